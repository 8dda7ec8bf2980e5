//! End-to-end tests of the kernel-log follower (issue 25 §4), through the agent binary: a file
//! replaced or truncated at `--kmsg-path` is read anew like `tail -F`, a FIFO without a writer
//! shows its detector, and a record counts once across restarts, whether or not it has a usable
//! sequence number and whether or not the boot id can be read.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use common::{wait_until, xid79, Agent};
use faultline_core::record::NodeRecord;

/// The counts of the Xid 79 faults in a record, sorted.
fn xid79_counts(r: &NodeRecord) -> Vec<u64> {
    let mut v: Vec<u64> = r
        .faults
        .iter()
        .filter(|f| f.fault_code == "Xid79")
        .map(|f| f.count)
        .collect();
    v.sort();
    v
}

/// The kmsg detector's `(state, reason)` in a record, if it is there.
fn kmsg_detector(r: &NodeRecord) -> Option<(String, String)> {
    r.agent
        .detectors
        .iter()
        .find(|d| d.name == "kmsg")
        .map(|d| (d.state.clone(), d.reason.clone().unwrap_or_default()))
}

fn noise(seq: u64) -> Vec<u8> {
    format!(
        "6,{seq},{},-;usb 1-1: new high-speed USB device number {seq}\n",
        seq * 100
    )
    .into_bytes()
}

