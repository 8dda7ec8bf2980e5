//! Nodes: status subresource rules, strategic merge patch list semantics
//! (taints atomic, conditions merged by type), and server-side apply field
//! ownership between managers.
#![allow(clippy::unwrap_used)]

mod common;

use common::{client, code_reason, status};
use faultline_kube_emulator::{node, Emulator, ResourceRef};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

fn with_taint(mut n: Value, key: &str, effect: &str) -> Value {
    n["spec"]["taints"] = json!([{"key": key, "effect": effect}]);
    n
}

fn condition_types(n: &Node) -> Vec<String> {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| cs.iter().map(|c| c.type_.clone()).collect())
        .unwrap_or_default()
}

fn taint_keys(n: &Node) -> Vec<String> {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|ts| ts.iter().map(|t| t.key.clone()).collect())
        .unwrap_or_default()
}

fn labels(n: &Node) -> std::collections::BTreeMap<String, String> {
    n.metadata.labels.clone().unwrap_or_default()
}

#[tokio::test]
async fn taints_are_replaced_atomically_by_strategic_and_merge_patch() {
    let emu = Emulator::start().await.unwrap();
    emu.put(with_taint(
        node("n1", &[]),
        "admin.example/maintenance",
        "NoSchedule",
    ));
    let nodes: Api<Node> = Api::all(client(&emu, "t").await);

    let ours = json!({"spec": {"taints": [
        {"key": "faultline.io/unhealthy", "effect": "NoSchedule", "value": "xid-79"}
    ]}});
    let n = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Strategic(ours.clone()),
        )
        .await
        .unwrap();
    // spec.taints has no patch strategy: the existing taint is gone.
    assert_eq!(taint_keys(&n), ["faultline.io/unhealthy"]);

    emu.put(with_taint(
        node("n2", &[]),
        "admin.example/maintenance",
        "NoSchedule",
    ));
    let n = nodes
        .patch("n2", &PatchParams::default(), &Patch::Merge(ours))
        .await
        .unwrap();
    assert_eq!(taint_keys(&n), ["faultline.io/unhealthy"]);

    // The right way: read, append, write with the resourceVersion.
    emu.put(with_taint(
        node("n3", &[]),
        "admin.example/maintenance",
        "NoSchedule",
    ));
    let mut n = nodes.get("n3").await.unwrap();
    let mut taints = n.spec.as_ref().unwrap().taints.clone().unwrap();
    taints.push(
        serde_json::from_value(json!({"key": "faultline.io/unhealthy", "effect": "NoExecute"}))
            .unwrap(),
    );
    n.spec.as_mut().unwrap().taints = Some(taints);
    let n = nodes
        .replace("n3", &PostParams::default(), &n)
        .await
        .unwrap();
    assert_eq!(
        taint_keys(&n),
        ["admin.example/maintenance", "faultline.io/unhealthy"]
    );

    // Duplicate key+effect and bad effects are rejected.
    let err = nodes
        .patch(
            "n3",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": [
                {"key": "a", "effect": "NoSchedule"}, {"key": "a", "effect": "NoSchedule", "value": "x"}
            ]}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    let err = nodes
        .patch(
            "n3",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": [{"key": "a", "effect": "NoSchedul"}]}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
}

