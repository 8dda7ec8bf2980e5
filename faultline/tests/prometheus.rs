//! The metrics as Prometheus itself reads them: `promtool check metrics` on what a scraper
//! without OpenMetrics gets, and a real Prometheus server scraping a running agent (`up` is 1
//! and the agent's series are stored). Needs Debian's `prometheus` package
//! (common/prometheus.rs).

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::prometheus::{promtool_check_metrics, query, start_prometheus, tools_present};
use common::{wait_until, xid79, Agent};

/// One HTTP/1.0 GET to `addr` with optional `Accept`; returns (head, body).
fn fetch(addr: &str, path: &str, accept: Option<&str>) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n{accept}\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (head.to_ascii_lowercase(), body.to_string())
}

/// Each format under its own content type; what a scraper without OpenMetrics gets (no
/// `Accept`, as curl sends, or `text/plain`) passes `promtool check metrics`. Before, the
/// OpenMetrics body went out as `text/plain; version=0.0.4`, and promtool failed on
/// `# TYPE faultline_build info`.
#[test]
fn promtool_checks_the_text_format() {
    if !tools_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.append(&xid79(1, "3b"));
    agent.wait_for("the Xid", |r| !r.faults.is_empty());
    let addr = agent.addr();
    for accept in [None, Some("text/plain;version=0.0.4")] {
        let (head, body) = fetch(&addr, "/metrics", accept);
        assert!(
            head.contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        if let Err(e) = promtool_check_metrics(&body) {
            panic!("promtool check metrics ({accept:?}):\n{e}");
        }
    }
    let (head, body) = fetch(
        &addr,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"),
    );
    assert!(
        head.contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert_eq!(agent.stop(), 0);
}

/// A real Prometheus server scrapes a running agent: the target is up and the agent's series
/// are stored, counters and the build info included. Before, Prometheus 2.42 marked the target
/// down (`invalid metric type "info"`) and stored no `faultline_*` series.
#[test]
fn a_real_prometheus_scrapes_the_agent() {
    if !tools_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.append(&xid79(1, "3b"));
    agent.wait_for("the Xid", |r| !r.faults.is_empty());
    let (server, web) = start_prometheus(dir.path(), &agent.addr());
    let log = || std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
    let up = wait_until("the target up", Duration::from_secs(60), || {
        let r = query(&web, "up{job=\"faultline\"}");
        r.first()
            .map(|s| s["value"][1].as_str().unwrap_or("").to_string())
            .filter(|v| v == "1" || v == "0")
    });
    assert_eq!(up, "1", "the target is down:\n{}", log());
    for series in [
        "faultline_build_info",
        "faultline_kmsg_records_total",
        "faultline_detector_up",
    ] {
        wait_until(series, Duration::from_secs(30), || {
            (!query(&web, series).is_empty()).then_some(())
        });
    }
    drop(server);
    assert_eq!(agent.stop(), 0);
}
