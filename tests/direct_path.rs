//! Which calls take the direct path (`rpc_core::direct`) and which take
//! tonic's, counted by rpc-core; and that each side's path works with the
//! other's (the bytes on the wire are the same).
//!
//! The counts are the process's: this file is a test binary of its own, and
//! its tests take turns ([`SERIAL`]).

use futures::StreamExt;
use rpc_core::direct::{counts, Counts};
use rpc_core::{Channel, Server, Transport};
use rpc_examples::echo::{EchoService, EchoStats};
use rpc_examples::pb::echo::echo_client::EchoClient;
use rpc_examples::pb::echo::echo_server::EchoServer;
use rpc_examples::pb::echo::EchoRequest;
use rpc_examples::pb::helloworld::greeter_client::GreeterClient;
use rpc_examples::pb::helloworld::greeter_server::{Greeter, GreeterServer};
use rpc_examples::pb::helloworld::{HelloReply, HelloRequest};
use std::sync::Arc;
use tonic::Code;

/// Held by each test: no test's calls run beside another's counting.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn echo() -> EchoServer<EchoService> {
    EchoServer::new(EchoService {
        stats: Arc::new(EchoStats::default()),
    })
}

fn req(message: &str) -> EchoRequest {
    EchoRequest {
        message: message.into(),
        ..Default::default()
    }
}

