//! The per-connection driver task (§8): it owns the connection's QP, CQs,
//! event channel and (through the shared core) its engine and memory from
//! the handshake to the teardown; it polls completions and feeds them to
//! the engine, delivers messages, sends keepalives and setup kicks, gives
//! idle memory back, and frees everything, QP before memory.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::rdma_cm_event_type as ev;
use tokio::sync::{mpsc, oneshot};

use super::admission::Admission;
use super::events::{event_name, next_event, CmFd, CqFd};
use super::halves::{RecvHalf, SendHalf};
use super::resources::Resources;
use super::shared::{Cmd, Core, Item, Shared, QUEUED_MSG_OVERHEAD};
use super::spin::{Ended, SpinBudget};
use super::{engine_err, io_err, Connection};
use crate::config::{Config, PollMode};
use crate::engine::wire::{Hello, Ticket};
use crate::engine::{Completion, Engine, EngineCounters, EngineError, Event, TimerConfig, WR_RECV};
use crate::error::Error;
use crate::mem::WR_BIND;
use crate::remote::RemoteShared;
use crate::stats::ConnStats;
use crate::verbs::cm::{CmId, EventChannel};
use crate::verbs::{async_fd, Cq, Wc};

#[allow(clippy::too_many_arguments)]
pub(super) fn spawn_driver(
    chan: Arc<EventChannel>,
    cm_afd: CmFd,
    id: Arc<CmId>,
    res: Resources,
    mut engine: Engine,
    cfg: Config,
    peer: SocketAddr,
    peer_hello: Hello,
    admission: Option<Admission>,
    ticket: Option<Ticket>,
    active: bool,
    remote: Arc<RemoteShared>,
) -> Result<Connection, Error> {
    let cq_afd = async_fd(res.cq.clone())?;
    let shared_receive = res.mem.is_shared();
    let (tx, cmd_rx) = mpsc::channel(cfg.send_queue_messages.max(1));
    let (deliver_tx, rx) = mpsc::unbounded_channel();
    let chunk = engine.config().chunk_bytes();
    // §2.3 step 6, §4.4, §4.5, §5.5: the engine's clock-driven policy.
    let start = tokio::time::Instant::now();
    engine.start_clock(
        start.into_std(),
        TimerConfig {
            keepalive: cfg.keepalive,
            idle_release: cfg.memory_idle_release,
            setup_kicks: active,
            recv_queue_bytes: cfg.recv_queue_bytes,
        },
    );
    let core = Core {
        engine,
        mem: res.mem,
        actions: Vec::with_capacity(64),
        failed: None,
        room_wanted: false,
    };
    let shared = Arc::new(Shared::new(
        cfg.recv_queue_bytes,
        core,
        cfg.send_queue_messages,
    ));
    let stats = Arc::new(ConnStats::default());
    stats.bump(|s| &s.connections, 1);
    if shared_receive {
        stats.bump(|s| &s.shared_receive_connections, 1);
    }
    let max = cfg.max_message_bytes.min(peer_hello.max_message as usize);
    let timer = Box::pin(tokio::time::sleep_until(start));
    let spin = SpinBudget::new(cfg.poll_mode, cfg.busy_poll);
    let d = Driver {
        cm_afd,
        cq_afd,
        cq: res.cq,
        send_cq: res.send_cq,
        id,
        chan,
        cmd_rx,
        deliver_tx,
        events: Vec::new(),
        shared: shared.clone(),
        stats: stats.clone(),
        last: EngineCounters::default(),
        cfg,
        cmd_open: true,
        recv_open: true,
        close_waiters: Vec::new(),
        peer_gone: false,
        wcs: Vec::with_capacity(64),
        timer,
        woke_receiver: false,
        spin,
        remote: remote.clone(),
        accepted: !active,
        _admission: admission,
    };
    tokio::spawn(d.run());
    Ok(Connection {
        send: SendHalf {
            tx,
            shared: shared.clone(),
            max,
            chunk,
            closed: false,
        },
        recv: RecvHalf {
            rx,
            shared,
            done: false,
        },
        peer,
        stats,
        ticket,
        remote,
    })
}

