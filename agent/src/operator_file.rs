//! Reading files an operator controls (the policy and the Ascend tables it names): regular
//! files only, never opened otherwise (a FIFO put in their place is refused at once instead of
//! hanging the reader and the agent's shutdown; a device is not touched), and never more than
//! a cap (a path pointing at `/dev/zero` or a huge file is refused, not read into memory).
//! Symlinks are followed: a Kubernetes ConfigMap volume is a chain of them.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The largest policy file read.
pub(crate) const MAX_POLICY_BYTES: u64 = 1024 * 1024;
/// The largest Ascend table (`faultCode.json`, `faultCustomization.json`) read.
pub(crate) const MAX_TABLE_BYTES: u64 = 4 * 1024 * 1024;

/// Why an operator file was not read.
#[derive(Debug, thiserror::Error)]
pub enum OperatorFileError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a regular file")]
    NotRegular,
    #[error("larger than {0} bytes")]
    TooLarge(u64),
    #[error("not UTF-8 text")]
    NotText,
}

/// Reads `path` as text: a regular file of at most `max` bytes.
pub(crate) fn read_text(path: &Path, max: u64) -> Result<String, OperatorFileError> {
    String::from_utf8(read_bytes(path, max)?).map_err(|_| OperatorFileError::NotText)
}

/// Reads `path`: a regular file of at most `max` bytes, opened without blocking. Also for the
/// agent's own files read back at start (`state.json`, `faults.json`): whatever was put in
/// their place cannot hang or exhaust the agent. Anything but a regular file is refused before
/// it is opened (opening a device can act on it); one swapped in between is still refused by
/// the check of what was opened.
pub(crate) fn read_bytes(path: &Path, max: u64) -> Result<Vec<u8>, OperatorFileError> {
    if !std::fs::metadata(path)?.file_type().is_file() {
        return Err(OperatorFileError::NotRegular);
    }
    let nonblock = rustix::fs::OFlags::NONBLOCK.bits() as i32;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nonblock)
        .open(path)?;
    read_opened(file, max)
}

/// Reads an opened file: a regular file of at most `max` bytes (however it was opened: the
/// clear requests are opened relative to their directory, without following links).
pub(crate) fn read_opened(file: std::fs::File, max: u64) -> Result<Vec<u8>, OperatorFileError> {
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(OperatorFileError::NotRegular);
    }
    if meta.len() > max {
        return Err(OperatorFileError::TooLarge(max));
    }
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(OperatorFileError::TooLarge(max));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// Anything but a regular file is refused before it is opened: opening a device can act on
    /// it (a tape rewinds, a watchdog arms). Seen through the directory's own inotify events:
    /// they are ordered, so the marker's creation arriving with no open before it means no open.
    #[test]
    fn a_file_that_is_not_regular_is_never_opened() {
        use notify::event::AccessKind;
        use notify::{EventKind, Watcher};
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("policy.yaml");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut w = notify::recommended_watcher(move |e: notify::Result<notify::Event>| {
            let _ = tx.send(e.unwrap());
        })
        .unwrap();
        w.watch(dir.path(), notify::RecursiveMode::NonRecursive)
            .unwrap();
        assert!(matches!(
            read_text(&fifo, 100),
            Err(OperatorFileError::NotRegular)
        ));
        let marker = dir.path().join("marker");
        std::fs::write(&marker, b"").unwrap();
        loop {
            let e = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("the marker's event");
            if e.paths.contains(&fifo) {
                assert!(
                    !matches!(e.kind, EventKind::Access(AccessKind::Open(_))),
                    "the FIFO was opened: {e:?}"
                );
            }
            if e.paths.contains(&marker) {
                break;
            }
        }
    }

    #[test]
    fn only_small_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("policy.yaml");
        std::fs::write(&ok, "burst_window: 1s\n").unwrap();
        assert_eq!(read_text(&ok, 100).unwrap(), "burst_window: 1s\n");
        // A ConfigMap mount: the path is a symlink to the real file.
        let link = dir.path().join("linked.yaml");
        symlink(&ok, &link).unwrap();
        assert!(read_text(&link, 100).is_ok());

        let fifo = dir.path().join("fifo.yaml");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        // Returns at once (a blocking open would wait for a writer forever).
        assert!(matches!(
            read_text(&fifo, 100),
            Err(OperatorFileError::NotRegular)
        ));
        assert!(matches!(
            read_text(Path::new("/dev/zero"), 100),
            Err(OperatorFileError::NotRegular)
        ));
        assert!(matches!(
            read_text(dir.path(), 100),
            Err(OperatorFileError::NotRegular)
        ));
        std::fs::write(&ok, vec![b'#'; 101]).unwrap();
        let e = read_text(&ok, 100).unwrap_err().to_string();
        assert_eq!(e, "larger than 100 bytes");
        std::fs::write(&ok, [0xff, 0xfe]).unwrap();
        assert!(matches!(
            read_text(&ok, 100),
            Err(OperatorFileError::NotText)
        ));
    }
}
