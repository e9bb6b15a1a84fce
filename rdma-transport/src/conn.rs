//! Connection setup over rdma_cm (§2) and the per-connection driver task
//! (§8) that owns the QP, CQ, registered memory and the engine.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdma_sys::rdma_cm_event_type as ev;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot, Notify};

use crate::config::{Config, PollMode};
use crate::engine::wire::{
    Hello, Ticket, HELLO_FLAG_ON_DEMAND, HELLO_FLAG_REVOCABLE, HELLO_FLAG_WRITE_IMM, VERSION,
};
use crate::engine::{
    Action, Completion, Engine, EngineConfig, EngineCounters, EngineError, Event, WR_RECV,
};
use crate::error::{Errno, Error, PeerMisbehaved};
use crate::mem::{ConnMemory, DevicePool, PoolSizes, RecvPool, WR_BIND};
use crate::stats::ConnStats;
use crate::verbs::cm::{CmEvent, CmId, EventChannel, REJECT_PRIVATE_MAX};
use crate::verbs::{async_fd, CompChannel, Cq, FdOwner, Pd, Qp, QpCaps, Wc};

/// IBV_WC_WR_FLUSH_ERR
const WC_FLUSH_ERR: u32 = 5;

/// §2.3 step 6: the active side's first setup kick comes this long after
/// the connection started, and each further one twice as long after the
/// previous one, while nothing was received from the passive side.
const SETUP_KICK_FIRST: Duration = Duration::from_millis(4);
/// §2.3 step 6: no more setup kicks once the interval would exceed this
/// (8 kicks over ~2 s); the keepalive (§4.4) remains the backstop.
const SETUP_KICK_LAST: Duration = Duration::from_secs(1);

pub(crate) type CmFd = AsyncFd<FdOwner<EventChannel>>;
type CqFd = AsyncFd<FdOwner<Cq>>;

fn io_err(verb: &'static str, e: std::io::Error) -> Error {
    Error::Verb {
        verb,
        errno: Errno(e.raw_os_error().unwrap_or(0)),
    }
}

/// Waits for the next cm event on a non-blocking channel.
pub(crate) async fn next_event(chan: &Arc<EventChannel>, afd: &CmFd) -> Result<CmEvent, Error> {
    // Readiness first: the driver rebuilds this future every time it sleeps,
    // and a try_get on an empty channel costs a syscall (EAGAIN) and an
    // allocation. Readiness is only cleared after EAGAIN, so no event is missed.
    loop {
        let mut g = afd.readable().await.map_err(|e| io_err("AsyncFd(cm)", e))?;
        match chan.try_get()? {
            Some(e) => return Ok(e),
            None => g.clear_ready(),
        }
    }
}

fn event_name(k: u32) -> &'static str {
    match k {
        ev::RDMA_CM_EVENT_ADDR_RESOLVED => "ADDR_RESOLVED",
        ev::RDMA_CM_EVENT_ADDR_ERROR => "ADDR_ERROR",
        ev::RDMA_CM_EVENT_ROUTE_RESOLVED => "ROUTE_RESOLVED",
        ev::RDMA_CM_EVENT_ROUTE_ERROR => "ROUTE_ERROR",
        ev::RDMA_CM_EVENT_CONNECT_REQUEST => "CONNECT_REQUEST",
        ev::RDMA_CM_EVENT_CONNECT_ERROR => "CONNECT_ERROR",
        ev::RDMA_CM_EVENT_UNREACHABLE => "UNREACHABLE",
        ev::RDMA_CM_EVENT_REJECTED => "REJECTED",
        ev::RDMA_CM_EVENT_ESTABLISHED => "ESTABLISHED",
        ev::RDMA_CM_EVENT_DISCONNECTED => "DISCONNECTED",
        ev::RDMA_CM_EVENT_DEVICE_REMOVAL => "DEVICE_REMOVAL",
        ev::RDMA_CM_EVENT_TIMEWAIT_EXIT => "TIMEWAIT_EXIT",
        _ => "other",
    }
}

fn status_text(status: i32) -> String {
    if status < 0 {
        format!("{}", Errno(-status))
    } else {
        format!("status {status}")
    }
}

/// Verbs resources of one connection before the driver starts.
pub(crate) struct Resources {
    pub(crate) mem: ConnMemory,
    /// Receive completions: the CQ the driver sleeps on.
    pub(crate) cq: Arc<Cq>,
    /// Send completions, on the same completion channel; armed only while
    /// the engine waits for one (§8), so they do not wake the driver.
    pub(crate) send_cq: Arc<Cq>,
    pub(crate) hello: Hello,
    /// The device is iWARP (no immediate data; a zero-length WRITE still
    /// needs a valid rkey there as far as we know, §4.4).
    pub(crate) iwarp: bool,
}

/// The process-wide block pools, one per device (buffer-ownership.md,
/// "Process-wide block pool"), keyed by device context (librdmacm opens
/// each device once per process): each is created by the first connection
/// on its device and goes with the last one (a `Weak` here). `None`: the
/// device has no memory windows, or its pool could not be created.
static DEVICE_POOLS: Mutex<Vec<(usize, Option<Weak<DevicePool>>)>> = Mutex::new(Vec::new());

/// The entry for `id`'s device in a per-device list (added, as "not created
/// yet", if missing): `None` means the device cannot have one.
fn device_entry<'a, T>(
    list: &'a mut Vec<(usize, Option<Weak<T>>)>,
    id: &CmId,
) -> &'a mut Option<Weak<T>> {
    let ctx = id.verbs() as usize;
    let i = match list.iter().position(|(c, _)| *c == ctx) {
        Some(i) => i,
        None => {
            list.push((ctx, Some(Weak::new())));
            list.len() - 1
        }
    };
    &mut list[i].1
}

/// The pool of `id`'s device, created if needed; `None` where connections
/// keep a PD of their own (`cfg`, iWARP, a device without windows).
fn device_pool(id: &Arc<CmId>, cfg: &Config) -> Option<Arc<DevicePool>> {
    if !cfg.device_pool || !cfg.memory_on_demand || id.is_iwarp() {
        return None;
    }
    let mut pools = DEVICE_POOLS.lock().unwrap_or_else(|p| p.into_inner());
    let entry = device_entry(&mut pools, id);
    if let Some(p) = entry.as_ref()?.upgrade() {
        return Some(p);
    }
    if !crate::verbs::window_support(id) {
        tracing::info!(
            "rdma: the device has no type-2 memory windows; every connection keeps a PD \
             and buffers of its own"
        );
        *entry = None;
        return None;
    }
    match Pd::new(id.clone()) {
        Ok(pd) => {
            let p = Arc::new(DevicePool::new(
                pd,
                cfg.global_max_registered_bytes,
                cfg.device_pool_idle_bytes,
                cfg.memory_idle_release,
            ));
            *entry = Some(Arc::downgrade(&p));
            Some(p)
        }
        Err(e) => {
            tracing::warn!("rdma: no device pool ({e}); this connection keeps a PD of its own");
            None
        }
    }
}

/// The shared receive pools of a listener, one per device (§4.7), in the
/// device pool's PD: each is created by the first connection accepted on
/// its device and goes with the last one (a `Weak` here).
#[derive(Default)]
pub(crate) struct SharedPools {
    /// (device context address, pool); `None`: the device has no SRQ, or
    /// its pool could not be created.
    pools: Mutex<Vec<(usize, Option<Weak<RecvPool>>)>>,
}

impl SharedPools {
    /// The pool for `id`'s device, created if needed; `None` where the
    /// device cannot share receive buffers (or `cfg` says not to).
    fn get(&self, id: &Arc<CmId>, cfg: &Config, dev: &DevicePool) -> Option<Arc<RecvPool>> {
        if !cfg.shared_receive_queue {
            return None;
        }
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let entry = device_entry(&mut pools, id);
        if let Some(p) = entry.as_ref()?.upgrade() {
            return Some(p);
        }
        let Some(max_wr) = crate::verbs::shared_receive_support(id) else {
            tracing::info!(
                "rdma listener: the device has no shared receive queue; \
                 receive rings stay per connection"
            );
            *entry = None;
            return None;
        };
        let max = (cfg.shared_receive_max_buffers as usize).min(max_wr as usize);
        match RecvPool::new(
            id,
            dev.pd().clone(),
            cfg.recv_slot_bytes,
            max,
            cfg.global_max_registered_bytes,
        ) {
            Ok(p) => {
                let p = Arc::new(p);
                *entry = Some(Arc::downgrade(&p));
                Some(p)
            }
            Err(e) => {
                tracing::warn!("rdma listener: no shared receive queue ({e}); receive rings stay per connection");
                None
            }
        }
    }
}

