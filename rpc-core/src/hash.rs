//! A fast keyed hash for the maps every call looks up: a session's calls by
//! stream id, the services by name. std's default (SipHash-1-3) costs
//! about as much per lookup as the rest of the lookup several times over;
//! this is one 64×64→128-bit multiply per word, folded, under a random key
//! per map (as `foldhash`, hashbrown's default), so a peer that picks its
//! stream ids cannot aim them at one bucket without knowing the key.

use std::hash::{BuildHasher, Hasher};

/// Multiplier (an odd constant with well-mixed bits: 2^64 / φ).
const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// The high and low halves of `a * b`, XORed.
fn folded_multiply(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// A [`BuildHasher`] with a random key of its own.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FastState(u64);

impl Default for FastState {
    fn default() -> Self {
        // std's per-map random keys, drawn once per map (not per lookup).
        FastState(std::hash::RandomState::new().hash_one(0x5eed_u32))
    }
}

impl BuildHasher for FastState {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(self.0)
    }
}

/// The hasher of [`FastState`].
pub(crate) struct FastHasher(u64);

impl FastHasher {
    fn mix(&mut self, word: u64) {
        self.0 = folded_multiply(self.0 ^ word, K);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.mix(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            // The length keeps "ab" and "ab\0" apart.
            self.mix(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.mix(u64::from(n));
    }
    fn write_u16(&mut self, n: u16) {
        self.mix(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.mix(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }
    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

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
