//! tonic's own example programs, switched by the one-line change (`use
//! tonic::transport::{..}` → `use rpc_core::{..}`), written in their image:
//! what their handlers print and rely on must be the same on every path.
//!
//! * helloworld: the handler prints `request.remote_addr()`; the client is
//!   built with the generated `GreeterClient::connect(url)`.
//! * streaming: the server-stream handler spawns a task that sends on an
//!   mpsc channel until `tx.send` fails ("client disconnected"); the bidi
//!   handler looks for an `io::Error` of kind `BrokenPipe` in its request
//!   stream's error.
//! * mock: `serve_with_incoming` over one end of `tokio::io::duplex`, and
//!   `Endpoint::connect_with_connector` over the other.
//! * the builder lines of the other examples (`Channel::builder(uri)`,
//!   `Endpoint::new`, `serve_with_shutdown(addr, notify.notified())`...).
use futures::StreamExt;
use rpc_core::{Channel, Endpoint, Server, Transport, TransportKind};
use rpc_examples::pb::echo::echo_client::EchoClient;
use rpc_examples::pb::echo::echo_server::EchoServer;
use rpc_examples::pb::echo::EchoRequest;
use rpc_examples::pb::helloworld::greeter_client::GreeterClient;
use rpc_examples::pb::helloworld::greeter_server::GreeterServer;
use rpc_examples::pb::helloworld::HelloRequest;
use rpc_tests::tonic_example::Example;
use rpc_tests::{device_required, eventually, rdma_ip, Path};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request};

/// A server of the examples' services over `path`, and the URL a client
/// uses (`None`: the path is skipped here).
async fn serve(path: Path, ex: &Example) -> Option<(rpc_core::ServingHandle, String, Transport)> {
    let ip = match path {
        Path::Tcp => "127.0.0.1".to_string(),
        Path::Rdma => match rdma_ip() {
            Some(ip) => ip,
            None => {
                assert!(!device_required(), "SOFTROCE_IP / RDMA_TEST_IP must be set");
                println!("SKIP: no RDMA test address (SOFTROCE_IP / RDMA_TEST_IP unset)");
                return None;
            }
        },
        Path::Memory | Path::MemoryTonic | Path::RdmaTonic => {
            unreachable!("run over tcp and rdma only")
        }
    };
    let h = Server::builder()
        .add_service(GreeterServer::new(ex.clone()))
        .add_service(EchoServer::new(ex.clone()))
        .start(format!("{ip}:0").parse().unwrap())
        .await
        .unwrap();
    let (addr, t) = match path {
        Path::Rdma => match h.rdma_addr() {
            Some(a) => (a, Transport::RdmaOnly),
            None => {
                assert!(
                    !device_required(),
                    "no RDMA listener although a device is expected"
                );
                println!("SKIP: no RDMA device for {ip}");
                return None;
            }
        },
        _ => (h.local_addr(), Transport::TcpOnly),
    };
    Some((h, format!("http://{addr}"), t))
}

