//! Every metric the agent exports, defined in one place.
//!
//! Naming (docs/metrics.md): `faultline_<what>_<unit>`; counters get `_total` from the encoder.
//! Every label value comes from a bounded set: a fixed one (kinds, sinks, levels, results,
//! detectors), or, for the fault labels, one that only the catalog, the policy file and the
//! node's inventory define ([`code_label`], [`device_label`]); anything else is `other`. Never
//! a message, and never a value a kernel-log line can invent.

use parking_lot::Mutex;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandlingLabel {
    pub handling: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DetectorLabel {
    pub detector: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DetectorStateLabel {
    pub detector: String,
    /// `running`, `starting`, `idle` or `down`.
    pub state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkLabel {
    pub sink: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabel {
    /// `http` or `peer` (an agent's), `coordinator` (the coordinator's gRPC service).
    pub server: &'static str,
}

/// An external tool call (Ascend `npu-smi`, `hccn_tool`) and how it ended: `ok`, `failed`
/// (non-zero exit or cannot start), `timeout` (killed), `garbage` (output did not parse).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabel {
    pub tool: &'static str,
    pub result: &'static str,
}

/// A fault code and device, bounded ([`code_label`], [`device_label`]).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FaultLabel {
    pub code: String,
    pub device: String,
}

/// [`FaultLabel`] with the fault's handling level.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ActiveFaultLabel {
    pub code: String,
    pub device: String,
    pub handling: &'static str,
}

/// How a peer check this agent took part in ended, for this agent ([`PeerCheckResult`]).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerCheckLabel {
    pub result: PeerCheckResult,
}

/// A peer check as this agent, one of its pair, saw it: its own probe's outcome, or why it ran
/// none.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum PeerCheckResult {
    /// The probe finished its allgather with the partner.
    passed,
    /// The probe failed: its own error, a kill at the deadline, unreadable output.
    failed,
    /// The probe's deadline passed after the pair connected (too slow, not an error).
    timeout,
    /// The probe could not start on this node (missing or not executable).
    cannot_run,
    /// The coordinator cancelled the check before the probe ended.
    cancelled,
    /// This agent refused the coordinator's assignment (not a member of the check, addresses
    /// or sizes outside what it accepts, too many checks running): no probe ran.
    refused,
}

/// The value of a fault label that is not in its bounded set.
pub(crate) const OTHER: &str = "other";

/// The kernel-log source's detector.
pub(crate) const DETECTOR_KMSG: &str = "kmsg";
/// The NVML source's detector.
pub(crate) const DETECTOR_NVML: &str = "nvml";
/// The Ascend source's detectors, one per tool.
pub(crate) const DETECTOR_NPU_SMI: &str = "npu-smi";
pub(crate) const DETECTOR_HCCN: &str = "hccn_tool";
/// The detector under which a failing record write shows in the record and metrics.
pub(crate) const DETECTOR_RECORD_FILE: &str = "record-file";

/// The detectors, the devices of `DETECTOR_DOWN` faults: a fixed set, named here so that the
/// sources and the file sink take their names from the metrics' label set.
pub(crate) const DETECTORS: [&str; 5] = [
    DETECTOR_KMSG,
    DETECTOR_NVML,
    DETECTOR_NPU_SMI,
    DETECTOR_HCCN,
    DETECTOR_RECORD_FILE,
];

/// NVSwitches named `nvswitch<N>` below this are label values. The number comes from the
/// driver's SXid lines (facility 0: the kernel's, no process can write one into /dev/kmsg);
/// NVML does not list switches, so this bound stands in for an inventory: HGX and DGX boards
/// carry 2 to 6.
pub(crate) const MAX_NVSWITCHES: u32 = 16;

/// The `code` label of a record's `fault_code`: the code when the catalog lists it or the
/// policy names it (`defined`: [`faultline_core::policy::Policy::defines`]), else `other`.
pub(crate) fn code_label(code: &str, defined: bool) -> String {
    if defined { code } else { OTHER }.to_string()
}

