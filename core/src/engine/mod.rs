//! The engine: pure and synchronous. `Engine::step(ctx, observation, now)` updates the state
//! and returns the events it caused; `Engine::view` derives the node verdict, the desired
//! labels, taints and condition, and the record. No I/O, no clocks, no async: the caller passes
//! `now`, the policy and the catalog, so every behaviour is a table test.
//!
//! What it does: dedupes repeats of a fault into one record with a count; counts occurrences
//! (repeats within the policy's burst window are one occurrence); escalates by frequency and
//! duration (sticky while the fault is active); clears faults on recovery rules, on a reboot
//! (kernel-log faults), on an operator's clear or when a source says the condition is gone;
//! keeps recovered faults as bounded history.
//!
//! This module holds the types and the observation handlers (`step`); `identity` resolves
//! devices to fault keys, `escalation` raises levels by rule, `recovery` ends faults and prunes
//! history, `view` derives the verdict and the desired node state, `deadline` says when time
//! alone can next change the engine (when the agent must tick it).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use jiff::Timestamp;

use crate::time::{signed, since};
use serde::{Deserialize, Serialize};

use crate::catalog::{Catalog, FaultCode};
pub use crate::kmsg_position::KmsgPosition;
use crate::parse::PciAddr;
use crate::policy::{Policy, TaintEffect, MAX_OCCURRENCES};
use crate::record::{Fault, Handling, Health, Source};
use escalation::{escalate, sticky};
use recovery::{recover, resolve};

mod caps;
mod deadline;
mod escalation;
mod identity;
mod recovery;
mod restore;
mod view;

pub use caps::{clamp_json, Folded, FOLDED_CODE, MAX_DEVICES, MAX_MESSAGE_JSON, MAX_NAME_JSON};
pub use restore::RestoreScope;

#[cfg(test)]
mod tests;

/// What sources send to the engine loop, in one FIFO order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Obs(Observation),
    /// Every kernel log record up to and including this position has been sent. The engine
    /// loop persists it with the engine state so a restart neither skips nor recounts.
    KmsgCursor(KmsgPosition),
    /// An observation from the kernel log record at `at` (or, for a loss report, the records
    /// up to it): the engine loop applies it and moves the cursor in one step, so no saved state
    /// holds the fault without the cursor that covers it (a kill between the two would count
    /// the record again after the restart).
    Kmsg {
        obs: Observation,
        at: KmsgPosition,
    },
    /// Whether a restart reads the kernel log's records from here on again, past the saved
    /// cursor: `true` for the device (its ring) and a regular file, `false` for a FIFO (a
    /// stream hands each line to one read). The kernel-log source says so each time it opens
    /// the log, before its first record. The engine loop publishes a change from a log that
    /// replays before the change is saved (a kill is made good by reading the record again),
    /// and saves any other change first.
    KmsgReplays(bool),
    /// Everything sent before this has been applied. The engine loop carries the highest marker
    /// in each snapshot, so a source can learn when its inputs are on disk (the file sink reports
    /// the markers it wrote).
    Marker(u64),
    /// An operator's clear request: applied as [`Observation::OperatorClear`], then as
    /// `Marker(marker)`. `request` is the request's identity, opaque to the engine: the engine
    /// loop remembers the requests it applied with the state it saves, so a request seen again
    /// (left behind by a kill) is answered with what it did, not applied a second time.
    Clear {
        request: String,
        code: Option<String>,
        device: Option<String>,
        marker: u64,
    },
}

/// Which device a signal is about. Every field is optional; the engine fills in what it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRef {
    pub pci: Option<PciAddr>,
    pub uuid: Option<String>,
    pub index: Option<u32>,
    /// An explicit name (`Ascend910-3`, a detector's name); wins over derived names.
    pub name: Option<String>,
}

impl DeviceRef {
    pub fn pci(pci: PciAddr) -> Self {
        DeviceRef {
            pci: Some(pci),
            ..Default::default()
        }
    }
    pub fn named(name: &str) -> Self {
        DeviceRef {
            name: Some(name.to_string()),
            ..Default::default()
        }
    }
}