/// The per-connection task (§8). The engine, the QP and the memory live in
/// `shared.core` ([`Core`]); the driver takes them out and frees them at
/// teardown (or when it is dropped), QP before memory (`ConnMemory`'s
/// drop order); the QP holds its CQ, PD and cm_id alive until then.
struct Driver {
    cm_afd: CmFd,
    cq_afd: CqFd,
    /// Receive completions (the driver sleeps on these).
    cq: Arc<Cq>,
    /// Send completions: polled with the receive CQ, armed only while the
    /// engine waits for one (`Engine::wants_send_completions`).
    send_cq: Arc<Cq>,
    id: Arc<CmId>,
    chan: Arc<EventChannel>,
    cmd_rx: mpsc::Receiver<Cmd>,
    deliver_tx: mpsc::UnboundedSender<Item>,
    /// Reused buffer for the engine's events of one step.
    events: Vec<Event>,
    shared: Arc<Shared>,
    stats: Arc<ConnStats>,
    last: EngineCounters,
    cfg: Config,
    cmd_open: bool,
    recv_open: bool,
    close_waiters: Vec<oneshot::Sender<()>>,
    peer_gone: bool,
    wcs: Vec<Wc>,
    /// Sleeps until the engine's next deadline (`Engine::poll_timeout`:
    /// setup kick, keepalive, idle release).
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// A message was handed to the `RecvHalf` since the driver last yielded
    /// (§8: yield before busy-polling, so the task it woke can run on this
    /// worker first).
    woke_receiver: bool,
    /// The busy-poll budget (§8, `Config::poll_mode`).
    spin: SpinBudget,
    /// One-sided access (§10): closed with the connection.
    remote: Arc<RemoteShared>,
    /// A listener accepted this connection (`cq_events_accepted`).
    accepted: bool,
    /// Listener side: this connection's count against its source address
    /// (`Config::max_connections_per_address`); last, so it is released
    /// only after the memory above was freed.
    _admission: Option<Admission>,
}

impl Driver {
    async fn run(mut self) {
        let r = self.main_loop().await;
        if let Err(e) = r {
            tracing::debug!("rdma connection failed: {e}");
            if let Ok(mut g) = self.shared.error.lock() {
                *g = Some(e.clone());
            }
            self.deliver(Item::Err(e));
        }
        self.teardown().await;
    }

    fn take_cmds(&mut self) -> bool {
        let mut did = false;
        while self.cmd_open {
            match self.cmd_rx.try_recv() {
                Ok(c) => {
                    self.handle_cmd(Some(c));
                    did = true;
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.handle_cmd(None);
                    did = true;
                }
            }
        }
        did
    }

    fn handle_cmd(&mut self, c: Option<Cmd>) {
        let mut g = self.shared.core();
        let Some(core) = g.as_mut() else { return };
        match c {
            Some(Cmd::Close(w)) => {
                self.close_waiters.push(w);
                core.engine.close();
                self.cmd_open = false;
            }
            None => {
                // SendHalf dropped without close: implicit close (§6).
                core.engine.close();
                self.cmd_open = false;
            }
        }
    }

    /// Polls the CQs until empty, feeding the engine. With `until_error`,
    /// stops at the first failed completion without reporting it (used
    /// after a disconnect to salvage messages that did arrive).
    fn poll_cq(&mut self, until_error: bool) -> Result<usize, Error> {
        self.poll_cqs(until_error, true)
    }

    /// The busy-poll's look (§8): the receive CQ, and the send CQ only while
    /// the engine waits for a send completion. Otherwise send completions
    /// wait for the next full poll, as they do while the driver sleeps
    /// (their CQ is not armed then either); a failed send still shows at
    /// once, since it flushes the receive queue into the receive CQ (not
    /// with a shared receive queue, §4.7: there it shows at the next send
    /// completion polled, at the latest the keepalive's).
    fn poll_cq_spin(&mut self) -> Result<usize, Error> {
        self.poll_cqs(false, false)
    }

