//! Host tests of the sans-IO engine: a simulated NIC pair executes the
//! actions of two engines wired back-to-back.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;

use super::wire::{Header, Hello, Kind, FLAG_CLOSE_SEEN, FLAG_LAST, HDR_LEN, VERSION};
use super::*;

const RDV_BASE: u64 = 0x10_0000_0000;
/// §5.6: where the fake "NIC" places exposed bodies: source `id` at
/// `EXPOSED_BASE + id << 32`, readable with rkey `EXPOSED_RKEY + id`.
const EXPOSED_BASE: u64 = 0x20_0000_0000;
const EXPOSED_RKEY: u32 = 0x5000;
const DEST_BASE: u64 = 0x40_0000_0000;
const DEST_RKEY: u32 = 0x9000;

/// The fake registered memory: whole pools, plus what memory on demand
/// has "registered" (§4.6, §5.5); using anything not registered panics,
/// and what is deregistered is poisoned.
struct Mem {
    recv: Vec<u8>,
    send: Vec<u8>,
    rdv: Vec<u8>,
    staging: Vec<u8>,
    slot: usize,
    rdv_bytes: usize,
    staging_bytes: usize,
    recv_active: u32,
    send_active: u32,
    rdv_open: bool,
    staging_open: bool,
    rdv_opens: u32,
    rdv_closes: u32,
    staging_opens: u32,
    staging_closes: u32,
    /// open_rdv / open_staging / grow_* fail (the registered-memory cap).
    refuse: bool,
    /// shrink_recv calls (§4.7).
    shrinks: u32,
    /// Zero-copy sources (§5.1) by id: `None` once released.
    sources: Vec<Option<Bytes>>,
    /// register_source refuses (a registration that fails: the copy).
    refuse_sources: bool,
    /// §5.6: which sources are exposed for the peer's READs, and whether
    /// their window has been bound (a READ before the bind fails).
    exposed: Vec<Option<bool>>,
    /// §5.6: our READs' destinations (`None` once taken).
    dests: Vec<Option<Vec<u8>>>,
    /// §5.6: close_read_cache calls.
    read_cache_closes: u32,
    /// §5.6: open_dest refuses (the cap): the copy fallback.
    refuse_dests: bool,
    /// §5.7: destinations granted to the peer, by id: the granted range
    /// (offset, length) and whether its window is bound; `None` once
    /// revoked (taken).
    dest_grants: Vec<Option<(usize, usize, bool)>>,
    /// §5.7: expose_dest refuses (no window): the message is read.
    refuse_grants: bool,
}

impl Buffers for Mem {
    fn recv_slot(&self, i: u32) -> &[u8] {
        assert!(i < self.recv_active, "receive slot {i} not registered");
        &self.recv[i as usize * self.slot..(i as usize + 1) * self.slot]
    }
    fn send_slot(&mut self, i: u32) -> &mut [u8] {
        assert!(i < self.send_active, "send slot {i} not registered");
        &mut self.send[i as usize * self.slot..(i as usize + 1) * self.slot]
    }
    fn append_rdv(&self, i: u32, len: usize, out: &mut BytesMut) {
        assert!(self.rdv_open, "read of a region that is not registered");
        assert!(len <= self.rdv_bytes);
        let off = i as usize * self.rdv_bytes;
        out.extend_from_slice(&self.rdv[off..off + len]);
    }
    fn staging(&mut self, i: u32) -> &mut [u8] {
        assert!(self.staging_open, "staging used while not registered");
        &mut self.staging[i as usize * self.staging_bytes..(i as usize + 1) * self.staging_bytes]
    }
    fn open_rdv(&mut self) -> Result<(u64, u32), ResourceError> {
        assert!(!self.rdv_open, "region registered twice");
        if self.refuse {
            return Err(ResourceError::Other("over the cap".into()));
        }
        self.rdv_open = true;
        self.rdv_opens += 1;
        Ok((RDV_BASE, 0x77))
    }
    fn close_rdv(&mut self) {
        assert!(self.rdv_open, "region deregistered twice");
        self.rdv_open = false;
        self.rdv_closes += 1;
        self.rdv.fill(0xEE);
    }
    fn open_staging(&mut self) -> Result<(), ResourceError> {
        assert!(!self.staging_open);
        if self.refuse {
            return Err(ResourceError::Other("over the cap".into()));
        }
        self.staging_open = true;
        self.staging_opens += 1;
        Ok(())
    }
    fn close_staging(&mut self) {
        assert!(self.staging_open);
        self.staging_open = false;
        self.staging_closes += 1;
        self.staging.fill(0xDD);
    }
    fn grow_send(&mut self, n: u32) -> Result<(), ResourceError> {
        assert!(n > self.send_active && n as usize * self.slot <= self.send.len());
        if self.refuse {
            return Err(ResourceError::Other("over the cap".into()));
        }
        self.send_active = n;
        Ok(())
    }
    fn shrink_send(&mut self, n: u32) {
        assert!(n < self.send_active);
        self.send_active = n;
    }
    fn grow_recv(&mut self, n: u32) -> Result<(), ResourceError> {
        assert!(n > self.recv_active && n as usize * self.slot <= self.recv.len());
        if self.refuse {
            return Err(ResourceError::Other("over the cap".into()));
        }
        self.recv_active = n;
        Ok(())
    }
    fn shrink_recv(&mut self, n: u32) {
        assert!(
            n < self.recv_active,
            "shrink to {n} from {}",
            self.recv_active
        );
        self.recv_active = n;
        self.shrinks += 1;
    }
    fn register_source(&mut self, body: &Bytes) -> Option<u32> {
        if self.refuse_sources {
            return None;
        }
        self.sources.push(Some(body.clone()));
        Some(self.sources.len() as u32 - 1)
    }
    fn release_source(&mut self, id: u32) {
        let s = &mut self.sources[id as usize];
        assert!(s.is_some(), "source {id} released twice");
        *s = None;
        if let Some(x) = self.exposed.get_mut(id as usize) {
            *x = None;
        }
    }
    fn expose_source(&mut self, body: &Bytes) -> Option<ExposedBody> {
        if self.refuse_sources {
            return None;
        }
        let id = self.sources.len() as u32;
        self.sources.push(Some(body.clone()));
        self.exposed.resize(id as usize + 1, None);
        self.exposed[id as usize] = Some(false);
        Some(ExposedBody {
            id,
            addr: EXPOSED_BASE + (u64::from(id) << 32),
            rkey: EXPOSED_RKEY + id,
            bind: true,
        })
    }
    fn open_dest(&mut self, head: &[u8], len: usize) -> Result<u32, ResourceError> {
        if self.refuse || self.refuse_dests {
            return Err(ResourceError::Other("over the cap".into()));
        }
        let mut v = vec![0xAB; head.len() + len];
        v[..head.len()].copy_from_slice(head);
        self.dests.push(Some(v));
        Ok(self.dests.len() as u32 - 1)
    }
    fn close_read_cache(&mut self) {
        assert!(
            self.dests.iter().all(Option::is_none),
            "the read buffers released with a READ posted"
        );
        self.read_cache_closes += 1;
    }
    fn expose_dest(
        &mut self,
        id: u32,
        off: usize,
        len: usize,
    ) -> Result<ExposedBody, ResourceError> {
        if self.refuse_grants {
            return Err(ResourceError::Other("no window".into()));
        }
        let n = self.dests[id as usize]
            .as_ref()
            .expect("a destination exposed after it was taken")
            .len();
        assert!(off + len <= n, "grant outside the destination");
        if self.dest_grants.len() <= id as usize {
            self.dest_grants.resize(id as usize + 1, None);
        }
        assert!(self.dest_grants[id as usize].is_none(), "granted twice");
        self.dest_grants[id as usize] = Some((off, len, false));
        Ok(ExposedBody {
            id,
            addr: DEST_BASE + (u64::from(id) << 32) + off as u64,
            rkey: DEST_RKEY + id,
            bind: true,
        })
    }
    fn take_dest(&mut self, id: u32) -> Result<Bytes, ResourceError> {
        // §5.7: the peer's access goes first.
        if let Some(g) = self.dest_grants.get_mut(id as usize) {
            *g = None;
        }
        let v = self.dests[id as usize]
            .take()
            .expect("a destination taken once");
        Ok(Bytes::from(v))
    }
}

#[derive(Clone, Copy, Debug)]
struct P {
    slots: u32,
    slot: usize,
    threshold: usize,
    rdv_count: u32,
    rdv_bytes: usize,
    signal_every: u32,
    inline: usize,
    /// Offers RDMA WRITE with immediate data (§5.4).
    imm: bool,
    /// Offers covering notifications (§5.4).
    covers: bool,
    /// Memory on demand (§4.6, §5.5), with rings starting at `initial`.
    on_demand: bool,
    initial: u32,
    /// The device takes zero-length WRITEs without a valid rkey (§4.4).
    zero_write: bool,
    /// §4.7: revokes idle credits (a shared receive queue).
    revoke: bool,
    /// Zero-copy send from this body size on (§5.1; 0: never).
    zero_copy: usize,
    /// Offers reading messages (§5.6).
    read: bool,
    /// The "NIC" executes a READ after the work request posted next, as
    /// iWARP (siw) completes SENDs posted after a READ before the READ.
    late_reads: bool,
    /// No buffer can be registered for a READ (§5.6: the copy fallback).
    refuse_dests: bool,
    /// Offers written destinations (§5.7), and grants them.
    write_dest: bool,
    /// No destination can be granted (§5.7): the message is read.
    refuse_grants: bool,
}

impl P {
    fn small() -> P {
        P {
            slots: 8,
            slot: 256,
            threshold: 200,
            rdv_count: 3,
            rdv_bytes: 4096,
            signal_every: 3,
            inline: 64,
            imm: false,
            covers: true,
            on_demand: false,
            initial: 8,
            zero_write: true,
            revoke: false,
            zero_copy: 0,
            read: false,
            late_reads: false,
            refuse_dests: false,
            write_dest: false,
            refuse_grants: false,
        }
    }
    /// Memory on demand, rings starting at 4 of 8 slots.
    fn on_demand() -> P {
        P {
            on_demand: true,
            initial: 4,
            ..P::small()
        }
    }
    fn start_slots(&self) -> u32 {
        if self.on_demand {
            self.initial
        } else {
            self.slots
        }
    }
    fn hello(&self) -> Hello {
        Hello {
            version: VERSION,
            flags: if self.imm {
                wire::HELLO_FLAG_WRITE_IMM
            } else {
                0
            } | if self.covers {
                wire::HELLO_FLAG_COVERS
            } else {
                0
            } | if self.on_demand {
                wire::HELLO_FLAG_ON_DEMAND | wire::HELLO_FLAG_REVOCABLE
            } else {
                0
            } | if self.read { wire::HELLO_FLAG_READ } else { 0 }
                | if self.write_dest {
                    wire::HELLO_FLAG_WRITE_DEST
                } else {
                    0
                },
            credits: self.start_slots(),
            recv_slot_bytes: self.slot as u32,
            rdv_count: self.rdv_count,
            rdv_bytes: self.rdv_bytes as u32,
            rdv_addr: if self.on_demand { 0 } else { RDV_BASE },
            rdv_rkey: if self.on_demand { 0 } else { 0x77 },
            max_message: 1 << 30,
        }
    }
    fn mem(&self) -> Mem {
        Mem {
            recv: vec![0; self.slots as usize * self.slot],
            send: vec![0; self.slots as usize * self.slot],
            rdv: vec![0; self.rdv_count as usize * self.rdv_bytes],
            staging: vec![0; self.rdv_count as usize * self.rdv_bytes],
            slot: self.slot,
            rdv_bytes: self.rdv_bytes,
            staging_bytes: self.rdv_bytes,
            recv_active: self.start_slots(),
            send_active: self.start_slots(),
            rdv_open: !self.on_demand,
            staging_open: false,
            rdv_opens: 0,
            rdv_closes: 0,
            staging_opens: 0,
            staging_closes: 0,
            refuse: false,
            shrinks: 0,
            sources: Vec::new(),
            refuse_sources: false,
            exposed: Vec::new(),
            dests: Vec::new(),
            read_cache_closes: 0,
            refuse_dests: self.refuse_dests,
            dest_grants: Vec::new(),
            refuse_grants: self.refuse_grants,
        }
    }
    fn engine(&self, peer: &P) -> Engine {
        Engine::new(EngineConfig {
            recv_slots: self.slots,
            initial_recv_slots: self.start_slots(),
            recv_slot_bytes: self.slot,
            send_slots: self.slots,
            initial_send_slots: self.start_slots(),
            on_demand: self.on_demand,
            send_slot_bytes: self.slot,
            rendezvous_threshold: self.threshold,
            rdv_count: self.rdv_count,
            rdv_bytes: self.rdv_bytes,
            rdv_addr: RDV_BASE,
            staging_count: self.rdv_count,
            staging_bytes: self.rdv_bytes,
            zero_copy_min: self.zero_copy,
            max_message: 1 << 30,
            signal_every: self.signal_every,
            max_inline: self.inline,
            write_imm: self.imm && peer.imm,
            covers: self.covers && peer.covers,
            read_rdv: self.read && peer.read,
            write_dest: self.read && peer.read && self.write_dest && peer.write_dest,
            grant_dest: self.read && peer.read && self.write_dest && peer.write_dest,
            zero_length_write_any_rkey: self.zero_write,
            revoke_idle: self.revoke,
            peer: peer.hello(),
        })
        .expect("valid peer hello")
    }
}

enum Op {
    Send {
        slot: u32,
        len: usize,
        wr_id: u64,
        signaled: bool,
    },
    Write {
        staging: u32,
        len: usize,
        addr: u64,
        rkey: u32,
        wr_id: u64,
        signaled: bool,
        imm: Option<u32>,
        source: Option<WriteSource>,
    },
    /// §5.6: a window bound over exposed source `id`.
    Bind { id: u32, wr_id: u64, signaled: bool },
    /// §5.7: a window bound over granted destination `dest`.
    BindDest {
        dest: u32,
        wr_id: u64,
        signaled: bool,
    },
    /// §5.6: a READ of the peer's exposed body into staging buffer
    /// `staging` (the copy fallback).
    ReadStaging {
        staging: u32,
        len: usize,
        addr: u64,
        rkey: u32,
        wr_id: u64,
    },
    /// §5.6: a READ of the peer's exposed body into destination `dest`.
    Read {
        dest: u32,
        off: usize,
        len: usize,
        addr: u64,
        rkey: u32,
        wr_id: u64,
    },
}

struct Side {
    e: Engine,
    mem: Mem,
    posted: VecDeque<u64>,
    cq: VecDeque<Completion>,
    wire: VecDeque<Op>, // ops this side posted, not yet executed by the "NIC"
    got: Vec<Bytes>,
    closed: bool,
    /// §4.7: receives come from a shared receive queue (with `P::revoke`):
    /// the "NIC" places a message in a pool buffer (its bytes here, in
    /// completion order, `None` for a WRITE with immediate), and the slot
    /// is bound when the completion is processed, as `ConnMemory::map_recv`
    /// does.
    srq: bool,
    srq_data: VecDeque<Option<Vec<u8>>>,
    /// WRITEs with immediate data this side received (§5.4): its
    /// receive-side notifications for rendezvous chunks.
    imm_notes: u64,
    /// CHUNK SENDs this side received (§5.2): the same without immediates.
    chunk_sends: u64,
    /// See [`P::late_reads`].
    late_reads: bool,
}

/// wr_id tag of a completion from the emulated shared receive queue.
const SRQ_TAG: u64 = 3;

impl Side {
    fn new(me: &P, peer: &P) -> Side {
        let mut s = Side {
            e: me.engine(peer),
            mem: me.mem(),
            posted: VecDeque::new(),
            cq: VecDeque::new(),
            wire: VecDeque::new(),
            got: Vec::new(),
            closed: false,
            srq: me.revoke,
            srq_data: VecDeque::new(),
            imm_notes: 0,
            chunk_sends: 0,
            late_reads: me.late_reads,
        };
        s.run_actions();
        s
    }

    fn run_actions(&mut self) {
        for a in self.e.take_actions() {
            match a {
                Action::PostRecv { slot, wr_id } => {
                    assert_eq!((wr_id & 0xffff_ffff) as u32, slot);
                    self.posted.push_back(wr_id);
                }
                Action::PostSend {
                    slot,
                    len,
                    wr_id,
                    signaled,
                    ..
                } => self.wire.push_back(Op::Send {
                    slot,
                    len,
                    wr_id,
                    signaled,
                }),
                Action::PostWrite {
                    staging,
                    len,
                    remote_addr,
                    rkey,
                    wr_id,
                    signaled,
                    imm,
                    source,
                } => self.wire.push_back(Op::Write {
                    staging,
                    len,
                    addr: remote_addr,
                    rkey,
                    wr_id,
                    signaled,
                    imm,
                    source,
                }),
                Action::BindSource {
                    id,
                    wr_id,
                    signaled,
                } => self.wire.push_back(Op::Bind {
                    id,
                    wr_id,
                    signaled,
                }),
                Action::BindDest {
                    dest,
                    wr_id,
                    signaled,
                } => self.wire.push_back(Op::BindDest {
                    dest,
                    wr_id,
                    signaled,
                }),
                Action::PostReadStaging {
                    staging,
                    len,
                    remote_addr,
                    rkey,
                    wr_id,
                } => self.wire.push_back(Op::ReadStaging {
                    staging,
                    len,
                    addr: remote_addr,
                    rkey,
                    wr_id,
                }),
                Action::PostRead {
                    dest,
                    off,
                    len,
                    remote_addr,
                    rkey,
                    wr_id,
                } => self.wire.push_back(Op::Read {
                    dest,
                    off,
                    len,
                    addr: remote_addr,
                    rkey,
                    wr_id,
                }),
            }
        }
    }

