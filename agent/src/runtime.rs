//! The engine loop: applies inputs from every source to the engine, in order, and publishes a
//! [`Snapshot`] on a `watch` channel whenever the visible state changed.
//!
//! This is the only place that owns the engine; sources and sinks talk to it through channels.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use faultline_core::time::Timestamp;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

use crate::metrics::{HandlingLabel, KindLabel, Metrics};
use crate::source::Input;
use faultline_core::catalog::Catalog;
use faultline_core::engine::{
    Ctx, DesiredCondition, DesiredTaint, DetectorState, Engine, EngineEvent, Observation,
};
use faultline_core::policy::LoadedPolicy;
use faultline_core::record::{
    check_code, AgentStatus, DetectorStatus, Handling, Health, NodeRecord, TaintBudgetStatus,
    API_VERSION,
};

/// Wall-clock time, injectable for tests.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Timestamp;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// What the agent saves across restarts (`state.json` in the state directory).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedState {
    pub version: u32,
    /// The last kernel log record whose effects are in `engine` (same boot only).
    pub kmsg_cursor: Option<u64>,
    pub engine: Engine,
}

pub const STATE_VERSION: u32 = 1;

/// What sinks see.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Increases with every published snapshot (engine changes and policy status changes).
    pub revision: u64,
    pub record: Arc<NodeRecord>,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<DesiredTaint>,
    pub condition: DesiredCondition,
    /// The highest [`Input::Marker`] applied before this snapshot.
    pub marker: u64,
    /// The devices each polled source last reported, by kind (the engine's view).
    pub inventory: Arc<BTreeMap<String, BTreeSet<String>>>,
    /// Active faults waiting out a recovery hold, as `(device, fault_code)` (the engine's view).
    pub recovering: Arc<BTreeSet<(String, String)>>,
    pub state: Arc<PersistedState>,
    /// When the newest input in this snapshot was applied (for latency metrics).
    pub applied_at: std::time::Instant,
}

/// Liveness of the engine loop, for `/healthz`.
#[derive(Debug, Default)]
pub struct Heartbeat(AtomicI64);

impl Heartbeat {
    pub fn beat(&self, now: Timestamp) {
        self.0.store(now.as_millisecond(), Ordering::Relaxed);
    }
    /// When the last beat was, if there was one.
    pub fn last(&self) -> Option<Timestamp> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            ms => Timestamp::from_millisecond(ms).ok(),
        }
    }
    /// Milliseconds since the last beat.
    pub fn age_ms(&self, now: Timestamp) -> i64 {
        now.as_millisecond() - self.0.load(Ordering::Relaxed)
    }
}

/// What sinks report about themselves; shown in the record's `agent` block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SinkReport {
    /// Set while the Kubernetes node sink withholds a taint (taint budget spent).
    pub taint_budget: Option<TaintBudgetStatus>,
}

/// Everything the engine loop needs.
#[derive(Debug)]
pub struct EngineLoop {
    pub node: String,
    pub engine: Engine,
    pub kmsg_cursor: Option<u64>,
    /// The highest [`Input::Marker`] applied.
    pub marker: u64,
    pub catalog: Arc<Catalog>,
    pub policy: watch::Receiver<LoadedPolicy>,
    pub inputs: mpsc::Receiver<Input>,
    pub snapshots: watch::Sender<Option<Snapshot>>,
    pub metrics: Arc<Metrics>,
    pub clock: Arc<dyn Clock>,
    pub heartbeat: Arc<Heartbeat>,
    pub tick: Duration,
    /// Engine events for the Kubernetes Event sink (Kubernetes mode only). Never blocks: when
    /// the sink is far behind, events are dropped and counted.
    pub events: Option<mpsc::Sender<EngineEvent>>,
    /// Sink reports to show in the record (a sender that is never used is fine).
    pub sink_report: watch::Receiver<SinkReport>,
    /// What the file sink last managed: shown as the `record-file` detector (down while
    /// writes fail, running once one succeeds).
    pub record_writer: watch::Receiver<crate::sink::file::RecordStatus>,
    pub shutdown: CancellationToken,
}

