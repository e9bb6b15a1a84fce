//! The crate's errors: [`Error`], and the typed detail some of its
//! variants carry so that callers and tests can tell the cases apart
//! without reading message texts: which protocol rule the peer broke
//! ([`PeerMisbehaved`]), why there is no device ([`NoDeviceReason`]), which
//! configuration field is invalid ([`ConfigError`]), what memory could not
//! be had ([`ResourceError`]) and why a listener rejected a connection
//! ([`RejectReason`]). Every `Display` text is the human-readable message.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// Errno wrapper that displays as `strerror` text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (errno {})",
            std::io::Error::from_raw_os_error(self.0),
            self.0
        )
    }
}

/// A violation of `docs/wire-protocol-rdma.md` by the peer: one variant per
/// rule, with the values that broke it. Carried by [`Error::Protocol`] (and
/// `engine::EngineError::Protocol`), so tests and callers can match the exact
/// violation instead of a message text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerMisbehaved {
    // ---- hello, §2.1/§2.2 ----
    /// The rdma_cm private data is shorter than a hello.
    #[error("bad hello: private data too short ({len} bytes, need {need})")]
    HelloTooShort {
        /// Bytes received.
        len: usize,
        /// `wire::HELLO_LEN`.
        need: usize,
    },
    /// The hello's `TICKET` flag (§2.4), `SIDE` flag or, in a listener's
    /// answer, `REMOTE` flag (§10) is set but the private data is too short
    /// to hold the ticket or side token after the hello.
    #[error(
        "bad hello: ticket or side token flag set but private data has {len} bytes (need {need})"
    )]
    HelloTicketTooShort {
        /// Bytes received.
        len: usize,
        /// `wire::HELLO_TICKET_LEN`.
        need: usize,
    },
    /// The accepting side's hello carries a ticket or a side request flag
    /// (§2.4, §10: only the connecting side presents either).
    #[error("bad hello: the accepting side's hello carries a ticket or a side request flag")]
    HelloTicketFromListener,
    /// The hello does not start with the magic number.
    #[error("bad hello: bad magic {magic:#010x}")]
    HelloBadMagic {
        /// What was there instead.
        magic: u32,
    },
    /// The peer speaks another protocol version.
    #[error("bad hello: unsupported protocol version {version} (we speak {ours})")]
    HelloVersion {
        /// Peer's version.
        version: u16,
        /// Ours.
        ours: u16,
    },
    /// A hello field is outside its documented range (§2.1).
    #[error("bad hello: {field} = {value} out of range {min}..={max}")]
    HelloFieldRange {
        /// Field name as in §2.1.
        field: &'static str,
        /// Value received.
        value: u64,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
    /// `rdv_addr + rdv_count * rdv_bytes` does not fit in 64 bits: the
    /// advertised rendezvous region wraps around the address space.
    #[error(
        "bad hello: rendezvous region at {addr:#x} of {count} x {bytes} bytes overflows the address space"
    )]
    HelloRegionOverflow {
        /// `rdv_addr`.
        addr: u64,
        /// `rdv_count`.
        count: u32,
        /// `rdv_bytes`.
        bytes: u32,
    },
    // ---- SEND header, §3 ----
    /// A SEND shorter than the 32-byte header.
    #[error("message shorter than header: {len} bytes")]
    ShortMessage {
        /// SEND length.
        len: usize,
    },
    /// Unknown message kind (§3.2).
    #[error("unknown message kind {kind}")]
    UnknownKind {
        /// The kind byte.
        kind: u8,
    },
    /// A SEND longer than the receive slot it landed in.
    #[error("receive of {len} bytes exceeds the {slot}-byte slot")]
    ReceiveExceedsSlot {
        /// Bytes received.
        len: usize,
        /// Slot size.
        slot: usize,
    },
    // ---- credits, §4.2 / §5.3 / §6 ----
    /// The peer returned more receive credits than it was ever given.
    #[error("peer returned too many credits ({credits} > {granted} granted)")]
    TooManyCredits {
        /// Credits after adding the return.
        credits: u64,
        /// The peer's initial credits (our ring).
        granted: u32,
    },
    /// The peer returned more rendezvous buffers than it was ever given.
    #[error("peer returned too many rendezvous buffers ({available} > {advertised})")]
    TooManyRendezvousReturns {
        /// Buffers after adding the return.
        available: u64,
        /// Buffers it advertised.
        advertised: u32,
    },
    /// A SEND arrived while every receive credit we granted was in use (§4.2).
    #[error(
        "peer sent without credit: {excess} messages received beyond the {granted} receive credits granted"
    )]
    SendWithoutCredit {
        /// Messages beyond the credits.
        excess: u32,
        /// Our ring size.
        granted: u32,
    },
    /// CLOSE_SEEN for a CLOSE we never sent (§6).
    #[error("peer acknowledged a CLOSE we never sent")]
    CloseSeenWithoutClose,
    /// EAGER, CHUNK or CLOSE after the peer's CLOSE (§6).
    #[error("{kind} after CLOSE")]
    AfterClose {
        /// Kind name.
        kind: &'static str,
    },
    // ---- immediate data, §5.4 ----
    /// An RDMA WRITE with immediate data arrived though this side's hello
    /// did not offer it (or the peer's did not).
    #[error("RDMA WRITE with immediate data {imm:#x}, which was not negotiated")]
    ImmediateNotOffered {
        /// The immediate data.
        imm: u32,
    },
    /// A SEND carried immediate data (the protocol never sends one).
    #[error("SEND with immediate data {imm:#x}")]
    ImmediateOnSend {
        /// The immediate data.
        imm: u32,
    },
    /// Chunk immediate data whose LAST bit disagrees with its "chunks that
    /// follow" field.
    #[error("malformed chunk immediate data {imm:#x}")]
    ImmediateMalformed {
        /// The immediate data.
        imm: u32,
    },
    /// One message's chunks were notified both ways: by CHUNK SENDs and by
    /// immediate data.
    #[error("a message mixes CHUNK and immediate-data chunk notifications")]
    ChunkNotificationMixed,
    // ---- memory on demand, §4.6 and §5.5 ----
    /// An on-demand message (RDV_REQUEST, RDV_GRANT, RDV_REVOKE,
    /// RDV_RELEASE, or a credit grant) though the hellos did not negotiate
    /// memory on demand, or at a moment §5.5 does not allow it.
    #[error("{kind} {why}")]
    OnDemandUnexpected {
        /// Kind name.
        kind: &'static str,
        /// What was wrong with it.
        why: &'static str,
    },
    /// A credit revoke (§4.7) to a limit below the hello's credits or not
    /// below the current one, or while one is being answered.
    #[error("credit revoke to {limit}: the limit is {current}, the hello's credits {initial}, and a revoke may only lower it, once at a time, not below the hello's")]
    CreditRevokeRange {
        /// The limit the revoke asked for.
        limit: u64,
        /// Our limit when it arrived.
        current: u32,
        /// The hello's credits.
        initial: u32,
    },
    /// An RDV_GRANT whose region wraps around the address space.
    #[error("granted rendezvous region at {addr:#x} wraps around the address space")]
    GrantRegionOverflow {
        /// Address of buffer 0.
        addr: u64,
    },
    /// A credit grant that lowers the limit or exceeds §2.1's maximum.
    #[error("credit grant to {limit} (current limit {current}, maximum 4096)")]
    CreditGrantRange {
        /// The new limit.
        limit: u64,
        /// The current limit.
        current: u32,
    },
    // ---- messages read by the receiver, §5.6 ----
    /// An RDV_READ or RDV_DONE though the hellos did not both offer §5.6.
    #[error("{kind} though reading messages was not negotiated")]
    ReadNotOffered {
        /// Kind name.
        kind: &'static str,
    },
    /// An RDV_READ while a rendezvous message was incomplete.
    #[error("RDV_READ inside a rendezvous message")]
    ReadInsideRendezvous,
    /// An RDV_READ beyond the announcements a side may have unanswered.
    #[error("more than {max} messages announced by RDV_READ and not answered")]
    TooManyReads {
        /// The most allowed (§5.6).
        max: u32,
    },
    /// An RDV_READ whose body is empty, larger than 1 GiB, or wraps around
    /// the address space.
    #[error("RDV_READ of {len} bytes at {addr:#x}: empty, over 1 GiB, or wrapping around the address space")]
    ReadRange {
        /// Address announced.
        addr: u64,
        /// Body length announced.
        len: u64,
    },
    /// An RDV_READ naming a message that is already being read.
    #[error("RDV_READ names message {id}, which is already being read")]
    ReadIdInUse {
        /// The id.
        id: u32,
    },
    /// An RDV_DONE for a message we did not announce (or answered twice).
    #[error("RDV_DONE for message {id}, which is not waiting to be read")]
    ReadDoneUnknown {
        /// The id.
        id: u32,
    },
    /// An RDV_DEST or RDV_WRITTEN on a connection that did not negotiate
    /// written destinations, or an RDV_WRITTEN to a side that grants none
    /// (§5.7).
    #[error("{kind} but written destinations were not negotiated (§5.7)")]
    DestNotOffered {
        /// Kind name.
        kind: &'static str,
    },
    /// An RDV_DEST for a message we did not announce, or one already
    /// granted a destination (§5.7).
    #[error("RDV_DEST for message {id}, which is not waiting for a destination")]
    DestUnknown {
        /// The id.
        id: u32,
    },
    /// An RDV_DEST whose length is not the announced body's, or whose range
    /// wraps the address space (§5.7).
    #[error("RDV_DEST for message {id} grants {len} bytes at {addr:#x}; the body has {body}")]
    DestRange {
        /// The id.
        id: u32,
        /// Address granted.
        addr: u64,
        /// Bytes granted.
        len: u64,
        /// Bytes of the body announced.
        body: u64,
    },
    /// An RDV_WRITTEN for a message we granted no destination, or one
    /// already written (§5.7).
    #[error("RDV_WRITTEN for message {id}, which has no destination waiting for it")]
    WrittenUnknown {
        /// The id.
        id: u32,
    },
    // ---- eager, §4.1 ----
    /// An EAGER message arrived while a rendezvous message was incomplete.
    #[error("eager message inside a rendezvous message")]
    EagerInsideRendezvous,
    /// CLOSE arrived while a rendezvous message was incomplete.
    #[error("CLOSE inside a rendezvous message")]
    CloseInsideRendezvous,
    /// An EAGER header's `len` disagrees with the SEND's length.
    #[error("eager length mismatch: header says {header} bytes, SEND carried {carried}")]
    EagerLengthMismatch {
        /// `len` in the header.
        header: u32,
        /// Payload bytes actually received.
        carried: usize,
    },
    // ---- rendezvous, §5.3 ----
    /// A CHUNK notification with bytes after the header.
    #[error("chunk notification with payload ({len} bytes)")]
    ChunkWithPayload {
        /// SEND length.
        len: usize,
    },
    /// A CHUNK names a buffer index we never advertised.
    #[error("chunk names unknown rendezvous buffer {index} (we advertised {count})")]
    ChunkUnknownBuffer {
        /// Index named.
        index: u32,
        /// Buffers advertised.
        count: u32,
    },
    /// A covering notification (§5.4) covers more chunks, itself
    /// included, than the peer holds grants for.
    #[error(
        "a chunk notification covers {chunks} rendezvous buffers, but the peer holds {held} grants"
    )]
    CoverExceedsGrants {
        /// Buffers the notification names: the covered ones and its own.
        chunks: u32,
        /// Buffers the peer holds.
        held: u32,
    },
    /// A CHUNK names a buffer that is not currently granted to the peer or
    /// not the next in round-robin order.
    #[error("chunk uses rendezvous buffer {index} not granted to the peer (expected {expected}, {held} held)")]
    ChunkBufferNotGranted {
        /// Index named.
        index: u32,
        /// The next buffer the peer may use.
        expected: u32,
        /// Buffers the peer holds.
        held: u32,
    },
    /// A CHUNK's address is not the advertised address of its buffer.
    #[error("chunk address {addr:#x} is not buffer {index} (at {expected:#x})")]
    ChunkWrongAddress {
        /// Buffer index.
        index: u32,
        /// Address in the header.
        addr: u64,
        /// Where that buffer is.
        expected: u64,
    },
    /// A CHUNK length of 0 or more than a buffer.
    #[error("chunk length {len} out of bounds (1..={max})")]
    ChunkLength {
        /// `len` in the header.
        len: u32,
        /// Buffer size.
        max: usize,
    },
    /// A rendezvous message longer than our `max_message`.
    #[error("message of {total} bytes exceeds max_message ({max})")]
    MessageTooLarge {
        /// Announced total.
        total: u64,
        /// Our limit.
        max: usize,
    },
    /// `total_len` changed between chunks of one message.
    #[error("total length changed between chunks ({was} then {now})")]
    ChunkTotalChanged {
        /// First chunk's total.
        was: u64,
        /// This chunk's total.
        now: u64,
    },
    /// The chunks add up to more than the announced total.
    #[error("chunk overruns the message: {end} bytes of {total}")]
    ChunkOverrun {
        /// Bytes with this chunk.
        end: u64,
        /// Announced total.
        total: u64,
    },
    /// LAST set on a chunk that does not complete the message, or missing on
    /// the one that does.
    #[error("LAST flag {} on a chunk ending at {end} of {total} bytes", if *.last { "set" } else { "missing" })]
    LastFlagWrong {
        /// Whether LAST was set.
        last: bool,
        /// Bytes with this chunk.
        end: u64,
        /// Announced total.
        total: u64,
    },
    // ---- completions, §7 ----
    /// A receive completion whose wr_id names an unknown slot or an old
    /// generation.
    #[error("stale or unknown receive completion {wr_id:#x}")]
    StaleReceive {
        /// The wr_id.
        wr_id: u64,
    },
    /// A completion with a wr_id of no known kind.
    #[error("completion with unknown wr_id {wr_id:#x}")]
    UnknownWrId {
        /// The wr_id.
        wr_id: u64,
    },
}

