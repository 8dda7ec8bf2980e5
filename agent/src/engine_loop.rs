//! The engine loop: applies inputs from every source to the engine, in order, and publishes a
//! [`Snapshot`] on a `watch` channel whenever the visible state changed.
//!
//! This is the only place that owns the engine; sources and sinks talk to it through channels.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use faultline_core::time::{shift, SignedDuration, Timeline, Timestamp};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

use crate::clear::{AppliedClears, ClearApplied, ClearResult};
use crate::clock::Clock;
use crate::metrics::{ActiveFaultLabel, FaultLabel, HandlingLabel, KindLabel, Metrics};
use crate::source::Input;
use faultline_core::catalog::Catalog;
use faultline_core::engine::{
    Ctx, DesiredCondition, DesiredTaint, DetectorState, Engine, EngineEvent, KmsgPosition,
    Observation,
};
use faultline_core::policy::LoadedPolicy;
use faultline_core::record::{
    check_code, AgentStatus, DetectorStatus, Handling, Health, NodeRecord, TaintBudgetStatus,
    API_VERSION,
};

/// What the agent saves across restarts (`state.json` in the data directory, `--data-dir`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedState {
    pub version: u32,
    /// The last kernel log record whose effects are in `engine` (same boot only).
    pub kmsg_cursor: Option<u64>,
    /// With `kmsg_cursor`: how many records after that one without a usable sequence number
    /// are in `engine` too (the cursor is a [`KmsgPosition`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kmsg_unsequenced: u64,
    /// With `kmsg_cursor`: the log it is in ([`KmsgPosition::log`]: a file's identity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kmsg_log: Option<u64>,
    /// With `kmsg_cursor`, in a regular file: how many bytes of it were read, and a hash of
    /// them ([`KmsgPosition::read`]): a file that no longer starts with them is another log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kmsg_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kmsg_hash: Option<u64>,
    /// The boot time of the boot that wrote this (`/proc/stat` `btime`, seconds since the
    /// epoch): tells a restart within the boot when the boot id cannot be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_time: Option<i64>,
    pub engine: Engine,
    /// The engine's timeline in the boot that wrote this (a restart in the same boot goes on
    /// with it). `None`: a new one is anchored.
    #[serde(default)]
    pub timeline: Option<Timeline>,
    /// The taint budget's last answer (the taints it withholds and since when), so that a
    /// reboot, which empties the record's directory, does not announce a withheld taint again.
    #[serde(default)]
    pub taint_budget: Option<TaintBudgetStatus>,
    /// The node whose state this is. A state of another node (a data directory another agent
    /// used), or of none, is set aside at start, never restored. `None` only in a default value
    /// that is never saved: the file sink always writes the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The clear requests applied lately, with what each did: a request found again after a
    /// restart is answered from here, not applied again.
    #[serde(default)]
    pub clears: AppliedClears,
}

pub(crate) const STATE_VERSION: u32 = 1;

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl PersistedState {
    /// Where the kernel-log reader was: every record in it is in `engine`.
    pub fn kmsg_position(&self) -> Option<KmsgPosition> {
        let p = KmsgPosition {
            seq: self.kmsg_cursor,
            unsequenced: self.kmsg_unsequenced,
            log: self.kmsg_log,
            read: self
                .kmsg_bytes
                .zip(self.kmsg_hash)
                .map(|(bytes, hash)| faultline_core::kmsg_reader::Extent { bytes, hash }),
        };
        (!p.is_start()).then_some(p)
    }
}

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
    pub state: Arc<PersistedState>,
    /// The newest revision (this one or an earlier one; 0: none in this run) holding a change
    /// that a restart would not make again: anything but a record of a kernel log that replays
    /// (an operator's clear, a policy reload, a polled source's report, a sink's report). The
    /// file sink writes a record that holds such a change only after the state that holds it
    /// ([`crate::sink::file`]); a record whose changes since the last saved state all come from
    /// the kernel log goes first, and its state right after.
    pub save_first: u64,
    /// When the newest input in this snapshot was applied, on [`Clock::instant`] (for latency
    /// metrics).
    pub applied_at: tokio::time::Instant,
}

/// Liveness of the engine loop, for `/healthz`: its age is measured since boot (a wall-clock
/// step neither kills nor revives it); the wall-clock time is kept for display only.
#[derive(Debug, Default)]
pub struct Heartbeat {
    wall_ms: AtomicI64,
    /// Milliseconds since boot at the last beat, plus one (0: never beat).
    boot_ms: AtomicI64,
}

impl Heartbeat {
    pub(crate) fn beat(&self, clock: &dyn Clock) {
        self.wall_ms
            .store(clock.now().as_millisecond(), Ordering::Relaxed);
        self.boot_ms.store(boot_ms(clock) + 1, Ordering::Relaxed);
    }
    /// When the last beat was, by the wall clock, if there was one.
    pub(crate) fn last(&self) -> Option<Timestamp> {
        match self.boot_ms.load(Ordering::Relaxed) {
            0 => None,
            _ => Timestamp::from_millisecond(self.wall_ms.load(Ordering::Relaxed)).ok(),
        }
    }
    /// Milliseconds since the last beat (`i64::MAX` before the first).
    pub(crate) fn age_ms(&self, clock: &dyn Clock) -> i64 {
        match self.boot_ms.load(Ordering::Relaxed) {
            0 => i64::MAX,
            b => boot_ms(clock) + 1 - b,
        }
    }
}

fn boot_ms(clock: &dyn Clock) -> i64 {
    i64::try_from(clock.since_boot().as_millis()).unwrap_or(i64::MAX - 1)
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
    /// The engine's time: `timeline.at(clock.since_boot())`.
    pub timeline: Timeline,
    pub kmsg_cursor: Option<KmsgPosition>,
    /// Saved with the state: [`PersistedState::boot_time`].
    pub boot_time: Option<i64>,
    /// The highest [`Input::Marker`] applied.
    pub marker: u64,
    /// The clear requests applied lately (restored with the state).
    pub clears: AppliedClears,
    /// Where the report on each [`Input::Clear`] goes (the clear requests' source). Never
    /// blocks; one report per request the source sent.
    pub clear_results: mpsc::UnboundedSender<ClearApplied>,
    pub catalog: Arc<Catalog>,
    pub policy: watch::Receiver<LoadedPolicy>,
    pub inputs: mpsc::Receiver<Input>,
    pub snapshots: watch::Sender<Option<Snapshot>>,
    pub metrics: Arc<Metrics>,
    pub clock: Arc<dyn Clock>,
    pub heartbeat: Arc<Heartbeat>,
    /// How often the loop beats ([`Heartbeat`], what `/healthz` and the record's heartbeat
    /// read) when nothing else wakes it. The engine itself is ticked only at its next deadline
    /// ([`Engine::next_deadline`]), never on this beat.
    pub liveness: Duration,
    /// Engine events for the Kubernetes Event sink (Kubernetes mode only). Never blocks: when
    /// the sink is far behind, events are dropped and counted.
    pub events: Option<mpsc::Sender<EngineEvent>>,
    /// Sink reports to show in the record (a sender that is never used is fine).
    pub sink_report: watch::Receiver<SinkReport>,
    /// What the file sink last managed: shown as the `record-file` detector (down while
    /// writes fail, running once one succeeds).
    pub record_writer: watch::Receiver<RecordStatus>,
    pub shutdown: CancellationToken,
}

