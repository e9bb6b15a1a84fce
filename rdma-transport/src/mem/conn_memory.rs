//! The QP and all registered memory of one connection ([`ConnMemory`]):
//! its receive ring (or its part of a shared receive pool), its send ring,
//! its rendezvous region (behind a memory window in a device pool's PD)
//! and its staging buffers; it posts the engine's actions and implements
//! the engine's [`Buffers`], and destroys the QP before any buffer is
//! deregistered or freed.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::device_pool::{BlockSource, DevicePool};
use super::exposed::{MrUse, SubMr, UserMr};
use super::local_cache::{read_buffer, read_bytes, LocalCache};
use super::recv_pool::RecvPool;
use super::registered::{Access, RegisteredBuf};
use super::slot_pool::SlotPool;
use super::{WR_BIND, WR_SRQ};
use crate::engine::{Action, Buffers, ExposedBody, WriteSource};
use crate::error::{Error, PeerMisbehaved, ResourceError};
use crate::remote::{Exposable, RemoteAccess};
use crate::verbs::{Cq, Mw, OneSidedDesc, Pd, Qp, SendDesc};

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

/// A message body registered for our WRITEs to read (§5.1) or the peer's
/// READs (§5.6).
struct Source {
    /// In a shared PD, the window the peer reads an exposed body through
    /// (bound to this connection's QP); declared first: deallocated (its
    /// rkey revoked) before the MR is deregistered.
    window: Option<Mw>,
    /// The rkey the window is bound with (0 without one).
    rkey: u32,
    mr: UserMr,
}

/// A receive buffer of the shared pool holding a connection's message.
struct Held {
    buf: u32,
    chunk: Arc<RegisteredBuf>,
    off: usize,
}

/// A connection's view of a shared receive pool (§4.7): the engine still
/// sees a ring of `reserved` slots; a slot is "posted" by queueing it, and a
/// receive completion from the SRQ binds the oldest queued slot to the
/// buffer the NIC filled, so the engine gets its own wr_id back, in the
/// order it posted, as with a receive queue of its own.
struct SharedRecv {
    pool: Arc<RecvPool>,
    /// Recv CQ of the connection, drained after the QP is destroyed for the
    /// buffer it may have taken (it comes back flushed, §4.7).
    cq: Arc<Cq>,
    reserved: usize,
    posted: VecDeque<(u32, u64)>,
    bound: Vec<Option<Held>>,
    /// Scratch list of buffers to give back.
    back: Vec<u32>,
}

/// QP + all registered memory of one connection (§8 of the wire doc;
/// ownership rules in `docs/buffer-ownership.md`). The rings are registered
/// a segment at a time, the rendezvous region and the staging buffers only
/// while in use (memory on demand, §4.6 and §5.5).
pub(crate) struct ConnMemory {
    // Declared first: dropped first, before any buffer.
    qp: Option<Qp>,
    recv: SlotPool,
    /// With a shared receive queue: the connection's part of it (then
    /// `recv` stays empty).
    shared: Option<SharedRecv>,
    send: SlotPool,
    /// The window the peer reaches `rdv` through, in a shared PD (§4.7);
    /// declared before `rdv`: deallocated (rkey revoked) first.
    window: Option<Mw>,
    rdv: Option<RegisteredBuf>,
    staging: Option<RegisteredBuf>,
    /// Zero-copy sources (§5.1): messages being RDMA-WRITTEN from where
    /// they are, each registered (no access flag: only our own WRITEs read
    /// it) and held until the engine releases it, after the completion
    /// covering its last WRITE, or until the QP is gone; and bodies the
    /// peer reads (§5.6), registered for its READs alone (remote read in
    /// a PD of this connection's own, else a window bound to its QP) and
    /// held until its RDV_DONE or until the QP is gone. Indexed by the id
    /// the engine names them by; `None` entries are free ids.
    sources: Vec<Option<Source>>,
    /// Buffers our READs fill (§5.6), by id: local write only (the peer
    /// has no key to them), each in a READ until its completion is polled
    /// or the QP is gone; or (§5.7) which the peer WRITES through a window
    /// bound over the body's bytes, until taken (the window deallocated
    /// first) or the QP is gone.
    dests: Vec<Option<Dest>>,
    /// Where those buffers come from (made on first use, at most
    /// `read_cache_bytes`); a buffer handed up goes back when the
    /// application drops it.
    dest_cache: Option<Arc<LocalCache>>,
    read_cache_bytes: usize,
    sz: PoolSizes,
    src: BlockSource,
    /// Scratch lists of [`execute`](Self::execute), kept so that posting
    /// allocates nothing in steady state.
    recvs: Vec<(u64, u64, u32, u32)>,
    sends: Vec<SendDesc>,
}

