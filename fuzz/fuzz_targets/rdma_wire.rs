//! rdma-transport's wire decoders: the rdma_cm private data (HELLO, with the
//! advertised rendezvous region) and the header of every SEND. Any bytes
//! decode or fail cleanly; what decodes satisfies the documented ranges
//! (including a rendezvous region that does not wrap the address space).
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdma_transport::engine::wire::{Header, Hello, HELLO_FLAGS_KNOWN};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Hello::decode(data) {
        // Only the flags this version knows (§2.1: bit 0 WRITE_IMM, bit 1 ON_DEMAND).
        assert_eq!(h.flags & !HELLO_FLAGS_KNOWN, 0);
        assert!((4..=4096).contains(&h.credits));
        assert!((48..=1 << 24).contains(&h.recv_slot_bytes));
        assert!(h.rdv_count >= 1 && h.rdv_count <= 4096);
        assert!((4096..=1 << 30).contains(&h.rdv_bytes));
        // §2.2: the advertised region does not wrap around the address
        // space, so every buffer address rdv_addr + i * rdv_bytes exists.
        let len = u64::from(h.rdv_count) * u64::from(h.rdv_bytes);
        assert!(h.rdv_addr.checked_add(len).is_some(), "{h:?}");
        // Encoding what was decoded gives the same fields back.
        assert_eq!(Hello::decode(&h.encode()).ok(), Some(h));
    }
    if let Ok(h) = Header::decode(data) {
        let mut buf = vec![0u8; data.len().max(64)];
        h.encode(&mut buf);
        assert_eq!(Header::decode(&buf).ok(), Some(h));
    }
});
