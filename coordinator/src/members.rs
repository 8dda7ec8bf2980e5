//! Who takes part in peer checks. In Kubernetes, the agent pods of the DaemonSet (pod IP, node
//! name, the node's topology label); on bare metal or Slurm, a members file. Behind a trait so
//! the coordinator is tested with fixed lists.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

pub use faultline_agent::peer::members::{parse_members, Member, MembersError};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};

/// A source of members.
#[async_trait::async_trait]
pub trait Members: Send + Sync + std::fmt::Debug {
    async fn list(&self) -> Result<Vec<Member>, MembersError>;
}

/// Members from a file, one per line: `node ip:port [topology]`; `#` starts a comment.
#[derive(Debug, Clone)]
pub struct StaticMembers {
    pub path: PathBuf,
}

#[async_trait::async_trait]
impl Members for StaticMembers {
    async fn list(&self) -> Result<Vec<Member>, MembersError> {
        let p = self.path.display().to_string();
        let text = tokio::fs::read_to_string(&self.path)
            .await
            .map_err(|source| MembersError::Read {
                path: p.clone(),
                source,
            })?;
        parse_members(&p, &text)
    }
}

/// The running agent pods of the DaemonSet.
#[derive(Clone)]
pub struct KubeMembers {
    pub client: Client,
    pub namespace: String,
    /// Label selector of the agent pods.
    pub selector: String,
    /// The port every agent's peer-check service listens on.
    pub port: u16,
    /// Node label whose value groups neighbours (empty: none; Nodes are then not read).
    pub topology_label: String,
}

/// The default selector of the agent pods (manifests/base/daemonset.yaml).
pub const DEFAULT_SELECTOR: &str =
    "app.kubernetes.io/name=faultline,app.kubernetes.io/component=agent";

#[async_trait::async_trait]
impl Members for KubeMembers {
    async fn list(&self) -> Result<Vec<Member>, MembersError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let list = pods
            .list(&ListParams::default().labels(&self.selector))
            .await?;
        let topology: BTreeMap<String, String> = if self.topology_label.is_empty() {
            BTreeMap::new()
        } else {
            let nodes: Api<Node> = Api::all(self.client.clone());
            nodes
                .list(&ListParams::default().labels(&self.topology_label))
                .await?
                .items
                .into_iter()
                .filter_map(|n| {
                    let v = n.metadata.labels?.get(&self.topology_label)?.clone();
                    Some((n.metadata.name?, v))
                })
                .collect()
        };
        let mut out: Vec<Member> = Vec::new();
        for p in list.items {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            let status = p.status.as_ref();
            let running = status.and_then(|s| s.phase.as_deref()) == Some("Running");
            let ip = status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse::<IpAddr>().ok());
            let (Some(node), Some(ip), true) = (node, ip, running) else {
                continue;
            };
            if out.iter().any(|m| m.node == node) {
                continue; // a rolling update: two pods on one node for a moment
            }
            out.push(Member {
                topology: topology.get(&node).cloned(),
                address: std::net::SocketAddr::new(ip, self.port).to_string(),
                node,
                ip,
            });
        }
        out.sort_by(|a, b| a.node.cmp(&b.node));
        Ok(out)
    }
}

impl std::fmt::Debug for KubeMembers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeMembers")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}
