//! Kubernetes sinks: make the agent's own Node and its fault ConfigMap match the engine's
//! latest snapshot, and announce changes as Events.
//!
//! Three tasks, each reading the newest snapshot (or notices) and writing only on change:
//! - [`node`]: the `faultline.io/health` label (server-side apply), `faultline.io/*` taints
//!   (read-modify-write with the resourceVersion; a new hard taint first asks the coordinator,
//!   which keeps the cluster's taint [`budget`]) and the
//!   `AcceleratorHealthy` condition (strategic merge patch of the status);
//! - [`configmap`]: `faultline-<node>` holding `faults.json` (server-side apply); a change of
//!   counts and last-seen times alone waits for its write budget (one per
//!   `--kube-write-interval`, the newest count at the end of it), any other change goes at once;
//! - [`events`]: Events on the Node through kube-runtime's `Recorder`, under a token bucket
//!   (`--kube-event-burst`, then `--kube-event-rate` a minute).
//!
//! The Node and the ConfigMap are also watched by name through kube-runtime (the node sink is a
//! `Controller` of its one Node; the ConfigMap sink follows `watch_object`), so that a deletion
//! or an overwrite by someone else is repaired within seconds ([`own`]: what the two share); the
//! periodic resync is the backstop.
//!
//! What to write is decided by pure functions beside each sink (`node::plan`,
//! `configmap::plan`, `events::plan`). Every API call they make is
//! listed in [`calls`]. An API error never reaches the engine or the local file: the sink logs,
//! counts, backs off and tries again with whatever is newest then.

pub(crate) mod budget;
pub mod calls;
pub(crate) mod configmap;
pub(crate) mod events;
pub(crate) mod node;
pub(crate) mod own;
pub(crate) mod publicfault;

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::backoff::Backoff;
use crate::component::{Component, Context, FlagError, Handle, StartError};
use crate::engine_loop::SinkReport;
use faultline_core::engine::EngineEvent;

use crate::kube_client::DEFAULT_NAMESPACE;
/// The field manager of every write (server-side apply ownership, `managedFields`).
pub(crate) use crate::kube_client::FIELD_MANAGER;

/// Where the coordinator's Service listens (`manifests/base/coordinator.yaml`): the taint budget
/// is asked there unless `--coordinator` says otherwise. A fully qualified name in the default
/// cluster domain, with its final dot: a shorter name goes through the pod's DNS search list,
/// whose first tries (`...svc.<namespace>.svc.cluster.local`, `...svc.svc.cluster.local`)
/// could be answered by a Service in a namespace someone else controls, and the agent's token
/// would go there. Another cluster domain: set `--coordinator`.
pub(crate) fn coordinator_service(namespace: &str) -> String {
    format!("faultline-coordinator.{namespace}.svc.cluster.local.:20262")
}
/// The fault ConfigMap's default write budget for changes of counts and last-seen times alone
/// (`--kube-write-interval`): a fault repeating all day costs the API server one write of the
/// record every 10 s at most.
pub(crate) const DEFAULT_WRITE_INTERVAL: Duration = Duration::from_secs(10);

/// Settings of the Kubernetes sinks.
#[derive(Debug, Clone)]
pub(crate) struct KubeSinkConfig {
    pub node: String,
    /// Where the fault ConfigMap lives.
    pub namespace: String,
    /// The reporting instance of Events (the pod name); defaults to the node name.
    pub instance: Option<String>,
    /// After start, changes that make the node look healthier wait this long, so a restarted
    /// agent that lost its state re-detects standing faults before it untaints anything.
    pub settle: Duration,
    /// How often the node is re-read to repair drift when nothing changed (a read, no write).
    pub resync: Duration,
    /// How often a withheld taint asks the budget again.
    pub budget_recheck: Duration,
    /// The agent's projected service-account token (`--node-token-file`): what the
    /// coordinator knows this node by when it asks the taint budget.
    pub node_token_file: Option<std::path::PathBuf>,
    /// Where the taint budget is asked (`host:port`): the coordinator's Service.
    pub coordinator: String,
    /// The fault ConfigMap's write budget: a change of counts and last-seen times alone is
    /// written at most once per this interval ([`configmap::plan::when_to_write`]); `ZERO` writes every
    /// change at once.
    pub write_interval: Duration,
    /// The Event sink's token bucket: Events a minute once `event_burst` are spent.
    pub event_rate: u32,
    pub event_burst: u32,
}

impl KubeSinkConfig {
    pub(crate) fn new(node: impl Into<String>) -> Self {
        KubeSinkConfig {
            node: node.into(),
            namespace: DEFAULT_NAMESPACE.to_string(),
            instance: None,
            settle: Duration::from_secs(30),
            resync: Duration::from_secs(300),
            budget_recheck: Duration::from_secs(15),
            node_token_file: None,
            coordinator: coordinator_service(DEFAULT_NAMESPACE),
            write_interval: DEFAULT_WRITE_INTERVAL,
            event_rate: events::RATE_PER_MINUTE,
            event_burst: events::BURST,
        }
    }
}

