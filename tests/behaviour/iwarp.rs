//! iWARP at the rpc layer (`docs/wire-protocol.md` §3): the server starts on
//! every device; on iWARP its RDMA listener takes another port, which the
//! TCP side announces, and `Auto` and `RdmaOnly` clients reach it over RDMA.
//! On RoCE RDMA keeps sharing the TCP port.
use rpc_core::{Channel, Transport, TransportKind};
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{device_required, rdma_ip, router};
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn server_starts_and_clients_reach_rdma_on_every_device() {
    let Some(ip) = rdma_ip() else {
        if device_required() {
            panic!("SOFTROCE_IP / RDMA_TEST_IP must be set");
        }
        println!("SKIP server_starts_and_clients_reach_rdma_on_every_device: SOFTROCE_IP / RDMA_TEST_IP unset");
        return;
    };
    let iwarp = std::env::var("SOFTROCE_SIW_IP").ok().as_deref() == Some(ip.as_str());
    let server = router(Arc::new(Default::default()))
        .start(format!("{ip}:0").parse().unwrap())
        .await
        .expect("the server starts");
    let tcp = server.local_addr();
    let rdma = server.rdma_addr().expect("an RDMA listener");
    println!(
        "{}: TCP {tcp}, RDMA {rdma}",
        if iwarp { "iWARP" } else { "RoCE" }
    );
    if iwarp {
        assert_ne!(rdma.port(), tcp.port(), "iWARP cannot share the TCP port");
    } else {
        assert_eq!(rdma.port(), tcp.port(), "RoCE keeps the same port");
    }
    for policy in [Transport::Auto, Transport::RdmaOnly] {
        let ch = Channel::from_shared(tcp.to_string())
            .unwrap()
            .transport(policy)
            .connect()
            .await
            .unwrap();
        println!("{policy:?} to {tcp}: {}", ch.transport());
        assert_eq!(ch.transport().kind, TransportKind::Rdma);
        EchoClient::new(ch)
            .unary_echo(EchoRequest::default())
            .await
            .unwrap();
    }
    let ch = Channel::from_shared(tcp.to_string())
        .unwrap()
        .transport(Transport::TcpOnly)
        .connect()
        .await
        .unwrap();
    EchoClient::new(ch)
        .unary_echo(EchoRequest::default())
        .await
        .unwrap();
    server.shutdown().await.unwrap();
}
