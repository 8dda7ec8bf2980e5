//! What the node and ConfigMap sinks share about their own objects (the agent's Node, its fault
//! ConfigMap), both watched by name through kube-runtime so that a change someone else makes is
//! repaired in seconds rather than at the next resync: the versions a sink wrote itself (their
//! watch echoes are not drift), and the pacing of repairs that something keeps undoing.

use std::time::Duration;

use kube::Resource;

use crate::backoff::Backoff;

/// How often a failing watch of an own object is logged (with the count of failures since).
pub(crate) const WATCH_WARN_EVERY: Duration = Duration::from_secs(300);

/// The resource versions a sink itself wrote or read last, the newest last: the watch's echo
/// of them is not drift (the agent's own multi-call pass makes intermediate versions).
#[derive(Debug, Default)]
pub(crate) struct OwnVersions(std::collections::VecDeque<String>);

impl OwnVersions {
    const KEEP: usize = 16;

    pub(crate) fn note(&mut self, rv: Option<&str>) {
        let Some(rv) = rv else { return };
        self.0.retain(|x| x != rv);
        if self.0.len() == Self::KEEP {
            self.0.pop_front();
        }
        self.0.push_back(rv.to_string());
    }

    /// Whether `rv` is the version the sink noted last.
    pub(crate) fn is_latest(&self, rv: Option<&str>) -> bool {
        rv.is_some_and(|rv| self.0.back().is_some_and(|x| x == rv))
    }

    /// [`Self::note`] of an object's resourceVersion.
    pub(crate) fn note_of<K: Resource>(&mut self, obj: &K) {
        self.note(obj.meta().resource_version.as_deref());
    }

    pub(crate) fn ours(&self, rv: Option<&str>) -> bool {
        rv.is_some_and(|rv| self.0.iter().any(|x| x == rv))
    }
}

/// Paces drift repairs when something keeps undoing them (a second agent with the same node
/// name, a mutating webhook, a GitOps controller): the first repair goes out at once; each one
/// within [`DriftPacer::CALM`] of the previous waits longer, by the doubling, jittered delays
/// of [`Backoff`] from 1 s up to 30 s (so a fleet whose labels one controller keeps undoing
/// does not repair in step). A minute without drift starts over.
#[derive(Debug)]
pub(crate) struct DriftPacer {
    /// Since boot ([`crate::clock::Clock::since_boot`]), as `ask`'s times.
    last: Option<Duration>,
    wait: Duration,
    delays: Backoff,
}

impl Default for DriftPacer {
    fn default() -> Self {
        DriftPacer {
            last: None,
            wait: Duration::ZERO,
            delays: Backoff::new(Self::FIRST, Self::MAX),
        }
    }
}

impl DriftPacer {
    pub(crate) const FIRST: Duration = Duration::from_secs(1);
    pub(crate) const MAX: Duration = Duration::from_secs(30);
    pub(crate) const CALM: Duration = Duration::from_secs(60);

    /// `Ok`: repair now. `Err(at)`: not before `at`.
    pub(crate) fn ask(&mut self, now: Duration) -> Result<(), Duration> {
        if let Some(last) = self.last {
            if now < last + self.wait {
                return Err(last + self.wait);
            }
            if now - last >= Self::CALM {
                self.delays.reset();
            }
        }
        self.wait = self.delays.next_delay();
        self.last = Some(now);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each wait is at least the last one's double before jitter: within `[1, 2)` s, then
    /// `[2, 4)` s, ...; none passes 30 s; a calm minute starts over at `[1, 2)` s.
    #[test]
    fn repeated_drift_is_repaired_ever_more_slowly_and_calm_starts_over() {
        let t0 = Duration::from_secs(1000);
        let s = Duration::from_secs;
        let mut p = DriftPacer::default();
        assert_eq!(p.ask(t0), Ok(()), "the first repair at once");
        let at = p.ask(t0 + Duration::from_millis(300)).unwrap_err();
        assert!((t0 + s(1)..t0 + s(2)).contains(&at), "{:?}", at - t0);
        assert_eq!(p.ask(at), Ok(()));
        let next = p.ask(at).unwrap_err();
        assert!(
            (at + s(2)..at + s(4)).contains(&next),
            "the wait doubled: {:?}",
            next - at
        );
        let mut t = next;
        for _ in 0..20 {
            assert_eq!(p.ask(t), Ok(()));
            let after = p.ask(t).unwrap_err();
            assert!(after - t <= s(30), "capped at 30 s: {:?}", after - t);
            t = after;
        }
        assert!(
            t - t0 > s(300),
            "at the ceiling, waits of 15-30 s: {:?}",
            t - t0
        );
        assert_eq!(p.ask(t), Ok(()));
        let calm = t + s(61);
        assert!(p.ask(calm).is_ok(), "a calm minute: repaired at once");
        let again = p.ask(calm).unwrap_err();
        assert!(
            (calm + s(1)..calm + s(2)).contains(&again),
            "after a calm minute the wait is 1-2 s again: {:?}",
            again - calm
        );
    }

    #[test]
    fn own_versions_remember_the_last_few() {
        let mut v = OwnVersions::default();
        assert!(!v.ours(Some("1")) && !v.ours(None));
        for i in 0..20 {
            v.note(Some(&i.to_string()));
        }
        v.note(None);
        assert!(v.ours(Some("19")) && v.ours(Some("4")));
        assert!(!v.ours(Some("3")), "only the last 16");
        assert!(v.is_latest(Some("19")) && !v.is_latest(Some("18")) && !v.is_latest(None));
        // Read again after a later one: the latest again, and kept once.
        v.note(Some("18"));
        assert!(v.is_latest(Some("18")) && v.ours(Some("19")) && v.ours(Some("4")));
    }
}
