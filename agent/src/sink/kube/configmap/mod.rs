//! The fault ConfigMap sink: `faultline-<node>` in the agent's namespace holds the record as
//! `faults.json`, with the labels docs/kubernetes.md lists ("What the agent publishes"), for
//! schedulers and job scripts.
//!
//! Written by server-side apply (one call creates or updates it) and only when the content
//! changed: `updateTime` alone is not a change. A change of counts and last-seen times alone (a
//! fault repeating) waits for the sink's write budget, one such write per
//! `--kube-write-interval` (default 10 s), and then carries the newest counts; any other change
//! (health, handling, a fault new, escalated or recovered) is written at once
//! ([`plan::when_to_write`]). A record of up to 1 MiB is otherwise sent for every repeat of an
//! Xid storm, back to back, on every node it hits. On start the sink reads the ConfigMap back and
//! adopts it when it already says the same; while the agent settles, a record that differs only
//! in detectors that have not reported yet (their states are not restored) is not written.
//! The record is cut to fit Kubernetes' 1 MiB limit ([`plan::fit_record`]).

pub(crate) mod plan;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher::watch_object;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::own::{DriftPacer, OwnVersions, WATCH_WARN_EVERY};
use super::{api, KubeSinkConfig, KubeSinkError, FIELD_MANAGER};
use crate::clock::Clock;
use crate::engine_loop::Snapshot;
use crate::metrics::{Metrics, SinkLabel};
use crate::rate_limit::LogPacer;
use faultline_core::record::NodeRecord;
use plan::{CountsPacer, RecordKeys, WriteWhen, CONFIGMAP_LIMIT, RECORD_KEY};

/// The fault ConfigMap's name for a node.
pub(crate) fn name(node: &str) -> String {
    format!("faultline-{node}")
}

