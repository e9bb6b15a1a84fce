//! Wire formats: the connect private data (§2) and the per-SEND header (§3).
//!
//! Everything is little-endian. See `docs/wire-protocol-rdma.md`.

use crate::error::PeerMisbehaved;

/// Magic number at the start of the connect private data ("RGRP").
pub const MAGIC: u32 = 0x5247_5250;
/// Protocol version (§2.1).
pub const VERSION: u16 = 1;
/// Size of the private data blob (§2.1). Must stay <= 56 bytes (IB CM REQ limit).
pub const HELLO_LEN: usize = 44;
/// Size of an admission ticket (§2.4).
pub const TICKET_LEN: usize = 12;
/// Size of a hello followed by a ticket (§2.4): exactly the 56 bytes of
/// private data an IB/RoCE connect request carries.
pub const HELLO_TICKET_LEN: usize = HELLO_LEN + TICKET_LEN;
/// An admission ticket (§2.4): opaque bytes the connecting side presents
/// and the listener's gate checks.
pub type Ticket = [u8; TICKET_LEN];
/// Size of the header at the start of every SEND (§3.1).
pub const HDR_LEN: usize = 32;

/// Message kinds (§3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Whole message inline in this SEND (§4).
    Eager = 1,
    /// Rendezvous chunk notification: data was RDMA-written before this SEND (§5).
    Chunk = 2,
    /// Credit / rendezvous-buffer return only (§4.3).
    Credit = 3,
    /// Sender half closed: no more messages follow (§6).
    Close = 4,
    /// "Advertise your rendezvous region": a rendezvous message is waiting
    /// and the peer's region is advertised on demand (§5.5).
    RdvRequest = 5,
    /// The rendezvous region, advertised on demand (§5.5): `addr` is the
    /// address of buffer 0, `len` the rkey; count and size are the hello's.
    RdvGrant = 6,
    /// "Give the region back when nothing is in flight" (§5.5).
    RdvRevoke = 7,
    /// The region granted last is no longer used: it may be deregistered (§5.5).
    RdvRelease = 8,
    /// "Read this message" (§5.6): the message's body waits at `addr`
    /// (`total_len` bytes, rkey in `len`) for the receiver's RDMA READ; the
    /// SEND's bytes after the header are the message's first bytes;
    /// `rdv_index` names it in the RDV_DONE that answers.
    RdvRead = 9,
    /// "Read it" (§5.6): the body announced by the RDV_READ whose
    /// `rdv_index` this carries is read; its memory may go.
    RdvDone = 10,
    /// "Write it here" (§5.7): the receiver's answer to an RDV_READ whose
    /// `rdv_index` this carries: `total_len` bytes at `addr` (rkey in
    /// `len`), a destination granted for that message alone, which the
    /// sender RDMA-WRITEs the body into.
    RdvDest = 11,
    /// "Written" (§5.7): the body named by `rdv_index` was RDMA-WRITTEN into
    /// the destination its RDV_DEST granted (the WRITE comes before this
    /// SEND on the queue pair, so its data is placed before it arrives).
    RdvWritten = 12,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Eager,
            2 => Kind::Chunk,
            3 => Kind::Credit,
            4 => Kind::Close,
            5 => Kind::RdvRequest,
            6 => Kind::RdvGrant,
            7 => Kind::RdvRevoke,
            8 => Kind::RdvRelease,
            9 => Kind::RdvRead,
            10 => Kind::RdvDone,
            11 => Kind::RdvDest,
            12 => Kind::RdvWritten,
            _ => return None,
        })
    }

    /// The kind's name in §3.2.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Eager => "EAGER",
            Kind::Chunk => "CHUNK",
            Kind::Credit => "CREDIT",
            Kind::Close => "CLOSE",
            Kind::RdvRequest => "RDV_REQUEST",
            Kind::RdvGrant => "RDV_GRANT",
            Kind::RdvRevoke => "RDV_REVOKE",
            Kind::RdvRelease => "RDV_RELEASE",
            Kind::RdvRead => "RDV_READ",
            Kind::RdvDone => "RDV_DONE",
            Kind::RdvDest => "RDV_DEST",
            Kind::RdvWritten => "RDV_WRITTEN",
        }
    }
}

/// Flag bit: last chunk of a rendezvous message (§5.2).
pub const FLAG_LAST: u8 = 1;
/// Flag bit: the sender has received our CLOSE, hence all our messages (§6).
pub const FLAG_CLOSE_SEEN: u8 = 2;
/// Flag bit of a CREDIT message: `total_len` is the new credit limit of the
/// receiver of this message, above the previous one (§4.6).
pub const FLAG_GRANT: u8 = 4;
/// Flag bit of a CREDIT message: `total_len` is the new, lower credit limit
/// of the receiver of this message; it answers with RELEASED once it holds
/// no more (§4.7).
pub const FLAG_REVOKE: u8 = 8;
/// Flag bit of a CREDIT message: the answer to a REVOKE, `total_len` its
/// limit; the sender now uses at most that many of our receive buffers
/// (§4.7).
pub const FLAG_RELEASED: u8 = 16;

