//! Helpers shared by the reliability tests: device check, servers, channels,
//! process memory and device counters, child processes.
use rpc_core::{Channel, ServingHandle, Transport, TransportKind};
use rpc_examples::echo::EchoStats;
use rpc_examples::pb::echo::echo_client::EchoClient;
use rpc_tests::{device_required, rdma_ip, router, BIG_LIMIT};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The RDMA test address (`$SOFTROCE_IP`), or `None` after printing
/// `SKIP <test>: <reason>`; panics when a device is required but missing.
pub fn rdma_host(test: &str) -> Option<String> {
    let reason = match rdma_transport::devices() {
        Ok(d) if d.is_empty() => "no RDMA device on this host".to_string(),
        Err(e) => format!("listing RDMA devices failed: {e}"),
        Ok(_) => match rdma_ip() {
            Some(ip) => return Some(ip),
            None => "SOFTROCE_IP / RDMA_TEST_IP unset".to_string(),
        },
    };
    if device_required() {
        panic!("{test}: an RDMA device is required (SOFTROCE_IN_VM / RDMA_TEST_REQUIRE_DEVICE) but: {reason}");
    }
    println!("SKIP {test}: {reason}");
    None
}

/// Starts the test router (echo with 80 MiB limits) on `ip:port` (0 = any);
/// panics unless it has an RDMA listener.
pub async fn start_server(ip: &str, port: u16) -> (ServingHandle, Arc<EchoStats>) {
    let stats = Arc::new(EchoStats::default());
    let handle = router(stats.clone())
        .start(format!("{ip}:{port}").parse().expect("RDMA test IP parses"))
        .await
        .expect("server starts");
    assert!(handle.rdma_addr().is_some(), "server has an RDMA listener");
    (handle, stats)
}

/// A channel that only uses RDMA.
pub async fn rdma_channel(addr: &str) -> Channel {
    let ch = Channel::from_shared(addr.to_string())
        .unwrap()
        .transport(Transport::RdmaOnly)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("RDMA channel to {addr}: {e}"));
    assert_eq!(ch.transport().kind, TransportKind::Rdma);
    ch
}

/// An echo client that accepts the test's large messages.
pub fn echo(ch: &Channel) -> EchoClient<Channel> {
    EchoClient::new(ch.clone())
        .max_decoding_message_size(BIG_LIMIT)
        .max_encoding_message_size(BIG_LIMIT)
}

/// Deterministic pseudo-random bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    v
}

/// A field of `/proc/self/status` in KiB (`VmRSS`, `VmPin`, `VmHWM`...).
pub fn proc_status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    s.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(field)?.strip_prefix(':')?;
            rest.trim().trim_end_matches("kB").trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

/// Resident memory of this process, KiB.
pub fn rss_kib() -> u64 {
    proc_status_kib("VmRSS")
}

/// Pinned memory of this process, KiB: what `ibv_reg_mr` pinned (the kernel
/// accounts registered pages in `mm->pinned_vm`, shown as `VmPin`).
pub fn pinned_kib() -> u64 {
    proc_status_kib("VmPin")
}

/// The device's `hw_counters` (`/sys/class/infiniband/$SOFTROCE_DEV/ports/1/hw_counters`,
/// every RDMA device when `SOFTROCE_DEV` is unset); empty where there are none (siw).
pub fn hw_counters() -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let devs: Vec<String> = match std::env::var("SOFTROCE_DEV") {
        Ok(d) => vec![d],
        Err(_) => std::fs::read_dir("/sys/class/infiniband")
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default(),
    };
    for dev in devs {
        let dir = format!("/sys/class/infiniband/{dev}/ports/1/hw_counters");
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            if let Ok(v) = std::fs::read_to_string(e.path()) {
                if let Ok(n) = v.trim().parse() {
                    out.insert(format!("{dev}:{}", e.file_name().to_string_lossy()), n);
                }
            }
        }
    }
    out
}

/// Environment variable that selects a child role in this test binary.
pub const CHILD_ROLE_ENV: &str = "RELIABILITY_CHILD_ROLE";
/// Address argument of the child role.
pub const CHILD_ADDR_ENV: &str = "RELIABILITY_CHILD_ADDR";

/// This test binary re-executed as a child process running
/// `peer_killed::child_role` with `role`; killed (SIGKILL) when dropped.
pub struct ChildProc {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
}

impl ChildProc {
    pub fn spawn(role: &str, addr: &str) -> ChildProc {
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = Command::new(exe)
            .args([
                "--ignored",
                "--exact",
                "peer_killed::child_role",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ROLE_ENV, role)
            .env(CHILD_ADDR_ENV, addr)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child process");
        let stdout = child.stdout.take().expect("child stdout");
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.contains("CHILD") {
                    println!("  child: {line}");
                }
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ChildProc { child, lines }
    }

    /// Waits for a stdout line starting with `prefix`; returns the rest.
    pub async fn wait_line(&mut self, prefix: &str, limit: Duration) -> String {
        let work = async {
            while let Some(l) = self.lines.recv().await {
                // libtest prints "test <name> ... " before the child's first line.
                if let Some(at) = l.find(prefix) {
                    return l[at + prefix.len()..].trim().to_string();
                }
            }
            panic!("child exited before printing {prefix:?}");
        };
        tokio::time::timeout(limit, work)
            .await
            .unwrap_or_else(|_| panic!("child did not print {prefix:?} within {limit:?}"))
    }

    /// SIGKILL (`Child::kill`) and reap.
    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL the child");
        let status = self.child.wait().expect("reap the child");
        println!("  child killed: {status}");
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a test body bounded by `limit`.
pub async fn bounded<F: std::future::Future<Output = ()>>(test: &str, limit: Duration, f: F) {
    let t0 = std::time::Instant::now();
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| panic!("{test} did not finish within {limit:?}"));
    println!("{test}: done in {:.1?}", t0.elapsed());
}

/// Median of durations.
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Live heap bytes of this process (allocated minus freed, counted by the
/// test binary's `stats_alloc` global allocator: the registered buffers of
/// rdma-transport are heap allocations too), so a leak shows up exactly,
/// whatever malloc keeps cached in its arenas (which `VmRSS` includes).
pub fn live_heap_bytes() -> i64 {
    let s = stats_alloc::INSTRUMENTED_SYSTEM.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}