/// A buffer a message of the peer's lands in (§5.6, §5.7).
struct Dest {
    /// §5.7: the window the peer WRITES the body through, bound with
    /// `rkey` over all of `grant`. Declared first: it is deallocated (the
    /// peer's access revoked) before the registration under it and the
    /// buffer go.
    window: Option<Mw>,
    rkey: u32,
    /// §5.7: a registration of exactly the granted bytes of `mr`'s
    /// buffer (local write and MW_BIND), for the window to be bound over:
    /// a window over all of an MR makes the MR's bounds the window's on
    /// every device (rxe checks a window's accesses against its MR's
    /// range, not the window's: a window over part of a larger MR let a
    /// peer write past it). Declared before `mr`: deregistered first.
    grant: Option<SubMr>,
    mr: UserMr,
    /// The message's length (head + body).
    total: usize,
}

impl ConnMemory {
    /// Registers receive slots `0..recv`, send slots `0..send`, and, with
    /// `static_rdv`, the rendezvous region (advertised in the hello). With
    /// `dev`, `pd` is its PD and the blocks come from it (no static region
    /// there: it would need remote access through its own rkey).
    pub(crate) fn new(
        pd: &Arc<Pd>,
        dev: Option<Arc<DevicePool>>,
        sz: PoolSizes,
        global_limit: usize,
        recv: usize,
        send: usize,
        static_rdv: bool,
    ) -> Result<Self, Error> {
        let mut m = ConnMemory {
            qp: None,
            recv: SlotPool::new(sz.recv_slots, sz.recv_slot_bytes, sz.recv_seg),
            shared: None,
            send: SlotPool::new(sz.send_slots, sz.send_slot_bytes, sz.send_seg),
            window: None,
            rdv: None,
            staging: None,
            sources: Vec::new(),
            dests: Vec::new(),
            dest_cache: None,
            read_cache_bytes: 16 << 20,
            sz,
            src: BlockSource {
                pd: pd.clone(),
                dev,
                limit: global_limit,
            },
            recvs: Vec::new(),
            sends: Vec::new(),
        };
        debug_assert!(m.src.dev.as_ref().is_none_or(|d| Arc::ptr_eq(d.pd(), pd)));
        assert!(
            !(static_rdv && m.src.dev.is_some()),
            "no static region in a shared PD"
        );
        m.recv.ensure(&m.src, recv)?;
        m.send.ensure(&m.src, send)?;
        if static_rdv {
            m.rdv = Some(m.register_rdv()?);
        }
        Ok(m)
    }

    /// Like [`new`](Self::new), with the receive buffers drawn from a
    /// listener's shared pool (§4.7): `recv` credits are reserved in it. The
    /// PD is the pool's; the rendezvous region is on demand only (it needs
    /// the QP, to bind its window).
    pub(crate) fn new_shared(
        dev: Arc<DevicePool>,
        pool: Arc<RecvPool>,
        cq: Arc<Cq>,
        sz: PoolSizes,
        global_limit: usize,
        recv: usize,
        send: usize,
    ) -> Result<Self, Error> {
        let pd = pool.pd().clone();
        debug_assert!(
            Arc::ptr_eq(dev.pd(), &pd),
            "the SRQ is in the device pool's PD"
        );
        let mut m = ConnMemory::new(
            &pd,
            Some(dev),
            PoolSizes {
                recv_slots: 0,
                ..sz
            },
            global_limit,
            0,
            send,
            false,
        )?;
        m.sz = sz;
        pool.reserve(recv)?;
        m.shared = Some(SharedRecv {
            pool,
            cq,
            reserved: recv,
            posted: VecDeque::with_capacity(sz.recv_slots),
            bound: (0..sz.recv_slots).map(|_| None).collect(),
            back: Vec::with_capacity(sz.recv_slots),
        });
        Ok(m)
    }

    pub(crate) fn pd(&self) -> &Arc<Pd> {
        &self.src.pd
    }

