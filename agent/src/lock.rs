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
//! `flock` needs no write access, only an open descriptor: whoever can open the file can take
//! the lock the moment the agent exits and keep every later agent from starting. So the file
//! is the agent user's alone (created 0600; an existing one must be a regular file owned by
//! this euid, and is made 0600 if it is wider), and the directory must be writable by nobody
//! else (owned by this euid or root, no group or other write bit): else another user could
//! create the file first and keep a descriptor of it.
//!
//! The file's content says who holds it (pid, node, start time), for the message a second agent
//! prints. It is information only: the lock is what decides, and the holder is named only when
//! that pid runs a faultline agent now.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation, Mode, OFlags};
use rustix::io::Errno;
use tracing::warn;

/// The lock file, in the data directory and in the state directory.
pub(crate) const LOCK_FILE: &str = "agent.lock";

/// The agent's process name (`/proc/<pid>/comm`: the executable's name, at most 15 bytes).
const AGENT_COMM: &str = "faultline-agent";

/// Largest holder description read back (it is a line of JSON).
const MAX_HOLDER_BYTES: u64 = 4096;

/// Who holds the lock, as its holder wrote it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Holder {
    pub pid: u32,
    pub node: String,
    pub started: faultline_core::time::Timestamp,
}

impl Holder {
    /// This process, on `node`, started at `started`.
    pub(crate) fn this_process(node: &str, started: faultline_core::time::Timestamp) -> Holder {
        Holder {
            pid: std::process::id(),
            node: node.to_string(),
            started,
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

/// What the file of a lock held by something we cannot name says.
fn claim(named: &Option<u32>) -> String {
    match named {
        Some(pid) => format!("the file names pid {pid}, which is not running it"),
        None => "the file names no holder".to_string(),
    }
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    #[error(
        "another faultline agent holds {path} ({holder}): one agent per state and data directory. \
         Stop that agent first, or give this one its own --state-dir and --data-dir"
    )]
    Held { path: PathBuf, holder: Holder },
    #[error(
        "{path} is held by another process (not a faultline agent we can name: {}): no agent \
         can start on this directory while it holds it. Find it with `fuser -v {path}` or \
         `lsof {path}`",
        claim(named)
    )]
    HeldByOther { path: PathBuf, named: Option<u32> },
    #[error("cannot lock {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot lock {path}: not a regular file")]
    NotRegular { path: PathBuf },
    #[error(
        "cannot lock {path}: it is owned by uid {owner}, not by this agent's uid {euid}, and \
         its owner may hold it open to keep every agent from starting; remove it"
    )]
    NotOurs {
        path: PathBuf,
        owner: u32,
        euid: u32,
    },
    #[error(
        "refusing {dir} as a state or data directory: {why}, so another user could create its \
         {LOCK_FILE} first and keep every agent from starting. Give the agent a directory only \
         it (or root) can write: `chmod go-w`, or another --state-dir / --data-dir"
    )]
    UnsafeDir { dir: PathBuf, why: String },
}

/// An exclusive lock on a directory, held until dropped (or the process ends).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

/// Refuses a directory that someone other than this euid or root can write (or could make
/// writable: its owner).
fn check_dir(dir_fd: &rustix::fd::OwnedFd, dir: &Path, euid: u32) -> Result<(), LockError> {
    let st = rustix::fs::fstat(dir_fd).map_err(|e| LockError::Io {
        path: dir.to_path_buf(),
        source: e.into(),
    })?;
    let why = if st.st_uid != euid && st.st_uid != 0 {
        format!(
            "it is owned by uid {}, neither this agent's uid {euid} nor root",
            st.st_uid
        )
    } else if st.st_mode & 0o022 != 0 {
        format!(
            "it is writable by its group or by others (mode {:o})",
            st.st_mode & 0o7777
        )
    } else {
        return Ok(());
    };
    Err(LockError::UnsafeDir {
        dir: dir.to_path_buf(),
        why,
    })
}

/// Opens the lock file of `dir` (created 0600 when `create`) without following a symlink
/// (nothing planted there is written through) and without blocking (a FIFO put in its place is
/// refused, not waited on); refuses it unless it is a regular file of this euid, and makes it
/// 0600 if it is wider.
fn open(dir: &Path, create: bool) -> Result<(File, PathBuf), LockError> {
    let path = dir.join(LOCK_FILE);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e: Errno| LockError::Io {
            path,
            source: e.into(),
        }
    };
    let euid = rustix::process::geteuid().as_raw();
    let dir_fd = rustix::fs::open(
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io(dir))?;
    check_dir(&dir_fd, dir, euid)?;
    let access = if create {
        OFlags::RDWR | OFlags::CREATE
    } else {
        OFlags::RDONLY
    };
    let fd = rustix::fs::openat(
        &dir_fd,
        LOCK_FILE,
        access | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(io(&path))?;
    let st = rustix::fs::fstat(&fd).map_err(io(&path))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(LockError::NotRegular { path });
    }
    if st.st_uid != euid {
        return Err(LockError::NotOurs {
            path,
            owner: st.st_uid,
            euid,
        });
    }
    if st.st_mode & 0o077 != 0 {
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600)).map_err(io(&path))?;
    }
    Ok((File::from(fd), path))
}

