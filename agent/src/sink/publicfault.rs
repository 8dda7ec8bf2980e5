//! MindCluster's public-fault output (opt-in, `ascend.mindcluster.public_faults.enabled`,
//! Kubernetes mode): what faultline finds that MindCluster's own device plugin cannot see (a
//! peer check's verdict, a slow or flapping port, a lost chip, a kernel-log fault) as a
//! `PublicFault` message in the ConfigMap `faultline-publicfault-<node>` in `kube-system`,
//! labelled `mc-consumer-publicfault=true`, which MindCluster's ClusterD reads and forwards to
//! Volcano through its cluster-info ConfigMaps.
//!
//! The message follows ClusterD's public-fault format and checks (docs/mindcluster-sources.md
//! §6 lists them with where they were read):
//! - each active fault is an `occur` entry with a stable `faultId` (a hash of node, code and
//!   device), so the next message's `recover` for it matches;
//! - a fault that ended is sent as `recover` in every message for [`RECOVER_KEPT`] after, so a
//!   ClusterD that missed one update still sees it;
//! - `faultCode` is one of faultline's nine-character public codes ([`public_code`]), by the
//!   fault's kind (NPU, Network, Node) and its level as ClusterD knows levels; the operator lists
//!   them in ClusterD's `publicCustomization.json`
//!   (`manifests/examples/mindcluster/publicCustomization.json`), with `resource` in
//!   `publicFaultResource`, or ClusterD drops the message;
//! - Ascend hex codes stay out: the device plugin reports those itself.
//!
//! Building a message is pure ([`entries`], [`Outbox::message`]); [`PublicFaultSink::run`]
//! writes it through a [`Publisher`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use faultline_core::catalog::ascend::{is_fault_code, FAMILIES};
use faultline_core::policy::LoadedPolicy;
use faultline_core::record::{Fault, FaultType, Handling, Source};
use faultline_core::time::Timestamp;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::metrics::{Metrics, SinkLabel};
use crate::runtime::{Clock, Snapshot};
use crate::sink::mindcluster::Publisher;

pub const CONFIGMAP_PREFIX: &str = "faultline-publicfault-";
pub const NAMESPACE: &str = "kube-system";
pub const DATA_KEY: &str = "PublicFault";
pub const CONSUMER_LABEL: (&str, &str) = ("mc-consumer-publicfault", "true");
/// ClusterD takes 1 to 100 faults per message.
pub const MAX_FAULTS: usize = 100;
/// How long a `recover` entry is repeated in later messages.
pub const RECOVER_KEPT: Duration = Duration::from_secs(600);
/// ClusterD's limits on free text and locations.
const DESCRIPTION_MAX: usize = 512;
const LOCATION_VALUE_MAX: usize = 128;
/// NPU physical ids ClusterD accepts (0..=31).
const MAX_DEVICE_ID: i32 = 31;

/// One public-fault message (`PubFaultInfo` in ClusterD's terms).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Message {
    pub id: String,
    /// Unix milliseconds.
    pub timestamp: i64,
    pub version: String,
    pub resource: String,
    pub faults: Vec<PublicFault>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublicFault {
    pub fault_id: String,
    /// `NPU`, `Network` or `Node`.
    pub fault_type: String,
    pub fault_code: String,
    /// Unix milliseconds: when the fault began (`occur`) or ended (`recover`).
    pub fault_time: i64,
    /// `occur` or `recover`.
    pub assertion: String,
    pub fault_location: BTreeMap<String, String>,
    pub influence: Vec<Influence>,
    pub description: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Influence {
    pub node_name: String,
    pub device_ids: Vec<i32>,
}

/// The levels ClusterD gives public faults, most severe last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PublicLevel {
    NotHandleFault,
    SubHealthFault,
    PreSeparateNPU,
    SeparateNPU,
}

impl PublicLevel {
    /// faultline's level in ClusterD's four: the restart levels (which a scheduler treats as
    /// "degraded") are SubHealthFault, a chip reset or a pre-separation PreSeparateNPU.
    pub fn of(h: Handling) -> PublicLevel {
        match h {
            Handling::NotHandleFault => PublicLevel::NotHandleFault,
            Handling::SubHealthFault | Handling::RestartRequest | Handling::RestartBusiness => {
                PublicLevel::SubHealthFault
            }
            Handling::FreeRestartNPU | Handling::RestartNPU | Handling::PreSeparateNPU => {
                PublicLevel::PreSeparateNPU
            }
            Handling::SeparateNPU | Handling::ManuallySeparateNPU => PublicLevel::SeparateNPU,
        }
    }

