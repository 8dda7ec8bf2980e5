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

/// A record someone other than a driver can put in the kernel log
/// (tests/fixtures/forged-kernel-lines.yaml).
#[derive(Debug, Deserialize)]
struct Forged {
    record: String,
    how: String,
}

fn forged() -> Vec<Forged> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/forged-kernel-lines.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Issue 25 §1: a line the kernel writes with text user space chose (a process name, a mapped
/// file's name, a module quoting a driver) is not a driver's line; a record user space wrote
/// is refused by its facility, though its text is exactly a driver's line.
#[test]
fn forged_lines_give_no_fault_at_the_parser() {
    use faultline_core::parse::parse_record;
    let cases = forged();
    let mut failures = Vec::new();
    let (mut kernel, mut user) = (0, 0);
    for c in &cases {
        let r = parse_record(c.record.as_bytes())
            .unwrap_or_else(|e| panic!("{:?}: not a kmsg record: {e}", c.record));
        let got = parse_message(&r.message);
        if r.facility == 0 {
            kernel += 1;
            if got.is_some() {
                failures.push(format!("{:?} ({}): {got:?}", c.record, c.how));
            }
        } else {
            // The text is a real driver line: only the facility tells it apart.
            user += 1;
            if got.is_none() {
                failures.push(format!("{:?} ({}): not a driver line", c.record, c.how));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        kernel >= 20 && user >= 10,
        "{kernel} kernel, {user} user records"
    );
}

/// The same forged records through the kernel log reader: no engine input but the cursor, and
/// every user-space record counted as one.
#[test]
fn forged_lines_give_no_fault_through_the_reader() {
    use faultline_core::engine::Input;
    use faultline_core::kmsg_reader::{KmsgReader, Tally};
    use std::sync::Arc;
    let cases = forged();
    let tally = Arc::new(Tally::default());
    let mut reader = KmsgReader::new(None, None, false, tally.clone());
    let mut out = Vec::new();
    for c in &cases {
        reader.feed(c.record.as_bytes(), &mut out);
    }
    reader.flush_cursor(&mut out);
    let inputs: Vec<String> = out
        .iter()
        .filter(|i| !matches!(i, Input::KmsgCursor(_)))
        .map(|i| format!("{i:?}"))
        .collect();
    assert!(inputs.is_empty(), "{inputs:#?}");
    let user = cases
        .iter()
        .filter(|c| {
            let r = faultline_core::parse::parse_record(c.record.as_bytes()).unwrap();
            r.facility != 0
        })
        .count();
    assert!(user >= 10);
    assert_eq!(Tally::get(&tally.user_records), user as u64);
    assert_eq!(Tally::get(&tally.matched), 0);
    assert_eq!(Tally::get(&tally.records), cases.len() as u64);
}

/// Every real line of the corpus, as the kernel writes it (facility 0), still reaches the
/// engine through the reader; the same line written from user space does not.
#[test]
fn corpus_lines_through_the_reader_by_facility() {
    use faultline_core::engine::Input;
    use faultline_core::kmsg_reader::{KmsgReader, Tally};
    use std::sync::Arc;
    let mut checked = 0;
    for c in corpus().iter().filter(|c| c.expect.is_some()) {
        for (pri, from_kernel) in [(4, true), (3, true), (12, false), (30, false)] {
            let tally = Arc::new(Tally::default());
            let mut reader = KmsgReader::new(None, None, false, tally.clone());
            let mut out = Vec::new();
            reader.feed(format!("{pri},1,1000,-;{}", c.line).as_bytes(), &mut out);
            let obs = out.iter().any(|i| matches!(i, Input::Kmsg { .. }));
            assert_eq!(obs, from_kernel, "pri {pri}: {:?}", c.line);
            assert_eq!(Tally::get(&tally.user_records), u64::from(!from_kernel));
        }
        checked += 1;
    }
    assert!(checked >= 60, "{checked}");
}
