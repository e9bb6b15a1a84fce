//! The echo/bench service used by the behaviour tests and the benchmark.

use crate::pb::echo::echo_server::Echo;
use crate::pb::echo::{EchoRequest, EchoResponse};
use bytes::Bytes;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::MetadataMap;
use tonic::{Code, Request, Response, Status, Streaming};

/// Counters a test can read to see what the handlers went through.
#[derive(Debug, Default)]
pub struct EchoStats {
    /// Handlers started.
    pub started: AtomicUsize,
    /// Handlers that ran to completion.
    pub completed: AtomicUsize,
    /// Handlers dropped before completing (client cancel, deadline, disconnect).
    pub cancelled: AtomicUsize,
}

/// Echoes payloads back; behaviour knobs are in the request.
#[derive(Debug, Clone, Default)]
pub struct EchoService {
    /// Shared counters.
    pub stats: Arc<EchoStats>,
}

/// Counts a handler as cancelled if dropped before `done()`.
struct Track {
    stats: Arc<EchoStats>,
    done: bool,
}

impl Track {
    fn new(stats: &Arc<EchoStats>) -> Track {
        stats.started.fetch_add(1, Ordering::SeqCst);
        Track {
            stats: stats.clone(),
            done: false,
        }
    }
    fn done(mut self) {
        self.done = true;
        self.stats.completed.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        if !self.done {
            self.stats.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Copies `x-echo-*` request metadata into a response's metadata.
fn echo_metadata(from: &MetadataMap, to: &mut MetadataMap) {
    for kv in from.iter() {
        match kv {
            tonic::metadata::KeyAndValueRef::Ascii(k, v) if k.as_str().starts_with("x-echo-") => {
                to.insert(k.clone(), v.clone());
            }
            tonic::metadata::KeyAndValueRef::Binary(k, v) if k.as_str().starts_with("x-echo-") => {
                to.insert_bin(k.clone(), v.clone());
            }
            _ => {}
        }
    }
}

/// The status a request asks for, with details and trailer metadata.
/// A unary request with this message makes the handler panic (after its
/// `delay_ms`): for tests of what a server does with a panicking handler.
pub const PANIC_MESSAGE: &str = "panic, as a test asks";

fn requested_failure(req: &EchoRequest) -> Option<Status> {
    if req.fail_with_code == 0 {
        return None;
    }
    let mut md = MetadataMap::new();
    md.insert("x-trailer-reason", "requested".parse().unwrap());
    let details = match req.status_details_bytes {
        0 => Bytes::from_static(b"\x08\x2a detail-bytes"),
        n => Bytes::from(vec![0x5A; n as usize]),
    };
    Some(Status::with_details_and_metadata(
        Code::from_i32(req.fail_with_code),
        format!("failing as asked: {}", req.message),
        details,
        md,
    ))
}

fn reply(req: &EchoRequest, seq: u32) -> EchoResponse {
    let payload = if req.reply_bytes > 0 {
        Bytes::from(vec![0xA5u8; req.reply_bytes as usize])
    } else {
        // The request's bytes, shared: no copy.
        req.payload.clone()
    };
    EchoResponse {
        message: req.message.clone(),
        payload,
        seq,
        crc32: if req.no_checksum {
            0
        } else {
            crc32fast::hash(&req.payload)
        },
    }
}

type RespStream = Pin<Box<dyn Stream<Item = Result<EchoResponse, Status>> + Send>>;

/// A response stream that counts its call completed when it ends and
/// cancelled when it is dropped before.
struct Tracked<S> {
    inner: S,
    track: Option<Track>,
}

impl<S: Stream + Unpin> Stream for Tracked<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        let r = Pin::new(&mut self.inner).poll_next(cx);
        if let std::task::Poll::Ready(None) = r {
            if let Some(t) = self.track.take() {
                t.done();
            }
        }
        r
    }
}

#[tonic::async_trait]
impl Echo for EchoService {
    async fn unary_echo(
        &self,
        request: Request<EchoRequest>,
    ) -> Result<Response<EchoResponse>, Status> {
        let track = Track::new(&self.stats);
        let md = request.metadata().clone();
        let req = request.into_inner();
        if req.delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(req.delay_ms.into())).await;
        }
        if req.message == PANIC_MESSAGE {
            track.done();
            panic!("the echo handler panics, as the request asked");
        }
        if let Some(s) = requested_failure(&req) {
            track.done();
            return Err(s);
        }
        let mut resp = Response::new(reply(&req, 0));
        echo_metadata(&md, resp.metadata_mut());
        track.done();
        Ok(resp)
    }

    type ServerStreamingEchoStream = RespStream;

    async fn server_streaming_echo(
        &self,
        request: Request<EchoRequest>,
    ) -> Result<Response<RespStream>, Status> {
        let md = request.metadata().clone();
        let req = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let track = Track::new(&self.stats);
        tokio::spawn(async move {
            for seq in 0..req.count {
                if req.delay_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(req.delay_ms.into())).await;
                }
                if tx.send(Ok(reply(&req, seq))).await.is_err() {
                    return; // client went away: `track` counts a cancel
                }
            }
            if let Some(s) = requested_failure(&req) {
                let _ = tx.send(Err(s)).await;
            }
            track.done();
        });
        let mut resp = Response::new(Box::pin(ReceiverStream::new(rx)) as RespStream);
        echo_metadata(&md, resp.metadata_mut());
        Ok(resp)
    }

    async fn client_streaming_echo(
        &self,
        request: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<EchoResponse>, Status> {
        let track = Track::new(&self.stats);
        let mut stream = request.into_inner();
        let mut n = 0u32;
        let mut hasher = crc32fast::Hasher::new();
        let mut last = EchoRequest::default();
        while let Some(m) = stream.next().await {
            let m = m?;
            n += 1;
            hasher.update(&m.payload);
            last = m;
        }
        if let Some(s) = requested_failure(&last) {
            track.done();
            return Err(s);
        }
        track.done();
        Ok(Response::new(EchoResponse {
            message: last.message,
            payload: Bytes::new(),
            seq: n,
            crc32: hasher.finalize(),
        }))
    }

    type BidirectionalStreamingEchoStream = RespStream;

    async fn bidirectional_streaming_echo(
        &self,
        request: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<RespStream>, Status> {
        let mut stream = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        // The call is the response stream: it completes when the server has
        // sent its end, and is cancelled when the server drops it before
        // (tonic ends a request stream the client cancelled as if the client
        // had half-closed, so the request side cannot tell).
        let track = Track::new(&self.stats);
        tokio::spawn(async move {
            let mut seq = 0;
            while let Some(m) = stream.next().await {
                let item = m.map(|req| {
                    seq += 1;
                    reply(&req, seq - 1)
                });
                if tx.send(item).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(Tracked {
            inner: ReceiverStream::new(rx),
            track: Some(track),
        }) as RespStream))
    }
}
