//! What the API reports about transports and connections: the policy a
//! channel follows ([`Transport`]), what carries a connection
//! ([`TransportKind`]), what a channel uses and why ([`TransportInfo`]), and
//! the per-connection details handlers see ([`ConnInfo`]).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

/// Transport policy of a [`Channel`](crate::Channel).
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

/// A transport policy that is none of `auto`, `rdma`, `tcp` (e.g. in
/// [`TRANSPORT_ENV`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid transport {0:?} in {TRANSPORT_ENV}: expected auto, rdma or tcp")]
pub struct InvalidTransport(pub String);

/// Why a channel does not use RDMA (or an RDMA connection attempt failed):
/// [`TransportInfo::fallback_reason`](crate::TransportInfo::fallback_reason)
/// and [`Error::RdmaUnavailable`](crate::Error::RdmaUnavailable). Displays as a sentence an operator can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FallbackReason {
    /// libibverbs or librdmacm is not installed (the loader's message).
    LibrariesMissing(String),
    /// This host has no RDMA device.
    NoDevice,
    /// The RDMA device list could not be read.
    DeviceQuery(String),
    /// The address has no RDMA route from this host.
    Unreachable {
        /// Address tried.
        addr: SocketAddr,
        /// What rdma_cm reported.
        detail: String,
    },
    /// The peer has no RDMA listener there, or refused the connection.
    Refused {
        /// Address tried.
        addr: SocketAddr,
        /// What the peer or rdma_cm said.
        detail: String,
    },
    /// RDMA connection setup timed out.
    Timeout {
        /// Address tried.
        addr: SocketAddr,
        /// The setup stage that timed out.
        stage: String,
    },
    /// A TLS server gave no RDMA ticket over the TLS connection
    /// (`docs/wire-protocol.md` §4).
    NoTicket {
        /// Address of the RDMA attempt.
        addr: SocketAddr,
        /// Why.
        detail: String,
    },
    /// The RDMA connection came up but the call-protocol handshake failed.
    Handshake {
        /// Address tried.
        addr: SocketAddr,
        /// Why.
        detail: String,
    },
    /// Another RDMA failure.
    Failed {
        /// Address tried.
        addr: SocketAddr,
        /// What failed.
        detail: String,
    },
    /// RDMA also failed at the port the server announced for it (iWARP,
    /// `docs/wire-protocol.md` §3).
    AnnouncedPort {
        /// The announced port.
        port: u16,
        /// Why it failed there.
        reason: Box<FallbackReason>,
    },
    /// Something other than RDMA setup (e.g. the address did not resolve).
    Other(String),
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use FallbackReason as R;
        match self {
            R::LibrariesMissing(m) => f.write_str(m),
            R::NoDevice => f.write_str("no RDMA device on this host"),
            R::DeviceQuery(m) => write!(f, "RDMA devices could not be listed ({m})"),
            R::Unreachable { addr, detail } => {
                write!(f, "{addr} is not reachable over RDMA ({detail})")
            }
            R::Refused { addr, detail } => {
                write!(f, "peer {addr} does not accept RDMA connections ({detail})")
            }
            R::Timeout { addr, stage } => {
                write!(
                    f,
                    "RDMA connection setup to {addr} timed out during {stage}"
                )
            }
            R::NoTicket { addr, detail } => {
                write!(f, "no RDMA ticket for {addr} over TLS: {detail}")
            }
            R::Handshake { addr, detail } => {
                write!(
                    f,
                    "RDMA connection to {addr} failed its handshake: {detail}"
                )
            }
            R::Failed { addr, detail } => write!(f, "RDMA connection to {addr} failed: {detail}"),
            R::AnnouncedPort { port, reason } => {
                write!(f, "{reason} (the server's RDMA listener is on port {port})")
            }
            R::Other(m) => f.write_str(m),
        }
    }
}

/// Environment variable operators set to force a transport: `auto`, `rdma`, `tcp`.
pub const TRANSPORT_ENV: &str = "RPC_TRANSPORT";

