//! Loads the policy file and reloads it when it changes.
//!
//! The file's directory is watched (notify) rather than the file, because Kubernetes updates a
//! mounted ConfigMap by swapping a symlink; a slow re-check covers missed events. A rejected
//! file leaves the last good policy in force and puts the error into the policy status, which
//! the record and the metrics show. The current policy is published on a `watch` channel.
//!
//! Only a real change is read again. The watcher's own reads of the directory fire inotify
//! events too (open, close-without-write), so only events that can change a file count:
//! create, write, close-after-write, attributes, rename, removal. Then each file the last load
//! read is looked at without opening it ([`Seen`]: device, inode, type, size, modification and
//! change times); unchanged, nothing is read. The periodic re-check and SIGHUP read the files
//! again and compare their content (a write within the file system's timestamp granularity
//! leaves the times as they were); the policy is parsed again only when the content differs.

use std::borrow::Cow;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode};
use notify::{EventKind, RecursiveMode, Watcher};
use sha2::Digest as _;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::component::{Component, Context, Handle, StartError};
use crate::metrics::{Metrics, ReloadLabel, ReloadResult};
use crate::operator_file::{read_text, OperatorFileError, MAX_POLICY_BYTES, MAX_TABLE_BYTES};
use faultline_core::policy::{checksum, LoadedPolicy, Policy, PolicyError};
use faultline_core::record::PolicyStatus;

/// How a file looked, read without opening it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stamp {
    /// `stat` (links followed): identity, type, size, modification and change times.
    Stat {
        dev: u64,
        ino: u64,
        mode: u32,
        size: u64,
        mtime: (i64, i64),
        ctime: (i64, i64),
    },
    /// `stat` failed (missing, no permission).
    Failed(std::io::ErrorKind),
}

fn stamp(path: &Path) -> Stamp {
    match std::fs::metadata(path) {
        Ok(m) => Stamp::Stat {
            dev: m.dev(),
            ino: m.ino(),
            mode: m.mode(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        },
        Err(e) => Stamp::Failed(e.kind()),
    }
}

/// Why a policy file was rejected (its text is the policy status's `error`).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: OperatorFileError,
    },
    #[error("{}: {source}", path.display())]
    Invalid {
        path: PathBuf,
        #[source]
        source: PolicyError,
    },
    #[error("policy reader failed: {0}")]
    Reader(#[source] tokio::task::JoinError),
}

/// The files a load read (the policy, then the tables it names), how each looked just before it
/// was read, and a digest of what was read (or why not).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    files: Vec<(PathBuf, u64, Stamp)>,
    digest: Vec<u8>,
}

impl Seen {
    /// Reads `path` (at most `max` bytes, a regular file only) and notes it.
    fn read(
        &mut self,
        hasher: &mut sha2::Sha256,
        path: &Path,
        max: u64,
    ) -> Result<String, LoadError> {
        self.files.push((path.to_path_buf(), max, stamp(path)));
        read_digested(hasher, path, max)
    }

    /// Whether the files look as they did: by identity and times only, or (`by_content`) by
    /// reading them again and comparing the digest.
    fn unchanged(&self, by_content: bool) -> bool {
        if self.files.iter().any(|(p, _, s)| stamp(p) != *s) {
            return false;
        }
        if !by_content {
            return true;
        }
        let mut hasher = sha2::Sha256::new();
        for (p, max, _) in &self.files {
            let _ = read_digested(&mut hasher, p, *max);
        }
        hasher.finalize().as_slice() == self.digest.as_slice()
    }
}

/// Reads `path` (at most `max` bytes, a regular file only) and adds its name and what was read
/// (or why not) to `hasher`.
fn read_digested(hasher: &mut sha2::Sha256, path: &Path, max: u64) -> Result<String, LoadError> {
    let text = read_text(path, max).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    });
    let (tag, bytes) = match &text {
        Ok(t) => (1u8, Cow::Borrowed(t.as_str())),
        Err(e) => (2, Cow::Owned(e.to_string())),
    };
    hasher.update(path.as_os_str().as_encoded_bytes());
    hasher.update([0, tag]);
    hasher.update(bytes.len().to_le_bytes());
    hasher.update(bytes.as_bytes());
    text
}

