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

/// `t` moved by `d`, saturating at the ends of time.
pub fn shift(t: Timestamp, d: SignedDuration) -> Timestamp {
    // Only a span with calendar units can make this fail; a SignedDuration has none.
    t.saturating_add(d).unwrap_or(t)
}

/// The engine's timeline within one boot: the wall-clock time of boot, as first estimated in
/// that boot, plus the time since boot (`CLOCK_BOOTTIME`). Windows, holds and durations are
/// measured on it, so a wall-clock step (an NTP step, `date -s`) moves nothing; a restart within
/// the boot continues it (it is saved with the boot id). A new boot starts a new one, anchored
/// on the wall clock of that boot minus the last known difference between the wall clock and
/// the old timeline: the times saved in the old boot stay comparable with the new ones even
/// when the old boot's clock was stepped after its timeline was anchored.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Timeline {
    /// The boot this timeline belongs to; `None` when the boot id is unknown (then every start
    /// anchors anew).
    pub boot_id: Option<String>,
    /// The timeline's time at boot.
    pub anchor: Timestamp,
    /// The last known wall-clock time minus timeline time, in milliseconds (the display offset,
    /// saved with the state): carried into the next boot's timeline.
    #[serde(default)]
    pub wall_offset_ms: i64,
}

impl Timeline {
    /// The timeline of the current boot: `saved` when it is of this boot, else one anchored so
    /// that its time now is `wall` minus the saved timeline's last wall offset (so times saved
    /// on the old timeline compare correctly with the new one's).
    pub fn for_boot(
        saved: Option<&Timeline>,
        boot_id: Option<&str>,
        wall: Timestamp,
        since_boot: Duration,
    ) -> Timeline {
        if let Some(t) = saved.filter(|t| boot_id.is_some() && t.boot_id.as_deref() == boot_id) {
            return t.clone();
        }
        let offset_ms = saved.map_or(0, |t| t.wall_offset_ms);
        let offset = SignedDuration::from_millis(offset_ms);
        Timeline {
            boot_id: boot_id.map(str::to_string),
            anchor: shift(shift(wall, -signed(since_boot)), -offset),
            wall_offset_ms: offset_ms,
        }
    }

    /// The timeline's time `since_boot` after boot.
    pub fn at(&self, since_boot: Duration) -> Timestamp {
        shift(self.anchor, signed(since_boot))
    }
}

/// How far the wall clock is from the timeline now (`wall - timeline`), for showing the
/// timeline's times as wall-clock dates. Moves only when it changed by more than a second, so
/// reading two clocks a few microseconds apart never rewrites a record.
pub fn display_offset(
    current: SignedDuration,
    wall: Timestamp,
    timeline_now: Timestamp,
) -> SignedDuration {
    let fresh = since(wall, timeline_now);
    if (fresh - current).abs() > SignedDuration::from_secs(1) {
        fresh
    } else {
        current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restart within the boot continues the saved timeline, whatever the wall clock says
    /// now; a new boot (or an unknown boot id) anchors a new one on the wall clock.
    #[test]
    fn the_timeline_is_kept_within_a_boot_only() {
        let t = |s| Timestamp::from_second(s).unwrap();
        let saved = Timeline {
            boot_id: Some("b1".into()),
            anchor: t(1_000),
            wall_offset_ms: 0,
        };
        let up = Duration::from_secs(500);
        // Same boot, the wall clock stepped an hour ahead meanwhile: unchanged.
        let same = Timeline::for_boot(Some(&saved), Some("b1"), t(1_500 + 3_600), up);
        assert_eq!(same, saved);
        assert_eq!(same.at(up), t(1_500));
        // A new boot: anchored on the wall clock.
        let next = Timeline::for_boot(Some(&saved), Some("b2"), t(9_000), up);
        assert_eq!(next.anchor, t(8_500));
        assert_eq!(next.boot_id.as_deref(), Some("b2"));
        assert_eq!(next.at(up), t(9_000));
        // Unknown boot id: never trusted across starts.
        let unknown = Timeline::for_boot(Some(&saved), None, t(9_000), up);
        assert_eq!(unknown.anchor, t(8_500));
        assert_eq!(
            Timeline::for_boot(Some(&unknown), None, t(7_000), up).anchor,
            t(6_500)
        );
        // The old boot's wall clock was stepped an hour ahead after its timeline was anchored
        // (wall = timeline + 1 h when last saved): the new timeline keeps that difference, so an
        // occurrence saved at old-timeline time T and one now are still (now - T) apart.
        let stepped = Timeline {
            wall_offset_ms: 3_600_000,
            ..saved.clone()
        };
        let next = Timeline::for_boot(Some(&stepped), Some("b2"), t(9_000), up);
        assert_eq!(next.at(up), t(9_000 - 3_600));
        assert_eq!(next.wall_offset_ms, 3_600_000);
    }

    #[test]
    fn the_display_offset_moves_on_steps_not_on_jitter() {
        let t = |ms| Timestamp::from_millisecond(ms).unwrap();
        let zero = SignedDuration::ZERO;
        assert_eq!(display_offset(zero, t(10_000), t(10_000)), zero);
        // Microseconds to a second between two readings: kept.
        assert_eq!(display_offset(zero, t(10_900), t(10_000)), zero);
        assert_eq!(display_offset(zero, t(9_100), t(10_000)), zero);
        // A step either way: followed.
        let hour = SignedDuration::from_secs(3_600);
        assert_eq!(display_offset(zero, t(10_000 + 3_600_000), t(10_000)), hour);
        assert_eq!(
            display_offset(hour, t(10_000 - 3_600_000), t(10_000)),
            -hour
        );
    }

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
