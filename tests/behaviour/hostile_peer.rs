//! A peer that speaks the call protocol wrongly on purpose, driven frame by
//! frame, over the in-memory connection and over a real RDMA connection to a
//! server's rdma_cm listener (in the VM): each misbehaviour gets a clear error
//! and the connection is closed, or the call rejected with the right status,
//! while other connections to the same server keep working. Each violation is
//! checked by its [`PeerMisbehaved`] variant, as the server reports it to its
//! `on_peer_misbehaved` hook. Violations of the
//! RDMA wire protocol itself (credits, rendezvous notifications, rkeys) are in
//! `rdma-transport/tests/hostile.rs`.
use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use rpc_core::__private::frame::{self, DecodeLimits, Frame, FrameError, Hello};
use rpc_core::__private::{RdmaConnection, RdmaReceiver, RdmaSender};
use rpc_core::conn::{mem, Connection, FrameReceiver, FrameSender};
use rpc_core::{ConnInfo, PeerMisbehaved, Router, TransportKind};
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

/// How long a test waits for the server to close a misbehaving peer's
/// connection, or to report the violation: a bound for a busy emulated VM,
/// not a timing (each wait ends as soon as it happens).
const CLOSE_WITHIN: Duration = Duration::from_secs(30);

const LIM: DecodeLimits = DecodeLimits {
    max_metadata_bytes: 1 << 20,
};

/// The raw peer's link to the server: the in-memory pair, or a real
/// rdma-transport connection to the server's RDMA listener (a well-formed
/// transport carrying a call protocol that is wrong on purpose).
enum Link {
    Mem(mem::MemSender, mem::MemReceiver),
    Rdma(RdmaSender, RdmaReceiver),
}

struct RawPeer {
    link: Link,
    server_hello: Hello,
}

/// Where the server under attack runs.
#[derive(Clone, Copy, Debug)]
enum Over {
    Memory,
    Rdma,
}

/// The server under attack: `router` on the in-memory transport, or a real
/// server with an RDMA listener (in the VM).
struct Harness {
    router: Router,
    memory: Option<rpc_core::MemoryServer>,
    net: Option<rpc_core::ServingHandle>,
    /// What the server's `on_peer_misbehaved` hook reported, in order.
    seen: Seen,
}

type Seen = Arc<std::sync::Mutex<Vec<PeerMisbehaved>>>;

impl Harness {
    /// `None` (the test is skipped, with a printed reason) when `over` is
    /// RDMA and this host has no device, unless one is required.
    async fn start(over: Over, router: Router, seen: Seen) -> Option<Harness> {
        match over {
            Over::Memory => Some(Harness {
                memory: Some(router.clone().into_memory()),
                router,
                net: None,
                seen,
            }),
            Over::Rdma => {
                let Some(ip) = rpc_tests::rdma_ip() else {
                    assert!(
                        !rpc_tests::device_required(),
                        "an RDMA device is required but SOFTROCE_IP / RDMA_TEST_IP is not set"
                    );
                    println!("SKIP: no RDMA test address (SOFTROCE_IP / RDMA_TEST_IP unset)");
                    return None;
                };
                let h = router
                    .clone()
                    .start(format!("{ip}:0").parse().unwrap())
                    .await
                    .expect("server starts");
                if h.rdma_addr().is_none() {
                    assert!(
                        !rpc_tests::device_required(),
                        "an RDMA device is required but the server has no RDMA listener"
                    );
                    println!("SKIP: no RDMA device for {ip}");
                    return None;
                }
                Some(Harness {
                    router,
                    memory: None,
                    net: Some(h),
                    seen,
                })
            }
        }
    }

    async fn raw_peer(&self) -> RawPeer {
        let mut link = match &self.net {
            None => {
                let (a, b) = mem::pair();
                let info = ConnInfo::new(TransportKind::Memory, None);
                let r = self.router.clone();
                tokio::spawn(async move { r.serve_connection(b, info).await });
                let (tx, rx) = a.split();
                Link::Mem(tx, rx)
            }
            Some(h) => {
                let c = rdma_transport::connect(
                    h.rdma_addr().unwrap(),
                    &rdma_transport::Config::default(),
                )
                .await
                .expect("RDMA connection to the server");
                let (tx, rx) = RdmaConnection::new(c).split();
                Link::Rdma(tx, rx)
            }
        };
        let hello = frame::encode_hello(&Hello {
            version: frame::PROTOCOL_VERSION,
            features: 0,
            max_concurrent_calls: 100,
            initial_window: 1 << 20,
            max_metadata_bytes: 16 << 10,
            connection_window: 1 << 30,
        });
        link.send(hello).await.unwrap();
        let first = link.recv().await.unwrap().unwrap();
        let Frame::Hello(server_hello) = frame::decode(first, &LIM).unwrap() else {
            panic!("HELLO first")
        };
        RawPeer { link, server_hello }
    }

