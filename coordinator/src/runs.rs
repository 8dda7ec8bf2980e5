//! The coordinator: runs a peer-check run among members, round by round as the planner
//! (`pairing`) says, over a [`Transport`] to the agents, and publishes each round's plan and the
//! verdicts through a [`RunPublisher`]. Only the agent holding the Lease runs it (`lease`).
//!
//! One check: the coordinator assigns it to both members at once (each runs its probe and sends
//! its `CheckReport` back here); the check passes when both report a pass, and fails as soon as
//! either reports a failure, refuses, cannot be reached, or the deadline passes (the other side
//! is then told to cancel its probe). Members that did not answer the pre-run ping take part in
//! the plan, but their checks fail at once without running a probe: a node whose agent is gone
//! fails with every partner, which is what a faulty node looks like.
//!
//! Relays: other members are asked whether they reach a member the coordinator cannot ping
//! (`reach`). When one of them does, only the coordinator's own path to it fails: the coordinator then
//! sends that member's `Assign`, `Cancel` and `Conclude` through that member
//! ([`Transport::forward`]), the assignment names the relay for the report (`report_via`), and
//! the member takes part in the run like any other. The coordinator's failing path names no
//! fault by itself; the member's checks say what it is.
//!
//! Fencing: a run belongs to the holder of the coordinator role (the Lease). It is aborted the
//! moment the role is lost ([`Fence::watch`]), and it concludes (publishes the verdicts and tells
//! the members) only after [`Fence::confirm`] asked the source of truth again: a coordinator that
//! was frozen while another took over never concludes on stale authority. A requested run
//! carries the requester's id; a requester that retries against a new coordinator with the same
//! id gets the run the new coordinator resumed, not a second one.
//!
//! Deadlines: round 1 waits the configured check timeout. Later rounds know how long a good
//! check takes, so they wait at most `HANG_FACTOR` times the slowest passed check (never less
//! than `MIN_LATER_DEADLINE`, never more than the timeout): a hung node costs one full timeout,
//! not one per round.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

pub use faultline_agent::peer::wire::{kind_from_name, kind_name};
use faultline_core::time::Timestamp;
use faultline_proto::v1::{
    CheckAccepted, CheckAssignment, CheckReport, Member as WireMember, PingReply, RunConclusion,
};
use faultline_proto::PROTOCOL;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};
use tracing::{debug, info, warn, Instrument};

use super::members::Member;
use super::wire;
use faultline_agent::clock::Clock;
use faultline_core::peer::pairing::{
    neighbour_order, NodeId, Outcome, Pair, PairingConfig, Planner, Verdicts,
};

/// Later rounds wait at most this many times the slowest passed check.
pub const HANG_FACTOR: f64 = 4.0;
/// ... but never less than this.
pub const MIN_LATER_DEADLINE: Duration = Duration::from_millis(1500);
/// How long past a check's deadline the coordinator waits for the reports (the probe is killed
/// one grace period after its deadline; the report then needs a moment to arrive).
pub const REPORT_SLACK: Duration = Duration::from_secs(2);
/// Pings per member before it counts as unreachable, and the pause between them (a failed
/// assignment call is tried once more after the same pause).
pub const PING_ATTEMPTS: u32 = 3;
pub const PING_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Members asked to reach a member the coordinator cannot reach.
pub const RELAYS: usize = 2;
/// Probe ports used per round, from the base port: a node takes part in at most two checks per
/// round, and successive rounds use different ports so a probe still winding down cannot block
/// the next one.
const PORTS_PER_ROUND: u16 = 4;
const PORT_GROUPS: u16 = 8;
/// How many probe ports from the base a run uses (agents accept no other: `authz`).
pub const PROBE_PORTS: u16 = PORTS_PER_ROUND * PORT_GROUPS;
const _: () = assert!(PROBE_PORTS == faultline_agent::peer::PROBE_PORTS);

/// A message the coordinator sends to a member through a relay (`Forward`).
#[derive(Debug, Clone)]
pub enum Relayed {
    Assign(CheckAssignment),
    Cancel(CheckAssignment),
    Conclude(RunConclusion),
}

/// What a run measures and how it judges.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub bytes: u64,
    pub iterations: u32,
    pub check_timeout: Duration,
    pub gemm: bool,
    pub pairing: PairingConfig,
    /// Round-1 rotation (changes between runs so different links are exercised).
    pub rotation: usize,
    /// Leave out members whose accelerators are busy (scheduled GPU runs).
    pub skip_busy: bool,
}

/// Why a run happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    Schedule,
    Request,
    /// A new coordinator restarting a run its predecessor did not finish.
    Resume,
}

/// One check as published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckState {
    pub a: String,
    pub b: String,
    pub passed: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub busbw_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub gemm_gflops: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundState {
    pub round: u32,
    pub deadline_ms: u64,
    pub checks: Vec<CheckState>,
}

/// A verdict as published (`kind`: faulty_node, broken_link, degraded_link, straggler,
/// unknown).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerdictState {
    pub kind: String,
    pub nodes: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub slowdown: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reason: Option<String>,
}

