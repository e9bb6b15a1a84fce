//! Reliability under faults, load and churn (Soft-RoCE VM; see docs/reliability.md).
//!
//! Every test needs an RDMA device, so each is `#[ignore]`d: a plain
//! `cargo test` lists them as ignored; run the binary with `--include-ignored`
//! (the Soft-RoCE VM suite does). Run so without a device, a test prints
//! `SKIP <test>: <reason>` and returns, unless `SOFTROCE_IN_VM=1` or
//! `RDMA_TEST_REQUIRE_DEVICE=1` says a device is required, in which case it
//! fails (and so does a run without `--include-ignored`). Run with
//! `--test-threads=1`.

mod common;

/// The system allocator instrumented by `stats_alloc`, for
/// [`common::live_heap_bytes`].
#[global_allocator]
static ALLOC: &stats_alloc::StatsAlloc<std::alloc::System> = &stats_alloc::INSTRUMENTED_SYSTEM;

/// Where a device is expected (`SOFTROCE_IN_VM=1`, `RDMA_TEST_REQUIRE_DEVICE=1`),
/// a run that leaves the `#[ignore]`d device tests out fails here.
#[test]
fn device_tests_run_where_a_device_is_expected() {
    rpc_tests::assert_device_tests_included();
}

mod churn;
mod deadline_storm;
mod load;
mod peer_killed;
mod server_restart;
mod slow_consumer;
