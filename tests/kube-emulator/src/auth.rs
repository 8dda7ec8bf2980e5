//! Optional token authentication and RBAC-style authorization.
//!
//! Off until [`crate::Emulator::authorize`] is called for some token. Then an
//! unknown bearer token is answered 401, a request without one runs as
//! `system:anonymous`, and resource requests must be allowed by one of the
//! token's rules (403 otherwise). Members of `system:masters` may do anything.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// The audience of the emulated API server: tokens without explicit audiences have it, and only
/// tokens that have it authenticate requests to the API itself.
pub const API_AUDIENCE: &str = "https://kubernetes.default.svc.cluster.local";

/// The identity a token authenticates as.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserInfo {
    pub username: String,
    #[serde(default)]
    pub groups: Vec<String>,
    #[serde(default)]
    pub extra: BTreeMap<String, Vec<String>>,
}

impl UserInfo {
    /// A user with no groups.
    pub fn new(username: &str) -> Self {
        UserInfo {
            username: username.to_string(),
            groups: Vec::new(),
            extra: BTreeMap::new(),
        }
    }

    /// The service account `system:serviceaccount:{namespace}:{name}` with its usual groups.
    pub fn service_account(namespace: &str, name: &str) -> Self {
        UserInfo {
            username: format!("system:serviceaccount:{namespace}:{name}"),
            groups: vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".into(),
            ],
            extra: BTreeMap::new(),
        }
    }

    /// Adds groups.
    pub fn with_groups(mut self, groups: &[&str]) -> Self {
        self.groups.extend(groups.iter().map(|g| g.to_string()));
        self
    }
}

/// One RBAC policy rule, bound cluster-wide (`namespace: None`, like a
/// ClusterRoleBinding) or in one namespace (like a RoleBinding).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection` or `*`.
    pub verbs: Vec<String>,
    /// `""` for core, `events.k8s.io`, ... or `*`.
    pub api_groups: Vec<String>,
    /// `nodes`, `nodes/status`, `*/status` or `*`.
    pub resources: Vec<String>,
    /// Empty: any name.
    #[serde(default)]
    pub resource_names: Vec<String>,
    /// `None`: every namespace and cluster-scoped resources; `Some(ns)`: only that namespace.
    #[serde(default)]
    pub namespace: Option<String>,
}

impl Rule {
    /// A cluster-wide rule.
    pub fn new(verbs: &[&str], api_groups: &[&str], resources: &[&str]) -> Self {
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect();
        Rule {
            verbs: v(verbs),
            api_groups: v(api_groups),
            resources: v(resources),
            resource_names: Vec::new(),
            namespace: None,
        }
    }

    /// Restricts the rule to these object names.
    pub fn names(mut self, names: &[&str]) -> Self {
        self.resource_names = names.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Restricts the rule to one namespace.
    pub fn in_namespace(mut self, namespace: &str) -> Self {
        self.namespace = Some(namespace.to_string());
        self
    }
}

/// A token's identity and rules.
#[derive(Debug, Clone)]
pub(crate) struct Grant {
    pub user: UserInfo,
    pub rules: Vec<Rule>,
    /// The token's audiences; empty: the API server's ([`API_AUDIENCE`]).
    pub audiences: Vec<String>,
}

impl Grant {
    /// The token's audiences, the API server's when none were given.
    pub fn token_audiences(&self) -> Vec<String> {
        if self.audiences.is_empty() {
            vec![API_AUDIENCE.to_string()]
        } else {
            self.audiences.clone()
        }
    }
}

/// What a resource request asks to do.
#[derive(Debug)]
pub(crate) struct Attributes<'a> {
    pub verb: &'a str,
    pub group: &'a str,
    pub resource: &'a str,
    pub subresource: Option<&'a str>,
    pub namespace: Option<&'a str>,
    pub name: Option<&'a str>,
}

