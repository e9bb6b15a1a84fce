//! Behaviour tests: each module is one behaviour, run over the in-memory,
//! TCP and RDMA paths (see `rpc_tests::on_every_path!`).

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
mod reprobe;
mod server_reset;
mod server_streaming;
mod status;
mod tls;
mod transports;
mod unary;
