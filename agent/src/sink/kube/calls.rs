//! Every Kubernetes API call the agent makes, and every call the peer-check coordinator makes, as
//! data.
//!
//! The RBAC manifests in `manifests/base/` must allow exactly these calls and nothing more, each
//! to its own service account (`faultline` for [`API_CALLS`], `faultline-coordinator` for
//! [`COORDINATOR_API_CALLS`]): a test (`tests/manifests/tests/rbac.rs`) checks the Roles against
//! these tables, and the end-to-end tests check that every call the agent sends to the API
//! emulator is listed here. Add a row here in the same change that adds a call.
//!
//! A row is a verb the API server *checks*, which is not always the verb of the request: a
//! server-side apply is a `patch`, and when it creates the object the server also checks
//! `create` on its name (k8s.io/apiserver `handlers/patch.go`; a PUT that creates likewise in
//! `handlers/update.go`). So every object the agent applies into existence has a `create` row
//! too. Nodes have none on purpose: the agent has read or watched its Node before each write
//! and must never create one (an apply to a deleted Node is refused, not turned into a bare
//! Node).

/// Where a call's target lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A cluster-scoped object (Nodes).
    Cluster,
    /// faultline's namespace (`faultline-system` by default): the agents' and the coordinator's.
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

/// The coordinator Lease, the only one the agent reads and the coordinator writes.
const LEASE: &[&str] = &["faultline-peercheck"];
/// The taint ledger, the only ConfigMap the coordinator replaces.
const LEDGER: &[&str] = &["faultline-taint-budget"];
/// The published peer-check runs.
const PEERCHECK: &[&str] = &["faultline-peercheck"];

