//! The agent's own Node, read from the Kubernetes API: its labels feed the other sources (today:
//! the expected GPU count from `nvidia.com/gpu.count`, set by GPU feature discovery).
//!
//! Only in Kubernetes mode. The agent reads its own Node and nothing else; a failed read is
//! logged and retried, and never stops detection.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::component::{Component, Context, Handle, StartError};

/// The label GPU feature discovery puts on GPU nodes.
pub(crate) const GPU_COUNT_LABEL: &str = "nvidia.com/gpu.count";

/// What the node's labels say of the expected GPU count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GpuCountLabel {
    /// The Node has not been read yet (Kubernetes mode, just started, or the API slow): no
    /// expectation can be judged, so a GPU_MISSING restored from state is neither ended nor
    /// raised again until it is read.
    Unread,
    /// The label's count; `None` when the node has no (usable) label, and always standalone.
    Read(Option<u32>),
}

/// The expected GPU count a node's labels state, if any.
pub(crate) fn gpu_count(labels: &BTreeMap<String, String>) -> Option<u32> {
    labels
        .get(GPU_COUNT_LABEL)
        .and_then(|v| v.trim().parse().ok())
}

/// The source that reads this node's GPU-count label, as the daemon starts it.
#[derive(Debug)]
pub(crate) struct GpuCountWatch(watch::Sender<GpuCountLabel>);

impl GpuCountWatch {
    /// The source and the channel it publishes on: `Unread` until the first read in Kubernetes
    /// mode; standalone there is no label to wait for.
    pub(crate) fn new(kubernetes: bool) -> (Self, watch::Receiver<GpuCountLabel>) {
        let first = if kubernetes {
            GpuCountLabel::Unread
        } else {
            GpuCountLabel::Read(None)
        };
        let (tx, rx) = watch::channel(first);
        (GpuCountWatch(tx), rx)
    }
}

impl Component for GpuCountWatch {
    const NAME: &'static str = "node";

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        let Some(kube) = &cx.kube else {
            return Ok(Handle::none());
        };
        let every = Duration::from_secs(60);
        let w = watch_gpu_count(
            kube.calls.clone(),
            cx.node.clone(),
            self.0,
            every,
            cx.shutdown.clone(),
        );
        Ok(Handle::watched(Self::NAME, &[], cx, w))
    }
}

/// Reads the node's labels every `every` and publishes the GPU count they state.
pub(crate) async fn watch_gpu_count(
    client: Client,
    node: String,
    tx: watch::Sender<GpuCountLabel>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let nodes: Api<Node> = Api::all(client);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        match nodes.get(&node).await {
            Ok(n) => {
                if std::mem::take(&mut failing) {
                    info!(node = %node, "reading the node works again");
                }
                let count = GpuCountLabel::Read(n.metadata.labels.as_ref().and_then(gpu_count));
                debug!(node = %node, count = ?count, "node labels read");
                tx.send_if_modified(|cur| {
                    let changed = *cur != count;
                    *cur = count;
                    changed
                });
            }
            Err(e) => {
                if !std::mem::replace(&mut failing, true) {
                    warn!(node = %node, error = %e, "cannot read this node from the API; keeping the last known labels");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_count_label() {
        let mut l = BTreeMap::new();
        assert_eq!(gpu_count(&l), None);
        l.insert(GPU_COUNT_LABEL.to_string(), "8".to_string());
        assert_eq!(gpu_count(&l), Some(8));
        l.insert(GPU_COUNT_LABEL.to_string(), "eight".to_string());
        assert_eq!(gpu_count(&l), None, "a bad label is ignored, not a crash");
    }
}
