//! The node sink: the agent's own Node gets the desired `faultline.io/health` label,
//! `faultline.io/*` taints and `AcceleratorHealthy` condition, and nothing else changes.
//!
//! - Labels: server-side apply under [`FIELD_MANAGER`], which owns exactly the keys it sends.
//! - Taints: `spec.taints` is one atomic list for every patch type, so the sink reads the Node,
//!   keeps every foreign taint, edits its own, and writes the list back with a merge patch that
//!   carries the resourceVersion it read (a 409 means someone else wrote: read again, retry).
//! - Condition: a strategic merge patch of the status subresource; conditions merge by `type`,
//!   so the kubelet's conditions survive.
//!
//! The sink is a kube-runtime [`Controller`] of its one Node ([`controller`]): its watcher keeps
//! the Node in a store, and [`NodeSink::step`] runs on every change of the Node, every new
//! snapshot and every requeue (the resync, the budget's recheck, the end of the settle time; a
//! failed pass is requeued by the error policy after the sink's jittered backoff).
//!
//! Every change starts from the Node as it is (the store's copy when that is the
//! version the sink itself last wrote or read, else a read), and writes happen only where the
//! Node differs from the desired state: a restarted agent adopts what is there and writes
//! nothing. The label and the condition are written before the taints: only a new hard taint
//! asks the cluster's taint [`Budget`], and neither its answer nor its failure to answer holds
//! the other two back (docs/operations.md, "When the taint budget cannot answer").

pub(crate) mod plan;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::budget::{Answer, Budget};
use super::events::plan::Notice;
use super::own::{DriftPacer, OwnVersions, WATCH_WARN_EVERY};
use super::{api, is_conflict, KubeSinkConfig, KubeSinkError, FIELD_MANAGER};
use crate::backoff::Backoff;
use crate::clock::Clock;
use crate::engine_loop::{SinkReport, Snapshot};
use crate::metrics::{Metrics, SinkLabel};
use crate::rate_limit::LogPacer;
use faultline_core::engine::{DesiredCondition, DesiredTaint};
use faultline_core::record::TaintBudgetStatus;
use faultline_core::time::Timestamp;

/// What the Node should carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Desired {
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<DesiredTaint>,
    pub condition: DesiredCondition,
}

impl Desired {
    pub(crate) fn of(s: &Snapshot) -> Self {
        Desired {
            labels: s.labels.clone(),
            taints: s.taints.clone(),
            condition: s.condition.clone(),
        }
    }

    /// Whether `node` carries this: the labels, the condition, and the faultline taints (hard
    /// taints not yet on the node are fine when `withholding`: the budget holds them back).
    /// Foreign labels, taints and conditions do not matter.
    pub(crate) fn carried_by(&self, node: &Node, withholding: bool, now: Timestamp) -> bool {
        let taints = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_deref())
            .unwrap_or_default();
        let conditions = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_deref())
            .unwrap_or_default();
        plan::plan_taints(taints, &self.taints, withholding, now).is_none()
            && plan::plan_condition(conditions, &self.condition, now).is_none()
            && !plan::labels_differ(node.metadata.labels.as_ref(), &self.labels)
    }
}

/// How one pass ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// The Node matches (`withheld`: except taints the budget holds back).
    Done { withheld: bool, wrote: bool },
    /// The change would make the node look healthier and the agent has just started.
    Settling,
}

/// What the last pass was for, and when the next one is due with nothing new (the resync, the
/// budget's recheck, the retry after a failure, the end of the settle time).
#[derive(Debug)]
struct Last {
    desired: Desired,
    /// The pass made the Node carry `desired`: a later change of the Node is drift.
    done: bool,
    /// Since boot ([`Clock::since_boot`]).
    due: Duration,
}

/// A failed pass and when to try again: the controller's `error_policy` requeues by it.
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub(crate) struct Retry {
    after: Duration,
    #[source]
    source: KubeSinkError,
}

/// Node sink state.
#[derive(Debug)]
pub(crate) struct NodeSink {
    nodes: Api<Node>,
    cfg: KubeSinkConfig,
    budget: Budget,
    notices: mpsc::Sender<Notice>,
    report: watch::Sender<SinkReport>,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
    /// Since boot, as every time below.
    started: Duration,
    /// When the sink last read the Node itself: the watch's copy stands in for a read only
    /// within a resync interval of it (a watch that fails keeps its last copy).
    read_at: Option<Duration>,
    /// The taints withheld at the last pass (to announce only changes).
    withheld: Vec<String>,
    /// The announcement of `withheld` when the notice queue was full (the API unreachable for
    /// long): sent again at every pass until it fits, dropped when the list changes.
    unsent: Option<Notice>,
    /// Versions of the Node this sink wrote or read (their watch echoes are not drift).
    versions: OwnVersions,
    pacer: DriftPacer,
    retry: Backoff,
    last: Option<Last>,
}

const MAX_TAINT_CONFLICTS: u32 = 8;

