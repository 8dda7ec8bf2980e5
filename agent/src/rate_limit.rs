//! The write rate limiter every sink shares: a generic cell rate algorithm (GCRA), which is a
//! token bucket kept as one time instead of a token count.
//!
//! `WriteBudget::new(interval, burst, now)` allows `burst` writes back to back, then one per
//! `interval`; in any span `T` at most `burst + T / interval` writes pass. Used by the file sink
//! (`--write-interval`, `--write-burst`), by the fault ConfigMap sink for changes that touch
//! only counters (`--kube-write-interval`, burst 1) and by the Event sink as a token bucket of
//! `--kube-event-burst` refilled at `--kube-event-rate` per minute.
//!
//! `LogPacer` paces a log line the same way: at most one per interval, with the count since the
//! last line and the running total.
//!
//! Times are `tokio::time::Instant`s read from [`Clock::instant`](crate::clock::Clock::instant):
//! the waits they decide are tokio timers, and tests pause and advance tokio's clock.

use std::time::Duration;

use tokio::time::Instant;

/// A generic cell rate limiter (GCRA): up to `burst` writes at once, then one per `interval`.
#[derive(Debug, Clone)]
pub(crate) struct WriteBudget {
    interval: Duration,
    burst: u32,
    /// The theoretical time of the next write if writes were evenly spaced.
    tat: Instant,
}

impl WriteBudget {
    pub(crate) fn new(interval: Duration, burst: u32, now: Instant) -> Self {
        WriteBudget {
            interval,
            burst: burst.max(1),
            tat: now,
        }
    }

    /// `per_minute` writes a minute after a burst of `burst`: a token bucket holding `burst`
    /// tokens, refilled by one every `60 s / per_minute` (0 counts as 1).
    pub(crate) fn per_minute(per_minute: u32, burst: u32, now: Instant) -> Self {
        WriteBudget::new(Duration::from_secs(60) / per_minute.max(1), burst, now)
    }

    /// How long to wait before the next write may go out.
    pub(crate) fn wait(&self, now: Instant) -> Duration {
        let slack = self.interval * (self.burst - 1);
        (self.tat.checked_sub(slack).unwrap_or(now)).saturating_duration_since(now)
    }

    /// Records a write made at `now`.
    pub(crate) fn spend(&mut self, now: Instant) {
        self.tat = self.tat.max(now) + self.interval;
    }

    /// Records a write that went out whatever the budget said (a change that cannot wait): the
    /// next paced write waits at least one interval from it, but such writes run up no debt,
    /// so three of them in a row do not hold the next paced write back three intervals.
    pub(crate) fn note_forced(&mut self, now: Instant) {
        self.tat = self.tat.max(now + self.interval);
    }

    /// Spends one write if one may go out at `now`; false (nothing spent) when the budget is
    /// used up.
    pub(crate) fn try_spend(&mut self, now: Instant) -> bool {
        let free = self.wait(now).is_zero();
        if free {
            self.spend(now);
        }
        free
    }
}

/// Logs a repeating condition (kernel-log overruns and gaps, Events left out, connections
/// refused) at most once per `every`, each line with what happened since the previous line and
/// the running total: one WARN per overrun would write 112k lines (17 MB) in two storms. The
/// metrics count every one.
#[derive(Debug)]
pub struct LogPacer {
    every: Duration,
    last: Option<Instant>,
    since: Tally,
    total: Tally,
}

/// Occurrences and the amount they carried (records lost).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub times: u64,
    pub amount: u64,
}

impl LogPacer {
    pub fn new(every: Duration) -> Self {
        LogPacer {
            every,
            last: None,
            since: Tally::default(),
            total: Tally::default(),
        }
    }

