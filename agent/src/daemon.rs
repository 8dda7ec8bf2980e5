//! The agent process: configuration, start-up (state restored by `restore`, policy loaded),
//! wiring sources, the engine loop and sinks together, and an orderly shutdown that flushes the
//! record.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use crate::http::{self, HttpState};
use crate::metrics::Metrics;
use crate::restore::{self, Origin, RestoreConfig, Restored};
use crate::runtime::{Clock, EngineLoop, Heartbeat, SinkReport, Snapshot, SystemClock};
use crate::sink::kube as kube_sink;
use crate::sink::{file, mindcluster};
use crate::source::{ascend, control, kmsg, node, nvml, policy_watch, Input, SourceContext};
use faultline_core::catalog::Catalog;
use faultline_core::engine::Observation;
use faultline_core::policy::LoadedPolicy;

/// Written into the state directory while the agent runs: the address its endpoints are bound
/// to (useful with `--listen …:0`).
pub const LISTEN_ADDR_FILE: &str = "listen.addr";

/// Port of the metrics/health endpoints when `--listen` is not given.
pub const DEFAULT_HTTP_PORT: u16 = 20260;

/// Where the metrics/health endpoints listen when `--listen` is not given: every interface in a
/// pod (its own network namespace; the kubelet's probes and scrapers come to the pod IP), only
/// loopback elsewhere, where every interface is the host's (bare metal, Slurm).
pub fn default_listen(in_pod: bool) -> SocketAddr {
    let ip = if in_pod {
        std::net::Ipv4Addr::UNSPECIFIED
    } else {
        std::net::Ipv4Addr::LOCALHOST
    };
    SocketAddr::from((ip, DEFAULT_HTTP_PORT))
}

/// Whether this process runs in a Kubernetes pod (the kubelet sets this variable in every
/// container).
pub fn in_pod() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
}

/// Default address of the peer-check service.
pub const DEFAULT_PEER_LISTEN: &str = "0.0.0.0:20261";

