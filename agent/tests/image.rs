//! The image (manifests/build-image.sh) against the DaemonSet that runs it
//! (manifests/base/daemonset.yaml, as `kubectl kustomize manifests/` renders it):
//!
//! - `the_image_runs_as_the_daemonset_runs_it`: two containers of the image, each started with
//!   the `docker run` arguments derived from the DaemonSet (securityContext, command and args,
//!   environment, volumes as bind mounts of temporary directories, a FIFO at `/dev/kmsg`, the
//!   ports, the memory limit), on a docker network of their own. They peer-check each other
//!   (an allgather at the policy's size); an Xid written to one node's FIFO appears in its
//!   `faults.json` on the host; `faultline get` and `faultline wait-healthy` run in the
//!   container (`docker exec`) with the exit codes the README gives; the image's probe has its
//!   GPU backends and says in one line that no CUDA library is there.
//! - `the_daemonset_and_the_image_agree`: from `docker image inspect`, the image's files and the
//!   image's own `faultline-agent --help`: every command the manifests run exists in the image
//!   and runs (the job examples' shell scripts' tools too), the probe is where the agent looks
//!   for it, the environment, the ports, the mounts and the user agree.
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
use faultline_agent::coordinator::runs::RunState;
use faultline_core::record::NodeRecord;
use serde_json::Value;

/// What the test changes in the DaemonSet's container, and why. Nothing else differs.
///
/// Kubernetes gives the agents their peers from the pod list (the API server); there is none
/// here, so the agents get the bare-metal members file instead, mounted read-only at
/// [`MEMBERS_DIR`] (docs/peer-checks.md, "The coordinator and the agents"). The container also
/// gets no `KUBERNETES_SERVICE_HOST` and no service-account token (the kubelet's), so the agent
/// runs standalone, as it does on a node whose API server cannot be reached.
const ADDED_ARGS: &[&str] = &["--peer-members=/etc/faultline-members/members"];
const MEMBERS_DIR: &str = "/etc/faultline-members";

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
            ["daemonset.yaml", "policy.yaml"]
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
    /// The volume's source: `hostPath`, `configMap` or `secret`, and its object.
    volume: Value,
}

/// The agent container of the DaemonSet, in the terms `docker run` needs.
#[derive(Debug)]
struct Agent {
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
    user: Option<(u64, u64)>,
    memory_limit: u64,
    /// The port name the kubelet's probes use, and the readiness path.
    probe_port: String,
    readiness_path: String,
}

fn quantity(q: &str) -> u64 {
    let (num, mult) = [("Gi", 1u64 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)]
        .iter()
        .find_map(|(s, m)| q.strip_suffix(s).map(|n| (n, *m)))
        .unwrap_or((q, 1));
    num.parse::<u64>().unwrap() * mult
}

