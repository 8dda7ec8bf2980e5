//! The peer-check coordinator's Deployment and Service (`manifests/base/coordinator.yaml`): two
//! replicas on different nodes, one active by the Lease and the only one Ready, so the Service
//! reaches it alone; no privileges and no host access; the agents' policy at the agents' path;
//! the properties docs/kubernetes.md, "The coordinator Deployment", promises.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, PodSpec, Service, ServiceAccount, Volume};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::common::{self, COORDINATOR_SERVICE_ACCOUNT, IMAGE, IMAGE_TAG, NAMESPACE};

const NAME: &str = "faultline-coordinator";

struct Coordinator {
    deploy: Deployment,
    labels: BTreeMap<String, String>,
    pod: PodSpec,
    container: Container,
    flags: BTreeMap<String, Option<String>>,
}

fn coordinator() -> Coordinator {
    let docs = common::base_objects();
    let deploy: Deployment = common::find(&docs, "Deployment", NAME).to();
    assert_eq!(deploy.metadata.namespace.as_deref(), Some(NAMESPACE));
    let template = deploy.spec.clone().expect("spec").template;
    let labels = template.metadata.and_then(|m| m.labels).expect("labels");
    let pod = template.spec.expect("pod spec");
    assert_eq!(pod.containers.len(), 1, "one container");
    assert!(pod.init_containers.is_none() && pod.ephemeral_containers.is_none());
    let container = pod.containers[0].clone();
    let list = common::flags(&container.args.clone().unwrap_or_default());
    let flags: BTreeMap<_, _> = list.iter().cloned().collect();
    assert_eq!(flags.len(), list.len(), "a flag given twice: {list:?}");
    Coordinator {
        deploy,
        labels,
        pod,
        container,
        flags,
    }
}

/// The agents' pod template labels and spec.
fn agents() -> (BTreeMap<String, String>, PodSpec) {
    let docs = common::base_objects();
    let ds: DaemonSet = common::find(&docs, "DaemonSet", "faultline-agent").to();
    let t = ds.spec.expect("spec").template;
    (
        t.metadata.and_then(|m| m.labels).expect("labels"),
        t.spec.expect("pod spec"),
    )
}

fn flag<'a>(c: &'a Coordinator, name: &str) -> &'a str {
    c.flags
        .get(name)
        .unwrap_or_else(|| panic!("{name} not given"))
        .as_deref()
        .unwrap_or_else(|| panic!("{name} has no value"))
}

fn port(c: &Coordinator, name: &str) -> i32 {
    c.container
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no container port {name}"))
        .container_port
}

