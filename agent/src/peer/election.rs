//! Who coordinates without Kubernetes: the members file's order and a liveness rule. The first
//! member not known to be down coordinates. Each agent pings, every [`PING_EVERY`], the members
//! listed before itself, in order, and stops at the first that is up; so in a healthy pool every
//! agent pings only the first member, and the first member pings nobody.
//!
//! A member is down after [`DOWN_AFTER`] pings in a row went unanswered (about 15 s, like the
//! Lease) and up again after [`UP_AFTER`] answers in a row (a flapping first member does not take
//! the role back and forth on every ping). Every member starts out believing the ones before it
//! are up: a restarted agent does not coordinate before it has seen the earlier ones down.
//!
//! What this does not give: agreement. Two agents that see different members down (a partition)
//! may each think a different member coordinates; the members-file order keeps that to the
//! members that cannot reach the earlier ones, and an agent takes assignments only from the
//! member it thinks coordinates. Runs are published in the coordinator's own state directory, so
//! a new coordinator does not resume a run its predecessor left unfinished (a requester's
//! retry, with its request id, starts it again).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::coordinator::Transport;
use super::members::{Member, Members};

/// How often the earlier members are pinged.
pub const PING_EVERY: Duration = Duration::from_secs(5);
/// Unanswered pings in a row before a member counts as down.
pub const DOWN_AFTER: u32 = 3;
/// Answers in a row before a member that was down counts as up again.
pub const UP_AFTER: u32 = 2;

/// What this agent has seen of the members before it: pure, stepped by ping results.
#[derive(Debug, Default, Clone)]
pub struct Liveness {
    /// Node -> answers (positive) or silences (negative) in a row.
    streak: HashMap<String, i64>,
    down: BTreeSet<String>,
}

impl Liveness {
    /// One ping of `node`: answered or not.
    pub fn observe(&mut self, node: &str, answered: bool) {
        let s = self.streak.entry(node.to_string()).or_insert(0);
        *s = match (answered, *s) {
            (true, n) if n > 0 => n + 1,
            (true, _) => 1,
            (false, n) if n < 0 => n - 1,
            (false, _) => -1,
        };
        if *s <= -i64::from(DOWN_AFTER) {
            self.down.insert(node.to_string());
        } else if *s >= i64::from(UP_AFTER) {
            self.down.remove(node);
        }
    }

    pub fn is_down(&self, node: &str) -> bool {
        self.down.contains(node)
    }
}

/// The rule: the first member, in the file's order, that is not down. `None` for no members.
pub fn elected<'a>(order: &'a [Member], live: &Liveness) -> Option<&'a Member> {
    order.iter().find(|m| !live.is_down(&m.node))
}

