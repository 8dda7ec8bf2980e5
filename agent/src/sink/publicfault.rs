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
//!   fault's kind (NPU, Network, Node) and its level as ClusterD knows levels; the operator
//!   gives ClusterD a `publicCustomization.json` that lists them and `resource`, or ClusterD
//!   drops the faults (`manifests/examples/mindcluster/<release>/publicCustomization.json`, one
//!   complete file per ClusterD release line, since the file replaces ClusterD's own);
//! - Ascend hex codes stay out: the device plugin reports those itself.
//!
//! Building a message is pure ([`entries`], [`Outbox::message`]); [`PublicFaultSink::run`]
//! writes it through a [`DocumentPublisher`].

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

use crate::clock::Clock;
use crate::engine_loop::Snapshot;
use crate::metrics::{Metrics, SinkLabel};

pub(crate) const CONFIGMAP_PREFIX: &str = "faultline-publicfault-";
pub(crate) const NAMESPACE: &str = "kube-system";
pub(crate) const DATA_KEY: &str = "PublicFault";
pub(crate) const CONSUMER_LABEL: (&str, &str) = ("mc-consumer-publicfault", "true");
/// ClusterD takes 1 to 100 faults per message.
pub(crate) const MAX_FAULTS: usize = 100;
/// How long a `recover` entry is repeated in later messages.
pub(crate) const RECOVER_KEPT: Duration = Duration::from_secs(600);
/// ClusterD's limits on free text and locations.
const DESCRIPTION_MAX: usize = 512;
const LOCATION_VALUE_MAX: usize = 128;
/// NPU physical ids ClusterD accepts (0..=31).
const MAX_DEVICE_ID: i32 = 31;

/// One public-fault message (`PubFaultInfo` in ClusterD's terms).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Message {
    pub id: String,
    /// Unix milliseconds.
    pub timestamp: i64,
    pub version: String,
    pub resource: String,
    pub faults: Vec<PublicFault>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PublicFault {
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
pub(crate) struct Influence {
    pub node_name: String,
    pub device_ids: Vec<i32>,
}

/// The levels ClusterD gives public faults, most severe last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum PublicLevel {
    NotHandleFault,
    SubHealthFault,
    PreSeparateNPU,
    SeparateNPU,
}

impl PublicLevel {
    /// faultline's level in ClusterD's four: the restart levels (which a scheduler treats as
    /// "degraded") are SubHealthFault, a chip reset or a pre-separation PreSeparateNPU.
    pub(crate) fn of(h: Handling) -> PublicLevel {
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

    #[cfg(test)]
    pub(crate) const ALL: [PublicLevel; 4] = [
        PublicLevel::NotHandleFault,
        PublicLevel::SubHealthFault,
        PublicLevel::PreSeparateNPU,
        PublicLevel::SeparateNPU,
    ];

    /// The key of ClusterD's `publicFaultCode` table for this level.
    #[cfg(test)]
    pub(crate) fn table_key(self) -> &'static str {
        match self {
            PublicLevel::NotHandleFault => "NotHandleFaultCodes",
            PublicLevel::SubHealthFault => "SubHealthFaultCodes",
            PublicLevel::PreSeparateNPU => "PreSeparateNPUCodes",
            PublicLevel::SeparateNPU => "SeparateNPUCodes",
        }
    }
}

/// ClusterD's fault types.
#[cfg(test)]
pub(crate) const FAULT_TYPES: [&str; 3] = ["NPU", "Network", "Node"];

