//! Device tests of the listener under hostile connection patterns (part of
//! the `hostile` binary): a handshake that never completes must delay no one
//! (handshakes run concurrently, each bounded by `connect_timeout`), pending
//! handshakes are bounded per source address, and one address opening
//! connections as fast as it can must not lock other addresses out.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use futures::StreamExt;
use rdma_transport::testing::StalledConnect;
use rdma_transport::{
    connect, connect_from, registered_bytes, Config, Connection, Error, RejectReason,
};

use super::{within, EchoServer};
use crate::common::{device_ip, iwarp, pattern, required};

/// Small pools (~1.2 MiB per connection instead of 5 MiB) so that many
/// connections fit in the VM.
fn small_client(timeout: Duration) -> Config {
    Config {
        rendezvous_buffers: 2,
        rendezvous_buffer_bytes: 64 << 10,
        resolve_timeout: timeout,
        connect_timeout: timeout,
        ..Config::default()
    }
}

/// One echo round trip (eager and rendezvous) on `c`, then a clean close.
async fn round_trip(c: Connection, sizes: &[usize]) {
    let (mut tx, mut rx) = c.split();
    for (i, &len) in sizes.iter().enumerate() {
        let m = pattern(i as u64 + 11, len);
        tx.send(m.clone()).await.expect("send");
        let got = rx.recv().await.expect("recv").expect("echo");
        assert!(got == m, "echo of {len} bytes corrupted");
    }
    tx.close().await;
}

fn stats(mut v: Vec<Duration>) -> String {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!(
        "min {:.1} ms, median {:.1} ms, max {:.1} ms",
        ms(v[0]),
        ms(v[v.len() / 2]),
        ms(v[v.len() - 1])
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn a_handshake_that_never_completes_delays_no_one() {
    let name = "a_handshake_that_never_completes_delays_no_one";
    let Some(ip) = device_ip(name) else {
        return;
    };
    if iwarp() {
        println!(
            "SKIP {name}: iWARP's connection manager needs a QP to send a connect request and \
             siw completes the handshake in the kernel, so an rdma_cm client that never \
             completes one cannot be built there; RoCE runs it"
        );
        return;
    }
    within(120, name, async {
        // The listener's handshakes are bounded by the default 5 s; the
        // clients give up after 2 s (rpc-core's `rdma_connect_timeout`).
        // Small pools on both sides: this is about handshakes, and the
        // emulated VM pays dearly for pinning pages.
        let server = EchoServer::start(ip, small_client(Duration::from_secs(5))).await;
        let stalled = StalledConnect::start(server.addr, None, &Config::default())
            .await
            .expect("stalled connect request sent");
        let answer = stalled.answer(Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            answer.as_deref(),
            Some("CONNECT_RESPONSE"),
            "the listener accepted the stalled request and now waits for it"
        );
        let cfg = small_client(Duration::from_secs(2));
        // 50 clients arriving 100 ms apart (all within the stalled
        // handshake's 5 s), each giving up after 2 s per stage.
        let t0 = Instant::now();
        let clients: Vec<_> = (0..50u32)
            .map(|k| {
                let cfg = cfg.clone();
                let addr = server.addr;
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(100) * k).await;
                    let t = Instant::now();
                    let c = connect(addr, &cfg).await?;
                    let took = t.elapsed();
                    round_trip(c, &[100, 5000]).await;
                    Ok::<_, Error>(took)
                })
            })
            .collect();
        let mut took = vec![];
        let mut failed = vec![];
        for c in clients {
            match c.await.unwrap() {
                Ok(d) => took.push(d),
                Err(e) => failed.push(e),
            }
        }
        println!(
            "RoCE (rxe): {} of 50 clients (arriving 100 ms apart) connected over RDMA with a \
             never-completing handshake pending; connect {}; all done in {:.2} s; failed: {:?}",
            took.len(),
            if took.is_empty() {
                "-".to_string()
            } else {
                stats(took.clone())
            },
            t0.elapsed().as_secs_f64(),
            failed
        );
        assert!(
            failed.is_empty(),
            "clients could not connect over RDMA with a stalled handshake pending: {failed:?}"
        );
        // The stalled handshake ends by the listener's own timeout.
        let mut ended = None;
        for _ in 0..400 {
            if let Some(e) = server.rejected.lock().unwrap().first() {
                ended = Some(e.clone());
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        println!("the stalled handshake ended at the listener with {ended:?}");
        assert!(
            matches!(ended, Some(Error::Timeout { stage: "accept" })),
            "{ended:?}"
        );
        drop(stalled);

        // Pending handshakes are bounded per source address: with a limit of
        // 2, a third stalled request from the same address is refused at once.
        let limited = EchoServer::start(
            ip,
            Config {
                max_pending_handshakes_per_address: 2,
                ..Config::default()
            },
        )
        .await;
        let mut answers = vec![];
        let mut held = vec![];
        for _ in 0..3 {
            let s = StalledConnect::start(limited.addr, None, &Config::default())
                .await
                .unwrap();
            answers.push(s.answer(Duration::from_secs(5)).await.unwrap());
            held.push(s);
        }
        println!("3 stalled requests, 2 pending allowed per address: {answers:?}");
        assert_eq!(answers[0].as_deref(), Some("CONNECT_RESPONSE"));
        assert_eq!(answers[1].as_deref(), Some("CONNECT_RESPONSE"));
        assert!(
            answers[2]
                .as_deref()
                .is_some_and(|a| a.starts_with("REJECTED: busy")),
            "{answers:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            limited.refused.load(std::sync::atomic::Ordering::Relaxed),
            1
        );
    })
    .await;
}

/// A second local address on the RDMA netdev: `RDMA_TEST_SECOND_IP`, or in
/// the VM (root) `ip addr add` of `ip`'s last octet + 1 (rxe gives the new
/// address its own GID; siw uses it like any TCP address).
fn second_ip(ip: IpAddr) -> Option<IpAddr> {
    if let Ok(s) = std::env::var("RDMA_TEST_SECOND_IP") {
        return Some(s.parse().expect("RDMA_TEST_SECOND_IP must be an IP"));
    }
    if std::env::var("SOFTROCE_IN_VM").as_deref() != Ok("1") {
        return None;
    }
    let IpAddr::V4(v4) = ip else { return None };
    let o = v4.octets();
    let second = IpAddr::from([o[0], o[1], o[2], o[3] + 1]);
    let netdev = if iwarp() {
        std::env::var("SOFTROCE_SIW_NETDEV")
    } else {
        std::env::var("SOFTROCE_NETDEV")
    }
    .expect("SOFTROCE_NETDEV / SOFTROCE_SIW_NETDEV in the VM");
    let out = std::process::Command::new("ip")
        .args(["addr", "add", &format!("{second}/24"), "dev", &netdev])
        .output()
        .expect("run ip addr add");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() || err.contains("File exists"),
        "ip addr add {second} dev {netdev}: {err}"
    );
    Some(second)
}