/// The `device` label of a record's `device` (of a fault with `code`): `node`; a device of the
/// node's inventory (`in_inventory`: [`faultline_core::engine::Engine::in_inventory`]: an NVML
/// GPU as `GPU-<index>` or `pci-<address>`, an Ascend chip); `nvswitch<N>` below
/// [`MAX_NVSWITCHES`]; a detector of [`DETECTORS`] for `DETECTOR_DOWN`; else `other` (a GPU the
/// kernel log alone names, `GPU-<pci bus id>`; a PCI address; a peer link `link:<node>`).
pub(crate) fn device_label(code: &str, device: &str, in_inventory: bool) -> String {
    let nvswitch = device
        .strip_prefix("nvswitch")
        .and_then(|n| n.parse::<u32>().ok().filter(|i| i.to_string() == n))
        .is_some_and(|n| n < MAX_NVSWITCHES);
    let detector = code == "DETECTOR_DOWN" && DETECTORS.contains(&device);
    if device == "node" || in_inventory || nvswitch || detector {
        device
    } else {
        OTHER
    }
    .to_string()
}

/// The number of active faults by bounded labels: a series is removed when no active fault
/// has its labels any more (the family alone would keep it at its last value).
#[derive(Debug, Default)]
pub struct ActiveFaults {
    family: Family<ActiveFaultLabel, Gauge>,
    shown: Mutex<HashSet<ActiveFaultLabel>>,
}

