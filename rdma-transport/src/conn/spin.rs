//! The driver's busy-poll budget (§8, `Config::poll_mode`): how long it
//! polls its CQs before it sleeps, from the observed waits for work and the
//! measured cost of a sleep.
//!
//! `PollMode::Adaptive` keeps two averages: how long the driver waited for
//! work when the wait ended without a sleep (a poll or a spin found it),
//! and how long when it slept on the completion channel and was woken.
//! Their difference is what a sleep costs this machine (the wake-up: the
//! interrupt, the reactor, the context switch), measured rather than
//! assumed. The driver spins when the expected wait is within
//! `busy_poll / 2` (the fixed bound, for machines whose wake-up is cheap)
//! or within twice a measured wake-up (spinning for the wait then costs at
//! most two wake-ups' worth of CPU and saves one wake-up's latency), for at
//! most twice the expected wait and never longer than [`SPIN_CEILING`]
//! (or `busy_poll` if that is longer). A spin that runs out without work
//! counts as a wait awake of the whole wait less the measured wake-up, so
//! waits that outgrow the budget turn spinning off; while it is off, one
//! idle period in [`PROBE_EVERY_ASLEEP`] spins anyway to see whether
//! waiting awake has become short again, and a probe that sees a short
//! wait is believed at once.
//!
//! The CPU cap: a spin yields to the runtime at every clock check; when a
//! check comes much later than usual, the core ran other work in between
//! (other tasks of a busy runtime, or the host took the CPU), and the spin
//! stops so the driver sleeps instead of taking turns with that work. A
//! spin costs at most two clock checks' worth of polling on a busy core.
//! An idle connection probes rarely (its periods are long), and so costs
//! almost no CPU.

use std::time::Duration;

use crate::config::PollMode;

/// The longest an adaptive spin runs for one wait, unless `busy_poll` is
/// longer: the CPU one wait may cost, whatever the measured wake-up.
pub(super) const SPIN_CEILING: Duration = Duration::from_millis(2);

/// `PollMode::Adaptive` times one idle period in this many while it does not
/// spin (§8): each timing is two clock reads, a syscall each where the
/// guest has no usable TSC, and a driver that sleeps anyway needs only a
/// trend to notice when its waits get short.
const SAMPLE_EVERY_ASLEEP: u32 = 8;

/// While spinning is off, one idle period in this many spins (a probe):
/// a wait is only seen awake by spinning through it.
const PROBE_EVERY_ASLEEP: u32 = 2 * SAMPLE_EVERY_ASLEEP;

/// The shortest spin when spinning at all (the first samples start at 0).
const SPIN_FLOOR: Duration = Duration::from_micros(2);

/// A moving average with weight 1/8 whose first sample is taken as is.
#[derive(Debug, Clone, Copy, Default)]
struct Avg(Option<Duration>);

impl Avg {
    fn add(&mut self, d: Duration) {
        self.0 = Some(match self.0 {
            None => d,
            Some(a) => (a * 7 + d) / 8,
        });
    }
}

/// How an idle period of the driver ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// Work was found by polling (before sleeping or during a spin).
    Polled,
    /// The driver slept (completion channel, command, timer) and was woken.
    Slept,
}

/// The driver's busy-poll budget (§8, `Config::poll_mode`).
#[derive(Debug, Clone, Copy)]
pub(super) struct SpinBudget {
    mode: PollMode,
    /// `Config::busy_poll`.
    max: Duration,
    /// `Adaptive`: waits that ended without a sleep, and spins that ran
    /// out (as their whole wait).
    awake: Avg,
    /// `Adaptive`: waits that ended in a wake-up, without a spin before.
    asleep: Avg,
    /// `Adaptive`: the budget outside a probe, from the averages (worked
    /// out when they change, not at every look).
    steady: Duration,
    /// `Adaptive`: idle periods since the last one that was timed (see
    /// [`SpinBudget::sample_now`]).
    unsampled: u32,
    /// `Adaptive`: idle periods since the last probe.
    unprobed: u32,
    /// `Adaptive`: the current idle period is a probe.
    probing: bool,
    /// `Adaptive`: the current idle period's spin ran out.
    missed: bool,
    /// `Adaptive`: the current idle period's spin stopped because its core
    /// was busy with other work ([`SpinBudget::contended`]).
    crowded: bool,
    /// `Adaptive`: the usual time between two clock checks of a spin
    /// (`CLOCK_EVERY` polls and a yield with nothing else to run): the
    /// least seen, let up slowly.
    usual_gap: Option<Duration>,
}

