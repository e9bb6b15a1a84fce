//! TLS with mutual authentication, switched as a tonic user switches
//! (`use rpc_core::{Server, ServerTlsConfig, Identity, Certificate}`): over
//! TCP it is tonic's TLS; over RDMA a connection is admitted only with a
//! ticket got over an authenticated TLS connection
//! (`docs/wire-protocol-rdma.md` §2.4). Handlers see the client's
//! certificate on both transports; a client without a certificate, or
//! without TLS, gets no service on either.
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rpc_core::{
    Certificate, ClientTlsConfig, ConnInfo, Endpoint, Identity, Server, ServerTlsConfig,
    ServingHandle, Transport, TransportKind,
};
use rpc_examples::pb::helloworld::greeter_client::GreeterClient;
use rpc_examples::pb::helloworld::greeter_server::{Greeter, GreeterServer};
use rpc_examples::pb::helloworld::{HelloReply, HelloRequest};
use rpc_tests::{device_required, rdma_ip, Path};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::{Request, Response, Status};

/// A CA, a server certificate for `localhost` and `ip`, a client certificate.
struct Pki {
    ca: String,
    server: Identity,
    client: Identity,
    client_der: Vec<u8>,
}

fn pki(ip: &str) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "rpc-tests CA");
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server_cert = CertificateParams::new(vec!["localhost".to_string(), ip.to_string()])
        .unwrap()
        .signed_by(&server_key, &ca)
        .unwrap();
    let client_key = KeyPair::generate().unwrap();
    let mut client_params = CertificateParams::new(vec!["client.test".to_string()]).unwrap();
    client_params
        .distinguished_name
        .push(DnType::CommonName, "rpc-tests client");
    let client_cert = client_params.signed_by(&client_key, &ca).unwrap();
    Pki {
        ca: ca.pem(),
        server: Identity::from_pem(server_cert.pem(), server_key.serialize_pem()),
        client: Identity::from_pem(client_cert.pem(), client_key.serialize_pem()),
        client_der: client_cert.der().to_vec(),
    }
}

#[derive(Default)]
struct Seen {
    calls: AtomicUsize,
    /// DER of the first peer certificate of the last call.
    cert: Mutex<Option<Vec<u8>>>,
    transport: Mutex<Option<TransportKind>>,
}

#[derive(Clone, Default)]
struct Authenticated {
    seen: Arc<Seen>,
}

#[tonic::async_trait]
impl Greeter for Authenticated {
    async fn say_hello(&self, req: Request<HelloRequest>) -> Result<Response<HelloReply>, Status> {
        self.seen.calls.fetch_add(1, SeqCst);
        // tonic's mutual-TLS example reads exactly this.
        let certs = req.peer_certs();
        *self.seen.cert.lock().unwrap() = certs.and_then(|c| c.first().map(|c| c.to_vec()));
        *self.seen.transport.lock().unwrap() =
            req.extensions().get::<ConnInfo>().map(|i| i.transport);
        Ok(Response::new(HelloReply {
            message: format!("Hello {}!", req.into_inner().name),
        }))
    }
}

/// A mutual-TLS server on `path`'s address; `None`: skipped.
async fn tls_server(path: Path) -> Option<(ServingHandle, Pki, Authenticated, String)> {
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
    let pki = pki(&ip);
    let svc = Authenticated::default();
    let tls = ServerTlsConfig::new()
        .identity(pki.server.clone())
        .client_ca_root(Certificate::from_pem(&pki.ca));
    let h = Server::builder()
        .tls_config(tls)
        .unwrap()
        .add_service(GreeterServer::new(svc.clone()))
        .start(format!("{ip}:0").parse().unwrap())
        .await
        .unwrap();
    if path == Path::Rdma && h.rdma_addr().is_none() {
        assert!(
            !device_required(),
            "no RDMA listener although a device is expected"
        );
        println!("SKIP: no RDMA device for {ip}");
        return None;
    }
    let url = format!("https://{}", h.local_addr());
    Some((h, pki, svc, url))
}

fn client_tls(pki: &Pki, with_cert: bool) -> ClientTlsConfig {
    let c = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca))
        .domain_name("localhost");
    if with_cert {
        c.identity(pki.client.clone())
    } else {
        c
    }
}

async fn hello(ch: rpc_core::Channel) -> Result<Response<HelloReply>, Status> {
    GreeterClient::new(ch)
        .say_hello(HelloRequest { name: "tls".into() })
        .await
}