impl ActiveFaults {
    /// Sets every series to `counts`; the series not in it are removed.
    pub(crate) fn set_all(&self, counts: HashMap<ActiveFaultLabel, i64>) {
        let mut shown = self.shown.lock();
        for (labels, n) in &counts {
            self.family.get_or_create(labels).set(*n);
        }
        for gone in shown.iter().filter(|l| !counts.contains_key(*l)) {
            self.family.remove(gone);
        }
        *shown = counts.into_keys().collect();
    }
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum ReloadResult {
    Ok,
    Rejected,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabel {
    pub result: ReloadResult,
}

/// All metrics. Cheap to share: every handle is reference-counted.
#[derive(Debug)]
pub struct Metrics {
    pub registry: Registry,
    pub kmsg_records: Counter,
    pub kmsg_lost: Counter,
    pub kmsg_overruns: Counter,
    pub kmsg_malformed: Counter,
    pub kmsg_truncated: Counter,
    pub kmsg_skipped: Counter,
    pub kmsg_matched: Family<KindLabel, Counter>,
    /// A kernel-log file at the path replaced (`rotated`) or cut short (`truncated`).
    pub kmsg_new_files: Family<KindLabel, Counter>,
    pub kmsg_user: Counter,
    pub engine_events: Family<KindLabel, Counter>,
    pub engine_inputs: Counter,
    pub faults_active: Family<HandlingLabel, Gauge>,
    /// Active faults by bounded code, device and handling level.
    pub fault_active: ActiveFaults,
    /// Reports of faults the engine took, by bounded code and device.
    pub fault_occurrences: Family<FaultLabel, Counter>,
    /// Unix time (wall clock, seconds) of the heartbeat last written into the local record.
    pub heartbeat: Gauge<f64, AtomicU64>,
    /// Peer checks this agent took part in, by result.
    pub peer_checks: Family<PeerCheckLabel, Counter>,
    pub node_health: Gauge,
    pub sink_writes: Family<SinkLabel, Counter>,
    pub sink_errors: Family<SinkLabel, Counter>,
    /// Own objects someone else changed or deleted, found by the watch and written again.
    pub drift_repairs: Family<SinkLabel, Counter>,
    pub connections_refused: Family<ServerLabel, Counter>,
    pub sink_write_seconds: Family<SinkLabel, Histogram>,
    pub policy_reloads: Family<ReloadLabel, Counter>,
    pub policy_valid: Gauge,
    pub detector_up: Family<DetectorLabel, Gauge>,
    /// 1 for each detector's current state, 0 for its other states.
    pub detector_state: Family<DetectorStateLabel, Gauge>,
    /// Engine events the Kubernetes Event sink could not take (its queue was full).
    pub events_dropped: Counter,
    /// Notices the Kubernetes Event sink published no Event for: its token bucket was empty.
    pub events_rate_limited: Counter,
    /// Taints withheld by the taint budget right now.
    pub taints_withheld: Gauge,
    /// Seconds from the engine applying a change to the node sink having written it.
    pub kube_publish_seconds: Histogram,
    /// Ascend tool calls, by tool and result.
    pub tool_calls: Family<ToolLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            kmsg_records: Counter::default(),
            kmsg_lost: Counter::default(),
            kmsg_overruns: Counter::default(),
            kmsg_malformed: Counter::default(),
            kmsg_truncated: Counter::default(),
            kmsg_skipped: Counter::default(),
            kmsg_matched: Family::default(),
            kmsg_new_files: Family::default(),
            kmsg_user: Counter::default(),
            engine_events: Family::default(),
            engine_inputs: Counter::default(),
            faults_active: Family::default(),
            fault_active: ActiveFaults::default(),
            fault_occurrences: Family::default(),
            heartbeat: Gauge::default(),
            peer_checks: Family::default(),
            node_health: Gauge::default(),
            sink_writes: Family::default(),
            sink_errors: Family::default(),
            drift_repairs: Family::default(),
            connections_refused: Family::default(),
            sink_write_seconds: Family::new_with_constructor(|| {
                Histogram::new([
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
                ])
            }),
            policy_reloads: Family::default(),
            policy_valid: Gauge::default(),
            detector_up: Family::default(),
            detector_state: Family::default(),
            events_dropped: Counter::default(),
            events_rate_limited: Counter::default(),
            taints_withheld: Gauge::default(),
            kube_publish_seconds: Histogram::new([
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            tool_calls: Family::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "faultline_kmsg_records",
            "Kernel log records read",
            m.kmsg_records.clone(),
        );
        r.register(
            "faultline_kmsg_lost_records",
            "Kernel log records lost before they were read (sequence gaps)",
            m.kmsg_lost.clone(),
        );
        r.register(
            "faultline_kmsg_overruns",
            "Times the kernel log reader fell behind the ring buffer (EPIPE)",
            m.kmsg_overruns.clone(),
        );
        r.register(
            "faultline_kmsg_malformed_records",
            "Kernel log records that did not parse as kmsg format (still scanned)",
            m.kmsg_malformed.clone(),
        );
        r.register(
            "faultline_kmsg_truncated_lines",
            "Input lines longer than the limit; their start was kept",
            m.kmsg_truncated.clone(),
        );
        r.register(
            "faultline_kmsg_skipped_records",
            "Records already counted before a restart, skipped",
            m.kmsg_skipped.clone(),
        );
        r.register(
            "faultline_kmsg_matched_records",
            "Kernel log records that matched a fault parser, by kind",
            m.kmsg_matched.clone(),
        );
        r.register(
            "faultline_kmsg_new_files",
            "Kernel-log files (--kmsg-path a file) replaced (kind=rotated) or truncated \
             (kind=truncated), then read from their beginning",
            m.kmsg_new_files.clone(),
        );
        r.register(
            "faultline_kmsg_user_records",
            "Kernel log records user space wrote (facility not 0), never scanned for faults",
            m.kmsg_user.clone(),
        );
        r.register(
            "faultline_engine_events",
            "Engine events (new fault, escalation, recovery, ...), by kind",
            m.engine_events.clone(),
        );
        r.register(
            "faultline_engine_inputs",
            "Inputs applied by the engine",
            m.engine_inputs.clone(),
        );
        r.register(
            "faultline_faults_active",
            "Active faults by handling level",
            m.faults_active.clone(),
        );
        r.register(
            "faultline_fault_active",
            "Active faults (one per fault code and device) by code (catalog or policy, else \
             other), device (inventory, node, nvswitch<N>, a detector, else other) and handling",
            m.fault_active.family.clone(),
        );
        r.register(
            "faultline_fault_occurrences",
            "Reports of faults the engine took (the first and every repeat, as the record's \
             count), by code and device (bounded as in faultline_fault_active)",
            m.fault_occurrences.clone(),
        );
        r.register(
            "faultline_heartbeat_timestamp_seconds",
            "Unix time of the heartbeat last written into the local record (agent.heartbeatTime): \
             renewed while the engine loop runs and the record can be written",
            m.heartbeat.clone(),
        );
        r.register(
            "faultline_peer_checks",
            "Peer checks this agent took part in as one of a pair, by its own result",
            m.peer_checks.clone(),
        );
        r.register(
            "faultline_node_health",
            "Node verdict: 0 Healthy, 1 Degraded, 2 Unhealthy",
            m.node_health.clone(),
        );
        r.register(
            "faultline_sink_writes",
            "Successful sink writes",
            m.sink_writes.clone(),
        );
        r.register(
            "faultline_sink_errors",
            "Failed sink writes (retried)",
            m.sink_errors.clone(),
        );
        r.register(
            "faultline_drift_repairs",
            "Own objects (the Node's faultline labels, taints and condition; the fault ConfigMap) found changed or deleted by someone else and repaired",
            m.drift_repairs.clone(),
        );
        r.register(
            "faultline_connections_refused",
            "Connections closed at once because the server's connection limit was reached",
            m.connections_refused.clone(),
        );
        r.register(
            "faultline_sink_write_seconds",
            "Time to complete one sink write",
            m.sink_write_seconds.clone(),
        );
        r.register(
            "faultline_policy_reloads",
            "Policy file loads, by result",
            m.policy_reloads.clone(),
        );
        r.register(
            "faultline_policy_valid",
            "1 when the newest policy file was accepted, 0 when rejected",
            m.policy_valid.clone(),
        );
        r.register(
            "faultline_detector_up",
            "1 when a detector is running, 0 when down, idle or starting",
            m.detector_up.clone(),
        );
        r.register(
            "faultline_detector_state",
            "1 for a detector's current state (running, starting, idle: nothing to watch here, \
             down), 0 for its other states",
            m.detector_state.clone(),
        );
        r.register(
            "faultline_tool_calls",
            "External tool calls (npu-smi, hccn_tool), by tool and result",
            m.tool_calls.clone(),
        );
        r.register(
            "faultline_kube_events_dropped",
            "Kubernetes Events dropped because the Event sink's queue was full",
            m.events_dropped.clone(),
        );
        r.register(
            "faultline_kube_events_rate_limited",
            "Notices that got no Kubernetes Event because the Event budget (--kube-event-burst, --kube-event-rate a minute) was spent",
            m.events_rate_limited.clone(),
        );
        r.register(
            "faultline_taints_withheld",
            "Taints this node should carry but the cluster's taint budget holds back",
            m.taints_withheld.clone(),
        );
        r.register(
            "faultline_kube_publish_seconds",
            "From the engine applying a change to the node's labels, taints and condition matching it",
            m.kube_publish_seconds.clone(),
        );
        r.register(
            "faultline_build",
            "Build information",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        Metrics { registry, ..m }
    }

    /// The OpenMetrics text format (what the registry writes).
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The metrics in the exposition `format` a scraper asked for.
    pub fn encode_as(&self, format: Format) -> String {
        match format {
            Format::OpenMetrics => self.encode(),
            Format::Text004 => text_004(&self.encode()),
        }
    }
}

/// The two exposition formats `/metrics` serves, each under its own content type: the body
/// and its type must agree, or a scraper rejects the target (Prometheus 2.42 reading an
/// OpenMetrics body as `text/plain; version=0.0.4` fails on `# TYPE faultline_build info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    OpenMetrics,
    Text004,
}

impl Format {
    /// The format for an `Accept` header: OpenMetrics when the client names
    /// `application/openmetrics-text` with a weight above 0 (Prometheus does, ahead of
    /// `text/plain`), else the Prometheus text format 0.0.4, which every scraper reads
    /// (also when there is no `Accept`, or it is `*/*`, as for curl).
    pub fn negotiate(accept: Option<&str>) -> Format {
        let openmetrics = accept.is_some_and(|a| {
            a.split(',').any(|range| {
                let mut parts = range.split(';').map(str::trim);
                let media = parts.next().unwrap_or_default();
                let q = parts
                    .filter_map(|p| p.strip_prefix("q="))
                    .find_map(|q| q.parse::<f32>().ok())
                    .unwrap_or(1.0);
                media.eq_ignore_ascii_case("application/openmetrics-text") && q > 0.0
            })
        });
        if openmetrics {
            Format::OpenMetrics
        } else {
            Format::Text004
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Text004 => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// The Prometheus text format 0.0.4 from the registry's OpenMetrics text. The samples are the
/// same lines; what differs is the metadata (prometheus.io "Exposition formats", and the
/// OpenMetrics specification): 0.0.4 has no `# EOF` and no `# UNIT`, names a family by its
/// samples' name (a counter `x` of sample `x_total` is the family `x_total`; an info `x` of
/// sample `x_info` is the gauge `x_info`), and knows only counter, gauge, histogram, summary
/// and untyped. No OpenMetrics-only syntax reaches the samples here: the registry writes no
/// exemplars and no `_created` lines for these metrics.
fn text_004(openmetrics: &str) -> String {
    // The family renames, from the TYPE lines (a family's HELP comes before its TYPE).
    let mut renamed = std::collections::HashMap::new();
    for line in openmetrics.lines() {
        if let Some((name, kind)) = line
            .strip_prefix("# TYPE ")
            .and_then(|rest| rest.split_once(' '))
        {
            let (suffix, kind) = match kind {
                "counter" => ("_total", "counter"),
                "info" => ("_info", "gauge"),
                "stateset" => ("", "gauge"),
                "gaugehistogram" => ("", "histogram"),
                "unknown" => ("", "untyped"),
                other => ("", other),
            };
            renamed.insert(name, (format!("{name}{suffix}"), kind));
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta.and_then(|(p, rest)| {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            renamed.get(name).map(|r| (p, r, text))
        }) {
            Some(("# TYPE ", (name, kind), _)) => out.push_str(&format!("# TYPE {name} {kind}")),
            Some((p, (name, _), text)) => out.push_str(&format!("{p}{name} {text}")),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The format each `Accept` gets: OpenMetrics only when named with a weight above 0.
    #[test]
    fn formats_by_accept() {
        use Format::{OpenMetrics, Text004};
        for (accept, want) in [
            (None, Text004),
            (Some("*/*"), Text004),
            (Some("text/plain;version=0.0.4"), Text004),
            (
                Some("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"),
                OpenMetrics,
            ),
            (Some("text/plain, Application/OpenMetrics-Text; q=0.3"), OpenMetrics),
            (Some("application/openmetrics-text;q=0"), Text004),
            (Some("application/openmetrics-text;q=x"), OpenMetrics),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }

    /// 0.0.4 names a counter and an info by their samples, has no `# EOF` or `# UNIT`, and keeps
    /// every sample line as it was.
    #[test]
    fn text_004_renames_families_and_keeps_samples() {
        let om = "# HELP a_seconds A.\n# TYPE a_seconds counter\n# UNIT a_seconds seconds\n\
                  a_seconds_total 3\n# HELP b B.\n# TYPE b info\nb_info{v=\"1\"} 1\n\
                  # HELP c C.\n# TYPE c gauge\nc{x=\"# TYPE c counter\"} 2\n# EOF\n";
        assert_eq!(
            text_004(om),
            "# HELP a_seconds_total A.\n# TYPE a_seconds_total counter\na_seconds_total 3\n\
             # HELP b_info B.\n# TYPE b_info gauge\nb_info{v=\"1\"} 1\n\
             # HELP c C.\n# TYPE c gauge\nc{x=\"# TYPE c counter\"} 2\n"
        );
        let m = Metrics::new();
        m.kmsg_records.inc();
        let om = m.encode();
        let text = m.encode_as(Format::Text004);
        let samples = |s: &str| -> Vec<String> {
            s.lines()
                .filter(|l| !l.starts_with('#'))
                .map(String::from)
                .collect()
        };
        assert_eq!(samples(&om), samples(&text));
        assert!(text.contains("# TYPE faultline_kmsg_records_total counter\n"));
        assert!(!text.contains("# EOF") && !text.contains(" info\n"));
    }

    /// The fault labels' bounds: a code only when defined; a device only when the inventory,
    /// the node, a switch number below the bound or a detector (of `DETECTOR_DOWN`) names it.
    #[test]
    fn fault_labels_are_bounded() {
        assert_eq!(code_label("Xid79", true), "Xid79");
        assert_eq!(code_label("Xid123456", false), OTHER);
        for (code, device, inventory, want) in [
            ("Xid79", "GPU-0", true, "GPU-0"),
            ("Xid79", "GPU-0000:3b:00.0", false, OTHER),
            ("PCIE_AER_FATAL", "pci-0000:3b:00.0", false, OTHER),
            (
                "PCIE_AER_FATAL",
                "pci-0000:3b:00.0",
                true,
                "pci-0000:3b:00.0",
            ),
            ("KMSG_LOSS", "node", false, "node"),
            ("SXid12028", "nvswitch0", false, "nvswitch0"),
            ("SXid12028", "nvswitch15", false, "nvswitch15"),
            ("SXid12028", "nvswitch16", false, OTHER),
            ("SXid12028", "nvswitch03", false, OTHER),
            ("SXid12028", "nvswitch-0000:86:00.0", false, OTHER),
            ("DETECTOR_DOWN", "kmsg", false, "kmsg"),
            ("DETECTOR_DOWN", "record-file", false, "record-file"),
            ("DETECTOR_DOWN", "made-up", false, OTHER),
            ("Xid79", "kmsg", false, OTHER),
            ("PEER_LINK_FAILED", "link:node-b", false, OTHER),
            ("PEER_LINK_DEGRADED", "link:node-b", false, OTHER),
            ("NPU_UNHEALTHY", "Ascend910-3", true, "Ascend910-3"),
        ] {
            assert_eq!(
                device_label(code, device, inventory),
                want,
                "{code} {device}"
            );
        }
    }

    /// A series of `faultline_fault_active` goes when no active fault has its labels any more.
    #[test]
    fn active_fault_series_go_with_their_last_fault() {
        let m = Metrics::new();
        let l = |code: &str| ActiveFaultLabel {
            code: code.into(),
            device: "node".into(),
            handling: "SeparateNPU",
        };
        m.fault_active
            .set_all(HashMap::from([(l("Xid79"), 2), (l("KMSG_LOSS"), 1)]));
        let text = m.encode();
        assert!(text.contains(
            "faultline_fault_active{code=\"Xid79\",device=\"node\",handling=\"SeparateNPU\"} 2\n"
        ));
        m.fault_active.set_all(HashMap::from([(l("KMSG_LOSS"), 1)]));
        let text = m.encode();
        assert!(!text.contains("Xid79"), "{text}");
        assert!(text.contains("code=\"KMSG_LOSS\""), "{text}");
    }

    /// docs/metrics.md lists every metric the agent exports, under the name a scraper of the
    /// text format sees.
    #[test]
    fn the_docs_list_every_metric() {
        let docs = include_str!("../../docs/metrics.md");
        let m = Metrics::new();
        // A family shows only once it has a series: one in each. Every field is named, so a
        // new metric cannot be left out of this test.
        let Metrics {
            registry: _,
            kmsg_records: _,
            kmsg_lost: _,
            kmsg_overruns: _,
            kmsg_malformed: _,
            kmsg_truncated: _,
            kmsg_skipped: _,
            kmsg_matched,
            kmsg_new_files,
            kmsg_user: _,
            engine_events,
            engine_inputs: _,
            faults_active,
            fault_active,
            fault_occurrences,
            node_health: _,
            heartbeat: _,
            sink_writes,
            sink_errors,
            drift_repairs,
            connections_refused,
            sink_write_seconds,
            policy_reloads,
            policy_valid: _,
            detector_up,
            detector_state,
            events_dropped: _,
            events_rate_limited: _,
            taints_withheld: _,
            kube_publish_seconds: _,
            tool_calls,
            peer_checks,
        } = &m;
        let kind = KindLabel { kind: "x" };
        let sink = SinkLabel { sink: "x" };
        let detector = DetectorLabel {
            detector: "x".into(),
        };
        let fault = FaultLabel {
            code: "x".into(),
            device: "x".into(),
        };
        for f in [kmsg_matched, kmsg_new_files, engine_events] {
            f.get_or_create(&kind).inc();
        }
        for f in [sink_writes, sink_errors, drift_repairs] {
            f.get_or_create(&sink).inc();
        }
        sink_write_seconds.get_or_create(&sink).observe(1.0);
        let _ = faults_active.get_or_create(&HandlingLabel { handling: "x" });
        fault_active.set_all(HashMap::from([(
            ActiveFaultLabel {
                code: "x".into(),
                device: "x".into(),
                handling: "x",
            },
            1,
        )]));
        fault_occurrences.get_or_create(&fault).inc();
        let _ = connections_refused.get_or_create(&ServerLabel { server: "x" });
        let _ = policy_reloads.get_or_create(&ReloadLabel {
            result: ReloadResult::Ok,
        });
        let _ = detector_up.get_or_create(&detector);
        let _ = detector_state.get_or_create(&DetectorStateLabel {
            detector: "x".into(),
            state: "x",
        });
        let _ = tool_calls.get_or_create(&ToolLabel {
            tool: "x",
            result: "x",
        });
        let _ = peer_checks.get_or_create(&PeerCheckLabel {
            result: PeerCheckResult::passed,
        });
        let text = m.encode_as(Format::Text004);
        let names: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next())
            .collect();
        assert!(names.len() >= 30, "{names:?}");
        for name in names {
            assert!(
                docs.contains(&format!("| `{name}` |")),
                "{name} is not in docs/metrics.md"
            );
        }
    }

    #[test]
    fn names_follow_the_rules() {
        let m = Metrics::new();
        m.kmsg_records.inc();
        m.sink_writes
            .get_or_create(&SinkLabel { sink: "file" })
            .inc();
        let text = m.encode();
        assert!(text.contains("faultline_kmsg_records_total 1"), "{text}");
        assert!(
            text.contains("faultline_sink_writes_total{sink=\"file\"} 1"),
            "{text}"
        );
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            assert!(line.starts_with("faultline_"), "{line}");
        }
    }
}
