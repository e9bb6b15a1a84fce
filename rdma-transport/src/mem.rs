//! Registered memory and the per-connection buffer pools.
//!
//! [`ConnMemory`] owns the QP together with every buffer the NIC may touch,
//! and destroys the QP before any buffer is deregistered or freed. See
//! `docs/buffer-ownership.md` for who owns which slot when.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::BytesMut;
use rdma_sys::*;

use crate::engine::{Action, Buffers};
use crate::error::Error;
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `verbs::dl`).
use crate::verbs::dl::{ibv_dereg_mr, ibv_reg_mr};
use crate::verbs::{verb_err, Pd, Qp, SendDesc};

/// Process-wide registered bytes (checked against `Config::global_max_registered_bytes`).
pub(crate) static REGISTERED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// A page-aligned heap allocation registered with a PD.
pub(crate) struct RegisteredBuf {
    ptr: NonNull<u8>,
    len: usize,
    mr: *mut ibv_mr,
    /// Registered with REMOTE_WRITE: the peer may write it at any time, so
    /// no Rust reference over it is ever formed (only raw copies).
    remote_write: bool,
    _pd: Arc<Pd>,
}

// SAFETY: the buffer is uniquely owned (like a Box<[u8]>); the MR pointer is
// only passed to thread-safe libibverbs calls.
unsafe impl Send for RegisteredBuf {}

impl RegisteredBuf {
    pub(crate) fn new(
        pd: &Arc<Pd>,
        len: usize,
        remote_write: bool,
        global_limit: usize,
    ) -> Result<RegisteredBuf, Error> {
        let len = len.max(64);
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
        if remote_write {
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
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
        Ok(RegisteredBuf {
            ptr,
            len,
            mr,
            remote_write,
            _pd: pd.clone(),
        })
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

    /// A shared slice over a part of a pool that **nobody can write while
    /// it lives**: only for pools that are not remotely writable (the
    /// receive ring), and only for a slot whose receive completed and that
    /// is not reposted while the slice is alive.
    fn slice_local(&self, off: usize, len: usize) -> &[u8] {
        assert!(
            !self.remote_write,
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
        assert!(!self.remote_write, "no slice over remotely writable memory");
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

    /// Registers every segment that holds one of slots `0..n`.
    fn ensure(&mut self, pd: &Arc<Pd>, n: usize, limit: usize) -> Result<(), Error> {
        let n = n.min(self.slots);
        for k in 0..n.div_ceil(self.seg_slots) {
            if self.segs[k].is_none() {
                let count = self.seg_slots.min(self.slots - k * self.seg_slots);
                self.segs[k] = Some(RegisteredBuf::new(
                    pd,
                    count * self.slot_bytes,
                    false,
                    limit,
                )?);
            }
        }
        Ok(())
    }

    /// Deregisters every segment whose slots are all at or above `n` (the
    /// caller guarantees none of them is posted).
    fn trim(&mut self, n: usize) {
        for k in n.div_ceil(self.seg_slots)..self.segs.len() {
            self.segs[k] = None;
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

/// QP + all registered memory of one connection (§8 of the wire doc;
/// ownership rules in `docs/buffer-ownership.md`). The rings are registered
/// a segment at a time, the rendezvous region and the staging buffers only
/// while in use (memory on demand, §4.6 and §5.5).
pub(crate) struct ConnMemory {
    // Declared first: dropped first, before any buffer.
    qp: Option<Qp>,
    recv: SlotPool,
    send: SlotPool,
    rdv: Option<RegisteredBuf>,
    staging: Option<RegisteredBuf>,
    sz: PoolSizes,
    pd: Arc<Pd>,
    global_limit: usize,
    /// Scratch lists of [`execute`](Self::execute), kept so that posting
    /// allocates nothing in steady state.
    recvs: Vec<(u64, u64, u32, u32)>,
    sends: Vec<SendDesc>,
}

impl ConnMemory {
    /// Registers receive slots `0..recv`, send slots `0..send`, and, with
    /// `static_rdv`, the rendezvous region (advertised in the hello).
    pub(crate) fn new(
        pd: &Arc<Pd>,
        sz: PoolSizes,
        global_limit: usize,
        recv: usize,
        send: usize,
        static_rdv: bool,
    ) -> Result<Self, Error> {
        let mut m = ConnMemory {
            qp: None,
            recv: SlotPool::new(sz.recv_slots, sz.recv_slot_bytes, sz.recv_seg),
            send: SlotPool::new(sz.send_slots, sz.send_slot_bytes, sz.send_seg),
            rdv: None,
            staging: None,
            sz,
            pd: pd.clone(),
            global_limit,
            recvs: Vec::new(),
            sends: Vec::new(),
        };
        m.recv.ensure(pd, recv, global_limit)?;
        m.send.ensure(pd, send, global_limit)?;
        if static_rdv {
            m.rdv = Some(m.register_rdv()?);
        }
        Ok(m)
    }

    fn register_rdv(&self) -> Result<RegisteredBuf, Error> {
        RegisteredBuf::new(
            &self.pd,
            self.sz.rdv_count * self.sz.rdv_bytes,
            true,
            self.global_limit,
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

    /// Destroys the QP; afterwards the NIC cannot access any buffer.
    pub(crate) fn destroy_qp(&mut self) {
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
        for a in actions {
            match *a {
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
        // SAFETY: every range was bounds-checked against its registered pool
        // above; the pools outlive the QP (field order + destroy_qp); the
        // engine does not touch a receive slot until its completion.
        let r = unsafe { qp.post_recvs(&recvs) }.and_then(|()| {
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
        // Explicit: QP first, then the buffers (field order would do the same).
        self.qp = None;
    }
}

impl Buffers for ConnMemory {
    fn recv_slot(&self, i: u32) -> &[u8] {
        let s = self.sz.recv_slot_bytes;
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
        let granted = (r.addr(), r.rkey());
        self.rdv = Some(r);
        Ok(granted)
    }
    fn close_rdv(&mut self) {
        // The engine calls this after the peer's RDV_RELEASE: no WRITE of
        // its can still land (buffer-ownership.md). Deregistered and freed
        // by RegisteredBuf's Drop; a late WRITE with the old rkey fails at
        // the NIC and breaks only this connection.
        self.rdv = None;
    }
    fn open_staging(&mut self) -> Result<(), String> {
        if self.staging.is_none() {
            let st = RegisteredBuf::new(
                &self.pd,
                self.sz.rdv_count * self.sz.rdv_bytes,
                false,
                self.global_limit,
            )
            .map_err(|e| e.to_string())?;
            self.staging = Some(st);
        }
        Ok(())
    }
    fn close_staging(&mut self) {
        // Called only when every staging buffer is free: no posted WRITE
        // reads it.
        self.staging = None;
    }
    fn grow_send(&mut self, n: u32) -> Result<(), String> {
        self.send
            .ensure(&self.pd, n as usize, self.global_limit)
            .map_err(|e| e.to_string())
    }
    fn shrink_send(&mut self, n: u32) {
        self.send.trim(n as usize);
    }
    fn grow_recv(&mut self, n: u32) -> Result<(), String> {
        self.recv
            .ensure(&self.pd, n as usize, self.global_limit)
            .map_err(|e| e.to_string())
    }
}
