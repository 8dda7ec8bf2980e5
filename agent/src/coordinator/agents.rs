//! Which node an agent's report comes from: the coordinator accepts a report only from the node
//! it describes, proven by a credential bound to that node.

use std::sync::Mutex;

use faultline_proto::auth::Verifier;
use faultline_proto::v1::CheckReport;
use tonic::Status;

use crate::peer::wire;

/// Why a report's sender was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No valid credential (`UNAUTHENTICATED`).
    #[error("{0}")]
    Unauthenticated(String),
    /// The credential could not be checked now (`UNAVAILABLE`: the agent retries).
    #[error("{0}")]
    Unavailable(String),
}

impl Refusal {
    pub fn status(&self) -> Status {
        match self {
            Refusal::Unauthenticated(m) => Status::unauthenticated(m.clone()),
            Refusal::Unavailable(m) => Status::unavailable(m.clone()),
        }
    }
}

/// Verifies a report's sender: the node whose credential it carries.
#[async_trait::async_trait]
pub trait Agents: Send + Sync + std::fmt::Debug {
    async fn verify(&self, report: &CheckReport, token: Option<&str>) -> Result<String, Refusal>;
}

/// The agents' shared secret: any holder may sign as any node.
#[derive(Debug)]
pub struct SharedKey(pub Mutex<Verifier>);

#[async_trait::async_trait]
impl Agents for SharedKey {
    async fn verify(&self, report: &CheckReport, _token: Option<&str>) -> Result<String, Refusal> {
        let mut v = self
            .0
            .lock()
            .map_err(|_| Refusal::Unavailable("verifier poisoned".into()))?;
        v.verify(report, wire::now_ms())
            .map_err(|e| Refusal::Unauthenticated(e.to_string()))
    }
}
