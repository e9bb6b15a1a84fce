//! RDMA as the default transport, and TCP fallback: which path carries the
//! calls, why it fell back, forced policies, mixed clients, reconnect.
use rpc_core::FallbackReason;
use rpc_core::{Channel, Transport, TransportKind};
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{device_required, rdma_ip, router};
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

/// Whether this host has an RDMA device; fails if one is required and missing.
fn has_device() -> bool {
    let n = rdma_transport::devices().map(|d| d.len()).unwrap_or(0);
    if n == 0 && device_required() {
        panic!("an RDMA device is required (SOFTROCE_IN_VM / RDMA_TEST_REQUIRE_DEVICE) but none was found");
    }
    n > 0
}

/// The test address for RDMA, or a printed skip.
fn rdma_host(test: &str) -> Option<String> {
    if !has_device() {
        println!("SKIP {test}: no RDMA device on this host");
        return None;
    }
    match rdma_ip() {
        Some(ip) => Some(ip),
        None if device_required() => panic!("SOFTROCE_IP / RDMA_TEST_IP must be set"),
        None => {
            println!("SKIP {test}: SOFTROCE_IP / RDMA_TEST_IP unset");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_reason_when_no_device() {
    if has_device() {
        println!("SKIP fallback_reason_when_no_device: this host has an RDMA device (checked on the host run)");
        return;
    }
    let stats = Arc::new(Default::default());
    let server = router(stats)
        .start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    assert!(
        server.rdma_addr().is_none(),
        "no RDMA listener without a device"
    );
    let addr = server.local_addr().to_string();
    let ch = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(Transport::Auto)
        .connect()
        .await
        .unwrap();
    assert_eq!(ch.transport().kind, TransportKind::Tcp);
    let reason = ch
        .transport()
        .fallback_reason
        .clone()
        .expect("a fallback reason");
    assert!(
        matches!(
            reason,
            FallbackReason::NoDevice | FallbackReason::LibrariesMissing(_)
        ),
        "{reason:?}"
    );
    assert_eq!(
        ch.transport().to_string(),
        format!("tcp (fallback: {reason})")
    );
    EchoClient::new(ch)
        .unary_echo(EchoRequest::default())
        .await
        .unwrap();

    // RdmaOnly refuses to fall back, with a clear Unavailable.
    let err = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(Transport::RdmaOnly)
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            rpc_core::Error::RdmaUnavailable(FallbackReason::NoDevice)
                | rpc_core::Error::RdmaUnavailable(FallbackReason::LibrariesMissing(_))
        ),
        "{err:?}"
    );
    assert_eq!(tonic::Status::from(err).code(), Code::Unavailable);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn rdma_rendezvous_and_mixed_clients() {
    let Some(ip) = rdma_host("rdma_rendezvous_and_mixed_clients") else {
        return;
    };
    let stats = Arc::new(Default::default());
    let server = router(stats)
        .start(format!("{ip}:0").parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    assert!(server.rdma_addr().is_some(), "RDMA listener up");

    // Auto picks RDMA.
    let rdma = Channel::from_shared(addr.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    assert_eq!(rdma.transport().to_string(), "rdma");
    // Forced TCP, ours.
    let tcp = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(Transport::TcpOnly)
        .connect()
        .await
        .unwrap();
    assert_eq!(tcp.transport().kind, TransportKind::Tcp);
    assert!(tcp.transport().fallback_reason.is_none());
    // A stock gRPC client: tonic's own HTTP/2 channel.
    let stock = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();

    // A large payload goes by rendezvous: read by the receiver where both
    // sides offer it (the default, wire protocol §5.6), else RDMA WRITE.
    let before = rdma_transport::global_stats();
    let payload = vec![0x5Au8; 1 << 20];
    let r = EchoClient::new(rdma.clone())
        .unary_echo(EchoRequest {
            payload: payload.clone().into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.payload, payload);
    let after = rdma_transport::global_stats();
    assert_eq!(
        after.reads_announced - before.reads_announced,
        2,
        "{before:?} -> {after:?}"
    );
    let landed = |s: &rdma_transport::StatsSnapshot| s.read_bytes + s.dest_bytes;
    assert!(
        landed(&after) - landed(&before) >= 2 << 20,
        "request and response (1 MiB each) were read by their receivers or written into \
         destinations they granted: {before:?} -> {after:?}"
    );

    // All three at the same time.
    let mut calls = Vec::new();
    for i in 0..30u32 {
        let mut a = EchoClient::new(rdma.clone());
        let mut b = EchoClient::new(tcp.clone());
        let mut c = EchoClient::new(stock.clone());
        calls.push(tokio::spawn(async move {
            let req = EchoRequest {
                message: i.to_string(),
                payload: vec![1; 20_000].into(),
                ..Default::default()
            };
            let (x, y, z) = tokio::join!(
                a.unary_echo(req.clone()),
                b.unary_echo(req.clone()),
                c.unary_echo(req)
            );
            for r in [x, y, z] {
                assert_eq!(r.unwrap().into_inner().message, i.to_string());
            }
        }));
    }
    for c in calls {
        c.await.unwrap();
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn fallback_when_server_is_tcp_only() {
    let Some(ip) = rdma_host("fallback_when_server_is_tcp_only") else {
        return;
    };
    let stats = Arc::new(Default::default());
    let handle = tcp_only_router(stats)
        .start(format!("{ip}:0").parse().unwrap())
        .await
        .unwrap();
    assert!(handle.rdma_addr().is_none());
    let addr = handle.local_addr().to_string();
    let ch = Channel::from_shared(addr.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    assert_eq!(ch.transport().kind, TransportKind::Tcp);
    let reason = ch.transport().fallback_reason.clone().unwrap();
    assert!(
        matches!(reason, FallbackReason::Refused { .. }),
        "{reason:?}"
    );
    assert!(
        reason.to_string().contains("does not accept RDMA"),
        "{reason}"
    );
    EchoClient::new(ch)
        .unary_echo(EchoRequest::default())
        .await
        .unwrap();

    let err = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(Transport::RdmaOnly)
        .connect()
        .await
        .unwrap_err();
    assert_eq!(tonic::Status::from(err).code(), Code::Unavailable);
    handle.shutdown().await.unwrap();
}

fn tcp_only_router(stats: Arc<rpc_examples::echo::EchoStats>) -> rpc_core::Router {
    rpc_core::Server::builder().tcp_only(true).add_service(
        rpc_examples::pb::echo::echo_server::EchoServer::new(rpc_examples::echo::EchoService {
            stats,
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn reconnect_after_connection_loss() {
    let Some(ip) = rdma_host("reconnect_after_connection_loss") else {
        return;
    };
    let stats = Arc::new(Default::default());
    let server = router(stats)
        .start(format!("{ip}:0").parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    let ch = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(Transport::RdmaOnly)
        .connect()
        .await
        .unwrap();
    let mut echo = EchoClient::new(ch.clone());
    echo.unary_echo(EchoRequest::default()).await.unwrap();

    let mut c = echo.clone();
    let inflight = tokio::spawn(async move {
        c.unary_echo(EchoRequest {
            delay_ms: 10_000,
            ..Default::default()
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.abort().await;
    let err = tokio::time::timeout(Duration::from_secs(20), inflight)
        .await
        .expect("in-flight call fails promptly")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    // Same port, new server: the next call reconnects over RDMA.
    let stats = Arc::new(Default::default());
    let server = router(stats).start(addr).await.unwrap();
    let mut ok = false;
    for _ in 0..20 {
        if echo.unary_echo(EchoRequest::default()).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(ok, "the channel reconnected");
    assert_eq!(ch.transport().kind, TransportKind::Rdma);
    server.shutdown().await.unwrap();
}
