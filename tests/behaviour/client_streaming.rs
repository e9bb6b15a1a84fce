//! Client streaming: all messages reach the server in order (CRC over the
//! concatenation), route guide RecordRoute.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_examples::pb::routeguide::{route_guide_client::RouteGuideClient, Point};
use rpc_tests::Fixture;

async fn client_streaming(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let msgs: Vec<EchoRequest> = (0..300u32)
        .map(|i| EchoRequest {
            message: format!("m{i}"),
            payload: vec![(i % 256) as u8; (i as usize * 37) % 5000].into(),
            ..Default::default()
        })
        .collect();
    let mut h = crc32fast::Hasher::new();
    for m in &msgs {
        h.update(&m.payload);
    }
    let resp = echo
        .client_streaming_echo(tokio_stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.seq, 300);
    assert_eq!(resp.crc32, h.finalize());
    assert_eq!(resp.message, "m299");

    let features = rpc_examples::routeguide::service().features;
    let pts: Vec<Point> = features
        .iter()
        .take(5)
        .map(|f| f.location.unwrap())
        .collect();
    let mut rg = RouteGuideClient::new(fx.channel.clone());
    let summary = rg
        .record_route(tokio_stream::iter(pts.clone()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(summary.point_count, 5);
    assert_eq!(summary.feature_count, 5);
    let dist: i32 = pts
        .windows(2)
        .map(|w| rpc_examples::routeguide::calc_distance(&w[0], &w[1]))
        .sum();
    assert_eq!(summary.distance, dist);
}

rpc_tests::on_every_path!(client_streaming);
