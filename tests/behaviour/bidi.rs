//! Bidirectional streaming: ping-pong (each reply before the next request),
//! and route guide RouteChat.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_examples::pb::routeguide::{route_guide_client::RouteGuideClient, Point, RouteNote};
use rpc_tests::Fixture;
use tokio_stream::wrappers::ReceiverStream;

async fn bidi(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let mut responses = echo
        .bidirectional_streaming_echo(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    for i in 0..100u32 {
        tx.send(EchoRequest {
            message: format!("ping {i}"),
            payload: vec![i as u8; 100].into(),
            ..Default::default()
        })
        .await
        .unwrap();
        let r = responses
            .message()
            .await
            .unwrap()
            .expect("a reply per request");
        assert_eq!(r.message, format!("ping {i}"));
        assert_eq!(r.seq, i);
    }
    drop(tx);
    assert!(
        responses.message().await.unwrap().is_none(),
        "stream ends after half-close"
    );

    let mut rg = RouteGuideClient::new(fx.channel.clone());
    let loc = Point {
        latitude: 1,
        longitude: 2,
    };
    let notes: Vec<RouteNote> = (0..3)
        .map(|i| RouteNote {
            location: Some(loc),
            message: format!("n{i}"),
        })
        .collect();
    let mut s = rg
        .route_chat(tokio_stream::iter(notes))
        .await
        .unwrap()
        .into_inner();
    let mut got = vec![];
    while let Some(n) = s.message().await.unwrap() {
        got.push(n.message);
    }
    // Each note is answered with all notes so far at that location: 1 + 2 + 3.
    assert_eq!(got, ["n0", "n0", "n1", "n0", "n1", "n2"]);
}

rpc_tests::on_every_path!(bidi);
