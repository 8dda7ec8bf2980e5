//! Time as values. Wall-clock instants are `jiff::Timestamp` (the type k8s-openapi's `Time`
//! wraps, so records and Kubernetes objects share one time type); spans in the policy are
//! `std::time::Duration`. Nothing here reads a clock: the caller passes `now`.

use std::time::Duration;

pub use jiff::{SignedDuration, Timestamp};

/// A policy duration as a signed span, saturating: a duration longer than `SignedDuration` can
/// hold (about 292 billion years) is "forever", never an error or a wrap.
pub fn signed(d: Duration) -> SignedDuration {
    SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX)
}

/// The time elapsed from `earlier` to `later`; negative when the clock went back.
pub fn since(later: Timestamp, earlier: Timestamp) -> SignedDuration {
    later.duration_since(earlier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_policy_durations_saturate() {
        assert_eq!(signed(Duration::MAX), SignedDuration::MAX);
        assert_eq!(
            signed(Duration::from_secs(90)),
            SignedDuration::from_secs(90)
        );
    }

    #[test]
    fn elapsed_time_is_signed() {
        let a = Timestamp::from_second(1_000).unwrap();
        let b = Timestamp::from_second(1_060).unwrap();
        assert_eq!(since(b, a), SignedDuration::from_secs(60));
        assert_eq!(since(a, b), SignedDuration::from_secs(-60));
    }

    /// `state.json` files written before the move to jiff hold chrono's RFC 3339 forms
    /// (nanoseconds, or whole seconds, with `Z` or `+00:00`): a restart after an upgrade must
    /// read them as the same instants.
    #[test]
    fn timestamps_saved_in_the_earlier_format_still_load() {
        let want = Timestamp::from_second(1_790_000_000).unwrap();
        for text in [
            "\"2026-09-21T14:13:20Z\"",
            "\"2026-09-21T14:13:20.000000000Z\"",
            "\"2026-09-21T14:13:20+00:00\"",
        ] {
            let t: Timestamp = serde_json::from_str(text).unwrap();
            assert_eq!(t, want, "{text}");
        }
        let ns: Timestamp = serde_json::from_str("\"2026-09-21T14:13:20.123456789Z\"").unwrap();
        assert_eq!(
            ns.duration_since(want),
            SignedDuration::from_nanos(123_456_789)
        );
    }
}
