//! Benchmark of unary calls: our RDMA path, our TCP path, the in-memory path
//! and plain tonic over TCP, against an in-process echo server.
//!
//! `rdma` and `memory` take tonic's client and server (`direct_path(false)`
//! on both sides: the tonic-stub path); `direct` and `direct-memory` are the
//! same transports with the direct path (`rpc_core::direct`), served by a
//! second server beside the first (same address, another port).
//!
//! Every cell (payload size × calls in flight) reports latency percentiles
//! (hdrhistogram, per call), calls/s, bandwidth and CPU time per call.
//! Requests carry `payload` bytes and ask for a 1-byte reply
//! (`reply_bytes: 1`), so "payload" is the request size and bandwidth counts
//! request bytes; `--echo-both-ways` echoes the payload back instead.
//! Client and server run in this one process: CPU time (time on CPU of all
//! threads, /proc/self/task/*/schedstat) and context switches are client+server.
//! So are heap allocations per call: the `#[global_allocator]` (`stats_alloc`'s
//! instrumented system allocator) counts every allocation and its bytes made
//! during the timed phase, minus the bench's own bookkeeping (the request and
//! its clone before each call, histograms), measured on its own beforehand.
//!
//! ```text
//! bench --paths rdma,tcp-fallback,tonic-tcp --duration-ms 1000 --markdown out.md
//! bench --paths memory,tonic-tcp --payloads 64 --inflight 1 --iters 10000
//! bench --paths direct-memory,memory --payloads 64 --inflight 1 --iters 10000
//! bench --quick --paths memory,tcp-fallback,tonic-tcp          # CI smoke
//! ```
//! Figures go to stdout (markdown tables), progress to stderr. No figure is
//! checked against a threshold.
use clap::Parser;
use hdrhistogram::Histogram;
use rpc_core::remote::{Remote, RemoteRegion};
use rpc_core::{Channel, Server, Transport};
use rpc_examples::blobstore::Blobs;
use rpc_examples::echo::EchoService;
use rpc_examples::pb::blobstore::{
    blob_store_client::BlobStoreClient, blob_store_server::BlobStoreServer, GetRequest, ReadRequest,
};
use rpc_examples::pb::echo::{echo_client::EchoClient, echo_server::EchoServer, EchoRequest};
use serde::Serialize;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The system allocator, instrumented by the `stats_alloc` crate (no allocator
/// code of ours): allocations (alloc, alloc_zeroed and realloc, each may hand out a
/// new block) and the bytes asked for (a realloc counts its growth),
/// process-wide.
#[global_allocator]
static GLOBAL: &stats_alloc::StatsAlloc<std::alloc::System> = &stats_alloc::INSTRUMENTED_SYSTEM;

/// Allocations and bytes so far (process-wide).
fn alloc_counts() -> (u64, u64) {
    let s = GLOBAL.stats();
    (
        (s.allocations + s.reallocations) as u64,
        s.bytes_allocated as u64,
    )
}

/// Codec limit on both sides (16 MiB payloads plus framing).
const MAX_MSG: usize = 64 << 20;

/// Default cells: payload size and the in-flight counts measured for it.
const CELLS: &[(usize, &[usize])] = &[
    (64, &[1, 8, 64]),
    (1 << 10, &[1, 8, 64]),
    (16 << 10, &[1]),
    (64 << 10, &[1]),
    (1 << 20, &[1, 8]),
    (16 << 20, &[1, 8]),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum PathKind {
    /// Our `Channel`, `Transport::RdmaOnly`, every call through tonic's
    /// client and server (`direct_path(false)` on both sides).
    Rdma,
    /// As `Rdma`, with the direct path (`rpc_core::direct`) on both sides.
    Direct,
    /// Our `Channel`, `Transport::TcpOnly` (HTTP/2 through our wrapper).
    TcpFallback,
    /// Plain `tonic::transport::Channel` to the same server.
    TonicTcp,
    /// Our call protocol over an in-memory connection (`Router::into_memory`),
    /// through tonic's client and server.
    Memory,
    /// As `Memory`, with the direct path on both sides.
    DirectMemory,
    /// Remote memory (`rpc_core::remote`) over RDMA: one `Get` call hands out
    /// a region of the server's memory, then each call of the cell reads
    /// `payload` bytes of it (one-sided RDMA READ: no handler runs).
    RemoteRead,
    /// The same fetch as a unary call over RDMA (direct path): a small
    /// request, a reply of `payload` bytes of the blob (`BlobStore.Read`).
    UnaryFetch,
}

impl PathKind {
    fn name(self) -> &'static str {
        match self {
            PathKind::Rdma => "rdma",
            PathKind::Direct => "direct",
            PathKind::DirectMemory => "direct-memory",
            PathKind::TcpFallback => "tcp-fallback",
            PathKind::TonicTcp => "tonic-tcp",
            PathKind::Memory => "memory",
            PathKind::RemoteRead => "remote-read",
            PathKind::UnaryFetch => "unary-fetch",
        }
    }
}

impl FromStr for PathKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.trim() {
            "rdma" => PathKind::Rdma,
            "tcp-fallback" | "tcp" => PathKind::TcpFallback,
            "tonic-tcp" | "tonic" => PathKind::TonicTcp,
            "memory" | "mem" => PathKind::Memory,
            "direct" => PathKind::Direct,
            "direct-memory" => PathKind::DirectMemory,
            "remote-read" => PathKind::RemoteRead,
            "unary-fetch" => PathKind::UnaryFetch,
            o => {
                return Err(format!(
                    "unknown path {o:?}: expected rdma, direct, tcp-fallback, tonic-tcp, memory, direct-memory, remote-read or unary-fetch"
                ))
            }
        })
    }
}

/// `64`, `1k`, `1KiB`, `16m`, `16MiB` → bytes.
fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_lowercase();
    let t = t.trim_end_matches("ib").trim_end_matches('b');
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1usize << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        _ => (t, 1),
    };
    num.trim()
        .parse::<usize>()
        .map(|n| n * mul)
        .map_err(|e| format!("bad size {s:?}: {e}"))
}