    /// `all_sends`: poll the send CQ whether or not the engine waits for it.
    fn poll_cqs(&mut self, until_error: bool, all_sends: bool) -> Result<usize, Error> {
        let mut g = self.shared.core();
        let Some(core) = g.as_mut() else {
            return Err(Error::Disconnected);
        };
        // Send completions first: they free slots for what the receives
        // will want to post. On iWARP both are one CQ: polled once.
        let separate = !Arc::ptr_eq(&self.send_cq, &self.cq);
        let mut sends = separate && (all_sends || core.engine.wants_send_completions());
        let mut total = 0;
        if sends {
            let (n, stop) = drain(&self.send_cq, &mut self.wcs, core, until_error)?;
            total += n;
            if stop {
                return Ok(total);
            }
        }
        loop {
            self.wcs.clear();
            let n = self.cq.poll(&mut self.wcs, 32)?;
            if n == 0 {
                return Ok(total);
            }
            total += n;
            if separate && !sends && self.wcs.iter().any(|w| w.status != 0) {
                // A failed receive is usually the flush that follows a
                // failed send: take the send CQ first, so the error
                // reported is the cause (rare path: the batch is copied).
                sends = true;
                let batch = self.wcs.clone();
                let (m, stop) = drain(&self.send_cq, &mut self.wcs, core, until_error)?;
                total += m;
                if stop || feed(core, &batch, until_error)? {
                    return Ok(total);
                }
            } else if feed(core, &self.wcs, until_error)? {
                return Ok(total);
            }
            if n < 32 {
                return Ok(total);
            }
        }
    }

    /// Lets the engine post what it can and delivers events.
    fn step(&mut self) -> Result<(), Error> {
        let mut g = self.shared.core();
        let Some(core) = g.as_mut() else {
            return Err(Error::Disconnected);
        };
        if let Some(e) = core.failed.take() {
            return Err(e);
        }
        // §4.5: an application that does not read holds back the peer.
        core.engine
            .note_backlog(self.shared.queued.load(Ordering::Acquire), self.recv_open);
        core.post()?;
        let mut events = std::mem::take(&mut self.events);
        while let Some(e) = core.engine.next_event() {
            events.push(e);
        }
        let now = core.engine.counters;
        // Most steps of a spin change nothing: no atomic updates then.
        if now != self.last {
            self.stats.add_delta(&now, &self.last);
            self.last = now;
        }
        let confirmed = core.engine.close_confirmed();
        // Back-pressure released: wake the senders waiting for room (a
        // sender that found the queue full said so under this lock, after
        // registering its wait).
        let room = core.room_wanted && core.engine.pending_msgs() < self.shared.send_limit;
        if room {
            core.room_wanted = false;
        }
        drop(g);
        // Delivered without the core lock: an inline handler may send.
        for e in events.drain(..) {
            self.deliver(match e {
                Event::Message(b) => Item::Msg(b),
                Event::PeerClosed => Item::Closed,
            });
        }
        self.events = events;
        if room {
            self.shared.room.notify_waiters();
        }
        if confirmed {
            for w in self.close_waiters.drain(..) {
                let _ = w.send(());
            }
        }
        Ok(())
    }

    /// Hands one item to the inline handler, or queues it for the `RecvHalf`.
    fn deliver(&mut self, item: Item) {
        if !self.recv_open {
            return;
        }
        let mut g = self.shared.inline();
        if let Some(inl) = g.as_mut() {
            let r = match item {
                Item::Msg(b) => Ok(Some(b)),
                Item::Closed => Ok(None),
                Item::Err(e) => Err(e),
            };
            let end = !matches!(r, Ok(Some(_)));
            if !(inl.handler)(r) || end {
                // Dropping it closes the channel: the receiving side is gone.
                *g = None;
                self.recv_open = false;
            }
            self.woke_receiver = true;
            return;
        }
        // Queued under the same lock: a handler installed meanwhile
        // (`deliver_inline`, which drains the queue under it first) would
        // otherwise never see this item, left in a queue nobody reads.
        if let Item::Msg(b) = &item {
            self.shared
                .queued
                .fetch_add(b.len() + QUEUED_MSG_OVERHEAD, Ordering::AcqRel);
        }
        if self.deliver_tx.send(item).is_err() {
            self.recv_open = false;
        } else {
            self.woke_receiver = true;
        }
        drop(g);
    }

