//! [`Channel`]: the client side, a `tower::Service` that tonic-generated
//! clients take unchanged.

use crate::body::RecvBody;
use crate::conn::Connection;
use crate::session::{self, CallGuard, Inbound, Shared};
use crate::{timeout, ConnInfo, Error, SessionConfig, Transport, TransportInfo, TransportKind};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt};
use http_body_util::BodyExt;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tonic::body::Body;
use tonic::{Code, Status};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Opens a new session for a message channel (used to reconnect).
pub(crate) type Connector =
    Arc<dyn Fn() -> BoxFuture<'static, Result<Arc<Shared>, Status>> + Send + Sync>;

/// A client channel to one server. Cheap to clone; clones share the connection
/// and multiplex their calls over it.
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
    inner: Inner,
    info: Arc<TransportInfo>,
}

#[derive(Clone)]
enum Inner {
    Tcp(tonic::transport::Channel),
    Msg(Arc<MsgChannel>),
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("transport", &self.info.to_string())
            .finish()
    }
}

pub(crate) struct MsgChannel {
    session: tokio::sync::Mutex<Option<Arc<Shared>>>,
    connector: Option<Connector>,
}

impl Drop for MsgChannel {
    fn drop(&mut self) {
        if let Some(s) = self.session.get_mut().take() {
            s.close_gracefully();
        }
    }
}

impl MsgChannel {
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

/// Builds a [`Channel`]: transport policy and timeouts.
#[derive(Debug, Clone)]
pub struct ChannelBuilder {
    pub(crate) addr: String,
    pub(crate) transport: Option<Transport>,
    pub(crate) connect_timeout: Duration,
    pub(crate) rdma_connect_timeout: Duration,
    pub(crate) session: SessionConfig,
}

impl ChannelBuilder {
    /// Which transport to use; default [`Transport::Auto`] unless the
    /// `RPC_TRANSPORT` environment variable (`auto`, `rdma`, `tcp`) says otherwise.
    pub fn transport(mut self, t: Transport) -> Self {
        self.transport = Some(t);
        self
    }
    /// Time allowed to establish the TCP connection (default 5 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }
    /// Time allowed for RDMA address/route resolution and connection before
    /// falling back to TCP (default 2 s, or `RPC_RDMA_CONNECT_TIMEOUT_MS`).
    pub fn rdma_connect_timeout(mut self, d: Duration) -> Self {
        self.rdma_connect_timeout = d;
        self
    }
    /// Call-protocol limits used on message (RDMA, in-memory) connections.
    pub fn session_config(mut self, c: SessionConfig) -> Self {
        self.session = c;
        self
    }

    /// Connects according to the transport policy.
    pub async fn connect(self) -> Result<Channel, Error> {
        let policy = match self.transport {
            Some(t) => t,
            None => Transport::from_env()?,
        };
        match policy {
            Transport::TcpOnly => self.connect_tcp(None).await,
            Transport::RdmaOnly => crate::rdma::connect_channel(&self).await,
            Transport::Auto => match crate::rdma::connect_channel(&self).await {
                Ok(c) => Ok(c),
                Err(e) => {
                    let reason = e.fallback_reason();
                    tracing::info!(addr = %self.addr, %reason, "RDMA unavailable, falling back to TCP");
                    self.connect_tcp(Some(reason)).await
                }
            },
        }
    }

    pub(crate) async fn connect_tcp(&self, fallback: Option<String>) -> Result<Channel, Error> {
        let uri = if self.addr.contains("://") {
            self.addr.clone()
        } else {
            format!("http://{}", self.addr)
        };
        let ep = tonic::transport::Endpoint::from_shared(uri)
            .map_err(|e| Error::InvalidAddress(format!("{}: {e}", self.addr)))?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true);
        let ch = ep.connect().await.map_err(|e| Error::Connect {
            transport: TransportKind::Tcp,
            addr: self.addr.clone(),
            detail: error_chain(&e),
        })?;
        Ok(Channel {
            inner: Inner::Tcp(ch),
            info: Arc::new(TransportInfo {
                kind: TransportKind::Tcp,
                fallback_reason: fallback,
            }),
        })
    }
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
    /// A builder for `addr` (`host:port`).
    pub fn builder(addr: impl Into<String>) -> ChannelBuilder {
        ChannelBuilder {
            addr: addr.into(),
            transport: None,
            connect_timeout: Duration::from_secs(5),
            rdma_connect_timeout: std::env::var(crate::RDMA_CONNECT_TIMEOUT_ENV)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(Duration::from_secs(2), Duration::from_millis),
            session: SessionConfig::default(),
        }
    }

    /// Connects to `addr` with the default policy (RDMA first, TCP fallback).
    pub async fn connect(addr: impl Into<String>) -> Result<Channel, Error> {
        Self::builder(addr).connect().await
    }

    /// A channel over an already established message connection (e.g. an
    /// in-memory pair). It does not reconnect.
    pub async fn from_connection<C: Connection>(
        conn: C,
        kind: TransportKind,
        config: SessionConfig,
    ) -> Result<Channel, Error> {
        let info = ConnInfo {
            transport: kind,
            peer: None,
        };
        let shared = session::start(conn, info, config, None)
            .await
            .map_err(|s| Error::Handshake(s.message().to_string()))?;
        Ok(Self::from_session(
            shared,
            None,
            TransportInfo {
                kind,
                fallback_reason: None,
            },
        ))
    }

