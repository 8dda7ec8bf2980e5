//! Which node an agent speaks for, on Kubernetes: what the coordinator checks before it takes
//! an agent's report as that node's.
//!
//! An agent presents its pod's projected service-account token, issued for the audience
//! [`AGENT_AUDIENCE`] (useless against the API server, so the coordinator cannot use it as the
//! agent). [`KubeAgentTokens`] asks the API server (TokenReview) whose it is and accepts it only
//! when it is the agents' own service account (the DaemonSet's: a workload pod's token on the
//! same node cannot speak for the node) and the API server names the token's node: since
//! Kubernetes 1.30 a token bound to a pod carries the pod's node, and TokenReview returns it in
//! `user.extra["authentication.kubernetes.io/node-name"]` ([`NODE_NAME_EXTRA`]). The node is
//! the API server's word, never the agent's.
//!
//! Accepted tokens are remembered for [`CACHE_TTL`] by their SHA-256 (the token itself is never
//! kept), at most [`CACHE_ENTRIES`] of them, so a burst of reports costs one review per agent
//! per minute; refusals are never remembered.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::requesters::TokenRefusal;
use faultline_agent::clock::{Clock, SystemClock};

/// The audience an agent's projected service-account token must be issued for.
pub const AGENT_AUDIENCE: &str = "faultline-peer";
/// The `user.extra` key in which TokenReview names the node of the pod a token is bound to.
/// Kubernetes: `NodeNameKey` in
/// `staging/src/k8s.io/apiserver/pkg/authentication/serviceaccount/util.go`, set by
/// `ServiceAccountInfo.UserInfo` from the token's `kubernetes.io.node` claim; KEP-4193 (bound
/// service account token improvements), feature gate `ServiceAccountTokenPodNodeInfo`, beta and
/// on by default since 1.30.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// How long an accepted token is answered from memory: a token revoked (its pod deleted) keeps
/// speaking for its node at most this long.
pub const CACHE_TTL: Duration = Duration::from_secs(60);
/// At most this many accepted tokens are remembered (one per agent, with room for rotations);
/// past it the oldest is forgotten.
pub const CACHE_ENTRIES: usize = 4096;

/// Tells which node an agent's token speaks for.
#[async_trait::async_trait]
pub trait AgentTokens: Send + Sync + std::fmt::Debug {
    /// The node whose agent presented `token`, or why it speaks for none.
    async fn node_of(&self, token: &str) -> Result<String, TokenRefusal>;
}

/// Kubernetes: TokenReview for [`AGENT_AUDIENCE`]; accepted when `status.authenticated`, the
/// audience is echoed in `status.audiences`, the user is exactly
/// `system:serviceaccount:<namespace>:<service_account>` (the agent DaemonSet's), and the API
/// server names one node in [`NODE_NAME_EXTRA`]. The caller's ClusterRole needs `create` on
/// `tokenreviews`.
pub struct KubeAgentTokens {
    pub client: kube::Client,
    pub namespace: String,
    pub service_account: String,
    clock: Arc<dyn Clock>,
    cache: Mutex<TokenCache>,
}

impl std::fmt::Debug for KubeAgentTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeAgentTokens")
            .field("namespace", &self.namespace)
            .field("service_account", &self.service_account)
            .finish_non_exhaustive()
    }
}

impl KubeAgentTokens {
    /// Tokens of the service account `service_account` in `namespace`, reviewed through
    /// `client`; the cache runs on the system clock.
    pub fn new(
        client: kube::Client,
        namespace: impl Into<String>,
        service_account: impl Into<String>,
    ) -> KubeAgentTokens {
        KubeAgentTokens {
            client,
            namespace: namespace.into(),
            service_account: service_account.into(),
            clock: Arc::new(SystemClock),
            cache: Mutex::new(TokenCache::new(CACHE_ENTRIES, CACHE_TTL)),
        }
    }

