//! The driver's busy-poll budget (§8, `Config::poll_mode`): how long it
//! polls its CQs before it sleeps, from the observed waits for work.

use std::time::Duration;

use crate::config::PollMode;

/// The driver's busy-poll budget (§8, `Config::poll_mode`).
#[derive(Debug, Clone, Copy)]
pub(super) struct SpinBudget {
    mode: PollMode,
    /// `Config::busy_poll`.
    max: Duration,
    /// `PollMode::Adaptive`: moving average of how long the driver went
    /// without work before the next completion or command.
    avg: Duration,
    /// `PollMode::Adaptive`: idle periods since the last one that was
    /// timed (see [`SpinBudget::sample_now`]).
    unsampled: u32,
}

/// `PollMode::Adaptive` times one idle period in this many while it does not
/// spin (§8): each timing is two clock reads, a syscall each where the
/// guest has no usable TSC, and a driver that sleeps anyway needs only a
/// trend to notice when its waits get short.
const SAMPLE_EVERY_ASLEEP: u32 = 8;

impl SpinBudget {
    pub(super) fn new(mode: PollMode, max: Duration) -> SpinBudget {
        SpinBudget {
            mode,
            max,
            avg: Duration::ZERO,
            unsampled: 0,
        }
    }

    /// Whether to time the idle period that starts now: always while the
    /// budget lets the driver spin (the spin reads the clock anyway), one
    /// period in [`SAMPLE_EVERY_ASLEEP`] while it does not.
    pub(super) fn sample_now(&mut self) -> bool {
        if self.mode != PollMode::Adaptive {
            return false;
        }
        if !self.budget().is_zero() {
            self.unsampled = 0;
            return true;
        }
        self.unsampled += 1;
        if self.unsampled >= SAMPLE_EVERY_ASLEEP {
            self.unsampled = 0;
            true
        } else {
            false
        }
    }

    /// How long to busy-poll now.
    pub(super) fn budget(&self) -> Duration {
        match self.mode {
            PollMode::Fixed => self.max,
            PollMode::Spin => Duration::MAX,
            PollMode::Adaptive => {
                let want = self.avg * 2;
                if want <= self.max {
                    // Never below a few µs: the first samples start at 0.
                    want.max(Duration::from_micros(2)).min(self.max)
                } else {
                    Duration::ZERO
                }
            }
        }
    }

    /// One more observed wait for work.
    pub(super) fn note(&mut self, waited: Duration) {
        // Moving average with weight 1/8; a wait longer than 4 × the bound
        // counts as 4 × the bound, so one long pause (an idle connection)
        // does not keep spinning off for long once traffic resumes.
        let w = waited.min(self.max * 4);
        self.avg = (self.avg * 7 + w) / 8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn adaptive_budget_follows_the_observed_wait_within_the_bound() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        // Nothing observed yet: a token spin.
        assert_eq!(b.budget(), 2 * US);
        for _ in 0..64 {
            b.note(20 * US);
        }
        // Converges to twice the wait (the 1/8 average approaches 20 µs).
        let got = b.budget();
        assert!(got > 38 * US && got <= 40 * US, "{got:?}");
        // Waits longer than half the bound: not worth spinning at all.
        for _ in 0..64 {
            b.note(300 * US);
        }
        assert_eq!(b.budget(), Duration::ZERO);
        // One very long pause counts as 4 × the bound only, so a few fast
        // round trips bring spinning back.
        let mut c = SpinBudget::new(PollMode::Adaptive, 100 * US);
        for _ in 0..64 {
            c.note(10 * US);
        }
        c.note(Duration::from_secs(10));
        let mut n = 0;
        while c.budget().is_zero() {
            c.note(10 * US);
            n += 1;
        }
        assert!(n <= 16, "{n} samples to resume spinning");
        // A zero bound never spins.
        let mut z = SpinBudget::new(PollMode::Adaptive, Duration::ZERO);
        z.note(US);
        assert_eq!(z.budget(), Duration::ZERO);
    }

    #[test]
    fn adaptive_times_every_period_while_spinning_one_in_eight_asleep() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        // Spinning (budget > 0): every idle period is timed.
        assert!((0..10).all(|_| b.sample_now()));
        for _ in 0..64 {
            b.note(Duration::from_millis(2));
        }
        assert_eq!(b.budget(), Duration::ZERO);
        // Asleep: one period in SAMPLE_EVERY_ASLEEP.
        let timed = (0..8 * SAMPLE_EVERY_ASLEEP)
            .filter(|_| b.sample_now())
            .count();
        assert_eq!(timed, 8);
        // Fixed and Spin never time a period (nothing adapts).
        let mut f = SpinBudget::new(PollMode::Fixed, 20 * US);
        assert!(!(0..20).any(|_| f.sample_now()));
        let mut s = SpinBudget::new(PollMode::Spin, 20 * US);
        assert!(!(0..20).any(|_| s.sample_now()));
    }

    #[test]
    fn fixed_and_spin_budgets() {
        let mut f = SpinBudget::new(PollMode::Fixed, 20 * US);
        f.note(Duration::from_secs(1));
        assert_eq!(f.budget(), 20 * US);
        assert_eq!(
            SpinBudget::new(PollMode::Spin, Duration::ZERO).budget(),
            Duration::MAX
        );
    }
}
