//! The Event sink: new faults, escalations, recoveries and withheld taints become Events on
//! the Node (namespace `default`, where Kubernetes keeps Events about cluster-scoped objects),
//! published through kube-runtime's `Recorder`, which turns repeats into one Event with a count.
//!
//! Notices wait in a bounded queue while the API is unreachable and go out in order when it
//! answers again; only when more than [`QUEUE`] pile up are the oldest dropped (and counted).
//!
//! Events are budgeted by a token bucket ([`WriteBudget::per_minute`]): [`BURST`] back to back,
//! then [`RATE_PER_MINUTE`] a minute (`--kube-event-burst`, `--kube-event-rate`). The token is
//! taken when a notice arrives; a notice that finds the bucket empty gets no Event (counted in
//! `faultline_kube_events_rate_limited_total`, logged at most once a minute) and never holds the
//! sink up. So an outage defers Events but adds none: what goes out after it was admitted
//! during it. The record and the node's condition still say everything.
//!
//! What kube-runtime's `Recorder` (5.0, `events.rs`) does and does not do, relied on here: it
//! keys an Event by type, reason, action, reporting controller and instance, and the regarding
//! and related objects; a repeat of a key within 6 minutes becomes a merge PATCH of the same
//! Event's `series` (count, lastObservedTime), and its note is not sent (the first note stays).
//! That bounds the Event *objects* a repeating fault leaves in etcd, but every publish is
//! still one API write (a POST or a PATCH): the Recorder has no rate limit, so the bucket here
//! is what bounds the write rate.

pub(crate) mod plan;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::Client;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{retry, KubeSinkConfig};
use crate::clock::Clock;
use crate::metrics::{Metrics, SinkLabel};
use crate::rate_limit::{LogPacer, WriteBudget};
use plan::{EventSpec, Notice};

/// Most notices held while the API is unreachable.
pub(crate) const QUEUE: usize = 1024;
/// Events a minute once the burst is spent (`--kube-event-rate`).
pub(crate) const RATE_PER_MINUTE: u32 = 30;
/// Events that may go out back to back (`--kube-event-burst`): one incident's new faults on a
/// few devices, and their escalations.
pub(crate) const BURST: u32 = 10;
/// How often at most the sink logs that Events were left out for the budget.
const DROP_LOG_EVERY: Duration = Duration::from_secs(60);

/// The Event budget: a token bucket, and the paced log of what it turned away.
#[derive(Debug)]
struct EventBudget {
    bucket: WriteBudget,
    refusals: LogPacer,
}

impl EventBudget {
    fn new(cfg: &KubeSinkConfig, now: Instant) -> Self {
        EventBudget {
            bucket: WriteBudget::per_minute(cfg.event_rate, cfg.event_burst, now),
            refusals: LogPacer::new(DROP_LOG_EVERY),
        }
    }

    /// Whether the Event may be published; counts and (at most once a minute) logs a refusal.
    fn admit(&mut self, ev: &EventSpec, metrics: &Metrics, now: Instant) -> bool {
        // A withheld taint is announced once per change of the withheld list (the node sink
        // sends it only then) and always after the incident's fault notices: it never waits
        // for tokens the incident spent, or it would be lost for good.
        if ev.reason == plan::TAINT_WITHHELD_REASON {
            return true;
        }
        if self.bucket.try_spend(now) {
            return true;
        }
        metrics.events_rate_limited.inc();
        if let Some((since, total)) = self.refusals.note(1, now) {
            warn!(
                refused = since.times,
                refused_total = total.times,
                reason = ev.reason,
                action = %ev.action,
                "Event budget spent; Events left out (the record and the node condition still carry every fault)"
            );
        }
        false
    }
}

/// The reporting controller named in every Event.
pub(crate) const CONTROLLER: &str = "faultline-agent";

/// Runs until the notice channel closes (the agent is stopping), then flushes for a moment.
pub(crate) async fn run(
    client: Client,
    cfg: KubeSinkConfig,
    mut notices: mpsc::Receiver<Notice>,
    node: Store<Node>,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: CONTROLLER.to_string(),
            instance: Some(cfg.instance.clone().unwrap_or_else(|| cfg.node.clone())),
        },
    );
    let mut reference = ObjectReference {
        api_version: Some("v1".to_string()),
        kind: Some("Node".to_string()),
        name: Some(cfg.node.clone()),
        ..Default::default()
    };
    let label = SinkLabel { sink: "event" };
    let mut queue: VecDeque<EventSpec> = VecDeque::new();
    let mut budget = EventBudget::new(&cfg, clock.instant());
    let mut retry = retry();
    let mut wake: Option<Instant> = None;
    let mut batch = Vec::new();
    loop {
        tokio::select! {
            n = notices.recv_many(&mut batch, QUEUE) => {
                if n == 0 {
                    break; // the agent is stopping
                }
                for n in batch.drain(..) {
                    enqueue(&mut queue, &mut budget, &n, &metrics, clock.instant());
                }
                if wake.is_some() {
                    continue; // backing off: keep collecting
                }
            }
            () = crate::sink::sleep_until(wake) => wake = None,
            () = shutdown.cancelled(), if wake.is_some() => break,
        }
        // The uid ties the Event to this incarnation of the Node, taken from the node sink's
        // store of it, so an incident costs no read of it; best effort: none before the
        // watch's first answer.
        if let Some(n) = node.get(&ObjectRef::new(&cfg.node)) {
            reference.uid.clone_from(&n.metadata.uid);
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
                    wake = Some(clock.instant() + delay);
                    break;
                }
            }
        }
    }
    // Stopping: a last, bounded flush.
    let deadline = clock.instant() + Duration::from_secs(2);
    while let Some(ev) = queue.front() {
        match tokio::time::timeout_at(deadline, publish(&recorder, &reference, ev)).await {
            Ok(Ok(())) => {
                queue.pop_front();
            }
            _ => break,
        }
    }
}

