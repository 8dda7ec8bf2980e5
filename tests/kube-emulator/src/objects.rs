//! Object references for direct store access and builders for realistic objects.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::util::{new_uid, now_rfc3339};

/// Names one object: group, version, plural resource, namespace (None for
/// cluster-scoped) and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResourceRef {
    pub group: String,
    pub version: String,
    pub resource: String,
    pub namespace: Option<String>,
    pub name: String,
}

impl ResourceRef {
    pub fn new(
        group: &str,
        version: &str,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Self {
        ResourceRef {
            group: group.to_string(),
            version: version.to_string(),
            resource: resource.to_string(),
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        }
    }

    fn core(resource: &str, namespace: Option<&str>, name: &str) -> Self {
        Self::new("", "v1", resource, namespace, name)
    }

    pub fn node(name: &str) -> Self {
        Self::core("nodes", None, name)
    }

    pub fn namespace(name: &str) -> Self {
        Self::core("namespaces", None, name)
    }

    pub fn config_map(namespace: &str, name: &str) -> Self {
        Self::core("configmaps", Some(namespace), name)
    }

    pub fn secret(namespace: &str, name: &str) -> Self {
        Self::core("secrets", Some(namespace), name)
    }

    pub fn pod(namespace: &str, name: &str) -> Self {
        Self::core("pods", Some(namespace), name)
    }

    pub fn service(namespace: &str, name: &str) -> Self {
        Self::core("services", Some(namespace), name)
    }

    /// A core/v1 Event.
    pub fn event(namespace: &str, name: &str) -> Self {
        Self::core("events", Some(namespace), name)
    }

    /// An events.k8s.io/v1 Event.
    pub fn events_v1(namespace: &str, name: &str) -> Self {
        Self::new("events.k8s.io", "v1", "events", Some(namespace), name)
    }

    pub fn lease(namespace: &str, name: &str) -> Self {
        Self::new("coordination.k8s.io", "v1", "leases", Some(namespace), name)
    }
}

fn internal_ip(name: &str) -> String {
    let h = name.bytes().fold(2166136261u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(16777619)
    });
    format!("10.0.{}.{}", (h >> 8) % 250, h % 250 + 2)
}

/// A Node as a kubelet registers it: the well-known labels plus `labels`,
/// capacity/allocatable, addresses, nodeInfo, and the four kubelet conditions
/// (Ready=True, MemoryPressure/DiskPressure/PIDPressure=False). No taints.
pub fn node(name: &str, labels: &[(&str, &str)]) -> Value {
    let now = now_rfc3339();
    let mut l = Map::new();
    for (k, v) in [
        ("beta.kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
        ("kubernetes.io/hostname", name),
        ("kubernetes.io/os", "linux"),
    ] {
        l.insert(k.to_string(), json!(v));
    }
    for (k, v) in labels {
        l.insert((*k).to_string(), json!(v));
    }
    let condition = |t: &str, status: &str, reason: &str, message: &str| {
        json!({
            "type": t,
            "status": status,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
            "reason": reason,
            "message": message,
        })
    };
    let resources = json!({
        "cpu": "64",
        "ephemeral-storage": "1856135664Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
        "memory": "1056617716Ki",
        "pods": "110",
    });
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": l,
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {
            "podCIDR": "10.244.0.0/24",
            "podCIDRs": ["10.244.0.0/24"],
        },
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": internal_ip(name)},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": new_uid().replace('-', ""),
                "systemUUID": new_uid(),
                "bootID": new_uid(),
                "kernelVersion": "6.8.0-52-generic",
                "osImage": "Ubuntu 24.04.1 LTS",
                "containerRuntimeVersion": "containerd://1.7.24",
                "kubeletVersion": "v1.33.0",
                "kubeProxyVersion": "v1.33.0",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "images": [],
        },
    })
}

/// A Namespace as the apiserver stores it (metadata.name label, `kubernetes`
/// finalizer, phase Active).
pub fn namespace(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_shape() {
        let n = node("gpu-1", &[("nvidia.com/gpu.present", "true")]);
        assert_eq!(n["metadata"]["labels"]["kubernetes.io/hostname"], "gpu-1");
        assert_eq!(n["metadata"]["labels"]["nvidia.com/gpu.present"], "true");
        let types: Vec<&str> = n["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["type"].as_str())
            .collect();
        assert_eq!(
            types,
            ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready"]
        );
        assert!(n["spec"].get("taints").is_none());
    }
}
