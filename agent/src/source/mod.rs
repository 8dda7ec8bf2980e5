//! Sources: turn the world into engine inputs.
//!
//! Each source runs on its own task or thread, gets a [`SourceContext`] with the channel to the
//! engine, the metrics and the shutdown token, and never blocks another source.

pub mod ascend;
pub mod control;
pub mod kmsg;
pub mod node;
pub mod nvml;
pub mod policy_watch;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

pub use faultline_core::engine::Input;

/// What every source gets.
#[derive(Debug, Clone)]
pub struct SourceContext {
    pub tx: mpsc::Sender<Input>,
    pub metrics: Arc<Metrics>,
    pub shutdown: CancellationToken,
}

/// Keeps `(time, value)` samples of a counter for `window` and returns its growth over the
/// window. A counter that went down was reset (driver reload, device reset): only the growth
/// since the reset counts.
pub(crate) fn counter_growth(
    hist: &mut VecDeque<(Instant, u64)>,
    now: Instant,
    value: u64,
    window: Duration,
) -> u64 {
    hist.push_back((now, value));
    while hist.len() > 1
        && hist
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
    {
        hist.pop_front();
    }
    // Back from the newest sample while the counter only grew: the oldest of those is the base.
    let base = hist
        .iter()
        .rev()
        .map(|(_, v)| *v)
        .take_while(|v| *v <= value)
        .min()
        .unwrap_or(value);
    value - base
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_growth_over_a_window_and_across_resets() {
        let t0 = Instant::now();
        let w = Duration::from_secs(60);
        let s = |n: u64| t0 + Duration::from_secs(n);
        let mut h = VecDeque::new();
        assert_eq!(counter_growth(&mut h, s(0), 5, w), 0);
        assert_eq!(counter_growth(&mut h, s(10), 20, w), 15);
        // Reset to 2, then 4: growth since the reset only.
        assert_eq!(counter_growth(&mut h, s(20), 2, w), 0);
        assert_eq!(counter_growth(&mut h, s(30), 4, w), 2);
        // The window moves past the reset: 4 -> 9 within the window.
        assert_eq!(counter_growth(&mut h, s(85), 9, w), 5);
        assert_eq!(counter_growth(&mut h, s(200), 9, w), 0);
        assert_eq!(h.len(), 1);
    }
}
