//! The kustomizations: complete, namespaces explicit and right, image and labels set; and, where
//! `kubectl` is installed, what `kubectl kustomize manifests/` renders.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::common::{self, Doc, EVENTS_NAMESPACE, IMAGE, IMAGE_TAG, NAMESPACE};

fn kustomization(sub: &str) -> Value {
    let path = common::manifests_dir().join(sub).join("kustomization.yaml");
    let text = std::fs::read_to_string(&path).expect("read kustomization.yaml");
    let mut docs = common::parse_yaml(&text).expect("kustomization.yaml parses");
    assert_eq!(docs.len(), 1, "{}: one document", path.display());
    docs.remove(0)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|x| x.as_str().expect("a string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Kinds that have no namespace.
fn cluster_scoped(kind: &str) -> bool {
    matches!(
        kind,
        "Namespace"
            | "ClusterRole"
            | "ClusterRoleBinding"
            | "ValidatingAdmissionPolicy"
            | "ValidatingAdmissionPolicyBinding"
    )
}

/// The namespace an object of the base must have: `None` for cluster-scoped kinds.
fn expected_namespace(d: &Doc) -> Option<&'static str> {
    if cluster_scoped(d.kind()) {
        None
    } else if matches!(d.kind(), "Role" | "RoleBinding") && d.name().ends_with("-events") {
        Some(EVENTS_NAMESPACE)
    } else {
        Some(NAMESPACE)
    }
}

#[test]
fn the_top_level_kustomization_is_the_base() {
    let k = kustomization("");
    assert_eq!(k["kind"], "Kustomization");
    assert_eq!(strings(&k["resources"]), ["base"]);
}

#[test]
fn the_base_kustomization_lists_every_file_and_only_existing_ones() {
    let k = kustomization("base");
    assert_eq!(k["kind"], "Kustomization");
    let listed: Vec<String> = strings(&k["resources"]);
    let unique: BTreeSet<_> = listed.iter().cloned().collect();
    assert_eq!(
        unique.len(),
        listed.len(),
        "a file listed twice: {listed:?}"
    );
    let on_disk: BTreeSet<String> = std::fs::read_dir(common::manifests_dir().join("base"))
        .expect("read manifests/base")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|f| f != "kustomization.yaml")
        .collect();
    assert_eq!(unique, on_disk, "resources vs files in manifests/base");
    for f in [
        "namespace.yaml",
        "serviceaccount.yaml",
        "rbac.yaml",
        "daemonset.yaml",
        "coordinator.yaml",
    ] {
        assert!(unique.contains(f), "{f} missing");
    }
    for f in ["policy.yaml", "admission.yaml"] {
        assert!(unique.contains(f), "{f} missing");
    }
}

/// kustomize's `namespace:` field would move the events Role out of `default` (and give the
/// cluster-scoped admission objects a namespace), so the base has none and every namespaced
/// object names its own.
#[test]
fn every_namespaced_object_names_its_namespace() {
    let k = kustomization("base");
    assert!(
        k.get("namespace").is_none(),
        "base/kustomization.yaml must not set namespace: (it would move the events Role out of default)"
    );
    let docs = common::base_objects();
    assert!(!docs.is_empty());
    for d in &docs {
        assert_eq!(d.namespace(), expected_namespace(d), "{}", d.at());
    }
    // The events RBAC is really there, in `default`.
    for kind in ["Role", "RoleBinding"] {
        assert!(
            docs.iter()
                .any(|d| d.kind() == kind && d.namespace() == Some(EVENTS_NAMESPACE)),
            "no {kind} in {EVENTS_NAMESPACE}"
        );
    }
    // The namespace itself is created.
    assert_eq!(
        common::find(&docs, "Namespace", NAMESPACE).name(),
        NAMESPACE
    );
}

#[test]
fn the_image_and_common_labels_are_set_by_kustomize() {
    let k = kustomization("base");
    let images = k["images"].as_array().expect("images:");
    assert_eq!(images.len(), 1);
    assert_eq!(images[0]["name"], IMAGE);
    assert_eq!(images[0]["newTag"], IMAGE_TAG);
    // The DaemonSet and the coordinator's Deployment name the same image, so `kustomize edit
    // set image NAME=…` finds both.
    let docs = common::base_objects();
    for (kind, name) in [
        ("DaemonSet", "faultline-agent"),
        ("Deployment", "faultline-coordinator"),
    ] {
        let d = common::find(&docs, kind, name);
        assert_eq!(
            d.value["spec"]["template"]["spec"]["containers"][0]["image"],
            format!("{IMAGE}:{IMAGE_TAG}"),
            "{kind}/{name}"
        );
    }

    assert!(
        k.get("commonLabels").is_none(),
        "use labels:, not commonLabels"
    );
    let labels = k["labels"].as_array().expect("labels:");
    assert_eq!(labels.len(), 1);
    assert_eq!(labels[0]["includeSelectors"], false);
    assert_eq!(labels[0]["pairs"]["app.kubernetes.io/name"], "faultline");
    assert_eq!(labels[0]["pairs"]["app.kubernetes.io/part-of"], "faultline");
}

/// What kustomize really renders: the same objects, namespaces unchanged, labels added,
/// selectors untouched. Skipped (with a note) where `kubectl` is not installed.
#[test]
fn kubectl_kustomize_renders_the_base_unchanged_but_for_labels() {
    let out = match std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(common::manifests_dir())
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: kubectl not available ({e})");
            return;
        }
    };
    assert!(
        out.status.success(),
        "kubectl kustomize failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = common::parse_yaml(&String::from_utf8_lossy(&out.stdout)).expect("YAML");
    let key = |v: &Value| {
        (
            v["kind"].as_str().unwrap_or("").to_string(),
            v["metadata"]["namespace"].as_str().map(str::to_string),
            v["metadata"]["name"].as_str().unwrap_or("").to_string(),
        )
    };
    let got: BTreeSet<_> = rendered.iter().map(key).collect();
    let want: BTreeSet<_> = common::base_objects()
        .iter()
        .map(|d| key(&d.value))
        .collect();
    assert_eq!(got, want);
    for kind in ["DaemonSet", "Deployment", "Service"] {
        assert!(
            got.iter().any(|(k, ..)| k == kind),
            "kubectl kustomize renders no {kind}"
        );
    }
    for v in &rendered {
        assert_eq!(
            v["metadata"]["labels"]["app.kubernetes.io/part-of"],
            "faultline",
            "{:?}",
            key(v)
        );
        if v["kind"] == "NetworkPolicy" {
            assert!(v["spec"]["podSelector"]["matchLabels"]
                .get("app.kubernetes.io/part-of")
                .is_none());
        }
        if v["kind"] == "Service" {
            assert!(v["spec"]["selector"]
                .get("app.kubernetes.io/part-of")
                .is_none());
        }
        if v["kind"] == "DaemonSet" || v["kind"] == "Deployment" {
            assert!(v["spec"]["selector"]["matchLabels"]
                .get("app.kubernetes.io/part-of")
                .is_none());
            assert_eq!(
                v["spec"]["template"]["spec"]["containers"][0]["image"],
                format!("{IMAGE}:{IMAGE_TAG}")
            );
        }
    }
}
