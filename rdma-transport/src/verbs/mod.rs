//! Thin RAII wrappers over libibverbs / librdmacm (via `rdma-sys`).
//!
//! This module tree and `crate::mem` are the only places with `unsafe`.
//! Ownership: children hold an `Arc` of their parent (PD -> cm_id, CQ ->
//! completion channel -> cm_id, cm_id -> event channel), so a parent is never
//! destroyed while a child exists. The QP ([`Qp`]) is owned by
//! `crate::mem::ConnMemory`, which destroys it before deregistering memory.

pub mod cm;
pub(crate) mod dl;

use std::ffi::CStr;
use std::os::fd::RawFd;
use std::sync::Arc;

use rdma_sys::*;

// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `dl`).
use self::dl::{
    ibv_ack_cq_events, ibv_alloc_pd, ibv_create_comp_channel, ibv_create_cq, ibv_create_qp,
    ibv_create_srq, ibv_dealloc_pd, ibv_destroy_comp_channel, ibv_destroy_cq, ibv_destroy_qp,
    ibv_destroy_srq, ibv_free_device_list, ibv_get_cq_event, ibv_get_device_guid,
    ibv_get_device_list, ibv_get_device_name, ibv_modify_qp, ibv_query_device, ibv_query_gid,
    ibv_wc_status_str, rdma_create_qp, rdma_destroy_qp,
};
use crate::error::{Errno, Error};
use crate::DeviceInfo;

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

/// Lists RDMA devices. A kernel without RDMA (ENOSYS, no sysfs class) or a
/// host without the RDMA libraries yields an empty list, never an error or a
/// crash.
pub fn devices() -> Result<Vec<DeviceInfo>, Error> {
    if dl::load().is_err() {
        return Ok(Vec::new());
    }
    let mut n: i32 = 0;
    // SAFETY: ibv_get_device_list writes the count into `n` and returns a
    // NULL-terminated array (or NULL on failure).
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = errno();
        return match e.0 {
            0 | libc::ENOSYS | libc::ENOENT | libc::ENODEV | libc::EPERM | libc::EACCES => {
                Ok(Vec::new())
            }
            _ => Err(Error::Verb {
                verb: "ibv_get_device_list",
                errno: e,
            }),
        };
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: `list` has `n` valid entries (documented contract).
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: dev is a valid ibv_device from the list; the name is a
        // NUL-terminated string inside it, valid until ibv_free_device_list.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: dev is valid (see above).
        let guid = u64::from_be(unsafe { ibv_get_device_guid(dev) });
        // SAFETY: dev is valid; reading a plain field.
        let tt = unsafe { (*dev).transport_type };
        let transport = match tt {
            ibv_transport_type::IBV_TRANSPORT_IB => "InfiniBand/RoCE",
            ibv_transport_type::IBV_TRANSPORT_IWARP => "iWARP",
            _ => "other",
        };
        out.push(DeviceInfo {
            name,
            guid,
            transport,
        });
    }
    // SAFETY: list came from ibv_get_device_list and is freed exactly once.
    unsafe { ibv_free_device_list(list) };
    Ok(out)
}

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
            return Err(Error::NoDevice("cm_id is not bound to a device".into()));
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

/// The device attributes of a bound cm_id (`None`: not bound, or the query
/// failed).
fn query_device(id: &cm::CmId) -> Option<ibv_device_attr> {
    let ctx = id.verbs();
    if ctx.is_null() {
        return None;
    }
    // SAFETY: ibv_device_attr is plain C data; zero is valid.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is the live device context of the bound id (held by it);
    // attr is a valid out-pointer.
    let r = unsafe { ibv_query_device(ctx, &mut attr) };
    if r != 0 {
        tracing::debug!("ibv_query_device failed: {}", Errno(r));
        return None;
    }
    Some(attr)
}

/// Whether the device of a bound cm_id has type-2 memory windows, which a
/// shared PD needs: there, rendezvous regions are reached only through
/// windows bound to one QP (wire protocol §4.7). siw has none.
pub(crate) fn window_support(id: &cm::CmId) -> bool {
    query_device(id).is_some_and(|attr| {
        attr.max_mw > 0
            && attr.device_cap_flags
                & (ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0
                    | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0)
                != 0
    })
}

