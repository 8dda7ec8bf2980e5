//! A real Prometheus server for the tests that check the metrics as Prometheus reads them
//! (prometheus.rs, monitoring.rs): Debian's `prometheus` package (`prometheus` and `promtool` on
//! the PATH). `.ci/run` installs it, and under `CI` a missing one fails the test; elsewhere the
//! test says it was skipped.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Whether the Prometheus tools are here; under CI they must be.
pub fn tools_present() -> bool {
    let found = ["prometheus", "promtool"].iter().all(|t| {
        Command::new(t)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    assert!(
        found || std::env::var_os("CI").is_none(),
        "CI must have Debian's prometheus package (prometheus, promtool): .ci/run installs it"
    );
    if !found {
        eprintln!("skipped: prometheus and promtool are not installed (Debian's prometheus)");
    }
    found
}

/// The Prometheus server, stopped when dropped.
pub struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Starts Prometheus in `dir`, scraping `target` every second as job `faultline`; returns the
/// server and its web address. Its log is `dir/prometheus.log`.
pub fn start_prometheus(dir: &Path, target: &str) -> (Server, String) {
    start_prometheus_with(dir, target, &[], None)
}

/// [`start_prometheus`], the target carrying `labels` as well (as a Kubernetes scrape
/// configuration's relabeling gives the ServiceMonitor's targets `node`), and, with
/// `rule_file`, its rules evaluated every second.
pub fn start_prometheus_with(
    dir: &Path,
    target: &str,
    labels: &[(&str, &str)],
    rule_file: Option<&Path>,
) -> (Server, String) {
    let config = dir.join("prometheus.yml");
    let mut labels: String = labels
        .iter()
        .map(|(k, v)| format!("          {k}: '{v}'\n"))
        .collect();
    if !labels.is_empty() {
        labels.insert_str(0, "        labels:\n");
    }
    let rules = rule_file
        .map(|f| {
            format!(
                "  evaluation_interval: 1s\nrule_files: ['{}']\n",
                f.display()
            )
        })
        .unwrap_or_default();
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n{rules}\
             scrape_configs:\n  - job_name: faultline\n    static_configs:\n      - targets: ['{target}']\n{labels}"
        ),
    )
    .unwrap();
    let web = format!("127.0.0.1:{}", free_port());
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::File::create(dir.join("prometheus.log")).unwrap(),
        ))
        .spawn()
        .unwrap();
    (Server(child), web)
}

/// `s` percent-encoded for a URL's query (all but letters, digits and `_`).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The `data` of an HTTP API answer (`/api/v1/...` with `params`, each value encoded here);
/// `None` when Prometheus is not answering yet or the answer is not a success.
pub fn api(web: &str, path: &str, params: &[(&str, &str)]) -> Option<serde_json::Value> {
    let mut s = std::net::TcpStream::connect(web).ok()?;
    let query: Vec<String> = params
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect();
    write!(
        s,
        "GET {path}?{} HTTP/1.0\r\nHost: x\r\n\r\n",
        query.join("&")
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let v = serde_json::from_str::<serde_json::Value>(body).ok()?;
    (v["status"] == "success").then(|| v["data"].clone())
}

/// The result vector of an instant query, empty when Prometheus is not answering yet.
pub fn query(web: &str, q: &str) -> Vec<serde_json::Value> {
    api(web, "/api/v1/query", &[("query", q)])
        .and_then(|d| d["result"].as_array().cloned())
        .unwrap_or_default()
}

/// `promtool check metrics` on an exposition `body`: `Err` with promtool's own words (and the
/// body) when it rejects it.
pub fn promtool_check_metrics(body: &str) -> Result<(), String> {
    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{}{}\n{body}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}
