//! Drives the kernel message parsers with the fixture corpus in tests/fixtures/kernel-lines.yaml:
//! every real-format line must yield the expected event, every other line must yield none.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

use std::path::PathBuf;

use faultline_core::parse::parse_message;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
struct Case {
    line: String,
    #[serde(default)]
    source: Option<String>,
    expect: Option<serde_json::Map<String, Value>>,
}

fn corpus() -> Vec<Case> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/kernel-lines.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn corpus_lines_parse_as_expected() {
    let cases = corpus();
    assert!(cases.len() >= 100, "corpus too small: {}", cases.len());
    let mut failures = Vec::new();
    let (mut matching, mut non_matching) = (0, 0);
    for c in &cases {
        let got = parse_message(&c.line).map(|e| serde_json::to_value(e).expect("serializable"));
        match (&c.expect, &got) {
            (None, None) => non_matching += 1,
            (Some(want), Some(Value::Object(got))) => {
                matching += 1;
                for (k, v) in want {
                    let actual = got.get(k).unwrap_or(&Value::Null);
                    if actual != v {
                        failures.push(format!(
                            "{:?}\n  field {k}: want {v}, got {actual}\n  source: {:?}",
                            c.line, c.source
                        ));
                    }
                }
            }
            _ => failures.push(format!(
                "{:?}\n  want {:?}\n  got  {:?}",
                c.line, c.expect, got
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} corpus lines failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert!(
        matching >= 60 && non_matching >= 40,
        "{matching} matching, {non_matching} non-matching"
    );
}
