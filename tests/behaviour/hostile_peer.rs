//! A peer that speaks the call protocol wrongly on purpose (over the in-memory
//! connection, driven frame by frame): each misbehaviour gets a clear error and
//! the connection is closed, or the call rejected with the right status, while
//! other connections to the same server keep working.
use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use rpc_core::conn::{mem, Connection, FrameReceiver, FrameSender};
use rpc_core::frame::{self, DecodeLimits, Frame, Hello};
use rpc_core::{ConnInfo, Router, TransportKind};
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

const LIM: DecodeLimits = DecodeLimits {
    max_metadata_bytes: 1 << 20,
};

struct RawPeer {
    tx: mem::MemSender,
    rx: mem::MemReceiver,
    server_hello: Hello,
}

impl RawPeer {
    async fn connect(router: &Router) -> RawPeer {
        let (a, b) = mem::pair();
        let info = ConnInfo {
            transport: TransportKind::Memory,
            peer: None,
        };
        let r = router.clone();
        let server = tokio::spawn(async move { r.serve_connection(b, info).await });
        let (mut tx, mut rx) = a.split();
        tx.send(frame::encode_hello(&Hello {
            version: frame::PROTOCOL_VERSION,
            features: 0,
            max_concurrent_calls: 100,
            initial_window: 1 << 20,
            max_metadata_bytes: 16 << 10,
            connection_window: 1 << 30,
        }))
        .await
        .unwrap();
        let first = rx.recv().await.unwrap().unwrap();
        server.await.unwrap().unwrap();
        let Frame::Hello(server_hello) = frame::decode(first, &LIM).unwrap() else {
            panic!("HELLO first")
        };
        RawPeer {
            tx,
            rx,
            server_hello,
        }
    }

    async fn send(&mut self, f: Bytes) {
        // The server may already have closed: that is what some tests expect.
        let _ = self.tx.send(f).await;
    }

    /// Frames until the server closes the connection (or `limit` passes).
    async fn frames_until_close(&mut self, limit: Duration) -> (Vec<Frame>, bool) {
        let mut out = vec![];
        let end = tokio::time::Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(end, self.rx.recv()).await {
                Ok(Ok(Some(b))) => {
                    out.push(frame::decode(b, &LIM).expect("server frames are well-formed"))
                }
                Ok(Ok(None)) | Ok(Err(_)) => return (out, true),
                Err(_) => return (out, false),
            }
        }
    }
}

fn grpc_message(req: &EchoRequest) -> Bytes {
    let body = req.encode_to_vec();
    let mut b = BytesMut::with_capacity(5 + body.len());
    b.put_u8(0);
    b.put_u32(body.len() as u32);
    b.put_slice(&body);
    b.freeze()
}

fn open(stream: u32) -> Bytes {
    let mut md = http::HeaderMap::new();
    md.insert("content-type", "application/grpc".parse().unwrap());
    frame::encode_open(stream, "/echo.Echo/UnaryEcho", None, &md, false)
}

fn goaway_code(frames: &[Frame]) -> Option<u32> {
    frames.iter().find_map(|f| match f {
        Frame::GoAway { code, .. } => Some(*code),
        _ => None,
    })
}

