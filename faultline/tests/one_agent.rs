//! One agent per state: a second agent on the same directories exits at once, naming the
//! holder, and changes nothing; the lock goes with the process however it dies; a saved state
//! or record of another node is never restored into this node's.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::{fault, wait_until, xid79, Agent};

/// Every file under `dir` with its bytes and modification time.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>, SystemTime)> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let meta = std::fs::symlink_metadata(e.path()).unwrap();
            if meta.is_dir() {
                dirs.push(e.path());
            } else {
                let bytes = std::fs::read(e.path()).unwrap_or_default();
                out.push((e.path(), bytes, meta.modified().unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Starts a second agent binary on the given directories (its log apart from the first's).
fn second_agent(first: &Agent, state: &Path, data: &Path, log: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_faultline-agent"))
        .arg("--kmsg-path")
        .arg(&first.kmsg)
        .arg("--state-dir")
        .arg(state)
        .arg("--data-dir")
        .arg(data)
        .arg("--boot-id-path")
        .arg(&first.boot_id)
        // Another port: binding cannot be what stops it.
        .args(["--listen", "127.0.0.1:0", "--node-name", "node-a"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(log).unwrap()))
        .spawn()
        .unwrap()
}

/// Waits at most `limit` for `child` to exit; kills it and returns `None` if it does not.
fn exit_within(child: &mut Child, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st.code().unwrap_or(-1));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, sig).unwrap();
}

/// A second agent on the same directories (a replay run by mistake, a leftover unit, a second
/// DaemonSet), on another port, exits at once with a non-zero status and names the running one
/// (pid, node, start time); it changes no file in either directory. The same holds when only
/// the data directory or only the state directory is shared. The first goes on detecting, and
/// when it is SIGKILLed the lock goes with it: the next agent starts and restores its faults.
/// Before, the second agent rewrote `state.json` (a later kernel-log cursor: real faults were
/// then skipped) and two agents took turns writing `faults.json`.
#[test]
fn a_second_agent_exits_at_once_names_the_first_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = Agent::start(dir.path(), &[]);
    first.append(&xid79(1, "3b"));
    first.wait_for("the fault", |r| fault(r, "Xid79").is_some());
    wait_until("state.json", Duration::from_secs(30), || {
        first.data().join("state.json").is_file().then_some(())
    });
    first.addr();
    // Frozen, so that nothing the first agent writes on its own (a heartbeat) can pass for a
    // write of the second; it still holds the lock.
    signal(&first.child, rustix::process::Signal::STOP);
    let before = snapshot(dir.path());

    let other = tempfile::tempdir().unwrap();
    let (other_state, other_data) = (other.path().join("state"), other.path().join("data"));
    let cases = [
        ("both directories", first.state(), first.data()),
        ("the data directory", other_state, first.data()),
        ("the state directory", first.state(), other_data),
    ];
    for (what, state, data) in cases {
        let log = other.path().join("second.log");
        let mut second = second_agent(&first, &state, &data, &log);
        let code = exit_within(&mut second, Duration::from_secs(10));
        let said = std::fs::read_to_string(&log).unwrap();
        assert!(
            code.is_some_and(|c| c != 0),
            "{what}: a second agent must exit at once, non-zero: {code:?}\n{said}"
        );
        let holder = format!("pid {}, node node-a, started ", first.child.id());
        assert!(
            said.contains(&holder) && said.contains("agent.lock"),
            "{what}: {said}"
        );
        let after = snapshot(dir.path());
        assert!(before == after, "{what}: a file was changed or added");
    }

    // The first goes on.
    signal(&first.child, rustix::process::Signal::CONT);
    first.append(&xid79(2, "5e"));
    first.wait_for("the next fault", |r| {
        r.faults.iter().filter(|f| f.fault_code == "Xid79").count() == 2
    });
    wait_until("the state saved", Duration::from_secs(30), || {
        let s = std::fs::read_to_string(first.data().join("state.json")).ok()?;
        s.contains("5e").then_some(())
    });

    // Killed outright: the kernel releases the lock, and a restart works.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let since = faultline_core::time::Timestamp::now();
    let again = Agent::start(dir.path(), &[]);
    let r = again.wait_for("restarted with both faults", |r| {
        r.update_time > since
            && r.agent.detectors.iter().any(|d| d.name == "kmsg")
            && r.faults
                .iter()
                .filter(|f| f.fault_code == "Xid79" && f.active)
                .count()
                == 2
    });
    assert_eq!(r.node, "node-a");
    let log = again.log();
    assert_eq!(again.stop(), 0, "{log}");
}

/// The lock cannot be taken from the agent by another user, and a lock held by something else
/// is not blamed on a dead agent. The agent's lock files are 0600: after it is SIGKILLed, uid
/// 65534 cannot open them to take the lock (needs root and `setpriv`; skipped otherwise), where
/// before `flock -x agent.lock sleep infinity` as any user kept every later agent from starting.
/// When a process that is not an agent holds the lock (here this test, as root can) while the
/// file still names the dead agent's pid, the next agent exits non-zero and says the holder is
/// not an agent it can name, not "another faultline agent holds ... (pid N)". A data directory
/// others can write is refused at start.
#[test]
fn a_lock_held_by_another_process_is_not_blamed_on_a_dead_agent() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    // Reachable by other users, as /var/lib and /run are.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut first = Agent::start(dir.path(), &[]);
    first.addr();
    let lock = first.data().join("agent.lock");
    for d in [first.data(), first.state()] {
        let m = std::fs::metadata(d.join("agent.lock")).unwrap().mode() & 0o777;
        assert_eq!(m, 0o600, "{}", d.display());
    }
    let dead = first.child.id();
    first.child.kill().unwrap();
    first.child.wait().unwrap();

    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped another user's attempt: not root");
    } else if let Ok(out) = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["flock", "-n", "-x"])
        .arg(&lock)
        .arg("true")
        .output()
    {
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "uid 65534 took the free lock");
        assert!(said.contains("Permission denied"), "{said}");
    } else {
        eprintln!("skipped another user's attempt: no setpriv");
    }

    let held = std::fs::File::open(&lock).unwrap();
    rustix::fs::flock(&held, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    let other = tempfile::tempdir().unwrap();
    let log = other.path().join("second.log");
    let mut second = second_agent(&first, &first.state(), &first.data(), &log);
    let code = exit_within(&mut second, Duration::from_secs(10));
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(code.is_some_and(|c| c != 0), "{code:?}\n{said}");
    assert!(
        said.contains(&format!(
            "held by another process (not a faultline agent we can name: the file names pid \
             {dead}, which is not running it)"
        )),
        "{said}"
    );
    assert!(!said.contains("another faultline agent"), "{said}");
    drop(held);

    let open = other.path().join("data");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let log = other.path().join("third.log");
    let mut third = second_agent(&first, &other.path().join("state"), &open, &log);
    let code = exit_within(&mut third, Duration::from_secs(10));
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(code.is_some_and(|c| c != 0), "{code:?}\n{said}");
    assert!(
        said.contains("writable by its group or by others (mode 777)"),
        "{said}"
    );
    assert!(!open.join("agent.lock").exists());
}