/// Why there is no RDMA device to use: the detail of [`Error::NoDevice`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoDeviceReason {
    /// rdma_cm has no device at all: creating an event channel failed (no
    /// RDMA support in the kernel, or no `/dev/infiniband/rdma_cm`).
    #[error("rdma_create_event_channel: {errno}")]
    NoRdmaCm {
        /// errno of `rdma_create_event_channel`.
        errno: Errno,
    },
    /// No RDMA device has the address a listener was to bind
    /// (`rdma_bind_addr` failed with ENODEV or EADDRNOTAVAIL).
    #[error("rdma_bind_addr({addr}): {errno}")]
    NotOnAddress {
        /// The address.
        addr: SocketAddr,
        /// errno of `rdma_bind_addr`.
        errno: Errno,
    },
    /// The cm_id is not bound to a device (its address was neither
    /// resolved nor bound).
    #[error("cm_id is not bound to a device")]
    Unbound,
    /// The device has no GID for the address on this port.
    #[error("no GID of {ip} on port {port} of the device")]
    NoGid {
        /// The address.
        ip: IpAddr,
        /// The device port.
        port: u8,
    },
    /// A shared receive pool's cm_id has no local address.
    #[error("the pool's address is unknown")]
    NoPoolAddress,
}

/// An invalid [`crate::Config`]: the detail of [`Error::Config`]. Displays
/// as `{field} {rule}`, e.g. `recv_slots must be in 4..=4096`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {rule}")]
#[non_exhaustive]
pub struct ConfigError {
    /// The field, as named in `Config`.
    pub field: &'static str,
    /// The rule its value breaks, e.g. `must be in 4..=4096`.
    pub rule: &'static str,
}

