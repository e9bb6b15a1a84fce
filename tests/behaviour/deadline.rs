//! Deadlines: `grpc-timeout` is enforced and the handler is cancelled.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{eventually, Fixture};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tonic::Code;

async fn deadline(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let mut req = tonic::Request::new(EchoRequest {
        delay_ms: 5_000,
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(200));
    let t = Instant::now();
    let err = echo.unary_echo(req).await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "deadline fired late: {:?}",
        t.elapsed()
    );
    assert!(
        eventually(Duration::from_secs(3), || fx
            .stats
            .cancelled
            .load(Ordering::SeqCst)
            >= 1)
        .await,
        "the handler was cancelled"
    );

    // A call within its deadline succeeds.
    let mut req = tonic::Request::new(EchoRequest {
        delay_ms: 10,
        ..Default::default()
    });
    req.set_timeout(Duration::from_secs(10));
    echo.unary_echo(req).await.unwrap();

    // A deadline on a stream cuts it mid-way.
    let mut req = tonic::Request::new(EchoRequest {
        count: 1000,
        delay_ms: 20,
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(300));
    let mut s = echo.server_streaming_echo(req).await.unwrap().into_inner();
    let mut n = 0;
    let err = loop {
        match s.message().await {
            Ok(Some(_)) => n += 1,
            Ok(None) => panic!("stream ended normally after {n} messages"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), Code::DeadlineExceeded);
    assert!(n < 1000);
}

rpc_tests::on_every_path!(deadline);
