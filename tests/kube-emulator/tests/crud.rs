//! CRUD through kube-rs: creation, conflicts, preconditions, patch types,
//! validation, selectors, and the Status errors clients decode.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::{client, code_reason, status};
use faultline_kube_emulator::{Emulator, ResourceRef};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;

fn config_map(name: &str, labels: &[(&str, &str)], data: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        ..Default::default()
    }
}

#[tokio::test]
async fn create_get_replace_delete_with_conflicts() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");

    let created = cms
        .create(
            &PostParams::default(),
            &config_map("c1", &[], &[("k", "v")]),
        )
        .await
        .unwrap();
    let rv1 = created.metadata.resource_version.clone().unwrap();
    assert!(created.metadata.uid.is_some());
    assert!(created.metadata.creation_timestamp.is_some());
    assert_eq!(created.metadata.namespace.as_deref(), Some("default"));
    assert_eq!(created.metadata.generation, Some(1));

    let err = cms
        .create(&PostParams::default(), &config_map("c1", &[], &[]))
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (409, "AlreadyExists".into()));
    assert_eq!(
        status(&err).unwrap().message,
        "configmaps \"c1\" already exists"
    );

    let mut got = cms.get("c1").await.unwrap();
    assert_eq!(got.data.as_ref().unwrap()["k"], "v");
    got.data = Some(BTreeMap::from([("k".to_string(), "v2".to_string())]));
    let replaced = cms
        .replace("c1", &PostParams::default(), &got)
        .await
        .unwrap();
    let rv2 = replaced.metadata.resource_version.clone().unwrap();
    assert_ne!(rv1, rv2);
    assert_eq!(replaced.metadata.uid, created.metadata.uid);
    assert_eq!(replaced.metadata.generation, Some(2));

    // Replace with the stale resourceVersion: 409 Conflict.
    let mut stale = got.clone();
    stale.metadata.resource_version = Some(rv1.clone());
    let err = cms
        .replace("c1", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (409, "Conflict".into()));
    assert!(status(&err)
        .unwrap()
        .message
        .contains("the object has been modified"));

    // Without a resourceVersion the replace is unconditional.
    let mut unconditional = got.clone();
    unconditional.metadata.resource_version = None;
    unconditional.data = Some(BTreeMap::from([("k".to_string(), "v3".to_string())]));
    cms.replace("c1", &PostParams::default(), &unconditional)
        .await
        .unwrap();

    // A merge patch carrying a stale resourceVersion is a precondition too.
    let err = cms
        .patch(
            "c1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": rv2}, "data": {"x": "y"}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (409, "Conflict".into()));
    let current = cms.get("c1").await.unwrap();
    let rv_now = current.metadata.resource_version.clone().unwrap();
    let patched = cms
        .patch(
            "c1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": rv_now}, "data": {"x": "y"}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data.as_ref().unwrap()["x"], "y");

    // A write that changes nothing keeps the resourceVersion.
    let same = cms
        .patch(
            "c1",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"x": "y"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        same.metadata.resource_version,
        patched.metadata.resource_version
    );

    let deleted = cms.delete("c1", &DeleteParams::default()).await.unwrap();
    assert!(deleted.is_left());
    let err = cms.get("c1").await.unwrap_err();
    assert_eq!(code_reason(&err), (404, "NotFound".into()));
    assert_eq!(status(&err).unwrap().message, "configmaps \"c1\" not found");
    let err = cms
        .delete("c1", &DeleteParams::default())
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (404, "NotFound".into()));
}

#[tokio::test]
async fn namespaces_generate_name_and_type_checks() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "t").await;

    // Namespaced create into a namespace that does not exist.
    let missing: Api<ConfigMap> = Api::namespaced(c.clone(), "nope");
    let err = missing
        .create(&PostParams::default(), &config_map("c", &[], &[]))
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (404, "NotFound".into()));
    assert_eq!(
        status(&err).unwrap().message,
        "namespaces \"nope\" not found"
    );

    let nss: Api<Namespace> = Api::all(c.clone());
    let names: Vec<String> = nss
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
        assert!(names.contains(&ns.to_string()), "{names:?}");
    }
    let ns = nss
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some("faultline".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Active"));
    assert_eq!(
        ns.metadata.labels.unwrap()["kubernetes.io/metadata.name"],
        "faultline"
    );

    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "faultline");
    let mut gen = config_map("", &[], &[]);
    gen.metadata.name = None;
    gen.metadata.generate_name = Some("probe-".into());
    let made = cms.create(&PostParams::default(), &gen).await.unwrap();
    let name = made.metadata.name.unwrap();
    assert!(
        name.starts_with("probe-") && name.len() == "probe-".len() + 5,
        "{name}"
    );

    // Deleting a namespace takes its contents with it.
    nss.delete("faultline", &DeleteParams::default())
        .await
        .unwrap();
    assert!(emu.list("", "configmaps", Some("faultline")).is_empty());

    // Invalid names and labels are 422 Invalid with causes.
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let err = cms
        .create(&PostParams::default(), &config_map("Bad_Name", &[], &[]))
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    let err = cms
        .create(
            &PostParams::default(),
            &config_map("ok", &[("faultline.io/reason", "xid:79")], &[]),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    assert_eq!(
        status(&err).unwrap().details.as_ref().unwrap().causes[0].field,
        "metadata.labels"
    );
}

