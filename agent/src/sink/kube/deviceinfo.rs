//! Publishes the MindCluster documents in `kube-system` by server-side apply under the agent's
//! field manager: the `DeviceInfoCfg` document (built by `sink::mindcluster`) as
//! `mindx-dl-deviceinfo-<node>`, and the public-fault message (built by `sink::publicfault`) as
//! `faultline-publicfault-<node>`. Only when the policy turns them on; the RBAC for them is an
//! opt-in kustomize component (`manifests/components/mindcluster`).

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::json;

use super::FIELD_MANAGER;
use crate::sink::mindcluster::{
    DocumentPublisher, CONFIGMAP_PREFIX, CONSUMER_LABEL, DATA_KEY, NAMESPACE,
};
use crate::sink::publicfault;

/// A document the API server did not take.
#[derive(Debug, thiserror::Error)]
#[error("apply ConfigMap {namespace}/{name}: {source}")]
pub(crate) struct PublishError {
    pub namespace: &'static str,
    pub name: String,
    #[source]
    pub source: kube::Error,
}

/// One labelled ConfigMap in `kube-system` holding one document under one key.
#[derive(Clone, Debug)]
pub(crate) struct DeviceInfoPublisher {
    api: Api<ConfigMap>,
    namespace: &'static str,
    name: String,
    label: (&'static str, &'static str),
    key: &'static str,
}

impl DeviceInfoPublisher {
    /// `mindx-dl-deviceinfo-<node>`, label `mx-consumer-cim=true`, key `DeviceInfoCfg`.
    pub(crate) fn new(client: kube::Client, node: &str) -> Self {
        DeviceInfoPublisher {
            api: Api::namespaced(client, NAMESPACE),
            namespace: NAMESPACE,
            name: format!("{CONFIGMAP_PREFIX}{node}"),
            label: CONSUMER_LABEL,
            key: DATA_KEY,
        }
    }

    /// `faultline-publicfault-<node>`, label `mc-consumer-publicfault=true`, key `PublicFault`.
    pub(crate) fn public_faults(client: kube::Client, node: &str) -> Self {
        DeviceInfoPublisher {
            api: Api::namespaced(client, publicfault::NAMESPACE),
            namespace: publicfault::NAMESPACE,
            name: format!("{}{node}", publicfault::CONFIGMAP_PREFIX),
            label: publicfault::CONSUMER_LABEL,
            key: publicfault::DATA_KEY,
        }
    }
}

impl DocumentPublisher for DeviceInfoPublisher {
    type Error = PublishError;
    async fn publish(&self, document: &str) -> Result<(), PublishError> {
        let body = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": { self.label.0: self.label.1 },
            },
            "data": { self.key: document },
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
                namespace: self.namespace,
                name: self.name.clone(),
                source,
            })
    }
}
