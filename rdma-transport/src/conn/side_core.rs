//! The operations of one side queue pair (wire protocol §10.2, §10.5):
//! what the callers of READs and WRITEs and the side queue pair's task
//! share.
//!
//! A lone operation (nothing else posted or queued, no other caller
//! polling) is posted by its caller ([`SideCore::submit`]), which then
//! polls the side CQ itself while it waits ([`SideCore::wait`]): in the
//! `Spin` mode until its operation completes, otherwise for `busy_poll`.
//! Its answer goes into the state it polls under ([`LoneAnswer`]), where
//! it takes it without a lock or a channel of its own.
//! Other operations go into a queue under a lock of its own (a caller never
//! waits for a post or a poll) for the side task, which posts them and
//! sleeps on the completion channel. Whoever polls answers every operation
//! it finds completed; a poller that stops with operations still posted
//! hands the wait to the task. So one operation in flight costs no task
//! switch, no channel hop and no system call beyond its post.
//!
//! A posted buffer stays in the [`SideQp`] until its completion is polled
//! or the queue pair is destroyed, whoever polls and whatever happens to
//! the caller's future.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, Notify};

use super::poll_lock::{PollGuard, PollLock};
use super::side::SIDE_DEPTH;
use super::side_reply::{LoneAnswer, Reply};
use crate::config::PollMode;
use crate::error::{Error, RemoteError};
use crate::mem::{ByWrId, Local, PostFail, SideQp, Transfer, FENCED_WRITE};
use crate::remote::{Finished, Op, OpResult, OpSpec};
use crate::verbs::{Cq, Wc};

/// IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_ACCESS_ERR.
const WC_REM_INV_REQ_ERR: u32 = 9;
const WC_REM_ACCESS_ERR: u32 = 10;
/// Statuses of an operation the queue pair failed under (`ibv_wc_status`:
/// LOC_QP_OP_ERR, WR_FLUSH_ERR, REM_OP_ERR, RETRY_EXC_ERR,
/// RNR_RETRY_EXC_ERR, REM_ABORT_ERR, FATAL_ERR, RESP_TIMEOUT_ERR,
/// GENERAL_ERR): siw reports a refused operation with some of them.
const RETRYABLE: [u32; 9] = [2, 5, 11, 12, 13, 16, 19, 20, 21];

/// Completions taken from the side CQ per poll.
const POLL_BATCH: usize = 32;

/// Polls between two looks at the clock and two yields to the runtime
/// while a caller waits.
const POLLS_PER_YIELD: u32 = 32;

pub(crate) fn unavailable(why: impl Into<String>) -> Error {
    Error::Remote(RemoteError::Unavailable(why.into()))
}

/// What is kept of a posted operation (its buffer is in the `SideQp`).
pub(crate) struct Posted {
    pub(crate) reply: Reply,
}

/// The state of one side queue pair, under [`SideCore`]'s lock.
pub(crate) struct SideState {
    /// The QP and the posted buffers. `None` once destroyed.
    pub(crate) sq: Option<SideQp>,
    /// The posted operations (at most [`SIDE_DEPTH`]).
    inflight: ByWrId<Posted>,
    /// Operations not posted yet (more than [`SIDE_DEPTH`] at a time).
    pub(crate) waiting: VecDeque<Op>,
    wcs: Vec<Wc>,
    next_wr: u64,
    /// iWARP: WRITEs are fenced (`SideQp::post`).
    iwarp: bool,
    /// Why the queue pair failed is known (a status named the operation,
    /// or it was closed or replaced): no flushed operation is suspected.
    pub(crate) cause_known: bool,
    /// Operations that failed because the queue pair failed, answered at
    /// the shutdown.
    pub(crate) failed: Vec<(u64, Local, Posted)>,
    /// Why the queue pair failed, for its task (which shuts it down).
    pub(crate) broken: Option<Error>,
    /// The task shuts the queue pair down: no operation is taken any more.
    pub(crate) ended: bool,
    /// The answer of the lone operation, whose caller polls.
    lone: LoneAnswer,
    /// A lone operation's answer was put since the last look (its caller
    /// may be asleep: [`SideCore::wake_lone`]).
    lone_put: bool,
}

