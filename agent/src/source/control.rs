//! Operator requests: `faultline clear` drops a JSON request into `<state-dir>/clear.d/`; this
//! source applies it and, once the clear is on disk, answers with what it cleared and removes
//! the request.
//!
//! Files rather than an HTTP endpoint: whoever may clear faults must already be able to write
//! into the node's state directory (root on the node, or `kubectl exec` into the agent).
//!
//! The directory is untrusted input, so it is read through file descriptors, never by path:
//! - `clear.d` itself is opened with `O_NOFOLLOW | O_DIRECTORY`: a symlink put in its place is
//!   refused, and every later open, rename and unlink is relative to that descriptor, so a
//!   directory swapped in meanwhile is never touched;
//! - a request is opened with `O_NOFOLLOW | O_NONBLOCK` and must be a regular file (no symlink to
//!   `/dev/zero`, no FIFO that blocks the read) of at most [`MAX_REQUEST_BYTES`];
//! - its JSON must be an object with only `code` and `device`, each at most once and a non-empty
//!   short string (`[]`, `["Xid79"]` and `{"code": null}` are not read as "clear all"); `{}`
//!   clears every fault on purpose.
//!
//! A request that fails any of this is renamed to `*.rejected` and the reason logged (the CLI
//! reports the rejection). A request that cannot be read for a passing reason (out of memory or
//! descriptors) stays and is read again after the retry interval (1 s).
//!
//! Watched, not polled: the directory is read when inotify says it changed (a request written,
//! renamed into it, removed), never on a timer while nothing happens. The watch is on the
//! directory `clear.d` is now: when it goes (removed, renamed, replaced by the CLI's
//! `create_dir_all`) the state directory is watched until it is back, and a new `clear.d` is
//! watched anew and read. Whatever inotify reports that is not a plain change (a queue
//! overflow, an error) makes a full read, which is what every wake-up does anyway. Without
//! inotify (its instances used up on the node) the directory is read every retry interval. The
//! checks above are the same: inotify only says when to read.
//!
//! Once: every request read is remembered by its file's identity ([`FileId`]: device, inode,
//! modification time) before it is acted on, and a file with a remembered identity is never
//! read again in this run, whatever its name. So a request that cannot be renamed or removed
//! (a read-only directory) is applied once and then left alone, not applied and logged every
//! second; a new request, even under the same name, is a new file and is read. Across runs, the
//! engine loop remembers the last [`REMEMBERED_CLEARS`](crate::clear::REMEMBERED_CLEARS) requests it applied (name and identity,
//! [`AppliedClears`](crate::clear::AppliedClears)) in the state it saves with the clear itself: a request found again after a
//! restart is answered with what it did then, not applied again.
//!
//! Durability and the answer: a request is first renamed to `*.json.applying` (taken), then
//! applied; the engine loop reports what it cleared ([`ClearApplied`](crate::clear::ClearApplied)); once the file sink reports
//! the clear written to `state.json`, the answer is written to `*.json.done` ([`ClearResult`](crate::clear::ClearResult),
//! atomically) and only then is the request removed, without holding up later requests. The CLI
//! reads the answer, removes it, and says how many faults were cleared. A kill before the clear
//! was saved leaves `*.applying`, which the next start applies (it was never applied as far as
//! the saved state goes); a kill after leaves it too, and the next start answers it from the
//! saved state.

use std::collections::HashSet;
use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::fs::{AtFlags, Mode, OFlags};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use super::{Input, SourceContext};
use crate::clear::{ClearApplied, ClearResult, MAX_RESULT_BYTES};
use crate::component::{Component, Context, Handle, StartError};
use crate::operator_file::{read_bytes, read_opened, OperatorFileError};

pub(crate) const CLEAR_DIR: &str = "clear.d";
/// A request that is taken and being applied.
pub(crate) const APPLYING_SUFFIX: &str = ".applying";
/// The largest request read. A clear request is a few dozen bytes; the largest valid one, as
/// `faultline clear` writes it (two fields of [`MAX_FIELD_CHARS`] characters; JSON takes at
/// most 6 bytes for a character, a control character's `\u00XX`), is about 3 KiB. Anything
/// longer is not a request, and is refused without being read into memory.
pub(crate) const MAX_REQUEST_BYTES: u64 = 4096;
/// The longest `code` or `device` accepted.
pub(crate) const MAX_FIELD_CHARS: usize = 256;

/// One clear request; both fields absent clears every active fault. A field that is present
/// must be a string: `{"code": null}` (what `jq -n '{code: env.CODE}'` writes with `CODE` unset)
/// is refused, never read as "any code".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClearRequest {
    #[serde(
        default,
        deserialize_with = "present_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub code: Option<String>,
    /// Device as `faultline get` shows it (`GPU-3`, `GPU-0000:3b:00.0`, `Ascend910-1`, `node`),
    /// its UUID or its PCI bus id.
    #[serde(
        default,
        deserialize_with = "present_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub device: Option<String>,
}

/// A field that is present is a string (`null` is an error, not an absent field).
fn present_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    String::deserialize(d).map(Some)
}

/// The suffix of a request's answer: `<name>.json.done`.
pub(crate) const DONE_SUFFIX: &str = ".done";
/// Why a request was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RequestError {
    #[error("a symbolic link (refused: a request must be a regular file in the directory)")]
    Symlink,
    #[error("not a regular file (FIFOs, devices and directories are refused)")]
    NotRegular,
    #[error("larger than {MAX_REQUEST_BYTES} bytes")]
    TooLarge,
    /// A passing failure: the request is read again at the next tick.
    #[error("cannot read: {0}")]
    Io(String),
    #[error("not a JSON object with `code` and/or `device`: {0}")]
    Schema(String),
    #[error("field `{0}` must be a non-empty string of at most {MAX_FIELD_CHARS} characters")]
    Field(&'static str),
}

