//! Why a remote-memory operation failed ([`RegionError`]), and the gRPC
//! status each reason gives.

use super::proto::Access;

/// Why a remote-memory operation failed. Each maps to the gRPC status a
/// caller acts on ([`RegionError::status`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RegionError {
    /// No such region: revoked, never exposed, or exposed by another server.
    #[error("remote region not found: it was revoked, or it was exposed on another connection or by another server")]
    NotFound,
    /// The region exists but was exposed on another connection.
    #[error("remote region was exposed on another connection; a descriptor is valid only on the connection it was issued on")]
    OtherConnection,
    /// The range lies outside the region.
    #[error("remote region range out of bounds: {len} bytes at offset {offset} in a region of {region_len} bytes")]
    OutOfRange {
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The region does not allow the operation.
    #[error("remote region allows {granted}, not {wanted}")]
    AccessDenied {
        /// "reading" or "writing".
        wanted: &'static str,
        /// What the region allows.
        granted: &'static str,
    },
    /// The descriptor is one of this side's own regions.
    #[error("remote region was exposed by this side ({side}); only the peer can read or write it")]
    OwnRegion {
        /// "server" or "client".
        side: &'static str,
    },
    /// The descriptor is for another path than the connection offers.
    #[error(
        "remote region descriptor is for {descriptor}, but this connection offers {connection}"
    )]
    WrongPath {
        /// The descriptor's path.
        descriptor: &'static str,
        /// The connection's path.
        connection: &'static str,
    },
    /// A field of the descriptor is missing or unknown.
    #[error("invalid remote region descriptor: {0}")]
    Invalid(&'static str),
    /// `Bytes` exposed for writing.
    #[error("a shared `Bytes` can only be exposed for reading; expose a `BytesMut` (or `Vec<u8>`) for writing")]
    SharedNotWritable,
    /// Over a cap on exposed bytes.
    #[error("cannot expose {requested} bytes: {in_use} of the {cap} bytes a {scope} may expose are in use")]
    Exhausted {
        /// Bytes asked for.
        requested: usize,
        /// The cap.
        cap: usize,
        /// Bytes exposed already.
        in_use: usize,
        /// "connection" or "process".
        scope: &'static str,
    },
    /// The connection cannot reach remote memory.
    #[error("remote memory unavailable: {0}")]
    Unavailable(String),
}

impl RegionError {
    /// The gRPC status for this error, with its text as the message.
    pub(crate) fn status(&self) -> tonic::Status {
        use tonic::Code;
        let code = match self {
            RegionError::NotFound => Code::NotFound,
            RegionError::OtherConnection | RegionError::AccessDenied { .. } => {
                Code::PermissionDenied
            }
            RegionError::OutOfRange { .. } => Code::OutOfRange,
            RegionError::OwnRegion { .. } | RegionError::WrongPath { .. } => {
                Code::FailedPrecondition
            }
            RegionError::Invalid(_) | RegionError::SharedNotWritable => Code::InvalidArgument,
            RegionError::Exhausted { .. } => Code::ResourceExhausted,
            RegionError::Unavailable(_) => Code::Unavailable,
        };
        tonic::Status::new(code, self.to_string())
    }
}

impl From<RegionError> for tonic::Status {
    fn from(e: RegionError) -> tonic::Status {
        e.status()
    }
}

/// How [`RegionError::AccessDenied`] names an access.
pub(crate) fn access_name(a: Access) -> &'static str {
    match a {
        Access::Unspecified => "nothing",
        Access::Read => "reading only",
        Access::Write => "writing only",
        Access::ReadWrite => "reading and writing",
    }
}
