//! The RBAC manifests grant each service account exactly the calls of its table
//! (`agent/src/sink/kube/calls.rs`): the agents' `faultline` the table `API_CALLS`, the
//! coordinator's `faultline-coordinator` the table `COORDINATOR_API_CALLS`. Every call is allowed
//! with the right scope, every permission granted is used by some call of that account's table,
//! and the agents can do none of the coordinator's cluster-wide work.

use std::collections::BTreeSet;

use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, Subject,
};

use crate::calls::{ApiCall, Scope, API_CALLS, COORDINATOR_API_CALLS, MINDCLUSTER_CALLS};
use crate::common::{self, Doc, COORDINATOR_SERVICE_ACCOUNT, NAMESPACE, SERVICE_ACCOUNT};

/// Where a permission applies.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Where {
    /// A ClusterRole bound by a ClusterRoleBinding.
    Cluster,
    /// A Role (or ClusterRole) bound by a RoleBinding in this namespace.
    Namespace(String),
}

/// One permission: `(group, resource, verb, where, names)`; no names: any object.
type Grant = (String, String, String, Where, Vec<String>);

fn wanted(call: &ApiCall) -> Grant {
    let at = match call.scope {
        Scope::Cluster => Where::Cluster,
        Scope::AgentNamespace => Where::Namespace(NAMESPACE.into()),
        Scope::Namespace(ns) => Where::Namespace(ns.into()),
    };
    let mut names: Vec<String> = call.names.iter().map(|n| n.to_string()).collect();
    names.sort();
    (
        call.group.into(),
        call.resource.into(),
        call.verb.into(),
        at,
        names,
    )
}

/// Whether `subjects` name the service account `account` of faultline's namespace.
fn names(subjects: &Option<Vec<Subject>>, account: &str) -> bool {
    subjects.iter().flatten().any(|s| {
        s.kind == "ServiceAccount" && s.name == account && s.namespace.as_deref() == Some(NAMESPACE)
    })
}

/// A role: `(kind, namespace for a Role, name)`.
type RoleId = (String, Option<String>, String);

/// Expands rules into grants; problems (wildcards, non-resource URLs) go into `errors`.
fn expand(rules: &[PolicyRule], at: &Where, origin: &str, errors: &mut Vec<String>) -> Vec<Grant> {
    let mut out = Vec::new();
    for r in rules {
        if r.non_resource_urls.is_some() {
            errors.push(format!("{origin}: nonResourceURLs"));
        }
        let groups = r.api_groups.clone().unwrap_or_default();
        let resources = r.resources.clone().unwrap_or_default();
        if groups.is_empty() || resources.is_empty() || r.verbs.is_empty() {
            errors.push(format!(
                "{origin}: a rule without groups, resources or verbs"
            ));
        }
        for g in &groups {
            for res in &resources {
                for v in &r.verbs {
                    if [g, res, v].iter().any(|s| s.contains('*')) {
                        errors.push(format!("{origin}: wildcard in {g:?} {res:?} {v:?}"));
                    }
                    let mut names = r.resource_names.clone().unwrap_or_default();
                    names.sort();
                    out.push((g.clone(), res.clone(), v.clone(), at.clone(), names));
                }
            }
        }
    }
    out
}

