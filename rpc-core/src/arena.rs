//! Small [`Bytes`] without an allocation each.
//!
//! A call makes a handful of small byte strings: the frames it sends (tens to
//! hundreds of bytes, copied into a send slot right after). Each used to be
//! its own heap allocation, and slicing a `Bytes` made from a `Vec`
//! allocated once more (its shared header). Here they are carved out of
//! a buffer of [`CHUNK`] bytes per thread instead, as `BytesMut::split` does:
//! every piece is a `Bytes` sharing that buffer, slicing and cloning it only
//! count references, and once every piece of the buffer was dropped the
//! buffer is reused from its start. A thread that makes one call at a time
//! therefore allocates nothing here in steady state. A thread keeps its
//! previous buffer too: when the current one is used up while some of its
//! pieces are alive (a BATCH is built while the frames it copies are), the
//! next pieces go to the previous one if its pieces are gone by then, not
//! to a new buffer.
//!
//! **Memory.** A piece that is kept keeps its whole buffer: at most
//! [`CHUNK`] bytes per live piece, against the piece's own size. That suits
//! what lives for a moment (an outgoing frame until it is posted), not what
//! someone else decides to keep: received messages are not carved from here,
//! since a header value or a queued frame kept by a slow handler would hold
//! a whole buffer each, and a peer sending many small messages could
//! multiply the memory it holds on us. Pieces larger than [`MAX_PIECE`] get
//! an allocation of their own, so a buffer always holds at least four.

use bytes::{Bytes, BytesMut};
use std::cell::RefCell;

/// Bytes of each buffer pieces are carved from.
pub const CHUNK: usize = 4 * 1024;

/// Largest piece taken from the thread's buffer; a larger one is allocated
/// on its own.
pub const MAX_PIECE: usize = CHUNK / 4;

/// A thread's buffers: pieces are carved from `current`; `previous` is
/// the one before, kept for when `current` is used up while some of its
/// pieces are alive (a BATCH is built while the frames it copies are).
#[derive(Default)]
struct Buffers {
    current: BytesMut,
    previous: BytesMut,
}

thread_local! {
    /// The thread's buffers; empty (`len() == 0`) between two pieces.
    static BUF: RefCell<Buffers> = RefCell::new(Buffers::default());
}

/// A piece of about `len` bytes written by `f`, as [`build`] for a writer
/// that cannot fail.
pub fn fill(len: usize, f: impl FnOnce(&mut BytesMut)) -> Bytes {
    build(len, |b| {
        f(b);
        Ok::<(), std::convert::Infallible>(())
    })
    .unwrap_or_else(|e| match e {})
}