/// Agent configuration: flags, each also settable by an environment variable.
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
    /// Kernel log to read: `/dev/kmsg`, or a file or FIFO of kmsg records or dmesg lines.
    #[arg(long, env = "FAULTLINE_KMSG_PATH", default_value = "/dev/kmsg")]
    pub kmsg_path: PathBuf,
    /// Do not read the kernel log at all.
    #[arg(long, env = "FAULTLINE_NO_KMSG", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_kmsg: bool,
    /// NVML library to load instead of the system's `libnvidia-ml.so.1`.
    #[arg(long, env = "FAULTLINE_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// Do not use NVML at all.
    #[arg(long, env = "FAULTLINE_NO_NVML", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_nvml: bool,
    /// Do not poll the Ascend tools (npu-smi, hccn_tool) at all.
    #[arg(long, env = "FAULTLINE_NO_ASCEND", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_ascend: bool,
    /// The `npu-smi` to run (as root): a path, or a name looked up on the agent's PATH. Only
    /// a flag, never the policy: changing it takes a rollout.
    #[arg(long, env = "FAULTLINE_NPU_SMI", default_value = "npu-smi")]
    pub npu_smi: PathBuf,
    /// The `hccn_tool` to run (as root): a path, or a name looked up on the agent's PATH.
    #[arg(long, env = "FAULTLINE_HCCN_TOOL", default_value = "hccn_tool")]
    pub hccn_tool: PathBuf,
    /// Kubernetes: use this kubeconfig instead of the in-cluster service account.
    #[arg(long, env = "FAULTLINE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Never talk to Kubernetes, even inside a cluster.
    #[arg(long, env = "FAULTLINE_STANDALONE", value_parser = clap::builder::BoolishValueParser::new())]
    pub standalone: bool,
    /// Kubernetes: the namespace of the fault ConfigMaps, the coordinator's Lease and Service
    /// (the default `--coordinator`).
    #[arg(long, env = "POD_NAMESPACE", default_value = crate::sink::kube::DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Kubernetes: this agent's pod name (the reporting instance of its Events).
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Kubernetes: after start, changes that make the node look healthier wait this long (so a
    /// restarted agent re-detects standing faults before it untaints anything).
    #[arg(long, env = "FAULTLINE_SETTLE", default_value = "30s", value_parser = humantime::parse_duration)]
    pub settle: Duration,
    /// Kubernetes: how often a withheld taint asks the taint budget again.
    #[arg(long, env = "FAULTLINE_BUDGET_RECHECK", default_value = "15s", value_parser = humantime::parse_duration, hide = true)]
    pub budget_recheck: Duration,
    /// Kubernetes: how often the node is re-read to repair drift.
    #[arg(long, env = "FAULTLINE_RESYNC", default_value = "5m", value_parser = humantime::parse_duration, hide = true)]
    pub resync: Duration,
    /// Kubernetes: a change of the fault ConfigMap that only moves counts and last-seen times
    /// (a fault repeating) is written at most once per this interval, the newest count at the
    /// end of it; a change of health, handling or the set of faults is written at once.
    /// `0s` writes every change at once; at most 10m.
    #[arg(long, env = "FAULTLINE_KUBE_WRITE_INTERVAL", default_value = "10s", value_parser = parse_kube_write_interval)]
    pub kube_write_interval: Duration,
    /// Kubernetes: Events published per minute once the burst is spent (a token bucket);
    /// notices over the budget get no Event (counted in
    /// `faultline_kube_events_rate_limited_total`).
    #[arg(long, env = "FAULTLINE_KUBE_EVENT_RATE", default_value_t = crate::sink::kube::events::RATE_PER_MINUTE,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub kube_event_rate: u32,
    /// Kubernetes: Events that may be published back to back (the token bucket's size).
    #[arg(long, env = "FAULTLINE_KUBE_EVENT_BURST", default_value_t = crate::sink::kube::events::BURST,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub kube_event_burst: u32,
    /// How often the local record is rewritten when nothing changed, so that its
    /// `heartbeatTime` shows the agent alive (`faultline wait-healthy` checks it).
    #[arg(long, env = "FAULTLINE_HEARTBEAT_INTERVAL", default_value = "10s", value_parser = parse_heartbeat)]
    pub heartbeat_interval: Duration,
    /// Policy file (YAML or JSON); reloaded when it changes. Default: built-in policy.
    #[arg(long, env = "FAULTLINE_POLICY")]
    pub policy: Option<PathBuf>,
    /// Address of /metrics, /healthz, /readyz and /v1/record. Default: 0.0.0.0:20260 in a pod,
    /// 127.0.0.1:20260 elsewhere.
    #[arg(long, env = "FAULTLINE_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Local record writes: after a burst of `--write-burst` writes, at most one per this
    /// interval; changes in between are coalesced into the next write.
    #[arg(long, env = "FAULTLINE_WRITE_INTERVAL", default_value = "200ms", value_parser = humantime::parse_duration)]
    pub write_interval: Duration,
    /// Local record writes that may go out back to back before `--write-interval` applies.
    #[arg(long, env = "FAULTLINE_WRITE_BURST", default_value_t = 3)]
    pub write_burst: u32,
    /// How often a kernel log file at its end is checked for growth.
    #[arg(long, env = "FAULTLINE_FOLLOW_INTERVAL", default_value = "10ms", value_parser = humantime::parse_duration)]
    pub follow_interval: Duration,
    /// Nice value of the kernel-log reader's thread (-20 to 19; 0 leaves it). A reader that
    /// falls behind the kernel's ring loses records (`faultline_kmsg_lost_records_total`); at
    /// -5 the reader weighs three times a normal process while records arrive, and uses no CPU
    /// otherwise. Needs CAP_SYS_NICE (the DaemonSet is privileged); without it the agent says so
    /// and reads at its own priority.
    #[arg(long, env = "FAULTLINE_KMSG_NICE", default_value_t = -5, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub kmsg_nice: i32,
    /// Kubernetes: this agent's projected service-account token (audience `faultline-peer`),
    /// what the coordinator knows this node by: its peer-check reports and its taint-budget
    /// admissions carry it, and the coordinator takes the node's name from it (TokenReview).
    /// Re-read for every request (the kubelet rotates it). Without it the node is labelled but
    /// never newly tainted, and takes no part in peer checks.
    #[arg(long, env = "FAULTLINE_NODE_TOKEN_FILE")]
    pub node_token_file: Option<PathBuf>,
    /// Kubernetes: where the taint budget is asked (`host:port`), the coordinator's Service.
    /// Default: `faultline-coordinator.<namespace>.svc.cluster.local.:20262`; set it in a
    /// cluster whose domain is not `cluster.local`. (`faultline check --coordinator` reads the
    /// same variable.)
    #[arg(long, env = "FAULTLINE_COORDINATOR")]
    pub coordinator: Option<String>,
    /// Peer checks without Kubernetes: this node's own key (`faultline keys node`); its reports
    /// are signed with it, and no other node holds it.
    #[arg(long, env = "FAULTLINE_PEER_NODE_KEY_FILE")]
    pub peer_node_key_file: Option<PathBuf>,
    /// Peer checks without Kubernetes: the coordinator's public key (`faultline keys
    /// coordinator` prints it). Only messages it signed assign checks or conclude runs here.
    /// (Its text may begin with `-`: it is taken as the value.)
    #[arg(
        long,
        env = "FAULTLINE_PEER_COORDINATOR_KEY",
        allow_hyphen_values = true
    )]
    pub peer_coordinator_key: Option<String>,
    /// Peer checks: where this agent's gRPC service listens.
    #[arg(long, env = "FAULTLINE_PEER_LISTEN", default_value = DEFAULT_PEER_LISTEN)]
    pub peer_listen: SocketAddr,
    /// The `faultline-probe` binary. Default: next to this binary, else on PATH.
    #[arg(long, env = "FAULTLINE_PROBE")]
    pub probe_bin: Option<PathBuf>,
    /// First of the 32 ports the probes listen on during checks.
    #[arg(long, env = "FAULTLINE_PROBE_PORT_BASE", default_value_t = 20270)]
    pub probe_port_base: u16,
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
}