fn rule_allows(rule: &Rule, a: &Attributes<'_>) -> bool {
    let any = |xs: &[String], x: &str| xs.iter().any(|v| v == "*" || v == x);
    if !any(&rule.verbs, a.verb) || !any(&rule.api_groups, a.group) {
        return false;
    }
    let resource_ok = rule.resources.iter().any(|r| match a.subresource {
        None => r == "*" || r == a.resource,
        Some(sub) => r == "*" || *r == format!("{}/{sub}", a.resource) || *r == format!("*/{sub}"),
    });
    if !resource_ok {
        return false;
    }
    if !rule.resource_names.is_empty() {
        match a.name {
            Some(n) if !n.is_empty() => {
                if !rule.resource_names.iter().any(|r| r == n) {
                    return false;
                }
            }
            _ => return false,
        }
    }
    match &rule.namespace {
        None => true,
        Some(ns) => a.namespace == Some(ns.as_str()),
    }
}

/// Whether the grant allows the request.
pub(crate) fn allowed(grant: &Grant, a: &Attributes<'_>) -> bool {
    grant.user.groups.iter().any(|g| g == "system:masters")
        || grant.rules.iter().any(|r| rule_allows(r, a))
}

/// The request allowed, or the 403 RBAC would answer.
pub(crate) fn authorize(grant: &Grant, a: &Attributes<'_>) -> Result<(), ApiError> {
    if allowed(grant, a) {
        Ok(())
    } else {
        Err(forbidden(&grant.user, a))
    }
}

/// The 403 answer, worded like the RBAC authorizer's.
pub(crate) fn forbidden(user: &UserInfo, a: &Attributes<'_>) -> ApiError {
    let qualified = if a.group.is_empty() {
        a.resource.to_string()
    } else {
        format!("{}.{}", a.resource, a.group)
    };
    let subject = match a.name {
        Some(n) if !n.is_empty() => format!("{qualified} \"{n}\""),
        _ => qualified,
    };
    let resource = match a.subresource {
        Some(s) => format!("{}/{s}", a.resource),
        None => a.resource.to_string(),
    };
    let scope = match a.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_string(),
    };
    let message = format!(
        "{subject} is forbidden: User \"{}\" cannot {} resource \"{resource}\" in API group \"{}\" {scope}",
        user.username, a.verb, a.group
    );
    let mut d = Map::new();
    if let Some(n) = a.name.filter(|n| !n.is_empty()) {
        d.insert("name".into(), json!(n));
    }
    if !a.group.is_empty() {
        d.insert("group".into(), json!(a.group));
    }
    d.insert("kind".into(), json!(a.resource));
    ApiError::forbidden(message, Value::Object(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_match_like_rbac() {
        let grant = Grant {
            user: UserInfo::new("agent"),
            rules: vec![
                Rule::new(&["get", "patch"], &[""], &["nodes", "nodes/status"]).names(&["n1"]),
                Rule::new(&["create"], &["events.k8s.io"], &["events"]).in_namespace("default"),
            ],
            audiences: Vec::new(),
        };
        let a = |verb, group, resource, sub, ns, name| Attributes {
            verb,
            group,
            resource,
            subresource: sub,
            namespace: ns,
            name,
        };
        assert!(allowed(
            &grant,
            &a("patch", "", "nodes", Some("status"), None, Some("n1"))
        ));
        assert!(!allowed(
            &grant,
            &a("patch", "", "nodes", Some("status"), None, Some("n2"))
        ));
        assert!(!allowed(&grant, &a("list", "", "nodes", None, None, None)));
        assert!(allowed(
            &grant,
            &a(
                "create",
                "events.k8s.io",
                "events",
                None,
                Some("default"),
                None
            )
        ));
        assert!(!allowed(
            &grant,
            &a(
                "create",
                "events.k8s.io",
                "events",
                None,
                Some("other"),
                None
            )
        ));
        let e = forbidden(&grant.user, &a("list", "", "nodes", None, None, None));
        assert_eq!(
            e.message,
            "nodes is forbidden: User \"agent\" cannot list resource \"nodes\" in API group \"\" at the cluster scope"
        );
    }
}