/// A well-behaved client on another connection still gets answers.
async fn others_still_work(server: &rpc_core::MemoryServer) {
    let ch = server.channel().await.unwrap();
    let r = EchoClient::new(ch)
        .unary_echo(EchoRequest {
            message: "fine".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.into_inner().message, "fine");
}

fn setup(limit: Option<usize>) -> (Router, rpc_core::MemoryServer) {
    let stats = Arc::new(Default::default());
    let mut b = rpc_core::Server::builder();
    if let Some(l) = limit {
        b = b.concurrency_limit_per_connection(l);
    }
    let router = b.add_service(rpc_examples::pb::echo::echo_server::EchoServer::new(
        rpc_examples::echo::EchoService { stats },
    ));
    (router.clone(), router.into_memory())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frame_closes_the_connection() {
    let (router, server) = setup(None);
    let mut p = RawPeer::connect(&router).await;
    p.send(Bytes::from_static(&[0x02, 0, 0, 0])).await; // shorter than a frame header
    let (frames, closed) = p.frames_until_close(Duration::from_secs(5)).await;
    assert!(closed, "connection closed");
    assert_eq!(
        goaway_code(&frames),
        Some(Code::Internal as u32),
        "{frames:?}"
    );
    others_still_work(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_beyond_the_window_closes_the_connection() {
    let (router, server) = setup(None);
    let mut p = RawPeer::connect(&router).await;
    let window = p.server_hello.initial_window as usize;
    p.send(open(1)).await;
    let chunk = vec![0u8; 1 << 20];
    let mut sent = 0;
    while sent <= window {
        p.send(frame::encode_data(1, &chunk, false)).await;
        sent += chunk.len();
    }
    let (frames, closed) = p.frames_until_close(Duration::from_secs(5)).await;
    assert!(
        closed,
        "connection closed after {sent} bytes into a {window}-byte window"
    );
    assert_eq!(
        goaway_code(&frames),
        Some(Code::Internal as u32),
        "{frames:?}"
    );
    others_still_work(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_or_decreasing_call_ids_close_the_connection() {
    let (router, server) = setup(None);
    let mut p = RawPeer::connect(&router).await;
    p.send(open(5)).await;
    p.send(open(3)).await;
    let (frames, closed) = p.frames_until_close(Duration::from_secs(5)).await;
    assert!(closed);
    assert_eq!(
        goaway_code(&frames),
        Some(Code::Internal as u32),
        "{frames:?}"
    );
    others_still_work(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_calls_than_allowed_are_rejected() {
    let (router, server) = setup(Some(2));
    let mut p = RawPeer::connect(&router).await;
    assert_eq!(p.server_hello.max_concurrent_calls, 2);
    let slow = grpc_message(&EchoRequest {
        delay_ms: 3_000,
        ..Default::default()
    });
    for id in [1, 3, 5] {
        p.send(open(id)).await;
        p.send(frame::encode_data(id, &slow, true)).await;
    }
    let (frames, _) = p.frames_until_close(Duration::from_millis(1500)).await;
    let reset = frames.iter().find_map(|f| match f {
        Frame::Reset {
            stream: 5,
            code,
            message,
        } => Some((*code, message.clone())),
        _ => None,
    });
    let (code, message) = reset.expect("the third call is reset");
    assert_eq!(code, Code::ResourceExhausted as u32);
    assert!(message.contains("limit 2"), "{message}");
    others_still_work(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_metadata_closes_the_connection() {
    let (router, server) = setup(None);
    let mut p = RawPeer::connect(&router).await;
    let limit = p.server_hello.max_metadata_bytes as usize;
    let mut md = http::HeaderMap::new();
    md.insert("x-big", "a".repeat(limit + 1).parse().unwrap());
    p.send(frame::encode_open(
        1,
        "/echo.Echo/UnaryEcho",
        None,
        &md,
        false,
    ))
    .await;
    let (frames, closed) = p.frames_until_close(Duration::from_secs(5)).await;
    assert!(closed);
    assert_eq!(
        goaway_code(&frames),
        Some(Code::ResourceExhausted as u32),
        "{frames:?}"
    );
    others_still_work(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_returns_credit_gets_no_more_than_its_window() {
    let (router, server) = setup(None);
    let mut p = RawPeer::connect(&router).await;
    // Server streaming of 64 KiB messages, far more than the 1 MiB window we granted.
    let req = grpc_message(&EchoRequest {
        count: 1000,
        reply_bytes: 64 << 10,
        ..Default::default()
    });
    let mut md = http::HeaderMap::new();
    md.insert("content-type", "application/grpc".parse().unwrap());
    p.send(frame::encode_open(
        1,
        "/echo.Echo/ServerStreamingEcho",
        None,
        &md,
        false,
    ))
    .await;
    p.send(frame::encode_data(1, &req, true)).await;
    let (frames, closed) = p.frames_until_close(Duration::from_secs(2)).await;
    assert!(
        !closed,
        "the server waits, it does not give up the connection"
    );
    let data: usize = frames
        .iter()
        .map(|f| match f {
            Frame::Data { data, .. } => data.len(),
            _ => 0,
        })
        .sum();
    assert!(data > 0, "some data flowed");
    assert!(data <= 1 << 20, "{data} bytes sent into a 1 MiB window");
    others_still_work(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_its_handlers() {
    let stats: Arc<rpc_examples::echo::EchoStats> = Arc::new(Default::default());
    let router = rpc_core::Server::builder().add_service(
        rpc_examples::pb::echo::echo_server::EchoServer::new(rpc_examples::echo::EchoService {
            stats: stats.clone(),
        }),
    );
    let mut p = RawPeer::connect(&router).await;
    let slow = grpc_message(&EchoRequest {
        delay_ms: 30_000,
        ..Default::default()
    });
    for id in [1, 3] {
        p.send(open(id)).await;
        p.send(frame::encode_data(id, &slow, true)).await;
    }
    assert!(
        rpc_tests::eventually(Duration::from_secs(5), || stats
            .started
            .load(std::sync::atomic::Ordering::SeqCst)
            == 2)
        .await
    );
    drop(p); // the connection goes away without RESET or GOAWAY
    assert!(
        rpc_tests::eventually(Duration::from_secs(5), || stats
            .cancelled
            .load(std::sync::atomic::Ordering::SeqCst)
            == 2)
        .await,
        "both handlers cancelled when the client disconnected"
    );
}
