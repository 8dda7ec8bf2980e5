//! The cluster-wide taint budget: a shared ledger ConfigMap (`faultline-taint-budget` in the
//! agent's namespace) that every agent updates with optimistic concurrency before it newly
//! taints its node.
//!
//! The number of nodes is the number of fault ConfigMaps (one per agent, listed by metadata
//! only), counted by an admitting agent and kept in the ledger for five minutes so the others
//! use it. Admission is a compare-and-swap on the ledger's resourceVersion, so 200 agents failing
//! at once cannot all see room and all taint: exactly `limit` of them get in, the rest are
//! denied until entries leave the window.

use std::collections::BTreeMap;
use std::time::Duration;

use faultline_core::time::Timestamp;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, Client};
use tracing::{debug, info, warn};

use super::plan::{Admission, Ledger, NodeCount};
use super::{api, is_conflict, KubeSinkError, FIELD_MANAGER};
use faultline_core::policy::TaintBudget;

/// Name of the ledger ConfigMap.
pub const LEDGER_NAME: &str = "faultline-taint-budget";
/// Its data key.
pub const LEDGER_KEY: &str = "ledger.json";
/// Selects the fault ConfigMaps, one per agent (the node count).
pub const NODES_SELECTOR: &str = "app.kubernetes.io/name=faultline,faultline.io/node";
/// How long one admission keeps retrying conflicting writes before giving up until the sink's
/// next retry. A conflict means another agent's write landed (progress for the fleet), so a
/// count cap is wrong: with 200 nodes failing at once the last one in sees about 199 conflicts,
/// and a cap of 64 sent most of them into the sink's backoff (2,000 nodes took 12 s).
const CONTENTION_DEADLINE: Duration = Duration::from_secs(20);
/// How long a node count in the ledger is used before an admitting agent counts again. The
/// budget's limit is a share of the fleet; a fleet grows or shrinks by few nodes in minutes.
const NODE_COUNT_MAX_AGE: Duration = Duration::from_secs(300);

/// The budget's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Allowed,
    Denied { used: u32, limit: u32, nodes: u32 },
}

/// Access to the ledger for one node.
#[derive(Debug, Clone)]
pub struct Budget {
    cms: Api<ConfigMap>,
    node: String,
}

impl Budget {
    pub fn new(client: Client, namespace: &str, node: &str) -> Self {
        Budget {
            cms: Api::namespaced(client, namespace),
            node: node.to_string(),
        }
    }

    /// The number of nodes: fault ConfigMaps, one per agent, listed by metadata only.
    async fn count_nodes(&self) -> Result<u32, KubeSinkError> {
        let list = self
            .cms
            .list_metadata(&ListParams::default().labels(NODES_SELECTOR))
            .await
            .map_err(api("count the nodes"))?;
        Ok(u32::try_from(list.items.len()).unwrap_or(u32::MAX))
    }

    /// Asks whether this node may be newly tainted now; records it in the ledger when yes.
    pub async fn admit(
        &self,
        budget: &TaintBudget,
        now: Timestamp,
    ) -> Result<Answer, KubeSinkError> {
        // The node count: the ledger's shared one while fresh, else counted here (once per
        // admission at most, not per conflict) and shared through the write below. 200 agents
        // failing at once in a 2,000-node cluster each listing every record was 400,000
        // objects for one incident; now it is one list per NODE_COUNT_MAX_AGE.
        let mut counted: Option<u32> = None;
        let started = tokio::time::Instant::now();
        let mut attempt: u32 = 0;
        while started.elapsed() < CONTENTION_DEADLINE {
            attempt = attempt.saturating_add(1);
            let current = self
                .cms
                .get_opt(LEDGER_NAME)
                .await
                .map_err(api("read the taint ledger"))?;
            let version = current
                .as_ref()
                .and_then(|c| c.metadata.resource_version.clone());
            let mut ledger = current.as_ref().map(parse_ledger).unwrap_or_default();
            let nodes = match ledger.fresh_nodes(now, NODE_COUNT_MAX_AGE) {
                Some(n) => n,
                None => {
                    let n = match counted {
                        Some(n) => n,
                        None => self.count_nodes().await?,
                    };
                    counted = Some(n);
                    ledger.nodes = Some(NodeCount { count: n, at: now });
                    n
                }
            };
            let limit = budget.limit(nodes);
            let used = match ledger.decide(&self.node, now, budget.window, limit) {
                Admission::AlreadyIn { .. } => return Ok(Answer::Allowed),
                Admission::Denied { used } => {
                    return Ok(Answer::Denied { used, limit, nodes });
                }
                Admission::Admitted { used } => used,
            };
            let text = serde_json::to_string(&ledger).map_err(|source| KubeSinkError::Encode {
                what: "the taint ledger",
                source,
            })?;
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(LEDGER_NAME.to_string()),
                    resource_version: version.clone(),
                    labels: Some(BTreeMap::from([
                        (
                            "app.kubernetes.io/part-of".to_string(),
                            "faultline".to_string(),
                        ),
                        (
                            "app.kubernetes.io/component".to_string(),
                            "taint-budget".to_string(),
                        ),
                    ])),
                    ..Default::default()
                },
                data: Some(BTreeMap::from([(LEDGER_KEY.to_string(), text)])),
                ..Default::default()
            };
            let pp = PostParams {
                field_manager: Some(FIELD_MANAGER.to_string()),
                ..Default::default()
            };
            let written = match version {
                Some(_) => self.cms.replace(LEDGER_NAME, &pp, &cm).await,
                None => self.cms.create(&pp, &cm).await,
            };
            match written {
                Ok(_) => {
                    info!(node = %self.node, used, limit, nodes, "taint budget: admitted");
                    return Ok(Answer::Allowed);
                }
                Err(e) if is_conflict(&e) => {
                    debug!(attempt, "taint ledger changed meanwhile; reading it again");
                    // Spread the retries of many agents failing at once.
                    let spread = 5 + (u64::from(attempt) * 7 + jitter(&self.node)) % 40;
                    tokio::time::sleep(Duration::from_millis(spread)).await;
                }
                Err(e) => return Err(api("write the taint ledger")(e)),
            }
        }
        Err(KubeSinkError::LedgerContention(attempt))
    }
}

/// A per-node number, so agents retrying at once do not stay in lockstep.
fn jitter(node: &str) -> u64 {
    node.bytes()
        .fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
}

/// The ledger in a ConfigMap; an unreadable one counts as empty (and is rewritten), with a
/// warning: losing the ledger can only let up to `limit` more nodes through in one window.
fn parse_ledger(cm: &ConfigMap) -> Ledger {
    let Some(text) = cm.data.as_ref().and_then(|d| d.get(LEDGER_KEY)) else {
        return Ledger::default();
    };
    serde_json::from_str(text).unwrap_or_else(|e| {
        warn!(error = %e, "the taint ledger is unreadable; starting it afresh");
        Ledger::default()
    })
}
