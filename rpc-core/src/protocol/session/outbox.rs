//! A session's outgoing frames: sent by the task that makes them when it can,
//! queued for the session's writer task when it cannot.
//!
//! Frames leave in the order they were pushed (`docs/wire-protocol.md` §1.3
//! needs OPENs in id order, §1.4 DATA before its call's end). The
//! connection's [`FrameSender`](crate::conn::FrameSender) sits *idle* in the
//! outbox while nobody is sending; the writer task takes it out while it
//! awaits a back-pressured send and puts it back afterwards. A pushed frame
//! goes out:
//!
//! * *directly*, from the pushing task, when it asked for a flush, nothing
//!   else is queued and the sender is idle and not back-pressured (its
//!   [`try_send`](crate::conn::FrameSender::try_send) takes the frame): no task
//!   hop. The frames queued before it leave with it, as one BATCH message
//!   (§1.7) when the peer supports it;
//! * otherwise through the queue: the writer task is woken and sends it.
//!
//! Frames that a flush usually follows at once (OPEN before a unary
//! request's DATA, response HEADERS and DATA before the TRAILERS) are pushed
//! without a flush: the writer is woken for them as a backstop, but the task
//! that ends the call usually sends them first, all in one message. A task
//! that *knows* it pushes a flushing frame next (a unary call whose request
//! or reply is all there) pushes without waking the writer at all
//! (`wake: false`): it then flushes, or wakes the writer itself before it
//! waits for anything (`Shared::reserve_or_wake`), so a frame never waits unsent
//! behind a task that sleeps.

use crate::conn::FrameSender;
use crate::protocol::frame;
use bytes::Bytes;
use futures::future::BoxFuture;
use std::collections::VecDeque;
use std::io;
use std::sync::Mutex;
use tokio::sync::Notify;

/// A [`FrameSender`] behind a pointer, so [`Outbox`] needs no type parameter.
trait ErasedSender: Send {
    fn try_send(&mut self, frame: Bytes, body: Bytes) -> Result<io::Result<()>, (Bytes, Bytes)>;
    fn send(&mut self, frame: Bytes, body: Bytes) -> BoxFuture<'_, io::Result<()>>;
    fn close(&mut self) -> BoxFuture<'_, ()>;
}

/// A frame with an empty `body` goes out as one part (`send`), one with a
/// body as a gather (`send_parts`).
impl<S: FrameSender> ErasedSender for S {
    fn try_send(&mut self, frame: Bytes, body: Bytes) -> Result<io::Result<()>, (Bytes, Bytes)> {
        if body.is_empty() {
            FrameSender::try_send(self, frame).map_err(|f| (f, body))
        } else {
            FrameSender::try_send_parts(self, frame, body)
        }
    }
    fn send(&mut self, frame: Bytes, body: Bytes) -> BoxFuture<'_, io::Result<()>> {
        if body.is_empty() {
            Box::pin(FrameSender::send(self, frame))
        } else {
            Box::pin(FrameSender::send_parts(self, frame, body))
        }
    }
    fn close(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(FrameSender::close(self))
    }
}

/// One queued connection message and the DATA budget it holds: `msg`,
/// followed by `body` when that is not empty (a DATA frame's header and its
/// payload, sent as a gather, never batched).
struct Out {
    msg: Bytes,
    body: Bytes,
    budget: u32,
    /// `msg` is in a buffer of its own, not a piece of the thread's frame
    /// buffer (see [`Out::own`]).
    owned: bool,
}

impl Out {
    /// Small frames are encoded into the thread's shared frame buffer
    /// ([`crate::arena`]), where a piece that waits keeps the whole
    /// buffer alive. A frame that waits behind a busy writer (a
    /// back-pressured connection: the peer does not take more) gets a
    /// buffer of its own first, so what a stalled peer makes us hold is
    /// bounded by the frames' own sizes, as it was before that buffer.
    fn own(&mut self) {
        if !self.owned {
            if self.msg.len() <= crate::arena::CHUNK {
                self.msg = Bytes::copy_from_slice(&self.msg);
            }
            self.owned = true;
        }
    }
}

