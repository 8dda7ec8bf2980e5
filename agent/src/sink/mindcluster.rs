//! The MindCluster-compatible output (opt-in, `ascend.mindcluster.enabled`): the per-node
//! `DeviceInfoCfg` document that Volcano's Ascend rescheduling reads from the ConfigMap
//! `mindx-dl-deviceinfo-<node>` in `kube-system` (label `mx-consumer-cim=true`), and the same
//! document as `deviceinfo.json` next to the fault file for standalone use.
//!
//! The document is rewritten when the device lists change (fault times do not count) and at
//! least every `ascend.mindcluster.resync`, since consumers read an old `UpdateTime` as a dead
//! node. Building it is pure (`device_list`, `render`); `run` writes it.
//!
//! Which chip goes in which list (docs/ascend.md explains the choice):
//! - `huawei.com/Ascend910-Unhealthy`: an active chip fault at `RestartRequest` or worse, as
//!   MindCluster's device plugin decides, including `NPU_LOST` and `NPU_UNHEALTHY`;
//! - `huawei.com/Ascend910-NetworkUnhealthy`: an active network fault at any level but
//!   `NotHandleFault` (a port down past its duration rule, a flapping port);
//! - `huawei.com/Ascend910-Recovering`: a fault whose condition is gone but whose recovery hold
//!   still runs;
//! - `huawei.com/Ascend910`: every other chip the source has seen;
//! - `huawei.com/Ascend910-Fault`: per chip with active Ascend codes, a `CardNetworkUnhealthy`
//!   element with its network codes and then a `CardUnhealthy` element with its chip codes,
//!   codes in the order they occurred (hex codes only: faultline's named conditions stay out,
//!   a consumer may parse the codes as hex).
//!
//! Keys are per chip family as the device plugin names them: the above for 910, 910B and 910A3;
//! `huawei.com/Ascend310P`, `-Unhealthy` and `-Fault` for 310P cards, and the same for 310
//! (`Ascend310`): the device plugin computes no network health and has no recovering list
//! there, so a chip waiting out a recovery hold is listed unhealthy.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use faultline_core::time::Timestamp;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::atomic_file::write as write_atomic;
use crate::clock::Clock;
use crate::engine_loop::Snapshot;
use crate::metrics::{Metrics, SinkLabel};
use faultline_core::catalog::ascend::{is_fault_code, FAMILIES, KIND};
use faultline_core::engine::NodeView;
use faultline_core::policy::LoadedPolicy;
use faultline_core::record::{Fault, FaultType, Handling, Source};

pub(crate) const CONFIGMAP_PREFIX: &str = "mindx-dl-deviceinfo-";
pub(crate) const NAMESPACE: &str = "kube-system";
pub(crate) const DATA_KEY: &str = "DeviceInfoCfg";
pub(crate) const CONSUMER_LABEL: (&str, &str) = ("mx-consumer-cim", "true");
pub(crate) const FILE_NAME: &str = "deviceinfo.json";

/// `huawei.com/Ascend910` and its suffixed keys.
#[cfg(test)]
pub(crate) fn key(suffix: &str) -> String {
    family_key(KIND, suffix)
}

/// `huawei.com/<family>` and its suffixed keys (`huawei.com/Ascend310P-Fault`).
pub(crate) fn family_key(family: &str, suffix: &str) -> String {
    if suffix.is_empty() {
        format!("huawei.com/{family}")
    } else {
        format!("huawei.com/{family}-{suffix}")
    }
}

/// Whether the device plugin keeps network and recovering lists for this family (910 only).
fn has_network_lists(family: &str) -> bool {
    family == KIND
}

/// One element of the `-Fault` list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct DeviceFault {
    pub fault_type: FaultType,
    pub npu_name: String,
    pub large_model_fault_level: Handling,
    pub fault_level: Handling,
    pub fault_handling: Handling,
    pub fault_code: String,
    pub fault_time_and_level_map: BTreeMap<String, TimeAndLevel>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct TimeAndLevel {
    /// Unix milliseconds of the fault's first sighting.
    pub fault_time: i64,
    pub fault_level: Handling,
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct DeviceInfo<'a> {
    device_list: &'a BTreeMap<String, String>,
    update_time: i64,
}

