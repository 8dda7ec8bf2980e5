//! The agent's peer-check gRPC service (`PeerCheck`): ping, assign, cancel, conclude, and
//! forward as a relay. Every request is the coordinator's: it must verify with the
//! coordinator's public key (`authz::WhoCoordinates`: the Lease's holder identity, or the key
//! configured on bare metal), which no agent holds, and be addressed to this node, fresh and not
//! seen before; anything else is refused with `UNAUTHENTICATED` and changes nothing. An
//! assignment must name this node, probe addresses on its probe ports, and sizes within its
//! policy (`authz`). Refusals are logged at a bounded rate.
//!
//! An assignment runs the probe as a child process (`runner`) and sends the `CheckReport`,
//! signed with this node's own credential (`wire::NodeCredential`), to the coordinator address
//! it names, or through the member it names in `report_via` (the coordinator cannot reach this
//! agent and reached it through that member). Every agent is also a relay (`Forward`): it
//! passes the coordinator's messages on, verbatim, to the member the coordinator's envelope
//! names, and a member's report on to the coordinator, within the bounds `authz` sets. A
//! conclusion becomes this node's `Level` observations (`verdicts`), sent to the engine like any
//! source's.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use faultline_proto::auth::{AuthError, CoordinatorPublicKey, Signed, Verifier};
use faultline_proto::v1::coordinator_client::CoordinatorClient;
use faultline_proto::v1::peer_check_client::PeerCheckClient;
use faultline_proto::v1::peer_check_server::PeerCheck;
use faultline_proto::v1::{forward_request as forward, ForwardReply, ForwardRequest as Forward};
use faultline_proto::v1::{
    CheckAccepted, CheckAssignment, CheckReport, PingReply, PingRequest, ReportAck, RunConclusion,
};
use faultline_proto::{MAX_MESSAGE_BYTES, PROTOCOL};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn, Instrument};

use super::authz::{self, CoordinatorId, WhoCoordinates};
use super::runner::{self, ProbeOutcome, ProbeSpec};
use super::wire::{self, NodeCredential};
use crate::clock::{Clock, SystemClock};
use crate::metrics::{PeerCheckLabel, PeerCheckResult};
use crate::source::Input;
use faultline_core::policy::PeerPolicy;

/// This node's failed checks in one run.
#[derive(Debug)]
struct OwnRun {
    run_id: String,
    /// Why its probe could not start, the first time.
    cannot_run: Option<String>,
    /// A check failed for another reason too (then the cause is not named).
    other_failures: bool,
}

/// Runs whose own-probe failure an agent remembers (a conclusion comes right after its run).
const OWN_FAILURES_KEPT: usize = 8;
/// Attempts to deliver a check report, and the pause between them.
pub const REPORT_ATTEMPTS: u32 = 3;
pub const REPORT_RETRY_PAUSE: Duration = Duration::from_millis(300);
/// Checks one agent runs at once (a node is in at most two per round).
pub const MAX_CONCURRENT_CHECKS: usize = 4;
/// How long a ping waits for the busy check.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(1);
/// Connect and call timeouts of the small calls (ping, assign, cancel, report).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the service waits to learn the coordinator's key (an answer must fit in the
/// coordinator's `CALL_TIMEOUT`).
pub const AUTHZ_TIMEOUT: Duration = Duration::from_millis(1500);
/// How long a call through a relay may take: the relay's call onward (a conclusion's is the
/// longest).
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a conclusion may take to deliver.
pub const CONCLUDE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a conclusion waits for the agent's engine to take its observations.
pub const CONCLUDE_DELIVERY: Duration = Duration::from_secs(3);
/// At most one log line per this interval about refused requests (with the count).
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Whether this node's accelerators run someone's work.
pub trait Busy: Send + Sync + std::fmt::Debug + 'static {
    /// `Some(reason)` when busy.
    fn busy(&self) -> Option<String>;
}

/// Never busy (CPU/TCP checks disturb nothing that matters).
#[derive(Debug, Clone, Copy, Default)]
pub struct NeverBusy;

impl Busy for NeverBusy {
    fn busy(&self) -> Option<String> {
        None
    }
}

/// How this agent runs its probe.
#[derive(Debug, Clone)]
pub struct ProbeSetup {
    pub bin: PathBuf,
    /// NCCL allgather and cuBLAS GEMM instead of TCP and the CPU.
    pub gpu: bool,
}

type CheckKey = (String, u32, String);
/// A check as one member sees it: run, round, member, partner.
type CheckKey4 = (String, u32, String, String);

/// Checks whose reports a relay remembers it may pass back (two per member reached through it,
/// per round, for dozens of members).
const RELAYED_CHECKS: usize = 256;

/// The served handle (tonic services are implemented on it).
#[derive(Debug, Clone)]
pub struct PeerHandle(pub Arc<PeerService>);

impl std::ops::Deref for PeerHandle {
    type Target = PeerService;
    fn deref(&self) -> &PeerService {
        &self.0
    }
}

/// Coordinator keys whose nonce memory an agent keeps: the Lease may move from one replica to
/// the other and back within the time a request stays valid.
const KEYS_REMEMBERED: usize = 4;

/// Verifies requests as the coordinator's: its key as [`WhoCoordinates`] names it now, and one
/// nonce memory per key (the newest [`KEYS_REMEMBERED`]).
#[derive(Debug)]
struct CoordinatorAuth {
    who: Arc<dyn WhoCoordinates>,
    me: String,
    verifiers: Mutex<std::collections::VecDeque<(CoordinatorPublicKey, Verifier)>>,
}

/// Why a request is not the coordinator's.
enum NotCoordinator {
    /// Its signature, receiver, time or nonce (`UNAUTHENTICATED`).
    Refused(String),
    /// The coordinator's key cannot be told now (`UNAVAILABLE`).
    Unknown(String),
}

impl CoordinatorAuth {
    /// The coordinator, when `msg` is its: signed with its key (asked again once when the key
    /// known does not verify: a new replica may have just taken the Lease).
    async fn verify<M: Signed>(&self, msg: &M) -> Result<CoordinatorId, NotCoordinator> {
        let mut last = NotCoordinator::Unknown("no coordinator is known".into());
        for recheck in [false, true] {
            let id = match tokio::time::timeout(AUTHZ_TIMEOUT, self.who.current(recheck)).await {
                Ok(Ok(Some(id))) => id,
                Ok(Ok(None)) => {
                    last = NotCoordinator::Unknown("no coordinator holds the Lease now".into());
                    continue;
                }
                Ok(Err(e)) => {
                    last = NotCoordinator::Unknown(e.to_string());
                    continue;
                }
                Err(_) => {
                    return Err(NotCoordinator::Unknown(format!(
                        "cannot tell the coordinator's key within {AUTHZ_TIMEOUT:?}"
                    )))
                }
            };
            let verified = {
                let mut v = self.verifiers.lock();
                if !v.iter().any(|(k, _)| *k == id.key) {
                    if v.len() >= KEYS_REMEMBERED {
                        v.pop_front();
                    }
                    v.push_back((id.key, Verifier::new(id.key, super::MAX_SKEW, &self.me)));
                }
                match v.iter_mut().find(|(k, _)| *k == id.key) {
                    Some((_, verifier)) => verifier.verify(msg, wire::now_ms()),
                    None => Err(AuthError::Missing),
                }
            };
            match verified {
                Ok(sender) if id.node.is_empty() || sender == id.node => return Ok(id),
                Ok(sender) => {
                    return Err(NotCoordinator::Refused(format!(
                        "signed as {sender:?} with the key of the coordinator {:?}",
                        id.node
                    )))
                }
                Err(e @ AuthError::BadSignature { .. }) => {
                    last = NotCoordinator::Refused(e.to_string())
                }
                Err(e) => return Err(NotCoordinator::Refused(e.to_string())),
            }
        }
        Err(last)
    }
}

