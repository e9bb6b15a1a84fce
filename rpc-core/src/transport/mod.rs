//! What carries calls, below the client and the server: the RDMA
//! connection over rdma-transport and its listener ([`rdma`]), the
//! adjustments that make tonic's HTTP/2 path behave as the message path
//! does ([`http2`]), and the two small gRPC methods an rpc-core server's TCP
//! side adds: the RDMA port announcement ([`rdma_port`]) and, with TLS, RDMA
//! tickets ([`ticket`]), with their shared framing ([`control`]).

pub(crate) mod control;
pub(crate) mod http2;
pub(crate) mod rdma;
pub(crate) mod rdma_port;
pub(crate) mod ticket;
