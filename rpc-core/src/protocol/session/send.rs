//! The send path of a session: control frames, and a call's DATA under
//! the call's window, the connection's window and the outbox's byte
//! budget (`docs/wire-protocol.md` §1.4), split into frames the transport
//! takes as one part or as a gather of two; and a unary call written
//! whole, its OPEN with the request or its reply, as one BATCH (§1.7).

use super::outbox::Pushed;
use super::{io_status, lock, CallWindow, InboundRx, Shared, OUT_QUEUE_BYTES};
use crate::protocol::frame;
use crate::protocol::message::Encoded;
use crate::protocol::window::SendWindow;
use bytes::Bytes;
use std::io;
use tonic::Status;

/// DATA payloads at least this large are sent as a gather (frame header and
/// payload as two parts) instead of being copied behind the header; smaller
/// ones are copied, which keeps them batchable (§1.7).
const GATHER_MIN_BYTES: usize = 8 << 10;

/// A DATA frame carrying `first` then `chunk`, as the transport takes it:
/// the frame's leading part, and a part sent as is (a gather: the transport
/// copies it once; empty when the frame is one part).
fn data_frame(id: u32, first: Bytes, chunk: Bytes, last: bool) -> (Bytes, Bytes) {
    if chunk.len() >= GATHER_MIN_BYTES {
        // Header (and the head's bytes), then the payload.
        (frame::encode_data(id, &first, last), chunk)
    } else if chunk.is_empty() && first.len() >= GATHER_MIN_BYTES {
        // A large head alone (a message without a large field taken
        // out): the same gather, the head as the payload.
        (frame::encode_data_head(id, last), first)
    } else {
        (
            frame::encode_data_joined(id, &first, &chunk, last),
            Bytes::new(),
        )
    }
}

impl Shared {
    /// Sends a control frame (not subject to the DATA budget). OPEN and
    /// HEADERS wait for the frame that usually follows them (see [`outbox`](super::outbox));
    /// the others are sent from this task when the connection takes them.
    ///
    /// Called with the state lock held only for a frame that is not flushed (OPEN).
    pub(crate) fn send_ctrl(&self, frame: Bytes) {
        let flush = !matches!(
            frame.first(),
            Some(&frame::kind::OPEN | &frame::kind::HEADERS)
        );
        let _ = self.push(frame, 0, flush);
    }

    /// As [`send_ctrl`](Self::send_ctrl) for an OPEN or HEADERS that this
    /// task follows with a flushing frame (its call's DATA with END_STREAM,
    /// or its TRAILERS) without waiting for anything else first, or with a
    /// wait that wakes the writer ([`reserve_or_wake`](Self::reserve_or_wake)): the writer
    /// is not woken for it (`outbox` module docs).
    pub(crate) fn send_ctrl_followed(&self, frame: Bytes) {
        let _ = self.push_parts_then(frame, Bytes::new(), 0, false, false);
    }

    /// Sends what this task queued without a flush
    /// ([`Outbox::flush_queued`](super::outbox::Outbox::flush_queued)).
    fn flush_queued(&self) {
        if let Pushed::Sent(sent) = self.outbox.flush_queued() {
            self.sent(sent.budget, &sent.result);
        }
    }

    /// Hands a frame to the outbox; false once the connection is closed.
    fn push(&self, frame: Bytes, budget: u32, flush: bool) -> bool {
        self.push_parts(frame, Bytes::new(), budget, flush)
    }

    /// Takes up to `want` bytes of `window`: at once when it is open, else
    /// after waking the session's writer and waiting. A task that pushed
    /// frames without waking the writer
    /// ([`send_ctrl_followed`](Self::send_ctrl_followed), a followed
    /// [`send_body`](Self::send_body)) so never sleeps with them unsent.
    /// The wait's state is boxed, made only when the window is shut: a
    /// call's future holds a pointer to it, not the state itself, and
    /// stays small (every move of a future copies all of it).
    async fn reserve_or_wake(&self, window: &SendWindow, want: usize) -> Result<usize, Status> {
        match window.try_reserve(want) {
            Some(r) => r,
            None => {
                self.outbox.wake_writer();
                Box::pin(window.reserve(want)).await
            }
        }
    }

    /// [`push`](Self::push) for the frame `head ++ body`, sent as a gather.
    fn push_parts(&self, head: Bytes, body: Bytes, budget: u32, flush: bool) -> bool {
        self.push_parts_then(head, body, budget, flush, true)
    }

    /// [`push_parts`](Self::push_parts); without `flush`, `wake` says whether
    /// the writer is woken for the frame.
    fn push_parts_then(
        &self,
        head: Bytes,
        body: Bytes,
        budget: u32,
        flush: bool,
        wake: bool,
    ) -> bool {
        match self.outbox.push_parts(head, body, budget, flush, wake) {
            Pushed::Queued => true,
            Pushed::Sent(sent) => {
                self.sent(sent.budget, &sent.result);
                true
            }
            Pushed::Closed => false,
        }
    }

