//! [`Channel`]: the client side, a `tower::Service` that tonic-generated
//! clients take unchanged.

use crate::body::RecvBody;
use crate::conn::Connection;
use crate::session::{self, CallGuard, Inbound, Shared};
use crate::tcp::{deadline_status, CallCancel, ClientResponseBody};
use crate::{timeout, ConnInfo, Error, SessionConfig, Transport, TransportInfo, TransportKind};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt};
use http_body_util::BodyExt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tonic::body::Body;
use tonic::{Code, Status};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Opens a new session for a message channel (used to reconnect).
pub(crate) type Connector =
    Arc<dyn Fn() -> BoxFuture<'static, Result<Arc<Shared>, Status>> + Send + Sync>;

/// A client channel to one server. Cheap to clone; clones share the connection
/// and multiplex their calls over it.
///
/// As a `tower::Service`, `poll_ready` on an RDMA or in-memory channel
/// reserves one of the calls the server accepts at once on the connection
/// (its `max_concurrent_calls`): it is `Pending` while all are in use, so
/// tower's `Buffer`, `ConcurrencyLimit` and balancers see the back-pressure.
/// The reservation belongs to this clone (clones start without one) and is
/// released if this clone is dropped without `call`. On a TCP channel,
/// `poll_ready` is tonic's.
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let channel = rpc_core::Channel::connect("127.0.0.1:50051").await?;
/// println!("transport: {}", channel.transport());
/// // let mut client = GreeterClient::new(channel);   // tonic-generated, unchanged
/// # Ok(()) }
/// ```
pub struct Channel {
    inner: Inner,
    info: Arc<TransportInfo>,
    /// Message transports: the call slot `poll_ready` reserved for the next `call`.
    ready: Ready,
}

impl Clone for Channel {
    fn clone(&self) -> Self {
        Channel {
            inner: self.inner.clone(),
            info: self.info.clone(),
            // A reservation is this clone's own (tower's contract).
            ready: Ready::Idle,
        }
    }
}

type Slot = (Arc<Shared>, OwnedSemaphorePermit);

/// Where a message channel's `poll_ready` stands.
enum Ready {
    /// Nothing reserved.
    Idle,
    /// Waiting for the session (connecting) or for a free call slot. In a
    /// `Mutex` only so that `Channel` stays `Sync`; reached through `get_mut`.
    Waiting(std::sync::Mutex<BoxFuture<'static, Result<Slot, Status>>>),
    /// A slot is held for the next `call`.
    Reserved(Slot),
    /// No session could be had: the next `call` fails with this status (a
    /// failed call, not a failed service, as gRPC channels report it).
    Failed(Status),
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
            ready: Ready::Idle,
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
            ready: Ready::Idle,
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
        let chan = match &mut self.inner {
            Inner::Tcp(c) => {
                return tower::Service::<http::Request<Body>>::poll_ready(c, cx).map_err(Into::into)
            }
            Inner::Msg(m) => m,
        };
        loop {
            match &mut self.ready {
                Ready::Reserved((s, _)) if !s.is_unusable() => return Poll::Ready(Ok(())),
                // The connection closed under the reservation: reserve on the next one.
                Ready::Reserved(_) => self.ready = Ready::Idle,
                Ready::Failed(_) => return Poll::Ready(Ok(())),
                Ready::Waiting(f) => {
                    let f = f.get_mut().unwrap_or_else(|e| e.into_inner());
                    self.ready = match f.poll_unpin(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(slot)) => Ready::Reserved(slot),
                        Poll::Ready(Err(st)) => Ready::Failed(st),
                    };
                }
                Ready::Idle => {
                    // Fast path: a live session with a free slot, no allocation.
                    if let Some(slot) = chan.try_reserve() {
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

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        match &mut self.inner {
            Inner::Tcp(c) => {
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
                            Some(t) if is_tonic_timeout_response(&r) => {
                                trailers_only(deadline_status(t))
                            }
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
                            || {
                                Status::unavailable(format!(
                                    "tcp connection failed: {}",
                                    error_chain(&e)
                                ))
                            },
                        ))),
                    }
                })
            }
            Inner::Msg(m) => {
                let m = m.clone();
                let slot = match std::mem::replace(&mut self.ready, Ready::Idle) {
                    Ready::Reserved(slot) => Some(slot),
                    Ready::Failed(st) => return Box::pin(async move { Err(status_error(st)) }),
                    // `call` without `poll_ready`: the call waits for its slot itself.
                    Ready::Idle | Ready::Waiting(_) => None,
                };
                Box::pin(async move {
                    match msg_call(m, slot, req).await {
                        Ok(r) => Ok(r),
                        Err(status) => Err(status_error(status)),
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
                    return Err(Status::cancelled(format!("request body failed: {e}")))
                }
                None => break,
            }
        }
        let open_ends = end && ready.is_empty();
        let (stream, mut rx, window) = shared.open_stream(|id| {
            // Checked against `limit` just above: cannot fail here.
            crate::frame::encode_open(id, &path, remaining, &md, open_ends, limit)
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