/// Runs the election for `me` until shutdown: whether this agent coordinates, and who does.
pub fn elect(
    me: String,
    members: Arc<dyn Members>,
    transport: Arc<dyn Transport>,
    shutdown: CancellationToken,
) -> (watch::Receiver<bool>, watch::Receiver<Option<String>>) {
    let (role_tx, role) = watch::channel(false);
    let (who_tx, who) = watch::channel(None);
    tokio::spawn(async move {
        let mut live = Liveness::default();
        loop {
            match members.list().await {
                Ok(order) => {
                    // Ping the earlier members in order until one is up: that one coordinates.
                    for m in order.iter().take_while(|m| m.node != me) {
                        let answered = tokio::select! {
                            _ = shutdown.cancelled() => {
                                role_tx.send_replace(false);
                                return;
                            }
                            r = transport.ping(m) => r.is_ok(),
                        };
                        live.observe(&m.node, answered);
                        if !live.is_down(&m.node) {
                            break;
                        }
                    }
                    let now = elected(&order, &live).map(|m| m.node.clone());
                    let mine = now.as_deref() == Some(me.as_str());
                    if *who_tx.borrow() != now {
                        info!(coordinator = ?now, this_agent = mine, "peer-check coordinator (members file)");
                    }
                    who_tx.send_if_modified(|w| {
                        let changed = *w != now;
                        *w = now;
                        changed
                    });
                    role_tx.send_if_modified(|r| {
                        let changed = *r != mine;
                        *r = mine;
                        changed
                    });
                }
                Err(e) => {
                    warn!(error = %e, "cannot read the members; the coordinator stays as it was")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => {
                    role_tx.send_replace(false);
                    return;
                }
                _ = tokio::time::sleep(PING_EVERY) => {}
            }
        }
    });
    (role, who)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use faultline_proto::v1::{CheckAccepted, CheckAssignment, PingReply, RunConclusion};
    use std::sync::Mutex;

    fn members(names: &[&str]) -> Vec<Member> {
        names
            .iter()
            .enumerate()
            .map(|(i, n)| Member {
                node: n.to_string(),
                address: format!("10.0.0.{}:20261", i + 1),
                ip: format!("10.0.0.{}", i + 1).parse().unwrap(),
                topology: None,
            })
            .collect()
    }

    #[test]
    fn down_after_three_silences_up_after_two_answers() {
        let order = members(&["a", "b", "c"]);
        let mut live = Liveness::default();
        assert_eq!(elected(&order, &live).unwrap().node, "a", "all up at first");
        for i in 1..=3 {
            live.observe("a", false);
            let want = if i < 3 { "a" } else { "b" };
            assert_eq!(elected(&order, &live).unwrap().node, want, "silence {i}");
        }
        // One answer is not enough to take the role back; a silence restarts the count.
        live.observe("a", true);
        live.observe("a", false);
        live.observe("a", true);
        assert_eq!(elected(&order, &live).unwrap().node, "b");
        live.observe("a", true);
        assert_eq!(elected(&order, &live).unwrap().node, "a");
        // Both earlier members down: the third coordinates.
        for _ in 0..3 {
            live.observe("a", false);
            live.observe("b", false);
        }
        assert_eq!(elected(&order, &live).unwrap().node, "c");
        assert!(elected(&[], &live).is_none());
    }

    #[derive(Debug)]
    struct List(Vec<Member>);

    #[async_trait::async_trait]
    impl Members for List {
        async fn list(&self) -> Result<Vec<Member>, super::super::members::MembersError> {
            Ok(self.0.clone())
        }
    }

    /// Agents that answer pings unless they are in `dead`; counts the pings per node.
    #[derive(Debug, Default)]
    struct Pings {
        dead: Mutex<BTreeSet<String>>,
        asked: Mutex<HashMap<String, usize>>,
    }

    #[async_trait::async_trait]
    impl Transport for Pings {
        async fn ping(&self, to: &Member) -> Result<PingReply, String> {
            *self
                .asked
                .lock()
                .unwrap()
                .entry(to.node.clone())
                .or_default() += 1;
            if self.dead.lock().unwrap().contains(&to.node) {
                return Err("connection refused".into());
            }
            Ok(PingReply::default())
        }
        async fn reach(
            &self,
            _: &Member,
            _: &[Member],
        ) -> Result<Vec<faultline_proto::v1::Reached>, String> {
            Err("not used".into())
        }
        async fn assign(&self, _: &Member, _: CheckAssignment) -> Result<CheckAccepted, String> {
            Err("not used".into())
        }
        async fn cancel(&self, _: &Member, _: CheckAssignment) {}
        async fn conclude(&self, _: &Member, _: RunConclusion) -> Result<(), String> {
            Err("not used".into())
        }
    }

    /// The second member takes over about 15 s after the first stops answering, and gives the
    /// role back once the first answers again; the third never coordinates meanwhile, and
    /// nobody pings past the first live member.
    #[tokio::test(start_paused = true)]
    async fn the_next_live_member_takes_over_and_gives_back() {
        let order = members(&["a", "b", "c"]);
        let pings = Arc::new(Pings::default());
        let shutdown = CancellationToken::new();
        let start = |me: &str| {
            elect(
                me.into(),
                Arc::new(List(order.clone())),
                pings.clone(),
                shutdown.clone(),
            )
        };
        let (a_role, _) = start("a");
        let (b_role, b_who) = start("b");
        let (c_role, c_who) = start("c");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(*a_role.borrow() && !*b_role.borrow() && !*c_role.borrow());
        assert_eq!(c_who.borrow().as_deref(), Some("a"));
        assert!(
            !pings.asked.lock().unwrap().contains_key("b"),
            "c stops at a"
        );
        pings.dead.lock().unwrap().insert("a".into());
        tokio::time::sleep(PING_EVERY * (DOWN_AFTER - 1)).await;
        assert!(!*b_role.borrow(), "not before {DOWN_AFTER} silences");
        tokio::time::sleep(PING_EVERY + Duration::from_secs(1)).await;
        assert!(*b_role.borrow() && !*c_role.borrow());
        assert_eq!(b_who.borrow().as_deref(), Some("b"));
        assert_eq!(c_who.borrow().as_deref(), Some("b"));
        pings.dead.lock().unwrap().clear();
        tokio::time::sleep(PING_EVERY * UP_AFTER + Duration::from_secs(1)).await;
        assert!(!*b_role.borrow());
        assert_eq!(b_who.borrow().as_deref(), Some("a"));
        shutdown.cancel();
    }
}
