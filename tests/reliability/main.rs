//! Reliability under faults, load and churn (Soft-RoCE VM; see docs/reliability.md).
//!
//! Every test needs an RDMA device: without one it prints `SKIP <test>: <reason>`
//! and returns, unless `SOFTROCE_IN_VM=1` or `RDMA_TEST_REQUIRE_DEVICE=1` says a
//! device is required, in which case it fails. Run with `--test-threads=1`.

mod common;

/// The system allocator instrumented by `stats_alloc`, for
/// [`common::live_heap_bytes`].
#[global_allocator]
static ALLOC: &stats_alloc::StatsAlloc<std::alloc::System> = &stats_alloc::INSTRUMENTED_SYSTEM;

mod churn;
mod deadline_storm;
mod load;
mod peer_killed;
mod server_restart;
mod slow_consumer;
