//! Peer checks without Kubernetes, end to end on loopback: a `faultline-coordinator` from a
//! members file, three agents, credentials made with `faultline keys`. A node whose probe
//! cannot run says so in its own record; and a member holding every credential an agent holds
//! (its own node key, the coordinator's public key) and the requesters' secret cannot speak for
//! the coordinator or for another node (issue 28: with the key every agent held, a forged
//! conclusion made a healthy node Degraded, four spoofed assignments filled a node's check
//! slots, and forged failure reports got a healthy node named faulty).

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::Duration;

use common::bare_metal::{Coordinator, Pool};
use common::{cluster::probe_bin, Agent};
use faultline_proto::v1::{
    peer_check_client::PeerCheckClient, verdict::Kind, CheckAssignment, CheckReport, Member,
    RunConclusion, Verdict,
};

fn free_on(ip: &str) -> SocketAddr {
    TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap()
}

const NAMES: [&str; 3] = ["node-a", "node-b", "node-c"];

/// The coordinator at 127.0.0.9 and three members at 127.0.0.1-3.
struct Setup {
    tmp: tempfile::TempDir,
    pool: Pool,
    addrs: [SocketAddr; 3],
    coordinator: Coordinator,
    /// The first probe port of this test's agents (tests in one process must not share them).
    port_base: &'static str,
}

impl Setup {
    fn new(port_base: &'static str) -> Setup {
        let tmp = tempfile::tempdir().unwrap();
        let addrs = [
            free_on("127.0.0.1"),
            free_on("127.0.0.2"),
            free_on("127.0.0.3"),
        ];
        let members: Vec<(&str, SocketAddr)> = NAMES.iter().copied().zip(addrs).collect();
        let pool = Pool::new(
            tmp.path(),
            &members,
            "peer:\n  enabled: false\n  bytes: 1048576\n  iterations: 2\n  check_timeout: 10s\n",
        );
        let coordinator = pool.start_coordinator(free_on("127.0.0.9"), port_base);
        Setup {
            tmp,
            pool,
            addrs,
            coordinator,
            port_base,
        }
    }

    /// Member `i`, running `probe` (the real one when `None`).
    fn start(&self, i: usize, probe: Option<&Path>) -> Agent {
        let dir = self.tmp.path().join(NAMES[i]);
        std::fs::create_dir_all(&dir).unwrap();
        let probe = probe.map_or_else(probe_bin, Path::to_path_buf);
        let args = self
            .pool
            .test_agent_args(NAMES[i], self.addrs[i], &probe, self.port_base);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Agent::start(&dir, &args)
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
        self.pool.check(self.coordinator.address, nodes, timeout)
    }
}

/// A node whose probe cannot run fails with every partner and is found faulty; its own record
/// names the cause (`PEER_PROBE_FAILED`, "cannot run /x/faultline-probe: …"), not
/// PEER_UNREACHABLE: its agent answered every call.
#[test]
fn a_probe_that_cannot_run_is_named_in_the_nodes_record() {
    let s = Setup::new("31470");
    let a = s.start(0, None);
    let b = s.start(1, None);
    let c = s.start(2, Some(Path::new("/x/faultline-probe")));
    s.wait_ready([&a, &b, &c]);
    let (code, out, err) = s.check("node-a,node-b,node-c", "60s");
    assert_eq!(code, 1, "{out}\n{err}\n{}", s.coordinator.log());
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
    assert_eq!(
        s.coordinator.published().unwrap().coordinator,
        "coordinator"
    );
    for agent in [a, b, c] {
        assert_eq!(agent.stop(), 0);
    }
}

