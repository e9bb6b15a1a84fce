//! Balanced channels: one [`Channel`] over several servers, as tonic's
//! `Channel::balance_list` / `balance_channel`. tower's power-of-two-choices
//! balancer (`tower::balance::p2c::Balance`) picks, for each call, the less
//! loaded (fewer calls in flight, `tower::load::PendingRequests`) of two ready
//! endpoints; endpoints come and go through a `tower::discover` stream of
//! [`Change`]s. Each endpoint is its own lazy channel choosing RDMA or TCP
//! on its own (and re-probing RDMA); while its server cannot be reached it
//! is not ready, so the balancer sends calls elsewhere. As tonic's, the
//! balancer sits behind a `tower::buffer::Buffer` so that the channel is
//! `Clone`. See `docs/architecture.md`, "Balanced channels".

use crate::client::endpoint::ChannelBuilder;
use crate::client::{BoxError, Core, Req, Resp};
use crate::{Channel, TransportInfo, TransportKind};
use futures::{Stream, StreamExt};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use tower::discover::Change;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::util::BoxService;

type EndpointSvc = PendingRequests<BoxService<Req, Resp, BoxError>>;

impl Channel {
    /// A channel balanced over `endpoints` (as tonic's `balance_list`), each
    /// connecting lazily on its own transport. Needs a Tokio runtime.
    pub fn balance_list(endpoints: impl IntoIterator<Item = ChannelBuilder>) -> Channel {
        let list: Vec<ChannelBuilder> = endpoints.into_iter().collect();
        let (channel, tx) = Channel::balance_channel::<usize>(list.len().max(1));
        for (i, e) in list.into_iter().enumerate() {
            // The capacity holds them all.
            let _ = tx.try_send(Change::Insert(i, e));
        }
        // Dropping the sender ends the stream: the list is final.
        channel
    }

    /// A balanced channel and the sender of its endpoint changes (as tonic's
    /// `balance_channel`): `Change::Insert(key, endpoint)` adds (or
    /// replaces) one, `Change::Remove(key)` removes one; calls in flight on a
    /// removed endpoint finish. `capacity` bounds the queued changes.
    pub fn balance_channel<K>(
        capacity: usize,
    ) -> (
        Channel,
        tokio::sync::mpsc::Sender<Change<K, ChannelBuilder>>,
    )
    where
        K: Hash + Eq + Clone + Send + Sync + 'static,
    {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        let changes =
            tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>);
        (Channel::balance_discover(changes), tx)
    }

    /// A channel balanced over the endpoints a `tower::discover` stream of
    /// [`Change`]s announces (e.g. from DNS or a service registry). An error
    /// of the stream fails the balancer (calls then fail `UNAVAILABLE`).
    pub fn balance_discover<K, D, E>(discover: D) -> Channel
    where
        K: Hash + Eq + Clone + Send + Sync + 'static,
        D: Stream<Item = Result<Change<K, ChannelBuilder>, E>> + Send + 'static,
        E: Into<BoxError> + 'static,
    {
        let registry: Registry<K> = Arc::new(Mutex::new(HashMap::new()));
        let reg = registry.clone();
        let services = discover.map(move |change| {
            let change = change.map_err(Into::into)?;
            let mut reg = reg.lock().unwrap_or_else(|e| e.into_inner());
            Ok::<_, BoxError>(match change {
                Change::Insert(k, endpoint) => {
                    let addr = endpoint.address().to_string();
                    let (core, svc) = endpoint.endpoint_service();
                    reg.insert(k.clone(), (addr, core));
                    let svc: EndpointSvc = PendingRequests::new(svc, CompleteOnResponse::default());
                    Change::Insert(k, svc)
                }
                Change::Remove(k) => {
                    reg.remove(&k);
                    Change::Remove(k)
                }
            })
        });
        let balance = tower::balance::p2c::Balance::new(Box::pin(services));
        let info = move || {
            let reg = registry.lock().unwrap_or_else(|e| e.into_inner());
            let mut endpoints: Vec<(String, TransportInfo)> =
                reg.values().map(|(a, c)| (a.clone(), c.info())).collect();
            endpoints.sort_by(|a, b| a.0.cmp(&b.0));
            TransportInfo {
                endpoints,
                ..TransportInfo::of(TransportKind::Balanced, None)
            }
        };
        Channel::buffered(BoxService::new(balance), Arc::new(info), None)
    }
}

type Registry<K> = Arc<Mutex<HashMap<K, (String, Arc<Core>)>>>;
