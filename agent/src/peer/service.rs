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
use std::sync::{Arc, Mutex};
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

/// The served handle (tonic services are implemented on it).
#[derive(Debug, Clone)]
pub struct PeerHandle(pub Arc<PeerService>);

impl std::ops::Deref for PeerHandle {
    type Target = PeerService;
    fn deref(&self) -> &PeerService {
        &self.0
    }
}

/// Verifies requests as the coordinator's: its key as [`WhoCoordinates`] names it now, and one
/// nonce memory per key.
#[derive(Debug)]
struct CoordinatorAuth {
    who: Arc<dyn WhoCoordinates>,
    me: String,
    verifier: Mutex<Option<(CoordinatorPublicKey, Verifier)>>,
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
                    last = NotCoordinator::Unknown(
                        "no coordinator holds the Lease now".into(),
                    );
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
                let mut v = self
                    .verifier
                    .lock()
                    .map_err(|_| NotCoordinator::Unknown("verifier poisoned".into()))?;
                if v.as_ref().is_none_or(|(k, _)| *k != id.key) {
                    *v = Some((id.key, Verifier::new(id.key, super::MAX_SKEW, &self.me)));
                }
                match v.as_mut() {
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
                verifier: Mutex::new(None),
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
            coordinator_address: Mutex::new(None),
            refusals: Mutex::new(crate::pace::LogPacer::new(REFUSAL_LOG_EVERY)),
            metrics: s.metrics,
        }
    }

    /// Logs a refusal (at most one line per `REFUSAL_LOG_EVERY`, with the count since the
    /// last line) and returns it.
    fn refused(&self, rpc: &str, s: Status) -> Status {
        let due = self
            .refusals
            .lock()
            .ok()
            .and_then(|mut p| p.note(1, tokio::time::Instant::now()));
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
                Status::unauthenticated(format!(
                    "{rpc} refused: not the coordinator's ({why})"
                )),
            )),
            Err(NotCoordinator::Unknown(why)) => {
                Err(self.refused(rpc, Status::unavailable(why)))
            }
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
        if let Ok(mut a) = self.coordinator_address.lock() {
            if a.as_deref() != Some(address) {
                *a = Some(address.to_string());
            }
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
            Err(why) => return refuse(why),
        };
        if a.coordinator.parse::<std::net::SocketAddr>().is_err() {
            return refuse("coordinator address is not ip:port".into());
        }
        let policy = self.policy.borrow().clone();
        let admitted = match authz::admit(&a, &policy) {
            Ok(x) => x,
            Err(why) => return refuse(why),
        };
        self.remember_coordinator(&a.coordinator);
        let cancel = CancellationToken::new();
        {
            let mut running = self
                .running
                .lock()
                .map_err(|_| Status::internal("poisoned"))?;
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
                if let Ok(mut r) = me.running.lock() {
                    r.remove(&key);
                }
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
        let found = check_key(&a, &self.node)
            .and_then(|(key, _, _)| self.running.lock().ok()?.get(&key).cloned());
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
        let taken = self
            .forwards
            .lock()
            .map_err(|_| Status::internal("poisoned"))?
            .take(tokio::time::Instant::now());
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
                let address = self
                    .coordinator_address
                    .lock()
                    .map_err(|_| Status::internal("poisoned"))?
                    .clone()
                    .ok_or_else(|| {
                        Status::unavailable("this relay has had no message from the coordinator")
                    })?;
                let token = (!f.token.is_empty()).then_some(f.token.as_str());
                return pass_report_on(&address, r, token)
                    .await
                    .map(|()| Response::new(ForwardReply::default()))
                    .map_err(Status::unavailable);
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
        debug!(to = %to.node, "forwarding the coordinator's message");
        pass_on(&to.address, msg)
            .await
            .map(Response::new)
            .map_err(Status::unavailable)
    }

    async fn conclude(
        &self,
        request: Request<RunConclusion>,
    ) -> Result<Response<ReportAck>, Status> {
        let c = request.into_inner();
        self.verify("Conclude", &c).await?;
        PeerService::check_protocol(c.protocol)?;
        let verdicts =
            wire::from_proto(&c.members, &c.verdicts).map_err(Status::invalid_argument)?;
        let Some(me) = c.members.iter().position(|m| m == &self.node) else {
            return Err(Status::invalid_argument(format!(
                "{} is not a member of run {}",
                self.node, c.run_id
            )));
        };
        // Named only when every failure of this node in the run was its probe not starting.
        let own = self.own_failures.lock().ok().and_then(|f| {
            f.iter()
                .find(|r| r.run_id == c.run_id && !r.other_failures)
                .and_then(|r| r.cannot_run.clone())
        });
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
        let Ok(mut f) = self.own_failures.lock() else {
            return;
        };
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
                let signed = signed.map_err(|e| (false, e.to_string()))?;
                let ch = endpoint(coordinator)
                    .map_err(|e| (false, e))?
                    .connect()
                    .await
                    .map_err(|e| (true, e.to_string()))?;
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
                        s.message().to_string(),
                    )),
                    Err(_) => Err((true, format!("no answer within {CALL_TIMEOUT:?}"))),
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
    async fn send_report_via(&self, via: &faultline_proto::v1::Member, to: &str, report: CheckReport) {
        let attempt = || {
            let signed = self.credential.sign(report.clone(), &self.node, to);
            async move {
                let signed = signed.map_err(|e| (false, e.to_string()))?;
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
async fn pass_report_on(address: &str, r: CheckReport, token: Option<&str>) -> Result<(), String> {
    let ch = endpoint(address)?
        .connect()
        .await
        .map_err(|e| format!("cannot reach the coordinator at {address}: {e}"))?;
    let mut c = CoordinatorClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let mut request = timed(r, CALL_TIMEOUT);
    if let Some(t) = token {
        bearer(&mut request, t)?;
    }
    match tokio::time::timeout(CALL_TIMEOUT, c.report(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(s.message().to_string()),
        Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
    }
}

/// A relay's call onward: the coordinator's message to the member at `address`, verbatim (its
/// signature is the coordinator's); the receiver's answer.
async fn pass_on(address: &str, msg: forward::Message) -> Result<ForwardReply, String> {
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
        forward::Message::Report(_) => return Err("a report goes to the coordinator".into()),
    })
}

/// A client endpoint for `address` (`ip:port`).
pub fn endpoint(address: &str) -> Result<Endpoint, String> {
    Endpoint::from_shared(format!("http://{address}"))
        .map(|e| e.connect_timeout(CALL_TIMEOUT).tcp_nodelay(true))
        .map_err(|e| format!("bad address {address:?}: {e}"))
}

/// A request with a deadline the server learns (`grpc-timeout`).
pub fn timed<T>(msg: T, timeout: Duration) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// Adds `authorization: Bearer <token>`.
pub fn bearer<T>(r: &mut Request<T>, token: &str) -> Result<(), String> {
    let value = format!("Bearer {token}")
        .parse()
        .map_err(|_| "the token is not a valid header value".to_string())?;
    r.metadata_mut().insert("authorization", value);
    Ok(())
}

/// One call with a deadline (`call` gets it to send to the server; it is also enforced here in
/// case the server never answers): the answer, or why there is none.
pub async fn within<T, F>(timeout: Duration, call: impl FnOnce(Duration) -> F) -> Result<T, String>
where
    F: std::future::Future<Output = Result<Response<T>, Status>>,
{
    match tokio::time::timeout(timeout, call(timeout)).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(s.message().to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}
