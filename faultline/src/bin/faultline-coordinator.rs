//! `faultline-coordinator`: the peer-check coordinator (`faultline_coordinator`). The
//! image ships it as another name of the agent's binary (`faultline-agent` runs it when called
//! by this name), as it does the CLI; `cargo build` builds it as its own binary too.

use clap::Parser;
use faultline_agent::signals::Action;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "faultline-coordinator",
    version,
    about = "Peer-check coordinator of faultline agents",
    args_override_self = true
)]
pub struct Cli {
    #[command(flatten)]
    coordinator: faultline_coordinator::CoordinatorConfig,
    /// Log format: `text` or `json`.
    #[arg(long, env = "FAULTLINE_LOG_FORMAT", default_value = "text")]
    log_format: String,
}

pub fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    faultline_agent::cli::init_tracing(&cli.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("faultline-coordinator")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("faultline-coordinator: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        let shutdown = CancellationToken::new();
        let mut signals = faultline_agent::signals::install()?;
        let reload = std::sync::Arc::new(tokio::sync::Notify::new());
        let stop = shutdown.clone();
        let reload_tx = reload.clone();
        let signal_task = tokio::spawn(async move {
            while let Some(h) = signals.recv().await {
                match h.action {
                    Action::Reload => reload_tx.notify_one(),
                    Action::Ignore => {}
                    Action::Stop { .. } if stop.is_cancelled() => std::process::exit(130),
                    Action::Stop { .. } => {
                        tracing::info!(signal = h.name.as_str(), "shutting down");
                        stop.cancel();
                    }
                }
            }
        });
        let r = faultline_coordinator::run(cli.coordinator, shutdown, reload).await;
        signal_task.abort();
        r
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("faultline-coordinator: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
