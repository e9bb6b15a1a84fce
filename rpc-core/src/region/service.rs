//! `rdma_grpc.RemoteMemory` (`docs/wire-protocol.md` §5), the hidden
//! service every rpc-core server serves: remote memory where there is no
//! one-sided access (TCP and in-memory connections), on the process's
//! [`table`](super::table).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::body::Body;

use super::check::{check, Op};
use super::error::RegionError;
use super::proto::{
    Access, ExposeReply, ExposeRequest, Path, ReadReply, ReadRequest, RemoteRegion, RevokeReply,
    RevokeRequest, Side, WriteReply, WriteRequest,
};
use super::table::{table, ConnKey, DEFAULT_PER_CONNECTION};

/// The service's full name.
pub(crate) const SERVICE: &str = "rdma_grpc.RemoteMemory";
/// Method paths.
pub(crate) const READ: &str = "/rdma_grpc.RemoteMemory/Read";
pub(crate) const WRITE: &str = "/rdma_grpc.RemoteMemory/Write";
pub(crate) const EXPOSE: &str = "/rdma_grpc.RemoteMemory/Expose";
pub(crate) const REVOKE: &str = "/rdma_grpc.RemoteMemory/Revoke";

/// Largest message either way: a region's bytes, bounded by the
/// per-connection cap, and a little framing.
pub(crate) const MAX_MESSAGE: usize = DEFAULT_PER_CONNECTION + 1024;

/// The connection a call came on: a message connection's number, else the
/// TCP connection's addresses; `None` when neither is known (a server
/// serving an incoming stream that reports no addresses).
pub(crate) fn conn_key<T>(req: &tonic::Request<T>) -> Option<ConnKey> {
    if let Some(id) = req
        .extensions()
        .get::<crate::ConnInfo>()
        .map(|i| i.id)
        .filter(|id| *id != 0)
    {
        return Some(ConnKey::Msg(id));
    }
    req.remote_addr()
        .map(|remote| ConnKey::Tcp(req.local_addr(), remote))
}

/// A descriptor the service path reaches.
fn service_region(region: Option<RemoteRegion>) -> Result<RemoteRegion, RegionError> {
    let r = region.ok_or(RegionError::Invalid("region missing"))?;
    let p = super::check::parse(&r)?;
    if p.path != Path::Service {
        return Err(RegionError::WrongPath {
            descriptor: super::check::path_name(p.path),
            connection: super::check::path_name(Path::Service),
        });
    }
    Ok(r)
}

/// Serves `rdma_grpc.RemoteMemory`.
#[derive(Clone, Default)]
pub(crate) struct RemoteMemoryService;

impl tonic::server::NamedService for RemoteMemoryService {
    const NAME: &'static str = SERVICE;
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl tower::Service<http::Request<Body>> for RemoteMemoryService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> ResponseFuture {
        match req.uri().path() {
            READ => Box::pin(unary(req, read)),
            WRITE => Box::pin(unary(req, write)),
            EXPOSE => Box::pin(unary(req, expose)),
            REVOKE => Box::pin(unary(req, revoke)),
            other => {
                let r = crate::transport::control::no_method(SERVICE, other);
                Box::pin(std::future::ready(Ok(r)))
            }
        }
    }
}

/// The calling connection, or why there is none.
fn caller<T>(req: &tonic::Request<T>) -> Result<ConnKey, RegionError> {
    conn_key(req).ok_or_else(|| {
        RegionError::Unavailable(
            "this connection has no identity (neither a message connection nor TCP addresses)"
                .into(),
        )
    })
}

fn read(req: tonic::Request<ReadRequest>) -> Result<ReadReply, RegionError> {
    let conn = caller(&req)?;
    let m = req.into_inner();
    let r = service_region(m.region)?;
    check(&r, Side::Client, Op::Read, m.offset, m.length)?;
    let data = table().read(conn, &r, m.offset, m.length)?;
    Ok(ReadReply { data })
}

fn write(req: tonic::Request<WriteRequest>) -> Result<WriteReply, RegionError> {
    let conn = caller(&req)?;
    let m = req.into_inner();
    let r = service_region(m.region)?;
    check(&r, Side::Client, Op::Write, m.offset, m.data.len() as u64)?;
    table().write(conn, &r, m.offset, &m.data)?;
    Ok(WriteReply {})
}

fn expose(req: tonic::Request<ExposeRequest>) -> Result<ExposeReply, RegionError> {
    let conn = caller(&req)?;
    let m = req.into_inner();
    let access = match Access::try_from(m.access) {
        Ok(Access::Unspecified) | Err(_) => return Err(RegionError::Invalid("unknown access")),
        Ok(a) => a,
    };
    let region = table().insert(conn, Side::Client, access, m.data.into())?;
    Ok(ExposeReply {
        region: Some(region),
    })
}

fn revoke(req: tonic::Request<RevokeRequest>) -> Result<RevokeReply, RegionError> {
    let conn = caller(&req)?;
    let r = service_region(req.into_inner().region)?;
    if r.exposed_by != Side::Client as i32 {
        return Err(RegionError::OwnRegion { side: "server" });
    }
    let data = table().remove(conn, &r)?;
    let access = Access::try_from(r.access).unwrap_or(Access::Unspecified);
    Ok(RevokeReply {
        data: if access.writes() {
            data.into_bytes()
        } else {
            bytes::Bytes::new()
        },
    })
}

/// One unary method: decodes the request, runs `f`, encodes its answer or
/// its status.
async fn unary<Req, Rep>(
    req: http::Request<Body>,
    f: fn(tonic::Request<Req>) -> Result<Rep, RegionError>,
) -> Result<http::Response<Body>, Infallible>
where
    Req: prost::Message + Default + Send + 'static,
    Rep: prost::Message + Send + 'static,
{
    let svc = tower::service_fn(move |r: tonic::Request<Req>| {
        std::future::ready(f(r).map(tonic::Response::new).map_err(tonic::Status::from))
    });
    let mut g = tonic::server::Grpc::new(tonic_prost::ProstCodec::<Rep, Req>::default())
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    Ok(g.unary(svc, req).await)
}
