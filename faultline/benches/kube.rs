//! Kubernetes-mode benchmarks against the API emulator (release build of the agent):
//!
//! - `latency`: an Xid line to the taint and the ConfigMap visible in the API server;
//! - `writes`: API writes per fault, and at steady state (nothing changing);
//! - `storm`: one Xid repeating for a minute: API writes against the write budget, and the
//!   final count in the last ConfigMap write;
//! - `fleet`: many agents against one API server, all failing at once, under the taint budget.
//! - `fleet-tasks`: 1,000-2,000 agents as tasks of one or more processes (`--agent-processes`:
//!   one process holds 2,000 agents under its 20,000 open files only while few of them ask the
//!   coordinator) against an API server (the emulator in a process of its own, as a real one
//!   is) with a real server's write latency; a share of them failing at once.
//!
//! Every part runs one real coordinator (`faultline-coordinator`, a process of its own, as its
//! Deployment's replica is): it holds the Lease `faultline-peercheck` and keeps the taint
//! budget, which each agent asks (`Admit`, with its pod-bound token) before it newly taints
//! its Node. The emulator holds one agent Pod per node (the budget's node count), reviews each
//! agent's token as its node's, and authorizes the agents and the coordinator for exactly
//! their call tables (`sink::kube::calls`).
//!
//! `cargo bench -p faultline --bench kube -- [latency] [writes] [storm] [fleet]
//!  [fleet-tasks] [--events N] [--steady-secs S] [--storm-secs S] [--storm-every-ms M]
//!  [--storm-interval-ms I] [--agents N] [--fail-percent P] [--latency-min-ms A]
//!  [--latency-max-ms B] [--agent-processes K]`; docs/benchmarks.md has the figures.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{quantile, terminate as sigterm};
use faultline_agent::sink::kube::calls::{ApiCall, Scope, API_CALLS, COORDINATOR_API_CALLS};
use faultline_kube_emulator::{Call, Emulator, ResourceRef, Rule, UserInfo};
use serde_json::{json, Value};

const NS: &str = "faultline-system";
/// The agents' API token (their service account's), authorized for `API_CALLS`.
const AGENT_TOKEN: &str = "bench";
/// The coordinator's API token, authorized for `COORDINATOR_API_CALLS`.
const COORDINATOR_TOKEN: &str = "bench-coordinator";
/// The bench's own reads (`fleet-tasks`): `system:masters`, and not counted as the fleet's.
const ADMIN_TOKEN: &str = "bench-admin";
/// The coordinator replica's name (the Lease's holder).
const COORDINATOR: &str = "faultline-coordinator-bench";
/// The coordinator's policy: no scheduled peer checks, so nothing but `Admit` runs; the taint
/// budget at its default (10 % of the nodes in 10 minutes).
const COORDINATOR_POLICY: &str = "peer:\n  enabled: false\n";

/// Node `name`'s agent's pod-bound token (audience `faultline-peer`), as the kubelet projects it.
fn peer_token(name: &str) -> String {
    format!("peer-token-of-{name}")
}

/// The RBAC rules a call table implies, the agents' namespace being `NS` (as the tests'
/// `tests/common/mod.rs` `rules_for` derives them).
fn rules_for(table: &[ApiCall]) -> Vec<Rule> {
    table
        .iter()
        .map(|c| Rule {
            verbs: vec![c.verb.to_string()],
            api_groups: vec![c.group.to_string()],
            resources: vec![c.resource.to_string()],
            resource_names: c.names.iter().map(|n| n.to_string()).collect(),
            namespace: match c.scope {
                Scope::Cluster => None,
                Scope::AgentNamespace => Some(NS.to_string()),
                Scope::Namespace(ns) => Some(ns.to_string()),
            },
        })
        .collect()
}

struct Cluster {
    /// Runs the emulator; dropped last.
    _rt: tokio::runtime::Runtime,
    emu: Emulator,
    kubeconfig: PathBuf,
    coordinator: Child,
    /// The coordinator's metrics port.
    metrics: u16,
    dir: tempfile::TempDir,
}

/// The runtime the benches run servers and agents on: two workers, as the machine has.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// An emulator on `rt` holding the agents' namespace, one Node and one running agent Pod per
/// name, each node's agent token (reviewed as that node's, audience `faultline-peer`, as the
/// netns tests' `tests/common/cluster.rs` does), the agents' and the coordinator's API tokens
/// with exactly their call tables, and the bench's own.
fn emulator(rt: &tokio::runtime::Runtime, nodes: impl IntoIterator<Item = String>) -> Emulator {
    use faultline_coordinator::tokens::{AGENT_AUDIENCE, NODE_NAME_EXTRA};
    let emu = rt.block_on(Emulator::start()).unwrap();
    emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}));
    for n in nodes {
        emu.put(faultline_kube_emulator::node(
            &n,
            &[("kubernetes.io/hostname", &n)],
        ));
        emu.put(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("faultline-{n}"), "namespace": NS,
                          "labels": {"app.kubernetes.io/name": "faultline",
                                     "app.kubernetes.io/component": "agent"}},
            "spec": {"nodeName": n, "containers": [{"name": "agent", "image": "faultline"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }));
        emu.authorize_for_audiences(
            &peer_token(&n),
            UserInfo {
                extra: [(NODE_NAME_EXTRA.to_string(), vec![n.clone()])].into(),
                ..UserInfo::service_account(NS, "faultline")
            },
            vec![],
            &[AGENT_AUDIENCE],
        );
    }
    emu.authorize(
        AGENT_TOKEN,
        UserInfo::service_account(NS, "faultline"),
        rules_for(API_CALLS),
    );
    emu.authorize(
        COORDINATOR_TOKEN,
        UserInfo::service_account(NS, "faultline-coordinator"),
        rules_for(COORDINATOR_API_CALLS),
    );
    emu.authorize(
        ADMIN_TOKEN,
        UserInfo::new("bench").with_groups(&["system:masters"]),
        vec![],
    );
    emu
}

/// The agents', the coordinator's and the bench's kubeconfigs in `dir`.
fn kubeconfigs(dir: &Path) -> [PathBuf; 3] {
    ["kubeconfig", "coordinator-kubeconfig", "admin-kubeconfig"].map(|f| dir.join(f))
}

fn write_kubeconfigs(emu: &Emulator, dir: &Path) {
    let [agents, coordinator, admin] = kubeconfigs(dir);
    emu.write_kubeconfig(&agents, AGENT_TOKEN).unwrap();
    emu.write_kubeconfig(&coordinator, COORDINATOR_TOKEN)
        .unwrap();
    emu.write_kubeconfig(&admin, ADMIN_TOKEN).unwrap();
}

/// The file in the bench's directory that holds the coordinator's gRPC address.
const COORDINATOR_ADDRESS: &str = "coordinator-address";

/// Where the agents ask the taint budget (the coordinator's gRPC address).
fn coordinator_address(dir: &Path) -> String {
    std::fs::read_to_string(dir.join(COORDINATOR_ADDRESS)).unwrap()
}

