//! Sinks: make the world match the engine's latest snapshot, idempotently and only on change.
//!
//! Every sink reads the snapshot `watch` channel, so a slow or failing sink only ever sees the
//! newest state (older ones are coalesced away) and never slows the engine.

pub mod file;
pub mod kube;
pub(crate) mod publicfault;

use std::time::Duration;

use crate::component::{Component, Context, Handle, StartError};

/// The public-fault output as the daemon starts it: in Kubernetes mode only (ClusterD reads
/// ConfigMaps), whatever the policy says then, since the policy may turn it on later.
#[derive(Debug)]
pub(crate) struct PublicFaults {
    /// The outbox's directory: durable state, since after a reboot the faults the reboot ended
    /// must still be retracted (ClusterD clears a public fault only on `recover`).
    pub data_dir: std::path::PathBuf,
    /// How long after start a retraction waits (`--settle`).
    pub settle: Duration,
}

impl Component for PublicFaults {
    const NAME: &'static str = "publicfault";

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        let Some(clients) = &cx.kube else {
            return Ok(Handle::none());
        };
        let sink = publicfault::PublicFaultSink {
            node: cx.node.clone(),
            dir: self.data_dir,
            settle: self.settle,
            publisher: kube::publicfault::PublicFaultPublisher::new(
                clients.calls.clone(),
                &cx.node,
            ),
            snapshots: cx.snapshots.clone(),
            policy: cx.policy.clone(),
            clock: cx.clock.clone(),
            metrics: cx.metrics.clone(),
            shutdown: cx.shutdown.clone(),
        };
        Ok(Handle::spawn(Self::NAME, sink.run()))
    }
}

/// What ended a sink's wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Woke {
    /// A new snapshot, or `wake` passed.
    Snapshot,
    /// The policy changed.
    Policy,
    /// Shutdown, or the engine or the policy watcher is gone: the sink ends.
    Stop,
}

/// The wait of a sink that follows both the snapshots and the policy (the public faults):
/// until a new snapshot, `wake` (`None`: no deadline), a policy change or shutdown.
pub(crate) async fn next_input<T, P>(
    shutdown: &tokio_util::sync::CancellationToken,
    snapshots: &mut tokio::sync::watch::Receiver<T>,
    policy: &mut tokio::sync::watch::Receiver<P>,
    wake: Option<tokio::time::Instant>,
) -> Woke {
    tokio::select! {
        _ = shutdown.cancelled() => Woke::Stop,
        more = changed_or_woken(snapshots, wake) => {
            if more { Woke::Snapshot } else { Woke::Stop }
        }
        changed = policy.changed() => {
            if changed.is_ok() { Woke::Policy } else { Woke::Stop }
        }
    }
}

/// Waits until the snapshot changes (true) or `wake` passes (true); false when the engine is
/// gone. `None`: no deadline.
pub(crate) async fn changed_or_woken<T>(
    snapshots: &mut tokio::sync::watch::Receiver<T>,
    wake: Option<tokio::time::Instant>,
) -> bool {
    tokio::select! {
        changed = snapshots.changed() => changed.is_ok(),
        () = sleep_until(wake) => true,
    }
}

/// Sleeps until `wake`; forever when `None`.
pub(crate) async fn sleep_until(wake: Option<tokio::time::Instant>) {
    match wake {
        Some(w) => tokio::time::sleep_until(w).await,
        None => std::future::pending().await,
    }
}