/// Everything the service account `account` may do according to `docs`; the roles bound to it go
/// into `used_roles`.
fn granted(
    docs: &[Doc],
    account: &str,
    used_roles: &mut BTreeSet<RoleId>,
    errors: &mut Vec<String>,
) -> Vec<Grant> {
    let cluster_roles: Vec<ClusterRole> = docs
        .iter()
        .filter(|d| d.kind() == "ClusterRole")
        .map(Doc::to)
        .collect();
    let roles: Vec<Role> = docs
        .iter()
        .filter(|d| d.kind() == "Role")
        .map(Doc::to)
        .collect();
    let cluster_role = |name: &str| {
        cluster_roles
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(name))
    };
    let mut out = Vec::new();

    for d in docs.iter().filter(|d| d.kind() == "ClusterRoleBinding") {
        let b: ClusterRoleBinding = d.to();
        if !names(&b.subjects, account) {
            continue;
        }
        let origin = d.at();
        match (b.role_ref.kind.as_str(), cluster_role(&b.role_ref.name)) {
            ("ClusterRole", Some(r)) => {
                used_roles.insert(("ClusterRole".to_string(), None, b.role_ref.name.clone()));
                let rules = r.rules.clone().unwrap_or_default();
                out.extend(expand(&rules, &Where::Cluster, &origin, errors));
            }
            _ => errors.push(format!("{origin}: roleRef {:?} not found", b.role_ref)),
        }
    }
    for d in docs.iter().filter(|d| d.kind() == "RoleBinding") {
        let b: RoleBinding = d.to();
        if !names(&b.subjects, account) {
            continue;
        }
        let origin = d.at();
        let ns = b.metadata.namespace.clone().unwrap_or_default();
        let at = Where::Namespace(ns.clone());
        let rules = match b.role_ref.kind.as_str() {
            "Role" => roles
                .iter()
                .find(|r| {
                    r.metadata.name.as_deref() == Some(&b.role_ref.name)
                        && r.metadata.namespace.as_deref() == Some(&ns)
                })
                .map(|r| {
                    used_roles.insert(("Role".into(), Some(ns.clone()), b.role_ref.name.clone()));
                    r.rules.clone().unwrap_or_default()
                }),
            "ClusterRole" => cluster_role(&b.role_ref.name).map(|r| {
                used_roles.insert(("ClusterRole".into(), None, b.role_ref.name.clone()));
                r.rules.clone().unwrap_or_default()
            }),
            _ => None,
        };
        match rules {
            Some(rules) => out.extend(expand(&rules, &at, &origin, errors)),
            None => errors.push(format!("{origin}: roleRef {:?} not found", b.role_ref)),
        }
    }
    out
}

/// Everything wrong about the RBAC in `docs` against `accounts`: each service account and the
/// table of the calls it makes.
fn problems(docs: &[Doc], accounts: &[(&str, &[ApiCall])]) -> Vec<String> {
    let mut errors = Vec::new();
    let mut used_roles = BTreeSet::new();
    for (account, calls) in accounts {
        let grants: BTreeSet<Grant> = granted(docs, account, &mut used_roles, &mut errors)
            .into_iter()
            .collect();
        let wanted: BTreeSet<Grant> = calls.iter().map(wanted).collect();
        for missing in wanted.difference(&grants) {
            errors.push(format!("{account}: call not allowed: {missing:?}"));
        }
        for extra in grants.difference(&wanted) {
            errors.push(format!("{account}: granted but no call uses it: {extra:?}"));
        }
    }
    // A role bound to none of these accounts is dead weight, or a binding went missing (the
    // requesters' role is for others to bind: `the_requester_role_grants_what_the_coordinator_asks`).
    for d in docs
        .iter()
        .filter(|d| matches!(d.kind(), "Role" | "ClusterRole"))
        .filter(|d| !(d.kind() == "ClusterRole" && d.name() == REQUESTER_ROLE))
    {
        let ns = (d.kind() == "Role").then(|| d.namespace().unwrap_or("").to_string());
        if !used_roles.contains(&(d.kind().to_string(), ns, d.name().to_string())) {
            errors.push(format!(
                "{}: not bound to faultline's service accounts",
                d.at()
            ));
        }
    }
    errors
}

/// The base's accounts and their tables.
const BASE: &[(&str, &[ApiCall])] = &[
    (SERVICE_ACCOUNT, API_CALLS),
    (COORDINATOR_SERVICE_ACCOUNT, COORDINATOR_API_CALLS),
];

/// The ClusterRole operators bind to whoever may request peer checks.
const REQUESTER_ROLE: &str = "faultline-peer-requester";

/// A `pub const NAME: &str = "value";` of the coordinator's requesters module.
fn authz_const(name: &str) -> String {
    let text = std::fs::read_to_string(common::repo_root().join("coordinator/src/requesters.rs"))
        .expect("requesters.rs");
    let at = text
        .find(&format!("pub const {name}: &str = \""))
        .unwrap_or_else(|| panic!("no const {name}"));
    let rest = &text[at..];
    let start = rest.find('"').expect("\"") + 1;
    let end = rest[start..].find('"').expect("\"") + start;
    rest[start..end].to_string()
}

