//! `faultline-probe`: run the check workload by hand: `faultline-probe gemm`, and
//! `faultline-probe allgather` between two or more hosts (start one per host, same `--peers`,
//! each with its own `--rank`). Results are JSON on stdout; errors name what went wrong and
//! exit 1.

use clap::{Parser, Subcommand};

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

#[derive(Debug, Subcommand)]
enum Command {
    /// Time a CPU GEMM and print the result as JSON.
    Gemm {
        #[arg(long, default_value_t = 256)]
        n: usize,
        #[arg(long, default_value_t = 4)]
        iterations: u32,
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
    },
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

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Gemm { n, iterations } => {
            anyhow::ensure!(n > 0 && n <= 16_384, "--n must be in 1..=16384");
            let r = faultline_probe::cpu_gemm(n, iterations.max(1));
            println!("{}", serde_json::to_string(&r)?);
        }
        Command::Allgather {
            peers,
            rank,
            size,
            iterations,
            timeout,
        } => {
            let cfg = faultline_probe::allgather::AllgatherConfig {
                peers,
                rank,
                bytes: size,
                iterations: iterations.max(1),
                timeout,
            };
            let r = faultline_probe::allgather::run(&cfg)?;
            println!("{}", serde_json::to_string(&r)?);
        }
    }
    Ok(())
}
