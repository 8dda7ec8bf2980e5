//! Bare-metal failover (members file, loopback): the first member coordinates; when it freezes
//! (SIGSTOP: its port still accepts connections, nothing answers), the next live member takes
//! over within about 15 s and `faultline check --members` finds it, instead of waiting on the
//! frozen one until `--timeout`. Before, the first member of the file coordinated for good.
//! And a node whose probe cannot run says so in its own record.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{cluster::probe_bin, Agent};
use faultline_agent::coordinator::runs::RunState;

fn free_on(ip: &str) -> SocketAddr {
    TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap()
}

fn signal(agent: &Agent, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &agent.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

fn check(members: &Path, secret: &Path, nodes: &str, timeout: &str) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(["check", "--nodes", nodes, "--timeout", timeout])
        .arg("--members")
        .arg(members)
        .arg("--secret-file")
        .arg(secret)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn published(agent: &Agent) -> Option<RunState> {
    let text = std::fs::read_to_string(agent.state().join("peercheck.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// Three members on loopback addresses: a temporary directory, the agents' secret, a policy
/// with scheduled runs off and small checks, the members file, and their peer addresses.
struct Pool {
    tmp: tempfile::TempDir,
    secret: PathBuf,
    policy: PathBuf,
    members: PathBuf,
    addrs: [SocketAddr; 3],
    probe: PathBuf,
    /// The first probe port of this test's agents (tests in one process must not share them).
    port_base: &'static str,
}

impl Pool {
    fn new(port_base: &'static str) -> Pool {
        let tmp = tempfile::tempdir().unwrap();
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, "failover-test-secret-0123456789abcdef0123\n").unwrap();
        let policy = tmp.path().join("policy.yaml");
        std::fs::write(
            &policy,
            "peer:\n  enabled: false\n  bytes: 1048576\n  iterations: 2\n  check_timeout: 10s\n",
        )
        .unwrap();
        let addrs = [
            free_on("127.0.0.1"),
            free_on("127.0.0.2"),
            free_on("127.0.0.3"),
        ];
        let members = tmp.path().join("members");
        std::fs::write(
            &members,
            format!(
                "node-a {}\nnode-b {}\nnode-c {}\n",
                addrs[0], addrs[1], addrs[2]
            ),
        )
        .unwrap();
        Pool {
            tmp,
            secret,
            policy,
            members,
            addrs,
            probe: probe_bin(),
            port_base,
        }
    }

    /// Member `i` (node-a, node-b, node-c), running `probe` (the real one when `None`).
    fn start(&self, i: usize, probe: Option<&Path>) -> Agent {
        let name = ["node-a", "node-b", "node-c"][i];
        let dir = self.tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let listen = self.addrs[i].to_string();
        Agent::start(
            &dir,
            &[
                "--node-name",
                name,
                "--no-nvml",
                "--no-ascend",
                "--policy",
                self.policy.to_str().unwrap(),
                "--peer-secret-file",
                self.secret.to_str().unwrap(),
                "--peer-members",
                self.members.to_str().unwrap(),
                "--peer-listen",
                &listen,
                "--probe-bin",
                probe.unwrap_or(&self.probe).to_str().unwrap(),
                "--probe-port-base",
                self.port_base,
            ],
        )
    }

    /// Each agent has written its record and listens on its peer port.
    fn wait_ready(&self, agents: [&Agent; 3]) {
        for (agent, addr) in agents.into_iter().zip(self.addrs) {
            agent.wait_for("start-up write", |_| true);
            common::wait_until("the peer port to listen", Duration::from_secs(30), || {
                std::net::TcpStream::connect(addr).ok()
            });
        }
    }

    fn check(&self, nodes: &str, timeout: &str) -> (i32, String, String) {
        check(&self.members, &self.secret, nodes, timeout)
    }
}

/// A node whose probe cannot run fails with every partner and is found faulty; its own record
/// names the cause (`PEER_PROBE_FAILED`, "cannot run /x/faultline-probe: …"), not
/// PEER_UNREACHABLE: its agent answered every call.
#[test]
fn a_probe_that_cannot_run_is_named_in_the_nodes_record() {
    let pool = Pool::new("31470");
    let a = pool.start(0, None);
    let b = pool.start(1, None);
    let c = pool.start(2, Some(Path::new("/x/faultline-probe")));
    pool.wait_ready([&a, &b, &c]);
    let (code, out, err) = pool.check("node-a,node-b,node-c", "60s");
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("faulty node   node-c"), "{out}");
    let r = c.wait_for("the cause in node-c's record", |r| {
        common::fault(r, "PEER_PROBE_FAILED").is_some()
    });
    let f = common::fault(&r, "PEER_PROBE_FAILED").unwrap();
    assert!(
        f.message.contains("cannot run /x/faultline-probe"),
        "{}",
        f.message
    );
    assert!(common::fault(&r, "PEER_UNREACHABLE").is_none());
    for agent in [a, b, c] {
        assert_eq!(agent.stop(), 0);
    }
}

#[test]
fn the_next_live_member_coordinates_when_the_first_freezes() {
    let pool = Pool::new("31370");
    let a = pool.start(0, None);
    let b = pool.start(1, None);
    let c = pool.start(2, None);
    pool.wait_ready([&a, &b, &c]);

    // The first member coordinates.
    let (code, out, err) = pool.check("node-b,node-c", "60s");
    assert_eq!(code, 0, "{out}\n{err}\n--- a:\n{}", a.log());
    assert_eq!(published(&a).unwrap().coordinator, "node-a");

    // Frozen: its port still accepts connections, and nothing answers.
    signal(&a, "-STOP");
    let asked = Instant::now();
    let (code, out, err) = pool.check("node-b,node-c", "90s");
    let took = asked.elapsed();
    assert_eq!(
        code,
        0,
        "{out}\n{err}\n--- b:\n{}\n--- c:\n{}",
        b.log(),
        c.log()
    );
    let run = published(&b).expect("node-b published the run");
    assert_eq!(run.coordinator, "node-b");
    assert!(run.is_finished());
    eprintln!("answered by node-b after {took:?}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert!(
        c.log().contains("peer-check coordinator (members file)"),
        "{}",
        c.log()
    );

    // Back: the first member takes the role again, and node-b lets it go.
    signal(&a, "-CONT");
    common::wait_until(
        "node-b to give the role back",
        Duration::from_secs(40),
        || b.log().contains("no longer coordinating").then_some(()),
    );
    let (code, out, err) = pool.check("node-b,node-c", "60s");
    assert_eq!(code, 0, "{out}\n{err}");
    let last = published(&a).unwrap();
    assert!(last.run_id != run.run_id && last.coordinator == "node-a");
    for agent in [a, b, c] {
        assert_eq!(agent.stop(), 0);
    }
}