#[tokio::test]
async fn config_map_size_limit() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    let limit = 1024 * 1024;

    // key (1 byte) + value = exactly 1 MiB is accepted.
    let at_limit = "x".repeat(limit - 1);
    cms.create(
        &PostParams::default(),
        &config_map("fits", &[], &[("k", &at_limit)]),
    )
    .await
    .unwrap();

    let over = "x".repeat(limit);
    let err = cms
        .create(
            &PostParams::default(),
            &config_map("big", &[], &[("k", &over)]),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    assert!(status(&err).unwrap().message.contains("1048576"), "{err}");

    // Growing an existing ConfigMap past the limit by patch, replace or apply.
    let err = cms
        .patch(
            "fits",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"k2": "y"}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    let mut cm = cms.get("fits").await.unwrap();
    cm.data.as_mut().unwrap().insert("more".into(), "z".into());
    let err = cms
        .replace("fits", &PostParams::default(), &cm)
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    let err = cms
        .patch(
            "big",
            &PatchParams::apply("t"),
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "big"}, "data": {"k": over}
            })),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    assert!(emu
        .get(&ResourceRef::config_map("default", "big"))
        .is_none());
    // binaryData counts decoded bytes.
    let err = cms
        .patch(
            "fits",
            &PatchParams::default(),
            &Patch::Merge(json!({"binaryData": {"b": "AAAA"}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
}

#[tokio::test]
async fn json_patch_and_media_types() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "t").await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    cms.create(&PostParams::default(), &config_map("c", &[], &[("a", "1")]))
        .await
        .unwrap();

    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/data/a", "value": "1"},
        {"op": "replace", "path": "/data/a", "value": "2"},
    ]))
    .unwrap();
    let cm = cms
        .patch("c", &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
        .unwrap();
    assert_eq!(cm.data.unwrap()["a"], "2");

    // A failing `test` operation is 422, and nothing changes.
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/data/a", "value": "1"},
        {"op": "replace", "path": "/data/a", "value": "3"},
    ]))
    .unwrap();
    let err = cms
        .patch("c", &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err).0, 422);
    assert_eq!(cms.get("c").await.unwrap().data.unwrap()["a"], "2");

    // Unsupported patch content type: 415.
    let req = http::Request::patch("/api/v1/namespaces/default/configmaps/c")
        .header("Content-Type", "application/x-unknown")
        .body(b"{}".to_vec())
        .unwrap();
    let err = c.request::<ConfigMap>(req).await.unwrap_err();
    assert_eq!(code_reason(&err), (415, "UnsupportedMediaType".into()));

    // Unknown resource: 404.
    let req = http::Request::get("/api/v1/namespaces/default/widgets")
        .body(Vec::new())
        .unwrap();
    let err = c.request::<serde_json::Value>(req).await.unwrap_err();
    assert_eq!(code_reason(&err), (404, "NotFound".into()));

    // Apply without a fieldManager: 422 from PatchOptions validation.
    let req = http::Request::patch("/api/v1/namespaces/default/configmaps/c")
        .header("Content-Type", "application/apply-patch+yaml")
        .body(b"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\n".to_vec())
        .unwrap();
    let err = c.request::<ConfigMap>(req).await.unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    assert!(status(&err).unwrap().message.contains("fieldManager"));

    // Apply as YAML with a fieldManager works.
    let req = http::Request::patch("/api/v1/namespaces/default/configmaps/c?fieldManager=yaml")
        .header("Content-Type", "application/apply-patch+yaml")
        .body(
            b"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\ndata:\n  y: \"1\"\n".to_vec(),
        )
        .unwrap();
    let cm: ConfigMap = c.request(req).await.unwrap();
    assert_eq!(cm.data.unwrap()["y"], "1");

    // /version and discovery.
    let v = c.apiserver_version().await.unwrap();
    assert_eq!(v.git_version, "v1.33.0");
    let groups = c.list_api_groups().await.unwrap();
    assert!(groups
        .groups
        .iter()
        .any(|g| g.name == "coordination.k8s.io"));
    let core = c.list_core_api_resources("v1").await.unwrap();
    assert!(core.resources.iter().any(|r| r.name == "nodes/status"));
}

