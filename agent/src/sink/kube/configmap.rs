//! The fault ConfigMap sink: `faultline-<node>` in the agent's namespace holds the record as
//! `faults.json`, with the labels of DESIGN.md, for schedulers and job scripts.
//!
//! Written by server-side apply (one call creates or updates it) and only when the content
//! changed: `updateTime` alone is not a change. On start the sink reads the ConfigMap back and
//! adopts it when it already says the same; while the agent settles, a record that differs only
//! in detectors that have not reported yet (their states are not restored) is not written.
//! The record is cut to fit Kubernetes' 1 MiB limit ([`plan::fit_record`]).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::own::{self, DriftPacer, OwnVersions, Seen};
use super::plan::{self, CONFIGMAP_LIMIT, RECORD_KEY};
use super::{api, KubeSinkConfig, KubeSinkError, Retry, FIELD_MANAGER};
use crate::metrics::{Metrics, SinkLabel};
use crate::runtime::Snapshot;
use faultline_core::record::NodeRecord;

/// The fault ConfigMap's name for a node.
pub fn name(node: &str) -> String {
    format!("faultline-{node}")
}

/// Runs until the snapshot channel closes, then makes one last bounded attempt. `own` is the
/// watch of this ConfigMap ([`own::watch_one`]): when it is deleted or rewritten by someone else,
/// the sink writes it again at once.
pub async fn run(
    client: Client,
    cfg: KubeSinkConfig,
    mut snapshots: watch::Receiver<Option<Snapshot>>,
    mut own: Option<watch::Receiver<Seen<ConfigMap>>>,
    metrics: Arc<Metrics>,
    _shutdown: CancellationToken,
) {
    let cms: Api<ConfigMap> = Api::namespaced(client, &cfg.namespace);
    let name = name(&cfg.node);
    let label = SinkLabel { sink: "configmap" };
    let started = Instant::now();
    let (mut written, adopted_base) = match adopt(&cms, &cfg.node).await {
        Some((key, base)) => (Some(key), Some(base)),
        None => (None, None),
    };
    let adopted = written.clone();
    let mut retry = Retry::new();
    let mut wake: Option<Instant> = None;
    let mut versions = OwnVersions::default();
    let mut pacer = DriftPacer::default();
    let mut woke_by_own = false;
    // A repair the pacer put off: counted when it is written.
    let mut repair = false;
    loop {
        let now = Instant::now();
        // Only a new report of the watch counts (`own::changed` marked it seen): an old one
        // compared again would undo what the sink wrote since.
        if let Some(rx) = own.as_ref().filter(|_| woke_by_own) {
            let seen = rx.borrow().clone();
            let echo = matches!(&seen, Seen::Present(cm)
                if versions.ours(cm.metadata.resource_version.as_deref()));
            match on_server(&seen, &cfg.node) {
                Some(there) if !echo && there != written => {
                    // What the server holds is what is compared from now on.
                    repair |= written.is_some();
                    written = there;
                }
                _ => {}
            }
        }
        let paced = if repair && woke_by_own {
            pacer.ask(now).err()
        } else {
            None
        };
        // A change of the watched ConfigMap alone does not cut a retry backoff short, and a
        // repair that keeps being undone waits its turn.
        let backing_off = woke_by_own && wake.is_some_and(|w| now < w);
        let snap = snapshots.borrow_and_update().clone();
        match (snap, paced) {
            (_, Some(at)) => {
                debug!("the fault ConfigMap was changed again; pacing the repair");
                wake = Some(at);
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
            (Some(snap), None) if !backing_off => {
                match write(&cms, &cfg, &name, &snap.record, &written).await {
                    Ok(Some((key, rv))) => {
                        metrics.sink_writes.get_or_create(&label).inc();
                        if repair {
                            info!("the fault ConfigMap had been changed or deleted by someone else; written again");
                            metrics.drift_repairs.get_or_create(&label).inc();
                            repair = false;
                        }
                        versions.note(rv.as_deref());
                        written = Some(key);
                        retry.reset();
                        wake = None;
                    }
                    Ok(None) => {
                        repair = false;
                        wake = None;
                    }
                    Err(e) => {
                        metrics.sink_errors.get_or_create(&label).inc();
                        let delay = retry.next_delay();
                        warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "writing the fault ConfigMap failed; detection goes on");
                        wake = Some(Instant::now() + delay);
                    }
                }
            }
            _ => {}
        }
        woke_by_own = false;
        tokio::select! {
            going = super::changed_or_woken(&mut snapshots, wake) => if !going { break },
            () = own::changed(&mut own) => woke_by_own = true,
        }
    }
    let last = snapshots.borrow().clone();
    if let Some(snap) = last {
        let _ = tokio::time::timeout(
            Duration::from_secs(3),
            write(&cms, &cfg, &name, &snap.record, &written),
        )
        .await;
    }
}