#[derive(Parser, Debug)]
#[command(
    about = "Unary echo benchmark: rdma, direct, tcp-fallback, tonic-tcp, memory and direct-memory paths"
)]
struct Args {
    /// Address to serve on (port 0 = any free port). In the Soft-RoCE VM use $SOFTROCE_IP:0.
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    /// Paths to measure, in order: rdma, tcp-fallback, tonic-tcp, memory.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "rdma,tcp-fallback,tonic-tcp"
    )]
    paths: Vec<PathKind>,
    /// Measuring time per cell (after a short warm-up).
    #[arg(long, default_value_t = 1000)]
    duration_ms: u64,
    /// Calls per cell instead of a duration (at least one per call in flight).
    #[arg(long)]
    iters: Option<u64>,
    /// Cap on request bytes per cell (MiB): large-payload cells stop after
    /// max(cap / payload, in-flight) calls. For slow (emulated) links.
    #[arg(long)]
    max_cell_mib: Option<u64>,
    /// Warm-up calls per cell (default: ~10% of the cell, at most 200 ms; one call for >= 1 MiB).
    #[arg(long)]
    warmup: Option<u64>,
    /// Only these payload sizes (e.g. 64,1k,16m). Default: 64 B..16 MiB (--quick: up to 1 MiB).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    payloads: Option<Vec<usize>>,
    /// Only these in-flight counts (e.g. 1,8).
    #[arg(long, value_delimiter = ',')]
    inflight: Option<Vec<usize>>,
    /// Echo the payload back (both directions carry `payload` bytes).
    #[arg(long)]
    echo_both_ways: bool,
    /// Tiny smoke run: 3 calls per cell (at least one per call in flight), payloads up to 1 MiB.
    #[arg(long)]
    quick: bool,
    /// Tokio worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Run client and server on one `current_thread` runtime instead.
    #[arg(long, conflicts_with = "threads")]
    current_thread: bool,
    /// Serve TCP and RDMA from a runtime of its own with this many threads
    /// (named `bench-server`), so that the server's CPU per call is
    /// reported apart (`server CPU/call`). In-memory paths are not affected.
    #[arg(long)]
    server_threads: Option<usize>,
    /// Also write the tables (markdown) to this file.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Also write every figure as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Streaming instead of unary calls: `client` (each call streams
    /// `--stream-msgs` requests of `payload` bytes, one small reply) or
    /// `server` (a small request, `--stream-msgs` replies of `payload`
    /// bytes). Bandwidth counts all messages of the call.
    #[arg(long, conflicts_with = "echo_both_ways")]
    stream: Option<StreamKind>,
    /// Messages per streaming call (default 8).
    #[arg(long, default_value_t = 8)]
    stream_msgs: u32,
    /// RDMA path: bytes per rendezvous buffer, both sides (default: the
    /// transport's, 256 KiB). For the rendezvous sweep (docs/benchmarks.md).
    #[arg(long, value_parser = parse_size)]
    rdv_bytes: Option<usize>,
    /// RDMA path: rendezvous buffers per connection, both sides (default 16).
    #[arg(long)]
    rdv_buffers: Option<u32>,
    /// RDMA path: rendezvous payloads of at least this many bytes are
    /// written from where they are, not copied into staging buffers
    /// (`rdma_transport::Config::zero_copy_send_bytes`; 0: always copied;
    /// default: the transport's).
    #[arg(long, value_parser = parse_size)]
    zero_copy_send_bytes: Option<usize>,
    /// RDMA path: RDMA-WRITE large payloads into the receiver's buffers
    /// instead of letting the receiver read them
    /// (`rdma_transport::Config::read_rendezvous: false`), to measure what
    /// reading saves.
    #[arg(long)]
    no_read_rendezvous: bool,
    /// RDMA path: let the receiver read large payloads instead of granting
    /// a destination the sender WRITEs them into
    /// (`rdma_transport::Config::write_destination: false`), to compare
    /// the two.
    #[arg(long)]
    no_write_destination: bool,
    /// RDMA path: notify chunks by SEND even where WRITE with immediate
    /// data is available (to measure what the immediate saves).
    #[arg(long)]
    no_write_imm: bool,
    /// RDMA path: register every pool up front, as before memory on demand
    /// (`rdma_transport::Config::memory_on_demand: false`), to measure what
    /// starting small costs.
    #[arg(long)]
    no_memory_on_demand: bool,
    /// RDMA path: how each connection's driver waits for completions
    /// (`rdma_transport::Config::poll_mode`; default: the transport's, adaptive).
    #[arg(long)]
    poll_mode: Option<PollModeArg>,
    /// RDMA path: the server's poll mode, when it differs from
    /// `--poll-mode` (e.g. `remote-read` in polling mode: the reading side
    /// polls, the exposing side takes no part, as in `ib_read_lat`).
    #[arg(long)]
    server_poll_mode: Option<PollModeArg>,
    /// RDMA path: how the side queue pair waits for one-sided operations
    /// (`rdma_transport::Config::one_sided_poll_mode`; default: as
    /// `--poll-mode`).
    #[arg(long)]
    one_sided_poll_mode: Option<PollModeArg>,
    /// RDMA path: busy-poll bound / budget in µs (`Config::busy_poll`).
    #[arg(long)]
    busy_poll_us: Option<u64>,
    /// RDMA path: receive and send slots each connection starts with, both
    /// sides (`Config::initial_recv_slots` and `initial_send_slots`), to
    /// measure what a smaller idle connection costs in calls.
    #[arg(long)]
    initial_slots: Option<u32>,
    /// Message paths: largest DATA frame payload, both sides
    /// (`rpc_core::SessionConfig::max_data_frame`, default just under
    /// 1 MiB); a call's send window grows to hold two such frames. For
    /// the frame-size sweep (docs/benchmarks.md).
    #[arg(long, value_parser = parse_size)]
    max_data_frame: Option<usize>,
}

/// `--poll-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PollModeArg {
    /// `PollMode::Adaptive`.
    Adaptive,
    /// `PollMode::Fixed`.
    Fixed,
    /// `PollMode::Spin`.
    Spin,
}

impl PollModeArg {
    fn mode(self) -> rdma_transport::PollMode {
        match self {
            PollModeArg::Adaptive => rdma_transport::PollMode::Adaptive,
            PollModeArg::Fixed => rdma_transport::PollMode::Fixed,
            PollModeArg::Spin => rdma_transport::PollMode::Spin,
        }
    }
}

