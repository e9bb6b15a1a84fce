//! The queue pair a shared receive pool drains its SRQ with ([`LoopQp`],
//! wire protocol §4.7, "Shrinking"): an RC QP connected to itself, without
//! rdma_cm, whose zero-length SENDs each consume one posted receive.

use std::sync::Arc;

use rdma_sys::*;

use super::cm;
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `dl`).
use super::dl::{ibv_create_qp, ibv_destroy_qp, ibv_query_gid};
use super::qp::{modify_qp, qp_to_error};
use super::{verb_err, warn_destroy, CompChannel, Cq, Pd, Srq};
use crate::error::{Errno, Error, NoDeviceReason};

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
            return Err(Error::NoDevice(NoDeviceReason::Unbound));
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
        let sgid_index = sgid_index.ok_or(Error::NoDevice(NoDeviceReason::NoGid { ip, port }))?;
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
