//! Where an eager message (§4.1) goes when it leaves its receive slot: a
//! heap buffer of its own, so that the slot is reposted at once and a
//! message the application keeps holds only its own bytes.
//!
//! A small message's buffer comes from a per-thread pool by size class
//! (powers of two, 64 B to 4 KiB) and goes back to the pool of the thread
//! that drops the message's last `Bytes`. The message is a `Bytes` owning
//! that buffer ([`Bytes::from_owner`]): one allocation per message (the
//! owner's reference count), and slicing it (the frames of a BATCH) or
//! cloning it costs none. A `Bytes` copied from a slice instead costs two:
//! its `Vec`, and the shared header its first slice or clone promotes it to.
//!
//! **Memory.** A kept message holds its class's buffer: at most twice its
//! size (as an allocator's own size classes do). The pools keep
//! [`KEEP`] buffers per class and thread, 64 KiB per thread at most; larger
//! messages get an exact allocation of their own.

use bytes::Bytes;
use std::cell::RefCell;

/// The pooled buffers' sizes.
const CLASSES: [usize; 7] = [64, 128, 256, 512, 1024, 2048, 4096];

/// Buffers kept per class and thread.
const KEEP: usize = 8;

thread_local! {
    static POOL: RefCell<[Vec<Vec<u8>>; CLASSES.len()]> = RefCell::new(Default::default());
}

/// A pooled buffer, the owner of a received message's `Bytes`.
struct Pooled {
    buf: Vec<u8>,
    class: usize,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        // A thread that is exiting (no pool any more), or a drop from
        // inside the pool's own borrow, frees the buffer instead.
        let _ = POOL.try_with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                let kept = &mut p[self.class];
                if kept.len() < KEEP {
                    kept.push(buf);
                }
            }
        });
    }
}

/// `src`, copied into a buffer of its own (see the module docs).
pub(super) fn copy_out(src: &[u8]) -> Bytes {
    let Some(class) = CLASSES.iter().position(|&c| src.len() <= c) else {
        return Bytes::copy_from_slice(src);
    };
    let reused = POOL
        .try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p[class].pop()))
        .ok()
        .flatten();
    let mut buf = reused.unwrap_or_else(|| Vec::with_capacity(CLASSES[class]));
    buf.clear();
    buf.extend_from_slice(src);
    Bytes::from_owner(Pooled { buf, class })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_reuses_by_class_and_bounds_what_a_kept_message_holds() {
        // On a thread of its own: the pool is the thread's.
        std::thread::spawn(|| {
            let a = copy_out(&[7u8; 100]);
            assert_eq!(&a[..], &[7u8; 100][..]);
            let at = a.as_ptr();
            // Slices and clones share the buffer.
            let part = a.slice(10..20);
            assert_eq!(&part[..], &[7u8; 10][..]);
            drop(a);
            // The buffer is still held by `part`: a new message gets another.
            let b = copy_out(&[1u8; 120]);
            assert_ne!(b.as_ptr(), at);
            drop(part);
            // Back in the pool now: the next message of its class reuses it.
            let c = copy_out(&[2u8; 65]);
            assert_eq!(c.as_ptr(), at);
            assert_eq!(&c[..], &[2u8; 65][..]);
            // Another class does not take it.
            drop(c);
            let d = copy_out(&[3u8; 10]);
            assert_ne!(d.as_ptr(), at);
            // A kept message holds at most twice its size.
            for len in [0usize, 1, 64, 65, 1000, 4096] {
                let m = copy_out(&vec![5u8; len]);
                assert_eq!(m.len(), len);
                let class = CLASSES.iter().position(|&c| len <= c).unwrap();
                assert!(CLASSES[class] <= (2 * len).max(64), "{len}");
            }
            // Larger ones are copied exactly, outside the pool.
            let big = copy_out(&vec![9u8; 5000]);
            assert_eq!(big.len(), 5000);
            // The pool keeps at most KEEP buffers per class.
            let many: Vec<Bytes> = (0..3 * KEEP).map(|_| copy_out(&[0u8; 64])).collect();
            drop(many);
            POOL.with(|p| assert_eq!(p.borrow()[0].len(), KEEP));
        })
        .join()
        .unwrap();
    }
}
