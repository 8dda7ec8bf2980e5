//! One agent per directory. Before the agent reads or writes anything in its data directory
//! (`state.json`) or its state directory (`faults.json`, `clear.d/`), it takes an exclusive
//! `flock(2)` on a file in each ([`LOCK_FILE`]) and holds it for its whole life. A second agent
//! started on the same directories (a replay run by mistake, a leftover unit, a second
//! DaemonSet) finds the lock taken and exits at once, naming the holder, before it has touched a
//! file.
//!
//! `flock` rather than a POSIX record lock: it belongs to the open file description, so the
//! kernel releases it when the process ends, however it ends (SIGKILL included), and closing
//! some other descriptor of the same file (as a POSIX lock would) does not drop it. The
//! descriptor is close-on-exec, so a child (a probe, `npu-smi`) outliving the agent does not
//! keep it. The lock file is never removed, not even on exit: removing it while another agent
//! waits would let two agents hold locks on two different files of the same name.
//!
//! The file's content says who holds it (pid, node, start time), for the message a second agent
//! prints and for [`probe`]. It is information only: the lock is what decides.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use rustix::io::Errno;
use tracing::warn;

/// The lock file, in the data directory and in the state directory.
pub const LOCK_FILE: &str = "agent.lock";

/// How long [`acquire`] keeps trying while the lock is taken. A running agent holds it for good,
/// so a second agent still exits within this; a reader's [`probe`] holds it for microseconds
/// and must not make a starting agent give up.
pub const PATIENCE: Duration = Duration::from_millis(500);

/// Largest holder description read back (it is a line of JSON).
const MAX_HOLDER_BYTES: u64 = 4096;

/// Who holds the lock, as its holder wrote it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    pub pid: u32,
    pub node: String,
    pub started: faultline_core::time::Timestamp,
}

impl Holder {
    /// This process, on `node`, now.
    pub fn this_process(node: &str) -> Holder {
        Holder {
            pid: std::process::id(),
            node: node.to_string(),
            started: faultline_core::time::Timestamp::now(),
        }
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {}, node {}, started {}",
            self.pid, self.node, self.started
        )
    }
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "another faultline agent holds {path} ({}): one agent per state and data directory. \
         Stop that agent first, or give this one its own --state-dir and --data-dir",
        holder.as_ref().map_or_else(|| "holder unknown".to_string(), Holder::to_string)
    )]
    Held {
        path: PathBuf,
        holder: Option<Holder>,
    },
    #[error("cannot lock {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot lock {path}: not a regular file")]
    NotRegular { path: PathBuf },
}

/// An exclusive lock on a directory, held until dropped (or the process ends).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    pub path: PathBuf,
}

/// Opens the lock file of `dir` without following a symlink (nothing planted there is written
/// through) and without blocking (a FIFO put in its place is refused, not waited on).
fn open(dir: &Path, create: bool) -> Result<(File, PathBuf), LockError> {
    let path = dir.join(LOCK_FILE);
    let flags = rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(create)
        .create(create)
        .mode(0o644)
        .custom_flags(flags.bits() as i32)
        .open(&path)
        .map_err(|source| LockError::Io {
            path: path.clone(),
            source,
        })?;
    let meta = file.metadata().map_err(|source| LockError::Io {
        path: path.clone(),
        source,
    })?;
    if !meta.file_type().is_file() {
        return Err(LockError::NotRegular { path });
    }
    Ok((file, path))
}

