//! Client cancellation reaches the handler: dropping a unary future or a
//! response stream cancels the server-side handler.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{eventually, Fixture};
use std::sync::atomic::Ordering;
use std::time::Duration;

async fn cancel(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());

    // Unary: abort the caller while the handler sleeps.
    let mut c = echo.clone();
    let call = tokio::spawn(async move {
        c.unary_echo(EchoRequest {
            delay_ms: 10_000,
            ..Default::default()
        })
        .await
    });
    assert!(
        eventually(Duration::from_secs(5), || fx
            .stats
            .started
            .load(Ordering::SeqCst)
            == 1)
        .await
    );
    call.abort();
    assert!(
        eventually(Duration::from_secs(5), || fx
            .stats
            .cancelled
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "unary handler saw the cancel"
    );

    // Server streaming: read one message, then drop the stream.
    let mut s = echo
        .server_streaming_echo(EchoRequest {
            count: 1_000_000,
            delay_ms: 5,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    s.message().await.unwrap().unwrap();
    drop(s);
    assert!(
        eventually(Duration::from_secs(5), || fx
            .stats
            .cancelled
            .load(Ordering::SeqCst)
            == 2)
        .await,
        "streaming handler saw the cancel"
    );
    assert_eq!(fx.stats.completed.load(Ordering::SeqCst), 0);

    // The connection is still fine.
    echo.unary_echo(EchoRequest::default()).await.unwrap();
}

rpc_tests::on_every_path!(cancel);
