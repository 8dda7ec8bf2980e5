//! Running the Ascend command-line tools: behind a trait so tests can replace them; the real
//! runner uses `crate::child` (a hard deadline, the child killed when it passes).

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::watch;

use crate::child::{self, ChildError};

use faultline_core::policy::LoadedPolicy;

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
        let mut cmd = tokio::process::Command::new(&path);
        cmd.args(args);
        match child::run(&mut cmd, timeout).await {
            Err(ChildError::Timeout(d)) => Err(ToolError::Timeout(d)),
            Err(ChildError::Spawn(e)) => Err(ToolError::Io(format!("{}: {e}", path.display()))),
            Err(ChildError::Io(e)) => Err(ToolError::Io(e)),
            Ok(out) => {
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                if out.status.success() {
                    Ok(text)
                } else {
                    // npu-smi prints its complaints on stdout; keep whichever said something.
                    let said = if out.stderr.is_empty() {
                        text
                    } else {
                        String::from_utf8_lossy(&out.stderr).into_owned()
                    };
                    Err(ToolError::Failed {
                        status: out.status.to_string(),
                        stderr: excerpt(&said),
                    })
                }
            }
        }
    }
}

/// The first line with text, shortened: enough for a reason in the record.
pub fn excerpt(s: &str) -> String {
    child::first_line(s, 120)
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
}