#[tokio::test]
async fn status_conditions_merge_by_type_on_the_status_subresource() {
    let emu = Emulator::start().await.unwrap();
    emu.put(node("n1", &[]));
    let nodes: Api<Node> = Api::all(client(&emu, "t").await);

    let cond = json!({"status": {"conditions": [{
        "type": "GpuHealthy", "status": "False", "reason": "XidError",
        "message": "Xid 79 on GPU 3", "lastTransitionTime": "2025-01-01T00:00:00Z"
    }]}});
    // force is only for apply patches (kube-rs checks this too, so go raw).
    let req = http::Request::patch("/api/v1/nodes/n1/status?force=true")
        .header("Content-Type", "application/strategic-merge-patch+json")
        .body(serde_json::to_vec(&cond).unwrap())
        .unwrap();
    let err = client(&emu, "t")
        .await
        .request::<Node>(req)
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (422, "Invalid".into()));
    let n = nodes
        .patch_status(
            "n1",
            &PatchParams::default(),
            &Patch::Strategic(cond.clone()),
        )
        .await
        .unwrap();
    assert_eq!(
        condition_types(&n),
        [
            "MemoryPressure",
            "DiskPressure",
            "PIDPressure",
            "Ready",
            "GpuHealthy"
        ]
    );

    // Updating our condition again merges into the same element.
    let again = json!({"status": {"conditions": [{"type": "GpuHealthy", "status": "True", "reason": "Recovered"}]}});
    let n = nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Strategic(again))
        .await
        .unwrap();
    assert_eq!(condition_types(&n).len(), 5);
    let ours = n.status.as_ref().unwrap().conditions.as_ref().unwrap()[4].clone();
    assert_eq!(
        (ours.status.as_str(), ours.reason.as_deref()),
        ("True", Some("Recovered"))
    );
    // Untouched fields of the merged element survive.
    assert_eq!(ours.message.as_deref(), Some("Xid 79 on GPU 3"));

    // `$patch: delete` removes one element.
    let n = nodes
        .patch_status(
            "n1",
            &PatchParams::default(),
            &Patch::Strategic(
                json!({"status": {"conditions": [{"type": "GpuHealthy", "$patch": "delete"}]}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(condition_types(&n).len(), 4);

    // A merge patch replaces the whole list: the kubelet's conditions are lost.
    let n = nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Merge(cond))
        .await
        .unwrap();
    assert_eq!(condition_types(&n), ["GpuHealthy"]);
}

#[tokio::test]
async fn main_resource_and_status_subresource_are_separate() {
    let emu = Emulator::start().await.unwrap();
    emu.put(node("n1", &[]));
    let nodes: Api<Node> = Api::all(client(&emu, "t").await);

    // Patching status through the main resource is silently ignored.
    let n = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"labels": {"faultline.io/checked": "true"}},
                "status": {"conditions": []}
            })),
        )
        .await
        .unwrap();
    assert_eq!(labels(&n)["faultline.io/checked"], "true");
    assert_eq!(condition_types(&n).len(), 4);

    // PUT on the main resource keeps status too.
    let mut edited = n.clone();
    edited.status.as_mut().unwrap().conditions = None;
    edited.spec.as_mut().unwrap().unschedulable = Some(true);
    let n = nodes
        .replace("n1", &PostParams::default(), &edited)
        .await
        .unwrap();
    assert_eq!(n.spec.as_ref().unwrap().unschedulable, Some(true));
    assert_eq!(condition_types(&n).len(), 4);

    // PUT/PATCH on /status changes only status.
    let mut edited = n.clone();
    edited.metadata.labels = None;
    edited.spec.as_mut().unwrap().unschedulable = Some(false);
    edited
        .status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()
        .truncate(1);
    let n = nodes
        .replace_status("n1", &PostParams::default(), &edited)
        .await
        .unwrap();
    assert_eq!(condition_types(&n), ["MemoryPressure"]);
    assert_eq!(n.spec.as_ref().unwrap().unschedulable, Some(true));
    assert_eq!(labels(&n)["faultline.io/checked"], "true");

    let n = nodes
        .patch_status(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"sneaky": "x"}}, "spec": {"unschedulable": false}}),
            ),
        )
        .await
        .unwrap();
    assert!(!labels(&n).contains_key("sneaky"));
    assert_eq!(n.spec.as_ref().unwrap().unschedulable, Some(true));

    // Stale resourceVersion on /status conflicts as well.
    let mut stale = n.clone();
    stale.metadata.resource_version = Some("1".into());
    let err = nodes
        .replace_status("n1", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (409, "Conflict".into()));
}

fn apply_labels(labels: Value) -> Patch<Value> {
    Patch::Apply(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "n1", "labels": labels}
    }))
}

