//! The cluster-wide taint budget: a shared ledger ConfigMap (`faultline-taint-budget` in the
//! agent's namespace) that every agent updates with optimistic concurrency before it newly
//! taints its node.
//!
//! The number of nodes is the number of fault ConfigMaps (one per agent, listed by metadata
//! only), kept in the ledger with the time it was taken. Every agent looks at it now and then
//! ([`keep_count_fresh`]) and the first to find it over a minute old counts again, so an incident
//! finds a fresh count and lists nothing; an admitting agent counts only when the shared count is
//! over five minutes old. Admission is a compare-and-swap on the ledger's resourceVersion, so 200
//! agents failing at once cannot all see room and all taint: exactly `limit` of them get in, the
//! rest are denied until entries leave the window.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use faultline_core::time::Timestamp;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::runtime::Clock;

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
/// A shared count older than this is taken again by the first agent whose periodic check
/// ([`keep_count_fresh`]) sees it: fleet-wide that is one list of the records a minute, and an
/// incident finds a count well within [`NODE_COUNT_MAX_AGE`]. At 2,000 nodes, 200 agents failing
/// before any count was shared each listed 2,000 records and the first taint came after 8 s.
const NODE_COUNT_REFRESH_AGE: Duration = Duration::from_secs(60);

/// The budget's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Allowed,
    Denied { used: u32, limit: u32, nodes: u32 },
}