/// Hello flag bit: the sender accepts chunk notifications by RDMA WRITE
/// with immediate data, and sends them that way if the peer does too (§2.1,
/// §5.4). Set on InfiniBand/RoCE devices; iWARP has no immediate data.
pub const HELLO_FLAG_WRITE_IMM: u16 = 1;
/// Hello flag bit: memory on demand (§2.1, §4.6, §5.5). The sender of the
/// hello registers its rendezvous region only when the peer asks for it
/// (RDV_REQUEST / RDV_GRANT, given back with RDV_REVOKE / RDV_RELEASE when
/// idle; `rdv_addr` and `rdv_rkey` of the hello are then 0), and may raise
/// the peer's credit limit above the hello's `credits` with a CREDIT
/// message carrying [`FLAG_GRANT`] (§4.6).
pub const HELLO_FLAG_ON_DEMAND: u16 = 2;
/// Hello flag bit: the sender answers a credit revoke (CREDIT with
/// [`FLAG_REVOKE`]) with RELEASED (§4.7), so its peer may take back credits
/// it granted beyond the hello's. Set with `ON_DEMAND`.
pub const HELLO_FLAG_REVOCABLE: u16 = 4;
/// Hello flag bit: the [`TICKET_LEN`] bytes right after the hello are an
/// admission ticket (§2.4). Only the active side's hello may carry one. A
/// property of the encoded blob, not of the connection: [`Hello::encode_with_ticket`]
/// sets it, [`Hello::decode_with_ticket`] consumes it, and a decoded
/// [`Hello`]'s `flags` never hold it.
pub const HELLO_FLAG_TICKET: u16 = 8;
/// Hello flag bit: the sender accepts a chunk notification (an immediate,
/// or a CHUNK SEND's `covered` field) that covers the chunks WRITTEN
/// before it without one (§5.4, "Covering notifications"), and sends them
/// that way if the peer does too: a message whose chunks fit the peer's
/// grants costs the receiver one completion, not one per chunk.
pub const HELLO_FLAG_COVERS: u16 = 16;
/// Hello flag bit: one-sided access (§10). In the active side's hello: it
/// offers it. In the listener's answer: it agrees, and the
/// [`SIDE_TOKEN_LEN`] bytes right after the hello are the side token the
/// active side presents to open the connection's side queue pair.
pub const HELLO_FLAG_REMOTE: u16 = 32;
/// Hello flag bit: this connect request opens the side queue pair of an
/// established connection (§10.2); the [`SIDE_TOKEN_LEN`] bytes right after
/// the hello (the ticket's position, §2.4) are the side token the listener
/// gave. Like [`HELLO_FLAG_TICKET`] a property of the blob: a decoded
/// [`Hello`]'s `flags` never hold it, and it never comes with a ticket.
pub const HELLO_FLAG_SIDE: u16 = 64;
/// Hello flag bit: the sender reads a message its peer announces with
/// RDV_READ, and announces its own large messages that way if the peer
/// sets it too (§5.6: the receiver pulls the body by RDMA READ into
/// memory of its own, which the peer cannot write).
pub const HELLO_FLAG_READ: u16 = 128;
/// Hello flag bit: the sender RDMA-WRITEs a body it announced by RDV_READ
/// into a destination the peer grants for it by RDV_DEST, and may grant
/// such destinations itself, if the peer sets it too (§5.7: the receiver
/// hands the written buffer up once the peer's access to it is revoked).
/// Only meaningful with [`HELLO_FLAG_READ`].
pub const HELLO_FLAG_WRITE_DEST: u16 = 256;
/// Messages a side may have announced by RDV_READ and not yet seen
/// answered by RDV_DONE (§5.6); also the RDMA READs each side lets the
/// other have outstanding on its queue pair.
pub const MAX_READS: u32 = 8;
/// The largest body a message announced by RDV_READ may have (§5.6): one
/// RDMA READ, within every device's message size.
pub const READ_MAX: u64 = 1 << 30;
/// Every flag a [`Hello`]'s `flags` may hold; [`Hello::validate`] refuses
/// any other bit. On the wire [`HELLO_FLAG_TICKET`] and [`HELLO_FLAG_SIDE`]
/// are known too ([`HELLO_WIRE_FLAGS_KNOWN`]).
pub const HELLO_FLAGS_KNOWN: u16 = HELLO_FLAG_WRITE_IMM
    | HELLO_FLAG_ON_DEMAND
    | HELLO_FLAG_REVOCABLE
    | HELLO_FLAG_COVERS
    | HELLO_FLAG_REMOTE
    | HELLO_FLAG_READ
    | HELLO_FLAG_WRITE_DEST;
