//! The buffers large messages are reassembled in (§5.3: each chunk is
//! copied out of its rendezvous buffer into the message's), reused by the
//! thread that reassembles them.
//!
//! A large message is a `Bytes` over its reassembly buffer, which the
//! thread keeps a handle of (`BytesMut::split`, as in `recv_buf`). The
//! application usually drops a message soon (tonic's decoder copies a body
//! frame into its own buffer and drops it); once every `Bytes` of it was
//! dropped, on whatever thread, the handle is the buffer's only owner and
//! the thread reassembles its next large message into it
//! (`BytesMut::try_reclaim`, which succeeds only then). A connection that
//! receives one 1 MiB message at a time then allocates nothing here in
//! steady state, where it allocated the message's size per message.
//!
//! **Memory.** A thread keeps handles of [`KEEP`] buffers, none larger than
//! [`KEEP_MAX_BYTES`]: 8 MiB per thread at most beside what live messages
//! hold, for the thread's life. A kept buffer is reused only for a message
//! of at least half its size, so a message the application keeps holds at
//! most twice its size (or 64 KiB). A message whose buffer is still held
//! gets a new one, which takes the place of the oldest handle.

use bytes::{Bytes, BytesMut};
use std::cell::RefCell;

/// Buffers kept per thread: one message being read by the application
/// while the next one is reassembled.
const KEEP: usize = 2;

/// Largest buffer kept: larger messages' buffers are freed with them.
const KEEP_MAX_BYTES: usize = 4 << 20;

/// Smallest size a kept buffer is reused for regardless of the half rule.
const SMALL: usize = 64 << 10;

thread_local! {
    /// The thread's handles of reassembly buffers (each empty; its buffer
    /// may still be held by the message reassembled in it).
    static POOL: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer of at least `cap` bytes' capacity for a message to be
/// reassembled in: one the thread kept, when a message of its no longer
/// holds it, else a new one.
pub(super) fn take(cap: usize) -> BytesMut {
    let reused = POOL
        .try_with(|p| {
            let mut p = p.try_borrow_mut().ok()?;
            let i = p
                .iter_mut()
                .position(|b| b.try_reclaim(cap) && b.capacity() <= (2 * cap).max(SMALL))?;
            Some(p.remove(i))
        })
        .ok()
        .flatten();
    reused.unwrap_or_else(|| BytesMut::with_capacity(cap))
}

/// The reassembled message in `buf` (from [`take`]); the thread keeps a
/// handle of the buffer for a later message.
pub(super) fn finish(mut buf: BytesMut) -> Bytes {
    let size = buf.capacity();
    let msg = buf.split().freeze();
    if size <= KEEP_MAX_BYTES {
        // A thread that is exiting (no pool any more) frees it instead.
        let _ = POOL.try_with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                if p.len() == KEEP {
                    p.remove(0);
                }
                p.push(buf);
            }
        });
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(fill: u8, len: usize) -> Bytes {
        let mut b = take(len);
        b.extend_from_slice(&vec![fill; len]);
        finish(b)
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
                let mut p = p.borrow_mut();
                assert!(p.iter_mut().all(|b| !b.try_reclaim(KEEP_MAX_BYTES + 1)));
            });
            // At most KEEP handles, however many messages are alive.
            let many: Vec<Bytes> = (0..3 * KEEP).map(|i| message(i as u8, 1000)).collect();
            for (i, m) in many.iter().enumerate() {
                assert!(m.iter().all(|&x| x == i as u8));
            }
            POOL.with(|p| assert!(p.borrow().len() <= KEEP));
        })
        .join()
        .expect("test thread");
    }
}