impl Args {
    /// The call protocol's settings where `--max-data-frame` changes them.
    fn session_config(&self) -> Option<rpc_core::SessionConfig> {
        let f = self.max_data_frame?;
        let d = rpc_core::SessionConfig::default();
        let window = u32::try_from(f.saturating_mul(2)).unwrap_or(u32::MAX);
        Some(rpc_core::SessionConfig {
            max_data_frame: f,
            initial_window: d.initial_window.max(window),
            connection_window: d.connection_window.max(window.saturating_mul(8)),
            ..d
        })
    }

    /// The RDMA transport settings of the server's (`server`) or the
    /// clients' end, when an option changes them.
    fn rdma_config(&self, server: bool) -> Option<rdma_transport::Config> {
        let poll_mode = match self.server_poll_mode {
            Some(m) if server => Some(m),
            _ => self.poll_mode,
        };
        if self.rdv_bytes.is_none()
            && self.rdv_buffers.is_none()
            && self.zero_copy_send_bytes.is_none()
            && !self.no_read_rendezvous
            && !self.no_write_destination
            && !self.no_write_imm
            && !self.no_memory_on_demand
            && poll_mode.is_none()
            && self.one_sided_poll_mode.is_none()
            && self.busy_poll_us.is_none()
            && self.initial_slots.is_none()
        {
            return None;
        }
        let d = rdma_transport::Config::default();
        Some(rdma_transport::Config {
            // As rpc-core's own default (rpc_core::rdma::MAX_RDMA_FRAME).
            max_message_bytes: 16 << 20,
            rendezvous_buffer_bytes: self.rdv_bytes.unwrap_or(d.rendezvous_buffer_bytes),
            rendezvous_buffers: self.rdv_buffers.unwrap_or(d.rendezvous_buffers),
            zero_copy_send_bytes: self.zero_copy_send_bytes.unwrap_or(d.zero_copy_send_bytes),
            read_rendezvous: !self.no_read_rendezvous,
            write_destination: !self.no_write_destination,
            write_with_imm: !self.no_write_imm,
            memory_on_demand: !self.no_memory_on_demand,
            poll_mode: poll_mode.map_or(d.poll_mode, PollModeArg::mode),
            one_sided_poll_mode: self.one_sided_poll_mode.map(PollModeArg::mode),
            busy_poll: self
                .busy_poll_us
                .map_or(d.busy_poll, std::time::Duration::from_micros),
            initial_recv_slots: self.initial_slots.unwrap_or(d.initial_recv_slots),
            initial_send_slots: self.initial_slots.unwrap_or(d.initial_send_slots),
            ..d
        })
    }
}

/// Streaming calls (`--stream`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StreamKind {
    /// Client streaming: `--stream-msgs` requests of `payload` bytes.
    Client,
    /// Server streaming: `--stream-msgs` replies of `payload` bytes.
    Server,
}

/// `--stream` and `--stream-msgs`, set once before any call.
static STREAM: std::sync::OnceLock<(StreamKind, u32)> = std::sync::OnceLock::new();

#[derive(Clone)]
enum Client {
    Ours(EchoClient<Channel>),
    Tonic(EchoClient<tonic::transport::Channel>),
    /// Reads of a region the server exposed (`remote-read`).
    Remote(Remote, RemoteRegion),
    /// `BlobStore.Read` calls (`unary-fetch`).
    Fetch(BlobStoreClient<Channel>),
}

impl Client {
    /// The reply bytes of one call: for a read, the bytes read.
    async fn call(&mut self, req: EchoRequest) -> Result<usize, tonic::Status> {
        use futures::StreamExt;
        match self {
            Client::Remote(remote, region) => {
                let n = req.payload.len() as u64;
                return Ok(remote.read(region, 0, n).await?.len());
            }
            Client::Fetch(c) => {
                let r = c
                    .read(ReadRequest {
                        name: "bench".into(),
                        offset: 0,
                        length: req.payload.len() as u64,
                    })
                    .await?;
                return Ok(r.into_inner().data.len());
            }
            _ => {}
        }
        match STREAM.get() {
            Some((StreamKind::Client, n)) => {
                // The n-1 further clones of the request are counted in this
                // call's allocations (the bench subtracts only one).
                let len = req.payload.len() * *n as usize;
                let msgs = tokio_stream::iter(vec![req; *n as usize]);
                let r = match self {
                    Client::Ours(c) => c.client_streaming_echo(msgs).await?.into_inner(),
                    Client::Tonic(c) => c.client_streaming_echo(msgs).await?.into_inner(),
                    Client::Remote(..) | Client::Fetch(_) => unreachable!("answered above"),
                };
                // The call's request bytes, if every message arrived.
                return Ok(if r.seq == *n { len } else { 0 });
            }
            Some((StreamKind::Server, n)) => {
                let req = EchoRequest {
                    reply_bytes: req.payload.len() as u64,
                    payload: bytes::Bytes::new(),
                    count: *n,
                    ..req
                };
                let mut total = 0;
                match self {
                    Client::Ours(c) => {
                        let mut s = c.server_streaming_echo(req).await?.into_inner();
                        while let Some(m) = s.next().await {
                            total += m?.payload.len();
                        }
                    }
                    Client::Tonic(c) => {
                        let mut s = c.server_streaming_echo(req).await?.into_inner();
                        while let Some(m) = s.next().await {
                            total += m?.payload.len();
                        }
                    }
                    Client::Remote(..) | Client::Fetch(_) => unreachable!("answered above"),
                }
                return Ok(total);
            }
            None => {}
        }
        let r = match self {
            Client::Ours(c) => c.unary_echo(req).await?.into_inner(),
            Client::Tonic(c) => c.unary_echo(req).await?.into_inner(),
            Client::Remote(..) | Client::Fetch(_) => unreachable!("answered above"),
        };
        Ok(r.payload.len())
    }
}

/// A `remote-read` client: the region of the server's blob, from `Get`.
async fn remote_client(ch: Channel) -> Result<(Client, String), String> {
    let t = ch.transport().to_string();
    let got = BlobStoreClient::new(ch.clone())
        .get(GetRequest {
            name: "bench".into(),
        })
        .await
        .map_err(|e| format!("Get: {e}"))?
        .into_inner();
    let region = got.blob.ok_or("Get answered no region")?;
    let remote = Remote::of_channel(&ch)
        .await
        .map_err(|e| format!("remote memory: {e}"))?;
    let how = match region.path {
        p if p == rpc_core::remote::proto::Path::OneSided as i32 => "one-sided RDMA READ",
        _ => "the RemoteMemory service",
    };
    Ok((
        Client::Remote(remote, region),
        format!("{t}, reads by {how}"),
    ))
}