/// What one look at the shared node count did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    /// The count is young enough: nothing listed.
    Fresh,
    /// Counted and written.
    Counted(u32),
    /// Counted, but another agent wrote the ledger meanwhile; the next look settles it.
    Raced,
    /// The list found no records (not even this agent's own): nothing shared.
    Empty,
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

    /// The ledger and the resourceVersion it was read at (`None`: there is none yet).
    async fn read(&self) -> Result<(Option<String>, Ledger), KubeSinkError> {
        let current = self
            .cms
            .get_opt(LEDGER_NAME)
            .await
            .map_err(api("read the taint ledger"))?;
        let version = current
            .as_ref()
            .and_then(|c| c.metadata.resource_version.clone());
        Ok((
            version,
            current.as_ref().map(parse_ledger).unwrap_or_default(),
        ))
    }

    /// Writes the ledger: a replace carrying the resourceVersion it was read at, or a create
    /// when there was none. The inner error is the API's (a 409 means someone wrote first).
    async fn write(
        &self,
        ledger: &Ledger,
        version: Option<String>,
    ) -> Result<Result<(), kube::Error>, KubeSinkError> {
        let text = serde_json::to_string(ledger).map_err(|source| KubeSinkError::Encode {
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
        Ok(match version {
            Some(_) => self.cms.replace(LEDGER_NAME, &pp, &cm).await.map(drop),
            None => self.cms.create(&pp, &cm).await.map(drop),
        })
    }

    /// Reads the ledger, and when its node count is missing or older than `max_age`, counts the records and writes the count (one attempt: a
    /// conflict means another agent wrote first, and the next look settles it).
    pub async fn refresh_count(
        &self,
        now: Timestamp,
        max_age: Duration,
    ) -> Result<Refresh, KubeSinkError> {
        let (version, mut ledger) = self.read().await?;
        if ledger.fresh_nodes(now, max_age).is_some() {
            return Ok(Refresh::Fresh);
        }
        let n = self.count_nodes().await?;
        if n == 0 {
            return Ok(Refresh::Empty);
        }
        ledger.nodes = Some(NodeCount { count: n, at: now });
        match self.write(&ledger, version).await? {
            Ok(()) => Ok(Refresh::Counted(n)),
            Err(e) if is_conflict(&e) => Ok(Refresh::Raced),
            Err(e) => Err(api("write the taint ledger")(e)),
        }
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
        // Whether this attempt put a count of its own into the ledger (only then is a denied
        // admission's write worth making).
        let mut shares_count;
        let started = tokio::time::Instant::now();
        let mut attempt: u32 = 0;
        while started.elapsed() < CONTENTION_DEADLINE {
            attempt = attempt.saturating_add(1);
            let (version, mut ledger) = self.read().await?;
            shares_count = false;
            let nodes = match ledger.fresh_nodes(now, NODE_COUNT_MAX_AGE) {
                Some(n) => n,
                None => {
                    let n = match counted {
                        Some(n) => n,
                        None => self.count_nodes().await?,
                    };
                    counted = Some(n);
                    // No records at all (not even this agent's): nothing worth sharing.
                    if n > 0 {
                        ledger.nodes = Some(NodeCount { count: n, at: now });
                        shares_count = true;
                    }
                    n
                }
            };
            let limit = budget.limit(nodes);
            let used = match ledger.decide(&self.node, now, budget.window, limit) {
                Admission::AlreadyIn { .. } => return Ok(Answer::Allowed),
                Admission::Denied { used } => {
                    // Share a count taken here, so that the denied agents' rechecks find it
                    // and do not each list every record again (one try; a conflict is fine).
                    if shares_count {
                        if let Err(e) = self.write(&ledger, version).await? {
                            debug!(error = %e, "the node count was not shared");
                        }
                    }
                    return Ok(Answer::Denied { used, limit, nodes });
                }
                Admission::Admitted { used } => used,
            };
            let written = self.write(&ledger, version).await?;
            match written {
                Ok(()) => {
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

/// Keeps the ledger's node count fresh until `shutdown`: a first look at a per-node point within
/// `every` of the start, then one every `every` (± 50 %, per node and per look); a look counts
/// again when the count is older than `every` or a minute, whichever is less. Fleet-wide that is
/// `nodes / every` reads of one ConfigMap (2,000 nodes at 5 min: under 7 a second) and one list of
/// the records a minute. Errors are logged and the next look tries again.
pub async fn keep_count_fresh(
    budget: Budget,
    clock: Arc<dyn Clock>,
    every: Duration,
    shutdown: CancellationToken,
) {
    // A zero interval (a typo) must not turn this into a busy loop against the API server, nor
    // an absurd one overflow the spread.
    let every = every.clamp(Duration::from_millis(100), Duration::from_secs(86_400));
    let max_age = every.min(NODE_COUNT_REFRESH_AGE);
    let seed = jitter(&budget.node);
    for look in 0u64.. {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(spread(every, seed, look)) => {}
        }
        let looked = tokio::select! {
            () = shutdown.cancelled() => return,
            r = budget.refresh_count(clock.now(), max_age) => r,
        };
        match looked {
            Ok(Refresh::Counted(n)) => debug!(nodes = n, "taint budget: node count shared"),
            Ok(r) => debug!(result = ?r, "taint budget: node count looked at"),
            // Once per look (minutes apart): a refused call (RBAC) must show.
            Err(e) => warn!(error = %e, "taint budget: could not look at the node count"),
        }
    }
}

/// The wait before look number `look` of [`keep_count_fresh`]: the first within `[0, every)`,
/// the rest within `[every/2, 3·every/2)`, placed by `seed` (the node) and `look` so that a
/// fleet's agents spread out and do not stay in step.
pub fn spread(every: Duration, seed: u64, look: u64) -> Duration {
    // splitmix64: a well-mixed number from the seed and the look's index.
    let mut z = seed ^ look.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let per_mille = u32::try_from(z % 1000).unwrap_or(0);
    let part = every * per_mille / 1000;
    if look == 0 {
        part
    } else {
        every / 2 + part
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The first look falls anywhere within one interval, later ones within half an interval
    /// either side of it, and a fleet's agents do not look in step.
    #[test]
    fn looks_spread_over_the_interval() {
        let every = Duration::from_secs(300);
        let firsts: Vec<Duration> = (0..2000)
            .map(|i| spread(every, jitter(&format!("node-{i:04}")), 0))
            .collect();
        assert!(firsts.iter().all(|d| *d < every));
        // The first looks of 2,000 agents cover the interval: every tenth of it gets some.
        for tenth in 0..10u32 {
            let (lo, hi) = (every * tenth / 10, every * (tenth + 1) / 10);
            let n = firsts.iter().filter(|d| **d >= lo && **d < hi).count();
            assert!((100..=300).contains(&n), "{n} first looks in tenth {tenth}");
        }
        let seed = jitter("node-0001");
        let later: Vec<Duration> = (1..200).map(|k| spread(every, seed, k)).collect();
        assert!(later.iter().all(|d| *d >= every / 2 && *d < every * 3 / 2));
        assert!(
            later.windows(2).any(|w| w[0] != w[1]),
            "one agent's looks vary"
        );
        // A zero interval (a test's setting) never panics.
        assert_eq!(spread(Duration::ZERO, seed, 3), Duration::ZERO);
    }
}
