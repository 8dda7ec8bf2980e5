//! The probe binary between two processes on loopback, as an operator would run it between two
//! hosts.

#![allow(clippy::unwrap_used)]

use std::process::Command;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn two_processes_allgather_and_print_json() {
    let peers = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let spawn = |rank: &str| {
        Command::new(env!("CARGO_BIN_EXE_faultline-probe"))
            .args(["allgather", "--peers", &peers, "--rank", rank])
            .args(["--size", "4MiB", "--iterations", "2", "--timeout", "20s"])
            .output()
            .unwrap()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| spawn("0"));
        let b = s.spawn(|| spawn("1"));
        (a.join().unwrap(), b.join().unwrap())
    });
    for (rank, out) in [(0, a), (1, b)] {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["rank"], rank);
        assert_eq!(v["world"], 2);
        assert_eq!(v["bytes_per_rank"], 4 << 20);
        assert_eq!(v["seconds"].as_array().unwrap().len(), 2);
        assert!(v["busbw_gbps"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn a_peer_that_never_comes_fails_at_the_timeout_with_a_clear_error() {
    let peers = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let out = Command::new(env!("CARGO_BIN_EXE_faultline-probe"))
        .args([
            "allgather",
            "--peers",
            &peers,
            "--rank",
            "0",
            "--timeout",
            "500ms",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1"), "{err}");
}

#[test]
fn bad_sizes_are_rejected() {
    for size in ["lots", "0", "5GiB"] {
        let out = Command::new(env!("CARGO_BIN_EXE_faultline-probe"))
            .args([
                "allgather",
                "--peers",
                "127.0.0.1:1,127.0.0.1:2",
                "--rank",
                "0",
                "--size",
                size,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{size}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(size),
            "{size}"
        );
    }
}
