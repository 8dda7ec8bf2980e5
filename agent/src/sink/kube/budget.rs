//! The node sink's side of the cluster's taint budget: before it newly taints its own Node the
//! agent asks the active coordinator (`Admit`), which alone keeps the budget
//! (`faultline_coordinator::budget`). It asks at the coordinator's Service, which sends
//! requests to the replica holding the Lease only (only that one is Ready), so finding the
//! coordinator costs no API request; the request is signed for the coordinator role with the
//! agent's projected service-account token and carries it, so it counts only for this node.
//! No answer (no coordinator, none reachable, an error) is an error: the taint waits and the
//! sink asks again with its backoff.

use std::path::PathBuf;
use std::time::Duration;

use faultline_proto::auth::COORDINATOR_ROLE;
use faultline_proto::v1::coordinator_client::CoordinatorClient;
use faultline_proto::v1::AdmitRequest;
use faultline_proto::{MAX_MESSAGE_BYTES, PROTOCOL};
use tracing::info;

use super::KubeSinkError;
use crate::peer::client::{bearer, endpoint, timed};
use crate::peer::wire::NodeCredential;

/// How long one admission may take: the coordinator answers within 8 s (its
/// `ADMIT_TIMEOUT`, then UNAVAILABLE).
const ADMIT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The budget's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    Allowed,
    Denied { used: u32, limit: u32, nodes: u32 },
}

/// Asks the coordinator for this node.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    node: String,
    /// The coordinator's Service (`host:port`).
    coordinator: String,
    /// The projected token file (`--node-token-file`); `None`: this agent cannot be admitted.
    token: Option<PathBuf>,
}

impl Budget {
    pub(crate) fn new(node: &str, coordinator: &str, token: Option<PathBuf>) -> Budget {
        Budget {
            node: node.to_string(),
            coordinator: coordinator.to_string(),
            token,
        }
    }

    /// Asks whether this node may be newly tainted now: within [`ADMIT_CALL_TIMEOUT`] in all
    /// (connecting included).
    pub(crate) async fn admit(&self) -> Result<Answer, KubeSinkError> {
        tokio::time::timeout(ADMIT_CALL_TIMEOUT, self.ask())
            .await
            .map_err(|_| {
                KubeSinkError::Budget(format!("no answer within {ADMIT_CALL_TIMEOUT:?}"))
            })?
    }

    async fn ask(&self) -> Result<Answer, KubeSinkError> {
        let refused = |why: String| KubeSinkError::Budget(why);
        let Some(token) = &self.token else {
            return Err(refused(
                "no --node-token-file: the coordinator cannot know this node, so its taint waits"
                    .into(),
            ));
        };
        let address = &self.coordinator;
        let signed = NodeCredential::Token(token.clone())
            .sign(
                AdmitRequest {
                    protocol: PROTOCOL,
                    node: self.node.clone(),
                    ..Default::default()
                },
                &self.node,
                COORDINATOR_ROLE,
            )
            .map_err(|e| refused(e.to_string()))?;
        let mut request = timed(signed.msg, ADMIT_CALL_TIMEOUT);
        if let Some(t) = &signed.token {
            bearer(&mut request, t).map_err(|e| refused(e.to_string()))?;
        }
        let channel = endpoint(address)
            .map_err(|e| refused(e.to_string()))?
            .connect_lazy();
        let mut client =
            CoordinatorClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let reply = tokio::time::timeout(ADMIT_CALL_TIMEOUT, client.admit(request))
            .await
            .map_err(|_| {
                refused(format!(
                    "the coordinator at {address} did not answer within {ADMIT_CALL_TIMEOUT:?}"
                ))
            })?
            .map_err(|s| {
                refused(format!(
                    "the coordinator at {address}: {}: {}",
                    s.code(),
                    s.message()
                ))
            })?
            .into_inner();
        if reply.allowed {
            info!(
                used = reply.used,
                limit = reply.limit,
                nodes = reply.nodes,
                "taint budget: admitted"
            );
            Ok(Answer::Allowed)
        } else {
            Ok(Answer::Denied {
                used: reply.used,
                limit: reply.limit,
                nodes: reply.nodes,
            })
        }
    }
}
