//! The client half of the direct path: a client compiled with
//! `rpc_codegen`, over an [`rpc_core::Channel`](crate::Channel) whose
//! connection is a message connection (RDMA, in-memory), encodes its
//! request straight into the call's frames and decodes the reply from the
//! received bytes, without tonic's client `Grpc`, `http::Request`, its
//! body or codec buffers (`docs/architecture.md`, "The direct path").
//!
//! The generated client keeps a [`Client`] beside tonic's `Grpc`; each
//! unary or server-streaming method asks it for a [`Call`] first and, when
//! there is none (another transport, compression, TCP at the moment),
//! takes tonic's path. The bytes on the wire are the same either way.

use super::{Channel, MsgChannel, Slot, Svc};
use crate::protocol::body::RecvBody;
use crate::protocol::message::{self, Encoded, End};
use crate::protocol::session::{CallGuard, Inbound, InboundRx, Shared};
use crate::protocol::{frame, timeout};
use crate::transport::http2::deadline_status;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tonic::codec::CompressionEncoding;
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};

/// Calls made on the direct path in this process (`server::generated::counts`).
pub(crate) static CALLED: AtomicU64 = AtomicU64::new(0);

/// What a generated client keeps for the direct path (made by generated
/// code from the client's transport; not meant to be used by hand).
#[derive(Default)]
pub struct Client {
    /// The channel, when the client's transport is an `rpc_core::Channel`
    /// with the direct path on.
    chan: Option<Channel>,
    /// The call slot the channel had reserved (its `poll_ready`) when the
    /// client was made: the first direct call uses it.
    reserved: Option<Slot>,
    max_decoding_message_size: Option<usize>,
    max_encoding_message_size: Option<usize>,
    /// Compression asked for: calls take tonic's path, whose codec compresses.
    compression: bool,
}

impl Clone for Client {
    /// A reservation is not cloned (tower's contract: it is one clone's).
    fn clone(&self) -> Self {
        Client {
            chan: self.chan.clone(),
            reserved: None,
            max_decoding_message_size: self.max_decoding_message_size,
            max_encoding_message_size: self.max_encoding_message_size,
            compression: self.compression,
        }
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("direct", &self.chan.is_some())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// The direct path of a client whose transport is `transport`: on when
    /// it is an `rpc_core::Channel` (not one with tonic's path forced,
    /// [`Channel::direct_path`]); any other transport (tonic's channel, an
    /// interceptor, a tower layer) always takes tonic's path.
    ///
    /// A call slot the channel had reserved (`poll_ready` before the client
    /// was made) moves to the direct path, for its first call.
    pub fn of<T: 'static>(transport: &mut T) -> Client {
        let Some(chan) = (transport as &mut dyn std::any::Any)
            .downcast_mut::<Channel>()
            .filter(|c| c.direct_path)
        else {
            return Client::default();
        };
        let reserved = match &mut chan.svc {
            Svc::Direct(d) => d.take_reservation(),
            Svc::Buffered { .. } => None,
        };
        Client {
            chan: Some(chan.clone()),
            reserved,
            ..Client::default()
        }
    }

    /// The client asked for compressed requests: tonic's path.
    #[must_use]
    pub fn send_compressed(mut self, _encoding: CompressionEncoding) -> Client {
        self.compression = true;
        self
    }

    /// The client accepts compressed responses: tonic's path (its codec
    /// decompresses).
    #[must_use]
    pub fn accept_compressed(mut self, _encoding: CompressionEncoding) -> Client {
        self.compression = true;
        self
    }

    /// As the generated client's `max_decoding_message_size`.
    #[must_use]
    pub fn max_decoding_message_size(mut self, limit: usize) -> Client {
        self.max_decoding_message_size = Some(limit);
        self
    }

    /// As the generated client's `max_encoding_message_size`.
    #[must_use]
    pub fn max_encoding_message_size(mut self, limit: usize) -> Client {
        self.max_encoding_message_size = Some(limit);
        self
    }

    /// A direct call, if this call can take the direct path now: the
    /// channel is on a message connection (an `Auto` channel that fell back
    /// to TCP takes tonic's path until it moves to RDMA).
    pub fn get(&mut self) -> Option<Call> {
        if self.compression {
            return None;
        }
        let Svc::Direct(d) = &self.chan.as_ref()?.svc else {
            return None;
        };
        let chan = d.current_msg()?;
        Some(Call {
            chan,
            slot: self.reserved.take(),
            max_decoding_message_size: self.max_decoding_message_size,
            max_encoding_message_size: self.max_encoding_message_size,
            channel_timeout: d.core.builder.as_ref().and_then(|b| b.timeout),
        })
    }
}