/// The controller of the agent's own Node. Its store is fed from two sources:
/// - one direct read of the Node, before anything else, as the initial list a watcher would
///   make (which also marks the store ready, as a controller waits for): a watch that RBAC
///   denies or that cannot connect would otherwise leave the store empty, and a controller
///   reconciles only what its store holds. Once the Node is there, the sink's own passes read
///   it when the store's copy is not known to be current ([`NodeSink::reconcile`]), at the
///   latest at every resync, so the sink works without the watch;
/// - kube-runtime's watcher on that one Node (`fieldSelector=metadata.name=<node>`), so that
///   someone else's change is repaired at once.
///
/// The watch's errors are logged here at a bounded rate and never reach the controller, whose
/// own backoff would otherwise hold back the snapshots' wake-ups. Every change of the Node,
/// every new snapshot and every requeue runs [`NodeSink::step`] on the newest of both.
pub(crate) fn controller(
    watch: Api<Node>,
    calls: Api<Node>,
    node: &str,
    clock: Arc<dyn Clock>,
) -> Controller<Node> {
    use futures::stream::{self, StreamExt as _};
    let (store, writer) = reflector::store();
    let mut pacer = LogPacer::new(WATCH_WARN_EVERY);
    let watched = watcher(
        watch,
        watcher::Config::default().fields(&format!("metadata.name={node}")),
    )
    .default_backoff()
    .filter_map(move |r| {
        let event = match r {
            Ok(e) => Some(Ok(e)),
            Err(e) => {
                if let Some((since, _)) = pacer.note(1, clock.instant()) {
                    warn!(error = %e, failures = since.times, "watching the node failed; it is read every resync instead");
                }
                None
            }
        };
        std::future::ready(event)
    });
    let first = stream::once(read_node(calls, node.to_string())).flat_map(|n| {
        let list = [
            watcher::Event::Init,
            watcher::Event::InitApply(n),
            watcher::Event::InitDone,
        ];
        stream::iter(list.map(Ok))
    });
    let nodes = first.chain(watched).reflect(writer).applied_objects();
    Controller::for_stream(nodes, store)
}

/// The Node, read until a read succeeds (the sink's backoff between failures).
async fn read_node(api: Api<Node>, node: String) -> Node {
    let mut retry = super::retry();
    loop {
        match api.get(&node).await {
            Ok(n) => return n,
            Err(e) => {
                debug!(error = %e, "reading the node failed; trying again");
                tokio::time::sleep(retry.next_delay()).await;
            }
        }
    }
}

impl NodeSink {
    pub(crate) fn new(
        client: Client,
        cfg: KubeSinkConfig,
        budget: Budget,
        notices: mpsc::Sender<Notice>,
        report: watch::Sender<SinkReport>,
        metrics: Arc<Metrics>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        // A restart while a taint is withheld: the report starts from the last record's
        // (`agent.taintBudget`), so the same withheld list is no change (no Event, no write,
        // the same `since`).
        let withheld = report
            .borrow()
            .taint_budget
            .as_ref()
            .map(|t| t.withheld.clone())
            .unwrap_or_default();
        NodeSink {
            nodes: Api::all(client),
            cfg,
            budget,
            notices,
            report,
            metrics,
            started: clock.since_boot(),
            clock,
            read_at: None,
            withheld,
            unsent: None,
            versions: OwnVersions::default(),
            pacer: DriftPacer::default(),
            retry: super::retry(),
            last: None,
        }
    }

    /// Runs `controller` (from [`controller`]) until the snapshot channel closes, then makes
    /// one last bounded attempt. A failed pass is retried by the controller's error policy
    /// after the sink's backoff.
    pub(crate) async fn run(
        self,
        controller: Controller<Node>,
        snapshots: watch::Receiver<Option<Snapshot>>,
    ) {
        let changes = futures::stream::unfold(snapshots.clone(), |mut rx| async move {
            rx.changed().await.ok().map(|()| ((), rx))
        });
        let mut closed = snapshots.clone();
        let ctx = Arc::new((tokio::sync::Mutex::new(self), snapshots));
        controller
            .reconcile_all_on(changes)
            .graceful_shutdown_on(async move { while closed.changed().await.is_ok() {} })
            .run(
                |node, ctx| async move {
                    let snap = ctx.1.borrow().clone();
                    ctx.0.lock().await.step(node, snap).await
                },
                |_, e, _| {
                    warn!(error = %e, retry_in_ms = e.after.as_millis() as u64, "updating the node failed; detection goes on");
                    Action::requeue(e.after)
                },
                ctx.clone(),
            )
            .for_each(|r| async move {
                if let Err(e) = r {
                    debug!(error = %e, "the node's controller");
                }
            })
            .await;
        // The engine stopped: push its final state if it differs, briefly.
        let mut sink = ctx.0.lock().await;
        let last = ctx.1.borrow().clone();
        if let Some(snap) = last {
            let desired = Desired::of(&snap);
            if sink
                .last
                .as_ref()
                .is_none_or(|l| !l.done || l.desired != desired)
            {
                let _ =
                    tokio::time::timeout(Duration::from_secs(3), sink.reconcile(&desired, None))
                        .await;
            }
        }
    }

