//! Violations of the call protocol (`docs/wire-protocol.md` part 1) by the
//! peer, as values: one variant per rule, with the numbers that broke it (in
//! the spirit of rustls' `PeerMisbehaved` and rdma-transport's own).
//!
//! Each one closes the connection: the peer gets a GOAWAY with
//! [`PeerMisbehaved::code`] and the error's text, the calls on the connection
//! fail with a [`tonic::Status`] whose `source()` is the [`PeerMisbehaved`],
//! and a server reports it to the hook set with
//! [`Server::on_peer_misbehaved`](crate::Server::on_peer_misbehaved).

use crate::protocol::frame::FrameError;
use tonic::Code;

/// A call-protocol violation by the peer; the connection is closed with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerMisbehaved {
    /// A frame could not be decoded (§1.2–§1.4, §1.7).
    #[error("malformed frame: {0}")]
    Malformed(#[source] FrameError),
    /// A frame's metadata exceeds the limit this side advertised in HELLO (§1.5).
    #[error("peer sent metadata of {got} bytes, over the limit of {limit} bytes")]
    MetadataTooLarge {
        /// Bytes the frame carries (or so far).
        got: usize,
        /// This side's `max_metadata_bytes`.
        limit: usize,
    },
    /// The first frame is not HELLO (§1.1); `kind` is the frame type received.
    #[error("expected HELLO, got frame type {kind:#04x}")]
    ExpectedHello {
        /// Frame type byte.
        kind: u8,
    },
    /// The peer speaks another call-protocol version (§1.1).
    #[error("peer speaks call-protocol version {peer}, this side {ours}")]
    VersionMismatch {
        /// The peer's version.
        peer: u16,
        /// [`PROTOCOL_VERSION`](crate::protocol::frame::PROTOCOL_VERSION).
        ours: u16,
    },
    /// A HELLO after the handshake (§1.1).
    #[error("second HELLO")]
    SecondHello,
    /// The server sent OPEN to the client (§1.3: only clients open calls).
    #[error("OPEN sent to a client")]
    OpenToClient,
    /// OPEN with a call id not above the last one the peer opened (§1.3).
    #[error("OPEN with stream id {stream} not above {last} (ids must increase)")]
    StreamIdNotIncreasing {
        /// The id received.
        stream: u32,
        /// The highest id the peer opened before.
        last: u32,
    },
    /// OPEN with an even call id (§1.3: client ids are odd).
    #[error("OPEN with even stream id {stream} (client ids are odd)")]
    StreamIdEven {
        /// The id received.
        stream: u32,
    },
    /// DATA beyond the connection's receive window (§1.4).
    #[error("DATA exceeds the connection's flow-control window by {excess} bytes")]
    ConnectionWindowExceeded {
        /// Bytes over the window.
        excess: u64,
    },
    /// DATA beyond one call's receive window (§1.4).
    #[error("DATA on stream {stream} exceeds the flow-control window by {excess} bytes")]
    StreamWindowExceeded {
        /// Call id (0 never appears here).
        stream: u32,
        /// Bytes over the window.
        excess: u64,
    },
    /// A WINDOW_UPDATE that would take a send window past 2^31 - 1 (§1.4).
    #[error(
        "WINDOW_UPDATE of {increment} on stream {stream} overflows the window ({window} + {increment})"
    )]
    WindowOverflow {
        /// Call id; 0 = the connection's window.
        stream: u32,
        /// The window before the update.
        window: i64,
        /// The increment received.
        increment: u32,
    },
}

impl PeerMisbehaved {
    /// The gRPC status code this violation is reported with (in GOAWAY and to
    /// the calls it ends): `ResourceExhausted` for metadata over the limit,
    /// `Unavailable` for a handshake the two sides cannot complete (another
    /// protocol or version), `Internal` for the rest.
    pub fn code(&self) -> Code {
        match self {
            PeerMisbehaved::MetadataTooLarge { .. } => Code::ResourceExhausted,
            PeerMisbehaved::ExpectedHello { .. } | PeerMisbehaved::VersionMismatch { .. } => {
                Code::Unavailable
            }
            _ => Code::Internal,
        }
    }
}

impl From<FrameError> for PeerMisbehaved {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::MetadataTooLarge { got, limit } => {
                PeerMisbehaved::MetadataTooLarge { got, limit }
            }
            other => PeerMisbehaved::Malformed(other),
        }
    }
}
