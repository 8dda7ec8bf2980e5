//! The table of resource types the emulator serves, and their per-kind traits
//! (scope, status subresource, create-on-update, discovery names).

/// One served resource type (one group/version/resource).
#[derive(Debug)]
pub(crate) struct ResourceType {
    pub group: &'static str,
    pub version: &'static str,
    pub resource: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Has a `status` subresource: writes to the main resource keep `.status`,
    /// writes to `/status` change only `.status`.
    pub status_subresource: bool,
    /// PUT on a missing object creates it (leases, events, services).
    pub create_on_update: bool,
    pub short_names: &'static [&'static str],
}

/// Index into [`RESOURCES`].
pub(crate) type ResourceId = usize;

pub(crate) static RESOURCES: [ResourceType; 9] = [
    ResourceType {
        group: "",
        version: "v1",
        resource: "namespaces",
        singular: "namespace",
        kind: "Namespace",
        namespaced: false,
        status_subresource: true,
        create_on_update: false,
        short_names: &["ns"],
    },
    ResourceType {
        group: "",
        version: "v1",
        resource: "nodes",
        singular: "node",
        kind: "Node",
        namespaced: false,
        status_subresource: true,
        create_on_update: false,
        short_names: &["no"],
    },
    ResourceType {
        group: "",
        version: "v1",
        resource: "configmaps",
        singular: "configmap",
        kind: "ConfigMap",
        namespaced: true,
        status_subresource: false,
        create_on_update: false,
        short_names: &["cm"],
    },
    ResourceType {
        group: "",
        version: "v1",
        resource: "secrets",
        singular: "secret",
        kind: "Secret",
        namespaced: true,
        status_subresource: false,
        create_on_update: false,
        short_names: &[],
    },
    ResourceType {
        group: "",
        version: "v1",
        resource: "pods",
        singular: "pod",
        kind: "Pod",
        namespaced: true,
        status_subresource: true,
        create_on_update: false,
        short_names: &["po"],
    },
    ResourceType {
        group: "",
        version: "v1",
        resource: "services",
        singular: "service",
        kind: "Service",
        namespaced: true,
        status_subresource: true,
        create_on_update: true,
        short_names: &["svc"],
    },
    ResourceType {
        group: "",
        version: "v1",
        resource: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
        status_subresource: false,
        create_on_update: true,
        short_names: &["ev"],
    },
    ResourceType {
        group: "events.k8s.io",
        version: "v1",
        resource: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
        status_subresource: false,
        create_on_update: true,
        short_names: &["ev"],
    },
    ResourceType {
        group: "coordination.k8s.io",
        version: "v1",
        resource: "leases",
        singular: "lease",
        kind: "Lease",
        namespaced: true,
        status_subresource: false,
        create_on_update: true,
        short_names: &[],
    },
];

/// Id of the `namespaces` resource.
pub(crate) const NAMESPACES: ResourceId = 0;

impl ResourceType {
    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `configmaps` or `leases.coordination.k8s.io`, as the apiserver prints it in messages.
    pub fn qualified_resource(&self) -> String {
        if self.group.is_empty() {
            self.resource.to_string()
        } else {
            format!("{}.{}", self.resource, self.group)
        }
    }

    /// `ConfigMap` or `Lease.coordination.k8s.io`.
    pub fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_string()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    /// Verbs listed for the resource in discovery documents.
    pub fn verbs(&self) -> &'static [&'static str] {
        &[
            "create",
            "delete",
            "deletecollection",
            "get",
            "list",
            "patch",
            "update",
            "watch",
        ]
    }
}

/// Looks a resource up by group, version and plural name.
pub(crate) fn find(group: &str, version: &str, resource: &str) -> Option<ResourceId> {
    RESOURCES
        .iter()
        .position(|r| r.group == group && r.version == version && r.resource == resource)
}

/// Looks a resource up by group and plural name (any served version).
pub(crate) fn find_resource(group: &str, resource: &str) -> Option<ResourceId> {
    RESOURCES
        .iter()
        .position(|r| r.group == group && r.resource == resource)
}

/// Looks a resource up by `apiVersion` and `kind`.
pub(crate) fn find_kind(api_version: &str, kind: &str) -> Option<ResourceId> {
    let (group, version) = split_api_version(api_version);
    RESOURCES
        .iter()
        .position(|r| r.group == group && r.version == version && r.kind == kind)
}

/// `v1` -> ("", "v1"); `coordination.k8s.io/v1` -> ("coordination.k8s.io", "v1").
pub(crate) fn split_api_version(api_version: &str) -> (&str, &str) {
    match api_version.split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    }
}

/// Distinct API groups (besides the core group), in table order.
pub(crate) fn groups() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for r in &RESOURCES {
        if !r.group.is_empty() && !out.contains(&r.group) {
            out.push(r.group);
        }
    }
    out
}

pub(crate) fn get(id: ResourceId) -> &'static ResourceType {
    &RESOURCES[id]
}
