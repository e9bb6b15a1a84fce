//! The sans-IO protocol engine of one connection: it owns the protocol
//! state (credits, the receive and send rings, rendezvous, close) and
//! decides every work request; no verbs call happens here. It consumes
//! completions and returns [`Action`]s naming buffers by slot index, and
//! [`Event`]s for the application; the driver (or a test simulator)
//! executes the actions on registered memory it reaches through
//! [`Buffers`].
//!
//! [`Engine`] is one state machine; its methods are grouped by concern:
//!
//! * `credits`: send credits and their returns (§4.2, §4.3), grants that
//!   grow the receive ring (§4.6), revokes that shrink it (§4.7),
//! * `recv_ring`: receive completions, header validation and reposting
//!   (§4.1, §4.3),
//! * `send_ring`: the send queue, send slots, selective signalling (§7) and
//!   keepalives (§4.4),
//! * `rendezvous`: chunks written into the peer's region and landed in
//!   ours (§5), and the regions on demand (§5.5),
//! * `read`: messages the receiver reads (§5.6),
//! * `dest`: messages written into a destination the receiver grants for
//!   them (§5.7),
//! * `close`: CLOSE and its confirmation (§6),
//! * `idle`: what an idle interval gives back (memory on demand, §5.5),
//! * `clock`: time as an input: setup kicks, keepalive, idle release and
//!   the receive back-pressure limit (§2.3, §4.4, §4.5, §5.5).
//!
//! The per-concern steps that [`Engine::on_completion`] and
//! [`Engine::progress`] run are `#[inline]`: each has its one caller in
//! another file, and inlined they cost what one function did.
//!
//! Section numbers (§) refer to `docs/wire-protocol-rdma.md`.

mod clock;
mod close;
mod credits;
mod dest;
mod idle;
mod read;
mod reasm_buf;
mod recv_buf;
mod recv_ring;
mod rendezvous;
mod send_ring;
pub mod wire;

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

pub use self::clock::{Fired, TimerConfig, SETUP_KICK_FIRST, SETUP_KICK_LAST};
use self::credits::Revoke;
pub use self::read::ExposedBody;
use self::read::{Inbound, ReadJob};
use self::rendezvous::{LocalRdv, PeerRdv, Reassembly};
use self::send_ring::{Held, Outgoing};
use self::wire::{Hello, HDR_LEN};
pub use crate::error::{PeerMisbehaved, ResourceError};

