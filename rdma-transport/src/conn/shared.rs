//! What a connection's driver task and its halves share: the core (the
//! engine and the registered memory, behind one lock, so that whichever
//! task holds it may post), the send back-pressure and wake-ups, the
//! receive queue's accounting (§4.5), the installed inline handler, and
//! the error that ended the connection.

use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, Notify};

use super::engine_err;
use super::halves::InlineHandler;
use crate::engine::{Action, Engine};
use crate::error::Error;
use crate::mem::ConnMemory;

/// What a `SendHalf` asks of the driver (messages themselves are posted by
/// the sending task, §8).
pub(super) enum Cmd {
    Close(oneshot::Sender<()>),
}

pub(super) enum Item {
    Msg(Bytes),
    Closed,
    Err(Error),
}

/// Per-message overhead counted against `recv_queue_bytes`, so a flood of
/// empty messages is bounded too.
pub(super) const QUEUED_MSG_OVERHEAD: usize = 64;

/// The protocol engine and the registered memory of one connection, with
/// the driver's posting state. Shared by the driver task and the
/// `SendHalf` (run-to-completion sends, §8): whoever holds the lock may
/// submit, post and consume completions; no `await` happens under it, so a
/// dropped future can never leave it half-done, and a posted buffer stays
/// owned by `mem` until its completion is polled, whichever task posted it.
pub(super) struct Core {
    pub(super) engine: Engine,
    pub(super) mem: ConnMemory,
    /// Reused buffer for the engine's actions (no allocation per post).
    pub(super) actions: Vec<Action>,
    /// A post from a `SendHalf` failed: the driver ends the connection with it.
    pub(super) failed: Option<Error>,
    /// A `SendHalf` found the engine's queue full and waits on
    /// [`Shared::room`]: the driver's next step with room wakes it (and
    /// only then signals `room`: most steps have nobody to wake).
    pub(super) room_wanted: bool,
}

impl Core {
    /// Submits `head ++ body` and posts what the engine can; a failed post
    /// is recorded for the driver (the caller wakes it with `Shared::kick`).
    /// `Ok(true)`: part of it is still queued, and the driver must be woken
    /// to arm its send CQ (it may be asleep on receives only, §8).
    pub(super) fn submit_and_post(&mut self, head: Bytes, body: Bytes) -> Result<bool, Error> {
        self.engine.submit_parts(head, body);
        self.post()
            .inspect_err(|e| self.failed = Some(e.clone()))
            .map(|()| self.engine.pending_msgs() > 0)
    }

    /// Lets the engine post what it can (§4.2, §5.2).
    pub(super) fn post(&mut self) -> Result<(), Error> {
        let p = self.engine.progress(&mut self.mem);
        self.engine.swap_actions(&mut self.actions);
        // Post what was queued before a failure too: receives the engine
        // counted as posted must be.
        let r = self
            .mem
            .execute(&self.actions)
            .and(p.map_err(|e| engine_err(e, "send")));
        if !self.actions.is_empty() {
            // §4.4: no clock read per post; the keepalive looks at this.
            self.engine.note_posted();
        }
        self.actions.clear();
        r
    }
}

/// An installed [`InlineHandler`] and the delivery channel's receiver, kept
/// so the channel stays open while the handler is in place.
pub(super) struct Inline {
    pub(super) handler: InlineHandler,
    pub(super) _rx: mpsc::UnboundedReceiver<Item>,
}

pub(super) struct Shared {
    /// Set by [`RecvHalf::deliver_inline`]: the driver hands messages to it
    /// instead of the channel. Taken (dropped) to stop delivery, which
    /// closes the channel as dropping the `RecvHalf` does.
    pub(super) inline: Mutex<Option<Inline>>,
    /// `None` once the driver tore the connection down (memory freed).
    pub(super) core: Mutex<Option<Core>>,
    /// Messages the engine may hold unposted before `send` waits
    /// (`Config::send_queue_messages`).
    pub(super) send_limit: usize,
    /// Signalled by the driver when the engine's queue dropped below
    /// `send_limit` (back-pressure released) while a sender waits for it
    /// ([`Core::room_wanted`]).
    pub(super) room: Notify,
    /// Wakes the driver: a post from a `SendHalf` failed.
    pub(super) kick: Notify,
    pub(super) error: Mutex<Option<Error>>,
    /// Bytes delivered to the `RecvHalf`'s queue and not yet taken (§4.5).
    pub(super) queued: AtomicUsize,
    /// `Config::recv_queue_bytes`.
    pub(super) queue_limit: usize,
    /// Signalled when the queue drops back to the limit.
    pub(super) drained: Notify,
}

impl Shared {
    pub(super) fn new(queue_limit: usize, core: Core, send_limit: usize) -> Shared {
        Shared {
            inline: Mutex::new(None),
            core: Mutex::new(Some(core)),
            send_limit: send_limit.max(1),
            room: Notify::new(),
            kick: Notify::new(),
            error: Mutex::new(None),
            queued: AtomicUsize::new(0),
            queue_limit,
            drained: Notify::new(),
        }
    }

    pub(super) fn inline(&self) -> std::sync::MutexGuard<'_, Option<Inline>> {
        self.inline.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn core(&self) -> std::sync::MutexGuard<'_, Option<Core>> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn error(&self) -> Error {
        self.error
            .lock()
            .map(|e| e.clone())
            .ok()
            .flatten()
            .unwrap_or(Error::Disconnected)
    }
}