#[tokio::test]
async fn list_selectors() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "t").await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    for (name, labels) in [
        ("a", vec![("app", "web"), ("tier", "fe")]),
        ("b", vec![("app", "web"), ("tier", "be")]),
        ("c", vec![("app", "db")]),
        ("d", vec![]),
    ] {
        cms.create(&PostParams::default(), &config_map(name, &labels, &[]))
            .await
            .unwrap();
    }
    let names = |list: kube::core::ObjectList<ConfigMap>| -> Vec<String> {
        list.items
            .into_iter()
            .filter_map(|c| c.metadata.name)
            .collect()
    };
    let sel = |s: &str| ListParams::default().labels(s);
    assert_eq!(names(cms.list(&sel("app=web")).await.unwrap()), ["a", "b"]);
    assert_eq!(
        names(cms.list(&sel("app==web,tier!=fe")).await.unwrap()),
        ["b"]
    );
    assert_eq!(names(cms.list(&sel("app")).await.unwrap()), ["a", "b", "c"]);
    assert_eq!(names(cms.list(&sel("!app")).await.unwrap()), ["d"]);
    assert_eq!(
        names(
            cms.list(&sel("app in (db, web),tier notin (be)"))
                .await
                .unwrap()
        ),
        ["a", "c"]
    );
    assert_eq!(
        names(cms.list(&sel("tier notin (fe)")).await.unwrap()),
        ["b", "c", "d"]
    );
    let by_name = ListParams::default().fields("metadata.name=c");
    assert_eq!(names(cms.list(&by_name).await.unwrap()), ["c"]);
    let not_name = ListParams::default().fields("metadata.name!=c,metadata.namespace=default");
    assert_eq!(names(cms.list(&not_name).await.unwrap()), ["a", "b", "d"]);
    // limit is accepted (everything comes back in one page).
    let limited = cms.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(limited.items.len(), 4);
    assert!(limited.metadata.resource_version.is_some());

    let err = cms.list(&sel("app in web")).await.unwrap_err();
    assert_eq!(code_reason(&err), (400, "BadRequest".into()));
    let err = cms
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (400, "BadRequest".into()));

    // Pods by spec.nodeName, across namespaces.
    let pods: Api<Pod> = Api::namespaced(c.clone(), "kube-system");
    for (name, node) in [("p1", Some("n1")), ("p2", Some("n2")), ("p3", None)] {
        let mut spec = json!({"containers": [{"name": "c", "image": "busybox:1.36"}]});
        if let Some(n) = node {
            spec["nodeName"] = json!(n);
        }
        let pod: Pod =
            serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap();
        let created = pods.create(&PostParams::default(), &pod).await.unwrap();
        assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));
    }
    let all: Api<Pod> = Api::all(c.clone());
    let on_n1 = all
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(on_n1.items.len(), 1);
    let unscheduled = all
        .list(&ListParams::default().fields("spec.nodeName="))
        .await
        .unwrap();
    assert_eq!(unscheduled.items[0].metadata.name.as_deref(), Some("p3"));

    // deletecollection honours selectors.
    let deleted = cms
        .delete_collection(&DeleteParams::default(), &sel("app=web"))
        .await
        .unwrap();
    assert_eq!(deleted.left().unwrap().items.len(), 2);
    assert_eq!(
        names(cms.list(&ListParams::default()).await.unwrap()),
        ["c", "d"]
    );
}

#[tokio::test]
async fn secrets_finalizers_and_direct_access() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "t").await;

    // stringData folds into base64 data.
    let secrets: Api<Secret> = Api::namespaced(c.clone(), "default");
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": "s"}, "stringData": {"token": "hello"}
    }))
    .unwrap();
    let created = secrets.create(&PostParams::default(), &s).await.unwrap();
    assert_eq!(created.type_.as_deref(), Some("Opaque"));
    assert_eq!(created.data.unwrap()["token"].0, b"hello");
    assert!(created.string_data.is_none());

    // A finalizer holds deletion: deletionTimestamp is set, the object stays
    // until the finalizer is removed.
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let mut cm = config_map("held", &[], &[]);
    cm.metadata.finalizers = Some(vec!["faultline.io/cleanup".into()]);
    cms.create(&PostParams::default(), &cm).await.unwrap();
    let r = cms.delete("held", &DeleteParams::default()).await.unwrap();
    let held = r.left().unwrap();
    assert!(held.metadata.deletion_timestamp.is_some());
    assert!(cms.get("held").await.is_ok());
    let err = cms
        .patch(
            "held",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"finalizers": ["faultline.io/cleanup", "other.io/x"]}}),
            ),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err).0, 422);
    cms.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert_eq!(code_reason(&cms.get("held").await.unwrap_err()).0, 404);

    // Direct store access does not show up in the call log.
    emu.clear_calls();
    let stored = emu.put(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "direct", "namespace": "default"}, "data": {"a": "b"}
    }));
    assert!(stored["metadata"]["resourceVersion"].is_string());
    assert!(stored["metadata"]["uid"].is_string());
    let via_api = cms.get("direct").await.unwrap();
    assert_eq!(via_api.data.unwrap()["a"], "b");
    assert_eq!(
        emu.get(&ResourceRef::config_map("default", "direct"))
            .unwrap()["data"]["a"],
        "b"
    );
    assert!(emu.delete(&ResourceRef::config_map("default", "direct")));
    assert!(!emu.delete(&ResourceRef::config_map("default", "direct")));
    assert_eq!(emu.calls().len(), 1, "only the GET is logged");
}
