//! A connection flood at the peer-check port of a bare-metal agent (members file, loopback):
//! the agent's connection guard keeps the port usable for its peers and the descriptors free
//! for its own work.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::Duration;

use common::{cluster::probe_bin, xid79, Agent};
use faultline_core::record::Health;

fn free_on(ip: &str) -> SocketAddr {
    TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap()
}

/// 1,100 idle connections at the coordinator's peer port, while that agent is held to 256 open
/// files (soft and hard): a check between the two agents still runs and passes, and a fault
/// that arrives during the flood is written. The flood comes from 127.0.0.9; the peers and the
/// CLI from other loopback addresses, as in a cluster where the flood is one misbehaving pod
/// (a flood from many addresses is kept off by the NetworkPolicy, docs/operations.md).
#[test]
fn a_flood_at_the_peer_port_does_not_stop_a_check_or_detection() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    // This test process needs room for its own end of the flood.
    if let Some(hard) = getrlimit(Resource::Nofile).maximum {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            },
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "flood-test-secret-0123456789abcdef0123456789\n").unwrap();
    // The CLI holds the requesters' secret only (issue 12 §5).
    let requester = tmp.path().join("requester-secret");
    std::fs::write(&requester, "flood-test-requester-secret-0123456789\n").unwrap();
    let policy = tmp.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "peer:\n  enabled: false\n  bytes: 1048576\n  iterations: 2\n  check_timeout: 10s\n",
    )
    .unwrap();
    let (a, b) = (free_on("127.0.0.1"), free_on("127.0.0.2"));
    let members = tmp.path().join("members");
    std::fs::write(&members, format!("node-a {a}\nnode-b {b}\n")).unwrap();
    let probe = probe_bin();
    let start = |name: &str, listen: SocketAddr, nofile: Option<u64>| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let listen = listen.to_string();
        let args = [
            "--node-name",
            name,
            "--no-nvml",
            "--no-ascend",
            "--policy",
            policy.to_str().unwrap(),
            "--peer-secret-file",
            secret.to_str().unwrap(),
            "--peer-requester-secret-file",
            requester.to_str().unwrap(),
            "--peer-members",
            members.to_str().unwrap(),
            "--peer-listen",
            &listen,
            "--probe-bin",
            probe.to_str().unwrap(),
            "--probe-port-base",
            "31270",
        ];
        match nofile {
            Some(n) => Agent::start_with_file_limit(&dir, &args, n),
            None => Agent::start(&dir, &args),
        }
    };
    let coordinator = start("node-a", a, Some(256));
    let other = start("node-b", b, None);
    for agent in [&coordinator, &other] {
        agent.wait_for("start-up write", |_| true);
    }
    common::wait_until("the peer port to listen", Duration::from_secs(30), || {
        std::net::TcpStream::connect(a).ok()
    });

    let flood = connect_from("127.0.0.9", a, 1100);
    assert!(flood.len() >= 1000, "the flood connected: {}", flood.len());

    coordinator.append(&xid79(1, "3b"));
    let out = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(["check", "--nodes", "node-a,node-b", "--timeout", "60s"])
        .args(["--coordinator", &a.to_string()])
        .arg("--secret-file")
        .arg(&requester)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "the check passes during the flood\n{stdout}\n{stderr}\n--- coordinator:\n{}",
        coordinator.log()
    );
    assert!(
        stdout.contains("no faulty node, broken or degraded link, or straggler"),
        "{stdout}"
    );
    let r = coordinator.wait_for("the fault written during the flood", |r| {
        r.health == Health::Unhealthy
    });
    assert!(common::fault(&r, "Xid79").is_some());
    assert!(
        !coordinator.log().contains("Too many open files"),
        "{}",
        coordinator.log()
    );
    drop(flood);
    common::wait_until(
        "the refusals to be counted",
        Duration::from_secs(40),
        || {
            (coordinator.metric("faultline_connections_refused_total{server=\"peer\"}") > 0.0)
                .then_some(())
        },
    );
    assert_eq!(coordinator.stop(), 0);
    assert_eq!(other.stop(), 0);
}

/// `n` TCP connections to `to` from the loopback address `from` (those that connect).
fn connect_from(from: &str, to: SocketAddr, n: usize) -> Vec<std::net::TcpStream> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let from: SocketAddr = format!("{from}:0").parse().unwrap();
    rt.block_on(async {
        let mut out = Vec::new();
        for _ in 0..n {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(from).unwrap();
            if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(2), s.connect(to)).await {
                out.push(c.into_std().unwrap());
            }
        }
        out
    })
}