/// Access to the registered memory the engine reads and writes (copies only).
pub trait Buffers {
    /// Receive slot `i` (full slot). Only called between the slot's receive
    /// completion and its repost, when nothing can write it (the pool is
    /// not remotely writable, and the NIC is done with it).
    fn recv_slot(&self, i: u32) -> &[u8];
    /// Send slot `i` (full slot), written before a SEND is posted from it.
    fn send_slot(&mut self, i: u32) -> &mut [u8];
    /// Appends the first `len` bytes of our advertised rendezvous buffer `i`
    /// to `out` (`len` ≤ the buffer size). The peer may RDMA-WRITE into that
    /// buffer at any time, even during the copy, so an implementation must
    /// never form a `&[u8]` over it: it copies through raw pointers
    /// (`docs/buffer-ownership.md`, "Note on a hostile peer").
    fn append_rdv(&self, i: u32, len: usize, out: &mut BytesMut);
    /// Local staging buffer `i`, source of RDMA WRITEs. Only called while
    /// the staging buffers are open ([`open_staging`](Self::open_staging)).
    fn staging(&mut self, i: u32) -> &mut [u8];
    /// Memory on demand (§5.5): registers our rendezvous region and returns
    /// (address of buffer 0, rkey), or why it cannot (the registered-memory
    /// cap). Called only while the region is not registered.
    ///
    /// # Errors
    ///
    /// What could not be registered or bound ([`ResourceError`]).
    fn open_rdv(&mut self) -> Result<(u64, u32), ResourceError>;
    /// Deregisters our rendezvous region: the peer released it (§5.5), so
    /// no WRITE of its can still arrive for it.
    fn close_rdv(&mut self);
    /// Registers the staging buffers (memory on demand, §5.5).
    ///
    /// # Errors
    ///
    /// What could not be registered ([`ResourceError`]).
    fn open_staging(&mut self) -> Result<(), ResourceError>;
    /// Releases the staging buffers: no posted WRITE uses any of them.
    fn close_staging(&mut self);
    /// Makes send slots `0..n` usable (registers what is missing; §4.6).
    ///
    /// # Errors
    ///
    /// What could not be registered ([`ResourceError`]); the ring keeps its
    /// size.
    fn grow_send(&mut self, n: u32) -> Result<(), ResourceError>;
    /// Keeps send slots `0..n` only: none at or above `n` is in use.
    fn shrink_send(&mut self, n: u32);
    /// Makes receive slots `0..n` usable (registers what is missing; §4.6);
    /// the engine posts them.
    ///
    /// # Errors
    ///
    /// What could not be registered or reserved ([`ResourceError`]); the
    /// ring keeps its size.
    fn grow_recv(&mut self, n: u32) -> Result<(), ResourceError>;
    /// §4.7: the peer released credits, so receive slots `n..` are retired:
    /// none is posted again, and those still posted are withdrawn (only
    /// possible with a shared receive queue, where "posted" is a slot queued
    /// for the next buffer the SRQ fills). Called only by an engine with
    /// [`EngineConfig::revoke_idle`]; the slot the current message arrived
    /// in may be among them (its header was read already).
    fn shrink_recv(&mut self, _n: u32) {}
    /// Zero-copy send (§5.1): registers `body`, the payload of a rendezvous
    /// message, as the source its chunks are RDMA-WRITTEN from, and returns
    /// the id [`WriteSource::id`] names it by; `None` to copy it into the
    /// staging buffers instead (registration failed, or the cap on
    /// registered memory is reached). The implementation keeps `body` (a
    /// clone) and its registration until [`release_source`](Self::release_source).
    fn register_source(&mut self, _body: &Bytes) -> Option<u32> {
        None
    }
    /// Every work request reading source `id` has completed: its
    /// registration and its bytes may go.
    fn release_source(&mut self, _id: u32) {}
    /// §5.6: makes `body`, the payload of a message the peer will read,
    /// readable by the peer's RDMA READs on this connection and by nothing
    /// else (no write access), keeping it (a clone) until
    /// [`release_source`](Self::release_source); `None` to send it by
    /// WRITE instead (registration failed, or the cap is reached).
    fn expose_source(&mut self, _body: &Bytes) -> Option<ExposedBody> {
        None
    }
    /// §5.6: a buffer of our own of `head.len() + len` bytes, registered
    /// for our READ alone (the peer has no key to it), starting with
    /// `head`; the engine READs the body into it after `head`.
    ///
    /// # Errors
    ///
    /// What could not be registered ([`ResourceError`]).
    fn open_dest(&mut self, _head: &[u8], _len: usize) -> Result<u32, ResourceError> {
        Err(ResourceError::Other(
            "no memory for messages read from the peer".into(),
        ))
    }
    /// §5.7: makes bytes `off..off + len` of destination `id`
    /// ([`open_dest`](Self::open_dest)) writable by this connection's
    /// peer alone, until [`take_dest`](Self::take_dest) revokes it; with
    /// `bind`, through a window [`Action::BindDest`] binds. The peer may
    /// write those bytes at any time until then: nothing reads them.
    ///
    /// # Errors
    ///
    /// What could not be granted ([`ResourceError`]): the engine reads the
    /// message instead.
    fn expose_dest(
        &mut self,
        _id: u32,
        _off: usize,
        _len: usize,
    ) -> Result<ExposedBody, ResourceError> {
        Err(ResourceError::Other(
            "no destinations the peer writes".into(),
        ))
    }
    /// §5.6: memory on demand: no READ for an idle interval, none in
    /// progress; the buffers kept for the next ones may go (those the
    /// application still holds go when it drops them).
    fn close_read_cache(&mut self) {}
    /// §5.6: the READ into destination `id` completed, or §5.7: the peer
    /// wrote it: the whole buffer, handed up (the engine never touches it
    /// again), once any access the peer had to it is revoked.
    ///
    /// # Errors
    ///
    /// The buffer could not be deregistered ([`ResourceError`]).
    fn take_dest(&mut self, _id: u32) -> Result<Bytes, ResourceError> {
        Err(ResourceError::Other(
            "no memory for messages read from the peer".into(),
        ))
    }
}

