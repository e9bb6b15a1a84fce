//! Connect/disconnect cycles (RDMA-only channel, one call, drop): resident and
//! registered (pinned) memory are flat at the end, every cycle made a real
//! RDMA connection, and the server still works.
use crate::common::{bounded, echo, pinned_kib, rdma_channel, rdma_host, rss_kib, start_server};
use rpc_examples::pb::echo::EchoRequest;
use std::time::{Duration, Instant};

/// Cycles; `RELIABILITY_CHURN_CYCLES` overrides (see docs/reliability.md).
const DEFAULT_CYCLES: usize = 1000;
const WARMUP: usize = 20;

async fn cycle(addr: &str, i: usize) {
    let ch = rdma_channel(addr).await;
    let r = echo(&ch)
        .unary_echo(EchoRequest {
            message: i.to_string(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("call in cycle {i}: {e:?}"));
    assert_eq!(r.into_inner().message, i.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_disconnect_churn() {
    let Some(ip) = rdma_host("connect_disconnect_churn") else {
        return;
    };
    let cycles: usize = std::env::var("RELIABILITY_CHURN_CYCLES")
        .ok()
        .map(|v| v.parse().expect("RELIABILITY_CHURN_CYCLES is a number"))
        .unwrap_or(DEFAULT_CYCLES);
    bounded("connect_disconnect_churn", Duration::from_secs(240), async {
        let (server, _stats) = start_server(&ip, 0).await;
        let addr = server.rdma_addr().unwrap().to_string();
        let idle_pin = pinned_kib();
        for i in 0..WARMUP {
            cycle(&addr, i).await;
        }
        // Teardown of the last connections (both sides) finishes in the background.
        assert!(
            rpc_tests::eventually(Duration::from_secs(10), || pinned_kib() <= idle_pin).await,
            "registered memory released after the warm-up: VmPin {} KiB, idle {idle_pin} KiB",
            pinned_kib()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (rss0, pin0) = (rss_kib(), pinned_kib());
        let conns0 = rdma_transport::global_stats().connections;
        let t0 = Instant::now();
        let mut peak_pin = pin0;
        let mut trajectory = vec![rss0];
        for i in 0..cycles {
            cycle(&addr, i).await;
            if i % 25 == 0 {
                peak_pin = peak_pin.max(pinned_kib());
            }
            if (i + 1) % (cycles / 8).max(1) == 0 {
                trajectory.push(rss_kib());
            }
        }
        let el = t0.elapsed();
        let conns = rdma_transport::global_stats().connections - conns0;
        let released =
            rpc_tests::eventually(Duration::from_secs(10), || pinned_kib() <= pin0).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (rss1, pin1) = (rss_kib(), pinned_kib());
        println!(
            "  {cycles} cycles in {el:.1?} ({:.1} cycles/s), {conns} RDMA connections established (both sides)",
            cycles as f64 / el.as_secs_f64()
        );
        println!(
            "  VmRSS {rss0} -> {rss1} KiB ({:+} KiB, {:+.0} B/cycle); VmPin (registered) {pin0} -> {pin1} KiB, peak {peak_pin} KiB",
            rss1 as i64 - rss0 as i64,
            (rss1 as f64 - rss0 as f64) * 1024.0 / cycles as f64
        );
        println!("  VmRSS every {} cycles (KiB): {trajectory:?}", (cycles / 8).max(1));
        assert_eq!(conns, 2 * cycles as u64, "a client and a server connection per cycle");
        assert!(released, "registered memory back to {pin0} KiB: VmPin {pin1} KiB");
        assert!(
            rss1 < rss0 + 32 * 1024,
            "resident memory grew by {} KiB over {cycles} cycles",
            rss1 - rss0
        );
        cycle(&addr, usize::MAX).await;
        server.shutdown().await.unwrap();
    })
    .await;
}
