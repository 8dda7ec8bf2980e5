//! The policy file: per-code overrides, escalation and recovery rules, node actions.
//!
//! YAML (or JSON, which is YAML) with unknown fields rejected. `Policy::parse` returns either a
//! validated policy or an error that names the field path and, for syntax errors, the line and
//! column. The built-in default is the empty document: every field has a default.
//! Reading and reloading the file live in the agent (`source::policy_watch`); this module is
//! pure.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::catalog::ascend::{self, AscendTable};
use crate::catalog::{Catalog, Classification, FaultCode};
use crate::record::{FaultType, Handling, Health, PolicyStatus, Source};
pub use crate::rules::{EscalationRule, RecoveryRule};

/// Most occurrences the engine remembers per fault: frequency rules need at most `count` of
/// them, so the policy refuses a larger `count`.
pub const MAX_OCCURRENCES: usize = 100;

/// Override of one code's classification.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Override {
    #[serde(default)]
    pub fault_type: Option<FaultType>,
    #[serde(default)]
    pub handling: Option<Handling>,
}

/// A taint the node gets for a handling level; its value is the fault code.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaintSpec {
    pub key: String,
    pub effect: TaintEffect,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::PreferNoSchedule => "PreferNoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// What the node gets when this is its most severe active handling.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeAction {
    pub health: Health,
    #[serde(default)]
    pub taint: Option<TaintSpec>,
    /// Status of the `AcceleratorHealthy` condition.
    pub condition: bool,
}

/// Settings of the NVML source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvmlPolicy {
    /// How often each GPU is polled.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// An NVML call running longer than this marks the NVML detector down (it keeps waiting).
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// NVLinks per GPU that must be active (links 0..n). `None`: every link seen active since
    /// the agent started must stay active.
    pub nvlinks_expected: Option<u32>,
    /// NVLink error counters (replay + recovery + CRC) growing by this much within the window
    /// raise `NVLINK_ERRORS`.
    pub nvlink_error_threshold: u64,
    #[serde(with = "humantime_serde")]
    pub nvlink_error_window: Duration,
    /// PCIe replay counter growth that raises `PCIE_REPLAY_ERRORS`.
    pub pcie_replay_threshold: u64,
    #[serde(with = "humantime_serde")]
    pub pcie_replay_window: Duration,
    /// Also flag a PCIe generation below the maximum. Off by default: GPUs lower their link
    /// generation when idle to save power, so only the width is a fault by default.
    pub pcie_check_generation: bool,
}

impl Default for NvmlPolicy {
    fn default() -> Self {
        NvmlPolicy {
            poll_interval: Duration::from_secs(10),
            call_timeout: Duration::from_secs(30),
            nvlinks_expected: None,
            nvlink_error_threshold: 100,
            nvlink_error_window: Duration::from_secs(600),
            pcie_replay_threshold: 100,
            pcie_replay_window: Duration::from_secs(600),
            pcie_check_generation: false,
        }
    }
}

/// What faultline tells MindCluster: only public faults for its ClusterD. faultline writes none
/// of the device plugin's own documents (docs/ascend.md, "MindCluster's device documents").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MindClusterPolicy {
    /// The public-fault message is written again at least this often (± 25 % per node) while
    /// anything is published, even when nothing changed: ClusterD drops messages beyond its
    /// rate limit and after a restart replays only the last one.
    #[serde(with = "humantime_serde")]
    pub resync: Duration,
    /// MindCluster's public-fault interface (Kubernetes mode): faultline's own findings, which
    /// MindCluster's device plugin cannot see, as a ConfigMap its ClusterD reads.
    pub public_faults: PublicFaultPolicy,
}

impl Default for MindClusterPolicy {
    fn default() -> Self {
        MindClusterPolicy {
            resync: Duration::from_secs(300),
            public_faults: PublicFaultPolicy::default(),
        }
    }
}

/// Public faults for MindCluster's ClusterD (docs/ascend.md, "Public faults"). Off by default;
/// ClusterD drops them unless its `publicCustomization.json` lists `resource` and faultline's
/// codes (`manifests/examples/mindcluster/<release>/publicCustomization.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PublicFaultPolicy {
    pub enabled: bool,
    /// The `resource` field of every message (ClusterD's `publicFaultResource` must list it).
    pub resource: String,
}

impl Default for PublicFaultPolicy {
    fn default() -> Self {
        PublicFaultPolicy {
            enabled: false,
            resource: "faultline".to_string(),
        }
    }
}

/// Settings of the Ascend source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AscendPolicy {
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// A tool call running longer than this is killed and the detector marked down.
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// The operator's `faultCode.json`; it replaces the built-in table.
    pub fault_code_file: Option<PathBuf>,
    /// The operator's `faultCustomization.json`; replaces the built-in one.
    pub fault_customization_file: Option<PathBuf>,
    /// The link-up counter growing by this much within `link_flap_window` raises
    /// `NPU_LINK_FLAPPING` (0: off).
    pub link_flap_count: u64,
    #[serde(with = "humantime_serde")]
    pub link_flap_window: Duration,
    /// Ports below this speed raise `NPU_LINK_SPEED_LOW` (0: not checked).
    pub expected_speed_mbps: u64,
    pub mindcluster: MindClusterPolicy,
}

impl Default for AscendPolicy {
    fn default() -> Self {
        AscendPolicy {
            poll_interval: Duration::from_secs(10),
            call_timeout: Duration::from_secs(10),
            fault_code_file: None,
            fault_customization_file: None,
            link_flap_count: 3,
            link_flap_window: Duration::from_secs(600),
            expected_speed_mbps: 0,
            mindcluster: MindClusterPolicy::default(),
        }
    }
}

