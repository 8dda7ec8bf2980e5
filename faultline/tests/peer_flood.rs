//! A connection flood at the peer-check port of a bare-metal agent (a coordinator from a members
//! file, loopback): the agent's connection guard keeps the port usable for the coordinator and
//! its peers and the descriptors free for its own work.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use common::{cluster::probe_bin, xid79, Agent};
use faultline_core::record::Health;

fn free_on(ip: &str) -> SocketAddr {
    TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap()
}

/// 1,100 idle connections at an agent's peer port, while that agent is held to 256 open
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
    let (a, b) = (free_on("127.0.0.1"), free_on("127.0.0.2"));
    let pool = common::bare_metal::Pool::new(
        tmp.path(),
        &[("node-a", a), ("node-b", b)],
        "peer:\n  enabled: false\n  bytes: 1048576\n  iterations: 2\n  check_timeout: 10s\n",
    );
    let probe = probe_bin();
    let start = |name: &str, listen: SocketAddr, nofile: Option<u64>| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let args = pool.test_agent_args(name, listen, &probe, "31270");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        match nofile {
            Some(n) => Agent::start_with_file_limit(&dir, &args, n),
            None => Agent::start(&dir, &args),
        }
    };
    let flooded = start("node-a", a, Some(256));
    let other = start("node-b", b, None);
    let coordinator = pool.start_coordinator(free_on("127.0.0.5"), "31270");
    for agent in [&flooded, &other] {
        agent.wait_for("start-up write", |_| true);
    }
    common::wait_until("the peer port to listen", Duration::from_secs(30), || {
        std::net::TcpStream::connect(a).ok()
    });

    let flood = connect_from("127.0.0.9", a, 1100);
    assert!(flood.len() >= 1000, "the flood connected: {}", flood.len());

    flooded.append(&xid79(1, "3b"));
    let (code, stdout, stderr) = pool.check(coordinator.address, "node-a,node-b", "60s");
    assert_eq!(
        code,
        0,
        "the check passes during the flood\n{stdout}\n{stderr}\n--- node-a:\n{}\n--- coordinator:\n{}",
        flooded.log(),
        coordinator.log()
    );
    assert!(
        stdout.contains("no faulty node, broken or degraded link, or straggler"),
        "{stdout}"
    );
    let r = flooded.wait_for("the fault written during the flood", |r| {
        r.health == Health::Unhealthy
    });
    assert!(common::fault(&r, "Xid79").is_some());
    assert!(
        !flooded.log().contains("Too many open files"),
        "{}",
        flooded.log()
    );
    drop(flood);
    common::wait_until(
        "the refusals to be counted",
        Duration::from_secs(40),
        || {
            (flooded.metric("faultline_connections_refused_total{server=\"peer\"}") > 0.0)
                .then_some(())
        },
    );
    assert_eq!(flooded.stop(), 0);
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
