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

    Server::builder()
        .tcp_only(args.tcp_only)
        .add_service(GreeterServer::new(greeter))
        .serve_with_shutdown(args.addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;

    Ok(())
}