/// The volume mounted at `path` in `pod`'s first container, and whether read-only.
fn mounted_at<'a>(pod: &'a PodSpec, path: &str) -> (&'a Volume, bool) {
    let m = pod.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == path)
        .unwrap_or_else(|| panic!("nothing mounted at {path}"));
    assert!(m.sub_path.is_none(), "{path}: subPath");
    let v = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == m.name)
        .unwrap_or_else(|| panic!("no volume {}", m.name));
    (v, m.read_only == Some(true))
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn two_replicas_on_different_nodes_that_can_be_rolled_out() {
    let c = coordinator();
    let spec = c.deploy.spec.clone().expect("spec");
    assert_eq!(spec.replicas, Some(2), "one active, one waiting");
    let selector = spec.selector.match_labels.clone().expect("matchLabels");
    assert!(
        selects(&selector, &c.labels),
        "the selector matches the template"
    );
    let (agent_labels, _) = agents();
    assert!(
        !selects(&selector, &agent_labels),
        "the coordinator's selector must not take the agent pods"
    );

    // Only the active replica is Ready: a rollout must not wait for new replicas to be Ready
    // before it stops the old ones (it would wait forever).
    let strategy = spec.strategy.expect("strategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.expect("rollingUpdate");
    assert_eq!(
        rolling.max_unavailable,
        Some(IntOrString::String("100%".into()))
    );

    // Preferred (not required) anti-affinity by node, on the pods of this Deployment.
    let anti = c
        .pod
        .affinity
        .clone()
        .and_then(|a| a.pod_anti_affinity)
        .expect("podAntiAffinity");
    assert!(anti
        .required_during_scheduling_ignored_during_execution
        .is_none());
    let terms = anti
        .preferred_during_scheduling_ignored_during_execution
        .expect("preferred terms");
    assert_eq!(terms.len(), 1);
    let term = &terms[0].pod_affinity_term;
    assert_eq!(term.topology_key, "kubernetes.io/hostname");
    assert_eq!(
        term.label_selector
            .as_ref()
            .and_then(|s| s.match_labels.as_ref()),
        Some(&selector)
    );
}

#[test]
fn the_coordinator_runs_unprivileged_without_host_access() {
    let c = coordinator();
    assert_eq!(
        c.container.image.as_deref(),
        Some(format!("{IMAGE}:{IMAGE_TAG}").as_str()),
        "the agents' image"
    );
    assert_eq!(
        c.container.command.as_deref(),
        Some(&["faultline-coordinator".to_string()][..])
    );
    let p = &c.pod;
    assert_eq!(
        p.service_account_name.as_deref(),
        Some(COORDINATOR_SERVICE_ACCOUNT)
    );
    let docs = common::base_objects();
    let sa: ServiceAccount =
        common::find(&docs, "ServiceAccount", COORDINATOR_SERVICE_ACCOUNT).to();
    assert_eq!(sa.metadata.namespace.as_deref(), Some(NAMESPACE));
    for (what, v) in [
        ("hostNetwork", p.host_network),
        ("hostPID", p.host_pid),
        ("hostIPC", p.host_ipc),
    ] {
        assert_ne!(v, Some(true), "{what}");
    }
    for v in p.volumes.iter().flatten() {
        assert!(v.host_path.is_none(), "volume {}: a hostPath", v.name);
    }
    let psc = p.security_context.clone().expect("pod securityContext");
    assert_eq!(psc.run_as_non_root, Some(true));
    assert!(psc.run_as_user.is_some_and(|u| u != 0), "{psc:?}");
    assert!(psc.run_as_group.is_some_and(|g| g != 0), "{psc:?}");
    assert_eq!(
        psc.seccomp_profile.map(|s| s.type_).as_deref(),
        Some("RuntimeDefault")
    );
    let sc = c
        .container
        .security_context
        .clone()
        .expect("securityContext");
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_ne!(sc.run_as_user, Some(0));
    let caps = sc.capabilities.expect("capabilities");
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    assert!(caps.add.is_none(), "{:?}", caps.add);
}

#[test]
fn the_environment_the_policy_and_the_requester_secret() {
    let c = coordinator();
    let env: BTreeMap<_, _> = c
        .container
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    // The pod's name (--name), its IP (the address the agents report to) and its namespace
    // (--namespace: where the agents, the Lease and faultline-peercheck are, the install's).
    for (name, field) in [
        ("POD_NAME", "metadata.name"),
        ("POD_IP", "status.podIP"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        let got = env
            .get(name)
            .unwrap_or_else(|| panic!("{name} not set"))
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        assert_eq!(got, Some(field), "{name}");
    }
    // No GPU: the NVIDIA runtime's variables are the agents'.
    assert!(!env.keys().any(|k| k.starts_with("NVIDIA_")), "{env:?}");

    // The agents' policy, from the same ConfigMap at the same path, and the same --policy.
    let (_, agent_pod) = agents();
    let agent_args = common::flags(&agent_pod.containers[0].args.clone().unwrap_or_default());
    let agent_policy = agent_args
        .iter()
        .find(|(f, _)| f == "--policy")
        .and_then(|(_, v)| v.clone())
        .expect("the agents' --policy");
    assert_eq!(flag(&c, "--policy"), agent_policy);
    let dir = agent_policy.rsplit_once('/').expect("a directory").0;
    let (theirs, _) = mounted_at(&agent_pod, dir);
    let (ours, ro) = mounted_at(&c.pod, dir);
    assert!(ro, "the policy mount is read-only");
    assert_eq!(
        ours.config_map, theirs.config_map,
        "the agents' policy ConfigMap"
    );
    assert!(ours.config_map.is_some());

    // The members it lists are the agent pods, never its own.
    let selector: BTreeMap<String, String> = flag(&c, "--peer-selector")
        .split(',')
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("key=value");
            (k.to_string(), v.to_string())
        })
        .collect();
    let (agent_labels, _) = agents();
    assert!(selects(&selector, &agent_labels), "{selector:?}");
    assert!(
        !selects(&selector, &c.labels),
        "{selector:?} takes the coordinator's pods"
    );

    // The requesters' secret: optional, read-only, and the file the variable names is in it.
    let file = env
        .get("FAULTLINE_PEER_REQUESTER_SECRET_FILE")
        .and_then(|e| e.value.as_deref())
        .expect("FAULTLINE_PEER_REQUESTER_SECRET_FILE");
    let (dir, key) = file.rsplit_once('/').expect("a path");
    let (vol, ro) = mounted_at(&c.pod, dir);
    assert!(ro, "the secret mount is read-only");
    let secret = vol.secret.as_ref().expect("a Secret volume");
    assert_eq!(
        secret.secret_name.as_deref(),
        Some("faultline-peer-requester")
    );
    assert_eq!(secret.optional, Some(true), "installs without it");
    assert!(secret.items.is_none(), "the keys are the file names: {key}");
}