/// Whether the changes not yet published could be made again by a restart (see
/// [`Snapshot::save_first`]).
#[derive(Debug, Default)]
struct Replay {
    /// The kernel log read now replays ([`Input::KmsgReplays`]); until the source says so, its
    /// records count as not replayed.
    kmsg: bool,
    /// A change since the last snapshot that a restart would not make again.
    unreplayed: bool,
}

/// Whether applying `input` can bring the engine's next deadline forward even when it causes no
/// event: anything but a repeat of a fault (which only moves deadlines later) and the loop's
/// own bookkeeping. See [`Engine::next_deadline`].
fn moves_deadline(input: &Input) -> bool {
    match input {
        Input::Obs(Observation::Signal(_))
        | Input::Kmsg {
            obs: Observation::Signal(_),
            ..
        }
        | Input::Marker(_)
        | Input::KmsgCursor(_)
        | Input::KmsgReplays(_) => false,
        Input::Obs(_) | Input::Kmsg { .. } | Input::Clear { .. } => true,
    }
}

/// What the file sink last managed with the record: `/readyz` is 200 while it is `Written`,
/// and the engine loop shows `Failing` as the `record-file` detector being down.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum RecordStatus {
    /// Nothing written yet in this run.
    #[default]
    NotYetWritten,
    /// The newest record is on disk.
    Written,
    /// The last write failed: why (the first failure's reason, until a write succeeds).
    Failing(String),
}

impl RecordStatus {
    pub(crate) fn is_written(&self) -> bool {
        *self == RecordStatus::Written
    }
}

/// The engine loop beats every tick; this long without a beat means it is stuck (`/healthz`,
/// and the file sink's heartbeat).
pub(crate) const STALE_MS: i64 = 30_000;

/// How often an idle engine loop beats: three beats within the [`STALE_MS`] that
/// `/healthz` allows, as the record's heartbeat fits three in its readers' 30 s.
pub(crate) const LIVENESS: Duration = Duration::from_millis(STALE_MS as u64 / 3);

/// Most inputs applied before a snapshot is published.
const BATCH: usize = 4096;

/// Changes that only move counts and last-seen times (a repeating fault) are published at most
/// this often; anything an engine event announces (a new, escalated or recovered fault, a health
/// change), a marker a source waits for, a policy or sink-report change is published at once.
/// A snapshot costs a pass over every fault (the view, the saved state); published after every
/// batch, a storm with 450 standing faults cost 30 us per record against 6.6 us with 20.
pub(crate) const PUBLISH_EVERY: Duration = Duration::from_millis(100);

impl EngineLoop {
    /// Runs until shutdown; then applies what is already queued and publishes a final snapshot.
    pub async fn run(self) {
        let span = tracing::info_span!("engine", node = %self.node);
        self.run_inner().instrument(span).await
    }

