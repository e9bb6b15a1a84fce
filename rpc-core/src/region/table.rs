//! The regions exposed where there is no one-sided access (TCP and
//! in-memory connections): one table per process, each region with the
//! connection it was exposed on, its token, its access and its bytes. A
//! server's own regions live here, and the clients' regions too (their
//! bytes sent at `Expose`, the server's writes returned at `Revoke`), so
//! that the server's reads and writes of either are local.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};

use bytes::{Bytes, BytesMut};

use super::check::{in_range, Op};
use super::error::RegionError;
use super::proto::{Access, Path, RemoteRegion, Side};

/// Bytes of regions one connection may have exposed at once (both sides'
/// regions kept by this table), by default.
pub(crate) const DEFAULT_PER_CONNECTION: usize = 256 << 20;
/// Bytes of regions this table holds at once, by default.
pub(crate) const DEFAULT_PER_PROCESS: usize = 1 << 30;

/// Memory handed to the peer: a shared `Bytes` (for reading only: other
/// clones may read it meanwhile) or an owned `BytesMut` (for any access:
/// nobody else sees it until it is given back).
#[derive(Debug)]
pub enum Exposable {
    /// Read-only memory, possibly shared.
    Shared(Bytes),
    /// Memory nobody else holds.
    Owned(BytesMut),
}

impl Exposable {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Exposable::Shared(b) => b.len(),
            Exposable::Owned(b) => b.len(),
        }
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, frozen.
    pub fn into_bytes(self) -> Bytes {
        match self {
            Exposable::Shared(b) => b,
            Exposable::Owned(b) => b.freeze(),
        }
    }

    /// The owned buffer; `None` for shared bytes.
    pub fn into_bytes_mut(self) -> Option<BytesMut> {
        match self {
            Exposable::Shared(_) => None,
            Exposable::Owned(b) => Some(b),
        }
    }

    fn slice(&self, offset: usize, len: usize) -> Bytes {
        match self {
            Exposable::Shared(b) => b.slice(offset..offset + len),
            Exposable::Owned(b) => Bytes::copy_from_slice(&b[offset..offset + len]),
        }
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

impl From<Vec<u8>> for Exposable {
    fn from(v: Vec<u8>) -> Exposable {
        Exposable::Owned(BytesMut::from(&v[..]))
    }
}

/// The connection a region was exposed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ConnKey {
    /// A message connection (RDMA or in-memory), by its process-wide number.
    Msg(u64),
    /// A TCP connection, by its (local, remote) addresses.
    Tcp(Option<SocketAddr>, SocketAddr),
}

struct Entry {
    conn: ConnKey,
    token: u64,
    access: Access,
    exposed_by: Side,
    data: Exposable,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    regions: HashMap<u64, Entry>,
    per_conn: HashMap<ConnKey, usize>,
    total: usize,
}

/// The process's table of regions reached through the service path.
pub(crate) struct Table {
    inner: Mutex<Inner>,
    per_connection: usize,
    per_process: usize,
}

/// The process's table.
pub(crate) fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| Table::new(DEFAULT_PER_CONNECTION, DEFAULT_PER_PROCESS))
}

impl Table {
    pub(crate) fn new(per_connection: usize, per_process: usize) -> Table {
        Table {
            inner: Mutex::new(Inner::default()),
            per_connection,
            per_process,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `data` as a region of `conn` that `exposed_by` exposed; its
    /// descriptor.
    pub(crate) fn insert(
        &self,
        conn: ConnKey,
        exposed_by: Side,
        access: Access,
        data: Exposable,
    ) -> Result<RemoteRegion, RegionError> {
        if access == Access::Unspecified {
            return Err(RegionError::Invalid("access not set"));
        }
        let data = match data {
            Exposable::Shared(b) if access.writes() => {
                if exposed_by == Side::Server {
                    return Err(RegionError::SharedNotWritable);
                }
                // A client's bytes arrived in a received message: the
                // server's copy is its own.
                Exposable::Owned(BytesMut::from(&b[..]))
            }
            d => d,
        };
        let token = random_token()?;
        let len = data.len();
        let mut t = self.lock();
        let used = t.per_conn.get(&conn).copied().unwrap_or(0);
        if used + len > self.per_connection {
            return Err(RegionError::Exhausted {
                requested: len,
                cap: self.per_connection,
                in_use: used,
                scope: "connection",
            });
        }
        if t.total + len > self.per_process {
            return Err(RegionError::Exhausted {
                requested: len,
                cap: self.per_process,
                in_use: t.total,
                scope: "process",
            });
        }
        t.next_id += 1;
        let id = t.next_id;
        *t.per_conn.entry(conn).or_insert(0) += len;
        t.total += len;
        t.regions.insert(
            id,
            Entry {
                conn,
                token,
                access,
                exposed_by,
                data,
            },
        );
        Ok(RemoteRegion {
            length: len as u64,
            access: access as i32,
            path: Path::Service as i32,
            exposed_by: exposed_by as i32,
            addr: 0,
            rkey: 0,
            id,
            token,
        })
    }

    /// The entry of `region` if `conn` may use it (the descriptor already
    /// passed `check`).
    fn entry<'a>(
        t: &'a mut Inner,
        conn: ConnKey,
        region: &RemoteRegion,
    ) -> Result<&'a mut Entry, RegionError> {
        let e = t.regions.get_mut(&region.id).ok_or(RegionError::NotFound)?;
        if e.token != region.token || e.exposed_by as i32 != region.exposed_by {
            return Err(RegionError::NotFound);
        }
        if e.conn != conn {
            return Err(RegionError::OtherConnection);
        }
        Ok(e)
    }

