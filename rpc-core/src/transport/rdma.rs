//! RDMA below the call protocol: the [`Connection`] over rdma-transport,
//! the call layer's transport settings, why RDMA is unavailable (typed
//! [`FallbackReason`]s), address resolution, and the rdma_cm listener's bind
//! (gated by tickets on a TLS server). The client's RDMA connector is in
//! `crate::client::select`, the server's accept loop in `crate::server::rdma`.

use crate::conn::{Connection, FrameReceiver, FrameSender};
use crate::transport::ticket::TicketStore;
use crate::{Error, FallbackReason};
use bytes::Bytes;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Once};

/// An established rdma-transport connection as a call-protocol [`Connection`].
pub struct RdmaConnection(pub(crate) rdma_transport::Connection);

impl RdmaConnection {
    /// Wraps an established rdma-transport connection (for tests driving a
    /// raw peer; reached through `rpc_core::__private`).
    pub fn new(c: rdma_transport::Connection) -> RdmaConnection {
        RdmaConnection(c)
    }
}

/// Sending half of an [`RdmaConnection`].
pub struct RdmaSender(rdma_transport::SendHalf);

/// Receiving half of an [`RdmaConnection`].
pub struct RdmaReceiver(rdma_transport::RecvHalf);

impl Connection for RdmaConnection {
    type Sender = RdmaSender;
    type Receiver = RdmaReceiver;
    fn split(self) -> (RdmaSender, RdmaReceiver) {
        let (s, r) = self.0.split();
        (RdmaSender(s), RdmaReceiver(r))
    }
}

/// rdma-transport's one mapping to `io::Error` (its `From` impl: the kind
/// says what happened, e.g. `OutOfMemory` for the registration cap, which
/// the session reports as `RESOURCE_EXHAUSTED`; the error is the source).
fn to_io(e: rdma_transport::Error) -> io::Error {
    io::Error::from(e)
}

impl FrameSender for RdmaSender {
    fn max_frame_len(&self) -> usize {
        self.0.max_message_len()
    }
    async fn send(&mut self, frame: Bytes) -> io::Result<()> {
        self.0.send(frame).await.map_err(to_io)
    }
    async fn send_parts(&mut self, head: Bytes, body: Bytes) -> io::Result<()> {
        self.0.send_parts(head, body).await.map_err(to_io)
    }
    fn frame_granule(&self) -> usize {
        self.0.chunk_len()
    }
    /// Posts from the calling task only while the connection is quiet
    /// (`SendHalf::try_send_parts`); under load the frame goes to the
    /// session's writer, which batches what queued meanwhile.
    fn try_send(&mut self, frame: Bytes) -> Result<io::Result<()>, Bytes> {
        match self.0.try_send_parts(Bytes::new(), frame) {
            Ok(r) => Ok(r.map_err(to_io)),
            Err((_, frame)) => Err(frame),
        }
    }
    fn try_send_parts(
        &mut self,
        head: Bytes,
        body: Bytes,
    ) -> Result<io::Result<()>, (Bytes, Bytes)> {
        self.0.try_send_parts(head, body).map(|r| r.map_err(to_io))
    }
    async fn close(&mut self) {
        self.0.close().await
    }
}

impl FrameReceiver for RdmaReceiver {
    async fn recv(&mut self) -> io::Result<Option<Bytes>> {
        self.0.recv().await.map_err(to_io)
    }
    fn deliver_inline(
        self,
        mut f: crate::conn::InlineFn,
    ) -> Result<crate::conn::StopFn, (Self, crate::conn::InlineFn)> {
        let stop = self
            .0
            .deliver_inline(Box::new(move |r| f(r.map_err(to_io))));
        Ok(Box::new(move || stop.stop()))
    }
}

