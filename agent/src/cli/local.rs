//! This node's record: `faultline get`, `wait-healthy` and `clear`, reading the local file and
//! writing clear requests for the agent.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use faultline_core::record::{BootClock, NodeRecord};
use faultline_core::time::{signed, since, SignedDuration, Timestamp};
use serde_json::{json, Value};

use super::{columns, Accept, Outcome};
use crate::atomic_file::write as write_atomic;
use crate::clear::ClearResult;
use crate::clock::{Clock, SystemClock};
use crate::sink::file::FAULTS_FILE;
use crate::source::control::{
    is_pending, is_rejected, is_taken, parse_request, read_result, remove_result, withdraw,
    ClearRequest, CLEAR_DIR,
};

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

/// `faultline get`: the record, and when the agent behind it is not alive (docs/record.md,
/// "Alive") a warning on stderr, a `notAlive` field in the JSON and exit 3: the verdict may be
/// out of date, so a script must not take it for the node's state.
pub fn get(path: &Path, json: bool, all: bool, now: &Now, stale_after: Duration) -> Outcome {
    let r = match read_record(path) {
        Ok(r) => r,
        Err(e) => return Outcome::error(format!("error: {e}")),
    };
    let dead = not_alive(&r, now, stale_after);
    let message = if json {
        let mut doc = serde_json::to_value(&r).unwrap_or_default();
        if let (Some(why), Some(obj)) = (&dead, doc.as_object_mut()) {
            obj.insert(NOT_ALIVE_FIELD.into(), Value::String(why.clone()));
        }
        serde_json::to_string_pretty(&doc).unwrap_or_default()
    } else {
        table(&r, all).trim_end().to_string()
    };
    match dead {
        None => Outcome::ok(message),
        Some(why) => Outcome {
            warning: Some(format!(
                "warning: {why} (the record below may be out of date)"
            )),
            ..Outcome::new(NOT_ALIVE_EXIT, message)
        },
    }
}

/// `faultline get`'s exit status when it printed a record whose agent is not alive.
pub const NOT_ALIVE_EXIT: u8 = 3;
/// The field `faultline get -o json` adds to the record when its agent is not alive: why.
pub const NOT_ALIVE_FIELD: &str = "notAlive";

/// The reader's clocks at one moment, to judge a heartbeat by (docs/record.md, "Alive").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Now {
    pub wall: Timestamp,
    /// The boot clock, when the reader is on the node that wrote the record and can read the
    /// boot id; `None` otherwise (a record fetched from another node).
    pub boot: Option<BootClock>,
    /// How far ahead of `wall` a heartbeat may be dated and still count.
    pub ahead: Duration,
}

/// How far a heartbeat judged by the wall clock may be dated ahead of the reader's clock on the
/// same node: the agent and the reader read one clock, so anything more means the clock was
/// stepped back since the heartbeat, which then proves nothing about the agent running now.
pub const AHEAD_TOLERANCE: Duration = Duration::from_secs(5);

impl Now {
    /// A reader on this node, on `clock`.
    pub fn read(clock: &dyn Clock) -> Now {
        Now {
            wall: clock.now(),
            boot: clock.boot_clock(),
            ahead: AHEAD_TOLERANCE,
        }
    }

    /// A reader of a record from another node, at `wall`: its clock may be off from this one
    /// either way by as much as `tolerance`.
    pub(crate) fn remote(wall: Timestamp, tolerance: Duration) -> Now {
        Now {
            wall,
            boot: None,
            ahead: tolerance,
        }
    }
}

