//! # rpc-core: gRPC calls over RDMA, with TCP fallback
//!
//! Existing tonic services and tonic-generated clients run unchanged; only the
//! construction of the channel and the server changes:
//!
//! ```text
//!            tonic-generated client                      tonic-generated service
//!                    │                                            ▲
//!              rpc_core::Channel  ── tower::Service ──    rpc_core::Server (Routes)
//!               │            │                              │              │
//!     call protocol      tonic HTTP/2                 call protocol    tonic HTTP/2
//!   (docs/wire-protocol.md) (TCP fallback)                   │          (same port, TCP)
//!               │                                            │
//!        conn::Connection ── rdma-transport (verbs) ── conn::Connection
//! ```
//!
//! * [`Channel`] tries RDMA first and falls back to standard gRPC over HTTP/2
//!   on TCP, saying why ([`Channel::transport`]); [`Transport`] forces either.
//! * [`Server`] serves the same services over RDMA (rdma_cm) and over HTTP/2 on
//!   TCP at the same address and port, so stock gRPC clients reach it too.
//! * [`conn::Connection`] is the narrow message-connection trait the call
//!   protocol runs over; [`conn::mem`] is an in-memory implementation.
#![deny(unsafe_code)]
#![warn(missing_docs)]
#![allow(missing_debug_implementations)]

mod balance;
mod body;
mod client;
pub mod conn;
mod discovery;
mod dispatch;
mod endpoint;
mod frame;
mod layers;
mod misbehaved;
mod rdma;
mod server;
mod session;
mod tcp;
mod ticket;
mod timeout;
mod window;

pub use body::RecvBody;
pub use client::Channel;
pub use endpoint::{ChannelBuilder, Endpoint};
pub use misbehaved::PeerMisbehaved;
pub use rdma::MAX_RDMA_FRAME;
/// rdma-transport's settings, for [`ChannelBuilder::rdma_config`] and
/// [`Server::rdma_config`].
pub use rdma_transport::Config as RdmaConfig;
/// How an RDMA connection waits for completions ([`RdmaConfig::poll_mode`]):
/// adaptive busy-polling (the default), a fixed spin, or polling only.
pub use rdma_transport::PollMode;
pub use server::{HttpService, MemoryServer, Router, Server, ServingHandle};
/// tonic's TLS types, for [`Server::tls_config`] and [`Endpoint::tls_config`]
/// (so that `use tonic::transport::{Server, ServerTlsConfig, Identity}`
/// becomes `use rpc_core::{..}` with the same names).
#[cfg(feature = "tls")]
pub use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
/// An endpoint change of a balanced channel's discovery stream
/// ([`Channel::balance_channel`], [`Channel::balance_discover`]): tower's.
pub use tower::discover::Change;

/// Internals that the hostile-peer tests and the fuzz targets drive directly
/// (the call-protocol codec, the RDMA connection wrapper). Not part of the
/// API: no stability promise, hidden from the docs.
#[doc(hidden)]
pub mod __private {
    /// The call-protocol frame codec (`docs/wire-protocol.md` §1).
    pub mod frame {
        pub use crate::frame::*;
    }
    pub use crate::rdma::{RdmaConnection, RdmaReceiver, RdmaSender};
}

use std::fmt;
use std::time::Duration;

/// Transport policy of a [`Channel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// RDMA when it works, else standard gRPC over TCP (the default).
    #[default]
    Auto,
    /// RDMA or fail with `Unavailable`; never falls back.
    RdmaOnly,
    /// Standard gRPC over HTTP/2 on TCP only.
    TcpOnly,
}

/// Environment variable operators set to force a transport: `auto`, `rdma`, `tcp`.
pub const TRANSPORT_ENV: &str = "RPC_TRANSPORT";

/// Environment variable: default RDMA connection-setup timeout of channels, in
/// milliseconds (default 2000), before they fall back to TCP.
pub const RDMA_CONNECT_TIMEOUT_ENV: &str = "RPC_RDMA_CONNECT_TIMEOUT_MS";

impl Transport {
    /// The policy from [`TRANSPORT_ENV`]; `Auto` when unset.
    pub fn from_env() -> Result<Transport, Error> {
        match std::env::var(TRANSPORT_ENV) {
            Err(_) => Ok(Transport::Auto),
            Ok(v) => v.parse(),
        }
    }
}

impl std::str::FromStr for Transport {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Transport::Auto),
            "rdma" | "rdma-only" | "rdmaonly" => Ok(Transport::RdmaOnly),
            "tcp" | "tcp-only" | "tcponly" => Ok(Transport::TcpOnly),
            other => Err(Error::InvalidTransport(other.to_string())),
        }
    }
}

/// What carries a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// Verbs over rdma-transport.
    Rdma,
    /// Standard gRPC over HTTP/2 on TCP.
    Tcp,
    /// The in-memory connection ([`conn::mem`]).
    Memory,
    /// A balanced channel: each endpoint has its own (see
    /// [`TransportInfo::endpoints`]). Never the transport of a connection.
    Balanced,
    /// A lazy channel that has not connected yet.
    NotConnected,
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportKind::Rdma => "rdma",
            TransportKind::Tcp => "tcp",
            TransportKind::Memory => "memory",
            TransportKind::Balanced => "balanced",
            TransportKind::NotConnected => "not connected",
        })
    }
}