/// Queues the notice's Event if it gets one and the budget admits it.
fn enqueue(
    queue: &mut VecDeque<EventSpec>,
    budget: &mut EventBudget,
    n: &Notice,
    metrics: &Metrics,
    now: Instant,
) {
    let Some(ev) = plan::event_for(n) else {
        return;
    };
    if !budget.admit(&ev, metrics, now) {
        return;
    }
    if queue.len() >= QUEUE {
        queue.pop_front();
        metrics.events_dropped.inc();
    }
    queue.push_back(ev);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;
    use faultline_core::engine::EngineEvent;
    use faultline_core::record::Handling;
    use faultline_kube_emulator::Emulator;
    use serde_json::json;

    /// A flood of notices (new faults on many devices, and one fault raised again and again)
    /// makes at most the bucket's burst of Event writes; the rest are counted, and the sink
    /// neither blocks nor queues them.
    #[tokio::test]
    async fn a_flood_of_notices_makes_at_most_the_buckets_event_writes() {
        let emu = Emulator::start().await.unwrap();
        emu.put(faultline_kube_emulator::node("n1", &[]));
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}));
        let (client, _dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        // 5 at once, then one a minute: nothing refills within the test.
        let cfg = KubeSinkConfig {
            event_burst: 5,
            event_rate: 1,
            ..KubeSinkConfig::new("n1")
        };
        let metrics = Arc::new(Metrics::new());
        let (tx, rx) = mpsc::channel(QUEUE);
        let task = tokio::spawn(run(
            client,
            cfg,
            rx,
            kube::runtime::reflector::store().0,
            metrics.clone(),
            Arc::new(crate::clock::SystemClock),
            CancellationToken::new(),
        ));
        let new_fault = |code: String, device: &str| {
            Notice::Engine(EngineEvent::NewFault {
                code,
                device: device.to_string(),
                handling: Handling::SeparateNPU,
                message: "flood".into(),
            })
        };
        let started = Instant::now();
        for i in 0..100 {
            tx.send(new_fault(format!("Xid{i}"), "GPU-0"))
                .await
                .unwrap();
            // The same fault raised again: the Recorder's series, one PATCH each.
            tx.send(new_fault("Xid79".into(), "GPU-1")).await.unwrap();
        }
        // The incident's withheld taint comes last, after the bucket is spent: it is announced
        // once per change of the withheld list, so it never waits for tokens.
        tx.send(Notice::TaintWithheld {
            taints: vec!["faultline.io/unhealthy=Xid79:NoSchedule".into()],
            used: 1,
            limit: 1,
            nodes: 3,
        })
        .await
        .unwrap();
        let event_writes = || {
            emu.calls()
                .iter()
                .filter(|c| c.is_write() && c.path.contains("/events"))
                .count()
        };
        while event_writes() < 6 && started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Time for anything more to go out.
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(tx);
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the sink stops")
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(60), "no refill");
        // 5 of the 200 fault notices, and the withheld taint's (all 195 refusals are faults').
        assert_eq!(event_writes(), 6, "{:#?}", emu.calls());
        assert_eq!(metrics.events_rate_limited.get(), 195);
        assert_eq!(metrics.events_dropped.get(), 0, "no queue overflow");
    }

    /// An Event names the Node's uid (this incarnation of the Node) from the watch of the own
    /// Node, so announcing a new fault reads nothing: in an incident a read per failing node
    /// would count against the API server.
    #[tokio::test]
    async fn an_event_takes_the_nodes_uid_from_the_watch_and_reads_nothing() {
        let emu = Emulator::start().await.unwrap();
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}));
        let (client, _dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        let mut node = Node::default();
        node.metadata.name = Some("n1".into());
        node.metadata.uid = Some("uid-of-n1".into());
        let (own, mut writer) = kube::runtime::reflector::store();
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(node));
        let (tx, rx) = mpsc::channel(QUEUE);
        let task = tokio::spawn(run(
            client,
            KubeSinkConfig::new("n1"),
            rx,
            own,
            Arc::new(Metrics::new()),
            Arc::new(crate::clock::SystemClock),
            CancellationToken::new(),
        ));
        tx.send(Notice::Engine(EngineEvent::NewFault {
            code: "Xid79".into(),
            device: "GPU-0".into(),
            handling: Handling::SeparateNPU,
            message: "fell off the bus".into(),
        }))
        .await
        .unwrap();
        drop(tx);
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the sink stops")
            .unwrap();
        let events = emu.list("events.k8s.io", "events", Some("default"));
        assert_eq!(events.len(), 1, "{events:#?}");
        assert_eq!(events[0]["regarding"]["uid"], "uid-of-n1");
        let calls = emu.calls();
        assert!(
            calls.iter().all(|c| !c.path.contains("/nodes")),
            "no read of the Node: {calls:#?}"
        );
    }
}
