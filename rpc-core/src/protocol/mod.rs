//! The call protocol (`docs/wire-protocol.md` Part 1): gRPC calls over any
//! reliable, ordered message connection ([`crate::conn::Connection`]),
//! without HTTP/2. This module owns the frame codec, the flow-control
//! windows, the session that multiplexes calls on one connection, and the
//! body a received call's messages are read from; it knows nothing of
//! RDMA, TCP, channels or servers.

pub(crate) mod body;
pub(crate) mod config;
pub(crate) mod flow;
pub(crate) mod frame;
pub(crate) mod message;
pub(crate) mod misbehaved;
pub(crate) mod session;
pub(crate) mod timeout;
pub(crate) mod window;
