//! Server calls a connection message opened, and where their handlers run.
//!
//! A message that opens one call (the usual unary call at low load: OPEN and
//! DATA(END_STREAM) in one BATCH) runs the call's first poll right after the
//! whole message was dispatched, in the task that read the message — on
//! RDMA the connection's driver, right after the completion. A handler that
//! needs nothing else (most unary handlers) decodes its request, runs and
//! posts its reply there: no task is spawned, scheduled or switched to, and
//! the reply leaves before the driver goes back to its loop. A handler that
//! is still pending after that poll is spawned as before, and so is every
//! further call a message opens (under load, calls run in parallel on the
//! runtime's workers).
//!
//! The first poll runs under `catch_unwind`: a handler that panics fails its
//! call with INTERNAL instead of taking the connection's task down.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use tonic::Status;

use super::Shared;

/// A server call, not started yet: what [`AcceptFn`](super::AcceptFn) returns.
pub(crate) use super::call_box::CallFuture;

/// The calls one message opened so far (see the module docs).
#[derive(Default)]
pub(crate) struct Opened {
    /// The message's first call, run in place once the message is dispatched.
    first: Option<(u32, CallFuture)>,
}

impl Opened {
    /// A call the message opened: the first is kept, the others spawned.
    pub(crate) fn add(&mut self, shared: &Arc<Shared>, stream: u32, call: CallFuture) {
        if self.first.is_none() {
            self.first = Some((stream, call));
        } else {
            spawn(shared, stream, call);
        }
    }

    /// After the message: the first call's first poll, here; spawned if it
    /// is not finished.
    pub(crate) fn run(self, shared: &Arc<Shared>) {
        let Some((stream, mut call)) = self.first else {
            return;
        };
        if !shared.has_stream(stream) {
            // Reset (or failed) within the same message: never started, as a
            // spawned handler aborted before its first poll.
            return;
        }
        // The waker is a no-op: a call still pending after this poll is
        // spawned, and the task's first poll registers its own waker with
        // whatever the call waits for (a future must honour the waker of its
        // latest poll).
        let mut cx = Context::from_waker(Waker::noop());
        match catch_unwind(AssertUnwindSafe(|| Pin::new(&mut call).poll(&mut cx))) {
            Ok(Poll::Ready(())) => {}
            Ok(Poll::Pending) => spawn(shared, stream, call),
            Err(_) => {
                tracing::error!(stream, peer = ?shared.info.peer, "a call's handler panicked");
                drop(call);
                shared.reset_stream(stream, Status::internal("the server's handler panicked"));
            }
        }
    }
}

/// Runs `call` as its own task; a RESET or the connection's end aborts it.
fn spawn(shared: &Arc<Shared>, stream: u32, call: CallFuture) {
    let handle = tokio::spawn(call).abort_handle();
    shared.set_handler(stream, handle);
}
