//! rdma-transport's protocol engine driven by random operation sequences, with
//! a hostile peer: arbitrary bytes land in our receive slots (forged headers,
//! credits, rendezvous notifications) and in our rendezvous buffers, completions
//! arrive in any order with any wr_id. The engine may fail the connection, but
//! never panics, never asks to post outside its own buffers, and never RDMA
//! WRITEs outside the region the peer advertised. The peer's hello is fuzzed
//! too (when the first byte is odd): a hello `Hello::decode` refuses must be
//! refused by `Engine::new` as well, and with any hello it accepts (any
//! region up to the top of the address space) every WRITE stays inside it.
//! Immediate data (§5.4) is negotiated when the input says so, and the peer
//! forges WRITE-with-immediate and SEND-with-immediate completions with any
//! immediate and length; messages are submitted whole or as gathers.
//! Memory on demand (§4.6, §5.5) is on for either side when the input says
//! so: then WRITEs must stay inside the region the peer *granted* (whatever
//! the forged RDV_GRANT said, as long as the engine accepted it), nothing is
//! read from a region or staging buffer that is not registered, and idle
//! ticks come at any moment. Zero-copy send (§5.1) is on when the input
//! says so: a WRITE reads a source only inside its registration and only
//! before the engine released it, and every release names a source held.
//! Reading by the receiver (§5.6) is on when the input says so: the peer
//! forges RDV_READ and RDV_DONE at will; a READ lands only inside a
//! destination the engine opened and has not taken (or, with none to be
//! had, inside a registered staging buffer), a window is bound only over
//! a body exposed and not released. Written destinations (§5.7) are on
//! when the input says so: the peer forges RDV_DEST and RDV_WRITTEN at
//! will; a WRITE outside the peer's region goes only exactly where a forged
//! RDV_DEST said, from a body exposed and not released, of its length; a
//! window is bound only over a destination opened and not taken.
#![no_main]
use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use rdma_transport::engine::wire::{
    Header, Hello, Kind, HELLO_FLAG_ON_DEMAND, HELLO_FLAG_READ, HELLO_FLAG_WRITE_DEST, VERSION,
};
use rdma_transport::engine::{
    sq_wr_id, Action, Buffers, Completion, Engine, EngineConfig, Event, ExposedBody, Imm,
    ResourceError, WriteSource,
};
use std::collections::VecDeque;

const SLOTS: u32 = 8;
const SLOT: usize = 256;
const RDV_COUNT: u32 = 4;
const RDV_BYTES: usize = 4096;
const PEER_RDV_ADDR: u64 = 0x7000_0000;
const PEER_RKEY: u32 = 0x1234;
const MAX_MESSAGE: usize = 64 << 10;

struct Mem {
    recv: Vec<u8>,
    send: Vec<u8>,
    rdv: Vec<u8>,
    staging: Vec<u8>,
    recv_active: u32,
    send_active: u32,
    rdv_open: bool,
    staging_open: bool,
    /// Zero-copy sources (§5.1) and exposed bodies (§5.6): the registered
    /// length, `None` once released.
    sources: Vec<Option<usize>>,
    /// READ destinations (§5.6): their length, `None` once taken.
    dests: Vec<Option<usize>>,
    /// open_dest refuses (the cap): READs go through the staging buffers.
    refuse_dests: bool,
    /// §5.7: destinations exposed to the peer (by id), until taken.
    dest_exposed: Vec<bool>,
    /// §5.7: what the forged RDV_DESTs granted: (address, rkey, length).
    grants: Vec<(u64, u32, u64)>,
}