/// The real coordinator (`faultline-coordinator`, built with this bench) against the API server
/// of `kubeconfig`, logging to `dir/coordinator.log` (the budget's answers among it), its
/// metrics on the returned port.
fn start_coordinator(dir: &Path, kubeconfig: &Path) -> (Child, u16) {
    let policy = dir.join("coordinator-policy.yaml");
    std::fs::write(&policy, COORDINATOR_POLICY).unwrap();
    // Free ports for its metrics and its gRPC service (a race with another process for them is
    // unlikely). The agents ask the budget at the gRPC address, as at its Service on a cluster.
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let port = free_port();
    let peer = format!("127.0.0.1:{}", free_port());
    std::fs::write(dir.join(COORDINATOR_ADDRESS), &peer).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_faultline-coordinator"))
        .args(["--name", COORDINATOR, "--namespace", NS])
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--policy")
        .arg(&policy)
        .args(["--peer-listen", &peer, "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        // Every agent here connects from 127.0.0.1; on a cluster each has its own pod address.
        .args(["--max-connections-per-address", "8192"])
        .env(
            "RUST_LOG",
            "warn,faultline_coordinator=info,faultline_coordinator::service=debug",
        )
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::File::create(dir.join("coordinator.log")).unwrap(),
        ))
        .spawn()
        .unwrap();
    (child, port)
}

/// The sum of a counter's series on the coordinator's `/metrics` (HTTP/1.0 by hand).
fn coordinator_counter(port: u16, name: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    Some(
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum(),
    )
}

/// What the coordinator warned about (the lines of its log at WARN and ERROR: each message
/// without its fields, counted, with the first in full).
fn coordinator_warnings(dir: &Path) -> Vec<String> {
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap_or_default();
    let mut warns: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for l in log
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
    {
        let msg = l.split_once(": ").map_or(l, |(_, m)| m);
        let words: Vec<&str> = msg
            .split_whitespace()
            .take_while(|w| !w.contains('='))
            .collect();
        warns.entry(words.join(" ")).or_insert((0, l.to_string())).0 += 1;
    }
    warns
        .into_iter()
        .map(|(w, (n, first))| format!("{n} x {w} (the first: {first})"))
        .collect()
}

/// The coordinator's connections refused over its caps, and its warnings.
fn coordinator_report(part: &str, dir: &Path, port: u16) {
    println!(
        "{part}: the coordinator refused {:?} connections over its caps (faultline_connections_refused_total)",
        coordinator_counter(port, "faultline_connections_refused_total")
    );
    for w in coordinator_warnings(dir) {
        println!("{part}: coordinator warnings: {w}");
    }
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap_or_default();
    let n = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    println!(
        "{part}: the coordinator took the Lease {} times and lost it {} times",
        n("coordinating peer checks"),
        n("no longer coordinating")
    );
}

/// The budget's answers in the coordinator's log: (admitted, denied).
fn admits(dir: &Path) -> (usize, usize) {
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap_or_default();
    let n = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    (n("taint budget: admitted"), n("taint budget: denied"))
}

/// The Lease holder in a Lease object, if any.
fn holder(lease: &Value) -> Option<String> {
    let h = lease["spec"]["holderIdentity"].as_str()?;
    (!h.is_empty()).then(|| h.to_string())
}

/// `METHOD resource[/subresource]` of an API request (`LIST` and `WATCH` for collection reads),
/// with the ledger's and faultline-peercheck's ConfigMaps named.
fn kind_of(c: &Call) -> String {
    let segs: Vec<&str> = c.path.split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segs.as_slice() {
        ["api", _, rest @ ..] => rest,
        ["apis", _, _, rest @ ..] => rest,
        _ => return format!("{} {}", c.method, c.path),
    };
    let rest = match rest {
        ["namespaces", _, r, more @ ..] => {
            let mut v = vec![*r];
            v.extend(more);
            v
        }
        r => r.to_vec(),
    };
    let mut resource = rest.first().copied().unwrap_or("").to_string();
    if let Some(sub) = rest.get(2) {
        resource = format!("{resource}/{sub}");
    }
    if let Some(name @ ("faultline-taint-budget" | "faultline-peercheck")) = rest.get(1).copied() {
        resource = format!("{resource} {name}");
    }
    let verb = match (c.method.as_str(), rest.len()) {
        ("GET", 1) if c.is_watch() => "WATCH",
        ("GET", 1) => "LIST",
        (m, _)
            if m == "PATCH"
                && c.content_type
                    .as_deref()
                    .is_some_and(|t| t.contains("apply-patch")) =>
        {
            "APPLY"
        }
        (m, _) => m,
    };
    format!("{verb} {resource}")
}

/// Requests counted by `kind_of`.
fn by_kind<'a>(calls: impl IntoIterator<Item = &'a Call>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for c in calls {
        *out.entry(kind_of(c)).or_default() += 1;
    }
    out
}

fn token_is(c: &Call, token: &str) -> bool {
    c.token.as_deref() == Some(token)
}

impl Cluster {
    /// The emulator with `nodes`, and the coordinator holding the Lease.
    fn new(nodes: &[String]) -> Cluster {
        let rt = runtime();
        let emu = emulator(&rt, nodes.iter().cloned());
        let dir = tempfile::tempdir().unwrap();
        write_kubeconfigs(&emu, dir.path());
        let [kubeconfig, coordinator_kubeconfig, _] = kubeconfigs(dir.path());
        let (coordinator, metrics) = start_coordinator(dir.path(), &coordinator_kubeconfig);
        let c = Cluster {
            _rt: rt,
            emu,
            kubeconfig,
            coordinator,
            metrics,
            dir,
        };
        c.wait(
            "the coordinator to hold the Lease",
            Duration::from_secs(30),
            |c| {
                c.emu
                    .get(&ResourceRef::lease(NS, "faultline-peercheck"))
                    .is_some_and(|l| holder(&l).is_some())
            },
        );
        c
    }

