//! Sans-IO protocol engine: credits, receive ring, send ring with selective
//! signalling, rendezvous chunking and validation. No verbs calls happen here:
//! the engine consumes completions and returns [`Action`]s naming buffers by
//! slot index; the driver (or a test simulator) executes them.
//!
//! Section numbers (§) refer to `docs/wire-protocol-rdma.md`.

pub mod wire;

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use self::wire::{Header, Hello, Kind, FLAG_CLOSE_SEEN, FLAG_GRANT, FLAG_LAST, HDR_LEN};
pub use crate::error::PeerMisbehaved;

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
    fn open_rdv(&mut self) -> Result<(u64, u32), String>;
    /// Deregisters our rendezvous region: the peer released it (§5.5), so
    /// no WRITE of its can still arrive for it.
    fn close_rdv(&mut self);
    /// Registers the staging buffers (memory on demand, §5.5).
    fn open_staging(&mut self) -> Result<(), String>;
    /// Releases the staging buffers: no posted WRITE uses any of them.
    fn close_staging(&mut self);
    /// Makes send slots `0..n` usable (registers what is missing; §4.6).
    fn grow_send(&mut self, n: u32) -> Result<(), String>;
    /// Keeps send slots `0..n` only: none at or above `n` is in use.
    fn shrink_send(&mut self, n: u32);
    /// Makes receive slots `0..n` usable (registers what is missing; §4.6);
    /// the engine posts them.
    fn grow_recv(&mut self, n: u32) -> Result<(), String>;
    /// §4.7: the peer released credits, so receive slots `n..` are retired:
    /// none is posted again, and those still posted are withdrawn (only
    /// possible with a shared receive queue, where "posted" is a slot queued
    /// for the next buffer the SRQ fills). Called only by an engine with
    /// [`EngineConfig::revoke_idle`]; the slot the current message arrived
    /// in may be among them (its header was read already).
    fn shrink_recv(&mut self, _n: u32) {}
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
    (WR_SQ << 56) | (seq & ((1 << 56) - 1))
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
    /// RDMA WRITE `len` bytes of staging buffer `staging` to (`remote_addr`, `rkey`).
    PostWrite {
        /// Staging buffer index.
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
    },
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
    Resource(String),
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
    /// Largest message we accept.
    pub max_message: usize,
    /// Signal at least every k-th send-queue work request.
    pub signal_every: u32,
    /// Device max_inline_data for this QP.
    pub max_inline: usize,
    /// Both hellos offered RDMA WRITE with immediate data (§2.1 flags,
    /// §5.4): chunks are notified by the WRITE's immediate, not a SEND.
    pub write_imm: bool,
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

/// §4.7: where a credit revoke of ours stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Revoke {
    None,
    /// To send: the new limit.
    Due(u32),
    /// Sent; RELEASED with this limit awaited.
    Sent(u32),
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

/// Our rendezvous region (§5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LocalRdv {
    /// Advertised in our hello, registered for the connection's life.
    Static,
    /// Not registered; the peer holds no grant.
    Absent,
    /// The peer asked (RDV_REQUEST); RDV_GRANT not sent yet.
    GrantDue,
    /// Registered and granted.
    Granted,
    /// RDV_REVOKE queued or sent; the peer still holds the region until
    /// its RDV_RELEASE.
    Revoking { sent: bool },
}

/// The peer's rendezvous region as this sender knows it (§5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerRdv {
    /// Advertised in its hello.
    Static,
    /// None held; a rendezvous message sends RDV_REQUEST first.
    Absent,
    /// RDV_REQUEST sent, waiting for RDV_GRANT.
    Requested,
    /// Granted: `peer_rdv_addr` / `peer_rdv_rkey` are valid.
    Granted,
    /// RDV_REVOKE received: no new message starts; RDV_RELEASE goes out
    /// once every buffer is back.
    ReleaseDue,
}

#[derive(Debug, Clone, Copy)]
enum Held {
    Slot(u32),
    Staging(u32),
}

enum Outgoing {
    /// `head` then `body`, one message (a gather: neither is copied until
    /// the bytes go into a send slot or a staging buffer).
    Msg {
        head: Bytes,
        body: Bytes,
        off: usize,
    },
    Close,
}

/// Copies `dst.len()` bytes of the concatenation `head ++ body`, starting at
/// `start`, into `dst` (the caller keeps `start + dst.len()` within it).
fn copy_gather(head: &[u8], body: &[u8], start: usize, dst: &mut [u8]) {
    let n = dst.len();
    if start < head.len() {
        let h = (head.len() - start).min(n);
        dst[..h].copy_from_slice(&head[start..start + h]);
        dst[h..].copy_from_slice(&body[..n - h]);
    } else {
        let b = start - head.len();
        dst.copy_from_slice(&body[b..b + n]);
    }
}

struct Reassembly {
    buf: BytesMut,
    /// Total length announced by CHUNK notifications; unknown (None) for a
    /// message notified by immediates (§5.4).
    total: Option<usize>,
}

/// Counters the engine maintains; the driver copies them into stats.
#[derive(Debug, Default, Clone, Copy)]
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
    peer_rdv: PeerRdv,
    peer_rdv_addr: u64,
    peer_rdv_rkey: u32,
    free_send: VecDeque<u32>,
    free_staging: VecDeque<u32>,
    records: VecDeque<(u64, Option<Held>)>,
    next_seq: u64,
    unsignaled_run: u32,
    peer_rdv_next: u32,
    peer_rdv_avail: u32,
    pending: VecDeque<Outgoing>,
    pending_bytes: usize,
    close_sent: bool,
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
    keepalive_due: bool,
    peer_saw_close: bool,
    /// A message from the peer was received (§2.3: ends the active side's
    /// setup kicks).
    heard: bool,
    // --- outputs ---
    actions: Vec<Action>,
    events: VecDeque<Event>,
    /// Counters.
    pub counters: EngineCounters,
}