#[derive(Serialize)]
struct DeviceInfoCfg<'a> {
    #[serde(rename = "DeviceInfo")]
    device_info: DeviceInfo<'a>,
    #[serde(rename = "SuperPodID")]
    super_pod_id: i64,
    #[serde(rename = "ServerIndex")]
    server_index: i64,
    #[serde(rename = "CheckCode")]
    check_code: String,
}

/// Sorts `Ascend910-2` before `Ascend910-10`.
fn chip_order(name: &str) -> (u64, String) {
    let n = name
        .rsplit('-')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX);
    (n, name.to_string())
}

fn join(names: &BTreeSet<String>) -> String {
    let mut v: Vec<&String> = names.iter().collect();
    v.sort_by_key(|n| chip_order(n));
    v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(",")
}

/// What the `DeviceList` is built from: the engine's published view (faults, the Ascend chips
/// the source last saw, and the faults waiting out a recovery hold).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceListInput<'a> {
    pub faults: &'a [Fault],
    pub inventory: &'a BTreeMap<String, BTreeSet<String>>,
    pub recovering: &'a BTreeSet<(String, String)>,
}

impl<'a> From<&'a Snapshot> for DeviceListInput<'a> {
    fn from(s: &'a Snapshot) -> Self {
        DeviceListInput {
            faults: &s.record.faults,
            inventory: &s.inventory,
            recovering: &s.recovering,
        }
    }
}

impl<'a> From<&'a NodeView> for DeviceListInput<'a> {
    fn from(v: &'a NodeView) -> Self {
        DeviceListInput {
            faults: &v.faults,
            inventory: &v.inventory,
            recovering: &v.recovering,
        }
    }
}

/// The `DeviceList` map from the engine's published view: chips from the Ascend inventory,
/// faults from the Ascend source; the keys of each chip family present.
pub(crate) fn device_list(input: DeviceListInput<'_>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for family in FAMILIES {
        let prefix = format!("{family}-");
        let present = input.inventory.get(family).is_some_and(|c| !c.is_empty())
            || input
                .faults
                .iter()
                .any(|r| r.active && r.source == Source::Ascend && r.device.starts_with(&prefix));
        if present {
            out.extend(family_list(family, input));
        }
    }
    out
}

/// The keys of one chip family.
fn family_list(family: &str, input: DeviceListInput<'_>) -> BTreeMap<String, String> {
    let key = |suffix: &str| family_key(family, suffix);
    let lists = has_network_lists(family);
    let prefix = format!("{family}-");
    let mut all: BTreeSet<String> = input.inventory.get(family).cloned().unwrap_or_default();
    let mut unhealthy = BTreeSet::new();
    let mut network = BTreeSet::new();
    let mut recovering = BTreeSet::new();
    // (chip, is-network) -> (worst level, (first seen, code, level) per code)
    type Element = (Handling, Vec<(Timestamp, String, Handling)>);
    let mut faults: BTreeMap<(String, bool), Element> = BTreeMap::new();
    for r in input.faults {
        if !r.active || r.source != Source::Ascend || !r.device.starts_with(&prefix) {
            continue;
        }
        all.insert(r.device.clone());
        if input
            .recovering
            .contains(&(r.device.clone(), r.fault_code.clone()))
        {
            if lists {
                recovering.insert(r.device.clone());
            } else {
                unhealthy.insert(r.device.clone());
            }
            continue;
        }
        let h = r.fault_handling;
        let is_network = r.fault_type == FaultType::CardNetworkUnhealthy;
        // The device plugin's rules: a chip is unhealthy from RestartRequest up, a chip's
        // network from any level but NotHandleFault (docs/ascend.md, "Which list").
        if lists && is_network && h > Handling::NotHandleFault {
            network.insert(r.device.clone());
        }
        if !is_network && h >= Handling::RestartRequest {
            unhealthy.insert(r.device.clone());
        }
        if is_fault_code(&r.fault_code) {
            let e = faults
                .entry((r.device.clone(), is_network))
                .or_insert((h, Vec::new()));
            e.0 = e.0.max(h);
            e.1.push((r.first_seen, r.fault_code.to_ascii_uppercase(), h));
        }
    }
    let healthy: BTreeSet<String> = all
        .iter()
        .filter(|n| !unhealthy.contains(*n) && !network.contains(*n) && !recovering.contains(*n))
        .cloned()
        .collect();
    // Per chip in chip order, its network element first, then its chip element: consumers
    // look for a link-down chip as an element of type CardNetworkUnhealthy whose fault_code is
    // exactly `81078603`, so network and chip codes never share an element.
    let mut keys: Vec<&(String, bool)> = faults.keys().collect();
    keys.sort_by_key(|(n, is_network)| (chip_order(n), !is_network));
    let elements: Vec<DeviceFault> = keys
        .into_iter()
        .map(|k| {
            let (worst, codes) = &faults[k];
            let mut codes = codes.clone();
            // In the order they occurred, as the device plugin lists them.
            codes.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
            DeviceFault {
                fault_type: if k.1 {
                    FaultType::CardNetworkUnhealthy
                } else {
                    FaultType::CardUnhealthy
                },
                npu_name: k.0.clone(),
                large_model_fault_level: *worst,
                fault_level: *worst,
                fault_handling: *worst,
                fault_code: codes
                    .iter()
                    .map(|c| c.1.as_str())
                    .collect::<Vec<_>>()
                    .join(","),
                fault_time_and_level_map: codes
                    .iter()
                    .map(|(at, code, level)| {
                        (
                            code.clone(),
                            TimeAndLevel {
                                fault_time: at.as_millisecond(),
                                fault_level: *level,
                            },
                        )
                    })
                    .collect(),
            }
        })
        .collect();
    // Serializing plain data cannot fail; an empty list is the safe fallback all the same.
    let fault_json = serde_json::to_string(&elements).unwrap_or_else(|_| "[]".into());
    let mut list = BTreeMap::from([
        (key(""), join(&healthy)),
        (key("Unhealthy"), join(&unhealthy)),
        (key("Fault"), fault_json),
    ]);
    if lists {
        list.insert(key("NetworkUnhealthy"), join(&network));
        list.insert(key("Recovering"), join(&recovering));
    }
    list
}

