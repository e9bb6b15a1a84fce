//! The side queue pair of a connection (wire protocol §10.2): a second RC
//! connection to the same listener, in the connection's exposure PD, that
//! carries only one-sided READs and WRITEs, so that a remote access error
//! (which takes an RC queue pair to the error state) never takes the
//! connection's messages down.
//!
//! * [`open_side`]: the active side opens it (a connect request with the
//!   side flag and the token the listener gave, §10.2),
//! * [`accept_side`]: the listener side answers such a request, for the
//!   connection the token belongs to,
//! * the side task: owns the queue pair and every posted buffer until its
//!   completion is polled (`crate::mem::SideQp`), posts at most
//!   [`SIDE_DEPTH`] operations at a time and queues the rest, and on a
//!   failure flushes everything and hands the flushed operations back for
//!   one retry on a fresh queue pair (§10.3).

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::Duration;

use rdma_sys::rdma_cm_event_type as ev;
use tokio::sync::{mpsc, oneshot, watch};

use super::events::{event_name, next_event, status_text, CmFd, CqFd};
use super::setup::resolve;
use crate::config::{Config, PollMode};
use crate::engine::wire::SideToken;
use crate::error::{Error, RejectReason, RemoteError};
use crate::mem::{read_destination, MrUse, PostFail, SideQp, Transfer, UserMr, FENCED_WRITE};
use crate::remote::{Op, OpResult, RemoteShared, SideLink};
use crate::verbs::cm::{CmId, EventChannel};
use crate::verbs::{async_fd, CompChannel, Cq, Pd, Qp, QpCaps, Wc};

/// READs and WRITEs posted on a side queue pair at a time; more wait in
/// its task's queue.
pub(crate) const SIDE_DEPTH: u32 = 64;

/// RDMA READs outstanding at a time each way on a side queue pair of
/// `id` (lowered by librdmacm to what both devices allow). One on iWARP:
/// with several, siw answered a refused READ's TERMINATE ahead of the
/// answers to older READs, which then failed too, and the oldest
/// operation not completed was no longer the refused one (§10.3).
fn read_depth(id: &CmId) -> u8 {
    if id.is_iwarp() {
        1
    } else {
        16
    }
}

/// IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_ACCESS_ERR.
const WC_REM_INV_REQ_ERR: u32 = 9;
const WC_REM_ACCESS_ERR: u32 = 10;
/// Statuses of an operation the queue pair failed under (`ibv_wc_status`:
/// LOC_QP_OP_ERR, WR_FLUSH_ERR, REM_OP_ERR, RETRY_EXC_ERR,
/// RNR_RETRY_EXC_ERR, REM_ABORT_ERR, FATAL_ERR, RESP_TIMEOUT_ERR,
/// GENERAL_ERR): siw reports a refused operation with some of them.
const RETRYABLE: [u32; 9] = [2, 5, 11, 12, 13, 16, 19, 20, 21];

/// Times a side connect retries with a fresh cm_id when iWARP finds its
/// local port taken (as `connect` does, §9).
const PORT_RETRIES: u32 = 3;

/// The side tokens a listener gave (§10.2), each with its connection's
/// state (a `Weak`: a closed connection's token finds nothing).
#[derive(Default)]
pub(crate) struct SideRegistry {
    tokens: std::sync::Mutex<Vec<(SideToken, Weak<RemoteShared>)>>,
}

impl SideRegistry {
    /// A fresh random token for `shared`'s connection; `None` (the
    /// connection then gets no one-sided access) if the system's random
    /// source fails.
    pub(crate) fn issue(&self) -> Option<SideToken> {
        use std::io::Read;
        let mut t: SideToken = [0; crate::engine::wire::SIDE_TOKEN_LEN];
        if let Err(e) = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut t)) {
            tracing::warn!("rdma listener: no random side token ({e}); no one-sided access");
            return None;
        }
        Some(t)
    }

    /// Records `token` as `shared`'s (and forgets closed connections').
    pub(crate) fn register(&self, token: SideToken, shared: &Arc<RemoteShared>) {
        let mut g = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        g.retain(|(_, w)| w.upgrade().is_some_and(|s| !s.is_closed()));
        g.push((token, Arc::downgrade(shared)));
    }

    /// The open connection `token` was given to.
    pub(crate) fn find(&self, token: &SideToken) -> Option<Arc<RemoteShared>> {
        let g = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        g.iter()
            .find(|(t, _)| t == token)
            .and_then(|(_, w)| w.upgrade())
            .filter(|s| !s.is_closed())
    }
}

