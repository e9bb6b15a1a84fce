//! tonic's route guide client over rpc-core: all four call kinds.
use clap::Parser;
use rpc_core::{Channel, Transport};
use rpc_examples::pb::routeguide::route_guide_client::RouteGuideClient;
use rpc_examples::pb::routeguide::{Point, Rectangle, RouteNote};
use std::error::Error;
use std::time::{Duration, Instant};
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

/// One summary line per call kind: what it did and how long it took.
fn report(kind: &str, call: &str, started: Instant, what: String) {
    println!("{kind:<18} {call:<13} {:>9.2?}  {what}", started.elapsed());
}

async fn get_feature(client: &mut RouteGuideClient<Channel>) -> Result<(), Box<dyn Error>> {
    let t = Instant::now();
    let at = Point {
        latitude: 409_146_138,
        longitude: -746_188_906,
    };
    let feature = client.get_feature(Request::new(at)).await?.into_inner();
    let what = if feature.name.is_empty() {
        format!("no feature at ({}, {})", at.latitude, at.longitude)
    } else {
        format!("found {:?}", feature.name)
    };
    report("unary", "GetFeature", t, what);
    Ok(())
}

async fn list_features(client: &mut RouteGuideClient<Channel>) -> Result<(), Box<dyn Error>> {
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
    let t = Instant::now();
    let mut stream = client
        .list_features(Request::new(rectangle))
        .await?
        .into_inner();
    let mut n = 0;
    let mut first = None;
    while let Some(feature) = stream.message().await? {
        n += 1;
        first.get_or_insert(feature.name);
    }
    report(
        "server streaming",
        "ListFeatures",
        t,
        format!(
            "{n} features received (first: {:?})",
            first.unwrap_or_default()
        ),
    );
    Ok(())
}

async fn record_route(client: &mut RouteGuideClient<Channel>) -> Result<(), Box<dyn Error>> {
    let point_count: usize = rand::random_range(2..100);
    let points: Vec<Point> = (0..=point_count).map(|_| random_point()).collect();
    let sent = points.len();
    let t = Instant::now();
    let summary = client
        .record_route(Request::new(tokio_stream::iter(points)))
        .await?
        .into_inner();
    report(
        "client streaming",
        "RecordRoute",
        t,
        format!(
            "{sent} points sent; server counted {} points, {} features, {} m",
            summary.point_count, summary.feature_count, summary.distance
        ),
    );
    Ok(())
}

async fn route_chat(client: &mut RouteGuideClient<Channel>) -> Result<(), Box<dyn Error>> {
    let start = time::Instant::now();
    const NOTES: usize = 5;
    let outbound = async_stream(move |tx| async move {
        let mut interval = time::interval(Duration::from_millis(50));
        for _ in 0..NOTES {
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

    let t = Instant::now();
    let response = client.route_chat(Request::new(outbound)).await?;
    let mut inbound = response.into_inner();
    let mut n = 0;
    while inbound.message().await?.is_some() {
        n += 1;
    }
    report(
        "bidi streaming",
        "RouteChat",
        t,
        format!("{NOTES} notes sent 50 ms apart, {n} notes received"),
    );
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
    let mut builder = Channel::from_shared(args.addr).unwrap();
    if let Some(t) = args.transport {
        builder = builder.transport(t);
    }
    let channel = builder.connect().await?;
    let transport = channel.transport().clone();
    let mut client = RouteGuideClient::new(channel);

    get_feature(&mut client).await?;
    list_features(&mut client).await?;
    record_route(&mut client).await?;
    route_chat(&mut client).await?;

    println!("transport: {transport}");
    Ok(())
}
