//! The TCP (HTTP/2) path's cancellation and deadlines, made to match the
//! message transports (`docs/wire-protocol.md` §1.3 cancellation, §1.8
//! deadlines; gRPC's `PROTOCOL-HTTP2.md`: a client that abandons a call resets
//! its stream with `RST_STREAM(CANCEL)`, an expired deadline is
//! `DEADLINE_EXCEEDED`).
//!
//! **Client.** hyper's HTTP/2 client pipes the request body to the stream in
//! a task of its own that holds the stream's send half; the response body
//! holds the receive half. h2 resets a stream only when *both* are gone, so a
//! caller that drops a response stream (or whose deadline passes) while its
//! request stream is still open never tells the server: the handler runs on.
//! (hyper resets the stream itself only when the response *future* is
//! dropped before the headers.) So each call made over a TCP channel carries
//! a [`CallCancel`]: the response body owns it, and dropping the body, or its
//! deadline passing, fires it. The request body ([`CancellableBody`]) then
//! fails with an h2 `CANCEL` error, on which hyper's pipe resets the stream
//! with `RST_STREAM(CANCEL)`; the deadline also drops the h2 receive half at
//! once, so a call whose request already ended is reset at that moment too.
//! The request body sees the signal whenever hyper's pipe waits for it
//! (the usual state of an idle request stream); a pipe blocked on the
//! *server's* flow-control window sees it when the server next reads.
//!
//! **Server.** tonic's server enforces `grpc-timeout` only until the response
//! headers, and reports it as `CANCELLED "Timeout expired"`.
//! [`ServerDeadlineLayer`] enforces it over the whole call, as the message
//! path's `handle_call` does: `DEADLINE_EXCEEDED` (Trailers-Only) when the
//! handler has not answered by then, and, for a response stream, the handler's
//! stream is dropped at the deadline and the call ends with `DEADLINE_EXCEEDED`
//! trailers.

use crate::protocol::timeout;
use bytes::Bytes;
use futures::task::AtomicWaker;
use http_body::Frame;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};
use tonic::body::Body;
use tonic::{Code, Status};

#[derive(Debug, Default)]
struct CancelState {
    fired: AtomicBool,
    waker: AtomicWaker,
}

/// The client's side of one call's cancellation: fires when dropped (or by
/// [`fire`](Self::fire)), which makes the call's [`CancellableBody`] fail.
#[derive(Debug)]
pub(crate) struct CallCancel(Arc<CancelState>);

impl CallCancel {
    /// A new signal, and the request body that obeys it.
    pub(crate) fn new(request: Body) -> (CallCancel, Body) {
        let state = Arc::new(CancelState::default());
        let body = CancellableBody {
            inner: request,
            state: state.clone(),
        };
        (CallCancel(state), Body::new(body))
    }

    /// Cancels the call's request stream now.
    pub(crate) fn fire(&self) {
        self.0.fired.store(true, Ordering::Release);
        self.0.waker.wake();
    }
}

impl Drop for CallCancel {
    fn drop(&mut self) {
        // The response side is gone (read to the end, dropped, or expired):
        // whatever of the request is still unsent is of no use to anyone.
        self.fire();
    }
}

pin_project_lite::pin_project! {
    /// A request body that fails with an h2 `CANCEL` error once its call's
    /// [`CallCancel`] fires, so that hyper resets the stream.
    pub(crate) struct CancellableBody {
        #[pin]
        inner: Body,
        state: Arc<CancelState>,
    }
}

/// The error that makes hyper send `RST_STREAM(CANCEL)`: hyper looks for an
/// `h2::Error` in the source chain of a request body's error (tonic's
/// `Status::from_error` keeps it as the status' source).
fn cancel_error() -> Status {
    let mut st = Status::from_error(Box::new(h2::Error::from(h2::Reason::CANCEL)));
    if st.code() != Code::Cancelled {
        st = Status::cancelled("call cancelled by the client");
    }
    st
}

