//! Registered memory: every buffer the NIC may touch, from its
//! registration to its deregistration, and who may reach it when.
//!
//! * `registered`: one page-aligned allocation registered with a PD
//!   (`RegisteredBuf`), the only place memory is registered and freed
//!   (counted in the process-wide [`REGISTERED_BYTES`], here),
//! * `device_pool`: the process-wide block pool of a device, which keeps
//!   blocks a connection let go for the next one (buffer-ownership.md,
//!   "Process-wide block pool"),
//! * `slot_pool`: a ring of equal slots registered a segment at a time,
//! * `recv_pool`: a listener's shared receive pool behind its shared
//!   receive queue (wire protocol §4.7),
//! * `exposed`: the application's buffers registered for one-sided access
//!   (wire protocol §10) and the side queue pair that owns the posted ones,
//! * `local_cache`: the local buffers of one-sided READs and WRITEs, kept
//!   registered between operations (§10.5),
//! * `conn_memory`: the QP and all memory of one connection
//!   (`ConnMemory`), which destroys the QP before any buffer is
//!   deregistered or freed, and implements the engine's `Buffers`.
//!
//! See `docs/buffer-ownership.md` for who owns which slot when. With
//! `crate::verbs`, this is the only module tree with `unsafe` code.

mod conn_memory;
mod device_pool;
mod exposed;
mod local_cache;
mod recv_pool;
mod registered;
mod slot_pool;

use std::sync::atomic::AtomicUsize;

pub(crate) use self::conn_memory::{ConnMemory, PoolSizes};
pub(crate) use self::device_pool::DevicePool;
pub(crate) use self::exposed::{
    read_destination, ByWrId, Local, MrUse, PostFail, SideQp, Transfer, UserMr, FENCED_WRITE,
    SMALL_READ_MAX,
};
pub(crate) use self::local_cache::{read_buffer, read_bytes, write_buffer, LocalCache};
pub(crate) use self::recv_pool::RecvPool;

/// Process-wide registered bytes (checked against `Config::global_max_registered_bytes`).
pub(crate) static REGISTERED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Of those, the bytes of blocks the device pools keep while no connection
/// uses them ([`DevicePool`]).
pub(crate) static POOL_IDLE_BYTES: AtomicUsize = AtomicUsize::new(0);

/// wr_id kind tag of a receive posted to a listener's shared receive queue;
/// the low 32 bits are the pool buffer (wire protocol §4.7). The engine's
/// own tags are 1 and 2 (§7).
pub(crate) const WR_SRQ: u64 = 3;

/// wr_id kind tag of a memory-window bind (§4.7): filtered out before the
/// engine sees completions.
pub(crate) const WR_BIND: u64 = 4;
