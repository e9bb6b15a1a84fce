//! The server side. This module owns [`Server`], the builder with tonic's
//! options; [`router`] serves the services it was given over RDMA (rdma_cm),
//! HTTP/2 on TCP (tonic's server) and in-memory connections; [`call`] runs
//! one call of a message connection; [`dispatch`] finds a service by name
//! without axum's router; [`layers`] holds the user's tower layers and the
//! default deadline; [`rdma`] is the RDMA accept loop.

pub(crate) mod call;
pub(crate) mod dispatch;
pub(crate) mod generated;
pub(crate) mod layers;
pub(crate) mod rdma;
pub(crate) mod router;

pub use layers::HttpService;
pub use router::{MemoryServer, Router, ServingHandle};

use crate::error::BoxError;
use crate::protocol::session::MisbehavedHook;
use crate::{ConnInfo, Error, PeerMisbehaved, SessionConfig};
use dispatch::Direct;
use layers::LayerFn;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::Routes;
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
    /// Calls to services compiled with `rpc_codegen` take the direct path
    /// on message connections.
    direct_path: bool,
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
            direct_path: true,
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
            .field("direct_path", &self.direct_path)
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

    /// Whether calls on message connections (RDMA, in-memory) to services
    /// compiled with `rpc_codegen` take the direct path: the request decoded
    /// from the received bytes and the user's trait method called without
    /// tonic's server machinery (`docs/architecture.md`, "The direct path").
    /// Default: `true`. `false` serves every call as tonic's server does
    /// (on TCP that is always the case). The bytes on the wire, and what the
    /// handler and the client see, are the same either way.
    pub fn direct_path(mut self, enable: bool) -> Self {
        self.direct_path = enable;
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
        // Every server serves remote memory's service path
        // (`crate::remote`): TCP and in-memory connections' clients reach
        // the regions exposed to them through it.
        let svc = crate::region::service::RemoteMemoryService;
        let mut direct = Direct::default();
        direct.add(crate::region::service::SERVICE, svc.clone());
        Router {
            server: self.clone(),
            routes: routes.add_service(svc),
            direct,
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
            .map_err(|e| Error::Tls(crate::error::error_chain(&e)))?;
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
                .unwrap_or_else(crate::transport::rdma::transport_config);
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
