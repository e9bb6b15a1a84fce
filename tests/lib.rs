//! Test harness: one fixture per transport path, the same behaviour tests on each.
//!
//! * `Memory`: the call protocol over the in-memory connection, with the
//!   direct path (`rpc_core::direct`) for the generated clients and services;
//! * `MemoryTonic`: the same connection with the direct path off on both
//!   sides, every call through tonic's client and server;
//! * `Tcp`: standard gRPC over HTTP/2 (tonic's transport) on loopback;
//! * `Rdma`: the call protocol over rdma-transport, with the direct path;
//! * `RdmaTonic`: the same with the direct path off on both sides, as stock
//!   tonic-build clients and services run over RDMA. The RDMA paths need an
//!   RDMA device, so every RDMA test is `#[ignore]`d: a plain `cargo test`
//!   lists it as ignored. The Soft-RoCE VM suite (`scripts/vm-suite.sh`) runs them with
//!   `--include-ignored`. Run that way on a host without a device, a test
//!   prints `SKIP ...` and returns, unless the environment says a device is
//!   expected (`SOFTROCE_IN_VM=1` or `RDMA_TEST_REQUIRE_DEVICE=1`), in which
//!   case it fails; so does [`assert_device_tests_included`] when the ignored
//!   tests were left out where a device is expected.

pub mod tonic_example;

use rpc_core::{Channel, MemoryServer, ServingHandle, Transport};
use rpc_examples::echo::{EchoService, EchoStats};
use rpc_examples::greeter::MyGreeter;
use rpc_examples::pb::echo::echo_server::EchoServer;
use rpc_examples::pb::helloworld::greeter_server::GreeterServer;
use rpc_examples::pb::routeguide::route_guide_server::RouteGuideServer;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Message size limit the echo service is configured with in tests.
pub const BIG_LIMIT: usize = 80 << 20;

/// Which transport a test runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// In-memory connection (generated calls on the direct path).
    Memory,
    /// In-memory connection, every call through tonic's client and server
    /// (`direct_path(false)` on both sides).
    MemoryTonic,
    /// HTTP/2 over TCP loopback.
    Tcp,
    /// RDMA (Soft-RoCE in the VM), generated calls on the direct path.
    Rdma,
    /// RDMA, every call through tonic's client and server
    /// (`direct_path(false)` on both sides).
    RdmaTonic,
}

impl Path {
    /// Over rdma-transport (either way of calling).
    pub fn is_rdma(self) -> bool {
        matches!(self, Path::Rdma | Path::RdmaTonic)
    }

    /// Generated clients and services call each other on the direct path.
    pub fn direct(self) -> bool {
        !matches!(self, Path::MemoryTonic | Path::RdmaTonic)
    }
}

/// A running server and a channel to it.
pub struct Fixture {
    /// Channel to the server.
    pub channel: Channel,
    /// Counters of the echo handlers.
    pub stats: Arc<EchoStats>,
    /// Path under test.
    pub path: Path,
    server: Server,
}

enum Server {
    Memory(Box<MemoryServer>),
    Net(Option<ServingHandle>),
}

/// True when the environment says an RDMA device must be present.
pub fn device_required() -> bool {
    std::env::var("SOFTROCE_IN_VM").is_ok_and(|v| v == "1")
        || std::env::var("RDMA_TEST_REQUIRE_DEVICE").is_ok_and(|v| v == "1")
}

/// Fails when a device is expected ([`device_required`]) but this test binary
/// runs without its `#[ignore]`d device tests (no `--include-ignored` or
/// `--ignored`): they would be counted as ignored, not run. Each device test
/// binary calls it from a test of its own that is not ignored. Under
/// cargo-nextest (which runs one test per process and has its own
/// `--run-ignored`) it checks nothing.
pub fn assert_device_tests_included() {
    if !device_required() || std::env::var_os("NEXTEST").is_some() {
        return;
    }
    let included = std::env::args().any(|a| a == "--include-ignored" || a == "--ignored");
    assert!(
        included,
        "an RDMA device is expected (SOFTROCE_IN_VM=1 / RDMA_TEST_REQUIRE_DEVICE=1) but the \
         device tests are #[ignore]d in this run: pass --include-ignored to the test binary \
         (cargo test -- --include-ignored)"
    );
}

