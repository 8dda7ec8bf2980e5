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

/// Ranks 0 and 1 of `allgather` on loopback, at once, with these further arguments.
fn two_ranks(args: &[&str]) -> [(usize, std::process::Output); 2] {
    let peers = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let spawn = |rank: &str| {
        Command::new(env!("CARGO_BIN_EXE_faultline-probe"))
            .args(["allgather", "--peers", &peers, "--rank", rank])
            .args(args)
            .output()
            .unwrap()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| spawn("0"));
        let b = s.spawn(|| spawn("1"));
        (a.join().unwrap(), b.join().unwrap())
    });
    [(0, a), (1, b)]
}

#[test]
fn two_processes_allgather_and_print_json() {
    for (rank, out) in two_ranks(&["--size", "4MiB", "--iterations", "2", "--timeout", "20s"]) {
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

/// The probe's goal for peak resident memory per rank, at any `--size` (docs/benchmarks.md:
/// about 6 MiB measured at 64 MiB and at 1 GiB; the code and libc pages are most of it).
const PEAK_RSS_GOAL: u64 = 24 << 20;

/// Memory does not grow with the block: two ranks exchange 256 MiB each, and each reports a peak
/// RSS (VmHWM) far below one block. The probe that kept every block and a copy of the expected
/// data peaked at 3 x 256 MiB here (and had no `peak_rss_bytes`).
#[test]
fn peak_memory_stays_bounded_at_a_large_size() {
    let size: u64 = 256 << 20;
    for (rank, out) in two_ranks(&["--size", "256MiB", "--iterations", "1", "--timeout", "120s"]) {
        assert!(
            out.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["bytes_per_rank"], size);
        let peak = v["peak_rss_bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("rank {rank}: no peak_rss_bytes in {v}"));
        assert!(
            peak > 0 && peak < PEAK_RSS_GOAL,
            "rank {rank}: peak RSS {} MiB for a {} MiB block (goal < {} MiB)",
            peak >> 20,
            size >> 20,
            PEAK_RSS_GOAL >> 20
        );
    }
}

/// A transfer too slow for the deadline (4 GiB x 5 in 2 s on one machine) is not an error: the
/// probe exits with status 3, which the agent reports as a timeout (judged with its round, no
/// evidence under load), while a rank that never comes stays status 1 (below).
#[test]
fn a_deadline_mid_transfer_exits_3() {
    for (rank, out) in two_ranks(&["--size", "4GiB", "--iterations", "5", "--timeout", "2s"]) {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "rank {rank}: {err}");
        assert!(err.starts_with("Error: "), "{err}");
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
