//! The agent process, top to bottom: its flags, the directories taken and the last run's state
//! restored (`restore`), the policy loaded, every source and sink started through one contract
//! (`component`), then the wait for shutdown and the stop in order that flushes the record.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use crate::clock::{Clock, SystemClock};
use crate::component::{Component, Context, Handle};
use crate::engine_loop::{EngineLoop, Heartbeat, RecordStatus, SinkReport};
use crate::metrics::Metrics;
use crate::restore::{self, RestoreConfig};
use crate::sink::kube as kube_sink;
use crate::source::{ascend, control, gpu_count, kmsg, nvml, policy_watch, Input};
use crate::{http, kube_client, peer, sink};
use faultline_core::catalog::Catalog;
use faultline_core::engine::Observation;
use faultline_core::time::Timeline;

/// Agent configuration: flags, each also settable by an environment variable, grouped by the
/// component that reads them.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentConfig {
    /// This node's name (Kubernetes: from the downward API). Default: the host name.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Where the local record (`faults.json`) that jobs and the CLI read, clear requests
    /// (`clear.d/`) and the listen address live. A tmpfs is fine: nothing here must outlive a
    /// reboot.
    #[arg(long, env = "FAULTLINE_STATE_DIR", default_value = "/run/faultline")]
    pub state_dir: PathBuf,
    /// Where durable state lives (`state.json`: faults only an operator may clear, escalation
    /// counts, the kernel-log cursor). Must survive a reboot: not a tmpfs.
    #[arg(long, env = "FAULTLINE_DATA_DIR", default_value = "/var/lib/faultline")]
    pub data_dir: PathBuf,
    /// Policy file (YAML or JSON); reloaded when it changes. Default: built-in policy.
    #[arg(long, env = "FAULTLINE_POLICY")]
    pub policy: Option<PathBuf>,
    #[arg(
        long,
        env = "FAULTLINE_BOOT_ID_PATH",
        default_value = "/proc/sys/kernel/random/boot_id",
        hide = true
    )]
    pub boot_id_path: PathBuf,
    #[arg(
        long,
        env = "FAULTLINE_PROC_STAT_PATH",
        default_value = "/proc/stat",
        hide = true
    )]
    pub proc_stat_path: PathBuf,
    #[command(flatten, next_help_heading = "Kernel log")]
    pub kmsg: kmsg::Flags,
    #[command(flatten, next_help_heading = "NVML")]
    pub nvml: nvml::Flags,
    #[command(flatten, next_help_heading = "Ascend")]
    pub ascend: ascend::Flags,
    #[command(flatten, next_help_heading = "Kubernetes")]
    pub kube: kube_client::Flags,
    #[command(flatten, next_help_heading = "Kubernetes sinks")]
    pub kube_sinks: kube_sink::Flags,
    #[command(flatten, next_help_heading = "Local record")]
    pub file: sink::file::Flags,
    #[command(flatten, next_help_heading = "Endpoints")]
    pub http: http::Flags,
    #[command(flatten, next_help_heading = "Peer checks")]
    pub peer: peer::Flags,
}

/// This host's name (the kernel's), `localhost` when it cannot be read; the agent's node name
/// and the coordinator's replica name by default.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Runs the agent until `shutdown` is cancelled, then flushes and returns.
pub async fn run(cfg: AgentConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_with_reload(cfg, shutdown, Arc::default()).await
}

/// [`run`], with a trigger that makes the agent re-read its policy file now (SIGHUP).
pub async fn run_with_reload(
    cfg: AgentConfig,
    shutdown: CancellationToken,
    reload: Arc<tokio::sync::Notify>,
) -> anyhow::Result<()> {
    let node = cfg.node_name.clone().unwrap_or_else(hostname);
    let span = tracing::info_span!("agent", node = %node);
    run_node(cfg, node, shutdown, reload).instrument(span).await
}

/// What the daemon waits on at shutdown, in the order it stops them.
#[derive(Default)]
struct Running {
    engine: Handle,
    sinks: Handle,
    sources: Handle,
    peer: Handle,
}

impl Running {
    /// Every part stops on the one shutdown signal. Waited for in this order: the engine loop
    /// (it applies what is already queued and publishes a final snapshot), the sinks (they
    /// write that snapshot), the sources, the peer tasks.
    async fn stop(self) {
        self.engine.join().await;
        self.sinks.join().await;
        self.sources.join().await;
        self.peer.join().await;
    }
}

