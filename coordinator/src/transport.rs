//! The coordinator's client of the agents (`runs::Transport` over gRPC): every message signed
//! with the coordinator's own key for the member it is for; one lazily connected channel per
//! agent address. A member the coordinator cannot reach is pinged, assigned, cancelled and
//! concluded through another (`Forward`): the inner message is still signed for its member, the
//! envelope for the relay.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::time::Duration;

use faultline_proto::v1::peer_check_client::PeerCheckClient;
use faultline_proto::v1::{forward_request as forward, ForwardRequest as Forward};
use faultline_proto::v1::{
    CheckAccepted, CheckAssignment, PingReply, PingRequest, Reached, RunConclusion,
};
use faultline_proto::{MAX_MESSAGE_BYTES, PROTOCOL};
use tonic::transport::Channel;

use crate::members::Member;
use crate::runs::{self as runs, Relayed, SendError};
use faultline_agent::peer::client::{
    endpoint, timed, within, CALL_TIMEOUT, CONCLUDE_TIMEOUT, FORWARD_TIMEOUT,
};
use faultline_agent::peer::wire::CoordinatorSigner;

/// How long a ping through a relay may take (the relay's own call within `CALL_TIMEOUT`).
pub const RELAY_TIMEOUT: Duration = Duration::from_secs(6);
/// Pings one relay passes on at once (more members to reach wait their turn).
pub const MAX_REACH: usize = 16;

/// A member as the wire names it.
pub fn wire_member(m: &Member) -> faultline_proto::v1::Member {
    faultline_proto::v1::Member {
        node: m.node.clone(),
        address: m.address.clone(),
        topology: m.topology.clone().unwrap_or_default(),
    }
}

/// The coordinator's client.
#[derive(Debug)]
pub struct GrpcTransport {
    signer: CoordinatorSigner,
    channels: Mutex<BTreeMap<String, Channel>>,
}

impl GrpcTransport {
    pub fn new(signer: CoordinatorSigner) -> GrpcTransport {
        GrpcTransport {
            signer,
            channels: Mutex::new(BTreeMap::new()),
        }
    }

    fn client(&self, to: &Member) -> Result<PeerCheckClient<Channel>, SendError> {
        let mut map = self.channels.lock();
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

    fn ping_for(&self, to: &Member) -> PingRequest {
        self.signer.sign(
            PingRequest {
                auth: None,
                protocol: PROTOCOL,
            },
            &to.node,
        )
    }

    /// Whether `to` answers a ping passed on by `via`; `None` when `via` could not be asked
    /// (then it says nothing about `to`).
    async fn ping_through(&self, via: &Member, to: &Member) -> Option<Reached> {
        let message = forward::Message::Ping(self.ping_for(to));
        let reply = self.through(via, to, message, RELAY_TIMEOUT).await.ok()?;
        Some(Reached {
            node: to.node.clone(),
            answered: reply.ping.is_some() && reply.unreachable.is_empty(),
            error: reply.unreachable,
        })
    }

    /// `message` (signed for `to`) through `via`, in an envelope signed for `via`.
    async fn through(
        &self,
        via: &Member,
        to: &Member,
        message: forward::Message,
        timeout: Duration,
    ) -> Result<faultline_proto::v1::ForwardReply, SendError> {
        let envelope = self.signer.sign(
            Forward {
                auth: None,
                protocol: PROTOCOL,
                to: Some(wire_member(to)),
                token: String::new(),
                message: Some(message),
            },
            &via.node,
        );
        let mut c = self.client(via)?;
        Ok(within(timeout, |t| c.forward(timed(envelope, t))).await?)
    }
}

#[async_trait::async_trait]
impl runs::Transport for GrpcTransport {
    async fn ping(&self, to: &Member) -> Result<PingReply, SendError> {
        let msg = self.ping_for(to);
        let mut c = self.client(to)?;
        Ok(within(CALL_TIMEOUT, |t| c.ping(timed(msg, t))).await?)
    }

    async fn reach(&self, via: &Member, targets: &[Member]) -> Result<Vec<Reached>, SendError> {
        use futures::StreamExt;
        let pings: Vec<_> = targets
            .iter()
            .map(|to| self.ping_through(via, to))
            .collect();
        let answers: Vec<Option<Reached>> = futures::stream::iter(pings)
            .buffered(MAX_REACH)
            .collect()
            .await;
        Ok(answers.into_iter().flatten().collect())
    }

    async fn assign(&self, to: &Member, a: CheckAssignment) -> Result<CheckAccepted, SendError> {
        let msg = self.signer.sign(a, &to.node);
        let mut c = self.client(to)?;
        Ok(within(CALL_TIMEOUT, |t| c.assign(timed(msg, t))).await?)
    }

    async fn cancel(&self, to: &Member, mut a: CheckAssignment) {
        a.cancel = true;
        let msg = self.signer.sign(a, &to.node);
        if let Ok(mut c) = self.client(to) {
            let _ = within(CALL_TIMEOUT, |t| c.cancel(timed(msg, t))).await;
        }
    }

    async fn conclude(&self, to: &Member, c: RunConclusion) -> Result<(), SendError> {
        let msg = self.signer.sign(c, &to.node);
        let mut client = self.client(to)?;
        within(CONCLUDE_TIMEOUT, |t| client.conclude(timed(msg, t))).await?;
        Ok(())
    }

    async fn forward(
        &self,
        via: &Member,
        to: &Member,
        msg: Relayed,
    ) -> Result<CheckAccepted, SendError> {
        let message = match msg {
            Relayed::Assign(a) => forward::Message::Assign(self.signer.sign(a, &to.node)),
            Relayed::Cancel(mut a) => {
                a.cancel = true;
                forward::Message::Cancel(self.signer.sign(a, &to.node))
            }
            Relayed::Conclude(c) => forward::Message::Conclude(self.signer.sign(c, &to.node)),
        };
        let concluding = matches!(message, forward::Message::Conclude(_));
        let reply = self.through(via, to, message, FORWARD_TIMEOUT).await?;
        if !reply.unreachable.is_empty() {
            return Err(SendError::NotRelayed {
                to: to.node.clone(),
                via: via.node.clone(),
                why: reply.unreachable,
            });
        }
        match (reply.accepted, concluding) {
            (Some(a), _) => Ok(a),
            (None, true) => Ok(CheckAccepted {
                accepted: true,
                reason: String::new(),
            }),
            (None, false) => Err(SendError::NoAnswer {
                via: via.node.clone(),
                to: to.node.clone(),
            }),
        }
    }
}