/// The `DeviceInfoCfg` document: `CheckCode` is the hex sha256 of the JSON of `DeviceInfo`,
/// fields in MindCluster's order, `SuperPodID` and `ServerIndex` -2 (not part of a super pod).
pub(crate) fn render(list: &BTreeMap<String, String>, update_time: i64) -> String {
    let info = DeviceInfo {
        device_list: list,
        update_time,
    };
    let info_json = serde_json::to_string(&info).unwrap_or_default();
    let doc = DeviceInfoCfg {
        device_info: info,
        super_pod_id: -2,
        server_index: -2,
        check_code: hex::encode(Sha256::digest(info_json.as_bytes())),
    };
    serde_json::to_string(&doc).unwrap_or_default()
}

/// The `UpdateTime` (Unix seconds) of the next document: now, but always after the last one.
/// Volcano skips a document whose UpdateTime is not newer than the one it holds, so two
/// changes within one second (or a clock stepped back) would lose the second.
pub(crate) fn next_update_time(last: Option<i64>, now: i64) -> i64 {
    last.map_or(now, |l| now.max(l.saturating_add(1)))
}

/// Whether the lists name any chip. A node without chips gets no document, as MindCluster's
/// device plugin publishes none there (it exits when it finds no device).
pub(crate) fn has_chips(list: &BTreeMap<String, String>) -> bool {
    FAMILIES.iter().any(|f| {
        ["", "Unhealthy", "NetworkUnhealthy", "Recovering"]
            .iter()
            .any(|k| list.get(&family_key(f, k)).is_some_and(|v| !v.is_empty()))
    })
}

/// The `UpdateTime` of a document written before (the local file at start): a restart within
/// the same second must not repeat it.
fn last_update_time(path: &std::path::Path) -> Option<i64> {
    let text = std::fs::read(path).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    v["DeviceInfo"]["UpdateTime"].as_i64()
}

/// Where a document (this sink's `DeviceInfoCfg`, `publicfault`'s message) goes besides the
/// local file.
pub(crate) trait DocumentPublisher: Send + Sync + 'static {
    /// Why a document could not be written.
    type Error: std::error::Error + Send;
    /// Writes the document; the error is logged and retried.
    fn publish(
        &self,
        document: &str,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send;
}

/// No Kubernetes: the local file only.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FileOnly;