async fn run_node(
    cfg: AgentConfig,
    node: String,
    shutdown: CancellationToken,
    reload: Arc<tokio::sync::Notify>,
) -> anyhow::Result<()> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let restore_cfg = RestoreConfig {
        state_dir: cfg.state_dir.clone(),
        data_dir: cfg.data_dir.clone(),
        boot_id_path: cfg.boot_id_path.clone(),
        proc_stat_path: cfg.proc_stat_path.clone(),
        namespace: cfg.kube.namespace.clone(),
        clock: clock.clone(),
    };
    let _locks = restore::take_directories(&restore_cfg, &node).await?;
    let catalog = Arc::new(Catalog::builtin().context("built-in catalog")?);
    let restored = restore::restore(&restore_cfg, &node, &catalog);
    // Connection floods are capped per server (listen.rs); the rest of the descriptors are the
    // agent's own, and there should be as many as the system allows.
    let files = crate::listen::raise_file_limit();
    info!(open_files = ?files, "open-file limit");

    // Detection does not wait for a slow policy file: past START_WAIT it starts on the
    // built-in policy, and the file's policy replaces it when read.
    let metrics = Arc::new(Metrics::new());
    let reader = policy_watch::file_reader();
    let (loaded, first) = policy_watch::initial_bounded(
        cfg.policy.as_deref(),
        &metrics,
        reader.clone(),
        policy_watch::START_WAIT,
    )
    .await;
    // The sender lives for the whole run, so the policy channel never closes.
    let (policy_tx, policy) = watch::channel(loaded);
    let (inputs_tx, inputs) = mpsc::channel::<Input>(8192);
    let (snapshots_tx, snapshots) = watch::channel(None);
    let heartbeat = Arc::new(Heartbeat::default());
    heartbeat.beat(&*clock);
    let kube = cfg.kube.connect(&node).await;
    let cx = Context {
        node,
        inputs: inputs_tx,
        snapshots,
        policy,
        metrics,
        clock,
        kube,
        shutdown: shutdown.clone(),
    };
    let mut running = Running::default();

    let timeline = Timeline::for_boot(
        restored.saved_timeline.as_ref(),
        restored.boot_id.as_deref(),
        cx.clock.now(),
        cx.clock.since_boot(),
    );
    info!(anchor = %timeline.anchor, boot_id = ?timeline.boot_id, "engine timeline");
    if let Some(b) = &restored.boot_id {
        let boot = Input::Obs(Observation::Boot { boot_id: b.clone() });
        cx.inputs.send(boot).await.ok();
    }

    // Sources. They stop on their own signal, after the engine loop has drained their inputs.
    let policy_file = cfg.policy.clone().map(|path| policy_watch::PolicyFile {
        path,
        tx: policy_tx.clone(),
        recheck: Duration::from_secs(30),
        reload,
        reader,
        first,
    });
    let record_status = watch::channel(RecordStatus::NotYetWritten).0;
    let persisted = watch::channel(0).0;
    let (clear_results, results) = mpsc::unbounded_channel();
    let clears = control::Control {
        state_dir: cfg.state_dir.clone(),
        persisted: persisted.subscribe(),
        results,
    };
    let (gpu_count, gpu_count_label) = gpu_count::GpuCountWatch::new(cx.kube.is_some());
    running.sources.add(policy_file.start(&cx).await?);
    running.sources.add(clears.start(&cx).await?);
    running.sources.add(gpu_count.start(&cx).await?);
    let calls = cx.kube.as_ref().map(|k| k.calls.clone());
    let restored = restore::from_cluster(
        restored,
        calls,
        &restore_cfg,
        &cx.node,
        &catalog,
        &cx.policy,
        &timeline,
    )
    .await;
    let kmsg = cfg.kmsg.config(
        restored.kmsg_cursor,
        restored.kmsg_skip_through,
        // Records are dated on the engine's timeline (boot + their monotonic timestamp), not
        // by /proc/stat's btime, which a wall-clock step moves.
        timeline.anchor,
    );
    for started in [
        kmsg.start(&cx).await,
        cfg.nvml.source(gpu_count_label).start(&cx).await,
        cfg.ascend.source().start(&cx).await,
    ] {
        running.sources.add(started?);
    }
    let peer = peer::Peer {
        flags: cfg.peer.clone(),
        node_token_file: cfg.kube.node_token_file.clone(),
        namespace: cfg.kube.namespace.clone(),
        busy: peer::busy::from_flags(&cfg.nvml),
    };
    running.peer = peer.start(&cx).await.unwrap_or_else(|e| {
        warn!(error = %format!("{:#}", anyhow::Error::from(e)), "peer checks disabled");
        Handle::none()
    });

    // The engine loop.
    let (report_tx, report_rx) = watch::channel(SinkReport {
        taint_budget: restored.taint_budget.clone(),
    });
    let (events_tx, events_rx) = mpsc::channel(kube_sink::events::QUEUE);
    let engine_loop = EngineLoop {
        node: cx.node.clone(),
        engine: restored.engine,
        timeline,
        kmsg_cursor: restored.kmsg_cursor,
        boot_time: restored.boot_time,
        marker: 0,
        clears: restored.clears,
        clear_results,
        catalog,
        policy: cx.policy.clone(),
        inputs,
        snapshots: snapshots_tx,
        metrics: cx.metrics.clone(),
        clock: cx.clock.clone(),
        heartbeat: heartbeat.clone(),
        liveness: crate::engine_loop::LIVENESS,
        events: cx.kube.is_some().then_some(events_tx),
        sink_report: report_rx,
        record_writer: record_status.subscribe(),
        shutdown: shutdown.clone(),
    };
    running.engine = Handle::spawn("engine", engine_loop.run());

    // Sinks and the endpoints. They stop on shutdown, after their last write.
    let public_faults = sink::PublicFaults {
        data_dir: cfg.data_dir.clone(),
        settle: cfg.kube_sinks.settle,
    };
    let kube_sinks = kube_sink::KubeSinks {
        config: cfg.kube_sinks.config(&cx.node, &cfg.kube),
        events: events_rx,
        report: report_tx,
    };
    let file = sink::file::FileSink {
        dirs: sink::file::Dirs {
            record: cfg.state_dir.clone(),
            data: cfg.data_dir.clone(),
        },
        flags: cfg.file.clone(),
        signals: sink::file::FileSinkSignals {
            status: record_status.clone(),
            persisted,
        },
        engine: heartbeat.clone(),
    };
    for started in [
        public_faults.start(&cx).await,
        kube_sinks.start(&cx).await,
        file.start(&cx).await,
    ] {
        running.sinks.add(started?);
    }
    let endpoints = http::Endpoints {
        flags: cfg.http.clone(),
        state_dir: cfg.state_dir.clone(),
        heartbeat,
        record: record_status.subscribe(),
    };
    match endpoints.start(&cx).await {
        Ok(h) => running.sinks.add(h),
        Err(e) => {
            // Nothing is flushed by a half-started agent that exits here: stop what runs.
            shutdown.cancel();
            running.stop().await;
            return Err(e.into());
        }
    }
    running.stop().await;
    drop(policy_tx);
    info!("faultline agent stopped; record flushed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::net::SocketAddr;

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        cfg: AgentConfig,
    }

    /// `--kube-write-interval` takes 0 (every change at once) up to 10 minutes; longer is refused
    /// with the limit named (an absurd value would overflow the clock).
    #[test]
    fn the_kube_write_interval_is_bounded() {
        let parse = |v: &str| Flags::try_parse_from(["agent", "--kube-write-interval", v]);
        assert_eq!(
            parse("0s").unwrap().cfg.kube_sinks.kube_write_interval,
            Duration::ZERO
        );
        assert_eq!(
            parse("10m").unwrap().cfg.kube_sinks.kube_write_interval,
            Duration::from_secs(600)
        );
        for bad in ["11m", "300000000000y", "soon"] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("kube-write-interval"), "{bad}: {e}");
        }
        assert!(parse("1d")
            .unwrap_err()
            .to_string()
            .contains("longer than 10m"));
    }

    /// On bare metal every interface is the host's: the endpoints stay on loopback unless
    /// `--listen` says otherwise. In a pod (its own network namespace) they listen on all.
    #[test]
    fn the_endpoints_listen_on_loopback_outside_a_pod() {
        assert_eq!(
            http::default_listen(false),
            SocketAddr::from(([127, 0, 0, 1], 20260))
        );
        assert_eq!(
            http::default_listen(true),
            SocketAddr::from(([0, 0, 0, 0], 20260))
        );
        // No flag: the choice is left to `default_listen`; a flag wins.
        let none = Flags::try_parse_from(["faultline-agent"]).unwrap();
        if std::env::var_os("FAULTLINE_LISTEN").is_none() {
            assert_eq!(none.cfg.http.listen, None);
        }
        let given = Flags::try_parse_from(["faultline-agent", "--listen", "0.0.0.0:9"]).unwrap();
        assert_eq!(
            given.cfg.http.listen,
            Some(SocketAddr::from(([0, 0, 0, 0], 9)))
        );
    }
}
