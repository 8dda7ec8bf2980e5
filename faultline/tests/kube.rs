//! End-to-end tests of Kubernetes mode: the real `faultline-agent` binary talks to the API
//! emulator (`tests/kube-emulator`) through a kubeconfig, exactly as it would talk to a cluster.
//!
//! Every test also checks that the agent made no API call missing from the call table
//! (`sink::kube::calls`): the emulator authorizes the agent's token with rules built from that
//! table, so an unlisted call would be refused with 403 and show up here.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{fault, Agent};
use faultline_agent::sink::kube::calls::{API_CALLS, COORDINATOR_API_CALLS};
use faultline_core::record::{Health, NodeRecord};
use faultline_kube_emulator::{Call, Emulator, FaultAction, FaultRule, ResourceRef, UserInfo};
use k8s_openapi::api::core::v1::Node;
use serde_json::{json, Value};

const TOKEN: &str = "agent-token";
const NS: &str = "faultline-system";
const XID79: &[u8] =
    b"4,100,5000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=x, GPU has fallen off the bus.\n";

/// An emulated cluster with nodes that already carry a foreign taint and kubelet conditions,
/// an agent pod object per node, and the coordinator (`faultline-coordinator`, one replica with
/// its own service account): it keeps the taint budget the agents ask before a new taint.
struct Cluster {
    rt: tokio::runtime::Runtime,
    emu: Emulator,
    kubeconfig: PathBuf,
    /// The policy file of the coordinator (and of the agents that are given it).
    policy: PathBuf,
    coordinator: Option<std::process::Child>,
    /// Where the agents ask the taint budget (the coordinator's Service on a cluster).
    coordinator_address: String,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(mut c) = self.coordinator.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

const COORDINATOR_TOKEN: &str = "coordinator-token";

/// The pod-bound token of `node`'s agent, for the coordinator's audience.
fn node_token(node: &str) -> String {
    format!("{node}-agent-token-0123456789abcdef")
}

fn operator_taint() -> Value {
    json!({"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"})
}

impl Cluster {
    /// The cluster with the built-in policy.
    fn new(nodes: &[&str]) -> Cluster {
        Cluster::with_policy(nodes, "")
    }

    /// The cluster, its coordinator following `policy` (YAML; give the agents `c.policy` too
    /// where they must agree). Scheduled peer checks are off: these tests are about the sinks.
    fn with_policy(nodes: &[&str], policy: &str) -> Cluster {
        let (rt, emu) = common::emulator();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        emu.write_kubeconfig(&kubeconfig, TOKEN).unwrap();
        let coordinator_kubeconfig = dir.path().join("coordinator-kubeconfig");
        emu.write_kubeconfig(&coordinator_kubeconfig, COORDINATOR_TOKEN)
            .unwrap();
        emu.authorize(
            COORDINATOR_TOKEN,
            UserInfo::service_account(NS, "faultline-coordinator"),
            common::rules_for(&[COORDINATOR_API_CALLS], NS),
        );
        let policy_file = dir.path().join("policy.yaml");
        std::fs::write(
            &policy_file,
            format!("peer: {{ enabled: false }}\n{policy}"),
        )
        .unwrap();
        emu.authorize(
            TOKEN,
            UserInfo {
                username: format!("system:serviceaccount:{NS}:faultline"),
                groups: vec!["system:serviceaccounts".into()],
                extra: Default::default(),
            },
            common::rules_for(&[API_CALLS], NS),
        );
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}));
        for n in nodes {
            let mut node = faultline_kube_emulator::node(n, &[("kubernetes.io/hostname", n)]);
            node["spec"]["taints"] = json!([operator_taint()]);
            emu.put(node);
            // The agent pod the coordinator counts, and its pod-bound token.
            common::agent_pod(&emu, NS, n, "127.0.0.1", &node_token(n));
        }
        // Its gRPC address, where the agents ask the taint budget (its Service on a cluster).
        let coordinator_address = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let coordinator = std::process::Command::new(env!("CARGO_BIN_EXE_faultline-coordinator"))
            .args(["--name", "faultline-coordinator-0", "--namespace", NS])
            .arg("--kubeconfig")
            .arg(&coordinator_kubeconfig)
            .arg("--policy")
            .arg(&policy_file)
            .args(["--peer-listen", &coordinator_address])
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info,faultline_coordinator::service=debug")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::from(
                std::fs::File::create(dir.path().join("coordinator.log")).unwrap(),
            ))
            .spawn()
            .unwrap();
        let c = Cluster {
            rt,
            emu,
            kubeconfig,
            policy: policy_file,
            coordinator: Some(coordinator),
            coordinator_address,
            _dir: dir,
        };
        c.wait("the coordinator to hold the Lease", None, |c| {
            c.emu
                .get(&ResourceRef::lease(NS, "faultline-peercheck"))
                .is_some_and(|l| {
                    l["spec"]["holderIdentity"]
                        .as_str()
                        .is_some_and(|h| h.starts_with("faultline-coordinator-0@"))
                })
        });
        c
    }

    /// How often the coordinator has denied `node` a taint (its debug log).
    fn denials_of(&self, node: &str) -> usize {
        std::fs::read_to_string(self._dir.path().join("coordinator.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("taint budget: denied") && l.contains(node))
            .count()
    }

    /// Stops the coordinator (SIGKILL): nobody answers for the taint budget.
    fn kill_coordinator(&mut self) {
        if let Some(mut c) = self.coordinator.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts `node`'s agent on `dir`, with its pod-bound token (written into `dir`).
    fn start_agent(&self, dir: &std::path::Path, node: &str, extra: &[&str]) -> Agent {
        let token = dir.join("node-token");
        std::fs::write(&token, format!("{}\n", node_token(node))).unwrap();
        let mut args = vec![
            "--kubeconfig",
            self.kubeconfig.to_str().unwrap(),
            "--node-name",
            node,
            "--settle",
            "2s",
            "--node-token-file",
            token.to_str().unwrap(),
            "--coordinator",
            &self.coordinator_address,
            "--peer-listen",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        Agent::start(dir, &args)
    }

    fn node(&self, name: &str) -> Node {
        serde_json::from_value(self.emu.get(&ResourceRef::node(name)).unwrap()).unwrap()
    }

    fn record(&self, node: &str) -> Option<NodeRecord> {
        let cm = self
            .emu
            .get(&ResourceRef::config_map(NS, &format!("faultline-{node}")))?;
        Some(serde_json::from_str(cm["data"]["faults.json"].as_str()?).unwrap())
    }

    fn configmap(&self, node: &str) -> Option<Value> {
        self.emu
            .get(&ResourceRef::config_map(NS, &format!("faultline-{node}")))
    }

    /// Events (events.k8s.io/v1) about `node`, as (reason, note, count).
    fn events(&self, node: &str) -> Vec<(String, String, i64)> {
        self.emu
            .list("events.k8s.io", "events", Some("default"))
            .into_iter()
            .filter(|e| e["regarding"]["name"] == node && e["regarding"]["kind"] == "Node")
            .map(|e| {
                (
                    e["reason"].as_str().unwrap_or_default().to_string(),
                    e["note"].as_str().unwrap_or_default().to_string(),
                    e["series"]["count"].as_i64().unwrap_or(1),
                )
            })
            .collect()
    }

    fn taints(&self, node: &str) -> Vec<String> {
        self.node(node)
            .spec
            .and_then(|s| s.taints)
            .unwrap_or_default()
            .into_iter()
            .map(|t| format!("{}={}:{}", t.key, t.value.unwrap_or_default(), t.effect))
            .collect()
    }

    /// (status, reason) of a node condition.
    fn condition(&self, node: &str, type_: &str) -> Option<(String, String)> {
        self.condition_message(node, type_).map(|(s, r, _)| (s, r))
    }

    fn condition_message(&self, node: &str, type_: &str) -> Option<(String, String, String)> {
        self.node(node)
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == type_)
            .map(|c| {
                (
                    c.status,
                    c.reason.unwrap_or_default(),
                    c.message.unwrap_or_default(),
                )
            })
    }

    /// The AcceleratorHealthy condition is False and its message names `code`.
    fn condition_names(&self, node: &str, code: &str) -> bool {
        self.condition_message(node, "AcceleratorHealthy")
            .is_some_and(|(s, _, m)| s == "False" && m.contains(code))
    }

    fn wait(&self, what: &str, agent: Option<&Agent>, f: impl Fn(&Cluster) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !f(self) {
            if Instant::now() > deadline {
                panic!(
                    "timed out waiting for {what}\nnode: {}\nconfigmap: {}\ncalls: {:#?}\nlog:\n{}",
                    serde_json::to_string_pretty(&self.emu.get(&ResourceRef::node("node-a")))
                        .unwrap(),
                    serde_json::to_string_pretty(&self.configmap("node-a")).unwrap(),
                    self.emu.calls().iter().rev().take(20).collect::<Vec<_>>(),
                    agent.map(|a| a.log()).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Every call the agent made was allowed, and it made no call it was refused.
    fn assert_calls_listed(&self) {
        for c in self.emu.calls() {
            if c.token.as_deref() == Some(TOKEN) {
                assert_ne!(
                    c.status, 403,
                    "the agent made a call the table does not list: {c:?}"
                );
                assert_ne!(c.status, 401, "{c:?}");
            }
        }
    }

    fn writes(&self) -> Vec<Call> {
        self.emu
            .calls()
            .into_iter()
            .filter(|c| c.is_write() && !c.injected)
            .collect()
    }
}

fn healthy_everywhere(c: &Cluster, node: &str) -> bool {
    c.record(node).is_some_and(|r| r.health == Health::Healthy)
        && c.node(node)
            .metadata
            .labels
            .unwrap_or_default()
            .get("faultline.io/health")
            == Some(&"Healthy".to_string())
        && c.condition(node, "AcceleratorHealthy").map(|c| c.0) == Some("True".into())
}

fn unhealthy_everywhere(c: &Cluster, node: &str) -> bool {
    c.taints(node)
        .contains(&"faultline.io/unhealthy=Xid79:NoSchedule".to_string())
        && c.node(node)
            .metadata
            .labels
            .unwrap_or_default()
            .get("faultline.io/health")
            == Some(&"Unhealthy".to_string())
        && c.condition(node, "AcceleratorHealthy") == Some(("False".into(), "SeparateNPU".into()))
        && c.condition_names(node, "Xid79")
        && c.record(node)
            .is_some_and(|r| r.health == Health::Unhealthy && fault(&r, "Xid79").is_some())
        && c.events(node)
            .iter()
            .any(|e| e.0 == "FaultDetected" && e.1.contains("Xid79"))
}

/// The acceptance path: Xid 79 taints and labels the node, sets the condition False,
/// writes the ConfigMap and an Event; foreign taints and kubelet conditions stay; a restart
/// changes nothing.
#[test]
fn xid79_reaches_the_node_configmap_and_events_and_a_restart_changes_nothing() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &[]);
    c.wait("a healthy node", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
    });
    let cm = c.configmap("node-a").unwrap();
    assert_eq!(
        cm["metadata"]["labels"]["app.kubernetes.io/name"],
        "faultline"
    );
    assert_eq!(cm["metadata"]["labels"]["faultline.io/node"], "node-a");
    assert_eq!(cm["metadata"]["labels"]["faultline.io/health"], "Healthy");
    let ready_before = c.condition("node-a", "Ready");

    agent.append(XID79);
    c.wait("the Xid 79 everywhere", Some(&agent), |c| {
        unhealthy_everywhere(c, "node-a")
    });
    let taints = c.taints("node-a");
    assert!(
        taints.contains(&"example.com/maintenance=planned:NoSchedule".to_string()),
        "foreign taint kept: {taints:?}"
    );
    assert_eq!(taints.len(), 2, "{taints:?}");
    assert_eq!(
        c.condition("node-a", "Ready"),
        ready_before,
        "kubelet conditions untouched"
    );
    for t in ["MemoryPressure", "DiskPressure", "PIDPressure"] {
        assert!(
            c.condition("node-a", t).is_some(),
            "kubelet condition {t} survived"
        );
    }
    assert_eq!(
        c.configmap("node-a").unwrap()["metadata"]["labels"]["faultline.io/health"],
        "Unhealthy"
    );
    // The cluster commands of the CLI, against the emulator: `faultline <command> <args>`, as
    // an operator allowed to list nodes, and configmaps and pods in the agents' namespace.
    let cli_dir = tempfile::tempdir().unwrap();
    let cli_kubeconfig = cli_dir.path().join("kubeconfig");
    c.emu.write_kubeconfig(&cli_kubeconfig, "operator").unwrap();
    let list = |resource: &str, ns: Option<&str>| faultline_kube_emulator::Rule {
        verbs: vec!["list".into()],
        api_groups: vec!["".into()],
        resources: vec![resource.into()],
        resource_names: vec![],
        namespace: ns.map(String::from),
    };
    c.emu.authorize(
        "operator",
        UserInfo {
            username: "operator".into(),
            groups: vec![],
            extra: Default::default(),
        },
        vec![
            list("nodes", None),
            list("configmaps", Some(NS)),
            list("pods", Some(NS)),
        ],
    );
    let cluster_cli = |command: &[&str], args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
            .args(command)
            .args(["--kubeconfig", cli_kubeconfig.to_str().unwrap()])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    // `faultline get --cluster` reads every node's record from the ConfigMaps, and takes the
    // agent behind each for alive while its pod on the node is Ready.
    let agent_pod = |ready: &str| {
        let mut pod = c
            .emu
            .get(&ResourceRef::pod(NS, "faultline-node-a"))
            .unwrap_or_else(|| {
                json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "faultline-node-a", "namespace": NS,
                        "labels": {"app.kubernetes.io/name": "faultline",
                                   "app.kubernetes.io/component": "agent"}},
                    "spec": {"nodeName": "node-a",
                             "containers": [{"name": "agent", "image": "faultline"}]},
                    "status": {"phase": "Running", "podIP": "127.0.0.1"}})
            });
        pod["status"]["conditions"] = json!([{"type": "Ready", "status": ready}]);
        pod
    };
    c.emu.put(agent_pod("True"));
    let get = |args: &[&str]| cluster_cli(&["get", "--cluster"], args);
    let json: Vec<NodeRecord> =
        serde_json::from_str(&get(&["--health", "unhealthy", "-o", "json"])).unwrap();
    assert_eq!(json.len(), 1);
    assert_eq!(
        (json[0].node.as_str(), json[0].health),
        ("node-a", Health::Unhealthy)
    );
    assert!(get(&["--health", "healthy"]).contains("no matching nodes"));
    let table = get(&["--code", "Xid79"]);
    assert!(
        table.contains("node-a") && table.contains("Xid79@GPU-0000:3b:00.0"),
        "{table}"
    );
    // An agent whose pod is not Ready (stopped, restarting), or that has no pod: its record is
    // still printed, with a warning on stderr, `notAlive` in the JSON, and exit 3. (Before: the
    // record alone, exit 0.) No pod may mean no Node any more: the reason says how to remove
    // the record then. (Before: only "no faultline agent pod on the node".)
    let get_dead = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
            .args([
                "get",
                "--cluster",
                "--kubeconfig",
                cli_kubeconfig.to_str().unwrap(),
            ])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let no_pod = format!(
        "no faultline agent pod on the node (if the node no longer exists, its record outlived \
         it: kubectl -n {NS} delete configmap faultline-node-a)"
    );
    for (pod, why) in [
        (Some("False"), "its faultline agent pod is not Ready"),
        (None, no_pod.as_str()),
    ] {
        match pod {
            Some(ready) => c.emu.put(agent_pod(ready)),
            None => {
                c.emu.delete(&ResourceRef::pod(NS, "faultline-node-a"));
                Value::Null
            }
        };
        let (code, out, err) = get_dead(&["-o", "json"]);
        assert_eq!(code, Some(3), "{out}{err}");
        let docs: Vec<Value> = serde_json::from_str(&out).unwrap();
        assert_eq!(docs[0]["node"], "node-a");
        assert_eq!(docs[0]["notAlive"], why);
        assert_eq!(
            err,
            format!("warning: not known to be alive, so their records may be out of date: node-a ({why})\n")
        );
        let (code, out, err) = get_dead(&["--node", "node-a"]);
        assert_eq!(code, Some(3), "{err}");
        assert!(out.starts_with("NODE") && out.contains("Xid79"), "{out}");
        assert!(err.contains(why), "{err}");
    }
    c.emu.put(agent_pod("True"));
    // `faultline hosts` leaves the unhealthy node out: with no usable node it prints nothing.
    let hosts = |args: &[&str]| cluster_cli(&["hosts", "--slots", "8"], args);
    assert_eq!(hosts(&[]), "");
    assert_eq!(hosts(&["--allow-degraded"]), "");
    // The local file says the same as the ConfigMap (each sink writes at its own pace: the
    // file sink's write budget may hold the newest record back a few hundred milliseconds).
    let in_cluster = c.record("node-a").unwrap().check_code;
    agent.wait_for("the local record to match the ConfigMap", |r| {
        r.check_code == in_cluster
    });

    // Restart: the agent adopts what is there and writes nothing.
    assert_eq!(agent.stop(), 0);
    std::thread::sleep(Duration::from_millis(300));
    c.emu.clear_calls();
    let events_before = c.events("node-a");
    let agent = c.start_agent(dir.path(), "node-a", &[]);
    agent.addr();
    // Long enough for the sinks to read everything back and the settle time to pass.
    c.wait("the restarted agent to read the node", Some(&agent), |c| {
        c.emu.calls().iter().filter(|x| x.method == "GET").count() >= 2
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        c.writes(),
        Vec::<Call>::new(),
        "a restart writes nothing when nothing changed"
    );
    assert_eq!(c.events("node-a"), events_before, "no duplicate Events");
    assert!(unhealthy_everywhere(&c, "node-a"));
    c.assert_calls_listed();

    // An operator clear brings everything back to healthy; the foreign taint still stays.
    let (code, _, err) = common::cli(&["clear", "--code", "Xid79"], &agent.state());
    assert_eq!(code, Some(0), "{err}");
    c.wait("healthy again", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
            && c.taints("node-a") == ["example.com/maintenance=planned:NoSchedule"]
            && c.events("node-a").iter().any(|e| e.0 == "FaultRecovered")
    });
    // `hosts` also wants the Node to offer accelerators and the agent's pod to be Ready.
    let mut node = c.emu.get(&ResourceRef::node("node-a")).unwrap();
    node["status"]["allocatable"]["nvidia.com/gpu"] = json!("8");
    c.emu.put(node);
    assert_eq!(hosts(&[]), "node-a:8\n");
    c.assert_calls_listed();
}

