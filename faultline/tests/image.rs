//! The image (manifests/build-image.sh) against the workloads that run it, as `kubectl kustomize
//! manifests/` renders them: the agents' DaemonSet (manifests/base/daemonset.yaml) and the
//! peer-check coordinator's Deployment (manifests/base/coordinator.yaml):
//!
//! - `the_image_runs_as_the_daemonset_and_the_deployment_run_it`: two agent containers of the
//!   image, each started with the `docker run` arguments derived from the DaemonSet
//!   (securityContext, command and args, environment, volumes as bind mounts of temporary
//!   directories, a FIFO at `/dev/kmsg`, the ports, the memory limit), and one coordinator
//!   container derived the same way from the Deployment's pod template (a non-root user, a
//!   read-only root, no capabilities, `faultline-coordinator`, the policy ConfigMap and the
//!   requesters' Secret), on a docker network of their own. The test adds only what an API
//!   server would have given them ([`agent_added_args`], [`coordinator_added_args`]): the
//!   bare-metal peer-check credentials, made with the image's own `faultline keys`. `faultline
//!   check` from an agent container asks the coordinator for a peer check (an allgather at the
//!   policy's size, under the agents' memory limit), and the run the coordinator publishes in
//!   its state directory passed; an Xid written to one node's FIFO appears in its `faults.json`
//!   on the host; `faultline get` and `faultline wait-healthy` run in the container (`docker
//!   exec`) with the exit codes the README gives; the image's probe has its GPU backends and
//!   says in one line that no CUDA library is there.
//! - `the_daemonset_the_deployment_and_the_image_agree`: from `docker image inspect`, the image's
//!   files and the image's own `faultline-agent --help` and `faultline-coordinator --help`: every
//!   command the manifests run exists in the image and runs (the job examples' shell scripts'
//!   tools too), every flag the two workloads pass is one their binary has, the probe is where
//!   the agent looks for it, the environment, the ports (and the probes' ports), the mounts and
//!   the users agree.
//!
//! Both need docker and the built image (the image the rendered DaemonSet names, or
//! `FAULTLINE_TEST_IMAGE`); `.ci/run` builds it and runs these with `--ignored`. Without docker
//! or the image they print why and pass without checking anything, except where `CI` is set:
//! there that is a failure.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::prometheus::{query, start_prometheus, tools_present};
use faultline_coordinator::runs::RunState;
use faultline_core::record::NodeRecord;
use serde_json::Value;

// What the test adds to the two workloads, and why. Nothing else differs.
//
// On Kubernetes the coordinator lists the agent pods (its members), checks each agent's
// pod-bound service-account token by TokenReview, and makes its own key, which the agents read
// from the Lease `faultline-peercheck`. There is no API server here, so every container runs
// without one (no `KUBERNETES_SERVICE_HOST`, no service-account token of the kubelet's: the
// agents run standalone, as on a node whose API server cannot be reached) and the test gives
// them the bare-metal peer-check setup instead (docs/peer-checks.md, "Bare metal"), made with
// the image's own `faultline keys`: each agent its own node key (mounted read-only at
// [`NODE_KEY_DIR`]) and the coordinator's public key; the coordinator the members file, its key
// and the master of the nodes' keys (read-only at [`COORDINATOR_FILES_DIR`]) and a state
// directory for the runs it publishes (a writable mount at [`COORDINATOR_STATE_DIR`], owned by
// the Deployment's user: its root is read-only). The DaemonSet's projected token volume
// (`faultline-peer-token`) is an empty directory: the kubelet would write the token there, and a
// standalone agent does not read it. The requesters' Secret the coordinator mounts is also
// mounted read-only at [`REQUESTER_DIR`] in the agent containers, where `faultline check` (a
// requester, as a job's launcher would be) reads it.

/// Where an agent container finds its node key (`faultline keys node`).
const NODE_KEY_DIR: &str = "/etc/faultline-node-key";
/// The coordinator's members file, key and master of the nodes' keys.
const COORDINATOR_FILES_DIR: &str = "/etc/faultline-coordinator-files";
/// The coordinator's `--state-dir`: `peercheck.json`, the last run it published.
const COORDINATOR_STATE_DIR: &str = "/var/lib/faultline-coordinator";
/// The requesters' secret, for `faultline check` in an agent container.
const REQUESTER_DIR: &str = "/etc/faultline-requester";

/// The arguments the test appends to the DaemonSet's: the agent's bare-metal peer-check
/// credentials (`public_key`: the coordinator's, as `faultline keys coordinator` printed it).
fn agent_added_args(public_key: &str) -> Vec<String> {
    vec![
        format!("--peer-node-key-file={NODE_KEY_DIR}/node.key"),
        format!("--peer-coordinator-key={public_key}"),
    ]
}

/// The arguments the test appends to the Deployment's: the bare-metal coordinator's members,
/// keys and state directory.
fn coordinator_added_args() -> Vec<String> {
    vec![
        format!("--members={COORDINATOR_FILES_DIR}/members"),
        format!("--key-file={COORDINATOR_FILES_DIR}/coordinator.key"),
        format!("--node-key-master-file={COORDINATOR_FILES_DIR}/master"),
        format!("--state-dir={COORDINATOR_STATE_DIR}"),
    ]
}

/// The CLI's name, as the job examples call it.
const CLI: &str = "faultline";

// ---------------------------------------------------------------------------------------------
// The manifests

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn yaml_docs(text: &str) -> Vec<Value> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text).unwrap();
    docs.into_iter().filter(|v| !v.is_null()).collect()
}