fn unavailable(why: impl Into<String>) -> Error {
    Error::Remote(RemoteError::Unavailable(why.into()))
}

/// The CQ and QP of a side queue pair on `id`, in the exposure PD `pd`.
fn side_qp(id: &Arc<CmId>, pd: &Arc<Pd>) -> Result<(Arc<Cq>, Qp), Error> {
    let comp = CompChannel::new(id.clone())?;
    let cq = Cq::new(id, comp, (2 * SIDE_DEPTH + 16) as i32)?;
    let qp = Qp::new(
        id.clone(),
        pd.clone(),
        cq.clone(),
        cq.clone(),
        QpCaps {
            // Two work requests per fenced WRITE (iWARP).
            send_wr: 2 * SIDE_DEPTH,
            // No receive is ever posted; some providers want a queue.
            recv_wr: 1,
            inline: 0,
            srq: None,
        },
    )?;
    Ok((cq, qp))
}

/// Active side (§10.2): opens a side queue pair to the listener at `peer`
/// (from `local`), presenting `token`, and starts its task. Bounded by
/// `connect_timeout`.
pub(crate) async fn open_side(
    shared: &Arc<RemoteShared>,
    peer: SocketAddr,
    local: Option<IpAddr>,
    token: SideToken,
) -> Result<SideLink, Error> {
    let cfg = shared.cfg.clone();
    let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
    let mut collisions = 0;
    loop {
        let r = tokio::time::timeout_at(deadline, open_once(shared, peer, local, token, &cfg))
            .await
            .unwrap_or_else(|_| {
                Err(unavailable(
                    "opening the side queue pair timed out (connect_timeout)",
                ))
            });
        match r {
            Err(Error::Verb {
                verb: "rdma_connect",
                errno,
            }) if errno.0 == libc::EADDRINUSE && collisions < PORT_RETRIES => collisions += 1,
            Err(e @ Error::Remote(_)) => return Err(e),
            Err(e) => return Err(unavailable(format!("opening the side queue pair: {e}"))),
            Ok(l) => return Ok(l),
        }
    }
}

async fn open_once(
    shared: &Arc<RemoteShared>,
    peer: SocketAddr,
    local: Option<IpAddr>,
    token: SideToken,
    cfg: &Config,
) -> Result<SideLink, Error> {
    let (chan, afd, id) = resolve(peer, local, cfg).await?;
    let id = Arc::new(id);
    if !shared.same_device(&id) {
        return Err(unavailable(
            "the side queue pair resolved to another RDMA device than the connection",
        ));
    }
    let pd = shared.pd()?;
    let (cq, qp) = side_qp(&id, &pd)?;
    let private = shared.hello.encode_side(&token);
    // rdma_connect blocks on iWARP (§9): on the blocking pool, with the QP
    // travelling along so that it is freed only after the call returned.
    let id2 = id.clone();
    let depth = read_depth(&id);
    let (r, qp) = tokio::task::spawn_blocking(move || (id2.connect_reads(&private, depth), qp))
        .await
        .map_err(|_| unavailable("the side connect's thread failed"))?;
    r?;
    let e = next_event(&chan, &afd).await?;
    match e.kind {
        ev::RDMA_CM_EVENT_ESTABLISHED => {}
        ev::RDMA_CM_EVENT_REJECTED => {
            let why = RejectReason::from_private_data(&e.private_data)
                .map_or_else(|| status_text(e.status), |r| r.to_string());
            return Err(unavailable(format!(
                "the peer refused the side queue pair: {why}"
            )));
        }
        k => {
            return Err(unavailable(format!(
                "the side queue pair's connect failed: {} ({})",
                event_name(k),
                status_text(e.status)
            )))
        }
    }
    start(shared, id, chan, afd, cq, qp)
}

