//! The server ends calls early: a stream failing mid-way, and a graceful
//! shutdown that lets in-flight calls finish and refuses new ones.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{eventually, Fixture};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tonic::Code;

async fn server_reset(mut fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let mut s = echo
        .server_streaming_echo(EchoRequest {
            count: 3,
            fail_with_code: Code::Aborted as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    for _ in 0..3 {
        s.message().await.unwrap().unwrap();
    }
    assert_eq!(s.message().await.unwrap_err().code(), Code::Aborted);

    // Graceful shutdown with a call in flight: the call completes.
    let mut c = echo.clone();
    let inflight = tokio::spawn(async move {
        c.unary_echo(EchoRequest {
            delay_ms: 500,
            message: "late".into(),
            ..Default::default()
        })
        .await
    });
    assert!(
        eventually(Duration::from_secs(5), || fx
            .stats
            .started
            .load(Ordering::SeqCst)
            >= 2)
        .await
    );
    fx.shutdown().await;
    let r = inflight
        .await
        .unwrap()
        .expect("in-flight call finishes during graceful shutdown");
    assert_eq!(r.into_inner().message, "late");

    // After shutdown, calls fail with Unavailable.
    let err = echo.unary_echo(EchoRequest::default()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
}

rpc_tests::on_every_path!(server_reset);
