//! Device tests of ticket-gated admission (wire §2.4; part of the `hostile`
//! binary): a listener made by `Listener::bind_gated` admits only connect
//! requests whose ticket its gate accepts, rejects the others with the
//! gate's reason before it counts or creates anything for them, and an
//! ungated listener ignores a ticket.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_transport::testing::StalledConnect;
use rdma_transport::{
    connect, connect_with_ticket, global_stats, registered_bytes, AdmitGate, AdmitRequest, Config,
    Connection, Error, Listener, RejectReason, StatsSnapshot, Ticket,
};
use tokio::sync::mpsc;

use super::within;
use crate::common::{device_ip, iwarp, pattern};

/// The ticket the gate below accepts.
const GOOD: Ticket = *b"good-ticket!";

/// Small pools (the emulated VM pays dearly for pinning pages), and no
/// device pool: each attempt registers its own rings, the same count every
/// time, so what one refused attempt registers is this side's only.
fn client_cfg() -> Config {
    Config {
        rendezvous_buffers: 2,
        rendezvous_buffer_bytes: 64 << 10,
        device_pool: false,
        resolve_timeout: Duration::from_secs(15),
        connect_timeout: Duration::from_secs(15),
        ..Config::default()
    }
}

/// A gate admitting [`GOOD`] only, recording every request it saw.
fn gate(seen: Arc<Mutex<Vec<AdmitRequest>>>) -> AdmitGate {
    Arc::new(move |r: &AdmitRequest| {
        seen.lock().unwrap().push(r.clone());
        match r.ticket {
            Some(t) if t == GOOD => Ok(()),
            Some(_) => Err("unauthenticated: ticket not valid".to_string()),
            None => Err("unauthenticated: no ticket presented".to_string()),
        }
    })
}

/// Accepts in a task of its own, handing every `accept` result over.
fn acceptor(mut l: Listener) -> (mpsc::UnboundedReceiver<Result<Connection, Error>>, Counters) {
    let (tx, rx) = mpsc::unbounded_channel();
    let counters = Counters::default();
    let c = counters.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        loop {
            tokio::select! {
                r = l.accept() => {
                    if tx.send(r).is_err() {
                        return;
                    }
                }
                _ = tick.tick() => {
                    *c.0.lock().unwrap() = (l.refused(), l.refused_unauthenticated());
                    if tx.is_closed() {
                        return;
                    }
                }
            }
        }
    });
    (rx, counters)
}

/// `(Listener::refused, Listener::refused_unauthenticated)`, published by
/// [`acceptor`] every 10 ms.
#[derive(Clone, Default)]
struct Counters(Arc<Mutex<(usize, usize)>>);

