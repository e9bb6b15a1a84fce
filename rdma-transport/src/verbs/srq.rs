//! A shared receive queue ([`Srq`]) in a listener's shared PD (wire
//! protocol §4.7), and posting receives to it.

use std::sync::Arc;

use rdma_sys::*;

// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `dl`).
use super::dl::{ibv_create_srq, ibv_destroy_srq};
use super::qp::post_recv_list;
use super::{verb_err, warn_destroy, Pd};
use crate::error::Error;

/// Shared receive queue of a listener's shared PD (wire protocol §4.7).
pub(crate) struct Srq {
    pub(crate) ptr: *mut ibv_srq,
    _pd: Arc<Pd>,
}

// SAFETY: thread-safe verbs object ("all verbs are thread safe"), the
// pointer is only passed to libibverbs.
unsafe impl Send for Srq {}

// SAFETY: as above; posting from several threads is allowed by libibverbs.
unsafe impl Sync for Srq {}

impl Srq {
    pub(crate) fn new(pd: &Arc<Pd>, max_wr: u32) -> Result<Srq, Error> {
        // SAFETY: ibv_srq_init_attr is plain C data; zero is valid.
        let mut attr: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = max_wr;
        attr.attr.max_sge = 1;
        // SAFETY: pd is live (we keep an Arc); attr is fully initialised.
        let ptr = unsafe { ibv_create_srq(pd.ptr, &mut attr) };
        if ptr.is_null() {
            return Err(verb_err("ibv_create_srq"));
        }
        Ok(Srq {
            ptr,
            _pd: pd.clone(),
        })
    }

    /// Posts receives to the SRQ, like [`Qp::post_recvs`].
    ///
    /// # Safety
    /// As [`Qp::post_recvs`]: every range lies in memory registered with its
    /// `lkey` on this SRQ's PD, stays allocated, and is neither read nor
    /// written by the CPU until a completion for it is polled on the CQ of
    /// the QP that took it, or the SRQ is destroyed.
    pub(crate) unsafe fn post(&self, list: &[(u64, u64, u32, u32)]) -> Result<(), Error> {
        // SAFETY: the caller's contract; `wr` is the list built by
        // post_recv_list, live across the call.
        unsafe {
            post_recv_list(list, "ibv_post_srq_recv", |wr, bad| {
                ibv_post_srq_recv(self.ptr, wr, bad)
            })
        }
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: ptr came from ibv_create_srq and is destroyed only here;
        // every QP using it holds an Arc to it, so none remains.
        let r = unsafe { ibv_destroy_srq(self.ptr) };
        warn_destroy("ibv_destroy_srq", r);
    }
}
