//! Kubernetes-mode benchmarks against the API emulator (release build of the agent):
//!
//! - `latency`: an Xid line to the taint and the ConfigMap visible in the API server;
//! - `writes`: API writes per fault, and at steady state (nothing changing);
//! - `fleet`: many agents against one API server, all failing at once, under the taint budget.
//! - `fleet-tasks`: 1,000-2,000 agents as tasks of one process against an API server with a
//!   real server's write latency; a share of them failing at once.
//!
//! `cargo bench -p faultline-agent --bench kube -- [latency] [writes] [fleet] [fleet-tasks]
//!  [--events N] [--steady-secs S] [--agents N] [--fail-percent P] [--latency-min-ms A]
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

impl Cluster {
    fn new(nodes: &[String]) -> Cluster {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let emu = rt.block_on(Emulator::start()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        emu.write_kubeconfig(&kubeconfig, "bench").unwrap();
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}));
        for n in nodes {
            emu.put(faultline_kube_emulator::node(
                n,
                &[("kubernetes.io/hostname", n)],
            ));
        }
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

/// Many agents as tasks of this process (each its own state directory, kernel log, HTTP port
/// and Kubernetes clients, sharing nothing but the API server), against an emulator whose
/// writes take `latency_ms` (a real API server's 5-20 ms). When all have written their
/// ConfigMaps, `fail_percent` of the nodes get an Xid 79 at the same moment: how long until
/// each is labelled Unhealthy and tainted or withheld by the budget, how many are tainted
/// against the budget's limit, and the API requests per node.
fn fleet_tasks(agents: usize, fail_percent: usize, latency_ms: (u64, u64)) {
    use clap::Parser;
    // The agents' errors (RUST_LOG=error by default here) on stderr.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "error");
    }
    faultline_agent::cli::init_tracing("text");
    let files = faultline_agent::listen::raise_file_limit();
    let names: Vec<String> = (0..agents).map(|i| format!("node-{i:04}")).collect();
    let c = Cluster::new(&names);
    c.emu.set_write_latency(
        Duration::from_millis(latency_ms.0),
        Duration::from_millis(latency_ms.1),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let t_start = Instant::now();
    let mut dirs = Vec::new();
    let mut tasks = Vec::new();
    for n in &names {
        let dir = c.dir.path().join(n);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("kmsg"), b"").unwrap();
        std::fs::write(dir.join("boot_id"), b"boot-1\n").unwrap();
        let p = |x: &str| dir.join(x).to_str().unwrap().to_string();
        let argv = [
            "faultline-agent".to_string(),
            "--kubeconfig".into(),
            c.kubeconfig.to_str().unwrap().into(),
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
        let written = c
            .emu
            .list("", "configmaps", Some(NS))
            .iter()
            .filter(|cm| cm["metadata"]["labels"]["faultline.io/node"].is_string())
            .count();
        if written == agents {
            break t_start.elapsed();
        }
        assert!(
            t_start.elapsed() < Duration::from_secs(600),
            "only {written} of {agents} ConfigMaps after 600 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let start_calls = c.emu.calls().len();
    println!(
        "fleet-tasks: {agents} agents (open-file limit {files:?}, {} open) started and wrote their ConfigMaps in {:.1} s; {start_calls} API requests ({:.1} per node)",
        open_files(),
        up.as_secs_f64(),
        start_calls as f64 / agents as f64
    );
    std::thread::sleep(Duration::from_secs(2));
    c.emu.clear_calls();
    let failing: Vec<usize> = (0..agents)
        .filter(|i| i * 100 / agents < fail_percent)
        .collect();
    let t0 = Instant::now();
    for (k, i) in failing.iter().enumerate() {
        append(&dirs[*i], &xid(10 + k as u64, "3b", 79));
    }
    let settled = |c: &Cluster, n: &str| -> bool {
        c.record(n).is_some_and(|r| {
            r["health"] == "Unhealthy"
                && c.emu.get(&ResourceRef::node(n)).is_some_and(|node| {
                    node["metadata"]["labels"]["faultline.io/health"] == "Unhealthy"
                })
                && (c.tainted(n) || !r["agent"]["taintBudget"].is_null())
        })
    };
    let t_settle = Instant::now();
    loop {
        if failing.iter().all(|i| settled(&c, &names[*i])) {
            break;
        }
        if t_settle.elapsed() > Duration::from_secs(300) {
            let done = failing.iter().filter(|i| settled(&c, &names[**i])).count();
            let ended = tasks.iter().filter(|t| t.is_finished()).count();
            println!("fleet-tasks: {ended} agent tasks have ended");
            let errors = c.emu.calls().iter().filter(|x| x.status >= 400).count();
            panic!(
                "after 300 s only {done} of {} failing nodes are labelled and tainted or withheld; {errors} API errors; open files {}",
                failing.len(),
                open_files()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = t0.elapsed();
    let tainted = failing.iter().filter(|i| c.tainted(&names[**i])).count();
    let limit = (agents * 10 / 100).max(1);
    let calls = c.emu.calls();
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
    drop(c);
}

fn main() {
    let args = common::Args::from_env();
    let parts = ["latency", "writes", "fleet", "fleet-tasks"];
    if args.wants(&parts, "latency") {
        latency(args.flag("--events", 100) as usize);
    }
    if args.wants(&parts, "writes") {
        writes(args.flag("--steady-secs", 60));
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
