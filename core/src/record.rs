//! The fault record: faultline's public contract (`faultline.io/v1`).
//!
//! These types are serialized into the node-local `faults.json` and, on Kubernetes, into the
//! per-node ConfigMap. Field names (docs/record.md): camelCase at the top, MindCluster's
//! snake_case inside each fault. `docs/record.schema.json` validates the output (a test checks).

use std::fmt;
use std::str::FromStr;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The schema version written into every record.
pub const API_VERSION: &str = "faultline.io/v1";

/// MindCluster's handling levels, least severe first so that `Ord` means "more severe".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Handling {
    NotHandleFault,
    SubHealthFault,
    RestartRequest,
    RestartBusiness,
    FreeRestartNPU,
    RestartNPU,
    PreSeparateNPU,
    SeparateNPU,
    ManuallySeparateNPU,
}

impl Handling {
    /// Every level, least severe first.
    pub const ALL: [Handling; 9] = [
        Handling::NotHandleFault,
        Handling::SubHealthFault,
        Handling::RestartRequest,
        Handling::RestartBusiness,
        Handling::FreeRestartNPU,
        Handling::RestartNPU,
        Handling::PreSeparateNPU,
        Handling::SeparateNPU,
        Handling::ManuallySeparateNPU,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Handling::NotHandleFault => "NotHandleFault",
            Handling::SubHealthFault => "SubHealthFault",
            Handling::RestartRequest => "RestartRequest",
            Handling::RestartBusiness => "RestartBusiness",
            Handling::FreeRestartNPU => "FreeRestartNPU",
            Handling::RestartNPU => "RestartNPU",
            Handling::PreSeparateNPU => "PreSeparateNPU",
            Handling::SeparateNPU => "SeparateNPU",
            Handling::ManuallySeparateNPU => "ManuallySeparateNPU",
        }
    }
}

impl fmt::Display for Handling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error for a string that names no known level, type or verdict.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?} (expected one of: {expected})")]
pub struct UnknownName {
    pub what: &'static str,
    pub value: String,
    pub expected: String,
}

impl FromStr for Handling {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Handling::ALL
            .into_iter()
            .find(|h| h.as_str() == s)
            .ok_or_else(|| UnknownName {
                what: "handling level",
                value: s.to_string(),
                expected: Handling::ALL.map(|h| h.as_str()).join(", "),
            })
    }
}

/// MindCluster's fault types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum FaultType {
    NodeUnhealthy,
    CardUnhealthy,
    CardNetworkUnhealthy,
}

impl FaultType {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultType::NodeUnhealthy => "NodeUnhealthy",
            FaultType::CardUnhealthy => "CardUnhealthy",
            FaultType::CardNetworkUnhealthy => "CardNetworkUnhealthy",
        }
    }
}

impl fmt::Display for FaultType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The node verdict, least severe first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Health {
    Healthy,
    Degraded,
    Unhealthy,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "Healthy",
            Health::Degraded => "Degraded",
            Health::Unhealthy => "Unhealthy",
        }
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Health {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "Healthy" => Ok(Health::Healthy),
            "Degraded" => Ok(Health::Degraded),
            "Unhealthy" => Ok(Health::Unhealthy),
            _ => Err(UnknownName {
                what: "health",
                value: s.to_string(),
                expected: "Healthy, Degraded, Unhealthy".into(),
            }),
        }
    }
}

/// Where an observation came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Kmsg,
    Nvml,
    Ascend,
    Peer,
    Agent,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Kmsg => "kmsg",
            Source::Nvml => "nvml",
            Source::Ascend => "ascend",
            Source::Peer => "peer",
            Source::Agent => "agent",
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Timestamps in records: RFC 3339, UTC, millisecond precision with a `Z`.
pub mod rfc3339 {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Timestamp, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{t:.3}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Timestamp, D::Error> {
        let s = String::deserialize(d)?;
        s.parse::<Timestamp>().map_err(serde::de::Error::custom)
    }

    pub mod option {
        use super::*;
        pub fn serialize<S: Serializer>(t: &Option<Timestamp>, s: S) -> Result<S::Ok, S::Error> {
            match t {
                Some(t) => super::serialize(t, s),
                None => s.serialize_none(),
            }
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Timestamp>, D::Error> {
            let s: Option<String> = Option::deserialize(d)?;
            s.map(|s| s.parse::<Timestamp>().map_err(serde::de::Error::custom))
                .transpose()
        }
    }
}

/// One fault in the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    pub fault_type: FaultType,
    pub fault_code: String,
    pub fault_handling: Handling,
    /// Equal to `fault_handling` (MindCluster writes all three; consumers read `fault_handling`).
    pub fault_level: Handling,
    /// Equal to `fault_handling`.
    pub large_model_fault_level: Handling,
    /// `GPU-<index>`, `GPU-<pci bus id>` when the index is unknown, `Ascend910-<n>`, or `node`.
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_uuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// Every source that reported this fault (the first one is the one that raised it).
    pub source: Source,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also_seen_by: Vec<Source>,
    pub message: String,
    #[serde(with = "rfc3339")]
    pub first_seen: Timestamp,
    #[serde(with = "rfc3339")]
    pub last_seen: Timestamp,
    pub count: u64,
    /// False once the fault recovered; recovered faults stay for a while as history.
    pub active: bool,
    #[serde(
        default,
        with = "rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub recovered_at: Option<Timestamp>,
    /// The level before escalation, when an escalation rule raised it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalated_from: Option<Handling>,
}

