//! The delay before each retry, for every retry loop in the agent: exponential, doubling from a
//! minimum to a ceiling, with jitter (backon), so that many nodes that failed together (an API
//! server outage, a driver upgrade on the whole fleet) do not retry in step.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Delays that start in `[min, 2·min)`, double, and once at the ceiling spread over
/// `[max/2, max]`: the jitter adds up to the delay itself, so the doubling stops at half the
/// ceiling and no delay passes `max`. (Stopping at `max` before the jitter made delays reach
/// twice the ceiling; clamping them to `max` would put every node on the same period.)
#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    current: ExponentialBackoff,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max,
            current: Self::build(min, max),
        }
    }

    fn build(min: Duration, max: Duration) -> ExponentialBackoff {
        ExponentialBuilder::default()
            .with_min_delay(min.min(max / 2))
            .with_max_delay(max / 2)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// The delay before the next try.
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.current.next().map_or(self.max, |d| d.min(self.max))
    }

    /// After a success: the next failure waits the shortest delay again.
    pub(crate) fn reset(&mut self) {
        self.current = Self::build(self.min, self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first delay is within `[min, 2·min)`, no delay passes the ceiling, the delays at the
    /// ceiling still spread (nodes do not retry in step), and a reset starts over.
    #[test]
    fn delays_double_within_their_bounds_with_jitter() {
        let (min, max) = (Duration::from_millis(200), Duration::from_secs(30));
        let mut b = Backoff::new(min, max);
        let first = b.next_delay();
        assert!((min..min * 2).contains(&first), "{first:?}");
        let delays: Vec<Duration> = (0..200).map(|_| b.next_delay()).collect();
        assert!(delays.iter().all(|d| *d <= max), "{delays:?}");
        let late = &delays[100..];
        assert!(late.iter().all(|d| *d >= max / 2), "{late:?}");
        let distinct: std::collections::BTreeSet<_> = late.iter().collect();
        assert!(distinct.len() > 50, "the jitter spreads them: {late:?}");
        b.reset();
        assert!((min..min * 2).contains(&b.next_delay()));
    }

    /// A minimum above half the ceiling starts at the ceiling's half (the jitter then keeps it
    /// within the ceiling).
    #[test]
    fn a_minimum_above_half_the_ceiling_stays_within_it() {
        let max = Duration::from_secs(10);
        let mut b = Backoff::new(Duration::from_secs(8), max);
        let d: Vec<Duration> = (0..20).map(|_| b.next_delay()).collect();
        assert!(d.iter().all(|d| (max / 2..=max).contains(d)), "{d:?}");
    }
}