    /// Whether the receive buffers come from a shared receive queue.
    pub(crate) fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Maps a receive completion from the shared receive queue to the
    /// engine's own wr_id (§4.7): the oldest slot the engine posted takes
    /// the buffer. Other wr_ids are returned unchanged. A message with no
    /// slot posted for it came without credit: the buffer goes back to the
    /// pool and the connection fails. A failed completion gives its buffer
    /// back and maps to a failed receive of the engine.
    pub(crate) fn map_recv(&mut self, wr_id: u64, ok: bool) -> Result<u64, Error> {
        let Some(sh) = self.shared.as_mut() else {
            return Ok(wr_id);
        };
        if wr_id >> 56 != WR_SRQ {
            return Ok(wr_id);
        }
        let b = wr_id as u32;
        if !ok {
            // A flushed (or failed) receive: the connection is failing. The
            // buffer goes back at once; the engine reports the failure.
            sh.pool.give_back(&[b])?;
            return Ok(crate::engine::WR_RECV << 56);
        }
        let Some((chunk, off)) = sh.pool.held(b) else {
            return Err(Error::Protocol(PeerMisbehaved::StaleReceive { wr_id }));
        };
        match sh.posted.pop_front() {
            Some((slot, engine_wr_id)) => {
                sh.bound[slot as usize] = Some(Held { buf: b, chunk, off });
                Ok(engine_wr_id)
            }
            None => {
                sh.pool.give_back(&[b])?;
                Err(Error::Protocol(PeerMisbehaved::SendWithoutCredit {
                    excess: 1,
                    granted: sh.reserved as u32,
                }))
            }
        }
    }

    /// Gives back to the shared pool the SRQ buffers named by completions
    /// polled outside the engine (the teardown's drain, §4.7).
    pub(crate) fn reclaim(&mut self, wcs: &[crate::verbs::Wc]) {
        self.reclaim_with(wcs, &[]);
    }

    /// [`reclaim`](Self::reclaim), with more buffers (`also`) given back in
    /// the same call.
    fn reclaim_with(&mut self, wcs: &[crate::verbs::Wc], also: &[u32]) {
        let Some(sh) = self.shared.as_mut() else {
            return;
        };
        sh.back.clear();
        sh.back.extend(
            wcs.iter()
                .filter(|wc| wc.wr_id >> 56 == WR_SRQ)
                .map(|wc| wc.wr_id as u32),
        );
        sh.back.extend_from_slice(also);
        if let Err(e) = sh.pool.give_back(&sh.back) {
            tracing::warn!("shared receive pool: reposting on close failed: {e}");
        }
    }

    fn register_rdv(&self) -> Result<RegisteredBuf, Error> {
        self.src.take(
            self.sz.rdv_count * self.sz.rdv_bytes,
            if self.src.dev.is_some() {
                Access::Window
            } else {
                Access::RemoteWrite
            },
        )
    }

    pub(crate) fn attach_qp(&mut self, qp: Qp) {
        self.qp = Some(qp);
    }

    pub(crate) fn qp(&self) -> Option<&Qp> {
        self.qp.as_ref()
    }

    /// Whether a destination can be granted to this connection's peer
    /// alone (§5.7): its buffers are in a device's shared PD, where a
    /// type-2 window bound to the QP scopes the peer's access.
    pub(crate) fn grants_windows(&self) -> bool {
        self.src.dev.is_some()
    }

    /// Address of the region advertised in the hello (0 if on demand).
    pub(crate) fn rdv_addr(&self) -> u64 {
        self.rdv.as_ref().map_or(0, |r| r.addr())
    }

    /// rkey of the region advertised in the hello (0 if on demand).
    pub(crate) fn rdv_rkey(&self) -> u32 {
        self.rdv.as_ref().map_or(0, |r| r.rkey())
    }

    /// Destroys the QP; afterwards the NIC cannot access any buffer. A
    /// memory window goes first (§4.7): it revokes the peer's access, and a
    /// window still bound holds its QP (rxe waited ~50 s in
    /// `ibv_destroy_qp` for it).
    pub(crate) fn destroy_qp(&mut self) {
        self.window = None;
        self.drop_source_windows();
        self.qp = None;
    }

    /// Deallocates the windows of granted destinations (§5.7): the peer
    /// can no longer write them, and no window holds the QP.
    fn drop_dest_windows(&mut self) {
        for d in self.dests.iter_mut().flatten() {
            d.window = None;
        }
    }

    /// Deallocates the windows of exposed bodies (§5.6): the peer can no
    /// longer read them, and no window holds the QP.
    fn drop_source_windows(&mut self) {
        for s in self.sources.iter_mut().flatten() {
            s.window = None;
        }
        self.drop_dest_windows();
    }

    /// Bytes the buffers of messages read from the peer (§5.6) may keep
    /// registered (`Config::read_cache_bytes`).
    pub(crate) fn set_read_cache_bytes(&mut self, n: usize) {
        self.read_cache_bytes = n;
    }