/// Listener side (§10.2): answers a side request for `shared`'s
/// connection on `id` (already on its own channel `chan`), and starts the
/// side task once it is established. Rejects it when the device differs
/// or the queue pair cannot be made.
pub(crate) async fn accept_side(
    id: CmId,
    chan: Arc<EventChannel>,
    shared: Arc<RemoteShared>,
) -> Result<(), Error> {
    let afd = match async_fd(chan.clone()) {
        Ok(a) => a,
        Err(e) => {
            id.reject(RejectReason::Resources.text().as_bytes());
            return Err(e);
        }
    };
    let id = Arc::new(id);
    if !shared.same_device(&id) {
        id.reject(b"side queue pair on another device than its connection");
        return Err(unavailable(
            "a side request arrived on another device than its connection",
        ));
    }
    let made = shared.pd().and_then(|pd| side_qp(&id, &pd));
    let (cq, qp) = match made {
        Ok(x) => x,
        Err(e) => {
            id.reject(RejectReason::Resources.text().as_bytes());
            return Err(e);
        }
    };
    id.accept_reads(&shared.hello.encode(), read_depth(&id))?;
    let e = tokio::time::timeout(shared.cfg.connect_timeout, next_event(&chan, &afd))
        .await
        .map_err(|_| Error::Timeout { stage: "accept" })??;
    if e.kind != ev::RDMA_CM_EVENT_ESTABLISHED {
        return Err(unavailable(format!(
            "the side queue pair's accept failed: {}",
            event_name(e.kind)
        )));
    }
    start(&shared, id, chan, afd, cq, qp).map(|_| ())
}

/// Starts the task of an established side queue pair and makes it the one
/// in use.
fn start(
    shared: &Arc<RemoteShared>,
    id: Arc<CmId>,
    chan: Arc<EventChannel>,
    cm_afd: CmFd,
    cq: Arc<Cq>,
    qp: Qp,
) -> Result<SideLink, Error> {
    let iwarp = id.is_iwarp();
    let scratch = UserMr::new(
        &shared.pd()?,
        read_destination(64),
        MrUse::ReadDestination,
        shared.cfg.global_max_registered_bytes,
    )?;
    let cq_afd = async_fd(cq.clone())?;
    let (tx, rx) = mpsc::unbounded_channel();
    let link = SideLink {
        tx,
        gen: shared.next_gen(),
    };
    let task = SideTask {
        sq: Some(SideQp::new(qp, scratch)),
        inflight: Inflight::default(),
        waiting: VecDeque::new(),
        rx,
        cq_afd,
        cq,
        cm_afd,
        id,
        chan,
        shared: Arc::downgrade(shared),
        closed: shared.closed_watch(),
        in_use: shared.side_watch(),
        gen: link.gen,
        wcs: Vec::with_capacity(32),
        mode: shared
            .cfg
            .one_sided_poll_mode
            .unwrap_or(shared.cfg.poll_mode),
        busy_poll: shared.cfg.busy_poll,
        iwarp,
        cause_known: false,
        failed: Vec::new(),
    };
    crate::stats::GLOBAL
        .side_queue_pairs
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if !shared.install(link.clone()) {
        // Closed meanwhile: the task disconnects and frees it at once.
        tokio::spawn(task.shutdown(Ok(())));
        return Err(Error::Remote(RemoteError::Closed));
    }
    tokio::spawn(task.run());
    Ok(link)
}

/// What the side task keeps of a posted operation (its buffer is in the
/// `SideQp`).
struct Posted {
    reply: oneshot::Sender<OpResult>,
}

/// The posted operations by work request id: at most [`SIDE_DEPTH`], so a
/// short list (a lookup is a few compares, no hashing).
#[derive(Default)]
struct Inflight(Vec<(u64, Posted)>);

impl Inflight {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn insert(&mut self, wr_id: u64, p: Posted) {
        self.0.push((wr_id, p));
    }

    fn remove(&mut self, wr_id: &u64) -> Option<Posted> {
        let i = self.0.iter().position(|(id, _)| id == wr_id)?;
        Some(self.0.swap_remove(i).1)
    }
}

