//! Sinks: make the world match the engine's latest snapshot, idempotently and only on change.
//!
//! Every sink reads the snapshot `watch` channel, so a slow or failing sink only ever sees the
//! newest state (older ones are coalesced away) and never slows the engine.

pub mod file;
pub mod kube;
pub mod mindcluster;
pub mod publicfault;

/// What ended a sink's wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woke {
    /// A new snapshot, or `wake` passed.
    Snapshot,
    /// The policy changed.
    Policy,
    /// Shutdown, or the engine or the policy watcher is gone: the sink ends.
    Stop,
}

/// The wait of a sink that follows both the snapshots and the policy (the MindCluster outputs):
/// until a new snapshot, `wake` (`None`: no deadline), a policy change or shutdown.
pub async fn next_input<T, P>(
    shutdown: &tokio_util::sync::CancellationToken,
    snapshots: &mut tokio::sync::watch::Receiver<T>,
    policy: &mut tokio::sync::watch::Receiver<P>,
    wake: Option<tokio::time::Instant>,
) -> Woke {
    tokio::select! {
        _ = shutdown.cancelled() => Woke::Stop,
        more = kube::changed_or_woken(snapshots, wake) => {
            if more { Woke::Snapshot } else { Woke::Stop }
        }
        changed = policy.changed() => {
            if changed.is_ok() { Woke::Policy } else { Woke::Stop }
        }
    }
}
