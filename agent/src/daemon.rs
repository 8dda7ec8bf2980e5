//! The agent process: configuration, start-up (restore state, load policy), wiring sources,
//! the engine loop and sinks together, and an orderly shutdown that flushes the record.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use crate::http::{self, HttpState};
use crate::metrics::Metrics;
use crate::runtime::{Clock, EngineLoop, Heartbeat, SinkReport, SystemClock};
use crate::sink::kube as kube_sink;
use crate::sink::{file, mindcluster};
use crate::source::{ascend, control, kmsg, node, nvml, policy_watch, Input, SourceContext};
use faultline_core::catalog::Catalog;
use faultline_core::engine::Observation;

/// Written into the state directory while the agent runs: the address its endpoints are bound
/// to (useful with `--listen …:0`).
pub const LISTEN_ADDR_FILE: &str = "listen.addr";

/// Default port of the metrics/health endpoints.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:20260";

/// Default address of the peer-check service.
pub const DEFAULT_PEER_LISTEN: &str = "0.0.0.0:20261";

/// Agent configuration: flags, each also settable by an environment variable.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentConfig {
    /// This node's name (Kubernetes: from the downward API). Default: the host name.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Where the local record (`faults.json`) and the restart state live.
    #[arg(long, env = "FAULTLINE_STATE_DIR", default_value = "/run/faultline")]
    pub state_dir: PathBuf,
    /// Kernel log to read: `/dev/kmsg`, or a file or FIFO of kmsg records or dmesg lines.
    #[arg(long, env = "FAULTLINE_KMSG_PATH", default_value = "/dev/kmsg")]
    pub kmsg_path: PathBuf,
    /// Do not read the kernel log at all.
    #[arg(long)]
    pub no_kmsg: bool,
    /// NVML library to load instead of the system's `libnvidia-ml.so.1`.
    #[arg(long, env = "FAULTLINE_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// Do not use NVML at all.
    #[arg(long)]
    pub no_nvml: bool,
    /// Do not poll the Ascend tools (npu-smi, hccn_tool) at all.
    #[arg(long)]
    pub no_ascend: bool,
    /// Kubernetes: use this kubeconfig instead of the in-cluster service account.
    #[arg(long, env = "FAULTLINE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Never talk to Kubernetes, even inside a cluster.
    #[arg(long)]
    pub standalone: bool,
    /// Kubernetes: the namespace of the fault ConfigMaps and the taint ledger.
    #[arg(long, env = "POD_NAMESPACE", default_value = crate::sink::kube::DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Kubernetes: this agent's pod name (the reporting instance of its Events).
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Kubernetes: after start, changes that make the node look healthier wait this long (so a
    /// restarted agent re-detects standing faults before it untaints anything).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub settle: Duration,
    /// Kubernetes: how often a withheld taint asks the taint budget again.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration, hide = true)]
    pub budget_recheck: Duration,
    /// Kubernetes: how often the node is re-read to repair drift.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration, hide = true)]
    pub resync: Duration,
    /// Policy file (YAML or JSON); reloaded when it changes. Default: built-in policy.
    #[arg(long, env = "FAULTLINE_POLICY")]
    pub policy: Option<PathBuf>,
    /// Address of /metrics, /healthz, /readyz and /v1/record.
    #[arg(long, env = "FAULTLINE_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Local record writes: after a burst of `--write-burst` writes, at most one per this
    /// interval; changes in between are coalesced into the next write.
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    pub write_interval: Duration,
    #[arg(long, default_value_t = 3)]
    pub write_burst: u32,
    /// How often a kernel log file at its end is checked for growth.
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    pub follow_interval: Duration,
    /// Peer checks: the shared secret (a mounted Kubernetes Secret). Without it the agent takes
    /// no part in peer checks.
    #[arg(long, env = "FAULTLINE_PEER_SECRET_FILE")]
    pub peer_secret_file: Option<PathBuf>,
    /// Peer checks: where this agent's gRPC service listens.
    #[arg(long, env = "FAULTLINE_PEER_LISTEN", default_value = DEFAULT_PEER_LISTEN)]
    pub peer_listen: SocketAddr,
    /// Peer checks: the address (ip or ip:port) other agents reach this one at. Default: the
    /// pod IP (`POD_IP`), or this node's line of the members file.
    #[arg(long, env = "FAULTLINE_PEER_ADDRESS")]
    pub peer_address: Option<String>,
    /// Peer checks without Kubernetes: the members file (`node ip:port [topology]` per line);
    /// the first node listed coordinates.
    #[arg(long, env = "FAULTLINE_PEER_MEMBERS")]
    pub peer_members: Option<PathBuf>,
    /// Peer checks in Kubernetes: label selector of the agent pods.
    #[arg(long, env = "FAULTLINE_PEER_SELECTOR", default_value = crate::peer::members::DEFAULT_SELECTOR)]
    pub peer_selector: String,
    /// The `faultline-probe` binary. Default: next to this binary, else on PATH.
    #[arg(long, env = "FAULTLINE_PROBE")]
    pub probe_bin: Option<PathBuf>,
    /// First of the 32 ports the probes listen on during checks.
    #[arg(long, env = "FAULTLINE_PROBE_PORT_BASE", default_value_t = 20270)]
    pub probe_port_base: u16,
    #[arg(long, default_value = "/proc/sys/kernel/random/boot_id", hide = true)]
    pub boot_id_path: PathBuf,
    #[arg(long, default_value = "/proc/stat", hide = true)]
    pub proc_stat_path: PathBuf,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn read_boot_id(path: &Path) -> Option<String> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Ok(_) => None,
        Err(e) => {
            warn!(path = %path.display(), error = %e, "cannot read the boot id; kernel-log faults will not clear on reboot");
            None
        }
    }
}