/// What the device of a bound cm_id offers for a listener's shared receive
/// queue (wire protocol §4.7): `Some(max_srq_wr)` when it has SRQs, `None`
/// otherwise or when the device cannot be queried. (The shared PD it lives
/// in also needs [`window_support`].)
pub(crate) fn shared_receive_support(id: &cm::CmId) -> Option<u32> {
    query_device(id).and_then(|attr| {
        (attr.max_srq > 0 && attr.max_srq_wr > 0).then_some(attr.max_srq_wr as u32)
    })
}

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

/// `ibv_modify_qp`; a failure is an error naming `verb`.
///
/// # Safety
/// `qp` is a live QP, and `a` holds valid values for every field `mask`
/// selects.
unsafe fn modify_qp(
    qp: *mut ibv_qp,
    a: &mut ibv_qp_attr,
    mask: ibv_qp_attr_mask,
    verb: &'static str,
) -> Result<(), Error> {
    // SAFETY: the caller's contract (above).
    let r = unsafe { ibv_modify_qp(qp, a, mask.0 as i32) };
    if r != 0 {
        return Err(Error::Verb {
            verb,
            errno: Errno(r),
        });
    }
    Ok(())
}

/// Moves a QP to the error state (its posted work requests are flushed).
///
/// # Safety
/// `qp` is a live QP.
unsafe fn qp_to_error(qp: *mut ibv_qp) -> Result<(), Error> {
    // SAFETY: ibv_qp_attr is plain C data; zero is valid.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = ibv_qp_state::IBV_QPS_ERR;
    // SAFETY: live QP (the caller's contract); only the state is selected.
    unsafe {
        modify_qp(
            qp,
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(ERR)",
        )
    }
}

/// An RC queue pair connected to itself that receives from a shared receive
/// queue: each zero-length SEND it posts consumes one receive posted to the
/// SRQ, whose completion (wr_id of that receive) comes on [`cq`](Self::cq).
/// A shared receive pool uses it to take back buffers it posted above its
/// target (wire protocol §4.7, "Shrinking"), since a posted receive cannot
/// be withdrawn otherwise. Created without rdma_cm (nothing to resolve:
/// the peer is itself), with the GID of the device's address `ip`.
pub(crate) struct LoopQp {
    qp: *mut ibv_qp,
    cq: Arc<Cq>,
    _srq: Arc<Srq>,
    _pd: Arc<Pd>,
}

// SAFETY: thread-safe verbs object, pointer only passed to libibverbs.
unsafe impl Send for LoopQp {}
// SAFETY: as above; posting from several threads is allowed by libibverbs.
unsafe impl Sync for LoopQp {}