/// The install as `kubectl apply -k manifests/` would apply it: kubectl's kustomize where
/// kubectl is installed, else the base's files as written (the same objects without the
/// kustomize labels).
fn rendered() -> Vec<Value> {
    match Command::new("kubectl")
        .args(["kustomize"])
        .arg(repo().join("manifests"))
        .output()
    {
        Ok(out) => {
            assert!(
                out.status.success(),
                "kubectl kustomize manifests/: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            yaml_docs(&String::from_utf8(out.stdout).unwrap())
        }
        Err(e) => {
            eprintln!("kubectl not found ({e}): reading manifests/base as written");
            ["daemonset.yaml", "coordinator.yaml", "policy.yaml"]
                .iter()
                .flat_map(|f| {
                    yaml_docs(
                        &std::fs::read_to_string(repo().join("manifests/base").join(f)).unwrap(),
                    )
                })
                .collect()
        }
    }
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name} in the rendered manifests"))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// A volume as the container sees it.
#[derive(Debug, Clone)]
struct Mount {
    name: String,
    path: String,
    read_only: bool,
    /// The volume's source: `hostPath`, `configMap`, `secret` or `projected`, and its object.
    volume: Value,
}

/// The one container of a workload's pod template, in the terms `docker run` needs.
#[derive(Debug)]
struct Workload {
    /// `DaemonSet/faultline-agent`, for messages.
    what: String,
    namespace: String,
    image: String,
    command: Vec<String>,
    args: Vec<String>,
    /// Name, and the literal value or the downward-API field path.
    env: Vec<(String, Result<String, String>)>,
    /// Name, port, protocol.
    ports: Vec<(String, u16, String)>,
    mounts: Vec<Mount>,
    privileged: bool,
    read_only_root: bool,
    /// `allowPrivilegeEscalation: false`: docker's `no-new-privileges`.
    no_new_privileges: bool,
    /// `capabilities.drop`, as docker's `--cap-drop` spells them.
    cap_drop: Vec<String>,
    /// `runAsNonRoot` (the container's, else the pod's).
    run_as_non_root: bool,
    /// `runAsUser` and `runAsGroup` (the container's, else the pod's; the group defaults to the
    /// user).
    user: Option<(u64, u64)>,
    memory_limit: u64,
    /// The port name the kubelet's probes use, and the readiness and liveness paths.
    probe_port: String,
    readiness_path: String,
    liveness_path: String,
}

fn quantity(q: &str) -> u64 {
    let (num, mult) = [("Gi", 1u64 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)]
        .iter()
        .find_map(|(s, m)| q.strip_suffix(s).map(|n| (n, *m)))
        .unwrap_or((q, 1));
    num.parse::<u64>().unwrap() * mult
}

/// The container of the pod template of `kind`/`name` (a DaemonSet or a Deployment).
fn workload(docs: &[Value], kind: &str, name: &str) -> Workload {
    let w = find(docs, kind, name);
    let pod = &w["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1, "{kind}/{name} runs one container");
    let c = &containers[0];
    let volumes: BTreeMap<&str, &Value> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    let sc = &c["securityContext"];
    let pod_sc = &pod["securityContext"];
    // The container's setting, else the pod's (kubernetes, pkg/securitycontext/util.go,
    // DetermineEffectiveSecurityContext: a container's field overrides the pod's).
    let either = |field: &str| -> Value {
        match &sc[field] {
            Value::Null => pod_sc[field].clone(),
            v => v.clone(),
        }
    };
    let user = either("runAsUser")
        .as_u64()
        .map(|u| (u, either("runAsGroup").as_u64().unwrap_or(u)));
    let probe_path = |probe: &str| -> String {
        c[probe]["httpGet"]["path"]
            .as_str()
            .unwrap_or_else(|| panic!("{kind}/{name}: no {probe} httpGet path"))
            .to_string()
    };
    Workload {
        what: format!("{kind}/{name}"),
        namespace: w["metadata"]["namespace"].as_str().unwrap().to_string(),
        image: c["image"].as_str().unwrap().to_string(),
        command: strings(&c["command"]),
        args: strings(&c["args"]),
        env: c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let name = e["name"].as_str().unwrap().to_string();
                let v = match e["value"].as_str() {
                    Some(v) => Ok(v.to_string()),
                    None => Err(e["valueFrom"]["fieldRef"]["fieldPath"]
                        .as_str()
                        .unwrap_or_else(|| panic!("env {name}: neither a value nor a fieldRef"))
                        .to_string()),
                };
                (name, v)
            })
            .collect(),
        ports: c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["name"].as_str().unwrap().to_string(),
                    p["containerPort"].as_u64().unwrap() as u16,
                    p["protocol"].as_str().unwrap_or("TCP").to_lowercase(),
                )
            })
            .collect(),
        mounts: c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let name = m["name"].as_str().unwrap().to_string();
                Mount {
                    path: m["mountPath"].as_str().unwrap().to_string(),
                    read_only: m["readOnly"].as_bool().unwrap_or(false),
                    volume: (*volumes
                        .get(name.as_str())
                        .unwrap_or_else(|| panic!("volumeMount {name} has no volume")))
                    .clone(),
                    name,
                }
            })
            .collect(),
        privileged: sc["privileged"].as_bool().unwrap_or(false),
        read_only_root: sc["readOnlyRootFilesystem"].as_bool().unwrap_or(false),
        no_new_privileges: sc["allowPrivilegeEscalation"] == false,
        cap_drop: strings(&sc["capabilities"]["drop"]),
        run_as_non_root: either("runAsNonRoot").as_bool().unwrap_or(false),
        user,
        memory_limit: quantity(c["resources"]["limits"]["memory"].as_str().unwrap()),
        probe_port: c["readinessProbe"]["httpGet"]["port"]
            .as_str()
            .unwrap()
            .to_string(),
        readiness_path: probe_path("readinessProbe"),
        liveness_path: probe_path("livenessProbe"),
    }
}

fn agent_workload(docs: &[Value]) -> Workload {
    workload(docs, "DaemonSet", "faultline-agent")
}

fn coordinator_workload(docs: &[Value]) -> Workload {
    workload(docs, "Deployment", "faultline-coordinator")
}

impl Workload {
    fn port(&self, name: &str) -> u16 {
        self.ports
            .iter()
            .find(|p| p.0 == name)
            .unwrap_or_else(|| panic!("{}: no containerPort named {name}", self.what))
            .1
    }

    /// The arguments after the command's name: the command's own, then `args`.
    fn arguments(&self) -> impl Iterator<Item = &String> {
        self.command.iter().skip(1).chain(&self.args)
    }

    /// The value the container's args or environment give a flag (`--flag=v`, `--flag v`, or
    /// its variable), if any.
    fn flag(&self, flag: &str, var: Option<&str>) -> Option<String> {
        let mut it = self.arguments();
        while let Some(a) = it.next() {
            if let Some(v) = a.strip_prefix(&format!("{flag}=")) {
                return Some(v.to_string());
            }
            if a == flag {
                return it.next().cloned();
            }
        }
        let var = var?;
        self.env
            .iter()
            .find(|(n, _)| n == var)
            .and_then(|(_, v)| v.clone().ok())
    }

    /// The mount a container path lies on (the deepest).
    fn mount_of(&self, path: &str) -> Option<&Mount> {
        self.mounts
            .iter()
            .filter(|m| path == m.path || path.starts_with(&format!("{}/", m.path)))
            .max_by_key(|m| m.path.len())
    }

