//! Watches of the agent's own objects (its Node, its fault ConfigMap), so that a change someone
//! else makes to what faultline owns is repaired in seconds rather than at the next resync.
//!
//! Each watch is pinned to one object by `fieldSelector=metadata.name=<name>` (kube-runtime's
//! `watch_object`): the API server sends only that object's changes, and RBAC sees the request
//! as naming it. A watch costs the API server no write. The watch is re-established with
//! backoff after errors; a re-list that no longer finds the object (deleted, or an API server
//! restored empty) reports it [`Seen::Absent`]. The sinks stay correct without these watches:
//! the periodic resync remains the backstop.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::watcher::watch_object;
use kube::runtime::WatchStreamExt;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

/// After a watched change, how long a sink waits for the object to settle before comparing it:
/// the agent's own multi-call passes (taints, then condition, then labels) produce intermediate
/// versions that are not drift.
pub const SETTLE: Duration = Duration::from_millis(300);

/// What the watch last saw of the object.
#[derive(Debug, Clone, Default)]
pub enum Seen<K> {
    /// Nothing yet (the first list has not answered).
    #[default]
    Unknown,
    /// The object does not exist.
    Absent,
    Present(Arc<K>),
}

/// Starts watching `name` through `api`; the receiver sees every change until `shutdown`.
pub fn watch_one<K>(
    api: Api<K>,
    name: &str,
    shutdown: CancellationToken,
) -> (watch::Receiver<Seen<K>>, tokio::task::JoinHandle<()>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (tx, rx) = watch::channel(Seen::Unknown);
    let what = name.to_string();
    let task = async move {
        let mut stream = watch_object(api, &what).default_backoff().boxed();
        let mut failing = false;
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                n = stream.next() => n,
            };
            match next {
                None => return,
                Some(Ok(obj)) => {
                    if failing {
                        info!(object = %what, "watching it again");
                        failing = false;
                    }
                    debug!(object = %what, present = obj.is_some(), "own object changed");
                    tx.send_replace(match obj {
                        Some(o) => Seen::Present(Arc::new(o)),
                        None => Seen::Absent,
                    });
                }
                Some(Err(e)) => {
                    // Logged once per outage; the watcher retries with backoff.
                    if !failing {
                        warn!(object = %what, error = %e, "watching an own object failed; the periodic resync still repairs it");
                        failing = true;
                    }
                }
            }
        }
    };
    let span = tracing::info_span!("watch", object = %name);
    (rx, tokio::spawn(task.instrument(span)))
}

/// Waits for the next change of a watch, then [`SETTLE`]; pending for ever once the watch is
/// gone, so it can sit in a `select!` beside other wake-ups.
pub async fn changed<K>(rx: &mut Option<watch::Receiver<Seen<K>>>) {
    let Some(r) = rx.as_mut() else {
        return std::future::pending().await;
    };
    if r.changed().await.is_err() {
        *rx = None;
        return std::future::pending().await;
    }
    tokio::time::sleep(SETTLE).await;
}
