//! Operator requests: `faultline clear` drops a JSON request into `<state-dir>/clear.d/`; this
//! source applies it and removes the file once the clear is on disk.
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
//! - its JSON must be an object with only `code` and `device`, each a non-empty short string
//!   (`[]` or `["Xid79"]` is not read as "clear all"); `{}` clears every fault on purpose.
//!
//! A request that fails any of this is renamed to `*.rejected` and the reason logged (the CLI
//! reports the rejection). A request that cannot be read for a passing reason (out of memory or
//! descriptors) stays and is read again at the next tick.
//!
//! Once: every request read is remembered by its file's identity ([`FileId`]: device, inode,
//! modification time) before it is acted on, and a file with a remembered identity is never
//! read again in this run, whatever its name. So a request that cannot be renamed or removed
//! (a read-only directory) is applied once and then left alone, not applied and logged every
//! second; a new request, even under the same name, is a new file and is read.
//!
//! Durability: a request is first renamed to `*.json.applying` (taken), then applied, then
//! followed through the engine by a marker; it is removed as soon as the file sink reports that
//! marker written to `state.json`, without holding up later requests. The CLI reports "cleared"
//! when both names are gone. Only a kill in the second or so between applying and writing
//! leaves `*.applying`, which the next start applies again (as it does a request it could not
//! remove).

use std::collections::HashSet;
use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::fs::{AtFlags, Mode, OFlags};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{info, warn};

use super::{Input, SourceContext};
use crate::operator_file::{read_opened, OperatorFileError};
use faultline_core::engine::Observation;

pub const CLEAR_DIR: &str = "clear.d";
/// A request that is taken and being applied.
pub const APPLYING_SUFFIX: &str = ".applying";
/// The largest request read. A clear request is a few dozen bytes; the largest valid one, as
/// `faultline clear` writes it (two fields of [`MAX_FIELD_CHARS`] characters; JSON takes at
/// most 6 bytes for a character, a control character's `\u00XX`), is about 3 KiB. Anything
/// longer is not a request, and is refused without being read into memory.
pub const MAX_REQUEST_BYTES: u64 = 4096;
/// The longest `code` or `device` accepted.
pub const MAX_FIELD_CHARS: usize = 256;

/// One clear request; both fields absent clears every active fault.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClearRequest {
    #[serde(default)]
    pub code: Option<String>,
    /// Device name (`GPU-3`), UUID or PCI bus id.
    #[serde(default)]
    pub device: Option<String>,
}

/// Why a request was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
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

/// Parses a request: a JSON object with at most `code` and `device`.
pub fn parse_request(bytes: &[u8]) -> Result<ClearRequest, RequestError> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| RequestError::Schema(e.to_string()))?;
    if !v.is_object() {
        return Err(RequestError::Schema(format!("found {}", kind(&v))));
    }
    let r: ClearRequest =
        serde_json::from_value(v).map_err(|e| RequestError::Schema(e.to_string()))?;
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
pub struct FileId {
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
pub struct Done(HashSet<FileId>);

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
pub struct RequestDir {
    fd: OwnedFd,
    path: PathBuf,
    /// Tests: every rename and removal fails, as in a read-only directory (root, which the
    /// tests may run as, ignores permissions).
    immutable: bool,
}

/// One request found in the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// Its name now (`*.json.applying` once taken).
    pub name: String,
    pub request: ClearRequest,
}

