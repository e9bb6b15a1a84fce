//! tonic's route guide client over rpc-core: all four call kinds.
use clap::Parser;
use rpc_core::{Channel, Transport};
use rpc_examples::pb::routeguide::route_guide_client::RouteGuideClient;
use rpc_examples::pb::routeguide::{Point, Rectangle, RouteNote};
use std::error::Error;
use std::time::Duration;
use tokio::time;
use tonic::Request;

#[derive(Parser)]
#[command(about = "Route guide client: GetFeature, ListFeatures, RecordRoute, RouteChat")]
struct Args {
    /// Server address.
    #[arg(long, default_value = rpc_examples::DEFAULT_ADDR)]
    addr: String,
    /// Transport policy: auto, rdma or tcp (default: $RPC_TRANSPORT, else auto).
    #[arg(long)]
    transport: Option<Transport>,
}

async fn print_features(client: &mut RouteGuideClient<Channel>) -> Result<(), Box<dyn Error>> {
    let rectangle = Rectangle {
        lo: Some(Point {
            latitude: 400_000_000,
            longitude: -750_000_000,
        }),
        hi: Some(Point {
            latitude: 420_000_000,
            longitude: -730_000_000,
        }),
    };

    let mut stream = client
        .list_features(Request::new(rectangle))
        .await?
        .into_inner();

    let mut n = 0;
    while let Some(feature) = stream.message().await? {
        n += 1;
        if n <= 3 {
            println!("FEATURE = {feature:?}");
        }
    }
    println!("ListFeatures: {n} features");

    Ok(())
}

async fn run_record_route(client: &mut RouteGuideClient<Channel>) -> Result<(), Box<dyn Error>> {
    let point_count: usize = rand::random_range(2..100);

    let mut points = vec![];
    for _ in 0..=point_count {
        points.push(random_point())
    }

    println!("Traversing {} points", points.len());
    let request = Request::new(tokio_stream::iter(points));

    match client.record_route(request).await {
        Ok(response) => println!("SUMMARY: {:?}", response.into_inner()),
        Err(e) => println!("something went wrong: {e:?}"),
    }

    Ok(())
}

async fn run_route_chat(client: &mut RouteGuideClient<Channel>) -> Result<(), Box<dyn Error>> {
    let start = time::Instant::now();

    let outbound = async_stream(move |tx| async move {
        let mut interval = time::interval(Duration::from_millis(50));
        for _ in 0..5 {
            let time = interval.tick().await;
            let elapsed = time.duration_since(start);
            let note = RouteNote {
                location: Some(Point {
                    latitude: 409_146_138 + elapsed.as_secs() as i32,
                    longitude: -746_188_906,
                }),
                message: format!("at {elapsed:?}"),
            };
            if tx.send(note).await.is_err() {
                return;
            }
        }
    });

    let response = client.route_chat(Request::new(outbound)).await?;
    let mut inbound = response.into_inner();

    while let Some(note) = inbound.message().await? {
        println!("NOTE = {note:?}");
    }

    Ok(())
}

fn async_stream<F, Fut>(f: F) -> tokio_stream::wrappers::ReceiverStream<RouteNote>
where
    F: FnOnce(tokio::sync::mpsc::Sender<RouteNote>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

fn random_point() -> Point {
    let latitude = (rand::random_range(0..180) - 90) * 10_000_000;
    let longitude = (rand::random_range(0..360) - 180) * 10_000_000;
    Point {
        latitude,
        longitude,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let mut builder = Channel::builder(args.addr);
    if let Some(t) = args.transport {
        builder = builder.transport(t);
    }
    let channel = builder.connect().await?;
    let transport = channel.transport().clone();
    let mut client = RouteGuideClient::new(channel);

    println!("*** SIMPLE RPC ***");
    let response = client
        .get_feature(Request::new(Point {
            latitude: 409_146_138,
            longitude: -746_188_906,
        }))
        .await?;
    println!("RESPONSE = {:?}", response.into_inner());

    println!("\n*** SERVER STREAMING ***");
    print_features(&mut client).await?;

    println!("\n*** CLIENT STREAMING ***");
    run_record_route(&mut client).await?;

    println!("\n*** BIDIRECTIONAL STREAMING ***");
    run_route_chat(&mut client).await?;

    println!("transport: {transport}");
    Ok(())
}
