//! When the engine next needs an [`Observation::Tick`](super::Observation::Tick): the earliest
//! time at which time passing alone can change it (a duration escalation, a recovery hold or a
//! quiet time ending, a recovered fault leaving the history). The engine loop sleeps until then
//! instead of ticking every second; before it, a tick changes nothing (property-tested below).
//!
//! Each case restates the rule that `tick` and `prune` (in `recovery`) and `escalate` apply, so
//! a change to one of them must change this too: the properties below catch one that does not.

use jiff::Timestamp;

use super::escalation::sticky;
use super::{Engine, FaultState};
use crate::policy::Policy;
use crate::time::signed;

impl Engine {
    /// The earliest time at or after which a `Tick` can change the engine, given that it is
    /// `now`; `None` when time alone changes nothing until another observation arrives. A time
    /// at or before `now` means a tick is due now (a policy reload that made a rule match).
    ///
    /// After any step that caused no event, the next deadline is never earlier than before,
    /// unless the step was a `Level` (a condition gone starts a recovery hold without an
    /// event), a `Tick` or a policy change: the engine loop recomputes it after those only,
    /// so a storm of repeats does not pay a pass over every fault per record.
    pub fn next_deadline(&self, policy: &Policy, now: Timestamp) -> Option<Timestamp> {
        let mut next: Option<Timestamp> = None;
        let mut at = |t: Option<Timestamp>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        };
        let mut recovered = 0usize;
        let retention = signed(policy.recovered_retention);
        for f in self.faults.values() {
            if !f.fault.active {
                recovered += 1;
                // `prune`: kept while younger than the retention.
                at(f.fault
                    .recovered_at
                    .and_then(|r| r.checked_add(retention).ok()));
                continue;
            }
            at(escalation_due(policy, f, now));
            if let Some(resolving) = f.resolving_since {
                // `tick`: recovered once gone for the hold; no quiet rule while it runs.
                let hold = signed(policy.recover_hold(&f.fault.fault_code));
                at(resolving.checked_add(hold).ok());
                continue;
            }
            if sticky(f) {
                continue;
            }
            // `tick`: the first recovery rule that matches and whose quiet time has passed.
            for r in &policy.recovery {
                let matches = (r.codes.is_empty() || r.codes.contains(&f.fault.fault_code))
                    && (r.sources.is_empty() || r.sources.contains(&f.fault.source))
                    && r.max_handling.is_none_or(|m| f.fault.fault_handling <= m);
                if matches {
                    at(f.fault.last_seen.checked_add(signed(r.clear_after)).ok());
                }
            }
        }
        // `prune`: more recovered faults than the cap (a reload lowered it) are dropped at once.
        if recovered > policy.max_recovered {
            at(Some(now));
        }
        next
    }
}

