//! Runs the probe (`faultline-probe allgather`) as a child process with a hard deadline: a
//! stuck socket or a hung accelerator call never hangs the agent, the child is killed at the
//! deadline, and its memory (GPU memory included) is freed when it exits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::child::ChildError;
use faultline_core::peer::pairing::Outcome;

/// One probe run.
#[derive(Debug, Clone)]
pub struct ProbeSpec {
    /// The `faultline-probe` binary.
    pub probe: PathBuf,
    /// Every rank's probe address, in rank order.
    pub peers: Vec<SocketAddr>,
    pub rank: usize,
    pub bytes: u64,
    pub iterations: u32,
    /// The probe's own deadline (it fails by itself after this).
    pub timeout: Duration,
    /// How much longer the agent waits before it kills the child.
    pub grace: Duration,
    /// NCCL instead of TCP (a probe built with the `gpu` feature).
    pub gpu: bool,
}

/// What the probe printed (the fields the agent uses).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ProbeReport {
    pub world: usize,
    pub rank: usize,
    pub median_seconds: f64,
    pub busbw_gbps: f64,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ProbeOutcome {
    Passed(ProbeReport),
    /// Why: the probe's own error, a kill at the deadline, unreadable output.
    Failed(String),
    /// The probe could not be started on this node (missing or not executable): a cause on
    /// this side, whatever the partner.
    CannotRun(String),
    /// The probe's deadline passed after the ranks connected (exit status 3): too slow to
    /// finish, not an error. Under load, no evidence against anyone (`Outcome::TimedOut`).
    TimedOut(String),
}

/// The probe's exit status for a deadline that passed after the ranks connected.
pub(crate) const PROBE_DEADLINE_EXIT: i32 = 3;

impl ProbeOutcome {
    /// The pairing planner's view.
    pub fn outcome(&self) -> Outcome {
        match self {
            ProbeOutcome::Passed(r) => Outcome::Pass {
                seconds: r.median_seconds,
            },
            ProbeOutcome::Failed(_) | ProbeOutcome::CannotRun(_) => Outcome::Fail,
            ProbeOutcome::TimedOut(_) => Outcome::TimedOut,
        }
    }
}

fn excerpt(s: &[u8]) -> String {
    crate::child::first_line(&String::from_utf8_lossy(s), 200)
}

/// How long the two probes of a check may take to find each other: both are started at once
/// (on the coordinator's word), so a partner missing after this is not coming; a third of the
/// deadline, at least 3 s, at most the deadline.
pub(crate) fn connect_timeout(timeout: Duration) -> Duration {
    (timeout / 3).max(Duration::from_secs(3)).min(timeout)
}

/// How long after its own deadline a probe is killed. The coordinator waits for reports this
/// much longer too.
pub const PROBE_GRACE: Duration = Duration::from_secs(1);

/// Runs the probe and waits at most `timeout + grace`.
pub async fn run_probe(spec: &ProbeSpec) -> ProbeOutcome {
    let peers: Vec<String> = spec.peers.iter().map(|p| p.to_string()).collect();
    let mut cmd = tokio::process::Command::new(&spec.probe);
    cmd.arg(if spec.gpu {
        "nccl-allgather"
    } else {
        "allgather"
    })
    .args(["--peers", &peers.join(",")])
    .args(["--rank", &spec.rank.to_string()])
    .args(["--size", &spec.bytes.to_string()])
    .args(["--iterations", &spec.iterations.max(1).to_string()])
    .args(["--timeout", &format!("{}ms", spec.timeout.as_millis())])
    // One-line errors: the agent keeps the first line of stderr as the reason.
    .env("RUST_BACKTRACE", "0");
    if !spec.gpu {
        let c = connect_timeout(spec.timeout);
        cmd.args(["--connect-timeout", &format!("{}ms", c.as_millis())]);
    }
    let limit = spec.timeout + spec.grace;
    match crate::child::run(&mut cmd, limit).await {
        Err(ChildError::Spawn(e)) => {
            ProbeOutcome::CannotRun(format!("cannot run {}: {e}", spec.probe.display()))
        }
        Err(ChildError::Timeout(_)) => ProbeOutcome::Failed(format!(
            "no result within {} (killed)",
            humantime::format_duration(limit)
        )),
        Err(ChildError::Io(e)) => ProbeOutcome::Failed(format!("waiting for the probe: {e}")),
        Ok(out) if out.status.code() == Some(PROBE_DEADLINE_EXIT) => {
            ProbeOutcome::TimedOut(format!("probe {}: {}", out.status, excerpt(&out.stderr)))
        }
        Ok(out) if !out.status.success() => {
            ProbeOutcome::Failed(format!("probe {}: {}", out.status, excerpt(&out.stderr)))
        }
        Ok(out) => match serde_json::from_slice::<ProbeReport>(&out.stdout) {
            Ok(r) if r.median_seconds.is_finite() && r.median_seconds >= 0.0 => {
                ProbeOutcome::Passed(r)
            }
            Ok(r) => ProbeOutcome::Failed(format!("probe reported {} s", r.median_seconds)),
            Err(e) => ProbeOutcome::Failed(format!(
                "unreadable probe output ({e}): {}",
                excerpt(&out.stdout)
            )),
        },
    }
}

#[derive(Debug, Deserialize)]
struct GemmReport {
    gflops: f64,
}

/// Why a GEMM timing has no result.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GemmError {
    #[error("unreadable GEMM output ({source}): {stdout}")]
    Unreadable {
        #[source]
        source: serde_json::Error,
        stdout: String,
    },
    #[error("gemm {status}: {stderr}")]
    Failed {
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("gemm: {0:?}")]
    Child(crate::child::ChildError),
}

/// Times a GEMM (`faultline-probe gemm`, on the CPU or with cuBLAS); its GFLOP/s.
pub(crate) async fn run_gemm(
    probe: &std::path::Path,
    gpu: bool,
    timeout: Duration,
) -> Result<f64, GemmError> {
    let mut cmd = tokio::process::Command::new(probe);
    cmd.arg("gemm")
        .args(["--backend", if gpu { "cublas" } else { "cpu" }])
        .env("RUST_BACKTRACE", "0");
    match crate::child::run(&mut cmd, timeout).await {
        Ok(out) if out.status.success() => serde_json::from_slice::<GemmReport>(&out.stdout)
            .map(|g| g.gflops)
            .map_err(|source| GemmError::Unreadable {
                source,
                stdout: excerpt(&out.stdout),
            }),
        Ok(out) => Err(GemmError::Failed {
            status: out.status,
            stderr: excerpt(&out.stderr),
        }),
        Err(e) => Err(GemmError::Child(e)),
    }
}