/// Memory that could not be had: the detail of [`Error::ResourceLimit`],
/// and of `engine::EngineError::Resource` (memory a message needs, on
/// demand).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResourceError {
    /// Registering `requested` more bytes would take the process over
    /// `Config::global_max_registered_bytes` (`cap`); `in_use` bytes were
    /// registered then.
    #[error("registering {requested} more bytes exceeds global_max_registered_bytes ({cap}); {in_use} in use")]
    RegisteredBytes {
        /// Bytes the registration needed.
        requested: usize,
        /// `Config::global_max_registered_bytes`.
        cap: usize,
        /// Bytes registered by the process before it.
        in_use: usize,
    },
    /// The allocator could not provide the buffer to register.
    #[error("allocation of {bytes} bytes failed")]
    Allocation {
        /// Bytes asked for.
        bytes: usize,
    },
    /// A listener's shared receive queue is full
    /// (`Config::shared_receive_max_buffers`, or the device's `max_srq_wr`).
    #[error("the shared receive queue holds at most {max} buffers (shared_receive_max_buffers or the device's max_srq_wr)")]
    SharedReceiveQueueFull {
        /// Buffers it holds at most.
        max: usize,
    },
    /// A verbs call that registers or exposes memory failed (`ibv_reg_mr`,
    /// `ibv_alloc_mw`, a memory-window bind, a post to the shared receive
    /// queue).
    #[error("{verb} failed: {errno}")]
    Verb {
        /// The failing call.
        verb: &'static str,
        /// errno after the call.
        errno: Errno,
    },
    /// Exposing `requested` more bytes to the peer would take this
    /// connection over `Config::max_exposed_bytes` (`cap`); `in_use` bytes
    /// were exposed on it then (§10.3).
    #[error("exposing {requested} more bytes exceeds max_exposed_bytes ({cap}) of this connection; {in_use} exposed")]
    ExposedBytes {
        /// Bytes the exposure needed.
        requested: usize,
        /// `Config::max_exposed_bytes`.
        cap: usize,
        /// Bytes this connection exposed before it.
        in_use: usize,
    },
    /// The connection was closed while memory was being set up for it.
    #[error("the connection is closed")]
    Closed,
    /// Any other failure, by its text.
    #[error("{0}")]
    Other(String),
}