/// Starts the agent on `dir` with `extra`, waits until it has read `lines` records (replayed
/// ones included), stops it with SIGTERM (the record is flushed) and returns the record. The
/// count goes up as a line is taken, before its fault is sent: the last line of a log given
/// here holds no fault.
fn run_until_read(dir: &Path, extra: &[&str], lines: u64) -> NodeRecord {
    let agent = Agent::start(dir, extra);
    wait_until("the whole log read", Duration::from_secs(30), || {
        (agent.metric("faultline_kmsg_records_total") >= lines as f64).then_some(())
    });
    let log = agent.log();
    assert_eq!(agent.stop(), 0, "{log}");
    let path = dir.join("state").join("faults.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// A file renamed over the path (log rotation) is noticed: the old file was read to its end,
/// the new one is read from its beginning (its records count even though their numbers start
/// over), and the record, metrics and log say so. A restart resumes in the new file, counting
/// nothing twice. Before, the agent kept reading the old inode: the new fault never appeared
/// and the detector said Running.
#[test]
fn a_file_renamed_over_the_path_is_followed() {
    let dir = tempfile::tempdir().unwrap();
    let kmsg = dir.path().join("kmsg");
    let mut first = noise(1);
    first.extend(xid79(2, "3b"));
    std::fs::write(&kmsg, first).unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_for("the first fault", |r| xid79_counts(r) == [1]);

    let mut second = noise(1);
    second.extend(xid79(2, "86"));
    let new = dir.path().join("kmsg.new");
    std::fs::write(&new, second).unwrap();
    std::fs::rename(&new, &kmsg).unwrap();
    let r = agent.wait_for("the fault in the new file", |r| xid79_counts(r) == [1, 1]);
    let (state, reason) = kmsg_detector(&r).unwrap();
    assert_eq!(state, "Running");
    assert!(reason.contains("replaced 1 times"), "{reason}");
    assert_eq!(
        agent.metric("faultline_kmsg_new_files_total{kind=\"rotated\"}"),
        1.0
    );
    assert!(agent.log().contains("rotated"), "{}", agent.log());
    // Appended to the file now at the path: read.
    agent.append(&xid79(3, "86"));
    agent.wait_for("the appended fault", |r| xid79_counts(r) == [1, 2]);
    assert_eq!(agent.stop(), 0);

    let r = run_until_read(dir.path(), &[], 3);
    assert_eq!(xid79_counts(&r), [1, 2], "a restart counts nothing twice");
}

/// A file replaced while the agent was stopped is not the log the saved position was taken in:
/// its records are new, though numbered at or below the position. Before, they were skipped as
/// already counted.
#[test]
fn a_file_replaced_while_the_agent_was_stopped_is_read_as_new() {
    let dir = tempfile::tempdir().unwrap();
    let kmsg = dir.path().join("kmsg");
    let mut first = noise(1);
    first.extend(xid79(2, "3b"));
    first.extend(noise(3));
    std::fs::write(&kmsg, first).unwrap();
    let r = run_until_read(dir.path(), &[], 3);
    assert_eq!(xid79_counts(&r), [1]);

    let mut second = xid79(1, "86");
    second.extend(noise(2));
    let new = dir.path().join("kmsg.new");
    std::fs::write(&new, second).unwrap();
    std::fs::rename(&new, &kmsg).unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_for("the fault in the new file", |r| xid79_counts(r) == [1, 1]);
    assert!(
        agent.log().contains("reading all of it as new"),
        "{}",
        agent.log()
    );
    assert_eq!(agent.stop(), 0);
    let r = run_until_read(dir.path(), &[], 2);
    assert_eq!(xid79_counts(&r), [1, 1], "and counted once");
}

/// A file cut below the offset read (truncated, then written again) is read from its
/// beginning. Before, the agent went on reading at its old offset: what was written below it
/// was lost.
#[test]
fn a_truncated_file_is_read_from_its_beginning() {
    let dir = tempfile::tempdir().unwrap();
    let kmsg = dir.path().join("kmsg");
    let mut log: Vec<u8> = (1..=20).flat_map(noise).collect();
    log.extend(xid79(21, "3b"));
    std::fs::write(&kmsg, log).unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_for("the first fault", |r| xid79_counts(r) == [1]);

    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&kmsg)
        .unwrap();
    f.write_all(&xid79(1, "86")).unwrap();
    drop(f);
    let r = agent.wait_for("the fault written after the truncation", |r| {
        xid79_counts(r) == [1, 1]
    });
    let (state, reason) = kmsg_detector(&r).unwrap();
    assert_eq!(state, "Running");
    assert!(reason.contains("truncated 1 times"), "{reason}");
    assert_eq!(
        agent.metric("faultline_kmsg_new_files_total{kind=\"truncated\"}"),
        1.0
    );
    assert!(agent.log().contains("truncated"), "{}", agent.log());
    assert_eq!(agent.stop(), 0);
}

/// A FIFO no writer has opened: the kmsg detector is in the record from the start, Starting,
/// saying it waits for a writer; once one writes, it is Running and the fault is read. Before,
/// the record had no kmsg detector at all.
#[test]
fn a_fifo_without_a_writer_shows_its_detector_starting() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kmsg");
    mkfifo(&fifo);
    let agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("the kmsg detector", |r| kmsg_detector(r).is_some());
    let (state, reason) = kmsg_detector(&r).unwrap();
    assert_eq!(state, "Starting");
    assert!(reason.contains("waiting for a writer"), "{reason}");

    let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    w.write_all(&xid79(1, "3b")).unwrap();
    let r = agent.wait_for("the fault from the FIFO", |r| xid79_counts(r) == [1]);
    assert_eq!(kmsg_detector(&r).unwrap().0, "Running");
    assert_eq!(agent.stop(), 0);
}

/// A malformed sequence number, a dmesg-format line and a sequence number that jumps past 2^40
/// each count once over three SIGTERM restarts (before: 1, 2, 3, 4), and a line appended after
/// the restarts still counts.
#[test]
fn records_without_a_usable_number_count_once_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let x = |bus: &str| {
        format!("NVRM: Xid (PCI:0000:{bus}:00): 79, pid=1, name=a, GPU has fallen off the bus.")
    };
    let mut log: Vec<u8> = (1..=3).flat_map(noise).collect();
    log.extend(format!("4,12x,400,-;{}\n", x("3b")).bytes());
    log.extend(format!("[    5.000000] {}\n", x("86")).bytes());
    log.extend(format!("4,{},600,-;{}\n", (1u64 << 41) + 7, x("af")).bytes());
    log.extend(noise(4));
    std::fs::write(dir.path().join("kmsg"), &log).unwrap();
    let lines = 7;
    for run in 1..=4 {
        let r = run_until_read(dir.path(), &[], lines);
        assert_eq!(xid79_counts(&r), [1, 1, 1], "after run {run}");
    }
    std::fs::OpenOptions::new()
        .append(true)
        .open(dir.path().join("kmsg"))
        .unwrap()
        .write_all(
            &[
                format!("[    6.000000] {}\n", x("86")).into_bytes(),
                noise(5),
            ]
            .concat(),
        )
        .unwrap();
    let r = run_until_read(dir.path(), &[], lines + 2);
    assert_eq!(xid79_counts(&r), [1, 1, 2], "the appended line is new");
}

