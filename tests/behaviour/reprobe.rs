//! Re-probing RDMA: an `Auto` channel that fell back to TCP because the
//! server had no RDMA listener moves its new calls to RDMA once one is up,
//! without failing a call.
use rpc_core::{Channel, ConnInfo, Server, TransportKind};
use rpc_examples::echo::{EchoService, EchoStats};
use rpc_examples::pb::echo::{echo_client::EchoClient, echo_server::EchoServer, EchoRequest};
use rpc_tests::{device_required, rdma_ip};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn echo_router(stats: Arc<EchoStats>) -> rpc_core::Router {
    Server::builder()
        .tcp_only(true)
        .add_service(EchoServer::new(EchoService { stats }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn auto_channel_moves_to_rdma_when_it_comes_up() {
    let Some(ip) = rdma_ip() else {
        if device_required() {
            panic!("SOFTROCE_IP / RDMA_TEST_IP must be set");
        }
        println!(
            "SKIP auto_channel_moves_to_rdma_when_it_comes_up: SOFTROCE_IP / RDMA_TEST_IP unset"
        );
        return;
    };
    if std::env::var("SOFTROCE_SIW_IP").ok().as_deref() == Some(ip.as_str()) {
        println!(
            "SKIP auto_channel_moves_to_rdma_when_it_comes_up on iWARP: the test's own RDMA \
             listener must share the TCP port, which iWARP's rdma_cm cannot (the server's \
             iWARP port announcement is tested by transports::iwarp_*)"
        );
        return;
    }
    // The server: HTTP/2 only at first.
    let tcp_stats = Arc::new(EchoStats::default());
    let server = echo_router(tcp_stats.clone())
        .start(format!("{ip}:0").parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    let ch = Channel::from_shared(addr.to_string())
        .unwrap()
        .rdma_reprobe(Duration::from_millis(200), Duration::from_millis(800))
        .connect()
        .await
        .unwrap();
    let t = ch.transport();
    println!("at start: {t}");
    assert_eq!(t.kind, TransportKind::Tcp);
    assert!(t.fallback_reason.is_some());

    // Calls all along.
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let mut c = EchoClient::new(ch.clone());
            let (stop, ok) = (stop.clone(), ok.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    c.unary_echo(EchoRequest {
                        delay_ms: 5,
                        ..Default::default()
                    })
                    .await
                    .expect("no call fails while RDMA comes up");
                    ok.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(ch.transport().kind, TransportKind::Tcp);

    // RDMA comes up on the same port: a listener serving the same service.
    let rdma_stats = Arc::new(EchoStats::default());
    let rdma_router = echo_router(rdma_stats.clone());
    let mut listener = rdma_transport::Listener::bind(addr, rdma_transport::Config::default())
        .await
        .expect("RDMA listener on the server's port");
    let accept = tokio::spawn(async move {
        while let Ok(conn) = listener.accept().await {
            let info = ConnInfo::new(TransportKind::Rdma, Some(conn.peer_addr()));
            rdma_router
                .serve_connection(rpc_core::__private::RdmaConnection::new(conn), info)
                .await
                .unwrap();
        }
    });
    assert!(
        rpc_tests::eventually(Duration::from_secs(60), || ch.transport().kind
            == TransportKind::Rdma)
        .await,
        "the channel did not move to RDMA: {}",
        ch.transport()
    );
    println!("after RDMA came up: {}", ch.transport());
    // New calls go over RDMA; TCP gets none (after those in flight).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (tcp_before, rdma_before) = (
        tcp_stats.started.load(Ordering::SeqCst),
        rdma_stats.started.load(Ordering::SeqCst),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.expect("no call failed");
    }
    let (tcp_after, rdma_after) = (
        tcp_stats.started.load(Ordering::SeqCst),
        rdma_stats.started.load(Ordering::SeqCst),
    );
    println!(
        "calls: {} ok; over TCP {tcp_after} ({tcp_before} when checked), over RDMA {rdma_after} ({rdma_before} when checked)",
        ok.load(Ordering::SeqCst)
    );
    assert_eq!(tcp_after, tcp_before, "new calls still went over TCP");
    assert!(rdma_after > rdma_before, "no call went over RDMA");
    accept.abort();
    drop(ch);
    server.shutdown().await.unwrap();
}
