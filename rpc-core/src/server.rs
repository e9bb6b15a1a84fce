//! [`Server`]: hosts unchanged tonic-generated services over message
//! connections (RDMA, in-memory) and over HTTP/2 on TCP at the same address.

use crate::body::RecvBody;
use crate::client::BoxError;
use crate::conn::{self, Connection};
use crate::dispatch::Direct;
pub use crate::layers::HttpService;
use crate::layers::{DefaultTimeoutLayer, DynLayer, LayerFn};
use crate::session::{self, Acceptor, CallFuture, MisbehavedHook, OpenCall, Shared};
use crate::ticket::TicketStore;
use crate::{
    frame, timeout, Channel, ConnInfo, Error, PeerMisbehaved, SessionConfig, TransportKind,
};
use http_body_util::BodyExt;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::{Code, Status};
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

/// A `trace_fn`: a span for each call, from its request head.
pub(crate) type TraceFn = Arc<dyn Fn(&http::Request<()>) -> tracing::Span + Send + Sync>;

/// Server configuration; [`Server::builder`] (or `Server::default()`, the
/// same) starts one. It has tonic's `Server` surface with the same argument
/// types; the HTTP/2 side *is* a `tonic::transport::Server` and gets every
/// HTTP/2 and TCP option unchanged. Each option's docs say what it means on
/// RDMA connections ("TCP only": no counterpart there).
#[derive(Clone)]
pub struct Server {
    /// The HTTP/2 side: tonic's server with its options.
    tcp: tonic::transport::Server,
    /// `tls_config` was given: TCP is TLS only, RDMA needs a ticket.
    tls: bool,
    trace: Option<TraceFn>,
    max_connection_age: Option<Duration>,
    max_connection_age_grace: Option<Duration>,
    tcp_keepalive: (Option<Duration>, Option<Duration>, Option<u32>),
    max_concurrent_streams: Option<u32>,
    rdma_listen: Option<SocketAddr>,
    session: SessionConfig,
    /// Calls at once per connection, already clamped to `1..=u32::MAX`
    /// ([`calls_limit`]) so that every transport applies the same number.
    concurrency_limit: Option<u32>,
    tcp_nodelay: bool,
    tcp_only: bool,
    on_misbehaved: Option<MisbehavedHook>,
    timeout: Option<Duration>,
    layers: Option<LayerFn>,
    rdma_config: Option<rdma_transport::Config>,
    rdma_port: Option<u16>,
}

impl Default for Server {
    /// As [`Server::builder`].
    fn default() -> Server {
        Server {
            tcp: tonic::transport::Server::builder(),
            tls: false,
            trace: None,
            max_connection_age: None,
            max_connection_age_grace: None,
            tcp_keepalive: (None, None, None),
            max_concurrent_streams: None,
            rdma_listen: None,
            session: SessionConfig::default(),
            concurrency_limit: None,
            tcp_nodelay: true,
            tcp_only: false,
            on_misbehaved: None,
            timeout: None,
            layers: None,
            rdma_config: None,
            rdma_port: None,
        }
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("session", &self.session)
            .field("concurrency_limit", &self.concurrency_limit)
            .field("tcp_nodelay", &self.tcp_nodelay)
            .field("tcp_only", &self.tcp_only)
            .field("on_misbehaved", &self.on_misbehaved.is_some())
            .field("timeout", &self.timeout)
            .field("layers", &self.layers.is_some())
            .field("rdma_config", &self.rdma_config)
            .field("rdma_port", &self.rdma_port)
            .field("tls", &self.tls)
            .field("trace_fn", &self.trace.is_some())
            .field("max_connection_age", &self.max_connection_age)
            .field("max_connection_age_grace", &self.max_connection_age_grace)
            .field("tcp_keepalive", &self.tcp_keepalive)
            .field("max_concurrent_streams", &self.max_concurrent_streams)
            .field("rdma_listen", &self.rdma_listen)
            .finish()
    }
}

/// The one conversion of a user's per-connection call limit: at least 1 (a
/// limit of 0 would refuse every call), at most `u32::MAX` (HELLO's field,
/// §1.1), never truncated.
fn calls_limit(limit: usize) -> u32 {
    u32::try_from(limit.max(1)).unwrap_or(u32::MAX)
}

impl Server {
    /// A server with default limits (see [`SessionConfig`]).
    pub fn builder() -> Server {
        Server::default()
    }

