//! Registered memory and the per-connection buffer pools.
//!
//! [`ConnMemory`] owns the QP together with every buffer the NIC may touch,
//! and destroys the QP before any buffer is deregistered or freed. See
//! `docs/buffer-ownership.md` for who owns which slot when.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use rdma_sys::*;

use crate::engine::{Action, Buffers};
use crate::error::{Error, PeerMisbehaved};
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `verbs::dl`).
use crate::verbs::cm::CmId;
use crate::verbs::dl::{ibv_dereg_mr, ibv_reg_mr};
use crate::verbs::{verb_err, Cq, LoopQp, Mw, Pd, Qp, SendDesc, Srq};

/// Process-wide registered bytes (checked against `Config::global_max_registered_bytes`).
pub(crate) static REGISTERED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Of those, the bytes of blocks the device pools keep while no connection
/// uses them ([`DevicePool`]).
pub(crate) static POOL_IDLE_BYTES: AtomicUsize = AtomicUsize::new(0);

/// A page-aligned heap allocation registered with a PD.
pub(crate) struct RegisteredBuf {
    ptr: NonNull<u8>,
    len: usize,
    mr: *mut ibv_mr,
    /// Not `Local`: the peer may write it at any time, so no Rust reference
    /// over it is ever formed (only raw copies).
    access: Access,
    _pd: Arc<Pd>,
}

// SAFETY: the buffer is uniquely owned (like a Box<[u8]>); the MR pointer is
// only passed to thread-safe libibverbs calls.
unsafe impl Send for RegisteredBuf {}
// SAFETY: every `&self` method only reads: the MR's plain fields, a shared
// slice under `slice_local`'s rules (a slot no receive is posted on), or a
// raw copy (`append_to`); writing needs `&mut self`. A shared receive pool's
// chunks are read this way by several connections, each its own slots.
unsafe impl Sync for RegisteredBuf {}

/// How the peer may reach a registered buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Only our own work requests (rings, staging, shared receive pool).
    Local,
    /// Remote write through the buffer's own rkey (a rendezvous region in
    /// a connection's own PD).
    RemoteWrite,
    /// Remote write only through a type-2 memory window bound to one QP
    /// (a rendezvous region in a listener's shared PD, §4.7): the MR itself
    /// grants no remote access.
    Window,
}

impl RegisteredBuf {
    pub(crate) fn new(
        pd: &Arc<Pd>,
        len: usize,
        how: Access,
        global_limit: usize,
    ) -> Result<RegisteredBuf, Error> {
        let len = Self::size_for(len);
        let prev = REGISTERED_BYTES.fetch_add(len, Ordering::SeqCst);
        if prev + len > global_limit {
            REGISTERED_BYTES.fetch_sub(len, Ordering::SeqCst);
            return Err(Error::ResourceLimit(format!(
                "registering {len} more bytes exceeds global_max_registered_bytes ({global_limit}); {prev} in use"
            )));
        }
        let layout = Layout::from_size_align(len, 4096).expect("valid layout");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            REGISTERED_BYTES.fetch_sub(len, Ordering::SeqCst);
            return Err(Error::ResourceLimit(format!(
                "allocation of {len} bytes failed"
            )));
        };
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        match how {
            Access::Local => {}
            Access::RemoteWrite => access |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
            Access::Window => access |= ibv_access_flags::IBV_ACCESS_MW_BIND.0,
        }
        // SAFETY: [ptr, ptr+len) is a live allocation owned by us; pd is live.
        let mr = unsafe { ibv_reg_mr(pd.ptr, raw as *mut _, len, access as i32) };
        if mr.is_null() {
            let e = verb_err("ibv_reg_mr");
            // SAFETY: allocated above with this layout, never registered.
            unsafe { dealloc(raw, layout) };
            REGISTERED_BYTES.fetch_sub(len, Ordering::SeqCst);
            return Err(e);
        }
        crate::stats::GLOBAL
            .memory_registrations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(RegisteredBuf {
            ptr,
            len,
            mr,
            access: how,
            _pd: pd.clone(),
        })
    }

    /// The bytes [`new`](Self::new) registers for a request of `len`.
    fn size_for(len: usize) -> usize {
        len.max(64)
    }

    /// Zeroes the whole buffer, through a raw pointer (it may be a
    /// rendezvous region, over which no reference is formed).
    ///
    /// For a buffer no work request and no peer can reach any more: a
    /// rendezvous region whose window was deallocated (its MR grants no
    /// remote access of its own, §4.7), before the process-wide pool hands
    /// it to another connection. `&mut self` excludes every CPU alias.
    fn zero(&mut self) {
        // SAFETY: [ptr, ptr+len) is our live allocation; `&mut self` means
        // no slice over it is alive; the caller's contract (above) means
        // neither the NIC nor a peer writes it meanwhile.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), 0, self.len) };
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: mr is live while self exists; plain field read.
        unsafe { (*self.mr).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }

    /// The MR, for binding a memory window to it.
    pub(crate) fn mr(&self) -> *mut ibv_mr {
        self.mr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A shared slice over a part of a pool that **nobody can write while
    /// it lives**: only for pools that are not remotely writable (the
    /// receive ring), and only for a slot whose receive completed and that
    /// is not reposted while the slice is alive.
    fn slice_local(&self, off: usize, len: usize) -> &[u8] {
        assert!(
            self.access == Access::Local,
            "no shared slice over remotely writable memory"
        );
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "registered slice out of bounds"
        );
        // Only our own receives can write this buffer (no REMOTE_WRITE), and
        // Buffers::recv_slot is used between a slot's completion and its repost.
        // SAFETY: in bounds of our live allocation (checked); not remotely
        // writable (asserted); no receive is posted on it while `self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// Appends `len` bytes at `off` to `out`, reading through raw pointers
    /// only: valid for memory a peer may RDMA-WRITE at any moment (the
    /// rendezvous region), where a `&[u8]` would assert that nothing
    /// changes it. A concurrent remote write can only change the bytes
    /// copied (plain `u8`s, no validity invariant), never their number.
    fn append_to(&self, off: usize, len: usize, out: &mut BytesMut) {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "registered copy out of bounds"
        );
        out.reserve(len);
        let dst = out.spare_capacity_mut();
        assert!(dst.len() >= len, "reserve gave room for len bytes");
        // The source is reached only through this raw pointer (no reference).
        // SAFETY: source in bounds of our live allocation (checked); destination
        // is `len` bytes of `out`'s spare capacity (checked), a separate allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(off),
                dst.as_mut_ptr().cast::<u8>(),
                len,
            );
        }
        let new_len = out.len() + len;
        // SAFETY: the `len` bytes after the old length were initialised by
        // the copy above and are within the capacity (checked).
        unsafe { out.set_len(new_len) };
    }

    fn slice_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(
            self.access == Access::Local,
            "no slice over remotely writable memory"
        );
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "registered slice out of bounds"
        );
        // Callers (send_slot/staging) only ask for a slot that no posted work
        // request covers (buffer-ownership.md); &mut self excludes CPU aliasing.
        // SAFETY: in bounds of our live allocation (checked); not remotely
        // writable (asserted), so only our own (not posted) work requests touch it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        // SAFETY: mr was registered in new() and is deregistered only here,
        // once. The owning ConnMemory destroyed the QP first, so no work
        // request of ours can target it.
        let r = unsafe { ibv_dereg_mr(self.mr) };
        if r != 0 {
            // The device still maps these pages: freeing them could let a
            // late DMA (or a peer holding the rkey) write into memory the
            // allocator hands out again. Leak them instead (and keep them
            // counted as registered).
            tracing::warn!(
                "ibv_dereg_mr of {} bytes failed: {}; leaking the buffer",
                self.len,
                crate::error::Errno(r)
            );
            return;
        }
        let layout = Layout::from_size_align(self.len, 4096).expect("valid layout");
        // SAFETY: allocated in new() with the same layout, freed once; the
        // MR covering it was deregistered successfully just above.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
        REGISTERED_BYTES.fetch_sub(self.len, Ordering::SeqCst);
    }
}

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

