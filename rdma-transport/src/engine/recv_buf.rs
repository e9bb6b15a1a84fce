//! Where an eager message (§4.1) goes when it leaves its receive slot: a
//! heap buffer of its own, so that the slot is reposted at once and a
//! message the application keeps holds only its own bytes.
//!
//! A small message's buffer is one of its receiving thread's, by size class
//! (powers of two, 64 B to 4 KiB), and holds that message only. The message
//! is a `Bytes` sharing the buffer with the thread's handle of it
//! (`BytesMut::split`): slicing it (the frames of a BATCH) or cloning it
//! costs no allocation. Once every `Bytes` of the message was dropped, on
//! whatever thread, the handle is the buffer's only owner and the thread
//! writes its next message of that class into it (`BytesMut::try_reclaim`,
//! which succeeds only then): a connection that receives one message at a
//! time allocates nothing here in steady state. (A `Bytes` copied from a
//! slice costs two allocations: its `Vec`, and the shared header its first
//! slice or clone promotes it to; a `Bytes` owning a pooled buffer,
//! `Bytes::from_owner`, costs one, its owner's reference count.)
//!
//! **Memory.** A kept message holds its class's buffer, shared with no
//! other message: at most twice its size (as an allocator's own size
//! classes do). A thread keeps handles of [`KEEP`] buffers per class, 64 KiB
//! per thread at most beside what live messages hold; when all of them are
//! held by messages, a new buffer takes the place of the oldest (its
//! message keeps it until it is dropped). Larger messages get an exact
//! allocation of their own.

use bytes::{Bytes, BytesMut};
use std::cell::RefCell;

/// The pooled buffers' sizes.
const CLASSES: [usize; 7] = [64, 128, 256, 512, 1024, 2048, 4096];

/// Buffers kept per class and thread.
const KEEP: usize = 8;

thread_local! {
    /// Per class, the thread's buffers: each empty, or held by the one
    /// message written into it.
    static POOL: RefCell<[Vec<BytesMut>; CLASSES.len()]> = RefCell::new(Default::default());
}

/// `src`, copied into a buffer of its own (see the module docs).
pub(super) fn copy_out(src: &[u8]) -> Bytes {
    if src.is_empty() {
        return Bytes::new();
    }
    let Some(class) = CLASSES.iter().position(|&c| src.len() <= c) else {
        return Bytes::copy_from_slice(src);
    };
    let size = CLASSES[class];
    // A thread that is exiting (no pool any more) copies the message
    // exactly instead.
    let pooled = POOL.try_with(|p| {
        let Ok(mut p) = p.try_borrow_mut() else {
            return None;
        };
        let bufs = &mut p[class];
        // The whole buffer back, only if no message holds it any more.
        let free = bufs.iter_mut().rposition(|b| b.try_reclaim(size));
        let i = match free {
            Some(i) => i,
            None => {
                if bufs.len() == KEEP {
                    bufs.remove(0);
                }
                bufs.push(BytesMut::with_capacity(size));
                bufs.len() - 1
            }
        };
        let b = &mut bufs[i];
        b.extend_from_slice(src);
        Some(b.split().freeze())
    });
    match pooled {
        Ok(Some(msg)) => msg,
        _ => Bytes::copy_from_slice(src),
    }
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
            // The pool keeps at most KEEP buffers per class; every message
            // has a buffer of its own however many are alive.
            let many: Vec<Bytes> = (0..3 * KEEP).map(|i| copy_out(&[i as u8; 64])).collect();
            for (i, m) in many.iter().enumerate() {
                assert!(
                    m.iter().all(|&x| x == i as u8),
                    "a live message never changes"
                );
            }
            let at: Vec<_> = many.iter().map(|m| m.as_ptr()).collect();
            let mut distinct = at.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), many.len());
            drop(many);
            POOL.with(|p| assert_eq!(p.borrow()[0].len(), KEEP));
            // The last KEEP buffers are free again: the next message reuses
            // one of them.
            let again = copy_out(&[4u8; 50]);
            assert!(at[at.len() - KEEP..].contains(&again.as_ptr()));
            // An empty message holds no buffer.
            assert!(copy_out(&[]).is_empty());
        })
        .join()
        .unwrap();
    }
}