fn build_resources(
    id: &Arc<CmId>,
    cfg: &Config,
    shared: Option<&SharedPools>,
) -> Result<Resources, Error> {
    let dev = device_pool(id, cfg);
    let pool = shared
        .zip(dev.as_ref())
        .and_then(|(s, d)| s.get(id, cfg, d));
    let comp = CompChannel::new(id.clone())?;
    // One more work request on the send queue with a shared pool: the
    // signaled bind of the rendezvous region's window (§4.7).
    let sq_depth = cfg.send_slots + cfg.rendezvous_buffers + 1 + u32::from(pool.is_some());
    // §8: receive and send completions on CQs of their own, one channel,
    // so that send completions need not wake the driver. Not on iWARP:
    // siw (Linux 6.1) then failed to set up connections made at the same
    // time (`ibv_create_cq` EAGAIN, `rdma_create_qp` EINVAL in
    // verbs::eight_connections_concurrently); there one CQ takes both, as
    // before, and every completion wakes the driver.
    let (cq, send_cq) = if id.is_iwarp() {
        let cq = Cq::new(id, comp, (sq_depth + cfg.recv_slots + 16) as i32)?;
        (cq.clone(), cq)
    } else {
        let cq = Cq::new(id, comp.clone(), (cfg.recv_slots + 16) as i32)?;
        (cq, Cq::new(id, comp, (sq_depth + 16) as i32)?)
    };
    let sizes = PoolSizes {
        recv_slots: cfg.recv_slots as usize,
        recv_slot_bytes: cfg.recv_slot_bytes,
        send_slots: cfg.send_slots as usize,
        send_slot_bytes: cfg.recv_slot_bytes,
        rdv_count: cfg.rendezvous_buffers as usize,
        rdv_bytes: cfg.rendezvous_buffer_bytes,
        recv_seg: cfg.recv_slots_at_start() as usize,
        send_seg: cfg.send_slots_at_start() as usize,
    };
    let shared_mem = pool.zip(dev.clone()).and_then(|(pool, dev)| {
        let srq = pool.srq().clone();
        match ConnMemory::new_shared(
            dev,
            pool,
            cq.clone(),
            sizes,
            cfg.global_max_registered_bytes,
            cfg.recv_slots_at_start() as usize,
            cfg.send_slots_at_start() as usize,
        ) {
            Ok(m) => Some((m, srq)),
            Err(e) => {
                // A full pool (shared_receive_max_buffers): this
                // connection gets a ring of its own.
                tracing::info!("rdma listener: {e}; this connection gets its own receive ring");
                None
            }
        }
    });
    let (mut mem, pd, srq) = match shared_mem {
        Some((m, srq)) => {
            let pd = m.pd().clone();
            (m, pd, Some(srq))
        }
        None => {
            let pd = match &dev {
                Some(d) => d.pd().clone(),
                None => Pd::new(id.clone())?,
            };
            let m = ConnMemory::new(
                &pd,
                dev,
                sizes,
                cfg.global_max_registered_bytes,
                cfg.recv_slots_at_start() as usize,
                cfg.send_slots_at_start() as usize,
                !cfg.memory_on_demand,
            )?;
            (m, pd, None)
        }
    };
    let qp = Qp::new(
        id.clone(),
        pd,
        send_cq.clone(),
        cq.clone(),
        QpCaps {
            send_wr: sq_depth,
            recv_wr: cfg.recv_slots,
            inline: cfg.max_inline_bytes,
            srq,
        },
    )?;
    mem.attach_qp(qp);
    // §4.1: every receive slot is posted before connect/accept, so the peer
    // may use all its initial credits as soon as the connection is up.
    let initial: Vec<_> = (0..cfg.recv_slots_at_start())
        .map(|slot| crate::engine::Action::PostRecv {
            slot,
            wr_id: crate::engine::recv_wr_id(slot, 0),
        })
        .collect();
    mem.execute(&initial)?;
    // §5.4: offer chunk notification by WRITE with immediate data where the
    // device has it (not on iWARP).
    let mut flags = if cfg.write_with_imm && !id.is_iwarp() {
        HELLO_FLAG_WRITE_IMM
    } else {
        0
    };
    if cfg.memory_on_demand {
        // §4.7: and we answer a peer's credit revoke.
        flags |= HELLO_FLAG_ON_DEMAND | HELLO_FLAG_REVOCABLE;
    }
    let hello = Hello {
        version: VERSION,
        flags,
        credits: cfg.recv_slots_at_start(),
        recv_slot_bytes: cfg.recv_slot_bytes as u32,
        rdv_count: cfg.rendezvous_buffers,
        rdv_bytes: cfg.rendezvous_buffer_bytes as u32,
        rdv_addr: mem.rdv_addr(),
        rdv_rkey: mem.rdv_rkey(),
        max_message: cfg.max_message_bytes as u64,
    };
    Ok(Resources {
        cq,
        send_cq,
        mem,
        hello,
        iwarp: id.is_iwarp(),
    })
}

fn engine_config(cfg: &Config, res: &Resources, peer: Hello) -> EngineConfig {
    let max_inline = res.mem.qp().map(|q| q.max_inline).unwrap_or(0) as usize;
    EngineConfig {
        recv_slots: cfg.recv_slots,
        initial_recv_slots: cfg.recv_slots_at_start(),
        recv_slot_bytes: cfg.recv_slot_bytes,
        send_slots: cfg.send_slots,
        initial_send_slots: cfg.send_slots_at_start(),
        on_demand: cfg.memory_on_demand,
        send_slot_bytes: cfg.recv_slot_bytes,
        rendezvous_threshold: cfg.rendezvous_threshold_bytes,
        rdv_count: cfg.rendezvous_buffers,
        rdv_bytes: cfg.rendezvous_buffer_bytes,
        rdv_addr: res.mem.rdv_addr(),
        staging_count: cfg.rendezvous_buffers,
        staging_bytes: cfg.rendezvous_buffer_bytes,
        max_message: cfg.max_message_bytes,
        signal_every: cfg.signal_every_eff(),
        max_inline,
        write_imm: res.hello.flags & peer.flags & HELLO_FLAG_WRITE_IMM != 0,
        zero_length_write_any_rkey: !res.iwarp,
        // §4.7: only a shared receive queue can take receives back.
        revoke_idle: res.mem.is_shared(),
        peer,
    }
}

/// The connection's error for an engine failure; `what` names the work
/// request side of a failed completion ("setup", "send", "recv"). A flushed
/// completion means the QP went to the error state: the peer is gone.
fn engine_err(e: EngineError, what: &'static str) -> Error {
    match e {
        EngineError::Protocol(v) => Error::Protocol(v),
        EngineError::Resource(m) => Error::ResourceLimit(m),
        EngineError::Completion { status, .. } if status == WC_FLUSH_ERR => Error::Disconnected,
        EngineError::Completion { status, .. } => Error::Completion {
            status,
            status_str: Cq::status_str(status),
            what,
        },
    }
}