/// A spin's clock check that comes this many times later than usual means
/// the core ran other work in between ([`SpinBudget::contended`]).
const CROWDED_GAP_FACTOR: u32 = 4;

/// ... and only if it came at least this late: a task that ran for less
/// (the one that will send the next message, say) is no contention.
const CROWDED_GAP_FLOOR: Duration = Duration::from_micros(10);

impl SpinBudget {
    pub(super) fn new(mode: PollMode, max: Duration) -> SpinBudget {
        let mut b = SpinBudget {
            mode,
            max,
            awake: Avg::default(),
            asleep: Avg::default(),
            unsampled: 0,
            unprobed: 0,
            probing: false,
            missed: false,
            crowded: false,
            usual_gap: None,
            steady: Duration::ZERO,
        };
        b.steady = b.work_out_steady();
        b
    }

    /// Whether to time the idle period that starts now: always while the
    /// budget lets the driver spin (the spin reads the clock anyway), one
    /// period in [`SAMPLE_EVERY_ASLEEP`] while it does not; every other
    /// timed period of those is a probe, which spins.
    pub(super) fn sample_now(&mut self) -> bool {
        if self.mode != PollMode::Adaptive {
            return false;
        }
        self.probing = false;
        self.missed = false;
        self.crowded = false;
        if !self.steady_budget().is_zero() {
            self.unsampled = 0;
            return true;
        }
        self.unsampled += 1;
        self.unprobed += 1;
        if self.unsampled < SAMPLE_EVERY_ASLEEP {
            return false;
        }
        self.unsampled = 0;
        if self.unprobed >= PROBE_EVERY_ASLEEP && !self.ceiling().is_zero() {
            self.unprobed = 0;
            self.probing = true;
        }
        true
    }

    /// How long to busy-poll now.
    pub(super) fn budget(&self) -> Duration {
        match self.mode {
            PollMode::Fixed => self.max,
            PollMode::Spin => Duration::MAX,
            PollMode::Adaptive if self.probing => {
                // Long enough to catch a wait that costs `asleep` with a
                // sleep in it, within the ceiling.
                let a = self.asleep.0.unwrap_or(self.max);
                (a * 2).clamp(SPIN_FLOOR, self.ceiling())
            }
            PollMode::Adaptive => self.steady_budget(),
        }
    }

    /// What a sleep costs: the average wait that ended in a wake-up less
    /// the average one that did not (zero until both were seen).
    pub(super) fn wake_cost(&self) -> Duration {
        match (self.asleep.0, self.awake.0) {
            (Some(s), Some(a)) => s.saturating_sub(a),
            _ => Duration::ZERO,
        }
    }

    /// The longest single spin.
    fn ceiling(&self) -> Duration {
        if self.max.is_zero() {
            return Duration::ZERO;
        }
        self.max.max(SPIN_CEILING)
    }

    /// `Adaptive`, outside a probe.
    fn steady_budget(&self) -> Duration {
        self.steady
    }

    fn work_out_steady(&self) -> Duration {
        if self.max.is_zero() {
            return Duration::ZERO;
        }
        let Some(wait) = self.awake.0.or(self.asleep.0) else {
            return SPIN_FLOOR.min(self.max);
        };
        let worth = (self.max / 2).max(self.wake_cost() * 2);
        if wait <= worth {
            (wait * 2).clamp(SPIN_FLOOR, self.ceiling())
        } else {
            Duration::ZERO
        }
    }

    /// The spin of the current idle period ran out without work; the
    /// driver sleeps next.
    pub(super) fn missed(&mut self) {
        self.missed = true;
    }

    /// A spin's time between two clock checks: whether the core is
    /// crowded (the check came [`CROWDED_GAP_FACTOR`] times later than
    /// usual and at least [`CROWDED_GAP_FLOOR`] late), in which case the
    /// spin stops and the driver sleeps (the CPU cap of §8). Only
    /// `Adaptive` stops; `Fixed` spins its budget out.
    pub(super) fn contended(&mut self, gap: Duration) -> bool {
        if self.mode != PollMode::Adaptive {
            return false;
        }
        match self.usual_gap {
            Some(usual) if gap > usual * CROWDED_GAP_FACTOR && gap > CROWDED_GAP_FLOOR => {
                self.crowded = true;
                true
            }
            // The usual gap is the least seen, let up by 1/64 per longer
            // one (a slower machine, a costlier poll): an average would
            // creep up under load, by each gap just short of crowded.
            Some(usual) => {
                self.usual_gap = Some(gap.min(usual + usual / 64));
                false
            }
            None => {
                self.usual_gap = Some(gap);
                false
            }
        }
    }

