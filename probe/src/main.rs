//! `faultline-probe`: run the check workload by hand: `faultline-probe gemm` (CPU, or cuBLAS
//! with `--backend cublas`), `faultline-probe allgather` (TCP) and `faultline-probe
//! nccl-allgather` between two or more hosts (start one per host, same `--peers`, each with its
//! own `--rank`). The GPU backends need a build with the `gpu` feature and the CUDA libraries at
//! run time. Results are JSON on stdout; errors are one line on stderr and exit 1.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use faultline_probe::accel::{CublasGemmConfig, Dtype, NcclAllgatherConfig};

#[derive(Debug, Parser)]
#[command(
    name = "faultline-probe",
    version,
    about = "faultline's peer-check workload"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum GemmBackend {
    Cpu,
    Cublas,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Time a GEMM (CPU, or cuBLAS on a GPU) and print the result as JSON.
    Gemm {
        #[arg(long, value_enum, default_value_t = GemmBackend::Cpu)]
        backend: GemmBackend,
        /// Matrix side [default: 256 on cpu, 8192 on cublas].
        #[arg(long)]
        n: Option<usize>,
        /// Timed GEMMs [default: 4 on cpu, 20 on cublas (after one warm-up)].
        #[arg(long)]
        iterations: Option<u32>,
        /// Element type on cublas: f32, bf16 or f16 (half precision accumulates in FP32).
        #[arg(long, default_value = "f32", value_parser = parse_dtype)]
        dtype: Dtype,
        /// The GPU (CUDA device ordinal) for cublas.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// A TCP ring allgather among the ranks in --peers; prints this rank's timings as JSON.
    Allgather {
        /// Every rank's address (host:port), in rank order; this rank listens on its own.
        #[arg(long, value_delimiter = ',', required = true)]
        peers: Vec<std::net::SocketAddr>,
        #[arg(long)]
        rank: usize,
        /// Bytes each rank contributes (64MiB, 1GiB, 4096 ...).
        #[arg(long, default_value = "64MiB", value_parser = parse_size)]
        size: usize,
        #[arg(long, default_value_t = 5)]
        iterations: u32,
        /// The whole run, connecting included, fails after this long.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        /// The ring must be connected within this (default: --timeout): the agent starts both
        /// probes of a check at once, so a partner that is not there after a few seconds is
        /// not coming.
        #[arg(long, value_parser = humantime::parse_duration)]
        connect_timeout: Option<std::time::Duration>,
    },
    /// An NCCL allgather among the ranks in --peers (one GPU per rank); prints this rank's
    /// timings as JSON.
    NcclAllgather {
        /// Every rank's address (host:port), in rank order; rank 0 hands NCCL's unique id out
        /// on its own address (one entry: a world of one, no network).
        #[arg(long, value_delimiter = ',', required = true)]
        peers: Vec<std::net::SocketAddr>,
        #[arg(long)]
        rank: usize,
        /// Bytes each rank contributes (64MiB, 1GiB, 4096 ...).
        #[arg(long, default_value = "64MiB", value_parser = parse_size)]
        size: usize,
        /// Timed allgathers (after one warm-up).
        #[arg(long, default_value_t = 5)]
        iterations: u32,
        /// The whole run (id exchange, NCCL init, iterations) fails after this long.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        /// The GPU (CUDA device ordinal).
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
}

fn parse_dtype(s: &str) -> Result<Dtype, String> {
    s.parse()
}

/// `64MiB`, `1GiB`, `512KiB`, `4096` (bytes); at most 4 GiB.
fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = [
        ("GiB", 1usize << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suffix, m)| t.strip_suffix(suffix).map(|n| (n, *m)))
    .unwrap_or((t, 1));
    let n: usize = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size (use e.g. 64MiB, 1GiB, 4096)"))?;
    let bytes = n
        .checked_mul(mult)
        .filter(|b| *b > 0 && *b <= 4 << 30)
        .ok_or_else(|| format!("{s:?} must be between 1 byte and 4GiB"))?;
    Ok(bytes)
}

/// Exit status when the allgather's deadline passed after the ranks connected.
const DEADLINE_EXIT: u8 = 3;

fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the agent keeps the first line of stderr as the failure reason.
            eprintln!("Error: {}", format!("{e:#}").replace('\n', " "));
            let deadline = e
                .downcast_ref::<faultline_probe::allgather::AllgatherError>()
                .is_some_and(|a| a.is_deadline());
            if deadline {
                // The agent tells this apart: too slow, not broken (docs/peer-checks.md).
                ExitCode::from(DEADLINE_EXIT)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Gemm {
            backend: GemmBackend::Cpu,
            n,
            iterations,
            dtype,
            device: _,
        } => {
            anyhow::ensure!(
                dtype == Dtype::F32,
                "the cpu backend computes in f32 only (--dtype {dtype} needs --backend cublas)"
            );
            let n = n.unwrap_or(256);
            anyhow::ensure!(n > 0 && n <= 16_384, "--n must be in 1..=16384");
            let r = faultline_probe::cpu_gemm(n, iterations.unwrap_or(4).max(1));
            println!("{}", serde_json::to_string(&r)?);
        }
        Command::Gemm {
            backend: GemmBackend::Cublas,
            n,
            iterations,
            dtype,
            device,
        } => {
            let cfg = CublasGemmConfig {
                device,
                n: n.unwrap_or(8192),
                iterations: iterations.unwrap_or(20).max(1),
                dtype,
            };
            let r = faultline_probe::accel::cublas_gemm(&cfg)?;
            println!("{}", serde_json::to_string(&r)?);
        }
        Command::Allgather {
            peers,
            rank,
            size,
            iterations,
            timeout,
            connect_timeout,
        } => {
            let cfg = faultline_probe::allgather::AllgatherConfig {
                peers,
                rank,
                bytes: size,
                iterations: iterations.max(1),
                timeout,
                connect_timeout,
            };
            let r = faultline_probe::allgather::run(&cfg)?;
            println!("{}", serde_json::to_string(&r)?);
        }
        Command::NcclAllgather {
            peers,
            rank,
            size,
            iterations,
            timeout,
            device,
        } => {
            let cfg = NcclAllgatherConfig {
                peers,
                rank,
                bytes: size,
                iterations: iterations.max(1),
                timeout,
                device,
            };
            let r = faultline_probe::accel::nccl_allgather(&cfg)?;
            println!("{}", serde_json::to_string(&r)?);
        }
    }
    Ok(())
}
