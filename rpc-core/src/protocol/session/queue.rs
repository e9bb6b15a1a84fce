//! A call's inbound queue: what the session's reader hands one call.
//!
//! Unbounded, one consumer (the call's task), one logical producer (the
//! reader; the stream map holds the sender). It needs no bound of its own:
//! the receive window granted to the peer bounds the DATA in it
//! (`docs/wire-protocol.md` §1.4). Lighter than a tokio mpsc, which allocates
//! a block of 32 slots per channel: here a call costs the shared state and a
//! small buffer on first use.

use super::Inbound;
use crate::protocol::window::SendWindow;
use bytes::Bytes;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

struct State {
    items: Items,
    /// The receiver's task, while it waits.
    waker: Option<Waker>,
    /// Live senders; none left (and the queue empty) ends the stream.
    senders: usize,
    /// False once the receiver was dropped: sends fail.
    rx_alive: bool,
}

/// A FIFO that holds its first [`INLINE`] items in place: a unary call's
/// queue (HEADERS, DATA, TRAILERS at the client; DATA, end at the server)
/// never allocates a buffer of its own.
#[derive(Default)]
struct Items {
    ring: [Option<Inbound>; INLINE],
    head: usize,
    len: usize,
    /// Items behind the ring's, once it was full (FIFO: while this is not
    /// empty, new items go here too).
    overflow: VecDeque<Inbound>,
}

/// Items a call's queue holds without allocating.
const INLINE: usize = 4;

impl Items {
    #[inline]
    fn push_back(&mut self, m: Inbound) {
        if self.len < INLINE && self.overflow.is_empty() {
            self.ring[(self.head + self.len) % INLINE] = Some(m);
            self.len += 1;
        } else {
            self.overflow.push_back(m);
        }
    }

    fn pop_front(&mut self) -> Option<Inbound> {
        if self.len > 0 {
            let m = self.ring[self.head].take();
            self.head = (self.head + 1) % INLINE;
            self.len -= 1;
            m
        } else {
            self.overflow.pop_front()
        }
    }
}

/// One call's shared state: its inbound queue and its send window, in one
/// allocation (the call and the session's stream map both hold both).
struct Queue {
    state: Mutex<State>,
    window: SendWindow,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn new(initial_window: u32) -> Queue {
        Queue {
            state: Mutex::new(State {
                items: Items::default(),
                waker: None,
                senders: 1,
                rx_alive: true,
            }),
            window: SendWindow::new(initial_window),
        }
    }
}

/// Queues whose call ended, kept for the next calls made on this thread: a
/// few, since each holds its ring of items in place (about 1 KiB), and what
/// the pool keeps stays allocated for the thread's life. A connection that
/// calls one at a time reuses one or two.
const POOL_MAX: usize = 4;

thread_local! {
    /// Ended calls' queues, emptied, each held by nothing else: a steady
    /// stream of calls reuses them instead of allocating one per call.
    static POOL: RefCell<Vec<Arc<Queue>>> = const { RefCell::new(Vec::new()) };
}

/// Creates a call's queue, with its send window of `initial_window` bytes
/// (`docs/wire-protocol.md` §1.4); the allocation of an ended call's queue
/// is reused when this thread has one.
pub(crate) fn channel(initial_window: u32) -> (InboundTx, InboundRx, CallWindow) {
    let reused = POOL
        .try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.pop()))
        .ok()
        .flatten();
    let q = match reused {
        Some(mut q) => match Arc::get_mut(&mut q) {
            Some(inner) => {
                *inner = Queue::new(initial_window);
                q
            }
            // Unreachable (the pool holds the only reference), but cheap.
            None => Arc::new(Queue::new(initial_window)),
        },
        None => Arc::new(Queue::new(initial_window)),
    };
    (
        InboundTx(Handle(Some(q.clone()))),
        InboundRx {
            queue: Handle(Some(q.clone())),
            closed: false,
        },
        CallWindow(Handle(Some(q))),
    )
}

/// One reference to a call's queue; the last one to go puts the queue's
/// allocation back into the thread's pool.
#[derive(Clone)]
struct Handle(Option<Arc<Queue>>);

impl std::ops::Deref for Handle {
    type Target = Queue;
    fn deref(&self) -> &Queue {
        // `None` only inside `drop`.
        self.0.as_deref().expect("queue handle used after drop")
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let Some(mut q) = self.0.take() else { return };
        // Another handle is left (or two are dropped at once on two threads
        // and neither sees itself last: then the queue is simply freed).
        let Some(inner) = Arc::get_mut(&mut q) else {
            return;
        };
        // Emptied now: what a dead call left queued may be large.
        let s = inner.state.get_mut().unwrap_or_else(|e| e.into_inner());
        s.items = Items::default();
        s.waker = None;
        let _ = POOL.try_with(move |p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                if p.len() < POOL_MAX {
                    p.push(q);
                }
            }
        });
    }
}