    /// One more observed wait for work (a timed idle period's end).
    pub(super) fn note(&mut self, waited: Duration, ended: Ended) {
        // A wait longer than 4 × the ceiling counts as 4 × the ceiling, so
        // one long pause (an idle connection) does not keep spinning off
        // for long once traffic resumes.
        let w = waited.min(self.ceiling() * 4);
        if std::mem::take(&mut self.crowded) {
            // The spin gave its core away: the wait tells neither what
            // waiting awake nor what a sleep costs.
            self.probing = false;
            self.missed = false;
            return;
        }
        match (ended, self.missed, self.awake.0) {
            (Ended::Polled, _, Some(a)) if self.probing => {
                // A probe saw the wait awake: believed at once (a wrong
                // belief costs one spin that runs out, which corrects it).
                self.awake = Avg(Some(a.min(w)));
            }
            (Ended::Polled, _, _) => self.awake.add(w),
            (Ended::Slept, true, Some(_)) => {
                // A spin that ran out: waiting awake would have taken the
                // whole wait less what the sleep added to it.
                self.awake.add(w.saturating_sub(self.wake_cost()));
            }
            // Nothing seen awake yet: a wait with a sleep in it.
            (Ended::Slept, _, _) => self.asleep.add(w),
        }
        self.steady = self.work_out_steady();
        self.probing = false;
        self.missed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    /// One timed idle period: `sample_now`, the budget, then the wait's end
    /// as the driver would report it (a spin catches `wait` if it is
    /// within the budget, otherwise runs out and the driver sleeps, and
    /// the wake-up adds `wake`).
    fn period(b: &mut SpinBudget, wait: Duration, wake: Duration) -> Option<Duration> {
        if !b.sample_now() {
            return None;
        }
        let budget = b.budget();
        if !budget.is_zero() && wait <= budget {
            b.note(wait, Ended::Polled);
        } else {
            if !budget.is_zero() {
                b.missed();
            }
            b.note(wait.max(budget) + wake, Ended::Slept);
        }
        Some(budget)
    }

    /// Runs `n` idle periods; returns the budgets of the timed ones.
    fn run(b: &mut SpinBudget, n: usize, wait: Duration, wake: Duration) -> Vec<Duration> {
        (0..n).filter_map(|_| period(b, wait, wake)).collect()
    }

    #[test]
    fn a_cheap_wake_up_spins_for_waits_within_half_the_bound() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        // Nothing observed yet: a token spin.
        assert_eq!(b.budget(), SPIN_FLOOR);
        // 20 µs waits, 5 µs wake-ups: spins, about twice the wait.
        let got = run(&mut b, 64, 20 * US, 5 * US);
        let last = *got.last().unwrap();
        assert!(last >= 38 * US && last <= 42 * US, "{last:?}");
        assert!(b.wake_cost() <= 5 * US, "{:?}", b.wake_cost());
        // 300 µs waits (beyond half the bound, and far beyond two cheap
        // wake-ups): spinning turns off.
        run(&mut b, 64, 300 * US, 5 * US);
        assert_eq!(b.steady_budget(), Duration::ZERO);
    }

    #[test]
    fn a_costly_wake_up_makes_longer_waits_worth_a_spin() {
        // 600 µs waits, 400 µs per wake-up (the emulated VM): spinning
        // through the wait costs less than two wake-ups. The first waits
        // are seen asleep; a probe sees one awake; then it spins.
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        let got = run(&mut b, 200, 600 * US, 400 * US);
        assert!(
            b.wake_cost() >= 300 * US && b.wake_cost() <= 400 * US,
            "{:?}",
            b.wake_cost()
        );
        let last = *got.last().unwrap();
        assert!(last >= 1100 * US && last <= 1300 * US, "{last:?}");
        // Once spinning, every period is timed and spins.
        assert!(got.iter().rev().take(50).all(|d| !d.is_zero()));
    }

    #[test]
    fn a_wake_up_cheap_next_to_the_wait_keeps_the_driver_asleep() {
        // 900 µs waits, 100 µs wake-ups: spinning would cost nine times a
        // wake-up. Only probes spin, one timed period in two, and they are
        // bounded by the ceiling.
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        let got = run(&mut b, 640, 900 * US, 100 * US);
        let spun: Vec<_> = got.iter().filter(|d| !d.is_zero()).collect();
        assert!(
            spun.len() <= got.len() / 2 + 1,
            "{} of {}",
            spun.len(),
            got.len()
        );
        assert!(spun.iter().all(|d| **d <= SPIN_CEILING));
        assert_eq!(b.steady_budget(), Duration::ZERO);
        // 640 periods: 80 timed (one in eight), at most 41 probes.
        assert!(got.len() <= 641 / SAMPLE_EVERY_ASLEEP as usize + 1);
    }

