//! The framing shared by the two small gRPC methods an rpc-core server's
//! TCP side adds ([`rdma_port`](super::rdma_port) and
//! [`ticket`](super::ticket)): a unary reply built by hand (one
//! length-prefixed message and `grpc-status: 0`), and the client's call
//! that sends an empty request and collects the reply's message and status,
//! bounded in size and time. The messages themselves are a field or two,
//! encoded and parsed by their modules.

use bytes::Bytes;
use http_body_util::BodyExt;
use std::convert::Infallible;
use std::time::Duration;
use tonic::body::Body;

/// How long a control call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A unary reply carrying `msg` (an encoded protobuf message) and status OK.
pub(crate) fn reply(msg: &[u8]) -> http::Response<Body> {
    let mut data = Vec::with_capacity(5 + msg.len());
    data.push(0);
    data.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    data.extend_from_slice(msg);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let frames = vec![
        Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(data))),
        Ok(http_body::Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
    let mut resp = http::Response::new(Body::new(body));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    resp
}

/// The reply to a path the service does not have.
pub(crate) fn no_method(service: &str, path: &str) -> http::Response<Body> {
    tonic::Status::unimplemented(format!("{service} has no method {path}")).into_http()
}

/// The message of a reply body that holds exactly one uncompressed
/// length-prefixed message.
pub(crate) fn message(body: &[u8]) -> Option<&[u8]> {
    let [0, a, b, c, d, msg @ ..] = body else {
        return None;
    };
    (u32::from_be_bytes([*a, *b, *c, *d]) as usize == msg.len()).then_some(msg)
}

/// What a control call got back.
pub(crate) struct Answer {
    /// `grpc-status` and `grpc-message` (`None`: no status came).
    pub(crate) status: Option<(String, String)>,
    /// Whether the status came alone (trailers-only: no message).
    pub(crate) trailers_only: bool,
    /// The reply body's bytes.
    pub(crate) data: Vec<u8>,
}

impl Answer {
    /// Whether the call ended with status OK.
    pub(crate) fn ok(&self) -> bool {
        self.status.as_ref().is_some_and(|(code, _)| code == "0")
    }

    /// The status as "code message", for an error message.
    pub(crate) fn status_text(&self) -> String {
        match &self.status {
            Some((code, msg)) => format!("grpc-status {code} {msg}"),
            None => "no grpc-status".to_string(),
        }
    }
}

fn status(h: &http::HeaderMap) -> Option<(String, String)> {
    let code = h.get("grpc-status")?;
    let msg = h
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or("");
    Some((code.to_str().unwrap_or("?").to_string(), msg.to_string()))
}

/// Calls `path` on `ch` with an empty request message; reads at most `max`
/// body bytes. `what` names the call in errors ("RDMA ticket request").
pub(crate) async fn call(
    ch: &tonic::transport::Channel,
    path: &'static str,
    max: usize,
    what: &str,
) -> Result<Answer, String> {
    use tower::ServiceExt;
    let mut req = http::Request::new(Body::new(http_body_util::Full::new(Bytes::from_static(&[
        0, 0, 0, 0, 0,
    ]))));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = http::Uri::from_static(path);
    req.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    req.headers_mut()
        .insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    let work = async {
        let resp = ch
            .clone()
            .oneshot(req)
            .await
            .map_err(|e| crate::error::error_chain(&e))?;
        if let Some(s) = status(resp.headers()) {
            return Ok(Answer {
                status: Some(s),
                trailers_only: true,
                data: Vec::new(),
            });
        }
        let mut body = resp.into_body();
        let mut data = Vec::new();
        let mut trailers = None;
        while let Some(f) = body.frame().await {
            let f = f.map_err(|e: tonic::Status| e.to_string())?;
            match f.into_data() {
                Ok(d) => {
                    data.extend_from_slice(&d);
                    if data.len() > max {
                        return Err(format!("{what}: response too large"));
                    }
                }
                Err(f) => trailers = f.into_trailers().ok(),
            }
        }
        Ok(Answer {
            status: trailers.as_ref().and_then(status),
            trailers_only: false,
            data,
        })
    };
    tokio::time::timeout(CALL_TIMEOUT, work)
        .await
        .map_err(|_| format!("{what} timed out"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_exactly() {
        assert_eq!(message(&[0, 0, 0, 0, 2, 7, 8]), Some(&[7u8, 8][..]));
        assert_eq!(message(&[0, 0, 0, 0, 0]), Some(&[][..]));
        for bad in [
            &[][..],
            &[0, 0, 0, 0],
            &[1, 0, 0, 0, 0],
            &[0, 0, 0, 0, 3, 7, 8],
            &[0, 0, 0, 0, 1, 7, 8],
        ] {
            assert_eq!(message(bad), None, "{bad:?}");
        }
    }
}
