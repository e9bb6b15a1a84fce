//! The client side. This module owns [`Channel`], the `tower::Service`
//! tonic-generated clients take unchanged, and what its clones share (the
//! transport in use, which can change, and each clone's reservation).
//! [`endpoint`] is the builder (tonic's `Endpoint`), [`select`] picks the
//! transport (RDMA, TCP fallback, re-probing, the RDMA connector), [`call`]
//! carries one call over a message connection or tonic's HTTP/2 channel, and
//! [`balance`] balances over several endpoints.

pub(crate) mod balance;
pub(crate) mod call;
pub(crate) mod endpoint;
pub(crate) mod generated;
pub(crate) mod select;

pub use endpoint::{ChannelBuilder, Endpoint};

use crate::conn::Connection;
use crate::error::BoxError;
use crate::protocol::session::{self, Shared};
use crate::{ConnInfo, Error, SessionConfig, TransportInfo, TransportKind};
use call::{msg_call, status_error, tcp_call};
use futures::future::{BoxFuture, FutureExt};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tonic::body::Body;
use tonic::Status;
use tower::ServiceExt;

pub(crate) type Req = http::Request<Body>;
pub(crate) type Resp = http::Response<Body>;
pub(crate) type RespFuture = BoxFuture<'static, Result<Resp, BoxError>>;
/// What a layered or balanced channel's `transport()` reports.
pub(crate) type InfoFn = Arc<dyn Fn() -> TransportInfo + Send + Sync>;

/// Buffer between a shared service (limits, balancer) and the channel's
/// clones, as tonic's (its `DEFAULT_BUFFER_SIZE`).
pub(crate) const BUFFER_SIZE: usize = 1024;

/// Opens a new session for a message channel (used to reconnect).
pub(crate) type Connector =
    Arc<dyn Fn() -> BoxFuture<'static, Result<Arc<Shared>, Error>> + Send + Sync>;

/// A client channel: to one server, or balanced over several
/// ([`Channel::balance_list`], [`Channel::balance_channel`]). Cheap to clone;
/// clones share the connection(s) and multiplex their calls over them.
///
/// As a `tower::Service`, `poll_ready` on an RDMA or in-memory channel
/// reserves one of the calls the server accepts at once on the connection
/// (its `max_concurrent_calls`): it is `Pending` while all are in use, so
/// tower's `Buffer`, `ConcurrencyLimit` and balancers see the back-pressure.
/// The reservation belongs to this clone (clones start without one) and is
/// released if this clone is dropped without `call`. On a TCP channel,
/// `poll_ready` is tonic's. A channel with a `concurrency_limit`, a
/// `rate_limit` or several endpoints is, as tonic's, a `tower::buffer::Buffer`
/// in front of the shared service.
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let channel = rpc_core::Channel::connect("127.0.0.1:50051").await?;
/// println!("transport: {}", channel.transport());
/// // let mut client = GreeterClient::new(channel);   // tonic-generated, unchanged
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Channel {
    svc: Svc,
    /// Clients compiled with `rpc_codegen` take the direct path over this
    /// channel's message connections ([`Channel::direct_path`]).
    direct_path: bool,
}

#[derive(Clone)]
enum Svc {
    Direct(Direct),
    Buffered {
        buf: tower::buffer::Buffer<Req, RespFuture>,
        info: InfoFn,
    },
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("transport", &self.transport().to_string())
            .finish()
    }
}

type Slot = (Arc<Shared>, OwnedSemaphorePermit);