    #[test]
    fn spins_that_run_out_turn_spinning_off_and_a_probe_turns_it_back_on() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        run(&mut b, 200, 600 * US, 400 * US);
        assert!(!b.steady_budget().is_zero());
        // The waits grow to 5 ms (a slow handler): every spin runs out,
        // and within a few periods spinning stops.
        let mut n = 0;
        while !b.steady_budget().is_zero() {
            period(&mut b, 5000 * US, 400 * US);
            n += 1;
            assert!(n <= 32, "still spinning after {n} periods");
        }
        // Waits come back to 600 µs: a probe sees it and spinning resumes.
        let mut m = 0;
        while b.steady_budget().is_zero() {
            period(&mut b, 600 * US, 400 * US);
            m += 1;
            assert!(m <= 20 * PROBE_EVERY_ASLEEP, "no spin after {m} periods");
        }
    }

    #[test]
    fn an_idle_connection_spins_only_on_rare_bounded_probes() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        run(&mut b, 100, 20 * US, 5 * US);
        // Then ten-second pauses: spinning stops after the first pause, and
        // afterwards one idle period in PROBE_EVERY_ASLEEP spins, for at
        // most the ceiling.
        let mut spun = Duration::ZERO;
        let n = 1600;
        for _ in 0..n {
            if let Some(d) = period(&mut b, Duration::from_secs(10), 5 * US) {
                spun += d;
            }
        }
        assert!(
            spun <= SPIN_CEILING * (n / PROBE_EVERY_ASLEEP + 2),
            "{spun:?}"
        );
        assert!(spun >= SPIN_CEILING, "no probe at all: {spun:?}");
    }

    #[test]
    fn a_spin_stops_when_its_core_is_crowded_and_the_wait_is_not_counted() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        run(&mut b, 200, 600 * US, 400 * US);
        let before = (b.awake.0, b.asleep.0);
        assert!(b.sample_now());
        // Usual gaps of 20 µs; one of 30 µs is no contention.
        for _ in 0..10 {
            assert!(!b.contended(20 * US));
        }
        assert!(!b.contended(30 * US));
        // Another task ran for 200 µs in between: crowded.
        assert!(b.contended(200 * US));
        b.note(Duration::from_millis(3), Ended::Slept);
        assert_eq!((b.awake.0, b.asleep.0), before);
        // Still spinning at the next period: crowding is judged per spin.
        assert!(b.sample_now());
        assert!(!b.budget().is_zero());
        // Gaps just short of crowded, again and again (a loaded core),
        // do not raise the usual gap enough to hide a crowded one.
        let mut l = SpinBudget::new(PollMode::Adaptive, 100 * US);
        assert!(!l.contended(20 * US));
        for _ in 0..16 {
            assert!(!l.contended(79 * US));
        }
        assert!(l.contended(200 * US));
        // Short gaps below the floor never count, whatever their ratio.
        let mut c = SpinBudget::new(PollMode::Adaptive, 100 * US);
        assert!(!c.contended(US));
        assert!(!c.contended(8 * US));
        // Fixed spins its budget out.
        let mut f = SpinBudget::new(PollMode::Fixed, 100 * US);
        assert!(!f.contended(US));
        assert!(!f.contended(Duration::from_millis(5)));
    }

    #[test]
    fn a_zero_bound_never_spins() {
        let mut z = SpinBudget::new(PollMode::Adaptive, Duration::ZERO);
        let got = run(&mut z, 400, US, 400 * US);
        assert!(got.iter().all(|d| d.is_zero()));
        assert_eq!(z.budget(), Duration::ZERO);
    }

    #[test]
    fn adaptive_times_every_period_while_spinning_one_in_eight_asleep() {
        let mut b = SpinBudget::new(PollMode::Adaptive, 100 * US);
        // Spinning (budget > 0): every idle period is timed.
        assert!((0..10).all(|_| b.sample_now()));
        for _ in 0..64 {
            b.note(Duration::from_millis(2), Ended::Slept);
        }
        assert_eq!(b.steady_budget(), Duration::ZERO);
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
        f.note(Duration::from_secs(1), Ended::Slept);
        assert_eq!(f.budget(), 20 * US);
        assert_eq!(
            SpinBudget::new(PollMode::Spin, Duration::ZERO).budget(),
            Duration::MAX
        );
    }
}
