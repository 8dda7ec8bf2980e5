//! Every agent is also a relay (`Forward`), for the members the coordinator cannot reach: it
//! passes the coordinator's messages on, verbatim (their signature is the coordinator's), to
//! the member the coordinator's envelope for this relay names, never to itself; and a member's
//! report on to the coordinator, at the address the coordinator's own last message named, only
//! for a check whose assignment went through this relay, and once. Within the bounds
//! `peer::authz` sets: a message's size and a rate of forwards. A member that does not answer
//! is the relay's answer (`unreachable`), not its error: the coordinator tells a relay it could
//! not ask from a member the relay could not reach.

use std::collections::VecDeque;

use faultline_proto::v1::coordinator_client::CoordinatorClient;
use faultline_proto::v1::peer_check_client::PeerCheckClient;
use faultline_proto::v1::CheckReport;
use faultline_proto::v1::{forward_request as forward, ForwardReply, ForwardRequest as Forward};
use faultline_proto::MAX_MESSAGE_BYTES;
use parking_lot::Mutex;
use tonic::Status;
use tracing::debug;

use super::auth::CoordinatorAuth;
use super::check_protocol;
use crate::clock::{Clock, SystemClock};
use crate::peer::authz::{ForwardRate, MAX_FORWARDED_BYTES};
use crate::peer::client::{
    bearer, endpoint, timed, within, CallError, CALL_TIMEOUT, CONCLUDE_TIMEOUT,
};

/// Checks whose reports a relay remembers it may pass back (two per member reached through it,
/// per round, for dozens of members).
const RELAYED_CHECKS: usize = 256;

/// A check as one member sees it: run, round, member, partner.
type RelayedCheck = (String, u32, String, String);

/// The relay's state.
#[derive(Debug)]
pub(super) struct Relay {
    node: String,
    /// Forwards, rate-limited.
    forwards: Mutex<ForwardRate>,
    /// The checks (run, round, member, partner) whose assignment this agent passed on as a
    /// relay, the newest [`RELAYED_CHECKS`]: the only reports it passes back, once each.
    relayed: Mutex<VecDeque<RelayedCheck>>,
    /// The coordinator's report address as its last verified message named it: a relay passes
    /// members' reports there.
    coordinator_address: Mutex<Option<String>>,
}

impl Relay {
    /// The relay of the agent on `node`.
    pub(super) fn new(node: String) -> Relay {
        Relay {
            node,
            forwards: Mutex::new(ForwardRate::default()),
            relayed: Mutex::new(VecDeque::new()),
            coordinator_address: Mutex::new(None),
        }
    }

    /// Where the coordinator takes reports, as its last verified message named it.
    pub(super) fn remember_coordinator(&self, address: &str) {
        let mut a = self.coordinator_address.lock();
        if a.as_deref() != Some(address) {
            *a = Some(address.to_string());
        }
    }

    /// `Forward`: the coordinator's message (verified by `auth`) on to a member, or a member's
    /// report on to the coordinator; the member's answer.
    pub(super) async fn forward(
        &self,
        auth: &CoordinatorAuth,
        mut f: Forward,
    ) -> Result<ForwardReply, Status> {
        check_protocol(f.protocol)?;
        if !matches!(f.message, Some(forward::Message::Report(_))) {
            // The coordinator's message for another member: only in an envelope the coordinator
            // signed for this relay, to the member it names.
            auth.verify("Forward", &f).await?;
        }
        let msg = f
            .message
            .take()
            .ok_or_else(|| Status::invalid_argument("nothing to forward"))?;
        let small = !matches!(msg, forward::Message::Conclude(_));
        if small && msg.encoded_len() > MAX_FORWARDED_BYTES {
            return Err(auth.refused(
                "Forward",
                Status::invalid_argument(format!(
                    "{} bytes to forward, more than {}",
                    msg.encoded_len(),
                    MAX_FORWARDED_BYTES
                )),
            ));
        }
        match msg {
            forward::Message::Report(r) => self.pass_report(auth, r, &f.token).await,
            msg => self.pass_to_member(auth, f.to, msg).await,
        }
    }

    /// A member's report, to the coordinator as its own last message named it: the report's
    /// signature is its author's, checked by the coordinator; this relay cannot change it, and
    /// sends it nowhere else.
    async fn pass_report(
        &self,
        auth: &CoordinatorAuth,
        r: CheckReport,
        token: &str,
    ) -> Result<ForwardReply, Status> {
        // Only the report of a check whose assignment went through here (anyone may send a
        // report to be passed on: it is not this relay's to verify).
        let key = (r.run_id.clone(), r.round, r.node.clone(), r.partner.clone());
        if !self.relayed.lock().contains(&key) {
            return Err(auth.refused(
                "Forward",
                Status::permission_denied(format!(
                    "{} passed on no assignment of {} in run {} round {} with {}",
                    self.node, r.node, r.run_id, r.round, r.partner
                )),
            ));
        }
        self.take_forward(auth)?;
        let address = self.coordinator_address.lock().clone().ok_or_else(|| {
            Status::unavailable("this relay has had no message from the coordinator")
        })?;
        pass_report_on(&address, r, (!token.is_empty()).then_some(token))
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        self.relayed.lock().retain(|x| x != &key);
        Ok(ForwardReply::default())
    }

    /// One forward off the rate, or the refusal when it is spent.
    fn take_forward(&self, auth: &CoordinatorAuth) -> Result<(), Status> {
        if self.forwards.lock().take(SystemClock.instant()) {
            return Ok(());
        }
        Err(auth.refused(
            "Forward",
            Status::resource_exhausted("too many forwards; ask again later"),
        ))
    }

    /// The coordinator's message (verified) on to the member `to`; the member's answer.
    async fn pass_to_member(
        &self,
        auth: &CoordinatorAuth,
        to: Option<faultline_proto::v1::Member>,
        msg: forward::Message,
    ) -> Result<ForwardReply, Status> {
        self.take_forward(auth)?;
        let Some(to) = to else {
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
        Ok(pass_on(&to.address, msg)
            .await
            .unwrap_or_else(|why| ForwardReply {
                unreachable: why.to_string(),
                ..Default::default()
            }))
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
    within(CALL_TIMEOUT, |_| c.report(request)).await.map(drop)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;
    use std::time::Duration;

    use faultline_proto::auth::{
        node_key, CoordinatorKey, CoordinatorPublicKey, Key, Signed, Verifier,
    };
    use faultline_proto::v1::coordinator_server::Coordinator as CoordinatorRpc;
    use faultline_proto::v1::peer_check_server::PeerCheck;
    use faultline_proto::v1::{
        CheckAccepted, CheckAssignment, Member as WireMember, PingReply, PingRequest, ReportAck,
        RunConclusion, RunRequest, RunResult,
    };
    use faultline_proto::PROTOCOL;
    use tonic::{Request, Response};

    use super::super::test_fixtures::{
        assignment, conclusion, coordinator, node_signer, service, MASTER,
    };
    use super::*;
    use crate::peer::authz;
    use crate::peer::wire::{self, CoordinatorSigner};

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
    /// assignment it passed on (otherwise anyone could make every relay send junk reports,
    /// each a TokenReview); too large a message and too many forwards are refused. Nothing here
    /// reaches the network. On the paused clock, so the rate does not refill.
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
            .checks
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
