//! The node-local file sink: `faults.json` (the record, in the state directory where readers
//! look) and `state.json` (what a restart and a reboot need, in the data directory).
//!
//! Each file is replaced atomically (write a temporary file in the same directory, fsync,
//! rename), so a reader never sees a half-written file. Writes are rate-limited by a
//! [`WriteBudget`] (shared with the Kubernetes sinks, [`crate::rate_limit`]): a few writes back to
//! back go out at once, after that one per interval, and every change in between is coalesced
//! into the next write. A failed write is retried with
//! backoff; the engine keeps running meanwhile.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::atomic_file::write as write_atomic;
use crate::clock::Clock;
use crate::component::{Component, Context, FlagError, Handle, StartError};
use crate::engine_loop::{Heartbeat, PersistedState, RecordStatus, Snapshot};
use crate::metrics::{Metrics, SinkLabel};
use crate::rate_limit::WriteBudget;
use faultline_core::record::BootClock;
use faultline_core::time::Timestamp;

pub(crate) const FAULTS_FILE: &str = "faults.json";
pub const STATE_FILE: &str = "state.json";

/// Errors of the file sink.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FileSinkError {
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Write(#[from] crate::atomic_file::WriteError),
    #[error("cannot encode {what}: {source}")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// The record was written, the state was not: readers see the current record (and its
    /// heartbeat), but a restart would not restore it, so nothing waiting for persistence (a
    /// clear request) is told it is saved.
    #[error("the record was written, but the saved state was not: {0}")]
    StateNotSaved(Box<FileSinkError>),
}

impl FileSinkError {
    /// The record itself reached the disk.
    pub(crate) fn record_written(&self) -> bool {
        matches!(self, FileSinkError::StateNotSaved(_))
    }
}

/// Where the file sink writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Dirs {
    /// `faults.json`: where job scripts and the CLI read it (`--state-dir`, default
    /// `/run/faultline`; a tmpfs is fine).
    pub record: PathBuf,
    /// `state.json`: operator-held faults, escalation counts and the kernel-log cursor
    /// (`--data-dir`, default `/var/lib/faultline`); must survive a reboot.
    pub data: PathBuf,
}

impl Dirs {
    /// Both files in one directory (tests).
    #[cfg(test)]
    pub(crate) fn one(dir: PathBuf) -> Self {
        Dirs {
            record: dir.clone(),
            data: dir,
        }
    }
}

/// Which of the two files of a snapshot goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// The state, then the record: the snapshot holds a change that a restart would not make
    /// again ([`Snapshot::save_first`]), so no reader sees it before it is saved.
    StateFirst,
    /// The record, then the state: every change since the last saved state comes from a kernel
    /// log that a restart reads again past the saved cursor, so a kill before the save loses
    /// nothing (the restart finds the record again), and the record does not wait for the
    /// fsyncs of the data directory.
    RecordFirst,
}

impl Order {
    /// The order for `snap` when the newest state saved in this run is that of revision
    /// `saved` (0: none yet).
    pub(crate) fn of(snap: &Snapshot, saved: u64) -> Order {
        if snap.save_first > saved {
            Order::StateFirst
        } else {
            Order::RecordFirst
        }
    }
}

/// Writes one snapshot in `order`: the state and the record stamped with `heartbeat`. With
/// `record_only` (a heartbeat, the state unchanged since the last write) only the record is
/// written.
///
/// A state that cannot be written (the data directory full or read-only) does not stop the
/// record: readers keep a current record and a live heartbeat, and the error
/// ([`FileSinkError::StateNotSaved`]) says the state is behind: a broken `/var/lib` must not
/// look like a dead agent. Likewise a record that cannot be written does not stop the state.
pub(crate) fn write_snapshot(
    dirs: &Dirs,
    snap: &Snapshot,
    heartbeat: &Beat,
    record_only: bool,
    order: Order,
) -> Result<(), FileSinkError> {
    let mut state_err = None;
    if !record_only && order == Order::StateFirst {
        state_err = save_state(dirs, snap)?;
    }
    let record = write_record(dirs, snap, heartbeat);
    if !record_only && order == Order::RecordFirst {
        state_err = save_state(dirs, snap)?;
    }
    record?;
    match state_err {
        Some(e) => Err(FileSinkError::StateNotSaved(Box::new(e))),
        None => Ok(()),
    }
}

/// Writes `state.json`; `Ok(Some(_))` when it could not be written.
fn save_state(dirs: &Dirs, snap: &Snapshot) -> Result<Option<FileSinkError>, FileSinkError> {
    let state = serde_json::to_vec(&*snap.state).map_err(|source| FileSinkError::Encode {
        what: "state",
        source,
    })?;
    Ok(write_atomic(&dirs.data.join(STATE_FILE), &state)
        .err()
        .map(FileSinkError::from))
}

/// Writes `faults.json`, stamped with `heartbeat`.
fn write_record(dirs: &Dirs, snap: &Snapshot, heartbeat: &Beat) -> Result<(), FileSinkError> {
    let mut stamped = (*snap.record).clone();
    stamped.agent.heartbeat_time = Some(heartbeat.wall);
    stamped.agent.heartbeat_boot = heartbeat.boot.clone();
    let mut record =
        serde_json::to_vec_pretty(&stamped).map_err(|source| FileSinkError::Encode {
            what: "record",
            source,
        })?;
    record.push(b'\n');
    write_atomic(&dirs.record.join(FAULTS_FILE), &record)?;
    Ok(())
}

/// One heartbeat as the record carries it: the wall-clock time people read, and the same moment
/// on the boot clock, which readers on this node judge liveness by (a wall-clock step moves the
/// first, never the second).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Beat {
    pub wall: Timestamp,
    pub boot: Option<BootClock>,
}

