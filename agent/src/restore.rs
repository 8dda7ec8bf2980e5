//! What the last run left for this one: `state.json` from the data directory (a file of
//! another version or node set aside), else the faults rebuilt from the record (`faults.json`),
//! else, on Kubernetes, from the fault ConfigMap or from the taints an operator must clear; the
//! kernel-log cursor when the boot is the same. Before any of it, the agent takes its
//! directories ([`take_directories`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tracing::{debug, error, info, warn};

use crate::clock::Clock;
use crate::sink::file;
use crate::sink::kube as kube_sink;
use crate::source::{control, kmsg};
use faultline_core::catalog::Catalog;
use faultline_core::engine::Observation;
use faultline_core::record::NodeRecord;

/// Where the last run's state is found: the agent's directories and the files that tell the
/// boot, and on Kubernetes the namespace of the fault ConfigMap.
#[derive(Debug, Clone)]
pub(crate) struct RestoreConfig {
    pub state_dir: PathBuf,
    pub data_dir: PathBuf,
    pub boot_id_path: PathBuf,
    pub proc_stat_path: PathBuf,
    pub namespace: String,
    /// The agent's clock: a record's age, the lock's start time, the wait for the API.
    pub clock: std::sync::Arc<dyn Clock>,
}

/// Why the agent cannot use its directories.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DirError {
    #[error("cannot create state directory {}", .path.display())]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot create data directory {} (it holds the state a restart and a reboot need; not \
         running as root, give --data-dir a directory you can write, on a disk that survives a \
         reboot)",
        .path.display()
    )]
    Data {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Lock(#[from] crate::lock::LockError),
    #[error("taking the directory locks")]
    Join(#[from] tokio::task::JoinError),
}

/// Creates the state and data directories and takes the agent's lock on each, before anything
/// in them is read or written: a second agent stops here, having changed nothing. The locks
/// are held while the returned values live (the kernel releases them if the process dies).
/// Then removes the temporary files of writes a kill interrupted (only the agent writes there).
pub(crate) async fn take_directories(
    cfg: &RestoreConfig,
    node: &str,
) -> Result<Vec<crate::lock::DirLock>, DirError> {
    // 0755 whatever the umask (a user's 0002 would make them group-writable, which the lock
    // refuses): only the agent writes there; jobs read the record as other users.
    use std::os::unix::fs::DirBuilderExt;
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true).mode(0o755);
    let (state, data) = (cfg.state_dir.clone(), cfg.data_dir.clone());
    builder.create(&state).map_err(|source| DirError::State {
        path: state.clone(),
        source,
    })?;
    builder.create(&data).map_err(|source| DirError::Data {
        path: data.clone(),
        source,
    })?;
    let holder = crate::lock::Holder::this_process(node, cfg.clock.now());
    // On a blocking thread: file system calls.
    let locks =
        tokio::task::spawn_blocking(move || crate::lock::acquire_all(&[&state, &data], &holder))
            .await??;
    for dir in [&cfg.state_dir, &cfg.data_dir] {
        match crate::atomic_file::remove_stale_temps(dir) {
            Ok(0) => {}
            Ok(n) => {
                info!(removed = n, dir = %dir.display(), "removed temporary files left by an interrupted write")
            }
            Err(e) => warn!(error = %e, dir = %dir.display(), "cannot clean temporary files"),
        }
    }
    let _ = std::fs::create_dir_all(cfg.state_dir.join(control::CLEAR_DIR));
    Ok(locks)
}

fn read_boot_id(path: &Path) -> Option<String> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Ok(_) => None,
        Err(e) => {
            warn!(path = %path.display(), error = %e, "cannot read the boot id; kernel-log faults will not clear on reboot");
            None
        }
    }
}

/// Where the restored engine came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// `state.json`.
    State,
    /// `faults.json` (`state.json` was unreadable) or the fault ConfigMap (both were lost).
    Record,
    /// Nothing survived locally.
    Empty,
}

