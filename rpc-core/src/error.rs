//! The crate's errors: [`Error`] for connecting and serving (calls fail
//! with `tonic::Status`), and the boxed error and error-chain text shared
//! by the layers.

use crate::info::{FallbackReason, InvalidTransport, TransportKind};

/// A boxed error, as tower and tonic pass them.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An error and its sources, `: `-separated.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Errors of connecting and serving. Calls themselves fail with [`tonic::Status`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The address could not be parsed or resolved (caller's fault).
    #[error("invalid address {0}")]
    InvalidAddress(String),
    /// `RPC_TRANSPORT` holds an unknown value.
    #[error(transparent)]
    InvalidTransport(#[from] InvalidTransport),
    /// RDMA could not be used (no device, no route, no RDMA listener, timeout...).
    #[error("RDMA unavailable: {0}")]
    RdmaUnavailable(FallbackReason),
    /// A connection could not be established.
    #[error("could not connect over {transport} to {addr}: {detail}")]
    Connect {
        /// Transport tried.
        transport: TransportKind,
        /// Address tried.
        addr: String,
        /// What failed.
        detail: String,
    },
    /// The call-protocol handshake failed (peer speaks another protocol or version).
    #[error("call-protocol handshake failed: {0}")]
    Handshake(String),
    /// Binding or serving failed.
    #[error("server error: {0}")]
    Serve(String),
    /// TLS is misconfigured: an `https://` target without `tls_config`, a
    /// `tls_config` with an `http://` target, or a configuration tonic refuses.
    #[error("TLS: {0}")]
    Tls(String),
    /// An I/O error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Why this error kept a channel off RDMA, for `transport: tcp
    /// (fallback: <reason>)`.
    pub fn fallback_reason(&self) -> FallbackReason {
        match self {
            Error::RdmaUnavailable(r) => r.clone(),
            other => FallbackReason::Other(other.to_string()),
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> tonic::Status {
        match e {
            Error::InvalidAddress(_) | Error::InvalidTransport(_) | Error::Tls(_) => {
                tonic::Status::invalid_argument(e.to_string())
            }
            _ => tonic::Status::unavailable(e.to_string()),
        }
    }
}