/// A load's result and what it read.
#[derive(Debug)]
pub struct Loaded {
    pub result: Result<(Policy, String), LoadError>,
    pub seen: Seen,
}

/// Reads and validates the file and the Ascend tables it names; on error returns the message
/// for the status. The checksum covers all of them, so an edited table is reloaded too.
#[cfg(test)]
pub(crate) fn read_policy(path: &Path) -> Result<(Policy, String), LoadError> {
    read_policy_seen(path).result
}

/// [`read_policy`], saying what it read.
pub(crate) fn read_policy_seen(path: &Path) -> Loaded {
    let mut seen = Seen::default();
    let mut hasher = sha2::Sha256::new();
    let result = read_and_parse(path, &mut seen, &mut hasher);
    seen.digest = hasher.finalize().to_vec();
    Loaded { result, seen }
}

fn read_and_parse(
    path: &Path,
    seen: &mut Seen,
    hasher: &mut sha2::Sha256,
) -> Result<(Policy, String), LoadError> {
    let invalid = |source| LoadError::Invalid {
        path: path.to_path_buf(),
        source,
    };
    let text = seen.read(hasher, path, MAX_POLICY_BYTES)?;
    let policy = Policy::parse(&text).map_err(invalid)?;
    // Relative table paths are relative to the policy file.
    let base = path.parent().unwrap_or(Path::new("."));
    let mut table = |p: &Option<PathBuf>| -> Result<Option<(String, String)>, LoadError> {
        p.as_ref()
            .map(|p| {
                let full = base.join(p);
                seen.read(hasher, &full, MAX_TABLE_BYTES)
                    .map(|t| (full.display().to_string(), t))
            })
            .transpose()
    };
    let codes = table(&policy.ascend.fault_code_file)?;
    let custom = table(&policy.ascend.fault_customization_file)?;
    let mut all = text.clone();
    for (_, t) in codes.iter().chain(custom.iter()) {
        all.push('\0');
        all.push_str(t);
    }
    let policy = policy
        .with_ascend_files(
            codes.as_ref().map(|(p, t)| (p.as_str(), t.as_str())),
            custom.as_ref().map(|(p, t)| (p.as_str(), t.as_str())),
        )
        .map_err(invalid)?;
    Ok((policy, checksum(&all)))
}

/// Whether a notify event can mean a changed file: any but an access, except a close after a
/// write. The watcher's own reads fire open and close-without-write events on the directory;
/// answering them with a read would reload an unchanged policy again and again.
pub(crate) fn is_change(kind: &EventKind) -> bool {
    !matches!(kind, EventKind::Access(a) if *a != AccessKind::Close(AccessMode::Write))
}

/// Applies a (re)load result to the current state. Returns the new state, or `None` when
/// nothing changed.
pub(crate) fn apply_load(
    current: &LoadedPolicy,
    path: &Path,
    result: Result<(Policy, String), LoadError>,
    metrics: &Metrics,
) -> Option<LoadedPolicy> {
    match result {
        Ok((policy, sum)) => {
            if sum == current.status.checksum
                && current.status.error.is_none()
                && current.status.source != "builtin"
            {
                return None;
            }
            count_reload(metrics, ReloadResult::Ok);
            info!(path = %path.display(), checksum = %sum, "policy loaded");
            for warning in policy.warnings() {
                warn!(path = %path.display(), warning = %warning, "policy warning");
            }
            Some(LoadedPolicy {
                policy: Arc::new(policy),
                status: PolicyStatus {
                    source: path.display().to_string(),
                    checksum: sum,
                    error: None,
                    loading: None,
                },
            })
        }
        Err(e) => {
            let msg = e.to_string();
            if current.status.error.as_deref() == Some(msg.as_str())
                && current.status.loading.is_none()
            {
                return None;
            }
            count_reload(metrics, ReloadResult::Rejected);
            warn!(error = %msg, "policy rejected; the previous policy stays in force");
            Some(LoadedPolicy {
                policy: current.policy.clone(),
                status: PolicyStatus {
                    error: Some(msg),
                    loading: None,
                    ..current.status.clone()
                },
            })
        }
    }
}