/// helloworld: the generated `connect`, `remote_addr()`, `local_addr()`,
/// and the client's user-agent, as tonic gives them over TCP.
async fn helloworld(path: Path) {
    let ex = Example::default();
    let Some((server, url, t)) = serve(path, &ex).await else {
        return;
    };
    // The generated constructor goes through rpc-core's channel: over RDMA
    // where the server has it (Auto picks it by itself).
    let mut client: GreeterClient<Channel> = GreeterClient::connect(url.clone()).await.unwrap();
    let reply = client
        .say_hello(Request::new(HelloRequest {
            name: "Tonic".into(),
        }))
        .await
        .unwrap();
    assert_eq!(reply.get_ref().message, "Hello Tonic!");
    let kind = reply
        .extensions()
        .get::<rpc_core::ConnInfo>()
        .map(|i| i.transport);
    match path {
        Path::Rdma => assert_eq!(
            kind,
            Some(TransportKind::Rdma),
            "generated connect used RDMA"
        ),
        _ => assert_eq!(kind, None, "TCP responses carry no ConnInfo"),
    }
    let server_addr: SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let remote = ex
        .seen
        .remote
        .lock()
        .unwrap()
        .expect("remote_addr() is Some");
    assert_eq!(
        remote.ip(),
        server_addr.ip(),
        "the client connected from the same host"
    );
    assert_ne!(remote.port(), 0);
    let local = ex.seen.local.lock().unwrap().expect("local_addr() is Some");
    assert_eq!(
        local, server_addr,
        "local_addr() is the address the server serves"
    );

    // A user agent set on the endpoint reaches the handler.
    let ch = Endpoint::from_shared(url.clone())
        .unwrap()
        .user_agent("dropin-test/1.0")
        .unwrap()
        .transport(t)
        .connect()
        .await
        .unwrap();
    GreeterClient::new(ch)
        .say_hello(HelloRequest { name: "ua".into() })
        .await
        .unwrap();
    let ua = ex
        .seen
        .user_agent
        .lock()
        .unwrap()
        .clone()
        .expect("a user-agent");
    println!("user-agent over {path:?}: {ua}");
    assert!(ua.starts_with("dropin-test/1.0 "), "{ua}");
    server.shutdown().await.unwrap();
}

/// streaming: a client that stops reading a server stream ends the
/// handler's `tx.send`; a client whose connection goes away makes the bidi
/// handler's request stream fail.
async fn streaming(path: Path) {
    let ex = Example::default();
    let Some((server, url, t)) = serve(path, &ex).await else {
        return;
    };
    let ch = Endpoint::from_shared(url.clone())
        .unwrap()
        .transport(t)
        .connect()
        .await
        .unwrap();
    let mut client = EchoClient::new(ch.clone());
    // tonic's `streaming_echo(client, 5)`: take 5, then drop the stream.
    let stream = client
        .server_streaming_echo(EchoRequest {
            message: "foo".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut stream = stream.take(5);
    while let Some(item) = stream.next().await {
        item.unwrap();
    }
    drop(stream);
    assert!(
        eventually(Duration::from_secs(10), || ex
            .seen
            .stream_client_gone
            .load(SeqCst))
        .await,
        "the server-stream handler's tx.send fails once the client dropped its stream"
    );

    // Bidi: the client's connection closes under an open request stream.
    let (req_tx, req_rx) = mpsc::channel(4);
    let ch2 = Endpoint::from_shared(url)
        .unwrap()
        .transport(t)
        .connect()
        .await
        .unwrap();
    let mut resp = EchoClient::new(ch2.clone())
        .bidirectional_streaming_echo(ReceiverStream::new(req_rx))
        .await
        .unwrap()
        .into_inner();
    req_tx
        .send(EchoRequest {
            message: "one".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(resp.message().await.unwrap().unwrap().message, "one");
    // The client abandons the call with its request stream still open: the
    // handler's request stream ends (a crashed client is in the reliability
    // suite: there the stream fails with `BrokenPipe` in its error).
    drop((resp, ch2));
    assert!(
        eventually(Duration::from_secs(10), || ex.seen.bidi_done.load(SeqCst)).await,
        "the bidi handler's request stream ended once the client abandoned the call"
    );
    // tonic turns a request stream's CANCELLED into its end, on every path.
    let err = ex.seen.bidi_error.lock().unwrap().take();
    assert!(err.is_none(), "{path:?}: {err:?}");
    drop(req_tx);
    server.shutdown().await.unwrap();
}

/// A client whose encoder refuses a message (its
/// `max_encoding_message_size`): INTERNAL, as tonic gives it over HTTP/2.
async fn encoding_limit(path: Path) {
    let ex = Example::default();
    let Some((server, url, t)) = serve(path, &ex).await else {
        return;
    };
    let ch = Endpoint::from_shared(url)
        .unwrap()
        .transport(t)
        .connect()
        .await
        .unwrap();
    let err = EchoClient::new(ch)
        .max_encoding_message_size(16)
        .unary_echo(EchoRequest {
            message: "x".repeat(100),
            ..Default::default()
        })
        .await
        .unwrap_err();
    println!("over {path:?}: {err:?}");
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    server.shutdown().await.unwrap();
}

macro_rules! on_net_paths {
    ($($name:ident),*) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tcp() {
                tokio::time::timeout(std::time::Duration::from_secs(60), super::$name(rpc_tests::Path::Tcp)).await.unwrap()
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
            async fn rdma() {
                tokio::time::timeout(std::time::Duration::from_secs(240), super::$name(rpc_tests::Path::Rdma)).await.unwrap()
            }
        }
    )*};
}
on_net_paths!(helloworld, streaming, encoding_limit);

/// tonic's mock example: a server on one end of an in-process pipe, a
/// channel over the other, with nothing but the `use` line changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mock_in_process() {
    let (client, server) = tokio::io::duplex(1024);
    let ex = Example::default();
    let serving = tokio::spawn(
        Server::builder()
            .add_service(GreeterServer::new(ex.clone()))
            .serve_with_incoming(tokio_stream::once(Ok::<_, std::io::Error>(server))),
    );
    let mut client = Some(client);
    let channel = Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let client = client.take();
            async move {
                if let Some(client) = client {
                    Ok(hyper_util::rt::TokioIo::new(client))
                } else {
                    Err(std::io::Error::other("Client already taken"))
                }
            }
        }))
        .await
        .unwrap();
    let reply = GreeterClient::new(channel)
        .say_hello(HelloRequest {
            name: "mock".into(),
        })
        .await
        .unwrap();
    assert_eq!(reply.get_ref().message, "Hello mock!");
    // A duplex pipe has no address, as with tonic.
    assert_eq!(*ex.seen.remote.lock().unwrap(), None);
    serving.abort();
}

