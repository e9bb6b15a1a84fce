//! How the answer of a one-sided operation reaches its caller (wire
//! protocol §10.5): a oneshot channel for operations the side task waits
//! for, and for the lone operation whose caller polls, the side queue
//! pair's one reusable [`LoneSlot`] (no allocation per operation).
//!
//! Either way an operation is answered exactly once: a [`Reply`] dropped
//! unanswered tells its caller so (the oneshot's closed channel, the slot's
//! `Dropped`), so a caller never waits for an answer that cannot come.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, Notify};

use crate::remote::OpResult;

/// Where an operation's answer goes.
pub(crate) enum Reply {
    /// A caller that sleeps until the side task answers.
    Chan(oneshot::Sender<OpResult>),
    /// The caller that polls the side CQ itself ([`LoneSlot`]).
    Lone(LoneSender),
}

impl Reply {
    /// Answers the operation (a caller that is gone drops the answer, and
    /// with it the local buffer, whose completion was polled).
    pub(crate) fn send(self, r: OpResult) {
        match self {
            Reply::Chan(tx) => {
                let _ = tx.send(r);
            }
            Reply::Lone(mut s) => s.send(r),
        }
    }

    /// The caller is known to be gone (only a channel can tell): an
    /// operation not posted yet need not be.
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Reply::Chan(tx) => tx.is_closed(),
            Reply::Lone(_) => false,
        }
    }
}

/// What the slot holds.
enum Slot {
    /// Nothing for the operation `seq` yet.
    Empty,
    Done(OpResult),
    /// The sender was dropped unanswered.
    Dropped,
}

/// The answer of a side queue pair's lone operation. One at a time: the
/// slot is taken by [`LoneSlot::try_start`] and free again only when its
/// [`LoneReceiver`] is dropped (the answer taken, or the caller gone), so
/// an answer waiting for a caller that stopped polling is never dropped
/// for the next operation. Each operation gets a fresh sequence number; an
/// answer for an older one (its caller gone) is dropped rather than kept.
pub(crate) struct LoneSlot {
    state: Mutex<(u64, Slot)>,
    /// Taken by an operation whose receiver lives.
    busy: AtomicBool,
    /// Whether an answer for the current operation is in.
    filled: AtomicBool,
    /// Wakes a caller that stopped polling.
    ready: Notify,
}

impl Default for LoneSlot {
    fn default() -> LoneSlot {
        LoneSlot {
            state: Mutex::new((0, Slot::Empty)),
            busy: AtomicBool::new(false),
            filled: AtomicBool::new(false),
            ready: Notify::new(),
        }
    }
}

impl LoneSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Slot)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the next lone operation, unless the slot is taken (`None`):
    /// an answer left for an older one (its caller's future was dropped) is
    /// dropped here.
    pub(crate) fn try_start(self: &Arc<Self>) -> Option<(LoneSender, LoneReceiver)> {
        if self.busy.swap(true, Ordering::Acquire) {
            return None;
        }
        let (seq, stale) = {
            let mut g = self.lock();
            g.0 = g.0.wrapping_add(1);
            self.filled.store(false, Ordering::Release);
            (g.0, std::mem::replace(&mut g.1, Slot::Empty))
        };
        drop(stale);
        Some((
            LoneSender {
                slot: self.clone(),
                seq,
                sent: false,
            },
            LoneReceiver {
                slot: self.clone(),
                seq,
            },
        ))
    }

    fn put(&self, seq: u64, s: Slot) {
        let stale = {
            let mut g = self.lock();
            if g.0 != seq {
                // An older operation's answer: nobody waits for it.
                Some(s)
            } else {
                g.1 = s;
                self.filled.store(true, Ordering::Release);
                None
            }
        };
        drop(stale);
        self.ready.notify_one();
    }

    /// The answer of `rx`'s operation, if it is in: `Some(None)` when its
    /// sender was dropped unanswered.
    fn try_take(&self, rx: &LoneReceiver) -> Option<Option<OpResult>> {
        if !self.filled.load(Ordering::Acquire) {
            return None;
        }
        let mut g = self.lock();
        if g.0 != rx.seq {
            return None;
        }
        match std::mem::replace(&mut g.1, Slot::Empty) {
            Slot::Empty => None,
            Slot::Done(r) => {
                self.filled.store(false, Ordering::Release);
                Some(Some(r))
            }
            Slot::Dropped => {
                self.filled.store(false, Ordering::Release);
                Some(None)
            }
        }
    }

    /// Waits (asleep) for the answer of `rx`'s operation; `None` when its
    /// sender was dropped unanswered.
    async fn take(&self, rx: &LoneReceiver) -> Option<OpResult> {
        loop {
            let n = self.ready.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some(r) = self.try_take(rx) {
                return r;
            }
            n.await;
        }
    }
}

