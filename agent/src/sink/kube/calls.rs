//! Every Kubernetes API call the agent makes, as data.
//!
//! The RBAC manifests in `manifests/base/` must allow exactly these calls and nothing more: a test
//! (`tests/manifests/tests/rbac.rs`) checks the Roles against this table, and the end-to-end tests
//! check that every call the agent sends to the API emulator is listed here. Add a row here in the
//! same change that adds a call.
//!
//! A row is a verb the API server *checks*, which is not always the verb of the request: a
//! server-side apply is a `patch`, and when it creates the object the server also checks
//! `create` on its name (k8s.io/apiserver `handlers/patch.go`; a PUT that creates likewise in
//! `handlers/update.go`). So every object the agent applies into existence has a `create` row
//! too. Nodes have none on purpose: the agent reads its Node before each write and must never
//! create one (an apply to a deleted Node is refused, not turned into a bare Node).

/// Where a call's target lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A cluster-scoped object (Nodes).
    Cluster,
    /// The agent's own namespace (`faultline-system` by default).
    AgentNamespace,
    /// A fixed namespace (Events about a Node go to `default`).
    Namespace(&'static str),
}

/// One kind of call: the RBAC verb on a resource (with subresource) in an API group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiCall {
    /// API group: `""` for the core group.
    pub group: &'static str,
    /// Resource, with `/subresource` when there is one (`nodes/status`).
    pub resource: &'static str,
    pub verb: &'static str,
    pub scope: Scope,
    /// The only object names the call is made on (RBAC `resourceNames`); empty: any name. A
    /// POST create cannot be limited by name in RBAC (the name is in the body), nor can names
    /// that depend on the node (`faultline-<node>`): the admission policy narrows those.
    pub names: &'static [&'static str],
    /// The module that makes the call, and why.
    pub used_by: &'static str,
}

const fn call(
    group: &'static str,
    resource: &'static str,
    verb: &'static str,
    scope: Scope,
    used_by: &'static str,
) -> ApiCall {
    ApiCall {
        group,
        resource,
        verb,
        scope,
        names: &[],
        used_by,
    }
}

impl ApiCall {
    /// The same call, made only on these names.
    const fn only(self, names: &'static [&'static str]) -> ApiCall {
        ApiCall { names, ..self }
    }
}

/// The coordinator Lease, the only one the agent touches.
const LEASE: &[&str] = &["faultline-peercheck"];
/// The taint ledger, the only ConfigMap the agent replaces.
const LEDGER: &[&str] = &["faultline-taint-budget"];

