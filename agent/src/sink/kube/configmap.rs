//! The fault ConfigMap sink: `faultline-<node>` in the agent's namespace holds the record as
//! `faults.json`, with the labels of DESIGN.md, for schedulers and job scripts.
//!
//! Written by server-side apply (one call creates or updates it) and only when the content
//! changed: `updateTime` alone is not a change. On start the sink reads the ConfigMap back and
//! adopts it when it already says the same. The record is cut to fit Kubernetes' 1 MiB limit
//! ([`plan::fit_record`]).

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

use super::own::{self, Seen};
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
    let mut written = adopt(&cms, &name).await;
    let mut retry = Retry::new();
    let mut wake: Option<Instant> = None;
    loop {
        if let Some(rx) = own.as_mut() {
            let seen = on_server(&rx.borrow_and_update());
            if let Some(now) = seen {
                if now != written && written.is_some() {
                    info!(
                        deleted = now.is_none(),
                        "the fault ConfigMap was changed or deleted by someone else; writing it again"
                    );
                    metrics.drift_repairs.get_or_create(&label).inc();
                }
                written = now;
            }
        }
        let snap = snapshots.borrow_and_update().clone();
        if let Some(snap) = snap {
            match write(&cms, &cfg, &name, &snap.record, &written).await {
                Ok(Some(key)) => {
                    metrics.sink_writes.get_or_create(&label).inc();
                    written = Some(key);
                    retry.reset();
                    wake = None;
                }
                Ok(None) => wake = None,
                Err(e) => {
                    metrics.sink_errors.get_or_create(&label).inc();
                    let delay = retry.next_delay();
                    warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "writing the fault ConfigMap failed; detection goes on");
                    wake = Some(Instant::now() + delay);
                }
            }
        }
        tokio::select! {
            going = super::changed_or_woken(&mut snapshots, wake) => if !going { break },
            () = own::changed(&mut own) => {}
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

/// What the watch says the server holds: `Some(None)` when the ConfigMap is gone or holds no
/// readable record, `Some(key)` for a record, `None` when the watch has not answered yet.
fn on_server(seen: &Seen<ConfigMap>) -> Option<Option<String>> {
    match seen {
        Seen::Unknown => None,
        Seen::Absent => Some(None),
        Seen::Present(cm) => Some(
            cm.data
                .as_ref()
                .and_then(|d| d.get(RECORD_KEY))
                .and_then(|t| serde_json::from_str::<NodeRecord>(t).ok())
                .map(|r| plan::content_key(&r)),
        ),
    }
}

/// The content key of the ConfigMap as it is, if it exists and holds a readable record.
async fn adopt(cms: &Api<ConfigMap>, name: &str) -> Option<String> {
    match cms.get_opt(name).await {
        Ok(Some(cm)) => {
            let text = cm.data.as_ref().and_then(|d| d.get(RECORD_KEY))?;
            match serde_json::from_str::<NodeRecord>(text) {
                Ok(r) => {
                    info!(health = %r.health, faults = r.faults.len(), "fault ConfigMap found; adopting it");
                    Some(plan::content_key(&r))
                }
                Err(e) => {
                    warn!(error = %e, "the fault ConfigMap holds no readable record; it will be rewritten");
                    None
                }
            }
        }
        Ok(None) => None,
        Err(e) => {
            warn!(error = %e, "cannot read the fault ConfigMap at start; it will be written when the API answers");
            None
        }
    }
}

/// Writes the record when it differs from `written`; returns the new content key.
async fn write(
    cms: &Api<ConfigMap>,
    cfg: &KubeSinkConfig,
    name: &str,
    record: &NodeRecord,
    written: &Option<String>,
) -> Result<Option<String>, KubeSinkError> {
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
    cms.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(api("apply the fault ConfigMap"))?;
    debug!(health = %fitted.health, faults = fitted.faults.len(), "fault ConfigMap written");
    Ok(Some(key))
}