impl ResourceError {
    /// The detail of a failed registration: the registration errors as they
    /// are, a failed verbs call as [`ResourceError::Verb`].
    pub(crate) fn from_error(e: Error) -> ResourceError {
        match e {
            Error::ResourceLimit(r) => r,
            Error::Verb { verb, errno } => ResourceError::Verb { verb, errno },
            e => ResourceError::Other(e.to_string()),
        }
    }
}

/// Why a one-sided operation or an exposure failed (wire protocol §10):
/// the detail of [`Error::Remote`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// `offset + len` lies beyond the region the key describes (checked
    /// here, before anything is posted).
    #[error(
        "{len} bytes at offset {offset} do not fit in the peer's region of {region_len} bytes"
    )]
    OutOfRange {
        /// Offset asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The key's `len`.
        region_len: u64,
    },
    /// The key does not grant the operation (checked here, before anything
    /// is posted).
    #[error("the peer exposed this region for {granted:?} access; {wanted:?} is not allowed")]
    AccessDenied {
        /// What the operation needs.
        wanted: crate::RemoteAccess,
        /// What the key grants.
        granted: crate::RemoteAccess,
    },
    /// The peer's NIC refused the operation (a remote access error): the key
    /// was revoked (stale), belongs to another connection, or does not
    /// cover the range or access asked for (a forged key). Keys survive a
    /// reopened side queue pair, so that is never the reason. The main
    /// connection is unaffected; ask the peer for a fresh key.
    #[error("the peer's NIC refused the one-sided operation ({status}): the key is revoked, stale, from another connection, or does not cover this range or access")]
    Refused {
        /// The work completion status, as `ibv_wc_status_str` names it.
        status: String,
    },
    /// A [`crate::Exposable::Shared`] buffer cannot be exposed for writing:
    /// other `Bytes` may share it. Expose a `BytesMut` instead.
    #[error("a shared (Bytes) buffer can only be exposed for Read; use Exposable::Owned (BytesMut) for write access")]
    SharedNotWritable,
    /// An empty buffer cannot be exposed.
    #[error("an empty buffer cannot be exposed")]
    Empty,
    /// One operation moves at most `max` bytes.
    #[error("a one-sided operation of {len} bytes exceeds the limit of {max} bytes; split it")]
    TooLarge {
        /// Bytes asked for.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// No one-sided channel to the peer: its reason (the peer does not
    /// offer one-sided access, the side queue pair could not be opened or
    /// failed twice for this operation, ...).
    #[error("one-sided access unavailable: {0}")]
    Unavailable(String),
    /// The connection is closed (locally or by the peer).
    #[error("one-sided access unavailable: the connection is closed")]
    Closed,
}

