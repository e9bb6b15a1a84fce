//! The process-wide block pool of a device ([`DevicePool`]): the
//! registered blocks every connection on the device shares, kept for reuse
//! when a connection lets one go and deregistered once idle for a whole
//! period; and where a connection's blocks come from ([`BlockSource`]: that
//! pool, or a PD of the connection's own).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::registered::{Access, RegisteredBuf};
use super::POOL_IDLE_BYTES;
use crate::error::Error;
use crate::verbs::Pd;

/// Which blocks a [`BlockCache`] holds interchangeably: the registered size
/// and the access (a window-bound rendezvous region is never handed out as
/// a send segment, nor the other way round).
type BlockKey = (usize, Access);

/// The accounting of a [`DevicePool`], without verbs (host-tested): the
/// blocks nobody uses, each stamped with the sweep period it came back in.
/// `B` is a registered block (`RegisteredBuf`; a plain value in the tests).
struct BlockCache<B> {
    idle: Vec<(BlockKey, B, u64)>,
    idle_bytes: usize,
    max_idle_bytes: usize,
    /// Sweeps so far.
    epoch: u64,
    /// Whether a sweeper task is armed.
    sweeping: bool,
}

impl<B> BlockCache<B> {
    fn new(max_idle_bytes: usize) -> Self {
        BlockCache {
            idle: Vec::new(),
            idle_bytes: 0,
            max_idle_bytes,
            epoch: 0,
            sweeping: false,
        }
    }

    /// An idle block of `key`, the most recently given back (its pages are
    /// the likeliest to be warm).
    fn take(&mut self, key: BlockKey) -> Option<B> {
        let i = self.idle.iter().rposition(|(k, _, _)| *k == key)?;
        self.idle_bytes -= key.0;
        Some(self.idle.remove(i).1)
    }

    /// Keeps `b` for reuse, or hands it back (to be deregistered) when that
    /// would take the idle blocks over the cap.
    fn put(&mut self, key: BlockKey, b: B) -> Option<B> {
        if self.idle_bytes + key.0 > self.max_idle_bytes {
            return Some(b);
        }
        self.idle_bytes += key.0;
        self.idle.push((key, b, self.epoch));
        None
    }

    /// Ends a sweep period: the blocks idle since before the previous sweep
    /// (a whole period or more) are handed back, to be deregistered.
    fn sweep(&mut self, out: &mut Vec<B>) {
        self.epoch += 1;
        let mut i = 0;
        while i < self.idle.len() {
            if self.idle[i].2 + 1 < self.epoch {
                let (k, b, _) = self.idle.swap_remove(i);
                self.idle_bytes -= k.0;
                out.push(b);
            } else {
                i += 1;
            }
        }
    }

    /// Hands back every idle block.
    fn clear(&mut self, out: &mut Vec<B>) {
        self.idle_bytes = 0;
        out.extend(self.idle.drain(..).map(|(_, b, _)| b));
    }
}

/// Registered blocks shared by every connection of the process on one
/// device (buffer-ownership.md, "Process-wide block pool"): one PD, in
/// which send and receive ring segments, staging buffers and rendezvous
/// regions are registered; a block a connection lets go (an idle release,
/// a close) is kept for the next one that needs a block of its size,
/// instead of being deregistered and registered again. Idle blocks are
/// bounded (`Config::device_pool_idle_bytes`) and deregistered once idle for a
/// whole `memory_idle_release` period, so the pool grows with traffic and
/// shrinks when idle; it goes with the last connection on the device.
///
/// No block in this PD grants remote access through its own MR: a
/// rendezvous region is registered with MW_BIND only and reached through a
/// type-2 window bound to its connection's QP (§4.7), so the rkey a peer
/// holds works on that connection alone. A region is zeroed before another
/// connection gets it (a peer that announces a chunk it never wrote reads
/// zeros, not another connection's data).
pub(crate) struct DevicePool {
    pd: Arc<Pd>,
    global_limit: usize,
    period: std::time::Duration,
    state: Mutex<BlockCache<RegisteredBuf>>,
}