    pub const ALL: [PublicLevel; 4] = [
        PublicLevel::NotHandleFault,
        PublicLevel::SubHealthFault,
        PublicLevel::PreSeparateNPU,
        PublicLevel::SeparateNPU,
    ];

    /// The key of ClusterD's `publicFaultCode` table for this level.
    pub fn table_key(self) -> &'static str {
        match self {
            PublicLevel::NotHandleFault => "NotHandleFaultCodes",
            PublicLevel::SubHealthFault => "SubHealthFaultCodes",
            PublicLevel::PreSeparateNPU => "PreSeparateNPUCodes",
            PublicLevel::SeparateNPU => "SeparateNPUCodes",
        }
    }
}

/// ClusterD's fault types.
pub const FAULT_TYPES: [&str; 3] = ["NPU", "Network", "Node"];

/// faultline's public fault code for a kind and a level: nine characters, `9` (faultline),
/// the kind (`1` NPU, `2` Network, `3` Node), `0000`, the level (`1` NotHandleFault ...
/// `4` SeparateNPU) as three digits. No code ClusterD ships starts with 9.
pub fn public_code(fault_type: &str, level: PublicLevel) -> String {
    let kind = match fault_type {
        "NPU" => 1,
        "Network" => 2,
        _ => 3,
    };
    let level = match level {
        PublicLevel::NotHandleFault => 1,
        PublicLevel::SubHealthFault => 2,
        PublicLevel::PreSeparateNPU => 3,
        PublicLevel::SeparateNPU => 4,
    };
    format!("9{kind}0000{level:03}")
}

/// The NPU ids of a device name (`Ascend910-3` -> 3), when it is a chip of a known family.
fn chip_id(device: &str) -> Option<i32> {
    FAMILIES.iter().find_map(|f| {
        device
            .strip_prefix(f)?
            .strip_prefix('-')?
            .parse::<i32>()
            .ok()
            .filter(|n| (0..=MAX_DEVICE_ID).contains(n))
    })
}

/// The first `max` characters, control characters and line breaks made spaces (ClusterD's
/// free text is printable characters and spaces).
fn clean(s: &str, max: usize) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() || c.is_whitespace() {
                ' '
            } else {
                c
            }
        })
        .take(max)
        .collect()
}

fn hash16(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    hex::encode(&h.finalize()[..8])
}

/// Whether ClusterD accepts a node name (a lowercase DNS name, as Kubernetes Node names are).
pub fn valid_node_name(n: &str) -> bool {
    let b = n.as_bytes();
    !b.is_empty()
        && b.len() <= 253
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// The `occur` entries for a record: every active fault but the Ascend hex codes (the device
/// plugin reports those), worst first. Empty on a node with no Ascend chip (ClusterD takes
/// public faults only for nodes its device plugin serves) or with a name it would refuse.
pub fn entries(
    node: &str,
    faults: &[Fault],
    inventory: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<PublicFault> {
    let chips: BTreeSet<i32> = FAMILIES
        .iter()
        .filter_map(|f| inventory.get(*f))
        .flatten()
        .filter_map(|d| chip_id(d))
        .collect();
    if chips.is_empty() || !valid_node_name(node) {
        return Vec::new();
    }
    let mut out: Vec<(PublicLevel, PublicFault)> = faults
        .iter()
        .filter(|f| f.active)
        // The agent's own state (a detector down) says nothing about the node's chips.
        .filter(|f| f.source != Source::Agent)
        .filter(|f| !(f.source == Source::Ascend && is_fault_code(&f.fault_code)))
        .map(|f| {
            let device_ids: Vec<i32> = match chip_id(&f.device) {
                Some(id) => vec![id],
                None => chips.iter().copied().collect(),
            };
            let fault_type = match (f.fault_type, chip_id(&f.device)) {
                (FaultType::CardNetworkUnhealthy, _) => "Network",
                (_, Some(_)) => "NPU",
                _ => "Node",
            };
            let level = PublicLevel::of(f.fault_handling);
            let mut location = BTreeMap::from([(
                "faultlineCode".to_string(),
                clean(&f.fault_code, LOCATION_VALUE_MAX),
            )]);
            if !f.device.is_empty() {
                location.insert("device".into(), clean(&f.device, LOCATION_VALUE_MAX));
            }
            (
                level,
                PublicFault {
                    fault_id: format!("faultline.{}", hash16(&[node, &f.fault_code, &f.device])),
                    fault_type: fault_type.into(),
                    fault_code: public_code(fault_type, level),
                    fault_time: f.first_seen.as_millisecond(),
                    assertion: "occur".into(),
                    fault_location: location,
                    influence: vec![Influence {
                        node_name: node.to_string(),
                        device_ids,
                    }],
                    description: clean(
                        &format!("{} ({}): {}", f.fault_code, f.fault_handling, f.message),
                        DESCRIPTION_MAX,
                    ),
                },
            )
        })
        .collect();
    out.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.fault_id.cmp(&b.1.fault_id)));
    out.into_iter().map(|(_, f)| f).collect()
}

