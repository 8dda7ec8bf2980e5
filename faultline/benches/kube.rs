//! Kubernetes-mode benchmarks against the API emulator (release build of the agent):
//!
//! - `latency`: an Xid line to the taint and the ConfigMap visible in the API server;
//! - `writes`: API writes per fault, and at steady state (nothing changing);
//! - `storm`: one Xid repeating for a minute: API writes against the write budget, and the
//!   final count in the last ConfigMap write;
//! - `fleet`: many agents against one API server, all failing at once, under the taint budget.
//! - `fleet-tasks`: 1,000-2,000 agents as tasks of one process against an API server (the
//!   emulator in a process of its own, as a real one is) with a real server's write latency; a
//!   share of them failing at once.
//!
//! `cargo bench -p faultline --bench kube -- [latency] [writes] [storm] [fleet]
//!  [fleet-tasks] [--events N] [--steady-secs S] [--storm-secs S] [--storm-every-ms M]
//!  [--storm-interval-ms I] [--agents N] [--fail-percent P] [--latency-min-ms A]
//!  [--latency-max-ms B]`; docs/benchmarks.md has the figures.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{quantile, terminate as sigterm};
use faultline_kube_emulator::{Emulator, ResourceRef};
use serde_json::{json, Value};

const NS: &str = "faultline-system";

struct Cluster {
    /// Runs the emulator; dropped last.
    _rt: tokio::runtime::Runtime,
    emu: Emulator,
    kubeconfig: PathBuf,
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

/// An emulator on `rt` holding the agents' namespace and one Node per name.
fn emulator(rt: &tokio::runtime::Runtime, nodes: impl IntoIterator<Item = String>) -> Emulator {
    let emu = rt.block_on(Emulator::start()).unwrap();
    emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}));
    for n in nodes {
        emu.put(faultline_kube_emulator::node(
            &n,
            &[("kubernetes.io/hostname", &n)],
        ));
    }
    emu
}

impl Cluster {
    fn new(nodes: &[String]) -> Cluster {
        let rt = runtime();
        let emu = emulator(&rt, nodes.iter().cloned());
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        emu.write_kubeconfig(&kubeconfig, "bench").unwrap();
        Cluster {
            _rt: rt,
            emu,
            kubeconfig,
            dir,
        }
    }