/// The Kubernetes sinks' flags.
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Kubernetes: after start, changes that make the node look healthier wait this long (so a
    /// restarted agent re-detects standing faults before it untaints anything).
    #[arg(long, env = "FAULTLINE_SETTLE", default_value = "30s", value_parser = humantime::parse_duration)]
    pub settle: Duration,
    /// Kubernetes: how often a withheld taint asks the taint budget again.
    #[arg(long, env = "FAULTLINE_BUDGET_RECHECK", default_value = "15s", value_parser = humantime::parse_duration, hide = true)]
    pub budget_recheck: Duration,
    /// Kubernetes: how often the node is re-read to repair drift.
    #[arg(long, env = "FAULTLINE_RESYNC", default_value = "5m", value_parser = humantime::parse_duration, hide = true)]
    pub resync: Duration,
    /// Kubernetes: a change of the fault ConfigMap that only moves counts and last-seen times
    /// (a fault repeating) is written at most once per this interval, the newest count at the
    /// end of it; a change of health, handling or the set of faults is written at once.
    /// `0s` writes every change at once; at most 10m.
    #[arg(long, env = "FAULTLINE_KUBE_WRITE_INTERVAL", default_value = "10s", value_parser = parse_kube_write_interval)]
    pub kube_write_interval: Duration,
    /// Kubernetes: Events published per minute once the burst is spent (a token bucket);
    /// notices over the budget get no Event (counted in
    /// `faultline_kube_events_rate_limited_total`).
    #[arg(long, env = "FAULTLINE_KUBE_EVENT_RATE", default_value_t = events::RATE_PER_MINUTE,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub kube_event_rate: u32,
    /// Kubernetes: Events that may be published back to back (the token bucket's size).
    #[arg(long, env = "FAULTLINE_KUBE_EVENT_BURST", default_value_t = events::BURST,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub kube_event_burst: u32,
    /// Kubernetes: where the taint budget is asked (`host:port`), the coordinator's Service.
    /// Default: `faultline-coordinator.<namespace>.svc.cluster.local.:20262`; set it in a
    /// cluster whose domain is not `cluster.local`. (`faultline check --coordinator` reads the
    /// same variable.)
    #[arg(long, env = "FAULTLINE_COORDINATOR")]
    pub coordinator: Option<String>,
}

/// `--kube-write-interval`: counts held back longer than 10 minutes would make the ConfigMap
/// useless to a scheduler reading it (and an absurd value would overflow the clock).
fn parse_kube_write_interval(s: &str) -> Result<Duration, FlagError> {
    let d = humantime::parse_duration(s)?;
    if d > Duration::from_secs(600) {
        let max = "10m";
        return Err(FlagError::TooLong {
            value: s.into(),
            max,
        });
    }
    Ok(d)
}

impl Flags {
    /// The sinks' settings for this node, known to Kubernetes as `identity` says.
    pub(crate) fn config(
        &self,
        node: &str,
        identity: &crate::kube_client::Flags,
    ) -> KubeSinkConfig {
        KubeSinkConfig {
            namespace: identity.namespace.clone(),
            instance: identity.pod_name.clone(),
            settle: self.settle,
            budget_recheck: self.budget_recheck,
            node_token_file: identity.node_token_file.clone(),
            coordinator: self
                .coordinator
                .clone()
                .unwrap_or_else(|| coordinator_service(&identity.namespace)),
            resync: self.resync,
            write_interval: self.kube_write_interval,
            event_rate: self.kube_event_rate,
            event_burst: self.kube_event_burst,
            ..KubeSinkConfig::new(node)
        }
    }
}

/// The Kubernetes sinks (the Node, the fault ConfigMap, Events), as the daemon starts them.
#[derive(Debug)]
pub(crate) struct KubeSinks {
    pub config: KubeSinkConfig,
    pub events: mpsc::Receiver<EngineEvent>,
    /// Where the node sink reports a withheld taint (shown in the record).
    pub report: watch::Sender<SinkReport>,
}

impl Component for KubeSinks {
    const NAME: &'static str = "kube";

