//! Remote memory below the public API ([`crate::remote`]): the descriptor
//! messages of `proto/rdma_grpc/remote.proto`, the checks on a descriptor,
//! the typed errors and their gRPC statuses, and the service path (TCP and
//! in-memory connections): the process's table of regions and the hidden
//! `rdma_grpc.RemoteMemory` service that reaches it. The design:
//! `docs/remote-memory.md`.

pub(crate) mod check;
pub(crate) mod error;
pub mod proto;
pub(crate) mod service;
pub(crate) mod table;