fn ours(ch: Channel) -> Client {
    Client::Ours(
        EchoClient::new(ch)
            .max_decoding_message_size(MAX_MSG)
            .max_encoding_message_size(MAX_MSG),
    )
}

#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    cpu_us: f64,
    /// Of `cpu_us`, the threads named `bench-server*` (`--server-threads`).
    server_cpu_us: f64,
    csw: u64,
}

/// CPU time and context switches of the whole process, summed over its
/// threads from /proc (plain file reads: FFI stays in rdma-transport): `schedstat`'s
/// time on CPU (ns) and `status`' voluntary + involuntary switches.
/// Threads that exited during a cell are not counted (tokio's workers live on).
fn usage() -> Usage {
    let mut u = Usage::default();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return u;
    };
    for t in tasks.flatten() {
        let dir = t.path();
        if let Ok(s) = std::fs::read_to_string(dir.join("schedstat")) {
            if let Some(ns) = s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
            {
                u.cpu_us += ns / 1e3;
                let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
                if comm.starts_with("bench-server") {
                    u.server_cpu_us += ns / 1e3;
                }
            }
        }
        if let Ok(s) = std::fs::read_to_string(dir.join("status")) {
            for line in s.lines() {
                if let Some(v) = line
                    .strip_prefix("voluntary_ctxt_switches:")
                    .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
                {
                    u.csw += v.trim().parse::<u64>().unwrap_or(0);
                }
            }
        }
    }
    u
}

/// RDMA transport counters per call (process-wide, so client+server).
#[derive(Debug, Clone, Default, Serialize)]
struct RdmaPerCall {
    msgs: f64,
    eager_sends: f64,
    inline_sends: f64,
    rendezvous_writes: f64,
    /// Messages the receiver read (RDV_READ, wire-protocol-rdma §5.6).
    reads: f64,
    credit_msgs: f64,
    cq_events: f64,
    /// Of `cq_events`, the server's (connections its listener accepted).
    cq_events_server: f64,
}

fn rdma_delta(
    a: &rdma_transport::StatsSnapshot,
    b: &rdma_transport::StatsSnapshot,
    calls: u64,
) -> RdmaPerCall {
    let n = calls.max(1) as f64;
    let d = |x: u64, y: u64| y.saturating_sub(x) as f64 / n;
    RdmaPerCall {
        msgs: d(a.msgs_sent + a.msgs_recv, b.msgs_sent + b.msgs_recv),
        eager_sends: d(a.eager_sends, b.eager_sends),
        inline_sends: d(a.inline_sends, b.inline_sends),
        rendezvous_writes: d(a.rendezvous_writes, b.rendezvous_writes),
        reads: d(a.reads_announced, b.reads_announced),
        credit_msgs: d(a.credit_msgs, b.credit_msgs),
        cq_events: d(a.cq_events, b.cq_events),
        cq_events_server: d(a.cq_events_accepted, b.cq_events_accepted),
    }
}

#[derive(Debug, Clone, Serialize)]
struct CellResult {
    path: PathKind,
    payload: usize,
    inflight: usize,
    calls: u64,
    elapsed_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
    mean_us: f64,
    calls_per_s: f64,
    /// Payload bytes moved per second (request only, or both ways with --echo-both-ways).
    bytes_per_s: f64,
    /// CPU time on all threads (/proc/self/task/*/schedstat) per call, client+server.
    cpu_us_per_call: f64,
    /// Voluntary + involuntary context switches per call (whole process).
    ctx_switches_per_call: f64,
    /// `remote-read`: side queue pairs opened and one-sided operations
    /// retried during the cell (a failed side queue pair shows here).
    one_sided: Option<(u64, u64)>,
    /// With `--server-threads`: CPU time of the server's threads per call.
    server_cpu_us_per_call: Option<f64>,
    /// Heap allocations per call (alloc, alloc_zeroed, realloc), client+server,
    /// the bench's own bookkeeping excluded.
    allocs_per_call: f64,
    /// Bytes asked for by those allocations, per call.
    alloc_bytes_per_call: f64,
    rdma: Option<RdmaPerCall>,
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct PathInfo {
    path: PathKind,
    transport: Option<String>,
    skipped: Option<String>,
}

#[derive(Clone, Copy)]
struct Budget {
    duration: Duration,
    calls: Option<u64>,
}

/// The request every call of a cell sends (a clone of it per call).
fn request(payload: usize, echo: bool) -> EchoRequest {
    EchoRequest {
        payload: vec![0x5a; payload].into(),
        reply_bytes: if echo { 0 } else { 1 },
        // The handler does no work on the payload (no CRC-32 of it): the
        // call is the transport's, as in perftest.
        no_checksum: true,
        ..Default::default()
    }
}

/// A worker's latency histogram (ns).
fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).unwrap()
}

/// Allocations and bytes of the bench's own work in a cell, which
/// [`run_cell`] subtracts: building the request and its first clone once
/// and a histogram per worker plus the merged one (returned together), and
/// cloning the request per call (the workers' tasks, a few allocations per
/// worker, are not subtracted: spread over a cell's calls they add well
/// under 0.1 per call). Only the first clone of the request allocates (its
/// payload, a `Bytes` made from a `Vec`, gets its shared header then), so
/// the per-call clone is measured on a request cloned once before, as the
/// workers' clones are.
fn bookkeeping_allocs(payload: usize, echo: bool, inflight: usize) -> ((u64, u64), (u64, u64)) {
    let a0 = alloc_counts();
    let base = request(payload, echo);
    let first = base.clone();
    let a1 = alloc_counts();
    let copy = base.clone();
    let a2 = alloc_counts();
    let h = histogram();
    let a3 = alloc_counts();
    drop((base, first, copy, h));
    let hists = inflight as u64 + 1;
    (
        (
            a1.0 - a0.0 + hists * (a3.0 - a2.0),
            a1.1 - a0.1 + hists * (a3.1 - a2.1),
        ),
        (a2.0 - a1.0, a2.1 - a1.1),
    )
}

