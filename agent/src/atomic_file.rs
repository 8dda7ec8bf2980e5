//! Atomic file replacement: a temporary file in the same directory, written, synced and
//! renamed over the target, so a reader sees the old bytes or the new ones, never a mix. Used
//! by every writer of files that other programs (or a later run) read: the record, the state,
//! the public-fault outbox, the peer-check result, the CLI's clear requests.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Temporary files start with this; a kill between create and rename leaves one behind.
pub(crate) const TEMP_PREFIX: &str = ".faultline-";

/// A file that could not be replaced.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {source}")]
pub struct WriteError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Replaces `path` with `bytes` atomically; the file is readable by everyone (job scripts).
pub fn write(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    let io = |source| WriteError {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .tempfile_in(dir)
        .map_err(io)?;
    tmp.write_all(bytes).map_err(io)?;
    #[cfg(test)]
    hooks::before_sync(path);
    tmp.as_file().sync_data().map_err(io)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o644)).map_err(io)?;
    }
    tmp.persist(path).map_err(|e| io(e.error))?;
    // The rename is durable only once the directory is: whoever acts on "written" (a clear
    // request removed once persisted) must not be ahead of the disk after a power loss.
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io)?;
    Ok(())
}

/// Removes the temporary files (`.faultline-*`, regular files only) that writes interrupted by
/// a kill left in `dir`. Only for directories no other program writes into at the same time.
pub(crate) fn remove_stale_temps(dir: &Path) -> std::io::Result<usize> {
    let mut n = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let is_temp = entry
            .file_name()
            .to_str()
            .is_some_and(|name| name.starts_with(TEMP_PREFIX));
        // file_type() does not follow symlinks: only plain files are removed.
        if is_temp && entry.file_type()?.is_file() {
            std::fs::remove_file(entry.path())?;
            n += 1;
        }
    }
    Ok(n)
}

/// Tests' stand-in for a slow disk: a hook that runs in [`write`] before the new file is synced,
/// for files under one directory (the tests of the crate run in parallel, each in its own).
#[cfg(test)]
pub(crate) mod hooks {
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex};

    type Hook = Arc<dyn Fn(&Path) + Send + Sync>;

    static HOOKS: Mutex<Vec<(u64, PathBuf, Hook)>> = Mutex::new(Vec::new());

    /// Runs `hook` with the target's path before each file under `dir` is synced, until the
    /// returned guard is dropped.
    pub(crate) fn on_sync(dir: &Path, hook: impl Fn(&Path) + Send + Sync + 'static) -> Guard {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut hooks = HOOKS.lock().unwrap_or_else(|e| e.into_inner());
        hooks.push((id, dir.to_path_buf(), Arc::new(hook)));
        Guard(id)
    }

    pub(crate) struct Guard(u64);

    impl Drop for Guard {
        fn drop(&mut self) {
            let mut hooks = HOOKS.lock().unwrap_or_else(|e| e.into_inner());
            hooks.retain(|(id, _, _)| *id != self.0);
        }
    }

    pub(super) fn before_sync(path: &Path) {
        let due: Vec<Hook> = HOOKS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, dir, _)| path.starts_with(dir))
            .map(|(_, _, hook)| hook.clone())
            .collect();
        for hook in due {
            hook(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_files_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("faults.json");
        write(&p, b"{\"a\":1}").unwrap();
        write(&p, b"{\"a\":2}").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"{\"a\":2}");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "{leftovers:?}");
    }

    #[test]
    fn unwritable_directory_is_a_clear_error() {
        let err = write(Path::new("/nonexistent-dir/faults.json"), b"x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent-dir/faults.json"), "{err}");
    }

    #[test]
    fn stale_temporary_files_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join(".faultline-a1b2"), b"half a record").unwrap();
        std::fs::write(d.join(".faultline-c3d4"), b"").unwrap();
        std::fs::write(d.join("faults.json"), b"{}").unwrap();
        std::fs::create_dir(d.join(".faultline-dir")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", d.join(".faultline-link")).unwrap();
        assert_eq!(remove_stale_temps(d).unwrap(), 2);
        let mut left: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, [".faultline-dir", ".faultline-link", "faults.json"]);
    }
}
