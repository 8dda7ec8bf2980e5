//! A cluster of real agents for the peer-check end-to-end test and bench: each agent in its own
//! network namespace on a bridge (tests/netlab), the API emulator on the bridge's host address,
//! the agents authorized for exactly the calls in `sink::kube::calls::API_CALLS`, each with its
//! own pod-bound peer token (audience `faultline-peer`, its node in the token's `extra`), one
//! Pod object per agent (what the coordinator lists), the real probe; and two coordinator
//! replicas (`faultline-coordinator`) on the host address, authorized for exactly
//! `COORDINATOR_API_CALLS`, one active by the Lease. Needs root.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use faultline_agent::sink::kube::calls::{API_CALLS, COORDINATOR_API_CALLS};
use faultline_coordinator::runs::RunState;
use faultline_core::record::NodeRecord;
use faultline_kube_emulator::{Emulator, ResourceRef, UserInfo};
use faultline_netlab::Lab;
use serde_json::json;

pub const NS: &str = "faultline-system";
pub const TOKEN: &str = "agent-token";
pub const COORDINATOR_TOKEN: &str = "coordinator-token";
/// The requesters' secret (`faultline check --secret-file`).
pub const SECRET: &str = "e2e peer-check secret, 32 bytes!";
/// The coordinator replicas.
pub const REPLICAS: usize = 2;

/// Node `name`'s agent's pod-bound peer token.
pub fn peer_token(name: &str) -> String {
    format!("peer-token-of-{name}-0123456789")
}

pub fn probe_bin() -> PathBuf {
    let agent = Path::new(env!("CARGO_BIN_EXE_faultline-agent"));
    // Built like the agent (debug for tests, release for benches), next to it.
    let release = agent.parent().is_some_and(|d| d.ends_with("release"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--quiet", "-p", "faultline-probe"]);
    if release {
        cmd.arg("--release");
    }
    assert!(
        cmd.status().unwrap().success(),
        "cannot build faultline-probe"
    );
    agent.parent().unwrap().join("faultline-probe")
}

pub struct Node {
    pub name: String,
    pub dir: PathBuf,
    pub child: Option<Child>,
}

impl Node {
    pub fn record(&self) -> Option<NodeRecord> {
        let text = std::fs::read_to_string(self.dir.join("state/faults.json")).ok()?;
        serde_json::from_str(&text).ok()
    }
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

pub struct KeepOnPanic(Option<tempfile::TempDir>);

impl KeepOnPanic {
    pub fn path(&self) -> &Path {
        self.0
            .as_ref()
            .map(|t| t.path())
            .unwrap_or(Path::new("/nonexistent"))
    }
}

impl Drop for KeepOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(t) = self.0.take() {
                eprintln!("agent logs kept in {}", t.keep().display());
            }
        }
    }
}

pub use super::wait_until;

pub fn lease_holder(emu: &Emulator) -> Option<String> {
    let l = emu.get(&ResourceRef::lease(NS, "faultline-peercheck"))?;
    let h = l["spec"]["holderIdentity"].as_str()?.to_string();
    (!h.is_empty()).then_some(h)
}

pub fn published(emu: &Emulator) -> Option<RunState> {
    published_key(emu, "run.json")
}

/// `run.json`: the current or last run; `finished.json`: the last finished one.
pub fn published_key(emu: &Emulator, key: &str) -> Option<RunState> {
    let cm = emu.get(&ResourceRef::config_map(NS, "faultline-peercheck"))?;
    serde_json::from_str(cm["data"][key].as_str()?).ok()
}

/// `faultline check` from the host namespace (outside the lab), finding the coordinator through the Lease.
pub fn check(kubeconfig: &Path, secret: &Path, nodes: &[String]) -> (i32, String, String) {
    check_with(kubeconfig, secret, nodes, &[])
}

/// `check` with more arguments.
pub fn check_with(
    kubeconfig: &Path,
    secret: &Path,
    nodes: &[String],
    extra: &[&str],
) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(["check", "--nodes", &nodes.join(","), "--timeout", "90s"])
        .arg("--secret-file")
        .arg(secret)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--namespace", NS])
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The verdict lines of `faultline check`'s table output, sorted.
pub fn verdict_lines(stdout: &str) -> Vec<String> {
    let mut v: Vec<String> = stdout
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    v.sort();
    v
}

