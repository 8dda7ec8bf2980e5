//! Request routing and the REST verbs: URL parsing, verb mapping,
//! authorization, discovery documents, and dispatch into the store.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use serde_json::{json, Value};

use crate::auth::{self, Attributes};
use crate::error::{ApiError, Cause};
use crate::resources::{self, ResourceId, RESOURCES};
use crate::response::{error_response, json_response, Body};
use crate::selectors::{FieldSelector, LabelSelector};
use crate::store::{PatchType, WriteOpts};
use crate::util::{percent_decode_path, Query};
use crate::watch::{self, WatchSpec};
use crate::{lock, Inner};

/// What the server layer hands to [`serve`].
#[derive(Debug)]
pub(crate) struct RequestCtx<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: &'a Query,
    pub content_type: Option<&'a str>,
    pub token: Option<&'a str>,
    pub user_agent: Option<&'a str>,
    /// The `Accept` header: `...;as=PartialObjectMetadataList` asks for metadata only.
    pub accept: Option<&'a str>,
    pub body: Bytes,
}

/// A request for a resource or one of its objects.
#[derive(Debug, Clone)]
struct ResourceReq {
    rid: ResourceId,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
    watch_path: bool,
}

#[derive(Debug)]
enum Route {
    Root,
    Version,
    Health,
    ApiVersions,
    ApiGroupList,
    ApiGroup(&'static str),
    ResourceList(&'static str, &'static str),
    Resource(ResourceReq),
    NotFound,
}

fn parse_route(path: &str) -> Route {
    let segs: Vec<String> = path
        .split('/')
        .filter(|s| !s.is_empty())
        .map(percent_decode_path)
        .collect();
    let s: Vec<&str> = segs.iter().map(String::as_str).collect();
    match s.as_slice() {
        [] => Route::Root,
        ["version"] => Route::Version,
        ["healthz" | "livez" | "readyz", ..] => Route::Health,
        ["api"] => Route::ApiVersions,
        ["api", "v1"] => Route::ResourceList("", "v1"),
        ["api", "v1", rest @ ..] => resource_route("", "v1", rest),
        ["apis"] => Route::ApiGroupList,
        ["apis", g] => match resources::groups().into_iter().find(|x| x == g) {
            Some(g) => Route::ApiGroup(g),
            None => Route::NotFound,
        },
        ["apis", g, v] => match RESOURCES.iter().find(|r| r.group == *g && r.version == *v) {
            Some(r) => Route::ResourceList(r.group, r.version),
            None => Route::NotFound,
        },
        ["apis", g, v, rest @ ..] => resource_route(g, v, rest),
        _ => Route::NotFound,
    }
}

fn resource_route(group: &str, version: &str, rest: &[&str]) -> Route {
    let (watch_path, rest) = match rest.split_first() {
        Some((&"watch", r)) => (true, r),
        _ => (false, rest),
    };
    let make = |res: &str, ns: Option<&str>, name: Option<&str>, sub: Option<&str>| {
        let Some(rid) = resources::find(group, version, res) else {
            return Route::NotFound;
        };
        let rt = resources::get(rid);
        if ns.is_some() && !rt.namespaced {
            return Route::NotFound;
        }
        if ns.is_none() && name.is_some() && rt.namespaced {
            return Route::NotFound;
        }
        if let Some(sub) = sub {
            if sub != "status" || !rt.status_subresource {
                return Route::NotFound;
            }
        }
        Route::Resource(ResourceReq {
            rid,
            namespace: ns.map(str::to_string),
            name: name.map(str::to_string),
            subresource: sub.map(str::to_string),
            watch_path,
        })
    };
    match rest {
        ["namespaces", ns, "status"] if group.is_empty() => {
            make("namespaces", None, Some(ns), Some("status"))
        }
        ["namespaces", ns, res] => make(res, Some(ns), None, None),
        ["namespaces", ns, res, name] => make(res, Some(ns), Some(name), None),
        ["namespaces", ns, res, name, sub] => make(res, Some(ns), Some(name), Some(sub)),
        [res] => make(res, None, None, None),
        [res, name] => make(res, None, Some(name), None),
        [res, name, sub] => make(res, None, Some(name), Some(sub)),
        _ => Route::NotFound,
    }
}

/// Handles one (non-control) request; the body has been read.
pub(crate) fn serve(inner: &Arc<Inner>, r: &RequestCtx<'_>) -> Response<Body> {
    let grant = match inner.authenticate(r.token) {
        Ok(g) => g,
        Err(e) => return error_response(&e),
    };
    if r.path == crate::reviews::TOKEN_REVIEWS || r.path == crate::reviews::ACCESS_REVIEWS {
        return serve_review(inner, r, grant.as_ref());
    }
    let route = parse_route(r.path);
    let req = match route {
        Route::Resource(req) => req,
        Route::NotFound => return error_response(&ApiError::path_not_found()),
        other => {
            if r.method != "GET" {
                return error_response(&ApiError::method_not_allowed(r.method));
            }
            if let Route::Health = other {
                let mut resp = Response::new(crate::response::full("ok"));
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                return resp;
            }
            return json_response(200, &discovery(inner, &other));
        }
    };
    match serve_resource(inner, r, &req, grant.as_ref()) {
        Ok(resp) => resp,
        Err(e) => error_response(&e),
    }
}

/// TokenReview and SubjectAccessReview: computed, never stored (`reviews`).
fn serve_review(
    inner: &Arc<Inner>,
    r: &RequestCtx<'_>,
    grant: Option<&auth::Grant>,
) -> Response<Body> {
    if r.method != "POST" {
        return error_response(&ApiError::method_not_allowed(r.method));
    }
    let result = parse_body(r).and_then(|body| {
        let grants = inner.grants_snapshot();
        if r.path == crate::reviews::TOKEN_REVIEWS {
            crate::reviews::token_review(&grants, grant, &body)
        } else {
            crate::reviews::access_review(&grants, grant, &body)
        }
    });
    match result {
        Ok(v) => json_response(201, &v),
        Err(e) => error_response(&e),
    }
}

fn verb_for(method: &str, named: bool, watch: bool) -> Option<&'static str> {
    Some(match (method, named) {
        ("GET", true) => {
            if watch {
                "watch"
            } else {
                "get"
            }
        }
        ("GET", false) => {
            if watch {
                "watch"
            } else {
                "list"
            }
        }
        ("POST", false) => "create",
        ("PUT", true) => "update",
        ("PATCH", true) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => return None,
    })
}

