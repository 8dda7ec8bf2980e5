//! The `faultline` CLI as scripts meet it: a dead agent's record, and `-o json` for every
//! error. Runs the real binaries.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use common::{cli, Agent};
use faultline_core::record::NodeRecord;
use serde_json::Value;

/// The record a killed agent leaves when its node's clock was a day ahead (reproduced with
/// libfaketime +1 day, then SIGKILL): the wall-clock heartbeat a day in the future. Its boot
/// clock reading says the kill was a minute ago. `wait-healthy` must not pass it and `get`
/// must say so; before, the future heartbeat counted as fresh for the whole day (exit 0 both).
#[test]
fn a_dead_agent_with_a_heartbeat_in_the_future_is_not_alive() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("a heartbeat", |r| r.agent.heartbeat_time.is_some());
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    let mut r: NodeRecord = r;
    let day = faultline_core::time::SignedDuration::from_hours(24);
    r.agent.heartbeat_time = r.agent.heartbeat_time.map(|t| t + day);
    let boot = r
        .agent
        .heartbeat_boot
        .as_mut()
        .expect("the agent stamps its heartbeat with the boot clock");
    boot.since_boot_ms = boot.since_boot_ms.saturating_sub(60_000);
    std::fs::write(agent.record_path(), serde_json::to_vec(&r).unwrap()).unwrap();

    let state = agent.state();
    let (code, out, err) = cli(&["wait-healthy", "--timeout", "300ms"], &state);
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(err.contains("not alive") && err.contains("old"), "{err}");

    let (code, out, err) = cli(&["get"], &state);
    assert_eq!(code, Some(3), "{out}{err}");
    assert!(out.contains("node-a"), "the record is printed: {out}");
    assert!(
        err.starts_with("warning: the agent is not alive") && err.lines().count() == 1,
        "{err}"
    );
    let (code, out, _) = cli(&["get", "-o", "json"], &state);
    assert_eq!(code, Some(3));
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert!(
        doc["notAlive"].as_str().unwrap().contains("not alive"),
        "{doc}"
    );
    assert_eq!(doc["node"], "node-a");
    // The document, notAlive and heartbeatBoot included, is what the published schema allows.
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/record.schema.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
}

/// `get` of a live agent's record: exit 0, nothing on stderr, no `notAlive`.
#[test]
fn get_of_a_live_agent_has_no_warning() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_for("a heartbeat", |r| r.agent.heartbeat_time.is_some());
    let (code, out, err) = cli(&["get", "-o", "json"], &agent.state());
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(err, "");
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert!(doc.get("notAlive").is_none(), "{doc}");
    assert_eq!(agent.stop(), 0);
}

/// `-o json` promises one JSON document on stdout, errors included: argument errors too (clap
/// fails before it has read `-o`), in every spelling of `-o json`. Before, stdout was empty.
#[test]
fn json_output_covers_argument_errors() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["wait-healthy", "--timeout", "abc", "-o", "json"][..],
        &["get", "--bogus", "-o", "json"],
        &["wait-healthy", "-ojson", "--max-handling", "Foo"],
        &["hosts", "--slots", "0", "--output", "json"],
        &["check", "--output=json"],
        &["get", "-o=json", "-o", "table"],
        &["-o", "json", "get"],
    ] {
        let (code, out, err) = cli(args, dir.path());
        assert_eq!(code, Some(2), "{args:?}: {out}{err}");
        let doc: Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("{args:?}: not one JSON document ({e}): {out:?}"));
        assert_eq!(doc["exitCode"], 2, "{args:?}");
        let why = doc["error"].as_str().unwrap();
        assert!(!why.is_empty() && !why.contains('\n'), "{args:?}: {why:?}");
    }
    let (_, out, _) = cli(
        &["wait-healthy", "--timeout", "abc", "-o", "json"],
        dir.path(),
    );
    assert!(out.contains("abc"), "the error names the bad value: {out}");
    // Without -o json an argument error stays clap's text on stderr.
    let (code, out, err) = cli(&["get", "--bogus"], dir.path());
    assert_eq!((code, out.as_str()), (Some(2), ""));
    assert!(err.contains("--bogus"), "{err}");
    // Help is not an error.
    let (code, out, _) = cli(&["get", "--help", "-o", "json"], dir.path());
    assert_eq!(code, Some(0));
    assert!(out.contains("Usage"), "{out}");
}
