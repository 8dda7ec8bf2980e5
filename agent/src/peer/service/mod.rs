//! The agent's peer-check gRPC service (`PeerCheck`): the handlers of `Ping`, `Assign`,
//! `Cancel`, `Conclude` and `Forward`. Each asks `auth` first whether the request is the
//! coordinator's (anything else is refused and changes nothing), then hands the work to the
//! module whose job it is: `checks` runs an assigned check and sends its report, `relay`
//! passes messages on for the members the coordinator cannot reach. An assignment must name
//! this node, probe addresses on its probe ports, and sizes within its policy (`peer::authz`).
//! A conclusion becomes this node's `Level` observations (`faultline_core::peer::verdicts`),
//! sent to the engine like any source's.

mod auth;
mod checks;
mod relay;
#[cfg(test)]
mod test_fixtures;

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use faultline_proto::v1::peer_check_server::PeerCheck;
use faultline_proto::v1::{
    CheckAccepted, CheckAssignment, ForwardReply, ForwardRequest as Forward, PingReply,
    PingRequest, ReportAck, RunConclusion,
};
use faultline_proto::PROTOCOL;
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status};
use tracing::{debug, info};

use super::authz::{self, WhoCoordinates};
use super::busy::Busy;
use super::wire::{self, NodeCredential};
use crate::metrics::{Metrics, PeerCheckResult};
use crate::source::Input;
use auth::CoordinatorAuth;
use checks::{Checks, Taken};
use faultline_core::policy::PeerPolicy;
use relay::Relay;

/// How long a conclusion waits for the agent's engine to take its observations.
const CONCLUDE_DELIVERY: Duration = Duration::from_secs(3);

/// How this agent runs its probe.
#[derive(Debug, Clone)]
pub(crate) struct ProbeSetup {
    pub(crate) bin: PathBuf,
    /// NCCL allgather and cuBLAS GEMM instead of TCP and the CPU.
    pub(crate) gpu: bool,
}

/// Everything the service is built from.
#[derive(Debug)]
pub(crate) struct ServiceSetup {
    pub(crate) node: String,
    /// Who coordinates and with which key.
    pub(crate) coordinator: Arc<dyn WhoCoordinates>,
    /// This node's own credential, for its reports.
    pub(crate) credential: NodeCredential,
    pub(crate) probe: ProbeSetup,
    pub(crate) busy: Arc<dyn Busy>,
    pub(crate) inputs: mpsc::Sender<Input>,
    pub(crate) policy: watch::Receiver<PeerPolicy>,
    /// The ports probe addresses may name (`probe_port_base` + `PROBE_PORTS`).
    pub(crate) probe_ports: Range<u16>,
    pub(crate) metrics: Arc<Metrics>,
}

/// The service every agent serves.
#[derive(Debug)]
pub(crate) struct PeerService {
    node: String,
    /// Whether a request is the coordinator's.
    auth: CoordinatorAuth,
    /// The checks assigned to this agent.
    checks: Arc<Checks>,
    /// Forwards for the members the coordinator cannot reach.
    relay: Relay,
    /// The engine's input: a conclusion's observations.
    inputs: mpsc::Sender<Input>,
    policy: watch::Receiver<PeerPolicy>,
    probe_ports: Range<u16>,
}

impl PeerService {
    pub(crate) fn new(s: ServiceSetup) -> PeerService {
        PeerService {
            auth: CoordinatorAuth::new(s.coordinator, s.node.clone()),
            checks: Arc::new(Checks::new(
                s.node.clone(),
                s.credential,
                s.probe,
                s.busy,
                s.metrics,
            )),
            relay: Relay::new(s.node.clone()),
            node: s.node,
            inputs: s.inputs,
            policy: s.policy,
            probe_ports: s.probe_ports,
        }
    }
}

/// A request in the protocol version this agent speaks.
fn check_protocol(p: u32) -> Result<(), Status> {
    if p == PROTOCOL {
        Ok(())
    } else {
        Err(Status::failed_precondition(format!(
            "protocol {p}; this agent speaks {PROTOCOL}"
        )))
    }
}

