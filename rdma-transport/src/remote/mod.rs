//! One-sided access (wire protocol §10): a connection's peer reads and
//! writes memory this side exposes, by RDMA READ and WRITE, without this
//! side's CPU.
//!
//! * [`RemoteMemory`] ([`Connection::remote_memory`](crate::Connection::remote_memory)):
//!   [`expose`](RemoteMemory::expose) a buffer to the peer of this
//!   connection, [`read`](RemoteMemory::read) and
//!   [`write`](RemoteMemory::write) what the peer exposed,
//! * [`Exposure`]: one exposed buffer, its [`RegionKey`] (what the peer
//!   needs, to be sent in a message of the application's), revoked by
//!   [`Exposure::revoke`] or dropping,
//! * the per-connection state (`state`): the exposure PD, the exposed
//!   bytes, the side queue pair in use and how to get a fresh one.
//!
//! The side queue pair itself (its setup and its task) is in
//! `crate::conn::side`; the registration of the buffers in `crate::mem`.

mod state;

use bytes::{Bytes, BytesMut};

use crate::error::{Error, RemoteError};
use crate::mem::{read_buffer, read_bytes, write_buffer, Local, MrUse, UserMr, SMALL_READ_MAX};

pub(crate) use self::state::{Finished, Op, OpResult, OpSpec, RemoteShared, Role, SideLink};

/// The access an exposure grants the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteAccess {
    /// RDMA READ only.
    Read,
    /// RDMA WRITE only.
    Write,
    /// Both.
    ReadWrite,
}

impl RemoteAccess {
    /// Whether this grant allows `op` (a `Read` or a `Write`).
    pub fn allows(self, op: RemoteAccess) -> bool {
        match op {
            RemoteAccess::Read => self != RemoteAccess::Write,
            RemoteAccess::Write => self != RemoteAccess::Read,
            RemoteAccess::ReadWrite => self == RemoteAccess::ReadWrite,
        }
    }

    /// The access's code in a descriptor (1 read, 2 write, 3 both).
    pub fn code(self) -> u8 {
        match self {
            RemoteAccess::Read => 1,
            RemoteAccess::Write => 2,
            RemoteAccess::ReadWrite => 3,
        }
    }

    /// The access of a code from [`RemoteAccess::code`]; `None` for any
    /// other value.
    pub fn from_code(c: u8) -> Option<RemoteAccess> {
        match c {
            1 => Some(RemoteAccess::Read),
            2 => Some(RemoteAccess::Write),
            3 => Some(RemoteAccess::ReadWrite),
            _ => None,
        }
    }
}

/// What the peer needs to reach one exposure; travels inside a descriptor
/// of the application's. Valid only on the connection whose
/// [`RemoteMemory`] issued it, for its range and access only, until the
/// exposure is revoked: the NIC enforces all of it (§10.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionKey {
    /// Address of the first byte in the exposing process.
    pub addr: u64,
    /// Bytes exposed.
    pub len: u64,
    /// The registration's rkey.
    pub rkey: u32,
    /// What the peer may do.
    pub access: RemoteAccess,
}

/// Size of [`RegionKey::encode`]'s output.
pub const REGION_KEY_LEN: usize = 21;

impl RegionKey {
    /// A fixed 21-byte little-endian encoding (`addr`, `len`, `rkey`,
    /// access code), for descriptors.
    pub fn encode(&self) -> [u8; REGION_KEY_LEN] {
        let mut b = [0u8; REGION_KEY_LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b[20] = self.access.code();
        b
    }

    /// Decodes [`RegionKey::encode`]'s output; `None` when `b` is not
    /// [`REGION_KEY_LEN`] bytes or the access code is unknown. A decoded
    /// key is only what the peer claims: the NIC checks it on use.
    pub fn decode(b: &[u8]) -> Option<RegionKey> {
        let b: &[u8; REGION_KEY_LEN] = b.try_into().ok()?;
        let u64at = |o: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(x)
        };
        Some(RegionKey {
            addr: u64at(0),
            len: u64at(8),
            rkey: u32::from_le_bytes([b[16], b[17], b[18], b[19]]),
            access: RemoteAccess::from_code(b[20])?,
        })
    }
}