fn agent_container(docs: &[Value]) -> Agent {
    let ds = find(docs, "DaemonSet", "faultline-agent");
    let pod = &ds["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1, "the DaemonSet runs one container");
    let c = &containers[0];
    let volumes: BTreeMap<&str, &Value> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    let sc = &c["securityContext"];
    Agent {
        namespace: ds["metadata"]["namespace"].as_str().unwrap().to_string(),
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
        user: sc["runAsUser"]
            .as_u64()
            .map(|u| (u, sc["runAsGroup"].as_u64().unwrap_or(u))),
        memory_limit: quantity(c["resources"]["limits"]["memory"].as_str().unwrap()),
        probe_port: c["readinessProbe"]["httpGet"]["port"]
            .as_str()
            .unwrap()
            .to_string(),
        readiness_path: c["readinessProbe"]["httpGet"]["path"]
            .as_str()
            .unwrap()
            .to_string(),
    }
}

impl Agent {
    fn port(&self, name: &str) -> u16 {
        self.ports
            .iter()
            .find(|p| p.0 == name)
            .unwrap_or_else(|| panic!("no containerPort named {name}"))
            .1
    }

    /// The value the container's args or environment give a flag (`--flag=v`, `--flag v`, or
    /// its variable), if any.
    fn flag(&self, flag: &str, var: Option<&str>) -> Option<String> {
        let mut it = self.command.iter().skip(1).chain(&self.args);
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
fn image_or_skip(agent: &Agent) -> Option<String> {
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

/// One node: a container of the image started as the DaemonSet starts the agent.
struct Node {
    name: String,
    container: String,
    ip: Ipv4Addr,
    /// The host directory behind each volume, by volume name.
    dirs: BTreeMap<String, PathBuf>,
    /// The host FIFO bind-mounted as the container's `/dev/kmsg`.
    kmsg: PathBuf,
}

impl Node {
    fn state(&self, agent: &Agent) -> PathBuf {
        let dir = agent
            .flag("--state-dir", Some("FAULTLINE_STATE_DIR"))
            .unwrap();
        self.dirs[&agent.mount_of(&dir).unwrap().name].clone()
    }

    fn record(&self, agent: &Agent) -> Option<NodeRecord> {
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

/// The downward API's value of `field` for this node.
fn field_value(agent: &Agent, node: &str, ip: Ipv4Addr, field: &str) -> String {
    match field {
        "spec.nodeName" => node.to_string(),
        "status.podIP" => ip.to_string(),
        "metadata.name" => format!("faultline-agent-{node}"),
        "metadata.namespace" => agent.namespace.clone(),
        other => panic!("the DaemonSet reads fieldRef {other}: give it a test value here"),
    }
}

/// The `docker run` arguments for `node`, derived from the DaemonSet, plus [`ADDED_ARGS`].
/// Makes the host side of every volume (`node.dirs`, the FIFO) on the way.
fn run_args(
    agent: &Agent,
    image: &str,
    node: &Node,
    network: &str,
    secrets: &BTreeMap<String, String>,
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
    members: &Path,
) -> Vec<String> {
    let mut a: Vec<String> = vec!["run".into(), "--detach".into()];
    a.push(format!("--name={}", node.container));
    a.push(format!("--hostname={}", node.name));
    a.push(format!("--network={network}"));
    a.push(format!("--ip={}", node.ip));
    if agent.privileged {
        a.extend(privileged_args());
    }
    if agent.read_only_root {
        a.push("--read-only".into());
    }
    if let Some((u, g)) = agent.user {
        a.push(format!("--user={u}:{g}"));
    }
    // Kubernetes' memory limit, without swap.
    a.push(format!("--memory={}", agent.memory_limit));
    a.push(format!("--memory-swap={}", agent.memory_limit));
    for (name, v) in &agent.env {
        let value = match v {
            Ok(v) => v.clone(),
            Err(field) => field_value(agent, &node.name, node.ip, field),
        };
        a.push(format!("--env={name}={value}"));
    }
    for m in &agent.mounts {
        let host = &node.dirs[&m.name];
        let v = &m.volume;
        if let Some(hp) = v.get("hostPath") {
            match hp["type"].as_str().unwrap_or("") {
                // The one device the DaemonSet mounts: the kernel log, here a FIFO.
                "CharDevice" => {
                    assert_eq!(m.path, "/dev/kmsg", "a device mount the test does not know");
                    mkfifo(&node.kmsg);
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
            // The keys the agent reads from this mount (its flags' paths), with a test secret
            // each; the operator creates these Secrets (docs/peer-checks.md).
            std::fs::create_dir_all(host).unwrap();
            for (path, secret) in secrets {
                if let Some(key) = path.strip_prefix(&format!("{}/", m.path)) {
                    std::fs::write(host.join(key), secret).unwrap();
                }
            }
        } else {
            panic!("volume {} of a kind the test does not know: {v}", m.name);
        }
        let src = if m.path == "/dev/kmsg" {
            &node.kmsg
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
    a.push(format!(
        "--mount=type=bind,source={},target={MEMBERS_DIR},readonly",
        members.parent().unwrap().display()
    ));
    // Ports, published on the host's loopback only.
    for (_, port, proto) in &agent.ports {
        a.push(format!("--publish=127.0.0.1::{port}/{proto}"));
    }
    // Kubernetes' `command` replaces the image's entrypoint and `args` its CMD.
    a.push(format!("--entrypoint={}", agent.command[0]));
    a.push(image.to_string());
    a.extend(agent.command.iter().skip(1).cloned());
    a.extend(agent.args.iter().cloned());
    a.extend(ADDED_ARGS.iter().map(|s| s.to_string()));
    a
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

#[test]
#[ignore = "needs docker and the built image: .ci/run runs it with --ignored"]
fn the_image_runs_as_the_daemonset_runs_it() {
    let docs = rendered();
    let agent = agent_container(&docs);
    let Some(image) = image_or_skip(&agent) else {
        return;
    };
    eprintln!(
        "derived from the DaemonSet; changed: {ADDED_ARGS:?} appended (members file at {MEMBERS_DIR}), \
         no Kubernetes API (the agent runs standalone)"
    );
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

    // The ConfigMaps the volumes name, from the rendered install (the policy).
    let config_maps: BTreeMap<String, BTreeMap<String, String>> = agent
        .mounts
        .iter()
        .filter_map(|m| m.volume["configMap"]["name"].as_str())
        .map(|name| {
            let cm = find(&docs, "ConfigMap", name);
            let data = cm["data"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect();
            (name.to_string(), data)
        })
        .collect();
    // Every file under a Secret mount that the container's environment names: two different
    // secrets (the agent refuses a requester secret equal to the agents').
    let secrets: BTreeMap<String, String> = agent
        .env
        .iter()
        .filter_map(|(_, v)| v.as_ref().ok())
        .filter(|p| {
            agent
                .mount_of(p)
                .is_some_and(|m| m.volume.get("secret").is_some())
        })
        .enumerate()
        .map(|(i, p)| {
            (
                p.clone(),
                format!("image-test-secret-{i}-0123456789abcdef0123"),
            )
        })
        .collect();
    assert!(
        secrets.len() >= 2,
        "the DaemonSet names the agents' and the requesters' secret files: {secrets:?}"
    );
    let requester_secret = agent
        .flag(
            "--peer-requester-secret-file",
            Some("FAULTLINE_PEER_REQUESTER_SECRET_FILE"),
        )
        .unwrap();

    let peer_port = agent.port("peer");
    let base = u32::from(base);
    let nodes: Vec<Node> = ["node-a", "node-b"]
        .iter()
        .enumerate()
        .map(|(i, name)| Node {
            name: name.to_string(),
            container: format!("{tag}-{name}"),
            ip: Ipv4Addr::from(base + 10 + i as u32),
            dirs: agent
                .mounts
                .iter()
                .map(|m| (m.name.clone(), tmp.path().join(name).join(&m.name)))
                .collect(),
            kmsg: tmp.path().join(name).join("kmsg.fifo"),
        })
        .collect();
    let members = tmp.path().join("members").join("members");
    std::fs::create_dir_all(members.parent().unwrap()).unwrap();
    let lines: String = nodes
        .iter()
        .map(|n| format!("{} {}:{peer_port}\n", n.name, n.ip))
        .collect();
    std::fs::write(&members, lines).unwrap();

    for n in &nodes {
        std::fs::create_dir_all(tmp.path().join(&n.name)).unwrap();
        let args = run_args(&agent, &image, n, &tag, &secrets, &config_maps, &members);
        eprintln!("docker {}", args.join(" "));
        cleanup.containers.push(n.container.clone());
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        ok(&refs);
    }

    // The kernel log of a node always has a writer; the FIFO's is the test, from here on.
    let mut fifos: Vec<std::fs::File> = nodes
        .iter()
        .map(|n| {
            common::wait_until(
                &format!("{}'s agent to open its kernel log", n.name),
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

    // Ready as the kubelet sees it: the readiness probe's path on the probe's port.
    let http = agent.port(&agent.probe_port);
    for n in &nodes {
        let host_port = published_port(&n.container, http);
        common::wait_until(
            &format!("{} ready ({} = 200)", n.name, agent.readiness_path),
            Duration::from_secs(60),
            || {
                assert!(
                    container_state(&n.container).starts_with("running=true"),
                    "{}: {}",
                    n.container,
                    container_state(&n.container)
                );
                (http_status(host_port, &agent.readiness_path) == Some(200)).then_some(())
            },
        );
    }

    // A healthy node: wait-healthy exits 0 at once.
    let (code, out, err) = nodes[0].exec(&[CLI, "wait-healthy", "--timeout", "30s"]);
    assert_eq!(code, 0, "wait-healthy on a healthy node\n{out}\n{err}");

    // The peer check, requested from node-a's container with the requesters' secret: both
    // agents start their probes under the container's memory limit.
    let (code, out, err) = nodes[0].exec(&[
        CLI,
        "check",
        "--nodes",
        "node-a,node-b",
        "--members",
        &format!("{MEMBERS_DIR}/members"),
        "--secret-file",
        &requester_secret,
        "--timeout",
        "120s",
    ]);
    eprintln!("faultline check:\n{out}{err}");
    assert_eq!(code, 0, "faultline check\n{out}\n{err}");
    let run: RunState = serde_json::from_str(
        &std::fs::read_to_string(nodes[0].state(&agent).join("peercheck.json")).unwrap(),
    )
    .unwrap();
    let checks: Vec<_> = run.rounds.iter().flat_map(|r| &r.checks).collect();
    assert!(!checks.is_empty(), "{run:?}");
    for k in &checks {
        assert_eq!(k.passed, Some(true), "{run:?}");
        assert!(k.busbw_gbps.is_some_and(|b| b > 0.0), "{run:?}");
    }
    for n in &nodes {
        let st = container_state(&n.container);
        assert_eq!(st, "running=true oomkilled=false exit=0", "{}", n.container);
    }

    // The image's probe has its GPU backends, and no CUDA library to load (docs/kubernetes.md,
    // "The image"): a GPU subcommand is one line saying so, not a crash and not "built without".
    let (code, out, err) = nodes[0].exec(&["faultline-probe", "gemm", "--backend", "cublas"]);
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
            nodes[0]
                .record(&agent)
                .filter(|r| common::fault(r, "Xid79").is_some())
        },
    );
    eprintln!("faults.json: health {:?}", record.health);

    let (code, out, err) = nodes[0].exec(&[CLI, "get"]);
    assert_eq!(code, 0, "faultline get\n{out}\n{err}");
    assert!(out.contains("Xid79"), "faultline get:\n{out}");
    let (code, out, err) = nodes[0].exec(&[CLI, "get", "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    let r: NodeRecord = serde_json::from_str(&out).unwrap();
    assert!(common::fault(&r, "Xid79").is_some(), "{out}");
    // A real Prometheus scrapes the container's metrics port (the pod annotations' port and
    // path): the target is up and the fault is a series with its code and device.
    if tools_present() {
        let target = format!("127.0.0.1:{}", published_port(&nodes[0].container, http));
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
    let (code, out, err) = nodes[0].exec(&[CLI, "wait-healthy", "--timeout", "2s"]);
    assert_eq!(code, 1, "wait-healthy on a node with Xid 79\n{out}\n{err}");
    // The other node saw nothing.
    let (code, out, err) = nodes[1].exec(&[CLI, "wait-healthy", "--timeout", "10s"]);
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

#[test]
#[ignore = "needs docker and the built image: .ci/run runs it with --ignored"]
fn the_daemonset_and_the_image_agree() {
    let docs = rendered();
    let agent = agent_container(&docs);
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
        users.len() >= 2,
        "the DaemonSet and the job examples: {users:?}"
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

    // The agent's flags, defaults and variables as the image's own binary has them.
    let help = match &agent_bin {
        Some(bin) => {
            let out = docker(&["run", "--rm", "--entrypoint", bin, &image, "--help"]);
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
        None => String::new(),
    };
    let reads: BTreeSet<String> = help
        .split("[env: ")
        .skip(1)
        .filter_map(|s| s.split('=').next())
        .map(String::from)
        .collect();
    if agent_bin.is_some() {
        assert!(
            reads.contains("NODE_NAME"),
            "no [env: …] in --help:\n{help}"
        );
    }

    // Environment: every variable the DaemonSet sets is read by someone; the image sets none
    // that the agent or the NVIDIA runtime reads (job pods run this image too, and must not ask
    // for GPUs or change the agent's flags).
    const READ_ELSEWHERE: &[(&str, &str)] = &[
        (
            "POD_IP",
            "the agent's peer address (agent/src/daemon.rs, peer_setup)",
        ),
        ("NVIDIA_VISIBLE_DEVICES", "the NVIDIA container runtime"),
        ("NVIDIA_DRIVER_CAPABILITIES", "the NVIDIA container runtime"),
    ];
    for (name, _) in &agent.env {
        if !reads.contains(name) && !READ_ELSEWHERE.iter().any(|(n, _)| n == name) {
            problems.push(format!(
                "the DaemonSet sets {name}, which the image's agent does not read"
            ));
        }
    }
    for name in env.keys() {
        if reads.contains(name) || name.starts_with("NVIDIA_") {
            problems.push(format!("the image sets {name}: leave it to the DaemonSet"));
        }
    }

    // Ports: the image exposes exactly the container's ports; the agent listens on them.
    let exposed: BTreeSet<String> = config["ExposedPorts"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let declared: BTreeSet<String> = agent
        .ports
        .iter()
        .map(|(_, p, proto)| format!("{p}/{proto}"))
        .collect();
    if exposed != declared {
        problems.push(format!(
            "the image exposes {exposed:?}, the DaemonSet declares {declared:?}"
        ));
    }
    for (name, flag, var) in [
        (agent.probe_port.as_str(), "--listen", "FAULTLINE_LISTEN"),
        ("peer", "--peer-listen", "FAULTLINE_PEER_LISTEN"),
    ] {
        let addr = agent
            .flag(flag, Some(var))
            .or_else(|| help_default(&help, flag));
        let port = addr
            .as_deref()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse::<u16>().ok());
        if port != Some(agent.port(name)) {
            problems.push(format!(
                "{flag} is {addr:?}, the containerPort {name} is {}",
                agent.port(name)
            ));
        }
    }

    // Mounts: every path the agent's args and environment name is on a volumeMount; the state
    // and data directories are writable mounts (the root is read-only).
    let values = agent
        .command
        .iter()
        .skip(1)
        .chain(&agent.args)
        .filter_map(|a| a.split_once('=').map(|(_, v)| v.to_string()))
        .chain(agent.env.iter().filter_map(|(_, v)| v.clone().ok()))
        .filter(|v| v.starts_with('/'));
    for v in values {
        if agent.mount_of(&v).is_none() {
            problems.push(format!(
                "{v} (an argument or variable of the agent) is on no volumeMount"
            ));
        }
    }
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

    // User: the image's user is the one the DaemonSet runs as.
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
    drop(cleanup);
    assert!(
        problems.is_empty(),
        "the DaemonSet and the image {image} disagree:\n- {}",
        problems.join("\n- ")
    );
}
