//! Every YAML document under `manifests/` is a faithful instance of its Kubernetes type.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, PodTemplateSpec, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::common::{self, strict, Doc};

fn check<K: DeserializeOwned + Serialize>(v: &Value) -> Result<(), String> {
    strict::<K>(v).map(|_| ())
}

/// Checks one document against the type its `apiVersion` and `kind` name. Kinds this test does
/// not know are errors, so a new kind in the manifests needs a line here.
fn check_doc(doc: &Doc) -> Result<(), String> {
    let v = &doc.value;
    match (doc.api_version(), doc.kind()) {
        ("v1", "Namespace") => check::<Namespace>(v),
        ("v1", "ServiceAccount") => check::<ServiceAccount>(v),
        ("v1", "ConfigMap") => check::<ConfigMap>(v),
        ("v1", "Service") => check::<Service>(v),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => check::<ClusterRole>(v),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => check::<ClusterRoleBinding>(v),
        ("rbac.authorization.k8s.io/v1", "Role") => check::<Role>(v),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => check::<RoleBinding>(v),
        ("apps/v1", "DaemonSet") => check::<DaemonSet>(v),
        ("apps/v1", "Deployment") => check::<Deployment>(v),
        ("networking.k8s.io/v1", "NetworkPolicy") => check::<NetworkPolicy>(v),
        ("batch/v1", "Job") => check::<Job>(v),
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            check::<ValidatingAdmissionPolicy>(v)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            check::<ValidatingAdmissionPolicyBinding>(v)
        }
        ("kubeflow.org/v1", "PyTorchJob") => check_pytorchjob(v),
        ("monitoring.coreos.com/v1", "ServiceMonitor") => check_servicemonitor(v),
        ("monitoring.coreos.com/v1", "PrometheusRule") => check_prometheusrule(v),
        ("kubeflow.org/v2beta1", "MPIJob") => check_mpijob(v),
        ("elastic.iml.github.io/v1alpha1", "ElasticJob") => check_elasticjob(v),
        ("kustomize.config.k8s.io/v1beta1", "Kustomization") => {
            if doc.file.ends_with("kustomization.yaml") {
                Ok(())
            } else {
                Err("a Kustomization outside a kustomization.yaml".into())
            }
        }
        ("kustomize.config.k8s.io/v1alpha1", "Component") => {
            if doc.file.starts_with("components/") && doc.file.ends_with("kustomization.yaml") {
                Ok(())
            } else {
                Err("a kustomize Component outside components/*/kustomization.yaml".into())
            }
        }
        (a, k) => Err(format!(
            "unknown kind {a:?} {k:?}: teach schema.rs about it"
        )),
    }
}

/// Keys of `v` (an object) outside `known`, as errors naming `at`.
fn only_keys(v: &Value, at: &str, known: &[&str]) -> Result<(), String> {
    let map = v.as_object().ok_or(format!("{at}: not a map"))?;
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(format!("{at}.{k}: not a field here")),
        None => Ok(()),
    }
}

/// A ServiceMonitor (prometheus-operator's custom resource, monitoring.coreos.com/v1): the
/// fields of its spec, endpoints and relabelings (prometheus-operator
/// pkg/apis/monitoring/v1/servicemonitor_types.go, `ServiceMonitorSpec`, and types.go,
/// `Endpoint`, `RelabelConfig`), the selector a strict `LabelSelector`.
fn check_servicemonitor(v: &Value) -> Result<(), String> {
    only_keys(v, "", &["apiVersion", "kind", "metadata", "spec"])?;
    let spec = &v["spec"];
    only_keys(
        spec,
        "spec",
        &[
            "jobLabel",
            "targetLabels",
            "podTargetLabels",
            "endpoints",
            "selector",
            "namespaceSelector",
            "sampleLimit",
            "targetLimit",
            "labelLimit",
            "labelNameLengthLimit",
            "labelValueLengthLimit",
            "attachMetadata",
        ],
    )?;
    strict::<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>(&spec["selector"])
        .map_err(|e| format!("spec.selector: {e}"))?;
    if let Some(ns) = spec.get("namespaceSelector") {
        only_keys(ns, "spec.namespaceSelector", &["any", "matchNames"])?;
    }
    let endpoints = spec["endpoints"].as_array().ok_or("no spec.endpoints")?;
    for (i, ep) in endpoints.iter().enumerate() {
        let at = format!("spec.endpoints[{i}]");
        only_keys(
            ep,
            &at,
            &[
                "port",
                "targetPort",
                "path",
                "scheme",
                "params",
                "interval",
                "scrapeTimeout",
                "tlsConfig",
                "bearerTokenSecret",
                "authorization",
                "honorLabels",
                "honorTimestamps",
                "basicAuth",
                "oauth2",
                "metricRelabelings",
                "relabelings",
                "proxyUrl",
                "followRedirects",
                "enableHttp2",
                "filterRunning",
            ],
        )?;
        for key in ["relabelings", "metricRelabelings"] {
            for (j, r) in ep[key].as_array().into_iter().flatten().enumerate() {
                only_keys(
                    r,
                    &format!("{at}.{key}[{j}]"),
                    &[
                        "sourceLabels",
                        "separator",
                        "targetLabel",
                        "regex",
                        "modulus",
                        "replacement",
                        "action",
                    ],
                )?;
            }
        }
    }
    Ok(())
}