    async fn run_inner(mut self) {
        // What the last snapshot held: the engine's revision and the marker.
        let mut published = (self.engine.revision(), self.marker);
        let mut seq = 0u64;
        let mut replay = Replay::default();
        // The newest snapshot with a change a restart would not make again.
        let mut save_first = 0u64;
        let mut loaded = self.policy.borrow_and_update().clone();
        // What was restored was classified under the policy of the run that saved it: it is
        // classified again under the policy in force, as a reload does. Not while a policy file
        // is still being read: the built-in policy stands in only for what is new meanwhile (a
        // restored operator-held fault must not be judged by it), and the file's policy
        // classifies everything once read, changed or not.
        let mut restored_classified = false;
        if loaded.status.loading.is_none() {
            self.reclassify(&loaded);
            restored_classified = true;
        }
        // What was restored and how it is classified now: saved before it is shown.
        replay.unreplayed = true;
        let mut report = self.sink_report.borrow_and_update().clone();
        let mut offset = SignedDuration::ZERO;
        // Publish at once, changed or not, rather than within `PUBLISH_EVERY`: an engine event,
        // a policy, sink-report or wall-clock change, and what was restored on the first pass.
        let mut urgent = true;
        let mut last_publish = self.clock.instant();
        // When time alone next changes the engine, as time since boot; computed again only
        // after what can bring it forward (see `moves_deadline`).
        let mut deadline: Option<Duration> = None;
        let mut replan = true;
        let clock = self.clock.clone();
        let mut batch = Vec::new();
        loop {
            if replan {
                deadline = self.next_deadline(&loaded);
                replan = false;
            }
            // A count-only change waits for `last_publish + PUBLISH_EVERY`.
            let waiting = self.engine.revision() != published.0;
            let (next, clock) = (deadline, &clock);
            let due = async move {
                match next {
                    Some(at) => clock.sleep_until_boot(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => break,
                _ = tokio::time::sleep_until(last_publish + PUBLISH_EVERY), if waiting => {}
                Ok(()) = self.sink_report.changed() => {
                    let next = self.sink_report.borrow_and_update().clone();
                    if next != report {
                        report = next;
                        urgent = true;
                        replay.unreplayed = true; // the withheld taints are saved
                    }
                }
                Ok(()) = self.record_writer.changed() => {
                    let detector = match self.record_writer.borrow_and_update().clone() {
                        RecordStatus::NotYetWritten => None,
                        RecordStatus::Written => Some((DetectorState::Running, None)),
                        RecordStatus::Failing(why) => Some((DetectorState::Down, Some(why))),
                    };
                    if let Some((state, reason)) = detector {
                        let name = crate::metrics::DETECTOR_RECORD_FILE.into();
                        let obs = Observation::Detector { name, state, reason };
                        replan = true;
                        urgent |= self.apply(&loaded, Input::Obs(obs), &mut replay);
                    }
                }
                Ok(()) = self.policy.changed() => {
                    replan = true;
                    let next = self.policy.borrow_and_update().clone();
                    let policy_changed = next.policy != loaded.policy;
                    loaded = next;
                    let first = !restored_classified && loaded.status.loading.is_none();
                    if policy_changed || first {
                        self.reclassify(&loaded);
                        restored_classified |= first;
                        replay.unreplayed = true;
                    }
                    urgent = true; // the policy status is part of the record
                }
                n = self.inputs.recv_many(&mut batch, BATCH) => {
                    if n == 0 {
                        break; // every source is gone
                    }
                    for input in batch.drain(..) {
                        replan |= moves_deadline(&input);
                        let eventful = self.apply(&loaded, input, &mut replay);
                        replan |= eventful;
                        urgent |= eventful;
                    }
                }
                () = due => {
                    replan = true;
                    urgent |= self.apply(&loaded, Input::Obs(Observation::Tick), &mut replay);
                }
                // Nothing else happened for a while: beat (below) and look at the wall clock.
                () = tokio::time::sleep(self.liveness) => {}
                // Urgent here only on the first pass (a later urgent change is published in
                // the pass that made it): what was restored is published without waiting.
                () = std::future::ready(()), if urgent => {}
            }
            self.heartbeat.beat(&*self.clock);
            // A wall-clock step moves the faults' dates: publish them even if nothing else
            // changed, and save the offset for the next boot's timeline.
            let next = self.display_offset(offset);
            if next != offset {
                offset = next;
                self.timeline.wall_offset_ms = i64::try_from(offset.as_millis()).unwrap_or(0);
                urgent = true;
            }
            // A new marker is published at once, even alone: its sender waits for it. An engine
            // event always comes with a new revision, so `urgent` publishes it too.
            let current = (self.engine.revision(), self.marker);
            let now = self.clock.instant();
            if urgent
                || current.1 != published.1
                || (current.0 != published.0 && now >= last_publish + PUBLISH_EVERY)
            {
                published = current;
                seq += 1;
                if std::mem::take(&mut replay.unreplayed) {
                    save_first = seq;
                }
                self.publish(&loaded, &report, seq, offset, save_first);
                last_publish = now;
                urgent = false;
            }
        }
        // Shutdown: nothing queued is dropped.
        while let Ok(i) = self.inputs.try_recv() {
            self.apply(&loaded, i, &mut replay);
        }
        if replay.unreplayed {
            save_first = seq + 1;
        }
        self.publish(&loaded, &report, seq + 1, offset, save_first);
        info!(revision = self.engine.revision(), "engine stopped");
    }

    /// Applies one input; true when it caused an engine event (worth publishing at once). Notes
    /// in `replay` a change that a restart would not make again.
    fn apply(&mut self, loaded: &LoadedPolicy, input: Input, replay: &mut Replay) -> bool {
        self.metrics.engine_inputs.inc();
        let revision = self.engine.revision();
        // A record of a kernel log that replays is read again by a restart past the saved
        // cursor (the cursor only moves with the state that holds the record's effect).
        let replays = matches!(input, Input::Kmsg { .. } | Input::KmsgCursor(_)) && replay.kmsg;
        let eventful = self.apply_input(loaded, input, replay);
        if !replays && self.engine.revision() != revision {
            replay.unreplayed = true;
        }
        eventful
    }

    fn apply_input(&mut self, loaded: &LoadedPolicy, input: Input, replay: &mut Replay) -> bool {
        match input {
            Input::KmsgReplays(replays) => {
                replay.kmsg = replays;
                false
            }
            Input::KmsgCursor(at) => {
                self.kmsg_cursor = Some(at);
                false
            }
            Input::Marker(m) => {
                self.marker = self.marker.max(m);
                false
            }
            Input::Kmsg { obs, at } => {
                // One step: no snapshot can hold this fault without the cursor covering it.
                let eventful = self.step(loaded, obs);
                self.kmsg_cursor = Some(at);
                eventful
            }
            Input::Obs(obs) => self.step(loaded, obs),
            Input::Clear {
                request,
                code,
                device,
                marker,
            } => {
                let (result, eventful) = match self.clears.get(&request) {
                    Some(r) => {
                        info!(
                            request,
                            cleared = r.cleared,
                            "clear request already applied; answered, not applied again"
                        );
                        (r.clone(), false)
                    }
                    None => {
                        let ctx = Ctx {
                            policy: &loaded.policy,
                            catalog: &self.catalog,
                        };
                        let events = self.engine.step(
                            ctx,
                            Observation::OperatorClear { code, device },
                            self.engine_now(),
                        );
                        self.note(&events);
                        let r = ClearResult::of(&events);
                        self.clears.insert(request, r.clone());
                        // Saved before it is shown, even when it cleared nothing: its answer
                        // waits for the save, and a restart must find it applied.
                        replay.unreplayed = true;
                        (r, !events.is_empty())
                    }
                };
                self.marker = self.marker.max(marker);
                // The source may be gone (shutting down): nothing waits for the report then.
                let _ = self.clear_results.send(ClearApplied { marker, result });
                eventful
            }
        }
    }

    /// Classifies every fault under `loaded`'s policy (a reload, or what was restored).
    fn reclassify(&mut self, loaded: &LoadedPolicy) {
        let ctx = Ctx {
            policy: &loaded.policy,
            catalog: &self.catalog,
        };
        let events = self.engine.reclassify(ctx);
        self.note(&events);
    }

    fn step(&mut self, loaded: &LoadedPolicy, obs: Observation) -> bool {
        let ctx = Ctx {
            policy: &loaded.policy,
            catalog: &self.catalog,
        };
        let events = self.engine.step(ctx, obs, self.engine_now());
        self.note(&events);
        for r in self.engine.reports() {
            self.metrics
                .fault_occurrences
                .get_or_create(&self.fault_label(&loaded.policy, &r.code, &r.device))
                .inc_by(r.count);
        }
        !events.is_empty()
    }

    /// A fault's bounded labels: its code when the catalog or the policy defines it, its device
    /// when the node's inventory (or the fixed sets) has it, else `other` (docs/metrics.md).
    fn fault_label(
        &self,
        policy: &faultline_core::policy::Policy,
        code: &str,
        device: &str,
    ) -> FaultLabel {
        FaultLabel {
            code: crate::metrics::code_label(code, policy.defines(&self.catalog, code)),
            device: crate::metrics::device_label(code, device, self.engine.in_inventory(device)),
        }
    }

    /// When the engine next needs a tick ([`Engine::next_deadline`]), as time since boot.
    fn next_deadline(&self, loaded: &LoadedPolicy) -> Option<Duration> {
        let at = self
            .engine
            .next_deadline(&loaded.policy, self.engine_now())?;
        // The timeline's time is its anchor plus the time since boot; before boot is now.
        let since_boot = faultline_core::time::since(at, self.timeline.anchor);
        Some(Duration::try_from(since_boot).unwrap_or(Duration::ZERO))
    }

    /// The engine's time: on the boot's timeline, unmoved by wall-clock steps.
    fn engine_now(&self) -> Timestamp {
        self.timeline.at(self.clock.since_boot())
    }

    /// The offset that turns the engine's times into wall-clock dates for the record.
    fn display_offset(&self, current: SignedDuration) -> SignedDuration {
        faultline_core::time::display_offset(current, self.clock.now(), self.engine_now())
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

    /// Publishes a snapshot. The faults' dates are the engine's times shifted by `offset`
    /// (wall minus engine time): after a wall-clock step they read as the corrected clock would
    /// have dated them; without one, the offset is zero.
    fn publish(
        &self,
        loaded: &LoadedPolicy,
        report: &SinkReport,
        seq: u64,
        offset: SignedDuration,
        save_first: u64,
    ) {
        let mut view = self.engine.view(&loaded.policy);
        if !offset.is_zero() {
            for f in &mut view.faults {
                f.first_seen = shift(f.first_seen, offset);
                f.last_seen = shift(f.last_seen, offset);
                f.recovered_at = f.recovered_at.map(|t| shift(t, offset));
            }
        }
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
        let mut active: std::collections::HashMap<ActiveFaultLabel, i64> = Default::default();
        for f in view.faults.iter().filter(|f| f.active) {
            let FaultLabel { code, device } =
                self.fault_label(&loaded.policy, &f.fault_code, &f.device);
            let handling = f.fault_handling.as_str();
            *active
                .entry(ActiveFaultLabel {
                    code,
                    device,
                    handling,
                })
                .or_default() += 1;
        }
        self.metrics.fault_active.set_all(active);
        self.metrics.node_health.set(match view.health {
            Health::Healthy => 0,
            Health::Degraded => 1,
            Health::Unhealthy => 2,
        });
        for (name, d) in self.engine.detectors() {
            use faultline_core::engine::DetectorState;
            let up = i64::from(d.state == DetectorState::Running);
            self.metrics
                .detector_up
                .get_or_create(&crate::metrics::DetectorLabel {
                    detector: name.clone(),
                })
                .set(up);
            // Idle (nothing to watch here) and down both read 0 above; this tells them apart.
            for (state, label) in [
                (DetectorState::Running, "running"),
                (DetectorState::Starting, "starting"),
                (DetectorState::Idle, "idle"),
                (DetectorState::Down, "down"),
            ] {
                self.metrics
                    .detector_state
                    .get_or_create(&crate::metrics::DetectorStateLabel {
                        detector: name.clone(),
                        state: label,
                    })
                    .set(i64::from(d.state == state));
            }
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
                heartbeat_boot: None,
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
            state: Arc::new(PersistedState {
                version: STATE_VERSION,
                kmsg_cursor: self.kmsg_cursor.and_then(|c| c.seq),
                kmsg_unsequenced: self.kmsg_cursor.map_or(0, |c| c.unsequenced),
                kmsg_log: self.kmsg_cursor.and_then(|c| c.log),
                kmsg_bytes: self.kmsg_cursor.and_then(|c| c.read).map(|r| r.bytes),
                kmsg_hash: self.kmsg_cursor.and_then(|c| c.read).map(|r| r.hash),
                boot_time: self.boot_time,
                engine: self.engine.clone(),
                timeline: Some(self.timeline.clone()),
                taint_budget: report.taint_budget.clone(),
                node: Some(self.node.clone()),
                clears: self.clears.clone(),
            }),
            save_first,
            applied_at: self.clock.instant(),
        };
        self.snapshots.send_replace(Some(snap));
    }
}

/// A Healthy snapshot of node `n1` with no faults, for the sinks' unit tests: every call with
/// any revision holds the same record (the sinks compare content, not revisions).
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn test_snapshot(revision: u64, marker: u64) -> Snapshot {
    let record = r#"{"apiVersion":"faultline.io/v1","node":"n1","health":"Healthy","updateTime":"2026-11-22T01:02:03.000Z","checkCode":"x","faults":[],"agent":{"version":"0","policy":{"source":"builtin","checksum":"y"},"detectors":[]}}"#;
    Snapshot {
        revision,
        record: Arc::new(serde_json::from_str(record).unwrap()),
        labels: Default::default(),
        taints: Vec::new(),
        condition: faultline_core::engine::DesiredCondition {
            status: true,
            reason: "NoFaults".into(),
            message: String::new(),
        },
        marker,
        inventory: Default::default(),
        state: Arc::new(PersistedState::default()),
        // Saved first: nothing in it replays.
        save_first: revision,
        applied_at: crate::clock::SystemClock.instant(),
    }
}

#[cfg(test)]
mod tests {
    //! The engine loop against an injected clock whose wall time can be stepped while the time
    //! since boot runs on: a wall-clock step changes no verdict.

    use super::*;
    use faultline_core::catalog::FaultCode;
    use faultline_core::engine::{DeviceRef, Signal};
    use faultline_core::record::Source;

    use crate::clock::testing::FakeClock;

    const POLICY: &str = "\
escalation:
  - { name: twice, codes: [Xid13], count: 2, window: 10m, handling: PreSeparateNPU }
  - { name: lasting, codes: [NVLINK_DOWN], duration: 20s, recover_after: 30s, handling: SeparateNPU }
recovery:
  - { codes: [KMSG_LOSS], clear_after: 10m }
";

    struct Rig {
        clock: Arc<FakeClock>,
        tx: mpsc::Sender<Input>,
        snaps: watch::Receiver<Option<Snapshot>>,
        marker: u64,
        shutdown: CancellationToken,
        policy: watch::Sender<LoadedPolicy>,
        results: mpsc::UnboundedReceiver<ClearApplied>,
        metrics: Arc<Metrics>,
    }

    /// `text` as the policy in force.
    fn loaded(text: &str) -> LoadedPolicy {
        LoadedPolicy {
            policy: Arc::new(faultline_core::policy::Policy::parse(text).unwrap()),
            status: LoadedPolicy::builtin().status,
        }
    }

    impl Rig {
        fn start() -> Rig {
            Rig::restored(Engine::default(), AppliedClears::default(), loaded(POLICY))
        }

        /// [`Rig::start`], beating every `liveness` when idle (as the agent does).
        fn with_liveness(liveness: Duration) -> Rig {
            Rig::with(
                Engine::default(),
                AppliedClears::default(),
                loaded(POLICY),
                liveness,
            )
        }

        /// The loop on a restored engine and clear memory, under `policy`.
        fn restored(engine: Engine, clears: AppliedClears, policy: LoadedPolicy) -> Rig {
            // Beats do not matter here; the engine is ticked at its deadlines, on the fake
            // clock, and by the test (`Rig::tick`) at the times it chooses.
            Rig::with(engine, clears, policy, Duration::from_secs(3600))
        }

        fn with(
            engine: Engine,
            clears: AppliedClears,
            policy: LoadedPolicy,
            liveness: Duration,
        ) -> Rig {
            let clock = Arc::new(FakeClock::new(1_790_000_000_000, 600_000));
            let (policy_tx, policy) = watch::channel(policy);
            let (results_tx, results) = mpsc::unbounded_channel();
            let (tx, inputs) = mpsc::channel(64);
            let (snap_tx, snaps) = watch::channel(None);
            let shutdown = CancellationToken::new();
            let timeline = Timeline::for_boot(None, Some("b1"), clock.now(), clock.since_boot());
            let metrics = Arc::new(Metrics::new());
            let engine_loop = EngineLoop {
                node: "n1".into(),
                engine,
                timeline,
                kmsg_cursor: None,
                boot_time: None,
                marker: 0,
                clears,
                clear_results: results_tx,
                catalog: Arc::new(Catalog::builtin().unwrap()),
                policy,
                inputs,
                snapshots: snap_tx,
                metrics: metrics.clone(),
                clock: clock.clone(),
                heartbeat: Arc::new(Heartbeat::default()),
                liveness,
                events: None,
                sink_report: watch::channel(SinkReport::default()).1,
                record_writer: watch::channel(RecordStatus::Written).1,
                shutdown: shutdown.clone(),
            };
            tokio::spawn(engine_loop.run());
            Rig {
                clock,
                tx,
                snaps,
                marker: 0,
                shutdown,
                policy: policy_tx,
                results,
                metrics,
            }
        }

        /// Sends clear request `key` and returns the loop's report and the snapshot that has it.
        async fn clear(&mut self, key: &str, code: Option<&str>) -> (ClearApplied, Snapshot) {
            self.marker += 1;
            let m = self.marker;
            let clear = Input::Clear {
                request: key.into(),
                code: code.map(String::from),
                device: None,
                marker: m,
            };
            self.tx.send(clear).await.unwrap();
            let report = self.results.recv().await.unwrap();
            let snap = self
                .snaps
                .wait_for(|s| s.as_ref().is_some_and(|s| s.marker >= m))
                .await
                .unwrap();
            (report, snap.clone().unwrap())
        }

        /// The first snapshot (the restored state, before any input).
        async fn first(&mut self) -> Snapshot {
            let snap = self.snaps.wait_for(|s| s.is_some()).await.unwrap();
            snap.clone().unwrap()
        }

        /// Applies `obs` (then a tick) and returns the snapshot that has it.
        async fn apply(&mut self, obs: Option<Observation>) -> Snapshot {
            if let Some(obs) = obs {
                self.tx.send(Input::Obs(obs)).await.unwrap();
            }
            self.tx.send(Input::Obs(Observation::Tick)).await.unwrap();
            self.marker += 1;
            self.tx.send(Input::Marker(self.marker)).await.unwrap();
            let m = self.marker;
            let snap = self
                .snaps
                .wait_for(|s| s.as_ref().is_some_and(|s| s.marker >= m))
                .await
                .unwrap();
            snap.clone().unwrap()
        }

        async fn tick(&mut self) -> Snapshot {
            self.apply(None).await
        }
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            self.shutdown.cancel();
        }
    }

    fn signal(code: FaultCode, source: Source) -> Observation {
        let device = DeviceRef::named("GPU-0");
        Observation::Signal(Signal::new(source, code, Some(device), "test"))
    }

    fn handling(s: &Snapshot, code: &str) -> Option<(Handling, bool)> {
        s.record
            .faults
            .iter()
            .find(|f| f.fault_code == code)
            .map(|f| (f.fault_handling, f.active))
    }

    const STEPS: [i64; 3] = [0, 3600, -3600];

    /// The samples of `metric` in `text`: each series' labels and value.
    fn series(text: &str, metric: &str) -> Vec<(BTreeMap<String, String>, f64)> {
        text.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(metric)?.strip_prefix('{')?;
                let (labels, value) = rest.rsplit_once("} ")?;
                let labels = labels
                    .split(',')
                    .filter_map(|kv| {
                        let (k, v) = kv.split_once('=')?;
                        Some((k.to_string(), v.trim_matches('"').to_string()))
                    })
                    .collect();
                Some((labels, value.parse().ok()?))
            })
            .collect()
    }

