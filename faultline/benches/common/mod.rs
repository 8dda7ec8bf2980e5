//! Helpers shared by the process-level benchmarks.

#![allow(dead_code, clippy::unwrap_used)]

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The inode of the record now (0 when there is none): the file sink replaces it on every write.
pub fn record_inode(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0)
}

/// Polls `path` until it has been replaced since `inode` with a record that satisfies `seen`;
/// panics after 10 s naming `what`.
pub fn wait_record(
    path: &Path,
    mut inode: u64,
    t0: Instant,
    what: &str,
    seen: impl Fn(&Value) -> bool,
) {
    loop {
        if let Ok(m) = std::fs::metadata(path) {
            if m.ino() != inode {
                inode = m.ino();
                let r: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
                if seen(&r) {
                    return;
                }
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what} never reached the record"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Whether the record has a fault whose `key` field equals `value` with at least `count`.
pub fn has_fault(r: &Value, key: &str, value: &str, code: Option<&str>, count: u64) -> bool {
    r["faults"].as_array().is_some_and(|fs| {
        fs.iter().any(|f| {
            f[key] == value
                && code.is_none_or(|c| f["fault_code"] == c)
                && f["count"].as_u64() >= Some(count)
        })
    })
}

/// The `q` quantile of sorted values (nearest rank).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// SIGTERM, as Kubernetes and systemd stop the agent.
pub fn terminate(child: &Child) {
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
}

/// A bench's command line (after `cargo bench -- …`): which parts to run and `--name N` flags.
pub struct Args(Vec<String>);

impl Args {
    pub fn from_env() -> Args {
        Args(
            std::env::args()
                .skip(1)
                .filter(|a| a != "--bench")
                .collect(),
        )
    }

    /// The value after `name`, or `default`.
    pub fn flag(&self, name: &str, default: u64) -> u64 {
        self.0
            .iter()
            .position(|a| a == name)
            .and_then(|i| self.0.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    /// Whether `name` is among the arguments (a part that runs only when asked for).
    #[allow(dead_code)] // not every bench has such a part
    pub fn named(&self, name: &str) -> bool {
        self.0.iter().any(|a| a == name)
    }

    /// Whether to run the part `name` out of `parts`: named on the command line, or none named.
    pub fn wants(&self, parts: &[&str], name: &str) -> bool {
        let named: Vec<&String> = self
            .0
            .iter()
            .filter(|a| parts.contains(&a.as_str()))
            .collect();
        named.is_empty() || named.iter().any(|a| *a == name)
    }
}
