//! The "run it" demo: a server and a client in one process. The server hosts
//! the greeter, route guide and echo services on RDMA (when there is a device)
//! and HTTP/2 on TCP at the same port; the client connects with the default
//! policy (RDMA first, TCP fallback), runs every call kind and prints a summary.
use clap::Parser;
use rpc_core::{Channel, Server, Transport};
use rpc_examples::echo::EchoService;
use rpc_examples::greeter::MyGreeter;
use rpc_examples::pb::echo::{echo_client::EchoClient, echo_server::EchoServer, EchoRequest};
use rpc_examples::pb::helloworld::{
    greeter_client::GreeterClient, greeter_server::GreeterServer, HelloRequest,
};
use rpc_examples::pb::routeguide::route_guide_client::RouteGuideClient;
use rpc_examples::pb::routeguide::route_guide_server::RouteGuideServer;
use rpc_examples::pb::routeguide::{Point, Rectangle, RouteNote};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "Runs a server and a client in one process and prints a summary")]
struct Args {
    /// Address to serve on (port 0 = any free port). Inside the Soft-RoCE VM use $SOFTROCE_IP:0.
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: std::net::SocketAddr,
    /// Client transport policy: auto, rdma or tcp (default: $RPC_TRANSPORT, else auto).
    #[arg(long)]
    transport: Option<Transport>,
    /// Small unary calls to time.
    #[arg(long, default_value_t = 200)]
    calls: u32,
}

fn row(what: &str, calls: u32, elapsed: Duration, note: &str) {
    let per = elapsed / calls.max(1);
    println!(
        "  {what:<42} {calls:>6} {:>10.2?} {per:>10.2?}  {note}",
        elapsed
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    rpc_examples::init_tracing();
    let args = Args::parse();

    let server = Server::builder()
        .add_service(GreeterServer::new(MyGreeter::default()))
        .add_service(RouteGuideServer::new(rpc_examples::routeguide::service()))
        .add_service(
            EchoServer::new(EchoService::default())
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20),
        )
        .start(args.addr)
        .await?;
    let addr = server.local_addr();
    println!(
        "server: {addr} (HTTP/2 on TCP){}",
        match server.rdma_addr() {
            Some(a) => format!(" and {a} (RDMA)"),
            None => ", no RDMA listener".to_string(),
        }
    );

    let mut builder = Channel::from_shared(addr.to_string()).unwrap();
    if let Some(t) = args.transport {
        builder = builder.transport(t);
    }
    let channel = builder.connect().await?;
    println!("client: transport: {}", channel.transport());

    println!(
        "\n  {:<42} {:>6} {:>10} {:>10}  note",
        "call kind        method", "count", "total", "per call"
    );
    let t = Instant::now();
    let reply = GreeterClient::new(channel.clone())
        .say_hello(HelloRequest {
            name: "demo".into(),
        })
        .await?
        .into_inner();
    row(
        "unary            Greeter/SayHello",
        1,
        t.elapsed(),
        &reply.message,
    );

    let mut rg = RouteGuideClient::new(channel.clone());
    let features = rpc_examples::routeguide::service().features;
    let t = Instant::now();
    let f = rg
        .get_feature(features[1].location.unwrap())
        .await?
        .into_inner();
    row(
        "unary            RouteGuide/GetFeature",
        1,
        t.elapsed(),
        &f.name,
    );

    let t = Instant::now();
    let rect = Rectangle {
        lo: Some(Point {
            latitude: 400_000_000,
            longitude: -750_000_000,
        }),
        hi: Some(Point {
            latitude: 420_000_000,
            longitude: -730_000_000,
        }),
    };
    let mut s = rg.list_features(rect).await?.into_inner();
    let mut n = 0;
    while s.message().await?.is_some() {
        n += 1;
    }
    row(
        "server streaming RouteGuide/ListFeatures",
        1,
        t.elapsed(),
        &format!("{n} features streamed"),
    );

    let t = Instant::now();
    let pts: Vec<Point> = features
        .iter()
        .take(10)
        .map(|f| f.location.unwrap())
        .collect();
    let summary = rg.record_route(tokio_stream::iter(pts)).await?.into_inner();
    row(
        "client streaming RouteGuide/RecordRoute",
        1,
        t.elapsed(),
        &format!("{} points, {} m", summary.point_count, summary.distance),
    );

    let t = Instant::now();
    let notes: Vec<RouteNote> = (0..4)
        .map(|i| RouteNote {
            location: Some(Point {
                latitude: 1,
                longitude: 1,
            }),
            message: format!("note {i}"),
        })
        .collect();
    let mut s = rg.route_chat(tokio_stream::iter(notes)).await?.into_inner();
    let mut n = 0;
    while s.message().await?.is_some() {
        n += 1;
    }
    row(
        "bidi streaming   RouteGuide/RouteChat",
        1,
        t.elapsed(),
        &format!("{n} notes back"),
    );

    let mut echo = EchoClient::new(channel.clone())
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let t = Instant::now();
    for _ in 0..args.calls {
        echo.unary_echo(EchoRequest {
            payload: vec![7; 64].into(),
            ..Default::default()
        })
        .await?;
    }
    row(
        "unary            Echo/UnaryEcho 64 B",
        args.calls,
        t.elapsed(),
        "sequential",
    );

    let payload = vec![0xC3u8; 4 << 20];
    let t = Instant::now();
    let r = echo
        .unary_echo(EchoRequest {
            payload: payload.clone().into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let ok = r.payload == payload;
    let el = t.elapsed();
    row(
        "unary            Echo/UnaryEcho 4 MiB",
        1,
        el,
        &format!(
            "round trip {}, {:.1} MB/s each way",
            if ok { "intact" } else { "CORRUPTED" },
            (4 << 20) as f64 / el.as_secs_f64() / 1e6
        ),
    );

    let rdma = rdma_transport::global_stats();
    println!(
        "\nsummary: transport {}, RDMA messages sent {}, RDMA WRITE chunks {} ({} bytes), announced to the receiver {} ({} bytes read, {} written into destinations it granted)",
        channel.transport(),
        rdma.msgs_sent,
        rdma.rendezvous_writes,
        rdma.rendezvous_bytes,
        rdma.reads_announced,
        rdma.read_bytes,
        rdma.dest_bytes
    );
    drop(channel);
    server.shutdown().await?;
    if !ok {
        return Err("payload corrupted".into());
    }
    Ok(())
}
