//! Shared by the device test binaries (`verbs.rs`, `hostile.rs`): whether a
//! device is required, the address to test on, and test payloads.
#![allow(dead_code)] // each binary uses its own subset

use std::net::IpAddr;

use bytes::Bytes;
use rdma_transport::devices;

pub fn required() -> bool {
    std::env::var("SOFTROCE_IN_VM").as_deref() == Ok("1")
        || std::env::var("RDMA_TEST_REQUIRE_DEVICE").as_deref() == Ok("1")
}

/// The address to use, or None (after printing SKIP) when there is no device.
pub fn device_ip(test: &str) -> Option<IpAddr> {
    let reason = match devices() {
        Ok(d) if d.is_empty() => match rdma_transport::check_libraries() {
            Err(e) => format!("devices() is empty: {e}"),
            Ok(()) => "devices() is empty".to_string(),
        },
        Ok(_) => match std::env::var("SOFTROCE_IP").or_else(|_| std::env::var("RDMA_TEST_IP")) {
            Ok(ip) => return Some(ip.parse().expect("SOFTROCE_IP/RDMA_TEST_IP must be an IP")),
            Err(_) => "SOFTROCE_IP / RDMA_TEST_IP not set".to_string(),
        },
        Err(e) => format!("devices() failed: {e}"),
    };
    if required() {
        panic!("{test}: RDMA device required but unavailable: {reason}");
    }
    println!("SKIP {test}: no RDMA device ({reason})");
    None
}

pub fn pattern(seed: u64, len: usize) -> Bytes {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    Bytes::from(v)
}