/// The IP to use for RDMA tests.
pub fn rdma_ip() -> Option<String> {
    std::env::var("SOFTROCE_IP")
        .or_else(|_| std::env::var("RDMA_TEST_IP"))
        .ok()
}

/// The router every fixture serves: echo (with large limits), greeter, route guide.
pub fn router(stats: Arc<EchoStats>) -> rpc_core::Router {
    let echo = EchoService { stats };
    rpc_core::Server::builder()
        .add_service(
            EchoServer::new(echo)
                .max_decoding_message_size(BIG_LIMIT)
                .max_encoding_message_size(BIG_LIMIT),
        )
        .add_service(GreeterServer::new(MyGreeter::default()))
        .add_service(RouteGuideServer::new(rpc_examples::routeguide::service()))
}

impl Fixture {
    /// Starts a server and connects a channel over `path`; `None` = skipped.
    pub async fn start(path: Path) -> Option<Fixture> {
        Self::start_with(path, router).await
    }

    /// As [`start`](Self::start) with a custom router.
    pub async fn start_with(
        path: Path,
        make: impl FnOnce(Arc<EchoStats>) -> rpc_core::Router,
    ) -> Option<Fixture> {
        let stats = Arc::new(EchoStats::default());
        let router = make(stats.clone());
        match path {
            Path::Memory | Path::MemoryTonic => {
                let server = router.direct_path(path.direct()).into_memory();
                let channel = server
                    .channel()
                    .await
                    .expect("in-memory channel")
                    .direct_path(path.direct());
                Some(Fixture {
                    channel,
                    stats,
                    path,
                    server: Server::Memory(Box::new(server)),
                })
            }
            Path::Tcp => {
                let handle = router
                    .start("127.0.0.1:0".parse().unwrap())
                    .await
                    .expect("server starts on loopback");
                let channel = Channel::from_shared(handle.local_addr().to_string())
                    .unwrap()
                    .transport(Transport::TcpOnly)
                    .connect()
                    .await
                    .expect("TCP channel");
                Some(Fixture {
                    channel,
                    stats,
                    path,
                    server: Server::Net(Some(handle)),
                })
            }
            Path::Rdma | Path::RdmaTonic => {
                let Some(ip) = rdma_ip() else {
                    if device_required() {
                        panic!(
                            "an RDMA device is required but SOFTROCE_IP / RDMA_TEST_IP is not set"
                        );
                    }
                    println!("SKIP: no RDMA test address (SOFTROCE_IP / RDMA_TEST_IP unset)");
                    return None;
                };
                let handle = router
                    .direct_path(path.direct())
                    .start(format!("{ip}:0").parse().expect("RDMA test IP parses"))
                    .await
                    .expect("server starts");
                let Some(rdma_addr) = handle.rdma_addr() else {
                    if device_required() {
                        panic!("an RDMA device is required but the server has no RDMA listener");
                    }
                    println!("SKIP: no RDMA device for {ip}");
                    return None;
                };
                let channel = Channel::from_shared(rdma_addr.to_string())
                    .unwrap()
                    .transport(Transport::RdmaOnly)
                    .connect()
                    .await
                    .expect("RDMA channel")
                    .direct_path(path.direct());
                assert_eq!(channel.transport().kind, rpc_core::TransportKind::Rdma);
                Some(Fixture {
                    channel,
                    stats,
                    path,
                    server: Server::Net(Some(handle)),
                })
            }
        }
    }

    /// A second, independent channel to the same server.
    pub async fn new_channel(&self) -> Channel {
        match &self.server {
            Server::Memory(m) => m
                .channel()
                .await
                .expect("in-memory channel")
                .direct_path(self.path.direct()),
            Server::Net(_) => {
                let (addr, t) = self.target().expect("a server with an address");
                Channel::from_shared(addr.to_string())
                    .unwrap()
                    .transport(t)
                    .connect()
                    .await
                    .expect("channel")
                    .direct_path(self.path.direct())
            }
        }
    }

