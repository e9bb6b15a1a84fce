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

/// The answer of a side queue pair's lone operation (at most one at a
/// time: `SideCore::submit` makes one caller the poller). Each lone
/// operation gets a fresh sequence number; an answer for an older one (its
/// caller gone) is dropped rather than kept.
pub(crate) struct LoneSlot {
    state: Mutex<(u64, Slot)>,
    /// Whether an answer for the current operation is in.
    filled: AtomicBool,
    /// Wakes a caller that stopped polling.
    ready: Notify,
}

impl Default for LoneSlot {
    fn default() -> LoneSlot {
        LoneSlot {
            state: Mutex::new((0, Slot::Empty)),
            filled: AtomicBool::new(false),
            ready: Notify::new(),
        }
    }
}

impl LoneSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Slot)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the next lone operation: an answer left for an older one (its
    /// caller's future was dropped) is dropped here.
    pub(crate) fn start(self: &Arc<Self>) -> (LoneSender, LoneReceiver) {
        let (seq, stale) = {
            let mut g = self.lock();
            g.0 = g.0.wrapping_add(1);
            self.filled.store(false, Ordering::Release);
            (g.0, std::mem::replace(&mut g.1, Slot::Empty))
        };
        drop(stale);
        (
            LoneSender {
                slot: self.clone(),
                seq,
                sent: false,
            },
            LoneReceiver { seq },
        )
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
    pub(crate) fn try_take(&self, rx: &LoneReceiver) -> Option<Option<OpResult>> {
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
    pub(crate) async fn take(&self, rx: &LoneReceiver) -> Option<OpResult> {
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

/// The receiving end: which lone operation the caller waits for.
pub(crate) struct LoneReceiver {
    seq: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_answer_reaches_its_own_operation_only() {
        let slot = Arc::new(LoneSlot::default());
        let (tx1, rx1) = slot.start();
        assert!(slot.try_take(&rx1).is_none(), "nothing yet");
        // The first caller goes away; the second operation starts before
        // the first one's answer comes.
        let (tx2, rx2) = slot.start();
        Reply::Lone(tx1).send(OpResult::Failed(crate::Error::Disconnected));
        assert!(slot.try_take(&rx2).is_none(), "an older answer is not ours");
        assert!(slot.try_take(&rx1).is_none(), "and is not kept");
        Reply::Lone(tx2).send(OpResult::Failed(crate::Error::Disconnected));
        assert!(matches!(
            slot.take(&rx2).await,
            Some(OpResult::Failed(crate::Error::Disconnected))
        ));
        assert!(slot.try_take(&rx2).is_none(), "taken once");
    }

    #[tokio::test]
    async fn a_dropped_sender_wakes_its_caller() {
        let slot = Arc::new(LoneSlot::default());
        let (tx, rx) = slot.start();
        let s2 = slot.clone();
        let waiter = tokio::spawn(async move { s2.take(&rx).await.is_none() });
        tokio::task::yield_now().await;
        drop(Reply::Lone(tx));
        assert!(waiter.await.unwrap(), "told the sender was dropped");
    }
}