/// What the last run left for this one: the engine and, within the same boot, the kernel-log
/// cursor.
pub(crate) struct Restored {
    pub(crate) boot_id: Option<String>,
    pub(crate) origin: Origin,
    pub(crate) engine: faultline_core::engine::Engine,
    /// The saved cursor, when the boot is the same (a new boot's log starts over).
    pub(crate) kmsg_cursor: Option<faultline_core::engine::KmsgPosition>,
    /// This boot's boot time (`/proc/stat` btime), saved with the state.
    pub(crate) boot_time: Option<i64>,
    /// When the engine was rebuilt from the record: the record's time (kernel-log records up to
    /// it are in it already).
    pub(crate) kmsg_skip_through: Option<faultline_core::time::Timestamp>,
    /// The taints the budget withheld when this node's last record was written: the node sink
    /// starts from them (Kubernetes mode), so a restart neither announces them again nor moves
    /// `since`.
    pub(crate) taint_budget: Option<faultline_core::record::TaintBudgetStatus>,
    /// The engine's timeline saved by the last run (kept when it is of this boot).
    pub(crate) saved_timeline: Option<faultline_core::time::Timeline>,
    /// The clear requests the last run applied (from `state.json`).
    pub(crate) clears: crate::clear::AppliedClears,
}

pub(crate) fn restore(cfg: &RestoreConfig, node: &str, catalog: &Catalog) -> Restored {
    let boot_id = read_boot_id(&cfg.boot_id_path);
    let mut kmsg_skip_through = None;
    // faults.json, read once: the engine is rebuilt from it when state.json is unusable, and
    // the withheld taints come from it in every case.
    let record = crate::cli::read_record(&cfg.state_dir.join(file::FAULTS_FILE));
    let (origin, persisted) = match read_durable_state(cfg, node) {
        Ok(Some(p)) => (Origin::State, p),
        // No usable state.json (deleted alone, or unreadable): the record is rebuilt.
        missing_or_bad => {
            let unreadable = missing_or_bad.err();
            match rebuild_from_record(&record, node, cfg, catalog) {
                Some((engine, written)) => {
                    kmsg_skip_through = written;
                    let why = unreadable
                        .as_ref()
                        .map_or_else(|| "no saved state".to_string(), |e| e.to_string());
                    warn!(error = %why, faults = engine.faults().count(), "saved state missing or unreadable; faults rebuilt from the record");
                    let state = crate::engine_loop::PersistedState {
                        engine,
                        ..Default::default()
                    };
                    (Origin::Record, state)
                }
                None => {
                    if let Some(e) = unreadable {
                        warn!(error = %e, "saved state unreadable and no record; starting empty");
                    }
                    (Origin::Empty, Default::default())
                }
            }
        }
    };
    let boot_time = kmsg::boot_time(&cfg.proc_stat_path).map(|t| t.as_second());
    let same_boot = same_boot(
        (persisted.engine.boot_id(), persisted.boot_time),
        (boot_id.as_deref(), boot_time),
    );
    let kmsg_cursor = persisted.kmsg_position().filter(|_| same_boot);
    info!(same_boot, resume_after = ?kmsg_cursor, faults = persisted.engine.faults().count(), "state restored");
    Restored {
        saved_timeline: persisted.timeline,
        clears: persisted.clears,
        boot_id,
        origin,
        engine: persisted.engine,
        kmsg_cursor,
        boot_time,
        kmsg_skip_through,
        // Saved with the state (kept by a reboot); from the record when the state was lost.
        taint_budget: persisted.taint_budget.or_else(|| {
            record
                .ok()
                .filter(|r| r.node == node)
                .and_then(|r| r.agent.taint_budget)
        }),
    }
}