fn selectors(q: &Query, rid: ResourceId) -> Result<(LabelSelector, FieldSelector), ApiError> {
    let rt = resources::get(rid);
    let label = LabelSelector::parse(q.get("labelSelector").unwrap_or(""))
        .map_err(ApiError::bad_request)?;
    let field = FieldSelector::parse(q.get("fieldSelector").unwrap_or(""), rt.kind, rt.group)
        .map_err(ApiError::bad_request)?;
    Ok((label, field))
}

fn write_opts(r: &RequestCtx<'_>) -> Result<WriteOpts, ApiError> {
    let q = r.query;
    let explicit = q.get("fieldManager").filter(|m| !m.is_empty());
    if let Some(m) = explicit {
        if m.len() > 128 || m.chars().any(char::is_control) {
            return Err(ApiError::invalid_kind(
                "PatchOptions.meta.k8s.io",
                "meta.k8s.io",
                "PatchOptions",
                "",
                vec![Cause::invalid(
                    "fieldManager",
                    &json!(m),
                    "must be at most 128 printable characters",
                )],
            ));
        }
    }
    let manager = match explicit {
        Some(m) => m.to_string(),
        None => r
            .user_agent
            .and_then(|ua| ua.split('/').next())
            .filter(|p| !p.is_empty())
            .unwrap_or("unknown")
            .to_string(),
    };
    let dry_run = q.get_all("dryRun").contains(&"All");
    if let Some(v) = q.get_all("dryRun").iter().find(|v| **v != "All") {
        return Err(ApiError::bad_request(format!(
            "dryRun: Unsupported value: \"{v}\": supported values: \"All\""
        )));
    }
    Ok(WriteOpts {
        manager,
        explicit_manager: explicit.is_some(),
        force: q.get("force").map(|_| q.flag("force")),
        dry_run,
    })
}