/// Most a rendezvous message reserves before its data arrived (§5.3).
pub const REASSEMBLY_RESERVE: usize = 4 << 20;

/// wr_id kind tag for receive work requests (§7).
pub const WR_RECV: u64 = 1;

/// wr_id kind tag for send-queue work requests (§7).
pub const WR_SQ: u64 = 2;

/// Encodes a receive wr_id: kind | generation | slot (§7).
pub fn recv_wr_id(slot: u32, gen: u32) -> u64 {
    (WR_RECV << 56) | (((gen & 0xff_ffff) as u64) << 32) | slot as u64
}

/// Encodes a send-queue wr_id: kind | sequence number (§7).
pub fn sq_wr_id(seq: u64) -> u64 {
    (WR_SQ << 56) | sq_seq(seq)
}

/// The sequence number of a send-queue wr_id (§7).
pub(crate) fn sq_seq(wr_id: u64) -> u64 {
    wr_id & ((1 << 56) - 1)
}

/// Work the driver must post, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Post a receive of the whole receive slot.
    PostRecv {
        /// Receive slot index.
        slot: u32,
        /// Work request id.
        wr_id: u64,
    },
    /// Post a SEND of `len` bytes from send slot `slot`.
    PostSend {
        /// Send slot index.
        slot: u32,
        /// Bytes (header included).
        len: usize,
        /// Work request id.
        wr_id: u64,
        /// Request a completion.
        signaled: bool,
        /// Use IBV_SEND_INLINE.
        inline: bool,
    },
    /// RDMA WRITE `len` bytes of staging buffer `staging` to (`remote_addr`,
    /// `rkey`); with a `source`, its first `source.head` bytes from the start
    /// of staging buffer `staging` and the rest from the registered source.
    PostWrite {
        /// Staging buffer index (unused with a source whose `head` is 0).
        staging: u32,
        /// Bytes.
        len: usize,
        /// Peer virtual address.
        remote_addr: u64,
        /// Peer rkey.
        rkey: u32,
        /// Work request id.
        wr_id: u64,
        /// Request a completion.
        signaled: bool,
        /// Post as RDMA WRITE with this immediate data (§5.4): the chunk
        /// notification, consuming one of the peer's receive buffers.
        imm: Option<u32>,
        /// Zero-copy send (§5.1): the registered message the bytes come from.
        source: Option<WriteSource>,
    },
    /// §5.6: bind the memory window of exposed source `id`
    /// ([`Buffers::expose_source`]) on our queue pair, with the rkey it
    /// chose: posted before the RDV_READ that announces it.
    BindSource {
        /// The exposed source.
        id: u32,
        /// Work request id.
        wr_id: u64,
        /// Request a completion.
        signaled: bool,
    },
    /// §5.7: bind the memory window of destination `dest`
    /// ([`Buffers::expose_dest`]) on our queue pair, with the rkey it
    /// chose: posted before the RDV_DEST that grants it.
    BindDest {
        /// The destination.
        dest: u32,
        /// Work request id.
        wr_id: u64,
        /// Request a completion.
        signaled: bool,
    },
    /// §5.6, the copy fallback: RDMA READ `len` bytes at (`remote_addr`,
    /// `rkey`) into staging buffer `staging`; always signalled.
    PostReadStaging {
        /// Staging buffer index.
        staging: u32,
        /// Bytes (at most a staging buffer).
        len: usize,
        /// Peer virtual address.
        remote_addr: u64,
        /// Peer rkey.
        rkey: u32,
        /// Work request id.
        wr_id: u64,
    },
    /// §5.6: RDMA READ `len` bytes at (`remote_addr`, `rkey`) into read
    /// destination `dest` ([`Buffers::open_dest`]) from offset `off`;
    /// always signalled.
    PostRead {
        /// Destination.
        dest: u32,
        /// Offset in it.
        off: usize,
        /// Bytes.
        len: usize,
        /// Peer virtual address.
        remote_addr: u64,
        /// Peer rkey.
        rkey: u32,
        /// Work request id.
        wr_id: u64,
    },
}