    /// Frames holding `budget` DATA bytes left (or failed to): give the
    /// budget back; a send error is final for the connection.
    pub(super) fn sent(&self, budget: u32, r: &io::Result<()>) {
        if budget > 0 {
            self.out_budget.add_permits(budget as usize);
        }
        if let Err(e) = r {
            self.fail(io_status("lost the", &self.info, e));
        }
    }

    /// Queues a DATA frame after taking its bytes from the queue budget;
    /// `last` (END_STREAM) sends it, with what is queued, from this task.
    /// `followed`: this task pushes a flushing frame next, so the writer is
    /// not woken for this one ([`send_ctrl_followed`](Self::send_ctrl_followed)).
    async fn send_data(
        &self,
        frame: Bytes,
        n: usize,
        last: bool,
        followed: bool,
    ) -> Result<(), Status> {
        self.send_data_parts(frame, Bytes::new(), n, last, followed)
            .await
    }

    /// [`send_data`](Self::send_data) for a DATA frame given as its header
    /// and its payload (a gather: the payload is not copied here).
    async fn send_data_parts(
        &self,
        frame: Bytes,
        body: Bytes,
        n: usize,
        last: bool,
        followed: bool,
    ) -> Result<(), Status> {
        let n32 = n.min(OUT_QUEUE_BYTES) as u32;
        if !self.try_budget(n32)? {
            // Frames this task queued without waking the writer go first.
            self.outbox.wake_writer();
            // Boxed, as in `reserve_or_wake`: only a wait makes it.
            Box::pin(self.out_budget.acquire_many(n32))
                .await
                .map_err(|_| Status::unavailable("connection closed"))?
                .forget();
        }
        self.push_data(frame, body, n32, last, followed)
    }

    /// Takes `n` bytes of the outbox's budget if it has them now:
    /// `Ok(false)` (nothing taken) when taking them would wait.
    fn try_budget(&self, n: u32) -> Result<bool, Status> {
        if n == 0 {
            return Ok(true);
        }
        match self.out_budget.try_acquire_many(n) {
            Ok(p) => {
                p.forget();
                Ok(true)
            }
            Err(tokio::sync::TryAcquireError::Closed) => {
                Err(Status::unavailable("connection closed"))
            }
            Err(tokio::sync::TryAcquireError::NoPermits) => Ok(false),
        }
    }

    /// Queues a DATA frame whose `budget` was taken; `last` and `followed`
    /// as for [`send_data`](Self::send_data).
    fn push_data(
        &self,
        frame: Bytes,
        body: Bytes,
        budget: u32,
        last: bool,
        followed: bool,
    ) -> Result<(), Status> {
        if self.push_parts_then(frame, body, budget, last, !followed) {
            Ok(())
        } else {
            Err(self.closed_status())
        }
    }

