//! One call on a channel's connection: over a message connection (RDMA,
//! in-memory) through the call protocol's session, or over tonic's HTTP/2
//! channel with the deadline and cancellation of `crate::transport::http2`;
//! and the statuses a call fails with before its response.

use super::{MsgChannel, Req, RespFuture, Slot};
use crate::error::{error_chain, BoxError};
use crate::protocol::body::RecvBody;
use crate::protocol::session::{CallGuard, Inbound};
use crate::protocol::{frame, timeout};
use crate::transport::http2::{deadline_status, CallCancel, ClientResponseBody};
use bytes::Bytes;
use futures::future::FutureExt;
use http_body_util::BodyExt;
use std::sync::Arc;
use tonic::body::Body;
use tonic::{Code, Status};

/// A call on tonic's HTTP/2 channel (after its `poll_ready`).
pub(super) fn tcp_call(c: &mut tonic::transport::Channel, req: Req) -> RespFuture {
    let timeout = req
        .headers()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(timeout::parse);
    // The deadline covers the whole call from now, the response stream included.
    let deadline = timeout.map(|t| (tokio::time::Instant::now() + t, t));
    // Abandoning the call (dropping this future or the response
    // body, or the deadline) resets its HTTP/2 stream even while
    // the request stream is open: see `crate::transport::http2`.
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
pub(super) fn status_error(status: Status) -> BoxError {
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

/// The request body's frames that were ready when the call started: a
/// unary request's one message without a `Vec` of its own.
#[derive(Default)]
struct ReadyData {
    first: Option<Bytes>,
    more: Vec<Bytes>,
}

impl ReadyData {
    fn push(&mut self, d: Bytes) {
        if self.first.is_none() {
            self.first = Some(d);
        } else {
            self.more.push(d);
        }
    }

    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.more.len()
    }

    fn is_empty(&self) -> bool {
        self.first.is_none()
    }
}

impl IntoIterator for ReadyData {
    type Item = Bytes;
    type IntoIter = std::iter::Chain<std::option::IntoIter<Bytes>, std::vec::IntoIter<Bytes>>;
    fn into_iter(self) -> Self::IntoIter {
        self.first.into_iter().chain(self.more)
    }
}

pub(super) async fn msg_call(
    chan: Arc<MsgChannel>,
    slot: Option<Slot>,
    req: http::Request<Body>,
) -> Result<http::Response<Body>, Status> {
    let (parts, mut body) = req.into_parts();
    let uri = parts.uri;
    let path = uri.path();
    let timeout = parts
        .headers
        .get(const { http::HeaderName::from_static("grpc-timeout") })
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
        // A slot reserved by `poll_ready` is on a session that was live then;
        // if it closed since, OPEN fails below with its status.
        let (shared, permit) = chan.slot(slot).await?;
        let limit = shared.peer.max_metadata_bytes as usize;
        let md_wire = match frame::check_metadata_with(&md, &[], limit) {
            Ok(w) => w,
            Err(e) => {
                return Err(Status::resource_exhausted(format!(
                    "request metadata not sent: {e} (the server's max_metadata_bytes)"
                )))
            }
        };
        let remaining = deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
        // Take what the request body has ready now: a unary request is one
        // message and then the end, so it needs no pump task, and OPEN plus its
        // DATA(END_STREAM) leave together (one BATCH message, §1.7).
        let mut ready = ReadyData::default();
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
        // A unary request (one message, then the end) is usually written
        // with its OPEN as one BATCH, at once (§1.7).
        let together = match (&ready.first, end && ready.more.is_empty()) {
            (Some(d), true) => {
                let (n, len) = (d.len(), frame::open_request_len(path, md_wire, d.len()));
                // The metadata was checked against `limit` just above: the
                // encoding cannot fail.
                shared.try_open_with_request(n, len, |id| {
                    frame::encode_open_request(id, path, remaining, &md, &[], md_wire, d, &[])
                        .unwrap_or_default()
                })?
            }
            _ => None,
        };
        let sent = together.is_some();
        // Else a unary request (all of it ready) follows its OPEN at once.
        let (stream, mut rx, window) = match together {
            Some(opened) => opened,
            None => shared.open_stream(
                |id| {
                    // Checked against `limit` just above: cannot fail here.
                    frame::encode_open(id, path, remaining, &md, open_ends, limit)
                        .unwrap_or_default()
                },
                end && !ready.is_empty(),
            )?,
        };
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
        // A request that left with its OPEN (`sent`) is all there was.
        if end && !sent {
            let n = ready.len();
            for (i, d) in ready.into_iter().enumerate() {
                // If the call ended early (the server answered, or reset it), the
                // answer is in `rx`: read it below rather than report the send.
                if shared
                    .send_body(stream, &window, d, i + 1 == n, true)
                    .await
                    .is_err()
                {
                    break;
                }
            }
        } else if !end {
            let s = shared.clone();
            let w = window.clone();
            // The pump ends when the body ends or the call closes (window closed).
            tokio::spawn(async move {
                let pump = async {
                    for d in ready {
                        s.send_body(stream, &w, d, false, false).await?;
                    }
                    loop {
                        match body.frame().await {
                            Some(Ok(f)) => {
                                if let Ok(data) = f.into_data() {
                                    let last = http_body::Body::is_end_stream(&body);
                                    s.send_body(stream, &w, data, last, false).await?;
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
                            None => {
                                return s.send_body(stream, &w, Bytes::new(), true, false).await
                            }
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
            Some(Inbound::TrailersOk) => {
                guard.done = true;
                let mut resp = http::Response::new(Body::empty());
                *resp.headers_mut() = crate::protocol::session::ok_trailers();
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