/// Why a listener rejected a connect request, as the connecting side reads
/// it from the reject's private data (wire protocol §2.3, §2.4): the detail
/// of [`Error::Rejected`]. `Display` is the text the listener sent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectReason {
    /// A limit of the listener refused it (`max_pending_handshakes`,
    /// `max_pending_handshakes_per_address`, `max_connections_per_address`).
    Busy,
    /// The listener's admission gate refused it (§2.4): its text, which
    /// starts with `unauthenticated`.
    Unauthenticated(String),
    /// The listener could not decode our hello.
    BadHello,
    /// The listener could not create the connection's resources (e.g. its
    /// registered-memory cap).
    Resources,
    /// Nobody listens there (iWARP: the TCP connect was refused).
    ConnectionRefused,
    /// Any other text the listener sent (e.g. another gate's).
    Other(String),
}

impl RejectReason {
    const BUSY: &'static str = "busy: too many connections or handshakes from this address";
    const BAD_HELLO: &'static str = "bad hello";
    const RESOURCES: &'static str = "resources";

    /// The text, as a listener sends it in the reject's private data.
    pub(crate) fn text(&self) -> &str {
        match self {
            RejectReason::Busy => Self::BUSY,
            RejectReason::BadHello => Self::BAD_HELLO,
            RejectReason::Resources => Self::RESOURCES,
            RejectReason::ConnectionRefused => "connection refused",
            RejectReason::Unauthenticated(s) | RejectReason::Other(s) => s,
        }
    }

