//! A peer process killed (SIGKILL) in the middle of a unary call in its handler,
//! of a flowing server stream and of a 16 MiB message travelling by RDMA WRITE
//! rendezvous: the surviving side's calls fail with `Unavailable` promptly,
//! nothing hangs, server-side handlers are cancelled, and new connections work.
use crate::common::{
    bounded, echo, pattern, rdma_channel, rdma_host, start_server, ChildProc, CHILD_ADDR_ENV,
    CHILD_ROLE_ENV,
};
use rpc_examples::pb::echo::EchoRequest;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::{Code, Status};

const BIG: usize = 16 << 20;
/// How long the surviving side may take to see the failure.
const PROMPT: Duration = Duration::from_secs(10);

/// Child roles (no-op unless `RELIABILITY_CHILD_ROLE` is set): `server` serves
/// the echo router and prints its RDMA address; `client` connects to
/// `RELIABILITY_CHILD_ADDR` and keeps a slow unary call, a server stream and
/// 16 MiB calls in flight. Either waits to be killed (exits after 5 min).
/// Not a test of its own: `ChildProc::spawn` runs it with `--ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the peer_killed tests (ChildProc::spawn runs it)"]
async fn child_role() {
    let Ok(role) = std::env::var(CHILD_ROLE_ENV) else {
        return;
    };
    let addr = std::env::var(CHILD_ADDR_ENV).expect("child address");
    match role.as_str() {
        "server" => {
            let (handle, _stats) = start_server(&addr, 0).await;
            println!("CHILD_ADDR {}", handle.rdma_addr().unwrap());
            tokio::time::sleep(Duration::from_secs(300)).await;
        }
        "client" => {
            let ch = rdma_channel(&addr).await;
            echo(&ch).unary_echo(EchoRequest::default()).await.unwrap();
            let active = Arc::new(AtomicUsize::new(0));
            for _ in 0..2 {
                let mut c = echo(&ch);
                tokio::spawn(async move {
                    let _ = c
                        .unary_echo(EchoRequest {
                            delay_ms: 600_000,
                            ..Default::default()
                        })
                        .await;
                });
            }
            let mut c = echo(&ch);
            let a = active.clone();
            tokio::spawn(async move {
                let mut s = c
                    .server_streaming_echo(EchoRequest {
                        count: u32::MAX,
                        reply_bytes: 1000,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner();
                while let Ok(Some(_)) = s.message().await {
                    a.fetch_add(1, SeqCst);
                }
            });
            // Big calls on their own connection, so the stream is not slowed.
            let big_ch = rdma_channel(&addr).await;
            let mut c = echo(&big_ch);
            let payload = pattern(7, BIG);
            tokio::spawn(async move {
                loop {
                    let _ = c
                        .unary_echo(EchoRequest {
                            payload: payload.clone().into(),
                            reply_bytes: BIG as u64,
                            ..Default::default()
                        })
                        .await;
                }
            });
            while active.load(SeqCst) < 10 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            println!("CHILD_READY");
            tokio::time::sleep(Duration::from_secs(300)).await;
        }
        "streaming-client" => {
            // tonic's streaming example's client: a server stream and a bidi
            // call open, then killed.
            let ch = rdma_channel(&addr).await;
            let mut c = echo(&ch);
            let mut s = c
                .server_streaming_echo(EchoRequest::default())
                .await
                .unwrap()
                .into_inner();
            s.message().await.unwrap().unwrap();
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let mut bidi = c
                .bidirectional_streaming_echo(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            tx.send(EchoRequest::default()).await.unwrap();
            bidi.message().await.unwrap().unwrap();
            println!("CHILD_READY");
            tokio::spawn(async move { while let Ok(Some(_)) = s.message().await {} });
            tokio::time::sleep(Duration::from_secs(300)).await;
            drop((tx, bidi));
        }
        other => panic!("unknown child role {other}"),
    }
}

/// Waits until a large message is moving in this process right now:
/// rendezvous bytes RDMA-WRITTEN, messages announced for reading, or bytes
/// read (wire protocol §5, §5.6).
async fn wait_rendezvous_moving() -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    let moved = || {
        let s = rdma_transport::global_stats();
        s.rendezvous_bytes + s.read_bytes + s.reads_announced
    };
    loop {
        let a = moved();
        tokio::time::sleep(Duration::from_millis(30)).await;
        let b = moved();
        if b > a {
            return b - a;
        }
        assert!(Instant::now() < deadline, "no rendezvous traffic");
    }
}

/// Awaits a call task that must fail with `Unavailable` within [`PROMPT`].
async fn expect_unavailable<T: std::fmt::Debug>(
    what: &str,
    killed: Instant,
    task: tokio::task::JoinHandle<Result<T, Status>>,
) {
    let r = tokio::time::timeout(PROMPT, task)
        .await
        .unwrap_or_else(|_| panic!("{what}: still hanging {PROMPT:?} after the kill"))
        .expect("call task");
    let el = killed.elapsed();
    let err = r.expect_err(&format!("{what}: must fail after the peer was killed"));
    println!(
        "  {what}: {:?} after {el:.1?}: {}",
        err.code(),
        err.message()
    );
    assert_eq!(err.code(), Code::Unavailable, "{what}: {err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn server_killed_mid_unary_stream_and_rendezvous() {
    let Some(ip) = rdma_host("server_killed_mid_unary_stream_and_rendezvous") else {
        return;
    };
    bounded(
        "server_killed_mid_unary_stream_and_rendezvous",
        Duration::from_secs(150),
        async {
            let mut child = ChildProc::spawn("server", &ip);
            let addr = child.wait_line("CHILD_ADDR ", Duration::from_secs(60)).await;
            // One connection per kind of call, as three independent clients.
            let (ch_unary, ch_stream, ch_big) = (
                rdma_channel(&addr).await,
                rdma_channel(&addr).await,
                rdma_channel(&addr).await,
            );
            echo(&ch_unary)
                .unary_echo(EchoRequest::default())
                .await
                .expect("call before the kill");

            let mut c = echo(&ch_unary);
            let unary = tokio::spawn(async move {
                c.unary_echo(EchoRequest {
                    delay_ms: 600_000,
                    ..Default::default()
                })
                .await
            });
            let streamed = Arc::new(AtomicUsize::new(0));
            let (mut c, n) = (echo(&ch_stream), streamed.clone());
            let stream = tokio::spawn(async move {
                let mut s = c
                    .server_streaming_echo(EchoRequest {
                        count: u32::MAX,
                        reply_bytes: 1000,
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                loop {
                    match s.message().await {
                        Ok(Some(_)) => n.fetch_add(1, SeqCst),
                        Ok(None) => return Ok(()),
                        Err(e) => return Err(e),
                    };
                }
            });
            let big_ok = Arc::new(AtomicUsize::new(0));
            let (mut c, n) = (echo(&ch_big), big_ok.clone());
            let payload = pattern(1, BIG);
            let big = tokio::spawn(async move {
                loop {
                    let r = c
                        .unary_echo(EchoRequest {
                            payload: payload.clone().into(),
                            reply_bytes: 1,
                            ..Default::default()
                        })
                        .await?
                        .into_inner();
                    assert_eq!(r.crc32, crc32fast::hash(&payload), "16 MiB arrived intact");
                    n.fetch_add(1, SeqCst);
                }
                #[allow(unreachable_code)]
                Ok::<(), Status>(())
            });
            // Kill while the stream flows, the slow call waits in its handler and
            // a 16 MiB request is being written (after one completed intact).
            assert!(
                rpc_tests::eventually(Duration::from_secs(90), || streamed.load(SeqCst) >= 50
                    && big_ok.load(SeqCst) >= 1)
                .await,
                "traffic flowing before the kill: streamed {}, big calls {}",
                streamed.load(SeqCst),
                big_ok.load(SeqCst)
            );
            let moving = wait_rendezvous_moving().await;
            let seen = streamed.load(SeqCst);
            child.kill();
            let killed = Instant::now();
            println!(
                "  killed the server: {seen} stream messages and {} 16 MiB calls done, {moving} rendezvous bytes in the last 30 ms",
                big_ok.load(SeqCst)
            );
            expect_unavailable("unary call in its handler", killed, unary).await;
            expect_unavailable("server stream", killed, stream).await;
            expect_unavailable("16 MiB call (rendezvous)", killed, big).await;

            // The old channel does not hang either: its reconnect is refused.
            let t = Instant::now();
            let err = tokio::time::timeout(PROMPT, echo(&ch_unary).unary_echo(EchoRequest::default()))
                .await
                .expect("a call on the old channel does not hang")
                .expect_err("nobody serves that address any more");
            println!("  old channel, new call: {:?} after {:.1?}: {}", err.code(), t.elapsed(), err.message());
            assert_eq!(err.code(), Code::Unavailable, "{err:?}");

            // A new server and channel work, rendezvous included.
            let (server, _stats) = start_server(&ip, 0).await;
            let ch = rdma_channel(&server.rdma_addr().unwrap().to_string()).await;
            let payload = pattern(2, BIG);
            let r = echo(&ch)
                .unary_echo(EchoRequest {
                    payload: payload.clone().into(),
                    ..Default::default()
                })
                .await
                .expect("new server works")
                .into_inner();
            assert_eq!(r.payload, payload);
            server.shutdown().await.unwrap();
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn client_killed_handlers_cancelled() {
    let Some(ip) = rdma_host("client_killed_handlers_cancelled") else {
        return;
    };
    bounded(
        "client_killed_handlers_cancelled",
        Duration::from_secs(150),
        async {
            let (server, stats) = start_server(&ip, 0).await;
            let addr = server.rdma_addr().unwrap().to_string();
            let mut child = ChildProc::spawn("client", &addr);
            child.wait_line("CHILD_READY", Duration::from_secs(90)).await;
            // 2 slow unary handlers + 1 stream handler are running; 16 MiB calls
            // go both ways (request, then a 16 MiB reply) on a second connection.
            assert!(
                rpc_tests::eventually(Duration::from_secs(30), || {
                    // Ended first: a handler may start and end between the loads.
                    let ended = stats.completed.load(SeqCst) + stats.cancelled.load(SeqCst);
                    let started = stats.started.load(SeqCst);
                    started - ended >= 3 && stats.completed.load(SeqCst) >= 2
                })
                .await,
                "handlers running and a 16 MiB call completed before the kill: {stats:?}"
            );
            let moving = wait_rendezvous_moving().await;
            let before = (
                stats.started.load(SeqCst),
                stats.completed.load(SeqCst),
                stats.cancelled.load(SeqCst),
            );
            child.kill();
            let killed = Instant::now();
            println!(
                "  killed the client: started/completed/cancelled {before:?}, {moving} rendezvous bytes in the last 30 ms"
            );
            let all_ended = rpc_tests::eventually(PROMPT, || {
                stats.started.load(SeqCst)
                    == stats.completed.load(SeqCst) + stats.cancelled.load(SeqCst)
            })
            .await;
            println!(
                "  after {:.1?}: started {} completed {} cancelled {}",
                killed.elapsed(),
                stats.started.load(SeqCst),
                stats.completed.load(SeqCst),
                stats.cancelled.load(SeqCst)
            );
            assert!(all_ended, "every handler ended after the client was killed: {stats:?}");
            assert!(
                stats.cancelled.load(SeqCst) >= before.2 + 3,
                "the 2 slow unary handlers and the stream handler were cancelled: {stats:?}"
            );

            // The server still serves new clients, rendezvous included.
            let ch = rdma_channel(&addr).await;
            let payload = pattern(3, BIG);
            let r = echo(&ch)
                .unary_echo(EchoRequest {
                    payload: payload.clone().into(),
                    ..Default::default()
                })
                .await
                .expect("server still works")
                .into_inner();
            assert_eq!(r.payload, payload);
            drop(ch);
            tokio::time::timeout(Duration::from_secs(20), server.shutdown())
                .await
                .expect("shutdown does not hang on the dead client's connection")
                .unwrap();
        },
    )
    .await;
}

/// tonic's streaming example, its client killed (SIGKILL) with a server
/// stream and a bidi call open: the server-stream handler's `tx.send` fails
/// ("client disconnected"), and the bidi handler's request stream fails with
/// an `io::Error` of kind `BrokenPipe` in its source chain ("client
/// disconnected: broken pipe"), as tonic's handlers see it over HTTP/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn client_killed_mid_stream_is_a_broken_pipe() {
    let Some(ip) = rdma_host("client_killed_mid_stream_is_a_broken_pipe") else {
        return;
    };
    bounded(
        "client_killed_mid_stream_is_a_broken_pipe",
        Duration::from_secs(150),
        async {
            let ex = rpc_tests::tonic_example::Example::default();
            let server = rpc_core::Server::builder()
                .add_service(rpc_examples::pb::echo::echo_server::EchoServer::new(
                    ex.clone(),
                ))
                .start(format!("{ip}:0").parse().unwrap())
                .await
                .unwrap();
            let addr = server.rdma_addr().expect("RDMA listener").to_string();
            let mut child = ChildProc::spawn("streaming-client", &addr);
            child
                .wait_line("CHILD_READY", Duration::from_secs(90))
                .await;
            child.kill();
            let killed = Instant::now();
            let seen = ex.seen.clone();
            let ended = rpc_tests::eventually(PROMPT, || {
                seen.stream_client_gone.load(SeqCst) && seen.bidi_done.load(SeqCst)
            })
            .await;
            println!(
                "  after {:.1?}: stream handler's send failed: {}, bidi: {:?}",
                killed.elapsed(),
                seen.stream_client_gone.load(SeqCst),
                seen.bidi_error.lock().unwrap()
            );
            assert!(ended, "both handlers saw the client go within {PROMPT:?}");
            assert!(
                seen.broken_pipe.load(SeqCst),
                "the bidi handler's request stream error carries BrokenPipe"
            );
            server.shutdown().await.unwrap();
        },
    )
    .await;
}
