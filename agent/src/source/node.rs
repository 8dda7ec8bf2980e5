//! The agent's own Node, read from the Kubernetes API: its labels feed the other sources (today:
//! the expected GPU count from `nvidia.com/gpu.count`, set by GPU feature discovery).
//!
//! Only in Kubernetes mode. The agent reads its own Node and nothing else; a failed read is
//! logged and retried, and never stops detection.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The label GPU feature discovery puts on GPU nodes.
pub const GPU_COUNT_LABEL: &str = "nvidia.com/gpu.count";

/// Why no client could be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("in-cluster configuration: {0}")]
    InCluster(#[from] kube::config::InClusterError),
    #[error("client: {0}")]
    Client(#[from] kube::Error),
    #[error("no Kubernetes configuration found (give --kubeconfig): {0}")]
    Infer(String),
}

/// A client from an explicit kubeconfig, or the in-cluster service account.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, ClientError> {
    let config = match kubeconfig {
        Some(p) => {
            let kc = Kubeconfig::read_from(p).map_err(|source| ClientError::Kubeconfig {
                path: p.display().to_string(),
                source,
            })?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|source| ClientError::Kubeconfig {
                    path: p.display().to_string(),
                    source,
                })?
        }
        None => Config::incluster()?,
    };
    Ok(Client::try_from(with_timeouts(config))?)
}

/// A client from `--kubeconfig`, else the usual places (`KUBECONFIG`, `~/.kube/config`, the
/// in-cluster service account): for the CLI.
pub async fn client_infer(kubeconfig: Option<&Path>) -> Result<Client, ClientError> {
    if kubeconfig.is_some() {
        return client(kubeconfig).await;
    }
    let config = Config::infer()
        .await
        .map_err(|e| ClientError::Infer(e.to_string()))?;
    Ok(Client::try_from(with_timeouts(config))?)
}

/// The agent never watches, so no call needs to wait long: a hung API server costs a sink at
/// most this long before it backs off and tries again.
pub fn with_timeouts(mut config: Config) -> Config {
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(15));
    config.write_timeout = Some(Duration::from_secs(15));
    config
}

/// The expected GPU count a node's labels state, if any.
pub fn gpu_count(labels: &BTreeMap<String, String>) -> Option<u32> {
    labels
        .get(GPU_COUNT_LABEL)
        .and_then(|v| v.trim().parse().ok())
}

/// Reads the node's labels every `every` and publishes the GPU count they state.
pub async fn watch_gpu_count(
    client: Client,
    node: String,
    tx: watch::Sender<Option<u32>>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let nodes: Api<Node> = Api::all(client);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        match nodes.get(&node).await {
            Ok(n) => {
                if failing {
                    info!(node = %node, "reading the node works again");
                    failing = false;
                }
                let count = n.metadata.labels.as_ref().and_then(gpu_count);
                debug!(node = %node, count = ?count, "node labels read");
                tx.send_if_modified(|cur| {
                    let changed = *cur != count;
                    *cur = count;
                    changed
                });
            }
            Err(e) => {
                if !failing {
                    warn!(node = %node, error = %e, "cannot read this node from the API; keeping the last known labels");
                    failing = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_count_label() {
        let mut l = BTreeMap::new();
        assert_eq!(gpu_count(&l), None);
        l.insert(GPU_COUNT_LABEL.to_string(), "8".to_string());
        assert_eq!(gpu_count(&l), Some(8));
        l.insert(GPU_COUNT_LABEL.to_string(), "eight".to_string());
        assert_eq!(gpu_count(&l), None, "a bad label is ignored, not a crash");
    }
}