/// Memory handed to the peer: `Shared` may only be exposed for
/// [`RemoteAccess::Read`] (other `Bytes` may share it).
#[derive(Debug)]
pub enum Exposable {
    /// Read-only memory, possibly shared with other `Bytes`.
    Shared(Bytes),
    /// Memory this side owns alone; the peer may write it.
    Owned(BytesMut),
}

impl Exposable {
    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        match self {
            Exposable::Shared(b) => b.len(),
            Exposable::Owned(b) => b.len(),
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Bytes> for Exposable {
    fn from(b: Bytes) -> Exposable {
        Exposable::Shared(b)
    }
}

impl From<BytesMut> for Exposable {
    fn from(b: BytesMut) -> Exposable {
        Exposable::Owned(b)
    }
}

/// Most bytes one [`RemoteMemory::read`] or [`RemoteMemory::write`] moves
/// (1 GiB; split larger transfers).
pub const MAX_OP_BYTES: u64 = 1 << 30;

/// The peer's address of `len` bytes at `offset` in `key`'s region, if the
/// key allows `op` there (§10.4). The checks before anything is posted.
pub(crate) fn check(
    key: &RegionKey,
    offset: u64,
    len: u64,
    op: RemoteAccess,
) -> Result<u64, RemoteError> {
    if !key.access.allows(op) {
        return Err(RemoteError::AccessDenied {
            wanted: op,
            granted: key.access,
        });
    }
    let out = || RemoteError::OutOfRange {
        offset,
        len,
        region_len: key.len,
    };
    let end = offset.checked_add(len).ok_or_else(out)?;
    if end > key.len {
        return Err(out());
    }
    // The region itself must not wrap the address space.
    key.addr.checked_add(key.len).ok_or_else(out)?;
    if len > MAX_OP_BYTES {
        return Err(RemoteError::TooLarge {
            len,
            max: MAX_OP_BYTES,
        });
    }
    Ok(key.addr + offset)
}

/// One-sided access on one connection (both sides). Cheap to clone;
/// `Send + Sync`. See `docs/wire-protocol-rdma.md` §10.
#[derive(Clone)]
pub struct RemoteMemory {
    pub(crate) inner: std::sync::Arc<RemoteShared>,
}

impl std::fmt::Debug for RemoteMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteMemory")
            .field("exposed_bytes", &self.exposed_bytes())
            .finish()
    }
}

impl RemoteMemory {
    /// Registers `buf` so that the peer of this connection (only) can reach
    /// it with `access`, in this connection's own protection domain (§10.1):
    /// its key works on no other connection, for no other range or access.
    /// No message is sent; on the connecting side, the side queue pair is
    /// opened in the background if there is none yet (the peer needs it).
    ///
    /// # Errors
    ///
    /// [`RemoteError::SharedNotWritable`] for a `Shared` buffer with write
    /// access, [`RemoteError::Empty`], [`RemoteError::Unavailable`] when
    /// the peer does not offer one-sided access, [`RemoteError::Closed`];
    /// [`Error::ResourceLimit`] beyond `Config::max_exposed_bytes`
    /// ([`ResourceError::ExposedBytes`](crate::ResourceError::ExposedBytes))
    /// or `global_max_registered_bytes`, or when `ibv_reg_mr` fails.
    pub async fn expose(&self, buf: Exposable, access: RemoteAccess) -> Result<Exposure, Error> {
        let s = &self.inner;
        if matches!(buf, Exposable::Shared(_)) && access != RemoteAccess::Read {
            return Err(Error::Remote(RemoteError::SharedNotWritable));
        }
        if buf.is_empty() {
            return Err(Error::Remote(RemoteError::Empty));
        }
        s.usable()?;
        let len = buf.len();
        let owned = matches!(buf, Exposable::Owned(_));
        let counted = s.count_exposed(len)?;
        let pd = s.pd()?;
        let mr = UserMr::new(
            pd,
            buf,
            MrUse::Exposed(access),
            s.cfg.global_max_registered_bytes,
        )?;
        // §10.2: the listener side will use it through a side queue pair,
        // which only this side can open.
        s.open_in_background(std::time::Duration::ZERO);
        let key = RegionKey {
            addr: mr.addr(),
            len: mr.len() as u64,
            rkey: mr.rkey(),
            access,
        };
        Ok(Exposure {
            mr: Some(mr),
            key,
            owned,
            _counted: counted,
        })
    }

