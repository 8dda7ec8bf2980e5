//! The policy ConfigMap: its `policy.yaml` is YAML and uses only the policy's fields.
//!
//! The agent-side test parses the same text with the agent's real parser (`Policy::parse`);
//! this one needs no agent build and catches the obvious mistakes early.

use k8s_openapi::api::core::v1::ConfigMap;
use serde_json::Value;

use crate::common;

/// The top-level fields of `Policy` (core/src/policy.rs), read from the source.
fn policy_fields() -> Vec<String> {
    common::clap_flags("core/src/policy.rs", "pub struct Policy")
        .into_iter()
        .map(|f| f.trim_start_matches("--").replace('-', "_"))
        .collect()
}

#[test]
fn the_policy_configmap_holds_a_yaml_policy_with_known_fields() {
    let docs = common::base_objects();
    let cm: ConfigMap = common::find(&docs, "ConfigMap", "faultline-policy").to();
    let data = cm.data.expect("data");
    assert_eq!(data.len(), 1, "one key: policy.yaml");
    let text = data.get("policy.yaml").expect("policy.yaml");
    let docs = common::parse_yaml(text).expect("policy.yaml is YAML");
    assert_eq!(docs.len(), 1, "one document");
    let policy = docs[0].as_object().expect("a mapping");

    let fields = policy_fields();
    assert!(fields.contains(&"taint_budget".to_string()), "{fields:?}");
    for k in policy.keys() {
        assert!(fields.contains(k), "{k} is not a policy field ({fields:?})");
    }
    // The taint budget, as docs/kubernetes.md describes the default.
    let tb = &policy["taint_budget"];
    assert_eq!(tb["max_percent"], Value::from(10));
    assert_eq!(tb["min_nodes"], Value::from(1));
    assert_eq!(tb["window"], "10m");
    let budget_fields = common::clap_flags("core/src/policy.rs", "pub struct TaintBudget");
    for k in tb.as_object().expect("a mapping").keys() {
        assert!(
            budget_fields.contains(&format!("--{}", k.replace('_', "-"))),
            "taint_budget.{k}"
        );
    }
    // The commented examples name real fields too.
    for line in text.lines() {
        let l = line.trim_start();
        if let Some(rest) = l.strip_prefix("# ") {
            if let Some((key, _)) = rest.split_once(':') {
                let top = line.len() - l.len() == 0 && !key.contains(' ');
                if top && !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                {
                    assert!(
                        fields.contains(&key.to_string()),
                        "commented {key} is not a policy field"
                    );
                }
            }
        }
    }
}
