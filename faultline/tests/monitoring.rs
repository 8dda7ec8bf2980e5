//! The alerts and the dashboard that ship in `manifests/components/monitoring/` use only what
//! the agent really exports: every metric name an alert's or a panel's PromQL reads, and every
//! label name its selectors, groupings and alert templates use, is checked against what a real
//! Prometheus server stored from scraping a running agent, read back from Prometheus' own API
//! (`/api/v1/label/__name__/values`, `/api/v1/series`), not from a list kept beside this test.
//! Needs Debian's `prometheus` package (common/prometheus.rs).

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::cluster::probe_bin;
use common::prometheus::{api, query, start_prometheus_with, tools_present};
use common::{wait_until, xid79, Agent};

/// What one PromQL expression reads.
#[derive(Debug, Default, PartialEq)]
struct Uses {
    /// Metric names (functions, aggregations, keywords and label names left out).
    metrics: BTreeSet<String>,
    /// `(metric, label)`: a label name a selector of that metric matches on.
    selector_labels: BTreeSet<(String, String)>,
    /// Label names of `by`, `without`, `on`, `ignoring`, `group_left`, `group_right` clauses:
    /// each must be on the series of some metric of the expression.
    grouping_labels: BTreeSet<String>,
}

/// PromQL's keywords that may stand where a metric name could (the binary set operators,
/// `offset`, `bool`, `atan2`) and number literals spelled as words.
const KEYWORDS: [&str; 8] = [
    "and", "or", "unless", "offset", "bool", "atan2", "inf", "nan",
];
/// Keywords followed by a parenthesized list of label names.
const GROUPING: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names and label names a PromQL expression uses, read by a small tokenizer of the
/// PromQL grammar (prometheus/promql/parser/lex.go: identifiers, strings, durations in
/// brackets, label matchers in braces): an identifier followed by `(` is a function or an
/// aggregation (`sum by (x) (...)` too), one after `by`/`without`/`on`/`ignoring`/
/// `group_left`/`group_right` in parentheses is a label name, a keyword is skipped, and any
/// other identifier is a metric name. Grafana's interval variables become durations.
fn promql_uses(expr: &str) -> Uses {
    let expr = expr
        .replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h");
    let chars: Vec<char> = expr.chars().collect();
    let mut uses = Uses::default();
    let mut i = 0;
    // The metric name just read, for the matchers in braces after it.
    let mut last_metric: Option<String> = None;
    let ident_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let ident_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let skip_space = |mut j: usize| {
        while j < chars.len() && chars[j].is_whitespace() {
            j += 1;
        }
        j
    };
    let skip_string = |j: usize| {
        let quote = chars[j];
        let mut k = j + 1;
        while k < chars.len() && chars[k] != quote {
            if chars[k] == '\\' && quote != '`' {
                k += 1;
            }
            k += 1;
        }
        k + 1
    };
    let read_ident = |j: usize| {
        let mut k = j;
        while k < chars.len() && ident_char(chars[k]) {
            k += 1;
        }
        (chars[j..k].iter().collect::<String>(), k)
    };
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '"' || c == '\'' || c == '`' {
            i = skip_string(i);
            last_metric = None;
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            // Label matchers: `name op "value"`, comma-separated.
            i += 1;
            loop {
                i = skip_space(i);
                if i >= chars.len() || chars[i] == '}' {
                    i += 1;
                    break;
                }
                if chars[i] == ',' {
                    i += 1;
                    continue;
                }
                let (label, next) = read_ident(i);
                assert!(!label.is_empty(), "unexpected {:?} in {expr}", chars[i]);
                if let Some(m) = &last_metric {
                    uses.selector_labels.insert((m.clone(), label));
                }
                i = skip_space(next);
                while i < chars.len() && "=!~".contains(chars[i]) {
                    i += 1;
                }
                i = skip_string(skip_space(i));
            }
            last_metric = None;
        } else if c.is_ascii_digit() || c == '.' {
            // A number or a duration.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            last_metric = None;
        } else if ident_start(c) {
            let (word, next) = read_ident(i);
            i = next;
            let after = skip_space(i);
            let followed_by = chars.get(after).copied();
            let lower = word.to_ascii_lowercase();
            last_metric = None;
            if GROUPING.contains(&lower.as_str()) {
                if followed_by == Some('(') {
                    i = after + 1;
                    while i < chars.len() && chars[i] != ')' {
                        let j = skip_space(i);
                        if j < chars.len() && ident_start(chars[j]) {
                            let (label, k) = read_ident(j);
                            uses.grouping_labels.insert(label);
                            i = k;
                        } else {
                            i = j + 1;
                        }
                    }
                    i += 1;
                }
            } else if KEYWORDS.contains(&lower.as_str()) {
            } else if followed_by == Some('(') {
                // A function or an aggregation.
            } else if followed_by.is_some_and(ident_start)
                && ["by", "without"].contains(&read_ident(after).0.as_str())
            {
                // An aggregation with its grouping first: `sum by (x) (...)`.
            } else {
                uses.metrics.insert(word.clone());
                last_metric = Some(word);
            }
        } else {
            i += 1;
            last_metric = None;
        }
    }
    uses
}