    /// A deadline for every call that has none shorter (as tonic's
    /// `Server::timeout`), on every transport: the handler is dropped at the
    /// deadline and the call ends `DEADLINE_EXCEEDED`.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d);
        self
    }

    /// Wraps every call, on every transport, in a tower layer (as tonic's
    /// `Server::layer`; several calls stack, the first outermost). The layer
    /// wraps a [`HttpService`] and returns a service of the same request and
    /// response types whose errors become gRPC statuses (as tonic does):
    /// `tower::timeout::TimeoutLayer`, `tonic::service::InterceptorLayer`,
    /// `tower::layer::layer_fn(..)`... Message transports box each call once
    /// more when layers are set.
    pub fn layer<L, ResBody>(mut self, layer: L) -> Self
    where
        L: tower::Layer<HttpService> + Send + Sync + 'static,
        L::Service: Service<http::Request<Body>, Response = http::Response<ResBody>>
            + Clone
            + Send
            + Sync
            + 'static,
        <L::Service as Service<http::Request<Body>>>::Error: Into<BoxError>,
        <L::Service as Service<http::Request<Body>>>::Future: Send + 'static,
        ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let this: LayerFn = Arc::new(move |s: HttpService| {
            HttpService::new(
                layer
                    .layer(s)
                    .map_response(|r: http::Response<ResBody>| r.map(Body::new))
                    .map_err(Into::into),
            )
        });
        self.layers = Some(match self.layers.take() {
            None => this,
            // Earlier layers are outer (as tower's ServiceBuilder and tonic).
            Some(outer) => Arc::new(move |s| outer(this(s))),
        });
        self
    }

    /// rdma-transport's settings (buffer sizes, queue depths, limits on
    /// pending handshakes...) of the RDMA listener and its connections.
    /// Default: the transport's defaults with `max_message_bytes` = 16 MiB.
    pub fn rdma_config(mut self, c: rdma_transport::Config) -> Self {
        self.rdma_config = Some(c);
        self
    }

    /// The RDMA listener's port when it cannot share the TCP port (iWARP
    /// devices, `docs/wire-protocol.md` §3). Default: an ephemeral port. On
    /// RoCE and InfiniBand, RDMA always shares the TCP port.
    pub fn rdma_port(mut self, port: u16) -> Self {
        self.rdma_port = Some(port);
        self
    }

    /// Adds the service if `Some` (as tonic's `Server::add_optional_service`).
    pub fn add_optional_service<S>(&mut self, svc: Option<S>) -> Router
    where
        S: Service<http::Request<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.add_routes(Routes::default()).add_optional_service(svc)
    }

    /// Serves already built routes (as tonic's `Server::add_routes`).
    pub fn add_routes(&mut self, routes: Routes) -> Router {
        Router {
            server: self.clone(),
            routes,
            direct: Direct::default(),
        }
    }

    /// Calls handled at once per connection, on every transport (as tonic's
    /// option of the same name). Clients wait for a free slot.
    ///
    /// The limit is at least 1 and at most `u32::MAX` (larger values mean
    /// `u32::MAX`), the same on RDMA, in-memory and TCP connections.
    pub fn concurrency_limit_per_connection(mut self, limit: usize) -> Self {
        let limit = calls_limit(limit);
        self.concurrency_limit = Some(limit);
        self.apply_call_limit();
        self
    }

    /// The calls a message connection's client may open at once: the
    /// smaller of `concurrency_limit_per_connection` and `max_concurrent_streams`.
    fn apply_call_limit(&mut self) {
        let limits = [
            self.concurrency_limit,
            self.max_concurrent_streams.map(|m| m.max(1)),
        ];
        if let Some(l) = limits.into_iter().flatten().min() {
            self.session.max_concurrent_calls = l;
        }
    }

    /// Calls `hook` with each peer that violates the call protocol (on RDMA
    /// and in-memory connections), just before its connection is closed: for
    /// metrics, logs or tests. The hook runs on the connection's reader task
    /// and must not block.
    pub fn on_peer_misbehaved(
        mut self,
        hook: impl Fn(&ConnInfo, &PeerMisbehaved) + Send + Sync + 'static,
    ) -> Self {
        self.on_misbehaved = Some(std::sync::Arc::new(hook));
        self
    }

    /// Serve HTTP/2 on TCP only, without the RDMA listener (default: both).
    pub fn tcp_only(mut self, tcp_only: bool) -> Self {
        self.tcp_only = tcp_only;
        self
    }

    /// Call-protocol limits for message connections.
    pub fn session_config(mut self, c: SessionConfig) -> Self {
        self.session = c;
        self.apply_call_limit();
        self
    }

    /// TLS on the TCP side (tonic's `ServerTlsConfig`, as tonic's): HTTP/2
    /// is then served over TLS only, and the RDMA listener admits only
    /// clients that got a one-time ticket over an authenticated TLS
    /// connection (`docs/wire-protocol-rdma.md` §2.4); no queue pair is set
    /// up for any other connect request. Handlers see the client's
    /// certificates (`request.peer_certs()`) on both transports. RDMA
    /// payloads themselves are not encrypted (see the section).
    ///
    /// # Errors
    ///
    /// [`Error::Tls`] if tonic refuses the configuration.
    #[cfg(feature = "tls")]
    pub fn tls_config(mut self, tls_config: crate::ServerTlsConfig) -> Result<Self, Error> {
        self.tcp = self
            .tcp
            .tls_config(tls_config)
            .map_err(|e| Error::Tls(crate::client::error_chain(&e)))?;
        self.tls = true;
        Ok(self)
    }

    /// Answer calls over the connection limit at once with an error instead
    /// of queueing them (as tonic's). TCP only: an RDMA client knows the
    /// limit from the handshake and never opens more calls than it allows.
    pub fn load_shed(mut self, load_shed: bool) -> Self {
        self.tcp = self.tcp.load_shed(load_shed);
        self
    }

    /// The initial per-call flow-control window: the HTTP/2 setting on TCP,
    /// [`SessionConfig::initial_window`] on message connections.
    pub fn initial_stream_window_size(mut self, sz: impl Into<Option<u32>>) -> Self {
        let sz = sz.into();
        if let Some(w) = sz {
            self.session.initial_window = w.max(1);
        }
        self.tcp = self.tcp.initial_stream_window_size(sz);
        self
    }

    /// The initial per-connection flow-control window: the HTTP/2 setting on
    /// TCP, [`SessionConfig::connection_window`] on message connections.
    pub fn initial_connection_window_size(mut self, sz: impl Into<Option<u32>>) -> Self {
        let sz = sz.into();
        if let Some(w) = sz {
            self.session.connection_window = w.max(1);
        }
        self.tcp = self.tcp.initial_connection_window_size(sz);
        self
    }

    /// Calls a client may open at once on one connection: HTTP/2's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` on TCP, the call limit of the
    /// handshake on message connections (with
    /// [`concurrency_limit_per_connection`](Self::concurrency_limit_per_connection),
    /// the smaller one).
    pub fn max_concurrent_streams(mut self, max: impl Into<Option<u32>>) -> Self {
        let max = max.into();
        self.max_concurrent_streams = max;
        self.apply_call_limit();
        self.tcp = self.tcp.max_concurrent_streams(max);
        self
    }

    /// Closes connections gracefully once they are this old (as tonic's): on
    /// TCP HTTP/2's GOAWAY, on message connections the call protocol's
    /// GOAWAY; calls in flight finish, clients reconnect for new ones.
    pub fn max_connection_age(mut self, max_connection_age: Duration) -> Self {
        self.max_connection_age = Some(max_connection_age);
        self.tcp = self.tcp.max_connection_age(max_connection_age);
        self
    }

    /// After `max_connection_age`, how long calls in flight may take before
    /// the connection is closed under them (as tonic's), on every transport.
    pub fn max_connection_age_grace(mut self, grace: Duration) -> Self {
        self.max_connection_age_grace = Some(grace);
        self.tcp = self.tcp.max_connection_age_grace(grace);
        self
    }

    /// HTTP/2 keepalive PING interval (as tonic's); on RDMA connections the
    /// transport's keepalive interval (`RdmaConfig::keepalive`).
    pub fn http2_keepalive_interval(mut self, interval: Option<Duration>) -> Self {
        if let Some(i) = interval {
            let mut cfg = self
                .rdma_config
                .take()
                .unwrap_or_else(crate::rdma::transport_config);
            cfg.keepalive = i;
            self.rdma_config = Some(cfg);
        }
        self.tcp = self.tcp.http2_keepalive_interval(interval);
        self
    }

    /// How long a keepalive PING may wait for its answer (as tonic's). On
    /// RDMA an unanswered keepalive fails at the NIC after its retries.
    pub fn http2_keepalive_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.tcp = self.tcp.http2_keepalive_timeout(timeout);
        self
    }

    /// HTTP/2 adaptive flow-control window (as tonic's). TCP only.
    pub fn http2_adaptive_window(mut self, enabled: Option<bool>) -> Self {
        self.tcp = self.tcp.http2_adaptive_window(enabled);
        self
    }

    /// HTTP/2 reset-stream limit (as tonic's). TCP only.
    pub fn http2_max_pending_accept_reset_streams(mut self, max: Option<usize>) -> Self {
        self.tcp = self.tcp.http2_max_pending_accept_reset_streams(max);
        self
    }

    /// HTTP/2 locally reset streams allowed (as tonic's). TCP only.
    pub fn http2_max_local_error_reset_streams(mut self, max: Option<usize>) -> Self {
        self.tcp = self.tcp.http2_max_local_error_reset_streams(max);
        self
    }

    /// TCP keepalive of accepted connections (as tonic's). RDMA connections
    /// use the transport's keepalive (`RdmaConfig::keepalive`).
    pub fn tcp_keepalive(mut self, tcp_keepalive: Option<Duration>) -> Self {
        self.tcp_keepalive.0 = tcp_keepalive;
        self.tcp = self.tcp.tcp_keepalive(tcp_keepalive);
        self
    }

    /// TCP keepalive probe interval (as tonic's). TCP only.
    pub fn tcp_keepalive_interval(mut self, interval: Option<Duration>) -> Self {
        self.tcp_keepalive.1 = interval;
        self.tcp = self.tcp.tcp_keepalive_interval(interval);
        self
    }

    /// TCP keepalive probe count (as tonic's). TCP only.
    pub fn tcp_keepalive_retries(mut self, retries: Option<u32>) -> Self {
        self.tcp_keepalive.2 = retries;
        self.tcp = self.tcp.tcp_keepalive_retries(retries);
        self
    }

    /// `TCP_NODELAY` on accepted connections (default on, as tonic's). TCP
    /// only: RDMA sends each message when it is posted.
    pub fn tcp_nodelay(mut self, enabled: bool) -> Self {
        self.tcp_nodelay = enabled;
        self.tcp = self.tcp.tcp_nodelay(enabled);
        self
    }

    /// Largest request metadata accepted (as tonic's): the HTTP/2 setting on
    /// TCP, [`SessionConfig::max_metadata_bytes`] on message connections.
    pub fn http2_max_header_list_size(mut self, max: impl Into<Option<u32>>) -> Self {
        let max = max.into();
        if let Some(m) = max {
            self.session.max_metadata_bytes = m.max(1);
        }
        self.tcp = self.tcp.http2_max_header_list_size(max);
        self
    }

    /// Largest HTTP/2 frame (as tonic's). TCP only: on message connections
    /// DATA frames are at most [`SessionConfig::max_data_frame`].
    pub fn max_frame_size(mut self, frame_size: impl Into<Option<u32>>) -> Self {
        self.tcp = self.tcp.max_frame_size(frame_size);
        self
    }

    /// Also serve HTTP/1.1 (grpc-web behind its layer), as tonic's. TCP only.
    pub fn accept_http1(mut self, accept_http1: bool) -> Self {
        self.tcp = self.tcp.accept_http1(accept_http1);
        self
    }

    /// A `tracing` span for each call, from its request head (method, URI,
    /// metadata), as tonic's; on message connections too, where the head is
    /// the call's path and metadata.
    pub fn trace_fn<F>(mut self, f: F) -> Self
    where
        F: Fn(&http::Request<()>) -> tracing::Span + Send + Sync + 'static,
    {
        let f: TraceFn = Arc::new(f);
        let g = f.clone();
        self.tcp = self.tcp.trace_fn(move |r| g(r));
        self.trace = Some(f);
        self
    }

    /// Where [`Router::serve_with_incoming`] listens for RDMA beside the
    /// HTTP/2 connections it is given (default: it serves no RDMA, since an
    /// incoming stream has no address). `serve` and `start` listen for RDMA
    /// at their own address and ignore this.
    pub fn rdma_listen_addr(mut self, addr: SocketAddr) -> Self {
        self.rdma_listen = Some(addr);
        self
    }

    /// Adds a tonic-generated service (e.g. `GreeterServer::new(greeter)`);
    /// as tonic's, it takes `&mut self` and the router gets a copy of this
    /// configuration.
    pub fn add_service<S>(&mut self, svc: S) -> Router
    where
        S: Service<http::Request<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.add_routes(Routes::default()).add_service(svc)
    }
}

