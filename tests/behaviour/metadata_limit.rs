//! One handler's oversized response metadata fails only its own call:
//! the server checks the client's advertised metadata
//! limit before it encodes HEADERS/TRAILERS (`docs/wire-protocol.md` §1.5),
//! so the client never sees a frame it must treat as a protocol violation of
//! the whole connection.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{Fixture, Path};
use tonic::Code;

const CALLS: u32 = 100;
const BIG: u32 = 42;

async fn oversized_response_metadata_fails_only_its_call(fx: Fixture) {
    let echo = EchoClient::new(fx.channel.clone());
    // 100 concurrent calls on one connection; one handler answers with a
    // status carrying 20 KiB of grpc-status-details-bin (over the client's
    // 16 KiB limit once base64-encoded or not).
    let calls = (0..CALLS).map(|i| {
        let mut c = echo.clone();
        async move {
            let big = i == BIG;
            c.unary_echo(EchoRequest {
                message: i.to_string(),
                delay_ms: 100,
                fail_with_code: if big { Code::Aborted as i32 } else { 0 },
                status_details_bytes: if big { 20 << 10 } else { 0 },
                ..Default::default()
            })
            .await
        }
    });
    let results = futures::future::join_all(calls).await;
    for (i, r) in results.into_iter().enumerate() {
        if i as u32 != BIG {
            let r = r.unwrap_or_else(|e| panic!("call {i} failed over {:?}: {e:?}", fx.path));
            assert_eq!(r.into_inner().message, i.to_string());
            continue;
        }
        let e = r.expect_err("the call with oversized trailers fails");
        println!("over {:?}: the oversized call got {e:?}", fx.path);
        match fx.path {
            // HTTP/2 (tonic/hyper/h2): the client's h2 refuses the header
            // block over its 16 KiB SETTINGS_MAX_HEADER_LIST_SIZE by
            // resetting that stream only (PROTOCOL_ERROR: INTERNAL in gRPC's
            // table), which the channel reports as such, not as a lost connection.
            Path::Tcp => {
                assert_eq!(e.code(), Code::Internal, "{e:?}");
                assert!(
                    e.message().contains("stream of this call was reset"),
                    "{e:?}"
                );
            }
            _ => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                let m = e.message();
                assert!(
                    m.contains("trailers")
                        && m.contains("limit of 16384 bytes")
                        && m.contains("grpc-status 10"),
                    "the status names the limit, the size and the handler's status: {m}"
                );
            }
        }
    }
    // The connection carries on.
    carries_on(&mut echo.clone()).await;
}

/// The next call on the same channel succeeds.
async fn carries_on(echo: &mut EchoClient<rpc_core::Channel>) {
    let r = echo
        .unary_echo(EchoRequest {
            message: "after".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.into_inner().message, "after");
}

rpc_tests::on_every_path!(oversized_response_metadata_fails_only_its_call);

/// Request metadata over the server's limit (its HELLO's
/// `max_metadata_bytes`, 16 KiB by default) is never sent on a message
/// connection: that call alone fails RESOURCE_EXHAUSTED with the reason,
/// and the connection carries on.
async fn oversized_request_metadata_fails_only_its_call(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let mut req = tonic::Request::new(EchoRequest {
        message: "big".into(),
        ..Default::default()
    });
    let big = "x".repeat(20 << 10);
    req.metadata_mut()
        .insert("x-big", big.parse().expect("an ASCII value"));
    let e = echo.unary_echo(req).await.expect_err("over the limit");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains("request metadata not sent")
            && e.message().contains("max_metadata_bytes"),
        "{e:?}"
    );
    carries_on(&mut echo).await;
}

rpc_tests::on_paths!([memory, memory_tonic, rdma, rdma_tonic] oversized_request_metadata_fails_only_its_call);
