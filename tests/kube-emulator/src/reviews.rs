//! The two review APIs a workload uses to check a caller's identity: TokenReview
//! (`POST /apis/authentication.k8s.io/v1/tokenreviews`) and SubjectAccessReview
//! (`POST /apis/authorization.k8s.io/v1/subjectaccessreviews`). Neither is stored: the answer
//! is the object sent, with `status` filled in, `201 Created`.
//!
//! As the Kubernetes API reference describes them:
//! - TokenReview (<https://kubernetes.io/docs/reference/kubernetes-api/authentication-resources/token-review-v1/>):
//!   `spec.token` is an opaque bearer token; `spec.audiences` the identifiers the resource
//!   server accepts (none: the API server's). `status.authenticated` says whether the token is
//!   a known user's, for at least one of those audiences; `status.user` (username, groups,
//!   extra) who; `status.audiences` the intersection of the spec's and the token's audiences;
//!   `status.error` why not. An unknown token, or one for other audiences, is `authenticated:
//!   false` with the error: a `201`, not a `401` (the caller was authenticated; the token in the
//!   body was not).
//! - SubjectAccessReview (<https://kubernetes.io/docs/reference/kubernetes-api/definitions/subject-access-review-v1-authorization/>):
//!   `spec.user`/`spec.groups` and exactly one of `resourceAttributes` (namespace, verb, group,
//!   resource, subresource, name) and `nonResourceAttributes`; `status.allowed` is true when
//!   the rules granted to that user (here: every token's grant with that username) allow it,
//!   and `status.reason` says by what. Members of `system:masters` may do anything.
//!
//! Creating either review is itself a request the caller must be allowed (`create` on
//! `tokenreviews` / `subjectaccessreviews`, cluster scope), as RBAC checks it.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::auth::{self, Attributes, Grant, UserInfo};
use crate::error::{ApiError, Cause};

pub(crate) const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";
pub(crate) const ACCESS_REVIEWS: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn check_kind(body: &Value, kind: &str, api_version: &str) -> Result<(), ApiError> {
    for (field, want) in [("kind", kind), ("apiVersion", api_version)] {
        match body.get(field).and_then(Value::as_str) {
            None | Some("") => {}
            Some(v) if v == want => {}
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "{field} {v:?} does not match the path ({want})"
                )))
            }
        }
    }
    Ok(())
}

/// The caller may create this review (cluster scope), as RBAC decides.
fn may_create(grant: Option<&Grant>, group: &str, resource: &str) -> Result<(), ApiError> {
    match grant {
        None => Ok(()), // authorization off
        Some(g) => auth::authorize(
            g,
            &Attributes {
                verb: "create",
                group,
                resource,
                subresource: None,
                namespace: None,
                name: None,
            },
        ),
    }
}

/// `POST .../tokenreviews`: the review with its status.
pub(crate) fn token_review(
    grants: &BTreeMap<String, Grant>,
    caller: Option<&Grant>,
    body: &Value,
) -> Result<Value, ApiError> {
    may_create(caller, "authentication.k8s.io", "tokenreviews")?;
    check_kind(body, "TokenReview", "authentication.k8s.io/v1")?;
    let spec = &body["spec"];
    let token = spec["token"].as_str().unwrap_or("");
    let mut wanted = strings(&spec["audiences"]);
    if wanted.is_empty() {
        wanted.push(crate::auth::API_AUDIENCE.to_string());
    }
    let status = match grants.get(token).filter(|_| !token.is_empty()) {
        None => json!({"authenticated": false, "error": "[invalid bearer token]"}),
        Some(g) => {
            let common: Vec<String> = g
                .token_audiences()
                .into_iter()
                .filter(|a| wanted.contains(a))
                .collect();
            if common.is_empty() {
                json!({
                    "authenticated": false,
                    "error": format!(
                        "[invalid bearer token, token audiences {:?} is invalid for the target audiences {:?}]",
                        g.token_audiences(), wanted
                    ),
                })
            } else {
                json!({
                    "authenticated": true,
                    "user": user_json(&g.user),
                    "audiences": common,
                })
            }
        }
    };
    Ok(answer(
        body,
        "TokenReview",
        "authentication.k8s.io/v1",
        status,
    ))
}

fn user_json(u: &UserInfo) -> Value {
    let mut v = json!({"username": u.username, "groups": u.groups});
    if !u.extra.is_empty() {
        v["extra"] = json!(u.extra);
    }
    v
}

fn answer(body: &Value, kind: &str, api_version: &str, status: Value) -> Value {
    let mut out = body.clone();
    out["kind"] = json!(kind);
    out["apiVersion"] = json!(api_version);
    out["metadata"] = json!({"creationTimestamp": null});
    out["status"] = status;
    out
}

