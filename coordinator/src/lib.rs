//! The peer-check coordinator, a process of its own (`faultline-coordinator`): it plans runs
//! (on a schedule and on request), assigns the checks, takes the reports, concludes each run to
//! its members and publishes it. No agent coordinates: an agent serves assignments, runs its
//! probe, reports and takes its verdicts (`peer`).
//!
//! In Kubernetes two replicas run as a Deployment; the holder of the Lease
//! `faultline-peercheck` is the active one (its `/readyz` is 200, so the Service sends
//! requesters to it) and the other waits to take over. Without Kubernetes one runs from a
//! members file.
//!
//! - `runs`: a run, round by round, over the `Transport` trait (`transport`: gRPC), published
//!   through `publish`, fenced by the Lease (`lease`), among the `members`;
//! - `service`: the gRPC service (`Report` and `Admit` from agents, `Run` from requesters);
//! - `budget`: the cluster's taint budget, which the active replica alone keeps (Kubernetes);
//! - `agents`: which node a report comes from; `tokens`: an agent token's node (Kubernetes);
//!   `requesters`: who may request a run.

pub mod agents;
pub mod budget;
pub mod lease;
pub mod members;
pub mod oneshot;
pub mod publish;
pub mod requesters;
pub mod runs;
pub mod service;
pub mod tokens;
pub mod transport;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use faultline_core::peer::pairing::PairingConfig;
use faultline_core::policy::PeerPolicy;
use faultline_proto::auth::Verifier;
use faultline_proto::v1::coordinator_server::CoordinatorServer;
use faultline_proto::MAX_MESSAGE_BYTES;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use faultline_agent::clock::{Clock, SystemClock};
use faultline_agent::metrics::Metrics;
use faultline_agent::peer::wire::{self, CoordinatorSigner};
use faultline_agent::peer::{authz, jittered, runner, MAX_REQUEST, MAX_SKEW};
use faultline_proto::auth::CoordinatorKey;
use members::Members;
use runs::{Coordinator, Fence, RunPublisher, RunSpec, Trigger};
use transport::GrpcTransport;

/// Where the coordinator's gRPC service listens by default.
pub const DEFAULT_PEER_LISTEN: &str = "0.0.0.0:20262";
/// Where its health, readiness and metrics endpoints listen by default.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:20263";
/// The agents' service account (their reports' tokens must be its).
pub const DEFAULT_AGENT_SERVICE_ACCOUNT: &str = "faultline";