    /// The same, with the cache's ages read from `clock` (tests).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> KubeAgentTokens {
        self.clock = clock;
        self
    }

    fn username(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}",
            self.namespace, self.service_account
        )
    }

    async fn review(&self, token: &str) -> Result<String, TokenRefusal> {
        let user = super::requesters::token_review(&self.client, token, AGENT_AUDIENCE).await?;
        let username = user.username.clone().unwrap_or_default();
        let agents = self.username();
        if username != agents {
            return Err(TokenRefusal::Denied(format!(
                "{username:?} is not the agents' service account {agents:?}: only an agent's own token speaks for its node"
            )));
        }
        let nodes = user
            .extra
            .as_ref()
            .and_then(|e| e.get(NODE_NAME_EXTRA))
            .map(Vec::as_slice)
            .unwrap_or_default();
        match nodes {
            [node] if !node.is_empty() => Ok(node.clone()),
            [] => Err(TokenRefusal::Denied(format!(
                "the token of {username} names no node (TokenReview has no {NODE_NAME_EXTRA:?}): \
                 Kubernetes older than 1.30 (or its ServiceAccountTokenPodNodeInfo feature off), \
                 or a token not bound to a pod"
            ))),
            more => Err(TokenRefusal::Denied(format!(
                "the token of {username} does not name one node ({NODE_NAME_EXTRA:?} is {more:?})"
            ))),
        }
    }
}

#[async_trait::async_trait]
impl AgentTokens for KubeAgentTokens {
    async fn node_of(&self, token: &str) -> Result<String, TokenRefusal> {
        let id: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let cached = self.cache.lock().get(&id, self.clock.since_boot());
        if let Some(node) = cached {
            return Ok(node);
        }
        // Not held across the review: agents' reviews run side by side. Two reports with the
        // same new token at once may both be reviewed; the cache then holds the later answer.
        let node = self.review(token).await?;
        self.cache
            .lock()
            .insert(id, node.clone(), self.clock.since_boot());
        Ok(node)
    }
}

/// Accepted tokens by SHA-256: node and when accepted (time since boot). Entries enter in time
/// order, so the expired and the oldest are at the front of `order`.
#[derive(Debug)]
struct TokenCache {
    capacity: usize,
    ttl: Duration,
    nodes: HashMap<[u8; 32], (String, Duration)>,
    /// (token hash, accepted at); an entry whose time differs from `nodes`' was replaced.
    order: VecDeque<([u8; 32], Duration)>,
}

