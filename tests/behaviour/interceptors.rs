//! tonic interceptors on both sides, tower layers on the channel, and the
//! connection info interceptors can read.
use rpc_examples::pb::echo::{echo_client::EchoClient, echo_server::EchoServer, EchoRequest};
use rpc_examples::pb::helloworld::{greeter_client::GreeterClient, HelloRequest};
use rpc_tests::{Fixture, Path};
use std::time::Duration;
use tonic::{Code, Request, Status};

fn check_auth(req: Request<()>) -> Result<Request<()>, Status> {
    match req.metadata().get("authorization") {
        Some(t) if t == "Bearer secret" => Ok(req),
        _ => Err(Status::unauthenticated("missing or bad token")),
    }
}

fn router(stats: std::sync::Arc<rpc_examples::echo::EchoStats>) -> rpc_core::Router {
    let echo = rpc_examples::echo::EchoService { stats };
    rpc_core::Server::builder()
        .add_service(EchoServer::with_interceptor(echo, check_auth))
        .add_service(
            rpc_examples::pb::helloworld::greeter_server::GreeterServer::with_interceptor(
                rpc_examples::greeter::MyGreeter::default(),
                |req: Request<()>| {
                    // The connection info is visible to interceptors (on message transports).
                    let tag = match req.extensions().get::<rpc_core::ConnInfo>() {
                        Some(i) => i.transport.to_string(),
                        None => "tcp".to_string(),
                    };
                    let mut req = req;
                    req.metadata_mut()
                        .insert("x-transport", tag.parse().unwrap());
                    Ok(req)
                },
            ),
        )
}

async fn interceptors(fx: Fixture) {
    let mut plain = EchoClient::new(fx.channel.clone());
    let err = plain.unary_echo(EchoRequest::default()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    let mut authed = EchoClient::with_interceptor(fx.channel.clone(), |mut req: Request<()>| {
        req.metadata_mut()
            .insert("authorization", "Bearer secret".parse().unwrap());
        Ok(req)
    });
    authed.unary_echo(EchoRequest::default()).await.unwrap();

    // tower layers on the channel: a timeout and a concurrency limit.
    let layered = tower::ServiceBuilder::new()
        .timeout(Duration::from_millis(200))
        .concurrency_limit(4)
        .service(fx.channel.clone());
    let mut authed = EchoClient::with_interceptor(layered, |mut req: Request<()>| {
        req.metadata_mut()
            .insert("authorization", "Bearer secret".parse().unwrap());
        Ok(req)
    });
    authed.unary_echo(EchoRequest::default()).await.unwrap();
    let err = authed
        .unary_echo(EchoRequest {
            delay_ms: 2_000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    // tonic turns a tower error into Unknown with the error's text, as over its own transport.
    assert_eq!(err.code(), Code::Unknown, "{err:?}");
    assert!(err.message().contains("timed out"), "{err:?}");

    let mut greeter = GreeterClient::new(fx.channel.clone());
    greeter
        .say_hello(HelloRequest { name: "i".into() })
        .await
        .unwrap();
}

async fn run(path: Path) {
    let Some(fx) = Fixture::start_with(path, router).await else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), interceptors(fx))
        .await
        .expect("in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory() {
    run(Path::Memory).await
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp() {
    run(Path::Tcp).await
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn rdma() {
    run(Path::Rdma).await
}