/// The coordinator's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct CoordinatorConfig {
    /// Where the gRPC service (reports from agents, runs from requesters) listens.
    #[arg(long, env = "FAULTLINE_PEER_LISTEN", default_value = DEFAULT_PEER_LISTEN)]
    pub peer_listen: SocketAddr,
    /// The address (ip or ip:port) agents send reports to. Default: the pod IP (`POD_IP`), or
    /// the listen address when it names one.
    #[arg(long, env = "FAULTLINE_COORDINATOR_ADDRESS")]
    pub address: Option<String>,
    /// Where `/healthz`, `/readyz` (200 on the active replica only) and `/metrics` listen.
    #[arg(long, env = "FAULTLINE_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// This replica's name (the Lease's holder and the sender of its messages). Default: the
    /// pod name (`POD_NAME`), else the host name.
    #[arg(long, env = "POD_NAME")]
    pub name: Option<String>,
    /// Without Kubernetes: the members file (`node ip:port [topology]` per line).
    #[arg(long, env = "FAULTLINE_PEER_MEMBERS")]
    pub members: Option<PathBuf>,
    /// Without Kubernetes: the coordinator's key (`faultline keys coordinator` writes it); on
    /// Kubernetes each replica makes its own at start unless this is given.
    #[arg(long, env = "FAULTLINE_COORDINATOR_KEY_FILE")]
    pub key_file: Option<PathBuf>,
    /// Without Kubernetes: the master of the nodes' keys (`faultline keys master`): a report
    /// is accepted only when signed with the key it derives for the node the report is from.
    #[arg(long, env = "FAULTLINE_PEER_NODE_KEY_MASTER_FILE")]
    pub node_key_master_file: Option<PathBuf>,
    /// Kubernetes: use this kubeconfig instead of the in-cluster service account.
    #[arg(long, env = "FAULTLINE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubernetes: the namespace of the agents, the Lease and the published run.
    #[arg(long, env = "POD_NAMESPACE", default_value = faultline_agent::kube_client::DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Kubernetes: label selector of the agent pods.
    #[arg(long, env = "FAULTLINE_PEER_SELECTOR", default_value = members::DEFAULT_SELECTOR)]
    pub peer_selector: String,
    /// Kubernetes: the agents' service account: a report's token must be its, bound to a pod
    /// on the node the report is from.
    #[arg(long, env = "FAULTLINE_AGENT_SERVICE_ACCOUNT", default_value = DEFAULT_AGENT_SERVICE_ACCOUNT)]
    pub agent_service_account: String,
    /// Kubernetes: the port the agents' peer-check service listens on (on their pod IP).
    #[arg(long, env = "FAULTLINE_AGENT_PEER_PORT", default_value_t = 20261)]
    pub agent_port: u16,
    /// First of the 32 ports the agents' probes listen on during checks.
    #[arg(long, env = "FAULTLINE_PROBE_PORT_BASE", default_value_t = 20270)]
    pub probe_port_base: u16,
    /// Policy file (its `peer` section: schedule, sizes, deadlines); reloaded when it changes.
    #[arg(long, env = "FAULTLINE_POLICY")]
    pub policy: Option<PathBuf>,
    /// The requesters' secret (`faultline check` signs `Run` with it); without it, requesters
    /// use service-account tokens (Kubernetes).
    #[arg(long, env = "FAULTLINE_PEER_REQUESTER_SECRET_FILE")]
    pub requester_secret_file: Option<PathBuf>,
    /// Connections the gRPC service holds at once (each agent may hold one: a fleet-wide
    /// incident has every failing node ask the taint budget at once).
    #[arg(long, env = "FAULTLINE_COORDINATOR_MAX_CONNECTIONS", default_value_t = faultline_agent::listen::COORDINATOR_LIMITS.max_connections)]
    pub max_connections: usize,
    /// Connections the gRPC service holds at once from one address (each agent has its own pod
    /// address; raise it where agents reach the coordinator through one NAT address).
    #[arg(long, env = "FAULTLINE_COORDINATOR_MAX_CONNECTIONS_PER_ADDRESS", default_value_t = faultline_agent::listen::COORDINATOR_LIMITS.max_per_address)]
    pub max_connections_per_address: usize,
    /// Without Kubernetes: where runs are published (`peercheck.json`).
    #[arg(
        long,
        env = "FAULTLINE_STATE_DIR",
        default_value = "/var/lib/faultline-coordinator"
    )]
    pub state_dir: PathBuf,
}

/// The active replica's role, and what its runs need.
#[derive(Debug, Clone)]
pub struct Leadership {
    pub coordinator: Arc<Coordinator>,
    /// Whether this replica is the active one.
    pub leader: watch::Receiver<bool>,
    pub members: Arc<dyn Members>,
    pub policy: watch::Receiver<PeerPolicy>,
    runs: Arc<AtomicUsize>,
}

impl Leadership {
    pub fn new(
        coordinator: Arc<Coordinator>,
        leader: watch::Receiver<bool>,
        members: Arc<dyn Members>,
        policy: watch::Receiver<PeerPolicy>,
    ) -> Leadership {
        Leadership {
            coordinator,
            leader,
            members,
            policy,
            runs: Arc::default(),
        }
    }