    /// One run of the controller: a pass when the engine wants something new, a pass is due, or
    /// the Node lost what the last pass made it carry (a repair, paced by [`DriftPacer`]).
    async fn step(&mut self, watched: Arc<Node>, snap: Option<Snapshot>) -> Result<Action, Retry> {
        self.send_unsent();
        let Some(snap) = snap else {
            return Ok(Action::await_change());
        };
        let desired = Desired::of(&snap);
        let now = self.clock.since_boot();
        let mut repair = false;
        if let Some(last) = self
            .last
            .as_ref()
            .filter(|l| l.desired == desired && now < l.due)
        {
            // Nothing new and no pass due (a change of the Node alone cuts neither a retry's
            // backoff nor the settle time short): only drift needs a pass.
            if !last.done || !self.drifted(&watched, &desired) {
                return Ok(Action::requeue(last.due - now));
            }
            if let Err(at) = self.pacer.ask(now) {
                debug!("the node drifted again; pacing the repair");
                return Ok(Action::requeue(at - now));
            }
            repair = true;
        }
        let outcome = self.reconcile(&desired, Some(watched)).await;
        let now = self.clock.since_boot();
        let (done, next) = match outcome {
            Ok(Outcome::Done { withheld, wrote }) => {
                if wrote {
                    let latency = self
                        .clock
                        .instant()
                        .saturating_duration_since(snap.applied_at);
                    self.metrics
                        .kube_publish_seconds
                        .observe(latency.as_secs_f64());
                }
                if wrote && repair {
                    info!("the node had lost what faultline wrote; repaired");
                    self.metrics
                        .drift_repairs
                        .get_or_create(&SinkLabel { sink: "node" })
                        .inc();
                }
                self.retry.reset();
                let next = if withheld {
                    self.cfg.budget_recheck
                } else {
                    self.cfg.resync
                };
                (true, next)
            }
            Ok(Outcome::Settling) => {
                debug!("holding an improvement until the agent has settled");
                (false, (self.started + self.cfg.settle).saturating_sub(now))
            }
            Err(source) => {
                self.metrics
                    .sink_errors
                    .get_or_create(&SinkLabel { sink: "node" })
                    .inc();
                let after = self.retry.next_delay();
                self.last = Some(Last {
                    desired,
                    done: false,
                    due: now + after,
                });
                return Err(Retry { after, source });
            }
        };
        self.last = Some(Last {
            desired,
            done,
            due: now + next,
        });
        Ok(Action::requeue(next))
    }

    /// Whether the watched Node has lost what the sink last made it carry. The sink's own
    /// intermediate versions are not; its latest is checked like any other: a change someone
    /// made between its last read and its last write is in that write's result, which the pass
    /// did not check.
    fn drifted(&self, node: &Node, desired: &Desired) -> bool {
        let rv = node.metadata.resource_version.as_deref();
        if self.versions.ours(rv) && !self.versions.is_latest(rv) {
            return false;
        }
        !desired.carried_by(node, !self.withheld.is_empty(), self.clock.now())
    }

    /// Counts a write of `what` and notes the Node it returned as the sink's own version.
    fn wrote(&mut self, what: &'static str, node: &Node) {
        self.versions.note_of(node);
        self.metrics
            .sink_writes
            .get_or_create(&SinkLabel { sink: what })
            .inc();
    }

    /// Reads the Node, noting when and its version.
    async fn read(&mut self, name: &str) -> Result<Node, KubeSinkError> {
        let node = self.nodes.get(name).await.map_err(api("read the node"))?;
        self.read_at = Some(self.clock.since_boot());
        self.versions.note_of(&node);
        Ok(node)
    }

