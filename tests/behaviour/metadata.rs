//! Metadata both ways: ASCII and binary request metadata reach the handler
//! and come back as response headers; trailers carry custom metadata.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::Fixture;
use tonic::metadata::{BinaryMetadataValue, MetadataValue};

async fn metadata(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let mut req = tonic::Request::new(EchoRequest {
        message: "md".into(),
        ..Default::default()
    });
    req.metadata_mut()
        .insert("x-echo-user", MetadataValue::from_static("alice"));
    req.metadata_mut().insert_bin(
        "x-echo-trace-bin",
        BinaryMetadataValue::from_bytes(&[0, 1, 2, 255]),
    );
    req.metadata_mut()
        .insert("x-not-echoed", MetadataValue::from_static("nope"));
    let resp = echo.unary_echo(req).await.unwrap();
    let md = resp.metadata();
    assert_eq!(md.get("x-echo-user").unwrap(), "alice");
    assert_eq!(
        md.get_bin("x-echo-trace-bin")
            .unwrap()
            .to_bytes()
            .unwrap()
            .as_ref(),
        &[0, 1, 2, 255]
    );
    assert!(md.get("x-not-echoed").is_none());

    // Streaming responses carry headers too.
    let mut req = tonic::Request::new(EchoRequest {
        count: 2,
        ..Default::default()
    });
    req.metadata_mut()
        .insert("x-echo-stream", MetadataValue::from_static("yes"));
    let resp = echo.server_streaming_echo(req).await.unwrap();
    assert_eq!(resp.metadata().get("x-echo-stream").unwrap(), "yes");
    let mut s = resp.into_inner();
    while s.message().await.unwrap().is_some() {}
    let trailers = s
        .trailers()
        .await
        .unwrap()
        .expect("trailers after the stream");
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");

    // Custom trailers arrive with an error status.
    let err = echo
        .unary_echo(EchoRequest {
            fail_with_code: tonic::Code::Aborted as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.metadata().get("x-trailer-reason").unwrap(), "requested");
}

rpc_tests::on_every_path!(metadata);
