//! The agent's peer-check gRPC service: `PeerCheck` (ping, assign, cancel, conclude) on every
//! agent, `Coordinator` (report, run) answered by the Lease holder; and [`GrpcTransport`], the
//! coordinator's client side. Every request is verified against the shared secret first; an
//! unsigned, forged, stale or replayed one is refused with `UNAUTHENTICATED` and changes nothing.
//! Then it is authorized (`authz`): `Assign`, `Cancel` and `Conclude` only from the current
//! coordinator (else `PERMISSION_DENIED`), an assignment only with current members' addresses
//! and within this agent's policy; `Run` also with the requesters' own secret, which no other
//! RPC accepts. Refusals are logged at a bounded rate.
//!
//! An assignment runs the probe as a child process (`runner`) and sends the `CheckReport` to
//! the coordinator address it names, or through the member it names in `report_via` (the
//! coordinator cannot reach this agent and reached it through that member). Every agent is
//! also a relay (`Forward`): it passes the coordinator's `Assign`, `Cancel` and `Conclude` on,
//! verbatim, to a member the coordinator cannot reach, and a member's own report on to the
//! coordinator, within the bounds `authz` sets. A conclusion becomes this node's `Level` observations
//! (`verdicts`), sent to the engine like any source's.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_proto::auth::{Signed, Verifier};
use faultline_proto::v1::coordinator_client::CoordinatorClient;
use faultline_proto::v1::coordinator_server::Coordinator as CoordinatorRpc;
use faultline_proto::v1::peer_check_client::PeerCheckClient;
use faultline_proto::v1::peer_check_server::PeerCheck;
use faultline_proto::v1::{forward_request as forward, ForwardReply, ForwardRequest as Forward};
use faultline_proto::v1::{
    CheckAccepted, CheckAssignment, CheckReport, PingReply, PingRequest, Reached, ReportAck,
    RunConclusion, RunRequest, RunResult,
};
use faultline_proto::{MAX_MESSAGE_BYTES, PROTOCOL};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn, Instrument};

use super::authz::{self, MemberView, WhoCoordinates};
use super::coordinator::{self, Coordinator, RunSpec, Transport, Trigger};
use super::members::{Member, Members};
use super::runner::{self, ProbeOutcome, ProbeSpec};
use super::wire::{self, Signer};
use crate::metrics::{PeerCheckLabel, PeerCheckResult};
use crate::source::Input;
use faultline_core::peer::pairing::PairingConfig;
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
/// Connect and call timeouts of the coordinator's small calls (ping, assign, cancel).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// A ping that asks the member to ping others too: their pings run at once, each within
/// `CALL_TIMEOUT`.
pub const RELAY_TIMEOUT: Duration = Duration::from_secs(6);
/// Members one relayed ping may name.
pub const MAX_REACH: usize = 16;
/// How long the service waits to learn who coordinates or who the members are (an answer
/// must fit in the coordinator's `CALL_TIMEOUT`).
pub const AUTHZ_TIMEOUT: Duration = Duration::from_millis(1500);
/// How long a call through a relay may take: the relay's own checks (who coordinates, the
/// members) and its call onward (a conclusion's is the longest).
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a conclusion waits for the agent's engine to take its observations.
pub const CONCLUDE_DELIVERY: Duration = Duration::from_secs(3);
/// At most one log line per this interval about refused requests (with the count).
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// What the service authorizes requests with, beyond the agents' shared secret.
#[derive(Debug)]
pub struct Authz {
    /// The agents' shared secret: every RPC is accepted with it (`Run` also with the
    /// requesters').
    pub agents: Verifier,
    /// Who coordinates now (Lease holder, elected member).
    pub who: Arc<dyn WhoCoordinates>,
    /// The requesters' secret: `Run` is accepted with it (and with the agents' secret);
    /// nothing else is.
    pub requester: Option<Verifier>,
    /// The ports probe addresses may name (`probe_port_base` + `coordinator::PROBE_PORTS`).
    pub probe_ports: std::ops::Range<u16>,
    /// Kubernetes: requesters' service-account tokens (`authorization: Bearer`), checked with
    /// TokenReview and SubjectAccessReview. `None`: tokens are refused.
    pub requesters: Option<Arc<dyn authz::Requesters>>,
}

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

