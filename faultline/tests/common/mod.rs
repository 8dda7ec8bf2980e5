//! Helpers for tests that run the real `faultline-agent` binary.

#![allow(dead_code)]

pub mod bare_metal;
pub mod cluster;
pub mod prometheus;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use faultline_core::record::NodeRecord;

/// Calls `f` until it returns a value; panics naming `what` after `limit`.
pub fn wait_until<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A kernel log record (sequence `seq`): Xid 79, "fallen off the bus", on PCI bus `bus`.
pub fn xid79(seq: u64, bus: &str) -> Vec<u8> {
    format!(
        "4,{seq},{},-;NVRM: Xid (PCI:0000:{bus}:00): 79, pid=1, name=a, GPU has fallen off the bus.\n",
        seq * 100
    )
    .into_bytes()
}

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// A running agent in its own temporary directory.
pub struct Agent {
    pub child: Child,
    pub dir: PathBuf,
    pub kmsg: PathBuf,
    pub boot_id: PathBuf,
}

pub struct Opts<'a> {
    pub extra: &'a [&'a str],
}

impl Agent {
    /// Starts the agent on `dir/kmsg` (created if missing) with boot id file `dir/boot_id`.
    pub fn start(dir: &Path, extra: &[&str]) -> Agent {
        Agent::start_env(dir, extra, &[])
    }

    /// Like `start`, with extra environment variables for the agent process.
    pub fn start_env(dir: &Path, extra: &[&str], env: &[(&str, &Path)]) -> Agent {
        Agent::spawn(dir, extra, env, &[])
    }

    /// Like `start`, under an open-file limit (soft and hard, so the agent cannot raise it).
    pub fn start_with_file_limit(dir: &Path, extra: &[&str], nofile: u64) -> Agent {
        // The shell execs the agent: same pid, so signals reach it.
        let ulimit = format!("ulimit -n {nofile} && exec \"$0\" \"$@\"");
        Agent::spawn(dir, extra, &[], &["sh", "-c", &ulimit])
    }

    /// Like `start`, run through `wrapper` (a program that execs the rest of its arguments, such
    /// as `setpriv`): same pid, so signals reach the agent.
    pub fn start_under(dir: &Path, extra: &[&str], wrapper: &[&str]) -> Agent {
        Agent::spawn(dir, extra, &[], wrapper)
    }

    fn spawn(dir: &Path, extra: &[&str], env: &[(&str, &Path)], wrapper: &[&str]) -> Agent {
        let kmsg = dir.join("kmsg");
        let boot_id = dir.join("boot_id");
        if !kmsg.exists() {
            std::fs::write(&kmsg, b"").unwrap();
        }
        if !boot_id.exists() {
            std::fs::write(&boot_id, b"boot-1\n").unwrap();
        }
        // The previous agent in this directory removed it on exit; make sure of it.
        let _ = std::fs::remove_file(dir.join("state").join("listen.addr"));
        let agent = env!("CARGO_BIN_EXE_faultline-agent");
        let mut cmd = match wrapper {
            [] => Command::new(agent),
            [program, args @ ..] => {
                let mut c = Command::new(program);
                c.args(args).arg(agent);
                c
            }
        };
        cmd.arg("--kmsg-path")
            .arg(&kmsg)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--boot-id-path")
            .arg(&boot_id)
            .args(["--listen", "127.0.0.1:0", "--follow-interval", "5ms"])
            .args(if extra.contains(&"--node-name") {
                &[][..]
            } else {
                &["--node-name", "node-a"][..]
            })
            .args(extra)
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("agent.log")).unwrap(),
            ));
        let child = cmd.spawn().expect("start faultline-agent");
        Agent {
            child,
            dir: dir.to_path_buf(),
            kmsg,
            boot_id,
        }
    }

    /// The state directory (`/run/faultline` on a node: the record; gone after a reboot).
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The data directory (`/var/lib/faultline` on a node: `state.json`; kept across a reboot).
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn record_path(&self) -> PathBuf {
        self.state().join("faults.json")
    }

    pub fn append(&self, bytes: &[u8]) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.kmsg)
            .unwrap();
        f.write_all(bytes).unwrap();
    }

    pub fn record(&self) -> Option<NodeRecord> {
        let bytes = std::fs::read(self.record_path()).ok()?;
        Some(serde_json::from_slice(&bytes).expect("the record is always whole, valid JSON"))
    }

    /// Waits until the record satisfies `f`; panics with the last record and the log if not.
    pub fn wait_for(&self, what: &str, f: impl Fn(&NodeRecord) -> bool) -> NodeRecord {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(r) = self.record() {
                if f(&r) {
                    return r;
                }
                if Instant::now() > deadline {
                    panic!(
                        "timed out waiting for {what}; record: {}\nlog:\n{}",
                        serde_json::to_string_pretty(&r).unwrap(),
                        self.log()
                    );
                }
            } else if Instant::now() > deadline {
                panic!(
                    "timed out waiting for {what}; no record; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    pub fn addr(&self) -> String {
        let p = self.state().join("listen.addr");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(s) = std::fs::read_to_string(&p) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "no listen.addr; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One HTTP GET on loopback; returns (status, body). A connection the server refused (it
    /// closes one over its connection cap at once, which resets it when the request was already
    /// sent) is status 0 with the error as the body, so a caller waiting for an answer can retry.
    pub fn get(&self, path: &str) -> (u16, String) {
        use std::io::Read;
        let mut s = std::net::TcpStream::connect(self.addr()).unwrap();
        let mut out = String::new();
        let sent = write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .and_then(|()| s.read_to_string(&mut out));
        if let Err(e) = sent {
            return (0, format!("connection failed: {e}"));
        }
        let status = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (status, body)
    }

    /// The value of a metric line (exact name with labels).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, body) = self.get("/metrics");
        body.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|v| v.strip_prefix(' '))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0.0)
    }

    /// SIGTERM and wait; returns the exit status code.
    pub fn stop(mut self) -> i32 {
        terminate(&self.child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code().unwrap_or(-1);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("agent did not stop on SIGTERM; log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a reboot does to the directories of an agent started on `dir` ([`Agent::start`]): a new
/// boot id, a kernel log that starts over with `kmsg`, and the state directory (`/run`) gone;
/// with `lose_data`, the data directory (`/var/lib`) is gone too (a lost disk).
pub fn reboot(dir: &Path, kmsg: &[u8], lose_data: bool) {
    std::fs::remove_dir_all(dir.join("state")).unwrap();
    if lose_data {
        std::fs::remove_dir_all(dir.join("data")).unwrap();
    }
    std::fs::write(dir.join("boot_id"), b"boot-2\n").unwrap();
    std::fs::write(dir.join("kmsg"), kmsg).unwrap();
}

/// Runs the `faultline` CLI against a state directory; returns (exit code, stdout, stderr).
pub fn cli(args: &[&str], state: &Path) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .output()
        .expect("run faultline");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Sends SIGTERM, as Kubernetes and systemd do.
pub fn terminate(child: &Child) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a live child has a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
}

pub fn fault<'a>(r: &'a NodeRecord, code: &str) -> Option<&'a faultline_core::record::Fault> {
    r.faults.iter().find(|f| f.fault_code == code)
}

