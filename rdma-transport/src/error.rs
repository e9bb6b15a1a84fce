//! Error type.

use std::fmt;
use std::net::SocketAddr;

/// Errno wrapper that displays as `strerror` text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (errno {})",
            std::io::Error::from_raw_os_error(self.0),
            self.0
        )
    }
}

/// Errors of the RDMA transport.
///
/// For automatic TCP fallback, [`Error::is_unavailable_for_fallback`] tells
/// whether RDMA is simply not usable to reach that peer (no device, address
/// not reachable over RDMA, nobody listening, setup timed out) as opposed to
/// a failure of an established connection.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No RDMA device / no RDMA support in the kernel.
    #[error("no RDMA device available: {0}")]
    NoDevice(String),
    /// The RDMA user-space libraries (`libibverbs.so.1`, `librdmacm.so.1`)
    /// could not be loaded, or lack a function this crate calls: RDMA is
    /// unavailable in this process. The text is the loader's, e.g.
    /// `libibverbs.so.1: cannot open shared object file: No such file or
    /// directory`. See [`crate::check_libraries`].
    #[error("RDMA libraries not installed ({0})")]
    LibraryUnavailable(String),
    /// `rdma_resolve_addr` failed: the address is not reachable over RDMA.
    #[error("rdma_resolve_addr to {addr} failed: {reason}")]
    AddrResolve {
        /// Destination.
        addr: SocketAddr,
        /// Event status / errno text.
        reason: String,
    },
    /// `rdma_resolve_route` failed.
    #[error("rdma_resolve_route to {addr} failed: {reason}")]
    RouteResolve {
        /// Destination.
        addr: SocketAddr,
        /// Event status / errno text.
        reason: String,
    },
    /// The peer (or its CM) rejected the connection: typically no listener on
    /// that port (`RDMA_CM_EVENT_REJECTED`), or the listener refused our
    /// parameters (then `reason` says why).
    #[error("connection rejected by {addr} (status {status}){reason}")]
    Rejected {
        /// Destination.
        addr: SocketAddr,
        /// CM reject status (IB: 8 = invalid service id, i.e. no listener; 28 = consumer reject).
        status: i32,
        /// Reason text from the peer's private data, if any.
        reason: String,
    },
    /// `RDMA_CM_EVENT_UNREACHABLE` / `CONNECT_ERROR`.
    #[error("peer {addr} unreachable (status {status})")]
    Unreachable {
        /// Destination.
        addr: SocketAddr,
        /// Event status.
        status: i32,
    },
    /// A connection-setup stage timed out.
    #[error("timeout during {stage}")]
    Timeout {
        /// "resolve_addr", "resolve_route", "connect", "accept".
        stage: &'static str,
    },
    /// A verbs / rdma_cm call failed.
    #[error("{verb} failed: {errno}")]
    Verb {
        /// The failing call.
        verb: &'static str,
        /// errno after the call.
        errno: Errno,
    },
    /// A work completion finished with an error status (e.g. retry exceeded
    /// when the peer died).
    #[error("work completion error: {status_str} (status {status}, {what})")]
    Completion {
        /// Raw `ibv_wc_status`.
        status: u32,
        /// `ibv_wc_status_str`.
        status_str: String,
        /// "recv" or "send".
        what: &'static str,
    },
    /// The peer violated the wire protocol; the connection was closed.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer disconnected (or the connection was torn down) without a
    /// clean close.
    #[error("connection lost: peer disconnected")]
    Disconnected,
    /// This half was closed locally.
    #[error("connection closed locally")]
    Closed,
    /// Message exceeds the negotiated `max_message_bytes`.
    #[error("message of {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// Message length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// Invalid [`crate::Config`].
    #[error("invalid config: {0}")]
    Config(String),
    /// A global resource limit (e.g. registered memory) would be exceeded.
    #[error("resource limit: {0}")]
    ResourceLimit(String),
}

impl Error {
    /// True when the error means "RDMA is not available for this peer" and a
    /// caller may transparently fall back to TCP: [`Error::NoDevice`],
    /// [`Error::LibraryUnavailable`],
    /// [`Error::AddrResolve`], [`Error::RouteResolve`], [`Error::Rejected`],
    /// [`Error::Unreachable`], and [`Error::Timeout`] during connection setup.
    /// Errors on an established connection (Protocol, Disconnected,
    /// Completion, ...) are not fallback reasons.
    pub fn is_unavailable_for_fallback(&self) -> bool {
        matches!(
            self,
            Error::NoDevice(_)
                | Error::LibraryUnavailable(_)
                | Error::AddrResolve { .. }
                | Error::RouteResolve { .. }
                | Error::Rejected { .. }
                | Error::Unreachable { .. }
                | Error::Timeout { .. }
        )
    }
}

impl From<Error> for std::io::Error {
    /// Maps to an `io::ErrorKind` (Disconnected → ConnectionReset,
    /// Rejected → ConnectionRefused, Timeout → TimedOut, ...), keeping the
    /// original error as the source.
    fn from(e: Error) -> std::io::Error {
        use std::io::ErrorKind as K;
        let kind = match &e {
            Error::NoDevice(_) | Error::LibraryUnavailable(_) => K::Unsupported,
            Error::AddrResolve { .. } | Error::RouteResolve { .. } | Error::Unreachable { .. } => {
                K::HostUnreachable
            }
            Error::Rejected { .. } => K::ConnectionRefused,
            Error::Timeout { .. } => K::TimedOut,
            Error::Disconnected | Error::Completion { .. } => K::ConnectionReset,
            Error::Closed => K::BrokenPipe,
            Error::Protocol(_) => K::InvalidData,
            Error::MessageTooLarge { .. } | Error::Config(_) => K::InvalidInput,
            Error::ResourceLimit(_) => K::OutOfMemory,
            Error::Verb { .. } => K::Other,
        };
        std::io::Error::new(kind, e)
    }
}