/// The task of one side queue pair.
struct SideTask {
    /// The QP and the posted buffers: first, so dropping the task destroys
    /// the QP before anything else goes. `None` once destroyed.
    sq: Option<SideQp>,
    inflight: Inflight,
    waiting: VecDeque<Op>,
    rx: mpsc::UnboundedReceiver<Op>,
    cq_afd: CqFd,
    cq: Arc<Cq>,
    cm_afd: CmFd,
    id: Arc<CmId>,
    chan: Arc<EventChannel>,
    shared: Weak<RemoteShared>,
    closed: watch::Receiver<bool>,
    /// The side queue pair in use: when it is no longer this one (the
    /// active side opened another), this one stops, so a peer cannot make
    /// the listener side keep more than one per connection.
    in_use: watch::Receiver<Option<SideLink>>,
    gen: u64,
    wcs: Vec<Wc>,
    /// `Config::one_sided_poll_mode` (else `poll_mode`) and
    /// `Config::busy_poll`: how long the task polls while operations are
    /// posted before it sleeps ([`SideTask::spin`]).
    mode: PollMode,
    busy_poll: Duration,
    /// iWARP: WRITEs are fenced (`SideQp::post`).
    iwarp: bool,
    /// Why the queue pair failed is known (a status named the operation,
    /// or it was closed or replaced): no flushed operation is suspected.
    cause_known: bool,
    /// Operations that failed because the queue pair failed, answered at
    /// the shutdown.
    failed: Vec<(u64, UserMr, Posted)>,
}

impl SideTask {
    async fn run(mut self) {
        let why = self.main_loop().await;
        self.shutdown(why).await;
    }

    fn next_wr(&self) -> u64 {
        self.shared.upgrade().map_or(0, |s| s.next_wr())
    }

    /// Posts waiting operations while fewer than [`SIDE_DEPTH`] are posted.
    fn post_waiting(&mut self) -> Result<(), Error> {
        while self.inflight.len() < SIDE_DEPTH as usize {
            let Some(op) = self.waiting.pop_front() else {
                break;
            };
            if op.reply.is_closed() {
                // Its caller is gone and it was never posted: drop it.
                continue;
            }
            let wr_id = self.next_wr();
            let Some(sq) = self.sq.as_mut() else {
                self.waiting.push_front(op);
                return Err(unavailable("the side queue pair is gone"));
            };
            let t = Transfer {
                read: op.read,
                len: op.len,
                remote_addr: op.remote_addr,
                rkey: op.rkey,
            };
            match sq.post(wr_id, self.iwarp, op.local, t) {
                Ok(()) => {
                    self.inflight.insert(wr_id, Posted { reply: op.reply });
                }
                Err(b) => match *b {
                    PostFail::NotPosted(local, e) => {
                        // Not posted: the QP failed (or refused the
                        // request); the operation goes back for a retry.
                        self.waiting.push_front(Op { local, ..op });
                        return Err(e);
                    }
                    PostFail::Posted(e) => {
                        // Posted without its fence: answered when the QP's
                        // flush (or destruction) gives its buffer back.
                        self.inflight.insert(wr_id, Posted { reply: op.reply });
                        return Err(e);
                    }
                },
            }
        }
        Ok(())
    }

    /// Handles polled completions; `Err` after a failed one: the queue
    /// pair is in the error state. A completed operation is answered at
    /// once; one that failed because the queue pair failed is kept in
    /// `failed` until the shutdown, which decides which one caused it.
    fn complete(&mut self) -> Result<(), Error> {
        let mut err = None;
        for i in 0..self.wcs.len() {
            let mut wc = self.wcs[i];
            if wc.wr_id & FENCED_WRITE != 0 {
                if wc.status == 0 {
                    // The operation completes with its fence READ.
                    continue;
                }
                wc.wr_id &= !FENCED_WRITE;
            }
            let local = self.sq.as_mut().and_then(|sq| sq.complete(wc.wr_id));
            let Some(p) = self.inflight.remove(&wc.wr_id) else {
                continue;
            };
            let Some(local) = local else { continue };
            if wc.status == 0 {
                let _ = p.reply.send(OpResult::Done(local));
                continue;
            }
            let status = Cq::status_str(wc.status);
            tracing::debug!(
                "side queue pair {}: {} failed: {status} (status {})",
                self.gen,
                if local.is_read_destination() {
                    "READ"
                } else {
                    "WRITE"
                },
                wc.status
            );
            err = Some(unavailable(format!("side queue pair failed: {status}")));
            match wc.status {
                // The peer's NIC refused this very operation (InfiniBand,
                // RoCE): the cause is known.
                WC_REM_ACCESS_ERR | WC_REM_INV_REQ_ERR => {
                    self.cause_known = true;
                    let e = Error::Remote(RemoteError::Refused { status });
                    let _ = p.reply.send(OpResult::Failed(e));
                }
                // The queue pair failed under it (flushed, terminated, the
                // peer gone): retried, unless it turns out to be the cause.
                s if RETRYABLE.contains(&s) => self.failed.push((wc.wr_id, local, p)),
                // A local error: a fault of ours, not retried.
                s => {
                    self.cause_known = true;
                    let e =
                        unavailable(format!("the side queue pair failed: {status} (status {s})"));
                    let _ = p.reply.send(OpResult::Failed(e));
                }
            }
        }
        err.map_or(Ok(()), Err)
    }