/// Parses a POST/PUT body (JSON, or YAML when declared).
fn parse_body(r: &RequestCtx<'_>) -> Result<Value, ApiError> {
    let ct = r
        .content_type
        .unwrap_or("application/json")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let v: Value = match ct.as_str() {
        "application/json" | "" | "*/*" => serde_json::from_slice(&r.body).map_err(|e| {
            ApiError::bad_request(format!(
                "the object provided is unrecognized: error decoding JSON: {e}"
            ))
        })?,
        "application/yaml" | "application/x-yaml" | "text/yaml" => {
            serde_saphyr::from_slice(&r.body)
                .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?
        }
        other => return Err(ApiError::unsupported_media_type(other)),
    };
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the object provided is unrecognized: expected a JSON object",
        ));
    }
    Ok(v)
}

fn list_response(rid: ResourceId, items: Vec<Value>, rv: u64) -> Value {
    let rt = resources::get(rid);
    json!({
        "apiVersion": rt.api_version(),
        "kind": rt.list_kind(),
        "metadata": {"resourceVersion": rv.to_string()},
        "items": items,
    })
}

fn serve_resource(
    inner: &Arc<Inner>,
    r: &RequestCtx<'_>,
    req: &ResourceReq,
    grant: Option<&auth::Grant>,
) -> Result<Response<Body>, ApiError> {
    let rt = resources::get(req.rid);
    let q = r.query;
    let watch = req.watch_path || q.flag("watch");
    let verb = verb_for(r.method, req.name.is_some(), watch)
        .ok_or_else(|| ApiError::method_not_allowed(r.method))?;
    if req.subresource.is_some() && !matches!(verb, "get" | "update" | "patch") {
        return Err(ApiError::method_not_allowed(r.method));
    }
    // For a cluster-scoped resource the namespace is meaningless; for a namespaced
    // resource reached without one (all-namespace list), it is None.
    let ns = req.namespace.as_deref();
    if let Some(g) = grant {
        // List and watch pinned to one name by `metadata.name=` are authorized for that name.
        let pinned = if matches!(verb, "list" | "watch") {
            selectors(q, req.rid)?.1.pinned_name().map(str::to_string)
        } else {
            None
        };
        let name = req.name.as_deref().or(pinned.as_deref());
        let attrs = Attributes {
            verb,
            group: rt.group,
            resource: rt.resource,
            subresource: req.subresource.as_deref(),
            namespace: ns,
            name,
        };
        auth::authorize(g, &attrs)?;
    }
    // A write that would create the object is also authorized as `create` on its name, as
    // kube-apiserver does: k8s.io/apiserver/pkg/endpoints/handlers/patch.go builds
    // `createAuthorizerAttributes` (Verb "create", the object's Name) for an apply patch, and
    // update.go the same for a PUT that creates (Leases, Events, Services here). The check runs
    // only on the creating path, so `patch` alone keeps working on an object that exists.
    let may_create = |store: &crate::store::Store, creates: bool| -> Result<(), ApiError> {
        let Some(g) = grant else { return Ok(()) };
        if !creates
            || store
                .get(req.rid, ns.unwrap_or(""), req.name.as_deref().unwrap_or(""))
                .is_some()
        {
            return Ok(());
        }
        let attrs = Attributes {
            verb: "create",
            group: rt.group,
            resource: rt.resource,
            subresource: req.subresource.as_deref(),
            namespace: ns,
            name: req.name.as_deref(),
        };
        auth::authorize(g, &attrs)
    };
    let ns_str = ns.unwrap_or("");
    let name = req.name.as_deref().unwrap_or("");
    let sub = req.subresource.as_deref();
    match verb {
        "get" => {
            let store = lock(&inner.store);
            let s = store
                .get(req.rid, ns_str, name)
                .ok_or_else(|| ApiError::not_found(rt, name))?;
            Ok(json_response(200, &s.obj))
        }
        "list" => {
            let (label, field) = selectors(q, req.rid)?;
            let (items, rv) = {
                let store = lock(&inner.store);
                (
                    store.list(req.rid, ns, &label, &field),
                    store.resource_version(),
                )
            };
            // `Accept: application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1` (a
            // metadata-only list, what kube's `list_metadata` and client-go's metadata client
            // send): the server answers with the objects' metadata only.
            if r.accept
                .is_some_and(|a| a.contains("as=PartialObjectMetadataList"))
            {
                let items: Vec<Value> = items
                    .iter()
                    .map(|o| {
                        json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                               "metadata": o["metadata"].clone()})
                    })
                    .collect();
                return Ok(json_response(
                    200,
                    &json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                            "metadata": {"resourceVersion": rv.to_string()}, "items": items}),
                ));
            }
            let items: Vec<Value> = items.iter().map(|o| (**o).clone()).collect();
            Ok(json_response(200, &list_response(req.rid, items, rv)))
        }
        "watch" => {
            let (label, mut field) = selectors(q, req.rid)?;
            if let Some(n) = req.name.as_deref() {
                let pinned = format!("metadata.name={n}");
                field = FieldSelector::parse(&pinned, rt.kind, rt.group)
                    .map_err(ApiError::bad_request)?;
            }
            let timeout = match q.get("timeoutSeconds") {
                Some(t) if !t.is_empty() => {
                    Some(Duration::from_secs(t.parse::<u64>().map_err(|_| {
                        ApiError::bad_request(format!("invalid timeoutSeconds {t:?}"))
                    })?))
                }
                _ => None,
            };
            let spec = WatchSpec {
                rid: req.rid,
                namespace: req.namespace.clone(),
                label,
                field,
                resource_version: q.get("resourceVersion").map(str::to_string),
                timeout,
                bookmarks: q.flag("allowWatchBookmarks"),
                send_initial_events: q.flag("sendInitialEvents"),
            };
            watch::start(inner, spec)
        }
        "create" => {
            let body = parse_body(r)?;
            let opts = write_opts(r)?;
            let obj = lock(&inner.store).create(req.rid, ns_str, body, &opts)?;
            Ok(json_response(201, &obj))
        }
        "update" => {
            let body = parse_body(r)?;
            let opts = write_opts(r)?;
            let mut store = lock(&inner.store);
            may_create(&store, sub.is_none() && rt.create_on_update)?;
            let (code, obj) = store.replace(req.rid, ns_str, name, sub, body, &opts)?;
            Ok(json_response(code, &obj))
        }
        "patch" => {
            let ct = r.content_type.unwrap_or("");
            let ptype = PatchType::from_content_type(ct)
                .ok_or_else(|| ApiError::unsupported_media_type(ct))?;
            let opts = write_opts(r)?;
            let mut store = lock(&inner.store);
            may_create(&store, ptype == PatchType::Apply && opts.explicit_manager)?;
            let (code, obj) = store.patch(req.rid, ns_str, name, sub, ptype, &r.body, &opts)?;
            Ok(json_response(code, &obj))
        }
        "delete" => {
            let options: Option<Value> = if r.body.is_empty() {
                None
            } else {
                Some(serde_json::from_slice(&r.body).map_err(|e| {
                    ApiError::bad_request(format!("error decoding DeleteOptions: {e}"))
                })?)
            };
            let opts = write_opts(r)?;
            let (code, obj) =
                lock(&inner.store).delete(req.rid, ns_str, name, options.as_ref(), opts.dry_run)?;
            Ok(json_response(code, &obj))
        }
        "deletecollection" => {
            let (label, field) = selectors(q, req.rid)?;
            let opts = write_opts(r)?;
            let (items, rv) = {
                let mut store = lock(&inner.store);
                let items = store.delete_collection(req.rid, ns, &label, &field, opts.dry_run)?;
                (items, store.resource_version())
            };
            Ok(json_response(200, &list_response(req.rid, items, rv)))
        }
        _ => Err(ApiError::method_not_allowed(r.method)),
    }
}