/// When an escalation rule that would raise `f` (active) can next hit
/// ([`super::escalation::rule_due`], the rule's one reading).
fn escalation_due(policy: &Policy, f: &FaultState, now: Timestamp) -> Option<Timestamp> {
    policy
        .escalation_rules()
        .filter_map(|r| super::escalation::rule_due(r, f, now))
        .min()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::tests::{arb_obs, t, Rig};
    use super::super::*;

    /// Quiet recovery (10 min), a recovery hold (30 s), a duration escalation (20 s), a
    /// frequency escalation and a short history retention: every kind of deadline.
    const POLICY: &str = "\
recovered_retention: 2h
max_recovered: 3
escalation:
  - { codes: [Xid13, Xid31], count: 2, window: 1h, handling: SeparateNPU }
  - { codes: [NVLINK_DOWN], duration: 20s, recover_after: 30s, handling: SeparateNPU }
recovery:
  - { codes: [KMSG_LOSS], clear_after: 10m }
";

    fn deadline(r: &Rig, s: i64) -> Option<Timestamp> {
        r.engine.next_deadline(&r.policy, t(s))
    }

    #[test]
    fn nothing_to_wait_for_without_timed_work() {
        let mut r = Rig::new(POLICY);
        assert_eq!(deadline(&r, 0), None, "empty");
        // Xid 79: no rule recovers or escalates it by time.
        r.at(
            0,
            Observation::Signal(Signal::new(Source::Kmsg, FaultCode::Xid(79), None, "x")),
        );
        assert_eq!(deadline(&r, 5), None);
    }

    /// Each deadline is the moment the tick acts, to the second: one second before it a tick
    /// changes nothing, at it the tick acts.
    #[test]
    fn each_kind_of_timed_work_has_its_deadline() {
        let named =
            |c: &str| Observation::Signal(Signal::new(Source::Kmsg, FaultCode::named(c), None, c));
        let mut r = Rig::new(POLICY);
        r.at(100, named("KMSG_LOSS"));
        assert_eq!(deadline(&r, 100), Some(t(100 + 600)), "quiet time");
        r.at(400, named("KMSG_LOSS"));
        assert_eq!(
            deadline(&r, 400),
            Some(t(400 + 600)),
            "a repeat moves it later"
        );
        assert!(r.at(999, Observation::Tick).is_empty());
        assert!(
            !r.at(1000, Observation::Tick).is_empty(),
            "recovered at the deadline"
        );
        assert_eq!(
            deadline(&r, 1000),
            Some(t(1000 + 7200)),
            "then its history's end"
        );

        let link = |present: bool| Observation::Level {
            source: Source::Nvml,
            device: None,
            domain: "d".into(),
            present: present
                .then(|| Signal::new(Source::Nvml, FaultCode::named("NVLINK_DOWN"), None, "down"))
                .into_iter()
                .collect(),
        };
        r.at(2000, link(true));
        assert_eq!(deadline(&r, 2000), Some(t(2020)), "duration escalation");
        r.at(2010, link(false));
        assert_eq!(
            deadline(&r, 2010),
            Some(t(2040)),
            "recovery hold; the duration clock stopped"
        );
        r.at(2039, Observation::Tick);
        assert!(!r.at(2040, Observation::Tick).is_empty(), "hold over");

        // A frequency rule that a reload made match is due at once.
        let mut r = Rig::new("");
        r.at(0, xid13());
        r.at(60, xid13());
        // The built-in policy's quiet recovery of application errors (an hour).
        assert_eq!(deadline(&r, 60), Some(t(60 + 3600)));
        r.policy = Policy::parse(POLICY).unwrap();
        assert_eq!(deadline(&r, 61), Some(t(61)));
        assert!(!r.at(61, Observation::Tick).is_empty(), "escalated");
        assert_eq!(deadline(&r, 61), None);
    }

    fn xid13() -> Observation {
        Observation::Signal(Signal::new(Source::Kmsg, FaultCode::Xid(13), None, "x"))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// After any history: a tick at any time from now until just before the deadline
        /// changes nothing (no event, same revision), and a tick at the deadline moves it later
        /// (the engine loop never spins on a deadline that a tick does not consume).
        #[test]
        fn a_tick_before_the_deadline_changes_nothing_and_one_at_it_moves_it(
            obs in prop::collection::vec(arb_obs(), 1..60),
            frac in 0.0f64..1.0,
        ) {
            let mut r = Rig::new(POLICY);
            let mut now = 0;
            for (dt, o) in obs {
                now += dt;
                r.at(now, o);
            }
            let Some(due) = deadline(&r, now) else { return Ok(()) };
            let due_s = due.as_second() - t(0).as_second();
            if due_s > now {
                let before = now + ((due_s - 1 - now) as f64 * frac) as i64;
                let mut copy = Rig { engine: r.engine.clone(), policy: r.policy.clone(), catalog: r.catalog.clone() };
                let rev = copy.engine.revision();
                let events = copy.at(before, Observation::Tick);
                prop_assert!(events.is_empty(), "tick at {} before the deadline {}: {:?}", before, due_s, events);
                prop_assert_eq!(copy.engine.revision(), rev);
            }
            let at = due_s.max(now);
            r.at(at, Observation::Tick);
            if let Some(next) = deadline(&r, at) {
                prop_assert!(next > t(at), "deadline {:?} again after the tick at {}", next, at);
            }
        }

        /// A step that caused no event and is neither a `Level` nor a `Tick` never brings the
        /// deadline forward (what lets the engine loop skip the pass after a repeat).
        #[test]
        fn an_uneventful_signal_never_brings_the_deadline_forward(
            obs in prop::collection::vec(arb_obs(), 1..60),
        ) {
            let mut r = Rig::new(POLICY);
            let mut now = 0;
            for (dt, o) in obs {
                now += dt;
                let before = deadline(&r, now);
                let level_or_tick = matches!(o, Observation::Level { .. } | Observation::Tick);
                let events = r.at(now, o);
                if events.is_empty() && !level_or_tick {
                    let after = deadline(&r, now);
                    match (before, after) {
                        (Some(b), Some(a)) => prop_assert!(a >= b, "{:?} -> {:?}", b, a),
                        (None, Some(a)) => prop_assert!(false, "none -> {:?}", a),
                        _ => {}
                    }
                }
            }
        }
    }
}