/// The sending end of a lone operation's answer; dropped unanswered, it
/// tells the caller so.
pub(crate) struct LoneSender {
    slot: Arc<LoneSlot>,
    seq: u64,
    sent: bool,
}

impl LoneSender {
    fn send(&mut self, r: OpResult) {
        self.sent = true;
        self.slot.put(self.seq, Slot::Done(r));
    }
}

impl Drop for LoneSender {
    fn drop(&mut self) {
        if !self.sent {
            self.slot.put(self.seq, Slot::Dropped);
        }
    }
}

/// The receiving end: which lone operation the caller waits for. Dropping
/// it frees the slot (and drops an answer not taken).
pub(crate) struct LoneReceiver {
    slot: Arc<LoneSlot>,
    seq: u64,
}

impl LoneReceiver {
    /// The answer, if it is in: `Some(None)` when the sender was dropped
    /// unanswered.
    pub(crate) fn try_take(&self) -> Option<Option<OpResult>> {
        self.slot.try_take(self)
    }

    /// Waits (asleep) for the answer; `None` when the sender was dropped
    /// unanswered.
    pub(crate) async fn take(&self) -> Option<OpResult> {
        self.slot.take(self).await
    }
}

impl Drop for LoneReceiver {
    fn drop(&mut self) {
        // An answer not taken gives its buffer back now. An answer taken
        // leaves nothing (no lock on the usual path); one that comes after
        // this is dropped by the next `try_start`.
        if self.slot.filled.load(Ordering::Acquire) {
            let left = {
                let mut g = self.slot.lock();
                if g.0 == self.seq {
                    self.slot.filled.store(false, Ordering::Release);
                    Some(std::mem::replace(&mut g.1, Slot::Empty))
                } else {
                    None
                }
            };
            drop(left);
        }
        self.slot.busy.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed() -> OpResult {
        OpResult::Failed(crate::Error::Disconnected)
    }

    #[tokio::test]
    async fn the_slot_is_taken_until_its_receiver_is_dropped() {
        let slot = Arc::new(LoneSlot::default());
        let (tx1, rx1) = slot.try_start().expect("free");
        assert!(rx1.try_take().is_none(), "nothing yet");
        // The caller stopped polling; its answer comes in meanwhile, and
        // another operation must not take the slot (and drop the answer).
        Reply::Lone(tx1).send(failed());
        assert!(slot.try_start().is_none(), "taken until the receiver goes");
        assert!(matches!(rx1.take().await, Some(OpResult::Failed(_))));
        assert!(rx1.try_take().is_none(), "taken once");
        drop(rx1);
        let (tx2, rx2) = slot.try_start().expect("free again");
        drop(tx2);
        assert!(matches!(rx2.try_take(), Some(None)), "told the sender went");
    }

    #[tokio::test]
    async fn an_answer_for_a_receiver_gone_is_not_taken_by_the_next() {
        let slot = Arc::new(LoneSlot::default());
        let (tx1, rx1) = slot.try_start().expect("free");
        // The first caller's future is dropped before its answer comes.
        drop(rx1);
        let (tx2, rx2) = slot.try_start().expect("free");
        Reply::Lone(tx1).send(failed());
        assert!(rx2.try_take().is_none(), "an older answer is not ours");
        Reply::Lone(tx2).send(OpResult::Failed(crate::Error::Timeout { stage: "t" }));
        assert!(matches!(
            rx2.take().await,
            Some(OpResult::Failed(crate::Error::Timeout { .. }))
        ));
    }

    #[tokio::test]
    async fn a_dropped_sender_wakes_its_caller() {
        let slot = Arc::new(LoneSlot::default());
        let (tx, rx) = slot.try_start().expect("free");
        let waiter = tokio::spawn(async move { rx.take().await.is_none() });
        tokio::task::yield_now().await;
        drop(Reply::Lone(tx));
        assert!(waiter.await.unwrap(), "told the sender was dropped");
    }
}