/// A piece of about `len` bytes written by `f` (which appends to the empty
/// `BytesMut` it is given; it may write more than `len`, at the cost of an
/// allocation). When `f` fails, nothing it wrote is kept.
pub fn build<E>(len: usize, f: impl FnOnce(&mut BytesMut) -> Result<(), E>) -> Result<Bytes, E> {
    let mut f = Some(f);
    if len <= MAX_PIECE {
        // Not on this thread's buffer only while the thread is exiting
        // (`try_with` fails) or from inside `f` itself (`try_borrow_mut`
        // fails): both fall through to an allocation of its own.
        let r = BUF.try_with(|cell| {
            let Ok(mut bufs) = cell.try_borrow_mut() else {
                return None;
            };
            let bufs = &mut *bufs;
            debug_assert!(bufs.current.is_empty() && bufs.previous.is_empty());
            if bufs.current.capacity() < len && !bufs.current.try_reclaim(CHUNK) {
                // Some piece of the current buffer is still alive: go on in
                // the previous one if it has room or its pieces are gone by
                // now, else leave it to its pieces and start a new one.
                std::mem::swap(&mut bufs.current, &mut bufs.previous);
                if bufs.current.capacity() < len && !bufs.current.try_reclaim(CHUNK) {
                    bufs.current = BytesMut::with_capacity(CHUNK);
                }
            }
            let b = &mut bufs.current;
            let f = f.take().expect("taken once");
            Some(match f(b) {
                Ok(()) => Ok(b.split().freeze()),
                Err(e) => {
                    b.clear();
                    Err(e)
                }
            })
        });
        if let Ok(Some(r)) = r {
            return r;
        }
    }
    let mut b = BytesMut::with_capacity(len);
    (f.take().expect("not taken above"))(&mut b)?;
    Ok(b.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(src: &[u8]) -> Bytes {
        fill(src.len(), |b| b.extend_from_slice(src))
    }

    #[test]
    fn pieces_are_independent_and_the_buffer_is_reused_once_they_are_gone() {
        let a = copy(b"first");
        let b = copy(b"second");
        assert_eq!((&a[..], &b[..]), (&b"first"[..], &b"second"[..]));
        // Both share one buffer: b starts right after a.
        assert_eq!(a.as_ptr().wrapping_add(a.len()), b.as_ptr());
        let start = a.as_ptr();
        drop((a, b));
        // Fill the rest of the buffer, then one more piece: with every
        // earlier piece gone, it lands at the buffer's start again.
        let mut n = 0;
        loop {
            let p = copy(&[7u8; 1000]);
            if p.as_ptr() == start {
                break;
            }
            n += 1;
            assert!(n <= CHUNK / 1000, "buffer never reused");
        }
    }

    #[test]
    fn a_live_piece_keeps_its_buffer_and_new_pieces_go_elsewhere() {
        let held = copy(&[1u8; MAX_PIECE]);
        let mut others = Vec::new();
        for i in 0..8u8 {
            others.push(copy(&[i; MAX_PIECE]));
        }
        others.clear();
        assert!(held.iter().all(|&x| x == 1), "a kept piece never changes");
        for (i, p) in (0..8u8).map(|i| (i, copy(&[i; 100]))) {
            assert!(p.iter().all(|&x| x == i));
            assert!(
                !(held.as_ptr() <= p.as_ptr()
                    && p.as_ptr() < held.as_ptr().wrapping_add(held.len())),
                "a new piece overlaps a live one"
            );
        }
    }

    #[test]
    fn a_used_up_buffer_with_live_pieces_gives_way_to_the_previous_one() {
        // Fill one buffer and keep its pieces: the next piece starts a
        // second buffer.
        let first: Vec<Bytes> = (0..CHUNK / MAX_PIECE)
            .map(|_| copy(&[1u8; MAX_PIECE]))
            .collect();
        let first_start = first[0].as_ptr();
        let in_first =
            |p: &Bytes| first_start <= p.as_ptr() && p.as_ptr() < first_start.wrapping_add(CHUNK);
        let second: Vec<Bytes> = (0..CHUNK / MAX_PIECE)
            .map(|_| copy(&[2u8; MAX_PIECE]))
            .collect();
        assert!(
            second.iter().all(|p| !in_first(p)),
            "a live buffer is not written over"
        );
        // The second is used up and still held; the first's pieces are gone:
        // the next piece goes back to the first buffer's start.
        drop(first);
        let next = copy(b"next");
        assert_eq!(next.as_ptr(), first_start);
        assert!(second.iter().all(|p| p.iter().all(|&x| x == 2)));
    }

    #[test]
    fn large_pieces_and_failures() {
        let big = copy(&vec![3u8; MAX_PIECE + 1]);
        assert_eq!(big.len(), MAX_PIECE + 1);
        let e = build(10, |b| {
            b.extend_from_slice(b"partial");
            Err("no")
        });
        assert_eq!(e, Err("no"));
        // Nothing of the failed piece is left in the next one.
        assert_eq!(&copy(b"next")[..], b"next");
        // A piece larger than announced is still whole.
        let p = build(2, |b| {
            b.extend_from_slice(&[9u8; 300]);
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!(p.len(), 300);
    }
}