/// Parses a request: a JSON object with at most `code` and `device`, each at most once and a
/// string.
pub(crate) fn parse_request(bytes: &[u8]) -> Result<ClearRequest, RequestError> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| RequestError::Schema(e.to_string()))?;
    // A struct is read from an array too (`[]` would be `{}`).
    if !v.is_object() {
        return Err(RequestError::Schema(format!("found {}", kind(&v))));
    }
    // Read from the bytes, not the map: a field given twice is an error, not the last one.
    let r: ClearRequest =
        serde_json::from_slice(bytes).map_err(|e| RequestError::Schema(e.to_string()))?;
    for (name, f) in [("code", &r.code), ("device", &r.device)] {
        if let Some(s) = f {
            if s.trim().is_empty() || s.chars().count() > MAX_FIELD_CHARS {
                return Err(RequestError::Field(name));
            }
        }
    }
    Ok(r)
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A request file's identity: the same file keeps it when renamed; a new file (a new request,
/// even under an old name) or a file rewritten has another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
    mtime: (i64, i64),
}

impl FileId {
    // The field types of `stat` differ between architectures; these casts widen or keep them.
    #[allow(clippy::unnecessary_cast)]
    fn of(st: &rustix::fs::Stat) -> FileId {
        FileId {
            dev: st.st_dev as u64,
            ino: st.st_ino as u64,
            mtime: (st.st_mtime as i64, st.st_mtime_nsec as i64),
        }
    }
}

/// The requests acted on (applied or rejected) in this run whose files are still in the
/// directory: they are not read again.
#[derive(Debug, Default)]
pub(crate) struct Done(HashSet<FileId>);

/// One directory entry, read or recognised.
#[derive(Debug)]
enum Entry {
    /// A file acted on before: not read again.
    Done(FileId),
    /// Read (`id` is `None` when the file could not be opened or stat'ed).
    Read {
        id: Option<FileId>,
        request: Result<ClearRequest, RequestError>,
    },
}

/// The request directory, opened without following a symlink.
#[derive(Debug)]
pub(crate) struct RequestDir {
    fd: OwnedFd,
    path: PathBuf,
    /// Tests: every rename and removal fails, as in a read-only directory (root, which the
    /// tests may run as, ignores permissions).
    immutable: bool,
}

/// One request found in the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pending {
    /// Its name now (`*.json.applying` once taken).
    pub name: String,
    pub request: ClearRequest,
    /// Its identity across runs: its name as written (`*.json`) and its file's identity, which
    /// a rename keeps and a new file under the same name does not have.
    pub key: String,
}

impl Pending {
    /// The request's name as written (`*.json`): its answer is `<that>.done`.
    fn base(&self) -> &str {
        self.name
            .strip_suffix(APPLYING_SUFFIX)
            .unwrap_or(&self.name)
    }
}

/// The identity of request `name` (`*.json`) whose file is `id`.
fn request_key(name: &str, id: Option<FileId>) -> String {
    match id {
        Some(id) => format!(
            "{name}@{}:{}:{}.{:09}",
            id.dev, id.ino, id.mtime.0, id.mtime.1
        ),
        None => name.to_string(),
    }
}

