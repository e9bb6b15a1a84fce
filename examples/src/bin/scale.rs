//! Scale benchmark: how one server holds many RDMA connections.
//!
//! Two roles in one binary:
//!
//! * `scale server --addr IP:PORT` runs the echo server (rpc-core `Server`,
//!   RDMA listener plus HTTP/2 on TCP). It prints one JSON line when it is
//!   up (`{"ready":true,...}`), then answers each `stats` line on its stdin
//!   with one JSON line of its own figures: registered bytes
//!   (`rdma_transport::registered_bytes()` of this process), RSS and peak RSS
//!   (/proc/self/status), threads and open fds. `quit` or end of input stops it.
//! * `scale client --addr IP:0 --steps 10,100,1000,2000` starts that server as
//!   a child process (unless `--server-addr` names a running one), then opens
//!   one `Channel` per connection with `Transport::RdmaOnly` (each its own
//!   RDMA connection, checked with `channel.transport()`), `--concurrency`
//!   handshakes at a time, up to each count in turn. At 1 connection and after
//!   each step it reports the connection setup rate, the server's and its own
//!   registered bytes and RSS, then runs background traffic (every connection
//!   makes a 64 B call every `--call-interval-ms`, jittered, for
//!   `--idle-secs`), then measures 64 B latency on one connection picked from
//!   the pool (one call in flight, the others idle) and 1 MiB request
//!   bandwidth on it (1 and 8 in flight), with ratios to the 1-connection
//!   figures of the same run. `--churn N` then opens and closes N more
//!   connections one after another (a 64 B and a 1 MiB call each) and
//!   prints cycles/s and memory registrations per cycle on both sides
//!   (`--no-device-pool` for the comparison without the device pool).
//!
//! The registered-memory cap is the transport's default
//! (`Config::global_max_registered_bytes`, 4 GiB) in both processes. The
//! spawned server raises `max_connections_per_address` (128 by default)
//! because every connection of this benchmark comes from the client's one
//! address; `--max-conns-per-address 0` keeps the default.
//!
//! A connection that cannot be opened (refused by the server, the cap, out
//! of file descriptors, the server process gone, host memory nearly
//! exhausted) ends the stepping: the steps done so far are still measured and
//! printed, the reason is printed, and the exit status is non-zero. So is it
//! when any call fails. No figure is checked against a threshold.
//!
//! ```text
//! scale client --addr $SOFTROCE_IP:0 --steps 10,100,1000,2000 --json scale.json
//! scale client --server-addr 192.168.77.1:50051 --steps 10,100
//! ```
//! Progress goes to stderr (the server's log lines too, prefixed `[server]`),
//! the markdown table to stdout.
#![forbid(unsafe_code)]

use clap::{Args as ClapArgs, Parser, Subcommand};
use hdrhistogram::Histogram;
use rpc_core::{Channel, Server, Transport, TransportKind};
use rpc_examples::echo::EchoService;
use rpc_examples::pb::echo::{echo_client::EchoClient, echo_server::EchoServer, EchoRequest};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Codec limit on both sides (1 MiB payloads plus framing, with room).
const MAX_MSG: usize = 64 << 20;
/// Request size of the small calls.
const SMALL: usize = 64;
/// Request size of the bandwidth calls.
const LARGE: usize = 1 << 20;

#[derive(Parser, Debug)]
#[command(about = "How one echo server scales to thousands of RDMA connections")]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// The echo server; answers `stats` lines on stdin with a JSON line.
    Server(ServerArgs),
    /// Opens connections in steps and measures (starts the server itself).
    Client(Box<ClientArgs>),
}

#[derive(ClapArgs, Debug)]
struct ServerArgs {
    /// Address to serve on (port 0 = any free port): an address of the RDMA
    /// device, e.g. $SOFTROCE_IP:0 in the Soft-RoCE VM.
    #[arg(long)]
    addr: SocketAddr,
    /// The RDMA listener's `max_connections_per_address` (0 = the
    /// transport's default, 128). All connections of this benchmark come
    /// from one address, so the default would stop it at 128.
    #[arg(long, default_value_t = 65536)]
    max_conns_per_address: usize,
    /// Tokio worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// `Config::device_pool: false`: every connection registers its own
    /// buffers in a PD of its own (for a comparison with the default).
    #[arg(long)]
    no_device_pool: bool,
}