/// `faultline hosts` as a launcher runs it, with a service account allowed only what the help
/// says it needs (list nodes and configmaps; list pods in the agents' namespace): it lists a
/// node only when the Node exists, is Ready and offers accelerators, its agent pod is Ready and
/// its record is usable; slots default to the node's accelerators. A namespace without records
/// and a refused list are errors (exit 2), not the empty output of "nothing usable". (The
/// command used to list every record: a CPU node, a NotReady node, a deleted node, a node whose
/// agent was down.)
#[test]
fn hosts_lists_only_what_a_launcher_can_use() {
    use faultline_kube_emulator::Rule;
    let (_rt, emu) = common::emulator();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig, "launcher").unwrap();
    let rule = |resource: &str, ns: Option<&str>| Rule {
        verbs: vec!["list".into()],
        api_groups: vec!["".into()],
        resources: vec![resource.into()],
        resource_names: vec![],
        namespace: ns.map(String::from),
    };
    emu.authorize(
        "launcher",
        UserInfo {
            username: "system:serviceaccount:jobs:launcher".into(),
            groups: vec!["system:serviceaccounts".into()],
            extra: Default::default(),
        },
        vec![
            rule("nodes", None),
            // Records in any namespace (a ClusterRole), so a mistyped namespace is listed.
            rule("configmaps", None),
            rule("pods", Some(NS)),
            rule("pods", Some("jobs")),
        ],
    );
    emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}));
    let healthy = |node: &str| {
        json!({"apiVersion": "faultline.io/v1", "node": node, "health": "Healthy",
               "updateTime": "2026-11-22T01:02:03.000Z", "checkCode": "x", "faults": [],
               "agent": {"version": "0", "policy": {"source": "builtin", "checksum": "y"},
                         "detectors": []}})
    };
    // name, GPUs, Node Ready, agent pod (None: none), record health
    let nodes: [(&str, u32, bool, Option<bool>, &str); 7] = [
        ("gpu-a", 8, true, Some(true), "Healthy"),
        ("gpu-b", 4, true, Some(true), "Healthy"),
        ("gpu-notready", 8, false, Some(true), "Healthy"),
        ("cpu-1", 0, true, Some(true), "Healthy"),
        ("gpu-agent-down", 8, true, Some(false), "Healthy"),
        ("gpu-no-agent", 8, true, None, "Healthy"),
        ("gpu-sick", 8, true, Some(true), "Unhealthy"),
    ];
    for (name, gpus, ready, agent, health) in nodes {
        let mut n = faultline_kube_emulator::node(name, &[]);
        if gpus > 0 {
            n["status"]["allocatable"]["nvidia.com/gpu"] = json!(gpus.to_string());
            n["status"]["capacity"]["nvidia.com/gpu"] = json!(gpus.to_string());
        }
        if !ready {
            for c in n["status"]["conditions"].as_array_mut().unwrap() {
                if c["type"] == "Ready" {
                    c["status"] = json!("False");
                }
            }
        }
        emu.put(n);
        if let Some(ready) = agent {
            emu.put(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("faultline-{name}"), "namespace": NS,
                    "labels": {"app.kubernetes.io/name": "faultline", "app.kubernetes.io/component": "agent"}},
                "spec": {"nodeName": name, "containers": [{"name": "agent", "image": "faultline"}]},
                "status": {"phase": "Running", "conditions": [
                    {"type": "Ready", "status": if ready { "True" } else { "False" }}]}}));
        }
        let mut r = healthy(name);
        r["health"] = json!(health);
        if health == "Unhealthy" {
            r["handling"] = json!("SeparateNPU");
        }
        emu.put(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("faultline-{name}"), "namespace": NS,
                "labels": {"app.kubernetes.io/name": "faultline", "faultline.io/node": name}},
            "data": {"faults.json": r.to_string()}}));
    }
    // A record whose Node was deleted.
    emu.put(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "faultline-gpu-gone", "namespace": NS,
            "labels": {"app.kubernetes.io/name": "faultline", "faultline.io/node": "gpu-gone"}},
        "data": {"faults.json": healthy("gpu-gone").to_string()}}));
    let hosts = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
            .arg("hosts")
            .args(["--kubeconfig", kubeconfig.to_str().unwrap()])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    assert_eq!(
        hosts(&[]),
        (Some(0), "gpu-a:8\ngpu-b:4\n".to_string(), String::new())
    );
    assert_eq!(hosts(&["--slots", "2"]).1, "gpu-a:2\ngpu-b:2\n");
    let (code, out, _) = hosts(&["-o", "json"]);
    assert_eq!(code, Some(0));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["hosts"],
        json!([{"host": "gpu-a", "slots": 8}, {"host": "gpu-b", "slots": 4}])
    );
    let left = left_out(&v, "node");
    assert_eq!(left.len(), 6, "{left:?}");
    assert_eq!(left["gpu-gone"], "no such Node (the record outlived it)");
    assert_eq!(left["cpu-1"], "the Node offers no accelerators");
    assert_eq!(
        left["gpu-agent-down"],
        "its faultline agent pod is not Ready"
    );
    // The job's pods on usable nodes, by hostname (headless-Service subdomain) or IP, with the
    // accelerators each asks for.
    emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "jobs"}}));
    for (pod, node, gpus, phase, ip) in [
        ("train-w-0", Some("gpu-a"), 8, "Running", "10.0.0.8"),
        ("train-w-1", Some("gpu-sick"), 8, "Running", "10.0.0.5"),
        ("train-w-2", None, 8, "Pending", ""),
        ("train-w-3", Some("gpu-b"), 4, "Running", "10.0.0.1"),
        ("other", Some("gpu-a"), 8, "Running", "10.0.0.9"),
        ("other-2", Some("gpu-b"), 8, "Running", "10.0.0.10"),
    ] {
        let label = if pod.starts_with("other") {
            "other"
        } else {
            "train"
        };
        emu.put(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": "jobs", "labels": {"job": label}},
            "spec": {"nodeName": node, "hostname": pod, "subdomain": "train",
                "containers": [{"name": "w", "image": "x",
                    "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]},
            "status": {"phase": phase, "podIP": ip}}));
    }
    let pods = |extra: &[&str]| {
        let mut a = vec!["--pods", "-l", "job=train", "--pod-namespace", "jobs"];
        a.extend_from_slice(extra);
        hosts(&a)
    };
    assert_eq!(
        pods(&[]),
        (
            Some(0),
            "train-w-0.train:8\ntrain-w-3.train:4\n".to_string(),
            String::new()
        )
    );
    assert_eq!(
        pods(&["--ip", "--slots", "1"]).1,
        "10.0.0.8:1\n10.0.0.1:1\n"
    );
    let v: Value = serde_json::from_str(&pods(&["-o", "json"]).1).unwrap();
    let left = left_out(&v, "pod");
    assert!(
        left["train-w-1"].starts_with("its node gpu-sick: the record says Unhealthy"),
        "{left:?}"
    );
    assert_eq!(left["train-w-2"], "the pod is not running");
    let (code, _, err) = hosts(&["--pods", "-l", "job=nope", "--pod-namespace", "jobs"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no pod matches"), "{err}");
    // The Horovod elastic example's two scripts, run as written: the sidecar's refresh (with
    // this build's CLI as `faultline` on PATH) and the launcher's discovery script, whose output
    // is read by Horovod's own rules.
    let yaml = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests/examples/horovod-elastic.yaml"),
    )
    .unwrap();
    let block = |key: &str| -> String {
        yaml.split_once(&format!("  {key}: |\n"))
            .unwrap()
            .1
            .lines()
            .take_while(|l| l.starts_with("    "))
            .map(|l| format!("{}\n", &l[4..]))
            .collect()
    };
    let (refresh, discovery) = (block("refresh_hosts.sh"), block("discover_hosts.sh"));
    let path_dir = dir.path().join("path");
    let hosts_dir = dir.path().join("hosts");
    std::fs::create_dir_all(&path_dir).unwrap();
    std::fs::create_dir_all(&hosts_dir).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_faultline"), path_dir.join("faultline"))
        .unwrap();
    let sh = |script: &str| {
        let out = std::process::Command::new("sh")
            .args(["-c", script])
            .env("PATH", format!("{}:/usr/bin:/bin", path_dir.display()))
            .env("FAULTLINE_KUBECONFIG", &kubeconfig)
            .env("JOB_NAMESPACE", "jobs")
            .env("HOSTS_DIR", &hosts_dir)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8(out.stdout).unwrap())
    };
    // Before the sidecar's first list, discovery fails (the launcher waits for the list).
    assert_eq!(sh(&discovery).0, Some(1));
    let mpi_worker = |i: u32, node: &str| {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("horovod-elastic-worker-{i}"), "namespace": "jobs",
                "labels": {"training.kubeflow.org/job-name": "horovod-elastic",
                           "training.kubeflow.org/job-role": "worker"}},
            "spec": {"nodeName": node, "hostname": format!("horovod-elastic-worker-{i}"),
                "subdomain": "horovod-elastic",
                "containers": [{"name": "worker", "image": "x",
                    "resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
            "status": {"phase": "Running", "podIP": format!("10.0.1.{i}")}})
    };
    emu.put(mpi_worker(0, "gpu-sick"));
    // No worker on a usable node: an empty list, which Horovod reads as "no host now".
    assert_eq!(sh(&refresh).0, Some(0));
    let (code, out) = sh(&discovery);
    assert_eq!((code, horovod_hosts(&out)), (Some(0), BTreeMap::new()));
    emu.put(mpi_worker(1, "gpu-a"));
    emu.put(mpi_worker(2, "gpu-b"));
    assert_eq!(sh(&refresh).0, Some(0));
    let (code, out) = sh(&discovery);
    assert_eq!(code, Some(0));
    let both = BTreeMap::from([
        ("horovod-elastic-worker-1.horovod-elastic".to_string(), 8),
        ("horovod-elastic-worker-2.horovod-elastic".to_string(), 8),
    ]);
    assert_eq!(horovod_hosts(&out), both);
    // A failed refresh (the API refuses: another namespace) keeps the last list.
    let refused = refresh.replace("${JOB_NAMESPACE:-default}", "kube-system");
    assert_ne!(sh(&refused).0, Some(0));
    assert_eq!(horovod_hosts(&sh(&discovery).1), both);
    // The PyTorchJob example's pre-flight script, run as written: with this build's CLI, as the
    // recipe's service account (list pods in the job's namespace, get the coordinator Lease),
    // and with a stand-in `faultline` that exits with each verdict code, to show what the script
    // does with each.
    let pytorchjob: Vec<Value> = serde_saphyr::from_multiple(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../manifests/examples/pytorchjob.yaml"),
        )
        .unwrap(),
    )
    .unwrap();
    let master = pytorchjob
        .iter()
        .find(|d| d["kind"] == "PyTorchJob")
        .map(|d| &d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"])
        .unwrap();
    let peer_check = master["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "peer-check")
        .unwrap();
    assert_eq!(
        (&peer_check["command"][0], &peer_check["command"][1]),
        (&json!("sh"), &json!("-c"))
    );
    let preflight = peer_check["command"][2].as_str().unwrap().to_string();
    assert!(
        preflight.starts_with("faultline check --pods") && preflight.contains("--timeout 5m"),
        "{preflight}"
    );
    let preflight_kubeconfig = dir.path().join("preflight-kubeconfig");
    emu.write_kubeconfig(&preflight_kubeconfig, "preflight")
        .unwrap();
    emu.authorize(
        "preflight",
        UserInfo {
            username: "system:serviceaccount:jobs:pytorch-preflight".into(),
            groups: vec!["system:serviceaccounts".into()],
            extra: Default::default(),
        },
        vec![
            rule("pods", Some("jobs")),
            Rule {
                verbs: vec!["get".into()],
                api_groups: vec!["coordination.k8s.io".into()],
                resources: vec!["leases".into()],
                resource_names: vec!["faultline-peercheck".into()],
                namespace: Some(NS.into()),
            },
        ],
    );
    let bin_dir = dir.path().join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    let run_preflight = |faultline: &str| {
        use std::os::unix::fs::PermissionsExt;
        let shim = bin_dir.join("faultline");
        std::fs::write(&shim, faultline).unwrap();
        std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut sh = std::process::Command::new("sh");
        sh.args(["-c", &preflight])
            .env("PATH", format!("{}:/usr/bin:/bin", bin_dir.display()))
            .env("FAULTLINE_JOB_NAMESPACE", "jobs");
        // A guard against a hang (the check waiting out its --timeout), not a timing test.
        let (code, out, _) = common::run_guarded(&mut sh, Duration::from_secs(60));
        (code, out)
    };
    // This build's CLI with the pod's settings: its service account (the kubeconfig) and the
    // mounted requesters' secret. Nothing else is changed: the --timeout is the recipe's 5m.
    let real = format!(
        "#!/bin/sh\nexec '{}' \"$@\" --kubeconfig '{}' --secret-file '{}'\n",
        env!("CARGO_BIN_EXE_faultline"),
        preflight_kubeconfig.display(),
        dir.path().join("secret").display()
    );
    std::fs::write(
        dir.path().join("secret"),
        "0123456789abcdef0123456789abcdef",
    )
    .unwrap();
    for (pod, node) in [
        ("pytorch-example-master-0", "gpu-a"),
        ("pytorch-example-worker-0", "gpu-b"),
    ] {
        emu.put(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": "jobs",
                "labels": {"training.kubeflow.org/job-name": "pytorch-example"}},
            "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "x"}]},
            "status": {"phase": "Pending"}}));
    }
    // No coordinator installed (no Lease): no check can run, said at once, and the Master
    // starts. (Before, the check retried "no coordinator holds the Lease yet" for the whole 5m.)
    let (code, out) = run_preflight(&real);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("no peer check (exit 2); starting"), "{out}");
    let answer: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(answer["exitCode"], 2, "{out}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .starts_with("no peer check can run: there is no coordinator Lease faultline-system/faultline-peercheck"),
        "{out}"
    );
    // A coordinator that stopped (it released the Lease) and none took over: said after the
    // grace (30 s), not at --timeout.
    emu.put(
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "faultline-peercheck", "namespace": NS},
        "spec": {"leaseDurationSeconds": 15}}),
    );
    let (code, out) = run_preflight(&real);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("no peer check (exit 2); starting"), "{out}");
    assert!(
        out.contains("nobody holds the coordinator Lease faultline-system/faultline-peercheck")
            && out.contains("and no coordinator came within 30s"),
        "{out}"
    );
    emu.delete(&ResourceRef::lease(NS, "faultline-peercheck"));
    // Nor does it wait for the job's pods to be scheduled first (train-w-2 is Pending).
    let mut pending = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"));
    pending
        .args(["check", "--pods", "job=train", "--pod-namespace", "jobs"])
        .args(["--kubeconfig", preflight_kubeconfig.to_str().unwrap()])
        .args(["--secret-file", dir.path().join("secret").to_str().unwrap()]);
    let (code, _, err) = common::run_guarded(&mut pending, Duration::from_secs(60));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.starts_with("error: no peer check can run: there is no coordinator Lease"),
        "{err}"
    );
    for (verdict, want) in [(0, 0), (1, 1), (3, 0), (2, 0)] {
        let (code, out) = run_preflight(&format!("#!/bin/sh\necho '{{}}'\nexit {verdict}\n"));
        assert_eq!(code, Some(want), "faultline check exit {verdict}: {out}");
    }
    // `faultline check --pods`: the job's nodes from its own pods (a namespaced list, no
    // cluster-wide right), waiting for every pod to be scheduled.
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    let check = |selector: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
            .args(["check", "--pods", selector, "--pod-namespace", "jobs"])
            .args(["--kubeconfig", kubeconfig.to_str().unwrap()])
            .args(["--coordinator", "127.0.0.1:9", "--timeout", "3s"])
            .args(["--secret-file", secret.to_str().unwrap()])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, err) = check("job=train");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("pods not scheduled yet: train-w-2"), "{err}");
    let (code, err) = check("job=other");
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("cannot reach the coordinator at 127.0.0.1:9"),
        "the pods' nodes were found, the run was asked for: {err}"
    );
    let (code, err) = check("job=none");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no pod matches"), "{err}");
    // A job on one node: there is nothing to pair it with.
    emu.put(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "solo", "namespace": "jobs", "labels": {"job": "solo"}},
        "spec": {"nodeName": "gpu-a", "containers": [{"name": "w", "image": "x"}]},
        "status": {"phase": "Running"}}));
    let (code, err) = check("job=solo");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("at least two nodes"), "{err}");
    // A namespace without records is an error, not "no usable node".
    let (code, out, err) = hosts(&["--namespace", "faultline-sytem"]);
    assert_eq!((code, out.as_str()), (Some(2), ""), "{err}");
    assert!(
        err.contains("no fault records in namespace faultline-sytem"),
        "{err}"
    );
    // So is a list the account may not make (the pods of another namespace's agents).
    emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}}));
    emu.put(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "faultline-gpu-a", "namespace": "other",
            "labels": {"app.kubernetes.io/name": "faultline", "faultline.io/node": "gpu-a"}},
        "data": {"faults.json": healthy("gpu-a").to_string()}}));
    let (code, _, err) = hosts(&["--namespace", "other"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot list the agent pods in other"), "{err}");
    assert!(err.contains("forbidden"), "{err}");
}

/// `hosts -o json`'s `leftOut` as name -> why; `key` names what was left out (`node`, `pod`).
fn left_out(v: &Value, key: &str) -> BTreeMap<String, String> {
    v["leftOut"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x[key].as_str().unwrap().to_string(),
                x["why"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// What Horovod elastic (0.25 and later; the example runs 0.28.1) makes of a discovery script's
/// output, its `HostDiscoveryScript` restated: the whole output stripped, split on newlines,
/// each distinct line a host; a line with `:` is `host:slots` (exactly one `:`, slots an
/// integer, else Horovod raises), a line without gets the default slots (0 here, to show it),
/// an empty line is skipped (before 0.25 it became a host named "").
fn horovod_hosts(stdout: &str) -> BTreeMap<String, u32> {
    let lines: std::collections::BTreeSet<&str> = stdout.trim().split('\n').collect();
    lines
        .into_iter()
        .filter_map(
            |line| match line.split(':').collect::<Vec<_>>().as_slice() {
                [host, slots] => Some((host.to_string(), slots.parse().expect("int(slots)"))),
                [""] => None,
                [host] => Some((host.to_string(), 0)),
                _ => panic!("Horovod cannot unpack {line:?}"),
            },
        )
        .collect()
}

/// Every request names its sender (`faultline-agent/<version> (<node>)`, what an audit log
/// shows as the user agent), every write names a field manager (Events too, which kube-runtime's
/// Recorder sends without one: a real API server would record them as owned by `unknown`), and
/// the watches of the agent's own objects stay open while nothing happens. The emulator sends
/// watch bookmarks once a minute, like a real API server; a client read timeout shorter than
/// that (the agent's was 15 s) cuts every quiet watch and makes the agent watch again.
#[test]
fn every_request_names_the_agent_and_quiet_watches_stay_open() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &[]);
    c.wait("a healthy node", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
    });
    agent.append(XID79);
    c.wait("the Xid 79 everywhere", Some(&agent), |c| {
        unhealthy_everywhere(c, "node-a")
    });
    let ua = format!("faultline-agent/{} (node-a)", env!("CARGO_PKG_VERSION"));
    let calls: Vec<Call> = c
        .emu
        .calls()
        .into_iter()
        .filter(|x| x.token.as_deref() == Some(TOKEN))
        .collect();
    assert!(
        calls
            .iter()
            .any(|x| x.method == "POST" && x.path.contains("/events")),
        "an Event was created: {calls:#?}"
    );
    for x in &calls {
        assert_eq!(x.user_agent.as_deref(), Some(ua.as_str()), "{x:?}");
        if matches!(x.method.as_str(), "POST" | "PUT" | "PATCH") {
            assert!(
                x.field_manager
                    .as_deref()
                    .is_some_and(|m| m.starts_with("faultline")),
                "a write without the agent's field manager: {x:?}"
            );
        }
    }
    let events = c.emu.list("events.k8s.io", "events", Some("default"));
    assert!(!events.is_empty());
    for e in &events {
        let managers: Vec<&str> = e["metadata"]["managedFields"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["manager"].as_str())
            .collect();
        assert_eq!(managers, ["faultline"], "{e:#}");
    }

    // Nothing changes for 20 s: no watch is cut and started again, nothing is listed again.
    c.emu.clear_calls();
    std::thread::sleep(Duration::from_secs(20));
    let again: Vec<Call> = c
        .emu
        .calls()
        .into_iter()
        .filter(|x| x.is_watch() || x.query.contains("fieldSelector"))
        .collect();
    assert_eq!(again, Vec::<Call>::new(), "quiet watches were cut");
    assert!(unhealthy_everywhere(&c, "node-a"));
    c.assert_calls_listed();
}

/// Someone deletes the fault ConfigMap, replaces the Node without faultline's taint, label and
/// condition (a PUT), and the API server comes back empty (the Node re-registered bare, the
/// ConfigMap gone). The periodic resync is set to an hour here, so only the watches of the own
/// objects can repair these: each is repaired within seconds, and the foreign taint stays.
#[test]
fn deleted_or_replaced_own_objects_are_repaired_in_seconds_not_at_the_resync() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &["--resync", "1h"]);
    agent.append(XID79);
    c.wait("the Xid 79 everywhere", Some(&agent), |c| {
        unhealthy_everywhere(c, "node-a")
    });
    let repaired_within = |what: &str, f: &dyn Fn(&Cluster) -> bool| {
        let start = Instant::now();
        c.wait(what, Some(&agent), |c| f(c));
        // The resync is an hour away: a repair within the wait's 60 s came from the watch.
        start.elapsed()
    };
    let cm_back = |c: &Cluster| {
        c.record("node-a")
            .is_some_and(|r| r.health == Health::Unhealthy && fault(&r, "Xid79").is_some())
    };
    // Quiet first: every detector has reported, so no content change of the record is still on
    // its way (an ordinary write of one would recreate the deleted ConfigMap before the watch's
    // repair, and the repair would not be counted; CI saw that once).
    c.wait("every detector in the ConfigMap", Some(&agent), |c| {
        c.record("node-a").is_some_and(|r| {
            ["kmsg", "nvml", "npu-smi", "hccn_tool", "record-file"]
                .iter()
                .all(|d| r.agent.detectors.iter().any(|x| x.name == *d))
        })
    });
    std::thread::sleep(Duration::from_millis(500));

    // 1. The fault ConfigMap is deleted.
    assert!(c
        .emu
        .delete(&ResourceRef::config_map(NS, "faultline-node-a")));
    let took = repaired_within("the deleted ConfigMap to be written again", &cm_back);
    eprintln!("ConfigMap recreated after {took:?}");

    // 2. The Node is replaced by one without faultline's taint, label and condition.
    let mut bare = faultline_kube_emulator::node("node-a", &[("kubernetes.io/hostname", "node-a")]);
    bare["spec"]["taints"] = json!([operator_taint()]);
    c.emu.put(bare.clone());
    assert!(!c
        .taints("node-a")
        .iter()
        .any(|t| t.starts_with("faultline.io/")));
    let took = repaired_within("the replaced node to be repaired", &|c| {
        unhealthy_everywhere(c, "node-a")
    });
    eprintln!("node repaired after {took:?}");
    assert!(c
        .taints("node-a")
        .contains(&"example.com/maintenance=planned:NoSchedule".to_string()));

    // 3. The API server restarts with nothing of ours: the kubelet re-registers a bare Node.
    c.rt.block_on(c.emu.down());
    assert!(c
        .emu
        .delete(&ResourceRef::config_map(NS, "faultline-node-a")));
    assert!(c.emu.delete(&ResourceRef::node("node-a")));
    c.emu.put(bare);
    c.rt.block_on(c.emu.up()).unwrap();
    let took = repaired_within("everything back after an empty API server", &|c| {
        unhealthy_everywhere(c, "node-a") && cm_back(c)
    });
    eprintln!("restored after the empty API server in {took:?}");
    c.assert_calls_listed();
    let (_, metrics) = agent.get("/metrics");
    let repairs: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("faultline_drift_repairs_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        repairs >= 3.0,
        "drift repairs counted: {repairs}\n{metrics}"
    );
}

