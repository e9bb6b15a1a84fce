//! tonic's builder surface: the channel's `Endpoint` options (URIs, timeout,
//! concurrency and rate limits, connect timeout, lazy connect, RDMA config)
//! and the server's (layer, timeout, optional services, routes, RDMA config).
use rpc_core::{Channel, ChannelBuilder, Server, TransportKind};
use rpc_examples::pb::echo::{echo_client::EchoClient, echo_server::EchoServer, EchoRequest};
use rpc_examples::pb::helloworld::{
    greeter_client::GreeterClient, greeter_server::GreeterServer, HelloRequest,
};
use rpc_tests::Fixture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

/// A builder for a new channel to the fixture's server on its path (these
/// tests run over TCP and RDMA only: the in-memory path has no address).
fn endpoint(fx: &Fixture, uri: bool) -> ChannelBuilder {
    let (addr, t) = fx.target().expect("a network path");
    let target = if uri {
        format!("http://{addr}")
    } else {
        addr.to_string()
    };
    Channel::from_shared(target).unwrap().transport(t)
}

fn delayed(ms: u32) -> EchoRequest {
    EchoRequest {
        delay_ms: ms,
        ..Default::default()
    }
}

async fn channel_accepts_uris(fx: Fixture) {
    let (addr, t) = fx.target().unwrap();
    let uri: http::Uri = format!("http://{addr}").parse().unwrap();
    // tonic's signature: `Channel::builder(Uri)`, with `.parse().unwrap()` inferred.
    let via_uri = Channel::builder(uri.to_string().parse().unwrap())
        .transport(t)
        .connect()
        .await
        .unwrap();
    let via_shared = Channel::from_shared(format!("http://{addr}/"))
        .unwrap()
        .transport(t)
        .connect()
        .await
        .unwrap();
    let via_hostport = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(t)
        .connect()
        .await
        .unwrap();
    for ch in [via_uri, via_shared, via_hostport] {
        let kind = ch.transport().kind;
        assert_eq!(
            kind,
            if fx.path.is_rdma() {
                TransportKind::Rdma
            } else {
                TransportKind::Tcp
            }
        );
        EchoClient::new(ch)
            .unary_echo(EchoRequest::default())
            .await
            .unwrap();
    }
    // https:// parses (as with tonic), but needs tls_config: a clear error at
    // connect, never a panic.
    let e = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .transport(t)
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, rpc_core::Error::Tls(_)), "{e}");
    println!("https without tls_config: {e}");
    for bad in [
        format!("ftp://{addr}"),
        format!("http://{addr}/some/path"),
        "no-port".to_string(),
    ] {
        let e = Channel::from_shared(bad.clone()).unwrap_err();
        assert!(
            matches!(e, rpc_core::Error::InvalidAddress(_)),
            "{bad}: {e}"
        );
        println!("{bad}: {e}");
    }
}

