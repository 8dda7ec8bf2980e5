//! The `faultline` command for operators and job scripts: `get` (this node, or every node from
//! the cluster's fault ConfigMaps), `wait-healthy`, `clear`, `hosts`, `check`.
//!
//! `local` reads this node's record (`get`, `wait-healthy`, `clear`); `cluster` reads every
//! node's fault ConfigMap (`get --cluster`, `hosts`); `check` asks the peer-check coordinator
//! for a run. Logic lives in plain functions returning an [`Outcome`] (exit code and one-line
//! reason) so tests drive it directly; `src/bin/faultline.rs` only parses arguments.

mod check;
mod cluster;
pub mod keys;
mod local;
pub mod members;

pub use check::{check, check_report, validate_nodes, CheckArgs};
pub use cluster::{
    cluster_records, cluster_table, get_cluster, hosts, hosts_lines, ClusterFilter, Hosts, PodQuery,
};
pub use local::{
    clear, get, not_alive, read_record, record_path, summary, table, wait_healthy, Now, ReadError,
    AHEAD_TOLERANCE, MAX_RECORD_BYTES, NOT_ALIVE_EXIT, NOT_ALIVE_FIELD,
};

use faultline_core::record::{Handling, Health, NodeRecord};
use serde_json::{json, Value};

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

/// Exit status and the line to print; with `-o json`, the document to print instead
/// ([`render`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub code: u8,
    pub message: String,
    /// The answer as JSON for `-o json`; `None` when `message` already is the JSON document
    /// (`get`, `check`) or there is none (an error: [`render`] makes one).
    pub data: Option<Value>,
    /// A line for stderr whatever the exit status, beside the answer on stdout (`get` of a
    /// record whose agent is not alive).
    pub warning: Option<String>,
}

impl Outcome {
    fn new(code: u8, message: impl Into<String>) -> Self {
        Outcome {
            code,
            message: message.into(),
            data: None,
            warning: None,
        }
    }
    fn ok(message: impl Into<String>) -> Self {
        Self::new(0, message)
    }
    fn unhealthy(message: impl Into<String>) -> Self {
        Self::new(1, message)
    }
    fn error(message: impl Into<String>) -> Self {
        Self::new(2, message)
    }
    /// Exit status 2: the command could not do its job (the binary's name for [`Outcome::error`]).
    pub fn failed(message: impl Into<String>) -> Self {
        Self::error(message)
    }
    /// The same outcome with its JSON form.
    fn with_data(mut self, data: Value) -> Self {
        self.data = Some(data);
        self
    }
}

/// What a command prints: `(stdout, stderr)`. As text, the message goes to stdout on success
/// and to stderr otherwise (nothing at all for an empty success: `hosts` with no usable node
/// must not hand a launcher an empty line). With `-o json` everything a script reads is one
/// JSON document on stdout, errors included: `{"error": "...", "exitCode": 2}`. A warning
/// goes to stderr beside the answer, in either form.
pub fn render(o: &Outcome, json: bool) -> (Option<String>, Option<String>) {
    if let Some(w) = &o.warning {
        let answer = match (&o.data, json) {
            (Some(d), true) => serde_json::to_string_pretty(d).unwrap_or_default(),
            _ => o.message.clone(),
        };
        return (Some(answer), Some(w.clone()));
    }
    if json {
        let doc = match &o.data {
            Some(d) => serde_json::to_string_pretty(d).unwrap_or_default(),
            None if o.code == 2 => {
                let why = o.message.strip_prefix("error: ").unwrap_or(&o.message);
                json!({"error": why, "exitCode": o.code}).to_string()
            }
            None => o.message.clone(),
        };
        return (Some(doc), None);
    }
    match (o.code, o.message.is_empty()) {
        (0, true) => (None, None),
        (0, false) => (Some(o.message.clone()), None),
        _ => (None, Some(o.message.clone())),
    }
}

/// Whether the command line (without the program name) asks for `-o json`, read from the raw
/// arguments: an argument error stops clap before it has parsed `--output`. Every spelling
/// clap accepts counts (`-o json`, `-ojson`, `-o=json`, `--output json`, `--output=json`), up
/// to a `--` that ends the options.
pub fn json_requested<S: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = S>) -> bool {
    let is_json = |v: &str| v.eq_ignore_ascii_case("json");
    let mut value_next = false;
    for a in args {
        let Some(a) = a.as_ref().to_str() else {
            value_next = false;
            continue;
        };
        if std::mem::take(&mut value_next) && is_json(a) {
            return true;
        }
        if a == "--" {
            return false;
        }
        if a == "-o" || a == "--output" {
            value_next = true;
        } else if let Some(v) = a.strip_prefix("--output=").or_else(|| a.strip_prefix("-o")) {
            if is_json(v.strip_prefix('=').unwrap_or(v)) {
                return true;
            }
        }
    }
    false
}

/// An argument error (clap's rendered text) as an outcome: exit 2, the error's first paragraph
/// on one line as the reason (clap's usage line and hints are for people at a terminal).
pub fn usage_error(rendered: &str) -> Outcome {
    let first = rendered.trim().split("\n\n").next().unwrap_or_default();
    let first = first.strip_prefix("error: ").unwrap_or(first);
    let why: Vec<&str> = first
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    Outcome::error(format!("error: {}", why.join(" ")))
}

/// Which records a job script accepts as usable (`wait-healthy`, `hosts`; docs/record.md,
/// "Usable"): Healthy always, Unhealthy never, Degraded only with `max_handling` set and the
/// record's most severe active handling at most that level (a Degraded record with no active
/// fault, e.g. a detector down, passes too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Accept {
    pub max_handling: Option<Handling>,
}