/// Sizes of the four per-connection pools (their largest sizes; memory on
/// demand registers less, `docs/wire-protocol-rdma.md` §4.6 and §5.5).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolSizes {
    pub recv_slots: usize,
    pub recv_slot_bytes: usize,
    pub send_slots: usize,
    pub send_slot_bytes: usize,
    pub rdv_count: usize,
    pub rdv_bytes: usize,
    /// Slots per registered segment of the receive ring (it grows a
    /// segment at a time).
    pub recv_seg: usize,
    /// Slots per registered segment of the send ring (it grows and shrinks
    /// a segment at a time).
    pub send_seg: usize,
}

/// Where a connection's blocks come from and go back to: its own PD, or its
/// device's process-wide pool (whose PD `pd` then is; rendezvous regions
/// are then behind windows, §4.7).
struct BlockSource {
    pd: Arc<Pd>,
    dev: Option<Arc<DevicePool>>,
    /// `Config::global_max_registered_bytes`.
    limit: usize,
}

impl BlockSource {
    fn take(&self, len: usize, how: Access) -> Result<RegisteredBuf, Error> {
        match &self.dev {
            Some(d) => d.take(len, how),
            None => RegisteredBuf::new(&self.pd, len, how, self.limit),
        }
    }

    /// Gives back a block no posted work request and no peer can reach any
    /// more: to the pool, or deregistered.
    fn put(&self, b: RegisteredBuf) {
        if let Some(d) = &self.dev {
            d.put(b);
        }
    }
}

/// A ring of equal slots registered a segment at a time, on demand.
struct SlotPool {
    segs: Vec<Option<RegisteredBuf>>,
    seg_slots: usize,
    slot_bytes: usize,
    slots: usize,
}

impl SlotPool {
    fn new(slots: usize, slot_bytes: usize, seg_slots: usize) -> SlotPool {
        let seg_slots = seg_slots.clamp(1, slots.max(1));
        SlotPool {
            segs: (0..slots.div_ceil(seg_slots)).map(|_| None).collect(),
            seg_slots,
            slot_bytes,
            slots,
        }
    }

    /// Registers (or takes from the pool) every segment that holds one of
    /// slots `0..n`.
    fn ensure(&mut self, reg: &BlockSource, n: usize) -> Result<(), Error> {
        let n = n.min(self.slots);
        for k in 0..n.div_ceil(self.seg_slots) {
            if self.segs[k].is_none() {
                let count = self.seg_slots.min(self.slots - k * self.seg_slots);
                self.segs[k] = Some(reg.take(count * self.slot_bytes, Access::Local)?);
            }
        }
        Ok(())
    }

    /// Gives back every segment whose slots are all at or above `n` (the
    /// caller guarantees none of them is posted).
    fn trim(&mut self, reg: &BlockSource, n: usize) {
        for k in n.div_ceil(self.seg_slots)..self.segs.len() {
            if let Some(b) = self.segs[k].take() {
                reg.put(b);
            }
        }
    }

    /// The registered segment holding slot `i`, and the slot's offset in it.
    fn at(&self, i: usize) -> (&RegisteredBuf, usize) {
        assert!(i < self.slots, "slot {i} out of range");
        let seg = self.segs[i / self.seg_slots]
            .as_ref()
            .expect("the engine uses registered slots only");
        (seg, (i % self.seg_slots) * self.slot_bytes)
    }

    fn at_mut(&mut self, i: usize) -> (&mut RegisteredBuf, usize) {
        assert!(i < self.slots, "slot {i} out of range");
        let seg = self.segs[i / self.seg_slots]
            .as_mut()
            .expect("the engine uses registered slots only");
        (seg, (i % self.seg_slots) * self.slot_bytes)
    }
}

/// wr_id kind tag of a receive posted to a listener's shared receive queue;
/// the low 32 bits are the pool buffer (wire protocol §4.7). The engine's
/// own tags are 1 and 2 (§7).
pub(crate) const WR_SRQ: u64 = 3;
/// wr_id kind tag of a memory-window bind (§4.7): filtered out before the
/// engine sees completions.
pub(crate) const WR_BIND: u64 = 4;
/// wr_id kind tag of a shared receive pool's drain SEND (§4.7), on the
/// pool's own loopback QP.
const WR_DRAIN: u64 = 5;
/// Zero-length SENDs a drain posts at once (its QP's send queue depth).
const DRAIN_BATCH: usize = 64;
/// A drain starts once this many posted buffers are drainable: two chunks.
const DRAIN_MIN: usize = 2 * CHUNK_BUFFERS;

/// Buffers a drain may take back now: the drainable ones less one more
/// slack's worth, for the buffers closing connections' QPs took from the
/// SRQ and have not given back yet (they still count as posted).
fn drain_size<C>(st: &PoolState<C>) -> usize {
    st.drainable().saturating_sub(POOL_SLACK)
}

/// Buffers per registered chunk of a shared receive pool (128 KiB with
/// 8 KiB buffers).
const CHUNK_BUFFERS: usize = 16;
/// Buffers a shared receive pool keeps posted beyond the sum of its
/// connections' credit limits (§4.7): a peer that sends without credit
/// takes one of these, not a buffer another connection's credit stands for,
/// before the check closes its connection.
pub(crate) const POOL_SLACK: usize = 16;