impl Beat {
    pub(crate) fn now(clock: &dyn Clock) -> Beat {
        Beat {
            wall: clock.now(),
            boot: clock.boot_clock(),
        }
    }
}

/// `faultline_heartbeat_timestamp_seconds`: the heartbeat just written into the record, as
/// Unix seconds (the same `heartbeatTime`, so an alert on its age and a reader of the record
/// agree).
fn set_heartbeat(metrics: &Metrics, beat: &Beat) {
    metrics
        .heartbeat
        .set(beat.wall.as_millisecond() as f64 / 1000.0);
}

/// How often the record is rewritten when nothing changed, so its `heartbeatTime` says the
/// agent is alive (readers call an agent dead after [`STALE_AFTER`]).
#[cfg(test)]
pub(crate) const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
/// How old a record's heartbeat may be while the agent still counts as alive: three missed
/// heartbeats.
#[cfg(test)]
pub(crate) const STALE_AFTER: Duration = Duration::from_secs(30);

/// The local heartbeat: how often, the clock it is stamped with, and the engine loop's own
/// heartbeat (the one `/healthz` reads): the record beats only while the engine does, so a
/// wedged engine does not look alive through a sink that still runs.
#[derive(Debug, Clone)]
pub(crate) struct HeartbeatConfig {
    pub every: Duration,
    pub clock: Arc<dyn Clock>,
    pub engine: Arc<Heartbeat>,
}

impl HeartbeatConfig {
    fn engine_alive(&self) -> bool {
        self.engine.age_ms(&*self.clock) <= crate::engine_loop::STALE_MS
    }
}

/// Why `state.json` could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateReadError {
    #[error("cannot read {path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    /// Written by another (newer) agent: its layout is unknown here, so it is not read at all.
    #[error("{path} is state version {found}; this agent reads version {known} only (written by a newer agent?)")]
    UnknownVersion {
        path: PathBuf,
        found: u64,
        known: u32,
    },
    /// Saved by the agent of another node (a data directory another agent used, or one copied
    /// from another machine): its faults are not this node's.
    #[error("{path} is the saved state of {}, not of this node {node:?} (a data directory another agent used?)", saved_by(found))]
    OtherNode {
        path: PathBuf,
        found: String,
        node: String,
    },
}

/// The node a refused state names, for its error: `found` is empty when it names none.
fn saved_by(found: &str) -> String {
    if found.is_empty() {
        "no node".to_string()
    } else {
        format!("node {found:?}")
    }
}

/// Largest `state.json` read. A node's state is a few hundred faults at most (well under a
/// megabyte); anything bigger is not ours to parse.
pub(crate) const MAX_STATE_BYTES: u64 = 32 << 20;

/// Reads `state.json`; a missing file is `Ok(None)`. The version is read first and must be
/// [`STATE_VERSION`](crate::engine_loop::STATE_VERSION): a file of another version is refused,
/// never read as if it were this one. A state that names another node than `node`, or none, is
/// refused too: its faults cannot be told to be this node's.
pub fn read_state(dir: &Path, node: &str) -> Result<Option<PersistedState>, StateReadError> {
    let path = dir.join(STATE_FILE);
    let unreadable = |reason: String| StateReadError::Unreadable {
        path: path.clone(),
        reason,
    };
    use crate::operator_file::{read_bytes, OperatorFileError};
    let bytes = match read_bytes(&path, MAX_STATE_BYTES) {
        Err(OperatorFileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => return Err(unreadable(e.to_string())),
        Ok(bytes) => bytes,
    };
    #[derive(serde::Deserialize)]
    struct Versioned {
        version: Option<serde_json::Value>,
    }
    let known = crate::engine_loop::STATE_VERSION;
    let head: Versioned =
        serde_json::from_slice(&bytes).map_err(|e| unreadable(format!("cannot parse: {e}")))?;
    match head.version {
        None => return Err(unreadable("cannot parse: no \"version\"".into())),
        Some(v) if v.as_u64() == Some(u64::from(known)) => {}
        Some(v) => match v.as_u64() {
            Some(found) => {
                return Err(StateReadError::UnknownVersion { path, found, known });
            }
            None => return Err(unreadable(format!("cannot parse: \"version\" is {v}"))),
        },
    }
    let state: PersistedState =
        serde_json::from_slice(&bytes).map_err(|e| unreadable(format!("cannot parse: {e}")))?;
    match state.node.as_deref() {
        Some(found) if found == node => Ok(Some(state)),
        found => Err(StateReadError::OtherNode {
            path,
            found: found.unwrap_or_default().to_string(),
            node: node.to_string(),
        }),
    }
}

/// After shutdown, how long the sink keeps trying to write the final snapshot. A disk that is
/// full or read-only must not hold the agent: past this the process exits with the last state
/// it managed to write (a restart continues from there).
pub(crate) const FLUSH_DEADLINE: Duration = Duration::from_secs(5);

/// The file sink's outputs besides the files.
#[derive(Debug, Clone)]
pub(crate) struct FileSinkSignals {
    pub status: watch::Sender<RecordStatus>,
    /// The highest engine-loop marker written to `state.json` (a clear request waits for it).
    pub persisted: watch::Sender<u64>,
}

/// The file sink's flags.
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Local record writes: after a burst of `--write-burst` writes, at most one per this
    /// interval; changes in between are coalesced into the next write.
    #[arg(long, env = "FAULTLINE_WRITE_INTERVAL", default_value = "200ms", value_parser = humantime::parse_duration)]
    pub write_interval: Duration,
    /// Local record writes that may go out back to back before `--write-interval` applies.
    #[arg(long, env = "FAULTLINE_WRITE_BURST", default_value_t = 3)]
    pub write_burst: u32,
    /// How often the local record is rewritten when nothing changed, so that its
    /// `heartbeatTime` shows the agent alive (`faultline wait-healthy` checks it).
    #[arg(long, env = "FAULTLINE_HEARTBEAT_INTERVAL", default_value = "10s", value_parser = parse_heartbeat)]
    pub heartbeat_interval: Duration,
}

