//! Peer-paired collective checks: agents check each other in pairs and the coordinator locates
//! faulty nodes, broken and degraded links and stragglers from the results.
//!
//! - `pairing`: the pure core (the planner and its verdicts, plus a simulator);
//! - `coordinator`: runs a run over a transport and publishes it; `lease` (Kubernetes) and
//!   `election` (the members file's order and a liveness rule): who coordinates;
//! - `service`: the gRPC service every agent serves, and the coordinator's client;
//! - `members`: who takes part (agent pods, or a members file); `publish`: where runs go;
//! - `runner`: the probe as a child process with a hard deadline; `verdicts`: a run's verdicts
//!   as this node's fault record (`PEER_UNREACHABLE`, `PEER_LINK_FAILED`,
//!   `PEER_LINK_DEGRADED`, `STRAGGLER`);
//! - `wire`: signing, the secret file, verdicts on the wire; `busy`: whether the GPUs run work;
//! - `authz`: who may send what (the current coordinator, current members' addresses, this
//!   agent's policy bounds).
//!
//! [`start`] wires them into the agent: the service on its own port, the election, and the
//! schedule of runs while this agent coordinates.

pub mod authz;
pub mod busy;
pub mod coordinator;
pub mod election;
pub mod lease;
pub mod members;
pub mod publish;
pub mod runner;
pub mod service;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use faultline_proto::auth::Verifier;
use faultline_proto::v1::coordinator_server::CoordinatorServer;
use faultline_proto::v1::peer_check_server::PeerCheckServer;
use faultline_proto::MAX_MESSAGE_BYTES;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use coordinator::{Coordinator, Fence, Publisher, Trigger};
use members::Members;
use service::{Busy, GrpcTransport, Leadership, PeerHandle, PeerService, ProbeSetup};
use wire::Signer;

use crate::source::Input;
use faultline_core::policy::LoadedPolicy;
use faultline_core::policy::PeerPolicy;

/// Requests signed longer ago than this are refused (ahead of the clock: `auth::MAX_AHEAD`).
pub const MAX_SKEW: Duration = Duration::from_secs(30);
/// No request is served longer than this (a `Run` lasts its rounds; every other RPC bounds
/// its own work to seconds). A client's shorter `grpc-timeout` is honoured.
pub const MAX_REQUEST: Duration = Duration::from_secs(15 * 60);

/// Who coordinates.
#[derive(Debug)]
pub enum Election {
    /// The holder of the Kubernetes Lease: this agent's fence, and whom every agent obeys
    /// (the holder, read from the Lease).
    Lease {
        fence: lease::LeaseFence,
        who: Arc<dyn authz::WhoCoordinates>,
    },
    /// Bare metal: the first live member of the members file (`election`).
    MembersFile,
}

/// Everything the peer-check part of the agent needs.
#[derive(Debug)]
pub struct PeerSetup {
    pub node: String,
    pub listener: tokio::net::TcpListener,
    /// Where other agents reach this one (reports go here).
    pub address: SocketAddr,
    pub key: faultline_proto::auth::Key,
    pub probe: ProbeSetup,
    pub probe_port_base: u16,
    pub busy: Arc<dyn Busy>,
    pub members: Arc<dyn Members>,
    pub publisher: Arc<dyn Publisher>,
    pub election: Election,
    /// The requesters' secret (`faultline check`), accepted for `Run` only.
    pub requester_key: Option<faultline_proto::auth::Key>,
    /// Kubernetes: requesters' service-account tokens, checked by the API server.
    pub requesters: Option<Arc<dyn authz::Requesters>>,
    pub policy: watch::Receiver<LoadedPolicy>,
    pub inputs: mpsc::Sender<Input>,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub shutdown: CancellationToken,
}

/// The peer-check policy, followed from the loaded policy.
pub fn follow_policy(
    mut loaded: watch::Receiver<LoadedPolicy>,
    shutdown: CancellationToken,
) -> watch::Receiver<PeerPolicy> {
    let (tx, rx) = watch::channel(loaded.borrow().policy.peer.clone());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = loaded.changed() => {
                    if r.is_err() { return; }
                    let p = loaded.borrow_and_update().policy.peer.clone();
                    tx.send_if_modified(|old| if *old != p { *old = p; true } else { false });
                }
            }
        }
    });
    rx
}