    /// Posts what `sends` gathered so far, so that a work request of
    /// another shape comes after it in send-queue order.
    fn flush_sends(qp: &Qp, sends: &mut Vec<SendDesc>) -> Result<(), Error> {
        // SAFETY: as in `execute`: every range was bounds-checked against
        // its registered pool or source, each reused only after a covering
        // completion (§7).
        let r = unsafe { qp.post_sends(sends) };
        sends.clear();
        r
    }

    /// `(addr, len, lkey)` of the bytes a zero-copy chunk of `len` bytes
    /// takes from its source after its head (§5.1), bounds-checked against
    /// the registration.
    fn source_range(&self, src: WriteSource, len: usize) -> (u64, u32, u32) {
        let mr = &self
            .sources
            .get(src.id as usize)
            .and_then(Option::as_ref)
            .expect("a WRITE from a source the engine registered and has not released")
            .mr;
        let n = len.checked_sub(src.head).expect("head within the chunk");
        assert!(
            src.off.checked_add(n).is_some_and(|end| end <= mr.len()),
            "zero-copy chunk outside its source"
        );
        (mr.addr() + src.off as u64, n as u32, mr.lkey())
    }

    /// Posts engine actions (bounds-checked against the pools): all
    /// receives first (one call), then all sends/writes in order (one call,
    /// split only where a bind or a READ must come in between). Receives
    /// first keeps the rule that a slot is posted before the credit for it
    /// is returned (§4.2), also when a send goes out before a bind.
    pub(crate) fn execute(&mut self, actions: &[Action]) -> Result<(), Error> {
        // Most driver steps post nothing: no scratch lists, no verbs call.
        if actions.is_empty() {
            return match self.qp {
                Some(_) => Ok(()),
                None => Err(Error::Disconnected),
            };
        }
        let mut recvs = std::mem::take(&mut self.recvs);
        let mut sends = std::mem::take(&mut self.sends);
        recvs.clear();
        sends.clear();
        let r = self.execute_with(actions, &mut recvs, &mut sends);
        self.recvs = recvs;
        self.sends = sends;
        r
    }