/// Where a zero-copy chunk's bytes are (§5.1): `head` bytes from the
/// staging buffer (the part of the message's head in this chunk, copied
/// there), then the rest of the chunk from offset `off` of source `id`
/// ([`Buffers::register_source`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSource {
    /// The source, as [`Buffers::register_source`] named it.
    pub id: u32,
    /// Offset in the source of the chunk's first byte after `head`.
    pub off: usize,
    /// Bytes at the start of the chunk that come from the staging buffer.
    pub head: usize,
}

/// Something the engine tells the application side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A complete message, already copied out of registered memory.
    Message(Bytes),
    /// The peer closed its sending direction (§6).
    PeerClosed,
}

/// A completion as the engine sees it.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    /// wr_id of the work request.
    pub wr_id: u64,
    /// Whether the status was IBV_WC_SUCCESS.
    pub ok: bool,
    /// Raw status (for error messages).
    pub status: u32,
    /// Bytes received (receives only; for an RDMA WRITE with immediate
    /// data, the bytes the WRITE placed).
    pub byte_len: u32,
    /// Immediate data that came with a receive completion (§5.4).
    pub imm: Imm,
}

/// Immediate data of a receive completion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Imm {
    /// None: a plain SEND (or not a receive).
    #[default]
    None,
    /// An RDMA WRITE with immediate data landed (`IBV_WC_RECV_RDMA_WITH_IMM`):
    /// a chunk notification (§5.4).
    Write(u32),
    /// A SEND with immediate data: never sent by this protocol.
    Send(u32),
}

/// Engine failures: all are fatal for the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// The peer violated the protocol.
    Protocol(PeerMisbehaved),
    /// Memory a message needs could not be registered (the cap).
    Resource(ResourceError),
    /// A work completion failed.
    Completion {
        /// Raw ibv_wc_status.
        status: u32,
        /// Whether it was a receive.
        recv: bool,
    },
}

/// Static parameters of one connection (local config + the peer's [`Hello`]).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Number of local receive slots (the most the ring may grow to).
    pub recv_slots: u32,
    /// Receive slots posted at first = the credits our hello grants.
    pub initial_recv_slots: u32,
    /// Bytes per local receive slot.
    pub recv_slot_bytes: usize,
    /// Number of local send slots (the most the send ring may grow to).
    pub send_slots: u32,
    /// Send slots usable at first (more are registered on demand).
    pub initial_send_slots: u32,
    /// Bytes per local send slot.
    pub send_slot_bytes: usize,
    /// Payloads up to this size go eager (further capped by slot sizes).
    pub rendezvous_threshold: usize,
    /// Our rendezvous region: buffer count.
    pub rdv_count: u32,
    /// Our rendezvous region: bytes per buffer.
    pub rdv_bytes: usize,
    /// Our rendezvous region: address of buffer 0 (unused when `on_demand`).
    pub rdv_addr: u64,
    /// Our hello offered memory on demand (§2.1 flags): our rendezvous
    /// region is registered when the peer asks (§5.5) and our receive ring
    /// grows by credit grants (§4.6). Staging buffers are opened on demand
    /// whatever this says.
    pub on_demand: bool,
    /// Number of local staging buffers.
    pub staging_count: u32,
    /// Bytes per staging buffer.
    pub staging_bytes: usize,
    /// Rendezvous payloads (the message's body, §5.1) of at least this many
    /// bytes are RDMA-WRITTEN from where they are, registered on the fly
    /// ([`Buffers::register_source`]), not copied into staging buffers. 0:
    /// never.
    pub zero_copy_min: usize,
    /// Largest message we accept.
    pub max_message: usize,
    /// Signal at least every k-th send-queue work request.
    pub signal_every: u32,
    /// Device max_inline_data for this QP.
    pub max_inline: usize,
    /// Both hellos offered RDMA WRITE with immediate data (§2.1 flags,
    /// §5.4): chunks are notified by the WRITE's immediate, not a SEND.
    pub write_imm: bool,
    /// Both hellos offered reading (§2.1 flags, §5.6): a rendezvous body of
    /// at least `zero_copy_min` bytes is announced by RDV_READ and read by
    /// the receiver, and the peer's are read.
    pub read_rdv: bool,
    /// Both hellos offered written destinations (§2.1 flags, §5.7): the
    /// peer may answer our RDV_READ with RDV_DEST, and we WRITE the body
    /// there.
    pub write_dest: bool,
    /// We answer the peer's RDV_READ with RDV_DEST (§5.7): `write_dest`,
    /// and our memory can grant a destination to this peer alone (a
    /// type-2 window bound to our queue pair).
    pub grant_dest: bool,
    /// Both hellos offered covering notifications (§2.1 flags, §5.4): one
    /// notification (an immediate, or a CHUNK SEND) may notify the chunks
    /// WRITTEN before it.
    pub covers: bool,
    /// The device executes a zero-length RDMA WRITE without checking its
    /// address and rkey (InfiniBand/RoCE, IB spec C9-88): keepalives (§4.4)
    /// while no region of the peer's is held are such a WRITE, invisible to
    /// the peer's CPU. Otherwise (iWARP) they are a CREDIT message.
    pub zero_length_write_any_rkey: bool,
    /// §4.7: take back, after an idle interval, the credits granted beyond
    /// the initial ones (a REVOKE / RELEASED exchange), if the peer's hello
    /// says it answers revokes. Only where the receive buffers come from a
    /// shared receive queue: a posted receive cannot be withdrawn from a QP.
    pub revoke_idle: bool,
    /// The peer's hello.
    pub peer: Hello,
}