/// Starts the service, and the schedule while this agent coordinates; returns the tasks.
pub fn start(s: PeerSetup) -> Vec<tokio::task::JoinHandle<()>> {
    let signer = Signer {
        key: s.key.clone(),
        sender: s.node.clone(),
    };
    let policy = follow_policy(s.policy, s.shutdown.clone());
    let transport = Arc::new(GrpcTransport::new(signer.clone()));
    let (fence, who): (Arc<dyn Fence>, Arc<dyn authz::WhoCoordinates>) = match s.election {
        Election::Lease { fence, who } => (Arc::new(fence), who),
        Election::MembersFile => {
            // The members-file election decides both whether this agent coordinates and whom
            // it obeys.
            let e = election::elect(
                s.node.clone(),
                s.members.clone(),
                transport.clone(),
                s.shutdown.clone(),
            );
            (Arc::new(e.fence), Arc::new(e.who))
        }
    };
    let coordinator = Arc::new(Coordinator::new(
        s.node.clone(),
        s.address.to_string(),
        s.probe_port_base,
        transport,
        s.publisher,
        fence.clone(),
    ));
    let leader = fence.watch();
    let leadership = Leadership {
        coordinator: coordinator.clone(),
        leader: leader.clone(),
        members: s.members.clone(),
        policy: policy.clone(),
    };
    let svc = PeerHandle(Arc::new(PeerService::new(
        s.node.clone(),
        signer,
        s.probe,
        s.busy,
        s.inputs,
        leadership.clone(),
        service::Authz {
            agents: Verifier::new(s.key, MAX_SKEW, s.node.clone()),
            who,
            requester: s
                .requester_key
                .map(|k| Verifier::new(k, MAX_SKEW, s.node.clone())),
            probe_ports: s.probe_port_base
                ..s.probe_port_base.saturating_add(coordinator::PROBE_PORTS),
            requesters: s.requesters,
        },
        s.metrics.clone(),
    )));
    let mut tasks = Vec::new();
    let shutdown = s.shutdown.clone();
    let incoming = crate::listen::incoming(
        s.listener,
        crate::listen::PEER_LIMITS,
        s.metrics.clone(),
        "peer",
    );
    // A server-wide request timeout long enough for a `Run` (a whole check: several rounds,
    // each up to its check deadline; every other RPC bounds its own work to seconds). A few
    // concurrent requests per connection, and HTTP/2 keep-alive so a peer that vanished is
    // noticed; the listener caps connections (in all and per address), their idle time and
    // age (`listen::PEER_LIMITS`).
    let server = tonic::transport::Server::builder()
        .timeout(MAX_REQUEST)
        .concurrency_limit_per_connection(16)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        .add_service(
            PeerCheckServer::new(svc.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            CoordinatorServer::new(svc)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    info!(address = %s.address, "peer-check service listening");
    tasks.push(tokio::spawn(
        async move {
            if let Err(e) = server.await {
                warn!(error = %e, "peer-check service stopped");
            }
        }
        .instrument(tracing::info_span!("source", name = "peer")),
    ));
    tasks.push(tokio::spawn(
        schedule(leadership, s.shutdown).instrument(tracing::info_span!("peer_schedule")),
    ));
    tasks
}

/// Calls `f` up to `attempts` times, `pause` apart, while it fails with an error `again` says
/// may pass; returns the last result. (Pings, assignments, relayed pings and reports: one lost
/// call on the control path is not an answer.)
pub async fn retried<T, E, Fut>(
    attempts: u32,
    pause: Duration,
    again: impl Fn(&E) -> bool,
    mut f: impl FnMut() -> Fut,
) -> Result<T, E>
where
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut last = f().await;
    for _ in 1..attempts.max(1) {
        match &last {
            Err(e) if again(e) => {}
            _ => break,
        }
        tokio::time::sleep(pause).await;
        last = f().await;
    }
    last
}

/// Waits `interval` plus or minus `jitter` of it.
pub fn jittered(interval: Duration, jitter: f64) -> Duration {
    let unit = (wire::random_u64() >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    let f = 1.0 + jitter.clamp(0.0, 0.5) * (2.0 * unit - 1.0);
    interval.mul_f64(f.max(0.0))
}

/// While this agent holds the Lease: finish (restart) a run the previous coordinator left
/// unfinished, then run among all members every `peer.interval` (jittered).
async fn schedule(l: Leadership, shutdown: CancellationToken) {
    let mut leader = l.leader.clone();
    let mut runs = 0usize;
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
        // previous coordinator could still hold its port (a later round's deadline may be as
        // long as the agents' ceiling, `check_timeout_ceiling`); then for as long as that run's
        // last round says (nothing, when it finished).
        let took_over = tokio::time::Instant::now();
        let longest = l
            .policy
            .borrow()
            .check_timeout_ceiling()
            .min(Duration::from_secs(3600))
            + runner::PROBE_GRACE
            + coordinator::REPORT_SLACK;
        l.coordinator.hold_until(took_over + longest);
        let last = l.coordinator.publisher().last().await;
        let unfinished = last.filter(|r| !r.is_finished());
        l.coordinator.hold_until(
            took_over
                + unfinished
                    .as_ref()
                    .map_or(Duration::ZERO, coordinator::resume_wait),
        );
        if let Some(last) = unfinished {
            // A requester retrying against this coordinator attaches to the resumed run. A
            // retry that came first runs the request itself: nothing to resume then.
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
                    _ = run_once(
                        &l,
                        Some(&only),
                        Trigger::Resume,
                        runs,
                        last.request_id.clone(),
                        timeout,
                    ) => {}
                }
                drop(claim);
                runs += 1;
            }
        }
        loop {
            let p = l.policy.borrow().clone();
            let wait = jittered(p.interval, p.jitter);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                // (A fixed election has no sender left: `lost` then never resolves.)
                _ = coordinator::role_lost(leader.clone()) => { info!("no longer coordinating"); break }
                _ = tokio::time::sleep(wait) => {}
            }
            if !l.policy.borrow().enabled {
                continue;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = run_once(&l, None, Trigger::Schedule, runs, None, None) => {}
            }
            runs += 1;
        }
    }
}