    /// `(code, device)` of each series of `metric`, with the values of those series summed.
    fn by_code_device(text: &str, metric: &str) -> BTreeMap<(String, String), f64> {
        let mut out = BTreeMap::new();
        for (l, v) in series(text, metric) {
            *out.entry((l["code"].clone(), l["device"].clone()))
                .or_insert(0.0) += v;
        }
        out
    }

    /// The faults by code and device, bounded. Hundreds of faults with crafted
    /// codes and devices (unlisted Xids, GPUs and PCI addresses NVML does not list, switch
    /// numbers, names) make a few dozen series, everything unlisted under `other`; what the
    /// catalog, the policy and the inventory name keeps its name. A reload that names a code
    /// makes it a label value; a series goes when its last fault does.
    #[tokio::test]
    async fn fault_metrics_are_labelled_by_bounded_code_and_device() {
        use faultline_core::parse::PciAddr;
        let mut r = Rig::restored(Engine::default(), AppliedClears::default(), loaded(""));
        let pci = |bus: u32| -> PciAddr { format!("0000:{bus:02x}:00.0").parse().unwrap() };
        let on = |code: FaultCode, device: DeviceRef| {
            Input::Obs(Observation::Signal(Signal::new(
                Source::Kmsg,
                code,
                Some(device),
                "crafted",
            )))
        };
        let mut inputs = vec![
            // NVML's GPU 0; the kernel log's UUID line for a GPU NVML does not list.
            Input::Obs(Observation::DeviceSeen {
                pci: pci(0x3b),
                uuid: Some("GPU-aaaa".into()),
                index: Some(0),
            }),
            Input::Obs(Observation::DeviceSeen {
                pci: pci(0x3c),
                uuid: Some("GPU-bbbb".into()),
                index: None,
            }),
            Input::Obs(Observation::Inventory {
                kind: "Ascend910".into(),
                names: vec!["Ascend910-0".into()],
            }),
            on(FaultCode::Xid(79), DeviceRef::pci(pci(0x3b))),
            on(FaultCode::Xid(79), DeviceRef::pci(pci(0x3b))),
            on(FaultCode::Xid(79), DeviceRef::pci(pci(0x3c))),
            on(
                FaultCode::named("NVLINK_DOWN"),
                DeviceRef::named("Ascend910-0"),
            ),
            on(
                FaultCode::named("NVLINK_DOWN"),
                DeviceRef::named("Ascend910-7"),
            ),
            on(
                FaultCode::named("NVLINK_DOWN"),
                DeviceRef::named("link:node-b"),
            ),
            Input::Obs(Observation::Detector {
                name: "kmsg".into(),
                state: faultline_core::engine::DetectorState::Down,
                reason: None,
            }),
            Input::Obs(Observation::Detector {
                name: "made-up".into(),
                state: faultline_core::engine::DetectorState::Down,
                reason: None,
            }),
        ];
        for i in 0..200u32 {
            let at: PciAddr = format!("0001:{:02x}:{:02x}.0", i / 32, i % 32)
                .parse()
                .unwrap();
            inputs.push(on(FaultCode::Xid(100_000 + i), DeviceRef::pci(at)));
            inputs.push(on(
                FaultCode::named(&format!("CRAFTED_{i}")),
                DeviceRef::named(&format!("dev{i}")),
            ));
        }
        for n in 0..40u32 {
            let device = DeviceRef {
                pci: Some(pci(n)),
                name: Some(format!("nvswitch{n}")),
                ..Default::default()
            };
            let sxid = FaultCode::Sxid {
                code: 12028,
                fatal: true,
            };
            inputs.push(on(sxid, device));
        }
        let mut loss = Signal::new(Source::Kmsg, FaultCode::named("KMSG_LOSS"), None, "lost");
        loss.count = 40;
        inputs.push(Input::Obs(Observation::Signal(loss)));
        for i in inputs {
            r.tx.send(i).await.unwrap();
        }
        let s = r.tick().await;
        let active_faults = s.record.faults.iter().filter(|f| f.active).count();
        assert!(active_faults > 400, "{active_faults}");

        let text = r.metrics.encode();
        let active = by_code_device(&text, "faultline_fault_active");
        let s = |a: &str, b: &str| (a.to_string(), b.to_string());
        let mut want: BTreeMap<(String, String), f64> = [
            (s("Xid79", "GPU-0"), 1.0),
            (s("Xid79", "other"), 1.0),
            (s("NVLINK_DOWN", "Ascend910-0"), 1.0),
            (s("NVLINK_DOWN", "other"), 2.0),
            (s("DETECTOR_DOWN", "kmsg"), 1.0),
            (s("DETECTOR_DOWN", "other"), 1.0),
            (s("other", "other"), 400.0),
            (s("SXid12028", "other"), 24.0),
            (s("KMSG_LOSS", "node"), 1.0),
        ]
        .into_iter()
        .collect();
        for n in 0..16 {
            want.insert(s("SXid12028", &format!("nvswitch{n}")), 1.0);
        }
        assert_eq!(active, want, "{text}");
        let values: f64 = series(&text, "faultline_fault_active")
            .iter()
            .map(|x| x.1)
            .sum();
        assert_eq!(values as usize, active_faults);
        assert!(series(&text, "faultline_fault_active").len() <= want.len() * 2);
        let occurred = by_code_device(&text, "faultline_fault_occurrences_total");
        assert_eq!(
            occurred[&s("Xid79", "GPU-0")],
            2.0,
            "the first and the repeat"
        );
        assert_eq!(
            occurred[&s("KMSG_LOSS", "node")],
            40.0,
            "as the record counts"
        );
        assert_eq!(occurred[&s("other", "other")], 400.0);
        assert_eq!(occurred.len(), want.len(), "{occurred:?}");

        // A reload that names Xid100000 makes it a label value, for what is active and for what
        // is reported next.
        r.policy.send_replace(loaded(
            "overrides:\n  Xid100000: { handling: NotHandleFault }\n",
        ));
        r.tick().await;
        let first: PciAddr = "0001:00:00.0".parse().unwrap();
        r.tx.send(on(FaultCode::Xid(100_000), DeviceRef::pci(first)))
            .await
            .unwrap();
        r.tick().await;
        let text = r.metrics.encode();
        let active = by_code_device(&text, "faultline_fault_active");
        assert_eq!(active[&s("other", "other")], 399.0);
        assert_eq!(active[&s("Xid100000", "other")], 1.0, "{text}");
        assert!(text.contains(
            "faultline_fault_active{code=\"Xid100000\",device=\"other\",handling=\"NotHandleFault\"} 1\n"
        ));
        let occurred = by_code_device(&text, "faultline_fault_occurrences_total");
        assert_eq!(occurred[&s("Xid100000", "other")], 1.0);

        // Cleared: its series goes (it would stay at its last value otherwise).
        r.clear("c1", Some("Xid79")).await;
        let text = r.metrics.encode();
        let active = by_code_device(&text, "faultline_fault_active");
        assert!(!active.contains_key(&s("Xid79", "GPU-0")), "{text}");
        assert!(!active.contains_key(&s("Xid79", "other")), "{text}");
        let occurred = by_code_device(&text, "faultline_fault_occurrences_total");
        assert_eq!(occurred[&s("Xid79", "GPU-0")], 2.0, "a counter stays");
    }

