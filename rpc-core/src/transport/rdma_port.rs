//! RDMA port discovery (`docs/wire-protocol.md` §3): a server whose RDMA
//! listener cannot share the TCP port (iWARP: rdma_cm's listener is a kernel
//! TCP listener) tells the port through a tiny gRPC method on the TCP side;
//! an `Auto` (or `RdmaOnly`) client that could not reach RDMA at the TCP
//! port asks it and tries RDMA there.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::body::Body;

use super::control;

/// The service's full name.
pub(crate) const SERVICE: &str = "rdma_grpc.RdmaEndpoint";
/// The method's path.
pub(crate) const PATH: &str = "/rdma_grpc.RdmaEndpoint/Get";
/// Largest response body read (a well-formed one is at most 5 + 4 bytes).
const MAX_RESPONSE: usize = 256;

/// Serves `Get`: the RDMA listener's port (0: none).
#[derive(Clone, Default)]
pub(crate) struct RdmaEndpointService {
    pub(crate) port: Arc<AtomicU16>,
}

impl tonic::server::NamedService for RdmaEndpointService {
    const NAME: &'static str = SERVICE;
}

impl tower::Service<http::Request<Body>> for RdmaEndpointService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() != PATH {
            return std::future::ready(Ok(control::no_method(SERVICE, req.uri().path())));
        }
        let port = self.port.load(Ordering::Acquire);
        // GetResponse { uint32 port = 1; } (proto3: 0 is omitted).
        let mut msg = Vec::new();
        if port != 0 {
            msg.push(0x08);
            put_varint(&mut msg, u64::from(port));
        }
        std::future::ready(Ok(control::reply(&msg)))
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &[u8], i: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*i)?;
        *i += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Parses a `Get` response body (gRPC length-prefixed message): the port,
/// `Ok(None)` for 0 or absent.
pub(crate) fn parse_response(body: &[u8]) -> Result<Option<u16>, String> {
    let msg = control::message(body).ok_or("malformed RDMA endpoint response")?;
    let mut i = 0;
    let mut port = 0u64;
    while i < msg.len() {
        let tag = get_varint(msg, &mut i).ok_or("bad tag")?;
        match (tag >> 3, tag & 7) {
            (1, 0) => port = get_varint(msg, &mut i).ok_or("bad port")?,
            (_, 0) => {
                get_varint(msg, &mut i).ok_or("bad field")?;
            }
            (_, 1) => i += 8,
            (_, 5) => i += 4,
            (_, 2) => {
                let l = get_varint(msg, &mut i).ok_or("bad length")? as usize;
                i = i.checked_add(l).ok_or("bad length")?;
            }
            _ => return Err("unsupported wire type".into()),
        }
    }
    if i > msg.len() {
        return Err("truncated field".into());
    }
    match u16::try_from(port) {
        Ok(0) => Ok(None),
        Ok(p) => Ok(Some(p)),
        Err(_) => Err(format!("port {port} out of range")),
    }
}

/// Asks a server over its HTTP/2 side for its RDMA port. `Ok(None)`: the
/// server has no RDMA listener, or does not know the method (a stock gRPC
/// server answers UNIMPLEMENTED).
pub(crate) async fn query(ch: &tonic::transport::Channel) -> Result<Option<u16>, String> {
    let answer = control::call(ch, PATH, MAX_RESPONSE, "RDMA endpoint query").await?;
    // Trailers-only is UNIMPLEMENTED from a stock server, or another error.
    if answer.trailers_only || !answer.ok() {
        return Ok(None);
    }
    parse_response(&answer.data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_round_trip_and_garbage_is_refused() {
        for port in [1u16, 127, 128, 50051, u16::MAX] {
            let mut msg = vec![0x08];
            put_varint(&mut msg, port.into());
            let mut body = vec![0, 0, 0, 0, msg.len() as u8];
            body.extend_from_slice(&msg);
            assert_eq!(parse_response(&body), Ok(Some(port)));
        }
        assert_eq!(parse_response(&[0, 0, 0, 0, 0]), Ok(None));
        // An unknown field is skipped.
        assert_eq!(
            parse_response(&[0, 0, 0, 0, 5, 0x12, 1, 0xff, 0x08, 7]),
            Ok(Some(7))
        );
        for bad in [
            &[][..],
            &[1, 0, 0, 0, 0],
            &[0, 0, 0, 0, 9, 0x08],
            &[0, 0, 0, 0, 4, 0x08, 0xff, 0xff, 0xff],
            &[0, 0, 0, 0, 4, 0x08, 0x80, 0x80, 0x04], // 65536
            &[0, 0, 0, 0, 3, 0x12, 5, 0],
        ] {
            assert!(parse_response(bad).is_err(), "{bad:?}");
        }
    }
}
