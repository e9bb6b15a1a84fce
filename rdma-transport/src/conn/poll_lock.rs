//! A lock no thread ever blocks on (the side queue pair's state, §10.5):
//! callers that poll take it with [`PollLock::try_lock`] and skip a turn
//! when it is held; the side task waits for it asleep
//! ([`PollLock::lock`]), woken when the holder lets go. A post on rxe can
//! do its transfer's kernel work inline, so a worker thread blocked behind
//! the holder would strand the tasks in its run queue; and an uncontended
//! take and release cost two atomic operations, where `tokio::sync::Mutex`
//! costs a semaphore's bookkeeping (about 180 instructions per operation).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use tokio::sync::Notify;

pub(crate) struct PollLock<T> {
    inner: Mutex<T>,
    /// Tasks waiting in [`PollLock::lock`].
    waiters: AtomicUsize,
    released: Notify,
}

/// Holds the lock; lets go (and wakes the waiters) when dropped.
pub(crate) struct PollGuard<'a, T> {
    guard: Option<MutexGuard<'a, T>>,
    lock: &'a PollLock<T>,
}

impl<T> PollLock<T> {
    pub(crate) fn new(v: T) -> PollLock<T> {
        PollLock {
            inner: Mutex::new(v),
            waiters: AtomicUsize::new(0),
            released: Notify::new(),
        }
    }

    /// The lock if nobody holds it.
    pub(crate) fn try_lock(&self) -> Option<PollGuard<'_, T>> {
        let guard = match self.inner.try_lock() {
            Ok(g) => g,
            // A holder panicked: the state is still consistent for the
            // shutdown, which is what takes it next.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        Some(PollGuard {
            guard: Some(guard),
            lock: self,
        })
    }

    /// The lock, waiting asleep while another holds it.
    pub(crate) async fn lock(&self) -> PollGuard<'_, T> {
        if let Some(g) = self.try_lock() {
            return g;
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let _count = Waiting(&self.waiters);
        loop {
            let n = self.released.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            // Pairs with the fence in `PollGuard::drop`: either the holder
            // sees this waiter, or this try sees the lock free.
            fence(Ordering::SeqCst);
            if let Some(g) = self.try_lock() {
                return g;
            }
            n.await;
        }
    }
}

/// One waiter of [`PollLock::lock`], counted until it has the lock (or its
/// future is dropped).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<T> Deref for PollGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.guard.as_deref().expect("held until dropped")
    }
}

impl<T> DerefMut for PollGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_deref_mut().expect("held until dropped")
    }
}

impl<T> Drop for PollGuard<'_, T> {
    fn drop(&mut self) {
        drop(self.guard.take());
        fence(Ordering::SeqCst);
        if self.lock.waiters.load(Ordering::Relaxed) > 0 {
            self.lock.released.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn try_lock_fails_while_held_and_succeeds_after() {
        let l = PollLock::new(1);
        let mut g = l.try_lock().expect("free");
        *g += 1;
        assert!(l.try_lock().is_none(), "held");
        drop(g);
        assert_eq!(*l.try_lock().expect("free again"), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_is_woken_when_the_holder_lets_go() {
        let l = Arc::new(PollLock::new(0u64));
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let l = l.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..1000 {
                    {
                        let mut g = l.lock().await;
                        *g += 1;
                    }
                    tokio::task::yield_now().await;
                }
            }));
        }
        let mut taken = 0;
        for _ in 0..1000 {
            if let Some(mut g) = l.try_lock() {
                *g += 1;
                taken += 1;
            }
            tokio::task::yield_now().await;
        }
        for t in tasks {
            tokio::time::timeout(std::time::Duration::from_secs(30), t)
                .await
                .expect("no waiter is left asleep")
                .unwrap();
        }
        assert_eq!(*l.lock().await, 4000 + taken);
    }
}