    /// The one violation the server reported (waits a little for the hook).
    async fn violation(&self) -> PeerMisbehaved {
        let seen = self.seen.clone();
        rpc_tests::eventually(CLOSE_WITHIN, || !seen.lock().unwrap().is_empty()).await;
        let v = self.seen.lock().unwrap();
        assert_eq!(v.len(), 1, "one violation reported: {v:?}");
        v[0].clone()
    }

    /// No violation was reported.
    fn no_violation(&self) {
        let v = self.seen.lock().unwrap();
        assert!(v.is_empty(), "no violation expected, got {v:?}");
    }

    /// A well-behaved client on another connection still gets answers.
    async fn others_still_work(&self) {
        let ch = match (&self.memory, &self.net) {
            (Some(m), _) => m.channel().await.unwrap(),
            (_, Some(h)) => rpc_core::Channel::from_shared(h.rdma_addr().unwrap().to_string())
                .unwrap()
                .transport(rpc_core::Transport::RdmaOnly)
                .connect()
                .await
                .expect("a good client connects over RDMA"),
            _ => unreachable!("a harness has a server"),
        };
        let r = EchoClient::new(ch)
            .unary_echo(EchoRequest {
                message: "fine".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(r.into_inner().message, "fine");
    }
}

impl Link {
    async fn send(&mut self, f: Bytes) -> std::io::Result<()> {
        match self {
            Link::Mem(tx, _) => tx.send(f).await,
            Link::Rdma(tx, _) => tx.send(f).await,
        }
    }
    async fn recv(&mut self) -> std::io::Result<Option<Bytes>> {
        match self {
            Link::Mem(_, rx) => rx.recv().await,
            Link::Rdma(_, rx) => rx.recv().await,
        }
    }
}

impl RawPeer {
    async fn send(&mut self, f: Bytes) {
        // The server may already have closed: that is what some tests expect.
        let _ = self.link.send(f).await;
    }

    /// Frames until the server closes the connection (or `limit` passes).
    async fn frames_until_close(&mut self, limit: Duration) -> (Vec<Frame>, bool) {
        let mut out = vec![];
        let end = tokio::time::Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(end, self.link.recv()).await {
                Ok(Ok(Some(b))) => {
                    out.push(frame::decode(b, &LIM).expect("server frames are well-formed"))
                }
                Ok(Ok(None)) | Ok(Err(_)) => return (out, true),
                Err(_) => return (out, false),
            }
        }
    }
}

/// One test per transport (memory, RDMA) for a hostile-peer `async fn(Over)`.
macro_rules! over_memory_and_rdma {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                let t = std::time::Duration::from_secs(60);
                tokio::time::timeout(t, super::$name(super::Over::Memory))
                    .await
                    .expect("finished within 60 s")
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
            async fn rdma() {
                let t = std::time::Duration::from_secs(120);
                tokio::time::timeout(t, super::$name(super::Over::Rdma))
                    .await
                    .expect("finished within 120 s")
            }
        }
    )*};
}

over_memory_and_rdma!(
    malformed_frame_closes_the_connection,
    window_overflow_and_second_hello_close_the_connection,
    data_beyond_the_window_closes_the_connection,
    reused_or_decreasing_call_ids_close_the_connection,
    more_calls_than_allowed_are_rejected,
    oversized_metadata_closes_the_connection,
    a_peer_that_never_returns_credit_gets_no_more_than_its_window,
    client_disconnect_cancels_its_handlers,
    the_server_ends_a_call_past_its_deadline_itself,
);

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
    frame::encode_open(stream, "/echo.Echo/UnaryEcho", None, &md, false, usize::MAX).unwrap()
}

fn goaway_code(frames: &[Frame]) -> Option<u32> {
    frames.iter().find_map(|f| match f {
        Frame::GoAway { code, .. } => Some(*code),
        _ => None,
    })
}