fn ms(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// Connects to a [`Listener`] at `addr` (§2.3, active side).
pub async fn connect(addr: SocketAddr, cfg: &Config) -> Result<Connection, Error> {
    connect_inner(None, addr, cfg, None).await
}

/// As [`connect`], presenting `ticket` to the listener (§2.4): it travels
/// in the connect request's private data, right after the hello. A listener
/// made by [`Listener::bind_gated`] admits the connection only if its gate
/// accepts the ticket, and otherwise rejects it before creating anything
/// for it: then this fails with [`Error::Rejected`] whose `reason` is the
/// gate's text. A listener without a gate ignores the ticket.
///
/// The ticket is sent in clear over the RDMA fabric; it is meant to be
/// obtained over an authenticated channel and used once.
pub async fn connect_with_ticket(
    addr: SocketAddr,
    cfg: &Config,
    ticket: Ticket,
) -> Result<Connection, Error> {
    connect_inner(None, addr, cfg, Some(ticket)).await
}

/// As [`connect`], from the local address `local` (`rdma_resolve_addr` with
/// a source address): for a host with several RDMA addresses, the
/// connection leaves from, and the listener sees, `local`.
pub async fn connect_from(
    local: IpAddr,
    addr: SocketAddr,
    cfg: &Config,
) -> Result<Connection, Error> {
    connect_inner(Some(local), addr, cfg, None).await
}

async fn connect_inner(
    local: Option<IpAddr>,
    addr: SocketAddr,
    cfg: &Config,
    ticket: Option<Ticket>,
) -> Result<Connection, Error> {
    // iWARP (§9): rdma_connect binds a real TCP port, which can collide with
    // a TCP socket already using the same ephemeral port (EADDRINUSE, seen
    // on siw while the same host ran TCP connections); a fresh cm_id picks
    // another port.
    let mut collisions = 0;
    let h = loop {
        match handshake(addr, local, cfg, ticket, |_| {}).await {
            Err(Error::Verb {
                verb: "rdma_connect",
                errno,
            }) if errno.0 == libc::EADDRINUSE && collisions < CONNECT_PORT_RETRIES => {
                collisions += 1;
                tracing::debug!("connect to {addr}: local port in use, retrying ({collisions})");
            }
            r => break r?,
        }
    };
    let ecfg = engine_config(cfg, &h.res, h.peer_hello);
    let mut engine = Engine::new(ecfg).map_err(|e| engine_err(e, "setup"))?;
    let _already_posted = engine.take_actions();
    // §2.3: the active side sends first (iWARP requirement).
    engine.send_initial_credit();
    spawn_driver(
        h.chan,
        h.afd,
        h.id,
        h.res,
        engine,
        cfg.clone(),
        h.peer,
        h.peer_hello,
        None,
        None,
        true,
    )
}

/// §2.3 steps 1-2, active side: a cm_id on its own event channel with
/// address and route resolved (from `local` when given).
pub(crate) async fn resolve(
    addr: SocketAddr,
    local: Option<IpAddr>,
    cfg: &Config,
) -> Result<(Arc<EventChannel>, CmFd, CmId), Error> {
    let chan = EventChannel::new()?;
    let afd = async_fd(chan.clone())?;
    let id = CmId::new(&chan)?;
    let slack = Duration::from_millis(500);

    // §2.3 step 1: address resolution.
    id.resolve_addr(
        local.map(|ip| SocketAddr::new(ip, 0)),
        addr,
        ms(cfg.resolve_timeout),
    )
    .map_err(|e| Error::AddrResolve {
        addr,
        reason: e.to_string(),
    })?;
    let e = tokio::time::timeout(cfg.resolve_timeout + slack, next_event(&chan, &afd))
        .await
        .map_err(|_| Error::Timeout {
            stage: "resolve_addr",
        })??;
    match e.kind {
        ev::RDMA_CM_EVENT_ADDR_RESOLVED => {}
        k => {
            return Err(Error::AddrResolve {
                addr,
                reason: format!("{} ({})", event_name(k), status_text(e.status)),
            })
        }
    }
    // §2.3 step 2: route resolution.
    id.resolve_route(ms(cfg.resolve_timeout))
        .map_err(|e| Error::RouteResolve {
            addr,
            reason: e.to_string(),
        })?;
    let e = tokio::time::timeout(cfg.resolve_timeout + slack, next_event(&chan, &afd))
        .await
        .map_err(|_| Error::Timeout {
            stage: "resolve_route",
        })??;
    match e.kind {
        ev::RDMA_CM_EVENT_ROUTE_RESOLVED => {}
        k => {
            return Err(Error::RouteResolve {
                addr,
                reason: format!("{} ({})", event_name(k), status_text(e.status)),
            })
        }
    }
    Ok((chan, afd, id))
}

/// An established active-side connection before anything was sent on it.
pub(crate) struct Handshake {
    // afd before chan/id: deregistered before the fd is closed.
    pub(crate) afd: CmFd,
    pub(crate) res: Resources,
    pub(crate) id: Arc<CmId>,
    pub(crate) chan: Arc<EventChannel>,
    pub(crate) peer: SocketAddr,
    pub(crate) peer_hello: Hello,
}

/// §2.3 steps 1-4, active side, presenting `ticket` when given (§2.4).
/// `edit_hello` may change the hello we send (only the hostile test peer
/// does, see `crate::testing`).
pub(crate) async fn handshake(
    addr: SocketAddr,
    local: Option<IpAddr>,
    cfg: &Config,
    ticket: Option<Ticket>,
    edit_hello: impl FnOnce(&mut Hello),
) -> Result<Handshake, Error> {
    cfg.validate()?;
    let (chan, afd, id) = resolve(addr, local, cfg).await?;
    let id = Arc::new(id);
    let mut res = build_resources(&id, cfg, None)?;
    edit_hello(&mut res.hello);
    // §2.3 step 3: connect with our hello as private data.
    // rdma_connect blocks on iWARP (siw does a synchronous kernel TCP
    // connect, ~2 min to a dead host), so it runs on the blocking pool and
    // the whole handshake is bounded by connect_timeout.
    let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
    let id2 = id.clone();
    let hello = res.hello;
    // The QP and memory travel with the call, so on timeout they are only
    // freed after the blocked rdma_connect returned (never under it).
    let call = tokio::task::spawn_blocking(move || {
        let r = match &ticket {
            Some(t) => id2.connect(&hello.encode_with_ticket(t)),
            None => id2.connect(&hello.encode()),
        };
        (r, res)
    });
    let (r, res) = match tokio::time::timeout_at(deadline, call).await {
        Ok(Ok(x)) => x,
        Ok(Err(_join)) => return Err(Error::Disconnected),
        Err(_) => return Err(Error::Timeout { stage: "connect" }),
    };
    r.map_err(|e| match e {
        // iWARP connects over TCP synchronously: no listener = ECONNREFUSED.
        Error::Verb { errno, .. } if errno.0 == libc::ECONNREFUSED => Error::Rejected {
            addr,
            status: -errno.0,
            reason: ": connection refused".into(),
        },
        Error::Verb { errno, .. }
            if matches!(
                errno.0,
                libc::EHOSTUNREACH | libc::ENETUNREACH | libc::ETIMEDOUT
            ) =>
        {
            Error::Unreachable {
                addr,
                status: -errno.0,
            }
        }
        e => e,
    })?;
    let e = tokio::time::timeout_at(deadline, next_event(&chan, &afd))
        .await
        .map_err(|_| Error::Timeout { stage: "connect" })??;
    let peer_hello = match e.kind {
        ev::RDMA_CM_EVENT_ESTABLISHED => match Hello::decode_with_ticket(&e.private_data) {
            Ok((h, None)) => h,
            // §2.4: only the connecting side presents a ticket.
            Ok((_, Some(_))) => {
                return Err(Error::Protocol(PeerMisbehaved::HelloTicketFromListener))
            }
            Err(v) => return Err(Error::Protocol(v)),
        },
        ev::RDMA_CM_EVENT_REJECTED => {
            let reason = String::from_utf8(e.private_data.clone())
                .ok()
                .map(|s| s.trim_end_matches('\0').to_string())
                .filter(|s| !s.is_empty() && s.chars().all(|c| !c.is_control()))
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            return Err(Error::Rejected {
                addr,
                status: e.status,
                reason,
            });
        }
        k => {
            // UNREACHABLE, CONNECT_ERROR (or anything unexpected).
            tracing::debug!("connect to {addr}: {} status {}", event_name(k), e.status);
            return Err(Error::Unreachable {
                addr,
                status: e.status,
            });
        }
    };
    let peer = id.peer_addr().unwrap_or(addr);
    Ok(Handshake {
        afd,
        res,
        id,
        chan,
        peer,
        peer_hello,
    })
}

/// A connect request as a listener's admission gate sees it (§2.4).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdmitRequest {
    /// The requesting side's address, as rdma_cm reports it.
    pub peer: Option<SocketAddr>,
    /// The ticket it presented ([`connect_with_ticket`]), if any.
    pub ticket: Option<Ticket>,
}