fn managers(emu: &Emulator) -> Vec<(String, String, Value)> {
    let n = emu.get(&ResourceRef::node("n1")).unwrap();
    n["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["manager"].as_str().unwrap().to_string(),
                e["operation"].as_str().unwrap().to_string(),
                e["fieldsV1"].clone(),
            )
        })
        .collect()
}

#[tokio::test]
async fn server_side_apply_labels_with_two_managers() {
    let emu = Emulator::start().await.unwrap();
    emu.put(node("n1", &[]));
    let nodes: Api<Node> = Api::all(client(&emu, "t").await);
    let a = PatchParams::apply("manager-a");
    let b = PatchParams::apply("manager-b");

    nodes
        .patch("n1", &a, &apply_labels(json!({"a": "1", "shared": "x"})))
        .await
        .unwrap();
    let n = nodes
        .patch("n1", &b, &apply_labels(json!({"b": "1", "shared": "x"})))
        .await
        .unwrap();
    let l = labels(&n);
    assert_eq!(
        (l["a"].as_str(), l["b"].as_str(), l["shared"].as_str()),
        ("1", "1", "x")
    );
    assert_eq!(l["kubernetes.io/hostname"], "n1", "others' labels are kept");
    let ms = managers(&emu);
    let a_fields = &ms.iter().find(|m| m.0 == "manager-a").unwrap();
    assert_eq!(a_fields.1, "Apply");
    assert_eq!(
        a_fields.2,
        json!({"f:metadata": {"f:labels": {"f:a": {}, "f:shared": {}}}})
    );
    assert!(ms.iter().any(|m| m.0 == "emulator" && m.1 == "Update"));

    // a stops sending `a` (nobody else owns it: removed) and `shared` (b still owns it: kept).
    let n = nodes
        .patch("n1", &a, &apply_labels(json!({})))
        .await
        .unwrap();
    let l = labels(&n);
    assert!(!l.contains_key("a"));
    assert_eq!(l["shared"], "x");
    assert!(!managers(&emu).iter().any(|m| m.0 == "manager-a"));

    // a takes `shared` back (same value: shared ownership), then b tries to change it.
    nodes
        .patch("n1", &a, &apply_labels(json!({"shared": "x"})))
        .await
        .unwrap();
    let err = nodes
        .patch("n1", &b, &apply_labels(json!({"b": "1", "shared": "y"})))
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (409, "Conflict".into()));
    let st = status(&err).unwrap();
    assert!(
        st.message.contains("conflict with \"manager-a\""),
        "{}",
        st.message
    );
    assert!(
        st.message.contains(".metadata.labels.shared"),
        "{}",
        st.message
    );
    let causes = &st.details.as_ref().unwrap().causes;
    assert_eq!(causes[0].reason, "FieldManagerConflict");
    assert_eq!(causes[0].field, ".metadata.labels.shared");
    assert_eq!(labels(&nodes.get("n1").await.unwrap())["shared"], "x");

    // Forcing takes ownership away from a.
    let n = nodes
        .patch(
            "n1",
            &b.clone().force(),
            &apply_labels(json!({"b": "1", "shared": "y"})),
        )
        .await
        .unwrap();
    assert_eq!(labels(&n)["shared"], "y");
    let ms = managers(&emu);
    let a_entry = ms.iter().find(|m| m.0 == "manager-a");
    assert!(a_entry.is_none(), "manager-a owned only `shared`: {ms:?}");
    // a dropping `shared` now leaves it alone: b owns it.
    let n = nodes
        .patch("n1", &a, &apply_labels(json!({})))
        .await
        .unwrap();
    assert_eq!(labels(&n)["shared"], "y");

    // Labels written by another manager's update (the node registration here)
    // conflict too.
    let err = nodes
        .patch(
            "n1",
            &a,
            &apply_labels(json!({"kubernetes.io/hostname": "other"})),
        )
        .await
        .unwrap_err();
    let st = status(&err).unwrap();
    assert!(
        st.message.contains("\"emulator\" using v1"),
        "{}",
        st.message
    );

    // An ordinary merge patch moves ownership of what it changed to its manager.
    nodes
        .patch(
            "n1",
            &PatchParams {
                field_manager: Some("kubectl-label".into()),
                ..Default::default()
            },
            &Patch::Merge(json!({"metadata": {"labels": {"b": "2"}}})),
        )
        .await
        .unwrap();
    let err = nodes
        .patch("n1", &b, &apply_labels(json!({"b": "3", "shared": "y"})))
        .await
        .unwrap_err();
    assert!(status(&err).unwrap().message.contains("kubectl-label"));
    // Applying the current value is not a conflict.
    nodes
        .patch("n1", &b, &apply_labels(json!({"b": "2", "shared": "y"})))
        .await
        .unwrap();
}

