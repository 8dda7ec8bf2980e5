//! The monitoring component (`manifests/components/monitoring`): the alerts pass
//! `promtool check rules` and their unit tests (`tests/manifests/alerts_test.yaml`, every alert
//! both firing and not firing) pass `promtool test rules`; each alert has a severity, a summary,
//! a description and a runbook that exists in docs/kubernetes.md; the ServiceMonitor reaches the
//! DaemonSet's metrics port through the Service and gives the job and node labels the alerts
//! use; the plain scrape annotations name the same port; kustomize renders the base with the
//! component. Which metrics the alerts and the dashboard read is checked against a real scrape
//! in faultline/tests/monitoring.rs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::common::{self, Doc, NAMESPACE};

const COMPONENT: &str = "monitoring";
/// Where every runbook_url points: the "Alerts" rows of docs/kubernetes.md's troubleshooting.
const RUNBOOKS: &str = "https://github.com/faultline-io/faultline/blob/main/docs/kubernetes.md#";

fn objects() -> Vec<Doc> {
    common::component_objects(COMPONENT)
}

fn rule() -> Doc {
    common::find(&objects(), "PrometheusRule", "faultline").clone()
}

/// Every alerting rule of the PrometheusRule.
fn alerts() -> Vec<Value> {
    let rule = rule();
    let mut out = Vec::new();
    for g in rule.value["spec"]["groups"].as_array().expect("groups") {
        out.extend(g["rules"].as_array().expect("rules").iter().cloned());
    }
    assert!(out.iter().all(|r| r.get("alert").is_some()), "alerts only");
    out
}

/// The promtool unit tests of the alerts.
fn unit_tests() -> Value {
    let path = common::repo_root().join("tests/manifests/alerts_test.yaml");
    let text = std::fs::read_to_string(&path).expect("read alerts_test.yaml");
    let mut docs = common::parse_yaml(&text).expect("alerts_test.yaml parses");
    docs.remove(0)
}

/// Whether `promtool` is here; under CI it must be (`.ci/run` installs Debian's `prometheus`).
fn promtool_present() -> bool {
    let found = Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found || std::env::var_os("CI").is_none(),
        "CI must have promtool (Debian's prometheus package): .ci/run installs it"
    );
    if !found {
        eprintln!("skipped: promtool is not installed (Debian's prometheus package)");
    }
    found
}

