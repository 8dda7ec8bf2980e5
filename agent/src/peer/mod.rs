//! Peer-paired collective checks, the agent's side: the coordinator (`faultline_coordinator`, a
//! process of its own) assigns this agent checks with its partners; the agent runs its probe,
//! reports, relays for members the coordinator cannot reach, and records the verdicts about its
//! own node.
//!
//! - `service`: the gRPC service every agent serves (`PeerCheck`): its handlers, and in its
//!   own modules whether a request is the coordinator's (`auth`), running an assigned check
//!   (`checks`) and passing messages on for others (`relay`);
//! - `authz`: whose requests it takes (the coordinator's key) and within which bounds;
//! - `client`: the gRPC client helpers agents and the coordinator share (`endpoint`, `within`,
//!   `CallError`, the call timeouts);
//! - `runner`: the probe as a child process with a hard deadline; `busy`: whether the GPUs run
//!   work;
//! - `wire`: the credentials (this node's, the coordinator's), verdicts on the wire.
//!
//! - `lease`: the Lease as agents read it (its holder: the active coordinator and its key).
//!
//! [`Peer`] wires the service into the agent on its own port.

pub mod authz;
pub mod busy;
pub mod client;
pub mod lease;
pub mod members;
pub mod runner;
pub(crate) mod service;
pub mod wire;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use faultline_proto::v1::peer_check_server::PeerCheckServer;
use faultline_proto::MAX_MESSAGE_BYTES;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use busy::Busy;
use service::{PeerService, ProbeSetup, ServiceSetup};

use crate::component::{Component, Context, Handle, StartError};
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
/// Checks one agent runs at once (a node is in at most two per round); each is one probe, so
/// the agent container's memory limit is derived from it (docs/kubernetes.md, "Memory").
pub const MAX_CONCURRENT_CHECKS: usize = 4;

/// Default address of the peer-check service.
pub(crate) const DEFAULT_LISTEN: &str = "0.0.0.0:20261";

/// The peer-check service's flags (in Kubernetes the node's credential is its service-account
/// token: `--node-token-file`).
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Peer checks without Kubernetes: this node's own key (`faultline keys node`); its reports
    /// are signed with it, and no other node holds it.
    #[arg(long, env = "FAULTLINE_PEER_NODE_KEY_FILE")]
    pub(crate) peer_node_key_file: Option<PathBuf>,
    /// Peer checks without Kubernetes: the coordinator's public key (`faultline keys
    /// coordinator` prints it). Only messages it signed assign checks or conclude runs here.
    /// (Its text may begin with `-`: it is taken as the value.)
    #[arg(
        long,
        env = "FAULTLINE_PEER_COORDINATOR_KEY",
        allow_hyphen_values = true
    )]
    pub(crate) peer_coordinator_key: Option<String>,
    /// Peer checks: where this agent's gRPC service listens.
    #[arg(long, env = "FAULTLINE_PEER_LISTEN", default_value = DEFAULT_LISTEN)]
    pub(crate) peer_listen: SocketAddr,
    /// The `faultline-probe` binary. Default: next to this binary, else on PATH.
    #[arg(long, env = "FAULTLINE_PROBE")]
    pub(crate) probe_bin: Option<PathBuf>,
    /// First of the 32 ports the probes listen on during checks.
    #[arg(long, env = "FAULTLINE_PROBE_PORT_BASE", default_value_t = 20270)]
    pub(crate) probe_port_base: u16,
}

/// The peer-check service, as the daemon starts it.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) flags: Flags,
    /// Kubernetes: the service-account token the coordinator knows this node by.
    pub(crate) node_token_file: Option<PathBuf>,
    /// Kubernetes: the namespace of the coordinator's Lease.
    pub(crate) namespace: String,
    /// Whether the GPUs run work (a check waits for them to be idle).
    pub(crate) busy: Arc<dyn Busy>,
}

impl Component for Peer {
    const NAME: &'static str = "peer";