/// A run as published in the ConfigMap `faultline-peercheck` (or `peercheck.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    pub run_id: String,
    pub trigger: Trigger,
    pub coordinator: String,
    pub started: Timestamp,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub finished: Option<Timestamp>,
    /// Members in the planner's terms (verdicts name them).
    pub members: Vec<String>,
    /// Requested or listed nodes left out, and why.
    #[serde(default)]
    pub skipped: BTreeMap<String, String>,
    pub rounds: Vec<RoundState>,
    pub verdicts: Vec<VerdictState>,
    /// The requester's id for the run (`faultline check`), kept when a new coordinator resumes
    /// it, so a requester that retries against the new coordinator gets this run's result.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub request_id: Option<String>,
    /// Every node the run was asked to check (members, nodes without an agent, nodes left out),
    /// so a resumed run checks and reports the same nodes.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub requested: Vec<String>,
    /// The run's check deadline, which a resumed run keeps (a requester may have asked for a
    /// shorter one than the policy's).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub check_timeout_ms: Option<u64>,
    /// Members the coordinator could not reach itself, with the member it reached each through.
    #[serde(skip_serializing_if = "BTreeMap::is_empty", default)]
    pub relayed: BTreeMap<String, String>,
}

impl RunState {
    pub fn is_finished(&self) -> bool {
        self.finished.is_some()
    }
}

/// Why the coordinator got no answer from a member.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Call(#[from] faultline_agent::peer::client::CallError),
    /// The relay answered, but the member did not answer it.
    #[error("{to} did not answer {via}: {why}")]
    NotRelayed {
        to: String,
        via: String,
        why: String,
    },
    #[error("{via} passed on no answer from {to}")]
    NoAnswer { via: String, to: String },
}

/// The coordinator's way to the agents.
#[async_trait::async_trait]
pub trait Transport: Send + Sync + std::fmt::Debug {
    async fn ping(&self, to: &Member) -> Result<PingReply, SendError>;
    /// Asks `via` to ping `targets` (members the coordinator cannot reach): whether each
    /// answered it. A target missing from the answer is one `via` could not be asked about.
    async fn reach(
        &self,
        via: &Member,
        targets: &[Member],
    ) -> Result<Vec<faultline_proto::v1::Reached>, SendError>;
    async fn assign(&self, to: &Member, a: CheckAssignment) -> Result<CheckAccepted, SendError>;
    async fn cancel(&self, to: &Member, a: CheckAssignment);
    async fn conclude(&self, to: &Member, c: RunConclusion) -> Result<(), SendError>;
    /// Sends `msg` to `to` through `via`, a member that reaches `to` when the coordinator
    /// cannot: the answer of `to` (a conclusion's is `accepted`).
    async fn forward(
        &self,
        via: &Member,
        to: &Member,
        msg: Relayed,
    ) -> Result<CheckAccepted, SendError>;
}

/// Why this agent may not act as the coordinator now.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("this agent no longer coordinates")]
    NotCoordinating,
    #[error("this agent no longer holds the Lease")]
    LeaseLost,
    #[error("cannot read the Lease to confirm it: {0}")]
    LeaseUnreadable(#[source] kube::Error),
    #[error("the Lease is gone")]
    LeaseGone,
    #[error(transparent)]
    NotHeld(#[from] NotHeld),
}

/// Why a Lease does not make this agent the coordinator now (`lease::held_by`'s answer; here
/// beside `FenceError` so that this module does not import `lease`, which imports it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotHeld {
    #[error("the Lease has no spec")]
    NoSpec,
    #[error("the Lease is held by {holder:?}, not {identity:?}")]
    Other { holder: String, identity: String },
    #[error("the Lease has no renew time")]
    NoRenewTime,
    #[error(
        "this agent's Lease runs out at {until}, less than {} s from now",
        faultline_agent::peer::lease::GRACE_SECONDS
    )]
    RunsOut {
        until: faultline_core::time::Timestamp,
    },
}

/// Whether this agent may act as the coordinator: the Lease on Kubernetes, the members-file
/// election on bare metal.
#[async_trait::async_trait]
pub trait Fence: Send + Sync + std::fmt::Debug {
    /// Follows the role: true while this agent holds it. A sender that is gone means the value
    /// no longer changes.
    fn watch(&self) -> watch::Receiver<bool>;
    /// Asks the source of truth again, right before an act that must not happen without the
    /// role (concluding a run): why not, when this agent does not hold it now.
    async fn confirm(&self) -> Result<(), FenceError>;
}

/// A fence that is only its watch (a fixed role, tests).
#[derive(Debug, Clone)]
pub struct WatchFence(pub watch::Receiver<bool>);

#[async_trait::async_trait]
impl Fence for WatchFence {
    fn watch(&self) -> watch::Receiver<bool> {
        self.0.clone()
    }
    async fn confirm(&self) -> Result<(), FenceError> {
        if *self.0.borrow() {
            Ok(())
        } else {
            Err(FenceError::NotCoordinating)
        }
    }
}

/// A run that stopped before its verdicts: the coordinator lost its role. Nothing was concluded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("run {run_id} aborted: {why}")]
pub struct Aborted {
    pub run_id: String,
    pub why: String,
}

/// Resolves when `leader` says false (at once when it already does); never when its sender is
/// gone with it true.
pub async fn role_lost(mut leader: watch::Receiver<bool>) {
    loop {
        if !*leader.borrow_and_update() {
            return;
        }
        if leader.changed().await.is_err() {
            if *leader.borrow() {
                std::future::pending::<()>().await;
            }
            return;
        }
    }
}

/// Where runs are published. Failures are the publisher's to log: a run never waits on them.
#[async_trait::async_trait]
pub trait RunPublisher: Send + Sync + std::fmt::Debug {
    async fn publish(&self, state: &RunState);
    /// The last published run (a new coordinator resumes it when it is unfinished).
    async fn last(&self) -> Option<RunState>;
}

/// A publisher that keeps the last run in memory (tests, and runs without any output).
#[derive(Debug, Default)]
pub struct MemoryPublisher(pub Mutex<Vec<RunState>>);

#[async_trait::async_trait]
impl RunPublisher for MemoryPublisher {
    async fn publish(&self, state: &RunState) {
        self.0.lock().push(state.clone());
    }
    async fn last(&self) -> Option<RunState> {
        self.0.lock().last().cloned()
    }
}

