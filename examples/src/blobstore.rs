//! A blob store whose bytes move by remote memory (`rpc_core::remote`):
//! `Get` exposes a stored blob to the caller, who reads it one-sided (no
//! handler runs while it reads); `Put` reads a blob from a region the caller
//! exposed; `Fetch` writes a blob into a region the caller exposed.
//!
//! Over RDMA the reads and writes are one-sided RDMA READ and WRITE; over
//! TCP and in-memory connections the same code goes through the server's
//! remote-memory service.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use rpc_core::remote::{Access, Grant, Remote};
use tonic::{Request, Response, Status};

use crate::pb::blobstore::blob_store_server::BlobStore;
use crate::pb::blobstore::{
    FetchReply, FetchRequest, GetReply, GetRequest, PutReply, PutRequest, ReadReply, ReadRequest,
    ReleaseReply, ReleaseRequest,
};

/// Largest blob `Put` accepts.
pub const MAX_BLOB: u64 = 64 << 20;
/// Leases (exposed blobs) held at once; the oldest is revoked beyond.
pub const MAX_LEASES: usize = 1024;

/// Blobs in memory, and the leases `Get` handed out.
#[derive(Default)]
pub struct Blobs {
    blobs: Mutex<HashMap<String, Bytes>>,
    leases: Mutex<Leases>,
}

#[derive(Default)]
struct Leases {
    next: u64,
    /// Lease number → the grant that keeps its region exposed.
    held: std::collections::BTreeMap<u64, Grant>,
}

impl Blobs {
    /// Stores `data` under `name` (as `Put` does, without a region).
    pub fn insert(&self, name: impl Into<String>, data: Bytes) {
        self.blobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.into(), data);
    }

    fn get(&self, name: &str) -> Result<Bytes, Status> {
        self.blobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("no blob named {name:?}")))
    }

    /// Leases held now.
    pub fn leases(&self) -> usize {
        self.leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .held
            .len()
    }
}

#[tonic::async_trait]
impl BlobStore for Blobs {
    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetReply>, Status> {
        let remote = Remote::of_request(&request)?;
        let blob = self.get(&request.get_ref().name)?;
        // Shared bytes, read-only: the blob stays readable here meanwhile.
        let grant = remote.expose(blob, Access::Read).await?;
        let region = grant.region();
        let mut l = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        l.next += 1;
        let lease = l.next;
        l.held.insert(lease, grant);
        while l.held.len() > MAX_LEASES {
            // Dropping the oldest grant revokes it.
            l.held.pop_first();
        }
        Ok(Response::new(GetReply {
            blob: Some(region),
            lease,
        }))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseReply>, Status> {
        let lease = request.into_inner().lease;
        let grant = self
            .leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .held
            .remove(&lease)
            .ok_or_else(|| Status::not_found(format!("no lease {lease}")))?;
        grant.revoke().await?;
        Ok(Response::new(ReleaseReply {}))
    }

    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutReply>, Status> {
        let remote = Remote::of_request(&request)?;
        let m = request.into_inner();
        let source = m
            .source
            .ok_or_else(|| Status::invalid_argument("source region missing"))?;
        if source.length > MAX_BLOB {
            return Err(Status::out_of_range(format!(
                "blob of {} bytes: at most {MAX_BLOB}",
                source.length
            )));
        }
        let data = remote.read(&source, 0, source.length).await?;
        self.insert(m.name, data);
        Ok(Response::new(PutReply {
            length: source.length,
        }))
    }

    async fn fetch(&self, request: Request<FetchRequest>) -> Result<Response<FetchReply>, Status> {
        let remote = Remote::of_request(&request)?;
        let m = request.into_inner();
        let blob = self.get(&m.name)?;
        let destination = m
            .destination
            .ok_or_else(|| Status::invalid_argument("destination region missing"))?;
        if (blob.len() as u64) > destination.length {
            return Err(Status::out_of_range(format!(
                "blob {:?} has {} bytes; the destination region holds {}",
                m.name,
                blob.len(),
                destination.length
            )));
        }
        let length = blob.len() as u64;
        remote.write(&destination, 0, blob).await?;
        Ok(Response::new(FetchReply { length }))
    }

    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadReply>, Status> {
        let m = request.into_inner();
        let blob = self.get(&m.name)?;
        let end = m
            .offset
            .checked_add(m.length)
            .filter(|e| *e <= blob.len() as u64)
            .ok_or_else(|| {
                Status::out_of_range(format!(
                    "{} bytes at {} of blob {:?} of {} bytes",
                    m.length,
                    m.offset,
                    m.name,
                    blob.len()
                ))
            })?;
        Ok(Response::new(ReadReply {
            // A slice of the stored blob: no copy.
            data: blob.slice(m.offset as usize..end as usize),
        }))
    }
}
