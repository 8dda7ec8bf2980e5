//! Publishes the MindCluster `DeviceInfoCfg` document (built by `sink::mindcluster`) as the
//! ConfigMap `mindx-dl-deviceinfo-<node>` in `kube-system`, by server-side apply under the
//! agent's field manager. Only when `ascend.mindcluster.enabled`; the RBAC for it is an opt-in
//! kustomize component (`manifests/components/mindcluster`).

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::json;

use super::FIELD_MANAGER;
use crate::sink::mindcluster::{Publisher, CONFIGMAP_PREFIX, CONSUMER_LABEL, DATA_KEY, NAMESPACE};

/// The Kubernetes side of the MindCluster output.
#[derive(Clone, Debug)]
pub struct DeviceInfoPublisher {
    api: Api<ConfigMap>,
    name: String,
}

impl DeviceInfoPublisher {
    pub fn new(client: kube::Client, node: &str) -> Self {
        DeviceInfoPublisher {
            api: Api::namespaced(client, NAMESPACE),
            name: format!("{CONFIGMAP_PREFIX}{node}"),
        }
    }
}

impl Publisher for DeviceInfoPublisher {
    async fn publish(&self, document: &str) -> Result<(), String> {
        let body = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": self.name,
                "namespace": NAMESPACE,
                "labels": { CONSUMER_LABEL.0: CONSUMER_LABEL.1 },
            },
            "data": { DATA_KEY: document },
        });
        self.api
            .patch(
                &self.name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
            .map(|_| ())
            .map_err(|e| format!("apply ConfigMap {NAMESPACE}/{}: {e}", self.name))
    }
}
