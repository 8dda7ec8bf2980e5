//! The cluster's taint budget, kept by the active coordinator alone: an agent asks (`Admit`)
//! before it newly taints its own Node, and at most the policy's limit of nodes is admitted
//! within its window.
//!
//! The admissions live in memory and in the ledger ConfigMap `faultline-taint-budget`, which
//! only the replica holding the Lease writes. A replica that becomes active reads the ledger
//! before it answers, so a failover does not reset the window. An admission is answered only
//! once a ledger holding it is written (a group commit: the admissions decided while one write
//! is in flight share the next), so a coordinator that dies after answering has left the
//! admission in the ledger, and 200 nodes failing at once cost a few writes, not 200. A write
//! that finds the ledger changed by someone else (a replica that still thought it was active,
//! or a person) takes the other writer's ledger as it is and fails the admissions it carried:
//! their agents ask again and are decided against the ledger as it now stands, so no conflict
//! lets more than the limit in.
//!
//! The number of nodes is the number of members (`members::Members`: the agent pods), counted
//! at most once a minute.

use std::sync::Arc;
use std::time::Duration;

use faultline_core::policy::TaintBudget;
use faultline_core::time::{signed, since, Timestamp};
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Mutex};
use tracing::{info, warn};

use super::members::Members;
use faultline_agent::clock::Clock;

/// Name of the ledger ConfigMap.
pub const LEDGER_NAME: &str = "faultline-taint-budget";
/// Its data key.
pub const LEDGER_KEY: &str = "ledger.json";
/// How long a node count is used before the members are counted again. The limit is a share of
/// the fleet; a fleet grows or shrinks by few nodes in a minute.
const COUNT_MAX_AGE: Duration = Duration::from_secs(60);
/// How long one list of the members may take (the API client retries a 429 or 503 by itself
/// for minutes): past it the last count serves, within the admission's own deadline.
const COUNT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long an older count still serves while the members cannot be listed.
const COUNT_STALE_MAX_AGE: Duration = Duration::from_secs(600);

/// One node's entry in the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerEntry {
    pub node: String,
    #[serde(with = "faultline_core::record::rfc3339")]
    pub at: Timestamp,
}

/// The ledger (`faultline-taint-budget`, key `ledger.json`): which nodes were admitted, and when.
/// Entries older than the budget's window no longer count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    pub entries: Vec<LedgerEntry>,
}

/// The ledger's answer to one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The node is already in the window.
    AlreadyIn { used: u32 },
    /// Admitted: the ledger must be written before the answer goes out.
    Admitted { used: u32 },
    /// The budget is spent.
    Denied { used: u32 },
}

impl Ledger {
    /// Drops entries that left the window, then admits `node` if the budget allows.
    pub fn decide(
        &mut self,
        node: &str,
        now: Timestamp,
        window: Duration,
        limit: u32,
    ) -> Admission {
        // An entry dated ahead of `now` (the wall clock stepped back, or a writer's clock was
        // ahead) counts as made now: it holds its slot for one window from here, never longer,
        // and a step back does not free the budget.
        for e in &mut self.entries {
            if e.at > now {
                e.at = now;
            }
        }
        let window = signed(window);
        self.entries.retain(|e| since(now, e.at) < window);
        let used = u32::try_from(self.entries.len()).unwrap_or(u32::MAX);
        if self.entries.iter().any(|e| e.node == node) {
            return Admission::AlreadyIn { used };
        }
        if used >= limit {
            return Admission::Denied { used };
        }
        self.entries.push(LedgerEntry {
            node: node.to_string(),
            at: now,
        });
        Admission::Admitted { used: used + 1 }
    }
}

/// The budget's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub allowed: bool,
    pub used: u32,
    pub limit: u32,
    pub nodes: u32,
}

/// Why the budget cannot answer now (the agent withholds the taint and asks again).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    #[error("cannot read the taint ledger: {0}")]
    Read(String),
    #[error("cannot write the taint ledger: {0}")]
    Write(String),
    #[error("cannot count the nodes: {0}")]
    Count(String),
}

/// Why the ledger's store did not take a write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// Someone else wrote it since it was read (HTTP 409).
    #[error("the ledger changed since it was read")]
    Conflict,
    #[error("{0}")]
    Failed(String),
}

/// Where the ledger is kept.
#[async_trait::async_trait]
pub trait LedgerStore: Send + Sync + std::fmt::Debug {
    /// The ledger and the version it was read at (`None`: there is none yet).
    async fn read(&self) -> Result<(Ledger, Option<String>), StoreError>;
    /// Writes the ledger if it is still at `version` (`None`: creates it); the new version.
    async fn write(&self, ledger: &Ledger, version: Option<&str>) -> Result<String, StoreError>;
}

