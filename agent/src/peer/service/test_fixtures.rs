//! What the service's tests share: the coordinator "c0" that signs requests, the service of an
//! agent obeying it, an assignment and a conclusion for it.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use faultline_core::policy::PeerPolicy;
use faultline_proto::auth::{node_key, CoordinatorKey, Key};
use faultline_proto::v1::{CheckAssignment, Member as WireMember, RunConclusion};
use faultline_proto::PROTOCOL;
use tokio::sync::{mpsc, watch};

use super::{PeerService, ProbeSetup, ServiceSetup};
use crate::peer::authz::{CoordinatorId, WhoCoordinates};
use crate::peer::busy::NeverBusy;
use crate::peer::wire::{CoordinatorSigner, NodeCredential, Signer};
use crate::source::Input;

/// The master key of bare metal's node keys.
pub(super) const MASTER: &[u8] = b"the coordinator's master, 32 b..";

/// The coordinator "c0": its key, and its signer.
pub(super) fn coordinator() -> CoordinatorSigner {
    CoordinatorSigner {
        key: Arc::new(CoordinatorKey::generate().unwrap()),
        sender: "c0".into(),
    }
}

pub(super) fn known(c: &CoordinatorSigner) -> watch::Receiver<Option<CoordinatorId>> {
    watch::channel(Some(CoordinatorId {
        node: c.sender.clone(),
        address: Some("10.0.0.9:20262".into()),
        key: c.key.public_key(),
    }))
    .1
}

/// What a member holds: its node's own key (bare metal) and the requesters' secret.
pub(super) fn node_signer(node: &str) -> Signer {
    Signer {
        key: node_key(&Key::new(MASTER).unwrap(), node),
        sender: node.into(),
    }
}

/// The service of `me` in the net `<net>.*`, obeying `who`, running `probe`.
pub(super) fn service_on(
    me: &str,
    who: Arc<dyn WhoCoordinates>,
    probe: PathBuf,
    metrics: Arc<crate::metrics::Metrics>,
) -> (Arc<PeerService>, mpsc::Receiver<Input>) {
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
    (Arc::new(svc), rx)
}

/// n1, obeying `c`.
pub(super) fn service(c: &CoordinatorSigner) -> (Arc<PeerService>, mpsc::Receiver<Input>) {
    service_on(
        "n1",
        Arc::new(known(c)),
        "/nonexistent/faultline-probe".into(),
        Arc::new(crate::metrics::Metrics::new()),
    )
}

pub(super) fn assignment() -> CheckAssignment {
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

pub(super) fn conclusion(faulty: &str) -> RunConclusion {
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