/// Where a channel's `poll_ready` stands.
enum Ready {
    /// Nothing reserved.
    Idle,
    /// Lazy channel: connecting. In a `Mutex` (as `Waiting`) only so that
    /// `Channel` stays `Sync`; reached through `get_mut`.
    Connecting(std::sync::Mutex<BoxFuture<'static, Result<(), Status>>>),
    /// Waiting for the session (connecting) or for a free call slot.
    Waiting(std::sync::Mutex<BoxFuture<'static, Result<Slot, Status>>>),
    /// A slot is held for the next `call`.
    Reserved(Slot),
    /// An endpoint of a balanced channel whose server cannot be reached:
    /// `Pending` until the next attempt, so that the balancer picks others.
    Backoff(std::sync::Mutex<Pin<Box<tokio::time::Sleep>>>),
    /// No session could be had: the next `call` fails with this status (a
    /// failed call, not a failed service, as gRPC channels report it).
    Failed(Status),
}

#[derive(Clone)]
pub(crate) enum Inner {
    Tcp(tonic::transport::Channel),
    Msg(Arc<MsgChannel>),
}

impl Inner {
    /// The message channel of `inner`, if it is one (a clone of its `Arc`).
    fn msg(inner: &Option<Inner>) -> Option<Arc<MsgChannel>> {
        match inner {
            Some(Inner::Msg(m)) => Some(m.clone()),
            _ => None,
        }
    }
}

/// One endpoint's channel: the transport in use (which can change: a lazy
/// channel connects, an `Auto` channel that fell back moves to RDMA when a
/// re-probe succeeds) and this clone's reservation.
pub(crate) struct Direct {
    core: Arc<Core>,
    /// The generation of `core` that `inner` is from.
    gen: u64,
    inner: Option<Inner>,
    ready: Ready,
    /// Failed attempts in a row (balanced endpoints' back-off).
    down: u32,
}

impl Clone for Direct {
    fn clone(&self) -> Self {
        Direct {
            core: self.core.clone(),
            gen: self.gen,
            inner: self.inner.clone(),
            // A reservation is this clone's own (tower's contract).
            ready: Ready::Idle,
            down: 0,
        }
    }
}

/// What the clones of one endpoint's channel share.
pub(crate) struct Core {
    /// How to (re)connect; `None` for channels over a given connection.
    builder: Option<ChannelBuilder>,
    /// Bumped each time `active.inner` changes; read without the lock on
    /// every `poll_ready`.
    gen: AtomicU64,
    active: std::sync::RwLock<Active>,
    connecting: tokio::sync::Mutex<()>,
    /// A balanced endpoint: while its server cannot be reached, `poll_ready`
    /// is `Pending` (retrying with back-off) instead of failing calls.
    pending_when_down: bool,
}

struct Active {
    inner: Option<Inner>,
    info: TransportInfo,
    /// The TCP channel a re-probe moved away from: kept (idle) so that calls
    /// in flight on it finish.
    retired: Option<Inner>,
}

impl Core {
    fn new(builder: Option<ChannelBuilder>, pending_when_down: bool) -> Arc<Core> {
        let addr = builder.as_ref().map(|b| b.addr.clone()).unwrap_or_default();
        Arc::new(Core {
            builder,
            gen: AtomicU64::new(0),
            active: std::sync::RwLock::new(Active {
                inner: None,
                info: TransportInfo::not_connected(&addr),
                retired: None,
            }),
            connecting: tokio::sync::Mutex::new(()),
            pending_when_down,
        })
    }

    fn connected(inner: Inner, info: TransportInfo) -> Arc<Core> {
        let core = Core::new(None, false);
        core.install(inner, info);
        core
    }

    pub(crate) fn info(&self) -> TransportInfo {
        self.active
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .info
            .clone()
    }

    fn install(&self, inner: Inner, info: TransportInfo) {
        let mut a = self.active.write().unwrap_or_else(|e| e.into_inner());
        let old = a.inner.replace(inner);
        if let Some(old @ Inner::Tcp(_)) = old {
            a.retired = Some(old);
        }
        a.info = info;
        self.gen.fetch_add(1, Ordering::AcqRel);
    }

    fn current(&self) -> Option<Inner> {
        self.active
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .inner
            .clone()
    }

    /// [`current`](Self::current)'s message connection, if it is one,
    /// without cloning a TCP channel.
    fn current_msg(&self) -> Option<Arc<MsgChannel>> {
        Inner::msg(&self.active.read().unwrap_or_else(|e| e.into_inner()).inner)
    }

    /// Connects a lazy channel (once; concurrent callers wait for it).
    async fn ensure_connected(self: &Arc<Self>) -> Result<(), Error> {
        let _one = self.connecting.lock().await;
        if self.current().is_some() {
            return Ok(());
        }
        let Some(b) = &self.builder else {
            return Err(Error::Connect {
                transport: TransportKind::Memory,
                addr: String::new(),
                detail: "connection closed".into(),
            });
        };
        let (inner, info, reprobe) = b.connect_inner().await?;
        self.install(inner, info);
        if reprobe {
            if let Some(r) = b.reprobe {
                tokio::spawn(select::reprobe_rdma(Arc::downgrade(self), b.clone(), r));
            }
        }
        Ok(())
    }
}

pub(crate) struct MsgChannel {
    session: tokio::sync::Mutex<Option<Arc<Shared>>>,
    connector: Option<Connector>,
    /// Sent with each call that has none (tonic's HTTP/2 channel adds its own).
    user_agent: http::HeaderValue,
}

impl Drop for MsgChannel {
    fn drop(&mut self) {
        if let Some(s) = self.session.get_mut().take() {
            s.close_gracefully();
        }
    }
}

/// The connection a channel's remote-memory operations go over
/// (`crate::remote`).
pub(crate) enum RemoteTarget {
    /// tonic's HTTP/2 channel.
    Tcp,
    /// A message connection (RDMA or in-memory), with its details.
    Msg(crate::ConnInfo),
}

impl Channel {
    /// The connection this channel uses now, connecting a lazy channel.
    pub(crate) async fn remote_target(&self) -> Result<RemoteTarget, Status> {
        let Svc::Direct(d) = &self.svc else {
            return Err(Status::unimplemented(
                "remote memory needs a channel with one connection: a balanced channel, or one \
                 with a concurrency or rate limit, has none (use a channel to one endpoint)",
            ));
        };
        d.core.ensure_connected().await.map_err(Status::from)?;
        match d.core.current() {
            Some(Inner::Tcp(_)) => Ok(RemoteTarget::Tcp),
            Some(Inner::Msg(m)) => m.session().await.map(|s| RemoteTarget::Msg(s.info.clone())),
            None => Err(Status::unavailable("channel not connected")),
        }
    }
}

impl MsgChannel {
    /// A call slot on the live session, if one is free right now (no waiting).
    fn try_reserve(&self) -> Option<Slot> {
        let guard = self.session.try_lock().ok()?;
        let s = guard.as_ref().filter(|s| !s.is_unusable())?;
        let permit = s.call_permits.clone().try_acquire_owned().ok()?;
        Some((s.clone(), permit))
    }

    /// A call slot: `reserved` (by `poll_ready`) if given, else a free one
    /// now, else the session's next free one (connecting first if needed).
    async fn slot(&self, reserved: Option<Slot>) -> Result<Slot, Status> {
        if let Some(slot) = reserved.or_else(|| self.try_reserve()) {
            return Ok(slot);
        }
        let shared = self.session().await?;
        let permit = shared
            .call_permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| shared.closed_status())?;
        Ok((shared, permit))
    }

    async fn session(&self) -> Result<Arc<Shared>, Status> {
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.as_ref() {
            if !s.is_unusable() {
                return Ok(s.clone());
            }
        }
        let Some(connector) = &self.connector else {
            return Err(guard
                .as_ref()
                .map(|s| s.closed_status())
                .unwrap_or_else(|| Status::unavailable("connection closed")));
        };
        if let Some(old) = guard.take() {
            tracing::info!(reason = %old.closed_status().message(), "reconnecting");
        }
        let s = connector().await.map_err(Status::from)?;
        *guard = Some(s.clone());
        Ok(s)
    }
}

impl Channel {
    /// A builder for `uri` (as tonic's `Channel::builder`): `http://host:port`,
    /// `https://host:port`, or the authority form `host:port`.
    pub fn builder(uri: http::Uri) -> ChannelBuilder {
        ChannelBuilder::from(uri)
    }