/// The transport a [`Channel`] uses and, if it fell back to TCP, why.
/// Displays as `rdma`, `tcp` or `tcp (fallback: <reason>)`; a balanced
/// channel as `balanced [10.0.0.5:50051: rdma, 10.0.0.6:50051: tcp (fallback: ...)]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportInfo {
    /// The transport in use.
    pub kind: TransportKind,
    /// Why RDMA was not used, when the policy was [`Transport::Auto`].
    pub fallback_reason: Option<String>,
    /// A balanced channel's endpoints (address, transport), in address
    /// order; empty otherwise.
    pub endpoints: Vec<(String, TransportInfo)>,
}

impl TransportInfo {
    pub(crate) fn of(kind: TransportKind, fallback_reason: Option<String>) -> TransportInfo {
        TransportInfo {
            kind,
            fallback_reason,
            endpoints: Vec::new(),
        }
    }

    pub(crate) fn not_connected(_addr: &str) -> TransportInfo {
        TransportInfo::of(TransportKind::NotConnected, None)
    }
}

impl fmt::Display for TransportInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.kind == TransportKind::Balanced {
            f.write_str("balanced [")?;
            for (i, (addr, t)) in self.endpoints.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{addr}: {t}")?;
            }
            return f.write_str("]");
        }
        match &self.fallback_reason {
            Some(r) => write!(f, "{} (fallback: {r})", self.kind),
            None => write!(f, "{}", self.kind),
        }
    }
}

/// Connection details the server adds to each request's extensions (for
/// interceptors: `req.extensions().get::<ConnInfo>()`), and the client to
/// each response. On message connections the server also adds what tonic's
/// HTTP/2 server adds, so `request.remote_addr()`, `local_addr()` and
/// `peer_certs()` answer as over TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnInfo {
    /// Transport of the connection.
    pub transport: TransportKind,
    /// The peer's address, when it has one (RDMA: its IP and rdma_cm port).
    pub peer: Option<std::net::SocketAddr>,
    /// This side's address of the connection, when it has one.
    pub local: Option<std::net::SocketAddr>,
    /// The TLS identity an RDMA connection was admitted with.
    pub(crate) tls: Option<ticket::TlsPeer>,
}

impl ConnInfo {
    /// Details of a connection over `transport` with `peer` (e.g. for
    /// [`Router::serve_connection`]).
    pub fn new(transport: TransportKind, peer: Option<std::net::SocketAddr>) -> ConnInfo {
        ConnInfo {
            transport,
            peer,
            local: None,
            tls: None,
        }
    }

    /// The same, with this side's address.
    pub fn with_local(mut self, local: Option<std::net::SocketAddr>) -> ConnInfo {
        self.local = local;
        self
    }
}

/// Limits of the call protocol on one message connection (`docs/wire-protocol.md` §1.5).
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Calls this side accepts at once on one connection (default 2048).
    pub max_concurrent_calls: u32,
    /// DATA bytes per call the peer may send before credit returns (default 4 MiB).
    pub initial_window: u32,
    /// DATA bytes the peer may send on the whole connection before credit
    /// returns (default 32 MiB): bounds what a connection can make this side buffer.
    pub connection_window: u32,
    /// Largest metadata block (names + values) accepted in one frame (default 16 KiB).
    pub max_metadata_bytes: u32,
    /// Largest DATA payload per frame sent (default 1 MiB minus the 6-byte
    /// frame header, so that a full DATA frame is exactly 1 MiB: four whole
    /// rendezvous buffers of rdma-transport's default 256 KiB, not five).
    pub max_data_frame: usize,
    /// Time allowed for the HELLO exchange (default 5 s).
    pub handshake_timeout: Duration,
    /// Small frames queued together are sent as one connection message of at
    /// most this many bytes (BATCH, §1.7; default 4 KiB, which keeps a batch
    /// under rdma-transport's default eager limit). 0 disables batching.
    pub max_batch_bytes: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            max_concurrent_calls: 2048,
            initial_window: 4 << 20,
            connection_window: 32 << 20,
            max_metadata_bytes: 16 << 10,
            max_data_frame: (1 << 20) - frame::HEADER_LEN,
            handshake_timeout: Duration::from_secs(5),
            max_batch_bytes: 4096,
        }
    }
}

/// Errors of connecting and serving. Calls themselves fail with [`tonic::Status`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The address could not be parsed or resolved (caller's fault).
    #[error("invalid address {0}")]
    InvalidAddress(String),
    /// `RPC_TRANSPORT` holds an unknown value.
    #[error("invalid transport {0:?} in {TRANSPORT_ENV}: expected auto, rdma or tcp")]
    InvalidTransport(String),
    /// RDMA could not be used (no device, no route, no RDMA listener, timeout...).
    #[error("RDMA unavailable: {0}")]
    RdmaUnavailable(String),
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
    /// A short reason suitable for `transport: tcp (fallback: <reason>)`.
    pub fn fallback_reason(&self) -> String {
        match self {
            Error::RdmaUnavailable(r) => r.clone(),
            other => other.to_string(),
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