/// Environment variable: default RDMA connection-setup timeout of channels, in
/// milliseconds (default 2000), before they fall back to TCP.
pub const RDMA_CONNECT_TIMEOUT_ENV: &str = "RPC_RDMA_CONNECT_TIMEOUT_MS";

impl Transport {
    /// The policy from [`TRANSPORT_ENV`]; `Auto` when unset.
    ///
    /// # Errors
    ///
    /// [`InvalidTransport`] if the variable holds something else.
    pub fn from_env() -> Result<Transport, InvalidTransport> {
        match std::env::var(TRANSPORT_ENV) {
            Err(_) => Ok(Transport::Auto),
            Ok(v) => v.parse(),
        }
    }
}

impl std::str::FromStr for Transport {
    type Err = InvalidTransport;
    fn from_str(s: &str) -> Result<Self, InvalidTransport> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Transport::Auto),
            "rdma" | "rdma-only" | "rdmaonly" => Ok(Transport::RdmaOnly),
            "tcp" | "tcp-only" | "tcponly" => Ok(Transport::TcpOnly),
            other => Err(InvalidTransport(other.to_string())),
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
    /// The in-memory connection ([`conn::mem`](crate::conn::mem)).
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

/// The transport a [`Channel`](crate::Channel) uses and, if it fell back to TCP, why.
/// Displays as `rdma`, `tcp` or `tcp (fallback: <reason>)`; a balanced
/// channel as `balanced [10.0.0.5:50051: rdma, 10.0.0.6:50051: tcp (fallback: ...)]`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportInfo {
    /// The transport in use.
    pub kind: TransportKind,
    /// Why RDMA was not used, when the policy was [`Transport::Auto`].
    pub fallback_reason: Option<FallbackReason>,
    /// A balanced channel's endpoints (address, transport), in address
    /// order; empty otherwise.
    pub endpoints: Vec<(String, TransportInfo)>,
}

impl TransportInfo {
    pub(crate) fn of(
        kind: TransportKind,
        fallback_reason: Option<FallbackReason>,
    ) -> TransportInfo {
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
    pub(crate) tls: Option<TlsPeer>,
    /// The connection's process-wide number (0: not a session's yet), for
    /// the regions exposed on it (`crate::remote`).
    pub(crate) id: u64,
    /// An RDMA connection's one-sided access (`crate::remote`).
    pub(crate) one_sided: Option<OneSided>,
}

/// An RDMA connection's one-sided access: part of what a connection
/// offers, not of its identity (every two compare equal).
#[derive(Clone, Debug)]
pub(crate) struct OneSided(pub(crate) rdma_transport::RemoteMemory);

impl PartialEq for OneSided {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for OneSided {}

/// A new connection number for [`ConnInfo`] (never 0).
pub(crate) fn next_conn_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl ConnInfo {
    /// Details of a connection over `transport` with `peer` (e.g. for
    /// [`Router::serve_connection`](crate::Router::serve_connection)).
    pub fn new(transport: TransportKind, peer: Option<std::net::SocketAddr>) -> ConnInfo {
        ConnInfo {
            transport,
            peer,
            local: None,
            tls: None,
            id: 0,
            one_sided: None,
        }
    }

    /// The same, with this side's address.
    pub fn with_local(mut self, local: Option<std::net::SocketAddr>) -> ConnInfo {
        self.local = local;
        self
    }
}

/// What TLS said about the peer an RDMA connection was admitted for
/// (tonic's connection info of its TLS connection: the certificates).
#[cfg(feature = "tls")]
pub(crate) type PeerTls =
    tonic::transport::server::TlsConnectInfo<tonic::transport::server::TcpConnectInfo>;
/// Without the `tls` feature there is nothing to carry.
#[cfg(not(feature = "tls"))]
pub(crate) type PeerTls = ();

/// The TLS identity an RDMA connection was admitted with, shared by its calls.
#[derive(Clone)]
pub(crate) struct TlsPeer(pub(crate) Arc<PeerTls>);

impl fmt::Debug for TlsPeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TlsPeer")
    }
}

impl PartialEq for TlsPeer {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for TlsPeer {}