    /// Two Xid 13 five minutes apart are two in the 10-minute window, whatever the wall clock
    /// did between them; eleven minutes apart they are not.
    #[tokio::test]
    async fn a_wall_clock_step_in_a_count_window_changes_nothing() {
        for step in STEPS {
            for (apart, escalated) in [(5 * 60, true), (11 * 60, false)] {
                let mut r = Rig::start();
                r.apply(Some(signal(FaultCode::Xid(13), Source::Kmsg)))
                    .await;
                r.clock.advance(Duration::from_secs(60));
                r.clock.step_wall(step);
                r.clock.advance(Duration::from_secs(apart - 60));
                let s = r
                    .apply(Some(signal(FaultCode::Xid(13), Source::Kmsg)))
                    .await;
                let want = if escalated {
                    Handling::PreSeparateNPU
                } else {
                    Handling::RestartBusiness
                };
                assert_eq!(
                    handling(&s, "Xid13"),
                    Some((want, true)),
                    "step {step} s, {apart} s apart"
                );
            }
        }
    }

    /// A link down for 20 s escalates at 20 s of real time: not at once after a forward step,
    /// not an hour late after a backward one.
    #[tokio::test]
    async fn a_wall_clock_step_during_a_duration_rule_changes_nothing() {
        let down = || signal(FaultCode::Named("NVLINK_DOWN".into()), Source::Nvml);
        for step in STEPS {
            let mut r = Rig::start();
            let s = r.apply(Some(down())).await;
            let base = handling(&s, "NVLINK_DOWN").unwrap().0;
            assert!(base < Handling::SeparateNPU, "{base}");
            r.clock.advance(Duration::from_secs(5));
            r.clock.step_wall(step);
            let s = r.tick().await;
            assert_eq!(
                handling(&s, "NVLINK_DOWN"),
                Some((base, true)),
                "step {step} s: 5 s down"
            );
            r.clock.advance(Duration::from_secs(14));
            let s = r.tick().await;
            assert_eq!(
                handling(&s, "NVLINK_DOWN").map(|h| h.0),
                Some(base),
                "step {step} s: 19 s down"
            );
            r.clock.advance(Duration::from_secs(2));
            let s = r.tick().await;
            assert_eq!(
                handling(&s, "NVLINK_DOWN"),
                Some((Handling::SeparateNPU, true)),
                "step {step} s: 21 s down"
            );
        }
    }