    /// [`execute`](Self::execute) with its scratch lists.
    fn execute_with(
        &mut self,
        actions: &[Action],
        recvs: &mut Vec<(u64, u64, u32, u32)>,
        sends: &mut Vec<SendDesc>,
    ) -> Result<(), Error> {
        if self.qp.is_none() {
            return Err(Error::Disconnected);
        }
        if let Some(sh) = self.shared.as_mut() {
            sh.back.clear();
        }
        for a in actions {
            match *a {
                Action::PostRecv { slot, wr_id } if self.shared.is_some() => {
                    let sh = self.shared.as_mut().expect("checked");
                    assert!((slot as usize) < sh.bound.len(), "slot {slot} out of range");
                    if let Some(h) = sh.bound[slot as usize].take() {
                        sh.back.push(h.buf);
                    }
                    sh.posted.push_back((slot, wr_id));
                }
                Action::PostRecv { slot, wr_id } => {
                    let (seg, off) = self.recv.at(slot as usize);
                    recvs.push((
                        wr_id,
                        seg.addr() + off as u64,
                        self.sz.recv_slot_bytes as u32,
                        seg.lkey(),
                    ));
                }
                _ => {}
            }
        }
        let qp = self.qp.as_ref().ok_or(Error::Disconnected)?;
        // §4.7: the buffers of reposted slots go back to the shared pool
        // (reposted there), and the receives are posted, before anything
        // below is: a send posted early (before a bind or a READ) may carry
        // the credit for a slot reposted here.
        if let Some(sh) = &self.shared {
            sh.pool.give_back(&sh.back)?;
        }
        // SAFETY: every range was bounds-checked against its registered
        // pool above; the pools outlive the QP (field order + destroy_qp);
        // the engine does not touch a receive slot until its completion.
        unsafe { qp.post_recvs(recvs)? };
        for a in actions {
            match *a {
                Action::PostRecv { .. } => {}
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
                        then: None,
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
                    source,
                } => {
                    let st = staging as usize;
                    // With a source, only its head comes from the staging buffer
                    // (a body WRITTEN into a granted destination, §5.7: none of it).
                    let (staged, then) = match source {
                        None => (len, None),
                        Some(src) => (src.head, Some(self.source_range(src, len))),
                    };
                    assert!(st < self.sz.rdv_count && staged <= self.sz.rdv_bytes);
                    // A zero-length WRITE (keepalive, §4.4) reads nothing:
                    // no staging buffer needs to be registered for it.
                    let (addr, lkey) = match &self.staging {
                        Some(b) => (b.addr() + (st * self.sz.rdv_bytes) as u64, b.lkey()),
                        None if staged == 0 => (0, 0),
                        None => panic!("WRITE from staging buffers that are not registered"),
                    };
                    sends.push(SendDesc {
                        wr_id,
                        addr,
                        len: staged as u32,
                        lkey,
                        then,
                        signaled,
                        inline: false,
                        remote: Some((remote_addr, rkey)),
                        imm,
                    });
                }
                Action::BindSource {
                    id,
                    wr_id,
                    signaled,
                } => {
                    let s = self
                        .sources
                        .get(id as usize)
                        .and_then(Option::as_ref)
                        .expect("a bind of a source the engine exposed");
                    let mw = s.window.as_ref().expect("an exposed source with a window");
                    Self::flush_sends(qp, sends)?;
                    let range = (s.mr.addr(), s.mr.len() as u64);
                    let read = rdma_sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
                    // SAFETY: the MR is live on this QP's PD with MW_BIND, the window covers it
                    // exactly, read only; the `Bytes` (unwritten) and MR live until the window is
                    // deallocated (`Source` field order; destroy_qp drops windows first).
                    unsafe {
                        qp.bind_window_as(mw, s.rkey, s.mr.mr(), range, read, wr_id, signaled)?
                    };
                }
                Action::BindDest {
                    dest,
                    wr_id,
                    signaled,
                } => {
                    let d = self
                        .dests
                        .get(dest as usize)
                        .and_then(Option::as_ref)
                        .expect("a bind of a destination the engine exposed");
                    let mw = d.window.as_ref().expect("an exposed destination");
                    let sub = d.grant.as_ref().expect("an exposed destination");
                    Self::flush_sends(qp, sends)?;
                    let write = rdma_sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
                    // The SubMr is live on this QP's PD with MW_BIND and local write, the window
                    // covers exactly it; both stay until the window is deallocated (`Dest` field
                    // order; take_dest, destroy_qp and Drop drop the window first).
                    // SAFETY: as above; nothing reads the buffer meanwhile (only take_dest).
                    unsafe {
                        qp.bind_window_as(
                            mw,
                            d.rkey,
                            sub.mr(),
                            sub.range(),
                            write,
                            wr_id,
                            signaled,
                        )?
                    };
                }
                Action::PostReadStaging {
                    staging,
                    len,
                    remote_addr,
                    rkey,
                    wr_id,
                } => {
                    let st = staging as usize;
                    assert!(st < self.sz.rdv_count && len <= self.sz.rdv_bytes);
                    let b = self
                        .staging
                        .as_ref()
                        .expect("a READ into staging buffers that are registered");
                    let d = OneSidedDesc {
                        wr_id,
                        read: true,
                        addr: b.addr() + (st * self.sz.rdv_bytes) as u64,
                        len: len as u32,
                        lkey: b.lkey(),
                        remote_addr,
                        rkey,
                    };
                    // SAFETY: staging buffer `st` (checked), local write; the engine reads it only
                    // after this READ's own completion, posts nothing else into it meanwhile, and
                    // Drop frees it after the QP.
                    unsafe { Self::post_read_after(qp, sends, &d)? };
                }
                Action::PostRead {
                    dest,
                    off,
                    len,
                    remote_addr,
                    rkey,
                    wr_id,
                } => {
                    let Dest { mr, total, .. } = self
                        .dests
                        .get(dest as usize)
                        .and_then(Option::as_ref)
                        .expect("a READ into a destination the engine opened");
                    assert!(
                        off.checked_add(len).is_some_and(|end| end <= *total) && *total <= mr.len(),
                        "READ outside its destination"
                    );
                    let d = OneSidedDesc {
                        wr_id,
                        read: true,
                        addr: mr.addr() + off as u64,
                        // The engine reads at most max_message (< 4 GiB).
                        len: u32::try_from(len).expect("a READ under 4 GiB"),
                        lkey: mr.lkey(),
                        remote_addr,
                        rkey,
                    };
                    // SAFETY: inside the destination's registration (checked), local write; the
                    // engine takes it (take_dest) only after this READ's own completion, and Drop
                    // frees it only after the QP.
                    unsafe { Self::post_read_after(qp, sends, &d)? };
                }
            }
        }
        // A zero-copy source is a `Bytes`, which nothing writes; the engine
        // releases it (the only thing that drops its registration and bytes
        // before the QP is gone) after a covering completion.
        // SAFETY: ranges inside the registered send/staging pools and sources
        // (checked); each reused only after a covering completion (§7).
        unsafe { qp.post_sends(sends) }
    }

    /// Posts the sends gathered so far, then the READ `d`, in send-queue
    /// order.
    ///
    /// # Safety
    /// As [`Qp::post_one_sided`] for `d`.
    unsafe fn post_read_after(
        qp: &Qp,
        sends: &mut Vec<SendDesc>,
        d: &OneSidedDesc,
    ) -> Result<(), Error> {
        Self::flush_sends(qp, sends)?;
        // SAFETY: the caller's contract.
        unsafe { qp.post_one_sided(d) }
    }
}