impl EngineConfig {
    /// Largest payload sent eagerly on this connection (§4.1).
    pub fn eager_max(&self) -> usize {
        let slot = self.send_slot_bytes.min(self.peer.recv_slot_bytes as usize);
        self.rendezvous_threshold.min(slot - HDR_LEN)
    }
    /// Rendezvous chunk size (§5.2).
    pub fn chunk_bytes(&self) -> usize {
        self.staging_bytes.min(self.peer.rdv_bytes as usize)
    }
    /// Send slots usable at first (`initial_send_slots`, at least 4 unless
    /// the ring is smaller, at most `send_slots`).
    pub fn initial_send(&self) -> u32 {
        self.initial_send_slots
            .clamp(4.min(self.send_slots), self.send_slots)
    }
    /// Send-queue depth the QP needs.
    pub fn sq_depth(&self) -> u32 {
        self.send_slots + self.staging_count + 1
    }
}

/// Counters the engine maintains; the driver copies them into stats.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EngineCounters {
    /// Messages submitted and fully handed to the NIC.
    pub msgs_sent: u64,
    /// Messages delivered.
    pub msgs_recv: u64,
    /// Eager SENDs.
    pub eager_sends: u64,
    /// Inline SENDs.
    pub inline_sends: u64,
    /// RDMA WRITEs posted.
    pub rdv_writes: u64,
    /// Bytes RDMA-written.
    pub rdv_bytes: u64,
    /// Of those, bytes written from a registered source, not a staging
    /// buffer (zero-copy send, §5.1).
    pub zero_copy_bytes: u64,
    /// Explicit credit messages sent.
    pub credit_msgs: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_recv: u64,
    /// Credit grants sent: the receive ring grew (§4.6).
    pub credit_grants: u64,
    /// Credit revokes the peer released: the receive ring went back to its
    /// initial size (§4.7).
    pub credit_revokes: u64,
    /// Messages announced by RDV_READ for the peer to read (§5.6).
    pub read_announced: u64,
    /// Bytes read from the peer by RDMA READ (§5.6).
    pub read_bytes: u64,
    /// Of the messages read, those read through the staging buffers and
    /// copied, no buffer of their own registrable (§5.6).
    pub reads_staged: u64,
    /// Bytes the peer RDMA-WROTE into destinations we granted its messages
    /// (§5.7).
    pub dest_bytes: u64,
}

