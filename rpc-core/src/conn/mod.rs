//! The narrow connection trait the call protocol runs over.
//!
//! A [`Connection`] is a reliable, ordered, message-oriented duplex link: it
//! carries whole *frames* (byte strings) and preserves their boundaries. The
//! call layer (see `docs/wire-protocol.md`, part 1) multiplexes gRPC calls over
//! it. Implementations:
//!
//! * [`mem`]: an in-memory pair, for tests and for in-process use;
//! * `rdma` (in this crate, adapting [`rdma_transport`]): verbs SEND/RECV with
//!   credits, and RDMA WRITE rendezvous for large frames.
//!
//! Back-pressure is the implementation's job: [`FrameSender::send`] waits until
//! the peer can take the frame (credits, a bounded queue...).

use bytes::Bytes;
use std::future::Future;
use std::io;

pub mod mem;

/// A message-oriented duplex connection, split into its two halves by the call layer.
pub trait Connection: Send + 'static {
    /// The sending half.
    type Sender: FrameSender;
    /// The receiving half.
    type Receiver: FrameReceiver;
    /// Splits the connection; each half is driven by its own task.
    fn split(self) -> (Self::Sender, Self::Receiver);
}

/// The sending half of a [`Connection`].
pub trait FrameSender: Send + 'static {
    /// Largest frame [`send`](Self::send) accepts, in bytes.
    fn max_frame_len(&self) -> usize;

    /// Sends one frame. Resolves once the transport has taken the frame (it may
    /// still be in flight); waits while the peer has no room for it.
    /// Errors are final: the connection is unusable afterwards.
    ///
    /// Must be cancel-safe: a `send` future dropped before it resolved did
    /// not send its frame (the default [`try_send`](Self::try_send) relies on it).
    fn send(&mut self, frame: Bytes) -> impl Future<Output = io::Result<()>> + Send;

    /// Sends one frame if the transport takes it without waiting; gives it
    /// back (`Err`) when `send` would wait (back-pressure). The session calls
    /// it from the task that made the frame, so that an unloaded connection
    /// needs no hop through its writer task. The default polls [`send`](Self::send)
    /// once (on a clone of the frame, a reference-count increment).
    fn try_send(&mut self, frame: Bytes) -> Result<io::Result<()>, Bytes> {
        use futures::FutureExt;
        match self.send(frame.clone()).now_or_never() {
            Some(r) => Ok(r),
            None => Err(frame),
        }
    }

    /// Sends one frame given as two parts, `head` then `body` (a DATA
    /// frame's header and its payload), so a transport that copies into
    /// registered memory anyway copies the payload only once. Same
    /// semantics as [`send`](Self::send) for `head ++ body`. The default
    /// joins the parts (one copy) and calls `send`.
    fn send_parts(
        &mut self,
        head: Bytes,
        body: Bytes,
    ) -> impl Future<Output = io::Result<()>> + Send {
        async move { self.send(join(&head, &body)).await }
    }

    /// As [`try_send`](Self::try_send), for a frame in two parts
    /// ([`send_parts`](Self::send_parts)); gives both back when it would wait.
    fn try_send_parts(
        &mut self,
        head: Bytes,
        body: Bytes,
    ) -> Result<io::Result<()>, (Bytes, Bytes)> {
        use futures::FutureExt;
        match self.send_parts(head.clone(), body.clone()).now_or_never() {
            Some(r) => Ok(r),
            None => Err((head, body)),
        }
    }

    /// Frame sizes this transport moves most efficiently come in multiples
    /// of this many bytes (RDMA: the rendezvous chunk, so a large frame fills
    /// whole rendezvous buffers). 1 (the default) means no preference.
    fn frame_granule(&self) -> usize {
        1
    }

    /// Closes the connection after the frames already sent. Idempotent.
    fn close(&mut self) -> impl Future<Output = ()> + Send;
}

/// A frame handler a transport runs from its own task for every frame
/// ([`FrameReceiver::deliver_inline`]): `Ok(Some(frame))`, then `Ok(None)`
/// when the peer closed cleanly or the final error. Returns `false` to stop.
pub type InlineFn = Box<dyn FnMut(io::Result<Option<Bytes>>) -> bool + Send>;

/// Stops inline delivery from another task ([`FrameReceiver::deliver_inline`]).
pub type StopFn = Box<dyn FnOnce() + Send>;

/// The receiving half of a [`Connection`].
pub trait FrameReceiver: Send + 'static {
    /// The next frame; `Ok(None)` when the peer closed the connection cleanly.
    /// Errors (peer gone, protocol violation) are final.
    fn recv(&mut self) -> impl Future<Output = io::Result<Option<Bytes>>> + Send;

    /// Has the transport call `f` for every frame from its own task (RDMA:
    /// the connection's driver, right after the completion), so no reader
    /// task sits between the transport and the call layer. `f` must not
    /// block. Returns a function that stops delivery, or gives `self` and
    /// `f` back when the transport cannot (the default): the caller then
    /// runs a reader task on [`recv`](Self::recv).
    fn deliver_inline(self, f: InlineFn) -> Result<StopFn, (Self, InlineFn)>
    where
        Self: Sized,
    {
        Err((self, f))
    }
}

/// `head ++ body` in one buffer.
pub(crate) fn join(head: &[u8], body: &[u8]) -> Bytes {
    let mut b = bytes::BytesMut::with_capacity(head.len() + body.len());
    b.extend_from_slice(head);
    b.extend_from_slice(body);
    b.freeze()
}