/// Why a record does not show a live agent (docs/record.md, "Alive"): its heartbeat is missing,
/// older than `stale_after`, or dated ahead of now. On the node that wrote it, with both boot
/// clock readings at hand, the age is measured on the boot clock, which no wall-clock step
/// moves, and a heartbeat of another boot is not alive; otherwise on the wall clock.
pub fn not_alive(r: &NodeRecord, now: &Now, stale_after: Duration) -> Option<String> {
    let Some(beat) = r.agent.heartbeat_time else {
        return Some("the record has no heartbeat (not written by a running agent)".into());
    };
    let (age, clock) = match (&r.agent.heartbeat_boot, &now.boot) {
        (Some(then), Some(at)) if then.boot_id != at.boot_id => {
            return Some(format!(
                "the agent is not alive: its last heartbeat was written in another boot (boot id {}); is the agent running?",
                then.boot_id
            ))
        }
        (Some(then), Some(at)) => {
            let ms = i128::from(at.since_boot_ms) - i128::from(then.since_boot_ms);
            let ms = i64::try_from(ms).unwrap_or(i64::MIN);
            (SignedDuration::from_millis(ms), "this node's boot clock")
        }
        _ => (since(now.wall, beat), "this clock"),
    };
    if age > signed(stale_after) {
        return Some(format!(
            "the agent is not alive: its last heartbeat is {}s old (stale after {}); is the agent running?",
            age.as_secs(),
            humantime::format_duration(stale_after)
        ));
    }
    (-age > signed(now.ahead)).then(|| {
        format!(
            "the agent is not alive: its last heartbeat is dated {}s ahead of {clock} (the clock was stepped back since?); is the agent running?",
            (-age).as_secs()
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
    clock: &dyn Clock,
) -> Outcome {
    let deadline = clock.instant() + timeout;
    loop {
        // The answer should the time be up now.
        let answer = match read_record(path) {
            Err(e @ ReadError::Invalid(..)) => return Outcome::error(format!("error: {e}")),
            Err(e) => Outcome::error(format!("error: {e}")),
            Ok(r) => match not_alive(&r, &Now::read(clock), stale_after) {
                Some(why) => Outcome::error(format!("error: {why}")),
                None if accept.accepts(&r) => {
                    let msg = format!("healthy: {}", summary(&r));
                    let data = verdict_json("healthy", 0, &msg, &r);
                    return Outcome::ok(msg).with_data(data);
                }
                None => {
                    let msg = format!(
                        "unhealthy after {}: {}",
                        humantime::format_duration(timeout),
                        summary(&r)
                    );
                    let data = verdict_json("unhealthy", 1, &msg, &r);
                    Outcome::unhealthy(msg).with_data(data)
                }
            },
        };
        if clock.instant() >= deadline {
            return answer;
        }
        std::thread::sleep(
            interval
                .min(deadline.saturating_duration_since(clock.instant()))
                .max(Duration::from_millis(1)),
        );
    }
}

/// `wait-healthy -o json`: the result, the exit code, the line a person reads, and the
/// record's node, health and most severe handling.
fn verdict_json(result: &str, code: u8, message: &str, r: &NodeRecord) -> Value {
    json!({
        "result": result,
        "exitCode": code,
        "message": message,
        "node": r.node,
        "health": r.health.as_str(),
        "handling": r.handling.map(|h| h.as_str()),
    })
}

/// After `--wait`, how much longer `faultline clear` waits for the answer to a request the agent
/// turns out to have taken (it could not be withdrawn): the answer follows the save, which takes
/// milliseconds unless the state cannot be written.
const TAKEN_GRACE: Duration = Duration::from_secs(2);

/// `faultline clear`: asks the agent to clear faults, waits for its answer, and says how many
/// faults it cleared: 0 some, 1 none matched (the message names the active faults), 2 refused or
/// not answered within `wait`.
pub fn clear(
    state_dir: &Path,
    code: Option<String>,
    device: Option<String>,
    wait: Duration,
) -> Outcome {
    let req = ClearRequest { code, device };
    let body = serde_json::to_vec(&req).unwrap_or_default();
    // What the agent would refuse is refused here, with the reason, before anything is written.
    if let Err(e) = parse_request(&body) {
        return Outcome::error(format!("error: the agent would reject this request: {e}"));
    }
    let dir = state_dir.join(CLEAR_DIR);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return Outcome::error(format!("error: cannot create {}: {e}", dir.display()));
    }
    let clock = SystemClock;
    let name = format!(
        "{}-{}.json",
        clock.now().as_nanosecond().max(0),
        std::process::id()
    );
    let path = dir.join(&name);
    if let Err(e) = write_atomic(&path, &body) {
        return Outcome::error(format!("error: {e}"));
    }
    let answered = || verdict(state_dir, &dir, &name, &req);
    let deadline = clock.instant() + wait;
    while clock.instant() < deadline {
        // The agent answers (`*.done`) once the clear is on its disk, and removes the request
        // after: the answer is looked for after the request is seen gone, so it is never missed.
        let pending = is_pending(&dir, &name);
        if let Some(o) = answered() {
            return o;
        }
        if !pending {
            let msg = "the agent applied the request but could not write its answer saying \
                       what it cleared (its log says why); faultline get shows what is active";
            let data = clear_json("applied", 0, msg, &req, None);
            return Outcome::ok(msg).with_data(data);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let waited = humantime::format_duration(wait);
    // Past the wait, a request the agent has not taken is withdrawn: left behind, it would clear
    // faults whenever an agent next started, long after this command said it did not.
    match withdraw(&dir, &name) {
        Ok(()) => Outcome::error(format!(
            "error: the agent did not take {} within {waited} (is it running?); the request is \
             withdrawn and will not be applied later",
            path.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // The agent took it first, maybe at the last moment: its answer follows as soon as
            // the clear is saved, so wait a little longer for it before saying anything.
            let grace = clock.instant() + TAKEN_GRACE;
            loop {
                if let Some(o) = answered() {
                    return o;
                }
                if clock.instant() >= grace {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if is_taken(&dir, &name) {
                Outcome::error(format!(
                    "error: the agent took the request but has not answered within {waited}: it \
                     answers once the clear is saved (if it cannot write its state, its log says \
                     why, and a restart before then applies the request again); faultline get \
                     shows what is active: {}",
                    dir.join(format!("{name}.applying")).display()
                ))
            } else {
                Outcome::error(format!(
                    "error: the request {} is gone without an answer (removed by hand?); \
                     faultline get shows what is active",
                    path.display()
                ))
            }
        }
        Err(e) => Outcome::error(format!(
            "error: the agent did not take {} within {waited} (is it running?), and the request \
             cannot be withdrawn ({e}): remove it, or an agent will apply it when it starts",
            path.display()
        )),
    }
}

/// The agent's verdict on the request `name` in `dir`, once it has given one: rejected, or its
/// answer (removed once read).
fn verdict(state_dir: &Path, dir: &Path, name: &str, req: &ClearRequest) -> Option<Outcome> {
    if is_rejected(dir, name) {
        return Some(Outcome::error(format!(
            "error: the agent rejected the request (its log says why): {}",
            dir.join(name).display()
        )));
    }
    Some(match read_result(dir, name)? {
        Ok(result) => {
            let _ = remove_result(dir, name);
            cleared(state_dir, req, &result)
        }
        Err(e) => Outcome::error(format!("error: cannot read the agent's answer: {e}")),
    })
}

/// The outcome of an answered clear: what it cleared, or, when nothing matched, what is active.
fn cleared(state_dir: &Path, req: &ClearRequest, result: &ClearResult) -> Outcome {
    if result.cleared > 0 {
        let n = usize::try_from(result.cleared).unwrap_or(usize::MAX);
        let faults = result.faults.iter().map(|f| (&f.code, &f.device));
        let msg = format!(
            "cleared {} {}: {}",
            result.cleared,
            if result.cleared == 1 {
                "fault"
            } else {
                "faults"
            },
            listed(faults, n)
        );
        let data = clear_json("cleared", 0, &msg, req, Some(result));
        return Outcome::ok(msg).with_data(data);
    }
    let mut asked = Vec::new();
    if let Some(c) = &req.code {
        asked.push(format!("--code {c}"));
    }
    if let Some(d) = &req.device {
        asked.push(format!("--device {d}"));
    }
    let asked = if asked.is_empty() {
        "the request".to_string()
    } else {
        asked.join(" ")
    };
    let now = match read_record(&state_dir.join(FAULTS_FILE)) {
        Ok(r) => {
            let active: Vec<_> = r.faults.iter().filter(|f| f.active).collect();
            if active.is_empty() {
                "the node has no active fault".to_string()
            } else {
                let faults = active.iter().map(|f| (&f.fault_code, &f.device));
                format!(
                    "active: {} (--device takes the DEVICE faultline get shows, a UUID or a PCI bus id)",
                    listed(faults, active.len())
                )
            }
        }
        Err(e) => format!("faultline get shows what is active ({e})"),
    };
    let msg = format!("nothing cleared: no active fault matches {asked}; {now}");
    let data = clear_json("nothingCleared", 1, &msg, req, Some(result));
    Outcome::unhealthy(msg).with_data(data)
}

/// Faults named in one line.
const MAX_SHOWN: usize = 5;

/// The first [`MAX_SHOWN`] of `total` faults (code, device) in one line, and how many more.
fn listed<'a>(faults: impl Iterator<Item = (&'a String, &'a String)>, total: usize) -> String {
    let shown: Vec<String> = faults
        .take(MAX_SHOWN)
        .map(|(code, device)| format!("{code} on {device}"))
        .collect();
    let mut s = shown.join(", ");
    if total > shown.len() {
        let _ = write!(s, " and {} more", total - shown.len());
    }
    s
}

/// `clear -o json`: the result, the exit code, the line a person reads, the request, and what
/// the agent cleared.
fn clear_json(
    result: &str,
    code: u8,
    message: &str,
    req: &ClearRequest,
    r: Option<&ClearResult>,
) -> Value {
    json!({
        "result": result,
        "exitCode": code,
        "message": message,
        "code": req.code,
        "device": req.device,
        "cleared": r.map(|r| r.cleared),
        "faults": r.map(|r| &r.faults),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::super::test_records::{HEALTHY, UNHEALTHY};
    use super::*;
    use crate::clear::ClearResult;
    use crate::clock::testing::FakeClock;
    use crate::clock::SystemClock;
    use crate::sink::file::{Beat, STALE_AFTER};

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

    /// A Healthy record left by a stopped agent does not pass: without a heartbeat, with
    /// one older than the bound, or with one dated ahead of the clock (written before the clock
    /// was stepped back), it is exit 2 at the timeout with one line saying why. These records
    /// carry no boot clock reading: the wall clock judges them.
    #[test]
    fn wait_healthy_fails_when_the_agent_is_not_alive() {
        let minutes_ago = Timestamp::now() - SignedDuration::from_secs(120);
        let ahead = Timestamp::now() + SignedDuration::from_secs(3600);
        let just_ahead = Timestamp::now() + SignedDuration::from_secs(2);
        for (beat, code, says) in [
            (None, 2, "no heartbeat"),
            (
                Some(minutes_ago),
                2,
                "is not alive: its last heartbeat is 12",
            ),
            (Some(ahead), 2, "s ahead of this clock"),
            (Some(just_ahead), 0, "healthy"),
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
            &SystemClock,
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
            &SystemClock,
        );
        writer.join().unwrap();
        assert_eq!(o.code, 0, "{}", o.message);
    }

    #[test]
    fn table_shows_faults_and_warnings() {
        let (_d, p) = file(&live(UNHEALTHY));
        let o = get(&p, false, false, &Now::read(&SystemClock), STALE_AFTER);
        assert_eq!(o.code, 0);
        assert_eq!(o.warning, None);
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
        let o = get(&p2, false, false, &Now::read(&SystemClock), STALE_AFTER);
        assert!(
            o.message
                .contains("detector kmsg is not watching yet: waiting for a writer"),
            "{}",
            o.message
        );
        let j = get(&p, true, false, &Now::read(&SystemClock), STALE_AFTER);
        let back: NodeRecord = serde_json::from_str(&j.message).unwrap();
        assert_eq!(back.faults.len(), 1);
    }

    const DAY: i64 = 86_400;

    /// The agent writes its heartbeat on `clock` into a record in `dir`, as the file sink does.
    fn beat(dir: &Path, clock: &FakeClock) -> PathBuf {
        let dirs = crate::sink::file::Dirs::one(dir.to_path_buf());
        let snap = crate::engine_loop::test_snapshot(1, 0);
        crate::sink::file::write_snapshot(
            &dirs,
            &snap,
            &Beat::now(clock),
            false,
            crate::sink::file::Order::StateFirst,
        )
        .unwrap();
        dir.join(FAULTS_FILE)
    }

    /// An agent killed (SIGKILL) while its node's clock was a day off, then the clock is
    /// corrected: its record is not alive for `wait-healthy` (exit 2) or `get` (exit 3 with a
    /// warning), whichever way the clock was off: a heartbeat dated a day ahead does not count
    /// as fresh for that day.
    #[test]
    fn a_dead_agent_is_not_alive_whichever_way_the_clock_stepped() {
        for step in [DAY, -DAY] {
            let d = tempfile::tempdir().unwrap();
            let clock = FakeClock::new(1_790_000_000_000, 600_000);
            clock.step_wall(step);
            let p = beat(d.path(), &clock);
            // Killed; a minute later the clock is stepped back to the right time.
            clock.advance(Duration::from_secs(60));
            clock.step_wall(-step);
            let o = wait_healthy(
                &p,
                Duration::from_millis(30),
                Duration::from_millis(10),
                Accept::HEALTHY,
                STALE_AFTER,
                &clock,
            );
            assert_eq!(o.code, 2, "{step}: {}", o.message);
            assert!(
                o.message
                    .contains("not alive: its last heartbeat is 60s old"),
                "{step}: {}",
                o.message
            );
            let o = get(&p, false, false, &Now::read(&clock), STALE_AFTER);
            assert_eq!(o.code, NOT_ALIVE_EXIT, "{step}");
            assert!(
                o.message.contains("NODE"),
                "the record is printed: {}",
                o.message
            );
            assert!(
                o.warning
                    .as_deref()
                    .is_some_and(|w| w.contains("not alive")),
                "{:?}",
                o.warning
            );
            let j = get(&p, true, false, &Now::read(&clock), STALE_AFTER);
            assert_eq!(j.code, NOT_ALIVE_EXIT);
            let doc: Value = serde_json::from_str(&j.message).unwrap();
            assert!(doc[NOT_ALIVE_FIELD].as_str().unwrap().contains("60s old"));
            assert_eq!(doc["health"], "Healthy", "still the record");
        }
    }

    /// A live agent stays alive for its readers across a step of the wall clock either way:
    /// just after the step (the heartbeat on disk was stamped before it) and after the next
    /// heartbeat: a forward step does not make it look dead until its next heartbeat.
    #[test]
    fn a_live_agent_stays_alive_across_a_clock_step() {
        for step in [DAY, -DAY] {
            let d = tempfile::tempdir().unwrap();
            let clock = FakeClock::new(1_790_000_000_000, 600_000);
            let p = beat(d.path(), &clock);
            clock.advance(Duration::from_secs(5));
            clock.step_wall(step);
            let r = read_record(&p).unwrap();
            assert_eq!(
                not_alive(&r, &Now::read(&clock), STALE_AFTER),
                None,
                "{step}"
            );
            let o = wait_healthy(
                &p,
                Duration::from_millis(30),
                Duration::from_millis(10),
                Accept::HEALTHY,
                STALE_AFTER,
                &clock,
            );
            assert_eq!(o.code, 0, "{step}: {}", o.message);
            clock.advance(Duration::from_secs(5));
            beat(d.path(), &clock);
            clock.advance(Duration::from_secs(29));
            let o = get(&p, false, false, &Now::read(&clock), STALE_AFTER);
            assert_eq!((o.code, o.warning), (0, None), "{step}");
            clock.advance(Duration::from_secs(2));
            let r = read_record(&p).unwrap();
            assert!(
                not_alive(&r, &Now::read(&clock), STALE_AFTER)
                    .is_some_and(|w| w.contains("31s old")),
                "then it stops beating"
            );
        }
    }

    /// The boot clock decides when both sides have it: a heartbeat of another boot is not
    /// alive (whatever its wall time), a heartbeat ahead of this boot's clock is not alive; a
    /// record without a boot clock reading (or a reader that cannot read the boot id) falls
    /// back to the wall clock, ahead by at most [`AHEAD_TOLERANCE`].
    #[test]
    fn the_boot_clock_judges_when_both_sides_have_it() {
        let d = tempfile::tempdir().unwrap();
        let clock = FakeClock::new(1_790_000_000_000, 600_000);
        let p = beat(d.path(), &clock);
        let r = read_record(&p).unwrap();
        assert_eq!(
            r.agent.heartbeat_boot,
            Some(BootClock {
                boot_id: "boot-1".into(),
                since_boot_ms: 600_000
            })
        );
        let now = |c: &FakeClock| not_alive(&r, &Now::read(c), STALE_AFTER);
        clock.advance(Duration::from_secs(60));
        clock.reboot(Some("boot-2"), 60_000);
        assert!(now(&clock).is_some_and(|w| w.contains("another boot (boot id boot-1)")));
        // The reader cannot read the boot id: the wall clock (a minute later) judges.
        clock.reboot(None, 60_000);
        assert!(now(&clock).is_some_and(|w| w.contains("60s old")));
        // The same boot, but the record's reading is later than this boot's clock.
        clock.reboot(Some("boot-1"), 590_000);
        assert!(now(&clock).is_some_and(|w| w.contains("10s ahead of this node's boot clock")));
        clock.reboot(Some("boot-1"), 600_000 + 30_000);
        assert_eq!(now(&clock), None, "30 s old: alive");

        let mut no_boot = r.clone();
        no_boot.agent.heartbeat_boot = None;
        let at = |secs: i64| {
            Now::remote(
                r.agent.heartbeat_time.unwrap() + SignedDuration::from_secs(secs),
                AHEAD_TOLERANCE,
            )
        };
        assert_eq!(not_alive(&no_boot, &at(-5), STALE_AFTER), None);
        assert!(not_alive(&no_boot, &at(-6), STALE_AFTER)
            .is_some_and(|w| w.contains("6s ahead of this clock")));
        assert_eq!(not_alive(&no_boot, &at(30), STALE_AFTER), None);
        assert!(not_alive(&no_boot, &at(31), STALE_AFTER).is_some());
    }

    /// Without an agent, the request is withdrawn when the wait is over: left behind, it would
    /// clear faults whenever an agent next started, after this command said it did not.
    #[test]
    fn clear_times_out_without_an_agent_and_withdraws_the_request() {
        let d = tempfile::tempdir().unwrap();
        let o = clear(
            d.path(),
            Some("Xid79".into()),
            None,
            Duration::from_millis(50),
        );
        assert_eq!(o.code, 2);
        assert!(
            o.message.contains("did not take") && o.message.contains("withdrawn"),
            "{}",
            o.message
        );
        let left: Vec<_> = std::fs::read_dir(d.path().join(CLEAR_DIR))
            .unwrap()
            .collect();
        assert!(left.is_empty(), "withdrawn: {left:?}");
    }

    /// An agent that took the request but cannot save the clear (a full or read-only data
    /// directory) is said to have taken it, not to be absent; the request stays with it.
    #[test]
    fn clear_taken_but_not_saved_says_so() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(CLEAR_DIR);
        let taker = {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let name = next_request(&dir);
                std::fs::rename(dir.join(&name), dir.join(format!("{name}.applying"))).unwrap();
            })
        };
        let o = clear(d.path(), None, None, Duration::from_millis(500));
        taker.join().unwrap();
        assert_eq!(o.code, 2);
        assert!(
            o.message.contains("took the request") && o.message.contains("not answered"),
            "{}",
            o.message
        );
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            left.len() == 1 && left[0].ends_with(".json.applying"),
            "{left:?}"
        );
    }

    /// A request the agent takes just before the wait ends is not withdrawn; its answer, which
    /// follows the save, is waited for and reported.
    #[test]
    fn clear_taken_at_the_deadline_reports_the_answer() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(FAULTS_FILE), UNHEALTHY).unwrap();
        let dir = d.path().join(CLEAR_DIR);
        let slow = {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let name = next_request(&dir);
                let taken = dir.join(format!("{name}.applying"));
                std::fs::rename(dir.join(&name), &taken).unwrap();
                // Saved well after the CLI's wait is over.
                std::thread::sleep(Duration::from_millis(600));
                let result = ClearResult {
                    cleared: 1,
                    faults: vec![crate::clear::ClearedFault {
                        code: "Xid79".into(),
                        device: "GPU-3".into(),
                    }],
                };
                let done = dir.join(format!("{name}.done"));
                write_atomic(&done, &serde_json::to_vec(&result).unwrap()).unwrap();
                std::fs::remove_file(taken).unwrap();
            })
        };
        let o = clear(
            d.path(),
            Some("Xid79".into()),
            None,
            Duration::from_millis(200),
        );
        slow.join().unwrap();
        assert_eq!(o.code, 0, "{}", o.message);
        assert_eq!(o.message, "cleared 1 fault: Xid79 on GPU-3");
    }

    /// A stand-in agent: takes the one request that appears in `state/clear.d`, and answers it
    /// with `result` (`None`: removes it without an answer, as an agent that cannot write one does).
    fn fake_agent(state: &Path, result: Option<ClearResult>) -> std::thread::JoinHandle<String> {
        let dir = state.join(CLEAR_DIR);
        std::thread::spawn(move || {
            let name = next_request(&dir);
            let body = std::fs::read_to_string(dir.join(&name)).unwrap();
            if let Some(r) = &result {
                let done = dir.join(format!("{name}.done"));
                write_atomic(&done, &serde_json::to_vec(r).unwrap()).unwrap();
            }
            std::fs::remove_file(dir.join(&name)).unwrap();
            body
        })
    }

    /// Waits for a request (`*.json`) to appear in `dir`, as an agent polling `clear.d` does;
    /// its name.
    fn next_request(dir: &Path) -> String {
        loop {
            let found = std::fs::read_dir(dir).ok().and_then(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .find(|n| n.ends_with(".json"))
            });
            if let Some(name) = found {
                return name;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `clear` says how many faults the agent cleared and which; none is exit 1 with what is
    /// active (the names `--device` takes), never "cleared" for what did not match.
    #[test]
    fn clear_says_what_the_agent_cleared() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(FAULTS_FILE), UNHEALTHY).unwrap();
        let wait = Duration::from_secs(30);

        let none = fake_agent(d.path(), Some(ClearResult::default()));
        let o = clear(d.path(), Some("Xid999".into()), None, wait);
        assert_eq!(none.join().unwrap(), r#"{"code":"Xid999"}"#);
        assert_eq!(o.code, 1, "{}", o.message);
        assert!(
            o.message
                .starts_with("nothing cleared: no active fault matches --code Xid999;")
                && o.message.contains("active: Xid79 on GPU-3"),
            "{}",
            o.message
        );
        assert_eq!(o.data.as_ref().unwrap()["cleared"], 0);
        assert_eq!(o.data.as_ref().unwrap()["exitCode"], 1);

        let two = ClearResult {
            cleared: 2,
            faults: vec![
                crate::clear::ClearedFault {
                    code: "Xid79".into(),
                    device: "GPU-0000:3b:00.0".into(),
                },
                crate::clear::ClearedFault {
                    code: "Xid13".into(),
                    device: "GPU-0000:3b:00.0".into(),
                },
            ],
        };
        let agent = fake_agent(d.path(), Some(two));
        let o = clear(d.path(), None, Some("3b:00.0".into()), wait);
        assert_eq!(agent.join().unwrap(), r#"{"device":"3b:00.0"}"#);
        assert_eq!(o.code, 0, "{}", o.message);
        assert_eq!(
            o.message,
            "cleared 2 faults: Xid79 on GPU-0000:3b:00.0, Xid13 on GPU-0000:3b:00.0"
        );
        assert_eq!(o.data.as_ref().unwrap()["faults"][1]["code"], "Xid13");

        // An agent that removes the request without an answer (it could not write one).
        let old = fake_agent(d.path(), None);
        let o = clear(d.path(), Some("Xid79".into()), None, wait);
        old.join().unwrap();
        assert_eq!(o.code, 0, "{}", o.message);
        assert!(
            o.message.contains("could not write its answer"),
            "{}",
            o.message
        );

        let left: Vec<_> = std::fs::read_dir(d.path().join(CLEAR_DIR))
            .unwrap()
            .collect();
        assert!(left.is_empty(), "answers read are removed: {left:?}");
    }

    /// What the agent would refuse is refused before anything is written.
    #[test]
    fn clear_refuses_what_the_agent_would_reject() {
        let d = tempfile::tempdir().unwrap();
        for (code, device, says) in [(Some(""), None, "`code`"), (None, Some(" "), "`device`")] {
            let o = clear(
                d.path(),
                code.map(String::from),
                device.map(String::from),
                Duration::from_secs(30),
            );
            assert_eq!(o.code, 2);
            assert!(o.message.contains(says), "{}", o.message);
        }
        assert!(!d.path().join(CLEAR_DIR).exists(), "nothing written");
    }
}