/// A policy file in `dir` that makes Xid 79 a fault only an operator may clear.
fn operator_held_xid79_policy(dir: &std::path::Path) -> PathBuf {
    let policy = dir.join("policy.yaml");
    std::fs::write(
        &policy,
        "overrides:\n  Xid79: { handling: ManuallySeparateNPU }\n",
    )
    .unwrap();
    policy
}

/// The state and data directories are lost (faults.json and state.json both gone): the agent rebuilds from
/// the fault ConfigMap instead of starting empty and untainting the node after `--settle`.
/// Within the same boot the kernel-log faults are kept; after a reboot (new
/// boot id, a later boot time, an empty kernel log) only the operator-held fault survives, and
/// the node stays tainted.
#[test]
fn a_lost_state_directory_is_rebuilt_from_the_cluster_and_survives_a_reboot() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let policy = operator_held_xid79_policy(dir.path());
    let proc_stat = dir.path().join("stat");
    let real = std::fs::read_to_string("/proc/stat").unwrap();
    std::fs::write(&proc_stat, &real).unwrap();
    let extra = [
        "--policy",
        policy.to_str().unwrap(),
        "--proc-stat-path",
        proc_stat.to_str().unwrap(),
    ];
    let agent = c.start_agent(dir.path(), "node-a", &extra);
    agent.append(XID79);
    agent.append(b"4,101,5000100,-;NVRM: Xid (PCI:0000:5e:00): 48, pid=0, name=x, DBE.\n");
    c.wait("both faults in the ConfigMap", Some(&agent), |c| {
        c.record("node-a")
            .is_some_and(|r| fault(&r, "Xid79").is_some() && fault(&r, "Xid48").is_some())
            && c.taints("node-a")
                .iter()
                .any(|t| t.starts_with("faultline.io/"))
    });
    let tainted = c.taints("node-a");
    assert!(
        tainted.iter().any(|t| t.starts_with("faultline.io/")),
        "{tainted:?}"
    );
    assert_eq!(agent.stop(), 0);

    let still_held = |c: &Cluster| {
        c.taints("node-a") == tainted
            && c.record("node-a").is_some_and(|r| {
                r.health == Health::Unhealthy
                    && fault(&r, "Xid79").is_some_and(|f| f.active && f.count == 1)
            })
    };
    // 1. Same boot, the state directory lost. The replay file is emptied: a file's records are
    // dated when read, so only /dev/kmsg's can be skipped by date (the core's reader tests
    // cover that skip).
    std::fs::remove_dir_all(dir.path().join("state")).unwrap();
    std::fs::remove_dir_all(dir.path().join("data")).unwrap();
    std::fs::write(dir.path().join("kmsg"), b"").unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &extra);
    let r = agent.wait_for("the rebuilt record", |r| {
        fault(r, "Xid79").is_some() && r.agent.detectors.iter().any(|d| d.name == "kmsg")
    });
    assert!(agent
        .log()
        .contains("faults rebuilt from the cluster's record"));
    // Past the settle time (2 s): an empty start would have untainted the node by now.
    std::thread::sleep(Duration::from_secs(4));
    let r2 = agent.record().unwrap();
    for code in ["Xid79", "Xid48"] {
        let f = fault(&r2, code).unwrap_or_else(|| panic!("{code} kept: {r:?}"));
        assert_eq!((f.active, f.count), (true, 1), "{code}");
    }
    assert!(
        still_held(&c),
        "{:?} {:?}",
        c.taints("node-a"),
        c.record("node-a")
    );
    assert_eq!(agent.stop(), 0);

    // 2. A reboot: new boot id and boot time, the kernel log starts over, /run is empty.
    common::reboot(dir.path(), b"", true);
    let later = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 1;
    let stat: String = real
        .lines()
        .map(|l| {
            if l.starts_with("btime ") {
                format!("btime {later}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(&proc_stat, stat).unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &extra);
    agent.wait_for("the rebuilt record after the reboot", |r| {
        fault(r, "Xid79").is_some() && r.agent.detectors.iter().any(|d| d.name == "kmsg")
    });
    std::thread::sleep(Duration::from_secs(4));
    let r = agent.record().unwrap();
    assert!(
        fault(&r, "Xid48").is_none_or(|f| !f.active),
        "the earlier boot's kernel-log fault ended with the reboot: {r:?}"
    );
    let held = fault(&r, "Xid79").unwrap();
    assert_eq!(
        held.fault_handling,
        faultline_core::record::Handling::ManuallySeparateNPU
    );
    assert!(held.active);
    c.wait(
        "the node still tainted for the operator-held fault",
        Some(&agent),
        |c| {
            c.taints("node-a")
                .iter()
                .any(|t| t.starts_with("faultline.io/"))
                && c.record("node-a").is_some_and(|r| {
                    r.health == Health::Unhealthy && fault(&r, "Xid79").is_some_and(|f| f.active)
                })
        },
    );
    c.assert_calls_listed();
}

/// Nothing left but the taint: the state and data directories are lost and the fault ConfigMap
/// was deleted, over a reboot. The node's own `faultline.io/` taint is the last trace of the
/// operator-held Xid 79, so the agent rebuilds the fault from it and the node stays tainted past
/// the settle time (before, it started empty and untainted the node after `--settle`), until
/// an operator clears it with `faultline clear`.
#[test]
fn with_no_state_and_no_record_the_operator_held_taint_is_kept_until_cleared() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let policy = operator_held_xid79_policy(dir.path());
    let extra = ["--policy", policy.to_str().unwrap()];
    let agent = c.start_agent(dir.path(), "node-a", &extra);
    agent.append(XID79);
    c.wait("the operator-held Xid 79 tainted", Some(&agent), |c| {
        c.taints("node-a")
            .contains(&"faultline.io/unhealthy=Xid79:NoSchedule".to_string())
            && c.record("node-a")
                .is_some_and(|r| fault(&r, "Xid79").is_some())
    });
    let tainted = c.taints("node-a");
    assert_eq!(agent.stop(), 0);

    common::reboot(dir.path(), b"", true);
    assert!(c
        .emu
        .delete(&ResourceRef::config_map(NS, "faultline-node-a")));
    let agent = c.start_agent(dir.path(), "node-a", &extra);
    let r = agent.wait_for("the fault rebuilt from the taint", |r| {
        fault(r, "Xid79").is_some_and(|f| f.active)
    });
    let f = fault(&r, "Xid79").unwrap();
    assert!(
        f.message.contains("rebuilt from the node's taint") && f.device == "node",
        "{f:?}"
    );
    assert_eq!(
        f.fault_handling,
        faultline_core::record::Handling::ManuallySeparateNPU
    );
    // Past the settle time (2 s): an empty start would have untainted the node by now.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(c.taints("node-a"), tainted);
    assert!(c
        .record("node-a")
        .is_some_and(|r| r.health == Health::Unhealthy && fault(&r, "Xid79").is_some()));

    let (code, _, err) = common::cli(&["clear", "--code", "Xid79"], &agent.state());
    assert_eq!(code, Some(0), "{err}");
    c.wait("the node untainted once cleared", Some(&agent), |c| {
        !c.taints("node-a")
            .iter()
            .any(|t| t.starts_with("faultline.io/"))
    });
    c.assert_calls_listed();
}

/// A reboot with the data directory kept (`/var/lib/faultline` on a node) and `/run` emptied:
/// the operator-held fault comes back from the agent's own state, not from the cluster. Here
/// the fault ConfigMap was deleted while the node was down, so only local durable state can
/// keep the promise: the node stays tainted past the settle time and the ConfigMap comes back
/// with the fault. When state lived in /run, this start was empty and untainted the node.
#[test]
fn a_reboot_keeps_the_node_tainted_from_its_durable_state() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let policy = operator_held_xid79_policy(dir.path());
    let extra = ["--policy", policy.to_str().unwrap()];
    let agent = c.start_agent(dir.path(), "node-a", &extra);
    agent.append(XID79);
    c.wait(
        "the fault in the ConfigMap, the node tainted",
        Some(&agent),
        |c| {
            c.record("node-a")
                .is_some_and(|r| fault(&r, "Xid79").is_some())
                && c.taints("node-a")
                    .iter()
                    .any(|t| t.starts_with("faultline.io/"))
        },
    );
    let tainted = c.taints("node-a");
    assert_eq!(agent.stop(), 0);

    // The reboot: /run emptied, a new boot id, the kernel log starts over; /var/lib kept.
    // Meanwhile the fault ConfigMap is gone (deleted by hand, or a namespace recreated).
    common::reboot(dir.path(), b"", false);
    assert!(c
        .emu
        .delete(&ResourceRef::config_map(NS, "faultline-node-a")));
    let agent = c.start_agent(dir.path(), "node-a", &extra);
    agent.wait_for("the record of the new boot", |r| {
        r.agent.detectors.iter().any(|d| d.name == "kmsg")
    });
    // Past the settle time (2 s), watched all along: an empty start untaints the node by then.
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        assert_eq!(c.taints("node-a"), tainted, "the taint never leaves");
        std::thread::sleep(Duration::from_millis(100));
    }
    c.wait("the fault back in the ConfigMap", Some(&agent), |c| {
        c.record("node-a").is_some_and(|r| {
            r.health == Health::Unhealthy && fault(&r, "Xid79").is_some_and(|f| f.active)
        })
    });
    assert_eq!(c.taints("node-a"), tainted, "the taint never left");
    let log = agent.log();
    assert!(!log.contains("rebuilt from the cluster"), "{log}");
    assert_eq!(agent.stop(), 0);
    c.assert_calls_listed();
}