/// A PrometheusRule (prometheus-operator's custom resource): its spec has only `groups`, each a
/// Prometheus rule group (the rules themselves are checked by `promtool check rules`, which
/// rejects unknown fields: monitoring.rs).
fn check_prometheusrule(v: &Value) -> Result<(), String> {
    only_keys(v, "", &["apiVersion", "kind", "metadata", "spec"])?;
    only_keys(&v["spec"], "spec", &["groups"])?;
    for (i, g) in v["spec"]["groups"]
        .as_array()
        .ok_or("no spec.groups")?
        .iter()
        .enumerate()
    {
        only_keys(
            g,
            &format!("spec.groups[{i}]"),
            &[
                "name",
                "interval",
                "rules",
                "partial_response_strategy",
                "limit",
            ],
        )?;
    }
    Ok(())
}

/// A PyTorchJob (a custom resource): the known top-level shape, and every replica's pod
/// template as a strict `PodTemplateSpec`.
fn check_pytorchjob(v: &Value) -> Result<(), String> {
    let spec = v["spec"].as_object().ok_or("no spec")?;
    for key in spec.keys() {
        if ![
            "runPolicy",
            "pytorchReplicaSpecs",
            "elasticPolicy",
            "nprocPerNode",
        ]
        .contains(&key.as_str())
        {
            return Err(format!("spec.{key}: not a PyTorchJob field"));
        }
    }
    let replicas = spec["pytorchReplicaSpecs"]
        .as_object()
        .ok_or("no spec.pytorchReplicaSpecs")?;
    if replicas.is_empty() {
        return Err("spec.pytorchReplicaSpecs is empty".into());
    }
    for (role, r) in replicas {
        if !["Master", "Worker"].contains(&role.as_str()) {
            return Err(format!("replica type {role}: not Master or Worker"));
        }
        for key in r.as_object().ok_or("replica spec is not a map")?.keys() {
            if !["replicas", "restartPolicy", "template"].contains(&key.as_str()) {
                return Err(format!("{role}.{key}: not a ReplicaSpec field"));
            }
        }
        strict::<PodTemplateSpec>(&r["template"]).map_err(|e| format!("{role}.template: {e}"))?;
    }
    Ok(())
}

/// An MPIJob (mpi-operator's custom resource, v2beta1): the known top-level shape, a Launcher
/// and Workers, every replica's pod template a strict `PodTemplateSpec`.
fn check_mpijob(v: &Value) -> Result<(), String> {
    let spec = v["spec"].as_object().ok_or("no spec")?;
    for key in spec.keys() {
        if ![
            "slotsPerWorker",
            "runLauncherAsWorker",
            "runPolicy",
            "mpiReplicaSpecs",
            "sshAuthMountPath",
            "launcherCreationPolicy",
            "mpiImplementation",
        ]
        .contains(&key.as_str())
        {
            return Err(format!("spec.{key}: not an MPIJob field"));
        }
    }
    let replicas = spec["mpiReplicaSpecs"]
        .as_object()
        .ok_or("no spec.mpiReplicaSpecs")?;
    for role in ["Launcher", "Worker"] {
        if !replicas.contains_key(role) {
            return Err(format!("spec.mpiReplicaSpecs has no {role}"));
        }
    }
    for (role, r) in replicas {
        if !["Launcher", "Worker"].contains(&role.as_str()) {
            return Err(format!("replica type {role}: not Launcher or Worker"));
        }
        for key in r.as_object().ok_or("replica spec is not a map")?.keys() {
            if !["replicas", "restartPolicy", "template"].contains(&key.as_str()) {
                return Err(format!("{role}.{key}: not a ReplicaSpec field"));
            }
        }
        strict::<PodTemplateSpec>(&r["template"]).map_err(|e| format!("{role}.template: {e}"))?;
    }
    Ok(())
}

