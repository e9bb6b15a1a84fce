//! Rendezvous (§5): the peer's region we RDMA-WRITE chunks into and ours
//! that its chunks land in, each chunk notification validated before a
//! buffer is read, the reassembly of a message from its chunks, and the
//! regions on demand (§5.5: request, grant, revoke, release).

use bytes::BytesMut;

use super::wire::{self, Header, Kind, FLAG_LAST, HDR_LEN};
use super::{reasm_buf, Buffers, Engine, EngineError, Event, PeerMisbehaved, REASSEMBLY_RESERVE};

/// Our rendezvous region (§5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LocalRdv {
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
pub(super) enum PeerRdv {
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

pub(super) struct Reassembly {
    pub(super) buf: BytesMut,
    /// Total length announced by CHUNK notifications; unknown (None) for a
    /// message notified by immediates (§5.4).
    pub(super) total: Option<usize>,
}

impl Engine {
    /// Bytes reserved for the rendezvous message being reassembled (test/diagnostics).
    pub fn reassembly_capacity(&self) -> usize {
        self.reasm.as_ref().map_or(0, |r| r.buf.capacity())
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

    /// §5.3: rendezvous buffers returned by the peer (in order). None can
    /// come back while we hold no region of the peer's (§5.5).
    #[inline]
    pub(super) fn on_rdv_returns(&mut self, h: &Header) -> Result<(), EngineError> {
        let avail = u64::from(self.peer_rdv_avail) + u64::from(h.rdv_return);
        let holding = !matches!(self.peer_rdv, PeerRdv::Absent | PeerRdv::Requested);
        if avail > u64::from(self.cfg.peer.rdv_count) || (h.rdv_return > 0 && !holding) {
            return Self::proto(PeerMisbehaved::TooManyRendezvousReturns {
                available: avail,
                advertised: self.cfg.peer.rdv_count,
            });
        }
        self.peer_rdv_avail = avail as u32; // <= peer.rdv_count
        Ok(())
    }

    /// §5.3: validate a chunk notification before touching the buffer.
    pub(super) fn on_chunk<B: Buffers + ?Sized>(
        &mut self,
        h: &Header,
        len: usize,
        bufs: &B,
    ) -> Result<(), EngineError> {
        if len != HDR_LEN {
            return Self::proto(PeerMisbehaved::ChunkWithPayload { len });
        }
        let idx = h.rdv_index;
        // §5.4: the chunks WRITTEN before this one that it covers (none
        // unless covering notifications were negotiated: reserved then).
        let covered = if self.cfg.covers {
            u32::from(h.covered)
        } else {
            0
        };
        self.check_covered_buffers(idx, covered)?;
        let full = self.covered_chunk_bytes();
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
            buf: reasm_buf::take(total.min(REASSEMBLY_RESERVE)),
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
        // Every term is bounded (received bytes <= total <= max_message,
        // covered < rdv_count <= 4096, full and clen <= rdv_bytes <= 1 GiB),
        // so the sum cannot overflow.
        let end = r.buf.len() + covered as usize * full + clen;
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
        self.land_covered(covered, idx, clen, last, bufs);
        Ok(())
    }

    /// §5.4: validates a chunk notified by an RDMA WRITE's immediate data
    /// (`len` = the bytes the WRITE placed) before touching the buffer.
    pub(super) fn on_imm_chunk<B: Buffers + ?Sized>(
        &mut self,
        imm: u32,
        len: usize,
        bufs: &B,
    ) -> Result<(), EngineError> {
        let (idx, following, last) = wire::parse_chunk_imm(imm);
        if self.cfg.covers {
            return self.on_covering_imm(idx, following, last, len, bufs);
        }
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
            buf: reasm_buf::take(cap),
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

    /// §5.4 "Covering notifications": a chunk notified by immediate data
    /// that also notifies the `covered` chunks WRITTEN before it without
    /// one. Those are the next `covered` buffers in round-robin order, each
    /// holding a full chunk (min of the two regions' buffers), and this one
    /// is the buffer after them. Every check is made before any buffer is
    /// read.
    fn on_covering_imm<B: Buffers + ?Sized>(
        &mut self,
        idx: u32,
        covered: u32,
        last: bool,
        len: usize,
        bufs: &B,
    ) -> Result<(), EngineError> {
        self.check_covered_buffers(idx, covered)?;
        if len == 0 || len > self.cfg.rdv_bytes {
            return Self::proto(PeerMisbehaved::ChunkLength {
                len: len as u32,
                max: self.cfg.rdv_bytes,
            });
        }
        let full = self.covered_chunk_bytes();
        let max = self.cfg.max_message;
        // covered < rdv_count <= 4096 and full <= 1 GiB: no overflow.
        let landing = covered as usize * full + len;
        let cap = if last { landing } else { landing + full }
            .min(REASSEMBLY_RESERVE)
            .min(max);
        let r = self.reasm.get_or_insert_with(|| Reassembly {
            buf: reasm_buf::take(cap),
            total: None,
        });
        if r.total.is_some() {
            return Self::proto(PeerMisbehaved::ChunkNotificationMixed);
        }
        // received <= max_message: no overflow.
        let end = r.buf.len() + landing;
        if end > max {
            return Self::proto(PeerMisbehaved::MessageTooLarge {
                total: end as u64,
                max,
            });
        }
        self.land_covered(covered, idx, len, last, bufs);
        Ok(())
    }

    /// §5.3, §5.4: a notification covering `covered` chunks names the
    /// buffer `covered` places after the next one in round-robin order,
    /// and the peer must hold a grant for each of them and for it (so none
    /// is one being consumed or not yet re-advertised). With nothing
    /// covered: [`check_chunk_buffer`](Self::check_chunk_buffer).
    fn check_covered_buffers(&self, idx: u32, covered: u32) -> Result<(), EngineError> {
        if covered == 0 {
            return self.check_chunk_buffer(idx);
        }
        if idx >= self.cfg.rdv_count {
            return Self::proto(PeerMisbehaved::ChunkUnknownBuffer {
                index: idx,
                count: self.cfg.rdv_count,
            });
        }
        if covered >= self.rdv_peer_held {
            return Self::proto(PeerMisbehaved::CoverExceedsGrants {
                chunks: covered + 1,
                held: self.rdv_peer_held,
            });
        }
        // covered < held <= rdv_count <= 4096 and rdv_expected < rdv_count:
        // no overflow.
        let expected = (self.rdv_expected + covered) % self.cfg.rdv_count;
        if idx != expected {
            return Self::proto(PeerMisbehaved::ChunkBufferNotGranted {
                index: idx,
                expected,
                held: self.rdv_peer_held,
            });
        }
        Ok(())
    }

    /// §5.4: the bytes of each chunk a notification covers: a full chunk,
    /// the smaller of the two regions' buffers.
    #[inline]
    pub(super) fn covered_chunk_bytes(&self) -> usize {
        self.cfg.rdv_bytes.min(self.cfg.peer.rdv_bytes as usize)
    }

    /// Lands the `covered` chunks before buffer `idx` (full ones, checked
    /// by the caller) and then `idx` itself with its `len` bytes.
    fn land_covered<B: Buffers + ?Sized>(
        &mut self,
        covered: u32,
        idx: u32,
        len: usize,
        last: bool,
        bufs: &B,
    ) {
        let full = self.covered_chunk_bytes();
        for _ in 0..covered {
            self.land_chunk(self.rdv_expected, full, false, bufs);
        }
        self.land_chunk(idx, len, last, bufs);
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
            let msg = reasm_buf::finish(r.buf);
            self.counters.msgs_recv += 1;
            self.counters.bytes_recv += msg.len() as u64;
            self.deliver(Event::Message(msg));
        }
    }

    /// §5.5: the peer asks for our region.
    #[inline]
    pub(super) fn on_rdv_request(&mut self, h: &Header) -> Result<(), EngineError> {
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
        Ok(())
    }

    /// §5.5: the peer granted the region we asked for.
    #[inline]
    pub(super) fn on_rdv_grant(&mut self, h: &Header) -> Result<(), EngineError> {
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
        Ok(())
    }

    /// §5.5: the peer takes back the region it granted us.
    #[inline]
    pub(super) fn on_rdv_revoke(&mut self, h: &Header) -> Result<(), EngineError> {
        if self.peer_rdv != PeerRdv::Granted {
            return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                kind: h.kind.name(),
                why: "for a region it did not grant us",
            });
        }
        self.peer_rdv = PeerRdv::ReleaseDue;
        self.owed_data += 1;
        Ok(())
    }

    /// §5.5: the peer let go of the region we revoked.
    #[inline]
    pub(super) fn on_rdv_release<B: Buffers + ?Sized>(
        &mut self,
        h: &Header,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
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
        Ok(())
    }

    /// §5.5: the region control messages due: the grant of our region
    /// (registered now), its revoke, and the release of the peer's.
    #[inline]
    pub(super) fn post_rdv_control<B: Buffers + ?Sized>(
        &mut self,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
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
        Ok(())
    }
}
