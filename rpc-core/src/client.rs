//! [`Channel`]: the client side, a `tower::Service` that tonic-generated
//! clients take unchanged; [`ChannelBuilder`] (alias [`Endpoint`]): tonic's
//! `Endpoint` options. Balanced channels are in `crate::balance`.

use crate::body::RecvBody;
use crate::conn::Connection;
use crate::endpoint::ChannelBuilder;
use crate::endpoint::Reprobe;
use crate::session::{self, CallGuard, Inbound, Shared};
use crate::tcp::{deadline_status, CallCancel, ClientResponseBody};
use crate::{timeout, ConnInfo, Error, SessionConfig, Transport, TransportInfo, TransportKind};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt};
use http_body_util::BodyExt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tonic::body::Body;
use tonic::{Code, Status};
use tower::ServiceExt;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
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
    Arc<dyn Fn() -> BoxFuture<'static, Result<Arc<Shared>, Status>> + Send + Sync>;

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
                tokio::spawn(reprobe_rdma(Arc::downgrade(self), b.clone(), r));
            }
        }
        Ok(())
    }
}

/// An `Auto` channel that fell back to TCP tries RDMA again in the background
/// (`docs/architecture.md`, "Re-probing RDMA"): after `initial`, then doubling
/// up to `max`, until it succeeds or the channel is dropped. New calls then go
/// over RDMA; calls in flight on TCP finish there.
async fn reprobe_rdma(core: Weak<Core>, b: ChannelBuilder, r: Reprobe) {
    let mut delay = r.initial;
    let mut attempts = 0u32;
    loop {
        tokio::time::sleep(delay).await;
        let Some(core) = core.upgrade() else { return };
        attempts += 1;
        let tcp = core.current();
        match b.rdma_or_discovered(tcp.as_ref()).await {
            Ok(inner) => {
                let before = core.info();
                core.install(inner, TransportInfo::of(TransportKind::Rdma, None));
                tracing::info!(
                    addr = %b.addr,
                    attempts,
                    was = %before,
                    "RDMA re-probe succeeded: new calls go over RDMA (calls in flight on TCP finish there)"
                );
                return;
            }
            Err(e) => {
                tracing::debug!(addr = %b.addr, attempts, reason = %e.fallback_reason(), next_in = ?delay.saturating_mul(2).min(r.max), "RDMA re-probe failed; staying on TCP");
                let reason = e.fallback_reason();
                {
                    let mut a = core.active.write().unwrap_or_else(|e| e.into_inner());
                    if a.info.kind == TransportKind::Tcp {
                        a.info.fallback_reason = Some(reason);
                    }
                }
                delay = delay.saturating_mul(2).min(r.max);
            }
        }
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

impl MsgChannel {
    /// A call slot on the live session, if one is free right now (no waiting).
    fn try_reserve(&self) -> Option<Slot> {
        let guard = self.session.try_lock().ok()?;
        let s = guard.as_ref().filter(|s| !s.is_unusable())?;
        let permit = s.call_permits.clone().try_acquire_owned().ok()?;
        Some((s.clone(), permit))
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
        let s = connector().await?;
        *guard = Some(s.clone());
        Ok(s)
    }
}

impl ChannelBuilder {
    /// Connects according to the transport policy (as tonic's
    /// `Endpoint::connect`): RDMA where there is RDMA, else HTTP/2 on TCP,
    /// saying why ([`Channel::transport`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] for a bad target, [`Error::Tls`] for an
    /// `https://` target without [`tls_config`](Self::tls_config) (or the
    /// reverse), [`Error::Connect`] when no transport reaches the server,
    /// [`Error::RdmaUnavailable`] under [`Transport::RdmaOnly`].
    pub async fn connect(&self) -> Result<Channel, Error> {
        self.check_target()?;
        let core = Core::new(Some(self.clone()), false);
        core.ensure_connected().await?;
        Ok(self.clone().wrap(core))
    }

    /// A channel that connects on its first call (as tonic's
    /// `Endpoint::connect_lazy`): a call while the server cannot be reached
    /// fails `UNAVAILABLE`, and the next one tries again. Needs a Tokio runtime
    /// when the builder has limits (their buffer's task is spawned here).
    pub fn connect_lazy(&self) -> Channel {
        let core = Core::new(Some(self.clone()), false);
        self.clone().wrap(core)
    }

    /// A channel over HTTP/2 on the IO that `connector` returns for the
    /// endpoint's URI (as tonic's `Endpoint::connect_with_connector`, e.g. an
    /// in-process `tokio::io::duplex` pair for tests, or a Unix socket). It
    /// is tonic's channel with this endpoint's HTTP/2 options, limits and
    /// timeout; it never uses RDMA ([`Channel::transport`] says `tcp`).
    ///
    /// # Errors
    ///
    /// [`Error::Connect`] if the connector or the HTTP/2 handshake fails.
    pub async fn connect_with_connector<C>(&self, connector: C) -> Result<Channel, Error>
    where
        C: tower::Service<http::Uri> + Send + 'static,
        C::Response: hyper::rt::Read + hyper::rt::Write + Send + Unpin,
        C::Future: Send,
        BoxError: From<C::Error> + Send,
    {
        let ch = self
            .tcp_endpoint()
            .connect_with_connector(connector)
            .await
            .map_err(|e| Error::Connect {
                transport: TransportKind::Tcp,
                addr: self.addr.clone(),
                detail: error_chain(&e),
            })?;
        Ok(self.over_tcp(ch))
    }

    /// As [`connect_with_connector`](Self::connect_with_connector), connecting
    /// on the first call (as tonic's `Endpoint::connect_with_connector_lazy`).
    pub fn connect_with_connector_lazy<C>(&self, connector: C) -> Channel
    where
        C: tower::Service<http::Uri> + Send + 'static,
        C::Response: hyper::rt::Read + hyper::rt::Write + Send + Unpin,
        C::Future: Send,
        BoxError: From<C::Error> + Send,
    {
        let ch = self.tcp_endpoint().connect_with_connector_lazy(connector);
        self.over_tcp(ch)
    }

    /// A channel over an established tonic channel, with this builder's limits.
    fn over_tcp(&self, ch: tonic::transport::Channel) -> Channel {
        let core = Core::connected(Inner::Tcp(ch), TransportInfo::of(TransportKind::Tcp, None));
        self.clone().wrap(core)
    }

    /// tonic's endpoint for the TCP side, with the connect timeout.
    pub(crate) fn tcp_endpoint(&self) -> tonic::transport::Endpoint {
        self.tcp.clone().connect_timeout(self.connect_timeout)
    }

    /// The target parses, and TLS and the scheme agree.
    fn check_target(&self) -> Result<(), Error> {
        let t = self.target()?;
        if t.https && !self.tls {
            return Err(Error::Tls(format!(
                "{}: an https:// target needs tls_config(ClientTlsConfig) (and rpc-core's `tls` feature)",
                self.addr
            )));
        }
        if self.tls && !t.https {
            return Err(Error::Tls(format!(
                "{}: tls_config is set but the target is not https://; use https://host:port",
                self.addr
            )));
        }
        Ok(())
    }

    /// One endpoint of a balanced channel: lazy, and `Pending` while down.
    pub(crate) fn endpoint_service(
        self,
    ) -> (Arc<Core>, tower::util::BoxService<Req, Resp, BoxError>) {
        let core = Core::new(Some(self.clone()), true);
        let svc = self.limited(Direct::new(core.clone()));
        (core, svc)
    }

    /// `direct` behind the builder's concurrency and rate limits (tower's).
    fn limited(&self, direct: Direct) -> tower::util::BoxService<Req, Resp, BoxError> {
        let svc = tower::ServiceBuilder::new()
            .option_layer(
                self.concurrency_limit
                    .map(tower::limit::ConcurrencyLimitLayer::new),
            )
            .option_layer(
                self.rate_limit
                    .map(|(n, per)| tower::limit::RateLimitLayer::new(n, per)),
            )
            .service(direct);
        tower::util::BoxService::new(svc)
    }

    fn wrap(self, core: Arc<Core>) -> Channel {
        let direct = Direct::new(core.clone());
        if self.concurrency_limit.is_none() && self.rate_limit.is_none() {
            return Channel {
                svc: Svc::Direct(direct),
            };
        }
        let size = self.buffer_size;
        Channel::buffered(self.limited(direct), Arc::new(move || core.info()), size)
    }

    /// Connects with the policy: the transport, what to report, and whether
    /// to re-probe RDMA in the background (an `Auto` channel on TCP).
    async fn connect_inner(&self) -> Result<(Inner, TransportInfo, bool), Error> {
        self.check_target()?;
        let policy = match self.transport {
            Some(t) => t,
            None => Transport::from_env()?,
        };
        if self.tls && policy != Transport::TcpOnly {
            // TLS first: RDMA is admitted only with a ticket got over it
            // (docs/wire-protocol-rdma.md §2.4).
            let tcp = self.connect_tcp().await?;
            return match self.rdma_or_discovered(Some(&tcp)).await {
                Ok(rdma) => Ok((rdma, TransportInfo::of(TransportKind::Rdma, None), false)),
                Err(e) if policy == Transport::RdmaOnly => Err(e),
                Err(e) => {
                    let reason = e.fallback_reason();
                    tracing::info!(addr = %self.addr, %reason, "RDMA unavailable, staying on TLS over TCP");
                    Ok((
                        tcp,
                        TransportInfo::of(TransportKind::Tcp, Some(reason)),
                        true,
                    ))
                }
            };
        }
        match policy {
            Transport::TcpOnly => Ok((
                self.connect_tcp().await?,
                TransportInfo::of(TransportKind::Tcp, None),
                false,
            )),
            Transport::RdmaOnly => Ok((
                self.rdma_or_discovered(None).await?,
                TransportInfo::of(TransportKind::Rdma, None),
                false,
            )),
            Transport::Auto => match crate::rdma::connect_channel(self, None).await {
                Ok(c) => Ok((c, TransportInfo::of(TransportKind::Rdma, None), false)),
                Err(e) => {
                    let tcp = self.connect_tcp().await?;
                    // The server may listen for RDMA on another port (iWARP, §3).
                    let e = match self.rdma_discovered(&tcp, e).await {
                        Ok(rdma) => {
                            return Ok((rdma, TransportInfo::of(TransportKind::Rdma, None), false))
                        }
                        Err(e) => e,
                    };
                    let reason = e.fallback_reason();
                    tracing::info!(addr = %self.addr, %reason, "RDMA unavailable, falling back to TCP");
                    Ok((
                        tcp,
                        TransportInfo::of(TransportKind::Tcp, Some(reason)),
                        true,
                    ))
                }
            },
        }
    }

    /// RDMA at the target's port, else at the port its TCP side announces
    /// (`docs/wire-protocol.md` §3), asked over `tcp` or a short-lived
    /// connection.
    pub(crate) async fn rdma_or_discovered(&self, tcp: Option<&Inner>) -> Result<Inner, Error> {
        let tls = tcp.filter(|_| self.tls);
        let e = match crate::rdma::connect_channel(self, tls).await {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        match tcp {
            Some(tcp) => self.rdma_discovered(tcp, e).await,
            None => {
                if !has_rdma_device() {
                    return Err(e);
                }
                match self.connect_tcp().await {
                    Ok(tcp) => self.rdma_discovered(&tcp, e).await,
                    Err(_) => Err(e),
                }
            }
        }
    }

    /// After RDMA failed at the target's port with `first`: asks the server
    /// over `tcp` for its RDMA port and, if it is another one, connects there.
    /// Errors: `first`, or the failure at the announced port.
    async fn rdma_discovered(&self, tcp: &Inner, first: Error) -> Result<Inner, Error> {
        let Inner::Tcp(ch) = tcp else {
            return Err(first);
        };
        if !has_rdma_device() {
            return Err(first);
        }
        let target_port = self
            .host_port()
            .ok()
            .and_then(|h| h.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()));
        match crate::discovery::query(ch).await {
            Ok(Some(port)) if Some(port) != target_port => {
                tracing::debug!(addr = %self.addr, port, "the server announces RDMA on another port");
                crate::rdma::connect_channel_at(self, Some(port), Some(tcp).filter(|_| self.tls))
                    .await
                    .map_err(|e| {
                        Error::RdmaUnavailable(format!(
                            "{} (the server's RDMA listener is on port {port})",
                            e.fallback_reason()
                        ))
                    })
            }
            Ok(_) => Err(first),
            Err(why) => {
                tracing::debug!(addr = %self.addr, %why, "RDMA endpoint query failed");
                Err(first)
            }
        }
    }

    pub(crate) async fn connect_tcp(&self) -> Result<Inner, Error> {
        self.check_target()?;
        let ch = self
            .tcp_endpoint()
            .connect()
            .await
            .map_err(|e| Error::Connect {
                transport: TransportKind::Tcp,
                addr: self.addr.clone(),
                detail: error_chain(&e),
            })?;
        Ok(Inner::Tcp(ch))
    }
}

fn has_rdma_device() -> bool {
    rdma_transport::devices().is_ok_and(|d| !d.is_empty())
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
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
            svc: Svc::Direct(Direct::new(Core::connected(
                msg_inner(shared, None, crate::endpoint::default_user_agent()),
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
        }
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
            crate::layers::cap_grpc_timeout(req.headers_mut(), t);
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

/// A call on tonic's HTTP/2 channel (after its `poll_ready`).
fn tcp_call(c: &mut tonic::transport::Channel, req: Req) -> RespFuture {
    let timeout = req
        .headers()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(timeout::parse);
    // The deadline covers the whole call from now, the response stream included.
    let deadline = timeout.map(|t| (tokio::time::Instant::now() + t, t));
    // Abandoning the call (dropping this future or the response
    // body, or the deadline) resets its HTTP/2 stream even while
    // the request stream is open: see `crate::tcp`.
    let (cancel, req) = {
        let (parts, body) = req.into_parts();
        let (cancel, body) = CallCancel::new(body);
        (cancel, http::Request::from_parts(parts, body))
    };
    let fut = tower::Service::call(c, req);
    Box::pin(async move {
        match fut.await {
            Ok(r) => Ok(match timeout {
                // tonic's HTTP/2 server answers an expired grpc-timeout with
                // CANCELLED "Timeout expired"; report it as gRPC specifies.
                Some(t) if is_tonic_timeout_response(&r) => trailers_only(deadline_status(t)),
                _ => r.map(|b| Body::new(ClientResponseBody::new(b, deadline, cancel))),
            }),
            // tonic's HTTP/2 channel reports an expired grpc-timeout as a
            // transport error (Cancelled); gRPC says DEADLINE_EXCEEDED,
            // as the message transports report it.
            Err(e) if is_timeout(&e) => {
                Ok(trailers_only(deadline_status(timeout.unwrap_or_default())))
            }
            // A connection that fails or closes under a call is
            // UNAVAILABLE in gRPC's terms, as on the message transports
            // (tonic alone reports some of these as CANCELLED or UNKNOWN);
            // an error of this call's stream only is not a connection's.
            Err(e) => Ok(trailers_only(stream_reset_status(&e).unwrap_or_else(
                || Status::unavailable(format!("tcp connection failed: {}", error_chain(&e))),
            ))),
        }
    })
}

fn is_tonic_timeout_response(r: &http::Response<Body>) -> bool {
    let h = r.headers();
    h.get("grpc-status").is_some_and(|v| v == "1")
        && h.get("grpc-message")
            .is_some_and(|v| v == "Timeout expired" || v == "Timeout%20expired")
}

/// An HTTP/2 error that reset only this call's stream, not the connection
/// (e.g. response headers over this side's `SETTINGS_MAX_HEADER_LIST_SIZE`):
/// its status per gRPC's `PROTOCOL-HTTP2.md` ("Errors": RST_STREAM codes).
fn stream_reset_status(e: &(dyn std::error::Error + 'static)) -> Option<Status> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<h2::Error>() {
            if !h.is_reset() {
                return None;
            }
            let reason = h.reason()?;
            let code = match reason {
                h2::Reason::REFUSED_STREAM => Code::Unavailable,
                h2::Reason::CANCEL => Code::Cancelled,
                h2::Reason::ENHANCE_YOUR_CALM => Code::ResourceExhausted,
                h2::Reason::INADEQUATE_SECURITY => Code::PermissionDenied,
                _ => Code::Internal,
            };
            let by = if h.is_remote() {
                "the server"
            } else {
                "this client"
            };
            return Some(Status::new(
                code,
                format!(
                    "the HTTP/2 stream of this call was reset by {by} ({reason:?}); \
                     the connection and other calls carry on: {}",
                    error_chain(e)
                ),
            ));
        }
        cur = err.source();
    }
    None
}

fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<tonic::TimeoutExpired>() {
            return true;
        }
        cur = err.source();
    }
    false
}

/// A call that failed before its response: tonic's client takes the `Status`
/// back as it is (`Status::from_error` downcasts it), its `source()` included
/// (e.g. the [`PeerMisbehaved`](crate::PeerMisbehaved) that closed the connection).
fn status_error(status: Status) -> BoxError {
    Box::new(status)
}

/// A response carrying only a status, as gRPC's "Trailers-Only".
fn trailers_only(status: Status) -> http::Response<Body> {
    status.into_http()
}

/// Header names that belong to HTTP/2 framing, not to gRPC metadata.
fn is_transport_header(name: &http::HeaderName) -> bool {
    matches!(
        name.as_str(),
        "te" | "connection" | "content-length" | "host" | "grpc-timeout" | "transfer-encoding"
    )
}

async fn msg_call(
    chan: Arc<MsgChannel>,
    slot: Option<Slot>,
    req: http::Request<Body>,
) -> Result<http::Response<Body>, Status> {
    let (parts, mut body) = req.into_parts();
    let uri = parts.uri;
    let path = uri.path();
    let timeout = parts
        .headers
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(timeout::parse);
    let mut md = parts.headers;
    // A few entries at most: no list of the names to remove (an allocation
    // per call, since tonic always sets `te`).
    while let Some(n) = md.keys().find(|k| is_transport_header(k)).cloned() {
        md.remove(n);
    }
    if !md.contains_key(http::header::USER_AGENT) {
        md.insert(http::header::USER_AGENT, chan.user_agent.clone());
    }
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let work = async {
        let (shared, permit) = match slot {
            // Reserved by `poll_ready` (a slot on a session that was live then;
            // if it closed since, OPEN fails below with its status).
            Some(slot) => slot,
            None => {
                let shared = chan.session().await?;
                let permit = shared
                    .call_permits
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| shared.closed_status())?;
                (shared, permit)
            }
        };
        let limit = shared.peer.max_metadata_bytes as usize;
        if let Err(e) = crate::frame::check_metadata(&md, limit) {
            return Err(Status::resource_exhausted(format!(
                "request metadata not sent: {e} (the server's max_metadata_bytes)"
            )));
        }
        let remaining = deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
        // Take what the request body has ready now: a unary request is one
        // message and then the end, so it needs no pump task, and OPEN plus its
        // DATA(END_STREAM) leave together (one BATCH message, §1.7).
        let mut ready: Vec<Bytes> = Vec::new();
        let mut end = http_body::Body::is_end_stream(&body);
        while !end && ready.len() < 8 {
            match body.frame().now_or_never() {
                Some(Some(Ok(f))) => {
                    if let Ok(d) = f.into_data() {
                        ready.push(d);
                    }
                    end = http_body::Body::is_end_stream(&body);
                }
                Some(None) => end = true,
                Some(Some(Err(e))) => {
                    return Err(Status::internal(format!("request body failed: {e}")))
                }
                None => break,
            }
        }
        let open_ends = end && ready.is_empty();
        let (stream, mut rx, window) = shared.open_stream(|id| {
            // Checked against `limit` just above: cannot fail here.
            crate::frame::encode_open(id, path, remaining, &md, open_ends, limit)
                .unwrap_or_default()
        })?;
        let mut guard = CallGuard {
            shared: shared.clone(),
            stream,
            done: false,
            _permit: Some(permit),
            timer: None,
        };
        if let Some(d) = deadline {
            let s = shared.clone();
            let t = tokio::spawn(async move {
                tokio::time::sleep_until(d).await;
                s.reset_stream(stream, deadline_status(timeout.unwrap_or_default()));
            });
            guard.timer = Some(t.abort_handle());
        }
        if end {
            let n = ready.len();
            for (i, d) in ready.into_iter().enumerate() {
                // If the call ended early (the server answered, or reset it), the
                // answer is in `rx`: read it below rather than report the send.
                if shared
                    .send_body(stream, &window, d, i + 1 == n)
                    .await
                    .is_err()
                {
                    break;
                }
            }
        } else {
            let s = shared.clone();
            let w = window.clone();
            // The pump ends when the body ends or the call closes (window closed).
            tokio::spawn(async move {
                let pump = async {
                    for d in ready {
                        s.send_body(stream, &w, d, false).await?;
                    }
                    loop {
                        match body.frame().await {
                            Some(Ok(f)) => {
                                if let Ok(data) = f.into_data() {
                                    let last = http_body::Body::is_end_stream(&body);
                                    s.send_body(stream, &w, data, last).await?;
                                    if last {
                                        return Ok(());
                                    }
                                }
                            }
                            Some(Err(e)) => {
                                let st = Status::internal(format!("request body failed: {e}"));
                                s.reset_stream(stream, st.clone());
                                return Err(st);
                            }
                            None => return s.send_body(stream, &w, Bytes::new(), true).await,
                        }
                    }
                };
                tokio::select! {
                    _ = pump => {}
                    _ = w.wait_closed() => {}
                }
            });
        }
        let keepalive: Arc<dyn std::any::Any + Send + Sync> = chan.clone();
        match rx.recv().await {
            Some(Inbound::Headers(h)) => {
                let mut resp = http::Response::new(Body::new(RecvBody::new(
                    rx,
                    shared.clone(),
                    stream,
                    Some(guard),
                    Some(keepalive),
                )));
                *resp.headers_mut() = h;
                resp.extensions_mut().insert(shared.info.clone());
                Ok(resp)
            }
            Some(Inbound::Trailers(t)) => {
                guard.done = true;
                let mut resp = http::Response::new(Body::empty());
                *resp.headers_mut() = t;
                Ok(resp)
            }
            Some(Inbound::Reset(s)) => {
                guard.done = true;
                Err(s)
            }
            Some(other) => {
                guard.done = true;
                let st = Status::internal(format!("protocol error: response began with {other:?}"));
                shared.reset_stream(stream, st.clone());
                Err(st)
            }
            None => {
                guard.done = true;
                Err(shared.closed_status())
            }
        }
    };
    match deadline {
        Some(d) => match tokio::time::timeout_at(d, work).await {
            Ok(r) => r,
            Err(_) => Err(deadline_status(timeout.unwrap_or_default())),
        },
        None => work.await,
    }
}
