//! The server is aborted (as a crash) and restarted on the same address while
//! several clients call in a loop: clients see only `Unavailable`, nothing
//! hangs, and the same channels reconnect over RDMA and succeed again.
use crate::common::{bounded, echo, pattern, rdma_channel, rdma_host, start_server};
use rpc_examples::pb::echo::EchoRequest;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const CLIENTS: usize = 4;

#[derive(Default)]
struct Tally {
    ok_before: AtomicUsize,
    ok_after: AtomicUsize,
    codes: Mutex<BTreeMap<String, usize>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn server_restarted_while_clients_call() {
    let Some(ip) = rdma_host("server_restarted_while_clients_call") else {
        return;
    };
    bounded(
        "server_restarted_while_clients_call",
        Duration::from_secs(120),
        async {
            let (server, _) = start_server(&ip, 0).await;
            let tcp = server.local_addr();
            let addr = server.rdma_addr().unwrap().to_string();
            let conns_before = rdma_transport::global_stats().connections;
            let restarted = Arc::new(AtomicBool::new(false));
            let stop = Arc::new(AtomicBool::new(false));
            let mut tasks = Vec::new();
            let mut tallies = Vec::new();
            let mut channels = Vec::new();
            for t in 0..CLIENTS {
                let ch = rdma_channel(&addr).await;
                channels.push(ch.clone());
                let tally = Arc::new(Tally::default());
                tallies.push(tally.clone());
                let (restarted, stop) = (restarted.clone(), stop.clone());
                tasks.push(tokio::spawn(async move {
                    let mut c = echo(&ch);
                    let mut i = 0u64;
                    while !stop.load(SeqCst) {
                        i += 1;
                        let after = restarted.load(SeqCst);
                        // Some calls sit in their handler for a while, some go by rendezvous.
                        let req = EchoRequest {
                            message: format!("{t}/{i}"),
                            payload: pattern(i, if i.is_multiple_of(10) { 100_000 } else { 100 }).into(),
                            delay_ms: (i % 3 * 20) as u32,
                            ..Default::default()
                        };
                        let call = tokio::time::timeout(Duration::from_secs(15), c.unary_echo(req.clone()));
                        match call.await.expect("a call hung for 15 s") {
                            Ok(r) => {
                                let r = r.into_inner();
                                assert_eq!(r.message, req.message);
                                assert_eq!(r.payload, req.payload);
                                if after {
                                    tally.ok_after.fetch_add(1, SeqCst);
                                } else {
                                    tally.ok_before.fetch_add(1, SeqCst);
                                }
                            }
                            Err(e) => {
                                *tally
                                    .codes
                                    .lock()
                                    .unwrap()
                                    .entry(format!("{:?}: {}", e.code(), e.message()))
                                    .or_default() += 1;
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        }
                    }
                }));
            }
            assert!(
                rpc_tests::eventually(Duration::from_secs(30), || tallies
                    .iter()
                    .all(|t| t.ok_before.load(SeqCst) >= 20))
                .await,
                "every client made 20 calls before the abort"
            );
            server.abort().await;
            println!("  server aborted");
            tokio::time::sleep(Duration::from_millis(1000)).await;
            let errors_while_down: usize = tallies
                .iter()
                .map(|t| t.codes.lock().unwrap().values().sum::<usize>())
                .sum();
            restarted.store(true, SeqCst);
            let (server, _) = start_server(&ip, tcp.port()).await;
            assert_eq!(server.rdma_addr().unwrap().to_string(), addr, "same address");
            println!("  server restarted on {addr}");
            let all_back = rpc_tests::eventually(Duration::from_secs(30), || {
                tallies.iter().all(|t| t.ok_after.load(SeqCst) >= 20)
            })
            .await;
            stop.store(true, SeqCst);
            for t in tasks {
                t.await.expect("client task");
            }
            let mut codes = BTreeMap::new();
            for (i, t) in tallies.iter().enumerate() {
                println!(
                    "  client {i}: {} ok before, {} ok after the restart, errors {:?}",
                    t.ok_before.load(SeqCst),
                    t.ok_after.load(SeqCst),
                    t.codes.lock().unwrap()
                );
                for (k, v) in t.codes.lock().unwrap().iter() {
                    *codes.entry(k.split(':').next().unwrap().to_string()).or_insert(0) += v;
                }
            }
            let conns = rdma_transport::global_stats().connections - conns_before;
            println!("  error codes {codes:?} ({errors_while_down} while the server was down); {conns} RDMA connections established");
            assert!(all_back, "every client succeeded 20 times after the restart");
            assert!(errors_while_down > 0, "clients noticed the server was gone");
            assert_eq!(
                codes.keys().collect::<Vec<_>>(),
                vec!["Unavailable"],
                "only Unavailable while the server was down"
            );
            for ch in &channels {
                assert_eq!(ch.transport().kind, rpc_core::TransportKind::Rdma);
            }
            // Each channel's reconnect is a new RDMA connection (client + server side).
            assert!(conns >= 2 * 2 * CLIENTS as u64, "{conns} connections");
            server.shutdown().await.unwrap();
        },
    )
    .await;
}
