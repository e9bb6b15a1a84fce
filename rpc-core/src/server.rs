//! [`Server`]: hosts unchanged tonic-generated services over message
//! connections (RDMA, in-memory) and over HTTP/2 on TCP at the same address.

use crate::body::RecvBody;
use crate::conn::{self, Connection};
use crate::session::{self, Acceptor, OpenCall, Shared};
use crate::{frame, timeout, Channel, ConnInfo, Error, SessionConfig, TransportKind};
use http_body_util::BodyExt;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::task::JoinSet;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::{Code, Status};
use tower::{Service, ServiceExt};

/// Server configuration; [`Server::builder`] starts one.
#[derive(Debug, Clone, Default)]
pub struct Server {
    session: SessionConfig,
    concurrency_limit: Option<usize>,
    tcp_nodelay: bool,
    tcp_only: bool,
}

impl Server {
    /// A server with default limits (see [`SessionConfig`]).
    pub fn builder() -> Server {
        Server {
            tcp_nodelay: true,
            ..Server::default()
        }
    }

    /// Calls handled at once per connection, on every transport (as tonic's
    /// option of the same name). Clients wait for a free slot.
    pub fn concurrency_limit_per_connection(mut self, limit: usize) -> Self {
        self.concurrency_limit = Some(limit);
        self.session.max_concurrent_calls = limit.clamp(1, u32::MAX as usize) as u32;
        self
    }

    /// Serve HTTP/2 on TCP only, without the RDMA listener (default: both).
    pub fn tcp_only(mut self, tcp_only: bool) -> Self {
        self.tcp_only = tcp_only;
        self
    }

    /// Call-protocol limits for message connections.
    pub fn session_config(mut self, c: SessionConfig) -> Self {
        let limit = self.concurrency_limit;
        self.session = c;
        if let Some(l) = limit {
            self.session.max_concurrent_calls = l as u32;
        }
        self
    }

    /// Adds a tonic-generated service (e.g. `GreeterServer::new(greeter)`).
    pub fn add_service<S>(self, svc: S) -> Router
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
        Router {
            server: self,
            routes: Routes::new(svc),
        }
    }
}

/// A [`Server`] with its services, ready to serve.
#[derive(Debug, Clone)]
pub struct Router {
    server: Server,
    routes: Routes,
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
        self.routes = self.routes.add_service(svc);
        self
    }

    /// Serves on `addr` until the process ends: RDMA (when the address has an
    /// RDMA device) and HTTP/2 on TCP at the same port.
    pub async fn serve(self, addr: SocketAddr) -> Result<(), Error> {
        self.serve_with_shutdown(addr, std::future::pending()).await
    }

    /// As [`serve`](Self::serve), until `signal` completes; then stops
    /// accepting, lets in-flight calls finish and returns.
    pub async fn serve_with_shutdown<F>(self, addr: SocketAddr, signal: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.start(addr).await?;
        signal.await;
        handle.shutdown().await
    }

    /// Binds and starts serving in the background; the handle tells the bound
    /// address (useful with port 0) and shuts the server down.
    pub async fn start(self, addr: SocketAddr) -> Result<ServingHandle, Error> {
        // Bind TCP first (port 0 picks the port both transports use), set up
        // the RDMA listener on that port, and only then listen on TCP: once
        // the TCP port answers, a client's RDMA attempt finds its listener too.
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
        let local = socket.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut tasks = JoinSet::new();

        let sessions: Sessions = Arc::new(Mutex::new(Vec::new()));
        let rdma = if self.server.tcp_only {
            None
        } else {
            crate::rdma::start_listener(
                local,
                self.clone(),
                sessions.clone(),
                stop_rx.clone(),
                &mut tasks,
            )
            .await
        };

        // HTTP/2 on TCP: tonic's own transport, the same routes.
        let listener = socket
            .listen(1024)
            .map_err(|e| Error::Serve(format!("listening on TCP {local}: {e}")))?;
        let mut tonic_server = tonic::transport::Server::builder();
        if let Some(l) = self.server.concurrency_limit {
            tonic_server = tonic_server.concurrency_limit_per_connection(l);
        }
        let incoming = tonic::transport::server::TcpIncoming::from(listener)
            .with_nodelay(Some(self.server.tcp_nodelay));
        let mut rx = stop_rx.clone();
        let routes = self.routes.clone();
        tasks.spawn(async move {
            tonic_server
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await
                .map_err(|e| Error::Serve(format!("TCP: {}", crate::client::error_chain(&e))))
        });
        tracing::info!(addr = %local, rdma = rdma.is_some(), "serving");
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
        let routes = self.routes.clone();
        Arc::new(move |shared: Arc<Shared>, call: OpenCall| {
            let routes = routes.clone();
            let h = tokio::spawn(handle_call(routes, shared, call));
            Some(h.abort_handle())
        })
    }
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
    /// The TCP address served (the RDMA listener uses the same port).
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

    /// Stops accepting, lets in-flight calls finish, closes connections.
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
        let info = ConnInfo {
            transport: TransportKind::Memory,
            peer: None,
        };
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

/// Runs one call: the service, its deadline, and the response back to the peer.
async fn handle_call(mut routes: Routes, shared: Arc<Shared>, call: OpenCall) {
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
    let body = RecvBody::new(inbound, shared.clone(), stream, None, None);
    let mut req = http::Request::new(Body::new(body));
    *req.method_mut() = http::Method::POST;
    *req.version_mut() = http::Version::HTTP_2;
    match path.parse() {
        Ok(uri) => *req.uri_mut() = uri,
        Err(_) => {
            send_status(
                &shared,
                stream,
                Status::invalid_argument(format!("bad method path {path:?}")),
            );
            return;
        }
    }
    *req.headers_mut() = metadata;
    req.extensions_mut().insert(shared.info.clone());

    let work = async {
        let resp = match ServiceExt::<http::Request<Body>>::ready(&mut routes).await {
            Ok(svc) => match svc.call(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            },
            Err(never) => match never {},
        };
        let (parts, mut body) = resp.into_parts();
        let mut headers = parts.headers;
        headers.remove(http::header::CONTENT_LENGTH);
        if headers.contains_key("grpc-status") && http_body::Body::is_end_stream(&body) {
            // Trailers-only response (e.g. unimplemented, or an error before any message).
            shared.send_ctrl(frame::encode_metadata_frame(
                frame::kind::TRAILERS,
                stream,
                &headers,
            ));
            return;
        }
        shared.send_ctrl(frame::encode_metadata_frame(
            frame::kind::HEADERS,
            stream,
            &headers,
        ));
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
                            shared.send_ctrl(frame::encode_metadata_frame(
                                frame::kind::TRAILERS,
                                stream,
                                &trailers,
                            ));
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
    shared.finish_stream(stream);
}

fn send_status(shared: &Shared, stream: u32, status: Status) {
    let mut md = http::HeaderMap::new();
    if status.add_header(&mut md).is_err() {
        md.insert("grpc-status", http::HeaderValue::from(status.code() as i32));
    }
    shared.send_ctrl(frame::encode_metadata_frame(
        frame::kind::TRAILERS,
        stream,
        &md,
    ));
}