    /// The number of the next run (it rotates round 1's pairs).
    fn next_run(&self) -> usize {
        self.runs.fetch_add(1, Ordering::Relaxed)
    }
}

/// A run's settings from the policy; `run_number` rotates round 1.
pub fn run_spec(p: &PeerPolicy, run_number: usize) -> RunSpec {
    RunSpec {
        bytes: p.bytes,
        iterations: p.iterations,
        check_timeout: p.check_timeout,
        gemm: p.gemm,
        pairing: PairingConfig {
            straggler_ratio: p.straggler_ratio,
            straggler_mads: p.straggler_mads,
            max_rounds: p.max_rounds,
        },
        rotation: run_number,
        skip_busy: p.gpu,
    }
}

/// The address agents report to.
fn advertised(cfg: &CoordinatorConfig, port: u16) -> anyhow::Result<SocketAddr> {
    match (&cfg.address, std::env::var("POD_IP").ok()) {
        (Some(a), _) => match a.parse::<SocketAddr>() {
            Ok(sa) => Ok(sa),
            Err(_) => Ok(SocketAddr::new(
                a.parse()
                    .with_context(|| format!("--address {a:?} is not an ip or ip:port"))?,
                port,
            )),
        },
        (None, Some(ip)) => Ok(SocketAddr::new(
            ip.parse()
                .with_context(|| format!("POD_IP {ip:?} is not an ip"))?,
            port,
        )),
        (None, None) if !cfg.peer_listen.ip().is_unspecified() => {
            Ok(SocketAddr::new(cfg.peer_listen.ip(), port))
        }
        _ => anyhow::bail!("no address for agents to reach this coordinator: set --address"),
    }
}

/// The coordinator's key from its file (`faultline keys coordinator`), which others may not
/// read (`wire::ensure_private`).
fn read_key(path: &std::path::Path) -> anyhow::Result<CoordinatorKey> {
    wire::ensure_private(path)?;
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    CoordinatorKey::from_pkcs8(&bytes)
        .with_context(|| format!("{} is not a coordinator key", path.display()))
}

/// The requesters' secret, if its file exists (an optional Secret not created: requesters use
/// service-account tokens); never the master of the nodes' keys, from which a requester could
/// derive every node's key.
fn requester_secret(
    path: Option<&std::path::Path>,
    master: Option<&faultline_proto::auth::Key>,
) -> anyhow::Result<Option<faultline_proto::auth::Key>> {
    let Some(path) = path.filter(|p| p.exists()) else {
        return Ok(None);
    };
    let key = wire::load_key(path)?;
    anyhow::ensure!(
        !master.is_some_and(|m| m.same_secret(&key)),
        "the requester secret {} is the master of the nodes' keys: a requester holding it could sign as any node",
        path.display()
    );
    Ok(Some(key))
}

