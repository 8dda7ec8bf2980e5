//! Peer checks without Kubernetes, as an operator sets them up: the credentials made with
//! `faultline keys` (the coordinator's key, the master, each node's own key), a members file,
//! a `faultline-coordinator` process and agents on loopback addresses.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Runs `faultline keys ...`; its stdout.
fn keys(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .arg("keys")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "faultline keys {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The pool's files.
pub struct Pool {
    pub dir: PathBuf,
    pub members: PathBuf,
    pub policy: PathBuf,
    /// The requesters' secret (`faultline check --secret-file`).
    pub requester: PathBuf,
    pub coordinator_key: PathBuf,
    pub public_key: String,
    pub master: PathBuf,
}

impl Pool {
    /// Credentials and files in `dir` for these members, with this policy.
    pub fn new(dir: &Path, members: &[(&str, SocketAddr)], policy: &str) -> Pool {
        let coordinator_key = dir.join("coordinator.key");
        let public_key = keys(&["coordinator", "--out", coordinator_key.to_str().unwrap()]);
        let master = dir.join("master");
        keys(&["master", "--out", master.to_str().unwrap()]);
        let file = dir.join("members");
        let lines: String = members.iter().map(|(n, a)| format!("{n} {a}\n")).collect();
        std::fs::write(&file, lines).unwrap();
        let policy_file = dir.join("policy.yaml");
        std::fs::write(&policy_file, policy).unwrap();
        let requester = dir.join("requester-secret");
        std::fs::write(&requester, "bare-metal-requester-secret-0123456789\n").unwrap();
        Pool {
            dir: dir.to_path_buf(),
            members: file,
            policy: policy_file,
            requester,
            coordinator_key,
            public_key,
            master,
        }
    }

    /// The flags of node `name`'s agent in these tests: its peer-check flags (`agent_args`),
    /// no NVML and no Ascend, running `probe` on probe ports from `port_base`.
    pub fn test_agent_args(
        &self,
        name: &str,
        listen: SocketAddr,
        probe: &Path,
        port_base: &str,
    ) -> Vec<String> {
        let mut args = self.agent_args(name, listen);
        args.extend(
            [
                "--node-name",
                name,
                "--no-nvml",
                "--no-ascend",
                "--probe-bin",
                probe.to_str().unwrap(),
                "--probe-port-base",
                port_base,
            ]
            .map(String::from),
        );
        args
    }

    /// The peer-check flags of node `name`'s agent, listening at `listen` (its node key made
    /// now, as an operator would for that node).
    pub fn agent_args(&self, name: &str, listen: SocketAddr) -> Vec<String> {
        let key = self.dir.join(format!("{name}.key"));
        if !key.exists() {
            keys(&[
                "node",
                "--master",
                self.master.to_str().unwrap(),
                "--node",
                name,
                "--out",
                key.to_str().unwrap(),
            ]);
        }
        vec![
            "--policy".into(),
            self.policy.display().to_string(),
            "--peer-node-key-file".into(),
            key.display().to_string(),
            "--peer-coordinator-key".into(),
            self.public_key.clone(),
            "--peer-listen".into(),
            listen.to_string(),
        ]
    }

    /// The coordinator, serving at `listen`, publishing to `<dir>/coordinator`; the agents'
    /// probes listen from `probe_port_base`.
    pub fn start_coordinator(&self, listen: SocketAddr, probe_port_base: &str) -> Coordinator {
        let dir = self.dir.join("coordinator");
        std::fs::create_dir_all(&dir).unwrap();
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_faultline-coordinator"))
            .arg("--name")
            .arg("coordinator")
            .arg("--members")
            .arg(&self.members)
            .arg("--key-file")
            .arg(&self.coordinator_key)
            .arg("--node-key-master-file")
            .arg(&self.master)
            .arg("--requester-secret-file")
            .arg(&self.requester)
            .arg("--policy")
            .arg(&self.policy)
            .arg("--state-dir")
            .arg(&dir)
            .args(["--peer-listen", &listen.to_string()])
            .args(["--listen", "127.0.0.1:0"])
            .args(["--probe-port-base", probe_port_base])
            .env("RUST_LOG", "info,faultline_agent=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        super::wait_until(
            "the coordinator to listen",
            std::time::Duration::from_secs(30),
            || std::net::TcpStream::connect(listen).ok(),
        );
        Coordinator {
            child,
            dir,
            address: listen,
        }
    }

    /// `faultline check` of these nodes, asking the coordinator at `at`.
    pub fn check(&self, at: SocketAddr, nodes: &str, timeout: &str) -> (i32, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_faultline"))
            .args(["check", "--nodes", nodes, "--timeout", timeout])
            .args(["--coordinator", &at.to_string()])
            .arg("--secret-file")
            .arg(&self.requester)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Pool {
    /// `faultline check --members`: a one-shot coordinator of these nodes in the CLI's own
    /// process, taking the reports at `report_listen`; the agents' probes listen from
    /// `probe_port_base`.
    pub fn check_one_shot(
        &self,
        report_listen: SocketAddr,
        probe_port_base: &str,
        nodes: &str,
        timeout: &str,
    ) -> (i32, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_faultline"))
            .args(["check", "--nodes", nodes, "--timeout", timeout])
            .arg("--members")
            .arg(&self.members)
            .arg("--coordinator-key-file")
            .arg(&self.coordinator_key)
            .arg("--node-key-master-file")
            .arg(&self.master)
            .arg("--policy")
            .arg(&self.policy)
            .args(["--report-listen", &report_listen.to_string()])
            .args(["--probe-port-base", probe_port_base])
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// A running coordinator (killed when dropped).
pub struct Coordinator {
    pub child: Child,
    pub dir: PathBuf,
    pub address: SocketAddr,
}

impl Coordinator {
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// The last run it published.
    pub fn published(&self) -> Option<faultline_coordinator::runs::RunState> {
        let text = std::fs::read_to_string(self.dir.join("peercheck.json")).ok()?;
        serde_json::from_str(&text).ok()
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