impl Accept {
    /// Healthy only (the default).
    pub(crate) const HEALTHY: Accept = Accept { max_handling: None };
    /// `--allow-degraded`: faults whose handling is a restart of the job at most
    /// (RestartBusiness and below), never a chip reset or an isolation.
    pub(crate) const DEGRADED: Accept = Accept {
        max_handling: Some(Handling::RestartBusiness),
    };

    /// From the flags: `--max-handling` wins over `--allow-degraded`.
    pub fn from_flags(allow_degraded: bool, max_handling: Option<Handling>) -> Accept {
        match (max_handling, allow_degraded) {
            (Some(h), _) => Accept {
                max_handling: Some(h),
            },
            (None, true) => Accept::DEGRADED,
            (None, false) => Accept::HEALTHY,
        }
    }

    pub(crate) fn accepts(&self, r: &NodeRecord) -> bool {
        match r.health {
            Health::Healthy => true,
            Health::Unhealthy => false,
            Health::Degraded => self
                .max_handling
                .is_some_and(|max| r.handling.is_none_or(|h| h <= max)),
        }
    }

    /// Why `hosts` leaves a record out under this rule; `None` when it accepts it.
    pub(crate) fn refusal(&self, r: &NodeRecord) -> Option<String> {
        (!self.accepts(r)).then(|| {
            let handling = r.handling.map(|h| format!(" ({h})")).unwrap_or_default();
            format!("the record says {}{handling}", r.health)
        })
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

#[cfg(test)]
mod tests {
    use super::test_records::{HEALTHY, UNHEALTHY};
    use super::*;

    fn record(health: Health, handling: Option<Handling>) -> NodeRecord {
        let mut r: NodeRecord = serde_json::from_str(HEALTHY).unwrap();
        r.health = health;
        r.handling = handling;
        r
    }

    /// `--allow-degraded` passes faults that need a restart of the job, never ones that call
    /// for a chip reset or isolation (PreSeparateNPU: a port down, a node a peer check named).
    #[test]
    fn allow_degraded_stops_at_restart_business() {
        use Handling::*;
        let d = Accept::from_flags(true, None);
        assert_eq!(d, Accept::DEGRADED);
        for (h, ok) in [
            (None, true),
            (Some(NotHandleFault), true),
            (Some(SubHealthFault), true),
            (Some(RestartRequest), true),
            (Some(RestartBusiness), true),
            (Some(FreeRestartNPU), false),
            (Some(RestartNPU), false),
            (Some(PreSeparateNPU), false),
            (Some(SeparateNPU), false),
            (Some(ManuallySeparateNPU), false),
        ] {
            assert_eq!(d.accepts(&record(Health::Degraded, h)), ok, "{h:?}");
            assert!(!Accept::HEALTHY.accepts(&record(Health::Degraded, h)));
        }
        let unhealthy: NodeRecord = serde_json::from_str(UNHEALTHY).unwrap();
        assert!(!Accept::from_flags(true, Some(ManuallySeparateNPU)).accepts(&unhealthy));
        assert!(Accept::HEALTHY.accepts(&record(Health::Healthy, None)));
        // The threshold is an option: a site that restarts chips in the job prologue.
        let wider = Accept::from_flags(false, Some(RestartNPU));
        assert!(wider.accepts(&record(Health::Degraded, Some(RestartNPU))));
        assert!(!wider.accepts(&record(Health::Degraded, Some(PreSeparateNPU))));
    }

    #[test]
    fn json_output_is_one_document_on_stdout_errors_included() {
        let err = Outcome::error("error: cannot read /x: No such file");
        let (out, errout) = render(&err, true);
        let v: Value = serde_json::from_str(&out.unwrap()).unwrap();
        assert_eq!(
            v,
            json!({"error": "cannot read /x: No such file", "exitCode": 2})
        );
        assert_eq!(errout, None);
        assert_eq!(
            render(&err, false),
            (None, Some("error: cannot read /x: No such file".into()))
        );
        let ok = Outcome::ok("a:8").with_data(json!({"hosts": [{"host": "a", "slots": 8}]}));
        let v: Value = serde_json::from_str(&render(&ok, true).0.unwrap()).unwrap();
        assert_eq!(v["hosts"][0]["slots"], 8);
        assert_eq!(render(&ok, false), (Some("a:8".into()), None));
        assert_eq!(render(&Outcome::ok(""), false), (None, None));
        // `get` and `check` already carry their document as the message.
        assert_eq!(render(&Outcome::ok("{}"), true), (Some("{}".into()), None));
    }
}

/// Records the commands' tests read.
#[cfg(test)]
mod test_records {
    pub const HEALTHY: &str = r#"{"apiVersion":"faultline.io/v1","node":"n1","health":"Healthy","updateTime":"2026-11-22T01:02:03.000Z","checkCode":"x","faults":[],"agent":{"version":"0","policy":{"source":"builtin","checksum":"y"},"detectors":[]}}"#;
    pub const UNHEALTHY: &str = r#"{"apiVersion":"faultline.io/v1","node":"n1","health":"Unhealthy","handling":"SeparateNPU","updateTime":"2026-11-22T01:02:03.000Z","checkCode":"x","faults":[{"fault_type":"CardUnhealthy","fault_code":"Xid79","fault_handling":"SeparateNPU","fault_level":"SeparateNPU","large_model_fault_level":"SeparateNPU","device":"GPU-3","source":"kmsg","message":"GPU has fallen off the bus","first_seen":"2026-11-22T01:02:03.000Z","last_seen":"2026-11-22T01:02:03.000Z","count":1,"active":true}],"agent":{"version":"0","policy":{"source":"/etc/p.yaml","checksum":"y","error":"field x: bad"},"detectors":[{"name":"kmsg","state":"Down","reason":"cannot open"}]}}"#;
}