fn read_holder(file: &File) -> Option<Holder> {
    let mut text = Vec::new();
    file.take(MAX_HOLDER_BYTES).read_to_end(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Whether an error says this process may not write there (a read-only file system, no
/// permission).
fn cannot_write(e: &std::io::Error) -> bool {
    [Errno::ROFS, Errno::ACCESS, Errno::PERM]
        .iter()
        .any(|n| e.raw_os_error() == Some(n.raw_os_error()))
}

/// Takes the lock of `dir` for `holder`, trying for `patience` while it is taken. In a directory
/// this process cannot write (a read-only file system), an existing lock file is locked all the
/// same (opened read-only); with none, `Ok(None)`: there is nothing to lock, and nothing this
/// agent could overwrite there (the agent runs on, as with a disk that failed later). A holder
/// that cannot be written (a full disk) leaves the lock held, the file not naming it.
pub fn acquire(
    dir: &Path,
    holder: &Holder,
    patience: Duration,
) -> Result<Option<DirLock>, LockError> {
    let (file, path) = match open(dir, true) {
        Err(LockError::Io { source, .. }) if cannot_write(&source) => match open(dir, false) {
            Err(LockError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(None)
            }
            other => other?,
        },
        other => other?,
    };
    let deadline = Instant::now() + patience;
    loop {
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => break,
            Err(Errno::WOULDBLOCK) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(Errno::WOULDBLOCK) => {
                let holder = read_holder(&file);
                return Err(LockError::Held { path, holder });
            }
            Err(e) => {
                return Err(LockError::Io {
                    path,
                    source: e.into(),
                })
            }
        }
    }
    // Written in place (no rename: the lock is on this inode), then cut to length.
    let mut text = serde_json::to_vec(holder).unwrap_or_default();
    text.push(b'\n');
    let written = file
        .write_all_at(&text, 0)
        .and_then(|()| file.set_len(text.len() as u64));
    if let Err(e) = written {
        warn!(path = %path.display(), error = %e, "the lock is held, but cannot name its holder");
    }
    Ok(Some(DirLock { _file: file, path }))
}

/// Takes the locks of every directory in `dirs`, in order; a directory named twice (or by two
/// paths) is locked once.
pub fn acquire_all(
    dirs: &[&Path],
    holder: &Holder,
    patience: Duration,
) -> Result<Vec<DirLock>, LockError> {
    let mut seen = Vec::new();
    let mut locks = Vec::new();
    for dir in dirs {
        let real = std::fs::canonicalize(dir).map_err(|source| LockError::Io {
            path: dir.join(LOCK_FILE),
            source,
        })?;
        if seen.contains(&real) {
            continue;
        }
        match acquire(&real, holder, patience)? {
            Some(lock) => locks.push(lock),
            None => {
                warn!(dir = %real.display(), "cannot create the lock file: this agent cannot write the directory (nor overwrite anything in it); running without its lock")
            }
        }
        seen.push(real);
    }
    Ok(locks)
}

/// Whether an agent holds the lock of `dir`, as far as the lock file tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockState {
    /// No live process holds it (or there is no lock file: no agent of this version ran here).
    Free,
    /// A live process holds it; who, if its description could be read.
    Held(Option<Holder>),
}

/// Asks whether a live agent holds the lock of `dir`, without taking it for more than an
/// instant (a shared lock, released at once; [`acquire`] waits out such an instant).
pub fn probe(dir: &Path) -> Result<LockState, LockError> {
    let (file, path) = match open(dir, false) {
        Err(LockError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(LockState::Free)
        }
        other => other?,
    };
    match flock(&file, FlockOperation::NonBlockingLockShared) {
        Ok(()) => Ok(LockState::Free),
        Err(Errno::WOULDBLOCK) => Ok(LockState::Held(read_holder(&file))),
        Err(e) => Err(LockError::Io {
            path,
            source: e.into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: u32) -> Holder {
        Holder {
            pid,
            node: "node-a".into(),
            started: faultline_core::time::Timestamp::from_second(1_800_000_000).unwrap(),
        }
    }

    /// The second taker is refused and told who holds it; once the holder lets go, the lock is
    /// free again and the file names the new holder.
    #[test]
    fn a_held_lock_names_its_holder_and_is_free_after() {
        let dir = tempfile::tempdir().unwrap();
        let first = acquire(dir.path(), &holder(1), Duration::ZERO)
            .unwrap()
            .unwrap();
        assert_eq!(probe(dir.path()).unwrap(), LockState::Held(Some(holder(1))));
        let e = acquire(dir.path(), &holder(2), Duration::from_millis(20)).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("pid 1, node node-a, started 2027-01-15T08:00:00Z"),
            "{msg}"
        );
        assert!(msg.contains(LOCK_FILE), "{msg}");
        drop(first);
        assert_eq!(probe(dir.path()).unwrap(), LockState::Free);
        let _second = acquire(dir.path(), &holder(2), Duration::ZERO)
            .unwrap()
            .unwrap();
        assert_eq!(probe(dir.path()).unwrap(), LockState::Held(Some(holder(2))));
    }

    /// One directory named by two paths is locked once (a second lock of the same file by this
    /// process would conflict with the first).
    #[test]
    fn the_same_directory_twice_is_locked_once() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        let locks =
            acquire_all(&[dir.path(), &link, dir.path()], &holder(1), Duration::ZERO).unwrap();
        assert_eq!(locks.len(), 1);
    }

    /// Nothing planted as the lock file is followed or waited on: a symlink and a FIFO are
    /// refused.
    #[test]
    fn a_planted_lock_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(LOCK_FILE)).unwrap();
        assert!(acquire(dir.path(), &holder(1), Duration::ZERO).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");

        let fifo_dir = tempfile::tempdir().unwrap();
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            fifo_dir.path().join(LOCK_FILE),
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let e = acquire(fifo_dir.path(), &holder(1), Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    /// A reader probing the lock in a tight loop never makes a starting agent give up: the
    /// probe's shared lock lasts an instant, and the agent waits such instants out.
    #[test]
    fn a_probe_never_makes_a_starting_agent_fail() {
        let dir = tempfile::tempdir().unwrap();
        drop(
            acquire(dir.path(), &holder(1), Duration::ZERO)
                .unwrap()
                .unwrap(),
        );
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let prober = {
            let (dir, stop) = (dir.path().to_path_buf(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = probe(&dir);
                }
            })
        };
        for _ in 0..200 {
            drop(acquire(dir.path(), &holder(1), PATIENCE).unwrap().unwrap());
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        prober.join().unwrap();
    }
}
