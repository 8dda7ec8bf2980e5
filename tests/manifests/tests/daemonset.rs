//! The agent's DaemonSet: flags the agent really has, mounts that match them, the downward API,
//! scheduling, resources, probes and security settings docs/kubernetes.md describes.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Volume};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::common::{self, IMAGE, IMAGE_TAG, NAMESPACE, SERVICE_ACCOUNT};

struct Agent {
    pod: PodSpec,
    container: Container,
    /// `--flag` -> value (`None` for a switch).
    flags: BTreeMap<String, Option<String>>,
}

fn agent() -> Agent {
    let docs = common::base_objects();
    let ds: DaemonSet = common::find(&docs, "DaemonSet", "faultline-agent").to();
    assert_eq!(ds.metadata.namespace.as_deref(), Some(NAMESPACE));
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(pod.containers.len(), 1, "one container");
    let container = pod.containers[0].clone();
    let args = container.args.clone().unwrap_or_default();
    let list = common::flags(&args);
    let flags: BTreeMap<_, _> = list.iter().cloned().collect();
    assert_eq!(flags.len(), list.len(), "a flag given twice: {args:?}");
    Agent {
        pod,
        container,
        flags,
    }
}

fn flag<'a>(a: &'a Agent, name: &str) -> &'a str {
    a.flags
        .get(name)
        .unwrap_or_else(|| panic!("{name} not given"))
        .as_deref()
        .unwrap_or_else(|| panic!("{name} has no value"))
}

fn volume<'a>(a: &'a Agent, name: &str) -> &'a Volume {
    a.pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The volume mounted at `path`, and whether read-only.
fn mounted_at<'a>(a: &'a Agent, path: &str) -> (&'a Volume, bool) {
    let m = a
        .container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == path)
        .unwrap_or_else(|| panic!("nothing mounted at {path}"));
    assert!(
        m.sub_path.is_none() && m.sub_path_expr.is_none(),
        "{path}: subPath"
    );
    (volume(a, &m.name), m.read_only == Some(true))
}

#[test]
fn the_agent_runs_with_flags_it_has() {
    let a = agent();
    let c = &a.container;
    assert_eq!(
        c.image.as_deref(),
        Some(format!("{IMAGE}:{IMAGE_TAG}").as_str())
    );
    assert_eq!(
        c.command.as_deref(),
        Some(&["faultline-agent".to_string()][..])
    );
    let mut known = common::agent_flags();
    let bin = common::clap_flags("faultline/src/bin/faultline-agent.rs", "struct Cli");
    assert!(bin.contains(&"--log-format".to_string()), "{bin:?}");
    known.push("--log-format".into());
    for f in a.flags.keys() {
        assert!(
            known.contains(f),
            "{f} is not a faultline-agent flag ({known:?})"
        );
    }
    assert_eq!(flag(&a, "--policy"), "/etc/faultline/policy.yaml");
    assert_eq!(flag(&a, "--state-dir"), "/run/faultline");
    assert_eq!(flag(&a, "--data-dir"), "/var/lib/faultline");
    assert_eq!(flag(&a, "--kmsg-path"), "/dev/kmsg");
    assert!(!a.flags.contains_key("--standalone"));
    assert!(!a.flags.contains_key("--no-kmsg"));
}

#[test]
fn the_downward_api_and_nvidia_environment_are_set() {
    let a = agent();
    let env: BTreeMap<_, _> = a
        .container
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    for (name, field) in [
        ("NODE_NAME", "spec.nodeName"),
        ("POD_IP", "status.podIP"),
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        let e = env.get(name).unwrap_or_else(|| panic!("{name} not set"));
        let got = e
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        assert_eq!(got, Some(field), "{name}");
    }
    // The agent reads its node name, namespace and pod name from these (POD_IP is for the
    // peer checks).
    let cmd = common::agent_command();
    for name in ["NODE_NAME", "POD_NAMESPACE", "POD_NAME"] {
        assert!(
            cmd.get_arguments()
                .any(|a| a.get_env().is_some_and(|e| e == name)),
            "the agent reads {name}"
        );
    }
    for (name, value) in [
        ("NVIDIA_VISIBLE_DEVICES", "all"),
        ("NVIDIA_DRIVER_CAPABILITIES", "utility"),
    ] {
        assert_eq!(
            env.get(name).and_then(|e| e.value.as_deref()),
            Some(value),
            "{name}"
        );
    }
    // NVML without allocating a GPU: no nvidia.com/gpu resource.
    let res = a.container.resources.clone().expect("resources");
    for m in [
        res.requests.unwrap_or_default(),
        res.limits.unwrap_or_default(),
    ] {
        assert!(!m.keys().any(|k| k.starts_with("nvidia.com/")), "{m:?}");
    }
}