/// The label names an alert's annotation and label templates name (`$labels.<name>`).
fn template_labels(text: &str) -> BTreeSet<String> {
    text.split("$labels.")
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

/// One expression to check, and where it comes from (for messages).
struct Use {
    at: String,
    uses: Uses,
    /// Label names templates of the same alert use.
    template_labels: BTreeSet<String>,
}

fn monitoring_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests/components/monitoring")
}

/// Every expression of every alert of the PrometheusRule, every panel's targets, and the
/// dashboard's template variables.
fn shipped_uses() -> Vec<Use> {
    let mut out = Vec::new();
    let text = std::fs::read_to_string(monitoring_dir().join("prometheusrule.yaml")).unwrap();
    let rule: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    for group in rule["spec"]["groups"].as_array().unwrap() {
        for r in group["rules"].as_array().unwrap() {
            let name = r["alert"].as_str().or(r["record"].as_str()).unwrap();
            let templates: String = ["labels", "annotations"]
                .iter()
                .filter_map(|k| r[*k].as_object())
                .flat_map(|m| m.values())
                .filter_map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join("\n");
            out.push(Use {
                at: format!("alert {name}"),
                uses: promql_uses(r["expr"].as_str().unwrap()),
                template_labels: template_labels(&templates),
            });
        }
    }
    let text = std::fs::read_to_string(monitoring_dir().join("dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut panels: Vec<&serde_json::Value> = dash["panels"].as_array().unwrap().iter().collect();
    while let Some(p) = panels.pop() {
        // Rows may hold their panels.
        panels.extend(p["panels"].as_array().into_iter().flatten());
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(Use {
                at: format!(
                    "panel {:?} target {}",
                    p["title"].as_str().unwrap_or(""),
                    t["refId"]
                ),
                uses: promql_uses(t["expr"].as_str().unwrap()),
                template_labels: BTreeSet::new(),
            });
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap();
        // Grafana's `label_values(metric, label)`: a metric and a label of its series.
        let (metric, label) = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .and_then(|r| r.split_once(','))
            .unwrap_or_else(|| panic!("variable {}: not label_values(m, l): {q}", v["name"]));
        let (metric, label) = (metric.trim(), label.trim());
        let mut uses = promql_uses(metric);
        uses.selector_labels
            .insert((metric.to_string(), label.to_string()));
        out.push(Use {
            at: format!("variable {}", v["name"]),
            uses,
            template_labels: BTreeSet::new(),
        });
    }
    out
}

/// What Prometheus stored: metric name -> the label names of its series.
type Stored = BTreeMap<String, BTreeSet<String>>;

/// Every problem: a metric not stored, or a label name not on its series.
fn problems(uses: &[Use], stored: &Stored) -> Vec<String> {
    let mut out = Vec::new();
    for u in uses {
        for m in &u.uses.metrics {
            if !stored.contains_key(m) {
                out.push(format!("{}: metric {m} is not exported", u.at));
            }
        }
        for (m, l) in &u.uses.selector_labels {
            if stored.get(m).is_some_and(|ls| !ls.contains(l)) {
                out.push(format!("{}: {m} has no label {l}", u.at));
            }
        }
        if !u.uses.metrics.iter().all(|m| stored.contains_key(m)) {
            // Said above; the labels of a metric not stored cannot be told.
            continue;
        }
        let all: BTreeSet<&String> = u
            .uses
            .metrics
            .iter()
            .filter_map(|m| stored.get(m))
            .flatten()
            .collect();
        for l in u.uses.grouping_labels.iter().chain(&u.template_labels) {
            if !all.contains(l) {
                out.push(format!(
                    "{}: label {l} is on no series of {:?}",
                    u.at, u.uses.metrics
                ));
            }
        }
    }
    out
}

fn free_on(ip: &str) -> SocketAddr {
    TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap()
}

/// The extractor on expressions of each kind it must tell apart.
#[test]
fn promql_uses_reads_metrics_and_labels() {
    let u = promql_uses(
        r#"sum by (code, node) (increase(faultline_x_total{node=~"$node",code!="a}b"}[$__rate_interval]))
           / on (node) group_left (le) max without (handling) (faultline_y) > bool 0
           or absent(up{job="faultline"}) unless time() - z offset 5m
           or histogram_quantile(0.99, sum(rate(h_bucket[5m:1m]))) or count(w == Inf)"#,
    );
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        u.metrics,
        set(&[
            "faultline_x_total",
            "faultline_y",
            "up",
            "z",
            "h_bucket",
            "w"
        ])
    );
    assert_eq!(
        u.selector_labels,
        [
            ("faultline_x_total", "code"),
            ("faultline_x_total", "node"),
            ("up", "job")
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
    );
    assert_eq!(u.grouping_labels, set(&["code", "node", "le", "handling"]));
    assert_eq!(
        template_labels("{{ $labels.node }} and {{$labels.code}}: {{ $value }}"),
        set(&["node", "code"])
    );
}

/// A real Prometheus scrapes an agent that has an active fault (an Xid in its kernel log) and
/// has taken part in a peer check with a second agent (so the labelled series exist); every
/// metric and label the shipped alerts and dashboard use is among what Prometheus stored. The
/// check is shown to catch a name the agent does not export. The same server evaluates the
/// alerts: no rule errs, and only the node's Unhealthy alert is active.
#[test]
fn the_alerts_and_the_dashboard_use_only_exported_metrics() {
    if !tools_present() {
        return;
    }
    let uses = shipped_uses();
    assert!(uses.len() > 20, "alerts and panels found: {}", uses.len());

    // Two agents on loopback, a coordinator, and a peer check between them (as peer_flood.rs
    // runs one).
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (free_on("127.0.0.1"), free_on("127.0.0.2"));
    let pool = common::bare_metal::Pool::new(
        tmp.path(),
        &[("node-a", a), ("node-b", b)],
        "peer:\n  enabled: false\n  bytes: 1048576\n  iterations: 2\n  check_timeout: 10s\n",
    );
    let probe = probe_bin();
    let start = |name: &str, listen: SocketAddr| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let args = pool.test_agent_args(name, listen, &probe, "31370");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Agent::start(&dir, &args)
    };
    let agent = start("node-a", a);
    let other = start("node-b", b);
    for x in [&agent, &other] {
        x.wait_for("start-up write", |_| true);
    }
    wait_until("the peer port to listen", Duration::from_secs(30), || {
        std::net::TcpStream::connect(a).ok()
    });
    let coordinator = pool.start_coordinator(free_on("127.0.0.5"), "31370");
    let (code, out, err) = pool.check(coordinator.address, "node-a,node-b", "60s");
    assert_eq!(code, 0, "the peer check passes\n{out}\n{err}");
    agent.append(&xid79(1, "3b"));
    agent.wait_for("the Xid", |r| common::fault(r, "Xid79").is_some());

    // `node` as the ServiceMonitor's relabeling gives it (components/monitoring), and the
    // PrometheusRule's `spec` as the rule file.
    let text = std::fs::read_to_string(monitoring_dir().join("prometheusrule.yaml")).unwrap();
    let rule: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let rule_file = tmp.path().join("faultline-rules.json");
    std::fs::write(&rule_file, rule["spec"].to_string()).unwrap();
    let (server, web) = start_prometheus_with(
        tmp.path(),
        &agent.addr(),
        &[("node", "node-a")],
        Some(&rule_file),
    );
    let log = || std::fs::read_to_string(tmp.path().join("prometheus.log")).unwrap_or_default();
    let wanted: BTreeSet<String> = uses
        .iter()
        .flat_map(|u| u.uses.metrics.iter().cloned())
        .collect();
    // Until every metric used is stored, or 30 s (then the check below names what is missing).
    let deadline = Instant::now() + Duration::from_secs(30);
    let names: BTreeSet<String> = loop {
        let names = api(&web, "/api/v1/label/__name__/values", &[])
            .and_then(|d| d.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect();
        if wanted.is_subset(&names) || Instant::now() > deadline {
            break names;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(
        query(&web, "up{job=\"faultline\"}")
            .first()
            .map(|s| s["value"][1].clone()),
        Some(serde_json::Value::from("1")),
        "the target is up:\n{}",
        log()
    );
    let mut stored = Stored::new();
    for name in &names {
        let series = api(&web, "/api/v1/series", &[("match[]", name)]).unwrap();
        let labels = stored.entry(name.clone()).or_default();
        for s in series.as_array().unwrap() {
            labels.extend(s.as_object().unwrap().keys().cloned());
        }
    }

    // The alerts as the server evaluates them on this agent: every rule evaluates without error
    // (promtool's unit tests cannot show that for data they do not have), and the one alert
    // active is the node's Unhealthy verdict from the Xid 79, pending for its minute. Each rule
    // group is evaluated on its own phase: one evaluated before the first scrape has
    // FaultlineAgentsAbsent pending (no `up` yet) until its next evaluation, a second later, so
    // the set is read until it settles.
    let expected = BTreeSet::from([(
        "FaultlineNodeUnhealthy".to_string(),
        "pending".to_string(),
        "node-a".to_string(),
    )]);
    let alerts_now = || -> BTreeSet<(String, String, String)> {
        query(&web, "ALERTS")
            .iter()
            .map(|a| {
                let l = |k: &str| a["metric"][k].as_str().unwrap_or("").to_string();
                (l("alertname"), l("alertstate"), l("node"))
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut active = alerts_now();
    while active != expected && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        active = alerts_now();
    }
    assert_eq!(active, expected);
    let groups = api(&web, "/api/v1/rules", &[]).unwrap();
    let mut evaluated = 0;
    for g in groups["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "{}: {}", r["name"], r["lastError"]);
            evaluated += 1;
        }
    }
    assert_eq!(
        evaluated,
        uses.iter().filter(|u| u.at.starts_with("alert ")).count()
    );
    drop(server);

    let found = problems(&uses, &stored);
    assert!(
        found.is_empty(),
        "the alerts and the dashboard use what the agent does not export:\n{}\n\nstored: {stored:#?}",
        found.join("\n")
    );
    // The check catches a misspelt metric, a label a metric does not have, and a grouping or
    // template label no series carries.
    let wrong = [
        (
            "faultline_node_healht == 2",
            "",
            "metric faultline_node_healht is not exported",
        ),
        (
            "faultline_detector_state{status=\"down\"} == 1",
            "",
            "faultline_detector_state has no label status",
        ),
        (
            "sum by (gpu) (faultline_fault_active)",
            "",
            "label gpu is on no series",
        ),
        (
            "faultline_node_health == 2",
            "{{ $labels.hostname }}",
            "label hostname is on no series",
        ),
    ];
    for (expr, template, want) in wrong {
        let u = Use {
            at: "mutant".into(),
            uses: promql_uses(expr),
            template_labels: template_labels(template),
        };
        let p = problems(&[u], &stored);
        assert!(p.iter().any(|p| p.contains(want)), "{expr}: {p:?}");
    }
    assert_eq!(agent.stop(), 0);
    assert_eq!(other.stop(), 0);
}