    /// The files under a Secret mount that the container's args or environment name, each
    /// with a test secret of its own (the operator creates these Secrets: docs/peer-checks.md).
    fn secret_files(&self) -> BTreeMap<String, String> {
        self.arguments()
            .filter_map(|a| a.split_once('=').map(|(_, v)| v.to_string()))
            .chain(self.env.iter().filter_map(|(_, v)| v.clone().ok()))
            .filter(|p| {
                self.mount_of(p)
                    .is_some_and(|m| m.volume.get("secret").is_some())
            })
            .enumerate()
            .map(|(i, p)| (p, format!("image-test-secret-{i}-0123456789abcdef0123")))
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// docker

fn docker(args: &[&str]) -> Output {
    Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("docker {args:?}: {e}"))
}

fn ok(args: &[&str]) -> String {
    let out = docker(args);
    assert!(
        out.status.success(),
        "docker {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The image under test, or `None` (said why) where there is no docker or no image and `CI` is
/// not set.
fn image_or_skip(agent: &Workload) -> Option<String> {
    let image = std::env::var("FAULTLINE_TEST_IMAGE").unwrap_or_else(|_| agent.image.clone());
    let why = match Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", &image])
        .output()
    {
        Ok(o) if o.status.success() => return Some(image),
        Ok(o) => format!(
            "docker cannot inspect {image} (no daemon, or the image is not built: \
             manifests/build-image.sh): {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => format!("no docker CLI: {e}"),
    };
    assert!(std::env::var_os("CI").is_none(), "CI is set: {why}");
    eprintln!("skipped: {why}");
    None
}

/// `privileged: true` as `docker run` arguments. `--privileged` asks runc for every capability
/// the kernel has; where this machine's own bounding set lacks some (a CI machine that is itself
/// a container), runc refuses it, and the nearest this machine allows is every capability it
/// has, seccomp and AppArmor off and every device allowed. The test prints which it used.
fn privileged_args() -> Vec<String> {
    // Names by bit (include/uapi/linux/capability.h), as docker's --cap-drop spells them.
    const CAPS: [&str; 41] = [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "MKNOD",
        "LEASE",
        "AUDIT_WRITE",
        "AUDIT_CONTROL",
        "SETFCAP",
        "MAC_OVERRIDE",
        "MAC_ADMIN",
        "SYSLOG",
        "WAKE_ALARM",
        "BLOCK_SUSPEND",
        "AUDIT_READ",
        "PERFMON",
        "BPF",
        "CHECKPOINT_RESTORE",
    ];
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let bnd = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .map(|h| u64::from_str_radix(h.trim(), 16).unwrap())
        .unwrap();
    let last: usize = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let missing: Vec<&str> = (0..=last.min(CAPS.len() - 1))
        .filter(|b| bnd & (1 << b) == 0)
        .map(|b| CAPS[b])
        .collect();
    if missing.is_empty() {
        eprintln!("privileged: --privileged");
        return vec!["--privileged".into()];
    }
    eprintln!(
        "privileged: this machine's capability bounding set lacks {missing:?}, so runc refuses \
         --privileged; using every other capability, seccomp and AppArmor off, all devices"
    );
    let mut args: Vec<String> = ["--cap-add=ALL"].map(String::from).to_vec();
    args.extend(missing.iter().map(|c| format!("--cap-drop={c}")));
    args.extend(
        [
            "--security-opt=seccomp=unconfined",
            "--security-opt=apparmor=unconfined",
            "--device-cgroup-rule=a *:* rwm",
        ]
        .map(String::from),
    );
    args
}

/// One pod: a container of the image started as its workload starts it.
struct Pod {
    /// The node's name (an agent's `spec.nodeName`), also the container's host name.
    node: String,
    /// The pod's name (`metadata.name`).
    name: String,
    container: String,
    ip: Ipv4Addr,
    /// The host directory behind each volume, by volume name.
    dirs: BTreeMap<String, PathBuf>,
    /// The host FIFO bind-mounted as the container's `/dev/kmsg` (where it mounts it).
    kmsg: PathBuf,
}

impl Pod {
    /// The pod of `w` on node `node`, its host side under `dir`.
    fn new(w: &Workload, tag: &str, node: &str, name: &str, ip: Ipv4Addr, dir: &Path) -> Pod {
        std::fs::create_dir_all(dir).unwrap();
        Pod {
            node: node.to_string(),
            name: name.to_string(),
            container: format!("{tag}-{node}"),
            ip,
            dirs: w
                .mounts
                .iter()
                .map(|m| (m.name.clone(), dir.join(&m.name)))
                .collect(),
            kmsg: dir.join("kmsg.fifo"),
        }
    }

    /// An agent's state directory on the host.
    fn state(&self, agent: &Workload) -> PathBuf {
        let dir = agent
            .flag("--state-dir", Some("FAULTLINE_STATE_DIR"))
            .unwrap();
        self.dirs[&agent.mount_of(&dir).unwrap().name].clone()
    }

    fn record(&self, agent: &Workload) -> Option<NodeRecord> {
        let text = std::fs::read_to_string(self.state(agent).join("faults.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn exec(&self, args: &[&str]) -> (i32, String, String) {
        let mut all = vec!["exec", self.container.as_str()];
        all.extend(args);
        let out = docker(&all);
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// The containers and the network of a test, removed on drop, their logs printed first when
/// the test failed.
struct Cleanup {
    containers: Vec<String>,
    network: Option<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for c in &self.containers {
            if std::thread::panicking() {
                let out = docker(&["logs", "--tail", "60", c]);
                eprintln!(
                    "--- docker logs {c}\n{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let _ = docker(&["rm", "-f", c]);
        }
        if let Some(n) = &self.network {
            let _ = docker(&["network", "rm", n]);
        }
    }
}

/// The downward API's value of `field` for this pod.
fn field_value(w: &Workload, pod: &Pod, field: &str) -> String {
    match field {
        "spec.nodeName" => pod.node.clone(),
        "status.podIP" => pod.ip.to_string(),
        "metadata.name" => pod.name.clone(),
        "metadata.namespace" => w.namespace.clone(),
        other => panic!(
            "{} reads fieldRef {other}: give it a test value here",
            w.what
        ),
    }
}

/// What the test adds to a container: read-only bind mounts (host directory, container path)
/// and writable ones, and arguments appended to the workload's.
#[derive(Default)]
struct Added {
    read_only: Vec<(PathBuf, String)>,
    writable: Vec<(PathBuf, String)>,
    args: Vec<String>,
}

/// The `docker run` arguments for `pod`, derived from its workload `w`, plus `added`. Makes the
/// host side of every volume (`pod.dirs`, the FIFO) on the way: a ConfigMap's data, a Secret's
/// files from `secrets` (container path to contents).
fn run_args(
    w: &Workload,
    image: &str,
    pod: &Pod,
    network: &str,
    secrets: &BTreeMap<String, String>,
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
    added: &Added,
) -> Vec<String> {
    let mut a: Vec<String> = vec!["run".into(), "--detach".into()];
    a.push(format!("--name={}", pod.container));
    a.push(format!("--hostname={}", pod.node));
    a.push(format!("--network={network}"));
    a.push(format!("--ip={}", pod.ip));
    if w.privileged {
        a.extend(privileged_args());
    }
    if w.read_only_root {
        a.push("--read-only".into());
    }
    if w.no_new_privileges {
        a.push("--security-opt=no-new-privileges".into());
    }
    for cap in &w.cap_drop {
        a.push(format!("--cap-drop={cap}"));
    }
    if let Some((u, g)) = w.user {
        a.push(format!("--user={u}:{g}"));
    }
    // Kubernetes' memory limit, without swap.
    a.push(format!("--memory={}", w.memory_limit));
    a.push(format!("--memory-swap={}", w.memory_limit));
    for (name, v) in &w.env {
        let value = match v {
            Ok(v) => v.clone(),
            Err(field) => field_value(w, pod, field),
        };
        a.push(format!("--env={name}={value}"));
    }
    for m in &w.mounts {
        let host = &pod.dirs[&m.name];
        let v = &m.volume;
        if let Some(hp) = v.get("hostPath") {
            match hp["type"].as_str().unwrap_or("") {
                // The one device the DaemonSet mounts: the kernel log, here a FIFO.
                "CharDevice" => {
                    assert_eq!(m.path, "/dev/kmsg", "a device mount the test does not know");
                    mkfifo(&pod.kmsg);
                }
                "Directory" | "DirectoryOrCreate" => std::fs::create_dir_all(host).unwrap(),
                t => panic!("hostPath {} of type {t:?}: teach the test", m.name),
            }
        } else if let Some(cm) = v.get("configMap") {
            std::fs::create_dir_all(host).unwrap();
            let data = &config_maps[cm["name"].as_str().unwrap()];
            for (k, text) in data {
                std::fs::write(host.join(k), text).unwrap();
            }
        } else if v.get("secret").is_some() {
            std::fs::create_dir_all(host).unwrap();
            for (path, secret) in secrets {
                if let Some(key) = path.strip_prefix(&format!("{}/", m.path)) {
                    std::fs::write(host.join(key), secret).unwrap();
                }
            }
        } else if let Some(p) = v.get("projected") {
            // The kubelet's service-account token for the coordinator (the agents' peer-check
            // identity on Kubernetes): an empty directory here, since a standalone agent does
            // not read it (see agent_added_args).
            let sources = p["sources"].as_array().unwrap();
            assert!(
                sources
                    .iter()
                    .all(|s| s.get("serviceAccountToken").is_some()),
                "projected volume {} with sources the test does not know: {v}",
                m.name
            );
            std::fs::create_dir_all(host).unwrap();
        } else {
            panic!("volume {} of a kind the test does not know: {v}", m.name);
        }
        let src = if m.path == "/dev/kmsg" {
            &pod.kmsg
        } else {
            host
        };
        let ro = if m.read_only { ",readonly" } else { "" };
        a.push(format!(
            "--mount=type=bind,source={},target={}{ro}",
            src.display(),
            m.path
        ));
    }
    for (host, path, ro) in added
        .read_only
        .iter()
        .map(|(h, p)| (h, p, ",readonly"))
        .chain(added.writable.iter().map(|(h, p)| (h, p, "")))
    {
        a.push(format!(
            "--mount=type=bind,source={},target={path}{ro}",
            host.display()
        ));
    }
    // Ports, published on the host's loopback only.
    for (_, port, proto) in &w.ports {
        a.push(format!("--publish=127.0.0.1::{port}/{proto}"));
    }
    // Kubernetes' `command` replaces the image's entrypoint and `args` its CMD.
    a.push(format!("--entrypoint={}", w.command[0]));
    a.push(image.to_string());
    a.extend(w.arguments().cloned());
    a.extend(added.args.iter().cloned());
    a
}

/// Starts `pod` (and has `cleanup` remove it).
fn start(args: &[String], pod: &Pod, cleanup: &mut Cleanup) {
    eprintln!("docker {}", args.join(" "));
    cleanup.containers.push(pod.container.clone());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&refs);
}

/// `faultline keys ARGS`, run by the image's own CLI with the host directory `dir` at `/keys`:
/// its stdout.
fn image_keys(image: &str, dir: &Path, args: &[&str]) -> String {
    let mount = format!("type=bind,source={},target=/keys", dir.display());
    let mut run = vec![
        "run",
        "--rm",
        "--network=none",
        "--mount",
        &mount,
        "--entrypoint",
        CLI,
        image,
        "keys",
    ];
    run.extend(args);
    ok(&run).trim().to_string()
}

fn mkfifo(path: &Path) {
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        path,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
}

/// A free subnet for the test's network: docker picks one for a throwaway network, which is
/// removed and made again with that subnet named (`docker run --ip` needs a named subnet).
fn create_network(name: &str) -> (String, Ipv4Addr) {
    ok(&["network", "create", name]);
    let subnet = ok(&[
        "network",
        "inspect",
        "--format",
        "{{range .IPAM.Config}}{{.Subnet}}{{end}}",
        name,
    ]);
    ok(&["network", "rm", name]);
    let subnet = subnet.trim().to_string();
    let (base, prefix) = subnet.split_once('/').unwrap();
    assert!(prefix.parse::<u8>().unwrap() <= 24, "subnet {subnet}");
    ok(&["network", "create", "--subnet", &subnet, name]);
    (subnet.clone(), base.parse().unwrap())
}

/// One HTTP/1.1 GET on the host's loopback: the status code.
fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split_whitespace().nth(1)?.parse().ok()
}

/// The host port docker published a container port on.
fn published_port(container: &str, port: u16) -> u16 {
    let out = ok(&["port", container, &format!("{port}/tcp")]);
    let line = out.lines().find(|l| l.starts_with("127.0.0.1:")).unwrap();
    line.rsplit(':').next().unwrap().parse().unwrap()
}

fn container_state(container: &str) -> String {
    ok(&[
        "inspect",
        "--format",
        "running={{.State.Running}} oomkilled={{.State.OOMKilled}} exit={{.State.ExitCode}}",
        container,
    ])
    .trim()
    .to_string()
}

/// Waits until `pod` of `w` is ready as the kubelet sees it (the readiness probe's path on the
/// probe's port answers 200), then checks its liveness path answers 200 too.
fn wait_ready(w: &Workload, pod: &Pod) {
    let host_port = published_port(&pod.container, w.port(&w.probe_port));
    common::wait_until(
        &format!("{} ready ({} = 200)", pod.container, w.readiness_path),
        Duration::from_secs(60),
        || {
            assert!(
                container_state(&pod.container).starts_with("running=true"),
                "{}: {}",
                pod.container,
                container_state(&pod.container)
            );
            (http_status(host_port, &w.readiness_path) == Some(200)).then_some(())
        },
    );
    assert_eq!(
        http_status(host_port, &w.liveness_path),
        Some(200),
        "{}: the liveness probe's {}",
        pod.container,
        w.liveness_path
    );
}

/// The ConfigMaps `w`'s volumes name, from the rendered install (the policy).
fn config_maps_of(w: &Workload, docs: &[Value]) -> BTreeMap<String, BTreeMap<String, String>> {
    w.mounts
        .iter()
        .filter_map(|m| m.volume["configMap"]["name"].as_str())
        .map(|name| {
            let cm = find(docs, "ConfigMap", name);
            let data = cm["data"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect();
            (name.to_string(), data)
        })
        .collect()
}

#[test]
#[ignore = "needs docker and the built image: .ci/run runs it with --ignored"]
fn the_image_runs_as_the_daemonset_and_the_deployment_run_it() {
    let docs = rendered();
    let agent = agent_workload(&docs);
    let coordinator = coordinator_workload(&docs);
    let Some(image) = image_or_skip(&agent) else {
        return;
    };
    let tag = format!("faultline-test-{}", std::process::id());
    // Before the cleanup, so that it outlives the containers that mount it.
    let tmp = tempfile::tempdir().unwrap();
    let mut cleanup = Cleanup {
        containers: Vec::new(),
        network: None,
    };
    let (subnet, base) = create_network(&tag);
    cleanup.network = Some(tag.clone());
    eprintln!("network {tag}: {subnet}");
    let base = u32::from(base);
    let agents: Vec<Pod> = ["node-a", "node-b"]
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let ip = Ipv4Addr::from(base + 10 + i as u32);
            let name = format!("faultline-agent-{node}");
            Pod::new(&agent, &tag, node, &name, ip, &tmp.path().join(node))
        })
        .collect();
    let coord = Pod::new(
        &coordinator,
        &tag,
        "coordinator",
        "faultline-coordinator-0",
        Ipv4Addr::from(base + 20),
        &tmp.path().join("coordinator"),
    );

    // The bare-metal credentials, made by the image's own CLI: the coordinator's key (its
    // public key printed), the master, and each node's key from it.
    let keys = tmp.path().join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let public_key = image_keys(
        &image,
        &keys,
        &["coordinator", "--out", "/keys/coordinator.key"],
    );
    image_keys(&image, &keys, &["master", "--out", "/keys/master"]);
    let node_key_dirs: Vec<PathBuf> = agents
        .iter()
        .map(|p| {
            let out = format!("/keys/{}.key", p.node);
            image_keys(
                &image,
                &keys,
                &[
                    "node",
                    "--master",
                    "/keys/master",
                    "--node",
                    &p.node,
                    "--out",
                    &out,
                ],
            );
            let dir = tmp.path().join(&p.node).join("node-key");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::rename(keys.join(format!("{}.key", p.node)), dir.join("node.key")).unwrap();
            dir
        })
        .collect();

    // The coordinator's files: the members (the agents at their pod IPs and the DaemonSet's
    // peer port), its key and the master, readable by the Deployment's user (`faultline keys`
    // writes them for their owner only); its state directory, writable by that user.
    let (uid, gid) = coordinator.user.unwrap_or((0, 0));
    let files = tmp.path().join("coordinator").join("files");
    std::fs::create_dir_all(&files).unwrap();
    let peer_port = agent.port("peer");
    let members: String = agents
        .iter()
        .map(|p| format!("{} {}:{peer_port}\n", p.node, p.ip))
        .collect();
    std::fs::write(files.join("members"), members).unwrap();
    for f in ["coordinator.key", "master"] {
        std::fs::rename(keys.join(f), files.join(f)).unwrap();
        std::os::unix::fs::chown(files.join(f), Some(uid as u32), Some(gid as u32)).unwrap();
    }
    let state = tmp.path().join("coordinator").join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::os::unix::fs::chown(&state, Some(uid as u32), Some(gid as u32)).unwrap();

    // The coordinator: the requesters' secret is the one Secret file it names.
    let secrets = coordinator.secret_files();
    let requester = coordinator
        .flag(
            "--requester-secret-file",
            Some("FAULTLINE_PEER_REQUESTER_SECRET_FILE"),
        )
        .unwrap();
    assert!(
        secrets.contains_key(&requester),
        "the requesters' secret {requester} is on a Secret mount: {secrets:?}"
    );
    let added = Added {
        read_only: vec![(files, COORDINATOR_FILES_DIR.into())],
        writable: vec![(state.clone(), COORDINATOR_STATE_DIR.into())],
        args: coordinator_added_args(),
    };
    eprintln!(
        "{}: derived from it; added: {:?}, {COORDINATOR_FILES_DIR} (members, coordinator.key, \
         master; read-only), {COORDINATOR_STATE_DIR} (writable, owned by {uid}:{gid}); no \
         Kubernetes API (bare-metal peer checks)",
        coordinator.what, added.args
    );
    let args = run_args(
        &coordinator,
        &image,
        &coord,
        &tag,
        &secrets,
        &config_maps_of(&coordinator, &docs),
        &added,
    );
    start(&args, &coord, &mut cleanup);
    let requester_dir = &coord.dirs[&coordinator.mount_of(&requester).unwrap().name];

    // The agents.
    let config_maps = config_maps_of(&agent, &docs);
    let agent_secrets = agent.secret_files();
    for (p, key_dir) in agents.iter().zip(&node_key_dirs) {
        let added = Added {
            read_only: vec![
                (key_dir.clone(), NODE_KEY_DIR.into()),
                (requester_dir.clone(), REQUESTER_DIR.into()),
            ],
            writable: Vec::new(),
            args: agent_added_args(&public_key),
        };
        eprintln!(
            "{} on {}: derived from it; added: {:?}, {NODE_KEY_DIR} (its node key), \
             {REQUESTER_DIR} (the requesters' secret, for faultline check; both read-only); \
             the projected token volume an empty directory; no Kubernetes API (the agent runs \
             standalone)",
            agent.what, p.node, added.args
        );
        let args = run_args(
            &agent,
            &image,
            p,
            &tag,
            &agent_secrets,
            &config_maps,
            &added,
        );
        start(&args, p, &mut cleanup);
    }

    // The kernel log of a node always has a writer; the FIFO's is the test, from here on.
    let mut fifos: Vec<std::fs::File> = agents
        .iter()
        .map(|n| {
            common::wait_until(
                &format!("{}'s agent to open its kernel log", n.node),
                Duration::from_secs(60),
                || {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
                        .open(&n.kmsg)
                        .ok()
                },
            )
        })
        .collect();

    // Ready and alive as the kubelet sees them: the probes' paths on the probes' port.
    wait_ready(&coordinator, &coord);
    for n in &agents {
        wait_ready(&agent, n);
    }

    // A healthy node: wait-healthy exits 0 at once.
    let (code, out, err) = agents[0].exec(&[CLI, "wait-healthy", "--timeout", "30s"]);
    assert_eq!(code, 0, "wait-healthy on a healthy node\n{out}\n{err}");

    // The peer check, requested from node-a's container with the requesters' secret, of the
    // coordinator at its pod IP and its `peer` port: both agents start their probes under the
    // container's memory limit.
    let secret_file = format!(
        "{REQUESTER_DIR}/{}",
        Path::new(&requester).file_name().unwrap().to_str().unwrap()
    );
    let at = format!("{}:{}", coord.ip, coordinator.port("peer"));
    let (code, out, err) = agents[0].exec(&[
        CLI,
        "check",
        "--nodes",
        "node-a,node-b",
        "--coordinator",
        &at,
        "--secret-file",
        &secret_file,
        "--timeout",
        "120s",
    ]);
    eprintln!("faultline check:\n{out}{err}");
    assert_eq!(code, 0, "faultline check\n{out}\n{err}");
    // The run as the coordinator published it, in its state directory.
    let run: RunState =
        serde_json::from_str(&std::fs::read_to_string(state.join("peercheck.json")).unwrap())
            .unwrap();
    let checks: Vec<_> = run.rounds.iter().flat_map(|r| &r.checks).collect();
    assert!(!checks.is_empty(), "{run:?}");
    for k in &checks {
        assert_eq!(k.passed, Some(true), "{run:?}");
        assert!(k.busbw_gbps.is_some_and(|b| b > 0.0), "{run:?}");
    }
    for n in agents.iter().chain([&coord]) {
        let st = container_state(&n.container);
        assert_eq!(st, "running=true oomkilled=false exit=0", "{}", n.container);
    }

    // The image's probe has its GPU backends, and no CUDA library to load (docs/kubernetes.md,
    // "The image"): a GPU subcommand is one line saying so, not a crash and not "built without".
    let (code, out, err) = agents[0].exec(&["faultline-probe", "gemm", "--backend", "cublas"]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        err.contains("backend cublas unavailable: cannot load libcuda") && err.lines().count() == 1,
        "{err}"
    );

    // An Xid as the kernel writes it into /dev/kmsg, into node-a's FIFO.
    fifos[0].write_all(&common::xid79(1, "3b")).unwrap();
    let record = common::wait_until(
        "the Xid in node-a's faults.json on the host",
        Duration::from_secs(30),
        || {
            agents[0]
                .record(&agent)
                .filter(|r| common::fault(r, "Xid79").is_some())
        },
    );
    eprintln!("faults.json: health {:?}", record.health);

    let (code, out, err) = agents[0].exec(&[CLI, "get"]);
    assert_eq!(code, 0, "faultline get\n{out}\n{err}");
    assert!(out.contains("Xid79"), "faultline get:\n{out}");
    let (code, out, err) = agents[0].exec(&[CLI, "get", "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    let r: NodeRecord = serde_json::from_str(&out).unwrap();
    assert!(common::fault(&r, "Xid79").is_some(), "{out}");
    // A real Prometheus scrapes the container's metrics port (the pod annotations' port and
    // path): the target is up and the fault is a series with its code and device.
    if tools_present() {
        let http = agent.port(&agent.probe_port);
        let target = format!("127.0.0.1:{}", published_port(&agents[0].container, http));
        let (_prometheus, web) = start_prometheus(tmp.path(), &target);
        common::wait_until(
            "Prometheus scrapes the container",
            Duration::from_secs(60),
            || {
                query(&web, "up{job=\"faultline\"} == 1")
                    .len()
                    .eq(&1)
                    .then_some(())
            },
        );
        common::wait_until(
            "the container's Xid 79 in Prometheus",
            Duration::from_secs(30),
            || (!query(&web, "faultline_fault_active{code=\"Xid79\"}").is_empty()).then_some(()),
        );
    }
    // Xid 79 (the GPU fell off the bus) makes the node unusable: exit 1 at the timeout.
    let (code, out, err) = agents[0].exec(&[CLI, "wait-healthy", "--timeout", "2s"]);
    assert_eq!(code, 1, "wait-healthy on a node with Xid 79\n{out}\n{err}");
    // The other node saw nothing.
    let (code, out, err) = agents[1].exec(&[CLI, "wait-healthy", "--timeout", "10s"]);
    assert_eq!(code, 0, "wait-healthy on node-b\n{out}\n{err}");
    drop(fifos);
    drop(cleanup);
}

// ---------------------------------------------------------------------------------------------
// Agreement

/// The image's files (from `docker export` of a container created from it, never started).
fn image_files(image: &str, name: &str) -> BTreeSet<String> {
    ok(&["create", "--name", name, image]);
    let mut export = Command::new("docker")
        .args(["export", name])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let tar = Command::new("tar")
        .arg("-t")
        .stdin(export.stdout.take().unwrap())
        .output()
        .unwrap();
    assert!(export.wait().unwrap().success());
    assert!(tar.status.success());
    String::from_utf8(tar.stdout)
        .unwrap()
        .lines()
        .map(|l| format!("/{}", l.trim_start_matches("./").trim_end_matches('/')))
        .collect()
}

/// Where a command name resolves in the image (a path, or a name on the image's PATH).
fn resolve(cmd: &str, path: &str, files: &BTreeSet<String>) -> Option<String> {
    if cmd.starts_with('/') {
        return files.contains(cmd).then(|| cmd.to_string());
    }
    path.split(':')
        .map(|d| format!("{}/{cmd}", d.trim_end_matches('/')))
        .find(|p| files.contains(p))
}

/// The `[default: …]` clap prints for a flag in `--help`.
fn help_default(help: &str, flag: &str) -> Option<String> {
    let start = help.find(&format!("{flag} <"))?;
    let rest = &help[start..];
    let end = rest[1..].find("\n  -").map_or(rest.len(), |e| e + 1);
    let block = &rest[..end];
    let d = block.split("[default: ").nth(1)?;
    Some(d[..d.find(']')?].to_string())
}

/// A container that runs the image: where it was found, the container, its pod's volumes.
type User = (String, Value, Value);

/// Every container of every pod template in `docs` that runs the image `name` (any tag).
fn containers_of(docs: &[(String, Value)], name: &str) -> Vec<User> {
    fn walk(v: &Value, at: &str, name: &str, out: &mut Vec<User>) {
        match v {
            Value::Object(m) => {
                for key in ["containers", "initContainers"] {
                    for c in m.get(key).and_then(Value::as_array).into_iter().flatten() {
                        let image = c["image"].as_str().unwrap_or("");
                        if image.split(':').next() == Some(name) {
                            out.push((
                                format!("{at} {}", c["name"].as_str().unwrap_or("")),
                                c.clone(),
                                m.get("volumes").cloned().unwrap_or(Value::Null),
                            ));
                        }
                    }
                }
                for child in m.values() {
                    walk(child, at, name, out);
                }
            }
            Value::Array(a) => a.iter().for_each(|c| walk(c, at, name, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (at, d) in docs {
        walk(d, at, name, &mut out);
    }
    out
}

/// The commands a short shell script runs by name: the first word of each simple command,
/// leaving out the shell's keywords and the builtins of the image's shell (busybox ash),
/// assignments and case patterns. A heuristic for the examples' few lines, not a shell parser.
fn script_commands(script: &str) -> Vec<String> {
    const SHELL: &[&str] = &[
        "case", "do", "done", "elif", "else", "esac", "fi", "for", "if", "in", "then", "until",
        "while", "break", "cd", "command", "continue", "echo", "eval", "exec", "exit", "export",
        "false", "local", "printf", "read", "return", "set", "shift", "test", "trap", "true",
        "unset", "wait",
    ];
    let text = script.replace("\\\n", " ");
    text.split(['\n', ';', '|', '&'])
        .flat_map(|p| p.split("$("))
        .filter_map(|piece| {
            let w = piece
                .split_whitespace()
                .find(|w| !matches!(*w, "do" | "then" | "else" | "while" | "if" | "until" | "!"))?;
            let plain = w.starts_with(|c: char| c.is_ascii_lowercase())
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
            (plain && !SHELL.contains(&w)).then(|| w.to_string())
        })
        .collect()
}

/// The scripts a container's `sh -c` runs: its own, and each `*.sh` file it names that one of
/// its ConfigMap volumes provides (from the same file of `docs`).
fn container_scripts(user: &User, docs: &[(String, Value)]) -> Vec<(String, String)> {
    let (at, c, volumes) = user;
    let cmd = strings(&c["command"]);
    let Some(script) = (cmd.len() == 3 && cmd[0] == "sh" && cmd[1] == "-c").then(|| cmd[2].clone())
    else {
        return Vec::new();
    };
    let mut out = vec![("sh -c".to_string(), script.clone())];
    for path in script
        .split_whitespace()
        .map(|w| w.trim_end_matches(';'))
        .filter(|w| w.starts_with('/') && w.ends_with(".sh"))
    {
        let (dir, file) = path.rsplit_once('/').unwrap();
        let mount = c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["mountPath"] == dir);
        let cm = mount.and_then(|m| {
            volumes
                .as_array()?
                .iter()
                .find(|v| v["name"] == m["name"])?["configMap"]["name"]
                .as_str()
        });
        let text = cm.and_then(|cm| {
            docs.iter()
                .filter(|(f, _)| at.starts_with(f.as_str()))
                .find(|(_, d)| d["kind"] == "ConfigMap" && d["metadata"]["name"] == cm)
                .and_then(|(_, d)| d["data"][file].as_str())
        });
        let text = text.unwrap_or_else(|| panic!("{at}: {path} is not from a ConfigMap here"));
        out.push((path.to_string(), text.to_string()));
    }
    out
}

/// `BIN --help` of the image's binary `bin` (a path in the image), or empty when there is none.
fn image_help(image: &str, bin: Option<&str>) -> String {
    let Some(bin) = bin else {
        return String::new();
    };
    let out = docker(&["run", "--rm", "--entrypoint", bin, image, "--help"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The variables a `--help` says its flags read (`[env: NAME=…]`).
fn help_env(help: &str) -> BTreeSet<String> {
    help.split("[env: ")
        .skip(1)
        .filter_map(|s| s.split(['=', ']']).next())
        .map(String::from)
        .collect()
}

/// The subcommands a `--help` lists (its `Commands:` section), but `help`.
fn help_commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

/// Whether `--help` lists `flag` (`--flag <VALUE>` or a bare `--flag`).
fn help_has_flag(help: &str, flag: &str) -> bool {
    help.split(|c: char| c.is_whitespace() || c == ',')
        .any(|w| w == flag)
}

/// The port of a listen address (`ip:port`).
fn port_of(addr: Option<&str>) -> Option<u16> {
    addr.and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse::<u16>().ok())
}

/// What `w` and its binary's `help` disagree on, added to `problems`: a flag the workload
/// passes that the binary lacks, a variable it sets that nobody reads (`read_elsewhere`: read
/// by someone other than the binary's flags, and who), a listen flag whose port is not the
/// containerPort of that name, the probes' port not the one `--listen` serves them on, a path
/// it is given that is on no mount.
fn workload_problems(
    w: &Workload,
    help: &str,
    read_elsewhere: &[(&str, &str)],
    listens: &[(&str, &str, &str)],
    problems: &mut Vec<String>,
) {
    let what = &w.what;
    for a in w.arguments().filter(|a| a.starts_with("--")) {
        let flag = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
        if !help_has_flag(help, flag) {
            problems.push(format!(
                "{what} passes {flag}, which the image's {} does not have",
                w.command[0]
            ));
        }
    }
    let reads = help_env(help);
    for (name, _) in &w.env {
        if !reads.contains(name) && !read_elsewhere.iter().any(|(n, _)| n == name) {
            problems.push(format!(
                "{what} sets {name}, which the image's {} does not read",
                w.command[0]
            ));
        }
    }
    for (name, flag, var) in listens {
        let addr = w.flag(flag, Some(var)).or_else(|| help_default(help, flag));
        if port_of(addr.as_deref()) != Some(w.port(name)) {
            problems.push(format!(
                "{what}: {flag} is {addr:?}, the containerPort {name} is {}",
                w.port(name)
            ));
        }
    }
    // The kubelet's probes go to the port `--listen` serves /healthz and /readyz on.
    if !listens
        .iter()
        .any(|(name, flag, _)| *name == w.probe_port && *flag == "--listen")
    {
        problems.push(format!(
            "{what}: the probes use port {}, not the one --listen serves them on",
            w.probe_port
        ));
    }
    let values = w
        .arguments()
        .filter_map(|a| a.split_once('=').map(|(_, v)| v.to_string()))
        .chain(w.env.iter().filter_map(|(_, v)| v.clone().ok()))
        .filter(|v| v.starts_with('/'));
    for v in values {
        if w.mount_of(&v).is_none() {
            problems.push(format!(
                "{v} (an argument or variable of {what}) is on no volumeMount"
            ));
        }
    }
}

#[test]
#[ignore = "needs docker and the built image: .ci/run runs it with --ignored"]
fn the_daemonset_the_deployment_and_the_image_agree() {
    let docs = rendered();
    let agent = agent_workload(&docs);
    let coordinator = coordinator_workload(&docs);
    let Some(image) = image_or_skip(&agent) else {
        return;
    };
    let tag = format!("faultline-test-files-{}", std::process::id());
    let cleanup = Cleanup {
        containers: vec![tag.clone()],
        network: None,
    };
    let config: Value = serde_json::from_str(&ok(&[
        "image",
        "inspect",
        "--format",
        "{{json .Config}}",
        &image,
    ]))
    .unwrap();
    let files = image_files(&image, &tag);
    let env: BTreeMap<String, String> = strings(&config["Env"])
        .iter()
        .map(|e| {
            let (k, v) = e.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect();
    let path = env.get("PATH").cloned().unwrap_or_default();
    let mut problems: Vec<String> = Vec::new();

    // The two workloads run the one image.
    if coordinator.image != agent.image {
        problems.push(format!(
            "{} runs {}, {} runs {}",
            agent.what, agent.image, coordinator.what, coordinator.image
        ));
    }

    // The DaemonSet asks the NVIDIA container runtime for the driver's libraries. It puts them
    // in /usr/lib/x86_64-linux-gnu only in an image with /etc/debian_version, else in
    // /usr/lib64 (libnvidia-container, src/nvc_container.c, copy_config), which the image's
    // loader (Debian's, at the multiarch paths) never searches: NVML would not load.
    if agent.env.iter().any(|(k, _)| k == "NVIDIA_VISIBLE_DEVICES")
        && !files.contains("/etc/debian_version")
    {
        problems.push(
            "the DaemonSet asks the NVIDIA runtime for libnvidia-ml, and the image has no \
             /etc/debian_version: the runtime would put it in /usr/lib64, where the loader \
             does not look"
                .into(),
        );
    }

    // Binaries: every command the manifests run with this image exists in it and runs (which
    // also proves the libraries it loads are there); the agent's probe is where it looks.
    let mut all: Vec<(String, Value)> = docs
        .iter()
        .map(|d| ("manifests/".to_string(), d.clone()))
        .collect();
    let examples = repo().join("manifests/examples");
    let mut stack = vec![examples];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml") {
                for d in yaml_docs(&std::fs::read_to_string(&p).unwrap()) {
                    all.push((p.strip_prefix(repo()).unwrap().display().to_string(), d));
                }
            }
        }
    }
    let image_name = agent.image.split(':').next().unwrap();
    let users = containers_of(&all, image_name);
    assert!(
        users.len() >= 3,
        "the DaemonSet, the Deployment and the job examples: {users:?}"
    );
    let mut commands: BTreeSet<String> = BTreeSet::new();
    for user in &users {
        for (name, script) in container_scripts(user, &all) {
            let used = script_commands(&script);
            eprintln!("{} {name}: runs {used:?}", user.0);
            for word in used {
                if resolve(&word, &path, &files).is_none() {
                    problems.push(format!(
                        "{} {name}: runs {word}, which is not in the image (PATH {path:?})",
                        user.0
                    ));
                }
            }
        }
    }
    for (at, c, _) in &users {
        let cmd = strings(&c["command"])
            .first()
            .cloned()
            .or_else(|| strings(&config["Entrypoint"]).first().cloned())
            .or_else(|| strings(&config["Cmd"]).first().cloned());
        match cmd {
            None => problems.push(format!(
                "{at}: no command, and the image has no entrypoint or CMD"
            )),
            Some(cmd) => match resolve(&cmd, &path, &files) {
                Some(p) => {
                    commands.insert(p);
                }
                None => problems.push(format!(
                    "{at}: command {cmd:?} is not in the image (PATH {path:?})"
                )),
            },
        }
    }
    let agent_bin = resolve(&agent.command[0], &path, &files);
    let coordinator_bin = resolve(&coordinator.command[0], &path, &files);
    let probe = match agent.flag("--probe-bin", Some("FAULTLINE_PROBE")) {
        Some(p) => resolve(&p, &path, &files),
        // The agent's default: `faultline-probe` beside its own binary, else on PATH.
        None => agent_bin
            .as_ref()
            .map(|a| {
                format!(
                    "{}/faultline-probe",
                    Path::new(a).parent().unwrap().display()
                )
            })
            .filter(|p| files.contains(p))
            .or_else(|| resolve("faultline-probe", &path, &files)),
    };
    match probe {
        Some(p) => {
            commands.insert(p);
        }
        None => problems.push(format!(
            "the agent's probe (faultline-probe beside {agent_bin:?}, or on PATH {path:?}) is not in the image"
        )),
    }
    for cmd in &commands {
        // The job examples' shell runs a trivial script; faultline's binaries print a version.
        let arg: &[&str] = if cmd.ends_with("/sh") {
            &["-c", "exit 0"]
        } else {
            &["--version"]
        };
        let mut run = vec!["run", "--rm", "--entrypoint", cmd, &image];
        run.extend(arg);
        let out = docker(&run);
        if !out.status.success() {
            problems.push(format!(
                "{cmd} {arg:?} in the image: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }

    // The flags, defaults and variables as the image's own binaries have them. The
    // coordinator is the agent's binary under another name (argv[0]): its --help must be the
    // coordinator's, not the agent's.
    let help = image_help(&image, agent_bin.as_deref());
    let coordinator_help = image_help(&image, coordinator_bin.as_deref());
    if agent_bin.is_some() {
        assert!(
            help_env(&help).contains("NODE_NAME"),
            "no [env: …] in --help:\n{help}"
        );
    }
    if coordinator_bin.is_some() {
        assert!(
            help_has_flag(&coordinator_help, "--node-key-master-file"),
            "{} --help is not the coordinator's:\n{coordinator_help}",
            coordinator.command[0]
        );
    }

    // Flags, environment, ports and paths of each workload against its binary: every flag it
    // passes exists; every variable it sets is read by the binary or by someone named here;
    // the listen flags' ports are the containerPorts; every path is on a mount.
    workload_problems(
        &agent,
        &help,
        &[
            (
                "POD_IP",
                "the agent's peer address (agent/src/peer/mod.rs, Peer::setup)",
            ),
            ("NVIDIA_VISIBLE_DEVICES", "the NVIDIA container runtime"),
            ("NVIDIA_DRIVER_CAPABILITIES", "the NVIDIA container runtime"),
        ],
        &[
            (agent.probe_port.as_str(), "--listen", "FAULTLINE_LISTEN"),
            ("peer", "--peer-listen", "FAULTLINE_PEER_LISTEN"),
        ],
        &mut problems,
    );
    workload_problems(
        &coordinator,
        &coordinator_help,
        &[(
            "POD_IP",
            "the address the agents report to (coordinator/src/lib.rs, advertised)",
        )],
        &[
            (
                coordinator.probe_port.as_str(),
                "--listen",
                "FAULTLINE_LISTEN",
            ),
            ("peer", "--peer-listen", "FAULTLINE_PEER_LISTEN"),
        ],
        &mut problems,
    );
    // The coordinator reaches the agents at their peer port and assigns their probes the ports
    // the agents listen on.
    for (flag, var, agents_flag, agents_var) in [
        (
            "--agent-port",
            "FAULTLINE_AGENT_PEER_PORT",
            "--peer-listen",
            "FAULTLINE_PEER_LISTEN",
        ),
        (
            "--probe-port-base",
            "FAULTLINE_PROBE_PORT_BASE",
            "--probe-port-base",
            "FAULTLINE_PROBE_PORT_BASE",
        ),
    ] {
        let ours = coordinator
            .flag(flag, Some(var))
            .or_else(|| help_default(&coordinator_help, flag));
        let theirs = agent
            .flag(agents_flag, Some(agents_var))
            .or_else(|| help_default(&help, agents_flag));
        let theirs = theirs.as_deref().map(|t| t.rsplit(':').next().unwrap());
        if ours.is_none() || ours.as_deref() != theirs {
            problems.push(format!(
                "the coordinator's {flag} is {ours:?}, the agents' {agents_flag} port {theirs:?}"
            ));
        }
    }

    // The CLI runs in the agent's container too (`kubectl exec … faultline get`, the README): a
    // variable the DaemonSet sets for the agent that a CLI command also reads must mean the same
    // to both, or the command silently takes the agent's setting for something else.
    const SAME_MEANING: &[(&str, &str)] = &[("POD_NAMESPACE", "the agents' namespace")];
    if let Some(cli) = resolve(CLI, &path, &files) {
        for cmd in help_commands(&image_help(&image, Some(&cli))) {
            let out = docker(&["run", "--rm", "--entrypoint", &cli, &image, &cmd, "--help"]);
            let reads = help_env(&String::from_utf8_lossy(&out.stdout));
            for (name, _) in &agent.env {
                if reads.contains(name) && !SAME_MEANING.iter().any(|(n, _)| n == name) {
                    problems.push(format!(
                        "`{CLI} {cmd}` reads {name}, which {} sets for the agent: run in the \
                         agent's container, the command takes the agent's setting",
                        agent.what
                    ));
                }
            }
        }
    }

    // The image sets no variable that the agent, the coordinator or the NVIDIA runtime reads
    // (job pods run this image too, and must not ask for GPUs or change the flags).
    let reads: BTreeSet<String> = help_env(&help)
        .union(&help_env(&coordinator_help))
        .cloned()
        .collect();
    for name in env.keys() {
        if reads.contains(name) || name.starts_with("NVIDIA_") {
            problems.push(format!("the image sets {name}: leave it to the manifests"));
        }
    }

    // Ports: the image exposes exactly the two workloads' container ports.
    let exposed: BTreeSet<String> = config["ExposedPorts"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let declared: BTreeSet<String> = agent
        .ports
        .iter()
        .chain(&coordinator.ports)
        .map(|(_, p, proto)| format!("{p}/{proto}"))
        .collect();
    if exposed != declared {
        problems.push(format!(
            "the image exposes {exposed:?}, the DaemonSet and the Deployment declare {declared:?}"
        ));
    }

    // The agent's state and data directories are writable mounts (its root is read-only).
    for (flag, var) in [
        ("--state-dir", "FAULTLINE_STATE_DIR"),
        ("--data-dir", "FAULTLINE_DATA_DIR"),
    ] {
        let dir = agent
            .flag(flag, Some(var))
            .or_else(|| help_default(&help, flag));
        match dir.as_deref().map(|d| (d, agent.mount_of(d))) {
            Some((_, Some(m))) if !m.read_only => {}
            Some((d, Some(m))) => {
                problems.push(format!("{flag} {d} is on the read-only mount {}", m.name))
            }
            Some((d, None)) if agent.read_only_root => {
                problems.push(format!("{flag} {d} is on the read-only root filesystem"))
            }
            Some(_) => {}
            None => problems.push(format!(
                "{flag}: no value and no default in the image's --help"
            )),
        }
    }

    // Users: the image's user is the one the DaemonSet runs as; the Deployment, which must
    // not run as root, runs as a user the kubelet accepts for runAsNonRoot: its runAsUser, not
    // 0, else the image's user, not 0 (kubernetes, pkg/kubelet/kuberuntime/
    // security_context_others.go, verifyRunAsNonRoot).
    let user = config["User"].as_str().unwrap_or("");
    let (u, g) = user.split_once(':').unwrap_or((user, ""));
    let num = |s: &str| -> Option<u64> {
        match s {
            "" | "root" => Some(0),
            s => s.parse().ok(),
        }
    };
    let image_user = (num(u), if g.is_empty() { num(u) } else { num(g) });
    if let Some((ru, rg)) = agent.user {
        if image_user != (Some(ru), Some(rg)) {
            problems.push(format!(
                "the image runs as {user:?}, the DaemonSet as runAsUser {ru} runAsGroup {rg}"
            ));
        }
    }
    if coordinator.run_as_non_root {
        match coordinator.user.map(|(u, _)| u).or(image_user.0) {
            Some(u) if u != 0 => {}
            u => problems.push(format!(
                "{} has runAsNonRoot and would run as user {u:?} (its runAsUser, else the \
                 image's {user:?}): the kubelet refuses that",
                coordinator.what
            )),
        }
    }
    drop(cleanup);
    assert!(
        problems.is_empty(),
        "the manifests and the image {image} disagree:\n- {}",
        problems.join("\n- ")
    );
}