/// Peer-paired checks (docs/peer-checks.md). An agent takes part only with its credential
/// (`--node-token-file`, or `--peer-node-key-file` without Kubernetes); the coordinator reads
/// these settings from its own policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeerPolicy {
    /// Scheduled runs among all members; requested runs (`faultline check`) happen regardless.
    pub enabled: bool,
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Each wait is `interval` plus or minus up to this fraction of it, at random.
    pub jitter: f64,
    /// Round 1 pairs nodes with equal values of this node label first (empty: by name only).
    pub topology_label: String,
    /// Bytes each member contributes to the allgather.
    pub bytes: u64,
    pub iterations: u32,
    /// Deadline of one check (the probe is killed a little after it).
    #[serde(with = "humantime_serde")]
    pub check_timeout: Duration,
    /// The longest deadline this agent gives its probe, whatever an assignment announces
    /// (`check_timeout_ceiling`). A round after a timeout announces a longer deadline than
    /// `check_timeout` (up to `pairing::MAX_DEADLINE_FACTOR` times it), and the probe gets it
    /// up to this ceiling. Unset: that factor times `check_timeout`.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_check_timeout: Option<Duration>,
    /// Also time a GEMM (reported; not used for verdicts).
    pub gemm: bool,
    /// GPU checks: NCCL allgather and cuBLAS GEMM instead of TCP and the CPU (needs a probe
    /// built with the `gpu` feature); nodes whose GPUs run work are skipped by scheduled runs.
    pub gpu: bool,
    pub straggler_ratio: f64,
    pub straggler_mads: f64,
    pub max_rounds: usize,
}

impl Default for PeerPolicy {
    fn default() -> Self {
        PeerPolicy {
            enabled: true,
            interval: Duration::from_secs(30 * 60),
            jitter: 0.1,
            topology_label: String::new(),
            bytes: 64 << 20,
            iterations: 5,
            check_timeout: Duration::from_secs(10),
            max_check_timeout: None,
            gemm: false,
            gpu: false,
            // Chosen from measured noise: core::peer::pairing::DEFAULT_STRAGGLER_RATIO.
            straggler_ratio: crate::peer::pairing::DEFAULT_STRAGGLER_RATIO,
            straggler_mads: 3.0,
            max_rounds: 6,
        }
    }
}

impl Eq for PeerPolicy {}

impl PeerPolicy {
    /// The longest probe deadline this agent accepts from an assignment: `max_check_timeout`,
    /// or by default as long as a later round may announce (`MAX_DEADLINE_FACTOR` times
    /// `check_timeout`, after overloaded rounds).
    pub fn check_timeout_ceiling(&self) -> Duration {
        self.max_check_timeout.unwrap_or_else(|| {
            self.check_timeout
                .mul_f64(crate::peer::pairing::MAX_DEADLINE_FACTOR)
        })
    }
}

/// The Ascend tables in force: not part of the policy text but loaded from the files it names
/// (or built in).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AscendTables {
    /// The operator's `faultCode.json`, when given.
    pub codes: Option<Arc<AscendTable>>,
    /// Escalation rules from `faultCustomization.json` (the operator's, else the built-in).
    pub rules: Vec<EscalationRule>,
    /// What the operator's files hold that is read but not applied, one line each (keys of
    /// other releases, skipped rules, network codes moved out of chip lists): shown as policy
    /// warnings.
    pub notes: Vec<String>,
}

impl AscendTables {
    fn builtin() -> Self {
        AscendTables {
            codes: None,
            // The built-in file is tested to parse; an error here cannot happen at run time.
            rules: ascend::parse_customization("builtin", ascend::BUILTIN_CUSTOMIZATION)
                .map(|c| c.rules)
                .unwrap_or_default(),
            notes: Vec::new(),
        }
    }
}

/// The cluster-wide taint budget (Kubernetes mode): at most `max_percent` % of the nodes, and
/// at least `min_nodes`, may be newly tainted by faultline within `window`. Further taints are
/// withheld (recorded, and announced by a `TaintBudgetExceeded` Event) until the window moves on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaintBudget {
    /// Percentage of nodes (0..=100); 100 turns the budget off.
    pub max_percent: u32,
    /// Always allowed, whatever the percentage gives (so a small cluster can taint a node).
    pub min_nodes: u32,
    #[serde(with = "humantime_serde")]
    pub window: Duration,
}

impl Default for TaintBudget {
    fn default() -> Self {
        TaintBudget {
            max_percent: 10,
            min_nodes: 1,
            window: Duration::from_secs(600),
        }
    }
}

impl TaintBudget {
    /// How many nodes may be newly tainted within the window, out of `nodes`.
    pub fn limit(&self, nodes: u32) -> u32 {
        if self.max_percent >= 100 {
            return nodes.max(self.min_nodes).max(1);
        }
        let by_share = (u64::from(nodes) * u64::from(self.max_percent) / 100) as u32;
        by_share.max(self.min_nodes)
    }
}