impl DevicePool {
    pub(crate) fn new(
        pd: Arc<Pd>,
        global_limit: usize,
        max_idle_bytes: usize,
        period: std::time::Duration,
    ) -> DevicePool {
        DevicePool {
            pd,
            global_limit,
            period,
            state: Mutex::new(BlockCache::new(max_idle_bytes)),
        }
    }

    pub(crate) fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// Runs `f` on the locked state, keeping [`POOL_IDLE_BYTES`] in step.
    fn with<R>(&self, f: impl FnOnce(&mut BlockCache<RegisteredBuf>) -> R) -> R {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let before = st.idle_bytes;
        let r = f(&mut st);
        let after = st.idle_bytes;
        if after > before {
            POOL_IDLE_BYTES.fetch_add(after - before, Ordering::SeqCst);
        } else if before > after {
            POOL_IDLE_BYTES.fetch_sub(before - after, Ordering::SeqCst);
        }
        r
    }

    /// A block of `len` bytes: an idle one of that size and access, or a
    /// new registration. At the registration cap the idle blocks of other
    /// sizes are let go, and the registration tried once more.
    fn take(&self, len: usize, how: Access) -> Result<RegisteredBuf, Error> {
        debug_assert!(
            how != Access::RemoteWrite,
            "no remote access in a shared PD"
        );
        let key = (RegisteredBuf::size_for(len), how);
        if let Some(b) = self.with(|st| st.take(key)) {
            crate::stats::GLOBAL
                .pool_reuses
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(b);
        }
        match RegisteredBuf::new(&self.pd, len, how, self.global_limit) {
            Err(Error::ResourceLimit(e)) => {
                let mut idle = Vec::new();
                self.with(|st| st.clear(&mut idle));
                if idle.is_empty() {
                    return Err(Error::ResourceLimit(e));
                }
                // Deregistered here, outside the lock.
                drop(idle);
                RegisteredBuf::new(&self.pd, len, how, self.global_limit)
            }
            r => r,
        }
    }

    /// Takes back a block its connection is done with: no posted work
    /// request covers it, and no peer can reach it (its window, if any, is
    /// deallocated). Kept for reuse within the cap, deregistered otherwise.
    fn put(self: &Arc<Self>, mut b: RegisteredBuf) {
        if b.access != Access::Local {
            b.zero();
        }
        let key = (b.len, b.access);
        let (over, arm) = self.with(|st| {
            let over = st.put(key, b);
            let arm = over.is_none() && !st.sweeping && !self.period.is_zero();
            if arm {
                st.sweeping = true;
            }
            (over, arm)
        });
        // A block over the cap is deregistered here, outside the lock.
        drop(over);
        if arm {
            self.arm_sweeper();
        }
    }

    /// Starts the task that lets idle blocks go, one period after another,
    /// until none is left. Without a runtime to run it on, nothing is kept.
    fn arm_sweeper(self: &Arc<Self>) {
        /// Clears `sweeping` if the task's runtime drops it before it ends,
        /// so that the next block given back arms a new one.
        struct Armed(std::sync::Weak<DevicePool>);
        impl Armed {
            /// The task ends normally: `sweeping` was cleared under the
            /// lock, and a block given back since may have armed the next
            /// sweeper already.
            fn disarm(&mut self) {
                self.0 = std::sync::Weak::new();
            }
        }
        impl Drop for Armed {
            fn drop(&mut self) {
                if let Some(p) = self.0.upgrade() {
                    p.with(|st| st.sweeping = false);
                }
            }
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            let mut idle = Vec::new();
            self.with(|st| {
                st.clear(&mut idle);
                st.sweeping = false;
            });
            return;
        };
        let mut armed = Armed(Arc::downgrade(self));
        let period = self.period;
        rt.spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(p) = armed.0.upgrade() else { break };
                let mut gone = Vec::new();
                let left = p.with(|st| {
                    st.sweep(&mut gone);
                    st.sweeping = !st.idle.is_empty();
                    st.sweeping
                });
                // Deregistered outside the lock.
                drop(gone);
                if !left {
                    armed.disarm();
                    break;
                }
            }
        });
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        // Explicit for the order's sake: the blocks hold the PD, which goes
        // after them anyway.
        let mut idle = Vec::new();
        self.with(|st| st.clear(&mut idle));
    }
}