/// The requesters' ClusterRole grants exactly the attribute the coordinator's
/// SubjectAccessReview asks about (peer::authz: verb, group, resource) and the Lease read that
/// finds the coordinator; nothing binds it to the agent.
#[test]
fn the_requester_role_grants_what_the_coordinator_asks() {
    let docs = rbac_docs();
    let role: ClusterRole = common::find(&docs, "ClusterRole", REQUESTER_ROLE).to();
    let mut errors = Vec::new();
    let mut got = expand(
        &role.rules.unwrap_or_default(),
        &Where::Namespace(NAMESPACE.into()),
        REQUESTER_ROLE,
        &mut errors,
    );
    assert!(errors.is_empty(), "{errors:?}");
    got.sort();
    let at = Where::Namespace(NAMESPACE.into());
    let mut want = vec![
        (
            authz_const("REQUEST_GROUP"),
            authz_const("REQUEST_RESOURCE"),
            authz_const("REQUEST_VERB"),
            at.clone(),
            vec![],
        ),
        (
            "coordination.k8s.io".to_string(),
            "leases".to_string(),
            "get".to_string(),
            at,
            vec!["faultline-peercheck".to_string()],
        ),
    ];
    want.sort();
    assert_eq!(got, want);
    for d in docs
        .iter()
        .filter(|d| matches!(d.kind(), "RoleBinding" | "ClusterRoleBinding"))
    {
        assert_ne!(
            d.value["roleRef"]["name"],
            REQUESTER_ROLE,
            "{}: the base binds the requesters' role to no one",
            d.at()
        );
    }
}

fn rbac_docs() -> Vec<Doc> {
    common::base_objects()
        .into_iter()
        .filter(|d| d.api_version() == "rbac.authorization.k8s.io/v1")
        .collect()
}

