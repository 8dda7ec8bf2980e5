//! The coordinator's gRPC service: `Report` (an agent's side of one check, accepted only from
//! the node it describes), `Run` (a requester's run) and `Admit` (may an agent newly taint its
//! own node: the taint budget), the last two answered only by the active replica.

use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use faultline_proto::auth::Verifier;
use faultline_proto::v1::coordinator_server::Coordinator as CoordinatorRpc;
use faultline_proto::v1::{
    AdmitReply, AdmitRequest, CheckReport, ReportAck, RunRequest, RunResult,
};
use faultline_proto::PROTOCOL;
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

use super::agents::FromAgent;
use super::budget::Admissions;
use super::requesters::{self, TokenRefusal};
use super::Leadership;
use crate::runs::{self as runs, Trigger};
use faultline_agent::peer::wire;

/// At most one log line per this interval about refused requests (with the count).
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// How long the token reviews of one request may take.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

/// Who may send what.
#[derive(Debug)]
pub struct Authz {
    /// The agents' reports: each verified as the node it names (`agents::Agents`).
    pub agents: Arc<dyn super::agents::Agents>,
    /// The requesters' secret (`faultline check` signs `Run` with it), if any.
    pub requester: Option<Verifier>,
    /// Kubernetes: requesters' service-account tokens (`authorization: Bearer`), checked with
    /// TokenReview and SubjectAccessReview.
    pub requesters: Option<Arc<dyn requesters::Requesters>>,
}

/// How long an admission may take (the token's review, the ledger's read, the node count and
/// the ledger's write): past it the agent is told to ask again, and its taint waits meanwhile.
const ADMIT_TIMEOUT: Duration = Duration::from_secs(8);

/// The served handle.
#[derive(Debug, Clone)]
pub struct CoordinatorService(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    leadership: Leadership,
    agents: Arc<dyn super::agents::Agents>,
    requester: Option<Mutex<Verifier>>,
    requesters: Option<Arc<dyn requesters::Requesters>>,
    /// The taint budget (Kubernetes only: without it there are no taints).
    admissions: Option<Admissions>,
    refusals: Mutex<faultline_agent::rate_limit::LogPacer>,
}

impl CoordinatorService {
    pub fn new(
        leadership: Leadership,
        authz: Authz,
        admissions: Option<Admissions>,
    ) -> CoordinatorService {
        CoordinatorService(Arc::new(Inner {
            leadership,
            agents: authz.agents,
            requester: authz.requester.map(Mutex::new),
            requesters: authz.requesters,
            admissions,
            refusals: Mutex::new(faultline_agent::rate_limit::LogPacer::new(
                REFUSAL_LOG_EVERY,
            )),
        }))
    }

    /// Logs a refusal (at most one line per `REFUSAL_LOG_EVERY`, with the count) and returns it.
    fn refused(&self, rpc: &str, s: Status) -> Status {
        let due = self
            .0
            .refusals
            .lock()
            .note(1, self.0.leadership.coordinator.clock().instant());
        if let Some((since, total)) = due {
            warn!(rpc, code = ?s.code(), reason = s.message(), refused_since_last_line = since.times, refused_total = total.times, "coordinator request refused");
        }
        s
    }

    fn check_protocol(p: u32) -> Result<(), Status> {
        if p == PROTOCOL {
            Ok(())
        } else {
            Err(Status::failed_precondition(format!(
                "protocol {p}; this coordinator speaks {PROTOCOL}"
            )))
        }
    }

    fn active(&self) -> Result<&Leadership, Status> {
        let l = &self.0.leadership;
        if *l.leader.borrow() {
            Ok(l)
        } else {
            Err(Status::failed_precondition(format!(
                "{} is not the active coordinator (it does not hold the Lease)",
                l.coordinator.node
            )))
        }
    }