/// Everything the service is built from.
#[derive(Debug)]
pub struct ServiceSetup {
    pub node: String,
    /// Who coordinates and with which key.
    pub coordinator: Arc<dyn WhoCoordinates>,
    /// This node's own credential, for its reports.
    pub credential: NodeCredential,
    pub probe: ProbeSetup,
    pub busy: Arc<dyn Busy>,
    pub inputs: mpsc::Sender<Input>,
    pub policy: watch::Receiver<PeerPolicy>,
    /// The ports probe addresses may name (`probe_port_base` + `PROBE_PORTS`).
    pub probe_ports: std::ops::Range<u16>,
    pub metrics: Arc<crate::metrics::Metrics>,
}

/// The service every agent serves.
#[derive(Debug)]
pub struct PeerService {
    pub node: String,
    coordinator: CoordinatorAuth,
    credential: NodeCredential,
    probe: ProbeSetup,
    busy: Arc<dyn Busy>,
    inputs: mpsc::Sender<Input>,
    policy: watch::Receiver<PeerPolicy>,
    running: Mutex<HashMap<CheckKey, CancellationToken>>,
    /// Runs in which this node's own probe could not run, with the cause (the newest
    /// `OWN_FAILURES_KEPT`): a conclusion that finds this node faulty names it.
    own_failures: Mutex<std::collections::VecDeque<OwnRun>>,
    probe_ports: std::ops::Range<u16>,
    /// Forwards as a relay, rate-limited.
    forwards: Mutex<authz::ForwardRate>,
    /// The checks (run, round, member, partner) whose assignment this agent passed on as a
    /// relay, the newest [`RELAYED_CHECKS`]: the only reports it passes back, once each.
    relayed: Mutex<std::collections::VecDeque<CheckKey4>>,
    /// The coordinator's report address as its last verified message named it: a relay passes
    /// members' reports there.
    coordinator_address: Mutex<Option<String>>,
    refusals: Mutex<crate::pace::LogPacer>,
    metrics: Arc<crate::metrics::Metrics>,
}

impl PeerService {
    pub fn new(s: ServiceSetup) -> PeerService {
        PeerService {
            coordinator: CoordinatorAuth {
                who: s.coordinator,
                me: s.node.clone(),
                verifiers: Mutex::new(std::collections::VecDeque::new()),
            },
            node: s.node,
            credential: s.credential,
            probe: s.probe,
            busy: s.busy,
            inputs: s.inputs,
            policy: s.policy,
            running: Mutex::new(HashMap::new()),
            own_failures: Mutex::new(std::collections::VecDeque::new()),
            probe_ports: s.probe_ports,
            forwards: Mutex::new(authz::ForwardRate::default()),
            relayed: Mutex::new(std::collections::VecDeque::new()),
            coordinator_address: Mutex::new(None),
            refusals: Mutex::new(crate::pace::LogPacer::new(REFUSAL_LOG_EVERY)),
            metrics: s.metrics,
        }
    }

    /// Logs a refusal (at most one line per `REFUSAL_LOG_EVERY`, with the count since the
    /// last line) and returns it.
    fn refused(&self, rpc: &str, s: Status) -> Status {
        let due = self.refusals.lock().note(1, SystemClock.instant());
        if let Some((since, total)) = due {
            warn!(rpc, code = ?s.code(), reason = s.message(), refused_since_last_line = since.times, refused_total = total.times, "peer request refused");
        }
        s
    }

    /// Verifies a request as the coordinator's; its authenticated sender.
    async fn verify<M: Signed>(&self, rpc: &str, msg: &M) -> Result<String, Status> {
        match self.coordinator.verify(msg).await {
            Ok(_) => Ok(msg.auth().map(|a| a.sender.clone()).unwrap_or_default()),
            Err(NotCoordinator::Refused(why)) => Err(self.refused(
                rpc,
                Status::unauthenticated(format!("{rpc} refused: not the coordinator's ({why})")),
            )),
            Err(NotCoordinator::Unknown(why)) => Err(self.refused(rpc, Status::unavailable(why))),
        }
    }

    fn check_protocol(p: u32) -> Result<(), Status> {
        if p == PROTOCOL {
            Ok(())
        } else {
            Err(Status::failed_precondition(format!(
                "protocol {p}; this agent speaks {PROTOCOL}"
            )))
        }
    }

    fn remember_coordinator(&self, address: &str) {
        let mut a = self.coordinator_address.lock();
        if a.as_deref() != Some(address) {
            *a = Some(address.to_string());
        }
    }
}

fn check_key(a: &CheckAssignment, me: &str) -> Option<(CheckKey, usize, String)> {
    let (ma, mb) = (a.a.as_ref()?, a.b.as_ref()?);
    let (rank, partner) = if ma.node == me {
        (0, mb.node.clone())
    } else if mb.node == me {
        (1, ma.node.clone())
    } else {
        return None;
    };
    Some(((a.run_id.clone(), a.round, partner.clone()), rank, partner))
}

#[tonic::async_trait]
impl PeerCheck for PeerHandle {
    async fn ping(&self, request: Request<PingRequest>) -> Result<Response<PingReply>, Status> {
        let p = request.into_inner();
        self.verify("Ping", &p).await?;
        // NVML calls can hang: ask on a blocking thread, and a node that cannot answer in
        // time counts as busy (a scheduled check is not worth disturbing a job).
        let busy = if self.probe.gpu {
            let b = Arc::clone(&self.busy);
            let asked = tokio::task::spawn_blocking(move || b.busy());
            match tokio::time::timeout(BUSY_TIMEOUT, asked).await {
                Ok(Ok(b)) => b,
                Ok(Err(_)) => Some("cannot tell (the check failed)".into()),
                Err(_) => Some(format!(
                    "cannot tell (no answer from NVML within {BUSY_TIMEOUT:?})"
                )),
            }
        } else {
            None
        };
        Ok(Response::new(PingReply {
            node: self.node.clone(),
            protocol: PROTOCOL,
            busy: busy.is_some(),
            reason: busy.unwrap_or_default(),
        }))
    }

    async fn assign(
        &self,
        request: Request<CheckAssignment>,
    ) -> Result<Response<CheckAccepted>, Status> {
        let a = request.into_inner();
        let sender = self.verify("Assign", &a).await?;
        PeerService::check_protocol(a.protocol)?;
        if a.cancel {
            return Err(self.refused(
                "Assign",
                Status::invalid_argument("a cancellation is not an assignment"),
            ));
        }
        let refuse = |reason: String| {
            let reason = format!("{}: {reason}", self.node);
            debug!(from = %sender, reason, "assignment refused");
            self.count_check(PeerCheckResult::refused);
            Ok(Response::new(CheckAccepted {
                accepted: false,
                reason,
            }))
        };
        let Some((key, rank, partner)) = check_key(&a, &self.node) else {
            return refuse(format!("{} is not a member of this check", self.node));
        };
        let peers = match authz::check_probes(&a, self.probe_ports.clone()) {
            Ok(p) => p,
            Err(why) => return refuse(why.to_string()),
        };
        if a.coordinator.parse::<std::net::SocketAddr>().is_err() {
            return refuse("coordinator address is not ip:port".into());
        }
        let policy = self.policy.borrow().clone();
        let admitted = match authz::admit(&a, &policy) {
            Ok(x) => x,
            Err(why) => return refuse(why.to_string()),
        };
        self.remember_coordinator(&a.coordinator);
        let cancel = CancellationToken::new();
        {
            let mut running = self.running.lock();
            if running.len() >= MAX_CONCURRENT_CHECKS {
                return refuse(format!("{} checks already running", running.len()));
            }
            if running.contains_key(&key) {
                // The same assignment again: the coordinator retried a call whose answer it did
                // not get. The check runs; say so (a refusal would fail a check that is fine).
                return Ok(Response::new(CheckAccepted {
                    accepted: true,
                    reason: "already running (a repeated assignment)".into(),
                }));
            }
            running.insert(key.clone(), cancel.clone());
        }
        debug!(run_id = %a.run_id, round = a.round, partner = %partner, rank, from = %sender, "check assigned");
        let me = Arc::clone(&self.0);
        // The report goes to the coordinator that assigned the check, signed for its name.
        let coordinator_node = sender.clone();
        let span = tracing::info_span!("peer_check", run_id = %a.run_id, round = a.round, partner = %partner);
        tokio::spawn(
            async move {
                let report = me
                    .run_check(&a, admitted, rank, &partner, peers, cancel)
                    .await;
                me.running.lock().remove(&key);
                if let Some(report) = report {
                    match &a.report_via {
                        Some(via) => me.send_report_via(via, &coordinator_node, report).await,
                        None => {
                            me.send_report(&a.coordinator, &coordinator_node, report)
                                .await
                        }
                    }
                }
            }
            .instrument(span),
        );
        Ok(Response::new(CheckAccepted {
            accepted: true,
            reason: String::new(),
        }))
    }