impl Drop for ConnMemory {
    fn drop(&mut self) {
        if let (Some(qp), Some(_)) = (&self.qp, &self.shared) {
            // Flushes the SRQ buffer the QP may have taken (§4.7).
            let _ = qp.to_error();
        }
        // Explicit: the windows (see destroy_qp), the QP, then the buffers.
        self.window = None;
        self.drop_source_windows();
        self.qp = None;
        // No WRITE reads a zero-copy source now, no peer an exposed one:
        // deregistered and let go.
        self.sources.clear();
        // No READ fills a destination now.
        self.dests.clear();
        if let Some(c) = self.dest_cache.take() {
            c.close();
        }
        // No work request can reach a block now, nor a peer (the window is
        // gone): the device pool takes them back.
        self.recv.trim(&self.src, 0);
        self.send.trim(&self.src, 0);
        for b in [self.rdv.take(), self.staging.take()].into_iter().flatten() {
            self.src.put(b);
        }
        if let Some(sh) = self.shared.as_mut() {
            // The buffer a QP took from the SRQ comes back as a flushed
            // completion on its CQ (rxe, measured: the last-WQE event is
            // never raised); every other SRQ buffer stays posted for the
            // other connections.
            sh.pool.unreserve(sh.reserved);
            let cq = sh.cq.clone();
            let mut wcs = Vec::new();
            while let Ok(n) = cq.poll(&mut wcs, 32) {
                if n == 0 {
                    break;
                }
            }
            // Held buffers go back with the flushed ones.
            let held: Vec<u32> = sh
                .bound
                .iter_mut()
                .filter_map(|h| h.take())
                .map(|h| h.buf)
                .collect();
            self.reclaim_with(&wcs, &held);
        }
    }
}

impl ConnMemory {
    fn put_source(&mut self, free: Option<usize>, s: Source) {
        match free {
            Some(i) => self.sources[i] = Some(s),
            None => self.sources.push(Some(s)),
        }
    }
}

