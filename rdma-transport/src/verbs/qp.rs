//! The RC queue pair of a connection ([`Qp`]), created through rdma_cm on
//! its cm_id: posting receives, SENDs, RDMA WRITEs and memory-window binds
//! with work requests built on the stack, and the state changes every QP
//! here goes through.

use std::mem::MaybeUninit;
use std::sync::Arc;

use rdma_sys::*;

use super::cm;
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `dl`).
use super::dl::{ibv_modify_qp, rdma_create_qp, rdma_destroy_qp};
use super::{verb_err, Cq, Mw, Pd, Srq};
use crate::error::{Errno, Error};

/// Work requests per `ibv_post_send` / `ibv_post_recv` call, built on the
/// stack (longer lists are posted in several calls, in order).
pub(crate) const POST_BATCH: usize = 16;

/// One SEND (`remote == None`) or RDMA WRITE to `(addr, rkey)`, of
/// `[addr, addr+len)` followed by `then` (a second gather entry, or none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendDesc {
    pub wr_id: u64,
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
    /// `(addr, len, lkey)` of a second gather entry (a zero-copy chunk's
    /// bytes after its head, §5.1).
    pub then: Option<(u64, u32, u32)>,
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
            // Two: a zero-copy chunk gathers its head from a staging
            // buffer and the rest from the message (§5.1).
            attr.cap.max_send_sge = 2;
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
        let rkey = mw.next_rkey();
        let access = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        // SAFETY: the caller's contract is this function's.
        unsafe { self.bind_window_as(mw, rkey, mr, (addr, len), access, wr_id, true)? };
        Ok(rkey)
    }

    /// Binds the type-2 window `mw` to this QP over `range` (address,
    /// length) of `mr` with `access` (remote access flags) and the rkey
    /// `rkey` ([`Mw::next_rkey`]), by a bind work request `wr_id`. Work
    /// requests posted after it on this QP are executed after the bind.
    ///
    /// # Safety
    /// `mr` is live, registered on this QP's PD with `IBV_ACCESS_MW_BIND`
    /// (and local write if `access` has remote write), and `range` lies
    /// inside it; the memory stays registered and allocated until `mw` is
    /// deallocated (which revokes the rkey); with remote write in
    /// `access`, the CPU reads it only through raw copies meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn bind_window_as(
        &self,
        mw: &Mw,
        rkey: u32,
        mr: *mut ibv_mr,
        range: (u64, u64),
        access: u32,
        wr_id: u64,
        signaled: bool,
    ) -> Result<(), Error> {
        // SAFETY: ibv_send_wr is plain C data (unions of PODs); zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
        if signaled {
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        wr.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw: mw.ptr,
            rkey,
            bind_info: ibv_mw_bind_info {
                mr,
                addr: range.0,
                length: range.1,
                mw_access_flags: access,
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
        Ok(())
    }

    /// Posts SENDs and RDMA WRITEs in order, one `ibv_post_send` call per
    /// batch of up to [`POST_BATCH`] (built on the stack, nothing allocated).
    ///
    /// # Safety
    /// Every `[addr, addr+len)` (and every `then` range) must lie in memory
    /// registered with its `lkey` that stays allocated and is not written
    /// by the CPU until a completion covering that work request is polled.
    pub(crate) unsafe fn post_sends(&self, list: &[SendDesc]) -> Result<(), Error> {
        for batch in list.chunks(POST_BATCH) {
            // Only the entries this batch uses are written (an ibv_send_wr is
            // 128 bytes: zeroing the whole array cost more than posting one).
            // Work request i gathers from sges[2i] and, with `then`, sges[2i+1].
            let mut sges = [const { MaybeUninit::<ibv_sge>::uninit() }; 2 * POST_BATCH];
            let mut wrs = [const { MaybeUninit::<ibv_send_wr>::uninit() }; POST_BATCH];
            let n = batch.len();
            for (i, d) in batch.iter().enumerate() {
                sges[2 * i].write(ibv_sge {
                    addr: d.addr,
                    length: d.len,
                    lkey: d.lkey,
                });
                let mut num_sge = i32::from(d.len != 0);
                if let Some((addr, length, lkey)) = d.then {
                    sges[2 * i + 1].write(ibv_sge { addr, length, lkey });
                    num_sge += 1;
                }
                let mut flags = 0;
                if d.signaled {
                    flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                if d.inline {
                    flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                }
                // SAFETY: ibv_send_wr is plain C data (unions of PODs);
                // all-zero is a valid value.
                let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
                wr.wr_id = d.wr_id;
                // A first entry of length 0 (a zero-length WRITE, or a
                // zero-copy chunk without head bytes) is skipped below.
                wr.num_sge = num_sge;
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
                wrs[i].write(wr);
            }
            let base = wrs.as_mut_ptr().cast::<ibv_send_wr>();
            let sbase = sges.as_mut_ptr().cast::<ibv_sge>();
            for (i, d) in batch.iter().enumerate() {
                // The gather list starts at the first entry written with a
                // length (an empty first entry is left out).
                let first = if d.len == 0 && d.then.is_some() {
                    2 * i + 1
                } else {
                    2 * i
                };
                // Bounds: i < n <= POST_BATCH, first < 2 * POST_BATCH; wrs[i]
                // and sges[first] (sges[first + 1] too when num_sge is 2) were
                // written above (MaybeUninit<T> has T's layout).
                // SAFETY: by the bounds above both pointers stay inside their
                // arrays, which live on this frame across the call.
                unsafe {
                    (*base.add(i)).sg_list = sbase.add(first);
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

/// A one-sided operation on a side queue pair (wire protocol §10): an RDMA
/// READ of the peer's `[remote_addr, +len)` into our `[addr, +len)`, or an
/// RDMA WRITE of ours to it. Always signaled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OneSidedDesc {
    pub wr_id: u64,
    pub read: bool,
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

impl Qp {
    /// Posts one signaled RDMA READ or WRITE (`d`).
    ///
    /// # Safety
    /// `[d.addr, d.addr+d.len)` lies in memory registered with `d.lkey` on
    /// this QP's PD (with local write access for a READ), which stays
    /// registered and allocated, and which the CPU neither writes (a WRITE's
    /// source) nor reads or writes (a READ's destination), until the
    /// completion of `d.wr_id` is polled or the QP is destroyed.
    pub(crate) unsafe fn post_one_sided(&self, d: &OneSidedDesc) -> Result<(), Error> {
        let mut sge = ibv_sge {
            addr: d.addr,
            length: d.len,
            lkey: d.lkey,
        };
        // SAFETY: ibv_send_wr is plain C data (unions of PODs); zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = d.wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.opcode = if d.read {
            ibv_wr_opcode::IBV_WR_RDMA_READ
        } else {
            ibv_wr_opcode::IBV_WR_RDMA_WRITE
        };
        wr.wr.rdma = rdma_t {
            remote_addr: d.remote_addr,
            rkey: d.rkey,
        };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; the work request and its SGE live on this frame
        // across the call (the provider copies them); the memory rules are
        // the caller's contract (see # Safety).
        let r = unsafe { ibv_post_send(self.qp, &mut wr, &mut bad) };
        if r != 0 {
            return Err(Error::Verb {
                verb: "ibv_post_send(RDMA READ/WRITE)",
                errno: Errno(r),
            });
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

/// `ibv_modify_qp`; a failure is an error naming `verb`.
///
/// # Safety
/// `qp` is a live QP, and `a` holds valid values for every field `mask`
/// selects.
pub(super) unsafe fn modify_qp(
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
pub(super) unsafe fn qp_to_error(qp: *mut ibv_qp) -> Result<(), Error> {
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

/// Builds a linked list of receive work requests on the stack, a batch of
/// up to [`POST_BATCH`] at a time, and hands each to `post` (an
/// `ibv_post_recv` or `ibv_post_srq_recv`). Each entry is `(wr_id, addr,
/// len, lkey)`.
///
/// # Safety
/// `post` must post the list it is given to a live queue; the buffer rules
/// of [`Qp::post_recvs`] apply to every range.
pub(super) unsafe fn post_recv_list(
    list: &[(u64, u64, u32, u32)],
    verb: &'static str,
    mut post: impl FnMut(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> i32,
) -> Result<(), Error> {
    for batch in list.chunks(POST_BATCH) {
        // Only the entries this batch uses are written.
        let mut sges = [const { MaybeUninit::<ibv_sge>::uninit() }; POST_BATCH];
        let mut wrs = [const { MaybeUninit::<ibv_recv_wr>::uninit() }; POST_BATCH];
        let n = batch.len();
        for (i, &(wr_id, addr, length, lkey)) in batch.iter().enumerate() {
            sges[i].write(ibv_sge { addr, length, lkey });
            // SAFETY: ibv_recv_wr is plain C data; zero is valid.
            let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = wr_id;
            wr.num_sge = 1;
            wrs[i].write(wr);
        }
        let base = wrs.as_mut_ptr().cast::<ibv_recv_wr>();
        let sbase = sges.as_mut_ptr().cast::<ibv_sge>();
        for i in 0..n {
            // SAFETY: i < n <= POST_BATCH: both pointers stay inside
            // their arrays, which live on this frame across the call, and
            // entries 0..n were written above.
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