/// Issue 28: without a coordinator service, `faultline check --members FILE` runs the check
/// from its own process, with the coordinator's key and the nodes' master: the same rounds and
/// verdicts (node-c's probe cannot run: it is found faulty), concluded to the members (node-c's
/// record names the cause), and nothing published. With the coordinator stopped, the same
/// check through `--coordinator` gets no run at all.
#[test]
fn a_one_shot_check_runs_without_a_coordinator_service() {
    let mut s = Setup::new("31570");
    let _ = s.coordinator.child.kill();
    let _ = s.coordinator.child.wait();
    let a = s.start(0, None);
    let b = s.start(1, None);
    let c = s.start(2, Some(Path::new("/x/faultline-probe")));
    s.wait_ready([&a, &b, &c]);
    let (code, _, err) = s.check("node-a,node-b", "3s");
    assert_eq!(code, 2, "no coordinator, no run: {err}");
    let (code, out, err) = s.pool.check_one_shot(
        free_on("127.0.0.9"),
        s.port_base,
        "node-a,node-b,node-c",
        "60s",
    );
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("faulty node   node-c"), "{out}");
    let r = c.wait_for("the conclusion in node-c's record", |r| {
        common::fault(r, "PEER_PROBE_FAILED").is_some()
    });
    assert!(common::fault(&r, "PEER_UNREACHABLE").is_none());
    assert!(
        s.coordinator.published().is_none(),
        "a one-shot run publishes nothing"
    );
    // Without the coordinator's key no check runs: the agents obey only messages it signed.
    let other = s.tmp.path().join("not-the-coordinator.key");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(["keys", "coordinator", "--out"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(status.status.success());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(["check", "--nodes", "node-a,node-b", "--timeout", "60s"])
        .arg("--members")
        .arg(&s.pool.members)
        .arg("--coordinator-key-file")
        .arg(&other)
        .arg("--node-key-master-file")
        .arg(&s.pool.master)
        .args(["--report-listen", &free_on("127.0.0.9").to_string()])
        .args(["--probe-port-base", s.port_base])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{text}");
    assert!(text.contains("unknown       node-a"), "{text}");
    for agent in [a, b, c] {
        assert_eq!(agent.stop(), 0);
    }
}

/// What node-b holds, as a file an attacker on node-b can read: its own node key.
fn node_b_key(s: &Setup) -> faultline_proto::auth::Key {
    let text = std::fs::read_to_string(s.tmp.path().join("node-b.key")).unwrap();
    faultline_proto::auth::Key::new(&hex::decode(text.trim()).unwrap()).unwrap()
}

fn wire(name: &str, at: SocketAddr) -> Option<Member> {
    Some(Member {
        node: name.into(),
        address: at.to_string(),
        topology: String::new(),
    })
}

/// Issue 28's forgeries, by a member (node-b) holding every credential an agent holds and the
/// requesters' secret, against the real processes: a conclusion naming node-a faulty signed as
/// the coordinator, and four assignments for node-a signed as the coordinator, are refused;
/// during a real run (the probes held 4 s so that the run can be read first), failure reports
/// about node-a for the checks that wait for node-a's (as node-a, and as itself for node-a)
/// are refused; the run passes, and node-a's record stays free of peer faults. (Before, with
/// the key every agent held, each of these was accepted.)
#[test]
fn a_member_with_every_agent_credential_forges_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let s = Setup::new("31570");
    let slow = s.tmp.path().join("slow-probe");
    std::fs::write(
        &slow,
        format!(
            "#!/bin/sh\nsleep 4\nexec '{}' \"$@\"\n",
            probe_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&slow, std::fs::Permissions::from_mode(0o755)).unwrap();
    let a = s.start(0, Some(&slow));
    let b = s.start(1, Some(&slow));
    let c = s.start(2, Some(&slow));
    s.wait_ready([&a, &b, &c]);
    let keys = [
        node_b_key(&s),
        faultline_agent::peer::wire::load_key(&s.pool.requester).unwrap(),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut to_a = PeerCheckClient::connect(format!("http://{}", s.addrs[0]))
            .await
            .unwrap();
        for key in &keys {
            let as_coordinator = faultline_agent::peer::wire::Signer {
                key: key.clone(),
                sender: "coordinator".into(),
            };
            let conclusion = RunConclusion {
                auth: None,
                protocol: faultline_proto::PROTOCOL,
                run_id: "forged".into(),
                members: NAMES.iter().map(|n| n.to_string()).collect(),
                verdicts: vec![Verdict {
                    kind: Kind::FaultyNode as i32,
                    nodes: vec!["node-a".into()],
                    slowdown: 0.0,
                    reason: String::new(),
                }],
            };
            let e = to_a
                .conclude(as_coordinator.sign(conclusion, "node-a"))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
            for i in 0..4 {
                let assignment = CheckAssignment {
                    protocol: faultline_proto::PROTOCOL,
                    run_id: format!("spoof-{i}"),
                    round: 1,
                    a: wire("node-a", s.addrs[0]),
                    b: wire("node-b", s.addrs[1]),
                    probe_a: "127.0.0.1:31570".into(),
                    probe_b: "127.0.0.2:31571".into(),
                    bytes: 1 << 20,
                    iterations: 1000,
                    timeout_ms: 600_000,
                    coordinator: s.addrs[1].to_string(),
                    ..Default::default()
                };
                let e = to_a
                    .assign(as_coordinator.sign(assignment, "node-a"))
                    .await
                    .unwrap_err();
                assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
            }
        }
    });
    // A real run; once its first round is out, forged reports about node-a.
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args([
            "check",
            "--nodes",
            "node-a,node-b,node-c",
            "--timeout",
            "90s",
        ])
        .args(["--coordinator", &s.coordinator.address.to_string()])
        .arg("--secret-file")
        .arg(&s.pool.requester)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let run = common::wait_until("the run's first round", Duration::from_secs(30), || {
        s.coordinator
            .published()
            .filter(|r| !r.is_finished() && r.rounds.first().is_some_and(|x| !x.checks.is_empty()))
    });
    let partners: Vec<String> = run.rounds[0]
        .checks
        .iter()
        .filter_map(|k| match (k.a.as_str(), k.b.as_str()) {
            ("node-a", p) | (p, "node-a") => Some(p.to_string()),
            _ => None,
        })
        .collect();
    assert!(!partners.is_empty(), "{run:?}");
    rt.block_on(async {
        let mut to_coordinator =
            faultline_proto::v1::coordinator_client::CoordinatorClient::connect(format!(
                "http://{}",
                s.coordinator.address
            ))
            .await
            .unwrap();
        for partner in &partners {
            for (sender, want) in [
                ("node-a", tonic::Code::Unauthenticated),
                ("node-b", tonic::Code::PermissionDenied),
            ] {
                let report = CheckReport {
                    protocol: faultline_proto::PROTOCOL,
                    run_id: run.run_id.clone(),
                    round: 1,
                    node: "node-a".into(),
                    partner: partner.clone(),
                    passed: false,
                    error: "connection refused".into(),
                    ..Default::default()
                };
                let signer = faultline_agent::peer::wire::Signer {
                    key: keys[0].clone(),
                    sender: sender.into(),
                };
                let e = to_coordinator
                    .report(signer.sign(report, "coordinator"))
                    .await
                    .unwrap_err();
                assert_eq!(e.code(), want, "as {sender}: {e:?}");
            }
        }
    });
    let out = check.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.coordinator.log()
    );
    let r = a.record().unwrap();
    assert!(
        !r.faults
            .iter()
            .any(|f| f.active && f.source == faultline_core::record::Source::Peer),
        "{:?}",
        r.faults
    );
    for agent in [a, b, c] {
        assert_eq!(agent.stop(), 0);
    }
}