/// `POST .../subjectaccessreviews`: the review with its status.
pub(crate) fn access_review(
    grants: &BTreeMap<String, Grant>,
    caller: Option<&Grant>,
    body: &Value,
) -> Result<Value, ApiError> {
    may_create(caller, "authorization.k8s.io", "subjectaccessreviews")?;
    check_kind(body, "SubjectAccessReview", "authorization.k8s.io/v1")?;
    let spec = &body["spec"];
    let user = spec["user"].as_str().unwrap_or("");
    let groups = strings(&spec["groups"]);
    let ra = spec.get("resourceAttributes").filter(|v| v.is_object());
    let nra = spec.get("nonResourceAttributes").filter(|v| v.is_object());
    let invalid = |field: &str, detail: &str| {
        ApiError::invalid_kind(
            "SubjectAccessReview.authorization.k8s.io",
            "authorization.k8s.io",
            "SubjectAccessReview",
            "",
            vec![Cause::invalid(field, &Value::Null, detail)],
        )
    };
    if ra.is_some() == nra.is_some() {
        return Err(invalid(
            "spec.resourceAttributes",
            "exactly one of nonResourceAttributes or resourceAttributes must be specified",
        ));
    }
    if user.is_empty() && groups.is_empty() {
        return Err(invalid(
            "spec.user",
            "at least one of user or group must be specified",
        ));
    }
    let masters = groups.iter().any(|g| g == "system:masters");
    let status = match ra {
        // Non-resource URLs: no rule here grants any.
        None => json!({"allowed": masters}),
        Some(ra) => {
            let s = |k: &str| ra[k].as_str().unwrap_or("");
            let (ns, name, sub) = (s("namespace"), s("name"), s("subresource"));
            let attrs = Attributes {
                verb: s("verb"),
                group: s("group"),
                resource: s("resource"),
                subresource: (!sub.is_empty()).then_some(sub),
                namespace: (!ns.is_empty()).then_some(ns),
                name: (!name.is_empty()).then_some(name),
            };
            let by = grants
                .values()
                .filter(|g| g.user.username == user)
                .any(|g| auth::allowed(g, &attrs));
            if masters || by {
                json!({"allowed": true, "reason": format!("RBAC: allowed for user {user:?}")})
            } else {
                json!({"allowed": false})
            }
        }
    };
    Ok(answer(
        body,
        "SubjectAccessReview",
        "authorization.k8s.io/v1",
        status,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Rule;

    fn grants() -> BTreeMap<String, Grant> {
        let mut g = BTreeMap::new();
        g.insert(
            "agent".to_string(),
            Grant {
                user: UserInfo::service_account("fs", "faultline"),
                rules: vec![Rule::new(
                    &["create"],
                    &["authentication.k8s.io", "authorization.k8s.io"],
                    &["tokenreviews", "subjectaccessreviews"],
                )],
                audiences: Vec::new(),
            },
        );
        g.insert(
            "job".to_string(),
            Grant {
                user: UserInfo::service_account("jobs", "launcher"),
                rules: vec![
                    Rule::new(&["create"], &["faultline.io"], &["peerchecks"]).in_namespace("fs")
                ],
                audiences: vec!["faultline-peercheck".into()],
            },
        );
        g
    }

    #[test]
    fn token_reviews_say_who_for_which_audience() {
        let g = grants();
        let agent = g.get("agent");
        let review = |token: &str, aud: &[&str]| {
            token_review(
                &g,
                agent,
                &json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                        "spec": {"token": token, "audiences": aud}}),
            )
            .unwrap()["status"]
                .clone()
        };
        let s = review("job", &["faultline-peercheck"]);
        assert_eq!(s["authenticated"], true);
        assert_eq!(s["user"]["username"], "system:serviceaccount:jobs:launcher");
        assert_eq!(s["audiences"], json!(["faultline-peercheck"]));
        // For the API server's audience (none asked), the audience-bound token is not valid.
        let s = review("job", &[]);
        assert_eq!(s["authenticated"], false);
        assert!(s["error"]
            .as_str()
            .unwrap()
            .contains("invalid for the target audiences"));
        let s = review("nope", &["faultline-peercheck"]);
        assert_eq!(s["authenticated"], false);
        assert_eq!(s["error"], "[invalid bearer token]");
        // The caller itself needs create on tokenreviews.
        let e = token_review(&g, g.get("job"), &json!({"spec": {"token": "agent"}})).unwrap_err();
        assert_eq!(e.code, 403);
    }

    #[test]
    fn access_reviews_apply_the_users_rules() {
        let g = grants();
        let agent = g.get("agent");
        let review = |user: &str, ns: &str, verb: &str| {
            access_review(
                &g,
                agent,
                &json!({"spec": {"user": user, "resourceAttributes": {
                    "namespace": ns, "verb": verb, "group": "faultline.io", "resource": "peerchecks"}}}),
            )
            .unwrap()["status"]["allowed"]
                .clone()
        };
        assert_eq!(
            review("system:serviceaccount:jobs:launcher", "fs", "create"),
            true
        );
        assert_eq!(
            review("system:serviceaccount:jobs:launcher", "other", "create"),
            false
        );
        assert_eq!(
            review("system:serviceaccount:jobs:launcher", "fs", "delete"),
            false
        );
        assert_eq!(
            review("system:serviceaccount:fs:faultline", "fs", "create"),
            false
        );
        let e = access_review(&g, agent, &json!({"spec": {"user": "x"}})).unwrap_err();
        assert_eq!(e.code, 422);
        let e = access_review(
            &g,
            agent,
            &json!({"spec": {"resourceAttributes": {"verb": "get"}}}),
        )
        .unwrap_err();
        assert_eq!(e.code, 422);
        let e = access_review(&g, g.get("job"), &json!({"spec": {}})).unwrap_err();
        assert_eq!(e.code, 403);
    }
}