impl Inner {
    /// The writer's next message, taken with the sender for a send that may
    /// wait: it and every frame queued behind it in buffers of their own
    /// (`Out::own`).
    fn take_for_writer(&mut self, batch_max: usize) -> Out {
        let mut out = take_message(&mut self.queue, batch_max, false);
        out.own();
        self.queue.iter_mut().for_each(Out::own);
        out
    }
}

struct Inner {
    queue: VecDeque<Out>,
    /// The sender while nobody uses it; `None` while the writer awaits a send
    /// and after it closed the connection.
    idle: Option<Box<dyn ErasedSender>>,
    /// Set once the writer ended: nothing is sent any more.
    done: bool,
}

/// What became of a pushed frame.
pub(super) enum Pushed {
    /// Waits in the queue for the writer (or a later flush).
    Queued,
    /// This task sent the queue, the frame included, or tried to.
    Sent(Sent),
    /// The writer ended: the connection is closed, the frame dropped.
    Closed,
}

/// What a direct send did.
pub(super) struct Sent {
    /// DATA budget of the frames that left (to give back to the session).
    pub(super) budget: u32,
    /// The sender's error, final for the connection.
    pub(super) result: io::Result<()>,
}

/// The outgoing side of one session (see the module docs).
pub(super) struct Outbox {
    inner: Mutex<Inner>,
    /// Wakes the writer: frames were queued, or the session is shutting down.
    wake: Notify,
    /// Largest BATCH message, 0 when the peer does not take BATCH (§1.7).
    batch_max: usize,
}

impl Outbox {
    pub(super) fn new<S: FrameSender>(tx: S, batch_max: usize) -> Outbox {
        Outbox {
            inner: Mutex::new(Inner {
                queue: VecDeque::new(),
                idle: Some(Box::new(tx)),
                done: false,
            }),
            wake: Notify::new(),
            batch_max,
        }
    }

