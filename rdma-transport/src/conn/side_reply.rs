//! How the answer of a one-sided operation reaches its caller (wire
//! protocol §10.5): a oneshot channel for operations the side task waits
//! for, and for the lone operation whose caller polls, the [`LoneAnswer`]
//! in the side queue pair's state, which the caller reads under the lock
//! it polls with (no allocation, no channel, no lock of its own).
//!
//! Either way an operation is answered exactly once: the side task's
//! shutdown answers whatever is still posted or queued, and a caller that
//! stopped polling sleeps until its answer is in (`SideCore::wait`).

use tokio::sync::oneshot;

use crate::remote::OpResult;

/// Where an operation's answer goes.
pub(crate) enum Reply {
    /// A caller that sleeps until the side task answers.
    Chan(oneshot::Sender<OpResult>),
    /// The lone operation `seq`, whose caller polls the side CQ itself:
    /// the answer goes into the state's [`LoneAnswer`].
    Lone(u64),
}

impl Reply {
    /// The caller is known to be gone (only a channel can tell): an
    /// operation not posted yet need not be.
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Reply::Chan(tx) => tx.is_closed(),
            Reply::Lone(_) => false,
        }
    }
}

/// The answer of the side queue pair's lone operation, kept in its state
/// (under the lock its poller takes). One operation at a time: a new one
/// starts only after the last one's caller is gone (`SideCore`'s
/// `lone_busy`), so an answer waiting for a caller that stopped polling is
/// never dropped for the next operation. Each operation gets a fresh
/// sequence number; an answer for an older one (its caller gone) is dropped
/// rather than kept, giving its buffer back.
#[derive(Default)]
pub(crate) struct LoneAnswer {
    seq: u64,
    answer: Option<OpResult>,
}

impl LoneAnswer {
    /// Starts the next lone operation: its sequence number. An answer left
    /// for an older one (its caller's future was dropped) is dropped here.
    pub(crate) fn start(&mut self) -> u64 {
        self.seq = self.seq.wrapping_add(1);
        self.answer = None;
        self.seq
    }

    /// Puts the answer of operation `seq`; `false` (the answer dropped)
    /// when a newer one started meanwhile: nobody waits for it.
    pub(crate) fn put(&mut self, seq: u64, r: OpResult) -> bool {
        if seq != self.seq {
            return false;
        }
        self.answer = Some(r);
        true
    }

    /// The answer of operation `seq`, if it is in.
    pub(crate) fn take(&mut self, seq: u64) -> Option<OpResult> {
        if seq != self.seq {
            return None;
        }
        self.answer.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed() -> OpResult {
        OpResult::Failed(crate::Error::Disconnected)
    }

    #[test]
    fn an_answer_is_taken_once_by_its_own_operation() {
        let mut a = LoneAnswer::default();
        let s1 = a.start();
        assert!(a.take(s1).is_none(), "nothing yet");
        assert!(a.put(s1, failed()));
        assert!(a.take(s1.wrapping_add(1)).is_none(), "not another's");
        assert!(matches!(a.take(s1), Some(OpResult::Failed(_))));
        assert!(a.take(s1).is_none(), "taken once");
    }

    #[test]
    fn an_answer_for_a_caller_gone_is_not_taken_by_the_next() {
        let mut a = LoneAnswer::default();
        let s1 = a.start();
        // The first caller's future is dropped before its answer comes.
        let s2 = a.start();
        assert_ne!(s1, s2);
        assert!(!a.put(s1, failed()), "an older answer is dropped");
        assert!(a.take(s2).is_none(), "an older answer is not ours");
        assert!(a.put(s2, OpResult::Failed(crate::Error::Timeout { stage: "t" })));
        assert!(matches!(
            a.take(s2),
            Some(OpResult::Failed(crate::Error::Timeout { .. }))
        ));
    }

    #[test]
    fn an_answer_not_taken_is_dropped_at_the_next_start() {
        let mut a = LoneAnswer::default();
        let s1 = a.start();
        assert!(a.put(s1, failed()));
        let s2 = a.start();
        assert!(a.take(s1).is_none() && a.take(s2).is_none(), "dropped");
    }
}