/// A second writer changes the node between the agent's read and write (409 on the taint
/// patch); other calls fail with 500, 429 and timeouts; the API goes away entirely. Detection
/// and the local file never wait, and the cluster converges to the latest state afterwards.
#[test]
fn api_errors_and_outages_never_stop_detection_and_converge() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &[]);
    c.wait("a healthy node", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
    });

    // Conflicts on the taint write, server errors on the condition, throttling on the ConfigMap.
    c.emu.inject(FaultRule {
        method: Some("PATCH".into()),
        path_contains: Some("/api/v1/nodes/node-a?".into()),
        action: FaultAction::Status {
            code: 409,
            retry_after_s: None,
        },
        times: Some(3),
    });
    c.emu.inject(FaultRule {
        method: Some("PATCH".into()),
        path_contains: Some("/nodes/node-a/status".into()),
        action: FaultAction::Status {
            code: 500,
            retry_after_s: None,
        },
        times: Some(2),
    });
    c.emu.inject(FaultRule {
        method: Some("PATCH".into()),
        path_contains: Some("/configmaps/faultline-node-a".into()),
        action: FaultAction::Status {
            code: 429,
            retry_after_s: Some(1),
        },
        times: Some(2),
    });
    c.emu.inject(FaultRule {
        method: Some("POST".into()),
        path_contains: Some("/events".into()),
        action: FaultAction::Reset,
        times: Some(1),
    });
    agent.append(XID79);
    c.wait("convergence through errors", Some(&agent), |c| {
        unhealthy_everywhere(c, "node-a")
    });
    let injected = c.emu.calls().iter().filter(|x| x.injected).count();
    assert_eq!(injected, 8, "every injected failure was hit");

    // The API goes away (and a request hangs before that): detection goes on.
    c.emu.clear_faults();
    c.emu.inject(FaultRule {
        method: Some("GET".into()),
        path_contains: Some("/api/v1/nodes/node-a".into()),
        action: FaultAction::Hang,
        times: Some(1),
    });
    c.rt.block_on(c.emu.down());
    let t0 = Instant::now();
    let (code, _, err) = common::cli(&["clear", "--code", "Xid79"], &agent.state());
    assert_eq!(code, Some(0), "{err}");
    agent.append(b"4,101,6000000,-;NVRM: Xid (PCI:0000:86:00): 48, pid=1, name=x, DBE (0x1,0x2)\n");
    agent.wait_for("the local record while the API is down", |r| {
        fault(r, "Xid48").is_some_and(|f| f.active) && fault(r, "Xid79").is_some_and(|f| !f.active)
    });
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "local detection did not wait for the API"
    );
    std::thread::sleep(Duration::from_secs(2));
    c.rt.block_on(c.emu.up()).unwrap();
    // Xid 48 (double-bit ECC) is RestartNPU: Degraded, no taint, condition True naming it.
    // The hung read costs the node sink one client timeout (15 s) before it retries.
    c.wait(
        "convergence to the latest state after the outage",
        Some(&agent),
        |c| {
            c.taints("node-a") == ["example.com/maintenance=planned:NoSchedule"]
                && c.record("node-a").is_some_and(|r| {
                    r.health == Health::Degraded
                        && fault(&r, "Xid48").is_some_and(|f| f.active)
                        && fault(&r, "Xid79").is_some_and(|f| !f.active)
                })
                && c.node("node-a")
                    .metadata
                    .labels
                    .unwrap_or_default()
                    .get("faultline.io/health")
                    == Some(&"Degraded".to_string())
                && c.condition_message("node-a", "AcceleratorHealthy")
                    .is_some_and(|(s, r, m)| {
                        s == "True" && r == "RestartNPU" && m.contains("Xid48")
                    })
                && c.events("node-a")
                    .iter()
                    .any(|e| e.0 == "FaultDetected" && e.1.contains("Xid48"))
                && c.events("node-a")
                    .iter()
                    .any(|e| e.0 == "FaultRecovered" && e.1.contains("Xid79"))
        },
    );
    c.assert_calls_listed();
    assert!(agent.metric("faultline_sink_errors_total{sink=\"node\"}") >= 1.0);
}