/// The receive buffers of every connection a listener accepted on one
/// device, posted to one shared receive queue (wire protocol §4.7,
/// buffer-ownership.md "Shared receive pool").
///
/// Accounting: `reserved` is the sum of the connections' receive credit
/// limits (each connection's ring size as the engine sees it), `active`
/// the buffers posted to the SRQ or held by a connection (a message not yet
/// consumed). The pool keeps `active >= reserved + POOL_SLACK`, which is
/// the no-RNR rule of §4.2 summed over connections: every connection has
/// at most `limit − held` credits and messages in flight, so the posted
/// buffers cover them all. Buffers given back above that are not reposted;
/// a chunk none of whose buffers is posted or held is deregistered. Posted
/// buffers cannot be taken back from an SRQ: the pool shrinks as traffic
/// consumes them, and goes (SRQ, PD and chunks) with its last connection.
pub(crate) struct RecvPool {
    // Declared first: the drain's QP is destroyed before the SRQ it
    // receives from, and the SRQ before the chunks it may still have posted.
    drain: Mutex<Option<LoopQp>>,
    srq: Arc<Srq>,
    /// The cm_id of the connection that created the pool (its device
    /// context, port and address: for the drain's QP).
    anchor: Arc<CmId>,
    pd: Arc<Pd>,
    buf_bytes: usize,
    max_buffers: usize,
    global_limit: usize,
    state: Mutex<PoolState<Arc<RegisteredBuf>>>,
}

/// The shared pool's accounting, without verbs (host-tested): which
/// buffers to post, which chunks to register and which to let go. `C` is a
/// registered chunk (`Arc<RegisteredBuf>`; `()` in the tests).
struct PoolState<C> {
    chunks: Vec<Option<C>>,
    /// Per chunk, how many of its buffers are in `idle`.
    idle_in_chunk: Vec<usize>,
    /// Registered buffers neither posted nor held.
    idle: Vec<u32>,
    /// Σ of the connections' credit limits.
    reserved: usize,
    /// Buffers posted to the SRQ or held by a connection (less those a
    /// drain is taking back).
    active: usize,
    /// Per buffer, whether a connection holds it (its receive completed,
    /// the slot not reposted yet), and how many do.
    is_held: Vec<bool>,
    held: usize,
    /// A drain task runs (at most one per pool), or draining failed once
    /// (then never again for this pool).
    draining: bool,
    drain_off: bool,
    /// Scratch list of buffers to post (kept: no allocation per repost).
    post: Vec<u32>,
}

impl<C> Default for PoolState<C> {
    fn default() -> Self {
        PoolState {
            chunks: Vec::new(),
            idle_in_chunk: Vec::new(),
            idle: Vec::new(),
            reserved: 0,
            active: 0,
            is_held: Vec::new(),
            held: 0,
            draining: false,
            drain_off: false,
            post: Vec::new(),
        }
    }
}

impl<C> PoolState<C> {
    fn target(&self) -> usize {
        self.reserved + POOL_SLACK
    }

    fn registered(&self) -> usize {
        self.chunks.iter().flatten().count() * CHUNK_BUFFERS
    }

    /// Chunks to register before `reserve(n)` (0 when idle buffers cover
    /// it), or an error when they would exceed `max_buffers`.
    fn chunks_short(&self, n: usize, max_buffers: usize) -> Result<usize, usize> {
        let short = (self.target() + n).saturating_sub(self.active);
        let chunks = short
            .saturating_sub(self.idle.len())
            .div_ceil(CHUNK_BUFFERS);
        if self.registered() + chunks * CHUNK_BUFFERS > max_buffers {
            return Err(max_buffers);
        }
        Ok(chunks)
    }

    /// Adds a registered chunk; its buffers are idle.
    fn add_chunk(&mut self, c: C) {
        let k = match self.chunks.iter().position(Option::is_none) {
            Some(k) => k,
            None => {
                self.chunks.push(None);
                self.idle_in_chunk.push(0);
                self.chunks.len() - 1
            }
        };
        self.chunks[k] = Some(c);
        self.idle_in_chunk[k] = CHUNK_BUFFERS;
        self.is_held
            .resize(self.chunks.len() * CHUNK_BUFFERS, false);
        let base = (k * CHUNK_BUFFERS) as u32;
        self.idle
            .extend((0..CHUNK_BUFFERS as u32).rev().map(|j| base + j));
    }

    /// Raises the sum of limits by `n` and moves idle buffers to `post`
    /// until the target is met (the chunks were added first).
    fn reserve(&mut self, n: usize) {
        self.reserved += n;
        self.post.clear();
        while self.active < self.target() {
            let Some(b) = self.idle.pop() else {
                break; // not reached: chunks_short registered enough
            };
            self.idle_in_chunk[b as usize / CHUNK_BUFFERS] -= 1;
            self.post.push(b);
            self.active += 1;
        }
    }

    /// Takes back buffers a connection is done with: into `post` while at
    /// or below the target, idle above it, and a chunk whose buffers are
    /// all idle is let go (removed from `chunks`, so dropped).
    fn give_back(&mut self, bufs: &[u32]) {
        self.post.clear();
        for &b in bufs {
            if !self.ours(b) {
                continue; // never posted again
            }
            if std::mem::take(&mut self.is_held[b as usize]) {
                self.held -= 1;
            }
            if self.active > self.target() {
                self.active -= 1;
                self.make_idle(b);
            } else {
                self.post.push(b);
            }
        }
    }

    /// Whether `b` is a buffer of a registered chunk of this pool.
    fn ours(&self, b: u32) -> bool {
        self.chunks
            .get(b as usize / CHUNK_BUFFERS)
            .is_some_and(Option::is_some)
    }

    /// `b` (neither posted nor held any more) joins the idle buffers; a
    /// chunk whose buffers are then all idle is let go.
    fn make_idle(&mut self, b: u32) {
        let k = b as usize / CHUNK_BUFFERS;
        self.idle.push(b);
        self.idle_in_chunk[k] += 1;
        if self.idle_in_chunk[k] == CHUNK_BUFFERS {
            // No buffer of this chunk is posted or held: the NIC cannot
            // write it any more.
            self.idle.retain(|&i| i as usize / CHUNK_BUFFERS != k);
            self.idle_in_chunk[k] = 0;
            self.chunks[k] = None;
        }
    }

    /// A receive completion handed buffer `b` to a connection; whether it
    /// is one of ours.
    fn hold(&mut self, b: u32) -> bool {
        if !self.ours(b) || self.is_held[b as usize] {
            return false;
        }
        self.is_held[b as usize] = true;
        self.held += 1;
        true
    }

    /// Posted buffers beyond what the connections' credits and the slack
    /// need: every connection may still receive `limit − held` messages,
    /// so the SRQ must keep `reserved − held + slack` posted; the rest can
    /// be taken back by a drain.
    fn drainable(&self) -> usize {
        let posted = self.active.saturating_sub(self.held);
        posted.saturating_sub(self.reserved.saturating_sub(self.held) + POOL_SLACK)
    }

    /// Starts taking back `k` posted buffers (at most [`drainable`]): they
    /// leave `active` now, so nothing counts on them from here on.
    fn drain_start(&mut self, k: usize) {
        debug_assert!(k <= self.drainable());
        self.active -= k;
    }

    /// A drain consumed posted buffer `b` (its receive completed, or was
    /// flushed, on the drain's own QP): idle now.
    fn drained(&mut self, b: u32) {
        if self.ours(b) {
            self.make_idle(b);
        }
    }