/// Discovery and other non-resource documents.
fn discovery(inner: &Inner, route: &Route) -> Value {
    match route {
        Route::Root => json!({"paths": [
            "/api", "/api/v1", "/apis", "/apis/coordination.k8s.io", "/apis/coordination.k8s.io/v1",
            "/apis/events.k8s.io", "/apis/events.k8s.io/v1", "/healthz", "/livez", "/readyz", "/version"
        ]}),
        Route::Version => json!({
            "major": "1",
            "minor": "33",
            "emulationMajor": "1",
            "emulationMinor": "33",
            "minCompatibilityMajor": "1",
            "minCompatibilityMinor": "32",
            "gitVersion": "v1.33.0",
            "gitCommit": "60a317eadfcb839692a68eab88b2096f4d708f4f",
            "gitTreeState": "clean",
            "buildDate": "2025-04-23T13:00:00Z",
            "goVersion": "go1.24.2",
            "compiler": "gc",
            "platform": "linux/amd64",
        }),
        Route::ApiVersions => json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": inner.addr.to_string()}],
        }),
        Route::ApiGroupList => json!({
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": resources::groups().iter().map(|g| group_doc(g)).collect::<Vec<_>>(),
        }),
        Route::ApiGroup(g) => {
            let mut d = group_doc(g);
            if let Some(o) = d.as_object_mut() {
                o.insert("kind".into(), json!("APIGroup"));
                o.insert("apiVersion".into(), json!("v1"));
            }
            d
        }
        Route::ResourceList(g, v) => {
            let mut list = Vec::new();
            for r in RESOURCES
                .iter()
                .filter(|r| r.group == *g && r.version == *v)
            {
                list.push(json!({
                    "name": r.resource,
                    "singularName": r.singular,
                    "namespaced": r.namespaced,
                    "kind": r.kind,
                    "verbs": r.verbs(),
                    "shortNames": r.short_names,
                }));
                if r.status_subresource {
                    list.push(json!({
                        "name": format!("{}/status", r.resource),
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": ["get", "patch", "update"],
                    }));
                }
            }
            let gv = if g.is_empty() {
                v.to_string()
            } else {
                format!("{g}/{v}")
            };
            json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": list})
        }
        Route::Health | Route::Resource(_) | Route::NotFound => Value::Null,
    }
}

