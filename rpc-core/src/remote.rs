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
    /// An RDMA connection whose peer offers one-sided access.
    one_sided: Option<rdma_transport::RemoteMemory>,
    service: Service,
}

/// The service path of a connection.
#[derive(Clone)]
enum Service {
    /// The server: the regions of both sides are in the process's table.
    Table(ConnKey),
    /// The client: through the server's service.
    Channel(Channel),
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("side", &self.side)
            .field("one_sided", &self.one_sided.is_some())
            .finish()
    }
}

/// The one-sided access of a connection, where its peer offers it.
fn one_sided_of(info: Option<&crate::ConnInfo>) -> Option<rdma_transport::RemoteMemory> {
    info.and_then(|i| i.one_sided.as_ref())
        .map(|o| o.0.clone())
        .filter(|m| m.is_available())
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
            one_sided: one_sided_of(request.extensions().get::<crate::ConnInfo>()),
            service: Service::Table(conn),
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
        let one_sided = match channel.remote_target().await? {
            RemoteTarget::Tcp => None,
            RemoteTarget::Msg(info) => one_sided_of(Some(&info)),
        };
        Ok(Remote {
            side: Side::Client,
            one_sided,
            service: Service::Channel(channel.clone()),
        })
    }

    /// Whether this connection reads and writes regions one-sided (RDMA
    /// READ and WRITE, no handler at the exposing side), rather than
    /// through the server's service.
    pub fn is_one_sided(&self) -> bool {
        self.one_sided.is_some()
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
    /// connection and per process; on RDMA also the cap on registered
    /// memory).
    pub async fn expose(&self, buf: impl Into<Exposable>, access: Access) -> Result<Grant, Status> {
        let buf = buf.into();
        if access == Access::Unspecified {
            return Err(RegionError::Invalid("access not set").into());
        }
        if access.writes() && matches!(buf, Exposable::Shared(_)) {
            return Err(RegionError::SharedNotWritable.into());
        }
        // An empty region has nothing to register: the service path keeps it.
        if let Some(m) = self.one_sided.as_ref().filter(|_| !buf.is_empty()) {
            let e = m
                .expose(to_transport(buf), rdma_access(access))
                .await
                .map_err(status_of)?;
            let k = e.key();
            return Ok(Grant {
                region: RemoteRegion {
                    length: k.len,
                    access: access as i32,
                    path: Path::OneSided as i32,
                    exposed_by: self.side as i32,
                    addr: k.addr,
                    rkey: k.rkey,
                    id: 0,
                    token: 0,
                },
                how: GrantHow::OneSided(e),
            });
        }
        match &self.service {
            Service::Table(conn) => {
                let region = table().insert(*conn, self.side, access, buf)?;
                Ok(Grant {
                    region,
                    how: GrantHow::Table,
                })
            }
            Service::Channel(ch) => {
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
        if p.path == Path::OneSided {
            let m = self.one_sided_for(p.path)?;
            let len = usize::try_from(len).map_err(|_| {
                Status::out_of_range(format!("remote memory: a read of {len} bytes"))
            })?;
            return m
                .read(&rdma_key(region, p.access), offset, len)
                .await
                .map_err(status_of);
        }
        match &self.service {
            Service::Table(conn) => Ok(table().read(*conn, region, offset, len)?),
            Service::Channel(ch) => {
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
        if p.path == Path::OneSided {
            let m = self.one_sided_for(p.path)?;
            return m
                .write(&rdma_key(region, p.access), offset, data)
                .await
                .map_err(status_of);
        }
        match &self.service {
            Service::Table(conn) => Ok(table().write(*conn, region, offset, &data)?),
            Service::Channel(ch) => {
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

    /// The one-sided access a one-sided descriptor needs.
    fn one_sided_for(&self, descriptor: Path) -> Result<&rdma_transport::RemoteMemory, Status> {
        self.one_sided.as_ref().ok_or_else(|| {
            RegionError::WrongPath {
                descriptor: path_name(descriptor),
                connection: path_name(Path::Service),
            }
            .into()
        })
    }
}

fn rdma_access(a: Access) -> rdma_transport::RemoteAccess {
    match a {
        Access::Write => rdma_transport::RemoteAccess::Write,
        Access::ReadWrite => rdma_transport::RemoteAccess::ReadWrite,
        Access::Read | Access::Unspecified => rdma_transport::RemoteAccess::Read,
    }
}

/// The transport's key of a one-sided descriptor (already checked).
fn rdma_key(r: &RemoteRegion, access: Access) -> rdma_transport::RegionKey {
    rdma_transport::RegionKey {
        addr: r.addr,
        len: r.length,
        rkey: r.rkey,
        access: rdma_access(access),
    }
}

fn to_transport(b: Exposable) -> rdma_transport::Exposable {
    match b {
        Exposable::Shared(b) => rdma_transport::Exposable::Shared(b),
        Exposable::Owned(b) => rdma_transport::Exposable::Owned(b),
    }
}

fn from_transport(b: rdma_transport::Exposable) -> Exposable {
    match b {
        rdma_transport::Exposable::Shared(b) => Exposable::Shared(b),
        rdma_transport::Exposable::Owned(b) => Exposable::Owned(b),
    }
}

/// The gRPC status of a one-sided operation's failure.
fn status_of(e: rdma_transport::Error) -> Status {
    use rdma_transport::{Error as E, RemoteError as R};
    match &e {
        E::Remote(r) => match r {
            R::OutOfRange { .. } => Status::out_of_range(e.to_string()),
            R::AccessDenied { .. } => Status::permission_denied(e.to_string()),
            R::Refused { .. } => Status::not_found(format!(
                "remote region not found: the peer's NIC refused the access ({e}); the region \
                 was revoked, was exposed on another connection, or the descriptor was altered"
            )),
            R::SharedNotWritable | R::Empty | R::TooLarge { .. } => {
                Status::invalid_argument(e.to_string())
            }
            _ => Status::unavailable(e.to_string()),
        },
        E::ResourceLimit(_) => Status::resource_exhausted(e.to_string()),
        _ => Status::unavailable(format!("remote memory: {e}")),
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
    /// Registered for one-sided access.
    OneSided(rdma_transport::Exposure),
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
            GrantHow::OneSided(e) => Ok(from_transport(e.revoke())),
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
            // Dropping the exposure deregisters it.
            GrantHow::OneSided(_) | GrantHow::Done => {}
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
