//! Remote memory: a service hands out regions of its memory that the
//! client reads and writes one-sided, and the client hands out regions the
//! server writes into (`docs/remote-memory.md`).
//!
//! A region is exposed on one connection, to its peer only, and described
//! by a [`RemoteRegion`] (`rdma_grpc.RemoteRegion` in
//! `proto/rdma_grpc/remote.proto`), a message to put in a request or reply
//! field. The peer reads and writes it with [`Remote::read`] and
//! [`Remote::write`]; the exposing side ends the peer's access by
//! revoking (or dropping) the [`Grant`], which gives the memory back with
//! the peer's writes in it.
//!
//! ```no_run
//! use rpc_core::remote::{Access, Remote};
//! # async fn get(request: tonic::Request<()>) -> Result<(), tonic::Status> {
//! // In a handler: expose a blob to the calling client for reading.
//! let blob = bytes::Bytes::from(vec![7u8; 1 << 20]);
//! let grant = Remote::of_request(&request)?.expose(blob, Access::Read).await?;
//! let descriptor = grant.region(); // goes into the reply
//! # Ok(()) }
//! # async fn fetch(channel: rpc_core::Channel, region: rpc_core::remote::RemoteRegion)
//! # -> Result<(), tonic::Status> {
//! // In the client: read it.
//! let bytes = Remote::of_channel(&channel).await?.read(&region, 0, region.length).await?;
//! # Ok(()) }
//! ```
//!
//! The same code runs on every transport: over TCP and in-memory
//! connections the operations go through the server's hidden
//! `rdma_grpc.RemoteMemory` service, with the same checks and errors.
//!
//! Errors are gRPC statuses: `NOT_FOUND` (revoked, or unknown), and
//! `PERMISSION_DENIED` (exposed on another connection, or an access the
//! region does not allow), `OUT_OF_RANGE`, `INVALID_ARGUMENT` (a malformed
//! descriptor), `FAILED_PRECONDITION` (one's own region, or a descriptor
//! for another path), `RESOURCE_EXHAUSTED` (over the cap on exposed
//! bytes), `UNIMPLEMENTED` (a balanced or limited channel).

use bytes::Bytes;
use tonic::Status;

use crate::client::RemoteTarget;
use crate::region::check::{check, path_name, Op};
use crate::region::error::RegionError;
use crate::region::proto::{
    ExposeReply, ExposeRequest, Path, ReadReply, ReadRequest, RevokeReply, RevokeRequest, Side,
    WriteReply, WriteRequest,
};
use crate::region::service::{conn_key, EXPOSE, MAX_MESSAGE, READ, REVOKE, WRITE};
use crate::region::table::{table, ConnKey};
use crate::Channel;

pub use crate::region::proto::{Access, RemoteRegion};
pub use crate::region::table::Exposable;

/// The messages of `proto/rdma_grpc/remote.proto` (`extern_path` target of
/// the `.rdma_grpc` package).
pub mod proto {
    pub use crate::region::proto::*;
}

/// Bytes the service path holds now for regions exposed on TCP and
/// in-memory connections, in this process (a server's own regions and the
/// copies of its clients' regions), and how many regions.
pub fn service_path_usage() -> (usize, usize) {
    table().usage()
}

/// One connection's peer, for remote memory: from a handler's request
/// ([`Remote::of_request`]) or a client's channel ([`Remote::of_channel`]).
#[derive(Clone)]
pub struct Remote {
    /// This end of the connection.
    side: Side,
    how: How,
}

#[derive(Clone)]
enum How {
    /// The server, on a connection without one-sided access: the regions
    /// of both sides are in the process's table.
    Table(ConnKey),
    /// The client, on a connection without one-sided access: through the
    /// server's service.
    Service(Channel),
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("side", &self.side)
            .field(
                "path",
                &match self.how {
                    How::Table(_) | How::Service(_) => "service",
                },
            )
            .finish()
    }
}

impl Remote {
    /// The client of the connection `request` came on (in a handler, on
    /// any transport).
    ///
    /// # Errors
    ///
    /// `UNAVAILABLE` when the request carries no connection (not a request
    /// an rpc-core server received, or one served over an incoming stream
    /// that reports no addresses).
    pub fn of_request<T>(request: &tonic::Request<T>) -> Result<Remote, Status> {
        let conn = conn_key(request).ok_or_else(|| {
            Status::unavailable(
                "remote memory: the request carries no connection (it did not come through an \
                 rpc-core server, or its incoming stream reports no addresses)",
            )
        })?;
        Ok(Remote {
            side: Side::Server,
            how: How::Table(conn),
        })
    }