    fn process(&mut self, max: usize) {
        for _ in 0..max {
            let Some(mut c) = self.cq.pop_front() else {
                break;
            };
            if c.wr_id >> 56 == SRQ_TAG {
                // The oldest slot posted takes the buffer.
                let rwr = self
                    .posted
                    .pop_front()
                    .expect("credit overrun: no slot posted");
                let rslot = (rwr & 0xffff_ffff) as usize;
                if let Some(data) = self.srq_data.pop_front().expect("data of the completion") {
                    let base = rslot * self.mem.slot;
                    self.mem.recv[base..base + data.len()].copy_from_slice(&data);
                }
                c.wr_id = rwr;
            }
            self.e
                .on_completion(c, &mut self.mem)
                .expect("engine error");
            // §4.7: slots a RELEASED retired leave the posted ones at once,
            // as ConnMemory::shrink_recv withdraws them from its queue.
            let active = self.e.recv_active;
            self.posted.retain(|w| ((w & 0xffff_ffff) as u32) < active);
        }
        self.e.progress(&mut self.mem).expect("progress");
        self.run_actions();
        while let Some(ev) = self.e.next_event() {
            match ev {
                Event::Message(b) => {
                    assert!(!self.closed);
                    self.got.push(b)
                }
                Event::PeerClosed => self.closed = true,
            }
        }
    }
}

/// The "NIC": executes the next op `from` posted, reading the sender's
/// memory at execution time (so premature buffer reuse corrupts data).
fn deliver(from: &mut Side, to: &mut Side) -> bool {
    if from.late_reads
        && from.wire.len() > 1
        && matches!(
            from.wire.front(),
            Some(Op::Read { .. } | Op::ReadStaging { .. })
        )
    {
        // iWARP: what was posted after a READ completes before it.
        from.wire.swap(0, 1);
    }
    let Some(op) = from.wire.pop_front() else {
        return false;
    };
    match op {
        Op::Send {
            slot,
            len,
            wr_id,
            signaled,
        } => {
            let kind = Header::decode(&from.mem.send_slot(slot)[..len]).map(|h| h.kind);
            to.chunk_sends += u64::from(kind == Ok(Kind::Chunk));
            if to.srq {
                // A buffer of the pool; the slot is bound when processed.
                assert!(
                    to.posted.len() > to.srq_data.len(),
                    "credit overrun: more messages than slots posted"
                );
                assert!(len <= to.mem.slot, "SEND larger than receive slot");
                to.srq_data
                    .push_back(Some(from.mem.send_slot(slot)[..len].to_vec()));
                to.cq.push_back(Completion {
                    wr_id: SRQ_TAG << 56,
                    ok: true,
                    status: 0,
                    byte_len: len as u32,
                    imm: Imm::None,
                });
                if signaled {
                    from.cq.push_back(Completion {
                        wr_id,
                        ok: true,
                        status: 0,
                        byte_len: 0,
                        imm: Imm::None,
                    });
                }
                return true;
            }
            let rwr = to
                .posted
                .pop_front()
                .expect("RNR: SEND with no posted receive");
            let rslot = (rwr & 0xffff_ffff) as usize;
            assert!(
                rslot < to.mem.recv_active as usize,
                "receive into an unregistered slot"
            );
            let src = from.mem.send_slot(slot)[..len].to_vec();
            assert!(len <= to.mem.slot, "SEND larger than receive slot");
            to.mem.recv[rslot * to.mem.slot..rslot * to.mem.slot + len].copy_from_slice(&src);
            to.cq.push_back(Completion {
                wr_id: rwr,
                ok: true,
                status: 0,
                byte_len: len as u32,
                imm: Imm::None,
            });
            if signaled {
                from.cq.push_back(Completion {
                    wr_id,
                    ok: true,
                    status: 0,
                    byte_len: 0,
                    imm: Imm::None,
                });
            }
        }
        Op::Write {
            staging,
            len,
            addr,
            rkey,
            wr_id,
            signaled,
            imm,
            source,
        } if addr >= DEST_BASE => {
            // §5.7: a body WRITTEN into a destination the peer granted:
            // only through a bound window, inside the grant, from a body
            // still held (read at execution time).
            assert!(imm.is_none(), "a destination WRITE with immediate data");
            let id = rkey.wrapping_sub(DEST_RKEY);
            let (goff, glen, bound) = to
                .mem
                .dest_grants
                .get(id as usize)
                .copied()
                .flatten()
                .expect("WRITE into a destination not granted or revoked");
            assert!(bound, "WRITE before the destination's window was bound");
            let at = (addr - DEST_BASE - (u64::from(id) << 32)) as usize;
            assert!(
                at >= goff && at + len <= goff + glen,
                "WRITE outside the granted range"
            );
            let Some(WriteSource { id: src, off, head }) = source else {
                panic!("a destination written from staging");
            };
            assert_eq!(head, 0);
            let body = from.mem.sources[src as usize]
                .clone()
                .expect("WRITE from a released source");
            let _ = staging;
            let d = to.mem.dests[id as usize]
                .as_mut()
                .expect("WRITE into a destination taken");
            d[at..at + len].copy_from_slice(&body[off..off + len]);
            if signaled {
                from.cq.push_back(Completion {
                    wr_id,
                    ok: true,
                    status: 0,
                    byte_len: 0,
                    imm: Imm::None,
                });
            }
        }
        Op::Write {
            staging,
            len,
            addr,
            rkey,
            wr_id,
            signaled,
            imm,
            source,
        } => {
            if len > 0 {
                // The rkey is valid only while the region is registered.
                assert!(to.mem.rdv_open, "WRITE into a deregistered region");
                assert_eq!(rkey, 0x77);
            }
            let off = addr.saturating_sub(RDV_BASE) as usize;
            assert!(off + len <= to.mem.rdv.len(), "WRITE out of bounds");
            // Read at execution time: a source released (or a staging
            // buffer reused) before its WRITE executed panics or corrupts.
            let src = match source {
                None => from.mem.staging(staging)[..len].to_vec(),
                Some(WriteSource { id, off: at, head }) => {
                    let body = from.mem.sources[id as usize]
                        .clone()
                        .expect("WRITE from a released source");
                    let mut v = if head > 0 {
                        from.mem.staging(staging)[..head].to_vec()
                    } else {
                        Vec::new()
                    };
                    v.extend_from_slice(&body[at..at + len - head]);
                    v
                }
            };
            to.mem.rdv[off..off + len].copy_from_slice(&src);
            to.imm_notes += u64::from(imm.is_some());
            if let (Some(v), true) = (imm, to.srq) {
                assert!(
                    to.posted.len() > to.srq_data.len(),
                    "credit overrun: more messages than slots posted"
                );
                to.srq_data.push_back(None);
                to.cq.push_back(Completion {
                    wr_id: SRQ_TAG << 56,
                    ok: true,
                    status: 0,
                    byte_len: len as u32,
                    imm: Imm::Write(v),
                });
            } else if let Some(v) = imm {
                // §5.4: WRITE with immediate consumes a posted receive.
                let rwr = to
                    .posted
                    .pop_front()
                    .expect("RNR: WRITE_WITH_IMM with no posted receive");
                to.cq.push_back(Completion {
                    wr_id: rwr,
                    ok: true,
                    status: 0,
                    byte_len: len as u32,
                    imm: Imm::Write(v),
                });
            }
            if signaled {
                from.cq.push_back(Completion {
                    wr_id,
                    ok: true,
                    status: 0,
                    byte_len: 0,
                    imm: Imm::None,
                });
            }
        }
        Op::Bind {
            id,
            wr_id,
            signaled,
        } => {
            let x = from.mem.exposed[id as usize]
                .as_mut()
                .expect("a bind of a released source");
            *x = true;
            if signaled {
                from.cq.push_back(Completion {
                    wr_id,
                    ok: true,
                    status: 0,
                    byte_len: 0,
                    imm: Imm::None,
                });
            }
        }
        Op::BindDest {
            dest,
            wr_id,
            signaled,
        } => {
            let g = from.mem.dest_grants[dest as usize]
                .as_mut()
                .expect("a bind of a destination revoked");
            g.2 = true;
            if signaled {
                from.cq.push_back(Completion {
                    wr_id,
                    ok: true,
                    status: 0,
                    byte_len: 0,
                    imm: Imm::None,
                });
            }
        }
        Op::Read {
            dest,
            off,
            len,
            addr,
            rkey,
            wr_id,
        } => {
            let bytes = exposed_range(to, addr, rkey, len);
            let d = from.mem.dests[dest as usize]
                .as_mut()
                .expect("READ into a destination taken");
            d[off..off + len].copy_from_slice(&bytes);
            from.cq.push_back(read_done(wr_id, len));
        }
        Op::ReadStaging {
            staging,
            len,
            addr,
            rkey,
            wr_id,
        } => {
            let bytes = exposed_range(to, addr, rkey, len);
            from.mem.staging(staging)[..len].copy_from_slice(&bytes);
            from.cq.push_back(read_done(wr_id, len));
        }
    }
    true
}

/// §5.6: the `len` bytes at (`addr`, `rkey`) of a body `to` exposed, read
/// at execution time: one released (or not yet bound) before the READ
/// executes, or a range outside it, panics.
fn exposed_range(to: &Side, addr: u64, rkey: u32, len: usize) -> Bytes {
    let id = rkey.wrapping_sub(EXPOSED_RKEY);
    assert_eq!(
        to.mem.exposed.get(id as usize).copied().flatten(),
        Some(true),
        "READ of a body not exposed, released, or not bound yet"
    );
    let at = addr
        .checked_sub(EXPOSED_BASE + (u64::from(id) << 32))
        .expect("READ below the body") as usize;
    let body = to.mem.sources[id as usize]
        .clone()
        .expect("READ of a released source");
    assert!(at + len <= body.len(), "READ beyond the body");
    body.slice(at..at + len)
}

/// The completion of a READ of `len` bytes.
fn read_done(wr_id: u64, len: usize) -> Completion {
    Completion {
        wr_id,
        ok: true,
        status: 0,
        byte_len: len as u32,
        imm: Imm::None,
    }
}

/// An active side `a` and a passive side `b` as `conn.rs` sets them up
/// (§2.3): `a` sends a CREDIT first, `b` answers its first message.
fn connect(p: &P) -> (Side, Side) {
    let mut a = Side::new(p, p);
    let mut b = Side::new(p, p);
    b.e.set_wait_first_recv();
    a.e.send_initial_credit();
    (a, b)
}

/// Runs both sides and the "NIC" until nothing moves.
fn pump(a: &mut Side, b: &mut Side) {
    for _ in 0..10_000 {
        a.process(64);
        b.process(64);
        let moved = deliver(a, b) | deliver(b, a);
        if !moved && a.cq.is_empty() && b.cq.is_empty() {
            return;
        }
    }
    panic!("no quiescence");
}

