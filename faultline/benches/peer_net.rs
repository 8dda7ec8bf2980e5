//! Peer checks end to end on a network-namespace cluster (tests/common/cluster.rs: eight real
//! agents, release builds, each in its own namespace on a bridge, the API emulator), timed from
//! `faultline check` starting to its verdict printed:
//!
//! - `healthy`: a healthy 8-node run with the default 64 MiB x 5 TCP allgather (goal: < 3 s);
//! - `hang`: one node's probe hangs (the probe is replaced by one that sleeps, as a GPU stuck in
//!   a kernel would), deadline 10 s: time to the verdict naming it (goal: < deadline + 2 s);
//! - `stopped`: one node's whole agent is frozen (SIGSTOP): time to the verdict.
//!
//! `cargo bench -p faultline --bench peer_net -- [--runs N]` (root: network namespaces);
//! docs/benchmarks.md has the figures.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "../tests/common/mod.rs"]
mod tcommon;

use std::time::{Duration, Instant};

use tcommon::cluster::{check, verdict_lines, Cluster};

/// The median (the upper middle one for an even count), as the other benches quote it.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    common::quantile(&v, 0.5)
}

fn timed_check(c: &Cluster) -> (f64, i32, String) {
    let t = Instant::now();
    let (code, out, err) = check(&c.cli_kubeconfig, &c.secret, &c.names);
    let secs = t.elapsed().as_secs_f64();
    assert!(code == 0 || code == 1, "faultline check failed: {err}");
    (secs, code, out)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(5);
    let flag_dir = tempfile::tempdir().unwrap();
    let flag = flag_dir.path().join("hang");
    let real = tcommon::cluster::probe_bin();
    // Node 7's probe: the real one, or a hang while the flag file exists.
    let hanging = flag_dir.path().join("probe-that-may-hang");
    std::fs::write(
        &hanging,
        format!(
            "#!/bin/sh\nif [ -e {} ]; then exec sleep 1000; fi\nexec {} \"$@\"\n",
            flag.display(),
            real.display()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hanging, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let policy =
        "peer:\n  enabled: false\n  bytes: 67108864\n  iterations: 5\n  check_timeout: 10s\n";
    let c = Cluster::start("bench", 8, policy, |i| (i == 7).then(|| hanging.clone()));
    println!("cluster: 8 agents (release), 64 MiB x 5 TCP allgather per check, deadline 10 s");

    // Healthy round trips.
    let _ = timed_check(&c); // warm-up: connections, page cache
    let mut healthy = Vec::new();
    for _ in 0..runs {
        let (s, code, out) = timed_check(&c);
        assert_eq!(code, 0, "{out}");
        healthy.push(s);
    }
    println!(
        "healthy: request to verdict, median {:.2} s of {runs} (min {:.2}, max {:.2})",
        median(healthy.clone()),
        healthy.iter().cloned().fold(f64::MAX, f64::min),
        healthy.iter().cloned().fold(0.0, f64::max),
    );

    // A hung probe on node 7.
    std::fs::write(&flag, b"").unwrap();
    let mut hang = Vec::new();
    for _ in 0..runs.min(3) {
        let (s, code, out) = timed_check(&c);
        assert_eq!(code, 1, "{out}");
        assert!(
            verdict_lines(&out).contains(&"faulty node n7".to_string()),
            "{out}"
        );
        hang.push(s);
        if let Some(run) = tcommon::cluster::published(&c.emu) {
            for r in &run.rounds {
                let slowest = r
                    .checks
                    .iter()
                    .filter_map(|c| c.seconds)
                    .fold(0.0, f64::max);
                println!(
                    "  round {}: {} checks, deadline {} ms, slowest passed median {:.3} s, failed: {:?}",
                    r.round,
                    r.checks.len(),
                    r.deadline_ms,
                    slowest,
                    r.checks
                        .iter()
                        .filter(|c| c.passed == Some(false))
                        .map(|c| format!("{}-{}: {}", c.a, c.b, c.error.clone().unwrap_or_default()))
                        .collect::<Vec<_>>()
                );
            }
        }
        // Let the killed probes' ports go.
        std::thread::sleep(Duration::from_secs(1));
    }
    std::fs::remove_file(&flag).unwrap();
    if let Ok(dir) = std::env::var("PEER_NET_LOGS") {
        for n in &c.nodes {
            let _ = std::fs::copy(n.dir.join("agent.log"), format!("{dir}/{}.log", n.name));
        }
    }
    println!(
        "hang (probe on n7 never returns, deadline 10 s): time to verdict, median {:.2} s of {} ({:?})",
        median(hang.clone()),
        hang.len(),
        hang.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>()
    );

    // A frozen agent on node 6.
    let pid = c.nodes[6].child.as_ref().unwrap().id();
    let sig = |s: &str| {
        std::process::Command::new("kill")
            .args([s, &pid.to_string()])
            .status()
            .unwrap();
    };
    sig("-STOP");
    let mut stopped = Vec::new();
    for _ in 0..runs.min(3) {
        let (s, code, out) = timed_check(&c);
        assert_eq!(code, 1, "{out}");
        assert!(
            verdict_lines(&out).contains(&"faulty node n6".to_string()),
            "{out}"
        );
        stopped.push(s);
    }
    sig("-CONT");
    println!(
        "stopped (agent on n6 frozen by SIGSTOP): time to verdict, median {:.2} s of {} ({:?})",
        median(stopped.clone()),
        stopped.len(),
        stopped
            .iter()
            .map(|s| format!("{s:.2}"))
            .collect::<Vec<_>>()
    );
}