    fn poll(&mut self) -> Result<usize, Error> {
        let mut total = 0;
        loop {
            self.wcs.clear();
            let n = self.cq.poll(&mut self.wcs, 32)?;
            total += n;
            self.complete()?;
            if n == 0 {
                return Ok(total);
            }
        }
    }

    /// Whether a completion is expected: something is posted.
    fn expecting(&self) -> bool {
        self.sq.as_ref().is_some_and(|sq| sq.outstanding() > 0)
    }

    /// While operations are posted, polls the CQ (and takes new
    /// operations) before the task sleeps on the completion channel (§10.5):
    /// for `busy_poll` in the `Adaptive` and `Fixed` modes, for as long as
    /// anything is posted in the `Spin` mode, letting the runtime run other
    /// tasks every few polls. `true` when it found work; `false` when the
    /// budget ran out or the task must look at its other events (closed,
    /// replaced, every handle gone).
    async fn spin(&mut self) -> Result<bool, Error> {
        let budget = match self.mode {
            PollMode::Spin => None,
            PollMode::Adaptive | PollMode::Fixed if self.busy_poll.is_zero() => return Ok(false),
            PollMode::Adaptive | PollMode::Fixed => Some(self.busy_poll),
        };
        // Read the clock only with a budget: in a VM a clock read can be a
        // system call.
        let deadline = budget.map(|b| std::time::Instant::now() + b);
        let mut polls: u32 = 0;
        loop {
            if self.poll()? > 0 {
                return Ok(true);
            }
            if self.inflight.len() < SIDE_DEPTH as usize {
                match self.rx.try_recv() {
                    Ok(op) => {
                        self.waiting.push_back(op);
                        return Ok(true);
                    }
                    Err(mpsc::error::TryRecvError::Empty) => {}
                    Err(mpsc::error::TryRecvError::Disconnected) => return Ok(false),
                }
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(32) {
                let replaced = self.in_use.borrow().as_ref().map(|l| l.gen) != Some(self.gen);
                if *self.closed.borrow() || replaced {
                    return Ok(false);
                }
                if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                    return Ok(false);
                }
                tokio::task::yield_now().await;
            }
        }
    }