/// The per-connection protocol state machine.
pub struct Engine {
    cfg: EngineConfig,
    eager_max: usize,
    chunk: usize,
    // --- send side (§4.2, §5.2, §7) ---
    credits: u32,
    /// The peer's current credit limit for us (its hello's credits, raised
    /// by grants, §4.6).
    credit_limit: u32,
    /// Send slots usable now (`0..send_active`, §4.6).
    send_active: u32,
    /// Send slots the ring may still grow to (lowered when registering fails).
    send_max: u32,
    /// Staging buffers registered (§5.5).
    staging_open: bool,
    /// A chunk was written since the last idle tick.
    staging_used: bool,
    /// §5.4 covering notifications: chunks WRITTEN without an immediate
    /// since the last notification of the message under way.
    covering: u32,
    peer_rdv: PeerRdv,
    peer_rdv_addr: u64,
    peer_rdv_rkey: u32,
    free_send: VecDeque<u32>,
    free_staging: VecDeque<u32>,
    records: VecDeque<(u64, Option<Held>)>,
    /// Zero-copy sources (§5.1) by the sequence number of the last work
    /// request reading them: released when a completion covers it.
    sources: VecDeque<(u64, u32)>,
    next_seq: u64,
    unsignaled_run: u32,
    peer_rdv_next: u32,
    peer_rdv_avail: u32,
    pending: VecDeque<Outgoing>,
    pending_bytes: usize,
    close_sent: bool,
    /// §5.6: the bodies announced by RDV_READ and not answered.
    exposed: Vec<dest::Announced>,
    /// §5.7: bodies to WRITE into the destinations the peer granted, in
    /// the order granted.
    dest_due: VecDeque<dest::DestDue>,
    /// §5.6: messages being read from the peer, in order.
    reads: VecDeque<ReadJob>,
    /// §5.6: READs posted and not yet completed (on the send queue, but not
    /// in `records`: each is finished by its own completion only).
    sq_reads: u32,
    /// §5.6: RDV_DONEs to send.
    done_due: VecDeque<u32>,
    /// §5.6: buffers for messages read from the peer may be kept
    /// ([`Buffers::close_read_cache`] not called since the last READ).
    read_cache_open: bool,
    /// §5.6: a READ started since the last idle tick.
    read_used: bool,
    // --- receive side (§4.3, §5.3) ---
    recv_gen: Vec<u32>,
    /// Receive slots posted (`0..recv_active`) = the peer's credit limit.
    recv_active: u32,
    /// The ring may still grow to this (lowered when registering fails).
    recv_max: u32,
    /// A credit grant (§4.6) to send: the new limit.
    grant_due: bool,
    /// §4.7: our credit revoke.
    revoke: Revoke,
    /// Messages received at the last idle tick (§4.7: a ring with none
    /// since is idle).
    recv_seen: u64,
    /// §4.7, sender side: credits the peer's revoke still wants back.
    debt: u32,
    /// §4.7, sender side: RELEASED to send (the revoked limit) once the
    /// debt is paid.
    released_due: Option<u32>,
    local_rdv: LocalRdv,
    /// Address of our region's buffer 0 while registered.
    rdv_addr: u64,
    /// A chunk landed since the last idle tick.
    rdv_used: bool,
    owed_total: u32,
    owed_data: u32,
    rdv_owed: u32,
    rdv_expected: u32,
    rdv_peer_held: u32,
    reasm: Option<Reassembly>,
    peer_closed: bool,
    wait_first_recv: bool,
    force_credit: bool,
    hold_returns: bool,
    /// The application stopped reading (its receiving half is gone):
    /// what the peer still sends is discarded (§6).
    app_gone: bool,
    keepalive_due: bool,
    /// The last [`progress`](Self::progress) posted nothing and left no
    /// work waiting, and no entry point ran since (each one that can give
    /// `progress` something to do clears it: [`stir`](Self::stir)), so the
    /// next `progress` would post nothing either and returns at once.
    settled: bool,
    peer_saw_close: bool,
    /// A message from the peer was received (§2.3: ends the active side's
    /// setup kicks).
    heard: bool,
    /// The clock-driven policy: setup kicks, keepalive, idle release (§2.3,
    /// §4.4, §5.5).
    timers: clock::Timers,
    // --- outputs ---
    actions: Vec<Action>,
    /// Events in order, a message being read (§5.6) holding back those
    /// behind it.
    inbox: VecDeque<Inbound>,
    /// Counters.
    pub counters: EngineCounters,
}