/// A [`Server`] with its services, ready to serve.
#[derive(Debug, Clone)]
pub struct Router {
    server: Server,
    routes: Routes,
    /// The services of `add_service`, for message connections' calls
    /// without axum's router (`dispatch`).
    direct: Direct,
}

impl Router {
    /// Adds another service.
    pub fn add_service<S>(mut self, svc: S) -> Router
    where
        S: Service<http::Request<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        // The same conversion tonic's router makes (`IntoResponse`, then
        // tonic's body), so a handler's response reaches the call exactly as
        // it does through the router.
        let direct = svc
            .clone()
            .map_response(|r| axum::response::IntoResponse::into_response(r).map(Body::new));
        self.direct.add(S::NAME, BoxCloneSyncService::new(direct));
        self.routes = self.routes.add_service(svc);
        self
    }

    /// Adds the service if `Some` (as tonic's `Router::add_optional_service`).
    pub fn add_optional_service<S>(self, svc: Option<S>) -> Router
    where
        S: Service<http::Request<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        match svc {
            Some(svc) => self.add_service(svc),
            None => self,
        }
    }

    /// Serves on `addr` until the process ends: RDMA (when the address has an
    /// RDMA device) and HTTP/2 on TCP at the same port.
    ///
    /// # Errors
    ///
    /// [`Error::Serve`] if the address cannot be bound or serving fails.
    pub async fn serve(self, addr: SocketAddr) -> Result<(), Error> {
        self.serve_with_shutdown(addr, std::future::pending()).await
    }

    /// As [`serve`](Self::serve), until `signal` completes (any future, as
    /// tonic's: `notify.notified()` too); then stops accepting, lets
    /// in-flight calls finish and returns.
    ///
    /// # Errors
    ///
    /// As [`serve`](Self::serve).
    pub async fn serve_with_shutdown<F>(self, addr: SocketAddr, signal: F) -> Result<(), Error>
    where
        F: Future<Output = ()>,
    {
        let handle = self.start(addr).await?;
        signal.await;
        handle.shutdown().await
    }

    /// Serves HTTP/2 over the connections `incoming` yields (as tonic's:
    /// a `TcpIncoming`, a TLS or Unix-socket stream, an in-process
    /// `tokio::io::duplex` end...), until the stream ends. An incoming
    /// stream has no address to listen for RDMA at, so RDMA is served beside
    /// it only when [`Server::rdma_listen_addr`] names one.
    ///
    /// # Errors
    ///
    /// [`Error::Serve`] if serving fails.
    pub async fn serve_with_incoming<I, IO, IE>(self, incoming: I) -> Result<(), Error>
    where
        I: futures::Stream<Item = Result<IO, IE>> + Send + 'static,
        IO: tokio::io::AsyncRead
            + tokio::io::AsyncWrite
            + tonic::transport::server::Connected
            + Unpin
            + Send
            + 'static,
        IO::ConnectInfo: Clone + Send + Sync + 'static,
        IE: Into<BoxError>,
    {
        self.serve_incoming(incoming, None::<std::future::Pending<()>>)
            .await
    }

    /// As [`serve_with_incoming`](Self::serve_with_incoming), until `signal`
    /// completes; then stops, letting in-flight calls finish.
    ///
    /// # Errors
    ///
    /// [`Error::Serve`] if serving fails.
    pub async fn serve_with_incoming_shutdown<I, IO, IE, F>(
        self,
        incoming: I,
        signal: F,
    ) -> Result<(), Error>
    where
        I: futures::Stream<Item = Result<IO, IE>> + Send + 'static,
        IO: tokio::io::AsyncRead
            + tokio::io::AsyncWrite
            + tonic::transport::server::Connected
            + Unpin
            + Send
            + 'static,
        IO::ConnectInfo: Clone + Send + Sync + 'static,
        IE: Into<BoxError>,
        F: Future<Output = ()>,
    {
        self.serve_incoming(incoming, Some(signal)).await
    }

    /// Both `serve_with_incoming*`. Without a signal, as tonic: the HTTP/2
    /// side returns when `incoming` ends and the connections it accepted
    /// carry on (a graceful shutdown would close them at that moment).
    async fn serve_incoming<I, IO, IE, F>(self, incoming: I, signal: Option<F>) -> Result<(), Error>
    where
        I: futures::Stream<Item = Result<IO, IE>> + Send + 'static,
        IO: tokio::io::AsyncRead
            + tokio::io::AsyncWrite
            + tonic::transport::server::Connected
            + Unpin
            + Send
            + 'static,
        IO::ConnectInfo: Clone + Send + Sync + 'static,
        IE: Into<BoxError>,
        F: Future<Output = ()>,
    {
        let graceful = signal.is_some();
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut tasks = JoinSet::new();
        let sessions: Sessions = Arc::new(Mutex::new(Vec::new()));
        let rdma_port = Arc::new(std::sync::atomic::AtomicU16::new(0));
        let tickets = self.tickets();
        let mut rdma = None;
        if let Some(addr) = self.server.rdma_listen.filter(|_| !self.server.tcp_only) {
            let cfg = self
                .server
                .rdma_config
                .clone()
                .unwrap_or_else(crate::rdma::transport_config);
            if let Some(l) = crate::rdma::bind_listener(addr, cfg, tickets.clone()).await {
                let a = crate::rdma::spawn_accept(
                    l,
                    self.clone(),
                    sessions.clone(),
                    tickets.clone(),
                    stop_rx.clone(),
                    &mut tasks,
                );
                rdma_port.store(a.port(), std::sync::atomic::Ordering::Release);
                rdma = Some(a);
            }
        }
        self.spawn_http2(
            incoming,
            rdma_port,
            tickets,
            graceful.then_some(stop_rx),
            &mut tasks,
        );
        tracing::info!(rdma = ?rdma, "serving the given connections");
        let handle = ServingHandle {
            local: SocketAddr::from(([0, 0, 0, 0], 0)),
            rdma,
            stop: stop_tx,
            tasks,
            sessions,
        };
        match signal {
            Some(signal) => handle.run_until(signal).await,
            None => handle.run_until(std::future::pending()).await,
        }
    }

    /// The ticket table of a TLS server (`crate::ticket`), else `None`.
    fn tickets(&self) -> Option<Arc<TicketStore>> {
        self.server.tls.then(|| Arc::new(TicketStore::default()))
    }

    /// Serves HTTP/2 (tonic's server, with this server's options, deadlines
    /// and layers) over `incoming` until `stop`.
    fn spawn_http2<I, IO, IE>(
        &self,
        incoming: I,
        rdma_port: Arc<std::sync::atomic::AtomicU16>,
        tickets: Option<Arc<TicketStore>>,
        stop: Option<tokio::sync::watch::Receiver<bool>>,
        tasks: &mut JoinSet<Result<(), Error>>,
    ) where
        I: futures::Stream<Item = Result<IO, IE>> + Send + 'static,
        IO: tokio::io::AsyncRead
            + tokio::io::AsyncWrite
            + tonic::transport::server::Connected
            + Unpin
            + Send
            + 'static,
        IO::ConnectInfo: Clone + Send + Sync + 'static,
        IE: Into<BoxError>,
    {
        let mut tonic_server = self.server.tcp.clone();
        if let Some(l) = self.server.concurrency_limit {
            let l = usize::try_from(l).unwrap_or(usize::MAX);
            tonic_server = tonic_server.concurrency_limit_per_connection(l);
        }
        // Deadlines as on the message transports: DEADLINE_EXCEEDED (not
        // tonic's CANCELLED "Timeout expired"), over the whole call.
        let mut tonic_server = tonic_server
            .layer(DefaultTimeoutLayer(self.server.timeout))
            .layer(crate::tcp::ServerDeadlineLayer)
            .layer(DynLayer(self.server.layers.clone()));
        let mut routes = self
            .routes
            .clone()
            .add_service(crate::discovery::RdmaEndpointService { port: rdma_port });
        if let Some(store) = tickets {
            // Over TLS only (a TLS server serves HTTP/2 over nothing else).
            routes = routes.add_service(crate::ticket::TicketService { store });
        }
        tasks.spawn(async move {
            let router = tonic_server.add_routes(routes);
            match stop {
                Some(mut rx) => {
                    router
                        .serve_with_incoming_shutdown(incoming, async move {
                            let _ = rx.wait_for(|s| *s).await;
                        })
                        .await
                }
                None => router.serve_with_incoming(incoming).await,
            }
            .map_err(|e| Error::Serve(format!("TCP: {}", crate::client::error_chain(&e))))
        });
    }

    /// Binds and starts serving in the background; the handle tells the bound
    /// address (useful with port 0) and shuts the server down.
    ///
    /// # Errors
    ///
    /// [`Error::Serve`] if the address cannot be bound.
    pub async fn start(self, addr: SocketAddr) -> Result<ServingHandle, Error> {
        // Bind TCP first (port 0 picks the port both transports use), set up
        // the RDMA listener on that port, and only then listen on TCP: once
        // the TCP port answers, a client's RDMA attempt finds its listener too.
        let socket = tcp_socket(addr)?;
        let local = socket.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut tasks = JoinSet::new();

        // The RDMA port, told to clients by the TCP side (§3); 0 = none.
        let rdma_port = Arc::new(std::sync::atomic::AtomicU16::new(0));
        let tickets = self.tickets();
        let cfg = self
            .server
            .rdma_config
            .clone()
            .unwrap_or_else(crate::rdma::transport_config);
        let sessions: Sessions = Arc::new(Mutex::new(Vec::new()));
        let mut rdma_listener = if self.server.tcp_only {
            None
        } else {
            crate::rdma::bind_listener(local, cfg.clone(), tickets.clone()).await
        };
        let listener = match socket.listen(1024) {
            Ok(l) => l,
            // iWARP (docs/wire-protocol.md §3): rdma_cm's listener is a kernel
            // TCP listener and took the port. HTTP/2 keeps the port (stock
            // clients know only it); RDMA listens on another one, which the
            // TCP side tells Auto clients.
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && rdma_listener.is_some() => {
                drop(rdma_listener.take());
                let l = listen_retrying(local).await?;
                let alt = SocketAddr::new(local.ip(), self.server.rdma_port.unwrap_or(0));
                rdma_listener = crate::rdma::bind_listener(alt, cfg, tickets.clone()).await;
                if let Some(r) = &rdma_listener {
                    tracing::info!(
                        tcp = %local,
                        rdma = %r.local_addr(),
                        "the RDMA device is iWARP (its listener cannot share the TCP port): \
                         RDMA listens on another port, announced over TCP"
                    );
                }
                l
            }
            Err(e) => return Err(Error::Serve(format!("listening on TCP {local}: {e}"))),
        };
        let rdma = rdma_listener.map(|l| {
            crate::rdma::spawn_accept(
                l,
                self.clone(),
                sessions.clone(),
                tickets.clone(),
                stop_rx.clone(),
                &mut tasks,
            )
        });
        rdma_port.store(
            rdma.map_or(0, |a| a.port()),
            std::sync::atomic::Ordering::Release,
        );
        let (keepalive, interval, retries) = self.server.tcp_keepalive;
        let incoming = tonic::transport::server::TcpIncoming::from(listener)
            .with_nodelay(Some(self.server.tcp_nodelay))
            .with_keepalive(keepalive)
            .with_keepalive_interval(interval)
            .with_keepalive_retries(retries);
        self.spawn_http2(incoming, rdma_port, tickets, Some(stop_rx), &mut tasks);
        tracing::info!(addr = %local, rdma = rdma.is_some(), tls = self.server.tls, "serving");
        Ok(ServingHandle {
            local,
            rdma,
            stop: stop_tx,
            tasks,
            sessions,
        })
    }

    /// Serves one established message connection (e.g. one end of
    /// [`conn::mem::pair`]) in the background until it closes.
    pub async fn serve_connection<C: Connection>(
        &self,
        conn: C,
        info: ConnInfo,
    ) -> Result<(), Error> {
        let shared = session::start(
            conn,
            info,
            self.server.session.clone(),
            Some(self.acceptor()),
        )
        .await
        .map_err(|s| Error::Handshake(s.message().to_string()))?;
        drop(shared);
        Ok(())
    }

    /// A message connection just started: closed gracefully once it is
    /// `max_connection_age` old (after `max_connection_age_grace` more, even
    /// with calls in flight), as tonic does on HTTP/2.
    pub(crate) fn watch_age(&self, s: &Arc<Shared>) {
        let Some(age) = self.server.max_connection_age else {
            return;
        };
        let grace = self.server.max_connection_age_grace;
        let weak = Arc::downgrade(s);
        tokio::spawn(async move {
            tokio::time::sleep(age).await;
            let Some(s) = weak.upgrade() else { return };
            let drain = s.drain_because("max_connection_age reached");
            match grace {
                None => drain.await,
                Some(g) => {
                    if tokio::time::timeout(g, drain).await.is_err() {
                        s.fail(Status::unavailable(
                            "connection closed: max_connection_age and its grace period passed",
                        ));
                    }
                }
            }
        });
    }

    pub(crate) async fn start_session<C: Connection>(
        &self,
        conn: C,
        info: ConnInfo,
    ) -> Result<Arc<Shared>, Status> {
        session::start(
            conn,
            info,
            self.server.session.clone(),
            Some(self.acceptor()),
        )
        .await
    }

    /// Serves in-process over in-memory connections: each
    /// [`MemoryServer::channel`] is a new connection.
    pub fn into_memory(self) -> MemoryServer {
        MemoryServer {
            router: self,
            sessions: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn acceptor(&self) -> Acceptor {
        let svc = match &self.server.layers {
            None => CallService::Routes {
                routes: self.routes.clone(),
                direct: self.direct.clone(),
            },
            Some(layers) => CallService::Layered(layers(HttpService::new(ServiceExt::<
                http::Request<Body>,
            >::map_err(
                self.routes.clone(),
                |never| match never {},
            )))),
        };
        let default_timeout = self.server.timeout;
        let trace = self.server.trace.clone();
        Acceptor {
            accept: Arc::new(move |shared: Arc<Shared>, mut call: OpenCall| {
                let svc = svc.clone();
                if let Some(t) = default_timeout {
                    call.timeout = Some(call.timeout.map_or(t, |c| c.min(t)));
                }
                // Started by the session (`session::opened`): in place or
                // as its own task. Boxed once here, so that neither moves
                // the whole call state (`tokio::spawn` of the bare future
                // copied it three times, ~2 k instructions per call).
                match &trace {
                    None => Box::pin(handle_call(svc, shared, call)) as CallFuture,
                    Some(f) => {
                        use tracing::Instrument;
                        let span = f(&call_head(&call));
                        Box::pin(handle_call(svc, shared, call).instrument(span)) as CallFuture
                    }
                }
            }),
            on_misbehaved: self.server.on_misbehaved.clone(),
        }
    }
}

fn tcp_socket(addr: SocketAddr) -> Result<tokio::net::TcpSocket, Error> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .map_err(|e| Error::Serve(format!("TCP socket for {addr}: {e}")))?;
    socket.set_reuseaddr(true)?;
    socket
        .bind(addr)
        .map_err(|e| Error::Serve(format!("binding TCP {addr}: {e}")))?;
    Ok(socket)
}