/// The whole policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// Per-code classification overrides, keyed by fault code.
    pub overrides: BTreeMap<String, Override>,
    pub escalation: Vec<EscalationRule>,
    pub recovery: Vec<RecoveryRule>,
    /// Node action per handling level; levels left out keep their defaults.
    pub node_actions: BTreeMap<Handling, NodeAction>,
    /// Repeats of a fault closer together than this are one occurrence (for `count` rules).
    #[serde(with = "humantime_serde")]
    pub burst_window: Duration,
    /// How long recovered faults stay in the record as history.
    #[serde(with = "humantime_serde")]
    pub recovered_retention: Duration,
    /// At most this many recovered faults are kept (oldest dropped first).
    pub max_recovered: usize,
    /// At most this many active faults per device; a new one past it is folded into the
    /// device's `FAULTS_FOLDED` fault (docs/policy.md, "Caps").
    pub max_active_per_device: usize,
    /// At most this many active faults on the node, all devices together; a new one past it is
    /// folded into the node's `FAULTS_FOLDED` fault.
    pub max_active: usize,
    /// Expected number of GPUs on this node (0: do not check). Used by the NVML source.
    pub expected_gpus: u32,
    pub nvml: NvmlPolicy,
    pub ascend: AscendPolicy,
    pub peer: PeerPolicy,
    pub taint_budget: TaintBudget,
    /// Loaded from the files `ascend` names; see `Policy::with_ascend_files`.
    #[serde(skip)]
    pub ascend_tables: AscendTables,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            overrides: BTreeMap::new(),
            escalation: Vec::new(),
            recovery: default_recovery(),
            node_actions: BTreeMap::new(),
            burst_window: Duration::from_secs(5),
            recovered_retention: Duration::from_secs(24 * 3600),
            max_recovered: 100,
            max_active_per_device: DEFAULT_MAX_ACTIVE_PER_DEVICE,
            max_active: DEFAULT_MAX_ACTIVE,
            expected_gpus: 0,
            nvml: NvmlPolicy::default(),
            ascend: AscendPolicy::default(),
            peer: PeerPolicy::default(),
            taint_budget: TaintBudget::default(),
            ascend_tables: AscendTables::builtin(),
        }
    }
}

/// Default cap of active faults per device. A GPU shows a handful of distinct faults when it
/// breaks (an Xid or two, ECC, a link, PCIe); 64 distinct codes on one device is no real failure
/// any more but a flood, and the count of what is folded says as much as more entries would.
pub const DEFAULT_MAX_ACTIVE_PER_DEVICE: usize = 64;
/// Default cap of active faults per node: 8 GPUs, 6 NVSwitches, NICs and the node itself, each
/// at its device cap, stay under it (15 x 64 = 960).
pub const DEFAULT_MAX_ACTIVE: usize = 1024;
/// Largest `max_active` and `max_recovered` a policy may set: with them, and every fault at its
/// largest size, `state.json` and `faults.json` stay well under what the agent reads back at
/// start (`agent/src/sink/file.rs`, the worst-case test there).
pub const MAX_ACTIVE_LIMIT: usize = 2048;
/// See [`MAX_ACTIVE_LIMIT`].
pub const MAX_RECOVERED_LIMIT: usize = 1000;

/// The default recovery rules (docs/policy.md explains them).
fn default_recovery() -> Vec<RecoveryRule> {
    vec![
        RecoveryRule {
            name: Some("agent-log-loss".into()),
            codes: vec!["KMSG_LOSS".into()],
            sources: vec![],
            max_handling: None,
            clear_after: Duration::from_secs(600),
        },
        RecoveryRule {
            name: Some("app-level-kernel-faults".into()),
            codes: vec![],
            sources: vec![Source::Kmsg],
            max_handling: Some(Handling::RestartBusiness),
            clear_after: Duration::from_secs(3600),
        },
    ]
}

/// The health of [`default_node_action`], without building the action.
pub fn default_health(h: Handling) -> Health {
    use Handling::*;
    match h {
        ManuallySeparateNPU | SeparateNPU => Health::Unhealthy,
        PreSeparateNPU | RestartNPU | FreeRestartNPU | RestartBusiness | RestartRequest => {
            Health::Degraded
        }
        SubHealthFault | NotHandleFault => Health::Healthy,
    }
}

/// The default node action for a level (docs/policy.md's table); its health is
/// [`default_health`].
pub fn default_node_action(h: Handling) -> NodeAction {
    use Handling::*;
    let taint = |key: &str, effect| {
        Some(TaintSpec {
            key: key.into(),
            effect,
        })
    };
    let (taint, condition) = match h {
        ManuallySeparateNPU | SeparateNPU => (
            taint("faultline.io/unhealthy", TaintEffect::NoSchedule),
            false,
        ),
        PreSeparateNPU => (
            taint("faultline.io/degraded", TaintEffect::PreferNoSchedule),
            false,
        ),
        RestartNPU | FreeRestartNPU | RestartBusiness | RestartRequest | SubHealthFault
        | NotHandleFault => (None, true),
    };
    NodeAction {
        health: default_health(h),
        taint,
        condition,
    }
}

/// A rejected policy: where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{location}: {message}")]
pub struct PolicyError {
    /// `field path` and/or `line N column M`.
    pub location: String,
    pub message: String,
}

impl Policy {
    /// Parses and validates policy text (YAML or JSON).
    pub fn parse(text: &str) -> Result<Policy, PolicyError> {
        if text.trim().is_empty() {
            return Ok(Policy::default());
        }
        // serde-saphyr (the YAML parser kube-client uses too) parses within a budget: nesting
        // depth, events, aliases. Its default budget keeps a hostile file from costing much.
        let mut options = serde_saphyr::Options::default();
        options.with_snippet = false;
        let mut path = String::new();
        let parsed = serde_saphyr::with_deserializer_from_str_with_options(text, options, |de| {
            serde_path_to_error::deserialize(de).map_err(|e| {
                path = e.path().to_string();
                e.into_inner()
            })
        });
        let policy: Policy = parsed.map_err(|inner| {
            let path = if path == "?" { String::new() } else { path };
            let line = inner
                .location()
                .map(|l| format!("line {} column {}", l.line(), l.column()));
            let location = match (path.as_str(), line) {
                (".", Some(l)) | ("", Some(l)) => l,
                (".", None) | ("", None) => "policy".to_string(),
                (p, Some(l)) => format!("field {p} ({l})"),
                (p, None) => format!("field {p}"),
            };
            // The message ends with " at line N, column M"; the location says it already.
            let msg = inner.to_string().replace(
                ", set DuplicateKeyPolicy in Options if acceptable",
                " (each key may appear once)",
            );
            let msg = match msg.find(" at line ") {
                Some(i) => msg[..i].to_string(),
                None => msg,
            };
            // It may also start with the path, which the location says too.
            let message = msg
                .strip_prefix(&format!("{path}: "))
                .map(str::to_string)
                .unwrap_or(msg);
            PolicyError { location, message }
        })?;
        let mut policy = policy;
        policy.ascend_tables = AscendTables::builtin();
        policy.validate()?;
        Ok(policy)
    }