impl AdmitRequest {
    /// A request from `peer` presenting `ticket` (for testing a gate).
    pub fn new(peer: Option<SocketAddr>, ticket: Option<Ticket>) -> AdmitRequest {
        AdmitRequest { peer, ticket }
    }
}

impl std::fmt::Debug for AdmitRequest {
    /// Does not show the ticket's bytes (they may still be valid).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmitRequest")
            .field("peer", &self.peer)
            .field("ticket", &self.ticket.map(|_| "<ticket>"))
            .finish()
    }
}

/// A listener's admission gate ([`Listener::bind_gated`], §2.4): called for
/// every connect request whose hello is valid, before anything is counted
/// or created for it. `Ok(())` admits the request; `Err(reason)` rejects
/// it, and the connecting side's [`Error::Rejected`] carries `reason`
/// (control characters replaced by spaces, cut to 148 bytes). It runs on
/// the listening task, which takes every connect request in turn, so it
/// must not block.
pub type AdmitGate = Arc<dyn Fn(&AdmitRequest) -> Result<(), String> + Send + Sync>;

/// Accepts RDMA connections (§2.3, passive side).
///
/// A task started by [`Listener::bind`] takes every connect request as it
/// arrives and runs its handshake (resources, `rdma_accept`, wait for
/// ESTABLISHED, bounded by `connect_timeout`) as a task of its own, so
/// handshakes proceed concurrently: a peer that never completes one delays
/// nobody. With [`Listener::bind_gated`], a request the gate refuses is
/// rejected at once, before any limit counts it and before any queue pair
/// or memory is created for it (§2.4). Requests beyond
/// `Config::max_pending_handshakes` (overall or per source address) or
/// `Config::max_connections_per_address` are refused at once with
/// `rdma_reject` and a log line. Completed connections wait for
/// [`Listener::accept`] in a queue of `listen_backlog`. Dropping the listener
/// stops the task and every handshake in progress; their resources are freed
/// as for any connection (`docs/buffer-ownership.md`, Teardown).
pub struct Listener {
    rx: mpsc::Receiver<Result<Connection, Error>>,
    task: tokio::task::JoinHandle<()>,
    limits: Arc<Limits>,
    local: SocketAddr,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Per-source-address accounting of a listener (pending handshakes and
/// connections, pending included).
#[derive(Default)]
struct Limits {
    state: Mutex<LimitState>,
    refused: AtomicUsize,
    /// Requests the admission gate refused (§2.4).
    unauthenticated: AtomicUsize,
}

#[derive(Default)]
struct LimitState {
    pending: usize,
    per_addr: HashMap<IpAddr, AddrCount>,
}

#[derive(Default, Clone, Copy)]
struct AddrCount {
    pending: usize,
    conns: usize,
}

impl Limits {
    /// Counts a new handshake from `ip`, or says which limit refuses it.
    fn admit(self: &Arc<Self>, ip: IpAddr, cfg: &Config) -> Result<Admission, String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let c = st.per_addr.get(&ip).copied().unwrap_or_default();
        let why = if st.pending >= cfg.max_pending_handshakes {
            Some(format!(
                "{} handshakes pending (max_pending_handshakes)",
                st.pending
            ))
        } else if c.pending >= cfg.max_pending_handshakes_per_address {
            Some(format!(
                "{} handshakes pending from {ip} (max_pending_handshakes_per_address)",
                c.pending
            ))
        } else if c.conns >= cfg.max_connections_per_address {
            Some(format!(
                "{} connections from {ip} (max_connections_per_address)",
                c.conns
            ))
        } else {
            None
        };
        if let Some(why) = why {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(why);
        }
        st.pending += 1;
        let e = st.per_addr.entry(ip).or_default();
        e.pending += 1;
        e.conns += 1;
        Ok(Admission {
            limits: self.clone(),
            ip,
            pending: true,
        })
    }
}

/// One admitted connection of a listener: counted against its source
/// address until dropped (by the driver, after teardown freed its memory).
pub(crate) struct Admission {
    limits: Arc<Limits>,
    ip: IpAddr,
    pending: bool,
}

impl Admission {
    /// The handshake completed: no longer pending, still a connection.
    fn established(&mut self) {
        if std::mem::take(&mut self.pending) {
            let mut st = self.limits.state.lock().unwrap_or_else(|p| p.into_inner());
            st.pending -= 1;
            if let Some(c) = st.per_addr.get_mut(&self.ip) {
                c.pending -= 1;
            }
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.established();
        let mut st = self.limits.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = st.per_addr.get_mut(&self.ip) {
            c.conns -= 1;
            if c.conns == 0 {
                st.per_addr.remove(&self.ip);
            }
        }
    }
}

impl Listener {
    /// Binds and listens on `addr` (use port 0 for an ephemeral port), and
    /// starts taking connect requests (see the type's docs). Every request
    /// with a valid hello is admitted (within the limits); a ticket it
    /// presents is not checked ([`Connection::ticket`] still shows it).
    pub async fn bind(addr: SocketAddr, cfg: Config) -> Result<Listener, Error> {
        Listener::bind_inner(addr, cfg, None).await
    }

    /// As [`Listener::bind`], admitting only the connect requests `gate`
    /// accepts (§2.4): it sees each request's source address and the ticket
    /// it presented ([`connect_with_ticket`]) right after the hello is
    /// validated. A refused request is rejected with the gate's reason,
    /// logged, and counted by [`Listener::refused_unauthenticated`]; no
    /// queue pair or memory is created for it, no limit counts it, and
    /// [`Listener::accept`] does not report it.
    pub async fn bind_gated(
        addr: SocketAddr,
        cfg: Config,
        gate: AdmitGate,
    ) -> Result<Listener, Error> {
        Listener::bind_inner(addr, cfg, Some(gate)).await
    }

    async fn bind_inner(
        addr: SocketAddr,
        cfg: Config,
        gate: Option<AdmitGate>,
    ) -> Result<Listener, Error> {
        cfg.validate()?;
        let chan = EventChannel::new()?;
        let afd = async_fd(chan.clone())?;
        let id = CmId::new(&chan)?;
        id.bind(addr).map_err(|e| match e {
            Error::Verb { errno, .. }
                if errno.0 == libc::ENODEV || errno.0 == libc::EADDRNOTAVAIL =>
            {
                Error::NoDevice(format!("rdma_bind_addr({addr}): {errno}"))
            }
            e => e,
        })?;
        id.listen(cfg.listen_backlog)?;
        let local = id.local_addr().unwrap_or(addr);
        let (tx, rx) = mpsc::channel(cfg.listen_backlog.max(1) as usize);
        let limits = Arc::new(Limits::default());
        let task = tokio::spawn(listen_loop(
            ListenState {
                afd,
                chan,
                _id: id,
                cfg,
                local,
                pools: Arc::default(),
                gate,
            },
            limits.clone(),
            tx,
        ));
        Ok(Listener {
            rx,
            task,
            limits,
            local,
        })
    }

    /// The bound address (with the actual port).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next connection whose handshake completed, or the error of one
    /// that failed after it was admitted (a bad hello, no resources, a
    /// handshake timeout...). Requests refused by a limit are not reported
    /// here (only logged, and counted by [`Listener::refused`]).
    pub async fn accept(&mut self) -> Result<Connection, Error> {
        match self.rx.recv().await {
            Some(r) => r,
            // The listening task ended: only if its event channel failed.
            None => Err(Error::Disconnected),
        }
    }

    /// Connect requests refused so far by `max_pending_handshakes`,
    /// `max_pending_handshakes_per_address` or `max_connections_per_address`.
    pub fn refused(&self) -> usize {
        self.limits.refused.load(Ordering::Relaxed)
    }

