//! The HTTP body a call's inbound queue presents to tonic: the server's
//! request body and the client's response body.

use crate::protocol::session::{ok_trailers, CallGuard, Inbound, InboundRx, Shared};
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
    done: bool,
    /// Client side: resets the call if the body is dropped before its trailers.
    guard: Option<CallGuard>,
    /// Client side: keeps the channel (and so the connection) alive while the body is read.
    _keepalive: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// Where the gRPC messages in the data start ([`PrefixSplit`]).
    split: PrefixSplit,
    /// The rest of a DATA frame split after a message's prefix, handed
    /// out by the next poll.
    pending: Option<Bytes>,
}

/// A message body at least this large is handed to tonic after its 5-byte
/// prefix, in a frame of its own: tonic's decode buffer starts at 8 KiB.
const SPLIT_MIN: u64 = 8 * 1024;

/// Follows the gRPC length-prefixed messages (a flag byte and a 4-byte
/// big-endian length before each message) through the body's DATA frames,
/// so that a large message reaches tonic as its prefix first and its bytes
/// after. tonic reads the length from a prefix and reserves room for the
/// message before its bytes come; given the prefix and the bytes in one
/// frame, it takes them all into its small buffer first and then reserves
/// the length again on top, which for a 1 MiB message allocates 2 MiB and
/// copies the message once more. The bytes are the same either way.
#[derive(Debug, Default)]
struct PrefixSplit {
    /// Bytes of the current message still to come.
    body_left: u64,
    /// Bytes of the next message's prefix seen so far (0..5), and them.
    have: usize,
    prefix: [u8; 5],
}

impl PrefixSplit {
    /// Follows `b` up to where it should be split: right after a prefix
    /// whose message of [`SPLIT_MIN`] bytes or more starts in `b` itself.
    /// `None`: no split, the whole of `b` was followed.
    fn scan(&mut self, b: &[u8]) -> Option<usize> {
        let mut pos = 0;
        while pos < b.len() {
            if self.body_left > 0 {
                // body_left > 0 here, and the step is at most what is left of b.
                let n = self.body_left.min((b.len() - pos) as u64);
                self.body_left -= n;
                pos += n as usize;
                continue;
            }
            let take = (5 - self.have).min(b.len() - pos);
            self.prefix[self.have..self.have + take].copy_from_slice(&b[pos..pos + take]);
            self.have += take;
            pos += take;
            if self.have == 5 {
                self.have = 0;
                let [_, l0, l1, l2, l3] = self.prefix;
                self.body_left = u64::from(u32::from_be_bytes([l0, l1, l2, l3]));
                if self.body_left >= SPLIT_MIN && pos < b.len() {
                    return Some(pos);
                }
            }
        }
        None
    }
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
            done: false,
            guard,
            _keepalive: keepalive,
            split: PrefixSplit::default(),
            pending: None,
        }
    }

    /// `b`, or, with `split`, its part up to a large message's prefix (the
    /// rest kept for the next poll), counted as consumed (§1.4).
    fn hand_out(&mut self, mut b: Bytes, split: bool) -> Bytes {
        if split {
            if let Some(at) = self.split.scan(&b) {
                self.pending = Some(b.split_off(at));
            }
        }
        self.shared.consumed(self.stream, b.len());
        b
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
        let n = self.pending.take().map_or(0, |b| b.len()) + self.rx.close();
        self.shared.conn_consumed(n);
    }
}

/// What a body hands out next ([`RecvBody::part`]).
pub(crate) enum Part {
    Data(Bytes),
    Trailers(http::HeaderMap),
    /// Trailers of only `grpc-status: 0`, not made into a map.
    TrailersOk,
}