/// What was published, to know what changed and what has recovered.
#[derive(Debug, Clone, Default)]
pub struct Outbox {
    /// The `occur` entries of the last message, by faultId.
    occurring: BTreeMap<String, PublicFault>,
    /// Faults that ended, with when (their `recover` entries are repeated for RECOVER_KEPT).
    recovered: BTreeMap<String, (PublicFault, Timestamp)>,
}

impl Outbox {
    /// Whether `current` differs from what was last sent (fault ids, codes or chips; a new
    /// description alone is no reason to write).
    pub fn changed(&self, current: &[PublicFault]) -> bool {
        current.len() != self.occurring.len()
            || current.iter().any(|f| {
                self.occurring
                    .get(&f.fault_id)
                    .is_none_or(|o| o.fault_code != f.fault_code || o.influence != f.influence)
            })
    }

    /// The message for `current`, or `None` when there is nothing to say (no fault now and no
    /// recovery to repeat). Call [`Outbox::sent`] once it is written.
    pub fn message(
        &self,
        node: &str,
        resource: &str,
        current: &[PublicFault],
        now: Timestamp,
    ) -> Option<(Message, Outbox)> {
        let mut next = Outbox::default();
        let kept = faultline_core::time::signed(RECOVER_KEPT);
        for (id, (f, at)) in &self.recovered {
            if faultline_core::time::since(now, *at) < kept
                && !current.iter().any(|c| c.fault_id == *id)
            {
                next.recovered.insert(id.clone(), (f.clone(), *at));
            }
        }
        for (id, f) in &self.occurring {
            if !current.iter().any(|c| c.fault_id == *id) {
                let mut r = f.clone();
                r.assertion = "recover".into();
                r.fault_time = now.as_millisecond();
                next.recovered.insert(id.clone(), (r, now));
            }
        }
        for f in current {
            next.occurring.insert(f.fault_id.clone(), f.clone());
        }
        let mut faults: Vec<PublicFault> =
            next.recovered.values().map(|(f, _)| f.clone()).collect();
        faults.extend(current.iter().cloned());
        if faults.is_empty() {
            return None;
        }
        if faults.len() > MAX_FAULTS {
            warn!(
                faults = faults.len(),
                max = MAX_FAULTS,
                "more public faults than one message holds; sending the recoveries and the worst"
            );
            faults.truncate(MAX_FAULTS);
        }
        let ms = now.as_millisecond();
        Some((
            Message {
                id: format!("faultline.{ms}.{}", hash16(&[node])),
                timestamp: ms,
                version: "1.0".into(),
                resource: resource.to_string(),
                faults,
            },
            next,
        ))
    }
}

/// Everything `run` needs.
#[derive(Debug)]
pub struct PublicFaultSink<P: Publisher> {
    pub node: String,
    pub publisher: P,
    pub snapshots: watch::Receiver<Option<Snapshot>>,
    pub policy: watch::Receiver<LoadedPolicy>,
    pub clock: Arc<dyn Clock>,
    pub metrics: Arc<Metrics>,
    pub shutdown: CancellationToken,
}