impl LoopQp {
    pub(crate) fn new(
        id: &Arc<cm::CmId>,
        pd: &Arc<Pd>,
        srq: &Arc<Srq>,
        ip: std::net::IpAddr,
        depth: u32,
    ) -> Result<LoopQp, Error> {
        let ctx = id.verbs();
        if ctx.is_null() {
            return Err(Error::NoDevice("cm_id is not bound to a device".into()));
        }
        // SAFETY: ptr is the live cm_id (held by `id`); plain field read.
        let port = match unsafe { (*id.ptr).port_num } {
            0 => 1,
            p => p,
        };
        // RoCE's GID of an address: the IPv6 address, or the IPv4-mapped one.
        let want: [u8; 16] = match ip {
            std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            std::net::IpAddr::V6(v6) => v6.octets(),
        };
        let mut sgid_index = None;
        for i in 0..256 {
            // SAFETY: ibv_gid is plain C data; zero is valid.
            let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: live context, valid out-pointer.
            if unsafe { ibv_query_gid(ctx, port, i, &mut gid) } != 0 {
                break;
            }
            // SAFETY: every bit pattern is a valid `[u8; 16]`.
            if unsafe { gid.raw } == want {
                sgid_index = Some(i as u8);
                break;
            }
        }
        let sgid_index = sgid_index.ok_or_else(|| {
            Error::NoDevice(format!("no GID of {ip} on port {port} of the device"))
        })?;
        let cq = Cq::new(id, CompChannel::new(id.clone())?, depth as i32 * 2 + 16)?;
        // SAFETY: ibv_qp_init_attr is plain C data; zero is valid.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.ptr;
        init.recv_cq = cq.ptr;
        init.srq = srq.ptr;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 1;
        init.cap.max_send_wr = depth;
        init.cap.max_send_sge = 1;
        // SAFETY: pd, cq and srq are live (held below); init is valid.
        let qp = unsafe { ibv_create_qp(pd.ptr, &mut init) };
        if qp.is_null() {
            return Err(verb_err("ibv_create_qp"));
        }
        let me = LoopQp {
            qp,
            cq,
            _srq: srq.clone(),
            _pd: pd.clone(),
        };
        // SAFETY: ptr is the QP just created; qp_num is a plain field.
        let qpn = unsafe { (*qp).qp_num };
        // SAFETY: ibv_qp_attr is plain C data; zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port;
        a.qp_access_flags = 0;
        me.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
        )?;
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ibv_mtu::IBV_MTU_1024;
        a.dest_qp_num = qpn;
        a.rq_psn = 0;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid.raw = want;
        a.ah_attr.grh.sgid_index = sgid_index;
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.port_num = port;
        me.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
        )?;
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        // A few RNR retries only: the pool never sends more than it has
        // posted above its target, so an RNR means something else is wrong,
        // and a failed SEND ends the drain instead of retrying for ever.
        a.rnr_retry = 3;
        a.sq_psn = 0;
        a.max_rd_atomic = 1;
        me.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
        )?;
        Ok(me)
    }

    fn modify(&self, a: &mut ibv_qp_attr, mask: ibv_qp_attr_mask) -> Result<(), Error> {
        // SAFETY: live QP (self); `a` is set for `mask` by the caller.
        unsafe { modify_qp(self.qp, a, mask, "ibv_modify_qp") }
    }

    /// Moves the QP to the error state: nothing more is sent, and no more
    /// SRQ receive is consumed.
    pub(crate) fn to_error(&self) -> Result<(), Error> {
        // SAFETY: live QP (self).
        unsafe { qp_to_error(self.qp) }
    }

    /// The CQ of both queues: the SENDs' completions (wr_id `send_wr_id`)
    /// and the SRQ receives they consumed (those receives' wr_ids).
    pub(crate) fn cq(&self) -> &Arc<Cq> {
        &self.cq
    }

    /// Posts `n` signaled zero-length SENDs to itself (no memory is read).
    /// On an error, how many were posted before it.
    pub(crate) fn post_empty_sends(&self, n: usize, send_wr_id: u64) -> Result<(), (usize, Error)> {
        for i in 0..n {
            // SAFETY: ibv_send_wr is plain C data; all-zero is valid.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = send_wr_id;
            wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.num_sge = 0;
            let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
            // SAFETY: live QP; the WR has no scatter/gather entry, so it
            // reads no memory; it lives across the call.
            let r = unsafe { ibv_post_send(self.qp, &mut wr, &mut bad) };
            if r != 0 {
                return Err((
                    i,
                    Error::Verb {
                        verb: "ibv_post_send",
                        errno: Errno(r),
                    },
                ));
            }
        }
        Ok(())
    }
}

impl Drop for LoopQp {
    fn drop(&mut self) {
        // SAFETY: qp came from ibv_create_qp and is destroyed only here;
        // no work request of it reads memory (zero-length SENDs).
        let r = unsafe { ibv_destroy_qp(self.qp) };
        warn_destroy("ibv_destroy_qp", r);
    }
}