/// Runs the coordinator until `shutdown`; `reload` (SIGHUP) re-reads the policy.
pub async fn run(
    cfg: CoordinatorConfig,
    shutdown: CancellationToken,
    reload: Arc<tokio::sync::Notify>,
) -> anyhow::Result<()> {
    let name = cfg
        .name
        .clone()
        .unwrap_or_else(faultline_agent::daemon::hostname);
    // One connection per agent at once (`COORDINATOR_LIMITS`): the default soft limit (1024)
    // would refuse a fleet-wide incident's calls.
    let files = faultline_agent::listen::raise_file_limit();
    let metrics = Arc::new(Metrics::new());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let listener = tokio::net::TcpListener::bind(cfg.peer_listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.peer_listen))?;
    let address = advertised(&cfg, listener.local_addr()?.port())?;
    let http = faultline_agent::http::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let key = match &cfg.key_file {
        Some(path) => read_key(path)?,
        None => CoordinatorKey::generate().context("cannot make the coordinator's key")?,
    };
    let key = Arc::new(key);
    let master = cfg
        .node_key_master_file
        .as_deref()
        .map(wire::load_private_key)
        .transpose()?;
    let requester = requester_secret(cfg.requester_secret_file.as_deref(), master.as_ref())?
        .map(|k| Verifier::new(k, MAX_SKEW, &name));
    let loaded = follow_policy(&cfg, &metrics, &shutdown, reload).await;
    let policy = faultline_agent::peer::follow_policy(loaded.clone(), shutdown.clone());

    type Parts = (
        Arc<dyn Members>,
        Arc<dyn RunPublisher>,
        Arc<dyn Fence>,
        Arc<dyn agents::Agents>,
        Option<Arc<dyn requesters::Requesters>>,
        Option<Arc<dyn budget::LedgerStore>>,
    );
    let (members, publisher, fence, agents, requesters, ledger): Parts = match &cfg.members {
        Some(path) => {
            anyhow::ensure!(
                cfg.key_file.is_some(),
                "without Kubernetes the coordinator needs --key-file: the agents know it by its public key"
            );
            let master = master.context(
                "without Kubernetes the coordinator needs --node-key-master-file: the agents sign their reports with the keys it derives",
            )?;
            // Checked at start: a members file that cannot be read is a configuration error.
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            members::parse_members(&path.display().to_string(), &text)?;
            // One coordinator without Kubernetes: always active. (No sender is left:
            // `role_lost` then never resolves.)
            let (_, rx) = watch::channel(true);
            (
                Arc::new(members::StaticMembers { path: path.clone() }),
                Arc::new(publish::FilePublisher {
                    dir: cfg.state_dir.clone(),
                }),
                Arc::new(runs::WatchFence(rx)),
                Arc::new(agents::NodeKeys::new(master, &name)),
                None,
                None,
            )
        }
        None => {
            let client =
                faultline_agent::kube_client::clients(cfg.kubeconfig.as_deref(), &name).await?;
            let topology_label = policy.borrow().topology_label.clone();
            // The Lease names this replica with its address and public key: agents obey the
            // holder's key, so a replica that lost the Lease is refused by every agent.
            let identity = authz::holder_identity(&name, &address.to_string(), &key.public_key());
            let held = lease::elect(
                client.lease.clone(),
                cfg.namespace.clone(),
                name.clone(),
                identity.clone(),
                shutdown.clone(),
            );
            (
                Arc::new(members::KubeMembers {
                    client: client.calls.clone(),
                    namespace: cfg.namespace.clone(),
                    selector: cfg.peer_selector.clone(),
                    port: cfg.agent_port,
                    topology_label,
                }),
                Arc::new(publish::KubePublisher {
                    client: client.calls.clone(),
                    namespace: cfg.namespace.clone(),
                }),
                Arc::new(lease::LeaseFence {
                    held,
                    client: client.lease.clone(),
                    namespace: cfg.namespace.clone(),
                    identity,
                    clock: clock.clone(),
                }),
                Arc::new(agents::Tokens::new(
                    Arc::new(tokens::KubeAgentTokens::new(
                        client.calls.clone(),
                        cfg.namespace.clone(),
                        cfg.agent_service_account.clone(),
                    )),
                    &name,
                )),
                Some(Arc::new(requesters::KubeRequesters {
                    client: client.calls.clone(),
                    namespace: cfg.namespace.clone(),
                })),
                Some(Arc::new(budget::KubeLedger {
                    api: kube::Api::namespaced(client.calls, &cfg.namespace),
                })),
            )
        }
    };

    let signer = CoordinatorSigner {
        key: key.clone(),
        sender: name.clone(),
    };
    let coordinator = Arc::new(Coordinator::new(
        name.clone(),
        address.to_string(),
        cfg.probe_port_base,
        Arc::new(GrpcTransport::new(signer)),
        publisher,
        fence.clone(),
        clock.clone(),
    ));
    let leader = fence.watch();
    let admissions = ledger.map(|store| {
        let ledger = Arc::new(budget::TaintLedger::new(
            store,
            members.clone(),
            clock.clone(),
        ));
        tokio::spawn(ledger.clone().follow(leader.clone()));
        budget::Admissions {
            ledger,
            policy: loaded,
        }
    });
    let leadership = Leadership::new(coordinator, leader, members, policy);
    let svc = service::CoordinatorService::new(
        leadership.clone(),
        service::Authz {
            agents,
            requester,
            requesters,
        },
        admissions,
    );
    let incoming = faultline_agent::listen::incoming(
        listener,
        faultline_agent::listen::Limits {
            max_connections: cfg.max_connections.max(1),
            max_per_address: cfg.max_connections_per_address.max(1),
            ..faultline_agent::listen::COORDINATOR_LIMITS
        },
        metrics.clone(),
        "coordinator",
    );
    let server = tonic::transport::Server::builder()
        .timeout(MAX_REQUEST)
        .concurrency_limit_per_connection(16)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(
            CoordinatorServer::new(svc)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    info!(%name, %address, public_key = %key.public_key(), open_files = ?files, "peer-check coordinator listening");
    let http_task = tokio::spawn(faultline_agent::http::serve_router(
        http,
        endpoints(leadership.leader.clone(), metrics.clone()),
        metrics,
        shutdown.clone(),
        faultline_agent::http::LIMITS,
    ));
    let schedule_task = tokio::spawn(
        schedule(leadership, shutdown.clone()).instrument(tracing::info_span!("peer_schedule")),
    );
    let served = faultline_agent::peer::drained(server, shutdown.clone()).await;
    shutdown.cancel();
    let _ = schedule_task.await;
    let _ = http_task.await;
    served.context("the coordinator's gRPC service stopped")
}

