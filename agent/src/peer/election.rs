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
//! The coordinator fences itself with [`MembersFence`]: before each round and before it
//! concludes, its election must have run lately (an agent frozen past [`FRESH`] has a stale
//! view: the role is dropped until it has looked again), and none of the members after it that
//! answer may name another coordinator (the one that took over while it was frozen does).
//! Every agent takes assignments and conclusions only from the member its own election names
//! (`authz`).
//!
//! What this does not give: agreement. Two agents that see different members down (a partition)
//! may each think a different member coordinates; the members-file order keeps that to the
//! members that cannot reach the earlier ones, and the later one's fence stops its runs while
//! the members after it name the earlier one. Runs are published in the coordinator's own state
//! directory, so a new coordinator does not resume a run its predecessor left unfinished (a
//! requester's retry, with its request id, starts it again).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::authz::CoordinatorId;
use super::coordinator::{Fence, Transport};
use super::members::{Member, Members};

/// How often the earlier members are pinged.
pub const PING_EVERY: Duration = Duration::from_secs(5);
/// Unanswered pings in a row before a member counts as down.
pub const DOWN_AFTER: u32 = 3;
/// Answers in a row before a member that was down counts as up again.
pub const UP_AFTER: u32 = 2;
/// The election must have looked at the members within this (every ping and every tick count)
/// for its coordinator to act; a longer silence is a freeze, and the role is dropped for
/// `DOWN_AFTER` ticks, long enough for a member that took over to see this one back.
pub const FRESH: Duration = Duration::from_secs(12);
/// Members after the coordinator asked whom they take for the coordinator (`MembersFence`).
pub const SUCCESSORS_ASKED: usize = 3;

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

/// The election of one agent, running: its role, whom it takes for the coordinator, and the
/// fence its coordinator uses.
#[derive(Debug)]
pub struct Elected {
    pub role: watch::Receiver<bool>,
    pub who: watch::Receiver<Option<CoordinatorId>>,
    pub fence: MembersFence,
}

/// The bare-metal fence (see the module header).
#[derive(Debug, Clone)]
pub struct MembersFence {
    me: String,
    role: watch::Receiver<bool>,
    members: Arc<dyn Members>,
    transport: Arc<dyn Transport>,
    /// When the election last looked at the members.
    looked: Arc<std::sync::Mutex<Instant>>,
}

