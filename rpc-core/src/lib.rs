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
//!
//! ## Layout
//!
//! Modules in layers, each using only those before it (no import circle):
//!
//! | module | owns |
//! |---|---|
//! | `arena` | the per-thread buffer outgoing frames are carved from |
//! | [`codec`] | the protobuf codec generated code uses (tonic-prost's, encoding into one allocation) |
//! | `hash` | the keyed hash of the maps each call looks up (calls by stream id, services by name) |
//! | `info` | what the API reports: [`Transport`], [`TransportKind`], [`TransportInfo`], [`FallbackReason`], [`ConnInfo`] |
//! | `error` | [`Error`], and the boxed error and error-chain text shared below |
//! | [`conn`] | the message-connection trait, and the in-memory connection |
//! | `protocol` | the call protocol (docs/wire-protocol.md Part 1): frames, flow-control windows as values (`flow`) and the send windows calls wait on, deadlines, the session that multiplexes calls on one connection (its stream table, a state machine without I/O, in `session/streams.rs`), [`SessionConfig`], [`RecvBody`], [`PeerMisbehaved`] |
//! | `transport` | what carries calls: the RDMA connection and listener, tonic's HTTP/2 path made to behave as the message path, the RDMA port announcement (§3) and TLS tickets (§4) |
//! | `region` | remote memory's descriptor messages, checks and typed errors, and its service path: the process's region table and the hidden `rdma_grpc.RemoteMemory` service |
//! | `client` | [`Channel`], [`Endpoint`], transport selection and fallback, one call, balancing |
//! | `server` | [`Server`], [`Router`] and serving, one call of a message connection, dispatch by name, layers, the RDMA accept loop |
//! | [`remote`] | remote memory's API ([`remote::Remote`], [`remote::Grant`]): one-sided on RDMA, the service path elsewhere (`docs/remote-memory.md`) |
#![deny(unsafe_code)]
#![warn(missing_docs)]
#![allow(missing_debug_implementations)]

mod arena;
mod client;
pub mod codec;
pub mod conn;
mod error;
mod hash;
mod info;
mod protocol;
mod region;
mod server;
mod transport;
// After `client` and `server`, whose connections it uses.
pub mod remote;

pub use client::{Channel, ChannelBuilder, Endpoint};
pub use error::Error;
pub use info::{
    ConnInfo, FallbackReason, InvalidTransport, Transport, TransportInfo, TransportKind,
    RDMA_CONNECT_TIMEOUT_ENV, TRANSPORT_ENV,
};
pub use protocol::body::RecvBody;
pub use protocol::config::SessionConfig;
pub use protocol::misbehaved::PeerMisbehaved;
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
pub use transport::rdma::MAX_RDMA_FRAME;

/// What the code `rpc_codegen` generates calls for the **direct path**: on a
/// message connection (RDMA, in-memory), a call from a generated client to a
/// generated service goes from the client's method to the service's trait
/// method without tonic's client and server machinery (`http::Request`,
/// `HeaderMap`s built and read back, tonic's body and codec buffers). The
/// user's code does not change: `build.rs` calls `rpc_codegen`, the service
/// is added with `add_service`, the client is made with `new(channel)` or
/// `connect`.
///
/// When a call takes it (otherwise the call takes tonic's path, with the
/// same bytes on the wire and the same behaviour):
///
/// | | direct path | tonic's path |
/// |---|---|---|
/// | transport | RDMA, in-memory | TCP (always), or `direct_path(false)` on the [`Channel`] or [`Server`] |
/// | call kinds | unary, server streaming | client and bidirectional streaming |
/// | client | a generated client over an [`Channel`] | interceptors (`with_interceptor`), tower layers around the channel, compression, a balanced or limited channel, stock tonic clients |
/// | server | a generated service added with `add_service` | `Server::layer`, a service wrapped in an interceptor, compression on the service or the request, stock tonic-build services, `add_routes` |
///
/// Metadata, status details, deadlines, cancellation and message size
/// limits behave as on tonic's path; handlers see the same extensions
/// (`remote_addr()`, the TLS peer's certificates, [`ConnInfo`]).
///
/// These items are public for the generated code only: their shape may
/// change with rpc_codegen's.
pub mod direct {
    pub use crate::client::generated::{Call, Client};
    pub use crate::protocol::message::{take_large, LargeField, LARGE_FIELD_MIN};
    pub use crate::server::generated::{
        counts, register, Counts, DirectFuture, Limits, Methods, ServerCall,
    };
}

/// Internals that the hostile-peer tests and the fuzz targets drive directly
/// (the call-protocol codec, a session's stream table and windows, the RDMA
/// connection wrapper). Not part of the API: no stability promise, hidden
/// from the docs.
#[doc(hidden)]
pub mod __private {
    /// The call-protocol frame codec (`docs/wire-protocol.md` §1).
    pub mod frame {
        pub use crate::protocol::frame::*;
    }
    /// A session's stream table and its flow-control windows as values
    /// (`docs/wire-protocol.md` §1.3, §1.4, §1.6).
    pub mod streams {
        pub use crate::protocol::flow::{RecvWindow, SendCredit, MAX_WINDOW};
        pub use crate::protocol::session::streams::*;
    }
    pub use crate::transport::rdma::{RdmaConnection, RdmaReceiver, RdmaSender};
}