/// Every flag bit a hello blob may carry (§2.1); any other bit is refused.
pub const HELLO_WIRE_FLAGS_KNOWN: u16 = HELLO_FLAGS_KNOWN | HELLO_FLAG_TICKET | HELLO_FLAG_SIDE;

/// Size of a side token (§10.2), the size of a ticket.
pub const SIDE_TOKEN_LEN: usize = TICKET_LEN;
/// A side token (§10.2): random bytes a listener gives the active side of
/// a connection that offered one-sided access, which it presents to open
/// that connection's side queue pair.
pub type SideToken = [u8; SIDE_TOKEN_LEN];

/// What follows the hello in a connect request (§2.4, §10.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attached {
    /// Nothing: a plain connect request.
    Nothing,
    /// An admission ticket (§2.4).
    Ticket(Ticket),
    /// A side token: the request opens the side queue pair of the
    /// connection the token belongs to (§10.2).
    Side(SideToken),
}

/// Immediate data bit of the last chunk of a message (§5.4).
pub const IMM_LAST: u32 = 1 << 31;
/// Largest "chunks that follow" hint an immediate carries (§5.4).
pub const IMM_FOLLOWING_MAX: u32 = 0x7fff;

/// Immediate data of a chunk WRITE (§5.4): bits 0–15 the rendezvous buffer
/// index, bits 16–30 how many chunks of the message follow (a sizing hint,
/// saturating at [`IMM_FOLLOWING_MAX`]), bit 31 LAST. With
/// [`HELLO_FLAG_COVERS`] negotiated, bits 16–30 instead count the
/// chunks WRITTEN before this one without a notification, which this one
/// covers (at most the peer's grants, below 4096). `index` is below
/// `MAX_RDV_COUNT` (4096), so it fits.
pub fn chunk_imm(index: u32, following: usize, last: bool) -> u32 {
    let following = following.min(IMM_FOLLOWING_MAX as usize) as u32;
    (index & 0xffff) | (following << 16) | if last { IMM_LAST } else { 0 }
}

/// Splits chunk immediate data into (index, following, last) (§5.4).
pub fn parse_chunk_imm(imm: u32) -> (u32, u32, bool) {
    (
        imm & 0xffff,
        (imm >> 16) & IMM_FOLLOWING_MAX,
        imm & IMM_LAST != 0,
    )
}

/// Connection parameters exchanged in the rdma_cm private data (§2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version of the sender.
    pub version: u16,
    /// Flags: [`HELLO_FLAG_WRITE_IMM`], [`HELLO_FLAG_ON_DEMAND`],
    /// [`HELLO_FLAG_REVOCABLE`]; other bits are refused ([`HELLO_FLAG_TICKET`]
    /// is carried by the blob only, see there).
    pub flags: u16,
    /// Receive buffers pre-posted by the sender = initial credits of the peer.
    pub credits: u32,
    /// Bytes per receive buffer (header included).
    pub recv_slot_bytes: u32,
    /// Number of rendezvous buffers in the advertised region.
    pub rdv_count: u32,
    /// Bytes per rendezvous buffer.
    pub rdv_bytes: u32,
    /// Virtual address of rendezvous buffer 0; buffer `i` is at `rdv_addr + i * rdv_bytes`.
    pub rdv_addr: u64,
    /// rkey of the region.
    pub rdv_rkey: u32,
    /// Largest message the sender of this hello accepts.
    pub max_message: u64,
}