/// `--heartbeat-interval`: between 1 s and 10 s, so that three heartbeats fit in the 30 s that
/// readers (`faultline wait-healthy --stale-after`) allow by default.
fn parse_heartbeat(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if !(Duration::from_secs(1)..=Duration::from_secs(10)).contains(&d) {
        return Err(format!("{s} is outside 1s..=10s"));
    }
    Ok(d)
}

/// `--kube-write-interval`: counts held back longer than 10 minutes would make the ConfigMap
/// useless to a scheduler reading it (and an absurd value would overflow the clock).
fn parse_kube_write_interval(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d > Duration::from_secs(600) {
        return Err(format!("{s} is longer than 10m"));
    }
    Ok(d)
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
    node: &str,
    kube_client: Option<crate::kube_client::Clients>,
    policy: watch::Receiver<LoadedPolicy>,
    ctx: SourceContext,
) -> anyhow::Result<Option<crate::peer::PeerSetup>> {
    use crate::peer::{self, authz, service, wire};
    let (coordinator, credential): (Arc<dyn authz::WhoCoordinates>, wire::NodeCredential) =
        match kube_client {
            Some(client) => {
                let Some(token) = cfg.node_token_file.clone() else {
                    info!("peer checks disabled (no --node-token-file: the service-account token the coordinator knows this node by)");
                    return Ok(None);
                };
                (
                    Arc::new(authz::LeaseHolder::new(
                        client.calls.clone(),
                        cfg.namespace.clone(),
                    )),
                    wire::NodeCredential::Token(token),
                )
            }
            None => match (&cfg.peer_node_key_file, &cfg.peer_coordinator_key) {
                (Some(key), Some(public)) => (
                    Arc::new(authz::fixed(public.parse().with_context(|| {
                        "--peer-coordinator-key is not the coordinator's public key"
                    })?)),
                    wire::NodeCredential::Key(wire::load_node_key(key)?),
                ),
                (None, None) => {
                    info!("peer checks disabled (without Kubernetes they need --peer-node-key-file and --peer-coordinator-key)");
                    return Ok(None);
                }
                _ => anyhow::bail!(
                    "peer checks without Kubernetes need both --peer-node-key-file and --peer-coordinator-key"
                ),
            },
        };
    let listener = tokio::net::TcpListener::bind(cfg.peer_listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.peer_listen))?;
    let probe = service::ProbeSetup {
        bin: probe_bin(cfg.probe_bin.as_deref()),
        gpu: policy.borrow().policy.peer.gpu,
    };
    info!(listen = %cfg.peer_listen, probe = %probe.bin.display(), "peer checks enabled");
    Ok(Some(peer::PeerSetup {
        node: node.to_string(),
        listener,
        probe,
        probe_port_base: cfg.probe_port_base,
        busy: if cfg.no_nvml {
            Arc::new(service::NeverBusy)
        } else {
            Arc::new(crate::peer::busy::NvmlBusy::new(cfg.nvml_lib.clone()))
        },
        coordinator,
        credential,
        policy,
        inputs: ctx.tx.clone(),
        metrics: ctx.metrics.clone(),
        shutdown: ctx.shutdown.clone(),
    }))
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

