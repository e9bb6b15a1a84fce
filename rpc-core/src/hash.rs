//! The hash of the maps every call looks up: a session's calls by stream
//! id, the services by name. std's default (SipHash-1-3) costs about as
//! much per lookup as the rest of the lookup several times over; foldhash
//! (its quality variant: hashbrown's default plus a final mix) is a folded multiply per word, under a random
//! key per map, so a peer that picks its stream ids cannot aim them at one
//! bucket without knowing the key.

/// A [`BuildHasher`](std::hash::BuildHasher) with a random key of its own
/// per map.
pub(crate) type FastState = foldhash::quality::RandomState;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::hash::BuildHasher;

    #[test]
    fn spreads_consecutive_stream_ids_over_buckets_and_top_bits() {
        let s = FastState::default();
        // hashbrown takes the bucket from the low bits and its tag from the top 7.
        let low: HashSet<u64> = (0..512u32).map(|i| s.hash_one(2 * i + 1) & 1023).collect();
        let top: HashSet<u64> = (0..512u32).map(|i| s.hash_one(2 * i + 1) >> 57).collect();
        assert!(low.len() > 300, "{}", low.len());
        assert!(top.len() > 100, "{}", top.len());
    }

    #[test]
    fn keys_differ_per_map_and_byte_strings_hash_by_content() {
        let (a, b) = (FastState::default(), FastState::default());
        assert_ne!(a.hash_one(1u32), b.hash_one(1u32));
        assert_eq!(
            a.hash_one(b"pkg.Svc".as_slice()),
            a.hash_one(b"pkg.Svc".to_vec().as_slice())
        );
        assert_ne!(a.hash_one(b"ab".as_slice()), a.hash_one(b"ab\0".as_slice()));
    }
}