impl Buffers for ConnMemory {
    fn recv_slot(&self, i: u32) -> &[u8] {
        let s = self.sz.recv_slot_bytes;
        if let Some(sh) = &self.shared {
            let h = sh.bound[i as usize]
                .as_ref()
                .expect("the engine reads a slot after its receive completed");
            return h.chunk.slice_local(h.off, s);
        }
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
    fn open_rdv(&mut self) -> Result<(u64, u32), ResourceError> {
        debug_assert!(self.rdv.is_none());
        let r = self.register_rdv().map_err(ResourceError::from_error)?;
        if self.src.dev.is_none() {
            let granted = (r.addr(), r.rkey());
            self.rdv = Some(r);
            return Ok(granted);
        }
        // §4.7: in the shared PD the region's own MR grants no remote
        // access; a type-2 window bound to this connection's QP does, so
        // its rkey is refused on every other QP.
        let qp = self.qp.as_ref().ok_or(ResourceError::Closed)?;
        let mw = match Mw::new(&self.src.pd) {
            Ok(mw) => mw,
            Err(e) => {
                self.src.put(r);
                return Err(ResourceError::from_error(e));
            }
        };
        // `window` is declared before `rdv`: the window is deallocated (rkey
        // revoked) before the region is deregistered, in close_rdv and Drop.
        // SAFETY: r's MR is live, on this QP's PD, with MW_BIND, covered
        // exactly by the window (above); read only by raw copies (append_rdv).
        let rkey = unsafe { qp.bind_window(&mw, r.mr(), r.addr(), r.len() as u64, WR_BIND << 56) }
            .map_err(ResourceError::from_error)?;
        let granted = (r.addr(), rkey);
        self.window = Some(mw);
        self.rdv = Some(r);
        Ok(granted)
    }
    fn close_rdv(&mut self) {
        // The engine calls this after the peer's RDV_RELEASE: no WRITE of
        // its can still land (buffer-ownership.md). Deregistered and freed
        // by RegisteredBuf's Drop, or, behind a window, zeroed and kept by
        // the device pool; a late WRITE with the old rkey fails at the NIC
        // and breaks only this connection. A window goes first.
        self.window = None;
        if let Some(r) = self.rdv.take() {
            self.src.put(r);
        }
    }
    // Registering is the rare path (memory on demand): kept out of the
    // engine's progress, which runs several times per message.
    #[inline(never)]
    fn open_staging(&mut self) -> Result<(), ResourceError> {
        if self.staging.is_none() {
            let st = self
                .src
                .take(self.sz.rdv_count * self.sz.rdv_bytes, Access::Local)
                .map_err(ResourceError::from_error)?;
            self.staging = Some(st);
        }
        Ok(())
    }
    fn close_staging(&mut self) {
        // Called only when every staging buffer is free: no posted WRITE
        // reads it.
        if let Some(st) = self.staging.take() {
            self.src.put(st);
        }
    }
    // Registering is the rare path (memory on demand): kept out of the
    // engine's progress, which runs several times per message.
    #[inline(never)]
    fn grow_send(&mut self, n: u32) -> Result<(), ResourceError> {
        self.send
            .ensure(&self.src, n as usize)
            .map_err(ResourceError::from_error)
    }
    fn shrink_send(&mut self, n: u32) {
        self.send.trim(&self.src, n as usize);
    }
    fn shrink_recv(&mut self, n: u32) {
        // §4.7: the peer released the credits above `n`. Its slots leave
        // the queue of posted ones (no message can be on its way to them:
        // the peer holds at most `n` credits, and the queue keeps `n`
        // slots), the buffer of the one being read goes back, and so does
        // the pool's reservation.
        let Some(sh) = self.shared.as_mut() else {
            return;
        };
        let n = n as usize;
        sh.posted.retain(|&(slot, _)| (slot as usize) < n);
        sh.back.clear();
        for h in sh.bound.iter_mut().skip(n) {
            if let Some(h) = h.take() {
                sh.back.push(h.buf);
            }
        }
        if n < sh.reserved {
            sh.pool.unreserve(sh.reserved - n);
            sh.reserved = n;
        }
        if let Err(e) = sh.pool.give_back(&sh.back) {
            tracing::warn!("shared receive pool: reposting failed: {e}");
        }
    }
    fn grow_recv(&mut self, n: u32) -> Result<(), ResourceError> {
        if let Some(sh) = self.shared.as_mut() {
            let n = (n as usize).min(sh.bound.len());
            if n > sh.reserved {
                sh.pool
                    .reserve(n - sh.reserved)
                    .map_err(ResourceError::from_error)?;
                sh.reserved = n;
            }
            return Ok(());
        }
        self.recv
            .ensure(&self.src, n as usize)
            .map_err(ResourceError::from_error)
    }
    fn register_source(&mut self, body: &Bytes) -> Option<u32> {
        if body.is_empty() {
            return None;
        }
        let free = self.sources.iter().position(Option::is_none);
        let id = free.unwrap_or(self.sources.len());
        let id32 = u32::try_from(id).ok()?;
        // No access flag: only our own WRITEs read it; a cap reached or a
        // failed registration means the copy instead.
        let mr = UserMr::new(
            &self.src.pd,
            Exposable::Shared(body.clone()),
            MrUse::WriteSource,
            self.src.limit,
        )
        .ok()?;
        self.put_source(
            free,
            Source {
                window: None,
                rkey: 0,
                mr,
            },
        );
        Some(id32)
    }
    fn expose_source(&mut self, body: &Bytes) -> Option<ExposedBody> {
        if body.is_empty() {
            return None;
        }
        let free = self.sources.iter().position(Option::is_none);
        let id = u32::try_from(free.unwrap_or(self.sources.len())).ok()?;
        // §5.6: readable by this connection's peer alone, never writable.
        // A PD of the connection's own scopes an MR's rkey to its QP; in a
        // shared PD a type-2 window bound to the QP does (§4.7). A cap
        // reached or a failed registration means a WRITE instead.
        let shared = self.src.dev.is_some();
        let how = if shared {
            MrUse::WindowSource
        } else {
            MrUse::Exposed(RemoteAccess::Read)
        };
        let mr = UserMr::new(
            &self.src.pd,
            Exposable::Shared(body.clone()),
            how,
            self.src.limit,
        )
        .ok()?;
        let (window, rkey) = if shared {
            let mw = Mw::new(&self.src.pd).ok()?;
            let rkey = mw.next_rkey();
            (Some(mw), rkey)
        } else {
            (None, mr.rkey())
        };
        let x = ExposedBody {
            id,
            addr: mr.addr(),
            rkey,
            bind: shared,
        };
        self.put_source(free, Source { window, rkey, mr });
        Some(x)
    }
    fn open_dest(&mut self, head: &[u8], len: usize) -> Result<u32, ResourceError> {
        let total = head
            .len()
            .checked_add(len)
            .ok_or_else(|| ResourceError::Other("message length overflows".into()))?;
        let pd = self.src.pd.clone();
        let cache = self
            .dest_cache
            .get_or_insert_with(|| {
                // rpc-core's frames are a power of two of payload behind a
                // 6-byte header: 4 KiB of slack keeps them in the
                // payload's class.
                LocalCache::with_slack(pd.clone(), self.read_cache_bytes, self.src.limit, 4096)
            })
            .clone();
        let mut mr =
            read_buffer(&cache, total, &pd, self.src.limit).map_err(ResourceError::from_error)?;
        // In no work request yet: only the CPU touches it.
        let b = mr
            .local_bytes_mut()
            .ok_or_else(|| ResourceError::Other("read buffer not writable".into()))?;
        b[..head.len()].copy_from_slice(head);
        let free = self.dests.iter().position(Option::is_none);
        let id = free.unwrap_or(self.dests.len());
        let id32 =
            u32::try_from(id).map_err(|_| ResourceError::Other("too many read buffers".into()))?;
        match free {
            Some(i) => self.dests[i] = Some(Dest::local(mr, total)),
            None => self.dests.push(Some(Dest::local(mr, total))),
        }
        Ok(id32)
    }
    fn expose_dest(
        &mut self,
        id: u32,
        off: usize,
        len: usize,
    ) -> Result<ExposedBody, ResourceError> {
        let d = self
            .dests
            .get_mut(id as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| ResourceError::Other(format!("no read buffer {id}")))?;
        // §5.7: only in a shared PD, through a window bound to this QP
        // (an MR's rkey there would reach every connection's QP).
        if self.src.dev.is_none() {
            return Err(ResourceError::Other(
                "no window can scope a destination to this peer".into(),
            ));
        }
        if d.window.is_some()
            || len == 0
            || !off
                .checked_add(len)
                .is_some_and(|end| end <= d.total && d.total <= d.mr.len())
        {
            return Err(ResourceError::Other(format!(
                "destination {id}: {len} bytes at {off} cannot be granted"
            )));
        }
        let addr = d.mr.addr() + off as u64;
        // [addr, addr + len) lies inside `d.mr`'s buffer (checked above), which `Dest` keeps
        // allocated until after the SubMr is gone (field order; take_dest deregisters it first).
        // SAFETY: as above; no work request uses it before the bind.
        let sub = unsafe { SubMr::new(&self.src.pd, addr, len) };
        let sub = sub.map_err(ResourceError::from_error)?;
        let mw = Mw::new(&self.src.pd).map_err(ResourceError::from_error)?;
        let rkey = mw.next_rkey();
        d.window = Some(mw);
        d.rkey = rkey;
        d.grant = Some(sub);
        Ok(ExposedBody {
            id,
            addr,
            rkey,
            bind: true,
        })
    }
    fn close_read_cache(&mut self) {
        // No READ is posted (the engine checked): the free buffers are
        // deregistered now, those the application holds when it drops them.
        if let Some(c) = self.dest_cache.take() {
            c.close();
        }
    }
    fn take_dest(&mut self, id: u32) -> Result<Bytes, ResourceError> {
        let Dest {
            window,
            grant,
            mr,
            total,
            ..
        } = self
            .dests
            .get_mut(id as usize)
            .and_then(Option::take)
            .ok_or_else(|| ResourceError::Other(format!("no read buffer {id}")))?;
        // §5.7: the peer's access goes first (ibv_dealloc_mw returns once
        // the window is invalid): nothing it writes can land any more.
        drop(window);
        if let Some(g) = grant {
            if !g.deregister() {
                // The device may still map the buffer: never handed out.
                std::mem::forget(mr);
                return Err(ResourceError::Other(
                    "a written destination could not be deregistered".into(),
                ));
            }
        }
        // The READ completed, or the peer's WRITE landed before its
        // RDV_WRITTEN: handed up as it is (a cached buffer goes back to the
        // cache when the last `Bytes` over it is dropped).
        read_bytes(mr, total)
            .ok_or_else(|| ResourceError::Other("a read buffer could not be deregistered".into()))
    }
    fn release_source(&mut self, id: u32) {
        if let Some(s) = self.sources.get_mut(id as usize) {
            // Window deallocated, then deregistered (and the bytes let go)
            // when dropped.
            *s = None;
        }
    }
}

impl Dest {
    /// A destination no window reaches (yet).
    fn local(mr: UserMr, total: usize) -> Dest {
        Dest {
            window: None,
            rkey: 0,
            grant: None,
            mr,
            total,
        }
    }
}
