//! `faultline-probe`: run the check workload by hand. Today: `faultline-probe gemm`.

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
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Gemm { n, iterations } => {
            anyhow::ensure!(n > 0 && n <= 16_384, "--n must be in 1..=16384");
            let r = faultline_probe::cpu_gemm(n, iterations.max(1));
            println!("{}", serde_json::to_string(&r)?);
        }
    }
    Ok(())
}