#[tokio::test]
async fn server_side_apply_status_conditions() {
    let emu = Emulator::start().await.unwrap();
    emu.put(node("n1", &[]));
    let nodes: Api<Node> = Api::all(client(&emu, "t").await);
    let pp = PatchParams::apply("faultline-agent");
    let mine = |status: &str| {
        Patch::Apply(json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
            "status": {"conditions": [{"type": "GpuHealthy", "status": status, "reason": "Probe"}]}
        }))
    };
    // Conditions are a map keyed by type: applying ours keeps the kubelet's.
    let n = nodes.patch_status("n1", &pp, &mine("True")).await.unwrap();
    assert_eq!(condition_types(&n).len(), 5);
    let n = nodes.patch_status("n1", &pp, &mine("False")).await.unwrap();
    assert_eq!(condition_types(&n).len(), 5);
    let entry = managers(&emu)
        .into_iter()
        .find(|m| m.0 == "faultline-agent")
        .unwrap();
    assert_eq!(
        entry.2["f:status"]["f:conditions"]["k:{\"type\":\"GpuHealthy\"}"]["f:status"],
        json!({})
    );
    // Changing the kubelet's Ready condition conflicts with its owner.
    let err = nodes
        .patch_status(
            "n1",
            &pp,
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
                "status": {"conditions": [{"type": "Ready", "status": "False"}]}
            })),
        )
        .await
        .unwrap_err();
    let st = status(&err).unwrap();
    assert_eq!(st.code, 409);
    assert!(
        st.message
            .contains(".status.conditions[type=\"Ready\"].status"),
        "{}",
        st.message
    );

    // Status sent through the main resource is ignored by apply.
    let n = nodes
        .patch(
            "n1",
            &PatchParams::apply("faultline-agent"),
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
                "status": {"conditions": [{"type": "Other", "status": "True"}]}
            })),
        )
        .await
        .unwrap();
    assert!(!condition_types(&n).contains(&"Other".to_string()));

    // Dropping our condition from the apply removes it.
    let n = nodes
        .patch_status(
            "n1",
            &pp,
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})),
        )
        .await
        .unwrap();
    assert_eq!(condition_types(&n).len(), 4);
}

#[tokio::test]
async fn server_side_apply_creates_and_accepts_client_managed_fields() {
    let emu = Emulator::start().await.unwrap();
    let nodes: Api<Node> = Api::all(client(&emu, "t").await);
    let n = nodes
        .patch(
            "fresh",
            &PatchParams::apply("creator"),
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {
                    "name": "fresh",
                    "labels": {"x": "1"},
                    "managedFields": [{"manager": "bogus", "operation": "Apply"}]
                },
                "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}
            })),
        )
        .await
        .unwrap();
    assert_eq!(taint_keys(&n), ["k"]);
    let ms = n.metadata.managed_fields.unwrap();
    assert_eq!(ms.len(), 1);
    assert_eq!(ms[0].manager.as_deref(), Some("creator"));
    // Taints are atomic: one leaf.
    let fields = serde_json::to_value(&ms[0].fields_v1).unwrap();
    assert_eq!(fields["f:spec"]["f:taints"], json!({}));

    // Wrong kind in the apply body.
    let err = nodes
        .patch(
            "fresh",
            &PatchParams::apply("creator"),
            &Patch::Apply(
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "fresh"}}),
            ),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err).0, 400);
}