fn group_doc(g: &str) -> Value {
    let versions: Vec<Value> = RESOURCES
        .iter()
        .filter(|r| r.group == g)
        .map(|r| r.version)
        .fold(Vec::new(), |mut acc: Vec<&str>, v| {
            if !acc.contains(&v) {
                acc.push(v);
            }
            acc
        })
        .into_iter()
        .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
        .collect();
    let preferred = versions.first().cloned().unwrap_or(Value::Null);
    json!({"name": g, "versions": versions, "preferredVersion": preferred})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(path: &str) -> Option<ResourceReq> {
        match parse_route(path) {
            Route::Resource(r) => Some(r),
            _ => None,
        }
    }

    #[test]
    fn routes() {
        let r = res("/api/v1/nodes/n1/status").expect("node status");
        assert_eq!(r.name.as_deref(), Some("n1"));
        assert_eq!(r.subresource.as_deref(), Some("status"));
        let r = res("/api/v1/namespaces/default/configmaps/c").expect("cm");
        assert_eq!(r.namespace.as_deref(), Some("default"));
        let r = res("/api/v1/namespaces/kube-system").expect("ns");
        assert_eq!(resources::get(r.rid).resource, "namespaces");
        assert!(res("/api/v1/namespaces/x/status").is_some());
        assert!(res("/apis/coordination.k8s.io/v1/namespaces/x/leases/l").is_some());
        assert!(res("/api/v1/configmaps").is_some());
        assert!(
            res("/api/v1/configmaps/x").is_none(),
            "namespaced object without namespace"
        );
        assert!(
            res("/api/v1/namespaces/x/nodes").is_none(),
            "cluster resource in namespace"
        );
        assert!(res("/api/v1/widgets").is_none());
        assert!(res("/api/v1/namespaces/d/configmaps/c/status").is_none());
        assert!(res("/api/v1/watch/namespaces/d/pods").is_some_and(|r| r.watch_path));
    }
}