async fn channel_timeout(fx: Fixture) {
    let b = endpoint(&fx, true);
    let mut c = EchoClient::new(
        b.timeout(Duration::from_millis(200))
            .connect()
            .await
            .unwrap(),
    );
    c.unary_echo(delayed(0)).await.unwrap();
    let st = c.unary_echo(delayed(10_000)).await.unwrap_err();
    assert_eq!(st.code(), Code::DeadlineExceeded, "{st:?}");
    // The deadline reached the server: its handler was dropped there too.
    assert!(
        rpc_tests::eventually(Duration::from_secs(10), || fx
            .stats
            .cancelled
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "the server's handler was not cancelled at the deadline"
    );
    // A shorter deadline of the call itself stays.
    let mut req = tonic::Request::new(delayed(10_000));
    req.set_timeout(Duration::from_millis(50));
    let st = c.unary_echo(req).await.unwrap_err();
    assert_eq!(st.code(), Code::DeadlineExceeded);
}

async fn channel_concurrency_limit(fx: Fixture) {
    let b = endpoint(&fx, false);
    let ch = b.concurrency_limit(2).connect().await.unwrap();
    let stats = fx.stats.clone();
    let max_seen = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (max_seen, done) = (max_seen.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                let running = stats.started.load(Ordering::SeqCst)
                    - stats.completed.load(Ordering::SeqCst)
                    - stats.cancelled.load(Ordering::SeqCst);
                max_seen.fetch_max(running, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let calls = (0..8).map(|_| {
        let mut c = EchoClient::new(ch.clone());
        async move { c.unary_echo(delayed(150)).await }
    });
    for r in futures::future::join_all(calls).await {
        r.unwrap();
    }
    done.store(true, Ordering::SeqCst);
    sampler.await.unwrap();
    let max = max_seen.load(Ordering::SeqCst);
    println!("channel_concurrency_limit: at most {max} calls ran at once on the server (limit 2, 8 calls)");
    assert!(
        (1..=2).contains(&max),
        "{max} calls at once with a limit of 2"
    );
}

async fn channel_rate_limit(fx: Fixture) {
    let b = endpoint(&fx, false);
    // Two calls per hour: the third waits (it would for an hour).
    let ch = b
        .rate_limit(2, Duration::from_secs(3600))
        .connect()
        .await
        .unwrap();
    let mut c = EchoClient::new(ch.clone());
    c.unary_echo(delayed(0)).await.unwrap();
    let mut c2 = EchoClient::new(ch);
    c2.unary_echo(delayed(0)).await.unwrap();
    let third = tokio::time::timeout(Duration::from_millis(500), c.unary_echo(delayed(0))).await;
    assert!(
        third.is_err(),
        "a third call within the period was not held back"
    );
    assert_eq!(fx.stats.started.load(Ordering::SeqCst), 2);
}

async fn channel_connect_lazy(fx: Fixture) {
    let (addr, t) = fx.target().expect("a network path");
    // A lazy channel to a port where nothing listens yet: created at once,
    // its calls fail UNAVAILABLE, and it connects once a server is there.
    let free = {
        let l = std::net::TcpListener::bind((addr.ip(), 0)).unwrap();
        l.local_addr().unwrap()
    };
    let ch = Channel::from_shared(free.to_string())
        .unwrap()
        .transport(t)
        .rdma_connect_timeout(Duration::from_secs(5))
        .connect_lazy();
    assert_eq!(ch.transport().kind, TransportKind::NotConnected);
    let mut c = EchoClient::new(ch.clone());
    let st = c.unary_echo(delayed(0)).await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    println!("lazy channel before its server: {st:?}");
    let stats = Arc::new(Default::default());
    let server = rpc_tests::router(stats).start(free).await.unwrap();
    c.unary_echo(delayed(0)).await.unwrap();
    let kind = ch.transport().kind;
    assert_eq!(
        kind,
        if fx.path.is_rdma() {
            TransportKind::Rdma
        } else {
            TransportKind::Tcp
        }
    );
    server.shutdown().await.unwrap();
}

async fn rdma_config_is_used(fx: Fixture) {
    let (addr, t) = fx.target().unwrap();
    let bad = rpc_core::RdmaConfig {
        recv_slots: 1,
        ..Default::default()
    };
    let e = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(t)
        .rdma_config(bad.clone())
        .connect()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("recv_slots"), "{e}");
    // A usable config is taken as given: small messages only.
    let small = rpc_core::RdmaConfig {
        recv_slots: 8,
        ..Default::default()
    };
    let ch = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(t)
        .rdma_config(small)
        .connect()
        .await
        .unwrap();
    EchoClient::new(ch).unary_echo(delayed(0)).await.unwrap();
    // The server's: an invalid one means no RDMA listener (TCP only), said in a warning.
    let ip = addr.ip();
    let h = Server::builder()
        .rdma_config(bad)
        .add_service(GreeterServer::new(
            rpc_examples::greeter::MyGreeter::default(),
        ))
        .start((ip, 0).into())
        .await
        .unwrap();
    assert!(h.rdma_addr().is_none());
    h.shutdown().await.unwrap();
}

// The channel builder's options need an address: TCP and RDMA only.
rpc_tests::on_paths!(
    [tcp, rdma] channel_accepts_uris,
    channel_timeout,
    channel_concurrency_limit,
    channel_rate_limit,
    channel_connect_lazy,
);
rpc_tests::on_paths!([rdma] rdma_config_is_used);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_connect_timeout() {
    // A listener whose backlog is full: further connects are not answered.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(0).unwrap();
    let addr = l.local_addr().unwrap();
    let mut fill = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) = tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            fill.push(s);
        }
    }
    let t0 = std::time::Instant::now();
    // The default connect timeout is 5 s; 4 s bounds this one (200 ms) loosely.
    let r = tokio::time::timeout(
        Duration::from_secs(4),
        Channel::from_shared(addr.to_string())
            .unwrap()
            .transport(rpc_core::Transport::TcpOnly)
            .connect_timeout(Duration::from_millis(200))
            .connect(),
    )
    .await
    .expect("connect_timeout(200 ms) was not applied");
    let e = r.unwrap_err();
    println!("connect_timeout: {e} after {:?}", t0.elapsed());
    assert!(matches!(e, rpc_core::Error::Connect { .. }), "{e}");
    drop(l);
}