/// `--heartbeat-interval`: between 1 s and 10 s, so that three heartbeats fit in the 30 s that
/// readers (`faultline wait-healthy --stale-after`) allow by default.
fn parse_heartbeat(s: &str) -> Result<Duration, FlagError> {
    let d = humantime::parse_duration(s)?;
    if !(Duration::from_secs(1)..=Duration::from_secs(10)).contains(&d) {
        let range = "1s..=10s";
        return Err(FlagError::Outside {
            value: s.into(),
            range,
        });
    }
    Ok(d)
}

/// The file sink, as the daemon starts it.
#[derive(Debug)]
pub(crate) struct FileSink {
    pub dirs: Dirs,
    pub flags: Flags,
    pub signals: FileSinkSignals,
    /// The engine loop's heartbeat: the record beats only while the engine does.
    pub engine: Arc<Heartbeat>,
}

impl Component for FileSink {
    const NAME: &'static str = "file";

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        let budget = WriteBudget::new(
            self.flags.write_interval,
            self.flags.write_burst,
            cx.clock.instant(),
        );
        let heartbeat = HeartbeatConfig {
            every: self.flags.heartbeat_interval,
            clock: cx.clock.clone(),
            engine: self.engine,
        };
        let task = run(
            self.dirs,
            cx.snapshots.clone(),
            cx.metrics.clone(),
            budget,
            self.signals,
            heartbeat,
            cx.shutdown.clone(),
        );
        Ok(Handle::spawn(Self::NAME, task))
    }
}