    /// One-sided RDMA READ of `len` bytes at `offset` within the peer's
    /// region `key`, into a local buffer kept registered between
    /// operations (`Config::one_sided_cache_bytes`, §10.5). The bytes are
    /// handed over only after the READ completed: up to 4 KiB copied out
    /// of the buffer, more as the buffer itself (back to the cache when
    /// the `Bytes` is dropped). Zero bytes: a no-op (after the checks).
    /// Dropping the future never frees memory the NIC may write.
    ///
    /// # Errors
    ///
    /// Before anything is posted: [`RemoteError::OutOfRange`],
    /// [`RemoteError::AccessDenied`], [`RemoteError::TooLarge`]. Then
    /// [`RemoteError::Refused`] when the peer's NIC refused it (the key is
    /// revoked, foreign or forged); [`RemoteError::Unavailable`] without a
    /// side queue pair (the peer does not offer one, it could not be
    /// opened, or failed twice for this operation); [`RemoteError::Closed`];
    /// [`Error::ResourceLimit`] when the local buffer cannot be registered.
    pub async fn read(&self, key: &RegionKey, offset: u64, len: usize) -> Result<Bytes, Error> {
        let remote = check(key, offset, len as u64, RemoteAccess::Read).map_err(Error::Remote)?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        self.inner.usable()?;
        // §10.5: on iWARP a small READ whose source crosses a page boundary
        // is made as two, one on each side of it.
        if let Some(first) = split_small_read(remote, len, self.inner.iwarp()) {
            let head = self.read_at(remote, first, key.rkey).await?;
            let tail = self
                .read_at(remote + first as u64, len - first, key.rkey)
                .await?;
            let mut b = bytes::BytesMut::with_capacity(len);
            b.extend_from_slice(&head);
            b.extend_from_slice(&tail);
            return Ok(b.freeze());
        }
        self.read_at(remote, len, key.rkey).await
    }

    /// One READ of `len` (> 0) bytes at the peer's address `remote`, checked.
    async fn read_at(&self, remote: u64, len: usize, rkey: u32) -> Result<Bytes, Error> {
        let s = &self.inner;
        // A small READ lands in the side queue pair's own buffer when it
        // is free (§10.5), else in a local buffer taken then.
        let local = if len <= SMALL_READ_MAX {
            Local::Small
        } else {
            let (pd, cache) = (s.pd()?, s.cache()?);
            Local::Mr(read_buffer(
                cache,
                len,
                pd,
                s.cfg.global_max_registered_bytes,
            )?)
        };
        match s.run(true, local, len, remote, rkey).await? {
            Finished::Read(b) => Ok(b),
            Finished::Mr(done) => read_bytes(done, len).ok_or_else(|| {
                Error::Remote(RemoteError::Unavailable(
                    "deregistering the READ's buffer failed".into(),
                ))
            }),
        }
    }

    /// One-sided RDMA WRITE of `data` at `offset` within the peer's region
    /// `key`; returns once the WRITE completed (the peer's NIC has the
    /// data). Up to 64 KiB are copied into a local buffer kept registered
    /// (§10.5); more are registered where they are, for the WRITE. Empty `data`: a no-op (after the checks). Dropping the future
    /// never frees memory the NIC may read.
    ///
    /// # Errors
    ///
    /// As [`RemoteMemory::read`].
    pub async fn write(&self, key: &RegionKey, offset: u64, data: Bytes) -> Result<(), Error> {
        let remote =
            check(key, offset, data.len() as u64, RemoteAccess::Write).map_err(Error::Remote)?;
        if data.is_empty() {
            return Ok(());
        }
        let s = &self.inner;
        s.usable()?;
        let pd = s.pd()?;
        let len = data.len();
        let cache = s.cache()?;
        let local = write_buffer(cache, data, pd, s.cfg.global_max_registered_bytes)?;
        let done = s
            .run(false, Local::Mr(local), len, remote, key.rkey)
            .await?;
        drop(done);
        Ok(())
    }

