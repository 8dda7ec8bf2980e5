//! The write rate limiter every sink shares: a generic cell rate algorithm (GCRA), which is a
//! token bucket kept as one time instead of a token count.
//!
//! `WriteBudget::new(interval, burst, now)` allows `burst` writes back to back, then one per
//! `interval`; in any span `T` at most `burst + T / interval` writes pass. Used by the file sink
//! (`--write-interval`, `--write-burst`), by the fault ConfigMap sink for changes that touch
//! only counters (`--kube-write-interval`, burst 1) and by the Event sink as a token bucket of
//! `--kube-event-burst` refilled at `--kube-event-rate` per minute.
//!
//! Times are `tokio::time::Instant`, so tests can pause and advance the clock.

use std::time::Duration;

use tokio::time::Instant;

/// A generic cell rate limiter (GCRA): up to `burst` writes at once, then one per `interval`.
#[derive(Debug, Clone)]
pub struct WriteBudget {
    interval: Duration,
    burst: u32,
    /// The theoretical time of the next write if writes were evenly spaced.
    tat: Instant,
}

impl WriteBudget {
    pub fn new(interval: Duration, burst: u32, now: Instant) -> Self {
        WriteBudget {
            interval,
            burst: burst.max(1),
            tat: now,
        }
    }

    /// `per_minute` writes a minute after a burst of `burst`: a token bucket holding `burst`
    /// tokens, refilled by one every `60 s / per_minute` (0 counts as 1).
    pub fn per_minute(per_minute: u32, burst: u32, now: Instant) -> Self {
        WriteBudget::new(Duration::from_secs(60) / per_minute.max(1), burst, now)
    }

    /// How long to wait before the next write may go out.
    pub fn wait(&self, now: Instant) -> Duration {
        let slack = self.interval * (self.burst - 1);
        (self.tat.checked_sub(slack).unwrap_or(now)).saturating_duration_since(now)
    }

    /// Records a write made at `now`.
    pub fn spend(&mut self, now: Instant) {
        self.tat = self.tat.max(now) + self.interval;
    }

    /// Records a write that went out whatever the budget said (a change that cannot wait): the
    /// next paced write waits at least one interval from it, but such writes run up no debt,
    /// so three of them in a row do not hold the next paced write back three intervals.
    pub fn note_forced(&mut self, now: Instant) {
        self.tat = self.tat.max(now + self.interval);
    }

    /// Spends one write if one may go out at `now`; false (nothing spent) when the budget is
    /// used up.
    pub fn try_spend(&mut self, now: Instant) -> bool {
        let free = self.wait(now).is_zero();
        if free {
            self.spend(now);
        }
        free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