#[test]
fn ports_probes_and_resources() {
    let c = coordinator();
    let (peer, http) = (port(&c, "peer"), port(&c, "http"));
    assert_eq!((peer, http), (20262, 20263));
    assert_eq!(flag(&c, "--peer-listen"), format!("0.0.0.0:{peer}"));
    assert_eq!(flag(&c, "--listen"), format!("0.0.0.0:{http}"));
    // Ready only while active: the Service routes to the Lease holder alone.
    for (probe, path) in [
        (c.container.liveness_probe.clone(), "/healthz"),
        (c.container.readiness_probe.clone(), "/readyz"),
    ] {
        let get = probe.and_then(|p| p.http_get).expect("an httpGet probe");
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(get.port, IntOrString::String("http".into()));
    }
    let res = c.container.resources.clone().expect("resources");
    let requests = res.requests.expect("requests");
    assert_eq!(requests.get("cpu"), Some(&Quantity("50m".into())));
    assert_eq!(requests.get("memory"), Some(&Quantity("64Mi".into())));
    let limits = res.limits.expect("limits");
    assert_eq!(limits.get("memory"), Some(&Quantity("256Mi".into())));
    assert_eq!(limits.len(), 1, "a memory limit only: {limits:?}");
}

#[test]
fn the_service_reaches_the_ready_coordinator_only() {
    let c = coordinator();
    let docs = common::base_objects();
    let svc: Service = common::find(&docs, "Service", NAME).to();
    assert_eq!(svc.metadata.namespace.as_deref(), Some(NAMESPACE));
    let spec = svc.spec.expect("spec");
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    assert_ne!(spec.cluster_ip.as_deref(), Some("None"), "not headless");
    assert_ne!(
        spec.publish_not_ready_addresses,
        Some(true),
        "the waiting replica must not be an endpoint"
    );
    let selector = spec.selector.expect("selector");
    assert!(selects(&selector, &c.labels), "{selector:?}");
    let (agent_labels, _) = agents();
    assert!(
        !selects(&selector, &agent_labels),
        "the agents are not the coordinator"
    );
    let ports = spec.ports.expect("ports");
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].port, port(&c, "peer"));
    // The agents ask the taint budget here by default
    // (`faultline_agent::sink::kube::coordinator_service`, tested there to be
    // `faultline-coordinator.<namespace>.svc.cluster.local.:20262`).
    assert_eq!(svc.metadata.name.as_deref(), Some("faultline-coordinator"));
    assert_eq!(ports[0].port, 20262);
    assert_eq!(ports[0].name.as_deref(), Some("peer"));
    assert_eq!(
        ports[0].target_port,
        Some(IntOrString::String("peer".into()))
    );
    assert_eq!(ports[0].protocol.as_deref(), Some("TCP"));
}