/// Runs until the snapshot channel closes, then makes one last bounded attempt. `watched`: where
/// the ConfigMap is watched by name (kube-runtime's `watch_object`): when someone else deletes
/// or rewrites it, the sink writes it again at once.
pub(crate) async fn run(
    client: Client,
    watched: Api<ConfigMap>,
    cfg: KubeSinkConfig,
    mut snapshots: watch::Receiver<Option<Snapshot>>,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
) {
    let cms: Api<ConfigMap> = Api::namespaced(client, &cfg.namespace);
    let name = name(&cfg.node);
    let label = SinkLabel { sink: "configmap" };
    let mut own = watch_object(watched, &name).default_backoff().boxed();
    let started = clock.instant();
    let mut versions = OwnVersions::default();
    let (mut written, adopted_base) = match adopt(&cms, &cfg.node, &mut versions).await {
        Some((keys, base)) => (Some(keys), Some(base)),
        None => (None, None),
    };
    let adopted = written.clone();
    let mut retry = super::retry();
    // When a failed write is tried again (a content change does not wait for it).
    let mut retry_at: Option<Instant> = None;
    // The keys of the attempt that failed, while its retry is pending.
    let mut failed: Option<RecordKeys> = None;
    // Writes of counters alone: one per interval, an interval after any write.
    let mut counts = CountsPacer::new(cfg.write_interval, started);
    let mut wake: Option<Instant> = None;
    let mut pacer = DriftPacer::default();
    let mut watch_warnings = LogPacer::new(WATCH_WARN_EVERY);
    // What the watch reported since the last turn, if anything.
    let mut seen: Option<Option<ConfigMap>> = None;
    // A repair the pacer put off: counted when it is written.
    let mut repair = false;
    loop {
        let now = clock.instant();
        let woke_by_own = seen.is_some();
        if let Some(cm) = seen.take() {
            let echo = cm
                .as_ref()
                .is_some_and(|cm| versions.ours(cm.metadata.resource_version.as_deref()));
            let there = on_server(cm.as_ref(), &cfg.node);
            if !echo && there != written {
                // What the server holds is what is compared from now on.
                repair |= written.is_some();
                written = there;
            }
        }
        let paced = if repair && woke_by_own {
            pacer.ask(clock.since_boot()).err()
        } else {
            None
        };
        // A change of the watched ConfigMap alone does not cut a retry backoff short, and a
        // repair that keeps being undone waits its turn; a drift is repaired without waiting
        // for the counts' budget.
        let backing_off = woke_by_own && retry_at.is_some_and(|r| now < r);
        let snap = snapshots.borrow_and_update().clone();
        match (snap, paced) {
            (_, Some(at)) => {
                debug!("the fault ConfigMap was changed again; pacing the repair");
                wake = Some(now + at.saturating_sub(clock.since_boot()));
            }
            // Just restarted, nothing written since adopting the ConfigMap, and the record
            // differs from it only in detectors that have not reported yet: wait for them
            // (at most the settle time) instead of writing twice.
            (Some(snap), None)
                if now < started + cfg.settle
                    && written.is_some()
                    && written == adopted
                    && adopted_base.as_deref()
                        == Some(plan::content_key_without_detectors(&snap.record).as_str()) =>
            {
                wake = Some(started + cfg.settle);
            }
            (Some(snap), None) if !backing_off => match Prepared::of(&snap.record) {
                // Cannot happen with a record (plain data); nothing to retry.
                Err(e) => {
                    warn!(error = %e, "the record cannot be encoded for the fault ConfigMap");
                    wake = None;
                }
                Ok(prepared) => {
                    let change = plan::record_change(written.as_ref(), &prepared.keys);
                    let since_failed = failed
                        .as_ref()
                        .map(|f| plan::record_change(Some(f), &prepared.keys));
                    match counts.decide(change, since_failed, now, retry_at) {
                        WriteWhen::Skip => {
                            repair = false;
                            retry_at = None;
                            wake = None;
                        }
                        WriteWhen::After(wait) => {
                            debug!(
                                wait_ms = wait.as_millis() as u64,
                                "only counts changed; the write waits for the write budget"
                            );
                            wake = Some(now + wait);
                        }
                        WriteWhen::Now => {
                            match apply(&cms, &cfg, &name, &prepared, &snap.record).await {
                                Ok(rv) => {
                                    metrics.sink_writes.get_or_create(&label).inc();
                                    if repair {
                                        info!("the fault ConfigMap had been changed or deleted by someone else; written again");
                                        metrics.drift_repairs.get_or_create(&label).inc();
                                        repair = false;
                                    }
                                    versions.note(rv.as_deref());
                                    counts.written(change, clock.instant());
                                    written = Some(prepared.keys);
                                    failed = None;
                                    retry.reset();
                                    retry_at = None;
                                    wake = None;
                                }
                                Err(e) => {
                                    metrics.sink_errors.get_or_create(&label).inc();
                                    let delay = retry.next_delay();
                                    warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "writing the fault ConfigMap failed; detection goes on");
                                    let at = clock.instant() + delay;
                                    failed = Some(prepared.keys);
                                    retry_at = Some(at);
                                    wake = Some(at);
                                }
                            }
                        }
                    }
                }
            },
            _ => {}
        }
        tokio::select! {
            going = crate::sink::changed_or_woken(&mut snapshots, wake) => if !going { break },
            Some(event) = own.next() => match event {
                Ok(cm) => seen = Some(cm),
                Err(e) => {
                    if let Some((since, _)) = watch_warnings.note(1, clock.instant()) {
                        warn!(error = %e, failures = since.times, "watching the fault ConfigMap failed; a change someone else makes to it is repaired at the sink's next write");
                    }
                }
            },
        }
    }
    // Stopping: the newest record, whatever the write budget says (one bounded attempt), so
    // that a count held back for the budget is not lost.
    let last = snapshots.borrow().clone();
    if let Some(snap) = last {
        if let Ok(p) = Prepared::of(&snap.record) {
            if plan::record_change(written.as_ref(), &p.keys) != plan::RecordChange::Same {
                let _ = tokio::time::timeout(
                    Duration::from_secs(3),
                    apply(&cms, &cfg, &name, &p, &snap.record),
                )
                .await;
            }
        }
    }
}

/// What the watch says the server holds: `None` when the ConfigMap is gone, holds no readable
/// record or lacks its labels (the taint budget counts nodes by them), else the record's keys.
fn on_server(cm: Option<&ConfigMap>, node: &str) -> Option<RecordKeys> {
    let cm = cm?;
    let record = record_in(cm).ok()?;
    let have = cm.metadata.labels.as_ref();
    plan::configmap_labels(node, record.health)
        .iter()
        .all(|(k, v)| have.and_then(|l| l.get(k)) == Some(v))
        .then(|| RecordKeys::of(&record))
}

/// Why the record could not be read back from the fault ConfigMap.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadBackError {
    #[error("cannot read the fault ConfigMap: {0}")]
    Api(#[source] kube::Error),
    #[error("the fault ConfigMap holds no readable record: {0}")]
    Unreadable(String),
}

/// This node's record as its fault ConfigMap holds it; `Ok(None)` when there is no ConfigMap.
/// The content is untrusted: it must parse as a record and be about `node`.
pub(crate) async fn read_back(
    cms: &Api<ConfigMap>,
    node: &str,
) -> Result<Option<NodeRecord>, ReadBackError> {
    Ok(read_own(cms, node).await?.map(|(record, _)| record))
}

