//! Who takes part in peer checks. In Kubernetes, the agent pods of the DaemonSet (pod IP, node
//! name, the node's topology label); on bare metal or Slurm, a members file. Behind a trait so
//! the coordinator is tested with fixed lists.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};

/// One member of the check pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub node: String,
    /// Where its agent's peer-check service listens.
    pub address: String,
    /// The address its probes bind (its pod IP: the agents run on the host network).
    pub ip: IpAddr,
    /// The topology label's value, when the node has one.
    pub topology: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum MembersError {
    #[error("cannot read the members file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("members file {path}, line {line}: {message}")]
    Syntax {
        path: String,
        line: usize,
        message: String,
    },
    #[error("listing the agent pods: {0}")]
    Kube(#[from] kube::Error),
}

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

/// Parses a members file.
pub fn parse_members(path: &str, text: &str) -> Result<Vec<Member>, MembersError> {
    let mut out: Vec<Member> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let err = |message: String| MembersError::Syntax {
            path: path.to_string(),
            line: i + 1,
            message,
        };
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (node, addr, topology) = match fields.as_slice() {
            [n, a] => (*n, *a, None),
            [n, a, t] => (*n, *a, Some(t.to_string())),
            _ => return Err(err("expected `node ip:port [topology]`".into())),
        };
        let sock: std::net::SocketAddr = addr
            .parse()
            .map_err(|_| err(format!("{addr:?} is not ip:port")))?;
        if out.iter().any(|m| m.node == node) {
            return Err(err(format!("node {node:?} is listed twice")));
        }
        out.push(Member {
            node: node.to_string(),
            address: sock.to_string(),
            ip: sock.ip(),
            topology,
        });
    }
    Ok(out)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn members_file() {
        let m = parse_members(
            "f",
            "# pool\nnode-a 10.0.0.1:20261 rack1\nnode-b 10.0.0.2:20261  # no rack\n\n",
        )
        .unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].topology.as_deref(), Some("rack1"));
        assert_eq!(m[1].address, "10.0.0.2:20261");
        assert_eq!(m[1].ip.to_string(), "10.0.0.2");
        for (bad, why) in [
            ("a", "expected"),
            ("a 10.0.0.1", "not ip:port"),
            ("a 10.0.0.1:1\na 10.0.0.2:1", "twice"),
            ("a b c d", "expected"),
        ] {
            let e = parse_members("f", bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