fn echo_router(
    limit: Option<usize>,
    stats: Arc<rpc_examples::echo::EchoStats>,
    seen: &Seen,
) -> Router {
    let seen = seen.clone();
    let mut b = rpc_core::Server::builder()
        .on_peer_misbehaved(move |_, e| seen.lock().unwrap().push(e.clone()));
    if let Some(l) = limit {
        b = b.concurrency_limit_per_connection(l);
    }
    b.add_service(rpc_examples::pb::echo::echo_server::EchoServer::new(
        rpc_examples::echo::EchoService { stats },
    ))
}

async fn setup(over: Over, limit: Option<usize>) -> Option<Harness> {
    setup_with_stats(over, limit, Arc::new(Default::default())).await
}

async fn setup_with_stats(
    over: Over,
    limit: Option<usize>,
    stats: Arc<rpc_examples::echo::EchoStats>,
) -> Option<Harness> {
    let seen = Seen::default();
    Harness::start(over, echo_router(limit, stats, &seen), seen).await
}

async fn malformed_frame_closes_the_connection(over: Over) {
    let Some(h) = setup(over, None).await else {
        return;
    };
    let mut p = h.raw_peer().await;
    p.send(Bytes::from_static(&[0x02, 0, 0, 0])).await; // shorter than a frame header
    let (frames, closed) = p.frames_until_close(CLOSE_WITHIN).await;
    assert!(closed, "connection closed");
    assert_eq!(
        goaway_code(&frames),
        Some(Code::Internal as u32),
        "{frames:?}"
    );
    assert_eq!(
        h.violation().await,
        PeerMisbehaved::Malformed(FrameError::Truncated("frame header"))
    );
    h.others_still_work().await;
}

async fn window_overflow_and_second_hello_close_the_connection(over: Over) {
    let Some(h) = setup(over, None).await else {
        return;
    };
    // The connection's send window is what our HELLO granted (1 GiB): a
    // WINDOW_UPDATE that takes it past 2^31 - 1 overflows it (§1.4).
    let mut p = h.raw_peer().await;
    p.send(frame::encode_window_update(0, i32::MAX as u32))
        .await;
    let (frames, closed) = p.frames_until_close(CLOSE_WITHIN).await;
    assert!(closed, "connection closed");
    assert_eq!(
        goaway_code(&frames),
        Some(Code::Internal as u32),
        "{frames:?}"
    );
    assert_eq!(
        h.violation().await,
        PeerMisbehaved::WindowOverflow {
            stream: 0,
            window: 1 << 30,
            increment: i32::MAX as u32
        }
    );
    h.seen.lock().unwrap().clear();

    // A second HELLO after the handshake (§1.1), on a connection of its own.
    let mut p = h.raw_peer().await;
    p.send(frame::encode_hello(&p.server_hello)).await;
    let (_, closed) = p.frames_until_close(CLOSE_WITHIN).await;
    assert!(closed, "connection closed");
    assert_eq!(h.violation().await, PeerMisbehaved::SecondHello);
    h.others_still_work().await;
}

async fn data_beyond_the_window_closes_the_connection(over: Over) {
    let Some(h) = setup(over, None).await else {
        return;
    };
    let mut p = h.raw_peer().await;
    let window = p.server_hello.initial_window as usize;
    p.send(open(1)).await;
    // One DATA frame one byte larger than the window: whatever the server
    // has consumed, it has granted no more than `window` for this call yet.
    // (A run of 1 MiB frames raced with the server's own WINDOW_UPDATEs: a
    // server that had already consumed and re-granted the first frames
    // when the last one arrived rightly found it within the window.)
    let sent = window + 1;
    p.send(frame::encode_data(1, &vec![0u8; sent], false)).await;
    let (frames, closed) = p.frames_until_close(CLOSE_WITHIN).await;
    assert!(
        closed,
        "connection closed after {sent} bytes into a {window}-byte window"
    );
    assert_eq!(
        goaway_code(&frames),
        Some(Code::Internal as u32),
        "{frames:?}"
    );
    match h.violation().await {
        PeerMisbehaved::StreamWindowExceeded { stream: 1, excess } => {
            assert!(excess > 0 && excess <= 1 << 20, "{excess}")
        }
        other => panic!("expected StreamWindowExceeded on stream 1, got {other:?}"),
    }
    h.others_still_work().await;
}

