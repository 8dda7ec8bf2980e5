//! The examples: every pod template that trains keeps off Unhealthy nodes and waits for a usable
//! record with `faultline wait-healthy`, reading the host's record read-only.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};

use crate::common::{self, IMAGE, IMAGE_TAG};

/// Every pod spec in the examples, with where it came from.
fn pod_specs() -> Vec<(String, PodSpec)> {
    let mut out = Vec::new();
    for d in common::load("examples") {
        match d.kind() {
            "Job" => {
                let job: Job = d.to();
                let spec = job.spec.expect("spec").template.spec.expect("pod spec");
                out.push((d.at(), spec));
            }
            "PyTorchJob" => {
                let replicas = d.value["spec"]["pytorchReplicaSpecs"]
                    .as_object()
                    .expect("pytorchReplicaSpecs");
                assert!(replicas.contains_key("Master") && replicas.contains_key("Worker"));
                for (role, r) in replicas {
                    let t: PodTemplateSpec =
                        common::strict(&r["template"]).unwrap_or_else(|e| panic!("{role}: {e}"));
                    out.push((format!("{} {role}", d.at()), t.spec.expect("pod spec")));
                }
            }
            "MPIJob" => {
                // The launcher starts no training and needs no agent on its node; the workers
                // are held to the same rules as every training pod.
                let t: PodTemplateSpec =
                    common::strict(&d.value["spec"]["mpiReplicaSpecs"]["Worker"]["template"])
                        .unwrap_or_else(|e| panic!("{}: Worker: {e}", d.at()));
                out.push((format!("{} Worker", d.at()), t.spec.expect("pod spec")));
            }
            "ElasticJob" => {
                // DLRover's job master starts no training and needs no agent on its node (its
                // pre-check asks the cluster about the workers' nodes); every other replica
                // trains and is held to the same rules as every training pod.
                let replicas = d.value["spec"]["replicaSpecs"]
                    .as_object()
                    .expect("replicaSpecs");
                assert!(replicas.contains_key("dlrover-master") && replicas.contains_key("worker"));
                for (role, r) in replicas
                    .iter()
                    .filter(|(role, _)| *role != "dlrover-master")
                {
                    let t: PodTemplateSpec =
                        common::strict(&r["template"]).unwrap_or_else(|e| panic!("{role}: {e}"));
                    out.push((format!("{} {role}", d.at()), t.spec.expect("pod spec")));
                }
            }
            // The launcher's identity and its discovery script.
            "ServiceAccount" | "Role" | "RoleBinding" | "ClusterRole" | "ClusterRoleBinding"
            | "ConfigMap" => {}
            other => panic!("{}: unexpected kind {other}", d.at()),
        }
    }
    assert!(
        out.len() >= 5,
        "a Job, a PyTorchJob's Master and Worker, an MPIJob's Worker, an ElasticJob's worker"
    );
    out
}

/// The flags `faultline wait-healthy` has (its own and the global ones).
fn wait_healthy_flags() -> Vec<String> {
    let mut f = common::clap_flags("faultline/src/bin/faultline.rs", "WaitHealthy");
    f.extend(common::clap_flags(
        "faultline/src/bin/faultline.rs",
        "struct Cli",
    ));
    assert!(f.contains(&"--timeout".to_string()), "{f:?}");
    f
}

fn wait_container(at: &str, spec: &PodSpec) -> Container {
    let init = spec.init_containers.clone().unwrap_or_default();
    let found: Vec<_> = init
        .into_iter()
        .filter(|c| {
            let cmd = c.command.clone().unwrap_or_default();
            cmd.first().map(String::as_str) == Some("faultline")
                && cmd.get(1).map(String::as_str) == Some("wait-healthy")
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{at}: one `faultline wait-healthy` init container"
    );
    found[0].clone()
}

#[test]
fn init_containers_wait_for_a_healthy_record() {
    let known = wait_healthy_flags();
    for (at, spec) in pod_specs() {
        let c = wait_container(&at, &spec);
        assert_eq!(
            c.image.as_deref(),
            Some(format!("{IMAGE}:{IMAGE_TAG}").as_str()),
            "{at}: the faultline image"
        );
        let cmd = c.command.clone().unwrap_or_default();
        let mut args = cmd[2..].to_vec();
        args.extend(c.args.clone().unwrap_or_default());
        let flags = common::flags(&args);
        for (f, _) in &flags {
            assert!(known.contains(f), "{at}: {f} is not a wait-healthy flag");
        }
        let timeout = flags
            .iter()
            .find(|(f, _)| f == "--timeout")
            .and_then(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("{at}: no --timeout"));
        assert!(
            timeout.ends_with('m') || timeout.ends_with('s'),
            "{at}: --timeout {timeout}"
        );
        // It reads the record where the agent writes it: the host's /run/faultline, read-only.
        let state_dir = flags
            .iter()
            .find(|(f, _)| f == "--state-dir")
            .and_then(|(_, v)| v.clone())
            .unwrap_or_else(|| "/run/faultline".into());
        let m = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.mount_path == state_dir)
            .unwrap_or_else(|| panic!("{at}: {state_dir} not mounted"));
        assert_eq!(
            m.read_only,
            Some(true),
            "{at}: the record is mounted read-only"
        );
        let vol = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == m.name)
            .unwrap_or_else(|| panic!("{at}: no volume {}", m.name));
        let hp = vol.host_path.as_ref().expect("a hostPath volume");
        assert_eq!(
            hp.path, "/run/faultline",
            "{at}: the agent's state directory"
        );
        // Never a GPU for the check itself.
        let res = c.resources.clone().unwrap_or_default();
        assert!(
            !res.limits
                .unwrap_or_default()
                .contains_key("nvidia.com/gpu"),
            "{at}"
        );
    }
}

