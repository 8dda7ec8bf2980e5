//! Signals against the real agent: none whose default action ends a process ends the agent
//! without its flush (docs/operations.md, "Shutdown and restarts").

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::time::Duration;

use common::{fault, wait_until, Agent};
use rustix::process::Signal;

const XID13: &str = "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, Graphics Exception";

/// An agent whose record is written once at start and then only by its flush at exit (the
/// write budget is one write, then one an hour).
fn start(dir: &std::path::Path) -> Agent {
    let agent = Agent::start(dir, &["--write-interval", "1h", "--write-burst", "1"]);
    agent.wait_for("start-up write", |_| true);
    agent
}

/// Appends Xid 13 records `from..=to` and waits until the engine has counted them all (its
/// record on `/v1/record`; the files are not written meanwhile).
fn replay(agent: &Agent, from: u64, to: u64) {
    for seq in from..=to {
        agent.append(format!("4,{seq},{},-;{XID13}\n", seq * 100).as_bytes());
    }
    wait_until("the records applied", Duration::from_secs(30), || {
        let (status, body) = agent.get("/v1/record");
        let r: faultline_core::record::NodeRecord = serde_json::from_str(&body).ok()?;
        (status == 200 && fault(&r, "Xid13").is_some_and(|f| f.count == to)).then_some(())
    });
}

/// Sends signal number `n` (`kill -N`: real-time signals have no name the tests can build).
fn send(agent: &Agent, n: i32) {
    let st = std::process::Command::new("kill")
        .arg(format!("-{n}"))
        .arg(agent.child.id().to_string())
        .status()
        .unwrap();
    assert!(st.success(), "kill -{n}");
}

/// Waits for the agent to exit; its exit code (`None`: killed by a signal).
fn exited(agent: &mut Agent) -> Option<i32> {
    let st = wait_until("the agent to exit", Duration::from_secs(20), || {
        agent.child.try_wait().unwrap()
    });
    st.code()
}

/// The count of Xid 13 in `faults.json` and in `state.json`, and the state's kernel-log cursor.
fn flushed(agent: &Agent) -> (u64, u64, u64) {
    let record: faultline_core::record::NodeRecord =
        serde_json::from_slice(&std::fs::read(agent.record_path()).unwrap()).unwrap();
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(agent.data().join("state.json")).unwrap()).unwrap();
    let saved = state["engine"]["faults"]
        .as_object()
        .unwrap()
        .values()
        .find(|f| f["fault"]["fault_code"] == "Xid13")
        .map(|f| f["fault"]["count"].as_u64().unwrap())
        .unwrap_or(0);
    (
        fault(&record, "Xid13").map(|f| f.count).unwrap_or(0),
        saved,
        state["kmsg_cursor"].as_u64().unwrap_or(0),
    )
}

/// SIGPWR (a power failure; LXC's request to shut a container down) and SIGXCPU (the CPU-time
/// soft limit) stop the agent like SIGTERM: the faults read just before are in `faults.json`
/// and `state.json` with their final count. SIGXCPU exits 152 (128 + 24): a failure. Before,
/// both ended the agent at once and the three faults read since its last write were lost.
#[test]
fn stop_signals_flush_the_record_and_the_state() {
    for (sig, code) in [
        (Signal::POWER, 0),
        (Signal::XCPU, 152),
        (Signal::TERM, 0),
        (Signal::INT, 0),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut agent = start(dir.path());
        replay(&agent, 1, 3);
        send(&agent, sig.as_raw());
        assert_eq!(exited(&mut agent), Some(code), "{sig:?}: {}", agent.log());
        assert_eq!(flushed(&agent), (3, 3, 3), "{sig:?}: {}", agent.log());
    }
}

/// Every other signal whose default action would end the agent is logged and ignored: the
/// timer signals, SIGIO, SIGSTKFLT, SIGXFSZ, SIGUSR1/2, SIGQUIT, the real-time signals (and
/// SIGPIPE, which Rust ignores). The agent runs on, reads on, and flushes everything at SIGTERM.
/// Before, SIGALRM and the others ended it without a flush.
#[test]
fn other_fatal_signals_are_ignored_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = start(dir.path());
    replay(&agent, 1, 1);
    let logged = [
        Signal::ALARM,
        Signal::VTALARM,
        Signal::PROF,
        Signal::IO,
        Signal::STKFLT,
        Signal::XFSZ,
        Signal::USR1,
        Signal::USR2,
        Signal::QUIT,
    ]
    .map(Signal::as_raw)
    .into_iter()
    .chain([34, 35, 64])
    .collect::<Vec<_>>();
    for &n in &logged {
        send(&agent, n);
    }
    send(&agent, Signal::PIPE.as_raw());
    wait_until("the signals logged", Duration::from_secs(10), || {
        (agent.log().matches("signal ignored").count() >= logged.len()).then_some(())
    });
    for name in [
        "SIGALRM",
        "SIGXFSZ",
        "SIGSTKFLT",
        "SIGRTMIN+0",
        "SIGRTMIN+30",
    ] {
        assert!(agent.log().contains(name), "{name}: {}", agent.log());
    }
    assert!(agent.child.try_wait().unwrap().is_none(), "still running");
    replay(&agent, 2, 3);
    common::terminate(&agent.child);
    assert_eq!(exited(&mut agent), Some(0), "{}", agent.log());
    assert_eq!(flushed(&agent), (3, 3, 3), "{}", agent.log());
}

/// The kernel sends SIGXCPU again every second past the soft limit: a repeat does not cut the
/// flush short, while a second SIGTERM does (exit 130 at once). The flush is made slow by a
/// record that cannot be written (the agent retries it for up to 5 s).
#[test]
fn a_repeated_sigxcpu_does_not_cut_the_flush_short() {
    for (second, code) in [(Signal::XCPU, 152), (Signal::TERM, 130)] {
        let dir = tempfile::tempdir().unwrap();
        let mut agent = start(dir.path());
        replay(&agent, 1, 1);
        std::fs::remove_file(agent.record_path()).unwrap();
        std::fs::create_dir(agent.record_path()).unwrap();
        send(&agent, Signal::XCPU.as_raw());
        wait_until("the stop begun", Duration::from_secs(10), || {
            agent.log().contains("shutting down").then_some(())
        });
        std::thread::sleep(Duration::from_millis(300));
        send(&agent, second.as_raw());
        assert_eq!(
            exited(&mut agent),
            Some(code),
            "{second:?}: {}",
            agent.log()
        );
    }
}
