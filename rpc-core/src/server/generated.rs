//! The server half of the direct path: calls on message connections to a
//! service compiled with `rpc_codegen` go from the received frames straight
//! to the user's trait method, without `http::Request`, tonic's server
//! `Grpc`, its codec buffers or its body types (`docs/architecture.md`,
//! "The direct path").
//!
//! **How the server learns of a service's methods.** `add_service` takes
//! any tower service and cannot ask it for more without a new bound that
//! stock services would not meet. So the code `rpc_codegen` generates
//! registers, when the service value is made (`GreeterServer::new`), a
//! function from the service's type to its [`Methods`]: [`register`].
//! `add_service` looks the service's type up ([`methods_of`]); a service
//! whose type was never registered (stock tonic-build, a hand-written
//! service, one wrapped in an interceptor) is served as before.
//!
//! Per call, what the direct path does not cover goes to tonic's path:
//! a method the table does not have (client or bidi streaming), a
//! compressed request, a server with layers. The bytes on the wire are
//! the same either way.

use super::call::{
    deadline_exceeded, insert_conn_info, request_headers, send_metadata, send_status, EndCall,
};
use crate::protocol::body::RecvBody;
use crate::protocol::frame;
use crate::protocol::message::{self, End};
use crate::protocol::session::{CallFuture, CallWindow, OpenCall, Shared};
use futures::{Stream, StreamExt};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tonic::Status;

/// A generated service's methods on the direct path (implemented by the
/// code `rpc_codegen` generates; not meant to be implemented by hand).
pub trait Methods: Send + Sync + 'static {
    /// The index of the method called `name` (the path's last segment,
    /// `SayHello` of `/helloworld.Greeter/SayHello`) if the direct path
    /// serves it; `None` sends the call to tonic's path.
    fn method(&self, name: &[u8]) -> Option<usize>;

    /// Starts a call of method `index` (one [`method`](Self::method)
    /// returned), with [`ServerCall::unary`] or
    /// [`ServerCall::server_streaming`].
    fn call(&self, index: usize, call: ServerCall) -> DirectFuture;
}

/// A call of the direct path, not started yet.
pub struct DirectFuture(pub(crate) CallFuture);

impl std::fmt::Debug for DirectFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DirectFuture")
    }
}

/// The message size limits of a generated server (its
/// `max_decoding_message_size` and `max_encoding_message_size`); `None` is
/// tonic's default (4 MiB decoding, no limit encoding).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Largest request message decoded.
    pub max_decoding_message_size: Option<usize>,
    /// Largest response message encoded.
    pub max_encoding_message_size: Option<usize>,
}

/// Calls served on the direct path in this process ([`counts`]).
static SERVED: AtomicU64 = AtomicU64::new(0);

/// How many calls took the direct path in this process, for tests and
/// benchmarks that check which path their calls took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Calls a generated client made on the direct path.
    pub client: u64,
    /// Calls a generated service served on the direct path.
    pub server: u64,
}

/// The [`Counts`] so far.
pub fn counts() -> Counts {
    Counts {
        client: crate::client::generated::CALLED.load(Ordering::Relaxed),
        server: SERVED.load(Ordering::Relaxed),
    }
}

type Lookup = Box<dyn Fn(&dyn Any) -> Option<Arc<dyn Methods>> + Send + Sync>;

fn registry() -> &'static Mutex<HashMap<TypeId, Lookup, crate::hash::FastState>> {
    static REGISTRY: OnceLock<Mutex<HashMap<TypeId, Lookup, crate::hash::FastState>>> =
        OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Registers how to get the [`Methods`] of a service of type `S` (called by
/// generated code when a service value is made; once per type is kept).
/// `methods` returns `None` when this service value must go through tonic's
/// path (e.g. compression is enabled on it).
pub fn register<S: 'static>(methods: fn(&S) -> Option<Arc<dyn Methods>>) {
    let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
    r.entry(TypeId::of::<S>()).or_insert_with(|| {
        Box::new(move |svc: &dyn Any| svc.downcast_ref::<S>().and_then(methods))
    });
}

/// The direct-path methods of `svc`, if its type was registered.
pub(crate) fn methods_of<S: 'static>(svc: &S) -> Option<Arc<dyn Methods>> {
    let r = registry().lock().unwrap_or_else(|e| e.into_inner());
    r.get(&TypeId::of::<S>()).and_then(|f| f(svc))
}

