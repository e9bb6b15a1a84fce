//! One call of a message connection on the server: the request as tonic's
//! services expect it (URI, metadata, extensions with the peer's address
//! and TLS identity), the service or the user's layers, the deadline, and
//! the response frames back to the peer, whatever happens to the handler.

use super::layers::HttpService;
use crate::error::BoxError;
use crate::protocol::body::RecvBody;
use crate::protocol::message::Encoded;
use crate::protocol::session::{CallFuture, OpenCall, Shared};
use crate::protocol::{frame, timeout};
use crate::ConnInfo;
use bytes::Bytes;
use futures::FutureExt;
use http_body_util::BodyExt;
use std::sync::Arc;
use std::time::Duration;
use tonic::body::Body;
use tonic::service::Routes;
use tonic::{Code, Status};
use tower::{Service, ServiceExt};

/// What a message connection's call is handed to: the service's future and
/// the response it ends with, in whatever body type the service answers.
pub(crate) trait CallSvc: Send + 'static {
    /// The response body.
    type Body: http_body::Body<Data = bytes::Bytes, Error: Into<BoxError> + Send>
        + Unpin
        + Send
        + 'static;
    /// Calls the service (after its `poll_ready`).
    fn call(
        &mut self,
        req: http::Request<Body>,
    ) -> impl std::future::Future<Output = http::Response<Self::Body>> + Send;
}

/// What serves the calls of message connections that are not dispatched by
/// service name (`dispatch`): the routes, or the routes inside the user's layers.
#[derive(Clone)]
pub(crate) enum CallService {
    Routes(Routes),
    Layered(HttpService),
}

impl CallSvc for CallService {
    type Body = Body;

