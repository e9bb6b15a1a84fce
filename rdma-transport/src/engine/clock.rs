//! Time as an input: what the engine does when time passes, and when it
//! next needs to be told. The driver reads the clock, passes `now` to
//! [`Engine::handle_timeout`] and sleeps until [`Engine::poll_timeout`]
//! (quinn-proto's shape); the policy lives here, where a test can drive it
//! with made-up instants:
//!
//! * setup kicks (§2.3 step 6): the active side probes the passive side at
//!   4 ms, 8 ms, ... up to 1 s intervals until it hears from it;
//! * keepalive (§4.4): a probe when nothing was posted during a whole
//!   interval;
//! * idle release (§5.5): once per interval, what went unused for a whole
//!   interval is given back; the timer counts only while there is something
//!   to give back, so an idle connection at its initial size is never woken
//!   for it;
//! * receive back-pressure (§4.5): credit returns are held while the
//!   application's queue of delivered messages exceeds its limit.
//!
//! Section numbers (§) refer to `docs/wire-protocol-rdma.md`.

use std::time::{Duration, Instant};

use super::{Buffers, Engine};

/// §2.3 step 6: the active side's first setup kick comes this long after
/// the connection started, and each further one twice as long after the
/// previous one, while nothing was received from the passive side.
pub const SETUP_KICK_FIRST: Duration = Duration::from_millis(4);

/// §2.3 step 6: no more setup kicks once the interval would exceed this
/// (8 kicks over ~2 s); the keepalive (§4.4) remains the backstop.
pub const SETUP_KICK_LAST: Duration = Duration::from_secs(1);

/// The clock-driven policy's settings ([`Engine::start_clock`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct TimerConfig {
    /// §4.4: keepalive interval; zero: no keepalive.
    pub keepalive: Duration,
    /// §5.5: idle-release interval; zero: nothing is given back on a timer.
    pub idle_release: Duration,
    /// §2.3 step 6: this is the active side, which sends setup kicks.
    pub setup_kicks: bool,
    /// §4.5: bytes of delivered, untaken messages above which credit
    /// returns are held.
    pub recv_queue_bytes: usize,
}

/// The timers' state (owned by the [`Engine`]).
#[derive(Debug, Default)]
pub(super) struct Timers {
    cfg: TimerConfig,
    /// Whether [`Engine::start_clock`] ran (an engine without a clock, as
    /// in the protocol tests, has no timers).
    started: bool,
    keepalive_at: Option<Instant>,
    /// Work requests were posted since the keepalive last fired (§4.4):
    /// set per post, without reading the clock.
    posted: bool,
    /// The next setup kick and the interval that led to it (§2.3 step 6).
    kick: Option<(Instant, Duration)>,
    idle_at: Option<Instant>,
}

/// What [`Engine::handle_timeout`] did, for the connection's statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fired {
    /// A keepalive probe was queued (§4.4).
    pub keepalive: bool,
    /// A setup kick was queued (§2.3 step 6).
    pub setup_kick: bool,
    /// The idle-release interval passed (§5.5).
    pub idle_release: bool,
}

impl Engine {
    /// Starts the clock-driven policy at `now` (once, when the connection is
    /// established).
    pub fn start_clock(&mut self, now: Instant, cfg: TimerConfig) {
        self.stir();
        let t = &mut self.timers;
        t.cfg = cfg;
        t.started = true;
        t.keepalive_at = (!cfg.keepalive.is_zero()).then(|| now + cfg.keepalive);
        t.kick = cfg
            .setup_kicks
            .then(|| (now + SETUP_KICK_FIRST, SETUP_KICK_FIRST));
        t.idle_at =
            (!cfg.idle_release.is_zero() && self.cfg.on_demand).then(|| now + cfg.idle_release);
    }

    /// Records that work requests were posted (the keepalive's idleness
    /// test, §4.4). Called per post: no clock read.
    #[inline]
    pub fn note_posted(&mut self) {
        self.timers.posted = true;
    }

    /// The application's queue of delivered, untaken messages holds
    /// `queued` bytes, or the application stopped reading (`open` false):
    /// credit returns are held while the queue is over its limit and read
    /// (§4.5: an application that does not read holds back the peer).
    #[inline]
    pub fn note_backlog(&mut self, queued: usize, open: bool) {
        let (hold, gone) = (open && queued > self.timers.cfg.recv_queue_bytes, !open);
        // Called every driver step: stirs only on a change.
        if (hold, gone) != (self.hold_returns, self.app_gone) {
            self.stir();
        }
        self.hold_returns = hold;
        self.app_gone = gone;
    }

    /// The next instant at which [`handle_timeout`](Self::handle_timeout)
    /// has something to do, or `None` (no timer runs). Reads no clock. The
    /// idle-release deadline counts only while the engine has something to
    /// give back (one that passed meanwhile is due at once); the setup
    /// kicks stop once the peer was heard from.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        if !self.timers.started {
            return None;
        }
        if self.heard {
            self.timers.kick = None;
        }
        let idle = self.timers.idle_at.filter(|_| self.has_releasable());
        let t = &self.timers;
        [t.keepalive_at, t.kick.map(|(at, _)| at), idle]
            .into_iter()
            .flatten()
            .min()
    }

    /// Runs what is due at `now`: a setup kick, a keepalive, an idle
    /// release. What it queues is posted by the next
    /// [`progress`](Self::progress).
    pub fn handle_timeout<B: Buffers + ?Sized>(&mut self, now: Instant, bufs: &mut B) -> Fired {
        self.stir();
        let mut fired = Fired::default();
        if let Some((at, d)) = self.timers.kick {
            if now >= at && !self.heard {
                // A zero-length WRITE makes the passive side's NIC look at
                // the connection again: siw (Linux 6.1) ignores FPDUs that
                // arrive while its accept is still installing the QP's
                // socket callbacks, until the next segment arrives.
                self.keepalive();
                fired.setup_kick = true;
                let d = d * 2;
                self.timers.kick = (d <= SETUP_KICK_LAST).then_some((now + d, d));
            } else if self.heard {
                self.timers.kick = None;
            }
        }
        if let Some(at) = self.timers.keepalive_at {
            if now >= at {
                if !std::mem::take(&mut self.timers.posted) {
                    self.keepalive();
                    fired.keepalive = true;
                }
                self.timers.keepalive_at = Some(now + self.timers.cfg.keepalive);
            }
        }
        if let Some(at) = self.timers.idle_at {
            if now >= at && self.has_releasable() {
                self.on_idle_tick(bufs);
                fired.idle_release = true;
                self.timers.idle_at = Some(now + self.timers.cfg.idle_release);
            }
        }
        fired
    }
}