#[test]
fn mounts_match_the_flags() {
    let a = agent();
    // /dev/kmsg: the host's character device, read-only, where --kmsg-path points.
    let (kmsg, ro) = mounted_at(&a, flag(&a, "--kmsg-path"));
    let hp = kmsg.host_path.as_ref().expect("kmsg is a hostPath");
    assert_eq!(hp.path, "/dev/kmsg");
    assert_eq!(hp.type_.as_deref(), Some("CharDevice"));
    assert!(ro, "/dev/kmsg must be read-only");

    // The state directory: the host's /run/faultline (survives pod restarts, not reboots).
    let state_dir = flag(&a, "--state-dir");
    let (state, ro) = mounted_at(&a, state_dir);
    let hp = state.host_path.as_ref().expect("state is a hostPath");
    assert_eq!(hp.path, "/run/faultline");
    assert_eq!(
        hp.path, state_dir,
        "jobs read the record at the same path as the agent"
    );
    assert_eq!(hp.type_.as_deref(), Some("DirectoryOrCreate"));
    assert!(!ro, "the agent writes its state");

    // The data directory: on the host's disk, so a reboot keeps it (/run is a tmpfs).
    let data_dir = flag(&a, "--data-dir");
    let (data, ro) = mounted_at(&a, data_dir);
    let hp = data.host_path.as_ref().expect("data is a hostPath");
    assert_eq!(hp.path, "/var/lib/faultline");
    assert!(
        !hp.path.starts_with("/run/")
            && !hp.path.starts_with("/dev/")
            && !hp.path.starts_with("/tmp/"),
        "durable state on a tmpfs is lost at the first reboot"
    );
    assert_eq!(hp.type_.as_deref(), Some("DirectoryOrCreate"));
    assert!(!ro, "the agent writes its durable state");

    // The policy: the ConfigMap mounted as a directory (no subPath: updates propagate), and
    // --policy names a key of it.
    let policy = Path::new(flag(&a, "--policy"));
    let dir = policy
        .parent()
        .expect("a directory")
        .to_str()
        .expect("utf-8");
    let file = policy.file_name().expect("a file").to_str().expect("utf-8");
    let (vol, ro) = mounted_at(&a, dir);
    assert!(ro, "the policy mount is read-only");
    let cm = vol
        .config_map
        .as_ref()
        .expect("the policy is a ConfigMap volume");
    assert_eq!(cm.name, "faultline-policy");
    assert!(cm.items.is_none(), "no items: the keys are the file names");
    let docs = common::base_objects();
    let cm: ConfigMap = common::find(&docs, "ConfigMap", "faultline-policy").to();
    assert_eq!(cm.metadata.namespace.as_deref(), Some(NAMESPACE));
    assert!(
        cm.data.unwrap_or_default().contains_key(file),
        "no key {file}"
    );

    // Nothing else is writable: a read-only root.
    let sc = a
        .container
        .security_context
        .clone()
        .expect("securityContext");
    assert_eq!(sc.read_only_root_filesystem, Some(true));
}