    fn agent(&self, node: &str, extra: &[&str]) -> (Child, PathBuf) {
        let dir = self.dir.path().join(node);
        std::fs::create_dir_all(&dir).unwrap();
        let kmsg = dir.join("kmsg");
        std::fs::write(&kmsg, b"").unwrap();
        std::fs::write(dir.join("boot_id"), b"boot-1\n").unwrap();
        std::fs::write(dir.join("peer-token"), format!("{}\n", peer_token(node))).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_faultline-agent"))
            .args(["--kubeconfig", self.kubeconfig.to_str().unwrap()])
            .args(["--node-name", node, "--listen", "127.0.0.1:0", "--no-nvml"])
            .args(["--peer-listen", "127.0.0.1:0"])
            .args(["--follow-interval", "2ms"])
            .arg("--kmsg-path")
            .arg(&kmsg)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--boot-id-path")
            .arg(dir.join("boot_id"))
            .arg("--node-token-file")
            .arg(dir.join("peer-token"))
            .args(["--coordinator", &coordinator_address(self.dir.path())])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("agent.log")).unwrap(),
            ))
            .spawn()
            .unwrap();
        (child, dir)
    }

    fn taints(&self, node: &str) -> Vec<String> {
        let n = self.emu.get(&ResourceRef::node(node)).unwrap();
        n["spec"]["taints"]
            .as_array()
            .map(|ts| {
                ts.iter()
                    .map(|t| {
                        format!(
                            "{}={}",
                            t["key"].as_str().unwrap(),
                            t["value"].as_str().unwrap_or("")
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether the node carries faultline's hard taint.
    fn tainted(&self, node: &str) -> bool {
        self.taints(node)
            .iter()
            .any(|t| t.starts_with("faultline.io/unhealthy"))
    }

    fn record(&self, node: &str) -> Option<Value> {
        let cm = self
            .emu
            .get(&ResourceRef::config_map(NS, &format!("faultline-{node}")))?;
        serde_json::from_str(cm["data"]["faults.json"].as_str()?).ok()
    }

    fn wait(&self, what: &str, limit: Duration, f: impl Fn(&Cluster) -> bool) -> Duration {
        let t0 = Instant::now();
        while !f(self) {
            assert!(t0.elapsed() < limit, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_micros(500));
        }
        t0.elapsed()
    }

    /// The agents' writes since the last `clear_calls`, by `METHOD resource`.
    fn writes(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for c in self
            .emu
            .calls()
            .into_iter()
            .filter(|c| c.is_write() && token_is(c, AGENT_TOKEN))
        {
            let resource = if c.path.contains("/status") {
                "nodes/status"
            } else if c.path.contains("/nodes/") {
                "nodes"
            } else if c.path.contains("/configmaps") {
                "configmaps"
            } else if c.path.contains("/events") {
                "events"
            } else {
                "other"
            };
            let kind = if c
                .content_type
                .as_deref()
                .is_some_and(|t| t.contains("apply-patch"))
            {
                "apply"
            } else {
                c.method.as_str()
            };
            *out.entry(format!("{kind} {resource}")).or_default() += 1;
        }
        out
    }

    /// The coordinator's requests since the last `clear_calls`, by `kind_of`.
    fn coordinator_calls(&self) -> BTreeMap<String, usize> {
        by_kind(
            self.emu
                .calls()
                .iter()
                .filter(|c| token_is(c, COORDINATOR_TOKEN)),
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        sigterm(&self.coordinator);
        let _ = self.coordinator.wait();
    }
}

fn append(dir: &Path, line: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("kmsg"))
        .unwrap();
    f.write_all(line.as_bytes()).unwrap();
}

fn xid(seq: u64, gpu: &str, xid: u32) -> String {
    format!(
        "4,{seq},{},-;NVRM: Xid (PCI:0000:{gpu}:00): {xid}, pid=0, name=x, bench\n",
        seq * 1000
    )
}

fn clear(state: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(["clear", "--state-dir"])
        .arg(state)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn has_fault(r: &Value, code: &str) -> bool {
    r["faults"].as_array().is_some_and(|fs| {
        fs.iter()
            .any(|f| f["fault_code"] == code && f["active"] == true)
    })
}

fn latency(events: usize) {
    let c = Cluster::new(&["node-a".to_string()]);
    let (mut child, dir) = c.agent("node-a", &["--settle", "0s"]);
    c.wait("a first ConfigMap", Duration::from_secs(30), |c| {
        c.record("node-a").is_some()
    });
    let mut lat = Vec::new();
    for i in 0..events {
        let t0 = Instant::now();
        append(&dir, &xid(10 + i as u64, "3b", 79));
        c.wait(
            "the taint and the ConfigMap",
            Duration::from_secs(10),
            |c| {
                c.taints("node-a")
                    .iter()
                    .any(|t| t == "faultline.io/unhealthy=Xid79")
                    && c.record("node-a").is_some_and(|r| has_fault(&r, "Xid79"))
            },
        );
        lat.push(t0.elapsed().as_secs_f64() * 1000.0);
        clear(&dir.join("state"));
        c.wait("the node healthy again", Duration::from_secs(10), |c| {
            c.taints("node-a").is_empty()
                && c.record("node-a").is_some_and(|r| r["health"] == "Healthy")
        });
    }
    lat.sort_by(f64::total_cmp);
    println!(
        "latency: Xid line -> taint and ConfigMap in the API server, {events} events: median {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        quantile(&lat, 0.5),
        quantile(&lat, 0.9),
        quantile(&lat, 0.99),
        lat[lat.len() - 1]
    );
    sigterm(&child);
    child.wait().unwrap();
}

fn writes(steady_secs: u64) {
    let c = Cluster::new(&["node-a".to_string()]);
    let (mut child, dir) = c.agent("node-a", &["--settle", "0s"]);
    c.wait("a first ConfigMap", Duration::from_secs(30), |c| {
        c.record("node-a").is_some_and(|r| r["health"] == "Healthy")
    });
    std::thread::sleep(Duration::from_secs(1));
    println!(
        "writes at start (healthy node, nothing there yet): {:?}",
        c.writes()
    );
    c.emu.clear_calls();
    append(&dir, &xid(10, "3b", 79));
    c.wait("the first fault", Duration::from_secs(10), |c| {
        c.record("node-a").is_some_and(|r| has_fault(&r, "Xid79"))
    });
    std::thread::sleep(Duration::from_secs(2));
    let first = c.writes();
    println!(
        "writes for the first fault (Healthy -> Unhealthy): {} {first:?}; the coordinator's requests for its admission: {:?}; the budget's answers (admitted, denied): {:?}",
        first.values().sum::<usize>(),
        c.coordinator_calls(),
        admits(c.dir.path())
    );
    c.emu.clear_calls();
    append(&dir, &xid(11, "86", 48));
    c.wait("the second fault", Duration::from_secs(10), |c| {
        c.record("node-a").is_some_and(|r| has_fault(&r, "Xid48"))
    });
    std::thread::sleep(Duration::from_secs(2));
    let second = c.writes();
    println!(
        "writes for a second fault on an unhealthy node: {} {second:?}",
        second.values().sum::<usize>()
    );
    c.emu.clear_calls();
    std::thread::sleep(Duration::from_secs(steady_secs));
    let steady = c.writes();
    let reads = c
        .emu
        .calls()
        .iter()
        .filter(|x| token_is(x, AGENT_TOKEN) && !x.is_write())
        .count();
    println!(
        "steady state, {steady_secs} s with nothing changing: {} writes {steady:?}, {reads} reads; the coordinator meanwhile (its Lease): {:?}",
        steady.values().sum::<usize>(),
        c.coordinator_calls()
    );
    sigterm(&child);
    child.wait().unwrap();
}

/// One Xid repeating every `every_ms` for `secs` seconds (a storm) against the emulator, the
/// agent's write budget at its default (`--kube-write-interval 10s`, Events 10 then 30 a
/// minute) or `interval_ms` (0: every change written at once, as before the budget). Counts
/// the API writes by the emulator's request log and checks them against the budget; checks
/// that the last ConfigMap write carries the final count.
fn storm(secs: u64, every_ms: u64, interval_ms: Option<u64>) {
    let c = Cluster::new(&["node-a".to_string()]);
    let interval = Duration::from_millis(interval_ms.unwrap_or(10_000));
    let flag = format!("{}ms", interval.as_millis());
    let (mut child, dir) = c.agent(
        "node-a",
        &["--settle", "0s", "--kube-write-interval", &flag],
    );
    c.wait("a first ConfigMap", Duration::from_secs(30), |c| {
        c.record("node-a").is_some_and(|r| r["health"] == "Healthy")
    });
    std::thread::sleep(Duration::from_secs(1));
    c.emu.clear_calls();
    let started = std::time::SystemTime::now();
    let t0 = Instant::now();
    let every = Duration::from_millis(every_ms.max(1));
    let mut lines = 0u64;
    while t0.elapsed() < Duration::from_secs(secs) {
        append(&dir, &xid(10 + lines, "3b", 79));
        lines += 1;
        let next = t0 + every * u32::try_from(lines).unwrap();
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    let count = |r: &Value| {
        r["faults"]
            .as_array()
            .and_then(|fs| fs.iter().find(|f| f["fault_code"] == "Xid79"))
            .and_then(|f| f["count"].as_u64())
    };
    let final_after = c.wait(
        "the final count in the ConfigMap",
        interval + Duration::from_secs(30),
        |c| c.record("node-a").is_some_and(|r| count(&r) == Some(lines)),
    );
    // Anything still to come would come within an interval.
    std::thread::sleep(interval.min(Duration::from_secs(10)) + Duration::from_secs(2));
    // The agent's own writes; the coordinator's requests (its Lease, and the ledger for the
    // one admission) apart.
    let all_calls = c.emu.calls();
    let calls: Vec<&Call> = all_calls
        .iter()
        .filter(|x| token_is(x, AGENT_TOKEN))
        .collect();
    let cm_path = format!("/api/v1/namespaces/{NS}/configmaps/faultline-node-a");
    let applies: Vec<f64> = calls
        .iter()
        .filter(|x| x.is_write() && x.path == cm_path)
        .map(|x| {
            x.at.duration_since(started)
                .unwrap_or_default()
                .as_secs_f64()
        })
        .collect();
    let events = calls
        .iter()
        .filter(|x| x.is_write() && x.path.contains("/events"))
        .count();
    let node = calls
        .iter()
        .filter(|x| x.is_write() && x.path.contains("/nodes/"))
        .count();
    let all = calls.iter().filter(|x| x.is_write()).count();
    let other = all - applies.len() - events - node;
    let (admitted, denied) = admits(c.dir.path());
    let asked = admitted + denied;
    // With peer checks off the coordinator writes no ConfigMap but the ledger.
    let ledger = all_calls
        .iter()
        .filter(|x| {
            token_is(x, COORDINATOR_TOKEN) && x.is_write() && x.path.contains("/configmaps")
        })
        .count();
    let last = c.record("node-a").and_then(|r| count(&r));
    println!(
        "storm: Xid 79 every {every_ms} ms for {secs} s ({lines} lines), --kube-write-interval {flag}: {all} API writes by the agent: {} ConfigMap applies, {node} Node writes, {events} Event writes, {other} others; {asked} admissions asked of the coordinator ({admitted} admitted); the coordinator's requests {:?} ({ledger} ledger writes); ConfigMap writes at {:?} s (the first 12); the final count ({lines}) in the ConfigMap {:.2} s after the last line; by kind {:?}",
        applies.len(),
        c.coordinator_calls(),
        applies
            .iter()
            .take(12)
            .map(|t| (t * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        final_after.as_secs_f64(),
        c.writes()
    );
    assert_eq!(last, Some(lines), "the last write carries the final count");
    if interval.is_zero() {
        println!("storm: (no write budget: every change written at once)");
    } else {
        // ConfigMap: the first report, one write of counts per interval over the storm, and
        // the trailing write with the final count. Node: what one new fault takes (the label,
        // the taint, the condition); the storm adds nothing. Events: the token bucket's burst
        // and its refill over the storm.
        // Over the nominal storm length (the loop ends a few ms after it).
        let per = interval.as_secs_f64();
        let cm_budget = 1 + (secs as f64 / per).ceil() as usize + 1;
        let event_budget = 10 + (secs * 30 / 60) as usize;
        println!(
            "storm: budget: ConfigMap 1 + ceil({secs} / {per}) + 1 = {cm_budget} (used {}), Node 3 (used {node}), Admit 1 (used {asked}), Events 10 + {secs} x 30/60 = {event_budget} (used {events}), other agent writes 0 (used {other})",
            applies.len()
        );
        assert!(
            applies.len() <= cm_budget,
            "ConfigMap writes over the budget"
        );
        assert!(node <= 3, "Node writes over one fault's");
        assert!(asked <= 1, "admissions over one new fault's");
        assert_eq!(other, 0, "the agent wrote something else");
        assert!(events <= event_budget, "Event writes over the budget");
    }
    coordinator_report("storm", c.dir.path(), c.metrics);
    sigterm(&child);
    child.wait().unwrap();
}

fn fleet(agents: usize) {
    let names: Vec<String> = (0..agents).map(|i| format!("node-{i:03}")).collect();
    let c = Cluster::new(&names);
    let mut children: Vec<(Child, PathBuf)> = names
        .iter()
        .map(|n| c.agent(n, &["--settle", "0s"]))
        .collect();
    let up = c.wait("every agent's ConfigMap", Duration::from_secs(120), |c| {
        names.iter().all(|n| c.record(n).is_some())
    });
    println!(
        "fleet: {agents} agents started and wrote their ConfigMaps in {:.1} s",
        up.as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(1));
    c.emu.clear_calls();
    let t0 = Instant::now();
    for (i, (_, dir)) in children.iter().enumerate() {
        append(dir, &xid(10 + i as u64, "3b", 79));
    }
    let settled = |c: &Cluster, n: &str| -> bool {
        c.record(n).is_some_and(|r| {
            r["health"] == "Unhealthy" && (c.tainted(n) || !r["agent"]["taintBudget"].is_null())
        })
    };
    c.wait(
        "every node tainted or withheld",
        Duration::from_secs(120),
        |c| names.iter().all(|n| settled(c, n)),
    );
    let took = t0.elapsed();
    let tainted = names.iter().filter(|n| c.tainted(n)).count();
    let calls = c.emu.calls();
    let requests = Requests::of(&calls);
    let (admitted, denied) = admits(c.dir.path());
    println!(
        "fleet: {agents} agents failing at once: every node labelled and tainted-or-withheld in {:.2} s; {tainted} tainted (budget 10 %); {admitted} admitted, {denied} denied by the coordinator; {}",
        took.as_secs_f64(),
        requests.line(agents)
    );
    // What the agents complained about meanwhile: each warning's message without its fields
    // (`<time> WARN <target>: <message> key=value ...`), counted, with the first line of each
    // in full.
    let mut warns: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for (_, dir) in &children {
        let log = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
        for l in log
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        {
            let msg = l.split_once(": ").map_or(l, |(_, m)| m);
            let words: Vec<&str> = msg
                .split_whitespace()
                .take_while(|w| !w.contains('='))
                .collect();
            warns.entry(words.join(" ")).or_insert((0, l.to_string())).0 += 1;
        }
    }
    for (w, (n, first)) in &warns {
        println!("fleet: agent warnings: {n} x {w} (the first: {first})");
    }
    coordinator_report("fleet", c.dir.path(), c.metrics);
    for (child, _) in &children {
        sigterm(child);
    }
    for (child, _) in &mut children {
        child.wait().unwrap();
    }
    drop(c);
}

/// The fleet's API requests over one stretch of the call log: the agents' and the
/// coordinator's apart, by their tokens; the bench's own reads are not counted.
struct Requests {
    agents: usize,
    agent_writes: usize,
    agent_kinds: BTreeMap<String, usize>,
    coordinator: usize,
    coordinator_kinds: BTreeMap<String, usize>,
    conflicts: usize,
    /// Answered 401 or 403: a call missing from a call table, or a token the server does not
    /// know.
    refused: usize,
}

impl Requests {
    fn of(calls: &[Call]) -> Requests {
        let agents: Vec<&Call> = calls.iter().filter(|c| token_is(c, AGENT_TOKEN)).collect();
        let coordinator: Vec<&Call> = calls
            .iter()
            .filter(|c| token_is(c, COORDINATOR_TOKEN))
            .collect();
        let fleet = || agents.iter().chain(&coordinator);
        Requests {
            agents: agents.len(),
            agent_writes: agents.iter().filter(|c| c.is_write()).count(),
            agent_kinds: by_kind(agents.iter().copied()),
            coordinator: coordinator.len(),
            coordinator_kinds: by_kind(coordinator.iter().copied()),
            conflicts: fleet().filter(|c| c.status == 409).count(),
            refused: fleet().filter(|c| matches!(c.status, 401 | 403)).count(),
        }
    }

    /// The counts, per failing node too.
    fn line(&self, failing: usize) -> String {
        let per = |n: usize| n as f64 / failing.max(1) as f64;
        let all = self.agents + self.coordinator;
        format!(
            "{all} API requests, {:.1} per failing node: the agents' {} ({:.1} per failing node; {} writes; {:?}), the coordinator's {} ({:.2} per failing node; {:?}); {} conflicts, {} refused (401/403)",
            per(all),
            self.agents,
            per(self.agents),
            self.agent_writes,
            self.agent_kinds,
            self.coordinator,
            per(self.coordinator),
            self.coordinator_kinds,
            self.conflicts,
            self.refused
        )
    }
}

/// CPU seconds (user + system) a process of ours has used: `/proc/PID/stat` fields 14 and 15,
/// in clock ticks (100 per second on Linux).
fn cpu_seconds_of(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces: count fields after its closing parenthesis.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.iter().sum::<f64>() / 100.0
}

/// The most resident memory a process of ours has had (`VmHWM`), in MiB.
fn peak_rss_mib(pid: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// Open file descriptors of this process.
fn open_files() -> usize {
    open_files_of("self")
}

/// The same for another process of ours.
fn open_files_of(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// The agent's configuration from its command line (clap), as the binary parses it.
#[derive(clap::Parser)]
struct AgentArgs {
    #[command(flatten)]
    agent: faultline_agent::daemon::AgentConfig,
}

/// The env var that turns this bench binary into the emulator's process for `fleet-tasks`:
/// its value is the directory to write the kubeconfigs in (`kubeconfigs`).
const SERVE_EMULATOR: &str = "FAULTLINE_BENCH_SERVE_EMULATOR";

/// The emulator's side of `fleet-tasks`, in a process of its own: one process cannot hold 2,000
/// agents' connections and the server's ends of them under a 20,000 open-file limit, and a
/// real API server is another process anyway. Serves `FLEET_NODES` nodes (`node-0000`...) with
/// their agent Pods and tokens (`emulator`), writes taking `FLEET_LATENCY_MS` (`min-max`),
/// writes the kubeconfigs, prints `ready`, and serves until its stdin closes.
fn serve_emulator(dir: &Path) {
    let files = faultline_agent::listen::raise_file_limit();
    let nodes: usize = std::env::var("FLEET_NODES").unwrap().parse().unwrap();
    let latency = std::env::var("FLEET_LATENCY_MS").unwrap();
    let (lo, hi) = latency.split_once('-').unwrap();
    let rt = runtime();
    let emu = emulator(&rt, (0..nodes).map(|i| format!("node-{i:04}")));
    emu.set_write_latency(
        Duration::from_millis(lo.parse().unwrap()),
        Duration::from_millis(hi.parse().unwrap()),
    );
    write_kubeconfigs(&emu, dir);
    println!("ready (open-file limit {files:?})");
    let mut sink = Vec::new();
    // Serve until the bench closes our stdin (or dies).
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    rt.block_on(emu.down());
}

/// The bench's view of the emulator process: reads over HTTP with a kube client of its own.
struct RemoteApi {
    /// The emulator's process, when this view started it.
    child: Option<Child>,
    rt: tokio::runtime::Runtime,
    client: kube::Client,
}

impl RemoteApi {
    /// The emulator's process, writing its kubeconfigs in `dir`; read with the bench's own.
    fn start(nodes: usize, latency_ms: (u64, u64), dir: &Path) -> RemoteApi {
        use std::io::BufRead;
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(SERVE_EMULATOR, dir)
            .env("FLEET_NODES", nodes.to_string())
            .env(
                "FLEET_LATENCY_MS",
                format!("{}-{}", latency_ms.0, latency_ms.1),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("ready"), "emulator process: {line:?}");
        println!("fleet-tasks: emulator process {}", line.trim());
        let mut api = RemoteApi::connect(dir);
        api.child = Some(child);
        api
    }

    /// A view of the emulator process another started, its kubeconfigs in `dir`.
    fn connect(dir: &Path) -> RemoteApi {
        let (rt, client) = admin_client(dir);
        RemoteApi {
            child: None,
            rt,
            client,
        }
    }

    fn send(&self, method: &str, path: &str) -> Value {
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .body(Vec::new())
            .unwrap();
        self.rt.block_on(self.client.request::<Value>(req)).unwrap()
    }

    fn items(&self, path: &str) -> Vec<Value> {
        match self.send("GET", path)["items"].take() {
            Value::Array(items) => items,
            _ => Vec::new(),
        }
    }

    fn calls(&self) -> Vec<faultline_kube_emulator::Call> {
        serde_json::from_value(self.send("GET", "/_emulator/calls")).unwrap()
    }

    fn clear_calls(&self) {
        self.send("DELETE", "/_emulator/calls");
    }

    /// Follows the Nodes and the records labelled Unhealthy with two watches, on a thread of its
    /// own, until `stop` is cancelled: when each node was first seen in each state. (The bench
    /// used to list them every 100 ms: at 2,000 failing nodes, two lists of 2,000 objects
    /// per poll took a share of the server's CPU the agents needed; a watch sends each change
    /// once.)
    fn follow(
        dir: &Path,
        stop: tokio_util::sync::CancellationToken,
    ) -> (Arc<Mutex<Progress>>, std::thread::JoinHandle<()>) {
        use futures::StreamExt;
        use k8s_openapi::api::core::v1::{ConfigMap, Node};
        use kube::runtime::{watcher, WatchStreamExt};
        let progress = Arc::new(Mutex::new(Progress::default()));
        let out = progress.clone();
        let dir = dir.to_path_buf();
        let thread = std::thread::spawn(move || {
            // A client of this thread's runtime: a kube client's requests are sent by a task
            // on the runtime it was made on.
            let (rt, client) = admin_client(&dir);
            rt.block_on(async move {
                let unhealthy =
                    || watcher::Config::default().labels("faultline.io/health=Unhealthy");
                let nodes = watcher(kube::Api::<Node>::all(client.clone()), unhealthy())
                    .applied_objects()
                    .map(|n| n.map(|n| Change::Node(Box::new(n))));
                let records = watcher(kube::Api::<ConfigMap>::namespaced(client, NS), unhealthy())
                    .applied_objects()
                    .map(|c| c.map(|c| Change::Record(Box::new(c))));
                let mut changes = std::pin::pin!(futures::stream::select(nodes, records));
                loop {
                    let change = tokio::select! {
                        () = stop.cancelled() => break,
                        c = changes.next() => c,
                    };
                    match change {
                        Some(Ok(c)) => out.lock().unwrap().note(c, Instant::now()),
                        // A failed watch is restarted by the watcher itself.
                        Some(Err(_)) => {}
                        None => break,
                    }
                }
            });
        });
        (progress, thread)
    }

    /// Whether a coordinator holds the Lease `faultline-peercheck`.
    fn lease_held(&self) -> bool {
        self.items(&format!(
            "/apis/coordination.k8s.io/v1/namespaces/{NS}/leases?fieldSelector=metadata.name%3Dfaultline-peercheck"
        ))
        .first()
        .is_some_and(|l| holder(l).is_some())
    }

    fn records_written(&self) -> usize {
        self.items(&format!(
            "/api/v1/namespaces/{NS}/configmaps?labelSelector=faultline.io%2Fnode"
        ))
        .len()
    }
}

impl Drop for RemoteApi {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            drop(child.stdin.take());
            let _ = child.wait();
        }
    }
}

/// A runtime on this thread, and the bench's client of the emulator process (its kubeconfigs in
/// `dir`) made on it.
fn admin_client(dir: &Path) -> (tokio::runtime::Runtime, kube::Client) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = rt.block_on(async {
        let [_, _, admin] = kubeconfigs(dir);
        let kc = kube::config::Kubeconfig::read_from(admin).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        kube::Client::try_from(cfg).unwrap()
    });
    (rt, client)
}

/// A change `RemoteApi::follow` saw.
enum Change {
    Node(Box<k8s_openapi::api::core::v1::Node>),
    Record(Box<k8s_openapi::api::core::v1::ConfigMap>),
}

/// When each node was first seen labelled Unhealthy on its Node, tainted, recorded Unhealthy
/// in its record's ConfigMap, and recorded Unhealthy with its taint withheld by the budget.
#[derive(Debug, Default)]
struct Progress {
    labelled: BTreeMap<String, Instant>,
    tainted: BTreeMap<String, Instant>,
    recorded: BTreeMap<String, Instant>,
    withheld: BTreeMap<String, Instant>,
}

impl Progress {
    fn note(&mut self, change: Change, at: Instant) {
        let first = |m: &mut BTreeMap<String, Instant>, name: &str| {
            m.entry(name.to_string()).or_insert(at);
        };
        match change {
            Change::Node(n) => {
                let name = n.metadata.name.clone().unwrap_or_default();
                first(&mut self.labelled, &name);
                let taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
                if taints.iter().any(|t| t.key == "faultline.io/unhealthy") {
                    first(&mut self.tainted, &name);
                }
            }
            Change::Record(cm) => {
                let labels = cm.metadata.labels.unwrap_or_default();
                let Some(name) = labels.get("faultline.io/node") else {
                    return;
                };
                let Some(r) = cm
                    .data
                    .as_ref()
                    .and_then(|d| d.get("faults.json"))
                    .and_then(|d| serde_json::from_str::<Value>(d).ok())
                else {
                    return;
                };
                if r["health"] != "Unhealthy" {
                    return;
                }
                first(&mut self.recorded, name);
                if !r["agent"]["taintBudget"].is_null() {
                    first(&mut self.withheld, name);
                }
            }
        }
    }

    /// When `node` was first labelled Unhealthy on both its Node and its record, and tainted or
    /// withheld: settled.
    fn settled(&self, node: &str) -> Option<Instant> {
        let done = match (self.tainted.get(node), self.withheld.get(node)) {
            (Some(a), Some(b)) => *a.min(b),
            (Some(a), None) | (None, Some(a)) => *a,
            (None, None) => return None,
        };
        Some(
            done.max(*self.labelled.get(node)?)
                .max(*self.recorded.get(node)?),
        )
    }
}

/// How many agents `fleet-tasks` starts at a time.
const START_BATCH: usize = 250;

/// The env var that turns this bench binary into one of `fleet-tasks`'s agents' processes: its
/// value is the bench's directory (the kubeconfigs, one directory per node); `FLEET_AGENTS`
/// (`from-to`) names the nodes it runs.
const SERVE_AGENTS: &str = "FAULTLINE_BENCH_SERVE_AGENTS";

/// The agents' errors, counted by their text; panics, with them, if any task has ended.
fn ended(rt: &tokio::runtime::Runtime, tasks: &mut [tokio::task::JoinHandle<anyhow::Result<()>>]) {
    let why = outcomes(rt, tasks.iter_mut().filter(|t| t.is_finished()));
    assert!(
        why.is_empty(),
        "fleet-tasks: {} agents ended before the incident (open files {}): {why:?}",
        why.values().sum::<usize>(),
        open_files()
    );
}

/// How the given agents' tasks ended, counted by their errors' text (`no error` for a clean end).
fn outcomes<'a>(
    rt: &tokio::runtime::Runtime,
    tasks: impl Iterator<Item = &'a mut tokio::task::JoinHandle<anyhow::Result<()>>>,
) -> BTreeMap<String, usize> {
    let mut why: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks {
        let r = match rt.block_on(t) {
            Ok(Ok(())) => "no error".to_string(),
            Ok(Err(e)) => format!("{e:#}"),
            Err(e) => format!("the task: {e}"),
        };
        *why.entry(r).or_default() += 1;
    }
    why
}

/// One of `fleet-tasks`'s agents' processes: runs the agents of nodes `FLEET_AGENTS` (`from-to`,
/// `to` excluded) as tasks (each its own state directory, kernel log, HTTP port and Kubernetes
/// clients, sharing nothing but the API server), started a batch at a time; prints `ready` once
/// all have written their ConfigMaps, runs them until its stdin closes, then stops them and
/// prints `ended` with how they ended (JSON). One process cannot hold 2,000 agents under a
/// 20,000 open-file limit once every one of them also asks the coordinator.
fn serve_agents(dir: &Path) {
    use clap::Parser;
    // The agents' errors (RUST_LOG=error by default here) on stderr.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "error");
    }
    faultline_agent::cli::init_tracing("text");
    let files = faultline_agent::listen::raise_file_limit();
    let range = std::env::var("FLEET_AGENTS").unwrap();
    let (from, to) = range.split_once('-').unwrap();
    let (from, to): (usize, usize) = (from.parse().unwrap(), to.parse().unwrap());
    let api = RemoteApi::connect(dir);
    let [kubeconfig, _, _] = kubeconfigs(dir);
    let coordinator = coordinator_address(dir);
    let rt = runtime();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut tasks = Vec::new();
    for i in from..to {
        let n = format!("node-{i:04}");
        let dir = dir.join(&n);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("kmsg"), b"").unwrap();
        std::fs::write(dir.join("boot_id"), b"boot-1\n").unwrap();
        std::fs::write(dir.join("peer-token"), format!("{}\n", peer_token(&n))).unwrap();
        let p = |x: &str| dir.join(x).to_str().unwrap().to_string();
        let argv = [
            "faultline-agent".to_string(),
            "--kubeconfig".into(),
            kubeconfig.to_str().unwrap().into(),
            "--node-name".into(),
            n.clone(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--no-nvml".into(),
            "--no-ascend".into(),
            "--follow-interval".into(),
            "100ms".into(),
            "--kmsg-path".into(),
            p("kmsg"),
            "--state-dir".into(),
            p("state"),
            "--data-dir".into(),
            p("data"),
            "--boot-id-path".into(),
            p("boot_id"),
            "--settle".into(),
            "0s".into(),
            "--node-token-file".into(),
            p("peer-token"),
            "--coordinator".into(),
            coordinator.clone(),
            "--peer-listen".into(),
            "127.0.0.1:0".into(),
        ];
        let cfg = AgentArgs::try_parse_from(argv).unwrap().agent;
        // Each agent its own token: one that fails to start cancels its own, not the fleet's.
        let stop = shutdown.child_token();
        tasks.push(rt.spawn(faultline_agent::daemon::run(cfg, stop)));
        // Started a batch at a time, as a DaemonSet's rollout starts them, each batch once the
        // one before has written its ConfigMaps (the processes before this one have written
        // theirs): all 2,000 connecting in the same second took the process to its 20,000
        // open files, and agents that could not open their listeners ended.
        let started = i + 1 - from;
        if started % START_BATCH == 0 || i + 1 == to {
            let t = Instant::now();
            while api.records_written() < i + 1 && t.elapsed() < Duration::from_secs(60) {
                ended(&rt, &mut tasks);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    ended(&rt, &mut tasks);
    println!("ready (open-file limit {files:?}, {} open)", open_files());
    let mut sink = Vec::new();
    // Run until the bench closes our stdin (or dies).
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    shutdown.cancel();
    let why = outcomes(&rt, tasks.iter_mut());
    println!("ended {}", serde_json::to_string(&why).unwrap());
}

/// One of `fleet-tasks`'s agents' processes, seen from the bench.
struct Agents {
    child: Child,
    out: std::io::BufReader<std::process::ChildStdout>,
    /// Reaped by `stop`: not to be signalled again.
    reaped: bool,
}

impl Agents {
    /// Starts the agents of nodes `from..to` and waits until they have written their ConfigMaps.
    fn start(dir: &Path, from: usize, to: usize) -> Agents {
        use std::io::BufRead;
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(SERVE_AGENTS, dir)
            .env("FLEET_AGENTS", format!("{from}-{to}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(
            line.starts_with("ready"),
            "agents' process {from}..{to}: {line:?}"
        );
        println!(
            "fleet-tasks: agents' process for nodes {from}..{to} {}",
            line.trim()
        );
        Agents {
            child,
            out,
            reaped: false,
        }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Open file descriptors of the process.
    fn open_files(&self) -> usize {
        open_files_of(&self.pid())
    }

    /// Stops the agents and says how they ended (their errors' text, counted).
    fn stop(mut self) -> BTreeMap<String, usize> {
        use std::io::BufRead;
        drop(self.child.stdin.take());
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        let _ = self.child.wait();
        self.reaped = true;
        let json = line.strip_prefix("ended ").unwrap_or_else(|| {
            panic!("agents' process: {line:?}");
        });
        serde_json::from_str(json).unwrap()
    }
}

impl Drop for Agents {
    fn drop(&mut self) {
        if self.reaped {
            return;
        }
        sigterm(&self.child);
        let _ = self.child.wait();
    }
}

/// Many agents as tasks of `processes` processes (`serve_agents`), against the emulator in a
/// process of its own whose writes take `latency_ms` (a real API server's 5-20 ms). When all
/// have written their ConfigMaps and the coordinator (a process of its own) holds the Lease,
/// `fail_percent` of the nodes get an Xid 79 at the same moment: how long until each is
/// labelled Unhealthy and tainted or withheld by the budget, how many are tainted against the
/// budget's limit, and the API requests per failing node, the agents' and the coordinator's.
fn fleet_tasks(agents: usize, fail_percent: usize, latency_ms: (u64, u64), processes: usize) {
    let names: Vec<String> = (0..agents).map(|i| format!("node-{i:04}")).collect();
    let dir = tempfile::tempdir().unwrap();
    let api = RemoteApi::start(agents, latency_ms, dir.path());
    let [_, coordinator_kubeconfig, _] = kubeconfigs(dir.path());
    let (coordinator, metrics) = start_coordinator(dir.path(), &coordinator_kubeconfig);
    // Stopped however this ends, a failed assertion included.
    let coordinator = Stopping(coordinator);
    let t_start = Instant::now();
    let processes = processes.clamp(1, agents.max(1));
    let fleet: Vec<Agents> = (0..processes)
        .map(|p| {
            Agents::start(
                dir.path(),
                agents * p / processes,
                agents * (p + 1) / processes,
            )
        })
        .collect();
    let dirs: Vec<PathBuf> = names.iter().map(|n| dir.path().join(n)).collect();
    // Steady state: every agent has written its ConfigMap and the coordinator holds the
    // Lease (it counts the members and reads the ledger at the first admission, as a
    // coordinator that has admitted nothing for a minute does).
    let up = loop {
        let written = api.records_written();
        let held = api.lease_held();
        if written == agents && held {
            break t_start.elapsed();
        }
        assert!(
            t_start.elapsed() < Duration::from_secs(600),
            "only {written} of {agents} ConfigMaps after 600 s (the Lease held: {held})"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let open = || fleet.iter().map(Agents::open_files).collect::<Vec<_>>();
    let agents_cpu = || fleet.iter().map(|a| cpu_seconds_of(&a.pid())).sum::<f64>();
    let start = Requests::of(&api.calls());
    println!(
        "fleet-tasks: {agents} agents in {processes} processes (open files {:?}, the emulator's {}) started and wrote their ConfigMaps, and the coordinator holds the Lease, in {:.1} s; the agents' API requests {} ({:.1} per node), the coordinator's {}",
        open(),
        open_files_of(&api.child.as_ref().unwrap().id().to_string()),
        up.as_secs_f64(),
        start.agents,
        start.agents as f64 / agents as f64,
        start.coordinator
    );
    let (cpu0, w0) = (agents_cpu(), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    println!(
        "fleet-tasks: idle, the agents' processes use {:.2} cores",
        (agents_cpu() - cpu0) / w0.elapsed().as_secs_f64()
    );
    api.clear_calls();
    let failing: Vec<usize> = (0..agents)
        .filter(|i| i * 100 / agents < fail_percent)
        .collect();
    let t0 = Instant::now();
    let cpu0 = agents_cpu();
    let emu_pid = api.child.as_ref().unwrap().id().to_string();
    let emu_cpu0 = cpu_seconds_of(&emu_pid);
    let coordinator_pid = coordinator.0.id().to_string();
    let coordinator_cpu0 = cpu_seconds_of(&coordinator_pid);
    let stop_following = tokio_util::sync::CancellationToken::new();
    let (progress, follower) = RemoteApi::follow(dir.path(), stop_following.clone());
    for (k, i) in failing.iter().enumerate() {
        append(&dirs[*i], &xid(10 + k as u64, "3b", 79));
    }
    // The most files each agents' process had open at a poll (each one's limit is 20,000 here).
    let mut peak_files = vec![0; processes];
    // And the emulator's (its limit is 20,000 too: each agent's connections end there).
    let mut emu_files = 0;
    let mut unsettled = None;
    let took = loop {
        for (peak, now) in peak_files.iter_mut().zip(open()) {
            *peak = now.max(*peak);
        }
        emu_files = emu_files.max(open_files_of(&emu_pid));
        let (done, labelled) = {
            let p = progress.lock().unwrap();
            let done = failing
                .iter()
                .filter(|i| p.settled(&names[**i]).is_some())
                .count();
            (done, p.labelled.len())
        };
        if done == failing.len() {
            break t0.elapsed();
        }
        if t0.elapsed() > Duration::from_secs(300) {
            // Reported like a finished run (the figures of the nodes that settled), then failed.
            let errors = api.calls().iter().filter(|x| x.status >= 400).count();
            let why = format!(
                "after 300 s only {done} of {} failing nodes are labelled and tainted or withheld ({labelled} labelled); {errors} API errors; open files {:?}",
                failing.len(),
                open()
            );
            println!("fleet-tasks: NOT SETTLED: {why}");
            unsettled = Some(why);
            break t0.elapsed();
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Settled nodes' times come from the watches: `took` is when the bench saw the last one.
    stop_following.cancel();
    follower.join().unwrap();
    let progress = std::mem::take(&mut *progress.lock().unwrap());
    let since = |m: &BTreeMap<String, Instant>| -> Vec<f64> {
        let mut v: Vec<f64> = m
            .values()
            .map(|t| t.saturating_duration_since(t0).as_secs_f64())
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let busy = (agents_cpu() - cpu0) / took.as_secs_f64();
    let emu_busy = (cpu_seconds_of(&emu_pid) - emu_cpu0) / took.as_secs_f64();
    let coordinator_busy =
        (cpu_seconds_of(&coordinator_pid) - coordinator_cpu0) / took.as_secs_f64();
    let settled_at: BTreeMap<String, Instant> = names
        .iter()
        .filter_map(|n| Some((n.clone(), progress.settled(n)?)))
        .collect();
    let times = since(&settled_at);
    let label_times = since(&progress.labelled);
    println!(
        "fleet-tasks: failing nodes settled after (s): first {:.2}, median {:.2}, p90 {:.2}, last {:.2}; the agents' processes used {busy:.2} cores meanwhile, the emulator's {emu_busy:.2}, the coordinator's {coordinator_busy:.2}",
        times.first().copied().unwrap_or_default(),
        quantile(&times, 0.5),
        quantile(&times, 0.9),
        times.last().copied().unwrap_or_default(),
    );
    println!(
        "fleet-tasks: failing nodes labelled after (s): first {:.2}, median {:.2}, p90 {:.2}, last {:.2}; open files at most {peak_files:?} meanwhile, the emulator's {emu_files}",
        label_times.first().copied().unwrap_or_default(),
        quantile(&label_times, 0.5),
        quantile(&label_times, 0.9),
        label_times.last().copied().unwrap_or_default(),
    );
    let tainted = progress.tainted.len();
    let limit = (agents * 10 / 100).max(1);
    let calls = api.calls();
    let requests = Requests::of(&calls);
    let (admitted, denied) = admits(dir.path());
    let others_wrote = calls
        .iter()
        .filter(|x| x.is_write() && token_is(x, AGENT_TOKEN))
        .filter_map(|x| x.user_agent.as_deref())
        .filter(|ua| {
            !failing
                .iter()
                .any(|i| ua.ends_with(&format!("({})", names[*i])))
        })
        .count();
    println!(
        "fleet-tasks: {} of {agents} nodes failing at once (write latency {}-{} ms): {} labelled and tainted-or-withheld in {:.2} s; {tainted} tainted, budget limit {limit}; the coordinator's answers: {admitted} admitted, {denied} denied; {}; {others_wrote} writes by healthy nodes",
        failing.len(),
        latency_ms.0,
        latency_ms.1,
        if unsettled.is_some() {
            format!("only {} of them", settled_at.len())
        } else {
            "every one".to_string()
        },
        took.as_secs_f64(),
        requests.line(failing.len())
    );
    assert!(
        tainted <= limit,
        "the budget was overrun: {tainted} > {limit}"
    );
    let mut failed_runs: BTreeMap<String, usize> = BTreeMap::new();
    for a in fleet {
        for (why, n) in a.stop() {
            *failed_runs.entry(why).or_default() += n;
        }
    }
    failed_runs.remove("no error");
    println!(
        "fleet-tasks: agents that ended with an error: {} {failed_runs:?}",
        failed_runs.values().sum::<usize>()
    );
    coordinator_report("fleet-tasks", dir.path(), metrics);
    // Its Deployment's memory limit is 256 MiB (manifests/base/coordinator.yaml).
    println!(
        "fleet-tasks: the coordinator's peak resident memory {:.1} MiB",
        peak_rss_mib(&coordinator_pid).unwrap_or(f64::NAN)
    );
    drop(coordinator);
    drop(api);
    assert!(unsettled.is_none(), "{}", unsettled.unwrap_or_default());
}

/// A child process stopped (SIGTERM) and reaped when dropped, also when the bench panics.
struct Stopping(Child);

impl Drop for Stopping {
    fn drop(&mut self) {
        sigterm(&self.0);
        let _ = self.0.wait();
    }
}

fn main() {
    if let Some(dir) = std::env::var_os(SERVE_EMULATOR) {
        serve_emulator(Path::new(&dir));
        return;
    }
    if let Some(dir) = std::env::var_os(SERVE_AGENTS) {
        serve_agents(Path::new(&dir));
        return;
    }
    let args = common::Args::from_env();
    let parts = ["latency", "writes", "storm", "fleet", "fleet-tasks"];
    if args.wants(&parts, "latency") {
        latency(args.flag("--events", 100) as usize);
    }
    if args.wants(&parts, "writes") {
        writes(args.flag("--steady-secs", 60));
    }
    if args.wants(&parts, "storm") {
        let interval = args.flag("--storm-interval-ms", u64::MAX);
        storm(
            args.flag("--storm-secs", 60),
            args.flag("--storm-every-ms", 10),
            (interval != u64::MAX).then_some(interval),
        );
    }
    if args.wants(&parts, "fleet") {
        fleet(args.flag("--agents", 200) as usize);
    }
    if args.wants(&parts, "fleet-tasks") {
        fleet_tasks(
            args.flag("--agents", 1000) as usize,
            args.flag("--fail-percent", 10) as usize,
            (
                args.flag("--latency-min-ms", 5),
                args.flag("--latency-max-ms", 20),
            ),
            args.flag("--agent-processes", 1) as usize,
        );
    }
}
