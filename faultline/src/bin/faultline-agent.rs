//! `faultline-agent`: the node daemon. With no flags it runs standalone: reads the kernel log,
//! writes `/run/faultline/faults.json`, serves metrics on :20260.
//!
//! Called by the name `faultline` (argv[0]'s file name), it is the CLI: the image ships this
//! one binary under both names (`faultline` is a symlink to it), since the two share nearly
//! all their code and two copies would not fit its size budget (manifests/build-image.sh,
//! docs/benchmarks.md "Image size"). `cargo build` still builds the CLI as its own binary too.

/// The coordinator (`src/bin/faultline-coordinator.rs`), the same way.
#[path = "faultline-coordinator.rs"]
mod coordinator_main;
/// The CLI (`src/bin/faultline.rs`), compiled into this binary as well.
#[path = "faultline.rs"]
mod faultline_cli;

use clap::Parser;
use faultline_agent::signals::Action;
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

/// What this process was started as, by argv[0]'s file name.
#[derive(Debug, PartialEq, Eq)]
enum Role {
    Agent,
    /// `faultline`
    Cli,
    /// `faultline-coordinator`
    Coordinator,
}

fn called_as(argv0: Option<&std::ffi::OsStr>) -> Role {
    match argv0
        .and_then(|a| std::path::Path::new(a).file_name())
        .and_then(|n| n.to_str())
    {
        Some("faultline") => Role::Cli,
        Some("faultline-coordinator") => Role::Coordinator,
        _ => Role::Agent,
    }
}

fn main() -> std::process::ExitCode {
    match called_as(std::env::args_os().next().as_deref()) {
        Role::Cli => return faultline_cli::main(),
        Role::Coordinator => return coordinator_main::main(),
        Role::Agent => {}
    }
    let cli = Cli::parse();
    faultline_agent::cli::init_tracing(&cli.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // The file sink's heartbeat writes on a blocking thread every 10 s; with tokio's default
        // keep-alive (10 s) that thread had just exited each time, and an idle agent started a
        // new one every heartbeat (5 a minute: strace, issue 27 §2). A parked thread costs
        // nothing while it waits.
        .thread_keep_alive(std::time::Duration::from_secs(60))
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
    // The exit status a stop signal chose (0 unless SIGXCPU).
    let exit = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(0));
    let exit_code = exit.clone();
    let result = rt.block_on(async move {
        let shutdown = CancellationToken::new();
        // Registered before anything starts, so a signal during start-up is handled too
        // (faultline_agent::signals has the table and why each signal does what it does).
        let mut signals = faultline_agent::signals::install()?;
        let reload = std::sync::Arc::new(tokio::sync::Notify::new());
        let stop = shutdown.clone();
        let reload_tx = reload.clone();
        let signal_task = tokio::spawn(async move {
            let mut stopping = false;
            while let Some(h) = signals.recv().await {
                let name = h.name.as_str();
                match h.action {
                    Action::Reload => {
                        tracing::info!(signal = name, "re-reading the policy");
                        reload_tx.notify_one();
                    }
                    Action::Ignore => tracing::info!(
                        signal = name,
                        "signal ignored (SIGTERM, SIGINT, SIGPWR or SIGXCPU stop the agent, SIGHUP re-reads the policy)"
                    ),
                    // The kernel sends SIGXCPU every second past the soft limit, whatever
                    // started the stop: only a stop signal sent by someone cuts the flush short.
                    Action::Stop { .. } if stopping && name == "SIGXCPU" => {}
                    // A second one: leave now.
                    Action::Stop { .. } if stopping => std::process::exit(130),
                    Action::Stop { exit } => {
                        tracing::info!(signal = name, "shutting down");
                        stopping = true;
                        exit_code.store(exit, std::sync::atomic::Ordering::SeqCst);
                        stop.cancel();
                    }
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
        Ok(()) => std::process::ExitCode::from(exit.load(std::sync::atomic::Ordering::SeqCst)),
        Err(e) => {
            eprintln!("faultline-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Only the name `faultline` is the CLI and only `faultline-coordinator` the coordinator:
    /// any other name, a path to it, or none at all is the agent.
    #[test]
    fn the_role_is_the_binarys_name() {
        use std::ffi::OsStr;
        for cli in ["faultline", "/usr/local/bin/faultline", "./faultline"] {
            assert_eq!(called_as(Some(OsStr::new(cli))), Role::Cli, "{cli}");
        }
        for c in [
            "faultline-coordinator",
            "/usr/local/bin/faultline-coordinator",
        ] {
            assert_eq!(called_as(Some(OsStr::new(c))), Role::Coordinator, "{c}");
        }
        for agent in [
            "faultline-agent",
            "/usr/local/bin/faultline-agent",
            "faultline2",
            "/faultline/x",
            "/faultline-coordinator/x",
        ] {
            assert_eq!(called_as(Some(OsStr::new(agent))), Role::Agent, "{agent}");
        }
        assert_eq!(called_as(None), Role::Agent);
    }

    /// Every flag can be set from the environment (README, "Configuration"), and the README's
    /// table names each shown flag with its variable: a flag added without one fails here.
    #[test]
    fn every_flag_has_an_environment_variable_and_a_readme_row() {
        let readme =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
        let rows: Vec<&str> = readme.lines().filter(|l| l.starts_with("| `--")).collect();
        let cmd = Cli::command();
        let mut checked = 0;
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version") {
                continue;
            }
            let env = arg.get_env().and_then(|e| e.to_str());
            let Some(env) = env else {
                panic!("--{long} has no environment variable");
            };
            checked += 1;
            if arg.is_hide_set() {
                continue;
            }
            let row = rows
                .iter()
                .find(|r| r.contains(&format!("`--{long}`")))
                .unwrap_or_else(|| panic!("--{long} has no row in the README's flag table"));
            assert!(
                row.contains(&format!("`{env}`")),
                "the README's row for --{long} does not name {env}: {row}"
            );
        }
        assert!(checked > 30, "only {checked} flags seen");
    }

    /// The coordinator's flags likewise: each has its environment variable, and a row in the
    /// README's "The coordinator" table naming it.
    #[test]
    fn every_coordinator_flag_has_an_environment_variable_and_a_readme_row() {
        let readme =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
        let section = readme
            .split("### The coordinator")
            .nth(1)
            .unwrap()
            .split("\n## ")
            .next()
            .unwrap();
        let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `--")).collect();
        let cmd = coordinator_main::Cli::command();
        let mut checked = 0;
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version") {
                continue;
            }
            let env = arg
                .get_env()
                .and_then(|e| e.to_str())
                .unwrap_or_else(|| panic!("--{long} has no environment variable"));
            let row = rows
                .iter()
                .find(|r| r.starts_with(&format!("| `--{long}` |")))
                .unwrap_or_else(|| panic!("--{long} has no row in the README's coordinator table"));
            assert!(row.contains(&format!("`{env}`")), "--{long}: {row}");
            checked += 1;
        }
        assert!(checked > 15, "only {checked} flags seen");
    }
}