/// A fault occurrence reported by a source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signal {
    pub source: Source,
    pub code: FaultCode,
    /// `None`: the whole node.
    pub device: Option<DeviceRef>,
    pub message: String,
    /// When it happened, if the source knows (kernel timestamp); else `now`.
    pub at: Option<Timestamp>,
    /// How many occurrences this signal stands for (lost records for `KMSG_LOSS`); at least 1.
    pub count: u64,
}

impl Signal {
    pub fn new(
        source: Source,
        code: FaultCode,
        device: Option<DeviceRef>,
        message: impl Into<String>,
    ) -> Self {
        Signal {
            source,
            code,
            device,
            message: message.into(),
            at: None,
            count: 1,
        }
    }
}

/// A detector's health as its source reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DetectorState {
    Running,
    /// Set up but not watching yet (a kernel-log FIFO no writer has opened): shown so a reader
    /// of the record knows the detector exists and why it sees nothing; no fault.
    Starting,
    /// Nothing to watch on this machine (no NVML on a CPU node): normal, no fault.
    Idle,
    Down,
}

impl DetectorState {
    pub fn as_str(self) -> &'static str {
        match self {
            DetectorState::Running => "Running",
            DetectorState::Starting => "Starting",
            DetectorState::Idle => "Idle",
            DetectorState::Down => "Down",
        }
    }
}

/// Everything that can happen to the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    Signal(Signal),
    /// A device's identity: PCI address with UUID and/or index.
    DeviceSeen {
        pci: PciAddr,
        uuid: Option<String>,
        index: Option<u32>,
    },
    /// The node's boot id. A change clears kernel-log faults: they described the last boot.
    Boot {
        boot_id: String,
    },
    /// An operator cleared faults (any code / device when `None`).
    OperatorClear {
        code: Option<String>,
        device: Option<String>,
    },
    Detector {
        name: String,
        state: DetectorState,
        reason: Option<String>,
    },
    /// Everything a level-triggered source sees wrong with one device in one domain (a chip's
    /// error codes, a port's state), polled: codes not yet active become faults; active faults
    /// from this source, device and domain that are no longer present recover (after the code's
    /// recovery hold). A poll that failed sends no `Level`, so nothing is lost when a tool breaks.
    ///
    /// `device: None` covers every device of the source in the domain (all of a node's peer
    /// links in one run): each present signal names its own device, and an active fault of the
    /// domain on any device that is not present recovers. Levels carry no memory in the source,
    /// so a restart neither keeps a condition that went away nor counts one that stayed.
    Level {
        source: Source,
        device: Option<DeviceRef>,
        domain: String,
        present: Vec<Signal>,
    },
    /// The devices of one kind a source sees (`Ascend910` -> `Ascend910-0`, …), for outputs that
    /// list healthy devices too.
    Inventory {
        kind: String,
        names: Vec<String>,
    },
    /// Time passed: duration escalation, quiet recovery, history pruning.
    Tick,
}

/// What a step changed that the outside world may want to hear about (Events, logs, metrics).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "PascalCase")]
pub enum EngineEvent {
    NewFault {
        code: String,
        device: String,
        handling: Handling,
        message: String,
    },
    Escalated {
        code: String,
        device: String,
        from: Handling,
        to: Handling,
        rule: String,
    },
    Recovered {
        code: String,
        device: String,
        reason: String,
    },
    Reclassified {
        code: String,
        device: String,
        from: Handling,
        to: Handling,
    },
    HealthChanged {
        from: Health,
        to: Health,
    },
}

/// The policy and catalog a step runs under.
#[derive(Debug, Clone, Copy)]
pub struct Ctx<'a> {
    pub policy: &'a Policy,
    pub catalog: &'a Catalog,
}