/// A type-2 memory window: the only way a peer reaches a rendezvous region
/// in a shared PD (§4.7). Deallocating it revokes every rkey it was bound
/// with.
pub(crate) struct Mw {
    ptr: *mut ibv_mw,
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

impl Drop for Mw {
    fn drop(&mut self) {
        // SAFETY: ptr came from ibv_alloc_mw and is deallocated only here.
        let r = unsafe { ibv_dealloc_mw(self.ptr) };
        warn_destroy("ibv_dealloc_mw", r);
    }
}

/// Builds a linked list of receive work requests on the stack, a batch of
/// up to [`POST_BATCH`] at a time, and hands each to `post` (an
/// `ibv_post_recv` or `ibv_post_srq_recv`). Each entry is `(wr_id, addr,
/// len, lkey)`.
///
/// # Safety
/// `post` must post the list it is given to a live queue; the buffer rules
/// of [`Qp::post_recvs`] apply to every range.
unsafe fn post_recv_list(
    list: &[(u64, u64, u32, u32)],
    verb: &'static str,
    mut post: impl FnMut(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> i32,
) -> Result<(), Error> {
    for batch in list.chunks(POST_BATCH) {
        // SAFETY: ibv_sge / ibv_recv_wr are plain C data; zero is valid.
        let mut sges: [ibv_sge; POST_BATCH] = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut wrs: [ibv_recv_wr; POST_BATCH] = unsafe { std::mem::zeroed() };
        let n = batch.len();
        for (i, &(wr_id, addr, length, lkey)) in batch.iter().enumerate() {
            sges[i] = ibv_sge { addr, length, lkey };
            wrs[i].wr_id = wr_id;
            wrs[i].num_sge = 1;
        }
        let base = wrs.as_mut_ptr();
        let sbase = sges.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < n <= POST_BATCH: both pointers stay inside
            // their arrays, which live on this frame across the call.
            unsafe {
                (*base.add(i)).sg_list = sbase.add(i);
                if i + 1 < n {
                    (*base.add(i)).next = base.add(i + 1);
                }
            }
        }
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // The linked list and its SGEs live across the call (the provider
        // copies them); buffer validity is the caller's contract.
        let r = post(base, &mut bad);
        if r != 0 {
            return Err(Error::Verb {
                verb,
                errno: Errno(r),
            });
        }
    }
    Ok(())
}

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

/// Work requests per `ibv_post_send` / `ibv_post_recv` call, built on the
/// stack (longer lists are posted in several calls, in order).
pub(crate) const POST_BATCH: usize = 16;

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

/// One SEND (`remote == None`) or RDMA WRITE to `(addr, rkey)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendDesc {
    pub wr_id: u64,
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
    pub signaled: bool,
    pub inline: bool,
    pub remote: Option<(u64, u32)>,
    /// With `remote`: RDMA WRITE with this immediate data (host byte order).
    pub imm: Option<u32>,
}

/// Sizes of a QP, and the shared receive queue it takes receives from.
pub(crate) struct QpCaps {
    pub send_wr: u32,
    /// Ignored with `srq`: the QP then has no receive queue of its own.
    pub recv_wr: u32,
    pub inline: u32,
    pub srq: Option<Arc<Srq>>,
}

/// RC queue pair created through rdma_cm on a cm_id (rdma_cm drives the
/// INIT/RTR/RTS transitions during connect/accept).
pub(crate) struct Qp {
    id: Arc<cm::CmId>,
    qp: *mut ibv_qp,
    _pd: Arc<Pd>,
    _send_cq: Arc<Cq>,
    _recv_cq: Arc<Cq>,
    _srq: Option<Arc<Srq>>,
    pub(crate) max_inline: u32,
}

// SAFETY: thread-safe verbs object, pointer only passed to libibverbs.
unsafe impl Send for Qp {}