    /// A drain that stopped with `k` of its buffers not consumed: they are
    /// still posted.
    fn drain_undo(&mut self, k: usize) {
        self.active += k;
    }
}

impl RecvPool {
    pub(crate) fn new(
        id: &Arc<CmId>,
        pd: Arc<Pd>,
        buf_bytes: usize,
        max_buffers: usize,
        global_limit: usize,
    ) -> Result<RecvPool, Error> {
        let max_buffers = max_buffers.max(CHUNK_BUFFERS);
        let srq = Arc::new(Srq::new(&pd, max_buffers as u32)?);
        Ok(RecvPool {
            drain: Mutex::new(None),
            srq,
            anchor: id.clone(),
            pd,
            buf_bytes,
            max_buffers,
            global_limit,
            state: Mutex::new(PoolState::default()),
        })
    }

    pub(crate) fn srq(&self) -> &Arc<Srq> {
        &self.srq
    }

    pub(crate) fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState<Arc<RegisteredBuf>>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Raises the sum of credit limits by `n` and posts buffers (registering
    /// chunks) until the pool covers it. Fails, changing nothing that
    /// matters, if the SRQ or the registration cap is full.
    pub(crate) fn reserve(&self, n: usize) -> Result<(), Error> {
        let mut st = self.lock();
        let chunks = st.chunks_short(n, self.max_buffers).map_err(|max| {
            Error::ResourceLimit(format!(
                "the shared receive queue holds at most {max} buffers \
                 (shared_receive_max_buffers or the device's max_srq_wr)"
            ))
        })?;
        for _ in 0..chunks {
            let chunk = RegisteredBuf::new(
                &self.pd,
                CHUNK_BUFFERS * self.buf_bytes,
                Access::Local,
                self.global_limit,
            )?;
            st.add_chunk(Arc::new(chunk));
        }
        st.reserve(n);
        self.post(&mut st)
    }

    /// Lowers the sum of credit limits by `n` (a connection closed, or its
    /// credits were revoked), and starts a drain if that left many more
    /// buffers posted than the connections' credits need.
    pub(crate) fn unreserve(self: &Arc<Self>, n: usize) {
        let mut st = self.lock();
        st.reserved = st.reserved.saturating_sub(n);
        if st.draining || st.drain_off || drain_size(&st) < DRAIN_MIN {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        st.draining = true;
        drop(st);
        let weak = Arc::downgrade(self);
        rt.spawn(async move {
            loop {
                let Some(p) = weak.upgrade() else { break };
                match p.drain_batch().await {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(
                            "shared receive pool: taking back posted buffers failed ({e}); \
                             they stay posted until traffic consumes them"
                        );
                        let mut st = p.lock();
                        st.draining = false;
                        st.drain_off = true;
                        break;
                    }
                }
            }
        });
    }

    /// One round of the drain (wire protocol §4.7, "Shrinking"): posts as
    /// many zero-length SENDs on the pool's loopback QP as there are
    /// drainable buffers (at most [`DRAIN_BATCH`]), each consuming one
    /// posted receive, and makes the consumed buffers idle (chunks whose
    /// buffers are all idle are deregistered). `Ok(false)`: nothing left
    /// to drain (`draining` cleared under the same lock).
    async fn drain_batch(&self) -> Result<bool, Error> {
        let k = {
            let mut st = self.lock();
            // Started at DRAIN_MIN; once running, down to what it may take.
            let k = drain_size(&st).min(DRAIN_BATCH);
            if k == 0 {
                st.draining = false;
                return Ok(false);
            }
            st.drain_start(k);
            k
        };
        // Only one drain task runs per pool (`draining`): the QP is taken
        // out for the round and put back after.
        let kept = self.drain.lock().unwrap_or_else(|p| p.into_inner()).take();
        let qp = match kept {
            Some(qp) => qp,
            None => {
                let ip = self
                    .anchor
                    .local_addr()
                    .map(|a| a.ip())
                    .ok_or(Error::NoDevice("the pool's address is unknown".into()));
                match ip.and_then(|ip| {
                    LoopQp::new(&self.anchor, &self.pd, &self.srq, ip, DRAIN_BATCH as u32)
                }) {
                    Ok(qp) => qp,
                    Err(e) => {
                        self.lock().drain_undo(k);
                        return Err(e);
                    }
                }
            }
        };
        let (consumed, r) = self.drain_round(&qp, k).await;
        if let Err(e) = r {
            // The QP is in the error state: no more receive is consumed.
            // What it did not consume is still posted.
            self.lock().drain_undo(k - consumed);
            return Err(e);
        }
        *self.drain.lock().unwrap_or_else(|p| p.into_inner()) = Some(qp);
        Ok(true)
    }

    /// Posts `k` SENDs on `qp` and waits for the receives they consume:
    /// (receives consumed, outcome). On a failure the QP is moved to the
    /// error state and its completions drained before returning.
    async fn drain_round(&self, qp: &LoopQp, k: usize) -> (usize, Result<(), Error>) {
        let mut consumed = 0;
        let mut sent = 0;
        let mut failure = qp
            .post_empty_sends(k, WR_DRAIN << 56)
            .err()
            .map(|(posted, e)| {
                sent = k - posted; // never posted: no completion will come
                e
            });
        let mut wcs = Vec::with_capacity(32);
        let start = std::time::Instant::now();
        let mut quiet_since: Option<std::time::Instant> = None;
        loop {
            wcs.clear();
            let n = match qp.cq().poll(&mut wcs, 32) {
                Ok(n) => n,
                Err(e) => {
                    failure.get_or_insert(e);
                    0
                }
            };
            for wc in &wcs {
                if wc.wr_id >> 56 == WR_SRQ {
                    // Completed or flushed, this posted receive is gone
                    // from the SRQ.
                    consumed += 1;
                    self.lock().drained(wc.wr_id as u32);
                    crate::stats::GLOBAL
                        .receive_buffers_drained
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                } else {
                    sent += 1;
                    if wc.status != 0 && failure.is_none() {
                        failure = Some(Error::Completion {
                            status: wc.status,
                            status_str: Cq::status_str(wc.status),
                            what: "send (shared receive pool drain)",
                        });
                    }
                }
            }
            if failure.is_none() && consumed == k && sent == k {
                return (consumed, Ok(()));
            }
            if failure.is_none() && start.elapsed() > std::time::Duration::from_secs(5) {
                failure = Some(Error::Timeout {
                    stage: "shared receive pool drain",
                });
            }
            if failure.is_some() {
                if quiet_since.is_none() {
                    let _ = qp.to_error();
                    quiet_since = Some(std::time::Instant::now());
                }
                // Flushed completions come promptly: 200 ms without one
                // more ends the wait (a receive consumed but never reported
                // would be counted as still posted: one buffer of slack).
                if n > 0 {
                    quiet_since = Some(std::time::Instant::now());
                } else if quiet_since
                    .is_some_and(|t| t.elapsed() > std::time::Duration::from_millis(200))
                {
                    if let Some(e) = failure {
                        return (consumed, Err(e));
                    }
                }
            }
            if n == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
    }

    /// The chunk holding buffer `b` and the buffer's offset in it, for a
    /// buffer a receive completion just handed to a connection.
    fn held(&self, b: u32) -> Option<(Arc<RegisteredBuf>, usize)> {
        let mut st = self.lock();
        if !st.hold(b) {
            return None;
        }
        let k = b as usize / CHUNK_BUFFERS;
        let chunk = st.chunks[k].as_ref()?.clone();
        Some((chunk, (b as usize % CHUNK_BUFFERS) * self.buf_bytes))
    }

    /// Takes back buffers a connection is done with ([`PoolState::give_back`]).
    pub(crate) fn give_back(&self, bufs: &[u32]) -> Result<(), Error> {
        if bufs.is_empty() {
            return Ok(());
        }
        let mut st = self.lock();
        st.give_back(bufs);
        self.post(&mut st)
    }

    /// Posts the buffers in `st.post` to the SRQ, one call.
    fn post(&self, st: &mut PoolState<Arc<RegisteredBuf>>) -> Result<(), Error> {
        let mut list: [(u64, u64, u32, u32); crate::verbs::POST_BATCH] =
            [(0, 0, 0, 0); crate::verbs::POST_BATCH];
        for batch in st.post.chunks(crate::verbs::POST_BATCH) {
            for (d, &b) in list.iter_mut().zip(batch) {
                let k = b as usize / CHUNK_BUFFERS;
                let chunk = st.chunks[k]
                    .as_ref()
                    .expect("a posted buffer's chunk is registered");
                let off = (b as usize % CHUNK_BUFFERS) * self.buf_bytes;
                *d = (
                    (WR_SRQ << 56) | u64::from(b),
                    chunk.addr() + off as u64,
                    self.buf_bytes as u32,
                    chunk.lkey(),
                );
            }
            // PoolState::give_back lets a chunk go only when all of its
            // buffers are idle, and the pool drops the SRQ before its chunks.
            // SAFETY: each range is one buffer of a chunk registered on the
            // SRQ's PD, registered while the buffer is posted or held (above);
            // no connection reads a buffer before its receive completes.
            unsafe { self.srq.post(&list[..batch.len()]) }?;
        }
        st.post.clear();
        Ok(())
    }
}

/// A receive buffer of the shared pool holding a connection's message.
struct Held {
    buf: u32,
    chunk: Arc<RegisteredBuf>,
    off: usize,
}

/// A connection's view of a shared receive pool (§4.7): the engine still
/// sees a ring of `reserved` slots; a slot is "posted" by queueing it, and a
/// receive completion from the SRQ binds the oldest queued slot to the
/// buffer the NIC filled, so the engine gets its own wr_id back, in the
/// order it posted, as with a receive queue of its own.
struct SharedRecv {
    pool: Arc<RecvPool>,
    /// Recv CQ of the connection, drained after the QP is destroyed for the
    /// buffer it may have taken (it comes back flushed, §4.7).
    cq: Arc<Cq>,
    reserved: usize,
    posted: VecDeque<(u32, u64)>,
    bound: Vec<Option<Held>>,
    /// Scratch list of buffers to give back.
    back: Vec<u32>,
}

/// QP + all registered memory of one connection (§8 of the wire doc;
/// ownership rules in `docs/buffer-ownership.md`). The rings are registered
/// a segment at a time, the rendezvous region and the staging buffers only
/// while in use (memory on demand, §4.6 and §5.5).
pub(crate) struct ConnMemory {
    // Declared first: dropped first, before any buffer.
    qp: Option<Qp>,
    recv: SlotPool,
    /// With a shared receive queue: the connection's part of it (then
    /// `recv` stays empty).
    shared: Option<SharedRecv>,
    send: SlotPool,
    /// The window the peer reaches `rdv` through, in a shared PD (§4.7);
    /// declared before `rdv`: deallocated (rkey revoked) first.
    window: Option<Mw>,
    rdv: Option<RegisteredBuf>,
    staging: Option<RegisteredBuf>,
    sz: PoolSizes,
    src: BlockSource,
    /// Scratch lists of [`execute`](Self::execute), kept so that posting
    /// allocates nothing in steady state.
    recvs: Vec<(u64, u64, u32, u32)>,
    sends: Vec<SendDesc>,
}

impl ConnMemory {
    /// Registers receive slots `0..recv`, send slots `0..send`, and, with
    /// `static_rdv`, the rendezvous region (advertised in the hello). With
    /// `dev`, `pd` is its PD and the blocks come from it (no static region
    /// there: it would need remote access through its own rkey).
    pub(crate) fn new(
        pd: &Arc<Pd>,
        dev: Option<Arc<DevicePool>>,
        sz: PoolSizes,
        global_limit: usize,
        recv: usize,
        send: usize,
        static_rdv: bool,
    ) -> Result<Self, Error> {
        let mut m = ConnMemory {
            qp: None,
            recv: SlotPool::new(sz.recv_slots, sz.recv_slot_bytes, sz.recv_seg),
            shared: None,
            send: SlotPool::new(sz.send_slots, sz.send_slot_bytes, sz.send_seg),
            window: None,
            rdv: None,
            staging: None,
            sz,
            src: BlockSource {
                pd: pd.clone(),
                dev,
                limit: global_limit,
            },
            recvs: Vec::new(),
            sends: Vec::new(),
        };
        debug_assert!(m.src.dev.as_ref().is_none_or(|d| Arc::ptr_eq(d.pd(), pd)));
        assert!(
            !(static_rdv && m.src.dev.is_some()),
            "no static region in a shared PD"
        );
        m.recv.ensure(&m.src, recv)?;
        m.send.ensure(&m.src, send)?;
        if static_rdv {
            m.rdv = Some(m.register_rdv()?);
        }
        Ok(m)
    }

    /// Like [`new`](Self::new), with the receive buffers drawn from a
    /// listener's shared pool (§4.7): `recv` credits are reserved in it. The
    /// PD is the pool's; the rendezvous region is on demand only (it needs
    /// the QP, to bind its window).
    pub(crate) fn new_shared(
        dev: Arc<DevicePool>,
        pool: Arc<RecvPool>,
        cq: Arc<Cq>,
        sz: PoolSizes,
        global_limit: usize,
        recv: usize,
        send: usize,
    ) -> Result<Self, Error> {
        let pd = pool.pd().clone();
        debug_assert!(
            Arc::ptr_eq(dev.pd(), &pd),
            "the SRQ is in the device pool's PD"
        );
        let mut m = ConnMemory::new(
            &pd,
            Some(dev),
            PoolSizes {
                recv_slots: 0,
                ..sz
            },
            global_limit,
            0,
            send,
            false,
        )?;
        m.sz = sz;
        pool.reserve(recv)?;
        m.shared = Some(SharedRecv {
            pool,
            cq,
            reserved: recv,
            posted: VecDeque::with_capacity(sz.recv_slots),
            bound: (0..sz.recv_slots).map(|_| None).collect(),
            back: Vec::with_capacity(sz.recv_slots),
        });
        Ok(m)
    }

    pub(crate) fn pd(&self) -> &Arc<Pd> {
        &self.src.pd
    }

    /// Whether the receive buffers come from a shared receive queue.
    pub(crate) fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Maps a receive completion from the shared receive queue to the
    /// engine's own wr_id (§4.7): the oldest slot the engine posted takes
    /// the buffer. Other wr_ids are returned unchanged. A message with no
    /// slot posted for it came without credit: the buffer goes back to the
    /// pool and the connection fails. A failed completion gives its buffer
    /// back and maps to a failed receive of the engine.
    pub(crate) fn map_recv(&mut self, wr_id: u64, ok: bool) -> Result<u64, Error> {
        let Some(sh) = self.shared.as_mut() else {
            return Ok(wr_id);
        };
        if wr_id >> 56 != WR_SRQ {
            return Ok(wr_id);
        }
        let b = wr_id as u32;
        if !ok {
            // A flushed (or failed) receive: the connection is failing. The
            // buffer goes back at once; the engine reports the failure.
            sh.pool.give_back(&[b])?;
            return Ok(crate::engine::WR_RECV << 56);
        }
        let Some((chunk, off)) = sh.pool.held(b) else {
            return Err(Error::Protocol(PeerMisbehaved::StaleReceive { wr_id }));
        };
        match sh.posted.pop_front() {
            Some((slot, engine_wr_id)) => {
                sh.bound[slot as usize] = Some(Held { buf: b, chunk, off });
                Ok(engine_wr_id)
            }
            None => {
                sh.pool.give_back(&[b])?;
                Err(Error::Protocol(PeerMisbehaved::SendWithoutCredit {
                    excess: 1,
                    granted: sh.reserved as u32,
                }))
            }
        }
    }

    /// Gives back to the shared pool the SRQ buffers named by completions
    /// polled outside the engine (the teardown's drain, §4.7).
    pub(crate) fn reclaim(&mut self, wcs: &[crate::verbs::Wc]) {
        self.reclaim_with(wcs, &[]);
    }

    /// [`reclaim`](Self::reclaim), with more buffers (`also`) given back in
    /// the same call.
    fn reclaim_with(&mut self, wcs: &[crate::verbs::Wc], also: &[u32]) {
        let Some(sh) = self.shared.as_mut() else {
            return;
        };
        sh.back.clear();
        sh.back.extend(
            wcs.iter()
                .filter(|wc| wc.wr_id >> 56 == WR_SRQ)
                .map(|wc| wc.wr_id as u32),
        );
        sh.back.extend_from_slice(also);
        if let Err(e) = sh.pool.give_back(&sh.back) {
            tracing::warn!("shared receive pool: reposting on close failed: {e}");
        }
    }

    fn register_rdv(&self) -> Result<RegisteredBuf, Error> {
        self.src.take(
            self.sz.rdv_count * self.sz.rdv_bytes,
            if self.src.dev.is_some() {
                Access::Window
            } else {
                Access::RemoteWrite
            },
        )
    }

    pub(crate) fn attach_qp(&mut self, qp: Qp) {
        self.qp = Some(qp);
    }

    pub(crate) fn qp(&self) -> Option<&Qp> {
        self.qp.as_ref()
    }

    /// Address of the region advertised in the hello (0 if on demand).
    pub(crate) fn rdv_addr(&self) -> u64 {
        self.rdv.as_ref().map_or(0, |r| r.addr())
    }

    /// rkey of the region advertised in the hello (0 if on demand).
    pub(crate) fn rdv_rkey(&self) -> u32 {
        self.rdv.as_ref().map_or(0, |r| r.rkey())
    }

    /// Destroys the QP; afterwards the NIC cannot access any buffer. A
    /// memory window goes first (§4.7): it revokes the peer's access, and a
    /// window still bound holds its QP (rxe waited ~50 s in
    /// `ibv_destroy_qp` for it).
    pub(crate) fn destroy_qp(&mut self) {
        self.window = None;
        self.qp = None;
    }

    /// Posts engine actions (bounds-checked against the pools): all
    /// receives first (one call), then all sends/writes in order (one call).
    /// Receives first keeps the rule that a slot is posted before the credit
    /// for it is returned (§4.2).
    pub(crate) fn execute(&mut self, actions: &[Action]) -> Result<(), Error> {
        let qp = self.qp.as_ref().ok_or(Error::Disconnected)?;
        let mut recvs = std::mem::take(&mut self.recvs);
        let mut sends = std::mem::take(&mut self.sends);
        recvs.clear();
        sends.clear();
        if let Some(sh) = self.shared.as_mut() {
            sh.back.clear();
        }
        for a in actions {
            match *a {
                Action::PostRecv { slot, wr_id } if self.shared.is_some() => {
                    let sh = self.shared.as_mut().expect("checked");
                    assert!((slot as usize) < sh.bound.len(), "slot {slot} out of range");
                    if let Some(h) = sh.bound[slot as usize].take() {
                        sh.back.push(h.buf);
                    }
                    sh.posted.push_back((slot, wr_id));
                }
                Action::PostRecv { slot, wr_id } => {
                    let (seg, off) = self.recv.at(slot as usize);
                    recvs.push((
                        wr_id,
                        seg.addr() + off as u64,
                        self.sz.recv_slot_bytes as u32,
                        seg.lkey(),
                    ));
                }
                Action::PostSend {
                    slot,
                    len,
                    wr_id,
                    signaled,
                    inline,
                } => {
                    assert!(len <= self.sz.send_slot_bytes);
                    let (seg, off) = self.send.at(slot as usize);
                    sends.push(SendDesc {
                        wr_id,
                        addr: seg.addr() + off as u64,
                        len: len as u32,
                        lkey: seg.lkey(),
                        signaled,
                        inline,
                        remote: None,
                        imm: None,
                    });
                }
                Action::PostWrite {
                    staging,
                    len,
                    remote_addr,
                    rkey,
                    wr_id,
                    signaled,
                    imm,
                } => {
                    let st = staging as usize;
                    assert!(st < self.sz.rdv_count && len <= self.sz.rdv_bytes);
                    // A zero-length WRITE (keepalive, §4.4) reads nothing:
                    // no staging buffer needs to be registered for it.
                    let (addr, lkey) = match &self.staging {
                        Some(b) => (b.addr() + (st * self.sz.rdv_bytes) as u64, b.lkey()),
                        None if len == 0 => (0, 0),
                        None => panic!("WRITE from staging buffers that are not registered"),
                    };
                    sends.push(SendDesc {
                        wr_id,
                        addr,
                        len: len as u32,
                        lkey,
                        signaled,
                        inline: false,
                        remote: Some((remote_addr, rkey)),
                        imm,
                    });
                }
            }
        }
        // §4.7: the buffers of reposted slots go back to the shared pool
        // (reposted there) before any credit for them leaves below.
        let shared = match &self.shared {
            Some(sh) => sh.pool.give_back(&sh.back),
            None => Ok(()),
        };
        let r = shared
            // SAFETY: every range was bounds-checked against its registered
            // pool above; the pools outlive the QP (field order + destroy_qp);
            // the engine does not touch a receive slot until its completion.
            .and_then(|()| unsafe { qp.post_recvs(&recvs) })
            .and_then(|()| {
                // SAFETY: ranges inside the registered send/staging pools
                // (checked); the engine reuses a slot only after a covering
                // completion (§7).
                unsafe { qp.post_sends(&sends) }
            });
        self.recvs = recvs;
        self.sends = sends;
        r
    }
}

impl Drop for ConnMemory {
    fn drop(&mut self) {
        if let (Some(qp), Some(_)) = (&self.qp, &self.shared) {
            // Flushes the SRQ buffer the QP may have taken (§4.7).
            let _ = qp.to_error();
        }
        // Explicit: the window (see destroy_qp), the QP, then the buffers.
        self.window = None;
        self.qp = None;
        // No work request can reach a block now, nor a peer (the window is
        // gone): the device pool takes them back.
        self.recv.trim(&self.src, 0);
        self.send.trim(&self.src, 0);
        for b in [self.rdv.take(), self.staging.take()].into_iter().flatten() {
            self.src.put(b);
        }
        if let Some(sh) = self.shared.as_mut() {
            // The buffer a QP took from the SRQ comes back as a flushed
            // completion on its CQ (rxe, measured: the last-WQE event is
            // never raised); every other SRQ buffer stays posted for the
            // other connections.
            sh.pool.unreserve(sh.reserved);
            let cq = sh.cq.clone();
            let mut wcs = Vec::new();
            while let Ok(n) = cq.poll(&mut wcs, 32) {
                if n == 0 {
                    break;
                }
            }
            // Held buffers go back with the flushed ones.
            let held: Vec<u32> = sh
                .bound
                .iter_mut()
                .filter_map(|h| h.take())
                .map(|h| h.buf)
                .collect();
            self.reclaim_with(&wcs, &held);
        }
    }
}

impl Buffers for ConnMemory {
    fn recv_slot(&self, i: u32) -> &[u8] {
        let s = self.sz.recv_slot_bytes;
        if let Some(sh) = &self.shared {
            let h = sh.bound[i as usize]
                .as_ref()
                .expect("the engine reads a slot after its receive completed");
            return h.chunk.slice_local(h.off, s);
        }
        let (seg, off) = self.recv.at(i as usize);
        seg.slice_local(off, s)
    }
    fn send_slot(&mut self, i: u32) -> &mut [u8] {
        let s = self.sz.send_slot_bytes;
        let (seg, off) = self.send.at_mut(i as usize);
        seg.slice_mut(off, s)
    }
    fn append_rdv(&self, i: u32, len: usize, out: &mut BytesMut) {
        let s = self.sz.rdv_bytes;
        assert!(len <= s, "copy of {len} bytes from a {s}-byte buffer");
        let rdv = self
            .rdv
            .as_ref()
            .expect("a chunk lands in a registered region");
        rdv.append_to(i as usize * s, len, out)
    }
    fn staging(&mut self, i: u32) -> &mut [u8] {
        let s = self.sz.rdv_bytes;
        let st = self.staging.as_mut().expect("staging opened before use");
        st.slice_mut(i as usize * s, s)
    }
    fn open_rdv(&mut self) -> Result<(u64, u32), String> {
        debug_assert!(self.rdv.is_none());
        let r = self.register_rdv().map_err(|e| e.to_string())?;
        if self.src.dev.is_none() {
            let granted = (r.addr(), r.rkey());
            self.rdv = Some(r);
            return Ok(granted);
        }
        // §4.7: in the shared PD the region's own MR grants no remote
        // access; a type-2 window bound to this connection's QP does, so
        // its rkey is refused on every other QP.
        let qp = self.qp.as_ref().ok_or("the connection is closed")?;
        let mw = match Mw::new(&self.src.pd) {
            Ok(mw) => mw,
            Err(e) => {
                self.src.put(r);
                return Err(e.to_string());
            }
        };
        // `window` is declared before `rdv`: the window is deallocated (rkey
        // revoked) before the region is deregistered, in close_rdv and Drop.
        // SAFETY: r's MR is live, on this QP's PD, with MW_BIND, covered
        // exactly by the window (above); read only by raw copies (append_rdv).
        let rkey = unsafe { qp.bind_window(&mw, r.mr(), r.addr(), r.len() as u64, WR_BIND << 56) }
            .map_err(|e| e.to_string())?;
        let granted = (r.addr(), rkey);
        self.window = Some(mw);
        self.rdv = Some(r);
        Ok(granted)
    }
    fn close_rdv(&mut self) {
        // The engine calls this after the peer's RDV_RELEASE: no WRITE of
        // its can still land (buffer-ownership.md). Deregistered and freed
        // by RegisteredBuf's Drop, or, behind a window, zeroed and kept by
        // the device pool; a late WRITE with the old rkey fails at the NIC
        // and breaks only this connection. A window goes first.
        self.window = None;
        if let Some(r) = self.rdv.take() {
            self.src.put(r);
        }
    }
    fn open_staging(&mut self) -> Result<(), String> {
        if self.staging.is_none() {
            let st = self
                .src
                .take(self.sz.rdv_count * self.sz.rdv_bytes, Access::Local)
                .map_err(|e| e.to_string())?;
            self.staging = Some(st);
        }
        Ok(())
    }
    fn close_staging(&mut self) {
        // Called only when every staging buffer is free: no posted WRITE
        // reads it.
        if let Some(st) = self.staging.take() {
            self.src.put(st);
        }
    }
    fn grow_send(&mut self, n: u32) -> Result<(), String> {
        self.send
            .ensure(&self.src, n as usize)
            .map_err(|e| e.to_string())
    }
    fn shrink_send(&mut self, n: u32) {
        self.send.trim(&self.src, n as usize);
    }
    fn shrink_recv(&mut self, n: u32) {
        // §4.7: the peer released the credits above `n`. Its slots leave
        // the queue of posted ones (no message can be on its way to them:
        // the peer holds at most `n` credits, and the queue keeps `n`
        // slots), the buffer of the one being read goes back, and so does
        // the pool's reservation.
        let Some(sh) = self.shared.as_mut() else {
            return;
        };
        let n = n as usize;
        sh.posted.retain(|&(slot, _)| (slot as usize) < n);
        sh.back.clear();
        for h in sh.bound.iter_mut().skip(n) {
            if let Some(h) = h.take() {
                sh.back.push(h.buf);
            }
        }
        if n < sh.reserved {
            sh.pool.unreserve(sh.reserved - n);
            sh.reserved = n;
        }
        if let Err(e) = sh.pool.give_back(&sh.back) {
            tracing::warn!("shared receive pool: reposting failed: {e}");
        }
    }
    fn grow_recv(&mut self, n: u32) -> Result<(), String> {
        if let Some(sh) = self.shared.as_mut() {
            let n = (n as usize).min(sh.bound.len());
            if n > sh.reserved {
                sh.pool
                    .reserve(n - sh.reserved)
                    .map_err(|e| e.to_string())?;
                sh.reserved = n;
            }
            return Ok(());
        }
        self.recv
            .ensure(&self.src, n as usize)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod pool_tests {
    use super::*;

    fn pool() -> PoolState<()> {
        PoolState::default()
    }

    /// reserve(n) as RecvPool does it, without verbs; returns the posts.
    fn reserve(p: &mut PoolState<()>, n: usize, max: usize) -> Result<Vec<u32>, usize> {
        for _ in 0..p.chunks_short(n, max)? {
            p.add_chunk(());
        }
        p.reserve(n);
        Ok(std::mem::take(&mut p.post))
    }

    fn give_back(p: &mut PoolState<()>, bufs: &[u32]) -> Vec<u32> {
        p.give_back(bufs);
        std::mem::take(&mut p.post)
    }

    #[test]
    fn reservations_are_posted_with_the_slack_in_whole_chunks() {
        let mut p = pool();
        let posted = reserve(&mut p, 4, 1 << 14).unwrap();
        assert_eq!(
            posted.len(),
            4 + POOL_SLACK,
            "the first connection's 4 and the slack"
        );
        assert_eq!(
            p.registered(),
            2 * CHUNK_BUFFERS,
            "20 buffers take 2 chunks"
        );
        // 3 more connections fit in the idle buffers: no registration.
        for _ in 0..3 {
            assert_eq!(reserve(&mut p, 4, 1 << 14).unwrap().len(), 4);
        }
        assert_eq!((p.active, p.registered()), (32, 32));
        // The next one needs a chunk.
        assert_eq!(reserve(&mut p, 4, 1 << 14).unwrap().len(), 4);
        assert_eq!(p.registered(), 48);
        let mut all: Vec<u32> = Vec::new();
        let mut q = pool();
        for _ in 0..5 {
            all.extend(reserve(&mut q, 4, 1 << 14).unwrap());
        }
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 36, "no buffer is posted twice");
    }

    #[test]
    fn the_cap_refuses_a_reservation_and_changes_nothing() {
        let mut p = pool();
        reserve(&mut p, 4, 32).unwrap();
        reserve(&mut p, 12, 32).unwrap(); // 32 = 2 chunks, all active
        assert_eq!(reserve(&mut p, 4, 32), Err(32));
        assert_eq!((p.reserved, p.active, p.registered()), (16, 32, 32));
    }

    #[test]
    fn buffers_are_reposted_at_the_target_and_let_go_above_it() {
        let mut p = pool();
        let posted = reserve(&mut p, 4, 1 << 14).unwrap();
        // A message arrives in each buffer and is consumed: all reposted.
        assert_eq!(give_back(&mut p, &posted), posted);
        // The connection closes holding 2 buffers: its credits leave the
        // target (16), the pool holds 20 → 2 go idle, none reposted.
        p.reserved -= 4;
        assert!(give_back(&mut p, &posted[..2]).is_empty());
        assert_eq!((p.active, p.idle.len()), (18, 14));
        // Traffic from other connections brings the rest back over time: the
        // pool shrinks to its target and lets a chunk go once it is all idle.
        assert!(give_back(&mut p, &posted[2..4]).is_empty());
        assert_eq!(p.active, 16);
        assert_eq!(
            p.registered(),
            2 * CHUNK_BUFFERS,
            "chunk 1 still has posted buffers"
        );
        let mut q = pool();
        let posted = reserve(&mut q, 4, 1 << 14).unwrap();
        q.reserved = 0; // every connection gone
                        // Chunk 0's 4 posted buffers come back first: all of it is then idle.
        let order: Vec<u32> = posted[16..].iter().chain(&posted[..16]).copied().collect();
        assert!(order[..4].iter().all(|&b| (b as usize) < CHUNK_BUFFERS));
        let reposted = give_back(&mut q, &order);
        assert_eq!(reposted.len(), POOL_SLACK, "the slack stays posted");
        assert_eq!(
            q.registered(),
            CHUNK_BUFFERS,
            "the chunk with only idle buffers is gone"
        );
        assert!(q
            .idle
            .iter()
            .all(|&b| (b as usize) < CHUNK_BUFFERS * q.chunks.len()));
        assert!(q
            .idle
            .iter()
            .all(|&b| q.chunks[b as usize / CHUNK_BUFFERS].is_some()));
    }

    #[test]
    fn a_foreign_buffer_is_ignored() {
        let mut p = pool();
        reserve(&mut p, 4, 1 << 14).unwrap();
        assert!(give_back(&mut p, &[999_999]).is_empty());
        assert_eq!(p.active, 20);
    }

    #[test]
    fn a_drain_takes_back_only_what_no_credit_stands_for() {
        let mut p = pool();
        for _ in 0..10 {
            reserve(&mut p, 4, 1 << 14).unwrap();
        }
        assert_eq!((p.active, p.registered()), (56, 64));
        assert_eq!(
            p.drainable(),
            0,
            "every posted buffer backs a credit or the slack"
        );
        // One connection holds a buffer (its receive completed).
        let b = (0..64u32)
            .find(|&b| !p.idle.contains(&b))
            .expect("a posted buffer");
        assert!(p.hold(b));
        assert!(!p.hold(b), "a buffer is held once");
        assert!(!p.hold(999_999), "not one of ours");
        // Nine connections close: 36 credits leave the target.
        p.reserved -= 36;
        // Posted 55; the 4 credits (one of them held) need 3, the slack 16.
        assert_eq!(p.drainable(), 36);
        assert_eq!(
            drain_size(&p),
            20,
            "one more slack is left for closing QPs' buffers"
        );
        p.drain_start(20);
        assert_eq!(p.active, 36);
        // While the drain runs, the held buffer comes back: above the
        // target, it goes idle.
        give_back(&mut p, &[b]);
        assert_eq!((p.active, p.held), (35, 0));
        // The drain consumed 20 posted buffers: idle now.
        let posted: Vec<u32> = (0..64u32)
            .filter(|&x| !p.idle.contains(&x) && x != b)
            .collect();
        for &x in &posted[..20] {
            p.drained(x);
        }
        assert_eq!(p.idle.len() + p.active, p.registered());
        assert_eq!(
            p.drainable(),
            35 - 20,
            "what is left is 20 above the target"
        );
        assert!(drain_size(&p) < DRAIN_MIN, "and too little to drain again");
        // If the drain had stopped after consuming 15 of 20, the other 5
        // would still be posted.
        let mut q = pool();
        for _ in 0..10 {
            reserve(&mut q, 4, 1 << 14).unwrap();
        }
        q.reserved -= 36;
        q.drain_start(20);
        q.drain_undo(5);
        assert_eq!(q.active, 56 - 15);
    }

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