#[test]
fn rbac_grants_exactly_the_call_table() {
    assert!(!API_CALLS.is_empty() && !COORDINATOR_API_CALLS.is_empty());
    let docs = rbac_docs();
    let errors = problems(&docs, BASE);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Whether `grants` allow `verb` on `group`/`resource` named `name` at `at`.
fn allows(
    grants: &[Grant],
    (group, resource, verb): (&str, &str, &str),
    at: &Where,
    name: &str,
) -> bool {
    grants.iter().any(|(g, r, v, w, n)| {
        g == group
            && r == resource
            && v == verb
            && w == at
            && (n.is_empty() || n.iter().any(|x| x == name))
    })
}

/// The cluster-wide work is the coordinator's alone: an agent's token (every node has one) can
/// neither hold or create the Lease, nor list the members, nor review tokens or access, nor write
/// faultline-peercheck (RBAC grants the agents patch and create on every ConfigMap of the
/// namespace for their own records; the admission policy refuses them faultline-peercheck:
/// admission.rs). The coordinator, in turn, writes no Node, no Event and no agent's record.
#[test]
fn the_agents_cannot_do_the_coordinators_work() {
    let docs = rbac_docs();
    let mut errors = Vec::new();
    let mut used = BTreeSet::new();
    let agent = granted(&docs, SERVICE_ACCOUNT, &mut used, &mut errors);
    let coordinator = granted(&docs, COORDINATOR_SERVICE_ACCOUNT, &mut used, &mut errors);
    assert!(errors.is_empty(), "{errors:?}");
    let ns = Where::Namespace(NAMESPACE.into());
    for verb in ["create", "update", "patch", "delete"] {
        assert!(
            !allows(
                &agent,
                ("coordination.k8s.io", "leases", verb),
                &ns,
                "faultline-peercheck"
            ),
            "the agents may {verb} the Lease"
        );
    }
    for (call, at) in [
        (("", "pods", "list"), &ns),
        (("", "pods", "watch"), &ns),
        (
            ("authentication.k8s.io", "tokenreviews", "create"),
            &Where::Cluster,
        ),
        (
            ("authorization.k8s.io", "subjectaccessreviews", "create"),
            &Where::Cluster,
        ),
    ] {
        assert!(!allows(&agent, call, at, ""), "the agents may {call:?}");
    }
    // Every coordinator call the agent's own table does not list is denied to the agents.
    for c in COORDINATOR_API_CALLS {
        let listed_for_agents = API_CALLS.iter().any(|a| {
            (a.group, a.resource, a.verb) == (c.group, c.resource, c.verb)
                && a.scope == c.scope
                && (a.names.is_empty() || c.names.iter().all(|n| a.names.contains(n)))
        });
        if listed_for_agents {
            continue;
        }
        let (g, r, v, at, names) = wanted(c);
        let name = names.first().cloned().unwrap_or_default();
        assert!(
            !allows(&agent, (&g, &r, &v), &at, &name),
            "the agents may {c:?}"
        );
    }
    for verb in ["patch", "update", "create"] {
        for res in ["nodes", "nodes/status"] {
            assert!(
                !allows(&coordinator, ("", res, verb), &Where::Cluster, "node-a"),
                "the coordinator may {verb} {res}"
            );
        }
    }
    for (verb, cm) in [
        ("patch", "faultline-taint-budget"),
        ("patch", "faultline-node-a"),
        ("update", "faultline-node-a"),
    ] {
        assert!(
            !allows(&coordinator, ("", "configmaps", verb), &ns, cm),
            "the coordinator may {verb} {cm}"
        );
    }
    // The taint ledger is the coordinator's alone.
    assert!(allows(
        &coordinator,
        ("", "configmaps", "update"),
        &ns,
        "faultline-taint-budget"
    ));
    for verb in ["update", "patch"] {
        assert!(
            !allows(
                &agent,
                ("", "configmaps", verb),
                &ns,
                "faultline-taint-budget"
            ) || verb == "patch",
            "the agents may {verb} the taint ledger"
        );
    }
    assert!(
        !coordinator.iter().any(|(g, ..)| g == "events.k8s.io"),
        "the coordinator writes no Event"
    );
}

/// The opt-in MindCluster component grants exactly the calls the public-fault output makes.
#[test]
fn the_mindcluster_component_grants_exactly_its_calls() {
    let docs: Vec<Doc> = common::component_objects("mindcluster")
        .into_iter()
        .filter(|d| d.api_version() == "rbac.authorization.k8s.io/v1")
        .collect();
    assert!(!docs.is_empty());
    let errors = problems(&docs, &[(SERVICE_ACCOUNT, MINDCLUSTER_CALLS)]);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn every_call_in_the_table_has_a_reason() {
    for c in API_CALLS
        .iter()
        .chain(MINDCLUSTER_CALLS)
        .chain(COORDINATOR_API_CALLS)
    {
        assert!(!c.used_by.trim().is_empty(), "{c:?}");
        assert!(c.resource.split('/').count() <= 2, "{c:?}");
    }
}

/// The checker notices each way the RBAC and the table can drift apart.
#[test]
fn the_rbac_check_catches_drift() {
    let docs = rbac_docs();
    let edit = |f: &dyn Fn(&mut Vec<Doc>)| {
        let mut d = docs.clone();
        f(&mut d);
        problems(&d, BASE)
    };
    // The agent's roles (the events Role is the one in `default`).
    let rules_of = |d: &mut Vec<Doc>, kind: &str, ns: &str| -> usize {
        d.iter()
            .position(|x| {
                x.kind() == kind
                    && x.namespace().unwrap_or("") == ns
                    && x.name().starts_with("faultline-agent")
            })
            .expect("the role")
    };
    let coordinator = |d: &mut Vec<Doc>, kind: &str| -> usize {
        d.iter()
            .position(|x| x.kind() == kind && x.name() == "faultline-coordinator")
            .expect("the coordinator's object")
    };

    // A verb no call uses.
    let e = edit(&|d| {
        let i = rules_of(d, "Role", NAMESPACE);
        d[i].value["rules"][0]["verbs"]
            .as_array_mut()
            .expect("verbs")
            .push("delete".into());
    });
    assert!(e.iter().any(|x| x.contains("\"delete\"")), "{e:?}");

    // A name limit dropped: the rule would grant every Lease, not only faultline-peercheck.
    let e = edit(&|d| {
        let i = rules_of(d, "Role", NAMESPACE);
        for rule in d[i].value["rules"].as_array_mut().expect("rules") {
            if let Some(r) = rule.as_object_mut() {
                r.remove("resourceNames");
            }
        }
    });
    assert!(
        e.iter().any(|x| x.contains("granted but no call uses it")
            && x.contains("leases")
            && x.contains("[]")),
        "{e:?}"
    );
    // The same in the coordinator's Role: the taint ledger's rule would grant every ConfigMap.
    let e = edit(&|d| {
        let i = coordinator(d, "Role");
        for rule in d[i].value["rules"].as_array_mut().expect("rules") {
            if let Some(r) = rule.as_object_mut() {
                r.remove("resourceNames");
            }
        }
    });
    assert!(
        e.iter()
            .any(|x| x.contains("call not allowed") && x.contains("faultline-taint-budget")),
        "{e:?}"
    );

    // A call the RBAC does not allow.
    let e = edit(&|d| {
        let i = rules_of(d, "ClusterRole", "");
        d[i].value["rules"] =
            serde_json::json!([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]);
    });
    assert!(
        e.iter()
            .any(|x| x.contains("call not allowed") && x.contains("nodes/status")),
        "{e:?}"
    );

    // The right permission in the wrong scope.
    let e = edit(&|d| {
        let i = rules_of(d, "Role", "default");
        d[i].value["metadata"]["namespace"] = NAMESPACE.into();
        let j = d
            .iter()
            .position(|x| x.kind() == "RoleBinding" && x.namespace() == Some("default"))
            .expect("events binding");
        d[j].value["metadata"]["namespace"] = NAMESPACE.into();
    });
    assert!(
        e.iter()
            .any(|x| x.contains("call not allowed") && x.contains("events")),
        "{e:?}"
    );

    // A wildcard.
    let e = edit(&|d| {
        let i = rules_of(d, "ClusterRole", "");
        d[i].value["rules"][0]["verbs"] = serde_json::json!(["*"]);
    });
    assert!(e.iter().any(|x| x.contains("wildcard")), "{e:?}");

    // A binding to someone else grants the agent nothing.
    let e = edit(&|d| {
        for x in d.iter_mut().filter(|x| x.kind() == "ClusterRoleBinding") {
            x.value["subjects"][0]["name"] = "other".into();
        }
    });
    assert!(e.iter().any(|x| x.contains("not bound")), "{e:?}");

    // A row added to the table without RBAC.
    let mut more = API_CALLS.to_vec();
    more.push(ApiCall {
        group: "coordination.k8s.io",
        resource: "leases",
        verb: "delete",
        scope: Scope::AgentNamespace,
        names: &[],
        used_by: "test",
    });
    let e = problems(
        &docs,
        &[
            (SERVICE_ACCOUNT, &more),
            (COORDINATOR_SERVICE_ACCOUNT, COORDINATOR_API_CALLS),
        ],
    );
    assert!(
        e.iter()
            .any(|x| x.contains("leases") && x.contains("delete")),
        "{e:?}"
    );

    // The coordinator's Role bound to the agents too: they could hold the Lease.
    let e = edit(&|d| {
        let i = coordinator(d, "RoleBinding");
        d[i].value["subjects"]
            .as_array_mut()
            .expect("subjects")
            .push(serde_json::json!({"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}));
    });
    assert!(
        e.iter()
            .any(|x| x.starts_with("faultline: granted but no call uses it")
                && x.contains("leases")
                && x.contains("\"create\"")),
        "{e:?}"
    );

    // The coordinator's binding gone: its calls are refused and its Role bound to no one.
    let e = edit(&|d| {
        let i = coordinator(d, "RoleBinding");
        d.remove(i);
    });
    assert!(
        e.iter()
            .any(|x| x.starts_with("faultline-coordinator: call not allowed") && x.contains("pods")),
        "{e:?}"
    );
    assert!(e.iter().any(|x| x.contains("not bound")), "{e:?}");

    // A name limit of the coordinator's dropped: it could patch every ConfigMap.
    let e = edit(&|d| {
        let i = coordinator(d, "Role");
        for rule in d[i].value["rules"].as_array_mut().expect("rules") {
            if rule["resources"][0] == "configmaps" {
                rule.as_object_mut().expect("rule").remove("resourceNames");
            }
        }
    });
    assert!(
        e.iter().any(
            |x| x.starts_with("faultline-coordinator: granted but no call uses it")
                && x.contains("configmaps")
                && x.contains("\"patch\"")
                && x.contains("[]")
        ),
        "{e:?}"
    );

    // A coordinator row without RBAC.
    let mut more = COORDINATOR_API_CALLS.to_vec();
    more.push(ApiCall {
        group: "",
        resource: "pods",
        verb: "watch",
        scope: Scope::AgentNamespace,
        names: &[],
        used_by: "test",
    });
    let e = problems(
        &docs,
        &[
            (SERVICE_ACCOUNT, API_CALLS),
            (COORDINATOR_SERVICE_ACCOUNT, &more),
        ],
    );
    assert!(
        e.iter()
            .any(|x| x.starts_with("faultline-coordinator: call not allowed")
                && x.contains("\"watch\"")),
        "{e:?}"
    );
}