fn pattern(id: u64, len: usize) -> Bytes {
    let mut v = vec![0u8; len];
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in v.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    Bytes::from(v)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// §4.2 invariant, checked at every step: the credits held by `from`, plus
/// SENDs in flight, plus receive completions not yet processed by `to`, plus
/// credits `to` owes or is returning, equal `to`'s ring size. Also `to` has
/// a receive posted for every credit `from` holds.
fn check_credit_invariant(from: &Side, to: &Side) {
    // §4.6: the limit `from` knows; a grant in flight adds to both ends
    // of the identity once applied.
    // §4.7: a revoke's unpaid debt is still the peer's, in flight.
    let ring = from.e.credit_limit + from.e.debt;
    let in_wire = from
        .wire
        .iter()
        .filter(|o| matches!(o, Op::Send { .. } | Op::Write { imm: Some(_), .. }))
        .count() as u32;
    let in_cq = to
        .cq
        .iter()
        .filter(|c| matches!(c.wr_id >> 56, WR_RECV | SRQ_TAG))
        .count() as u32;
    // Credits already returned by `to` but not yet applied by `from`.
    let mut returning = 0u32;
    for o in &to.wire {
        if let Op::Send { slot, .. } = o {
            let b = &to.mem.send[*slot as usize * to.mem.slot..];
            returning += Header::decode(b).unwrap().credit_return as u32;
        }
    }
    // (A WRITE with immediate carries no header, hence no returns.)
    for data in from.srq_data.iter().flatten() {
        returning += Header::decode(data).unwrap().credit_return as u32;
    }
    for c in from
        .cq
        .iter()
        .filter(|c| c.wr_id >> 56 == WR_RECV && c.imm == Imm::None)
    {
        let slot = (c.wr_id & 0xffff_ffff) as usize;
        let b = &from.mem.recv[slot * from.mem.slot..];
        returning += Header::decode(b).unwrap().credit_return as u32;
    }
    assert_eq!(
        from.e.credits() + in_wire + in_cq + to.e.owed_total + returning,
        ring,
        "credit conservation"
    );
    let bound_later = to.srq_data.len() as u32;
    assert!(
        to.posted.len() as u32 >= from.e.credits() + in_wire + bound_later,
        "credit without posted receive"
    );
}

/// Runs two engines back to back. `a_msgs`/`b_msgs` are message lengths.
fn run_pair(pa: P, pb: P, a_msgs: &[usize], b_msgs: &[usize], seed: u64) -> (Side, Side) {
    let mut a = Side::new(&pa, &pb);
    let mut b = Side::new(&pb, &pa);
    let mut rng = Rng(seed | 1);
    let (mut ia, mut ib) = (0, 0);
    let mut steps = 0u64;
    loop {
        steps += 1;
        assert!(steps < 10_000_000, "no progress (deadlock?)");
        // Submit with back-pressure like the driver: at most 2 queued.
        if ia < a_msgs.len() && a.e.pending_msgs() < 2 && rng.next().is_multiple_of(3) {
            let m = pattern(ia as u64, a_msgs[ia]);
            if rng.next().is_multiple_of(2) {
                // A gather (head, body), split anywhere: same bytes arrive.
                let mut body = m.clone();
                let head = body.split_to(rng.next() as usize % (m.len() + 1));
                a.e.submit_parts(head, body);
            } else {
                a.e.submit(m);
            }
            ia += 1;
            if ia == a_msgs.len() {
                a.e.close();
            }
        }
        if ib < b_msgs.len() && b.e.pending_msgs() < 2 && rng.next().is_multiple_of(3) {
            b.e.submit(pattern(1_000_000 + ib as u64, b_msgs[ib]));
            ib += 1;
            if ib == b_msgs.len() {
                b.e.close();
            }
        }
        if a_msgs.is_empty() && !a.e.close_sent() && a.e.pending_msgs() == 0 {
            a.e.close();
        }
        if b_msgs.is_empty() && !b.e.close_sent() && b.e.pending_msgs() == 0 {
            b.e.close();
        }
        match rng.next() % 9 {
            0 | 4 => {
                for _ in 0..rng.next() % 4 + 1 {
                    deliver(&mut a, &mut b);
                }
            }
            1 | 5 => {
                for _ in 0..rng.next() % 4 + 1 {
                    deliver(&mut b, &mut a);
                }
            }
            2 | 6 => a.process(rng.next() as usize % 8 + 1),
            3 | 7 => b.process(rng.next() as usize % 8 + 1),
            // §5.5: memory on demand gives back what went unused, at any
            // moment (a no-op for what is not on demand).
            _ => {
                let s = if rng.next().is_multiple_of(2) {
                    &mut a
                } else {
                    &mut b
                };
                s.e.on_idle_tick(&mut s.mem);
            }
        }
        check_credit_invariant(&a, &b);
        check_credit_invariant(&b, &a);
        let done = a.closed
            && b.closed
            && a.wire.is_empty()
            && b.wire.is_empty()
            && a.cq.is_empty()
            && b.cq.is_empty();
        if done && ia == a_msgs.len() && ib == b_msgs.len() {
            // settle: flush any last credit messages
            for _ in 0..1000 {
                a.process(64);
                b.process(64);
                let moved = deliver(&mut a, &mut b) | deliver(&mut b, &mut a);
                if !moved && a.cq.is_empty() && b.cq.is_empty() {
                    break;
                }
            }
            break;
        }
    }
    assert!(
        a.e.close_confirmed() && b.e.close_confirmed(),
        "close handshake (§6): a flushed {} saw {} rec {:?}; b flushed {} saw {} rec {:?}",
        a.e.close_flushed(),
        a.e.peer_saw_close,
        a.e.records,
        b.e.close_flushed(),
        b.e.peer_saw_close,
        b.e.records
    );
    // §5.1: every zero-copy source released once its WRITEs completed;
    // §5.6: every exposed one once read, every destination handed up.
    for side in [&a, &b] {
        assert!(
            side.mem.sources.iter().all(Option::is_none),
            "a source kept"
        );
        assert!(
            side.mem.dests.iter().all(Option::is_none),
            "a destination kept"
        );
        assert_eq!(side.e.reads_announced(), 0);
        assert_eq!(side.e.reads_in_progress(), 0);
    }
    // Credit conservation at quiescence (§4.2): what a holds + what b owes
    // == b's receive ring.
    assert_eq!(a.e.credits() + b.e.owed_total, b.e.recv_active);
    assert_eq!(b.e.credits() + a.e.owed_total, a.e.recv_active);
    assert_eq!(a.e.credit_limit, b.e.recv_active);
    assert_eq!(b.e.credit_limit, a.e.recv_active);
    assert_eq!(a.posted.len() as u32, a.e.recv_active);
    assert_eq!(b.posted.len() as u32, b.e.recv_active);
    assert!(a.e.recv_active <= pa.slots && b.e.recv_active <= pb.slots);
    // Rendezvous buffers: all back with the sender while it holds the
    // region; none anywhere once released (§5.5).
    for (s, r, pr) in [(&a, &b, &pb), (&b, &a, &pa)] {
        let held = !matches!(s.e.peer_rdv, PeerRdv::Absent | PeerRdv::Requested);
        let want = if held { pr.rdv_count } else { 0 };
        assert_eq!(s.e.peer_rdv_avail + r.e.rdv_owed, want);
        assert_eq!(r.mem.rdv_open, r.e.local_rdv != LocalRdv::Absent);
    }
    for (i, m) in b.got.iter().enumerate() {
        assert_eq!(m, &pattern(i as u64, a_msgs[i]), "a->b message {i}");
    }
    assert_eq!(b.got.len(), a_msgs.len());
    for (i, m) in a.got.iter().enumerate() {
        assert_eq!(
            m,
            &pattern(1_000_000 + i as u64, b_msgs[i]),
            "b->a message {i}"
        );
    }
    assert_eq!(a.got.len(), b_msgs.len());
    (a, b)
}

#[test]
fn one_way_small_no_rnr_and_credit_messages() {
    let p = P::small();
    let msgs: Vec<usize> = (0..5000).map(|i| i % 150).collect();
    let (a, b) = run_pair(p, p, &msgs, &[], 7);
    assert!(
        b.e.counters.credit_msgs > 0,
        "one-way traffic needs credit messages"
    );
    assert_eq!(a.e.counters.rdv_writes, 0);
    assert!(a.e.counters.inline_sends > 0);
}

#[test]
fn threshold_boundary() {
    let p = P::small();
    let t = p.threshold;
    let msgs = vec![
        0,
        1,
        t - 1,
        t,
        t + 1,
        4096,
        4097,
        3 * 4096,
        3 * 4096 + 1,
        20_000,
    ];
    let (a, _b) = run_pair(p, p, &msgs, &msgs, 3);
    // t+1 .. : 1+1+1+3+4+5 chunks
    assert_eq!(a.e.counters.rdv_writes, 1 + 1 + 2 + 3 + 4 + 5);
    assert_eq!(a.e.counters.eager_sends, 4);
}

#[test]
fn ring_reuse_many_generations() {
    let mut p = P::small();
    p.slots = 4;
    p.signal_every = 2;
    let msgs: Vec<usize> = (0..3000).map(|i| (i * 7) % 240).collect();
    run_pair(p, p, &msgs, &msgs, 11);
}

#[test]
fn rendezvous_chunks_pipelined_asymmetric_configs() {
    let pa = P::small();
    let mut pb = P::small();
    pb.rdv_bytes = 8192;
    pb.rdv_count = 2;
    pb.slots = 16;
    pb.slot = 512;
    pb.threshold = 400;
    let msgs = vec![100_000, 5, 70_001, 8192, 8193];
    let (a, b) = run_pair(pa, pb, &msgs, &msgs, 5);
    // a -> b: chunk = min(a staging 4096, b rdv 8192) = 4096
    assert_eq!(a.e.config().chunk_bytes(), 4096);
    assert_eq!(b.e.config().chunk_bytes(), 4096);
}

/// A 1 GiB message through simulated rendezvous buffers: chunk accounting
/// and stripe markers are checked (the payload is mostly zero pages).
#[test]
fn one_gib_message_chunk_accounting() {
    let mut p = P::small();
    p.rdv_bytes = 4 << 20;
    p.rdv_count = 4;
    let total = 1usize << 30;
    let mut v = vec![0u8; total];
    for (k, stripe) in v.chunks_mut(1 << 20).enumerate() {
        stripe[..8].copy_from_slice(&(k as u64 ^ 0xA5A5).to_le_bytes());
    }
    let msg = Bytes::from(v);
    let mut a = Side::new(&p, &p);
    let mut b = Side::new(&p, &p);
    a.e.submit(msg);
    let mut guard = 0;
    while b.got.is_empty() {
        guard += 1;
        assert!(guard < 100_000);
        a.process(64);
        while deliver(&mut a, &mut b) {}
        b.process(64);
        while deliver(&mut b, &mut a) {}
    }
    assert_eq!(a.e.counters.rdv_writes, 256);
    assert_eq!(a.e.counters.rdv_bytes, total as u64);
    let got = &b.got[0];
    assert_eq!(got.len(), total);
    for k in 0..1024 {
        let o = k << 20;
        assert_eq!(got[o..o + 8], (k as u64 ^ 0xA5A5).to_le_bytes());
        assert_eq!(got[o + 8], 0);
    }
}

// ---- malformed notifications (§5.3) ----

fn receiver() -> (Engine, Mem, P) {
    let p = P::small();
    let e = p.engine(&p);
    (e, p.mem(), p)
}

fn inject(
    e: &mut Engine,
    mem: &mut Mem,
    slot: u32,
    gen: u32,
    h: Header,
    extra: &[u8],
) -> Result<(), EngineError> {
    let base = slot as usize * mem.slot;
    h.encode(&mut mem.recv[base..base + HDR_LEN]);
    mem.recv[base + HDR_LEN..base + HDR_LEN + extra.len()].copy_from_slice(extra);
    e.on_completion(
        Completion {
            wr_id: recv_wr_id(slot, gen),
            ok: true,
            status: 0,
            byte_len: (HDR_LEN + extra.len()) as u32,
            imm: Imm::None,
        },
        mem,
    )
}

fn chunk(idx: u32, len: u32, total: u64, last: bool) -> Header {
    let mut h = Header::new(Kind::Chunk);
    h.rdv_index = idx;
    h.len = len;
    h.total_len = total;
    h.addr = RDV_BASE + idx as u64 * 4096;
    if last {
        h.flags = FLAG_LAST;
    }
    h
}

/// The exact violation an engine reported.
fn violation(r: Result<(), EngineError>) -> PeerMisbehaved {
    match r {
        Err(EngineError::Protocol(v)) => v,
        other => panic!("expected a protocol violation, got {other:?}"),
    }
}

#[test]
fn malformed_notifications_rejected() {
    use PeerMisbehaved as V;
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, chunk(3, 10, 10, true), &[])),
        V::ChunkUnknownBuffer { index: 3, count: 3 }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(
            &mut e,
            &mut m,
            0,
            0,
            chunk(0, 4097, 5000, false),
            &[]
        )),
        V::ChunkLength {
            len: 4097,
            max: 4096
        }
    );
    let (mut e, mut m, _) = receiver();
    let mut h = chunk(0, 10, 10, true);
    h.addr += 1;
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, h, &[])),
        V::ChunkWrongAddress {
            index: 0,
            addr: RDV_BASE + 1,
            expected: RDV_BASE
        }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, chunk(1, 10, 10, true), &[])),
        V::ChunkBufferNotGranted {
            index: 1,
            expected: 0,
            held: 3
        }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, chunk(0, 10, 20, true), &[])),
        V::LastFlagWrong {
            last: true,
            end: 10,
            total: 20
        }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, chunk(0, 10, 5, false), &[])),
        V::ChunkOverrun { end: 10, total: 5 }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, chunk(0, 0, 0, true), &[])),
        V::ChunkLength { len: 0, max: 4096 }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(
            &mut e,
            &mut m,
            0,
            0,
            chunk(0, 10, (1 << 30) + 1, false),
            &[]
        )),
        V::MessageTooLarge {
            total: (1 << 30) + 1,
            max: 1 << 30
        }
    );
    let (mut e, mut m, _) = receiver();
    inject(&mut e, &mut m, 0, 0, chunk(0, 4096, 3 * 4096, false), &[]).unwrap();
    assert_eq!(
        violation(inject(
            &mut e,
            &mut m,
            1,
            0,
            chunk(1, 4096, 2 * 4096, true),
            &[]
        )),
        V::ChunkTotalChanged {
            was: 3 * 4096,
            now: 2 * 4096
        }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, chunk(0, 10, 10, true), &[7])),
        V::ChunkWithPayload { len: HDR_LEN + 1 }
    );
    // stale generation
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 5, Header::new(Kind::Credit), &[])),
        V::StaleReceive {
            wr_id: recv_wr_id(0, 5)
        }
    );
    // unknown kind / short message
    let (mut e, mut m, _) = receiver();
    m.recv[0] = 99;
    let r = e.on_completion(
        Completion {
            wr_id: recv_wr_id(0, 0),
            ok: true,
            status: 0,
            byte_len: 32,
            imm: Imm::None,
        },
        &mut m,
    );
    assert_eq!(violation(r), V::UnknownKind { kind: 99 });
    let (mut e, mut m, _) = receiver();
    let r = e.on_completion(
        Completion {
            wr_id: recv_wr_id(0, 0),
            ok: true,
            status: 0,
            byte_len: 3,
            imm: Imm::None,
        },
        &mut m,
    );
    assert_eq!(violation(r), V::ShortMessage { len: 3 });
    let (mut e, mut m, _) = receiver();
    let r = e.on_completion(
        Completion {
            wr_id: recv_wr_id(0, 0),
            ok: true,
            status: 0,
            byte_len: 257,
            imm: Imm::None,
        },
        &mut m,
    );
    assert_eq!(
        violation(r),
        V::ReceiveExceedsSlot {
            len: 257,
            slot: 256
        }
    );
    // too many credits / rendezvous buffers returned
    let (mut e, mut m, _) = receiver();
    let mut h = Header::new(Kind::Credit);
    h.credit_return = 1;
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, h, &[])),
        V::TooManyCredits {
            credits: 9,
            granted: 8
        }
    );
    let (mut e, mut m, _) = receiver();
    let mut h = Header::new(Kind::Credit);
    h.credit_return = u16::MAX;
    h.rdv_return = u16::MAX;
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, h, &[])),
        V::TooManyCredits {
            credits: 8 + 65535,
            granted: 8
        }
    );
    let (mut e, mut m, _) = receiver();
    let mut h = Header::new(Kind::Credit);
    h.rdv_return = 1;
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, h, &[])),
        V::TooManyRendezvousReturns {
            available: 4,
            advertised: 3
        }
    );
    // CLOSE_SEEN for a CLOSE never sent
    let (mut e, mut m, _) = receiver();
    let mut h = Header::new(Kind::Credit);
    h.flags = FLAG_CLOSE_SEEN;
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, h, &[])),
        V::CloseSeenWithoutClose
    );
    // eager length lie
    let (mut e, mut m, _) = receiver();
    let mut h = Header::new(Kind::Eager);
    h.len = 100;
    assert_eq!(
        violation(inject(&mut e, &mut m, 0, 0, h, &[1, 2, 3])),
        V::EagerLengthMismatch {
            header: 100,
            carried: 3
        }
    );
    // data after CLOSE; eager and CLOSE inside a rendezvous message
    let (mut e, mut m, _) = receiver();
    inject(&mut e, &mut m, 0, 0, Header::new(Kind::Close), &[]).unwrap();
    let mut h = Header::new(Kind::Eager);
    h.len = 1;
    assert_eq!(
        violation(inject(&mut e, &mut m, 1, 0, h, &[1])),
        V::AfterClose { kind: "EAGER" }
    );
    let (mut e, mut m, _) = receiver();
    inject(&mut e, &mut m, 0, 0, chunk(0, 4096, 3 * 4096, false), &[]).unwrap();
    let mut h = Header::new(Kind::Eager);
    h.len = 1;
    assert_eq!(
        violation(inject(&mut e, &mut m, 1, 0, h, &[1])),
        V::EagerInsideRendezvous
    );
    let (mut e, mut m, _) = receiver();
    inject(&mut e, &mut m, 0, 0, chunk(0, 4096, 3 * 4096, false), &[]).unwrap();
    assert_eq!(
        violation(inject(&mut e, &mut m, 1, 0, Header::new(Kind::Close), &[])),
        V::CloseInsideRendezvous
    );
    // a completion with no known wr_id kind
    let (mut e, mut m, _) = receiver();
    let r = e.on_completion(
        Completion {
            wr_id: 7 << 56,
            ok: true,
            status: 0,
            byte_len: 0,
            imm: Imm::None,
        },
        &mut m,
    );
    assert_eq!(violation(r), V::UnknownWrId { wr_id: 7 << 56 });
}

#[test]
fn reused_rendezvous_buffer_rejected() {
    // All 3 buffers used without any being returned, then a 4th chunk
    // reuses buffer 0 before we re-advertised it.
    let (mut e, mut m, _) = receiver();
    let total = 4 * 4096;
    for i in 0..3u32 {
        inject(&mut e, &mut m, i, 0, chunk(i, 4096, total, false), &[]).unwrap();
    }
    assert_eq!(
        violation(inject(
            &mut e,
            &mut m,
            3,
            0,
            chunk(0, 4096, total, true),
            &[]
        )),
        PeerMisbehaved::ChunkBufferNotGranted {
            index: 0,
            expected: 0,
            held: 0
        }
    );
    // After the return went out (progress sends a credit message), reuse is fine.
    let (mut e, mut m, _) = receiver();
    for i in 0..3u32 {
        inject(&mut e, &mut m, i, 0, chunk(i, 4096, total, false), &[]).unwrap();
    }
    e.progress(&mut m).unwrap();
    assert!(e
        .take_actions()
        .iter()
        .any(|a| matches!(a, Action::PostSend { .. })));
    inject(&mut e, &mut m, 3, 0, chunk(0, 4096, total, true), &[]).unwrap();
    assert!(matches!(e.next_event(), Some(Event::Message(b)) if b.len() == total as usize));
}

#[test]
fn send_without_credit_rejected() {
    // The ring has `slots` receive buffers: the peer holds exactly that many
    // credits until we return some. One more SEND is a violation (§4.2),
    // even though the slot it landed in had already been reposted.
    let (mut e, mut m, p) = receiver();
    for i in 0..p.slots {
        inject(&mut e, &mut m, i, 0, Header::new(Kind::Credit), &[]).unwrap();
    }
    let r = inject(&mut e, &mut m, 0, 1, Header::new(Kind::Credit), &[]);
    assert_eq!(
        violation(r),
        PeerMisbehaved::SendWithoutCredit {
            excess: 1,
            granted: p.slots
        }
    );
    // Once the returns went out (a CREDIT message), the peer may send again.
    let (mut e, mut m, p) = receiver();
    for i in 0..p.slots {
        inject(&mut e, &mut m, i, 0, Header::new(Kind::Credit), &[]).unwrap();
    }
    e.progress(&mut m).unwrap();
    let sent = e.take_actions();
    assert!(sent.iter().any(|a| matches!(a, Action::PostSend { .. })));
    inject(&mut e, &mut m, 0, 1, Header::new(Kind::Credit), &[]).unwrap();
}

#[test]
fn a_huge_claimed_total_reserves_only_what_arrives() {
    // One 32-byte notification claiming a 1 GiB message must not make the
    // receiver reserve 1 GiB: memory follows the chunks that landed.
    let (mut e, mut m, _) = receiver();
    inject(&mut e, &mut m, 0, 0, chunk(0, 4096, 1 << 30, false), &[]).unwrap();
    let cap = e.reassembly_capacity();
    assert!(
        (4096..=REASSEMBLY_RESERVE).contains(&cap),
        "reserved {cap} B"
    );
}

#[test]
fn held_returns_stop_the_peer_until_released() {
    // §4.5: while returns are held, nothing goes back to the peer, however
    // much is owed; releasing them returns everything in one header.
    let (mut e, mut m, p) = receiver();
    e.set_hold_returns(true);
    for i in 0..p.slots {
        let mut h = Header::new(Kind::Eager);
        h.len = 1;
        inject(&mut e, &mut m, i, 0, h, &[9]).unwrap();
    }
    e.progress(&mut m).unwrap();
    assert!(
        !e.take_actions()
            .iter()
            .any(|a| matches!(a, Action::PostSend { .. })),
        "no credit message while held"
    );
    // A message we send anyway carries no returns.
    e.submit(Bytes::from_static(b"hi"));
    e.progress(&mut m).unwrap();
    let sent: Vec<_> = e.take_actions();
    let Some(Action::PostSend { slot, .. }) =
        sent.iter().find(|a| matches!(a, Action::PostSend { .. }))
    else {
        panic!("the data message goes out: {sent:?}")
    };
    let off = *slot as usize * m.slot;
    let h = Header::decode(&m.send[off..off + HDR_LEN]).unwrap();
    assert_eq!((h.credit_return, h.rdv_return), (0, 0));
    // The peer is out of credits: one more SEND would be a violation.
    let r = inject(&mut e, &mut m, 0, 1, Header::new(Kind::Credit), &[]);
    assert_eq!(
        violation(r),
        PeerMisbehaved::SendWithoutCredit {
            excess: 1,
            granted: p.slots
        }
    );
    // Released: a CREDIT message returns all 8.
    let (mut e, mut m, p) = receiver();
    e.set_hold_returns(true);
    for i in 0..p.slots {
        inject(&mut e, &mut m, i, 0, Header::new(Kind::Credit), &[]).unwrap();
    }
    e.progress(&mut m).unwrap();
    assert!(e.holding_returns());
    assert!(!e
        .take_actions()
        .iter()
        .any(|a| matches!(a, Action::PostSend { .. })));
    e.set_hold_returns(false);
    e.progress(&mut m).unwrap();
    let sent = e.take_actions();
    let Some(Action::PostSend { slot, .. }) =
        sent.iter().find(|a| matches!(a, Action::PostSend { .. }))
    else {
        panic!("a credit message once released: {sent:?}")
    };
    let off = *slot as usize * m.slot;
    let h = Header::decode(&m.send[off..off + HDR_LEN]).unwrap();
    assert_eq!(h.credit_return as u32, p.slots);
}

#[test]
fn keepalive_is_a_zero_length_write_that_uses_no_credit() {
    let (mut e, mut m, _) = receiver();
    let _initial_receives = e.take_actions();
    let credits = e.credits();
    e.keepalive();
    e.progress(&mut m).unwrap();
    let a = e.take_actions();
    assert!(
        matches!(
            a.as_slice(),
            [Action::PostWrite {
                len: 0,
                remote_addr: RDV_BASE,
                ..
            }]
        ),
        "{a:?}"
    );
    assert_eq!(e.credits(), credits, "a keepalive uses no credit");
    e.progress(&mut m).unwrap();
    assert!(e.take_actions().is_empty(), "one keepalive per request");
}