    /// Connect requests refused so far by the admission gate
    /// ([`Listener::bind_gated`]); not counted by [`Listener::refused`].
    pub fn refused_unauthenticated(&self) -> usize {
        self.limits.unauthenticated.load(Ordering::Relaxed)
    }
}

/// The gate's verdict on `req`; a gate that panics refuses (and the
/// listener goes on).
fn run_gate(gate: &AdmitGate, req: &AdmitRequest) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gate(req))).unwrap_or_else(|_| {
        tracing::error!("rdma listener: the admission gate panicked; request refused");
        Err("unauthenticated: admission check failed".to_string())
    })
}

/// A gate's reason as reject private data (§2.4): control characters
/// replaced by spaces (the connecting side drops a reason holding any), at
/// most [`REJECT_PRIVATE_MAX`] bytes, cut at a character boundary; an empty
/// reason becomes "unauthenticated".
fn reject_reason(why: &str) -> String {
    let mut out = String::with_capacity(why.len().min(REJECT_PRIVATE_MAX));
    for c in why.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > REJECT_PRIVATE_MAX {
            break;
        }
        out.push(c);
    }
    if out.trim().is_empty() {
        return "unauthenticated".to_string();
    }
    out
}

/// What the listening task owns. Field order = drop order: the AsyncFd
/// before the channel it watches.
struct ListenState {
    afd: CmFd,
    chan: Arc<EventChannel>,
    _id: CmId,
    cfg: Config,
    local: SocketAddr,
    pools: Arc<SharedPools>,
    /// The admission gate (§2.4), if any.
    gate: Option<AdmitGate>,
}

/// The listening task: takes CONNECT_REQUESTs (the only events on this
/// channel: an accepted id moves to its own channel at once) and starts
/// each handshake as a task of its own (§2.3 step 3).
async fn listen_loop(
    st: ListenState,
    limits: Arc<Limits>,
    tx: mpsc::Sender<Result<Connection, Error>>,
) {
    // Dropped with this task (Listener dropped): aborts every handshake in
    // progress; each one's resources are freed by their destructors.
    let mut handshakes = tokio::task::JoinSet::new();
    loop {
        let e = tokio::select! {
            e = next_event(&st.chan, &st.afd) => e,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
            _ = tx.closed() => return,
        };
        let e = match e {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("rdma listener on {}: {e}; stopping", st.local);
                let _ = tx.try_send(Err(e));
                return;
            }
        };
        if e.kind != ev::RDMA_CM_EVENT_CONNECT_REQUEST {
            tracing::debug!("listener ignoring cm event {}", event_name(e.kind));
            continue;
        }
        let Some(id) = e.new_id else {
            continue;
        };
        let peer = id.peer_addr();
        let (peer_hello, ticket) = match Hello::decode_with_ticket(&e.private_data) {
            Ok(h) => h,
            Err(v) => {
                id.reject(b"bad hello");
                tracing::debug!("rdma listener: refused {peer:?}: {v}");
                let _ = tx.try_send(Err(Error::Protocol(v)));
                continue;
            }
        };
        // §2.4: the gate decides first, so a refused request is counted by
        // no limit and gets no event channel, queue pair or memory.
        if let Some(gate) = &st.gate {
            if let Err(why) = run_gate(gate, &AdmitRequest { peer, ticket }) {
                limits.unauthenticated.fetch_add(1, Ordering::Relaxed);
                let why = reject_reason(&why);
                let presented = if ticket.is_some() { "a" } else { "no" };
                tracing::warn!(
                    "rdma listener on {}: refused a connection from {} presenting {presented} \
                     ticket: {why}",
                    st.local,
                    peer.map_or_else(|| "?".to_string(), |p| p.to_string()),
                );
                id.reject(why.as_bytes());
                continue;
            }
        }
        let ip = peer.map_or(IpAddr::from([0, 0, 0, 0]), |p| p.ip());
        let admission = match limits.admit(ip, &st.cfg) {
            Ok(a) => a,
            Err(why) => {
                tracing::warn!(
                    "rdma listener on {}: refused a connection from {}: {why}",
                    st.local,
                    peer.map_or_else(|| "?".to_string(), |p| p.to_string())
                );
                id.reject(b"busy: too many connections or handshakes from this address");
                continue;
            }
        };
        // Give the connection its own event channel (§8) before anything
        // else can arrive for it on ours.
        let mut id = id;
        let chan = match EventChannel::new().and_then(|c| id.migrate(&c).map(|_| c)) {
            Ok(c) => c,
            Err(e) => {
                id.reject(b"resources");
                let _ = tx.try_send(Err(e));
                continue;
            }
        };
        let (cfg, local, tx) = (st.cfg.clone(), st.local, tx.clone());
        let pools = st.pools.clone();
        handshakes.spawn(async move {
            let r = setup_passive(id, chan, peer_hello, ticket, cfg, local, admission, pools).await;
            if let Err(e) = &r {
                tracing::debug!("rdma listener on {local}: handshake failed: {e}");
            }
            // Waits while `listen_backlog` connections are not accepted yet;
            // if the listener is gone the connection is dropped (closed).
            let _ = tx.send(r).await;
        });
    }
}

/// §2.3 step 3, passive side, for an id already on its own channel;
/// `ticket` is the one the request presented (§2.4).
#[allow(clippy::too_many_arguments)]
async fn setup_passive(
    id: CmId,
    chan: Arc<EventChannel>,
    peer_hello: Hello,
    ticket: Option<Ticket>,
    cfg: Config,
    local: SocketAddr,
    mut admission: Admission,
    pools: Arc<SharedPools>,
) -> Result<Connection, Error> {
    let afd = match async_fd(chan.clone()) {
        Ok(a) => a,
        Err(e) => {
            id.reject(b"resources");
            return Err(e);
        }
    };
    let id = Arc::new(id);
    let res = match build_resources(&id, &cfg, Some(&pools)) {
        Ok(r) => r,
        Err(e) => {
            id.reject(b"resources");
            return Err(e);
        }
    };
    id.accept(&res.hello.encode())?;
    let e = tokio::time::timeout(cfg.connect_timeout, next_event(&chan, &afd))
        .await
        .map_err(|_| Error::Timeout { stage: "accept" })??;
    if e.kind != ev::RDMA_CM_EVENT_ESTABLISHED {
        return Err(Error::Unreachable {
            addr: id.peer_addr().unwrap_or(local),
            status: e.status,
        });
    }
    let peer = id.peer_addr().unwrap_or(local);
    let mut engine =
        Engine::new(engine_config(&cfg, &res, peer_hello)).map_err(|e| engine_err(e, "setup"))?;
    let _already_posted = engine.take_actions();
    engine.set_wait_first_recv();
    admission.established();
    spawn_driver(
        chan,
        afd,
        id,
        res,
        engine,
        cfg,
        peer,
        peer_hello,
        Some(admission),
        ticket,
        false,
    )
}

/// What a `SendHalf` asks of the driver (messages themselves are posted by
/// the sending task, §8).
enum Cmd {
    Close(oneshot::Sender<()>),
}

enum Item {
    Msg(Bytes),
    Closed,
    Err(Error),
}

/// Times `connect` retries with a fresh cm_id when `rdma_connect` finds its
/// local port taken (iWARP, §9).
const CONNECT_PORT_RETRIES: u32 = 3;

/// [`SendHalf::try_send_parts`] posts at once only while fewer sent
/// messages than this are unacknowledged by the peer.
pub const QUIET_UNRETURNED: u32 = 2;

/// Per-message overhead counted against `recv_queue_bytes`, so a flood of
/// empty messages is bounded too.
const QUEUED_MSG_OVERHEAD: usize = 64;