/// The agent's parts, started one by one. Each component is started with the shutdown signal it
/// stops on: sources stop on `source_shutdown`, which is cancelled only after the engine loop
/// has drained its queue; the engine loop, the sinks and the HTTP server stop on `shutdown`.
/// [`Components::stop`] waits for them in that order.
struct Components {
    cfg: AgentConfig,
    node: String,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
    heartbeat: Arc<Heartbeat>,
    /// What the file sink last managed with the record (`/readyz`, the `record-file` detector).
    record_status: watch::Sender<crate::runtime::RecordStatus>,
    /// The highest engine-loop marker the file sink has written (clear requests wait for it).
    persisted: watch::Sender<u64>,
    /// The engine loop's reports on clear requests (the sender goes to the engine loop)...
    clear_results: mpsc::UnboundedSender<control::ClearApplied>,
    /// ... and the receiver to the clear requests' source, when it starts.
    clear_reports: Option<mpsc::UnboundedReceiver<control::ClearApplied>>,
    /// Re-read the policy now (SIGHUP).
    reload: Arc<tokio::sync::Notify>,
    shutdown: CancellationToken,
    source_shutdown: CancellationToken,
    policy: watch::Receiver<LoadedPolicy>,
    /// Kept for the whole run, so the policy channel never closes under the sources (the
    /// watcher, when there is a file, holds a clone).
    policy_tx: watch::Sender<LoadedPolicy>,
    /// Cloned by every source; dropped once the sources are started, so the engine loop sees the
    /// channel close when the last source has stopped.
    source_ctx: Option<SourceContext>,
    snapshots: watch::Receiver<Option<Snapshot>>,
    kube: Option<crate::kube_client::Clients>,
    /// Tasks that stop on `source_shutdown`.
    sources: JoinSet<()>,
    /// Sinks and the HTTP server: they stop on `shutdown`.
    sinks: Vec<JoinHandle<()>>,
    peer: Vec<JoinHandle<()>>,
    engine: Option<JoinHandle<()>>,
    addr_file: Option<PathBuf>,
}

/// The channel ends the engine loop takes.
struct EngineEnds {
    inputs: mpsc::Receiver<Input>,
    snapshots: watch::Sender<Option<Snapshot>>,
}

impl Components {
    fn new(
        cfg: AgentConfig,
        node: String,
        metrics: Arc<Metrics>,
        loaded: LoadedPolicy,
        shutdown: CancellationToken,
        reload: Arc<tokio::sync::Notify>,
    ) -> (Self, EngineEnds) {
        let (policy_tx, policy) = watch::channel(loaded);
        let (in_tx, inputs) = mpsc::channel::<Input>(8192);
        let (snap_tx, snapshots) = watch::channel(None);
        let source_shutdown = shutdown.child_token();
        let (clear_results, clear_reports) = mpsc::unbounded_channel();
        let source_ctx = SourceContext {
            tx: in_tx,
            metrics: metrics.clone(),
            shutdown: source_shutdown.clone(),
        };
        let c = Components {
            cfg,
            node,
            metrics,
            clock: Arc::new(SystemClock),
            heartbeat: Arc::new(Heartbeat::default()),
            record_status: watch::channel(crate::runtime::RecordStatus::NotYetWritten).0,
            persisted: watch::channel(0).0,
            clear_results,
            clear_reports: Some(clear_reports),
            reload,
            shutdown,
            source_shutdown,
            policy,
            policy_tx,
            source_ctx: Some(source_ctx),
            snapshots,
            kube: None,
            sources: JoinSet::new(),
            sinks: Vec::new(),
            peer: Vec::new(),
            engine: None,
            addr_file: None,
        };
        let ends = EngineEnds {
            inputs,
            snapshots: snap_tx,
        };
        (c, ends)
    }

    fn ctx(&self) -> SourceContext {
        self.source_ctx
            .clone()
            .expect("sources are started before the engine loop")
    }

