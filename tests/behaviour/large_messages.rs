//! Message size limits: 64 MiB round trip with raised limits; the 4 MiB
//! default is enforced by tonic's codec, on every path with the same status
//! tonic gives over its own transport (OutOfRange, naming size and limit).
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_examples::pb::helloworld::{greeter_client::GreeterClient, HelloRequest};
use rpc_tests::{Fixture, Path, BIG_LIMIT};
use tonic::Code;

async fn large_messages(fx: Fixture) {
    let size = 64 << 20;
    let payload: Vec<u8> = (0..size)
        .map(|i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let crc = crc32fast::hash(&payload);
    let mut echo = EchoClient::new(fx.channel.clone())
        .max_decoding_message_size(BIG_LIMIT)
        .max_encoding_message_size(BIG_LIMIT);
    // Reply small, then reply big: both directions carry 64 MiB.
    let resp = echo
        .unary_echo(EchoRequest {
            payload: payload.clone().into(),
            reply_bytes: 1,
            ..Default::default()
        })
        .await
        .expect("64 MiB request")
        .into_inner();
    assert_eq!(resp.crc32, crc, "64 MiB request arrived intact");
    let resp = echo
        .unary_echo(EchoRequest {
            payload: payload.into(),
            ..Default::default()
        })
        .await
        .expect("64 MiB request and response")
        .into_inner();
    assert_eq!(resp.payload.len(), size);
    assert_eq!(
        crc32fast::hash(&resp.payload),
        crc,
        "64 MiB response arrived intact"
    );

    // Default limits (4 MiB) on the greeter service.
    let mut greeter = GreeterClient::new(fx.channel.clone());
    let err = greeter
        .say_hello(HelloRequest {
            name: "x".repeat(5 << 20),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    assert!(
        err.message().contains("the limit is: 4194304 bytes"),
        "{err:?}"
    );
    // Client-side default limit on decoding.
    let mut small = EchoClient::new(fx.channel.clone());
    let err = small
        .unary_echo(EchoRequest {
            reply_bytes: 5 << 20,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    assert!(
        err.message().contains("the limit is: 4194304 bytes"),
        "{err:?}"
    );
    if fx.path != Path::Tcp {
        // The connection survives oversize messages.
        small.unary_echo(EchoRequest::default()).await.unwrap();
    }
}

rpc_tests::on_every_path!(large_messages);
