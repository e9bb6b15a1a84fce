//! Completions: the completion channel a connection's CQs report on
//! ([`CompChannel`], its fd watched by tokio), the CQs ([`Cq`]: polling,
//! arming, consuming events) and one polled completion ([`Wc`]).

use std::ffi::CStr;
use std::os::fd::RawFd;
use std::sync::Arc;

use rdma_sys::*;

use super::cm;
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `dl`).
use super::dl::{
    ibv_ack_cq_events, ibv_create_comp_channel, ibv_create_cq, ibv_destroy_comp_channel,
    ibv_destroy_cq, ibv_get_cq_event, ibv_wc_status_str,
};
use super::{errno, set_nonblocking, verb_err, warn_destroy};
use crate::error::{Errno, Error};

/// Completion channel (its fd is made non-blocking for tokio's AsyncFd).
pub(crate) struct CompChannel {
    ptr: *mut ibv_comp_channel,
    _id: Arc<cm::CmId>,
}

// SAFETY: thread-safe verbs object, pointer only passed to libibverbs.
unsafe impl Send for CompChannel {}

// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    pub(crate) fn new(id: Arc<cm::CmId>) -> Result<Arc<CompChannel>, Error> {
        // SAFETY: id.verbs() is the live device context (held by the id).
        let ptr = unsafe { ibv_create_comp_channel(id.verbs()) };
        if ptr.is_null() {
            return Err(verb_err("ibv_create_comp_channel"));
        }
        let ch = CompChannel { ptr, _id: id };
        set_nonblocking(ch.fd(), "fcntl(comp_channel)")?;
        Ok(Arc::new(ch))
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: ptr is a live comp channel; reading a plain field.
        unsafe { (*self.ptr).fd }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: ptr came from ibv_create_comp_channel and is destroyed
        // only here; every CQ using it holds an Arc to it, so none remain.
        let r = unsafe { ibv_destroy_comp_channel(self.ptr) };
        warn_destroy("ibv_destroy_comp_channel", r);
    }
}

/// One polled work completion.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub byte_len: u32,
    /// Immediate data of a receive completion (host byte order).
    pub imm: crate::engine::Imm,
}

/// Completion queue bound to a completion channel.
pub(crate) struct Cq {
    pub(crate) ptr: *mut ibv_cq,
    chan: Arc<CompChannel>,
}

// SAFETY: thread-safe verbs object, pointer only passed to libibverbs.
unsafe impl Send for Cq {}

// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn new(
        id: &Arc<cm::CmId>,
        chan: Arc<CompChannel>,
        cqe: i32,
    ) -> Result<Arc<Cq>, Error> {
        // SAFETY: valid context and channel (both kept alive by Arcs).
        let ptr = unsafe { ibv_create_cq(id.verbs(), cqe, std::ptr::null_mut(), chan.ptr, 0) };
        if ptr.is_null() {
            return Err(verb_err("ibv_create_cq"));
        }
        Ok(Arc::new(Cq { ptr, chan }))
    }

    pub(crate) fn channel_fd(&self) -> RawFd {
        self.chan.fd()
    }

    /// Polls up to `max` completions, appending to `out`. Returns the count.
    pub(crate) fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<usize, Error> {
        const BATCH: usize = 32;
        let max = max.min(BATCH);
        // Not zeroed: the provider writes the entries it returns, and only
        // those are read (zeroing 1.5 KiB per poll showed in the busy-poll).
        let mut wcs = [const { std::mem::MaybeUninit::<ibv_wc>::uninit() }; BATCH];
        // SAFETY: ptr is a live CQ; wcs has room for `max` ≤ BATCH entries
        // (MaybeUninit<ibv_wc> has ibv_wc's layout).
        let n = unsafe { ibv_poll_cq(self.ptr, max as i32, wcs.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::Verb {
                verb: "ibv_poll_cq",
                errno: Errno(-n),
            });
        }
        let n = (n as usize).min(max);
        for wc in &wcs[..n] {
            // Fields are read one by one through the pointer: for a failed
            // completion only `wr_id` and `status` need have been written, so
            // no reference to the whole entry is made.
            let p = wc.as_ptr();
            // SAFETY: ibv_poll_cq(3) filled the first `n` ≤ max entries (n is
            // clamped above) and `wr_id` and `status` are valid in each.
            let (wr_id, status) = unsafe { ((*p).wr_id, (*p).status) };
            if status != ibv_wc_status::IBV_WC_SUCCESS {
                out.push(Wc {
                    wr_id,
                    status,
                    byte_len: 0,
                    imm: crate::engine::Imm::None,
                });
                continue;
            }
            // SAFETY: a successful completion has opcode, byte_len and
            // wc_flags valid, and imm_data when IBV_WC_WITH_IMM is set
            // (ibv_poll_cq(3)); all are plain integers.
            let (opcode, byte_len, flags) = unsafe { ((*p).opcode, (*p).byte_len, (*p).wc_flags) };
            let imm = if flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
                // SAFETY: with IBV_WC_WITH_IMM the union holds imm_data.
                let v = u32::from_be(unsafe { (*p).imm_data_invalidated_rkey_union.imm_data });
                if opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                    crate::engine::Imm::Write(v)
                } else {
                    crate::engine::Imm::Send(v)
                }
            } else {
                crate::engine::Imm::None
            };
            out.push(Wc {
                wr_id,
                status,
                byte_len,
                imm,
            });
        }
        Ok(n)
    }

    /// Arms the CQ for the next completion event.
    pub(crate) fn arm(&self) -> Result<(), Error> {
        // SAFETY: ptr is a live CQ.
        let r = unsafe { ibv_req_notify_cq(self.ptr, 0) };
        if r != 0 {
            return Err(Error::Verb {
                verb: "ibv_req_notify_cq",
                errno: Errno(r),
            });
        }
        Ok(())
    }

    /// Reads (non-blocking) and acknowledges pending completion events.
    /// Returns how many were consumed.
    pub(crate) fn consume_events(&self) -> Result<u32, Error> {
        let mut n = 0;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: live channel with a non-blocking fd; out-pointers valid.
            let r = unsafe { ibv_get_cq_event(self.chan.ptr, &mut cq, &mut ctx) };
            if r != 0 {
                let e = errno();
                if e.0 == libc::EAGAIN || e.0 == libc::EWOULDBLOCK {
                    break;
                }
                return Err(Error::Verb {
                    verb: "ibv_get_cq_event",
                    errno: e,
                });
            }
            // SAFETY: `cq` is the live CQ of this channel the event was for
            // (a connection's send or receive CQ); acked at once so
            // ibv_destroy_cq never blocks on unacked events.
            unsafe { ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
        Ok(n)
    }

    pub(crate) fn status_str(status: u32) -> String {
        // SAFETY: ibv_wc_status_str returns a static string for any value.
        unsafe { CStr::from_ptr(ibv_wc_status_str(status)) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: ptr came from ibv_create_cq and is destroyed only here; the
        // QP using this CQ holds an Arc to it, so it is gone; every event
        // read was acked at once in consume_events.
        let r = unsafe { ibv_destroy_cq(self.ptr) };
        warn_destroy("ibv_destroy_cq", r);
    }
}