/// Where a refused `state.json` is set aside: `state.json.v<N>` for another version,
/// `state.json.node-<name>` for another node (the name kept to letters, digits, `.`, `-` and
/// `_`: it comes from the file). `None` for a file that is merely unreadable.
fn set_aside_name(e: &file::StateReadError) -> Option<(PathBuf, String)> {
    match e {
        file::StateReadError::UnknownVersion { path, found, .. } => {
            Some((path.clone(), format!("{}.v{found}", file::STATE_FILE)))
        }
        file::StateReadError::OtherNode { path, found, .. } => {
            let found = if found.is_empty() { "none" } else { found };
            let safe: String = found
                .chars()
                .take(200)
                .map(|c| {
                    if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            Some((path.clone(), format!("{}.node-{safe}", file::STATE_FILE)))
        }
        file::StateReadError::Unreadable { .. } => None,
    }
}

/// Whether the saved state (its boot id and boot time) is of this boot (`now`): by the boot
/// ids when both are known; else by the boot times (`/proc/stat` btime), which both runs
/// saved. The boot time moves when the wall clock is stepped, so a step between two starts of
/// one boot makes them look like two boots (the kernel log is counted again, as when nothing
/// tells the boot); a new boot never has the boot time of the last one unless its clock
/// starts where the last one's did, with no time source setting it.
fn same_boot(saved: (Option<&str>, Option<i64>), now: (Option<&str>, Option<i64>)) -> bool {
    match (saved.0, now.0) {
        (Some(a), Some(b)) => a == b,
        _ => saved.1.is_some() && saved.1 == now.1,
    }
}

/// `state.json` from the data directory. A file of another version is refused and set aside
/// as `state.json.v<N>` (the agent that wrote it may come back after a rollback), a file of
/// another node as `state.json.node-<name>`; neither is merged nor overwritten.
fn read_durable_state(
    cfg: &RestoreConfig,
    node: &str,
) -> Result<Option<crate::engine_loop::PersistedState>, file::StateReadError> {
    file::read_state(&cfg.data_dir, node).inspect_err(|e| {
        if let Some((path, name)) = set_aside_name(e) {
            let aside = path.with_file_name(name);
            match std::fs::rename(&path, &aside) {
                Ok(()) => {
                    error!(error = %e, kept_as = %aside.display(), "saved state refused and set aside; not restored")
                }
                Err(r) => {
                    error!(error = %e, rename_error = %r, "saved state refused, and it cannot be set aside: it will be overwritten")
                }
            }
        }
    })
}

/// An engine rebuilt from a record, and the time up to which the record counted kernel-log
/// lines (set when the record is of this boot).
type Rebuilt = (
    faultline_core::engine::Engine,
    Option<faultline_core::time::Timestamp>,
);

/// The engine from `faults.json`, when `state.json` cannot be read. `None` when the record is
/// missing or unreadable too, or is another node's (a state directory another agent used).
fn rebuild_from_record(
    record: &Result<NodeRecord, crate::cli::ReadError>,
    node: &str,
    cfg: &RestoreConfig,
    catalog: &Catalog,
) -> Option<Rebuilt> {
    match record {
        Ok(r) if r.node != node => {
            error!(record_node = %r.node, "the record in the state directory is another node's; not restored");
            None
        }
        Ok(r) => Some(engine_from_record(r, cfg, catalog)),
        Err(crate::cli::ReadError::Missing(_)) => None,
        Err(e) => {
            warn!(error = %e, "the record is unreadable too");
            None
        }
    }
}

/// How long start-up waits for the cluster's copy of the record when nothing survived locally
/// (trying again meanwhile, after 200 ms doubling to 1 s, with jitter).
const CLUSTER_RESTORE_WAIT: Duration = Duration::from_secs(10);

/// The fault an operator-held taint stands for, when nothing else is left of it: the code in
/// the taint's value, if the policy in force holds that code for an operator
/// (`ManuallySeparateNPU`). A taint of a fault that recovers by itself is not held: if the fault
/// is still there, its source finds it again. The value is untrusted: anything but a code the
/// policy holds is ignored.
fn held_code(
    value: &str,
    policy: &faultline_core::policy::Policy,
    catalog: &Catalog,
) -> Option<faultline_core::catalog::FaultCode> {
    use faultline_core::catalog::FaultCode;
    use faultline_core::record::Handling;
    let code = if let Some(n) = value.strip_prefix("SXid").and_then(|n| n.parse().ok()) {
        FaultCode::Sxid {
            code: n,
            fatal: true,
        }
    } else if let Some(n) = value.strip_prefix("Xid").and_then(|n| n.parse().ok()) {
        FaultCode::Xid(n)
    } else if faultline_core::catalog::ascend::is_fault_code(value) {
        FaultCode::Ascend {
            code: value.to_string(),
            network: false,
            severe: true,
        }
    } else if faultline_core::policy::valid_code(value) {
        FaultCode::named(value)
    } else {
        return None;
    };
    (policy.classify(catalog, &code).handling == Handling::ManuallySeparateNPU).then_some(code)
}

/// When neither local state nor the fault ConfigMap is left, the node's own `faultline.io/`
/// taints are the last trace of operator-held faults: each taint whose value is a code the
/// policy holds for an operator becomes an active fault on `node` again (source `agent`, the
/// message saying where it came from), so the node stays tainted until an operator runs
/// `faultline clear`. `None` when the Node cannot be read or carries no such taint.
async fn rebuild_from_taints(
    client: kube::Client,
    node: &str,
    policy: &faultline_core::policy::Policy,
    catalog: &Catalog,
    now: faultline_core::time::Timestamp,
) -> Option<faultline_core::engine::Engine> {
    use faultline_core::engine::{DeviceRef, Engine, Signal};
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client);
    let n = match tokio::time::timeout(CLUSTER_RESTORE_WAIT, nodes.get(node)).await {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            warn!(error = %e, "cannot read this node's taints; starting empty");
            return None;
        }
        Err(_) => {
            warn!("this node's taints were not read in time; starting empty");
            return None;
        }
    };
    let ctx = faultline_core::engine::Ctx { policy, catalog };
    let mut engine = Engine::new();
    for t in n.spec.and_then(|s| s.taints).unwrap_or_default() {
        if !t.key.starts_with("faultline.io/") {
            continue;
        }
        let value = t.value.unwrap_or_default();
        let Some(code) = held_code(&value, policy, catalog) else {
            continue;
        };
        let message = format!(
            "rebuilt from the node's taint {}={value}:{}: no local state and no fault record were left; \
             an operator must clear it (faultline clear --code {value}) once the node is repaired",
            t.key, t.effect
        );
        let signal = Signal::new(
            faultline_core::record::Source::Agent,
            code,
            Some(DeviceRef::named("node")),
            message,
        );
        engine.step(ctx, Observation::Signal(signal), now);
    }
    let held = engine.faults().filter(|f| f.fault.active).count();
    if held == 0 {
        return None;
    }
    warn!(
        faults = held,
        "no local state and no fault record; operator-held faults rebuilt from the node's taints"
    );
    Some(engine)
}