#[derive(ClapArgs, Debug, Clone, Serialize)]
struct ClientArgs {
    /// Address for the server this process starts (port 0 = any free port).
    /// In the Soft-RoCE VM: $SOFTROCE_IP:0.
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    /// Use this running server (`host:port`) instead of starting one; its
    /// process figures (registered bytes, RSS) are then not available.
    #[arg(long)]
    server_addr: Option<String>,
    /// Connection counts to reach, in increasing order (1 is measured first
    /// in any case, as the reference of the ratios).
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,2000")]
    steps: Vec<usize>,
    /// Connection handshakes in progress at once. Each waits for the others'
    /// CPU time: on a slow machine (the emulated Soft-RoCE VM) 32 at once take
    /// longer than the transport's 5 s handshake timeout; use 8 there.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Background traffic: each connection makes one 64 B call this often
    /// (each interval jittered uniformly over 0.5x..1.5x; the first call at a
    /// random offset within one interval).
    #[arg(long, default_value_t = 3000)]
    call_interval_ms: u64,
    /// Length of the background traffic phase per step (default: one
    /// interval, so every connection makes at least one call).
    #[arg(long)]
    idle_secs: Option<f64>,
    /// 64 B calls (one in flight) for the latency figures, per step.
    #[arg(long, default_value_t = 2000)]
    lat_iters: u64,
    /// Warm-up before the 1-connection figures, the reference of the ratios:
    /// this many 64 B calls, and a hundredth as many 1 MiB calls before each
    /// bandwidth figure (under emulation code runs slowly until translated).
    /// The other steps warm up with a tenth of --lat-iters (at most 50) and
    /// one 1 MiB call.
    #[arg(long, default_value_t = 1000)]
    first_warmup: u64,
    /// 1 MiB calls per bandwidth figure.
    #[arg(long, default_value_t = 20)]
    bw_iters: u64,
    /// Calls in flight for the bandwidth figures (on the one connection).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    bw_inflight: Vec<usize>,
    /// Bandwidth figures per step, each of --bw-iters calls, the --bw-inflight
    /// values interleaved; the table shows their median and range (single
    /// figures of one cell move by ±25 % in the emulated VM).
    #[arg(long, default_value_t = 1)]
    bw_rounds: usize,
    /// After the last step, close every connection but the first (the one the
    /// 1-connection figures ran on) and measure again: a control for drift
    /// over the run, and registered memory back at one connection's.
    #[arg(long)]
    return_to_one: bool,
    /// A call without a reply after this long counts as failed.
    #[arg(long, default_value_t = 30_000)]
    call_timeout_ms: u64,
    /// Stop opening connections when the host's MemAvailable falls below
    /// this (MiB), rather than run into the OOM killer (0 = never).
    #[arg(long, default_value_t = 512)]
    min_mem_available_mib: u64,
    /// Passed to the server this process starts (see `scale server --help`).
    #[arg(long, default_value_t = 65536)]
    max_conns_per_address: usize,
    /// `Config::device_pool: false` in this process and the server it
    /// starts: every connection registers its own buffers in a PD of its
    /// own (for a comparison with the default).
    #[arg(long)]
    no_device_pool: bool,
    /// After the steps: this many connection cycles, one after another
    /// (open, one 64 B call, one 1 MiB call, close), with the first
    /// connection kept open; prints cycles/s and memory registrations per
    /// cycle on each side (0 = none).
    #[arg(long, default_value_t = 0)]
    churn: usize,
    /// Tokio worker threads of this process and of the server it starts.
    #[arg(long)]
    threads: Option<usize>,
    /// Also write the table (markdown) to this file.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Also write every figure as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() {
    let cli = Cli::parse();
    let threads = match &cli.role {
        Role::Server(a) => a.threads,
        Role::Client(a) => a.threads,
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Some(n) = threads {
        rt.worker_threads(n.max(1));
    }
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("scale: cannot start the runtime: {e}");
            std::process::exit(2);
        }
    };
    let r = match cli.role {
        Role::Server(a) => rt.block_on(server_main(a)),
        Role::Client(a) => rt.block_on(client_main(*a)),
    };
    if let Err(e) = r {
        eprintln!("scale: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------- process figures

/// Figures of one process, from itself.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ProcFigures {
    /// `rdma_transport::registered_bytes()`.
    registered_bytes: u64,
    /// VmRSS.
    rss_bytes: u64,
    /// VmHWM (peak RSS).
    rss_peak_bytes: u64,
    threads: u64,
    fds: u64,
    /// Connections established so far, and how many of them take their
    /// receive buffers from a listener's shared receive queue (wire
    /// protocol §4.7; the server's, on a device with SRQs and windows).
    #[serde(default)]
    connections_total: u64,
    #[serde(default)]
    shared_receive_connections: u64,
    /// Memory regions registered so far (`ibv_reg_mr` calls), blocks taken
    /// from the device pool instead, and the bytes the pool keeps idle.
    #[serde(default)]
    memory_registrations: u64,
    #[serde(default)]
    pool_reuses: u64,
    #[serde(default)]
    pool_idle_bytes: u64,
}

/// A `kB` field of /proc/self/status, in bytes.
fn status_bytes(status: &str, key: &str) -> u64 {
    status_field(status, key) * 1024
}

fn status_field(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim_start_matches(':').split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn proc_figures() -> ProcFigures {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    ProcFigures {
        registered_bytes: rdma_transport::registered_bytes() as u64,
        rss_bytes: status_bytes(&status, "VmRSS"),
        rss_peak_bytes: status_bytes(&status, "VmHWM"),
        threads: status_field(&status, "Threads"),
        fds: std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64),
        connections_total: rdma_transport::global_stats().connections,
        shared_receive_connections: rdma_transport::global_stats().shared_receive_connections,
        memory_registrations: rdma_transport::global_stats().memory_registrations,
        pool_reuses: rdma_transport::global_stats().pool_reuses,
        pool_idle_bytes: rdma_transport::pool_idle_bytes() as u64,
    }
}

/// The soft and hard limits on open files (/proc/self/limits).
fn fd_limits() -> (String, String) {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let mut it = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .unwrap_or("? ?")
        .split_whitespace();
    let soft = it.next().unwrap_or("?").to_string();
    let hard = it.next().unwrap_or("?").to_string();
    (soft, hard)
}

/// MemAvailable of the host (or VM), in bytes.
fn mem_available() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let v = status_bytes(&m, "MemAvailable");
    (v > 0).then_some(v)
}

// ---------------------------------------------------------------- server role

/// The server's first stdout line.
#[derive(Debug, Serialize, Deserialize)]
struct Ready {
    ready: bool,
    addr: String,
    rdma_addr: Option<String>,
    pid: u32,
    max_connections_per_address: usize,
    global_max_registered_bytes: u64,
}

async fn server_main(a: ServerArgs) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();

    let mut builder = Server::builder();
    let mut per_address = rdma_transport::Config::default().max_connections_per_address;
    if a.max_conns_per_address > 0 || a.no_device_pool {
        // rpc-core's own RDMA settings (rpc_core::rdma::transport_config:
        // the transport's defaults with the call layer's frame limit) with
        // only the per-address connection limit raised (and the device pool
        // off if asked). The registered-memory cap stays the default.
        if a.max_conns_per_address > 0 {
            per_address = a.max_conns_per_address;
        }
        builder = builder.rdma_config(rdma_transport::Config {
            max_message_bytes: rpc_core::MAX_RDMA_FRAME,
            max_connections_per_address: per_address,
            device_pool: !a.no_device_pool,
            ..rdma_transport::Config::default()
        });
    }
    let handle = builder
        .add_service(
            EchoServer::new(EchoService::default())
                .max_decoding_message_size(MAX_MSG)
                .max_encoding_message_size(MAX_MSG),
        )
        .start(a.addr)
        .await
        .map_err(|e| format!("server: cannot serve on {}: {e}", a.addr))?;
    let ready = Ready {
        ready: true,
        addr: handle.local_addr().to_string(),
        rdma_addr: handle.rdma_addr().map(|a| a.to_string()),
        pid: std::process::id(),
        max_connections_per_address: per_address,
        global_max_registered_bytes: rdma_transport::Config::default().global_max_registered_bytes
            as u64,
    };
    if ready.rdma_addr.is_none() {
        eprintln!(
            "server: no RDMA listener on {} (not an address of an RDMA device?): serving TCP only",
            a.addr
        );
    }
    answer(&serde_json::to_string(&ready).map_err(|e| e.to_string())?)?;

    // Requests on stdin, answered from this thread (the figures are
    // process-wide reads); `quit` or end of input stops the server.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let Ok(line) = line else { break };
            match line.trim() {
                "stats" => {
                    let s = serde_json::to_string(&proc_figures()).unwrap_or_default();
                    if answer(&s).is_err() {
                        break;
                    }
                }
                "quit" => break,
                "" => {}
                other => {
                    let why = format!("unknown request {other:?}: expected stats or quit");
                    let _ = answer(&serde_json::json!({ "error": why }).to_string());
                }
            }
        }
        let _ = tx.send(());
    });
    let _ = rx.await;
    handle.abort().await;
    Ok(())
}