fn with_echo(mut server: Server, stats: Arc<rpc_examples::echo::EchoStats>) -> rpc_core::Router {
    server.add_service(EchoServer::new(rpc_examples::echo::EchoService { stats }))
}

rpc_tests::on_every_path!(
    server_timeout => |stats| super::with_echo(rpc_core::Server::builder().timeout(std::time::Duration::from_millis(200)), stats),
    server_layer => super::layered_router,
    server_optional_services_and_routes => super::optional_router,
);

async fn server_timeout(fx: Fixture) {
    let mut c = EchoClient::new(fx.channel.clone());
    c.unary_echo(delayed(0)).await.unwrap();
    let st = c.unary_echo(delayed(10_000)).await.unwrap_err();
    assert_eq!(st.code(), Code::DeadlineExceeded, "{st:?}");
    assert!(
        rpc_tests::eventually(Duration::from_secs(10), || fx
            .stats
            .cancelled
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "the handler was not dropped at the server's deadline"
    );
    // A shorter deadline of the call stays the call's.
    let mut req = tonic::Request::new(delayed(10_000));
    req.set_timeout(Duration::from_millis(50));
    let st = c.unary_echo(req).await.unwrap_err();
    assert_eq!(st.code(), Code::DeadlineExceeded);
}

fn check_auth(req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
    match req.metadata().get("authorization") {
        Some(t) if t == "Bearer secret" => Ok(req),
        _ => Err(tonic::Status::unauthenticated("missing or bad token")),
    }
}

/// Two layers: a counter that tags each response with the calls it saw, and
/// tonic's interceptor layer (which answers some calls itself).
fn layered_router(stats: Arc<rpc_examples::echo::EchoStats>) -> rpc_core::Router {
    let seen = Arc::new(AtomicUsize::new(0));
    let (a, b) = (seen.clone(), seen);
    let counting = tower::ServiceBuilder::new()
        .map_request(move |r: http::Request<tonic::body::Body>| {
            a.fetch_add(1, Ordering::SeqCst);
            r
        })
        .map_response(move |mut r: http::Response<tonic::body::Body>| {
            let n = b.load(Ordering::SeqCst);
            r.headers_mut().insert("x-layer-calls", n.into());
            r
        })
        .into_inner();
    with_echo(
        Server::builder()
            .layer(counting)
            .layer(tonic::service::InterceptorLayer::new(check_auth)),
        stats,
    )
}

async fn server_layer(fx: Fixture) {
    let mut c = EchoClient::new(fx.channel.clone());
    let authed = |m: EchoRequest| {
        let mut r = tonic::Request::new(m);
        r.metadata_mut()
            .insert("authorization", "Bearer secret".parse().unwrap());
        r
    };
    let r = c.unary_echo(authed(delayed(0))).await.unwrap();
    assert_eq!(r.metadata().get("x-layer-calls").unwrap(), "1");
    let r = c.unary_echo(authed(delayed(0))).await.unwrap();
    assert_eq!(r.metadata().get("x-layer-calls").unwrap(), "2");
    // The inner layer answers without the handler; the outer one still sees it.
    let st = c.unary_echo(delayed(0)).await.unwrap_err();
    assert_eq!(st.code(), Code::Unauthenticated, "{st:?}");
    assert_eq!(fx.stats.started.load(Ordering::SeqCst), 2);
    let r = c.unary_echo(authed(delayed(0))).await.unwrap();
    assert_eq!(r.metadata().get("x-layer-calls").unwrap(), "4");
}

fn optional_router(stats: Arc<rpc_examples::echo::EchoStats>) -> rpc_core::Router {
    let echo =
        tonic::service::Routes::new(EchoServer::new(rpc_examples::echo::EchoService { stats }));
    Server::default()
        .add_routes(echo)
        .add_optional_service(Some(GreeterServer::new(
            rpc_examples::greeter::MyGreeter::default(),
        )))
        .add_optional_service(
            None::<
                rpc_examples::pb::routeguide::route_guide_server::RouteGuideServer<
                    rpc_examples::routeguide::RouteGuideService,
                >,
            >,
        )
}

async fn server_optional_services_and_routes(fx: Fixture) {
    GreeterClient::new(fx.channel.clone())
        .say_hello(HelloRequest { name: "x".into() })
        .await
        .unwrap();
    EchoClient::new(fx.channel.clone())
        .unary_echo(delayed(0))
        .await
        .unwrap();
    let st =
        rpc_examples::pb::routeguide::route_guide_client::RouteGuideClient::new(fx.channel.clone())
            .get_feature(rpc_examples::pb::routeguide::Point::default())
            .await
            .unwrap_err();
    assert_eq!(st.code(), Code::Unimplemented, "{st:?}");
}