impl RequestDir {
    /// Opens `dir`; a symlink or anything but a directory is an error.
    pub(crate) fn open(dir: &Path) -> std::io::Result<RequestDir> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::open(dir, flags, Mode::empty())?;
        Ok(RequestDir {
            fd,
            path: dir.to_path_buf(),
            immutable: false,
        })
    }

    /// Tests: renames and removals in this directory fail.
    #[cfg(test)]
    fn immutable(mut self) -> RequestDir {
        self.immutable = true;
        self
    }

    fn refuse_changes(&self) -> std::io::Result<()> {
        if self.immutable {
            return Err(std::io::Error::from_raw_os_error(
                rustix::io::Errno::ROFS.raw_os_error(),
            ));
        }
        Ok(())
    }

    /// The directory's identity (device, inode): a directory put in its place has another.
    fn identity(&self) -> Option<(u64, u64)> {
        let id = FileId::of(&rustix::fs::fstat(&self.fd).ok()?);
        Some((id.dev, id.ino))
    }

    fn names(&self) -> std::io::Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in rustix::fs::Dir::read_from(&self.fd)? {
            let entry = entry?;
            if let Ok(name) = entry.file_name().to_str() {
                out.push(name.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    /// Reads one entry: a regular file of at most [`MAX_REQUEST_BYTES`], opened without
    /// following links and without blocking.
    #[cfg(test)]
    fn read(&self, name: &str) -> Result<ClearRequest, RequestError> {
        match self.read_entry(name, &Done::default()) {
            Entry::Read { request, .. } => request,
            Entry::Done(_) => unreachable!("nothing is done"),
        }
    }

    /// Reads one entry, unless its file is in `done`.
    fn read_entry(&self, name: &str, done: &Done) -> Entry {
        let unknown = |e: RequestError| Entry::Read {
            id: None,
            request: Err(e),
        };
        let c = match cname(name) {
            Ok(c) => c,
            Err(e) => return unknown(RequestError::Io(e.to_string())),
        };
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let fd = match rustix::fs::openat(&self.fd, &c, flags, Mode::empty()) {
            Ok(fd) => fd,
            // ELOOP: the entry is a symlink. It is never followed; its own identity is used.
            Err(e) if e == rustix::io::Errno::LOOP => {
                let id = rustix::fs::statat(&self.fd, &c, AtFlags::SYMLINK_NOFOLLOW)
                    .ok()
                    .map(|st| FileId::of(&st));
                return match id {
                    Some(id) if done.0.contains(&id) => Entry::Done(id),
                    id => Entry::Read {
                        id,
                        request: Err(RequestError::Symlink),
                    },
                };
            }
            Err(e) => return unknown(RequestError::Io(e.to_string())),
        };
        let id = rustix::fs::fstat(&fd).ok().map(|st| FileId::of(&st));
        if let Some(id) = id.filter(|id| done.0.contains(id)) {
            return Entry::Done(id);
        }
        let bytes = read_opened(std::fs::File::from(fd), MAX_REQUEST_BYTES).map_err(|e| match e {
            OperatorFileError::NotRegular => RequestError::NotRegular,
            OperatorFileError::TooLarge(_) => RequestError::TooLarge,
            other => RequestError::Io(other.to_string()),
        });
        Entry::Read {
            id,
            request: bytes.and_then(|b| parse_request(&b)),
        }
    }

    fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        self.refuse_changes()?;
        rustix::fs::renameat(&self.fd, &cname(from)?, &self.fd, &cname(to)?)?;
        Ok(())
    }

    /// Takes request `name` by renaming it to `taken` (`*.json.applying`); the name to apply it
    /// under, or `None` when it is gone. The CLI withdraws a request it stopped waiting for by
    /// removing it, so a rename that finds no file means the request was withdrawn after it was
    /// read: it is not applied, and exactly one of the agent and the CLI wins. Any other failure
    /// (a read-only `clear.d`) applies it once where it is.
    fn claim(&self, name: String, taken: String) -> Option<String> {
        if taken == name {
            return Some(name);
        }
        match self.rename(&name, &taken) {
            Ok(()) => Some(taken),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                info!(dir = %self.path.display(), name, "a clear request was withdrawn before it was taken; not applied");
                None
            }
            Err(e) => {
                warn!(dir = %self.path.display(), name, error = %e, "cannot rename a clear request; applying it once where it is (it is not applied again while the agent runs, but again after a restart if it is still there)");
                Some(name)
            }
        }
    }

    fn exists(&self, name: &str) -> bool {
        cname(name)
            .is_ok_and(|c| rustix::fs::statat(&self.fd, &c, AtFlags::SYMLINK_NOFOLLOW).is_ok())
    }

    fn remove(&self, name: &str) -> std::io::Result<()> {
        self.refuse_changes()?;
        rustix::fs::unlinkat(&self.fd, &cname(name)?, AtFlags::empty())?;
        Ok(())
    }

    /// Writes `bytes` to `name` atomically: a temporary file created afresh (never a file or
    /// link someone put there), synced, renamed over `name`.
    fn write(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write as _;
        self.refuse_changes()?;
        let tmp = cname(&format!("{}{name}", crate::atomic_file::TEMP_PREFIX))?;
        // Left by a kill in the middle of an earlier write.
        let _ = rustix::fs::unlinkat(&self.fd, &tmp, AtFlags::empty());
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, &tmp, flags, Mode::from_raw_mode(0o644))?;
        let mut f = std::fs::File::from(fd);
        f.write_all(bytes)?;
        f.sync_data()?;
        rustix::fs::renameat(&self.fd, &tmp, &self.fd, &cname(name)?)?;
        Ok(())
    }

    /// Answers request `p` with `result` (`<name>.json.done`), then removes it. A request whose
    /// answer cannot be written is removed all the same: the clear is on disk, and the CLI,
    /// finding neither, says it was applied without an answer.
    fn finish(&self, p: &Pending, result: &ClearResult) {
        let body = serde_json::to_vec(result).unwrap_or_default();
        if let Err(e) = self.write(&done_name(p.base()), &body) {
            warn!(dir = %self.path.display(), request = p.name, error = %e, "cannot write the answer to a clear request");
        }
        if let Err(e) = self.remove(&p.name) {
            warn!(dir = %self.path.display(), request = p.name, error = %e, "cannot remove an applied clear request (it is not applied again while the agent runs)");
        }
    }

    /// Takes every new request: `*.json` becomes `*.json.applying`; bad ones become
    /// `*.rejected`. Requests already `*.applying` (left by a run that was killed) are returned
    /// too. A file in `done` is skipped; every file acted on is added to it before it is
    /// returned, and `done` forgets files no longer in the directory. Oldest name first.
    #[cfg(test)]
    pub(crate) fn take(&self, done: &mut Done) -> Vec<Pending> {
        self.scan(done).0
    }

    /// [`RequestDir::take`], and whether something could not be read for a passing reason (the
    /// directory is read again after the retry interval: no inotify event says when).
    fn scan(&self, done: &mut Done) -> (Vec<Pending>, bool) {
        let names = match self.names() {
            Ok(n) => n,
            Err(e) => {
                warn!(dir = %self.path.display(), error = %e, "cannot list clear requests");
                return (Vec::new(), true);
            }
        };
        let mut passing = false;
        let mut present = HashSet::new();
        let mut out = Vec::new();
        for name in names {
            // `*.json`, or `*.json.applying` (taken by a run that was killed); anything else
            // (temporary files of a writer, rejected requests) is not a request.
            let base = name
                .strip_suffix(APPLYING_SUFFIX)
                .unwrap_or(&name)
                .to_string();
            if !base.ends_with(".json") {
                continue;
            }
            let taken = applying_name(&base);
            if taken != name && self.exists(&taken) {
                continue; // a request of the same name is still being applied: later
            }
            let (id, read) = match self.read_entry(&name, done) {
                Entry::Done(id) => {
                    present.insert(id);
                    continue;
                }
                Entry::Read { id, request } => (id, request),
            };
            if let Some(id) = id {
                present.insert(id);
            }
            match read {
                Ok(request) => {
                    // Done before it is acted on: whatever happens next, not read again.
                    if let Some(id) = id {
                        done.0.insert(id);
                    }
                    let key = request_key(&base, id);
                    if let Some(name) = self.claim(name, taken) {
                        out.push(Pending { name, request, key });
                    }
                }
                Err(e @ RequestError::Io(_)) => {
                    warn!(dir = %self.path.display(), name, error = %e, "cannot read a clear request now; trying again");
                    passing = true;
                }
                Err(e) => {
                    warn!(dir = %self.path.display(), name, error = %e, "rejected a clear request");
                    if let Some(id) = id {
                        done.0.insert(id);
                    }
                    if self.rename(&name, &rejected_name(&base)).is_err() {
                        if let Err(e) = self.remove(&name) {
                            warn!(dir = %self.path.display(), name, error = %e, "cannot set a rejected clear request aside; it is ignored while the agent runs");
                        }
                    }
                }
            }
        }
        done.0.retain(|id| present.contains(id));
        (out, passing)
    }
}