async fn run_once(
    l: &Leadership,
    only: Option<&[String]>,
    trigger: Trigger,
    runs: usize,
    request_id: Option<String>,
    check_timeout: Option<Duration>,
) {
    let all = match l.members.list().await {
        Ok(m) => m,
        Err(e) => return warn!(error = %e, "cannot list the peer-check members; skipping this run"),
    };
    let (members, missing) = match only {
        Some(names) => coordinator::select(all, names),
        None => (all, Default::default()),
    };
    if members.len() < 2 {
        return info!(
            members = members.len(),
            "fewer than two members; nothing to check"
        );
    }
    let mut spec = service::run_spec(&l.policy.borrow(), runs);
    if let Some(t) = check_timeout {
        spec.check_timeout = spec.check_timeout.min(t).max(Duration::from_millis(100));
    }
    // An aborted run is logged where it stops; the next holder resumes it.
    let _ = l
        .coordinator
        .run(members, missing, &spec, trigger, request_id)
        .await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Failures that may pass are tried again up to the count, a pause apart; an answer (a
    /// success, or a failure `again` refuses) ends it at once.
    #[tokio::test(start_paused = true)]
    async fn retried_stops_at_an_answer_or_the_count() {
        let calls = std::sync::atomic::AtomicU32::new(0);
        let call = |fail_until: u32, kind: &'static str| {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            async move {
                if n <= fail_until {
                    Err(kind)
                } else {
                    Ok(n)
                }
            }
        };
        let start = tokio::time::Instant::now();
        let pause = Duration::from_millis(500);
        assert_eq!(retried(3, pause, |_| true, || call(2, "lost")).await, Ok(3));
        assert_eq!(start.elapsed(), pause * 2);
        calls.store(0, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            retried(3, pause, |_| true, || call(9, "lost")).await,
            Err("lost")
        );
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 3);
        calls.store(0, std::sync::atomic::Ordering::Relaxed);
        let again = |e: &&str| *e == "lost";
        assert_eq!(
            retried(3, pause, again, || call(9, "refused")).await,
            Err("refused")
        );
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 1);
    }
}