/// Listens on `addr` once the dropped iWARP listener has released it (its
/// task and rdma_cm id go away asynchronously): up to 5 s.
async fn listen_retrying(addr: SocketAddr) -> Result<tokio::net::TcpListener, Error> {
    let mut last = None;
    for _ in 0..100 {
        match tcp_socket(addr).and_then(|s| s.listen(1024).map_err(Error::from)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Err(Error::Serve(format!(
        "listening on TCP {addr}: {}",
        last.map_or_else(String::new, |e| e.to_string())
    )))
}

pub(crate) type Sessions = Arc<Mutex<Vec<std::sync::Weak<Shared>>>>;

/// Remembers a live session for graceful shutdown, forgetting closed ones so
/// that a long-running server does not grow with every connection it served.
pub(crate) fn track_session(sessions: &Sessions, s: &Arc<Shared>) {
    let mut v = sessions.lock().unwrap_or_else(|e| e.into_inner());
    v.retain(|w| w.strong_count() > 0);
    v.push(Arc::downgrade(s));
}

/// A running server (see [`Router::start`]).
#[derive(Debug)]
pub struct ServingHandle {
    local: SocketAddr,
    rdma: Option<SocketAddr>,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: JoinSet<Result<(), Error>>,
    sessions: Sessions,
}

impl ServingHandle {
    /// The TCP address served (the RDMA listener uses the same port, except
    /// on iWARP: see [`rdma_addr`](Self::rdma_addr)).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The RDMA address served, if an RDMA listener is up.
    pub fn rdma_addr(&self) -> Option<SocketAddr> {
        self.rdma
    }

    /// Stops at once, as a crash would: listeners close and every message
    /// connection is dropped with its calls failing `Unavailable` on the client.
    /// (HTTP/2 connections are closed by tonic.)
    pub async fn abort(mut self) {
        let _ = self.stop.send(true);
        let live: Vec<Arc<Shared>> = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .filter_map(|w| w.upgrade())
            .collect();
        for s in live {
            s.fail(Status::unavailable("server aborted"));
        }
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
    }

    /// Serves until `signal`, or until a serving task ends (an incoming
    /// stream that ended, a failure); then shuts down.
    async fn run_until<F: Future<Output = ()>>(mut self, signal: F) -> Result<(), Error> {
        let ended = tokio::select! {
            _ = signal => None,
            r = self.tasks.join_next() => r,
        };
        let first = match ended {
            Some(Ok(Err(e))) => Err(e),
            Some(Err(e)) if e.is_panic() => Err(Error::Serve(format!("task panicked: {e}"))),
            _ => Ok(()),
        };
        let rest = self.shutdown().await;
        first.and(rest)
    }

    /// Stops accepting, lets in-flight calls finish, closes connections.
    ///
    /// # Errors
    ///
    /// [`Error::Serve`] if a serving task failed.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        let _ = self.stop.send(true);
        drain_sessions(&self.sessions).await;
        let mut result = Ok(());
        while let Some(r) = self.tasks.join_next().await {
            match r {
                Ok(Err(e)) => result = Err(e),
                Err(e) if e.is_panic() => result = Err(Error::Serve(format!("task panicked: {e}"))),
                _ => {}
            }
        }
        result
    }
}

async fn drain_sessions(sessions: &Sessions) {
    let live: Vec<Arc<Shared>> = sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain(..)
        .filter_map(|w| w.upgrade())
        .collect();
    futures::future::join_all(live.iter().map(|s| s.drain())).await;
}

/// An in-process server reached over in-memory connections.
#[derive(Debug)]
pub struct MemoryServer {
    router: Router,
    sessions: Sessions,
}

impl MemoryServer {
    /// Opens a new in-memory connection to the server.
    pub async fn channel(&self) -> Result<Channel, Error> {
        let (a, b) = conn::mem::pair();
        let info = ConnInfo::new(TransportKind::Memory, None);
        let router = self.router.clone();
        let sessions = self.sessions.clone();
        let server = tokio::spawn(async move {
            let s = router.start_session(b, info).await?;
            track_session(&sessions, &s);
            Ok::<_, Status>(())
        });
        let ch =
            Channel::from_connection(a, TransportKind::Memory, SessionConfig::default()).await?;
        server
            .await
            .map_err(|e| Error::Serve(e.to_string()))?
            .map_err(|s| Error::Handshake(s.message().to_string()))?;
        Ok(ch)
    }

    /// Sends GOAWAY on every connection and waits for their calls to finish.
    pub async fn shutdown(&self) {
        drain_sessions(&self.sessions).await;
    }
}

/// What serves the calls of message connections: the routes, or the routes
/// inside the user's layers.
#[derive(Clone)]
enum CallService {
    /// No layers: a service added by name is called directly (`dispatch`),
    /// anything else goes through the router.
    Routes {
        routes: Routes,
        direct: Direct,
    },
    Layered(HttpService),
}

impl CallService {
    async fn call(&mut self, req: http::Request<Body>) -> http::Response<Body> {
        match self {
            CallService::Routes { direct, routes } => {
                if let Some(mut svc) = direct.get(req.uri().path()) {
                    return match svc.ready().await {
                        Ok(svc) => match svc.call(req).await {
                            Ok(r) => r,
                            Err(never) => match never {},
                        },
                        Err(never) => match never {},
                    };
                }
                match ServiceExt::<http::Request<Body>>::ready(routes).await {
                    Ok(svc) => match svc.call(req).await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    },
                    Err(never) => match never {},
                }
            }
            // A layer's error is the call's status, as tonic's server reports it.
            CallService::Layered(svc) => match svc.ready().await {
                Ok(svc) => match svc.call(req).await {
                    Ok(r) => r,
                    Err(e) => Status::from_error(e).into_http(),
                },
                Err(e) => Status::from_error(e).into_http(),
            },
        }
    }
}