    /// One pass: read the Node, write what differs. `watched`: the Node as the own-node watch
    /// last delivered it; when that is the version this sink itself wrote or read last, and the
    /// sink read the Node itself within the last resync interval, nobody has changed the Node
    /// since as far as the watch knows, and it is not read again (a new fault costs its writes
    /// alone, a withheld taint's recheck only its admission). A change the watch has not
    /// delivered yet is one a read could have missed too: the taint's write names the version
    /// it started from and fails on a newer one, and a label or condition taken away meanwhile
    /// is in the result of the pass's last write, which `drifted` checks when the watch
    /// delivers it. A watch that keeps failing keeps its last copy: the resync's read is the
    /// backstop.
    async fn reconcile(
        &mut self,
        desired: &Desired,
        watched: Option<Arc<Node>>,
    ) -> Result<Outcome, KubeSinkError> {
        let name = self.cfg.node.clone();
        let now = self.clock.since_boot();
        let recent = self
            .read_at
            .is_some_and(|at| now.saturating_sub(at) < self.cfg.resync);
        let mut node = match watched.filter(|n| {
            recent
                && self
                    .versions
                    .is_latest(n.metadata.resource_version.as_deref())
        }) {
            Some(node) => Arc::unwrap_or_clone(node),
            None => self.read(&name).await?,
        };
        let labels = node.metadata.labels.clone();
        if now.saturating_sub(self.started) < self.cfg.settle
            && plan::is_improvement(labels.as_ref(), &desired.labels)
        {
            return Ok(Outcome::Settling);
        }
        let mut wrote = false;

        // The label and the condition first: they never wait for the taint budget.
        if plan::labels_differ(node.metadata.labels.as_ref(), &desired.labels) {
            let body = json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": { "name": name, "labels": desired.labels },
            });
            node = self
                .nodes
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&body),
                )
                .await
                .map_err(api("apply the node's labels"))?;
            self.wrote("node_labels", &node);
            info!(labels = ?desired.labels, "node labels applied");
            wrote = true;
        }

        let conditions = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        if let Some(c) = plan::plan_condition(&conditions, &desired.condition, self.clock.now()) {
            let body = json!({ "status": { "conditions": [c] } });
            let pp = PatchParams {
                field_manager: Some(FIELD_MANAGER.to_string()),
                ..Default::default()
            };
            node = self
                .nodes
                .patch_status(&name, &pp, &Patch::Strategic(&body))
                .await
                .map_err(api("write the node's condition"))?;
            self.wrote("node_condition", &node);
            info!(status = %c.status, reason = ?c.reason, "node condition updated");
            wrote = true;
        }

        // The taints last: only they may wait for the budget (an admission under contention
        // takes seconds, and an API server that cannot answer for the ledger makes it fail);
        // the label and the condition, written above, say what is wrong meanwhile. Each write
        // returns the Node, so the taint patch carries the newest resourceVersion and a new
        // fault costs three node writes (and a read, unless the watch holds the sink's last
        // version).
        let mut withheld: Option<(Vec<String>, u32, u32, u32)> = None;
        for attempt in 0.. {
            let now = self.clock.now();
            let actual = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.clone())
                .unwrap_or_default();
            let mut withhold = false;
            withheld = None;
            if plan::needs_admission(&actual, &desired.taints) {
                if let Answer::Denied { used, limit, nodes } = self.budget.admit().await? {
                    withhold = true;
                    let list = plan::withheld(&actual, &desired.taints)
                        .iter()
                        .map(plan::taint_string)
                        .collect();
                    withheld = Some((list, used, limit, nodes));
                }
            }
            let Some(taints) = plan::plan_taints(&actual, &desired.taints, withhold, now) else {
                break;
            };
            let body = json!({
                "metadata": { "resourceVersion": node.metadata.resource_version },
                "spec": { "taints": if taints.is_empty() { serde_json::Value::Null } else { json!(taints) } },
            });
            let pp = PatchParams {
                field_manager: Some(FIELD_MANAGER.to_string()),
                ..Default::default()
            };
            match self.nodes.patch(&name, &pp, &Patch::Merge(&body)).await {
                Ok(n) => {
                    info!(taints = ?taints.iter().filter(|t| t.key.starts_with(plan::OWNED_PREFIX)).map(|t| format!("{}={}:{}", t.key, t.value.as_deref().unwrap_or(""), t.effect)).collect::<Vec<_>>(), "node taints updated");
                    self.wrote("node_taints", &n);
                    wrote = true;
                    break;
                }
                Err(e) if is_conflict(&e) && attempt < MAX_TAINT_CONFLICTS => {
                    debug!(attempt, "node changed meanwhile; reading it again");
                    node = self.read(&name).await?;
                }
                Err(e) => return Err(api("write the node's taints")(e)),
            }
        }
        self.note_withheld(withheld);

        Ok(Outcome::Done {
            withheld: !self.withheld.is_empty(),
            wrote,
        })
    }

    /// Queues the withheld taint's announcement if one is waiting; it waits on while the queue
    /// is full (it is sent once per change of the list, so dropping it would lose it for good).
    fn send_unsent(&mut self) {
        let Some(n) = self.unsent.take() else { return };
        match self.notices.try_send(n) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(n)) => {
                debug!("the notice queue is full; the withheld taint's Event waits");
                self.unsent = Some(n);
            }
            // The Event sink stopped: the agent is stopping.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Publishes a change in withheld taints: in the record, as a metric, and as one Event.
    fn note_withheld(&mut self, withheld: Option<(Vec<String>, u32, u32, u32)>) {
        let list = withheld.as_ref().map(|w| w.0.clone()).unwrap_or_default();
        self.metrics.taints_withheld.set(list.len() as i64);
        if list == self.withheld {
            return;
        }
        self.withheld = list.clone();
        self.unsent = None;
        match withheld {
            Some((taints, used, limit, nodes)) => {
                warn!(
                    ?taints,
                    used, limit, nodes, "taint budget spent: taint withheld"
                );
                let since = self.clock.now();
                self.report.send_replace(SinkReport {
                    taint_budget: Some(TaintBudgetStatus {
                        withheld: taints.clone(),
                        used,
                        limit,
                        nodes,
                        since,
                    }),
                });
                self.unsent = Some(Notice::TaintWithheld {
                    taints,
                    used,
                    limit,
                    nodes,
                });
                self.send_unsent();
            }
            None => {
                info!("no taint withheld any more");
                self.report.send_replace(SinkReport::default());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_core::policy::TaintEffect;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, NodeStatus, Taint};

    fn desired() -> Desired {
        Desired {
            labels: BTreeMap::from([("faultline.io/health".into(), "Unhealthy".into())]),
            taints: vec![DesiredTaint {
                key: "faultline.io/unhealthy".into(),
                value: "Xid79".into(),
                effect: TaintEffect::NoSchedule,
            }],
            condition: DesiredCondition {
                status: false,
                reason: "SeparateNPU".into(),
                message: "Xid79".into(),
            },
        }
    }

    fn taint(key: &str, value: &str) -> Taint {
        Taint {
            key: key.into(),
            value: Some(value.into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }
    }

    /// A Node as the sink leaves it for `desired()`, plus foreign labels, taints and conditions.
    fn carrying() -> Node {
        let mut n = Node::default();
        n.metadata.labels = Some(BTreeMap::from([
            ("faultline.io/health".into(), "Unhealthy".into()),
            ("kubernetes.io/hostname".into(), "n1".into()),
        ]));
        n.spec = Some(NodeSpec {
            taints: Some(vec![
                taint("example.com/maintenance", "planned"),
                taint("faultline.io/unhealthy", "Xid79"),
            ]),
            ..Default::default()
        });
        n.status = Some(NodeStatus {
            conditions: Some(vec![
                NodeCondition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    ..Default::default()
                },
                NodeCondition {
                    type_: "AcceleratorHealthy".into(),
                    status: "False".into(),
                    reason: Some("SeparateNPU".into()),
                    message: Some("Xid79".into()),
                    ..Default::default()
                },
            ]),
            ..Default::default()
        });
        n
    }

    fn taints_of(n: &mut Node) -> &mut Vec<Taint> {
        n.spec
            .get_or_insert_default()
            .taints
            .get_or_insert_default()
    }

    fn conditions_of(n: &mut Node) -> &mut Vec<NodeCondition> {
        n.status
            .get_or_insert_default()
            .conditions
            .get_or_insert_default()
    }

    /// A sink for n1 on `client`, asking `budget`, sending its notices to `notices`.
    fn sink_on(client: Client, budget: Budget, notices: mpsc::Sender<Notice>) -> NodeSink {
        NodeSink::new(
            client,
            KubeSinkConfig::new("n1"),
            budget,
            notices,
            watch::channel(SinkReport::default()).0,
            Arc::new(Metrics::new()),
            Arc::new(crate::clock::SystemClock),
        )
    }

    /// n1 as the emulator holds it.
    fn n1_in(emu: &faultline_kube_emulator::Emulator) -> Node {
        let n1 = emu.get(&faultline_kube_emulator::ResourceRef::node("n1"));
        serde_json::from_value(n1.unwrap()).unwrap()
    }

    /// The withheld taint is announced once per change of the list, so a notice queue that is
    /// full (the API unreachable long enough for 1,024 notices) must not drop it: it waits and
    /// goes out once there is room; a list that changes meanwhile replaces it.
    #[tokio::test]
    async fn the_withheld_taint_notice_waits_for_room_in_a_full_queue() {
        let emu = faultline_kube_emulator::Emulator::start().await.unwrap();
        let (client, _dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        let budget = Budget::new("n1", "127.0.0.1:9", None);
        let (tx, mut rx) = mpsc::channel(1);
        let mut sink = sink_on(client, budget, tx.clone());
        let filler = || Notice::TaintWithheld {
            taints: vec!["filler".into()],
            used: 0,
            limit: 0,
            nodes: 0,
        };
        let withheld = |t: &str| Some((vec![t.to_string()], 1, 1, 10));
        tx.try_send(filler()).unwrap();

        sink.note_withheld(withheld("a"));
        assert_eq!(rx.recv().await, Some(filler()));
        assert!(rx.try_recv().is_err(), "nothing sent into the full queue");
        sink.send_unsent();
        let Ok(Notice::TaintWithheld { taints, .. }) = rx.try_recv() else {
            panic!("the withheld taint was never announced");
        };
        assert_eq!(taints, ["a"]);
        sink.send_unsent();
        assert!(rx.try_recv().is_err(), "announced once");

        // Full again; the list changes twice before there is room: only the newest goes out.
        tx.try_send(filler()).unwrap();
        sink.note_withheld(withheld("b"));
        sink.note_withheld(withheld("c"));
        assert_eq!(rx.recv().await, Some(filler()));
        sink.send_unsent();
        let Ok(Notice::TaintWithheld { taints, .. }) = rx.try_recv() else {
            panic!("the newest list was never announced");
        };
        assert_eq!(taints, ["c"]);
        // Withheld and then released while the queue is full: nothing stale is announced.
        tx.try_send(filler()).unwrap();
        sink.note_withheld(withheld("d"));
        sink.note_withheld(None);
        assert_eq!(rx.recv().await, Some(filler()));
        sink.send_unsent();
        assert!(rx.try_recv().is_err(), "a released list is not announced");
    }

    /// A coordinator that answers every admission with `allowed`, and counts them, checking
    /// that each carries the agent's token and names n1.
    #[derive(Clone)]
    struct Admits(Arc<std::sync::atomic::AtomicUsize>);

    #[tonic::async_trait]
    impl faultline_proto::v1::coordinator_server::Coordinator for Admits {
        async fn report(
            &self,
            _: tonic::Request<faultline_proto::v1::CheckReport>,
        ) -> Result<tonic::Response<faultline_proto::v1::ReportAck>, tonic::Status> {
            Err(tonic::Status::unimplemented("not used"))
        }
        async fn run(
            &self,
            _: tonic::Request<faultline_proto::v1::RunRequest>,
        ) -> Result<tonic::Response<faultline_proto::v1::RunResult>, tonic::Status> {
            Err(tonic::Status::unimplemented("not used"))
        }
        async fn admit(
            &self,
            r: tonic::Request<faultline_proto::v1::AdmitRequest>,
        ) -> Result<tonic::Response<faultline_proto::v1::AdmitReply>, tonic::Status> {
            let bearer = r.metadata().get("authorization").unwrap().to_str().unwrap();
            assert_eq!(bearer, format!("Bearer {TOKEN}"));
            let r = r.into_inner();
            assert_eq!(r.node, "n1");
            assert_eq!(
                r.auth.unwrap().receiver,
                faultline_proto::auth::COORDINATOR_ROLE
            );
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(tonic::Response::new(faultline_proto::v1::AdmitReply {
                allowed: true,
                used: 1,
                limit: 1,
                nodes: 1,
            }))
        }
    }

    const TOKEN: &str = "n1's projected token, 0123456789abcdef";

    /// A new fault on a node whose taint needs the budget: the label and the condition are
    /// written before the coordinator is asked, and stay written when none answers (the pass
    /// fails and is retried, the taint waits); the next pass, with the coordinator answering,
    /// adds only the taint. A new fault costs three node writes in all, and no write of any
    /// ConfigMap of the budget's: a budget under contention or refused holds back only the taint.
    #[tokio::test]
    async fn the_label_and_condition_are_written_before_the_budget_is_asked() {
        use faultline_kube_emulator::Emulator;
        let emu = Emulator::start().await.unwrap();
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "faultline-system"}}));
        emu.put(faultline_kube_emulator::node("n1", &[]));
        let (client, dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        let token = dir.path().join("token");
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        // Nobody answers at the coordinator's address yet.
        let address = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let budget = Budget::new("n1", &address.to_string(), Some(token));
        let (tx, _rx) = mpsc::channel(8);
        let mut sink = sink_on(client, budget, tx);
        let node = || n1_in(&emu);

        let d = desired();
        let first = sink.reconcile(&d, None).await;
        assert!(
            matches!(&first, Err(KubeSinkError::Budget(why)) if why.contains(&address.to_string())),
            "the pass fails, to be retried: {first:?}"
        );
        let n = node();
        assert!(
            d.carried_by(&n, true, Timestamp::UNIX_EPOCH),
            "label and condition written, the taint waits: {n:?}"
        );
        assert!(
            !d.carried_by(&n, false, Timestamp::UNIX_EPOCH),
            "no taint yet"
        );
        let writes: Vec<String> = emu
            .calls()
            .iter()
            .filter(|c| c.is_write())
            .map(|c| c.path.clone())
            .collect();
        assert_eq!(writes, ["/api/v1/nodes/n1", "/api/v1/nodes/n1/status"]);

        // A coordinator answers: the taint follows, and nothing else is written again.
        let listener = tokio::net::TcpListener::bind(address).await.unwrap();
        let admits = Admits(Arc::default());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(
                    faultline_proto::v1::coordinator_server::CoordinatorServer::new(admits.clone()),
                )
                .serve_with_incoming(crate::listen::incoming(
                    listener,
                    crate::listen::PEER_LIMITS,
                    Arc::new(Metrics::new()),
                    "coordinator",
                )),
        );
        emu.clear_calls();
        let second = sink.reconcile(&d, None).await.unwrap();
        assert_eq!(
            second,
            Outcome::Done {
                withheld: false,
                wrote: true
            }
        );
        assert!(d.carried_by(&node(), false, Timestamp::UNIX_EPOCH));
        assert_eq!(admits.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        let writes: Vec<String> = emu
            .calls()
            .iter()
            .filter(|c| c.is_write())
            .map(|c| c.path.clone())
            .collect();
        assert_eq!(writes, ["/api/v1/nodes/n1"], "the taint alone");
    }

    /// A pass reads the Node only when the watched one is not the version the sink itself wrote
    /// or read last: a new fault on a Node nobody else changed costs its writes alone, and a
    /// Node changed by someone else since, or a watch behind the sink's own last write, is read
    /// first (a withheld taint's rechecks, at 2,000 nodes failing at once, read nothing).
    #[tokio::test]
    async fn the_node_is_read_only_when_the_watch_is_not_at_the_sinks_last_version() {
        use faultline_kube_emulator::Emulator;
        let emu = Emulator::start().await.unwrap();
        emu.put(faultline_kube_emulator::node("n1", &[]));
        let (client, _dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        let budget = Budget::new("n1", "127.0.0.1:9", None);
        let (tx, _rx) = mpsc::channel(8);
        let mut sink = sink_on(client, budget, tx);
        let node = || n1_in(&emu);
        // Taints need no admission here: the budget is not what this test is about.
        let healthy = Desired {
            labels: BTreeMap::from([("faultline.io/health".into(), "Healthy".into())]),
            taints: Vec::new(),
            condition: DesiredCondition {
                status: true,
                reason: "AcceleratorsHealthy".into(),
                message: "ok".into(),
            },
        };
        let unhealthy = Desired {
            taints: Vec::new(),
            ..desired()
        };
        let calls = || -> Vec<String> {
            emu.calls()
                .iter()
                .map(|c| format!("{} {}", c.method, c.path))
                .collect()
        };
        let done = Outcome::Done {
            withheld: false,
            wrote: true,
        };

        // Nothing watched yet: read, then written.
        assert_eq!(sink.reconcile(&healthy, None).await.unwrap(), done);
        assert_eq!(
            calls(),
            [
                "GET /api/v1/nodes/n1",
                "PATCH /api/v1/nodes/n1",
                "PATCH /api/v1/nodes/n1/status"
            ]
        );
        // The watch delivers the sink's own last write: a new fault is written without a read.
        let echo = node();
        emu.clear_calls();
        assert_eq!(
            sink.reconcile(&unhealthy, Some(Arc::new(echo.clone())))
                .await
                .unwrap(),
            done
        );
        assert_eq!(
            calls(),
            ["PATCH /api/v1/nodes/n1", "PATCH /api/v1/nodes/n1/status"]
        );
        assert!(unhealthy.carried_by(&node(), false, Timestamp::UNIX_EPOCH));
        // A watch still behind that write: read first (the stale Node would have the label and
        // condition written again).
        emu.clear_calls();
        assert_eq!(
            sink.reconcile(&unhealthy, Some(Arc::new(echo)))
                .await
                .unwrap(),
            Outcome::Done {
                withheld: false,
                wrote: false
            }
        );
        assert_eq!(calls(), ["GET /api/v1/nodes/n1"]);
        // Someone else changes the Node (their version is none of the sink's): read first, so
        // what they did is seen.
        let mut theirs = node();
        theirs
            .metadata
            .labels
            .get_or_insert_default()
            .insert("faultline.io/health".into(), "Healthy".into());
        theirs.metadata.resource_version = None;
        emu.put(serde_json::to_value(&theirs).unwrap());
        let watched = node();
        emu.clear_calls();
        assert_eq!(
            sink.reconcile(&unhealthy, Some(Arc::new(watched)))
                .await
                .unwrap(),
            done
        );
        assert_eq!(calls(), ["GET /api/v1/nodes/n1", "PATCH /api/v1/nodes/n1"]);
        assert!(unhealthy.carried_by(&node(), false, Timestamp::UNIX_EPOCH));
        // The watch at the sink's version, but the sink's own last read older than a resync
        // interval (a watch that fails keeps its last copy): read.
        let watched = node();
        emu.clear_calls();
        sink.cfg.resync = Duration::ZERO;
        sink.reconcile(&unhealthy, Some(Arc::new(watched)))
            .await
            .unwrap();
        assert_eq!(calls(), ["GET /api/v1/nodes/n1"]);
    }

    /// A label someone removes after the sink's last read, while the watch still holds that
    /// read, is carried into the result of the sink's next write (a condition here), which the
    /// pass does not check: when the watch delivers that result, the sink's own latest version,
    /// it is drift. The sink's earlier versions are not.
    #[tokio::test]
    async fn the_sinks_own_latest_version_is_drift_when_it_lacks_what_is_desired() {
        let emu = faultline_kube_emulator::Emulator::start().await.unwrap();
        emu.put(faultline_kube_emulator::node("n1", &[]));
        let (client, _dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        let budget = Budget::new("n1", "127.0.0.1:9", None);
        let mut sink = sink_on(client, budget, mpsc::channel(8).0);
        let first = Desired {
            taints: Vec::new(),
            ..desired()
        };
        sink.reconcile(&first, None).await.unwrap();
        let echo = n1_in(&emu);
        assert!(!sink.drifted(&echo, &first));
        // Someone takes the label away; the watch has not delivered it.
        let mut theirs = echo.clone();
        theirs.metadata.labels = None;
        theirs.metadata.resource_version = None;
        emu.put(serde_json::to_value(&theirs).unwrap());
        // A new condition: written from the watch's copy, which has the label.
        let second = Desired {
            condition: DesiredCondition {
                message: "Xid79 and Xid48".into(),
                ..first.condition.clone()
            },
            ..first.clone()
        };
        sink.reconcile(&second, Some(Arc::new(echo.clone())))
            .await
            .unwrap();
        let result = n1_in(&emu);
        assert!(
            !second.carried_by(&result, false, Timestamp::UNIX_EPOCH),
            "the write kept their change: {:?}",
            result.metadata.labels
        );
        assert!(
            sink.drifted(&result, &second),
            "the sink's own latest version lacks the label: drift"
        );
        assert!(
            !sink.drifted(&echo, &second),
            "an earlier version of the sink's own is not"
        );
    }

    /// What counts as drift: only faultline's own label, taints and condition; a hard taint the
    /// budget withholds is not drift.
    #[test]
    fn drift_is_a_change_to_what_faultline_owns() {
        let now = Timestamp::UNIX_EPOCH;
        let d = desired();
        assert!(d.carried_by(&carrying(), false, now));

        let mut foreign = carrying();
        taints_of(&mut foreign).remove(0);
        foreign
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .remove("kubernetes.io/hostname");
        conditions_of(&mut foreign).remove(0);
        assert!(
            d.carried_by(&foreign, false, now),
            "foreign changes are not drift"
        );

        let mut no_taint = carrying();
        taints_of(&mut no_taint).pop();
        assert!(!d.carried_by(&no_taint, false, now), "own taint removed");
        assert!(d.carried_by(&no_taint, true, now), "withheld by the budget");

        let mut wrong_value = carrying();
        taints_of(&mut wrong_value)[1] = taint("faultline.io/unhealthy", "Xid48");
        assert!(!d.carried_by(&wrong_value, true, now), "own taint changed");

        let mut extra = carrying();
        taints_of(&mut extra).push(taint("faultline.io/degraded", "x"));
        assert!(
            !d.carried_by(&extra, false, now),
            "an own taint added by someone else"
        );

        let mut label = carrying();
        label
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("faultline.io/health".into(), "Healthy".into());
        assert!(!d.carried_by(&label, false, now), "own label changed");

        let mut cond = carrying();
        conditions_of(&mut cond).pop();
        assert!(!d.carried_by(&cond, false, now), "own condition removed");

        assert!(
            !d.carried_by(&Node::default(), false, now),
            "a bare re-registered node"
        );
    }

    /// The watch is how the sink hears of others' changes, not what lets it write: with list
    /// and watch denied by RBAC (get and patch allowed), the sink still labels the Node at
    /// once, and follows a later snapshot, from its own reads of the Node.
    #[tokio::test]
    async fn the_sink_writes_without_the_watch() {
        use faultline_kube_emulator::{Rule, UserInfo};
        let emu = faultline_kube_emulator::Emulator::start().await.unwrap();
        emu.put(faultline_kube_emulator::node("n1", &[]));
        let (client, _dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        let allowed = Rule::new(
            &["get", "patch", "update"],
            &[""],
            &["nodes", "nodes/status"],
        );
        emu.authorize("t", UserInfo::new("agent"), vec![allowed]);
        let (tx, _rx) = mpsc::channel(64);
        let budget = Budget::new("n1", "127.0.0.1:9", None);
        let mut sink = sink_on(client.clone(), budget, tx);
        // Healthier states wait for the settle time after a start; none here.
        sink.cfg.settle = Duration::ZERO;
        let nodes = controller(
            Api::all(client.clone()),
            Api::all(client),
            "n1",
            Arc::new(crate::clock::SystemClock),
        );
        let (snapshots, rx) = watch::channel(None);
        let task = tokio::spawn(sink.run(nodes, rx));
        let health = |emu: &faultline_kube_emulator::Emulator| {
            n1_in(emu)
                .metadata
                .labels
                .unwrap_or_default()
                .get("faultline.io/health")
                .cloned()
        };
        for (revision, want) in [(1, "Unhealthy"), (2, "Healthy")] {
            let mut s = crate::engine_loop::test_snapshot(revision, 0);
            s.labels = BTreeMap::from([("faultline.io/health".into(), want.into())]);
            snapshots.send_replace(Some(s));
            let mut waited = Duration::ZERO;
            while health(&emu).as_deref() != Some(want) {
                assert!(waited < Duration::from_secs(10), "never labelled {want}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                waited += Duration::from_millis(50);
            }
        }
        drop(snapshots);
        task.await.unwrap();
    }
}