/// The protocol engine and the registered memory of one connection, with
/// the driver's posting state. Shared by the driver task and the
/// `SendHalf` (run-to-completion sends, §8): whoever holds the lock may
/// submit, post and consume completions; no `await` happens under it, so a
/// dropped future can never leave it half-done, and a posted buffer stays
/// owned by `mem` until its completion is polled, whichever task posted it.
struct Core {
    engine: Engine,
    mem: ConnMemory,
    /// Reused buffer for the engine's actions (no allocation per post).
    actions: Vec<Action>,
    /// Work requests were posted since the keepalive timer last fired
    /// (§4.4): set per post without reading the clock.
    posted: bool,
    /// A post from a `SendHalf` failed: the driver ends the connection with it.
    failed: Option<Error>,
}

impl Core {
    /// Submits `head ++ body` and posts what the engine can; a failed post
    /// is recorded for the driver (the caller wakes it with `Shared::kick`).
    /// `Ok(true)`: part of it is still queued, and the driver must be woken
    /// to arm its send CQ (it may be asleep on receives only, §8).
    fn submit_and_post(&mut self, head: Bytes, body: Bytes) -> Result<bool, Error> {
        self.engine.submit_parts(head, body);
        self.post()
            .inspect_err(|e| self.failed = Some(e.clone()))
            .map(|()| self.engine.pending_msgs() > 0)
    }

    /// Lets the engine post what it can (§4.2, §5.2).
    fn post(&mut self) -> Result<(), Error> {
        let p = self.engine.progress(&mut self.mem);
        self.engine.swap_actions(&mut self.actions);
        // Post what was queued before a failure too: receives the engine
        // counted as posted must be.
        let r = self
            .mem
            .execute(&self.actions)
            .and(p.map_err(|e| engine_err(e, "send")));
        if !self.actions.is_empty() {
            // §4.4: no clock read per post; the keepalive timer looks at this.
            self.posted = true;
        }
        self.actions.clear();
        r
    }
}

/// A receive handler run by the connection's driver task for each message
/// (see [`RecvHalf::deliver_inline`]).
pub type InlineHandler = Box<dyn FnMut(Result<Option<Bytes>, Error>) -> bool + Send>;

/// An installed [`InlineHandler`] and the delivery channel's receiver, kept
/// so the channel stays open while the handler is in place.
struct Inline {
    handler: InlineHandler,
    _rx: mpsc::UnboundedReceiver<Item>,
}

struct Shared {
    /// Set by [`RecvHalf::deliver_inline`]: the driver hands messages to it
    /// instead of the channel. Taken (dropped) to stop delivery, which
    /// closes the channel as dropping the `RecvHalf` does.
    inline: Mutex<Option<Inline>>,
    /// `None` once the driver tore the connection down (memory freed).
    core: Mutex<Option<Core>>,
    /// Messages the engine may hold unposted before `send` waits
    /// (`Config::send_queue_messages`).
    send_limit: usize,
    /// Signalled by the driver when the engine's queue dropped below
    /// `send_limit` (back-pressure released).
    room: Notify,
    /// Wakes the driver: a post from a `SendHalf` failed.
    kick: Notify,
    error: Mutex<Option<Error>>,
    /// Bytes delivered to the `RecvHalf`'s queue and not yet taken (§4.5).
    queued: AtomicUsize,
    /// `Config::recv_queue_bytes`.
    queue_limit: usize,
    /// Signalled when the queue drops back to the limit.
    drained: Notify,
}

impl Shared {
    fn new(queue_limit: usize, core: Core, send_limit: usize) -> Shared {
        Shared {
            inline: Mutex::new(None),
            core: Mutex::new(Some(core)),
            send_limit: send_limit.max(1),
            room: Notify::new(),
            kick: Notify::new(),
            error: Mutex::new(None),
            queued: AtomicUsize::new(0),
            queue_limit,
            drained: Notify::new(),
        }
    }

    fn inline(&self) -> std::sync::MutexGuard<'_, Option<Inline>> {
        self.inline.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn core(&self) -> std::sync::MutexGuard<'_, Option<Core>> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn over_limit(&self) -> bool {
        self.queued.load(Ordering::Acquire) > self.queue_limit
    }

    fn error(&self) -> Error {
        self.error
            .lock()
            .map(|e| e.clone())
            .ok()
            .flatten()
            .unwrap_or(Error::Disconnected)
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("local", &self.local)
            .finish()
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .field("max_message_len", &self.send.max)
            .finish()
    }
}

impl std::fmt::Debug for SendHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendHalf")
            .field("max_message_len", &self.max)
            .field("closed", &self.closed)
            .finish()
    }
}

impl std::fmt::Debug for RecvHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvHalf")
            .field("done", &self.done)
            .finish()
    }
}

/// An established connection; [`Connection::split`] it to use it.
pub struct Connection {
    send: SendHalf,
    recv: RecvHalf,
    peer: SocketAddr,
    stats: Arc<ConnStats>,
    ticket: Option<Ticket>,
}

impl Connection {
    /// Splits into independently usable halves (both `Send + 'static`).
    pub fn split(self) -> (SendHalf, RecvHalf) {
        (self.send, self.recv)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// Live counters of this connection.
    pub fn stats(&self) -> Arc<ConnStats> {
        self.stats.clone()
    }

    /// On the accepting side, the ticket the peer presented in its connect
    /// request (§2.4), which a gated listener's gate accepted (an ungated
    /// listener checks nothing: then it is only what the peer sent); `None`
    /// when it presented none, and on the connecting side.
    pub fn ticket(&self) -> Option<Ticket> {
        self.ticket
    }
}

/// Sending half. Dropping it closes the sending direction (like `close`).
pub struct SendHalf {
    tx: mpsc::Sender<Cmd>,
    shared: Arc<Shared>,
    max: usize,
    chunk: usize,
    closed: bool,
}

impl SendHalf {
    /// Largest message [`SendHalf::send`] accepts (min of both sides' limits).
    pub fn max_message_len(&self) -> usize {
        self.max
    }

    /// Queues `msg` for sending. Waits while the driver's queue is full
    /// (back-pressure from credits / rendezvous buffers). `Ok` means the
    /// driver took ownership; delivery errors show up on later calls.
    pub async fn send(&mut self, msg: Bytes) -> Result<(), Error> {
        self.send_parts(Bytes::new(), msg).await
    }

    /// As [`send`](Self::send), for the message `head` followed by `body`
    /// (e.g. a frame header and a payload), without joining them first: the
    /// bytes are copied once, into registered memory, as they are posted.
    ///
    /// The calling task posts the message itself (§8): when the connection
    /// has credits and room, the SEND (or the first rendezvous WRITEs) is
    /// on the wire when this returns, with no hop through the driver task.
    /// What cannot be posted yet stays queued in the engine (up to
    /// `Config::send_queue_messages` messages; beyond that this waits) and
    /// the driver posts it as credits come back.
    pub async fn send_parts(&mut self, head: Bytes, body: Bytes) -> Result<(), Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        let len = head.len() + body.len();
        if len > self.max {
            return Err(Error::MessageTooLarge { len, max: self.max });
        }
        let mut msg = Some((head, body));
        loop {
            // Registered before looking, so a release between the look and
            // the wait is not lost.
            let room = self.shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut g = self.shared.core();
                let Some(core) = g.as_mut() else {
                    return Err(self.shared.error());
                };
                if let Some(e) = &core.failed {
                    return Err(e.clone());
                }
                if core.engine.pending_msgs() < self.shared.send_limit {
                    let (head, body) = msg.take().expect("message not yet submitted");
                    let r = core.submit_and_post(head, body);
                    drop(g);
                    if !matches!(r, Ok(false)) {
                        self.shared.kick.notify_one();
                    }
                    return r.map(|_| ());
                }
            }
            room.await;
        }
    }

    /// Posts `head ++ body` now, from the calling task, if the connection
    /// is quiet: no message is waiting in the engine and fewer than
    /// 2 sent messages are still unacknowledged by the
    /// peer. Otherwise gives the parts back (`Err`), so that the caller can
    /// queue them and send several together later (the call layer then
    /// batches frames into one message, which costs the peer one receive
    /// instead of several): low latency when there is little traffic, fewer
    /// messages when there is a lot. Errors as [`send`](Self::send).
    #[allow(clippy::type_complexity)]
    pub fn try_send_parts(
        &mut self,
        head: Bytes,
        body: Bytes,
    ) -> Result<Result<(), Error>, (Bytes, Bytes)> {
        if self.closed {
            return Ok(Err(Error::Closed));
        }
        let len = head.len() + body.len();
        if len > self.max {
            return Ok(Err(Error::MessageTooLarge { len, max: self.max }));
        }
        let mut g = self.shared.core();
        let Some(core) = g.as_mut() else {
            return Ok(Err(self.shared.error()));
        };
        if let Some(e) = &core.failed {
            return Ok(Err(e.clone()));
        }
        if core.engine.pending_msgs() > 0 || core.engine.unreturned_credits() >= QUIET_UNRETURNED {
            return Err((head, body));
        }
        let r = core.submit_and_post(head, body);
        drop(g);
        if !matches!(r, Ok(false)) {
            self.shared.kick.notify_one();
        }
        Ok(r.map(|_| ()))
    }

    /// Bytes per rendezvous chunk on this connection (§5.2): a message
    /// larger than the eager limit moves in pieces of this size, so one whose
    /// length is a multiple of it fills whole rendezvous buffers.
    pub fn chunk_len(&self) -> usize {
        self.chunk
    }

    /// Sends CLOSE after all queued messages and waits until it was
    /// transmitted (or the connection failed). The peer's `recv` then
    /// returns `Ok(None)`. Idempotent.
    pub async fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Close(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// Stops inline delivery ([`RecvHalf::deliver_inline`]) from any task.
pub struct InlineStop(Arc<Shared>);

impl InlineStop {
    /// Removes the handler (after the call it may be running returns): no
    /// message is delivered after this, as if the `RecvHalf` was dropped.
    pub fn stop(&self) {
        let h = self.0.inline().take();
        drop(h);
    }
}

impl std::fmt::Debug for InlineStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InlineStop")
    }
}

