//! The checks every remote-memory operation makes on a descriptor before
//! it touches anything: known fields, the peer's region (not our own), an
//! access that allows the operation, a range inside the region.

use super::error::{access_name, RegionError};
use super::proto::{Access, Path, RemoteRegion, Side};

/// A read or a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Reading the region.
    Read,
    /// Writing the region.
    Write,
}

/// A descriptor's enumerations, each known and set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub(crate) access: Access,
    pub(crate) path: Path,
    pub(crate) exposed_by: Side,
}

/// The descriptor's enumerations, or why they are not usable.
pub(crate) fn parse(region: &RemoteRegion) -> Result<Parsed, RegionError> {
    let access = match Access::try_from(region.access) {
        Ok(Access::Unspecified) => return Err(RegionError::Invalid("access not set")),
        Ok(a) => a,
        Err(_) => return Err(RegionError::Invalid("unknown access")),
    };
    let path = match Path::try_from(region.path) {
        Ok(Path::Unspecified) => return Err(RegionError::Invalid("path not set")),
        Ok(p) => p,
        Err(_) => return Err(RegionError::Invalid("unknown path")),
    };
    let exposed_by = match Side::try_from(region.exposed_by) {
        Ok(Side::Unspecified) => return Err(RegionError::Invalid("exposing side not set")),
        Ok(s) => s,
        Err(_) => return Err(RegionError::Invalid("unknown exposing side")),
    };
    Ok(Parsed {
        access,
        path,
        exposed_by,
    })
}

/// Checks that `caller` may `op` `len` bytes at `offset` of the peer's
/// `region`; the descriptor's enumerations on success.
pub(crate) fn check(
    region: &RemoteRegion,
    caller: Side,
    op: Op,
    offset: u64,
    len: u64,
) -> Result<Parsed, RegionError> {
    let p = parse(region)?;
    if p.exposed_by == caller {
        return Err(RegionError::OwnRegion {
            side: side_name(caller),
        });
    }
    let allowed = match op {
        Op::Read => p.access.reads(),
        Op::Write => p.access.writes(),
    };
    if !allowed {
        return Err(RegionError::AccessDenied {
            wanted: match op {
                Op::Read => "reading",
                Op::Write => "writing",
            },
            granted: access_name(p.access),
        });
    }
    in_range(offset, len, region.length)?;
    Ok(p)
}

/// `len` bytes at `offset` lie inside a region of `region_len` bytes.
pub(crate) fn in_range(offset: u64, len: u64, region_len: u64) -> Result<(), RegionError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(RegionError::OutOfRange {
            offset,
            len,
            region_len,
        }),
    }
}

/// "server" or "client".
pub(crate) fn side_name(s: Side) -> &'static str {
    match s {
        Side::Server => "server",
        Side::Client => "client",
        Side::Unspecified => "unspecified",
    }
}

/// How [`RegionError::WrongPath`] names a path.
pub(crate) fn path_name(p: Path) -> &'static str {
    match p {
        Path::OneSided => "one-sided RDMA access",
        Path::Service => "access through the server's RemoteMemory service",
        Path::Unspecified => "no access",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(access: Access, by: Side, len: u64) -> RemoteRegion {
        RemoteRegion {
            length: len,
            access: access as i32,
            path: Path::Service as i32,
            exposed_by: by as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_range_past_the_end_or_overflowing_is_out_of_range() {
        let r = region(Access::ReadWrite, Side::Server, 100);
        assert!(check(&r, Side::Client, Op::Read, 0, 100).is_ok());
        assert!(check(&r, Side::Client, Op::Read, 100, 0).is_ok());
        assert_eq!(
            check(&r, Side::Client, Op::Read, 99, 2),
            Err(RegionError::OutOfRange {
                offset: 99,
                len: 2,
                region_len: 100
            })
        );
        assert!(matches!(
            check(&r, Side::Client, Op::Write, u64::MAX, 2),
            Err(RegionError::OutOfRange { .. })
        ));
    }

    #[test]
    fn the_access_must_allow_the_operation() {
        let ro = region(Access::Read, Side::Server, 8);
        assert!(check(&ro, Side::Client, Op::Read, 0, 8).is_ok());
        let e = check(&ro, Side::Client, Op::Write, 0, 8).unwrap_err();
        assert_eq!(e.status().code(), tonic::Code::PermissionDenied);
        assert!(e.to_string().contains("reading only"), "{e}");
        let wo = region(Access::Write, Side::Server, 8);
        assert!(check(&wo, Side::Client, Op::Write, 0, 8).is_ok());
        assert!(check(&wo, Side::Client, Op::Read, 0, 8).is_err());
    }

    #[test]
    fn own_regions_and_unset_fields_are_refused() {
        let r = region(Access::Read, Side::Client, 8);
        assert_eq!(
            check(&r, Side::Client, Op::Read, 0, 1)
                .unwrap_err()
                .status()
                .code(),
            tonic::Code::FailedPrecondition
        );
        let mut bad = region(Access::Read, Side::Server, 8);
        bad.path = 0;
        assert_eq!(
            check(&bad, Side::Client, Op::Read, 0, 1),
            Err(RegionError::Invalid("path not set"))
        );
        bad.path = 77;
        assert_eq!(
            check(&bad, Side::Client, Op::Read, 0, 1),
            Err(RegionError::Invalid("unknown path"))
        );
        let mut bad = region(Access::Read, Side::Server, 8);
        bad.access = 0;
        assert_eq!(
            check(&bad, Side::Client, Op::Read, 0, 1)
                .unwrap_err()
                .status()
                .code(),
            tonic::Code::InvalidArgument
        );
    }
}