impl Engine {
    /// Creates the engine and queues the initial receive posts (§4.1).
    /// Fails if the peer's hello is out of range (§2.2): every address and
    /// length the engine later derives from it is then computed without
    /// overflow.
    ///
    /// # Errors
    ///
    /// [`EngineError::Protocol`] with the hello field out of range.
    pub fn new(cfg: EngineConfig) -> Result<Engine, EngineError> {
        cfg.peer.validate().map_err(EngineError::Protocol)?;
        let eager_max = cfg.eager_max();
        let chunk = cfg.chunk_bytes();
        let on_demand_peer = cfg.peer.flags & wire::HELLO_FLAG_ON_DEMAND != 0;
        let initial_recv = cfg.initial_recv_slots.clamp(1, cfg.recv_slots);
        let initial_send = cfg.initial_send();
        let mut e = Engine {
            eager_max,
            chunk,
            credits: cfg.peer.credits,
            credit_limit: cfg.peer.credits,
            send_active: initial_send,
            send_max: cfg.send_slots,
            staging_open: false,
            staging_used: false,
            covering: 0,
            peer_rdv: if on_demand_peer {
                PeerRdv::Absent
            } else {
                PeerRdv::Static
            },
            peer_rdv_addr: cfg.peer.rdv_addr,
            peer_rdv_rkey: cfg.peer.rdv_rkey,
            free_send: (0..initial_send).collect(),
            free_staging: (0..cfg.staging_count).collect(),
            records: VecDeque::new(),
            sources: VecDeque::new(),
            next_seq: 0,
            unsignaled_run: 0,
            peer_rdv_next: 0,
            peer_rdv_avail: if on_demand_peer {
                0
            } else {
                cfg.peer.rdv_count
            },
            pending: VecDeque::new(),
            pending_bytes: 0,
            close_sent: false,
            exposed: Vec::new(),
            dest_due: VecDeque::new(),
            reads: VecDeque::new(),
            sq_reads: 0,
            done_due: VecDeque::new(),
            read_cache_open: false,
            read_used: false,
            recv_gen: vec![0; cfg.recv_slots as usize],
            recv_active: if cfg.on_demand {
                initial_recv
            } else {
                cfg.recv_slots
            },
            recv_max: cfg.recv_slots,
            grant_due: false,
            revoke: Revoke::None,
            recv_seen: 0,
            debt: 0,
            released_due: None,
            local_rdv: if cfg.on_demand {
                LocalRdv::Absent
            } else {
                LocalRdv::Static
            },
            rdv_addr: if cfg.on_demand { 0 } else { cfg.rdv_addr },
            rdv_used: false,
            owed_total: 0,
            owed_data: 0,
            rdv_owed: 0,
            rdv_expected: 0,
            rdv_peer_held: if cfg.on_demand { 0 } else { cfg.rdv_count },
            reasm: None,
            peer_closed: false,
            wait_first_recv: false,
            force_credit: false,
            hold_returns: false,
            app_gone: false,
            keepalive_due: false,
            settled: false,
            peer_saw_close: false,
            heard: false,
            timers: clock::Timers::default(),
            actions: Vec::new(),
            inbox: VecDeque::new(),
            counters: EngineCounters::default(),
            cfg,
        };
        for slot in 0..e.recv_active {
            e.actions.push(Action::PostRecv {
                slot,
                wr_id: recv_wr_id(slot, 0),
            });
        }
        Ok(e)
    }

    /// Passive side (§2.3): send nothing until the first message from the
    /// active side arrived (iWARP requires the active side to send first).
    pub fn set_wait_first_recv(&mut self) {
        self.stir();
        self.wait_first_recv = true;
    }

    /// Active side (§2.3): send a CREDIT message as the first message.
    pub fn send_initial_credit(&mut self) {
        self.stir();
        self.force_credit = true;
    }

