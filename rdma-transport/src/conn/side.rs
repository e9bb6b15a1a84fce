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
//! * the side task: the backstop of the callers' waits (`side_core`: the
//!   callers post and poll themselves, at most [`SIDE_DEPTH`] operations
//!   posted at a time), and on a failure it flushes everything and hands
//!   the flushed operations back for one retry on a fresh queue pair
//!   (§10.3).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::Duration;

use rdma_sys::rdma_cm_event_type as ev;
use tokio::sync::watch;

use super::events::{event_name, next_event, status_text, CmFd, CqFd};
use super::setup::resolve;
use super::side_core::{unavailable, SideCore};
use crate::config::Config;
use crate::engine::wire::SideToken;
use crate::error::{Error, RejectReason, RemoteError};
use crate::mem::{read_destination, MrUse, SideQp, UserMr, SMALL_READ_MAX};
use crate::remote::{OpResult, RemoteShared, SideLink};
use crate::verbs::cm::{CmId, EventChannel};
use crate::verbs::{async_fd, CompChannel, Cq, Pd, Qp, QpCaps};

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
    let (cq, qp) = side_qp(&id, pd)?;
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
    let made = shared.pd().and_then(|pd| side_qp(&id, pd));
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
        shared.pd()?,
        read_destination(SMALL_READ_MAX),
        MrUse::ReadDestination,
        shared.cfg.global_max_registered_bytes,
    )?;
    let cq_afd = async_fd(cq.clone())?;
    let core = Arc::new(SideCore::new(
        SideQp::new(qp, scratch),
        cq,
        shared.next_gen(),
        iwarp,
        shared
            .cfg
            .one_sided_poll_mode
            .unwrap_or(shared.cfg.poll_mode),
        shared.cfg.busy_poll,
    ));
    let link = SideLink { core: core.clone() };
    let task = SideTask {
        core,
        cq_afd,
        cm_afd,
        id,
        chan,
        shared: Arc::downgrade(shared),
        closed: shared.closed_watch(),
        in_use: shared.side_watch(),
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

/// The task of one side queue pair: the backstop of its callers' waits
/// (it sleeps on the completion channel for operations no caller polls
/// for, `side_core`), the watcher of its connection events, and its
/// shutdown.
struct SideTask {
    /// Holds the QP and the posted buffers: dropping the task (and every
    /// link) destroys the QP before anything else goes.
    core: Arc<SideCore>,
    cq_afd: CqFd,
    cm_afd: CmFd,
    id: Arc<CmId>,
    chan: Arc<EventChannel>,
    shared: Weak<RemoteShared>,
    closed: watch::Receiver<bool>,
    /// The side queue pair in use: when it is no longer this one (the
    /// active side opened another), this one stops, so a peer cannot make
    /// the listener side keep more than one per connection.
    in_use: watch::Receiver<Option<SideLink>>,
}

impl SideTask {
    async fn run(mut self) {
        let why = self.main_loop().await;
        self.shutdown(why).await;
    }

    /// Posts what callers queued and polls what completed; whether
    /// anything is posted. `Err` once the queue pair failed.
    async fn step(&self) -> Result<bool, Error> {
        let core = &self.core;
        let mut st = core.lock().await;
        core.post_queued(&mut st);
        core.poll_locked(&mut st);
        match st.take_failure() {
            Some(e) => Err(e),
            None => Ok(st.expecting()),
        }
    }

    /// Arms the completion channel while anything is posted, then polls
    /// again (a completion before the arm raises no event); `true` if
    /// that found one. `Err` once the queue pair failed.
    async fn arm(&self) -> Result<bool, Error> {
        let core = &self.core;
        let mut st = core.lock().await;
        if !st.expecting() {
            // Nothing posted: no completion can come, the channel stays
            // unarmed (arming is a system call on some devices).
            return Ok(false);
        }
        core.cq.arm()?;
        let found = core.poll_locked(&mut st) > 0;
        match st.take_failure() {
            Some(e) => Err(e),
            None => Ok(found),
        }
    }

    async fn main_loop(&mut self) -> Result<(), Error> {
        let gen = self.core.gen;
        loop {
            // The task does not spin: the caller of a lone operation does
            // (`SideCore::wait`); with several in flight, spinning here made
            // some callers wait far longer than others (§10.5).
            self.step().await?;
            if self.arm().await? {
                continue;
            }
            tokio::select! {
                g = self.cq_afd.readable() => {
                    let mut g = g.map_err(|e| super::io_err("AsyncFd(side cq)", e))?;
                    g.clear_ready();
                    self.core.cq.consume_events()?;
                }
                _ = self.core.kick.notified() => {}
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
                // Replaced by a newer one, or every handle gone (the
                // connection's state dropped its sender).
                _ = self.in_use.wait_for(|l| l.as_ref().map(|l| l.gen()) != Some(gen)) => {
                    return Ok(())
                }
            }
        }
    }

    /// Ends the side queue pair: no longer in use, the peer told
    /// (disconnect), everything posted flushed and answered, the QP
    /// destroyed before any buffer is freed. `why`: `Ok` when closing, the
    /// failure otherwise.
    async fn shutdown(self, why: Result<(), Error>) {
        let core = &self.core;
        let shared = self.shared.upgrade();
        if let Some(s) = &shared {
            s.side_failed(core.gen);
        }
        // From here no operation is taken: what is queued is answered.
        core.queue().closed = true;
        {
            let mut st = core.lock().await;
            st.ended = true;
            if why.is_ok() {
                // Closed or replaced: no operation caused it.
                st.cause_known = true;
            }
            if let Some(sq) = &st.sq {
                let _ = sq.to_error();
            }
        }
        if let Err(e) = &why {
            tracing::debug!("rdma side queue pair {} ends: {e}", core.gen);
        }
        let _ = self.id.disconnect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        loop {
            let outstanding = {
                let mut st = core.lock().await;
                // Flushed completions are collected even after a failure.
                st.broken = None;
                core.poll_locked(&mut st);
                st.broken = None;
                st.sq.as_ref().map_or(0, |sq| sq.outstanding())
            };
            if outstanding == 0 || tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        {
            let mut st = core.lock().await;
            // The QP goes before any buffer still posted (now safe to free).
            if let Some(sq) = st.sq.take() {
                for (wr_id, local) in sq.destroy() {
                    if let Some(p) = st.take_inflight(wr_id) {
                        st.failed.push((wr_id, local, p));
                    }
                }
            }
            let mut waiting = std::mem::take(&mut st.waiting);
            waiting.extend(core.take_queued());
            // Posting order: the oldest operation the queue pair did not
            // complete is the likely cause of its failure (§10.3), unless a
            // status named the cause or none is needed (closed, replaced).
            let mut failed = std::mem::take(&mut st.failed);
            failed.sort_by_key(|(wr_id, _, _)| *wr_id);
            let cause_known = st.cause_known;
            // Answered under the lock that destroyed the QP: a lone
            // operation's sleeping caller that finds the QP gone knows its
            // answer is in (`SideCore::wait`).
            for (i, (_, local, p)) in failed.into_iter().enumerate() {
                let first = i == 0 && !cause_known;
                st.answer(p.reply, OpResult::Flushed(local, first));
            }
            for op in waiting {
                st.answer(op.reply, OpResult::Flushed(op.spec.local, false));
            }
            core.wake_lone(&mut st);
        }
        let _ = core.cq.consume_events();
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