impl Engine {
    /// Creates the engine and queues the initial receive posts (§4.1).
    /// Fails if the peer's hello is out of range (§2.2): every address and
    /// length the engine later derives from it is then computed without
    /// overflow.
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
            keepalive_due: false,
            peer_saw_close: false,
            heard: false,
            actions: Vec::new(),
            events: VecDeque::new(),
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
        self.wait_first_recv = true;
    }

    /// Active side (§2.3): send a CREDIT message as the first message.
    pub fn send_initial_credit(&mut self) {
        self.force_credit = true;
    }

    /// Whether a message from the peer has been received (§2.3 step 6: the
    /// active side kicks until it has).
    pub fn heard_from_peer(&self) -> bool {
        self.heard
    }

    /// Keepalive (§4.4): queue a zero-length RDMA WRITE to the peer, so an
    /// idle connection still has a work request in flight now and then and
    /// a silently dead peer is found by the QP's retry limit. It consumes no
    /// credit and the peer's engine never sees it.
    pub fn keepalive(&mut self) {
        self.keepalive_due = true;
    }

    /// Receive back-pressure (§4.5): while set, no receive credits or
    /// rendezvous buffers are returned to the peer, so it stops sending once
    /// it used what it holds. Clearing it lets the next header (or a CREDIT
    /// message from [`progress`](Self::progress)) return everything owed.
    pub fn set_hold_returns(&mut self, hold: bool) {
        self.hold_returns = hold;
    }

    /// Whether returns are held (§4.5).
    pub fn holding_returns(&self) -> bool {
        self.hold_returns
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Largest payload sent eagerly.
    pub fn eager_max(&self) -> usize {
        self.eager_max
    }

    /// Queues a message. The caller must already have checked the length
    /// against the peer's `max_message`.
    pub fn submit(&mut self, data: Bytes) {
        self.submit_parts(Bytes::new(), data);
    }

    /// Queues one message made of `head` followed by `body`, without
    /// joining them: the bytes are copied once, into the send slot (eager)
    /// or the staging buffers (rendezvous). The caller must already have
    /// checked the total length against the peer's `max_message`.
    pub fn submit_parts(&mut self, head: Bytes, body: Bytes) {
        self.pending_bytes += head.len() + body.len();
        self.pending.push_back(Outgoing::Msg { head, body, off: 0 });
    }

    /// Queues the CLOSE marker (§6); no message may be submitted after it.
    pub fn close(&mut self) {
        self.pending.push_back(Outgoing::Close);
    }

    /// Messages queued but not yet fully posted.
    pub fn pending_msgs(&self) -> usize {
        self.pending.len()
    }

    /// Payload bytes queued but not yet fully posted.
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// CLOSE posted and every send-queue work request completed.
    pub fn close_flushed(&self) -> bool {
        self.close_sent && self.pending.is_empty() && self.records.is_empty()
    }

    /// CLOSE flushed and the peer confirmed it received it (and therefore
    /// every message before it): safe to disconnect (§6).
    pub fn close_confirmed(&self) -> bool {
        self.close_flushed() && self.peer_saw_close
    }

    /// CLOSE posted.
    pub fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// The peer sent CLOSE.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Bytes reserved for the rendezvous message being reassembled (test/diagnostics).
    pub fn reassembly_capacity(&self) -> usize {
        self.reasm.as_ref().map_or(0, |r| r.buf.capacity())
    }

    /// Messages sent that the peer has not yet returned the credit for
    /// (still in flight, or received but not yet acknowledged): a measure
    /// of how busy the connection is.
    pub fn unreturned_credits(&self) -> u32 {
        // The current limit, not the hello's: after a credit grant (§4.6)
        // the hello's figure would read "all returned" while many are not.
        self.credit_limit.saturating_sub(self.credits)
    }

    /// Current send credits (test/diagnostics).
    pub fn credits(&self) -> u32 {
        self.credits
    }

    /// Send-queue work requests not yet known complete.
    pub fn outstanding_sq(&self) -> usize {
        self.records.len()
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

    /// Whether progress may wait for a send completion (§8): a message is
    /// queued, CLOSE waits for its flush, or fewer than the 2 send slots or
    /// the send-queue room a control message needs are free, all while a
    /// posted work request is outstanding. The driver arms its send CQ
    /// only then, so a send completion does not wake it otherwise; what
    /// waits for the peer instead (credits, rendezvous buffers) is woken by
    /// a receive.
    pub fn wants_send_completions(&self) -> bool {
        !self.records.is_empty()
            && (!self.pending.is_empty()
                || self.close_sent
                || self.free_send.len() < 2
                || !self.sq_room(3))
    }

    /// Takes the next event.
    pub fn next_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Handles one completion. Receive payloads are copied out and the slot
    /// reposted immediately (§4.3, ownership in `docs/buffer-ownership.md`).
    pub fn on_completion<B: Buffers + ?Sized>(
        &mut self,
        c: Completion,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
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
            if !c.ok {
                return Err(EngineError::Completion {
                    status: c.status,
                    recv: false,
                });
            }
            // §7: completions on the SQ are in order, so a completion for
            // sequence s covers every earlier (unsignalled) work request.
            let seq = c.wr_id & ((1 << 56) - 1);
            while let Some(&(s, held)) = self.records.front() {
                if (s & ((1 << 56) - 1)) > seq {
                    break;
                }
                self.records.pop_front();
                match held {
                    Some(Held::Slot(i)) => self.free_send.push_back(i),
                    Some(Held::Staging(i)) => self.free_staging.push_back(i),
                    None => {}
                }
            }
            Ok(())
        } else {
            Self::proto(PeerMisbehaved::UnknownWrId { wr_id: c.wr_id })
        }
    }

    fn proto<T>(v: PeerMisbehaved) -> Result<T, EngineError> {
        Err(EngineError::Protocol(v))
    }

    fn on_recv<B: Buffers + ?Sized>(
        &mut self,
        c: Completion,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        let slot = (c.wr_id & 0xffff_ffff) as u32;
        let gen = ((c.wr_id >> 32) & 0xff_ffff) as u32;
        if slot >= self.recv_active || self.recv_gen[slot as usize] != gen {
            return Self::proto(PeerMisbehaved::StaleReceive { wr_id: c.wr_id });
        }
        let len = c.byte_len as usize;
        let write_imm = match c.imm {
            Imm::None => None,
            Imm::Write(imm) if self.cfg.write_imm => Some(imm),
            Imm::Write(imm) => return Self::proto(PeerMisbehaved::ImmediateNotOffered { imm }),
            Imm::Send(imm) => return Self::proto(PeerMisbehaved::ImmediateOnSend { imm }),
        };
        // An RDMA WRITE with immediate placed its bytes in our rendezvous
        // region, not in the slot: its length is checked in on_imm_chunk.
        if write_imm.is_none() && len > self.cfg.recv_slot_bytes {
            return Self::proto(PeerMisbehaved::ReceiveExceedsSlot {
                len,
                slot: self.cfg.recv_slot_bytes,
            });
        }
        if self.wait_first_recv {
            // §2.3 step 6: P answers A's first message at once (a CREDIT
            // message if nothing else goes out first), which tells A that
            // its messages are being read.
            self.force_credit = true;
            self.wait_first_recv = false;
        }
        self.heard = true;
        if let Some(imm) = write_imm {
            // §5.4: a chunk notified by its WRITE's immediate data. It
            // carries no returns and is data like a CHUNK SEND.
            if self.peer_closed {
                return Self::proto(PeerMisbehaved::AfterClose {
                    kind: "WRITE_WITH_IMM",
                });
            }
            self.on_imm_chunk(imm, len, bufs)?;
            self.owed_data += 1;
            return self.repost(slot, gen);
        }
        let h = Header::decode(&bufs.recv_slot(slot)[..len]).map_err(EngineError::Protocol)?;
        // §4.6: a credit grant raises our limit first (only a CREDIT
        // message from a peer whose hello offered memory on demand).
        if h.flags & FLAG_GRANT != 0 {
            if h.kind != Kind::Credit || !self.peer_on_demand() {
                return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                    kind: h.kind.name(),
                    why: "with the credit-grant flag, which only an on-demand peer's CREDIT may carry",
                });
            }
            let limit = h.total_len;
            if limit <= u64::from(self.credit_limit) || limit > u64::from(wire::MAX_CREDITS) {
                return Self::proto(PeerMisbehaved::CreditGrantRange {
                    limit,
                    current: self.credit_limit,
                });
            }
            let limit = limit as u32; // <= MAX_CREDITS
            self.credits += limit - self.credit_limit;
            self.credit_limit = limit;
        }
        // §4.7: the peer takes back credits it granted: a lower limit, and a
        // debt our credits pay before we use them.
        if h.flags & wire::FLAG_REVOKE != 0 {
            if h.kind != Kind::Credit || !self.peer_on_demand() {
                return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                    kind: h.kind.name(),
                    why: "with the credit-revoke flag, which only an on-demand peer's CREDIT may carry",
                });
            }
            let limit = h.total_len;
            if self.debt > 0
                || self.released_due.is_some()
                || limit < u64::from(self.cfg.peer.credits)
                || limit >= u64::from(self.credit_limit)
            {
                return Self::proto(PeerMisbehaved::CreditRevokeRange {
                    limit,
                    current: self.credit_limit,
                    initial: self.cfg.peer.credits,
                });
            }
            let limit = limit as u32; // < credit_limit, a u32
            self.debt = self.credit_limit - limit;
            self.credit_limit = limit;
            self.released_due = Some(limit);
        }
        // §4.7: the answer to our revoke: the peer holds no more than the
        // new limit; the slots above it are retired.
        if h.flags & wire::FLAG_RELEASED != 0 {
            match self.revoke {
                Revoke::Sent(limit) if h.kind == Kind::Credit && h.total_len == u64::from(limit) => {
                    self.revoke = Revoke::None;
                    self.recv_active = limit;
                    self.counters.credit_revokes += 1;
                    // Reposts of retired slots not yet handed to the
                    // memory layer are dropped with them (their credits
                    // stay owed: those messages did arrive).
                    self.actions.retain(
                        |a| !matches!(a, Action::PostRecv { slot, .. } if *slot >= limit),
                    );
                    bufs.shrink_recv(limit);
                }
                _ => {
                    return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                        kind: h.kind.name(),
                        why: "with the released flag, which only answers our credit revoke (a CREDIT with its limit)",
                    })
                }
            }
        }
        // §4.2: credits returned by the peer (u64: no overflow whatever it sends).
        // §4.7: while a revoke's debt is unpaid, credits and the debt
        // together stay within the old limit.
        let credits = u64::from(self.credits) + u64::from(h.credit_return);
        let most = u64::from(self.credit_limit) + u64::from(self.debt);
        if credits > most {
            return Self::proto(PeerMisbehaved::TooManyCredits {
                credits,
                granted: most as u32,
            });
        }
        // §4.7: credits beyond the one reserved for CREDIT messages (§4.3)
        // pay the debt first.
        let pay = u64::from(self.debt).min(credits.saturating_sub(1));
        self.debt -= pay as u32;
        let credits = credits - pay;
        self.credits = credits as u32; // <= credit_limit + debt, a u32
                                       // §5.3: rendezvous buffers returned by the peer (in order). None
                                       // can come back while we hold no region of the peer's (§5.5).
        let avail = u64::from(self.peer_rdv_avail) + u64::from(h.rdv_return);
        let holding = !matches!(self.peer_rdv, PeerRdv::Absent | PeerRdv::Requested);
        if avail > u64::from(self.cfg.peer.rdv_count) || (h.rdv_return > 0 && !holding) {
            return Self::proto(PeerMisbehaved::TooManyRendezvousReturns {
                available: avail,
                advertised: self.cfg.peer.rdv_count,
            });
        }
        self.peer_rdv_avail = avail as u32; // <= peer.rdv_count
        if h.flags & FLAG_CLOSE_SEEN != 0 {
            if !self.close_sent {
                return Self::proto(PeerMisbehaved::CloseSeenWithoutClose);
            }
            self.peer_saw_close = true;
        }
        // §6, §5.5: after CLOSE only messages that serve the other
        // direction: returns, and our region's grant, revoke and release.
        let control = matches!(
            h.kind,
            Kind::Credit | Kind::RdvGrant | Kind::RdvRevoke | Kind::RdvRelease
        );
        if self.peer_closed && !control {
            return Self::proto(PeerMisbehaved::AfterClose {
                kind: h.kind.name(),
            });
        }
        match h.kind {
            Kind::Eager => {
                // §4.1
                if self.reasm.is_some() {
                    return Self::proto(PeerMisbehaved::EagerInsideRendezvous);
                }
                // len >= HDR_LEN: Header::decode succeeded.
                if h.len as usize != len - HDR_LEN {
                    return Self::proto(PeerMisbehaved::EagerLengthMismatch {
                        header: h.len,
                        carried: len - HDR_LEN,
                    });
                }
                // Copied out of the slot so it can be reposted now, into a
                // buffer of its own: not the thread's arena, where one kept
                // message (a header value, a queued DATA frame a slow handler
                // has not read) would keep a whole shared buffer alive, and a
                // peer sending many small messages could multiply the memory
                // it holds on us by up to `arena::CHUNK` per message.
                let msg = Bytes::copy_from_slice(&bufs.recv_slot(slot)[HDR_LEN..len]);
                self.counters.msgs_recv += 1;
                self.counters.bytes_recv += msg.len() as u64;
                self.events.push_back(Event::Message(msg));
                self.owed_data += 1;
            }
            Kind::Chunk => {
                self.on_chunk(&h, len, bufs)?;
                self.owed_data += 1;
            }
            Kind::Credit => {}
            Kind::RdvRequest => {
                // §5.5: the peer holds no region of ours and wants one.
                if self.local_rdv != LocalRdv::Absent {
                    return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                        kind: h.kind.name(),
                        why: if self.local_rdv == LocalRdv::Static {
                            "though our region is advertised in the hello"
                        } else {
                            "while a region of ours is granted or being granted"
                        },
                    });
                }
                self.local_rdv = LocalRdv::GrantDue;
                self.owed_data += 1;
            }
            Kind::RdvGrant => {
                if self.peer_rdv != PeerRdv::Requested {
                    return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                        kind: h.kind.name(),
                        why: "that we did not request",
                    });
                }
                // Same shape as the hello's (count × bytes, validated
                // there); only the address must not wrap (§2.2).
                let len = u64::from(self.cfg.peer.rdv_count) * u64::from(self.cfg.peer.rdv_bytes);
                if h.addr.checked_add(len).is_none() {
                    return Self::proto(PeerMisbehaved::GrantRegionOverflow { addr: h.addr });
                }
                self.peer_rdv = PeerRdv::Granted;
                self.peer_rdv_addr = h.addr;
                self.peer_rdv_rkey = h.len;
                self.peer_rdv_avail = self.cfg.peer.rdv_count;
                self.peer_rdv_next = 0;
                self.owed_data += 1;
            }
            Kind::RdvRevoke => {
                if self.peer_rdv != PeerRdv::Granted {
                    return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                        kind: h.kind.name(),
                        why: "for a region it did not grant us",
                    });
                }
                self.peer_rdv = PeerRdv::ReleaseDue;
                self.owed_data += 1;
            }
            Kind::RdvRelease => {
                // §5.5: only after our REVOKE, and never inside a message
                // (the peer sends it once every buffer is back).
                if !matches!(self.local_rdv, LocalRdv::Revoking { sent: true }) {
                    return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                        kind: h.kind.name(),
                        why: "without our RDV_REVOKE",
                    });
                }
                if self.reasm.is_some() || self.rdv_peer_held != self.cfg.rdv_count {
                    return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                        kind: h.kind.name(),
                        why: "while a chunk of a message is still outstanding",
                    });
                }
                // Every WRITE of the peer's into the region came before
                // this SEND on the same QP (RC order), so none can still
                // land: deregistering frees it (buffer-ownership.md).
                bufs.close_rdv();
                self.local_rdv = LocalRdv::Absent;
                self.rdv_peer_held = 0;
                self.rdv_expected = 0;
                self.rdv_owed = 0;
                self.rdv_addr = 0;
                self.owed_data += 1;
            }
            Kind::Close => {
                if self.reasm.is_some() {
                    return Self::proto(PeerMisbehaved::CloseInsideRendezvous);
                }
                self.peer_closed = true;
                // §6: confirm promptly so the peer may disconnect.
                self.force_credit = true;
                self.events.push_back(Event::PeerClosed);
                self.owed_data += 1;
            }
        }
        self.repost(slot, gen)
    }

    /// §4.2, §4.3: checks the receive used a credit we granted, reposts
    /// the slot and makes its credit returnable.
    fn repost(&mut self, slot: u32, gen: u32) -> Result<(), EngineError> {
        // §4.2: every SEND consumed a credit we granted. Slots received but
        // not yet returned can exceed the ring only if the peer sent without
        // a credit (it cannot hold credits we have not returned yet).
        if self.owed_total >= self.recv_active {
            return Self::proto(PeerMisbehaved::SendWithoutCredit {
                excess: self.owed_total + 1 - self.recv_active,
                granted: self.recv_active,
            });
        }
        // §4.3: repost immediately; the credit becomes returnable. A slot
        // the peer's RELEASED retired (§4.7; possibly the one that carried
        // it) is not posted again.
        let g = (gen + 1) & 0xff_ffff;
        self.recv_gen[slot as usize] = g;
        if slot < self.recv_active {
            self.actions.push(Action::PostRecv {
                slot,
                wr_id: recv_wr_id(slot, g),
            });
        }
        self.owed_total += 1;
        // §4.6: the peer used half its credits on messages other than
        // CREDIT before we could return them: grow the ring (up to
        // recv_slots) and grant it more. CREDIT messages do not count: a
        // setup's first CREDIT and its answer (§2.3) still owed when the
        // first call arrives would otherwise double every 4-slot ring that
        // carries one call.
        if self.cfg.on_demand
            && !self.hold_returns
            && self.revoke == Revoke::None
            && self.recv_active < self.recv_max
            && self.owed_data * 2 >= self.recv_active
        {
            self.grant_due = true;
        }
        Ok(())
    }

    /// §5.3: validate a chunk notification before touching the buffer.
    fn on_chunk<B: Buffers + ?Sized>(
        &mut self,
        h: &Header,
        len: usize,
        bufs: &B,
    ) -> Result<(), EngineError> {
        if len != HDR_LEN {
            return Self::proto(PeerMisbehaved::ChunkWithPayload { len });
        }
        let idx = h.rdv_index;
        self.check_chunk_buffer(idx)?;
        // Our own region (idx < rdv_count, checked, and granted, so
        // registered): the end address exists and nothing here can overflow.
        let expect_addr = self.rdv_addr + u64::from(idx) * self.cfg.rdv_bytes as u64;
        if h.addr != expect_addr {
            return Self::proto(PeerMisbehaved::ChunkWrongAddress {
                index: idx,
                addr: h.addr,
                expected: expect_addr,
            });
        }
        let clen = h.len as usize;
        if clen == 0 || clen > self.cfg.rdv_bytes {
            return Self::proto(PeerMisbehaved::ChunkLength {
                len: h.len,
                max: self.cfg.rdv_bytes,
            });
        }
        let total = h.total_len;
        if total > self.cfg.max_message as u64 {
            return Self::proto(PeerMisbehaved::MessageTooLarge {
                total,
                max: self.cfg.max_message,
            });
        }
        let total = total as usize; // <= max_message, a usize
        let last = h.flags & FLAG_LAST != 0;
        // Memory follows the data that actually arrived: a notification
        // claiming a huge total reserves at most REASSEMBLY_RESERVE up front,
        // and the buffer grows as chunks land (large reallocations are
        // mremap'ed, not copied).
        let r = self.reasm.get_or_insert_with(|| Reassembly {
            buf: BytesMut::with_capacity(total.min(REASSEMBLY_RESERVE)),
            total: Some(total),
        });
        match r.total {
            None => return Self::proto(PeerMisbehaved::ChunkNotificationMixed),
            Some(was) if was != total => {
                return Self::proto(PeerMisbehaved::ChunkTotalChanged {
                    was: was as u64,
                    now: total as u64,
                })
            }
            Some(_) => {}
        }
        // Both terms are bounded (received bytes <= total <= max_message,
        // clen <= rdv_bytes), so the sum cannot overflow.
        let end = r.buf.len() + clen;
        if end > total {
            return Self::proto(PeerMisbehaved::ChunkOverrun {
                end: end as u64,
                total: total as u64,
            });
        }
        if last != (end == total) {
            return Self::proto(PeerMisbehaved::LastFlagWrong {
                last,
                end: end as u64,
                total: total as u64,
            });
        }
        self.land_chunk(idx, clen, last, bufs);
        Ok(())
    }

    /// §5.4: validates a chunk notified by an RDMA WRITE's immediate data
    /// (`len` = the bytes the WRITE placed) before touching the buffer.
    fn on_imm_chunk<B: Buffers + ?Sized>(
        &mut self,
        imm: u32,
        len: usize,
        bufs: &B,
    ) -> Result<(), EngineError> {
        let (idx, following, last) = wire::parse_chunk_imm(imm);
        if last != (following == 0) {
            return Self::proto(PeerMisbehaved::ImmediateMalformed { imm });
        }
        self.check_chunk_buffer(idx)?;
        if len == 0 || len > self.cfg.rdv_bytes {
            return Self::proto(PeerMisbehaved::ChunkLength {
                len: len as u32,
                max: self.cfg.rdv_bytes,
            });
        }
        let max = self.cfg.max_message;
        let cap = if last {
            len
        } else {
            // A hint from the peer, bounded: it only sizes the first
            // reservation (at most REASSEMBLY_RESERVE), never a check.
            (following as usize + 1)
                .saturating_mul(self.cfg.rdv_bytes)
                .min(REASSEMBLY_RESERVE)
                .min(max)
        };
        let r = self.reasm.get_or_insert_with(|| Reassembly {
            buf: BytesMut::with_capacity(cap),
            total: None,
        });
        if r.total.is_some() {
            return Self::proto(PeerMisbehaved::ChunkNotificationMixed);
        }
        // received <= max_message and len <= rdv_bytes: no overflow.
        let end = r.buf.len() + len;
        if end > max {
            return Self::proto(PeerMisbehaved::MessageTooLarge {
                total: end as u64,
                max,
            });
        }
        self.land_chunk(idx, len, last, bufs);
        Ok(())
    }

    /// §5.3: a notification may only name the next buffer in round-robin
    /// order, and only while the peer holds a grant.
    fn check_chunk_buffer(&self, idx: u32) -> Result<(), EngineError> {
        if idx >= self.cfg.rdv_count {
            return Self::proto(PeerMisbehaved::ChunkUnknownBuffer {
                index: idx,
                count: self.cfg.rdv_count,
            });
        }
        if self.rdv_peer_held == 0 || idx != self.rdv_expected {
            return Self::proto(PeerMisbehaved::ChunkBufferNotGranted {
                index: idx,
                expected: self.rdv_expected,
                held: self.rdv_peer_held,
            });
        }
        Ok(())
    }

    /// Copies a validated chunk out of rendezvous buffer `idx` into the
    /// message being reassembled; the buffer is free to re-advertise.
    fn land_chunk<B: Buffers + ?Sized>(&mut self, idx: u32, clen: usize, last: bool, bufs: &B) {
        let r = self.reasm.as_mut().expect("reassembly present");
        bufs.append_rdv(idx, clen, &mut r.buf);
        self.rdv_used = true;
        self.rdv_peer_held -= 1;
        self.rdv_expected = (idx + 1) % self.cfg.rdv_count;
        // Copied out: the buffer is ours again and can be re-advertised.
        self.rdv_owed += 1;
        if last {
            let r = self.reasm.take().expect("reassembly present");
            let msg = r.buf.freeze();
            self.counters.msgs_recv += 1;
            self.counters.bytes_recv += msg.len() as u64;
            self.events.push_back(Event::Message(msg));
        }
    }

    fn fill_returns(&mut self, h: &mut Header) {
        if self.hold_returns {
            return;
        }
        let c = self.owed_total.min(u16::MAX as u32);
        h.credit_return = c as u16;
        self.owed_total -= c;
        self.owed_data = self.owed_data.min(self.owed_total);
        let r = self.rdv_owed.min(u16::MAX as u32);
        h.rdv_return = r as u16;
        self.rdv_owed -= r;
        self.rdv_peer_held += r;
    }

    fn push_record(&mut self, held: Option<Held>, force_signal: bool) -> (u64, bool) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.unsignaled_run += 1;
        // §7: at least every `send_active / 2` work requests is signalled,
        // whatever `signal_every` says. Slots held by unsignalled SENDs come
        // back only with a later signalled completion, so with a longer run
        // a ring that started small (§4.6) could have too few free slots for
        // a control message (RDV_GRANT needs 2, §4.3) and nothing in flight
        // that would ever free one. After CLOSE everything is signalled so
        // the SQ drains completely (§6).
        let every = self.cfg.signal_every.min((self.send_active / 2).max(1));
        let signaled = force_signal || self.close_sent || self.unsignaled_run >= every;
        if signaled {
            self.unsignaled_run = 0;
        }
        self.records.push_back((seq, held));
        (sq_wr_id(seq), signaled)
    }

    fn sq_room(&self, n: usize) -> bool {
        self.records.len() + n <= self.cfg.sq_depth() as usize
    }

    fn post_send_slot<B: Buffers + ?Sized>(
        &mut self,
        bufs: &mut B,
        mut h: Header,
        payload: (&[u8], &[u8]),
        force_signal: bool,
    ) {
        let slot = self
            .free_send
            .pop_front()
            .expect("caller checked free slot");
        self.fill_returns(&mut h);
        if self.peer_closed {
            h.flags |= FLAG_CLOSE_SEEN;
        }
        let b = bufs.send_slot(slot);
        h.encode(&mut b[..HDR_LEN]);
        let plen = payload.0.len() + payload.1.len();
        copy_gather(payload.0, payload.1, 0, &mut b[HDR_LEN..HDR_LEN + plen]);
        let len = HDR_LEN + plen;
        let inline = len <= self.cfg.max_inline;
        if inline {
            self.counters.inline_sends += 1;
        }
        self.credits -= 1;
        let (wr_id, signaled) = self.push_record(Some(Held::Slot(slot)), force_signal);
        self.actions.push(Action::PostSend {
            slot,
            len,
            wr_id,
            signaled,
            inline,
        });
    }

    fn peer_on_demand(&self) -> bool {
        self.cfg.peer.flags & wire::HELLO_FLAG_ON_DEMAND != 0
    }

    /// Data (and the on-demand control messages) need 2 credits and 2 free
    /// send slots: one of each stays reserved for credit messages so
    /// returns can never deadlock (§4.3).
    fn data_room(&self) -> bool {
        self.credits >= 2 && self.free_send.len() >= 2 && self.sq_room(3)
    }

    /// The message at the front of the queue is partly sent.
    fn mid_message(&self) -> bool {
        matches!(self.pending.front(), Some(Outgoing::Msg { off, .. }) if *off > 0)
    }

    /// The peer's rendezvous region this engine may WRITE into now
    /// (address of buffer 0, rkey): the hello's, or the one granted on
    /// demand (§5.5); `None` while it holds none.
    pub fn peer_region(&self) -> Option<(u64, u32)> {
        matches!(
            self.peer_rdv,
            PeerRdv::Static | PeerRdv::Granted | PeerRdv::ReleaseDue
        )
        .then_some((self.peer_rdv_addr, self.peer_rdv_rkey))
    }

    /// Whether [`on_idle_tick`](Self::on_idle_tick) could give anything
    /// back (a granted region, open staging buffers, a grown send ring): an
    /// idle connection that holds only its initial rings needs no timer.
    pub fn has_releasable(&self) -> bool {
        self.local_rdv == LocalRdv::Granted
            || self.staging_open
            || self.send_active > self.cfg.initial_send()
            || self.revocable()
    }

    /// §4.7: credits beyond the initial ones that a revoke could take back.
    fn revocable(&self) -> bool {
        self.cfg.revoke_idle
            && self.cfg.peer.flags & wire::HELLO_FLAG_REVOCABLE != 0
            && self.revoke == Revoke::None
            && self.recv_active > self.cfg.initial_recv_slots.clamp(1, self.cfg.recv_slots)
    }

    /// Memory on demand (§5.5), called by the driver once per idle
    /// interval, then [`progress`](Self::progress): what was not used
    /// during a whole interval is given back. Our rendezvous region is
    /// revoked (it is deregistered when the peer's RDV_RELEASE arrives),
    /// the staging buffers are released, the send ring shrinks to its
    /// initial size.
    pub fn on_idle_tick<B: Buffers + ?Sized>(&mut self, bufs: &mut B) {
        // §4.7: a ring that grew and received nothing for a whole interval
        // goes back to its initial size (a REVOKE, then the peer's RELEASED).
        if self.revocable()
            && self.counters.msgs_recv == self.recv_seen
            && !self.grant_due
            && !self.hold_returns
            && !self.peer_closed
        {
            self.revoke = Revoke::Due(self.cfg.initial_recv_slots.clamp(1, self.cfg.recv_slots));
        }
        self.recv_seen = self.counters.msgs_recv;
        if self.local_rdv == LocalRdv::Granted
            && !self.rdv_used
            && self.reasm.is_none()
            && self.rdv_owed == 0
            && self.rdv_peer_held == self.cfg.rdv_count
            && !self.peer_closed
        {
            self.local_rdv = LocalRdv::Revoking { sent: false };
        }
        self.rdv_used = false;
        if self.staging_open
            && !self.staging_used
            && self.free_staging.len() == self.cfg.staging_count as usize
            && !self.mid_message()
        {
            // No posted WRITE uses a staging buffer (all are free).
            bufs.close_staging();
            self.staging_open = false;
        }
        self.staging_used = false;
        let initial = self.cfg.initial_send();
        if self.send_active > initial
            && self.free_send.len() == self.send_active as usize
            && self.pending.is_empty()
        {
            // Every slot is free: no posted SEND covers any of them.
            self.free_send.retain(|&i| i < initial);
            bufs.shrink_send(initial);
            self.send_active = initial;
        }
    }

    /// Posts one on-demand control message (§5.5) from a send slot.
    fn post_control<B: Buffers + ?Sized>(&mut self, bufs: &mut B, h: Header) {
        self.post_send_slot(bufs, h, (&[], &[]), false);
        self.counters.credit_msgs += 1;
    }

    /// Posts whatever credits, slots and rendezvous buffers allow (§4.2, §5.2),
    /// then an explicit credit message if one is due (§4.3). Fails only if
    /// memory a message needs cannot be registered (§5.5).
    pub fn progress<B: Buffers + ?Sized>(&mut self, bufs: &mut B) -> Result<(), EngineError> {
        if self.wait_first_recv {
            return Ok(());
        }
        // §4.6: the send ring grows while messages wait for slots.
        if self.free_send.len() < 2
            && self.send_active < self.send_max
            && self.credits >= 2
            && !self.pending.is_empty()
        {
            let new = (self.send_active * 2).min(self.send_max);
            match bufs.grow_send(new) {
                Ok(()) => {
                    self.free_send.extend(self.send_active..new);
                    self.send_active = new;
                }
                Err(_) => self.send_max = self.send_active,
            }
        }
        // §4.6: grow the receive ring and grant the peer the new credits
        // (the receives are posted before the grant: actions keep order).
        if self.grant_due
            && !self.hold_returns
            && self.credits >= 1
            && !self.free_send.is_empty()
            && self.sq_room(1)
        {
            self.grant_due = false;
            let new = (self.recv_active * 2).min(self.recv_max);
            match bufs.grow_recv(new) {
                Ok(()) => {
                    for slot in self.recv_active..new {
                        let g = self.recv_gen[slot as usize];
                        self.actions.push(Action::PostRecv {
                            slot,
                            wr_id: recv_wr_id(slot, g),
                        });
                    }
                    self.recv_active = new;
                    self.counters.credit_grants += 1;
                    let mut h = Header::new(Kind::Credit);
                    h.flags = FLAG_GRANT;
                    h.total_len = u64::from(new);
                    self.post_control(bufs, h);
                }
                // The cap: stay at this size.
                Err(_) => self.recv_max = self.recv_active,
            }
        }
        // §4.7: our revoke. Like data it leaves the last credit reserved
        // for CREDIT messages (§4.3): it may return nothing, and a side that
        // spent its last credit on a message returning nothing could meet a
        // peer that did the same (both at 0 credits, each owing the other:
        // found by random_pairs_deliver_everything_before_any_close).
        if let Revoke::Due(limit) = self.revoke {
            if self.credits >= 2 && !self.free_send.is_empty() && self.sq_room(1) {
                self.revoke = Revoke::Sent(limit);
                let mut h = Header::new(Kind::Credit);
                h.flags = wire::FLAG_REVOKE;
                h.total_len = u64::from(limit);
                self.post_control(bufs, h);
            }
        }
        // §4.7: the peer's revoke is paid: say so (not on the credit
        // reserved for CREDIT messages, §4.3, as the revoke above).
        if let (0, Some(limit)) = (self.debt, self.released_due) {
            if self.credits >= 2 && !self.free_send.is_empty() && self.sq_room(1) {
                self.released_due = None;
                let mut h = Header::new(Kind::Credit);
                h.flags = wire::FLAG_RELEASED;
                h.total_len = u64::from(limit);
                self.post_control(bufs, h);
            }
        }
        // §5.5: our region, on demand.
        if self.local_rdv == LocalRdv::GrantDue && self.data_room() {
            let (addr, rkey) = bufs.open_rdv().map_err(EngineError::Resource)?;
            self.local_rdv = LocalRdv::Granted;
            self.rdv_addr = addr;
            self.rdv_peer_held = self.cfg.rdv_count;
            self.rdv_expected = 0;
            self.rdv_owed = 0;
            self.rdv_used = true;
            let mut h = Header::new(Kind::RdvGrant);
            h.addr = addr;
            h.len = rkey;
            self.post_control(bufs, h);
        }
        if self.local_rdv == (LocalRdv::Revoking { sent: false }) && self.data_room() {
            self.local_rdv = LocalRdv::Revoking { sent: true };
            self.post_control(bufs, Header::new(Kind::RdvRevoke));
        }
        if self.peer_rdv == PeerRdv::ReleaseDue
            && self.peer_rdv_avail == self.cfg.peer.rdv_count
            && !self.mid_message()
            && self.data_room()
        {
            self.peer_rdv = PeerRdv::Absent;
            self.peer_rdv_avail = 0;
            self.post_control(bufs, Header::new(Kind::RdvRelease));
        }
        loop {
            if !self.data_room() {
                break;
            }
            let mid = self.mid_message();
            let region = match self.peer_rdv {
                PeerRdv::Static | PeerRdv::Granted => true,
                // Revoked: finish the message under way, start none.
                PeerRdv::ReleaseDue => mid,
                PeerRdv::Absent | PeerRdv::Requested => false,
            };
            let rdv_ready = region && self.peer_rdv_avail > 0 && !self.free_staging.is_empty();
            let need_request = self.peer_rdv == PeerRdv::Absent;
            let eager_max = self.eager_max;
            let Some(front) = self.pending.front_mut() else {
                break;
            };
            match front {
                Outgoing::Close => {
                    self.pending.pop_front();
                    let h = Header::new(Kind::Close);
                    self.post_send_slot(bufs, h, (&[], &[]), true);
                    self.close_sent = true;
                }
                Outgoing::Msg { head, body, off } if head.len() + body.len() <= eager_max => {
                    let (head, body) = (head.clone(), body.clone());
                    debug_assert_eq!(*off, 0);
                    self.pending.pop_front();
                    let n = head.len() + body.len();
                    self.pending_bytes -= n;
                    let mut h = Header::new(Kind::Eager);
                    h.len = n as u32;
                    self.post_send_slot(bufs, h, (&head, &body), false);
                    self.counters.eager_sends += 1;
                    self.counters.msgs_sent += 1;
                    self.counters.bytes_sent += n as u64;
                }
                Outgoing::Msg { .. } if need_request => {
                    // §5.5: ask for the peer's region first.
                    self.peer_rdv = PeerRdv::Requested;
                    self.post_control(bufs, Header::new(Kind::RdvRequest));
                    break;
                }
                Outgoing::Msg { head, body, off } => {
                    // §5.2: one chunk = WRITE into the next peer buffer +
                    // notification (a SEND, or the WRITE's immediate, §5.4).
                    if !rdv_ready {
                        break;
                    }
                    if !self.staging_open {
                        bufs.open_staging().map_err(EngineError::Resource)?;
                        self.staging_open = true;
                    }
                    self.staging_used = true;
                    let total = head.len() + body.len();
                    let clen = self.chunk.min(total - *off);
                    let start = *off;
                    *off += clen;
                    let last = *off == total;
                    let remaining = total - *off;
                    let (head, body) = (head.clone(), body.clone());
                    if last {
                        self.pending.pop_front();
                    }
                    self.pending_bytes -= clen;
                    let st = self.free_staging.pop_front().expect("checked");
                    copy_gather(&head, &body, start, &mut bufs.staging(st)[..clen]);
                    let idx = self.peer_rdv_next;
                    self.peer_rdv_next = (idx + 1) % self.cfg.peer.rdv_count;
                    self.peer_rdv_avail -= 1;
                    // idx < peer.rdv_count and the peer's region was checked
                    // not to wrap (Hello::validate in new), so no overflow.
                    let remote_addr =
                        self.peer_rdv_addr + u64::from(idx) * u64::from(self.cfg.peer.rdv_bytes);
                    self.counters.rdv_writes += 1;
                    self.counters.rdv_bytes += clen as u64;
                    if last {
                        self.counters.msgs_sent += 1;
                        self.counters.bytes_sent += total as u64;
                    }
                    // §5.4: with immediates the WRITE's immediate data is
                    // the notification; it consumes a receive buffer (a
                    // credit) at the peer like a SEND, and is signalled so
                    // the staging buffer is released promptly. Otherwise a
                    // CHUNK SEND follows the (unsignalled) WRITE.
                    let imm = self
                        .cfg
                        .write_imm
                        .then(|| wire::chunk_imm(idx, remaining.div_ceil(self.chunk), last));
                    let (wr_id, signaled) =
                        self.push_record(Some(Held::Staging(st)), imm.is_some());
                    self.actions.push(Action::PostWrite {
                        staging: st,
                        len: clen,
                        remote_addr,
                        rkey: self.peer_rdv_rkey,
                        wr_id,
                        signaled,
                        imm,
                    });
                    if imm.is_some() {
                        self.credits -= 1;
                        continue;
                    }
                    let mut h = Header::new(Kind::Chunk);
                    h.len = clen as u32;
                    h.rdv_index = idx;
                    h.total_len = total as u64;
                    h.addr = remote_addr;
                    if last {
                        h.flags |= FLAG_LAST;
                    }
                    // Signal the notify so the staging buffer is released promptly.
                    self.post_send_slot(bufs, h, (&[], &[]), true);
                }
            }
        }
        // §4.4: keepalive, a zero-length WRITE to the start of the peer's
        // region (no data moves, no credit is used, the peer sees nothing);
        // while we hold no region of the peer's (§5.5), a zero-length WRITE
        // to address 0 where the device allows it, else a CREDIT message.
        let peer_region = matches!(
            self.peer_rdv,
            PeerRdv::Static | PeerRdv::Granted | PeerRdv::ReleaseDue
        );
        let write_ok = peer_region || self.cfg.zero_length_write_any_rkey;
        if self.keepalive_due && write_ok && self.sq_room(1) {
            self.keepalive_due = false;
            let (wr_id, signaled) = self.push_record(None, false);
            // Without a region: address and rkey 0, which a zero-length
            // WRITE does not need (C9-88).
            let (remote_addr, rkey) = if peer_region {
                (self.peer_rdv_addr, self.peer_rdv_rkey)
            } else {
                (0, 0)
            };
            self.actions.push(Action::PostWrite {
                staging: 0,
                len: 0,
                remote_addr,
                rkey,
                wr_id,
                signaled,
                imm: None,
            });
        } else if self.keepalive_due && !write_ok {
            self.keepalive_due = false;
            self.force_credit = true;
        }
        // §4.3: explicit credit message when returns are due and no data
        // carried them: half the ring owed for other messages, or the ring
        // but one owed in all. So credit messages cannot ping-pong.
        // §5.3: rendezvous buffers go back in batches while a message is
        // still arriving (half the region at a time), all at once when it
        // is complete.
        // Slots owed for CREDIT messages count only once the peer is down
        // to its reserved credit (ring − 1 owed): counted from half the
        // ring, a CREDIT and a data message owed together made a 4-slot
        // ring answer with a CREDIT, and two sides that read both before
        // answering kept that going, a CREDIT each way per call.
        let half = (self.recv_active / 2).max(1);
        let low = self.recv_active.saturating_sub(1).max(half);
        let rdv_half = (self.cfg.rdv_count / 2).max(1);
        let rdv_due = self.rdv_owed >= rdv_half || (self.rdv_owed > 0 && self.reasm.is_none());
        // §4.7: while our revoke waits for RELEASED, every credit owed goes
        // back at once, so the peer can pay its debt.
        let revoking = matches!(self.revoke, Revoke::Sent(_)) && self.owed_total > 0;
        let owed = self.owed_data >= half || self.owed_total >= low || rdv_due || revoking;
        let due = (owed && !self.hold_returns) || self.force_credit;
        if due && self.credits >= 1 && !self.free_send.is_empty() && self.sq_room(1) {
            let h = Header::new(Kind::Credit);
            self.post_send_slot(bufs, h, (&[], &[]), false);
            self.counters.credit_msgs += 1;
            self.force_credit = false;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
