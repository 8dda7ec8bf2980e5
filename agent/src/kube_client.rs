//! The Kubernetes client the agent and the CLI use: from a kubeconfig or the in-cluster
//! service account, with timeouts, and the field manager the agent's writes carry.

use std::path::Path;
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// The server-side apply field manager of the agent's writes.
pub const FIELD_MANAGER: &str = "faultline";

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