    /// A requester's bearer token: its user name when it may request runs.
    async fn check_token(&self, token: &str) -> Result<String, Status> {
        let Some(r) = &self.0.requesters else {
            return Err(self.refused(
                "Run",
                Status::unauthenticated(
                    "this coordinator takes no service-account tokens (not on Kubernetes); sign with the requester secret",
                ),
            ));
        };
        match tokio::time::timeout(REVIEW_TIMEOUT, r.check(token)).await {
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

    /// A `Run` signed with the requesters' secret: the signer's name.
    fn verify_run(&self, msg: &RunRequest) -> Result<String, Status> {
        let Some(r) = &self.0.requester else {
            return Err(self.refused(
                "Run",
                Status::unauthenticated(
                    "no requester secret is configured here: request runs with a service-account token",
                ),
            ));
        };
        let mut v = r.lock();
        v.verify_or_role(msg, wire::now_ms(), faultline_proto::auth::COORDINATOR_ROLE)
            .map_err(|e| self.refused("Run", Status::unauthenticated(e.to_string())))
    }
}

fn bearer<T>(r: &Request<T>) -> Option<String> {
    r.metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string())
}

#[tonic::async_trait]
impl CoordinatorRpc for CoordinatorService {
    async fn report(&self, request: Request<CheckReport>) -> Result<Response<ReportAck>, Status> {
        let token = bearer(&request);
        let r = request.into_inner();
        let coordinator = &self.0.leadership.coordinator;
        // A report no check waits for (late, duplicate, or made up) changes nothing: it is
        // answered before any signature is checked or token reviewed, so junk costs nothing.
        // A replica that is not active says so.
        if !coordinator.waits_for(&r) {
            self.active()?;
            debug!(node = %r.node, run_id = %r.run_id, "report for no waiting check (late, duplicate or made up)");
            return Ok(Response::new(ReportAck {}));
        }
        let node = match self
            .0
            .agents
            .verify(FromAgent::Report(&r), token.as_deref())
            .await
        {
            Ok(node) => node,
            Err(e) => return Err(self.refused("Report", e.status())),
        };
        Self::check_protocol(r.protocol)?;
        runs::validate_report(&r)
            .map_err(|why| Status::invalid_argument(format!("report from {node}: {why}")))?;
        if node != r.node {
            return Err(self.refused(
                "Report",
                Status::permission_denied(format!("{node} cannot report for {}", r.node)),
            ));
        }
        if !coordinator.deliver(r) {
            debug!(from = %node, "report for no waiting check (it ended meanwhile)");
        }
        Ok(Response::new(ReportAck {}))
    }

    async fn run(&self, request: Request<RunRequest>) -> Result<Response<RunResult>, Status> {
        let token = bearer(&request);
        let req = request.into_inner();
        let sender = match token {
            Some(token) => {
                // Only the active replica asks the API server.
                self.active()?;
                self.check_token(&token).await?
            }
            None => self.verify_run(&req)?,
        };
        Self::check_protocol(req.protocol)?;
        let l = self.active()?.clone();
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
        let aborted = |e: runs::Aborted| Status::unavailable(e.to_string());
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
        let (members, missing) = runs::select(all, &req.nodes);
        let policy = l.policy.borrow().clone();
        let mut spec = super::run_spec(&policy, l.next_run());
        spec.check_timeout = requested_timeout(spec.check_timeout, req.timeout_ms);
        info!(from = %sender, nodes = req.nodes.len(), "peer-check run requested");
        let state = l
            .coordinator
            .run_detached(members, missing, spec, Trigger::Request, request_id, claim)
            .await
            .map_err(aborted)?;
        Ok(Response::new(result_of(&state)))
    }

