//! A protection domain ([`Pd`]), allocated on the device of a cm_id: the
//! scope of every memory registration, memory window and queue pair in it.

use std::sync::Arc;

use rdma_sys::*;

use super::cm;
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `dl`).
use super::dl::{ibv_alloc_pd, ibv_dealloc_pd};
use super::{verb_err, warn_destroy};
use crate::error::{Error, NoDeviceReason};

/// Protection domain, allocated on the device of a cm_id.
pub(crate) struct Pd {
    pub(crate) ptr: *mut ibv_pd,
    _id: Arc<cm::CmId>,
}

// SAFETY: libibverbs objects are thread-safe ("all verbs are thread safe");
// the pointer is only dereferenced by libibverbs.
unsafe impl Send for Pd {}

// SAFETY: see Send; &Pd only exposes the pointer to thread-safe verbs.
unsafe impl Sync for Pd {}

impl Pd {
    pub(crate) fn new(id: Arc<cm::CmId>) -> Result<Arc<Pd>, Error> {
        let ctx = id.verbs();
        if ctx.is_null() {
            return Err(Error::NoDevice(NoDeviceReason::Unbound));
        }
        // SAFETY: ctx is the live device context of the resolved cm_id, kept
        // open by librdmacm while the id exists (we hold the id).
        let ptr = unsafe { ibv_alloc_pd(ctx) };
        if ptr.is_null() {
            return Err(verb_err("ibv_alloc_pd"));
        }
        Ok(Arc::new(Pd { ptr, _id: id }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: ptr came from ibv_alloc_pd and is deallocated only here;
        // every MR and the QP hold an Arc to this Pd, so none remain.
        let r = unsafe { ibv_dealloc_pd(self.ptr) };
        warn_destroy("ibv_dealloc_pd", r);
    }
}