/// One detector's state, for the `agent` block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectorStatus {
    pub name: String,
    /// `Running`, `Starting` (set up, not watching yet: a kernel-log FIFO without a writer),
    /// `Idle` (nothing to watch on this machine) or `Down`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The policy in force, and the last reload error if the newest file was rejected.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    /// Path of the policy file, or `builtin`.
    pub source: String,
    /// sha256 (hex) of the policy text in force.
    pub checksum: String,
    /// Why the newest policy file was rejected (the previous one stays in force).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The policy file still being read when detection started: until it is read, the policy
    /// named by `source` (the built-in one) is in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loading: Option<String>,
}

/// Taints the Kubernetes node sink holds back because the cluster's taint budget is spent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaintBudgetStatus {
    /// The taints this node should carry but does not, as `key=value:Effect`.
    pub withheld: Vec<String>,
    /// Nodes newly tainted by faultline within the budget window, cluster-wide.
    pub used: u32,
    /// How many the budget allows within the window.
    pub limit: u32,
    /// Nodes counted (one fault ConfigMap per agent).
    pub nodes: u32,
    #[serde(with = "rfc3339")]
    pub since: Timestamp,
}

/// What the agent says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    pub version: String,
    pub policy: PolicyStatus,
    pub detectors: Vec<DetectorStatus>,
    /// Present while a taint is withheld by the taint budget (Kubernetes mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taint_budget: Option<TaintBudgetStatus>,
    /// When the agent last wrote the local file: it rewrites the record at least every
    /// heartbeat interval (10 s by default) while it runs and can write, so a reader can tell a
    /// live agent's record from a stopped one's (docs/record.md, "Alive"). Only in the local
    /// file, never in the ConfigMap (it would be a write to the API server every interval).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "rfc3339::option"
    )]
    pub heartbeat_time: Option<Timestamp>,
    /// Where the same heartbeat fell on the boot clock: what a reader on this node judges
    /// liveness by, since no wall-clock step moves it (docs/record.md, "Alive"). Local file only,
    /// absent when the agent could not read the boot id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_boot: Option<BootClock>,
}

/// A reading of the boot clock (`CLOCK_BOOTTIME`: monotonic, counting suspend, never stepped)
/// with the boot it belongs to: two readings compare only when their boot ids are equal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BootClock {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`), new at every boot.
    pub boot_id: String,
    /// Milliseconds since that boot.
    pub since_boot_ms: u64,
}

/// The whole record for one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRecord {
    pub api_version: String,
    pub node: String,
    pub health: Health,
    /// The most severe active handling, absent when no fault is active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handling: Option<Handling>,
    #[serde(with = "rfc3339")]
    pub update_time: Timestamp,
    /// Hex sha256 of the JSON of `faults`.
    pub check_code: String,
    pub faults: Vec<Fault>,
    /// Recovered faults dropped from this record to keep it within its size bound.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropped_faults: u64,
    pub agent: AgentStatus,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The check code of a faults array: hex sha256 of its compact JSON.
pub fn check_code(faults: &[Fault]) -> String {
    // Serializing plain data with string keys cannot fail.
    let json = serde_json::to_vec(faults).unwrap_or_default();
    hex::encode(Sha256::digest(&json))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handling_order_matches_mindcluster() {
        // Most severe first in FACTS.md.
        let mut sorted = Handling::ALL.to_vec();
        sorted.sort();
        sorted.reverse();
        assert_eq!(
            sorted.iter().map(|h| h.as_str()).collect::<Vec<_>>(),
            vec![
                "ManuallySeparateNPU",
                "SeparateNPU",
                "PreSeparateNPU",
                "RestartNPU",
                "FreeRestartNPU",
                "RestartBusiness",
                "RestartRequest",
                "SubHealthFault",
                "NotHandleFault"
            ]
        );
    }

    #[test]
    fn handling_parses_its_names_and_rejects_others() {
        for h in Handling::ALL {
            assert_eq!(h.as_str().parse::<Handling>(), Ok(h));
        }
        let err = "Reboot".parse::<Handling>().unwrap_err();
        assert!(err.to_string().contains("Reboot"), "{err}");
        assert!(err.to_string().contains("SeparateNPU"), "{err}");
    }
}