/// What the active replica holds in memory.
#[derive(Debug, Default)]
struct State {
    /// The ledger as read when this replica became active, with every admission since.
    ledger: Ledger,
    /// Whether `ledger` was read in this term (it is read again after every loss of the Lease).
    loaded: bool,
    /// The version the ledger was last read or written at.
    version: Option<String>,
    /// Bumped by every admission: the ledger in memory includes admissions up to it.
    decided: u64,
    /// The admissions up to this one are written.
    written: u64,
    /// Bumped whenever the ledger in memory is replaced (the Lease lost, or another writer's
    /// ledger taken): an admission decided in an earlier epoch is never answered "allowed".
    epoch: u64,
    /// The last node count and when it was taken (time since boot).
    count: Option<(u32, Duration)>,
}

/// The taint budget of the active replica.
#[derive(Debug)]
pub struct TaintLedger {
    store: Arc<dyn LedgerStore>,
    members: Arc<dyn Members>,
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
    /// Held by the one admission that writes the ledger at a time.
    writing: Mutex<()>,
}

impl TaintLedger {
    pub fn new(
        store: Arc<dyn LedgerStore>,
        members: Arc<dyn Members>,
        clock: Arc<dyn Clock>,
    ) -> TaintLedger {
        TaintLedger {
            store,
            members,
            clock,
            state: Mutex::new(State::default()),
            writing: Mutex::new(()),
        }
    }

    /// Forgets the ledger whenever this replica stops being the active one, so that it reads
    /// the ledger again (with the other replica's admissions) when it becomes active again.
    pub async fn follow(self: Arc<Self>, mut leader: watch::Receiver<bool>) {
        while leader.changed().await.is_ok() {
            if !*leader.borrow_and_update() {
                let mut s = self.state.lock().await;
                *s = State {
                    count: s.count,
                    epoch: s.epoch + 1,
                    ..State::default()
                };
            }
        }
    }

    /// Whether `node` may be newly tainted now; an admission is written before it is answered.
    pub async fn admit(&self, node: &str, budget: &TaintBudget) -> Result<Answer, BudgetError> {
        let (answer, epoch, admitted) = {
            let mut s = self.state.lock().await;
            if !s.loaded {
                let (ledger, version) = self
                    .store
                    .read()
                    .await
                    .map_err(|e| BudgetError::Read(e.to_string()))?;
                info!(entries = ledger.entries.len(), "taint ledger read");
                s.ledger = ledger;
                s.version = version;
                s.loaded = true;
            }
            let nodes = self.count(&mut s).await?;
            let limit = budget.limit(nodes);
            // The budget off: every node may be tainted, and nothing is worth a write.
            if budget.max_percent >= 100 {
                return Ok(Answer {
                    allowed: true,
                    used: 0,
                    limit,
                    nodes,
                });
            }
            let now = self.clock.now();
            let decided = s.decided;
            let epoch = s.epoch;
            match s.ledger.decide(node, now, budget.window, limit) {
                Admission::Denied { used } => {
                    return Ok(Answer {
                        allowed: false,
                        used,
                        limit,
                        nodes,
                    })
                }
                // Already in: allowed once the write that holds it is done (it may be in
                // flight, for an agent that asked twice).
                Admission::AlreadyIn { used } => (
                    Answer {
                        allowed: true,
                        used,
                        limit,
                        nodes,
                    },
                    epoch,
                    decided,
                ),
                Admission::Admitted { used } => {
                    s.decided += 1;
                    info!(node, used, limit, nodes, "taint budget: admitted");
                    (
                        Answer {
                            allowed: true,
                            used,
                            limit,
                            nodes,
                        },
                        epoch,
                        s.decided,
                    )
                }
            }
        };
        self.written(epoch, admitted).await?;
        Ok(answer)
    }

    /// The node count: the last one while under a minute old, else the members counted now (an
    /// older count serves for up to ten minutes while they cannot be listed).
    async fn count(&self, s: &mut State) -> Result<u32, BudgetError> {
        let now = self.clock.since_boot();
        let age = |at: Duration| now.saturating_sub(at);
        if let Some((n, at)) = s.count {
            if age(at) < COUNT_MAX_AGE {
                return Ok(n);
            }
        }
        let listed = tokio::time::timeout(COUNT_TIMEOUT, self.members.list())
            .await
            .map_err(|_| format!("no list of the members within {COUNT_TIMEOUT:?}"))
            .and_then(|r| r.map_err(|e| e.to_string()));
        match listed {
            Ok(m) => {
                let n = u32::try_from(m.len()).unwrap_or(u32::MAX);
                s.count = Some((n, now));
                Ok(n)
            }
            Err(e) => match s.count {
                Some((n, at)) if age(at) < COUNT_STALE_MAX_AGE => {
                    warn!(error = %e, nodes = n, "cannot count the nodes; using the last count");
                    Ok(n)
                }
                _ => Err(BudgetError::Count(e)),
            },
        }
    }