    /// `len` bytes at `offset` of `region`, for `conn`.
    pub(crate) fn read(
        &self,
        conn: ConnKey,
        region: &RemoteRegion,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, RegionError> {
        let mut t = self.lock();
        let e = Self::entry(&mut t, conn, region)?;
        allowed(e.access, Op::Read)?;
        in_range(offset, len, e.data.len() as u64)?;
        Ok(e.data.slice(offset as usize, len as usize))
    }

    /// Writes `data` at `offset` of `region`, for `conn`.
    pub(crate) fn write(
        &self,
        conn: ConnKey,
        region: &RemoteRegion,
        offset: u64,
        data: &[u8],
    ) -> Result<(), RegionError> {
        let mut t = self.lock();
        let e = Self::entry(&mut t, conn, region)?;
        allowed(e.access, Op::Write)?;
        in_range(offset, data.len() as u64, e.data.len() as u64)?;
        match &mut e.data {
            Exposable::Owned(b) => {
                let at = offset as usize;
                b[at..at + data.len()].copy_from_slice(data);
                Ok(())
            }
            // `insert` keeps writable regions owned.
            Exposable::Shared(_) => Err(RegionError::SharedNotWritable),
        }
    }

    /// Ends `region` (for `conn`): its bytes.
    pub(crate) fn remove(
        &self,
        conn: ConnKey,
        region: &RemoteRegion,
    ) -> Result<Exposable, RegionError> {
        let mut t = self.lock();
        Self::entry(&mut t, conn, region)?;
        Ok(Self::take(&mut t, region.id).expect("entry checked above"))
    }

    /// Ends region `id` whoever asks (its grant was dropped); its bytes.
    pub(crate) fn remove_id(&self, id: u64) -> Option<Exposable> {
        Self::take(&mut self.lock(), id)
    }

    /// Ends the regions a client exposed on `conn` (the connection ended:
    /// nobody can revoke them any more).
    pub(crate) fn connection_ended(&self, conn: ConnKey) {
        let mut t = self.lock();
        let ids: Vec<u64> = t
            .regions
            .iter()
            .filter(|(_, e)| e.conn == conn && e.exposed_by == Side::Client)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            Self::take(&mut t, id);
        }
    }

    fn take(t: &mut Inner, id: u64) -> Option<Exposable> {
        let e = t.regions.remove(&id)?;
        let len = e.data.len();
        t.total -= len;
        if let Some(n) = t.per_conn.get_mut(&e.conn) {
            *n -= len;
            if *n == 0 {
                t.per_conn.remove(&e.conn);
            }
        }
        Some(e.data)
    }

    /// Bytes held, and regions (for tests and figures).
    pub(crate) fn usage(&self) -> (usize, usize) {
        let t = self.lock();
        (t.total, t.regions.len())
    }
}

fn allowed(access: Access, op: Op) -> Result<(), RegionError> {
    let ok = match op {
        Op::Read => access.reads(),
        Op::Write => access.writes(),
    };
    if ok {
        return Ok(());
    }
    Err(RegionError::AccessDenied {
        wanted: match op {
            Op::Read => "reading",
            Op::Write => "writing",
        },
        granted: super::error::access_name(access),
    })
}

