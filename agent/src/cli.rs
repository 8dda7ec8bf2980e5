//! The `faultline` command for operators and job scripts: `get` (this node, or every node from
//! the cluster's fault ConfigMaps), `wait-healthy`, `clear`.
//!
//! Logic lives here as plain functions returning an [`Outcome`] (exit code and one-line
//! reason) so tests drive it directly; `src/bin/faultline.rs` only parses arguments.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::atomic_file::write as write_atomic;
use crate::sink::file::FAULTS_FILE;
use crate::source::control::{ClearRequest, CLEAR_DIR};
use faultline_core::record::{Health, NodeRecord};

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

/// Where the local record is.
pub fn record_path(file: Option<&Path>, state_dir: &Path) -> PathBuf {
    file.map(Path::to_path_buf)
        .unwrap_or_else(|| state_dir.join(FAULTS_FILE))
}

/// Why a record could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("no record at {0} (is the agent running?)")]
    Missing(String),
    #[error("cannot read {0}: {1}")]
    Io(String, String),
    #[error("{0} is not a faultline record: {1}")]
    Invalid(String, String),
}

pub fn read_record(path: &Path) -> Result<NodeRecord, ReadError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ReadError::Missing(p.clone()),
        _ => ReadError::Io(p.clone(), e.to_string()),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ReadError::Invalid(p, e.to_string()))
}

/// A one-line account of a record's verdict.
pub fn summary(r: &NodeRecord) -> String {
    let active: Vec<String> = r
        .faults
        .iter()
        .filter(|f| f.active)
        .take(3)
        .map(|f| format!("{} on {} ({})", f.fault_code, f.device, f.fault_handling))
        .collect();
    let n = r.faults.iter().filter(|f| f.active).count();
    let mut s = format!("node {} is {}", r.node, r.health);
    if !active.is_empty() {
        let _ = write!(s, ": {}", active.join("; "));
        if n > active.len() {
            let _ = write!(s, "; and {} more", n - active.len());
        }
    }
    s
}

