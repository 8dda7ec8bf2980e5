//! Optional authorization: tokens, RBAC-like rules, 401 and 403 answers.
#![allow(clippy::unwrap_used)]

mod common;

use common::{client, code_reason, status};
use faultline_kube_emulator::{node, Emulator, Rule, UserInfo};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

#[tokio::test]
async fn rules_allow_and_deny_like_rbac() {
    let emu = Emulator::start().await.unwrap();
    emu.put(node("n1", &[]));
    emu.put(node("n2", &[]));
    emu.authorize(
        "agent-token",
        UserInfo::service_account("faultline", "agent"),
        vec![
            Rule::new(&["get", "list", "watch"], &[""], &["nodes"]).names(&["n1"]),
            Rule::new(&["patch"], &[""], &["nodes/status"]).names(&["n1"]),
            Rule::new(&["create", "patch"], &["events.k8s.io"], &["events"]),
            Rule::new(&["get", "list"], &[""], &["configmaps"]).in_namespace("kube-system"),
        ],
    );
    emu.authorize(
        "admin-token",
        UserInfo::new("admin").with_groups(&["system:masters"]),
        vec![],
    );

    let agent = client(&emu, "agent-token").await;
    let nodes: Api<Node> = Api::all(agent.clone());
    nodes.get("n1").await.unwrap();
    nodes
        .patch_status(
            "n1",
            &PatchParams::default(),
            &Patch::Strategic(
                json!({"status": {"conditions": [{"type": "GpuHealthy", "status": "True"}]}}),
            ),
        )
        .await
        .unwrap();
    // List pinned to its own node by field selector is authorized by name.
    let own = nodes
        .list(&ListParams::default().fields("metadata.name=n1"))
        .await
        .unwrap();
    assert_eq!(own.items.len(), 1);

    let err = nodes.get("n2").await.unwrap_err();
    assert_eq!(code_reason(&err), (403, "Forbidden".into()));
    assert_eq!(
        status(&err).unwrap().message,
        "nodes \"n2\" is forbidden: User \"system:serviceaccount:faultline:agent\" cannot get resource \"nodes\" in API group \"\" at the cluster scope"
    );
    let err = nodes.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(code_reason(&err).0, 403);
    // Patching the main resource is a different permission from nodes/status.
    let err = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err).0, 403);
    assert!(status(&err)
        .unwrap()
        .message
        .contains("cannot patch resource \"nodes\""));
    let err = nodes
        .delete("n1", &DeleteParams::default())
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err).0, 403);

    // Namespaced rule.
    let ks: Api<ConfigMap> = Api::namespaced(agent.clone(), "kube-system");
    ks.list(&ListParams::default()).await.unwrap();
    let def: Api<ConfigMap> = Api::namespaced(agent.clone(), "default");
    let err = def.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(
        status(&err).unwrap().message,
        "configmaps is forbidden: User \"system:serviceaccount:faultline:agent\" cannot list resource \"configmaps\" in API group \"\" in the namespace \"default\""
    );

    // Denied requests change nothing and are logged with their status.
    assert!(emu.calls().iter().any(|c| c.status == 403
        && c.method == "DELETE"
        && c.token.as_deref() == Some("agent-token")));
    assert!(emu
        .get(&faultline_kube_emulator::ResourceRef::node("n1"))
        .is_some());

    // system:masters may do anything.
    let admin: Api<Node> = Api::all(client(&emu, "admin-token").await);
    admin.delete("n2", &DeleteParams::default()).await.unwrap();

    // Unknown token: 401.
    let stranger: Api<Node> = Api::all(client(&emu, "who-are-you").await);
    let err = stranger.get("n1").await.unwrap_err();
    assert_eq!(code_reason(&err), (401, "Unauthorized".into()));

    // Replacing a grant takes effect immediately.
    emu.authorize(
        "agent-token",
        UserInfo::service_account("faultline", "agent"),
        vec![Rule::new(&["*"], &["*"], &["*"])],
    );
    def.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "now-allowed"}})).unwrap(),
    )
    .await
    .unwrap();
}

/// An apply patch that creates the object is authorized as `patch` and as `create` on its
/// name; on an object that exists, `patch` alone is enough. A PUT that creates (Leases) needs
/// `create` as well as `update`. (kube-apiserver: handlers/patch.go and update.go check
/// `createAuthorizerAttributes` only on the creating path.)
#[tokio::test]
async fn a_write_that_creates_also_needs_create() {
    use k8s_openapi::api::coordination::v1::Lease;
    let emu = Emulator::start().await.unwrap();
    emu.authorize(
        "patcher",
        UserInfo::service_account("faultline-system", "faultline"),
        vec![
            Rule::new(&["patch", "update", "get"], &[""], &["configmaps"])
                .in_namespace("kube-system"),
            Rule::new(&["update"], &["coordination.k8s.io"], &["leases"])
                .in_namespace("kube-system"),
        ],
    );
    emu.authorize(
        "creator",
        UserInfo::new("creator"),
        vec![
            Rule::new(&["patch", "create"], &[""], &["configmaps"])
                .names(&["mine"])
                .in_namespace("kube-system"),
            Rule::new(&["update", "create"], &["coordination.k8s.io"], &["leases"])
                .in_namespace("kube-system"),
        ],
    );
    let apply = PatchParams::apply("faultline");
    let doc = |name: &str| {
        Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name}, "data": {"k": "v"}}))
    };

    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "patcher").await, "kube-system");
    let err = cms.patch("mine", &apply, &doc("mine")).await.unwrap_err();
    assert_eq!(code_reason(&err), (403, "Forbidden".into()));
    assert_eq!(
        status(&err).unwrap().message,
        "configmaps \"mine\" is forbidden: User \"system:serviceaccount:faultline-system:faultline\" cannot create resource \"configmaps\" in API group \"\" in the namespace \"kube-system\""
    );
    assert!(
        cms.get_opt("mine").await.unwrap().is_none(),
        "nothing was created"
    );

    // `create` is checked with the object's name, so resourceNames apply to it.
    let creator: Api<ConfigMap> = Api::namespaced(client(&emu, "creator").await, "kube-system");
    let err = creator
        .patch("other", &apply, &doc("other"))
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err).0, 403);
    creator.patch("mine", &apply, &doc("mine")).await.unwrap();
    // Once it exists, `patch` alone applies to it; a merge patch never creates.
    cms.patch("mine", &apply, &doc("mine")).await.unwrap();
    let err = cms
        .patch(
            "absent",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"a": "b"}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err).0, 404);

    let lease = |name: &str| -> Lease {
        serde_json::from_value(json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": "kube-system"}, "spec": {"holderIdentity": "a"}}))
        .unwrap()
    };
    let leases: Api<Lease> = Api::namespaced(client(&emu, "patcher").await, "kube-system");
    let err = leases
        .replace("l1", &PostParams::default(), &lease("l1"))
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err).0, 403);
    assert!(status(&err)
        .unwrap()
        .message
        .contains("cannot create resource \"leases\""));
    let by_creator: Api<Lease> = Api::namespaced(client(&emu, "creator").await, "kube-system");
    by_creator
        .replace("l1", &PostParams::default(), &lease("l1"))
        .await
        .unwrap();
}