/// A record dated further ahead of this host's clock than this is refused: its time would set
/// how far the kernel log is skipped.
const MAX_RECORD_SKEW: Duration = Duration::from_secs(300);

/// What the cluster holds of this node's last record.
enum ClusterRecord {
    Found(Rebuilt, Box<NodeRecord>),
    Absent,
    NoAnswer,
}

/// In Kubernetes, when nothing was found on this node ([`Origin::Empty`]), the state is rebuilt
/// from the cluster: the fault ConfigMap's record, else the Node's taints. Standalone there is
/// no taint budget, and nothing is withheld.
pub(crate) async fn from_cluster(
    mut restored: Restored,
    kube: Option<kube::Client>,
    cfg: &RestoreConfig,
    node: &str,
    catalog: &Catalog,
    policy: &tokio::sync::watch::Receiver<faultline_core::policy::LoadedPolicy>,
    timeline: &faultline_core::time::Timeline,
) -> Restored {
    let Some(client) = kube else {
        restored.taint_budget = None;
        return restored;
    };
    if restored.origin != Origin::Empty {
        return restored;
    }
    match rebuild_from_cluster(client.clone(), cfg, node, catalog).await {
        ClusterRecord::Found((engine, skip), record) => {
            restored.origin = Origin::Record;
            restored.engine = engine;
            restored.kmsg_skip_through = skip;
            restored.taint_budget = record.agent.taint_budget;
        }
        ClusterRecord::Absent => {
            // The policy and the time after the wait for the record: a slow policy file may
            // have been read meanwhile, and which taints an operator holds depends on it.
            let policy = policy.borrow().policy.clone();
            let now = timeline.at(cfg.clock.since_boot());
            if let Some(engine) = rebuild_from_taints(client, node, &policy, catalog, now).await {
                restored.origin = Origin::Record;
                restored.engine = engine;
            }
        }
        ClusterRecord::NoAnswer => {}
    }
    restored
}

