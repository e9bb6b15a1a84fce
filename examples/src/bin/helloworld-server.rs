//! tonic's helloworld server; only the `Server` import differs.
use clap::Parser;
use rpc_core::Server; // was: use tonic::transport::Server;
use rpc_examples::greeter::MyGreeter;
use rpc_examples::pb::helloworld::greeter_server::GreeterServer;

#[derive(Parser)]
#[command(about = "Greeter server: RDMA (when available) and HTTP/2 on TCP, same port")]
struct Args {
    /// Address to serve on.
    #[arg(long, default_value = rpc_examples::DEFAULT_ADDR)]
    addr: std::net::SocketAddr,
    /// Serve HTTP/2 on TCP only (no RDMA listener).
    #[arg(long)]
    tcp_only: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let greeter = MyGreeter::default();

    println!("GreeterServer listening on {}", args.addr);

    // Standard gRPC health checking and server reflection, as with tonic: stock
    // tools (grpcurl, grpcio's reflection client) can list and call the service.
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<GreeterServer<MyGreeter>>()
        .await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(rpc_examples::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };

    Server::builder()
        .tcp_only(args.tcp_only)
        .add_service(GreeterServer::new(greeter))
        // The echo test service too (slow handlers, status details, streams):
        // stock clients check deadlines and cancellation against it
        // (tests/stock_client/grpcio_hello.py).
        .add_service(rpc_examples::pb::echo::echo_server::EchoServer::new(
            rpc_examples::echo::EchoService::default(),
        ))
        .add_service(health_service)
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?)
        .serve_with_shutdown(args.addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;

    Ok(())
}