/// Many nodes fail at once: no more than the budget is newly tainted within the window, the
/// rest carry the label and condition, a TaintBudgetExceeded Event and `agent.taintBudget`, and
/// get their taint once the window moves on.
#[test]
fn taint_budget_holds_with_many_nodes() {
    const N: usize = 24;
    const WINDOW_S: i64 = 4;
    let names: Vec<String> = (0..N).map(|i| format!("node-{i:02}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    // 10 % of 24 nodes: 2 per window.
    let c = Cluster::with_policy(
        &refs,
        &format!("taint_budget: {{ max_percent: 10, min_nodes: 1, window: {WINDOW_S}s }}\n"),
    );
    let policy = c.policy.clone();
    let dirs: Vec<_> = (0..N).map(|_| tempfile::tempdir().unwrap()).collect();
    let agents: Vec<Agent> = names
        .iter()
        .zip(&dirs)
        .map(|(n, d)| {
            c.start_agent(
                d.path(),
                n,
                &[
                    "--policy",
                    policy.to_str().unwrap(),
                    "--budget-recheck",
                    "500ms",
                ],
            )
        })
        .collect();
    c.wait("every agent's ConfigMap", None, |c| {
        names.iter().all(|n| c.record(n).is_some())
    });
    for a in &agents {
        a.append(XID79);
    }
    let tainted = |c: &Cluster| -> usize {
        names
            .iter()
            .filter(|n| {
                c.taints(n)
                    .iter()
                    .any(|t| t.starts_with("faultline.io/unhealthy="))
            })
            .count()
    };
    c.wait(
        "every node to be labelled, and the rest of the budget to be withheld",
        None,
        |c| {
            names.iter().all(|n| {
                c.record(n).is_some_and(|r| r.health == Health::Unhealthy)
                    && c.condition(n, "AcceleratorHealthy").map(|x| x.0) == Some("False".into())
            }) && names
                .iter()
                .filter(|n| c.record(n).is_some_and(|r| r.agent.taint_budget.is_some()))
                .count()
                >= N - 2 - 2 // the window may already have moved on once
        },
    );
    let withheld: Vec<NodeRecord> = names
        .iter()
        .filter_map(|n| c.record(n))
        .filter(|r| r.agent.taint_budget.is_some())
        .collect();
    let tb = withheld[0].agent.taint_budget.clone().unwrap();
    assert_eq!((tb.limit, tb.nodes), (2, N as u32), "{tb:?}");
    assert_eq!(tb.withheld, ["faultline.io/unhealthy=Xid79:NoSchedule"]);
    // The record and the Event are written by two sinks, in no fixed order.
    c.wait("the withheld node's Event", None, |c| {
        c.events(&withheld[0].node)
            .iter()
            .any(|e| e.0 == "TaintBudgetExceeded")
    });

    // Reopens by itself: more nodes get tainted as windows pass.
    c.wait("more nodes tainted after the window", None, |c| {
        tainted(c) >= 6
    });

    // Never more than the budget within any window: check the taints' timeAdded.
    let mut added: Vec<i64> = names
        .iter()
        .filter_map(|n| {
            c.node(n)
                .spec
                .and_then(|s| s.taints)
                .unwrap_or_default()
                .into_iter()
                .find_map(|t| {
                    (t.key == "faultline.io/unhealthy")
                        .then(|| t.time_added.unwrap().0.as_millisecond())
                })
        })
        .collect();
    added.sort();
    for (i, t) in added.iter().enumerate() {
        let in_window = added[i..]
            .iter()
            .filter(|u| **u < t + WINDOW_S * 1000)
            .count();
        assert!(
            in_window <= 2,
            "{in_window} nodes newly tainted within {WINDOW_S}s: {added:?}"
        );
    }
    c.assert_calls_listed();
    drop(agents);
}

/// The taint budget is the coordinator's alone: a new taint is admitted by it (it writes the
/// ledger, under its own service account), the agent makes no call about the ledger, and an
/// agent's credentials cannot write the ledger at all (the RBAC of the call table refuses it).
/// Issue 28: every agent kept the budget by compare-and-swap on one ConfigMap, 50 requests per
/// failing node with every node failing at once.
#[test]
fn the_coordinator_alone_keeps_the_taint_budget() {
    let c = Cluster::new(&["node-a", "node-b"]);
    let dir = tempfile::tempdir().unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &[]);
    c.wait("a healthy node", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
    });
    c.emu.clear_calls();
    agent.append(XID79);
    c.wait("node-a tainted", Some(&agent), |c| {
        unhealthy_everywhere(c, "node-a")
    });
    let ledger = c
        .emu
        .get(&ResourceRef::config_map(NS, "faultline-taint-budget"))
        .expect("the ledger");
    let entries: Value =
        serde_json::from_str(ledger["data"]["ledger.json"].as_str().unwrap()).unwrap();
    assert_eq!(entries["entries"][0]["node"], "node-a", "{entries}");
    let calls = c.emu.calls();
    let about_ledger: Vec<&Call> = calls
        .iter()
        .filter(|x| x.path.contains("faultline-taint-budget"))
        .collect();
    assert!(
        about_ledger
            .iter()
            .all(|x| x.token.as_deref() == Some(COORDINATOR_TOKEN)),
        "only the coordinator touches the ledger: {about_ledger:#?}"
    );
    // Created by a POST to the collection (the name is in the body), by the coordinator.
    assert!(
        calls.iter().any(|x| x.method == "POST"
            && x.path == format!("/api/v1/namespaces/{NS}/configmaps")
            && x.token.as_deref() == Some(COORDINATOR_TOKEN)
            && x.status == 201),
        "{calls:#?}"
    );
    c.assert_calls_listed();
    // An agent's own credential, used by hand: the ledger cannot be written.
    let forged = c.rt.block_on(async {
        let kc = kube::config::Kubeconfig::read_from(&c.kubeconfig).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        let client = kube::Client::try_from(config).unwrap();
        let cms: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
            kube::Api::namespaced(client, NS);
        let body = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "faultline-taint-budget", "namespace": NS},
            "data": {"ledger.json": "{\"entries\":[]}"},
        }))
        .unwrap();
        let replaced = cms
            .replace("faultline-taint-budget", &Default::default(), &body)
            .await;
        replaced
    });
    // (A patch, which RBAC allows on every ConfigMap of the namespace, is refused by the
    // admission policy, whose CEL tests/manifests/tests/admission.rs runs.)
    assert!(
        matches!(&forged, Err(kube::Error::Api(s)) if s.code == 403),
        "{forged:?}"
    );
    drop(agent);
}