    async fn cancel(
        &self,
        request: Request<CheckAssignment>,
    ) -> Result<Response<CheckAccepted>, Status> {
        let a = request.into_inner();
        self.verify("Cancel", &a).await?;
        if !a.cancel {
            return Err(self.refused(
                "Cancel",
                Status::invalid_argument("an assignment is not a cancellation"),
            ));
        }
        let found = check_key(&a, &self.node)
            .and_then(|(key, _, _)| self.running.lock().get(&key).cloned());
        if let Some(c) = &found {
            c.cancel();
        }
        Ok(Response::new(CheckAccepted {
            accepted: found.is_some(),
            reason: if found.is_some() {
                String::new()
            } else {
                "no such check running".into()
            },
        }))
    }

    async fn forward(&self, request: Request<Forward>) -> Result<Response<ForwardReply>, Status> {
        let mut f = request.into_inner();
        PeerService::check_protocol(f.protocol)?;
        if !matches!(f.message, Some(forward::Message::Report(_))) {
            // The coordinator's message for another member: only in an envelope the coordinator
            // signed for this relay, to the member it names.
            self.verify("Forward", &f).await?;
        }
        let msg = f
            .message
            .take()
            .ok_or_else(|| Status::invalid_argument("nothing to forward"))?;
        let small = !matches!(msg, forward::Message::Conclude(_));
        if small && msg.encoded_len() > authz::MAX_FORWARDED_BYTES {
            return Err(self.refused(
                "Forward",
                Status::invalid_argument(format!(
                    "{} bytes to forward, more than {}",
                    msg.encoded_len(),
                    authz::MAX_FORWARDED_BYTES
                )),
            ));
        }
        let report_key = match &msg {
            forward::Message::Report(r) => {
                Some((r.run_id.clone(), r.round, r.node.clone(), r.partner.clone()))
            }
            _ => None,
        };
        if let Some(k) = &report_key {
            // Only the report of a check whose assignment went through here (anyone may send a
            // report to be passed on: it is not this relay's to verify).
            let known = self.relayed.lock().contains(k);
            if !known {
                return Err(self.refused(
                    "Forward",
                    Status::permission_denied(format!(
                        "{} passed on no assignment of {} in run {} round {} with {}",
                        self.node, k.2, k.0, k.1, k.3
                    )),
                ));
            }
        }
        let taken = self.forwards.lock().take(SystemClock.instant());
        if !taken {
            return Err(self.refused(
                "Forward",
                Status::resource_exhausted("too many forwards; ask again later"),
            ));
        }
        let to = match msg {
            forward::Message::Report(r) => {
                // A member's report, to the coordinator as its own last message named it: the
                // report's signature is its author's, checked by the coordinator; this relay
                // cannot change it, and sends it nowhere else.
                let address = self.coordinator_address.lock().clone().ok_or_else(|| {
                    Status::unavailable("this relay has had no message from the coordinator")
                })?;
                let token = (!f.token.is_empty()).then_some(f.token.as_str());
                pass_report_on(&address, r, token)
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?;
                if let Some(k) = &report_key {
                    self.relayed.lock().retain(|x| x != k);
                }
                return Ok(Response::new(ForwardReply::default()));
            }
            msg => (f.to, msg),
        };
        let (Some(to), msg) = to else {
            return Err(Status::invalid_argument("no member to forward to"));
        };
        if to.node == self.node {
            return Err(Status::invalid_argument(format!(
                "{} does not forward to itself",
                self.node
            )));
        }
        if let forward::Message::Assign(a) = &msg {
            // Where the coordinator takes reports (its own envelope says so): this relay passes
            // the member's report there, and only that check's.
            self.remember_coordinator(&a.coordinator);
            let partner = [&a.a, &a.b]
                .into_iter()
                .flatten()
                .find(|m| m.node != to.node)
                .map(|m| m.node.clone())
                .unwrap_or_default();
            {
                let mut relayed = self.relayed.lock();
                if relayed.len() >= RELAYED_CHECKS {
                    relayed.pop_front();
                }
                relayed.push_back((a.run_id.clone(), a.round, to.node.clone(), partner));
            }
        }
        debug!(to = %to.node, "forwarding the coordinator's message");
        // The member not answering is the relay's answer, not its error: the coordinator tells
        // a relay that could not be asked from a member that could not be reached.
        Ok(Response::new(
            pass_on(&to.address, msg)
                .await
                .unwrap_or_else(|why| ForwardReply {
                    unreachable: why.to_string(),
                    ..Default::default()
                }),
        ))
    }

    async fn conclude(
        &self,
        request: Request<RunConclusion>,
    ) -> Result<Response<ReportAck>, Status> {
        let c = request.into_inner();
        self.verify("Conclude", &c).await?;
        PeerService::check_protocol(c.protocol)?;
        let verdicts = wire::from_proto(&c.members, &c.verdicts)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let Some(me) = c.members.iter().position(|m| m == &self.node) else {
            return Err(Status::invalid_argument(format!(
                "{} is not a member of run {}",
                self.node, c.run_id
            )));
        };
        // Named only when every failure of this node in the run was its probe not starting.
        let own = self
            .own_failures
            .lock()
            .iter()
            .find(|r| r.run_id == c.run_id && !r.other_failures)
            .and_then(|r| r.cannot_run.clone());
        let obs = faultline_core::peer::verdicts::observe(
            &c.members,
            me,
            &verdicts,
            &c.run_id,
            own.as_deref(),
        );
        info!(run_id = %c.run_id, observations = obs.len(), "peer-check verdicts received");
        for o in obs {
            match tokio::time::timeout(CONCLUDE_DELIVERY, self.inputs.send(Input::Obs(o))).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(Status::unavailable("the agent is shutting down")),
                Err(_) => {
                    return Err(Status::unavailable(format!(
                        "the agent did not take the verdicts within {CONCLUDE_DELIVERY:?}"
                    )))
                }
            }
        }
        Ok(Response::new(ReportAck {}))
    }
}