async fn reused_or_decreasing_call_ids_close_the_connection(over: Over) {
    let Some(h) = setup(over, None).await else {
        return;
    };
    let mut p = h.raw_peer().await;
    p.send(open(5)).await;
    p.send(open(3)).await;
    let (frames, closed) = p.frames_until_close(CLOSE_WITHIN).await;
    assert!(closed);
    assert_eq!(
        goaway_code(&frames),
        Some(Code::Internal as u32),
        "{frames:?}"
    );
    assert_eq!(
        h.violation().await,
        PeerMisbehaved::StreamIdNotIncreasing { stream: 3, last: 5 }
    );
    h.others_still_work().await;
}

async fn more_calls_than_allowed_are_rejected(over: Over) {
    let Some(h) = setup(over, Some(2)).await else {
        return;
    };
    let mut p = h.raw_peer().await;
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
    h.no_violation(); // a call refused, not a peer at fault
    h.others_still_work().await;
}

async fn oversized_metadata_closes_the_connection(over: Over) {
    let Some(h) = setup(over, None).await else {
        return;
    };
    let mut p = h.raw_peer().await;
    let limit = p.server_hello.max_metadata_bytes as usize;
    let mut md = http::HeaderMap::new();
    md.insert("x-big", "a".repeat(limit + 1).parse().unwrap());
    // Our encoder refuses it for this peer...
    assert!(frame::encode_open(1, "/echo.Echo/UnaryEcho", None, &md, false, limit).is_err());
    // ...so the hostile peer ignores the limit on purpose.
    p.send(frame::encode_open(1, "/echo.Echo/UnaryEcho", None, &md, false, usize::MAX).unwrap())
        .await;
    let (frames, closed) = p.frames_until_close(CLOSE_WITHIN).await;
    assert!(closed);
    assert_eq!(
        goaway_code(&frames),
        Some(Code::ResourceExhausted as u32),
        "{frames:?}"
    );
    // Counted up to the value that crossed the limit: "x-big" + the value.
    assert_eq!(
        h.violation().await,
        PeerMisbehaved::MetadataTooLarge {
            got: 5 + limit + 1,
            limit
        }
    );
    h.others_still_work().await;
}

async fn a_peer_that_never_returns_credit_gets_no_more_than_its_window(over: Over) {
    let Some(h) = setup(over, None).await else {
        return;
    };
    let mut p = h.raw_peer().await;
    // Server streaming of 64 KiB messages, far more than the 1 MiB window we granted.
    let req = grpc_message(&EchoRequest {
        count: 1000,
        reply_bytes: 64 << 10,
        ..Default::default()
    });
    let mut md = http::HeaderMap::new();
    md.insert("content-type", "application/grpc".parse().unwrap());
    p.send(
        frame::encode_open(
            1,
            "/echo.Echo/ServerStreamingEcho",
            None,
            &md,
            false,
            usize::MAX,
        )
        .unwrap(),
    )
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
    h.no_violation();
    h.others_still_work().await;
}

async fn client_disconnect_cancels_its_handlers(over: Over) {
    let stats: Arc<rpc_examples::echo::EchoStats> = Arc::new(Default::default());
    let Some(h) = setup_with_stats(over, None, stats.clone()).await else {
        return;
    };
    let mut p = h.raw_peer().await;
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

/// RDMA only: a transport message larger than the call layer ever sends
/// (`MAX_RDMA_FRAME`, advertised in the server's hello) closes the connection
/// at its first chunk notification, before anything is reserved for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn an_oversized_rdma_message_closes_the_connection() {
    use rdma_transport::engine::wire::Kind;
    use rdma_transport::testing::RawPeer as RawQp;
    let Some(h) = setup(Over::Rdma, None).await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(60), async {
        let addr = h.net.as_ref().unwrap().rdma_addr().unwrap();
        let mut p = RawQp::connect(addr, &rdma_transport::Config::default(), |_| {})
            .await
            .expect("raw RDMA connection to the server");
        let sh = p.peer_hello();
        assert_eq!(sh.max_message, rpc_core::MAX_RDMA_FRAME as u64);
        assert!(p.send_header(Kind::Credit, |_| {}).await.unwrap().ok());
        // Memory on demand (wire-protocol-rdma §5.5): ask for the region as
        // an honest sender does, then abuse it.
        let (rdv_addr, rdv_rkey) =
            if sh.flags & rdma_transport::engine::wire::HELLO_FLAG_ON_DEMAND != 0 {
                assert!(p.send_header(Kind::RdvRequest, |_| {}).await.unwrap().ok());
                loop {
                    let m = p
                        .recv(Duration::from_secs(10))
                        .await
                        .unwrap()
                        .expect("the server grants its region");
                    let g = rdma_transport::engine::wire::Header::decode(&m).unwrap();
                    if g.kind == Kind::RdvGrant {
                        break (g.addr, g.len);
                    }
                }
            } else {
                (sh.rdv_addr, sh.rdv_rkey)
            };
        let st = p.write(&[7; 4096], rdv_addr, rdv_rkey).await.unwrap();
        assert!(st.ok(), "{st:?}");
        let total = rpc_core::MAX_RDMA_FRAME as u64 + 1;
        let _ = p
            .send_header(Kind::Chunk, |c| {
                c.rdv_index = 0;
                c.len = 4096;
                c.total_len = total;
                c.addr = rdv_addr;
            })
            .await
            .unwrap();
        assert!(
            p.wait_disconnected(Duration::from_secs(10)).await.unwrap(),
            "the server closes a connection announcing a {total}-byte message"
        );
        h.others_still_work().await;
    })
    .await
    .expect("finished within 60 s");
}

