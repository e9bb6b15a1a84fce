//! rpc-core
