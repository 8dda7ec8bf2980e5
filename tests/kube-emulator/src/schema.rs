//! The little schema knowledge the emulator needs: which lists are associative
//! (merged by key in strategic merge patch and tracked per element in
//! server-side apply), which are sets, and which are atomic.

/// How a list field merges.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ListType {
    /// Replaced as a whole (`+listType=atomic`, no patch strategy).
    Atomic,
    /// Elements identified by key fields (`+listType=map`, `patchStrategy=merge`).
    /// The first key is the strategic-merge-patch `patchMergeKey`.
    Map(&'static [&'static str]),
    /// Scalar elements merged as a set (`+listType=set`, `patchStrategy=merge`).
    Set,
}

/// The list type of the field at `path` (field names only, list elements
/// skipped) in an object of `kind`.
pub(crate) fn list_type(kind: &str, path: &[String]) -> ListType {
    let joined = path.join(".");
    let p = joined.as_str();
    match p {
        "metadata.ownerReferences" => return ListType::Map(&["uid"]),
        "metadata.finalizers" => return ListType::Set,
        _ => {}
    }
    match kind {
        "Node" => match p {
            "status.conditions" | "status.addresses" => ListType::Map(&["type"]),
            "status.volumesAttached" => ListType::Map(&["name"]),
            "spec.podCIDRs" => ListType::Set,
            _ => ListType::Atomic,
        },
        "Pod" => pod_list_type(p),
        "Service" => match p {
            "spec.ports" => ListType::Map(&["port", "protocol"]),
            "status.conditions" => ListType::Map(&["type"]),
            _ => ListType::Atomic,
        },
        "Namespace" => match p {
            "status.conditions" => ListType::Map(&["type"]),
            _ => ListType::Atomic,
        },
        _ => ListType::Atomic,
    }
}

fn pod_list_type(p: &str) -> ListType {
    for containers in [
        "spec.containers",
        "spec.initContainers",
        "spec.ephemeralContainers",
    ] {
        if p == containers {
            return ListType::Map(&["name"]);
        }
        if let Some(rest) = p.strip_prefix(containers).and_then(|r| r.strip_prefix('.')) {
            return match rest {
                "ports" => ListType::Map(&["containerPort", "protocol"]),
                "env" => ListType::Map(&["name"]),
                "volumeMounts" => ListType::Map(&["mountPath"]),
                "volumeDevices" => ListType::Map(&["devicePath"]),
                _ => ListType::Atomic,
            };
        }
    }
    match p {
        "spec.volumes" | "spec.imagePullSecrets" | "spec.resourceClaims" => {
            ListType::Map(&["name"])
        }
        "spec.hostAliases" => ListType::Map(&["ip"]),
        "status.conditions" => ListType::Map(&["type"]),
        "status.podIPs" | "status.hostIPs" => ListType::Map(&["ip"]),
        _ => ListType::Atomic,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Vec<String> {
        s.split('.').map(String::from).collect()
    }

    #[test]
    fn lookups() {
        assert_eq!(list_type("Node", &p("spec.taints")), ListType::Atomic);
        assert_eq!(
            list_type("Node", &p("status.conditions")),
            ListType::Map(&["type"])
        );
        assert_eq!(
            list_type("Pod", &p("spec.containers.env")),
            ListType::Map(&["name"])
        );
        assert_eq!(
            list_type("ConfigMap", &p("metadata.finalizers")),
            ListType::Set
        );
    }
}