/// Runs `inflight` workers on clones of `client` until the budget is used;
/// returns the merged latency histogram (ns) and the number of calls.
async fn drive(
    client: &Client,
    payload: usize,
    inflight: usize,
    echo: bool,
    budget: Budget,
) -> Result<(Histogram<u64>, u64), String> {
    let base = request(payload, echo);
    let expect = match STREAM.get() {
        _ if matches!(client, Client::Remote(..) | Client::Fetch(_)) => payload,
        Some((_, n)) => payload * *n as usize,
        None if echo => payload,
        None => 1,
    };
    let base = Arc::new(base);
    let tickets = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + budget.duration;
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..inflight {
        let mut client = client.clone();
        let base = base.clone();
        let tickets = tickets.clone();
        tasks.spawn(async move {
            let mut h = histogram();
            let mut first = true;
            loop {
                match budget.calls {
                    Some(n) => {
                        if tickets.fetch_add(1, Ordering::Relaxed) >= n {
                            break;
                        }
                    }
                    None => {
                        if !first && Instant::now() >= end {
                            break;
                        }
                    }
                }
                first = false;
                // Payload copy outside the timed call; its allocations are
                // subtracted from the counts (see `bookkeeping_allocs`).
                let req = (*base).clone();
                let t = Instant::now();
                let got = client
                    .call(req)
                    .await
                    .map_err(|s| format!("worker {w}: {:?}: {}", s.code(), s.message()))?;
                let ns = t.elapsed().as_nanos() as u64;
                if got != expect {
                    return Err(format!("reply of {got} bytes, expected {expect}"));
                }
                h.saturating_record(ns.max(1));
            }
            Ok::<_, String>(h)
        });
    }
    let mut all = histogram();
    let mut err = None;
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Ok(h)) => all.add(&h).map_err(|e| e.to_string())?,
            Ok(Err(e)) => {
                if err.is_none() {
                    err = Some(e);
                    tasks.abort_all();
                }
            }
            Err(e) if e.is_cancelled() => {}
            Err(e) => err = Some(format!("worker panicked: {e}")),
        }
    }
    match err {
        Some(e) => Err(e),
        None => {
            let n = all.len();
            Ok((all, n))
        }
    }
}

async fn run_cell(
    path: PathKind,
    client: &Client,
    payload: usize,
    inflight: usize,
    args: &Args,
) -> CellResult {
    let echo = args.echo_both_ways;
    let mut result = CellResult {
        path,
        payload,
        inflight,
        calls: 0,
        elapsed_s: 0.0,
        p50_us: 0.0,
        p99_us: 0.0,
        p999_us: 0.0,
        max_us: 0.0,
        mean_us: 0.0,
        calls_per_s: 0.0,
        bytes_per_s: 0.0,
        cpu_us_per_call: 0.0,
        ctx_switches_per_call: 0.0,
        one_sided: None,
        server_cpu_us_per_call: None,
        allocs_per_call: 0.0,
        alloc_bytes_per_call: 0.0,
        rdma: None,
        error: None,
    };
    let inflight_calls = inflight as u64;
    // Measurement budget.
    let mut calls = if args.quick {
        Some(3.max(inflight_calls))
    } else {
        args.iters.map(|n| n.max(inflight_calls))
    };
    if let Some(cap) = args.max_cell_mib {
        let by_bytes = ((cap << 20) / payload.max(1) as u64).max(inflight_calls);
        if payload >= 1 << 20 || calls.is_some() {
            calls = Some(calls.map_or(by_bytes, |c| c.min(by_bytes)));
        }
    }
    let budget = Budget {
        duration: Duration::from_millis(args.duration_ms),
        calls,
    };
    // Warm-up: connections, buffers, allocator, caches.
    let warm = if let Some(w) = args.warmup {
        Budget {
            duration: Duration::ZERO,
            calls: Some(w),
        }
    } else if args.quick || payload >= 1 << 20 {
        Budget {
            duration: Duration::ZERO,
            calls: Some(1),
        }
    } else if let Some(n) = budget.calls {
        Budget {
            duration: Duration::ZERO,
            calls: Some((n / 10).max(1)),
        }
    } else {
        Budget {
            duration: (budget.duration / 10).min(Duration::from_millis(200)),
            calls: None,
        }
    };
    if warm.calls != Some(0) {
        let w_inflight = if warm.calls == Some(1) { 1 } else { inflight };
        if let Err(e) = drive(client, payload, w_inflight, echo, warm).await {
            result.error = Some(format!("warm-up: {e}"));
            return result;
        }
    }

    let (build, per_clone) = bookkeeping_allocs(payload, echo, inflight);
    let rdma0 = rdma_transport::global_stats();
    let u0 = usage();
    let a0 = alloc_counts();
    let t0 = Instant::now();
    let r = drive(client, payload, inflight, echo, budget).await;
    let elapsed = t0.elapsed().as_secs_f64();
    let a1 = alloc_counts();
    let u1 = usage();
    let rdma1 = rdma_transport::global_stats();
    match r {
        Err(e) => result.error = Some(e),
        Ok((h, n)) => {
            let us = |ns: u64| ns as f64 / 1000.0;
            let nf = n.max(1) as f64;
            result.calls = n;
            result.elapsed_s = elapsed;
            result.p50_us = us(h.value_at_quantile(0.50));
            result.p99_us = us(h.value_at_quantile(0.99));
            result.p999_us = us(h.value_at_quantile(0.999));
            result.max_us = us(h.max());
            result.mean_us = h.mean() / 1000.0;
            result.calls_per_s = n as f64 / elapsed;
            let per_call_bytes = match STREAM.get() {
                Some((_, n)) => payload * *n as usize,
                None if echo => 2 * payload,
                None => payload,
            };
            result.bytes_per_s = result.calls_per_s * per_call_bytes as f64;
            result.cpu_us_per_call = (u1.cpu_us - u0.cpu_us) / nf;
            result.ctx_switches_per_call = (u1.csw - u0.csw) as f64 / nf;
            if path == PathKind::RemoteRead {
                result.one_sided = Some((
                    rdma1.side_queue_pairs - rdma0.side_queue_pairs,
                    rdma1.one_sided_retries - rdma0.one_sided_retries,
                ));
            }
            if args.server_threads.is_some()
                && path != PathKind::Memory
                && path != PathKind::DirectMemory
            {
                result.server_cpu_us_per_call = Some((u1.server_cpu_us - u0.server_cpu_us) / nf);
            }
            // Minus the bench's own request building and per-call clones.
            let ours = |i: fn(&(u64, u64)) -> u64, a1: u64, a0: u64| {
                a1.saturating_sub(a0)
                    .saturating_sub(i(&build) + n * i(&per_clone))
            };
            result.allocs_per_call = ours(|x| x.0, a1.0, a0.0) as f64 / nf;
            result.alloc_bytes_per_call = ours(|x| x.1, a1.1, a0.1) as f64 / nf;
            if matches!(
                path,
                PathKind::Rdma | PathKind::Direct | PathKind::RemoteRead | PathKind::UnaryFetch
            ) {
                result.rdma = Some(rdma_delta(&rdma0, &rdma1, n));
            }
        }
    }
    result
}