    /// Applies the Ascend files the policy names, given as `(path, text)`: the operator's
    /// `faultCode.json` and `faultCustomization.json`. The caller reads them (this stays pure).
    pub fn with_ascend_files(
        mut self,
        codes: Option<(&str, &str)>,
        customization: Option<(&str, &str)>,
    ) -> Result<Policy, PolicyError> {
        let err = |field: &str, e: ascend::AscendFileError| PolicyError {
            location: format!("field ascend.{field}"),
            message: e.to_string(),
        };
        if let Some((path, text)) = codes {
            let t = AscendTable::parse(path, text).map_err(|e| err("fault_code_file", e))?;
            let notes = &mut self.ascend_tables.notes;
            notes.extend(
                t.ignored_keys
                    .iter()
                    .map(|k| format!("{path}: {k}: not a level this agent knows; ignored")),
            );
            notes.extend(t.moved.iter().map(|m| format!("{path}: {m}")));
            self.ascend_tables.codes = Some(Arc::new(t));
        }
        if let Some((path, text)) = customization {
            let c = ascend::parse_customization(path, text)
                .map_err(|e| err("fault_customization_file", e))?;
            self.ascend_tables.rules = c.rules;
            self.ascend_tables
                .notes
                .extend(c.notes.iter().map(|n| format!("{path}: {n}")));
        }
        Ok(self)
    }

    /// What the agent warns about when it loads the policy: a node action that the shipped
    /// admission policy refuses, and the notes of the Ascend tables.
    pub fn warnings(&self) -> Vec<String> {
        self.node_actions
            .iter()
            .filter(|(_, a)| {
                a.taint
                    .as_ref()
                    .is_some_and(|t| t.effect == TaintEffect::NoExecute)
            })
            .map(|(level, _)| {
                format!(
                    "node_actions.{level:?} taints with NoExecute: the shipped admission \
                     policy (manifests/base/admission.yaml) refuses that effect, and every \
                     taint write of this node with it, until its taintEffects variable \
                     includes NoExecute"
                )
            })
            .chain(self.ascend_tables.notes.iter().cloned())
            .collect()
    }

    /// Every escalation rule in force: the policy's own, then the Ascend customization's.
    pub fn escalation_rules(&self) -> impl Iterator<Item = &EscalationRule> {
        self.escalation
            .iter()
            .chain(self.ascend_tables.rules.iter())
    }

    /// How long a fault with this code must stay gone to count as recovered (0: at once).
    pub fn recover_hold(&self, code: &str) -> Duration {
        self.escalation_rules()
            .filter(|r| r.codes.iter().any(|c| c == code))
            .filter_map(|r| r.recover_after)
            .max()
            .unwrap_or(Duration::ZERO)
    }

    /// Every duration in the policy with its allowed range (docs/policy.md, "Ranges"). A value
    /// outside is refused: a poll interval of years would silently stop a detector.
    fn durations(&self) -> Vec<(String, Duration, Duration, Duration)> {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        let (min, hour, day) = (s(60), s(3600), s(86_400));
        let mut v = vec![
            (
                "burst_window".into(),
                self.burst_window,
                Duration::ZERO,
                hour,
            ),
            // Long retention is harmless: `max_recovered` bounds the history anyway.
            (
                "recovered_retention".into(),
                self.recovered_retention,
                Duration::ZERO,
                20 * 365 * day,
            ),
            (
                "nvml.poll_interval".into(),
                self.nvml.poll_interval,
                ms(100),
                hour,
            ),
            (
                "nvml.call_timeout".into(),
                self.nvml.call_timeout,
                ms(100),
                10 * min,
            ),
            (
                "nvml.nvlink_error_window".into(),
                self.nvml.nvlink_error_window,
                s(1),
                7 * day,
            ),
            (
                "nvml.pcie_replay_window".into(),
                self.nvml.pcie_replay_window,
                s(1),
                7 * day,
            ),
            (
                "ascend.poll_interval".into(),
                self.ascend.poll_interval,
                ms(100),
                hour,
            ),
            (
                "ascend.call_timeout".into(),
                self.ascend.call_timeout,
                ms(100),
                10 * min,
            ),
            (
                "ascend.link_flap_window".into(),
                self.ascend.link_flap_window,
                s(1),
                7 * day,
            ),
            (
                "ascend.mindcluster.resync".into(),
                self.ascend.mindcluster.resync,
                s(1),
                day,
            ),
            ("peer.interval".into(), self.peer.interval, s(10), 7 * day),
            (
                "peer.check_timeout".into(),
                self.peer.check_timeout,
                ms(100),
                10 * min,
            ),
            (
                "peer.max_check_timeout".into(),
                self.peer.check_timeout_ceiling(),
                ms(100),
                40 * min,
            ),
            (
                "taint_budget.window".into(),
                self.taint_budget.window,
                s(1),
                7 * day,
            ),
        ];
        for (i, r) in self.escalation.iter().enumerate() {
            let f = |name: &str| format!("escalation[{i}].{name}");
            if let Some(w) = r.window {
                v.push((f("window"), w, s(1), 366 * day));
            }
            if let Some(d) = r.duration {
                v.push((f("duration"), d, s(1), 366 * day));
            }
            if let Some(d) = r.recover_after {
                v.push((f("recover_after"), d, s(1), 7 * day));
            }
        }
        for (i, r) in self.recovery.iter().enumerate() {
            v.push((
                format!("recovery[{i}].clear_after"),
                r.clear_after,
                s(1),
                366 * day,
            ));
        }
        v
    }