/// The whole table.
pub const API_CALLS: &[ApiCall] = &[
    call(
        "",
        "nodes",
        "get",
        Scope::Cluster,
        "source::node (expected GPU count label), sink::kube::node (read before every change), daemon (at start with no local state and no fault ConfigMap: the taints that name operator-held faults)",
    ),
    call(
        "",
        "nodes",
        "list",
        Scope::Cluster,
        "sink::kube::own (the watch of this Node starts with a list pinned to its name), peer::members (the topology label of every member; only with peer.topology_label set)",
    ),
    call(
        "",
        "nodes",
        "watch",
        Scope::Cluster,
        "sink::kube::own (this Node, by fieldSelector metadata.name: drift is repaired at once)",
    ),
    call(
        "",
        "pods",
        "list",
        Scope::AgentNamespace,
        "peer::members (the coordinator lists the agent pods: node name and pod IP; every agent lists them to check an assignment's addresses, peer::authz)",
    ),
    call(
        "authentication.k8s.io",
        "tokenreviews",
        "create",
        Scope::Cluster,
        "peer::authz (the coordinator checks a requester's service-account token: TokenReview)",
    ),
    call(
        "authorization.k8s.io",
        "subjectaccessreviews",
        "create",
        Scope::Cluster,
        "peer::authz (the coordinator asks whether that requester may create peerchecks.faultline.io: SubjectAccessReview)",
    ),
    call(
        "coordination.k8s.io",
        "leases",
        "get",
        Scope::AgentNamespace,
        "peer::lease (the faultline-peercheck Lease: who coordinates; faultline check reads it, every agent reads it to obey only the coordinator, peer::authz)",
    )
    .only(LEASE),
    call(
        "coordination.k8s.io",
        "leases",
        "create",
        Scope::AgentNamespace,
        "peer::lease (kube-lease-manager creates the Lease when missing)",
    ),
    call(
        "coordination.k8s.io",
        "leases",
        "patch",
        Scope::AgentNamespace,
        "peer::lease (kube-lease-manager acquires, renews and releases it)",
    )
    .only(LEASE),
    call(
        "",
        "nodes",
        "patch",
        Scope::Cluster,
        "sink::kube::node: labels by server-side apply; taints by merge patch with resourceVersion",
    ),
    call(
        "",
        "nodes/status",
        "patch",
        Scope::Cluster,
        "sink::kube::node: the AcceleratorHealthy condition by strategic merge patch",
    ),
    call(
        "",
        "configmaps",
        "get",
        Scope::AgentNamespace,
        "sink::kube::configmap (adopt on start), sink::kube::budget (the taint ledger)",
    ),
    call(
        "",
        "configmaps",
        "list",
        Scope::AgentNamespace,
        "sink::kube::budget (count the nodes: one fault ConfigMap per agent), sink::kube::own (the watch of faultline-<node> starts with a list pinned to its name)",
    ),
    call(
        "",
        "configmaps",
        "watch",
        Scope::AgentNamespace,
        "sink::kube::own (faultline-<node>, by fieldSelector metadata.name: a deleted or overwritten record is written again at once)",
    ),
    call(
        "",
        "configmaps",
        "create",
        Scope::AgentNamespace,
        "sink::kube::budget (the taint ledger's first entry, by POST); sink::kube::configmap and peer::publish (the first server-side apply of faultline-<node> and faultline-peercheck creates them, and the API server checks create as well as patch for that)",
    ),
    call(
        "",
        "configmaps",
        "update",
        Scope::AgentNamespace,
        "sink::kube::budget (ledger entries, with resourceVersion)",
    )
    .only(LEDGER),
    call(
        "",
        "configmaps",
        "patch",
        Scope::AgentNamespace,
        "sink::kube::configmap (faultline-<node> by server-side apply), peer::publish (faultline-peercheck)",
    ),
    call(
        "events.k8s.io",
        "events",
        "create",
        Scope::Namespace("default"),
        "sink::kube::events (kube-runtime Recorder: a new Event)",
    ),
    call(
        "events.k8s.io",
        "events",
        "patch",
        Scope::Namespace("default"),
        "sink::kube::events (kube-runtime Recorder: a repeat of the same Event)",
    ),
];

/// Calls made only with the MindCluster output on (`ascend.mindcluster.enabled`). Their RBAC is
/// the opt-in component `manifests/components/mindcluster`, checked against this table.
pub const MINDCLUSTER_CALLS: &[ApiCall] = &[
    call(
        "",
        "configmaps",
        "patch",
        Scope::Namespace("kube-system"),
        "sink::kube::deviceinfo (mindx-dl-deviceinfo-<node> and faultline-publicfault-<node> by server-side apply)",
    ),
    call(
        "",
        "configmaps",
        "create",
        Scope::Namespace("kube-system"),
        "sink::kube::deviceinfo (the first apply creates each ConfigMap: checked as create too)",
    ),
];

/// Whether `verb` on `group`/`resource` is in either table (for the emulator-based tests).
pub fn listed(group: &str, resource: &str, verb: &str) -> bool {
    API_CALLS
        .iter()
        .chain(MINDCLUSTER_CALLS)
        .any(|c| c.group == group && c.resource == resource && c.verb == verb)
}
