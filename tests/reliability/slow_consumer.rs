//! A server stream of 1 MiB messages (4 GiB offered) read slowly by the
//! client: flow control holds the server back. The bytes the transport
//! carried stay within what the client consumed plus one call window, and
//! the process's resident memory stays bounded; dropping the stream cancels
//! the handler and the connection goes on working.
use crate::common::{bounded, echo, rdma_channel, rdma_host, rss_kib, start_server};
use rpc_examples::pb::echo::EchoRequest;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

const MSG: usize = 1 << 20;
const OFFERED: u32 = 4096; // messages: 4 GiB
const READS: usize = 40;
const READ_PAUSE: Duration = Duration::from_millis(250);
/// The per-call flow-control window (SessionConfig::default().initial_window).
const WINDOW: u64 = 4 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn slow_consumer_back_pressure() {
    let Some(ip) = rdma_host("slow_consumer_back_pressure") else {
        return;
    };
    bounded("slow_consumer_back_pressure", Duration::from_secs(120), async {
        let (server, stats) = start_server(&ip, 0).await;
        let ch = rdma_channel(&server.rdma_addr().unwrap().to_string()).await;
        let mut c = echo(&ch);
        // Warm up: buffers and pools of a 1 MiB exchange exist before measuring.
        c.unary_echo(EchoRequest {
            payload: vec![1; MSG].into(),
            ..Default::default()
        })
        .await
        .unwrap();
        let rss0 = rss_kib();
        let sent0 = rdma_transport::global_stats().bytes_sent;
        let t0 = Instant::now();
        let mut s = c
            .server_streaming_echo(EchoRequest {
                count: OFFERED,
                reply_bytes: MSG as u64,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut got = 0u64;
        let mut peak = rss0;
        for i in 0..READS {
            let m = s.message().await.unwrap().expect("a message");
            assert_eq!(m.seq as usize, i);
            assert_eq!(m.payload.len(), MSG);
            got += m.payload.len() as u64;
            peak = peak.max(rss_kib());
            tokio::time::sleep(READ_PAUSE).await;
        }
        // Let the sender run into the window for a moment more.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let sent = rdma_transport::global_stats().bytes_sent - sent0;
        peak = peak.max(rss_kib());
        let el = t0.elapsed();
        println!(
            "  read {READS} x 1 MiB in {el:.1?} (server offered {OFFERED} MiB); transport carried {:.1} MiB; VmRSS {} -> peak {} KiB (+{:.1} MiB)",
            sent as f64 / 1048576.0,
            rss0,
            peak,
            (peak - rss0) as f64 / 1024.0
        );
        assert!(
            sent <= got + WINDOW + (2 << 20),
            "the server pushed {sent} bytes while the client consumed {got} (window {WINDOW})"
        );
        assert!(
            peak - rss0 < 200 * 1024,
            "resident memory grew by {} KiB",
            peak - rss0
        );
        let (started, cancelled) = (stats.started.load(SeqCst), stats.cancelled.load(SeqCst));
        drop(s);
        assert!(
            rpc_tests::eventually(Duration::from_secs(10), || stats.cancelled.load(SeqCst)
                == cancelled + 1)
            .await,
            "dropping the stream cancelled the handler: {stats:?}"
        );
        assert_eq!(stats.started.load(SeqCst), started);
        let r = c
            .unary_echo(EchoRequest {
                message: "after".into(),
                ..Default::default()
            })
            .await
            .expect("the connection still works");
        assert_eq!(r.into_inner().message, "after");
        server.shutdown().await.unwrap();
    })
    .await;
}
