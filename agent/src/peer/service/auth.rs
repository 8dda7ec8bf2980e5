//! Whether a request is the coordinator's, as every handler of the service asks first: signed
//! with the key `authz::WhoCoordinates` names now (asked again once when the key known does not
//! verify: a new replica may have just taken the Lease), addressed to this node, fresh, and
//! with a nonce not seen before under that key. No agent holds the coordinator's key, so no
//! member can speak as the coordinator. The agent keeps one nonce memory per coordinator key,
//! for the newest `KEYS_REMEMBERED` (the Lease may move from one replica to the other and back
//! within the time a request stays valid). Anything else is refused (`UNAUTHENTICATED`;
//! `UNAVAILABLE` while the key cannot be told) and changes nothing; refusals are logged at most
//! once per `REFUSAL_LOG_EVERY`, with the count, so that a flood of them is one line.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use faultline_proto::auth::{AuthError, CoordinatorPublicKey, Signed, Verifier};
use parking_lot::Mutex;
use tonic::Status;
use tracing::warn;

use crate::clock::{Clock, SystemClock};
use crate::peer::authz::{CoordinatorId, WhoCoordinates};
use crate::peer::{wire, MAX_SKEW};
use crate::rate_limit::LogPacer;

/// How long the service waits to learn the coordinator's key (an answer must fit in the
/// coordinator's `CALL_TIMEOUT`).
const AUTHZ_TIMEOUT: Duration = Duration::from_millis(1500);
/// At most one log line per this interval about refused requests (with the count).
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// Coordinator keys whose nonce memory an agent keeps: the Lease may move from one replica to
/// the other and back within the time a request stays valid.
const KEYS_REMEMBERED: usize = 4;

/// Verifies requests as the coordinator's: its key as [`WhoCoordinates`] names it now, and one
/// nonce memory per key (the newest [`KEYS_REMEMBERED`]); logs refusals at a bounded rate.
#[derive(Debug)]
pub(super) struct CoordinatorAuth {
    who: Arc<dyn WhoCoordinates>,
    /// This node: the receiver every request must name.
    me: String,
    verifiers: Mutex<VecDeque<(CoordinatorPublicKey, Verifier)>>,
    refusals: Mutex<LogPacer>,
}

/// Why a request is not the coordinator's.
enum NotCoordinator {
    /// Its signature, receiver, time or nonce (`UNAUTHENTICATED`).
    Refused(String),
    /// The coordinator's key cannot be told now (`UNAVAILABLE`).
    Unknown(String),
}

impl CoordinatorAuth {
    /// Requests for `me`, from the coordinator `who` names.
    pub(super) fn new(who: Arc<dyn WhoCoordinates>, me: String) -> CoordinatorAuth {
        CoordinatorAuth {
            who,
            me,
            verifiers: Mutex::new(VecDeque::new()),
            refusals: Mutex::new(LogPacer::new(REFUSAL_LOG_EVERY)),
        }
    }

    /// Verifies a request as the coordinator's; its authenticated sender.
    pub(super) async fn verify<M: Signed>(&self, rpc: &str, msg: &M) -> Result<String, Status> {
        match self.coordinator(msg).await {
            Ok(_) => Ok(msg.auth().map(|a| a.sender.clone()).unwrap_or_default()),
            Err(NotCoordinator::Refused(why)) => Err(self.refused(
                rpc,
                Status::unauthenticated(format!("{rpc} refused: not the coordinator's ({why})")),
            )),
            Err(NotCoordinator::Unknown(why)) => Err(self.refused(rpc, Status::unavailable(why))),
        }
    }

    /// Logs a refusal (at most one line per `REFUSAL_LOG_EVERY`, with the count since the
    /// last line) and returns it.
    pub(super) fn refused(&self, rpc: &str, s: Status) -> Status {
        let due = self.refusals.lock().note(1, SystemClock.instant());
        if let Some((since, total)) = due {
            warn!(rpc, code = ?s.code(), reason = s.message(), refused_since_last_line = since.times, refused_total = total.times, "peer request refused");
        }
        s
    }

    /// The coordinator, when `msg` is its: signed with its key (asked again once when the key
    /// known does not verify: a new replica may have just taken the Lease).
    async fn coordinator<M: Signed>(&self, msg: &M) -> Result<CoordinatorId, NotCoordinator> {
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
                let i = v.iter().position(|(k, _)| *k == id.key).unwrap_or_else(|| {
                    if v.len() >= KEYS_REMEMBERED {
                        v.pop_front();
                    }
                    v.push_back((id.key, Verifier::new(id.key, MAX_SKEW, &self.me)));
                    v.len() - 1
                });
                v[i].1.verify(msg, wire::now_ms())
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

    use faultline_proto::auth::{CoordinatorKey, Key, NONCE_BYTES};
    use faultline_proto::v1::peer_check_server::PeerCheck;
    use faultline_proto::v1::PingRequest;
    use faultline_proto::PROTOCOL;
    use tokio::sync::watch;
    use tonic::Request;

    use super::super::test_fixtures::{
        assignment, conclusion, coordinator, known, node_signer, service, service_on, MASTER,
    };
    use super::*;
    use crate::peer::wire::{CoordinatorSigner, Signer};
    use crate::source::Input;

    const REQUESTER: &[u8] = b"requester secret, not the agents";

    /// How many observations reached the engine since the last look.
    fn recorded(inputs: &mut tokio::sync::mpsc::Receiver<Input>) -> usize {
        std::iter::from_fn(|| inputs.try_recv().ok()).count()
    }

    /// No member can act as the coordinator. A member holds its own node's key, a
    /// requester's secret and an Ed25519 key of its own making, and signs the coordinator's
    /// messages with each, under the coordinator's name: `Conclude` (taken, it would make a
    /// healthy node Degraded), `Assign` (four taken would fill the node's check slots so that the
    /// real checks are refused), `Cancel` and `Ping`. Every one is refused (`UNAUTHENTICATED`), nothing is
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
        assert!(svc.checks.running.lock().is_empty(), "no slot taken");
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

    /// The Lease moves to another replica (its key in the holder identity): the new
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

    /// A Conclude the coordinator signed for one agent, replayed verbatim to a second, is
    /// refused although each agent keeps its own nonces: requests name their receiver:
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
        assert!(n2.checks.running.lock().is_empty(), "nothing started");
    }

    /// A Conclude signed 25 s ahead of the agent's clock is refused (`UNAUTHENTICATED`,
    /// "ahead") and nothing is recorded; one signed 0.5 s ahead (within `auth::MAX_AHEAD`) is
    /// taken.
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
}
