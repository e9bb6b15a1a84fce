//! Device tests: a peer that breaks the RDMA wire protocol on purpose, over a
//! real queue pair ([`RawPeer`]), against a real [`Listener`] running an echo
//! service. Each violation must end that connection with an error naming it
//! (never a panic, never a write outside what was advertised), the NIC must
//! refuse every RDMA WRITE outside the advertised buffers or with another
//! connection's (or a closed connection's) rkey, and a well-behaved
//! connection to the same listener must keep working throughout.
//!
//! Like `verbs.rs`: `#[ignore]`d (run with `--include-ignored`); without a
//! device they print `SKIP`, unless `SOFTROCE_IN_VM=1` /
//! `RDMA_TEST_REQUIRE_DEVICE=1` says one is expected.
//! Section numbers refer to `docs/wire-protocol-rdma.md`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_transport::engine::wire::{self, Header, Hello, Kind, FLAG_LAST, HDR_LEN};
use rdma_transport::testing::{RawPeer, WC_REM_ACCESS_ERR};
use rdma_transport::{connect, Config, Error, Listener, PeerMisbehaved};

mod common;
use common::{device_ip, iwarp, pattern};

mod admission;
mod listener;

/// The listener's configuration in these tests: its rendezvous region is
/// advertised in the hello and registered for the connection's life
/// (`memory_on_demand: false`), so a raw peer can forge chunks into it
/// right away. With memory on demand (the default) the same checks apply
/// once a region is granted; `on_demand_region_is_never_writable_ungranted`
/// covers the region that was not.
fn static_cfg() -> Config {
    Config {
        memory_on_demand: false,
        ..Config::default()
    }
}

/// How each connection the listener accepted ended.
#[derive(Debug, Clone)]
enum Outcome {
    /// The peer closed cleanly.
    Clean,
    /// The connection failed.
    Failed(Error),
}

