//! Behaviour tests: each module is one behaviour, run over the in-memory,
//! TCP and RDMA paths (see `rpc_tests::on_every_path!`).
//!
//! The tests that need an RDMA device are `#[ignore]`d (a host run lists them
//! as ignored); the Soft-RoCE VM suite runs them with `--include-ignored`.

mod back_pressure;
mod balance;
mod bidi;
mod builder;
mod cancel;
mod client_streaming;
mod concurrency;
mod deadline;
mod dropin;
mod handler_panic;
mod hostile_peer;
mod interceptors;
mod iwarp;
mod large_messages;
mod metadata;
mod metadata_limit;
mod remote_memory;
mod reprobe;
mod server_reset;
mod server_streaming;
mod status;
mod tls;
mod transports;
mod unary;

/// Where a device is expected (`SOFTROCE_IN_VM=1`, `RDMA_TEST_REQUIRE_DEVICE=1`),
/// a run that leaves the `#[ignore]`d device tests out fails here.
#[test]
fn device_tests_run_where_a_device_is_expected() {
    rpc_tests::assert_device_tests_included();
}
