//! Operator requests: `faultline clear` drops a JSON request into `<state-dir>/clear.d/`; this
//! source applies it and removes the file. A request that does not parse is renamed to
//! `*.rejected` with the reason logged, so it is neither lost nor retried forever.
//!
//! Files rather than an HTTP endpoint: whoever may clear faults must already be able to write
//! into the node's state directory (root on the node, or `kubectl exec` into the agent).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{Input, SourceContext};
use faultline_core::engine::Observation;

pub const CLEAR_DIR: &str = "clear.d";

/// One clear request; both fields empty clears every active fault.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClearRequest {
    #[serde(default)]
    pub code: Option<String>,
    /// Device name (`GPU-3`), UUID or PCI bus id.
    #[serde(default)]
    pub device: Option<String>,
}

/// Reads every pending request in `dir`, oldest name first. Returns parsed requests with their
/// paths, and rejects (renames) the ones that do not parse.
pub fn collect(dir: &Path) -> Vec<(PathBuf, ClearRequest)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for p in paths {
        let parsed = std::fs::read(&p)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<ClearRequest>(&b).map_err(|e| e.to_string()));
        match parsed {
            Ok(r) => out.push((p, r)),
            Err(e) => {
                warn!(path = %p.display(), error = %e, "rejected a clear request");
                let _ = std::fs::rename(&p, p.with_extension("rejected"));
            }
        }
    }
    out
}

/// Polls the request directory until shutdown.
pub async fn run(state_dir: PathBuf, ctx: SourceContext, every: Duration) {
    let dir = state_dir.join(CLEAR_DIR);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let d = dir.clone();
        let Ok(requests) = tokio::task::spawn_blocking(move || collect(&d)).await else {
            continue;
        };
        for (path, r) in requests {
            info!(code = ?r.code, device = ?r.device, "operator clear");
            let obs = Observation::OperatorClear {
                code: r.code,
                device: r.device,
            };
            if ctx.tx.send(Input::Obs(obs)).await.is_err() {
                return;
            }
            let _ = std::fs::remove_file(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_requests_are_read_bad_ones_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("1.json"), br#"{"code":"Xid79"}"#).unwrap();
        std::fs::write(dir.path().join("2.json"), br#"{"cod":"Xid79"}"#).unwrap();
        std::fs::write(dir.path().join("3.json"), br#"{}"#).unwrap();
        let got = collect(dir.path());
        assert_eq!(
            got.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>(),
            vec![
                ClearRequest {
                    code: Some("Xid79".into()),
                    device: None
                },
                ClearRequest::default()
            ]
        );
        assert!(
            dir.path().join("2.rejected").exists(),
            "kept for the operator to see"
        );
    }
}
