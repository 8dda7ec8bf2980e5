//! `faultline-agent`: the node daemon. With no flags it runs standalone: reads the kernel log,
//! writes `/run/faultline/faults.json`, serves metrics on :20260.

use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "faultline-agent",
    version,
    about = "Accelerator node-health agent",
    args_override_self = true
)]
struct Cli {
    #[command(flatten)]
    agent: faultline_agent::daemon::AgentConfig,
    /// Log format: `text` or `json`.
    #[arg(long, env = "FAULTLINE_LOG_FORMAT", default_value = "text")]
    log_format: String,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    faultline_agent::cli::init_tracing(&cli.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("faultline")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("faultline-agent: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        let shutdown = CancellationToken::new();
        // tokio's own signal handling (its `signal` feature): registered before anything starts,
        // so a SIGTERM during start-up still flushes.
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let stop = shutdown.clone();
        let signal_task = tokio::spawn(async move {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            tracing::info!(signal = name, "shutting down");
            stop.cancel();
            // A second signal while flushing: leave now.
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            std::process::exit(130);
        });
        let r = faultline_agent::daemon::run(cli.agent, shutdown).await;
        signal_task.abort();
        r
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("faultline-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
