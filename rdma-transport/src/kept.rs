//! Large heap buffers a thread reuses once every `Bytes` over them was
//! dropped: a buffer a large message is written into (reassembled from its
//! rendezvous chunks here, encoded by rpc-core before it is sent) is handed
//! out as a `Bytes`, and the thread keeps a handle of it. When the message
//! is gone (on whatever thread it was dropped), the handle is the buffer's
//! only owner and the thread writes its next large message into it
//! (`BytesMut::try_reclaim`, which succeeds only then). A thread that moves
//! one large message at a time then allocates nothing for them in steady
//! state, and its buffers stay mapped (a fresh buffer of 1 MiB is 256 page
//! faults, as costly as copying it several times in a virtual machine).
//!
//! **Memory.** A pool keeps handles of at most [`KEEP`] buffers per
//! thread, none larger than [`KEEP_MAX_BYTES`], [`KEEP_TOTAL_BYTES`] of
//! them together: 8 MiB per thread and pool at most beside what live
//! messages hold, for the thread's life (so 8 messages of 1 MiB in flight
//! reuse their buffers as well as one at a time does). A kept buffer is reused
//! only for a message of at least half its size, so a message the
//! application keeps holds at most twice its size (or 64 KiB). A message
//! whose buffer is still held gets a new one, which takes the place of the
//! oldest handle. A live message is never written again: nothing is
//! reused while a `Bytes` of it exists.
//!
//! Each use declares a pool of its own, so that uses on one thread do not
//! evict each other's buffers:
//!
//! ```
//! use rdma_transport::kept::{self, KeptBuffers};
//!
//! thread_local! {
//!     static POOL: KeptBuffers = const { KeptBuffers::new() };
//! }
//!
//! let mut buf = kept::take(&POOL, 1 << 20);
//! buf.extend_from_slice(b"a large message");
//! let msg = kept::finish(&POOL, buf);
//! assert_eq!(&msg[..], b"a large message");
//! ```

use bytes::{Bytes, BytesMut};
use std::cell::RefCell;
use std::thread::LocalKey;

/// Buffers kept per thread and pool: as many as large messages are
/// usually in flight on a connection (the bench's 8), within
/// [`KEEP_TOTAL_BYTES`].
pub const KEEP: usize = 8;

/// Largest buffer kept: larger messages' buffers are freed with them.
pub const KEEP_MAX_BYTES: usize = 4 << 20;

/// Most bytes a pool keeps on one thread, all its buffers together: the
/// oldest handles go first.
pub const KEEP_TOTAL_BYTES: usize = 8 << 20;

/// Smallest size a kept buffer is reused for regardless of the half rule.
const SMALL: usize = 64 << 10;

/// One thread's handles of large buffers, for one use (see the module
/// documentation); declared in a `thread_local!`. Each handle with the
/// size of its buffer (a handle's own capacity is what its message left).
#[derive(Debug, Default)]
pub struct KeptBuffers(RefCell<Vec<(usize, BytesMut)>>);

impl KeptBuffers {
    /// An empty pool.
    pub const fn new() -> KeptBuffers {
        KeptBuffers(RefCell::new(Vec::new()))
    }
}

/// An empty buffer of at least `cap` bytes' capacity for a message: one
/// this thread kept in `pool` whose message is gone, else a new one.
pub fn take(pool: &'static LocalKey<KeptBuffers>, cap: usize) -> BytesMut {
    let reused = pool
        .try_with(|p| {
            let mut p = p.0.try_borrow_mut().ok()?;
            let i = p
                .iter_mut()
                .position(|(_, b)| b.try_reclaim(cap) && b.capacity() <= (2 * cap).max(SMALL))?;
            Some(p.remove(i).1)
        })
        .ok()
        .flatten();
    reused.unwrap_or_else(|| BytesMut::with_capacity(cap))
}

