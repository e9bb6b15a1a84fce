//! Client cancellation reaches the handler: dropping a unary future or a
//! response stream cancels the server-side handler, also while the request
//! stream is still open (on TCP, where hyper resets an HTTP/2 stream only
//! once both halves are gone, rpc-core resets it when the response goes).
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{eventually, Fixture};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio_stream::wrappers::ReceiverStream;

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

/// A bidi call cancelled after the first response, its request stream still open.
async fn bidi_cancel_with_request_open(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(EchoRequest {
        message: "first".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut responses = echo
        .bidirectional_streaming_echo(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = responses
        .message()
        .await
        .unwrap()
        .expect("a first response");
    assert_eq!(first.message, "first");
    assert_eq!(fx.stats.started.load(Ordering::SeqCst), 1);

    // Cancel: drop the response stream, keep the request stream (`tx`) open.
    let t = Instant::now();
    drop(responses);
    assert!(
        eventually(Duration::from_secs(5), || fx
            .stats
            .cancelled
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "the handler is dropped although the request stream is open ({:?}; started {}, completed {}, cancelled {})",
        fx.path,
        fx.stats.started.load(Ordering::SeqCst),
        fx.stats.completed.load(Ordering::SeqCst),
        fx.stats.cancelled.load(Ordering::SeqCst),
    );
    println!(
        "over {:?}: bidi handler dropped {:?} after the response stream was",
        fx.path,
        t.elapsed()
    );
    assert_eq!(fx.stats.completed.load(Ordering::SeqCst), 0);
    // The cancelled call lets go of its request stream too.
    assert!(
        eventually(Duration::from_secs(5), || tx.is_closed()).await,
        "the request stream is released"
    );

    // The connection is still fine.
    echo.unary_echo(EchoRequest::default()).await.unwrap();
}

rpc_tests::on_every_path!(bidi_cancel_with_request_open);