    /// Starts a source task; if it dies of a panic, `detectors` are reported Down
    /// ([`watched_task`](crate::source::watched_task)).
    fn spawn_source(
        &mut self,
        name: &'static str,
        detectors: &'static [&'static str],
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        let watched = crate::source::watched_task(name, detectors, self.ctx(), task);
        self.sources
            .spawn(watched.instrument(tracing::info_span!("source", name)));
    }

    fn spawn_sink(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        self.sinks.push(tokio::spawn(
            task.instrument(tracing::info_span!("sink", name)),
        ));
    }

    /// The policy watcher (when a file is given; it finishes a slow start-up load) and the
    /// operator's clear requests.
    fn start_policy_and_control(&mut self, pending: Option<policy_watch::FirstLoad>) {
        if let Some(path) = self.cfg.policy.clone() {
            let watcher = policy_watch::watch_policy(
                path,
                self.policy_tx.clone(),
                self.metrics.clone(),
                self.source_shutdown.clone(),
                Duration::from_secs(30),
                self.reload.clone(),
                policy_watch::file_reader(),
                pending,
            );
            self.spawn_source("policy", &[], watcher);
        }
        let reports = self
            .clear_reports
            .take()
            .expect("the clear requests' source is started once");
        let clears = control::run(
            self.cfg.state_dir.clone(),
            self.ctx(),
            self.persisted.subscribe(),
            reports,
            // Read again after a passing failure; read on changes (inotify) otherwise.
            Duration::from_secs(1),
        );
        self.spawn_source("control", &[], clears);
    }

    /// The kernel log, on its own thread: a read of /dev/kmsg cannot be cancelled, so the thread
    /// is not joined; it stops at its next record after `source_shutdown`.
    fn start_kmsg(
        &mut self,
        resume_after: Option<faultline_core::engine::KmsgPosition>,
        skip_through: Option<faultline_core::time::Timestamp>,
        timeline: &faultline_core::time::Timeline,
    ) {
        if self.cfg.no_kmsg {
            info!("kernel log source disabled");
            return;
        }
        let kcfg = kmsg::KmsgConfig {
            path: self.cfg.kmsg_path.clone(),
            resume_after,
            skip_through,
            // Records are dated on the engine's timeline (boot + their monotonic timestamp),
            // not by /proc/stat's btime, which a wall-clock step moves.
            boot_time: Some(timeline.anchor),
            follow_interval: self.cfg.follow_interval,
            nice: self.cfg.kmsg_nice,
        };
        kmsg::spawn(kcfg, self.ctx());
    }

    /// Kubernetes mode: a kubeconfig was given, or the agent runs in a pod. Anything failing here
    /// leaves the agent standalone; detection never waits for the API. Returns the expected GPU
    /// count from the Node's label, as a channel the NVML source reads.
    async fn connect_kubernetes(&mut self) -> watch::Receiver<node::GpuCountLabel> {
        // Standalone there is no label to wait for.
        let (label_tx, label_rx) = watch::channel(node::GpuCountLabel::Read(None));
        if self.cfg.standalone || (self.cfg.kubeconfig.is_none() && !in_pod()) {
            return label_rx;
        }
        match crate::kube_client::clients(self.cfg.kubeconfig.as_deref(), &self.node).await {
            Ok(client) => {
                info!(node = %self.node, namespace = %self.cfg.namespace, "Kubernetes mode");
                label_tx.send_replace(node::GpuCountLabel::Unread);
                let w = node::watch_gpu_count(
                    client.calls.clone(),
                    self.node.clone(),
                    label_tx,
                    Duration::from_secs(60),
                    self.source_shutdown.clone(),
                );
                self.spawn_source("node", &[], w);
                self.kube = Some(client);
            }
            Err(e) => warn!(error = %e, "cannot reach Kubernetes; running standalone"),
        }
        label_rx
    }

    /// NVML and the Ascend tools, unless disabled.
    fn start_accelerators(&mut self, gpu_count_label: watch::Receiver<node::GpuCountLabel>) {
        if self.cfg.no_nvml {
            info!("NVML source disabled");
        } else {
            let ncfg = nvml::NvmlConfig {
                library: self.cfg.nvml_lib.clone(),
            };
            let source = nvml::run(ncfg, self.policy.clone(), gpu_count_label, self.ctx());
            self.spawn_source("nvml", &[crate::metrics::DETECTOR_NVML], source);
        }
        if self.cfg.no_ascend {
            info!("Ascend source disabled");
        } else {
            let paths = ascend::tools::ToolPaths {
                npu_smi: self.cfg.npu_smi.clone(),
                hccn_tool: self.cfg.hccn_tool.clone(),
            };
            let tools = Arc::new(ascend::tools::RealTools::new(paths));
            let source = ascend::run(tools, self.policy.clone(), self.ctx());
            self.spawn_source(
                "ascend",
                &[
                    crate::metrics::DETECTOR_NPU_SMI,
                    crate::metrics::DETECTOR_HCCN,
                ],
                source,
            );
        }
    }

    /// Peer checks, when this node has its credential and knows the coordinator's.
    async fn start_peer(&mut self) {
        let setup = peer_setup(
            &self.cfg,
            &self.node,
            self.kube.clone(),
            self.policy.clone(),
            self.ctx(),
        )
        .await;
        match setup {
            Ok(Some(setup)) => self.peer = crate::peer::start(setup),
            Ok(None) => {}
            Err(e) => warn!(error = %format!("{e:#}"), "peer checks disabled"),
        }
    }

    /// The engine loop and every sink. The sources' sender is dropped here: from now on the
    /// input channel closes when the last source stops.
    fn start_engine_and_sinks(
        &mut self,
        restored: Restored,
        timeline: faultline_core::time::Timeline,
        catalog: Arc<Catalog>,
        ends: EngineEnds,
    ) {
        self.source_ctx = None;
        let (report_tx, report_rx) = watch::channel(SinkReport {
            taint_budget: restored.taint_budget.clone(),
        });
        let (events_tx, events_rx) = mpsc::channel(kube_sink::events::QUEUE);
        let engine_loop = EngineLoop {
            node: self.node.clone(),
            engine: restored.engine,
            timeline,
            kmsg_cursor: restored.kmsg_cursor,
            boot_time: restored.boot_time,
            marker: 0,
            clears: restored.clears,
            clear_results: self.clear_results.clone(),
            catalog,
            policy: self.policy.clone(),
            inputs: ends.inputs,
            snapshots: ends.snapshots,
            metrics: self.metrics.clone(),
            clock: self.clock.clone(),
            heartbeat: self.heartbeat.clone(),
            liveness: crate::runtime::LIVENESS,
            events: self.kube.is_some().then_some(events_tx),
            sink_report: report_rx,
            record_writer: self.record_status.subscribe(),
            shutdown: self.shutdown.clone(),
        };
        self.engine = Some(tokio::spawn(engine_loop.run()));

        let mind = mindcluster::MindClusterSink {
            dir: self.cfg.state_dir.clone(),
            publisher: mindcluster::FileOnly,
            snapshots: self.snapshots.clone(),
            policy: self.policy.clone(),
            clock: self.clock.clone(),
            metrics: self.metrics.clone(),
            shutdown: self.shutdown.clone(),
        };
        match self.kube.clone() {
            Some(c) => {
                let p =
                    kube_sink::deviceinfo::DeviceInfoPublisher::new(c.calls.clone(), &self.node);
                self.spawn_sink("mindcluster", mind.with_publisher(p).run());
                // Public faults go to ClusterD, which exists only in a cluster. The outbox is
                // durable state (the data directory): after a reboot, the faults the reboot
                // ended must still be retracted (ClusterD clears a public fault only on
                // `recover`).
                let public = crate::sink::publicfault::PublicFaultSink {
                    node: self.node.clone(),
                    dir: self.cfg.data_dir.clone(),
                    settle: self.cfg.settle,
                    publisher: kube_sink::deviceinfo::DeviceInfoPublisher::public_faults(
                        c.calls, &self.node,
                    ),
                    snapshots: self.snapshots.clone(),
                    policy: self.policy.clone(),
                    clock: self.clock.clone(),
                    metrics: self.metrics.clone(),
                    shutdown: self.shutdown.clone(),
                };
                self.spawn_sink("publicfault", public.run());
            }
            None => self.spawn_sink("mindcluster", mind.run()),
        }
        if let Some(client) = self.kube.clone() {
            if self.cfg.node_token_file.is_none() {
                warn!("no --node-token-file: the coordinator cannot know this node, so it is labelled when unhealthy but never newly tainted");
            }
            let kcfg = kube_sink::KubeSinkConfig {
                namespace: self.cfg.namespace.clone(),
                instance: self.cfg.pod_name.clone(),
                settle: self.cfg.settle,
                budget_recheck: self.cfg.budget_recheck,
                node_token_file: self.cfg.node_token_file.clone(),
                coordinator: self
                    .cfg
                    .coordinator
                    .clone()
                    .unwrap_or_else(|| kube_sink::coordinator_service(&self.cfg.namespace)),
                resync: self.cfg.resync,
                write_interval: self.cfg.kube_write_interval,
                event_rate: self.cfg.kube_event_rate,
                event_burst: self.cfg.kube_event_burst,
                ..kube_sink::KubeSinkConfig::new(self.node.clone())
            };
            let inputs = kube_sink::KubeSinkInputs {
                snapshots: self.snapshots.clone(),
                events: events_rx,
                report: report_tx,
            };
            self.sinks.extend(kube_sink::spawn(
                client,
                kcfg,
                inputs,
                self.metrics.clone(),
                self.clock.clone(),
                self.shutdown.clone(),
            ));
        }
        let budget = crate::pace::WriteBudget::new(
            self.cfg.write_interval,
            self.cfg.write_burst,
            tokio::time::Instant::now(),
        );
        let file_sink = file::run(
            file::Dirs {
                record: self.cfg.state_dir.clone(),
                data: self.cfg.data_dir.clone(),
            },
            self.snapshots.clone(),
            self.metrics.clone(),
            budget,
            file::FileSinkSignals {
                status: self.record_status.clone(),
                persisted: self.persisted.clone(),
            },
            file::HeartbeatConfig {
                every: self.cfg.heartbeat_interval,
                clock: self.clock.clone(),
                engine: self.heartbeat.clone(),
            },
            self.shutdown.clone(),
        );
        self.spawn_sink("file", file_sink);
    }

    /// `/metrics`, `/healthz`, `/readyz`, `/v1/record`; the bound address goes into the state
    /// directory.
    async fn start_http(&mut self) -> anyhow::Result<()> {
        let addr = self.cfg.listen.unwrap_or_else(|| default_listen(in_pod()));
        let listener = http::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let bound = listener.local_addr()?;
        info!(addr = %bound, state_dir = %self.cfg.state_dir.display(), "faultline agent running");
        let addr_file = self.cfg.state_dir.join(LISTEN_ADDR_FILE);
        let _ = crate::atomic_file::write(&addr_file, bound.to_string().as_bytes());
        self.addr_file = Some(addr_file);
        let state = HttpState {
            metrics: self.metrics.clone(),
            heartbeat: self.heartbeat.clone(),
            clock: self.clock.clone(),
            record: self.record_status.subscribe(),
            snapshots: self.snapshots.clone(),
            record_body: Default::default(),
        };
        let shutdown = self.shutdown.clone();
        self.spawn_sink("http", async move {
            if let Err(e) = http::serve(listener, state, shutdown).await {
                warn!(error = %e, "HTTP server stopped");
            }
        });
        Ok(())
    }

    /// Waits for `shutdown`, then stops in order: the engine drains its queue and publishes a
    /// final snapshot; the sources stop; the sinks write the final snapshot; the peer tasks end.
    async fn stop(mut self) {
        if let Some(engine) = self.engine.take() {
            let _ = engine.await;
        }
        self.source_shutdown.cancel();
        for t in self.sinks.drain(..) {
            let _ = t.await;
        }
        while self.sources.join_next().await.is_some() {}
        for t in self.peer.drain(..) {
            let _ = t.await;
        }
        if let Some(f) = &self.addr_file {
            let _ = std::fs::remove_file(f);
        }
    }
}