    /// The reason in a reject's private data: `None` when it holds no text
    /// (e.g. no listener on that port, on InfiniBand/RoCE), or one that is
    /// not UTF-8 or holds control characters.
    pub(crate) fn from_private_data(data: &[u8]) -> Option<RejectReason> {
        let s = std::str::from_utf8(data).ok()?.trim_end_matches('\0');
        if s.is_empty() || s.chars().any(char::is_control) {
            return None;
        }
        Some(match s {
            Self::BUSY => RejectReason::Busy,
            Self::BAD_HELLO => RejectReason::BadHello,
            Self::RESOURCES => RejectReason::Resources,
            s if s.starts_with("unauthenticated") => RejectReason::Unauthenticated(s.to_string()),
            s => RejectReason::Other(s.to_string()),
        })
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.text())
    }
}

/// `": {reason}"`, or nothing without one (the end of
/// [`Error::Rejected`]'s text).
fn reject_suffix(reason: &Option<RejectReason>) -> String {
    reason
        .as_ref()
        .map(|r| format!(": {r}"))
        .unwrap_or_default()
}

/// Errors of the RDMA transport.
///
/// For automatic TCP fallback, [`Error::is_unavailable_for_fallback`] tells
/// whether RDMA is simply not usable to reach that peer (no device, address
/// not reachable over RDMA, nobody listening, setup timed out) as opposed to
/// a failure of an established connection.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No RDMA device / no RDMA support in the kernel (which: the
    /// [`NoDeviceReason`]).
    #[error("no RDMA device available: {0}")]
    NoDevice(NoDeviceReason),
    /// The RDMA user-space libraries (`libibverbs.so.1`, `librdmacm.so.1`)
    /// could not be loaded, or lack a function this crate calls: RDMA is
    /// unavailable in this process. The text is the loader's, e.g.
    /// `libibverbs.so.1: cannot open shared object file: No such file or
    /// directory`. See [`crate::check_libraries`].
    #[error("RDMA libraries not installed ({0})")]
    LibraryUnavailable(String),
    /// `rdma_resolve_addr` failed: the address is not reachable over RDMA.
    #[error("rdma_resolve_addr to {addr} failed: {reason}")]
    AddrResolve {
        /// Destination.
        addr: SocketAddr,
        /// Event status / errno text.
        reason: String,
    },
    /// `rdma_resolve_route` failed.
    #[error("rdma_resolve_route to {addr} failed: {reason}")]
    RouteResolve {
        /// Destination.
        addr: SocketAddr,
        /// Event status / errno text.
        reason: String,
    },
    /// The peer (or its CM) rejected the connection: typically no listener on
    /// that port (`RDMA_CM_EVENT_REJECTED`), or the listener refused our
    /// parameters, a limit, or our ticket (wire §2.4: its admission gate's
    /// text, e.g. `unauthenticated: ...`); then `reason` says why.
    #[error("connection rejected by {addr} (status {status}){}", reject_suffix(.reason))]
    Rejected {
        /// Destination.
        addr: SocketAddr,
        /// CM reject status (IB: 8 = invalid service id, i.e. no listener; 28 = consumer reject).
        status: i32,
        /// The reason in the peer's private data, if it sent one.
        reason: Option<RejectReason>,
    },
    /// `RDMA_CM_EVENT_UNREACHABLE` / `CONNECT_ERROR`.
    #[error("peer {addr} unreachable (status {status})")]
    Unreachable {
        /// Destination.
        addr: SocketAddr,
        /// Event status.
        status: i32,
    },
    /// A connection-setup stage timed out.
    #[error("timeout during {stage}")]
    Timeout {
        /// "resolve_addr", "resolve_route", "connect", "accept".
        stage: &'static str,
    },
    /// A verbs / rdma_cm call failed.
    #[error("{verb} failed: {errno}")]
    Verb {
        /// The failing call.
        verb: &'static str,
        /// errno after the call.
        errno: Errno,
    },
    /// A work completion finished with an error status (e.g. retry exceeded
    /// when the peer died).
    #[error("work completion error: {status_str} (status {status}, {what})")]
    Completion {
        /// Raw `ibv_wc_status`.
        status: u32,
        /// `ibv_wc_status_str`.
        status_str: String,
        /// "recv" or "send".
        what: &'static str,
    },
    /// The peer violated the wire protocol (which rule: the
    /// [`PeerMisbehaved`] variant); the connection was closed, or, for a bad
    /// hello, never established.
    #[error("protocol error: {0}")]
    Protocol(#[source] PeerMisbehaved),
    /// The peer disconnected (or the connection was torn down) without a
    /// clean close.
    #[error("connection lost: peer disconnected")]
    Disconnected,
    /// This half was closed locally.
    #[error("connection closed locally")]
    Closed,
    /// Message exceeds the negotiated `max_message_bytes`.
    #[error("message of {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// Message length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// Invalid [`crate::Config`] (which field, which rule: the
    /// [`ConfigError`]).
    #[error("invalid config: {0}")]
    Config(ConfigError),
    /// Memory could not be had: a global resource limit (e.g. registered
    /// memory) would be exceeded, or registering failed (which: the
    /// [`ResourceError`]).
    #[error("resource limit: {0}")]
    ResourceLimit(ResourceError),
    /// A one-sided operation or an exposure failed (which way: the
    /// [`RemoteError`]); the connection's messages are unaffected.
    #[error("remote memory: {0}")]
    Remote(RemoteError),
}