impl http_body::Body for CancellableBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.project();
        if this.state.fired.load(Ordering::Acquire) {
            return Poll::Ready(Some(Err(cancel_error())));
        }
        match this.inner.poll_frame(cx) {
            Poll::Pending => {
                this.state.waker.register(cx.waker());
                // Fired between the check above and the registration?
                if this.state.fired.load(Ordering::Acquire) {
                    return Poll::Ready(Some(Err(cancel_error())));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The status of a call whose deadline of `t` passed.
pub(crate) fn deadline_status(t: Duration) -> Status {
    Status::new(
        Code::DeadlineExceeded,
        format!("deadline exceeded: the call did not complete within {t:?}"),
    )
}

pin_project_lite::pin_project! {
    /// A TCP call's response body on the client: fails with
    /// DEADLINE_EXCEEDED once the call's deadline passes, and on that or on
    /// drop cancels the call's request stream (see the module docs).
    pub(crate) struct ClientResponseBody {
        // `None` once the deadline dropped it (h2 then resets the stream).
        inner: Option<Body>,
        #[pin]
        sleep: Option<Sleep>,
        timeout: Duration,
        expired: bool,
        cancel: CallCancel,
    }
}

impl ClientResponseBody {
    /// `deadline`: when the call started plus its timeout, and the timeout.
    pub(crate) fn new(
        inner: Body,
        deadline: Option<(Instant, Duration)>,
        cancel: CallCancel,
    ) -> Self {
        ClientResponseBody {
            inner: Some(inner),
            sleep: deadline.map(|(d, _)| tokio::time::sleep_until(d)),
            timeout: deadline.map_or(Duration::ZERO, |(_, t)| t),
            expired: false,
            cancel,
        }
    }
}

impl http_body::Body for ClientResponseBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.project();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(f) = Pin::new(inner).poll_frame(cx) {
            return Poll::Ready(f);
        }
        if let Some(sleep) = this.sleep.as_pin_mut() {
            if sleep.poll(cx).is_ready() {
                *this.expired = true;
                *this.inner = None;
                this.cancel.fire();
                return Poll::Ready(Some(Err(deadline_status(*this.timeout))));
            }
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }
}

/// Tower layer over the routes of the TCP server (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ServerDeadlineLayer;

impl<S> tower::Layer<S> for ServerDeadlineLayer {
    type Service = ServerDeadline<S>;
    fn layer(&self, inner: S) -> ServerDeadline<S> {
        ServerDeadline { inner }
    }
}

/// See [`ServerDeadlineLayer`].
#[derive(Debug, Clone)]
pub(crate) struct ServerDeadline<S> {
    inner: S,
}

impl<S> tower::Service<http::Request<Body>> for ServerDeadline<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = ServerDeadlineFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The deadline is taken before the inner service is called. tonic's
        // own `GrpcTimeout` (outside this layer) calls us first and only then
        // starts its timer, and it polls us before looking at that timer: so
        // when its timer has fired, `Instant::now()` is past our deadline too
        // and our DEADLINE_EXCEEDED answer is the one that goes out.
        let deadline = req
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(timeout::parse)
            .map(|t| (Instant::now() + t, t));
        ServerDeadlineFuture {
            inner: self.inner.call(req),
            sleep: deadline.map(|(d, _)| tokio::time::sleep_until(d)),
            deadline,
        }
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`ServerDeadline`].
    pub(crate) struct ServerDeadlineFuture<F> {
        #[pin]
        inner: F,
        #[pin]
        sleep: Option<Sleep>,
        deadline: Option<(Instant, Duration)>,
    }
}

fn server_deadline_status(t: Duration) -> Status {
    Status::new(
        Code::DeadlineExceeded,
        format!("deadline exceeded: the server did not finish the call within {t:?}"),
    )
}

impl<F, E> Future for ServerDeadlineFuture<F>
where
    F: Future<Output = Result<http::Response<Body>, E>>,
{
    type Output = Result<http::Response<Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(r) = this.inner.poll(cx) {
            return Poll::Ready(r.map(|resp| match *this.deadline {
                Some((d, t)) => resp.map(|b| Body::new(ServerDeadlineBody::new(b, d, t))),
                None => resp,
            }));
        }
        if let (Some((d, t)), Some(sleep)) = (*this.deadline, this.sleep.as_pin_mut()) {
            if Instant::now() >= d || sleep.poll(cx).is_ready() {
                // Dropping `inner` (with this future) cancels the handler.
                return Poll::Ready(Ok(server_deadline_status(t).into_http()));
            }
        }
        Poll::Pending
    }
}

pin_project_lite::pin_project! {
    /// A response body that the server ends at the call's deadline: the
    /// handler's stream is dropped and DEADLINE_EXCEEDED trailers end the call.
    struct ServerDeadlineBody {
        inner: Option<Body>,
        #[pin]
        sleep: Sleep,
        timeout: Duration,
    }
}

impl ServerDeadlineBody {
    fn new(inner: Body, deadline: Instant, timeout: Duration) -> Self {
        ServerDeadlineBody {
            inner: Some(inner),
            sleep: tokio::time::sleep_until(deadline),
            timeout,
        }
    }
}

impl http_body::Body for ServerDeadlineBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.project();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if f.is_trailers() {
                    *this.inner = None;
                }
                return Poll::Ready(Some(Ok(f)));
            }
            Poll::Ready(other) => {
                *this.inner = None;
                return Poll::Ready(other);
            }
            Poll::Pending => {}
        }
        if this.sleep.poll(cx).is_ready() {
            *this.inner = None; // the handler's stream: it sees its receiver gone
            let mut trailers = http::HeaderMap::new();
            let status = server_deadline_status(*this.timeout);
            if status.add_header(&mut trailers).is_err() {
                trailers.insert("grpc-status", http::HeaderValue::from(status.code() as i32));
            }
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| http_body::SizeHint::with_exact(0), |b| b.size_hint())
    }
}