/// No coordinator answers (it is gone: its address refuses connections): the fault is recorded
/// and the node labelled with its condition at once; the taint waits, asked for again with the
/// sink's backoff, and the log says why (docs/operations.md, "When the taint budget cannot
/// answer").
#[test]
fn without_a_coordinator_the_node_is_labelled_and_the_taint_waits() {
    let mut c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &["--budget-recheck", "500ms"]);
    c.wait("a healthy node", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
    });
    c.kill_coordinator();
    agent.append(XID79);
    c.wait(
        "the label, the condition and the record",
        Some(&agent),
        |c| {
            c.node("node-a")
                .metadata
                .labels
                .unwrap_or_default()
                .get("faultline.io/health")
                .is_some_and(|v| v == "Unhealthy")
                && c.condition_names("node-a", "Xid79")
                && c.record("node-a")
                    .is_some_and(|r| r.health == Health::Unhealthy && fault(&r, "Xid79").is_some())
        },
    );
    c.wait("the budget asked again", Some(&agent), |_| {
        agent
            .log()
            .matches("the taint budget cannot answer")
            .count()
            >= 2
    });
    assert!(
        !c.taints("node-a")
            .iter()
            .any(|t| t.starts_with("faultline.io/")),
        "no taint without the coordinator's answer: {:?}",
        c.taints("node-a")
    );
    assert_eq!(c.record("node-a").unwrap().agent.taint_budget, None);
    c.assert_calls_listed();
    drop(agent);
}