impl PeerService {
    async fn run_check(
        &self,
        a: &CheckAssignment,
        admitted: authz::Admitted,
        rank: usize,
        partner: &str,
        peers: Vec<std::net::SocketAddr>,
        cancel: CancellationToken,
    ) -> Option<CheckReport> {
        let spec = ProbeSpec {
            probe: self.probe.bin.clone(),
            peers,
            rank,
            bytes: admitted.bytes,
            iterations: admitted.iterations,
            timeout: admitted.timeout,
            grace: runner::PROBE_GRACE,
            gpu: self.probe.gpu,
        };
        let outcome = tokio::select! {
            o = runner::run_probe(&spec) => o,
            _ = cancel.cancelled() => {
                debug!("check cancelled by the coordinator");
                self.count_check(PeerCheckResult::cancelled);
                return None; // the probe child is killed as its future is dropped
            }
        };
        self.count_check(match &outcome {
            ProbeOutcome::Passed(_) => PeerCheckResult::passed,
            ProbeOutcome::Failed(_) => PeerCheckResult::failed,
            ProbeOutcome::TimedOut(_) => PeerCheckResult::timeout,
            ProbeOutcome::CannotRun(_) => PeerCheckResult::cannot_run,
        });
        let mut report = CheckReport {
            auth: None,
            protocol: PROTOCOL,
            run_id: a.run_id.clone(),
            round: a.round,
            node: self.node.clone(),
            partner: partner.to_string(),
            ..Default::default()
        };
        match outcome {
            ProbeOutcome::Passed(r) => {
                report.passed = true;
                report.seconds = r.median_seconds;
                report.busbw_gbps = r.busbw_gbps;
                if a.gemm {
                    match runner::run_gemm(&self.probe.bin, self.probe.gpu, spec.timeout).await {
                        Ok(g) => report.gemm_gflops = g,
                        Err(e) => warn!(error = %e, "GEMM failed (not a verdict)"),
                    }
                }
            }
            ProbeOutcome::Failed(e) => {
                self.note_failure(&a.run_id, None);
                report.passed = false;
                report.error = e;
            }
            ProbeOutcome::TimedOut(e) => {
                report.passed = false;
                report.timed_out = true;
                report.error = e;
            }
            ProbeOutcome::CannotRun(e) => {
                warn!(error = %e, "the probe cannot run on this node");
                self.note_failure(&a.run_id, Some(&e));
                report.passed = false;
                report.error = e;
            }
        }
        Some(report)
    }

    /// `faultline_peer_checks_total`: one check this agent was assigned, by how it ended here.
    fn count_check(&self, result: PeerCheckResult) {
        self.metrics
            .peer_checks
            .get_or_create(&PeerCheckLabel { result })
            .inc();
    }

    /// Remembers a failed check of this node in `run_id`: its probe could not start (`cause`),
    /// or it failed otherwise.
    fn note_failure(&self, run_id: &str, cause: Option<&str>) {
        let mut f = self.own_failures.lock();
        if !f.iter().any(|r| r.run_id == run_id) {
            if f.len() >= OWN_FAILURES_KEPT {
                f.pop_front();
            }
            f.push_back(OwnRun {
                run_id: run_id.to_string(),
                cannot_run: None,
                other_failures: false,
            });
        }
        if let Some(r) = f.iter_mut().find(|r| r.run_id == run_id) {
            match cause {
                Some(c) => {
                    r.cannot_run.get_or_insert_with(|| c.to_string());
                }
                None => r.other_failures = true,
            }
        }
    }

    /// Sends the report, up to `REPORT_ATTEMPTS` times while the coordinator cannot be reached
    /// (a lost report leaves the check unjudged; the coordinator waits `REPORT_SLACK` past the
    /// deadline for it). A refusal is an answer and is not repeated. Each attempt is signed
    /// anew with this node's credential, for the coordinator `to` (the sender of the
    /// assignment): the coordinator refuses a nonce it has seen, every agent a report.
    async fn send_report(&self, coordinator: &str, to: &str, report: CheckReport) {
        let attempt = || {
            let signed = self.credential.sign(report.clone(), &self.node, to);
            async move {
                let signed = signed.map_err(|e| (false, CallError::from(e)))?;
                let ch = endpoint(coordinator)
                    .map_err(|e| (false, e))?
                    .connect()
                    .await
                    .map_err(|e| (true, CallError::Transport(e)))?;
                let mut c = CoordinatorClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
                let mut request = timed(signed.msg, CALL_TIMEOUT);
                if let Some(t) = &signed.token {
                    bearer(&mut request, t).map_err(|e| (false, e))?;
                }
                match tokio::time::timeout(CALL_TIMEOUT, c.report(request)).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(s)) => Err((
                        matches!(
                            s.code(),
                            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                        ),
                        CallError::Answer(s),
                    )),
                    Err(_) => Err((true, CallError::Timeout(CALL_TIMEOUT))),
                }
            }
        };
        // The error says whether it may pass (the coordinator unreachable) or is an answer.
        let sent = super::retried(REPORT_ATTEMPTS, REPORT_RETRY_PAUSE, |e| e.0, attempt).await;
        if let Err((_, e)) = sent {
            warn!(coordinator, error = %e, "cannot send the check report");
        }
    }

    /// Sends the report through the member the assignment named (`report_via`), as
    /// `send_report` does directly: up to `REPORT_ATTEMPTS` times while it cannot be reached,
    /// each attempt signed anew.
    async fn send_report_via(
        &self,
        via: &faultline_proto::v1::Member,
        to: &str,
        report: CheckReport,
    ) {
        let attempt = || {
            let signed = self.credential.sign(report.clone(), &self.node, to);
            async move {
                let signed = signed.map_err(|e| (false, CallError::from(e)))?;
                let envelope = Forward {
                    auth: None,
                    protocol: PROTOCOL,
                    to: None,
                    token: signed.token.unwrap_or_default(),
                    message: Some(forward::Message::Report(signed.msg)),
                };
                let ch = endpoint(&via.address)
                    .map_err(|e| (false, e))?
                    .connect_lazy();
                let mut c = PeerCheckClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
                within(FORWARD_TIMEOUT, |t| c.forward(timed(envelope, t)))
                    .await
                    .map(|_| ())
                    .map_err(|e| (true, e))
            }
        };
        let sent = super::retried(REPORT_ATTEMPTS, REPORT_RETRY_PAUSE, |e| e.0, attempt).await;
        if let Err((_, e)) = sent {
            warn!(via = %via.node, error = %e, "cannot send the check report through the relay");
        }
    }
}