/// Receiving half.
pub struct RecvHalf {
    rx: mpsc::UnboundedReceiver<Item>,
    shared: Arc<Shared>,
    done: bool,
}

impl RecvHalf {
    /// Hands every received message to `f` right in the connection's
    /// driver task, as soon as it is taken from registered memory (§8): no
    /// task hop between the completion and `f`. Then `Ok(None)` once the
    /// peer closed cleanly, or the error that ends the connection. Messages
    /// that arrived before this call go to `f` first, in order.
    ///
    /// `f` runs on the driver: it must not block (it may send on this
    /// connection). Returning `false` stops delivery, as dropping the
    /// `RecvHalf` does; so does [`InlineStop::stop`]. Receive back-pressure
    /// (`Config::recv_queue_bytes`) does not apply: `f` takes each message
    /// at once.
    pub fn deliver_inline(mut self, mut f: InlineHandler) -> InlineStop {
        let shared = self.shared.clone();
        let mut g = shared.inline();
        // Under the lock the driver delivers with: nothing overtakes these.
        let mut keep = !self.done;
        while keep {
            let r = match self.rx.try_recv() {
                Ok(Item::Msg(b)) => {
                    let n = b.len() + QUEUED_MSG_OVERHEAD;
                    self.shared.queued.fetch_sub(n, Ordering::AcqRel);
                    Ok(Some(b))
                }
                Ok(Item::Closed) => Ok(None),
                Ok(Item::Err(e)) => Err(e),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => Err(self.shared.error()),
            };
            let end = !matches!(r, Ok(Some(_)));
            keep = f(r) && !end;
        }
        if keep {
            *g = Some(Inline {
                handler: f,
                _rx: self.rx,
            });
        }
        // The queue was drained: a driver holding returns may release them.
        self.shared.drained.notify_one();
        drop(g);
        InlineStop(shared)
    }

    /// Next message, `Ok(None)` once the peer closed cleanly. The returned
    /// bytes are owned by the caller (copied out of registered memory).
    pub async fn recv(&mut self) -> Result<Option<Bytes>, Error> {
        if self.done {
            return Ok(None);
        }
        match self.rx.recv().await {
            Some(Item::Msg(b)) => {
                // §4.5: the driver holds credit returns while the queue is
                // over its limit; wake it when we drain back under.
                let n = b.len() + QUEUED_MSG_OVERHEAD;
                let before = self.shared.queued.fetch_sub(n, Ordering::AcqRel);
                let limit = self.shared.queue_limit;
                if before > limit && before - n <= limit {
                    self.shared.drained.notify_one();
                }
                Ok(Some(b))
            }
            Some(Item::Closed) => {
                self.done = true;
                Ok(None)
            }
            Some(Item::Err(e)) => Err(e),
            None => Err(self.shared.error()),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn spawn_driver(
    chan: Arc<EventChannel>,
    cm_afd: CmFd,
    id: Arc<CmId>,
    res: Resources,
    engine: Engine,
    cfg: Config,
    peer: SocketAddr,
    peer_hello: Hello,
    admission: Option<Admission>,
    ticket: Option<Ticket>,
    active: bool,
) -> Result<Connection, Error> {
    let cq_afd = async_fd(res.cq.clone())?;
    let shared_receive = res.mem.is_shared();
    let (tx, cmd_rx) = mpsc::channel(cfg.send_queue_messages.max(1));
    let (deliver_tx, rx) = mpsc::unbounded_channel();
    let chunk = engine.config().chunk_bytes();
    let core = Core {
        engine,
        mem: res.mem,
        actions: Vec::with_capacity(64),
        posted: false,
        failed: None,
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
    let keepalive_timer = Box::pin(tokio::time::sleep(cfg.keepalive));
    let idle_timer = Box::pin(tokio::time::sleep(cfg.memory_idle_release));
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
        keepalive_timer,
        idle_timer,
        woke_receiver: false,
        spin,
        setup_kick: active.then(|| {
            (
                tokio::time::Instant::now() + SETUP_KICK_FIRST,
                SETUP_KICK_FIRST,
            )
        }),
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
    })
}

/// The driver's busy-poll budget (§8, `Config::poll_mode`).
#[derive(Debug, Clone, Copy)]
struct SpinBudget {
    mode: PollMode,
    /// `Config::busy_poll`.
    max: Duration,
    /// `PollMode::Adaptive`: moving average of how long the driver went
    /// without work before the next completion or command.
    avg: Duration,
    /// `PollMode::Adaptive`: idle periods since the last one that was
    /// timed (see [`SpinBudget::sample_now`]).
    unsampled: u32,
}

/// `PollMode::Adaptive` times one idle period in this many while it does not
/// spin (§8): each timing is two clock reads, a syscall each where the
/// guest has no usable TSC, and a driver that sleeps anyway needs only a
/// trend to notice when its waits get short.
const SAMPLE_EVERY_ASLEEP: u32 = 8;

impl SpinBudget {
    fn new(mode: PollMode, max: Duration) -> SpinBudget {
        SpinBudget {
            mode,
            max,
            avg: Duration::ZERO,
            unsampled: 0,
        }
    }

    /// Whether to time the idle period that starts now: always while the
    /// budget lets the driver spin (the spin reads the clock anyway), one
    /// period in [`SAMPLE_EVERY_ASLEEP`] while it does not.
    fn sample_now(&mut self) -> bool {
        if self.mode != PollMode::Adaptive {
            return false;
        }
        if !self.budget().is_zero() {
            self.unsampled = 0;
            return true;
        }
        self.unsampled += 1;
        if self.unsampled >= SAMPLE_EVERY_ASLEEP {
            self.unsampled = 0;
            true
        } else {
            false
        }
    }

    /// How long to busy-poll now.
    fn budget(&self) -> Duration {
        match self.mode {
            PollMode::Fixed => self.max,
            PollMode::Spin => Duration::MAX,
            PollMode::Adaptive => {
                let want = self.avg * 2;
                if want <= self.max {
                    // Never below a few µs: the first samples start at 0.
                    want.max(Duration::from_micros(2)).min(self.max)
                } else {
                    Duration::ZERO
                }
            }
        }
    }

    /// One more observed wait for work.
    fn note(&mut self, waited: Duration) {
        // Moving average with weight 1/8; a wait longer than 4 × the bound
        // counts as 4 × the bound, so one long pause (an idle connection)
        // does not keep spinning off for long once traffic resumes.
        let w = waited.min(self.max * 4);
        self.avg = (self.avg * 7 + w) / 8;
    }
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
    /// Fires once per keepalive interval; a keepalive is posted when nothing
    /// was posted during a whole interval (so after 1 to 2 intervals of
    /// idleness).
    keepalive_timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Memory on demand (§5.5): fires once per `memory_idle_release`; what
    /// went unused for a whole interval is given back.
    idle_timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// A message was handed to the `RecvHalf` since the driver last yielded
    /// (§8: yield before busy-polling, so the task it woke can run on this
    /// worker first).
    woke_receiver: bool,
    /// The busy-poll budget (§8, `Config::poll_mode`).
    spin: SpinBudget,
    /// Active side, until the passive side's first message arrived: when
    /// the next setup kick is due and the interval that led to it (§2.3
    /// step 6).
    setup_kick: Option<(tokio::time::Instant, Duration)>,
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
            .set_hold_returns(self.recv_open && self.shared.over_limit());
        core.post()?;
        let mut events = std::mem::take(&mut self.events);
        while let Some(e) = core.engine.next_event() {
            events.push(e);
        }
        let now = core.engine.counters;
        self.stats.add_delta(&now, &self.last);
        self.last = now;
        let confirmed = core.engine.close_confirmed();
        // Back-pressure released: wake the senders waiting for room.
        let room = core.engine.pending_msgs() < self.shared.send_limit;
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
        drop(g);
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
                if let Some(t) = idle_since.take() {
                    self.spin.note(t.elapsed());
                }
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
                        if start.elapsed() >= budget {
                            break;
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
                    if let Some(t) = idle_since.take() {
                        self.spin.note(t.elapsed());
                    }
                    self.step()?;
                    continue;
                }
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
                    if let Some(t) = idle_since.take() {
                        self.spin.note(t.elapsed());
                    }
                    self.step()?;
                    continue;
                }
            }
            let cmds = self.cmd_open;
            let keepalive = !self.cfg.keepalive.is_zero();
            // Memory on demand (§5.5): the idle timer runs only while there
            // is something to give back, so an idle connection holding its
            // initial rings only is never woken for it.