/// One fault with what the engine needs beyond the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultState {
    pub fault: Fault,
    pub code: FaultCodeRepr,
    /// Key of the device (`pci`, uuid, name or `node`).
    pub device_key: String,
    /// The catalog/policy level, before escalation.
    pub base: Handling,
    /// The level escalation raised it to (sticky while active).
    pub escalated: Option<Handling>,
    /// Start times of recent occurrences, newest last (bounded).
    pub occurrences: VecDeque<Timestamp>,
    /// When the current active period started.
    pub active_since: Timestamp,
    /// The `Level` domain that reports this fault, if a level-triggered source raised it.
    #[serde(default)]
    pub domain: Option<String>,
    /// Since when the condition has been gone while the recovery hold runs.
    #[serde(default)]
    pub resolving_since: Option<Timestamp>,
    /// Set on an overflow fault (`FAULTS_FOLDED`): the worst of what it holds ([`caps`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub folded: Option<Folded>,
}

/// `FaultCode` in a serializable form (for the persisted state).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum FaultCodeRepr {
    Xid {
        xid: u32,
    },
    Sxid {
        sxid: u32,
        fatal: bool,
    },
    Named {
        name: String,
    },
    Ascend {
        code: String,
        network: bool,
        severe: bool,
    },
}

impl From<&FaultCode> for FaultCodeRepr {
    fn from(c: &FaultCode) -> Self {
        match c {
            FaultCode::Xid(x) => FaultCodeRepr::Xid { xid: *x },
            FaultCode::Sxid { code, fatal } => FaultCodeRepr::Sxid {
                sxid: *code,
                fatal: *fatal,
            },
            FaultCode::Named(n) => FaultCodeRepr::Named { name: n.clone() },
            FaultCode::Ascend {
                code,
                network,
                severe,
            } => FaultCodeRepr::Ascend {
                code: code.clone(),
                network: *network,
                severe: *severe,
            },
        }
    }
}

impl From<&FaultCodeRepr> for FaultCode {
    fn from(c: &FaultCodeRepr) -> Self {
        match c {
            FaultCodeRepr::Xid { xid } => FaultCode::Xid(*xid),
            FaultCodeRepr::Sxid { sxid, fatal } => FaultCode::Sxid {
                code: *sxid,
                fatal: *fatal,
            },
            FaultCodeRepr::Named { name } => FaultCode::Named(name.clone()),
            FaultCodeRepr::Ascend {
                code,
                network,
                severe,
            } => FaultCode::Ascend {
                code: code.clone(),
                network: *network,
                severe: *severe,
            },
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct DeviceInfo {
    uuid: Option<String>,
    index: Option<u32>,
}

/// A detector's last reported state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetectorInfo {
    pub state: DetectorState,
    pub reason: Option<String>,
}

/// The engine's whole state. Serializable so the agent can persist it across restarts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Engine {
    boot_id: Option<String>,
    /// Keyed by `code/device_key`.
    faults: BTreeMap<String, FaultState>,
    devices: BTreeMap<PciAddr, DeviceInfo>,
    detectors: BTreeMap<String, DetectorInfo>,
    /// Recovered faults dropped from the history so far.
    dropped: u64,
    /// Bumped on every change visible in the record.
    #[serde(default)]
    revision: u64,
    /// Devices per kind, from `Observation::Inventory`.
    #[serde(default)]
    inventory: BTreeMap<String, BTreeSet<String>>,
    /// The node's health under the policy of the last `reclassify` (or the first step), as of
    /// the last step that caused an event. Not saved: derived again after a load.
    #[serde(skip)]
    health_cache: HealthCache,
    /// The reports the last step took ([`Engine::reports`]). Not saved.
    #[serde(skip)]
    reports: Reports,
}

/// One report of a fault that a step took: the fault it went into (`code`, `device` as the
/// record has them: after the merge into one fault per code and device, or the device's
/// `FAULTS_FOLDED` when a cap folded it) and how many occurrences it stood for (what the
/// fault's `count` grew by). A level source's condition that is still there is no new report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub code: String,
    pub device: String,
    pub count: u64,
}

/// Scratch: two engines are equal, and a clone starts empty, whatever it holds.
#[derive(Debug, Default)]
struct Reports(Vec<Report>);

impl Clone for Reports {
    fn clone(&self) -> Self {
        Reports::default()
    }
}