/// Counts a reload that changed the policy status, and whether the file in force is valid.
fn count_reload(metrics: &Metrics, result: ReloadResult) {
    let valid = matches!(result, ReloadResult::Ok);
    metrics
        .policy_reloads
        .get_or_create(&ReloadLabel { result })
        .inc();
    metrics.policy_valid.set(i64::from(valid));
}

/// Publishes what a (re)load changed; nothing when it changed nothing.
fn publish(
    tx: &watch::Sender<LoadedPolicy>,
    path: &Path,
    result: Result<(Policy, String), LoadError>,
    metrics: &Metrics,
) -> bool {
    tx.send_if_modified(|current| match apply_load(current, path, result, metrics) {
        Some(next) => {
            *current = next;
            true
        }
        None => false,
    })
}

/// Loads the policy once (the built-in default when `path` is `None`).
#[cfg(test)]
pub(crate) fn initial(path: Option<&Path>, metrics: &Metrics) -> LoadedPolicy {
    let builtin = LoadedPolicy::builtin();
    match path {
        None => {
            metrics.policy_valid.set(1);
            builtin
        }
        Some(p) => apply_load(&builtin, p, read_policy(p), metrics).unwrap_or(builtin),
    }
}

/// How long start-up waits for the policy file before detection begins on the built-in policy.
pub const START_WAIT: Duration = Duration::from_secs(2);

/// Reads and validates a policy file ([`read_policy_seen`]; tests substitute a slow or counting
/// one).
pub(crate) type Reader = Arc<dyn Fn(&Path) -> Loaded + Send + Sync>;

/// The reader the agent uses.
pub fn file_reader() -> Reader {
    Arc::new(read_policy_seen)
}

/// The start-up load, handed to [`PolicyFile`]: finished (what it read, so that the watcher
/// does not read an unchanged file again), or still running (the watcher finishes it).
#[derive(Debug)]
pub enum FirstLoad {
    Done(Seen),
    Running(tokio::task::JoinHandle<Loaded>),
}

impl FirstLoad {
    /// Whether the load was still running when detection started.
    #[cfg(test)]
    pub(crate) fn is_running(&self) -> bool {
        matches!(self, FirstLoad::Running(_))
    }
}

fn joined(done: Result<Loaded, tokio::task::JoinError>) -> Loaded {
    done.unwrap_or_else(|e| Loaded {
        result: Err(LoadError::Reader(e)),
        seen: Seen::default(),
    })
}

/// Loads the policy at start, waiting at most `wait`. A file on a hung or slow filesystem must
/// not delay detection: past `wait`, the built-in policy is in force (the status says which file
/// is still loading) and the load goes on in the background, handed to [`PolicyFile`].
pub async fn initial_bounded(
    path: Option<&Path>,
    metrics: &Metrics,
    reader: Reader,
    wait: Duration,
) -> (LoadedPolicy, Option<FirstLoad>) {
    let builtin = LoadedPolicy::builtin();
    let Some(path) = path else {
        metrics.policy_valid.set(1);
        return (builtin, None);
    };
    let owned = path.to_path_buf();
    let mut load = tokio::task::spawn_blocking(move || reader(&owned));
    match tokio::time::timeout(wait, &mut load).await {
        Ok(done) => {
            let Loaded { result, seen } = joined(done);
            let loaded = apply_load(&builtin, path, result, metrics).unwrap_or(builtin);
            (loaded, Some(FirstLoad::Done(seen)))
        }
        Err(_) => {
            warn!(path = %path.display(), waited_ms = wait.as_millis() as u64, "the policy file is slow to read; detection starts on the built-in policy");
            // The built-in policy in force is valid; a rejected file sets this to 0 later.
            metrics.policy_valid.set(1);
            let mut loaded = builtin;
            loaded.status.loading = Some(path.display().to_string());
            (loaded, Some(FirstLoad::Running(load)))
        }
    }
}