    /// Runs `f` on the engine (`None` once the connection was torn down).
    fn with_engine<T>(&self, f: impl FnOnce(&mut Engine) -> T) -> Option<T> {
        self.shared.core().as_mut().map(|c| f(&mut c.engine))
    }

    /// §6: both directions done and the peer confirmed our CLOSE, so no
    /// data of ours can still be in flight (iWARP completes SENDs locally).
    fn finished(&self) -> bool {
        let recv_open = self.recv_open;
        !self.cmd_open
            && self
                .with_engine(|e| e.close_confirmed() && (e.peer_closed() || !recv_open))
                .unwrap_or(true)
    }

    async fn main_loop(&mut self) -> Result<(), Error> {
        const CLOCK_EVERY: u32 = 32;
        let mut spins = 0u32;
        // When the driver last ran out of work (PollMode::Adaptive).
        let mut idle_since: Option<Instant> = None;
        // The driver slept since `idle_since` (Adaptive's wake-up cost).
        let mut slept = false;
        loop {
            let mut did = self.take_cmds();
            if self.poll_cq(false)? > 0 {
                did = true;
            }
            self.step()?;
            if self.finished() {
                return Ok(());
            }
            if self.recv_open && self.deliver_tx.is_closed() {
                self.recv_open = false;
                continue;
            }
            if did {
                let ended = if slept { Ended::Slept } else { Ended::Polled };
                end_idle(&mut idle_since, &mut slept, &mut self.spin, ended);
                spins += 1;
                if spins.is_multiple_of(64) {
                    tokio::task::yield_now().await;
                }
                continue;
            }
            if idle_since.is_none() && self.spin.sample_now() {
                idle_since = Some(Instant::now());
            }
            // Busy-poll before sleeping (§8); the clock is read every
            // CLOCK_EVERY polls only (a syscall where there is no vDSO clock).
            let budget = self.spin.budget();
            // §8: before spinning, let the task just handed a message run
            // first (it is in this worker's LIFO slot, which no other worker
            // may steal), then look again for its reply. Not when about to
            // sleep: sleeping lets it run anyway, and a yield costs a
            // reschedule.
            if !budget.is_zero() && std::mem::take(&mut self.woke_receiver) {
                tokio::task::yield_now().await;
                continue;
            }
            self.woke_receiver = false;
            if !budget.is_zero() {
                let start = idle_since.unwrap_or_else(Instant::now);
                let mut got = false;
                let mut n = 0u32;
                let mut last: Option<Instant> = None;
                loop {
                    if self.poll_cq_spin()? > 0 || (self.cmd_open && !self.cmd_rx.is_empty()) {
                        got = true;
                        break;
                    }
                    n += 1;
                    if n.is_multiple_of(CLOCK_EVERY) {
                        if self.cfg.poll_mode == PollMode::Spin {
                            break;
                        }
                        let now = Instant::now();
                        if now.duration_since(start) >= budget {
                            break;
                        }
                        // §8: the CPU cap. A spin whose yields come back
                        // late shares its core with other work (this
                        // worker ran other tasks, or the host took the
                        // CPU): it stops and the driver sleeps, leaving
                        // the core to that work.
                        if let Some(l) = last.replace(now) {
                            if self.spin.contended(now.duration_since(l)) {
                                break;
                            }
                        }
                        // §8: spin cooperatively. Every CLOCK_EVERY polls,
                        // let what else is ready on this worker run (the
                        // task that will send the next message may be one
                        // of them: on a current_thread runtime a spin that
                        // never yields waits out its whole budget for it).
                        tokio::task::yield_now().await;
                    }
                    std::hint::spin_loop();
                }
                if got {
                    end_idle(&mut idle_since, &mut slept, &mut self.spin, Ended::Polled);
                    self.step()?;
                    continue;
                }
                self.spin.missed();
            }
            let spin = self.cfg.poll_mode == PollMode::Spin;
            if !spin {
                // Arm, then poll again: a completion that arrived before the
                // arm would otherwise never raise an event (lost wakeup).
                self.cq.arm()?;
                // Send completions wake the driver only when the engine
                // waits for one (a slot, a staging buffer, SQ room, the
                // CLOSE flush); otherwise they are collected with the next
                // receive.
                if !Arc::ptr_eq(&self.send_cq, &self.cq)
                    && self
                        .with_engine(|e| e.wants_send_completions())
                        .unwrap_or(true)
                {
                    self.send_cq.arm()?;
                }
                if self.poll_cq(false)? > 0 {
                    end_idle(&mut idle_since, &mut slept, &mut self.spin, Ended::Polled);
                    self.step()?;
                    continue;
                }
            }
            let cmds = self.cmd_open;
            // One look under the core lock: receive back-pressure (§4.5),
            // and the engine's next deadline (setup kick, keepalive, idle
            // release; no clock read).
            let (holding, next) = self
                .with_engine(|e| (e.holding_returns(), e.poll_timeout()))
                .unwrap_or((false, None));
            if let Some(at) = next.map(tokio::time::Instant::from_std) {
                if self.timer.deadline() != at {
                    self.timer.as_mut().reset(at);
                }
            }
            slept = true;
            tokio::select! {
                biased;
                r = self.cq_afd.readable(), if !spin => {
                    let mut g = r.map_err(|e| io_err("AsyncFd(cq)", e))?;
                    let n = self.cq.consume_events()?;
                    self.stats.bump(|s| &s.cq_events, n as u64);
                    if self.accepted {
                        crate::stats::GLOBAL
                            .cq_events_accepted
                            .fetch_add(n as u64, Ordering::Relaxed);
                    }
                    g.clear_ready();
                    end_idle(&mut idle_since, &mut slept, &mut self.spin, Ended::Slept);
                }
                c = self.cmd_rx.recv(), if cmds => {
                    self.handle_cmd(c);
                    end_idle(&mut idle_since, &mut slept, &mut self.spin, Ended::Slept);
                }
                e = next_event(&self.chan, &self.cm_afd) => {
                    let e = e?;
                    match e.kind {
                        ev::RDMA_CM_EVENT_DISCONNECTED | ev::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                            self.peer_gone = true;
                            // Salvage messages that arrived before the disconnect.
                            self.poll_cq(true)?;
                            self.step()?;
                            // Clean if the peer closed and so did we (the peer
                            // only disconnects after confirming our CLOSE).
                            let recv_open = self.recv_open;
                            let clean = self
                                .with_engine(|e| {
                                    (e.peer_closed() || !recv_open) && e.close_flushed()
                                })
                                .unwrap_or(false);
                            if self.finished() || (clean && !self.cmd_open) {
                                return Ok(());
                            }
                            return Err(Error::Disconnected);
                        }
                        k => tracing::debug!("ignoring cm event {}", event_name(k)),
                    }
                }
                _ = self.timer.as_mut(), if next.is_some() => {
                    let now = tokio::time::Instant::now().into_std();
                    let fired = self.shared.core().as_mut().map(|c| {
                        let Core { engine, mem, .. } = c;
                        engine.handle_timeout(now, mem)
                    });
                    if let Some(f) = fired {
                        self.stats.bump(|s| &s.setup_kicks, u64::from(f.setup_kick));
                        self.stats.bump(|s| &s.keepalives, u64::from(f.keepalive));
                    }
                    // The next turn's step() posts what it queued.
                }
                _ = self.deliver_tx.closed(), if self.recv_open => {
                    self.recv_open = false;
                }
                _ = self.shared.drained.notified(), if holding => {
                    // The application caught up: step() releases the returns.
                }
                _ = self.shared.kick.notified() => {
                    // A SendHalf's post failed (step() reports it), or left
                    // a message queued: the next turn arms the send CQ.
                }
                _ = tokio::task::yield_now(), if spin => {
                    // PollMode::Spin: nothing else is ready; poll the CQ again.
                }
            }
        }
    }

    /// §8 teardown: disconnect, QP to error, drain flushed completions
    /// (bounded), then free everything (QP before memory).
    async fn teardown(mut self) {
        // §10.3: the side queue pair goes with the connection.
        self.remote.close();
        if !self.peer_gone {
            let _ = self.id.disconnect();
        }
        // The inline handler may hold the application's state (which holds
        // our SendHalf): drop it here, not when the last Arc goes.
        let inline = self.shared.inline().take();
        drop(inline);
        // From here no SendHalf can post: it finds the core gone.
        let Some(mut core) = self.shared.core().take() else {
            return;
        };
        // A SendHalf waiting for room (back-pressure) registered its wait
        // before it looked at the core: wake it to find the core gone and
        // return the connection's error, instead of waiting for ever.
        self.shared.room.notify_waiters();
        if let Some(qp) = core.mem.qp() {
            let _ = qp.to_error();
        }
        let deadline = Instant::now() + Duration::from_millis(200);
        // With a shared receive queue (§4.7) the QP has no receives of its
        // own to flush, at most the one SRQ buffer it had taken.
        let recvs = if core.mem.is_shared() {
            0
        } else {
            self.cfg.recv_slots as usize
        };
        let expect = recvs + core.engine.outstanding_sq();
        let mut seen = 0;
        'drain: while Instant::now() < deadline && seen < expect {
            let mut got = 0;
            for cq in [&self.send_cq, &self.cq] {
                self.wcs.clear();
                match cq.poll(&mut self.wcs, 32) {
                    Ok(n) => got += n,
                    Err(_) => break 'drain,
                }
                // A flushed SRQ buffer goes back to the pool (§4.7).
                core.mem.reclaim(&self.wcs);
            }
            if got == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            seen += got;
        }
        let _ = self.cq.consume_events();
        for w in self.close_waiters.drain(..) {
            let _ = w.send(());
        }
        core.mem.destroy_qp();
        drop(core);
        // Remaining fields drop in declaration order.
    }
}

