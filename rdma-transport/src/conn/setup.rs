//! The active side of connection setup (§2.3): address and route
//! resolution, the handshake with our hello (and a ticket, §2.4) as private
//! data, and [`connect`] and its variants, which hand the established
//! connection to its driver.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::rdma_cm_event_type as ev;

use super::driver::spawn_driver;
use super::events::{event_name, next_event, status_text, CmFd};
use super::resources::{build_resources, engine_config, Resources};
use super::{engine_err, Connection};
use crate::config::Config;
use crate::engine::wire::{Hello, SideToken, Ticket, HELLO_FLAG_REMOTE};
use crate::engine::Engine;
use crate::error::{Error, RejectReason};
use crate::remote::{RemoteShared, Role};
use crate::verbs::async_fd;
use crate::verbs::cm::{CmId, EventChannel};

fn ms(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// Times `connect` retries with a fresh cm_id when `rdma_connect` finds its
/// local port taken (iWARP, §9).
const CONNECT_PORT_RETRIES: u32 = 3;

/// Connects to a [`Listener`](crate::Listener) at `addr` (§2.3, active side).
///
/// # Errors
///
/// [`Error::Config`] for an invalid `cfg`; when RDMA cannot reach the peer
/// (the errors [`Error::is_unavailable_for_fallback`] accepts):
/// [`Error::NoDevice`], [`Error::LibraryUnavailable`],
/// [`Error::AddrResolve`], [`Error::RouteResolve`], [`Error::Rejected`]
/// (with the listener's [`RejectReason`], if it gave one),
/// [`Error::Unreachable`], [`Error::Timeout`]; [`Error::Protocol`] for a
/// bad hello from the listener; [`Error::ResourceLimit`] or
/// [`Error::Verb`] when this side's resources cannot be created.
pub async fn connect(addr: SocketAddr, cfg: &Config) -> Result<Connection, Error> {
    connect_inner(None, addr, cfg, None).await
}

/// As [`connect`], presenting `ticket` to the listener (§2.4): it travels
/// in the connect request's private data, right after the hello. A listener
/// made by [`Listener::bind_gated`](crate::Listener::bind_gated) admits
/// the connection only if its gate accepts the ticket, and otherwise
/// rejects it before creating anything for it: then this fails with
/// [`Error::Rejected`] whose `reason` is the gate's text. A listener
/// without a gate ignores the ticket.
///
/// The ticket is sent in clear over the RDMA fabric; it is meant to be
/// obtained over an authenticated channel and used once.
///
/// # Errors
///
/// As [`connect`]; a gate's refusal is [`Error::Rejected`] with
/// [`RejectReason::Unauthenticated`] (or [`RejectReason::Other`] for a
/// gate text that does not start with `unauthenticated`).
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
///
/// # Errors
///
/// As [`connect`]; [`Error::AddrResolve`] also when `local` is not an
/// RDMA address of this host.
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
    // §10.1: we offer one-sided access; a listener from before it refuses
    // the flag as a bad hello, and then gets a hello without it.
    let mut offer_remote = true;
    let h = loop {
        let offer = offer_remote;
        let edit = move |h: &mut Hello| {
            if !offer {
                h.flags &= !HELLO_FLAG_REMOTE;
            }
        };
        match handshake(addr, local, cfg, ticket, edit).await {
            Err(Error::Verb {
                verb: "rdma_connect",
                errno,
            }) if errno.0 == libc::EADDRINUSE && collisions < CONNECT_PORT_RETRIES => {
                collisions += 1;
                tracing::debug!("connect to {addr}: local port in use, retrying ({collisions})");
            }
            Err(Error::Rejected {
                reason: Some(RejectReason::BadHello),
                ..
            }) if offer_remote => {
                offer_remote = false;
                tracing::debug!(
                    "connect to {addr}: the listener refused our hello; retrying without \
                     offering one-sided access"
                );
            }
            r => break r?,
        }
    };
    let remote = RemoteShared::new(
        cfg,
        Role::Active {
            peer: addr,
            local: h.id.local_addr().map(|a| a.ip()),
        },
        h.side_token,
        h.res.hello,
        h.id.clone(),
    );
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
        remote,
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
    /// The side token the listener gave (§10.1), when it agreed to
    /// one-sided access.
    pub(crate) side_token: Option<SideToken>,
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
    // §10.1: offer one-sided access.
    res.hello.flags |= HELLO_FLAG_REMOTE;
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
            reason: Some(RejectReason::ConnectionRefused),
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
    let (peer_hello, side_token) = match e.kind {
        // §2.4: only the connecting side presents a ticket; §10.1: the
        // side token comes with the listener's REMOTE flag.
        ev::RDMA_CM_EVENT_ESTABLISHED => match Hello::decode_answer(&e.private_data) {
            Ok((h, t)) if res.hello.flags & HELLO_FLAG_REMOTE != 0 => (h, t),
            Ok((h, _)) => (h, None),
            Err(v) => return Err(Error::Protocol(v)),
        },
        ev::RDMA_CM_EVENT_REJECTED => {
            return Err(Error::Rejected {
                addr,
                status: e.status,
                reason: RejectReason::from_private_data(&e.private_data),
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
        side_token,
    })
}
