//! Balanced channels (tower's power-of-two-choices over per-endpoint
//! channels): calls spread over the servers, endpoints come and go through
//! discovery, and a server killed mid-run fails only the calls in flight on it.
use rpc_core::{Change, Channel, ServingHandle, Transport, TransportKind};
use rpc_examples::echo::EchoStats;
use rpc_examples::pb::echo::{echo_client::EchoClient, EchoRequest};
use rpc_tests::{device_required, rdma_ip};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

struct Replica {
    stats: Arc<EchoStats>,
    handle: Option<ServingHandle>,
}

impl Replica {
    async fn start(ip: &str) -> Replica {
        let stats = Arc::new(EchoStats::default());
        let handle = rpc_tests::router(stats.clone())
            .start(format!("{ip}:0").parse().unwrap())
            .await
            .expect("replica starts");
        Replica {
            stats,
            handle: Some(handle),
        }
    }
    fn addr(&self) -> std::net::SocketAddr {
        self.handle.as_ref().unwrap().local_addr()
    }
    fn calls(&self) -> usize {
        self.stats.started.load(Ordering::SeqCst)
    }
}

fn counts(rs: &[Replica]) -> Vec<usize> {
    rs.iter().map(Replica::calls).collect()
}

/// `n` calls, `concurrency` at a time, all of which must succeed.
async fn calls(ch: &Channel, n: usize, concurrency: usize) {
    let left = Arc::new(AtomicUsize::new(n));
    let workers = (0..concurrency).map(|_| {
        let mut c = EchoClient::new(ch.clone());
        let left = left.clone();
        async move {
            while left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
                .is_ok()
            {
                c.unary_echo(EchoRequest::default()).await.expect("call");
            }
        }
    });
    futures::future::join_all(workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spreads_and_follows_discovery_over_tcp() {
    let mut rs = Vec::new();
    for _ in 0..3 {
        rs.push(Replica::start("127.0.0.1").await);
    }
    let (ch, tx) = Channel::balance_channel::<usize>(16);
    for (i, r) in rs.iter().enumerate() {
        tx.send(Change::Insert(
            i,
            Channel::from_shared(r.addr().to_string())
                .unwrap()
                .transport(Transport::TcpOnly),
        ))
        .await
        .unwrap();
    }
    calls(&ch, 600, 8).await;
    let c = counts(&rs);
    println!("balance over TCP, 600 calls on 3 servers: per-server {c:?}");
    assert_eq!(c.iter().sum::<usize>(), 600);
    assert!(c.iter().all(|&n| n > 0), "a server got no call: {c:?}");
    let t = ch.transport();
    println!("transport: {t}");
    assert_eq!(t.kind, TransportKind::Balanced);
    assert_eq!(t.endpoints.len(), 3);
    assert!(t
        .endpoints
        .iter()
        .all(|(_, e)| e.kind == TransportKind::Tcp));

    // Remove server 0: the calls keep succeeding, on the others only.
    tx.send(Change::Remove(0)).await.unwrap();
    let before = counts(&rs);
    calls(&ch, 300, 8).await;
    let after = counts(&rs);
    println!("after removing server 0, 300 calls: per-server {after:?} (before {before:?})");
    assert_eq!(after[0], before[0], "a removed server still got calls");
    assert_eq!(after[1] + after[2] - before[1] - before[2], 300);
    assert!(after[1] > before[1] && after[2] > before[2]);
    assert_eq!(ch.transport().endpoints.len(), 2);

    // Add a fourth: it gets calls.
    rs.push(Replica::start("127.0.0.1").await);
    tx.send(Change::Insert(
        3,
        Channel::from_shared(format!("http://{}", rs[3].addr()))
            .unwrap()
            .transport(Transport::TcpOnly),
    ))
    .await
    .unwrap();
    calls(&ch, 300, 8).await;
    let c = counts(&rs);
    println!("after adding server 3, 300 calls: per-server {c:?}");
    assert!(c[3] > 0, "the added server got no call: {c:?}");
    for r in rs {
        r.handle.unwrap().shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balance_list_spreads() {
    let mut rs = Vec::new();
    for _ in 0..3 {
        rs.push(Replica::start("127.0.0.1").await);
    }
    // Auto endpoints: each picks its transport (TCP here: no RDMA device on
    // the host, or loopback has no RDMA route).
    let ch = Channel::balance_list(rs.iter().map(|r| {
        Channel::from_shared(r.addr().to_string())
            .unwrap()
            .no_rdma_reprobe()
    }));
    calls(&ch, 300, 4).await;
    let c = counts(&rs);
    println!(
        "balance_list, 300 calls: per-server {c:?}; transport: {}",
        ch.transport()
    );
    assert!(c.iter().all(|&n| n > 0), "{c:?}");
    for r in rs {
        r.handle.unwrap().shutdown().await.unwrap();
    }
}

/// VM: three servers over RDMA, N calls (`BALANCE_CALLS`, default 10^4); a
/// third of the way in one server is killed and another added. Only calls in
/// flight on the killed server may fail, as UNAVAILABLE; the others spread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn rdma_server_killed_and_added() {
    let Some(ip) = rdma_ip() else {
        if device_required() {
            panic!("SOFTROCE_IP / RDMA_TEST_IP must be set");
        }
        println!("SKIP rdma_server_killed_and_added: SOFTROCE_IP / RDMA_TEST_IP unset");
        return;
    };
    let n: usize = std::env::var("BALANCE_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    const WORKERS: usize = 16;
    let mut rs = Vec::new();
    for _ in 0..3 {
        let r = Replica::start(&ip).await;
        assert!(
            r.handle.as_ref().unwrap().rdma_addr().is_some(),
            "no RDMA listener on {ip}"
        );
        rs.push(r);
    }
    let (ch, tx) = Channel::balance_channel::<usize>(16);
    for (i, r) in rs.iter().enumerate() {
        tx.send(Change::Insert(
            i,
            Channel::from_shared(r.addr().to_string()).unwrap(),
        ))
        .await
        .unwrap();
    }
    let issued = Arc::new(AtomicUsize::new(0));
    let ok = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<tonic::Status>::new()));
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let mut c = EchoClient::new(ch.clone());
            let (issued, ok, failures) = (issued.clone(), ok.clone(), failures.clone());
            tokio::spawn(async move {
                while issued
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                        (v < n).then_some(v + 1)
                    })
                    .is_ok()
                {
                    match c.unary_echo(EchoRequest::default()).await {
                        Ok(_) => {
                            ok.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(st) => failures.lock().unwrap().push(st),
                    }
                }
            })
        })
        .collect();
    while issued.load(Ordering::SeqCst) < n / 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!("transport before the kill: {}", ch.transport());
    let at_kill = counts(&rs);
    let in_flight_on_killed = rs[1].calls() - rs[1].stats.completed.load(Ordering::SeqCst);
    let killed = rs[1].addr().to_string();
    rs[1].handle.take().unwrap().abort().await;
    rs.push(Replica::start(&ip).await);
    tx.send(Change::Insert(
        3,
        Channel::from_shared(rs[3].addr().to_string()).unwrap(),
    ))
    .await
    .unwrap();
    for w in workers {
        tokio::time::timeout(Duration::from_secs(600), w)
            .await
            .expect("calls finish")
            .unwrap();
    }
    let end = counts(&rs);
    let failures = std::mem::take(&mut *failures.lock().unwrap());
    println!(
        "balance over RDMA: {n} calls, {} ok, {} failed; per-server at the kill {at_kill:?}, at the end {end:?} (server 1 killed with ~{in_flight_on_killed} calls in flight, server 3 added)",
        ok.load(Ordering::SeqCst),
        failures.len()
    );
    for st in failures.iter() {
        println!("  failed: {:?} {}", st.code(), st.message());
        assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    }
    // Only calls in flight on the killed server fail: at most one per worker.
    assert!(
        failures.len() <= WORKERS,
        "{} calls failed; at most {WORKERS} were in flight",
        failures.len()
    );
    assert_eq!(ok.load(Ordering::SeqCst) + failures.len(), n);
    for i in [0, 2, 3] {
        assert!(
            end[i] > at_kill.get(i).copied().unwrap_or(0),
            "live server {i} got no call after the kill: {end:?}"
        );
    }
    let t = ch.transport();
    println!("transport at the end: {t}");
    for (addr, e) in &t.endpoints {
        if *addr != killed {
            assert_eq!(e.kind, TransportKind::Rdma, "{addr}: {e}");
        }
    }
    drop(ch);
    for r in rs {
        if let Some(h) = r.handle {
            if let Err(e) = h.shutdown().await {
                println!("shutdown of a replica: {e}");
            }
        }
    }
}
