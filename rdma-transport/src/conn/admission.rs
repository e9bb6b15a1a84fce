//! Who a listener admits (§2.4): the admission gate that sees each
//! connect request's address and ticket, and the limits on pending
//! handshakes and connections per source address, counted from the request
//! until the connection's memory is freed.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::Config;
use crate::engine::wire::Ticket;
use crate::verbs::cm::REJECT_PRIVATE_MAX;

/// A connect request as a listener's admission gate sees it (§2.4).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdmitRequest {
    /// The requesting side's address, as rdma_cm reports it.
    pub peer: Option<SocketAddr>,
    /// The ticket it presented ([`connect_with_ticket`](crate::connect_with_ticket)), if any.
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

/// A listener's admission gate
/// ([`Listener::bind_gated`](crate::Listener::bind_gated), §2.4): called
/// for every connect request whose hello is valid, before anything is
/// counted or created for it. `Ok(())` admits the request; `Err(reason)`
/// rejects it, and the connecting side's
/// [`Error::Rejected`](crate::Error::Rejected) carries `reason` (control
/// characters replaced by spaces, cut to 148 bytes). It runs on
/// the listening task, which takes every connect request in turn, so it
/// must not block.
pub type AdmitGate = Arc<dyn Fn(&AdmitRequest) -> Result<(), String> + Send + Sync>;

/// Per-source-address accounting of a listener (pending handshakes and
/// connections, pending included).
#[derive(Default)]
pub(super) struct Limits {
    state: Mutex<LimitState>,
    pub(super) refused: AtomicUsize,
    /// Requests the admission gate refused (§2.4).
    pub(super) unauthenticated: AtomicUsize,
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

/// Which limit refuses a connect request (logged by the listener; the
/// connecting side sees [`RejectReason::Busy`](crate::RejectReason::Busy)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// `max_pending_handshakes`: this many handshakes pending.
    Pending(usize),
    /// `max_pending_handshakes_per_address`: this many pending from `ip`.
    PendingFrom(usize, IpAddr),
    /// `max_connections_per_address`: this many connections from `ip`.
    ConnectionsFrom(usize, IpAddr),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Pending(n) => write!(f, "{n} handshakes pending (max_pending_handshakes)"),
            Refusal::PendingFrom(n, ip) => write!(
                f,
                "{n} handshakes pending from {ip} (max_pending_handshakes_per_address)"
            ),
            Refusal::ConnectionsFrom(n, ip) => {
                write!(f, "{n} connections from {ip} (max_connections_per_address)")
            }
        }
    }
}

impl Limits {
    /// Counts a new handshake from `ip`, or says which limit refuses it.
    pub(super) fn admit(self: &Arc<Self>, ip: IpAddr, cfg: &Config) -> Result<Admission, Refusal> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let c = st.per_addr.get(&ip).copied().unwrap_or_default();
        let why = if st.pending >= cfg.max_pending_handshakes {
            Some(Refusal::Pending(st.pending))
        } else if c.pending >= cfg.max_pending_handshakes_per_address {
            Some(Refusal::PendingFrom(c.pending, ip))
        } else if c.conns >= cfg.max_connections_per_address {
            Some(Refusal::ConnectionsFrom(c.conns, ip))
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
    pub(super) fn established(&mut self) {
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

/// The gate's verdict on `req`; a gate that panics refuses (and the
/// listener goes on).
pub(super) fn run_gate(gate: &AdmitGate, req: &AdmitRequest) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gate(req))).unwrap_or_else(|_| {
        tracing::error!("rdma listener: the admission gate panicked; request refused");
        Err("unauthenticated: admission check failed".to_string())
    })
}

/// A gate's reason as reject private data (§2.4): control characters
/// replaced by spaces (the connecting side drops a reason holding any), at
/// most [`REJECT_PRIVATE_MAX`] bytes, cut at a character boundary; an empty
/// reason becomes "unauthenticated".
pub(super) fn reject_reason(why: &str) -> String {
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