/// The taint budget cannot answer (the coordinator's read of its ledger hangs past the
/// admission's deadline, then the API server fails it with 500): the fault is recorded and the
/// node gets its label and condition at once, with no taint; the taint is asked for again
/// through the sink's backoff and arrives once the ledger answers (docs/operations.md, "When
/// the taint budget cannot answer"). The label and condition used to be written only after an
/// admission, so they waited as long as the ledger did.
#[test]
fn label_and_condition_do_not_wait_for_a_budget_that_cannot_answer() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &[]);
    c.wait("a healthy node", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
    });
    let ledger = "/configmaps/faultline-taint-budget";
    c.emu.inject(FaultRule::hang().on_path(ledger).times(1));
    // 500, not 503: the client retries 429, 503 and 504 by itself (for minutes), within one
    // pass of the sink.
    c.emu.inject(FaultRule::status(500).on_path(ledger));
    agent.append(XID79);
    c.wait(
        "the label, the condition and the record",
        Some(&agent),
        |c| {
            c.node("node-a")
                .metadata
                .labels
                .unwrap_or_default()
                .get("faultline.io/health")
                .is_some_and(|v| v == "Unhealthy")
                && c.condition_names("node-a", "Xid79")
                && c.record("node-a")
                    .is_some_and(|r| r.health == Health::Unhealthy && fault(&r, "Xid79").is_some())
        },
    );
    let refused = |c: &Cluster| {
        c.emu
            .calls()
            .iter()
            .filter(|x| x.injected && x.status == 500 && x.path.ends_with(ledger))
            .count()
    };
    // The hung read times out and the sink asks again (and is refused) twice.
    c.wait("the budget asked again after the hang", Some(&agent), |c| {
        refused(c) >= 2
    });
    assert!(
        !c.taints("node-a")
            .iter()
            .any(|t| t.starts_with("faultline.io/")),
        "no taint without the budget's answer: {:?}",
        c.taints("node-a")
    );
    assert_eq!(
        c.record("node-a").unwrap().agent.taint_budget,
        None,
        "nothing was denied: the record does not claim the budget is spent"
    );
    c.emu.clear_faults();
    c.wait("the taint once the budget answers", Some(&agent), |c| {
        unhealthy_everywhere(c, "node-a")
    });
    assert!(agent.metric("faultline_sink_errors_total{sink=\"node\"}") >= 2.0);
    c.assert_calls_listed();
    drop(agent);
}

/// A reboot while the budget withholds the taint of an operator-held fault: the withheld list
/// is saved with the durable state, so the rebooted agent (empty /run, new boot id, empty kernel
/// log) neither taints the node nor announces the withheld taint again, and `since` stays.
/// (It came back only from the record in /run, which a reboot empties.)
#[test]
fn a_reboot_while_a_taint_is_withheld_announces_nothing_again() {
    let c = Cluster::with_policy(
        &["node-0", "node-1", "node-2"],
        "taint_budget: { max_percent: 10, min_nodes: 1, window: 1h }\n\
         overrides:\n  Xid79: { handling: ManuallySeparateNPU }\n",
    );
    let policy = c.policy.clone();
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let args = [
        "--policy",
        policy.to_str().unwrap(),
        "--budget-recheck",
        "500ms",
    ];
    let a0 = c.start_agent(dirs[0].path(), "node-0", &args);
    let a1 = c.start_agent(dirs[1].path(), "node-1", &args);
    c.wait("both ConfigMaps", None, |c| {
        c.record("node-0").is_some() && c.record("node-1").is_some()
    });
    a0.append(XID79);
    c.wait("node-0 tainted", Some(&a0), |c| {
        c.taints("node-0")
            .contains(&"faultline.io/unhealthy=Xid79:NoSchedule".to_string())
    });
    a1.append(XID79);
    c.wait("node-1's taint withheld", Some(&a1), |c| {
        c.record("node-1")
            .is_some_and(|r| r.health == Health::Unhealthy && r.agent.taint_budget.is_some())
            && c.events("node-1")
                .iter()
                .any(|e| e.0 == "TaintBudgetExceeded")
    });
    let before = c.record("node-1").unwrap().agent.taint_budget.unwrap();
    let events_before = c.events("node-1");
    assert_eq!(a1.stop(), 0);

    let dir = dirs[1].path();
    common::reboot(dir, b"", false);
    let a1 = c.start_agent(dir, "node-1", &args);
    a1.wait_for("the record of the new boot", |r| {
        r.agent.detectors.iter().any(|d| d.name == "kmsg")
    });
    // The settle time (2 s) and several budget rechecks (500 ms) pass.
    std::thread::sleep(Duration::from_secs(4));
    let local = a1.record().unwrap();
    assert!(fault(&local, "Xid79").is_some_and(|f| f.active));
    assert_eq!(
        local.agent.taint_budget,
        Some(before.clone()),
        "since stays"
    );
    assert_eq!(c.events("node-1"), events_before, "no second Event");
    assert!(c
        .taints("node-1")
        .iter()
        .all(|t| !t.starts_with("faultline.io/")));
    assert_eq!(c.record("node-1").unwrap().agent.taint_budget, Some(before));
    c.assert_calls_listed();
    drop((a0, a1));
}

/// A restart while the budget withholds a taint writes nothing: the withheld list comes back
/// from the last record, so the ConfigMap is not rewritten, no second `TaintBudgetExceeded`
/// Event is emitted and `agent.taintBudget.since` stays. (The withheld list used to live only
/// in memory: a restart wrote the ConfigMap twice, emitted the Event again and reset `since`.)
#[test]
fn a_restart_while_a_taint_is_withheld_writes_nothing() {
    // 3 nodes: one newly tainted node per hour.
    let c = Cluster::with_policy(
        &["node-0", "node-1", "node-2"],
        "taint_budget: { max_percent: 10, min_nodes: 1, window: 1h }\n",
    );
    let policy = c.policy.clone();
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let args = [
        "--policy",
        policy.to_str().unwrap(),
        "--budget-recheck",
        "500ms",
    ];
    let mut agents: Vec<Option<Agent>> = (0..3)
        .map(|i| Some(c.start_agent(dirs[i].path(), &format!("node-{i}"), &args)))
        .collect();
    c.wait("every agent's ConfigMap", None, |c| {
        (0..3).all(|i| c.record(&format!("node-{i}")).is_some())
    });
    fn agent(a: &Option<Agent>) -> &Agent {
        a.as_ref().unwrap()
    }
    agent(&agents[0]).append(XID79);
    c.wait("node-0 tainted", Some(agent(&agents[0])), |c| {
        unhealthy_everywhere(c, "node-0")
    });
    agent(&agents[1]).append(XID79);
    c.wait("node-1's taint withheld", Some(agent(&agents[1])), |c| {
        c.record("node-1")
            .is_some_and(|r| r.health == Health::Unhealthy && r.agent.taint_budget.is_some())
            && c.events("node-1")
                .iter()
                .any(|e| e.0 == "TaintBudgetExceeded")
    });
    let before = c.record("node-1").unwrap().agent.taint_budget.unwrap();
    assert_eq!(before.withheld, ["faultline.io/unhealthy=Xid79:NoSchedule"]);
    assert!(c
        .taints("node-1")
        .iter()
        .all(|t| !t.starts_with("faultline.io/")));
    let events_before = c.events("node-1");

    let denied_before = c.denials_of("node-1");
    assert_eq!(agents[1].take().unwrap().stop(), 0);
    std::thread::sleep(Duration::from_millis(300));
    c.emu.clear_calls();
    agents[1] = Some(c.start_agent(dirs[1].path(), "node-1", &args));
    agent(&agents[1]).addr();
    // The settle time (2 s) and several budget rechecks (500 ms) pass.
    std::thread::sleep(Duration::from_secs(4));
    let ua = format!("faultline-agent/{} (node-1)", env!("CARGO_PKG_VERSION"));
    let writes: Vec<Call> = c
        .writes()
        .into_iter()
        .filter(|x| x.user_agent.as_deref() == Some(ua.as_str()))
        .collect();
    assert_eq!(writes, Vec::<Call>::new(), "the restart wrote");
    assert!(
        c.denials_of("node-1") > denied_before,
        "the restarted agent asked the budget again"
    );
    assert_eq!(c.events("node-1"), events_before, "no second Event");
    let after = c.record("node-1").unwrap().agent.taint_budget.unwrap();
    assert_eq!(after, before, "since and the counts stay");
    let local = agent(&agents[1]).record().unwrap();
    assert_eq!(local.agent.taint_budget, Some(before));
    c.assert_calls_listed();
}