    async fn main_loop(&mut self) -> Result<(), Error> {
        let gen = self.gen;
        loop {
            self.post_waiting()?;
            if self.poll()? > 0 {
                continue;
            }
            // Nothing posted: no completion can come, the channel stays
            // unarmed (arming is a system call on some devices).
            if self.expecting() {
                if self.spin().await? {
                    continue;
                }
                self.cq.arm()?;
                // A completion between the poll and the arm raises no event.
                if self.poll()? > 0 {
                    continue;
                }
            }
            let room = self.inflight.len() < SIDE_DEPTH as usize;
            tokio::select! {
                g = self.cq_afd.readable() => {
                    let mut g = g.map_err(|e| super::io_err("AsyncFd(side cq)", e))?;
                    g.clear_ready();
                    self.cq.consume_events()?;
                }
                op = self.rx.recv(), if room => match op {
                    Some(op) => self.waiting.push_back(op),
                    // Every handle is gone: nobody can use this side.
                    None => return Ok(()),
                },
                e = next_event(&self.chan, &self.cm_afd) => {
                    let e = e?;
                    match e.kind {
                        ev::RDMA_CM_EVENT_DISCONNECTED | ev::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                            return Err(unavailable("the peer closed the side queue pair"));
                        }
                        k => tracing::debug!("side queue pair: cm event {}", event_name(k)),
                    }
                }
                _ = self.closed.wait_for(|c| *c) => return Ok(()),
                _ = self.in_use.wait_for(|l| l.as_ref().map(|l| l.gen) != Some(gen)) => {
                    return Ok(())
                }
            }
        }
    }

    /// Ends the side queue pair: no longer in use, the peer told
    /// (disconnect), everything posted flushed and answered, the QP
    /// destroyed before any buffer is freed. `why`: `Ok` when closing, the
    /// failure otherwise.
    async fn shutdown(mut self, why: Result<(), Error>) {
        let shared = self.shared.upgrade();
        if let Some(s) = &shared {
            s.side_failed(self.gen);
        }
        if why.is_ok() {
            // Closed or replaced: no operation caused it.
            self.cause_known = true;
        }
        if let Err(e) = &why {
            tracing::debug!("rdma side queue pair {} ends: {e}", self.gen);
        }
        // From here no operation can be queued: what is queued is answered.
        self.rx.close();
        while let Ok(op) = self.rx.try_recv() {
            self.waiting.push_back(op);
        }
        let _ = self.id.disconnect();
        if let Some(sq) = &self.sq {
            let _ = sq.to_error();
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while self.sq.as_ref().is_some_and(|sq| sq.outstanding() > 0)
            && tokio::time::Instant::now() < deadline
        {
            if let Ok(0) | Err(_) = self.poll() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        // The QP goes before any buffer still posted (now safe to free).
        if let Some(sq) = self.sq.take() {
            for (wr_id, local) in sq.destroy() {
                if let Some(p) = self.inflight.remove(&wr_id) {
                    self.failed.push((wr_id, local, p));
                }
            }
        }
        // Posting order: the oldest operation the queue pair did not
        // complete is the likely cause of its failure (§10.3), unless a
        // status named the cause or none is needed (closed, replaced).
        self.failed.sort_by_key(|(wr_id, _, _)| *wr_id);
        for (i, (_, local, p)) in self.failed.drain(..).enumerate() {
            let first = i == 0 && !self.cause_known;
            let _ = p.reply.send(OpResult::Flushed(local, first));
        }
        for op in self.waiting.drain(..) {
            let _ = op.reply.send(OpResult::Flushed(op.local, false));
        }
        let _ = self.cq.consume_events();
        if why.is_err() {
            if let Some(s) = shared {
                s.reopen_later();
            }
        }
    }
}

/// A side request (§10.2) with any token and hello, from a queue pair in a
/// PD of its own; `Ok` if the listener accepted it (then disconnected at
/// once). Only for tests of a hostile peer (`crate::testing`).
#[cfg(feature = "test-util")]
pub(crate) async fn raw_side_request(
    addr: SocketAddr,
    cfg: &Config,
    hello: crate::engine::wire::Hello,
    token: SideToken,
) -> Result<(), Error> {
    let (chan, afd, id) = resolve(addr, None, cfg).await?;
    let id = Arc::new(id);
    let pd = Pd::new(id.clone())?;
    let (_cq, qp) = side_qp(&id, &pd)?;
    let private = hello.encode_side(&token);
    let id2 = id.clone();
    let (r, _qp) = tokio::task::spawn_blocking(move || (id2.connect(&private), qp))
        .await
        .map_err(|_| Error::Disconnected)?;
    r?;
    let e = tokio::time::timeout(cfg.connect_timeout, next_event(&chan, &afd))
        .await
        .map_err(|_| Error::Timeout { stage: "connect" })??;
    match e.kind {
        ev::RDMA_CM_EVENT_ESTABLISHED => {
            let _ = id.disconnect();
            Ok(())
        }
        ev::RDMA_CM_EVENT_REJECTED => Err(Error::Rejected {
            addr,
            status: e.status,
            reason: RejectReason::from_private_data(&e.private_data),
        }),
        _ => Err(Error::Unreachable {
            addr,
            status: e.status,
        }),
    }
}
