//! Send windows that can be waited on (`docs/wire-protocol.md` §1.4): one
//! per call, one for the connection.
//!
//! The accounting is [`SendCredit`], a value (checked arithmetic, a protocol
//! error on overflow, never a wrap); this adds the waiting for credit and the
//! closing of a call's window when the call ends.

use crate::protocol::flow::SendCredit;
#[cfg(test)]
use crate::protocol::flow::MAX_WINDOW;
use crate::PeerMisbehaved;
use std::sync::Mutex;
use tokio::sync::Notify;
use tonic::Status;

#[derive(Debug)]
struct State {
    credit: SendCredit,
    closed: Closed,
    /// A task waits on `notify` (it said so under this lock, after
    /// registering its wait): a grant or the close signals only then, and
    /// the window of a call nobody waits on costs no wake-up.
    waiting: bool,
}

/// Why a window no longer takes reservations.
#[derive(Debug)]
enum Closed {
    Open,
    /// The call ended normally: its status is built only if someone asks
    /// (a normal end costs no allocation).
    Finished,
    Failed(Status),
}

impl Closed {
    fn status(&self) -> Option<Status> {
        match self {
            Closed::Open => None,
            Closed::Finished => Some(Status::cancelled("call finished")),
            Closed::Failed(s) => Some(s.clone()),
        }
    }
}

/// Bytes of DATA the local side may still send on one call.
#[derive(Debug)]
pub(crate) struct SendWindow {
    state: Mutex<State>,
    notify: Notify,
}

impl SendWindow {
    pub(crate) fn new(initial: u32) -> Self {
        SendWindow {
            state: Mutex::new(State {
                credit: SendCredit::new(initial),
                closed: Closed::Open,
                waiting: false,
            }),
            notify: Notify::new(),
        }
    }