/// The coordinator role: present on every agent, active while `leader` is true.
#[derive(Debug, Clone)]
pub struct Leadership {
    pub coordinator: Arc<Coordinator>,
    pub leader: watch::Receiver<bool>,
    pub members: Arc<dyn Members>,
    pub policy: watch::Receiver<PeerPolicy>,
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

/// The service every agent serves.
#[derive(Debug)]
pub struct PeerService {
    pub node: String,
    verifier: Mutex<Verifier>,
    signer: Signer,
    probe: ProbeSetup,
    busy: Arc<dyn Busy>,
    inputs: mpsc::Sender<Input>,
    running: Mutex<HashMap<CheckKey, CancellationToken>>,
    leadership: Leadership,
    runs: std::sync::atomic::AtomicUsize,
    /// Pings other members on the coordinator's behalf (`PingRequest.reach`).
    relay: GrpcTransport,
    /// Runs in which this node's own probe could not run, with the cause (the newest
    /// `OWN_FAILURES_KEPT`): a conclusion that finds this node faulty names it.
    own_failures: Mutex<std::collections::VecDeque<OwnRun>>,
    who: Arc<dyn WhoCoordinates>,
    requester: Option<Mutex<Verifier>>,
    requesters: Option<Arc<dyn authz::Requesters>>,
    probe_ports: std::ops::Range<u16>,
    view: MemberView,
    refusals: Mutex<crate::pace::LogPacer>,
    metrics: Arc<crate::metrics::Metrics>,
    /// What this agent forwards as a relay, per second.
    forwards: Mutex<authz::ForwardRate>,
}

impl PeerService {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        node: String,
        signer: Signer,
        probe: ProbeSetup,
        busy: Arc<dyn Busy>,
        inputs: mpsc::Sender<Input>,
        leadership: Leadership,
        authz: Authz,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> PeerService {
        PeerService {
            metrics,
            view: MemberView::new(Arc::clone(&leadership.members)),
            verifier: Mutex::new(authz.agents),
            who: authz.who,
            requester: authz.requester.map(Mutex::new),
            requesters: authz.requesters,
            probe_ports: authz.probe_ports,
            refusals: Mutex::new(crate::pace::LogPacer::new(REFUSAL_LOG_EVERY)),
            forwards: Mutex::new(authz::ForwardRate::default()),
            node,
            signer: signer.clone(),
            probe,
            busy,
            inputs,
            running: Mutex::new(HashMap::new()),
            leadership,
            runs: std::sync::atomic::AtomicUsize::new(0),
            relay: GrpcTransport::new(signer.clone()),
            own_failures: Mutex::new(std::collections::VecDeque::new()),
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

    /// Verifies an agents' request with the agents' secret; the authenticated sender.
    fn verify<M: Signed>(&self, rpc: &str, msg: &M) -> Result<String, Status> {
        let mut v = self
            .verifier
            .lock()
            .map_err(|_| Status::internal("verifier poisoned"))?;
        v.verify(msg, wire::now_ms())
            .map_err(|e| self.refused(rpc, Status::unauthenticated(e.to_string())))
    }

    /// Authenticates and authorizes a `Run` by the requester's bearer token (Kubernetes).
    async fn check_token(&self, token: &str) -> Result<String, Status> {
        use authz::TokenRefusal;
        let Some(r) = &self.requesters else {
            return Err(self.refused(
                "Run",
                Status::unauthenticated(
                    "this agent takes no service-account tokens (not on Kubernetes); sign with the requester secret",
                ),
            ));
        };
        match tokio::time::timeout(CALL_TIMEOUT * 5, r.check(token)).await {
            Ok(Ok(user)) => Ok(format!("user {user}")),
            Ok(Err(e @ TokenRefusal::Unauthenticated(_))) => {
                Err(self.refused("Run", Status::unauthenticated(e.to_string())))
            }
            Ok(Err(e @ TokenRefusal::Denied(_))) => {
                Err(self.refused("Run", Status::permission_denied(e.to_string())))
            }
            Ok(Err(e @ TokenRefusal::Unavailable(_))) => Err(Status::unavailable(e.to_string())),
            Err(_) => Err(Status::unavailable("the token reviews took too long")),
        }
    }

    /// Verifies a `Run`: with the requesters' secret, else the agents'.
    fn verify_run(&self, msg: &RunRequest) -> Result<String, Status> {
        if let Some(r) = &self.requester {
            let mut v = r
                .lock()
                .map_err(|_| Status::internal("verifier poisoned"))?;
            match v.verify(msg, wire::now_ms()) {
                Ok(sender) => return Ok(sender),
                // Not the requesters' key: maybe the agents'.
                Err(faultline_proto::auth::AuthError::BadMac { .. }) => {}
                Err(e) => return Err(self.refused("Run", Status::unauthenticated(e.to_string()))),
            }
        }
        self.verify("Run", msg)
    }

    /// Only the current coordinator may send `what`: `PERMISSION_DENIED` for anyone else, with
    /// who coordinates. Asks again (after a moment) before refusing, so a new coordinator is
    /// obeyed as soon as the Lease names it.
    async fn only_coordinator(&self, rpc: &str, sender: &str) -> Result<(), Status> {
        let ask = |recheck: bool| async move {
            match tokio::time::timeout(AUTHZ_TIMEOUT, self.who.current(recheck)).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err(format!(
                    "cannot tell who coordinates peer checks within {AUTHZ_TIMEOUT:?}"
                )),
            }
        };
        let mut who = ask(false).await;
        if !matches!(&who, Ok(Some(c)) if c.node == sender) {
            who = ask(true).await;
        }
        let denied = match who {
            Ok(Some(c)) if c.node == sender => return Ok(()),
            Ok(Some(c)) => format!(
                "{rpc} from {sender:?} refused: only the current peer-check coordinator ({:?}) may send it",
                c.node
            ),
            Ok(None) => format!(
                "{rpc} from {sender:?} refused: no agent coordinates peer checks now"
            ),
            Err(e) => return Err(self.refused(rpc, Status::unavailable(e))),
        };
        Err(self.refused(rpc, Status::permission_denied(denied)))
    }

    /// An assignment's addresses against the current members (read again once if they do
    /// not match the cached list: a member may have just joined or moved).
    async fn check_addresses(&self, a: &CheckAssignment, coordinator: &str) -> Result<(), String> {
        let mut last = String::new();
        for recheck in [false, true] {
            let list = tokio::time::timeout(AUTHZ_TIMEOUT, self.view.list(recheck))
                .await
                .map_err(|_| format!("cannot list the members within {AUTHZ_TIMEOUT:?}"))?
                .map_err(|e| format!("cannot list the members: {e}"))?;
            match authz::check_addresses(a, &list, coordinator, self.probe_ports.clone()) {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
        }
        Err(last)
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

    fn leader(&self) -> Result<&Leadership, Status> {
        if *self.leadership.leader.borrow() {
            Ok(&self.leadership)
        } else {
            Err(Status::failed_precondition(format!(
                "{} is not the peer-check coordinator (it does not hold the Lease)",
                self.node
            )))
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
        self.verify("Ping", &p)?;
        let reached = self.relay_pings(&p.reach).await?;
        // NVML calls can hang: ask on a blocking thread, and a node that cannot answer in
        // time counts as busy (a scheduled check is not worth disturbing a job).
        let busy = if self.probe.gpu && !p.liveness_only {
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
            reached,
            // Whom this agent obeys now (cached; an error or nobody: empty).
            coordinator: tokio::time::timeout(AUTHZ_TIMEOUT, self.who.current(false))
                .await
                .ok()
                .and_then(Result::ok)
                .flatten()
                .map(|c| c.node)
                .unwrap_or_default(),
        }))
    }

    async fn assign(
        &self,
        request: Request<CheckAssignment>,
    ) -> Result<Response<CheckAccepted>, Status> {
        let a = request.into_inner();
        let sender = self.verify("Assign", &a)?;
        PeerService::check_protocol(a.protocol)?;
        self.only_coordinator("Assign", &sender).await?;
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
        let peers: Result<Vec<std::net::SocketAddr>, _> =
            [&a.probe_a, &a.probe_b].iter().map(|p| p.parse()).collect();
        let Ok(peers) = peers else {
            return refuse("probe addresses are not ip:port".into());
        };
        if a.coordinator.parse::<std::net::SocketAddr>().is_err() {
            return refuse("coordinator address is not ip:port".into());
        }
        let policy = self.leadership.policy.borrow().clone();
        let admitted = match authz::admit(&a, &policy) {
            Ok(x) => x,
            Err(why) => return refuse(why),
        };
        if let Err(why) = self.check_addresses(&a, &sender).await {
            return refuse(why);
        }
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
                        Some(via) => me.send_report_via(via, report).await,
                        None => me.send_report(&a.coordinator, report).await,
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
        let sender = self.verify("Cancel", &a)?;
        self.only_coordinator("Cancel", &sender).await?;
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
        let f = request.into_inner();
        let sender = self.verify("Forward", &f)?;
        PeerService::check_protocol(f.protocol)?;
        let msg = f
            .message
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
        // The inner message was signed by whoever asks for the forwarding (its receiver checks
        // the signature itself; this only keeps a relay from carrying someone else's messages).
        let inner = match &msg {
            forward::Message::Assign(a) | forward::Message::Cancel(a) => a.auth.as_ref(),
            forward::Message::Conclude(c) => c.auth.as_ref(),
            forward::Message::Report(r) => r.auth.as_ref(),
        };
        if inner.map(|a| a.sender.as_str()) != Some(sender.as_str()) {
            return Err(self.refused(
                "Forward",
                Status::permission_denied(format!("{sender} may forward only messages it signed")),
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
        let members = tokio::time::timeout(AUTHZ_TIMEOUT, self.view.list(false))
            .await
            .map_err(|_| Status::unavailable("cannot list the members in time"))?
            .map_err(|e| Status::unavailable(format!("cannot list the members: {e}")))?;
        if let forward::Message::Report(r) = msg {
            // A member's own report, to the coordinator this agent knows at its listed address.
            if r.node != sender || !members.iter().any(|m| m.node == sender) {
                return Err(self.refused(
                    "Forward",
                    Status::permission_denied(format!(
                        "{sender} may forward only its own report, as a current member"
                    )),
                ));
            }
            let who = tokio::time::timeout(AUTHZ_TIMEOUT, self.who.current(false))
                .await
                .map_err(|_| Status::unavailable("cannot tell who coordinates in time"))?
                .map_err(|e| Status::unavailable(e.to_string()))?
                .ok_or_else(|| Status::unavailable("no agent coordinates peer checks now"))?;
            let to = members
                .iter()
                .find(|m| m.node == who.node)
                .ok_or_else(|| Status::unavailable("the coordinator is not a current member"))?;
            return pass_report_on(&to.address, r)
                .await
                .map(|()| Response::new(ForwardReply { accepted: None }))
                .map_err(Status::unavailable);
        }
        self.only_coordinator("Forward", &sender).await?;
        let to = authz::forward_target(f.to.as_ref(), &members, &self.node)
            .map_err(|e| self.refused("Forward", Status::permission_denied(e)))?;
        debug!(from = %sender, to = %to.node, "forwarding the coordinator's message");
        self.relay
            .pass_on(&to, msg)
            .await
            .map(|accepted| Response::new(ForwardReply { accepted }))
            .map_err(Status::unavailable)
    }

    async fn conclude(
        &self,
        request: Request<RunConclusion>,
    ) -> Result<Response<ReportAck>, Status> {
        let c = request.into_inner();
        let sender = self.verify("Conclude", &c)?;
        PeerService::check_protocol(c.protocol)?;
        self.only_coordinator("Conclude", &sender).await?;
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
    /// Pings the members `reach` names, on the coordinator's behalf: only current members, at
    /// their listed addresses (the request cannot make this agent connect anywhere else), at
    /// most `MAX_REACH`, all at once.
    async fn relay_pings(
        &self,
        reach: &[faultline_proto::v1::Member],
    ) -> Result<Vec<Reached>, Status> {
        if reach.is_empty() {
            return Ok(Vec::new());
        }
        if reach.len() > MAX_REACH {
            return Err(Status::invalid_argument(format!(
                "{} members to reach, at most {MAX_REACH}",
                reach.len()
            )));
        }
        // The members as cached for authorization: a relayed ping costs no list of pods.
        let current = tokio::time::timeout(AUTHZ_TIMEOUT, self.view.list(false))
            .await
            .map_err(|_| Status::unavailable("cannot list the members in time"))?
            .map_err(|e| Status::unavailable(format!("cannot list the members: {e}")))?;
        let ping = |m: Option<Member>, r: &faultline_proto::v1::Member| {
            let node = r.node.clone();
            let address = r.address.clone();
            async move {
                let Some(m) = m else {
                    return Reached {
                        node,
                        answered: false,
                        error: format!("{address:?} is not a current member's address"),
                    };
                };
                // Twice, like the coordinator's own pings: one lost ping says nothing.
                let last = super::retried(
                    2,
                    Duration::from_millis(200),
                    |_| true,
                    || self.relay.ping(&m),
                )
                .await;
                Reached {
                    node,
                    answered: last.is_ok(),
                    error: last.err().unwrap_or_default(),
                }
            }
        };
        Ok(futures::future::join_all(reach.iter().map(|r| {
            let m = current
                .iter()
                .find(|m| m.node == r.node && m.address == r.address)
                .cloned();
            ping(m, r)
        }))
        .await)
    }

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
    /// anew: the coordinator refuses a nonce it has seen.
    async fn send_report(&self, coordinator: &str, report: CheckReport) {
        let attempt = || {
            let signed = self.signer.sign(report.clone());
            async move {
                let ch = endpoint(coordinator)
                    .map_err(|e| (false, e))?
                    .connect()
                    .await
                    .map_err(|e| (true, e.to_string()))?;
                let mut c = CoordinatorClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
                match tokio::time::timeout(CALL_TIMEOUT, c.report(timed(signed, CALL_TIMEOUT)))
                    .await
                {
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
}

impl PeerService {
    /// Sends the report through the member the assignment named (`report_via`), as
    /// `send_report` does directly: up to `REPORT_ATTEMPTS` times while it cannot be reached,
    /// each attempt signed anew.
    async fn send_report_via(&self, via: &faultline_proto::v1::Member, report: CheckReport) {
        let attempt = || {
            let envelope = self.signer.sign(Forward {
                auth: None,
                protocol: PROTOCOL,
                to: None,
                message: Some(forward::Message::Report(self.signer.sign(report.clone()))),
            });
            async move {
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

/// A relay passes a member's report on to the coordinator, verbatim (one attempt: the member
/// tries again, signing anew).
async fn pass_report_on(address: &str, r: CheckReport) -> Result<(), String> {
    let ch = endpoint(address)?
        .connect()
        .await
        .map_err(|e| format!("cannot reach the coordinator at {address}: {e}"))?;
    let mut c = CoordinatorClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
    within(CALL_TIMEOUT, |t| c.report(timed(r, t)))
        .await
        .map(|_| ())
}

#[tonic::async_trait]
impl CoordinatorRpc for PeerHandle {
    async fn report(&self, request: Request<CheckReport>) -> Result<Response<ReportAck>, Status> {
        let r = request.into_inner();
        let sender = self.verify("Report", &r)?;
        PeerService::check_protocol(r.protocol)?;
        coordinator::validate_report(&r)
            .map_err(|why| Status::invalid_argument(format!("report from {sender}: {why}")))?;
        if sender != r.node {
            return Err(self.refused(
                "Report",
                Status::permission_denied(format!("{sender} cannot report for {}", r.node)),
            ));
        }
        // Accepted by run id: a check of a run of this coordinator that waits for it takes it,
        // leader or not (a run that lost the role is being aborted and drops its checks). A
        // report nothing waits for is refused by an agent that does not coordinate.
        let coordinator = &self.leadership.coordinator;
        if !coordinator.deliver(r) {
            self.leader()?;
            debug!(from = %sender, "report for no waiting check (late or duplicate)");
        }
        Ok(Response::new(ReportAck {}))
    }

    async fn run(&self, request: Request<RunRequest>) -> Result<Response<RunResult>, Status> {
        let bearer = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| t.trim().to_string());
        let req = request.into_inner();
        let sender = match bearer {
            Some(token) => {
                // Only the coordinator asks the API server: a token sent to any other agent
                // costs no review.
                self.leader()?;
                self.check_token(&token).await?
            }
            None => self.verify_run(&req)?,
        };
        PeerService::check_protocol(req.protocol)?;
        let l = self.leader()?.clone();
        if req.nodes.is_empty() {
            return Err(Status::invalid_argument("no nodes to check"));
        }
        if req.nodes.len() > 10_000 {
            return Err(Status::invalid_argument("more than 10000 nodes"));
        }
        if req.request_id.len() > 64 {
            return Err(Status::invalid_argument(
                "request_id is longer than 64 bytes",
            ));
        }
        let request_id = (!req.request_id.is_empty()).then(|| req.request_id.clone());
        let aborted = |e: coordinator::Aborted| Status::unavailable(e.to_string());
        // The same request again (the requester lost its coordinator and came here): the run
        // resumed or still running for it, or its result.
        if let Some(id) = &request_id {
            if let Some(r) = l.coordinator.attach(id).await {
                info!(from = %sender, request_id = %id, "peer-check request attached to its run");
                return r.map(|s| Response::new(result_of(&s))).map_err(aborted);
            }
        }
        let claim = match &request_id {
            Some(id) => match l.coordinator.claim(id) {
                Some(c) => Some(c),
                None => {
                    return match l.coordinator.attach(id).await {
                        Some(r) => r.map(|s| Response::new(result_of(&s))).map_err(aborted),
                        None => Err(Status::unavailable(
                            "the same request is being started; ask again",
                        )),
                    }
                }
            },
            None => None,
        };
        let all = l
            .members
            .list()
            .await
            .map_err(|e| Status::unavailable(format!("cannot list the members: {e}")))?;
        let (members, missing) = coordinator::select(all, &req.nodes);
        let policy = l.policy.borrow().clone();
        let mut spec = run_spec(
            &policy,
            self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        );
        if req.timeout_ms > 0 {
            spec.check_timeout = spec
                .check_timeout
                .min(Duration::from_millis(u64::from(req.timeout_ms)));
        }
        info!(from = %sender, nodes = req.nodes.len(), "peer-check run requested");
        let state = l
            .coordinator
            .run_detached(members, missing, spec, Trigger::Request, request_id, claim)
            .await
            .map_err(aborted)?;
        Ok(Response::new(result_of(&state)))
    }
}

/// The wire result of a finished run.
pub fn result_of(state: &coordinator::RunState) -> RunResult {
    use faultline_proto::v1::Verdict;
    RunResult {
        run_id: state.run_id.clone(),
        rounds: state.rounds.len() as u32,
        verdicts: state
            .verdicts
            .iter()
            .map(|v| Verdict {
                kind: coordinator::kind_from_name(&v.kind) as i32,
                nodes: v.nodes.clone(),
                slowdown: v.slowdown.unwrap_or(0.0),
                reason: v.reason.clone().unwrap_or_default(),
            })
            .collect(),
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

fn endpoint(address: &str) -> Result<Endpoint, String> {
    Endpoint::from_shared(format!("http://{address}"))
        .map(|e| e.connect_timeout(CALL_TIMEOUT).tcp_nodelay(true))
        .map_err(|e| format!("bad address {address:?}: {e}"))
}

/// A member as the wire names it.
pub fn wire_member(m: &Member) -> faultline_proto::v1::Member {
    faultline_proto::v1::Member {
        node: m.node.clone(),
        address: m.address.clone(),
        topology: m.topology.clone().unwrap_or_default(),
    }
}

/// The coordinator's client: one lazily connected channel per agent address.
#[derive(Debug)]
pub struct GrpcTransport {
    signer: Signer,
    channels: Mutex<BTreeMap<String, Channel>>,
}

impl GrpcTransport {
    pub fn new(signer: Signer) -> GrpcTransport {
        GrpcTransport {
            signer,
            channels: Mutex::new(BTreeMap::new()),
        }
    }

    fn client(&self, to: &Member) -> Result<PeerCheckClient<Channel>, String> {
        let mut map = self.channels.lock().map_err(|_| "poisoned".to_string())?;
        let ch = match map.get(&to.address) {
            Some(c) => c.clone(),
            None => {
                let c = endpoint(&to.address)?.connect_lazy();
                map.insert(to.address.clone(), c.clone());
                c
            }
        };
        Ok(PeerCheckClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES))
    }
}

impl GrpcTransport {
    /// A relay's call onward: the coordinator's message to `to`, verbatim (its signature is
    /// the coordinator's); the receiver's answer to an assignment or a cancel.
    async fn pass_on(
        &self,
        to: &Member,
        msg: forward::Message,
    ) -> Result<Option<CheckAccepted>, String> {
        let mut c = self.client(to)?;
        match msg {
            forward::Message::Assign(a) => within(CALL_TIMEOUT, |t| c.assign(timed(a, t)))
                .await
                .map(Some),
            forward::Message::Cancel(a) => within(CALL_TIMEOUT, |t| c.cancel(timed(a, t)))
                .await
                .map(Some),
            forward::Message::Conclude(m) => within(CONCLUDE_TIMEOUT, |t| c.conclude(timed(m, t)))
                .await
                .map(|_| None),
            forward::Message::Report(_) => Err("a report goes to the coordinator".into()),
        }
    }
}

fn timed<T>(msg: T, timeout: Duration) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// One call with a deadline (`call` gets it to send to the server; it is also enforced here in
/// case the server never answers): the answer, or why there is none.
async fn within<T, F>(timeout: Duration, call: impl FnOnce(Duration) -> F) -> Result<T, String>
where
    F: std::future::Future<Output = Result<Response<T>, Status>>,
{
    match tokio::time::timeout(timeout, call(timeout)).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(s.message().to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// How long a conclusion may take to deliver.
const CONCLUDE_TIMEOUT: Duration = Duration::from_secs(5);

#[async_trait::async_trait]
impl coordinator::Transport for GrpcTransport {
    async fn ping(&self, to: &Member) -> Result<PingReply, String> {
        let msg = self.signer.sign(PingRequest {
            auth: None,
            protocol: PROTOCOL,
            reach: Vec::new(),
            liveness_only: false,
        });
        let mut c = self.client(to)?;
        within(CALL_TIMEOUT, |t| c.ping(timed(msg, t))).await
    }

    async fn alive(&self, to: &Member) -> Result<PingReply, String> {
        let msg = self.signer.sign(PingRequest {
            auth: None,
            protocol: PROTOCOL,
            reach: Vec::new(),
            liveness_only: true,
        });
        let mut c = self.client(to)?;
        within(CALL_TIMEOUT, |t| c.ping(timed(msg, t))).await
    }

    async fn reach(&self, via: &Member, targets: &[Member]) -> Result<Vec<Reached>, String> {
        let msg = self.signer.sign(PingRequest {
            auth: None,
            protocol: PROTOCOL,
            reach: targets.iter().map(wire_member).collect(),
            liveness_only: false,
        });
        let mut c = self.client(via)?;
        within(RELAY_TIMEOUT, |t| c.ping(timed(msg, t)))
            .await
            .map(|r| r.reached)
    }

    async fn assign(&self, to: &Member, a: CheckAssignment) -> Result<CheckAccepted, String> {
        let msg = self.signer.sign(a);
        let mut c = self.client(to)?;
        within(CALL_TIMEOUT, |t| c.assign(timed(msg, t))).await
    }

    async fn cancel(&self, to: &Member, a: CheckAssignment) {
        let msg = self.signer.sign(a);
        if let Ok(mut c) = self.client(to) {
            let _ = within(CALL_TIMEOUT, |t| c.cancel(timed(msg, t))).await;
        }
    }

    async fn conclude(&self, to: &Member, c: RunConclusion) -> Result<(), String> {
        let msg = self.signer.sign(c);
        let mut client = self.client(to)?;
        within(CONCLUDE_TIMEOUT, |t| client.conclude(timed(msg, t)))
            .await
            .map(|_| ())
    }

    async fn forward(
        &self,
        via: &Member,
        to: &Member,
        msg: coordinator::Relayed,
    ) -> Result<CheckAccepted, String> {
        use coordinator::Relayed;
        let message = match msg {
            Relayed::Assign(a) => forward::Message::Assign(self.signer.sign(a)),
            Relayed::Cancel(a) => forward::Message::Cancel(self.signer.sign(a)),
            Relayed::Conclude(c) => forward::Message::Conclude(self.signer.sign(c)),
        };
        let envelope = self.signer.sign(Forward {
            auth: None,
            protocol: PROTOCOL,
            to: Some(wire_member(to)),
            message: Some(message),
        });
        let mut c = self.client(via)?;
        within(FORWARD_TIMEOUT, |t| c.forward(timed(envelope, t)))
            .await
            .map(|r| {
                r.accepted.unwrap_or(CheckAccepted {
                    accepted: true,
                    reason: String::new(),
                })
            })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::peer::coordinator::MemoryPublisher;
    use faultline_proto::auth::Key;
    use faultline_proto::v1::Member as WireMember;

    const SECRET: &[u8] = b"service test secret, 32 bytes...";
    const REQUESTER: &[u8] = b"requester secret, not the agents";

    /// A fixed member list.
    #[derive(Debug)]
    struct Fixed(Vec<Member>);

    #[async_trait::async_trait]
    impl crate::peer::members::Members for Fixed {
        async fn list(&self) -> Result<Vec<Member>, crate::peer::members::MembersError> {
            Ok(self.0.clone())
        }
    }

    fn member(node: &str, ip: &str) -> Member {
        Member {
            node: node.into(),
            address: format!("{ip}:20261"),
            ip: ip.parse().unwrap(),
            topology: None,
        }
    }

    /// The coordinator is n0 (10.0.0.1); n1 (10.0.0.2) serves; n2 (10.0.0.3) is another
    /// member, holding the agents' secret too.
    struct Setup {
        svc: PeerHandle,
        signer: Signer,
        who: watch::Sender<Option<authz::CoordinatorId>>,
        inputs: mpsc::Receiver<Input>,
    }

    fn agent(name: &str) -> Signer {
        Signer {
            key: Key::new(SECRET).unwrap(),
            sender: name.into(),
        }
    }

    fn requester() -> Signer {
        Signer {
            key: Key::new(REQUESTER).unwrap(),
            sender: "cli@laptop".into(),
        }
    }

    fn setup() -> Setup {
        let (who, who_rx) = watch::channel(Some(authz::CoordinatorId {
            node: "n0".into(),
            address: Some("10.0.0.1:20261".into()),
        }));
        let (svc, signer, inputs) =
            service_with(Arc::new(who_rx), Some(Arc::new(FakeTokens)), false);
        Setup {
            svc,
            signer,
            who,
            inputs,
        }
    }

    fn service() -> (PeerHandle, Signer) {
        let s = setup();
        std::mem::forget(s.who);
        std::mem::forget(s.inputs);
        (s.svc, s.signer)
    }

    /// Tokens as an API server would review them: "good" is alice's, "denied" bob's (who may
    /// not request runs), anything else invalid.
    #[derive(Debug)]
    struct FakeTokens;

    #[async_trait::async_trait]
    impl authz::Requesters for FakeTokens {
        async fn check(&self, token: &str) -> Result<String, authz::TokenRefusal> {
            match token {
                "good" => Ok("alice".into()),
                "denied" => Err(authz::TokenRefusal::Denied("bob may not".into())),
                _ => Err(authz::TokenRefusal::Unauthenticated("invalid".into())),
            }
        }
    }

    fn service_with(
        who: Arc<dyn WhoCoordinates>,
        requesters: Option<Arc<dyn authz::Requesters>>,
        leader: bool,
    ) -> (PeerHandle, Signer, mpsc::Receiver<Input>) {
        service_on(
            who,
            requesters,
            leader,
            "10.0.0",
            "/nonexistent/faultline-probe".into(),
            Arc::new(crate::metrics::Metrics::new()),
        )
    }

    /// The service of n1 with members n0, n1, n2 at `<net>.1`, `.2`, `.3`, running `probe`.
    fn service_on(
        who: Arc<dyn WhoCoordinates>,
        requesters: Option<Arc<dyn authz::Requesters>>,
        leader: bool,
        net: &str,
        probe: PathBuf,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> (PeerHandle, Signer, mpsc::Receiver<Input>) {
        let key = Key::new(SECRET).unwrap();
        let signer = Signer {
            key: key.clone(),
            sender: "n0".into(),
        };
        let coordinator = Arc::new(Coordinator::new(
            "n1".into(),
            format!("{net}.2:20261"),
            20270,
            Arc::new(GrpcTransport::new(signer.clone())),
            Arc::new(MemoryPublisher::default()),
            Arc::new(crate::peer::coordinator::WatchFence(
                watch::channel(false).1,
            )),
        ));
        let leadership = Leadership {
            coordinator,
            leader: watch::channel(leader).1,
            members: Arc::new(Fixed(vec![
                member("n0", &format!("{net}.1")),
                member("n1", &format!("{net}.2")),
                member("n2", &format!("{net}.3")),
            ])),
            policy: watch::channel(PeerPolicy::default()).1,
        };
        let (tx, rx) = mpsc::channel(8);
        let svc = PeerService::new(
            "n1".into(),
            Signer {
                key: Key::new(SECRET).unwrap(),
                sender: "n1".into(),
            },
            ProbeSetup {
                bin: probe,
                gpu: false,
            },
            Arc::new(NeverBusy),
            tx,
            leadership,
            Authz {
                agents: Verifier::new(key, Duration::from_secs(30)),
                who,
                requester: Some(Verifier::new(
                    Key::new(REQUESTER).unwrap(),
                    Duration::from_secs(30),
                )),
                probe_ports: 20270..20302,
                requesters,
            },
            metrics,
        );
        (PeerHandle(Arc::new(svc)), signer, rx)
    }

    type Edit = Box<dyn Fn(&mut CheckAssignment)>;

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
            for w in [m.a.as_mut().unwrap(), m.b.as_mut().unwrap()] {
                w.address = w.address.replace("10.0.0.", "127.0.0.");
            }
            for a in [&mut m.probe_a, &mut m.probe_b, &mut m.coordinator] {
                *a = a.replace("10.0.0.", "127.0.0.");
            }
        };
        let service = |probe: PathBuf| {
            let who = watch::channel(Some(authz::CoordinatorId {
                node: "n0".into(),
                address: Some("127.0.0.1:20261".into()),
            }))
            .1;
            let (svc, signer, inputs) = service_on(
                Arc::new(who),
                None,
                false,
                "127.0.0",
                probe,
                metrics.clone(),
            );
            std::mem::forget(inputs);
            (svc, signer)
        };
        let cases = [
            (script("pass", &format!("echo '{report}'")), "passed"),
            (script("fail", "echo broken >&2; exit 1"), "failed"),
            (script("slow", "echo too slow >&2; exit 3"), "timeout"),
            (dir.path().join("missing"), "cannot_run"),
        ];
        for (i, (probe, result)) in cases.into_iter().enumerate() {
            let (svc, signer) = service(probe);
            let mut a = assignment();
            on_loopback(&mut a);
            a.run_id = format!("r{i}");
            let r = svc.assign(Request::new(signer.sign(a))).await.unwrap();
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

        let (svc, signer) = service(script("hang", "exec sleep 60"));
        let mut a = assignment();
        on_loopback(&mut a);
        let r = svc
            .assign(Request::new(signer.sign(a.clone())))
            .await
            .unwrap();
        assert!(r.get_ref().accepted, "{r:?}");
        let r = svc
            .cancel(Request::new(signer.sign(a.clone())))
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

        a.probe_b = "127.0.0.9:20270".into();
        let r = svc.assign(Request::new(signer.sign(a))).await.unwrap();
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
            coordinator: "10.0.0.1:20261".into(),
            report_via: None,
        }
    }

    /// Bad assignments are refused with the reason and start nothing; bad signatures are
    /// refused before anything is read; a non-holder refuses coordinator calls.
    #[tokio::test]
    async fn bad_requests_get_clear_refusals() {
        let (svc, signer) = service();
        let refused = |a: CheckAssignment| {
            let svc = svc.clone();
            let a = signer.sign(a);
            async move { svc.assign(Request::new(a)).await.unwrap().into_inner() }
        };
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|a| a.b.as_mut().unwrap().node = "n9".into()),
                "not a member",
            ),
            (
                Box::new(|a| a.probe_b = "nowhere".into()),
                "probe addresses",
            ),
            (
                Box::new(|a| a.coordinator = "x".into()),
                "coordinator address",
            ),
            (Box::new(|a| a.bytes = 0), "bytes, iterations and timeout"),
            (Box::new(|a| a.bytes = 8 << 30), "over this agent's limit"),
            (
                Box::new(|a| a.timeout_ms = 0),
                "bytes, iterations and timeout",
            ),
        ];
        for (edit, why) in cases {
            let mut a = assignment();
            edit(&mut a);
            let r = refused(a).await;
            assert!(!r.accepted && r.reason.contains(why), "{why}: {r:?}");
        }
        assert!(svc.running.lock().unwrap().is_empty(), "nothing started");
        // Unsigned, and signed with another secret.
        let s = svc.assign(Request::new(assignment())).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::Unauthenticated);
        let other = Signer {
            key: Key::new(b"another secret of 32 bytes......").unwrap(),
            sender: "n0".into(),
        };
        let s = svc
            .assign(Request::new(other.sign(assignment())))
            .await
            .unwrap_err();
        assert_eq!(s.code(), tonic::Code::Unauthenticated);
        assert!(s.message().contains("does not verify"), "{}", s.message());
        // Another protocol version.
        let mut a = assignment();
        a.protocol = PROTOCOL + 1;
        let s = svc.assign(Request::new(signer.sign(a))).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        // Not the Lease holder: no runs, no reports.
        let run = signer.sign(RunRequest {
            auth: None,
            protocol: PROTOCOL,
            nodes: vec!["n0".into()],
            timeout_ms: 0,
            request_id: String::new(),
        });
        let s = svc.run(Request::new(run)).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        assert!(s.message().contains("not the peer-check coordinator"));
        // A report for someone else is refused even with the secret.
        let report = signer.sign(CheckReport {
            protocol: PROTOCOL,
            node: "n5".into(),
            ..Default::default()
        });
        let s = svc.report(Request::new(report)).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::PermissionDenied);
        // A conclusion naming a non-member is refused as a whole, and records nothing.
        let c = signer.sign(RunConclusion {
            auth: None,
            protocol: PROTOCOL,
            run_id: "r1".into(),
            members: vec!["n0".into(), "n1".into()],
            verdicts: vec![faultline_proto::v1::Verdict {
                kind: faultline_proto::v1::verdict::Kind::FaultyNode as i32,
                nodes: vec!["zz".into()],
                slowdown: 0.0,
                reason: String::new(),
            }],
        });
        let s = svc.conclude(Request::new(c)).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
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

    /// Issue 12 §5: a key holder that is not the coordinator sends `Conclude` naming this node
    /// faulty, or `Assign`, or `Cancel`: PERMISSION_DENIED naming the coordinator, and nothing
    /// is recorded or started. Once the coordinator changes to it, it is obeyed.
    #[tokio::test]
    async fn only_the_current_coordinator_assigns_cancels_and_concludes() {
        let mut s = setup();
        let n2 = agent("n2");
        let e = s
            .svc
            .conclude(Request::new(n2.sign(conclusion("n1"))))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(
            e.message()
                .contains("only the current peer-check coordinator (\"n0\")"),
            "{}",
            e.message()
        );
        assert!(s.inputs.try_recv().is_err(), "nothing recorded");
        let mut a = assignment();
        a.coordinator = "10.0.0.3:20261".into();
        let e = s
            .svc
            .assign(Request::new(n2.sign(a.clone())))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let e = s.svc.cancel(Request::new(n2.sign(a))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(s.svc.running.lock().unwrap().is_empty(), "nothing started");
        // Nobody coordinates: nobody is obeyed.
        s.who.send_replace(None);
        let e = s
            .svc
            .conclude(Request::new(s.signer.sign(conclusion("n1"))))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("no agent coordinates"),
            "{}",
            e.message()
        );
        // The coordinator's own conclusion is recorded; after a change, the new one's.
        s.who.send_replace(Some(authz::CoordinatorId {
            node: "n0".into(),
            address: None,
        }));
        s.svc
            .conclude(Request::new(s.signer.sign(conclusion("n1"))))
            .await
            .unwrap();
        assert!(
            s.inputs.try_recv().is_ok(),
            "the coordinator's verdict is recorded"
        );
        s.who.send_replace(Some(authz::CoordinatorId {
            node: "n2".into(),
            address: None,
        }));
        while s.inputs.try_recv().is_ok() {}
        s.svc
            .conclude(Request::new(n2.sign(conclusion("n1"))))
            .await
            .unwrap();
        assert!(s.inputs.try_recv().is_ok());
        let e = s
            .svc
            .conclude(Request::new(s.signer.sign(conclusion("n1"))))
            .await
            .unwrap_err();
        assert_eq!(
            e.code(),
            tonic::Code::PermissionDenied,
            "the old one is not"
        );
    }

    /// Issue 12 §5: an assignment from the coordinator itself that names a foreign address, a
    /// port outside the probe range, a 4 GiB size or unbounded iterations is refused with the
    /// reason and starts nothing.
    #[tokio::test]
    async fn assignments_name_only_members_and_stay_within_the_policy() {
        let (svc, signer) = service();
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|a| a.probe_b = "10.9.9.9:20270".into()),
                "not the IP of member n1",
            ),
            (
                Box::new(|a| a.probe_a = "127.0.0.99:20270".into()),
                "not the IP of member n0",
            ),
            (
                Box::new(|a| a.probe_b = "10.0.0.2:10250".into()),
                "not among the probe ports",
            ),
            (
                Box::new(|a| a.coordinator = "10.9.9.9:20261".into()),
                "report address",
            ),
            (
                Box::new(|a| a.a.as_mut().unwrap().address = "10.9.9.9:20261".into()),
                "not its listed",
            ),
            (Box::new(|a| a.bytes = 4 << 30), "over this agent's limit"),
            (
                Box::new(|a| a.iterations = u32::MAX),
                "iterations 4294967295 over",
            ),
        ];
        for (edit, why) in cases {
            let mut a = assignment();
            edit(&mut a);
            let r = svc
                .assign(Request::new(signer.sign(a)))
                .await
                .unwrap()
                .into_inner();
            assert!(!r.accepted && r.reason.contains(why), "{why}: {r:?}");
        }
        assert!(svc.running.lock().unwrap().is_empty(), "nothing started");
        // A 49-day deadline is accepted, clamped to the policy's ceiling (authz::admit's test); the
        // well-formed assignment starts a check.
        let mut a = assignment();
        a.timeout_ms = u32::MAX;
        let r = svc
            .assign(Request::new(signer.sign(a)))
            .await
            .unwrap()
            .into_inner();
        assert!(r.accepted, "{r:?}");
    }

    /// The relay's bounds (`Forward`): it carries only the coordinator's Assign, Cancel and
    /// Conclude, signed by the coordinator itself, to a current member other than itself, and
    /// only a member's own report; too large a message and too many forwards are refused; the
    /// requesters' secret is not accepted. Nothing here reaches the network (every case is
    /// refused before the call onward). On the paused clock, so the rate does not refill.
    #[tokio::test(start_paused = true)]
    async fn a_relay_forwards_only_within_its_bounds() {
        let (svc, coordinator) = service();
        let n2 = agent("n2");
        let envelope = |by: &Signer, to: Option<WireMember>, m: forward::Message| {
            by.sign(Forward {
                auth: None,
                protocol: PROTOCOL,
                to,
                message: Some(m),
            })
        };
        let to = |n: &str, a: &str| {
            Some(WireMember {
                node: n.into(),
                address: a.into(),
                topology: String::new(),
            })
        };
        let assign = |by: &Signer| forward::Message::Assign(by.sign(assignment()));
        let n2_at = to("n2", "10.0.0.3:20261");
        let cases: Vec<(Forward, tonic::Code, &str)> = vec![
            // Not the coordinator.
            (
                envelope(&n2, to("n0", "10.0.0.1:20261"), assign(&n2)),
                tonic::Code::PermissionDenied,
                "only the current peer-check coordinator",
            ),
            // The coordinator's envelope around someone else's message.
            (
                envelope(&coordinator, n2_at.clone(), assign(&n2)),
                tonic::Code::PermissionDenied,
                "only messages it signed",
            ),
            (
                envelope(
                    &coordinator,
                    to("n9", "10.0.0.9:20261"),
                    assign(&coordinator),
                ),
                tonic::Code::PermissionDenied,
                "not a current member",
            ),
            (
                envelope(
                    &coordinator,
                    to("n2", "10.9.9.9:20261"),
                    assign(&coordinator),
                ),
                tonic::Code::PermissionDenied,
                "is not its listed",
            ),
            (
                envelope(
                    &coordinator,
                    to("n1", "10.0.0.2:20261"),
                    assign(&coordinator),
                ),
                tonic::Code::PermissionDenied,
                "does not forward to itself",
            ),
            (
                envelope(&coordinator, None, assign(&coordinator)),
                tonic::Code::PermissionDenied,
                "no member to forward to",
            ),
            // A report for another node.
            (
                envelope(
                    &n2,
                    None,
                    forward::Message::Report(n2.sign(CheckReport {
                        protocol: PROTOCOL,
                        node: "n0".into(),
                        ..Default::default()
                    })),
                ),
                tonic::Code::PermissionDenied,
                "only its own report",
            ),
            (
                envelope(&coordinator, n2_at.clone(), {
                    let mut a = assignment();
                    a.run_id = "x".repeat(authz::MAX_FORWARDED_BYTES);
                    forward::Message::Assign(coordinator.sign(a))
                }),
                tonic::Code::InvalidArgument,
                "bytes to forward",
            ),
            (
                envelope(&requester(), n2_at.clone(), assign(&requester())),
                tonic::Code::Unauthenticated,
                "",
            ),
        ];
        for (f, code, why) in cases {
            let e = svc.forward(Request::new(f)).await.unwrap_err();
            assert_eq!(e.code(), code, "{why}: {e:?}");
            assert!(e.message().contains(why), "{why}: {e:?}");
        }
        // The rate: a burst, then refused (each of these is refused after its token is taken).
        let refused = |svc: &PeerHandle| {
            let f = envelope(
                &coordinator,
                to("n9", "10.0.0.9:20261"),
                assign(&coordinator),
            );
            let svc = svc.clone();
            async move { svc.forward(Request::new(f)).await.unwrap_err().code() }
        };
        let mut codes = Vec::new();
        for _ in 0..authz::FORWARD_BURST as usize {
            codes.push(refused(&svc).await);
        }
        assert!(codes
            .iter()
            .all(|c| *c == tonic::Code::PermissionDenied || *c == tonic::Code::ResourceExhausted));
        assert_eq!(refused(&svc).await, tonic::Code::ResourceExhausted);
    }

    /// A far agent (n2) and a coordinator (n0) on loopback that verify and record what reaches
    /// them: what a relay passes on must verify as its original signer's.
    #[derive(Clone)]
    struct Far {
        verifier: Arc<Mutex<Verifier>>,
        got: Arc<Mutex<Vec<String>>>,
    }

    impl Far {
        fn new() -> Far {
            Far {
                verifier: Arc::new(Mutex::new(Verifier::new(
                    Key::new(SECRET).unwrap(),
                    Duration::from_secs(30),
                ))),
                got: Arc::default(),
            }
        }

        fn note<M: Signed>(&self, what: &str, m: &M) -> Result<(), Status> {
            let sender = self
                .verifier
                .lock()
                .unwrap()
                .verify(m, wire::now_ms())
                .map_err(|e| Status::unauthenticated(e.to_string()))?;
            self.got
                .lock()
                .unwrap()
                .push(format!("{what} from {sender}"));
            Ok(())
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
        async fn ping(&self, _: Request<PingRequest>) -> Result<Response<PingReply>, Status> {
            Err(Status::unimplemented("not used"))
        }
        async fn assign(
            &self,
            r: Request<CheckAssignment>,
        ) -> Result<Response<CheckAccepted>, Status> {
            self.note("assign", r.get_ref())?;
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
            self.note("conclude", r.get_ref())?;
            Ok(Response::new(ReportAck {}))
        }
        async fn forward(&self, r: Request<Forward>) -> Result<Response<ForwardReply>, Status> {
            self.note("forward", r.get_ref())?;
            if let Some(forward::Message::Report(rep)) = &r.get_ref().message {
                self.note("report", rep)?;
            }
            Ok(Response::new(ForwardReply { accepted: None }))
        }
    }

    #[tonic::async_trait]
    impl CoordinatorRpc for Far {
        async fn report(&self, r: Request<CheckReport>) -> Result<Response<ReportAck>, Status> {
            self.note("report", r.get_ref())?;
            Ok(Response::new(ReportAck {}))
        }
        async fn run(&self, _: Request<RunRequest>) -> Result<Response<RunResult>, Status> {
            Err(Status::unimplemented("not used"))
        }
    }

    /// Over real gRPC on loopback (members n0, n1, n2 at 127.0.28.1-3): the relay n1 passes the
    /// coordinator's assignment and conclusion on to n2 and n2's report on to the coordinator,
    /// verbatim (each verifies as its signer's at its receiver), and returns n2's answer; a
    /// member whose assignment names a relay sends its report inside a `Forward` to it.
    #[tokio::test]
    async fn a_relay_passes_messages_on_verbatim() {
        let (coordinator_at, far_at) = (Far::new(), Far::new());
        coordinator_at.serve("127.0.28.1:20261").await;
        far_at.serve("127.0.28.3:20261").await;
        let who = watch::channel(Some(authz::CoordinatorId {
            node: "n0".into(),
            address: Some("127.0.28.1:20261".into()),
        }))
        .1;
        let (relay, coordinator) = {
            let (svc, signer, inputs) = service_on(
                Arc::new(who),
                None,
                false,
                "127.0.28",
                "/nonexistent/faultline-probe".into(),
                Arc::new(crate::metrics::Metrics::new()),
            );
            std::mem::forget(inputs);
            (svc, signer)
        };
        let n2 = agent("n2");
        let to_n2 = Some(WireMember {
            node: "n2".into(),
            address: "127.0.28.3:20261".into(),
            topology: String::new(),
        });
        let envelope = |by: &Signer, to: Option<WireMember>, m: forward::Message| {
            by.sign(Forward {
                auth: None,
                protocol: PROTOCOL,
                to,
                message: Some(m),
            })
        };
        let r = relay
            .forward(Request::new(envelope(
                &coordinator,
                to_n2.clone(),
                forward::Message::Assign(coordinator.sign(assignment())),
            )))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.accepted.unwrap().reason, "n2 took it");
        relay
            .forward(Request::new(envelope(
                &coordinator,
                to_n2,
                forward::Message::Conclude(coordinator.sign(conclusion("n2"))),
            )))
            .await
            .unwrap();
        let report = CheckReport {
            protocol: PROTOCOL,
            run_id: "r1".into(),
            node: "n2".into(),
            partner: "n0".into(),
            passed: true,
            ..Default::default()
        };
        relay
            .forward(Request::new(envelope(
                &n2,
                None,
                forward::Message::Report(n2.sign(report.clone())),
            )))
            .await
            .unwrap();
        assert_eq!(
            far_at.got.lock().unwrap().clone(),
            vec!["assign from n0", "conclude from n0"]
        );
        assert_eq!(
            coordinator_at.got.lock().unwrap().clone(),
            vec!["report from n2"]
        );
        // The relay's own reports go through the relay its assignment names.
        let via = WireMember {
            node: "n2".into(),
            address: "127.0.28.3:20261".into(),
            topology: String::new(),
        };
        relay
            .send_report_via(
                &via,
                CheckReport {
                    node: "n1".into(),
                    ..report
                },
            )
            .await;
        assert_eq!(
            far_at.got.lock().unwrap()[2..].to_vec(),
            vec!["forward from n1", "report from n1"]
        );
    }

    /// Issue 12 §5: the requesters' secret requests runs and nothing else; the agents'
    /// secret still requests runs.
    #[tokio::test]
    async fn the_requester_secret_cannot_assign_cancel_conclude_or_report() {
        let (svc, _) = service();
        let cli = requester();
        let e = svc
            .assign(Request::new(cli.sign(assignment())))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = svc
            .cancel(Request::new(cli.sign(assignment())))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = svc
            .conclude(Request::new(cli.sign(conclusion("n1"))))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        // Even naming itself as the coordinator.
        let as_n0 = Signer {
            key: Key::new(REQUESTER).unwrap(),
            sender: "n0".into(),
        };
        let e = svc
            .conclude(Request::new(as_n0.sign(conclusion("n1"))))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let report = as_n0.sign(CheckReport {
            protocol: PROTOCOL,
            node: "n0".into(),
            ..Default::default()
        });
        let e = svc.report(Request::new(report)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = svc
            .ping(Request::new(cli.sign(PingRequest {
                auth: None,
                protocol: PROTOCOL,
                reach: vec![],
                liveness_only: false,
            })))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        // Run: authenticated with either secret (this agent then says it does not coordinate),
        // refused with any other.
        let run = |s: &Signer| {
            s.sign(RunRequest {
                auth: None,
                protocol: PROTOCOL,
                nodes: vec!["n0".into(), "n1".into()],
                timeout_ms: 0,
                request_id: String::new(),
            })
        };
        for s in [cli, agent("n2")] {
            let e = svc.run(Request::new(run(&s))).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        }
        let stranger = Signer {
            key: Key::new(b"a stranger's secret, 32 bytes...").unwrap(),
            sender: "cli@x".into(),
        };
        let e = svc.run(Request::new(run(&stranger))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
    }

    /// A requester's bearer token is reviewed (`Requesters`) for `Run` only: accepted,
    /// denied, invalid; it never stands in for the agents' signature.
    #[tokio::test]
    async fn requester_tokens_request_runs_and_nothing_else() {
        let (svc, _) = service();
        let with = |token: &str, msg| bearer(token, msg);
        let run = RunRequest {
            auth: None,
            protocol: PROTOCOL,
            nodes: vec!["n0".into(), "n1".into()],
            timeout_ms: 0,
            request_id: String::new(),
        };
        // Not the coordinator: no review at all, whatever the token.
        let e = svc.run(with("forged", run.clone())).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        // The coordinator reviews it (an empty node list is refused only after that).
        let (_w, who_rx) = watch::channel(None);
        let (lead, _, _) = service_with(Arc::new(who_rx), Some(Arc::new(FakeTokens)), true);
        let empty = RunRequest {
            nodes: vec![],
            ..run.clone()
        };
        let e = lead.run(with("good", empty.clone())).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "past auth: {e:?}");
        let e = lead.run(with("denied", empty.clone())).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("bob may not"));
        let e = lead.run(with("forged", empty)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = svc.assign(bearer("good", assignment())).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = svc
            .conclude(bearer("good", conclusion("n1")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        // Without Kubernetes no token is taken.
        let (_who, who_rx) = watch::channel(None);
        let (bare, _, _) = service_with(Arc::new(who_rx), None, true);
        let e = bare
            .run(with(
                "good",
                RunRequest {
                    nodes: vec![],
                    ..run
                },
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("takes no service-account tokens"));
    }

    fn bearer<T>(token: &str, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        r.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    }
}