impl RequestDir {
    /// Opens `dir`; a symlink or anything but a directory is an error.
    pub fn open(dir: &Path) -> std::io::Result<RequestDir> {
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

    fn exists(&self, name: &str) -> bool {
        cname(name)
            .is_ok_and(|c| rustix::fs::statat(&self.fd, &c, AtFlags::SYMLINK_NOFOLLOW).is_ok())
    }

    fn remove(&self, name: &str) -> std::io::Result<()> {
        self.refuse_changes()?;
        rustix::fs::unlinkat(&self.fd, &cname(name)?, AtFlags::empty())?;
        Ok(())
    }

    /// Takes every new request: `*.json` becomes `*.json.applying`; bad ones become
    /// `*.rejected`. Requests already `*.applying` (left by a run that was killed) are returned
    /// too. A file in `done` is skipped; every file acted on is added to it before it is
    /// returned, and `done` forgets files no longer in the directory. Oldest name first.
    pub fn take(&self, done: &mut Done) -> Vec<Pending> {
        let names = match self.names() {
            Ok(n) => n,
            Err(e) => {
                warn!(dir = %self.path.display(), error = %e, "cannot list clear requests");
                return Vec::new();
            }
        };
        let mut present = HashSet::new();
        let mut out = Vec::new();
        for name in names {
            let taken = if let Some(base) = name.strip_suffix(APPLYING_SUFFIX) {
                if !base.ends_with(".json") {
                    continue;
                }
                name.clone()
            } else if name.ends_with(".json") {
                let taken = applying_name(&name);
                if self.exists(&taken) {
                    continue; // a request of the same name is still being applied: later
                }
                taken
            } else {
                continue; // temporary files of a writer, rejected requests, anything else
            };
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
                    let name = if taken == name {
                        name
                    } else {
                        match self.rename(&name, &taken) {
                            Ok(()) => taken,
                            Err(e) => {
                                warn!(dir = %self.path.display(), name, error = %e, "cannot rename a clear request; applying it once where it is (it is not applied again while the agent runs, but again after a restart if it is still there)");
                                name
                            }
                        }
                    };
                    out.push(Pending { name, request });
                }
                Err(e @ RequestError::Io(_)) => {
                    warn!(dir = %self.path.display(), name, error = %e, "cannot read a clear request now; trying again");
                }
                Err(e) => {
                    warn!(dir = %self.path.display(), name, error = %e, "rejected a clear request");
                    if let Some(id) = id {
                        done.0.insert(id);
                    }
                    let base = name.strip_suffix(APPLYING_SUFFIX).unwrap_or(&name);
                    if self.rename(&name, &rejected_name(base)).is_err() {
                        if let Err(e) = self.remove(&name) {
                            warn!(dir = %self.path.display(), name, error = %e, "cannot set a rejected clear request aside; it is ignored while the agent runs");
                        }
                    }
                }
            }
        }
        done.0.retain(|id| present.contains(id));
        out
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

/// Whether a request named `name` (`*.json`) is still pending in `dir`: for the CLI.
pub fn is_pending(dir: &Path, name: &str) -> bool {
    dir.join(name).exists() || dir.join(applying_name(name)).exists()
}

/// Whether the agent rejected the request named `name` (`*.json`): for the CLI.
pub fn is_rejected(dir: &Path, name: &str) -> bool {
    dir.join(rejected_name(name)).exists()
}

/// Polls the request directory until shutdown. `persisted` is the highest marker the file sink
/// has written to disk.
pub async fn run(
    state_dir: PathBuf,
    ctx: SourceContext,
    mut persisted: watch::Receiver<u64>,
    every: Duration,
) {
    let dir = state_dir.join(CLEAR_DIR);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut done = Done::default();
    // Applied, waiting for their marker to reach the disk: (request, marker).
    let mut awaiting: Vec<(String, u64)> = Vec::new();
    let mut marker = 0u64;
    let mut rd: Option<RequestDir> = None;
    loop {
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tick.tick() => {}
            Ok(()) = persisted.changed(), if !awaiting.is_empty() => {}
        }
        let on_disk = *persisted.borrow_and_update();
        if let Some(rd) = &rd {
            awaiting.retain(|(name, m)| {
                if *m > on_disk {
                    return true;
                }
                if let Err(e) = rd.remove(name) {
                    warn!(request = name, error = %e, "cannot remove an applied clear request (it is not applied again while the agent runs)");
                }
                false
            });
        }
        // The directory is read on a blocking thread; `done` goes there and comes back.
        let d = dir.clone();
        let mut remembered = std::mem::take(&mut done);
        let taken = tokio::task::spawn_blocking(move || {
            let opened = RequestDir::open(&d).map(|rd| (rd.take(&mut remembered), rd));
            (opened, remembered)
        })
        .await;
        // A panicked task (it cannot, short of a bug) loses what it remembered, not the loop.
        let Ok((opened, remembered)) = taken else {
            continue;
        };
        done = remembered;
        let requests = match opened {
            Ok((requests, opened)) => {
                rd = Some(opened);
                requests
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                warn!(dir = %dir.display(), error = %e, "cannot open the clear request directory (a symlink or not a directory is refused)");
                continue;
            }
        };
        for p in requests {
            info!(code = ?p.request.code, device = ?p.request.device, "operator clear");
            let obs = Observation::OperatorClear {
                code: p.request.code.clone(),
                device: p.request.device.clone(),
            };
            marker += 1;
            let sent = ctx.tx.send(Input::Obs(obs)).await.is_ok()
                && ctx.tx.send(Input::Marker(marker)).await.is_ok();
            if !sent {
                return;
            }
            awaiting.push((p.name, marker));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        write(d, ".faultline-tmp", br#"{}"#);
        let rd = RequestDir::open(d).unwrap();
        let mut done = Done::default();
        let got = rd.take(&mut done);
        assert_eq!(
            got,
            vec![
                Pending {
                    name: "1.json.applying".into(),
                    request: ClearRequest {
                        code: Some("Xid79".into()),
                        device: None
                    }
                },
                Pending {
                    name: "3.json.applying".into(),
                    request: ClearRequest::default()
                },
            ]
        );
        assert_eq!(
            names(d),
            [
                ".faultline-tmp",
                "1.json.applying",
                "2.rejected",
                "3.json.applying",
                "4.rejected",
                "5.rejected",
                "6.rejected"
            ],
            "rejects kept for the operator to see; a writer's temporary file left alone"
        );
        // Taken requests are not taken again in the same run, but are after a restart.
        assert!(rd.take(&mut done).is_empty());
        assert_eq!(rd.take(&mut Done::default()).len(), 2);
        // A new request under a name taken before is a new file: it is read.
        std::fs::remove_file(d.join("1.json.applying")).unwrap();
        write(d, "1.json", br#"{"device":"GPU-1"}"#);
        let again = rd.take(&mut done);
        assert_eq!(again.len(), 1, "{again:?}");
        assert_eq!(again[0].request.device.as_deref(), Some("GPU-1"));
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
            first,
            vec![Pending {
                name: "1.json".into(),
                request: ClearRequest {
                    code: Some("Xid79".into()),
                    device: None
                }
            }],
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

    fn ctx() -> (SourceContext, tokio::sync::mpsc::Receiver<Input>) {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let ctx = SourceContext {
            tx,
            metrics: std::sync::Arc::new(crate::metrics::Metrics::new()),
            shutdown: tokio_util::sync::CancellationToken::new(),
        };
        (ctx, rx)
    }

    /// The request file stays until the clear is written to disk, and only then goes.
    #[tokio::test]
    async fn a_clear_is_acknowledged_only_once_persisted() {
        let state = tempfile::tempdir().unwrap();
        let d = state.path().join(CLEAR_DIR);
        std::fs::create_dir(&d).unwrap();
        write(&d, "1.json", br#"{"code":"Xid79"}"#);
        let (ctx, mut rx) = ctx();
        let (persist_tx, persist_rx) = watch::channel(0u64);
        let task = tokio::spawn(run(
            state.path().to_path_buf(),
            ctx.clone(),
            persist_rx,
            Duration::from_millis(10),
        ));
        assert!(matches!(
            rx.recv().await,
            Some(Input::Obs(Observation::OperatorClear { .. }))
        ));
        assert_eq!(rx.recv().await, Some(Input::Marker(1)));
        // A second request is applied while the first waits for the disk.
        write(&d, "2.json", br#"{"device":"GPU-1"}"#);
        assert!(matches!(
            rx.recv().await,
            Some(Input::Obs(Observation::OperatorClear { .. }))
        ));
        assert_eq!(rx.recv().await, Some(Input::Marker(2)));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(is_pending(&d, "1.json"), "not on disk yet: still pending");
        assert_eq!(names(&d), ["1.json.applying", "2.json.applying"]);
        persist_tx.send_replace(1);
        for _ in 0..100 {
            if !is_pending(&d, "1.json") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!is_pending(&d, "1.json"), "removed once persisted");
        assert!(is_pending(&d, "2.json"), "its marker is not on disk yet");
        persist_tx.send_replace(2);
        for _ in 0..100 {
            if !is_pending(&d, "2.json") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!is_pending(&d, "2.json"));
        ctx.shutdown.cancel();
        task.await.unwrap();
    }

    /// A request taken by a run that was killed before the clear reached the disk is applied
    /// again by the next run.
    #[tokio::test]
    async fn a_request_left_applying_is_applied_at_the_next_start() {
        let state = tempfile::tempdir().unwrap();
        let d = state.path().join(CLEAR_DIR);
        std::fs::create_dir(&d).unwrap();
        write(&d, "1.json.applying", br#"{"device":"GPU-3"}"#);
        let (ctx, mut rx) = ctx();
        let (_persist_tx, persist_rx) = watch::channel(0u64);
        let task = tokio::spawn(run(
            state.path().to_path_buf(),
            ctx.clone(),
            persist_rx,
            Duration::from_millis(10),
        ));
        match rx.recv().await {
            Some(Input::Obs(Observation::OperatorClear { code, device })) => {
                assert_eq!((code, device), (None, Some("GPU-3".into())));
            }
            other => panic!("{other:?}"),
        }
        ctx.shutdown.cancel();
        task.await.unwrap();
    }
}