/// The peer policy, followed from the policy file (the agents' own file and rules).
async fn follow_policy(
    cfg: &CoordinatorConfig,
    metrics: &Arc<Metrics>,
    shutdown: &CancellationToken,
    reload: Arc<tokio::sync::Notify>,
) -> watch::Receiver<faultline_core::policy::LoadedPolicy> {
    use faultline_agent::source::policy_watch;
    let (loaded, first) = policy_watch::initial_bounded(
        cfg.policy.as_deref(),
        metrics,
        policy_watch::file_reader(),
        policy_watch::START_WAIT,
    )
    .await;
    let (tx, rx) = watch::channel(loaded);
    if let Some(path) = cfg.policy.clone() {
        let file = policy_watch::PolicyFile {
            path,
            tx,
            recheck: Duration::from_secs(60),
            reload,
            reader: policy_watch::file_reader(),
            first,
        };
        tokio::spawn(file.run(metrics.clone(), shutdown.clone()));
    }
    rx
}

#[derive(Clone)]
struct Endpoints {
    leader: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
}

/// `/healthz` (the process serves), `/readyz` (200 on the active replica only: the Service
/// sends requesters to it), `/metrics`.
fn endpoints(leader: watch::Receiver<bool>, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { (StatusCode::OK, "ok\n") }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(Endpoints { leader, metrics })
}

async fn readyz(State(s): State<Endpoints>) -> Response {
    if *s.leader.borrow() {
        (StatusCode::OK, "active\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "standby: another replica holds the Lease\n",
        )
            .into_response()
    }
}

async fn metrics_text(State(s): State<Endpoints>, headers: axum::http::HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = faultline_agent::metrics::Format::negotiate(accept);
    (
        [(header::CONTENT_TYPE, format.content_type())],
        s.metrics.encode_as(format),
    )
        .into_response()
}