/// Most inputs applied before a snapshot is published.
const BATCH: usize = 4096;

impl EngineLoop {
    /// Runs until shutdown; then applies what is already queued and publishes a final snapshot.
    pub async fn run(self) {
        let span = tracing::info_span!("engine", node = %self.node);
        self.run_inner().instrument(span).await
    }

    async fn run_inner(mut self) {
        let mut published = u64::MAX;
        let mut published_marker = self.marker;
        let mut seq = 0u64;
        let mut tick = tokio::time::interval(self.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut loaded = self.policy.borrow_and_update().clone();
        let mut report = self.sink_report.borrow_and_update().clone();
        loop {
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => break,
                Ok(()) = self.sink_report.changed() => {
                    let next = self.sink_report.borrow_and_update().clone();
                    if next != report {
                        report = next;
                        published = u64::MAX;
                    }
                }
                Ok(()) = self.record_writer.changed() => {
                    use crate::sink::file::RecordStatus;
                    let detector = match self.record_writer.borrow_and_update().clone() {
                        RecordStatus::NotYetWritten => None,
                        RecordStatus::Written => Some((DetectorState::Running, None)),
                        RecordStatus::Failing(why) => Some((DetectorState::Down, Some(why))),
                    };
                    if let Some((state, reason)) = detector {
                        let name = crate::sink::file::RECORD_DETECTOR.into();
                        let obs = Observation::Detector { name, state, reason };
                        self.apply(&loaded, Input::Obs(obs));
                    }
                }
                Ok(()) = self.policy.changed() => {
                    let next = self.policy.borrow_and_update().clone();
                    let policy_changed = next.policy != loaded.policy;
                    loaded = next;
                    if policy_changed {
                        let ctx = Ctx { policy: &loaded.policy, catalog: &self.catalog };
                        let events = self.engine.reclassify(ctx);
                        self.note(&events);
                    }
                    published = u64::MAX; // the policy status is part of the record
                }
                input = self.inputs.recv() => {
                    let Some(first) = input else { break };
                    self.apply(&loaded, first);
                    let mut n = 1;
                    while n < BATCH {
                        match self.inputs.try_recv() {
                            Ok(i) => { self.apply(&loaded, i); n += 1; }
                            Err(_) => break,
                        }
                    }
                }
                _ = tick.tick() => self.apply(&loaded, Input::Obs(Observation::Tick)),
            }
            self.heartbeat.beat(self.clock.now());
            // A marker is published even when nothing else changed: its sender waits for it.
            if self.engine.revision() != published || self.marker != published_marker {
                published = self.engine.revision();
                published_marker = self.marker;
                seq += 1;
                self.publish(&loaded, &report, seq);
            }
        }
        // Shutdown: nothing queued is dropped.
        while let Ok(i) = self.inputs.try_recv() {
            self.apply(&loaded, i);
        }
        self.publish(&loaded, &report, seq + 1);
        info!(revision = self.engine.revision(), "engine stopped");
    }

    fn apply(&mut self, loaded: &LoadedPolicy, input: Input) {
        self.metrics.engine_inputs.inc();
        match input {
            Input::KmsgCursor(seq) => self.kmsg_cursor = Some(seq),
            Input::Marker(m) => self.marker = self.marker.max(m),
            Input::Kmsg { obs, seq } => {
                // One step: no snapshot can hold this fault without the cursor covering it.
                self.step(loaded, obs);
                self.kmsg_cursor = Some(seq);
            }
            Input::Obs(obs) => self.step(loaded, obs),
        }
    }