    /// The server at the other end of `channel`'s connection (connecting a
    /// lazy channel). Regions exposed through it are valid on that
    /// connection only: after the channel reconnects, the server's
    /// descriptors must be asked for again.
    ///
    /// # Errors
    ///
    /// `UNIMPLEMENTED` for a balanced channel or one with a concurrency or
    /// rate limit (no single connection); the connection's error when a
    /// lazy channel cannot connect.
    pub async fn of_channel(channel: &Channel) -> Result<Remote, Status> {
        match channel.remote_target().await? {
            RemoteTarget::Tcp | RemoteTarget::Msg => Ok(Remote {
                side: Side::Client,
                how: How::Service(channel.clone()),
            }),
        }
    }

    /// Exposes `buf` to the peer with `access` until the returned grant is
    /// revoked or dropped. A shared [`Bytes`] may be exposed for reading
    /// only; a `BytesMut` (or `Vec<u8>`) for any access, and nobody sees
    /// it until [`Grant::revoke`] gives it back.
    ///
    /// # Errors
    ///
    /// `INVALID_ARGUMENT` for shared bytes exposed for writing or an unset
    /// access, `RESOURCE_EXHAUSTED` over the caps on exposed bytes (per
    /// connection and per process).
    pub async fn expose(&self, buf: impl Into<Exposable>, access: Access) -> Result<Grant, Status> {
        let buf = buf.into();
        if access == Access::Unspecified {
            return Err(RegionError::Invalid("access not set").into());
        }
        if access.writes() && matches!(buf, Exposable::Shared(_)) {
            return Err(RegionError::SharedNotWritable.into());
        }
        match &self.how {
            How::Table(conn) => {
                let region = table().insert(*conn, self.side, access, buf)?;
                Ok(Grant {
                    region,
                    how: GrantHow::Table,
                })
            }
            How::Service(ch) => {
                let data = match &buf {
                    Exposable::Shared(b) => b.clone(),
                    Exposable::Owned(b) => Bytes::copy_from_slice(b),
                };
                let reply: ExposeReply = call(
                    ch,
                    EXPOSE,
                    ExposeRequest {
                        access: access as i32,
                        data,
                    },
                )
                .await?;
                let region = reply
                    .region
                    .ok_or_else(|| Status::internal("remote memory: Expose answered no region"))?;
                Ok(Grant {
                    region,
                    how: GrantHow::Mirror {
                        channel: ch.clone(),
                        original: Some(buf),
                    },
                })
            }
        }
    }

    /// Reads `len` bytes at `offset` of the peer's `region`.
    ///
    /// # Errors
    ///
    /// As the [module](self) says: `NOT_FOUND`, `PERMISSION_DENIED`,
    /// `OUT_OF_RANGE`, `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, or the
    /// connection's error.
    pub async fn read(
        &self,
        region: &RemoteRegion,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, Status> {
        let p = check(region, self.side, Op::Read, offset, len)?;
        self.path_is(p.path)?;
        match &self.how {
            How::Table(conn) => Ok(table().read(*conn, region, offset, len)?),
            How::Service(ch) => {
                let reply: ReadReply = call(
                    ch,
                    READ,
                    ReadRequest {
                        region: Some(*region),
                        offset,
                        length: len,
                    },
                )
                .await?;
                if reply.data.len() as u64 != len {
                    return Err(Status::internal(format!(
                        "remote memory: the server returned {} bytes for a read of {len}",
                        reply.data.len()
                    )));
                }
                Ok(reply.data)
            }
        }
    }

    /// Writes `data` at `offset` of the peer's `region`.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    pub async fn write(
        &self,
        region: &RemoteRegion,
        offset: u64,
        data: impl Into<Bytes>,
    ) -> Result<(), Status> {
        let data = data.into();
        let p = check(region, self.side, Op::Write, offset, data.len() as u64)?;
        self.path_is(p.path)?;
        match &self.how {
            How::Table(conn) => Ok(table().write(*conn, region, offset, &data)?),
            How::Service(ch) => {
                let _: WriteReply = call(
                    ch,
                    WRITE,
                    WriteRequest {
                        region: Some(*region),
                        offset,
                        data,
                    },
                )
                .await?;
                Ok(())
            }
        }
    }

