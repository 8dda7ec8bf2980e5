//! The coordinator over a fake transport whose agents behave as a scenario says (dead, hung,
//! slow, a broken link), on tokio's paused clock: verdicts, rounds, deadlines, cancels and
//! conclusions.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use std::time::Duration;
use tokio::sync::watch;

use faultline_proto::v1::{CheckAccepted, CheckAssignment, CheckReport, PingReply, RunConclusion};
use faultline_proto::PROTOCOL;

use super::*;
use crate::members::Member;
use faultline_agent::peer::client::CallError;
use faultline_core::policy::PeerPolicy;

#[derive(Debug, Default, Clone)]
struct Scenario {
    dead: BTreeSet<String>,
    hung: BTreeSet<String>,
    refuses: BTreeSet<String>,
    busy: BTreeSet<String>,
    /// node -> slowdown
    slow: Vec<(String, f64)>,
    cut: Vec<(String, String)>,
    /// (a, b, slowdown): checks between a and b are that much slower (a degraded link).
    slow_links: Vec<(String, String, f64)>,
    /// The coordinator cannot reach these agents; other members can.
    coordinator_cut: BTreeSet<String>,
    /// The first ping to these is lost.
    lost_first_ping: BTreeSet<String>,
    /// (node, round): the coordinator's assignment calls to the node fail in that round.
    assign_fails: Vec<(String, u32)>,
    /// (node, round): the node's report of that round never arrives.
    report_lost: Vec<(String, u32)>,
    /// Rounds in which every probe hits its deadline mid-transfer (an overloaded machine).
    overloaded_rounds: BTreeSet<u32>,
    /// Every check takes this long (a loaded machine): a probe whose deadline is shorter hits it
    /// mid-transfer.
    loaded_check: Option<Duration>,
    /// These nodes' data path is down (their probes never connect) while their agents answer.
    data_down: BTreeSet<String>,
    /// Relays that cannot be asked (they time out, or refuse: too many forwards).
    relays_fail: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct Fake {
    scenario: Scenario,
    coordinator: OnceLock<Weak<Coordinator>>,
    cancels: Mutex<Vec<String>>,
    concluded: Mutex<Vec<(String, RunConclusion)>>,
    /// (node, round, announced deadline ms, the deadline its agent gave the probe).
    assigned: Mutex<Vec<(String, u32, u32, Duration)>>,
    pings: Mutex<std::collections::HashMap<String, u32>>,
    relayed: Mutex<Vec<(String, Vec<String>)>>,
    /// (relay, target, kind) of every message sent through a relay.
    forwarded: Mutex<Vec<(String, String, &'static str)>>,
}

const BASE: f64 = 0.05;

impl Fake {
    fn seconds(&self, node: &str) -> f64 {
        self.scenario
            .slow
            .iter()
            .find(|(n, _)| n == node)
            .map_or(BASE, |(_, f)| BASE * f)
    }
    fn cut(&self, a: &str, b: &str) -> bool {
        self.scenario
            .cut
            .iter()
            .any(|(x, y)| (x == a && y == b) || (x == b && y == a))
    }
    fn link_slowdown(&self, a: &str, b: &str) -> f64 {
        self.scenario
            .slow_links
            .iter()
            .find(|(x, y, _)| (x == a && y == b) || (x == b && y == a))
            .map_or(1.0, |l| l.2)
    }
}

#[async_trait::async_trait]
impl Transport for Fake {
    async fn ping(&self, to: &Member) -> Result<PingReply, SendError> {
        let n = {
            let mut p = self.pings.lock().unwrap();
            let n = p.entry(to.node.clone()).or_default();
            *n += 1;
            *n
        };
        if self.scenario.dead.contains(&to.node) || self.scenario.coordinator_cut.contains(&to.node)
        {
            return Err(refused());
        }
        if n == 1 && self.scenario.lost_first_ping.contains(&to.node) {
            return Err(CallError::Timeout(Duration::from_secs(2)).into());
        }
        Ok(PingReply {
            node: to.node.clone(),
            protocol: PROTOCOL,
            busy: self.scenario.busy.contains(&to.node),
            reason: "a job runs".into(),
        })
    }

    async fn reach(
        &self,
        via: &Member,
        targets: &[Member],
    ) -> Result<Vec<faultline_proto::v1::Reached>, SendError> {
        self.relayed.lock().unwrap().push((
            via.node.clone(),
            targets.iter().map(|t| t.node.clone()).collect(),
        ));
        if self.scenario.relays_fail.contains(&via.node) {
            // No word on any target (transport::GrpcTransport leaves them out).
            return Ok(Vec::new());
        }
        Ok(targets
            .iter()
            .map(|t| faultline_proto::v1::Reached {
                node: t.node.clone(),
                answered: !self.scenario.dead.contains(&t.node) && !self.cut(&via.node, &t.node),
                error: String::new(),
            })
            .collect())
    }

    async fn assign(&self, to: &Member, a: CheckAssignment) -> Result<CheckAccepted, SendError> {
        if self.scenario.coordinator_cut.contains(&to.node) {
            return Err(refused());
        }
        self.assign_at(to, a)
    }

    async fn forward(
        &self,
        via: &Member,
        to: &Member,
        msg: Relayed,
    ) -> Result<CheckAccepted, SendError> {
        let kind = match &msg {
            Relayed::Assign(_) => "assign",
            Relayed::Cancel(_) => "cancel",
            Relayed::Conclude(_) => "conclude",
        };
        self.forwarded
            .lock()
            .unwrap()
            .push((via.node.clone(), to.node.clone(), kind));
        let s = &self.scenario;
        if s.dead.contains(&via.node) || s.dead.contains(&to.node) || self.cut(&via.node, &to.node)
        {
            return Err(SendError::NotRelayed {
                to: to.node.clone(),
                via: via.node.clone(),
                why: "connection refused".into(),
            });
        }
        let ok = CheckAccepted {
            accepted: true,
            reason: String::new(),
        };
        match msg {
            Relayed::Assign(a) => {
                // The member reports through the relay that brought the assignment.
                assert_eq!(
                    a.report_via.as_ref().map(|m| m.node.as_str()),
                    Some(via.node.as_str())
                );
                self.assign_at(to, a)
            }
            Relayed::Cancel(a) => {
                self.cancel(to, a).await;
                Ok(ok)
            }
            Relayed::Conclude(c) => {
                self.concluded.lock().unwrap().push((to.node.clone(), c));
                Ok(ok)
            }
        }
    }

    async fn cancel(&self, to: &Member, _a: CheckAssignment) {
        self.cancels.lock().unwrap().push(to.node.clone());
    }

    async fn conclude(&self, to: &Member, c: RunConclusion) -> Result<(), SendError> {
        self.concluded.lock().unwrap().push((to.node.clone(), c));
        Ok(())
    }
}

impl Fake {
    /// An assignment reaching `to`'s agent (directly or through a relay).
    fn assign_at(&self, to: &Member, a: CheckAssignment) -> Result<CheckAccepted, SendError> {
        // The deadline the member's agent gives its probe, by the agent's own rule and policy.
        let timeout = faultline_agent::peer::authz::admit(&a, &PeerPolicy::default())
            .unwrap()
            .timeout;
        self.assigned
            .lock()
            .unwrap()
            .push((to.node.clone(), a.round, a.timeout_ms, timeout));
        if self.scenario.dead.contains(&to.node)
            || self
                .scenario
                .assign_fails
                .contains(&(to.node.clone(), a.round))
        {
            return Err(refused());
        }
        if self.scenario.refuses.contains(&to.node) {
            return Ok(CheckAccepted {
                accepted: false,
                reason: "4 checks already running".into(),
            });
        }
        if self.scenario.hung.contains(&to.node) {
            return Ok(CheckAccepted {
                accepted: true,
                reason: String::new(),
            });
        }
        let (ma, mb) = (a.a.clone().unwrap(), a.b.clone().unwrap());
        let partner = if ma.node == to.node { mb.node } else { ma.node };
        let s = &self.scenario;
        // What this member's probe sees: the partner dead or hung (never connects), the link
        // cut: it fails at its deadline; else the slower of the two sets the pace.
        let fails = s.dead.contains(&partner)
            || s.hung.contains(&partner)
            || self.cut(&to.node, &partner)
            || s.data_down.contains(&to.node)
            || s.data_down.contains(&partner);
        let secs = self.seconds(&to.node).max(self.seconds(&partner))
            * self.link_slowdown(&to.node, &partner);
        let took = if fails {
            timeout
        } else {
            Duration::from_secs_f64(secs * f64::from(a.iterations)).min(timeout)
        };
        let weak = self.coordinator.get().unwrap().clone();
        let report = CheckReport {
            auth: None,
            protocol: PROTOCOL,
            run_id: a.run_id.clone(),
            round: a.round,
            node: to.node.clone(),
            partner,
            passed: !fails,
            seconds: if fails { 0.0 } else { secs },
            busbw_gbps: 1.0,
            gemm_gflops: 0.0,
            error: if fails {
                "rank 1 never connected".into()
            } else {
                String::new()
            },
            timed_out: false,
        };
        let mut report = report;
        let mut took = took;
        let too_slow = s.loaded_check.is_some_and(|t| t > timeout);
        if !fails && (s.overloaded_rounds.contains(&a.round) || too_slow) {
            report.passed = false;
            report.timed_out = true;
            report.seconds = 0.0;
            report.error = "deadline (10s) passed".into();
            took = timeout;
        } else if let (false, Some(t)) = (fails, s.loaded_check) {
            took = t;
        }
        let lost = self
            .scenario
            .report_lost
            .contains(&(to.node.clone(), a.round));
        tokio::spawn(async move {
            tokio::time::sleep(took).await;
            if let Some(c) = weak.upgrade() {
                if !lost {
                    c.deliver(report);
                }
            }
        });
        Ok(CheckAccepted {
            accepted: true,
            reason: String::new(),
        })
    }
}

fn members(n: usize) -> Vec<Member> {
    (0..n)
        .map(|i| Member {
            node: format!("n{i}"),
            address: format!("10.0.0.{}:20261", i + 1),
            ip: format!("10.0.0.{}", i + 1).parse().unwrap(),
            topology: None,
        })
        .collect()
}

fn spec() -> RunSpec {
    RunSpec {
        bytes: 64 << 20,
        iterations: 5,
        check_timeout: Duration::from_secs(10),
        gemm: false,
        pairing: PairingConfig::default(),
        rotation: 0,
        skip_busy: true,
    }
}

/// A call the member's agent did not answer (the connection was refused).
fn refused() -> SendError {
    CallError::Answer(tonic::Status::unavailable("connection refused")).into()
}

/// A fence the test moves: the role as its watch says, and `confirm` as `confirms` says
/// (`None`: confirmed).
#[derive(Debug)]
struct TestFence {
    role: watch::Sender<bool>,
    confirms: Mutex<Option<NotHeld>>,
}

impl TestFence {
    fn new() -> Arc<TestFence> {
        Arc::new(TestFence {
            role: watch::channel(true).0,
            confirms: Mutex::new(None),
        })
    }
}

#[async_trait::async_trait]
impl Fence for TestFence {
    fn watch(&self) -> watch::Receiver<bool> {
        self.role.subscribe()
    }
    async fn confirm(&self) -> Result<(), FenceError> {
        match self.confirms.lock().unwrap().clone() {
            None => Ok(()),
            Some(why) => Err(why.into()),
        }
    }
}

fn coordinator(
    scenario: Scenario,
    fence: Arc<TestFence>,
) -> (Arc<Coordinator>, Arc<Fake>, Arc<MemoryPublisher>) {
    let fake = Arc::new(Fake {
        scenario,
        ..Default::default()
    });
    let publisher = Arc::new(MemoryPublisher::default());
    let c = Arc::new(Coordinator::new(
        "n0".into(),
        "10.0.0.1:20261".into(),
        20270,
        fake.clone(),
        publisher.clone(),
        fence,
        Arc::new(faultline_agent::clock::SystemClock),
    ));
    fake.coordinator.set(Arc::downgrade(&c)).unwrap();
    (c, fake, publisher)
}

async fn run(n: usize, scenario: Scenario) -> (RunState, Arc<Fake>, Duration) {
    let (c, fake, publisher) = coordinator(scenario, TestFence::new());
    let start = tokio::time::Instant::now();
    let state = c
        .run(members(n), BTreeMap::new(), &spec(), Trigger::Request, None)
        .await
        .unwrap();
    let took = start.elapsed();
    // Published once per round and once at the end; the last is the finished run.
    let published = publisher.0.lock().clone();
    assert_eq!(published.len(), state.rounds.len() + 1);
    assert_eq!(published.last(), Some(&state));
    assert!(published[..published.len() - 1]
        .iter()
        .all(|s| !s.is_finished()));
    (state, fake, took)
}

fn verdicts(s: &RunState) -> Vec<(String, Vec<String>)> {
    s.verdicts
        .iter()
        .map(|v| (v.kind.clone(), v.nodes.clone()))
        .collect()
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(start_paused = true)]
async fn healthy_cluster_one_round_no_verdicts() {
    let (s, fake, took) = run(8, Scenario::default()).await;
    assert_eq!(s.rounds.len(), 1);
    assert!(s.verdicts.is_empty(), "{:?}", s.verdicts);
    assert!(s.rounds[0].checks.iter().all(|c| c.passed == Some(true)));
    assert!(took < Duration::from_secs(1), "{took:?}");
    // Every member is told (nothing against it).
    assert_eq!(fake.concluded.lock().unwrap().len(), 8);
}

#[tokio::test(start_paused = true)]
async fn dead_agent_is_faulty_without_waiting() {
    let sc = Scenario {
        dead: ["n5".to_string()].into(),
        ..Default::default()
    };
    let (s, fake, took) = run(8, sc).await;
    assert_eq!(
        verdicts(&s),
        vec![("faulty_node".to_string(), names(&["n5"]))]
    );
    assert!(s.rounds.len() <= 2);
    // Its checks fail at once: nobody waits for a probe deadline.
    assert!(took < Duration::from_secs(2), "{took:?}");
    let told: Vec<String> = fake
        .concluded
        .lock()
        .unwrap()
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    assert!(!told.contains(&"n5".to_string()) && told.len() == 7);
    assert!(s.rounds[0].checks.iter().any(|c| c
        .error
        .as_deref()
        .is_some_and(|e| e.contains("n5 unreachable"))));
}

#[tokio::test(start_paused = true)]
async fn hung_node_verdict_within_deadline_plus_two_seconds() {
    let sc = Scenario {
        hung: ["n3".to_string()].into(),
        ..Default::default()
    };
    let (s, fake, took) = run(8, sc).await;
    assert_eq!(
        verdicts(&s),
        vec![("faulty_node".to_string(), names(&["n3"]))]
    );
    assert_eq!(s.rounds.len(), 2);
    // Round 1 waits the full deadline; round 2 only a few times a good check.
    assert!(took < Duration::from_secs(12), "{took:?}");
    assert!(s.rounds[1].deadline_ms < 10_000, "{:?}", s.rounds[1]);
    // The hung node's probes were told to stop.
    assert!(fake.cancels.lock().unwrap().iter().all(|n| n == "n3"));
    assert!(!fake.cancels.lock().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn cut_link_is_a_link_not_a_node() {
    // Round 1 pairs n0-n1, n2-n3, ...: cut n2-n3.
    let sc = Scenario {
        cut: vec![("n2".into(), "n3".into())],
        ..Default::default()
    };
    let (s, _, _) = run(8, sc).await;
    assert_eq!(
        verdicts(&s),
        vec![("broken_link".to_string(), names(&["n2", "n3"]))]
    );
    assert_eq!(s.rounds.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn straggler_with_its_slowdown() {
    let sc = Scenario {
        slow: vec![("n6".into(), 4.0)],
        ..Default::default()
    };
    let (s, _, _) = run(8, sc).await;
    assert_eq!(s.verdicts.len(), 1, "{:?}", s.verdicts);
    let v = &s.verdicts[0];
    assert_eq!(
        (v.kind.as_str(), v.nodes.clone()),
        ("straggler", names(&["n6"]))
    );
    let ratio = v.slowdown.unwrap();
    assert!((3.5..=4.5).contains(&ratio), "{ratio}");
}

/// Issue 28: a pair 2.5x slower than every other pair, both nodes normal with other partners
/// (a link flapping every 300 ms), gave no verdict at all, also when the link touched the
/// coordinator's node (n0). Now it is published as a degraded link with its slowdown, and the
/// conclusion each end receives records `PEER_LINK_DEGRADED` on the link to the other.
#[tokio::test(start_paused = true)]
async fn a_slow_link_is_a_degraded_link() {
    for (a, b) in [("n2", "n3"), ("n0", "n1")] {
        let sc = Scenario {
            slow_links: vec![(a.into(), b.into(), 2.5)],
            ..Default::default()
        };
        let (s, fake, _) = run(8, sc).await;
        assert_eq!(
            verdicts(&s),
            vec![("degraded_link".to_string(), names(&[a, b]))],
            "{a}-{b}"
        );
        let ratio = s.verdicts[0].slowdown.unwrap();
        assert!((2.3..=2.7).contains(&ratio), "{ratio}");
        assert_eq!(s.rounds.len(), 3);
        // `faultline check` gets it back from the published run with its slowdown.
        let r = crate::service::result_of(&s);
        assert_eq!(
            r.verdicts[0].kind(),
            faultline_proto::v1::verdict::Kind::DegradedLink
        );
        assert_eq!(r.verdicts[0].slowdown, ratio);
        let told = fake.concluded.lock().unwrap().clone();
        assert_eq!(told.len(), 8);
        for (me, partner) in [(a, b), (b, a)] {
            let (_, c) = told.iter().find(|(n, _)| n == me).unwrap();
            let v = wire::from_proto(&c.members, &c.verdicts).unwrap();
            let i = c.members.iter().position(|m| m == me).unwrap();
            let obs = faultline_core::peer::verdicts::observe(&c.members, i, &v, &c.run_id, None);
            let codes: Vec<(String, String)> = obs
                .iter()
                .filter_map(|o| match o {
                    faultline_core::engine::Observation::Level { present, .. } => Some(present),
                    _ => None,
                })
                .flatten()
                .map(|sig| {
                    (
                        sig.code.to_string(),
                        sig.device
                            .as_ref()
                            .and_then(|d| d.name.clone())
                            .unwrap_or_default(),
                    )
                })
                .collect();
            assert_eq!(
                codes,
                [("PEER_LINK_DEGRADED".to_string(), format!("link:{partner}"))],
                "{me}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn all_three_at_once_and_busy_nodes_skipped() {
    let sc = Scenario {
        dead: ["n1".to_string()].into(),
        cut: vec![("n4".into(), "n5".into())],
        slow: vec![("n8".into(), 5.0)],
        busy: ["n9".to_string()].into(),
        ..Default::default()
    };
    let (s, _, _) = run(10, sc).await;
    let mut v = verdicts(&s);
    v.sort();
    assert_eq!(
        v,
        vec![
            ("broken_link".to_string(), names(&["n4", "n5"])),
            ("faulty_node".to_string(), names(&["n1"])),
            ("straggler".to_string(), names(&["n8"])),
            ("unknown".to_string(), names(&["n9"])),
        ]
    );
    assert!(s.skipped["n9"].contains("busy"));
    assert!(!s.members.contains(&"n9".to_string()));
    assert!(s.rounds.len() <= 3);
}

#[tokio::test(start_paused = true)]
async fn a_refused_check_fails_and_the_other_side_is_cancelled() {
    let sc = Scenario {
        refuses: ["n2".to_string()].into(),
        ..Default::default()
    };
    let (s, fake, _) = run(4, sc).await;
    // n2 refuses everything: it never passes, with two good partners: faulty.
    assert_eq!(
        verdicts(&s),
        vec![("faulty_node".to_string(), names(&["n2"]))]
    );
    assert!(s.rounds[0]
        .checks
        .iter()
        .any(|c| c.error.as_deref().is_some_and(|e| e.contains("refused"))));
    assert!(!fake.cancels.lock().unwrap().is_empty());
}

#[test]
fn requested_nodes_without_an_agent_are_unknown() {
    let (found, missing) = select(members(3), &names(&["n1", "zz"]));
    assert_eq!(found.len(), 1);
    assert!(missing["zz"].contains("no running faultline agent"));
}

/// A report's numbers are untrusted: a negative, infinite or NaN time, or an oversized text, is
/// refused at the boundary with a reason (a negative `seconds` used to panic the coordinator in
/// `Duration::from_secs_f64`), and the deadline arithmetic cannot panic whatever it is given.
#[test]
fn reports_are_validated_and_deadlines_never_panic() {
    let good = CheckReport {
        run_id: "r1".into(),
        node: "n1".into(),
        partner: "n2".into(),
        passed: true,
        seconds: 0.25,
        busbw_gbps: 12.0,
        ..Default::default()
    };
    assert_eq!(super::validate_report(&good), Ok(()));
    let bad: [(&str, CheckReport); 6] = [
        (
            "seconds -1",
            CheckReport {
                seconds: -1.0,
                ..good.clone()
            },
        ),
        (
            "seconds NaN",
            CheckReport {
                seconds: f64::NAN,
                ..good.clone()
            },
        ),
        (
            "seconds inf",
            CheckReport {
                seconds: f64::INFINITY,
                ..good.clone()
            },
        ),
        (
            "busbw_gbps -3",
            CheckReport {
                busbw_gbps: -3.0,
                ..good.clone()
            },
        ),
        (
            "error is 5000 bytes",
            CheckReport {
                error: "x".repeat(5000),
                ..good.clone()
            },
        ),
        (
            "run_id is 200 bytes",
            CheckReport {
                run_id: "r".repeat(200),
                ..good.clone()
            },
        ),
    ];
    for (want, r) in bad {
        let e = super::validate_report(&r).unwrap_err().to_string();
        assert!(
            e.starts_with(want.split(' ').next().unwrap()),
            "{want}: {e}"
        );
    }
    let timeout = Duration::from_secs(60);
    for s in [-1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e300] {
        let d = super::later_deadline(s, 10, timeout);
        assert!(d >= super::MIN_LATER_DEADLINE && d <= timeout, "{s}: {d:?}");
    }
    assert_eq!(
        super::later_deadline(0.5, 10, timeout),
        Duration::from_secs(20),
        "HANG_FACTOR x 10 iterations x 0.5 s"
    );
}

/// A coordinator that loses the Lease in the middle of a run stops there: no verdicts are
/// published as final and no member is told anything (before, it ran on and concluded, and the
/// reports the new holder refused became PEER_UNREACHABLE on healthy nodes).
#[tokio::test(start_paused = true)]
async fn losing_the_role_mid_run_aborts_and_concludes_nothing() {
    let fence = TestFence::new();
    // A hung node keeps round 1 waiting its full deadline (10 s).
    let sc = Scenario {
        hung: ["n3".to_string()].into(),
        ..Default::default()
    };
    let (c, fake, publisher) = coordinator(sc, fence.clone());
    let f = fence.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        f.role.send_replace(false);
    });
    let start = tokio::time::Instant::now();
    let r = c
        .run(members(8), BTreeMap::new(), &spec(), Trigger::Request, None)
        .await;
    let e = r.unwrap_err();
    assert!(e.why.contains("lost the coordinator role"), "{e}");
    // It stopped when the role went, not at the round's deadline.
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    assert!(fake.concluded.lock().unwrap().is_empty());
    let published = publisher.0.lock().clone();
    assert!(published.iter().all(|s| !s.is_finished()), "{published:?}");
    // Its checks no longer wait for reports.
    assert!(c.reports.lock().is_empty());
    // And without the role it does not start another.
    let again = c
        .run(members(8), BTreeMap::new(), &spec(), Trigger::Request, None)
        .await;
    assert!(again.is_err());
}

/// The role as the coordinator last saw it is not enough to conclude: the Lease is asked again
/// first, and a coordinator whose Lease is gone (it was frozen past it) concludes nothing.
#[tokio::test(start_paused = true)]
async fn no_conclusion_unless_the_lease_confirms() {
    let fence = TestFence::new();
    *fence.confirms.lock().unwrap() = Some(NotHeld::Other {
        holder: "n4@10.0.0.5:20261".into(),
        identity: "n1@10.0.0.2:20261".into(),
    });
    let (c, fake, publisher) = coordinator(Scenario::default(), fence);
    let e = c
        .run(members(6), BTreeMap::new(), &spec(), Trigger::Request, None)
        .await
        .unwrap_err();
    assert!(e.why.contains("n4@"), "{e}");
    assert!(fake.concluded.lock().unwrap().is_empty());
    assert!(publisher.0.lock().iter().all(|s| !s.is_finished()));
}

/// A requester that asks again with the same request id (its first coordinator froze, the new
/// one resumed the run) gets that run's result; a different id gets a run of its own.
#[tokio::test(start_paused = true)]
async fn a_retried_request_attaches_to_its_run() {
    let sc = Scenario {
        hung: ["n3".to_string()].into(),
        ..Default::default()
    };
    let (c, _fake, publisher) = coordinator(sc, TestFence::new());
    assert!(c.attach("req-1").await.is_none(), "nothing claimed yet");
    let claim = c.claim("req-1").unwrap();
    assert!(c.claim("req-1").is_none(), "claimed once");
    let c2 = c.clone();
    let resumed = tokio::spawn(async move {
        c2.run(
            members(8),
            BTreeMap::new(),
            &spec(),
            Trigger::Resume,
            Some("req-1".into()),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let attached = c.attach("req-1").await.unwrap().unwrap();
    let state = resumed.await.unwrap().unwrap();
    drop(claim);
    assert_eq!(attached, state);
    assert_eq!(state.request_id.as_deref(), Some("req-1"));
    assert_eq!(
        verdicts(&state),
        vec![("faulty_node".to_string(), names(&["n3"]))]
    );
    // Asked again after it finished: the same result, from what was published.
    assert_eq!(
        c.attach("req-1").await.unwrap().unwrap().run_id,
        state.run_id
    );
    assert!(c.attach("req-2").await.is_none());
    assert_eq!(
        publisher.0.lock().last().unwrap().request_id.as_deref(),
        Some("req-1")
    );
}

/// A new coordinator resumes an unfinished run only after the probes of its last round are
/// over (their ports free), and believes no published deadline beyond an hour.
#[test]
fn resume_waits_for_the_last_rounds_probes() {
    let mut last = RunState {
        run_id: "r".into(),
        trigger: Trigger::Request,
        coordinator: "n0".into(),
        started: faultline_core::time::Timestamp::UNIX_EPOCH,
        finished: None,
        members: names(&["n0", "n1"]),
        skipped: BTreeMap::new(),
        rounds: vec![],
        verdicts: vec![],
        request_id: None,
        requested: vec![],
        check_timeout_ms: None,
        relayed: BTreeMap::new(),
    };
    assert_eq!(resume_wait(&last), Duration::ZERO, "no probe was started");
    last.rounds.push(RoundState {
        round: 1,
        deadline_ms: 10_000,
        checks: vec![],
    });
    assert_eq!(
        resume_wait(&last),
        Duration::from_secs(10) + faultline_agent::peer::runner::PROBE_GRACE + REPORT_SLACK
    );
    last.rounds[0].deadline_ms = u64::MAX;
    assert_eq!(
        resume_wait(&last),
        Duration::from_secs(3600) + faultline_agent::peer::runner::PROBE_GRACE + REPORT_SLACK
    );
}

/// One lost pre-run ping used to mark a member unreachable for the whole run, and its checks
/// failed without a probe: a healthy node named faulty. Pings are tried again.
#[tokio::test(start_paused = true)]
async fn one_lost_ping_blames_nobody() {
    let sc = Scenario {
        lost_first_ping: ["n5".to_string()].into(),
        ..Default::default()
    };
    let (s, _, _) = run(8, sc).await;
    assert!(s.verdicts.is_empty(), "{:?}", s.verdicts);
    assert_eq!(s.rounds.len(), 1);
}

/// The coordinator cannot reach one healthy member's agent; another member can (issue 28: the
/// node was left `unknown` with none of its checks run, and a broken link to the coordinator's
/// node was named on that alone). The coordinator reaches it through that member: its checks
/// run and pass, so it gets no verdict; the failing control path names no fault; its
/// conclusion goes through the relay too. A real faulty node elsewhere is still found.
#[tokio::test(start_paused = true)]
async fn a_member_only_the_coordinator_cannot_reach_is_checked_through_another() {
    let sc = Scenario {
        coordinator_cut: ["n5".to_string()].into(),
        dead: ["n2".to_string()].into(),
        ..Default::default()
    };
    let (s, fake, _) = run(10, sc).await;
    assert_eq!(
        verdicts(&s),
        vec![("faulty_node".to_string(), names(&["n2"]))]
    );
    assert!(s.members.contains(&"n5".to_string()), "{:?}", s.skipped);
    assert_eq!(
        s.relayed,
        [("n5".to_string(), "n1".to_string())].into_iter().collect()
    );
    let with_n5: Vec<&CheckState> = s
        .rounds
        .iter()
        .flat_map(|r| &r.checks)
        .filter(|c| (c.a == "n5" || c.b == "n5") && c.a != "n2" && c.b != "n2")
        .collect();
    assert!(!with_n5.is_empty());
    assert!(
        with_n5.iter().all(|c| c.passed == Some(true)),
        "{with_n5:?}"
    );
    let forwarded = fake.forwarded.lock().unwrap().clone();
    assert!(forwarded.contains(&("n1".into(), "n5".into(), "assign")));
    assert!(forwarded.contains(&("n1".into(), "n5".into(), "conclude")));
    assert!(forwarded
        .iter()
        .all(|(via, to, _)| via == "n1" && to == "n5"));
    // A member that nobody reaches (n2's agent is gone) is asked about too, and stays faulty.
    let relayed = fake.relayed.lock().unwrap().clone();
    assert!(relayed
        .iter()
        .all(|(via, _)| via != "n0" && via != "n2" && via != "n5"));
    let told = fake.concluded.lock().unwrap().clone();
    let (_, c) = told.iter().find(|(n, _)| n == "n5").unwrap();
    assert!(c.verdicts.iter().all(|v| v.nodes != vec!["n5".to_string()]));
}

/// A member reached only through another is never blamed for what comes back through the
/// relay (issue 28 review: a relay can change or drop every answer of that member): its data
/// path is down, its checks fail, and it is `unknown`, not faulty; its partners are named
/// nothing. (Its checks that pass count: see the test above.)
#[tokio::test(start_paused = true)]
async fn a_member_reached_through_another_is_never_blamed_through_the_relay() {
    let sc = Scenario {
        coordinator_cut: ["n5".to_string()].into(),
        data_down: ["n5".to_string()].into(),
        ..Default::default()
    };
    let (s, fake, _) = run(8, sc).await;
    assert_eq!(verdicts(&s), vec![("unknown".to_string(), names(&["n5"]))]);
    let told = fake.concluded.lock().unwrap().clone();
    let (_, c) = told.iter().find(|(n, _)| n == "n5").unwrap();
    assert!(c.verdicts.iter().any(|v| v.nodes == vec!["n5".to_string()]));
    assert!(fake
        .forwarded
        .lock()
        .unwrap()
        .contains(&("n1".into(), "n5".into(), "conclude")));
}

/// Issue 28 review: a member the coordinator cannot reach, whose relays could not be asked
/// (rate-limited, timed out), is `unknown`, not faulty: a relay that cannot be asked says
/// nothing about the member. (It used to count as "nobody reaches it": faulty.)
#[tokio::test(start_paused = true)]
async fn relays_that_cannot_be_asked_blame_nobody() {
    let sc = Scenario {
        coordinator_cut: ["n5".to_string()].into(),
        relays_fail: (0..8).map(|i| format!("n{i}")).collect(),
        ..Default::default()
    };
    let (s, _, _) = run(8, sc).await;
    assert!(
        verdicts(&s).iter().all(|(kind, _)| kind == "unknown"),
        "{:?}",
        verdicts(&s)
    );
    assert!(verdicts(&s)
        .iter()
        .any(|(_, nodes)| nodes == &names(&["n5"])));
}

/// With nobody to ask (two members, the other one unreachable from the coordinator), the node
/// is unknown, not faulty.
#[tokio::test(start_paused = true)]
async fn with_nobody_to_ask_an_unreachable_node_is_unknown() {
    let sc = Scenario {
        coordinator_cut: ["n1".to_string()].into(),
        ..Default::default()
    };
    let (s, _, _) = run(2, sc).await;
    let v = verdicts(&s);
    // n0 is left with no partner: it cannot be told either.
    assert_eq!(
        v,
        vec![
            ("unknown".to_string(), names(&["n0"])),
            ("unknown".to_string(), names(&["n1"]))
        ]
    );
    assert!(s.verdicts[1]
        .reason
        .as_deref()
        .unwrap()
        .contains("no other member could be asked"));
}

/// Control-path failures during the run are not evidence: an assignment call that fails (the
/// agent answered the ping) and a report lost while the partner passed leave the check
/// unjudged, and it is run again with another partner.
#[tokio::test(start_paused = true)]
async fn a_flapping_control_path_is_not_a_verdict() {
    let sc = Scenario {
        assign_fails: vec![("n3".into(), 1)],
        report_lost: vec![("n5".into(), 1)],
        ..Default::default()
    };
    let (s, _, _) = run(8, sc).await;
    assert!(s.verdicts.is_empty(), "{:?}", s.verdicts);
    assert_eq!(s.rounds.len(), 2, "the unjudged checks are run again");
    let unjudged: Vec<&CheckState> = s.rounds[0]
        .checks
        .iter()
        .filter(|c| c.passed.is_none())
        .collect();
    assert_eq!(unjudged.len(), 2, "{:?}", s.rounds[0]);
    assert!(unjudged
        .iter()
        .all(|c| c.error.as_deref().unwrap().starts_with("not judged")));
}

/// Under heavy load every probe of a round runs past its deadline mid-transfer (the issue: a
/// healthy 12-node cluster under CPU load was named as having 4-5 faulty nodes and 5-7 broken
/// links). The probes say it was their deadline (`timed_out`), the planner reads the round as
/// overloaded, and the checks run again with a longer deadline: nobody is blamed.
#[tokio::test(start_paused = true)]
async fn a_round_of_probe_deadlines_under_load_blames_nobody() {
    let sc = Scenario {
        overloaded_rounds: [1].into(),
        ..Default::default()
    };
    let (s, _, _) = run(12, sc).await;
    assert!(s.verdicts.is_empty(), "{:?}", s.verdicts);
    assert!(s.rounds.len() >= 2, "{:?}", s.rounds);
    assert!(
        s.rounds[1].deadline_ms > s.rounds[0].deadline_ms,
        "retried with a longer deadline: {:?}",
        s.rounds.iter().map(|r| r.deadline_ms).collect::<Vec<_>>()
    );
}

/// Rounds 2-3 announce deadlines of 20 s and 40 s for checks that timed out under load, but
/// each agent clamped the deadline to its own 10 s `check_timeout`, so the probes stopped at
/// 10 s again and the run ended with every node unknown. Under a load that makes every check
/// take 15 s, round 1 (10 s) times out, round 2 announces 20 s, the probes get 20 s, and the
/// checks pass: nobody is blamed and nothing is left unknown.
#[tokio::test(start_paused = true)]
async fn a_longer_deadline_after_a_timeout_reaches_the_probe() {
    let sc = Scenario {
        loaded_check: Some(Duration::from_secs(15)),
        ..Default::default()
    };
    let (s, fake, _) = run(8, sc).await;
    assert!(s.verdicts.is_empty(), "{:?}", s.verdicts);
    assert_eq!(s.rounds.len(), 2, "{:?}", s.rounds);
    assert_eq!(s.rounds[1].deadline_ms, 20_000);
    assert!(s.rounds[1].checks.iter().all(|c| c.passed == Some(true)));
    let assigned = fake.assigned.lock().unwrap().clone();
    let round2: Vec<_> = assigned.iter().filter(|x| x.1 == 2).collect();
    assert!(!round2.is_empty());
    for (node, _, announced, probe) in round2 {
        assert_eq!(
            (*announced, *probe),
            (20_000, Duration::from_secs(20)),
            "{node}"
        );
    }
}

/// A requester that goes away (its call dropped: keep-alive, Ctrl-C, the Lease moved) does not
/// drop its run halfway: the run goes on in its own task, and a retry with the same request id
/// gets its result.
#[tokio::test(start_paused = true)]
async fn a_requester_that_goes_away_does_not_drop_its_run() {
    let sc = Scenario {
        hung: ["n3".to_string()].into(),
        ..Default::default()
    };
    let (c, fake, _) = coordinator(sc, TestFence::new());
    let claim = c.claim("req-9").unwrap();
    let call = c.run_detached(
        members(8),
        BTreeMap::new(),
        spec(),
        Trigger::Request,
        Some("req-9".into()),
        Some(claim),
    );
    assert!(tokio::time::timeout(Duration::from_secs(1), call)
        .await
        .is_err());
    let state = c.attach("req-9").await.unwrap().unwrap();
    assert_eq!(
        verdicts(&state),
        vec![("faulty_node".to_string(), names(&["n3"]))]
    );
    // Concluded: every member told (the hung node's agent answers; its probe does not).
    assert_eq!(fake.concluded.lock().unwrap().len(), 8);
    assert!(c.claim("req-9").is_some(), "released when the run ended");
}

/// A new coordinator holds every run (requested ones too) until the previous coordinator's
/// probes are over.
#[tokio::test(start_paused = true)]
async fn no_run_starts_before_the_hold() {
    let (c, fake, _) = coordinator(Scenario::default(), TestFence::new());
    let start = tokio::time::Instant::now();
    c.hold_until(start + Duration::from_secs(13));
    let s = c
        .run(members(4), BTreeMap::new(), &spec(), Trigger::Request, None)
        .await
        .unwrap();
    assert!(s.verdicts.is_empty());
    assert!(
        start.elapsed() >= Duration::from_secs(13),
        "{:?}",
        start.elapsed()
    );
    let first_assign = fake.assigned.lock().unwrap().len();
    assert!(first_assign > 0);
}