    pub(crate) fn from_session(
        shared: Arc<Shared>,
        connector: Option<Connector>,
        info: TransportInfo,
    ) -> Channel {
        Channel {
            inner: Inner::Msg(Arc::new(MsgChannel {
                session: tokio::sync::Mutex::new(Some(shared)),
                connector,
            })),
            info: Arc::new(info),
        }
    }

    /// Which transport carries this channel's calls, and why TCP if it fell back.
    pub fn transport(&self) -> &TransportInfo {
        &self.info
    }
}

impl tower::Service<http::Request<Body>> for Channel {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match &mut self.inner {
            Inner::Tcp(c) => {
                tower::Service::<http::Request<Body>>::poll_ready(c, cx).map_err(Into::into)
            }
            Inner::Msg(_) => Poll::Ready(Ok(())),
        }
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        match &mut self.inner {
            Inner::Tcp(c) => {
                let timeout = req
                    .headers()
                    .get("grpc-timeout")
                    .and_then(|v| v.to_str().ok())
                    .and_then(timeout::parse);
                let fut = tower::Service::call(c, req);
                Box::pin(async move {
                    match fut.await {
                        // The deadline covers the whole call, the response stream included.
                        Ok(r) => Ok(match timeout {
                            // tonic's HTTP/2 server answers an expired grpc-timeout with
                            // CANCELLED "Timeout expired"; report it as gRPC specifies.
                            Some(t) if is_tonic_timeout_response(&r) => {
                                trailers_only(deadline_status(t))
                            }
                            Some(t) => r.map(|b| Body::new(DeadlineBody::new(b, t))),
                            None => r,
                        }),
                        // tonic's HTTP/2 channel reports an expired grpc-timeout as a
                        // transport error (Cancelled); gRPC says DEADLINE_EXCEEDED,
                        // as the message transports report it.
                        Err(e) if is_timeout(&e) => {
                            Ok(trailers_only(deadline_status(timeout.unwrap_or_default())))
                        }
                        // A connection that fails or closes under a call is
                        // UNAVAILABLE in gRPC's terms, as on the message transports
                        // (tonic alone reports some of these as CANCELLED or UNKNOWN).
                        Err(e) => Ok(trailers_only(Status::unavailable(format!(
                            "tcp connection failed: {}",
                            error_chain(&e)
                        )))),
                    }
                })
            }
            Inner::Msg(m) => {
                let m = m.clone();
                Box::pin(async move {
                    match msg_call(m, req).await {
                        Ok(r) => Ok(r),
                        Err(status) => Ok(trailers_only(status)),
                    }
                })
            }
        }
    }
}

fn is_tonic_timeout_response(r: &http::Response<Body>) -> bool {
    let h = r.headers();
    h.get("grpc-status").is_some_and(|v| v == "1")
        && h.get("grpc-message")
            .is_some_and(|v| v == "Timeout expired" || v == "Timeout%20expired")
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
    req: http::Request<Body>,
) -> Result<http::Response<Body>, Status> {
    let (parts, mut body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let timeout = parts
        .headers
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(timeout::parse);
    let mut md = parts.headers;
    let names: Vec<_> = md
        .keys()
        .filter(|k| is_transport_header(k))
        .cloned()
        .collect();
    for n in names {
        md.remove(n);
    }
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let work = async {
        let shared = chan.session().await?;
        let md_bytes = crate::frame::metadata_bytes(&md);
        if md_bytes > shared.peer.max_metadata_bytes as usize {
            return Err(Status::resource_exhausted(format!(
                "request metadata is {md_bytes} bytes, over the server's limit of {} bytes",
                shared.peer.max_metadata_bytes
            )));
        }
        let permit = shared
            .call_permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| shared.closed_status())?;
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
                    return Err(Status::cancelled(format!("request body failed: {e}")))
                }
                None => break,
            }
        }
        let open_ends = end && ready.is_empty();
        let (stream, mut rx, window) = shared
            .open_stream(|id| crate::frame::encode_open(id, &path, remaining, &md, open_ends))?;
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
                                let st = Status::cancelled(format!("request body failed: {e}"));
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

fn deadline_status(t: Duration) -> Status {
    Status::new(
        Code::DeadlineExceeded,
        format!("deadline exceeded: the call did not complete within {t:?}"),
    )
}

pin_project_lite::pin_project! {
    /// A response body that fails with DEADLINE_EXCEEDED once the call's deadline passes.
    struct DeadlineBody {
        #[pin]
        inner: Body,
        #[pin]
        sleep: tokio::time::Sleep,
        timeout: Duration,
        expired: bool,
    }
}

impl DeadlineBody {
    fn new(inner: Body, timeout: Duration) -> Self {
        DeadlineBody {
            inner,
            sleep: tokio::time::sleep(timeout),
            timeout,
            expired: false,
        }
    }
}

impl http_body::Body for DeadlineBody {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Status>>> {
        let this = self.project();
        if *this.expired {
            return Poll::Ready(None);
        }
        if let Poll::Ready(f) = this.inner.poll_frame(cx) {
            return Poll::Ready(f);
        }
        if this.sleep.poll(cx).is_ready() {
            *this.expired = true;
            return Poll::Ready(Some(Err(deadline_status(*this.timeout))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.expired || self.inner.is_end_stream()
    }
}