    /// A recovery hold of 30 s and a quiet time of 10 min run on real time: a forward step does
    /// not end them early, a backward step does not stall them.
    #[tokio::test]
    async fn a_wall_clock_step_during_recovery_holds_changes_nothing() {
        for step in STEPS {
            let mut r = Rig::start();
            let link = |present: bool| Observation::Level {
                source: Source::Nvml,
                device: Some(DeviceRef::named("GPU-0")),
                domain: "nvml-nvlink".into(),
                present: if present {
                    vec![Signal::new(
                        Source::Nvml,
                        FaultCode::Named("NVLINK_DOWN".into()),
                        None,
                        "down",
                    )]
                } else {
                    Vec::new()
                },
            };
            r.apply(Some(link(true))).await;
            r.apply(Some(signal(
                FaultCode::Named("KMSG_LOSS".into()),
                Source::Kmsg,
            )))
            .await;
            r.apply(Some(link(false))).await;
            r.clock.advance(Duration::from_secs(10));
            r.clock.step_wall(step);
            let s = r.tick().await;
            assert_eq!(
                handling(&s, "NVLINK_DOWN").map(|h| h.1),
                Some(true),
                "step {step} s: hold at 10 s"
            );
            assert_eq!(
                handling(&s, "KMSG_LOSS").map(|h| h.1),
                Some(true),
                "step {step} s: quiet 10 s"
            );
            r.clock.advance(Duration::from_secs(21));
            let s = r.tick().await;
            assert_eq!(
                handling(&s, "NVLINK_DOWN").map(|h| h.1),
                Some(false),
                "step {step} s: hold over at 31 s"
            );
            assert_eq!(
                handling(&s, "KMSG_LOSS").map(|h| h.1),
                Some(true),
                "step {step} s: quiet 31 s"
            );
            r.clock.advance(Duration::from_secs(9 * 60 + 30));
            let s = r.tick().await;
            assert_eq!(
                handling(&s, "KMSG_LOSS").map(|h| h.1),
                Some(false),
                "step {step} s: quiet 10 min 1 s"
            );
        }
    }