/// What woke the watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// A file event in the directory: the files are compared by identity and times.
    Event,
    /// The periodic re-check or SIGHUP: the files are read and compared by content.
    Recheck,
}

/// The policy file's watcher: the source of policy changes.
pub struct PolicyFile {
    pub path: PathBuf,
    /// Where every change is published.
    pub tx: watch::Sender<LoadedPolicy>,
    /// How often the file is read and compared by content, whatever the file events said.
    pub recheck: Duration,
    /// Re-read the file now (SIGHUP).
    pub reload: Arc<tokio::sync::Notify>,
    pub reader: Reader,
    /// The start-up load, finished first (and published) when it is still running.
    pub first: Option<FirstLoad>,
}

impl std::fmt::Debug for PolicyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Component for PolicyFile {
    const NAME: &'static str = "policy";

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        let task = self.run(cx.metrics.clone(), cx.shutdown.clone());
        Ok(Handle::watched(Self::NAME, &[], cx, task))
    }
}

impl PolicyFile {
    /// Watches the file and publishes every change until shutdown.
    pub async fn run(self, metrics: Arc<Metrics>, shutdown: CancellationToken) {
        let PolicyFile {
            path,
            tx,
            recheck,
            reload,
            reader,
            first,
        } = self;
        let mut seen = match first {
            Some(FirstLoad::Done(seen)) => Some(seen),
            Some(FirstLoad::Running(load)) => {
                let loaded = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    r = load => joined(r),
                };
                if publish(&tx, &path, loaded.result, &metrics) {
                    info!(path = %path.display(), "the slow policy load finished");
                }
                Some(loaded.seen)
            }
            None => None,
        };
        let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<()>();
        let dir = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if res.is_ok_and(|e| is_change(&e.kind)) {
                let _ = ev_tx.send(());
            }
        })
        .and_then(|mut w| w.watch(&dir, RecursiveMode::NonRecursive).map(|()| w));
        let _watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                warn!(error = %e, dir = %dir.display(), "cannot watch the policy directory; re-checking periodically only");
                None
            }
        };
        // The first re-check one period from now (`reset`): the file was just read.
        let mut tick = tokio::time::interval(recheck);
        tick.reset();
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let wake = tokio::select! {
                _ = shutdown.cancelled() => return,
                Some(()) = ev_rx.recv() => {
                    // Let a burst of events (write, rename, symlink swap) settle.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    while ev_rx.try_recv().is_ok() {}
                    Wake::Event
                }
                _ = tick.tick() => Wake::Recheck,
                _ = reload.notified() => {
                    info!(path = %path.display(), "re-reading the policy (SIGHUP)");
                    Wake::Recheck
                }
            };
            if let Some(last) = seen.clone() {
                let by_content = wake == Wake::Recheck;
                let unchanged = tokio::task::spawn_blocking(move || last.unchanged(by_content))
                    .await
                    .unwrap_or(false);
                if unchanged {
                    continue;
                }
            }
            let p = path.clone();
            let read = reader.clone();
            let loaded = joined(tokio::task::spawn_blocking(move || read(&p)).await);
            seen = Some(loaded.seen);
            publish(&tx, &path, loaded.result, &metrics);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_core::record::Handling;

    /// The watcher on `path` (hourly re-check, the file reader); stop it with the token.
    fn spawn_watcher(
        path: &Path,
        tx: watch::Sender<LoadedPolicy>,
        m: Arc<Metrics>,
        reload: Arc<tokio::sync::Notify>,
        pending: Option<FirstLoad>,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let stop = CancellationToken::new();
        let task = tokio::spawn(
            PolicyFile {
                path: path.to_path_buf(),
                tx,
                recheck: Duration::from_secs(3600),
                reload,
                reader: file_reader(),
                first: pending,
            }
            .run(m, stop.clone()),
        );
        (stop, task)
    }

    #[test]
    fn bad_reload_keeps_the_last_good_policy_and_reports_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        let m = Metrics::new();
        std::fs::write(&path, "overrides:\n  Xid43: { handling: SeparateNPU }\n").unwrap();
        let good = initial(Some(&path), &m);
        assert_eq!(good.status.error, None);
        assert_eq!(
            good.policy.overrides["Xid43"].handling,
            Some(Handling::SeparateNPU)
        );

        std::fs::write(&path, "overrides:\n  Xid43: { handling: Sometimes }\n").unwrap();
        let bad = apply_load(&good, &path, read_policy(&path), &m).expect("a change");
        assert_eq!(bad.policy, good.policy, "last good policy stays");
        let err = bad.status.error.clone().unwrap();
        assert!(
            err.contains("overrides.Xid43.handling") && err.contains("line 2"),
            "{err}"
        );
        assert_eq!(m.policy_valid.get(), 0);
        assert!(
            apply_load(&bad, &path, read_policy(&path), &m).is_none(),
            "same error: no change"
        );

        std::fs::write(&path, "expected_gpus: 8\n").unwrap();
        let fixed = apply_load(&bad, &path, read_policy(&path), &m).unwrap();
        assert_eq!(
            (fixed.policy.expected_gpus, fixed.status.error.clone()),
            (8, None)
        );
        assert_eq!(m.policy_valid.get(), 1);
    }

    #[test]
    fn missing_file_at_start_runs_on_builtin_with_error() {
        let m = Metrics::new();
        let p = initial(Some(Path::new("/nonexistent/faultline/policy.yaml")), &m);
        assert_eq!(*p.policy, Policy::default());
        assert!(p.status.error.unwrap().contains("cannot read"));
    }

    #[tokio::test]
    async fn watcher_publishes_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        std::fs::write(&path, "expected_gpus: 1\n").unwrap();
        let m = Arc::new(Metrics::new());
        let (tx, mut rx) = watch::channel(initial(Some(&path), &m));
        let (stop, task) = spawn_watcher(&path, tx, m, Arc::default(), None);
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::fs::write(&path, "expected_gpus: 4\n").unwrap();
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                rx.changed().await.unwrap();
                if rx.borrow().policy.expected_gpus == 4 {
                    break;
                }
            }
        })
        .await
        .expect("reload seen");
        stop.cancel();
        task.await.unwrap();
    }

    /// SIGHUP re-reads the file at once, also where the file watcher sees nothing: here the
    /// policy path is a symlink into another directory, whose changes it does not watch.
    #[tokio::test]
    async fn a_reload_request_rereads_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let real_dir = dir.path().join("real");
        std::fs::create_dir(&real_dir).unwrap();
        let real = real_dir.join("policy.yaml");
        std::fs::write(&real, "expected_gpus: 1\n").unwrap();
        let watched_dir = dir.path().join("watched");
        std::fs::create_dir(&watched_dir).unwrap();
        let path = watched_dir.join("policy.yaml");
        std::os::unix::fs::symlink(&real, &path).unwrap();
        let m = Arc::new(Metrics::new());
        let (tx, mut rx) = watch::channel(initial(Some(&path), &m));
        let reload = Arc::new(tokio::sync::Notify::new());
        let (stop, task) = spawn_watcher(&path, tx, m, reload.clone(), None);
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::fs::write(&real, "expected_gpus: 4\n").unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            rx.borrow_and_update().policy.expected_gpus,
            1,
            "not seen without a reload"
        );
        reload.notify_one();
        tokio::time::timeout(
            Duration::from_secs(10),
            rx.wait_for(|p| p.policy.expected_gpus == 4),
        )
        .await
        .expect("reload seen")
        .unwrap();
        stop.cancel();
        task.await.unwrap();
    }

    /// A policy file that takes longer than the start-up wait does not hold detection back: the
    /// built-in policy is in force at once (the status names the file still loading), and the
    /// file's policy replaces it when the read finishes.
    #[tokio::test]
    async fn a_slow_policy_load_starts_on_the_builtin_policy_and_finishes_later() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        std::fs::write(&path, "expected_gpus: 4\n").unwrap();
        let gate = Arc::new(std::sync::Barrier::new(2));
        let held = gate.clone();
        let slow: Reader = Arc::new(move |p: &Path| {
            held.wait(); // released by the test, after start-up went on
            read_policy_seen(p)
        });
        let m = Arc::new(Metrics::new());
        let (first, pending) =
            initial_bounded(Some(&path), &m, slow.clone(), Duration::from_millis(50)).await;
        assert_eq!(*first.policy, Policy::default(), "built-in policy in force");
        assert_eq!(first.status.source, "builtin");
        assert_eq!(first.status.loading.as_deref(), path.to_str());
        let pending = pending.expect("a file is given");
        assert!(pending.is_running());

        let (tx, mut rx) = watch::channel(first);
        let (stop, task) = spawn_watcher(&path, tx, m, Arc::default(), Some(pending));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(rx.borrow_and_update().status.loading.is_some());
        gate.wait();
        let loaded = tokio::time::timeout(
            Duration::from_secs(10),
            rx.wait_for(|p| p.status.loading.is_none()),
        )
        .await
        .expect("the pending load is published")
        .unwrap()
        .clone();
        assert_eq!(loaded.policy.expected_gpus, 4);
        assert_eq!(loaded.status.source, path.display().to_string());
        assert_eq!(loaded.status.error, None);
        stop.cancel();
        task.await.unwrap();
    }

    /// A slow load that ends in an error leaves the built-in policy with the error, and no
    /// longer says it is loading; a fast load needs no background work.
    #[tokio::test]
    async fn a_slow_load_that_fails_reports_its_error_and_a_fast_one_is_not_pending() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        std::fs::write(&path, "overrides: [\n").unwrap();
        let m = Arc::new(Metrics::new());
        let (fast, pending) =
            initial_bounded(Some(&path), &m, file_reader(), Duration::from_secs(10)).await;
        assert!(!pending.unwrap().is_running());
        assert!(fast.status.error.is_some() && fast.status.loading.is_none());

        let slow: Reader = Arc::new(|p: &Path| {
            std::thread::sleep(Duration::from_millis(300));
            read_policy_seen(p)
        });
        let (first, pending) =
            initial_bounded(Some(&path), &m, slow, Duration::from_millis(20)).await;
        assert!(first.status.loading.is_some() && first.status.error.is_none());
        let (tx, mut rx) = watch::channel(first);
        let (stop, task) = spawn_watcher(&path, tx, m, Arc::default(), pending);
        let failed = tokio::time::timeout(
            Duration::from_secs(10),
            rx.wait_for(|p| p.status.loading.is_none()),
        )
        .await
        .expect("the failed load is published")
        .unwrap()
        .clone();
        assert_eq!(*failed.policy, Policy::default());
        assert!(failed.status.error.unwrap().contains("policy.yaml"));
        stop.cancel();
        task.await.unwrap();
    }

    /// A reader that counts its calls (each is a read and a parse of every file).
    fn counting() -> (Reader, Arc<std::sync::atomic::AtomicUsize>) {
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let calls = n.clone();
        let reader: Reader = Arc::new(move |p: &Path| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            read_policy_seen(p)
        });
        (reader, n)
    }

    /// A `faultCode.json` of about `bytes` bytes.
    fn big_table(bytes: usize) -> String {
        let codes: Vec<String> = (0..bytes / 11)
            .map(|i| format!("\"{:08X}\"", 0x1000_0000 + i))
            .collect();
        format!("{{\"NotHandleFaultCodes\": [{}]}}", codes.join(","))
    }

    /// An unchanged policy is read once, at start, however long the agent runs: the watcher's
    /// own reads fire events in the watched directory, and answering them with a read made it
    /// read and parse the policy and its 3.5 MiB table about ten times a second, for ever
    /// (65 % of a core on an idle node). A real change is still read, once.
    #[tokio::test]
    async fn an_unchanged_policy_is_not_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        let table = dir.path().join("codes.json");
        std::fs::write(&table, big_table(3_500_000)).unwrap();
        std::fs::write(&path, "ascend:\n  fault_code_file: codes.json\n").unwrap();
        let m = Arc::new(Metrics::new());
        let (reader, reads) = counting();
        let (first, load) =
            initial_bounded(Some(&path), &m, reader.clone(), Duration::from_secs(60)).await;
        assert_eq!(first.status.error, None);
        let (tx, mut rx) = watch::channel(first);
        let stop = CancellationToken::new();
        let task = tokio::spawn(
            PolicyFile {
                path: path.clone(),
                tx,
                recheck: Duration::from_secs(3600),
                reload: Arc::default(),
                reader,
                first: load,
            }
            .run(m, stop.clone()),
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 1);

        let before = rx.borrow_and_update().status.checksum.clone();
        std::fs::write(
            &path,
            "expected_gpus: 2\nascend:\n  fault_code_file: codes.json\n",
        )
        .unwrap();
        tokio::time::timeout(
            Duration::from_secs(30),
            rx.wait_for(|p| p.status.checksum != before),
        )
        .await
        .expect("the change is read")
        .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 2);
        stop.cancel();
        task.await.unwrap();
    }

    /// A character device named as the policy is refused with the reason, and not opened
    /// again while it stays what it is: each read of it fires an event in /dev, which would
    /// make the watcher read it again and again.
    #[tokio::test]
    async fn a_device_as_the_policy_is_refused_and_not_read_again() {
        let path = Path::new("/dev/null");
        let m = Arc::new(Metrics::new());
        let (reader, reads) = counting();
        let (first, load) =
            initial_bounded(Some(path), &m, reader.clone(), Duration::from_secs(60)).await;
        let err = first.status.error.clone().unwrap();
        assert!(
            err.contains("/dev/null") && err.contains("not a regular file"),
            "{err}"
        );
        let (tx, _rx) = watch::channel(first);
        let stop = CancellationToken::new();
        let task = tokio::spawn(
            PolicyFile {
                path: path.to_path_buf(),
                tx,
                recheck: Duration::from_secs(3600),
                reload: Arc::default(),
                reader,
                first: load,
            }
            .run(m, stop.clone()),
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 1);
        stop.cancel();
        task.await.unwrap();
    }

    /// Files that look unchanged (identity and times) are compared by content on a re-check:
    /// a write within the timestamp granularity leaves the times alone.
    #[test]
    fn a_recheck_compares_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        std::fs::write(&path, "expected_gpus: 1\n").unwrap();
        let mut seen = read_policy_seen(&path).seen;
        assert!(seen.unchanged(false) && seen.unchanged(true));
        // What a same-size write in the same timestamp tick would look like.
        seen.digest[0] ^= 1;
        assert!(seen.unchanged(false));
        assert!(!seen.unchanged(true));
        std::fs::write(&path, "expected_gpus: 22\n").unwrap();
        assert!(!seen.unchanged(false), "size and times changed");
    }

    /// Only events that can change a file wake the watcher; its own reads (open,
    /// close-without-write) do not.
    #[test]
    fn only_changing_events_count() {
        use notify::event::{CreateKind, ModifyKind, RemoveKind, RenameMode};
        for kind in [
            EventKind::Create(CreateKind::File),
            EventKind::Modify(ModifyKind::Data(notify::event::DataChange::Any)),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Modify(ModifyKind::Metadata(notify::event::MetadataKind::Any)),
            EventKind::Remove(RemoveKind::File),
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            EventKind::Any,
        ] {
            assert!(is_change(&kind), "{kind:?}");
        }
        for kind in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            EventKind::Access(AccessKind::Read),
        ] {
            assert!(!is_change(&kind), "{kind:?}");
        }
    }

    /// A FIFO or a device as the policy is refused at once with a clear error; the last good
    /// policy stays.
    #[test]
    fn a_policy_that_is_not_a_regular_file_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("policy.yaml");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let err = read_policy(&fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let err = read_policy(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let big = dir.path().join("big.yaml");
        std::fs::write(&big, vec![b'#'; (MAX_POLICY_BYTES + 1) as usize]).unwrap();
        let err = read_policy(&big).unwrap_err().to_string();
        assert!(err.contains("larger than 1048576 bytes"), "{err}");
    }
}
