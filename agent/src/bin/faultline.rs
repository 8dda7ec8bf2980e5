//! `faultline`: read this node's fault record, wait for health, clear faults.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use faultline_agent::cli;

#[derive(Debug, Parser)]
#[command(
    name = "faultline",
    version,
    about = "Read and act on faultline's fault records"
)]
struct Cli {
    /// The agent's state directory (holds faults.json).
    #[arg(
        long,
        global = true,
        env = "FAULTLINE_STATE_DIR",
        default_value = "/run/faultline"
    )]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print this node's record.
    Get {
        /// Read this file instead of <state-dir>/faults.json.
        #[arg(long)]
        file: Option<PathBuf>,
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
        /// Include recovered faults.
        #[arg(long)]
        all: bool,
    },
    /// Wait until this node is healthy: exit 0 healthy, 1 still unhealthy at the timeout,
    /// 2 when the record cannot be read.
    WaitHealthy {
        #[arg(long)]
        file: Option<PathBuf>,
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        interval: Duration,
        /// Accept Degraded (faults that need a restart, not isolation) as healthy.
        #[arg(long)]
        allow_degraded: bool,
    },
    /// Ask the agent to clear active faults (all, or by code and/or device).
    Clear {
        #[arg(long)]
        code: Option<String>,
        /// Device name (GPU-3), UUID or PCI bus id.
        #[arg(long)]
        device: Option<String>,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        wait: Duration,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Get { file, output, all } => cli::get(
            &cli::record_path(file.as_deref(), &cli.state_dir),
            matches!(output, Output::Json),
            all,
        ),
        Command::WaitHealthy {
            file,
            timeout,
            interval,
            allow_degraded,
        } => cli::wait_healthy(
            &cli::record_path(file.as_deref(), &cli.state_dir),
            timeout,
            interval,
            allow_degraded,
        ),
        Command::Clear { code, device, wait } => cli::clear(&cli.state_dir, code, device, wait),
    };
    if outcome.code == 0 {
        println!("{}", outcome.message);
    } else {
        eprintln!("{}", outcome.message);
    }
    std::process::ExitCode::from(outcome.code)
}