/// One unary call, one server-streaming call of 3 replies and one
/// client-streaming call (never on the direct path) over `channel`;
/// returns how the counts moved.
async fn calls(channel: Channel) -> Counts {
    let before = counts();
    let mut client = EchoClient::new(channel);
    let r = client.unary_echo(req("one")).await.unwrap();
    assert_eq!(r.into_inner().message, "one");
    let mut replies = client
        .server_streaming_echo(EchoRequest {
            count: 3,
            ..req("three")
        })
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while let Some(r) = replies.next().await {
        assert_eq!(r.unwrap().seq, n);
        n += 1;
    }
    assert_eq!(n, 3);
    let sum = client
        .client_streaming_echo(futures::stream::iter(vec![req("a"), req("b")]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sum.seq, 2);
    let after = counts();
    Counts {
        client: after.client - before.client,
        server: after.server - before.server,
    }
}

async fn memory(server_direct: bool, client_direct: bool) -> Channel {
    let server = Server::builder()
        .direct_path(server_direct)
        .add_service(echo())
        .into_memory();
    let channel = server.channel().await.unwrap();
    // The server lives as long as its connections.
    std::mem::forget(server);
    channel.direct_path(client_direct)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_calls_take_the_direct_path_where_it_applies() {
    let _turn = SERIAL.lock().await;
    // Both sides on (the default): unary and server streaming, not client streaming.
    assert_eq!(
        calls(memory(true, true).await).await,
        Counts {
            client: 2,
            server: 2
        }
    );
    // A client on tonic's path, a server on the direct path, and the reverse.
    assert_eq!(
        calls(memory(true, false).await).await,
        Counts {
            client: 0,
            server: 2
        }
    );
    assert_eq!(
        calls(memory(false, true).await).await,
        Counts {
            client: 2,
            server: 0
        }
    );
    // TCP: tonic's path on both sides.
    let handle = Server::builder()
        .add_service(echo())
        .start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let tcp = Channel::from_shared(handle.local_addr().to_string())
        .unwrap()
        .transport(Transport::TcpOnly)
        .connect()
        .await
        .unwrap();
    assert_eq!(calls(tcp).await, Counts::default());

    // A client with an interceptor: tonic's path (the interceptor runs).
    let before = counts();
    let channel = memory(true, true).await;
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let s = seen.clone();
    let mut client = EchoClient::with_interceptor(channel, move |r| {
        s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(r)
    });
    client.unary_echo(req("intercepted")).await.unwrap();
    assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(counts().client, before.client);
    assert_eq!(counts().server, before.server + 1);

    // A server with a layer: tonic's path there.
    let before = counts();
    let server = Server::builder()
        .layer(tower::layer::util::Identity::new())
        .add_service(echo())
        .into_memory();
    let channel = server.channel().await.unwrap();
    EchoClient::new(channel)
        .unary_echo(req("layered"))
        .await
        .unwrap();
    assert_eq!(counts().client, before.client + 1);
    assert_eq!(counts().server, before.server);

    // Limits and statuses on the direct path are tonic's.
    let channel = memory(true, true).await;
    let mut small = EchoClient::new(channel.clone()).max_decoding_message_size(10);
    let e = small
        .unary_echo(req("a reply longer than ten bytes"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    assert!(
        e.message().contains("decoded message length too large"),
        "{e:?}"
    );
    let e = EchoClient::new(channel.clone())
        .max_encoding_message_size(3)
        .unary_echo(req("four"))
        .await
        .unwrap_err();
    // As tonic's client over HTTP/2 (tests/behaviour/dropin.rs).
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    assert!(
        e.message().contains("encoded message length too large"),
        "{e:?}"
    );
    let e = EchoClient::new(channel)
        .unary_echo(EchoRequest {
            fail_with_code: Code::PermissionDenied as i32,
            ..req("no")
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    handle.shutdown().await.unwrap();
}

/// Tells the caller what its handler saw: the request's metadata names and
/// values (but the user agent's version), whether it had a peer address
/// and `ConnInfo`; and answers with metadata of its own.
struct Seen;

#[tonic::async_trait]
impl Greeter for Seen {
    async fn say_hello(
        &self,
        request: tonic::Request<HelloRequest>,
    ) -> Result<tonic::Response<HelloReply>, tonic::Status> {
        let mut seen: Vec<String> = request
            .metadata()
            .clone()
            .into_headers()
            .iter()
            .map(|(k, v)| match k.as_str() {
                "user-agent" => "user-agent".to_string(),
                _ => format!("{k}={}", v.to_str().unwrap_or("?")),
            })
            .collect();
        seen.sort();
        seen.push(format!(
            "conn_info={}",
            request.extensions().get::<rpc_core::ConnInfo>().is_some()
        ));
        let mut reply = tonic::Response::new(HelloReply {
            message: seen.join(" "),
        });
        reply
            .metadata_mut()
            .insert("x-answer", "42".parse().unwrap());
        // Names tonic reserves are dropped from a handler's metadata.
        reply
            .metadata_mut()
            .insert("content-type", "text/plain".parse().unwrap());
        Ok(reply)
    }
}

/// What one call shows, handler side and client side.
async fn seen_over(server_direct: bool, client_direct: bool) -> (String, Vec<String>) {
    let server = Server::builder()
        .direct_path(server_direct)
        .add_service(GreeterServer::new(Seen))
        .into_memory();
    let channel = server.channel().await.unwrap().direct_path(client_direct);
    std::mem::forget(server);
    let mut request = tonic::Request::new(HelloRequest { name: "x".into() });
    request
        .metadata_mut()
        .insert("x-custom", "value".parse().unwrap());
    request
        .metadata_mut()
        .insert("grpc-status", "13".parse().unwrap());
    request.set_timeout(std::time::Duration::from_secs(30));
    let reply = GreeterClient::new(channel)
        .say_hello(request)
        .await
        .unwrap();
    let mut md: Vec<String> = reply
        .metadata()
        .clone()
        .into_headers()
        .iter()
        .map(|(k, v)| format!("{k}={}", v.to_str().unwrap_or("?")))
        .collect();
    md.sort();
    // The deadline's encoding may differ by rounding: compare its name only.
    let handler = reply
        .into_inner()
        .message
        .split(' ')
        .map(|e| {
            if e.starts_with("grpc-timeout=") {
                "grpc-timeout"
            } else {
                e
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    (handler, md)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_and_callers_see_the_same_on_either_path() {
    let _turn = SERIAL.lock().await;
    let tonic_path = seen_over(false, false).await;
    assert!(tonic_path.0.contains("x-custom=value"), "{tonic_path:?}");
    assert!(!tonic_path.0.contains("grpc-status"), "{tonic_path:?}");
    assert!(
        tonic_path.1.contains(&"x-answer=42".to_string()),
        "{tonic_path:?}"
    );
    for (s, c) in [(true, true), (true, false), (false, true)] {
        assert_eq!(
            seen_over(s, c).await,
            tonic_path,
            "server direct {s}, client direct {c}"
        );
    }
}