    /// Returns once the admissions up to `decided` of `epoch` are in the written ledger, writing
    /// it if no one else has. One write at a time; the next covers every admission decided
    /// meanwhile.
    async fn written(&self, epoch: u64, decided: u64) -> Result<(), BudgetError> {
        let replaced = || {
            BudgetError::Write(
                "the ledger was replaced before this admission was written; ask again".into(),
            )
        };
        let _writing = self.writing.lock().await;
        loop {
            let (ledger, version, upto) = {
                let s = self.state.lock().await;
                if s.epoch != epoch {
                    return Err(replaced());
                }
                if s.written >= decided {
                    return Ok(());
                }
                (s.ledger.clone(), s.version.clone(), s.decided)
            };
            match self.store.write(&ledger, version.as_deref()).await {
                Ok(v) => {
                    let mut s = self.state.lock().await;
                    if s.epoch != epoch {
                        return Err(replaced());
                    }
                    s.version = Some(v);
                    s.written = s.written.max(upto);
                }
                Err(StoreError::Conflict) => {
                    // Another writer (a replica that still thought it held the Lease, or a
                    // person), or the ledger deleted: its ledger is the truth now. The
                    // admissions decided here and not written are dropped, and their agents ask
                    // again against it.
                    let (theirs, v) = self
                        .store
                        .read()
                        .await
                        .map_err(|e| BudgetError::Read(e.to_string()))?;
                    let mut s = self.state.lock().await;
                    warn!(
                        entries = theirs.entries.len(),
                        dropped = upto.saturating_sub(s.written),
                        "the taint ledger was written by someone else; taking theirs, and the admissions not yet written are asked again"
                    );
                    if s.epoch == epoch {
                        s.ledger = theirs;
                        s.version = v;
                        s.epoch += 1;
                        s.written = s.decided;
                    }
                    return Err(replaced());
                }
                Err(StoreError::Failed(e)) => return Err(BudgetError::Write(e)),
            }
        }
    }
}

/// What the service answers `Admit` with: the ledger, and the budget from the policy.
#[derive(Debug, Clone)]
pub struct Admissions {
    pub ledger: Arc<TaintLedger>,
    /// The policy; its `taint_budget` is the budget.
    pub policy: watch::Receiver<faultline_core::policy::LoadedPolicy>,
}

/// The ledger in a ConfigMap of the coordinator's namespace.
#[derive(Clone)]
pub struct KubeLedger {
    pub api: kube::Api<k8s_openapi::api::core::v1::ConfigMap>,
}

impl std::fmt::Debug for KubeLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeLedger").finish_non_exhaustive()
    }
}

/// The ledger in a ConfigMap; an unreadable one counts as empty (and is rewritten), with a
/// warning: losing it can only let up to `limit` more nodes through in one window.
fn parse_ledger(cm: &k8s_openapi::api::core::v1::ConfigMap) -> Ledger {
    let Some(text) = cm.data.as_ref().and_then(|d| d.get(LEDGER_KEY)) else {
        return Ledger::default();
    };
    serde_json::from_str(text).unwrap_or_else(|e| {
        warn!(error = %e, "the taint ledger is unreadable; starting it afresh");
        Ledger::default()
    })
}

#[async_trait::async_trait]
impl LedgerStore for KubeLedger {
    async fn read(&self) -> Result<(Ledger, Option<String>), StoreError> {
        let cm = self
            .api
            .get_opt(LEDGER_NAME)
            .await
            .map_err(|e| StoreError::Failed(e.to_string()))?;
        Ok(match cm {
            Some(cm) => (parse_ledger(&cm), cm.metadata.resource_version.clone()),
            None => (Ledger::default(), None),
        })
    }

    async fn write(&self, ledger: &Ledger, version: Option<&str>) -> Result<String, StoreError> {
        use k8s_openapi::api::core::v1::ConfigMap;
        use kube::api::{ObjectMeta, PostParams};
        use std::collections::BTreeMap;
        let text = serde_json::to_string(ledger).map_err(|e| StoreError::Failed(e.to_string()))?;
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(LEDGER_NAME.to_string()),
                resource_version: version.map(str::to_string),
                labels: Some(BTreeMap::from([
                    ("app.kubernetes.io/part-of".into(), "faultline".into()),
                    ("app.kubernetes.io/component".into(), "taint-budget".into()),
                ])),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(LEDGER_KEY.to_string(), text)])),
            ..Default::default()
        };
        let pp = PostParams {
            field_manager: Some(faultline_agent::kube_client::FIELD_MANAGER.to_string()),
            ..Default::default()
        };
        let written = match version {
            Some(_) => self.api.replace(LEDGER_NAME, &pp, &cm).await,
            None => self.api.create(&pp, &cm).await,
        };
        match written {
            Ok(cm) => Ok(cm.metadata.resource_version.unwrap_or_default()),
            // 409: replaced since read, or created by someone else meanwhile; 404: deleted
            // since read (a person resetting the budget). Either way: read it again.
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Err(StoreError::Conflict),
            Err(e) => Err(StoreError::Failed(e.to_string())),
        }
    }
}

#[cfg(test)]
#[path = "budget_tests.rs"]
mod tests;
