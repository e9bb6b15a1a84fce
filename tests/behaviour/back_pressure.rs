//! Tower back-pressure: on the message transports
//! `Channel::poll_ready` reserves one of the calls the server accepts at once
//! on the connection, so it is `Pending` while all are in flight and tower's
//! `Buffer`, `ConcurrencyLimit` and balancers see it. A reservation belongs to
//! one clone and is released when that clone is dropped without a call.
//!
//! Memory and RDMA only: on the TCP path `poll_ready` is tonic's channel's
//! (its `Buffer`), which does not know the server's per-connection limit.
use rpc_examples::echo::EchoService;
use rpc_examples::pb::echo::{echo_client::EchoClient, echo_server::EchoServer, EchoRequest};
use rpc_tests::{eventually, Fixture, Path};
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;
use tower::{Service, ServiceExt};

type Req = http::Request<tonic::body::Body>;

/// Polls `poll_ready` once.
async fn poll_ready_once(c: &mut rpc_core::Channel) -> Poll<()> {
    futures::poll!(std::future::poll_fn(|cx| Service::<Req>::poll_ready(c, cx)))
        .map(|r| r.expect("poll_ready never fails on a message channel"))
}

async fn poll_ready_reflects_free_call_slots(path: Path) {
    const LIMIT: usize = 2;
    let Some(fx) = Fixture::start_with(path, |stats| {
        rpc_core::Server::builder()
            .concurrency_limit_per_connection(LIMIT)
            .add_service(EchoServer::new(EchoService { stats }))
    })
    .await
    else {
        return;
    };
    // LIMIT calls in flight: a short one and a long one.
    let mut a = EchoClient::new(fx.channel.clone());
    let mut b = EchoClient::new(fx.channel.clone());
    let short = tokio::spawn(async move {
        a.unary_echo(EchoRequest {
            delay_ms: 1500,
            ..Default::default()
        })
        .await
    });
    let long = tokio::spawn(async move {
        b.unary_echo(EchoRequest {
            delay_ms: 60_000,
            ..Default::default()
        })
        .await
    });
    assert!(
        eventually(Duration::from_secs(5), || fx
            .stats
            .started
            .load(Ordering::SeqCst)
            == LIMIT)
        .await
    );

    // Another clone cannot start a call now...
    let mut c = fx.channel.clone();
    assert!(
        poll_ready_once(&mut c).await.is_pending(),
        "poll_ready is Pending with {LIMIT} of {LIMIT} calls in flight"
    );
    // ...and can as soon as one finishes.
    tokio::time::timeout(Duration::from_secs(10), ServiceExt::<Req>::ready(&mut c))
        .await
        .expect("poll_ready turns Ready when a call finishes")
        .unwrap();
    short.await.unwrap().expect("the short call succeeded");
    assert_eq!(fx.stats.completed.load(Ordering::SeqCst), 1);
    assert!(!long.is_finished());

    // `c` holds the freed slot: a further clone waits for it.
    let mut d = fx.channel.clone();
    assert!(
        poll_ready_once(&mut d).await.is_pending(),
        "the slot reserved by one clone is not another's"
    );
    // Dropping the reservation without a call releases it.
    drop(c);
    tokio::time::timeout(Duration::from_secs(10), ServiceExt::<Req>::ready(&mut d))
        .await
        .expect("a reservation dropped without a call is released")
        .unwrap();
    // And the reserved slot carries a call.
    let r = EchoClient::new(d)
        .unary_echo(EchoRequest {
            message: "on the reserved slot".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.into_inner().message, "on the reserved slot");
    long.abort();
}

mod poll_ready_reflects_free_call_slots {
    use rpc_tests::Path;
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        let t = std::time::Duration::from_secs(60);
        tokio::time::timeout(t, super::poll_ready_reflects_free_call_slots(Path::Memory))
            .await
            .expect("finished within 60 s")
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
    async fn rdma() {
        let t = std::time::Duration::from_secs(120);
        tokio::time::timeout(t, super::poll_ready_reflects_free_call_slots(Path::Rdma))
            .await
            .expect("finished within 120 s")
    }
}