/// Runs one call: the service, its deadline, and the response back to the peer.
async fn handle_call(mut routes: CallService, shared: Arc<Shared>, call: OpenCall) {
    let OpenCall {
        stream,
        path,
        timeout: call_timeout,
        mut metadata,
        inbound,
        window,
    } = call;
    if let Some(t) = call_timeout {
        if let Ok(v) = timeout::encode(t).parse() {
            metadata.insert("grpc-timeout", v);
        }
    }
    if !metadata.contains_key(http::header::CONTENT_TYPE) {
        metadata.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
    }
    metadata.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    let _end = EndCall {
        shared: shared.clone(),
        stream,
    };
    let body = RecvBody::new(inbound, shared.clone(), stream, None, None);
    let mut req = http::Request::new(Body::new(body));
    *req.method_mut() = http::Method::POST;
    *req.version_mut() = http::Version::HTTP_2;
    // The path's bytes become the URI's without a copy.
    match http::Uri::from_maybe_shared(bytes::Bytes::from(path)) {
        Ok(uri) => *req.uri_mut() = uri,
        Err(e) => {
            send_status(
                &shared,
                stream,
                Status::invalid_argument(format!("bad method path: {e}")),
            );
            return;
        }
    }
    *req.headers_mut() = metadata;
    insert_conn_info(req.extensions_mut(), &shared.info);

    let work = async {
        let resp = routes.call(req).await;
        let (parts, mut body) = resp.into_parts();
        let mut headers = parts.headers;
        headers.remove(http::header::CONTENT_LENGTH);
        if headers.contains_key("grpc-status") && http_body::Body::is_end_stream(&body) {
            // Trailers-only response (e.g. unimplemented, or an error before any message).
            send_metadata(&shared, stream, frame::kind::TRAILERS, &headers);
            return;
        }
        if !send_metadata(&shared, stream, frame::kind::HEADERS, &headers) {
            return;
        }
        loop {
            match body.frame().await {
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => {
                        if shared
                            .send_body(stream, &window, data, false)
                            .await
                            .is_err()
                        {
                            return; // call reset or connection gone
                        }
                    }
                    Err(f) => {
                        if let Ok(trailers) = f.into_trailers() {
                            send_metadata(&shared, stream, frame::kind::TRAILERS, &trailers);
                            return;
                        }
                    }
                },
                Some(Err(status)) => {
                    send_status(&shared, stream, status);
                    return;
                }
                None => {
                    send_status(
                        &shared,
                        stream,
                        Status::internal("handler ended without trailers"),
                    );
                    return;
                }
            }
        }
    };
    match call_timeout {
        Some(t) => {
            if tokio::time::timeout(t, work).await.is_err() {
                send_status(
                    &shared,
                    stream,
                    Status::new(
                        Code::DeadlineExceeded,
                        format!(
                            "deadline exceeded: the server did not finish the call within {t:?}"
                        ),
                    ),
                );
            }
        }
        None => work.await,
    }
    // `_end` finishes the call.
}