/// faultline's public fault code for a kind and a level: nine characters, `9` (faultline),
/// the kind (`1` NPU, `2` Network, `3` Node), `0000`, the level (`1` NotHandleFault ...
/// `4` SeparateNPU) as three digits. No code ClusterD ships starts with 9.
pub(crate) fn public_code(fault_type: &str, level: PublicLevel) -> String {
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

/// At most `max` bytes of `s` (ClusterD measures its limits in bytes), control characters and
/// line breaks made spaces (its free text is printable characters and spaces), `"` made `'`,
/// `\` made `/` and any other non-ASCII character `?`: the message is then printable ASCII
/// with no JSON escape, which lets the admission policy check who a message names by plain
/// text (manifests/components/mindcluster).
fn clean(s: &str, max: usize) -> String {
    let mut out = String::new();
    for c in s.chars() {
        let c = match c {
            '"' => '\'',
            '\\' => '/',
            c if !c.is_ascii() => '?',
            c if c.is_control() || c.is_whitespace() => ' ',
            c => c,
        };
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
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
pub(crate) fn valid_node_name(n: &str) -> bool {
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
pub(crate) fn entries(
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
                    // Everything ClusterD keeps of an occurrence is in the id: ClusterD adds an
                    // `occur` only for an id it does not hold, so a new level or a new set of
                    // chips must be a new id (the old one is sent as `recover`).
                    fault_id: format!(
                        "faultline.{}",
                        hash16(&[
                            node,
                            &f.fault_code,
                            &f.device,
                            &public_code(fault_type, level),
                            &format!("{device_ids:?}"),
                        ])
                    ),
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
    // Two faults with the same code and device name (one from two device keys) are one entry.
    let mut seen = BTreeSet::new();
    out.into_iter()
        .map(|(_, f)| f)
        .filter(|f| seen.insert(f.fault_id.clone()))
        .collect()
}

/// What was published, to know what changed and what has recovered. Kept in the data directory
/// (`publicfault.json`, kept by a reboot), so a restarted or rebooted agent still retracts what
/// it published before: ClusterD clears a public fault only on its `recover`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Outbox {
    /// The resource the entries were sent under.
    resource: String,
    /// The `occur` entries of the last message, by faultId.
    occurring: BTreeMap<String, PublicFault>,
    /// Every faultId current at the last message, sent or cut for room.
    considered: BTreeSet<String>,
    /// Faults that ended, with when (Unix ms); their `recover` entries are repeated for
    /// RECOVER_KEPT.
    recovered: BTreeMap<String, (PublicFault, i64)>,
}

/// The outbox's file in the data directory.
pub(crate) const OUTBOX_FILE: &str = "publicfault.json";
/// The most of it read back (a hundred entries of at most about 1.5 KiB each, twice).
const OUTBOX_MAX_BYTES: u64 = 1 << 20;

impl Outbox {
    /// Nothing published yet under `resource`.
    fn empty(resource: &str) -> Outbox {
        Outbox {
            resource: resource.to_string(),
            ..Outbox::default()
        }
    }

    /// Whether nothing is published that could need a `recover`.
    pub(crate) fn is_empty(&self) -> bool {
        self.occurring.is_empty() && self.recovered.is_empty()
    }

    /// Whether `current` differs from what the last message was made of. The faultId holds
    /// the code, the level and the chips, so comparing ids is comparing all ClusterD keeps (a
    /// new description alone is no reason to write).
    pub(crate) fn changed(&self, current: &[PublicFault]) -> bool {
        current.len() != self.considered.len()
            || current
                .iter()
                .any(|f| !self.considered.contains(&f.fault_id))
    }

    /// Whether a repeated `recover` has been repeated long enough.
    pub(crate) fn expiring(&self, now: Timestamp) -> bool {
        let kept = i64::try_from(RECOVER_KEPT.as_millis()).unwrap_or(i64::MAX);
        self.recovered
            .values()
            .any(|(_, at)| now.as_millisecond().saturating_sub(*at) >= kept)
    }

    /// The message for `current` under `resource`, or `None` when there is nothing to say (no
    /// fault now and no recovery to repeat), with the outbox to keep once it is written. A
    /// fault that just ended goes first (as `recover`), then the current ones worst first, then
    /// repeated recoveries; past [`MAX_FAULTS`] the rest waits: an ended fault stays pending,
    /// a current one not sent counts as not published.
    pub(crate) fn message(
        &self,
        node: &str,
        resource: &str,
        current: &[PublicFault],
        now: Timestamp,
    ) -> Option<(Message, Outbox)> {
        let ms = now.as_millisecond();
        let kept = i64::try_from(RECOVER_KEPT.as_millis()).unwrap_or(i64::MAX);
        let is_current = |id: &str| current.iter().any(|c| c.fault_id == id);
        let mut ended: Vec<(PublicFault, i64)> = Vec::new();
        for (id, f) in &self.occurring {
            if !is_current(id) {
                let mut r = f.clone();
                r.assertion = "recover".into();
                r.fault_time = ms;
                ended.push((r, ms));
            }
        }
        let repeated: Vec<(PublicFault, i64)> = self
            .recovered
            .iter()
            .filter(|(id, (_, at))| ms.saturating_sub(*at) < kept && !is_current(id))
            .map(|(_, x)| x.clone())
            .collect();
        let total = ended.len() + current.len() + repeated.len();
        if total == 0 {
            return None;
        }
        if total > MAX_FAULTS {
            warn!(
                faults = total,
                max = MAX_FAULTS,
                "more public faults than one message holds; the rest wait for the next message"
            );
        }
        let mut faults: Vec<PublicFault> = Vec::new();
        let mut next = Outbox {
            resource: resource.to_string(),
            considered: current.iter().map(|f| f.fault_id.clone()).collect(),
            ..Outbox::default()
        };
        for (f, at) in ended.iter().chain(repeated.iter()) {
            next.recovered.insert(f.fault_id.clone(), (f.clone(), *at));
        }
        let ordered = ended
            .iter()
            .map(|(f, _)| (f, false))
            .chain(current.iter().map(|f| (f, true)))
            .chain(repeated.iter().map(|(f, _)| (f, false)));
        for (f, occurs) in ordered.take(MAX_FAULTS) {
            if occurs {
                next.occurring.insert(f.fault_id.clone(), f.clone());
            }
            faults.push(f.clone());
        }
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

    /// Reads the outbox a previous run left; a missing, oversized or unreadable file is an
    /// empty outbox (with a warning for the last two).
    pub(crate) fn load(dir: &std::path::Path) -> Outbox {
        use std::io::Read;
        let path = dir.join(OUTBOX_FILE);
        let Ok(f) = std::fs::File::open(&path) else {
            return Outbox::default();
        };
        let mut text = Vec::new();
        if let Err(e) = f.take(OUTBOX_MAX_BYTES + 1).read_to_end(&mut text) {
            warn!(path = %path.display(), error = %e, "cannot read the public-fault outbox");
            return Outbox::default();
        }
        if text.len() as u64 > OUTBOX_MAX_BYTES {
            warn!(path = %path.display(), "the public-fault outbox is too large; ignored");
            return Outbox::default();
        }
        serde_json::from_slice(&text).unwrap_or_else(|e| {
            warn!(path = %path.display(), error = %e, "the public-fault outbox is unreadable; ignored");
            Outbox::default()
        })
    }
}

/// Not before 2025-01-01T00:00:00Z: ClusterD discards a message dated earlier (a node whose
/// clock is unset).
const EARLIEST_MS: i64 = 1_735_689_600_000;

/// Where a message goes: the ConfigMap in Kubernetes mode.
pub(crate) trait DocumentPublisher: Send + Sync + 'static {
    /// Why a message could not be written.
    type Error: std::error::Error + Send;
    /// Writes the message; the error is logged and retried.
    fn publish(
        &self,
        document: &str,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send;
}

/// Everything `run` needs.
#[derive(Debug)]
pub(crate) struct PublicFaultSink<P: DocumentPublisher> {
    pub node: String,
    /// The state directory (the outbox file).
    pub dir: std::path::PathBuf,
    pub publisher: P,
    pub snapshots: watch::Receiver<Option<Snapshot>>,
    pub policy: watch::Receiver<LoadedPolicy>,
    pub clock: Arc<dyn Clock>,
    pub metrics: Arc<Metrics>,
    /// After start, a message that would retract a published fault waits this long, so a
    /// restarted agent re-detects standing faults first (a `recover` followed within seconds
    /// by the same `occur` can leave ClusterD without the fault: it deletes 5 s after a
    /// `recover`).
    pub settle: Duration,
    pub shutdown: CancellationToken,
}

impl<P: DocumentPublisher> PublicFaultSink<P> {
    /// Runs until shutdown or the engine stops. Writes when the faults change, when the policy
    /// turns the output off (every published fault as `recover`) or renames the resource (the
    /// same under the old name first), while recoveries are being repeated, and again every
    /// `ascend.mindcluster.resync` (± 25 % per node) while anything is published: ClusterD drops
    /// messages beyond its rate limit (100 at once, then 1 a second per resource) and after a
    /// restart replays only the last one. A failed write is retried with backoff and never
    /// holds up detection.
    pub(crate) async fn run(mut self) {
        let label = SinkLabel {
            sink: "publicfault",
        };
        let mut outbox = Outbox::load(&self.dir);
        let started = self.clock.instant();
        let mut retry = crate::sink::kube::retry();
        let mut last_sent: Option<tokio::time::Instant> = None;
        let spread =
            u32::try_from(u64::from_str_radix(&hash16(&[&self.node])[..4], 16).unwrap_or(0) % 500)
                .unwrap_or(0);
        loop {
            let (enabled, resource, resync) = {
                let p = &self.policy.borrow().policy.ascend.mindcluster;
                (
                    p.public_faults.enabled,
                    p.public_faults.resource.clone(),
                    p.resync,
                )
            };
            // ± 25 %: 750..1250 per mille of resync.
            let resync = resync * (750 + spread) / 1000;
            let snap = self.snapshots.borrow_and_update().clone();
            let have_snapshot = snap.is_some();
            let now = self.clock.now();
            let tick = self.clock.instant();
            let mut wake = None;
            if outbox.occurring.is_empty() && outbox.resource != resource {
                // Nothing published under the old name (or none yet): take the new one; the
                // repeats of old recoveries stop.
                outbox = Outbox::empty(&resource);
            }
            // What to send now: (resource, current faults), or nothing.
            let job: Option<(String, Vec<PublicFault>)> = if !enabled || resource != outbox.resource
            {
                // Off, or renamed: retract what was published under the old name first.
                (!outbox.occurring.is_empty()).then(|| (outbox.resource.clone(), Vec::new()))
            } else {
                snap.map(|snap| entries(&self.node, &snap.record.faults, &snap.inventory))
                    .filter(|current| {
                        outbox.changed(current)
                            || outbox.expiring(now)
                            || (!outbox.is_empty()
                                && last_sent.is_none_or(|at| tick >= at + resync))
                    })
                    .map(|current| (resource.clone(), current))
            };
            let settle_until = started + self.settle;
            let retracts = |current: &[PublicFault]| {
                outbox
                    .occurring
                    .keys()
                    .any(|id| !current.iter().any(|c| &c.fault_id == id))
            };
            // Retractions of every kind wait: an agent just started may still be loading its
            // policy (the built-in one has the output off) or re-detecting standing faults.
            let job = match job {
                Some((_, ref current)) if tick < settle_until && retracts(current) => {
                    debug!("holding a retraction until the agent has settled");
                    wake = Some(settle_until);
                    None
                }
                other => other,
            };
            if let Some((name, current)) = job {
                if now.as_millisecond() < EARLIEST_MS {
                    warn!(%now, "the clock is before 2025: ClusterD would discard the message; not sent");
                    wake = Some(tick + retry.next_delay());
                } else {
                    match outbox.message(&self.node, &name, &current, now) {
                        None => outbox = Outbox::empty(&resource),
                        Some((msg, mut next)) => {
                            let text = serde_json::to_string(&msg).unwrap_or_default();
                            match self.publisher.publish(&text).await {
                                Ok(()) => {
                                    self.metrics.sink_writes.get_or_create(&label).inc();
                                    debug!(faults = msg.faults.len(), "public faults published");
                                    if name != resource || !enabled {
                                        // Retracted: what was under the old name is done.
                                        next = Outbox::empty(&resource);
                                    }
                                    outbox = next;
                                    last_sent = Some(tick);
                                    self.save(&outbox).await;
                                    retry.reset();
                                }
                                Err(e) => {
                                    self.metrics.sink_errors.get_or_create(&label).inc();
                                    warn!(error = %e, "publishing public faults failed; detection goes on");
                                    wake = Some(tick + retry.next_delay());
                                }
                            }
                        }
                    }
                }
            }
            if wake.is_none() && !outbox.is_empty() && enabled && have_snapshot {
                // Look again for expiring recoveries and for the periodic re-send (never in the
                // past: before a first send the job above has just run).
                let resend = last_sent.map_or(tick + resync, |at| at + resync);
                wake = Some(
                    resend
                        .min(tick + Duration::from_secs(30))
                        .max(tick + Duration::from_millis(100)),
                );
            }
            let woke = crate::sink::next_input(
                &self.shutdown,
                &mut self.snapshots,
                &mut self.policy,
                wake,
            )
            .await;
            if woke == crate::sink::Woke::Stop {
                return;
            }
        }
    }

    /// Keeps the outbox for the next run; a failure is logged (the next write tries again).
    async fn save(&self, outbox: &Outbox) {
        let path = self.dir.join(OUTBOX_FILE);
        let bytes = serde_json::to_vec(outbox).unwrap_or_default();
        let r = tokio::task::spawn_blocking(move || crate::atomic_file::write(&path, &bytes)).await;
        if !matches!(r, Ok(Ok(()))) {
            warn!(
                "cannot keep the public-fault outbox; a restart may not retract what was published"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context as _;

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
        release_config("v26.1.0")
    }

    /// The shipped `publicCustomization.json` of one release line.
    fn release_config(dir: &str) -> ClusterdConfig {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests/examples/mindcluster")
            .join(dir)
            .join("publicCustomization.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// The message for `current` as JSON text, after ClusterD's checks with the newest file.
    fn checked_message(node: &str, current: &[PublicFault]) -> String {
        let (msg, _) = Outbox::default()
            .message(node, "faultline", current, t(10))
            .unwrap();
        let text = serde_json::to_string(&msg).unwrap();
        if let Err(e) = clusterd_check(&text, &shipped_config()) {
            panic!("{e}: {text}");
        }
        text
    }

    /// One ClusterD release line, restated from MindCluster's code at its tags: the built-in
    /// `component/clusterd/build/publicFaultConfiguration.json` (codes by level, resources),
    /// and the level keys its code struct has (`pubFaultCode` in
    /// `pkg/domain/publicfault/file.go`; `PreSeparateNPUCodes` from v7.3.0 on).
    struct Release {
        dir: &'static str,
        pre_separate: bool,
        codes: Vec<(&'static str, Vec<&'static str>)>,
        resources: Vec<&'static str>,
    }

    fn releases() -> Vec<Release> {
        let separate = vec![
            "220001001",
            "220001002",
            "220001003",
            "220001004",
            "220001005",
            "220001006",
            "220001007",
        ];
        let not_handle = vec![
            "200001006",
            "200001010",
            "200001011",
            "200001012",
            "100001011",
        ];
        let sub_health_70 = vec![
            "010001001",
            "010001004",
            "310001005",
            "210001007",
            "210001008",
            "210001009",
        ];
        let sub_health_71 = [
            sub_health_70.clone(),
            vec!["110001010", "110001020", "110001021"],
        ]
        .concat();
        let resources_70 = vec!["CCAE", "fd-online", "pingmesh", "Netmind"];
        let resources_71 = [resources_70.clone(), vec!["dpcStorage"]].concat();
        let v71 = |dir, pre_separate| Release {
            dir,
            pre_separate,
            codes: vec![
                ("NotHandleFaultCodes", not_handle.clone()),
                ("SubHealthFaultCodes", sub_health_71.clone()),
                ("SeparateNPUCodes", separate.clone()),
            ],
            resources: resources_71.clone(),
        };
        vec![
            Release {
                dir: "v7.0.RC1",
                pre_separate: false,
                codes: vec![
                    ("NotHandleFaultCodes", vec!["200001006"]),
                    ("SubHealthFaultCodes", sub_health_70.clone()),
                    ("SeparateNPUCodes", separate.clone()),
                ],
                resources: resources_70.clone(),
            },
            v71("v7.1.RC1-v7.2.RC1", false),
            v71("v7.3.0-v26.0.1", true),
            Release {
                dir: "v26.1.0",
                pre_separate: true,
                codes: vec![
                    ("NotHandleFaultCodes", not_handle.clone()),
                    (
                        "SubHealthFaultCodes",
                        [sub_health_71.clone(), vec!["010001002"]].concat(),
                    ),
                    (
                        "SeparateNPUCodes",
                        [separate, vec!["120001001", "020001001"]].concat(),
                    ),
                    ("PreSeparateNPUCodes", vec!["110001022", "110001023"]),
                ],
                resources: [resources_71, vec!["dtfsStorage"]].concat(),
            },
        ]
    }

    /// The shipped file of each release line keeps everything ClusterD's own file has (an
    /// operator's file replaces it: `LoadPubFaultCfgFromFile` resets the code cache and the
    /// resources), uses only the level keys that release reads (Go's decoder drops any other
    /// key, and the codes under it become unknown: v7.0.RC1 then refuses the whole message),
    /// and lists every code faultline sends exactly once: at its own level, or, before
    /// PreSeparateNPU exists, under SeparateNPU (the chip is kept from new work either way).
    #[test]
    fn one_complete_clusterd_configuration_per_release_line() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests/examples/mindcluster");
        let mut found: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        found.sort();
        let mut want: Vec<String> = releases().iter().map(|r| r.dir.to_string()).collect();
        want.sort();
        assert_eq!(found, want, "one directory per release line");
        let resource = faultline_core::policy::PublicFaultPolicy::default().resource;
        for r in releases() {
            let path = dir.join(r.dir).join("publicCustomization.json");
            let text = std::fs::read_to_string(&path).unwrap();
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let top: Vec<&String> = v.as_object().unwrap().keys().collect();
            assert_eq!(top, ["publicFaultCode", "publicFaultResource"], "{}", r.dir);
            let cfg: ClusterdConfig = serde_json::from_value(v).unwrap();
            let read = |key: &str| key != "PreSeparateNPUCodes" || r.pre_separate;
            for key in cfg.public_fault_code.keys() {
                assert!(
                    [
                        "NotHandleFaultCodes",
                        "SubHealthFaultCodes",
                        "SeparateNPUCodes",
                        "PreSeparateNPUCodes"
                    ]
                    .contains(&key.as_str())
                        && read(key),
                    "{}: {key} is not read",
                    r.dir
                );
            }
            // ClusterD's level of a code (`GetFaultLevelByCode`): the first list that has it.
            let level_of = |code: &str| {
                let lists: Vec<&str> = cfg
                    .public_fault_code
                    .iter()
                    .filter(|(_, codes)| codes.iter().any(|c| c == code))
                    .map(|(k, _)| k.as_str())
                    .collect();
                assert!(lists.len() <= 1, "{}: {code} under {lists:?}", r.dir);
                lists.first().map(|k| k.to_string())
            };
            for (key, codes) in &r.codes {
                for code in codes {
                    assert_eq!(level_of(code).as_deref(), Some(*key), "{}: {code}", r.dir);
                }
            }
            for res in r.resources.iter().copied().chain([resource.as_str()]) {
                assert!(
                    cfg.public_fault_resource.iter().any(|x| x == res),
                    "{}: resource {res}",
                    r.dir
                );
            }
            for level in PublicLevel::ALL {
                let key = match level.table_key() {
                    k if read(k) => k,
                    _ => "SeparateNPUCodes",
                };
                for ty in FAULT_TYPES {
                    let code = public_code(ty, level);
                    assert_eq!(level_of(&code).as_deref(), Some(key), "{}: {code}", r.dir);
                }
            }
        }
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

    /// ClusterD's check of one public-fault message, restated from its checker
    /// (`application/publicfault/checker.go`). A failure of the message's own fields discards
    /// it on every release; an invalid fault discards the whole message on v7.0.RC1
    /// (`checkFaults`) and only that fault from v7.1.RC1 on (`checkFaultsAndFlush`). faultline
    /// must pass on both, so here any failure fails. Parsed into a plain JSON value first, as
    /// ClusterD decodes into its own structs (so our struct cannot hide a missing or misnamed
    /// field).
    fn clusterd_check(text: &str, cfg: &ClusterdConfig) -> anyhow::Result<()> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        let s = |x: &serde_json::Value, k: &str| x[k].as_str().unwrap_or_default().to_string();
        if !id_ok(&s(&v, "id")) {
            anyhow::bail!("id");
        }
        if !v["timestamp"].as_i64().is_some_and(ms_ok) {
            anyhow::bail!("timestamp");
        }
        if s(&v, "version") != "1.0" {
            anyhow::bail!("version");
        }
        if !cfg.public_fault_resource.contains(&s(&v, "resource")) {
            anyhow::bail!("resource");
        }
        let faults = v["faults"].as_array().context("faults")?;
        if !(1..=100).contains(&faults.len()) {
            anyhow::bail!("faults count");
        }
        let codes: BTreeSet<&String> = cfg.public_fault_code.values().flatten().collect();
        for f in faults {
            if !id_ok(&s(f, "faultId")) {
                anyhow::bail!("faultId");
            }
            if !["NPU", "Node", "Network", "Storage"].contains(&s(f, "faultType").as_str()) {
                anyhow::bail!("faultType");
            }
            let code = s(f, "faultCode");
            if code.chars().count() != 9 || !codes.contains(&code) {
                anyhow::bail!("faultCode {code}");
            }
            if !f["faultTime"].as_i64().is_some_and(ms_ok) {
                anyhow::bail!("faultTime");
            }
            if !["occur", "recover"].contains(&s(f, "assertion").as_str()) {
                anyhow::bail!("assertion");
            }
            let loc = f["faultLocation"].as_object().context("faultLocation")?;
            if loc.len() > 10
                || loc.iter().any(|(k, v)| {
                    // Go's len(): bytes.
                    k.len() > 16 || v.as_str().is_none_or(|v| v.len() > 128)
                })
            {
                anyhow::bail!("faultLocation");
            }
            let inf = f["influence"].as_array().context("influence")?;
            if !(1..=1000).contains(&inf.len()) {
                anyhow::bail!("influence count");
            }
            for i in inf {
                if !valid_node_name(&s(i, "nodeName")) {
                    anyhow::bail!("nodeName");
                }
                let ids: Vec<i64> = i["deviceIds"]
                    .as_array()
                    .context("deviceIds")?
                    .iter()
                    .map(|x| x.as_i64().unwrap_or(-1))
                    .collect();
                let unique: BTreeSet<&i64> = ids.iter().collect();
                if !(1..=32).contains(&ids.len())
                    || unique.len() != ids.len()
                    || ids.iter().any(|d| !(0..=31).contains(d))
                {
                    anyhow::bail!("deviceIds");
                }
            }
            let d = s(f, "description");
            if d.chars().count() > 512 || d.chars().any(|c| c.is_whitespace() && c != ' ') {
                anyhow::bail!("description");
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
        let text = checked_message("gpu-node-1", &current);
        // What the mindcluster component's admission policy requires of it (its CEL, restated):
        // printable ASCII, no backslash, no nodeSN, every nodeName key the agent's own node.
        assert!(text.bytes().all(|b| (b' '..=b'~').contains(&b)), "{text}");
        assert!(!text.contains('\\') && !text.to_ascii_lowercase().contains("\"nodesn\""));
        assert_eq!(
            text.to_ascii_lowercase().matches("\"nodename\"").count(),
            text.matches("\"nodeName\":\"gpu-node-1\"").count()
        );
        assert!(
            text.contains(r#""faultLocation":{"device":"Ascend910-5","faultlineCode":"NPU_LOST"}"#)
        );
        // Every code faultline can send is in each shipped customization:
        // `one_complete_clusterd_configuration_per_release_line`.
    }

    /// A node-level fault on an NPU's own PCI function reaches ClusterD as a fault of every
    /// chip. The kernel reports a fatal PCIe AER error on 0000:01:00.0, the Bus-Id npu-smi shows
    /// for Ascend910-4 (`npu-smi-info-910b-8.txt`); the engine, with the built-in catalog, keeps
    /// it under the PCI function (it does not map Bus-Ids to chip names) as a NodeUnhealthy
    /// fault and the node goes Unhealthy. The message then has a `Node` fault at SeparateNPU
    /// with every chip in `deviceIds`, 4 included: the one level ClusterD files a chip as
    /// unhealthy at on every release (v7.0.RC1 only that one), so no chip of the node, chip 4
    /// least of all, is left listed as usable.
    #[test]
    fn a_fatal_aer_error_on_a_chips_pci_function_withdraws_every_chip() {
        use faultline_core::catalog::Catalog;
        use faultline_core::engine::{Ctx, Engine, Observation};
        use faultline_core::policy::Policy;
        use faultline_core::record::Health;

        let (policy, catalog) = (Policy::parse("").unwrap(), Catalog::builtin().unwrap());
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut engine = Engine::new();
        engine.step(
            ctx,
            Observation::Inventory {
                kind: "Ascend910".into(),
                names: (0..8).map(|i| format!("Ascend910-{i}")).collect(),
            },
            t(0),
        );
        let line = "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0";
        let event = faultline_core::parse::parse_message(line).expect("an AER line");
        engine.step(
            ctx,
            faultline_core::kmsg_reader::to_observation(event, None),
            t(1),
        );
        let view = engine.view(&policy);
        assert_eq!(view.health, Health::Unhealthy);
        let aer = view
            .faults
            .iter()
            .find(|f| f.fault_code == "PCIE_AER_FATAL")
            .expect("the AER fault");
        assert_eq!(
            (aer.fault_type, aer.fault_handling, aer.device.as_str()),
            (
                FaultType::NodeUnhealthy,
                Handling::SeparateNPU,
                "pci-0000:01:00.0"
            )
        );

        let current = entries("gpu-node-1", &view.faults, &view.inventory);
        assert_eq!(current.len(), 1, "{current:?}");
        let f = &current[0];
        assert_eq!(f.fault_type, "Node");
        assert_eq!(f.fault_code, public_code("Node", PublicLevel::SeparateNPU));
        assert_eq!(f.influence[0].node_name, "gpu-node-1");
        assert_eq!(f.influence[0].device_ids, (0..8).collect::<Vec<i32>>());
        assert_eq!(f.fault_location["device"], "pci-0000:01:00.0");
        checked_message("gpu-node-1", &current);
        // ClusterD's level for the code is its table's: SeparateNPU in the file of every release
        // line, the one level that takes a chip off on all of them (v7.0.RC1 files nothing
        // less as unhealthy).
        for r in releases() {
            let cfg = release_config(r.dir);
            assert!(
                cfg.public_fault_code["SeparateNPUCodes"].contains(&f.fault_code),
                "{}",
                r.dir
            );
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
            let e = clusterd_check(&v.to_string(), &cfg)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(want), "{want}: {e}");
        }
    }

    /// A new level (or other chips) is a new faultId: ClusterD adds an `occur` only for an id it
    /// does not hold, so the old id is retracted and the new one sent.
    #[test]
    fn a_new_level_is_a_new_fault_for_clusterd() {
        let mut f = fault(
            "NPU_NET_UNHEALTHY",
            "Ascend910-1",
            Source::Ascend,
            FaultType::CardNetworkUnhealthy,
            Handling::SubHealthFault,
        );
        let before = entries("n1", std::slice::from_ref(&f), &inventory(2));
        let (_, outbox) = Outbox::default()
            .message("n1", "faultline", &before, t(0))
            .unwrap();
        f.fault_handling = Handling::SeparateNPU;
        let after = entries("n1", &[f], &inventory(2));
        assert_ne!(before[0].fault_id, after[0].fault_id);
        assert!(outbox.changed(&after));
        let (msg, _) = outbox.message("n1", "faultline", &after, t(1)).unwrap();
        let got: Vec<(&str, &str, &str)> = msg
            .faults
            .iter()
            .map(|x| {
                (
                    x.fault_id.as_str(),
                    x.assertion.as_str(),
                    x.fault_code.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (before[0].fault_id.as_str(), "recover", "920000002"),
                (after[0].fault_id.as_str(), "occur", "920000004"),
            ]
        );
    }

    /// Past 100 entries a message holds what just ended first, then the worst current faults;
    /// what did not fit is not counted as published, and the same faults again write nothing.
    #[test]
    fn a_full_message_keeps_only_what_it_sent() {
        let many: Vec<PublicFault> = (0..120)
            .map(|i| {
                let mut f = entries(
                    "n1",
                    &[fault(
                        &format!("PEER_X{i}"),
                        "node",
                        Source::Peer,
                        FaultType::NodeUnhealthy,
                        Handling::SubHealthFault,
                    )],
                    &inventory(1),
                );
                f.remove(0)
            })
            .collect();
        let (msg, outbox) = Outbox::default()
            .message("n1", "faultline", &many, t(0))
            .unwrap();
        assert_eq!(msg.faults.len(), MAX_FAULTS);
        assert_eq!(outbox.occurring.len(), MAX_FAULTS);
        assert!(!outbox.changed(&many));
        // All of them end: the hundred sent are retracted, nothing is lost or invented.
        let (msg, outbox) = outbox.message("n1", "faultline", &[], t(1)).unwrap();
        assert_eq!(msg.faults.len(), MAX_FAULTS);
        assert!(msg.faults.iter().all(|f| f.assertion == "recover"));
        assert!(outbox.occurring.is_empty());
    }

    /// The outbox survives a restart through the state directory; a damaged or oversized file
    /// is an empty outbox, never a crash.
    #[test]
    fn the_outbox_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Outbox::load(dir.path()), Outbox::default());
        let current = entries(
            "n1",
            &[fault(
                "NPU_LOST",
                "Ascend910-0",
                Source::Ascend,
                FaultType::CardUnhealthy,
                Handling::SeparateNPU,
            )],
            &inventory(1),
        );
        let (_, outbox) = Outbox::default()
            .message("n1", "faultline", &current, t(0))
            .unwrap();
        std::fs::write(
            dir.path().join(OUTBOX_FILE),
            serde_json::to_vec(&outbox).unwrap(),
        )
        .unwrap();
        let back = Outbox::load(dir.path());
        assert_eq!(back, outbox);
        // After the restart the fault is gone: the first message retracts it.
        let (msg, _) = back.message("n1", "faultline", &[], t(100)).unwrap();
        assert_eq!(msg.faults[0].assertion, "recover");
        assert_eq!(msg.faults[0].fault_id, current[0].fault_id);
        std::fs::write(dir.path().join(OUTBOX_FILE), b"{not json").unwrap();
        assert_eq!(Outbox::load(dir.path()), Outbox::default());
        std::fs::write(dir.path().join(OUTBOX_FILE), vec![b' '; 2 << 20]).unwrap();
        assert_eq!(Outbox::load(dir.path()), Outbox::default());
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
