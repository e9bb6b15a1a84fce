//! Flow-control windows as values (`docs/wire-protocol.md` §1.4), for both
//! directions, in the style of h2's `FlowControl`: checked arithmetic, a
//! violation reported as a [`PeerMisbehaved`], never a wrap, and no lock, no
//! waiting and no I/O. The session holds them under its lock and sends the
//! WINDOW_UPDATEs they ask for; [`SendWindow`](super::window::SendWindow)
//! adds the waiting to [`SendCredit`].
//!
//! * [`RecvWindow`]: what the peer may still send us (on one call, or on the
//!   whole connection), and when to grant it credit back: once the
//!   application consumed half the window.
//! * [`SendCredit`]: what we may still send, raised by the peer's
//!   WINDOW_UPDATEs up to [`MAX_WINDOW`].

use crate::PeerMisbehaved;

/// Largest window a peer may grant (2^31 - 1, as in HTTP/2).
pub const MAX_WINDOW: i64 = (1 << 31) - 1;

/// The receive side of one window: DATA bytes the peer may still send, and
/// the bytes the application consumed that were not granted back yet.
///
/// The sum of [`available`](Self::available), [`unclaimed`](Self::unclaimed)
/// and the bytes received but not consumed yet is the window granted in
/// HELLO, at all times: credit goes back only for consumed bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWindow {
    /// DATA bytes the peer may still send; never negative (DATA beyond it
    /// is refused, not charged).
    available: i64,
    /// Bytes consumed since the last grant.
    unclaimed: u32,
    /// A grant is due once `unclaimed` reaches this: half the window.
    threshold: u32,
}

impl RecvWindow {
    /// A window of `window` bytes, as granted in HELLO (`initial_window` per
    /// call, `connection_window` for the connection).
    pub fn new(window: u32) -> Self {
        RecvWindow {
            available: i64::from(window),
            unclaimed: 0,
            threshold: window / 2,
        }
    }

    /// DATA bytes the peer may still send.
    pub fn available(&self) -> i64 {
        self.available
    }

    /// Bytes consumed and not granted back yet.
    pub fn unclaimed(&self) -> u32 {
        self.unclaimed
    }

    /// The peer sent `n` DATA bytes on `stream` (0: this is the connection's
    /// window). More than the window holds is a violation, and is not
    /// charged.
    pub fn recv(&mut self, stream: u32, n: usize) -> Result<(), PeerMisbehaved> {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        if n > self.available {
            let excess = n.abs_diff(self.available);
            return Err(if stream == 0 {
                PeerMisbehaved::ConnectionWindowExceeded { excess }
            } else {
                PeerMisbehaved::StreamWindowExceeded { stream, excess }
            });
        }
        self.available -= n;
        Ok(())
    }

    /// The application consumed `n` received bytes (or dropped them): the
    /// increment of the WINDOW_UPDATE to send, once half the window was
    /// consumed since the last one; `None` until then. Never an increment
    /// of 0 (a WINDOW_UPDATE the peer would refuse).
    pub fn consumed(&mut self, n: usize) -> Option<u32> {
        if n == 0 {
            return None;
        }
        self.unclaimed = self
            .unclaimed
            .saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
        if self.unclaimed < self.threshold {
            return None;
        }
        let inc = std::mem::take(&mut self.unclaimed);
        self.available += i64::from(inc);
        Some(inc)
    }
}

/// The send side of one window: DATA bytes this side may still send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendCredit {
    /// Never negative, never above [`MAX_WINDOW`].
    available: i64,
}

impl SendCredit {
    /// Credit of `initial` bytes, as the peer granted in HELLO.
    pub fn new(initial: u32) -> Self {
        SendCredit {
            available: i64::from(initial),
        }
    }

    /// DATA bytes this side may still send.
    pub fn available(&self) -> i64 {
        self.available
    }

    /// Takes up to `want` bytes of credit: what was taken, 0 when there is
    /// none.
    pub fn take(&mut self, want: usize) -> usize {
        let n = usize::try_from(self.available).unwrap_or(0).min(want);
        // n <= available <= MAX_WINDOW: fits.
        self.available -= n as i64;
        n
    }

    /// Adds credit from a WINDOW_UPDATE on `stream` (0 = the connection).
    /// A window past [`MAX_WINDOW`] is a violation, and is not applied.
    pub fn grant(&mut self, stream: u32, inc: u32) -> Result<(), PeerMisbehaved> {
        let next = self.available + i64::from(inc);
        if next > MAX_WINDOW {
            return Err(PeerMisbehaved::WindowOverflow {
                stream,
                window: self.available,
                increment: inc,
            });
        }
        self.available = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_beyond_a_receive_window_is_a_typed_violation_and_not_charged() {
        let mut w = RecvWindow::new(100);
        w.recv(0, 60).unwrap();
        assert_eq!(
            w.recv(0, 50),
            Err(PeerMisbehaved::ConnectionWindowExceeded { excess: 10 })
        );
        assert_eq!(w.available(), 40, "the refused DATA is not charged");
        let mut s = RecvWindow::new(8);
        assert_eq!(
            s.recv(7, 9),
            Err(PeerMisbehaved::StreamWindowExceeded {
                stream: 7,
                excess: 1
            })
        );
        // Exactly the window is allowed, and then nothing more.
        s.recv(7, 8).unwrap();
        assert_eq!(s.available(), 0);
        s.recv(7, 0).unwrap();
        assert!(s.recv(7, 1).is_err());
    }

    #[test]
    fn credit_goes_back_once_half_the_window_was_consumed() {
        let mut w = RecvWindow::new(100);
        w.recv(3, 100).unwrap();
        assert_eq!(w.consumed(20), None);
        assert_eq!(w.consumed(29), None);
        assert_eq!((w.available(), w.unclaimed()), (0, 49));
        // 49 + 1 = half of 100: all of it goes back in one grant.
        assert_eq!(w.consumed(1), Some(50));
        assert_eq!((w.available(), w.unclaimed()), (50, 0));
        assert_eq!(w.consumed(50), Some(50));
        assert_eq!(w.available(), 100);
        // A tiny window grants on every consumed byte, never 0.
        let mut t = RecvWindow::new(1);
        t.recv(0, 1).unwrap();
        assert_eq!(t.consumed(0), None);
        assert_eq!(t.consumed(1), Some(1));
    }

    #[test]
    fn send_credit_is_taken_up_to_what_is_left_and_granted_up_to_the_maximum() {
        let mut c = SendCredit::new(10);
        assert_eq!(c.take(4), 4);
        assert_eq!(c.take(100), 6);
        assert_eq!(c.take(1), 0);
        c.grant(1, 3).unwrap();
        assert_eq!(c.available(), 3);
        let mut full = SendCredit::new(u32::MAX >> 1);
        assert_eq!(
            full.grant(0, 1),
            Err(PeerMisbehaved::WindowOverflow {
                stream: 0,
                window: MAX_WINDOW,
                increment: 1
            })
        );
        assert_eq!(full.available(), MAX_WINDOW, "an overflow is not applied");
        assert_eq!(full.take(usize::MAX), MAX_WINDOW as usize);
        assert_eq!(full.available(), 0);
    }
}