impl RecvBody {
    /// The next part of the body: data, or the trailers that end it;
    /// `None` at the end of a request stream. With `split`, for tonic's
    /// decoder, a large message's data comes after its prefix
    /// ([`PrefixSplit`]); without, for our own reader (which reads a
    /// message in one frame in place), as it came.
    fn poll_part(
        &mut self,
        cx: &mut Context<'_>,
        split: bool,
    ) -> Poll<Option<Result<Part, Status>>> {
        if let Some(rest) = self.pending.take() {
            return Poll::Ready(Some(Ok(Part::Data(self.hand_out(rest, split)))));
        }
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            match ready!(self.rx.poll_recv(cx)) {
                Some(Inbound::Data(b)) => {
                    return Poll::Ready(Some(Ok(Part::Data(self.hand_out(b, split)))));
                }
                Some(Inbound::Trailers(t)) => {
                    self.finish();
                    return Poll::Ready(Some(Ok(Part::Trailers(t))));
                }
                Some(Inbound::TrailersOk) => {
                    self.finish();
                    return Poll::Ready(Some(Ok(Part::TrailersOk)));
                }
                Some(Inbound::End) => {
                    // Request half-closed; the call itself goes on.
                    self.done = true;
                    return Poll::Ready(None);
                }
                Some(Inbound::Headers(_)) => continue, // only the first HEADERS matters
                Some(Inbound::Reset(s)) => {
                    self.finish();
                    return Poll::Ready(Some(Err(s)));
                }
                None => {
                    self.finish();
                    return Poll::Ready(Some(Err(self.shared.closed_status())));
                }
            }
        }
    }

    /// The next part of the body, as it came (the direct path's reader:
    /// `protocol::message::Reader`).
    pub(crate) async fn part(&mut self) -> Option<Result<Part, Status>> {
        std::future::poll_fn(|cx| self.poll_part(cx, false)).await
    }
}

impl http_body::Body for RecvBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.poll_part(cx, true).map(|p| {
            p.map(|r| {
                r.map(|p| match p {
                    Part::Data(d) => Frame::data(d),
                    Part::Trailers(t) => Frame::trailers(t),
                    Part::TrailersOk => Frame::trailers(ok_trailers()),
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.pending.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(len: usize, fill: u8) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.resize(5 + len, fill);
        m
    }

    /// Splits `frames` as the body hands them out.
    fn split_all(frames: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut s = PrefixSplit::default();
        let mut out = vec![];
        for f in frames {
            let mut b = &f[..];
            while let Some(at) = s.scan(b) {
                out.push(b[..at].to_vec());
                b = &b[at..];
            }
            out.push(b.to_vec());
        }
        out
    }

    #[test]
    fn a_large_message_comes_after_its_prefix_and_nothing_else_moves() {
        let big = msg(1 << 20, 7);
        let small = msg(100, 1);
        // One large message in one frame: its prefix, then its bytes.
        assert_eq!(
            split_all(std::slice::from_ref(&big)),
            vec![big[..5].to_vec(), big[5..].to_vec()]
        );
        // Small messages, or a message of exactly 8 KiB - 1: untouched.
        let edge = msg(8 * 1024 - 1, 2);
        assert_eq!(
            split_all(&[small.clone(), edge.clone()]),
            vec![small.clone(), edge]
        );
        // Several messages in one frame, the large one in the middle: split
        // right after its prefix only; the bytes are all there, in order.
        let mut one = small.clone();
        one.extend_from_slice(&big);
        one.extend_from_slice(&small);
        let parts = split_all(&[one.clone()]);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].len(), small.len() + 5);
        assert_eq!(parts.concat(), one);
        // A prefix cut across frames, and a body over many frames: the split
        // is where the body starts, never again inside the body.
        let frames = vec![
            big[..3].to_vec(),
            big[3..1000].to_vec(),
            big[1000..].to_vec(),
        ];
        let parts = split_all(&frames);
        assert_eq!(parts[0], big[..3].to_vec());
        assert_eq!(parts[1], big[3..5].to_vec());
        assert_eq!(parts.concat(), big);
        assert_eq!(parts.len(), 4);
        // The prefix alone at the end of a frame: nothing to split.
        assert_eq!(split_all(&[big[..5].to_vec()]), vec![big[..5].to_vec()]);
    }
}