/// The probe binary: the flag, else `faultline-probe` next to this binary, else on PATH.
fn probe_bin(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    let sibling = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("faultline-probe")))
        .filter(|p| p.exists());
    sibling.unwrap_or_else(|| PathBuf::from("faultline-probe"))
}

/// Everything peer checks need, or `None` when this agent cannot take part (said why).
async fn peer_setup(
    cfg: &AgentConfig,
    secret: &Path,
    node: &str,
    kube_client: Option<kube::Client>,
    policy: watch::Receiver<faultline_core::policy::LoadedPolicy>,
    ctx: SourceContext,
) -> anyhow::Result<Option<crate::peer::PeerSetup>> {
    use crate::peer::{self, members, publish, service};
    let key = peer::wire::load_key(secret)?;
    let static_members = match &cfg.peer_members {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            Some(members::parse_members(&p.display().to_string(), &text)?)
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(cfg.peer_listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.peer_listen))?;
    let port = listener.local_addr()?.port();
    let own_line = static_members
        .as_ref()
        .and_then(|m| m.iter().find(|m| m.node == node));
    let address: SocketAddr = match (&cfg.peer_address, std::env::var("POD_IP").ok(), own_line) {
        (Some(a), _, _) => match a.parse::<SocketAddr>() {
            Ok(sa) => sa,
            Err(_) => SocketAddr::new(
                a.parse()
                    .with_context(|| format!("--peer-address {a:?} is not an ip or ip:port"))?,
                port,
            ),
        },
        (None, Some(ip), _) => SocketAddr::new(
            ip.parse()
                .with_context(|| format!("POD_IP {ip:?} is not an ip"))?,
            port,
        ),
        (None, None, Some(m)) => m.address.parse()?,
        (None, None, None) if !cfg.peer_listen.ip().is_unspecified() => {
            SocketAddr::new(cfg.peer_listen.ip(), port)
        }
        _ => anyhow::bail!(
            "no address for other agents to reach this one: set --peer-address (or POD_IP)"
        ),
    };
    let (members, election, publisher): (
        Arc<dyn members::Members>,
        peer::Election,
        Arc<dyn peer::coordinator::Publisher>,
    ) = match (static_members, kube_client) {
        (Some(list), _) => {
            let first = list.first().map(|m| m.node == node).unwrap_or(false);
            let path = cfg.peer_members.clone().unwrap_or_default();
            (
                Arc::new(members::StaticMembers { path }),
                if first {
                    peer::Election::Always
                } else {
                    peer::Election::Never
                },
                Arc::new(publish::FilePublisher {
                    dir: cfg.state_dir.clone(),
                }),
            )
        }
        (None, Some(client)) => {
            let topology_label = policy.borrow().policy.peer.topology_label.clone();
            let identity = peer::lease::identity(node, &address.to_string());
            let lease = peer::lease::elect(
                client.clone(),
                cfg.namespace.clone(),
                identity,
                ctx.shutdown.clone(),
            );
            (
                Arc::new(members::KubeMembers {
                    client: client.clone(),
                    namespace: cfg.namespace.clone(),
                    selector: cfg.peer_selector.clone(),
                    port,
                    topology_label,
                }),
                peer::Election::Lease(lease),
                Arc::new(publish::KubePublisher {
                    client,
                    namespace: cfg.namespace.clone(),
                }),
            )
        }
        (None, None) => {
            info!("peer checks disabled: neither Kubernetes nor --peer-members says who the peers are");
            return Ok(None);
        }
    };
    let probe = service::ProbeSetup {
        bin: probe_bin(cfg.probe_bin.as_deref()),
        gpu: policy.borrow().policy.peer.gpu,
    };
    info!(address = %address, probe = %probe.bin.display(), "peer checks enabled");
    Ok(Some(peer::PeerSetup {
        node: node.to_string(),
        listener,
        address,
        key,
        probe,
        probe_port_base: cfg.probe_port_base,
        busy: if cfg.no_nvml {
            Arc::new(service::NeverBusy)
        } else {
            Arc::new(crate::peer::busy::NvmlBusy::new(cfg.nvml_lib.clone()))
        },
        members,
        publisher,
        election,
        policy,
        inputs: ctx.tx.clone(),
        shutdown: ctx.shutdown.clone(),
    }))
}

