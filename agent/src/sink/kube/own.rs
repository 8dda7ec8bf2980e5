//! Watches of the agent's own objects (its Node, its fault ConfigMap), so that a change someone
//! else makes to what faultline owns is repaired in seconds rather than at the next resync.
//!
//! Each watch is pinned to one object by `fieldSelector=metadata.name=<name>` (kube-runtime's
//! `watch_object`): the API server sends only that object's changes, and RBAC sees the request
//! as naming it. A watch costs the API server no write. The watch is re-established with
//! backoff after errors; a re-list that no longer finds the object (deleted, or an API server
//! restored empty) reports it [`Seen::Absent`]. The sinks stay correct without these watches:
//! the periodic resync remains the backstop.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::watcher::watch_object;
use kube::runtime::WatchStreamExt;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

use crate::backoff::Backoff;

/// After a watched change, how long a sink waits for the object to settle before comparing it:
/// the agent's own multi-call passes (taints, then condition, then labels) produce intermediate
/// versions that are not drift.
pub const SETTLE: Duration = Duration::from_millis(300);

/// What the watch last saw of the object.
#[derive(Debug, Clone, Default)]
pub enum Seen<K> {
    /// Nothing yet (the first list has not answered).
    #[default]
    Unknown,
    /// The object does not exist.
    Absent,
    Present(Arc<K>),
}

/// Starts watching `name` through `api`; the receiver sees every change until `shutdown`.
pub fn watch_one<K>(
    api: Api<K>,
    name: &str,
    shutdown: CancellationToken,
) -> (watch::Receiver<Seen<K>>, tokio::task::JoinHandle<()>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (tx, rx) = watch::channel(Seen::Unknown);
    let what = name.to_string();
    let task = async move {
        let mut stream = watch_object(api, &what).default_backoff().boxed();
        let mut failing = false;
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                n = stream.next() => n,
            };
            match next {
                None => return,
                Some(Ok(obj)) => {
                    if failing {
                        info!(object = %what, "watching it again");
                        failing = false;
                    }
                    debug!(object = %what, present = obj.is_some(), "own object changed");
                    tx.send_replace(match obj {
                        Some(o) => Seen::Present(Arc::new(o)),
                        None => Seen::Absent,
                    });
                }
                Some(Err(e)) => {
                    // Logged once per outage; the watcher retries with backoff.
                    if !failing {
                        warn!(object = %what, error = %e, "watching an own object failed; the periodic resync still repairs it");
                        failing = true;
                    }
                }
            }
        }
    };
    let span = tracing::info_span!("watch", object = %name);
    (rx, tokio::spawn(task.instrument(span)))
}

/// A watched change, then [`SETTLE`]: what a sink waits for in a `select!` beside its other
/// wake-ups. The settle's deadline is kept here, not in the future: a change is marked seen when
/// it arrives, so a future dropped during the settle (another branch of the `select!` won, say a
/// snapshot with nothing new) would otherwise lose it, and a deleted ConfigMap on a quiet node
/// would wait for the next change of the record.
#[derive(Debug, Default)]
pub struct Settling {
    due: Option<tokio::time::Instant>,
}

impl Settling {
    /// Returns [`SETTLE`] after the next change (or after the one already noted); pending for
    /// ever once the watch is gone. Cancel-safe.
    pub async fn next<K>(&mut self, rx: &mut Option<watch::Receiver<Seen<K>>>) {
        loop {
            if let Some(at) = self.due {
                tokio::time::sleep_until(at).await;
                self.due = None;
                return;
            }
            let Some(r) = rx.as_mut() else {
                return std::future::pending().await;
            };
            // `changed` is cancel-safe: a change not yet returned stays unseen.
            if r.changed().await.is_err() {
                *rx = None;
                return std::future::pending().await;
            }
            self.due = Some(tokio::time::Instant::now() + SETTLE);
        }
    }
}