/// A fresh directory for this test's files.
fn scratch(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().expect("run promtool");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The PrometheusRule's `spec` is the rule file: promtool checks it and runs the unit tests on
/// it. Written out as JSON, which is YAML, so the shipped object stays the only copy.
#[test]
fn promtool_checks_and_unit_tests_the_alerts() {
    if !promtool_present() {
        return;
    }
    let dir = scratch("alerts");
    let rules = dir.join("faultline-rules.json");
    std::fs::write(&rules, rule().value["spec"].to_string()).expect("write the rule file");
    let (ok, out) = run(Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&rules));
    assert!(ok, "promtool check rules:\n{out}");
    assert!(
        out.contains(&format!("{} rules found", alerts().len())),
        "{out}"
    );

    let test = dir.join("alerts_test.yaml");
    std::fs::copy(
        common::repo_root().join("tests/manifests/alerts_test.yaml"),
        &test,
    )
    .expect("copy the unit tests");
    let (ok, out) = run(Command::new("promtool")
        .arg("test")
        .arg("rules")
        .arg(&test)
        .current_dir(&dir));
    assert!(ok, "promtool test rules:\n{out}");

    // The unit tests test: an alert that fires at the wrong time fails them.
    let mut broken = rule().value["spec"].clone();
    let stale = broken["groups"][0]["rules"]
        .as_array_mut()
        .expect("rules")
        .iter_mut()
        .find(|r| r["alert"] == "FaultlineRecordStale")
        .expect("FaultlineRecordStale");
    stale["expr"] = Value::from("time() - faultline_heartbeat_timestamp_seconds > 60");
    std::fs::write(&rules, broken.to_string()).expect("write the broken rule file");
    let (ok, out) = run(Command::new("promtool")
        .arg("test")
        .arg("rules")
        .arg(&test)
        .current_dir(&dir));
    assert!(!ok && out.contains("FaultlineRecordStale"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every alert has unit tests where it fires and where it does not, and the unit tests name no
/// alert that does not exist.
#[test]
fn every_alert_is_unit_tested_firing_and_not_firing() {
    let tests = unit_tests();
    assert_eq!(
        tests["rule_files"],
        serde_json::json!(["faultline-rules.json"]),
        "the rule file the promtool test writes"
    );
    let mut firing = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for t in tests["tests"].as_array().expect("tests") {
        for a in t["alert_rule_test"].as_array().into_iter().flatten() {
            let name = a["alertname"].as_str().expect("alertname").to_string();
            if a["exp_alerts"].as_array().is_some_and(|e| !e.is_empty()) {
                firing.insert(name);
            } else {
                quiet.insert(name);
            }
        }
    }
    let names: BTreeSet<String> = alerts()
        .iter()
        .map(|a| a["alert"].as_str().expect("alert").to_string())
        .collect();
    for n in &names {
        assert!(firing.contains(n), "{n}: no unit test where it fires");
        assert!(
            quiet.contains(n),
            "{n}: no unit test where it does not fire"
        );
    }
    let unknown: Vec<_> = firing
        .union(&quiet)
        .filter(|n| !names.contains(*n))
        .collect();
    assert!(
        unknown.is_empty(),
        "tests of alerts that do not exist: {unknown:?}"
    );
    assert!(names.len() >= 10, "{names:?}");
}

/// The ids of the HTML anchors (`<a id="...">`) and the headings' anchors of a Markdown file.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = markdown
        .split("id=\"")
        .skip(1)
        .filter_map(|rest| rest.split_once('"').map(|(id, _)| id.to_string()))
        .collect();
    for line in markdown.lines().filter(|l| l.starts_with('#')) {
        let title = line.trim_start_matches('#').trim().to_lowercase();
        out.insert(
            title
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect(),
        );
    }
    out
}

/// Severity, summary, description, and a runbook that exists: docs/kubernetes.md has the
/// anchor, and the row names the alert.
#[test]
fn every_alert_has_a_severity_and_a_runbook_in_the_docs() {
    let doc = std::fs::read_to_string(common::repo_root().join("docs/kubernetes.md"))
        .expect("read docs/kubernetes.md");
    let ids = anchors(&doc);
    for a in alerts() {
        let name = a["alert"].as_str().expect("alert");
        let severity = a["labels"]["severity"].as_str().unwrap_or("");
        assert!(
            ["critical", "warning"].contains(&severity),
            "{name}: severity {severity:?}"
        );
        for key in ["summary", "description", "runbook_url"] {
            assert!(
                a["annotations"][key]
                    .as_str()
                    .is_some_and(|s| !s.is_empty()),
                "{name}: no {key}"
            );
        }
        let url = a["annotations"]["runbook_url"]
            .as_str()
            .expect("runbook_url");
        let anchor = url
            .strip_prefix(RUNBOOKS)
            .unwrap_or_else(|| panic!("{name}: runbook {url} is not in docs/kubernetes.md"));
        assert_eq!(
            anchor,
            name.to_lowercase(),
            "{name}: the anchor is its name"
        );
        assert!(
            ids.contains(anchor),
            "{name}: docs/kubernetes.md has no anchor {anchor}"
        );
        let row = doc
            .lines()
            .find(|l| l.contains(&format!("id=\"{anchor}\"")))
            .expect("the anchor's line");
        assert!(row.contains(&format!("`{name}`")), "{name}: its row: {row}");
    }
}

/// The DaemonSet's agent container: (pod labels, pod annotations, the `http` port, `--listen`).
fn agent_pod() -> (
    BTreeMap<String, String>,
    BTreeMap<String, String>,
    i64,
    String,
) {
    let docs = common::base_objects();
    let ds = common::find(&docs, "DaemonSet", "faultline-agent");
    let template = &ds.value["spec"]["template"];
    let map = |v: &Value| -> BTreeMap<String, String> {
        v.as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().expect("a string").to_string()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let container = &template["spec"]["containers"][0];
    let port = container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "http")
        .expect("a port named http")["containerPort"]
        .as_i64()
        .expect("containerPort");
    let listen = container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .find_map(|a| a.strip_prefix("--listen="))
        .expect("--listen=")
        .to_string();
    (
        map(&template["metadata"]["labels"]),
        map(&template["metadata"]["annotations"]),
        port,
        listen,
    )
}

/// A Prometheus without prometheus-operator scrapes the pods by their annotations: the port
/// they name is the one the agent listens on.
#[test]
fn the_scrape_annotations_name_the_metrics_port() {
    let (_, annotations, port, listen) = agent_pod();
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    assert_eq!(annotations["prometheus.io/port"], port.to_string());
    assert!(listen.ends_with(&format!(":{port}")), "--listen={listen}");
}

/// The Service selects the agent pods and reaches their `http` port; the ServiceMonitor selects
/// the Service, scrapes that port's `/metrics`, gives the targets job="faultline" (what the
/// alerts select) and the pod's node as `node`.
#[test]
fn the_servicemonitor_scrapes_the_agents_as_job_faultline_with_their_node() {
    let docs = objects();
    let (pod_labels, _, port, _) = agent_pod();
    let svc = common::find(&docs, "Service", "faultline-agent");
    assert_eq!(svc.namespace(), Some(NAMESPACE));
    let spec = &svc.value["spec"];
    assert_eq!(spec["clusterIP"], "None", "headless");
    for (k, v) in spec["selector"].as_object().expect("selector") {
        assert_eq!(pod_labels.get(k).map(String::as_str), v.as_str(), "{k}");
    }
    let svc_port = &spec["ports"][0];
    assert_eq!(svc_port["targetPort"], "http");
    assert_eq!(svc_port["port"].as_i64(), Some(port));

    let sm = common::find(&docs, "ServiceMonitor", "faultline-agent");
    let spec = &sm.value["spec"];
    for (k, v) in spec["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels")
    {
        assert_eq!(&svc.value["metadata"]["labels"][k], v, "{k}");
    }
    // Without a namespaceSelector it looks in its own namespace: the Service's.
    assert!(spec.get("namespaceSelector").is_none());
    assert_eq!(sm.namespace(), svc.namespace());
    // jobLabel: the job is the value of this Service label.
    let job_label = spec["jobLabel"].as_str().expect("jobLabel");
    assert_eq!(svc.value["metadata"]["labels"][job_label], "faultline");
    assert!(
        alerts().iter().any(|a| a["expr"]
            .as_str()
            .unwrap_or("")
            .contains("up{job=\"faultline\"}")),
        "the alerts select job=\"faultline\""
    );
    let ep = &spec["endpoints"][0];
    assert_eq!(ep["port"], svc_port["name"]);
    assert_eq!(ep["path"], "/metrics");
    assert!(ep["relabelings"]
        .as_array()
        .is_some_and(|r| r.iter().any(|r| {
            r["sourceLabels"] == serde_json::json!(["__meta_kubernetes_pod_node_name"])
                && r["targetLabel"] == "node"
        })));
}

/// The component lists exactly its files, and `kubectl kustomize` (where installed) renders the
/// base with it: the base's objects, the component's, and the dashboard ConfigMap for Grafana's
/// sidecar holding dashboard.json as it is.
#[test]
fn kubectl_kustomize_renders_the_base_with_the_component() {
    let dir = common::manifests_dir().join("components").join(COMPONENT);
    let k = common::parse_yaml(
        &std::fs::read_to_string(dir.join("kustomization.yaml")).expect("kustomization.yaml"),
    )
    .expect("parses")
    .remove(0);
    let mut listed: BTreeSet<String> = k["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("a string").to_string())
        .collect();
    let generator = &k["configMapGenerator"][0];
    assert_eq!(generator["options"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(generator["namespace"], NAMESPACE);
    listed.insert(
        generator["files"][0]
            .as_str()
            .and_then(|f| f.split_once('=').map(|(_, file)| file.to_string()))
            .expect("files: [key=file]"),
    );
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("read the component")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|f| f != "kustomization.yaml")
        .collect();
    assert_eq!(
        listed, on_disk,
        "resources vs files in components/{COMPONENT}"
    );

    // kustomize loads resources by relative path only: an overlay in a scratch directory.
    let overlay = scratch("overlay");
    let root = common::manifests_dir().canonicalize().expect("manifests/");
    let from = overlay.canonicalize().expect("the overlay");
    let up = "../".repeat(from.components().count() - 1);
    let rel = |p: &str| {
        format!(
            "{up}{}",
            root.join(p).to_string_lossy().trim_start_matches('/')
        )
    };
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
             resources: [{}]\ncomponents: [{}]\n",
            rel("base"),
            rel(&format!("components/{COMPONENT}"))
        ),
    )
    .expect("write the overlay");
    let out = match Command::new("kubectl")
        .arg("kustomize")
        .arg(&overlay)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: kubectl not available ({e})");
            return;
        }
    };
    assert!(
        out.status.success(),
        "kubectl kustomize failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = common::parse_yaml(&String::from_utf8_lossy(&out.stdout)).expect("YAML");
    let key = |v: &Value| {
        (
            v["kind"].as_str().unwrap_or("").to_string(),
            v["metadata"]["name"].as_str().unwrap_or("").to_string(),
        )
    };
    let got: BTreeSet<_> = rendered.iter().map(key).collect();
    let mut want: BTreeSet<_> = common::base_objects()
        .iter()
        .map(|d| key(&d.value))
        .collect();
    want.extend(objects().iter().map(|d| key(&d.value)));
    want.insert(("ConfigMap".into(), "faultline-dashboard".into()));
    assert_eq!(got, want);
    let cm = rendered
        .iter()
        .find(|v| key(v) == ("ConfigMap".into(), "faultline-dashboard".into()))
        .expect("the dashboard ConfigMap");
    assert_eq!(cm["metadata"]["namespace"], NAMESPACE);
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(
        cm["data"]["faultline.json"].as_str(),
        Some(
            std::fs::read_to_string(dir.join("dashboard.json"))
                .expect("dashboard.json")
                .as_str()
        )
    );
    let _ = std::fs::remove_dir_all(&overlay);
}

/// The dashboard asks for its Prometheus data source (a template variable), so it works in any
/// Grafana; every panel and query uses that variable.
#[test]
fn the_dashboard_uses_its_datasource_variable() {
    let path = common::manifests_dir().join("components/monitoring/dashboard.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard.json"))
        .expect("JSON");
    let vars = dash["templating"]["list"].as_array().expect("templating");
    assert!(vars.iter().any(|v| v["name"] == "datasource"
        && v["type"] == "datasource"
        && v["query"] == "prometheus"));
    let templated = serde_json::json!({"type": "prometheus", "uid": "${datasource}"});
    let mut count = 0;
    for p in dash["panels"].as_array().expect("panels") {
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"], templated, "panel {}", p["title"]);
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"], templated, "panel {}", p["title"]);
            count += 1;
        }
    }
    assert!(count > 10, "{count} queries");
    let titles: Vec<&str> = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .filter_map(|p| p["title"].as_str())
        .collect();
    for want in [
        "Nodes by health",
        "Active faults by code",
        "Active faults by node",
        "Detectors by state",
        "Kernel-log records lost",
        "Peer checks by result",
        "Taints withheld by node",
    ] {
        assert!(titles.contains(&want), "no panel {want:?}: {titles:?}");
    }
}