/// The directories the agent creates are 0755 whatever the umask: under a user's usual 0002
/// they would be group-writable, and the agent would refuse the directories it made itself.
#[test]
fn the_directories_the_agent_creates_are_0755_under_any_umask() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (kmsg, state, data) = (
        dir.path().join("kmsg"),
        dir.path().join("a/state"),
        dir.path().join("b/data"),
    );
    std::fs::write(&kmsg, b"").unwrap();
    let log = dir.path().join("agent.log");
    let mut agent = Command::new("sh")
        .args(["-c", "umask 0002 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_faultline-agent"))
        .arg("--kmsg-path")
        .arg(&kmsg)
        .arg("--state-dir")
        .arg(&state)
        .arg("--data-dir")
        .arg(&data)
        .args(["--no-nvml", "--no-ascend", "--node-name", "node-a"])
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let started = wait_until("listen.addr", Duration::from_secs(30), || {
        if agent.try_wait().unwrap().is_some() {
            return Some(false);
        }
        state.join("listen.addr").is_file().then_some(true)
    });
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(started, "{}", std::fs::read_to_string(&log).unwrap());
    for d in [&state, &data, &dir.path().join("a"), &dir.path().join("b")] {
        let mode = std::fs::metadata(d).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o755, "{}", d.display());
    }
}