fn cname(name: &str) -> std::io::Result<CString> {
    CString::new(name).map_err(|_| std::io::Error::other("a file name with a NUL byte"))
}

/// The name of request `name` (`*.json`) once taken.
fn applying_name(name: &str) -> String {
    format!("{name}{APPLYING_SUFFIX}")
}

/// The name of request `name` (`*.json`) once rejected.
fn rejected_name(name: &str) -> String {
    format!("{}.rejected", name.trim_end_matches(".json"))
}

/// The name of the answer to request `name` (`*.json`).
fn done_name(name: &str) -> String {
    format!("{name}{DONE_SUFFIX}")
}

/// An answer file that is there but is not a readable answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResultError {
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: OperatorFileError,
    },
    #[error("{}: {source}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// The agent's answer to the request named `name` (`*.json`) in `dir`, if it has answered: for
/// the CLI. `Err` when the file there is not a readable answer.
pub(crate) fn read_result(dir: &Path, name: &str) -> Option<Result<ClearResult, ResultError>> {
    let path = dir.join(done_name(name));
    match read_bytes(&path, MAX_RESULT_BYTES) {
        Err(OperatorFileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => Some(Err(ResultError::Read { path, source })),
        Ok(b) => {
            Some(serde_json::from_slice(&b).map_err(|source| ResultError::Parse { path, source }))
        }
    }
}

/// Removes the answer to the request named `name` once read: for the CLI.
pub(crate) fn remove_result(dir: &Path, name: &str) -> std::io::Result<()> {
    std::fs::remove_file(dir.join(done_name(name)))
}

/// Whether a request named `name` (`*.json`) is still pending in `dir`: for the CLI.
pub(crate) fn is_pending(dir: &Path, name: &str) -> bool {
    dir.join(name).exists() || dir.join(applying_name(name)).exists()
}

/// Whether the agent has taken the request named `name` (`*.json`) and not yet answered it (it
/// is `*.json.applying`): for the CLI.
pub(crate) fn is_taken(dir: &Path, name: &str) -> bool {
    dir.join(applying_name(name)).exists()
}

/// Withdraws the request named `name` (`*.json`) that the agent has not taken: for the CLI, once
/// it stops waiting. The agent takes a request by renaming it, so exactly one of the two
/// succeeds; `NotFound` means the agent took it first (or it was never there).
pub(crate) fn withdraw(dir: &Path, name: &str) -> std::io::Result<()> {
    std::fs::remove_file(dir.join(name))
}

/// Whether the agent rejected the request named `name` (`*.json`): for the CLI.
pub(crate) fn is_rejected(dir: &Path, name: &str) -> bool {
    dir.join(rejected_name(name)).exists()
}

/// How long after a change in the directory it is read (see [`run`]).
const SETTLE: Duration = Duration::from_millis(100);

/// What the inotify watch is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watched {
    Nothing,
    /// `clear.d`, the directory of this identity.
    Dir((u64, u64)),
    /// The state directory, while `clear.d` cannot be opened: its coming back is seen.
    Parent,
}

/// Wakes the request loop when the request directory changes ([`run`]).
struct DirWatch {
    /// `None`: inotify could not be used; the directory is read every retry interval.
    watcher: Option<notify::RecommendedWatcher>,
    watched: Watched,
    /// Set when the request directory itself changed (removed, renamed, created): the watch is
    /// set again even when the directory found has the same identity (a new directory can get
    /// the inode number of the one just removed, whose watch the kernel has ended).
    moved: std::sync::Arc<std::sync::atomic::AtomicBool>,
    dir: PathBuf,
    parent: PathBuf,
}

