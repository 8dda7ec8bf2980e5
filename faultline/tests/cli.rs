//! The `faultline` CLI as scripts meet it: a dead agent's record, and `-o json` for every
//! error. Runs the real binaries.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use common::{cli, Agent};
use faultline_core::record::NodeRecord;
use serde_json::{json, Value};

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

/// The examples' files, parsed (every document of a multi-document file).
fn example(name: &str) -> Vec<Value> {
    let path = format!(
        "{}/../manifests/examples/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The record loops of the examples' trainers, as written: job.yaml's `python -c` script and
/// the PyTorchJob's train.py (its ConfigMap), with their names.
fn training_loops() -> Vec<(&'static str, String)> {
    let job = example("job.yaml");
    let command = &job[0]["spec"]["template"]["spec"]["containers"][0]["command"];
    assert_eq!((&command[0], &command[1]), (&json!("python"), &json!("-c")));
    let pytorch = example("pytorchjob.yaml");
    let train = pytorch
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "pytorch-example-train")
        .expect("the PyTorchJob's train.py");
    vec![
        ("job.yaml", command[2].as_str().unwrap().to_string()),
        (
            "pytorchjob.yaml train.py",
            train["data"]["train.py"].as_str().unwrap().to_string(),
        ),
    ]
}

/// Runs a trainer's loop as written with python3, as its pod would: `record` stands where the
/// pod mounts the host's /run/faultline/faults.json, and each "step" (the `time.sleep` that
/// stands for training) takes no time. Exit status and stdout.
fn run_loop(script: &str, record: &std::path::Path) -> (Option<i32>, String) {
    const HARNESS: &str = r#"
import builtins, sys, time
script, record = sys.argv[1], sys.argv[2]
real_open = builtins.open
def mounted(path, *args, **kwargs):
    if path == "/run/faultline/faults.json":
        path = record
    return real_open(path, *args, **kwargs)
builtins.open = mounted
time.sleep = lambda seconds: None
exec(compile(script, "trainer", "exec"), {"__name__": "__main__"})
"#;
    let out = std::process::Command::new("python3")
        .args(["-c", HARNESS, script])
        .arg(record)
        .output()
        .expect("python3 runs the examples' trainers (it is what their images run)");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The trainers of job.yaml and pytorchjob.yaml (the same loop), run as written against the
/// records the real agent writes: a live agent's Healthy record trains every step; Unhealthy
/// stops the run (exit 1), from a live agent or a dead one; a dead agent's Healthy record
/// (killed, its heartbeat a minute old, or more by the time the loop reads it; from another
/// boot; dated a day ahead of the clock) still trains, but every step says the agent is not
/// running and new faults go unseen, and so does a record whose heartbeat cannot be read
/// (`"agent": null`, a `heartbeatBoot` without `bootId`: before, the loops died of a Python
/// exception on these).
/// Before, the loop printed "node Healthy" for a dead agent's record, as for a live one's, and
/// the PyTorchJob had no loop at all.
#[test]
fn the_examples_trainers_say_when_the_agent_is_not_running() {
    let loops = training_loops();
    assert_eq!(
        loops[0].1, loops[1].1,
        "the PyTorchJob runs job.yaml's loop"
    );
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let healthy = agent.wait_for("a heartbeat", |r| r.agent.heartbeat_time.is_some());
    let record = dir.path().join("faults.json");
    let put = |r: &NodeRecord| std::fs::write(&record, serde_json::to_vec(r).unwrap()).unwrap();
    let steps = |out: &str| out.lines().filter(|l| l.starts_with("step ")).count();

    for (name, script) in &loops {
        let (code, out) = run_loop(script, &agent.record_path());
        assert_eq!(code, Some(0), "{name}: {out}");
        assert_eq!(steps(&out), 10, "{name}: {out}");
        assert!(out.contains("step 9: node Healthy\n"), "{name}: {out}");
        assert!(!out.contains("not running"), "{name}: a live agent: {out}");
    }
    agent.append(&common::xid79(1, "3b"));
    let unhealthy = agent.wait_for("the Xid 79", |r| {
        r.health == faultline_core::record::Health::Unhealthy
    });
    for (name, script) in &loops {
        let (code, out) = run_loop(script, &agent.record_path());
        assert_eq!(code, Some(1), "{name}: {out}");
        assert!(
            out.starts_with("node unhealthy (") && out.contains("Xid79 on GPU-"),
            "{name}: {out}"
        );
    }
    let mut agent = agent;
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();

    // Killed a minute ago: the heartbeat, on both clocks, a minute older than when it was read.
    let aged = |r: &NodeRecord| {
        let mut r = r.clone();
        r.agent.heartbeat_time = r
            .agent
            .heartbeat_time
            .map(|t| t - faultline_core::time::SignedDuration::from_secs(60));
        let boot = r
            .agent
            .heartbeat_boot
            .as_mut()
            .expect("a boot clock reading");
        boot.since_boot_ms = boot.since_boot_ms.saturating_sub(60_000);
        r
    };
    let mut other_boot = healthy.clone();
    other_boot.agent.heartbeat_boot.as_mut().unwrap().boot_id = "an-earlier-boot".into();
    // No boot clock reading (judged on the wall clock), dated a day ahead: written before the
    // clock was stepped back.
    let mut ahead = healthy.clone();
    ahead.agent.heartbeat_boot = None;
    ahead.agent.heartbeat_time = ahead
        .agent
        .heartbeat_time
        .map(|t| t + faultline_core::time::SignedDuration::from_hours(24));
    // The age a trainer prints ("its last heartbeat is 61s old"), in seconds.
    let age_of = |line: &str| -> u64 {
        let rest = line
            .split("its last heartbeat is ")
            .nth(1)
            .unwrap_or_else(|| panic!("no age in {line:?}"));
        rest[..rest.find("s old").unwrap_or_else(|| panic!("{line:?}"))]
            .parse()
            .unwrap_or_else(|e| panic!("{line:?}: {e}"))
    };
    // Records no running agent writes: no agent block, a boot-clock reading without its boot id.
    let mut no_agent = serde_json::to_value(&healthy).unwrap();
    no_agent["agent"] = Value::Null;
    let mut no_boot_id = serde_json::to_value(&healthy).unwrap();
    no_boot_id["agent"]["heartbeatBoot"]
        .as_object_mut()
        .expect("a boot clock reading")
        .remove("bootId")
        .expect("its boot id");
    for (dead, why) in [
        (
            serde_json::to_value(aged(&healthy)).unwrap(),
            "its last heartbeat is ",
        ),
        (
            serde_json::to_value(other_boot).unwrap(),
            "its last heartbeat is from another boot",
        ),
        (
            serde_json::to_value(ahead).unwrap(),
            "its last heartbeat is dated 86",
        ),
        (no_agent, "its heartbeat cannot be read"),
        (no_boot_id, "its heartbeat cannot be read"),
    ] {
        std::fs::write(&record, serde_json::to_vec(&dead).unwrap()).unwrap();
        // What `faultline get` says of the same file: not alive (3), or no readable record (2).
        let (code, _, err) =
            common::cli(&["get", "--file", record.to_str().unwrap()], &agent.state());
        assert!(matches!(code, Some(2 | 3)), "{code:?} {err}");
        for (name, script) in &loops {
            let (code, out) = run_loop(script, &record);
            assert_eq!(code, Some(0), "{name}: trains on: {out}");
            assert_eq!(steps(&out), 10, "{name}: {out}");
            for line in out.lines() {
                assert!(
                    line.contains(
                        "node Healthy when last checked; the faultline agent is not running ("
                    ) && line.contains(why)
                        && line.ends_with("new faults are not seen"),
                    "{name}: {line}"
                );
                // Killed and aged a minute: at least that old, whenever the loop reads it.
                if why == "its last heartbeat is " {
                    assert!(age_of(line) >= 60, "{name}: {line}");
                }
            }
        }
    }
    put(&aged(&unhealthy));
    for (name, script) in &loops {
        let (code, out) = run_loop(script, &record);
        assert_eq!(code, Some(1), "{name}: the last verdict stands: {out}");
        assert!(out.starts_with("node unhealthy ("), "{name}: {out}");
    }
}
