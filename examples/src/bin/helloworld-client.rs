//! tonic's helloworld client; only the channel construction differs.
use clap::Parser;
use rpc_core::{Channel, Transport};
use rpc_examples::pb::helloworld::greeter_client::GreeterClient;
use rpc_examples::pb::helloworld::HelloRequest;

#[derive(Parser)]
#[command(
    about = "Greeter client: RDMA first, TCP fallback; prints which transport carried the call"
)]
struct Args {
    /// Server address.
    #[arg(long, default_value = rpc_examples::DEFAULT_ADDR)]
    addr: String,
    /// Transport policy: auto, rdma or tcp (default: $RPC_TRANSPORT, else auto).
    #[arg(long)]
    transport: Option<Transport>,
    /// Name to greet.
    #[arg(long, default_value = "Tonic")]
    name: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let mut builder = Channel::from_shared(args.addr).unwrap();
    if let Some(t) = args.transport {
        builder = builder.transport(t);
    }
    let channel = builder.connect().await?;
    let transport = channel.transport().clone();

    let mut client = GreeterClient::new(channel);

    let request = tonic::Request::new(HelloRequest { name: args.name });

    let response = client.say_hello(request).await?;

    println!("RESPONSE={:?}", response.into_inner());
    println!("transport: {transport}");

    Ok(())
}