/// The other direction: a server that breaks the protocol (it sends OPEN,
/// which only clients may, §1.3). The client closes the connection and its
/// call fails with `Internal` whose `source()` is the violation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misbehaving_server_fails_the_calls_with_the_violation_as_source() {
    let (a, b) = mem::pair();
    let (mut tx, mut rx) = b.split();
    let server = tokio::spawn(async move {
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
        let _client_hello = rx.recv().await.unwrap().unwrap();
        let _client_open = rx.recv().await.unwrap().unwrap();
        tx.send(open(1)).await.unwrap();
        // The client answers with GOAWAY and closes.
        let mut frames = vec![];
        while let Ok(Some(f)) = rx.recv().await {
            frames.push(frame::decode(f, &LIM).unwrap());
        }
        frames
    });
    let ch = rpc_core::Channel::from_connection(a, TransportKind::Memory, Default::default())
        .await
        .unwrap();
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        EchoClient::new(ch).unary_echo(EchoRequest::default()),
    )
    .await
    .expect("the call ends")
    .unwrap_err();
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    let source = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<PeerMisbehaved>());
    assert_eq!(source, Some(&PeerMisbehaved::OpenToClient), "{err:?}");
    let frames = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the client closes the connection")
        .unwrap();
    assert_eq!(
        goaway_code(&frames),
        Some(Code::Internal as u32),
        "{frames:?}"
    );
}

/// A client that keeps no timer of its own (a raw peer) still gets
/// DEADLINE_EXCEEDED when its call's deadline passes: the server ends the
/// call itself, with its TRAILERS, and cancels the handler.
async fn the_server_ends_a_call_past_its_deadline_itself(over: Over) {
    let stats = Arc::new(rpc_examples::echo::EchoStats::default());
    let Some(h) = setup_with_stats(over, None, stats.clone()).await else {
        return;
    };
    let mut p = h.raw_peer().await;
    let mut md = http::HeaderMap::new();
    md.insert("content-type", "application/grpc".parse().unwrap());
    let deadline = Duration::from_millis(200);
    let path = "/echo.Echo/UnaryEcho";
    p.send(frame::encode_open(1, path, Some(deadline), &md, false, usize::MAX).unwrap())
        .await;
    let req = EchoRequest {
        delay_ms: 30_000,
        ..Default::default()
    };
    p.send(frame::encode_data(1, &grpc_message(&req), true))
        .await;
    // Long before the handler's 30 s.
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    let status = 'found: loop {
        let b = match tokio::time::timeout_at(end, p.link.recv()).await {
            Ok(Ok(Some(b))) => b,
            other => panic!("no end of the call within 10 s: {other:?}"),
        };
        let frames = match frame::decode(b, &LIM).expect("server frames are well-formed") {
            Frame::Batch(parts) => parts
                .map(|f| frame::decode(f, &LIM).expect("well-formed"))
                .collect(),
            f => vec![f],
        };
        for f in frames {
            match f {
                Frame::Trailers {
                    stream: 1,
                    metadata,
                } => break 'found tonic::Status::from_header_map(&metadata),
                Frame::Reset {
                    stream: 1,
                    code,
                    message,
                } => panic!("call 1 reset ({code}: {message}), not ended with trailers"),
                _ => {}
            }
        }
    };
    let status = status.expect("the trailers carry a status");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        rpc_tests::eventually(Duration::from_secs(5), || stats
            .cancelled
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 1)
        .await,
        "the handler was cancelled"
    );
}