#[tonic::async_trait]
impl PeerCheck for PeerService {
    async fn ping(&self, request: Request<PingRequest>) -> Result<Response<PingReply>, Status> {
        let p = request.into_inner();
        self.auth.verify("Ping", &p).await?;
        let busy = self.checks.busy().await;
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
        let sender = self.auth.verify("Assign", &a).await?;
        check_protocol(a.protocol)?;
        if a.cancel {
            return Err(self.auth.refused(
                "Assign",
                Status::invalid_argument("a cancellation is not an assignment"),
            ));
        }
        let refuse = |reason: String| {
            let reason = format!("{}: {reason}", self.node);
            debug!(from = %sender, reason, "assignment refused");
            self.checks.count(PeerCheckResult::refused);
            Ok(Response::new(CheckAccepted {
                accepted: false,
                reason,
            }))
        };
        let Some(role) = checks::check_key(&a, &self.node) else {
            return refuse(format!("{} is not a member of this check", self.node));
        };
        let peers = match authz::check_probes(&a, self.probe_ports.clone()) {
            Ok(p) => p,
            Err(why) => return refuse(why.to_string()),
        };
        if a.coordinator.parse::<SocketAddr>().is_err() {
            return refuse("coordinator address is not ip:port".into());
        }
        let policy = self.policy.borrow().clone();
        let admitted = match authz::admit(&a, &policy) {
            Ok(x) => x,
            Err(why) => return refuse(why.to_string()),
        };
        self.relay.remember_coordinator(&a.coordinator);
        // The report goes to the coordinator that assigned the check, signed for its name.
        let reason = match self.checks.start(a, role, admitted, peers, sender.clone()) {
            Ok(Taken::New) => String::new(),
            // The check runs; say so (a refusal would fail a check that is fine).
            Ok(Taken::Repeated) => "already running (a repeated assignment)".into(),
            Err(why) => return refuse(why),
        };
        Ok(Response::new(CheckAccepted {
            accepted: true,
            reason,
        }))
    }

    async fn cancel(
        &self,
        request: Request<CheckAssignment>,
    ) -> Result<Response<CheckAccepted>, Status> {
        let a = request.into_inner();
        self.auth.verify("Cancel", &a).await?;
        if !a.cancel {
            return Err(self.auth.refused(
                "Cancel",
                Status::invalid_argument("an assignment is not a cancellation"),
            ));
        }
        let found = self.checks.cancel(&a);
        Ok(Response::new(CheckAccepted {
            accepted: found,
            reason: if found {
                String::new()
            } else {
                "no such check running".into()
            },
        }))
    }

    async fn forward(&self, request: Request<Forward>) -> Result<Response<ForwardReply>, Status> {
        let reply = self.relay.forward(&self.auth, request.into_inner()).await?;
        Ok(Response::new(reply))
    }

    async fn conclude(
        &self,
        request: Request<RunConclusion>,
    ) -> Result<Response<ReportAck>, Status> {
        let c = request.into_inner();
        self.auth.verify("Conclude", &c).await?;
        check_protocol(c.protocol)?;
        let verdicts = wire::from_proto(&c.members, &c.verdicts)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let Some(me) = c.members.iter().position(|m| m == &self.node) else {
            return Err(Status::invalid_argument(format!(
                "{} is not a member of run {}",
                self.node, c.run_id
            )));
        };
        let own = self.checks.cannot_run(&c.run_id);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::test_fixtures::{assignment, conclusion, coordinator, service};
    use super::*;

    type Edit = Box<dyn Fn(&mut CheckAssignment)>;

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
        assert!(svc.checks.running.lock().is_empty(), "nothing started");
        // A Cancel is the same message as an Assign; one replayed as the other
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
        assert!(svc.checks.running.lock().is_empty(), "nothing started");
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
}