/// An unguessable token: a descriptor's number alone reaches nothing.
fn random_token() -> Result<u64, RegionError> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b)
        .map_err(|e| RegionError::Unavailable(format!("no randomness for a region token: {e}")))?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: ConnKey = ConnKey::Msg(1);
    const B: ConnKey = ConnKey::Msg(2);

    #[test]
    fn a_region_is_reached_only_with_its_token_on_its_connection() {
        let t = Table::new(1 << 20, 1 << 20);
        let r = t
            .insert(
                A,
                Side::Server,
                Access::Read,
                Bytes::from_static(b"hello").into(),
            )
            .unwrap();
        assert_eq!(t.read(A, &r, 1, 3).unwrap(), &b"ell"[..]);
        assert_eq!(t.read(B, &r, 0, 1), Err(RegionError::OtherConnection));
        let forged = RemoteRegion {
            token: r.token ^ 1,
            ..r
        };
        assert_eq!(t.read(A, &forged, 0, 1), Err(RegionError::NotFound));
        assert!(matches!(
            t.read(A, &r, 4, 2),
            Err(RegionError::OutOfRange { .. })
        ));
        assert!(matches!(
            t.write(A, &r, 0, b"x"),
            Err(RegionError::AccessDenied { .. })
        ));
        assert_eq!(t.remove(A, &r).unwrap().into_bytes(), &b"hello"[..]);
        assert_eq!(t.read(A, &r, 0, 1), Err(RegionError::NotFound));
        assert_eq!(t.usage(), (0, 0));
    }

    #[test]
    fn writes_land_and_come_back_on_revoke() {
        let t = Table::new(1 << 20, 1 << 20);
        let r = t
            .insert(
                A,
                Side::Client,
                Access::ReadWrite,
                Bytes::from_static(b"abcdef").into(),
            )
            .unwrap();
        t.write(A, &r, 2, b"XY").unwrap();
        assert_eq!(t.read(A, &r, 0, 6).unwrap(), &b"abXYef"[..]);
        assert_eq!(t.remove(A, &r).unwrap().into_bytes(), &b"abXYef"[..]);
    }

    #[test]
    fn shared_bytes_are_not_exposed_for_writing_by_their_owner() {
        let t = Table::new(1 << 20, 1 << 20);
        assert_eq!(
            t.insert(
                A,
                Side::Server,
                Access::Write,
                Bytes::from_static(b"x").into()
            ),
            Err(RegionError::SharedNotWritable)
        );
    }

    #[test]
    fn caps_bound_a_connection_and_the_process() {
        let t = Table::new(10, 15);
        let r = t
            .insert(A, Side::Server, Access::Read, vec![0; 8].into())
            .unwrap();
        assert!(matches!(
            t.insert(A, Side::Server, Access::Read, vec![0; 3].into()),
            Err(RegionError::Exhausted {
                scope: "connection",
                ..
            })
        ));
        t.insert(B, Side::Server, Access::Read, vec![0; 7].into())
            .unwrap();
        let e = t
            .insert(B, Side::Server, Access::Read, vec![0; 1].into())
            .unwrap_err();
        assert!(matches!(
            e,
            RegionError::Exhausted {
                scope: "process",
                ..
            }
        ));
        assert_eq!(e.status().code(), tonic::Code::ResourceExhausted);
        t.remove_id(r.id).unwrap();
        t.insert(A, Side::Server, Access::Read, vec![0; 8].into())
            .unwrap();
    }

    proptest::proptest! {
        /// Any descriptor and range a peer sends: an error, or exactly the
        /// bytes asked for from the region its number and token name on its
        /// connection, within the region's stored length;
        /// writes land only inside the region; never a panic.
        #[test]
        fn hostile_descriptors_reach_only_their_own_region(
            ops in proptest::collection::vec(
                (0u8..4, proptest::prelude::any::<u64>(), 0u64..80, 0u64..80,
                 proptest::prelude::any::<bool>(), proptest::prelude::any::<bool>()),
                1..64,
            )
        ) {
            let t = Table::new(1 << 20, 1 << 20);
            let mine = t
                .insert(A, Side::Server, Access::ReadWrite, BytesMut::zeroed(64).into())
                .unwrap();
            let other = t
                .insert(B, Side::Server, Access::ReadWrite, BytesMut::zeroed(32).into())
                .unwrap();
            let mut model = [0u8; 64];
            for (op, salt, offset, len, forge_token, forge_len) in ops {
                let mut r = if salt % 5 == 0 { other } else { mine };
                if forge_token {
                    r.token ^= salt | 1;
                }
                if forge_len {
                    r.length = salt;
                }
                // A forged length reaches nothing more: the stored one counts.
                let genuine = r.id == mine.id && r.token == mine.token;
                match op {
                    0 | 1 => match t.read(A, &r, offset, len) {
                        Ok(b) => {
                            proptest::prop_assert!(genuine);
                            proptest::prop_assert_eq!(&b[..], &model[offset as usize..(offset + len) as usize]);
                        }
                        Err(_) => proptest::prop_assert!(!genuine || offset + len > 64),
                    },
                    _ => {
                        let data = vec![(salt >> 8) as u8; len as usize];
                        match t.write(A, &r, offset, &data) {
                            Ok(()) => {
                                proptest::prop_assert!(genuine);
                                model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                            }
                            Err(_) => proptest::prop_assert!(!genuine || offset + len > 64),
                        }
                    }
                }
            }
            let back = t.remove(A, &mine).unwrap().into_bytes();
            proptest::prop_assert_eq!(&back[..], &model[..]);
            let theirs = t.remove(B, &other).unwrap().into_bytes();
            proptest::prop_assert!(theirs.iter().all(|b| *b == 0), "another connection's region untouched");
        }
    }

    #[test]
    fn a_client_s_regions_go_with_its_connection() {
        let t = Table::new(1 << 20, 1 << 20);
        let mine = t
            .insert(A, Side::Server, Access::Read, vec![1; 4].into())
            .unwrap();
        t.insert(A, Side::Client, Access::Write, vec![2; 4].into())
            .unwrap();
        t.connection_ended(A);
        assert_eq!(t.usage(), (4, 1));
        assert!(t.read(A, &mine, 0, 4).is_ok());
    }
}