/// The builder lines tonic's other examples use compile and mean the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_lines_of_tonics_examples() {
    let ex = Example::default();
    let notify = Arc::new(tokio::sync::Notify::new());
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    // Reserve a free port for a `serve_with_shutdown(addr, ..)` server.
    let port = std::net::TcpListener::bind(addr)
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let n = notify.clone();
    let svc = GreeterServer::new(ex.clone());
    let server = tokio::spawn(async move {
        // A borrowed signal, as tonic's examples pass it.
        Server::builder()
            .timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .tcp_keepalive(Some(Duration::from_secs(30)))
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(5)))
            .max_concurrent_streams(64)
            .initial_stream_window_size(1 << 20)
            .initial_connection_window_size(4 << 20)
            .max_frame_size(1 << 16)
            .accept_http1(false)
            .load_shed(false)
            .max_connection_age(Duration::from_secs(3600))
            .trace_fn(|_| tracing::info_span!("call"))
            .add_service(svc)
            .serve_with_shutdown(addr, n.notified())
            .await
    });
    let url = format!("http://{addr}");
    let mut channel = None;
    for _ in 0..100 {
        // `Channel::builder(uri)` with the `.parse().unwrap()` tonic's examples write.
        match Channel::builder(url.parse().unwrap())
            .timeout(Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(1))
            .tcp_keepalive(Some(Duration::from_secs(30)))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true)
            .initial_stream_window_size(Some(1 << 20))
            .buffer_size(64)
            .concurrency_limit(16)
            .transport(Transport::TcpOnly)
            .connect()
            .await
        {
            Ok(c) => {
                channel = Some(c);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let channel = channel.expect("server up");
    let ep = Endpoint::new(url.clone()).unwrap();
    assert_eq!(ep.uri(), &url.parse::<http::Uri>().unwrap());
    GreeterClient::new(channel)
        .say_hello(HelloRequest { name: "b".into() })
        .await
        .unwrap();
    notify.notify_one();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve_with_shutdown returns after the signal")
        .unwrap()
        .unwrap();
}