/// A listener echoing every message back, recording how each connection ended.
struct EchoServer {
    addr: SocketAddr,
    /// Peers of the connections accepted, in order.
    accepted: Arc<Mutex<Vec<SocketAddr>>>,
    /// Counters of each accepted connection (printed when one hangs).
    stats: Arc<Mutex<HashMap<SocketAddr, Arc<rdma_transport::ConnStats>>>>,
    /// How each connection ended, until `outcome` takes it (a later
    /// connection may come from the same address and port: on iWARP the
    /// port space is TCP's, and ports are reused).
    outcomes: Arc<Mutex<HashMap<SocketAddr, Outcome>>>,
    rejected: Arc<Mutex<Vec<Error>>>,
    /// `Listener::refused`, published every 20 ms.
    refused: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl EchoServer {
    async fn start(ip: IpAddr, cfg: Config) -> EchoServer {
        let mut l = Listener::bind(SocketAddr::new(ip, 0), cfg)
            .await
            .expect("bind");
        let addr = l.local_addr();
        let outcomes = Arc::new(Mutex::new(HashMap::new()));
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let stats = Arc::new(Mutex::new(HashMap::new()));
        let st = stats.clone();
        let rejected = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (o, r, a, f) = (
            outcomes.clone(),
            rejected.clone(),
            accepted.clone(),
            refused.clone(),
        );
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                let c = tokio::select! {
                    c = l.accept() => c,
                    _ = tick.tick() => {
                        f.store(l.refused(), std::sync::atomic::Ordering::Relaxed);
                        continue;
                    }
                };
                let c = match c {
                    Ok(c) => c,
                    Err(e) => {
                        r.lock().unwrap().push(e);
                        continue;
                    }
                };
                let o = o.clone();
                a.lock().unwrap().push(c.peer_addr());
                st.lock().unwrap().insert(c.peer_addr(), c.stats());
                tokio::spawn(async move {
                    let peer = c.peer_addr();
                    let (mut tx, mut rx) = c.split();
                    let end = loop {
                        match rx.recv().await {
                            Ok(Some(m)) => {
                                if let Err(e) = tx.send(m).await {
                                    break Outcome::Failed(e);
                                }
                            }
                            Ok(None) => {
                                tx.close().await;
                                break Outcome::Clean;
                            }
                            Err(e) => break Outcome::Failed(e),
                        }
                    };
                    let old = o.lock().unwrap().insert(peer, end);
                    assert!(
                        old.is_none(),
                        "two connections from {peer} ended before the first outcome was read: {old:?}"
                    );
                });
            }
        });
        EchoServer {
            addr,
            accepted,
            stats,
            outcomes,
            rejected,
            refused,
            task,
        }
    }

    /// Waits (up to 10 s) for the connection from `peer` to end.
    async fn outcome(&self, peer: SocketAddr) -> Outcome {
        self.outcome_within(peer, Duration::from_secs(10)).await
    }

    /// Waits up to `limit` for the connection from `peer` to end, and takes
    /// its outcome.
    async fn outcome_within(&self, peer: SocketAddr, limit: Duration) -> Outcome {
        let end = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < end {
            if let Some(o) = self.outcomes.lock().unwrap().remove(&peer) {
                return o;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ended = format!("{:?}", self.outcomes.lock().unwrap());
        let stats = self.stats.lock().unwrap().get(&peer).map(|s| s.snapshot());
        panic!(
            "the listener's connection from {peer} did not end within {limit:?}; ended: {ended}; \
             its counters: {stats:?}"
        );
    }

    /// Asserts the connection from `peer` failed with the protocol
    /// violation `want` accepts.
    async fn expect_violation(
        &self,
        peer: SocketAddr,
        case: &str,
        want: impl Fn(&PeerMisbehaved) -> bool,
    ) {
        match self.outcome(peer).await {
            Outcome::Failed(Error::Protocol(v)) => {
                assert!(want(&v), "{case}: wrong violation: {v:?}");
                println!("{case}: listener closed the connection: {v:?} ({v})");
            }
            o => panic!("{case}: expected a protocol violation, got {o:?}"),
        }
    }

    /// Asserts this listener accepted exactly the connections from `peers`.
    fn assert_accepted(&self, peers: &[SocketAddr], case: &str) {
        assert_eq!(
            self.accepted.lock().unwrap().as_slice(),
            peers,
            "{case}: connections the listener accepted"
        );
    }

    /// A well-behaved client on its own connection: small and rendezvous
    /// messages come back intact.
    async fn others_still_work(&self, case: &str) {
        let c = connect(self.addr, &static_cfg())
            .await
            .unwrap_or_else(|e| panic!("{case}: a good client cannot connect: {e}"));
        let (mut tx, mut rx) = c.split();
        for (i, len) in [0usize, 100, 5000, 1 << 20].into_iter().enumerate() {
            let m = pattern(i as u64 + 7, len);
            tx.send(m.clone()).await.expect("good client send");
            let got = rx.recv().await.expect("good client recv").expect("echo");
            assert!(got == m, "{case}: echo of {len} bytes corrupted");
        }
        tx.close().await;
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A raw connection that already sent the active side's first message (§2.3).
async fn raw(server: &EchoServer, edit: impl FnOnce(&mut Hello)) -> (RawPeer, SocketAddr) {
    raw_to(server.addr, edit).await
}

/// [`raw`], to any listener's address.
async fn raw_to(addr: SocketAddr, edit: impl FnOnce(&mut Hello)) -> (RawPeer, SocketAddr) {
    let mut p = RawPeer::connect(addr, &static_cfg(), edit)
        .await
        .expect("raw peer connects");
    let me = p.local_addr().expect("raw peer address");
    let st = p.send_header(Kind::Credit, |_| {}).await.expect("post");
    assert!(st.ok(), "first CREDIT message: {st:?}");
    // §2.3 step 6: the listener answers the first message; until it has,
    // its NIC may not be reading this connection yet (siw), so everything
    // a case sends afterwards is certain to be looked at.
    let (heard, kicks) = p
        .wait_for_listener(Duration::from_secs(10))
        .await
        .expect("raw peer setup kicks");
    assert!(
        heard,
        "the listener did not answer the first message within 10 s ({kicks} setup kicks)"
    );
    if kicks > 0 {
        println!("raw peer {me}: the listener answered after {kicks} setup kick(s)");
    }
    (p, me)
}

/// An EAGER SEND carrying `payload` (§4.1), as an honest sender builds it.
fn eager(payload: &[u8]) -> Vec<u8> {
    let mut m = vec![0u8; HDR_LEN + payload.len()];
    let mut h = Header::new(Kind::Eager);
    h.len = payload.len() as u32;
    h.encode(&mut m);
    m[HDR_LEN..].copy_from_slice(payload);
    m
}

fn buffer_addr(h: &Hello, i: u32) -> u64 {
    h.rdv_addr + i as u64 * h.rdv_bytes as u64
}

/// A CHUNK notification for buffer `idx` (§5.2), as an honest sender would build it.
fn chunk(h: &Hello, idx: u32, len: u32, total: u64, last: bool) -> impl FnOnce(&mut Header) {
    let addr = buffer_addr(h, idx);
    move |c: &mut Header| {
        c.rdv_index = idx;
        c.len = len;
        c.total_len = total;
        c.addr = addr;
        if last {
            c.flags |= FLAG_LAST;
        }
    }
}

/// The next message of `kind` the raw peer receives (header included),
/// skipping others (credit returns); `what` names it if none comes in 10 s.
async fn recv_kind(p: &mut RawPeer, kind: Kind, what: &str) -> Vec<u8> {
    loop {
        let m = p
            .recv(Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no {what} within 10 s"));
        if Header::decode(&m).unwrap().kind == kind {
            return m;
        }
    }
}

/// Asks the listener for its rendezvous region (§5.5) and waits for the
/// grant: (address, rkey).
async fn grant(p: &mut RawPeer) -> (u64, u32) {
    let st = p.send_header(Kind::RdvRequest, |_| {}).await.unwrap();
    assert!(st.ok(), "{st:?}");
    let m = recv_kind(p, Kind::RdvGrant, "grant of the listener's region").await;
    let h = Header::decode(&m).unwrap();
    (h.addr, h.len)
}

async fn within<F: std::future::Future<Output = ()>>(secs: u64, what: &str, f: F) {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {secs} s"));
}

/// Asserts that an RDMA WRITE the raw peer made was refused by the
/// listener's NIC and that only that connection died. On InfiniBand/RoCE
/// the writer's completion says so (`IBV_WC_REM_ACCESS_ERR`: RC completes a
/// WRITE only once the responder placed it). On iWARP a WRITE completes
/// locally once handed to TCP, and the responder answers a bad access with a
/// TERMINATE that ends the connection: the writer is disconnected instead.
async fn expect_refused(
    server: &EchoServer,
    p: &mut RawPeer,
    me: SocketAddr,
    st: &rdma_transport::testing::WcStatus,
    case: &str,
) {
    if st.status == WC_REM_ACCESS_ERR {
        println!("{case}: the NIC refused the WRITE: {}", st.text);
    } else {
        assert!(
            iwarp() && st.ok(),
            "{case}: WRITE completed with {st:?} (expected a remote access error)"
        );
        assert!(
            p.wait_disconnected(Duration::from_secs(10)).await.unwrap(),
            "{case}: iWARP: the responder must terminate the connection"
        );
        println!("{case}: iWARP: WRITE completed locally, the responder terminated the connection");
    }
    match server.outcome(me).await {
        Outcome::Failed(e) => println!("{case}: listener side ended with: {e}"),
        o => panic!("{case}: listener side ended {o:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn sending_without_credit_closes_the_connection() {
    let Some(ip) = device_ip("sending_without_credit_closes_the_connection") else {
        return;
    };
    // Per-connection ring (64 slots), and with the default configuration,
    // where the listener's connections share a receive queue (§4.7) on
    // rxe: the offender's excess must not cost another connection anything.
    // (Not on iWARP, which has no shared queue here: there a 4-slot ring
    // may have no receive posted when the excess SEND arrives, and iWARP,
    // which has no RNR, ends the connection instead of the engine's check.)
    overrun_credits(ip, static_cfg(), 64).await;
    if !iwarp() {
        overrun_credits(ip, Config::default(), 4).await;
    }
}

async fn overrun_credits(ip: IpAddr, cfg: Config, granted: u32) {
    within(120, "send without credit", async {
        let server = EchoServer::start(ip, cfg).await;
        // We advertise only 4 credits and never return any, so the listener
        // can return its receive credits at most 4 times; then we keep
        // sending as if we had credits (§4.2).
        let (mut p, me) = raw(&server, |h| h.credits = 4).await;
        let ring = p.peer_hello().credits as u64;
        let mut sent = 1u64; // the first CREDIT message
        let mut returned = 0u64;
        let mut refused = None;
        while sent < 10 * ring {
            while let Some(m) = p.recv(Duration::ZERO).await.unwrap() {
                returned += Header::decode(&m).expect("listener header").credit_return as u64;
            }
            // A SEND that never completes means the listener stopped taking
            // them (on iWARP a SEND into a closed connection can just hang).
            let st = match p.send_header(Kind::Credit, |_| {}).await {
                Ok(st) => st,
                Err(e @ Error::Timeout { .. }) => {
                    println!("SEND {}: {e}", sent + 1);
                    break;
                }
                Err(e) => panic!("{e}"),
            };
            if !st.ok() {
                refused = Some(st);
                break;
            }
            sent += 1;
            if p.wait_disconnected(Duration::ZERO).await.unwrap() {
                break;
            }
        }
        println!(
            "sent {sent} SENDs on {ring} initial credits + {returned} returned; \
             then: {refused:?}"
        );
        assert!(
            sent > ring + returned,
            "the peer did overrun its credits ({sent} > {ring} + {returned})"
        );
        server
            .expect_violation(me, "send without credit", |v| {
                *v == PeerMisbehaved::SendWithoutCredit { excess: 1, granted }
            })
            .await;
        assert!(
            p.wait_disconnected(Duration::from_secs(10)).await.unwrap(),
            "the listener disconnected the offender"
        );
        server.others_still_work("send without credit").await;
    })
    .await;
}

/// Wire §4.7: where the listener's connections share a PD (and a receive
/// queue), a granted rendezvous region is reachable only through a memory
/// window bound to its own connection's QP: another connection of the same
/// listener, knowing the address and the window's rkey, is refused by the
/// NIC. (On siw, without SRQ, the region's own PD gives the same answer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn granted_windows_work_only_on_their_own_connection() {
    let Some(ip) = device_ip("granted_windows_work_only_on_their_own_connection") else {
        return;
    };
    within(120, "window isolation", async {
        // A refused WRITE puts the listener's QP in the error state, but
        // with a shared receive queue it has no receive of its own to flush
        // (§4.7): the listener finds out at its next keepalive (§4.4),
        // 1 s here (10 s by default), or when the peer disconnects.
        let cfg = Config {
            keepalive: Duration::from_secs(1),
            ..Config::default()
        };
        let server = EchoServer::start(ip, cfg).await;
        let (mut a, a_addr) = raw(&server, |_| {}).await;
        let (addr, rkey) = grant(&mut a).await;
        println!("A was granted a region at {addr:#x}, rkey {rkey:#x}");
        let stats = server.stats.lock().unwrap()[&a_addr].clone();
        assert_eq!(
            stats.snapshot().shared_receive_connections,
            u64::from(!iwarp()),
            "on rxe the listener's connections share a receive queue (and a PD)"
        );
        let st = a.write(&pattern(7, 4096), addr, rkey).await.unwrap();
        assert!(st.ok(), "A writes its own granted region: {st:?}");
        let (mut b, b_addr) = raw(&server, |_| {}).await;
        let st = b.write(&[0xEE; 64], addr, rkey).await.unwrap();
        println!("B writes into A's region with A's window rkey: {}", st.text);
        expect_refused(&server, &mut b, b_addr, &st, "B with A's window").await;
        // A's connection is unharmed and still writes through its window.
        let st = a.write(&pattern(8, 4096), addr, rkey).await.unwrap();
        assert!(st.ok(), "A's window still works: {st:?}");
        server.others_still_work("window isolation").await;
    })
    .await;
}

/// buffer-ownership.md, "Process-wide block pool": a rendezvous region a
/// closed connection gave back is zeroed before the pool grants it to the
/// next one, so a peer that announces a chunk it never wrote reads zeros,
/// not what another connection's peer wrote there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn a_recycled_region_holds_nothing_of_its_last_connection() {
    let Some(ip) = device_ip("a_recycled_region_holds_nothing_of_its_last_connection") else {
        return;
    };
    within(120, "recycled region", async {
        let server = EchoServer::start(ip, Config::default()).await;
        // Keeps the device pool alive (it goes with the last connection).
        let (_keep, _) = raw(&server, |_| {}).await;
        let (mut a, a_addr) = raw(&server, |_| {}).await;
        let (addr_a, rkey_a) = grant(&mut a).await;
        let secret = vec![0x5Au8; 4096];
        let st = a.write(&secret, addr_a, rkey_a).await.unwrap();
        assert!(st.ok(), "A writes its granted region: {st:?}");
        drop(a);
        let _ = server.outcome(a_addr).await;
        // A's region reaches the pool once the listener's teardown is done.
        let region = {
            let d = Config::default();
            d.rendezvous_buffers as usize * d.rendezvous_buffer_bytes
        };
        let pooled = !iwarp();
        let t = std::time::Instant::now();
        while pooled && rdma_transport::pool_idle_bytes() < region {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "A's region did not reach the device pool within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (mut b, _) = raw(&server, |_| {}).await;
        let (addr_b, _) = grant(&mut b).await;
        if pooled {
            assert_eq!(addr_b, addr_a, "B was granted A's region, from the pool");
        }
        // B announces a whole 4 KiB chunk it never wrote.
        let st = b
            .send_header(Kind::Chunk, |c: &mut Header| {
                c.rdv_index = 0;
                c.len = 4096;
                c.total_len = 4096;
                c.addr = addr_b;
                c.flags |= FLAG_LAST;
            })
            .await
            .unwrap();
        assert!(st.ok(), "{st:?}");
        let echo = recv_kind(&mut b, Kind::Eager, "echo of B's message").await[HDR_LEN..].to_vec();
        assert_eq!(echo.len(), 4096);
        assert!(
            echo.iter().all(|&x| x == 0),
            "B read {} bytes of A's data from the recycled region",
            echo.iter().filter(|&&x| x == 0x5A).count()
        );
        println!(
            "B was granted {} region and read zeros where A had written",
            if pooled {
                "A's recycled"
            } else {
                "a new (siw: no pool)"
            }
        );
        server.others_still_work("recycled region").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn forged_rendezvous_notifications_close_the_connection() {
    let Some(ip) = device_ip("forged_rendezvous_notifications_close_the_connection") else {
        return;
    };
    within(240, "forged notifications", async {
        let cases = [
            "CHUNK names a buffer never advertised",
            "CHUNK longer than its buffer",
            "CHUNK at an address that is not its buffer",
            "CHUNK out of round-robin order",
            "CHUNK repeated for a buffer already consumed",
            "CHUNK with a payload",
            "more credits returned than ever granted",
            "CLOSE_SEEN for a CLOSE never sent",
        ];
        let mut last = None;
        for (i, case) in cases.into_iter().enumerate() {
            // Each case on its own listener and its own connection: nothing
            // a previous case left behind (state, or an outcome recorded for
            // a reused address and port) can decide this one.
            let server = EchoServer::start(ip, static_cfg()).await;
            let (mut p, me) = raw(&server, |_| {}).await;
            let h = p.peer_hello();
            let n = h.rdv_count;
            let b = h.rdv_bytes;
            let a0 = buffer_addr(&h, 0);
            // A real 4 KiB WRITE into buffer 0 first, as an honest sender does.
            let data = pattern(i as u64, 4096);
            let st = p.write(&data, a0, h.rdv_rkey).await.unwrap();
            assert!(st.ok(), "{case}: honest WRITE into buffer 0: {st:?}");
            type Want = Box<dyn Fn(&PeerMisbehaved) -> bool>;
            let (st, want): (_, Want) = match i {
                0 => (
                    p.send_header(Kind::Chunk, chunk(&h, n, 16, 16, true)).await,
                    Box::new(move |v| {
                        *v == PeerMisbehaved::ChunkUnknownBuffer { index: n, count: n }
                    }),
                ),
                1 => (
                    p.send_header(Kind::Chunk, chunk(&h, 0, b + 1, 2 * b as u64, false))
                        .await,
                    Box::new(move |v| {
                        *v == PeerMisbehaved::ChunkLength {
                            len: b + 1,
                            max: b as usize,
                        }
                    }),
                ),
                2 => {
                    let mut c = Header::new(Kind::Chunk);
                    chunk(&h, 0, 16, 16, true)(&mut c);
                    c.addr += 8;
                    let mut raw = [0u8; HDR_LEN];
                    c.encode(&mut raw);
                    (
                        p.send_raw(&raw).await,
                        Box::new(move |v| {
                            *v == PeerMisbehaved::ChunkWrongAddress {
                                index: 0,
                                addr: a0 + 8,
                                expected: a0,
                            }
                        }),
                    )
                }
                3 => (
                    p.send_header(Kind::Chunk, chunk(&h, 1, 16, 16, true)).await,
                    Box::new(move |v| {
                        *v == PeerMisbehaved::ChunkBufferNotGranted {
                            index: 1,
                            expected: 0,
                            held: n,
                        }
                    }),
                ),
                4 => {
                    let st = p
                        .send_header(Kind::Chunk, chunk(&h, 0, 4096, 8192, false))
                        .await
                        .unwrap();
                    assert!(st.ok());
                    (
                        p.send_header(Kind::Chunk, chunk(&h, 0, 4096, 8192, true))
                            .await,
                        // Buffer 0 is owed back to the peer (held n - 1) or
                        // already returned (held n); either way 1 is next.
                        Box::new(|v| {
                            matches!(
                                v,
                                PeerMisbehaved::ChunkBufferNotGranted {
                                    index: 0,
                                    expected: 1,
                                    ..
                                }
                            )
                        }),
                    )
                }
                5 => {
                    let mut c = Header::new(Kind::Chunk);
                    chunk(&h, 0, 16, 16, true)(&mut c);
                    let mut raw = vec![0u8; HDR_LEN + 8];
                    c.encode(&mut raw);
                    (
                        p.send_raw(&raw).await,
                        Box::new(|v| *v == PeerMisbehaved::ChunkWithPayload { len: HDR_LEN + 8 }),
                    )
                }
                6 => (
                    p.send_header(Kind::Credit, |c| c.credit_return = 2).await,
                    // The listener has sent one message (its answer to our
                    // first, §2.3 step 6): 63 of the 64 credits we granted
                    // are still with it; two more make 65.
                    Box::new(|v| {
                        *v == PeerMisbehaved::TooManyCredits {
                            credits: 65,
                            granted: 64,
                        }
                    }),
                ),
                _ => (
                    p.send_header(Kind::Credit, |c| c.flags = 2 /* CLOSE_SEEN */)
                        .await,
                    Box::new(|v| *v == PeerMisbehaved::CloseSeenWithoutClose),
                ),
            };
            let st = st.unwrap();
            println!(
                "{case}: connection from {me}: SEND completed with {:?}",
                st.text
            );
            let t = std::time::Instant::now();
            server.expect_violation(me, case, want).await;
            println!(
                "{case}: outcome {:.1} ms after the SEND",
                t.elapsed().as_secs_f64() * 1e3
            );
            assert!(
                p.wait_disconnected(Duration::from_secs(10)).await.unwrap(),
                "{case}: the listener disconnected the offender"
            );
            server.assert_accepted(&[me], case);
            let t = std::time::Instant::now();
            drop(p);
            println!(
                "{case}: raw peer torn down in {:.1} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
            last = Some(server);
        }
        last.expect("8 cases")
            .others_still_work("forged notifications")
            .await;
    })
    .await;
}

/// §5.4: forged chunk notifications by RDMA WRITE with immediate data. Each
/// closes only the offender's connection, with the exact violation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn forged_immediates_close_the_connection() {
    let Some(ip) = device_ip("forged_immediates_close_the_connection") else {
        return;
    };
    if iwarp() {
        println!("SKIP forged_immediates_close_the_connection: iWARP has no immediate data (§5.4), so no side offers it");
        return;
    }
    within(240, "forged immediates", async {
        let cases = [
            "WRITE with immediate on a connection that did not offer it",
            "immediate names a buffer never advertised",
            "immediate out of round-robin order",
            "immediate with LAST and chunks to follow disagreeing",
            "immediate claims the buffer the previous chunk is still in",
            "covering immediate covers more buffers than are granted",
            "covering immediate is not the buffer after those it covers",
        ];
        let mut last = None;
        for (i, case) in cases.into_iter().enumerate() {
            let server = EchoServer::start(ip, static_cfg()).await;
            // Cases 1-4: one notification per chunk (no covering
            // notifications offered); 5-6: covering notifications.
            let (mut p, me) = raw(&server, |h| {
                if i == 0 {
                    h.flags = 0;
                } else if i < 5 {
                    h.flags &= !wire::HELLO_FLAG_COVERS;
                }
            })
            .await;
            let h = p.peer_hello();
            assert_ne!(
                h.flags & wire::HELLO_FLAG_WRITE_IMM,
                0,
                "{case}: a RoCE listener offers immediates"
            );
            assert_ne!(
                h.flags & wire::HELLO_FLAG_COVERS,
                0,
                "{case}: and covering notifications"
            );
            let n = h.rdv_count;
            let a0 = buffer_addr(&h, 0);
            let data = pattern(i as u64, 4096);
            type Want = Box<dyn Fn(&PeerMisbehaved) -> bool>;
            let (imm, want): (u32, Want) = match i {
                0 => {
                    let imm = wire::chunk_imm(0, 0, true);
                    (
                        imm,
                        Box::new(move |v| *v == PeerMisbehaved::ImmediateNotOffered { imm }),
                    )
                }
                1 => (
                    wire::chunk_imm(n, 0, true),
                    Box::new(move |v| {
                        *v == PeerMisbehaved::ChunkUnknownBuffer { index: n, count: n }
                    }),
                ),
                2 => (
                    wire::chunk_imm(1, 0, true),
                    Box::new(move |v| {
                        *v == PeerMisbehaved::ChunkBufferNotGranted {
                            index: 1,
                            expected: 0,
                            held: n,
                        }
                    }),
                ),
                3 => {
                    let imm = wire::chunk_imm(0, 0, false);
                    (
                        imm,
                        Box::new(move |v| *v == PeerMisbehaved::ImmediateMalformed { imm }),
                    )
                }
                5 => (
                    wire::chunk_imm(0, n as usize, true),
                    Box::new(move |v| {
                        *v == PeerMisbehaved::CoverExceedsGrants {
                            chunks: n + 1,
                            held: n,
                        }
                    }),
                ),
                6 => (
                    wire::chunk_imm(2, 1, true),
                    Box::new(move |v| {
                        *v == PeerMisbehaved::ChunkBufferNotGranted {
                            index: 2,
                            expected: 1,
                            held: n,
                        }
                    }),
                ),
                _ => {
                    // An honest first chunk into buffer 0, then a second
                    // one claiming buffer 0 again while it holds the first.
                    let st = p
                        .write_with_imm(&data, a0, h.rdv_rkey, wire::chunk_imm(0, 1, false))
                        .await
                        .unwrap();
                    assert!(st.ok(), "{case}: honest first chunk: {st:?}");
                    (
                        wire::chunk_imm(0, 0, true),
                        Box::new(move |v| {
                            *v == PeerMisbehaved::ChunkBufferNotGranted {
                                index: 0,
                                expected: 1,
                                held: n - 1,
                            }
                        }),
                    )
                }
            };
            let st = p.write_with_imm(&data, a0, h.rdv_rkey, imm).await.unwrap();
            println!(
                "{case}: WRITE with immediate {imm:#x} completed with {:?}",
                st.text
            );
            server.expect_violation(me, case, want).await;
            assert!(
                p.wait_disconnected(Duration::from_secs(10)).await.unwrap(),
                "{case}: the listener disconnected the offender"
            );
            server.assert_accepted(&[me], case);
            drop(p);
            last = Some(server);
        }
        last.expect("7 cases")
            .others_still_work("forged immediates")
            .await;
    })
    .await;
}

/// §5.4 "Covering notifications", on a real QP: chunks WRITTEN without a
/// notification are never delivered on their own (a peer that never
/// notifies gets nothing delivered, and its connection keeps working);
/// once a covering immediate names them, the application gets exactly the
/// bytes that were in the buffers then, and WRITEs the peer makes into the
/// same buffers afterwards (it holds their grants again) do not change the
/// message the application holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn covered_chunks_are_delivered_only_when_notified_and_never_change_after() {
    let Some(ip) =
        device_ip("covered_chunks_are_delivered_only_when_notified_and_never_change_after")
    else {
        return;
    };
    // iWARP has no immediate data: the covering notification is a CHUNK
    // SEND there.
    let imm = !iwarp();
    within(120, "covered chunks", async {
        let mut l = Listener::bind(SocketAddr::new(ip, 0), static_cfg())
            .await
            .expect("bind");
        let addr = l.local_addr();
        let accept = tokio::spawn(async move {
            let c = l.accept().await.expect("accept");
            (l, c)
        });
        let (mut p, _me) = raw_to(addr, |_| {}).await;
        let (_l, c) = accept.await.unwrap();
        let (mut tx, mut rx) = c.split();
        let h = p.peer_hello();
        assert_ne!(
            h.flags & wire::HELLO_FLAG_COVERS,
            0,
            "the listener offers covering notifications"
        );
        let full = h.rdv_bytes as usize; // both sides' buffers: static_cfg's
        let first = pattern(1, full);
        let tail = pattern(2, 10);

        // A chunk WRITTEN into buffer 0 without a notification: nothing is
        // delivered.
        let st = p
            .write(&first, buffer_addr(&h, 0), h.rdv_rkey)
            .await
            .unwrap();
        assert!(st.ok(), "silent chunk: {st:?}");
        let early = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await;
        assert!(
            early.is_err(),
            "delivered before any notification: {early:?}"
        );

        // The covering notification: buffer 1 holds the last 10 bytes and
        // covers buffer 0.
        let st = if imm {
            p.write_with_imm(
                &tail,
                buffer_addr(&h, 1),
                h.rdv_rkey,
                wire::chunk_imm(1, 1, true),
            )
            .await
            .unwrap()
        } else {
            let st = p
                .write(&tail, buffer_addr(&h, 1), h.rdv_rkey)
                .await
                .unwrap();
            assert!(st.ok(), "last chunk: {st:?}");
            let total = (full + tail.len()) as u64;
            p.send_header(Kind::Chunk, |c| {
                chunk(&h, 1, tail.len() as u32, total, true)(c);
                c.covered = 1;
            })
            .await
            .unwrap()
        };
        assert!(st.ok(), "covering notification: {st:?}");
        let got = rx.recv().await.expect("recv").expect("a message");
        let mut want = first.to_vec();
        want.extend_from_slice(&tail);
        assert!(got[..] == want[..], "the covered message, in order");

        // The peer writes over both buffers again: the message held is
        // unchanged.
        for i in 0..2 {
            let st = p
                .write(&pattern(9, full), buffer_addr(&h, i), h.rdv_rkey)
                .await
                .unwrap();
            assert!(st.ok(), "rewrite of buffer {i}: {st:?}");
        }
        assert!(
            got[..] == want[..],
            "a later WRITE changed a delivered message"
        );

        // Chunks WRITTEN and never notified, then an eager message: only the
        // eager message is delivered, and the connection answers.
        let st = p
            .write(&pattern(4, full), buffer_addr(&h, 2), h.rdv_rkey)
            .await
            .unwrap();
        assert!(st.ok(), "{st:?}");
        let st = p.send_raw(&eager(b"after silence")).await.unwrap();
        assert!(st.ok(), "{st:?}");
        let got = rx.recv().await.expect("recv").expect("the eager message");
        assert_eq!(&got[..], b"after silence");
        tx.send(bytes::Bytes::from_static(b"still here"))
            .await
            .expect("send");
        let m = recv_kind(&mut p, Kind::Eager, "the listener's answer").await;
        assert_eq!(&m[HDR_LEN..], b"still here");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn the_nic_refuses_writes_outside_the_advertised_region() {
    let Some(ip) = device_ip("the_nic_refuses_writes_outside_the_advertised_region") else {
        return;
    };
    within(120, "writes outside the region", async {
        let server = EchoServer::start(ip, static_cfg()).await;
        let cases = ["straddling the end", "just before the start", "forged rkey"];
        let mut peers = vec![];
        for case in cases {
            let (mut p, me) = raw(&server, |_| {}).await;
            let h = p.peer_hello();
            let end = buffer_addr(&h, h.rdv_count);
            let (addr, rkey) = match case {
                "straddling the end" => (end - 8, h.rdv_rkey),
                "just before the start" => (h.rdv_addr - 16, h.rdv_rkey),
                _ => (h.rdv_addr, h.rdv_rkey ^ 0x5a5a_0000),
            };
            let st = p.write(&[0xEE; 16], addr, rkey).await.unwrap();
            println!("WRITE {case} ({addr:#x}, rkey {rkey:#x}): {}", st.text);
            // The listener's side of that QP is dead too: it must end with an
            // error, never as a clean close.
            expect_refused(&server, &mut p, me, &st, case).await;
            // Each case was its own connection.
            peers.push(me);
            server.assert_accepted(&peers, case);
        }
        server.others_still_work("writes outside the region").await;
    })
    .await;
}

/// Memory on demand (§5.5): a listener that advertised no region has none
/// a peer can write. A CHUNK naming a buffer before any grant is a
/// violation; a WRITE with the hello's zero address and rkey is refused by
/// the NIC; the echo service keeps working for everyone else, and for
/// large messages (REQUEST, GRANT, then rendezvous).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn on_demand_region_is_never_writable_ungranted() {
    let Some(ip) = device_ip("on_demand_region_is_never_writable_ungranted") else {
        return;
    };
    within(120, "ungranted region", async {
        // The refused WRITE is found at the listener's next keepalive with
        // a shared receive queue (§4.7; see granted_windows_...): 1 s here.
        let cfg = Config {
            keepalive: Duration::from_secs(1),
            ..Config::default()
        };
        let server = EchoServer::start(ip, cfg).await;
        let (mut p, me) = raw(&server, |_| {}).await;
        let h = p.peer_hello();
        assert_ne!(
            h.flags & wire::HELLO_FLAG_ON_DEMAND,
            0,
            "on demand by default"
        );
        assert_eq!((h.rdv_addr, h.rdv_rkey), (0, 0), "no region in the hello");
        let st = p
            .send_header(Kind::Chunk, chunk(&h, 0, 100, 100, true))
            .await
            .unwrap();
        assert!(st.ok(), "{st:?}");
        server
            .expect_violation(me, "chunk before any grant", |v| {
                matches!(v, PeerMisbehaved::ChunkBufferNotGranted { .. })
            })
            .await;
        let (mut p, me) = raw(&server, |_| {}).await;
        let st = p.write(&[0xEE; 16], 0, 0).await.unwrap();
        println!(
            "WRITE to the zero address and rkey of an on-demand hello: {}",
            st.text
        );
        expect_refused(&server, &mut p, me, &st, "write without a grant").await;
        server.others_still_work("ungranted region").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn rkeys_work_only_on_their_own_live_connection() {
    let Some(ip) = device_ip("rkeys_work_only_on_their_own_live_connection") else {
        return;
    };
    within(120, "rkey isolation", async {
        let server = EchoServer::start(ip, static_cfg()).await;
        // A: the victim. It learns its region (address + rkey) from the
        // listener; the attacker is assumed to know them too. A puts a
        // message into its buffer 0 but does not announce it yet.
        let (mut a, a_addr) = raw(&server, |_| {}).await;
        let ha = a.peer_hello();
        let msg = pattern(99, 4096);
        let st = a.write(&msg, ha.rdv_addr, ha.rdv_rkey).await.unwrap();
        assert!(st.ok(), "{st:?}");
        // B, another connection to the same listener, writes over it with
        // A's address and rkey.
        let (mut b, b_addr) = raw(&server, |_| {}).await;
        let st = b
            .write(&[0xEE; 64], ha.rdv_addr, ha.rdv_rkey)
            .await
            .unwrap();
        println!("B writes into A's buffer 0 with A's rkey: {}", st.text);
        expect_refused(&server, &mut b, b_addr, &st, "B with A's rkey").await;
        // Now A announces its message: it must echo back exactly as A wrote
        // it (had B's WRITE landed, it would start with 64 bytes of 0xEE).
        let st = a
            .send_header(Kind::Chunk, chunk(&ha, 0, 4096, 4096, true))
            .await
            .unwrap();
        assert!(st.ok(), "{st:?}");
        // The listener returns buffer 0 (a CREDIT message), then echoes.
        let echo = recv_kind(&mut a, Kind::Eager, "echo of A's message").await;
        assert!(
            echo[HDR_LEN..] == msg[..],
            "A's data intact after B's attempt"
        );
        println!("A's 4 KiB message echoed back intact");
        // A closes; then C, a new connection, tries A's (now dead) rkey.
        drop(a);
        let ended = server.outcome(a_addr).await;
        println!("A ended: {ended:?}");
        // Let the listener finish A's teardown (QP destroyed, region deregistered).
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (mut c, c_addr) = raw(&server, |_| {}).await;
        let st = c
            .write(&[0xEE; 64], ha.rdv_addr, ha.rdv_rkey)
            .await
            .unwrap();
        println!("C writes with closed A's rkey: {}", st.text);
        expect_refused(&server, &mut c, c_addr, &st, "C with closed A's rkey").await;
        server.others_still_work("rkey isolation").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn a_peer_that_never_returns_credits_gets_no_more_sends() {
    let Some(ip) = device_ip("a_peer_that_never_returns_credits_gets_no_more_sends") else {
        return;
    };
    within(120, "credit starvation", async {
        let server = EchoServer::start(ip, static_cfg()).await;
        let credits = 4u16;
        let (mut p, me) = raw(&server, |h| h.credits = credits as u32).await;
        // 20 eager messages, returning none of the listener's credits.
        for i in 0..20u8 {
            assert!(p.send_raw(&eager(&[i; 100])).await.unwrap().ok());
        }
        let mut got = vec![];
        while let Some(m) = p.recv(Duration::from_secs(2)).await.unwrap() {
            got.push(Header::decode(&m).unwrap().kind);
        }
        println!(
            "listener sent {} SENDs on {credits} credits: {got:?}",
            got.len()
        );
        assert!(!got.is_empty(), "the listener used its credits");
        assert!(
            got.len() <= credits as usize,
            "the listener sent {} SENDs on {credits} credits",
            got.len()
        );
        // §4.3: the last credit is reserved for credit returns, never data.
        let data = got.iter().filter(|k| **k == Kind::Eager).count();
        assert!(data < credits as usize, "{data} data SENDs");
        assert!(
            server.outcomes.lock().unwrap().get(&me).is_none(),
            "the listener waits; it does not drop a slow peer"
        );
        server.others_still_work("credit starvation").await;
        // Returning exactly the credits it used lets the echoes flow again
        // (no deadlock; returning more would itself be a violation).
        let mut consumed = got.len() as u16;
        let mut echoed = data;
        for _ in 0..40 {
            if echoed == 20 {
                break;
            }
            let st = p
                .send_header(Kind::Credit, |c| c.credit_return = consumed)
                .await
                .unwrap();
            assert!(st.ok(), "{st:?}");
            consumed = 0;
            while let Some(m) = p.recv(Duration::from_millis(500)).await.unwrap() {
                consumed += 1;
                if Header::decode(&m).unwrap().kind == Kind::Eager {
                    echoed += 1;
                }
            }
            assert!(consumed <= credits, "{consumed} SENDs on {credits} credits");
        }
        assert_eq!(echoed, 20, "all 20 echoes arrive once credits come back");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn a_lying_hello_is_refused_or_fails_only_that_connection() {
    let Some(ip) = device_ip("a_lying_hello_is_refused_or_fails_only_that_connection") else {
        return;
    };
    within(120, "lying hello", async {
        let server = EchoServer::start(ip, static_cfg()).await;
        // An out-of-range hello is refused at connect time (§2.2).
        let r = RawPeer::connect(server.addr, &static_cfg(), |h| h.credits = 1_000_000).await;
        let e = r.expect_err("a hello claiming 10^6 credits must be refused");
        println!("hello with 10^6 credits: {e}");
        assert!(matches!(e, Error::Rejected { .. }), "{e:?}");
        for _ in 0..500 {
            if !server.rejected.lock().unwrap().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let rej = server.rejected.lock().unwrap().clone();
        assert!(
            matches!(
                rej.as_slice(),
                [Error::Protocol(PeerMisbehaved::HelloFieldRange {
                    field: "credits",
                    value: 1_000_000,
                    min: 4,
                    max: 4096
                })]
            ),
            "{rej:?}"
        );
        // A well-formed hello advertising a region the peer does not own:
        // the listener's rendezvous WRITE of an 8 KiB echo is refused by the
        // peer's NIC, and only that connection fails.
        let (mut p, me) = raw(&server, |h| h.rdv_rkey ^= 0x5a5a_0000).await;
        let h = p.peer_hello();
        let msg = pattern(5, 8192);
        for (i, part) in msg.chunks(4096).enumerate() {
            let st = p
                .write(part, buffer_addr(&h, i as u32), h.rdv_rkey)
                .await
                .unwrap();
            assert!(st.ok(), "{st:?}");
            let st = p
                .send_header(Kind::Chunk, chunk(&h, i as u32, 4096, 8192, i == 1))
                .await
                .unwrap();
            assert!(st.ok(), "{st:?}");
        }
        match server.outcome(me).await {
            // iWARP: the WRITE completed locally; our NIC's TERMINATE ended
            // the connection (siw reports it as a failed later operation).
            Outcome::Failed(e) if iwarp() => {
                println!("listener's WRITE into the forged region (iWARP): connection ended: {e}")
            }
            Outcome::Failed(e @ Error::Completion { .. }) => {
                println!("listener's WRITE into the forged region: {e}");
                assert!(e.to_string().contains("access"), "{e}");
            }
            o => panic!("expected the listener's WRITE to fail, got {o:?}"),
        }
        assert!(
            p.wait_disconnected(Duration::from_secs(10)).await.unwrap(),
            "the lying peer is disconnected"
        );
        server.others_still_work("lying hello").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn a_silently_dead_peer_is_found_by_keepalive() {
    let Some(ip) = device_ip("a_silently_dead_peer_is_found_by_keepalive") else {
        return;
    };
    if iwarp() {
        // siw closes a QP's TCP connection when the QP is destroyed, so the
        // listener is told at once: a raw peer cannot play a silent host.
        println!(
            "SKIP a_silently_dead_peer_is_found_by_keepalive: on iWARP a destroyed QP \
             closes its TCP connection (not silent); RoCE runs it"
        );
        return;
    }
    within(120, "silent peer", async {
        // Two listeners, one with a 500 ms keepalive and one without; a peer
        // on each goes silent at the same moment.
        let with = |ka| Config {
            keepalive: ka,
            ..static_cfg()
        };
        let server = EchoServer::start(ip, with(Duration::from_millis(500))).await;
        let control = EchoServer::start(ip, with(Duration::ZERO)).await;
        let mut peers = vec![];
        for s in [&server, &control] {
            let (mut p, me) = raw(s, |_| {}).await;
            // One honest round trip, then the peer's host "dies": no DREQ,
            // no more ACKs.
            assert!(p.send_raw(&eager(&[0; 10])).await.unwrap().ok());
            // The listener's answer to our first message (a CREDIT), then the echo.
            let echo = loop {
                let m = p
                    .recv(Duration::from_secs(10))
                    .await
                    .unwrap()
                    .expect("echo");
                if Header::decode(&m).unwrap().kind != Kind::Credit {
                    break m;
                }
            };
            assert_eq!(Header::decode(&echo).unwrap().kind, Kind::Eager);
            peers.push((p, me));
        }
        for (p, _) in &mut peers {
            p.go_silent();
        }
        let t = std::time::Instant::now();
        let ended = server
            .outcome_within(peers[0].1, Duration::from_secs(90))
            .await;
        println!(
            "silent peer: listener's connection ended after {:.1} s: {ended:?}",
            t.elapsed().as_secs_f64()
        );
        assert!(
            matches!(
                ended,
                Outcome::Failed(Error::Completion { .. } | Error::Disconnected)
            ),
            "{ended:?}"
        );
        // Without keepalive nothing is ever sent on the idle connection, so
        // the other listener still holds it (and its registered memory).
        assert!(
            control.outcomes.lock().unwrap().get(&peers[1].1).is_none(),
            "without keepalive the silent peer goes unnoticed"
        );
        println!("without keepalive: still connected after the same time");
        server.others_still_work("silent peer").await;
    })
    .await;
}

/// One-sided access (§10): how a wrong key ends.
mod one_sided {
    use std::time::{Duration, Instant};

    use bytes::{Bytes, BytesMut};
    use rdma_transport::engine::wire::HELLO_FLAG_REMOTE;
    use rdma_transport::testing::RawPeer;
    use rdma_transport::{
        Config, Connection, Error, Exposable, RegionKey, RemoteAccess, RemoteError,
    };

    use crate::common::{device_ip, kept_pair, pattern};

    fn refused(r: Result<impl std::fmt::Debug, Error>, what: &str) {
        match r {
            Err(Error::Remote(RemoteError::Refused { status })) => {
                println!("{what}: refused by the NIC ({status})")
            }
            r => panic!("{what}: expected RemoteError::Refused, got {r:?}"),
        }
    }

    /// The main connection still carries messages both ways.
    async fn messages_flow(c: Connection, s: Connection, what: &str) {
        let (mut ctx, mut crx) = c.split();
        let (mut stx, mut srx) = s.split();
        ctx.send(Bytes::from(what.to_string())).await.expect("send");
        let m = srx.recv().await.expect("recv").expect("message");
        assert_eq!(&m[..], what.as_bytes(), "{what}");
        stx.send(Bytes::from_static(b"back"))
            .await
            .expect("send back");
        let m = crx.recv().await.expect("recv back").expect("message back");
        assert_eq!(&m[..], b"back", "{what}");
    }

    /// A key replayed after its exposure was revoked is refused by the
    /// peer's NIC (`Refused`); afterwards another exposure still reads fine
    /// (a fresh side queue pair), from both sides, and the connection's
    /// messages still flow.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
    async fn a_revoked_key_is_refused_and_nothing_else_suffers() {
        let Some(ip) = device_ip("a_revoked_key_is_refused_and_nothing_else_suffers") else {
            return;
        };
        let cfg = Config::default();
        tokio::time::timeout(Duration::from_secs(120), async {
            let (c, s, _l) = kept_pair(ip, &cfg).await;
            let (a, p) = (c.remote_memory(), s.remote_memory());
            let d1 = pattern(1, 4096);
            let d2 = pattern(2, 8192);
            let e1 = p
                .expose(Exposable::Shared(d1.clone()), RemoteAccess::Read)
                .await
                .unwrap();
            let e2 = p
                .expose(Exposable::Shared(d2.clone()), RemoteAccess::Read)
                .await
                .unwrap();
            let k1 = e1.key();
            assert!(a.read(&k1, 0, 4096).await.expect("live key") == d1);
            e1.revoke();
            refused(a.read(&k1, 0, 4096).await, "read with a revoked key");
            assert!(a.read(&e2.key(), 0, 8192).await.expect("other key") == d2);
            // A writable exposure of A's, written by P after the failure
            // (P waits for the side queue pair A reopens).
            let ea = a
                .expose(Exposable::Owned(BytesMut::zeroed(64)), RemoteAccess::Write)
                .await
                .unwrap();
            p.write(&ea.key(), 0, Bytes::from_static(b"still works"))
                .await
                .expect("P writes after A's failure");
            let Exposable::Owned(b) = ea.revoke() else {
                panic!("owned")
            };
            assert_eq!(&b[..11], b"still works");
            // A revoked write key too: refused, from P's side.
            let ew = a
                .expose(Exposable::Owned(BytesMut::zeroed(64)), RemoteAccess::Write)
                .await
                .unwrap();
            let kw = ew.key();
            drop(ew);
            refused(
                p.write(&kw, 0, Bytes::from_static(b"late")).await,
                "write with a dropped exposure's key",
            );
            assert!(a.read(&e2.key(), 0, 8192).await.expect("after both") == d2);
            messages_flow(c, s, "messages after refused keys").await;
        })
        .await
        .expect("timeout");
    }

    /// A key is valid only on the connection it was issued for: another
    /// connection to the same listener (its own exposure PD) is refused by
    /// the NIC, and both connections keep working.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
    async fn a_key_works_only_on_its_own_connection() {
        let Some(ip) = device_ip("a_key_works_only_on_its_own_connection") else {
            return;
        };
        let cfg = Config::default();
        tokio::time::timeout(Duration::from_secs(120), async {
            let (c1, s1, mut l) = kept_pair(ip, &cfg).await;
            let (c2, s2) = tokio::join!(rdma_transport::connect(l.local_addr(), &cfg), l.accept());
            let (c2, s2) = (c2.expect("connect 2"), s2.expect("accept 2"));
            let (a1, p1) = (c1.remote_memory(), s1.remote_memory());
            let (a2, p2) = (c2.remote_memory(), s2.remote_memory());
            let d = pattern(3, 4096);
            let e = p1
                .expose(Exposable::Shared(d.clone()), RemoteAccess::Read)
                .await
                .unwrap();
            // Open connection 2's side queue pair with a legitimate read.
            let e2 = p2
                .expose(Exposable::Shared(pattern(4, 64)), RemoteAccess::Read)
                .await
                .unwrap();
            assert!(a2.read(&e2.key(), 0, 64).await.unwrap() == pattern(4, 64));
            refused(a2.read(&e.key(), 0, 4096).await, "another connection's key");
            assert!(a1.read(&e.key(), 0, 4096).await.expect("own connection") == d);
            // And the other way: a writable exposure of A1's, written by P2.
            let ew = a1
                .expose(Exposable::Owned(BytesMut::zeroed(128)), RemoteAccess::Write)
                .await
                .unwrap();
            refused(
                p2.write(&ew.key(), 0, Bytes::from_static(b"foreign")).await,
                "write with another connection's key",
            );
            p1.write(&ew.key(), 0, Bytes::from_static(b"own"))
                .await
                .expect("own connection writes");
            let Exposable::Owned(b) = ew.revoke() else {
                panic!("owned")
            };
            assert_eq!(&b[..3], b"own");
            assert!(
                b[3..].iter().all(|&x| x == 0),
                "nothing of the foreign write"
            );
            assert!(a2.read(&e2.key(), 0, 64).await.expect("2 still reads") == pattern(4, 64));
            messages_flow(c1, s1, "connection 1 after a foreign key").await;
            messages_flow(c2, s2, "connection 2 after a foreign key").await;
        })
        .await
        .expect("timeout");
    }

    /// Out of range and a write to a read-only region are refused locally,
    /// typed, before anything is posted; with the local check bypassed by a
    /// forged key (a larger `len`, another access) the peer's NIC refuses,
    /// and the connection still works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
    async fn out_of_range_and_read_only_are_refused_locally_and_by_the_nic() {
        let Some(ip) = device_ip("out_of_range_and_read_only_are_refused_locally_and_by_the_nic")
        else {
            return;
        };
        let cfg = Config::default();
        tokio::time::timeout(Duration::from_secs(120), async {
            let (c, s, _l) = kept_pair(ip, &cfg).await;
            let (a, p) = (c.remote_memory(), s.remote_memory());
            let d = pattern(5, 4096);
            let e = p
                .expose(Exposable::Owned(BytesMut::from(&d[..])), RemoteAccess::Read)
                .await
                .unwrap();
            let key = e.key();
            match a.read(&key, 4000, 100).await {
                Err(Error::Remote(RemoteError::OutOfRange {
                    offset: 4000,
                    len: 100,
                    region_len: 4096,
                })) => {}
                r => panic!("out of range: {r:?}"),
            }
            match a.write(&key, 0, Bytes::from_static(b"no")).await {
                Err(Error::Remote(RemoteError::AccessDenied {
                    wanted: RemoteAccess::Write,
                    granted: RemoteAccess::Read,
                })) => {}
                r => panic!("read-only: {r:?}"),
            }
            // Forged: a longer region, then write access.
            let longer = RegionKey {
                len: 1 << 20,
                ..key
            };
            refused(a.read(&longer, 4096, 4096).await, "read beyond the region");
            assert!(a.read(&key, 0, 4096).await.expect("in range") == d);
            let writable = RegionKey {
                access: RemoteAccess::ReadWrite,
                ..key
            };
            refused(
                a.write(&writable, 0, Bytes::from_static(b"forged")).await,
                "write to a read-only region",
            );
            let Exposable::Owned(b) = e.revoke() else {
                panic!("owned")
            };
            assert!(b == d, "the read-only region is unchanged");
            messages_flow(c, s, "messages after forged keys").await;
        })
        .await
        .expect("timeout");
    }

    /// The exposing side drops its connection while the other reads: the
    /// reads end with an error, promptly, never hang.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
    async fn the_exposing_side_dropping_its_connection_mid_read_ends_the_reads() {
        let Some(ip) =
            device_ip("the_exposing_side_dropping_its_connection_mid_read_ends_the_reads")
        else {
            return;
        };
        let cfg = Config {
            connect_timeout: Duration::from_secs(5),
            ..Config::default()
        };
        tokio::time::timeout(Duration::from_secs(120), async {
            let (c, s, _l) = kept_pair(ip, &cfg).await;
            let (a, p) = (c.remote_memory(), s.remote_memory());
            let d = pattern(6, 1 << 20);
            let e = p
                .expose(Exposable::Shared(d.clone()), RemoteAccess::Read)
                .await
                .unwrap();
            let key = e.key();
            assert!(a.read(&key, 0, 1 << 20).await.unwrap() == d);
            let readers: Vec<_> = (0..4)
                .map(|_| {
                    let a = a.clone();
                    tokio::spawn(async move {
                        let mut ok = 0u32;
                        loop {
                            match a.read(&key, 0, 1 << 20).await {
                                Ok(b) => {
                                    assert!(b.len() == 1 << 20);
                                    ok += 1;
                                }
                                Err(e) => return (ok, e, Instant::now()),
                            }
                        }
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let t = Instant::now();
            drop(s);
            for r in readers {
                let (ok, e, at) = r.await.unwrap();
                println!(
                    "reader: {ok} reads, then {e} after {:?}",
                    at.saturating_duration_since(t)
                );
                assert!(
                    matches!(
                        e,
                        Error::Remote(
                            RemoteError::Closed
                                | RemoteError::Unavailable(_)
                                | RemoteError::Refused { .. }
                        )
                    ),
                    "{e:?}"
                );
                assert!(at.saturating_duration_since(t) < Duration::from_secs(30));
            }
            // The exposure outlived its connection; revoking still works.
            match e.revoke() {
                Exposable::Shared(b) => assert!(b == d),
                Exposable::Owned(_) => panic!("shared"),
            }
        })
        .await
        .expect("timeout: a read hung after the exposing side left");
    }

    /// A peer that does not offer one-sided access (a hello without the
    /// flag, as before it existed): the listener side's operations fail
    /// with `Unavailable`, the connection works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
    async fn a_peer_without_one_sided_access_gets_none() {
        let Some(ip) = device_ip("a_peer_without_one_sided_access_gets_none") else {
            return;
        };
        let cfg = Config::default();
        tokio::time::timeout(Duration::from_secs(60), async {
            let mut l =
                rdma_transport::Listener::bind(std::net::SocketAddr::new(ip, 0), cfg.clone())
                    .await
                    .unwrap();
            let addr = l.local_addr();
            let (raw, s) = tokio::join!(
                RawPeer::connect(addr, &cfg, |h| h.flags &= !HELLO_FLAG_REMOTE),
                l.accept()
            );
            let raw = raw.expect("raw connect");
            assert_eq!(
                raw.peer_hello().flags & HELLO_FLAG_REMOTE,
                0,
                "no REMOTE in the answer"
            );
            let s = s.expect("accept");
            let p = s.remote_memory();
            assert!(!p.is_available());
            let e = p
                .expose(
                    Exposable::Shared(Bytes::from_static(b"x")),
                    RemoteAccess::Read,
                )
                .await
                .expect_err("no one-sided access");
            match e {
                Error::Remote(RemoteError::Unavailable(why)) => {
                    assert!(why.contains("does not offer"), "{why}")
                }
                e => panic!("{e:?}"),
            }
        })
        .await
        .expect("timeout");
    }

    /// Side requests with a token the listener never gave (guessed, or
    /// forged) are rejected, typed, without disturbing the listener or its
    /// connections; a real connection's one-sided access keeps working.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
    async fn side_requests_with_an_unknown_token_are_rejected() {
        let Some(ip) = device_ip("side_requests_with_an_unknown_token_are_rejected") else {
            return;
        };
        let cfg = Config::default();
        tokio::time::timeout(Duration::from_secs(60), async {
            let (c, s, mut l) = kept_pair(ip, &cfg).await;
            let (a, p) = (c.remote_memory(), s.remote_memory());
            let d = pattern(9, 4096);
            let e = p
                .expose(Exposable::Shared(d.clone()), RemoteAccess::Read)
                .await
                .unwrap();
            assert!(a.read(&e.key(), 0, 4096).await.unwrap() == d);
            for token in [[0u8; 12], *b"guessed-tokn", [0xff; 12]] {
                match rdma_transport::testing::side_request(l.local_addr(), &cfg, token).await {
                    Err(Error::Rejected {
                        reason: Some(r), ..
                    }) => assert_eq!(r.to_string(), "unknown side token"),
                    r => panic!("an unknown side token: {r:?}"),
                }
            }
            // Nothing was reported as a connection, and everything works.
            assert!(
                tokio::time::timeout(Duration::from_millis(200), l.accept())
                    .await
                    .is_err(),
                "a side request is never reported by accept"
            );
            assert!(a.read(&e.key(), 0, 4096).await.unwrap() == d);
            messages_flow(c, s, "messages after forged side requests").await;
        })
        .await
        .expect("timeout");
    }

    /// Operations in flight on a side queue pair that a refused operation
    /// takes down are retried on a fresh one, transparently: every good
    /// READ and WRITE among them succeeds, only the bad one is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
    async fn operations_beside_a_refused_one_are_retried_transparently() {
        let Some(ip) = device_ip("operations_beside_a_refused_one_are_retried_transparently")
        else {
            return;
        };
        let cfg = Config::default();
        tokio::time::timeout(Duration::from_secs(120), async {
            let (c, s, _l) = kept_pair(ip, &cfg).await;
            let (a, p) = (c.remote_memory(), s.remote_memory());
            let d = pattern(11, 256 << 10);
            let good = p
                .expose(Exposable::Shared(d.clone()), RemoteAccess::Read)
                .await
                .unwrap();
            let sink = p
                .expose(
                    Exposable::Owned(BytesMut::zeroed(64 << 10)),
                    RemoteAccess::Write,
                )
                .await
                .unwrap();
            let gone = p
                .expose(Exposable::Shared(pattern(12, 4096)), RemoteAccess::Read)
                .await
                .unwrap();
            let (gk, sk, bad) = (good.key(), sink.key(), gone.key());
            drop(gone);
            assert!(a.read(&gk, 0, 64).await.unwrap() == d.slice(..64));
            let before = rdma_transport::global_stats();
            for round in 0..3 {
                let mut tasks = Vec::new();
                for i in 0..40u64 {
                    let ai = a.clone();
                    tasks.push(tokio::spawn(async move {
                        let off = (i * 5000) % ((256 << 10) - 65536);
                        if i % 4 == 3 {
                            let w = pattern(100 + i, 1024);
                            ai.write(&sk, (i % 64) * 1024, w).await.map(|_| None)
                        } else {
                            ai.read(&gk, off, 65536).await.map(|b| Some((off, b)))
                        }
                    }));
                    if i == 10 {
                        let ab = a.clone();
                        tasks.push(tokio::spawn(async move {
                            let r = ab.read(&bad, 0, 4096).await;
                            match r {
                                Err(Error::Remote(RemoteError::Refused { .. })) => Ok(None),
                                r => panic!("the revoked key: {r:?}"),
                            }
                        }));
                    }
                }
                let mut ok = 0;
                for t in tasks {
                    match t.await.unwrap() {
                        Ok(Some((off, b))) => {
                            let off = off as usize;
                            assert!(b == d.slice(off..off + 65536), "read at {off}");
                            ok += 1;
                        }
                        Ok(None) => ok += 1,
                        Err(e) => panic!("round {round}: a good operation failed: {e:?}"),
                    }
                }
                assert_eq!(ok, 41, "round {round}");
            }
            let after = rdma_transport::global_stats();
            let (retries, sides) = (
                after.one_sided_retries - before.one_sided_retries,
                after.side_queue_pairs - before.side_queue_pairs,
            );
            println!("3 rounds: {retries} operations retried, {sides} side queue pairs opened");
            // Each round's refused READ took a side queue pair down (and
            // was retried itself at least once on iWARP, where the NIC
            // reports it by a flush; on InfiniBand and RoCE its status
            // names it and it is not retried): the good operations in
            // flight beside it were retried, and succeeded.
            assert!(sides >= 3, "{sides} side queue pairs");
            let refused_retries = if crate::iwarp() { 3 } else { 0 };
            assert!(
                retries > refused_retries,
                "{retries} retries: no good operation was in flight"
            );
            let Exposable::Owned(b) = sink.revoke() else {
                panic!("owned")
            };
            for i in (3..40u64).step_by(4) {
                let at = ((i % 64) * 1024) as usize;
                assert!(b[at..at + 1024] == pattern(100 + i, 1024), "write {i}");
            }
            messages_flow(c, s, "messages after retried operations").await;
        })
        .await
        .expect("timeout");
    }
}

/// Wire §5.6: a peer that announces a body for reading and gives a key
/// and address it never exposed: the listener's READ fails at the NIC,
/// nothing is delivered, only that connection ends, and other clients
/// are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn an_announcement_of_a_body_never_exposed_ends_only_that_connection() {
    let Some(ip) = device_ip("an_announcement_of_a_body_never_exposed_ends_only_that_connection")
    else {
        return;
    };
    within(120, "forged read announcement", async {
        let case = "RDV_READ of memory never exposed";
        let server = EchoServer::start(ip, static_cfg()).await;
        let (mut p, me) = raw(&server, reads_only).await;
        let st = p
            .send_header(Kind::RdvRead, |h| {
                h.addr = 0x7000_0000;
                h.len = 0x1234_5678;
                h.total_len = 600 << 10;
                h.rdv_index = 1;
            })
            .await
            .unwrap();
        assert!(st.ok(), "{case}: {st:?}");
        // On iWARP the responder answers the bad READ with a TERMINATE,
        // which ends the connection: the READ's failure reads as the peer
        // gone.
        match server.outcome(me).await {
            Outcome::Failed(e @ Error::Completion { .. }) => {
                println!("{case}: the listener's READ failed: {e}")
            }
            Outcome::Failed(e @ Error::Disconnected) if iwarp() => {
                println!("{case}: iWARP: the listener's READ ended the connection: {e}")
            }
            o => panic!("{case}: expected the READ to fail, got {o:?}"),
        }
        // Nothing was echoed: the only message was never delivered.
        while let Some(m) = p.recv(Duration::from_millis(200)).await.unwrap() {
            let k = Header::decode(&m).unwrap().kind;
            assert!(
                !matches!(k, Kind::Eager | Kind::Chunk | Kind::RdvRead),
                "{case}: something was echoed: {k:?}"
            );
        }
        server.others_still_work(case).await;
    })
    .await;
}

/// The raw peer announces a body of `len` bytes (§5.6); the listener
/// reads it and echoes it, announced for reading in turn: that
/// announcement, and the body.
async fn read_echo(p: &mut RawPeer, seed: u64, len: usize, what: &str) -> (Header, bytes::Bytes) {
    let body = pattern(seed, len);
    let (st, _) = p.announce_read(&body).await.unwrap();
    assert!(st.ok(), "{what}: announcement: {st:?}");
    let m = recv_kind(p, Kind::RdvRead, "the echo's announcement").await;
    (Header::decode(&m).unwrap(), body)
}

/// Wire §5.6: a body the listener announces for reading is readable by
/// that peer alone, exactly as announced, and only until the peer's
/// RDV_DONE: a READ past its end or with another key is refused by the
/// NIC (ending that connection), a READ of it returns it intact, and the
/// same READ after RDV_DONE is refused. In a PD of the connection's own
/// (a static region) the body is an MR with remote read; in a device's
/// shared PD (memory on demand, rxe) a window bound to the connection's QP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn announced_bodies_are_readable_only_as_announced_and_until_done() {
    let Some(ip) = device_ip("announced_bodies_are_readable_only_as_announced_and_until_done")
    else {
        return;
    };
    within(240, "reads of announced bodies", async {
        for (what, cfg) in [("static", static_cfg()), ("on demand", Config::default())] {
            let server = EchoServer::start(ip, cfg).await;
            let len = 600 << 10;
            for (i, case) in ["past its end", "another key"].into_iter().enumerate() {
                let case = format!("{what}: a READ {case}");
                let (mut p, me) = raw(&server, reads_only).await;
                let (h, _) = read_echo(&mut p, i as u64, len, what).await;
                assert_eq!(h.total_len, len as u64);
                let (addr, rkey) = if i == 0 {
                    (h.addr + h.total_len - 8, h.len)
                } else {
                    (h.addr, h.len ^ 0x100)
                };
                let (st, got) = p.read(16, addr, rkey).await.unwrap();
                assert!(got.is_none() && !st.ok(), "{case}: READ succeeded: {st:?}");
                println!("{case}: refused: {st:?}");
                // The reader's QP is in the error state; the listener's
                // connection ends when it next hears (or fails to hear)
                // from it: here at once, by the reader's disconnect.
                drop(p);
                match server.outcome(me).await {
                    Outcome::Failed(e) => println!("{case}: listener side ended with: {e}"),
                    o => panic!("{case}: listener side ended {o:?}"),
                }
            }
            let case = format!("{what}: the announced READ, then the same after RDV_DONE");
            let (mut p, me) = raw(&server, reads_only).await;
            let (h, body) = read_echo(&mut p, 9, len, what).await;
            let (st, got) = p.read(len, h.addr, h.len).await.unwrap();
            assert!(st.ok(), "{case}: {st:?}");
            assert!(got.unwrap() == body, "{case}: the body read back differs");
            let st = p
                .send_header(Kind::RdvDone, |d| d.rdv_index = h.rdv_index)
                .await
                .unwrap();
            assert!(st.ok(), "{case}: RDV_DONE: {st:?}");
            // An echo after it: the listener has handled the RDV_DONE.
            let st = p.send_raw(&eager(b"after done")).await.unwrap();
            assert!(st.ok(), "{case}: {st:?}");
            let m = recv_kind(&mut p, Kind::Eager, "the echo after RDV_DONE").await;
            assert_eq!(&m[HDR_LEN..], b"after done");
            let (st, got) = p.read(16, h.addr, h.len).await.unwrap();
            assert!(
                got.is_none() && !st.ok(),
                "{case}: READ after RDV_DONE: {st:?}"
            );
            println!("{case}: refused after RDV_DONE: {st:?}");
            drop(p);
            match server.outcome(me).await {
                Outcome::Failed(e) => println!("{case}: listener side ended with: {e}"),
                o => panic!("{case}: listener side ended {o:?}"),
            }
            server.others_still_work(&case).await;
        }
    })
    .await;
}

/// A raw peer's hello that offers reading (§5.6) and no written
/// destinations (§5.7): the listener reads what it announces.
fn reads_only(h: &mut Hello) {
    h.flags = (h.flags | wire::HELLO_FLAG_READ) & !wire::HELLO_FLAG_WRITE_DEST;
}

/// The listener's destination for the announced `body` (§5.7): announces
/// it and waits for the RDV_DEST that grants it.
async fn announce_for_dest(p: &mut RawPeer, body: &bytes::Bytes, what: &str) -> (Header, u32) {
    let (st, x) = p.announce_read(body).await.unwrap();
    assert!(st.ok(), "{what}: announcement: {st:?}");
    let m = recv_kind(p, Kind::RdvDest, "the listener's destination").await;
    let h = Header::decode(&m).unwrap();
    assert_eq!(h.rdv_index, x.id, "{what}: granted for the body announced");
    assert_eq!(
        h.total_len,
        body.len() as u64,
        "{what}: exactly the body's length"
    );
    (h, x.id)
}

/// Wire §5.7: a destination the listener grants for a message is
/// writable by that peer alone, exactly as granted, and only until the
/// message is handed up: a WRITE past its end or with another key is
/// refused by the NIC (ending that connection); the honest WRITE and
/// RDV_WRITTEN deliver the message intact (the echo carries it back);
/// the same WRITE after that is refused (the window is gone), and what the
/// application holds does not change. A peer that is granted a
/// destination and never writes it gets nothing delivered and breaks
/// nothing else. On InfiniBand/RoCE only: iWARP (siw) has no windows, and
/// its listener reads instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn granted_destinations_are_writable_only_as_granted_and_until_delivered() {
    let Some(ip) =
        device_ip("granted_destinations_are_writable_only_as_granted_and_until_delivered")
    else {
        return;
    };
    if iwarp() {
        println!(
            "SKIPPED granted_destinations_are_writable_only_as_granted_and_until_delivered: \
             iWARP grants no destinations (no memory windows; wire §5.7)"
        );
        return;
    }
    let flags = wire::HELLO_FLAG_READ | wire::HELLO_FLAG_WRITE_DEST;
    within(240, "writes into granted destinations", async {
        // Memory on demand: the listener's buffers are in the device's
        // shared PD, where a window scopes a destination to one QP.
        let server = EchoServer::start(ip, Config::default()).await;
        let len = 600 << 10;
        let piece = 256 << 10;
        for (i, case) in ["past its end", "another key"].into_iter().enumerate() {
            let case = format!("a WRITE {case}");
            let (mut p, me) = raw(&server, |h| h.flags |= flags).await;
            let (h, _) = announce_for_dest(&mut p, &pattern(i as u64, len), &case).await;
            let (addr, rkey) = if i == 0 {
                (h.addr + h.total_len - 8, h.len)
            } else {
                (h.addr, h.len ^ 0x100)
            };
            let st = p.write(&[0xEE; 16], addr, rkey).await.unwrap();
            assert!(!st.ok(), "{case}: WRITE succeeded: {st:?}");
            println!("{case}: refused: {st:?}");
            drop(p);
            match server.outcome(me).await {
                Outcome::Failed(e) => println!("{case}: listener side ended with: {e}"),
                o => panic!("{case}: listener side ended {o:?}"),
            }
        }

        let case = "the granted WRITE, then the same after delivery";
        let (mut p, me) = raw(&server, |h| h.flags |= flags).await;
        let body = pattern(9, len);
        let (h, id) = announce_for_dest(&mut p, &body, case).await;
        for off in (0..len).step_by(piece) {
            let n = piece.min(len - off);
            let st = p
                .write(&body[off..off + n], h.addr + off as u64, h.len)
                .await
                .unwrap();
            assert!(st.ok(), "{case}: WRITE at {off}: {st:?}");
        }
        let st = p
            .send_header(Kind::RdvWritten, |d| d.rdv_index = id)
            .await
            .unwrap();
        assert!(st.ok(), "{case}: RDV_WRITTEN: {st:?}");
        let done = recv_kind(&mut p, Kind::RdvDone, "the listener's RDV_DONE").await;
        assert_eq!(Header::decode(&done).unwrap().rdv_index, id);
        // The echo: the listener's application got the message and sends it
        // back, announced for us to read.
        let m = recv_kind(&mut p, Kind::RdvRead, "the echo's announcement").await;
        let e = Header::decode(&m).unwrap();
        let (st, got) = p.read(len, e.addr, e.len).await.unwrap();
        assert!(st.ok(), "{case}: READ of the echo: {st:?}");
        assert!(
            got.unwrap() == body,
            "{case}: the echo differs from what was written"
        );
        let st = p.write(&[0xEE; 16], h.addr, h.len).await.unwrap();
        assert!(!st.ok(), "{case}: WRITE after delivery succeeded: {st:?}");
        println!("{case}: refused after delivery: {st:?}");
        // The echo the listener still holds (announced, exposed) is intact.
        drop(p);
        match server.outcome(me).await {
            Outcome::Failed(e) => println!("{case}: listener side ended with: {e}"),
            o => panic!("{case}: listener side ended {o:?}"),
        }

        let case = "granted, never written";
        let (mut p, _me) = raw(&server, |h| h.flags |= flags).await;
        let (_h, _) = announce_for_dest(&mut p, &pattern(11, len), case).await;
        let st = p.send_raw(&eager(b"behind it")).await.unwrap();
        assert!(st.ok(), "{case}: {st:?}");
        assert!(
            p.recv(Duration::from_secs(2))
                .await
                .unwrap()
                .is_none_or(|m| { Header::decode(&m).unwrap().kind != Kind::Eager }),
            "{case}: a message behind the unwritten one was delivered"
        );
        println!("{case}: nothing delivered, connection up");
        server.others_still_work(case).await;
        drop(p);
    })
    .await;
}

/// Wire §5.6: a peer that never answers RDV_DONE holds at most
/// `MAX_READS` bodies of the listener's: the listener announces that many
/// echoes and then waits (its connection stays up, nothing else is
/// exposed); one RDV_DONE lets the next echo through. The key a peer gets
/// for a body is read-only: a WRITE with it is refused by the NIC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
async fn a_peer_that_never_answers_holds_at_most_max_reads_bodies() {
    let Some(ip) = device_ip("a_peer_that_never_answers_holds_at_most_max_reads_bodies") else {
        return;
    };
    within(180, "a peer that never answers RDV_DONE", async {
        let case = "RDV_DONE never sent";
        let server = EchoServer::start(ip, static_cfg()).await;
        let (mut p, me) = raw(&server, reads_only).await;
        let len = 600 << 10;
        let max = wire::MAX_READS as u64;
        // One at a time (the listener answers each with RDV_DONE before it
        // echoes it): its echoes are announced, never answered.
        let mut announced = Vec::new();
        for i in 0..max {
            let (h, _) = read_echo(&mut p, i, len, case).await;
            announced.push(h);
        }
        let body = pattern(max, len);
        let (st, _) = p.announce_read(&body).await.unwrap();
        assert!(st.ok(), "{case}: {st:?}");
        // The listener read it (its RDV_DONE comes) but announces no echo.
        let mut kinds = Vec::new();
        while let Some(m) = p.recv(Duration::from_millis(500)).await.unwrap() {
            kinds.push(Header::decode(&m).unwrap().kind);
        }
        assert!(
            !kinds.contains(&Kind::RdvRead),
            "{case}: a {}th body announced while {max} were unanswered: {kinds:?}",
            max + 1
        );
        assert!(
            kinds.contains(&Kind::RdvDone),
            "{case}: the listener read ours: {kinds:?}"
        );
        // The key of an announced body allows no WRITE.
        let h0 = announced[0];
        // One RDV_DONE: the held echo is announced.
        let st = p
            .send_header(Kind::RdvDone, |d| d.rdv_index = h0.rdv_index)
            .await
            .unwrap();
        assert!(st.ok(), "{case}: {st:?}");
        let m = recv_kind(&mut p, Kind::RdvRead, "the echo after one RDV_DONE").await;
        let h = Header::decode(&m).unwrap();
        assert_eq!(h.total_len, len as u64);
        let (st, got) = p.read(len, h.addr, h.len).await.unwrap();
        assert!(
            st.ok() && got.unwrap() == body,
            "{case}: the held echo: {st:?}"
        );
        let st = p.write(&[0x5A; 64], h.addr, h.len).await.unwrap();
        expect_refused(
            &server,
            &mut p,
            me,
            &st,
            "a WRITE with a body's read-only key",
        )
        .await;
        server.others_still_work(case).await;
    })
    .await;
}