    async fn admit(&self, request: Request<AdmitRequest>) -> Result<Response<AdmitReply>, Status> {
        let token = bearer(&request);
        let req = request.into_inner();
        let Some(admissions) = &self.0.admissions else {
            return Err(Status::unimplemented(
                "no taint budget here: this coordinator runs without Kubernetes",
            ));
        };
        // Only the active replica keeps the budget, and only it asks the API server whose token
        // this is.
        self.active()?;
        // The whole answer within ADMIT_TIMEOUT (the agent waits 10 s): the token's review
        // and the ledger.
        let answer = tokio::time::timeout(ADMIT_TIMEOUT, async {
            let node = match self
                .0
                .agents
                .verify(FromAgent::Admit(&req), token.as_deref())
                .await
            {
                Ok(node) => node,
                Err(e) => return Err(self.refused("Admit", e.status())),
            };
            Self::check_protocol(req.protocol)?;
            if node != req.node {
                return Err(self.refused(
                    "Admit",
                    Status::permission_denied(format!("{node} cannot ask to taint {}", req.node)),
                ));
            }
            let budget = admissions.policy.borrow().policy.taint_budget.clone();
            admissions
                .ledger
                .admit(&node, &budget)
                .await
                .map_err(|e| Status::unavailable(e.to_string()))
        })
        .await
        .map_err(|_| Status::unavailable("the taint budget took too long; ask again"))??;
        let node = &req.node;
        if !answer.allowed {
            debug!(%node, used = answer.used, limit = answer.limit, "taint budget: denied");
        }
        Ok(Response::new(AdmitReply {
            allowed: answer.allowed,
            used: answer.used,
            limit: answer.limit,
            nodes: answer.nodes,
        }))
    }
}

/// The shortest per-check deadline a requester gets (or the policy's, if shorter): a deadline
/// near the time a connection takes fails checks as plain failures, which name nodes faulty.
pub const MIN_REQUESTED_TIMEOUT: Duration = Duration::from_secs(1);

/// The per-check deadline of a requested run: the policy's, shortened to the request's
/// (`timeout_ms`, 0: none), never below [`MIN_REQUESTED_TIMEOUT`] (or the policy's own).
pub(crate) fn requested_timeout(policy: Duration, timeout_ms: u32) -> Duration {
    if timeout_ms == 0 {
        return policy;
    }
    policy
        .min(Duration::from_millis(u64::from(timeout_ms)))
        .max(MIN_REQUESTED_TIMEOUT.min(policy))
}

/// The wire result of a finished run.
pub fn result_of(state: &runs::RunState) -> RunResult {
    use faultline_proto::v1::Verdict;
    RunResult {
        run_id: state.run_id.clone(),
        rounds: state.rounds.len() as u32,
        verdicts: state
            .verdicts
            .iter()
            .map(|v| Verdict {
                kind: runs::kind_from_name(&v.kind) as i32,
                nodes: v.nodes.clone(),
                slowdown: v.slowdown.unwrap_or(0.0),
                reason: v.reason.clone().unwrap_or_default(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::agents::{NodeKeys, Tokens};
    use crate::members::{Member, MembersError};
    use crate::runs::{Coordinator, MemoryPublisher, WatchFence};
    use crate::tokens::AgentTokens;
    use crate::transport::GrpcTransport;
    use faultline_agent::peer::wire::{CoordinatorSigner, Signer};
    use faultline_core::policy::PeerPolicy;
    use faultline_proto::auth::{node_key, CoordinatorKey, Key, COORDINATOR_ROLE};
    use tokio::sync::watch;

    const MASTER: &[u8] = b"the coordinator's master, 32 b..";
    const REQUESTER: &[u8] = b"requester secret, not the agents";

    #[derive(Debug)]
    struct NoMembers;

    #[async_trait::async_trait]
    impl crate::members::Members for NoMembers {
        async fn list(&self) -> Result<Vec<Member>, MembersError> {
            Ok(Vec::new())
        }
    }

    /// Pads test tokens to a usable key length.
    const PAD: &str = "-0123456789abcdef";

    /// Tokens as the API server would review them: `tok-<node>-0123456789abcdef` is that
    /// node's agent's.
    /// Counts its reviews.
    #[derive(Debug, Default)]
    struct FakeTokens(std::sync::atomic::AtomicUsize);

    #[async_trait::async_trait]
    impl AgentTokens for FakeTokens {
        async fn node_of(&self, token: &str) -> Result<String, TokenRefusal> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            token
                .strip_prefix("tok-")
                .and_then(|t| t.strip_suffix(PAD))
                .map(str::to_string)
                .ok_or_else(|| TokenRefusal::Unauthenticated("invalid bearer token".into()))
        }
    }

    /// The coordinator "c0", active, taking reports as `agents` says.
    fn service(agents: Arc<dyn super::super::agents::Agents>, active: bool) -> CoordinatorService {
        service_with(agents, active, None)
    }

    fn service_with(
        agents: Arc<dyn super::super::agents::Agents>,
        active: bool,
        admissions: Option<Admissions>,
    ) -> CoordinatorService {
        let coordinator = Arc::new(Coordinator::new(
            "c0".into(),
            "10.0.0.9:20262".into(),
            20270,
            Arc::new(GrpcTransport::new(CoordinatorSigner {
                key: Arc::new(CoordinatorKey::generate().unwrap()),
                sender: "c0".into(),
            })),
            Arc::new(MemoryPublisher::default()),
            Arc::new(WatchFence(watch::channel(active).1)),
            Arc::new(faultline_agent::clock::SystemClock),
        ));
        CoordinatorService::new(
            Leadership::new(
                coordinator,
                watch::channel(active).1,
                Arc::new(NoMembers),
                watch::channel(PeerPolicy::default()).1,
            ),
            Authz {
                agents,
                requester: Some(Verifier::new(
                    Key::new(REQUESTER).unwrap(),
                    faultline_agent::peer::MAX_SKEW,
                    "c0",
                )),
                requesters: None,
            },
            admissions,
        )
    }

    /// A check of run r1 waits for `node`'s report (its partner n0); the receiver is kept
    /// alive by the caller.
    fn waiting(
        svc: &CoordinatorService,
        node: &str,
    ) -> tokio::sync::oneshot::Receiver<CheckReport> {
        svc.0
            .leadership
            .coordinator
            .expect(("r1".into(), 1, node.into(), "n0".into()))
    }

    fn report(node: &str) -> CheckReport {
        CheckReport {
            protocol: PROTOCOL,
            run_id: "r1".into(),
            round: 1,
            node: node.into(),
            partner: "n0".into(),
            passed: false,
            error: "connection refused".into(),
            ..Default::default()
        }
    }

    fn node_signer(node: &str, as_: &str) -> Signer {
        Signer {
            key: node_key(&Key::new(MASTER).unwrap(), node),
            sender: as_.into(),
        }
    }

    /// Issue 28: forged failure reports signed as a healthy node got it named faulty (every
    /// agent held the key that signed any sender's name). Without Kubernetes a report now
    /// verifies only under the key derived for the node it names: n2 cannot report for n1,
    /// neither under its own name (`PERMISSION_DENIED`) nor under n1's (`UNAUTHENTICATED`);
    /// n1's own is taken.
    #[tokio::test]
    async fn without_kubernetes_a_report_is_taken_only_from_its_node() {
        let svc = service(
            Arc::new(NodeKeys::new(Key::new(MASTER).unwrap(), "c0")),
            true,
        );
        let _waits = waiting(&svc, "n1");
        let e = svc
            .report(Request::new(
                node_signer("n2", "n2").sign(report("n1"), "c0"),
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("n2 cannot report for n1"), "{e:?}");
        let e = svc
            .report(Request::new(
                node_signer("n2", "n1").sign(report("n1"), "c0"),
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        // The master itself is the coordinator's; a requester's secret is no node's key.
        let requester = Signer {
            key: Key::new(REQUESTER).unwrap(),
            sender: "n1".into(),
        };
        let e = svc
            .report(Request::new(requester.sign(report("n1"), "c0")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        svc.report(Request::new(
            node_signer("n1", "n1").sign(report("n1"), "c0"),
        ))
        .await
        .unwrap();
    }

    fn tok(node: &str) -> String {
        format!("tok-{node}{PAD}")
    }

    fn with_token(token: &str, msg: CheckReport) -> Request<CheckReport> {
        let mut r = Request::new(msg);
        faultline_agent::peer::client::bearer(&mut r, token).unwrap();
        r
    }

    fn token_signed(token: &str, as_: &str, msg: CheckReport) -> CheckReport {
        Signer {
            key: Key::new(token.as_bytes()).unwrap(),
            sender: as_.into(),
        }
        .sign(msg, "c0")
    }

    /// Issue 28, on Kubernetes: a report carries its agent's service-account token and is
    /// signed with it; the API server's node for the token must be the node the report names.
    /// n2's token cannot report for n1 (under either name), a report without a token or signed
    /// with another token than it carries is refused; n1's own is taken.
    #[tokio::test]
    async fn on_kubernetes_a_report_is_taken_only_from_the_node_its_token_names() {
        let svc = service(
            Arc::new(Tokens::new(Arc::new(FakeTokens::default()), "c0")),
            true,
        );
        let _waits = waiting(&svc, "n1");
        let cases = [
            (
                with_token(&tok("n2"), token_signed(&tok("n2"), "n2", report("n1"))),
                tonic::Code::PermissionDenied,
                "n2 cannot report for n1",
            ),
            (
                with_token(&tok("n2"), token_signed(&tok("n2"), "n1", report("n1"))),
                tonic::Code::Unauthenticated,
                "its token is \"n2\"'s agent's",
            ),
            (
                with_token(&tok("n2"), token_signed(&tok("n1"), "n1", report("n1"))),
                tonic::Code::Unauthenticated,
                "does not verify",
            ),
            (
                Request::new(token_signed(&tok("n1"), "n1", report("n1"))),
                tonic::Code::Unauthenticated,
                "must carry the agent's service-account token",
            ),
            (
                with_token(
                    "forged-0123456789",
                    token_signed("forged-0123456789", "n1", report("n1")),
                ),
                tonic::Code::Unauthenticated,
                "invalid bearer token",
            ),
        ];
        for (request, code, why) in cases {
            let e = svc.report(request).await.unwrap_err();
            assert_eq!(e.code(), code, "{why}: {e:?}");
            assert!(e.message().contains(why), "{why}: {e:?}");
        }
        svc.report(with_token(
            &tok("n1"),
            token_signed(&tok("n1"), "n1", report("n1")),
        ))
        .await
        .unwrap();
    }

    /// A report no check waits for is answered without a look, and one replayed, altered or
    /// addressed elsewhere is refused before its token is reviewed: neither costs the API server
    /// anything (issue 28 review: junk reports relayed by every agent made one TokenReview
    /// each).
    #[tokio::test]
    async fn a_replayed_or_altered_report_costs_no_token_review() {
        let tokens = Arc::new(FakeTokens::default());
        let svc = service(Arc::new(Tokens::new(tokens.clone(), "c0")), true);
        let reviews = || tokens.0.load(std::sync::atomic::Ordering::Relaxed);
        // Reports that no check waits for are answered without a look: no review.
        for junk in [report("n1"), report("n7")] {
            svc.report(with_token(&format!("junk{PAD}"), junk))
                .await
                .unwrap();
        }
        assert_eq!(reviews(), 0);
        let mut waits = waiting(&svc, "n1");
        let good = token_signed(&tok("n1"), "n1", report("n1"));
        svc.report(with_token(&tok("n1"), good.clone()))
            .await
            .unwrap();
        assert_eq!(reviews(), 1);
        assert!(waits.try_recv().is_ok(), "the check got its report");
        let _waits = waiting(&svc, "n1");
        let e = svc
            .report(with_token(&tok("n1"), good.clone()))
            .await
            .unwrap_err();
        assert!(e.message().contains("replay"), "{e:?}");
        let mut altered = good;
        altered.passed = true;
        let e = svc
            .report(with_token(&tok("n1"), altered))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        let elsewhere = Signer {
            key: Key::new(tok("n1").as_bytes()).unwrap(),
            sender: "n1".into(),
        }
        .sign(report("n1"), "c1");
        let e = svc
            .report(with_token(&tok("n1"), elsewhere))
            .await
            .unwrap_err();
        assert!(e.message().contains("addressed to"), "{e:?}");
        assert_eq!(reviews(), 1, "no review for any of them");
    }

    /// Issue 28 review: a requester could shorten the per-check deadline to 1 ms, and checks
    /// then failed as plain failures (false faulty verdicts). It is floored at a second (or the
    /// policy's own, if shorter).
    #[test]
    fn a_requested_deadline_only_shortens_and_never_below_a_second() {
        let ten = Duration::from_secs(10);
        assert_eq!(requested_timeout(ten, 0), ten);
        assert_eq!(requested_timeout(ten, 3_000), Duration::from_secs(3));
        assert_eq!(requested_timeout(ten, 60_000), ten);
        assert_eq!(requested_timeout(ten, 1), Duration::from_secs(1));
        let short = Duration::from_millis(500);
        assert_eq!(requested_timeout(short, 1), short);
    }

    fn run_request() -> RunRequest {
        RunRequest {
            auth: None,
            protocol: PROTOCOL,
            nodes: vec!["n1".into()],
            timeout_ms: 0,
            request_id: String::new(),
        }
    }

    /// `Run` takes the requesters' secret (or a requester's token on Kubernetes), never an
    /// agent's key, and only on the active replica.
    #[tokio::test]
    async fn runs_are_requested_with_the_requesters_credential_on_the_active_replica() {
        let agents = || Arc::new(NodeKeys::new(Key::new(MASTER).unwrap(), "c0"));
        let svc = service(agents(), true);
        let e = svc
            .run(Request::new(
                node_signer("n1", "n1").sign(run_request(), "c0"),
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        let requester = Signer {
            key: Key::new(REQUESTER).unwrap(),
            sender: "cli@laptop".into(),
        };
        // Accepted (fewer than two members known: the run ends at once).
        svc.run(Request::new(requester.sign(run_request(), "c0")))
            .await
            .unwrap();
        let mut bearer = Request::new(run_request());
        faultline_agent::peer::client::bearer(&mut bearer, "tok").unwrap();
        let e = svc.run(bearer).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        assert!(
            e.message().contains("takes no service-account tokens"),
            "{e:?}"
        );
        let standby = service(agents(), false);
        let e = standby
            .run(Request::new(requester.sign(run_request(), "c0")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("not the active coordinator"), "{e:?}");
    }

    /// A ledger in memory that never conflicts (the budget's own behaviour is tested in
    /// `budget`); what it holds.
    #[derive(Debug, Default)]
    struct Kept(Mutex<Option<crate::budget::Ledger>>);

    #[async_trait::async_trait]
    impl crate::budget::LedgerStore for Kept {
        async fn read(
            &self,
        ) -> Result<(crate::budget::Ledger, Option<String>), crate::budget::StoreError> {
            Ok((self.0.lock().clone().unwrap_or_default(), None))
        }
        async fn write(
            &self,
            ledger: &crate::budget::Ledger,
            _version: Option<&str>,
        ) -> Result<String, crate::budget::StoreError> {
            *self.0.lock() = Some(ledger.clone());
            Ok("1".into())
        }
    }

    /// Two members: a budget of one node (10 %, at least one).
    #[derive(Debug)]
    struct TwoMembers;

    #[async_trait::async_trait]
    impl crate::members::Members for TwoMembers {
        async fn list(&self) -> Result<Vec<Member>, MembersError> {
            Ok(["n1", "n2"]
                .iter()
                .map(|n| Member {
                    node: (*n).into(),
                    address: "10.0.0.1:20261".into(),
                    ip: "10.0.0.1".parse().unwrap(),
                    topology: None,
                })
                .collect())
        }
    }

    fn admissions(kept: Arc<Kept>) -> Admissions {
        Admissions {
            ledger: Arc::new(crate::budget::TaintLedger::new(
                kept,
                Arc::new(TwoMembers),
                Arc::new(faultline_agent::clock::SystemClock),
            )),
            policy: watch::channel(faultline_core::policy::LoadedPolicy::builtin()).1,
        }
    }

    fn admit_request(node: &str) -> AdmitRequest {
        AdmitRequest {
            protocol: PROTOCOL,
            node: node.into(),
            ..Default::default()
        }
    }

    /// An admission as an agent sends it: to the coordinator's Service, so for the role.
    fn admit_with_token(token: &str, as_: &str, node: &str) -> Request<AdmitRequest> {
        admit_for(COORDINATOR_ROLE, token, as_, node)
    }

    fn admit_for(receiver: &str, token: &str, as_: &str, node: &str) -> Request<AdmitRequest> {
        let msg = Signer {
            key: Key::new(token.as_bytes()).unwrap(),
            sender: as_.into(),
        }
        .sign(admit_request(node), receiver);
        let mut r = Request::new(msg);
        faultline_agent::peer::client::bearer(&mut r, token).unwrap();
        r
    }

    /// Issue 28: the taint budget is the coordinator's. An agent's admission counts only for
    /// the node its token names: a member holding every agent credential cannot spend the
    /// budget in another node's name (nor under its own name for another node), a replayed
    /// admission is refused, as is one signed for the other replica, and the ledger holds only
    /// the admitted node. Budget of one: the second node is denied, with the numbers the agent
    /// shows.
    #[tokio::test]
    async fn a_taint_admission_counts_only_for_the_node_its_token_names() {
        let kept = Arc::new(Kept::default());
        let svc = service_with(
            Arc::new(Tokens::new(Arc::new(FakeTokens::default()), "c0")),
            true,
            Some(admissions(kept.clone())),
        );
        for (r, code, why) in [
            (
                admit_with_token(&tok("n2"), "n2", "n1"),
                tonic::Code::PermissionDenied,
                "n2 cannot ask to taint n1",
            ),
            (
                admit_with_token(&tok("n2"), "n1", "n1"),
                tonic::Code::Unauthenticated,
                "its token is \"n2\"'s",
            ),
            (
                Request::new(admit_request("n1")),
                tonic::Code::Unauthenticated,
                "must carry",
            ),
            // Signed for the other replica by name: not for this one (the role, or this
            // replica's own name, is).
            (
                admit_for("c1", &tok("n1"), "n1", "n1"),
                tonic::Code::Unauthenticated,
                "addressed to \"c1\"",
            ),
        ] {
            let e = svc.admit(r).await.unwrap_err();
            assert_eq!(e.code(), code, "{e:?}");
            assert!(e.message().contains(why), "{e:?}");
        }
        assert!(kept.0.lock().is_none(), "nothing was admitted");
        let first = admit_with_token(&tok("n1"), "n1", "n1");
        let replay = Request::new(first.get_ref().clone());
        let mut replay = replay;
        faultline_agent::peer::client::bearer(&mut replay, &tok("n1")).unwrap();
        let a = svc.admit(first).await.unwrap().into_inner();
        assert_eq!((a.allowed, a.used, a.limit, a.nodes), (true, 1, 1, 2));
        let e = svc.admit(replay).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        let d = svc
            .admit(admit_with_token(&tok("n2"), "n2", "n2"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((d.allowed, d.used, d.limit, d.nodes), (false, 1, 1, 2));
        // Addressed to this replica by its own name: taken as well.
        let d = svc
            .admit(admit_for("c0", &tok("n2"), "n2", "n2"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((d.allowed, d.used, d.limit, d.nodes), (false, 1, 1, 2));
        let held: Vec<String> = kept
            .0
            .lock()
            .as_ref()
            .unwrap()
            .entries
            .iter()
            .map(|e| e.node.clone())
            .collect();
        assert_eq!(held, ["n1"]);
    }

    /// Only the active replica answers (the other would keep a second ledger), and a
    /// coordinator without Kubernetes has no budget to offer.
    #[tokio::test]
    async fn only_the_active_replica_on_kubernetes_admits() {
        let standby = service_with(
            Arc::new(Tokens::new(Arc::new(FakeTokens::default()), "c0")),
            false,
            Some(admissions(Arc::default())),
        );
        let e = standby
            .admit(admit_with_token(&tok("n1"), "n1", "n1"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        let bare = service(
            Arc::new(NodeKeys::new(Key::new(MASTER).unwrap(), "c0")),
            true,
        );
        let e = bare
            .admit(Request::new(
                node_signer("n1", "n1").sign(admit_request("n1"), "c0"),
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    }
}