    async fn call(&mut self, req: http::Request<Body>) -> http::Response<Body> {
        match self {
            CallService::Routes(routes) => {
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

/// Starts `handle_call` as the session runs calls: boxed once (a box an
/// ended call left, see [`CallFuture`]), in the call's span if the server
/// has a `trace_fn`.
pub(crate) fn start_call<S: CallSvc>(
    svc: S,
    shared: Arc<Shared>,
    call: OpenCall,
    span: Option<tracing::Span>,
) -> CallFuture {
    match span {
        None => CallFuture::new(handle_call(svc, shared, call)),
        Some(span) => {
            use tracing::Instrument;
            CallFuture::new(handle_call(svc, shared, call).instrument(span))
        }
    }
}

/// Runs one call: the service, its deadline, and the response back to the peer.
async fn handle_call<S: CallSvc>(mut svc: S, shared: Arc<Shared>, call: OpenCall) {
    let OpenCall {
        stream,
        path,
        timeout: call_timeout,
        mut metadata,
        inbound,
        window,
    } = call;
    request_headers(&mut metadata, call_timeout);
    let _end = EndCall {
        shared: shared.clone(),
        stream,
    };
    let body = RecvBody::new(inbound, shared.clone(), stream, None, None);
    let mut req = http::Request::new(Body::new(body));
    *req.method_mut() = http::Method::POST;
    *req.version_mut() = http::Version::HTTP_2;
    // The path's bytes (the OPEN frame's) become the URI's without a copy.
    match http::Uri::from_maybe_shared(path) {
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
        let resp = svc.call(req).await;
        let (parts, mut body) = resp.into_parts();
        let mut headers = parts.headers;
        headers.remove(http::header::CONTENT_LENGTH);
        if headers.contains_key(const { http::HeaderName::from_static("grpc-status") })
            && http_body::Body::is_end_stream(&body)
        {
            // Trailers-only response (e.g. unimplemented, or an error before any message).
            send_metadata(&shared, stream, frame::kind::TRAILERS, &headers);
            return;
        }
        // A unary reply usually has its message and then its trailers
        // (`grpc-status: 0` alone) ready at once: the three are then
        // written as one BATCH (§1.7). Frames taken to see that are handled
        // first below, when it was not so.
        let mut taken = [body.frame().now_or_never(), None];
        if matches!(&taken[0], Some(Some(Ok(f))) if f.is_data()) {
            taken[1] = body.frame().now_or_never();
        }
        if let [Some(Some(Ok(d))), Some(Some(Ok(t)))] = &taken {
            if let (Some(data), true) = (d.data_ref(), t.trailers_ref().is_some_and(is_ok_only)) {
                let msg = Encoded {
                    head: data.clone(),
                    tail: Bytes::new(),
                };
                // `Err`: it could not go that way; the frames go one by one.
                if shared
                    .try_send_unary_reply(stream, &window, &headers, &[], msg)
                    .is_ok()
                {
                    return;
                }
            }
        }
        if !send_metadata(&shared, stream, frame::kind::HEADERS, &headers) {
            return;
        }
        // The frames that were ready (`None` among them: the body's end).
        let mut taken = taken.into_iter().flatten();
        loop {
            let next = match taken.next() {
                Some(item) => item,
                None => body.frame().await,
            };
            match next {
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => {
                        if shared
                            .send_body(stream, &window, data, false, false)
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
                // As tonic's `Body::new` maps a body's error (the status
                // itself, or the one in its source chain).
                Some(Err(e)) => {
                    send_status(&shared, stream, Status::from_error(e.into()));
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
    within_deadline(&shared, stream, call_timeout, work).await;
    // `_end` finishes the call.
}

/// The request headers tonic's HTTP/2 path shows a handler: the deadline as
/// `grpc-timeout`, `content-type` and `te` (both paths of a message
/// connection's call, tonic's and the direct one).
pub(super) fn request_headers(metadata: &mut http::HeaderMap, call_timeout: Option<Duration>) {
    if let Some(t) = call_timeout {
        // The encoded string's bytes become the value's (no copy).
        if let Ok(v) = http::HeaderValue::try_from(timeout::encode(t)) {
            metadata.insert(const { http::HeaderName::from_static("grpc-timeout") }, v);
        }
    }
    if !metadata.contains_key(http::header::CONTENT_TYPE) {
        metadata.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
    }
    metadata.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
}

/// Runs `work` (a call's handler and its response) within the call's
/// deadline; past it, the call ends DEADLINE_EXCEEDED.
pub(super) fn within_deadline<W: std::future::Future<Output = ()>>(
    shared: &Shared,
    stream: u32,
    call_timeout: Option<Duration>,
    work: W,
) -> WithinDeadline<'_, W> {
    match call_timeout {
        Some(t) => WithinDeadline::Timed {
            work: tokio::time::timeout(t, work),
            shared,
            stream,
            t,
        },
        None => WithinDeadline::Untimed { work },
    }
}

pin_project_lite::pin_project! {
    /// [`within_deadline`]'s future. It holds `work` once: an `async fn`
    /// keeps its argument beside the timer it moved it into, which doubled
    /// the size of every call's future (the call's box, and each copy of
    /// it).
    #[project = WithinProj]
    pub(super) enum WithinDeadline<'a, W> {
        Timed {
            #[pin]
            work: tokio::time::Timeout<W>,
            shared: &'a Shared,
            stream: u32,
            t: Duration,
        },
        Untimed {
            #[pin]
            work: W,
        },
        Done,
    }
}

impl<W: std::future::Future<Output = ()>> std::future::Future for WithinDeadline<'_, W> {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        use std::task::Poll;
        let (shared, stream, t) = match self.as_mut().project() {
            WithinProj::Untimed { work } => return work.poll(cx),
            WithinProj::Timed {
                work,
                shared,
                stream,
                t,
            } => match work.poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => return Poll::Ready(()),
                Poll::Ready(Err(_)) => (*shared, *stream, *t),
            },
            WithinProj::Done => return Poll::Ready(()),
        };
        // The handler and what it holds go first, as when the work ends.
        self.set(WithinDeadline::Done);
        deadline_exceeded(shared, stream, t);
        Poll::Ready(())
    }
}

/// Ends a call whose deadline `t` passed before the server finished it.
pub(super) fn deadline_exceeded(shared: &Shared, stream: u32, t: Duration) {
    send_status(
        shared,
        stream,
        Status::new(
            Code::DeadlineExceeded,
            format!("deadline exceeded: the server did not finish the call within {t:?}"),
        ),
    );
}

/// What tonic's HTTP/2 server puts in a request's extensions, for a call on a
/// message connection: `TcpConnectInfo` (so `remote_addr()` and
/// `local_addr()` answer with the RDMA peer's and this side's IP:port) and,
/// on a connection admitted through TLS, the TLS peer's `TlsConnectInfo`
/// (so `peer_certs()` answers); and the [`ConnInfo`].
pub(super) fn insert_conn_info(ext: &mut http::Extensions, info: &ConnInfo) {
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
pub(crate) fn call_head(call: &OpenCall) -> http::Request<()> {
    let mut r = http::Request::new(());
    *r.method_mut() = http::Method::POST;
    *r.version_mut() = http::Version::HTTP_2;
    if let Ok(uri) = http::Uri::from_maybe_shared(call.path.clone()) {
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
pub(super) struct EndCall {
    pub(super) shared: Arc<Shared>,
    pub(super) stream: u32,
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

pub(super) fn send_status(shared: &Shared, stream: u32, status: Status) {
    let mut md = http::HeaderMap::new();
    if status.add_header(&mut md).is_err() {
        md.insert("grpc-status", http::HeaderValue::from(status.code() as i32));
    }
    send_metadata(shared, stream, frame::kind::TRAILERS, &md);
}

/// Whether `trailers` are those of a call that succeeded and nothing else:
/// `grpc-status: 0` alone.
fn is_ok_only(trailers: &http::HeaderMap) -> bool {
    trailers.len() == 1
        && trailers
            .get(const { http::HeaderName::from_static("grpc-status") })
            .is_some_and(|v| v == "0")
}

/// Sends a call's HEADERS or TRAILERS if the client's metadata limit (its
/// HELLO, §1.5) allows. A block over the limit would be a protocol violation
/// that closes the whole connection at the client, so it never leaves: only
/// this call fails, with a RESET (RESOURCE_EXHAUSTED) that names the limit,
/// the size and the status the handler meant to send. Returns whether the
/// frame was sent.
pub(super) fn send_metadata(shared: &Shared, stream: u32, kind: u8, md: &http::HeaderMap) -> bool {
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
    use crate::conn::{Connection, FrameReceiver, FrameSender};
    use crate::protocol::session::{self, AcceptFn, Acceptor, CallFuture};
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Sets its flag when dropped, after a while: a frame sent after the
    /// drop began leaves once the flag is set, one sent before does not wait.
    struct SetOnDrop(Arc<AtomicBool>);

    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            std::thread::sleep(Duration::from_millis(200));
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_its_deadline_a_call_drops_its_handler_then_ends_deadline_exceeded() {
        let dropped = Arc::new(AtomicBool::new(false));
        let d = dropped.clone();
        // Every call: a handler that never finishes, within the deadline.
        let accept: AcceptFn = Arc::new(move |shared: Arc<Shared>, call: OpenCall| {
            let handler = SetOnDrop(d.clone());
            CallFuture::new(async move {
                let _end = EndCall {
                    shared: shared.clone(),
                    stream: call.stream,
                };
                let work = async move {
                    let _handler = handler;
                    std::future::pending::<()>().await
                };
                within_deadline(&shared, call.stream, call.timeout, work).await;
            })
        });
        let acceptor = Acceptor {
            accept,
            on_misbehaved: None,
        };
        let (a, b) = crate::conn::mem::pair();
        let info = ConnInfo::new(crate::TransportKind::Memory, None);
        let server = session::start(b, info, Default::default(), Some(acceptor));
        let (mut tx, mut rx) = a.split();
        let config = crate::SessionConfig::default();
        let client = async {
            let hello = frame::Hello {
                version: frame::PROTOCOL_VERSION,
                features: 0,
                max_concurrent_calls: config.max_concurrent_calls,
                initial_window: config.initial_window,
                max_metadata_bytes: config.max_metadata_bytes,
                connection_window: config.connection_window,
            };
            tx.send(frame::encode_hello(&hello)).await.unwrap();
            rx.recv().await.unwrap().expect("the server's HELLO");
        };
        let (_server, ()) = tokio::join!(server, client);
        let timeout = Duration::from_millis(50);
        let open = frame::encode_open(
            1,
            "/p.S/M",
            Some(timeout),
            &http::HeaderMap::new(),
            true,
            1 << 14,
        )
        .unwrap();
        tx.send(open).await.unwrap();
        let limits = frame::DecodeLimits {
            max_metadata_bytes: config.max_metadata_bytes as usize,
        };
        let trailers = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let msg = rx.recv().await.unwrap().expect("the server's answer");
                if let frame::Frame::Trailers {
                    stream: 1,
                    metadata,
                } = frame::decode(msg, &limits).unwrap()
                {
                    return metadata;
                }
            }
        })
        .await
        .expect("trailers within 10 s");
        assert!(
            dropped.load(Ordering::SeqCst),
            "the handler is dropped before the status leaves"
        );
        let status = Status::from_header_map(&trailers).expect("a status");
        assert_eq!(status.code(), Code::DeadlineExceeded);
        assert_eq!(
            status.message(),
            format!("deadline exceeded: the server did not finish the call within {timeout:?}")
        );
    }

    /// A call's request metadata as the server decodes it from OPEN.
    fn decoded(
        md: &http::HeaderMap,
        timeout: Option<Duration>,
    ) -> (http::HeaderMap, Option<Duration>) {
        let open = frame::encode_open_with(1, "/pkg.Svc/Method", timeout, md, &[], false, 1 << 16)
            .expect("encodes");
        let limits = frame::DecodeLimits {
            max_metadata_bytes: 1 << 16,
        };
        match frame::decode(open, &limits).expect("decodes") {
            frame::Frame::Open {
                metadata, timeout, ..
            } => (metadata, timeout),
            other => panic!("not OPEN: {other:?}"),
        }
    }

    #[test]
    fn the_request_headers_fit_in_the_decoded_map() {
        let mut caller = http::HeaderMap::new();
        caller.insert("user-agent", http::HeaderValue::from_static("t"));
        for timeout in [None, Some(Duration::from_secs(1))] {
            for content_type in [false, true] {
                let mut md = caller.clone();
                if content_type {
                    md.insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/grpc+proto"),
                    );
                }
                let (mut got, t) = decoded(&md, timeout);
                assert_eq!(t, timeout);
                let room = got.capacity();
                request_headers(&mut got, t);
                assert_eq!(got.capacity(), room, "grew ({timeout:?}, {content_type})");
                assert_eq!(
                    got.len(),
                    md.len() + 1 + usize::from(!content_type) + usize::from(t.is_some())
                );
                assert_eq!(got["te"], "trailers");
                assert_eq!(got.contains_key("grpc-timeout"), t.is_some());
                if content_type {
                    assert_eq!(got["content-type"], "application/grpc+proto");
                }
            }
        }
    }
}