pub(crate) type ReportKey = (String, u32, String, String);

/// Runs peer checks. Cheap to share (`Arc`); one run at a time.
#[derive(Debug)]
pub struct Coordinator {
    /// This agent's node name (signs as it).
    pub node: String,
    /// Where this agent's peer service listens for reports.
    pub address: String,
    pub probe_port_base: u16,
    transport: Arc<dyn Transport>,
    publisher: Arc<dyn RunPublisher>,
    fence: Arc<dyn Fence>,
    reports: Mutex<HashMap<ReportKey, oneshot::Sender<CheckReport>>>,
    lock: tokio::sync::Mutex<()>,
    /// Request ids of runs claimed (queued, resuming or running) on this coordinator.
    claimed: Mutex<BTreeSet<String>>,
    /// No run starts before this (`hold_until`).
    not_before: Mutex<Option<tokio::time::Instant>>,
    /// The last run that finished here (requesters waiting on a claimed id watch it).
    finished: watch::Sender<Option<RunState>>,
    clock: Arc<dyn Clock>,
}

/// A claimed request id, released when dropped (which wakes requesters waiting on it: a run
/// that ended without a result must not leave them waiting).
#[derive(Debug)]
pub struct Claim {
    coordinator: Arc<Coordinator>,
    id: String,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.coordinator.claimed.lock().remove(&self.id);
        self.coordinator.finished.send_modify(|_| {});
    }
}

/// What happened to one check.
#[derive(Debug, Clone)]
struct CheckResult {
    outcome: Outcome,
    state: CheckState,
}

/// Published verdicts from planner verdicts.
pub fn verdict_states(members: &[String], v: &Verdicts) -> Vec<VerdictState> {
    wire::to_proto(members, v)
        .into_iter()
        .map(|w| VerdictState {
            kind: kind_name(w.kind()).to_string(),
            nodes: w.nodes,
            slowdown: (w.slowdown > 0.0).then_some(w.slowdown),
            reason: (!w.reason.is_empty()).then_some(w.reason),
        })
        .collect()
}

/// A new run id: time and a random suffix.
pub fn new_run_id(now: Timestamp) -> String {
    format!(
        "{}-{:04x}",
        now.strftime("%Y%m%dT%H%M%SZ"),
        wire::random_u64() & 0xffff
    )
}

impl Coordinator {
    pub fn new(
        node: String,
        address: String,
        probe_port_base: u16,
        transport: Arc<dyn Transport>,
        publisher: Arc<dyn RunPublisher>,
        fence: Arc<dyn Fence>,
        clock: Arc<dyn Clock>,
    ) -> Coordinator {
        Coordinator {
            node,
            address,
            probe_port_base,
            transport,
            publisher,
            fence,
            reports: Mutex::new(HashMap::new()),
            lock: tokio::sync::Mutex::new(()),
            claimed: Mutex::new(BTreeSet::new()),
            not_before: Mutex::new(None),
            finished: watch::channel(None).0,
            clock,
        }
    }

    /// The clock this coordinator reads time on.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Claims a request id: None when a run with it is already claimed here.
    pub fn claim(self: &Arc<Self>, id: &str) -> Option<Claim> {
        let mut c = self.claimed.lock();
        c.insert(id.to_string()).then(|| Claim {
            coordinator: Arc::clone(self),
            id: id.to_string(),
        })
    }

    /// No run starts before `t` (a new coordinator: the previous one's probes may still hold
    /// their ports). A run already waiting for the lock waits for this too.
    pub fn hold_until(&self, t: tokio::time::Instant) {
        *self.not_before.lock() = Some(t);
    }

    /// Runs a requested run in a task of its own, so a requester that goes away (a dropped
    /// call, a keep-alive timeout) does not drop the run halfway (its probes still running, its
    /// checks never cancelled); the claim is released when the run ends.
    pub async fn run_detached(
        self: &Arc<Self>,
        members: Vec<Member>,
        missing: BTreeMap<String, String>,
        spec: RunSpec,
        trigger: Trigger,
        request_id: Option<String>,
        claim: Option<Claim>,
    ) -> Result<RunState, Aborted> {
        let c = Arc::clone(self);
        let task = tokio::spawn(
            async move {
                let r = c.run(members, missing, &spec, trigger, request_id).await;
                drop(claim);
                r
            }
            .in_current_span(),
        );
        task.await.unwrap_or_else(|e| {
            Err(Aborted {
                run_id: String::new(),
                why: format!("the run's task ended: {e}"),
            })
        })
    }

    /// The result of the run requested as `id` when it is claimed here (being resumed or run
    /// for an earlier attempt of the same request): waits for it to finish. None when no run
    /// with that id is claimed or finished here; `Aborted` when the role is lost meanwhile.
    pub async fn attach(&self, id: &str) -> Option<Result<RunState, Aborted>> {
        let is_it = |s: &RunState| s.request_id.as_deref() == Some(id) && s.is_finished();
        let mut done = self.finished.subscribe();
        if let Some(s) = done.borrow_and_update().clone().filter(is_it) {
            return Some(Ok(s));
        }
        if let Some(s) = self.publisher.last().await.filter(is_it) {
            return Some(Ok(s));
        }
        let claimed = |c: &Coordinator| c.claimed.lock().contains(id);
        if !claimed(self) {
            // It may have finished between the looks above and this one.
            return done.borrow_and_update().clone().filter(is_it).map(Ok);
        }
        let lost = role_lost(self.fence.watch());
        tokio::pin!(lost);
        loop {
            tokio::select! {
                _ = &mut lost => return Some(Err(Aborted {
                    run_id: String::new(),
                    why: "the coordinator lost its role before the run finished".into(),
                })),
                r = done.changed() => {
                    if r.is_err() {
                        return None;
                    }
                    if let Some(s) = done.borrow_and_update().clone().filter(is_it) {
                        return Some(Ok(s));
                    }
                    if !claimed(self) {
                        return None;
                    }
                }
            }
        }
    }