/// §4.4 with memory on demand: holding no region of the peer's, the
/// keepalive is a zero-length WRITE to address and rkey 0 where the device
/// takes it (IB/RoCE, C9-88: no credit, invisible to the peer), else
/// (iWARP) a CREDIT message, which uses a credit.
#[test]
fn keepalive_without_a_peer_region() {
    for zero_write in [true, false] {
        let mut p = P::on_demand();
        p.zero_write = zero_write;
        let mut e = p.engine(&p);
        let mut m = p.mem();
        let _initial_receives = e.take_actions();
        assert_eq!(e.peer_region(), None);
        let credits = e.credits();
        e.keepalive();
        e.progress(&mut m).unwrap();
        let a = e.take_actions();
        if zero_write {
            assert!(
                matches!(
                    a.as_slice(),
                    [Action::PostWrite {
                        len: 0,
                        remote_addr: 0,
                        rkey: 0,
                        ..
                    }]
                ),
                "{a:?}"
            );
            assert_eq!(e.credits(), credits, "no credit used");
        } else {
            assert!(matches!(a.as_slice(), [Action::PostSend { .. }]), "{a:?}");
            let h = Header::decode(&m.send).unwrap();
            assert_eq!(h.kind, Kind::Credit);
            assert_eq!(e.credits(), credits - 1);
        }
        e.progress(&mut m).unwrap();
        assert!(e.take_actions().is_empty(), "one keepalive per request");
    }
}

#[test]
fn an_engine_refuses_a_peer_region_that_wraps_the_address_space() {
    // With rdv_addr near 2^64 the address of the peer's
    // buffer i (rdv_addr + i * rdv_bytes) overflowed when the engine sent a
    // rendezvous chunk. The engine now validates the whole peer hello.
    let p = P::small();
    let mut peer = p.hello();
    peer.rdv_addr = u64::MAX - 4096;
    let cfg = EngineConfig {
        peer,
        ..p.engine(&p).config().clone()
    };
    assert_eq!(
        Engine::new(cfg).err(),
        Some(EngineError::Protocol(PeerMisbehaved::HelloRegionOverflow {
            addr: u64::MAX - 4096,
            count: p.rdv_count,
            bytes: p.rdv_bytes as u32
        }))
    );
}