/// One line on stdout, flushed.
fn answer(line: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .map_err(|e| format!("server: stdout: {e}"))
}

// ---------------------------------------------------------------- the child server, seen from the client

/// The server process this client started: requests on its stdin, answers
/// from its stdout (read by a thread), its stderr forwarded with a prefix
/// (the last lines kept, to say why connections were refused).
struct ServerProc {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    log: Arc<Mutex<VecDeque<String>>>,
}

const LOG_KEEP: usize = 20;

impl ServerProc {
    fn spawn(a: &ClientArgs) -> Result<(ServerProc, Ready), String> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let mut cmd = Command::new(exe);
        cmd.arg("server")
            .arg("--addr")
            .arg(a.addr.to_string())
            .arg("--max-conns-per-address")
            .arg(a.max_conns_per_address.to_string());
        if a.no_device_pool {
            cmd.arg("--no-device-pool");
        }
        if let Some(n) = a.threads {
            cmd.arg("--threads").arg(n.to_string());
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the server process: {e}"))?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[server] {line}");
                let mut l = log2.lock().unwrap_or_else(|p| p.into_inner());
                if l.len() == LOG_KEEP {
                    l.pop_front();
                }
                l.push_back(line);
            }
        });
        let mut s = ServerProc {
            child,
            stdin,
            lines,
            log,
        };
        let first = s.line(Duration::from_secs(60))?;
        let ready: Ready = serde_json::from_str(&first)
            .map_err(|e| format!("server said {first:?} instead of ready ({e})"))?;
        Ok((s, ready))
    }

    /// The next stdout line of the server, or why there is none.
    fn line(&mut self, within: Duration) -> Result<String, String> {
        match self.lines.recv_timeout(within) {
            Ok(l) => Ok(l),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(format!("the server did not answer within {within:?}"))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // Give its stderr a moment to drain.
                std::thread::sleep(Duration::from_millis(200));
                Err(match self.exited() {
                    Some(why) => why,
                    None => "the server closed its stdout".to_string(),
                })
            }
        }
    }

    /// `Some(why)` when the server process has exited.
    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(st)) => Some(format!(
                "the server process exited ({st}{}); its last lines: {}",
                if st.code().is_none() {
                    ", killed by a signal: the OOM killer? see dmesg"
                } else {
                    ""
                },
                self.last_log(5).join(" | ")
            )),
            _ => None,
        }
    }

    fn last_log(&self, n: usize) -> Vec<String> {
        let l = self.log.lock().unwrap_or_else(|p| p.into_inner());
        l.iter().skip(l.len().saturating_sub(n)).cloned().collect()
    }

    /// The server's process figures.
    fn stats(&mut self) -> Result<ProcFigures, String> {
        writeln!(self.stdin, "stats")
            .and_then(|_| self.stdin.flush())
            .map_err(|e| {
                self.exited()
                    .unwrap_or_else(|| format!("cannot ask the server: {e}"))
            })?;
        let line = self.line(Duration::from_secs(30))?;
        serde_json::from_str(&line).map_err(|e| format!("server answered {line:?} ({e})"))
    }

    /// Asks the server to stop; kills it after 10 s.
    fn quit(mut self) {
        let _ = writeln!(self.stdin, "quit").and_then(|_| self.stdin.flush());
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("server did not stop within 10 s: killing it");
        // Drop kills it.
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------- client role

type Client = EchoClient<Channel>;

#[derive(Debug, Clone, Default, Serialize)]
struct Latency {
    calls: u64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
    mean_us: f64,
}

impl Latency {
    fn of(h: &Histogram<u64>) -> Latency {
        let us = |ns: u64| ns as f64 / 1e3;
        Latency {
            calls: h.len(),
            p50_us: us(h.value_at_quantile(0.5)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
            mean_us: h.mean() / 1e3,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct Bandwidth {
    inflight: usize,
    calls: u64,
    secs: f64,
    /// Request bytes per second / 1e6.
    mb_per_s: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
struct Background {
    secs: f64,
    ok: u64,
    failed: u64,
    /// Latency of the background calls.
    latency: Latency,
    /// The first failures (connection index and status).
    errors: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
struct Step {
    /// The count this step aimed at.
    target: usize,
    /// The `--return-to-one` control step (back at 1 after the last step).
    control: bool,
    /// Connections open at the end of the step.
    connections: usize,
    /// Opened during this step.
    opened: usize,
    setup_secs: f64,
    /// Connections opened per second during this step.
    setup_rate: f64,
    /// Per-connection setup time (Channel::connect), this step.
    connect_p50_ms: f64,
    connect_max_ms: f64,
    server: Option<ProcFigures>,
    /// (server registered bytes - with 0 connections) / connections.
    server_registered_per_conn: Option<f64>,
    client: ProcFigures,
    client_registered_per_conn: f64,
    background: Option<Background>,
    /// Index in the pool of the connection latency and bandwidth ran on.
    measured_connection: Option<usize>,
    latency: Option<Latency>,
    bandwidth: Vec<Bandwidth>,
    /// All calls of the step (background, latency, bandwidth, warm-ups).
    calls_ok: u64,
    calls_failed: u64,
    /// Why no more connections could be opened (ends the run).
    stopped: Option<String>,
    /// Failed calls and failed measurements.
    errors: Vec<String>,
}

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("histogram bounds")
}

fn request(payload: usize) -> EchoRequest {
    EchoRequest {
        payload: vec![0x5a; payload].into(),
        reply_bytes: 1,
        ..Default::default()
    }
}

/// One unary call; `Err` says why it failed.
async fn call(c: &mut Client, req: EchoRequest, timeout: Duration) -> Result<(), String> {
    match tokio::time::timeout(timeout, c.unary_echo(req)).await {
        Err(_) => Err(format!("no reply within {timeout:?}")),
        Ok(Err(s)) => Err(format!("status {:?}: {}", s.code(), s.message())),
        Ok(Ok(r)) if r.get_ref().payload.len() != 1 => Err(format!(
            "reply of {} bytes, expected 1",
            r.get_ref().payload.len()
        )),
        Ok(Ok(_)) => Ok(()),
    }
}

/// Why a connection could not be opened, with a hint for the usual causes.
fn explain_connect_error(e: &str) -> String {
    let lower = e.to_ascii_lowercase();
    if lower.contains("too many open files") || lower.contains("os error 24") {
        let (soft, hard) = fd_limits();
        format!(
            "{e} -- out of file descriptors: raise ulimit -n (now {soft}, hard limit {hard}); \
             each RDMA connection takes a few fds on each side"
        )
    } else if lower.contains("timed out") {
        format!(
            "{e} -- a handshake took longer than the transport's connect timeout \
             (rdma_transport::Config::connect_timeout, 5 s): on a slow machine open fewer \
             at a time (--concurrency)"
        )
    } else {
        e.to_string()
    }
}

/// Opens one RDMA channel (checked to be RDMA).
async fn connect_one(
    target: String,
    i: usize,
    device_pool: bool,
) -> Result<(Client, Duration), String> {
    let t = Instant::now();
    let mut b = Channel::from_shared(target.clone().to_string())
        .unwrap()
        .transport(Transport::RdmaOnly);
    if !device_pool {
        b = b.rdma_config(rdma_transport::Config {
            max_message_bytes: rpc_core::MAX_RDMA_FRAME,
            device_pool: false,
            ..rdma_transport::Config::default()
        });
    }
    let ch = b.connect().await.map_err(|e| {
        format!(
            "connection {}: {}",
            i + 1,
            explain_connect_error(&e.to_string())
        )
    })?;
    let took = t.elapsed();
    let info = ch.transport();
    if info.kind != TransportKind::Rdma {
        return Err(format!(
            "connection {} to {target}: transport is {info}, expected rdma",
            i + 1
        ));
    }
    Ok((
        EchoClient::new(ch)
            .max_decoding_message_size(MAX_MSG)
            .max_encoding_message_size(MAX_MSG),
        took,
    ))
}

/// Opens connections until `pool` holds `target`, `concurrency` at a time.
/// Returns the elapsed time, the setup times and, if it stopped early, why
/// (connections in progress at that moment are let finish and kept).
async fn open_connections(
    a: &ClientArgs,
    dest: &str,
    pool: &mut Vec<Client>,
    target: usize,
    server: &mut Option<ServerProc>,
) -> (Duration, Vec<Duration>, Option<String>) {
    let start = Instant::now();
    let first = pool.len();
    let mut next = first;
    let mut tasks = tokio::task::JoinSet::new();
    let mut stop: Option<String> = None;
    let mut times = Vec::new();
    let mut last_report = Instant::now();
    let min_avail = a.min_mem_available_mib << 20;
    loop {
        while stop.is_none() && next < target && tasks.len() < a.concurrency.max(1) {
            if min_avail > 0 {
                if let Some(avail) = mem_available().filter(|&m| m < min_avail) {
                    stop = Some(format!(
                        "host memory nearly exhausted before connection {}: MemAvailable {} < {} \
                         (--min-mem-available-mib); give the machine (SOFTROCE_VM_MEM) more memory",
                        next + 1,
                        human_bytes(avail as f64),
                        human_bytes(min_avail as f64)
                    ));
                    break;
                }
            }
            tasks.spawn(connect_one(dest.to_string(), next, !a.no_device_pool));
            next += 1;
        }
        let Some(r) = tasks.join_next().await else {
            break;
        };
        match r {
            Ok(Ok((c, took))) => {
                pool.push(c);
                times.push(took);
            }
            Ok(Err(e)) => {
                if stop.is_none() {
                    // Is the server still there? A crashed server explains
                    // every refusal that follows.
                    let why = server.as_mut().and_then(|s| s.exited()).map_or_else(
                        || {
                            let hint = server
                                .as_ref()
                                .map(|s| s.last_log(3))
                                .filter(|l| !l.is_empty())
                                .map(|l| format!("; server's last lines: {}", l.join(" | ")))
                                .unwrap_or_default();
                            format!("{e}{hint}")
                        },
                        |dead| format!("{e}; {dead}"),
                    );
                    stop = Some(why);
                } else {
                    eprintln!("  also failed: {e}");
                }
            }
            Err(e) => {
                stop.get_or_insert_with(|| format!("connect task failed: {e}"));
            }
        }
        if last_report.elapsed() >= Duration::from_secs(2) {
            last_report = Instant::now();
            let el = start.elapsed().as_secs_f64();
            eprintln!(
                "  {}/{target} open, {:.1} s, {:.1} conn/s",
                pool.len(),
                el,
                (pool.len() - first) as f64 / el
            );
        }
    }
    (start.elapsed(), times, stop)
}

/// Every connection makes a 64 B call every interval (jittered) for `window`.
async fn background(pool: &[Client], a: &ClientArgs, window: Duration) -> Background {
    let interval = Duration::from_millis(a.call_interval_ms.max(1));
    let timeout = Duration::from_millis(a.call_timeout_ms);
    let first_within = interval.min(window).max(Duration::from_millis(1));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let hist = Arc::new(Mutex::new(histogram()));
    let start = Instant::now();
    let end = tokio::time::Instant::now() + window;
    let mut tasks = tokio::task::JoinSet::new();
    for (i, c) in pool.iter().enumerate() {
        let mut c = c.clone();
        let (ok, failed, errors, hist) = (ok.clone(), failed.clone(), errors.clone(), hist.clone());
        let offset = first_within.mul_f64(rand::random::<f64>());
        tasks.spawn(async move {
            let mut at = tokio::time::Instant::now() + offset;
            loop {
                tokio::time::sleep_until(at).await;
                let t = Instant::now();
                match call(&mut c, request(SMALL), timeout).await {
                    Ok(()) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                        let ns = t.elapsed().as_nanos() as u64;
                        hist.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .saturating_record(ns.max(1));
                    }
                    Err(e) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        let mut errs = errors.lock().unwrap_or_else(|p| p.into_inner());
                        if errs.len() < 10 {
                            errs.push(format!("background call on connection {}: {e}", i + 1));
                        }
                    }
                }
                at += interval.mul_f64(0.5 + rand::random::<f64>());
                if at >= end {
                    break;
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let h = hist.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let errors = errors.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Background {
        secs: start.elapsed().as_secs_f64(),
        ok: ok.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        latency: Latency::of(&h),
        errors,
    }
}

/// 64 B calls one at a time on `c`: `warmup` calls, then `iters` timed ones.
async fn latency(
    c: &Client,
    warmup: u64,
    iters: u64,
    timeout: Duration,
    step: &mut Step,
) -> Option<Latency> {
    let mut c = c.clone();
    let mut h = histogram();
    for k in 0..warmup + iters {
        let t = Instant::now();
        match call(&mut c, request(SMALL), timeout).await {
            Ok(()) => {
                step.calls_ok += 1;
                if k >= warmup {
                    h.saturating_record((t.elapsed().as_nanos() as u64).max(1));
                }
            }
            Err(e) => {
                step.calls_failed += 1;
                step.errors.push(format!("64 B latency call {k}: {e}"));
                return None;
            }
        }
    }
    Some(Latency::of(&h))
}

/// `iters` 1 MiB calls (reply 1 byte) on `c`, `inflight` at a time, after
/// `warmup` (at least one) warm-up calls; request bytes per second.
async fn bandwidth(
    c: &Client,
    iters: u64,
    inflight: usize,
    warmup: u64,
    timeout: Duration,
    step: &mut Step,
) -> Option<Bandwidth> {
    let mut w = c.clone();
    for _ in 0..warmup.max(1) {
        match call(&mut w, request(LARGE), timeout).await {
            Ok(()) => step.calls_ok += 1,
            Err(e) => {
                step.calls_failed += 1;
                step.errors
                    .push(format!("1 MiB x {inflight} warm-up call: {e}"));
                return None;
            }
        }
    }
    let iters = iters.max(inflight as u64);
    let tickets = Arc::new(AtomicU64::new(0));
    let base = Arc::new(request(LARGE));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..inflight.max(1) {
        let (mut c, tickets, base) = (c.clone(), tickets.clone(), base.clone());
        tasks.spawn(async move {
            let mut done = 0u64;
            while tickets.fetch_add(1, Ordering::Relaxed) < iters {
                call(&mut c, (*base).clone(), timeout).await?;
                done += 1;
            }
            Ok::<u64, String>(done)
        });
    }
    let mut done = 0;
    let mut err = None;
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Ok(n)) => done += n,
            Ok(Err(e)) => err = err.or(Some(e)),
            Err(e) => err = err.or(Some(format!("task failed: {e}"))),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    step.calls_ok += done;
    if let Some(e) = err {
        step.calls_failed += 1;
        step.errors.push(format!("1 MiB x {inflight}: {e}"));
        return None;
    }
    Some(Bandwidth {
        inflight,
        calls: done,
        secs,
        mb_per_s: (done as f64 * LARGE as f64) / secs / 1e6,
    })
}

/// Asks the server process (if this process started one) for its figures.
type ServerStats = dyn Fn(&mut Option<ServerProc>) -> Result<Option<ProcFigures>, String>;

/// What `--churn` measured.
#[derive(Debug, Clone, Serialize)]
struct Churn {
    cycles: usize,
    secs: f64,
    /// Memory registrations per cycle (`ibv_reg_mr` calls), blocks taken
    /// from the device pool per cycle, on each side (server: `None` when
    /// its figures are not available).
    client_registrations: f64,
    client_pool_reuses: f64,
    server_registrations: Option<f64>,
    server_pool_reuses: Option<f64>,
}

impl Churn {
    fn line(&self) -> String {
        let per = |x: Option<f64>| x.map_or("n/a".into(), |v| format!("{v:.2}"));
        format!(
            "{} cycles (open, 64 B call, 1 MiB call, close) in {:.1} s: {:.1} cycles/s; \
             per cycle: client {:.2} registrations, {:.2} blocks from the pool; \
             server {} registrations, {} blocks from the pool",
            self.cycles,
            self.secs,
            self.cycles as f64 / self.secs,
            self.client_registrations,
            self.client_pool_reuses,
            per(self.server_registrations),
            per(self.server_pool_reuses)
        )
    }
}

/// `--churn`: connection cycles one after another (the next opens as soon
/// as the previous one is dropped; its teardown may still be running).
async fn churn_cycles(
    a: &ClientArgs,
    dest: &str,
    timeout: Duration,
    server: &mut Option<ServerProc>,
    server_stats: &ServerStats,
) -> Result<Churn, String> {
    let before_client = proc_figures();
    let before_server = server_stats(server)?;
    let start = Instant::now();
    for i in 0..a.churn {
        let (mut c, _) = connect_one(dest.to_string(), i, !a.no_device_pool).await?;
        call(&mut c, request(SMALL), timeout)
            .await
            .map_err(|e| format!("cycle {i}: 64 B call: {e}"))?;
        call(&mut c, request(LARGE), timeout)
            .await
            .map_err(|e| format!("cycle {i}: 1 MiB call: {e}"))?;
        drop(c);
    }
    let secs = start.elapsed().as_secs_f64();
    let after_client = proc_figures();
    let after_server = server_stats(server)?;
    let n = a.churn as f64;
    let (srv_regs, srv_reuses) = match (before_server, after_server) {
        (Some(b), Some(x)) => (
            Some((x.memory_registrations - b.memory_registrations) as f64 / n),
            Some((x.pool_reuses - b.pool_reuses) as f64 / n),
        ),
        _ => (None, None),
    };
    Ok(Churn {
        cycles: a.churn,
        secs,
        client_registrations: (after_client.memory_registrations
            - before_client.memory_registrations) as f64
            / n,
        client_pool_reuses: (after_client.pool_reuses - before_client.pool_reuses) as f64 / n,
        server_registrations: srv_regs,
        server_pool_reuses: srv_reuses,
    })
}

/// The step's bandwidth figures on `c` (pool index `pick`): `--bw-rounds`
/// rounds of every `--bw-inflight` value.
async fn measure_bandwidth(
    a: &ClientArgs,
    c: &Client,
    pick: usize,
    first: bool,
    timeout: Duration,
    step: &mut Step,
) {
    let target = step.target;
    for round in 0..a.bw_rounds.max(1) {
        for &k in &a.bw_inflight {
            let warmup = if first && round == 0 {
                (a.first_warmup / 100).max(1)
            } else {
                1
            };
            if let Some(b) = bandwidth(c, a.bw_iters, k, warmup, timeout, step).await {
                eprintln!(
                    "scale: step {target}: 1 MiB x {k} on connection {}: {:.1} MB/s ({} calls in {:.2} s)",
                    pick + 1,
                    b.mb_per_s,
                    b.calls,
                    b.secs
                );
                step.bandwidth.push(b);
            }
        }
    }
}

/// Median of the step's figures at `k` in flight, with their range when
/// there are several.
fn bandwidth_median(s: &Step, k: usize) -> Option<(f64, f64, f64, usize)> {
    let mut v: Vec<f64> = s
        .bandwidth
        .iter()
        .filter(|x| x.inflight == k)
        .map(|x| x.mb_per_s)
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some((med, v[0], v[n - 1], n))
}

async fn client_main(a: ClientArgs) -> Result<(), String> {
    let (soft, hard) = fd_limits();
    let max_step = a.steps.iter().copied().max().unwrap_or(1);
    eprintln!(
        "scale: steps {:?}, {} handshakes at a time; open files limit {soft} (hard {hard}); \
         registered-memory cap {} per process (transport default)",
        a.steps,
        a.concurrency,
        human_bytes(rdma_transport::Config::default().global_max_registered_bytes as f64)
    );
    if let Ok(n) = soft.parse::<usize>() {
        if n < max_step * 8 {
            eprintln!(
                "scale: warning: ulimit -n {n} may be too low for {max_step} connections \
                 (a few fds per connection on each side): raise ulimit -n"
            );
        }
    }
    match rdma_transport::devices() {
        Ok(d) if !d.is_empty() => eprintln!(
            "scale: RDMA devices: {}",
            d.iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Ok(_) => {
            return Err(
                "no RDMA device on this host (rdma_transport::devices() is empty)".to_string(),
            )
        }
        Err(e) => return Err(format!("listing RDMA devices failed: {e}")),
    }

    // The server: started here, or a running one.
    let mut server: Option<ServerProc> = None;
    let (dest, server_info) = match &a.server_addr {
        Some(addr) => (addr.clone(), None),
        None => {
            let (s, ready) = tokio::task::block_in_place(|| ServerProc::spawn(&a))?;
            eprintln!(
                "scale: server pid {} on {} (HTTP/2), {} (RDMA); max_connections_per_address {}",
                ready.pid,
                ready.addr,
                ready.rdma_addr.as_deref().unwrap_or("none"),
                ready.max_connections_per_address
            );
            server = Some(s);
            let Some(rdma) = ready.rdma_addr.clone() else {
                return Err(format!(
                    "the server has no RDMA listener on {} (not an address of an RDMA device? \
                     In the Soft-RoCE VM use --addr $SOFTROCE_IP:0)",
                    a.addr
                ));
            };
            (rdma, Some(ready))
        }
    };

    let server_stats = |s: &mut Option<ServerProc>| -> Result<Option<ProcFigures>, String> {
        match s {
            Some(s) => tokio::task::block_in_place(|| s.stats()).map(Some),
            None => Ok(None),
        }
    };
    let base_server = server_stats(&mut server)?;
    let base_client = proc_figures();
    eprintln!(
        "scale: 0 connections: {}",
        base_figures(&base_server, &base_client)
    );

    let mut targets = vec![1usize];
    for &n in &a.steps {
        if n > *targets.last().unwrap() {
            targets.push(n);
        } else if n != 1 {
            eprintln!("scale: step {n} skipped (steps must increase)");
        }
    }
    let window = Duration::from_secs_f64(
        a.idle_secs
            .unwrap_or(a.call_interval_ms as f64 / 1e3)
            .max(0.0),
    );
    let timeout = Duration::from_millis(a.call_timeout_ms);
    let run_start = Instant::now();
    let mut pool: Vec<Client> = Vec::new();
    let mut steps: Vec<Step> = Vec::new();
    let mut fatal: Option<String> = None;
    for &target in &targets {
        eprintln!(
            "scale: step {target}: opening {} connections ({:.0} s into the run)",
            target - pool.len(),
            run_start.elapsed().as_secs_f64()
        );
        let before = pool.len();
        let (took, times, stopped) =
            open_connections(&a, &dest, &mut pool, target, &mut server).await;
        let opened = pool.len() - before;
        let mut step = Step {
            target,
            connections: pool.len(),
            opened,
            setup_secs: took.as_secs_f64(),
            setup_rate: opened as f64 / took.as_secs_f64().max(1e-9),
            stopped,
            ..Default::default()
        };
        if !times.is_empty() {
            let mut t = times.clone();
            t.sort();
            step.connect_p50_ms = t[t.len() / 2].as_secs_f64() * 1e3;
            step.connect_max_ms = t[t.len() - 1].as_secs_f64() * 1e3;
        }
        eprintln!(
            "scale: step {target}: {} open (+{opened} in {:.2} s, {:.1} conn/s, connect p50 {:.1} ms, max {:.1} ms)",
            pool.len(),
            step.setup_secs,
            step.setup_rate,
            step.connect_p50_ms,
            step.connect_max_ms
        );
        if let Some(why) = &step.stopped {
            eprintln!(
                "scale: step {target}: STOPPED at {} connections: {why}",
                pool.len()
            );
        }
        match server_stats(&mut server) {
            Ok(s) => step.server = s,
            Err(e) => {
                step.errors.push(format!("server figures: {e}"));
                fatal = Some(e);
            }
        }
        step.client = proc_figures();
        let n = pool.len().max(1) as f64;
        step.server_registered_per_conn = match (&step.server, &base_server) {
            (Some(s), Some(b)) => {
                Some(s.registered_bytes.saturating_sub(b.registered_bytes) as f64 / n)
            }
            _ => None,
        };
        step.client_registered_per_conn =
            step.client
                .registered_bytes
                .saturating_sub(base_client.registered_bytes) as f64
                / n;
        eprintln!(
            "scale: step {target}: server registered {} ({}/conn), RSS {}, fds {}; client registered {} ({}/conn), RSS {}, fds {}",
            step.server.as_ref().map_or("n/a".into(), |s| human_bytes(s.registered_bytes as f64)),
            step.server_registered_per_conn.map_or("n/a".into(), human_bytes),
            step.server.as_ref().map_or("n/a".into(), |s| human_bytes(s.rss_bytes as f64)),
            step.server.as_ref().map_or("n/a".into(), |s| s.fds.to_string()),
            human_bytes(step.client.registered_bytes as f64),
            human_bytes(step.client_registered_per_conn),
            human_bytes(step.client.rss_bytes as f64),
            step.client.fds
        );
        let pooled = |f: &ProcFigures| {
            format!(
                "{} registrations, {} blocks from the device pool, {} idle in it",
                f.memory_registrations,
                f.pool_reuses,
                human_bytes(f.pool_idle_bytes as f64)
            )
        };
        eprintln!(
            "scale: step {target}: so far server {}; client {}",
            step.server.as_ref().map_or("n/a".into(), pooled),
            pooled(&step.client)
        );
        if pool.is_empty() || fatal.is_some() {
            steps.push(step);
            break;
        }

        // Background traffic on every connection.
        eprintln!(
            "scale: step {target}: background traffic, {} connections, one call each every ~{} ms, for {:.1} s",
            pool.len(),
            a.call_interval_ms,
            window.as_secs_f64()
        );
        let bg = background(&pool, &a, window).await;
        step.calls_ok += bg.ok;
        step.calls_failed += bg.failed;
        step.errors.extend(bg.errors.iter().cloned());
        eprintln!(
            "scale: step {target}: background {} ok, {} failed in {:.1} s (p50 {}, max {})",
            bg.ok,
            bg.failed,
            bg.secs,
            lat(bg.latency.p50_us),
            lat(bg.latency.max_us)
        );
        step.background = Some(bg);

        // Latency and bandwidth on one connection, the others idle.
        let pick = if pool.len() == 1 {
            0
        } else {
            rand::random_range(0..pool.len())
        };
        step.measured_connection = Some(pick);
        let c = pool[pick].clone();
        let first = steps.is_empty();
        let warmup = if first {
            a.first_warmup.max(1)
        } else {
            (a.lat_iters / 10).clamp(1, 50)
        };
        step.latency = latency(&c, warmup, a.lat_iters, timeout, &mut step).await;
        if let Some(l) = &step.latency {
            eprintln!(
                "scale: step {target}: 64 B on connection {}: p50 {} p99 {} ({} calls)",
                pick + 1,
                lat(l.p50_us),
                lat(l.p99_us),
                l.calls
            );
        }
        measure_bandwidth(&a, &c, pick, first, timeout, &mut step).await;
        for e in &step.errors {
            eprintln!("scale: step {target}: FAILED: {e}");
        }
        let stop = step.stopped.is_some();
        steps.push(step);
        if stop {
            break;
        }
    }

    if a.return_to_one && fatal.is_none() && pool.len() > 1 {
        // The control: back to the first connection alone, measured once
        // the closed connections are torn down (their teardown is CPU work
        // that would otherwise land in the figures): registered memory back
        // to within twice the 1-connection step's, or open fds back to that
        // step's (+2), on both sides, or 60 s. Registered memory alone is
        // not enough: the connection kept may have grown its receive ring
        // since (64 KiB at step 1, more after the 8-in-flight calls), and a
        // receive ring never shrinks.
        pool.truncate(1);
        let settle = Instant::now();
        let one_server = steps[0].server.as_ref().map(|x| x.registered_bytes);
        let one_client = steps[0].client.registered_bytes;
        let one_server_fds = steps[0].server.as_ref().map(|x| x.fds);
        let one_client_fds = steps[0].client.fds;
        let mut step = Step {
            target: 1,
            control: true,
            connections: 1,
            measured_connection: Some(0),
            ..Default::default()
        };
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            step.client = proc_figures();
            match server_stats(&mut server) {
                Ok(s) => step.server = s,
                Err(e) => {
                    step.errors.push(format!("server figures: {e}"));
                    break;
                }
            }
            let server_back = match (&step.server, one_server) {
                (Some(s), Some(o)) => s.registered_bytes <= 2 * o,
                _ => true,
            };
            let fds_back = step.client.fds <= one_client_fds + 2
                && match (&step.server, one_server_fds) {
                    (Some(s), Some(o)) => s.fds <= o + 2,
                    _ => true,
                };
            if (server_back && step.client.registered_bytes <= 2 * one_client)
                || fds_back
                || settle.elapsed() > Duration::from_secs(60)
            {
                break;
            }
        }
        step.setup_secs = settle.elapsed().as_secs_f64();
        eprintln!(
            "scale: back at 1 connection after {:.1} s: server registered {}, client registered {}",
            step.setup_secs,
            step.server
                .as_ref()
                .map_or("n/a".into(), |s| human_bytes(s.registered_bytes as f64)),
            human_bytes(step.client.registered_bytes as f64)
        );
        let c = pool[0].clone();
        let warmup = (a.lat_iters / 10).clamp(1, 50);
        step.latency = latency(&c, warmup, a.lat_iters, timeout, &mut step).await;
        if let Some(l) = &step.latency {
            eprintln!(
                "scale: back at 1 connection: 64 B p50 {} p99 {} ({} calls)",
                lat(l.p50_us),
                lat(l.p99_us),
                l.calls
            );
        }
        measure_bandwidth(&a, &c, 0, false, timeout, &mut step).await;
        for e in &step.errors {
            eprintln!("scale: back at 1 connection: FAILED: {e}");
        }
        steps.push(step);
    }

    let churn = if a.churn > 0 && fatal.is_none() {
        pool.truncate(1);
        let r = churn_cycles(&a, &dest, timeout, &mut server, &server_stats).await;
        match &r {
            Ok(c) => eprintln!("scale: churn: {}", c.line()),
            Err(e) => eprintln!("scale: churn: FAILED: {e}"),
        }
        Some(r)
    } else {
        None
    };

    let table = render(
        &a,
        &dest,
        server_info.as_ref(),
        &base_server,
        &base_client,
        &steps,
    );
    println!("{table}");
    match &churn {
        Some(Ok(c)) => println!("Churn: {}\n", c.line()),
        Some(Err(e)) => println!("Churn: FAILED: {e}\n"),
        None => {}
    }
    let mut out_err = None;
    if let Some(f) = &a.markdown {
        if let Err(e) = std::fs::write(f, &table) {
            out_err = Some(format!("writing {}: {e}", f.display()));
        }
    }
    if let Some(f) = &a.json {
        let doc = serde_json::json!({
            "args": a,
            "command": std::env::args().collect::<Vec<_>>(),
            "server": server_info,
            "destination": dest,
            "baseline": {"server": base_server, "client": base_client},
            "steps": steps,
            "churn": churn.as_ref().map(|r| r.as_ref().ok()),
            "run_secs": run_start.elapsed().as_secs_f64(),
        });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        if let Err(e) = std::fs::write(f, text) {
            out_err = Some(format!("writing {}: {e}", f.display()));
        }
    }
    drop(pool);
    if let Some(s) = server.take() {
        tokio::task::block_in_place(|| s.quit());
    }

    // The verdict: every connection opened, every call succeeded.
    let mut why = Vec::new();
    if let Some(e) = fatal {
        why.push(e);
    }
    if let Some(Err(e)) = churn {
        why.push(format!("churn: {e}"));
    }
    for s in &steps {
        if let Some(stop) = &s.stopped {
            why.push(format!(
                "step {}: only {} of {} connections opened: {stop}",
                s.target, s.connections, s.target
            ));
        }
        if s.calls_failed > 0 {
            why.push(format!(
                "step {}: {} call(s) failed, first: {}",
                s.target,
                s.calls_failed,
                s.errors.first().map_or("?", String::as_str)
            ));
        }
    }
    let stepped = steps.iter().filter(|s| !s.control).count();
    let reached = steps
        .iter()
        .rev()
        .find(|s| !s.control)
        .map_or(0, |s| s.connections);
    if stepped < targets.len() && why.is_empty() {
        why.push(format!("stopped at {reached} connections"));
    }
    if let Some(e) = out_err {
        why.push(e);
    }
    if why.is_empty() {
        eprintln!(
            "scale: OK: reached {reached} connections, every call succeeded ({:.0} s)",
            run_start.elapsed().as_secs_f64()
        );
        Ok(())
    } else {
        Err(format!("FAILED:\n  {}", why.join("\n  ")))
    }
}

// ---------------------------------------------------------------- output

/// "server registered X, RSS Y; client registered Z, RSS W" (the server's
/// figures are "n/a" when it did not report them).
fn base_figures(server: &Option<ProcFigures>, client: &ProcFigures) -> String {
    let srv = |f: fn(&ProcFigures) -> u64| {
        server
            .as_ref()
            .map_or("n/a".into(), |s| human_bytes(f(s) as f64))
    };
    format!(
        "server registered {}, RSS {}; client registered {}, RSS {}",
        srv(|s| s.registered_bytes),
        srv(|s| s.rss_bytes),
        human_bytes(client.registered_bytes as f64),
        human_bytes(client.rss_bytes as f64)
    )
}

fn human_bytes(b: f64) -> String {
    const K: f64 = 1024.0;
    if b >= K * K * K {
        format!("{:.2} GiB", b / (K * K * K))
    } else if b >= K * K {
        format!("{:.1} MiB", b / (K * K))
    } else if b >= 10.0 * K {
        format!("{:.1} KiB", b / K)
    } else {
        format!("{b:.0} B")
    }
}

fn lat(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{:.1} ms", us / 1e3)
    } else {
        format!("{us:.0} µs")
    }
}

fn ratio(x: f64, base: f64) -> String {
    if base > 0.0 {
        format!("{:.2}×", x / base)
    } else {
        "–".into()
    }
}

fn render(
    a: &ClientArgs,
    dest: &str,
    server: Option<&Ready>,
    base_server: &Option<ProcFigures>,
    base_client: &ProcFigures,
    steps: &[Step],
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Scale: one echo server, N RDMA connections from one client process \
         (one `Channel`, `Transport::RdmaOnly`, per connection; {} handshakes at a time). \
         Registered-memory cap: {} per process (transport default).",
        a.concurrency,
        human_bytes(rdma_transport::Config::default().global_max_registered_bytes as f64)
    );
    match server {
        Some(r) => {
            let _ = writeln!(
                out,
                "Server: pid {} started by the client, RDMA on {dest}, max_connections_per_address {}.",
                r.pid, r.max_connections_per_address
            );
        }
        None => {
            let _ = writeln!(
                out,
                "Server: already running at {dest} (its process figures are not available)."
            );
        }
    }
    let _ = writeln!(
        out,
        "Per step: background traffic (each connection one 64 B call every ~{} ms, jittered, for {} s), \
         then on one connection of the pool: 64 B latency ({} calls, one in flight, the others idle) and \
         1 MiB request bandwidth ({} calls per figure, {} figure(s) per step: median [range]; reply 1 byte). \
         Ratios are to the 1-connection row. \
         Registered per connection = (registered - registered with 0 connections) / N.",
        a.call_interval_ms,
        a.idle_secs
            .unwrap_or(a.call_interval_ms as f64 / 1e3),
        a.lat_iters,
        a.bw_iters,
        a.bw_rounds.max(1)
    );
    let _ = writeln!(
        out,
        "With 0 connections: {}.\n",
        base_figures(base_server, base_client)
    );
    let mut head = "| connections | setup (conn/s) | server registered | server reg./conn | server RSS | client registered | client RSS | calls ok / failed | 64 B p50 (ratio) | 64 B p99 (ratio) |".to_string();
    let mut rule = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|".to_string();
    for k in &a.bw_inflight {
        let _ = write!(head, " 1 MiB × {k} MB/s (ratio) |");
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{head}\n{rule}");
    let base = steps.first();
    for s in steps {
        let conns = if s.control {
            format!("1 (back, control; after {:.0} s)", s.setup_secs)
        } else if s.stopped.is_some() {
            format!("{} (of {}: stopped)", s.connections, s.target)
        } else {
            s.connections.to_string()
        };
        let na = || "n/a".to_string();
        let _ = write!(
            out,
            "| {conns} | {:.1} | {} | {} | {} | {} | {} | {} / {} |",
            s.setup_rate,
            s.server
                .as_ref()
                .map_or_else(na, |x| human_bytes(x.registered_bytes as f64)),
            s.server_registered_per_conn.map_or_else(na, human_bytes),
            s.server
                .as_ref()
                .map_or_else(na, |x| human_bytes(x.rss_bytes as f64)),
            human_bytes(s.client.registered_bytes as f64),
            human_bytes(s.client.rss_bytes as f64),
            s.calls_ok,
            s.calls_failed
        );
        let bl = base.and_then(|b| b.latency.as_ref());
        match &s.latency {
            Some(l) => {
                let _ = write!(
                    out,
                    " {} ({}) | {} ({}) |",
                    lat(l.p50_us),
                    bl.map_or("–".into(), |b| ratio(l.p50_us, b.p50_us)),
                    lat(l.p99_us),
                    bl.map_or("–".into(), |b| ratio(l.p99_us, b.p99_us))
                );
            }
            None => out.push_str(" – | – |"),
        }
        for &k in &a.bw_inflight {
            let bb = base.and_then(|b| bandwidth_median(b, k));
            match bandwidth_median(s, k) {
                Some((med, lo, hi, n)) => {
                    let range = if n > 1 {
                        format!(" [{lo:.1}–{hi:.1}]")
                    } else {
                        String::new()
                    };
                    let _ = write!(
                        out,
                        " {med:.1}{range} ({}) |",
                        bb.map_or("–".into(), |b| ratio(med, b.0))
                    );
                }
                None => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    if let Some(x) = steps.iter().rev().find_map(|s| s.server.as_ref()) {
        let _ = writeln!(
            out,
            "\nServer: {} of the {} connections it accepted took their receive buffers \
             from its shared receive queue (wire protocol §4.7).",
            x.shared_receive_connections, x.connections_total
        );
    }
    for s in steps {
        if let Some(why) = &s.stopped {
            let _ = writeln!(
                out,
                "\n**Stopped** at {} connections (step {}): {}",
                s.connections,
                s.target,
                why.replace('|', "/")
            );
        }
        for e in s.errors.iter().take(10) {
            let _ = writeln!(
                out,
                "\n**Failed** (step {}): {}",
                s.target,
                e.replace('|', "/")
            );
        }
    }
    out
}