/// Largest call-protocol frame carried as one RDMA message (both directions).
///
/// The call layer never sends frames near this size (DATA frames are at most
/// `SessionConfig::max_data_frame`, 1 MiB by default; metadata frames are
/// bounded by `max_metadata_bytes`), so this only bounds what a misbehaving
/// peer can make the transport reassemble on one connection before the call
/// layer's windows see it. A larger message closes the connection.
pub const MAX_RDMA_FRAME: usize = 16 << 20;

/// The rdma-transport configuration of the call layer's connections.
pub(crate) fn transport_config() -> rdma_transport::Config {
    rdma_transport::Config {
        max_message_bytes: MAX_RDMA_FRAME,
        ..rdma_transport::Config::default()
    }
}

/// Why this host has no RDMA device to use: the RDMA libraries are not
/// installed (`RDMA libraries not installed (libibverbs.so.1: ...)`), or
/// there is simply no device.
pub(crate) fn no_device_reason() -> FallbackReason {
    match rdma_transport::check_libraries() {
        Err(e) => FallbackReason::LibrariesMissing(e.to_string()),
        Ok(()) => FallbackReason::NoDevice,
    }
}

/// Why RDMA could not be used: the transport's error, typed for the
/// fallback reason (its text is what an operator acts on).
pub(crate) fn reason(addr: SocketAddr, e: &rdma_transport::Error) -> FallbackReason {
    use rdma_transport::Error as E;
    let detail = e.to_string();
    match e {
        E::NoDevice(_) => FallbackReason::NoDevice,
        E::LibraryUnavailable(_) => FallbackReason::LibrariesMissing(detail),
        E::AddrResolve { .. } | E::RouteResolve { .. } => {
            FallbackReason::Unreachable { addr, detail }
        }
        E::Rejected { .. } | E::Unreachable { .. } => FallbackReason::Refused { addr, detail },
        E::Timeout { stage } => FallbackReason::Timeout {
            addr,
            stage: stage.to_string(),
        },
        _ => FallbackReason::Failed { addr, detail },
    }
}

static NO_DEVICE_LOGGED: Once = Once::new();

/// Binds the server's RDMA listener on `addr`, if this host has an RDMA
/// device for it (else `None`, logged once). With `tickets` (a TLS server),
/// only connect requests presenting a live ticket are admitted.
pub(crate) async fn bind_listener(
    addr: SocketAddr,
    cfg: rdma_transport::Config,
    tickets: Option<Arc<TicketStore>>,
) -> Option<rdma_transport::Listener> {
    match rdma_transport::devices() {
        Ok(d) if !d.is_empty() => {}
        Ok(_) => {
            NO_DEVICE_LOGGED
                .call_once(|| tracing::info!("{}: serving gRPC over TCP only", no_device_reason()));
            return None;
        }
        Err(e) => {
            NO_DEVICE_LOGGED
                .call_once(|| tracing::info!("RDMA unavailable ({e}): serving gRPC over TCP only"));
            return None;
        }
    }
    let bound = match tickets {
        None => rdma_transport::Listener::bind(addr, cfg).await,
        Some(t) => {
            let gate: rdma_transport::AdmitGate =
                Arc::new(move |r: &rdma_transport::AdmitRequest| {
                    t.claim(r.ticket.as_ref(), std::time::Instant::now())
                        .map_err(str::to_string)
                });
            rdma_transport::Listener::bind_gated(addr, cfg, gate).await
        }
    };
    match bound {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::warn!(%addr, "no RDMA listener ({e}): serving gRPC over TCP only");
            None
        }
    }
}

pub(crate) async fn resolve(addr: &str) -> Result<SocketAddr, Error> {
    let hostport = addr
        .split("://")
        .last()
        .unwrap_or(addr)
        .trim_end_matches('/');
    let mut addrs = tokio::net::lookup_host(hostport)
        .await
        .map_err(|e| Error::InvalidAddress(format!("{addr}: {e}")))?
        .collect::<Vec<_>>();
    addrs.sort_by_key(|a| !a.is_ipv4()); // rdma_cm over RoCE v2 is most often IPv4
    addrs
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidAddress(format!("{addr}: no address found")))
}