    /// The path this connection offers is the descriptor's.
    fn path_is(&self, descriptor: Path) -> Result<(), RegionError> {
        let ours = match self.how {
            How::Table(_) | How::Service(_) => Path::Service,
        };
        if descriptor != ours {
            return Err(RegionError::WrongPath {
                descriptor: path_name(descriptor),
                connection: path_name(ours),
            });
        }
        Ok(())
    }
}

/// A region exposed to the peer: [`region`](Grant::region) is its
/// descriptor; [`revoke`](Grant::revoke) ends the peer's access and gives
/// the memory back. Dropping it also ends the access (the memory is then
/// freed).
pub struct Grant {
    region: RemoteRegion,
    how: GrantHow,
}

enum GrantHow {
    /// In the process's table (a server's region on the service path).
    Table,
    /// Kept at the server (a client's region on the service path); the
    /// client keeps its own buffer.
    Mirror {
        channel: Channel,
        original: Option<Exposable>,
    },
    /// Revoked.
    Done,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

impl Grant {
    /// The descriptor to hand to the peer (in a request or reply field).
    pub fn region(&self) -> RemoteRegion {
        self.region
    }

    /// Ends the peer's access and gives the memory back, with what the
    /// peer wrote into it. After it returns, the peer can neither read nor
    /// write the memory.
    ///
    /// # Errors
    ///
    /// On the service path a client's region is taken back from the
    /// server: that call's error (the connection's, or `NOT_FOUND` when the
    /// connection it was exposed on has ended). The server has then
    /// already dropped its copy.
    pub async fn revoke(mut self) -> Result<Exposable, Status> {
        match std::mem::replace(&mut self.how, GrantHow::Done) {
            GrantHow::Table => table()
                .remove_id(self.region.id)
                .ok_or_else(|| RegionError::NotFound.into()),
            GrantHow::Mirror { channel, original } => {
                let original = original.expect("a live mirror grant holds its buffer");
                let reply: RevokeReply = call(
                    &channel,
                    REVOKE,
                    RevokeRequest {
                        region: Some(self.region),
                    },
                )
                .await?;
                match original {
                    Exposable::Owned(mut b) if self.access().writes() => {
                        if reply.data.len() != b.len() {
                            return Err(Status::internal(format!(
                                "remote memory: the server returned {} bytes for a region of {}",
                                reply.data.len(),
                                b.len()
                            )));
                        }
                        b.copy_from_slice(&reply.data);
                        Ok(Exposable::Owned(b))
                    }
                    o => Ok(o),
                }
            }
            GrantHow::Done => Err(RegionError::NotFound.into()),
        }
    }

    fn access(&self) -> Access {
        Access::try_from(self.region.access).unwrap_or(Access::Unspecified)
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.how, GrantHow::Done) {
            GrantHow::Table => {
                table().remove_id(self.region.id);
            }
            GrantHow::Mirror { channel, .. } => {
                // Take the server's copy back in the background; without a
                // runtime it goes with the connection.
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    let region = self.region;
                    rt.spawn(async move {
                        let r: Result<RevokeReply, Status> = call(
                            &channel,
                            REVOKE,
                            RevokeRequest {
                                region: Some(region),
                            },
                        )
                        .await;
                        if let Err(e) = r {
                            tracing::debug!(error = %e.message(), "dropped region not revoked at the server");
                        }
                    });
                }
            }
            GrantHow::Done => {}
        }
    }
}

/// One call of the service path.
async fn call<Req, Rep>(ch: &Channel, path: &'static str, req: Req) -> Result<Rep, Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Rep: prost::Message + Default + Send + Sync + 'static,
{
    let mut g = tonic::client::Grpc::new(ch.clone())
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    g.ready()
        .await
        .map_err(|e| Status::unavailable(format!("remote memory: {e}")))?;
    let r = g
        .unary(
            tonic::Request::new(req),
            http::uri::PathAndQuery::from_static(path),
            tonic_prost::ProstCodec::<Req, Rep>::default(),
        )
        .await?;
    Ok(r.into_inner())
}