#[test]
fn scheduling_and_lifecycle() {
    let a = agent();
    let p = &a.pod;
    assert_eq!(p.service_account_name.as_deref(), Some(SERVICE_ACCOUNT));
    assert_eq!(p.automount_service_account_token, Some(true));
    assert_eq!(
        p.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert_ne!(p.host_network, Some(true));
    assert_ne!(p.host_pid, Some(true));
    assert_eq!(p.termination_grace_period_seconds, Some(30));
    assert!(p.node_selector.is_none(), "runs on every node by default");
    assert!(p.affinity.is_none(), "runs on every node by default");
    let tol = p.tolerations.clone().unwrap_or_default();
    assert_eq!(tol.len(), 1, "{tol:?}");
    assert_eq!(tol[0].operator.as_deref(), Some("Exists"));
    assert!(
        tol[0].key.is_none() && tol[0].effect.is_none(),
        "tolerates everything"
    );

    let docs = common::base_objects();
    let ds: DaemonSet = common::find(&docs, "DaemonSet", "faultline-agent").to();
    let spec = ds.spec.expect("spec");
    let strategy = spec.update_strategy.expect("updateStrategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        strategy.rolling_update.and_then(|r| r.max_unavailable),
        Some(IntOrString::String("10%".into()))
    );
    let selector = spec.selector.match_labels.expect("matchLabels");
    let labels = spec
        .template
        .metadata
        .and_then(|m| m.labels)
        .expect("labels");
    for (k, v) in &selector {
        assert_eq!(labels.get(k), Some(v), "the selector matches the template");
    }
}

#[test]
fn resources_probes_and_privileges() {
    let a = agent();
    let c = &a.container;
    let res = c.resources.clone().expect("resources");
    let requests = res.requests.expect("requests");
    let limits = res.limits.expect("limits");
    assert_eq!(requests.get("cpu"), Some(&Quantity("10m".into())));
    assert_eq!(requests.get("memory"), Some(&Quantity("32Mi".into())));
    assert_eq!(limits.get("memory"), Some(&Quantity("128Mi".into())));
    assert!(
        !limits.contains_key("cpu"),
        "no CPU limit: throttling delays detection"
    );

    // The listening port: the agent's default port, named http, used by both probes. The
    // address is given, on every interface of the pod (the agent's own default off a pod is
    // loopback, where the kubelet's probes would not reach it).
    let port = i32::from(faultline_agent::http::DEFAULT_PORT);
    assert_eq!(flag(&a, "--listen"), format!("0.0.0.0:{port}"));
    let ports = c.ports.clone().unwrap_or_default();
    assert_eq!(ports.len(), 2);
    assert_eq!(ports[0].container_port, port);
    assert_eq!(ports[0].name.as_deref(), Some("http"));
    let peer_port: i32 = common::agent_default("peer-listen")
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("--peer-listen's default port");
    assert_eq!(ports[1].container_port, peer_port);
    assert_eq!(ports[1].name.as_deref(), Some("peer"));
    for (probe, path) in [
        (c.liveness_probe.clone(), "/healthz"),
        (c.readiness_probe.clone(), "/readyz"),
    ] {
        let get = probe.and_then(|p| p.http_get).expect("an httpGet probe");
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(get.port, IntOrString::String("http".into()));
    }
    let http =
        std::fs::read_to_string(common::repo_root().join("agent/src/http.rs")).expect("http.rs");
    assert!(http.contains(".route(\"/healthz\"") && http.contains(".route(\"/readyz\""));

    let sc = c.security_context.clone().expect("securityContext");
    assert_eq!(sc.privileged, Some(true));
    assert_eq!(sc.run_as_user, Some(0));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
}

/// The audience of the agents' peer-check tokens: what the coordinator's TokenReview asks for
/// (`AGENT_AUDIENCE` in coordinator/src/tokens.rs).
fn peer_audience() -> String {
    let text = std::fs::read_to_string(common::repo_root().join("coordinator/src/tokens.rs"))
        .expect("tokens.rs");
    let at = text
        .find("pub const AGENT_AUDIENCE: &str = \"")
        .expect("AGENT_AUDIENCE");
    let rest = &text[at..];
    let start = rest.find('"').expect("\"") + 1;
    let end = rest[start..].find('"').expect("\"") + start;
    rest[start..end].to_string()
}

/// The agent's peer-check credential is a service-account token bound to its pod (and so to its
/// node), for the coordinator's audience, mounted read-only where FAULTLINE_NODE_TOKEN_FILE
/// points; no agent holds a secret shared with the others or the requesters' secret any more.
#[test]
fn the_peer_credential_is_a_pod_bound_token() {
    let a = agent();
    let env: BTreeMap<_, _> = a
        .container
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    let file = env
        .get("FAULTLINE_NODE_TOKEN_FILE")
        .and_then(|e| e.value.as_deref())
        .expect("FAULTLINE_NODE_TOKEN_FILE");
    assert_eq!(file, "/var/run/secrets/faultline-peer/token");
    let (dir, key) = file.rsplit_once('/').expect("a path");
    let (vol, ro) = mounted_at(&a, dir);
    assert!(ro, "the token mount is read-only");
    assert_eq!(vol.name, "faultline-peer-token");
    let sources = vol
        .projected
        .as_ref()
        .and_then(|p| p.sources.clone())
        .expect("a projected volume");
    assert_eq!(sources.len(), 1, "the token alone: {sources:?}");
    let token = sources[0]
        .service_account_token
        .as_ref()
        .expect("a serviceAccountToken source");
    assert_eq!(token.audience.as_deref(), Some(peer_audience().as_str()));
    assert_eq!(token.expiration_seconds, Some(3600));
    assert_eq!(token.path, key, "the file the variable names");

    for gone in [
        "FAULTLINE_PEER_SECRET_FILE",
        "FAULTLINE_PEER_REQUESTER_SECRET_FILE",
    ] {
        assert!(!env.contains_key(gone), "{gone} is set");
    }
    for v in a.pod.volumes.iter().flatten() {
        assert!(v.secret.is_none(), "volume {}: a Secret", v.name);
        let projected = v.projected.iter().flat_map(|p| p.sources.iter().flatten());
        for s in projected {
            assert!(s.secret.is_none(), "volume {}: a Secret", v.name);
        }
    }
}