    /// Bytes of registered local buffers this connection keeps for its
    /// READs and WRITEs (free or in use; `Config::one_sided_cache_bytes`).
    pub fn cached_bytes(&self) -> usize {
        self.inner.cached_bytes()
    }

    /// Bytes this connection exposes right now.
    pub fn exposed_bytes(&self) -> usize {
        self.inner.exposed()
    }

    /// Whether the peer offered one-sided access (and this side agreed):
    /// without it every operation fails with [`RemoteError::Unavailable`].
    pub fn is_available(&self) -> bool {
        self.inner.usable().is_ok()
    }
}

/// One buffer exposed to the peer ([`RemoteMemory::expose`]); `Send`.
/// Revoked by [`Exposure::revoke`] or dropping.
pub struct Exposure {
    /// `Some` until revoked.
    mr: Option<UserMr>,
    key: RegionKey,
    /// An `Owned` buffer (else `Shared`).
    owned: bool,
    /// The bytes counted against `Config::max_exposed_bytes`, given back
    /// after the MR is deregistered (field order).
    _counted: state::Counted,
}

impl std::fmt::Debug for Exposure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exposure").field("key", &self.key).finish()
    }
}

impl Exposure {
    /// What the peer needs to reach this exposure.
    pub fn key(&self) -> RegionKey {
        self.key
    }

    /// Ends the peer's access (deregisters: once this returns the NIC
    /// cannot touch the memory, a READ or WRITE with the key fails with
    /// [`RemoteError::Refused`] at the peer) and gives the buffer back,
    /// with whatever the peer wrote. Should deregistering fail (logged),
    /// the buffer is leaked rather than handed out, and an empty one of
    /// the same kind is returned.
    pub fn revoke(mut self) -> Exposable {
        match self.mr.take().and_then(UserMr::into_inner) {
            Some(b) => b,
            None if self.owned => Exposable::Owned(BytesMut::new()),
            None => Exposable::Shared(Bytes::new()),
        }
    }
}

/// READs of at most this many bytes whose source crosses a page boundary
/// are split there on iWARP (§10.5).
const SPLIT_READ_MAX: usize = 64;

/// Boundaries a small READ's source must not cross on iWARP: 4 KiB, so
/// that any page size's boundaries are among them.
const SPLIT_READ_PAGE: u64 = 4096;