    fn step(&mut self, loaded: &LoadedPolicy, obs: Observation) {
        let ctx = Ctx {
            policy: &loaded.policy,
            catalog: &self.catalog,
        };
        let events = self.engine.step(ctx, obs, self.clock.now());
        self.note(&events);
    }

    fn note(&self, events: &[EngineEvent]) {
        for e in events {
            if let Some(tx) = &self.events {
                if tx.try_send(e.clone()).is_err() {
                    self.metrics.events_dropped.inc();
                }
            }
            let kind = match e {
                EngineEvent::NewFault {
                    code,
                    device,
                    handling,
                    message,
                } => {
                    warn!(code = %code, device = %device, handling = %handling, text = %message, "new fault");
                    "new_fault"
                }
                EngineEvent::Escalated {
                    code,
                    device,
                    from,
                    to,
                    rule,
                } => {
                    warn!(code = %code, device = %device, from = %from, to = %to, rule = %rule, "fault escalated");
                    "escalated"
                }
                EngineEvent::Recovered {
                    code,
                    device,
                    reason,
                } => {
                    info!(code = %code, device = %device, reason = %reason, "fault recovered");
                    "recovered"
                }
                EngineEvent::Reclassified {
                    code,
                    device,
                    from,
                    to,
                } => {
                    info!(code = %code, device = %device, from = %from, to = %to, "fault reclassified by policy");
                    "reclassified"
                }
                EngineEvent::HealthChanged { from, to } => {
                    warn!(from = %from, to = %to, "node health changed");
                    "health_changed"
                }
            };
            self.metrics
                .engine_events
                .get_or_create(&KindLabel { kind })
                .inc();
        }
    }

    fn publish(&self, loaded: &LoadedPolicy, report: &SinkReport, seq: u64) {
        let view = self.engine.view(&loaded.policy);
        let now = self.clock.now();
        let detectors = self
            .engine
            .detectors()
            .iter()
            .map(|(name, d)| DetectorStatus {
                name: name.clone(),
                state: d.state.as_str().to_string(),
                reason: d.reason.clone(),
            })
            .collect();
        for h in Handling::ALL {
            let n = view
                .faults
                .iter()
                .filter(|f| f.active && f.fault_handling == h)
                .count();
            self.metrics
                .faults_active
                .get_or_create(&HandlingLabel {
                    handling: h.as_str(),
                })
                .set(n as i64);
        }
        self.metrics.node_health.set(match view.health {
            Health::Healthy => 0,
            Health::Degraded => 1,
            Health::Unhealthy => 2,
        });
        for (name, d) in self.engine.detectors() {
            let up = i64::from(d.state == faultline_core::engine::DetectorState::Running);
            self.metrics
                .detector_up
                .get_or_create(&crate::metrics::DetectorLabel {
                    detector: name.clone(),
                })
                .set(up);
        }
        let record = NodeRecord {
            api_version: API_VERSION.to_string(),
            node: self.node.clone(),
            health: view.health,
            handling: view.handling,
            update_time: now,
            check_code: check_code(&view.faults),
            faults: view.faults,
            dropped_faults: view.dropped_faults,
            agent: AgentStatus {
                version: env!("CARGO_PKG_VERSION").to_string(),
                policy: loaded.status.clone(),
                detectors,
                taint_budget: report.taint_budget.clone(),
                heartbeat_time: None,
            },
        };
        debug!(revision = self.engine.revision(), health = %record.health, "publishing snapshot");
        let snap = Snapshot {
            revision: seq,
            record: Arc::new(record),
            labels: view.labels,
            taints: view.taints,
            condition: view.condition,
            marker: self.marker,
            inventory: Arc::new(view.inventory),
            recovering: Arc::new(view.recovering),
            state: Arc::new(PersistedState {
                version: STATE_VERSION,
                kmsg_cursor: self.kmsg_cursor,
                engine: self.engine.clone(),
            }),
            applied_at: std::time::Instant::now(),
        };
        self.snapshots.send_replace(Some(snap));
    }
}