/// Where a connection's blocks come from and go back to: its own PD, or its
/// device's process-wide pool (whose PD `pd` then is; rendezvous regions
/// are then behind windows, §4.7).
pub(super) struct BlockSource {
    pub(super) pd: Arc<Pd>,
    pub(super) dev: Option<Arc<DevicePool>>,
    /// `Config::global_max_registered_bytes`.
    pub(super) limit: usize,
}

impl BlockSource {
    pub(super) fn take(&self, len: usize, how: Access) -> Result<RegisteredBuf, Error> {
        match &self.dev {
            Some(d) => d.take(len, how),
            None => RegisteredBuf::new(&self.pd, len, how, self.limit),
        }
    }

    /// Gives back a block no posted work request and no peer can reach any
    /// more: to the pool, or deregistered.
    pub(super) fn put(&self, b: RegisteredBuf) {
        if let Some(d) = &self.dev {
            d.put(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: BlockKey = (32 << 10, Access::Local);
    const RDV: BlockKey = (2 << 20, Access::Window);

    #[test]
    fn a_block_given_back_serves_the_next_taker_of_its_size_and_access() {
        let mut c = BlockCache::new(16 << 20);
        assert_eq!(c.take(SEG), None, "an empty cache registers");
        assert_eq!(c.put(SEG, 1), None);
        assert_eq!(c.put(RDV, 2), None);
        assert_eq!(c.idle_bytes, (32 << 10) + (2 << 20));
        assert_eq!(c.take((32 << 10, Access::Window)), None, "access differs");
        assert_eq!(c.take((64 << 10, Access::Local)), None, "size differs");
        assert_eq!(c.take(RDV), Some(2));
        assert_eq!(c.take(SEG), Some(1));
        assert_eq!((c.take(SEG), c.idle_bytes), (None, 0));
        // The most recently given back comes first.
        c.put(SEG, 3);
        c.put(SEG, 4);
        assert_eq!(c.take(SEG), Some(4));
    }

    #[test]
    fn idle_blocks_stay_under_the_cap() {
        let mut c = BlockCache::new(3 << 20);
        assert_eq!(c.put(RDV, 1), None);
        assert_eq!(c.put(RDV, 2), Some(2), "over the cap: deregistered");
        assert_eq!(c.put(SEG, 3), None, "a smaller block still fits");
        assert_eq!(c.idle_bytes, (2 << 20) + (32 << 10));
        let mut none = BlockCache::new(0);
        assert_eq!(none.put(SEG, 1), Some(1), "a zero cap keeps nothing");
        let mut out = Vec::new();
        c.clear(&mut out);
        out.sort_unstable();
        assert_eq!((out, c.idle_bytes), (vec![1, 3], 0));
    }

    #[test]
    fn a_block_goes_once_idle_for_a_whole_period() {
        let mut c = BlockCache::new(16 << 20);
        let mut out = Vec::new();
        c.put(SEG, 1);
        // The first sweep may come right after the block went idle: kept.
        c.sweep(&mut out);
        assert!(out.is_empty());
        c.put(SEG, 2);
        // A whole period later block 1 goes, block 2 (idle for less) stays.
        c.sweep(&mut out);
        assert_eq!(out, vec![1]);
        assert_eq!(c.idle_bytes, 32 << 10);
        // A block taken and given back again starts a new period.
        assert_eq!(c.take(SEG), Some(2));
        c.put(SEG, 2);
        c.sweep(&mut out);
        assert_eq!(out, vec![1], "block 2 is younger than a period");
        c.sweep(&mut out);
        assert_eq!((out, c.idle_bytes), (vec![1, 2], 0));
    }
}
