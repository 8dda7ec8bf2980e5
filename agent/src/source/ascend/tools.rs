//! Running the Ascend command-line tools: behind a trait so tests can replace them; the real
//! runner uses `crate::child` (a hard deadline, the child and its process group killed when it
//! passes).
//!
//! Which executables run is the agent's configuration (`--npu-smi`, `--hccn-tool`), never the
//! policy: the tools run as root, and the policy is a ConfigMap that is reloaded while the agent
//! runs, so whoever may edit it must not be able to choose what runs. Each tool starts with an
//! empty environment plus [`TOOL_PATH`], `LANG=C` and `LC_ALL=C` (and the agent's own
//! `LD_LIBRARY_PATH`, where the driver's libraries are found), so nothing else the agent
//! inherited reaches it.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::child::{self, ChildError};

/// `PATH` of a tool's process (for whatever it runs itself).
pub(crate) const TOOL_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The two tools the source calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Tool {
    NpuSmi,
    HccnTool,
}

impl Tool {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Tool::NpuSmi => "npu-smi",
            Tool::HccnTool => "hccn_tool",
        }
    }
}

/// Why a call produced no output to parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ToolError {
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
pub(crate) trait Tools: Send + Sync + 'static {
    fn run(
        &self,
        tool: Tool,
        args: &[String],
        timeout: Duration,
    ) -> impl Future<Output = Result<String, ToolError>> + Send;
}

/// The executables to run, from the agent's flags: each a path, or a name looked up on the
/// agent's own `PATH` (set by its deployment, like the flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ToolPaths {
    pub npu_smi: PathBuf,
    pub hccn_tool: PathBuf,
}

/// The real tools. Looked up on every call, so a driver installed (or a tool replaced) after
/// the agent started is picked up.
#[derive(Debug, Clone)]
pub(crate) struct RealTools {
    paths: ToolPaths,
}

impl RealTools {
    pub(crate) fn new(paths: ToolPaths) -> Self {
        RealTools { paths }
    }

    fn resolve(&self, tool: Tool) -> Result<PathBuf, ToolError> {
        let name = match tool {
            Tool::NpuSmi => &self.paths.npu_smi,
            Tool::HccnTool => &self.paths.hccn_tool,
        };
        which::which(name).map_err(|_| ToolError::NotFound(name.display().to_string()))
    }

    /// The command for `path`, with the environment it gets and nothing more.
    fn command(path: &Path, args: &[String]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(path);
        cmd.args(args)
            .env_clear()
            .env("PATH", TOOL_PATH)
            .env("LANG", "C")
            .env("LC_ALL", "C");
        if let Some(lib) = std::env::var_os("LD_LIBRARY_PATH").filter(|v| !v.is_empty()) {
            cmd.env("LD_LIBRARY_PATH", lib);
        }
        cmd
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
        let mut cmd = Self::command(&path, args);
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
pub(crate) fn excerpt(s: &str) -> String {
    child::first_line(s, 120)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
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
            RealTools::new(ToolPaths {
                npu_smi: npu.into(),
                hccn_tool: "/nonexistent/hccn_tool".into(),
            })
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
        assert_eq!(
            t(&ok).run(Tool::HccnTool, &args, d).await,
            Err(ToolError::NotFound("/nonexistent/hccn_tool".into()))
        );
    }

    /// A tool sees a fixed PATH and the C locale, and none of what the agent inherited (this
    /// test process has HOME and cargo's variables, at least).
    #[tokio::test]
    async fn tools_start_with_a_cleared_environment() {
        let dir = tempfile::tempdir().unwrap();
        let env = script(dir.path(), "env", "exec /usr/bin/env");
        let tools = RealTools::new(ToolPaths {
            npu_smi: env.into(),
            hccn_tool: "/nonexistent/hccn_tool".into(),
        });
        assert!(
            std::env::vars_os().count() > 3,
            "the test process has an environment to leak"
        );
        let out = tools
            .run(Tool::NpuSmi, &[], Duration::from_secs(5))
            .await
            .unwrap();
        let vars: std::collections::BTreeMap<&str, &str> =
            out.lines().filter_map(|l| l.split_once('=')).collect();
        assert_eq!(vars.get("PATH"), Some(&TOOL_PATH), "{out}");
        assert_eq!(vars.get("LANG"), Some(&"C"), "{out}");
        assert_eq!(vars.get("LC_ALL"), Some(&"C"), "{out}");
        // The shell adds PWD itself; the library path is passed on when the agent has one.
        let allowed = ["PATH", "LANG", "LC_ALL", "PWD", "LD_LIBRARY_PATH"];
        let extra: Vec<&&str> = vars.keys().filter(|k| !allowed.contains(k)).collect();
        assert!(extra.is_empty(), "inherited: {extra:?}");
    }
}
