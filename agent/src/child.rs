//! Running a child process under a hard deadline, shared by the Ascend tools and the peer-check
//! probe: both streams are read at the same time (a chatty stderr cannot block the child), only
//! the first bytes of each are kept, and at the deadline the child is killed, not waited on.
//!
//! Each child leads its own process group, and what is killed at the deadline (or when the
//! caller stops waiting) is the whole group: a tool that forks a helper, or a shell script's
//! `sleep &`, does not outlive it.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use rustix::process::{kill_process_group, Pid, Signal};
use tokio::io::{AsyncRead, AsyncReadExt};

/// At most this much standard output is kept.
pub(crate) const MAX_STDOUT: u64 = 1 << 20;
/// At most this much standard error is kept.
pub(crate) const MAX_STDERR: u64 = 4096;

/// What a child printed and how it exited.
#[derive(Debug)]
pub(crate) struct ChildOutput {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Why there is no output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildError {
    /// It could not be started.
    Spawn(String),
    /// It ran past the deadline and was killed.
    Timeout(Duration),
    /// Reading its output or waiting for it failed, or it printed more than `MAX_STDOUT`.
    Io(String),
}

/// Keeps the first `max` bytes and reads (and drops) the rest, so the writer never blocks.
/// Returns the bytes and whether anything was dropped.
async fn keep_first<R: AsyncRead + Unpin>(
    r: Option<R>,
    max: u64,
) -> std::io::Result<(Vec<u8>, bool)> {
    let Some(mut r) = r else {
        return Ok((Vec::new(), false));
    };
    let mut kept = Vec::new();
    (&mut r).take(max).read_to_end(&mut kept).await?;
    let dropped = tokio::io::copy(&mut r, &mut tokio::io::sink()).await?;
    Ok((kept, dropped > 0))
}

/// The process group of a child that leads its own (`process_group(0)`): SIGKILLed when this is
/// dropped, unless the child was waited for first.
///
/// The kill is sent only while the leader has not been reaped, so the group id cannot have been
/// reused by an unrelated process (the kernel does not reuse the pid of a zombie).
#[derive(Debug)]
struct Group(Option<Pid>);

impl Group {
    /// The child exited and was reaped: nothing to kill (its group id may be reused now).
    fn reaped(&mut self) {
        self.0 = None;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(pgid) = self.0.take() {
            // ESRCH: every member is gone already.
            let _ = kill_process_group(pgid, Signal::KILL);
        }
    }
}

/// Runs `cmd` (its stdio and process group are set here) and returns its output, or kills it and
/// everything it started at `deadline`.
pub(crate) async fn run(
    cmd: &mut tokio::process::Command,
    deadline: Duration,
) -> Result<ChildOutput, ChildError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| ChildError::Spawn(e.to_string()))?;
    // Declared after `child`, so dropped before it: the group is killed while the leader is
    // still unreaped.
    let mut group = Group(
        child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(Pid::from_raw),
    );
    let (out, err) = (child.stdout.take(), child.stderr.take());
    let work = async {
        let (out, err) =
            tokio::try_join!(keep_first(out, MAX_STDOUT), keep_first(err, MAX_STDERR))?;
        let status = child.wait().await?;
        Ok::<_, std::io::Error>((status, out, err))
    };
    let result = tokio::time::timeout(deadline, work).await;
    if let Ok(Ok(_)) = result {
        group.reaped();
    }
    // Any other way out (the deadline, a read error, the caller dropping this future) kills the
    // group when `group` is dropped, then the child itself (kill_on_drop).
    match result {
        Err(_) => Err(ChildError::Timeout(deadline)),
        Ok(Err(e)) => Err(ChildError::Io(e.to_string())),
        Ok(Ok((_, (_, true), _))) => Err(ChildError::Io(format!(
            "more than {MAX_STDOUT} bytes of output"
        ))),
        Ok(Ok((status, (stdout, false), (stderr, _)))) => Ok(ChildOutput {
            status,
            stdout,
            stderr,
        }),
    }
}

/// The first line with text, shortened to `max` characters (`…` marks a cut): enough for a
/// reason in a record or a log line.
pub(crate) fn first_line(text: &str, max: usize) -> String {
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let mut out: String = line.chars().take(max).collect();
    if line.chars().count() > max {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;

    fn sh(script: &str) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[tokio::test]
    async fn output_status_deadline_and_limits() {
        let d = Duration::from_secs(10);
        let o = run(&mut sh("echo out; echo err >&2; exit 3"), d)
            .await
            .unwrap();
        assert_eq!(
            (o.stdout.as_slice(), o.stderr.as_slice()),
            (&b"out\n"[..], &b"err\n"[..])
        );
        assert_eq!(o.status.code(), Some(3));
        // A chatty stderr neither blocks the child nor grows the kept part.
        let o = run(&mut sh("head -c 300000 /dev/zero >&2; echo done"), d)
            .await
            .unwrap();
        assert_eq!(o.stdout, b"done\n");
        assert_eq!(o.stderr.len() as u64, MAX_STDERR);
        // Too much stdout is an error, not a silent cut.
        let e = run(&mut sh("head -c 2000000 /dev/zero"), d)
            .await
            .unwrap_err();
        assert!(
            matches!(e, ChildError::Io(ref m) if m.contains("bytes of output")),
            "{e:?}"
        );
        let started = std::time::Instant::now();
        let e = run(&mut sh("exec sleep 30"), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert_eq!(e, ChildError::Timeout(Duration::from_millis(200)));
        assert!(started.elapsed() < Duration::from_secs(5));
        let mut missing = tokio::process::Command::new("/nonexistent/tool");
        assert!(matches!(
            run(&mut missing, d).await,
            Err(ChildError::Spawn(_))
        ));
    }

    /// Whether `pid` is a live process (a zombie is dead: it only waits to be reaped).
    fn alive(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => false,
            // `pid (comm) S ...`: the state follows the last parenthesis.
            Ok(stat) => stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                .is_some_and(|state| state != 'Z'),
        }
    }

    /// A child that started a grandchild and then ran past the deadline: the grandchild is
    /// killed with it, not left running (it also holds the output pipe open).
    #[tokio::test]
    async fn the_deadline_kills_what_the_child_started() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("grandchild.pid");
        let script = format!("sleep 300 & echo $! > '{}'; wait", pid_file.display());
        let e = run(&mut sh(&script), Duration::from_millis(500))
            .await
            .unwrap_err();
        assert_eq!(e, ChildError::Timeout(Duration::from_millis(500)));
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let started = std::time::Instant::now();
        while alive(pid) && started.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let survived = alive(pid);
        if survived {
            // Do not leave it behind when the test fails.
            if let Some(p) = Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(p, Signal::KILL);
            }
        }
        assert!(!survived, "the grandchild {pid} outlived the deadline");
    }

    #[test]
    fn first_lines_are_short() {
        assert_eq!(first_line("\n  first \nsecond", 120), "first");
        assert_eq!(first_line(&"x".repeat(200), 120).chars().count(), 121);
        assert_eq!(first_line("", 120), "");
    }
}