    /// The address a new channel reaches this server at and the policy that
    /// keeps it on this path (`None` for the in-memory path).
    pub fn target(&self) -> Option<(std::net::SocketAddr, Transport)> {
        match &self.server {
            Server::Memory(_) => None,
            Server::Net(Some(h)) if self.path.is_rdma() => {
                Some((h.rdma_addr().unwrap(), Transport::RdmaOnly))
            }
            Server::Net(Some(h)) => Some((h.local_addr(), Transport::TcpOnly)),
            Server::Net(None) => panic!("server already shut down"),
        }
    }

    /// Shuts the server down gracefully.
    pub async fn shutdown(&mut self) {
        match &mut self.server {
            Server::Memory(m) => m.shutdown().await,
            Server::Net(h) => {
                if let Some(h) = h.take() {
                    h.shutdown().await.expect("clean shutdown");
                }
            }
        }
    }
}

/// Runs `test` on a fresh fixture for `path`, bounded by a timeout.
pub async fn run<F, Fut>(path: Path, test: F)
where
    F: FnOnce(Fixture) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some(fx) = Fixture::start(path).await else {
        return;
    };
    let limit = time_limit(path);
    tokio::time::timeout(limit, test(fx))
        .await
        .unwrap_or_else(|_| panic!("test over {path:?} did not finish within {limit:?}"));
}

/// How long one behaviour test may take on `path` (RDMA in the emulated VM
/// is slow).
fn time_limit(path: Path) -> Duration {
    if path.is_rdma() {
        Duration::from_secs(240)
    } else {
        Duration::from_secs(60)
    }
}

/// As [`run`], on a fixture serving `make`'s router.
pub async fn run_with<F, Fut>(
    path: Path,
    make: impl FnOnce(Arc<EchoStats>) -> rpc_core::Router,
    test: F,
) where
    F: FnOnce(Fixture) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some(fx) = Fixture::start_with(path, make).await else {
        return;
    };
    let limit = time_limit(path);
    tokio::time::timeout(limit, test(fx))
        .await
        .unwrap_or_else(|_| panic!("test over {path:?} did not finish within {limit:?}"));
}

/// Waits until `cond` holds, up to `limit`; returns whether it did.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}

/// Declares one test per transport path for a behaviour `async fn(Fixture)`:
/// `mod name { memory, memory_tonic, tcp, rdma, rdma_tonic }`, the RDMA ones `#[ignore]`d
/// (they need a device; see the crate docs). `name => router` serves `router` instead of
/// [`router`] (as [`on_paths!`]).
#[macro_export]
macro_rules! on_every_path {
    ($($names:tt)*) => {
        $crate::on_paths!([memory, memory_tonic, tcp, rdma, rdma_tonic] $($names)*);
    };
}

/// As [`on_every_path!`] on the listed paths only, e.g.
/// `on_paths!([tcp, rdma] needs_an_address)`; with `name => router`, the
/// fixture serves `router` ([`run_with`]) instead of [`router`].
#[macro_export]
macro_rules! on_paths {
    (@mod [$($path:ident),*] $name:ident $router:tt) => {
        mod $name {
            $($crate::on_paths!(@test $path $name $router);)*
        }
    };
    (@test memory $name:ident $router:tt) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn memory() { $crate::on_paths!(@run Memory $name $router) }
    };
    (@test memory_tonic $name:ident $router:tt) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn memory_tonic() { $crate::on_paths!(@run MemoryTonic $name $router) }
    };
    (@test tcp $name:ident $router:tt) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn tcp() { $crate::on_paths!(@run Tcp $name $router) }
    };
    (@test rdma $name:ident $router:tt) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
        async fn rdma() { $crate::on_paths!(@run Rdma $name $router) }
    };
    (@test rdma_tonic $name:ident $router:tt) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "needs an RDMA device: run in the Soft-RoCE VM (scripts/vm-suite.sh) or with --include-ignored"]
        async fn rdma_tonic() { $crate::on_paths!(@run RdmaTonic $name $router) }
    };
    (@run $path:ident $name:ident ()) => {
        $crate::run($crate::Path::$path, super::$name).await
    };
    (@run $path:ident $name:ident ($router:expr)) => {
        $crate::run_with($crate::Path::$path, $router, super::$name).await
    };
    ($paths:tt $($name:ident $(=> $router:expr)?),* $(,)?) => {$(
        $crate::on_paths!(@mod $paths $name ($($router)?));
    )*};
}
