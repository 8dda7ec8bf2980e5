//! The RBAC manifests grant exactly the calls in the agent's table `API_CALLS`
//! (`agent/src/sink/kube/calls.rs`): every call is allowed with the right scope, and every
//! permission granted is used by some call.

use std::collections::BTreeSet;

use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, Subject,
};

use crate::calls::{ApiCall, Scope, API_CALLS, MINDCLUSTER_CALLS};
use crate::common::{self, Doc, NAMESPACE, SERVICE_ACCOUNT};

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

fn is_agent(subjects: &Option<Vec<Subject>>) -> bool {
    subjects.iter().flatten().any(|s| {
        s.kind == "ServiceAccount"
            && s.name == SERVICE_ACCOUNT
            && s.namespace.as_deref() == Some(NAMESPACE)
    })
}

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

/// Everything the agent's service account may do according to `docs`.
fn granted(docs: &[Doc], errors: &mut Vec<String>) -> Vec<Grant> {
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
    let mut used_roles = BTreeSet::new();
    let mut out = Vec::new();

    for d in docs.iter().filter(|d| d.kind() == "ClusterRoleBinding") {
        let b: ClusterRoleBinding = d.to();
        if !is_agent(&b.subjects) {
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
        if !is_agent(&b.subjects) {
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
    // A role nothing binds to the agent is dead weight, or a binding went missing (the
    // requesters' role is for others to bind: `the_requester_role_grants_what_the_coordinator_asks`).
    for d in docs
        .iter()
        .filter(|d| matches!(d.kind(), "Role" | "ClusterRole"))
        .filter(|d| !(d.kind() == "ClusterRole" && d.name() == REQUESTER_ROLE))
    {
        let ns = (d.kind() == "Role").then(|| d.namespace().unwrap_or("").to_string());
        if !used_roles.contains(&(d.kind().to_string(), ns, d.name().to_string())) {
            errors.push(format!(
                "{}: not bound to the agent's service account",
                d.at()
            ));
        }
    }
    out
}

/// Everything wrong about the RBAC in `docs` against `calls`.
fn problems(docs: &[Doc], calls: &[ApiCall]) -> Vec<String> {
    let mut errors = Vec::new();
    let grants: BTreeSet<Grant> = granted(docs, &mut errors).into_iter().collect();
    let wanted: BTreeSet<Grant> = calls.iter().map(wanted).collect();
    for missing in wanted.difference(&grants) {
        errors.push(format!("call not allowed: {missing:?}"));
    }
    for extra in grants.difference(&wanted) {
        errors.push(format!("granted but no call uses it: {extra:?}"));
    }
    errors
}

/// The ClusterRole operators bind to whoever may request peer checks.
const REQUESTER_ROLE: &str = "faultline-peer-requester";

/// A `pub const NAME: &str = "value";` of the agent's peer::authz.
fn authz_const(name: &str) -> String {
    let text = std::fs::read_to_string(common::repo_root().join("agent/src/peer/authz.rs"))
        .expect("authz.rs");
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
    assert!(!API_CALLS.is_empty());
    let docs = rbac_docs();
    let errors = problems(&docs, API_CALLS);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// The opt-in MindCluster component grants exactly the calls the MindCluster output makes.
#[test]
fn the_mindcluster_component_grants_exactly_its_calls() {
    let docs: Vec<Doc> = common::component_objects("mindcluster")
        .into_iter()
        .filter(|d| d.api_version() == "rbac.authorization.k8s.io/v1")
        .collect();
    assert!(!docs.is_empty());
    let errors = problems(&docs, MINDCLUSTER_CALLS);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn every_call_in_the_table_has_a_reason() {
    for c in API_CALLS.iter().chain(MINDCLUSTER_CALLS) {
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
        problems(&d, API_CALLS)
    };
    let rules_of = |d: &mut Vec<Doc>, kind: &str, ns: &str| -> usize {
        d.iter()
            .position(|x| x.kind() == kind && x.namespace().unwrap_or("") == ns)
            .expect("the role")
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
    let e = problems(&docs, &more);
    assert!(
        e.iter()
            .any(|x| x.contains("leases") && x.contains("delete")),
        "{e:?}"
    );
}