/// What the watch says the server holds: `Some(None)` when the ConfigMap is gone, holds no
/// readable record or lacks its labels (the taint budget counts nodes by them), `Some(key)` for
/// a record, `None` when the watch has not answered yet.
fn on_server(seen: &Seen<ConfigMap>, node: &str) -> Option<Option<String>> {
    match seen {
        Seen::Unknown => None,
        Seen::Absent => Some(None),
        Seen::Present(cm) => {
            let record = record_in(cm).ok();
            let labelled = |r: &NodeRecord| {
                let have = cm.metadata.labels.as_ref();
                plan::configmap_labels(node, r.health)
                    .iter()
                    .all(|(k, v)| have.and_then(|l| l.get(k)) == Some(v))
            };
            Some(
                record
                    .filter(|r| labelled(r))
                    .map(|r| plan::content_key(&r)),
            )
        }
    }
}

/// Why the record could not be read back from the fault ConfigMap.
#[derive(Debug, thiserror::Error)]
pub enum ReadBackError {
    #[error("cannot read the fault ConfigMap: {0}")]
    Api(#[source] kube::Error),
    #[error("the fault ConfigMap holds no readable record: {0}")]
    Unreadable(String),
}

/// This node's record as its fault ConfigMap holds it; `Ok(None)` when there is no ConfigMap.
/// The content is untrusted: it must parse as a record and be about `node`.
pub async fn read_back(
    cms: &Api<ConfigMap>,
    node: &str,
) -> Result<Option<NodeRecord>, ReadBackError> {
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
    Ok(Some(record))
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

/// The content key of the ConfigMap as it is, and the same without the detectors' states, if
/// it exists and holds a readable record.
async fn adopt(cms: &Api<ConfigMap>, node: &str) -> Option<(String, String)> {
    match read_back(cms, node).await {
        Ok(Some(r)) => {
            info!(health = %r.health, faults = r.faults.len(), "fault ConfigMap found; adopting it");
            Some((
                plan::content_key(&r),
                plan::content_key_without_detectors(&r),
            ))
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

/// Writes the record when it differs from `written`; returns the new content key and the
/// written object's resourceVersion.
async fn write(
    cms: &Api<ConfigMap>,
    cfg: &KubeSinkConfig,
    name: &str,
    record: &NodeRecord,
    written: &Option<String>,
) -> Result<Option<(String, Option<String>)>, KubeSinkError> {
    let (text, fitted) =
        plan::fit_record(record, CONFIGMAP_LIMIT - RECORD_KEY.len()).map_err(|source| {
            KubeSinkError::Encode {
                what: "the record",
                source,
            }
        })?;
    let key = plan::content_key(&fitted);
    if written.as_ref() == Some(&key) {
        return Ok(None);
    }
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
        "data": { RECORD_KEY: text },
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
    Ok(Some((key, cm.metadata.resource_version)))
}

#[cfg(test)]
mod tests {
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
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        emu.write_kubeconfig(&kubeconfig, "t").unwrap();
        let client = crate::kube_client::client(
            Some(&kubeconfig),
            crate::kube_client::Sender::Agent { node: "n1" },
        )
        .await
        .unwrap();
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
        let present =
            |v: Value| Seen::Present(Arc::new(serde_json::from_value::<ConfigMap>(v).unwrap()));
        assert_eq!(on_server(&Seen::Unknown, "n1"), None);
        assert_eq!(on_server(&Seen::Absent, "n1"), Some(None));
        assert_eq!(
            on_server(&present(with_labels.clone()), "n1"),
            Some(Some(plan::content_key(&record)))
        );
        let mut stripped = with_labels.clone();
        stripped["metadata"]["labels"] = json!({"app.kubernetes.io/name": "faultline"});
        assert_eq!(on_server(&present(stripped), "n1"), Some(None));
        let mut garbled = with_labels;
        garbled["data"][RECORD_KEY] = json!("{");
        assert_eq!(on_server(&present(garbled), "n1"), Some(None));
    }
}
