//! The application's side of a connection: the [`SendHalf`], which posts
//! its messages itself from the calling task when it can (§8), the
//! [`RecvHalf`] with its queue or its inline handler, and [`InlineStop`].

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::shared::{Cmd, Inline, Item, Shared, QUEUED_MSG_OVERHEAD};
use crate::error::Error;

/// [`SendHalf::try_send_parts`] posts at once only while fewer sent
/// messages than this are unacknowledged by the peer.
pub const QUIET_UNRETURNED: u32 = 2;

/// A receive handler run by the connection's driver task for each message
/// (see [`RecvHalf::deliver_inline`]).
pub type InlineHandler = Box<dyn FnMut(Result<Option<Bytes>, Error>) -> bool + Send>;

/// Sending half. Dropping it closes the sending direction (like `close`).
pub struct SendHalf {
    pub(super) tx: mpsc::Sender<Cmd>,
    pub(super) shared: Arc<Shared>,
    pub(super) max: usize,
    pub(super) chunk: usize,
    pub(super) closed: bool,
}

impl SendHalf {
    /// Largest message [`SendHalf::send`] accepts (min of both sides' limits).
    pub fn max_message_len(&self) -> usize {
        self.max
    }

    /// Queues `msg` for sending. Waits while the driver's queue is full
    /// (back-pressure from credits / rendezvous buffers). `Ok` means the
    /// driver took ownership; delivery errors show up on later calls.
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] after [`close`](Self::close),
    /// [`Error::MessageTooLarge`] above [`max_message_len`](Self::max_message_len),
    /// and, once the connection failed, the error that ended it (e.g.
    /// [`Error::Disconnected`], [`Error::Protocol`], or
    /// [`Error::ResourceLimit`] when memory a message needed could not be
    /// registered).
    pub async fn send(&mut self, msg: Bytes) -> Result<(), Error> {
        self.send_parts(Bytes::new(), msg).await
    }

    /// As [`send`](Self::send), for the message `head` followed by `body`
    /// (e.g. a frame header and a payload), without joining them first: the
    /// bytes are copied once, into registered memory, as they are posted; a
    /// `body` of at least `Config::zero_copy_send_bytes` is not copied at all
    /// but registered and written from where it is (the connection holds a
    /// reference to it until the NIC is done, `docs/wire-protocol-rdma.md`
    /// §5.1).
    ///
    /// The calling task posts the message itself (§8): when the connection
    /// has credits and room, the SEND (or the first rendezvous WRITEs) is
    /// on the wire when this returns, with no hop through the driver task.
    /// What cannot be posted yet stays queued in the engine (up to
    /// `Config::send_queue_messages` messages; beyond that this waits) and
    /// the driver posts it as credits come back.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send).
    pub async fn send_parts(&mut self, head: Bytes, body: Bytes) -> Result<(), Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        let len = head.len() + body.len();
        if len > self.max {
            return Err(Error::MessageTooLarge { len, max: self.max });
        }
        let mut msg = Some((head, body));
        loop {
            // Registered before looking, so a release between the look and
            // the wait is not lost.
            let room = self.shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut g = self.shared.core();
                let Some(core) = g.as_mut() else {
                    return Err(self.shared.error());
                };
                if let Some(e) = &core.failed {
                    return Err(e.clone());
                }
                if core.engine.pending_msgs() < self.shared.send_limit {
                    let (head, body) = msg.take().expect("message not yet submitted");
                    let r = core.submit_and_post(head, body);
                    drop(g);
                    if !matches!(r, Ok(false)) {
                        self.shared.kick.notify_one();
                    }
                    return r.map(|_| ());
                }
                // Full: the driver signals `room` once it has some.
                core.room_wanted = true;
            }
            room.await;
        }
    }

    /// Posts `head ++ body` now, from the calling task, if the connection
    /// is quiet: no message is waiting in the engine and fewer than
    /// 2 sent messages are still unacknowledged by the
    /// peer. Otherwise gives the parts back (`Err`), so that the caller can
    /// queue them and send several together later (the call layer then
    /// batches frames into one message, which costs the peer one receive
    /// instead of several): low latency when there is little traffic, fewer
    /// messages when there is a lot.
    ///
    /// # Errors
    ///
    /// `Err((head, body))` when the connection is not quiet (nothing was
    /// posted); `Ok(Err(e))` with the errors of [`send`](Self::send).
    #[allow(clippy::type_complexity)]
    pub fn try_send_parts(
        &mut self,
        head: Bytes,
        body: Bytes,
    ) -> Result<Result<(), Error>, (Bytes, Bytes)> {
        if self.closed {
            return Ok(Err(Error::Closed));
        }
        let len = head.len() + body.len();
        if len > self.max {
            return Ok(Err(Error::MessageTooLarge { len, max: self.max }));
        }
        let mut g = self.shared.core();
        let Some(core) = g.as_mut() else {
            return Ok(Err(self.shared.error()));
        };
        if let Some(e) = &core.failed {
            return Ok(Err(e.clone()));
        }
        if core.engine.pending_msgs() > 0 || core.engine.unreturned_credits() >= QUIET_UNRETURNED {
            return Err((head, body));
        }
        let r = core.submit_and_post(head, body);
        drop(g);
        if !matches!(r, Ok(false)) {
            self.shared.kick.notify_one();
        }
        Ok(r.map(|_| ()))
    }

    /// Bytes per rendezvous chunk on this connection (§5.2): a message
    /// larger than the eager limit moves in pieces of this size, so one whose
    /// length is a multiple of it fills whole rendezvous buffers.
    pub fn chunk_len(&self) -> usize {
        self.chunk
    }

    /// Sends CLOSE after all queued messages and waits until it was
    /// transmitted (or the connection failed). The peer's `recv` then
    /// returns `Ok(None)`. Idempotent.
    pub async fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Close(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

impl std::fmt::Debug for SendHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendHalf")
            .field("max_message_len", &self.max)
            .field("closed", &self.closed)
            .finish()
    }
}

