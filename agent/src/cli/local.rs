//! This node's record: `faultline get`, `wait-healthy` and `clear`, reading the local file and
//! writing clear requests for the agent.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use faultline_core::record::NodeRecord;
use faultline_core::time::{signed, since, Timestamp};
use serde_json::{json, Value};

use super::{columns, Accept, Outcome};
use crate::atomic_file::write as write_atomic;
use crate::sink::file::FAULTS_FILE;
use crate::source::control::{is_pending, is_rejected, ClearRequest, CLEAR_DIR};

/// Where the local record is.
pub fn record_path(file: Option<&Path>, state_dir: &Path) -> PathBuf {
    file.map(Path::to_path_buf)
        .unwrap_or_else(|| state_dir.join(FAULTS_FILE))
}

/// Why a record could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("no record at {0} (is the agent running?)")]
    Missing(String),
    #[error("cannot read {0}: {1}")]
    Io(String, String),
    #[error("{0} is not a faultline record: {1}")]
    Invalid(String, String),
}

/// Largest record file read: the agent's own record is far smaller (a ConfigMap holds it in
/// 1 MiB); the cap keeps a file put in its place from exhausting the reader.
pub const MAX_RECORD_BYTES: u64 = 32 << 20;

/// Reads a record file: a regular file of at most [`MAX_RECORD_BYTES`], opened without blocking
/// (the agent reads it back at every start; a FIFO or `/dev/zero` there is refused, not read).
pub fn read_record(path: &Path) -> Result<NodeRecord, ReadError> {
    use crate::operator_file::{read_bytes, OperatorFileError};
    let p = path.display().to_string();
    let bytes = read_bytes(path, MAX_RECORD_BYTES).map_err(|e| match e {
        OperatorFileError::Io(e) if e.kind() == std::io::ErrorKind::NotFound => {
            ReadError::Missing(p.clone())
        }
        e => ReadError::Io(p.clone(), e.to_string()),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ReadError::Invalid(p, e.to_string()))
}

/// A one-line account of a record's verdict.
pub fn summary(r: &NodeRecord) -> String {
    let active: Vec<String> = r
        .faults
        .iter()
        .filter(|f| f.active)
        .take(3)
        .map(|f| format!("{} on {} ({})", f.fault_code, f.device, f.fault_handling))
        .collect();
    let n = r.faults.iter().filter(|f| f.active).count();
    let mut s = format!("node {} is {}", r.node, r.health);
    if !active.is_empty() {
        let _ = write!(s, ": {}", active.join("; "));
        if n > active.len() {
            let _ = write!(s, "; and {} more", n - active.len());
        }
    }
    s
}

/// Renders a record as a table.
pub fn table(r: &NodeRecord, all: bool) -> String {
    let mut out = String::new();
    let handling = r
        .handling
        .map(|h| h.to_string())
        .unwrap_or_else(|| "-".into());
    let rows = vec![
        vec![
            "NODE".to_string(),
            "HEALTH".into(),
            "HANDLING".into(),
            "UPDATED".into(),
        ],
        vec![
            r.node.clone(),
            r.health.to_string(),
            handling,
            r.update_time.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        ],
    ];
    out.push_str(&columns(&rows));
    let faults: Vec<_> = r.faults.iter().filter(|f| all || f.active).collect();
    if faults.is_empty() {
        out.push_str("\nno active faults\n");
    } else {
        out.push('\n');
        let mut rows = vec![[
            "CODE",
            "TYPE",
            "HANDLING",
            "DEVICE",
            "COUNT",
            "LAST SEEN",
            "STATE",
            "MESSAGE",
        ]
        .map(String::from)
        .to_vec()];
        for f in faults {
            let mut msg: String = f.message.chars().take(60).collect();
            if f.message.chars().count() > 60 {
                msg.push('…');
            }
            rows.push(vec![
                f.fault_code.clone(),
                f.fault_type.to_string(),
                f.fault_handling.to_string(),
                f.device.clone(),
                f.count.to_string(),
                f.last_seen.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
                if f.active {
                    "active".into()
                } else {
                    "recovered".into()
                },
                msg,
            ]);
        }
        out.push_str(&columns(&rows));
    }
    if let Some(e) = &r.agent.policy.error {
        let _ = writeln!(
            out,
            "\nwarning: the newest policy was rejected (the previous one is in force): {e}"
        );
    }
    if let Some(path) = &r.agent.policy.loading {
        let _ = writeln!(
            out,
            "\nwarning: the policy file {path} is still being read; the built-in policy is in force"
        );
    }
    for d in r.agent.detectors.iter() {
        // Down, or not watching yet (a kernel-log FIFO without a writer): nothing is detected.
        let what = match d.state.as_str() {
            "Down" => "is down",
            "Starting" => "is not watching yet",
            _ => continue,
        };
        let _ = writeln!(
            out,
            "warning: detector {} {what}: {}",
            d.name,
            d.reason.as_deref().unwrap_or("unknown reason")
        );
    }
    out
}

/// `faultline get`.
pub fn get(path: &Path, json: bool, all: bool) -> Outcome {
    match read_record(path) {
        Ok(r) if json => Outcome::ok(serde_json::to_string_pretty(&r).unwrap_or_default()),
        Ok(r) => Outcome::ok(table(&r, all).trim_end().to_string()),
        Err(e) => Outcome::error(format!("error: {e}")),
    }
}

/// Why a record does not show a live agent (docs/record.md, "Alive"): its heartbeat is missing
/// or older than `stale_after` at `now`. A heartbeat in the future (the clock stepped back)
/// counts as fresh.
pub fn not_alive(r: &NodeRecord, now: Timestamp, stale_after: Duration) -> Option<String> {
    let Some(beat) = r.agent.heartbeat_time else {
        return Some("the record has no heartbeat (not written by a running agent)".into());
    };
    let age = since(now, beat);
    (age > signed(stale_after)).then(|| {
        format!(
            "the agent is not alive: its last heartbeat is {}s old (stale after {}); is the agent running?",
            age.as_secs(),
            humantime::format_duration(stale_after)
        )
    })
}

/// `faultline wait-healthy`: polls the record until it is healthy (0), the timeout passes
/// while it is not (1), or it cannot be read at all (2). A record whose agent is not alive
/// (a stale heartbeat) is polled like a missing one, since an agent being restarted beats again
/// within seconds; still not alive at the timeout is 2, whatever the record says.
pub fn wait_healthy(
    path: &Path,
    timeout: Duration,
    interval: Duration,
    accept: Accept,
    stale_after: Duration,
) -> Outcome {
    let deadline = Instant::now() + timeout;
    loop {
        let last = read_record(path);
        let mut dead = None;
        match &last {
            Ok(r) => match not_alive(r, Timestamp::now(), stale_after) {
                Some(why) => dead = Some(why),
                None if accept.accepts(r) => {
                    let msg = format!("healthy: {}", summary(r));
                    let data = verdict_json("healthy", 0, &msg, Some(r));
                    return Outcome::ok(msg).with_data(data);
                }
                None => {}
            },
            Err(e @ ReadError::Invalid(..)) => return Outcome::error(format!("error: {e}")),
            _ => {}
        }
        if Instant::now() >= deadline {
            return match (last, dead) {
                (_, Some(why)) => Outcome::error(format!("error: {why}")),
                (Ok(r), None) => {
                    let msg = format!(
                        "unhealthy after {}: {}",
                        humantime::format_duration(timeout),
                        summary(&r)
                    );
                    let data = verdict_json("unhealthy", 1, &msg, Some(&r));
                    Outcome::unhealthy(msg).with_data(data)
                }
                (Err(e), None) => Outcome::error(format!("error: {e}")),
            };
        }
        std::thread::sleep(
            interval
                .min(deadline.saturating_duration_since(Instant::now()))
                .max(Duration::from_millis(1)),
        );
    }
}

/// `wait-healthy -o json`: the result, the exit code, the line a person reads, and the
/// record's node, health and most severe handling.
fn verdict_json(result: &str, code: u8, message: &str, r: Option<&NodeRecord>) -> Value {
    json!({
        "result": result,
        "exitCode": code,
        "message": message,
        "node": r.map(|r| r.node.as_str()),
        "health": r.map(|r| r.health.as_str()),
        "handling": r.and_then(|r| r.handling).map(|h| h.as_str()),
    })
}

/// `faultline clear`: asks the agent to clear faults, and waits until it has taken the request.
pub fn clear(
    state_dir: &Path,
    code: Option<String>,
    device: Option<String>,
    wait: Duration,
) -> Outcome {
    let dir = state_dir.join(CLEAR_DIR);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return Outcome::error(format!("error: cannot create {}: {e}", dir.display()));
    }
    let req = ClearRequest { code, device };
    let name = format!(
        "{}-{}.json",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
        std::process::id()
    );
    let path = dir.join(&name);
    let body = serde_json::to_vec(&req).unwrap_or_default();
    if let Err(e) = write_atomic(&path, &body) {
        return Outcome::error(format!("error: {e}"));
    }
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        // Taken (renamed `*.applying`) and then removed once the clear is on the agent's disk.
        if is_rejected(&dir, &name) {
            return Outcome::error(format!(
                "error: the agent rejected the request (its log says why): {}",
                path.display()
            ));
        }
        if !is_pending(&dir, &name) {
            let data = json!({
                "result": "cleared",
                "exitCode": 0,
                "code": req.code,
                "device": req.device,
            });
            return Outcome::ok(format!(
                "cleared {} on {}",
                req.code.as_deref().unwrap_or("all faults"),
                req.device.as_deref().unwrap_or("every device")
            ))
            .with_data(data);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Outcome::error(format!(
        "error: the agent did not take {} within {} (is it running?)",
        path.display(),
        humantime::format_duration(wait)
    ))
}

#[cfg(test)]
mod tests {
    use super::super::test_records::{HEALTHY, UNHEALTHY};
    use super::*;
    use crate::sink::file::STALE_AFTER;

    fn file(body: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("faults.json");
        std::fs::write(&p, body).unwrap();
        (d, p)
    }

    /// The record file is read back by the agent at every start, and by the CLI: whatever sits
    /// in its place is refused at once with the reason, never waited on (a FIFO with no
    /// writer) or read whole (`/dev/zero`, a huge file).
    #[test]
    fn a_record_file_that_is_not_one_is_refused_without_being_read() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo.json");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let zero = d.path().join("zero.json");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let huge = d.path().join("huge.json");
        std::fs::File::create(&huge)
            .unwrap()
            .set_len(MAX_RECORD_BYTES + 1)
            .unwrap();
        for (path, why) in [
            (&fifo, "not a regular file"),
            (&zero, "not a regular file"),
            (&huge, "larger than"),
        ] {
            let e = read_record(path).unwrap_err();
            assert!(
                matches!(&e, ReadError::Io(_, m) if m.contains(why)),
                "{}: {e}",
                path.display()
            );
        }
        assert!(matches!(
            read_record(&d.path().join("none.json")),
            Err(ReadError::Missing(_))
        ));
    }

    /// A record as a live agent writes it: with a heartbeat of now.
    fn live(body: &str) -> String {
        stamped(body, Some(Timestamp::now()))
    }

    fn stamped(body: &str, beat: Option<Timestamp>) -> String {
        let mut r: NodeRecord = serde_json::from_str(body).unwrap();
        r.agent.heartbeat_time = beat;
        serde_json::to_string(&r).unwrap()
    }

    /// A Healthy record left by a stopped agent no longer passes: without a heartbeat, or with
    /// one older than the bound, it is exit 2 at the timeout with one line saying why. A
    /// heartbeat ahead of the clock (stepped back) counts as fresh.
    #[test]
    fn wait_healthy_fails_when_the_agent_is_not_alive() {
        let minutes_ago = Timestamp::now() - faultline_core::time::SignedDuration::from_secs(120);
        let ahead = Timestamp::now() + faultline_core::time::SignedDuration::from_secs(3600);
        for (beat, code, says) in [
            (None, 2, "no heartbeat"),
            (
                Some(minutes_ago),
                2,
                "is not alive: its last heartbeat is 12",
            ),
            (Some(ahead), 0, "healthy"),
        ] {
            let (_d, p) = file(&stamped(HEALTHY, beat));
            let o = wait(&p, Duration::from_millis(100), STALE_AFTER);
            assert_eq!(o.code, code, "{beat:?}: {}", o.message);
            assert!(o.message.contains(says), "{}", o.message);
            assert!(!o.message.contains('\n'), "one line");
        }
        let (_d, p) = file(&stamped(HEALTHY, Some(minutes_ago)));
        let o = wait(&p, Duration::from_millis(50), Duration::from_secs(600));
        assert_eq!(o.code, 0, "within a longer bound: {}", o.message);

        // An agent restarting: the stale record is polled, and passes once it beats again.
        let (_d, p) = file(&stamped(HEALTHY, Some(minutes_ago)));
        let p2 = p.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            write_atomic(&p2, live(HEALTHY).as_bytes()).unwrap();
        });
        let o = wait(&p, Duration::from_secs(30), STALE_AFTER);
        writer.join().unwrap();
        assert_eq!(o.code, 0, "{}", o.message);
    }

    /// `wait_healthy` polling every 10 ms, Healthy only.
    fn wait(p: &Path, timeout: Duration, stale_after: Duration) -> Outcome {
        wait_healthy(
            p,
            timeout,
            Duration::from_millis(10),
            Accept::HEALTHY,
            stale_after,
        )
    }

    #[test]
    fn wait_healthy_exit_codes() {
        let (_d, p) = file(&live(HEALTHY));
        assert_eq!(wait(&p, Duration::from_millis(50), STALE_AFTER).code, 0);
        let (_d, p) = file(&live(UNHEALTHY));
        let o = wait(&p, Duration::from_millis(50), STALE_AFTER);
        assert_eq!(o.code, 1);
        assert!(o.message.contains("Xid79 on GPU-3"), "{}", o.message);
        assert!(!o.message.contains('\n'), "one line");
        let o = wait(
            Path::new("/nonexistent/faults.json"),
            Duration::from_millis(30),
            STALE_AFTER,
        );
        assert_eq!(o.code, 2);
        assert!(o.message.contains("is the agent running"), "{}", o.message);
        let (_d, p) = file("{\"not\": \"a record\"}");
        let o = wait(&p, Duration::from_secs(60), STALE_AFTER);
        assert_eq!(o.code, 2, "a foreign file fails at once: {}", o.message);
    }

    #[test]
    fn wait_healthy_sees_recovery_before_the_timeout() {
        let (_d, p) = file(&live(UNHEALTHY));
        let p2 = p.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            write_atomic(&p2, live(HEALTHY).as_bytes()).unwrap();
        });
        let o = wait_healthy(
            &p,
            Duration::from_secs(30),
            Duration::from_millis(20),
            Accept::HEALTHY,
            STALE_AFTER,
        );
        writer.join().unwrap();
        assert_eq!(o.code, 0, "{}", o.message);
    }

    #[test]
    fn table_shows_faults_and_warnings() {
        let (_d, p) = file(UNHEALTHY);
        let o = get(&p, false, false);
        assert_eq!(o.code, 0);
        assert!(
            o.message.contains("Xid79")
                && o.message.contains("GPU-3")
                && o.message.contains("SeparateNPU"),
            "{}",
            o.message
        );
        assert!(o.message.contains("policy was rejected"), "{}", o.message);
        assert!(o.message.contains("detector kmsg is down"), "{}", o.message);
        let starting = UNHEALTHY.replace(
            r#""state":"Down","reason":"cannot open""#,
            r#""state":"Starting","reason":"waiting for a writer""#,
        );
        let (_d2, p2) = file(&starting);
        let o = get(&p2, false, false);
        assert!(
            o.message
                .contains("detector kmsg is not watching yet: waiting for a writer"),
            "{}",
            o.message
        );
        let j = get(&p, true, false);
        let back: NodeRecord = serde_json::from_str(&j.message).unwrap();
        assert_eq!(back.faults.len(), 1);
    }

    #[test]
    fn clear_times_out_without_an_agent() {
        let d = tempfile::tempdir().unwrap();
        let o = clear(
            d.path(),
            Some("Xid79".into()),
            None,
            Duration::from_millis(50),
        );
        assert_eq!(o.code, 2);
        let left: Vec<_> = std::fs::read_dir(d.path().join(CLEAR_DIR))
            .unwrap()
            .collect();
        assert_eq!(
            left.len(),
            1,
            "the request stays for the agent to take later"
        );
    }
}