/// While the API server refuses the fault ConfigMap, a storm of a repeating fault waits for the
/// retry backoff: what the failed attempt already carried (the new fault) plus counts is not
/// "new content", so it is not sent with every snapshot. When the API answers again, the final
/// count arrives. (Compared only with the last successful write, every snapshot of the storm
/// looked like content and was applied at once: about ten a second per node.)
#[test]
fn a_storm_against_a_failing_api_waits_for_the_retry_backoff() {
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let agent = c.start_agent(dir.path(), "node-a", &[]);
    c.wait("a healthy node", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
    });
    let rule = c.emu.inject(FaultRule {
        method: Some("PATCH".into()),
        path_contains: Some("/configmaps/faultline-node-a".into()),
        action: FaultAction::Status {
            code: 500,
            retry_after_s: None,
        },
        times: None,
    });
    let started = Instant::now();
    let mut seq = 100u64;
    while started.elapsed() < Duration::from_secs(4) {
        agent.append(
            format!(
                "4,{seq},{},-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception\n",
                seq * 1000
            )
            .as_bytes(),
        );
        seq += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let attempts = c
        .emu
        .calls()
        .iter()
        .filter(|x| x.injected && x.path.contains("/configmaps/faultline-node-a"))
        .count();
    // A backoff from 200 ms doubling (with jitter) over 4 s: a handful of attempts, not ~40.
    assert!(
        (1..=8).contains(&attempts),
        "{attempts} applies of the ConfigMap in 4 s against a failing API"
    );
    assert!(c.emu.remove_fault(rule));
    let lines = seq - 100;
    c.wait("the final count in the ConfigMap", Some(&agent), |c| {
        c.record("node-a")
            .is_some_and(|r| fault(&r, "Xid13").is_some_and(|f| f.count == lines))
    });
    c.assert_calls_listed();
}

/// Issue 13 §5: a fault repeating for seconds writes the fault ConfigMap once per
/// `--kube-write-interval`, not once per repeat (each write is the whole record, up to 1 MiB);
/// an escalation in the middle of it is written at once, and the last write carries the final
/// count. (Every repeat was one server-side apply before: about 240 here.)
#[test]
fn a_repeating_xid_writes_the_configmap_once_per_interval_and_an_escalation_at_once() {
    // The escalation (5 s into the storm) falls between two writes of counts (4 s, 8 s).
    const INTERVAL_S: u64 = 4;
    const STORM: Duration = Duration::from_secs(12);
    let c = Cluster::new(&["node-a"]);
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "escalation:\n  - name: lasting\n    codes: [Xid13]\n    duration: 5s\n    handling: SeparateNPU\n",
    )
    .unwrap();
    let interval = format!("{INTERVAL_S}s");
    let agent = c.start_agent(
        dir.path(),
        "node-a",
        &[
            "--kube-write-interval",
            &interval,
            "--policy",
            policy.to_str().unwrap(),
        ],
    );
    c.wait("a healthy node", Some(&agent), |c| {
        healthy_everywhere(c, "node-a")
    });
    std::thread::sleep(Duration::from_millis(500));
    c.emu.clear_calls();

    let xid13 = |r: &NodeRecord| fault(r, "Xid13").cloned();
    let escalated = |r: &NodeRecord| xid13(r).is_some_and(|f| f.escalated_from.is_some());
    // Xid 13 twenty times a second; when the escalation shows in the local record and in the
    // ConfigMap (polled between lines).
    let started = Instant::now();
    let (mut local_at, mut cluster_at) = (None, None);
    let mut lines = 0u64;
    while started.elapsed() < STORM {
        let seq = 100 + lines;
        agent.append(
            format!(
                "4,{seq},{},-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception\n",
                seq * 1000
            )
            .as_bytes(),
        );
        lines += 1;
        if local_at.is_none() && agent.record().is_some_and(|r| escalated(&r)) {
            local_at = Some(started.elapsed());
        }
        if cluster_at.is_none() && c.record("node-a").is_some_and(|r| escalated(&r)) {
            cluster_at = Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let storm_ended = Instant::now();
    agent.wait_for("the final count in the local record", |r| {
        xid13(r).is_some_and(|f| f.count == lines)
    });
    c.wait("the final count in the ConfigMap", Some(&agent), |c| {
        c.record("node-a")
            .and_then(|r| xid13(&r))
            .is_some_and(|f| f.count == lines)
    });
    let final_after = storm_ended.elapsed();
    // Nothing after the final count.
    std::thread::sleep(Duration::from_secs(INTERVAL_S + 1));
    let applies: Vec<Call> = c
        .writes()
        .into_iter()
        .filter(|x| x.path.ends_with("/configmaps/faultline-node-a"))
        .collect();
    let (local_at, cluster_at) = (local_at.unwrap(), cluster_at.unwrap());
    let first = applies.first().map(|x| x.at);
    let at: Vec<String> = applies
        .iter()
        .map(|x| {
            let d = first.and_then(|f| x.at.duration_since(f).ok());
            format!("{:.2}", d.unwrap_or_default().as_secs_f64())
        })
        .collect();
    eprintln!(
        "{lines} repeats in {STORM:?}: {} ConfigMap writes at {at:?} s; escalation local {local_at:?}, ConfigMap {cluster_at:?}; final count {final_after:?} after the storm",
        applies.len()
    );
    // The new fault (1), the escalation (1), counts once per interval over the storm
    // (ceil(12 / 4) = 3) and the trailing write with the final count (1).
    let budget = 1 + 1 + STORM.as_secs().div_ceil(INTERVAL_S) + 1;
    assert!(
        applies.len() as u64 <= budget,
        "{} ConfigMap writes for {lines} repeats, budget {budget}: {applies:#?}",
        applies.len()
    );
    assert!(
        applies.len() >= 3,
        "counts went out during the storm: {applies:#?}"
    );
    // The escalation did not wait for the interval (3 s more): in the ConfigMap within a
    // second of the local record (which has a write budget of its own, 200 ms).
    assert!(
        cluster_at <= local_at + Duration::from_secs(1),
        "escalation: local {local_at:?}, ConfigMap {cluster_at:?}"
    );
    // The final count within an interval (and a margin) of the last repeat.
    assert!(
        final_after <= Duration::from_secs(INTERVAL_S) + Duration::from_secs(2),
        "final count after {final_after:?}"
    );
    assert_eq!(
        c.record("node-a").unwrap().health,
        Health::Unhealthy,
        "SeparateNPU"
    );
    c.assert_calls_listed();
}

/// `faultline check` through the Lease says within its grace (two Lease terms, 30 s) that no
/// check can run when nothing shows a coordinator: the Lease's holder stopped renewing it, or
/// nothing takes connections at its address (exit 2, the reason in one line). A coordinator
/// that takes the connection but does not answer (frozen, busy) is asked again until
/// --timeout, and so is one whose Lease a replica takes 24 s into the wait: later than one term
/// and the clock slack (20 s, the grace before, which cut such a hand-over off with exit 2),
/// within the slowest hand-over between running replicas. The first two run with --timeout 5m,
/// the frozen one with 30s and the hand-over with 40s (the timeout is their expected end), all
/// under a 90 s guard against a hang.
#[test]
fn check_says_within_the_grace_that_no_check_can_run() {
    use faultline_kube_emulator::Rule;
    let (_rt, emu) = common::emulator();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig, "checker").unwrap();
    emu.authorize(
        "checker",
        UserInfo {
            username: "system:serviceaccount:jobs:checker".into(),
            groups: vec![],
            extra: Default::default(),
        },
        vec![Rule {
            verbs: vec!["get".into()],
            api_groups: vec!["coordination.k8s.io".into()],
            resources: vec!["leases".into()],
            resource_names: vec!["faultline-peercheck".into()],
            namespace: None,
        }],
    );
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    let key = faultline_proto::auth::CoordinatorKey::generate()
        .unwrap()
        .public_key();
    let micro =
        |t: faultline_core::time::Timestamp| t.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string();
    let now = faultline_core::time::Timestamp::now();
    let lease = |ns: &str, holder: Option<String>, renewed: faultline_core::time::Timestamp| {
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "faultline-peercheck", "namespace": ns},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                     "renewTime": micro(renewed), "acquireTime": micro(renewed)}})
    };
    // A coordinator's port that takes connections (the kernel's backlog) and never answers.
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let frozen_at = frozen.local_addr().unwrap();
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let holder = |addr: std::net::SocketAddr| Some(format!("coord-0@{addr}#{key}"));
    let hour = faultline_core::time::SignedDuration::from_hours(1);
    for ns in ["expired", "refused", "frozen", "handover"] {
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}));
    }
    emu.put(lease(
        "expired",
        holder(frozen_at),
        now - faultline_core::time::SignedDuration::from_secs(60),
    ));
    emu.put(lease("refused", holder(closed), now + hour));
    emu.put(lease("frozen", holder(frozen_at), now + hour));
    emu.put(lease("handover", None, now));
    let check = |ns: &str, timeout: &str| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"));
        c.args(["check", "--nodes", "gpu-a,gpu-b", "--namespace", ns])
            .args(["--timeout", timeout])
            .args(["--kubeconfig", kubeconfig.to_str().unwrap()])
            .args(["--secret-file", secret.to_str().unwrap()]);
        let (code, _, err) = common::run_guarded(&mut c, Duration::from_secs(90));
        (code, err)
    };
    std::thread::scope(|s| {
        let expired = s.spawn(|| check("expired", "5m"));
        let refused = s.spawn(|| check("refused", "5m"));
        let frozen = s.spawn(|| check("frozen", "30s"));
        let handover = s.spawn(|| check("handover", "40s"));
        // 24 s into the hand-over, a replica takes the Lease.
        std::thread::sleep(Duration::from_secs(24));
        emu.put(lease(
            "handover",
            holder(frozen_at),
            faultline_core::time::Timestamp::now() + hour,
        ));

        let (code, err) = expired.join().unwrap();
        assert_eq!(code, Some(2), "{err}");
        assert!(
            err.starts_with(
                "error: no peer check can run: the coordinator Lease's holder coord-0 stopped renewing it, last at "
            ) && err.trim_end().ends_with("and no coordinator came within 30s")
                && err.lines().count() == 1,
            "{err}"
        );
        let (code, err) = refused.join().unwrap();
        assert_eq!(code, Some(2), "{err}");
        assert!(
            err.starts_with(&format!(
                "error: no peer check can run: cannot reach the coordinator at {closed} ("
            )) && err.contains("efused")
                && err
                    .trim_end()
                    .ends_with("and no coordinator came within 30s"),
            "{err}"
        );
        for (case, answer, timeout) in [("frozen", frozen, "30s"), ("handover", handover, "40s")] {
            let (code, err) = answer.join().unwrap();
            assert_eq!(code, Some(2), "{case}: {err}");
            assert!(
                err.starts_with(&format!(
                    "error: no result within {timeout}: the coordinator at {frozen_at}: "
                )),
                "{case}: asked until --timeout: {err}"
            );
        }
    });
    drop(frozen);
}