    /// Sends body bytes of one call, split by window and frame size (§1.4).
    /// `followed`: when the body does not end here, this task pushes a
    /// flushing frame (its TRAILERS) right after, so its DATA frames do not
    /// wake the writer ([`send_ctrl_followed`](Self::send_ctrl_followed));
    /// every wait in between wakes it ([`reserve_or_wake`](Self::reserve_or_wake)), and so
    /// does a failure.
    pub(crate) fn send_body<'a>(
        &'a self,
        id: u32,
        window: &'a SendWindow,
        data: Bytes,
        end_stream: bool,
        followed: bool,
    ) -> impl std::future::Future<Output = Result<(), Status>> + Send + 'a {
        let msg = Encoded {
            head: Bytes::new(),
            tail: data,
        };
        self.send_message(id, window, msg, end_stream, followed)
    }

    /// [`send_body`](Self::send_body) for a body of one message encoded
    /// as its head and an uncopied tail (`message::encode_split`): the
    /// tail goes to the transport as a part of its own, so its bytes are
    /// copied once, by the transport.
    ///
    /// A message that fits one frame, with the windows and the outbox's
    /// budget open, goes at once ([`try_send_now`](Self::try_send_now));
    /// the frame loop, with its waits, runs in a box made only when one is
    /// needed. The future stays small: a call's future holds it, and every
    /// move of a future copies all of it. Not an `async fn`, which would
    /// keep its arguments twice in its state.
    #[allow(clippy::manual_async_fn)]
    pub(crate) fn send_message<'a>(
        &'a self,
        id: u32,
        window: &'a SendWindow,
        msg: Encoded,
        end_stream: bool,
        followed: bool,
    ) -> impl std::future::Future<Output = Result<(), Status>> + Send + 'a {
        async move {
            let r = match self.try_send_now(id, window, msg, end_stream, followed) {
                Ok(sent) => sent,
                Err(msg) => {
                    Box::pin(self.send_body_frames(id, window, msg, end_stream, followed)).await
                }
            };
            if r.is_err() {
                // Frames this task queued without waking the writer go now.
                self.outbox.wake_writer();
            }
            r
        }
    }

    /// Sends `msg` as one DATA frame if nothing has to wait: it fits one
    /// frame and the call's window, the connection's and the outbox's
    /// budget all have room for all of it now (each taken whole or not at
    /// all). `Err(msg)`: it did not go (what was taken is given back), the
    /// caller runs the frame loop.
    fn try_send_now(
        &self,
        id: u32,
        window: &SendWindow,
        msg: Encoded,
        end_stream: bool,
        followed: bool,
    ) -> Result<Result<(), Status>, Encoded> {
        let n = msg.head.len() + msg.tail.len();
        if n == 0 || n > self.max_last_data {
            return Err(msg);
        }
        let budget = match self.try_reserve_all(id, window, n) {
            Ok(Some(budget)) => budget,
            Ok(None) => return Err(msg),
            Err(st) => return Ok(Err(st)),
        };
        let (frame, body) = data_frame(id, msg.head, msg.tail, end_stream);
        Ok(self.push_data(frame, body, budget, end_stream, followed))
    }

    /// Takes `n` DATA bytes (`0 < n <= max_last_data`) of the call's window,
    /// the connection's and the outbox's budget, each whole or not at all:
    /// `Ok(Some(budget))`, the outbox budget the frame holds; `Ok(None)`
    /// when one of them would wait (what was taken is given back).
    fn try_reserve_all(
        &self,
        id: u32,
        window: &SendWindow,
        n: usize,
    ) -> Result<Option<u32>, Status> {
        // `n <= max_last_data`, a frame's payload: fits in u32.
        let n32 = u32::try_from(n).unwrap_or(u32::MAX);
        match window.try_reserve_exact(n) {
            Some(Ok(())) => {}
            Some(Err(st)) => return Err(st),
            None => return Ok(None),
        }
        let taken = self.try_reserve_shared(n);
        if !matches!(taken, Ok(Some(_))) {
            let _ = window.grant(id, n32);
        }
        taken
    }

    /// The part of [`try_reserve_all`](Self::try_reserve_all) every call
    /// shares: `n` bytes of the connection's window and the outbox's budget,
    /// both or neither; `Ok(Some(budget))` as there.
    fn try_reserve_shared(&self, n: usize) -> Result<Option<u32>, Status> {
        match self.conn_window.try_reserve_exact(n) {
            Some(Ok(())) => {}
            Some(Err(st)) => return Err(st),
            None => return Ok(None),
        }
        let budget = n.min(OUT_QUEUE_BYTES) as u32;
        let taken = self.try_budget(budget);
        if !matches!(taken, Ok(true)) {
            self.give_back_shared(u32::try_from(n).unwrap_or(u32::MAX), 0);
        }
        taken.map(|t| t.then_some(budget))
    }

    /// Gives back what [`try_reserve_all`](Self::try_reserve_all) took for
    /// `n` bytes that were not sent after all (`budget`: its outbox budget,
    /// 0 if that was not taken).
    fn give_back(&self, id: u32, window: &SendWindow, n: u32, budget: u32) {
        self.give_back_shared(n, budget);
        let _ = window.grant(id, n);
    }

    /// Gives back what [`try_reserve_shared`](Self::try_reserve_shared)
    /// took (`budget` 0: the outbox's was not taken).
    fn give_back_shared(&self, n: u32, budget: u32) {
        if budget > 0 {
            self.out_budget.add_permits(budget as usize);
        }
        let _ = self.conn_window.grant(0, n);
    }

    /// Client: [`open_stream`](Shared::open_stream) for a call whose whole
    /// request is one small message of `n` bytes, written with its OPEN as
    /// one BATCH of `len` bytes by `open` (`frame::encode_open_request`:
    /// OPEN, then DATA with END_STREAM) and sent from this task: one push
    /// instead of two, and no BATCH copied together from the frames.
    ///
    /// It goes this way when the peer takes BATCH, the message is small (no
    /// gather) and within the new call's window, the BATCH fits
    /// `max_batch_bytes`, and the connection's window and the outbox's
    /// budget have room now; `Ok(None)` otherwise, with nothing opened or
    /// taken: the caller opens the call as usual. `open` must not fail
    /// (the caller checked the metadata: `frame::check_metadata_with`).
    pub(crate) fn try_open_with_request(
        &self,
        n: usize,
        len: usize,
        open: impl FnOnce(u32) -> Bytes,
    ) -> Result<Option<(u32, InboundRx, CallWindow)>, Status> {
        if n == 0
            || n > self.max_last_data
            || n >= GATHER_MIN_BYTES
            || n > self.peer.initial_window as usize
            || len > self.outbox.batch_max()
        {
            return Ok(None);
        }
        // `n` is below GATHER_MIN_BYTES: fits in u32.
        let n32 = n as u32;
        let Some(budget) = self.try_reserve_shared(n)? else {
            return Ok(None);
        };
        let mut s = lock(&self.state);
        let (id, rx, window) = match self.open_locked(&mut s) {
            Ok(opened) => opened,
            Err(st) => {
                drop(s);
                self.give_back_shared(n32, budget);
                return Err(st);
            }
        };
        // A new call's window is the peer's initial window, `n` or more:
        // taking `n` of it cannot wait.
        let took = window.try_reserve_exact(n);
        debug_assert!(matches!(took, Some(Ok(()))), "{took:?}");
        // Under the lock, as every OPEN (ids in order); sent after it.
        let _ = self.push_parts_then(open(id), Bytes::new(), budget, false, false);
        drop(s);
        self.flush_queued();
        Ok(Some((id, rx, window)))
    }

    /// A unary call's reply, HEADERS (`md`, then `extra`), its one message
    /// and the TRAILERS `grpc-status: 0`, written as one BATCH message and
    /// sent from this task (`frame::encode_unary_reply`, §1.7): one
    /// encoding and one push instead of three frames queued, then copied
    /// into a BATCH. It goes this way when the peer takes BATCH, the
    /// message is small (no gather) and the whole fits one BATCH, and the
    /// windows and the outbox's budget have room now; `Err(msg)` otherwise,
    /// with nothing sent or taken: the caller sends the three frames as
    /// usual (which also reports metadata over the peer's limit).
    pub(crate) fn try_send_unary_reply(
        &self,
        id: u32,
        window: &SendWindow,
        md: &http::HeaderMap,
        extra: &[(&str, &[u8])],
        msg: Encoded,
    ) -> Result<Result<(), Status>, Encoded> {
        let n = msg.head.len() + msg.tail.len();
        if n == 0 || n > self.max_last_data || n >= GATHER_MIN_BYTES {
            return Err(msg);
        }
        // The metadata is walked once to check it and size the message,
        // before anything is taken; over the limit, the usual way reports it.
        let limit = self.peer.max_metadata_bytes as usize;
        let Ok(md_wire) = frame::check_unary_reply(md, extra, limit) else {
            return Err(msg);
        };
        if frame::unary_reply_len(md_wire, n) > self.outbox.batch_max() {
            return Err(msg);
        }
        let budget = match self.try_reserve_all(id, window, n) {
            Ok(Some(budget)) => budget,
            Ok(None) => return Err(msg),
            Err(st) => return Ok(Err(st)),
        };
        match frame::encode_unary_reply(id, md, extra, md_wire, &msg.head, &msg.tail) {
            Ok(batch) => {
                if self.push_parts_then(batch, Bytes::new(), budget, true, true) {
                    Ok(Ok(()))
                } else {
                    Ok(Err(self.closed_status()))
                }
            }
            Err(_) => {
                // Not after the check above; should it happen, nothing was
                // sent. `n` fits in u32 (checked against a frame's payload).
                self.give_back(id, window, n as u32, budget);
                Err(msg)
            }
        }
    }

    async fn send_body_frames(
        &self,
        id: u32,
        window: &SendWindow,
        msg: Encoded,
        end_stream: bool,
        followed: bool,
    ) -> Result<(), Status> {
        let Encoded {
            mut head,
            tail: mut data,
        } = msg;
        if head.is_empty() && data.is_empty() {
            if end_stream {
                return self
                    .send_data(frame::encode_data(id, &[], true), 0, true, false)
                    .await;
            }
            return Ok(());
        }
        while !head.is_empty() || !data.is_empty() {
            // Stream credit first (only this call can use it), then connection credit;
            // stream credit not covered by the connection's goes back (§1.4).
            let left = head.len() + data.len();
            let want = if left <= self.max_last_data {
                left
            } else {
                self.max_data
            };
            let n = self.reserve_or_wake(window, want).await?;
            let k = self.reserve_or_wake(&self.conn_window, n).await?;
            if k < n {
                // `k < n <= max_last_data`, a frame's payload: fits in u32.
                let _ = window.grant(id, u32::try_from(n - k).unwrap_or(u32::MAX));
            }
            let n = k;
            // The frame's payload: what is left of the head, then the tail.
            let first = head.split_to(n.min(head.len()));
            let chunk = data.split_to(n - first.len());
            let last = end_stream && head.is_empty() && data.is_empty();
            // Frames before the body's last are followed by it.
            let followed = followed || (end_stream && !last);
            let (frame, body) = data_frame(id, first, chunk, last);
            self.send_data_parts(frame, body, n, last, followed).await?;
        }
        Ok(())
    }
}