impl DocumentPublisher for FileOnly {
    type Error = std::convert::Infallible;
    async fn publish(&self, _document: &str) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Everything `run` needs.
#[derive(Debug)]
pub(crate) struct MindClusterSink<P: DocumentPublisher> {
    pub dir: PathBuf,
    pub publisher: P,
    pub snapshots: watch::Receiver<Option<Snapshot>>,
    pub policy: watch::Receiver<LoadedPolicy>,
    pub clock: Arc<dyn Clock>,
    pub metrics: Arc<Metrics>,
    pub shutdown: CancellationToken,
}

impl<P: DocumentPublisher> MindClusterSink<P> {
    /// The same sink publishing somewhere else as well.
    pub(crate) fn with_publisher<Q: DocumentPublisher>(self, publisher: Q) -> MindClusterSink<Q> {
        MindClusterSink {
            dir: self.dir,
            publisher,
            snapshots: self.snapshots,
            policy: self.policy,
            clock: self.clock,
            metrics: self.metrics,
            shutdown: self.shutdown,
        }
    }

    /// Runs until shutdown or the engine stops. Does nothing while the output is disabled.
    pub(crate) async fn run(mut self) {
        let label = SinkLabel {
            sink: "mindcluster",
        };
        let mut file_written: Option<(BTreeMap<String, String>, Instant)> = None;
        let mut published: Option<(BTreeMap<String, String>, Instant)> = None;
        let mut retry = crate::sink::kube::retry();
        let mut last_update = last_update_time(&self.dir.join(FILE_NAME));
        loop {
            let (enabled, resync) = {
                let p = &self.policy.borrow().policy.ascend.mindcluster;
                (p.enabled, p.resync)
            };
            let snap = self.snapshots.borrow_and_update().clone();
            let mut wake = None;
            let list = snap
                .as_ref()
                .filter(|_| enabled)
                .map(|snap| device_list(snap.into()))
                .filter(has_chips);
            if let Some(list) = list {
                let now = self.clock.instant();
                let due = |w: &Option<(BTreeMap<String, String>, Instant)>| {
                    w.as_ref()
                        .is_none_or(|(l, at)| *l != list || now.duration_since(*at) >= resync)
                };
                let (file_due, publish_due) = (due(&file_written), due(&published));
                // Rendered (JSON, sha256) only when something will be written: snapshots come
                // with every engine change, most of which leave the device lists alone.
                let doc = (file_due || publish_due).then(|| {
                    let at = next_update_time(last_update, self.clock.now().as_second());
                    last_update = Some(at);
                    render(&list, at)
                });
                let mut failed = false;
                if let (true, Some(doc)) = (file_due, &doc) {
                    let path = self.dir.join(FILE_NAME);
                    let bytes = doc.clone().into_bytes();
                    let r: Result<(), Box<dyn std::error::Error + Send + Sync>> =
                        tokio::task::spawn_blocking(move || write_atomic(&path, &bytes))
                            .await
                            .map_err(Into::into)
                            .and_then(|r| r.map_err(Into::into));
                    match r {
                        Ok(()) => file_written = Some((list.clone(), now)),
                        Err(e) => {
                            failed = true;
                            warn!(error = %e, "writing deviceinfo.json failed");
                        }
                    }
                }
                if let (true, Some(doc)) = (publish_due, &doc) {
                    match self.publisher.publish(doc).await {
                        Ok(()) => {
                            self.metrics.sink_writes.get_or_create(&label).inc();
                            debug!("DeviceInfoCfg published");
                            published = Some((list.clone(), now));
                        }
                        Err(e) => {
                            failed = true;
                            self.metrics.sink_errors.get_or_create(&label).inc();
                            warn!(error = %e, "publishing DeviceInfoCfg failed; detection goes on");
                        }
                    }
                }
                let retry_at = if failed {
                    Some(now + retry.next_delay())
                } else {
                    retry.reset();
                    None
                };
                // The retry or the next resync of either output, whichever comes first.
                wake = [&file_written, &published]
                    .iter()
                    .filter_map(|w| w.as_ref().map(|(_, at)| *at + resync))
                    .chain(retry_at)
                    .min();
            }
            match crate::sink::next_input(
                &self.shutdown,
                &mut self.snapshots,
                &mut self.policy,
                wake,
            )
            .await
            {
                crate::sink::Woke::Stop => return,
                crate::sink::Woke::Policy => {
                    info!("policy changed; re-evaluating the MindCluster output");
                }
                crate::sink::Woke::Snapshot => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_core::catalog::{Catalog, FaultCode};
    use faultline_core::engine::{Ctx, DeviceRef, Engine, Observation, Signal};
    use faultline_core::policy::Policy;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_790_000_000 + s).unwrap()
    }

    /// An engine whose Ascend inventory has chips 0..n.
    fn with_chips(ctx: Ctx<'_>, n: u32) -> Engine {
        let mut e = Engine::new();
        let names = (0..n).map(|i| format!("Ascend910-{i}")).collect();
        e.step(
            ctx,
            Observation::Inventory {
                kind: KIND.into(),
                names,
            },
            t(0),
        );
        e
    }

    fn ascend(code: &str, network: bool, chip: u32) -> Observation {
        Observation::Signal(Signal::new(
            Source::Ascend,
            FaultCode::Ascend {
                code: code.into(),
                network,
                severe: false,
            },
            Some(DeviceRef::named(&format!("Ascend910-{chip}"))),
            "x",
        ))
    }

    /// The byte layout, pinned against a sample checked by hand: the keys and their order,
    /// the escaping of the Fault list, and the CheckCode over the DeviceInfo JSON.
    #[test]
    fn golden_document() {
        let (policy, catalog) = (Policy::parse("").unwrap(), Catalog::builtin().unwrap());
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut e = with_chips(ctx, 4);
        // 80E3A201 is SeparateNPU in the built-in table; 80E01801 RestartBusiness; the link
        // code starts at NotHandleFault.
        e.step(ctx, ascend("80E3A201", false, 2), t(1));
        e.step(ctx, ascend("80E01801", false, 2), t(2));
        e.step(ctx, ascend("81078603", true, 3), t(3));
        let list = device_list((&e.view(&policy)).into());
        let doc = render(&list, t(10).as_second());
        let golden = include_str!("../../../tests/fixtures/ascend/deviceinfocfg-golden.json");
        assert_eq!(doc, golden.trim_end());
        // CheckCode is sha256 over exactly the DeviceInfo object's bytes.
        let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
        let start = doc.find("{\"DeviceList\"").unwrap();
        let end = doc.find(",\"SuperPodID\"").unwrap();
        assert_eq!(
            v["CheckCode"],
            hex::encode(Sha256::digest(&doc.as_bytes()[start..end]))
        );
    }

    /// 310P cards get MindCluster's 310P keys (`huawei.com/Ascend310P`, `-Unhealthy`, `-Fault`;
    /// no network or recovering lists there) and nothing under the 910 keys.
    #[test]
    fn a_310p_node_gets_the_310p_keys() {
        let (policy, catalog) = (Policy::parse("").unwrap(), Catalog::builtin().unwrap());
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut e = Engine::new();
        e.step(
            ctx,
            Observation::Inventory {
                kind: "Ascend310P".into(),
                names: (0..3).map(|i| format!("Ascend310P-{i}")).collect(),
            },
            t(0),
        );
        let chip = |code: &str, n: u32| {
            Observation::Signal(Signal::new(
                Source::Ascend,
                FaultCode::Ascend {
                    code: code.into(),
                    network: false,
                    severe: false,
                },
                Some(DeviceRef::named(&format!("Ascend310P-{n}"))),
                "x",
            ))
        };
        e.step(ctx, chip("80E3A201", 1), t(1));
        let l = device_list((&e.view(&policy)).into());
        assert_eq!(
            l.keys().map(String::as_str).collect::<Vec<_>>(),
            [
                "huawei.com/Ascend310P",
                "huawei.com/Ascend310P-Fault",
                "huawei.com/Ascend310P-Unhealthy"
            ]
        );
        assert_eq!(l["huawei.com/Ascend310P"], "Ascend310P-0,Ascend310P-2");
        assert_eq!(l["huawei.com/Ascend310P-Unhealthy"], "Ascend310P-1");
        assert!(l["huawei.com/Ascend310P-Fault"].contains(r#""npu_name":"Ascend310P-1""#));
        assert!(has_chips(&l));
    }

    /// The device plugin's rules (docs/ascend.md): a chip is unhealthy from RestartRequest up;
    /// a chip with both network and chip codes gets two elements, the network one first, so a
    /// consumer comparing `fault_code == "81078603"` on CardNetworkUnhealthy elements finds it.
    #[test]
    fn network_and_chip_codes_are_separate_elements() {
        let (policy, catalog) = (Policy::parse("").unwrap(), Catalog::builtin().unwrap());
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut e = with_chips(ctx, 4);
        // 80C98008 is RestartRequest in the built-in table (and in MindCluster's faultCode.json).
        e.step(ctx, ascend("80C98008", false, 1), t(1));
        e.step(ctx, ascend("81078603", true, 1), t(2));
        let l = device_list((&e.view(&policy)).into());
        assert_eq!(
            l[&key("Unhealthy")],
            "Ascend910-1",
            "RestartRequest is unhealthy"
        );
        assert_eq!(l[&key("")], "Ascend910-0,Ascend910-2,Ascend910-3");
        let elems: serde_json::Value = serde_json::from_str(&l[&key("Fault")]).unwrap();
        let pairs: Vec<(&str, &str, &str)> = elems
            .as_array()
            .unwrap()
            .iter()
            .map(|x| {
                (
                    x["npu_name"].as_str().unwrap(),
                    x["fault_type"].as_str().unwrap(),
                    x["fault_code"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            pairs,
            [
                ("Ascend910-1", "CardNetworkUnhealthy", "81078603"),
                ("Ascend910-1", "CardUnhealthy", "80C98008"),
            ]
        );
    }

    #[test]
    fn update_time_strictly_increases_and_cpu_nodes_get_nothing() {
        assert_eq!(next_update_time(None, 100), 100);
        assert_eq!(next_update_time(Some(99), 100), 100);
        assert_eq!(next_update_time(Some(100), 100), 101, "same second");
        assert_eq!(next_update_time(Some(105), 100), 106, "clock stepped back");
        let (policy, catalog) = (Policy::parse("").unwrap(), Catalog::builtin().unwrap());
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        assert!(!has_chips(&device_list(
            (&Engine::new().view(&policy)).into()
        )));
        assert!(has_chips(&device_list(
            (&with_chips(ctx, 1).view(&policy)).into()
        )));
    }

    #[test]
    fn lists_follow_levels_and_holds() {
        let (policy, catalog) = (Policy::parse("").unwrap(), Catalog::builtin().unwrap());
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut e = with_chips(ctx, 11);
        let level = |down: bool| Observation::Level {
            source: Source::Ascend,
            device: Some(DeviceRef::named("Ascend910-10")),
            domain: "npu-link".into(),
            present: if down {
                vec![Signal::new(
                    Source::Ascend,
                    FaultCode::Ascend {
                        code: "81078603".into(),
                        network: true,
                        severe: false,
                    },
                    None,
                    "down",
                )]
            } else {
                vec![]
            },
        };
        e.step(ctx, level(true), t(1));
        let l = device_list((&e.view(&policy)).into());
        // Down for less than the duration rule: still healthy, but listed with its code.
        assert!(
            l[&key("")].ends_with("Ascend910-9,Ascend910-10"),
            "{}",
            l[&key("")]
        );
        assert_eq!(l[&key("NetworkUnhealthy")], "");
        assert!(l[&key("Fault")].contains("\"fault_code\":\"81078603\""));
        e.step(ctx, Observation::Tick, t(22));
        let l = device_list((&e.view(&policy)).into());
        assert_eq!(l[&key("NetworkUnhealthy")], "Ascend910-10");
        assert!(!l[&key("")].contains("Ascend910-10"));
        // Up again: recovering for the hold, then healthy.
        e.step(ctx, level(false), t(30));
        let l = device_list((&e.view(&policy)).into());
        assert_eq!(l[&key("Recovering")], "Ascend910-10");
        assert_eq!(l[&key("NetworkUnhealthy")], "");
        e.step(ctx, Observation::Tick, t(91));
        let l = device_list((&e.view(&policy)).into());
        assert_eq!(l[&key("Recovering")], "");
        assert_eq!(l[&key("Fault")], "[]");
        assert!(l[&key("")].ends_with("Ascend910-10"));
    }
}
