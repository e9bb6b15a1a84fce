//! 1000 concurrent calls multiplexed on one connection, and a slow stream
//! that does not block the others (per-call flow control).
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::Fixture;
use std::time::Duration;

async fn concurrency(fx: Fixture) {
    let echo = EchoClient::new(fx.channel.clone());
    let calls = (0..1000u32).map(|i| {
        let mut c = echo.clone();
        async move {
            let r = c
                .unary_echo(EchoRequest {
                    message: i.to_string(),
                    payload: vec![(i % 251) as u8; 64 + (i as usize % 512)].into(),
                    delay_ms: 20,
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("call {i}: {e}"))
                .into_inner();
            assert_eq!(r.message, i.to_string());
            assert_eq!(r.payload.len(), 64 + (i as usize % 512));
        }
    });
    futures::future::join_all(calls).await;

    // The same from many tasks on several threads: call ids must still reach
    // the server in increasing order (OPEN is queued with the id allocation).
    let tasks: Vec<_> = (0..400u32)
        .map(|i| {
            let mut c = echo.clone();
            tokio::spawn(async move {
                c.unary_echo(EchoRequest {
                    message: i.to_string(),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("spawned call {i}: {e}"))
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }

    // A stream whose reader never reads: its window fills, others carry on.
    let mut c = echo.clone();
    let stalled = c
        .server_streaming_echo(EchoRequest {
            count: 10_000,
            payload: vec![1; 64 << 10].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut c2 = echo.clone();
    tokio::time::timeout(
        Duration::from_secs(10),
        c2.unary_echo(EchoRequest {
            payload: vec![2; 100_000].into(),
            ..Default::default()
        }),
    )
    .await
    .expect("a stalled stream does not block other calls")
    .unwrap();
    drop(stalled);
}

rpc_tests::on_every_path!(concurrency);