    /// Every count in the policy with its allowed range (docs/policy.md, "Ranges").
    fn counts(&self) -> Vec<(String, u64, u64, u64)> {
        let mut v = vec![
            (
                "max_recovered".into(),
                self.max_recovered as u64,
                0,
                MAX_RECOVERED_LIMIT as u64,
            ),
            (
                "max_active".into(),
                self.max_active as u64,
                1,
                MAX_ACTIVE_LIMIT as u64,
            ),
            (
                "max_active_per_device".into(),
                self.max_active_per_device as u64,
                1,
                MAX_ACTIVE_LIMIT as u64,
            ),
            (
                "expected_gpus".into(),
                u64::from(self.expected_gpus),
                0,
                1024,
            ),
            (
                "nvml.nvlink_error_threshold".into(),
                self.nvml.nvlink_error_threshold,
                1,
                1 << 40,
            ),
            (
                "nvml.pcie_replay_threshold".into(),
                self.nvml.pcie_replay_threshold,
                1,
                1 << 40,
            ),
            (
                "ascend.link_flap_count".into(),
                self.ascend.link_flap_count,
                0,
                10_000,
            ),
            (
                "ascend.expected_speed_mbps".into(),
                self.ascend.expected_speed_mbps,
                0,
                10_000_000,
            ),
            ("peer.bytes".into(), self.peer.bytes, 1, 4 << 30),
            (
                "peer.iterations".into(),
                u64::from(self.peer.iterations),
                1,
                1000,
            ),
            ("peer.max_rounds".into(), self.peer.max_rounds as u64, 2, 20),
            (
                "taint_budget.max_percent".into(),
                u64::from(self.taint_budget.max_percent),
                0,
                100,
            ),
            (
                "taint_budget.min_nodes".into(),
                u64::from(self.taint_budget.min_nodes),
                0,
                100_000,
            ),
        ];
        for (i, r) in self.escalation.iter().enumerate() {
            if let Some(c) = r.count {
                // The engine remembers this many occurrences per fault: a larger count could
                // never be reached (MindCluster's `Times` is at most 100 too).
                let most = MAX_OCCURRENCES as u64;
                v.push((format!("escalation[{i}].count"), u64::from(c), 1, most));
            }
        }
        v
    }

    fn validate(&self) -> Result<(), PolicyError> {
        let err = |location: String, message: &str| {
            Err(PolicyError {
                location,
                message: message.to_string(),
            })
        };
        let human = |d: Duration| humantime::format_duration(d).to_string();
        for (field, v, lo, hi) in self.durations() {
            if v < lo || v > hi {
                let range = if lo.is_zero() {
                    format!("must be at most {}", human(hi))
                } else {
                    format!("must be between {} and {}", human(lo), human(hi))
                };
                return err(format!("field {field}"), &range);
            }
        }
        for (field, v, lo, hi) in self.counts() {
            if v < lo || v > hi {
                return err(
                    format!("field {field}"),
                    &format!("must be between {lo} and {hi}"),
                );
            }
        }
        // ClusterD compares `resource` with its configured names; keep it to the characters
        // its other identifiers allow, so a typo is refused here and not dropped there.
        let resource = &self.ascend.mindcluster.public_faults.resource;
        if resource.is_empty()
            || resource.len() > 64
            || !resource
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return err(
                "field ascend.mindcluster.public_faults.resource".into(),
                "1 to 64 letters, digits, '-', '_' or '.'",
            );
        }
        for code in self.overrides.keys() {
            if !valid_code(code) {
                return err(
                    format!("field overrides.{code}"),
                    "not a fault code (letters, digits and _ only)",
                );
            }
        }
        for (i, r) in self.escalation.iter().enumerate() {
            let at = |f: &str| format!("field escalation[{i}]{f}");
            if r.codes.is_empty() {
                return err(at(".codes"), "must list at least one fault code");
            }
            if let Some(c) = r.codes.iter().find(|c| !valid_code(c)) {
                return err(at(".codes"), &format!("{c:?} is not a fault code"));
            }
            // Zero counts and durations are refused by the range table above.
            match (r.count, r.window, r.duration) {
                (Some(_), Some(_), None) => {}
                (None, None, Some(_)) => {}
                _ => {
                    return err(
                        at(""),
                        "needs either `count` with `window` (frequency) or `duration` alone",
                    )
                }
            }
        }
        for (i, r) in self.recovery.iter().enumerate() {
            if let Some(c) = r.codes.iter().find(|c| !valid_code(c)) {
                return err(
                    format!("field recovery[{i}].codes"),
                    &format!("{c:?} is not a fault code"),
                );
            }
        }
        let p = &self.peer;
        if !(0.0..=0.5).contains(&p.jitter) {
            return err("field peer.jitter".into(), "must be between 0 and 0.5");
        }
        if !(p.straggler_ratio.is_finite() && p.straggler_ratio > 1.0) {
            return err("field peer.straggler_ratio".into(), "must be above 1");
        }
        if !(p.straggler_mads.is_finite() && p.straggler_mads >= 0.0) {
            return err("field peer.straggler_mads".into(), "must be 0 or more");
        }
        if p.check_timeout_ceiling() < p.check_timeout {
            return err(
                "field peer.max_check_timeout".into(),
                "must be at least peer.check_timeout",
            );
        }
        for (h, a) in &self.node_actions {
            if let Some(t) = &a.taint {
                if !t.key.starts_with("faultline.io/") {
                    return err(
                        format!("field node_actions.{h}.taint.key"),
                        "the agent only owns taints under faultline.io/",
                    );
                }
            }
        }
        Ok(())
    }

    /// The classification of a code: the catalog's, then this policy's override.
    pub fn classify(&self, catalog: &Catalog, code: &FaultCode) -> Classification {
        let mut c = match code {
            FaultCode::Ascend {
                code,
                network,
                severe,
            } => catalog.classify_ascend(
                self.ascend_tables.codes.as_deref(),
                code,
                *network,
                *severe,
            ),
            _ => catalog.classify(code),
        };
        if let Some(o) = self.overrides.get(&code.to_string()) {
            if let Some(t) = o.fault_type {
                c.fault_type = t;
            }
            if let Some(h) = o.handling {
                c.handling = h;
            }
        }
        c
    }

    /// Whether `code` (a record's `fault_code`) is one the catalog lists or this policy names:
    /// an override, an escalation or recovery rule (the Ascend customization's included), the
    /// operator's Ascend fault code table. A bounded set: what a source reports cannot add to
    /// it, only the catalog and the policy file can (the metrics' `code` label,
    /// docs/metrics.md).
    pub fn defines(&self, catalog: &Catalog, code: &str) -> bool {
        catalog.lists(code)
            || self.overrides.contains_key(code)
            || self
                .escalation_rules()
                .any(|r| r.codes.iter().any(|c| c == code))
            || self
                .recovery
                .iter()
                .any(|r| r.codes.iter().any(|c| c == code))
            || self
                .ascend_tables
                .codes
                .as_deref()
                .is_some_and(|t| crate::catalog::ascend_listed(t, code))
    }

    /// The node health a level maps to; unlike [`Policy::node_action`], allocates nothing.
    pub fn health_of(&self, h: Handling) -> Health {
        self.node_actions
            .get(&h)
            .map_or_else(|| default_health(h), |a| a.health)
    }

    /// The node action for a level.
    pub fn node_action(&self, h: Handling) -> NodeAction {
        self.node_actions
            .get(&h)
            .cloned()
            .unwrap_or_else(|| default_node_action(h))
    }
}