/// Stops inline delivery ([`RecvHalf::deliver_inline`]) from any task.
pub struct InlineStop(Arc<Shared>);

impl InlineStop {
    /// Removes the handler (after the call it may be running returns): no
    /// message is delivered after this, as if the `RecvHalf` was dropped.
    pub fn stop(&self) {
        let h = self.0.inline().take();
        drop(h);
    }
}

impl std::fmt::Debug for InlineStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InlineStop")
    }
}

/// Receiving half.
pub struct RecvHalf {
    pub(super) rx: mpsc::UnboundedReceiver<Item>,
    pub(super) shared: Arc<Shared>,
    pub(super) done: bool,
}

impl RecvHalf {
    /// Hands every received message to `f` right in the connection's
    /// driver task, as soon as it is taken from registered memory (§8): no
    /// task hop between the completion and `f`. Then `Ok(None)` once the
    /// peer closed cleanly, or the error that ends the connection. Messages
    /// that arrived before this call go to `f` first, in order.
    ///
    /// `f` runs on the driver: it must not block (it may send on this
    /// connection). Returning `false` stops delivery, as dropping the
    /// `RecvHalf` does; so does [`InlineStop::stop`]. Receive back-pressure
    /// (`Config::recv_queue_bytes`) does not apply: `f` takes each message
    /// at once.
    pub fn deliver_inline(mut self, mut f: InlineHandler) -> InlineStop {
        let shared = self.shared.clone();
        let mut g = shared.inline();
        // Under the lock the driver delivers with: nothing overtakes these.
        let mut keep = !self.done;
        while keep {
            let r = match self.rx.try_recv() {
                Ok(Item::Msg(b)) => {
                    let n = b.len() + QUEUED_MSG_OVERHEAD;
                    self.shared.queued.fetch_sub(n, Ordering::AcqRel);
                    Ok(Some(b))
                }
                Ok(Item::Closed) => Ok(None),
                Ok(Item::Err(e)) => Err(e),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => Err(self.shared.error()),
            };
            let end = !matches!(r, Ok(Some(_)));
            keep = f(r) && !end;
        }
        if keep {
            *g = Some(Inline {
                handler: f,
                _rx: self.rx,
            });
        }
        // The queue was drained: a driver holding returns may release them.
        self.shared.drained.notify_one();
        drop(g);
        InlineStop(shared)
    }

    /// Next message, `Ok(None)` once the peer closed cleanly. The returned
    /// bytes are owned by the caller (copied out of registered memory).
    ///
    /// # Errors
    ///
    /// The error that ended the connection: e.g. [`Error::Disconnected`]
    /// when the peer went without a clean close, [`Error::Protocol`] when it
    /// broke the protocol, [`Error::Completion`] for a failed work request.
    pub async fn recv(&mut self) -> Result<Option<Bytes>, Error> {
        if self.done {
            return Ok(None);
        }
        match self.rx.recv().await {
            Some(Item::Msg(b)) => {
                // §4.5: the driver holds credit returns while the queue is
                // over its limit; wake it when we drain back under.
                let n = b.len() + QUEUED_MSG_OVERHEAD;
                let before = self.shared.queued.fetch_sub(n, Ordering::AcqRel);
                let limit = self.shared.queue_limit;
                if before > limit && before - n <= limit {
                    self.shared.drained.notify_one();
                }
                Ok(Some(b))
            }
            Some(Item::Closed) => {
                self.done = true;
                Ok(None)
            }
            Some(Item::Err(e)) => Err(e),
            None => Err(self.shared.error()),
        }
    }
}

impl std::fmt::Debug for RecvHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvHalf")
            .field("done", &self.done)
            .finish()
    }
}