impl Hello {
    /// Encodes into the fixed-size blob (§2.1), `flags` as they are.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.credits.to_le_bytes());
        b[12..16].copy_from_slice(&self.recv_slot_bytes.to_le_bytes());
        b[16..20].copy_from_slice(&self.rdv_count.to_le_bytes());
        b[20..24].copy_from_slice(&self.rdv_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.rdv_addr.to_le_bytes());
        b[32..36].copy_from_slice(&self.rdv_rkey.to_le_bytes());
        b[36..44].copy_from_slice(&self.max_message.to_le_bytes());
        b
    }

    /// Encodes with an admission ticket (§2.4): the hello with
    /// [`HELLO_FLAG_TICKET`] set, then the ticket.
    pub fn encode_with_ticket(&self, ticket: &Ticket) -> [u8; HELLO_TICKET_LEN] {
        let flagged = Hello {
            flags: self.flags | HELLO_FLAG_TICKET,
            ..*self
        };
        let mut b = [0u8; HELLO_TICKET_LEN];
        b[..HELLO_LEN].copy_from_slice(&flagged.encode());
        b[HELLO_LEN..].copy_from_slice(ticket);
        b
    }

    /// Encodes a side request (§10.2): the hello with [`HELLO_FLAG_SIDE`]
    /// set, then the side token.
    pub fn encode_side(&self, token: &SideToken) -> [u8; HELLO_TICKET_LEN] {
        let flagged = Hello {
            flags: self.flags | HELLO_FLAG_SIDE,
            ..*self
        };
        let mut b = [0u8; HELLO_TICKET_LEN];
        b[..HELLO_LEN].copy_from_slice(&flagged.encode());
        b[HELLO_LEN..].copy_from_slice(token);
        b
    }

    /// Encodes a listener's answer that agrees to one-sided access (§10.1):
    /// the hello with [`HELLO_FLAG_REMOTE`] set, then the side token.
    pub fn encode_with_side_token(&self, token: &SideToken) -> [u8; HELLO_TICKET_LEN] {
        let flagged = Hello {
            flags: self.flags | HELLO_FLAG_REMOTE,
            ..*self
        };
        let mut b = [0u8; HELLO_TICKET_LEN];
        b[..HELLO_LEN].copy_from_slice(&flagged.encode());
        b[HELLO_LEN..].copy_from_slice(token);
        b
    }

    /// Decodes a connect request (§2.4, §10.2): the hello and what follows
    /// it ([`HELLO_FLAG_TICKET`]: a ticket, [`HELLO_FLAG_SIDE`]: a side
    /// token; both at once is refused). The returned hello's `flags` hold
    /// neither bit.
    ///
    /// # Errors
    ///
    /// As [`Hello::decode`]; [`PeerMisbehaved::HelloTicketTooShort`] when
    /// the blob is too short for the token, and
    /// [`PeerMisbehaved::HelloFieldRange`] for both bits at once.
    pub fn decode_request(b: &[u8]) -> Result<(Hello, Attached), PeerMisbehaved> {
        let side = b.len() >= 8 && u16::from_le_bytes([b[6], b[7]]) & HELLO_FLAG_SIDE != 0;
        if !side {
            let (h, t) = Hello::decode_with_ticket(b)?;
            return Ok((h, t.map_or(Attached::Nothing, Attached::Ticket)));
        }
        let mut plain = b.to_vec();
        let flags = u16::from_le_bytes([b[6], b[7]]);
        if flags & HELLO_FLAG_TICKET != 0 {
            return Err(PeerMisbehaved::HelloFieldRange {
                field: "flags",
                value: flags.into(),
                min: 0,
                max: (HELLO_WIRE_FLAGS_KNOWN & !HELLO_FLAG_TICKET).into(),
            });
        }
        plain[6..8].copy_from_slice(&(flags & !HELLO_FLAG_SIDE).to_le_bytes());
        let (h, _) = Hello::decode_with_ticket(&plain)?;
        let token = b
            .get(HELLO_LEN..HELLO_TICKET_LEN)
            .and_then(|t| SideToken::try_from(t).ok())
            .ok_or(PeerMisbehaved::HelloTicketTooShort {
                len: b.len(),
                need: HELLO_TICKET_LEN,
            })?;
        Ok((h, Attached::Side(token)))
    }

    /// Decodes a listener's answer (§2.3, §10.1): the hello, and the side
    /// token that follows it when its [`HELLO_FLAG_REMOTE`] is set. A
    /// ticket or a side request flag there is refused.
    ///
    /// # Errors
    ///
    /// As [`Hello::decode`]; [`PeerMisbehaved::HelloTicketFromListener`]
    /// for a ticket or side flag; [`PeerMisbehaved::HelloTicketTooShort`]
    /// when the side token is missing.
    pub fn decode_answer(b: &[u8]) -> Result<(Hello, Option<SideToken>), PeerMisbehaved> {
        if b.len() >= 8 && u16::from_le_bytes([b[6], b[7]]) & HELLO_FLAG_SIDE != 0 {
            return Err(PeerMisbehaved::HelloTicketFromListener);
        }
        let h = match Hello::decode_with_ticket(b)? {
            (h, None) => h,
            (_, Some(_)) => return Err(PeerMisbehaved::HelloTicketFromListener),
        };
        if h.flags & HELLO_FLAG_REMOTE == 0 {
            return Ok((h, None));
        }
        let token = b
            .get(HELLO_LEN..HELLO_TICKET_LEN)
            .and_then(|t| SideToken::try_from(t).ok())
            .ok_or(PeerMisbehaved::HelloTicketTooShort {
                len: b.len(),
                need: HELLO_TICKET_LEN,
            })?;
        Ok((h, Some(token)))
    }

    /// Decodes and validates (§2.2). Trailing bytes (CM padding, a ticket)
    /// are ignored; a blob whose [`HELLO_FLAG_TICKET`] is set must still be
    /// long enough to hold the ticket.
    ///
    /// # Errors
    ///
    /// The rule the blob breaks (`PeerMisbehaved::Hello*`).
    pub fn decode(b: &[u8]) -> Result<Hello, PeerMisbehaved> {
        Hello::decode_with_ticket(b).map(|(h, _)| h)
    }

    /// Decodes and validates (§2.2), with the admission ticket when
    /// [`HELLO_FLAG_TICKET`] is set (§2.4): then the blob must be at least
    /// [`HELLO_TICKET_LEN`] bytes. The returned hello's `flags` do not hold
    /// [`HELLO_FLAG_TICKET`]; bytes after the hello (and its ticket) are
    /// ignored.
    ///
    /// # Errors
    ///
    /// As [`Hello::decode`].
    pub fn decode_with_ticket(b: &[u8]) -> Result<(Hello, Option<Ticket>), PeerMisbehaved> {
        if b.len() < HELLO_LEN {
            return Err(PeerMisbehaved::HelloTooShort {
                len: b.len(),
                need: HELLO_LEN,
            });
        }
        let u32at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64at = |o: usize| u64::from(u32at(o)) | (u64::from(u32at(o + 4)) << 32);
        if u32at(0) != MAGIC {
            return Err(PeerMisbehaved::HelloBadMagic { magic: u32at(0) });
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(PeerMisbehaved::HelloVersion {
                version,
                ours: VERSION,
            });
        }
        let flags = u16::from_le_bytes([b[6], b[7]]);
        if flags & !HELLO_WIRE_FLAGS_KNOWN != 0 {
            return Err(PeerMisbehaved::HelloFieldRange {
                field: "flags",
                value: flags.into(),
                min: 0,
                max: HELLO_WIRE_FLAGS_KNOWN.into(),
            });
        }
        let ticket = if flags & HELLO_FLAG_TICKET != 0 {
            let t = b
                .get(HELLO_LEN..HELLO_TICKET_LEN)
                .and_then(|t| Ticket::try_from(t).ok())
                .ok_or(PeerMisbehaved::HelloTicketTooShort {
                    len: b.len(),
                    need: HELLO_TICKET_LEN,
                })?;
            Some(t)
        } else {
            None
        };
        let h = Hello {
            version,
            flags: flags & !HELLO_FLAG_TICKET,
            credits: u32at(8),
            recv_slot_bytes: u32at(12),
            rdv_count: u32at(16),
            rdv_bytes: u32at(20),
            rdv_addr: u64at(24),
            rdv_rkey: u32at(32),
            max_message: u64at(36),
        };
        h.validate()?;
        Ok((h, ticket))
    }

    /// Checks every field against its range in §2.1 and that the advertised
    /// rendezvous region `[rdv_addr, rdv_addr + rdv_count * rdv_bytes)` does
    /// not wrap around the address space, so that no address computed from
    /// it can overflow (§2.2). [`Hello::decode`] calls it; so does
    /// `Engine::new` for the peer's hello.
    ///
    /// # Errors
    ///
    /// [`PeerMisbehaved::HelloVersion`], [`PeerMisbehaved::HelloFieldRange`]
    /// or [`PeerMisbehaved::HelloRegionOverflow`].
    pub fn validate(&self) -> Result<(), PeerMisbehaved> {
        if self.version != VERSION {
            return Err(PeerMisbehaved::HelloVersion {
                version: self.version,
                ours: VERSION,
            });
        }
        let range = |field: &'static str, value: u64, min: u64, max: u64| {
            if (min..=max).contains(&value) {
                Ok(())
            } else {
                Err(PeerMisbehaved::HelloFieldRange {
                    field,
                    value,
                    min,
                    max,
                })
            }
        };
        if self.flags & !HELLO_FLAGS_KNOWN != 0 {
            return Err(PeerMisbehaved::HelloFieldRange {
                field: "flags",
                value: self.flags.into(),
                min: 0,
                max: HELLO_FLAGS_KNOWN.into(),
            });
        }
        range("credits", self.credits.into(), 4, MAX_CREDITS.into())?;
        range(
            "recv_slot_bytes",
            self.recv_slot_bytes.into(),
            (HDR_LEN + 16) as u64,
            MAX_SLOT_BYTES.into(),
        )?;
        range("rdv_count", self.rdv_count.into(), 1, MAX_RDV_COUNT.into())?;
        range(
            "rdv_bytes",
            self.rdv_bytes.into(),
            MIN_RDV_BYTES.into(),
            MAX_RDV_BYTES.into(),
        )?;
        // count <= 2^12 and bytes <= 2^30: the product fits easily in u64;
        // the sum with the peer's address may not.
        let len = u64::from(self.rdv_count) * u64::from(self.rdv_bytes);
        if self.rdv_addr.checked_add(len).is_none() {
            return Err(PeerMisbehaved::HelloRegionOverflow {
                addr: self.rdv_addr,
                count: self.rdv_count,
                bytes: self.rdv_bytes,
            });
        }
        Ok(())
    }
}

