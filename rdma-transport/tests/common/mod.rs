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

/// The address to use, or None (after printing SKIP) when there is no device;
/// panics instead when one is [`required`]. The tests that call it are
/// `#[ignore]`d, so this runs only with `--include-ignored`.
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

/// Whether the device under test is iWARP (e.g. siw in the VM suite's
/// second run): `RDMA_TEST_IWARP=1`, or `SOFTROCE_SIW_IP` is set and is the
/// address under test, or every RDMA device on the host is iWARP.
pub fn iwarp() -> bool {
    let transports: Vec<&str> = devices()
        .unwrap_or_default()
        .iter()
        .map(|d| d.transport)
        .collect();
    is_iwarp(
        std::env::var("RDMA_TEST_IWARP").as_deref() == Ok("1"),
        std::env::var("SOFTROCE_SIW_IP").ok().as_deref(),
        std::env::var("SOFTROCE_IP")
            .or_else(|_| std::env::var("RDMA_TEST_IP"))
            .ok()
            .as_deref(),
        &transports,
    )
}

/// The decision of [`iwarp`], from its inputs. Two unset variables are not
/// "the same address": a real NIC run without `SOFTROCE_*` is not iWARP
/// unless its devices are.
pub fn is_iwarp(
    forced: bool,
    siw_ip: Option<&str>,
    ip_under_test: Option<&str>,
    device_transports: &[&str],
) -> bool {
    forced
        || matches!((siw_ip, ip_under_test), (Some(s), Some(i)) if s == i)
        || (!device_transports.is_empty() && device_transports.iter().all(|t| *t == "iWARP"))
}

/// Where a device is expected ([`required`]), a run that leaves the
/// `#[ignore]`d device tests out (no `--include-ignored` / `--ignored`)
/// fails here rather than counting them as ignored. Under cargo-nextest (one
/// test per process, its own `--run-ignored`) it checks nothing.
#[test]
fn device_tests_run_where_a_device_is_expected() {
    if !required() || std::env::var_os("NEXTEST").is_some() {
        return;
    }
    assert!(
        std::env::args().any(|a| a == "--include-ignored" || a == "--ignored"),
        "an RDMA device is expected (SOFTROCE_IN_VM=1 / RDMA_TEST_REQUIRE_DEVICE=1) but the \
         device tests are #[ignore]d in this run: pass --include-ignored to the test binary \
         (cargo test -- --include-ignored)"
    );
}

#[test]
fn unset_addresses_do_not_mean_iwarp() {
    // Before: `SOFTROCE_SIW_IP == SOFTROCE_IP` compared two `None`s on a real
    // NIC run and took the siw branch, skipping two checks.
    assert!(!is_iwarp(false, None, None, &["InfiniBand/RoCE"]));
    assert!(!is_iwarp(
        false,
        None,
        Some("10.0.0.1"),
        &["InfiniBand/RoCE"]
    ));
    assert!(!is_iwarp(
        false,
        Some("192.168.78.1"),
        Some("192.168.77.1"),
        &["InfiniBand/RoCE", "iWARP"]
    ));
    assert!(is_iwarp(
        false,
        Some("192.168.78.1"),
        Some("192.168.78.1"),
        &["InfiniBand/RoCE", "iWARP"]
    ));
    assert!(is_iwarp(false, None, None, &["iWARP"]));
    assert!(is_iwarp(true, None, None, &[]));
    assert!(!is_iwarp(false, None, None, &[]));
}

/// A connected pair (connecting side, listener side) and the listener,
/// kept: one-sided access opens its side queue pair through it.
pub async fn kept_pair(
    ip: IpAddr,
    cfg: &rdma_transport::Config,
) -> (
    rdma_transport::Connection,
    rdma_transport::Connection,
    rdma_transport::Listener,
) {
    let mut l = rdma_transport::Listener::bind(std::net::SocketAddr::new(ip, 0), cfg.clone())
        .await
        .expect("bind");
    let addr = l.local_addr();
    let c = rdma_transport::connect(addr, cfg);
    let (c, s) = tokio::join!(c, l.accept());
    (c.expect("connect"), s.expect("accept"), l)
}