#[test]
fn failed_completion_is_error() {
    let (mut e, mut m, _) = receiver();
    let r = e.on_completion(
        Completion {
            wr_id: recv_wr_id(0, 0),
            ok: false,
            status: 5,
            byte_len: 0,
            imm: Imm::None,
        },
        &mut m,
    );
    assert_eq!(
        r,
        Err(EngineError::Completion {
            status: 5,
            recv: true
        })
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    #[test]
    fn random_pairs_exchange_without_loss(
        seed in any::<u64>(),
        a_msgs in proptest::collection::vec(prop_oneof![0usize..220, 0usize..20_000], 0..60),
        b_msgs in proptest::collection::vec(prop_oneof![0usize..220, 0usize..20_000], 0..60),
        slots in 4u32..12,
        signal_every in 1u32..4,
        rdv_count in 1u32..4,
        threshold in 0usize..224,
    ) {
        let mut pa = P::small();
        pa.slots = slots;
        pa.signal_every = signal_every;
        pa.rdv_count = rdv_count;
        pa.threshold = threshold;
        let mut pb = P::small();
        pb.rdv_count = 4 - rdv_count.min(3);
        pb.slot = 320;
        // §5.4: immediates only when both offer them; any mix must work.
        pa.imm = seed & 2 != 0;
        pb.imm = seed & 4 != 0;
        // §4.6, §5.5: memory on demand on either side, or both, with
        // idle ticks at random moments.
        pa.on_demand = seed & 8 != 0;
        pa.initial = 4;
        pb.on_demand = seed & 16 != 0;
        pb.initial = 4 + (seed >> 5) as u32 % 4;
        // §5.1: zero-copy send on either side.
        pa.zero_copy = if seed & 512 != 0 { 3000 } else { 0 };
        pb.zero_copy = if seed & 1024 != 0 { 1 } else { 0 };
        // §5.6: messages read by the receiver where both offer it (any
        // mix of offers; without zero-copy send nothing is announced).
        pa.read = seed & 2048 != 0;
        pb.read = seed & 4096 != 0;
        pa.late_reads = seed & 8192 != 0;
        pb.late_reads = seed & 16384 != 0;
        pa.refuse_dests = seed & 32768 != 0;
        pb.refuse_dests = seed & 65536 != 0;
        run_pair(pa, pb, &a_msgs, &b_msgs, seed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Everything submitted arrives while both sides stay open. CLOSE
    /// signals every work request (§6), which releases a send ring stuck
    /// behind unsignalled SENDs, so `random_pairs_exchange_without_loss`
    /// (which closes after its last message) cannot see such a stall; here
    /// nothing closes, and `signal_every` ranges past the rings in use
    /// (the stall of `a_small_send_ring_frees_slots_for_a_grant`). Idle
    /// ticks (regions revoked under traffic, §5.5, and with `seed & 2`
    /// grown rings revoked too, §4.7) and receive back-pressure (§4.5,
    /// released before the end) come at random moments.
    #[test]
    fn random_pairs_deliver_everything_before_any_close(
        seed in any::<u64>(),
        a_msgs in proptest::collection::vec(prop_oneof![0usize..220, 0usize..20_000], 1..40),
        b_msgs in proptest::collection::vec(prop_oneof![0usize..220, 0usize..20_000], 0..40),
        signal_every in 1u32..24,
        initial in 4u32..9,
        rdv_count in 1u32..9,
    ) {
        let p = P {
            slots: 32,
            initial,
            rdv_count,
            signal_every,
            imm: seed & 1 != 0,
            // §4.7: idle ticks also revoke grown rings, as with a shared
            // receive queue (both sides at once: each is both roles).
            revoke: seed & 2 != 0,
            // §5.1: the larger bodies written from where they are.
            zero_copy: if seed & 4 != 0 { 5000 } else { 0 },
            // §5.6: and with reading on, read by the receiver instead.
            read: seed & 8 != 0,
            late_reads: seed & 16 != 0,
            refuse_dests: seed & 32 != 0,
            ..P::on_demand()
        };
        let mut a = Side::new(&p, &p);
        let mut b = Side::new(&p, &p);
        let mut rng = Rng(seed | 1);
        let (mut ia, mut ib) = (0, 0);
        let mut quiet = 0;
        let mut idle_events = true;
        for _ in 0..2_000_000 {
            if ia < a_msgs.len() && a.e.pending_msgs() < 2 && rng.next().is_multiple_of(3) {
                a.e.submit(pattern(ia as u64, a_msgs[ia]));
                ia += 1;
            }
            if ib < b_msgs.len() && b.e.pending_msgs() < 2 && rng.next().is_multiple_of(3) {
                b.e.submit(pattern(1_000_000 + ib as u64, b_msgs[ib]));
                ib += 1;
            }
            let moved = match rng.next() % 11 {
                0..=2 => deliver(&mut a, &mut b),
                3..=5 => deliver(&mut b, &mut a),
                6..=7 => { a.process(rng.next() as usize % 8 + 1); false }
                8..=9 => { b.process(rng.next() as usize % 8 + 1); false }
                // Memory on demand gives back what went unused (§5.5), and
                // the application falls behind for a while (§4.5), at any
                // moment of the traffic.
                _ => {
                    let s = if rng.next().is_multiple_of(2) { &mut a } else { &mut b };
                    match rng.next() % 3 {
                        0 => s.e.on_idle_tick(&mut s.mem),
                        1 if idle_events => s.e.set_hold_returns(true),
                        _ => s.e.set_hold_returns(false),
                    }
                    false
                }
            };
            let idle = !moved && a.cq.is_empty() && b.cq.is_empty()
                && a.wire.is_empty() && b.wire.is_empty();
            quiet = if idle { quiet + 1 } else { 0 };
            if ia == a_msgs.len() && ib == b_msgs.len() && quiet > 64 {
                if idle_events {
                    // The application catches up: returns flow again.
                    idle_events = false;
                    a.e.set_hold_returns(false);
                    b.e.set_hold_returns(false);
                    quiet = 0;
                    continue;
                }
                break;
            }
        }
        prop_assert_eq!(b.got.len(), a_msgs.len(), "a->b delivered before close");
        prop_assert_eq!(a.got.len(), b_msgs.len(), "b->a delivered before close");
        for (i, m) in b.got.iter().enumerate() {
            prop_assert_eq!(m, &pattern(i as u64, a_msgs[i]));
        }
    }
}

// ---- memory on demand (§4.6, §5.5) ----

/// Large messages find no region, ask for one (RDV_REQUEST), get it
/// (RDV_GRANT) and flow; idle ticks revoke and release it, and the next
/// large message asks again. The receive ring grows under a burst.
#[test]
fn on_demand_region_is_granted_revoked_and_granted_again() {
    let pa = P::on_demand();
    let pb = P::on_demand();
    let mut a = Side::new(&pa, &pb);
    let mut b = Side::new(&pb, &pa);
    assert_eq!(a.posted.len(), 4, "the ring starts at the initial size");
    assert!(
        !b.mem.rdv_open && !a.mem.staging_open,
        "nothing registered for rendezvous yet"
    );
    let pump = |a: &mut Side, b: &mut Side| {
        for _ in 0..10_000 {
            a.process(64);
            b.process(64);
            let moved = deliver(a, b) | deliver(b, a);
            check_credit_invariant(a, b);
            check_credit_invariant(b, a);
            if !moved && a.cq.is_empty() && b.cq.is_empty() {
                return;
            }
        }
        panic!("no quiescence");
    };
    for round in 0..3u64 {
        for i in 0..6u64 {
            a.e.submit(pattern(round * 10 + i, 9_000 + i as usize));
        }
        pump(&mut a, &mut b);
        assert_eq!(b.got.len() as u64, (round + 1) * 6);
        assert!(b.mem.rdv_open && a.mem.staging_open);
        assert_eq!(b.mem.rdv_opens, round as u32 + 1, "one grant per round");
        // Idle: the first tick marks the region unused since, the second
        // revokes it; the peer releases it and it is deregistered.
        for _ in 0..2 {
            a.e.on_idle_tick(&mut a.mem);
            b.e.on_idle_tick(&mut b.mem);
            pump(&mut a, &mut b);
        }
        assert!(!b.mem.rdv_open, "region released after an idle interval");
        assert!(
            !a.mem.staging_open,
            "staging released after an idle interval"
        );
        assert_eq!(b.mem.rdv_closes, round as u32 + 1);
        assert_eq!(a.e.peer_rdv, PeerRdv::Absent);
        assert_eq!(b.e.local_rdv, LocalRdv::Absent);
    }
    for (i, m) in b.got.iter().enumerate() {
        let (round, k) = (i as u64 / 6, i as u64 % 6);
        assert_eq!(m, &pattern(round * 10 + k, 9_000 + k as usize));
    }
    // A burst of small messages grows b's ring (and a's send ring).
    for i in 0..40u64 {
        a.e.submit(pattern(100 + i, 50));
        if i % 8 == 7 {
            a.process(64);
            for _ in 0..8 {
                deliver(&mut a, &mut b);
            }
            // b processes without answering in between: credits run low.
            for _ in 0..8 {
                if let Some(c) = b.cq.pop_front() {
                    b.e.on_completion(c, &mut b.mem).unwrap();
                }
            }
            b.e.progress(&mut b.mem).unwrap();
            b.run_actions();
        }
    }
    pump(&mut a, &mut b);
    assert_eq!(b.got.len(), 18 + 40);
    assert!(b.e.recv_active > 4, "the ring grew: {}", b.e.recv_active);
    assert_eq!(a.e.credit_limit, b.e.recv_active, "the grant reached a");
    assert_eq!(b.posted.len() as u32, b.e.recv_active);
}

/// §4.6: CREDIT messages do not grow the receive ring. The setup's first
/// CREDIT and its answer (§2.3), then calls one message each way (a unary
/// call's request and reply), leave both 4-slot rings at 4: before, the
/// answer still owed when the first reply arrived doubled the ring of every
/// connection that carried one call. Data sent without answers still grows
/// it.
#[test]
fn credit_messages_alone_do_not_grow_the_ring() {
    let (mut a, mut b) = connect(&P::on_demand());
    // a's CREDIT and its first message (rpc-core's HELLO) go out together;
    // b reads both before answering: 2 of its 4 credits used.
    a.e.submit(pattern(500, 30));
    a.process(64);
    assert!(deliver(&mut a, &mut b), "a's first CREDIT");
    assert!(deliver(&mut a, &mut b), "a's first message");
    b.process(64);
    // b's answer and its own first message reach a the same way.
    b.e.submit(pattern(501, 30));
    b.process(64);
    assert!(deliver(&mut b, &mut a), "b's answer");
    assert!(deliver(&mut b, &mut a), "b's first message");
    a.process(64);
    assert_eq!(a.e.recv_active, 4, "a's ring stayed at 4 through setup");
    assert_eq!(b.e.recv_active, 4, "b's ring stayed at 4 through setup");
    for i in 0..20u64 {
        a.e.submit(pattern(i, 50));
        a.process(64);
        assert!(deliver(&mut a, &mut b), "request {i}");
        b.process(64);
        b.e.submit(pattern(1000 + i, 1));
        b.process(64);
        assert!(deliver(&mut b, &mut a), "reply {i}");
        a.process(64);
    }
    pump(&mut a, &mut b);
    assert_eq!(b.got.len(), 21);
    assert_eq!(a.got.len(), 21);
    assert_eq!(a.e.recv_active, 4, "a's ring stayed at 4");
    assert_eq!(b.e.recv_active, 4, "b's ring stayed at 4");
    // Two requests before a reply: half the ring used by data, it grows.
    for i in 0..2u64 {
        a.e.submit(pattern(100 + i, 50));
        a.process(64);
        assert!(deliver(&mut a, &mut b));
    }
    b.process(64);
    pump(&mut a, &mut b);
    assert_eq!(b.e.recv_active, 8, "data grew b's ring");
    assert_eq!(a.e.credit_limit, 8, "and the grant reached a");
}

/// §4.3: a CREDIT message and a data message owed together do not make a
/// 4-slot ring return them with a CREDIT of its own. With "all owed ≥ half
/// the ring" as the trigger, a ping-pong where each side reads the peer's
/// CREDIT and its data before answering kept itself going: every call cost
/// a CREDIT each way (seen under callgrind, where timing starts it; nothing
/// ends it once the rings stay at 4 slots).
#[test]
fn a_credit_and_data_owed_together_do_not_echo_credits() {
    let (mut a, mut b) = connect(&P::on_demand());
    let all = |from: &mut Side, to: &mut Side| while deliver(from, to) {};
    let mut before = (0, 0);
    for i in 0..40u64 {
        if i == 10 {
            // Setup (the answer to the first CREDIT) is behind us.
            before = (a.e.counters.credit_msgs, b.e.counters.credit_msgs);
        }
        // Each side reads everything the peer sent, then answers.
        a.e.submit(pattern(i, 50));
        a.process(64);
        all(&mut a, &mut b);
        b.process(64);
        b.e.submit(pattern(1000 + i, 1));
        b.process(64);
        all(&mut b, &mut a);
        a.process(64);
    }
    assert_eq!(b.got.len(), 40);
    assert_eq!(a.got.len(), 40);
    let extra = (
        a.e.counters.credit_msgs - before.0,
        b.e.counters.credit_msgs - before.1,
    );
    assert_eq!(extra, (0, 0), "CREDIT messages in 30 steady calls (a, b)");
    assert_eq!((a.e.recv_active, b.e.recv_active), (4, 4));
}

/// §5.5 checks: each on-demand message is refused where the protocol does
/// not allow it.
#[test]
fn on_demand_messages_out_of_turn_are_violations() {
    let on = P::on_demand();
    let stat = P::small();
    let req = Header::new(Kind::RdvRequest);
    let mut grant = Header::new(Kind::RdvGrant);
    grant.addr = RDV_BASE;
    grant.len = 0x77;
    let revoke = Header::new(Kind::RdvRevoke);
    let release = Header::new(Kind::RdvRelease);
    let unexpected = |r| {
        assert!(
            matches!(violation(r), PeerMisbehaved::OnDemandUnexpected { .. }),
            "expected OnDemandUnexpected"
        )
    };
    // A static region (our hello advertised it): no request, no release.
    let mut e = stat.engine(&on);
    let mut m = stat.mem();
    unexpected(inject(&mut e, &mut m, 0, 0, req, &[]));
    let mut e = stat.engine(&on);
    unexpected(inject(&mut e, &mut m, 0, 0, release, &[]));
    // A grant or revoke we did not ask for, from a peer with a static region.
    let mut e = on.engine(&stat);
    let mut m = on.mem();
    unexpected(inject(&mut e, &mut m, 0, 0, grant, &[]));
    let mut e = on.engine(&stat);
    unexpected(inject(&mut e, &mut m, 0, 0, revoke, &[]));
    // On demand both ways: a grant without a request, a release without a
    // revoke, a second request while the region is granted.
    let mut e = on.engine(&on);
    let mut m = on.mem();
    unexpected(inject(&mut e, &mut m, 0, 0, grant, &[]));
    let mut e = on.engine(&on);
    unexpected(inject(&mut e, &mut m, 0, 0, release, &[]));
    let mut e = on.engine(&on);
    let mut m = on.mem();
    inject(&mut e, &mut m, 0, 0, req, &[]).unwrap();
    e.progress(&mut m).unwrap();
    assert!(m.rdv_open, "granted");
    unexpected(inject(&mut e, &mut m, 1, 0, req, &[]));
    // A chunk into a region that was never granted.
    let mut e = on.engine(&on);
    let mut m = on.mem();
    assert!(matches!(
        violation(inject(&mut e, &mut m, 0, 0, chunk(0, 100, 100, true), &[])),
        PeerMisbehaved::ChunkBufferNotGranted { .. }
    ));
    // Rendezvous returns while we hold no region of the peer's.
    let mut e = on.engine(&on);
    let mut h = Header::new(Kind::Credit);
    h.rdv_return = 1;
    assert!(matches!(
        violation(inject(&mut e, &mut m, 0, 0, h, &[])),
        PeerMisbehaved::TooManyRendezvousReturns { .. }
    ));
    // A granted region that wraps the address space.
    let mut e = on.engine(&on);
    e.submit(pattern(1, 9_000));
    e.progress(&mut m).unwrap();
    assert_eq!(e.peer_rdv, PeerRdv::Requested);
    let mut g = grant;
    g.addr = u64::MAX - 100;
    assert!(matches!(
        violation(inject(&mut e, &mut m, 0, 0, g, &[])),
        PeerMisbehaved::GrantRegionOverflow { .. }
    ));
    // Credit grants: only in a CREDIT, only from an on-demand peer, only up.
    let mut h = Header::new(Kind::Credit);
    h.flags = wire::FLAG_GRANT;
    h.total_len = 6;
    let mut e = stat.engine(&stat);
    let mut m = stat.mem();
    unexpected(inject(&mut e, &mut m, 0, 0, h, &[]));
    let mut e = on.engine(&on);
    let mut m = on.mem();
    let mut eager = Header::new(Kind::Eager);
    eager.flags = wire::FLAG_GRANT;
    eager.total_len = 6;
    unexpected(inject(&mut e, &mut m, 0, 0, eager, &[]));
    for bad in [4u64, 3, 4097] {
        let mut e = on.engine(&on);
        let mut g = h;
        g.total_len = bad;
        assert!(matches!(
            violation(inject(&mut e, &mut m, 0, 0, g, &[])),
            PeerMisbehaved::CreditGrantRange { .. }
        ));
    }
    let mut e = on.engine(&on);
    inject(&mut e, &mut m, 0, 0, h, &[]).unwrap();
    assert_eq!(
        (e.credits(), e.credit_limit),
        (6, 6),
        "a valid grant adds credits"
    );
    // Unreturned credits count against the granted limit, not the hello's
    // (SendHalf::try_send_parts posts at once only while nearly all are
    // back: counted against the hello's 4, 5 unreturned of 6 read as 0,
    // and every frame went out on its own, unbatched).
    assert_eq!(e.unreturned_credits(), 0);
    e.submit(pattern(1, 10));
    e.progress(&mut m).unwrap();
    assert_eq!((e.credits(), e.unreturned_credits()), (5, 1));
}

/// Registering fails at the cap: a request cannot be granted, which ends
/// the connection with a resource error (not a protocol one); a ring that
/// cannot grow stays as it is.
#[test]
fn on_demand_registration_failures() {
    let on = P::on_demand();
    let mut e = on.engine(&on);
    let mut m = on.mem();
    m.refuse = true;
    inject(&mut e, &mut m, 0, 0, Header::new(Kind::RdvRequest), &[]).unwrap();
    assert!(matches!(e.progress(&mut m), Err(EngineError::Resource(_))));
    let mut e = on.engine(&on);
    e.submit(pattern(1, 9_000));
    e.progress(&mut m).unwrap();
    let mut g = Header::new(Kind::RdvGrant);
    g.addr = RDV_BASE;
    g.len = 0x77;
    inject(&mut e, &mut m, 0, 0, g, &[]).unwrap();
    assert!(
        matches!(e.progress(&mut m), Err(EngineError::Resource(_))),
        "staging refused"
    );
    let mut e = on.engine(&on);
    e.grant_due = true;
    e.progress(&mut m).unwrap();
    assert_eq!(
        (e.recv_active, e.recv_max),
        (4, 4),
        "no growth past the cap"
    );
}

/// §2.3 step 6: P sends nothing before A's first message, then answers it at
/// once with a CREDIT message even though nothing else is due; A's engine
/// notes it heard from P (which ends its setup kicks, `conn.rs`).
#[test]
fn the_passive_side_answers_the_first_message_at_once() {
    let (mut a, mut b) = connect(&P::small());
    b.process(0);
    assert!(b.wire.is_empty(), "P sent before A's first message");
    a.process(0);
    assert!(!a.e.heard_from_peer());
    assert!(deliver(&mut a, &mut b), "A's first message");
    b.process(8);
    let answers: Vec<Kind> = b
        .wire
        .iter()
        .map(|o| match o {
            Op::Send { slot, .. } => {
                let at = *slot as usize * b.mem.slot;
                Header::decode(&b.mem.send[at..at + HDR_LEN]).unwrap().kind
            }
            Op::Write { .. }
            | Op::Bind { .. }
            | Op::BindDest { .. }
            | Op::Read { .. }
            | Op::ReadStaging { .. } => {
                panic!("P wrote before answering")
            }
        })
        .collect();
    assert_eq!(answers, [Kind::Credit], "P's answer to A's first message");
    assert!(deliver(&mut b, &mut a));
    a.process(8);
    assert!(a.e.heard_from_peer());
    // The answer is a one-off: nothing more goes out on either side.
    b.process(8);
    assert!(a.wire.is_empty() && b.wire.is_empty());
}

// ---- gather sends, batched returns and immediate-data chunks (§5.3, §5.4) ----

/// §5.4: with both sides offering immediates, every chunk is one WRITE with
/// immediate data (no notification SEND), the bytes arrive intact (gather
/// sends included) and the credit accounting still balances (`run_pair`).
#[test]
fn write_with_imm_replaces_the_chunk_send() {
    let mut p = P::small();
    p.imm = true;
    let msgs = vec![5, 4097, 3 * 4096, 3 * 4096 + 1, 20_000, 100];
    let (a, b) = run_pair(p, p, &msgs, &msgs, 9);
    let chunks = 2 + 3 + 4 + 5;
    assert_eq!(a.e.counters.rdv_writes, chunks);
    assert!(a.e.config().write_imm && b.e.config().write_imm);
    // Without immediates the same traffic needs a SEND per chunk on top.
    let mut q = P::small();
    q.imm = false;
    let (c, _) = run_pair(q, q, &msgs, &msgs, 9);
    assert_eq!(c.e.counters.rdv_writes, chunks);
    assert!(!c.e.config().write_imm);
    // Only one side offering: no immediates either way (§2.1).
    let (d, e) = run_pair(p, q, &msgs, &msgs, 9);
    assert!(!d.e.config().write_imm && !e.e.config().write_imm);
}

/// §5.3: while a long message arrives, buffers go back in batches of half
/// the region, not one CREDIT message per chunk.
#[test]
fn rendezvous_returns_are_batched() {
    let mut p = P::small();
    p.rdv_count = 8;
    for imm in [false, true] {
        p.imm = imm;
        let total = 64 * 4096;
        let (_, b) = run_pair(p, p, &[total], &[], 21);
        let credit_msgs = b.e.counters.credit_msgs;
        assert!(
            credit_msgs <= 64 / 4 + 4,
            "imm={imm}: {credit_msgs} credit messages for 64 chunks"
        );
    }
}

/// A gather's head and body land in order across chunk boundaries.
#[test]
fn gather_parts_cross_chunk_boundaries() {
    let p = P::small();
    let mut a = Side::new(&p, &p);
    let mut b = Side::new(&p, &p);
    let whole = pattern(77, 3 * 4096 + 10);
    for cut in [0, 6, 4095, 4096, 4097, whole.len()] {
        let mut body = whole.clone();
        let head = body.split_to(cut);
        a.e.submit_parts(head, body);
    }
    let mut guard = 0;
    while b.got.len() < 6 {
        guard += 1;
        assert!(guard < 10_000);
        a.process(64);
        while deliver(&mut a, &mut b) {}
        b.process(64);
        while deliver(&mut b, &mut a) {}
    }
    for m in &b.got {
        assert_eq!(m, &whole);
    }
}

/// A receiver of chunks notified one by one by immediates (§5.4, without
/// covering notifications).
fn imm_receiver() -> (Engine, Mem, P) {
    let mut p = P::small();
    p.imm = true;
    p.covers = false;
    let e = p.engine(&p);
    (e, p.mem(), p)
}

/// A receiver of covering notifications (§5.4): 3 buffers of 4096 bytes.
fn covering_receiver() -> (Engine, Mem, P) {
    let mut p = P::small();
    p.imm = true;
    let e = p.engine(&p);
    assert!(e.config().covers);
    (e, p.mem(), p)
}

fn inject_imm(
    e: &mut Engine,
    mem: &mut Mem,
    slot: u32,
    imm: Imm,
    len: u32,
) -> Result<(), EngineError> {
    e.on_completion(
        Completion {
            wr_id: recv_wr_id(slot, 0),
            ok: true,
            status: 0,
            byte_len: len,
            imm,
        },
        mem,
    )
}

/// Forged immediates (§5.4): each closes the connection with its own
/// violation and never reads outside the region.
#[test]
fn forged_immediates_rejected() {
    use wire::chunk_imm;
    use PeerMisbehaved as V;
    // Not negotiated (our hello did not offer it).
    let (mut e, mut m, _) = receiver();
    let imm = chunk_imm(0, 0, true);
    assert_eq!(
        violation(inject_imm(&mut e, &mut m, 0, Imm::Write(imm), 10)),
        V::ImmediateNotOffered { imm }
    );
    // A SEND with immediate data.
    let (mut e, mut m, _) = imm_receiver();
    assert_eq!(
        violation(inject_imm(&mut e, &mut m, 0, Imm::Send(7), 32)),
        V::ImmediateOnSend { imm: 7 }
    );
    // An index outside the region, and one not next in round-robin order.
    let (mut e, mut m, _) = imm_receiver();
    assert_eq!(
        violation(inject_imm(
            &mut e,
            &mut m,
            0,
            Imm::Write(chunk_imm(3, 0, true)),
            10
        )),
        V::ChunkUnknownBuffer { index: 3, count: 3 }
    );
    let (mut e, mut m, _) = imm_receiver();
    assert_eq!(
        violation(inject_imm(
            &mut e,
            &mut m,
            0,
            Imm::Write(chunk_imm(1, 0, true)),
            10
        )),
        V::ChunkBufferNotGranted {
            index: 1,
            expected: 0,
            held: 3
        }
    );
    // Zero bytes, or more than a buffer (a WRITE can place more than a slot).
    for len in [0, 4097] {
        let (mut e, mut m, _) = imm_receiver();
        assert_eq!(
            violation(inject_imm(
                &mut e,
                &mut m,
                0,
                Imm::Write(chunk_imm(0, 0, true)),
                len
            )),
            V::ChunkLength { len, max: 4096 }
        );
    }
    // LAST disagreeing with "chunks that follow".
    let (mut e, mut m, _) = imm_receiver();
    let bad = chunk_imm(0, 0, false);
    assert_eq!(
        violation(inject_imm(&mut e, &mut m, 0, Imm::Write(bad), 10)),
        V::ImmediateMalformed { imm: bad }
    );
    // A buffer claimed again before we returned it (all 3 consumed).
    let (mut e, mut m, _) = imm_receiver();
    for i in 0..3u32 {
        inject_imm(&mut e, &mut m, i, Imm::Write(chunk_imm(i, 5, false)), 4096).unwrap();
    }
    assert_eq!(
        violation(inject_imm(
            &mut e,
            &mut m,
            3,
            Imm::Write(chunk_imm(0, 4, false)),
            4096
        )),
        V::ChunkBufferNotGranted {
            index: 0,
            expected: 0,
            held: 0
        }
    );
    // Mixing notification kinds inside one message, both ways.
    let (mut e, mut m, _) = imm_receiver();
    inject_imm(&mut e, &mut m, 0, Imm::Write(chunk_imm(0, 1, false)), 4096).unwrap();
    assert_eq!(
        violation(inject(&mut e, &mut m, 1, 0, chunk(1, 10, 4106, true), &[])),
        V::ChunkNotificationMixed
    );
    let (mut e, mut m, _) = imm_receiver();
    inject(&mut e, &mut m, 0, 0, chunk(0, 4096, 4106, false), &[]).unwrap();
    assert_eq!(
        violation(inject_imm(
            &mut e,
            &mut m,
            1,
            Imm::Write(chunk_imm(1, 0, true)),
            10
        )),
        V::ChunkNotificationMixed
    );
    // An EAGER inside an immediate-notified message.
    let (mut e, mut m, _) = imm_receiver();
    inject_imm(&mut e, &mut m, 0, Imm::Write(chunk_imm(0, 1, false)), 4096).unwrap();
    let mut h = Header::new(Kind::Eager);
    h.len = 1;
    assert_eq!(
        violation(inject(&mut e, &mut m, 1, 0, h, &[1])),
        V::EagerInsideRendezvous
    );
    // A hint of 0x7fff chunks to follow reserves at most REASSEMBLY_RESERVE.
    let (mut e, mut m, _) = imm_receiver();
    inject_imm(
        &mut e,
        &mut m,
        0,
        Imm::Write(chunk_imm(0, 1 << 20, false)),
        4096,
    )
    .unwrap();
    assert!(e.reassembly_capacity() <= REASSEMBLY_RESERVE);
    // A valid immediate chunk delivers the bytes of the buffer it names.
    let (mut e, mut m, _) = imm_receiver();
    m.rdv[..3].copy_from_slice(b"abc");
    inject_imm(&mut e, &mut m, 0, Imm::Write(chunk_imm(0, 0, true)), 3).unwrap();
    assert!(matches!(e.next_event(), Some(Event::Message(b)) if &b[..] == b"abc"));
}

/// §5.4 "Covering notifications": forged covering immediates each close
/// the connection with their own violation before any buffer is read; a
/// valid one delivers the covered buffers' full chunks and its own bytes.
#[test]
fn forged_covering_immediates_rejected() {
    use wire::chunk_imm;
    use PeerMisbehaved as V;
    // Covering more buffers than the peer holds grants for (3).
    let (mut e, mut m, _) = covering_receiver();
    assert_eq!(
        violation(inject_imm(
            &mut e,
            &mut m,
            0,
            Imm::Write(chunk_imm(0, 3, true)),
            10
        )),
        V::CoverExceedsGrants { chunks: 4, held: 3 }
    );
    // Not the buffer right after the covered ones.
    let (mut e, mut m, _) = covering_receiver();
    assert_eq!(
        violation(inject_imm(
            &mut e,
            &mut m,
            0,
            Imm::Write(chunk_imm(2, 1, true)),
            10
        )),
        V::ChunkBufferNotGranted {
            index: 2,
            expected: 1,
            held: 3
        }
    );
    // Outside the region.
    let (mut e, mut m, _) = covering_receiver();
    assert_eq!(
        violation(inject_imm(
            &mut e,
            &mut m,
            0,
            Imm::Write(chunk_imm(3, 0, true)),
            10
        )),
        V::ChunkUnknownBuffer { index: 3, count: 3 }
    );
    // Zero bytes, or more than a buffer.
    for len in [0, 4097] {
        let (mut e, mut m, _) = covering_receiver();
        assert_eq!(
            violation(inject_imm(
                &mut e,
                &mut m,
                0,
                Imm::Write(chunk_imm(1, 1, true)),
                len
            )),
            V::ChunkLength { len, max: 4096 }
        );
    }
    // After two covered buffers were consumed (held 1), covering one more
    // than is held is refused even though the index is in order.
    let (mut e, mut m, _) = covering_receiver();
    inject_imm(&mut e, &mut m, 0, Imm::Write(chunk_imm(1, 1, false)), 4096).unwrap();
    assert_eq!(
        violation(inject_imm(
            &mut e,
            &mut m,
            1,
            Imm::Write(chunk_imm(0, 1, true)),
            10
        )),
        V::CoverExceedsGrants { chunks: 2, held: 1 }
    );
    // A SEND-notified chunk inside a message notified by immediates.
    let (mut e, mut m, _) = covering_receiver();
    inject_imm(&mut e, &mut m, 0, Imm::Write(chunk_imm(1, 1, false)), 4096).unwrap();
    assert_eq!(
        violation(inject(&mut e, &mut m, 1, 0, chunk(2, 10, 8202, true), &[])),
        V::ChunkNotificationMixed
    );
    // Valid: buffers 0 and 1 covered (full chunks), buffer 2 notifies 10
    // bytes and LAST: one message of 4096 + 4096 + 10 bytes, in order.
    let (mut e, mut m, _) = covering_receiver();
    for (i, b) in m.rdv.iter_mut().enumerate() {
        *b = (i / 4096) as u8 + 1;
    }
    inject_imm(&mut e, &mut m, 0, Imm::Write(chunk_imm(2, 2, true)), 10).unwrap();
    match e.next_event() {
        Some(Event::Message(b)) => {
            assert_eq!(b.len(), 2 * 4096 + 10);
            assert!(b[..4096].iter().all(|&x| x == 1));
            assert!(b[4096..8192].iter().all(|&x| x == 2));
            assert!(b[8192..].iter().all(|&x| x == 3));
        }
        other => panic!("expected the message, got {other:?}"),
    }
}

/// §5.4 "Covering notifications" by CHUNK SEND (`covered` in the header):
/// forged ones close the connection before any buffer is read; a valid one
/// delivers the covered full chunks and its own bytes; a receiver that did
/// not offer covering ignores the field, as a reserved one.
#[test]
fn forged_covering_chunk_sends_rejected() {
    use PeerMisbehaved as V;
    let covering = |idx, covered, len, total, last| {
        let mut h = chunk(idx, len, total, last);
        h.covered = covered;
        h
    };
    let (mut e, mut m, _) = receiver();
    assert!(e.config().covers && !e.config().write_imm);
    assert_eq!(
        violation(inject(
            &mut e,
            &mut m,
            0,
            0,
            covering(0, 3, 10, 3 * 4096 + 10, true),
            &[]
        )),
        V::CoverExceedsGrants { chunks: 4, held: 3 }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(
            &mut e,
            &mut m,
            0,
            0,
            covering(2, 1, 10, 4106, true),
            &[]
        )),
        V::ChunkBufferNotGranted {
            index: 2,
            expected: 1,
            held: 3
        }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(
            &mut e,
            &mut m,
            0,
            0,
            covering(1, 1, 10, 100, true),
            &[]
        )),
        V::ChunkOverrun {
            end: 4106,
            total: 100
        }
    );
    let (mut e, mut m, _) = receiver();
    assert_eq!(
        violation(inject(
            &mut e,
            &mut m,
            0,
            0,
            covering(1, 1, 10, 4107, true),
            &[]
        )),
        V::LastFlagWrong {
            last: true,
            end: 4106,
            total: 4107
        }
    );
    // Valid: buffers 0 and 1 covered, buffer 2 holds the last 10 bytes.
    let (mut e, mut m, _) = receiver();
    for (i, b) in m.rdv.iter_mut().enumerate() {
        *b = (i / 4096) as u8 + 1;
    }
    inject(&mut e, &mut m, 0, 0, covering(2, 2, 10, 8202, true), &[]).unwrap();
    match e.next_event() {
        Some(Event::Message(b)) => {
            assert_eq!(b.len(), 8202);
            assert!(b[..4096].iter().all(|&x| x == 1));
            assert!(b[4096..8192].iter().all(|&x| x == 2));
            assert!(b[8192..].iter().all(|&x| x == 3));
        }
        other => panic!("expected the message, got {other:?}"),
    }
    // Not negotiated: the field is reserved and not read.
    let mut q = P::small();
    q.covers = false;
    let mut e = q.engine(&q);
    let mut m = q.mem();
    m.rdv[..10].copy_from_slice(b"0123456789");
    inject(&mut e, &mut m, 0, 0, covering(0, 5, 10, 10, true), &[]).unwrap();
    assert!(matches!(e.next_event(), Some(Event::Message(b)) if &b[..] == b"0123456789"));
}

/// §5.4 "Covering notifications": a message whose chunks fit the peer's
/// grants costs the receiver one notification; a longer one, one per
/// round of grants at most; without covering, one per chunk. Every byte
/// arrives, and random interleavings keep the credit accounting
/// (`run_pair`) with gathers included.
#[test]
fn covering_notifications_one_per_message() {
    let mut p = P::small();
    p.imm = true;
    p.rdv_count = 8;
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    for (id, chunks) in [(1u64, 4usize), (2, 4), (3, 2), (4, 7), (5, 12), (6, 1)] {
        let before = b.imm_notes;
        let writes = a.e.counters.rdv_writes;
        let m = pattern(id, chunks * 4096 - 5);
        a.e.submit(m.clone());
        pump(&mut a, &mut b);
        assert_eq!(b.got.pop(), Some(m), "message {id} intact");
        assert_eq!(a.e.counters.rdv_writes - writes, chunks as u64);
        let notes = b.imm_notes - before;
        // At most half the region (4 of 8 buffers) per notification.
        if chunks <= 4 {
            assert_eq!(
                notes, 1,
                "{chunks} chunks within half the grants: one notification"
            );
        } else {
            assert!(
                (chunks.div_ceil(4) as u64..chunks as u64).contains(&notes),
                "{chunks} chunks: {notes} notifications"
            );
        }
    }
    // The same with CHUNK SENDs (no immediates, as on iWARP).
    let mut s = p;
    s.imm = false;
    let (mut a, mut b) = connect(&s);
    pump(&mut a, &mut b);
    for (id, chunks) in [(7u64, 4usize), (8, 3), (9, 9)] {
        let before = b.chunk_sends;
        let m = pattern(id, chunks * 4096 - 1);
        a.e.submit(m.clone());
        pump(&mut a, &mut b);
        assert_eq!(b.got.pop(), Some(m), "message {id} intact");
        let notes = b.chunk_sends - before;
        if chunks <= 4 {
            assert_eq!(notes, 1, "{chunks} chunks: one CHUNK SEND");
        } else {
            assert!(
                (chunks.div_ceil(4) as u64..chunks as u64).contains(&notes),
                "{chunks} chunks: {notes} CHUNK SENDs"
            );
        }
    }
    // A region of 3 buffers: a notification covers one chunk (half of 3,
    // at least 1), as without covering.
    let mut r = P::small();
    r.imm = true;
    let (a, b) = run_pair(r, r, &[3 * 4096], &[], 1);
    assert_eq!(b.imm_notes, a.e.counters.rdv_writes);
    let msgs = vec![5, 4097, 3 * 4096, 3 * 4096 + 1, 20_000, 40_000, 100];
    for seed in 1..6 {
        let (a, b) = run_pair(p, p, &msgs, &msgs, seed);
        assert!(a.e.config().covers && b.e.config().covers);
        assert!(b.imm_notes < a.e.counters.rdv_writes, "seed {seed}");
    }
    // Per chunk without covering; not negotiated if one side does not offer.
    let mut q = p;
    q.covers = false;
    let (a, b) = run_pair(q, q, &msgs, &msgs, 3);
    assert_eq!(b.imm_notes, a.e.counters.rdv_writes);
    let (c, d) = run_pair(p, q, &msgs, &msgs, 3);
    assert!(!c.e.config().covers && !d.e.config().covers);
    assert_eq!(d.imm_notes, c.e.counters.rdv_writes);
}

/// §7, §4.6: a send ring that starts small still frees slots for a
/// control message. With 4 send slots and `signal_every` 16, three small
/// unsignalled SENDs used to keep three slots until some later signalled
/// completion, and RDV_GRANT (2 free slots, §4.3) then waited for ever:
/// the peer's large message never left (found in the VM with
/// `initial_send_slots = 4`). Nothing closes here, since CLOSE signals
/// everything and would hide the stall.
#[test]
fn a_small_send_ring_frees_slots_for_a_grant() {
    for imm in [false, true] {
        let p = P {
            slots: 64,
            initial: 4,
            rdv_count: 8,
            signal_every: 16,
            imm,
            ..P::on_demand()
        };
        let mut a = Side::new(&p, &p);
        let mut b = Side::new(&p, &p);
        for i in 0..3u64 {
            a.e.submit(pattern(i, 40));
        }
        pump(&mut a, &mut b);
        assert_eq!(b.got.len(), 3);
        // b's large message needs a's region: a must send RDV_GRANT.
        b.e.submit(pattern(9, 20_000));
        pump(&mut a, &mut b);
        assert_eq!(a.got.len(), 1, "imm {imm}: the large message arrived");
        assert_eq!(a.got[0], pattern(9, 20_000));
        assert!(
            a.e.free_send.len() >= 2,
            "imm {imm}: free send slots {}",
            a.e.free_send.len()
        );
    }
}

/// §4.7: `a` on demand, `b` on demand and revoking (as with a shared
/// receive queue), connected and quiet.
fn revoking_pair() -> (Side, Side) {
    let pa = P::on_demand();
    let pb = P {
        revoke: true,
        ..P::on_demand()
    };
    let mut a = Side::new(&pa, &pb);
    let mut b = Side::new(&pb, &pa);
    b.e.set_wait_first_recv();
    a.e.send_initial_credit();
    pump(&mut a, &mut b);
    (a, b)
}

/// §4.6: two data messages from `a` (`seed`, `seed + 1`) before `b`
/// answers: `b`'s ring doubles and the grant reaches `a`.
fn grow_b(a: &mut Side, b: &mut Side, seed: u64) {
    for i in 0..2u64 {
        a.e.submit(pattern(seed + i, 50));
        a.process(64);
        assert!(deliver(a, b));
    }
    b.process(64);
    pump(a, b);
}

/// §4.7: a receive ring that grew and then stayed idle goes back to its
/// initial size: REVOKE, the sender pays its debt from the credits it gets
/// back, RELEASED, the receiver retires the slots above. Messages keep
/// flowing both ways with the credit invariant, and the ring grows again.
#[test]
fn an_idle_grown_ring_is_revoked_and_released() {
    let (mut a, mut b) = revoking_pair();
    // Two data messages before b answers: b's ring grows to 8.
    grow_b(&mut a, &mut b, 0);
    assert_eq!((b.e.recv_active, a.e.credit_limit), (8, 8), "grown");
    assert!(b.e.has_releasable(), "the idle timer runs for it");
    // Not idle yet: messages arrived during this interval.
    b.e.on_idle_tick(&mut b.mem);
    assert_eq!(b.e.revoke, Revoke::None);
    // A whole interval without a message: the revoke goes out.
    b.e.on_idle_tick(&mut b.mem);
    assert_eq!(b.e.revoke, Revoke::Due(4));
    b.process(0);
    assert!(matches!(b.e.revoke, Revoke::Sent(4)));
    assert_eq!(b.e.recv_active, 8, "b keeps its slots until RELEASED");
    assert!(deliver(&mut b, &mut a), "the REVOKE");
    a.process(64);
    assert_eq!(a.e.credit_limit, 4, "a's limit is lowered at once");
    check_credit_invariant(&a, &b);
    pump(&mut a, &mut b);
    assert_eq!(a.e.debt, 0, "a paid its debt");
    assert_eq!(b.e.revoke, Revoke::None, "RELEASED arrived");
    assert_eq!(
        (b.e.recv_active, b.mem.shrinks),
        (4, 1),
        "b's ring is back to 4"
    );
    assert!(b.posted.iter().all(|w| (w & 0xffff_ffff) < 4));
    assert_eq!(b.posted.len(), 4, "4 receives posted");
    assert!(!b.e.has_releasable());
    check_credit_invariant(&a, &b);
    check_credit_invariant(&b, &a);
    // Traffic as before, both ways, with the invariant at every step.
    for i in 0..30u64 {
        a.e.submit(pattern(100 + i, 40 + i as usize));
        b.e.submit(pattern(200 + i, 10));
        a.process(64);
        b.process(64);
        deliver(&mut a, &mut b);
        deliver(&mut b, &mut a);
        check_credit_invariant(&a, &b);
        check_credit_invariant(&b, &a);
    }
    pump(&mut a, &mut b);
    assert_eq!(b.got.len(), 32);
    assert_eq!(a.got.len(), 30);
    for i in 0..30u64 {
        assert!(b.got[2 + i as usize] == pattern(100 + i, 40 + i as usize));
    }
    // And the ring can grow again.
    grow_b(&mut a, &mut b, 300);
    assert_eq!((b.e.recv_active, a.e.credit_limit), (8, 8), "grown again");
}

/// §4.7: the sender of a revoke's answer pays its debt only from credits
/// beyond the one reserved for CREDIT messages, and a revoke that arrives
/// while its credits are in flight is paid as they come back.
#[test]
fn a_revoke_with_credits_in_flight_is_paid_as_they_return() {
    let (mut a, mut b) = revoking_pair();
    grow_b(&mut a, &mut b, 0);
    assert_eq!(a.e.credit_limit, 8);
    b.e.on_idle_tick(&mut b.mem);
    b.e.on_idle_tick(&mut b.mem);
    b.process(0);
    // a sends messages before the REVOKE reaches it; b has not read them:
    // a's credits are used up.
    for i in 0..7u64 {
        a.e.submit(pattern(10 + i, 30));
    }
    for _ in 0..8 {
        a.process(64);
        while deliver(&mut a, &mut b) {}
    }
    assert!(a.e.credits() <= 1, "a used its credits");
    assert!(deliver(&mut b, &mut a), "the REVOKE");
    a.process(64);
    assert!(a.e.debt > 0, "a cannot pay all of it yet");
    assert!(a.e.credits() <= 1, "a keeps only the reserved credit");
    check_credit_invariant(&a, &b);
    pump(&mut a, &mut b);
    assert_eq!((a.e.debt, a.e.credit_limit, b.e.recv_active), (0, 4, 4));
    assert_eq!(b.got.len(), 2 + 7, "every message arrived");
    check_credit_invariant(&a, &b);
}

/// §4.7: revokes and RELEASED out of turn close the connection.
#[test]
fn revokes_out_of_turn_are_violations() {
    let on = P::on_demand();
    let stat = P::small();
    let credit = |flags: u8, total: u64| {
        let mut h = Header::new(Kind::Credit);
        h.flags = flags;
        h.total_len = total;
        h
    };
    // RELEASED we never asked for.
    let mut e = on.engine(&on);
    let mut m = on.mem();
    assert!(matches!(
        violation(inject(
            &mut e,
            &mut m,
            0,
            0,
            credit(wire::FLAG_RELEASED, 4),
            &[]
        )),
        PeerMisbehaved::OnDemandUnexpected { .. }
    ));
    // A revoke from a peer without memory on demand.
    let mut e = on.engine(&stat);
    assert!(matches!(
        violation(inject(
            &mut e,
            &mut m,
            0,
            0,
            credit(wire::FLAG_REVOKE, 4),
            &[]
        )),
        PeerMisbehaved::OnDemandUnexpected { .. }
    ));
    // Below the hello's credits, or not below the current limit.
    let range = |r| matches!(violation(r), PeerMisbehaved::CreditRevokeRange { .. });
    let mut e = on.engine(&on);
    assert!(range(inject(
        &mut e,
        &mut m,
        0,
        0,
        credit(wire::FLAG_REVOKE, 3),
        &[]
    )));
    let mut e = on.engine(&on);
    assert!(range(inject(
        &mut e,
        &mut m,
        0,
        0,
        credit(wire::FLAG_REVOKE, 4),
        &[]
    )));
    // A second revoke while the first is unanswered.
    let mut e = on.engine(&on);
    inject(&mut e, &mut m, 0, 0, credit(wire::FLAG_GRANT, 8), &[]).unwrap();
    inject(&mut e, &mut m, 1, 0, credit(wire::FLAG_REVOKE, 6), &[]).unwrap();
    assert!(range(inject(
        &mut e,
        &mut m,
        2,
        0,
        credit(wire::FLAG_REVOKE, 4),
        &[]
    )));
    // A revoke on a message that is not a CREDIT.
    let mut e = on.engine(&on);
    let mut h = Header::new(Kind::Eager);
    h.flags = wire::FLAG_REVOKE;
    h.total_len = 4;
    assert!(matches!(
        violation(inject(&mut e, &mut m, 0, 0, h, b"x")),
        PeerMisbehaved::OnDemandUnexpected { .. }
    ));
}

// --- time as an input (clock.rs: §2.3 step 6, §4.4, §4.5, §5.5) ---

fn timers(keepalive_ms: u64, idle_ms: u64, kicks: bool) -> TimerConfig {
    TimerConfig {
        keepalive: std::time::Duration::from_millis(keepalive_ms),
        idle_release: std::time::Duration::from_millis(idle_ms),
        setup_kicks: kicks,
        recv_queue_bytes: 1000,
    }
}

fn ms(t0: std::time::Instant, at: Option<std::time::Instant>) -> Option<u128> {
    at.map(|a| a.duration_since(t0).as_millis())
}

#[test]
fn an_engine_without_a_clock_has_no_deadline() {
    let (mut e, mut m, _) = receiver();
    assert_eq!(e.poll_timeout(), None);
    let fired = e.handle_timeout(std::time::Instant::now(), &mut m);
    assert_eq!(fired, Fired::default());
}

#[test]
fn setup_kicks_back_off_and_end_at_one_second() {
    let (mut e, mut m, _) = receiver();
    let _initial_receives = e.take_actions();
    let t0 = std::time::Instant::now();
    e.start_clock(t0, timers(15_000, 0, true));
    let mut kicks = Vec::new();
    while let Some(at) = e.poll_timeout() {
        if at >= t0 + std::time::Duration::from_secs(15) {
            break; // the keepalive's: the kicks are over
        }
        let fired = e.handle_timeout(at, &mut m);
        assert!(fired.setup_kick && !fired.keepalive, "{fired:?}");
        kicks.push(at.duration_since(t0).as_millis());
        e.progress(&mut m).unwrap();
        let a = e.take_actions();
        assert!(
            matches!(a.as_slice(), [Action::PostWrite { len: 0, .. }]),
            "a kick is a zero-length WRITE: {a:?}"
        );
        assert!(kicks.len() <= 8, "{kicks:?}");
    }
    assert_eq!(kicks, [4, 12, 28, 60, 124, 252, 508, 1020]);
    assert_eq!(
        ms(t0, e.poll_timeout()),
        Some(15_000),
        "the keepalive remains"
    );
}

#[test]
fn setup_kicks_stop_once_the_peer_is_heard() {
    let p = P::small();
    let (mut a, mut b) = connect(&p);
    let t0 = std::time::Instant::now();
    a.e.start_clock(t0, timers(0, 0, true));
    assert_eq!(ms(t0, a.e.poll_timeout()), Some(4));
    b.e.submit(pattern(1, 10));
    pump(&mut a, &mut b);
    assert!(a.e.heard_from_peer());
    assert_eq!(a.e.poll_timeout(), None, "heard: no more kicks");
    let fired =
        a.e.handle_timeout(t0 + std::time::Duration::from_millis(4), &mut a.mem);
    assert!(!fired.setup_kick);
}

#[test]
fn a_keepalive_goes_only_after_an_interval_without_posts() {
    let (mut e, mut m, _) = receiver();
    let _initial_receives = e.take_actions();
    let t0 = std::time::Instant::now();
    e.start_clock(t0, timers(100, 0, false));
    assert_eq!(ms(t0, e.poll_timeout()), Some(100));
    // Something was posted in the first interval: no probe.
    e.note_posted();
    let t1 = t0 + std::time::Duration::from_millis(100);
    assert!(!e.handle_timeout(t1, &mut m).keepalive);
    e.progress(&mut m).unwrap();
    assert!(e.take_actions().is_empty());
    assert_eq!(ms(t0, e.poll_timeout()), Some(200));
    // Early: nothing is due yet.
    let early = t0 + std::time::Duration::from_millis(150);
    assert_eq!(e.handle_timeout(early, &mut m), Fired::default());
    // A whole interval without a post: one probe.
    let t2 = t0 + std::time::Duration::from_millis(200);
    assert!(e.handle_timeout(t2, &mut m).keepalive);
    e.progress(&mut m).unwrap();
    let a = e.take_actions();
    assert!(
        matches!(a.as_slice(), [Action::PostWrite { len: 0, .. }]),
        "{a:?}"
    );
    assert_eq!(ms(t0, e.poll_timeout()), Some(300));
}

#[test]
fn the_idle_timer_counts_only_while_something_can_be_given_back() {
    let pa = P::on_demand();
    let pb = P::on_demand();
    let mut a = Side::new(&pa, &pb);
    let mut b = Side::new(&pb, &pa);
    let t0 = std::time::Instant::now();
    a.e.start_clock(t0, timers(0, 100, false));
    b.e.start_clock(t0, timers(0, 100, false));
    assert_eq!(
        a.e.poll_timeout(),
        None,
        "at its initial size a connection is never woken"
    );
    for i in 0..6u64 {
        a.e.submit(pattern(i, 9_000));
    }
    pump(&mut a, &mut b);
    assert!(b.mem.rdv_open && a.mem.staging_open);
    // The deadline that passed while nothing was releasable is due at once.
    assert_eq!(ms(t0, b.e.poll_timeout()), Some(100));
    // Two idle intervals give the region and the staging buffers back.
    for k in 1..=2u64 {
        let now = t0 + std::time::Duration::from_millis(100 * k);
        assert!(a.e.handle_timeout(now, &mut a.mem).idle_release);
        assert!(b.e.handle_timeout(now, &mut b.mem).idle_release);
        pump(&mut a, &mut b);
    }
    assert!(!b.mem.rdv_open && !a.mem.staging_open);
    assert_eq!(a.e.poll_timeout(), None, "nothing left to give back");
    assert_eq!(b.e.poll_timeout(), None);
}

#[test]
fn a_settled_engine_posts_what_a_later_entry_point_gives_it() {
    // `progress` skips its passes once it found nothing to post; the
    // backlog clearing (the driver's `note_backlog`, every step) and a
    // message submitted must both be posted by the next one.
    let (mut e, mut m, p) = receiver();
    e.start_clock(std::time::Instant::now(), timers(0, 0, false));
    let _initial_receives = e.take_actions();
    e.note_backlog(1001, true);
    for i in 0..p.slots {
        inject(&mut e, &mut m, i, 0, Header::new(Kind::Credit), &[]).unwrap();
    }
    let sends = |e: &mut Engine| {
        e.take_actions()
            .iter()
            .filter(|a| matches!(a, Action::PostSend { .. }))
            .count()
    };
    for _ in 0..3 {
        e.progress(&mut m).unwrap();
        assert_eq!(sends(&mut e), 0, "returns held: nothing to post");
    }
    e.note_backlog(1001, true);
    e.progress(&mut m).unwrap();
    assert_eq!(sends(&mut e), 0, "still held");
    e.note_backlog(0, true);
    e.progress(&mut m).unwrap();
    assert_eq!(sends(&mut e), 1, "released: the CREDIT message goes out");
    e.progress(&mut m).unwrap();
    assert_eq!(sends(&mut e), 0);
    e.submit(Bytes::from_static(b"hi"));
    e.progress(&mut m).unwrap();
    assert_eq!(sends(&mut e), 1, "a message submitted to a settled engine");
}

#[test]
fn credit_returns_are_held_while_the_application_is_behind() {
    let (mut e, _m, _) = receiver();
    e.start_clock(std::time::Instant::now(), timers(0, 0, false));
    e.note_backlog(1000, true);
    assert!(!e.holding_returns(), "at the limit");
    e.note_backlog(1001, true);
    assert!(e.holding_returns(), "over the limit");
    e.note_backlog(1001, false);
    assert!(
        !e.holding_returns(),
        "an application that stopped reading holds back nothing"
    );
    e.note_backlog(0, true);
    assert!(!e.holding_returns());
}

/// §5.3 (informative): large messages are reassembled in buffers the
/// receiving thread reuses once a message was dropped; a message the
/// application keeps never changes while later ones are reassembled.
#[test]
fn a_kept_large_message_never_changes_and_a_dropped_ones_buffer_is_reused() {
    // On a thread of its own: the reassembly buffers are the thread's.
    std::thread::spawn(|| {
        for imm in [false, true] {
            let mut p = P::small();
            p.imm = imm;
            let (mut a, mut b) = connect(&p);
            let len = 3 * 4096 + 100;
            let send = |a: &mut Side, b: &mut Side, id: u64| {
                a.e.submit(pattern(id, len));
                pump(a, b);
                b.got.pop().expect("a large message delivered")
            };
            let kept = send(&mut a, &mut b, 1);
            assert_eq!(kept, pattern(1, len));
            let second = send(&mut a, &mut b, 2);
            let at = second.as_ptr();
            assert_ne!(at, kept.as_ptr(), "a kept message's buffer is not reused");
            // Later messages while `kept` is alive: it never changes.
            drop(second);
            for id in 3..6 {
                let m = send(&mut a, &mut b, id);
                assert_eq!(m, pattern(id, len));
                assert_ne!(m.as_ptr(), kept.as_ptr());
                // The dropped message's buffer is the one reused.
                assert_eq!(m.as_ptr(), at, "imm={imm}: message {id}");
            }
            assert_eq!(kept, pattern(1, len), "a kept message never changes");
        }
    })
    .join()
    .expect("test thread");
}

// ---- zero-copy send (§5.1) ----

/// A body at the threshold is registered once and WRITTEN from where it
/// is: the head's bytes alone go through a staging buffer; the source is
/// held until the completion covering its last WRITE, then released; the
/// receiver gets the same bytes.
#[test]
fn a_large_body_is_written_from_its_source_and_released_after_its_completion() {
    for imm in [false, true] {
        let p = P {
            zero_copy: 5000,
            rdv_count: 4,
            imm,
            ..P::small()
        };
        let (mut a, mut b) = connect(&p);
        pump(&mut a, &mut b);
        let m = pattern(7, 3 * 4096 + 100);
        let mut body = m.clone();
        let head = body.split_to(6);
        a.e.submit_parts(head, body.clone());
        a.e.progress(&mut a.mem).unwrap();
        a.run_actions();
        assert_eq!(a.mem.sources.len(), 1, "registered once");
        assert!(
            a.mem.sources[0].is_some(),
            "held while its WRITEs are posted"
        );
        let writes: Vec<_> = a
            .wire
            .iter()
            .filter_map(|o| match o {
                Op::Write { source, len, .. } => Some((*source, *len)),
                _ => None,
            })
            .collect();
        assert_eq!(
            writes,
            [
                (
                    Some(WriteSource {
                        id: 0,
                        off: 0,
                        head: 6
                    }),
                    4096
                ),
                (
                    Some(WriteSource {
                        id: 0,
                        off: 4090,
                        head: 0
                    }),
                    4096
                ),
                (
                    Some(WriteSource {
                        id: 0,
                        off: 8186,
                        head: 0
                    }),
                    4096
                ),
                (
                    Some(WriteSource {
                        id: 0,
                        off: 12282,
                        head: 0
                    }),
                    100
                ),
            ],
            "imm {imm}"
        );
        pump(&mut a, &mut b);
        assert_eq!(b.got, [m]);
        assert!(a.mem.sources[0].is_none(), "released after the completion");
        assert_eq!(a.e.counters.zero_copy_bytes, body.len() as u64);
        assert_eq!(a.mem.staging_opens, 1, "the head's staging buffer");
    }
}

/// Below the threshold, or when the registration fails, the body is
/// copied into staging buffers as before, and arrives the same.
#[test]
fn a_body_below_the_threshold_or_not_registered_is_copied() {
    for (zero_copy, refuse) in [(5000, false), (100, true)] {
        let p = P {
            zero_copy,
            ..P::small()
        };
        let (mut a, mut b) = connect(&p);
        a.mem.refuse_sources = refuse;
        pump(&mut a, &mut b);
        let m = pattern(9, 4999);
        a.e.submit(m.clone());
        pump(&mut a, &mut b);
        assert_eq!(b.got, [m]);
        assert!(a.mem.sources.is_empty(), "nothing registered");
        assert_eq!(a.e.counters.zero_copy_bytes, 0);
    }
}

/// The source stays registered until the completion that covers its last
/// WRITE is polled, even when every chunk has been handed to the "NIC".
#[test]
fn a_source_outlives_its_posting_until_the_covering_completion() {
    let p = P {
        zero_copy: 1,
        rdv_count: 4,
        imm: true,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    let m = pattern(3, 6000);
    a.e.submit(m.clone());
    a.e.progress(&mut a.mem).unwrap();
    a.run_actions();
    assert_eq!(a.e.pending_msgs(), 0, "every chunk posted");
    while deliver(&mut a, &mut b) {}
    assert!(a.mem.sources[0].is_some(), "no completion polled yet");
    pump(&mut a, &mut b);
    assert!(a.mem.sources[0].is_none());
    assert_eq!(b.got, [m]);
}

/// §8: a queued message that waits for the peer's rendezvous buffers is
/// woken by the receive that returns them, not by send completions (the
/// driver arms its send CQ only for what a completion frees); one that
/// waits for a staging buffer needs the completion.
#[test]
fn only_a_local_wait_asks_for_send_completions() {
    for zero_copy in [0, 1] {
        let p = P {
            zero_copy,
            rdv_count: 2,
            slots: 16,
            ..P::small()
        };
        let (mut a, mut b) = connect(&p);
        pump(&mut a, &mut b);
        // Three messages of two chunks each: the peer's two buffers take
        // the first; the rest waits for their return.
        for i in 0..3 {
            a.e.submit(pattern(i, 2 * 4096));
        }
        a.e.progress(&mut a.mem).unwrap();
        a.run_actions();
        assert!(a.e.pending_msgs() > 0, "waiting for the peer's buffers");
        assert_eq!(a.e.peer_rdv_avail, 0);
        let staging_short = a.e.free_staging.is_empty();
        assert_eq!(
            a.e.wants_send_completions(),
            staging_short,
            "zero_copy {zero_copy}: a completion helps only if it frees staging"
        );
        pump(&mut a, &mut b);
        assert_eq!(b.got.len(), 3, "everything arrives");
    }
}

// ---- messages read by the receiver (§5.6) ----

/// Both sides offer reading: a body at the threshold is announced by one
/// RDV_READ carrying the head, exposed (its window bound before the
/// announcement), READ by the receiver into a buffer of its own, handed up
/// whole, and released after RDV_DONE. No WRITE, no staging buffer.
#[test]
fn a_large_body_is_read_by_the_receiver_and_released_after_its_done() {
    let p = P {
        zero_copy: 5000,
        read: true,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    let m = pattern(7, 3 * 4096 + 100);
    let mut body = m.clone();
    let head = body.split_to(6);
    a.e.submit_parts(head.clone(), body.clone());
    a.e.progress(&mut a.mem).unwrap();
    a.run_actions();
    let ops: Vec<_> = a
        .wire
        .iter()
        .map(|o| match o {
            Op::Bind { .. } | Op::BindDest { .. } => "bind",
            Op::Send { slot, len, .. } => {
                let h = Header::decode(&a.mem.send_slot(*slot)[..*len]).unwrap();
                assert_eq!(h.kind, Kind::RdvRead);
                assert_eq!(*len, HDR_LEN + head.len(), "the head rides on it");
                assert_eq!(h.total_len, body.len() as u64);
                "RDV_READ"
            }
            Op::Write { .. } => "write",
            Op::Read { .. } | Op::ReadStaging { .. } => "read",
        })
        .collect();
    assert_eq!(ops, ["bind", "RDV_READ"]);
    pump(&mut a, &mut b);
    assert_eq!(b.got, [m]);
    assert!(a.mem.sources[0].is_none(), "released after RDV_DONE");
    assert_eq!(a.e.counters.read_announced, 1);
    assert_eq!(a.e.counters.rdv_writes, 0);
    assert_eq!(b.e.counters.read_bytes, body.len() as u64);
    assert_eq!(a.mem.staging_opens, 0, "no staging buffer");
    assert!(b.mem.dests.iter().all(Option::is_none), "handed up");
}

/// A message being read holds back the ones behind it: the application
/// sees them in the order they were sent, and the peer's CLOSE last.
#[test]
fn messages_behind_a_read_wait_for_it() {
    let p = P {
        zero_copy: 5000,
        read: true,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    let big = pattern(1, 9000);
    let small = pattern(2, 50);
    a.e.submit(big.clone());
    a.e.submit(small.clone());
    a.e.close();
    a.e.progress(&mut a.mem).unwrap();
    a.run_actions();
    // The RDV_READ, the EAGER and the CLOSE reach b; b's READ has not
    // executed: nothing is delivered yet.
    while deliver(&mut a, &mut b) {}
    b.process(64);
    assert!(b.got.is_empty() && !b.closed, "held behind the read");
    assert_eq!(b.e.reads_in_progress(), 1);
    assert!(
        b.e.wants_send_completions(),
        "the READ's completion delivers"
    );
    pump(&mut a, &mut b);
    assert_eq!(b.got, [big, small]);
    assert!(b.closed);
}

/// iWARP (siw) completes a SEND posted after a READ before the READ's
/// response arrived: that completion must not finish the READ (it was
/// taken as covering it: the message was handed up unread, and the READ
/// then landed in a buffer already given away).
#[test]
fn a_read_is_finished_by_its_own_completion_only() {
    let p = P {
        zero_copy: 5000,
        read: true,
        late_reads: true,
        slots: 16,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    let msgs: Vec<_> = (0..6).map(|i| pattern(i, 6000 + i as usize)).collect();
    for m in &msgs {
        a.e.submit(m.clone());
        // The peer answers too, so b's SENDs follow its READs.
        b.e.submit(pattern(100, 40));
    }
    pump(&mut a, &mut b);
    assert_eq!(b.got, msgs);
    assert_eq!(a.got.len(), 6);
}

/// Offered by one side only, or with the body not exposable (a failed
/// registration), the message goes by WRITE as before.
#[test]
fn without_both_offers_or_an_exposure_a_body_is_written() {
    for (ra, rb, refuse) in [(true, false), (false, true), (true, true)]
        .into_iter()
        .zip([false, false, true])
        .map(|((a, b), r)| (a, b, r))
    {
        let pa = P {
            zero_copy: 5000,
            read: ra,
            ..P::small()
        };
        let pb = P { read: rb, ..pa };
        let mut a = Side::new(&pa, &pb);
        let mut b = Side::new(&pb, &pa);
        b.e.set_wait_first_recv();
        a.e.send_initial_credit();
        a.mem.refuse_sources = refuse;
        pump(&mut a, &mut b);
        let m = pattern(4, 9000);
        a.e.submit(m.clone());
        pump(&mut a, &mut b);
        assert_eq!(b.got, [m]);
        assert_eq!(a.e.counters.read_announced, 0);
        assert!(a.e.counters.rdv_writes > 0);
    }
}

/// At most MAX_READS messages wait for their RDV_DONE; the next waits.
#[test]
fn announcements_stop_at_max_reads_until_a_done() {
    let p = P {
        zero_copy: 5000,
        read: true,
        slots: 32,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    let n = wire::MAX_READS as u64 + 2;
    for i in 0..n {
        a.e.submit(pattern(i, 6000));
    }
    a.e.progress(&mut a.mem).unwrap();
    a.run_actions();
    assert_eq!(a.e.reads_announced(), wire::MAX_READS as usize);
    assert_eq!(a.e.pending_msgs(), 2, "waiting for an RDV_DONE");
    pump(&mut a, &mut b);
    assert_eq!(b.got.len() as u64, n);
    for (i, m) in b.got.iter().enumerate() {
        assert_eq!(m, &pattern(i as u64, 6000));
    }
}

/// The receiver's checks (§5.6), each before anything is registered.
#[test]
fn a_bad_rdv_read_or_done_is_a_protocol_error() {
    use PeerMisbehaved as V;
    let reader = |read: bool| {
        let p = P {
            read,
            slots: 32,
            ..P::small()
        };
        (p.engine(&p), p.mem())
    };
    let mut h = Header::new(Kind::RdvRead);
    h.addr = 0x1000;
    h.len = 7;
    h.total_len = 5000;
    let once = |h: Header, read: bool| {
        let (mut e, mut m) = reader(read);
        inject(&mut e, &mut m, 0, 0, h, &[1, 2, 3]).map(|()| m.dests.len())
    };
    assert_eq!(once(h, true), Ok(1), "a destination opened");
    assert_eq!(
        once(h, false),
        Err(EngineError::Protocol(V::ReadNotOffered {
            kind: "RDV_READ"
        }))
    );
    for (addr, len) in [(0x1000, 0), (u64::MAX - 10, 5000), (0x1000, (1 << 30) + 1)] {
        let mut x = h;
        x.addr = addr;
        x.total_len = len;
        assert_eq!(
            once(x, true),
            Err(EngineError::Protocol(V::ReadRange { addr, len }))
        );
    }
    // An RDV_DONE for nothing we announced.
    let (mut e, mut m) = reader(true);
    let mut d = Header::new(Kind::RdvDone);
    d.rdv_index = 3;
    assert_eq!(
        inject(&mut e, &mut m, 0, 0, d, &[]),
        Err(EngineError::Protocol(V::ReadDoneUnknown { id: 3 }))
    );
    // The same id twice while the first is being read.
    let (mut e, mut m) = reader(true);
    assert_eq!(inject(&mut e, &mut m, 0, 0, h, &[]), Ok(()));
    assert_eq!(
        inject(&mut e, &mut m, 1, 0, h, &[]),
        Err(EngineError::Protocol(V::ReadIdInUse { id: 0 }))
    );
    // More than MAX_READS at once.
    let (mut e, mut m) = reader(true);
    for i in 0..wire::MAX_READS {
        let mut x = h;
        x.rdv_index = i;
        assert_eq!(inject(&mut e, &mut m, i, 0, x, &[]), Ok(()));
    }
    let mut x = h;
    x.rdv_index = 99;
    assert_eq!(
        inject(&mut e, &mut m, wire::MAX_READS, 0, x, &[]),
        Err(EngineError::Protocol(V::TooManyReads {
            max: wire::MAX_READS
        }))
    );
}

/// §5.6 with memory on demand: the buffers kept for messages read from
/// the peer go after an idle interval with no READ, not while one is in
/// progress, and not after an interval in which one started.
#[test]
fn read_buffers_go_after_an_idle_interval() {
    let p = P {
        zero_copy: 5000,
        read: true,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    a.e.submit(pattern(1, 6000));
    a.e.progress(&mut a.mem).unwrap();
    a.run_actions();
    while deliver(&mut a, &mut b) {}
    b.process(64);
    assert_eq!(b.e.reads_in_progress(), 1, "the READ is posted");
    b.e.on_idle_tick(&mut b.mem);
    assert_eq!(
        b.mem.read_cache_closes, 0,
        "not while a READ is in progress"
    );
    pump(&mut a, &mut b);
    assert_eq!(b.got.len(), 1);
    b.e.on_idle_tick(&mut b.mem);
    assert_eq!(
        b.mem.read_cache_closes, 1,
        "no READ started in the interval: released"
    );
    assert!(!b.e.has_releasable() || b.e.local_rdv == LocalRdv::Static);
    // Another message read: not released at the end of its interval,
    // released at the end of the next.
    a.e.submit(pattern(2, 6000));
    pump(&mut a, &mut b);
    assert_eq!(b.got.len(), 2);
    b.e.on_idle_tick(&mut b.mem);
    assert_eq!(b.mem.read_cache_closes, 1, "a READ started in the interval");
    b.e.on_idle_tick(&mut b.mem);
    assert_eq!(b.mem.read_cache_closes, 2);
    b.e.on_idle_tick(&mut b.mem);
    assert_eq!(b.mem.read_cache_closes, 2, "once");
}

/// §5.6, the copy fallback: no buffer can be registered for a message
/// read from the peer (the cap), so it is read through the staging
/// buffers, a staging buffer's worth per READ, and copied out; it arrives
/// the same, in order with the others, and every staging buffer comes
/// back.
#[test]
fn a_message_with_no_buffer_of_its_own_is_read_through_staging() {
    for late_reads in [false, true] {
        let p = P {
            zero_copy: 5000,
            read: true,
            refuse_dests: true,
            late_reads,
            slots: 16,
            ..P::small()
        };
        let (mut a, mut b) = connect(&p);
        pump(&mut a, &mut b);
        let msgs = [pattern(1, 3 * 4096 + 100), pattern(2, 50), pattern(3, 9000)];
        for m in &msgs {
            a.e.submit(m.clone());
        }
        pump(&mut a, &mut b);
        assert_eq!(b.got, msgs, "late_reads {late_reads}");
        assert_eq!(b.e.counters.reads_staged, 2);
        assert_eq!(b.e.counters.read_bytes, (3 * 4096 + 100 + 9000) as u64);
        assert_eq!(b.e.free_staging.len(), p.rdv_count as usize, "all back");
        assert!(b.mem.dests.is_empty(), "no buffer of their own");
        assert!(a.mem.sources.iter().all(Option::is_none), "released");
    }
}

/// §5.7: with written destinations on both sides, a large body is
/// announced, granted a destination, WRITTEN there whole and handed up
/// from it; the sender's body goes after RDV_DONE; both ways, several in
/// flight, in order with the small messages between them.
#[test]
fn large_bodies_are_written_into_destinations_the_receiver_grants() {
    let p = P {
        zero_copy: 5000,
        read: true,
        write_dest: true,
        slots: 16,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    let mut sent = Vec::new();
    for i in 0..12u64 {
        let m = if i % 3 == 2 {
            pattern(i, 100)
        } else {
            pattern(i, 5000 + 4096 * i as usize)
        };
        let mut body = m.clone();
        let head = body.split_to(6);
        a.e.submit_parts(head.clone(), body.clone());
        b.e.submit_parts(head, body);
        sent.push(m);
    }
    pump(&mut a, &mut b);
    for s in [&a, &b] {
        assert_eq!(s.got, sent);
        assert_eq!(s.e.counters.read_bytes, 0, "nothing read");
        // Bodies from `zero_copy` bytes on are announced; the rest go by
        // WRITE into the rendezvous region.
        let big: usize = sent
            .iter()
            .map(|m| m.len() - 6)
            .filter(|&n| n >= 5000)
            .sum();
        assert_eq!(s.e.counters.dest_bytes, big as u64);
        assert!(s.mem.sources.iter().all(Option::is_none), "all released");
        assert!(s.mem.dests.iter().all(Option::is_none), "all handed up");
        assert!(s.mem.dest_grants.iter().all(Option::is_none), "all revoked");
    }
}

/// What `op`, posted by `s`, is in §5.6 and §5.7's exchange; `None` for a
/// SEND of another kind.
fn rendezvous_op(s: &Side, op: &Op) -> Option<&'static str> {
    Some(match op {
        Op::BindDest { .. } => "bind dest",
        Op::Bind { .. } => "bind source",
        Op::Write { .. } => "WRITE",
        Op::Send { slot, len, .. } => {
            let at = *slot as usize * s.mem.slot;
            match Header::decode(&s.mem.send[at..at + *len]).unwrap().kind {
                Kind::RdvRead => "RDV_READ",
                Kind::RdvDest => "RDV_DEST",
                Kind::RdvWritten => "RDV_WRITTEN",
                Kind::RdvDone => "RDV_DONE",
                _ => return None,
            }
        }
        Op::Read { .. } | Op::ReadStaging { .. } => "READ",
    })
}

/// §5.7: the order on the wire is bind, RDV_DEST (receiver); WRITE,
/// RDV_WRITTEN (sender); RDV_DONE (receiver, once handed up).
#[test]
fn a_written_destination_goes_bind_dest_write_written_done() {
    let p = P {
        zero_copy: 5000,
        read: true,
        write_dest: true,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    let m = pattern(3, 20_000);
    a.e.submit(m.clone());
    let mut seen: Vec<&'static str> = Vec::new();
    for _ in 0..200 {
        for (s, o) in [(&mut a, 0), (&mut b, 1)] {
            s.process(64);
            for op in &s.wire {
                let Some(what) = rendezvous_op(s, op) else {
                    continue;
                };
                if seen.last() != Some(&what) || o == 2 {
                    seen.push(what);
                }
            }
        }
        let moved = deliver(&mut a, &mut b) | deliver(&mut b, &mut a);
        if !moved && a.cq.is_empty() && b.cq.is_empty() {
            break;
        }
    }
    seen.dedup();
    assert_eq!(
        seen,
        [
            "bind source",
            "RDV_READ",
            "bind dest",
            "RDV_DEST",
            "WRITE",
            "RDV_WRITTEN",
            "RDV_DONE"
        ]
    );
    assert_eq!(b.got, [m]);
}

/// §5.7: a large message queued when a grant arrives is announced ahead
/// of the granted WRITE on the send queue, so that its own grant comes back
/// while that WRITE moves: a queue pair sends in order, and behind the
/// WRITE the announcement would wait for the whole body to go.
#[test]
fn the_next_announcement_goes_ahead_of_a_granted_write() {
    let p = P {
        zero_copy: 5000,
        read: true,
        write_dest: true,
        slots: 16,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    let (m1, m2) = (pattern(1, 20_000), pattern(2, 30_000));
    a.e.submit(m1.clone());
    a.process(64);
    while deliver(&mut a, &mut b) {}
    b.process(64);
    while deliver(&mut b, &mut a) {}
    // The grant for m1 is in a's completion queue; m2 is queued with it.
    a.e.submit(m2.clone());
    a.process(64);
    let seen: Vec<&str> = a
        .wire
        .iter()
        .filter_map(|op| rendezvous_op(&a, op))
        .collect();
    assert_eq!(seen, ["bind source", "RDV_READ", "WRITE", "RDV_WRITTEN"]);
    pump(&mut a, &mut b);
    assert_eq!(b.got, [m1, m2]);
    assert_eq!(b.e.counters.dest_bytes, 50_000);
    assert!(a.mem.sources.iter().all(Option::is_none), "all released");
}

/// §5.7: a receiver that cannot grant a destination (no window) reads
/// the message instead; one side without written destinations means
/// reading both ways.
#[test]
fn without_a_grantable_destination_the_message_is_read() {
    for (refuse, other) in [(true, true), (false, false)] {
        let p = P {
            zero_copy: 5000,
            read: true,
            write_dest: true,
            refuse_grants: refuse,
            ..P::small()
        };
        let q = P {
            write_dest: other,
            ..p
        };
        let mut a = Side::new(&p, &q);
        let mut b = Side::new(&q, &p);
        b.e.set_wait_first_recv();
        a.e.send_initial_credit();
        pump(&mut a, &mut b);
        let m = pattern(5, 30_000);
        a.e.submit(m.clone());
        b.e.submit(m.clone());
        pump(&mut a, &mut b);
        for s in [&a, &b] {
            assert_eq!(
                s.got,
                std::slice::from_ref(&m),
                "refuse {refuse}, other {other}"
            );
            assert_eq!(s.e.counters.dest_bytes, 0);
            assert_eq!(s.e.counters.read_bytes, 30_000);
            assert!(s.mem.sources.iter().all(Option::is_none));
        }
    }
}

/// §5.7: forged RDV_DEST and RDV_WRITTEN each end the connection with
/// their own violation, before anything is written.
#[test]
fn a_bad_rdv_dest_or_written_is_a_protocol_error() {
    use PeerMisbehaved as V;
    let p = P {
        zero_copy: 5000,
        read: true,
        write_dest: true,
        slots: 32,
        ..P::small()
    };
    // A sender with one body announced (id 0, 20 000 bytes).
    let sender = |p: &P| {
        let (mut a, mut b) = connect(p);
        pump(&mut a, &mut b);
        a.e.submit(pattern(1, 20_000));
        a.e.progress(&mut a.mem).unwrap();
        a.run_actions();
        assert_eq!(a.e.reads_announced(), 1);
        a
    };
    let dest = |id: u32, len: u64| {
        let mut h = Header::new(Kind::RdvDest);
        h.rdv_index = id;
        h.addr = 0x9000_0000;
        h.len = 0x42;
        h.total_len = len;
        h
    };
    let next = |a: &mut Side| {
        let w = a.posted.pop_front().expect("a posted receive");
        ((w & 0xffff_ffff) as u32, ((w >> 32) & 0xff_ffff) as u32)
    };
    let mut a = sender(&p);
    let (s, g) = next(&mut a);
    assert_eq!(
        inject(&mut a.e, &mut a.mem, s, g, dest(7, 20_000), &[]),
        Err(EngineError::Protocol(V::DestUnknown { id: 7 }))
    );
    let mut a = sender(&p);
    let (s, g) = next(&mut a);
    assert_eq!(
        inject(&mut a.e, &mut a.mem, s, g, dest(0, 20_001), &[]),
        Err(EngineError::Protocol(V::DestRange {
            id: 0,
            addr: 0x9000_0000,
            len: 20_001,
            body: 20_000
        }))
    );
    let mut wrap = dest(0, 20_000);
    wrap.addr = u64::MAX - 100;
    let mut a = sender(&p);
    let (s, g) = next(&mut a);
    assert!(matches!(
        inject(&mut a.e, &mut a.mem, s, g, wrap, &[]),
        Err(EngineError::Protocol(V::DestRange { .. }))
    ));
    // Granted twice.
    let mut a = sender(&p);
    let (s, g) = next(&mut a);
    assert_eq!(
        inject(&mut a.e, &mut a.mem, s, g, dest(0, 20_000), &[]),
        Ok(())
    );
    a.run_actions();
    let (s, g) = next(&mut a);
    assert_eq!(
        inject(&mut a.e, &mut a.mem, s, g, dest(0, 20_000), &[]),
        Err(EngineError::Protocol(V::DestUnknown { id: 0 }))
    );
    // Not negotiated.
    let q = P {
        write_dest: false,
        ..p
    };
    let mut a = sender(&q);
    let (s, g) = next(&mut a);
    assert_eq!(
        inject(&mut a.e, &mut a.mem, s, g, dest(0, 20_000), &[]),
        Err(EngineError::Protocol(V::DestNotOffered {
            kind: "RDV_DEST"
        }))
    );
    // RDV_WRITTEN for nothing granted (receiver side).
    let mut a = sender(&p);
    let (s, g) = next(&mut a);
    let mut w = Header::new(Kind::RdvWritten);
    w.rdv_index = 5;
    assert_eq!(
        inject(&mut a.e, &mut a.mem, s, g, w, &[]),
        Err(EngineError::Protocol(V::WrittenUnknown { id: 5 }))
    );
}

/// §5.7: an RDV_DONE for a body granted a destination but not yet
/// WRITTEN (a peer answering too early) means the body is not written at
/// all, and released once; one for a body WRITTEN but whose WRITE is not
/// known complete keeps it until a completion covers the WRITE.
#[test]
fn a_body_is_released_only_when_its_write_is_done_and_answered() {
    let p = P {
        zero_copy: 5000,
        read: true,
        write_dest: true,
        slots: 32,
        signal_every: 16,
        ..P::small()
    };
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    a.e.submit(pattern(1, 20_000));
    a.e.progress(&mut a.mem).unwrap();
    a.run_actions();
    let next = |a: &mut Side| {
        let w = a.posted.pop_front().expect("a posted receive");
        ((w & 0xffff_ffff) as u32, ((w >> 32) & 0xff_ffff) as u32)
    };
    let mut d = Header::new(Kind::RdvDest);
    d.addr = 0x9000_0000;
    d.len = 0x42;
    d.total_len = 20_000;
    let mut done = Header::new(Kind::RdvDone);
    done.rdv_index = 0;
    // Granted and answered in the same poll: nothing written.
    let (s, g) = next(&mut a);
    a.posted.pop_front();
    inject(&mut a.e, &mut a.mem, s, g, d, &[]).unwrap();
    let (s, g) = next(&mut a);
    a.posted.pop_front();
    inject(&mut a.e, &mut a.mem, s, g, done, &[]).unwrap();
    a.e.progress(&mut a.mem).unwrap();
    assert!(a.mem.sources[0].is_none(), "released once");
    assert!(
        !a.e.take_actions().iter().any(|x| matches!(
            x,
            Action::PostWrite {
                source: Some(_),
                ..
            }
        )),
        "no WRITE from a released body"
    );
    // Written, then answered before any completion covered the WRITE.
    let (mut a, mut b) = connect(&p);
    pump(&mut a, &mut b);
    a.e.submit(pattern(2, 20_000));
    a.e.progress(&mut a.mem).unwrap();
    a.run_actions();
    let (s, g) = next(&mut a);
    a.posted.pop_front();
    inject(&mut a.e, &mut a.mem, s, g, d, &[]).unwrap();
    a.e.progress(&mut a.mem).unwrap();
    let acts = a.e.take_actions();
    let Some(Action::PostWrite { len, .. }) = acts.iter().find(|x| {
        matches!(
            x,
            Action::PostWrite {
                source: Some(_),
                ..
            }
        )
    }) else {
        panic!("the body is WRITTEN once granted: {acts:?}");
    };
    assert_eq!(*len, 20_000);
    let (s, g) = next(&mut a);
    a.posted.pop_front();
    inject(&mut a.e, &mut a.mem, s, g, done, &[]).unwrap();
    assert!(
        a.mem.sources[0].is_some(),
        "held until a completion covers the WRITE"
    );
    let last = acts
        .iter()
        .filter_map(|x| match x {
            Action::PostSend { wr_id, .. } | Action::PostWrite { wr_id, .. } => Some(*wr_id),
            _ => None,
        })
        .max()
        .unwrap();
    a.e.on_completion(
        Completion {
            wr_id: last,
            ok: true,
            status: 0,
            byte_len: 0,
            imm: Imm::None,
        },
        &mut a.mem,
    )
    .unwrap();
    assert!(
        a.mem.sources[0].is_none(),
        "released by the covering completion"
    );
}

/// §5.6, §6: a side whose application stopped reading may disconnect
/// with bodies still announced to it (it would discard them, and a peer
/// that keeps announcing would hold it open); one that reads waits.
#[test]
fn a_side_whose_application_stopped_reading_does_not_wait_for_announced_bodies() {
    for open in [true, false] {
        let p = P {
            read: true,
            slots: 32,
            ..P::small()
        };
        let mut e = p.engine(&p);
        let mut m = p.mem();
        let _ = e.take_actions();
        let mut h = Header::new(Kind::RdvRead);
        h.addr = 0x1000;
        h.len = 7;
        h.total_len = 5000;
        inject(&mut e, &mut m, 0, 0, h, &[1, 2, 3]).unwrap();
        e.note_backlog(0, open);
        e.close();
        e.progress(&mut m).unwrap();
        // Every send-queue work request completes but the READ.
        for a in e.take_actions() {
            if let Action::PostSend { wr_id, .. } = a {
                let c = Completion {
                    wr_id,
                    ok: true,
                    status: 0,
                    byte_len: 0,
                    imm: Imm::None,
                };
                e.on_completion(c, &mut m).unwrap();
            }
        }
        assert!(e.close_sent());
        assert_eq!(e.reads_in_progress(), 1, "the READ has not completed");
        assert_eq!(
            e.close_flushed(),
            !open,
            "application reading: {open}: waits for the body announced to it"
        );
    }
}