    /// Starts the three sinks (nothing without Kubernetes). They stop when the snapshot
    /// channel closes (the engine stopped), after a last attempt bounded by a few seconds.
    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        let Some(clients) = cx.kube.clone() else {
            return Ok(Handle::none());
        };
        let cfg = self.config;
        if cfg.node_token_file.is_none() {
            tracing::warn!("no --node-token-file: the coordinator cannot know this node, so it is labelled when unhealthy but never newly tainted");
        }
        let (notice_tx, notice_rx) = mpsc::channel(events::QUEUE);
        let forward = {
            let tx = notice_tx.clone();
            let mut rx = self.events;
            let metrics = cx.metrics.clone();
            async move {
                while let Some(e) = rx.recv().await {
                    if tx.try_send(events::plan::Notice::Engine(e)).is_err() {
                        metrics.events_dropped.inc();
                    }
                }
            }
        };
        let client = clients.calls;
        let budget = budget::Budget::new(&cfg.node, &cfg.coordinator, cfg.node_token_file.clone());
        let node_sink = node::NodeSink::new(
            client.clone(),
            cfg.clone(),
            budget,
            notice_tx,
            self.report,
            cx.metrics.clone(),
            cx.clock.clone(),
        );
        let node_controller = node::controller(
            kube::Api::all(clients.watch.clone()),
            kube::Api::all(client.clone()),
            &cfg.node,
            cx.clock.clone(),
        );
        let node_store = node_controller.store();
        let node_task = node_sink.run(node_controller, cx.snapshots.clone());
        let cm_task = configmap::run(
            client.clone(),
            kube::Api::namespaced(clients.watch, &cfg.namespace),
            cfg.clone(),
            cx.snapshots.clone(),
            cx.metrics.clone(),
            cx.clock.clone(),
        );
        let ev_task = events::run(
            client,
            cfg,
            notice_rx,
            node_store,
            cx.metrics.clone(),
            cx.clock.clone(),
            cx.shutdown.clone(),
        );
        Ok(Handle::of(vec![
            tokio::spawn(forward),
            tokio::spawn(node_task.instrument(tracing::info_span!("sink", name = "node"))),
            tokio::spawn(cm_task.instrument(tracing::info_span!("sink", name = "configmap"))),
            tokio::spawn(ev_task.instrument(tracing::info_span!("sink", name = "events"))),
        ]))
    }
}

/// Errors of the Kubernetes sinks (all retried).
#[derive(Debug, thiserror::Error)]
pub(crate) enum KubeSinkError {
    #[error("{what}: {source}")]
    Api {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("the taint budget cannot answer: {0}")]
    Budget(String),
    #[error("cannot encode {what}: {source}")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// Wraps an API error with what was being done.
pub(crate) fn api(what: &'static str) -> impl FnOnce(kube::Error) -> KubeSinkError {
    move |source| KubeSinkError::Api { what, source }
}

/// Whether an API error is a 409 Conflict (stale resourceVersion, or the object exists).
pub(crate) fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// The ceiling of the sinks' delay between failed attempts.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(30);

/// The delays between a sink's failed attempts: 200 ms doubling, at most [`RETRY_MAX`], with
/// jitter (at the ceiling they spread over 15-30 s: a DaemonSet whose API failed for all nodes
/// at once does not retry in step).
pub(crate) fn retry() -> Backoff {
    Backoff::new(Duration::from_millis(200), RETRY_MAX)
}

/// A client of the agent on node `node` against an API emulator (unit tests here and in the
/// coordinator crate, through the `test-support` feature); the
/// directory holds its kubeconfig.
#[cfg(any(test, feature = "test-support"))]
pub async fn emulator_client(
    emu: &faultline_kube_emulator::Emulator,
    node: &str,
) -> (kube::Client, tempfile::TempDir) {
    #![allow(clippy::unwrap_used)]
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig, "t").unwrap();
    let client = crate::kube_client::client(
        Some(&kubeconfig),
        crate::kube_client::Sender::Agent { node },
    )
    .await
    .unwrap();
    (client, dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The taint budget is asked at the coordinator's Service (manifests/base/coordinator.yaml:
    /// `faultline-coordinator`, port 20262, checked by the manifests tests) under its fully
    /// qualified name, so the pod's DNS search list never tries another namespace's name first;
    /// the daemon's default follows its namespace.
    #[test]
    fn the_budget_is_asked_at_the_services_fully_qualified_name() {
        assert_eq!(
            coordinator_service("faultline-system"),
            "faultline-coordinator.faultline-system.svc.cluster.local.:20262"
        );
        assert_eq!(
            KubeSinkConfig::new("n1").coordinator,
            coordinator_service(DEFAULT_NAMESPACE)
        );
        assert!(crate::peer::client::endpoint(&coordinator_service("ops")).is_ok());
    }

    /// The backoff starts at 200 ms (up to twice that with jitter), reaches its ceiling and
    /// never passes 30 s, jitter included; a reset starts over.
    #[test]
    fn retry_delays_stay_within_200ms_and_30s() {
        let mut r = retry();
        let first = r.next_delay();
        assert!(
            (Duration::from_millis(200)..=Duration::from_millis(400)).contains(&first),
            "{first:?}"
        );
        let delays: Vec<Duration> = (0..200).map(|_| r.next_delay()).collect();
        assert!(delays.iter().all(|d| *d <= RETRY_MAX), "{delays:?}");
        // At the ceiling (the last 100) the delays still spread: nodes do not retry in step.
        let late = &delays[100..];
        assert!(
            late.iter().all(|d| *d >= RETRY_MAX / 2),
            "the ceiling is reached: {late:?}"
        );
        let (lo, hi) = (late.iter().min().unwrap(), late.iter().max().unwrap());
        assert!(
            *hi - *lo > Duration::from_secs(5),
            "jitter kept at the ceiling: {lo:?}..{hi:?}"
        );
        r.reset();
        assert!(r.next_delay() <= Duration::from_millis(400));
    }
}
