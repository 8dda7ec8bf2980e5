//! Where runs are published: the ConfigMap `faultline-peercheck` in the agent's namespace
//! (Kubernetes), or `peercheck.json` in the coordinator's state directory (standalone). Both
//! hold the last run, its plan round by round, and its verdicts; a failed write is logged and
//! the run goes on.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tracing::warn;

use super::runs::{RunPublisher, RunState};
use faultline_agent::peer::lease::NAME;

/// Its key holding the current (or last) run as JSON.
pub const KEY: &str = "run.json";
/// Its key holding the last finished run (stays while the next run is in progress).
pub const FINISHED_KEY: &str = "finished.json";
/// The field manager of `finished.json`.
const FINISHED_MANAGER: &str = "faultline-peercheck-finished";
/// The file in the state directory.
pub const FILE: &str = "peercheck.json";
/// The last finished run, in the state directory.
pub const FINISHED_FILE: &str = "peercheck-finished.json";

/// Publishes to the ConfigMap by server-side apply.
#[derive(Clone)]
pub struct KubePublisher {
    pub client: Client,
    pub namespace: String,
}

#[async_trait::async_trait]
impl RunPublisher for KubePublisher {
    async fn publish(&self, state: &RunState) {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let text = match serde_json::to_string_pretty(state) {
            Ok(t) => t,
            Err(e) => return warn!(error = %e, "cannot encode the run"),
        };
        let data = json!({
            KEY: text,
            "coordinator": state.coordinator,
            "runId": state.run_id,
            "finished": state.is_finished().to_string(),
        });
        let labels = json!({"app.kubernetes.io/name": "faultline", "app.kubernetes.io/component": "peercheck"});
        let apply = |data: serde_json::Value| {
            json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": NAME, "labels": labels},
                "data": data,
            })
        };
        let pp = PatchParams::apply(faultline_agent::kube_client::FIELD_MANAGER).force();
        if let Err(e) = api.patch(NAME, &pp, &Patch::Apply(&apply(data))).await {
            warn!(error = %e, configmap = NAME, "cannot publish the peer-check run");
        }
        // The last finished run under its own field manager: the next run's applies (which do
        // not carry it) leave it alone until that run finishes too.
        if state.is_finished() {
            let pp = PatchParams::apply(FINISHED_MANAGER).force();
            let finished = apply(json!({ FINISHED_KEY: text }));
            if let Err(e) = api.patch(NAME, &pp, &Patch::Apply(&finished)).await {
                warn!(error = %e, configmap = NAME, "cannot publish the finished peer-check run");
            }
        }
    }

    async fn last(&self) -> Option<RunState> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        match api.get_opt(NAME).await {
            Ok(Some(cm)) => {
                let text = cm.data?.remove(KEY)?;
                serde_json::from_str(&text)
                    .map_err(|e| warn!(error = %e, "unreadable {NAME}; ignoring it"))
                    .ok()
            }
            Ok(None) => None,
            Err(e) => {
                warn!(error = %e, "cannot read {NAME}");
                None
            }
        }
    }
}

/// Publishes to `peercheck.json` (atomically replaced), and a finished run also to
/// `peercheck-finished.json`.
#[derive(Debug, Clone)]
pub struct FilePublisher {
    pub dir: PathBuf,
}

#[async_trait::async_trait]
impl RunPublisher for FilePublisher {
    async fn publish(&self, state: &RunState) {
        let bytes = match serde_json::to_vec_pretty(state) {
            Ok(b) => b,
            Err(e) => return warn!(error = %e, "cannot encode the run"),
        };
        let mut paths = vec![self.dir.join(FILE)];
        if state.is_finished() {
            paths.push(self.dir.join(FINISHED_FILE));
        }
        for path in paths {
            if let Err(e) = faultline_agent::atomic_file::write(&path, &bytes) {
                warn!(path = %path.display(), error = %e, "cannot write the peer-check run");
            }
        }
    }

    async fn last(&self) -> Option<RunState> {
        let text = tokio::fs::read(self.dir.join(FILE)).await.ok()?;
        serde_json::from_slice(&text).ok()
    }
}

impl std::fmt::Debug for KubePublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubePublisher")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}
