//! RDMA transport