/// With the boot id unreadable, the boot is told by its boot time (`/proc/stat` btime): a
/// restart resumes after the saved cursor instead of counting every record again (before: 1,
/// 2, 3).
#[test]
fn an_unreadable_boot_id_still_resumes_after_the_cursor() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = noise(1);
    log.extend(xid79(2, "3b"));
    log.extend(noise(3));
    std::fs::write(dir.path().join("kmsg"), &log).unwrap();
    let no_id = ["--boot-id-path", "/nonexistent/boot_id"];
    for run in 1..=3 {
        let r = run_until_read(dir.path(), &no_id, 3);
        assert_eq!(xid79_counts(&r), [1], "after run {run}");
    }
    std::fs::OpenOptions::new()
        .append(true)
        .open(dir.path().join("kmsg"))
        .unwrap()
        .write_all(&[xid79(4, "3b"), noise(5)].concat())
        .unwrap();
    let r = run_until_read(dir.path(), &no_id, 5);
    assert_eq!(xid79_counts(&r), [2], "the appended record is new");
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        path,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
}

/// The operations guide's FIFO flow, restarted: a line without a sequence number is read, the
/// agent is stopped (the position saved: one line counted) and started again, and the next line
/// a writer sends is a new fault. A FIFO replays nothing, so nothing read from it is skipped.
/// Before, the saved count was taken as a replay to skip: the Xid 48 after the restart was
/// skipped (`faultline_kmsg_skipped_records_total` 1) and no fault appeared.
#[test]
fn a_fifo_restarted_skips_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kmsg");
    mkfifo(&fifo);
    let write = |line: &str| {
        let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        w.write_all(line.as_bytes()).unwrap();
    };
    let agent = Agent::start(dir.path(), &[]);
    write("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=a, GPU has fallen off the bus.\n");
    agent.wait_for("the Xid 79", |r| xid79_counts(r) == [1]);
    assert_eq!(agent.stop(), 0);

    let agent = Agent::start(dir.path(), &[]);
    write("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=a, DBE (double bit error)\n");
    let r = agent.wait_for("the Xid 48 after the restart", |r| {
        r.faults.iter().any(|f| f.fault_code == "Xid48")
    });
    assert_eq!(xid79_counts(&r), [1]);
    assert_eq!(agent.metric("faultline_kmsg_skipped_records_total"), 0.0);
    assert!(agent.log().contains("replays nothing"), "{}", agent.log());
    assert_eq!(agent.stop(), 0);
}

/// A FIFO put where a replay file was, under the file's inode number (ext4 hands a freed number
/// out again), is a stream: nothing is read out of it to compare with the saved file's bytes.
/// Before, the start read the saved byte count out of the pipe, and the lines it took were
/// never parsed. Where the inode number is not reused, the test says so and checks nothing.
#[test]
fn a_fifo_under_a_replaced_files_inode_number_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let kmsg = dir.path().join("kmsg");
    let mut first = noise(1);
    first.extend(xid79(2, "3b"));
    first.extend(noise(3));
    std::fs::write(&kmsg, &first).unwrap();
    let r = run_until_read(dir.path(), &[], 3);
    assert_eq!(xid79_counts(&r), [1]);
    let inode = std::fs::metadata(&kmsg).unwrap().ino();
    std::fs::remove_file(&kmsg).unwrap();
    mkfifo(&kmsg);
    if std::fs::metadata(&kmsg).unwrap().ino() != inode {
        eprintln!("skipped: this file system gave the FIFO another inode number");
        return;
    }
    let agent = Agent::start(dir.path(), &[]);
    let mut w = std::fs::OpenOptions::new().write(true).open(&kmsg).unwrap();
    w.write_all(b"NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=a, DBE (double bit error)\n")
        .unwrap();
    agent.wait_for("the Xid 48 written to the FIFO", |r| {
        r.faults.iter().any(|f| f.fault_code == "Xid48")
    });
    drop(w);
    assert_eq!(agent.stop(), 0);
}