/// The README's first command on a machine whose default directories another agent (another
/// node's name) had used: its saved state is set aside as `state.json.node-<name>`, untouched,
/// with a message naming both nodes, and none of its faults enters this node's record (the
/// reported case restored another node's PEER_LINK_FAILED; any fault shows it). With no saved
/// state, the other node's `faults.json` is not rebuilt from either.
#[test]
fn a_saved_state_of_another_node_is_set_aside_not_merged() {
    let dir = tempfile::tempdir().unwrap();
    let other = Agent::start(dir.path(), &["--node-name", "node-b"]);
    other.append(&xid79(1, "3b"));
    other.wait_for("node-b's fault", |r| fault(r, "Xid79").is_some());
    let data = other.data();
    assert_eq!(other.stop(), 0);
    let theirs = std::fs::read(data.join("state.json")).unwrap();
    let since = faultline_core::time::Timestamp::now();
    // Nothing of node-b's left in the kernel log: only saved state could bring the fault back.
    std::fs::write(dir.path().join("kmsg"), b"").unwrap();

    let agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("this node's first record", |r| {
        r.node == "node-a"
            && r.update_time > since
            && r.agent.detectors.iter().any(|d| d.name == "kmsg")
    });
    assert!(r.faults.is_empty(), "merged: {:?}", r.faults);
    let log = agent.log();
    assert!(
        log.contains("saved state of node \"node-b\", not of this node \"node-a\"")
            && log.contains("set aside"),
        "{log}"
    );
    assert_eq!(
        std::fs::read(data.join("state.json.node-node-b")).unwrap(),
        theirs,
        "set aside untouched"
    );
    assert_eq!(agent.stop(), 0);

    // Only node-b's record is left (its saved state lost): not rebuilt from either.
    let dir = tempfile::tempdir().unwrap();
    let other = Agent::start(dir.path(), &["--node-name", "node-b"]);
    other.append(&xid79(1, "3b"));
    other.wait_for("node-b's fault", |r| fault(r, "Xid79").is_some());
    assert_eq!(other.stop(), 0);
    std::fs::remove_file(dir.path().join("data/state.json")).unwrap();
    std::fs::write(dir.path().join("kmsg"), b"").unwrap();
    let since = faultline_core::time::Timestamp::now();
    let agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("this node's first record", |r| {
        r.node == "node-a"
            && r.update_time > since
            && r.agent.detectors.iter().any(|d| d.name == "kmsg")
    });
    assert!(r.faults.is_empty(), "rebuilt: {:?}", r.faults);
    assert!(
        agent.log().contains("another node's; not restored"),
        "{}",
        agent.log()
    );
    assert_eq!(agent.stop(), 0);
}

