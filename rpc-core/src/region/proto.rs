//! The messages of `proto/rdma_grpc/remote.proto` (package `rdma_grpc`),
//! written out so that rpc-core needs no build step; a test in the
//! workspace's `tests` crate checks them against the `.proto` compiled by
//! `rpc_codegen`.

/// What the peer may do with a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Access {
    /// Not set: a descriptor with it is refused.
    Unspecified = 0,
    /// The peer may read.
    Read = 1,
    /// The peer may write.
    Write = 2,
    /// The peer may read and write.
    ReadWrite = 3,
}

impl Access {
    /// The peer may read.
    pub fn reads(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }

    /// The peer may write.
    pub fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }
}

/// How the peer reaches a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Path {
    /// Not set: a descriptor with it is refused.
    Unspecified = 0,
    /// RDMA READ and WRITE on the connection's one-sided queue pair.
    OneSided = 1,
    /// The server's `rdma_grpc.RemoteMemory` service (TCP, in-memory).
    Service = 2,
}

/// Which end of the connection exposed a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Side {
    /// Not set: a descriptor with it is refused.
    Unspecified = 0,
    /// The server exposed it.
    Server = 1,
    /// The client exposed it.
    Client = 2,
}

/// A descriptor of a region (`rdma_grpc.RemoteRegion`): valid on the
/// connection it was issued on, for its length and access, until the
/// exposing side revokes it. Put it in a request or reply field.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct RemoteRegion {
    /// Bytes in the region.
    #[prost(uint64, tag = "1")]
    pub length: u64,
    /// What the peer may do ([`Access`]).
    #[prost(enumeration = "Access", tag = "2")]
    pub access: i32,
    /// How the peer reaches it ([`Path`]).
    #[prost(enumeration = "Path", tag = "3")]
    pub path: i32,
    /// Which end exposed it ([`Side`]).
    #[prost(enumeration = "Side", tag = "4")]
    pub exposed_by: i32,
    /// One-sided: the region's address at the exposing side.
    #[prost(uint64, tag = "5")]
    pub addr: u64,
    /// One-sided: the region's key.
    #[prost(uint32, tag = "6")]
    pub rkey: u32,
    /// Through the service: the region's number.
    #[prost(uint64, tag = "7")]
    pub id: u64,
    /// Through the service: the region's unguessable token.
    #[prost(fixed64, tag = "8")]
    pub token: u64,
}

/// `Read`: a range of a region the server exposed.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ReadRequest {
    /// The region.
    #[prost(message, optional, tag = "1")]
    pub region: Option<RemoteRegion>,
    /// First byte.
    #[prost(uint64, tag = "2")]
    pub offset: u64,
    /// Bytes to read.
    #[prost(uint64, tag = "3")]
    pub length: u64,
}

/// `Read`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ReadReply {
    /// The bytes read.
    #[prost(bytes = "bytes", tag = "1")]
    pub data: bytes::Bytes,
}

/// `Write`: bytes for a region the server exposed.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WriteRequest {
    /// The region.
    #[prost(message, optional, tag = "1")]
    pub region: Option<RemoteRegion>,
    /// Where the bytes go.
    #[prost(uint64, tag = "2")]
    pub offset: u64,
    /// The bytes.
    #[prost(bytes = "bytes", tag = "3")]
    pub data: bytes::Bytes,
}

/// `Write`'s answer.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct WriteReply {}

/// `Expose`: a region of the client's, kept at the server.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExposeRequest {
    /// What the server may do.
    #[prost(enumeration = "Access", tag = "1")]
    pub access: i32,
    /// The region's bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub data: bytes::Bytes,
}

/// `Expose`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExposeReply {
    /// The region's descriptor.
    #[prost(message, optional, tag = "1")]
    pub region: Option<RemoteRegion>,
}

/// `Revoke`: ends a region of the client's.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RevokeRequest {
    /// The region.
    #[prost(message, optional, tag = "1")]
    pub region: Option<RemoteRegion>,
}

/// `Revoke`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RevokeReply {
    /// The region's bytes, with the server's writes, when it was writable.
    #[prost(bytes = "bytes", tag = "1")]
    pub data: bytes::Bytes,
}
