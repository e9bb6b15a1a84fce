//! Server streaming: order and count of messages, route guide ListFeatures.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_examples::pb::routeguide::{route_guide_client::RouteGuideClient, Point, Rectangle};
use rpc_tests::Fixture;

async fn server_streaming(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let mut stream = echo
        .server_streaming_echo(EchoRequest {
            message: "s".into(),
            payload: vec![7; 3000].into(),
            count: 200,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut seq = 0;
    while let Some(m) = stream.message().await.unwrap() {
        assert_eq!(m.seq, seq, "messages arrive in order");
        assert_eq!(m.payload.len(), 3000);
        seq += 1;
    }
    assert_eq!(seq, 200);

    let rect = Rectangle {
        lo: Some(Point {
            latitude: 400_000_000,
            longitude: -750_000_000,
        }),
        hi: Some(Point {
            latitude: 410_000_000,
            longitude: -740_000_000,
        }),
    };
    let expected = rpc_examples::routeguide::service()
        .features
        .iter()
        .filter(|f| rpc_examples::routeguide::in_range(f.location.as_ref().unwrap(), &rect))
        .count();
    assert!(expected > 0);
    let mut rg = RouteGuideClient::new(fx.channel.clone());
    let mut s = rg.list_features(rect).await.unwrap().into_inner();
    let mut n = 0;
    while let Some(_f) = s.message().await.unwrap() {
        n += 1;
    }
    assert_eq!(n, expected);
}

rpc_tests::on_every_path!(server_streaming);