/// An ElasticJob (DLRover's custom resource, v1alpha1): the fields of its spec and of each
/// replica (DLRover's go/elasticjob/api/v1alpha1/elasticjob_types.go, `ElasticJobSpec` and
/// `ReplicaSpec`, which inlines pkg/common/api/v1/types.go `ReplicaSpec`, at v0.6.1), the
/// replica types the master knows (dlrover/python/common/constants.py `NodeType`, and the
/// controller's `dlrover-master`), every template a strict `PodTemplateSpec`.
fn check_elasticjob(v: &Value) -> Result<(), String> {
    only_keys(v, "", &["apiVersion", "kind", "metadata", "spec"])?;
    let spec = &v["spec"];
    only_keys(
        spec,
        "spec",
        &[
            "distributionStrategy",
            "resourceLimits",
            "optimizeMode",
            "brainService",
            "replicaSpecs",
            "envs",
            "suspend",
        ],
    )?;
    let replicas = spec["replicaSpecs"]
        .as_object()
        .ok_or("no spec.replicaSpecs")?;
    if !replicas.contains_key("worker") {
        return Err("spec.replicaSpecs has no worker".into());
    }
    for (role, r) in replicas {
        if !["dlrover-master", "worker", "ps", "chief", "evaluator"].contains(&role.as_str()) {
            return Err(format!("replica type {role}: not one DLRover knows"));
        }
        only_keys(
            r,
            &format!("spec.replicaSpecs.{role}"),
            &[
                "replicas",
                "template",
                "restartPolicy",
                "restartCount",
                "autoScale",
                "restartTimeout",
                "priority",
                "BatchScheduler",
            ],
        )?;
        strict::<PodTemplateSpec>(&r["template"]).map_err(|e| format!("{role}.template: {e}"))?;
    }
    Ok(())
}

#[test]
fn every_document_is_a_faithful_instance_of_its_type() {
    let docs = common::load("");
    let files: std::collections::BTreeSet<_> = docs.iter().map(|d| d.file.as_str()).collect();
    for required in [
        "kustomization.yaml",
        "base/kustomization.yaml",
        "base/daemonset.yaml",
        "base/coordinator.yaml",
        "examples/job.yaml",
        "examples/pytorchjob.yaml",
        "examples/elasticjob.yaml",
    ] {
        assert!(files.contains(required), "{required} not found");
    }
    let errors: Vec<String> = docs
        .iter()
        .filter_map(|d| check_doc(d).err().map(|e| format!("{}: {e}", d.at())))
        .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // Every document is checked against something: at least the kinds we ship.
    let kinds: std::collections::BTreeSet<_> = docs.iter().map(|d| d.kind()).collect();
    for k in [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "DaemonSet",
        "Deployment",
        "ConfigMap",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "Job",
        "PyTorchJob",
        "ElasticJob",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
    ] {
        assert!(kinds.contains(k), "no {k} under manifests/");
    }
}

/// The strict check itself catches what it is there for.
#[test]
fn the_strict_check_catches_misplaced_and_mistyped_fields() {
    let docs = common::base_objects();
    let ds = common::find(&docs, "DaemonSet", "faultline-agent");
    assert!(check_doc(ds).is_ok());

    let mut typo = ds.clone();
    typo.value["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always".into();
    let err = check_doc(&typo).expect_err("a typo'd field must be rejected");
    assert!(err.contains("imagePullPolicyy"), "{err}");

    let mut nested = ds.clone();
    nested.value["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesystem"] =
        true.into();
    assert!(check_doc(&nested).is_err(), "a field at the wrong level");

    let mut typed = ds.clone();
    typed.value["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "30".into();
    assert!(
        check_doc(&typed).is_err(),
        "a string where a number belongs"
    );

    let job = common::load("examples")
        .into_iter()
        .find(|d| d.kind() == "PyTorchJob")
        .expect("a PyTorchJob");
    let mut bad = job.clone();
    bad.value["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["initContainer"] =
        Value::Array(vec![]);
    assert!(
        check_doc(&bad).is_err(),
        "a typo inside a PyTorchJob template"
    );

    let ej = common::load("examples")
        .into_iter()
        .find(|d| d.kind() == "ElasticJob")
        .expect("an ElasticJob");
    assert!(check_doc(&ej).is_ok());
    let mut bad = ej.clone();
    bad.value["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["initContainer"] =
        Value::Array(vec![]);
    assert!(
        check_doc(&bad).is_err(),
        "a typo inside an ElasticJob template"
    );
    let mut bad = ej.clone();
    bad.value["spec"]["replicaSpecs"]["worker"]["restartCounts"] = 3.into();
    assert!(check_doc(&bad).is_err(), "a typo in an ElasticJob replica");

    let mut unknown = ds.clone();
    unknown.value["kind"] = "DeamonSet".into();
    assert!(check_doc(&unknown).is_err(), "an unknown kind");

    // The coordinator's Deployment is checked as strictly.
    let deploy = common::find(&docs, "Deployment", "faultline-coordinator");
    assert!(check_doc(deploy).is_ok());
    let mut misplaced = deploy.clone();
    misplaced.value["spec"]["template"]["spec"]["containers"][0]["runAsNonRoot"] = true.into();
    let err = check_doc(&misplaced).expect_err("a pod-level field in the container");
    assert!(err.contains("runAsNonRoot"), "{err}");
}