/// A call's send window (shared with its queue's allocation).
#[derive(Clone)]
pub(crate) struct CallWindow(Handle);

impl std::ops::Deref for CallWindow {
    type Target = SendWindow;
    fn deref(&self) -> &SendWindow {
        &self.0.window
    }
}

impl std::fmt::Debug for CallWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.window.fmt(f)
    }
}

/// The reader's end of a call's queue.
pub(crate) struct InboundTx(Handle);

impl InboundTx {
    /// Queues `m`; gives it back when the receiver is gone.
    pub(crate) fn send(&self, m: Inbound) -> Result<(), Inbound> {
        let mut s = self.0.lock();
        if !s.rx_alive {
            return Err(m);
        }
        s.items.push_back(m);
        let w = s.waker.take();
        drop(s);
        if let Some(w) = w {
            w.wake();
        }
        Ok(())
    }

    /// Queues a DATA frame's bytes (when there are any) and, when it ends
    /// its stream, the end, under one lock; `None` when the receiver is
    /// gone (nothing is queued then). The receiver is woken by the
    /// [`Wake`] returned, which the caller runs once it let go of its own
    /// locks (the stream table's: a woken call may want it at once).
    pub(crate) fn queue_data(&self, data: Bytes, end: bool) -> Option<Wake> {
        self.queue_with(|items| {
            if !data.is_empty() {
                items.push_back(Inbound::Data(data));
            }
            if end {
                items.push_back(Inbound::End);
            }
        })
    }

    /// Queues `m` as [`queue_data`](Self::queue_data) does; `None` when the
    /// receiver is gone.
    pub(crate) fn queue(&self, m: Inbound) -> Option<Wake> {
        self.queue_with(|items| items.push_back(m))
    }

    fn queue_with(&self, push: impl FnOnce(&mut Items)) -> Option<Wake> {
        let mut s = self.0.lock();
        if !s.rx_alive {
            return None;
        }
        push(&mut s.items);
        Some(Wake(s.waker.take()))
    }
}

/// The receiver to wake after a [`InboundTx::queue`], if it was waiting.
#[must_use = "the receiver waits until it is woken"]
pub(crate) struct Wake(Option<Waker>);

impl Wake {
    /// Wakes the receiver, if it was waiting.
    pub(crate) fn wake(self) {
        if let Some(w) = self.0 {
            w.wake();
        }
    }
}

impl Clone for InboundTx {
    fn clone(&self) -> Self {
        self.0.lock().senders += 1;
        InboundTx(self.0.clone())
    }
}

impl Drop for InboundTx {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.senders -= 1;
        let w = if s.senders == 0 { s.waker.take() } else { None };
        drop(s);
        if let Some(w) = w {
            w.wake();
        }
    }
}

impl std::fmt::Debug for InboundTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboundTx").finish_non_exhaustive()
    }
}

/// The call's end of its queue.
pub(crate) struct InboundRx {
    queue: Handle,
    /// [`close`](Self::close) ran: dropping it has nothing left to do.
    closed: bool,
}