    /// As [`reserve`](Self::reserve) without waiting: `None` when it would
    /// wait (no window open now).
    pub(crate) fn try_reserve(&self, want: usize) -> Option<Result<usize, Status>> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = s.closed.status() {
            return Some(Err(st));
        }
        if want == 0 {
            return Some(Ok(0));
        }
        match s.credit.take(want) {
            0 => None,
            n => Some(Ok(n)),
        }
    }

    /// Takes exactly `n` bytes if the window holds them now; `None` (and
    /// nothing taken) when it holds fewer.
    pub(crate) fn try_reserve_exact(&self, n: usize) -> Option<Result<(), Status>> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = s.closed.status() {
            return Some(Err(st));
        }
        if usize::try_from(s.credit.available()).unwrap_or(0) < n {
            return None;
        }
        s.credit.take(n);
        Some(Ok(()))
    }

    /// Waits until some window is open and takes up to `want` bytes of it.
    /// Fails once the call is closed.
    pub(crate) async fn reserve(&self, want: usize) -> Result<usize, Status> {
        loop {
            let notified = self.notify.notified();
            {
                let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(st) = s.closed.status() {
                    return Err(st);
                }
                if want == 0 {
                    return Ok(0);
                }
                let n = s.credit.take(want);
                if n > 0 {
                    return Ok(n);
                }
                s.waiting = true;
            }
            notified.await;
        }
    }

    /// Adds credit from a WINDOW_UPDATE on `stream` (0 = the connection).
    /// Errors if the window would exceed
    /// [`MAX_WINDOW`](crate::protocol::flow::MAX_WINDOW).
    pub(crate) fn grant(&self, stream: u32, inc: u32) -> Result<(), PeerMisbehaved> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.credit.grant(stream, inc)?;
        let wake = std::mem::take(&mut s.waiting);
        drop(s);
        if wake {
            self.notify.notify_waiters();
        }
        Ok(())
    }

    /// Closes the window: pending and future `reserve` calls fail with `status`.
    pub(crate) fn close(&self, status: Status) {
        self.close_with(Closed::Failed(status));
    }

    /// Closes the window of a call that ended normally: `reserve` fails with
    /// CANCELLED "call finished".
    pub(crate) fn finish(&self) {
        self.close_with(Closed::Finished);
    }

    fn close_with(&self, closed: Closed) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(s.closed, Closed::Open) {
            s.closed = closed;
        }
        let wake = std::mem::take(&mut s.waiting);
        drop(s);
        if wake {
            self.notify.notify_waiters();
        }
    }

    /// The status the window was closed with, if any.
    #[cfg(test)]
    pub(crate) fn closed(&self) -> Option<Status> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .closed
            .status()
    }

    /// Waits until the window is closed.
    pub(crate) async fn wait_closed(&self) -> Status {
        loop {
            let notified = self.notify.notified();
            {
                let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(st) = s.closed.status() {
                    return st;
                }
                s.waiting = true;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn reserve_waits_for_grant_and_never_exceeds() {
        let w = Arc::new(SendWindow::new(10));
        assert_eq!(w.reserve(4).await.unwrap(), 4);
        assert_eq!(w.reserve(100).await.unwrap(), 6);
        let w2 = w.clone();
        let t = tokio::spawn(async move { w2.reserve(5).await });
        tokio::task::yield_now().await;
        assert!(!t.is_finished());
        w.grant(1, 3).unwrap();
        assert_eq!(t.await.unwrap().unwrap(), 3);
    }

    #[tokio::test]
    async fn each_waiter_is_woken_by_what_it_waits_for() {
        let w = Arc::new(SendWindow::new(0));
        let (w1, w2, w3) = (w.clone(), w.clone(), w.clone());
        let reserving = tokio::spawn(async move { w1.reserve(5).await });
        let closing = tokio::spawn(async move { w2.wait_closed().await });
        tokio::task::yield_now().await;
        // A grant wakes every waiter; the one waiting for the close finds
        // the window open and registers again, as does a later reserve.
        w.grant(1, 3).unwrap();
        assert_eq!(reserving.await.unwrap().unwrap(), 3);
        let again = tokio::spawn(async move { w3.reserve(1).await });
        tokio::task::yield_now().await;
        assert!(!again.is_finished() && !closing.is_finished());
        w.grant(1, 1).unwrap();
        assert_eq!(again.await.unwrap().unwrap(), 1);
        tokio::task::yield_now().await;
        assert!(!closing.is_finished(), "a grant does not close the window");
        w.close(Status::cancelled("gone"));
        assert_eq!(closing.await.unwrap().message(), "gone");
    }

    #[test]
    fn an_exact_reserve_takes_all_or_nothing() {
        let w = SendWindow::new(10);
        assert!(w.try_reserve_exact(11).is_none());
        assert!(matches!(w.try_reserve_exact(10), Some(Ok(()))));
        assert!(w.try_reserve_exact(1).is_none());
        w.grant(1, 5).unwrap();
        assert!(matches!(w.try_reserve_exact(5), Some(Ok(()))));
        w.close(Status::cancelled("gone"));
        assert!(matches!(w.try_reserve_exact(0), Some(Err(_))));
    }

    #[tokio::test]
    async fn close_wakes_waiters_and_overflow_is_an_error() {
        let w = Arc::new(SendWindow::new(0));
        let w2 = w.clone();
        let t = tokio::spawn(async move { w2.reserve(5).await });
        tokio::task::yield_now().await;
        w.close(Status::cancelled("gone"));
        assert_eq!(t.await.unwrap().unwrap_err().code(), tonic::Code::Cancelled);
        // The first close wins; a finished window says so.
        w.finish();
        assert_eq!(w.closed().unwrap().message(), "gone");
        let f = SendWindow::new(10);
        assert!(f.closed().is_none());
        f.finish();
        f.close(Status::internal("later"));
        let st = f.reserve(1).await.unwrap_err();
        assert_eq!(
            (st.code(), st.message()),
            (tonic::Code::Cancelled, "call finished")
        );
        let w = SendWindow::new(u32::MAX >> 1);
        assert_eq!(
            w.grant(7, 10),
            Err(PeerMisbehaved::WindowOverflow {
                stream: 7,
                window: MAX_WINDOW,
                increment: 10
            })
        );
    }
}
