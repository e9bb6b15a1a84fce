//! Which calls take the direct path (`rpc_core::direct`) and which take
//! tonic's, counted by rpc-core; and that each side's path works with the
//! other's (the bytes on the wire are the same).
//!
//! One test, its steps in order: the counts are the process's, so no other
//! test may run calls beside it (this file is a test binary of its own).

use futures::StreamExt;
use rpc_core::direct::{counts, Counts};
use rpc_core::{Channel, Server, Transport};
use rpc_examples::echo::{EchoService, EchoStats};
use rpc_examples::pb::echo::echo_client::EchoClient;
use rpc_examples::pb::echo::echo_server::EchoServer;
use rpc_examples::pb::echo::EchoRequest;
use std::sync::Arc;
use tonic::Code;

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
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
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