    /// As [`ChannelBuilder::from_static`].
    pub fn from_static(s: &'static str) -> ChannelBuilder {
        ChannelBuilder::from_static(s)
    }

    /// As [`ChannelBuilder::from_shared`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] if `s` is not a target.
    pub fn from_shared(s: impl Into<bytes::Bytes>) -> Result<ChannelBuilder, Error> {
        ChannelBuilder::from_shared(s)
    }

    /// Connects to `addr` (`host:port`, `http://..`, `https://..`) with the
    /// default policy (RDMA first, TCP fallback).
    ///
    /// # Errors
    ///
    /// As [`ChannelBuilder::connect`].
    pub async fn connect(addr: impl std::fmt::Display) -> Result<Channel, Error> {
        ChannelBuilder::for_target(addr.to_string()).connect().await
    }

    /// A channel over an already established message connection (e.g. an
    /// in-memory pair). It does not reconnect.
    pub async fn from_connection<C: Connection>(
        conn: C,
        kind: TransportKind,
        config: SessionConfig,
    ) -> Result<Channel, Error> {
        let info = ConnInfo::new(kind, None);
        let shared = session::start(conn, info, config, None)
            .await
            .map_err(|s| Error::Handshake(s.message().to_string()))?;
        Ok(Channel {
            direct_path: true,
            svc: Svc::Direct(Direct::new(Core::connected(
                msg_inner(shared, None, crate::client::endpoint::default_user_agent()),
                TransportInfo::of(kind, None),
            ))),
        })
    }

