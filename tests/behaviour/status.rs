//! Status codes, messages and details; unknown methods are Unimplemented.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::Fixture;
use tonic::Code;

async fn status(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    for code in [
        Code::InvalidArgument,
        Code::NotFound,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Internal,
        Code::Unavailable,
    ] {
        let err = echo
            .unary_echo(EchoRequest {
                message: "über".into(),
                fail_with_code: code as i32,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code);
        assert_eq!(err.message(), "failing as asked: über");
        assert_eq!(
            err.details(),
            b"\x08\x2a detail-bytes",
            "grpc-status-details-bin survives"
        );
    }

    // Errors at the end of streams.
    let err = echo
        .client_streaming_echo(tokio_stream::iter(vec![EchoRequest {
            fail_with_code: Code::DataLoss as i32,
            ..Default::default()
        }]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DataLoss);

    // A service the server does not host.
    let mut other =
        rpc_examples::pb::helloworld::greeter_client::GreeterClient::new(fx.channel.clone());
    let mut path_client = tonic::client::Grpc::new(fx.channel.clone());
    path_client.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<
        rpc_examples::pb::helloworld::HelloRequest,
        rpc_examples::pb::helloworld::HelloReply,
    >::default();
    let err = path_client
        .unary(
            tonic::Request::new(rpc_examples::pb::helloworld::HelloRequest::default()),
            "/nope.Missing/Method".parse().unwrap(),
            codec,
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    // and the channel still works afterwards
    other
        .say_hello(rpc_examples::pb::helloworld::HelloRequest { name: "x".into() })
        .await
        .unwrap();
}

rpc_tests::on_every_path!(status);