#[test]
fn affinity_keeps_off_unhealthy_nodes_and_prefers_healthy_ones() {
    for (at, spec) in pod_specs() {
        let na = spec
            .affinity
            .and_then(|a| a.node_affinity)
            .unwrap_or_else(|| panic!("{at}: no nodeAffinity"));
        let required = na
            .required_during_scheduling_ignored_during_execution
            .unwrap_or_else(|| panic!("{at}: no required node affinity"));
        assert!(!required.node_selector_terms.is_empty());
        // Terms are ORed: every one of them must exclude Unhealthy.
        for term in &required.node_selector_terms {
            let excludes = term.match_expressions.iter().flatten().any(|e| {
                e.key == "faultline.io/health"
                    && e.operator == "NotIn"
                    && e.values.iter().flatten().any(|v| v == "Unhealthy")
            });
            assert!(excludes, "{at}: a term that admits Unhealthy nodes");
        }
        let preferred = na
            .preferred_during_scheduling_ignored_during_execution
            .unwrap_or_default();
        assert!(
            preferred.iter().any(|p| p.weight > 0
                && p.preference.match_expressions.iter().flatten().any(|e| {
                    e.key == "faultline.io/health"
                        && e.operator == "NotIn"
                        && e.values.iter().flatten().any(|v| v == "Degraded")
                })),
            "{at}: prefers nodes that are not Degraded"
        );
        // Nothing tolerates faultline's taints.
        for t in spec.tolerations.iter().flatten() {
            let key = t.key.clone().unwrap_or_default();
            assert!(
                !(key.starts_with("faultline.io/")
                    || (key.is_empty() && t.operator.as_deref() == Some("Exists"))),
                "{at}: tolerates faultline's taints"
            );
        }
    }
}

#[test]
fn the_job_reads_the_local_record() {
    let job = common::load("examples")
        .into_iter()
        .find(|d| d.kind() == "Job")
        .expect("examples/job.yaml");
    let job: Job = job.to();
    let spec = job.spec.expect("spec").template.spec.expect("pod spec");
    let main = &spec.containers[0];
    let script = main.command.clone().unwrap_or_default().join(" ");
    assert!(script.contains("/run/faultline/faults.json"), "{script}");
    assert!(main
        .volume_mounts
        .iter()
        .flatten()
        .any(|m| m.mount_path == "/run/faultline" && m.read_only == Some(true)));
}

/// The PyTorchJob's training containers read the node's record during training, as the Job's
/// trainer does: both replicas run torchrun on train.py from the ConfigMap, which is the Job's
/// loop, with the host's /run/faultline mounted read-only (faultline/tests/cli.rs runs the loop
/// against live and dead agents' records).
#[test]
fn the_pytorchjob_reads_the_local_record_during_training() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let docs = common::load("examples");
    let job: Job = docs
        .iter()
        .find(|d| d.kind() == "Job")
        .expect("examples/job.yaml")
        .to();
    let trainer = &job
        .spec
        .expect("spec")
        .template
        .spec
        .expect("pod spec")
        .containers[0];
    let job_loop = trainer.command.clone().unwrap_or_default()[2].clone();
    let cm = docs
        .iter()
        .find(|d| d.kind() == "ConfigMap" && d.name() == "pytorch-example-train")
        .expect("the PyTorchJob's training script");
    let cm: ConfigMap = cm.to();
    let train = cm.data.unwrap_or_default()["train.py"].clone();
    assert_eq!(train, job_loop, "the same loop as job.yaml's trainer");
    assert!(train.contains("/run/faultline/faults.json") && train.contains("heartbeatBoot"));
    let pytorch = docs
        .iter()
        .find(|d| d.kind() == "PyTorchJob")
        .expect("examples/pytorchjob.yaml");
    for role in ["Master", "Worker"] {
        let t: PodTemplateSpec =
            common::strict(&pytorch.value["spec"]["pytorchReplicaSpecs"][role]["template"])
                .unwrap_or_else(|e| panic!("{role}: {e}"));
        let spec = t.spec.expect("pod spec");
        let c = spec
            .containers
            .iter()
            .find(|c| c.name == "pytorch")
            .unwrap_or_else(|| panic!("{role}: the pytorch container"));
        assert_eq!(
            c.command.clone().unwrap_or_default(),
            ["torchrun", "/workspace/train.py"],
            "{role}"
        );
        let mounts = c.volume_mounts.clone().unwrap_or_default();
        let volume = |path: &str| {
            let m = mounts
                .iter()
                .find(|m| m.mount_path == path)
                .unwrap_or_else(|| panic!("{role}: {path} not mounted"));
            assert_eq!(m.read_only, Some(true), "{role}: {path} read-only");
            spec.volumes
                .iter()
                .flatten()
                .find(|v| v.name == m.name)
                .unwrap_or_else(|| panic!("{role}: no volume {}", m.name))
                .clone()
        };
        assert_eq!(
            volume("/workspace").config_map.map(|c| c.name),
            Some("pytorch-example-train".to_string()),
            "{role}"
        );
        assert_eq!(
            volume("/run/faultline").host_path.map(|h| h.path),
            Some("/run/faultline".to_string()),
            "{role}"
        );
    }
}
