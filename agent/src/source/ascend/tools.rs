//! Running the Ascend command-line tools: behind a trait so tests can replace them, and the real
//! runner spawns the process with a hard deadline and kills it (and never waits on it) when the
//! deadline passes.

use std::future::Future;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use crate::source::policy_watch::LoadedPolicy;

/// The two tools the source calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tool {
    NpuSmi,
    HccnTool,
}

impl Tool {
    pub fn as_str(self) -> &'static str {
        match self {
            Tool::NpuSmi => "npu-smi",
            Tool::HccnTool => "hccn_tool",
        }
    }
}

/// Why a call produced no output to parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// Not installed: normal on a node without Ascend hardware.
    #[error("{0} not found")]
    NotFound(String),
    #[error("no answer within {} (killed)", humantime::format_duration(*.0))]
    Timeout(Duration),
    #[error("exited with {status}: {stderr}")]
    Failed { status: String, stderr: String },
    #[error("cannot run: {0}")]
    Io(String),
}

/// Runs one tool invocation and returns its standard output.
pub trait Tools: Send + Sync + 'static {
    fn run(
        &self,
        tool: Tool,
        args: &[String],
        timeout: Duration,
    ) -> impl Future<Output = Result<String, ToolError>> + Send;
}

/// At most this much output is read from a tool (a runaway tool cannot eat the agent's memory).
const MAX_OUTPUT: u64 = 1 << 20;

/// The real tools, found by the names or paths the policy in force gives (looked up on every
/// call, so a policy change, or a tool installed or replaced later, is picked up).
#[derive(Debug, Clone)]
pub struct RealTools {
    policy: watch::Receiver<LoadedPolicy>,
}

impl RealTools {
    pub fn new(policy: watch::Receiver<LoadedPolicy>) -> Self {
        RealTools { policy }
    }

    fn resolve(&self, tool: Tool) -> Result<PathBuf, ToolError> {
        let name = {
            let p = &self.policy.borrow().policy.ascend;
            match tool {
                Tool::NpuSmi => p.npu_smi.clone(),
                Tool::HccnTool => p.hccn_tool.clone(),
            }
        };
        which::which(&name).map_err(|_| ToolError::NotFound(name))
    }
}

impl Tools for RealTools {
    async fn run(
        &self,
        tool: Tool,
        args: &[String],
        timeout: Duration,
    ) -> Result<String, ToolError> {
        let path = self.resolve(tool)?;
        let mut child = tokio::process::Command::new(&path)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| ToolError::Io(format!("{}: {e}", path.display())))?;
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();
        let work = async {
            let mut out = Vec::new();
            let mut err = Vec::new();
            if let Some(o) = stdout.as_mut() {
                o.take(MAX_OUTPUT).read_to_end(&mut out).await?;
            }
            if let Some(e) = stderr.as_mut() {
                e.take(4096).read_to_end(&mut err).await?;
            }
            let status = child.wait().await?;
            Ok::<_, std::io::Error>((status, out, err))
        };
        match tokio::time::timeout(timeout, work).await {
            Err(_) => Err(ToolError::Timeout(timeout)),
            Ok(Err(e)) => Err(ToolError::Io(e.to_string())),
            Ok(Ok((status, out, err))) => {
                let text = String::from_utf8_lossy(&out).into_owned();
                if status.success() {
                    Ok(text)
                } else {
                    // npu-smi prints its complaints on stdout; keep whichever said something.
                    let said = if err.is_empty() {
                        text
                    } else {
                        String::from_utf8_lossy(&err).into_owned()
                    };
                    Err(ToolError::Failed {
                        status: status.to_string(),
                        stderr: excerpt(&said),
                    })
                }
            }
        }
        // Dropping `child` on the timeout path kills the process (kill_on_drop); tokio reaps it.
    }
}

/// The first line with text, shortened: enough for a reason in the record.
pub fn excerpt(s: &str) -> String {
    let line = s
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let mut out: String = line.chars().take(120).collect();
    if line.chars().count() > 120 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn script(dir: &std::path::Path, name: &str, body: &str) -> String {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p.display().to_string()
    }

    #[tokio::test]
    async fn output_exit_status_timeout_and_absence() {
        let dir = tempfile::tempdir().unwrap();
        let ok = script(dir.path(), "ok", "echo \"args: $*\"");
        let bad = script(dir.path(), "bad", "echo 'Invalid card id.'; exit 3");
        let hang = script(dir.path(), "hang", "exec sleep 30");
        let t = |npu: &str| {
            let mut loaded = LoadedPolicy::builtin();
            let mut policy = (*loaded.policy).clone();
            policy.ascend.npu_smi = npu.to_string();
            policy.ascend.hccn_tool = "/nonexistent/hccn_tool".into();
            loaded.policy = std::sync::Arc::new(policy);
            RealTools::new(watch::channel(loaded).1)
        };
        let args = vec!["info".to_string(), "-t".to_string()];
        let d = Duration::from_secs(5);
        assert_eq!(
            t(&ok).run(Tool::NpuSmi, &args, d).await.unwrap(),
            "args: info -t\n"
        );
        match t(&bad).run(Tool::NpuSmi, &args, d).await {
            Err(ToolError::Failed { status, stderr }) => {
                assert!(status.contains('3'), "{status}");
                assert_eq!(stderr, "Invalid card id.");
            }
            other => panic!("{other:?}"),
        }
        let started = std::time::Instant::now();
        let r = t(&hang)
            .run(Tool::NpuSmi, &args, Duration::from_millis(300))
            .await;
        assert_eq!(r, Err(ToolError::Timeout(Duration::from_millis(300))));
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(matches!(
            t(&ok).run(Tool::HccnTool, &args, d).await,
            Err(ToolError::NotFound(_))
        ));
    }

    #[test]
    fn excerpts_are_short_first_lines() {
        assert_eq!(excerpt("\n  first \nsecond"), "first");
        assert_eq!(excerpt(&"x".repeat(200)).chars().count(), 121);
        assert_eq!(excerpt(""), "");
    }
}