/// An API emulator on loopback with the runtime that serves it (keep both alive).
pub fn emulator() -> (tokio::runtime::Runtime, faultline_kube_emulator::Emulator) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let emu = rt
        .block_on(faultline_kube_emulator::Emulator::start())
        .unwrap();
    (rt, emu)
}

/// Puts `node`'s agent pod into `namespace` (Running at `ip`: what the coordinator lists as a
/// member and counts for the taint budget) and authorizes `token` as that pod's projected
/// token for the coordinator's audience, naming the node as the API server does for a token
/// bound to a pod (`faultline_coordinator::tokens`).
pub fn agent_pod(
    emu: &faultline_kube_emulator::Emulator,
    namespace: &str,
    node: &str,
    ip: &str,
    token: &str,
) {
    use faultline_coordinator::tokens::{AGENT_AUDIENCE, NODE_NAME_EXTRA};
    emu.put(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("faultline-{node}"), "namespace": namespace,
                      "labels": {"app.kubernetes.io/name": "faultline",
                                 "app.kubernetes.io/component": "agent"}},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "faultline"}]},
        "status": {"phase": "Running", "podIP": ip},
    }));
    emu.authorize_for_audiences(
        token,
        faultline_kube_emulator::UserInfo {
            extra: [(NODE_NAME_EXTRA.to_string(), vec![node.to_string()])].into(),
            ..faultline_kube_emulator::UserInfo::service_account(namespace, "faultline")
        },
        vec![],
        &[AGENT_AUDIENCE],
    );
}

/// The RBAC rules a call table implies, with the agent in `agent_ns` (the manifests test
/// checks the Roles say the same). An agent authorized with exactly these gets 403 for any
/// call the tables do not list.
pub fn rules_for(
    tables: &[&[faultline_agent::sink::kube::calls::ApiCall]],
    agent_ns: &str,
) -> Vec<faultline_kube_emulator::Rule> {
    use faultline_agent::sink::kube::calls::Scope;
    tables
        .iter()
        .flat_map(|t| t.iter())
        .map(|c| faultline_kube_emulator::Rule {
            verbs: vec![c.verb.to_string()],
            api_groups: vec![c.group.to_string()],
            resources: vec![c.resource.to_string()],
            resource_names: c.names.iter().map(|n| n.to_string()).collect(),
            namespace: match c.scope {
                Scope::Cluster => None,
                Scope::AgentNamespace => Some(agent_ns.to_string()),
                Scope::Namespace(ns) => Some(ns.to_string()),
            },
        })
        .collect()
}

/// Runs `cmd` to its end in a process group of its own; panics, after killing the group, when
/// it is still running after `limit`: a guard against a hang, not a measure of how long it took.
/// Exit status, stdout, stderr.
pub fn run_guarded(cmd: &mut Command, limit: Duration) -> (Option<i32>, String, String) {
    use std::os::unix::process::CommandExt;
    let child = cmd
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let group = rustix::process::Pid::from_raw(child.id() as i32).expect("a live child has a pid");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(limit) {
        Ok(out) => out.expect("wait"),
        Err(_) => {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
            let out = rx.recv().expect("the waiter").expect("wait");
            panic!(
                "{cmd:?} still running after {limit:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