fn size(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

fn lat(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else if us >= 1000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{us:.1} µs")
    }
}

fn bw(bytes_per_s: f64) -> String {
    if bytes_per_s >= 1e9 {
        format!("{:.2} GB/s", bytes_per_s / 1e9)
    } else if bytes_per_s >= 1e6 {
        format!("{:.1} MB/s", bytes_per_s / 1e6)
    } else {
        format!("{:.1} kB/s", bytes_per_s / 1e3)
    }
}

fn rate(r: f64) -> String {
    if r >= 100.0 {
        format!("{r:.0}")
    } else {
        format!("{r:.2}")
    }
}

fn ratio(a: f64, b: f64) -> String {
    if a > 0.0 && b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "–".into()
    }
}

fn progress(r: &CellResult) {
    let cell = format!("[{}] {} ×{}", r.path.name(), size(r.payload), r.inflight);
    match &r.error {
        Some(e) => eprintln!("{cell}: FAILED: {e}"),
        None => {
            let mut extra = String::new();
            if let Some(c) = r.server_cpu_us_per_call {
                let _ = write!(extra, ", server CPU {c:.1} µs/call");
            }
            if let Some((q, n)) = r.one_sided {
                let _ = write!(
                    extra,
                    ", side queue pairs opened {q}, one-sided operations retried {n}"
                );
            }
            if let Some(c) = &r.rdma {
                let _ = write!(
                    extra,
                    ", rdma/call: {:.1} msgs sent+recv, {:.1} rdv writes, {:.2} reads, {:.2} credit msgs, {:.2} cq events",
                    c.msgs, c.rendezvous_writes, c.reads, c.credit_msgs, c.cq_events
                );
            }
            eprintln!(
                "{cell}: {} calls in {:.2} s, p50 {} p99 {} p99.9 {}, {} calls/s, {}, CPU {:.1} µs/call, {:.2} ctx sw/call, {:.1} allocs/call ({}/call){extra}",
                r.calls,
                r.elapsed_s,
                lat(r.p50_us),
                lat(r.p99_us),
                lat(r.p999_us),
                rate(r.calls_per_s),
                bw(r.bytes_per_s),
                r.cpu_us_per_call,
                r.ctx_switches_per_call,
                r.allocs_per_call,
                bytes(r.alloc_bytes_per_call)
            );
        }
    }
}

