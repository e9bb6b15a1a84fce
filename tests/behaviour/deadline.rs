//! Deadlines: `grpc-timeout` is enforced and the handler is cancelled.
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{eventually, Fixture};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tonic::Code;

async fn deadline(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let mut req = tonic::Request::new(EchoRequest {
        delay_ms: 5_000,
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(200));
    let t = Instant::now();
    let err = echo.unary_echo(req).await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "deadline fired late: {:?}",
        t.elapsed()
    );
    assert!(
        eventually(Duration::from_secs(3), || fx
            .stats
            .cancelled
            .load(Ordering::SeqCst)
            >= 1)
        .await,
        "the handler was cancelled"
    );

    // A call within its deadline succeeds.
    let mut req = tonic::Request::new(EchoRequest {
        delay_ms: 10,
        ..Default::default()
    });
    req.set_timeout(Duration::from_secs(10));
    echo.unary_echo(req).await.unwrap();

    // A deadline on a stream cuts it mid-way.
    let mut req = tonic::Request::new(EchoRequest {
        count: 1000,
        delay_ms: 20,
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(300));
    let mut s = echo.server_streaming_echo(req).await.unwrap().into_inner();
    let mut n = 0;
    let err = loop {
        match s.message().await {
            Ok(Some(_)) => n += 1,
            Ok(None) => panic!("stream ended normally after {n} messages"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), Code::DeadlineExceeded);
    assert!(n < 1000);
}

rpc_tests::on_every_path!(deadline);

/// A server stream whose deadline passes after the first message: the client
/// gets DEADLINE_EXCEEDED and the handler is dropped even though the client
/// still holds the response stream.
async fn stream_deadline_drops_the_handler(fx: Fixture) {
    let mut echo = EchoClient::new(fx.channel.clone());
    let mut req = tonic::Request::new(EchoRequest {
        count: 1_000_000,
        delay_ms: 20,
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(500));
    let mut s = echo.server_streaming_echo(req).await.unwrap().into_inner();
    s.message().await.unwrap().expect("a first message");
    let err = loop {
        match s.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("stream ended normally"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    let t = Instant::now();
    // `s` is still held here.
    assert!(
        eventually(Duration::from_secs(5), || fx
            .stats
            .cancelled
            .load(Ordering::SeqCst)
            == 1)
        .await,
        "the handler is dropped at the deadline ({:?})",
        fx.path
    );
    println!(
        "over {:?}: streaming handler dropped {:?} after the client saw DEADLINE_EXCEEDED",
        fx.path,
        t.elapsed()
    );
    assert_eq!(fx.stats.completed.load(Ordering::SeqCst), 0);
    drop(s);
    echo.unary_echo(EchoRequest::default()).await.unwrap();
}

rpc_tests::on_every_path!(stream_deadline_drops_the_handler);

/// Our server over TCP answers an expired `grpc-timeout` with
/// DEADLINE_EXCEEDED, as gRPC specifies, not tonic's CANCELLED "Timeout
/// expired". A raw HTTP/2 client, which keeps no timer of its own, reads the
/// server's own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_server_answers_an_expired_deadline_with_deadline_exceeded() {
    use prost::Message;
    let stats = std::sync::Arc::new(rpc_examples::echo::EchoStats::default());
    let handle = rpc_tests::router(stats.clone())
        .start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let tcp = tokio::net::TcpStream::connect(handle.local_addr())
        .await
        .unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    for (path, body) in [
        // A unary handler that sleeps past the deadline.
        (
            "/echo.Echo/UnaryEcho",
            EchoRequest {
                delay_ms: 5_000,
                ..Default::default()
            },
        ),
        // A server stream whose deadline passes after its first messages.
        (
            "/echo.Echo/ServerStreamingEcho",
            EchoRequest {
                count: 1_000_000,
                delay_ms: 20,
                ..Default::default()
            },
        ),
    ] {
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}{path}", handle.local_addr()))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("grpc-timeout", "200m")
            .body(())
            .unwrap();
        let (resp, mut send) = client.send_request(req, false).unwrap();
        let msg = body.encode_to_vec();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        framed.extend_from_slice(&msg);
        send.send_data(framed.into(), true).unwrap();
        let t = Instant::now();
        let resp = tokio::time::timeout(Duration::from_secs(10), resp)
            .await
            .expect("an answer")
            .unwrap();
        let (parts, mut body) = resp.into_parts();
        let status = match parts.headers.get("grpc-status") {
            Some(_) => parts.headers.clone(), // Trailers-Only
            None => {
                while let Some(d) = body.data().await {
                    let d = d.unwrap();
                    let _ = body.flow_control().release_capacity(d.len());
                }
                body.trailers().await.unwrap().expect("trailers")
            }
        };
        let code = status.get("grpc-status").unwrap().to_str().unwrap();
        let message = status
            .get("grpc-message")
            .map(|m| m.to_str().unwrap().to_string());
        println!(
            "{path}: grpc-status {code} {message:?} after {:?}",
            t.elapsed()
        );
        assert_eq!(
            code,
            (Code::DeadlineExceeded as i32).to_string(),
            "{path}: {message:?}"
        );
    }
    assert!(
        eventually(Duration::from_secs(5), || stats
            .cancelled
            .load(Ordering::SeqCst)
            == 2)
        .await,
        "both handlers dropped at the deadline"
    );
    drop(client);
    handle.shutdown().await.unwrap();
}
