//! The HTTP body a call's inbound queue presents to tonic: the server's
//! request body and the client's response body.

use crate::protocol::session::{CallGuard, Inbound, InboundRx, Shared};
use bytes::Bytes;
use http_body::Frame;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tonic::Status;

/// Body of a call carried over a message connection.
#[derive(Debug)]
pub struct RecvBody {
    rx: InboundRx,
    shared: Arc<Shared>,
    stream: u32,
    pending_credit: u32,
    done: bool,
    /// Client side: resets the call if the body is dropped before its trailers.
    guard: Option<CallGuard>,
    /// Client side: keeps the channel (and so the connection) alive while the body is read.
    _keepalive: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl RecvBody {
    pub(crate) fn new(
        rx: InboundRx,
        shared: Arc<Shared>,
        stream: u32,
        guard: Option<CallGuard>,
        keepalive: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Self {
        RecvBody {
            rx,
            shared,
            stream,
            pending_credit: 0,
            done: false,
            guard,
            _keepalive: keepalive,
        }
    }

    fn finish(&mut self) {
        self.done = true;
        if let Some(g) = &mut self.guard {
            g.done = true;
        }
    }
}

impl Drop for RecvBody {
    fn drop(&mut self) {
        // Data that was never consumed leaves the connection's buffers now:
        // return its connection-level credit (§1.4).
        let mut n = 0;
        while let Some(m) = self.rx.try_recv() {
            if let Inbound::Data(b) = m {
                n += b.len();
            }
        }
        self.shared.conn_consumed(n);
    }
}

impl http_body::Body for RecvBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(this.rx.poll_recv(cx)) {
                Some(Inbound::Data(b)) => {
                    this.shared
                        .consumed(this.stream, &mut this.pending_credit, b.len());
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                Some(Inbound::Trailers(t)) => {
                    this.finish();
                    return Poll::Ready(Some(Ok(Frame::trailers(t))));
                }
                Some(Inbound::End) => {
                    // Request half-closed; the call itself goes on.
                    this.done = true;
                    return Poll::Ready(None);
                }
                Some(Inbound::Headers(_)) => continue, // only the first HEADERS matters
                Some(Inbound::Reset(s)) => {
                    this.finish();
                    return Poll::Ready(Some(Err(s)));
                }
                None => {
                    this.finish();
                    return Poll::Ready(Some(Err(this.shared.closed_status())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}
