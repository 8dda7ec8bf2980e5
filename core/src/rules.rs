//! The escalation and recovery rule types. Both the policy document (`policy`) and
//! MindCluster's `faultCustomization.json` (`catalog::ascend`) produce them, so they live here,
//! where both can see them without importing each other.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::record::{Handling, Source};

/// Raise a fault's handling when it repeats (`count` occurrences within `window`) or lasts
/// (`duration` of being continuously active).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EscalationRule {
    #[serde(default)]
    pub name: Option<String>,
    /// Fault codes the rule applies to (`Xid13`, `80E01801`, `NVLINK_DOWN`).
    pub codes: Vec<String>,
    #[serde(default)]
    pub count: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    pub window: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub duration: Option<Duration>,
    /// The level to raise to (never lowers a fault).
    pub handling: Handling,
    /// Once the condition is gone, the fault counts as recovered only after staying gone this
    /// long (MindCluster's `RecoverTimeout`); a return within it continues the same fault.
    #[serde(default, with = "humantime_serde")]
    pub recover_after: Option<Duration>,
}

/// Clear a fault after it has been quiet (no new signal) for `clear_after`. A rule applies when
/// every filter it sets matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecoveryRule {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub codes: Vec<String>,
    #[serde(default)]
    pub sources: Vec<Source>,
    /// Applies only to faults whose current handling is at most this level.
    #[serde(default)]
    pub max_handling: Option<Handling>,
    #[serde(with = "humantime_serde")]
    pub clear_after: Duration,
}