/// [`read_back`], with the resourceVersion of the ConfigMap it was read from.
async fn read_own(
    cms: &Api<ConfigMap>,
    node: &str,
) -> Result<Option<(NodeRecord, Option<String>)>, ReadBackError> {
    let Some(cm) = cms.get_opt(&name(node)).await.map_err(ReadBackError::Api)? else {
        return Ok(None);
    };
    let record = record_in(&cm)?;
    if record.node != node {
        return Err(ReadBackError::Unreadable(format!(
            "it is about node {:?}, not {node:?}",
            record.node
        )));
    }
    Ok(Some((record, cm.metadata.resource_version)))
}

/// The record a fault ConfigMap holds under [`RECORD_KEY`].
fn record_in(cm: &ConfigMap) -> Result<NodeRecord, ReadBackError> {
    let text = cm
        .data
        .as_ref()
        .and_then(|d| d.get(RECORD_KEY))
        .ok_or_else(|| ReadBackError::Unreadable(format!("no {RECORD_KEY} key")))?;
    serde_json::from_str(text).map_err(|e| ReadBackError::Unreadable(e.to_string()))
}

/// The keys of the ConfigMap as it is, and its content key without the detectors' states, if
/// it exists and holds a readable record.
async fn adopt(
    cms: &Api<ConfigMap>,
    node: &str,
    versions: &mut OwnVersions,
) -> Option<(RecordKeys, String)> {
    match read_own(cms, node).await {
        Ok(Some((r, version))) => {
            info!(health = %r.health, faults = r.faults.len(), "fault ConfigMap found; adopting it");
            // The watch's first event may be this version, arriving after the sink's first
            // write: read by the sink itself, it is not drift.
            versions.note(version.as_deref());
            Some((RecordKeys::of(&r), plan::content_key_without_detectors(&r)))
        }
        Ok(None) => None,
        Err(e @ ReadBackError::Unreadable(_)) => {
            warn!(error = %e, "the fault ConfigMap will be rewritten");
            None
        }
        Err(e) => {
            warn!(error = %e, "the fault ConfigMap will be written when the API answers");
            None
        }
    }
}

/// The record as it goes into the ConfigMap: cut to fit ([`plan::fit_record`]), as text, and
/// the keys it is compared by.
struct Prepared {
    text: String,
    fitted: NodeRecord,
    keys: RecordKeys,
}

impl Prepared {
    fn of(record: &NodeRecord) -> Result<Prepared, KubeSinkError> {
        let (text, fitted) =
            plan::fit_record(record, CONFIGMAP_LIMIT - RECORD_KEY.len()).map_err(|source| {
                KubeSinkError::Encode {
                    what: "the record",
                    source,
                }
            })?;
        let keys = RecordKeys::of(&fitted);
        Ok(Prepared { text, fitted, keys })
    }
}

