//! Running a child process under a hard deadline, shared by the Ascend tools and the peer-check
//! probe: both streams are read at the same time (a chatty stderr cannot block the child), only
//! the first bytes of each are kept, and at the deadline the child is killed, not waited on.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

/// At most this much standard output is kept.
pub const MAX_STDOUT: u64 = 1 << 20;
/// At most this much standard error is kept.
pub const MAX_STDERR: u64 = 4096;

/// What a child printed and how it exited.
#[derive(Debug)]
pub struct ChildOutput {
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

/// Runs `cmd` (its stdio is set here) and returns its output, or kills it at `deadline`.
pub async fn run(
    cmd: &mut tokio::process::Command,
    deadline: Duration,
) -> Result<ChildOutput, ChildError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| ChildError::Spawn(e.to_string()))?;
    let (out, err) = (child.stdout.take(), child.stderr.take());
    let work = async {
        let (out, err) =
            tokio::try_join!(keep_first(out, MAX_STDOUT), keep_first(err, MAX_STDERR))?;
        let status = child.wait().await?;
        Ok::<_, std::io::Error>((status, out, err))
    };
    // On the timeout path `child` is dropped with `work`, which kills it (kill_on_drop).
    match tokio::time::timeout(deadline, work).await {
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
pub fn first_line(text: &str, max: usize) -> String {
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

    #[test]
    fn first_lines_are_short() {
        assert_eq!(first_line("\n  first \nsecond", 120), "first");
        assert_eq!(first_line(&"x".repeat(200), 120).chars().count(), 121);
        assert_eq!(first_line("", 120), "");
    }
}