/// A data directory the agent cannot write at start (a read-only file system) or on a full
/// disk does not stop it: the lock is not taken where nothing can be written (read-only), or is
/// taken without naming its holder (full), and detection and the record go on, as they do when
/// the disk fails later. Needs root and a mount namespace (`unshare -m`): skipped elsewhere.
#[test]
fn a_read_only_or_full_data_directory_does_not_stop_the_agent() {
    let private = Command::new("unshare")
        .args(["-m", "true"])
        .stderr(Stdio::null())
        .status();
    if !private.is_ok_and(|s| s.success()) {
        eprintln!("skipped: no mount namespace here (unshare -m)");
        return;
    }
    let cases = [
        (
            "read-only",
            "mount -t tmpfs -o ro,mode=0755 none \"$D\"",
            "running without its lock",
        ),
        (
            "full",
            "mount -t tmpfs -o size=16k,mode=0755 none \"$D\" && { head -c 1000000 /dev/zero > \"$D/fill\" 2>/dev/null; true; }",
            "cannot name its holder",
        ),
    ];
    for (what, mount, said) in cases {
        let dir = tempfile::tempdir().unwrap();
        let (kmsg, data, log) = (
            dir.path().join("kmsg"),
            dir.path().join("data"),
            dir.path().join("agent.log"),
        );
        std::fs::write(&kmsg, b"").unwrap();
        std::fs::create_dir(&data).unwrap();
        let script = format!("D=\"$1\"; shift; {mount} && exec \"$0\" \"$@\"");
        let mut child = Command::new("unshare")
            .args(["-m", "sh", "-c", &script])
            .arg(env!("CARGO_BIN_EXE_faultline-agent"))
            .arg(&data)
            .arg("--kmsg-path")
            .arg(&kmsg)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--data-dir")
            .arg(&data)
            .args(["--no-nvml", "--no-ascend", "--node-name", "node-a"])
            .args(["--listen", "127.0.0.1:0", "--follow-interval", "5ms"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&kmsg)
            .unwrap()
            .write_all(&xid79(1, "3b"))
            .unwrap();
        let record = dir.path().join("state/faults.json");
        let found = wait_until(what, Duration::from_secs(30), || {
            if child.try_wait().unwrap().is_some() {
                return Some(false);
            }
            let r: faultline_core::record::NodeRecord =
                serde_json::from_slice(&std::fs::read(&record).ok()?).ok()?;
            fault(&r, "Xid79").map(|_| true)
        });
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(found, "{what}: the agent stopped\n{text}");
        assert!(text.contains(said), "{what}: {text}");
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// One host directory given as both the state and the data directory through two mounts (two
/// hostPath volumes of one path, a bind mount) is locked once: the agent runs. Before, the two
/// paths were told apart by name, the second lock of the same file by the same agent conflicted
/// with the first, and the agent refused to start blaming itself ("another faultline agent
/// holds …"), for ever. Needs root and a mount namespace (`unshare -m`): skipped elsewhere.
#[test]
fn one_directory_behind_two_mounts_is_locked_once() {
    let private = Command::new("unshare")
        .args(["-m", "true"])
        .stderr(Stdio::null())
        .status();
    if !private.is_ok_and(|s| s.success()) {
        eprintln!("skipped: no mount namespace here (unshare -m)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (kmsg, data, state, log) = (
        dir.path().join("kmsg"),
        dir.path().join("data"),
        dir.path().join("state"),
        dir.path().join("agent.log"),
    );
    std::fs::write(&kmsg, xid79(1, "3b")).unwrap();
    std::fs::create_dir(&data).unwrap();
    std::fs::create_dir(&state).unwrap();
    let script = "mount --bind \"$1\" \"$2\" && shift 2 && exec \"$0\" \"$@\"";
    let mut child = Command::new("unshare")
        .args(["-m", "sh", "-c", script])
        .arg(env!("CARGO_BIN_EXE_faultline-agent"))
        .arg(&data)
        .arg(&state)
        .arg("--kmsg-path")
        .arg(&kmsg)
        .arg("--state-dir")
        .arg(&state)
        .arg("--data-dir")
        .arg(&data)
        .args(["--no-nvml", "--no-ascend", "--node-name", "node-a"])
        .args(["--listen", "127.0.0.1:0", "--follow-interval", "5ms"])
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    // The record appears in the data directory: the state directory is the same one.
    let record = data.join("faults.json");
    let found = wait_until("the record", Duration::from_secs(30), || {
        if child.try_wait().unwrap().is_some() {
            return Some(false);
        }
        let r: faultline_core::record::NodeRecord =
            serde_json::from_slice(&std::fs::read(&record).ok()?).ok()?;
        fault(&r, "Xid79").map(|_| true)
    });
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(found, "the agent stopped:\n{text}");
}