/// The message written in `buf` (from [`take`]); the thread keeps a handle
/// of the buffer in `pool` for a later message.
pub fn finish(pool: &'static LocalKey<KeptBuffers>, mut buf: BytesMut) -> Bytes {
    let size = buf.capacity();
    let msg = buf.split().freeze();
    if size <= KEEP_MAX_BYTES {
        // A thread that is exiting (no pool any more) frees it instead.
        let _ = pool.try_with(|p| {
            if let Ok(mut p) = p.0.try_borrow_mut() {
                p.push((size, buf));
                let mut total: usize = p.iter().map(|(n, _)| n).sum();
                while p.len() > KEEP || total > KEEP_TOTAL_BYTES {
                    total -= p.remove(0).0;
                }
            }
        });
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static POOL: KeptBuffers = const { KeptBuffers::new() };
    }

    fn message(fill: u8, len: usize) -> Bytes {
        let mut b = take(&POOL, len);
        b.extend_from_slice(&vec![fill; len]);
        finish(&POOL, b)
    }

    #[test]
    fn reuses_a_buffer_once_its_message_is_dropped_and_never_changes_a_live_one() {
        // On a thread of its own: the pool is the thread's.
        std::thread::spawn(|| {
            let a = message(1, 1 << 20);
            let at = a.as_ptr();
            let part = a.slice(10..20);
            drop(a);
            // Still held by a slice: the next message gets another buffer.
            let b = message(2, 1 << 20);
            assert_ne!(b.as_ptr(), at);
            assert!(part.iter().all(|&x| x == 1), "a live message never changes");
            drop(part);
            // Free now: the next message of a fitting size reuses it.
            let c = message(3, 1 << 20);
            assert!(c.as_ptr() == at || c.as_ptr() == b.as_ptr());
            assert!(b.iter().all(|&x| x == 2) && c.iter().all(|&x| x == 3));
            drop((b, c));
            // A buffer is reused only for a message of at least half its
            // size (or up to 64 KiB): a kept message holds at most twice
            // its size.
            let small = message(4, 100 << 10);
            assert!(small.as_ptr() != at);
            drop(small);
            // Larger than KEEP_MAX_BYTES: not kept.
            drop(message(5, KEEP_MAX_BYTES + 1));
            POOL.with(|p| {
                let mut p = p.0.borrow_mut();
                assert!(p
                    .iter_mut()
                    .all(|(_, b)| !b.try_reclaim(KEEP_MAX_BYTES + 1)));
            });
            // At most KEEP handles, however many messages are alive.
            let many: Vec<Bytes> = (0..3 * KEEP).map(|i| message(i as u8, 1000)).collect();
            for (i, m) in many.iter().enumerate() {
                assert!(m.iter().all(|&x| x == i as u8));
            }
            POOL.with(|p| assert!(p.0.borrow().len() <= KEEP));
            // And at most KEEP_TOTAL_BYTES of them: 3 MiB messages, two
            // kept at a time.
            let big: Vec<Bytes> = (0..4).map(|i| message(i, 3 << 20)).collect();
            POOL.with(|p| {
                let p = p.0.borrow();
                let total: usize = p.iter().map(|(n, _)| n).sum();
                assert!(total <= KEEP_TOTAL_BYTES, "{total}");
                assert_eq!(p.iter().filter(|(n, _)| *n >= 3 << 20).count(), 2);
            });
            drop(big);
        })
        .join()
        .expect("test thread");
    }

    #[test]
    fn pools_of_one_thread_keep_their_own_buffers() {
        thread_local! {
            static OTHER: KeptBuffers = const { KeptBuffers::new() };
        }
        std::thread::spawn(|| {
            let a = message(1, 1 << 20);
            let at = a.as_ptr();
            drop(a);
            // Another pool of the same thread does not take it ...
            let mut o = take(&OTHER, 1 << 20);
            assert_ne!(o.as_ptr(), at);
            o.extend_from_slice(&[9; 16]);
            let o = finish(&OTHER, o);
            // ... and does not evict it: it is still there for its own.
            let b = message(2, 1 << 20);
            assert_eq!(b.as_ptr(), at);
            assert_eq!(&o[..], &[9; 16]);
        })
        .join()
        .expect("test thread");
    }
}