#[async_trait::async_trait]
impl Fence for MembersFence {
    fn watch(&self) -> watch::Receiver<bool> {
        self.role.clone()
    }
    async fn confirm(&self) -> Result<(), String> {
        if !*self.role.borrow() {
            return Err("this agent no longer coordinates".into());
        }
        let silent = self.looked.lock().map(|l| l.elapsed()).unwrap_or_default();
        if silent > FRESH {
            return Err(format!(
                "this agent's election has not run for {} s (was it stopped?)",
                silent.as_secs()
            ));
        }
        let order = self.members.list().await.map_err(|e| e.to_string())?;
        let after: Vec<&Member> = order
            .iter()
            .skip_while(|m| m.node != self.me)
            .skip(1)
            .take(SUCCESSORS_ASKED)
            .collect();
        let answers =
            futures::future::join_all(after.iter().map(|m| self.transport.alive(m))).await;
        for (m, a) in after.iter().zip(answers) {
            if let Ok(reply) = a {
                if !reply.coordinator.is_empty() && reply.coordinator != self.me {
                    return Err(format!(
                        "{} takes {} for the coordinator",
                        m.node, reply.coordinator
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Runs the election for `me` until shutdown.
pub fn elect(
    me: String,
    members: Arc<dyn Members>,
    transport: Arc<dyn Transport>,
    shutdown: CancellationToken,
) -> Elected {
    let (role_tx, role) = watch::channel(false);
    let (who_tx, who) = watch::channel(None);
    let looked = Arc::new(std::sync::Mutex::new(Instant::now()));
    let fence = MembersFence {
        me: me.clone(),
        role: role.clone(),
        members: members.clone(),
        transport: transport.clone(),
        looked: looked.clone(),
    };
    // Marks that the election looked now; how long since it last did.
    let look = move || {
        looked
            .lock()
            .map(|mut l| std::mem::replace(&mut *l, Instant::now()).elapsed())
            .unwrap_or_default()
    };
    tokio::spawn(async move {
        let mut live = Liveness::default();
        let mut stepped_down_until: Option<Instant> = None;
        loop {
            // A silence longer than FRESH: this agent was frozen; what it knew is stale.
            if look() > FRESH {
                warn!("the peer-check election did not run for a while (frozen?); stepping down until it has looked again");
                live = Liveness::default();
                stepped_down_until = Some(Instant::now() + PING_EVERY * DOWN_AFTER);
            }
            match members.list().await {
                Ok(order) => {
                    // Ping the earlier members in order until one is up: that one coordinates.
                    for m in order.iter().take_while(|m| m.node != me) {
                        let answered = tokio::select! {
                            _ = shutdown.cancelled() => {
                                role_tx.send_replace(false);
                                return;
                            }
                            r = transport.alive(m) => r.is_ok(),
                        };
                        look();
                        live.observe(&m.node, answered);
                        if !live.is_down(&m.node) {
                            break;
                        }
                    }
                    let now = elected(&order, &live).map(|m| CoordinatorId {
                        node: m.node.clone(),
                        address: Some(m.address.clone()),
                    });
                    let stepped_down = stepped_down_until.is_some_and(|t| Instant::now() < t);
                    let mine = now.as_ref().is_some_and(|c| c.node == me) && !stepped_down;
                    if *who_tx.borrow() != now {
                        info!(coordinator = ?now.as_ref().map(|c| &c.node), this_agent = mine, "peer-check coordinator (members file)");
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
    Elected { role, who, fence }
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

    /// Agents that answer pings unless they are in `dead`; counts the pings per node; each
    /// names the coordinator `views` says.
    #[derive(Debug, Default)]
    struct Pings {
        dead: Mutex<BTreeSet<String>>,
        asked: Mutex<HashMap<String, usize>>,
        views: Mutex<HashMap<String, String>>,
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
            Ok(PingReply {
                coordinator: self
                    .views
                    .lock()
                    .unwrap()
                    .get(&to.node)
                    .cloned()
                    .unwrap_or_default(),
                ..PingReply::default()
            })
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
        async fn forward(
            &self,
            _: &Member,
            _: &Member,
            _: crate::peer::coordinator::Relayed,
        ) -> Result<CheckAccepted, String> {
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
        let a = start("a");
        let b = start("b");
        let c = start("c");
        let (a_role, b_role, c_role) = (a.role, b.role, c.role);
        let node = |w: &watch::Receiver<Option<CoordinatorId>>| {
            w.borrow().as_ref().map(|c| c.node.clone())
        };
        let (b_who, c_who) = (b.who, c.who);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(*a_role.borrow() && !*b_role.borrow() && !*c_role.borrow());
        assert_eq!(node(&c_who).as_deref(), Some("a"));
        assert!(
            !pings.asked.lock().unwrap().contains_key("b"),
            "c stops at a"
        );
        pings.dead.lock().unwrap().insert("a".into());
        tokio::time::sleep(PING_EVERY * (DOWN_AFTER - 1)).await;
        assert!(!*b_role.borrow(), "not before {DOWN_AFTER} silences");
        tokio::time::sleep(PING_EVERY + Duration::from_secs(1)).await;
        assert!(*b_role.borrow() && !*c_role.borrow());
        assert_eq!(node(&b_who).as_deref(), Some("b"));
        assert_eq!(node(&c_who).as_deref(), Some("b"));
        pings.dead.lock().unwrap().clear();
        tokio::time::sleep(PING_EVERY * UP_AFTER + Duration::from_secs(1)).await;
        assert!(!*b_role.borrow());
        assert_eq!(node(&b_who).as_deref(), Some("a"));
        shutdown.cancel();
    }

    /// The bare-metal fence: the first member may conclude while the members after it take it
    /// for the coordinator; not once one of them names another (it took over while this one
    /// was frozen), and not right after a freeze (its election has not looked since).
    #[tokio::test(start_paused = true)]
    async fn a_frozen_or_deposed_first_member_does_not_conclude() {
        let order = members(&["a", "b", "c", "d", "e"]);
        let pings = Arc::new(Pings::default());
        for n in ["b", "c", "d", "e"] {
            pings.views.lock().unwrap().insert(n.into(), "a".into());
        }
        let shutdown = CancellationToken::new();
        let a = elect(
            "a".into(),
            Arc::new(List(order.clone())),
            pings.clone(),
            shutdown.clone(),
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(*a.role.borrow());
        assert_eq!(a.fence.confirm().await, Ok(()));
        // b took over while a could not tell.
        pings.views.lock().unwrap().insert("b".into(), "b".into());
        let e = a.fence.confirm().await.unwrap_err();
        assert!(e.contains("b takes b for the coordinator"), "{e}");
        // e (past the successors asked) does not count; a silent successor does not either.
        pings.views.lock().unwrap().insert("b".into(), "a".into());
        pings.views.lock().unwrap().insert("e".into(), "e".into());
        pings.dead.lock().unwrap().insert("c".into());
        assert_eq!(a.fence.confirm().await, Ok(()));
        // Frozen: time passed and the election has not looked since.
        tokio::time::advance(Duration::from_secs(30)).await;
        let e = a.fence.confirm().await.unwrap_err();
        assert!(e.contains("has not run for"), "{e}");
        // Once it runs again it steps down for a while, then takes the role back.
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!*a.role.borrow(), "stepped down after the freeze");
        tokio::time::sleep(PING_EVERY * (DOWN_AFTER + 1)).await;
        assert!(*a.role.borrow());
        shutdown.cancel();
    }
}