impl PartialEq for Reports {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for Reports {}

/// A derived value: two engines with the same state are equal whatever their caches hold.
#[derive(Debug, Clone, Copy, Default)]
struct HealthCache(Option<Health>);

impl PartialEq for HealthCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for HealthCache {}

/// A taint the node should carry.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DesiredTaint {
    pub key: String,
    pub value: String,
    pub effect: TaintEffect,
}

/// The `AcceleratorHealthy` condition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredCondition {
    pub status: bool,
    pub reason: String,
    pub message: String,
}

/// What the node should look like: the input of every node sink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    pub health: Health,
    pub handling: Option<Handling>,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<DesiredTaint>,
    pub condition: DesiredCondition,
    /// Active faults first (most severe first), then recovered ones (newest first).
    pub faults: Vec<Fault>,
    pub dropped_faults: u64,
    /// The devices each polled source last reported, by kind (`Ascend910` -> chip names).
    pub inventory: BTreeMap<String, BTreeSet<String>>,
}

/// The label every node gets.
pub const HEALTH_LABEL: &str = "faultline.io/health";

impl Engine {
    pub fn new() -> Self {
        Engine::default()
    }

    /// A counter bumped by every change that shows in `view`.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    pub fn boot_id(&self) -> Option<&str> {
        self.boot_id.as_deref()
    }

    pub fn detectors(&self) -> &BTreeMap<String, DetectorInfo> {
        &self.detectors
    }

    /// The devices of one kind last reported by `Observation::Inventory`.
    pub fn inventory(&self, kind: &str) -> Option<&BTreeSet<String>> {
        self.inventory.get(kind)
    }

    /// All faults, in key order.
    pub fn faults(&self) -> impl Iterator<Item = &FaultState> {
        self.faults.values()
    }

    /// The reports of faults the last [`Engine::step`] took, in order (for counting them: the
    /// engine's own account, not a second reading of the input).
    pub fn reports(&self) -> &[Report] {
        &self.reports.0
    }

    /// Whether a record's `device` is one of the node's inventory: `GPU-<index>` of a GPU
    /// whose index a polled source (NVML) reported, `pci-<address>` of such a GPU, or a name a
    /// source listed in an [`Observation::Inventory`] (Ascend chips). The kernel log never adds
    /// to it: its lines name PCI addresses and UUIDs, not indices, and no inventory.
    pub fn in_inventory(&self, device: &str) -> bool {
        if let Some(i) = device
            .strip_prefix("GPU-")
            .and_then(|n| n.parse::<u32>().ok().filter(|i| i.to_string() == n))
        {
            return self.devices.values().any(|d| d.index == Some(i));
        }
        if let Some(pci) = device
            .strip_prefix("pci-")
            .and_then(|a| a.parse::<PciAddr>().ok().filter(|p| p.to_string() == a))
        {
            return self.devices.get(&pci).is_some_and(|d| d.index.is_some());
        }
        self.inventory.values().any(|names| names.contains(device))
    }

    /// Applies one observation. Returns the events it caused.
    ///
    /// The cost of a step does not grow with the number of standing faults on the hot path (a
    /// repeat of an active fault): the node's health is cached and derived again only after a
    /// step that caused an event (only a new, escalated, reclassified or recovered fault can
    /// move it). Before that cache, two full passes over the faults per kernel-log record made
    /// a storm with 450 standing faults 4.5x slower per record than with 20.
    pub fn step(&mut self, ctx: Ctx<'_>, mut obs: Observation, now: Timestamp) -> Vec<EngineEvent> {
        caps::clamp(&mut obs);
        self.reports.0.clear();
        let before = self.cached_health(ctx.policy);
        let mut events = Vec::new();
        let tick = obs == Observation::Tick;
        match obs {
            Observation::Signal(s) => self.signal(ctx, s, now, &mut events),
            Observation::DeviceSeen { pci, uuid, index } => self.device_seen(pci, uuid, index),
            Observation::Boot { boot_id } => {
                if self.boot_id.as_deref().is_some_and(|old| old != boot_id) {
                    for f in self.faults.values_mut() {
                        if f.fault.active && f.fault.source == Source::Kmsg && !sticky(f) {
                            recover(f, now, "node rebooted".into(), &mut events);
                        }
                    }
                }
                if self.boot_id.as_deref() != Some(boot_id.as_str()) {
                    self.boot_id = Some(boot_id);
                    self.revision += 1;
                }
            }
            Observation::OperatorClear { code, device } => {
                // A PCI bus id in any form the kernel log or NVML prints it (`3b:00.0`,
                // `00000000:3B:00.0`) names the device of that normalized address.
                let pci = device.as_deref().and_then(|d| d.parse::<PciAddr>().ok());
                let pci = pci.map(|p| p.to_string());
                for f in self.faults.values_mut() {
                    let code_ok = code.as_deref().is_none_or(|c| c == f.fault.fault_code);
                    let dev_ok = device.as_deref().is_none_or(|d| {
                        d == f.fault.device
                            || Some(d) == f.fault.device_uuid.as_deref()
                            || Some(d) == f.fault.pci_bus_id.as_deref()
                            || (pci.is_some() && pci == f.fault.pci_bus_id)
                    });
                    if f.fault.active && code_ok && dev_ok {
                        recover(f, now, "cleared by operator".into(), &mut events);
                    }
                }
            }
            Observation::Detector {
                name,
                state,
                reason,
            } => self.detector(ctx, name, state, reason, now, &mut events),
            Observation::Level {
                source,
                device,
                domain,
                present,
            } => self.level(ctx, source, device, domain, present, now, &mut events),
            Observation::Inventory { kind, names } => {
                let names: BTreeSet<String> = names.into_iter().collect();
                if self.inventory.get(&kind) != Some(&names) {
                    self.inventory.insert(kind, names);
                    self.revision += 1;
                }
            }
            Observation::Tick => self.tick(ctx.policy, now, &mut events),
        }
        // History changes only with time or a recovery: not on the hot path of repeated signals.
        if tick
            || events
                .iter()
                .any(|e| matches!(e, EngineEvent::Recovered { .. }))
        {
            self.prune(ctx.policy, now);
        }
        if !events.is_empty() {
            self.revision += 1;
        }
        let after = if events.is_empty() {
            before
        } else {
            let h = self.health(ctx.policy);
            self.health_cache = HealthCache(Some(h));
            h
        };
        if after != before {
            events.push(EngineEvent::HealthChanged {
                from: before,
                to: after,
            });
        }
        events
    }

    /// Re-applies the catalog and policy to every fault (after a policy reload).
    pub fn reclassify(&mut self, ctx: Ctx<'_>) -> Vec<EngineEvent> {
        // The health of a level is the policy's: derived again under the new one.
        self.health_cache = HealthCache(None);
        let events = self
            .faults
            .values_mut()
            .filter_map(|f| classify_again(ctx, f))
            .collect();
        self.revision += 1;
        events
    }

    fn signal(&mut self, ctx: Ctx<'_>, s: Signal, now: Timestamp, events: &mut Vec<EngineEvent>) {
        let at = s.at.unwrap_or(now);
        let count = s.count.max(1);
        let (dkey, dname, uuid, pci) = self.resolve_device(s.device.as_ref());
        let key = format!("{}/{}", s.code, dkey);
        let adds = self.faults.get(&key).is_none_or(|f| !f.fault.active);
        if adds
            && self.fold_if_capped(
                ctx,
                &s,
                &dkey,
                (&dname, uuid.as_ref(), pci.as_ref()),
                now,
                events,
            )
        {
            return;
        }
        let burst = signed(ctx.policy.burst_window);
        match self.faults.get_mut(&key) {
            Some(f) => {
                let was_active = f.fault.active;
                // The condition is back within the recovery hold: the same fault goes on.
                f.resolving_since = None;
                f.fault.count = f.fault.count.saturating_add(count);
                if s.source != f.fault.source && !f.fault.also_seen_by.contains(&s.source) {
                    f.fault.also_seen_by.push(s.source);
                    f.fault.also_seen_by.sort();
                }
                if f.fault.device_uuid.is_none() {
                    f.fault.device_uuid = uuid;
                }
                let new_occurrence = !was_active || since(at, f.fault.last_seen) > burst;
                if at > f.fault.last_seen {
                    f.fault.last_seen = at;
                }
                if new_occurrence {
                    push_occurrence(&mut f.occurrences, at);
                }
                if !was_active {
                    f.fault.active = true;
                    f.fault.recovered_at = None;
                    f.fault.message = s.message;
                    f.active_since = at;
                    f.escalated = None;
                    f.fault.escalated_from = None;
                    set_handling(&mut f.fault, f.base);
                    events.push(EngineEvent::NewFault {
                        code: f.fault.fault_code.clone(),
                        device: f.fault.device.clone(),
                        handling: f.fault.fault_handling,
                        message: f.fault.message.clone(),
                    });
                }
                escalate(ctx.policy, f, now, events);
                self.reports.0.push(Report {
                    code: f.fault.fault_code.clone(),
                    device: f.fault.device.clone(),
                    count,
                });
                // Even a counters-only change shows in the record.
                self.revision += 1;
            }
            None => {
                let c = ctx.policy.classify(ctx.catalog, &s.code);
                let message = if s.message.is_empty() {
                    c.description.clone()
                } else {
                    s.message
                };
                let mut f = FaultState {
                    fault: Fault {
                        fault_type: c.fault_type,
                        fault_code: s.code.to_string(),
                        fault_handling: c.handling,
                        fault_level: c.handling,
                        large_model_fault_level: c.handling,
                        device: dname,
                        device_uuid: uuid,
                        pci_bus_id: pci,
                        source: s.source,
                        also_seen_by: Vec::new(),
                        message,
                        first_seen: at,
                        last_seen: at,
                        count,
                        active: true,
                        recovered_at: None,
                        escalated_from: None,
                    },
                    code: FaultCodeRepr::from(&s.code),
                    device_key: dkey,
                    base: c.handling,
                    escalated: None,
                    occurrences: VecDeque::from([at]),
                    active_since: at,
                    domain: None,
                    resolving_since: None,
                    folded: None,
                };
                events.push(EngineEvent::NewFault {
                    code: f.fault.fault_code.clone(),
                    device: f.fault.device.clone(),
                    handling: f.fault.fault_handling,
                    message: f.fault.message.clone(),
                });
                escalate(ctx.policy, &mut f, now, events);
                self.reports.0.push(Report {
                    code: f.fault.fault_code.clone(),
                    device: f.fault.device.clone(),
                    count,
                });
                self.faults.insert(key, f);
                self.revision += 1;
            }
        }
    }

    fn detector(
        &mut self,
        ctx: Ctx<'_>,
        name: String,
        state: DetectorState,
        reason: Option<String>,
        now: Timestamp,
        events: &mut Vec<EngineEvent>,
    ) {
        let info = DetectorInfo {
            state,
            reason: reason.clone(),
        };
        if self.detectors.get(&name) != Some(&info) {
            self.detectors.insert(name.clone(), info);
            self.revision += 1;
        }
        let device = DeviceRef::named(&name);
        let code = FaultCode::named("DETECTOR_DOWN");
        match state {
            DetectorState::Down => {
                let key = self.fault_key(&code, Some(&device));
                let already = self.faults.get(&key).is_some_and(|f| f.fault.active);
                if !already {
                    let msg = format!("{name}: {}", reason.unwrap_or_else(|| "down".into()));
                    let s = Signal::new(Source::Agent, code, Some(device), msg);
                    self.signal(ctx, s, now, events);
                }
            }
            DetectorState::Running | DetectorState::Starting | DetectorState::Idle => {
                let key = self.fault_key(&code, Some(&device));
                if let Some(f) = self.faults.get_mut(&key) {
                    if f.fault.active {
                        recover(f, now, format!("{name} is {}", state.as_str()), events);
                    }
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn level(
        &mut self,
        ctx: Ctx<'_>,
        source: Source,
        device: Option<DeviceRef>,
        domain: String,
        present: Vec<Signal>,
        now: Timestamp,
        events: &mut Vec<EngineEvent>,
    ) {
        // `None`: every device of the source in this domain.
        let dkey = device.as_ref().map(|d| self.resolve_device(Some(d)).0);
        let mut present = present;
        unlisted_follow_listed(ctx, &mut present);
        let mut seen = BTreeSet::new();
        for mut s in present {
            if s.device.is_none() {
                s.device = device.clone();
            }
            let key = self.fault_key(&s.code, s.device.as_ref());
            seen.insert(key.clone());
            match self.faults.get_mut(&key) {
                Some(f) if f.fault.active => {
                    // Still there: nothing to record; a running recovery hold is cancelled.
                    if f.resolving_since.take().is_some() {
                        self.revision += 1;
                    }
                    // An Ascend chip code read again with other codes beside it, or under
                    // another health word: its level is judged again from this read, as the
                    // device plugin judges a chip's codes on every read.
                    let code = FaultCodeRepr::from(&s.code);
                    if f.code != code {
                        f.code = code;
                        events.extend(classify_again(ctx, f));
                        self.revision += 1;
                    }
                    if f.domain.as_deref() != Some(domain.as_str()) {
                        f.domain = Some(domain.clone());
                    }
                }
                _ => {
                    self.signal(ctx, s, now, events);
                    if let Some(f) = self.faults.get_mut(&key) {
                        f.domain = Some(domain.clone());
                    }
                }
            }
        }
        for (k, f) in self.faults.iter_mut() {
            if f.fault.active
                && f.fault.source == source
                && dkey.as_ref().is_none_or(|d| *d == f.device_key)
                && f.domain.as_deref() == Some(domain.as_str())
                && !seen.contains(k)
            {
                let why = format!("{source} no longer reports it");
                resolve(ctx.policy, f, now, why, events);
            }
        }
    }
}

fn push_occurrence(q: &mut VecDeque<Timestamp>, at: Timestamp) {
    q.push_back(at);
    while q.len() > MAX_OCCURRENCES {
        q.pop_front();
    }
}

/// Applies the catalog and policy to `f`'s code again, keeping what escalation raised it to; the
/// event when an active fault's level changed.
fn classify_again(ctx: Ctx<'_>, f: &mut FaultState) -> Option<EngineEvent> {
    let c = ctx.policy.classify(ctx.catalog, &FaultCode::from(&f.code));
    let from = f.fault.fault_handling;
    f.base = c.handling;
    f.fault.fault_type = c.fault_type;
    let mut to = f.escalated.map_or(f.base, |e| e.max(f.base));
    // An overflow fault keeps the worst of what it holds (not kept, so not judged again).
    if let Some(folded) = &f.folded {
        to = to.max(folded.worst);
        if folded.worst >= f.base {
            f.fault.fault_type = folded.fault_type;
        }
    }
    set_handling(&mut f.fault, to);
    (from != to && f.fault.active).then(|| EngineEvent::Reclassified {
        code: f.fault.fault_code.clone(),
        device: f.fault.device.clone(),
        from,
        to,
    })
}

fn set_handling(f: &mut Fault, h: Handling) {
    f.fault_handling = h;
    f.fault_level = h;
    f.large_model_fault_level = h;
}

/// MindCluster's device plugin gives an Ascend chip the level of its listed codes whenever it has
/// one, and falls back to a default (SeparateNPU for a severe code) only when none of the chip's
/// codes is listed (`GetFaultTypeByCode`, then `getFaultTypeBySeverity`, in its
/// `pkg/common/fault_code.go`), on every read. So an unlisted chip code read together with a
/// listed one on the same chip is not severe: it never raises the chip above what the listed
/// code says. `level` judges an active fault again when this changes its code.
fn unlisted_follow_listed(ctx: Ctx<'_>, present: &mut [Signal]) {
    let listed = |s: &Signal| {
        matches!(s.code, FaultCode::Ascend { network: false, .. })
            && ctx.policy.classify(ctx.catalog, &s.code).known
    };
    if !present.iter().any(listed) {
        return;
    }
    for s in present.iter_mut() {
        if let FaultCode::Ascend {
            network: false,
            severe,
            ..
        } = &mut s.code
        {
            *severe = false;
        }
    }
}