async fn run_node(
    cfg: AgentConfig,
    node: String,
    shutdown: CancellationToken,
    reload: Arc<tokio::sync::Notify>,
) -> anyhow::Result<()> {
    // 0755 whatever the umask (a user's 0002 would make them group-writable, which the lock
    // refuses): only the agent writes there; jobs read the record as other users.
    use std::os::unix::fs::DirBuilderExt;
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true).mode(0o755);
    builder
        .create(&cfg.state_dir)
        .with_context(|| format!("cannot create state directory {}", cfg.state_dir.display()))?;
    builder.create(&cfg.data_dir).with_context(|| {
        format!(
            "cannot create data directory {} (it holds the state a restart and a reboot need; \
             not running as root, give --data-dir a directory you can write, on a disk that \
             survives a reboot)",
            cfg.data_dir.display()
        )
    })?;
    // One agent per directory, before anything in them is read or written: a second agent
    // exits here, having changed nothing. Held until this function returns (the kernel
    // releases it if the process dies). On a blocking thread: file system calls.
    let (dirs, holder) = (
        [cfg.data_dir.clone(), cfg.state_dir.clone()],
        crate::lock::Holder::this_process(&node),
    );
    let _locks = tokio::task::spawn_blocking(move || {
        crate::lock::acquire_all(&[&dirs[0], &dirs[1]], &holder)
    })
    .await
    .context("taking the directory locks")??;
    // Temporary files of writes a kill interrupted (only the agent writes here).
    match crate::atomic_file::remove_stale_temps(&cfg.state_dir) {
        Ok(0) => {}
        Ok(n) => info!(
            removed = n,
            "removed temporary files left by an interrupted write"
        ),
        Err(e) => warn!(error = %e, "cannot clean temporary files in the state directory"),
    }
    std::fs::create_dir_all(cfg.state_dir.join(control::CLEAR_DIR)).ok();
    if cfg.data_dir != cfg.state_dir {
        match crate::atomic_file::remove_stale_temps(&cfg.data_dir) {
            Ok(_) => {}
            Err(e) => warn!(error = %e, "cannot clean temporary files in the data directory"),
        }
    }
    let catalog = Arc::new(Catalog::builtin().context("built-in catalog")?);
    let restore_cfg = RestoreConfig {
        state_dir: cfg.state_dir.clone(),
        data_dir: cfg.data_dir.clone(),
        boot_id_path: cfg.boot_id_path.clone(),
        proc_stat_path: cfg.proc_stat_path.clone(),
        namespace: cfg.namespace.clone(),
    };
    let restored = restore::restore(&restore_cfg, &node, &catalog);
    // Connection floods are capped per server (listen.rs); the rest of the descriptors are the
    // agent's own, and there should be as many as the system allows.
    let files = crate::listen::raise_file_limit();
    info!(open_files = ?files, "open-file limit");

    // Detection does not wait for a slow policy file: past START_WAIT it starts on the
    // built-in policy, and the file's policy replaces it when read.
    let metrics = Arc::new(Metrics::new());
    let (loaded, pending) = policy_watch::initial_bounded(
        cfg.policy.as_deref(),
        &metrics,
        policy_watch::file_reader(),
        policy_watch::START_WAIT,
    )
    .await;
    let (mut c, ends) = Components::new(cfg, node, metrics, loaded, shutdown, reload);
    c.heartbeat.beat(&*c.clock);
    let timeline = faultline_core::time::Timeline::for_boot(
        restored.saved_timeline.as_ref(),
        restored.boot_id.as_deref(),
        c.clock.now(),
        c.clock.since_boot(),
    );
    info!(anchor = %timeline.anchor, boot_id = ?timeline.boot_id, "engine timeline");
    if let Some(b) = &restored.boot_id {
        let boot = Input::Obs(Observation::Boot { boot_id: b.clone() });
        c.ctx().tx.send(boot).await.ok();
    }
    c.start_policy_and_control(pending);
    let gpu_count_label = c.connect_kubernetes().await;
    let mut restored = restored;
    if c.kube.is_none() {
        // Standalone: no budget, nothing withheld.
        restored.taint_budget = None;
    }
    if let (Origin::Empty, Some(client)) =
        (restored.origin, c.kube.as_ref().map(|k| k.calls.clone()))
    {
        let found =
            restore::rebuild_from_cluster(client.clone(), &restore_cfg, &c.node, &catalog).await;
        if let Ok(Some(((engine, skip), record))) = found {
            restored.origin = Origin::Record;
            restored.engine = engine;
            restored.kmsg_skip_through = skip;
            restored.taint_budget = record.agent.taint_budget;
        } else if found.is_ok() {
            let policy = c.policy.borrow().policy.clone();
            let now = timeline.at(c.clock.since_boot());
            if let Some(engine) =
                restore::rebuild_from_taints(client, &c.node, &policy, &catalog, now).await
            {
                restored.origin = Origin::Record;
                restored.engine = engine;
            }
        }
    }
    c.start_kmsg(restored.kmsg_cursor, restored.kmsg_skip_through, &timeline);
    c.start_accelerators(gpu_count_label);
    c.start_peer().await;
    c.start_engine_and_sinks(restored, timeline, catalog, ends);
    if let Err(e) = c.start_http().await {
        // Nothing is flushed by a half-started agent that exits here: stop what runs.
        c.shutdown.cancel();
        c.stop().await;
        return Err(e);
    }
    c.stop().await;
    info!("faultline agent stopped; record flushed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        cfg: AgentConfig,
    }

    /// `--kube-write-interval` takes 0 (every change at once) up to 10 minutes; longer is refused
    /// with the limit named (an absurd value overflowed the clock).
    #[test]
    fn the_kube_write_interval_is_bounded() {
        let parse = |v: &str| Flags::try_parse_from(["agent", "--kube-write-interval", v]);
        assert_eq!(parse("0s").unwrap().cfg.kube_write_interval, Duration::ZERO);
        assert_eq!(
            parse("10m").unwrap().cfg.kube_write_interval,
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
            default_listen(false),
            SocketAddr::from(([127, 0, 0, 1], 20260))
        );
        assert_eq!(
            default_listen(true),
            SocketAddr::from(([0, 0, 0, 0], 20260))
        );
        // No flag: the choice is left to `default_listen`; a flag wins.
        let none = Flags::try_parse_from(["faultline-agent"]).unwrap();
        if std::env::var_os("FAULTLINE_LISTEN").is_none() {
            assert_eq!(none.cfg.listen, None);
        }
        let given = Flags::try_parse_from(["faultline-agent", "--listen", "0.0.0.0:9"]).unwrap();
        assert_eq!(given.cfg.listen, Some(SocketAddr::from(([0, 0, 0, 0], 9))));
    }
}