impl Buffers for Mem {
    fn recv_slot(&self, i: u32) -> &[u8] {
        assert!(i < self.recv_active, "receive slot {i} not registered");
        &self.recv[i as usize * SLOT..(i as usize + 1) * SLOT]
    }
    fn send_slot(&mut self, i: u32) -> &mut [u8] {
        assert!(i < self.send_active, "send slot {i} not registered");
        &mut self.send[i as usize * SLOT..(i as usize + 1) * SLOT]
    }
    fn append_rdv(&self, i: u32, len: usize, out: &mut BytesMut) {
        assert!(self.rdv_open, "read from a region that is not registered");
        assert!(
            len <= RDV_BYTES,
            "copy of {len} bytes from a rendezvous buffer"
        );
        let off = i as usize * RDV_BYTES;
        out.extend_from_slice(&self.rdv[off..off + len]);
    }
    fn staging(&mut self, i: u32) -> &mut [u8] {
        assert!(self.staging_open, "staging used while not registered");
        &mut self.staging[i as usize * RDV_BYTES..(i as usize + 1) * RDV_BYTES]
    }
    fn open_rdv(&mut self) -> Result<(u64, u32), ResourceError> {
        assert!(!self.rdv_open, "region registered twice");
        self.rdv_open = true;
        Ok((0x1000_0000, 0x99))
    }
    fn close_rdv(&mut self) {
        assert!(self.rdv_open, "region deregistered twice");
        self.rdv_open = false;
    }
    fn open_staging(&mut self) -> Result<(), ResourceError> {
        assert!(!self.staging_open, "staging registered twice");
        self.staging_open = true;
        Ok(())
    }
    fn close_staging(&mut self) {
        assert!(self.staging_open, "staging released twice");
        self.staging_open = false;
    }
    fn grow_send(&mut self, n: u32) -> Result<(), ResourceError> {
        assert!(n > self.send_active && n <= SLOTS, "send ring grows to {n}");
        self.send_active = n;
        Ok(())
    }
    fn shrink_send(&mut self, n: u32) {
        assert!(n < self.send_active, "send ring shrinks to {n}");
        self.send_active = n;
    }
    fn grow_recv(&mut self, n: u32) -> Result<(), ResourceError> {
        assert!(n > self.recv_active && n <= SLOTS, "receive ring grows to {n}");
        self.recv_active = n;
        Ok(())
    }
    fn register_source(&mut self, body: &Bytes) -> Option<u32> {
        assert!(!body.is_empty(), "an empty source");
        self.sources.push(Some(body.len()));
        Some(self.sources.len() as u32 - 1)
    }
    fn release_source(&mut self, id: u32) {
        let s = self.sources.get_mut(id as usize).expect("a source never registered");
        assert!(s.take().is_some(), "source {id} released twice");
    }
    fn expose_source(&mut self, body: &Bytes) -> Option<ExposedBody> {
        assert!(!body.is_empty(), "an empty body exposed");
        self.sources.push(Some(body.len()));
        let id = self.sources.len() as u32 - 1;
        Some(ExposedBody {
            id,
            addr: 0x5000_0000 + (u64::from(id) << 20),
            rkey: 0x77,
            bind: id % 2 == 0,
        })
    }
    fn open_dest(&mut self, head: &[u8], len: usize) -> Result<u32, ResourceError> {
        if self.refuse_dests {
            return Err(ResourceError::Other("over the cap".into()));
        }
        let total = head.len() + len;
        assert!(total <= MAX_MESSAGE, "a destination of {total} bytes");
        self.dests.push(Some(total));
        Ok(self.dests.len() as u32 - 1)
    }
    fn expose_dest(&mut self, id: u32, off: usize, len: usize) -> Result<ExposedBody, ResourceError> {
        let n = self
            .dests
            .get(id as usize)
            .copied()
            .flatten()
            .expect("a destination exposed after it was taken, or never opened");
        assert!(off + len <= n, "{len} bytes at {off} exposed of a {n}-byte destination");
        if self.dest_exposed.len() <= id as usize {
            self.dest_exposed.resize(id as usize + 1, false);
        }
        assert!(!self.dest_exposed[id as usize], "destination {id} exposed twice");
        self.dest_exposed[id as usize] = true;
        Ok(ExposedBody {
            id,
            addr: 0x6000_0000 + (u64::from(id) << 20) + off as u64,
            rkey: 0x88,
            bind: true,
        })
    }
    fn take_dest(&mut self, id: u32) -> Result<Bytes, ResourceError> {
        if let Some(x) = self.dest_exposed.get_mut(id as usize) {
            *x = false;
        }
        let d = self.dests.get_mut(id as usize).expect("a destination never opened");
        let n = d.take().expect("a destination taken twice");
        Ok(Bytes::from(vec![0xCD; n]))
    }
}

struct Input<'a>(&'a [u8]);
impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn u64(&mut self) -> u64 {
        let mut v = [0u8; 8];
        let t = self.take(8);
        v[..t.len()].copy_from_slice(t);
        u64::from_le_bytes(v)
    }
}