/// Runs the agent until `shutdown` is cancelled, then flushes and returns.
pub async fn run(cfg: AgentConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let node = cfg.node_name.clone().unwrap_or_else(hostname);
    let span = tracing::info_span!("agent", node = %node);
    run_node(cfg, node, shutdown).instrument(span).await
}

async fn run_node(
    cfg: AgentConfig,
    node: String,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let catalog = Arc::new(Catalog::builtin().context("built-in catalog")?);
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("cannot create state directory {}", cfg.state_dir.display()))?;
    std::fs::create_dir_all(cfg.state_dir.join(control::CLEAR_DIR)).ok();

    // Restore what the last run knew. Its kernel log cursor is only valid within the same boot.
    let boot_id = read_boot_id(&cfg.boot_id_path);
    let persisted = match file::read_state(&cfg.state_dir) {
        Ok(p) => p.unwrap_or_default(),
        Err(e) => {
            warn!(error = %e, "ignoring unreadable saved state; starting fresh");
            Default::default()
        }
    };
    let same_boot = boot_id.is_some() && persisted.engine.boot_id() == boot_id.as_deref();
    let resume_after = if same_boot {
        persisted.kmsg_cursor
    } else {
        None
    };
    info!(same_boot, resume_after = ?resume_after, faults = persisted.engine.faults().count(), "state restored");

    let loaded = policy_watch::initial(cfg.policy.as_deref(), &metrics);
    let (policy_tx, policy_rx) = watch::channel(loaded);
    let (in_tx, in_rx) = mpsc::channel::<Input>(8192);
    let (snap_tx, snap_rx) = watch::channel(None);
    let heartbeat = Arc::new(Heartbeat::default());
    heartbeat.beat(clock.now());
    let ready = Arc::new(AtomicBool::new(false));
    let source_shutdown = shutdown.child_token();
    let ctx = SourceContext {
        tx: in_tx.clone(),
        metrics: metrics.clone(),
        shutdown: source_shutdown.clone(),
    };
    if let Some(b) = &boot_id {
        in_tx
            .send(Input::Obs(Observation::Boot { boot_id: b.clone() }))
            .await
            .ok();
    }

    let mut tasks = tokio::task::JoinSet::new();
    if let Some(path) = cfg.policy.clone() {
        let watcher = policy_watch::watch_policy(
            path,
            policy_tx,
            metrics.clone(),
            source_shutdown.clone(),
            Duration::from_secs(30),
        );
        tasks.spawn(watcher.instrument(tracing::info_span!("source", name = "policy")));
    }
    let clears = control::run(cfg.state_dir.clone(), ctx.clone(), Duration::from_secs(1));
    tasks.spawn(clears.instrument(tracing::info_span!("source", name = "control")));
    if cfg.no_kmsg {
        info!("kernel log source disabled");
    } else {
        let kcfg = kmsg::KmsgConfig {
            path: cfg.kmsg_path.clone(),
            resume_after,
            boot_time: kmsg::boot_time(&cfg.proc_stat_path),
            follow_interval: cfg.follow_interval,
        };
        // A blocking thread: a read of /dev/kmsg cannot be cancelled, so it is not joined.
        kmsg::spawn(kcfg, ctx.clone());
    }
    // Kubernetes mode: a kubeconfig was given, or the agent runs in a pod. Anything failing here
    // leaves the agent standalone; detection never waits for the API.
    let (label_tx, label_rx) = watch::channel(None);
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    let mut kube_client = None;
    let mut peer_tasks = Vec::new();
    if !cfg.standalone && (cfg.kubeconfig.is_some() || in_cluster) {
        match crate::kube_client::client(cfg.kubeconfig.as_deref()).await {
            Ok(client) => {
                info!(node = %node, namespace = %cfg.namespace, "Kubernetes mode");
                let w = node::watch_gpu_count(
                    client.clone(),
                    node.clone(),
                    label_tx,
                    Duration::from_secs(60),
                    source_shutdown.clone(),
                );
                tasks.spawn(w.instrument(tracing::info_span!("source", name = "node")));
                kube_client = Some(client);
            }
            Err(e) => warn!(error = %e, "cannot reach Kubernetes; running standalone"),
        }
    }
    if cfg.no_nvml {
        info!("NVML source disabled");
    } else {
        let ncfg = nvml::NvmlConfig {
            library: cfg.nvml_lib.clone(),
        };
        let source = nvml::run(ncfg, policy_rx.clone(), label_rx, ctx.clone());
        tasks.spawn(source.instrument(tracing::info_span!("source", name = "nvml")));
    }
    if cfg.no_ascend {
        info!("Ascend source disabled");
    } else {
        let tools = Arc::new(ascend::tools::RealTools::new(policy_rx.clone()));
        let source = ascend::run(tools, policy_rx.clone(), ctx.clone());
        tasks.spawn(source.instrument(tracing::info_span!("source", name = "ascend")));
    }
    if let Some(secret) = &cfg.peer_secret_file {
        let policy = policy_rx.clone();
        match peer_setup(
            &cfg,
            secret,
            &node,
            kube_client.clone(),
            policy,
            ctx.clone(),
        )
        .await
        {
            Ok(Some(setup)) => peer_tasks = crate::peer::start(setup),
            Ok(None) => {}
            Err(e) => warn!(error = %format!("{e:#}"), "peer checks disabled"),
        }
    } else {
        info!("peer checks disabled (no --peer-secret-file)");
    }
    drop(ctx);
    drop(in_tx);

    let (report_tx, report_rx) = watch::channel(SinkReport::default());
    let (events_tx, events_rx) = mpsc::channel(kube_sink::events::QUEUE);
    let engine_loop = EngineLoop {
        node: node.clone(),
        engine: persisted.engine,
        kmsg_cursor: persisted.kmsg_cursor.filter(|_| same_boot),
        catalog,
        policy: policy_rx,
        inputs: in_rx,
        snapshots: snap_tx,
        metrics: metrics.clone(),
        clock: clock.clone(),
        heartbeat: heartbeat.clone(),
        tick: Duration::from_secs(1),
        events: kube_client.is_some().then_some(events_tx),
        sink_report: report_rx,
        shutdown: shutdown.clone(),
    };
    {
        let sink = mindcluster::MindClusterSink {
            dir: cfg.state_dir.clone(),
            publisher: mindcluster::FileOnly,
            snapshots: snap_rx.clone(),
            policy: engine_loop.policy.clone(),
            clock: clock.clone(),
            metrics: metrics.clone(),
            shutdown: shutdown.clone(),
        };
        let span = tracing::info_span!("sink", name = "mindcluster");
        match &kube_client {
            Some(c) => {
                let p = kube_sink::deviceinfo::DeviceInfoPublisher::new(c.clone(), &node);
                tasks.spawn(sink.with_publisher(p).run().instrument(span));
            }
            None => {
                tasks.spawn(sink.run().instrument(span));
            }
        }
    }
    let kube_sinks = match kube_client {
        Some(client) => {
            let kcfg = kube_sink::KubeSinkConfig {
                namespace: cfg.namespace.clone(),
                instance: cfg.pod_name.clone(),
                settle: cfg.settle,
                budget_recheck: cfg.budget_recheck,
                resync: cfg.resync,
                ..kube_sink::KubeSinkConfig::new(node.clone())
            };
            let inputs = kube_sink::KubeSinkInputs {
                snapshots: snap_rx.clone(),
                policy: engine_loop.policy.clone(),
                events: events_rx,
                report: report_tx,
            };
            kube_sink::spawn(
                client,
                kcfg,
                inputs,
                metrics.clone(),
                clock.clone(),
                shutdown.clone(),
            )
        }
        None => Vec::new(),
    };
    let engine_task = tokio::spawn(engine_loop.run());
    let sink_task = tokio::spawn(
        file::run(
            cfg.state_dir.clone(),
            snap_rx.clone(),
            metrics.clone(),
            file::WriteBudget::new(
                cfg.write_interval,
                cfg.write_burst,
                std::time::Instant::now(),
            ),
            ready.clone(),
            shutdown.clone(),
        )
        .instrument(tracing::info_span!("sink", name = "file")),
    );

    let listener = http::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let bound = listener.local_addr()?;
    info!(addr = %bound, state_dir = %cfg.state_dir.display(), "faultline agent running");
    let addr_file = cfg.state_dir.join(LISTEN_ADDR_FILE);
    let _ = crate::atomic_file::write(&addr_file, bound.to_string().as_bytes());
    let http_state = HttpState {
        metrics,
        heartbeat,
        clock,
        ready,
        snapshots: snap_rx,
    };
    tasks.spawn(async move {
        if let Err(e) = http::serve(listener, http_state, shutdown.clone()).await {
            warn!(error = %e, "HTTP server stopped");
        }
    });

    // Shutdown order: the engine drains its queue and publishes a final snapshot; the file sink
    // writes it; sources and the server stop.
    let _ = engine_task.await;
    source_shutdown.cancel();
    let _ = sink_task.await;
    for t in kube_sinks {
        let _ = t.await;
    }
    while tasks.join_next().await.is_some() {}
    for t in peer_tasks {
        let _ = t.await;
    }
    let _ = std::fs::remove_file(&addr_file);
    info!("faultline agent stopped; record flushed");
    Ok(())
}
