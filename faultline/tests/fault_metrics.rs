//! Issue 26 §2: the metrics that say which fault code and which device, read from a running
//! agent's `/metrics` over loopback after kernel-log faults (file mode): bounded labels whatever
//! the kernel log names, a policy reload that names a code, the heartbeat as the record has it,
//! and the text format still accepted by `promtool check metrics` (when installed).

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{wait_until, xid79, Agent};

/// The samples of `metric` in a text-format body: each series' labels and value.
fn series(body: &str, metric: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    body.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(metric)?.strip_prefix('{')?;
            let (labels, value) = rest.rsplit_once("} ")?;
            let labels = labels
                .split(',')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_string(), v.trim_matches('"').to_string()))
                })
                .collect();
            Some((labels, value.parse().ok()?))
        })
        .collect()
}

/// The value of the one series of `metric` with `code` and `device`, summed over the rest.
fn value(body: &str, metric: &str, code: &str, device: &str) -> f64 {
    series(body, metric)
        .iter()
        .filter(|(l, _)| l["code"] == code && l["device"] == device)
        .map(|(_, v)| v)
        .sum()
}

/// Hundreds of kernel-log faults with codes and devices no catalog, policy or inventory names
/// (unlisted Xids on PCI addresses NVML does not list, switches numbered past any board) make a
/// handful of series, all of the unnamed under `other`; a policy reload that names one of the
/// codes makes it a label value. Before, none of these series existed.
#[test]
fn kernel_log_faults_get_bounded_code_and_device_labels() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, "overrides: {}\n").unwrap();
    let agent = Agent::start(dir.path(), &["--policy", policy.to_str().unwrap()]);
    let mut log = xid79(1, "3b");
    let mut seq = 2;
    for i in 0..150u32 {
        log.extend(
            format!(
                "4,{seq},{},-;NVRM: Xid (PCI:0000:{:02x}:00): {}, pid=1, name=a, crafted\n",
                seq * 100,
                0x10 + i,
                100_000 + i
            )
            .bytes(),
        );
        seq += 1;
    }
    for n in 0..30u32 {
        log.extend(
            format!(
                "4,{seq},{},-;nvidia-nvswitch{n}: SXid (PCI:0000:{:02x}:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)\n",
                seq * 100,
                0xc0 + n
            )
            .bytes(),
        );
        seq += 1;
    }
    agent.append(&log);
    let record = agent.wait_for("every fault", |r| {
        r.faults.iter().filter(|f| f.active).count() >= 181
    });
    let active = record.faults.iter().filter(|f| f.active).count();

    let (_, body) = agent.get("/metrics");
    let faults = series(&body, "faultline_fault_active");
    let codes: BTreeSet<&str> = faults.iter().map(|(l, _)| l["code"].as_str()).collect();
    assert_eq!(
        codes,
        BTreeSet::from(["Xid79", "SXid12028", "other"]),
        "{body}"
    );
    let devices: BTreeSet<String> = faults.iter().map(|(l, _)| l["device"].clone()).collect();
    let mut want: BTreeSet<String> = (0..16).map(|n| format!("nvswitch{n}")).collect();
    want.insert("other".into());
    assert_eq!(devices, want, "no PCI address, no GPU-<bus id>");
    assert!(
        faults.len() <= 20,
        "{} series for {active} faults",
        faults.len()
    );
    let total: f64 = faults.iter().map(|(_, v)| v).sum();
    assert_eq!(total as usize, active, "every active fault counted once");
    assert_eq!(
        value(&body, "faultline_fault_active", "other", "other"),
        150.0
    );
    assert_eq!(
        value(&body, "faultline_fault_active", "SXid12028", "other"),
        14.0
    );
    assert_eq!(
        value(&body, "faultline_fault_occurrences_total", "Xid79", "other"),
        1.0
    );
    assert_eq!(
        value(&body, "faultline_fault_occurrences_total", "other", "other"),
        150.0
    );
    assert_eq!(
        value(
            &body,
            "faultline_fault_occurrences_total",
            "SXid12028",
            "nvswitch3"
        ),
        1.0
    );
    promtool_accepts(&body);

    // A policy that names Xid100007: its fault is shown under its code from the reload on.
    std::fs::write(
        &policy,
        "overrides:\n  Xid100007: { handling: NotHandleFault }\n",
    )
    .unwrap();
    let body = wait_until(
        "the reloaded policy's code",
        Duration::from_secs(30),
        || {
            let (_, body) = agent.get("/metrics");
            (value(&body, "faultline_fault_active", "Xid100007", "other") == 1.0).then_some(body)
        },
    );
    assert_eq!(
        value(&body, "faultline_fault_active", "other", "other"),
        149.0
    );
    assert!(
        body.contains(
            "faultline_fault_active{code=\"Xid100007\",device=\"other\",handling=\"NotHandleFault\"} 1\n"
        ),
        "{body}"
    );
    assert_eq!(agent.stop(), 0);
}

/// `faultline_heartbeat_timestamp_seconds` is the record's `agent.heartbeatTime`, in Unix
/// seconds. Before, no such series existed.
#[test]
fn the_heartbeat_metric_is_the_records_heartbeat_time() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_for("a heartbeat", |r| r.agent.heartbeat_time.is_some());
    // The record is rewritten every 10 s: read both until no rewrite fell between them.
    wait_until(
        "the metric to match the record",
        Duration::from_secs(30),
        || {
            let before = agent.record()?.agent.heartbeat_time?;
            let metric = agent.metric("faultline_heartbeat_timestamp_seconds");
            let after = agent.record()?.agent.heartbeat_time?;
            let want = before.as_millisecond() as f64 / 1000.0;
            (before == after && metric == want).then_some(())
        },
    );
    assert_eq!(agent.stop(), 0);
}

/// `promtool check metrics` on `body`, when Debian's `prometheus` package is installed (under
/// CI a missing one fails: common::prometheus::tools_present).
fn promtool_accepts(body: &str) {
    if !common::prometheus::tools_present() {
        return;
    }
    if let Err(e) = common::prometheus::promtool_check_metrics(body) {
        panic!("promtool check metrics:\n{e}");
    }
}
