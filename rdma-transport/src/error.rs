//! Error type.

use std::fmt;
use std::net::SocketAddr;

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
    /// The hello's `TICKET` flag is set but the private data is too short
    /// to hold the ticket after the hello (§2.4).
    #[error("bad hello: ticket flag set but private data has {len} bytes (need {need})")]
    HelloTicketTooShort {
        /// Bytes received.
        len: usize,
        /// `wire::HELLO_TICKET_LEN`.
        need: usize,
    },
    /// The accepting side's hello carries a ticket (§2.4: only the
    /// connecting side presents one).
    #[error("bad hello: the accepting side's hello carries a ticket")]
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

/// Errors of the RDMA transport.
///
/// For automatic TCP fallback, [`Error::is_unavailable_for_fallback`] tells
/// whether RDMA is simply not usable to reach that peer (no device, address
/// not reachable over RDMA, nobody listening, setup timed out) as opposed to
/// a failure of an established connection.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No RDMA device / no RDMA support in the kernel.
    #[error("no RDMA device available: {0}")]
    NoDevice(String),
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
    #[error("connection rejected by {addr} (status {status}){reason}")]
    Rejected {
        /// Destination.
        addr: SocketAddr,
        /// CM reject status (IB: 8 = invalid service id, i.e. no listener; 28 = consumer reject).
        status: i32,
        /// Reason text from the peer's private data, if any.
        reason: String,
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
    /// Invalid [`crate::Config`].
    #[error("invalid config: {0}")]
    Config(String),
    /// A global resource limit (e.g. registered memory) would be exceeded.
    #[error("resource limit: {0}")]
    ResourceLimit(String),
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
        };
        std::io::Error::new(kind, e)
    }
}