/// Largest `credits` in a hello (§2.1).
pub const MAX_CREDITS: u32 = 4096;
/// Largest `recv_slot_bytes` in a hello (§2.1): 16 MiB.
pub const MAX_SLOT_BYTES: u32 = 1 << 24;
/// Largest `rdv_count` in a hello (§2.1).
pub const MAX_RDV_COUNT: u32 = 4096;
/// Smallest `rdv_bytes` in a hello (§2.1).
pub const MIN_RDV_BYTES: u32 = 4096;
/// Largest `rdv_bytes` in a hello (§2.1): 1 GiB.
pub const MAX_RDV_BYTES: u32 = 1 << 30;

/// The header at the start of every SEND (§3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message kind.
    pub kind: Kind,
    /// Flags ([`FLAG_LAST`]).
    pub flags: u8,
    /// Receive credits returned to the peer (§4.2).
    pub credit_return: u16,
    /// Rendezvous buffers returned to the peer (§5.3).
    pub rdv_return: u16,
    /// Eager: payload bytes after the header. Chunk: bytes written into the buffer.
    pub len: u32,
    /// Chunk: index of the rendezvous buffer written.
    pub rdv_index: u32,
    /// Chunk: total message length.
    pub total_len: u64,
    /// Chunk: remote address written (must equal the advertised buffer address).
    pub addr: u64,
    /// Chunk, with covering notifications negotiated (§5.4): the chunks
    /// WRITTEN before this one without a notification, which it covers.
    /// Otherwise reserved (sent as 0, not read).
    pub covered: u16,
}