impl<P: Publisher> PublicFaultSink<P> {
    /// Runs until shutdown or the engine stops; does nothing while the output is disabled.
    /// Writes when the faults change and while recoveries are being repeated; a failed write is
    /// retried with backoff and never holds up detection.
    pub async fn run(mut self) {
        let label = SinkLabel {
            sink: "publicfault",
        };
        let mut outbox = Outbox::default();
        let mut retry = crate::sink::kube::Retry::new();
        // The recoveries still being repeated: look again when the oldest expires.
        loop {
            let (enabled, resource) = {
                let p = &self.policy.borrow().policy.ascend.mindcluster.public_faults;
                (p.enabled, p.resource.clone())
            };
            let snap = self.snapshots.borrow_and_update().clone();
            let mut wake = None;
            if let (true, Some(snap)) = (enabled, snap) {
                let current = entries(&self.node, &snap.record.faults, &snap.inventory);
                let now = self.clock.now();
                let expiring = outbox.recovered.values().any(|(_, at)| {
                    faultline_core::time::since(now, *at)
                        >= faultline_core::time::signed(RECOVER_KEPT)
                });
                if outbox.changed(&current) || expiring {
                    match outbox.message(&self.node, &resource, &current, now) {
                        None => outbox = Outbox::default(),
                        Some((msg, next)) => {
                            let text = serde_json::to_string(&msg).unwrap_or_default();
                            match self.publisher.publish(&text).await {
                                Ok(()) => {
                                    self.metrics.sink_writes.get_or_create(&label).inc();
                                    debug!(faults = msg.faults.len(), "public faults published");
                                    outbox = next;
                                    retry.reset();
                                }
                                Err(e) => {
                                    self.metrics.sink_errors.get_or_create(&label).inc();
                                    warn!(error = %e, "publishing public faults failed; detection goes on");
                                    wake = Some(tokio::time::Instant::now() + retry.next_delay());
                                }
                            }
                        }
                    }
                }
                if wake.is_none() && !outbox.recovered.is_empty() {
                    wake = Some(tokio::time::Instant::now() + Duration::from_secs(30));
                }
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                more = crate::sink::kube::changed_or_woken(&mut self.snapshots, wake) => {
                    if !more {
                        return;
                    }
                }
                changed = self.policy.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_790_000_000 + s).unwrap()
    }

    fn fault(
        code: &str,
        device: &str,
        source: Source,
        fault_type: FaultType,
        h: Handling,
    ) -> Fault {
        Fault {
            fault_type,
            fault_code: code.into(),
            fault_handling: h,
            fault_level: h,
            large_model_fault_level: h,
            device: device.into(),
            device_uuid: None,
            pci_bus_id: None,
            source,
            also_seen_by: vec![],
            message: format!("{code} on {device}"),
            first_seen: t(1),
            last_seen: t(2),
            count: 1,
            active: true,
            recovered_at: None,
            escalated_from: None,
        }
    }

    fn inventory(n: u32) -> BTreeMap<String, BTreeSet<String>> {
        BTreeMap::from([(
            "Ascend910".to_string(),
            (0..n).map(|i| format!("Ascend910-{i}")).collect(),
        )])
    }

    /// ClusterD's `publicCustomization.json`, in the shape its loader reads
    /// (`publicFaultCode` level lists, `publicFaultResource`).
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ClusterdConfig {
        public_fault_code: BTreeMap<String, Vec<String>>,
        public_fault_resource: Vec<String>,
    }

    fn shipped_config() -> ClusterdConfig {
        serde_json::from_str(include_str!(
            "../../../manifests/examples/mindcluster/publicCustomization.json"
        ))
        .unwrap()
    }

    fn id_ok(s: &str) -> bool {
        (8..=128).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    }

    fn ms_ok(v: i64) -> bool {
        // Thirteen digits, and not before 2025-01-01T00:00:00Z.
        (1_000_000_000_000..10_000_000_000_000).contains(&v) && v >= 1_735_689_600_000
    }

    /// ClusterD's check of one public-fault message, restated from its checker: any failure
    /// discards the whole message. Parsed into a plain JSON value first, as ClusterD decodes
    /// into its own structs (so our struct cannot hide a missing or misnamed field).
    fn clusterd_check(text: &str, cfg: &ClusterdConfig) -> Result<(), String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let s = |x: &serde_json::Value, k: &str| x[k].as_str().unwrap_or_default().to_string();
        if !id_ok(&s(&v, "id")) {
            return Err("id".into());
        }
        if !v["timestamp"].as_i64().is_some_and(ms_ok) {
            return Err("timestamp".into());
        }
        if s(&v, "version") != "1.0" {
            return Err("version".into());
        }
        if !cfg.public_fault_resource.contains(&s(&v, "resource")) {
            return Err("resource".into());
        }
        let faults = v["faults"].as_array().ok_or("faults")?;
        if !(1..=100).contains(&faults.len()) {
            return Err("faults count".into());
        }
        let codes: BTreeSet<&String> = cfg.public_fault_code.values().flatten().collect();
        for f in faults {
            if !id_ok(&s(f, "faultId")) {
                return Err("faultId".into());
            }
            if !["NPU", "Node", "Network", "Storage"].contains(&s(f, "faultType").as_str()) {
                return Err("faultType".into());
            }
            let code = s(f, "faultCode");
            if code.chars().count() != 9 || !codes.contains(&code) {
                return Err(format!("faultCode {code}"));
            }
            if !f["faultTime"].as_i64().is_some_and(ms_ok) {
                return Err("faultTime".into());
            }
            if !["occur", "recover"].contains(&s(f, "assertion").as_str()) {
                return Err("assertion".into());
            }
            let loc = f["faultLocation"].as_object().ok_or("faultLocation")?;
            if loc.len() > 10
                || loc.iter().any(|(k, v)| {
                    k.chars().count() > 16 || v.as_str().is_none_or(|v| v.chars().count() > 128)
                })
            {
                return Err("faultLocation".into());
            }
            let inf = f["influence"].as_array().ok_or("influence")?;
            if !(1..=1000).contains(&inf.len()) {
                return Err("influence count".into());
            }
            for i in inf {
                if !valid_node_name(&s(i, "nodeName")) {
                    return Err("nodeName".into());
                }
                let ids: Vec<i64> = i["deviceIds"]
                    .as_array()
                    .ok_or("deviceIds")?
                    .iter()
                    .map(|x| x.as_i64().unwrap_or(-1))
                    .collect();
                let unique: BTreeSet<&i64> = ids.iter().collect();
                if !(1..=32).contains(&ids.len())
                    || unique.len() != ids.len()
                    || ids.iter().any(|d| !(0..=31).contains(d))
                {
                    return Err("deviceIds".into());
                }
            }
            let d = s(f, "description");
            if d.chars().count() > 512 || d.chars().any(|c| c.is_whitespace() && c != ' ') {
                return Err("description".into());
            }
        }
        Ok(())
    }

