//! One registered buffer: a page-aligned heap allocation registered with
//! a PD ([`RegisteredBuf`]), how the peer may reach it ([`Access`]), and
//! the only ways the CPU reads and writes it (a shared slice only over
//! memory no peer can write; raw copies otherwise). Registering counts the
//! bytes against `Config::global_max_registered_bytes`.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::BytesMut;
use rdma_sys::*;

use super::REGISTERED_BYTES;
use crate::error::{Error, ResourceError};
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `verbs::dl`).
use crate::verbs::dl::{ibv_dereg_mr, ibv_reg_mr};
use crate::verbs::{verb_err, Pd};

/// A page-aligned heap allocation registered with a PD.
pub(crate) struct RegisteredBuf {
    ptr: NonNull<u8>,
    pub(super) len: usize,
    mr: *mut ibv_mr,
    /// Not `Local`: the peer may write it at any time, so no Rust reference
    /// over it is ever formed (only raw copies).
    pub(super) access: Access,
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
            return Err(Error::ResourceLimit(ResourceError::RegisteredBytes {
                requested: len,
                cap: global_limit,
                in_use: prev,
            }));
        }
        let layout = Layout::from_size_align(len, 4096).expect("valid layout");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            REGISTERED_BYTES.fetch_sub(len, Ordering::SeqCst);
            return Err(Error::ResourceLimit(ResourceError::Allocation {
                bytes: len,
            }));
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
    pub(super) fn size_for(len: usize) -> usize {
        len.max(64)
    }

    /// Zeroes the whole buffer, through a raw pointer (it may be a
    /// rendezvous region, over which no reference is formed).
    ///
    /// For a buffer no work request and no peer can reach any more: a
    /// rendezvous region whose window was deallocated (its MR grants no
    /// remote access of its own, §4.7), before the process-wide pool hands
    /// it to another connection. `&mut self` excludes every CPU alias.
    pub(super) fn zero(&mut self) {
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
    pub(super) fn slice_local(&self, off: usize, len: usize) -> &[u8] {
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
    pub(super) fn append_to(&self, off: usize, len: usize, out: &mut BytesMut) {
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

    pub(super) fn slice_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
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