impl DirWatch {
    /// A watcher that wakes `wake` on any change in `dir` or of `dir` itself, and on anything
    /// inotify reports that is not a plain change (an overflow, an error): a full read follows
    /// each wake-up, so nothing it could have missed stays unread.
    fn new(dir: &Path, wake: std::sync::Arc<tokio::sync::Notify>) -> DirWatch {
        let inside = dir.to_path_buf();
        let moved = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let moved_tx = moved.clone();
        let watcher = notify::recommended_watcher(move |e: notify::Result<notify::Event>| {
            // The state directory's own files (the record rewritten every heartbeat) are not
            // requests: only paths in (or of) the request directory wake the loop; and not
            // opens and reads (the loop's own reads of the directory would wake it again).
            let wanted = match &e {
                Ok(e) => {
                    let change = super::policy_watch::is_change(&e.kind);
                    if change && e.paths.contains(&inside) {
                        moved_tx.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    e.need_rescan() || (change && e.paths.iter().any(|p| p.starts_with(&inside)))
                }
                Err(_) => true,
            };
            if wanted {
                wake.notify_one();
            }
        });
        let watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                warn!(dir = %dir.display(), error = %e, "cannot watch the clear request directory (inotify); reading it every second instead");
                None
            }
        };
        DirWatch {
            watcher,
            watched: Watched::Nothing,
            moved,
            dir: dir.to_path_buf(),
            parent: dir.parent().map(Path::to_path_buf).unwrap_or_default(),
        }
    }

    /// Watches what the last read found: `clear.d` of identity `id`, or (`None`: it could not
    /// be opened) the state directory. True when the watch moved: what changed before it was
    /// in place is read again.
    fn follow(&mut self, id: Option<(u64, u64)>) -> bool {
        use notify::{RecursiveMode, Watcher};
        let want = id.map_or(Watched::Parent, Watched::Dir);
        let Some(w) = self.watcher.as_mut() else {
            return false;
        };
        let moved = self.moved.swap(false, std::sync::atomic::Ordering::SeqCst);
        if want == self.watched && !moved {
            return false;
        }
        // The old watch may be gone already (its directory removed): nothing to undo then.
        match self.watched {
            Watched::Dir(_) => drop(w.unwatch(&self.dir)),
            Watched::Parent => drop(w.unwatch(&self.parent)),
            Watched::Nothing => {}
        }
        let path = match want {
            Watched::Parent => &self.parent,
            _ => &self.dir,
        };
        match w.watch(path, RecursiveMode::NonRecursive) {
            Ok(()) => self.watched = want,
            Err(e) => {
                warn!(dir = %path.display(), error = %e, "cannot watch the clear request directory (inotify); reading it every second until it can be");
                self.watched = Watched::Nothing;
            }
        }
        true
    }

    /// Whether changes are seen without reading the directory on a timer.
    fn watching(&self) -> bool {
        self.watcher.is_some() && self.watched != Watched::Nothing
    }
}

impl std::fmt::Debug for DirWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirWatch")
            .field("watched", &self.watched)
            .field("dir", &self.dir)
            .finish()
    }
}

/// The clear requests' source, as the daemon starts it.
#[derive(Debug)]
pub(crate) struct Control {
    pub state_dir: PathBuf,
    /// The highest engine-loop marker the file sink has written to disk.
    pub persisted: watch::Receiver<u64>,
    /// The engine loop's reports on the requests sent to it.
    pub results: mpsc::UnboundedReceiver<ClearApplied>,
}

impl Component for Control {
    const NAME: &'static str = "control";

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        // Read again after a passing failure; read on changes (inotify) otherwise.
        let retry = Duration::from_secs(1);
        let task = run(
            self.state_dir,
            cx.source(),
            self.persisted,
            self.results,
            retry,
        );
        Ok(Handle::watched(Self::NAME, &[], cx, task))
    }
}