pub fn rounds_of(stdout: &str) -> usize {
    stdout
        .lines()
        .next()
        .and_then(|l| l.split(": ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(usize::MAX)
}

pub fn has_fault(r: &NodeRecord, code: &str, device: &str) -> bool {
    r.faults
        .iter()
        .any(|f| f.active && f.fault_code == code && f.device == device)
}

/// A running cluster; everything is stopped and removed on drop (logs kept if a test failed).
pub struct Cluster {
    pub nodes: Vec<Node>,
    /// The coordinator replicas.
    pub coordinators: Vec<Node>,
    pub names: Vec<String>,
    pub emu: Emulator,
    pub lab: Lab,
    pub cli_kubeconfig: PathBuf,
    pub secret: PathBuf,
    pub tmp: KeepOnPanic,
    _rt: tokio::runtime::Runtime,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in self.nodes.iter_mut().chain(self.coordinators.iter_mut()) {
            n.kill();
        }
    }
}

impl Cluster {
    /// `n` agents with this policy; `probe_for(i)` may give node i another probe binary.
    pub fn start(
        tag: &str,
        n: usize,
        policy: &str,
        probe_for: impl Fn(usize) -> Option<PathBuf>,
    ) -> Cluster {
        Cluster::start_in(tag, n, policy, probe_for, |_| None)
    }

    /// [`Cluster::start`], with node i's agent started inside the cgroup whose `cgroup.procs`
    /// file `cgroup_procs(i)` names (if any): its process is moved there before it runs the
    /// agent, so everything the agent allocates, and every probe it forks, is charged there.
    pub fn start_in(
        tag: &str,
        n: usize,
        policy: &str,
        probe_for: impl Fn(usize) -> Option<PathBuf>,
        cgroup_procs: impl Fn(usize) -> Option<PathBuf>,
    ) -> Cluster {
        if let Err(why) = Lab::check_available() {
            panic!("this test needs network namespaces: {why}");
        }
        let lab = Lab::new(tag, n).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let emu = rt
            .block_on(Emulator::start_on(SocketAddr::new(lab.host_ip().into(), 0)))
            .unwrap();
        emu.authorize(
            TOKEN,
            UserInfo {
                username: format!("system:serviceaccount:{NS}:faultline"),
                groups: vec!["system:serviceaccounts".into()],
                extra: Default::default(),
            },
            super::rules_for(&[API_CALLS], NS),
        );
        emu.authorize(
            COORDINATOR_TOKEN,
            UserInfo::service_account(NS, "faultline-coordinator"),
            super::rules_for(&[COORDINATOR_API_CALLS], NS),
        );
        // The CLI runs as a job's service account: it may read the Lease, nothing else.
        emu.authorize(
            "cli-token",
            UserInfo {
                username: "system:serviceaccount:default:job".into(),
                groups: vec!["system:serviceaccounts".into()],
                extra: Default::default(),
            },
            vec![faultline_kube_emulator::Rule {
                verbs: vec!["get".into()],
                api_groups: vec!["coordination.k8s.io".into()],
                resources: vec!["leases".into()],
                resource_names: vec![],
                namespace: Some(NS.into()),
            }],
        );
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}));
        // Kept when the test fails (its path is printed), for the agents' logs.
        let tmp = tempfile::Builder::new()
            .prefix("peer-netns-")
            .tempdir()
            .unwrap();
        let tmp = KeepOnPanic(Some(tmp));
        let kubeconfig = tmp.path().join("kubeconfig");
        emu.write_kubeconfig(&kubeconfig, TOKEN).unwrap();
        let coordinator_kubeconfig = tmp.path().join("coordinator-kubeconfig");
        emu.write_kubeconfig(&coordinator_kubeconfig, COORDINATOR_TOKEN)
            .unwrap();
        let cli_kubeconfig = tmp.path().join("cli-kubeconfig");
        emu.write_kubeconfig(&cli_kubeconfig, "cli-token").unwrap();
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        let policy_file = tmp.path().join("policy.yaml");
        std::fs::write(&policy_file, policy).unwrap();
        let probe = probe_bin();
        let names: Vec<String> = (0..n).map(|i| format!("n{i}")).collect();
        let mut nodes: Vec<Node> = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let ip = lab.nodes()[i].ip;
            emu.put(faultline_kube_emulator::node(name, &[]));
            // Its pod, and its pod-bound token for the coordinator, as the kubelet projects it.
            super::agent_pod(&emu, NS, name, &ip.to_string(), &peer_token(name));
            let dir = tmp.path().join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("boot_id"), "boot-1\n").unwrap();
            std::fs::write(dir.join("peer-token"), format!("{}\n", peer_token(name))).unwrap();
            let log = std::fs::File::create(dir.join("agent.log")).unwrap();
            let procs = cgroup_procs(i);
            // In a cgroup: a shell waits on its stdin until the test has moved it (the same
            // process: `ip netns exec` and `sh` exec, they do not fork), then execs the agent.
            // Moved from here, outside `ip netns exec`'s own mount of /sys.
            let mut cmd = match procs {
                None => lab.command(i, env!("CARGO_BIN_EXE_faultline-agent")),
                Some(_) => {
                    let mut c = lab.command(i, "sh");
                    c.args(["-c", "read -r _ && exec \"$@\"", "sh"])
                        .arg(env!("CARGO_BIN_EXE_faultline-agent"))
                        .stdin(Stdio::piped());
                    c
                }
            };
            let mut child = cmd
                .args(["--node-name", name, "--no-kmsg", "--no-nvml", "--no-ascend"])
                .arg("--state-dir")
                .arg(dir.join("state"))
                .arg("--data-dir")
                .arg(dir.join("data"))
                .arg("--boot-id-path")
                .arg(dir.join("boot_id"))
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .arg("--policy")
                .arg(&policy_file)
                .arg("--node-token-file")
                .arg(dir.join("peer-token"))
                .arg("--probe-bin")
                .arg(probe_for(i).unwrap_or_else(|| probe.clone()))
                .args(["--listen", "127.0.0.1:0", "--settle", "0s"])
                .env("RUST_LOG", "info,faultline_agent=debug")
                .stdout(Stdio::null())
                .stderr(Stdio::from(log))
                .spawn()
                .unwrap();
            if let Some(procs) = procs {
                std::fs::write(&procs, child.id().to_string()).unwrap_or_else(|e| {
                    panic!("move {name}'s agent into {}: {e}", procs.display())
                });
                let mut gate = child.stdin.take().unwrap();
                std::io::Write::write_all(&mut gate, b"go\n").unwrap();
            }
            nodes.push(Node {
                name: name.clone(),
                dir,
                child: Some(child),
            });
        }
        let coordinators = (0..REPLICAS)
            .map(|i| {
                // As long as a Deployment's pod names get: the Lease's field manager must stay
                // under the API server's 128 characters although the holder identity (name,
                // address, key) does not.
                let name = format!("faultline-coordinator-6c9f8d7b5d-replica-x{i}q7z");
                let dir = tmp.path().join(&name);
                std::fs::create_dir_all(&dir).unwrap();
                let log = std::fs::File::create(dir.join("agent.log")).unwrap();
                let at = SocketAddr::new(
                    lab.host_ip().into(),
                    std::net::TcpListener::bind((lab.host_ip(), 0))
                        .unwrap()
                        .local_addr()
                        .unwrap()
                        .port(),
                );
                let child = Command::new(env!("CARGO_BIN_EXE_faultline-coordinator"))
                    .args(["--name", &name, "--namespace", NS])
                    .arg("--kubeconfig")
                    .arg(&coordinator_kubeconfig)
                    .arg("--policy")
                    .arg(&policy_file)
                    .arg("--requester-secret-file")
                    .arg(&secret)
                    .args(["--peer-listen", &at.to_string()])
                    .args(["--listen", "127.0.0.1:0"])
                    .env("RUST_LOG", "info,faultline_agent=debug")
                    .stdout(Stdio::null())
                    .stderr(Stdio::from(log))
                    .spawn()
                    .unwrap();
                Node {
                    name,
                    dir,
                    child: Some(child),
                }
            })
            .collect();
        let cluster = Cluster {
            nodes,
            coordinators,
            names,
            emu,
            lab,
            cli_kubeconfig,
            secret,
            tmp,
            _rt: rt,
        };
        wait_until("a coordinator", Duration::from_secs(30), || {
            lease_holder(&cluster.emu)
        });
        wait_until("every agent's record", Duration::from_secs(30), || {
            cluster
                .nodes
                .iter()
                .all(|n| n.record().is_some())
                .then_some(())
        });
        cluster
    }

    /// The index of the coordinator replica holding the Lease.
    pub fn coordinator(&self) -> usize {
        let holder = wait_until("a coordinator", Duration::from_secs(30), || {
            lease_holder(&self.emu)
        });
        self.coordinators
            .iter()
            .position(|c| holder.starts_with(&format!("{}@", c.name)))
            .unwrap()
    }
}