impl Qp {
    pub(crate) fn new(
        id: Arc<cm::CmId>,
        pd: Arc<Pd>,
        send_cq: Arc<Cq>,
        recv_cq: Arc<Cq>,
        caps: QpCaps,
    ) -> Result<Qp, Error> {
        let QpCaps {
            send_wr,
            recv_wr,
            inline,
            srq,
        } = caps;
        let mut inline_try = inline;
        loop {
            // SAFETY: ibv_qp_init_attr is plain C data; zero is valid.
            let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            attr.send_cq = send_cq.ptr;
            attr.recv_cq = recv_cq.ptr;
            attr.qp_type = ibv_qp_type::IBV_QPT_RC;
            attr.sq_sig_all = 0;
            attr.cap.max_send_wr = send_wr;
            // With a shared receive queue the QP has no receive queue of
            // its own (§4.7).
            attr.cap.max_recv_wr = if srq.is_some() { 0 } else { recv_wr };
            attr.srq = srq.as_ref().map_or(std::ptr::null_mut(), |s| s.ptr);
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            attr.cap.max_inline_data = inline_try;
            // SAFETY: id is resolved (has a device), pd/cq/srq are live and
            // on the same device; attr is fully initialised.
            let r = unsafe { rdma_create_qp(id.ptr, pd.ptr, &mut attr) };
            if r == 0 {
                // SAFETY: on success rdma_create_qp stored the QP in id->qp.
                let qp = unsafe { (*id.ptr).qp };
                return Ok(Qp {
                    id,
                    qp,
                    _pd: pd,
                    _send_cq: send_cq,
                    _recv_cq: recv_cq,
                    _srq: srq,
                    max_inline: attr.cap.max_inline_data,
                });
            }
            if inline_try == 0 {
                return Err(verb_err("rdma_create_qp"));
            }
            // Device refused the inline size: retry with less (down to 0).
            inline_try = if inline_try > 32 { inline_try / 2 } else { 0 };
        }
    }

    /// Moves the QP to the error state: outstanding work requests are
    /// flushed with IBV_WC_WR_FLUSH_ERR.
    pub(crate) fn to_error(&self) -> Result<(), Error> {
        // SAFETY: live QP (self).
        unsafe { qp_to_error(self.qp) }
    }

    /// Posts receives, one `ibv_post_recv` call per batch of up to
    /// [`POST_BATCH`] (work requests built on the stack: nothing is
    /// allocated per post). Each entry is `(wr_id, addr, len, lkey)`.
    ///
    /// # Safety
    /// Every range must lie in memory registered with its `lkey` on this
    /// QP's PD that stays allocated and is neither read nor written by the
    /// CPU until the receive completes (or the QP is destroyed).
    pub(crate) unsafe fn post_recvs(&self, list: &[(u64, u64, u32, u32)]) -> Result<(), Error> {
        // SAFETY: the caller's contract; `wr` is the list built by
        // post_recv_list, live across the call, and the QP is live.
        unsafe {
            post_recv_list(list, "ibv_post_recv", |wr, bad| {
                ibv_post_recv(self.qp, wr, bad)
            })
        }
    }

    /// Binds the type-2 window `mw` to this QP over `[addr, addr+len)` of
    /// `mr` with remote write access, by a signaled bind work request
    /// (`wr_id`), and returns the window's new rkey. Work requests posted
    /// after it on this QP are executed after the bind (send queue order),
    /// so an rkey sent in a later SEND is valid when the peer gets it.
    ///
    /// # Safety
    /// `mr` is live, registered on this QP's PD with `IBV_ACCESS_MW_BIND`,
    /// and `[addr, addr+len)` lies inside it; the memory stays registered
    /// and allocated until `mw` is deallocated (which revokes the rkey),
    /// and is only read through raw copies meanwhile (the peer may write it).
    pub(crate) unsafe fn bind_window(
        &self,
        mw: &Mw,
        mr: *mut ibv_mr,
        addr: u64,
        len: u64,
        wr_id: u64,
    ) -> Result<u32, Error> {
        // SAFETY: mw is a live window (plain field read).
        let rkey = unsafe { ibv_inc_rkey((*mw.ptr).rkey) };
        // SAFETY: ibv_send_wr is plain C data (unions of PODs); zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw: mw.ptr,
            rkey,
            bind_info: ibv_mw_bind_info {
                mr,
                addr,
                length: len,
                mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
            },
        };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; the work request lives across the call (the
        // provider copies it); the memory rules are the caller's contract.
        let r = unsafe { ibv_post_send(self.qp, &mut wr, &mut bad) };
        if r != 0 {
            return Err(Error::Verb {
                verb: "ibv_post_send(BIND_MW)",
                errno: Errno(r),
            });
        }
        Ok(rkey)
    }

