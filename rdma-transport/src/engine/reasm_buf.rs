//! The buffers large messages are reassembled in (§5.3: each chunk is
//! copied out of its rendezvous buffer into the message's), reused by the
//! thread that reassembles them ([`crate::kept`]).
//!
//! A large message is a `Bytes` over its reassembly buffer, which the
//! thread keeps a handle of. The application usually drops a message soon
//! (tonic's decoder copies a body frame into its own buffer and drops it);
//! once every `Bytes` of it was dropped, on whatever thread, the thread
//! reassembles its next large message into it. A connection that receives
//! one 1 MiB message at a time then allocates nothing here in steady
//! state, where it allocated the message's size per message. Memory: at
//! most [`crate::kept::KEEP`] buffers of at most
//! [`crate::kept::KEEP_MAX_BYTES`], [`crate::kept::KEEP_TOTAL_BYTES`]
//! together, per thread beside live messages; a message the application
//! keeps holds at most twice its size.

use crate::kept::{self, KeptBuffers};
use bytes::{Bytes, BytesMut};

thread_local! {
    /// The thread's handles of reassembly buffers.
    static POOL: KeptBuffers = const { KeptBuffers::new() };
}

/// An empty buffer of at least `cap` bytes' capacity for a message to be
/// reassembled in: one the thread kept, when a message of its no longer
/// holds it, else a new one.
pub(super) fn take(cap: usize) -> BytesMut {
    kept::take(&POOL, cap)
}

/// The reassembled message in `buf` (from [`take`]); the thread keeps a
/// handle of the buffer for a later message.
pub(super) fn finish(buf: BytesMut) -> Bytes {
    kept::finish(&POOL, buf)
}