    /// Largest BATCH message, 0 when the peer does not take BATCH (§1.7).
    pub(super) fn batch_max(&self) -> usize {
        self.batch_max
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `frame` (holding `budget` DATA bytes); with `flush`, sends the
    /// queue from this task if the sender is idle and takes it without
    /// waiting.
    #[cfg(test)]
    pub(super) fn push(&self, frame: Bytes, budget: u32, flush: bool) -> Pushed {
        self.push_parts(frame, Bytes::new(), budget, flush, true)
    }

    /// Queues the frame `head ++ body` (holding `budget` DATA bytes), sent as a
    /// gather (the payload is not copied into a frame buffer first). Without
    /// `flush`, `wake` says whether the writer is woken for it (see the
    /// module docs for who may leave it asleep).
    pub(super) fn push_parts(
        &self,
        head: Bytes,
        body: Bytes,
        budget: u32,
        flush: bool,
        wake: bool,
    ) -> Pushed {
        let mut inner = self.lock();
        if inner.done {
            return Pushed::Closed;
        }
        inner.queue.push_back(Out {
            msg: head,
            body,
            budget,
            owned: false,
        });
        let sent = if flush { self.flush(&mut inner) } else { None };
        if inner.idle.is_none() {
            // The writer is busy (it holds the sender across a send the
            // connection is not ready for): this frame will wait.
            if let Some(o) = inner.queue.back_mut() {
                o.own();
            }
        }
        let queued = !inner.queue.is_empty();
        drop(inner);
        if queued && (flush || wake) {
            self.wake.notify_one();
        }
        sent.map_or(Pushed::Queued, Pushed::Sent)
    }

    /// Sends what is queued from this task if the sender is idle and takes
    /// it without waiting, as a flushing push does, with nothing to push
    /// (frames pushed `wake: false` under a lock this task held).
    pub(super) fn flush_queued(&self) -> Pushed {
        let mut inner = self.lock();
        if inner.done {
            return Pushed::Closed;
        }
        let sent = self.flush(&mut inner);
        let queued = !inner.queue.is_empty();
        drop(inner);
        if queued {
            self.wake.notify_one();
        }
        sent.map_or(Pushed::Queued, Pushed::Sent)
    }

    /// Sends queued messages while the idle sender takes them at once.
    fn flush(&self, inner: &mut Inner) -> Option<Sent> {
        let mut tx = inner.idle.take()?;
        let mut total = 0u32;
        let mut result = Ok(());
        while !inner.queue.is_empty() {
            let Out {
                msg, body, budget, ..
            } = take_message(&mut inner.queue, self.batch_max, true);
            match tx.try_send(msg, body) {
                Ok(r) => {
                    total = total.saturating_add(budget);
                    if r.is_err() {
                        result = r;
                        break;
                    }
                }
                Err((msg, body)) => {
                    // Back-pressured: the writer waits for room. The message
                    // may already be a BATCH; `take_message` never nests it.
                    inner.queue.push_front(Out {
                        msg,
                        body,
                        budget,
                        owned: false,
                    });
                    break;
                }
            }
        }
        inner.idle = Some(tx);
        Some(Sent {
            budget: total,
            result,
        })
    }

    /// Wakes the writer (shutdown: it sends what is queued, then closes).
    pub(super) fn wake_writer(&self) {
        self.wake.notify_one();
    }

    /// The writer task's loop: sends what the pushing tasks could not, until
    /// `shut()` says the session ended and the queue is empty; then closes
    /// the connection. `on_sent` gets each message's budget and result; an
    /// error ends the loop.
    pub(super) async fn run_writer(
        &self,
        shut: impl Fn() -> bool,
        on_sent: impl Fn(u32, &io::Result<()>),
    ) {
        let mut woken = false;
        loop {
            if std::mem::take(&mut woken) && !self.lock().queue.is_empty() {
                // Woken with frames to send: let the tasks that are ready
                // now queue theirs too, so they leave in one BATCH rather
                // than one message each (under load; a quiet connection's
                // frames were sent by their own tasks and the queue is empty).
                tokio::task::yield_now().await;
            }
            let next = {
                let mut inner = self.lock();
                if inner.queue.is_empty() {
                    None
                } else {
                    // Only the writer keeps the sender across an await, so
                    // it is idle here unless the connection was closed.
                    let tx = inner.idle.take();
                    tx.map(|tx| (tx, inner.take_for_writer(self.batch_max)))
                }
            };
            let Some((mut tx, out)) = next else {
                if shut() {
                    break;
                }
                self.wake.notified().await;
                woken = true;
                continue;
            };
            let r = tx.send(out.msg, out.body).await;
            on_sent(out.budget, &r);
            self.lock().idle = Some(tx);
            if r.is_err() {
                break;
            }
        }
        let tx = {
            let mut inner = self.lock();
            inner.done = true;
            inner.queue.clear();
            inner.idle.take()
        };
        if let Some(mut tx) = tx {
            tx.close().await;
        }
    }
}

/// Pops the next connection message: the first queued frame, with the frames
/// after it in one BATCH while they fit in `batch_max` (§1.7). A queued
/// message that is already a BATCH (a unary call's whole request or reply,
/// written at once; or one put back after back-pressure) joins it with its
/// parts as they are: a BATCH is never nested, and never sent alone when
/// frames beside it could share its message. A BATCH is built in the
/// thread's frame buffer for a message sent at once (`shared`), in a buffer
/// of its own for one that may wait.
fn take_message(queue: &mut VecDeque<Out>, batch_max: usize, shared: bool) -> Out {
    let Some(first) = queue.pop_front() else {
        return Out {
            msg: Bytes::new(),
            body: Bytes::new(),
            budget: 0,
            owned: true,
        };
    };
    let batchable = |o: &Out| o.body.is_empty();
    let mut size = frame::HEADER_LEN + batch_share(&first.msg);
    if size > batch_max || !batchable(&first) {
        return first;
    }
    let mut n = 0;
    for o in queue.iter() {
        if !batchable(o) || size + batch_share(&o.msg) > batch_max {
            break;
        }
        size += batch_share(&o.msg);
        n += 1;
    }
    if n == 0 {
        return first;
    }
    // Encoded straight into the BATCH (as `frame::encode_batch` does), with
    // no list of the parts in between.
    let mut budget = first.budget;
    let parts = |b: &mut bytes::BytesMut| {
        put_batch_share(b, &first.msg);
        for o in queue.drain(..n) {
            budget = budget.saturating_add(o.budget);
            put_batch_share(b, &o.msg);
        }
    };
    let msg = if shared {
        frame::batch_with(size, parts)
    } else {
        frame::batch_owned(size, parts)
    };
    Out {
        msg,
        body: Bytes::new(),
        budget,
        owned: !shared,
    }
}

/// Whether a queued message is a BATCH (made whole by this side: its parts
/// are well formed).
fn is_batch(msg: &[u8]) -> bool {
    msg.first() == Some(&frame::kind::BATCH) && msg.len() >= frame::HEADER_LEN
}

/// Bytes `msg` adds to a BATCH: a BATCH its parts, a frame itself behind
/// its length.
fn batch_share(msg: &[u8]) -> usize {
    if is_batch(msg) {
        msg.len() - frame::HEADER_LEN
    } else {
        4 + msg.len()
    }
}

/// Appends `msg` to a BATCH being built ([`batch_share`]).
fn put_batch_share(b: &mut bytes::BytesMut, msg: &[u8]) {
    if is_batch(msg) {
        b.extend_from_slice(&msg[frame::HEADER_LEN..]);
    } else {
        frame::put_batch_part(b, msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::{mem, Connection, FrameReceiver};
    use std::sync::Arc;

    fn data(stream: u32, byte: u8, end: bool) -> Bytes {
        frame::encode_data(stream, &[byte], end)
    }

    fn pushed_sent(p: Pushed) -> Sent {
        match p {
            Pushed::Sent(s) => s,
            Pushed::Queued => panic!("queued, expected a direct send"),
            Pushed::Closed => panic!("closed, expected a direct send"),
        }
    }

    /// A push that leaves the writer asleep (`wake: false`) gives it no
    /// wake-up; one that does not say so, or a flush, does.
    #[tokio::test(flavor = "current_thread")]
    async fn a_followed_push_leaves_the_writer_asleep() {
        use futures::FutureExt;
        let (a, _b) = mem::pair();
        let (tx, _) = a.split();
        let out = Outbox::new(tx, 1024);
        let quiet = out.push_parts(data(1, 1, false), Bytes::new(), 1, false, false);
        assert!(matches!(quiet, Pushed::Queued));
        assert!(
            out.wake.notified().now_or_never().is_none(),
            "no wake-up for a followed push"
        );
        assert!(matches!(
            out.push_parts(data(3, 1, false), Bytes::new(), 1, false, true),
            Pushed::Queued
        ));
        assert!(
            out.wake.notified().now_or_never().is_some(),
            "a plain push wakes the writer"
        );
        assert_eq!(out.lock().queue.len(), 2);
    }

    /// Without a flush a frame waits; the flushing push sends it and the
    /// frame after it as one BATCH from the pushing task: the peer has the
    /// message before any other task ran.
    #[tokio::test(flavor = "current_thread")]
    async fn flush_sends_queue_as_one_batch_from_the_caller() {
        let (a, b) = mem::pair();
        let (tx, _) = a.split();
        let (_, mut rx) = b.split();
        let out = Outbox::new(tx, 1024);
        assert!(matches!(
            out.push(data(1, 1, false), 1, false),
            Pushed::Queued
        ));
        let sent = pushed_sent(out.push(data(1, 2, true), 1, true));
        assert!(sent.result.is_ok());
        assert_eq!(sent.budget, 2, "both frames' budget comes back");
        let msg = rx.recv().now_or_never_ready();
        assert_eq!(
            msg,
            frame::encode_batch(&[data(1, 1, false), data(1, 2, true)])
        );
        assert!(out.lock().queue.is_empty());
    }

    /// A gather (header + payload) is never folded into a BATCH: it leaves
    /// as its own message, between its neighbours, with its bytes joined by
    /// the memory transport's default `send_parts`.
    #[tokio::test(flavor = "current_thread")]
    async fn a_gather_leaves_alone_and_in_order() {
        let (a, b) = mem::pair();
        let (tx, _) = a.split();
        let (_, mut rx) = b.split();
        let out = Outbox::new(tx, 1 << 20);
        let payload = Bytes::from(vec![7u8; 10_000]);
        let _ = out.push(data(1, 1, false), 1, false);
        let _ = out.push_parts(
            frame::encode_data_head(1, false),
            payload.clone(),
            9,
            false,
            true,
        );
        let sent = pushed_sent(out.push(data(1, 2, true), 1, true));
        assert!(sent.result.is_ok());
        assert_eq!(sent.budget, 11);
        assert_eq!(rx.recv().now_or_never_ready(), data(1, 1, false));
        assert_eq!(
            rx.recv().now_or_never_ready(),
            frame::encode_data(1, &payload, false)
        );
        assert_eq!(rx.recv().now_or_never_ready(), data(1, 2, true));
    }

    /// Frames that wait behind a busy writer do not keep pieces of the
    /// thread's shared frame buffer alive: each is moved to a buffer of its
    /// own (a stalled peer would otherwise make us hold a whole shared
    /// buffer per waiting frame). Frames sent at once are not copied.
    #[tokio::test(flavor = "current_thread")]
    async fn frames_that_wait_behind_a_busy_writer_get_buffers_of_their_own() {
        let (a, _b) = mem::pair();
        let (tx, _) = a.split();
        let out = Outbox::new(tx, 1024);
        // Pushed while the sender is idle: queued as encoded (a piece of the
        // thread's frame buffer), waiting for the flush that usually follows.
        let f1 = data(1, 1, false);
        let _ = out.push(f1.clone(), 1, false);
        {
            let inner = out.lock();
            let q = inner.queue.back().unwrap();
            assert!(!q.owned && q.msg.as_ptr() == f1.as_ptr(), "not copied");
        }
        // The writer takes the sender for a send that waits: the frame it
        // sends and those queued behind it get their own buffers...
        let (tx, taken) = {
            let mut inner = out.lock();
            let tx = inner.idle.take().unwrap();
            (tx, inner.take_for_writer(1024))
        };
        assert!(taken.owned && taken.msg == f1 && taken.msg.as_ptr() != f1.as_ptr());
        // ...and so does every frame pushed while it is busy.
        let f2 = data(1, 2, false);
        assert!(matches!(
            out.push(f2.clone(), 1, true),
            Pushed::Sent(_) | Pushed::Queued
        ));
        {
            let inner = out.lock();
            let q = inner.queue.back().unwrap();
            assert!(q.owned && q.msg == f2 && q.msg.as_ptr() != f2.as_ptr());
        }
        out.lock().idle = Some(tx);
    }

    /// A message already written as a BATCH (a unary reply) joins the
    /// frames queued beside it with its parts as they are: one BATCH of
    /// every frame, in order, none nested; alone, it leaves as it is.
    #[tokio::test(flavor = "current_thread")]
    async fn a_batch_joins_the_frames_beside_it_flat() {
        let (a, b) = mem::pair();
        let (tx, _) = a.split();
        let (_, mut rx) = b.split();
        let out = Outbox::new(tx, 1024);
        let reply = frame::encode_batch(&[data(3, 1, false), data(3, 2, false)]);
        let _ = out.push(data(1, 1, false), 1, false);
        let _ = out.push(reply.clone(), 2, false);
        let sent = pushed_sent(out.push(data(5, 1, true), 1, true));
        assert_eq!(sent.budget, 4);
        assert_eq!(
            rx.recv().now_or_never_ready(),
            frame::encode_batch(&[
                data(1, 1, false),
                data(3, 1, false),
                data(3, 2, false),
                data(5, 1, true)
            ])
        );
        // First in the queue, then a frame: the same, flat.
        let _ = out.push(reply.clone(), 2, false);
        let _ = pushed_sent(out.push(data(5, 2, true), 1, true));
        assert_eq!(
            rx.recv().now_or_never_ready(),
            frame::encode_batch(&[data(3, 1, false), data(3, 2, false), data(5, 2, true)])
        );
        // Alone: as it was written.
        let _ = pushed_sent(out.push(reply.clone(), 2, true));
        assert_eq!(rx.recv().now_or_never_ready(), reply);
        // Two that do not fit one message together leave one by one.
        let out = |msg: &Bytes| Out {
            msg: msg.clone(),
            body: Bytes::new(),
            budget: 2,
            owned: false,
        };
        let mut queue = VecDeque::from([out(&reply), out(&reply)]);
        assert_eq!(take_message(&mut queue, reply.len() + 4, true).msg, reply);
        assert_eq!(take_message(&mut queue, reply.len() + 4, true).msg, reply);
        assert!(queue.is_empty());
    }

    /// Without BATCH support each frame leaves as its own message, in order.
    #[tokio::test(flavor = "current_thread")]
    async fn flush_without_batch_keeps_frames_apart_and_in_order() {
        let (a, b) = mem::pair();
        let (tx, _) = a.split();
        let (_, mut rx) = b.split();
        let out = Outbox::new(tx, 0);
        let _ = out.push(data(1, 1, false), 0, false);
        let _ = out.push(data(3, 2, false), 0, false);
        assert!(pushed_sent(out.push(data(1, 3, true), 0, true))
            .result
            .is_ok());
        for (s, byte, end) in [(1, 1, false), (3, 2, false), (1, 3, true)] {
            assert_eq!(rx.recv().now_or_never_ready(), data(s, byte, end));
        }
    }

    /// A back-pressured connection (the peer's queue full) queues the frame;
    /// the writer sends it, after the frames before it, once there is room.
    #[tokio::test(flavor = "current_thread")]
    async fn back_pressure_goes_through_the_writer_in_order() {
        let (a, b) = mem::pair();
        let (tx, _) = a.split();
        let (_, mut rx) = b.split();
        let out = Arc::new(Outbox::new(tx, 0));
        for i in 0..mem::MEM_QUEUE_FRAMES {
            let s = pushed_sent(out.push(data(1, i as u8, false), 0, true));
            assert!(s.result.is_ok());
        }
        // Full: both wait, in order, and nothing was lost.
        let s = pushed_sent(out.push(data(1, 200, false), 7, true));
        assert_eq!(s.budget, 0, "nothing left from here");
        let _ = out.push(data(1, 201, true), 0, true);
        assert_eq!(out.lock().queue.len(), 2);
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let budget = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let w = {
            let (out, done, budget) = (out.clone(), done.clone(), budget.clone());
            tokio::spawn(async move {
                out.run_writer(
                    || done.load(std::sync::atomic::Ordering::Acquire),
                    |b, r| {
                        assert!(r.is_ok());
                        budget.fetch_add(b, std::sync::atomic::Ordering::Relaxed);
                    },
                )
                .await
            })
        };
        for i in 0..mem::MEM_QUEUE_FRAMES {
            assert_eq!(rx.recv().await.unwrap().unwrap(), data(1, i as u8, false));
        }
        assert_eq!(rx.recv().await.unwrap().unwrap(), data(1, 200, false));
        assert_eq!(rx.recv().await.unwrap().unwrap(), data(1, 201, true));
        assert_eq!(budget.load(std::sync::atomic::Ordering::Relaxed), 7);
        done.store(true, std::sync::atomic::Ordering::Release);
        out.wake_writer();
        w.await.unwrap();
        // The writer closed the connection and the outbox refuses frames.
        assert_eq!(rx.recv().await.unwrap(), None);
        assert!(matches!(
            out.push(data(1, 0, true), 0, true),
            Pushed::Closed
        ));
    }

    trait ReadyExt {
        fn now_or_never_ready(self) -> Bytes;
    }

    impl<F: std::future::Future<Output = io::Result<Option<Bytes>>>> ReadyExt for F {
        /// The received message, which must be there without waiting.
        fn now_or_never_ready(self) -> Bytes {
            use futures::FutureExt;
            self.now_or_never()
                .expect("message not delivered by the pushing task")
                .expect("recv failed")
                .expect("connection closed")
        }
    }
}