    /// The record's dates follow the wall clock: after a step, the faults' dates are shifted by
    /// it (as the corrected clock would have dated them); the record's own time is the wall's.
    #[tokio::test]
    async fn record_dates_follow_the_wall_clock() {
        let mut r = Rig::start();
        let before = r.clock.now();
        let s = r
            .apply(Some(signal(FaultCode::Xid(13), Source::Kmsg)))
            .await;
        let first = s.record.faults[0].first_seen;
        assert_eq!(first, before);
        r.clock.step_wall(3600);
        let s = r
            .apply(Some(signal(FaultCode::Xid(31), Source::Kmsg)))
            .await;
        assert_eq!(s.record.update_time, r.clock.now());
        let x13 = s
            .record
            .faults
            .iter()
            .find(|f| f.fault_code == "Xid13")
            .unwrap();
        assert_eq!(
            x13.first_seen,
            shift(before, SignedDuration::from_secs(3600))
        );
        let x31 = s
            .record
            .faults
            .iter()
            .find(|f| f.fault_code == "Xid31")
            .unwrap();
        assert_eq!(x31.first_seen, r.clock.now());
    }

    /// A step alone (no new input, only time passing) republishes the record with the moved
    /// dates, and the offset is saved for the next boot's timeline.
    #[tokio::test]
    async fn a_step_alone_republishes_the_dates() {
        let mut r = Rig::start();
        let before = r.clock.now();
        r.apply(Some(signal(FaultCode::Xid(13), Source::Kmsg)))
            .await;
        r.clock.step_wall(3600);
        r.tx.send(Input::Obs(Observation::Tick)).await.unwrap();
        let want = shift(before, SignedDuration::from_secs(3600));
        let snap = r
            .snaps
            .wait_for(|s| {
                s.as_ref().is_some_and(|s| {
                    s.record
                        .faults
                        .first()
                        .is_some_and(|f| f.first_seen == want)
                })
            })
            .await
            .unwrap()
            .clone()
            .unwrap();
        let saved = snap.state.timeline.clone().unwrap();
        assert_eq!(saved.wall_offset_ms, 3_600_000);
    }

    /// An idle engine loop applies nothing; the engine is ticked at its deadline
    /// (here a 10-minute quiet time), on the injected clock, whichever way the wall clock was
    /// stepped meanwhile: an idle node costs no inputs.
    #[tokio::test(start_paused = true)]
    async fn the_engine_is_ticked_at_its_deadline_only() {
        for step in STEPS {
            let mut r = Rig::with_liveness(LIVENESS);
            let loss = || signal(FaultCode::named("KMSG_LOSS"), Source::Kmsg);
            r.apply(Some(loss())).await;
            let inputs = r.metrics.engine_inputs.get();
            // Ten minutes pass on tokio's clock: beats only (the fake clock has not moved).
            tokio::time::sleep(Duration::from_secs(600)).await;
            assert_eq!(r.metrics.engine_inputs.get(), inputs, "step {step}: idle");
            r.clock.step_wall(step);
            r.clock.advance(Duration::from_secs(599));
            tokio::time::sleep(LIVENESS * 2).await;
            assert_eq!(
                r.metrics.engine_inputs.get(),
                inputs,
                "step {step}: 1 s before the deadline"
            );
            let snap = r.snaps.borrow().clone().unwrap();
            assert_eq!(handling(&snap, "KMSG_LOSS").map(|h| h.1), Some(true));
            // At the deadline: one tick, sent by nobody but the loop's timer.
            r.clock.advance(Duration::from_secs(1));
            let quiet = |s: &Option<Snapshot>| {
                s.as_ref()
                    .is_some_and(|s| handling(s, "KMSG_LOSS").map(|h| h.1) == Some(false))
            };
            tokio::time::timeout(Duration::from_secs(3600), r.snaps.wait_for(quiet))
                .await
                .expect("recovered at the deadline")
                .unwrap();
            assert_eq!(r.metrics.engine_inputs.get(), inputs + 1, "step {step}");
            // Nothing timed is left but the history's end (the policy's default retention).
            tokio::time::sleep(Duration::from_secs(600)).await;
            assert_eq!(r.metrics.engine_inputs.get(), inputs + 1, "step {step}");
        }
    }

    /// `/healthz`'s age is measured since boot: a wall-clock step neither makes a beating
    /// engine look dead nor a dead one alive.
    #[test]
    fn the_heartbeat_age_ignores_wall_clock_steps() {
        let clock = FakeClock::new(1_790_000_000_000, 1_000);
        let h = Heartbeat::default();
        assert_eq!(h.age_ms(&clock), i64::MAX, "never beat");
        assert_eq!(h.last(), None);
        h.beat(&clock);
        assert_eq!(h.last(), Some(clock.now()));
        clock.step_wall(3600);
        assert_eq!(h.age_ms(&clock), 0);
        clock.step_wall(-7200);
        clock.advance(Duration::from_secs(40));
        assert_eq!(h.age_ms(&clock), 40_000);
    }

