//! Publishes the public-fault message (built by `sink::publicfault`) as the ConfigMap
//! `faultline-publicfault-<node>` in `kube-system`, labelled `mc-consumer-publicfault=true`,
//! by server-side apply under the agent's field manager. Only when the policy turns public
//! faults on; the RBAC for it is an opt-in kustomize component
//! (`manifests/components/mindcluster`).

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::json;

use super::FIELD_MANAGER;
use crate::sink::publicfault::{
    DocumentPublisher, CONFIGMAP_PREFIX, CONSUMER_LABEL, DATA_KEY, NAMESPACE,
};

/// A message the API server did not take.
#[derive(Debug, thiserror::Error)]
#[error("apply ConfigMap {NAMESPACE}/{name}: {source}")]
pub(crate) struct PublishError {
    pub name: String,
    #[source]
    pub source: kube::Error,
}

/// This node's public-fault ConfigMap.
#[derive(Clone, Debug)]
pub(crate) struct PublicFaultPublisher {
    api: Api<ConfigMap>,
    name: String,
}

impl PublicFaultPublisher {
    /// `faultline-publicfault-<node>` in `kube-system`.
    pub(crate) fn new(client: kube::Client, node: &str) -> Self {
        PublicFaultPublisher {
            api: Api::namespaced(client, NAMESPACE),
            name: format!("{CONFIGMAP_PREFIX}{node}"),
        }
    }
}

impl DocumentPublisher for PublicFaultPublisher {
    type Error = PublishError;
    async fn publish(&self, document: &str) -> Result<(), PublishError> {
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
            .map_err(|source| PublishError {
                name: self.name.clone(),
                source,
            })
    }
}