impl Drop for Driver {
    /// A driver dropped without its teardown (runtime shut down) still
    /// frees the QP and memory now, not when the last half goes.
    fn drop(&mut self) {
        self.remote.close();
        let inline = self.shared.inline().take();
        drop(inline);
        let core = self.shared.core().take();
        drop(core);
    }
}

/// Ends the current idle period: its wait, if it was timed, goes to the
/// spin budget (`PollMode::Adaptive`, §8) as ended by `ended`.
fn end_idle(
    idle_since: &mut Option<Instant>,
    slept: &mut bool,
    spin: &mut SpinBudget,
    ended: Ended,
) {
    if let Some(t) = idle_since.take() {
        spin.note(t.elapsed(), ended);
    }
    *slept = false;
}

/// Polls `cq` until empty into `wcs`, feeding `core`'s engine. Returns the
/// count and whether [`feed`] stopped at a failed completion.
fn drain(
    cq: &Cq,
    wcs: &mut Vec<Wc>,
    core: &mut Core,
    until_error: bool,
) -> Result<(usize, bool), Error> {
    let mut total = 0;
    loop {
        wcs.clear();
        let n = cq.poll(wcs, 32)?;
        total += n;
        if n == 0 {
            return Ok((total, false));
        }
        if feed(core, wcs, until_error)? {
            return Ok((total, true));
        }
        if n < 32 {
            return Ok((total, false));
        }
    }
}

/// Feeds completions to the engine. With `until_error`, stops at the first
/// failed one without reporting it (returns true).
fn feed(core: &mut Core, wcs: &[Wc], until_error: bool) -> Result<bool, Error> {
    for wc in wcs {
        let ok = wc.status == 0;
        if !ok && until_error {
            return Ok(true);
        }
        if wc.wr_id >> 56 == WR_BIND {
            // §4.7: the bind of the rendezvous region's window, posted by
            // ConnMemory, not the engine.
            if ok {
                continue;
            }
            return Err(engine_err(
                EngineError::Completion {
                    status: wc.status,
                    recv: false,
                },
                "memory window bind",
            ));
        }
        let c = Completion {
            wr_id: core.mem.map_recv(wc.wr_id, ok)?,
            ok,
            status: wc.status,
            byte_len: wc.byte_len,
            imm: wc.imm,
        };
        if let Err(e) = core.engine.on_completion(c, &mut core.mem) {
            let recv = matches!(e, EngineError::Completion { recv: true, .. })
                || wc.wr_id >> 56 == WR_RECV;
            return Err(engine_err(e, if recv { "recv" } else { "send" }));
        }
    }
    Ok(false)
}