/// What tonic's HTTP/2 server puts in a request's extensions, for a call on a
/// message connection: `TcpConnectInfo` (so `remote_addr()` and
/// `local_addr()` answer with the RDMA peer's and this side's IP:port) and,
/// on a connection admitted through TLS, the TLS peer's `TlsConnectInfo`
/// (so `peer_certs()` answers); and the [`ConnInfo`].
fn insert_conn_info(ext: &mut http::Extensions, info: &ConnInfo) {
    if info.peer.is_some() || info.local.is_some() {
        ext.insert(tonic::transport::server::TcpConnectInfo {
            local_addr: info.local,
            remote_addr: info.peer,
        });
    }
    #[cfg(feature = "tls")]
    if let Some(tls) = &info.tls {
        ext.insert((*tls.0).clone());
    }
    ext.insert(info.clone());
}

/// A call's head as an `http::Request<()>`, for a `trace_fn`.
fn call_head(call: &OpenCall) -> http::Request<()> {
    let mut r = http::Request::new(());
    *r.method_mut() = http::Method::POST;
    *r.version_mut() = http::Version::HTTP_2;
    if let Ok(uri) = http::Uri::try_from(call.path.as_str()) {
        *r.uri_mut() = uri;
    }
    *r.headers_mut() = call.metadata.clone();
    r
}

