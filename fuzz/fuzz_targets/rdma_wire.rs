//! rdma-transport's wire decoders: the rdma_cm private data (HELLO, with the
//! advertised rendezvous region) and the header of every SEND. Any bytes
//! decode or fail cleanly; what decodes satisfies the documented ranges.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdma_transport::engine::wire::{Header, Hello};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Hello::decode(data) {
        assert!((4..=4096).contains(&h.credits));
        assert!(h.rdv_count >= 1 && h.rdv_count <= 4096);
        assert!(h.rdv_bytes >= 4096);
        // Encoding what was decoded gives the same fields back.
        assert_eq!(Hello::decode(&h.encode()).ok(), Some(h));
    }
    if let Ok(h) = Header::decode(data) {
        let mut buf = vec![0u8; data.len().max(64)];
        h.encode(&mut buf);
        assert_eq!(Header::decode(&buf).ok(), Some(h));
    }
});