impl Counters {
    async fn settled(&self, want: (usize, usize)) -> (usize, usize) {
        for _ in 0..100 {
            let now = *self.0.lock().unwrap();
            if now == want {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        *self.0.lock().unwrap()
    }
}

/// What one step registered in this process.
#[derive(Debug, PartialEq, Eq)]
struct Registered {
    registrations: u64,
    pool_reuses: u64,
    /// Registered bytes after the step, over those before it.
    left: isize,
}

fn registered_since(before: &StatsSnapshot, bytes_before: usize) -> Registered {
    let now = global_stats();
    Registered {
        registrations: now.memory_registrations - before.memory_registrations,
        pool_reuses: now.pool_reuses - before.pool_reuses,
        left: registered_bytes() as isize - bytes_before as isize,
    }
}

/// Runs `attempt`, which must fail with `Error::Rejected`, and returns the
/// error with what was registered meanwhile.
async fn refused<F>(what: &str, attempt: F) -> (Error, Registered)
where
    F: std::future::Future<Output = Result<Connection, Error>>,
{
    let (before, bytes) = (global_stats(), registered_bytes());
    let e = attempt.await.expect_err(what);
    let reg = registered_since(&before, bytes);
    println!("{what}: {e}; registered meanwhile: {reg:?}");
    assert!(matches!(e, Error::Rejected { .. }), "{what}: {e:?}");
    (e, reg)
}

/// Sends `n` patterned messages each way (eager and rendezvous sizes) and
/// checks them.
async fn both_ways(client: Connection, server: Connection) {
    let (mut ctx, mut crx) = client.split();
    let (mut stx, mut srx) = server.split();
    for (i, len) in [100usize, 200 << 10].into_iter().enumerate() {
        let m = pattern(i as u64 + 1, len);
        ctx.send(m.clone()).await.expect("client send");
        assert!(
            srx.recv().await.expect("server recv") == Some(m),
            "client → server, {len} B"
        );
        let m = pattern(i as u64 + 100, len);
        stx.send(m.clone()).await.expect("server send");
        assert!(
            crx.recv().await.expect("client recv") == Some(m),
            "server → client, {len} B"
        );
    }
    ctx.close().await;
    assert!(srx.recv().await.expect("server sees the close").is_none());
    stx.close().await;
    assert!(crx.recv().await.expect("client sees the close").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn admission_only_with_the_gates_ticket() {
    let name = "admission_only_with_the_gates_ticket";
    let Some(ip) = device_ip(name) else {
        return;
    };
    within(300, name, async {
        let cfg = client_cfg();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let l = Listener::bind_gated(SocketAddr::new(ip, 0), cfg.clone(), gate(seen.clone()))
            .await
            .expect("bind_gated");
        let addr = l.local_addr();
        let (mut accepted, counters) = acceptor(l);

        // What one attempt registers on the connecting side alone: a
        // connect to a port nobody listens on (refused by the CM, or on
        // iWARP by TCP, before any listener sees it).
        let (_, alone) = refused("no listener", connect(SocketAddr::new(ip, 1), &cfg)).await;
        assert!(alone.registrations > 0, "{alone:?}");

        // (a) No ticket: rejected with the gate's reason.
        let (e, reg) = refused("no ticket", connect(addr, &cfg)).await;
        assert!(
            matches!(&e, Error::Rejected { reason: Some(RejectReason::Unauthenticated(r)), .. }
                if r == "unauthenticated: no ticket presented"),
            "{e}"
        );
        // (d) The listener registered nothing for it: the attempt
        // registered what the connecting side alone does, and all of it is
        // gone again.
        assert_eq!(reg, alone, "no ticket: the listener registered memory");
        assert_eq!(reg.left, 0, "no ticket: memory left registered");

        // (b) A wrong ticket: the same.
        let (e, reg) = refused(
            "wrong ticket",
            connect_with_ticket(addr, &cfg, *b"wrong-ticket"),
        )
        .await;
        assert!(
            matches!(&e, Error::Rejected { reason: Some(RejectReason::Unauthenticated(r)), .. }
                if r == "unauthenticated: ticket not valid"),
            "{e}"
        );
        assert_eq!(reg, alone, "wrong ticket: the listener registered memory");

        // On IB/RoCE a connect request can be sent without a queue pair and
        // without registering anything: refused ones leave this process's
        // registrations exactly where they were.
        if iwarp() {
            println!(
                "iWARP: the connection manager needs a QP to send a connect request; the \
                 comparison with a connect to no listener above covers it"
            );
        } else {
            for ticket in [None, Some(*b"wrong-ticket")] {
                let (before, bytes) = (global_stats(), registered_bytes());
                let s = StalledConnect::start_with_ticket(addr, None, &cfg, ticket)
                    .await
                    .expect("connect request sent");
                let answer = s.answer(Duration::from_secs(10)).await.unwrap();
                let reg = registered_since(&before, bytes);
                println!("request without a QP, ticket {ticket:?}: {answer:?}; registered {reg:?}");
                assert!(
                    answer
                        .as_deref()
                        .is_some_and(|a| a.starts_with("REJECTED: unauthenticated")),
                    "{answer:?}"
                );
                assert_eq!(
                    reg,
                    Registered {
                        registrations: 0,
                        pool_reuses: 0,
                        left: 0
                    }
                );
            }
        }
        let refusals = if iwarp() { 2 } else { 4 };
        assert_eq!(
            counters.settled((0, refusals)).await,
            (0, refusals),
            "(refused by limits, refused by the gate)"
        );
        // Refused requests are not reported by accept.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(accepted.try_recv().is_err(), "accept reported a refusal");

        // (c) The right ticket connects; the accepting side sees it.
        let client = connect_with_ticket(addr, &cfg, GOOD)
            .await
            .expect("connect with the right ticket");
        let server = accepted.recv().await.unwrap().expect("accepted");
        assert_eq!(server.ticket(), Some(GOOD));
        assert_eq!(client.ticket(), None);
        let client_local = server.peer_addr();
        both_ways(client, server).await;
        let seen = seen.lock().unwrap().clone();
        println!("the gate saw {seen:?}");
        assert_eq!(seen.len(), refusals + 1);
        let last = seen.last().unwrap();
        assert_eq!(last.ticket, Some(GOOD));
        assert_eq!(last.peer.map(|p| p.ip()), Some(client_local.ip()));
        assert_eq!(seen[0].ticket, None);
        assert_eq!(counters.settled((0, refusals)).await, (0, refusals));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn admission_ungated_listener_ignores_a_ticket_and_a_panicking_gate_refuses() {
    let name = "admission_ungated_listener_ignores_a_ticket_and_a_panicking_gate_refuses";
    let Some(ip) = device_ip(name) else {
        return;
    };
    within(300, name, async {
        let cfg = client_cfg();
        let l = Listener::bind(SocketAddr::new(ip, 0), cfg.clone())
            .await
            .expect("bind");
        let addr = l.local_addr();
        let (mut accepted, counters) = acceptor(l);
        let t: Ticket = *b"any-ticket!!";
        let client = connect_with_ticket(addr, &cfg, t)
            .await
            .expect("an ungated listener admits a ticketed connect");
        let server = accepted.recv().await.unwrap().expect("accepted");
        assert_eq!(server.ticket(), Some(t), "the ticket presented is shown");
        both_ways(client, server).await;
        let client = connect(addr, &cfg).await.expect("and a plain one");
        let server = accepted.recv().await.unwrap().expect("accepted");
        assert_eq!(server.ticket(), None);
        both_ways(client, server).await;
        assert_eq!(counters.settled((0, 0)).await, (0, 0));

        // A gate that panics refuses, and the listener goes on.
        let panicky: AdmitGate = Arc::new(|r: &AdmitRequest| {
            if r.ticket.is_none() {
                panic!("gate bug (panics on purpose in this test)");
            }
            Ok(())
        });
        let l = Listener::bind_gated(SocketAddr::new(ip, 0), cfg.clone(), panicky)
            .await
            .expect("bind_gated");
        let addr = l.local_addr();
        let (mut accepted, counters) = acceptor(l);
        let e = connect(addr, &cfg).await.expect_err("refused");
        println!("panicking gate: {e}");
        assert!(
            matches!(&e, Error::Rejected { reason: Some(RejectReason::Unauthenticated(r)), .. }
                if r == "unauthenticated: admission check failed"),
            "{e:?}"
        );
        let client = connect_with_ticket(addr, &cfg, t)
            .await
            .expect("the listener still runs");
        let server = accepted.recv().await.unwrap().expect("accepted");
        assert_eq!(server.ticket(), Some(t));
        both_ways(client, server).await;
        assert_eq!(counters.settled((0, 1)).await, (0, 1));
    })
    .await;
}

#[test]
fn admit_request_debug_does_not_show_the_ticket() {
    let peer: SocketAddr = (IpAddr::from([192, 168, 77, 1]), 4000).into();
    let r = AdmitRequest::new(Some(peer), Some(GOOD));
    let s = format!("{r:?}");
    assert!(!s.contains("good") && !s.contains("103"), "{s}");
    assert!(s.contains("<ticket>") && s.contains("192.168.77.1"), "{s}");
}
