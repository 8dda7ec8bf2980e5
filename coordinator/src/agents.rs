//! Which node an agent's report or taint admission comes from: the coordinator takes either only
//! from the node it is about, proven by a credential bound to that node and held by no other.
//!
//! - Kubernetes ([`Tokens`]): the report carries the agent's projected service-account token
//!   (`authorization: Bearer`) and is signed with it; the API server names the token's node
//!   (`tokens`).
//! - Without Kubernetes ([`NodeKeys`]): the report is signed with the node's own key, which the
//!   coordinator derives from its master for the node the report names (`auth::node_key`).

use std::sync::Arc;

use parking_lot::Mutex;

use faultline_proto::auth::{AuthError, Key, Verifier, VerifyKey, COORDINATOR_ROLE};
use faultline_proto::v1::{AdmitRequest, CheckReport};
use tonic::Status;

use super::tokens::AgentTokens;
use crate::requesters::TokenRefusal;
use faultline_agent::peer::wire;

/// Why a report's sender was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No valid credential for the node it names (`UNAUTHENTICATED`).
    #[error("{0}")]
    Unauthenticated(String),
    /// The credential could not be checked now (`UNAVAILABLE`: the agent tries again).
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

/// What an agent sends the coordinator. A report goes to the replica that assigned its check
/// and must name it; an admission goes to the Service, so it may name the coordinator role
/// instead (only the active replica answers it, and an admission replayed to the other replica
/// within the freshness window only repeats the node's own recent request).
#[derive(Debug, Clone, Copy)]
pub enum FromAgent<'a> {
    Report(&'a CheckReport),
    Admit(&'a AdmitRequest),
}

impl FromAgent<'_> {
    fn verify(self, v: &mut Verifier, key: Option<&VerifyKey>) -> Result<String, AuthError> {
        let now = wire::now_ms();
        match (self, key) {
            (FromAgent::Report(m), None) => v.verify(m, now),
            (FromAgent::Admit(m), None) => v.verify_or_role(m, now, COORDINATOR_ROLE),
            (FromAgent::Report(m), Some(k)) => v.verify_with(k, m, now),
            (FromAgent::Admit(m), Some(k)) => v.verify_with_or_role(k, m, now, COORDINATOR_ROLE),
        }
    }
}

/// Verifies an agent's message: the node whose credential it carries.
#[async_trait::async_trait]
pub trait Agents: Send + Sync + std::fmt::Debug {
    /// The node the message comes from (its signature verified, addressed to this coordinator,
    /// fresh and not seen before), or why it is refused.
    async fn verify(&self, msg: FromAgent<'_>, token: Option<&str>) -> Result<String, Refusal>;
}

/// Without Kubernetes: each node's own key, derived from the master.
#[derive(Debug)]
pub struct NodeKeys(Mutex<Verifier>);

impl NodeKeys {
    /// Reports to `me` signed with the key `master` derives for their sender.
    pub fn new(master: Key, me: &str) -> NodeKeys {
        NodeKeys(Mutex::new(Verifier::new(
            VerifyKey::Nodes(master),
            faultline_agent::peer::MAX_SKEW,
            me,
        )))
    }
}

#[async_trait::async_trait]
impl Agents for NodeKeys {
    async fn verify(&self, msg: FromAgent<'_>, _token: Option<&str>) -> Result<String, Refusal> {
        msg.verify(&mut self.0.lock(), None)
            .map_err(|e| Refusal::Unauthenticated(e.to_string()))
    }
}

/// Kubernetes: the agent's service-account token, reviewed by the API server; the report is
/// signed with the token, so its fields are the token holder's.
#[derive(Debug)]
pub struct Tokens {
    tokens: Arc<dyn AgentTokens>,
    verifier: Mutex<Verifier>,
}

impl Tokens {
    pub fn new(tokens: Arc<dyn AgentTokens>, me: &str) -> Tokens {
        Tokens {
            tokens,
            verifier: Mutex::new(Verifier::new(
                VerifyKey::PerRequest,
                faultline_agent::peer::MAX_SKEW,
                me,
            )),
        }
    }
}

#[async_trait::async_trait]
impl Agents for Tokens {
    async fn verify(&self, msg: FromAgent<'_>, token: Option<&str>) -> Result<String, Refusal> {
        let Some(token) = token else {
            return Err(Refusal::Unauthenticated(
                "an agent's message must carry the agent's service-account token (authorization: Bearer)"
                    .into(),
            ));
        };
        let key = Key::new(token.as_bytes())
            .map_err(|e| Refusal::Unauthenticated(format!("the token: {e}")))?;
        // The signature, receiver, time and nonce first: a replayed, stale or altered report
        // costs the API server no review.
        let sender = msg
            .verify(&mut self.verifier.lock(), Some(&VerifyKey::Hmac(key)))
            .map_err(|e| Refusal::Unauthenticated(e.to_string()))?;
        let node = self.tokens.node_of(token).await.map_err(|e| match e {
            TokenRefusal::Unavailable(m) => Refusal::Unavailable(m),
            e => Refusal::Unauthenticated(e.to_string()),
        })?;
        if sender != node {
            return Err(Refusal::Unauthenticated(format!(
                "the message names {sender:?} as its sender, but its token is {node:?}'s agent's"
            )));
        }
        Ok(node)
    }
}