/// The agent's table. Cluster-wide decisions are the coordinator's ([`COORDINATOR_API_CALLS`]):
/// no agent writes the Lease, faultline-peercheck or the taint ledger, lists the members, or
/// reviews tokens.
pub const API_CALLS: &[ApiCall] = &[
    call(
        "",
        "nodes",
        "get",
        Scope::Cluster,
        "source::gpu_count (expected GPU count label), sink::kube::node (read before every change), restore (at start with no local state and no fault ConfigMap: the taints that name operator-held faults)",
    ),
    call(
        "",
        "nodes",
        "list",
        Scope::Cluster,
        "sink::kube::node (its controller's watch of this Node starts with a list pinned to its name; without it the sink reads the Node itself)",
    ),
    call(
        "",
        "nodes",
        "watch",
        Scope::Cluster,
        "sink::kube::node (this Node, by fieldSelector metadata.name: drift is repaired at once)",
    ),
    call(
        "coordination.k8s.io",
        "leases",
        "get",
        Scope::AgentNamespace,
        "peer (the faultline-peercheck Lease, read only: which coordinator is active, and its public key, the only key an agent accepts assignments and conclusions under)",
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
        "sink::kube::configmap (adopt faultline-<node> on start)",
    ),
    call(
        "",
        "configmaps",
        "list",
        Scope::AgentNamespace,
        "sink::kube::configmap (the watch of faultline-<node> starts with a list pinned to its name)",
    ),
    call(
        "",
        "configmaps",
        "watch",
        Scope::AgentNamespace,
        "sink::kube::configmap (faultline-<node>, by fieldSelector metadata.name: a deleted or overwritten record is written again at once)",
    ),
    call(
        "",
        "configmaps",
        "create",
        Scope::AgentNamespace,
        "sink::kube::configmap (the first server-side apply of faultline-<node> creates it, and the API server checks create as well as patch for that)",
    ),
    call(
        "",
        "configmaps",
        "patch",
        Scope::AgentNamespace,
        "sink::kube::configmap (faultline-<node> by server-side apply)",
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

/// Calls made only with MindCluster's public faults on (`ascend.mindcluster.public_faults`).
/// Their RBAC is the opt-in component `manifests/components/mindcluster`, checked against this
/// table.
pub const MINDCLUSTER_CALLS: &[ApiCall] = &[
    call(
        "",
        "configmaps",
        "patch",
        Scope::Namespace("kube-system"),
        "sink::kube::publicfault (faultline-publicfault-<node> by server-side apply)",
    ),
    call(
        "",
        "configmaps",
        "create",
        Scope::Namespace("kube-system"),
        "sink::kube::publicfault (the first apply creates the ConfigMap: checked as create too)",
    ),
];

/// The peer-check coordinator's table (`faultline-coordinator`, its own service account and
/// Deployment): the election, the published runs, the members, the taint ledger, and the
/// identity checks of the agents' reports and admissions and the requesters' runs. It writes no
/// Node and no agent's record.
pub const COORDINATOR_API_CALLS: &[ApiCall] = &[
    call(
        "coordination.k8s.io",
        "leases",
        "get",
        Scope::AgentNamespace,
        "coordinator::lease (who holds faultline-peercheck, and until when)",
    )
    .only(LEASE),
    call(
        "coordination.k8s.io",
        "leases",
        "create",
        Scope::AgentNamespace,
        "coordinator::lease (creates faultline-peercheck when missing: a POST, which RBAC cannot limit by name)",
    ),
    call(
        "coordination.k8s.io",
        "leases",
        "patch",
        Scope::AgentNamespace,
        "coordinator::lease (acquires, renews and releases it; publishes the active replica's address and public key in it)",
    )
    .only(LEASE),
    call(
        "coordination.k8s.io",
        "leases",
        "update",
        Scope::AgentNamespace,
        "coordinator::lease (takes over an expired Lease with its resourceVersion)",
    )
    .only(LEASE),
    call(
        "",
        "configmaps",
        "get",
        Scope::AgentNamespace,
        "coordinator::publish (reads faultline-peercheck back to resume a run after a failover)",
    )
    .only(PEERCHECK),
    call(
        "",
        "configmaps",
        "get",
        Scope::AgentNamespace,
        "coordinator::budget (reads the taint ledger when it becomes the active replica, and after a conflicting write)",
    )
    .only(LEDGER),
    call(
        "",
        "configmaps",
        "create",
        Scope::AgentNamespace,
        "coordinator::publish (the first server-side apply of faultline-peercheck creates it: the API server checks create, which RBAC cannot limit by name), coordinator::budget (the taint ledger's first admission, by POST)",
    ),
    call(
        "",
        "configmaps",
        "update",
        Scope::AgentNamespace,
        "coordinator::budget (the taint ledger, replaced with the resourceVersion it was read or last written at)",
    )
    .only(LEDGER),
    call(
        "",
        "configmaps",
        "patch",
        Scope::AgentNamespace,
        "coordinator::publish (faultline-peercheck by server-side apply: runs and verdicts)",
    )
    .only(PEERCHECK),
    call(
        "",
        "pods",
        "list",
        Scope::AgentNamespace,
        "coordinator::members (the agent pods: node name and pod IP of every member; their number is the taint budget's node count)",
    ),
    call(
        "",
        "nodes",
        "get",
        Scope::Cluster,
        "coordinator::members (the topology label of one member's Node; only with peer.topology_label set)",
    ),
    call(
        "",
        "nodes",
        "list",
        Scope::Cluster,
        "coordinator::members (the topology label of every member's Node; only with peer.topology_label set)",
    ),
    call(
        "authentication.k8s.io",
        "tokenreviews",
        "create",
        Scope::Cluster,
        "coordinator::agents (TokenReview of agent tokens: the pod-bound token says which node a report or a taint admission comes from), coordinator::requesters (TokenReview of a requester's token)",
    ),
    call(
        "authorization.k8s.io",
        "subjectaccessreviews",
        "create",
        Scope::Cluster,
        "coordinator::requesters (may that requester create peerchecks.faultline.io: SubjectAccessReview)",
    ),
];

/// Whether `verb` on `group`/`resource` is in either of the agent's tables (for the emulator-based tests).
pub fn listed(group: &str, resource: &str, verb: &str) -> bool {
    API_CALLS
        .iter()
        .chain(MINDCLUSTER_CALLS)
        .any(|c| c.group == group && c.resource == resource && c.verb == verb)
}