fn read_holder(file: &File) -> Option<Holder> {
    let mut text = Vec::new();
    file.take(MAX_HOLDER_BYTES).read_to_end(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Whether `pid` is a running faultline agent (as seen from this pid namespace).
fn runs_agent(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .is_ok_and(|comm| comm.trim_end_matches('\n') == AGENT_COMM)
}

/// The error for a lock that is taken: naming the holder the file describes only when that pid
/// runs a faultline agent (a file left by a dead agent, and held now by something else, must
/// not send the operator after a dead or reused pid).
fn held(path: PathBuf, file: &File) -> LockError {
    match read_holder(file) {
        Some(holder) if runs_agent(holder.pid) => LockError::Held { path, holder },
        other => LockError::HeldByOther {
            path,
            named: other.map(|h| h.pid),
        },
    }
}

/// Whether an error says this process may not write there (a read-only file system, no
/// permission).
fn cannot_write(e: &std::io::Error) -> bool {
    [Errno::ROFS, Errno::ACCESS, Errno::PERM]
        .iter()
        .any(|n| e.raw_os_error() == Some(n.raw_os_error()))
}

/// Takes the lock of `dir` for `holder`, or fails at once if it is taken. In a directory this
/// process cannot write (a read-only file system), an existing lock file is locked all the
/// same (opened read-only); with none, `Ok(None)`: there is nothing to lock, and nothing this
/// agent could overwrite there (the agent runs on, as with a disk that failed later). A holder
/// that cannot be written (a full disk) leaves the lock held, the file not naming it.
pub(crate) fn acquire(dir: &Path, holder: &Holder) -> Result<Option<DirLock>, LockError> {
    let (file, path) = match open(dir, true) {
        Err(LockError::Io { source, .. }) if cannot_write(&source) => match open(dir, false) {
            Err(LockError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(None)
            }
            other => other?,
        },
        other => other?,
    };
    match flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(Errno::WOULDBLOCK) => return Err(held(path, &file)),
        Err(e) => {
            return Err(LockError::Io {
                path,
                source: e.into(),
            })
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
    Ok(Some(DirLock { _file: file }))
}

/// Takes the locks of every directory in `dirs`, in order; a directory named twice (by two
/// paths, a link, or two mounts of one host directory) is locked once: directories are told
/// apart by device and inode, since a second lock of the same file by this process would
/// conflict with the first.
pub(crate) fn acquire_all(dirs: &[&Path], holder: &Holder) -> Result<Vec<DirLock>, LockError> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = Vec::new();
    let mut locks = Vec::new();
    for dir in dirs {
        let io = |source| LockError::Io {
            path: dir.join(LOCK_FILE),
            source,
        };
        let real = std::fs::canonicalize(dir).map_err(io)?;
        let meta = std::fs::metadata(&real).map_err(io)?;
        let id = (meta.dev(), meta.ino());
        if seen.contains(&id) {
            continue;
        }
        match acquire(&real, holder)? {
            Some(lock) => locks.push(lock),
            None => {
                warn!(dir = %real.display(), "cannot create the lock file: this agent cannot write the directory (nor overwrite anything in it); running without its lock")
            }
        }
        seen.push(id);
    }
    Ok(locks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::process::Command;

    fn holder(pid: u32) -> Holder {
        Holder {
            pid,
            node: "node-a".into(),
            started: faultline_core::time::Timestamp::from_second(1_800_000_000).unwrap(),
        }
    }

    /// The pid of a process that has ended (and been reaped).
    fn dead_pid() -> u32 {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn is_root() -> bool {
        rustix::process::geteuid().is_root()
    }

    /// The second taker is refused at once. The file names a pid that no longer runs an agent
    /// (the agent that wrote it is dead; something else holds the lock now): the message names
    /// no agent and does not send the operator after that pid. Once the holder lets go, the lock
    /// is free again and the file names the new holder.
    #[test]
    fn a_held_lock_whose_file_names_a_dead_pid_names_no_agent() {
        let dir = tempfile::tempdir().unwrap();
        let dead = dead_pid();
        let first = acquire(dir.path(), &holder(dead)).unwrap().unwrap();
        let e = acquire(dir.path(), &holder(2)).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!(
                "held by another process (not a faultline agent we can name: the file names pid \
                 {dead}, which is not running it)"
            )) && msg.contains(LOCK_FILE),
            "{msg}"
        );
        assert!(!msg.contains("another faultline agent"), "{msg}");
        // Alive but not an agent (this test binary): named no more than a dead one.
        drop(first);
        let first = acquire(dir.path(), &holder(std::process::id()))
            .unwrap()
            .unwrap();
        let msg = acquire(dir.path(), &holder(2)).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("the file names pid {}, which", std::process::id())),
            "{msg}"
        );
        drop(first);
        let _second = acquire(dir.path(), &holder(2)).unwrap().unwrap();
        let text = std::fs::read(dir.path().join(LOCK_FILE)).unwrap();
        assert_eq!(serde_json::from_slice::<Holder>(&text).unwrap(), holder(2));
    }

    /// One directory named by two paths is locked once (a second lock of the same file by this
    /// process would conflict with the first).
    #[test]
    fn the_same_directory_twice_is_locked_once() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        let locks = acquire_all(&[dir.path(), &link, dir.path()], &holder(1)).unwrap();
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
        assert!(acquire(dir.path(), &holder(1)).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");

        let fifo_dir = tempfile::tempdir().unwrap();
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            fifo_dir.path().join(LOCK_FILE),
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let e = acquire(fifo_dir.path(), &holder(1)).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    /// The lock file is created 0600, so no other user can open it, and so none can take the
    /// lock (exclusive or shared) while the agent is down and keep every later agent from
    /// starting (with 0644, `flock -x agent.lock sleep infinity` as any user would). The second half runs `flock` as uid 65534 (`setpriv`): needs root
    /// and util-linux, skipped otherwise.
    #[test]
    fn no_other_user_can_take_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        // As /var/lib/faultline is: root's, 0755.
        chmod(dir.path(), 0o755);
        let path = dir.path().join(LOCK_FILE);
        drop(acquire(dir.path(), &holder(1)).unwrap().unwrap());
        assert_eq!(mode(&path), 0o600);
        if !is_root() {
            eprintln!("skipped the other user's attempt: not root (setpriv needs it)");
            return;
        }
        for how in ["-x", "-s"] {
            let out = Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .args(["flock", "-n", how])
                .arg(&path)
                .arg("true")
                .output();
            let Ok(out) = out else {
                eprintln!("skipped the other user's attempt: no setpriv here");
                return;
            };
            let said = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "uid 65534 took the lock ({how})");
            // The lock was free: only the permission can have stopped it.
            assert!(said.contains("Permission denied"), "{how}: {said}");
        }
        drop(acquire(dir.path(), &holder(1)).unwrap().unwrap());
    }

    /// A lock file that exists already is made 0600 when it is wider (an older agent's 0644);
    /// one owned by another user is refused (its owner may hold it open: making it private
    /// would not close that descriptor), and left as it is. The second half needs root.
    #[test]
    fn an_existing_lock_file_is_made_private_or_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, b"").unwrap();
        chmod(&path, 0o644);
        drop(acquire(dir.path(), &holder(1)).unwrap().unwrap());
        assert_eq!(mode(&path), 0o600);

        if !is_root() {
            eprintln!("skipped a lock file of another user: not root (chown needs it)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, b"").unwrap();
        chmod(&path, 0o600);
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        let e = acquire(dir.path(), &holder(1)).unwrap_err();
        assert!(
            matches!(e, LockError::NotOurs { owner: 65534, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        assert_eq!(std::fs::metadata(&path).unwrap().uid(), 65534);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    }

    /// A directory someone else can write (group or other write bit, sticky or not) or that
    /// belongs to another user (not root) is refused before a lock file is created in it:
    /// there, another user could have created `agent.lock` first and kept a descriptor of it.
    /// Root's 0755 directories (the default ones) are fine (the test above). The owner case
    /// needs root.
    #[test]
    fn a_directory_others_can_write_is_refused() {
        for m in [0o777, 0o1777, 0o775, 0o757] {
            let dir = tempfile::tempdir().unwrap();
            chmod(dir.path(), m);
            let e = acquire(dir.path(), &holder(1)).unwrap_err();
            assert!(
                e.to_string()
                    .contains(&format!("writable by its group or by others (mode {m:o})")),
                "{m:o}: {e}"
            );
            assert!(!dir.path().join(LOCK_FILE).exists(), "{m:o}");
        }
        if !is_root() {
            eprintln!("skipped a directory of another user: not root (chown needs it)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        chmod(dir.path(), 0o755);
        std::os::unix::fs::chown(dir.path(), Some(65534), Some(65534)).unwrap();
        let e = acquire(dir.path(), &holder(1)).unwrap_err();
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        assert!(!dir.path().join(LOCK_FILE).exists());
    }
}