            if self.setup_kick.is_some()
                && self.with_engine(|e| e.heard_from_peer()).unwrap_or(true)
            {
                self.setup_kick = None;
            }
            // One look under the core lock: receive back-pressure (§4.5),
            // and whether memory on demand has anything to give back, so the
            // idle timer runs only then (§5.5: an idle connection at its
            // initial size is never woken for it).
            let (holding, releasable) = self
                .with_engine(|e| (e.holding_returns(), e.has_releasable()))
                .unwrap_or((false, false));
            let idle_release =
                releasable && self.cfg.memory_on_demand && !self.cfg.memory_idle_release.is_zero();
            let (kick, kick_at) = match self.setup_kick {
                Some((at, _)) => (true, at),
                // Not polled; any stored instant will do (no clock read).
                None => (false, self.keepalive_timer.deadline()),
            };
            tokio::select! {
                biased;
                r = self.cq_afd.readable(), if !spin => {
                    let mut g = r.map_err(|e| io_err("AsyncFd(cq)", e))?;
                    let n = self.cq.consume_events()?;
                    self.stats.bump(|s| &s.cq_events, n as u64);
                    g.clear_ready();
                    if let Some(t) = idle_since.take() {
                        self.spin.note(t.elapsed());
                    }
                }
                c = self.cmd_rx.recv(), if cmds => {
                    self.handle_cmd(c);
                    if let Some(t) = idle_since.take() {
                        self.spin.note(t.elapsed());
                    }
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
                _ = tokio::time::sleep_until(kick_at), if kick => {
                    // §2.3 step 6: nothing heard from the passive side yet.
                    // A zero-length WRITE makes its NIC look at the
                    // connection again: siw (Linux 6.1) ignores FPDUs that
                    // arrive while its accept is still installing the QP's
                    // socket callbacks, until the next segment arrives.
                    self.with_engine(|e| e.keepalive());
                    self.stats.bump(|s| &s.setup_kicks, 1);
                    let now = tokio::time::Instant::now();
                    self.setup_kick = self.setup_kick.and_then(|(_, d)| {
                        let d = d * 2;
                        (d <= SETUP_KICK_LAST).then_some((now + d, d))
                    });
                }
                _ = self.keepalive_timer.as_mut(), if keepalive => {
                    let now = tokio::time::Instant::now();
                    // §4.4: nothing posted during a whole interval: probe.
                    let idle = self
                        .shared
                        .core()
                        .as_mut()
                        .is_some_and(|c| {
                            let idle = !std::mem::take(&mut c.posted);
                            if idle {
                                c.engine.keepalive();
                            }
                            idle
                        });
                    if idle {
                        self.stats.bump(|s| &s.keepalives, 1);
                    }
                    self.keepalive_timer.as_mut().reset(now + self.cfg.keepalive);
                }
                _ = self.idle_timer.as_mut(), if idle_release => {
                    let now = tokio::time::Instant::now();
                    if let Some(c) = self.shared.core().as_mut() {
                        let Core { engine, mem, .. } = c;
                        engine.on_idle_tick(mem);
                    }
                    // Posts a REVOKE if one is due (§5.5).
                    self.step()?;
                    self.idle_timer
                        .as_mut()
                        .reset(now + self.cfg.memory_idle_release);
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
        let inline = self.shared.inline().take();
        drop(inline);
        let core = self.shared.core().take();
        drop(core);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn adaptive_budget_follows_the_observed_wait_within_the_bound() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        // Nothing observed yet: a token spin.
        assert_eq!(b.budget(), 2 * US);
        for _ in 0..64 {
            b.note(20 * US);
        }
        // Converges to twice the wait (the 1/8 average approaches 20 µs).
        let got = b.budget();
        assert!(got > 38 * US && got <= 40 * US, "{got:?}");
        // Waits longer than half the bound: not worth spinning at all.
        for _ in 0..64 {
            b.note(300 * US);
        }
        assert_eq!(b.budget(), Duration::ZERO);
        // One very long pause counts as 4 × the bound only, so a few fast
        // round trips bring spinning back.
        let mut c = SpinBudget::new(PollMode::Adaptive, 100 * US);
        for _ in 0..64 {
            c.note(10 * US);
        }
        c.note(Duration::from_secs(10));
        let mut n = 0;
        while c.budget().is_zero() {
            c.note(10 * US);
            n += 1;
        }
        assert!(n <= 16, "{n} samples to resume spinning");
        // A zero bound never spins.
        let mut z = SpinBudget::new(PollMode::Adaptive, Duration::ZERO);
        z.note(US);
        assert_eq!(z.budget(), Duration::ZERO);
    }

    #[test]
    fn adaptive_times_every_period_while_spinning_one_in_eight_asleep() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        // Spinning (budget > 0): every idle period is timed.
        assert!((0..10).all(|_| b.sample_now()));
        for _ in 0..64 {
            b.note(Duration::from_millis(2));
        }
        assert_eq!(b.budget(), Duration::ZERO);
        // Asleep: one period in SAMPLE_EVERY_ASLEEP.
        let timed = (0..8 * SAMPLE_EVERY_ASLEEP)
            .filter(|_| b.sample_now())
            .count();
        assert_eq!(timed, 8);
        // Fixed and Spin never time a period (nothing adapts).
        let mut f = SpinBudget::new(PollMode::Fixed, 20 * US);
        assert!(!(0..20).any(|_| f.sample_now()));
        let mut s = SpinBudget::new(PollMode::Spin, 20 * US);
        assert!(!(0..20).any(|_| s.sample_now()));
    }

    #[test]
    fn fixed_and_spin_budgets() {
        let mut f = SpinBudget::new(PollMode::Fixed, 20 * US);
        f.note(Duration::from_secs(1));
        assert_eq!(f.budget(), 20 * US);
        assert_eq!(
            SpinBudget::new(PollMode::Spin, Duration::ZERO).budget(),
            Duration::MAX
        );
    }
}