    /// Starts nothing (and says why) when this node has no credential or does not know the
    /// coordinator's.
    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        Ok(match self.setup(cx).await? {
            Some((setup, listener)) => Handle::of(start(setup, listener, cx.shutdown.clone())),
            None => Handle::none(),
        })
    }
}

impl Peer {
    /// The service's setup and its bound listener, or `None` when this agent cannot take part
    /// (said why).
    async fn setup(
        self,
        cx: &Context,
    ) -> Result<Option<(ServiceSetup, tokio::net::TcpListener)>, StartError> {
        let (coordinator, credential): (Arc<dyn authz::WhoCoordinates>, wire::NodeCredential) =
            match &cx.kube {
                Some(client) => {
                    let Some(token) = self.node_token_file else {
                        info!("peer checks disabled (no --node-token-file: the service-account token the coordinator knows this node by)");
                        return Ok(None);
                    };
                    let holder = authz::LeaseHolder::new(client.calls.clone(), self.namespace);
                    (Arc::new(holder), wire::NodeCredential::Token(token))
                }
                None => match (&self.flags.peer_node_key_file, &self.flags.peer_coordinator_key)
                {
                    (Some(key), Some(public)) => {
                        let public = public.parse().map_err(|e| StartError::Key {
                            what: "--peer-coordinator-key is not the coordinator's public key",
                            source: Box::new(e),
                        })?;
                        let key = wire::load_node_key(key).map_err(|e| StartError::Key {
                            what: "--peer-node-key-file cannot be used",
                            source: Box::new(e),
                        })?;
                        (
                            Arc::new(authz::fixed(public)),
                            wire::NodeCredential::Key(key),
                        )
                    }
                    (None, None) => {
                        info!("peer checks disabled (without Kubernetes they need --peer-node-key-file and --peer-coordinator-key)");
                        return Ok(None);
                    }
                    _ => return Err(StartError::Flags(
                        "peer checks without Kubernetes need both --peer-node-key-file and --peer-coordinator-key",
                    )),
                },
            };
        let addr = self.flags.peer_listen;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Listen { addr, source })?;
        let probe = ProbeSetup {
            bin: probe_bin(self.flags.probe_bin.as_deref()),
            gpu: cx.policy.borrow().policy.peer.gpu,
        };
        info!(listen = %addr, probe = %probe.bin.display(), "peer checks enabled");
        let base = self.flags.probe_port_base;
        let setup = ServiceSetup {
            node: cx.node.clone(),
            coordinator,
            credential,
            probe,
            busy: self.busy,
            inputs: cx.inputs.clone(),
            policy: follow_policy(cx.policy.clone(), cx.shutdown.clone()),
            probe_ports: base..base.saturating_add(PROBE_PORTS),
            metrics: cx.metrics.clone(),
        };
        Ok(Some((setup, listener)))
    }
}

/// The probe binary: the flag, else `faultline-probe` next to this binary, else on PATH.
fn probe_bin(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    let sibling = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("faultline-probe")))
        .filter(|p| p.exists());
    sibling.unwrap_or_else(|| PathBuf::from("faultline-probe"))
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

/// Starts the service on `listener`; returns its task.
fn start(
    setup: ServiceSetup,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let address = listener.local_addr().ok();
    let incoming = crate::listen::incoming(
        listener,
        crate::listen::PEER_LIMITS,
        setup.metrics.clone(),
        "peer",
    );
    let svc = PeerService::new(setup);
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
const DRAIN: Duration = Duration::from_secs(2);

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
    f: impl FnMut() -> Fut,
) -> Result<T, E>
where
    Fut: std::future::Future<Output = Result<T, E>>,
{
    use backon::{ConstantBuilder, Retryable};
    let retries = usize::try_from(attempts.saturating_sub(1)).unwrap_or(usize::MAX);
    f.retry(
        ConstantBuilder::new()
            .with_delay(pause)
            .with_max_times(retries),
    )
    .sleep(tokio::time::sleep)
    .when(again)
    .await
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
