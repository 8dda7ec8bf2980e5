//! The Event sink: new faults, escalations, recoveries and withheld taints become Events on
//! the Node (namespace `default`, where Kubernetes keeps Events about cluster-scoped objects),
//! published through kube-runtime's `Recorder`, which turns repeats into one Event with a count.
//!
//! Notices wait in a bounded queue while the API is unreachable and go out in order when it
//! answers again; only when more than [`QUEUE`] pile up are the oldest dropped (and counted).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::plan::{self, EventSpec, Notice};
use super::{KubeSinkConfig, Retry};
use crate::metrics::{Metrics, SinkLabel};

/// Most notices held while the API is unreachable.
pub const QUEUE: usize = 1024;
/// The reporting controller named in every Event.
pub const CONTROLLER: &str = "faultline-agent";

/// Runs until the notice channel closes (the agent is stopping), then flushes for a moment.
pub async fn run(
    client: Client,
    cfg: KubeSinkConfig,
    mut notices: mpsc::Receiver<Notice>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: CONTROLLER.to_string(),
            instance: Some(cfg.instance.clone().unwrap_or_else(|| cfg.node.clone())),
        },
    );
    let nodes: Api<Node> = Api::all(client);
    let mut reference = ObjectReference {
        api_version: Some("v1".to_string()),
        kind: Some("Node".to_string()),
        name: Some(cfg.node.clone()),
        ..Default::default()
    };
    let label = SinkLabel { sink: "event" };
    let mut queue: VecDeque<EventSpec> = VecDeque::new();
    let mut retry = Retry::new();
    let mut wake: Option<Instant> = None;
    let mut open = true;
    while open || !queue.is_empty() {
        if !open {
            // Stopping: a last, bounded flush.
            let deadline = Instant::now() + Duration::from_secs(2);
            while let Some(ev) = queue.front() {
                match tokio::time::timeout_at(deadline, publish(&recorder, &reference, ev)).await {
                    Ok(Ok(())) => {
                        queue.pop_front();
                    }
                    _ => break,
                }
            }
            break;
        }
        let sleep = async {
            match wake {
                Some(w) => tokio::time::sleep_until(w).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            n = notices.recv() => match n {
                Some(n) => {
                    if let Some(ev) = plan::event_for(&n) {
                        if queue.len() >= QUEUE {
                            queue.pop_front();
                            metrics.events_dropped.inc();
                        }
                        queue.push_back(ev);
                    }
                    while let Ok(n) = notices.try_recv() {
                        if let Some(ev) = plan::event_for(&n) {
                            if queue.len() >= QUEUE {
                                queue.pop_front();
                                metrics.events_dropped.inc();
                            }
                            queue.push_back(ev);
                        }
                    }
                    if wake.is_some() {
                        continue; // backing off: keep collecting
                    }
                }
                None => { open = false; continue; }
            },
            _ = sleep => { wake = None; }
            _ = shutdown.cancelled(), if wake.is_some() => { open = false; continue; }
        }
        if reference.uid.is_none() {
            // The uid ties the Event to this incarnation of the Node; best effort.
            if let Ok(n) = nodes.get_metadata(&cfg.node).await {
                reference.uid = n.metadata.uid;
            }
        }
        while let Some(ev) = queue.front() {
            match publish(&recorder, &reference, ev).await {
                Ok(()) => {
                    metrics.sink_writes.get_or_create(&label).inc();
                    debug!(reason = ev.reason, action = %ev.action, "event published");
                    queue.pop_front();
                    retry.reset();
                }
                Err(e) => {
                    metrics.sink_errors.get_or_create(&label).inc();
                    let delay = retry.next_delay();
                    warn!(error = %e, queued = queue.len(), retry_in_ms = delay.as_millis() as u64, "publishing an Event failed; it stays queued");
                    wake = Some(Instant::now() + delay);
                    break;
                }
            }
        }
    }
}

async fn publish(
    recorder: &Recorder,
    reference: &ObjectReference,
    ev: &EventSpec,
) -> Result<(), kube::Error> {
    recorder
        .publish(
            &Event {
                type_: if ev.warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: ev.reason.to_string(),
                note: Some(ev.note.clone()),
                action: ev.action.clone(),
                secondary: None,
            },
            reference,
        )
        .await
}
