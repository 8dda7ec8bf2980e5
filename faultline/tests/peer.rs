//! The agent's probe runner with the real `faultline-probe` binary (built for the test): two
//! ranks on loopback pass and report timings; a missing partner fails with the probe's reason;
//! a probe that hangs is killed at the deadline.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use faultline_agent::peer::runner::{run_probe, ProbeOutcome, ProbeSpec};
use faultline_core::peer::pairing::Outcome;

/// The probe binary, built (or found up to date) once per test process.
fn probe() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let st = std::process::Command::new(cargo)
            .args(["build", "--quiet", "-p", "faultline-probe"])
            .status()
            .unwrap();
        assert!(st.success(), "cannot build faultline-probe");
        Path::new(env!("CARGO_BIN_EXE_faultline-agent"))
            .parent()
            .unwrap()
            .join("faultline-probe")
    })
    .clone()
}

fn free() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn spec(
    probe: PathBuf,
    peers: Vec<std::net::SocketAddr>,
    rank: usize,
    timeout_ms: u64,
) -> ProbeSpec {
    ProbeSpec {
        probe,
        peers,
        rank,
        bytes: 1 << 20,
        iterations: 2,
        timeout: Duration::from_millis(timeout_ms),
        grace: Duration::from_millis(500),
        gpu: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_pass_a_missing_one_fails_a_hung_one_is_killed() {
    let bin = probe();
    let peers = vec![free(), free()];
    let (s0, s1) = (
        spec(bin.clone(), peers.clone(), 0, 20_000),
        spec(bin.clone(), peers.clone(), 1, 20_000),
    );
    let (a, b) = tokio::join!(run_probe(&s0), run_probe(&s1));
    for (rank, o) in [(0, a), (1, b)] {
        match &o {
            ProbeOutcome::Passed(r) => {
                assert_eq!((r.rank, r.world), (rank, 2));
                assert!(r.busbw_gbps > 0.0);
                assert!(matches!(o.outcome(), Outcome::Pass { seconds } if seconds > 0.0));
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }

    // The partner never comes: the probe gives up at its own deadline and says why.
    let o = run_probe(&spec(bin.clone(), vec![free(), free()], 0, 500)).await;
    match &o {
        ProbeOutcome::Failed(why) => assert!(why.contains("rank 1"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(o.outcome(), Outcome::Fail);

    // With a long deadline, a partner that never shows up fails the check at the connect
    // timeout (a third of the deadline, at least 3 s), not at the deadline.
    let t0 = Instant::now();
    let o = run_probe(&spec(bin.clone(), vec![free(), free()], 0, 12_000)).await;
    let took = t0.elapsed();
    assert_eq!(o.outcome(), Outcome::Fail);
    assert!(
        took >= Duration::from_millis(3500) && took < Duration::from_secs(8),
        "{took:?}"
    );

    // A probe that hangs (ignores its deadline) is killed at timeout + grace.
    let dir = tempfile::tempdir().unwrap();
    let hung = dir.path().join("hung-probe");
    std::fs::write(&hung, "#!/bin/sh\nexec sleep 60\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&hung, std::fs::Permissions::from_mode(0o755)).unwrap();
    let t0 = Instant::now();
    let o = run_probe(&spec(hung, vec![free(), free()], 0, 300)).await;
    assert!(t0.elapsed() < Duration::from_secs(10));
    match o {
        ProbeOutcome::Failed(why) => assert!(why.contains("killed"), "{why}"),
        other => panic!("{other:?}"),
    }

    // Garbage on stdout is a failure with the reason, not a pass.
    let liar = dir.path().join("liar-probe");
    std::fs::write(&liar, "#!/bin/sh\necho 'all good, trust me'\n").unwrap();
    std::fs::set_permissions(&liar, std::fs::Permissions::from_mode(0o755)).unwrap();
    match run_probe(&spec(liar, vec![free(), free()], 0, 300)).await {
        ProbeOutcome::Failed(why) => assert!(why.contains("unreadable probe output"), "{why}"),
        other => panic!("{other:?}"),
    }
}