    /// Whether a message from the peer has been received (§2.3 step 6: the
    /// active side kicks until it has).
    pub fn heard_from_peer(&self) -> bool {
        self.heard
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Largest payload sent eagerly.
    pub fn eager_max(&self) -> usize {
        self.eager_max
    }

    /// Takes the actions produced so far (to be posted in order).
    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// As [`take_actions`](Self::take_actions), into `buf` (which must be
    /// empty): both vectors keep their capacity, so a driver that passes the
    /// same buffer every step allocates nothing.
    pub fn swap_actions(&mut self, buf: &mut Vec<Action>) {
        debug_assert!(buf.is_empty());
        std::mem::swap(buf, &mut self.actions);
    }

    /// Takes the next event.
    pub fn next_event(&mut self) -> Option<Event> {
        if !matches!(self.inbox.front(), Some(Inbound::Ready(_))) {
            return None;
        }
        match self.inbox.pop_front() {
            Some(Inbound::Ready(ev)) => Some(ev),
            _ => None,
        }
    }

    /// Handles one completion. Receive payloads are copied out and the slot
    /// reposted immediately (§4.3, ownership in `docs/buffer-ownership.md`).
    ///
    /// # Errors
    ///
    /// [`EngineError::Completion`] for a failed completion;
    /// [`EngineError::Protocol`] for anything of the peer's that breaks the
    /// protocol (which rule: the [`PeerMisbehaved`]). Both end the
    /// connection.
    pub fn on_completion<B: Buffers + ?Sized>(
        &mut self,
        c: Completion,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        self.stir();
        let kind = c.wr_id >> 56;
        if kind == WR_RECV {
            if !c.ok {
                return Err(EngineError::Completion {
                    status: c.status,
                    recv: true,
                });
            }
            self.on_recv(c, bufs)
        } else if kind == WR_SQ {
            self.on_sq_completion(c, bufs)
        } else {
            Self::proto(PeerMisbehaved::UnknownWrId { wr_id: c.wr_id })
        }
    }

    fn proto<T>(v: PeerMisbehaved) -> Result<T, EngineError> {
        Err(EngineError::Protocol(v))
    }

    /// Posts whatever credits, slots and rendezvous buffers allow (§4.2, §5.2),
    /// then an explicit credit message if one is due (§4.3). Fails only if
    /// memory a message needs cannot be registered (§5.5).
    ///
    /// # Errors
    ///
    /// [`EngineError::Resource`] with what [`Buffers`] could not register.
    pub fn progress<B: Buffers + ?Sized>(&mut self, bufs: &mut B) -> Result<(), EngineError> {
        if self.settled {
            // Debug builds (every test) run the passes anyway and check
            // that skipping them loses nothing.
            #[cfg(debug_assertions)]
            {
                let before = self.actions.len();
                self.post_all(bufs)?;
                debug_assert_eq!(
                    self.actions.len(),
                    before,
                    "a settled engine found something to post: an entry point does not stir"
                );
            }
            return Ok(());
        }
        let before = self.actions.len();
        self.post_all(bufs)?;
        self.settled = self.actions.len() == before && self.nothing_waiting();
        Ok(())
    }

    /// The passes of [`progress`](Self::progress), in order.
    fn post_all<B: Buffers + ?Sized>(&mut self, bufs: &mut B) -> Result<(), EngineError> {
        if self.wait_first_recv {
            return Ok(());
        }
        self.grow_send_ring(bufs);
        self.post_credit_control(bufs);
        self.post_rdv_control(bufs)?;
        self.post_reads(bufs)?;
        self.post_read_done(bufs);
        self.post_dest_writes(bufs);
        self.post_pending(bufs)?;
        self.post_keepalive();
        self.post_credit_message(bufs);
        Ok(())
    }

    /// No queue of work a pass of [`progress`](Self::progress) serves holds
    /// anything (what waits for credits, slots, staging buffers or the
    /// peer's region, or for a registration to be tried again).
    fn nothing_waiting(&self) -> bool {
        self.pending.is_empty()
            && self.reads.is_empty()
            && self.done_due.is_empty()
            && self.dest_due.is_empty()
            && !self.grant_due
            && !self.force_credit
            && !self.keepalive_due
            && self.released_due.is_none()
            && !matches!(self.revoke, Revoke::Due(_))
            && !matches!(
                self.local_rdv,
                LocalRdv::GrantDue | LocalRdv::Revoking { sent: false }
            )
            && self.peer_rdv != PeerRdv::ReleaseDue
    }

    /// Something changed that [`progress`](Self::progress) may have work
    /// for: it runs its passes again.
    #[inline]
    fn stir(&mut self) {
        self.settled = false;
    }
}

#[cfg(test)]
mod tests;