/// One call on the direct path, handed to [`Methods::call`].
pub struct ServerCall {
    pub(crate) shared: Arc<Shared>,
    pub(crate) call: OpenCall,
    pub(crate) span: Option<tracing::Span>,
}

impl std::fmt::Debug for ServerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCall")
            .field("stream", &self.call.stream)
            .finish_non_exhaustive()
    }
}

impl ServerCall {
    /// Serves a unary call with `handler` (the user's trait method): the
    /// request decoded from the received bytes, the reply encoded into the
    /// outgoing frame.
    pub fn unary<Req, Resp, F, Fut>(self, limits: Limits, handler: F) -> DirectFuture
    where
        Req: prost::Message + Default + Send + 'static,
        Resp: prost::Message + Send + 'static,
        F: FnOnce(tonic::Request<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>> + Send + 'static,
    {
        self.unary_large(limits, handler, |_| None)
    }

    /// [`unary`](Self::unary) for a reply with `bytes` fields: `take` takes
    /// a large one out of the reply (`rpc_core::direct::take_large`), whose
    /// bytes then go to the transport uncopied, after the others.
    pub fn unary_large<Req, Resp, F, Fut, Take>(
        self,
        limits: Limits,
        handler: F,
        take: Take,
    ) -> DirectFuture
    where
        Req: prost::Message + Default + Send + 'static,
        Resp: prost::Message + Send + 'static,
        F: FnOnce(tonic::Request<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>> + Send + 'static,
        Take: FnOnce(&mut Resp) -> Option<(u32, bytes::Bytes)> + Send + 'static,
    {
        self.start(limits, move |shared, stream, window, req| async move {
            let resp = handler(req).await;
            let (md, msg, _) = match resp {
                Ok(r) => r.into_parts(),
                Err(st) => return send_status(&shared, stream, st),
            };
            let data = match message::encode_split(msg, limits.max_encoding_message_size, take) {
                Ok(d) => d,
                Err(st) => return send_status(&shared, stream, st),
            };
            let md = message::sanitized(md);
            // Usually the whole reply is one BATCH, written at once.
            let data = match shared.try_send_unary_reply(stream, &window, &md, CONTENT_TYPE, data) {
                Ok(_) => return,
                Err(data) => data,
            };
            // Else HEADERS, DATA and TRAILERS leave together: the TRAILERS flush.
            if !send_headers(&shared, stream, &md, true) {
                return;
            }
            if shared
                .send_message(stream, &window, data, false, true)
                .await
                .is_ok()
            {
                send_ok(&shared, stream);
            }
        })
    }

    /// Serves a server-streaming call with `handler`: each message of the
    /// stream it returns is encoded into a frame of its own, and an error
    /// item ends the call with that status (as tonic's server does).
    pub fn server_streaming<Req, Resp, S, F, Fut>(self, limits: Limits, handler: F) -> DirectFuture
    where
        Req: prost::Message + Default + Send + 'static,
        Resp: prost::Message + Send + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
        F: FnOnce(tonic::Request<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<tonic::Response<S>, Status>> + Send + 'static,
    {
        self.start(limits, move |shared, stream, window, req| async move {
            let (md, replies, _) = match handler(req).await {
                Ok(r) => r.into_parts(),
                Err(st) => return send_status(&shared, stream, st),
            };
            if !send_headers(&shared, stream, &message::sanitized(md), false) {
                return;
            }
            let mut replies = std::pin::pin!(replies);
            while let Some(item) = replies.next().await {
                let data = match item
                    .and_then(|m| message::encode(&m, limits.max_encoding_message_size))
                {
                    Ok(d) => d,
                    Err(st) => return send_status(&shared, stream, st),
                };
                if shared
                    .send_body(stream, &window, data, false, false)
                    .await
                    .is_err()
                {
                    return; // call reset or connection gone
                }
            }
            send_ok(&shared, stream);
        })
    }

    /// Answers UNIMPLEMENTED (an index [`Methods::method`] never returns).
    pub fn unimplemented(self) -> DirectFuture {
        let ServerCall { shared, call, .. } = self;
        DirectFuture(CallFuture::new(async move {
            let _end = EndCall {
                shared: shared.clone(),
                stream: call.stream,
            };
            send_status(
                &shared,
                call.stream,
                Status::unimplemented("no such method on the direct path"),
            );
        }))
    }

    /// The request's one message and the call around `respond`: the
    /// deadline, the request's metadata and extensions (peer address, TLS
    /// identity, as on tonic's path), and the end of the call however it
    /// ends.
    fn start<Req, F, Fut>(self, limits: Limits, respond: F) -> DirectFuture
    where
        Req: prost::Message + Default + Send + 'static,
        F: FnOnce(Arc<Shared>, u32, CallWindow, tonic::Request<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let ServerCall { shared, call, span } = self;
        SERVED.fetch_add(1, Ordering::Relaxed);
        let fut = async move {
            let OpenCall {
                stream,
                path: _,
                timeout: call_timeout,
                mut metadata,
                inbound,
                window,
            } = call;
            let _end = EndCall {
                shared: shared.clone(),
                stream,
            };
            request_headers(&mut metadata, call_timeout);
            // The deadline bounds reading the request and the response,
            // each awaited in place: a future wrapped around the whole
            // call would be moved (copied) whole on the way in.
            let deadline = call_timeout.map(|t| (tokio::time::Instant::now() + t, t));
            let mut body = RecvBody::new(inbound, shared.clone(), stream, None, None);
            let mut reader = message::Reader::new(limits.max_decoding_message_size);
            let read = match deadline {
                None => reader.next(&mut body).await,
                Some((at, t)) => match tokio::time::timeout_at(at, reader.next(&mut body)).await {
                    Ok(r) => r,
                    Err(_) => return deadline_exceeded(&shared, stream, t),
                },
            };
            let msg: Req = match read {
                Ok(Ok(m)) => m,
                Ok(Err(End::Eof | End::Trailers(_) | End::TrailersOk)) => {
                    return send_status(
                        &shared,
                        stream,
                        Status::internal("Missing request message."),
                    )
                }
                Err(st) => return send_status(&shared, stream, st),
            };
            drop(reader);
            let mut ext = http::Extensions::new();
            insert_conn_info(&mut ext, &shared.info);
            let req = tonic::Request::from_parts(
                tonic::metadata::MetadataMap::from_headers(metadata),
                ext,
                msg,
            );
            let work = respond(shared.clone(), stream, window, req);
            match deadline {
                None => work.await,
                Some((at, t)) => {
                    if tokio::time::timeout_at(at, work).await.is_err() {
                        deadline_exceeded(&shared, stream, t);
                    }
                }
            }
            drop(body);
        };
        DirectFuture(match span {
            None => CallFuture::new(fut),
            Some(span) => {
                use tracing::Instrument;
                CallFuture::new(fut.instrument(span))
            }
        })
    }
}

/// What the response's HEADERS carry after the handler's metadata.
const CONTENT_TYPE: &[(&str, &[u8])] = &[("content-type", b"application/grpc")];

/// The response's HEADERS: the handler's metadata (without the names tonic
/// reserves, [`message::sanitized`]) and tonic's content type. `followed`:
/// this task flushes next ([`Shared::send_ctrl_followed`]).
fn send_headers(shared: &Shared, stream: u32, md: &http::HeaderMap, followed: bool) -> bool {
    send_metadata_with(
        shared,
        stream,
        frame::kind::HEADERS,
        md,
        CONTENT_TYPE,
        followed,
    )
}

/// The TRAILERS of a call that succeeded: `grpc-status: 0` only.
fn send_ok(shared: &Shared, stream: u32) {
    const OK: &[(&str, &[u8])] = &[("grpc-status", b"0")];
    send_metadata_with(
        shared,
        stream,
        frame::kind::TRAILERS,
        &http::HeaderMap::new(),
        OK,
        false,
    );
}

/// [`send_metadata`] with `extra` entries after `md`'s (no map built);
/// `followed` as [`Shared::send_ctrl_followed`].
fn send_metadata_with(
    shared: &Shared,
    stream: u32,
    kind: u8,
    md: &http::HeaderMap,
    extra: &[(&str, &[u8])],
    followed: bool,
) -> bool {
    let limit = shared.peer.max_metadata_bytes as usize;
    match frame::encode_metadata_frame_with(kind, stream, md, extra, limit) {
        Ok(f) => {
            if followed {
                shared.send_ctrl_followed(f);
            } else {
                shared.send_ctrl(f);
            }
            true
        }
        // Over the client's limit: the map-based path reports and resets.
        Err(_) => {
            let mut full = md.clone();
            for (k, v) in extra {
                if let (Ok(k), Ok(v)) = (
                    http::HeaderName::from_bytes(k.as_bytes()),
                    http::HeaderValue::from_bytes(v),
                ) {
                    full.insert(k, v);
                }
            }
            send_metadata(shared, stream, kind, &full)
        }
    }
}