impl Header {
    /// A header of `kind` with everything else zero.
    pub fn new(kind: Kind) -> Header {
        Header {
            kind,
            flags: 0,
            credit_return: 0,
            rdv_return: 0,
            len: 0,
            rdv_index: 0,
            total_len: 0,
            addr: 0,
            covered: 0,
        }
    }

    /// Encodes into the first [`HDR_LEN`] bytes of `b`.
    pub fn encode(&self, b: &mut [u8]) {
        b[0] = self.kind as u8;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.credit_return.to_le_bytes());
        b[4..6].copy_from_slice(&self.rdv_return.to_le_bytes());
        b[6..8].copy_from_slice(&self.covered.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.rdv_index.to_le_bytes());
        b[16..24].copy_from_slice(&self.total_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.addr.to_le_bytes());
    }

    /// Decodes (§3.1); unknown kinds are a protocol error.
    ///
    /// # Errors
    ///
    /// [`PeerMisbehaved::ShortMessage`] or [`PeerMisbehaved::UnknownKind`].
    pub fn decode(b: &[u8]) -> Result<Header, PeerMisbehaved> {
        if b.len() < HDR_LEN {
            return Err(PeerMisbehaved::ShortMessage { len: b.len() });
        }
        let kind = Kind::from_u8(b[0]).ok_or(PeerMisbehaved::UnknownKind { kind: b[0] })?;
        Ok(Header {
            kind,
            flags: b[1],
            covered: u16::from_le_bytes([b[6], b[7]]),
            credit_return: u16::from_le_bytes([b[2], b[3]]),
            rdv_return: u16::from_le_bytes([b[4], b[5]]),
            len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            rdv_index: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            total_len: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            addr: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_roundtrip() {
        let h = Hello {
            version: VERSION,
            flags: 0,
            credits: 64,
            recv_slot_bytes: 8192,
            rdv_count: 8,
            rdv_bytes: 1 << 20,
            rdv_addr: 0xdead_beef_0000,
            rdv_rkey: 77,
            max_message: 1 << 30,
        };
        let mut padded = h.encode().to_vec();
        padded.extend_from_slice(&[0; 12]);
        assert_eq!(Hello::decode(&padded).unwrap(), h);
        assert!(Hello::decode(&padded[..20]).is_err());
        padded[0] = 0;
        assert!(Hello::decode(&padded).is_err());
    }

    fn good() -> Hello {
        Hello {
            version: VERSION,
            flags: 0,
            credits: 64,
            recv_slot_bytes: 8192,
            rdv_count: 8,
            rdv_bytes: 1 << 18,
            rdv_addr: 0x7f00_0000_0000,
            rdv_rkey: 5,
            max_message: 1 << 30,
        }
    }

    #[test]
    fn a_rendezvous_region_that_wraps_the_address_space_is_refused() {
        // §2.2: rdv_addr + rdv_count * rdv_bytes must not overflow; before,
        // such a hello decoded and the engine's address arithmetic
        // overflowed (a panic in debug builds, a wrapped WRITE address in
        // release).
        let mut h = good();
        h.rdv_addr = u64::MAX - 8 * (1 << 18) + 1;
        assert_eq!(
            Hello::decode(&h.encode()),
            Err(PeerMisbehaved::HelloRegionOverflow {
                addr: h.rdv_addr,
                count: 8,
                bytes: 1 << 18
            })
        );
        // The last address that still fits is fine.
        h.rdv_addr = u64::MAX - 8 * (1 << 18);
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn every_hello_field_is_range_checked() {
        let range = |field, value, min, max| PeerMisbehaved::HelloFieldRange {
            field,
            value,
            min,
            max,
        };
        type Case = (fn(&mut Hello), PeerMisbehaved);
        let cases: [Case; 10] = [
            (|h| h.flags = 512, range("flags", 512, 0, 511)),
            (|h| h.flags = 0x8001, range("flags", 0x8001, 0, 511)),
            (|h| h.credits = 3, range("credits", 3, 4, 4096)),
            (|h| h.credits = 4097, range("credits", 4097, 4, 4096)),
            (
                |h| h.recv_slot_bytes = 47,
                range("recv_slot_bytes", 47, 48, 1 << 24),
            ),
            (
                |h| h.recv_slot_bytes = (1 << 24) + 1,
                range("recv_slot_bytes", (1 << 24) + 1, 48, 1 << 24),
            ),
            (|h| h.rdv_count = 0, range("rdv_count", 0, 1, 4096)),
            (|h| h.rdv_count = 4097, range("rdv_count", 4097, 1, 4096)),
            (
                |h| h.rdv_bytes = 4095,
                range("rdv_bytes", 4095, 4096, 1 << 30),
            ),
            (
                |h| h.rdv_bytes = u32::MAX,
                range("rdv_bytes", u32::MAX.into(), 4096, 1 << 30),
            ),
        ];
        for (edit, want) in cases {
            let mut h = good();
            edit(&mut h);
            assert_eq!(Hello::decode(&h.encode()), Err(want));
        }
        let mut h = good();
        h.version = 2;
        assert_eq!(
            Hello::decode(&h.encode()),
            Err(PeerMisbehaved::HelloVersion {
                version: 2,
                ours: VERSION
            })
        );
        let mut b = good().encode();
        b[0] = 0;
        assert!(matches!(
            Hello::decode(&b),
            Err(PeerMisbehaved::HelloBadMagic { .. })
        ));
        assert_eq!(
            Hello::decode(&b[..20]),
            Err(PeerMisbehaved::HelloTooShort {
                len: 20,
                need: HELLO_LEN
            })
        );
    }

    #[test]
    fn a_ticket_travels_right_after_the_hello() {
        let h = Hello {
            flags: HELLO_FLAG_WRITE_IMM | HELLO_FLAG_ON_DEMAND,
            ..good()
        };
        let t: Ticket = *b"0123456789ab";
        let b = h.encode_with_ticket(&t);
        // 44 + 12: exactly what an IB/RoCE connect request carries.
        assert_eq!(b.len(), 56);
        // The hello's bytes but for the flags (offset 6), which gain TICKET.
        let plain = h.encode();
        assert_eq!(&b[..6], &plain[..6]);
        assert_eq!(&b[8..HELLO_LEN], &plain[8..]);
        assert_eq!(
            u16::from_le_bytes([b[6], b[7]]),
            HELLO_FLAG_WRITE_IMM | HELLO_FLAG_ON_DEMAND | HELLO_FLAG_TICKET
        );
        assert_eq!(&b[HELLO_LEN..], &t);
        // The decoded hello does not hold the ticket flag; the ticket comes
        // separately, and `decode` (without it) accepts the same blob.
        assert_eq!(Hello::decode_with_ticket(&b), Ok((h, Some(t))));
        assert_eq!(Hello::decode(&b), Ok(h));
        // CM padding after the ticket is ignored.
        let mut padded = b.to_vec();
        padded.extend_from_slice(&[0xee; 140]);
        assert_eq!(Hello::decode_with_ticket(&padded), Ok((h, Some(t))));
        // Without the flag, whatever follows the hello is padding, not a
        // ticket.
        let mut plain = h.encode().to_vec();
        plain.extend_from_slice(&t);
        assert_eq!(Hello::decode_with_ticket(&plain), Ok((h, None)));
        assert_eq!(Hello::decode_with_ticket(&h.encode()), Ok((h, None)));
    }

    #[test]
    fn a_ticket_flag_without_the_ticket_bytes_is_refused() {
        let b = good().encode_with_ticket(&[7; TICKET_LEN]);
        for len in [HELLO_LEN, HELLO_LEN + 1, HELLO_TICKET_LEN - 1] {
            let want = PeerMisbehaved::HelloTicketTooShort {
                len,
                need: HELLO_TICKET_LEN,
            };
            assert_eq!(Hello::decode_with_ticket(&b[..len]), Err(want.clone()));
            assert_eq!(Hello::decode(&b[..len]), Err(want));
        }
        // A blob too short for the hello itself is that error, flag or not.
        assert_eq!(
            Hello::decode_with_ticket(&b[..HELLO_LEN - 1]),
            Err(PeerMisbehaved::HelloTooShort {
                len: HELLO_LEN - 1,
                need: HELLO_LEN
            })
        );
        // The flag is a property of the blob: a hello struct holding it is
        // refused by `validate` (and so by `Engine::new`).
        let h = Hello {
            flags: HELLO_FLAG_TICKET,
            ..good()
        };
        assert_eq!(
            h.validate(),
            Err(PeerMisbehaved::HelloFieldRange {
                field: "flags",
                value: 8,
                min: 0,
                max: 439
            })
        );
        // Other unknown bits are refused next to the ticket flag too.
        let mut bad = good().encode_with_ticket(&[1; TICKET_LEN]);
        bad[7] = 0x80;
        assert!(matches!(
            Hello::decode_with_ticket(&bad),
            Err(PeerMisbehaved::HelloFieldRange { field: "flags", .. })
        ));
    }

    #[test]
    fn header_roundtrip() {
        let mut h = Header::new(Kind::Chunk);
        h.flags = FLAG_LAST;
        h.credit_return = 3;
        h.rdv_return = 2;
        h.len = 100;
        h.rdv_index = 5;
        h.total_len = 1 << 33;
        h.addr = 42;
        let mut b = [0u8; HDR_LEN];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b).unwrap(), h);
        b[0] = 13;
        assert_eq!(
            Header::decode(&b),
            Err(PeerMisbehaved::UnknownKind { kind: 13 })
        );
        assert_eq!(
            Header::decode(&b[..10]),
            Err(PeerMisbehaved::ShortMessage { len: 10 })
        );
    }

    #[test]
    fn side_requests_and_side_tokens_round_trip_and_bad_ones_are_refused() {
        let token: SideToken = *b"side-token-1";
        // §10.2: a side request carries the token where a ticket would be.
        let b = good().encode_side(&token);
        assert_eq!(b.len(), HELLO_TICKET_LEN);
        assert_eq!(
            Hello::decode_request(&b).unwrap(),
            (good(), Attached::Side(token))
        );
        // Decoded as a plain request it is refused, never taken for a
        // connection of its own.
        assert!(matches!(
            Hello::decode_with_ticket(&b),
            Err(PeerMisbehaved::HelloFieldRange { field: "flags", .. })
        ));
        // Too short for the token.
        assert!(matches!(
            Hello::decode_request(&b[..HELLO_LEN + 4]),
            Err(PeerMisbehaved::HelloTicketTooShort { len: 48, need: 56 })
        ));
        // SIDE and TICKET at once.
        let mut both = b;
        let f = u16::from_le_bytes([both[6], both[7]]) | HELLO_FLAG_TICKET;
        both[6..8].copy_from_slice(&f.to_le_bytes());
        assert!(matches!(
            Hello::decode_request(&both),
            Err(PeerMisbehaved::HelloFieldRange { field: "flags", .. })
        ));
        // Plain requests and tickets decode as before.
        assert_eq!(
            Hello::decode_request(&good().encode()).unwrap(),
            (good(), Attached::Nothing)
        );
        assert_eq!(
            Hello::decode_request(&good().encode_with_ticket(&token)).unwrap(),
            (good(), Attached::Ticket(token))
        );
        // §10.1: the listener's answer with REMOTE carries the token; the
        // flag stays in the decoded hello (a property of the connection).
        let answer = good().encode_with_side_token(&token);
        let (h, t) = Hello::decode_answer(&answer).unwrap();
        assert_eq!(h.flags, HELLO_FLAG_REMOTE);
        assert_eq!(t, Some(token));
        // InfiniBand pads the answer with zeros: ignored.
        let mut padded = answer.to_vec();
        padded.resize(196, 0);
        assert_eq!(Hello::decode_answer(&padded).unwrap().1, Some(token));
        // REMOTE without the token, a ticket or a side flag in the answer.
        assert!(matches!(
            Hello::decode_answer(&answer[..HELLO_LEN]),
            Err(PeerMisbehaved::HelloTicketTooShort { .. })
        ));
        assert_eq!(
            Hello::decode_answer(&good().encode_with_ticket(&token)),
            Err(PeerMisbehaved::HelloTicketFromListener)
        );
        assert_eq!(
            Hello::decode_answer(&good().encode_side(&token)),
            Err(PeerMisbehaved::HelloTicketFromListener)
        );
        assert_eq!(
            Hello::decode_answer(&good().encode()).unwrap(),
            (good(), None)
        );
    }
}