/// A relay passes a member's report on to the coordinator, verbatim, with its token (one
/// attempt: the member tries again, signing anew).
async fn pass_report_on(
    address: &str,
    r: CheckReport,
    token: Option<&str>,
) -> Result<(), CallError> {
    let ch = endpoint(address)?
        .connect()
        .await
        .map_err(|source| CallError::Connect {
            address: address.to_string(),
            source,
        })?;
    let mut c = CoordinatorClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let mut request = timed(r, CALL_TIMEOUT);
    if let Some(t) = token {
        bearer(&mut request, t)?;
    }
    match tokio::time::timeout(CALL_TIMEOUT, c.report(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(CallError::Answer(s)),
        Err(_) => Err(CallError::Timeout(CALL_TIMEOUT)),
    }
}

/// A relay's call onward: the coordinator's message to the member at `address`, verbatim (its
/// signature is the coordinator's); the receiver's answer.
async fn pass_on(address: &str, msg: forward::Message) -> Result<ForwardReply, CallError> {
    let ch = endpoint(address)?.connect_lazy();
    let mut c = PeerCheckClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
    Ok(match msg {
        forward::Message::Ping(p) => ForwardReply {
            ping: Some(within(CALL_TIMEOUT, |t| c.ping(timed(p, t))).await?),
            ..Default::default()
        },
        forward::Message::Assign(a) => ForwardReply {
            accepted: Some(within(CALL_TIMEOUT, |t| c.assign(timed(a, t))).await?),
            ..Default::default()
        },
        forward::Message::Cancel(a) => ForwardReply {
            accepted: Some(within(CALL_TIMEOUT, |t| c.cancel(timed(a, t))).await?),
            ..Default::default()
        },
        forward::Message::Conclude(m) => {
            within(CONCLUDE_TIMEOUT, |t| c.conclude(timed(m, t))).await?;
            ForwardReply::default()
        }
        forward::Message::Report(_) => return Err(CallError::ReportToMember),
    })
}

/// Why a call to another agent or to the coordinator got no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("bad address {address:?}: {source}")]
    BadAddress {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot reach the coordinator at {address}: {source}")]
    Connect {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The connection failed (a caller that names the address itself).
    #[error(transparent)]
    Transport(tonic::transport::Error),
    #[error("the token is not a valid header value")]
    Token,
    /// The receiver's answer was an error status (its message, as the receiver wrote it).
    #[error("{}", .0.message())]
    Answer(#[source] Status),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("a report goes to the coordinator")]
    ReportToMember,
    #[error(transparent)]
    Sign(#[from] wire::SecretError),
}

/// A client endpoint for `address` (`ip:port`).
pub fn endpoint(address: &str) -> Result<Endpoint, CallError> {
    Endpoint::from_shared(format!("http://{address}"))
        .map(|e| e.connect_timeout(CALL_TIMEOUT).tcp_nodelay(true))
        .map_err(|source| CallError::BadAddress {
            address: address.to_string(),
            source,
        })
}

/// A request with a deadline the server learns (`grpc-timeout`).
pub fn timed<T>(msg: T, timeout: Duration) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// Adds `authorization: Bearer <token>`.
pub fn bearer<T>(r: &mut Request<T>, token: &str) -> Result<(), CallError> {
    let value = format!("Bearer {token}")
        .parse()
        .map_err(|_| CallError::Token)?;
    r.metadata_mut().insert("authorization", value);
    Ok(())
}

/// One call with a deadline (`call` gets it to send to the server; it is also enforced here in
/// case the server never answers): the answer, or why there is none.
pub async fn within<T, F>(
    timeout: Duration,
    call: impl FnOnce(Duration) -> F,
) -> Result<T, CallError>
where
    F: std::future::Future<Output = Result<Response<T>, Status>>,
{
    match tokio::time::timeout(timeout, call(timeout)).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(CallError::Answer(s)),
        Err(_) => Err(CallError::Timeout(timeout)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use faultline_proto::auth::{node_key, CoordinatorKey, Key, NONCE_BYTES};
    use faultline_proto::v1::coordinator_server::Coordinator as CoordinatorRpc;
    use faultline_proto::v1::{Member as WireMember, RunRequest, RunResult};

    use crate::peer::wire::{CoordinatorSigner, Signer};

    const MASTER: &[u8] = b"the coordinator's master, 32 b..";
    const REQUESTER: &[u8] = b"requester secret, not the agents";

    /// The coordinator "c0": its key, and its signer.
    fn coordinator() -> CoordinatorSigner {
        CoordinatorSigner {
            key: Arc::new(CoordinatorKey::generate().unwrap()),
            sender: "c0".into(),
        }
    }

    fn known(c: &CoordinatorSigner) -> watch::Receiver<Option<CoordinatorId>> {
        watch::channel(Some(CoordinatorId {
            node: c.sender.clone(),
            address: Some("10.0.0.9:20262".into()),
            key: c.key.public_key(),
        }))
        .1
    }

    /// What a member holds: its node's own key (bare metal) and the requesters' secret.
    fn node_signer(node: &str) -> Signer {
        Signer {
            key: node_key(&Key::new(MASTER).unwrap(), node),
            sender: node.into(),
        }
    }

    /// The service of `me` in the net `<net>.*`, obeying `who`, running `probe`.
    fn service_on(
        me: &str,
        who: Arc<dyn WhoCoordinates>,
        probe: PathBuf,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> (PeerHandle, mpsc::Receiver<Input>) {
        let (tx, rx) = mpsc::channel(8);
        let svc = PeerService::new(ServiceSetup {
            node: me.into(),
            coordinator: who,
            credential: NodeCredential::Key(node_key(&Key::new(MASTER).unwrap(), me)),
            probe: ProbeSetup {
                bin: probe,
                gpu: false,
            },
            busy: Arc::new(NeverBusy),
            inputs: tx,
            policy: watch::channel(PeerPolicy::default()).1,
            probe_ports: 20270..20302,
            metrics,
        });
        (PeerHandle(Arc::new(svc)), rx)
    }

    /// n1, obeying `c`.
    fn service(c: &CoordinatorSigner) -> (PeerHandle, mpsc::Receiver<Input>) {
        service_on(
            "n1",
            Arc::new(known(c)),
            "/nonexistent/faultline-probe".into(),
            Arc::new(crate::metrics::Metrics::new()),
        )
    }

    fn assignment() -> CheckAssignment {
        let m = |n: &str, a: &str| WireMember {
            node: n.into(),
            address: a.into(),
            topology: String::new(),
        };
        CheckAssignment {
            auth: None,
            protocol: PROTOCOL,
            run_id: "r1".into(),
            round: 1,
            a: Some(m("n0", "10.0.0.1:20261")),
            b: Some(m("n1", "10.0.0.2:20261")),
            probe_a: "10.0.0.1:20270".into(),
            probe_b: "10.0.0.2:20270".into(),
            bytes: 1 << 20,
            iterations: 1,
            timeout_ms: 1000,
            gemm: false,
            coordinator: "10.0.0.9:20262".into(),
            report_via: None,
            cancel: false,
        }
    }

    fn conclusion(faulty: &str) -> RunConclusion {
        RunConclusion {
            auth: None,
            protocol: PROTOCOL,
            run_id: "r1".into(),
            members: vec!["n0".into(), "n1".into(), "n2".into()],
            verdicts: vec![faultline_proto::v1::Verdict {
                kind: faultline_proto::v1::verdict::Kind::FaultyNode as i32,
                nodes: vec![faulty.into()],
                slowdown: 0.0,
                reason: String::new(),
            }],
        }
    }

    type Edit = Box<dyn Fn(&mut CheckAssignment)>;

    /// How many observations reached the engine since the last look.
    fn recorded(inputs: &mut mpsc::Receiver<Input>) -> usize {
        std::iter::from_fn(|| inputs.try_recv().ok()).count()
    }

    /// Issue 26 §2 (`faultline_peer_checks_total{result}`): every check this agent is assigned
    /// counts once, by how it ended here: its probe passed, failed, ran out of time or could not
    /// start, the coordinator cancelled it, or the agent refused the assignment. The members
    /// are on loopback, the probe is a script.
    #[tokio::test]
    async fn each_assigned_check_counts_by_its_result() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| -> PathBuf {
            let p = dir.path().join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p
        };
        let report = r#"{"world":2,"rank":1,"median_seconds":0.001,"busbw_gbps":1.0}"#;
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let count = |result: &str| -> u64 {
            let line = format!("faultline_peer_checks_total{{result=\"{result}\"}} ");
            metrics
                .encode()
                .lines()
                .find_map(|l| l.strip_prefix(line.as_str())?.parse().ok())
                .unwrap_or(0)
        };
        let on_loopback = |m: &mut CheckAssignment| {
            for a in [&mut m.probe_a, &mut m.probe_b, &mut m.coordinator] {
                *a = a.replace("10.0.0.", "127.0.0.");
            }
        };
        let c = coordinator();
        let service = |probe: PathBuf| {
            let (svc, inputs) = service_on("n1", Arc::new(known(&c)), probe, metrics.clone());
            std::mem::forget(inputs);
            svc
        };
        let cases = [
            (script("pass", &format!("echo '{report}'")), "passed"),
            (script("fail", "echo broken >&2; exit 1"), "failed"),
            (script("slow", "echo too slow >&2; exit 3"), "timeout"),
            (dir.path().join("missing"), "cannot_run"),
        ];
        for (i, (probe, result)) in cases.into_iter().enumerate() {
            let svc = service(probe);
            let mut a = assignment();
            on_loopback(&mut a);
            a.run_id = format!("r{i}");
            let r = svc.assign(Request::new(c.sign(a, "n1"))).await.unwrap();
            assert!(r.get_ref().accepted, "{result}: {r:?}");
            let counted = tokio::time::timeout(Duration::from_secs(20), async {
                while count(result) == 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await;
            assert!(
                counted.is_ok(),
                "{result} not counted: {}",
                metrics.encode()
            );
        }

        let svc = service(script("hang", "exec sleep 60"));
        let mut a = assignment();
        on_loopback(&mut a);
        let r = svc
            .assign(Request::new(c.sign(a.clone(), "n1")))
            .await
            .unwrap();
        assert!(r.get_ref().accepted, "{r:?}");
        let cancel = CheckAssignment {
            cancel: true,
            ..a.clone()
        };
        let r = svc
            .cancel(Request::new(c.sign(cancel, "n1")))
            .await
            .unwrap();
        assert!(r.get_ref().accepted, "{r:?}");
        let counted = tokio::time::timeout(Duration::from_secs(20), async {
            while count("cancelled") == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(counted.is_ok(), "cancelled not counted");

        a.probe_b = "127.0.0.2:9".into();
        let r = svc.assign(Request::new(c.sign(a, "n1"))).await.unwrap();
        assert!(!r.get_ref().accepted, "{r:?}");
        for result in [
            "passed",
            "failed",
            "timeout",
            "cannot_run",
            "cancelled",
            "refused",
        ] {
            assert_eq!(count(result), 1, "{result}: {}", metrics.encode());
        }
    }

    /// Bad assignments from the coordinator are refused with the reason and start nothing;
    /// another protocol version and a conclusion naming a non-member are refused as a whole.
    #[tokio::test]
    async fn bad_requests_get_clear_refusals() {
        let c = coordinator();
        let (svc, mut inputs) = service(&c);
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|a| a.b.as_mut().unwrap().node = "n9".into()),
                "not a member",
            ),
            (Box::new(|a| a.probe_b = "nowhere".into()), "not ip:port"),
            (
                Box::new(|a| a.probe_b = "10.0.0.2:10250".into()),
                "not among the probe ports",
            ),
            (
                Box::new(|a| a.coordinator = "x".into()),
                "coordinator address",
            ),
            (Box::new(|a| a.bytes = 0), "bytes, iterations and timeout"),
            (Box::new(|a| a.bytes = 8 << 30), "over this agent's limit"),
            (
                Box::new(|a| a.iterations = u32::MAX),
                "iterations 4294967295 over",
            ),
        ];
        for (edit, why) in cases {
            let mut a = assignment();
            edit(&mut a);
            let r = svc
                .assign(Request::new(c.sign(a, "n1")))
                .await
                .unwrap()
                .into_inner();
            assert!(!r.accepted && r.reason.contains(why), "{why}: {r:?}");
        }
        assert!(svc.running.lock().is_empty(), "nothing started");
        // Issue 28 review: a Cancel is the same message as an Assign; one replayed as the other
        // (by a relay, or on the path) is refused.
        let cancel = c.sign(
            CheckAssignment {
                cancel: true,
                ..assignment()
            },
            "n1",
        );
        let s = svc.assign(Request::new(cancel)).await.unwrap_err();
        assert!(s.message().contains("not an assignment"), "{s:?}");
        let s = svc
            .cancel(Request::new(c.sign(assignment(), "n1")))
            .await
            .unwrap_err();
        assert!(s.message().contains("not a cancellation"), "{s:?}");
        assert!(svc.running.lock().is_empty(), "nothing started");
        let mut a = assignment();
        a.protocol = PROTOCOL + 1;
        let s = svc.assign(Request::new(c.sign(a, "n1"))).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        let mut bad = conclusion("zz");
        bad.members.truncate(2);
        let s = svc
            .conclude(Request::new(c.sign(bad, "n1")))
            .await
            .unwrap_err();
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(inputs.try_recv().is_err(), "nothing recorded");
    }

    /// Issue 28: any member could act as the coordinator (the sender was a name it wrote,
    /// signed with the key every agent held). A member now holds its own node's key, a
    /// requester's secret and an Ed25519 key of its own making, and signs the coordinator's
    /// messages with each, under the coordinator's name: `Conclude` (which made a healthy node
    /// Degraded), `Assign` (four filled the node's check slots so that the real checks were
    /// refused), `Cancel` and `Ping`. Every one is refused (`UNAUTHENTICATED`), nothing is
    /// recorded or started, and the coordinator's own assignment then finds the slots free.
    #[tokio::test]
    async fn a_member_with_every_agent_credential_cannot_speak_as_the_coordinator() {
        let c = coordinator();
        let (svc, mut inputs) = service(&c);
        let own_key = node_signer("n2");
        let as_coordinator = |key: &Key| Signer {
            key: key.clone(),
            sender: "c0".into(),
        };
        let forged_ed25519 = CoordinatorSigner {
            key: Arc::new(CoordinatorKey::generate().unwrap()),
            sender: "c0".into(),
        };
        let hmac_forgers = [
            as_coordinator(&own_key.key),
            as_coordinator(&Key::new(REQUESTER).unwrap()),
            as_coordinator(&Key::new(MASTER).unwrap()),
        ];
        let mut refused = 0;
        for f in &hmac_forgers {
            let e = svc
                .conclude(Request::new(f.sign(conclusion("n1"), "n1")))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
            assert!(e.message().contains("not the coordinator's"), "{e:?}");
            for i in 0..4 {
                let mut a = assignment();
                a.run_id = format!("spoof{i}");
                let e = svc.assign(Request::new(f.sign(a, "n1"))).await.unwrap_err();
                assert_eq!(e.code(), tonic::Code::Unauthenticated);
            }
            let e = svc
                .cancel(Request::new(f.sign(assignment(), "n1")))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated);
            let ping = PingRequest {
                auth: None,
                protocol: PROTOCOL,
            };
            let e = svc
                .ping(Request::new(f.sign(ping, "n1")))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated);
            refused += 1;
        }
        let e = svc
            .conclude(Request::new(forged_ed25519.sign(conclusion("n1"), "n1")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        assert!(
            e.message()
                .contains("does not verify with the coordinator's"),
            "{e:?}"
        );
        assert_eq!(refused, hmac_forgers.len());
        assert!(inputs.try_recv().is_err(), "nothing recorded");
        assert!(svc.running.lock().is_empty(), "no slot taken");
        // The coordinator's own: taken.
        svc.conclude(Request::new(c.sign(conclusion("n1"), "n1")))
            .await
            .unwrap();
        assert!(inputs.try_recv().is_ok(), "the verdict is recorded");
        let r = svc
            .assign(Request::new(c.sign(assignment(), "n1")))
            .await
            .unwrap();
        assert!(r.get_ref().accepted, "{r:?}");
    }

    /// Issue 28: the Lease moves to another replica (its key in the holder identity): the new
    /// one is obeyed at once (the agent reads the holder again when a signature does not
    /// verify), the old one, frozen and woken, is refused; when the Lease comes back to it, what
    /// it sent before is still a replay; with no holder nobody is obeyed.
    #[tokio::test]
    async fn only_the_lease_holders_key_is_obeyed() {
        let (old, new) = (coordinator(), coordinator());
        let (tx, rx) = watch::channel(known(&old).borrow().clone());
        let (svc, mut inputs) = service_on(
            "n1",
            Arc::new(rx),
            "/nonexistent/faultline-probe".into(),
            Arc::new(crate::metrics::Metrics::new()),
        );
        let first = old.sign(conclusion("n1"), "n1");
        svc.conclude(Request::new(first.clone())).await.unwrap();
        assert!(recorded(&mut inputs) > 0);
        tx.send_replace(known(&new).borrow().clone());
        svc.conclude(Request::new(new.sign(conclusion("n1"), "n1")))
            .await
            .unwrap();
        assert!(recorded(&mut inputs) > 0, "the new holder is obeyed");
        let e = svc
            .conclude(Request::new(old.sign(conclusion("n1"), "n1")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        assert_eq!(recorded(&mut inputs), 0, "the old one is not");
        // Back to the first replica: what it sent before is still a replay.
        tx.send_replace(known(&old).borrow().clone());
        let e = svc.conclude(Request::new(first)).await.unwrap_err();
        assert!(e.message().contains("replay"), "{e:?}");
        assert_eq!(recorded(&mut inputs), 0);
        tx.send_replace(None);
        let e = svc
            .conclude(Request::new(new.sign(conclusion("n1"), "n1")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().contains("no coordinator"), "{e:?}");
    }

    /// Issue 28: a Conclude the coordinator signed for one agent, replayed verbatim to a
    /// second, was accepted (each agent keeps its own nonces). Requests name their receiver:
    /// n1 takes the conclusion, n2 refuses the same bytes (`UNAUTHENTICATED`, "addressed to")
    /// and records nothing; an assignment signed for another node is refused likewise.
    #[tokio::test]
    async fn a_request_signed_for_one_agent_is_refused_by_another() {
        let c = coordinator();
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let serve = |me: &str| {
            let probe = "/nonexistent/faultline-probe".into();
            service_on(me, Arc::new(known(&c)), probe, metrics.clone())
        };
        let (n1, _n1_inputs) = serve("n1");
        let (n2, mut n2_inputs) = serve("n2");
        let msg = c.sign(conclusion("n2"), "n1");
        n1.conclude(Request::new(msg.clone())).await.unwrap();
        let e = n2.conclude(Request::new(msg)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        assert!(
            e.message()
                .contains("addressed to \"n1\", not to this receiver (\"n2\")"),
            "{}",
            e.message()
        );
        assert!(n2_inputs.try_recv().is_err(), "n2 recorded nothing");
        let mut a = assignment();
        a.a.as_mut().unwrap().node = "n2".into();
        let e = n2.assign(Request::new(c.sign(a, "n1"))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        assert!(n2.running.lock().is_empty(), "nothing started");
    }

    /// Issue 28: a Conclude signed 25 s ahead of the agent's clock was accepted (30 s either
    /// way). Now refused (`UNAUTHENTICATED`, "ahead") and nothing is recorded; one signed
    /// 0.5 s ahead (within `auth::MAX_AHEAD`) is taken.
    #[tokio::test]
    async fn a_request_signed_in_the_future_is_refused() {
        let c = coordinator();
        let (svc, mut inputs) = service(&c);
        let ahead = |ms: i64, nonce: u8| {
            let mut m = conclusion("n1");
            c.key.sign(
                &mut m,
                "c0",
                "n1",
                wire::now_ms() + ms,
                [nonce; NONCE_BYTES],
            );
            m
        };
        let e = svc
            .conclude(Request::new(ahead(25_000, 1)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        assert!(
            e.message().contains("ms ahead of this node's clock"),
            "{}",
            e.message()
        );
        assert!(inputs.try_recv().is_err(), "nothing recorded");
        svc.conclude(Request::new(ahead(500, 2))).await.unwrap();
        assert!(inputs.try_recv().is_ok(), "the verdict is recorded");
    }

    fn envelope(
        by: &CoordinatorSigner,
        relay: &str,
        to: Option<WireMember>,
        m: forward::Message,
    ) -> Forward {
        by.sign(
            Forward {
                auth: None,
                protocol: PROTOCOL,
                to,
                token: String::new(),
                message: Some(m),
            },
            relay,
        )
    }

    fn wire(node: &str, address: &str) -> Option<WireMember> {
        Some(WireMember {
            node: node.into(),
            address: address.into(),
            topology: String::new(),
        })
    }

    /// The relay's bounds (`Forward`): the coordinator's messages only in an envelope the
    /// coordinator signed for this relay, never to itself; a report only of a check whose
    /// assignment it passed on (issue 28 review: anyone could make every relay send junk
    /// reports, each a TokenReview); too large a message and too many forwards are refused. Nothing here reaches the network. On the paused clock, so
    /// the rate does not refill.
    #[tokio::test(start_paused = true)]
    async fn a_relay_forwards_only_within_its_bounds() {
        let c = coordinator();
        let (svc, _inputs) = service(&c);
        let n2 = node_signer("n2");
        let forger = CoordinatorSigner {
            key: Arc::new(CoordinatorKey::generate().unwrap()),
            sender: "c0".into(),
        };
        let assign = |to: &str| forward::Message::Assign(c.sign(assignment(), to));
        let report = forward::Message::Report(n2.sign(
            CheckReport {
                protocol: PROTOCOL,
                node: "n2".into(),
                ..Default::default()
            },
            "c0",
        ));
        let cases: Vec<(Forward, tonic::Code, &str)> = vec![
            (
                envelope(&forger, "n1", wire("n2", "10.0.0.3:20261"), assign("n2")),
                tonic::Code::Unauthenticated,
                "not the coordinator's",
            ),
            (
                envelope(&c, "n2", wire("n2", "10.0.0.3:20261"), assign("n2")),
                tonic::Code::Unauthenticated,
                "addressed to \"n2\"",
            ),
            (
                envelope(&c, "n1", wire("n1", "10.0.0.2:20261"), assign("n1")),
                tonic::Code::InvalidArgument,
                "does not forward to itself",
            ),
            (
                envelope(&c, "n1", None, assign("n2")),
                tonic::Code::InvalidArgument,
                "no member to forward to",
            ),
            (
                envelope(&c, "n1", wire("n2", "10.0.0.3:20261"), {
                    let mut a = assignment();
                    a.run_id = "x".repeat(authz::MAX_FORWARDED_BYTES);
                    forward::Message::Assign(c.sign(a, "n2"))
                }),
                tonic::Code::InvalidArgument,
                "bytes to forward",
            ),
            (
                Forward {
                    auth: None,
                    protocol: PROTOCOL,
                    to: None,
                    token: String::new(),
                    message: Some(report.clone()),
                },
                tonic::Code::PermissionDenied,
                "n1 passed on no assignment of n2 in run  round 0 with ",
            ),
        ];
        for (f, code, why) in cases {
            let e = svc.forward(Request::new(f)).await.unwrap_err();
            assert_eq!(e.code(), code, "{why}: {e:?}");
            assert!(e.message().contains(why), "{why}: {e:?}");
        }
        // The rate: a burst, then refused (each of these is refused after its token is taken).
        let spend = || {
            let f = envelope(&c, "n1", wire("n1", "10.0.0.2:20261"), assign("n1"));
            let svc = svc.clone();
            async move { svc.forward(Request::new(f)).await.unwrap_err().code() }
        };
        let mut codes = Vec::new();
        for _ in 0..authz::FORWARD_BURST as usize {
            codes.push(spend().await);
        }
        assert!(codes
            .iter()
            .all(|c| *c == tonic::Code::InvalidArgument || *c == tonic::Code::ResourceExhausted));
        assert_eq!(spend().await, tonic::Code::ResourceExhausted);
    }

    /// A far agent (n2) and a coordinator (c0) on loopback that verify and record what reaches
    /// them: what a relay passes on must verify as its original signer's.
    #[derive(Clone)]
    struct Far {
        me: String,
        coordinator: CoordinatorPublicKey,
        got: Arc<Mutex<Vec<String>>>,
    }

    impl Far {
        /// Verifies `m` as signed with `key` for `to`, and records it.
        fn note<M: Signed>(
            &self,
            what: &str,
            m: &M,
            key: faultline_proto::auth::VerifyKey,
            to: &str,
        ) -> Result<(), Status> {
            let sender = Verifier::new(key, Duration::from_secs(30), to)
                .verify(m, wire::now_ms())
                .map_err(|e| Status::unauthenticated(e.to_string()))?;
            self.got.lock().push(format!("{what} from {sender}"));
            Ok(())
        }

        fn note_coordinators<M: Signed>(&self, what: &str, m: &M) -> Result<(), Status> {
            self.note(what, m, self.coordinator.into(), &self.me)
        }

        async fn serve(&self, at: &str) {
            let listener = tokio::net::TcpListener::bind(at).await.unwrap();
            let incoming = crate::listen::incoming(
                listener,
                crate::listen::PEER_LIMITS,
                Arc::new(crate::metrics::Metrics::new()),
                "peer",
            );
            let server = tonic::transport::Server::builder()
                .add_service(
                    faultline_proto::v1::peer_check_server::PeerCheckServer::new(self.clone()),
                )
                .add_service(
                    faultline_proto::v1::coordinator_server::CoordinatorServer::new(self.clone()),
                )
                .serve_with_incoming(incoming);
            tokio::spawn(server);
        }
    }

    #[tonic::async_trait]
    impl PeerCheck for Far {
        async fn ping(&self, r: Request<PingRequest>) -> Result<Response<PingReply>, Status> {
            self.note_coordinators("ping", r.get_ref())?;
            Ok(Response::new(PingReply {
                node: self.me.clone(),
                protocol: PROTOCOL,
                ..Default::default()
            }))
        }
        async fn assign(
            &self,
            r: Request<CheckAssignment>,
        ) -> Result<Response<CheckAccepted>, Status> {
            self.note_coordinators("assign", r.get_ref())?;
            Ok(Response::new(CheckAccepted {
                accepted: true,
                reason: "n2 took it".into(),
            }))
        }
        async fn cancel(
            &self,
            _: Request<CheckAssignment>,
        ) -> Result<Response<CheckAccepted>, Status> {
            Err(Status::unimplemented("not used"))
        }
        async fn conclude(&self, r: Request<RunConclusion>) -> Result<Response<ReportAck>, Status> {
            self.note_coordinators("conclude", r.get_ref())?;
            Ok(Response::new(ReportAck {}))
        }
        async fn forward(&self, r: Request<Forward>) -> Result<Response<ForwardReply>, Status> {
            if let Some(forward::Message::Report(rep)) = &r.get_ref().message {
                let key = node_key(&Key::new(MASTER).unwrap(), &rep.node);
                // For the coordinator: this relay only passes it on.
                self.note("forwarded report", rep, VerifyKey(key).into(), "c0")?;
            }
            Ok(Response::new(ForwardReply::default()))
        }
    }

    /// `VerifyKey::Hmac` by another name, for `Far::note`.
    struct VerifyKey(Key);

    impl From<VerifyKey> for faultline_proto::auth::VerifyKey {
        fn from(k: VerifyKey) -> Self {
            faultline_proto::auth::VerifyKey::Hmac(k.0)
        }
    }

    #[tonic::async_trait]
    impl CoordinatorRpc for Far {
        async fn report(&self, r: Request<CheckReport>) -> Result<Response<ReportAck>, Status> {
            let key = node_key(&Key::new(MASTER).unwrap(), &r.get_ref().node);
            self.note("report", r.get_ref(), VerifyKey(key).into(), &self.me)?;
            Ok(Response::new(ReportAck {}))
        }
        async fn run(&self, _: Request<RunRequest>) -> Result<Response<RunResult>, Status> {
            Err(Status::unimplemented("not used"))
        }
        async fn admit(
            &self,
            _: Request<faultline_proto::v1::AdmitRequest>,
        ) -> Result<Response<faultline_proto::v1::AdmitReply>, Status> {
            Err(Status::unimplemented("not used"))
        }
    }

    /// Over real gRPC on loopback (the coordinator at 127.0.28.9:20262, n2 at 127.0.28.3): the
    /// relay n1 passes the coordinator's ping, assignment and conclusion on to n2, and n2's
    /// report on to the coordinator at the address the coordinator's assignment named,
    /// verbatim (each verifies as its signer's at its receiver), and returns n2's answer; a
    /// member whose assignment names a relay sends its report inside a `Forward` to it.
    #[tokio::test]
    async fn a_relay_passes_messages_on_verbatim() {
        let c = coordinator();
        let far = |me: &str| Far {
            me: me.into(),
            coordinator: c.key.public_key(),
            got: Arc::default(),
        };
        let (coordinator_at, n2_at) = (far("c0"), far("n2"));
        coordinator_at.serve("127.0.28.9:20262").await;
        n2_at.serve("127.0.28.3:20261").await;
        let (relay, _inputs) = service(&c);
        let to_n2 = wire("n2", "127.0.28.3:20261");
        let r = relay
            .forward(Request::new(envelope(
                &c,
                "n1",
                to_n2.clone(),
                forward::Message::Ping(c.sign(
                    PingRequest {
                        auth: None,
                        protocol: PROTOCOL,
                    },
                    "n2",
                )),
            )))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.ping.unwrap().node, "n2");
        let r = relay
            .forward(Request::new(envelope(
                &c,
                "n1",
                to_n2.clone(),
                forward::Message::Assign(c.sign(assignment(), "n2")),
            )))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.accepted.unwrap().reason, "n2 took it");
        relay
            .forward(Request::new(envelope(
                &c,
                "n1",
                to_n2,
                forward::Message::Conclude(c.sign(conclusion("n2"), "n2")),
            )))
            .await
            .unwrap();
        // The relay learns where the coordinator takes reports from its own assignment.
        let mut own = assignment();
        own.coordinator = "127.0.28.9:20262".into();
        own.probe_a = "127.0.0.1:20270".into();
        own.probe_b = "127.0.0.1:20271".into();
        assert!(
            relay
                .assign(Request::new(c.sign(own, "n1")))
                .await
                .unwrap()
                .get_ref()
                .accepted
        );
        let report = CheckReport {
            protocol: PROTOCOL,
            run_id: "r1".into(),
            round: 1,
            node: "n2".into(),
            partner: "n0".into(),
            passed: true,
            ..Default::default()
        };
        relay
            .forward(Request::new(Forward {
                auth: None,
                protocol: PROTOCOL,
                to: None,
                token: String::new(),
                message: Some(forward::Message::Report(
                    node_signer("n2").sign(report.clone(), "c0"),
                )),
            }))
            .await
            .unwrap();
        assert_eq!(
            n2_at.got.lock().clone(),
            vec!["ping from c0", "assign from c0", "conclude from c0"]
        );
        let got = coordinator_at.got.lock().clone();
        assert!(got.contains(&"report from n2".to_string()), "{got:?}");
        // The relay's own reports go through the relay its assignment names, signed with its
        // own node's key.
        let via = WireMember {
            node: "n2".into(),
            address: "127.0.28.3:20261".into(),
            topology: String::new(),
        };
        relay
            .send_report_via(
                &via,
                "c0",
                CheckReport {
                    node: "n1".into(),
                    ..report
                },
            )
            .await;
        assert_eq!(
            n2_at.got.lock()[3..].to_vec(),
            vec!["forwarded report from n1"]
        );
    }
}