/// One call on the direct path ([`Client::get`]).
pub struct Call {
    chan: Arc<MsgChannel>,
    /// A call slot reserved before (see [`Client::of`]).
    slot: Option<Slot>,
    max_decoding_message_size: Option<usize>,
    max_encoding_message_size: Option<usize>,
    /// The channel's `timeout`, which caps every call's.
    channel_timeout: Option<Duration>,
}

impl std::fmt::Debug for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call").finish_non_exhaustive()
    }
}

/// A call opened and its request sent: what comes back is read from `rx`.
struct Opened {
    shared: Arc<Shared>,
    stream: u32,
    rx: InboundRx,
    guard: CallGuard,
    deadline: Option<(Instant, Duration)>,
}

impl Call {
    /// A unary call to `path` (`/package.Service/Method`).
    pub fn unary<Req, Resp>(
        self,
        path: &'static str,
        request: tonic::Request<Req>,
    ) -> impl std::future::Future<Output = Result<tonic::Response<Resp>, Status>>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        self.unary_large(path, request, |_| None)
    }

    /// [`unary`](Self::unary) for a request with `bytes` fields: `take`
    /// takes a large one out of the request (`rpc_core::direct::take_large`),
    /// whose bytes then go to the transport uncopied, after the others.
    pub async fn unary_large<Req, Resp>(
        self,
        path: &'static str,
        request: tonic::Request<Req>,
        take: impl FnOnce(&mut Req) -> Option<(u32, bytes::Bytes)>,
    ) -> Result<tonic::Response<Resp>, Status>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        let limit = self.max_decoding_message_size;
        let call = self.prepare(path, request, take)?;
        match call.deadline {
            None => unary_call(call, limit).await,
            Some((at, t)) => tokio::time::timeout_at(at, unary_call(call, limit))
                .await
                .unwrap_or_else(|_| Err(deadline_status(t))),
        }
    }

    /// A server-streaming call to `path`: the replies as tonic's
    /// `Streaming`, decoded by tonic-prost's decoder from the received
    /// bytes.
    pub async fn server_streaming<Req, Resp>(
        self,
        path: &'static str,
        request: tonic::Request<Req>,
    ) -> Result<tonic::Response<tonic::Streaming<Resp>>, Status>
    where
        Req: prost::Message,
        Resp: prost::Message + Default + Send + 'static,
    {
        let limit = self.max_decoding_message_size;
        let keepalive: Arc<dyn std::any::Any + Send + Sync> = self.chan.clone();
        let prepared = self.prepare(path, request, |_| None)?;
        let deadline = prepared.deadline;
        let work = async {
            let mut call = open_call(prepared).await?;
            if let Some((at, t)) = call.deadline {
                // The deadline covers the reply stream too, after this
                // function returned: a timer resets the call then.
                let s = call.shared.clone();
                let stream = call.stream;
                let timer = tokio::spawn(async move {
                    tokio::time::sleep_until(at).await;
                    s.reset_stream(stream, deadline_status(t));
                });
                call.guard.timer = Some(timer.abort_handle());
            }
            let headers =
                match first(&mut call.rx, &call.shared, call.stream, &mut call.guard).await? {
                    Ok(h) => h,
                    Err(trailers) => {
                        call.guard.done = true;
                        // Trailers-only: an error, or an empty stream.
                        if let Some(st) = Status::from_header_map(&trailers) {
                            if st.code() != Code::Ok {
                                return Err(st);
                            }
                        }
                        let decoder =
                            tonic_prost::ProstCodec::<(), Resp>::raw_decoder(Default::default());
                        return Ok(tonic::Response::from_parts(
                            MetadataMap::from_headers(trailers),
                            tonic::Streaming::new_empty(
                                decoder,
                                http_body_util::Empty::<bytes::Bytes>::new(),
                            ),
                            http::Extensions::new(),
                        ));
                    }
                };
            let Opened {
                shared,
                stream,
                rx,
                guard,
                ..
            } = call;
            let body = RecvBody::new(rx, shared.clone(), stream, Some(guard), Some(keepalive));
            let decoder = tonic_prost::ProstCodec::<(), Resp>::raw_decoder(Default::default());
            let replies =
                tonic::Streaming::new_response(decoder, body, http::StatusCode::OK, None, limit);
            let mut ext = http::Extensions::new();
            ext.insert(shared.info.clone());
            Ok(tonic::Response::from_parts(
                MetadataMap::from_headers(headers),
                replies,
                ext,
            ))
        };
        match deadline {
            None => work.await,
            Some((at, t)) => tokio::time::timeout_at(at, work)
                .await
                .unwrap_or_else(|_| Err(deadline_status(t))),
        }
    }

    /// Encodes the request: the call, ready to open ([`open_call`]).
    fn prepare<Req: prost::Message>(
        self,
        path: &'static str,
        request: tonic::Request<Req>,
        take: impl FnOnce(&mut Req) -> Option<(u32, bytes::Bytes)>,
    ) -> Result<Prepared, Status> {
        CALLED.fetch_add(1, Ordering::Relaxed);
        let (md, _ext, msg) = request.into_parts();
        let mut md = message::sanitized(md);
        if let Some(t) = self.channel_timeout {
            timeout::cap_grpc_timeout(&mut md, t);
        }
        // The deadline travels in OPEN (§1.3), not as metadata.
        let call_timeout = md
            .remove(const { http::HeaderName::from_static("grpc-timeout") })
            .and_then(|v| v.to_str().ok().and_then(timeout::parse));
        // A request the encoder refuses fails as tonic's client fails it
        // (over HTTP/2 and the call protocol alike): INTERNAL, the request
        // body's error, with the encoder's status in its text.
        let data = message::encode_split(msg, self.max_encoding_message_size, take)
            .map_err(|e| Status::internal(format!("request body failed: {e}")))?;
        Ok(Prepared {
            chan: self.chan,
            reserved: self.slot.filter(|(s, _)| !s.is_unusable()),
            path,
            md,
            data,
            deadline: call_timeout.map(|t| (Instant::now() + t, t)),
        })
    }
}

