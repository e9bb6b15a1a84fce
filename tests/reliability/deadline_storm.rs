//! Thousands of calls with a short deadline against handlers that sleep
//! longer: every call ends `DeadlineExceeded`, every handler that started is
//! cancelled (none completes), and the same connection then serves calls
//! with normal latency.
use crate::common::{bounded, echo, median, rdma_channel, rdma_host, start_server};
use futures::StreamExt;
use rpc_examples::pb::echo::EchoRequest;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

const CALLS: usize = 2000;
const DEADLINE: Duration = Duration::from_millis(50);
const HANDLER_SLEEP_MS: u32 = 2000;
const CONCURRENCY: usize = 64;

async fn latencies(
    c: &mut rpc_examples::pb::echo::echo_client::EchoClient<rpc_core::Channel>,
) -> Vec<Duration> {
    let mut v = Vec::new();
    for _ in 0..30 {
        let t = Instant::now();
        c.unary_echo(EchoRequest {
            payload: vec![7; 64].into(),
            ..Default::default()
        })
        .await
        .expect("normal call");
        v.push(t.elapsed());
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn deadline_storm() {
    let Some(ip) = rdma_host("deadline_storm") else {
        return;
    };
    bounded("deadline_storm", Duration::from_secs(120), async {
        let (server, stats) = start_server(&ip, 0).await;
        let ch = rdma_channel(&server.rdma_addr().unwrap().to_string()).await;
        let mut c = echo(&ch);
        let before = median(latencies(&mut c).await);
        let conns = rdma_transport::global_stats().connections;
        let base = stats.started.load(SeqCst);
        let (done0, cancelled0) = (stats.completed.load(SeqCst), stats.cancelled.load(SeqCst));

        let t0 = Instant::now();
        let codes: BTreeMap<String, usize> = futures::stream::iter(0..CALLS)
            .map(|i| {
                let mut c = c.clone();
                async move {
                    let mut req = tonic::Request::new(EchoRequest {
                        message: i.to_string(),
                        delay_ms: HANDLER_SLEEP_MS,
                        ..Default::default()
                    });
                    req.set_timeout(DEADLINE);
                    let t = Instant::now();
                    let r = c.unary_echo(req).await;
                    (r.map(|_| ()), t.elapsed())
                }
            })
            .buffer_unordered(CONCURRENCY)
            .fold(BTreeMap::new(), |mut m, (r, el)| async move {
                let k = match r {
                    Ok(()) => "OK".to_string(),
                    Err(e) => format!("{:?}", e.code()),
                };
                // A call that ends long after its deadline counts as hanging.
                assert!(el < Duration::from_secs(10), "a call took {el:?}");
                *m.entry(k).or_insert(0) += 1;
                m
            })
            .await;
        let storm = t0.elapsed();
        let started = stats.started.load(SeqCst) - base;
        println!("  {CALLS} calls with a {DEADLINE:?} deadline in {storm:.1?}: {codes:?}; {started} handlers started");
        assert_eq!(codes.get("DeadlineExceeded"), Some(&CALLS), "{codes:?}");

        // Every handler that started is cancelled: none completes its sleep.
        let all_cancelled = rpc_tests::eventually(Duration::from_secs(10), || {
            stats.cancelled.load(SeqCst) - cancelled0 == stats.started.load(SeqCst) - base
        })
        .await;
        println!(
            "  handlers: started {} completed {} cancelled {}",
            stats.started.load(SeqCst) - base,
            stats.completed.load(SeqCst) - done0,
            stats.cancelled.load(SeqCst) - cancelled0
        );
        assert!(started > 0, "handlers started");
        assert!(all_cancelled, "every started handler was cancelled: {stats:?}");
        tokio::time::sleep(Duration::from_millis(u64::from(HANDLER_SLEEP_MS) + 500)).await;
        assert_eq!(stats.completed.load(SeqCst), done0, "no handler ran to completion");

        // Same connection (no reconnect), normal latency.
        let after = median(latencies(&mut c).await);
        println!("  median latency of 30 calls: before {before:.2?}, after {after:.2?}");
        assert_eq!(
            rdma_transport::global_stats().connections,
            conns,
            "no new connection was needed"
        );
        assert!(
            after <= before * 10 + Duration::from_millis(200),
            "latency after the storm {after:?} vs before {before:?}"
        );
        server.shutdown().await.unwrap();
    })
    .await;
}