/// §10.5: siw (seen on Linux 6.1) answers a READ of at most 32 bytes whose
/// source crosses a page boundary with wrong bytes (the part after the
/// boundary shifted), so on iWARP a READ of at most [`SPLIT_READ_MAX`]
/// bytes that crosses a 4 KiB boundary of the peer's addresses is made as
/// two: the length of the first part, if it is to be split.
fn split_small_read(remote: u64, len: usize, iwarp: bool) -> Option<usize> {
    if !iwarp || len > SPLIT_READ_MAX {
        return None;
    }
    let to_boundary = SPLIT_READ_PAGE - remote % SPLIT_READ_PAGE;
    (to_boundary < len as u64).then_some(to_boundary as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(len: u64, access: RemoteAccess) -> RegionKey {
        RegionKey {
            addr: 0x7f00_0000_0000,
            len,
            rkey: 7,
            access,
        }
    }

    #[test]
    fn small_reads_across_a_page_boundary_are_split_there_on_iwarp_only() {
        let page = 0x7f00_0000_1000u64;
        // Across the boundary: split where it is.
        assert_eq!(split_small_read(page - 6, 20, true), Some(6));
        assert_eq!(split_small_read(page - 1, 2, true), Some(1));
        assert_eq!(split_small_read(page - 63, 64, true), Some(63));
        // Up to it, from it, within a page: one READ.
        assert_eq!(split_small_read(page - 20, 20, true), None);
        assert_eq!(split_small_read(page, 64, true), None);
        assert_eq!(split_small_read(page + 100, 64, true), None);
        // Larger READs, and other devices: one READ.
        assert_eq!(split_small_read(page - 6, 65, true), None);
        assert_eq!(split_small_read(page - 6, 20, false), None);
    }

    #[test]
    fn checks_refuse_out_of_range_and_denied_access_before_posting() {
        use RemoteAccess::*;
        let k = key(4096, ReadWrite);
        assert_eq!(check(&k, 0, 4096, Read), Ok(0x7f00_0000_0000));
        assert_eq!(check(&k, 4095, 1, Write), Ok(0x7f00_0000_0fff));
        assert_eq!(check(&k, 4096, 0, Read), Ok(0x7f00_0000_1000));
        assert_eq!(
            check(&k, 4000, 97, Read),
            Err(RemoteError::OutOfRange {
                offset: 4000,
                len: 97,
                region_len: 4096
            })
        );
        assert_eq!(
            check(&k, 4097, 0, Read),
            Err(RemoteError::OutOfRange {
                offset: 4097,
                len: 0,
                region_len: 4096
            })
        );
        // offset + len overflows u64: out of range, no panic.
        assert!(matches!(
            check(&k, u64::MAX, 2, Read),
            Err(RemoteError::OutOfRange { .. })
        ));
        // A region that wraps the address space.
        let wrap = RegionKey {
            addr: u64::MAX - 10,
            ..key(4096, Read)
        };
        assert!(matches!(
            check(&wrap, 0, 1, Read),
            Err(RemoteError::OutOfRange { .. })
        ));
        assert_eq!(
            check(&key(64, Read), 0, 8, Write),
            Err(RemoteError::AccessDenied {
                wanted: Write,
                granted: Read
            })
        );
        assert_eq!(
            check(&key(64, Write), 0, 8, Read),
            Err(RemoteError::AccessDenied {
                wanted: Read,
                granted: Write
            })
        );
        assert!(check(&key(64, Write), 0, 8, Write).is_ok());
        assert_eq!(
            check(&key(u64::MAX / 2, Read), 0, MAX_OP_BYTES + 1, Read),
            Err(RemoteError::TooLarge {
                len: MAX_OP_BYTES + 1,
                max: MAX_OP_BYTES
            })
        );
        // The texts say what to do.
        assert_eq!(
            Error::Remote(RemoteError::AccessDenied {
                wanted: Write,
                granted: Read
            })
            .to_string(),
            "remote memory: the peer exposed this region for Read access; Write is not allowed"
        );
        assert!(Error::Remote(RemoteError::Refused {
            status: "remote access error".into()
        })
        .to_string()
        .contains("revoked"));
    }

    #[test]
    fn handles_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<RemoteMemory>();
        send::<Exposure>();
        send::<Exposable>();
    }

    #[test]
    fn access_grants_and_region_keys_round_trip() {
        use RemoteAccess::*;
        assert!(ReadWrite.allows(Read) && ReadWrite.allows(Write) && ReadWrite.allows(ReadWrite));
        assert!(Read.allows(Read) && !Read.allows(Write) && !Read.allows(ReadWrite));
        assert!(Write.allows(Write) && !Write.allows(Read));
        for a in [Read, Write, ReadWrite] {
            let k = RegionKey {
                addr: 0x1234_5678_9abc,
                len: 1 << 20,
                rkey: 0xdead_beef,
                access: a,
            };
            assert_eq!(RegionKey::decode(&k.encode()), Some(k));
        }
        let mut b = key(64, Read).encode();
        b[20] = 9;
        assert_eq!(RegionKey::decode(&b), None);
        assert_eq!(RegionKey::decode(&b[..20]), None);
    }
}