/// A file rewritten in place while the agent was stopped (`dmesg > replay.log` again: `O_TRUNC`
/// keeps the inode), with other lines of the same or a greater length, is another log: all of it
/// is read as new, and counted once. Before, its first lines were skipped as the ones counted
/// before the restart (the Xid 79 on 86 and the one on af never counted). A file that only grew
/// resumes where it was (`records_without_a_usable_number_count_once_across_restarts`).
#[test]
fn a_file_rewritten_in_place_while_the_agent_was_stopped_is_read_as_new() {
    let dir = tempfile::tempdir().unwrap();
    let kmsg = dir.path().join("kmsg");
    let x = |bus: &str| {
        format!("NVRM: Xid (PCI:0000:{bus}:00): 79, pid=1, name=a, GPU has fallen off the bus.")
    };
    let mut first = noise(1);
    first.extend(xid79(2, "3b"));
    first.extend(format!("[    5.000000] {}\n", x("3b")).bytes());
    first.extend(noise(3));
    std::fs::write(&kmsg, &first).unwrap();
    let r = run_until_read(dir.path(), &[], 4);
    assert_eq!(xid79_counts(&r), [2]);
    let inode = std::fs::metadata(&kmsg).unwrap().ino();

    // The same shape, other buses, one more line; written over the same inode.
    let mut second = noise(1);
    second.extend(xid79(2, "86"));
    second.extend(format!("[    5.000000] {}\n", x("af")).bytes());
    second.extend(noise(3));
    second.extend(noise(4));
    assert!(second.len() > first.len());
    std::fs::write(&kmsg, &second).unwrap();
    assert_eq!(std::fs::metadata(&kmsg).unwrap().ino(), inode);
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_for("the faults in the rewritten file", |r| {
        xid79_counts(r) == [1, 1, 2]
    });
    assert!(
        agent.log().contains("no longer starts with"),
        "{}",
        agent.log()
    );
    assert_eq!(agent.stop(), 0);
    let r = run_until_read(dir.path(), &[], 5);
    assert_eq!(xid79_counts(&r), [1, 1, 2], "and counted once");
}

/// The nice value of each thread of `pid` named `name`.
fn thread_nice(pid: u32, name: &str) -> Vec<i64> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.join("stat")).unwrap();
        // Fields after the command's closing parenthesis start at the 3rd (state); the nice
        // value is the 19th (proc(5)).
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        out.push(after.split_whitespace().nth(16).unwrap().parse().unwrap());
    }
    out
}

/// Issue 27 §2: the kernel-log reader's thread runs at `--kmsg-nice` (a reader starved of CPU
/// loses records the ring overwrites), the agent's other threads at their own; without
/// CAP_SYS_NICE the agent says so and reads at its own priority, losing nothing else. Before,
/// the reader ran at the agent's priority and the flag did not exist.
#[test]
fn the_reader_thread_runs_at_its_nice_value_and_reads_without_the_right_to_set_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kmsg"), xid79(1, "3b")).unwrap();
    let agent = Agent::start(dir.path(), &["--kmsg-nice", "-7"]);
    agent.wait_for("the fault", |r| xid79_counts(r) == [1]);
    let pid = agent.child.id();
    assert_eq!(thread_nice(pid, "kmsg"), [-7], "{}", agent.log());
    assert_eq!(
        thread_nice(pid, "faultline-agent"),
        [0],
        "the main thread keeps the agent's priority"
    );
    assert_eq!(agent.stop(), 0);

    // setpriv (util-linux) execs the agent without CAP_SYS_NICE in its bounding set.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kmsg"), xid79(1, "3b")).unwrap();
    let agent = Agent::start_under(dir.path(), &[], &["setpriv", "--bounding-set", "-sys_nice"]);
    agent.wait_for("the fault, read without the right to be nicer", |r| {
        xid79_counts(r) == [1]
    });
    wait_until("the warning", Duration::from_secs(10), || {
        agent
            .log()
            .contains("cannot set the kernel-log reader thread's nice value")
            .then_some(())
    });
    assert_eq!(thread_nice(agent.child.id(), "kmsg"), [0]);
    assert_eq!(agent.stop(), 0);
}