/// Ends a server call when its `handle_call` ends, however it ends: after
/// its trailers (or its RESET) the call is finished; if the handler
/// panicked — in place (`session::opened`) or in its own task — the client
/// gets INTERNAL instead of waiting for an answer that never comes. An
/// aborted handler (the client's RESET, the connection's end) finds its call
/// already gone: nothing is sent.
struct EndCall {
    shared: Arc<Shared>,
    stream: u32,
}

impl Drop for EndCall {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.reset_stream(
                self.stream,
                Status::internal("the server's handler panicked"),
            );
        } else {
            self.shared.finish_stream(self.stream);
        }
    }
}

fn send_status(shared: &Shared, stream: u32, status: Status) {
    let mut md = http::HeaderMap::new();
    if status.add_header(&mut md).is_err() {
        md.insert("grpc-status", http::HeaderValue::from(status.code() as i32));
    }
    send_metadata(shared, stream, frame::kind::TRAILERS, &md);
}

/// Sends a call's HEADERS or TRAILERS if the client's metadata limit (its
/// HELLO, §1.5) allows. A block over the limit would be a protocol violation
/// that closes the whole connection at the client, so it never leaves: only
/// this call fails, with a RESET (RESOURCE_EXHAUSTED) that names the limit,
/// the size and the status the handler meant to send. Returns whether the
/// frame was sent.
fn send_metadata(shared: &Shared, stream: u32, kind: u8, md: &http::HeaderMap) -> bool {
    let limit = shared.peer.max_metadata_bytes as usize;
    match frame::encode_metadata_frame(kind, stream, md, limit) {
        Ok(f) => {
            shared.send_ctrl(f);
            true
        }
        Err(e) => {
            let what = if kind == frame::kind::HEADERS {
                "headers"
            } else {
                "trailers"
            };
            let handler_status = md
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .map_or_else(String::new, |c| format!(" (grpc-status {c})"));
            let status = Status::resource_exhausted(format!(
                "the server's response {what}{handler_status} were not sent: {e} \
                 (the client's max_metadata_bytes)"
            ));
            tracing::warn!(stream, peer = ?shared.info.peer, "{}", status.message());
            // Also cancels this handler (the task running this code): it ends here.
            shared.reset_stream(stream, status);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_builder() {
        // `Server::default()` used to leave TCP_NODELAY off, unlike `builder()`.
        assert_eq!(
            format!("{:?}", Server::default()),
            format!("{:?}", Server::builder())
        );
        assert!(Server::default().tcp_nodelay);
    }

    #[test]
    fn concurrency_limit_is_converted_once_and_never_truncated() {
        // 2^32 + 5 used to become 5 when a session config was set afterwards.
        let s = Server::builder()
            .concurrency_limit_per_connection((1usize << 32) + 5)
            .session_config(SessionConfig::default());
        assert_eq!(s.concurrency_limit, Some(u32::MAX));
        assert_eq!(s.session.max_concurrent_calls, u32::MAX);
        // 0 would refuse every call: it means 1, on every transport.
        let s = Server::builder().concurrency_limit_per_connection(0);
        assert_eq!(s.concurrency_limit, Some(1));
        assert_eq!(s.session.max_concurrent_calls, 1);
        let s = Server::builder()
            .session_config(SessionConfig::default())
            .concurrency_limit_per_connection(7);
        assert_eq!(s.session.max_concurrent_calls, 7);
    }
}
