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
        // tokio's own signal handling (its `signal` feature), registered before anything starts,
        // so a SIGTERM during start-up still flushes. A signal whose default action would kill
        // the agent without a flush is handled: SIGHUP re-reads the policy; SIGUSR1, SIGUSR2
        // and SIGQUIT are logged and otherwise ignored.
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut hup = signal(SignalKind::hangup())?;
        let mut usr1 = signal(SignalKind::user_defined1())?;
        let mut usr2 = signal(SignalKind::user_defined2())?;
        let mut quit = signal(SignalKind::quit())?;
        let reload = std::sync::Arc::new(tokio::sync::Notify::new());
        let stop = shutdown.clone();
        let reload_tx = reload.clone();
        let signal_task = tokio::spawn(async move {
            let mut stopping = false;
            loop {
                let name = tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                    _ = hup.recv() => {
                        tracing::info!(signal = "SIGHUP", "re-reading the policy");
                        reload_tx.notify_one();
                        continue;
                    }
                    _ = usr1.recv() => "SIGUSR1",
                    _ = usr2.recv() => "SIGUSR2",
                    _ = quit.recv() => "SIGQUIT",
                };
                match name {
                    "SIGTERM" | "SIGINT" if stopping => std::process::exit(130), // a second one: leave now
                    "SIGTERM" | "SIGINT" => {
                        tracing::info!(signal = name, "shutting down");
                        stopping = true;
                        stop.cancel();
                    }
                    _ => tracing::info!(signal = name, "signal ignored (SIGTERM or SIGINT stop the agent, SIGHUP re-reads the policy)"),
                }
            }
        });
        let r = faultline_agent::daemon::run_with_reload(cli.agent, shutdown, reload).await;
        signal_task.abort();
        r
    });
    // A blocking read that never returns (a policy file on a hung filesystem, a kernel-log read)
    // must not hold the exit: what had to be flushed is flushed by now.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("faultline-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