/// Bytes per call, human-readable (B, KiB, MiB).
fn bytes(b: f64) -> String {
    if b >= (1 << 20) as f64 {
        format!("{:.2} MiB", b / (1 << 20) as f64)
    } else if b >= 10240.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

fn find(
    results: &[CellResult],
    path: PathKind,
    payload: usize,
    inflight: usize,
) -> Option<&CellResult> {
    results.iter().find(|r| {
        r.path == path && r.payload == payload && r.inflight == inflight && r.error.is_none()
    })
}

fn render(
    args: &Args,
    infos: &[PathInfo],
    cells: &[(usize, usize)],
    results: &[CellResult],
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}; client and server in one process \
         (CPU = time on CPU of all threads per call, from /proc/self/task/*/schedstat, client+server; ctx sw = voluntary+involuntary context switches per call; \
         allocs = heap allocations per call and the bytes they asked for, counting global allocator, client+server, the bench's own bookkeeping excluded).\n",
        match args.stream {
            Some(StreamKind::Client) => format!(
                "Client streaming: {} requests of `payload` bytes per call, a small reply (bandwidth counts all requests)",
                args.stream_msgs
            ),
            Some(StreamKind::Server) => format!(
                "Server streaming: a small request, {} replies of `payload` bytes per call (bandwidth counts all replies)",
                args.stream_msgs
            ),
            None if args.echo_both_ways => {
                "Unary echo; payload = request bytes, reply echoes the payload (bandwidth counts both directions)".to_string()
            }
            None => "Unary echo; payload = request bytes, reply 1 byte (bandwidth counts request bytes)".to_string(),
        }
    );
    for i in infos {
        match (&i.transport, &i.skipped) {
            (_, Some(why)) => {
                let _ = writeln!(out, "* {}: **skipped**: {why}", i.path.name());
            }
            (Some(t), None) => {
                let _ = writeln!(out, "* {}: transport `{t}`", i.path.name());
            }
            _ => {}
        }
    }
    let _ = writeln!(
        out,
        "\n| payload | in flight | path | calls | p50 | p99 | p99.9 | calls/s | bandwidth | CPU/call | ctx sw/call | allocs/call | alloc bytes/call |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for &(payload, inflight) in cells {
        for i in infos.iter().filter(|i| i.skipped.is_none()) {
            let Some(r) = results
                .iter()
                .find(|r| r.path == i.path && r.payload == payload && r.inflight == inflight)
            else {
                continue;
            };
            if let Some(e) = &r.error {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | failed: {} |||||||||",
                    size(payload),
                    inflight,
                    r.path.name(),
                    e.replace('|', "/")
                );
                continue;
            }
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {} |",
                size(payload),
                inflight,
                r.path.name(),
                r.calls,
                lat(r.p50_us),
                lat(r.p99_us),
                lat(r.p999_us),
                rate(r.calls_per_s),
                bw(r.bytes_per_s),
                match r.server_cpu_us_per_call {
                    Some(sv) => format!("{:.1} µs (server {sv:.1} µs)", r.cpu_us_per_call),
                    None => format!("{:.1} µs", r.cpu_us_per_call),
                },
                r.ctx_switches_per_call,
                r.allocs_per_call,
                bytes(r.alloc_bytes_per_call)
            );
        }
    }

    // Ratios against the baseline (tonic-tcp when measured).
    let live: Vec<PathKind> = infos
        .iter()
        .filter(|i| i.skipped.is_none())
        .map(|i| i.path)
        .collect();
    if let Some(&base) = live
        .iter()
        .find(|p| **p == PathKind::TonicTcp)
        .or(live.last())
    {
        let others: Vec<PathKind> = live.iter().copied().filter(|p| *p != base).collect();
        if !others.is_empty() {
            let _ = writeln!(
                out,
                "\nRatios against {} (p50 and CPU/call: lower is better, below 1× beats the baseline; \
                 calls/s: above 1× beats it).\n",
                base.name()
            );
            let mut head = "| payload | in flight |".to_string();
            let mut rule = "|---|---:|".to_string();
            for p in &others {
                let _ = write!(
                    head,
                    " {0}/{1} p50 | {0}/{1} calls/s | {0}/{1} CPU/call |",
                    p.name(),
                    base.name()
                );
                rule.push_str("---:|---:|---:|");
            }
            let _ = writeln!(out, "{head}\n{rule}");
            for &(payload, inflight) in cells {
                let b = find(results, base, payload, inflight);
                let _ = write!(out, "| {} | {} |", size(payload), inflight);
                for p in &others {
                    match (find(results, *p, payload, inflight), b) {
                        (Some(r), Some(b)) => {
                            let _ = write!(
                                out,
                                " {} | {} | {} |",
                                ratio(r.p50_us, b.p50_us),
                                ratio(r.calls_per_s, b.calls_per_s),
                                ratio(r.cpu_us_per_call, b.cpu_us_per_call)
                            );
                        }
                        _ => out.push_str(" – | – | – |"),
                    }
                }
                out.push('\n');
            }
        }
    }

    let rdma_rows: Vec<&CellResult> = results.iter().filter(|r| r.rdma.is_some()).collect();
    if !rdma_rows.is_empty() {
        let _ = writeln!(
            out,
            "\nRDMA transport counters per call (rdma_transport::global_stats deltas; client+server):\n"
        );
        let _ = writeln!(
            out,
            "| payload | in flight | path | msgs (sent+recv) | eager SENDs | inline SENDs | rendezvous WRITEs | credit msgs | CQ events | of which client / server |"
        );
        let _ = writeln!(out, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in rdma_rows {
            let c = r.rdma.as_ref().unwrap();
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} / {:.2} |",
                size(r.payload),
                r.inflight,
                r.path.name(),
                c.msgs,
                c.eager_sends,
                c.inline_sends,
                c.rendezvous_writes,
                c.credit_msgs,
                c.cq_events,
                c.cq_events - c.cq_events_server,
                c.cq_events_server
            );
        }
    }
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut rt = if args.current_thread {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    rt.enable_all();
    if let (Some(n), false) = (args.threads, args.current_thread) {
        rt.worker_threads(n.max(1));
    }
    rt.build()?.block_on(run(args))
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(k) = args.stream {
        let _ = STREAM.set((k, args.stream_msgs.max(1)));
    }
    // Cells in order.
    let mut cells: Vec<(usize, usize)> = Vec::new();
    for &(payload, infl) in CELLS {
        if let Some(p) = &args.payloads {
            if !p.contains(&payload) {
                continue;
            }
        } else if args.quick && payload > 1 << 20 {
            continue;
        }
        for &n in infl {
            if args.inflight.as_ref().is_none_or(|f| f.contains(&n)) {
                cells.push((payload, n));
            }
        }
    }
    // Sizes asked for that are not in the default grid: one in flight (or as asked).
    if let Some(p) = &args.payloads {
        for &payload in p {
            if !CELLS.iter().any(|c| c.0 == payload) {
                for &n in args.inflight.as_deref().unwrap_or(&[1]) {
                    cells.push((payload, n));
                }
            }
        }
    }

    let mut server_builder = Server::builder();
    if let Some(sc) = args.session_config() {
        server_builder = server_builder.session_config(sc);
    }
    if let Some(c) = args.rdma_config(true) {
        eprintln!(
            "rdma: {} rendezvous buffers of {} KiB, write with immediate {}",
            c.rendezvous_buffers,
            c.rendezvous_buffer_bytes >> 10,
            if c.write_with_imm { "offered" } else { "off" }
        );
        server_builder = server_builder.rdma_config(c);
    }
    // `remote-read` reads a blob as large as the largest payload.
    let blobs = Blobs::default();
    if args.paths.contains(&PathKind::RemoteRead) || args.paths.contains(&PathKind::UnaryFetch) {
        let largest = cells.iter().map(|c| c.0).max().unwrap_or(0);
        blobs.insert("bench", vec![0x5a; largest].into());
    }
    let router = server_builder
        .add_service(
            EchoServer::new(EchoService::default())
                .max_decoding_message_size(MAX_MSG)
                .max_encoding_message_size(MAX_MSG),
        )
        .add_service(
            BlobStoreServer::new(blobs)
                .max_decoding_message_size(MAX_MSG)
                .max_encoding_message_size(MAX_MSG),
        );
    // The tonic-stub rows (`rdma`, `memory`) are served with the direct path
    // off, the `direct` rows by a server with it on (the default).
    let tonic_router = router.clone().direct_path(false);
    let memory = args
        .paths
        .contains(&PathKind::Memory)
        .then(|| tonic_router.clone().into_memory());
    let direct_memory = args
        .paths
        .contains(&PathKind::DirectMemory)
        .then(|| router.clone().into_memory());
    let net = args.paths.iter().any(|p| {
        !matches!(
            p,
            PathKind::Memory | PathKind::DirectMemory | PathKind::Direct | PathKind::UnaryFetch
        )
    });
    let announce = |s: &rpc_core::ServingHandle, what: &str| {
        eprintln!(
            "{what}: {} (HTTP/2 on TCP){}",
            s.local_addr(),
            match s.rdma_addr() {
                Some(a) => format!(" and {a} (RDMA)"),
                None => ", no RDMA listener".into(),
            }
        )
    };
    // `--server-threads`: the TCP and RDMA server on a runtime of its own.
    let server_rt = match args.server_threads {
        Some(n) => Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(n.max(1))
                .thread_name("bench-server")
                .enable_all()
                .build()?,
        ),
        None => None,
    };
    let server = if net {
        let s = match &server_rt {
            Some(rt) => {
                let (r, addr) = (tonic_router.clone(), args.addr);
                rt.spawn(async move { r.start(addr).await }).await??
            }
            None => tonic_router.start(args.addr).await?,
        };
        announce(&s, "server");
        Some(s)
    } else {
        None
    };
    let direct_server =
        if args.paths.contains(&PathKind::Direct) || args.paths.contains(&PathKind::UnaryFetch) {
            // Beside the other one: same address, another port.
            let addr = std::net::SocketAddr::new(args.addr.ip(), 0);
            let s = match &server_rt {
                Some(rt) => {
                    let r = router.clone();
                    rt.spawn(async move { r.start(addr).await }).await??
                }
                None => router.clone().start(addr).await?,
            };
            announce(&s, "server (direct path)");
            Some(s)
        } else {
            None
        };

    let mut infos = Vec::new();
    let mut results = Vec::new();
    for &path in &args.paths {
        let serving = match path {
            PathKind::Direct | PathKind::UnaryFetch => direct_server.as_ref(),
            _ => server.as_ref(),
        };
        let addr = serving.map(|s| s.local_addr().to_string());
        let client: Result<(Client, String), String> = match path {
            PathKind::Rdma | PathKind::Direct | PathKind::RemoteRead | PathKind::UnaryFetch => {
                let devs = rdma_transport::devices().map_err(|e| e.to_string());
                match devs {
                    Err(e) => Err(format!("listing RDMA devices failed: {e}")),
                    Ok(d) if d.is_empty() => Err(
                        "no RDMA device on this host (rdma_transport::devices() is empty)".into(),
                    ),
                    Ok(_) if serving.and_then(|s| s.rdma_addr()).is_none() => Err(format!(
                        "the server has no RDMA listener on {} (address not on an RDMA device?)",
                        args.addr
                    )),
                    Ok(_) => {
                        let mut b = Channel::from_shared(addr.clone().unwrap().to_string())
                            .unwrap()
                            .transport(Transport::RdmaOnly)
                            .direct_path(matches!(path, PathKind::Direct | PathKind::UnaryFetch));
                        if let Some(c) = args.rdma_config(false) {
                            b = b.rdma_config(c);
                        }
                        if let Some(sc) = args.session_config() {
                            b = b.session_config(sc);
                        }
                        match b.connect().await {
                            Err(e) => Err(format!("RdmaOnly connect failed: {e}")),
                            Ok(c) if path == PathKind::RemoteRead => remote_client(c).await,
                            Ok(c) if path == PathKind::UnaryFetch => {
                                let t = c.transport().to_string();
                                let f = BlobStoreClient::new(c)
                                    .max_decoding_message_size(MAX_MSG)
                                    .max_encoding_message_size(MAX_MSG);
                                Ok((Client::Fetch(f), format!("{t}, BlobStore.Read calls")))
                            }
                            Ok(c) => {
                                let t = c.transport().to_string();
                                Ok((ours(c), t))
                            }
                        }
                    }
                }
            }
            PathKind::TcpFallback => Channel::from_shared(addr.clone().unwrap().to_string())
                .unwrap()
                .transport(Transport::TcpOnly)
                .connect()
                .await
                .map(|c| {
                    let t = c.transport().to_string();
                    (ours(c), t)
                })
                .map_err(|e| format!("TcpOnly connect failed: {e}")),
            PathKind::TonicTcp => {
                let ep =
                    tonic::transport::Endpoint::from_shared(format!("http://{}", addr.unwrap()))?
                        .tcp_nodelay(true);
                match ep.connect().await {
                    Ok(c) => Ok((
                        Client::Tonic(
                            EchoClient::new(c)
                                .max_decoding_message_size(MAX_MSG)
                                .max_encoding_message_size(MAX_MSG),
                        ),
                        "tonic::transport::Channel (HTTP/2, TCP_NODELAY)".into(),
                    )),
                    Err(e) => Err(format!("tonic connect failed: {e}")),
                }
            }
            PathKind::Memory | PathKind::DirectMemory => {
                let (m, direct) = match path {
                    PathKind::Memory => (memory.as_ref(), false),
                    _ => (direct_memory.as_ref(), true),
                };
                match m.unwrap().channel().await {
                    Ok(c) => {
                        let t = c.transport().to_string();
                        Ok((ours(c.direct_path(direct)), t))
                    }
                    Err(e) => Err(format!("in-memory channel failed: {e}")),
                }
            }
        };
        let (client, transport) = match client {
            Ok(c) => c,
            Err(why) => {
                eprintln!("[{}] rows skipped: {why}", path.name());
                infos.push(PathInfo {
                    path,
                    transport: None,
                    skipped: Some(why),
                });
                continue;
            }
        };
        eprintln!("[{}] transport: {transport}", path.name());
        infos.push(PathInfo {
            path,
            transport: Some(transport),
            skipped: None,
        });
        for &(payload, inflight) in &cells {
            let r = run_cell(path, &client, payload, inflight, &args).await;
            progress(&r);
            results.push(r);
        }
    }

    let table = render(&args, &infos, &cells, &results);
    println!("{table}");
    if let Some(f) = &args.markdown {
        std::fs::write(f, &table)?;
    }
    if let Some(f) = &args.json {
        let doc = serde_json::json!({
            "args": format!("{:?}", std::env::args().collect::<Vec<_>>()),
            "paths": infos,
            "cells": results,
        });
        std::fs::write(f, serde_json::to_string_pretty(&doc)?)?;
    }
    for s in [server, direct_server].into_iter().flatten() {
        s.abort().await;
    }
    if let Some(rt) = server_rt {
        rt.shutdown_background();
    }
    for m in [memory, direct_memory].into_iter().flatten() {
        let _ = tokio::time::timeout(Duration::from_secs(2), m.shutdown()).await;
    }
    let failed = results.iter().filter(|r| r.error.is_some()).count();
    if failed > 0 {
        return Err(format!("{failed} cell(s) failed").into());
    }
    Ok(())
}