impl TokenCache {
    fn new(capacity: usize, ttl: Duration) -> TokenCache {
        TokenCache {
            capacity,
            ttl,
            nodes: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn get(&mut self, id: &[u8; 32], now: Duration) -> Option<String> {
        while let Some((_, at)) = self.order.front() {
            if now.saturating_sub(*at) < self.ttl {
                break;
            }
            self.pop_front();
        }
        self.nodes.get(id).map(|(node, _)| node.clone())
    }

    fn insert(&mut self, id: [u8; 32], node: String, now: Duration) {
        self.nodes.insert(id, (node, now));
        self.order.push_back((id, now));
        while self.order.len() > self.capacity {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        if let Some((id, at)) = self.order.pop_front() {
            if self.nodes.get(&id).is_some_and(|(_, t)| *t == at) {
                self.nodes.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use faultline_agent::clock::testing::FakeClock;
    use faultline_kube_emulator::{Emulator, Rule, UserInfo};

    const NS: &str = "faultline-system";
    const SA: &str = "faultline";

    /// A token's user, bound to a pod on `node` (the API server's extra), or to none.
    fn on_node(mut user: UserInfo, node: Option<&str>) -> UserInfo {
        if let Some(n) = node {
            user.extra
                .insert(NODE_NAME_EXTRA.to_string(), vec![n.to_string()]);
            user.extra.insert(
                "authentication.kubernetes.io/pod-name".to_string(),
                vec![format!("faultline-agent-{n}")],
            );
        }
        user
    }

    fn reviews(emu: &Emulator) -> usize {
        emu.calls()
            .iter()
            .filter(|c| c.path == "/apis/authentication.k8s.io/v1/tokenreviews")
            .count()
    }

    /// Issue 28: an agent's identity was a name it wrote itself. Now its node is the one the
    /// API server binds its token to, and only the agents' service account speaks for a node:
    /// another service account's token on that node, a token for another audience, the API
    /// server's own token of the agent, and a token bound to no pod are refused, each clearly.
    #[tokio::test]
    async fn an_agents_pod_bound_token_names_its_node_and_no_other_token_does() {
        let emu = Emulator::start().await.unwrap();
        emu.authorize(
            "t",
            UserInfo::service_account(NS, "faultline-coordinator"),
            vec![Rule::new(
                &["create"],
                &["authentication.k8s.io"],
                &["tokenreviews"],
            )],
        );
        let agent = |node| on_node(UserInfo::service_account(NS, SA), node);
        let grant = |token: &str, user: UserInfo, audience: &str| {
            emu.authorize_for_audiences(token, user, vec![], &[audience]);
        };
        grant("agent-n1", agent(Some("n1")), AGENT_AUDIENCE);
        grant("agent-n2", agent(Some("n2")), AGENT_AUDIENCE);
        grant(
            "workload-n1",
            on_node(UserInfo::service_account("jobs", "trainer"), Some("n1")),
            AGENT_AUDIENCE,
        );
        grant(
            "same-name-elsewhere",
            on_node(UserInfo::service_account("jobs", SA), Some("n1")),
            AGENT_AUDIENCE,
        );
        grant("vault-n1", agent(Some("n1")), "vault");
        grant("unbound", agent(None), AGENT_AUDIENCE);
        let mut two = agent(Some("n1"));
        two.extra
            .insert(NODE_NAME_EXTRA.into(), vec!["n1".into(), "n2".into()]);
        grant("two-nodes", two, AGENT_AUDIENCE);
        // The agent's token for the API server itself (no audience of ours).
        emu.authorize("api-n1", agent(Some("n1")), vec![]);

        let (client, _dir) =
            faultline_agent::sink::kube::emulator_client(&emu, "coordinator").await;
        let tokens = KubeAgentTokens::new(client, NS, SA);
        assert_eq!(tokens.node_of("agent-n1").await, Ok("n1".to_string()));
        assert_eq!(tokens.node_of("agent-n2").await, Ok("n2".to_string()));

        for token in ["workload-n1", "same-name-elsewhere"] {
            match tokens.node_of(token).await {
                Err(TokenRefusal::Denied(why)) => assert!(
                    why.contains(
                        "is not the agents' service account \"system:serviceaccount:faultline-system:faultline\""
                    ),
                    "{token}: {why}"
                ),
                other => panic!("{token}: {other:?}"),
            }
        }
        for token in ["vault-n1", "api-n1", "unknown"] {
            match tokens.node_of(token).await {
                Err(TokenRefusal::Unauthenticated(why)) => {
                    assert!(why.contains("invalid bearer token"), "{token}: {why}")
                }
                other => panic!("{token}: {other:?}"),
            }
        }
        match tokens.node_of("unbound").await {
            Err(TokenRefusal::Denied(why)) => {
                assert!(why.contains("names no node"), "{why}");
                assert!(why.contains("older than 1.30"), "{why}");
                assert!(why.contains("not bound to a pod"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        match tokens.node_of("two-nodes").await {
            Err(TokenRefusal::Denied(why)) => assert!(why.contains("does not name one node")),
            other => panic!("{other:?}"),
        }
        // The coordinator without create on tokenreviews cannot tell: unavailable, never
        // accepted (a token it has not accepted before).
        emu.authorize(
            "t",
            UserInfo::service_account(NS, "faultline-coordinator"),
            vec![],
        );
        match tokens.node_of("agent-n3").await {
            Err(TokenRefusal::Unavailable(why)) => assert!(why.contains("TokenReview"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// A burst of reports costs one review per agent per minute: an accepted token is answered
    /// from memory for 60 s (on the injected clock), then reviewed again; refusals are reviewed
    /// every time, so a token that becomes valid is not refused from memory.
    #[tokio::test]
    async fn accepted_tokens_are_remembered_for_a_minute_and_refusals_never() {
        let emu = Emulator::start().await.unwrap();
        emu.authorize(
            "t",
            UserInfo::service_account(NS, "faultline-coordinator"),
            vec![Rule::new(
                &["create"],
                &["authentication.k8s.io"],
                &["tokenreviews"],
            )],
        );
        emu.authorize_for_audiences(
            "agent-n1",
            on_node(UserInfo::service_account(NS, SA), Some("n1")),
            vec![],
            &[AGENT_AUDIENCE],
        );
        let (client, _dir) =
            faultline_agent::sink::kube::emulator_client(&emu, "coordinator").await;
        let clock = Arc::new(FakeClock::new(1_790_000_000_000, 1_000_000));
        let tokens = KubeAgentTokens::new(client, NS, SA).with_clock(clock.clone());
        emu.clear_calls();
        for _ in 0..5 {
            assert_eq!(tokens.node_of("agent-n1").await, Ok("n1".to_string()));
        }
        assert_eq!(reviews(&emu), 1);
        clock.advance(CACHE_TTL - Duration::from_millis(1));
        assert_eq!(tokens.node_of("agent-n1").await, Ok("n1".to_string()));
        assert_eq!(reviews(&emu), 1);
        clock.advance(Duration::from_millis(1));
        assert_eq!(tokens.node_of("agent-n1").await, Ok("n1".to_string()));
        assert_eq!(reviews(&emu), 2);

        // Refused twice, reviewed twice; then granted, accepted at once.
        for _ in 0..2 {
            assert!(tokens.node_of("agent-n2").await.is_err());
        }
        assert_eq!(reviews(&emu), 4);
        emu.authorize_for_audiences(
            "agent-n2",
            on_node(UserInfo::service_account(NS, SA), Some("n2")),
            vec![],
            &[AGENT_AUDIENCE],
        );
        assert_eq!(tokens.node_of("agent-n2").await, Ok("n2".to_string()));
        assert_eq!(reviews(&emu), 5);
    }

    fn id(n: u8) -> [u8; 32] {
        [n; 32]
    }

    /// The memory is bounded: past its capacity the oldest accepted token is forgotten (and
    /// reviewed again when it comes back); a token accepted again replaces its old entry.
    #[test]
    fn the_token_memory_is_bounded_and_forgets_the_oldest_first() {
        let ttl = Duration::from_secs(60);
        let s = Duration::from_secs;
        let mut c = TokenCache::new(3, ttl);
        for n in 1..=3 {
            c.insert(id(n), format!("n{n}"), s(u64::from(n)));
        }
        assert_eq!(c.get(&id(1), s(4)), Some("n1".into()));
        c.insert(id(4), "n4".into(), s(4));
        assert_eq!(c.get(&id(1), s(4)), None, "the oldest is forgotten");
        assert_eq!(c.get(&id(2), s(4)), Some("n2".into()));
        assert_eq!(c.nodes.len(), 3);
        assert_eq!(c.order.len(), 3);
        // Accepted again (after two reviews raced): one entry, its time the later one; its old
        // place in the order, popped at once, does not remove it.
        c.insert(id(2), "n2".into(), s(5));
        assert_eq!(c.nodes.len(), 3);
        assert_eq!(c.get(&id(2), s(5)), Some("n2".into()));
        c.insert(id(5), "n5".into(), s(6));
        assert_eq!(c.get(&id(2), s(6)), Some("n2".into()));
        assert_eq!(c.get(&id(3), s(6)), None);
        assert!(c.order.len() <= 3 && c.nodes.len() <= 3);
        // Expiry: at 60 s after acceptance, gone.
        assert_eq!(c.get(&id(2), s(64)), Some("n2".into()));
        assert_eq!(c.get(&id(2), s(65)), None);
        assert_eq!(c.get(&id(5), s(65)), Some("n5".into()));
        assert_eq!(c.get(&id(5), s(66)), None);
        assert!(c.nodes.is_empty() && c.order.is_empty());
    }
}
