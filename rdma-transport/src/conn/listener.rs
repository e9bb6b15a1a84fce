//! The passive side of connection setup (§2.3): the [`Listener`], its
//! listening task that takes every connect request in turn, and each
//! admitted request's handshake, run as a task of its own.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rdma_sys::rdma_cm_event_type as ev;
use tokio::sync::mpsc;

use super::admission::{reject_reason, run_gate, Admission, AdmitGate, AdmitRequest, Limits};
use super::driver::spawn_driver;
use super::events::{event_name, next_event, CmFd};
use super::resources::{build_resources, engine_config, SharedPools};
use super::side::{accept_side, SideRegistry};
use super::{engine_err, Connection};
use crate::config::Config;
use crate::engine::wire::{Attached, Hello, Ticket, HELLO_FLAG_REMOTE};
use crate::engine::Engine;
use crate::error::{Error, NoDeviceReason, RejectReason};
use crate::remote::{RemoteShared, Role};
use crate::verbs::async_fd;
use crate::verbs::cm::{CmId, EventChannel};

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

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("local", &self.local)
            .finish()
    }
}

impl Listener {
    /// Binds and listens on `addr` (use port 0 for an ephemeral port), and
    /// starts taking connect requests (see the type's docs). Every request
    /// with a valid hello is admitted (within the limits); a ticket it
    /// presents is not checked ([`Connection::ticket`] still shows it).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an invalid `cfg`; [`Error::NoDevice`] when the
    /// host has no RDMA support or no RDMA device has `addr`
    /// ([`NoDeviceReason::NotOnAddress`]); [`Error::LibraryUnavailable`]
    /// without the RDMA libraries; [`Error::Verb`] when binding or
    /// listening fails otherwise (e.g. the port is taken).
    pub async fn bind(addr: SocketAddr, cfg: Config) -> Result<Listener, Error> {
        Listener::bind_inner(addr, cfg, None).await
    }

    /// As [`Listener::bind`], admitting only the connect requests `gate`
    /// accepts (§2.4): it sees each request's source address and the ticket
    /// it presented ([`connect_with_ticket`](crate::connect_with_ticket)) right after the hello is
    /// validated. A refused request is rejected with the gate's reason,
    /// logged, and counted by [`Listener::refused_unauthenticated`]; no
    /// queue pair or memory is created for it, no limit counts it, and
    /// [`Listener::accept`] does not report it.
    ///
    /// # Errors
    ///
    /// As [`Listener::bind`].
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
                Error::NoDevice(NoDeviceReason::NotOnAddress { addr, errno })
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
                sides: Arc::default(),
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
    ///
    /// # Errors
    ///
    /// The error of a handshake that failed after its request was admitted
    /// ([`Error::Protocol`] for a bad hello, [`Error::Timeout`],
    /// [`Error::ResourceLimit`], ...); [`Error::Disconnected`] once the
    /// listening task ended (its event channel failed).
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
    /// The side tokens given to this listener's connections (§10.2).
    sides: Arc<SideRegistry>,
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
        let (peer_hello, ticket) = match Hello::decode_request(&e.private_data) {
            Ok((h, Attached::Nothing)) => (h, None),
            Ok((h, Attached::Ticket(t))) => (h, Some(t)),
            // §10.2: a side request: the token is the credential (it was
            // given to an admitted connection): no gate, no limit, and
            // `accept` never reports it.
            Ok((_, Attached::Side(token))) => {
                let Some(shared) = st.sides.find(&token) else {
                    tracing::warn!(
                        "rdma listener on {}: refused a side queue pair from {} with an unknown \
                         or closed connection's token",
                        st.local,
                        peer.map_or_else(|| "?".to_string(), |p| p.to_string()),
                    );
                    id.reject(b"unknown side token");
                    continue;
                };
                let mut id = id;
                let chan = match EventChannel::new().and_then(|c| id.migrate(&c).map(|_| c)) {
                    Ok(c) => c,
                    Err(e) => {
                        id.reject(RejectReason::Resources.text().as_bytes());
                        tracing::debug!("rdma listener: side queue pair refused: {e}");
                        continue;
                    }
                };
                let local = st.local;
                handshakes.spawn(async move {
                    if let Err(e) = accept_side(id, chan, shared).await {
                        tracing::debug!("rdma listener on {local}: side queue pair failed: {e}");
                    }
                });
                continue;
            }
            Err(v) => {
                id.reject(RejectReason::BadHello.text().as_bytes());
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
                id.reject(RejectReason::Busy.text().as_bytes());
                continue;
            }
        };
        // Give the connection its own event channel (§8) before anything
        // else can arrive for it on ours.
        let mut id = id;
        let chan = match EventChannel::new().and_then(|c| id.migrate(&c).map(|_| c)) {
            Ok(c) => c,
            Err(e) => {
                id.reject(RejectReason::Resources.text().as_bytes());
                let _ = tx.try_send(Err(e));
                continue;
            }
        };
        let (cfg, local, tx) = (st.cfg.clone(), st.local, tx.clone());
        let pools = st.pools.clone();
        let sides = st.sides.clone();
        handshakes.spawn(async move {
            let r = setup_passive(
                id, chan, peer_hello, ticket, cfg, local, admission, pools, sides,
            )
            .await;
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
    sides: Arc<SideRegistry>,
) -> Result<Connection, Error> {
    let afd = match async_fd(chan.clone()) {
        Ok(a) => a,
        Err(e) => {
            id.reject(RejectReason::Resources.text().as_bytes());
            return Err(e);
        }
    };
    let id = Arc::new(id);
    let res = match build_resources(&id, &cfg, Some(&pools)) {
        Ok(r) => r,
        Err(e) => {
            id.reject(RejectReason::Resources.text().as_bytes());
            return Err(e);
        }
    };
    // §10.1: the peer offers one-sided access: agree, with a side token.
    let token = if peer_hello.flags & HELLO_FLAG_REMOTE != 0 {
        sides.issue()
    } else {
        None
    };
    let remote = RemoteShared::new(&cfg, Role::Passive, token, res.hello, id.clone());
    match &token {
        Some(t) => {
            sides.register(*t, &remote);
            id.accept(&res.hello.encode_with_side_token(t))?;
        }
        None => id.accept(&res.hello.encode())?,
    }
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
        remote,
    )
}