/// A call whose request is encoded ([`Call::prepare`]), to open.
struct Prepared {
    chan: Arc<MsgChannel>,
    /// A call slot reserved before, still usable.
    reserved: Option<Slot>,
    path: &'static str,
    md: http::HeaderMap,
    data: Encoded,
    deadline: Option<(Instant, Duration)>,
}

// The call's futures are plain functions returning `async` blocks, not
// `async fn`s: an `async fn` keeps its arguments twice in its state (the
// arguments, and the locals they move into), and every move of a future
// copies all of its state.

/// A unary call: open, then its response.
#[allow(clippy::manual_async_fn)] // see above: not an `async fn` by design
fn unary_call<Resp: prost::Message + Default>(
    call: Prepared,
    limit: Option<usize>,
) -> impl std::future::Future<Output = Result<tonic::Response<Resp>, Status>> {
    async move {
        let Opened {
            shared,
            stream,
            mut rx,
            mut guard,
            ..
        } = open_call(call).await?;
        let headers = first(&mut rx, &shared, stream, &mut guard).await?;
        let body = RecvBody::new(rx, shared.clone(), stream, None, None);
        let r = read_unary(headers, body, &shared, limit).await;
        // Whatever ended it (its trailers, a reset, a protocol error
        // that reset it already), the call is over on this side.
        guard.done = true;
        r
    }
}

/// Opens `call`: a call slot, OPEN and the request's DATA(END_STREAM)
/// (one BATCH message, §1.7).
#[allow(clippy::manual_async_fn)] // see above: not an `async fn` by design
fn open_call(call: Prepared) -> impl std::future::Future<Output = Result<Opened, Status>> {
    async move {
        let Prepared {
            chan,
            reserved,
            path,
            md,
            data,
            deadline,
        } = call;
        let (shared, permit) = chan.slot(reserved).await?;
        let limit = shared.peer.max_metadata_bytes as usize;
        let ua = [("user-agent", chan.user_agent.as_bytes())];
        let extra: &[(&str, &[u8])] = if md.contains_key(http::header::USER_AGENT) {
            &[]
        } else {
            &ua
        };
        let remaining = deadline.map(|(at, _)| at.saturating_duration_since(Instant::now()));
        // Metadata over the server's limit is never sent: the call ends
        // here, with the reason (before a call is opened).
        let n = data.head.len() + data.tail.len();
        let md_wire = frame::check_metadata_with(&md, extra, limit).map_err(|e| {
            Status::resource_exhausted(format!(
                "request metadata not sent: {e} (the server's max_metadata_bytes)"
            ))
        })?;
        let len = frame::open_request_len(path, md_wire, n);
        // Usually the OPEN and the whole request leave as one BATCH,
        // written at once. Neither encoding below can fail: the metadata
        // was checked just above.
        let together = shared.try_open_with_request(n, len, |id| {
            let (a, b) = (&data.head[..], &data.tail[..]);
            frame::encode_open_request(id, path, remaining, &md, extra, md_wire, a, b)
                .unwrap_or_default()
        })?;
        let sent = together.is_some();
        let (stream, rx, window) = match together {
            Some(opened) => opened,
            // The request's DATA(END_STREAM) follows the OPEN at once.
            None => shared.open_stream(
                |id| {
                    frame::encode_open_with(id, path, remaining, &md, extra, false, limit)
                        .unwrap_or_default()
                },
                true,
            )?,
        };
        drop(md);
        let guard = CallGuard {
            shared: shared.clone(),
            stream,
            done: false,
            _permit: Some(permit),
            timer: None,
        };
        // If the call ended early (the server answered, or reset it),
        // the answer is in `rx`: read it rather than report the send.
        if !sent {
            let _ = shared
                .send_message(stream, &window, data, true, false)
                .await;
        }
        Ok(Opened {
            shared,
            stream,
            rx,
            guard,
            deadline,
        })
    }
}