/// Reads the request directory whenever it changes, until shutdown. `results` are the engine
/// loop's reports on the requests sent to it; `persisted` is the highest marker the file sink
/// has written to disk. `retry`: how soon a read that met a passing failure is tried again
/// (and how often the directory is read when inotify cannot be used).
pub(crate) async fn run(
    state_dir: PathBuf,
    ctx: SourceContext,
    mut persisted: watch::Receiver<u64>,
    mut results: mpsc::UnboundedReceiver<ClearApplied>,
    retry: Duration,
) {
    let dir = state_dir.join(CLEAR_DIR);
    let wake = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut watch = DirWatch::new(&dir, wake.clone());
    // The first read, at once.
    wake.notify_one();
    let mut again: Option<tokio::time::Instant> = None;
    let mut done = Done::default();
    // Sent to the engine loop, waiting for its report and for their marker to reach the disk.
    let mut awaiting: Vec<(Pending, u64, Option<ClearResult>)> = Vec::new();
    let mut marker = 0u64;
    let mut rd: Option<RequestDir> = None;
    let clock = ctx.clock.clone();
    loop {
        let retry_at = again.unwrap_or_else(|| clock.instant());
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            () = wake.notified() => {
                // A request written in place (not renamed in) is created before it is written:
                // its writer gets this long to finish before it is read.
                tokio::time::sleep(SETTLE).await;
            }
            () = tokio::time::sleep_until(retry_at), if again.is_some() => {}
            Ok(()) = persisted.changed(), if !awaiting.is_empty() => {}
        }
        // A report is sent before the snapshot that carries its marker: every request whose
        // marker is on disk has its report here.
        while let Ok(a) = results.try_recv() {
            if let Some(w) = awaiting.iter_mut().find(|w| w.1 == a.marker) {
                w.2 = Some(a.result);
            }
        }
        let on_disk = *persisted.borrow_and_update();
        if let Some(rd) = &rd {
            awaiting.retain(|(p, m, result)| match result {
                Some(result) if *m <= on_disk => {
                    rd.finish(p, result);
                    false
                }
                _ => true,
            });
        }
        // The directory is read on a blocking thread; `done` goes there and comes back.
        let d = dir.clone();
        let mut remembered = std::mem::take(&mut done);
        let taken = tokio::task::spawn_blocking(move || {
            let opened = RequestDir::open(&d).map(|rd| (rd.scan(&mut remembered), rd));
            (opened, remembered)
        })
        .await;
        // A panicked task (it cannot, short of a bug) loses what it remembered, not the loop.
        let Ok((opened, remembered)) = taken else {
            again = Some(clock.instant() + retry);
            continue;
        };
        done = remembered;
        let (requests, passing, id) = match opened {
            Ok(((requests, passing), opened)) => {
                let id = opened.identity();
                rd = Some(opened);
                (requests, passing, id)
            }
            // Not there (yet): its creation is seen in the state directory.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), false, None),
            Err(e) => {
                warn!(dir = %dir.display(), error = %e, "cannot open the clear request directory (a symlink or not a directory is refused)");
                (Vec::new(), true, None)
            }
        };
        if watch.follow(id) {
            wake.notify_one();
        }
        let retry_after = passing || !watch.watching();
        again = retry_after.then(|| clock.instant() + retry);
        for p in requests {
            info!(code = ?p.request.code, device = ?p.request.device, request = p.name, "operator clear");
            marker += 1;
            let clear = Input::Clear {
                request: p.key.clone(),
                code: p.request.code.clone(),
                device: p.request.device.clone(),
                marker,
            };
            if ctx.tx.send(clear).await.is_err() {
                return;
            }
            awaiting.push((p, marker, None));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clear::answer;
    use std::os::unix::fs::symlink;

    fn write(dir: &Path, name: &str, body: &[u8]) {
        std::fs::write(dir.join(name), body).unwrap();
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// A request the CLI withdrew (removed) after the agent read it and before it renamed it
    /// is not applied; one the agent cannot rename (a read-only directory) is applied where it
    /// is; otherwise it is taken as `*.applying`.
    #[test]
    fn a_request_withdrawn_before_it_is_taken_is_not_applied() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let claim = |rd: &RequestDir| rd.claim("1.json".into(), "1.json.applying".into());
        let rd = RequestDir::open(d).unwrap();
        assert_eq!(claim(&rd), None, "withdrawn");
        write(d, "1.json", b"{}");
        assert_eq!(
            claim(&RequestDir::open(d).unwrap().immutable()).as_deref(),
            Some("1.json")
        );
        assert_eq!(claim(&rd).as_deref(), Some("1.json.applying"));
        assert_eq!(names(d), ["1.json.applying"]);
    }

    #[test]
    fn good_requests_are_taken_bad_ones_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write(d, "1.json", br#"{"code":"Xid79"}"#);
        write(d, "2.json", br#"{"cod":"Xid79"}"#);
        write(d, "3.json", br#"{}"#);
        write(d, "4.json", br#"[]"#);
        write(d, "5.json", br#"["Xid79"]"#);
        write(d, "6.json", br#"{"code":""}"#);
        write(d, "7.json", br#"{"code":null}"#);
        write(d, "8.json", br#"{"device":null}"#);
        write(d, "9.json", br#"{"code":"Xid79","code":null}"#);
        write(d, ".faultline-tmp", br#"{}"#);
        let rd = RequestDir::open(d).unwrap();
        let mut done = Done::default();
        let got = rd.take(&mut done);
        assert_eq!(
            taken(&got),
            vec![
                (
                    "1.json.applying",
                    ClearRequest {
                        code: Some("Xid79".into()),
                        device: None
                    }
                ),
                ("3.json.applying", ClearRequest::default()),
            ]
        );
        assert!(got[0].key.starts_with("1.json@"), "{}", got[0].key);
        assert_ne!(got[0].key, got[1].key);
        assert_eq!(
            names(d),
            [
                ".faultline-tmp",
                "1.json.applying",
                "2.rejected",
                "3.json.applying",
                "4.rejected",
                "5.rejected",
                "6.rejected",
                "7.rejected",
                "8.rejected",
                "9.rejected"
            ],
            "rejects kept for the operator to see; a writer's temporary file left alone"
        );
        // Taken requests are not taken again in the same run, but are after a restart, under
        // the identity they had (the engine loop answers them from the saved state).
        assert!(rd.take(&mut done).is_empty());
        assert_eq!(rd.take(&mut Done::default()), got);
        // A new request under a name taken before is a new file: it is read, and is another
        // request.
        std::fs::remove_file(d.join("1.json.applying")).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        write(d, "1.json", br#"{"device":"GPU-1"}"#);
        let again = rd.take(&mut done);
        assert_eq!(again.len(), 1, "{again:?}");
        assert_eq!(again[0].request.device.as_deref(), Some("GPU-1"));
        assert_ne!(again[0].key, got[0].key);
    }

    fn taken(p: &[Pending]) -> Vec<(&str, ClearRequest)> {
        p.iter()
            .map(|p| (p.name.as_str(), p.request.clone()))
            .collect()
    }

    /// A request that cannot be renamed or removed (a read-only directory) is applied exactly
    /// once, not at every tick; a rejected one is logged once and then left alone.
    #[test]
    fn a_request_that_cannot_be_removed_is_applied_once() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write(d, "1.json", br#"{"code":"Xid79"}"#);
        write(d, "2.json", br#"[]"#);
        let rd = RequestDir::open(d).unwrap().immutable();
        let mut done = Done::default();
        let first = rd.take(&mut done);
        assert_eq!(
            taken(&first),
            vec![(
                "1.json",
                ClearRequest {
                    code: Some("Xid79".into()),
                    device: None
                }
            )],
            "applied where it is"
        );
        for _ in 0..5 {
            assert_eq!(rd.take(&mut done), vec![], "not applied again");
        }
        assert_eq!(names(d), ["1.json", "2.json"], "nothing could be changed");
        assert_eq!(done.0.len(), 2, "both remembered while they are there");
    }

    /// The largest request `faultline clear` can write fits under the size cap.
    #[test]
    fn the_largest_valid_request_fits_the_cap() {
        let field = "\u{1}".repeat(MAX_FIELD_CHARS);
        let req = ClearRequest {
            code: Some(field.clone()),
            device: Some(field),
        };
        let bytes = serde_json::to_vec(&req).unwrap();
        assert!(bytes.len() as u64 <= MAX_REQUEST_BYTES, "{}", bytes.len());
        assert_eq!(parse_request(&bytes), Ok(req));
    }

    #[test]
    fn requests_that_are_not_plain_small_files_are_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        symlink("/dev/zero", d.join("zero.json")).unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, br#"{}"#).unwrap();
        symlink(&target, d.join("link.json")).unwrap();
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            d.join("fifo.json"),
            Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let big = format!(r#"{{"code":"Xid79","device":"{}"}}"#, "x".repeat(5000));
        write(d, "big.json", big.as_bytes());
        let rd = RequestDir::open(d).unwrap();
        assert_eq!(rd.read("zero.json"), Err(RequestError::Symlink));
        assert_eq!(rd.read("link.json"), Err(RequestError::Symlink));
        assert!(
            RequestError::Symlink.to_string().contains("symbolic link"),
            "the log says what was refused"
        );
        assert_eq!(rd.read("fifo.json"), Err(RequestError::NotRegular));
        assert_eq!(rd.read("big.json"), Err(RequestError::TooLarge));
        assert!(rd.take(&mut Done::default()).is_empty());
        assert!(target.exists(), "the link's target is never touched");
        assert_eq!(std::fs::read(&target).unwrap(), br#"{}"#);
        let mut left = names(d);
        left.retain(|n| n != "elsewhere");
        assert_eq!(
            left,
            [
                "big.rejected",
                "fifo.rejected",
                "link.rejected",
                "zero.rejected"
            ],
            "each set aside, none applied"
        );
    }

    #[test]
    fn a_symlinked_request_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        write(&elsewhere, "1.json", br#"{}"#);
        let link = dir.path().join(CLEAR_DIR);
        symlink(&elsewhere, &link).unwrap();
        assert!(RequestDir::open(&link).is_err());
        assert_eq!(
            names(&elsewhere),
            ["1.json"],
            "nothing renamed or removed there"
        );
    }

    #[test]
    fn request_errors_say_why() {
        let e = parse_request(b"[]").unwrap_err().to_string();
        assert!(e.contains("found an array"), "{e}");
        let e = parse_request(br#"{"code": 79}"#).unwrap_err().to_string();
        assert!(e.contains("invalid type"), "{e}");
        let e = parse_request(br#"{"device": "  "}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`device`"), "{e}");
        assert_eq!(parse_request(b"{}"), Ok(ClearRequest::default()));
    }

    /// `null` is not "any": what `jq -n '{code: env.CODE}'` writes with `CODE` unset clears
    /// nothing, and says why (read as `{}`, it would clear every active fault).
    #[test]
    fn a_null_field_is_refused_not_read_as_any() {
        for (body, says) in [
            (&br#"{"code": null}"#[..], "invalid type: null"),
            (br#"{"device": null}"#, "invalid type: null"),
            (
                br#"{"code": "Xid79", "device": null}"#,
                "invalid type: null",
            ),
            (
                br#"{"code": "Xid79", "code": "Xid13"}"#,
                "duplicate field `code`",
            ),
            (br#"{"code": "Xid79", "all": true}"#, "unknown field `all`"),
            (b"null", "found null"),
            (br#""Xid79""#, "found a string"),
        ] {
            let e = parse_request(body).unwrap_err();
            assert!(
                matches!(&e, RequestError::Schema(m) if m.contains(says)),
                "{}: {e}",
                String::from_utf8_lossy(body)
            );
        }
        // What `faultline clear` writes: absent fields, never nulls.
        let all = serde_json::to_vec(&ClearRequest::default()).unwrap();
        assert_eq!(all, b"{}");
        let one = ClearRequest {
            code: Some("Xid79".into()),
            device: None,
        };
        assert_eq!(serde_json::to_vec(&one).unwrap(), br#"{"code":"Xid79"}"#);
        assert_eq!(parse_request(br#"{"code":"Xid79"}"#), Ok(one));
    }

    fn ctx() -> (SourceContext, tokio::sync::mpsc::Receiver<Input>) {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let ctx = SourceContext {
            tx,
            metrics: std::sync::Arc::new(crate::metrics::Metrics::new()),
            clock: std::sync::Arc::new(crate::clock::SystemClock),
            shutdown: tokio_util::sync::CancellationToken::new(),
        };
        (ctx, rx)
    }

    /// The control source with a report channel: (task, inputs, report sender, persisted).
    #[allow(clippy::type_complexity)]
    fn start(
        state: &Path,
    ) -> (
        SourceContext,
        tokio::task::JoinHandle<()>,
        tokio::sync::mpsc::Receiver<Input>,
        mpsc::UnboundedSender<ClearApplied>,
        watch::Sender<u64>,
    ) {
        start_with(state, Duration::from_millis(10))
    }

    /// [`start`] with the retry interval `retry`.
    #[allow(clippy::type_complexity)]
    fn start_with(
        state: &Path,
        retry: Duration,
    ) -> (
        SourceContext,
        tokio::task::JoinHandle<()>,
        tokio::sync::mpsc::Receiver<Input>,
        mpsc::UnboundedSender<ClearApplied>,
        watch::Sender<u64>,
    ) {
        let (ctx, rx) = ctx();
        let (persist_tx, persist_rx) = watch::channel(0u64);
        let (report_tx, report_rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(
            state.to_path_buf(),
            ctx.clone(),
            persist_rx,
            report_rx,
            retry,
        ));
        (ctx, task, rx, report_tx, persist_tx)
    }

    /// The next clear sent to the engine loop: (code, device, marker).
    async fn next_clear(
        rx: &mut tokio::sync::mpsc::Receiver<Input>,
    ) -> (Option<String>, Option<String>, u64) {
        match rx.recv().await {
            Some(Input::Clear {
                code,
                device,
                marker,
                ..
            }) => (code, device, marker),
            other => panic!("{other:?}"),
        }
    }

    async fn until(what: &str, f: impl Fn() -> bool) {
        for _ in 0..500 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    /// The request file stays until the clear is written to disk; then the answer is written
    /// and only then the request goes.
    #[tokio::test]
    async fn a_clear_is_answered_only_once_persisted() {
        let state = tempfile::tempdir().unwrap();
        let d = state.path().join(CLEAR_DIR);
        std::fs::create_dir(&d).unwrap();
        write(&d, "1.json", br#"{"code":"Xid79"}"#);
        let (ctx, task, mut rx, reports, persist_tx) = start(state.path());
        let (code, _, m1) = next_clear(&mut rx).await;
        assert_eq!((code.as_deref(), m1), (Some("Xid79"), 1));
        reports
            .send(ClearApplied {
                marker: 1,
                result: answer(2),
            })
            .unwrap();
        // A second request is applied while the first waits for the disk.
        write(&d, "2.json", br#"{"device":"GPU-1"}"#);
        let (_, device, m2) = next_clear(&mut rx).await;
        assert_eq!((device.as_deref(), m2), (Some("GPU-1"), 2));
        reports
            .send(ClearApplied {
                marker: 2,
                result: answer(0),
            })
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(is_pending(&d, "1.json"), "not on disk yet: still pending");
        assert!(read_result(&d, "1.json").is_none(), "and not answered");
        assert_eq!(names(&d), ["1.json.applying", "2.json.applying"]);
        persist_tx.send_replace(1);
        until("the first answered", || !is_pending(&d, "1.json")).await;
        assert_eq!(read_result(&d, "1.json").unwrap().unwrap(), answer(2));
        assert!(is_pending(&d, "2.json"), "its marker is not on disk yet");
        assert!(read_result(&d, "2.json").is_none());
        persist_tx.send_replace(2);
        until("the second answered", || !is_pending(&d, "2.json")).await;
        assert_eq!(read_result(&d, "2.json").unwrap().unwrap(), answer(0));
        remove_result(&d, "1.json").unwrap();
        remove_result(&d, "2.json").unwrap();
        assert_eq!(names(&d), Vec::<String>::new(), "nothing left behind");
        ctx.shutdown.cancel();
        task.await.unwrap();
    }

    /// A request left `*.applying` by a run that was killed is sent again by the next run, under
    /// the identity it had, so the engine loop knows it (and answers it from the saved state if
    /// the clear was saved).
    #[tokio::test]
    async fn a_request_left_applying_is_sent_again_at_the_next_start() {
        let state = tempfile::tempdir().unwrap();
        let d = state.path().join(CLEAR_DIR);
        std::fs::create_dir(&d).unwrap();
        write(&d, "1.json", br#"{"device":"GPU-3"}"#);
        let first = RequestDir::open(&d).unwrap().take(&mut Done::default());
        assert_eq!(names(&d), ["1.json.applying"], "taken, then the kill");
        let (ctx, task, mut rx, _reports, _persist) = start(state.path());
        match rx.recv().await {
            Some(Input::Clear {
                request,
                code,
                device,
                ..
            }) => {
                assert_eq!((code, device), (None, Some("GPU-3".into())));
                assert_eq!(request, first[0].key);
            }
            other => panic!("{other:?}"),
        }
        ctx.shutdown.cancel();
        task.await.unwrap();
    }

    /// A request as the CLI writes it: a temporary file renamed into place.
    fn drop_request(dir: &Path, name: &str, body: &[u8]) {
        let tmp = dir.join(format!(".faultline-tmp-{name}"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }

    /// The next clear, failing the test if none comes within a minute (a guard against a hang,
    /// not a measurement: the source reacts within its 100 ms settle).
    async fn soon(rx: &mut tokio::sync::mpsc::Receiver<Input>, what: &str) -> Option<String> {
        let next = tokio::time::timeout(Duration::from_secs(60), next_clear(rx));
        next.await.unwrap_or_else(|_| panic!("{what}: not read")).0
    }

    /// A request is read when it arrives, not at the next poll: with a retry interval of an
    /// hour, requests dropped in one after the other (renamed in, as the CLI does, and written
    /// in place by hand) are each read at once.
    #[tokio::test]
    async fn a_request_is_read_when_it_arrives() {
        let state = tempfile::tempdir().unwrap();
        let d = state.path().join(CLEAR_DIR);
        std::fs::create_dir(&d).unwrap();
        let (ctx, task, mut rx, _reports, _persist) =
            start_with(state.path(), Duration::from_secs(3600));
        drop_request(&d, "1.json", br#"{"code":"Xid79"}"#);
        assert_eq!(soon(&mut rx, "renamed in").await.as_deref(), Some("Xid79"));
        write(&d, "2.json", br#"{"code":"Xid48"}"#);
        assert_eq!(
            soon(&mut rx, "written in place").await.as_deref(),
            Some("Xid48")
        );
        ctx.shutdown.cancel();
        task.await.unwrap();
    }

    /// The watch follows the directory: one missing at start is read once it is created, and
    /// one removed and created again (as `faultline clear` does with `create_dir_all`) is
    /// watched anew.
    #[tokio::test]
    async fn a_request_directory_created_or_replaced_is_watched_anew() {
        let state = tempfile::tempdir().unwrap();
        let d = state.path().join(CLEAR_DIR);
        let (ctx, task, mut rx, _reports, _persist) =
            start_with(state.path(), Duration::from_secs(3600));
        // The record beside it changes every heartbeat: not a reason to read the directory.
        std::fs::write(state.path().join("faults.json"), b"{}").unwrap();
        std::fs::create_dir(&d).unwrap();
        drop_request(&d, "1.json", br#"{"code":"Xid79"}"#);
        assert_eq!(soon(&mut rx, "created").await.as_deref(), Some("Xid79"));
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::create_dir(&d).unwrap();
        drop_request(&d, "2.json", br#"{"code":"Xid48"}"#);
        assert_eq!(soon(&mut rx, "replaced").await.as_deref(), Some("Xid48"));
        // Renamed away and another put in its place.
        std::fs::rename(&d, state.path().join("old")).unwrap();
        std::fs::create_dir(&d).unwrap();
        drop_request(&d, "3.json", br#"{"code":"Xid95"}"#);
        assert_eq!(soon(&mut rx, "renamed").await.as_deref(), Some("Xid95"));
        ctx.shutdown.cancel();
        task.await.unwrap();
    }
}