/// Writes the prepared record (`record` is the whole one, before it was cut to fit); returns
/// the written object's resourceVersion.
async fn apply(
    cms: &Api<ConfigMap>,
    cfg: &KubeSinkConfig,
    name: &str,
    prepared: &Prepared,
    record: &NodeRecord,
) -> Result<Option<String>, KubeSinkError> {
    let fitted = &prepared.fitted;
    if fitted.dropped_faults > record.dropped_faults {
        warn!(
            dropped = fitted.dropped_faults - record.dropped_faults,
            "the record is over the ConfigMap limit; oldest faults left out of the ConfigMap"
        );
    }
    let body = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": cfg.namespace,
            "labels": plan::configmap_labels(&cfg.node, fitted.health),
        },
        "data": { RECORD_KEY: prepared.text },
    });
    let cm = cms
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(api("apply the fault ConfigMap"))?;
    debug!(health = %fitted.health, faults = fitted.faults.len(), "fault ConfigMap written");
    Ok(cm.metadata.resource_version)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;
    use faultline_kube_emulator::{Emulator, ResourceRef};
    use serde_json::Value;

    fn cm(data: Value) -> Value {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "faultline-n1", "namespace": "faultline-system"},
            "data": data,
        })
    }

    /// The cluster's copy of the record is untrusted input: only a record about this node is
    /// used, and each other case gets its own error.
    #[tokio::test]
    async fn reading_the_record_back_accepts_only_this_nodes_record() {
        let emu = Emulator::start().await.unwrap();
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "faultline-system"}}));
        let (client, _dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        let cms: Api<ConfigMap> = Api::namespaced(client, "faultline-system");

        assert!(read_back(&cms, "n1").await.unwrap().is_none(), "none yet");

        let record = |node: &str| {
            json!({
                "apiVersion": "faultline.io/v1", "node": node, "health": "Healthy",
                "updateTime": "2026-11-24T00:00:00Z", "checkCode": "", "faults": [],
                "agent": {"version": "0", "policy": {"source": "builtin", "checksum": ""}, "detectors": []},
            })
            .to_string()
        };
        emu.put(cm(json!({ RECORD_KEY: record("n1") })));
        let r = read_back(&cms, "n1").await.unwrap().unwrap();
        assert_eq!(r.node, "n1");

        for (data, expect) in [
            (json!({ RECORD_KEY: record("n2") }), "about node \"n2\""),
            (json!({ RECORD_KEY: "{\"node\": 1" }), "no readable record"),
            (json!({ "other": "x" }), "no faults.json key"),
        ] {
            emu.put(cm(data));
            let e = read_back(&cms, "n1").await.unwrap_err().to_string();
            assert!(e.contains(expect), "{expect}: {e}");
        }
        assert!(emu.delete(&ResourceRef::config_map("faultline-system", "faultline-n1")));
    }

    /// The ConfigMap is deleted while snapshots with nothing new keep coming (a busy node: a
    /// marker, a policy status, a repeat within the same content), one every 50 ms: the watch's
    /// report of the deletion is not lost to the snapshots winning the sink's `select!`, and the
    /// ConfigMap is written again without waiting for the record to change.
    #[tokio::test]
    async fn a_deleted_configmap_is_written_again_while_snapshots_keep_coming() {
        let emu = Emulator::start().await.unwrap();
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "faultline-system"}}));
        let (client, _dir) = crate::sink::kube::emulator_client(&emu, "n1").await;
        let mut cfg = KubeSinkConfig::new("n1");
        cfg.namespace = "faultline-system".into();
        cfg.settle = Duration::ZERO;
        let (snapshots, snap_rx) = watch::channel(None);
        let sink = tokio::spawn(run(
            client.clone(),
            Api::namespaced(client, "faultline-system"),
            cfg,
            snap_rx,
            Arc::new(Metrics::new()),
            Arc::new(crate::clock::SystemClock),
        ));
        let cm_ref = ResourceRef::config_map("faultline-system", "faultline-n1");
        let mut revision = 1;
        snapshots.send_replace(Some(crate::engine_loop::test_snapshot(revision, 0)));
        let start = Instant::now();
        while emu.get(&cm_ref).is_none() {
            assert!(start.elapsed() < Duration::from_secs(20), "never written");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        assert!(emu.delete(&cm_ref));
        let deleted = Instant::now();
        while emu.get(&cm_ref).is_none() {
            assert!(
                deleted.elapsed() < Duration::from_secs(10),
                "the deleted ConfigMap was not written again"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            revision += 1;
            snapshots.send_replace(Some(crate::engine_loop::test_snapshot(revision, 0)));
        }
        drop(snapshots);
        tokio::time::timeout(Duration::from_secs(10), sink)
            .await
            .unwrap()
            .unwrap();
    }

    /// What the watch reports is compared by content and labels: a record whose labels were
    /// stripped (the taint budget counts nodes by them) needs writing as much as a deleted one.
    #[test]
    fn the_watched_configmap_counts_as_written_only_with_its_record_and_labels() {
        let text = json!({
            "apiVersion": "faultline.io/v1", "node": "n1", "health": "Healthy",
            "updateTime": "2026-11-24T00:00:00Z", "checkCode": "", "faults": [],
            "agent": {"version": "0", "policy": {"source": "builtin", "checksum": ""}, "detectors": []},
        })
        .to_string();
        let record: NodeRecord = serde_json::from_str(&text).unwrap();
        let mut with_labels = cm(json!({ RECORD_KEY: text }));
        with_labels["metadata"]["labels"] = json!(plan::configmap_labels("n1", record.health));
        let present = |v: Value| serde_json::from_value::<ConfigMap>(v).unwrap();
        assert_eq!(on_server(None, "n1"), None);
        assert_eq!(
            on_server(Some(&present(with_labels.clone())), "n1"),
            Some(RecordKeys::of(&record))
        );
        let mut stripped = with_labels.clone();
        stripped["metadata"]["labels"] = json!({"app.kubernetes.io/name": "faultline"});
        assert_eq!(on_server(Some(&present(stripped)), "n1"), None);
        let mut garbled = with_labels;
        garbled["data"][RECORD_KEY] = json!("{");
        assert_eq!(on_server(Some(&present(garbled)), "n1"), None);
    }
}