impl SideState {
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
            self.post_op(op)?;
        }
        Ok(())
    }

    /// Posts `op` (fewer than [`SIDE_DEPTH`] are posted); an operation the
    /// queue pair did not take goes back to the front of `waiting`.
    fn post_op(&mut self, op: Op) -> Result<(), Error> {
        {
            let wr_id = self.next_wr;
            self.next_wr += 1;
            let Some(sq) = self.sq.as_mut() else {
                self.waiting.push_front(op);
                return Err(unavailable("the side queue pair is gone"));
            };
            let t = Transfer {
                read: op.spec.read,
                len: op.spec.len,
                remote_addr: op.spec.remote_addr,
                rkey: op.spec.rkey,
            };
            let local = match op.spec.local {
                Local::Mr(mr) => mr,
                Local::Small => {
                    // Only posted when the buffer is free (`submit`).
                    if let Err(e) = sq.post_small_read(wr_id, t) {
                        self.waiting.push_front(Op {
                            spec: OpSpec {
                                local: Local::Small,
                                ..op.spec
                            },
                            reply: op.reply,
                        });
                        return Err(e);
                    }
                    self.inflight.insert(wr_id, Posted { reply: op.reply });
                    return Ok(());
                }
            };
            match sq.post(wr_id, self.iwarp, local, t) {
                Ok(()) => self.inflight.insert(wr_id, Posted { reply: op.reply }),
                Err(b) => match *b {
                    PostFail::NotPosted(local, e) => {
                        // Not posted: the QP failed (or refused the
                        // request); the operation goes back for a retry.
                        self.waiting.push_front(Op {
                            spec: OpSpec {
                                local: Local::Mr(local),
                                ..op.spec
                            },
                            reply: op.reply,
                        });
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

    /// Answers an operation (a caller that is gone drops the answer, and
    /// with it the local buffer, whose completion was polled).
    pub(crate) fn answer(&mut self, reply: Reply, r: OpResult) {
        match reply {
            Reply::Chan(tx) => {
                let _ = tx.send(r);
            }
            Reply::Lone(seq) => {
                if self.lone.put(seq, r) {
                    self.lone_put = true;
                }
            }
        }
    }

    /// Handles polled completions; `Err` after a failed one: the queue
    /// pair is in the error state. A completed operation is answered at
    /// once; one that failed because the queue pair failed is kept in
    /// `failed` until the shutdown, which decides which one caused it.
    fn complete(&mut self, gen: u64) -> Result<(), Error> {
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
            let ok = wc.status == 0;
            let local = self.sq.as_mut().and_then(|sq| sq.complete(wc.wr_id, ok));
            let Some(p) = self.inflight.remove(wc.wr_id) else {
                continue;
            };
            let Some(local) = local else { continue };
            if ok {
                let done = match local {
                    Local::Mr(mr) => OpResult::Done(Finished::Mr(mr)),
                    // Copied out now: the buffer is the queue pair's.
                    Local::Small => match self.sq.as_mut().and_then(SideQp::small_bytes) {
                        Some(b) => OpResult::Done(Finished::Read(b)),
                        None => OpResult::Failed(unavailable(
                            "internal: a small READ completed without its bytes",
                        )),
                    },
                };
                self.answer(p.reply, done);
                continue;
            }
            let status = Cq::status_str(wc.status);
            tracing::debug!(
                "side queue pair {gen}: {} failed: {status} (status {})",
                match &local {
                    Local::Mr(mr) if !mr.is_read_destination() => "WRITE",
                    _ => "READ",
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
                    self.answer(p.reply, OpResult::Failed(e));
                }
                // The queue pair failed under it (flushed, terminated, the
                // peer gone): retried, unless it turns out to be the cause.
                // On iWARP every other status too: beside a refused READ,
                // siw was seen to fail a good READ with LOC_LEN_ERR (§10.3).
                s if RETRYABLE.contains(&s) || self.iwarp => self.failed.push((wc.wr_id, local, p)),
                // A local error (InfiniBand, RoCE): a fault of ours, not
                // retried.
                s => {
                    self.cause_known = true;
                    let e =
                        unavailable(format!("the side queue pair failed: {status} (status {s})"));
                    self.answer(p.reply, OpResult::Failed(e));
                }
            }
        }
        err.map_or(Ok(()), Err)
    }

    /// Whether a completion is expected: something is posted.
    pub(crate) fn expecting(&self) -> bool {
        self.sq.as_ref().is_some_and(|sq| sq.outstanding() > 0)
    }

    /// Why the queue pair failed, if it did; from here it takes no
    /// operation (its task shuts it down).
    pub(crate) fn take_failure(&mut self) -> Option<Error> {
        let e = self.broken.take()?;
        self.ended = true;
        Some(e)
    }

    /// The posted operation `wr_id`, taken out (the shutdown, after the QP
    /// was destroyed, answers it).
    pub(crate) fn take_inflight(&mut self, wr_id: u64) -> Option<Posted> {
        self.inflight.remove(wr_id)
    }
}

/// One side queue pair's operations, shared by its callers (through the
/// [`SideLink`](crate::remote::SideLink)) and its task.
pub(crate) struct SideCore {
    /// No thread ever blocks on it: a post on rxe can do its transfer's
    /// kernel work inline, and a worker thread blocked behind it would
    /// strand the tasks in its run queue (`poll_lock`).
    state: PollLock<SideState>,
    /// A lone operation's caller is waiting (its [`LoneReceiver`] lives):
    /// no other starts until it is gone.
    lone_busy: AtomicBool,
    /// The lone operation's caller stopped polling and sleeps until
    /// `lone_ready` tells it its answer is in.
    lone_asleep: AtomicBool,
    lone_ready: Notify,
    pub(crate) cq: Arc<Cq>,
    pub(crate) gen: u64,
    /// `Config::one_sided_poll_mode` (else `poll_mode`) and
    /// `Config::busy_poll`: how long a caller polls before it leaves the
    /// wait to the task.
    mode: PollMode,
    busy_poll: Duration,
    /// Wakes the task: an operation is posted that no caller polls for,
    /// or the queue pair failed.
    pub(crate) kick: Notify,
    /// A caller polls the CQ ([`SideCore::wait`]).
    polling: AtomicBool,
    /// Operations callers handed to the task: under a lock of their own,
    /// never held across a verb, so a caller never waits for a post or a
    /// poll (on rxe a post can do the transfer's kernel work inline).
    queue: Mutex<Queue>,
    /// Work requests posted (`SideQp::outstanding`), read without the lock.
    posted: AtomicUsize,
    /// Operations in `queue`, read without its lock.
    queued: AtomicUsize,
}

/// Operations waiting for the task to post them.
#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) ops: VecDeque<Op>,
    /// The queue pair is ending: no operation is taken.
    pub(crate) closed: bool,
}

impl SideCore {
    pub(crate) fn new(
        sq: SideQp,
        cq: Arc<Cq>,
        gen: u64,
        iwarp: bool,
        mode: PollMode,
        busy_poll: Duration,
    ) -> SideCore {
        SideCore {
            state: PollLock::new(SideState {
                sq: Some(sq),
                inflight: ByWrId::default(),
                waiting: VecDeque::new(),
                wcs: Vec::with_capacity(POLL_BATCH),
                next_wr: 1,
                iwarp,
                cause_known: false,
                failed: Vec::new(),
                broken: None,
                ended: false,
                lone: LoneAnswer::default(),
                lone_put: false,
            }),
            lone_busy: AtomicBool::new(false),
            lone_asleep: AtomicBool::new(false),
            lone_ready: Notify::new(),
            cq,
            gen,
            mode,
            busy_poll,
            kick: Notify::new(),
            polling: AtomicBool::new(false),
            queue: Mutex::default(),
            posted: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
        }
    }

    pub(crate) fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the operations callers queued.
    pub(crate) fn take_queued(&self) -> VecDeque<Op> {
        let mut q = self.queue();
        self.queued.store(0, Ordering::Release);
        std::mem::take(&mut q.ops)
    }

    /// Records how many work requests are posted, for readers without the
    /// lock.
    fn sync(&self, st: &SideState) {
        let n = st.sq.as_ref().map_or(0, |sq| sq.outstanding());
        self.posted.store(n, Ordering::Release);
    }

    /// Whether anything is posted or queued (without the state lock).
    pub(crate) fn busy(&self) -> bool {
        self.posted.load(Ordering::Acquire) > 0 || self.queued.load(Ordering::Acquire) > 0
    }

    pub(crate) async fn lock(&self) -> PollGuard<'_, SideState> {
        self.state.lock().await
    }

    /// Marks the queue pair failed (the first cause is kept) and wakes
    /// its task, which shuts it down.
    fn fail(&self, st: &mut SideState, e: Error) {
        if st.broken.is_none() {
            st.broken = Some(e);
        }
        self.kick.notify_one();
    }

    /// Takes `spec`: when nothing else is posted or waiting and no caller
    /// polls, posts it at once and makes its caller the poller (who polls
    /// in [`SideCore::wait`] for its answer in the state's [`LoneAnswer`]);
    /// otherwise queues it for the task, which posts and polls for it (the
    /// answer comes by a channel). A small READ into the queue pair's own
    /// buffer ([`Local::Small`]) is taken only on the first way, when that
    /// buffer is free, and given back otherwise ([`NotTaken`]).
    pub(crate) fn submit(&self, spec: OpSpec) -> Result<Answer<'_>, NotTaken> {
        let alone = self.budget() != Some(Duration::ZERO)
            && self.queued.load(Ordering::Acquire) == 0
            && self.posted.load(Ordering::Acquire) == 0
            && !self.polling.swap(true, Ordering::Acquire);
        if !alone {
            return self.queue_for_task(self.queue(), spec);
        }
        let Some(mut st) = self.state.try_lock() else {
            // The task holds it (posting or polling): it takes this one too.
            self.polling.store(false, Ordering::Release);
            return self.queue_for_task(self.queue(), spec);
        };
        // Checked under the state lock: the shutdown marks the state ended
        // under it, and answers whatever is posted by then.
        if st.ended || st.broken.is_some() {
            self.polling.store(false, Ordering::Release);
            return Err(NotTaken::Closed(Box::new(spec)));
        }
        let direct = st.waiting.is_empty()
            && st.inflight.len() < SIDE_DEPTH as usize
            && (!matches!(spec.local, Local::Small)
                || st.sq.as_ref().is_some_and(SideQp::small_free));
        if !direct && matches!(spec.local, Local::Small) {
            drop(st);
            self.polling.store(false, Ordering::Release);
            return Err(NotTaken::NeedsBuffer(Box::new(spec)));
        }
        if self.lone_busy.swap(true, Ordering::Acquire) {
            // The last lone operation's caller has not taken its answer
            // yet (it stopped polling): the task takes this one.
            drop(st);
            self.polling.store(false, Ordering::Release);
            return self.queue_for_task(self.queue(), spec);
        }
        let seq = st.lone.start();
        let rx = LoneReceiver { core: self, seq };
        let op = Op {
            spec,
            reply: Reply::Lone(seq),
        };
        let posted = if direct {
            st.post_op(op)
        } else {
            st.waiting.push_back(op);
            st.post_waiting()
        };
        if let Err(e) = posted {
            // What was not posted is answered (flushed) by the shutdown.
            self.fail(&mut st, e);
        }
        self.sync(&st);
        Ok(Answer::Lone(rx))
    }

    /// Queues `spec` for the task (`q` is the queue, locked), answered by a
    /// channel; `Err` when the queue pair takes no more operations, or
    /// `spec` needs a buffer of its own.
    fn queue_for_task(
        &self,
        mut q: MutexGuard<'_, Queue>,
        spec: OpSpec,
    ) -> Result<Answer<'_>, NotTaken> {
        if matches!(spec.local, Local::Small) {
            return Err(NotTaken::NeedsBuffer(Box::new(spec)));
        }
        if q.closed {
            return Err(NotTaken::Closed(Box::new(spec)));
        }
        let (tx, rx) = oneshot::channel();
        q.ops.push_back(Op {
            spec,
            reply: Reply::Chan(tx),
        });
        self.queued.store(q.ops.len(), Ordering::Release);
        drop(q);
        self.kick.notify_one();
        Ok(Answer::Chan(rx))
    }

    /// Posts what callers queued (unless the queue pair is ending).
    pub(crate) fn post_queued(&self, st: &mut SideState) {
        if st.ended || st.broken.is_some() {
            return;
        }
        if self.queued.load(Ordering::Acquire) > 0 {
            st.waiting.extend(self.take_queued());
        }
        if st.waiting.is_empty() {
            return;
        }
        if let Err(e) = st.post_waiting() {
            self.fail(st, e);
        }
        self.sync(st);
    }

    /// How long a waiter polls: `None` for as long as it takes (`Spin`).
    fn budget(&self) -> Option<Duration> {
        match self.mode {
            PollMode::Spin => None,
            PollMode::Adaptive | PollMode::Fixed => Some(self.busy_poll),
        }
    }

    /// Polls the CQ until it is empty, answering what completed, and posts
    /// what waits; the number of completions. A failure marks the queue
    /// pair failed for its task.
    pub(crate) fn poll_locked(&self, st: &mut SideState) -> usize {
        let n = self.poll_cq(st);
        self.wake_lone(st);
        n
    }

    /// Wakes the lone operation's caller if its answer was put while it
    /// sleeps. (Its caller sets `lone_asleep` before it looks under the
    /// lock, and the answer is put under the lock: either it finds the
    /// answer, or this sees it asleep.)
    pub(crate) fn wake_lone(&self, st: &mut SideState) {
        if std::mem::take(&mut st.lone_put) && self.lone_asleep.load(Ordering::SeqCst) {
            self.lone_ready.notify_one();
        }
    }

    /// [`Self::poll_locked`] but for waking the lone operation's caller.
    fn poll_cq(&self, st: &mut SideState) -> usize {
        if st.broken.is_some() || st.sq.is_none() {
            return 0;
        }
        let mut total = 0;
        loop {
            st.wcs.clear();
            let n = match self.cq.poll(&mut st.wcs, POLL_BATCH) {
                Ok(n) => n,
                Err(e) => {
                    self.fail(st, e);
                    return total;
                }
            };
            total += n;
            if let Err(e) = st.complete(self.gen) {
                self.fail(st, e);
                return total;
            }
            // Fewer than asked for: the CQ was empty (one poll, not two,
            // for a lone operation).
            if n < POLL_BATCH {
                break;
            }
        }
        if total > 0 && !st.ended {
            if let Err(e) = st.post_waiting() {
                self.fail(st, e);
            }
        }
        self.sync(st);
        total
    }

    /// Waits for the answer of an operation this caller submitted (§10.5);
    /// `None` if it was dropped unanswered (a runtime shutting down).
    /// The poller ([`SideCore::submit`]) polls the CQ itself (`Spin`: until
    /// its answer comes; otherwise for `busy_poll`), letting the runtime
    /// run other tasks every few polls; the others, and a poller that
    /// stops with operations still posted, leave the wait to the task and
    /// sleep. If a poller's future is dropped, the task takes the wait
    /// over, so a posted buffer is always collected.
    pub(crate) async fn wait(&self, answer: Answer<'_>) -> Option<OpResult> {
        let rx = match answer {
            Answer::Chan(rx) => return rx.await.ok(),
            Answer::Lone(rx) => rx,
        };
        let budget = self.budget();
        let mut handover = Handover {
            core: self,
            kick: true,
        };
        // Read the clock only with a budget: in a VM a clock read can be a
        // system call.
        let start = budget.map(|_| Instant::now());
        let mut polls: u32 = 0;
        loop {
            if let Some(mut st) = self.state.try_lock() {
                // The task may have answered it while this caller yielded.
                if let Some(r) = st.lone.take(rx.seq) {
                    handover.kick = false;
                    return Some(r);
                }
                if st.ended || st.broken.is_some() {
                    break;
                }
                self.poll_locked(&mut st);
                if let Some(r) = st.lone.take(rx.seq) {
                    handover.kick = false;
                    return Some(r);
                }
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(POLLS_PER_YIELD) {
                if let (Some(b), Some(start)) = (budget, start) {
                    if start.elapsed() >= b {
                        break;
                    }
                }
                YieldBack(false).await;
            }
            std::hint::spin_loop();
        }
        drop(handover);
        self.sleep_for(&rx).await
    }

    /// Waits asleep for the answer of the lone operation `rx` (its caller
    /// stopped polling: the task polls for it); `None` if the queue pair
    /// was shut down without answering it (the shutdown answers every
    /// operation, so only a fault of ours could).
    async fn sleep_for(&self, rx: &LoneReceiver<'_>) -> Option<OpResult> {
        self.lone_asleep.store(true, Ordering::SeqCst);
        loop {
            let n = self.lone_ready.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            {
                let mut st = self.state.lock().await;
                if let Some(r) = st.lone.take(rx.seq) {
                    return Some(r);
                }
                if st.ended && st.sq.is_none() {
                    // Destroyed, and everything answered under the same
                    // lock (`SideTask::shutdown`).
                    return None;
                }
            }
            n.await;
        }
    }
}

