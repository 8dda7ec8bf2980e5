//! The `faultline` command for operators and job scripts: `get` (this node, or every node from
//! the cluster's fault ConfigMaps), `wait-healthy`, `clear`.
//!
//! `local` reads this node's record (`get`, `wait-healthy`, `clear`); `cluster` reads every
//! node's fault ConfigMap (`get --cluster`, `hosts`); `check` asks the peer-check coordinator
//! for a run. Logic lives in plain functions returning an [`Outcome`] (exit code and one-line
//! reason) so tests drive it directly; `src/bin/faultline.rs` only parses arguments.

mod check;
mod cluster;
mod local;

pub use check::{check, check_report, CheckArgs};
pub use cluster::{cluster_records, cluster_table, get_cluster, hosts, hosts_lines, ClusterFilter};
pub use local::{clear, get, read_record, record_path, summary, table, wait_healthy, ReadError};

/// Sets up `tracing` for a binary: `text` or `json` to stderr, level from `RUST_LOG`. Colours
/// only when stderr is a terminal, so logs collected from files or containers stay plain text.
pub fn init_tracing(format: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Exit status and the line to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub code: u8,
    pub message: String,
}

impl Outcome {
    fn ok(message: impl Into<String>) -> Self {
        Outcome {
            code: 0,
            message: message.into(),
        }
    }
    fn unhealthy(message: impl Into<String>) -> Self {
        Outcome {
            code: 1,
            message: message.into(),
        }
    }
    fn error(message: impl Into<String>) -> Self {
        Outcome {
            code: 2,
            message: message.into(),
        }
    }
    /// Exit status 2: the command could not do its job.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::error(message)
    }
}

fn columns(rows: &[Vec<String>]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..n)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i + 1 == r.len() {
                    c.clone()
                } else {
                    format!("{c:<w$}", w = widths[i])
                }
            })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// Records the commands' tests read.
#[cfg(test)]
mod test_records {
    pub const HEALTHY: &str = r#"{"apiVersion":"faultline.io/v1","node":"n1","health":"Healthy","updateTime":"2026-11-22T01:02:03.000Z","checkCode":"x","faults":[],"agent":{"version":"0","policy":{"source":"builtin","checksum":"y"},"detectors":[]}}"#;
    pub const UNHEALTHY: &str = r#"{"apiVersion":"faultline.io/v1","node":"n1","health":"Unhealthy","handling":"SeparateNPU","updateTime":"2026-11-22T01:02:03.000Z","checkCode":"x","faults":[{"fault_type":"CardUnhealthy","fault_code":"Xid79","fault_handling":"SeparateNPU","fault_level":"SeparateNPU","large_model_fault_level":"SeparateNPU","device":"GPU-3","source":"kmsg","message":"GPU has fallen off the bus","first_seen":"2026-11-22T01:02:03.000Z","last_seen":"2026-11-22T01:02:03.000Z","count":1,"active":true}],"agent":{"version":"0","policy":{"source":"/etc/p.yaml","checksum":"y","error":"field x: bad"},"detectors":[{"name":"kmsg","state":"Down","reason":"cannot open"}]}}"#;
}