impl InboundRx {
    /// The next item; `None` once every sender is gone and the queue is empty.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Inbound>> {
        let mut s = self.queue.lock();
        if let Some(m) = s.items.pop_front() {
            return Poll::Ready(Some(m));
        }
        if s.senders == 0 {
            return Poll::Ready(None);
        }
        match &s.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => s.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Waits for the next item (see [`poll_recv`](Self::poll_recv)).
    pub(crate) async fn recv(&mut self) -> Option<Inbound> {
        poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// The next item if one is queued.
    #[cfg(test)]
    pub(crate) fn try_recv(&mut self) -> Option<Inbound> {
        self.queue.lock().items.pop_front()
    }

    /// Ends this side of the queue under one lock: later sends fail, and
    /// what is queued is dropped. Returns the bytes of DATA dropped (their
    /// connection credit is the caller's to give back); a send cannot slip
    /// in between the drain and the end.
    pub(crate) fn close(&mut self) -> usize {
        let mut s = self.queue.lock();
        s.rx_alive = false;
        s.waker = None;
        let mut n = 0;
        while let Some(m) = s.items.pop_front() {
            if let Inbound::Data(b) = m {
                n += b.len();
            }
        }
        self.closed = true;
        n
    }
}

impl Drop for InboundRx {
    fn drop(&mut self) {
        if !self.closed {
            let mut s = self.queue.lock();
            s.rx_alive = false;
            s.waker = None;
        }
    }
}

impl std::fmt::Debug for InboundRx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboundRx").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(b: &'static [u8]) -> Inbound {
        Inbound::Data(Bytes::from_static(b))
    }

    #[tokio::test]
    async fn delivers_in_order_then_ends_when_the_senders_are_gone() {
        let (tx, mut rx, _window) = channel(0);
        let tx2 = tx.clone();
        tx.send(data(b"a")).unwrap();
        tx2.send(Inbound::End).unwrap();
        let waiter = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(m) = rx.recv().await {
                got.push(format!("{m:?}"));
            }
            got
        });
        tokio::task::yield_now().await;
        drop(tx);
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "a sender is left: no end yet");
        tx2.send(data(b"b")).unwrap();
        drop(tx2);
        let got = waiter.await.unwrap();
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got[0].contains("Data") && got[1] == "End" && got[2].contains("Data"));
    }

    #[test]
    fn items_stay_in_order_through_the_ring_and_the_overflow() {
        let mut q = Items::default();
        let mut next_in = 0u8;
        let mut next_out = 0u8;
        // Pushes and pops in uneven runs: ring full, overflow, ring wrapping.
        for (push, pop) in [(3, 2), (6, 1), (1, 5), (9, 9), (2, 0), (4, 6)] {
            for _ in 0..push {
                q.push_back(Inbound::Data(Bytes::from(vec![next_in])));
                next_in += 1;
            }
            for _ in 0..pop {
                match q.pop_front() {
                    Some(Inbound::Data(b)) => assert_eq!(b[0], next_out),
                    _ => panic!("item {next_out} missing"),
                }
                next_out += 1;
            }
        }
        while let Some(m) = q.pop_front() {
            match m {
                Inbound::Data(b) => assert_eq!(b[0], next_out),
                _ => panic!("not data"),
            }
            next_out += 1;
        }
        assert_eq!(next_in, next_out, "every item came out once");
    }

    #[test]
    fn an_ended_calls_queue_is_reused_empty_and_a_live_one_never() {
        fn addr(w: &CallWindow) -> *const Queue {
            &*w.0
        }
        let (tx, rx, w) = channel(10);
        tx.send(data(b"left behind")).unwrap();
        let first = addr(&w);
        let w2 = w.clone();
        drop((tx, rx, w));
        // One handle left: the queue is not free.
        let (tx_b, mut rx_b, w_b) = channel(20);
        assert_ne!(addr(&w_b), first, "a queue still referenced was reused");
        drop(w2);
        // Now it is: the next call gets it, empty and with its own window.
        let (tx_c, mut rx_c, w_c) = channel(30);
        assert_eq!(addr(&w_c), first, "the ended call's queue was not reused");
        assert!(rx_c.try_recv().is_none(), "a reused queue starts empty");
        assert_eq!(format!("{w_c:?}"), format!("{:?}", SendWindow::new(30)));
        tx_c.send(data(b"c")).unwrap();
        tx_b.send(data(b"b")).unwrap();
        assert!(matches!(rx_c.try_recv(), Some(Inbound::Data(b)) if &b[..] == b"c"));
        assert!(matches!(rx_b.try_recv(), Some(Inbound::Data(b)) if &b[..] == b"b"));
        drop(tx_c);
        assert!(rx_c.try_recv().is_none());
        drop((tx_b, rx_b, w_b, rx_c, w_c));
    }

    #[test]
    fn several_items_queue_in_order_at_once() {
        let (tx, mut rx, _window) = channel(0);
        tx.send(data(b"a")).unwrap();
        tx.queue_data(Bytes::from_static(b"b"), true)
            .unwrap()
            .wake();
        tx.queue_data(Bytes::new(), false).unwrap().wake();
        assert!(matches!(rx.try_recv(), Some(Inbound::Data(b)) if &b[..] == b"a"));
        assert!(matches!(rx.try_recv(), Some(Inbound::Data(b)) if &b[..] == b"b"));
        assert!(matches!(rx.try_recv(), Some(Inbound::End)));
        assert!(rx.try_recv().is_none());
        drop(rx);
        assert!(
            tx.queue_data(Bytes::new(), true).is_none(),
            "the receiver is gone"
        );
    }

    #[test]
    fn closing_counts_the_data_left_and_refuses_later_sends() {
        let (tx, mut rx, _window) = channel(0);
        tx.send(data(b"abc")).unwrap();
        tx.send(Inbound::End).unwrap();
        tx.send(data(b"de")).unwrap();
        assert_eq!(rx.close(), 5);
        assert!(rx.try_recv().is_none(), "closing drops what was queued");
        assert!(matches!(tx.send(data(b"f")), Err(Inbound::Data(_))));
        assert!(tx.queue_data(Bytes::from_static(b"g"), true).is_none());
        assert_eq!(rx.close(), 0);
    }

    #[test]
    fn send_fails_once_the_receiver_is_gone() {
        let (tx, mut rx, _window) = channel(0);
        tx.send(data(b"x")).unwrap();
        assert!(matches!(rx.try_recv(), Some(Inbound::Data(_))));
        assert!(rx.try_recv().is_none());
        drop(rx);
        assert!(matches!(tx.send(Inbound::End), Err(Inbound::End)));
    }
}
