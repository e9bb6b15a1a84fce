//! A type-2 memory window ([`Mw`]): the only way a peer reaches a
//! rendezvous region in a shared PD (wire protocol §4.7); bound by
//! [`Qp::bind_window`](super::Qp::bind_window).

use std::sync::Arc;

use rdma_sys::*;

use super::{verb_err, warn_destroy, Pd};
use crate::error::Error;

/// A type-2 memory window: the only way a peer reaches a rendezvous region
/// in a shared PD (§4.7). Deallocating it revokes every rkey it was bound
/// with.
pub(crate) struct Mw {
    pub(super) ptr: *mut ibv_mw,
    _pd: Arc<Pd>,
}

// SAFETY: thread-safe verbs object, pointer only passed to libibverbs.
unsafe impl Send for Mw {}

impl Mw {
    pub(crate) fn new(pd: &Arc<Pd>) -> Result<Mw, Error> {
        // SAFETY: pd is live; rdma-sys checks that the provider has alloc_mw.
        match unsafe { ibv_alloc_mw(pd.ptr, ibv_mw_type::IBV_MW_TYPE_2) } {
            Some(ptr) if !ptr.is_null() => Ok(Mw {
                ptr,
                _pd: pd.clone(),
            }),
            _ => Err(verb_err("ibv_alloc_mw")),
        }
    }
}

impl Mw {
    /// The rkey the window's next bind gives it: its current one with the
    /// key byte moved on (`ibv_inc_rkey`), so an rkey of an earlier bind is
    /// refused once the window is bound again.
    pub(crate) fn next_rkey(&self) -> u32 {
        // SAFETY: ptr is a live window (plain field read).
        unsafe { ibv_inc_rkey((*self.ptr).rkey) }
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        // SAFETY: ptr came from ibv_alloc_mw and is deallocated only here.
        let r = unsafe { ibv_dealloc_mw(self.ptr) };
        warn_destroy("ibv_dealloc_mw", r);
    }
}
