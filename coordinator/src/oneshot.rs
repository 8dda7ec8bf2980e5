//! A one-shot coordinator: `faultline check --members FILE` runs one check among named nodes
//! in the requesting process, for bare metal and Slurm where no coordinator service runs (a
//! job's prolog, an operator's shell). It is the coordinator's own engine and service
//! (`runs`, `service`, `transport`), with the coordinator's credentials: its key (the agents
//! obey only messages signed with it) and the master of the nodes' keys (to verify their
//! reports). It listens for the reports while the run lasts, publishes nothing and stops.
//!
//! Only whoever holds those two files can run it, which is whoever could run the coordinator;
//! it must not run beside a standing coordinator with the same key (docs/peer-checks.md, "Bare
//! metal": one coordinator at a time).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use faultline_core::policy::Policy;
use faultline_proto::v1::coordinator_server::CoordinatorServer;
use faultline_proto::v1::RunResult;
use faultline_proto::MAX_MESSAGE_BYTES;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::runs::{Coordinator, MemoryPublisher, Trigger, WatchFence};
use super::transport::GrpcTransport;
use super::{agents, members, service, Leadership};
use faultline_agent::metrics::Metrics;
use faultline_agent::peer::wire::{self, CoordinatorSigner};

/// What a one-shot run needs.
#[derive(Debug, Clone)]
pub struct OneShot {
    pub nodes: Vec<String>,
    /// The members file (`node ip:port [topology]` per line), as the coordinator's.
    pub members: PathBuf,
    /// The coordinator's key (`faultline keys coordinator`).
    pub key_file: PathBuf,
    /// The master of the nodes' keys (`faultline keys master`).
    pub node_key_master_file: PathBuf,
    /// Where the agents' reports are taken while the run lasts.
    pub listen: SocketAddr,
    /// The address the agents send them to (ip or ip:port); default: `listen`'s, when it names
    /// one.
    pub address: Option<String>,
    pub probe_port_base: u16,
    /// The policy (its `peer` section: sizes, deadlines); default: the built-in one.
    pub policy: Option<PathBuf>,
    /// Per-check deadline to use instead of the policy's (only shorter, never under 1 s).
    pub check_timeout: Option<Duration>,
}

/// Runs one check among `o.nodes` and returns its result (nodes missing from the members file
/// come back `unknown`, as from a coordinator).
pub async fn run(o: OneShot) -> anyhow::Result<RunResult> {
    let key = super::read_key(&o.key_file)?;
    let master = wire::load_private_key(&o.node_key_master_file)?;
    let text = std::fs::read_to_string(&o.members)
        .with_context(|| format!("cannot read {}", o.members.display()))?;
    let all = members::parse_members(&o.members.display().to_string(), &text)?;
    let policy = match &o.policy {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Policy::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        None => Policy::default(),
    }
    .peer;
    let listener = tokio::net::TcpListener::bind(o.listen)
        .await
        .with_context(|| format!("cannot listen on {} for the reports", o.listen))?;
    let port = listener.local_addr()?.port();
    let address = match &o.address {
        Some(a) => match a.parse::<SocketAddr>() {
            Ok(sa) => sa,
            Err(_) => SocketAddr::new(
                a.parse()
                    .with_context(|| format!("--report-address {a:?} is not an ip or ip:port"))?,
                port,
            ),
        },
        None if !o.listen.ip().is_unspecified() => SocketAddr::new(o.listen.ip(), port),
        None => anyhow::bail!(
            "no address for the agents to send their reports to: set --report-address"
        ),
    };
    let name = format!("check@{}", faultline_agent::daemon::hostname());
    let (members, missing) = super::runs::select(all, &o.nodes);
    // Always active, and nobody can depose it (no sender is left: `role_lost` never resolves).
    let leader = watch::channel(true).1;
    let coordinator = Arc::new(Coordinator::new(
        name.clone(),
        address.to_string(),
        o.probe_port_base,
        Arc::new(GrpcTransport::new(CoordinatorSigner {
            key: Arc::new(key),
            sender: name.clone(),
        })),
        Arc::new(MemoryPublisher::default()),
        Arc::new(WatchFence(leader.clone())),
        Arc::new(faultline_agent::clock::SystemClock),
    ));
    let svc = service::CoordinatorService::new(
        Leadership::new(
            coordinator.clone(),
            leader,
            Arc::new(members::StaticMembers {
                path: o.members.clone(),
            }),
            watch::channel(policy.clone()).1,
        ),
        service::Authz {
            agents: Arc::new(agents::NodeKeys::new(master, &name)),
            requester: None,
            requesters: None,
        },
        None,
    );
    let stop = CancellationToken::new();
    let server = tonic::transport::Server::builder()
        .add_service(
            CoordinatorServer::new(svc)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(
            faultline_agent::listen::incoming(
                listener,
                faultline_agent::listen::COORDINATOR_LIMITS,
                Arc::new(Metrics::new()),
                "coordinator",
            ),
            stop.clone().cancelled_owned(),
        );
    let server = tokio::spawn(server);
    let mut spec = super::run_spec(&policy, 0);
    if let Some(t) = o.check_timeout {
        spec.check_timeout = service::requested_timeout(
            spec.check_timeout,
            t.as_millis().min(u128::from(u32::MAX)) as u32,
        );
    }
    let state = coordinator
        .run_detached(members, missing, spec, Trigger::Request, None, None)
        .await;
    stop.cancel();
    let _ = server.await;
    let state = state.map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(service::result_of(&state))
}