/// Opens up to `n` connections to `addr` from the default source address
/// (8 attempts in flight), keeping every one that is accepted. Starts no
/// new attempt after the first refusal by the listener (`Rejected`) when
/// `stop_at_refusal`, but lets those in flight finish and keeps them:
/// dropping them would free their listener-side memory again.
async fn flood(
    addr: SocketAddr,
    n: usize,
    stop_at_refusal: bool,
) -> (Vec<Connection>, Vec<Error>, Duration) {
    // Tiny pools: the flooder's own registered memory hardly counts.
    let cfg = Config {
        recv_slots: 4,
        recv_slot_bytes: 1024,
        send_slots: 4,
        rendezvous_buffers: 1,
        rendezvous_buffer_bytes: 4096,
        ..Config::default()
    };
    let t = Instant::now();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let go = stop.clone();
    let mut attempts = futures::stream::iter(0..n)
        .take_while(move |_| futures::future::ready(!go.load(std::sync::atomic::Ordering::Relaxed)))
        .map(|_| {
            let cfg = cfg.clone();
            async move { connect(addr, &cfg).await }
        })
        .buffer_unordered(8);
    let (mut ok, mut refused) = (vec![], vec![]);
    while let Some(r) = attempts.next().await {
        match r {
            Ok(c) => ok.push(c),
            Err(e) => {
                let by_listener = matches!(e, Error::Rejected { .. });
                refused.push(e);
                if stop_at_refusal && by_listener {
                    stop.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    }
    drop(attempts);
    (ok, refused, t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn one_address_cannot_take_every_connection() {
    let name = "one_address_cannot_take_every_connection";
    let Some(ip) = device_ip(name) else {
        return;
    };
    if iwarp() {
        // Seen in 4 of 4 siw runs in the VM: after a few dozen CQs were
        // created and destroyed in quick succession, siw fails
        // `ibv_create_cq` (EAGAIN, EINVAL) in the flooder, in the listener's
        // handshakes and in the well-behaved client alike, even with one
        // attempt at a time; what fails is then the device, not the limit.
        println!(
            "SKIP {name}: siw fails ibv_create_cq (EAGAIN/EINVAL) under a connection flood \
             from one process, whoever creates the CQ; RoCE runs it"
        );
        return;
    }
    let Some(other) = second_ip(ip) else {
        assert!(
            !required(),
            "{name}: a second address is needed (RDMA_TEST_SECOND_IP)"
        );
        println!("SKIP {name}: no second local RDMA address (set RDMA_TEST_SECOND_IP)");
        return;
    };
    let transport = "RoCE (rxe)";
    within(300, name, async {
        // Room for 24 listener-side connections under the process-wide
        // cap, and at most 12 from one address. The listener registers
        // its rings and its region up front (`memory_on_demand: false`,
        // below): 3 MiB per connection (staging only when it sends large
        // messages).
        let d = Config::default();
        let per_conn = (d.recv_slots + d.send_slots) as usize * d.recv_slot_bytes
            + d.rendezvous_buffers as usize * d.rendezvous_buffer_bytes;
        let cap = |base: usize| base + 24 * per_conn + (1 << 20);
        let good_cfg = Config::default();

        // Control: the same without a per-address limit. The flood takes
        // every byte under the cap, and a client from another address is
        // refused: the fault the limit prevents.
        let base = registered_bytes();
        let control = EchoServer::start(
            ip,
            Config {
                max_connections_per_address: usize::MAX,
                global_max_registered_bytes: cap(base),
                // 5 MiB per connection up front, as the cap above assumes.
                memory_on_demand: false,
                ..Config::default()
            },
        )
        .await;
        let (held, refused, _) = flood(control.addr, 500, true).await;
        let e = connect_from(other, control.addr, &good_cfg)
            .await
            .expect_err("no per-address limit: the flood leaves no room");
        println!(
            "control (no per-address limit): the flood got {} connections, then {:?}; \
             a client from {other}: {e}",
            held.len(),
            refused.last()
        );
        assert!(
            held.len() >= 20,
            "{} connections; the listener's errors: {:?}",
            held.len(),
            control.rejected.lock().unwrap()
        );
        assert!(
            matches!(
                &e,
                Error::Rejected {
                    reason: Some(RejectReason::Resources),
                    ..
                }
            ),
            "{e:?}"
        );
        drop(held);
        drop(control);
        wait_registered(base).await;

        // With the limit: 12 connections from the flooding address, the
        // rest refused at once, and another address still gets in.
        let base = registered_bytes();
        let server = EchoServer::start(
            ip,
            Config {
                max_connections_per_address: 12,
                global_max_registered_bytes: cap(base),
                memory_on_demand: false,
                ..Config::default()
            },
        )
        .await;
        let addr = server.addr;
        let flooder = tokio::spawn(async move { flood(addr, 500, false).await });
        // Connect while the flood is on, once it holds its 12.
        while server.accepted.lock().unwrap().len() < 12 && !flooder.is_finished() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let t = Instant::now();
        let good = connect_from(other, server.addr, &good_cfg)
            .await
            .unwrap_or_else(|e| panic!("a client from {other} cannot connect: {e}"));
        let took = t.elapsed();
        round_trip(good, &[0, 100, 5000, 1 << 20]).await;
        let flood_done = flooder.is_finished();
        assert!(
            server
                .accepted
                .lock()
                .unwrap()
                .iter()
                .any(|p| p.ip() == other),
            "the listener saw the client's address {other}"
        );
        let (held, refused, flood_took) = flooder.await.unwrap();
        let listener_mib = (registered_bytes() - base) >> 20;
        println!(
            "{transport}: a client from {other} connected in {:.1} ms {} the flood from {ip} \
             and its 4 messages (0 B..1 MiB) echoed intact; the flood: 500 attempts in \
             {:.2} s, {} accepted, {} refused ({:?}); listener refusals {}; registered now \
             {listener_mib} MiB (cap {} MiB above the {} MiB before)",
            took.as_secs_f64() * 1e3,
            if flood_done { "after" } else { "during" },
            flood_took.as_secs_f64(),
            held.len(),
            refused.len(),
            refused.first(),
            server.refused.load(std::sync::atomic::Ordering::Relaxed),
            (cap(base) - base) >> 20,
            base >> 20,
        );
        assert_eq!(held.len(), 12, "max_connections_per_address");
        assert_eq!(refused.len(), 500 - 12);
        // Every refusal is the listener's, naming the limit.
        let (by_listener, local): (Vec<_>, Vec<_>) = refused
            .iter()
            .partition(|e| matches!(e, Error::Rejected { .. }));
        assert!(
            by_listener.iter().all(|e| matches!(
                e,
                Error::Rejected {
                    reason: Some(RejectReason::Busy),
                    ..
                }
            )),
            "{by_listener:?}"
        );
        println!(
            "refused by the listener: {}; failed in the flooder's own device: {} {:?}",
            by_listener.len(),
            local.len(),
            local.first()
        );
        assert!(local.is_empty(), "{local:?}");
        assert!(by_listener.len() >= 250, "{} refusals", by_listener.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            server.refused.load(std::sync::atomic::Ordering::Relaxed),
            by_listener.len(),
            "Listener::refused"
        );
        drop(held);
        drop(server);
        wait_registered(base).await;
    })
    .await;
}

/// Waits (up to 20 s) until the closed connections' memory is deregistered.
async fn wait_registered(base: usize) {
    for _ in 0..400 {
        if registered_bytes() <= base {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "registered memory did not return to {base} B after the connections closed: {} B",
        registered_bytes()
    );
}