/// Fault codes are what Kubernetes accepts as a label/taint value: letters, digits, `_`, `-`.
pub fn valid_code(c: &str) -> bool {
    !c.is_empty()
        && c.len() <= 63
        && c.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Hex sha256 of a policy text.
pub fn checksum(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The policy in force and its status, as the policy watcher publishes it to the engine loop,
/// the sources and the sinks.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedPolicy {
    pub policy: Arc<Policy>,
    pub status: PolicyStatus,
}

impl LoadedPolicy {
    /// The built-in policy, in force until a file is loaded (or when none is given).
    pub fn builtin() -> Self {
        LoadedPolicy {
            policy: Arc::new(Policy::default()),
            status: PolicyStatus {
                source: "builtin".into(),
                checksum: checksum(""),
                error: None,
                loading: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes a policy defines are the catalog's plus what it names (overrides, rules, its
    /// Ascend table); an unlisted code is not, until a policy names it.
    #[test]
    fn defines_the_catalog_codes_and_the_policys_own() {
        let catalog = Catalog::builtin().unwrap();
        let base = Policy::default();
        assert!(base.defines(&catalog, "Xid79"));
        assert!(base.defines(&catalog, "KMSG_LOSS"));
        for code in ["Xid99999", "MY_CODE", "RULE_CODE", "QUIET_CODE", "ABCD0001"] {
            assert!(!base.defines(&catalog, code), "{code}");
        }
        let p = Policy::parse(
            "overrides:\n  Xid99999: { handling: NotHandleFault }\n  MY_CODE: { handling: NotHandleFault }\n\
             escalation:\n  - { name: r, codes: [RULE_CODE], count: 2, window: 1m, handling: SeparateNPU }\n\
             recovery:\n  - { codes: [QUIET_CODE], clear_after: 10m }\n",
        )
        .unwrap()
        .with_ascend_files(Some(("codes.json", r#"{"SeparateNPUCodes": ["abcd0001"]}"#)), None)
        .unwrap();
        for code in [
            "Xid79",
            "Xid99999",
            "MY_CODE",
            "RULE_CODE",
            "QUIET_CODE",
            "ABCD0001",
        ] {
            assert!(p.defines(&catalog, code), "{code}");
        }
        assert!(
            !p.defines(&catalog, "abcd0001"),
            "only the records' spelling"
        );
        assert!(!p.defines(&catalog, "Xid99998"));
    }

    #[test]
    fn empty_text_is_the_default() {
        assert_eq!(Policy::parse(""), Ok(Policy::default()));
        assert_eq!(Policy::parse("{}"), Ok(Policy::default()));
    }

    #[test]
    fn full_policy_parses() {
        let p = Policy::parse(
            r#"
overrides:
  Xid43: { handling: RestartBusiness }
  "80E01801": { fault_type: CardUnhealthy }
escalation:
  - codes: [Xid13, Xid31]
    count: 3
    window: 24h
    handling: PreSeparateNPU
  - name: link-down-lasting
    codes: ["81078603"]
    duration: 20s
    handling: PreSeparateNPU
recovery:
  - codes: [NVLINK_ERRORS]
    clear_after: 30m
node_actions:
  PreSeparateNPU: { health: Unhealthy, taint: { key: faultline.io/unhealthy, effect: NoSchedule }, condition: false }
burst_window: 2s
expected_gpus: 8
"#,
        )
        .expect("valid");
        assert_eq!(p.escalation[0].window, Some(Duration::from_secs(86400)));
        assert_eq!(p.escalation[1].duration, Some(Duration::from_secs(20)));
        assert_eq!(p.expected_gpus, 8);
        assert_eq!(
            p.node_action(Handling::PreSeparateNPU).health,
            Health::Unhealthy
        );
        assert_eq!(
            p.node_action(Handling::SeparateNPU),
            default_node_action(Handling::SeparateNPU)
        );
    }

    /// Each bad policy is rejected with an error that names where the problem is.
    #[test]
    fn bad_policies_name_field_and_line() {
        let cases: &[(&str, &[&str])] = &[
            ("escalation:\n  - codes: [Xid13]\n    count: three\n    window: 1h\n    handling: SeparateNPU\n",
             &["escalation[0].count", "line 3"]),
            ("overrides:\n  Xid13: { handling: Reboot }\n", &["overrides.Xid13.handling", "Reboot"]),
            ("escalation:\n  - codes: [Xid13]\n    count: 2\n    window: 5 parsecs\n    handling: SeparateNPU\n",
             &["escalation[0].window"]),
            ("escalation:\n  - codes: [Xid13]\n    handling: SeparateNPU\n", &["escalation[0]", "count"]),
            ("escalation:\n  - codes: []\n    duration: 1s\n    handling: SeparateNPU\n", &["escalation[0].codes"]),
            ("escalation:\n  - codes: [Xid13]\n    count: 0\n    window: 1h\n    handling: SeparateNPU\n", &["escalation[0].count"]),
            ("recovery:\n  - clear_after: 0s\n", &["recovery[0].clear_after"]),
            ("burst_windw: 1s\n", &["unknown field", "burst_windw"]),
            ("overrides: [1, 2\n", &["line"]),
            ("node_actions:\n  SeparateNPU: { health: Unhealthy, taint: { key: example.com/x, effect: NoSchedule }, condition: false }\n",
             &["node_actions.SeparateNPU.taint.key"]),
            ("overrides:\n  \"bad code!\": {}\n", &["overrides.bad code!"]),
            ("taint_budget: { max_percent: 150 }\n", &["taint_budget.max_percent"]),
            ("taint_budget: { window: 0s }\n", &["taint_budget.window"]),
            // Too large is refused too: a poll interval of years would silently stop polling.
            ("nvml: { poll_interval: 500000000000y }\n", &["nvml.poll_interval", "between 100ms and 1h"]),
            ("nvml: { call_timeout: 1d }\n", &["nvml.call_timeout", "10m"]),
            ("ascend: { poll_interval: 2h }\n", &["ascend.poll_interval"]),
            ("peer: { interval: 30d }\n", &["peer.interval"]),
            ("burst_window: 2h\n", &["burst_window", "at most 1h"]),
            ("recovered_retention: 21y\n", &["recovered_retention"]),
            ("expected_gpus: 100000\n", &["expected_gpus", "between 0 and 1024"]),
            ("max_recovered: 10000000\n", &["max_recovered"]),
            ("max_recovered: 1001\n", &["max_recovered", "between 0 and 1000"]),
            ("max_active: 0\n", &["max_active", "between 1 and 2048"]),
            ("max_active: 2049\n", &["max_active", "between 1 and 2048"]),
            ("max_active_per_device: 0\n", &["max_active_per_device", "between 1 and 2048"]),
            ("escalation:\n  - codes: [Xid13]\n    count: 2\n    window: 1000y\n    handling: SeparateNPU\n", &["escalation[0].window"]),
            ("escalation:\n  - codes: [Xid13]\n    count: 100000000\n    window: 1h\n    handling: SeparateNPU\n", &["escalation[0].count"]),
            // More occurrences than the engine remembers could never be counted.
            ("escalation:\n  - codes: [Xid13]\n    count: 101\n    window: 1h\n    handling: SeparateNPU\n", &["escalation[0].count", "between 1 and 100"]),
            ("recovery:\n  - clear_after: 1000y\n", &["recovery[0].clear_after"]),
            ("ascend: { link_flap_count: 100000 }\n", &["ascend.link_flap_count"]),
            ("ascend: { mindcluster: { public_faults: { resource: \"fault line\" } } }\n",
             &["ascend.mindcluster.public_faults.resource", "letters, digits"]),
            ("ascend: { mindcluster: { public_faults: { enabled: true, resource: \"\" } } }\n",
             &["ascend.mindcluster.public_faults.resource"]),
            ("ascend: { mindcluster: { public_faults: { enable: true } } }\n", &["unknown field", "enable"]),
            // The device plugin's document is not faultline's to write (docs/ascend.md): the
            // switch that wrote it is gone, and a policy that still sets it is refused.
            ("ascend: { mindcluster: { enabled: true } }\n", &["unknown field", "enabled", "ascend"]),
        ];
        for (text, needles) in cases {
            let err = Policy::parse(text).expect_err(text).to_string();
            for n in *needles {
                assert!(err.contains(n), "error {err:?} for {text:?} lacks {n:?}");
            }
        }
    }

    /// The tool paths moved to agent flags: a policy that still has them loads (an upgrade
    /// keeps the operator's policy), they choose nothing, and the warnings name each one.
    #[test]
    fn a_no_execute_taint_is_loaded_with_a_warning_about_the_admission_policy() {
        let p = Policy::parse(
            "node_actions:\n  SeparateNPU: { health: Unhealthy, taint: { key: faultline.io/unhealthy, effect: NoExecute }, condition: false }\n",
        )
        .unwrap();
        let w = p.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("SeparateNPU")
                && w[0].contains("NoExecute")
                && w[0].contains("taintEffects"),
            "{}",
            w[0]
        );
    }

    /// The policy cannot name the Ascend tools, which run as root: whoever may edit it must not
    /// choose what runs (the agent's `--npu-smi` and `--hccn-tool` do). A policy that tries is
    /// refused, naming the field.
    #[test]
    fn a_policy_naming_a_tool_is_refused() {
        for field in ["npu_smi", "hccn_tool"] {
            let e = Policy::parse(&format!(
                "ascend:\n  {field}: /tmp/evil\n  poll_interval: 5s\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains(field), "{e}");
        }
        assert!(Policy::default().warnings().is_empty());
    }

    /// Deep nesting and repeated keys are refused with a location. The parser streams into the
    /// typed policy, so nesting stops at the first value of the wrong shape (and its budget caps
    /// depth, aliases and events for anything that gets further).
    #[test]
    fn hostile_yaml_is_refused_with_a_clear_error() {
        let deep = format!(
            "overrides: {}{}\n",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let err = Policy::parse(&deep).expect_err("deep nesting").to_string();
        assert!(err.contains("overrides") && err.contains("line 1"), "{err}");
        let err = Policy::parse("burst_window: 1s\nburst_window: 2s\n")
            .expect_err("duplicate key")
            .to_string();
        assert!(
            err.contains("duplicate") && err.contains("line 2") && !err.contains("Options"),
            "{err}"
        );
    }

    /// The policy shipped in the manifests parses, and so does every example in its comments.
    #[test]
    fn shipped_policy_and_its_commented_examples_parse() {
        let cm: serde_json::Value =
            serde_saphyr::from_str(include_str!("../../manifests/base/policy.yaml")).unwrap();
        let text = cm["data"]["policy.yaml"].as_str().unwrap();
        let p = Policy::parse(text).unwrap();
        assert_eq!(p.taint_budget, TaintBudget::default());
        // Uncomment every example block ("# key:" lines and their indented "#   ..." lines).
        let uncommented: String = text
            .lines()
            .filter_map(|l| {
                let t = l.trim_start();
                let body = t.strip_prefix("# ")?;
                let is_yaml = body.starts_with("  ")
                    || body.split_once(':').is_some_and(|(k, _)| {
                        !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    });
                is_yaml.then(|| format!("{body}\n"))
            })
            .collect();
        assert!(uncommented.contains("overrides:"), "{uncommented}");
        Policy::parse(&uncommented).unwrap_or_else(|e| panic!("{e}\n{uncommented}"));
    }

    #[test]
    fn peer_settings_are_checked() {
        let p =
            Policy::parse("peer:\n  interval: 5m\n  bytes: 4096\n  check_timeout: 3s\n").unwrap();
        assert_eq!(p.peer.interval, Duration::from_secs(300));
        assert_eq!(
            (p.peer.bytes, p.peer.iterations),
            (4096, 5),
            "unset fields keep defaults"
        );
        for (text, field) in [
            ("peer: { interval: 1s }", "peer.interval"),
            ("peer: { jitter: 0.9 }", "peer.jitter"),
            ("peer: { bytes: 0 }", "peer.bytes"),
            ("peer: { bytes: 8589934592 }", "peer.bytes"),
            ("peer: { iterations: 0 }", "peer.iterations"),
            ("peer: { check_timeout: 10ms }", "peer.check_timeout"),
            ("peer: { check_timeout: 1h }", "peer.check_timeout"),
            ("peer: { straggler_ratio: 1.0 }", "peer.straggler_ratio"),
            ("peer: { straggler_mads: -1 }", "peer.straggler_mads"),
            ("peer: { max_rounds: 1 }", "peer.max_rounds"),
            ("peer: { max_check_timeout: 1h }", "peer.max_check_timeout"),
            (
                "peer: { check_timeout: 20s, max_check_timeout: 15s }",
                "peer.max_check_timeout",
            ),
        ] {
            let e = Policy::parse(text).unwrap_err();
            assert!(e.location.contains(field), "{text}: {e}");
        }
        // The ceiling on announced deadlines: by default what a later round may announce
        // (4x the check timeout), or as set.
        assert_eq!(p.peer.check_timeout_ceiling(), Duration::from_secs(12));
        assert_eq!(
            PeerPolicy::default().check_timeout_ceiling(),
            Duration::from_secs(40)
        );
        let set = Policy::parse("peer: { max_check_timeout: 25s }").unwrap();
        assert_eq!(set.peer.check_timeout_ceiling(), Duration::from_secs(25));
        let e = Policy::parse("peer: { rounds: 3 }").unwrap_err();
        assert!(e.to_string().contains("rounds"), "{e}");
    }

    #[test]
    fn taint_budget_limit() {
        let b = |max_percent, min_nodes| TaintBudget {
            max_percent,
            min_nodes,
            window: Duration::from_secs(600),
        };
        // (budget, nodes, limit)
        let cases = [
            (b(10, 1), 0, 1),
            (b(10, 1), 5, 1),
            (b(10, 1), 19, 1),
            (b(10, 1), 20, 2),
            (b(10, 1), 2000, 200),
            (b(10, 0), 5, 0),
            (b(0, 3), 100, 3),
            (b(100, 1), 40, 40),
            (b(50, 1), 7, 3),
        ];
        for (budget, nodes, want) in cases {
            assert_eq!(budget.limit(nodes), want, "{budget:?} of {nodes}");
        }
        let p = Policy::parse("taint_budget: { max_percent: 5, window: 2m }\n").unwrap();
        assert_eq!(p.taint_budget.max_percent, 5);
        assert_eq!(
            p.taint_budget.min_nodes, 1,
            "unset fields keep their defaults"
        );
        assert_eq!(p.taint_budget.window, Duration::from_secs(120));
    }

    #[test]
    fn overrides_apply_over_the_catalog() {
        let cat = Catalog::builtin().unwrap();
        let p = Policy::parse(
            "overrides:\n  Xid43: { handling: SeparateNPU, fault_type: NodeUnhealthy }\n",
        )
        .unwrap();
        let c = p.classify(&cat, &FaultCode::Xid(43));
        assert_eq!(
            (c.handling, c.fault_type),
            (Handling::SeparateNPU, FaultType::NodeUnhealthy)
        );
        assert_eq!(
            Policy::default()
                .classify(&cat, &FaultCode::Xid(43))
                .handling,
            Handling::NotHandleFault
        );
    }

    #[test]
    fn health_of_agrees_with_the_node_action() {
        let custom =
            Policy::parse("node_actions:\n  RestartNPU: {health: Unhealthy, condition: false}\n")
                .unwrap();
        assert_eq!(
            custom.health_of(Handling::RestartNPU),
            Health::Unhealthy,
            "a configured action wins"
        );
        for p in [Policy::parse("").unwrap(), custom] {
            for h in Handling::ALL {
                assert_eq!(p.health_of(h), p.node_action(h).health, "{h}");
            }
        }
    }
}