/// When nothing survived locally (the state directory was lost, or a reboot emptied a tmpfs),
/// the fault ConfigMap may still hold this node's last record: rebuild from it, so operator-held
/// faults are not published as Healthy. Waits at most [`CLUSTER_RESTORE_WAIT`]:
/// [`ClusterRecord::NoAnswer`] when the API did not answer in time (nothing else is asked then,
/// detection has waited long enough); [`ClusterRecord::Absent`] when it answered without a
/// usable record (the node's taints are asked next, [`rebuild_from_taints`]).
async fn rebuild_from_cluster(
    client: kube::Client,
    cfg: &RestoreConfig,
    node: &str,
    catalog: &Catalog,
) -> ClusterRecord {
    let cms: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(client, &cfg.namespace);
    use kube_sink::configmap::{read_back, ReadBackError};
    let clock = &cfg.clock;
    let deadline = clock.instant() + CLUSTER_RESTORE_WAIT;
    let mut retry =
        crate::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(1));
    let record = loop {
        let left = deadline.saturating_duration_since(clock.instant());
        match tokio::time::timeout(left, read_back(&cms, node)).await {
            Ok(Ok(Some(r))) => break r,
            Ok(Ok(None)) => return ClusterRecord::Absent,
            Ok(Err(e @ ReadBackError::Unreadable(_))) => {
                warn!(error = %e, "no local state, and the cluster's record cannot be used");
                return ClusterRecord::Absent;
            }
            Ok(Err(e)) if !left.is_zero() => {
                debug!(error = %e, "reading the cluster's record failed; trying again");
                tokio::time::sleep(retry.next_delay().min(left)).await;
            }
            _ => {
                warn!(
                    waited_ms = CLUSTER_RESTORE_WAIT.as_millis() as u64,
                    "no local state, and the API did not give this node's record in time; starting empty"
                );
                return ClusterRecord::NoAnswer;
            }
        }
    };
    let ahead = faultline_core::time::since(record.update_time, clock.now());
    if ahead > faultline_core::time::signed(MAX_RECORD_SKEW) {
        warn!(record_time = %record.update_time, "the cluster's record is dated in the future; not used");
        return ClusterRecord::Absent;
    }
    let rebuilt = engine_from_record(&record, cfg, catalog);
    warn!(faults = rebuilt.0.faults().count(), record_time = %record.update_time, "no local state; faults rebuilt from the cluster's record");
    ClusterRecord::Found(rebuilt, Box::new(record))
}

/// A record's active faults, minus what the next polls will report anyway, and minus
/// kernel-log faults of an earlier boot (the record was written before this boot began).
fn engine_from_record(record: &NodeRecord, cfg: &RestoreConfig, catalog: &Catalog) -> Rebuilt {
    // Unknown boot time: keep kernel-log faults (a stale fault an operator can clear beats a
    // lost one).
    let booted = kmsg::boot_time(&cfg.proc_stat_path);
    let same_boot = booted.is_none_or(|b| record.update_time >= b);
    let policy = faultline_core::policy::Policy::default();
    let ctx = faultline_core::engine::Ctx {
        policy: &policy,
        catalog,
    };
    let engine = faultline_core::engine::Engine::from_record(
        record,
        faultline_core::engine::RestoreScope { same_boot },
        ctx,
    );
    // The record's time bounds what the kernel-log reader skips: never beyond now.
    let written = record.update_time.min(cfg.clock.now());
    (engine, same_boot.then_some(written))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The boot ids decide when both runs read one; else the boot times both runs saved. An
    /// unknown boot is never the same boot.
    #[test]
    fn the_boot_is_told_by_its_id_else_its_boot_time() {
        let (b1, b2) = (Some("b1"), Some("b2"));
        let (t1, t2) = (Some(1_700_000_000), Some(1_700_086_400));
        assert!(
            same_boot((b1, t1), (b1, t2)),
            "ids agree: a clock step is no reboot"
        );
        assert!(!same_boot((b1, t1), (b2, t1)), "ids differ");
        // The boot id unreadable now, or when the state was saved: the boot times decide.
        assert!(same_boot((b1, t1), (None, t1)));
        assert!(same_boot((None, t1), (None, t1)));
        assert!(same_boot((None, t1), (b1, t1)));
        assert!(!same_boot((None, t1), (None, t2)), "a reboot");
        // Nothing known: a new boot.
        assert!(!same_boot((None, None), (None, None)));
        assert!(!same_boot((b1, None), (None, t1)));
    }

    /// A taint's value is untrusted: only a code the policy in force holds for an operator
    /// rebuilds a fault; other codes, and values that are no code, are ignored.
    #[test]
    fn only_operator_held_codes_are_rebuilt_from_taints() {
        let catalog = Catalog::builtin().unwrap();
        let builtin = faultline_core::policy::Policy::default();
        let held = faultline_core::policy::Policy::parse(
            "overrides:\n  Xid79: { handling: ManuallySeparateNPU }\n",
        )
        .unwrap();
        assert!(held_code("Xid79", &held, &catalog).is_some());
        assert_eq!(
            held_code("Xid79", &builtin, &catalog),
            None,
            "Xid 79 recovers by itself under the built-in policy"
        );
        for value in ["", "Xid", "Xid79x", "../etc", "a b", &"X".repeat(64)] {
            assert_eq!(held_code(value, &held, &catalog), None, "{value:?}");
        }
    }
}