    /// One occurrence carrying `amount`. Returns `(since the last line, total)` when a line is
    /// due: the first occurrence, then at most one per `every`.
    pub fn note(&mut self, amount: u64, now: Instant) -> Option<(Tally, Tally)> {
        for t in [&mut self.since, &mut self.total] {
            t.times = t.times.saturating_add(1);
            t.amount = t.amount.saturating_add(amount);
        }
        if self
            .last
            .is_some_and(|l| now.saturating_duration_since(l) < self.every)
        {
            return None;
        }
        self.last = Some(now);
        Some((std::mem::take(&mut self.since), self.total))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;

    /// A storm of 100,000 overruns in 25 s makes 3 lines (at 0, 10 and 20 s), each with the
    /// count since the previous line and the running total; nothing is lost from the totals.
    #[test]
    fn overruns_and_gaps_are_logged_at_a_bounded_rate() {
        let t0 = Instant::now();
        let mut p = LogPacer::new(Duration::from_secs(10));
        let mut lines = Vec::new();
        for i in 0..100_000u64 {
            let now = t0 + Duration::from_micros(i * 250);
            if let Some(l) = p.note(3, now) {
                lines.push(l);
            }
        }
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(
            lines[0].0,
            Tally {
                times: 1,
                amount: 3
            }
        );
        assert_eq!(lines[1].1.times, lines[0].0.times + lines[1].0.times);
        let since: u64 = lines.iter().map(|l| l.0.times).sum();
        assert_eq!(
            lines[2].1,
            Tally {
                times: since,
                amount: 3 * since
            }
        );
        // The next line, after the storm, carries the rest.
        let l = p.note(3, t0 + Duration::from_secs(60)).unwrap();
        assert_eq!(l.1.times, 100_001);
        assert_eq!(since + l.0.times, 100_001);
    }

    #[test]
    fn budget_allows_a_burst_then_one_per_interval() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut b = WriteBudget::new(ms(100), 3, t0);
        for _ in 0..3 {
            assert_eq!(b.wait(t0), Duration::ZERO);
            b.spend(t0);
        }
        assert_eq!(b.wait(t0), ms(100), "burst spent");
        assert_eq!(b.wait(t0 + ms(40)), ms(60));
        b.spend(t0 + ms(100));
        assert_eq!(b.wait(t0 + ms(100)), ms(100));
        // After a quiet period the whole burst is back, and no more.
        let later = t0 + ms(10_000);
        for _ in 0..3 {
            assert_eq!(b.wait(later), Duration::ZERO);
            b.spend(later);
        }
        assert!(b.wait(later) > Duration::ZERO);
        // At most burst + elapsed/interval writes in any span: 3 + 10 over one second.
        let mut b = WriteBudget::new(ms(100), 3, t0);
        let mut now = t0;
        let mut writes = 0;
        while now < t0 + ms(1000) {
            now += b.wait(now);
            if now >= t0 + ms(1000) {
                break;
            }
            b.spend(now);
            writes += 1;
        }
        assert_eq!(writes, 12);
    }

    /// Forced writes push the next paced write one interval out, no further.
    #[test]
    fn forced_writes_run_up_no_debt() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut b = WriteBudget::new(s(10), 1, t0);
        b.note_forced(t0);
        b.note_forced(t0 + s(1));
        b.note_forced(t0 + s(2));
        assert_eq!(b.wait(t0 + s(2)), s(10), "one interval from the last one");
        b.spend(t0 + s(12));
        b.note_forced(t0 + s(13));
        assert_eq!(b.wait(t0 + s(13)), s(10));
        // A forced write long after the last paced one.
        let mut b = WriteBudget::new(s(10), 1, t0);
        b.spend(t0);
        b.note_forced(t0 + s(100));
        assert_eq!(b.wait(t0 + s(105)), s(5));
    }

    /// As a token bucket: `burst` at once, then `per_minute` a minute; a refused try spends
    /// nothing.
    #[test]
    fn token_bucket_per_minute() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut b = WriteBudget::per_minute(30, 10, t0);
        let taken = (0..100).filter(|_| b.try_spend(t0)).count();
        assert_eq!(taken, 10, "the burst");
        assert!(!b.try_spend(t0 + Duration::from_millis(1999)));
        assert!(b.try_spend(t0 + s(2)), "one token per 2 s");
        assert!(!b.try_spend(t0 + s(2)));
        // Offered 10 a second for a minute (the last offer at 59.9 s): the burst, then one every
        // 2 s from 2 s to 58 s.
        let mut b = WriteBudget::per_minute(30, 10, t0);
        let mut passed = 0;
        for tenth in 0..600u64 {
            let now = t0 + Duration::from_millis(100 * tenth);
            passed += usize::from(b.try_spend(now));
        }
        assert_eq!(passed, 10 + 29);
        // A rate of 0 is read as 1 a minute, not a division by zero.
        let mut b = WriteBudget::per_minute(0, 1, t0);
        assert!(b.try_spend(t0));
        assert_eq!(b.wait(t0), s(60));
    }
}