/// The resource versions a sink itself wrote or read last, the newest last: the watch's echo
/// of them is not drift (the agent's own multi-call pass makes intermediate versions).
#[derive(Debug, Default)]
pub struct OwnVersions(std::collections::VecDeque<String>);

impl OwnVersions {
    const KEEP: usize = 16;

    pub fn note(&mut self, rv: Option<&str>) {
        let Some(rv) = rv else { return };
        self.0.retain(|x| x != rv);
        if self.0.len() == Self::KEEP {
            self.0.pop_front();
        }
        self.0.push_back(rv.to_string());
    }

    /// Whether `rv` is the version the sink noted last.
    pub fn is_latest(&self, rv: Option<&str>) -> bool {
        rv.is_some_and(|rv| self.0.back().is_some_and(|x| x == rv))
    }

    /// [`Self::note`] of an object's resourceVersion.
    pub fn note_of<K: Resource>(&mut self, obj: &K) {
        self.note(obj.meta().resource_version.as_deref());
    }

    pub fn ours(&self, rv: Option<&str>) -> bool {
        rv.is_some_and(|rv| self.0.iter().any(|x| x == rv))
    }
}

/// Paces drift repairs when something keeps undoing them (a second agent with the same node
/// name, a mutating webhook, a GitOps controller): the first repair goes out at once; each one
/// within [`DriftPacer::CALM`] of the previous waits longer, by the doubling, jittered delays
/// of [`Backoff`] from 1 s up to 30 s (so a fleet whose labels one controller keeps undoing
/// does not repair in step). A minute without drift starts over.
#[derive(Debug)]
pub struct DriftPacer {
    last: Option<tokio::time::Instant>,
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
    pub const FIRST: Duration = Duration::from_secs(1);
    pub const MAX: Duration = Duration::from_secs(30);
    pub const CALM: Duration = Duration::from_secs(60);

    /// `Ok`: repair now. `Err(at)`: not before `at`.
    pub fn ask(&mut self, now: tokio::time::Instant) -> Result<(), tokio::time::Instant> {
        if let Some(last) = self.last {
            if now < last + self.wait {
                return Err(last + self.wait);
            }
            if now.duration_since(last) >= Self::CALM {
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
    use tokio::time::Instant;

    /// Each wait is at least the last one's double before jitter: within `[1, 2)` s, then
    /// `[2, 4)` s, ...; none passes 30 s; a calm minute starts over at `[1, 2)` s.
    #[test]
    fn repeated_drift_is_repaired_ever_more_slowly_and_calm_starts_over() {
        let t0 = Instant::now();
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

    /// A wake-up of another branch during the settle (the old `changed` future was dropped
    /// there, and the change with it) leaves the change due: it is reported when its settle ends.
    #[tokio::test(start_paused = true)]
    async fn a_change_survives_another_wake_up_during_its_settle() {
        let (tx, rx) = watch::channel(Seen::<String>::Unknown);
        let mut rx = Some(rx);
        let mut settling = Settling::default();
        let t0 = Instant::now();
        tx.send_replace(Seen::Absent);
        tokio::select! {
            () = settling.next(&mut rx) => panic!("reported before its settle"),
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        tokio::time::timeout(Duration::from_secs(5), settling.next(&mut rx))
            .await
            .expect("the change was lost when the other branch won");
        assert_eq!(t0.elapsed(), SETTLE, "reported when its settle ended");
        // Nothing new: nothing more to report; a new change is reported after its own settle.
        assert!(
            tokio::time::timeout(Duration::from_secs(5), settling.next(&mut rx))
                .await
                .is_err(),
            "no change, no report"
        );
        let t1 = Instant::now();
        tx.send_replace(Seen::Absent);
        settling.next(&mut rx).await;
        assert_eq!(t1.elapsed(), SETTLE);
        // The watch gone: pending for ever, not a busy loop.
        drop(tx);
        assert!(
            tokio::time::timeout(Duration::from_secs(5), settling.next(&mut rx))
                .await
                .is_err()
        );
        assert!(rx.is_none());
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
