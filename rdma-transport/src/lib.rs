//! RDMA transport (work in progress)
#![deny(clippy::undocumented_unsafe_blocks)]
pub mod engine;