/// Why [`SideCore::submit`] gave an operation back.
pub(crate) enum NotTaken {
    /// The queue pair no longer takes operations (its task is shutting it
    /// down).
    Closed(Box<OpSpec>),
    /// A small READ ([`Local::Small`]) that cannot use the queue pair's own
    /// buffer now: it needs a local buffer.
    NeedsBuffer(Box<OpSpec>),
}

/// How a caller of [`SideCore::submit`] gets its answer.
pub(crate) enum Answer<'a> {
    /// It polls, and finds the answer in the state's [`LoneAnswer`].
    Lone(LoneReceiver<'a>),
    /// The side task answers by this channel.
    Chan(oneshot::Receiver<OpResult>),
}

/// The caller of the lone operation `seq`: while it lives no other lone
/// operation starts. An answer it did not take (its future was dropped)
/// stays in the state until the next lone operation starts, which drops it
/// (and with it the local buffer, whose completion was polled).
pub(crate) struct LoneReceiver<'a> {
    core: &'a SideCore,
    seq: u64,
}

impl Drop for LoneReceiver<'_> {
    fn drop(&mut self) {
        self.core.lone_asleep.store(false, Ordering::SeqCst);
        self.core.lone_busy.store(false, Ordering::Release);
    }
}

/// The polling caller's turn ([`SideCore::wait`]): when it ends, another
/// caller may poll; and the wait of what is still posted goes to the side
/// task (always when the caller stopped before its answer came, including
/// a dropped future; otherwise only if other operations are posted).
struct Handover<'a> {
    core: &'a SideCore,
    /// Stopped before its answer came.
    kick: bool,
}

impl Drop for Handover<'_> {
    fn drop(&mut self) {
        self.core.polling.store(false, Ordering::Release);
        if self.kick || self.core.busy() {
            self.core.kick.notify_one();
        }
    }
}

/// Lets the runtime run the other ready tasks once: wakes its own task and
/// returns `Pending`, which puts the task at the back of its worker's run
/// queue. Not `tokio::task::yield_now`: that parks the task in the worker's
/// deferred list until the worker next looks for I/O, and with several
/// operations in flight a polling caller parked there was seen to wait
/// seconds.
struct YieldBack(bool);

impl std::future::Future for YieldBack {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.0 {
            return std::task::Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}