/// Mutual TLS: the call goes over RDMA where there is RDMA (TLS over TCP
/// elsewhere), and the handler sees the client's certificate either way.
async fn mutual_tls(path: Path) {
    let Some((server, pki, svc, url)) = tls_server(path).await else {
        return;
    };
    let policy = if path == Path::Rdma {
        Transport::RdmaOnly
    } else {
        Transport::Auto
    };
    let ch = Endpoint::from_shared(url.clone())
        .unwrap()
        .tls_config(client_tls(&pki, true))
        .unwrap()
        .transport(policy)
        .connect()
        .await
        .unwrap();
    println!("mutual TLS over {path:?}: transport {}", ch.transport());
    let reply = hello(ch.clone()).await.unwrap();
    assert_eq!(reply.get_ref().message, "Hello tls!");
    let expect = if path == Path::Rdma {
        Some(TransportKind::Rdma)
    } else {
        None // tonic's HTTP/2 server: no ConnInfo of ours
    };
    assert_eq!(*svc.seen.transport.lock().unwrap(), expect);
    assert_eq!(
        svc.seen.cert.lock().unwrap().as_deref(),
        Some(&pki.client_der[..]),
        "the handler sees the client's certificate over {path:?}"
    );
    // The channel reconnects over RDMA with a new ticket (a ticket is good once).
    if path == Path::Rdma {
        let again = Endpoint::from_shared(url)
            .unwrap()
            .tls_config(client_tls(&pki, true))
            .unwrap()
            .transport(Transport::RdmaOnly)
            .connect()
            .await
            .unwrap();
        hello(again).await.unwrap();
        assert_eq!(svc.seen.calls.load(SeqCst), 2);
    }
    server.shutdown().await.unwrap();
}

/// A client without a certificate, and one without TLS, get neither TCP
/// nor RDMA service from a server that requires client certificates.
async fn unauthenticated_clients_get_nothing(path: Path) {
    let Some((server, pki, svc, url)) = tls_server(path).await else {
        return;
    };
    // TLS without a client certificate.
    let no_cert = Endpoint::from_shared(url.clone())
        .unwrap()
        .tls_config(client_tls(&pki, false))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await;
    match no_cert {
        Err(e) => println!("no client certificate over {path:?}: connect failed: {e}"),
        Ok(ch) => {
            assert_ne!(
                ch.transport().kind,
                TransportKind::Rdma,
                "no RDMA without a certificate"
            );
            let e = hello(ch).await.unwrap_err();
            println!("no client certificate over {path:?}: {e:?}");
        }
    }
    // Plaintext to the TLS server: no HTTP/2 without TLS, no RDMA without a ticket.
    let plain = Endpoint::from_shared(url.replace("https://", "http://"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await;
    match plain {
        Err(e) => println!("plaintext over {path:?}: connect failed: {e}"),
        Ok(ch) => {
            assert_ne!(
                ch.transport().kind,
                TransportKind::Rdma,
                "no RDMA without a ticket"
            );
            let e = hello(ch).await.unwrap_err();
            println!("plaintext over {path:?}: {e:?}");
        }
    }
    if path == Path::Rdma {
        // A raw RDMA connect request without a ticket is refused before any
        // queue pair exists for it on the server.
        let addr = server.rdma_addr().unwrap();
        let e = match rdma_transport::connect(addr, &rdma_transport::Config::default()).await {
            Ok(_) => panic!("an RDMA connect without a ticket was admitted"),
            Err(e) => e,
        };
        println!("RDMA without a ticket: {e}");
        assert!(e.to_string().contains("unauthenticated"), "{e}");
        let e = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .transport(Transport::RdmaOnly)
            .connect()
            .await
            .expect_err("RdmaOnly without TLS is refused");
        println!("RdmaOnly without TLS: {e}");
    }
    assert_eq!(svc.seen.calls.load(SeqCst), 0, "no handler ran for them");
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
on_net_paths!(mutual_tls, unauthenticated_clients_get_nothing);

#[test]
fn https_without_tls_config_is_an_error_not_a_panic() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let e = rt
        .block_on(
            Endpoint::from_static("https://127.0.0.1:1")
                .transport(Transport::TcpOnly)
                .connect(),
        )
        .unwrap_err();
    assert!(matches!(e, rpc_core::Error::Tls(_)), "{e}");
}