impl Error {
    /// True when the error means "RDMA is not available for this peer" and a
    /// caller may transparently fall back to TCP: [`Error::NoDevice`],
    /// [`Error::LibraryUnavailable`],
    /// [`Error::AddrResolve`], [`Error::RouteResolve`], [`Error::Rejected`],
    /// [`Error::Unreachable`], and [`Error::Timeout`] during connection setup.
    /// Errors on an established connection (Protocol, Disconnected,
    /// Completion, ...) are not fallback reasons.
    pub fn is_unavailable_for_fallback(&self) -> bool {
        matches!(
            self,
            Error::NoDevice(_)
                | Error::LibraryUnavailable(_)
                | Error::AddrResolve { .. }
                | Error::RouteResolve { .. }
                | Error::Rejected { .. }
                | Error::Unreachable { .. }
                | Error::Timeout { .. }
        )
    }
}

impl From<Error> for std::io::Error {
    /// Maps to an `io::ErrorKind` (Disconnected → ConnectionReset,
    /// Rejected → ConnectionRefused, Timeout → TimedOut, ...), keeping the
    /// original error as the source.
    fn from(e: Error) -> std::io::Error {
        use std::io::ErrorKind as K;
        let kind = match &e {
            Error::NoDevice(_) | Error::LibraryUnavailable(_) => K::Unsupported,
            Error::AddrResolve { .. } | Error::RouteResolve { .. } | Error::Unreachable { .. } => {
                K::HostUnreachable
            }
            Error::Rejected { .. } => K::ConnectionRefused,
            Error::Timeout { .. } => K::TimedOut,
            Error::Disconnected | Error::Completion { .. } => K::ConnectionReset,
            Error::Closed => K::BrokenPipe,
            Error::Protocol(_) => K::InvalidData,
            Error::MessageTooLarge { .. } | Error::Config(_) => K::InvalidInput,
            Error::ResourceLimit(_) => K::OutOfMemory,
            Error::Verb { .. } => K::Other,
            Error::Remote(r) => match r {
                RemoteError::OutOfRange { .. }
                | RemoteError::SharedNotWritable
                | RemoteError::Empty
                | RemoteError::TooLarge { .. } => K::InvalidInput,
                RemoteError::AccessDenied { .. } | RemoteError::Refused { .. } => {
                    K::PermissionDenied
                }
                RemoteError::Unavailable(_) => K::Unsupported,
                RemoteError::Closed => K::BrokenPipe,
            },
        };
        std::io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reject_reason_is_parsed_from_the_private_data_and_displays_as_sent() {
        let p = RejectReason::from_private_data;
        for r in [
            RejectReason::Busy,
            RejectReason::BadHello,
            RejectReason::Resources,
            RejectReason::Unauthenticated("unauthenticated: no ticket".into()),
            RejectReason::Other("go away".into()),
        ] {
            let mut data = r.text().as_bytes().to_vec();
            assert_eq!(p(&data).as_ref(), Some(&r));
            // InfiniBand pads the reject's private data with zeros.
            data.resize(148, 0);
            assert_eq!(p(&data).as_ref(), Some(&r));
        }
        assert_eq!(p(b""), None);
        assert_eq!(p(&[0; 148]), None);
        assert_eq!(p(b"bad\nhello"), None, "control characters");
        assert_eq!(p(&[0xff, 0xfe]), None, "not UTF-8");
        let addr: SocketAddr = "192.0.2.1:7471".parse().unwrap();
        let e = |reason| Error::Rejected {
            addr,
            status: 28,
            reason,
        };
        assert_eq!(
            e(None).to_string(),
            "connection rejected by 192.0.2.1:7471 (status 28)"
        );
        assert_eq!(
            e(Some(RejectReason::Busy)).to_string(),
            "connection rejected by 192.0.2.1:7471 (status 28): busy: too many connections or \
             handshakes from this address"
        );
        assert_eq!(
            e(Some(RejectReason::ConnectionRefused)).to_string(),
            "connection rejected by 192.0.2.1:7471 (status 28): connection refused"
        );
    }

    #[test]
    fn typed_details_keep_the_message_texts() {
        let r = Error::ResourceLimit(ResourceError::RegisteredBytes {
            requested: 4096,
            cap: 1 << 20,
            in_use: 1 << 20,
        });
        assert_eq!(
            r.to_string(),
            "resource limit: registering 4096 more bytes exceeds global_max_registered_bytes \
             (1048576); 1048576 in use"
        );
        assert_eq!(
            ResourceError::from_error(r.clone()),
            ResourceError::RegisteredBytes {
                requested: 4096,
                cap: 1 << 20,
                in_use: 1 << 20,
            }
        );
        let v = Error::Verb {
            verb: "ibv_reg_mr",
            errno: Errno(libc::ENOMEM),
        };
        let rv = ResourceError::from_error(v.clone());
        assert!(matches!(
            rv,
            ResourceError::Verb {
                verb: "ibv_reg_mr",
                ..
            }
        ));
        assert_eq!(rv.to_string(), v.to_string());
        let c = crate::Config {
            recv_slots: 1,
            ..crate::Config::default()
        };
        match c.validate() {
            Err(e @ Error::Config(ConfigError { field, .. })) => {
                assert_eq!(field, "recv_slots");
                assert_eq!(
                    e.to_string(),
                    "invalid config: recv_slots must be in 4..=4096"
                );
            }
            r => panic!("{r:?}"),
        }
        assert_eq!(
            Error::NoDevice(NoDeviceReason::Unbound).to_string(),
            "no RDMA device available: cm_id is not bound to a device"
        );
    }
}