    /// A repeating fault (1,000 repeats over one second, each its own batch) is published at
    /// most once per `PUBLISH_EVERY` after its first report, and the last count arrives; a new
    /// fault in the middle is published at once.
    #[tokio::test(start_paused = true)]
    async fn count_only_changes_are_published_at_a_bounded_rate() {
        let mut r = Rig::start();
        let first = r.tick().await.revision;
        let xid = || signal(FaultCode::Xid(31), Source::Kmsg);
        for i in 0..1000u32 {
            r.tx.send(Input::Obs(xid())).await.unwrap();
            if i == 500 {
                r.tx.send(Input::Obs(signal(FaultCode::Xid(79), Source::Kmsg)))
                    .await
                    .unwrap();
                // Published at once, without waiting for the pacing interval.
                let s = tokio::time::timeout(
                    Duration::from_millis(5),
                    r.snaps
                        .wait_for(|s| s.as_ref().is_some_and(|s| handling(s, "Xid79").is_some())),
                )
                .await;
                assert!(s.is_ok(), "a new fault waited for the pacing");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(PUBLISH_EVERY * 2).await;
        let last = r.snaps.borrow().clone().unwrap();
        let xid31 = last.record.faults.iter().find(|f| f.fault_code == "Xid31");
        assert_eq!(xid31.map(|f| f.count), Some(1000), "the last count arrives");
        let publishes = last.revision - first;
        // The first report and Xid 79 at once, then at most one per 100 ms over ~1 s, and the
        // trailing one.
        assert!(
            (3..=14).contains(&publishes),
            "{publishes} snapshots for 1,000 repeats"
        );
    }

    /// An engine as a run under `policy` left it: one Xid 13 on GPU-0.
    fn saved_under(policy: &str) -> Engine {
        let policy = faultline_core::policy::Policy::parse(policy).unwrap();
        let catalog = Catalog::builtin().unwrap();
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut e = Engine::default();
        let at = Timestamp::from_second(1_790_000_000).unwrap();
        e.step(ctx, signal(FaultCode::Xid(13), Source::Kmsg), at);
        // Saved and read back, as state.json is.
        serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap()
    }

    const NOT_HANDLED: &str = "overrides:\n  Xid13: { handling: NotHandleFault }\n";

    /// A fault saved under a policy that overrode its level is classified under the policy in
    /// force when the agent starts, and stays so when it recurs, as the same code on another
    /// device is.
    #[tokio::test]
    async fn restored_faults_are_classified_under_the_policy_in_force() {
        let engine = saved_under(NOT_HANDLED);
        assert_eq!(
            engine.faults().next().unwrap().fault.fault_handling,
            Handling::NotHandleFault
        );
        let mut r = Rig::restored(engine, AppliedClears::default(), loaded(""));
        let s = r.first().await;
        assert_eq!(
            handling(&s, "Xid13"),
            Some((Handling::RestartBusiness, true))
        );
        assert_eq!(s.record.health, Health::Degraded, "{:?}", s.record.health);
        r.clock.advance(Duration::from_secs(60));
        let s = r
            .apply(Some(signal(FaultCode::Xid(13), Source::Kmsg)))
            .await;
        assert_eq!(
            handling(&s, "Xid13"),
            Some((Handling::RestartBusiness, true)),
            "recurred"
        );
    }

    /// While the policy file is still being read, restored faults keep the level they were
    /// saved with (the built-in policy only stands in); once it is read they are classified
    /// under it, even when it is the same as the built-in policy (no change to react to).
    #[tokio::test]
    async fn restored_faults_wait_for_a_policy_file_still_loading() {
        let mut loading = loaded("");
        loading.status.loading = Some("/etc/faultline/policy.yaml".into());
        let mut r = Rig::restored(saved_under(NOT_HANDLED), AppliedClears::default(), loading);
        let s = r.first().await;
        assert_eq!(
            handling(&s, "Xid13"),
            Some((Handling::NotHandleFault, true)),
            "not judged by the stand-in"
        );
        r.policy.send_replace(loaded(""));
        let s = r.tick().await;
        assert_eq!(
            handling(&s, "Xid13"),
            Some((Handling::RestartBusiness, true)),
            "the file's policy, read"
        );
    }

    /// A clear is reported with what it ended; the same request again (as a restart finds one
    /// left behind by a kill) is answered from memory, not applied again, also by a new run on
    /// the saved state.
    #[tokio::test]
    async fn a_clear_is_reported_and_applied_once() {
        let mut r = Rig::restored(Engine::default(), AppliedClears::default(), loaded(""));
        r.apply(Some(signal(FaultCode::Xid(79), Source::Kmsg)))
            .await;
        r.apply(Some(signal(FaultCode::Xid(13), Source::Kmsg)))
            .await;
        let (report, s) = r.clear("1.json@1", Some("Xid79")).await;
        assert_eq!(report.marker, r.marker, "reported under its marker");
        assert_eq!(report.result.cleared, 1);
        assert_eq!(
            report.result.faults,
            [crate::clear::ClearedFault {
                code: "Xid79".into(),
                device: "GPU-0".into()
            }]
        );
        assert_eq!(handling(&s, "Xid79").map(|h| h.1), Some(false));
        assert_eq!(s.state.clears.get("1.json@1"), Some(&report.result));
        let (none, _) = r.clear("2.json@2", Some("Xid999")).await;
        assert_eq!(none.result, ClearResult::default(), "nothing matched");

        // Back, then the first request once more: answered as before, not applied.
        let s = r
            .apply(Some(signal(FaultCode::Xid(79), Source::Kmsg)))
            .await;
        assert_eq!(handling(&s, "Xid79").map(|h| h.1), Some(true));
        let (again, s) = r.clear("1.json@1", Some("Xid79")).await;
        assert_eq!(again.result, report.result);
        assert_eq!(
            handling(&s, "Xid79").map(|h| h.1),
            Some(true),
            "not cleared again"
        );

        // A new run on the saved state.
        let saved = (*s.state).clone();
        drop(r);
        let mut r = Rig::restored(saved.engine, saved.clears, loaded(""));
        let (again, s) = r.clear("1.json@1", Some("Xid79")).await;
        assert_eq!(again.result, report.result);
        assert_eq!(
            handling(&s, "Xid79").map(|h| h.1),
            Some(true),
            "not cleared again"
        );
        let (other, _) = r.clear("1.json@3", Some("Xid79")).await;
        assert_eq!(
            other.result.cleared, 1,
            "a new file under the same name is a new request"
        );
    }

    /// What the file sink may show before it is saved. A record of a kernel log
    /// that replays (the device, a regular file) goes ahead: a restart reads it again past the
    /// saved cursor. The restored state, a record read from a FIFO (nothing reads it again),
    /// another source's report and an operator's clear are marked to be saved first, and the
    /// mark stays on later snapshots (the sink compares it with what it saved).
    #[tokio::test]
    async fn only_what_a_restart_makes_again_goes_ahead_of_the_save() {
        let mut r = Rig::start();
        let first = r.first().await;
        assert_eq!(first.save_first, first.revision, "the restored state");
        let xid79 = |seq| Input::Kmsg {
            obs: signal(FaultCode::Xid(79), Source::Kmsg),
            at: KmsgPosition::at_seq(seq),
        };
        let send = |r: &mut Rig, inputs: Vec<Input>| {
            r.marker += 1;
            let (tx, m) = (r.tx.clone(), r.marker);
            let mut snaps = r.snaps.clone();
            async move {
                for i in inputs {
                    tx.send(i).await.unwrap();
                }
                tx.send(Input::Marker(m)).await.unwrap();
                let s = snaps
                    .wait_for(|s| s.as_ref().is_some_and(|s| s.marker >= m))
                    .await
                    .unwrap();
                s.clone().unwrap()
            }
        };
        let count = |s: &Snapshot| {
            s.record
                .faults
                .iter()
                .find(|f| f.fault_code == "Xid79")
                .map(|f| f.count)
        };

        let device = send(&mut r, vec![Input::KmsgReplays(true), xid79(1)]).await;
        assert_eq!(count(&device), Some(1));
        assert!(device.revision > first.revision);
        assert_eq!(
            device.save_first, first.revision,
            "the device's record goes ahead"
        );

        let fifo = send(&mut r, vec![Input::KmsgReplays(false), xid79(2)]).await;
        assert_eq!(count(&fifo), Some(2));
        assert_eq!(
            fifo.save_first, fifo.revision,
            "a FIFO's record is saved first"
        );

        let again = send(&mut r, vec![Input::KmsgReplays(true), xid79(3)]).await;
        assert_eq!(count(&again), Some(3));
        assert_eq!(
            again.save_first, fifo.revision,
            "still held for the FIFO's record until the sink saved it"
        );

        let nvml = r
            .apply(Some(signal(FaultCode::Xid(48), Source::Nvml)))
            .await;
        assert_eq!(nvml.save_first, nvml.revision, "another source's report");

        let (_, cleared) = r.clear("1.json@1", Some("Xid79")).await;
        assert!(cleared.revision > nvml.revision);
        assert_eq!(cleared.save_first, cleared.revision, "an operator's clear");

        // Kernel-log records with no fault move the cursor only: nothing to hold.
        let quiet = send(&mut r, vec![Input::KmsgCursor(KmsgPosition::at_seq(9))]).await;
        assert_eq!(quiet.save_first, cleared.revision);
    }
}