/// While this replica is active: finish (restart) a run the previous one left unfinished, then
/// run among all members every `peer.interval` (jittered).
async fn schedule(l: Leadership, shutdown: CancellationToken) {
    let mut leader = l.leader.clone();
    loop {
        // Wait to lead.
        while !*leader.borrow_and_update() {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = leader.changed() => if r.is_err() { return },
            }
        }
        info!("coordinating peer checks");
        // Until the last published run is read, no run starts for as long as any probe of a
        // previous replica could still hold its port; then for as long as that run's last
        // round says (nothing, when it finished).
        let took_over = l.coordinator.clock().instant();
        let longest = l
            .policy
            .borrow()
            .check_timeout_ceiling()
            .min(Duration::from_secs(3600))
            + runner::PROBE_GRACE
            + runs::REPORT_SLACK;
        l.coordinator.hold_until(took_over + longest);
        let last = l.coordinator.publisher().last().await;
        let unfinished = last.filter(|r| !r.is_finished());
        l.coordinator.hold_until(
            took_over
                + unfinished
                    .as_ref()
                    .map_or(Duration::ZERO, runs::resume_wait),
        );
        if let Some(last) = unfinished {
            // A requester retrying against this replica attaches to the resumed run. A retry
            // that came first runs the request itself: nothing to resume then.
            let claim = match last.request_id.as_deref() {
                Some(id) => l.coordinator.claim(id).map(Some),
                None => Some(None),
            };
            if let Some(claim) = claim {
                info!(run_id = %last.run_id, coordinator = %last.coordinator, "restarting the run a previous coordinator left unfinished, once its probes are over");
                let only = if last.requested.is_empty() {
                    last.members.clone()
                } else {
                    last.requested.clone()
                };
                let timeout = last.check_timeout_ms.map(Duration::from_millis);
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = run_once(&l, Some(&only), Trigger::Resume, last.request_id.clone(), timeout) => {}
                }
                drop(claim);
            }
        }
        loop {
            let p = l.policy.borrow().clone();
            let wait = jittered(p.interval, p.jitter);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = runs::role_lost(leader.clone()) => { info!("no longer coordinating"); break }
                _ = tokio::time::sleep(wait) => {}
            }
            if !l.policy.borrow().enabled {
                continue;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = run_once(&l, None, Trigger::Schedule, None, None) => {}
            }
        }
    }
}

async fn run_once(
    l: &Leadership,
    only: Option<&[String]>,
    trigger: Trigger,
    request_id: Option<String>,
    check_timeout: Option<Duration>,
) {
    let all = match l.members.list().await {
        Ok(m) => m,
        Err(e) => return warn!(error = %e, "cannot list the peer-check members; skipping this run"),
    };
    let (members, missing) = match only {
        Some(names) => runs::select(all, names),
        None => (all, Default::default()),
    };
    if members.len() < 2 {
        return info!(
            members = members.len(),
            "fewer than two members; nothing to check"
        );
    }
    let mut spec = run_spec(&l.policy.borrow(), l.next_run());
    if let Some(t) = check_timeout {
        spec.check_timeout = spec.check_timeout.min(t).max(Duration::from_millis(100));
    }
    // An aborted run is logged where it stops; the next active replica resumes it.
    let _ = l
        .coordinator
        .run(members, missing, &spec, trigger, request_id)
        .await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The requesters' secret is optional (no file: none), and never the nodes' master.
    #[test]
    fn the_requester_secret_is_never_the_nodes_master() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, "one secret of enough bytes\n").unwrap();
        std::fs::write(&b, "another secret, long enough\n").unwrap();
        let master = wire::load_key(&a).unwrap();
        assert!(requester_secret(None, Some(&master)).unwrap().is_none());
        assert!(
            requester_secret(Some(&dir.path().join("none")), Some(&master))
                .unwrap()
                .is_none()
        );
        assert!(requester_secret(Some(&b), Some(&master)).unwrap().is_some());
        assert!(requester_secret(Some(&a), None).unwrap().is_some());
        let e = requester_secret(Some(&a), Some(&master)).unwrap_err();
        assert!(e.to_string().contains("master of the nodes' keys"), "{e}");
    }
}