    pub(crate) fn buffered(
        svc: tower::util::BoxService<Req, Resp, BoxError>,
        info: InfoFn,
        size: Option<usize>,
    ) -> Channel {
        let (buf, worker) = tower::buffer::Buffer::pair(svc, size.unwrap_or(BUFFER_SIZE).max(1));
        tokio::spawn(worker);
        Channel {
            svc: Svc::Buffered { buf, info },
            direct_path: true,
        }
    }

    /// Whether clients compiled with `rpc_codegen` take the direct path
    /// over this channel's message connections (RDMA, in-memory): the
    /// request encoded straight into the call's frames and the reply decoded
    /// from the received bytes, without tonic's client machinery
    /// (`docs/architecture.md`, "The direct path"). Default: `true`
    /// ([`ChannelBuilder::direct_path`]). `false` sends every call through
    /// tonic's client. The bytes on the wire, and what the caller sees, are
    /// the same either way; stock tonic clients always take tonic's path.
    #[must_use]
    pub fn direct_path(mut self, enable: bool) -> Channel {
        self.direct_path = enable;
        self
    }

    /// Which transport carries this channel's calls now, and why TCP if it
    /// fell back: a snapshot, since an `Auto` channel that fell back moves to
    /// RDMA when a background re-probe succeeds (see
    /// [`ChannelBuilder::rdma_reprobe`]). A balanced channel reports each
    /// endpoint's.
    pub fn transport(&self) -> TransportInfo {
        match &self.svc {
            Svc::Direct(d) => d.core.info(),
            Svc::Buffered { info, .. } => info(),
        }
    }
}

pub(crate) fn msg_inner(
    shared: Arc<Shared>,
    connector: Option<Connector>,
    user_agent: http::HeaderValue,
) -> Inner {
    Inner::Msg(Arc::new(MsgChannel {
        session: tokio::sync::Mutex::new(Some(shared)),
        connector,
        user_agent,
    }))
}

impl tower::Service<Req> for Channel {
    type Response = Resp;
    type Error = BoxError;
    type Future = RespFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match &mut self.svc {
            Svc::Direct(d) => tower::Service::<Req>::poll_ready(d, cx),
            Svc::Buffered { buf, .. } => buf.poll_ready(cx),
        }
    }

    fn call(&mut self, req: Req) -> Self::Future {
        match &mut self.svc {
            Svc::Direct(d) => tower::Service::<Req>::call(d, req),
            Svc::Buffered { buf, .. } => Box::pin(buf.call(req)),
        }
    }
}

impl Direct {
    pub(crate) fn new(core: Arc<Core>) -> Direct {
        let gen = core.gen.load(Ordering::Acquire);
        let inner = core.current();
        Direct {
            core,
            gen,
            inner,
            ready: Ready::Idle,
            down: 0,
        }
    }

    /// Picks up a transport change (lazy connect, re-probe, reconnect).
    /// The call slot `poll_ready` reserved, if any, for a call made
    /// another way (the direct path).
    pub(crate) fn take_reservation(&mut self) -> Option<Slot> {
        match std::mem::replace(&mut self.ready, Ready::Idle) {
            Ready::Reserved(slot) => Some(slot),
            other => {
                self.ready = other;
                None
            }
        }
    }

    /// The message connection in use now (as `refresh` would make it),
    /// without changing this clone; `None` over TCP or before connecting.
    /// Clones only the message channel's `Arc`: a TCP channel's clone
    /// allocates (tower's buffer handle), and a generated client asks this
    /// before every call.
    pub(crate) fn current_msg(&self) -> Option<Arc<MsgChannel>> {
        if self.core.gen.load(Ordering::Acquire) == self.gen {
            Inner::msg(&self.inner)
        } else {
            self.core.current_msg()
        }
    }

    fn refresh(&mut self) {
        let g = self.core.gen.load(Ordering::Acquire);
        if g != self.gen {
            self.inner = self.core.current();
            self.gen = g;
        }
    }