/// Renders a record as a table.
pub fn table(r: &NodeRecord, all: bool) -> String {
    let mut out = String::new();
    let handling = r
        .handling
        .map(|h| h.to_string())
        .unwrap_or_else(|| "-".into());
    let rows = vec![
        vec![
            "NODE".to_string(),
            "HEALTH".into(),
            "HANDLING".into(),
            "UPDATED".into(),
        ],
        vec![
            r.node.clone(),
            r.health.to_string(),
            handling,
            r.update_time.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
        ],
    ];
    out.push_str(&columns(&rows));
    let faults: Vec<_> = r.faults.iter().filter(|f| all || f.active).collect();
    if faults.is_empty() {
        out.push_str("\nno active faults\n");
    } else {
        out.push('\n');
        let mut rows = vec![[
            "CODE",
            "TYPE",
            "HANDLING",
            "DEVICE",
            "COUNT",
            "LAST SEEN",
            "STATE",
            "MESSAGE",
        ]
        .map(String::from)
        .to_vec()];
        for f in faults {
            let mut msg: String = f.message.chars().take(60).collect();
            if f.message.chars().count() > 60 {
                msg.push('…');
            }
            rows.push(vec![
                f.fault_code.clone(),
                f.fault_type.to_string(),
                f.fault_handling.to_string(),
                f.device.clone(),
                f.count.to_string(),
                f.last_seen.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
                if f.active {
                    "active".into()
                } else {
                    "recovered".into()
                },
                msg,
            ]);
        }
        out.push_str(&columns(&rows));
    }
    if let Some(e) = &r.agent.policy.error {
        let _ = writeln!(
            out,
            "\nwarning: the newest policy was rejected (the previous one is in force): {e}"
        );
    }
    for d in r.agent.detectors.iter().filter(|d| d.state == "Down") {
        let _ = writeln!(
            out,
            "warning: detector {} is down: {}",
            d.name,
            d.reason.as_deref().unwrap_or("unknown reason")
        );
    }
    out
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

/// `faultline get`.
pub fn get(path: &Path, json: bool, all: bool) -> Outcome {
    match read_record(path) {
        Ok(r) if json => Outcome::ok(serde_json::to_string_pretty(&r).unwrap_or_default()),
        Ok(r) => Outcome::ok(table(&r, all).trim_end().to_string()),
        Err(e) => Outcome::error(format!("error: {e}")),
    }
}

/// `faultline wait-healthy`: polls the record until it is healthy (0), the timeout passes
/// while it is not (1), or it cannot be read at all (2).
pub fn wait_healthy(
    path: &Path,
    timeout: Duration,
    interval: Duration,
    allow_degraded: bool,
) -> Outcome {
    let deadline = Instant::now() + timeout;
    let acceptable = |h: Health| h == Health::Healthy || (allow_degraded && h == Health::Degraded);
    loop {
        let last = read_record(path);
        match &last {
            Ok(r) if acceptable(r.health) => {
                return Outcome::ok(format!("healthy: {}", summary(r)))
            }
            Err(e @ ReadError::Invalid(..)) => return Outcome::error(format!("error: {e}")),
            _ => {}
        }
        if Instant::now() >= deadline {
            return match last {
                Ok(r) => Outcome::unhealthy(format!(
                    "unhealthy after {}: {}",
                    humantime::format_duration(timeout),
                    summary(&r)
                )),
                Err(e) => Outcome::error(format!("error: {e}")),
            };
        }
        std::thread::sleep(
            interval
                .min(deadline.saturating_duration_since(Instant::now()))
                .max(Duration::from_millis(1)),
        );
    }
}

/// `faultline clear`: asks the agent to clear faults, and waits until it has taken the request.
pub fn clear(
    state_dir: &Path,
    code: Option<String>,
    device: Option<String>,
    wait: Duration,
) -> Outcome {
    let dir = state_dir.join(CLEAR_DIR);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return Outcome::error(format!("error: cannot create {}: {e}", dir.display()));
    }
    let req = ClearRequest { code, device };
    let name = format!(
        "{}-{}.json",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
        std::process::id()
    );
    let path = dir.join(name);
    let body = serde_json::to_vec(&req).unwrap_or_default();
    if let Err(e) = write_atomic(&path, &body) {
        return Outcome::error(format!("error: {e}"));
    }
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        if !path.exists() {
            return Outcome::ok(format!(
                "cleared {} on {}",
                req.code.as_deref().unwrap_or("all faults"),
                req.device.as_deref().unwrap_or("every device")
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Outcome::error(format!(
        "error: the agent did not take {} within {} (is it running?)",
        path.display(),
        humantime::format_duration(wait)
    ))
}

/// Which records `faultline get --cluster` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterFilter {
    /// Only this node.
    pub node: Option<String>,
    /// Only nodes with one of these verdicts (empty: any).
    pub health: Vec<Health>,
    /// Only nodes with an active fault of this code.
    pub code: Option<String>,
}

impl ClusterFilter {
    pub fn matches(&self, r: &NodeRecord) -> bool {
        self.node.as_ref().is_none_or(|n| &r.node == n)
            && (self.health.is_empty() || self.health.contains(&r.health))
            && self.code.as_ref().is_none_or(|c| {
                r.faults
                    .iter()
                    .any(|f| f.active && f.fault_code.eq_ignore_ascii_case(c))
            })
    }
}

/// Every node's record from the fault ConfigMaps (`faultline-<node>` in `namespace`), sorted by
/// node name, and the ConfigMaps that hold no readable record (name and why).
pub async fn cluster_records(
    client: kube::Client,
    namespace: &str,
) -> Result<(Vec<NodeRecord>, Vec<(String, String)>), kube::Error> {
    use k8s_openapi::api::core::v1::ConfigMap;
    let cms: kube::Api<ConfigMap> = kube::Api::namespaced(client, namespace);
    let list = cms
        .list(&kube::api::ListParams::default().labels(crate::sink::kube::budget::NODES_SELECTOR))
        .await?;
    let mut records = Vec::new();
    let mut bad = Vec::new();
    for cm in list.items {
        let name = cm.metadata.name.clone().unwrap_or_default();
        let text = cm
            .data
            .as_ref()
            .and_then(|d| d.get(crate::sink::kube::plan::RECORD_KEY));
        match text.map(|t| serde_json::from_str::<NodeRecord>(t)) {
            Some(Ok(r)) => records.push(r),
            Some(Err(e)) => bad.push((name, e.to_string())),
            None => bad.push((name, "no faults.json key".to_string())),
        }
    }
    records.sort_by(|a, b| a.node.cmp(&b.node));
    Ok((records, bad))
}

/// One line per node: verdict, level, active fault codes.
pub fn cluster_table(records: &[NodeRecord]) -> String {
    let mut rows = vec![["NODE", "HEALTH", "HANDLING", "ACTIVE", "UPDATED"]
        .map(String::from)
        .to_vec()];
    for r in records {
        let codes: Vec<String> = r
            .faults
            .iter()
            .filter(|f| f.active)
            .map(|f| format!("{}@{}", f.fault_code, f.device))
            .collect();
        rows.push(vec![
            r.node.clone(),
            r.health.to_string(),
            r.handling
                .map(|h| h.to_string())
                .unwrap_or_else(|| "-".into()),
            if codes.is_empty() {
                "-".into()
            } else {
                codes.join(",")
            },
            r.update_time.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
        ]);
    }
    columns(&rows)
}

/// `faultline get --cluster`.
pub async fn get_cluster(
    client: kube::Client,
    namespace: &str,
    filter: &ClusterFilter,
    json: bool,
    all: bool,
) -> Outcome {
    let (records, bad) = match cluster_records(client, namespace).await {
        Ok(x) => x,
        Err(e) => {
            return Outcome::error(format!(
                "error: cannot list fault ConfigMaps in {namespace}: {e}"
            ))
        }
    };
    for (name, why) in &bad {
        eprintln!("warning: ConfigMap {namespace}/{name} holds no readable record: {why}");
    }
    let mut shown: Vec<NodeRecord> = records.into_iter().filter(|r| filter.matches(r)).collect();
    if !all {
        for r in &mut shown {
            r.faults.retain(|f| f.active);
        }
    }
    if json {
        return Outcome::ok(serde_json::to_string_pretty(&shown).unwrap_or_default());
    }
    if shown.is_empty() {
        return Outcome::ok("no matching nodes");
    }
    if let (Some(_), [one]) = (&filter.node, shown.as_slice()) {
        return Outcome::ok(table(one, all).trim_end().to_string());
    }
    Outcome::ok(cluster_table(&shown).trim_end().to_string())
}

/// `faultline hosts`: usable nodes as `host:slots` lines, for Horovod elastic's
/// `discover_hosts` script (and any launcher that wants a host list). Healthy nodes only, or
/// also Degraded ones with `allow_degraded`; sorted by name.
pub fn hosts_lines(records: &[NodeRecord], slots: u32, allow_degraded: bool) -> String {
    records
        .iter()
        .filter(|r| match r.health {
            Health::Healthy => true,
            Health::Degraded => allow_degraded,
            Health::Unhealthy => false,
        })
        .map(|r| format!("{}:{slots}\n", r.node))
        .collect()
}

/// `faultline hosts --slots N`: prints nothing (exit 0) when no node is usable, so a
/// discovery script never hands a launcher a broken host; exit 2 when the records cannot be
/// read.
pub async fn hosts(
    client: kube::Client,
    namespace: &str,
    slots: u32,
    allow_degraded: bool,
) -> Outcome {
    match cluster_records(client, namespace).await {
        Ok((records, bad)) => {
            for (name, why) in &bad {
                eprintln!("warning: ConfigMap {namespace}/{name} holds no readable record: {why}");
            }
            Outcome::ok(
                hosts_lines(&records, slots, allow_degraded)
                    .trim_end()
                    .to_string(),
            )
        }
        Err(e) => Outcome::error(format!(
            "error: cannot list fault ConfigMaps in {namespace}: {e}"
        )),
    }
}

/// `faultline check`: where to send the request and how long to try.
#[derive(Debug, Clone)]
pub struct CheckArgs {
    pub nodes: Vec<String>,
    /// The whole command gives up after this (retries included).
    pub timeout: Duration,
    /// Per-check deadline to ask for (0: the coordinator's policy).
    pub check_timeout: Option<Duration>,
    /// The coordinator's peer-service address; else the Lease holder's.
    pub coordinator: Option<String>,
    pub secret_file: PathBuf,
    pub kubeconfig: Option<PathBuf>,
    pub namespace: String,
    pub json: bool,
}

/// The printed report of a run and its exit status: 0 nothing found, 1 a faulty node, broken
/// link or straggler, 3 only nodes that could not be judged.
pub fn check_report(r: &faultline_proto::v1::RunResult, json: bool) -> Outcome {
    use faultline_proto::v1::verdict::Kind;
    let kinds: Vec<Kind> = r.verdicts.iter().map(|v| v.kind()).collect();
    let code = if kinds.iter().any(|k| *k != Kind::Unknown) {
        1
    } else if kinds.is_empty() {
        0
    } else {
        3
    };
    let message = if json {
        let verdicts: Vec<serde_json::Value> = r
            .verdicts
            .iter()
            .map(|v| {
                let mut o = serde_json::json!({
                    "kind": crate::peer::coordinator::kind_name(v.kind()),
                    "nodes": v.nodes,
                });
                if v.slowdown > 0.0 {
                    o["slowdown"] = serde_json::json!(v.slowdown);
                }
                if !v.reason.is_empty() {
                    o["reason"] = serde_json::json!(v.reason);
                }
                o
            })
            .collect();
        serde_json::json!({"run_id": r.run_id, "rounds": r.rounds, "verdicts": verdicts})
            .to_string()
    } else {
        let mut out = format!(
            "run {}: {} round{}",
            r.run_id,
            r.rounds,
            if r.rounds == 1 { "" } else { "s" }
        );
        if r.verdicts.is_empty() {
            out.push_str(", no faulty node, broken link or straggler");
        }
        for v in &r.verdicts {
            let line = match v.kind() {
                Kind::FaultyNode => format!("faulty node   {}", v.nodes.join(",")),
                Kind::BrokenLink => format!("broken link   {}", v.nodes.join(" <-> ")),
                Kind::Straggler => {
                    format!(
                        "straggler     {} ({:.2}x the median)",
                        v.nodes.join(","),
                        v.slowdown
                    )
                }
                Kind::Unknown => format!("unknown       {}: {}", v.nodes.join(","), v.reason),
                Kind::Unspecified => format!("?             {}", v.nodes.join(",")),
            };
            out.push('\n');
            out.push_str(&line);
        }
        out
    };
    Outcome { code, message }
}

/// `faultline check --nodes a,b,c`: asks the coordinator to run a check among these nodes now
/// and prints the verdicts. Retries (re-reading the Lease) while the coordinator is unreachable
/// or changing, until `timeout`.
pub async fn check(args: CheckArgs) -> Outcome {
    use faultline_proto::v1::coordinator_client::CoordinatorClient;
    use faultline_proto::v1::RunRequest;
    use tonic::Code;
    let key = match crate::peer::wire::load_key(&args.secret_file) {
        Ok(k) => k,
        Err(e) => return Outcome::error(format!("error: {e}")),
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let signer = crate::peer::wire::Signer {
        key,
        sender: format!("cli@{}", host.trim()),
    };
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut last_error = String::from("no attempt made");
    let mut client_kube = None;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Outcome::error(format!(
                "error: no result within {}: {last_error}",
                humantime::format_duration(args.timeout)
            ));
        }
        let address = match &args.coordinator {
            Some(a) => Ok(a.clone()),
            None => {
                if client_kube.is_none() {
                    match crate::kube_client::client_infer(args.kubeconfig.as_deref()).await {
                        Ok(c) => client_kube = Some(c),
                        Err(e) => {
                            return Outcome::error(format!(
                                "error: no --coordinator and no Kubernetes to find it in: {e}"
                            ))
                        }
                    }
                }
                match &client_kube {
                    Some(c) => match crate::peer::lease::holder(c.clone(), &args.namespace).await {
                        Ok(Some(id)) => crate::peer::lease::address_of(&id)
                            .map(str::to_string)
                            .ok_or_else(|| format!("Lease holder {id:?} names no address")),
                        Ok(None) => Err("no agent holds the coordinator Lease yet".to_string()),
                        Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => {
                            return Outcome::error(format!(
                                "error: cannot read the coordinator Lease {}/{}: {} (this client needs get on leases)",
                                args.namespace,
                                crate::peer::publish::NAME,
                                s.message
                            ))
                        }
                        Err(e) => Err(format!("cannot read the coordinator Lease: {e}")),
                    },
                    None => Err("no Kubernetes client".to_string()),
                }
            }
        };
        let attempt = async {
            let address = address?;
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
                .map_err(|e| format!("bad coordinator address {address:?}: {e}"))?
                .connect_timeout(Duration::from_secs(3))
                .connect()
                .await
                .map_err(|e| format!("cannot reach the coordinator at {address}: {e}"))?;
            let req = signer.sign(RunRequest {
                auth: None,
                protocol: faultline_proto::PROTOCOL,
                nodes: args.nodes.clone(),
                timeout_ms: args
                    .check_timeout
                    .map(|t| t.as_millis().min(u128::from(u32::MAX)) as u32)
                    .unwrap_or(0),
            });
            let mut request = tonic::Request::new(req);
            request.set_timeout(deadline.saturating_duration_since(tokio::time::Instant::now()));
            let answer = CoordinatorClient::new(channel)
                .max_decoding_message_size(faultline_proto::MAX_MESSAGE_BYTES)
                .run(request)
                .await;
            Ok::<_, String>((address, answer))
        };
        // Could not ask (no coordinator yet, unreachable): retry. Asked and refused for the
        // request itself (secret, arguments): stop. Any other answer (not the coordinator any
        // more, shutting down): retry.
        last_error = match attempt.await {
            Ok((_, Ok(result))) => return check_report(&result.into_inner(), args.json),
            Ok((_, Err(s)))
                if matches!(
                    s.code(),
                    Code::Unauthenticated | Code::InvalidArgument | Code::PermissionDenied
                ) =>
            {
                return Outcome::error(format!(
                    "error: the coordinator refused the request: {}",
                    s.message()
                ))
            }
            Ok((address, Err(s))) => format!("the coordinator at {address}: {}", s.message()),
            Err(e) => e,
        };
        tokio::time::sleep(
            Duration::from_secs(2)
                .min(deadline.saturating_duration_since(tokio::time::Instant::now())),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_report_exit_codes_and_lines() {
        use faultline_proto::v1::{verdict::Kind, RunResult, Verdict};
        let v = |kind: Kind, nodes: &[&str], slowdown: f64, reason: &str| Verdict {
            kind: kind as i32,
            nodes: nodes.iter().map(|s| s.to_string()).collect(),
            slowdown,
            reason: reason.into(),
        };
        let clean = RunResult {
            run_id: "r1".into(),
            rounds: 1,
            verdicts: vec![],
        };
        let o = check_report(&clean, false);
        assert_eq!(o.code, 0);
        assert_eq!(
            o.message,
            "run r1: 1 round, no faulty node, broken link or straggler"
        );
        let found = RunResult {
            run_id: "r2".into(),
            rounds: 2,
            verdicts: vec![
                v(Kind::FaultyNode, &["n5"], 0.0, ""),
                v(Kind::BrokenLink, &["n2", "n3"], 0.0, ""),
                v(Kind::Straggler, &["n6"], 4.0, ""),
                v(Kind::Unknown, &["n9"], 0.0, "accelerators busy"),
            ],
        };
        let o = check_report(&found, false);
        assert_eq!(o.code, 1);
        assert_eq!(
            o.message,
            "run r2: 2 rounds\nfaulty node   n5\nbroken link   n2 <-> n3\nstraggler     n6 (4.00x the median)\nunknown       n9: accelerators busy"
        );
        let j: serde_json::Value =
            serde_json::from_str(&check_report(&found, true).message).unwrap();
        assert_eq!(j["verdicts"][2]["kind"], "straggler");
        assert_eq!(j["verdicts"][2]["slowdown"], 4.0);
        assert_eq!(j["verdicts"][1]["nodes"][1], "n3");
        let unknown_only = RunResult {
            run_id: "r3".into(),
            rounds: 1,
            verdicts: vec![v(Kind::Unknown, &["n1"], 0.0, "no node passed")],
        };
        assert_eq!(check_report(&unknown_only, false).code, 3);
    }

    #[test]
    fn hosts_lists_usable_nodes_with_their_slots() {
        let rec = |node: &str, health: Health| {
            let mut r: NodeRecord = serde_json::from_str(HEALTHY).unwrap();
            r.node = node.into();
            r.health = health;
            r
        };
        let records = [
            rec("a", Health::Healthy),
            rec("b", Health::Unhealthy),
            rec("c", Health::Degraded),
            rec("d", Health::Healthy),
        ];
        assert_eq!(hosts_lines(&records, 8, false), "a:8\nd:8\n");
        assert_eq!(hosts_lines(&records, 4, true), "a:4\nc:4\nd:4\n");
        assert_eq!(hosts_lines(&records[1..2], 8, true), "");
    }

    const HEALTHY: &str = r#"{"apiVersion":"faultline.io/v1","node":"n1","health":"Healthy","updateTime":"2026-11-22T01:02:03.000Z","checkCode":"x","faults":[],"agent":{"version":"0","policy":{"source":"builtin","checksum":"y"},"detectors":[]}}"#;
    const UNHEALTHY: &str = r#"{"apiVersion":"faultline.io/v1","node":"n1","health":"Unhealthy","handling":"SeparateNPU","updateTime":"2026-11-22T01:02:03.000Z","checkCode":"x","faults":[{"fault_type":"CardUnhealthy","fault_code":"Xid79","fault_handling":"SeparateNPU","fault_level":"SeparateNPU","large_model_fault_level":"SeparateNPU","device":"GPU-3","source":"kmsg","message":"GPU has fallen off the bus","first_seen":"2026-11-22T01:02:03.000Z","last_seen":"2026-11-22T01:02:03.000Z","count":1,"active":true}],"agent":{"version":"0","policy":{"source":"/etc/p.yaml","checksum":"y","error":"field x: bad"},"detectors":[{"name":"kmsg","state":"Down","reason":"cannot open"}]}}"#;

    fn file(body: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("faults.json");
        std::fs::write(&p, body).unwrap();
        (d, p)
    }

    #[test]
    fn wait_healthy_exit_codes() {
        let (_d, p) = file(HEALTHY);
        assert_eq!(
            wait_healthy(
                &p,
                Duration::from_millis(50),
                Duration::from_millis(10),
                false
            )
            .code,
            0
        );
        let (_d, p) = file(UNHEALTHY);
        let o = wait_healthy(
            &p,
            Duration::from_millis(50),
            Duration::from_millis(10),
            false,
        );
        assert_eq!(o.code, 1);
        assert!(o.message.contains("Xid79 on GPU-3"), "{}", o.message);
        assert!(!o.message.contains('\n'), "one line");
        let o = wait_healthy(
            Path::new("/nonexistent/faults.json"),
            Duration::from_millis(30),
            Duration::from_millis(10),
            false,
        );
        assert_eq!(o.code, 2);
        assert!(o.message.contains("is the agent running"), "{}", o.message);
        let (_d, p) = file("{\"not\": \"a record\"}");
        let o = wait_healthy(
            &p,
            Duration::from_secs(60),
            Duration::from_millis(10),
            false,
        );
        assert_eq!(o.code, 2, "a foreign file fails at once: {}", o.message);
    }

    #[test]
    fn wait_healthy_sees_recovery_before_the_timeout() {
        let (_d, p) = file(UNHEALTHY);
        let p2 = p.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            write_atomic(&p2, HEALTHY.as_bytes()).unwrap();
        });
        let o = wait_healthy(
            &p,
            Duration::from_secs(30),
            Duration::from_millis(20),
            false,
        );
        writer.join().unwrap();
        assert_eq!(o.code, 0, "{}", o.message);
    }

    #[test]
    fn table_shows_faults_and_warnings() {
        let (_d, p) = file(UNHEALTHY);
        let o = get(&p, false, false);
        assert_eq!(o.code, 0);
        assert!(
            o.message.contains("Xid79")
                && o.message.contains("GPU-3")
                && o.message.contains("SeparateNPU"),
            "{}",
            o.message
        );
        assert!(o.message.contains("policy was rejected"), "{}", o.message);
        assert!(o.message.contains("detector kmsg is down"), "{}", o.message);
        let j = get(&p, true, false);
        let back: NodeRecord = serde_json::from_str(&j.message).unwrap();
        assert_eq!(back.faults.len(), 1);
    }

    #[test]
    fn clear_times_out_without_an_agent() {
        let d = tempfile::tempdir().unwrap();
        let o = clear(
            d.path(),
            Some("Xid79".into()),
            None,
            Duration::from_millis(50),
        );
        assert_eq!(o.code, 2);
        let left: Vec<_> = std::fs::read_dir(d.path().join(CLEAR_DIR))
            .unwrap()
            .collect();
        assert_eq!(
            left.len(),
            1,
            "the request stays for the agent to take later"
        );
    }

    #[test]
    fn cluster_filters_and_table() {
        let healthy: NodeRecord = serde_json::from_str(HEALTHY).unwrap();
        let mut sick: NodeRecord = serde_json::from_str(UNHEALTHY).unwrap();
        sick.node = "n2".into();
        let all = [healthy.clone(), sick.clone()];
        let pick = |f: ClusterFilter| -> Vec<String> {
            all.iter()
                .filter(|r| f.matches(r))
                .map(|r| r.node.clone())
                .collect()
        };
        assert_eq!(pick(ClusterFilter::default()), ["n1", "n2"]);
        assert_eq!(
            pick(ClusterFilter {
                health: vec![Health::Unhealthy],
                ..Default::default()
            }),
            ["n2"]
        );
        assert_eq!(
            pick(ClusterFilter {
                health: vec![Health::Healthy, Health::Degraded],
                ..Default::default()
            }),
            ["n1"]
        );
        assert_eq!(
            pick(ClusterFilter {
                code: Some("xid79".into()),
                ..Default::default()
            }),
            ["n2"]
        );
        assert_eq!(
            pick(ClusterFilter {
                code: Some("Xid48".into()),
                ..Default::default()
            }),
            Vec::<String>::new()
        );
        assert_eq!(
            pick(ClusterFilter {
                node: Some("n1".into()),
                ..Default::default()
            }),
            ["n1"]
        );
        sick.faults[0].active = false;
        assert!(
            !ClusterFilter {
                code: Some("Xid79".into()),
                ..Default::default()
            }
            .matches(&sick),
            "recovered faults do not match"
        );
        let t = cluster_table(&all);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[0].starts_with("NODE")
                && lines[1].starts_with("n1")
                && lines[2].starts_with("n2"),
            "{t}"
        );
        assert!(
            lines[2].contains("Unhealthy") && lines[2].contains("Xid79@GPU-3"),
            "{t}"
        );
        assert!(
            lines[1].contains("Healthy") && lines[1].contains(" - "),
            "{t}"
        );
    }
}
