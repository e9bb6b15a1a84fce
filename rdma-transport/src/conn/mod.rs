//! Connections: every RDMA connection of the process, from the connect
//! request to the teardown. A [`Connection`] is made by the active side
//! ([`connect`], in `setup`) or by a [`Listener`] (passive side, with the
//! admission rules of `admission`); its verbs resources are built by
//! `resources`, and from then on one driver task (`driver`) owns them and
//! runs the engine, sharing the engine and the memory with the sending half
//! under one lock (`shared`). The application holds the two halves
//! (`halves`). Section numbers (§) refer to `docs/wire-protocol-rdma.md`.
//!
//! * `setup`: the active side (§2.3: resolve, handshake, connect),
//! * `listener`: the passive side (§2.3), the [`Listener`] and its task,
//! * `admission`: who a listener admits (§2.4: the gate; the pending and
//!   per-address limits),
//! * `resources`: the QP, CQs and memory of a new connection, and the
//!   process-wide pools they come from,
//! * `shared`: the state the driver and the halves share (the core lock),
//! * `halves`: [`SendHalf`], [`RecvHalf`], [`InlineStop`],
//! * `driver`: the per-connection task (§8),
//! * `spin`: the driver's busy-poll budget (`Config::poll_mode`),
//! * `side`: the side queue pair of one-sided access (§10.2); `side_core`:
//!   its operations, shared by their callers and its task; `side_reply`:
//!   how an operation's answer reaches its caller; `poll_lock`: the lock
//!   of its state, on which no thread blocks,
//! * `events`: waiting for rdma_cm events.

mod admission;
mod driver;
mod events;
mod halves;
mod listener;
mod poll_lock;
mod resources;
mod setup;
mod shared;
mod side;
mod side_core;
mod side_reply;
mod spin;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::engine::wire::Ticket;
use crate::engine::EngineError;
use crate::error::{Errno, Error};
use crate::remote::{RemoteMemory, RemoteShared};
use crate::stats::ConnStats;
use crate::verbs::Cq;

pub use self::admission::{AdmitGate, AdmitRequest};
pub use self::halves::{InlineHandler, InlineStop, RecvHalf, SendHalf};
pub use self::listener::Listener;
pub use self::setup::{connect, connect_from, connect_with_ticket};
pub(crate) use self::side::open_side;
#[cfg(feature = "test-util")]
pub(crate) use self::side::raw_side_request;
pub(crate) use self::side_core::{NotTaken, SideCore};
pub(crate) use self::side_reply::Reply;
// The setup steps `testing::RawPeer` takes as `connect` does.
#[cfg(feature = "test-util")]
pub(crate) use self::events::{next_event, CmFd};
#[cfg(feature = "test-util")]
pub(crate) use self::setup::{handshake, resolve, Handshake};

/// An established connection; [`Connection::split`] it to use it.
pub struct Connection {
    send: SendHalf,
    recv: RecvHalf,
    peer: SocketAddr,
    stats: Arc<ConnStats>,
    ticket: Option<Ticket>,
    remote: Arc<RemoteShared>,
}

impl Connection {
    /// One-sided access on this connection (both sides, wire protocol
    /// §10): expose memory to the peer, read and write what it exposed.
    /// Call before [`Connection::split`]; the handle is cheap to clone.
    /// Once the connection closes, operations fail with
    /// [`RemoteError::Closed`](crate::RemoteError::Closed). The one-sided
    /// operations run on a side queue pair that the connecting side opens
    /// through the same [`Listener`]: on the accepting side, keep the
    /// listener while the connection uses one-sided access.
    pub fn remote_memory(&self) -> RemoteMemory {
        RemoteMemory {
            inner: self.remote.clone(),
        }
    }

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

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .field("max_message_len", &self.send.max)
            .finish()
    }
}

/// IBV_WC_WR_FLUSH_ERR
const WC_FLUSH_ERR: u32 = 5;

fn io_err(verb: &'static str, e: std::io::Error) -> Error {
    Error::Verb {
        verb,
        errno: Errno(e.raw_os_error().unwrap_or(0)),
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