/// Runs the sink until the snapshot channel closes (the engine stopped) or shutdown; at shutdown
/// it writes the last snapshot it saw, trying for at most [`FLUSH_DEADLINE`].
/// Between changes the record is rewritten every `heartbeat.every` (only the record, with a new
/// `heartbeatTime`); while writes fail the heartbeat stops with them.
pub(crate) async fn run(
    dirs: Dirs,
    mut rx: watch::Receiver<Option<Snapshot>>,
    metrics: Arc<Metrics>,
    mut budget: WriteBudget,
    signals: FileSinkSignals,
    heartbeat: HeartbeatConfig,
    shutdown: CancellationToken,
) {
    let label = SinkLabel { sink: "file" };
    let clock = heartbeat.clock.clone();
    let mut written: Option<u64> = None;
    // The revision whose state was saved last in this run.
    let mut saved = 0u64;
    let mut backoff =
        crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
    let mut flush_until: Option<tokio::time::Instant> = None;
    let mut last_write = clock.instant();
    // The heartbeat last written: kept, not renewed, while the engine loop is not running (a
    // retry of a state that cannot be saved rewrites the record too).
    let mut stamped: Option<Beat> = None;
    loop {
        let mut beat = false;
        let closed = tokio::select! {
            c = rx.changed() => c.is_err(),
            _ = tokio::time::sleep_until(last_write + heartbeat.every), if written.is_some() => {
                beat = true;
                false
            }
        };
        let wait = budget.wait(clock.instant());
        if !closed && !wait.is_zero() && !shutdown.is_cancelled() {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => {}
            }
        }
        loop {
            let snap = rx.borrow_and_update().clone();
            let Some(snap) = snap else { break };
            let record_only = written == Some(snap.revision);
            if record_only && !(beat && heartbeat.engine_alive()) {
                if beat {
                    warn!("the engine loop has not run for 30 s; the record's heartbeat stops");
                    // Checked again at the next interval.
                    last_write = clock.instant();
                }
                break;
            }
            let d = dirs.clone();
            let started = clock.since_boot();
            let snap2 = snap.clone();
            let now = match &stamped {
                Some(last) if !heartbeat.engine_alive() => last.clone(),
                _ => Beat::now(&*heartbeat.clock),
            };
            let beat_written = now.clone();
            let order = Order::of(&snap, saved);
            let result = tokio::task::spawn_blocking(move || {
                write_snapshot(&d, &snap2, &now, record_only, order)
            })
            .await
            .unwrap_or_else(|e| {
                Err(FileSinkError::Io {
                    path: dirs.record.clone(),
                    source: std::io::Error::other(e.to_string()),
                })
            });
            // The record is on disk with this heartbeat (even when the state is not: the state
            // is retried with the backoff, the heartbeat is fresh).
            if result
                .as_ref()
                .map_or_else(FileSinkError::record_written, |_| true)
            {
                set_heartbeat(&metrics, &beat_written);
                stamped = Some(beat_written);
                last_write = clock.instant();
            }
            match result {
                Ok(()) => {
                    metrics.sink_writes.get_or_create(&label).inc();
                    metrics
                        .sink_write_seconds
                        .get_or_create(&label)
                        .observe(clock.since_boot().saturating_sub(started).as_secs_f64());
                    debug!(
                        revision = snap.revision,
                        latency_us = clock
                            .instant()
                            .saturating_duration_since(snap.applied_at)
                            .as_micros() as u64,
                        "record written"
                    );
                    written = Some(snap.revision);
                    if !record_only {
                        saved = snap.revision;
                        budget.spend(clock.instant());
                    }
                    // Reported on the first success of a run too, which clears a record-file
                    // fault the last run left behind.
                    signals.status.send_if_modified(|s| {
                        let changed = !s.is_written();
                        *s = RecordStatus::Written;
                        changed
                    });
                    signals.persisted.send_if_modified(|m| {
                        let newer = snap.marker > *m;
                        *m = (*m).max(snap.marker);
                        newer
                    });
                    backoff.reset();
                    break;
                }
                Err(e) => {
                    metrics.sink_errors.get_or_create(&label).inc();
                    // What is on disk (the record, or the state behind it) is now older than
                    // the agent's state: not ready, and say so in the record the agent serves.
                    signals.status.send_if_modified(|s| {
                        let first = !matches!(s, RecordStatus::Failing(_));
                        if first {
                            *s = RecordStatus::Failing(e.to_string());
                        }
                        first
                    });
                    let mut pause = backoff.next_delay();
                    warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "writing the local record failed");
                    if e.record_written() {
                        // Retried at least as often as the heartbeat, which the retry carries.
                        pause = pause.min(heartbeat.every);
                    }
                    if shutdown.is_cancelled() {
                        let until =
                            *flush_until.get_or_insert_with(|| clock.instant() + FLUSH_DEADLINE);
                        let left = until.saturating_duration_since(clock.instant());
                        if left.is_zero() {
                            warn!(deadline_s = FLUSH_DEADLINE.as_secs(), "giving up on writing the final record; the last one written stays on disk");
                            return;
                        }
                        pause = pause.min(left);
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        // Shutdown during the pause: try again now, under the flush deadline.
                        _ = shutdown.cancelled(), if !shutdown.is_cancelled() => {}
                    }
                }
            }
        }
        if closed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;
    use crate::engine_loop::test_snapshot;

    #[test]
    fn corrupt_state_is_reported_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_state(dir.path(), "n1"), Ok(None));
        std::fs::write(dir.path().join(STATE_FILE), b"{not json").unwrap();
        let err = read_state(dir.path(), "n1").unwrap_err().to_string();
        assert!(
            err.contains("cannot parse") && err.contains("state.json"),
            "{err}"
        );
    }

    /// A state file of another version is refused with both versions named, not read as this
    /// one (a field that changed meaning would be misread silently). A file with no version,
    /// or a version that is not a number, is unreadable.
    #[test]
    fn state_of_another_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(STATE_FILE);
        let ours = serde_json::to_value(PersistedState {
            version: crate::engine_loop::STATE_VERSION,
            node: Some("n1".into()),
            ..Default::default()
        })
        .unwrap();
        std::fs::write(&path, ours.to_string()).unwrap();
        assert!(matches!(read_state(dir.path(), "n1"), Ok(Some(_))));

        let mut newer = ours.clone();
        newer["version"] = 2.into();
        std::fs::write(&path, newer.to_string()).unwrap();
        let err = read_state(dir.path(), "n1").unwrap_err();
        assert_eq!(
            err,
            StateReadError::UnknownVersion {
                path: path.clone(),
                found: 2,
                known: crate::engine_loop::STATE_VERSION
            }
        );
        assert!(
            err.to_string()
                .contains("state version 2; this agent reads version 1"),
            "{err}"
        );
        for (doc, why) in [
            (serde_json::json!({"kmsg_cursor": 3}), "no \"version\""),
            (serde_json::json!({"version": "1"}), "\"version\" is \"1\""),
            (serde_json::json!({"version": -1}), "\"version\" is -1"),
        ] {
            std::fs::write(&path, doc.to_string()).unwrap();
            let err = read_state(dir.path(), "n1").unwrap_err().to_string();
            assert!(err.contains(why), "{doc}: {err}");
        }
        // Bounded: a huge file is not read whole.
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(MAX_STATE_BYTES + 10).unwrap();
        let err = read_state(dir.path(), "n1").unwrap_err().to_string();
        assert!(err.contains("larger than"), "{err}");
    }

    /// A state that names another node, or none, is refused with both named; one naming this
    /// node is read.
    #[test]
    fn state_of_another_node_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(STATE_FILE);
        let write = |node: Option<&str>| {
            let state = PersistedState {
                version: crate::engine_loop::STATE_VERSION,
                node: node.map(str::to_string),
                ..Default::default()
            };
            std::fs::write(&path, serde_json::to_vec(&state).unwrap()).unwrap();
        };
        write(Some("n1"));
        assert!(matches!(read_state(dir.path(), "n1"), Ok(Some(_))));
        write(None);
        let err = read_state(dir.path(), "n1").unwrap_err();
        assert!(err.to_string().contains("saved state of no node"), "{err}");
        write(Some("n2"));
        let err = read_state(dir.path(), "n1").unwrap_err();
        assert!(matches!(err, StateReadError::OtherNode { .. }));
        assert!(
            err.to_string()
                .contains("saved state of node \"n2\", not of this node \"n1\""),
            "{err}"
        );
    }

    /// The largest files the caps allow are read back whole at the next start, with room to
    /// spare: `max_active` and `max_recovered` at their largest, plus the node's overflow fault
    /// and every detector down, each fault at its largest (the longest code the policy accepts,
    /// a message, device name and UUID of control characters, which JSON writes six bytes
    /// each, 100 occurrences, every source, escalated); 1,024 device identities. Unbounded,
    /// 100,000 distinct faults would make a 57 MiB state.json that the next start refuses,
    /// losing every fault.
    #[test]
    fn the_largest_state_the_caps_allow_is_read_back() {
        use faultline_core::catalog::{Catalog, FaultCode};
        use faultline_core::engine::{Ctx, DetectorState, DeviceRef, Engine, Observation, Signal};
        use faultline_core::policy::{Policy, MAX_ACTIVE_LIMIT, MAX_RECOVERED_LIMIT};
        use faultline_core::record::{AgentStatus, NodeRecord, PolicyStatus, Source};

        let code = "C".repeat(63);
        let policy = Policy::parse(&format!(
            "max_active: {MAX_ACTIVE_LIMIT}\nmax_active_per_device: {MAX_ACTIVE_LIMIT}\n\
             max_recovered: {MAX_RECOVERED_LIMIT}\nrecovered_retention: 10y\nburst_window: 0s\n\
             escalation:\n  - codes: [{code}]\n    count: 2\n    window: 366d\n    handling: ManuallySeparateNPU\n"
        ))
        .unwrap();
        let catalog = Catalog::builtin().unwrap();
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut engine = Engine::new();
        let mut now = faultline_core::time::Timestamp::from_second(1_700_000_000).unwrap();
        let mut step = |engine: &mut Engine, obs| {
            now += faultline_core::time::SignedDuration::from_millis(1_001);
            engine.step(ctx, obs, now);
        };
        // Cut once here as the engine cuts them, so the loop below does not repeat the work.
        let cut = |mut s: String, max| {
            faultline_core::engine::clamp_json(&mut s, max);
            s
        };
        let wide = |i: usize| {
            cut(
                format!("{i:05}{}", "\u{1}".repeat(300)),
                faultline_core::engine::MAX_NAME_JSON,
            )
        };
        let message = cut(
            "\u{1}".repeat(300),
            faultline_core::engine::MAX_MESSAGE_JSON,
        );
        let sources = [Source::Kmsg, Source::Nvml, Source::Ascend, Source::Peer];
        let fill =
            |engine: &mut Engine, step: &mut dyn FnMut(&mut Engine, Observation), from, to| {
                for i in from..to {
                    let device = DeviceRef {
                        name: Some(wide(i)),
                        uuid: Some(wide(i)),
                        ..Default::default()
                    };
                    for n in 0..faultline_core::policy::MAX_OCCURRENCES {
                        let mut s = Signal::new(
                            sources[n % sources.len()],
                            FaultCode::named(&code),
                            Some(device.clone()),
                            message.clone(),
                        );
                        s.count = u64::MAX / 2;
                        step(engine, Observation::Signal(s));
                    }
                }
            };
        // The history first (cleared by an operator), then the active faults and one more.
        fill(&mut engine, &mut step, 0, MAX_RECOVERED_LIMIT);
        step(
            &mut engine,
            Observation::OperatorClear {
                code: None,
                device: None,
            },
        );
        let end = MAX_RECOVERED_LIMIT + MAX_ACTIVE_LIMIT + 1;
        fill(&mut engine, &mut step, MAX_RECOVERED_LIMIT, end);
        let detectors = [
            "kmsg",
            "nvml",
            "ascend-npu",
            "ascend-net",
            "peer",
            "policy",
            "record-file",
            "kube-node",
            "kube-faults",
            "public-faults",
            "boot-id",
        ];
        for name in detectors {
            step(
                &mut engine,
                Observation::Detector {
                    name: name.into(),
                    state: DetectorState::Down,
                    reason: Some("\u{1}".repeat(300)),
                },
            );
        }
        for i in 0..faultline_core::engine::MAX_DEVICES + 10 {
            let pci = format!("{:04x}:{:02x}:{:02x}.0", i >> 8, i & 0xff, i % 32);
            step(
                &mut engine,
                Observation::DeviceSeen {
                    pci: pci.parse().unwrap(),
                    uuid: Some(wide(i)),
                    index: Some(i as u32),
                },
            );
        }
        let view = engine.view(&policy);
        let active = view.faults.iter().filter(|f| f.active).count();
        assert_eq!(
            active,
            MAX_ACTIVE_LIMIT + 1 + detectors.len(),
            "the cap holds"
        );
        assert_eq!(view.faults.len(), active + MAX_RECOVERED_LIMIT);
        let record = NodeRecord {
            api_version: faultline_core::record::API_VERSION.into(),
            node: "n".repeat(253),
            health: view.health,
            handling: view.handling,
            update_time: now,
            check_code: faultline_core::record::check_code(&view.faults),
            faults: view.faults,
            dropped_faults: u64::MAX,
            agent: AgentStatus {
                version: "0".into(),
                policy: PolicyStatus {
                    source: "p".repeat(4096),
                    checksum: "0".repeat(64),
                    error: Some("e".repeat(4096)),
                    loading: None,
                },
                detectors: Vec::new(),
                taint_budget: None,
                heartbeat_time: None,
                heartbeat_boot: None,
            },
        };
        let mut snap = test_snapshot(1, 0);
        snap.record = Arc::new(record);
        snap.state = Arc::new(PersistedState {
            version: crate::engine_loop::STATE_VERSION,
            kmsg_cursor: Some(u64::MAX),
            kmsg_unsequenced: u64::MAX,
            kmsg_log: Some(u64::MAX),
            kmsg_bytes: Some(u64::MAX),
            kmsg_hash: Some(u64::MAX),
            boot_time: Some(i64::MIN),
            engine,
            node: Some("n".repeat(253)),
            ..Default::default()
        });
        let dir = tempfile::tempdir().unwrap();
        let beat = Beat {
            wall: now,
            boot: Some(faultline_core::record::BootClock {
                boot_id: "b".repeat(36),
                since_boot_ms: u64::MAX,
            }),
        };
        write_snapshot(
            &Dirs::one(dir.path().to_path_buf()),
            &snap,
            &beat,
            false,
            Order::StateFirst,
        )
        .unwrap();
        let size = |f: &str| std::fs::metadata(dir.path().join(f)).unwrap().len();
        let (state, faults) = (size(STATE_FILE), size(FAULTS_FILE));
        eprintln!("largest state.json {state} bytes, faults.json {faults} bytes");
        assert!(state <= MAX_STATE_BYTES / 2, "state.json {state} bytes");
        assert!(
            faults <= crate::cli::MAX_RECORD_BYTES / 2,
            "faults.json {faults} bytes"
        );
        // `/v1/record` serves the same document: `faultline hosts --members` reads it whole.
        assert!(faults <= crate::cli::members::MAX_ANSWER_BYTES as u64);
        let back = read_state(dir.path(), &"n".repeat(253))
            .unwrap()
            .expect("read back");
        assert!(back == *snap.state, "state.json reads back as written");
        let mut stamped = (*snap.record).clone();
        stamped.agent.heartbeat_time = Some(now);
        stamped.agent.heartbeat_boot = beat.boot;
        let record = crate::cli::read_record(&dir.path().join(FAULTS_FILE)).unwrap();
        assert!(record == stamped, "faults.json reads back as written");
    }

    fn start(
        dir: PathBuf,
    ) -> (
        watch::Sender<Option<Snapshot>>,
        FileSinkSignals,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        start_beating(dir, HEARTBEAT_INTERVAL)
    }

    fn start_beating(
        dir: PathBuf,
        every: Duration,
    ) -> (
        watch::Sender<Option<Snapshot>>,
        FileSinkSignals,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let (tx, rx) = watch::channel(None);
        let signals = FileSinkSignals {
            status: watch::channel(RecordStatus::NotYetWritten).0,
            persisted: watch::channel(0).0,
        };
        let shutdown = CancellationToken::new();
        let budget = WriteBudget::new(Duration::from_millis(10), 3, tokio::time::Instant::now());
        let task = tokio::spawn(run(
            Dirs::one(dir),
            rx,
            Arc::new(Metrics::new()),
            budget,
            signals.clone(),
            HeartbeatConfig {
                every,
                clock: Arc::new(crate::clock::SystemClock),
                engine: engine_beating(),
            },
            shutdown.clone(),
        ));
        (tx, signals, shutdown, task)
    }

    fn ready(s: &FileSinkSignals) -> bool {
        s.status.borrow().is_written()
    }

    /// Written records make the agent ready and report their marker; a record that cannot be
    /// written makes it not ready (root ignores permissions, so the "disk" here is a path under
    /// a regular file: every write fails with ENOTDIR).
    #[tokio::test]
    async fn readiness_follows_whether_the_newest_record_is_on_disk() {
        let tmp = tempfile::tempdir().unwrap();
        let (tx, signals, shutdown, task) = start(tmp.path().to_path_buf());
        let mut status = signals.status.subscribe();
        tx.send_replace(Some(test_snapshot(1, 7)));
        let mut persisted = signals.persisted.subscribe();
        tokio::time::timeout(Duration::from_secs(5), persisted.wait_for(|m| *m == 7))
            .await
            .expect("marker reported")
            .unwrap();
        assert!(ready(&signals));
        assert!(tmp.path().join(FAULTS_FILE).exists());
        // The first success is reported even with no failure before it (it clears a
        // record-file fault an earlier run left behind).
        assert!(status.has_changed().unwrap());
        assert_eq!(*status.borrow_and_update(), RecordStatus::Written);
        shutdown.cancel();
        drop(tx);
        task.await.unwrap();

        let not_a_dir = tmp.path().join("plain-file");
        std::fs::write(&not_a_dir, b"x").unwrap();
        let (tx, signals, shutdown, task) = start(not_a_dir);
        signals.status.send_replace(RecordStatus::Written);
        tx.send_replace(Some(test_snapshot(1, 3)));
        for _ in 0..100 {
            if !ready(&signals) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!ready(&signals), "a failed write is not ready");
        assert_eq!(*signals.persisted.borrow(), 0, "nothing reported persisted");
        let why = match signals.status.borrow().clone() {
            RecordStatus::Failing(why) => why,
            other => panic!("the failure is reported: {other:?}"),
        };
        assert!(why.contains("plain-file"), "{why}");
        shutdown.cancel();
        drop(tx);
        task.await.unwrap();
    }

    /// The data directory cannot take `state.json` (here a non-empty directory stands where the
    /// file goes: the rename fails, for root too). The record is still written and its heartbeat
    /// goes on; the failure is reported and nothing is acknowledged as persisted. When the data
    /// directory works again, the state is saved and the marker reported.
    #[tokio::test]
    async fn a_state_that_cannot_be_saved_does_not_stop_the_record() {
        let tmp = tempfile::tempdir().unwrap();
        let blocked = tmp.path().join(STATE_FILE);
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("x"), b"x").unwrap();
        let (tx, signals, shutdown, task) =
            start_beating(tmp.path().to_path_buf(), Duration::from_millis(100));
        tx.send_replace(Some(test_snapshot(1, 5)));
        let mut status = signals.status.subscribe();
        let why = tokio::time::timeout(
            Duration::from_secs(5),
            status.wait_for(|s| matches!(s, RecordStatus::Failing(_))),
        )
        .await
        .expect("the failure is reported")
        .unwrap()
        .clone();
        assert!(
            matches!(&why, RecordStatus::Failing(w) if w.contains("saved state was not")),
            "{why:?}"
        );
        assert!(
            tmp.path().join(FAULTS_FILE).exists(),
            "the record is written"
        );
        let first = heartbeat_of(tmp.path()).unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        let later = heartbeat_of(tmp.path()).unwrap();
        assert!(later > first, "the record's heartbeat goes on");
        assert_eq!(*signals.persisted.borrow(), 0, "nothing acknowledged");
        // The data directory works again: saved, acknowledged, written.
        std::fs::remove_dir_all(&blocked).unwrap();
        let mut persisted = signals.persisted.subscribe();
        tokio::time::timeout(Duration::from_secs(10), persisted.wait_for(|m| *m == 5))
            .await
            .expect("saved once the directory works")
            .unwrap();
        assert!(blocked.is_file());
        assert!(signals.status.borrow().is_written());
        shutdown.cancel();
        drop(tx);
        task.await.unwrap();
    }

    /// `test_snapshot` with its record dated `revision` seconds after the epoch (so the records
    /// in the file can be told apart), its marker `revision`, saved first from `save_first`.
    fn dated(revision: u64, save_first: u64) -> Snapshot {
        let mut snap = test_snapshot(revision, revision);
        let mut record = (*snap.record).clone();
        record.update_time = Timestamp::from_second(revision as i64).unwrap();
        snap.record = Arc::new(record);
        snap.save_first = save_first;
        snap
    }

    /// The date of the record in `dir`, in seconds.
    fn record_date(dir: &Path) -> Option<i64> {
        let text = std::fs::read_to_string(dir.join(FAULTS_FILE)).ok()?;
        serde_json::from_str::<faultline_core::record::NodeRecord>(&text)
            .ok()
            .map(|r| r.update_time.as_second())
    }

    /// With a slow data disk (here its fsync waits until the test lets it go), a
    /// record whose changes a restart makes again (kernel-log records past the saved cursor) is
    /// in `faults.json` while its state is still being saved; a record holding a change a
    /// restart would not make again (the restored state, an operator's clear) waits for its
    /// state.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_a_restart_makes_again_does_not_wait_for_a_slow_state() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = Dirs {
            record: tmp.path().join("run"),
            data: tmp.path().join("data"),
        };
        std::fs::create_dir(&dirs.record).unwrap();
        std::fs::create_dir(&dirs.data).unwrap();
        let (syncing_tx, syncing) = std::sync::mpsc::channel::<PathBuf>();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = std::sync::Mutex::new(released);
        let slow = crate::atomic_file::hooks::on_sync(&dirs.data, move |path| {
            let _ = syncing_tx.send(path.to_path_buf());
            // Bounded, so that a failing test ends instead of holding its runtime.
            let _ = released
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(30));
        });
        let state_syncing = || {
            let path =
                tokio::task::block_in_place(|| syncing.recv_timeout(Duration::from_secs(10)))
                    .expect("the state is being saved");
            assert_eq!(path, dirs.data.join(STATE_FILE));
        };
        let (tx, rx) = watch::channel(None);
        let signals = FileSinkSignals {
            status: watch::channel(RecordStatus::NotYetWritten).0,
            persisted: watch::channel(0).0,
        };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            dirs.clone(),
            rx,
            Arc::new(Metrics::new()),
            WriteBudget::new(Duration::from_millis(10), 3, tokio::time::Instant::now()),
            signals.clone(),
            HeartbeatConfig {
                every: HEARTBEAT_INTERVAL,
                clock: Arc::new(crate::clock::SystemClock),
                engine: engine_beating(),
            },
            shutdown.clone(),
        ));
        let saved = |m: u64| {
            let mut persisted = signals.persisted.subscribe();
            async move {
                tokio::time::timeout(Duration::from_secs(10), persisted.wait_for(|p| *p >= m))
                    .await
                    .expect("saved")
                    .unwrap();
            }
        };

        // The restored state: saved first.
        tx.send_replace(Some(dated(1, 1)));
        state_syncing();
        assert_eq!(record_date(&dirs.record), None, "shown before it is saved");
        release.send(()).unwrap();
        saved(1).await;
        assert_eq!(record_date(&dirs.record), Some(1));

        // A kernel-log record: in the file while its state is still being synced.
        tx.send_replace(Some(dated(2, 1)));
        let shown = tokio::time::timeout(Duration::from_secs(10), async {
            while record_date(&dirs.record) != Some(2) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(shown.is_ok(), "the record waited for the state");
        state_syncing();
        assert_eq!(*signals.persisted.borrow(), 1, "not saved yet");
        release.send(()).unwrap();
        saved(2).await;

        // An operator's clear: saved first.
        tx.send_replace(Some(dated(3, 3)));
        state_syncing();
        assert_eq!(
            record_date(&dirs.record),
            Some(2),
            "the clear is shown before it is saved"
        );
        release.send(()).unwrap();
        saved(3).await;
        assert_eq!(record_date(&dirs.record), Some(3));

        drop(slow);
        shutdown.cancel();
        drop(tx);
        task.await.unwrap();
    }

    /// An engine heartbeat kept fresh by a thread, as the engine loop keeps the agent's.
    fn engine_beating() -> Arc<Heartbeat> {
        let h = Arc::new(Heartbeat::default());
        let beating = h.clone();
        std::thread::spawn(move || loop {
            beating.beat(&crate::clock::SystemClock);
            std::thread::sleep(Duration::from_millis(50));
        });
        h
    }

    fn heartbeat_of(dir: &Path) -> Option<Timestamp> {
        let text = std::fs::read_to_string(dir.join(FAULTS_FILE)).ok()?;
        serde_json::from_str::<faultline_core::record::NodeRecord>(&text)
            .ok()?
            .agent
            .heartbeat_time
    }

    /// `faultline_heartbeat_timestamp_seconds` is the heartbeat written into the
    /// record (the injected clock's wall time, in seconds), renewed with it, and left at its last
    /// value while the engine loop does not run: an alert on its age sees the agent dead when a
    /// reader of the record does.
    #[tokio::test]
    async fn the_heartbeat_metric_is_the_records_heartbeat() {
        use crate::clock::testing::FakeClock;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let clock = Arc::new(FakeClock::new(1_790_000_000_500, 1_000));
        let engine = Arc::new(Heartbeat::default());
        engine.beat(&*clock);
        let metrics = Arc::new(Metrics::new());
        let (tx, rx) = watch::channel(None);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            Dirs::one(dir.clone()),
            rx,
            metrics.clone(),
            WriteBudget::new(Duration::from_millis(10), 3, tokio::time::Instant::now()),
            FileSinkSignals {
                status: watch::channel(RecordStatus::NotYetWritten).0,
                persisted: watch::channel(0).0,
            },
            HeartbeatConfig {
                every: Duration::from_millis(20),
                clock: clock.clone(),
                engine: engine.clone(),
            },
            shutdown.clone(),
        ));
        tx.send_replace(Some(test_snapshot(1, 0)));
        let beat_at = |wall: Timestamp| {
            let (dir, metrics) = (dir.clone(), metrics.clone());
            async move {
                tokio::time::timeout(Duration::from_secs(10), async {
                    while heartbeat_of(&dir) != Some(wall)
                        || metrics.heartbeat.get() != wall.as_millisecond() as f64 / 1000.0
                    {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
                .await
                .is_ok()
            }
        };
        assert!(beat_at(clock.now()).await, "the first write");
        assert_eq!(metrics.heartbeat.get(), 1_790_000_000.5);
        clock.advance(Duration::from_secs(5));
        engine.beat(&*clock);
        assert!(beat_at(clock.now()).await, "renewed with the record");
        assert_eq!(metrics.heartbeat.get(), 1_790_000_005.5);
        // The engine loop stops beating: 40 s later neither the record nor the metric moves.
        clock.advance(Duration::from_secs(40));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(metrics.heartbeat.get(), 1_790_000_005.5);
        assert_eq!(
            heartbeat_of(tmp.path()).map(|t| t.as_millisecond()),
            Some(1_790_000_005_500)
        );
        shutdown.cancel();
        drop(tx);
        task.await.unwrap();
    }

    /// With nothing changing, the record is rewritten every interval with a newer heartbeat
    /// (the state file is not rewritten). While the record cannot be written the heartbeat
    /// stops with it, and it resumes when writes work again.
    #[tokio::test]
    async fn the_heartbeat_rewrites_the_record_and_stops_while_writes_fail() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let (tx, signals, shutdown, task) = start_beating(dir.clone(), Duration::from_millis(100));
        tx.send_replace(Some(test_snapshot(1, 0)));
        let beats = || async {
            let mut seen = Vec::new();
            for _ in 0..200 {
                if let Some(b) = heartbeat_of(&dir) {
                    if seen.last() != Some(&b) {
                        seen.push(b);
                    }
                }
                if seen.len() >= 3 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        };
        let mut first = signals.status.subscribe();
        tokio::time::timeout(Duration::from_secs(5), first.wait_for(|s| s.is_written()))
            .await
            .expect("first write")
            .unwrap();
        let state_before = std::fs::metadata(dir.join(STATE_FILE))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(beats().await.len(), 3, "the heartbeat advances");
        let state_after = std::fs::metadata(dir.join(STATE_FILE))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(
            state_before, state_after,
            "heartbeats rewrite only the record"
        );

        // The record's place becomes a directory: writes fail, the heartbeat stops.
        std::fs::remove_file(dir.join(FAULTS_FILE)).unwrap();
        std::fs::create_dir(dir.join(FAULTS_FILE)).unwrap();
        let mut status = signals.status.subscribe();
        tokio::time::timeout(
            Duration::from_secs(5),
            status.wait_for(|s| matches!(s, RecordStatus::Failing(_))),
        )
        .await
        .expect("the failing write is reported")
        .unwrap();
        // Three heartbeat intervals later no write has succeeded: a heartbeat write would have
        // reported the record written again.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(matches!(*status.borrow(), RecordStatus::Failing(_)));

        std::fs::remove_dir(dir.join(FAULTS_FILE)).unwrap();
        let resumed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if heartbeat_of(&dir).is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(resumed.is_ok(), "the heartbeat resumes");
        shutdown.cancel();
        drop(tx);
        task.await.unwrap();
    }

    /// A wedged engine loop (its heartbeat 30 s old) stops the record's heartbeat: the sink
    /// alone running does not make the agent look alive.
    #[tokio::test]
    async fn the_heartbeat_stops_when_the_engine_loop_does() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let (tx, rx) = watch::channel(None);
        let signals = FileSinkSignals {
            status: watch::channel(RecordStatus::NotYetWritten).0,
            persisted: watch::channel(0).0,
        };
        let shutdown = CancellationToken::new();
        let stuck = Arc::new(Heartbeat::default()); // never beat
        let task = tokio::spawn(run(
            Dirs::one(dir.clone()),
            rx,
            Arc::new(Metrics::new()),
            WriteBudget::new(Duration::from_millis(10), 3, tokio::time::Instant::now()),
            signals.clone(),
            HeartbeatConfig {
                every: Duration::from_millis(50),
                clock: Arc::new(crate::clock::SystemClock),
                engine: stuck.clone(),
            },
            shutdown.clone(),
        ));
        tx.send_replace(Some(test_snapshot(1, 0)));
        let mut first = signals.status.subscribe();
        tokio::time::timeout(Duration::from_secs(5), first.wait_for(|s| s.is_written()))
            .await
            .expect("the snapshot itself is written")
            .unwrap();
        let written = heartbeat_of(&dir).unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(
            heartbeat_of(&dir),
            Some(written),
            "no heartbeat while the engine is stuck"
        );
        stuck.beat(&crate::clock::SystemClock);
        let resumed = tokio::time::timeout(Duration::from_secs(5), async {
            while heartbeat_of(&dir) == Some(written) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(resumed.is_ok(), "the heartbeat resumes with the engine");
        shutdown.cancel();
        drop(tx);
        task.await.unwrap();
    }

    /// SIGTERM while the record cannot be written: the sink stops within the flush deadline
    /// instead of retrying forever (the engine loop still holds its sender, as in the agent
    /// while it drains).
    #[tokio::test]
    async fn shutdown_finishes_while_the_record_cannot_be_written() {
        let tmp = tempfile::tempdir().unwrap();
        let not_a_dir = tmp.path().join("plain-file");
        std::fs::write(&not_a_dir, b"x").unwrap();
        let (tx, _signals, shutdown, task) = start(not_a_dir);
        tx.send_replace(Some(test_snapshot(1, 0)));
        tokio::time::sleep(Duration::from_millis(300)).await;
        shutdown.cancel();
        let started = std::time::Instant::now();
        tokio::time::timeout(FLUSH_DEADLINE + Duration::from_secs(5), task)
            .await
            .expect("the sink stopped after its flush deadline")
            .unwrap();
        assert!(started.elapsed() >= FLUSH_DEADLINE - Duration::from_millis(500));
        drop(tx);
    }
}