    fn agent(&self, node: &str, extra: &[&str]) -> (Child, PathBuf) {
        let dir = self.dir.path().join(node);
        std::fs::create_dir_all(&dir).unwrap();
        let kmsg = dir.join("kmsg");
        std::fs::write(&kmsg, b"").unwrap();
        std::fs::write(dir.join("boot_id"), b"boot-1\n").unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_faultline-agent"))
            .args(["--kubeconfig", self.kubeconfig.to_str().unwrap()])
            .args(["--node-name", node, "--listen", "127.0.0.1:0", "--no-nvml"])
            .args(["--follow-interval", "2ms"])
            .arg("--kmsg-path")
            .arg(&kmsg)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--boot-id-path")
            .arg(dir.join("boot_id"))
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

    /// Writes since the last `clear_calls`, by `METHOD resource`.
    fn writes(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for c in self.emu.calls().into_iter().filter(|c| c.is_write()) {
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
        "writes for the first fault (Healthy -> Unhealthy): {} {first:?}",
        first.values().sum::<usize>()
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
    let reads = c.emu.calls().len() - steady.values().sum::<usize>();
    println!(
        "steady state, {steady_secs} s with nothing changing: {} writes {steady:?}, {reads} reads",
        steady.values().sum::<usize>()
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
    let calls = c.emu.calls();
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
    let ledger = all - applies.len() - events - node;
    let last = c.record("node-a").and_then(|r| count(&r));
    println!(
        "storm: Xid 79 every {every_ms} ms for {secs} s ({lines} lines), --kube-write-interval {flag}: {all} API writes: {} ConfigMap applies, {node} Node writes, {ledger} taint-ledger writes, {events} Event writes; ConfigMap writes at {:?} s (the first 12); the final count ({lines}) in the ConfigMap {:.2} s after the last line; by kind {:?}",
        applies.len(),
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
            "storm: budget: ConfigMap 1 + ceil({secs} / {per}) + 1 = {cm_budget} (used {}), Node 3 (used {node}), taint ledger 1 (used {ledger}), Events 10 + {secs} x 30/60 = {event_budget} (used {events})",
            applies.len()
        );
        assert!(
            applies.len() <= cm_budget,
            "ConfigMap writes over the budget"
        );
        assert!(node <= 3, "Node writes over one fault's");
        assert!(ledger <= 1, "taint-ledger writes over one admission's");
        assert!(events <= event_budget, "Event writes over the budget");
    }
    sigterm(&child);
    child.wait().unwrap();
}

fn fleet(agents: usize) {
    let names: Vec<String> = (0..agents).map(|i| format!("node-{i:03}")).collect();
    let c = Cluster::new(&names);
    let mut children: Vec<(Child, PathBuf)> = names
        .iter()
        .map(|n| c.agent(n, &["--settle", "0s", "--budget-recheck", "1s"]))
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
    let writes = calls.iter().filter(|c| c.is_write()).count();
    let conflicts = calls.iter().filter(|c| c.status == 409).count();
    println!(
        "fleet: {agents} agents failing at once: every node labelled and tainted-or-withheld in {:.2} s; {tainted} tainted (budget 10 %); {} API requests ({writes} writes, {conflicts} conflicts on the ledger) in that time",
        took.as_secs_f64(),
        calls.len()
    );
    // What the agents complained about meanwhile: each warning's message without its fields
    // (`<time> WARN <target>: <message> key=value ...`), counted.
    let mut warns: BTreeMap<String, usize> = BTreeMap::new();
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
            *warns.entry(words.join(" ")).or_default() += 1;
        }
    }
    for (w, n) in &warns {
        println!("fleet: agent warnings: {n} x {w}");
    }
    for (child, _) in &children {
        sigterm(child);
    }
    for (child, _) in &mut children {
        child.wait().unwrap();
    }
    drop(c);
}

/// CPU seconds (user + system) this process has used: `/proc/self/stat` fields 14 and 15, in
/// clock ticks (100 per second on Linux).
fn cpu_seconds() -> f64 {
    cpu_seconds_of("self")
}

/// The same for another process of ours.
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

/// Open file descriptors of this process.
fn open_files() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

/// The agent's configuration from its command line (clap), as the binary parses it.
#[derive(clap::Parser)]
struct AgentArgs {
    #[command(flatten)]
    agent: faultline_agent::daemon::AgentConfig,
}

/// The env var that turns this bench binary into the emulator's process for `fleet-tasks`:
/// its value is where to write the kubeconfig.
const SERVE_EMULATOR: &str = "FAULTLINE_BENCH_SERVE_EMULATOR";

/// The emulator's side of `fleet-tasks`, in a process of its own: one process cannot hold 2,000
/// agents' connections and the server's ends of them under a 20,000 open-file limit, and a
/// real API server is another process anyway. Serves `FLEET_NODES` nodes (`node-0000`...) with
/// writes taking `FLEET_LATENCY_MS` (`min-max`), writes the kubeconfig, prints `ready`, and
/// serves until its stdin closes.
fn serve_emulator(kubeconfig: &Path) {
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
    emu.write_kubeconfig(kubeconfig, "bench").unwrap();
    println!("ready (open-file limit {files:?})");
    let mut sink = Vec::new();
    // Serve until the bench closes our stdin (or dies).
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    rt.block_on(emu.down());
}

/// The bench's view of the emulator process: reads over HTTP with a kube client of its own.
struct RemoteApi {
    child: Child,
    rt: tokio::runtime::Runtime,
    client: kube::Client,
}

impl RemoteApi {
    fn start(nodes: usize, latency_ms: (u64, u64), kubeconfig: &Path) -> RemoteApi {
        use std::io::BufRead;
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(SERVE_EMULATOR, kubeconfig)
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
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = rt.block_on(async {
            let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
            let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .unwrap();
            kube::Client::try_from(cfg).unwrap()
        });
        RemoteApi { child, rt, client }
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

    /// Nodes of `names` labelled Unhealthy on both the Node and the record's ConfigMap, and
    /// tainted or withheld by the budget (two label-selected lists, not a GET per node); and the
    /// Nodes labelled Unhealthy, each with whether it is tainted.
    fn settled(&self) -> (BTreeMap<String, bool>, BTreeMap<String, bool>) {
        let sel = "labelSelector=faultline.io%2Fhealth%3DUnhealthy";
        let nodes: BTreeMap<String, bool> = self
            .items(&format!("/api/v1/nodes?{sel}"))
            .into_iter()
            .map(|n| {
                let tainted = n["spec"]["taints"].as_array().is_some_and(|ts| {
                    ts.iter()
                        .any(|t| t["key"].as_str() == Some("faultline.io/unhealthy"))
                });
                (
                    n["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    tainted,
                )
            })
            .collect();
        let mut settled = BTreeMap::new();
        for cm in self.items(&format!("/api/v1/namespaces/{NS}/configmaps?{sel}")) {
            let Some(node) = cm["metadata"]["labels"]["faultline.io/node"].as_str() else {
                continue;
            };
            let Some(r) = cm["data"]["faults.json"]
                .as_str()
                .and_then(|d| serde_json::from_str::<Value>(d).ok())
            else {
                continue;
            };
            let Some(&tainted) = nodes.get(node) else {
                continue;
            };
            if r["health"] == "Unhealthy" && (tainted || !r["agent"]["taintBudget"].is_null()) {
                settled.insert(node.to_string(), tainted);
            }
        }
        (settled, nodes)
    }

    /// The taint budget's shared node count, when the ledger holds one.
    fn ledger_count(&self) -> Option<u64> {
        let cm = self.send(
            "GET",
            &format!("/api/v1/namespaces/{NS}/configmaps?fieldSelector=metadata.name%3Dfaultline-taint-budget"),
        );
        let text = cm["items"][0]["data"]["ledger.json"].as_str()?.to_string();
        serde_json::from_str::<Value>(&text).ok()?["nodes"]["count"].as_u64()
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
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Many agents as tasks of this process (each its own state directory, kernel log, HTTP port
/// and Kubernetes clients, sharing nothing but the API server), against the emulator in a
/// process of its own whose writes take `latency_ms` (a real API server's 5-20 ms). When all
/// have written their ConfigMaps, `fail_percent` of the nodes get an Xid 79 at the same moment:
/// how long until each is labelled Unhealthy and tainted or withheld by the budget, how many
/// are tainted against the budget's limit, and the API requests per node.
fn fleet_tasks(agents: usize, fail_percent: usize, latency_ms: (u64, u64)) {
    use clap::Parser;
    // The agents' errors (RUST_LOG=error by default here) on stderr.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "error");
    }
    faultline_agent::cli::init_tracing("text");
    let files = faultline_agent::listen::raise_file_limit();
    let names: Vec<String> = (0..agents).map(|i| format!("node-{i:04}")).collect();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    let api = RemoteApi::start(agents, latency_ms, &kubeconfig);
    let rt = runtime();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let t_start = Instant::now();
    let mut dirs = Vec::new();
    let mut tasks = Vec::new();
    for n in &names {
        let dir = dir.path().join(n);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("kmsg"), b"").unwrap();
        std::fs::write(dir.join("boot_id"), b"boot-1\n").unwrap();
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
            "--budget-recheck".into(),
            "1s".into(),
        ];
        let cfg = AgentArgs::try_parse_from(argv).unwrap().agent;
        // Each agent its own token: one that fails to start cancels its own, not the fleet's.
        let stop = shutdown.child_token();
        tasks.push(rt.spawn(faultline_agent::daemon::run(cfg, stop)));
        dirs.push(dir);
    }
    let up = loop {
        let written = api.records_written();
        if written == agents {
            break t_start.elapsed();
        }
        assert!(
            t_start.elapsed() < Duration::from_secs(600),
            "only {written} of {agents} ConfigMaps after 600 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let start_calls = api.calls().len();
    println!(
        "fleet-tasks: {agents} agents (open-file limit {files:?}, {} open) started and wrote their ConfigMaps in {:.1} s; {start_calls} API requests ({:.1} per node)",
        open_files(),
        up.as_secs_f64(),
        start_calls as f64 / agents as f64
    );
    // Steady state: the agents keep the budget's node count fresh (a look every 5 min each, a
    // count when it is over a minute old), so the first count, taken while the fleet was still
    // starting, is replaced within about a minute.
    let counted = loop {
        if api.ledger_count() == Some(agents as u64) {
            break t_start.elapsed();
        }
        assert!(
            t_start.elapsed() < Duration::from_secs(900),
            "the shared node count is {:?}, not {agents}, after 900 s",
            api.ledger_count()
        );
        std::thread::sleep(Duration::from_secs(1));
    };
    println!(
        "fleet-tasks: the taint budget's shared node count was {agents} after {:.1} s",
        counted.as_secs_f64()
    );
    let (cpu0, w0) = (cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    println!(
        "fleet-tasks: idle, the agents' process uses {:.2} cores",
        (cpu_seconds() - cpu0) / w0.elapsed().as_secs_f64()
    );
    api.clear_calls();
    let failing: Vec<usize> = (0..agents)
        .filter(|i| i * 100 / agents < fail_percent)
        .collect();
    let t0 = Instant::now();
    let cpu0 = cpu_seconds();
    let emu_pid = api.child.id().to_string();
    let emu_cpu0 = cpu_seconds_of(&emu_pid);
    for (k, i) in failing.iter().enumerate() {
        append(&dirs[*i], &xid(10 + k as u64, "3b", 79));
    }
    let mut first_label = None;
    // When each failing node was first seen labelled on its Node (whatever its taint).
    let mut labelled: BTreeMap<String, f64> = BTreeMap::new();
    // When each failing node was first seen settled (polled every 100 ms: each poll lists up to
    // 200 Nodes and ConfigMaps, and polling every 25 ms cost the server, on the same two cores
    // as the agents, a visible share of its time).
    let mut seen: BTreeMap<String, f64> = BTreeMap::new();
    let (took, settled) = loop {
        let (settled, on_nodes) = api.settled();
        let unhealthy = on_nodes.len();
        let now = t0.elapsed();
        if unhealthy > 0 && first_label.is_none() {
            first_label = Some(now);
        }
        for n in on_nodes.keys() {
            labelled.entry(n.clone()).or_insert(now.as_secs_f64());
        }
        for n in settled.keys() {
            seen.entry(n.clone()).or_insert(now.as_secs_f64());
        }
        let done = failing
            .iter()
            .filter(|i| settled.contains_key(&names[**i]))
            .count();
        if done == failing.len() {
            break (now, settled);
        }
        if t0.elapsed() > Duration::from_secs(300) {
            let ended = tasks.iter().filter(|t| t.is_finished()).count();
            println!("fleet-tasks: {ended} agent tasks have ended");
            let errors = api.calls().iter().filter(|x| x.status >= 400).count();
            panic!(
                "after 300 s only {done} of {} failing nodes are labelled and tainted or withheld ({unhealthy} labelled); {errors} API errors; open files {}",
                failing.len(),
                open_files()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let busy = (cpu_seconds() - cpu0) / took.as_secs_f64();
    let emu_busy = (cpu_seconds_of(&emu_pid) - emu_cpu0) / took.as_secs_f64();
    let mut times: Vec<f64> = seen.into_values().collect();
    times.sort_by(f64::total_cmp);
    println!(
        "fleet-tasks: first node labelled after {:.2} s; failing nodes settled after (s): first {:.2}, median {:.2}, p90 {:.2}, last {:.2}; the agents' process used {busy:.2} cores meanwhile, the emulator's {emu_busy:.2}",
        first_label.unwrap_or_default().as_secs_f64(),
        times.first().copied().unwrap_or_default(),
        quantile(&times, 0.5),
        quantile(&times, 0.9),
        took.as_secs_f64()
    );
    let mut label_times: Vec<f64> = labelled.into_values().collect();
    label_times.sort_by(f64::total_cmp);
    println!(
        "fleet-tasks: failing nodes labelled after (s): first {:.2}, median {:.2}, p90 {:.2}, last {:.2}",
        label_times.first().copied().unwrap_or_default(),
        quantile(&label_times, 0.5),
        quantile(&label_times, 0.9),
        label_times.last().copied().unwrap_or_default(),
    );
    let tainted = settled.values().filter(|t| **t).count();
    let limit = (agents * 10 / 100).max(1);
    let calls = api.calls();
    let writes = calls.iter().filter(|c| c.is_write()).count();
    let conflicts = calls.iter().filter(|c| c.status == 409).count();
    let others_wrote = calls
        .iter()
        .filter(|x| x.is_write())
        .filter_map(|x| x.user_agent.as_deref())
        .filter(|ua| {
            !failing
                .iter()
                .any(|i| ua.ends_with(&format!("({})", names[*i])))
        })
        .count();
    println!(
        "fleet-tasks: {} of {agents} nodes failing at once (write latency {}-{} ms): every one labelled and tainted-or-withheld in {:.2} s; {tainted} tainted, budget limit {limit}; {} API requests ({writes} writes, {conflicts} conflicts), {:.1} per failing node, {others_wrote} writes by healthy nodes",
        failing.len(),
        latency_ms.0,
        latency_ms.1,
        took.as_secs_f64(),
        calls.len(),
        calls.len() as f64 / failing.len().max(1) as f64
    );
    assert!(
        tainted <= limit,
        "the budget was overrun: {tainted} > {limit}"
    );
    shutdown.cancel();
    let failed_runs = rt.block_on(async {
        let mut n = 0;
        for t in tasks {
            if !matches!(t.await, Ok(Ok(()))) {
                n += 1;
            }
        }
        n
    });
    println!("fleet-tasks: agents that ended with an error: {failed_runs}");
    drop(rt);
    drop(api);
}

fn main() {
    if let Some(kubeconfig) = std::env::var_os(SERVE_EMULATOR) {
        serve_emulator(Path::new(&kubeconfig));
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
        );
    }
}