    pub fn publisher(&self) -> &Arc<dyn RunPublisher> {
        &self.publisher
    }

    /// A report from an agent (the `Report` RPC, already authenticated). False when no check
    /// waits for it (late, duplicate, or not ours).
    /// Whether a check of a run here waits for this report (its run, round, node and partner).
    pub fn waits_for(&self, r: &CheckReport) -> bool {
        let key = (r.run_id.clone(), r.round, r.node.clone(), r.partner.clone());
        self.reports.lock().contains_key(&key)
    }

    pub fn deliver(&self, r: CheckReport) -> bool {
        let key = (r.run_id.clone(), r.round, r.node.clone(), r.partner.clone());
        let tx = self.reports.lock().remove(&key);
        match tx {
            Some(tx) => tx.send(r).is_ok(),
            None => false,
        }
    }

    pub(crate) fn expect(&self, key: ReportKey) -> oneshot::Receiver<CheckReport> {
        let (tx, rx) = oneshot::channel();
        self.reports.lock().insert(key, tx);
        rx
    }

    fn forget(&self, key: &ReportKey) {
        self.reports.lock().remove(key);
    }

    /// Runs one run among `members` (plus `missing`: requested nodes without an agent, reported
    /// as unknown). Waits for a run already in progress to finish first. Aborted, with nothing
    /// concluded, when this agent does not hold the coordinator role or loses it meanwhile.
    pub async fn run(
        &self,
        members: Vec<Member>,
        missing: BTreeMap<String, String>,
        spec: &RunSpec,
        trigger: Trigger,
        request_id: Option<String>,
    ) -> Result<RunState, Aborted> {
        let _one_at_a_time = self.lock.lock().await;
        let hold = *self.not_before.lock();
        if let Some(t) = hold {
            tokio::select! {
                _ = tokio::time::sleep_until(t) => {}
                _ = role_lost(self.fence.watch()) => return Err(Aborted {
                    run_id: String::new(),
                    why: "this agent lost the coordinator role before the run started".into(),
                }),
            }
        }
        let started = self.clock.now();
        let run_id = new_run_id(started);
        let span = tracing::info_span!("peer_run", run_id = %run_id, trigger = ?trigger);
        let inner = self
            .run_inner(
                members,
                missing,
                spec,
                trigger,
                run_id.clone(),
                started,
                request_id,
            )
            .instrument(span);
        let result = tokio::select! {
            r = inner => r,
            _ = role_lost(self.fence.watch()) => Err(Aborted {
                run_id: run_id.clone(),
                why: "this agent lost the coordinator role".into(),
            }),
        };
        match &result {
            Ok(state) => {
                self.finished.send_replace(Some(state.clone()));
            }
            Err(e) => {
                // Checks still waiting for reports are dropped with the run.
                self.reports.lock().retain(|k, _| k.0 != run_id);
                warn!(run_id = %run_id, why = %e.why, "peer-check run aborted; nothing concluded");
            }
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_inner(
        &self,
        members: Vec<Member>,
        mut skipped: BTreeMap<String, String>,
        spec: &RunSpec,
        trigger: Trigger,
        run_id: String,
        started: Timestamp,
        request_id: Option<String>,
    ) -> Result<RunState, Aborted> {
        let mut requested: Vec<String> = members
            .iter()
            .map(|m| m.node.clone())
            .chain(skipped.keys().cloned())
            .collect();
        requested.sort();
        requested.dedup();
        // Ping first: who is there, who is busy.
        let pings = self.ping_all(&members).await;
        let mut unreachable: BTreeMap<String, String> = BTreeMap::new();
        let mut pool: Vec<Member> = Vec::new();
        for (m, p) in members.into_iter().zip(pings) {
            match p {
                Ok(reply) if reply.busy && spec.skip_busy => {
                    skipped.insert(
                        m.node.clone(),
                        format!("accelerators busy: {}", reply.reason),
                    );
                }
                Ok(reply) if reply.protocol != PROTOCOL => {
                    skipped.insert(
                        m.node.clone(),
                        format!("agent speaks protocol {}, not {PROTOCOL}", reply.protocol),
                    );
                }
                Ok(_) => pool.push(m),
                Err(e) => {
                    unreachable.insert(m.node.clone(), e.to_string());
                    pool.push(m);
                }
            }
        }
        // A member the coordinator cannot reach is not yet evidence against the member: other
        // members are asked to reach it. Reached by one of them, only the path from the
        // coordinator fails: the coordinator reaches it through that member from now on, and it
        // takes part in the run. Reached by none that answered, its agent is gone (it stays in
        // the plan and fails with every partner); with nobody to ask, it cannot be told.
        let mut routes: BTreeMap<String, Member> = BTreeMap::new();
        if !unreachable.is_empty() {
            let relays: Vec<Member> = pool
                .iter()
                .filter(|m| !unreachable.contains_key(&m.node) && m.node != self.node)
                .take(RELAYS)
                .cloned()
                .collect();
            let targets: Vec<Member> = pool
                .iter()
                .filter(|m| unreachable.contains_key(&m.node))
                .cloned()
                .collect();
            let seen = self.relay(&relays, &targets).await;
            for t in &targets {
                match seen.get(&t.node) {
                    Some(Reach::By(relay)) => {
                        info!(node = %t.node, via = %relay.node, error = %unreachable[&t.node], "the coordinator reaches this member through another (its own path to it fails)");
                        routes.insert(t.node.clone(), relay.clone());
                    }
                    Some(Reach::Nobody) => {}
                    None => {
                        skipped.insert(
                            t.node.clone(),
                            format!(
                                "its agent does not answer the coordinator ({}: {}), and no other member could be asked to reach it",
                                self.node, unreachable[&t.node]
                            ),
                        );
                    }
                }
            }
            pool.retain(|m| !skipped.contains_key(&m.node));
            unreachable.retain(|n, _| !skipped.contains_key(n) && !routes.contains_key(n));
        }
        let names: Vec<String> = pool.iter().map(|m| m.node.clone()).collect();
        let mut state = RunState {
            run_id: run_id.clone(),
            trigger,
            coordinator: self.node.clone(),
            started,
            finished: None,
            members: names.clone(),
            skipped,
            rounds: Vec::new(),
            verdicts: Vec::new(),
            request_id,
            requested,
            check_timeout_ms: Some(spec.check_timeout.as_millis() as u64),
            relayed: routes
                .iter()
                .map(|(n, via)| (n.clone(), via.node.clone()))
                .collect(),
        };
        info!(
            members = names.len(),
            unreachable = unreachable.len(),
            skipped = state.skipped.len(),
            "peer-check run starting"
        );
        let topo: Vec<(String, Option<String>)> = pool
            .iter()
            .map(|m| (m.node.clone(), m.topology.clone()))
            .collect();
        let mut planner = Planner::new(neighbour_order(&topo, spec.rotation), spec.pairing.clone());
        let mut slowest_pass: Option<f64> = None;
        while let Some(checks) = planner.next_round() {
            let round = planner.rounds() as u32;
            let deadline = match slowest_pass {
                Some(s) if round > 1 => later_deadline(s, spec.iterations, spec.check_timeout),
                _ => spec.check_timeout,
            };
            // Longer after overloaded rounds and for nodes checked again after a timeout.
            let deadline = deadline.mul_f64(planner.deadline_factor());
            // Probe ports: per node, one per check it takes part in this round.
            let mut slots: HashMap<NodeId, u16> = HashMap::new();
            let group = (round.saturating_sub(1) as u16 % PORT_GROUPS) * PORTS_PER_ROUND;
            let mut port = |n: NodeId| {
                let s = slots.entry(n).or_insert(0);
                let p = self
                    .probe_port_base
                    .saturating_add(group + (*s % PORTS_PER_ROUND));
                *s += 1;
                p
            };
            let planned: Vec<(Pair, u16, u16)> = checks
                .iter()
                .map(|c| (c.pair, port(c.pair.a()), port(c.pair.b())))
                .collect();
            state.rounds.push(RoundState {
                round,
                deadline_ms: deadline.as_millis() as u64,
                checks: planned
                    .iter()
                    .map(|(p, _, _)| CheckState {
                        a: names[p.a()].clone(),
                        b: names[p.b()].clone(),
                        passed: None,
                        seconds: None,
                        busbw_gbps: None,
                        gemm_gflops: None,
                        error: None,
                    })
                    .collect(),
            });
            // Fenced: nothing is published or assigned without the role, asked of the source
            // of truth (a coordinator woken from a freeze may not have noticed the loss yet).
            if let Err(why) = self.fence.confirm().await {
                return Err(Aborted {
                    run_id,
                    why: why.to_string(),
                });
            }
            self.publisher.publish(&state).await;
            let results = futures::future::join_all(planned.iter().map(|(pair, pa, pb)| {
                let (a, b) = (&pool[pair.a()], &pool[pair.b()]);
                async {
                    let r = self
                        .check(
                            &run_id,
                            round,
                            a,
                            b,
                            (*pa, *pb),
                            &unreachable,
                            &routes,
                            spec,
                            deadline,
                        )
                        .await;
                    relayed_counts(r, a, b, &routes)
                }
            }))
            .await;
            let mut outcomes = Vec::new();
            for ((pair, _, _), r) in planned.iter().zip(results) {
                debug!(round, a = %r.state.a, b = %r.state.b, passed = ?r.state.passed, seconds = ?r.state.seconds, error = ?r.state.error, "check done");
                if let Outcome::Pass { seconds } = r.outcome {
                    slowest_pass = Some(slowest_pass.map_or(seconds, |s: f64| s.max(seconds)));
                }
                outcomes.push((*pair, r.outcome));
                if let Some(last) = state.rounds.last_mut() {
                    if let Some(c) = last
                        .checks
                        .iter_mut()
                        .find(|c| c.a == names[pair.a()] && c.b == names[pair.b()])
                    {
                        *c = r.state;
                    }
                }
            }
            planner.record(&outcomes);
            let failed = outcomes
                .iter()
                .filter(|(_, o)| !matches!(o, Outcome::Pass { .. }))
                .count();
            info!(
                round,
                checks = outcomes.len(),
                failed,
                "peer-check round done"
            );
        }
        let verdicts = planner.verdicts();
        state.verdicts = verdict_states(&names, &verdicts);
        for (n, why) in &state.skipped {
            if !names.contains(n) {
                state.verdicts.push(VerdictState {
                    kind: "unknown".into(),
                    nodes: vec![n.clone()],
                    slowdown: None,
                    reason: Some(why.clone()),
                });
            }
        }
        // Fenced: the verdicts go out only while this agent still holds the role, asked of the
        // source of truth itself (a coordinator frozen past its Lease may not have noticed yet).
        if let Err(why) = self.fence.confirm().await {
            return Err(Aborted {
                run_id,
                why: why.to_string(),
            });
        }
        state.finished = Some(self.clock.now());
        self.publisher.publish(&state).await;
        info!(
            rounds = state.rounds.len(),
            verdicts = state.verdicts.len(),
            "peer-check run finished"
        );
        // Every reachable member records its own verdict (those reached through a relay too).
        let conclusion = RunConclusion {
            auth: None,
            protocol: PROTOCOL,
            run_id: run_id.clone(),
            members: names.clone(),
            verdicts: wire::to_proto(&names, &verdicts),
        };
        let told = futures::future::join_all(
            pool.iter()
                .filter(|m| !unreachable.contains_key(&m.node))
                .map(|m| {
                    let c = conclusion.clone();
                    let via = routes.get(&m.node);
                    async move {
                        let r = match via {
                            Some(via) => self
                                .transport
                                .forward(via, m, Relayed::Conclude(c))
                                .await
                                .map(|_| ()),
                            None => self.transport.conclude(m, c).await,
                        };
                        (m, r)
                    }
                }),
        )
        .await;
        for (m, r) in told {
            if let Err(e) = r {
                warn!(node = %m.node, error = %e, "cannot tell a member its verdict");
            }
        }
        Ok(state)
    }

    /// Pings every member, each failed ping again up to `PING_ATTEMPTS` times: one lost ping
    /// does not make a member unreachable for the whole run.
    async fn ping_all(&self, members: &[Member]) -> Vec<Result<PingReply, SendError>> {
        futures::future::join_all(members.iter().map(|m| {
            faultline_agent::peer::retried(
                PING_ATTEMPTS,
                PING_RETRY_PAUSE,
                |_| true,
                || self.transport.ping(m),
            )
        }))
        .await
    }

    /// Asks the relays, all at once, to reach `targets`: per target, the first relay that
    /// reached it, `Nobody` when relays answered and none did, absent when no relay answered.
    async fn relay(&self, relays: &[Member], targets: &[Member]) -> BTreeMap<String, Reach> {
        let mut seen: BTreeMap<String, Reach> = BTreeMap::new();
        if targets.is_empty() {
            return seen;
        }
        let asked = futures::future::join_all(
            relays
                .iter()
                .map(|r| async move { (r, self.transport.reach(r, targets).await) }),
        )
        .await;
        for (relay, answer) in asked {
            let Ok(reached) = answer else {
                if let Err(e) = answer {
                    debug!(relay = %relay.node, error = %e, "a relay could not be asked");
                }
                continue;
            };
            // A target the relay has no word on (it could not be asked about it) is left as
            // it was: only a relay that tried and got no answer says the member is gone.
            for t in targets {
                let Some(r) = reached.iter().find(|r| r.node == t.node) else {
                    continue;
                };
                match seen.get(&t.node) {
                    Some(Reach::By(_)) => {}
                    _ if r.answered => {
                        seen.insert(t.node.clone(), Reach::By(relay.clone()));
                    }
                    _ => {
                        seen.insert(t.node.clone(), Reach::Nobody);
                    }
                }
            }
        }
        seen
    }

    /// `assign_retried` directly, or through the member's relay (`routes`), with the relay
    /// named for its report.
    async fn send_assign(
        &self,
        to: &Member,
        a: CheckAssignment,
        routes: &BTreeMap<String, Member>,
    ) -> Result<CheckAccepted, SendError> {
        let Some(via) = routes.get(&to.node) else {
            return self.assign_retried(to, a).await;
        };
        let a = CheckAssignment {
            report_via: Some(wire_member(via)),
            ..a
        };
        faultline_agent::peer::retried(
            2,
            PING_RETRY_PAUSE,
            |_| true,
            || self.transport.forward(via, to, Relayed::Assign(a.clone())),
        )
        .await
    }

    /// `cancel`, through the member's relay when it has one.
    async fn send_cancel(
        &self,
        to: &Member,
        a: CheckAssignment,
        routes: &BTreeMap<String, Member>,
    ) {
        match routes.get(&to.node) {
            Some(via) => {
                if let Err(e) = self.transport.forward(via, to, Relayed::Cancel(a)).await {
                    debug!(node = %to.node, via = %via.node, error = %e, "cannot cancel through the relay");
                }
            }
            None => self.transport.cancel(to, a).await,
        }
    }

    /// `assign`, once more after a short pause when the call itself failed (a refusal is an
    /// answer and is not repeated).
    async fn assign_retried(
        &self,
        to: &Member,
        a: CheckAssignment,
    ) -> Result<CheckAccepted, SendError> {
        faultline_agent::peer::retried(
            2,
            PING_RETRY_PAUSE,
            |_| true,
            || self.transport.assign(to, a.clone()),
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn check(
        &self,
        run_id: &str,
        round: u32,
        a: &Member,
        b: &Member,
        ports: (u16, u16),
        unreachable: &BTreeMap<String, String>,
        routes: &BTreeMap<String, Member>,
        spec: &RunSpec,
        deadline: Duration,
    ) -> CheckResult {
        let mut state = CheckState {
            a: a.node.clone(),
            b: b.node.clone(),
            passed: Some(false),
            seconds: None,
            busbw_gbps: None,
            gemm_gflops: None,
            error: None,
        };
        let fail = |mut state: CheckState, why: String| CheckResult {
            outcome: Outcome::Fail,
            state: {
                state.error = Some(why);
                state
            },
        };
        for m in [a, b] {
            if let Some(e) = unreachable.get(&m.node) {
                return fail(state, format!("agent on {} unreachable: {e}", m.node));
            }
        }
        let assignment = CheckAssignment {
            auth: None,
            protocol: PROTOCOL,
            run_id: run_id.to_string(),
            round,
            a: Some(wire_member(a)),
            b: Some(wire_member(b)),
            probe_a: SocketAddr::new(a.ip, ports.0).to_string(),
            probe_b: SocketAddr::new(b.ip, ports.1).to_string(),
            bytes: spec.bytes,
            iterations: spec.iterations,
            timeout_ms: u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX),
            gemm: spec.gemm,
            coordinator: self.address.clone(),
            report_via: None,
            cancel: false,
        };
        let key_a: ReportKey = (run_id.into(), round, a.node.clone(), b.node.clone());
        let key_b: ReportKey = (run_id.into(), round, b.node.clone(), a.node.clone());
        let mut rx_a = self.expect(key_a.clone());
        let mut rx_b = self.expect(key_b.clone());
        let (ra, rb) = tokio::join!(
            self.send_assign(a, assignment.clone(), routes),
            self.send_assign(b, assignment.clone(), routes)
        );
        let refused = |m: &Member, r: &Result<CheckAccepted, SendError>| match r {
            Ok(acc) if acc.accepted => None,
            Ok(acc) => Some(format!("{} refused the check: {}", m.node, acc.reason)),
            Err(_) => None,
        };
        // The coordinator could not reach an agent to assign the check (it answered the ping):
        // the control path, not the data path. Not judged.
        let unassigned = [(&ra, a), (&rb, b)].into_iter().find_map(|(r, m)| {
            r.as_ref()
                .err()
                .map(|e| format!("cannot assign the check to {}: {e}", m.node))
        });
        let mut result = None;
        if let Some(why) = refused(a, &ra).or_else(|| refused(b, &rb)) {
            result = Some(fail(state.clone(), why));
        } else if let Some(why) = unassigned {
            result = Some(void(state.clone(), why));
        }
        let mut got_a: Option<CheckReport> = None;
        let mut got_b: Option<CheckReport> = None;
        if result.is_none() {
            let limit = tokio::time::sleep(deadline + super::runner::PROBE_GRACE + REPORT_SLACK);
            tokio::pin!(limit);
            loop {
                if got_a.is_some() && got_b.is_some() {
                    break;
                }
                tokio::select! {
                    r = &mut rx_a, if got_a.is_none() => {
                        got_a = Some(r.unwrap_or_else(|_| lost(a, b)));
                    }
                    r = &mut rx_b, if got_b.is_none() => {
                        got_b = Some(r.unwrap_or_else(|_| lost(b, a)));
                    }
                    _ = &mut limit => break,
                }
                // A failure on either side decides the check (one that is only the probe's
                // deadline waits for the other side, which may say more).
                if [&got_a, &got_b]
                    .iter()
                    .any(|r| r.as_ref().is_some_and(|r| !r.passed && !r.timed_out))
                {
                    break;
                }
            }
        }
        self.forget(&key_a);
        self.forget(&key_b);
        if result.is_none() {
            let failure = [(&got_a, a), (&got_b, b)].into_iter().find_map(|(r, m)| {
                r.as_ref()
                    .filter(|r| !r.passed && !r.timed_out)
                    .map(|r| format!("{}: {}", m.node, r.error))
            });
            let too_slow = [(&got_a, a), (&got_b, b)].into_iter().find_map(|(r, m)| {
                r.as_ref()
                    .filter(|r| !r.passed && r.timed_out)
                    .map(|r| format!("{}: {}", m.node, r.error))
            });
            result = Some(match (&got_a, &got_b, failure) {
                (_, _, Some(why)) => fail(state.clone(), why),
                (_, _, None) if too_slow.is_some() => {
                    // The transfer did not finish in time: a timeout, which the planner judges
                    // with its round (load, or a node that is too slow).
                    let mut r = fail(state.clone(), too_slow.unwrap_or_default());
                    r.outcome = Outcome::TimedOut;
                    r
                }
                (Some(x), Some(y), None) => {
                    let seconds = x.seconds.max(y.seconds);
                    state.passed = Some(true);
                    state.seconds = Some(seconds);
                    state.busbw_gbps = Some(x.busbw_gbps.min(y.busbw_gbps));
                    state.gemm_gflops = [x.gemm_gflops, y.gemm_gflops]
                        .into_iter()
                        .filter(|g| *g > 0.0)
                        .reduce(f64::min);
                    CheckResult {
                        outcome: Outcome::Pass { seconds },
                        state: state.clone(),
                    }
                }
                (Some(x), None, None) | (None, Some(x), None) => {
                    // One side passed: its probe exchanged every block with the other, so the
                    // data path works; the other's report was lost on its way here.
                    let silent = if got_a.is_none() { a } else { b };
                    void(
                        state.clone(),
                        format!(
                            "{} passed; no report from {} within {} (lost on the way to the coordinator)",
                            x.node,
                            silent.node,
                            humantime::format_duration(deadline)
                        ),
                    )
                }
                _ => {
                    let silent: Vec<&str> = [(&got_a, a), (&got_b, b)]
                        .into_iter()
                        .filter(|(r, _)| r.is_none())
                        .map(|(_, m)| m.node.as_str())
                        .collect();
                    // The deadline passed with no failure reported: a timeout, which the
                    // planner reads against the rest of the round (overload or a hung node).
                    let mut r = fail(
                        state.clone(),
                        format!(
                            "no report from {} within {}",
                            silent.join(" and "),
                            humantime::format_duration(deadline)
                        ),
                    );
                    r.outcome = Outcome::TimedOut;
                    r
                }
            });
        }
        // Whoever has not reported is still running a probe for nothing: stop it.
        let accepted = |r: &Result<CheckAccepted, SendError>| matches!(r, Ok(acc) if acc.accepted);
        let cancels = [(&got_a, a, &ra), (&got_b, b, &rb)]
            .into_iter()
            .filter(|(got, _, assigned)| got.is_none() && accepted(assigned))
            .map(|(_, m, _)| self.send_cancel(m, assignment.clone(), routes));
        futures::future::join_all(cancels).await;
        result.unwrap_or_else(|| fail(state, "internal: no result".into()))
    }
}

/// A check with a member reached through a relay counts only when it passed: every answer of
/// that member (its acceptance, its ping, its report's arrival) comes back through the relay,
/// which a relay could change or drop, so a failure may be the relay's doing. Such a member
/// can be found healthy, never faulty; a failed check is left unjudged.
fn relayed_counts(
    r: CheckResult,
    a: &Member,
    b: &Member,
    routes: &BTreeMap<String, Member>,
) -> CheckResult {
    let via = [a, b]
        .into_iter()
        .find_map(|m| routes.get(&m.node).map(|v| (m, v)));
    match (&r.outcome, via) {
        (Outcome::Fail | Outcome::TimedOut, Some((m, v))) => {
            let why = format!(
                "{} (not counted: {} answers only through {}, whose word it is)",
                r.state.error.clone().unwrap_or_default(),
                m.node,
                v.node
            );
            void(r.state, why)
        }
        _ => r,
    }
}

/// A member as the wire names it.
fn wire_member(m: &Member) -> WireMember {
    WireMember {
        node: m.node.clone(),
        address: m.address.clone(),
        topology: m.topology.clone().unwrap_or_default(),
    }
}

/// A check that says nothing about the data path: no outcome for the planner.
fn void(mut state: CheckState, why: String) -> CheckResult {
    state.passed = None;
    state.error = Some(format!("not judged: {why}"));
    CheckResult {
        outcome: Outcome::Void,
        state,
    }
}

/// What other members saw of a member the coordinator could not reach.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reach {
    /// This relay reached it.
    By(Member),
    /// Relays answered; none reached it.
    Nobody,
}

fn lost(node: &Member, partner: &Member) -> CheckReport {
    CheckReport {
        node: node.node.clone(),
        partner: partner.node.clone(),
        passed: false,
        error: "report channel closed".into(),
        ..Default::default()
    }
}

/// Members of a requested run: the named nodes that have an agent, and the rest with a reason.
pub fn select(all: Vec<Member>, wanted: &[String]) -> (Vec<Member>, BTreeMap<String, String>) {
    let want: BTreeSet<&String> = wanted.iter().collect();
    let found: Vec<Member> = all.into_iter().filter(|m| want.contains(&m.node)).collect();
    let missing = want
        .into_iter()
        .filter(|n| !found.iter().any(|m| &&m.node == n))
        .map(|n| {
            (
                n.clone(),
                "no running faultline agent with peer checks on this node".to_string(),
            )
        })
        .collect();
    (found, missing)
}

/// How long a new coordinator waits before it resumes an unfinished run: the probes of that
/// run's last round may hold their ports until the round's deadline, the probe's grace and the
/// report slack have passed. Counted from when this agent took the role, which is after the
/// round started, so no other node's clock is involved. The published deadline is untrusted:
/// at most an hour is believed.
pub fn resume_wait(last: &RunState) -> Duration {
    last.rounds.last().map_or(Duration::ZERO, |r| {
        Duration::from_millis(r.deadline_ms.min(3_600_000))
            + super::runner::PROBE_GRACE
            + REPORT_SLACK
    })
}

/// The deadline of a check after the first round: `HANG_FACTOR` times what the slowest passed
/// check of earlier rounds took for `iterations`, within [MIN_LATER_DEADLINE, check_timeout].
/// Never panics: a time that is not a finite, non-negative number (reports are validated, but
/// this is arithmetic on them) gives the full `check_timeout`.
pub fn later_deadline(slowest: f64, iterations: u32, check_timeout: Duration) -> Duration {
    let expected = HANG_FACTOR * slowest * f64::from(iterations.max(1));
    Duration::try_from_secs_f64(expected.min(check_timeout.as_secs_f64()))
        .unwrap_or(check_timeout)
        .max(MIN_LATER_DEADLINE)
        .min(check_timeout)
}

/// Why a report is refused at the boundary.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BadReport {
    #[error("{name} {value} is not a number from 0 to {most}")]
    Number {
        name: &'static str,
        value: f64,
        most: f64,
    },
    #[error("{name} is {len} bytes, more than {most}")]
    TooLong {
        name: &'static str,
        len: usize,
        most: usize,
    },
}

/// Checks a report's fields at the boundary: times and rates finite, not negative and within
/// reason, identifiers and the error text of bounded length. The coordinator computes deadlines
/// from `seconds` (a negative one used to panic it).
pub fn validate_report(r: &CheckReport) -> Result<(), BadReport> {
    for (name, v, most) in [
        ("seconds", r.seconds, 86_400.0),
        ("busbw_gbps", r.busbw_gbps, 1e9),
        ("gemm_gflops", r.gemm_gflops, 1e12),
    ] {
        if !v.is_finite() || v < 0.0 || v > most {
            return Err(BadReport::Number {
                name,
                value: v,
                most,
            });
        }
    }
    for (name, v, most) in [
        ("run_id", &r.run_id, 128),
        ("node", &r.node, 253),
        ("partner", &r.partner, 253),
        ("error", &r.error, 4096),
    ] {
        if v.len() > most {
            return Err(BadReport::TooLong {
                name,
                len: v.len(),
                most,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "runs_tests.rs"]
#[allow(clippy::disallowed_methods)] // tests read the real clock freely
mod tests;
