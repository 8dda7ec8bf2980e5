//! Peer-paired collective checks, the agent's side: the coordinator (`faultline_coordinator`, a
//! process of its own) assigns this agent checks with its partners; the agent runs its probe,
//! reports, relays for members the coordinator cannot reach, and records the verdicts about its
//! own node.
//!
//! - `service`: the gRPC service every agent serves (`PeerCheck`);
//! - `authz`: whose requests it takes (the coordinator's key) and within which bounds;
//! - `runner`: the probe as a child process with a hard deadline; `busy`: whether the GPUs run
//!   work;
//! - `wire`: the credentials (this node's, the coordinator's), verdicts on the wire.
//!
//! - `lease`: the Lease as agents read it (its holder: the active coordinator and its key).
//!
//! [`start`] wires the service into the agent on its own port.

pub mod authz;
pub mod busy;
pub mod lease;
pub mod members;
pub mod runner;
pub mod service;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use faultline_proto::v1::peer_check_server::PeerCheckServer;
use faultline_proto::MAX_MESSAGE_BYTES;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use service::{Busy, PeerHandle, PeerService, ProbeSetup};

use crate::source::Input;
use faultline_core::policy::LoadedPolicy;
use faultline_core::policy::PeerPolicy;

/// The probe ports an agent serves from its `probe_port_base`: the coordinator assigns each
/// round's checks ports from them (`coordinator::runs`).
pub const PROBE_PORTS: u16 = 32;
/// Requests signed longer ago than this are refused.
pub const MAX_SKEW: Duration = Duration::from_secs(30);
/// No request is served longer than this (a `Run` lasts its rounds; every other RPC bounds
/// its own work to seconds). A client's shorter `grpc-timeout` is honoured.
pub const MAX_REQUEST: Duration = Duration::from_secs(15 * 60);

/// Everything the peer-check part of the agent needs.
#[derive(Debug)]
pub struct PeerSetup {
    pub node: String,
    pub listener: tokio::net::TcpListener,
    pub probe: ProbeSetup,
    pub probe_port_base: u16,
    pub busy: Arc<dyn Busy>,
    /// Who coordinates and with which key.
    pub coordinator: Arc<dyn authz::WhoCoordinates>,
    /// This node's own credential, for its reports.
    pub credential: wire::NodeCredential,
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

/// Starts the service; returns its task.
pub fn start(s: PeerSetup) -> Vec<tokio::task::JoinHandle<()>> {
    let policy = follow_policy(s.policy, s.shutdown.clone());
    let svc = PeerHandle(Arc::new(PeerService::new(service::ServiceSetup {
        node: s.node,
        coordinator: s.coordinator,
        credential: s.credential,
        probe: s.probe,
        busy: s.busy,
        inputs: s.inputs,
        policy,
        probe_ports: s.probe_port_base..s.probe_port_base.saturating_add(PROBE_PORTS),
        metrics: s.metrics.clone(),
    })));
    let shutdown = s.shutdown.clone();
    let address = s.listener.local_addr().ok();
    let incoming = crate::listen::incoming(
        s.listener,
        crate::listen::PEER_LIMITS,
        s.metrics.clone(),
        "peer",
    );
    // A server-wide request timeout; a few concurrent requests per connection, and HTTP/2
    // keep-alive so a peer that vanished is noticed; the listener caps connections (in all and
    // per address), their idle time and age (`listen::PEER_LIMITS`).
    let server = tonic::transport::Server::builder()
        .timeout(MAX_REQUEST)
        .concurrency_limit_per_connection(16)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        .add_service(
            PeerCheckServer::new(svc)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    info!(address = ?address, "peer-check service listening");
    vec![tokio::spawn(
        async move {
            if let Err(e) = drained(server, shutdown).await {
                warn!(error = %e, "peer-check service stopped");
            }
        }
        .instrument(tracing::info_span!("source", name = "peer")),
    )]
}

/// How long a server, once shut down, waits for its connections to end: a peer that keeps its
/// connection open (the coordinator's channels stay connected between runs) must not hold the
/// agent's exit.
pub const DRAIN: Duration = Duration::from_secs(2);

/// Runs `server` (which stops taking requests at `shutdown`) until it ends, or [`DRAIN`] after
/// `shutdown`: what is still open then is dropped.
pub async fn drained<E>(
    server: impl std::future::Future<Output = Result<(), E>>,
    shutdown: CancellationToken,
) -> Result<(), E> {
    tokio::select! {
        r = server => r,
        _ = async { shutdown.cancelled().await; tokio::time::sleep(DRAIN).await } => {
            tracing::debug!("connections still open {DRAIN:?} after the shutdown; closed");
            Ok(())
        }
    }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
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
