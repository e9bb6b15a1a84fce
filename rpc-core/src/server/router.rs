//! A [`Router`]: a server with its services, serving them. It owns the
//! listeners (TCP first, then RDMA on the same port, or on another one on
//! iWARP), tonic's HTTP/2 server with this server's options and layers, the
//! RDMA accept loop, the sessions of message connections (for graceful
//! shutdown and `max_connection_age`), and the in-memory server.

use super::call::{call_head, start_call, CallService};
use super::dispatch::Direct;
use super::layers::{DefaultTimeoutLayer, DynLayer, HttpService};
use super::{rdma, Server};
use crate::conn::{self, Connection};
use crate::error::BoxError;
use crate::protocol::session::{self, track_session, Acceptor, OpenCall, Sessions, Shared};
use crate::transport::ticket::TicketStore;
use crate::{Channel, ConnInfo, Error, SessionConfig, TransportKind};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::task::JoinSet;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::Status;
use tower::{Service, ServiceExt};

/// The regions a client exposed on a message connection go when the
/// connection does (nobody can revoke them any more).
fn end_regions_with(s: &Shared) {
    let conn = crate::region::table::ConnKey::Msg(s.info.id);
    s.on_end(move || crate::region::table::table().connection_ended(conn));
}

/// A [`Server`] with its services, ready to serve.
#[derive(Debug, Clone)]
pub struct Router {
    pub(super) server: Server,
    pub(super) routes: Routes,
    /// The services of `add_service`, for message connections' calls
    /// without axum's router (`dispatch`).
    pub(super) direct: Direct,
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
        self.direct.add(S::NAME, svc.clone());
        self.routes = self.routes.add_service(svc);
        self
    }

    /// As [`Server::direct_path`], on a router already made.
    #[must_use]
    pub fn direct_path(mut self, enable: bool) -> Router {
        self.server.direct_path = enable;
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
                .unwrap_or_else(crate::transport::rdma::transport_config);
            if let Some(l) = crate::transport::rdma::bind_listener(addr, cfg, tickets.clone()).await
            {
                let a = rdma::spawn_accept(
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

    /// The ticket table of a TLS server (`crate::transport::ticket`), else `None`.
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
            .layer(crate::transport::http2::ServerDeadlineLayer)
            .layer(DynLayer(self.server.layers.clone()));
        let mut routes = self
            .routes
            .clone()
            .add_service(crate::transport::rdma_port::RdmaEndpointService { port: rdma_port });
        if let Some(store) = tickets {
            // Over TLS only (a TLS server serves HTTP/2 over nothing else).
            routes = routes.add_service(crate::transport::ticket::TicketService { store });
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
            .map_err(|e| Error::Serve(format!("TCP: {}", crate::error::error_chain(&e))))
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
            .unwrap_or_else(crate::transport::rdma::transport_config);
        let sessions: Sessions = Arc::new(Mutex::new(Vec::new()));
        let mut rdma_listener = if self.server.tcp_only {
            None
        } else {
            crate::transport::rdma::bind_listener(local, cfg.clone(), tickets.clone()).await
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
                rdma_listener =
                    crate::transport::rdma::bind_listener(alt, cfg, tickets.clone()).await;
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
            rdma::spawn_accept(
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
        end_regions_with(&shared);
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
        let s = session::start(
            conn,
            info,
            self.server.session.clone(),
            Some(self.acceptor()),
        )
        .await?;
        end_regions_with(&s);
        Ok(s)
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
        // Without layers, a service added by name is called directly
        // (`dispatch`); anything else goes through the router.
        let direct = match &self.server.layers {
            None => self.direct.clone(),
            Some(_) => Direct::default(),
        };
        let svc = match &self.server.layers {
            None => CallService::Routes(self.routes.clone()),
            Some(layers) => CallService::Layered(layers(HttpService::new(ServiceExt::<
                http::Request<Body>,
            >::map_err(
                self.routes.clone(),
                |never| match never {},
            )))),
        };
        let default_timeout = self.server.timeout;
        let generated = self.server.direct_path;
        let trace = self.server.trace.clone();
        Acceptor {
            accept: Arc::new(move |shared: Arc<Shared>, mut call: OpenCall| {
                if let Some(t) = default_timeout {
                    call.timeout = Some(call.timeout.map_or(t, |c| c.min(t)));
                }
                // Started by the session (`session::opened`): in place or
                // as its own task. Boxed once (`start_call`), so that neither
                // moves the whole call state (`tokio::spawn` of the bare
                // future copied it three times, ~2 k instructions per call).
                let span = trace.as_ref().map(|f| f(&call_head(&call)));
                match direct.get(&call.path) {
                    Some(named) => named.start(shared, call, span, generated),
                    None => start_call(svc.clone(), shared, call, span),
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
