//! RDMA messaging transport for the gRPC-over-RDMA framework: it owns the
//! process's RDMA resources (the verbs objects, the registered memory and
//! the connections that use them) and moves messages over RC queue pairs:
//!
//! * connection setup with rdma_cm ([`Listener`], [`connect`]), optionally
//!   admitting only peers that present a ticket ([`Listener::bind_gated`],
//!   [`connect_with_ticket`]),
//! * small messages by SEND into pre-posted receive buffers with
//!   credit-based flow control, large ones RDMA-READ by the receiver from
//!   where the sender has them, or RDMA-WRITTEN into buffers the peer
//!   advertised (rendezvous), see `docs/wire-protocol-rdma.md`,
//! * a per-connection driver task owning all verbs resources and registered
//!   memory (`docs/buffer-ownership.md`); the API halves talk to it through
//!   channels, so dropping a future never frees memory the NIC may touch.
//!
//! The crate, one concern per module:
//!
//! * `conn`: connections, from the connect request to the teardown: the
//!   active side ([`connect`]), the [`Listener`] and who it admits
//!   ([`AdmitGate`]), each connection's resources and driver task, and the
//!   [`SendHalf`] and [`RecvHalf`] of a [`Connection`],
//! * [`engine`]: the sans-IO protocol engine (credits, receive and send
//!   rings, rendezvous, close) and the wire format ([`engine::wire`]),
//! * [`kept`]: large heap buffers a thread reuses once their messages are
//!   gone (reassembly here, encoding in rpc-core),
//! * `mem`: registered memory, the device and shared receive pools, and
//!   each connection's buffers,
//! * `remote`: one-sided access ([`RemoteMemory`], [`Exposure`]): the
//!   peer reads and writes memory this side exposes, by RDMA READ and
//!   WRITE on a side queue pair (wire protocol §10),
//! * `verbs`: the libibverbs / librdmacm objects, the libraries loaded at
//!   run time ([`check_libraries`]),
//! * [`Config`], [`Error`] with its typed details, [`ConnStats`]; `testing`
//!   (feature `test-util`): a misbehaving peer for tests.
//!
//! `unsafe` code lives only in the `verbs` module tree and `mem` (the crate
//! denies it everywhere else), every `unsafe` block with a `// SAFETY:`
//! comment and every `unsafe fn` with a `# Safety` section.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(clippy::missing_safety_doc)]
#![warn(missing_docs)]

mod config;
mod conn;
pub mod engine;
mod error;
pub mod kept;
#[allow(unsafe_code)]
mod mem;
mod remote;
mod stats;
#[cfg(feature = "test-util")]
pub mod testing;
#[allow(unsafe_code)]
mod verbs;

pub use config::{Config, PollMode};
pub use conn::{
    connect, connect_from, connect_with_ticket, AdmitGate, AdmitRequest, Connection, InlineHandler,
    InlineStop, Listener, RecvHalf, SendHalf,
};
pub use engine::wire::{Ticket, TICKET_LEN};
pub use error::{
    ConfigError, Errno, Error, NoDeviceReason, PeerMisbehaved, RejectReason, RemoteError,
    ResourceError,
};
pub use remote::{
    Exposable, Exposure, RegionKey, RemoteAccess, RemoteMemory, MAX_OP_BYTES, REGION_KEY_LEN,
};
pub use stats::{ConnStats, StatsSnapshot};

/// An RDMA device found by [`devices`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name, e.g. `rxe0`, `mlx5_0`, `siw0`.
    pub name: String,
    /// Node GUID (host order).
    pub guid: u64,
    /// "InfiniBand/RoCE", "iWARP" or "other".
    pub transport: &'static str,
}

/// Lists RDMA devices; `Ok(empty)` when the kernel has no RDMA support or
/// the RDMA libraries are not installed ([`check_libraries`] says which).
///
/// # Errors
///
/// [`Error::Verb`] when `ibv_get_device_list` fails otherwise than for lack
/// of RDMA support.
pub fn devices() -> Result<Vec<DeviceInfo>, Error> {
    verbs::devices()
}

/// Loads the RDMA user-space libraries (`libibverbs.so.1`, `librdmacm.so.1`)
/// if not done yet: they are not linked, but opened at run time on first use
/// (by this, [`devices`], [`connect`] or [`Listener::bind`]), so a program
/// starts on a host without them and uses TCP there.
///
/// `Err(Error::LibraryUnavailable)` when a library is missing or lacks a
/// function this crate calls; its text says which, e.g. `RDMA libraries not
/// installed (libibverbs.so.1: cannot open shared object file: No such file
/// or directory)`. The outcome of the first attempt holds for the process.
///
/// # Errors
///
/// [`Error::LibraryUnavailable`], as above.
pub fn check_libraries() -> Result<(), Error> {
    verbs::dl::load()
}

/// Process-wide counters (all connections, including closed ones).
pub fn global_stats() -> StatsSnapshot {
    stats::GLOBAL.snapshot()
}

/// Bytes of memory registered with RDMA devices by this process right now
/// (all live connections; a closed connection's regions are deregistered
/// during its teardown, or kept a while by its device's pool:
/// [`pool_idle_bytes`]). Bounded by `Config::global_max_registered_bytes`.
pub fn registered_bytes() -> usize {
    mem::REGISTERED_BYTES.load(std::sync::atomic::Ordering::SeqCst)
}

/// Of [`registered_bytes`], the bytes the process-wide device pools keep
/// registered while no connection uses them, for the next connection that
/// needs a block (`Config::device_pool`; bounded by
/// `Config::device_pool_idle_bytes`, each block let go after a whole
/// `memory_idle_release` unused).
pub fn pool_idle_bytes() -> usize {
    mem::POOL_IDLE_BYTES.load(std::sync::atomic::Ordering::SeqCst)
}
