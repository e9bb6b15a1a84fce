//! Unary calls: helloworld, route guide GetFeature, echo with a payload.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_examples::pb::helloworld::{greeter_client::GreeterClient, HelloRequest};
use rpc_examples::pb::routeguide::{route_guide_client::RouteGuideClient, Point};
use rpc_tests::Fixture;

async fn unary(fx: Fixture) {
    let mut greeter = GreeterClient::new(fx.channel.clone());
    let reply = greeter
        .say_hello(HelloRequest {
            name: "RDMA".into(),
        })
        .await
        .expect("SayHello succeeds")
        .into_inner();
    assert_eq!(reply.message, "Hello RDMA!");

    let features = rpc_examples::routeguide::service().features;
    let known = features.iter().find(|f| !f.name.is_empty()).unwrap();
    let mut rg = RouteGuideClient::new(fx.channel.clone());
    let got = rg
        .get_feature(known.location.unwrap())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(&got, known);
    let none = rg
        .get_feature(Point {
            latitude: 1,
            longitude: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(none.name.is_empty());

    let mut echo = EchoClient::new(fx.channel.clone());
    for size in [0usize, 1, 100, 4095, 4096, 65_537, 1 << 20] {
        let payload: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        let resp = echo
            .unary_echo(EchoRequest {
                message: format!("size {size}"),
                payload: payload.clone().into(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("echo of {size} bytes: {e}"))
            .into_inner();
        assert_eq!(
            resp.payload, payload,
            "payload of {size} bytes comes back intact"
        );
        assert_eq!(resp.crc32, crc32fast::hash(&payload));
        assert_eq!(resp.message, format!("size {size}"));
    }
}

rpc_tests::on_every_path!(unary);