/// Checks every action against the local and the advertised (or granted)
/// bounds.
fn drain(
    e: &mut Engine,
    peer: &Hello,
    mem: &Mem,
    posted: &mut VecDeque<u64>,
    sq: &mut VecDeque<u64>,
) {
    // The region WRITEs may target: the one the engine holds now (the
    // hello's, or the granted one); none at all while it holds none.
    let region = e.peer_region();
    for a in e.take_actions() {
        match a {
            Action::PostRecv { slot, wr_id } => {
                assert!(
                    slot < mem.recv_active,
                    "receive slot {slot} out of range"
                );
                posted.push_back(wr_id);
            }
            Action::PostSend {
                slot, len, wr_id, ..
            } => {
                assert!(
                    slot < mem.send_active && len <= SLOT,
                    "send slot {slot} len {len}"
                );
                sq.push_back(wr_id);
            }
            Action::PostWrite {
                staging,
                len,
                remote_addr,
                rkey,
                wr_id,
                source,
                ..
            } => {
                // §5.7: a body WRITTEN whole into a destination a forged
                // RDV_DEST granted.
                let granted = mem
                    .grants
                    .iter()
                    .any(|&(a, k, n)| a == remote_addr && k == rkey && n == len as u64);
                if granted {
                    if let Some(WriteSource { id, off: 0, head: 0 }) = source {
                        let held = mem.sources.get(id as usize).copied().flatten();
                        assert_eq!(
                            held,
                            Some(len),
                            "WRITE of {len} bytes from body {id} into a destination"
                        );
                        sq.push_back(wr_id);
                        continue;
                    }
                }
                assert!(
                    staging < RDV_COUNT && len <= RDV_BYTES,
                    "staging {staging} len {len}"
                );
                let staged = match source {
                    None => len,
                    Some(WriteSource { id, off, head }) => {
                        let held = mem.sources.get(id as usize).copied().flatten();
                        let Some(n) = held else {
                            panic!("WRITE from source {id}, released or never registered");
                        };
                        assert!(
                            head < len && off + (len - head) <= n,
                            "WRITE of {len} bytes (head {head}) at {off} of a {n}-byte source"
                        );
                        head
                    }
                };
                assert!(staged == 0 || mem.staging_open, "WRITE from unregistered staging");
                let Some((base, key)) = region else {
                    // A keepalive (§4.4): zero bytes, address and rkey 0.
                    assert!(
                        len == 0 && remote_addr == 0 && rkey == 0,
                        "a WRITE of {len} bytes while holding no peer region"
                    );
                    sq.push_back(wr_id);
                    continue;
                };
                assert_eq!(
                    rkey, key,
                    "WRITE with an rkey the peer never advertised"
                );
                let end = base
                    .checked_add(u64::from(peer.rdv_count) * u64::from(peer.rdv_bytes))
                    .expect("an accepted region does not wrap");
                assert!(
                    remote_addr >= base
                        && remote_addr
                            .checked_add(len as u64)
                            .is_some_and(|e| e <= end),
                    "WRITE of {len} bytes at {remote_addr:#x} outside the advertised region"
                );
                sq.push_back(wr_id);
            }
            Action::BindSource { id, wr_id, .. } => {
                assert!(
                    mem.sources.get(id as usize).copied().flatten().is_some(),
                    "bind over body {id}, released or never exposed"
                );
                sq.push_back(wr_id);
            }
            Action::BindDest { dest, wr_id, .. } => {
                assert!(
                    mem.dests.get(dest as usize).copied().flatten().is_some()
                        && mem.dest_exposed.get(dest as usize) == Some(&true),
                    "bind over destination {dest}, taken or never exposed"
                );
                sq.push_back(wr_id);
            }
            Action::PostReadStaging {
                staging, len, wr_id, ..
            } => {
                assert!(
                    staging < RDV_COUNT && len <= RDV_BYTES && mem.staging_open,
                    "READ of {len} bytes into staging {staging}"
                );
                sq.push_back(wr_id);
            }
            Action::PostRead {
                dest, off, len, wr_id, ..
            } => {
                let Some(n) = mem.dests.get(dest as usize).copied().flatten() else {
                    panic!("READ into destination {dest}, taken or never opened");
                };
                assert!(off + len <= n, "READ of {len} bytes at {off} into {n}");
                sq.push_back(wr_id);
            }
        }
    }
    while let Some(ev) = e.next_event() {
        if let Event::Message(m) = ev {
            assert!(
                m.len() <= MAX_MESSAGE,
                "message of {} bytes over the limit",
                m.len()
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let first = input.byte().unwrap_or(0);
    let write_imm = first & 1 == 1;
    let on_demand = first & 2 != 0;
    let peer_on_demand = first & 4 != 0;
    // §5.4: covering notifications, where immediates are on.
    let covers = write_imm && first & 8 != 0;
    // §5.1: zero-copy send of bodies from 1 KiB on.
    let zero_copy = first & 16 != 0;
    // §5.6: reading by the receiver, both ways.
    let read = first & 32 != 0;
    // §5.7: written destinations, both ways.
    let write_dest = read && first & 128 != 0;
    let mut peer = Hello {
        version: VERSION,
        flags: 0,
        credits: SLOTS,
        recv_slot_bytes: SLOT as u32,
        rdv_count: RDV_COUNT,
        rdv_bytes: RDV_BYTES as u32,
        rdv_addr: PEER_RDV_ADDR,
        rdv_rkey: PEER_RKEY,
        max_message: MAX_MESSAGE as u64,
    };
    if peer_on_demand {
        peer.flags = HELLO_FLAG_ON_DEMAND;
        peer.rdv_addr = 0;
        peer.rdv_rkey = 0;
    }
    if read {
        peer.flags |= HELLO_FLAG_READ;
    }
    if write_dest {
        peer.flags |= HELLO_FLAG_WRITE_DEST;
    }
    if input.byte().unwrap_or(0) & 1 == 1 {
        // A hello with fuzzed fields (magic and version right, so that the
        // range and overflow checks are what decides).
        let mut b = peer.encode();
        let t = input.take(b.len() - 8);
        b[8..8 + t.len()].copy_from_slice(t);
        peer = Hello {
            credits: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            recv_slot_bytes: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            rdv_count: u32::from_le_bytes(b[16..20].try_into().unwrap()),
            rdv_bytes: u32::from_le_bytes(b[20..24].try_into().unwrap()),
            rdv_addr: u64::from_le_bytes(b[24..32].try_into().unwrap()),
            rdv_rkey: u32::from_le_bytes(b[32..36].try_into().unwrap()),
            max_message: u64::from_le_bytes(b[36..44].try_into().unwrap()),
            ..peer
        };
        // Engine::new must agree with the decoder (§2.2).
        let decoded = Hello::decode(&peer.encode());
        if let Ok(d) = &decoded {
            assert_eq!(d, &peer, "decode(encode(h)) == h");
        } else {
            let r = Engine::new(engine_config(peer, write_imm, covers, on_demand, zero_copy, read, write_dest));
            assert!(
                r.is_err(),
                "Engine::new accepted a hello decode refuses: {peer:?}"
            );
            return;
        }
    }
    let Ok(mut e) = Engine::new(engine_config(peer, write_imm, covers, on_demand, zero_copy, read, write_dest)) else {
        panic!("Engine::new refused a hello decode accepts: {peer:?}");
    };
    let mut mem = Mem {
        recv: vec![0; SLOTS as usize * SLOT],
        send: vec![0; SLOTS as usize * SLOT],
        rdv: vec![0; RDV_COUNT as usize * RDV_BYTES],
        staging: vec![0; RDV_COUNT as usize * RDV_BYTES],
        recv_active: if on_demand { INITIAL } else { SLOTS },
        send_active: if on_demand { INITIAL } else { SLOTS },
        rdv_open: !on_demand,
        staging_open: false,
        sources: Vec::new(),
        dests: Vec::new(),
        refuse_dests: first & 64 != 0,
        dest_exposed: Vec::new(),
        grants: Vec::new(),
    };
    let mut posted = VecDeque::new();
    let mut sq = VecDeque::new();
    let mut seq = 0u64;
    drain(&mut e, &peer, &mem, &mut posted, &mut sq);
    run(
        &mut e,
        &peer,
        &mut mem,
        &mut input,
        &mut posted,
        &mut sq,
        &mut seq,
    );
});

/// Ring size at the start with memory on demand.
const INITIAL: u32 = 4;

fn engine_config(
    peer: Hello,
    write_imm: bool,
    covers: bool,
    on_demand: bool,
    zero_copy: bool,
    read: bool,
    write_dest: bool,
) -> EngineConfig {
    let initial = if on_demand { INITIAL } else { SLOTS };
    EngineConfig {
        recv_slots: SLOTS,
        initial_recv_slots: initial,
        recv_slot_bytes: SLOT,
        send_slots: SLOTS,
        initial_send_slots: initial,
        on_demand,
        send_slot_bytes: SLOT,
        rendezvous_threshold: 128,
        rdv_count: RDV_COUNT,
        rdv_bytes: RDV_BYTES,
        rdv_addr: 0x1000_0000,
        staging_count: RDV_COUNT,
        staging_bytes: RDV_BYTES,
        zero_copy_min: if zero_copy { 1024 } else { 0 },
        max_message: MAX_MESSAGE,
        signal_every: 4,
        max_inline: 64,
        write_imm,
        covers,
        read_rdv: read,
        write_dest,
        grant_dest: write_dest,
        zero_length_write_any_rkey: write_imm,
        // §4.7: the revoke exchange too, where memory is on demand.
        revoke_idle: on_demand,
        peer,
    }
}

fn run(
    e: &mut Engine,
    peer: &Hello,
    mem: &mut Mem,
    input: &mut Input<'_>,
    posted: &mut VecDeque<u64>,
    sq: &mut VecDeque<u64>,
    seq: &mut u64,
) {
    while let Some(op) = input.byte() {
        let r = match op % 7 {
            // The peer SENDs: arbitrary bytes land in the next posted receive.
            0 => {
                let Some(wr_id) = posted.pop_front() else {
                    continue;
                };
                let len = input.byte().unwrap_or(0) as usize % (SLOT + 1);
                let slot = (wr_id & 0xffff_ffff) as usize;
                let bytes = input.take(len).to_vec();
                mem.recv[slot * SLOT..slot * SLOT + bytes.len()].copy_from_slice(&bytes);
                if let Ok(h) = Header::decode(&bytes) {
                    if h.kind == Kind::RdvDest {
                        mem.grants.push((h.addr, h.len, h.total_len));
                    }
                }
                e.on_completion(
                    Completion {
                        wr_id,
                        ok: true,
                        status: 0,
                        byte_len: len as u32,
                        imm: Imm::None,
                    },
                    mem,
                )
            }
            // The peer RDMA-WRITEs arbitrary bytes into our rendezvous
            // region (its rkey is valid only while it is registered).
            1 if mem.rdv_open => {
                let off = input.byte().unwrap_or(0) as usize * 64 % mem.rdv.len();
                let bytes = input.take(64).to_vec();
                let n = bytes.len().min(mem.rdv.len() - off);
                mem.rdv[off..off + n].copy_from_slice(&bytes[..n]);
                Ok(())
            }
            // The application sends a message (eager or rendezvous), whole
            // or as a gather split anywhere.
            2 => {
                let len = (input.byte().unwrap_or(0) as usize) * 97 % (16 << 10);
                let cut = input.byte().unwrap_or(0) as usize * 67 % (len + 1);
                let mut body = Bytes::from(vec![0xAB; len]);
                if cut == 0 {
                    e.submit(body);
                } else {
                    let head = body.split_to(cut);
                    e.submit_parts(head, body);
                }
                Ok(())
            }
            // The oldest send-queue work request completes.
            3 => match sq.pop_front() {
                Some(wr_id) => e.on_completion(
                    Completion {
                        wr_id,
                        ok: true,
                        status: 0,
                        byte_len: 0,
                        imm: Imm::None,
                    },
                    mem,
                ),
                None => Ok(()),
            },
            // A completion with an arbitrary wr_id and status.
            4 => {
                let wr_id = input.u64();
                let ok = input.byte().unwrap_or(0) & 1 == 0;
                e.on_completion(
                    Completion {
                        wr_id,
                        ok,
                        status: 5,
                        byte_len: input.byte().unwrap_or(0) as u32,
                        imm: Imm::None,
                    },
                    mem,
                )
            }
            // The peer forges a WRITE (or SEND) with immediate data: any
            // immediate, any length, into the next posted receive.
            5 if input.byte().unwrap_or(0) & 1 == 1 => {
                let Some(wr_id) = posted.pop_front() else {
                    continue;
                };
                let imm = input.u64() as u32;
                let len = (input.u64() % (RDV_BYTES as u64 + 2)) as u32;
                let kind = if input.byte().unwrap_or(0) & 3 == 0 {
                    Imm::Send(imm)
                } else {
                    Imm::Write(imm)
                };
                e.on_completion(
                    Completion {
                        wr_id,
                        ok: true,
                        status: 0,
                        byte_len: len,
                        imm: kind,
                    },
                    mem,
                )
            }
            // Memory on demand: an idle interval ends.
            6 => {
                e.on_idle_tick(mem);
                Ok(())
            }
            // A send-queue completion for a sequence number never posted.
            _ => {
                *seq = seq.wrapping_add(input.u64() % 1000);
                e.on_completion(
                    Completion {
                        wr_id: sq_wr_id(*seq),
                        ok: true,
                        status: 0,
                        byte_len: 0,
                        imm: Imm::None,
                    },
                    mem,
                )
            }
        };
        if r.is_err() {
            return; // the connection is closed with a protocol or completion error
        }
        let p = e.progress(mem);
        drain(e, peer, mem, posted, sq);
        if p.is_err() {
            return; // memory could not be registered: the connection ends
        }
    }
}
