//! A handler that panics fails its call (INTERNAL on message connections),
//! whether it panics in its first poll (run in place, `session::opened`) or
//! later in its own task; the connection and its other calls go on.
use std::time::Duration;

use rpc_examples::echo::PANIC_MESSAGE;
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{Fixture, Path};
use tonic::Code;

async fn handler_panic(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    // delay 0: panics in the first poll; 20 ms: after an await, in a task.
    for delay_ms in [0, 20] {
        let r = tokio::time::timeout(
            Duration::from_secs(20),
            echo.unary_echo(EchoRequest {
                message: PANIC_MESSAGE.into(),
                delay_ms,
                ..Default::default()
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("no answer to a panicking handler (delay {delay_ms} ms)"));
        let err = r.expect_err("a panicking handler's call fails");
        if fx.path != Path::Tcp {
            // Over TCP, tonic's HTTP/2 server answers as it does.
            assert_eq!(err.code(), Code::Internal, "{err:?}");
            assert!(err.message().contains("panicked"), "{err:?}");
        }
        // The connection still serves calls.
        let ok = echo
            .unary_echo(EchoRequest {
                message: format!("after a panic (delay {delay_ms} ms)"),
                ..Default::default()
            })
            .await
            .expect("the next call succeeds")
            .into_inner();
        assert_eq!(ok.message, format!("after a panic (delay {delay_ms} ms)"));
    }
}

rpc_tests::on_every_path!(handler_panic);
