//! The verbs objects: thin RAII wrappers over libibverbs and librdmacm
//! (via `rdma-sys`, the libraries loaded at run time by `dl`), one file per
//! object, each owning one C object and destroying it exactly once.
//!
//! * `device`: the device list and what a device offers,
//! * `pd`: protection domains, `mw`: memory windows,
//! * `cq`: completion channels, CQs and polled completions,
//! * `qp`: the connection's RC queue pair and posting to it,
//! * `srq`: shared receive queues, `loop_qp`: the queue pair connected to
//!   itself that drains one,
//! * `cm`: rdma_cm event channels and identifiers,
//! * `fd`: watching a channel's file descriptor with tokio.
//!
//! This module tree and `crate::mem` are the only places with `unsafe`.
//! Ownership: children hold an `Arc` of their parent (PD -> cm_id, CQ ->
//! completion channel -> cm_id, cm_id -> event channel), so a parent is never
//! destroyed while a child exists. The QP ([`Qp`]) is owned by
//! `crate::mem::ConnMemory`, which destroys it before deregistering memory.

pub mod cm;
mod cq;
mod device;
pub(crate) mod dl;
mod fd;
mod loop_qp;
mod mw;
mod pd;
mod qp;
mod srq;

use std::os::fd::RawFd;

use crate::error::{Errno, Error};

pub(crate) use self::cq::{CompChannel, Cq, Wc};
pub use self::device::devices;
pub(crate) use self::device::{shared_receive_support, window_support};
pub(crate) use self::fd::{async_fd, FdOwner};
pub(crate) use self::loop_qp::LoopQp;
pub(crate) use self::mw::Mw;
pub(crate) use self::pd::Pd;
pub(crate) use self::qp::{OneSidedDesc, Qp, QpCaps, SendDesc, POST_BATCH};
pub(crate) use self::srq::Srq;

pub(crate) fn errno() -> Errno {
    Errno(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// Logs a failed destroy/deregister call (a `Drop` cannot return it): `r` is
/// the call's return value, an errno itself (libibverbs) or -1 with `errno`
/// set (librdmacm).
pub(crate) fn warn_destroy(verb: &'static str, r: i32) {
    if r != 0 {
        let e = if r > 0 { Errno(r) } else { errno() };
        tracing::warn!("{verb} failed: {e}; the resource may be leaked");
    }
}

pub(crate) fn verb_err(verb: &'static str) -> Error {
    Error::Verb {
        verb,
        errno: errno(),
    }
}

/// Sets O_NONBLOCK on a file descriptor owned by verbs/cm.
pub(crate) fn set_nonblocking(fd: RawFd, verb: &'static str) -> Result<(), Error> {
    // SAFETY: fcntl on an fd we own (from a live channel); no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(verb_err(verb));
    }
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
    if r < 0 {
        return Err(verb_err(verb));
    }
    Ok(())
}