/// The response's first frame: its HEADERS (`Ok`), or the TRAILERS of a
/// trailers-only response (`Err`); a reset or a lost connection is the
/// error, which ends the call.
async fn first(
    rx: &mut InboundRx,
    shared: &Shared,
    stream: u32,
    guard: &mut CallGuard,
) -> Result<Result<http::HeaderMap, http::HeaderMap>, Status> {
    let r = match rx.recv().await {
        Some(Inbound::Headers(h)) => return Ok(Ok(h)),
        Some(Inbound::Trailers(t)) => return Ok(Err(t)),
        Some(Inbound::TrailersOk) => return Ok(Err(crate::protocol::session::ok_trailers())),
        Some(Inbound::Reset(s)) => Err(s),
        Some(other) => {
            let st = Status::internal(format!("protocol error: response began with {other:?}"));
            shared.reset_stream(stream, st.clone());
            Err(st)
        }
        None => Err(shared.closed_status()),
    };
    guard.done = true;
    r
}

/// `st` with the response headers' metadata too (as tonic's client
/// reports a failed response).
fn with_headers(headers: &http::HeaderMap, mut st: Status) -> Status {
    let mut md = std::mem::take(st.metadata_mut()).into_headers();
    md.extend(headers.clone());
    *st.metadata_mut() = MetadataMap::from_headers(md);
    st
}

/// A unary response after its first frame: its one message, and the
/// status in its trailers (as tonic's client reads it: the trailers'
/// metadata joins the headers').
async fn read_unary<Resp: prost::Message + Default>(
    first: Result<http::HeaderMap, http::HeaderMap>,
    mut body: RecvBody,
    shared: &Shared,
    limit: Option<usize>,
) -> Result<tonic::Response<Resp>, Status> {
    let mut headers = match first {
        Ok(h) => h,
        Err(trailers) => {
            return Err(match Status::from_header_map(&trailers) {
                Some(st) if st.code() != Code::Ok => st,
                _ => Status::internal("Missing response message."),
            })
        }
    };
    let mut reader = message::Reader::new(limit);
    let msg: Resp = match reader.next(&mut body).await {
        Ok(Ok(m)) => m,
        Ok(Err(End::Trailers(t))) => {
            headers.extend(t);
            return Err(match Status::from_header_map(&headers) {
                Some(st) if st.code() != Code::Ok => st,
                _ => Status::internal("Missing response message."),
            });
        }
        Ok(Err(End::TrailersOk | End::Eof)) => {
            return Err(Status::internal("Missing response message."))
        }
        Err(st) => return Err(with_headers(&headers, st)),
    };
    // Then the trailers (further messages, which a unary call does not
    // have, are read past as tonic does). They join the headers as
    // tonic's client merges them (`grpc-status` included).
    loop {
        match reader.next::<Resp>(&mut body).await {
            Ok(Ok(_)) => continue,
            Ok(Err(End::TrailersOk)) => {
                // The room for it was kept when the headers were decoded.
                headers.insert(
                    const { http::HeaderName::from_static("grpc-status") },
                    http::HeaderValue::from_static("0"),
                );
                break;
            }
            Ok(Err(End::Trailers(t))) => {
                let ok = t.get("grpc-status").is_none_or(|v| v == "0");
                headers.extend(t);
                if !ok {
                    if let Some(st) = Status::from_header_map(&headers) {
                        return Err(st);
                    }
                }
                break;
            }
            Ok(Err(End::Eof)) => break,
            Err(st) => return Err(with_headers(&headers, st)),
        }
    }
    let mut ext = http::Extensions::new();
    ext.insert(shared.info.clone());
    Ok(tonic::Response::from_parts(
        MetadataMap::from_headers(headers),
        msg,
        ext,
    ))
}