    /// No session could be had: fail the next call, or, for a balanced
    /// endpoint, wait (back-off) and try again.
    fn down(&mut self, st: Status) -> Ready {
        if !self.core.pending_when_down {
            return Ready::Failed(st);
        }
        let d = Duration::from_millis(50)
            .saturating_mul(1u32 << self.down.min(7))
            .min(Duration::from_secs(5));
        self.down += 1;
        tracing::debug!(status = %st.message(), retry_in = ?d, "balanced endpoint unreachable");
        Ready::Backoff(std::sync::Mutex::new(Box::pin(tokio::time::sleep(d))))
    }
}

impl tower::Service<Req> for Direct {
    type Response = Resp;
    type Error = BoxError;
    type Future = RespFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        loop {
            match &mut self.ready {
                Ready::Reserved((s, _)) if !s.is_unusable() => return Poll::Ready(Ok(())),
                // The connection closed under the reservation: reserve on the next one.
                Ready::Reserved(_) => self.ready = Ready::Idle,
                Ready::Failed(_) => return Poll::Ready(Ok(())),
                Ready::Backoff(sleep) => {
                    let sleep = sleep.get_mut().unwrap_or_else(|e| e.into_inner());
                    if std::future::Future::poll(sleep.as_mut(), cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.ready = Ready::Idle;
                }
                Ready::Connecting(f) => {
                    let f = f.get_mut().unwrap_or_else(|e| e.into_inner());
                    self.ready = match f.poll_unpin(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(())) => Ready::Idle,
                        Poll::Ready(Err(st)) => self.down(st),
                    };
                }
                Ready::Waiting(f) => {
                    let f = f.get_mut().unwrap_or_else(|e| e.into_inner());
                    self.ready = match f.poll_unpin(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(slot)) => {
                            self.down = 0;
                            Ready::Reserved(slot)
                        }
                        Poll::Ready(Err(st)) => self.down(st),
                    };
                }
                Ready::Idle => {
                    self.refresh();
                    match &mut self.inner {
                        None => {
                            let core = self.core.clone();
                            let f =
                                async move { core.ensure_connected().await.map_err(Status::from) };
                            self.ready = Ready::Connecting(std::sync::Mutex::new(Box::pin(f)));
                        }
                        Some(Inner::Tcp(c)) => {
                            return tower::Service::<Req>::poll_ready(c, cx).map_err(Into::into)
                        }
                        Some(Inner::Msg(chan)) => {
                            // Fast path: a live session with a free slot, no allocation.
                            if let Some(slot) = chan.try_reserve() {
                                self.down = 0;
                                self.ready = Ready::Reserved(slot);
                                continue;
                            }
                            let chan = chan.clone();
                            let wait = async move {
                                let s = chan.session().await?;
                                let permit = s
                                    .call_permits
                                    .clone()
                                    .acquire_owned()
                                    .await
                                    .map_err(|_| s.closed_status())?;
                                Ok((s, permit))
                            };
                            self.ready = Ready::Waiting(std::sync::Mutex::new(Box::pin(wait)));
                        }
                    }
                }
            }
        }
    }

    fn call(&mut self, mut req: Req) -> RespFuture {
        if let Some(t) = self.core.builder.as_ref().and_then(|b| b.timeout) {
            crate::protocol::timeout::cap_grpc_timeout(req.headers_mut(), t);
        }
        let slot = match std::mem::replace(&mut self.ready, Ready::Idle) {
            Ready::Reserved(slot) => Some(slot),
            Ready::Failed(st) => return Box::pin(async move { Err(status_error(st)) }),
            // `call` without `poll_ready`: the call waits for its slot itself.
            _ => None,
        };
        match &mut self.inner {
            Some(Inner::Tcp(c)) => tcp_call(c, req),
            Some(Inner::Msg(m)) => {
                let m = m.clone();
                Box::pin(async move { msg_call(m, slot, req).await.map_err(status_error) })
            }
            // A lazy channel called without `poll_ready`: connect first.
            None => {
                let core = self.core.clone();
                Box::pin(async move {
                    core.ensure_connected()
                        .await
                        .map_err(|e| status_error(Status::from(e)))?;
                    match core.current() {
                        Some(Inner::Tcp(mut c)) => {
                            ServiceExt::<Req>::ready(&mut c).await?;
                            tcp_call(&mut c, req).await
                        }
                        Some(Inner::Msg(m)) => msg_call(m, None, req).await.map_err(status_error),
                        None => Err(status_error(Status::unavailable("not connected"))),
                    }
                })
            }
        }
    }
}