    /// What faultline publishes passes ClusterD's checks against the shipped customization:
    /// a peer verdict on the node, a flapping port, a lost chip; the device plugin's own hex
    /// codes and the agent's detector state stay out.
    #[test]
    fn messages_pass_clusterd_checks() {
        let long = "x\ty\n".repeat(400);
        let mut lost = fault(
            "NPU_LOST",
            "Ascend910-5",
            Source::Ascend,
            FaultType::CardUnhealthy,
            Handling::SeparateNPU,
        );
        lost.message = long;
        let faults = vec![
            fault(
                "PEER_CHECK_FAILED",
                "node",
                Source::Peer,
                FaultType::NodeUnhealthy,
                Handling::PreSeparateNPU,
            ),
            fault(
                "NPU_LINK_FLAPPING",
                "Ascend910-3",
                Source::Ascend,
                FaultType::CardNetworkUnhealthy,
                Handling::RestartBusiness,
            ),
            lost,
            fault(
                "80E3A201",
                "Ascend910-2",
                Source::Ascend,
                FaultType::CardUnhealthy,
                Handling::SeparateNPU,
            ),
            fault(
                "DETECTOR_DOWN",
                "node",
                Source::Agent,
                FaultType::NodeUnhealthy,
                Handling::NotHandleFault,
            ),
        ];
        let current = entries("gpu-node-1", &faults, &inventory(8));
        let summary: Vec<(String, String, Vec<i32>)> = current
            .iter()
            .map(|f| {
                (
                    f.fault_type.clone(),
                    f.fault_code.clone(),
                    f.influence[0].device_ids.clone(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("NPU".to_string(), "910000004".to_string(), vec![5]),
                ("Node".into(), "930000003".into(), (0..8).collect()),
                ("Network".into(), "920000002".into(), vec![3]),
            ]
        );
        let (msg, _) = Outbox::default()
            .message("gpu-node-1", "faultline", &current, t(10))
            .unwrap();
        let text = serde_json::to_string(&msg).unwrap();
        let cfg = shipped_config();
        assert_eq!(clusterd_check(&text, &cfg), Ok(()), "{text}");
        assert!(
            text.contains(r#""faultLocation":{"device":"Ascend910-5","faultlineCode":"NPU_LOST"}"#)
        );
        // Every code faultline can send is in the shipped customization, at its own level.
        for level in PublicLevel::ALL {
            for ty in FAULT_TYPES {
                let code = public_code(ty, level);
                assert!(
                    cfg.public_fault_code[level.table_key()].contains(&code),
                    "{code} not under {}",
                    level.table_key()
                );
            }
        }
    }

    /// The checker above is not a formality: each broken message is refused.
    #[test]
    fn the_restated_checks_refuse_what_clusterd_refuses() {
        let faults = vec![fault(
            "NPU_LOST",
            "Ascend910-1",
            Source::Ascend,
            FaultType::CardUnhealthy,
            Handling::SeparateNPU,
        )];
        let current = entries("node-a", &faults, &inventory(2));
        let (msg, _) = Outbox::default()
            .message("node-a", "faultline", &current, t(0))
            .unwrap();
        let cfg = shipped_config();
        let good = serde_json::to_value(&msg).unwrap();
        type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
        let breaks: [(&str, Edit<'_>); 8] = [
            ("id", &|v| v["id"] = "short".into()),
            ("timestamp", &|v| v["timestamp"] = 1_790_000_000.into()),
            ("resource", &|v| v["resource"] = "pingmesh2".into()),
            ("faultCode", &|v| {
                v["faults"][0]["faultCode"] = "80E3A201".into()
            }),
            ("deviceIds", &|v| {
                v["faults"][0]["influence"][0]["deviceIds"] = serde_json::json!([])
            }),
            ("deviceIds", &|v| {
                v["faults"][0]["influence"][0]["deviceIds"] = serde_json::json!([32])
            }),
            ("description", &|v| {
                v["faults"][0]["description"] = "a\nb".into()
            }),
            ("faults count", &|v| v["faults"] = serde_json::json!([])),
        ];
        for (want, edit) in breaks {
            let mut v = good.clone();
            edit(&mut v);
            let e = clusterd_check(&v.to_string(), &cfg).unwrap_err();
            assert!(e.starts_with(want), "{want}: {e}");
        }
    }

    /// A fault that ends is sent as `recover` with the same faultId, repeated for a while, and
    /// then nothing is left to say.
    #[test]
    fn recoveries_match_and_expire() {
        let a = fault(
            "NPU_LINK_SPEED_LOW",
            "Ascend910-0",
            Source::Ascend,
            FaultType::CardNetworkUnhealthy,
            Handling::PreSeparateNPU,
        );
        let b = fault(
            "PEER_STRAGGLER",
            "node",
            Source::Peer,
            FaultType::NodeUnhealthy,
            Handling::SubHealthFault,
        );
        let both = entries("n1", &[a.clone(), b.clone()], &inventory(2));
        let outbox = Outbox::default();
        assert!(outbox.changed(&both));
        let (_, outbox) = outbox.message("n1", "faultline", &both, t(0)).unwrap();
        assert!(!outbox.changed(&both), "the same faults again: no write");
        let only_b = entries("n1", &[b], &inventory(2));
        assert!(outbox.changed(&only_b));
        let (msg, outbox) = outbox.message("n1", "faultline", &only_b, t(5)).unwrap();
        let recovered: Vec<&PublicFault> = msg
            .faults
            .iter()
            .filter(|f| f.assertion == "recover")
            .collect();
        assert_eq!(recovered.len(), 1);
        assert!(both
            .iter()
            .any(|f| f.fault_id == recovered[0].fault_id && f.fault_code == "920000003"));
        assert_eq!(recovered[0].fault_time, t(5).as_millisecond());
        // Nothing active: the recoveries are still sent until RECOVER_KEPT has passed.
        let (msg, outbox) = outbox.message("n1", "faultline", &[], t(60)).unwrap();
        assert_eq!(msg.faults.len(), 2);
        assert!(msg.faults.iter().all(|f| f.assertion == "recover"));
        assert!(outbox.message("n1", "faultline", &[], t(700)).is_none());
        // No Ascend chip, or a name ClusterD refuses: nothing to publish.
        assert!(entries("n1", std::slice::from_ref(&a), &BTreeMap::new()).is_empty());
        assert!(entries("Node_1", &[a], &inventory(2)).is_empty());
    }
}
