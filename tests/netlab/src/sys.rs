//! Running the host tools (`ip`, `tc`, `iptables`) the lab is built with: every call captures
//! its output, and a failure names the command line, its exit status and what it printed on
//! stderr.

use std::ffi::OsStr;
use std::process::{Command, Output};

use crate::LabError;

/// `program args...` as one printable line, for error messages.
fn line(program: &str, args: &[&str]) -> String {
    std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `program args...` and returns its output, whatever the exit status.
pub(crate) fn output(program: &str, args: &[&str]) -> Result<Output, LabError> {
    Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| LabError::Spawn {
            cmd: line(program, args),
            source,
        })
}

/// Runs `program args...`; a non-zero exit is an error. Returns stdout.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String, LabError> {
    let out = output(program, args)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(LabError::Failed {
            cmd: line(program, args),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Runs `program args...` for cleanup: errors are ignored (the thing may already be gone).
pub(crate) fn quiet(program: &str, args: &[&str]) -> bool {
    output(program, args).is_ok_and(|o| o.status.success())
}

/// `ip netns exec <ns> <program>` with the arguments still to add.
pub(crate) fn in_ns(ns: &str, program: impl AsRef<OsStr>) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).arg(program);
    c
}

/// Runs `program args...` inside namespace `ns`; a non-zero exit is an error.
pub(crate) fn run_in(ns: &str, program: &str, args: &[&str]) -> Result<String, LabError> {
    let mut full = vec!["netns", "exec", ns, program];
    full.extend_from_slice(args);
    run("ip", &full)
}

/// The effective uid of this process, from /proc/self/status.
pub(crate) fn euid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let uids = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    uids.split_whitespace().nth(1)?.parse().ok()
}