    /// Posts SENDs and RDMA WRITEs in order, one `ibv_post_send` call per
    /// batch of up to [`POST_BATCH`] (built on the stack, nothing allocated).
    ///
    /// # Safety
    /// Every `[addr, addr+len)` must lie in memory registered with its
    /// `lkey` that stays allocated and is not written by the CPU until a
    /// completion covering that work request is polled.
    pub(crate) unsafe fn post_sends(&self, list: &[SendDesc]) -> Result<(), Error> {
        for batch in list.chunks(POST_BATCH) {
            // SAFETY: ibv_sge / ibv_send_wr are plain C data (unions of
            // PODs); all-zero is a valid value.
            let mut sges: [ibv_sge; POST_BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let mut wrs: [ibv_send_wr; POST_BATCH] = unsafe { std::mem::zeroed() };
            let n = batch.len();
            for (i, d) in batch.iter().enumerate() {
                sges[i] = ibv_sge {
                    addr: d.addr,
                    length: d.len,
                    lkey: d.lkey,
                };
                let mut flags = 0;
                if d.signaled {
                    flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                if d.inline {
                    flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                }
                let wr = &mut wrs[i];
                wr.wr_id = d.wr_id;
                wr.num_sge = if d.len == 0 { 0 } else { 1 };
                wr.send_flags = flags;
                match d.remote {
                    None => wr.opcode = ibv_wr_opcode::IBV_WR_SEND,
                    Some((remote_addr, rkey)) => {
                        wr.opcode = match d.imm {
                            None => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                            Some(imm) => {
                                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                                ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                            }
                        };
                        wr.wr.rdma = rdma_t { remote_addr, rkey };
                    }
                }
            }
            let base = wrs.as_mut_ptr();
            let sbase = sges.as_mut_ptr();
            for i in 0..n {
                // SAFETY: i < n <= POST_BATCH: both pointers stay inside
                // their arrays, which live on this frame across the call.
                unsafe {
                    (*base.add(i)).sg_list = sbase.add(i);
                    if i + 1 < n {
                        (*base.add(i)).next = base.add(i + 1);
                    }
                }
            }
            let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
            // SAFETY: list and SGEs live across the call; buffer validity is
            // the caller's contract (see # Safety).
            let r = unsafe { ibv_post_send(self.qp, base, &mut bad) };
            if r != 0 {
                return Err(Error::Verb {
                    verb: "ibv_post_send",
                    errno: Errno(r),
                });
            }
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP was created by rdma_create_qp on this id and is
        // destroyed once; after this the NIC no longer accesses our buffers.
        unsafe { rdma_destroy_qp(self.id.ptr) };
    }
}

/// Objects owning a file descriptor that can be watched with tokio.
pub(crate) trait HasFd {
    fn raw_fd(&self) -> RawFd;
}

impl HasFd for cm::EventChannel {
    fn raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl HasFd for Cq {
    fn raw_fd(&self) -> RawFd {
        self.channel_fd()
    }
}

/// Keeps the fd's owner alive for as long as tokio watches the fd.
pub(crate) struct FdOwner<T: HasFd>(Arc<T>);

impl<T: HasFd> std::os::fd::AsRawFd for FdOwner<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.raw_fd()
    }
}

/// Registers the (non-blocking) fd of `owner` with the tokio reactor.
pub(crate) fn async_fd<T: HasFd>(
    owner: Arc<T>,
) -> Result<tokio::io::unix::AsyncFd<FdOwner<T>>, Error> {
    // The fd belongs to `owner` (event/completion channel), which the FdOwner
    // keeps alive (Arc) for the AsyncFd's whole lifetime.
    // SAFETY: so the fd stays open and always refers to the same file
    // description, and as_raw_fd always returns that same fd.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            FdOwner(owner),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| Error::Verb {
        verb: "AsyncFd::register",
        errno: Errno(std::io::Error::from(e).raw_os_error().unwrap_or(0)),
    })
}
