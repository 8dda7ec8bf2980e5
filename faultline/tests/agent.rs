//! End-to-end tests of the standalone agent: the real binary, a kernel log file, the local
//! record, metrics, restarts, policy reloads and shutdown.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::time::Duration;

use common::{fault, fixtures, wait_until, xid79, Agent};
use faultline_core::record::{FaultType, Handling, Health, Source};

fn mixed_replay() -> Vec<u8> {
    let mut data = std::fs::read(fixtures().join("replay/mixed.kmsg")).unwrap();
    // Bad input the fixture file cannot hold as text: invalid UTF-8, and a line far over the
    // length limit whose start holds a fault.
    data.extend_from_slice(b"4,44,14000,-;\xff\xfe\xfd invalid utf-8 \xc3\x28\n");
    data.extend_from_slice(
        b"4,45,15000,-;NVRM: Xid (PCI:0000:b1:00): 48, pid=1, name=x, DBE (0x1,0x2) ",
    );
    data.extend(std::iter::repeat_n(b'x', 200_000));
    data.push(b'\n');
    data
}

/// The hand-checked expectations for tests/fixtures/replay/mixed.kmsg.
#[test]
fn replay_yields_the_expected_records() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kmsg"), mixed_replay()).unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("all faults", |r| {
        r.faults.len() >= 9 && fault(r, "Xid48").is_some()
    });

    let want: &[(&str, &str, u64, Handling, FaultType)] = &[
        (
            "Xid79",
            "GPU-0000:3b:00.0",
            3,
            Handling::SeparateNPU,
            FaultType::CardUnhealthy,
        ),
        (
            "Xid13",
            "GPU-0000:86:00.0",
            2,
            Handling::RestartBusiness,
            FaultType::CardUnhealthy,
        ),
        (
            "Xid74",
            "GPU-0000:1a:00.0",
            1,
            Handling::RestartNPU,
            FaultType::CardNetworkUnhealthy,
        ),
        (
            "SXid12028",
            "nvswitch3",
            1,
            Handling::SubHealthFault,
            FaultType::NodeUnhealthy,
        ),
        (
            "PCIE_AER_FATAL",
            "pci-0000:01:00.0",
            1,
            Handling::SeparateNPU,
            FaultType::NodeUnhealthy,
        ),
        (
            "MCE_CORRECTED",
            "node",
            1,
            Handling::NotHandleFault,
            FaultType::NodeUnhealthy,
        ),
        (
            "KMSG_LOSS",
            "node",
            28,
            Handling::SubHealthFault,
            FaultType::NodeUnhealthy,
        ),
        (
            "Xid95",
            "GPU-0000:af:00.0",
            1,
            Handling::RestartNPU,
            FaultType::CardUnhealthy,
        ),
        (
            "Xid48",
            "GPU-0000:b1:00.0",
            1,
            Handling::RestartNPU,
            FaultType::CardUnhealthy,
        ),
    ];
    assert_eq!(r.faults.len(), want.len(), "{:#?}", r.faults);
    for (code, device, count, handling, ftype) in want {
        let f = fault(&r, code).unwrap_or_else(|| panic!("{code} missing"));
        assert_eq!(
            (
                f.device.as_str(),
                f.count,
                f.fault_handling,
                f.fault_type,
                f.active
            ),
            (*device, *count, *handling, *ftype, true),
            "{code}"
        );
    }
    let x79 = fault(&r, "Xid79").unwrap();
    assert_eq!(
        x79.device_uuid.as_deref(),
        Some("GPU-5d1c7f7e-1e0b-1b2c-3c4d-0123456789ab")
    );
    assert_eq!(x79.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
    assert_eq!(x79.source, Source::Kmsg);
    assert!(fault(&r, "Xid74").unwrap().message.contains("link 14"));
    assert_eq!(fault(&r, "KMSG_LOSS").unwrap().source, Source::Agent);
    assert_eq!(
        (r.health, r.handling),
        (Health::Unhealthy, Some(Handling::SeparateNPU))
    );
    assert_eq!(r.node, "node-a");

    // The bad records were counted, not fatal.
    assert!(agent.metric("faultline_kmsg_malformed_records_total") >= 1.0);
    assert_eq!(agent.metric("faultline_kmsg_truncated_lines_total"), 1.0);
    // 12 -> 40 loses 27; 41 is a truncated record (read, malformed); 42 is missing.
    assert_eq!(agent.metric("faultline_kmsg_lost_records_total"), 28.0);
    assert_eq!(agent.metric("faultline_node_health"), 2.0);
    assert_eq!(agent.stop(), 0);
}

/// Every matching line of the parser corpus, fed through the agent, becomes the fault its
/// expectation implies; no non-matching line creates one.
#[test]
fn whole_corpus_through_the_agent() {
    #[derive(serde::Deserialize)]
    struct Case {
        line: String,
        expect: Option<serde_json::Map<String, serde_json::Value>>,
    }
    let text = std::fs::read_to_string(fixtures().join("kernel-lines.yaml")).unwrap();
    let cases: Vec<Case> = serde_saphyr::from_str(&text).unwrap();
    let mut kmsg = String::new();
    let mut want = std::collections::BTreeSet::new();
    for (i, c) in cases.iter().enumerate() {
        // The corpus holds messages; as records they must be one line each.
        let msg = c.line.replace('\n', " ");
        kmsg.push_str(&format!("4,{},{},-;{msg}\n", i + 1, i * 10));
        let Some(e) = &c.expect else { continue };
        let num = |k: &str| e.get(k).and_then(|v| v.as_u64());
        let code = match e.get("kind").and_then(|k| k.as_str()) {
            Some("xid") => format!("Xid{}", num("xid").unwrap()),
            Some("fallen_off_bus") => "Xid79".into(),
            Some("sxid" | "sxid_severity") => format!("SXid{}", num("sxid").unwrap()),
            Some("pcie_aer") if e.get("fatal") == Some(&serde_json::Value::Bool(true)) => {
                "PCIE_AER_FATAL".into()
            }
            Some("pcie_aer") => "PCIE_AER_NONFATAL".into(),
            Some("machine_check") if e.get("corrected") == Some(&serde_json::Value::Bool(true)) => {
                "MCE_CORRECTED".into()
            }
            Some("machine_check") => "MCE_UNCORRECTED".into(),
            _ => continue, // gpu_uuid: identity, not a fault
        };
        want.insert(code);
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kmsg"), kmsg).unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let n = cases.len() as f64;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while agent.metric("faultline_kmsg_records_total") < n {
        assert!(
            std::time::Instant::now() < deadline,
            "agent did not read the corpus"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every code the corpus names (one code can be on several devices, so a count of faults
    // can be reached before the last code is in).
    let r = agent.wait_for("corpus faults", |r| {
        want.iter()
            .all(|c| r.faults.iter().any(|f| &f.fault_code == c))
    });
    let got: std::collections::BTreeSet<String> =
        r.faults.iter().map(|f| f.fault_code.clone()).collect();
    assert_eq!(got, want);
    agent.stop();
}

#[test]
fn restart_neither_recounts_nor_forgets() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("kmsg"),
        std::fs::read(fixtures().join("replay/mixed.kmsg")).unwrap(),
    )
    .unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_for("replay", |r| {
        fault(r, "Xid79").is_some_and(|f| f.count == 3)
    });
    assert_eq!(agent.stop(), 0);

    // Same boot: the log is read again from its start, but counted records are skipped.
    let agent = Agent::start(dir.path(), &[]);
    agent.append(b"4,46,16000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n");
    let r = agent.wait_for("the new record", |r| {
        fault(r, "Xid79").is_some_and(|f| f.count >= 4)
    });
    assert_eq!(
        fault(&r, "Xid79").unwrap().count,
        4,
        "only the new line counted"
    );
    assert_eq!(
        fault(&r, "Xid13").unwrap().count,
        2,
        "restored, not recounted"
    );
    // 43 -> 46 skips two records: lost while the agent was down.
    assert_eq!(fault(&r, "KMSG_LOSS").unwrap().count, 28 + 2);
    assert!(agent.metric("faultline_kmsg_skipped_records_total") >= 14.0);
    assert_eq!(agent.stop(), 0);

    // A new boot: kernel-log faults describe the old boot and clear.
    std::fs::write(dir.path().join("boot_id"), b"boot-2\n").unwrap();
    std::fs::write(dir.path().join("kmsg"), b"6,1,100,-;Linux version 6.1.0\n").unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("reboot clears", |r| r.health == Health::Healthy);
    let x79 = fault(&r, "Xid79").unwrap();
    assert!(!x79.active && x79.recovered_at.is_some(), "kept as history");
    agent.stop();
}

/// A reboot, as a node sees it: a new boot id, a new boot time, a kernel log that starts over,
/// and `/run` empty (the state directory is gone) while `/var/lib` is kept (the data
/// directory). The operator-held fault stays active, the node stays Unhealthy, and the
/// escalation count goes on across the reboot: one Xid 13 before and one after make two in
/// 24 h. When the state lived in /run, the agent came back empty and Healthy.
#[test]
fn a_reboot_keeps_operator_held_faults_and_escalation_counts() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "overrides:\n  Xid79: { handling: ManuallySeparateNPU }\n\
         escalation:\n  - { name: twice, codes: [Xid13], count: 2, window: 24h, handling: PreSeparateNPU }\n",
    )
    .unwrap();
    let extra = ["--policy", policy.to_str().unwrap()];
    let agent = Agent::start(dir.path(), &extra);
    agent.append(&xid79(1, "3b"));
    agent.append(
        b"4,2,2000000,-;NVRM: Xid (PCI:0000:5e:00): 13, pid=1, name=a, Graphics Exception\n",
    );
    let before = agent.wait_for("both faults", |r| {
        fault(r, "Xid79").is_some() && fault(r, "Xid13").is_some()
    });
    assert_eq!(
        fault(&before, "Xid13").unwrap().fault_handling,
        Handling::RestartBusiness,
        "one occurrence: not escalated yet"
    );
    assert!(agent.data().join("state.json").is_file());
    assert!(
        !agent.state().join("state.json").exists(),
        "durable state is not in /run"
    );
    assert_eq!(agent.stop(), 0);

    // The reboot.
    common::reboot(dir.path(), b"6,1,100,-;Linux version 6.1.0\n", false);
    let agent = Agent::start(dir.path(), &extra);
    let r = agent.wait_for("the record of the new boot", |r| {
        r.agent.detectors.iter().any(|d| d.name == "kmsg")
    });
    let held = fault(&r, "Xid79").expect("the operator-held fault is kept");
    assert!(held.active, "{held:?}");
    assert_eq!(held.fault_handling, Handling::ManuallySeparateNPU);
    assert_eq!(r.health, Health::Unhealthy);
    let x13 = fault(&r, "Xid13").unwrap();
    assert!(!x13.active, "a reboot ends a kernel-log fault: {x13:?}");

    // The same application fault once more in the new boot: the second in 24 h.
    agent.append(
        b"4,2,3000000,-;NVRM: Xid (PCI:0000:5e:00): 13, pid=1, name=a, Graphics Exception\n",
    );
    let r = agent.wait_for("Xid 13 again", |r| {
        fault(r, "Xid13").is_some_and(|f| f.active)
    });
    let x13 = fault(&r, "Xid13").unwrap();
    assert_eq!(
        x13.fault_handling,
        Handling::PreSeparateNPU,
        "escalated: the count survived the reboot ({x13:?})"
    );
    assert_eq!(agent.stop(), 0);
}

/// A `state.json` written by a newer agent (another version) is refused with a clear message,
/// never misread: it is set aside as `state.json.v2` (a rollback's agent finds it there), and
/// the faults are rebuilt from the record.
#[test]
fn state_of_another_version_is_set_aside() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.append(&xid79(1, "3b"));
    agent.wait_for("the fault", |r| fault(r, "Xid79").is_some());
    let data = agent.data();
    assert_eq!(agent.stop(), 0);

    // A newer version.
    let path = data.join("state.json");
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    doc["version"] = 2.into();
    let newer = doc.to_string();
    std::fs::write(&path, &newer).unwrap();
    std::fs::write(dir.path().join("kmsg"), b"").unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("rebuilt", |r| {
        agent.log().contains("faults rebuilt from the record")
            && r.agent.detectors.iter().any(|d| d.name == "kmsg")
    });
    assert_eq!(
        fault(&r, "Xid79").map(|f| (f.active, f.count)),
        Some((true, 1))
    );
    let log = agent.log();
    assert!(
        log.contains("state version 2; this agent reads version 1 only")
            && log.contains("faults rebuilt from the record"),
        "{log}"
    );
    assert_eq!(
        std::fs::read_to_string(data.join("state.json.v2")).unwrap(),
        newer,
        "set aside untouched"
    );
    assert_eq!(agent.stop(), 0);
}

#[test]
fn sigterm_flushes_the_latest_state() {
    let dir = tempfile::tempdir().unwrap();
    // One write allowed, then one per hour: the start-up write spends the budget, so every
    // later change waits for the shutdown flush.
    let agent = Agent::start(
        dir.path(),
        &["--write-interval", "1h", "--write-burst", "1"],
    );
    agent.wait_for("start-up write", |_| true);
    agent.append(b"4,1,100,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, Graphics Exception\n");
    agent.append(
        b"4,2,200,-;NVRM: Xid (PCI:0000:86:00): 79, pid=1, name=a, GPU has fallen off the bus.\n",
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while agent.metric("faultline_engine_events_total{kind=\"new_fault\"}") < 2.0 {
        assert!(std::time::Instant::now() < deadline, "faults not applied");
        std::thread::sleep(Duration::from_millis(10));
    }
    let before = agent.record().unwrap();
    assert!(fault(&before, "Xid79").is_none(), "still coalesced");
    let dir_state = agent.state();
    assert_eq!(agent.stop(), 0);
    let after: faultline_core::record::NodeRecord =
        serde_json::from_slice(&std::fs::read(dir_state.join("faults.json")).unwrap()).unwrap();
    assert!(
        fault(&after, "Xid13").is_some() && fault(&after, "Xid79").is_some(),
        "flushed on SIGTERM"
    );
    assert_eq!(after.health, Health::Unhealthy);
}

/// Issue 27 §1: a kernel-log fault reaches `faults.json` before `state.json` is saved. A kill
/// (SIGKILL) as soon as the record shows it, whether the state was saved by then or not, loses
/// nothing and counts nothing twice: the restart reads the record again past the saved cursor.
/// Five kills in a row, whichever write each comes after: with the record polled every 20 ms,
/// a kill rarely lands between the two (a review counted 1 in 20), so this is a guard on the
/// whole restart, which the old order (the state first) passes too; the gap itself is tested
/// deterministically by `sink::file::a_record_a_restart_makes_again_does_not_wait_for_a_slow_state`
/// (the data disk's fsync held).
#[test]
fn a_kill_as_soon_as_the_record_shows_a_fault_loses_nothing_and_counts_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    for n in 1..=5u64 {
        let mut agent = Agent::start(dir.path(), &[]);
        let since = faultline_core::time::Timestamp::now();
        agent.append(&xid79(n, "3b"));
        agent.wait_for("the fault", |r| {
            r.update_time > since && fault(r, "Xid79").is_some_and(|f| f.count >= n)
        });
        agent.child.kill().unwrap();
        agent.child.wait().unwrap();
    }
    let agent = Agent::start(dir.path(), &[]);
    // Read after the five records: once it is in, so are they.
    agent.append(b"4,6,600,-;NVRM: Xid (PCI:0000:86:00): 13, pid=1, name=a, Graphics Exception\n");
    let r = agent.wait_for("the last record", |r| fault(r, "Xid13").is_some());
    assert_eq!(fault(&r, "Xid79").map(|f| f.count), Some(5));
    assert_eq!(agent.stop(), 0);
}

/// SIGHUP, SIGUSR1, SIGUSR2 and SIGQUIT would end an agent without a flush by their default
/// action: they are handled (SIGHUP re-reads the policy, the others are logged), and the agent
/// keeps running and still flushes on SIGTERM.
#[test]
fn other_signals_neither_kill_the_agent_nor_lose_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(
        dir.path(),
        &["--write-interval", "1h", "--write-burst", "1"],
    );
    agent.wait_for("start-up write", |_| true);
    agent.append(b"4,1,100,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, Graphics Exception\n");
    wait_until("the fault applied", Duration::from_secs(30), || {
        (agent.metric("faultline_engine_events_total{kind=\"new_fault\"}") >= 1.0).then_some(())
    });
    let pid = rustix::process::Pid::from_raw(agent.child.id() as i32).unwrap();
    use rustix::process::Signal;
    for sig in [Signal::HUP, Signal::USR1, Signal::USR2, Signal::QUIT] {
        rustix::process::kill_process(pid, sig).unwrap();
    }
    wait_until("the signals handled", Duration::from_secs(10), || {
        (agent.log().matches("signal ignored").count() >= 3).then_some(())
    });
    let mut agent = agent;
    assert!(agent.child.try_wait().unwrap().is_none(), "still running");
    assert!(agent.log().contains("SIGHUP"), "{}", agent.log());
    let state = agent.state();
    assert_eq!(agent.stop(), 0);
    let after: faultline_core::record::NodeRecord =
        serde_json::from_slice(&std::fs::read(state.join("faults.json")).unwrap()).unwrap();
    assert!(fault(&after, "Xid13").is_some(), "flushed on SIGTERM");
}

/// 1,100 idle connections at the HTTP port of an agent limited to 256 open files (the usual
/// limit is 1,024; the flood is larger than either): faults that arrive meanwhile are detected
/// and written, because the server caps its connections and the descriptors the agent needs
/// stay free. Before the cap, the server took every descriptor and the record writes failed
/// with "Too many open files" until the connections closed.
#[test]
fn a_connection_flood_does_not_stop_detection_or_record_writes() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_with_file_limit(dir.path(), &[], 256);
    agent.wait_for("start-up write", |_| true);
    // This test process needs room for its own end of the flood.
    let lim = getrlimit(Resource::Nofile);
    if let Some(hard) = lim.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            },
        );
    }
    let addr = agent.addr();
    let mut flood = Vec::new();
    for _ in 0..1100 {
        if let Ok(c) = std::net::TcpStream::connect(&addr) {
            flood.push(c);
        }
    }
    assert!(flood.len() >= 1000, "the flood connected: {}", flood.len());
    for (seq, bus) in (1..).zip(["3b", "5e", "86", "af"]) {
        agent.append(&xid79(seq, bus));
    }
    let r = agent.wait_for("four faults written during the flood", |r| {
        r.faults.iter().filter(|f| f.fault_code == "Xid79").count() == 4
    });
    assert_eq!(r.health, Health::Unhealthy);
    assert!(
        !agent.log().contains("Too many open files"),
        "{}",
        agent.log()
    );
    // The flood comes from one address; a probe from another (127.0.0.2 is loopback too) is
    // still answered.
    let health = tokio::runtime::Runtime::new().unwrap().block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut c = s.connect(addr.parse().unwrap()).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").await.unwrap();
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), c.read_to_string(&mut out))
            .await
            .expect("answered")
            .unwrap();
        out
    });
    assert!(health.starts_with("HTTP/1.0 200"), "{health}");
    drop(flood);
    // Once the flood is gone the endpoints answer again, and say what they refused.
    wait_until("the metrics to answer", Duration::from_secs(40), || {
        (agent.metric("faultline_connections_refused_total{server=\"http\"}") > 0.0).then_some(())
    });
    assert_eq!(agent.stop(), 0);
}

/// A record that cannot be written does not lie: /readyz fails, the agent's own record says
/// why (DETECTOR_DOWN on `record-file`) and the metric shows the detector down; once writes
/// succeed again, all of it clears and the file holds the fault that arrived meanwhile. (Root
/// ignores permissions, so the failure here is `faults.json` replaced by a directory: the
/// rename over it fails.)
#[test]
fn a_record_that_cannot_be_written_is_visible_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_for("start-up write", |_| true);
    // The file appears a moment before the sink reports it written: readiness follows.
    wait_until(
        "ready after the first write",
        Duration::from_secs(30),
        || (agent.get("/readyz").0 == 200).then_some(()),
    );
    let faults = agent.record_path();
    std::fs::remove_file(&faults).unwrap();
    std::fs::create_dir(&faults).unwrap();
    agent.append(b"4,1,100,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, Graphics Exception\n");
    let served = wait_until(
        "DETECTOR_DOWN on record-file",
        Duration::from_secs(30),
        || {
            let (status, body) = agent.get("/v1/record");
            let r: Option<faultline_core::record::NodeRecord> = (status == 200)
                .then(|| serde_json::from_str(&body).ok())
                .flatten();
            r.filter(|r| {
                r.faults.iter().any(|f| {
                    f.fault_code == "DETECTOR_DOWN" && f.device == "record-file" && f.active
                })
            })
        },
    );
    assert!(fault(&served, "Xid13").is_some(), "detection went on");
    assert_eq!(agent.get("/readyz").0, 503);
    assert_eq!(
        agent.metric("faultline_detector_up{detector=\"record-file\"}"),
        0.0
    );
    std::fs::remove_dir(&faults).unwrap();
    let r = agent.wait_for("the record written again, the detector recovered", |r| {
        fault(r, "Xid13").is_some()
            && r.faults
                .iter()
                .any(|f| f.fault_code == "DETECTOR_DOWN" && !f.active)
    });
    assert!(r
        .agent
        .detectors
        .iter()
        .any(|d| d.name == "record-file" && d.state == "Running"));
    wait_until("ready again", Duration::from_secs(30), || {
        (agent.get("/readyz").0 == 200).then_some(())
    });
    assert_eq!(agent.stop(), 0);
}

/// A corrupt, truncated or empty state.json no longer means starting Healthy: the faults of
/// the intact faults.json are rebuilt (this boot's kernel-log faults included), and the node
/// stays Unhealthy. Before, four active SeparateNPU faults vanished this way.
/// A kernel log with more distinct faults than the default caps (80 distinct Xids on each of 20
/// GPUs, then an Xid 79 on a 21st): each GPU keeps 64 and folds the rest into its overflow fault,
/// the node keeps 1,024 and folds the rest, the Xid 79 included, into its own, which makes the
/// node Unhealthy. After a restart the agent reads back exactly the faults it wrote. Before the
/// caps nothing bounded them: 100,000 distinct faults made a state.json that the next start
/// refused as too large, losing every fault.
#[test]
fn faults_at_the_caps_are_read_back_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Vec::new();
    let mut seq = 0u64;
    for gpu in 0..20u32 {
        for x in 1000..1080u32 {
            seq += 1;
            log.extend_from_slice(
                format!(
                    "4,{seq},{},-;NVRM: Xid (PCI:0000:{:02x}:00): {x}, pid=1, name=a, test\n",
                    seq * 100,
                    0x10 + gpu
                )
                .as_bytes(),
            );
        }
    }
    log.extend_from_slice(&xid79(seq + 1, "f0"));
    std::fs::write(dir.path().join("kmsg"), &log).unwrap();
    let active = |r: &faultline_core::record::NodeRecord| {
        let mut v: Vec<(String, String, Handling, u64)> = r
            .faults
            .iter()
            .filter(|f| f.active)
            .map(|f| {
                (
                    f.fault_code.clone(),
                    f.device.clone(),
                    f.fault_handling,
                    f.count,
                )
            })
            .collect();
        v.sort();
        v
    };
    let folded_79 = |r: &faultline_core::record::NodeRecord| {
        r.faults.iter().any(|f| {
            f.active
                && f.fault_code == "FAULTS_FOLDED"
                && f.device == "node"
                && f.fault_handling == Handling::SeparateNPU
        })
    };
    let agent = Agent::start(dir.path(), &[]);
    let before = agent.wait_for("the whole log, the Xid 79 folded", folded_79);
    assert_eq!(agent.stop(), 0);
    let faults = active(&before);
    assert_eq!(before.health, Health::Unhealthy);
    // 1,024 kept (16 GPUs' overflow faults among them), and the node's overflow fault.
    assert_eq!(faults.len(), 1025, "{faults:?}");
    let per_gpu = |bus: &str| {
        faults
            .iter()
            .filter(|f| f.1 == format!("GPU-0000:{bus}:00.0"))
            .count()
    };
    assert_eq!(per_gpu("10"), 65);
    let node = faults.iter().find(|f| f.1 == "node").unwrap();
    // 20 x 80 reports, 1,024 kept or folded into a GPU's overflow fault, the rest here.
    let on_gpus: u64 = faults.iter().filter(|f| f.1 != "node").map(|f| f.3).sum();
    assert_eq!(on_gpus + node.3, 20 * 80 + 1);

    let agent = Agent::start(dir.path(), &[]);
    let after = agent.wait_for("a record written by the restarted agent", |r| {
        r.agent.heartbeat_time > before.agent.heartbeat_time
            && agent.log().contains("state restored")
    });
    assert_eq!(active(&after), faults, "the same faults after the restart");
    assert_eq!(after.health, Health::Unhealthy);
    assert!(!agent.log().contains("unreadable"), "{}", agent.log());
    assert_eq!(agent.stop(), 0);
}

#[test]
fn a_lost_state_file_is_rebuilt_from_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    for (seq, bus) in (1..).zip(["3b", "5e"]) {
        agent.append(&xid79(seq, bus));
    }
    agent.wait_for("two faults", |r| {
        r.faults.iter().filter(|f| f.fault_code == "Xid79").count() == 2
    });
    let state = agent.data();
    assert_eq!(agent.stop(), 0);
    for damage in ["truncated", "empty"] {
        let p = state.join("state.json");
        let bytes = std::fs::read(&p).unwrap();
        let kept = if damage == "empty" {
            0
        } else {
            bytes.len() / 2
        };
        std::fs::write(&p, &bytes[..kept]).unwrap();
        // The kernel log is gone too (a new file): nothing re-reads the faults from it.
        std::fs::write(dir.path().join("kmsg"), b"").unwrap();
        let agent = Agent::start(dir.path(), &[]);
        let r = agent.wait_for("the record rewritten after the restart", |r| {
            agent.log().contains("faults rebuilt from the record")
                && r.agent.detectors.iter().any(|d| d.name == "kmsg")
        });
        let active: Vec<&str> = r
            .faults
            .iter()
            .filter(|f| f.active)
            .map(|f| f.fault_code.as_str())
            .collect();
        assert_eq!(active, ["Xid79", "Xid79"], "{damage}: {:?}", r.faults);
        assert_eq!(r.health, Health::Unhealthy, "{damage}");
        assert_eq!(agent.stop(), 0);
    }
}

#[test]
fn bad_policy_is_rejected_visibly_and_detection_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, "overrides:\n  Xid43: { handling: SeparateNPU }\n").unwrap();
    let agent = Agent::start(dir.path(), &["--policy", policy.to_str().unwrap()]);
    agent.append(b"4,1,100,-;NVRM: Xid (PCI:0000:3b:00): 43, pid=1, name=a, Ch 00000010\n");
    agent.wait_for("override applied", |r| r.health == Health::Unhealthy);

    std::fs::write(&policy, "overrides:\n  Xid43: { handling: SeparateNPU }\nescalation:\n  - codes: [Xid13]\n    count: lots\n").unwrap();
    let r = agent.wait_for("policy error in record", |r| r.agent.policy.error.is_some());
    let err = r.agent.policy.error.clone().unwrap();
    assert!(
        err.contains("escalation[0].count") && err.contains("line 5"),
        "{err}"
    );
    assert_eq!(
        r.health,
        Health::Unhealthy,
        "last good policy still in force"
    );
    assert_eq!(agent.metric("faultline_policy_valid"), 0.0);
    assert!(agent.metric("faultline_policy_reloads_total{result=\"Rejected\"}") >= 1.0);

    agent.append(b"4,2,200,-;NVRM: Xid (PCI:0000:86:00): 95, pid=1, name=a, Uncontained ECC\n");
    agent.wait_for("detection continues", |r| fault(r, "Xid95").is_some());

    std::fs::write(&policy, "overrides: {}\n").unwrap();
    let r = agent.wait_for("good policy back", |r| {
        r.agent.policy.error.is_none()
            && fault(r, "Xid43").is_some_and(|f| f.fault_handling == Handling::NotHandleFault)
    });
    assert_eq!(r.health, Health::Degraded, "Xid95 alone: RestartNPU");
    assert_eq!(agent.metric("faultline_policy_valid"), 1.0);
    agent.stop();
}

#[test]
fn unreadable_kernel_log_is_a_detector_fault_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &["--kmsg-path", "/nonexistent/kmsg"]);
    let r = agent.wait_for("detector down", |r| fault(r, "DETECTOR_DOWN").is_some());
    let f = fault(&r, "DETECTOR_DOWN").unwrap();
    assert_eq!(f.device, "kmsg");
    assert!(f.message.contains("/nonexistent/kmsg"), "{}", f.message);
    assert_eq!(r.health, Health::Healthy);
    assert_eq!(agent.get("/healthz").0, 200);
    wait_until("ready", Duration::from_secs(30), || {
        (agent.get("/readyz").0 == 200).then_some(())
    });
    assert_eq!(agent.stop(), 0);
}

#[test]
fn operator_clear_and_cli() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.append(
        b"4,1,100,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=a, GPU has fallen off the bus.\n",
    );
    agent.wait_for("fault", |r| r.health == Health::Unhealthy);
    let state = agent.state();
    let (code, _, err) = common::cli(
        &["wait-healthy", "--timeout", "200ms", "--interval", "50ms"],
        &state,
    );
    assert_eq!(code, Some(1));
    assert!(err.contains("Xid79") && err.lines().count() == 1, "{err}");

    // A request the agent would reject (an empty code) is refused, not reported as cleared.
    let (code, out, err) = common::cli(&["clear", "--code", ""], &state);
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(format!("{out}{err}").contains("reject"), "{out}{err}");
    assert_eq!(agent.record().unwrap().health, Health::Unhealthy);

    // Nothing matches: exit 1, saying so and naming what is active, for a code the node does
    // not have and for the README's old example, a device name this node does not use (its
    // GPU is known from the kernel log only). Before: "cleared Xid999 on every device", exit 0.
    for args in [
        &["clear", "--code", "Xid999"][..],
        &["clear", "--code", "Xid79", "--device", "GPU-3"],
    ] {
        let (code, out, err) = common::cli(args, &state);
        assert_eq!(code, Some(1), "{args:?}: {out}{err}");
        assert!(
            err.starts_with("nothing cleared: no active fault matches --code")
                && err.contains("active: Xid79 on GPU-0000:3b:00.0")
                && err.lines().count() == 1,
            "{args:?}: {err}"
        );
        assert!(out.is_empty(), "{out}");
    }
    let (code, out, _) = common::cli(&["clear", "--code", "Xid999", "-o", "json"], &state);
    assert_eq!(code, Some(1));
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&doc["result"], &doc["cleared"]),
        (&serde_json::json!("nothingCleared"), &serde_json::json!(0))
    );
    assert_eq!(agent.record().unwrap().health, Health::Unhealthy);
    let left: Vec<_> = std::fs::read_dir(state.join("clear.d")).unwrap().collect();
    assert!(left.is_empty(), "answers read and removed: {left:?}");

    // The device as `get` shows it clears, and says what it cleared.
    let (code, out, err) = common::cli(&["clear", "--device", "GPU-0000:3b:00.0"], &state);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), "cleared 1 fault: Xid79 on GPU-0000:3b:00.0");
    let (code, _, err) = common::cli(&["wait-healthy", "--timeout", "20s"], &state);
    assert_eq!(code, Some(0), "{err}");

    let (_, out, _) = common::cli(&["get", "-o", "json", "--all"], &state);
    let r: faultline_core::record::NodeRecord = serde_json::from_str(&out).unwrap();
    assert!(!fault(&r, "Xid79").unwrap().active);
    assert!(
        r.agent.heartbeat_time.is_some(),
        "the local record has a heartbeat"
    );
    agent.stop();

    // The agent is gone: its Healthy record no longer passes once the heartbeat is stale.
    std::thread::sleep(Duration::from_millis(1500));
    let (code, _, err) = common::cli(
        &["wait-healthy", "--stale-after", "1s", "--timeout", "1s"],
        &state,
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("not alive") && err.lines().count() == 1,
        "{err}"
    );
}

/// A clear request whose field is `null` (`jq -n '{code: env.CODE}'` with `CODE` unset) is
/// refused and set aside with the reason in the log; before, it read as `{}` and cleared every
/// active fault.
#[test]
fn a_null_clear_request_is_refused_not_read_as_clear_all() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    agent.append(&xid79(1, "3b"));
    agent.wait_for("fault", |r| r.health == Health::Unhealthy);
    let requests = agent.state().join("clear.d");
    for (name, body) in [
        ("1.json", r#"{"code": null}"#),
        ("2.json", r#"{"device": null}"#),
    ] {
        std::fs::write(requests.join(name), body).unwrap();
    }
    common::wait_until("both set aside", Duration::from_secs(20), || {
        (requests.join("1.rejected").exists() && requests.join("2.rejected").exists()).then_some(())
    });
    assert!(
        agent.log().contains("invalid type: null"),
        "{}",
        agent.log()
    );
    // A request sent after them is applied: they were refused, not still in the way.
    let (code, _, err) = common::cli(&["clear", "--code", "Xid13"], &agent.state());
    assert_eq!(code, Some(1), "{err}");
    let r = agent.record().unwrap();
    assert!(fault(&r, "Xid79").unwrap().active, "nothing cleared");
    assert_eq!(r.health, Health::Unhealthy);
    agent.stop();
}

/// A fault raised under a policy that overrode its level, then restored by an agent started
/// without that override, is classified under the policy in force: from the start, when it
/// recurs, and like the same code on another device. Before, the restored Xid 13 stayed
/// NotHandleFault (even after recurring) while a new one was RestartBusiness.
#[test]
fn restored_faults_are_classified_under_the_policy_in_force() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "overrides:\n  Xid13: { handling: NotHandleFault }\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("kmsg"),
        b"4,1,1000,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, Graphics Exception\n",
    )
    .unwrap();
    let agent = Agent::start(dir.path(), &["--policy", policy.to_str().unwrap()]);
    let r = agent.wait_for("Xid 13", |r| fault(r, "Xid13").is_some());
    assert_eq!(
        fault(&r, "Xid13").unwrap().fault_handling,
        Handling::NotHandleFault
    );
    assert_eq!(agent.stop(), 0);

    // The same boot, without the override.
    let agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("the new agent's record", |r| {
        r.agent.policy.source == "builtin"
    });
    let x13 = fault(&r, "Xid13").expect("restored");
    assert_eq!(x13.count, 1, "restored, not recounted");
    assert_eq!(x13.fault_handling, Handling::RestartBusiness, "restored");
    agent.append(
        b"4,2,2000000,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, Graphics Exception\n",
    );
    agent.append(
        b"4,3,2000000,-;NVRM: Xid (PCI:0000:86:00): 13, pid=1, name=a, Graphics Exception\n",
    );
    let r = agent.wait_for("both", |r| {
        r.faults
            .iter()
            .filter(|f| f.fault_code == "Xid13")
            .map(|f| f.count)
            .sum::<u64>()
            == 3
    });
    for f in r.faults.iter().filter(|f| f.fault_code == "Xid13") {
        assert_eq!(f.fault_handling, Handling::RestartBusiness, "{f:?}");
    }
    assert_eq!(agent.stop(), 0);
}

/// A live agent keeps its record's heartbeat fresh with nothing happening: wait-healthy with a
/// bound of three heartbeats passes long after the last change.
#[test]
fn the_heartbeat_keeps_an_idle_agent_alive() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &["--heartbeat-interval", "1s"]);
    let first = agent
        .wait_for("a first record", |r| r.agent.heartbeat_time.is_some())
        .agent
        .heartbeat_time
        .unwrap();
    let later = agent
        .wait_for("a newer heartbeat", |r| {
            r.agent.heartbeat_time.is_some_and(|b| b > first)
        })
        .agent
        .heartbeat_time
        .unwrap();
    assert!(later > first);
    std::thread::sleep(Duration::from_millis(3500));
    let (code, out, err) = common::cli(&["wait-healthy", "--stale-after", "3s"], &agent.state());
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(agent.stop(), 0);
}

#[test]
fn record_validates_against_the_published_schema() {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("../../docs/record.schema.json")).unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).expect("schema compiles");

    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, "overrides: { Xid13: { handling: Sometimes } }\n").unwrap();
    std::fs::write(dir.path().join("kmsg"), mixed_replay()).unwrap();
    let agent = Agent::start(dir.path(), &["--policy", policy.to_str().unwrap()]);
    agent.wait_for("faults", |r| fault(r, "Xid48").is_some());
    agent.append(b"4,46,16000,-;NVRM: Xid (PCI:0000:86:00): 13, pid=1, name=a, x\n");
    let state = agent.state();
    // Recovered faults, an escalation source list and a policy error all appear in one record.
    common::cli(&["clear", "--code", "Xid95"], &state);
    let r = agent.wait_for("cleared", |r| fault(r, "Xid95").is_some_and(|f| !f.active));
    assert!(r.agent.policy.error.is_some());
    let value: serde_json::Value =
        serde_json::from_slice(&std::fs::read(agent.record_path()).unwrap()).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");

    // The schema is strict: it rejects what the contract does not allow.
    let mut bad = value.clone();
    bad["faults"][0]["fault_handling"] = "Reboot".into();
    assert!(!validator.is_valid(&bad));
    let mut bad = value;
    bad["health"] = "Sick".into();
    assert!(!validator.is_valid(&bad));
    agent.stop();
}

/// Issue 25 §1 through the agent: every record of tests/fixtures/forged-kernel-lines.yaml
/// (kernel lines carrying names user space chose, and user-space writes of real driver lines)
/// in the kernel log, then one real Xid: the real one is the only fault, and the user-space
/// records are counted as such.
#[test]
fn forged_kernel_lines_are_no_fault() {
    let text = std::fs::read_to_string(fixtures().join("forged-kernel-lines.yaml")).unwrap();
    let cases: Vec<serde_json::Value> = serde_saphyr::from_str(&text).unwrap();
    let mut kmsg = Vec::new();
    let mut user = 0;
    let mut last = 0;
    for c in &cases {
        let line = c["record"].as_str().unwrap();
        let r = faultline_core::parse::parse_record(line.as_bytes()).unwrap();
        user += u64::from(r.facility != 0);
        last = r.seq;
        kmsg.extend_from_slice(line.as_bytes());
        kmsg.push(b'\n');
    }
    kmsg.extend_from_slice(&xid79(last + 1, "af"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kmsg"), kmsg).unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let r = agent.wait_for("the real Xid", |r| fault(r, "Xid79").is_some());
    let faults: Vec<_> = r
        .faults
        .iter()
        .map(|f| {
            (
                f.fault_code.as_str(),
                f.pci_bus_id.as_deref(),
                f.message.as_str(),
            )
        })
        .collect();
    assert_eq!(
        faults,
        [("Xid79", Some("0000:af:00.0"), "GPU has fallen off the bus.")],
        "only the real line is a fault"
    );
    assert_eq!(r.health, Health::Unhealthy);
    assert_eq!(
        agent.metric("faultline_kmsg_user_records_total"),
        user as f64
    );
    assert_eq!(agent.stop(), 0);
}

/// The tests that write into the machine's kernel log run one at a time: each reads the whole
/// ring and waits for what it wrote.
static REAL_KMSG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The agent's arguments for reading the machine's kernel log, as on a node.
const REAL_KMSG_ARGS: [&str; 4] = [
    "--kmsg-path",
    "/dev/kmsg",
    "--boot-id-path",
    "/proc/sys/kernel/random/boot_id",
];

/// What the test reads back from the machine's kernel log: (facility, seq, message) of every
/// record in the ring now.
fn kernel_ring() -> Vec<(u32, u64, String)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut dev = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open("/dev/kmsg")
        .unwrap();
    let mut buf = vec![0u8; 16 * 1024];
    let mut out = Vec::new();
    loop {
        match dev.read(&mut buf) {
            Ok(n) => {
                if let Ok(r) = faultline_core::parse::parse_record(&buf[..n]) {
                    out.push((r.facility, r.seq, r.message.into_owned()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return out,
            Err(e) if e.raw_os_error() == Some(32) => {} // EPIPE: overwritten; go on
            Err(e) => panic!("reading /dev/kmsg: {e}"),
        }
    }
}

/// The child of `real_dev_kmsg_forgeries_are_ignored`: names its thread `comm` and takes a
/// real page fault (a read at address 8), which the kernel logs as
/// `<comm>[pid]: segfault at 8 ip … in <file>[…]`, `<file>` being the name this program was
/// run as. Never returns.
///
/// The one `unsafe` of the test suite: a page fault the kernel logs needs a bad memory access,
/// and no safe code makes one.
#[allow(unsafe_code)]
fn crash_named(comm: &str) -> ! {
    use rustix::process::{setrlimit, Resource, Rlimit};
    // No core dump: the crash is the point, not its memory.
    let _ = setrlimit(
        Resource::Core,
        Rlimit {
            current: Some(0),
            maximum: Some(0),
        },
    );
    std::fs::write("/proc/thread-self/comm", comm).expect("set comm");
    // SAFETY: none; the fault is wanted. Rust's own SIGSEGV handler sees it is not a stack
    // overflow and restores the default action, so the fault recurs and the kernel logs it.
    // SAFETY: not safe, on purpose: this process exists to die of this read.
    let v = unsafe { std::ptr::read_volatile(std::ptr::without_provenance::<u8>(8)) };
    unreachable!("read {v} at address 8")
}

/// Issue 25 §1 for real, on the machine's own kernel log (`/dev/kmsg`):
/// - an unprivileged process (uid 65534 through `setpriv`) named `Xid (3b:00): 79` segfaults,
///   and another segfaults in a program file named like an Xid 48 line: the kernel itself
///   logs both names (when `debug.exception-trace` is on; the test says what it printed);
/// - user-space writes of real driver lines to `/dev/kmsg` at each priority `<0>`..`<7>`,
///   none, `<8>` and `<30>`: as uid 65534 where the device lets it, else as root (still user
///   space: facility not 0).
///
/// The agent reading `/dev/kmsg` records none of them as a fault, before or after a restart,
/// and counts every user-space record as one. (No line user space can put in the log is a
/// fault any more, so the real device's dating and no-recount of a fault are not tested here:
/// `kmsg_reader`'s unit tests cover them.) It writes into the machine's real kernel log, so it runs only where asked:
/// `.ci/run` sets `FAULTLINE_TEST_WRITE_KMSG=1` on its throwaway machine (root). Elsewhere it
/// says it was skipped.
#[test]
fn real_dev_kmsg_forgeries_are_ignored() {
    use std::io::Write;
    use std::process::Command;
    if let Ok(comm) = std::env::var("FAULTLINE_TEST_CRASH_AS") {
        crash_named(&comm);
    }
    if std::env::var("FAULTLINE_TEST_WRITE_KMSG").as_deref() != Ok("1") {
        eprintln!("skipped: set FAULTLINE_TEST_WRITE_KMSG=1 (as root, on a machine whose kernel log may take test lines)");
        return;
    }
    let _ring = REAL_KMSG.lock().unwrap_or_else(|e| e.into_inner());
    const NOBODY: [&str; 4] = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
    ];
    // PCI addresses no machine has, unique per run: the kernel log keeps earlier runs' lines.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let domain = 0xfff0 + (nanos % 15) as u32;
    let bus = ((nanos / 15) % 250) as u8;
    let marker = format!("faultline-forge-{nanos}");

    // 1. Crashes the kernel logs, as an unprivileged user. The program is this test binary,
    // linked under a crafted name in a directory that user can read.
    let exe = std::env::current_exe().unwrap();
    let bin = tempfile::Builder::new()
        .prefix(".forge")
        .tempdir_in(exe.parent().unwrap())
        .unwrap();
    std::fs::set_permissions(
        bin.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let xid48 = bin.path().join(format!(
        "NVRM: Xid (PCI:{domain:04x}:{bus:02x}:00): 48, pid=1, name=x, {marker}"
    ));
    let plain = bin.path().join("forge");
    for link in [&xid48, &plain] {
        std::fs::hard_link(&exe, link).unwrap();
    }
    let before = kernel_ring().last().map_or(0, |r| r.1);
    let mut crashes = Vec::new();
    for (program, comm) in [(&plain, "Xid (3b:00): 79"), (&xid48, "python3")] {
        let child = Command::new(NOBODY[0])
            .args(&NOBODY[1..])
            .arg(program)
            .args([
                "--exact",
                "real_dev_kmsg_forgeries_are_ignored",
                "--test-threads=1",
            ])
            .env("FAULTLINE_TEST_CRASH_AS", comm)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("setpriv runs");
        let status = child.wait_with_output().unwrap().status;
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(11), "{comm}: SIGSEGV, got {status}");
        crashes.push(comm);
    }

    // 2. Writes to /dev/kmsg from user space, one open each (the device rate-limits per open).
    let xid = |level: &str| {
        format!("{level}NVRM: Xid (PCI:{domain:04x}:{bus:02x}:01): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. {marker}\n")
    };
    let mut lines: Vec<String> = [
        "<0>", "<1>", "<2>", "<3>", "<4>", "<5>", "<6>", "<7>", "", "<8>", "<30>",
    ]
    .iter()
    .map(|l| xid(l))
    .collect();
    lines.push(format!(
        "<3>nvidia-nvswitch3: SXid (PCI:{domain:04x}:{bus:02x}:02.0): 24007, Fatal, Link 30 {marker}\n"
    ));
    lines.push(format!(
        "<3>pcieport {domain:04x}:{bus:02x}:03.0: AER: Uncorrected (Fatal) error received: {domain:04x}:{bus:02x}:04.0 {marker}\n"
    ));
    lines.push(format!("<6>{marker} end\n"));
    let as_nobody = Command::new(NOBODY[0])
        .args(&NOBODY[1..])
        .args([
            "sh",
            "-c",
            "printf '%s' \"$1\" > /dev/kmsg",
            "sh",
            &lines[0],
        ])
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
        .success();
    for line in &lines[usize::from(as_nobody)..] {
        let mut dev = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/kmsg")
            .expect("FAULTLINE_TEST_WRITE_KMSG=1 needs a writable /dev/kmsg (root)");
        dev.write_all(line.as_bytes()).unwrap();
    }

    // What the kernel made of it all.
    let ring = kernel_ring();
    let end = ring
        .iter()
        .find(|(_, _, m)| *m == format!("{marker} end"))
        .map(|(_, seq, _)| *seq)
        .expect("the end line is in the kernel log");
    let ours: Vec<_> = ring
        .iter()
        .filter(|(_, _, m)| m.ends_with(&marker) || *m == format!("{marker} end"))
        .collect();
    assert_eq!(ours.len(), lines.len(), "{ours:#?}");
    assert!(
        ours.iter().all(|(f, _, _)| *f != 0),
        "user space cannot write facility 0: {ours:#?}"
    );
    let mut logged = 0;
    for comm in &crashes {
        // `<comm>[<tid>]: segfault at 8 …` (x86; arm64 words it differently).
        let line = ring
            .iter()
            .find(|(_, seq, m)| *seq > before && m.starts_with(&format!("{comm}[")));
        match line {
            Some((f, _, m)) => {
                assert_eq!(*f, 0, "the kernel wrote it");
                eprintln!("the kernel logged: {m}");
                logged += 1;
            }
            None => eprintln!(
                "the kernel did not log the segfault of {comm:?} (debug.exception-trace off, or \
                 rate-limited): not exercised"
            ),
        }
    }
    eprintln!(
        "user-space writes to /dev/kmsg as uid 65534: {}",
        if as_nobody {
            "allowed, done"
        } else {
            "refused by the device's mode; written as root"
        }
    );
    let upto: Vec<_> = ring.iter().filter(|(_, seq, _)| *seq <= end).collect();
    let user = upto.iter().filter(|(f, _, _)| *f != 0).count() as f64;

    // 3. The agent reads the whole ring; nothing of it is a fault of ours.
    let dir = tempfile::tempdir().unwrap();
    let args = REAL_KMSG_ARGS;
    // The agent reads the ring from its oldest record, in order: once it has read as many
    // records, and as many user-space ones, as the ring held up to the end line, it has read
    // that line and everything before it. (Skipped records after a restart are not scanned,
    // so not counted as user-space ones.)
    let caught_up = |agent: &Agent, user: f64| {
        wait_until(
            "the agent to read past the forged lines",
            Duration::from_secs(30),
            || {
                (agent.metric("faultline_kmsg_user_records_total") >= user
                    && agent.metric("faultline_kmsg_records_total") >= upto.len() as f64)
                    .then_some(())
            },
        )
    };
    let forged = |r: &faultline_core::record::NodeRecord| -> Vec<String> {
        r.faults
            .iter()
            .filter(|f| {
                f.message.contains("segfault")
                    || f.message.contains(&marker)
                    || f.pci_bus_id
                        .as_deref()
                        .is_some_and(|p| p.starts_with(&format!("{domain:04x}:{bus:02x}:")))
                    || (f.fault_code == "Xid79" && f.pci_bus_id.as_deref() == Some("0000:3b:00.0"))
            })
            .map(|f| format!("{} {:?} {}", f.fault_code, f.pci_bus_id, f.message))
            .collect()
    };
    let agent = Agent::start(dir.path(), &args);
    caught_up(&agent, user);
    let r = agent.wait_for("a record", |_| true);
    assert_eq!(forged(&r), Vec::<String>::new(), "forged faults recorded");
    assert!(agent.metric("faultline_kmsg_user_records_total") >= lines.len() as f64);
    assert_eq!(agent.stop(), 0);

    // A restart within the boot reads the ring again: still nothing.
    let agent = Agent::start(dir.path(), &args);
    caught_up(&agent, 0.0);
    assert_eq!(
        forged(&agent.wait_for("a record", |_| true)),
        Vec::<String>::new()
    );
    agent.stop();
    eprintln!("segfault lines the kernel logged and the agent ignored: {logged} of 2");
}

/// Issue 27 §2 (review): reading the real `/dev/kmsg`, the agent tells its engine how far it got
/// once the ring has been quiet a moment, so a stop after a quiet spell saves the last record
/// read: a restart reads nothing again, and a ring that wraps while the agent is down shows no
/// loss that did not happen. Before, the position was sent every 256 records (then every 4,096):
/// up to that many records behind, which a wrapped ring turned into `KMSG_LOSS` after a rollout.
/// Opt-in like `real_dev_kmsg_forgeries_are_ignored` (it writes three lines into the machine's
/// kernel log). The one real-time wait: the kernel's ring has no clock to inject.
#[test]
fn real_dev_kmsg_position_is_saved_once_the_log_is_quiet() {
    use std::io::Write;
    if std::env::var("FAULTLINE_TEST_WRITE_KMSG").as_deref() != Ok("1") {
        eprintln!("skipped: set FAULTLINE_TEST_WRITE_KMSG=1 (as root, on a machine whose kernel log may take test lines)");
        return;
    }
    let _ring = REAL_KMSG.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let args = REAL_KMSG_ARGS;
    let agent = Agent::start(dir.path(), &args);
    let ring = kernel_ring().len() as f64;
    wait_until(
        "the agent to read the ring",
        Duration::from_secs(30),
        || (agent.metric("faultline_kmsg_records_total") >= ring).then_some(()),
    );
    let marker = format!("faultline-test-quiet-{}", std::process::id());
    let read_before = agent.metric("faultline_kmsg_records_total");
    // Three lines: within the default rate limit of user-space writes (10 per 5 s).
    for i in 0..3 {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/kmsg")
            .unwrap()
            .write_all(format!("<12>{marker} {i}\n").as_bytes())
            .unwrap();
    }
    let last = kernel_ring()
        .iter()
        .filter(|(_, _, m)| m.starts_with(&marker))
        .map(|(_, seq, _)| *seq)
        .max()
        .expect("our lines are in the kernel log");
    wait_until(
        "the agent to read our lines",
        Duration::from_secs(30),
        || (agent.metric("faultline_kmsg_records_total") >= read_before + 3.0).then_some(()),
    );
    // Quiet for 20 times the reader's wait (50 ms) before the stop.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(agent.stop(), 0);
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("data/state.json")).unwrap())
            .unwrap();
    let saved = state["kmsg_cursor"].as_u64().expect("a saved position");
    assert!(
        saved >= last,
        "the saved position {saved} is behind the last record read {last}"
    );
}

/// `faultline hosts --members FILE` without Kubernetes: each member's agent is asked for its
/// record over HTTP; a member is listed only when its agent answers in time with a live,
/// accepted record of that node. An agent that is down, one that answers for another node, one
/// that sends more than a record can be, and an Unhealthy node are left out, each with why.
#[test]
fn hosts_from_the_members_file() {
    use std::io::{Read, Write};
    // One port, free on several loopback addresses: every agent listens on the same port, as
    // on real hosts.
    let port = (0..50)
        .find_map(|_| {
            let p = std::net::TcpListener::bind("127.0.0.2:0")
                .ok()?
                .local_addr()
                .ok()?
                .port();
            ["127.0.0.3", "127.0.0.5", "127.0.0.6"]
                .iter()
                .all(|ip| std::net::TcpListener::bind((*ip, p)).is_ok())
                .then_some(p)
        })
        .expect("a port free on 127.0.0.2-6");
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let listen = |ip: &str| format!("{ip}:{port}");
    let (l1, l2) = (listen("127.0.0.2"), listen("127.0.0.3"));
    let a1 = Agent::start(
        d1.path(),
        &["--no-nvml", "--node-name", "n1", "--listen", &l1],
    );
    let a2 = Agent::start(
        d2.path(),
        &["--no-nvml", "--node-name", "n2", "--listen", &l2],
    );
    a1.wait_for("n1 healthy", |r| r.health == Health::Healthy);
    a2.append(&xid79(1, "3b"));
    a2.wait_for("n2 unhealthy", |r| r.health == Health::Unhealthy);
    // A liar (answers with n1's record) and a flood (more than a record can be).
    let record = a1.get("/v1/record").1;
    let fake = |ip: &'static str, body: Vec<u8>| {
        let l = std::net::TcpListener::bind((ip, port)).unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten().take(4) {
                let mut s = s;
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf);
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(head.as_bytes());
                let _ = s.write_all(&body);
            }
        });
    };
    fake("127.0.0.5", record.into_bytes());
    fake(
        "127.0.0.6",
        vec![b' '; faultline_agent::cli::members::MAX_ANSWER_BYTES + (1 << 20)],
    );
    let members = d1.path().join("members");
    std::fs::write(
        &members,
        "# node ip:port (the peer-check port; hosts asks --agent-port)\n\
         n1 127.0.0.2:7000\nn2 127.0.0.3:7000\nn3 127.0.0.4:7000\nliar 127.0.0.5:7000\nflood 127.0.0.6:7000\n",
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
            .args(["hosts", "--members", members.to_str().unwrap()])
            .args(["--agent-port", &port.to_string(), "--agent-timeout", "2s"])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, out, err) = run(&["--slots", "4"]);
    assert_eq!((code, out.as_str()), (Some(0), "n1:4\n"), "{err}");
    let (code, out, _) = run(&["--slots", "4", "-o", "json"]);
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let why = |n: &str| -> String {
        v["leftOut"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["node"] == n)
            .map(|x| x["why"].as_str().unwrap().to_string())
            .unwrap_or_default()
    };
    assert!(why("n2").starts_with("the record says Unhealthy"), "{v}");
    assert!(why("n3").contains("127.0.0.4"), "{v}");
    assert!(why("liar").contains("answers for node \"n1\""), "{v}");
    assert!(why("flood").contains("reading the answer"), "{v}");
    // --slots is required: a record does not say how many accelerators a host has.
    let (code, _, err) = run(&[]);
    assert_eq!(code, Some(2), "{err}");
    // No agent answers at all (they listen on loopback only, or the port is wrong): a wrong
    // setup, exit 2, not an empty list.
    let only_dead = d1.path().join("dead");
    std::fs::write(&only_dead, "n3 127.0.0.4:7000\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args([
            "hosts",
            "--members",
            only_dead.to_str().unwrap(),
            "--slots",
            "4",
        ])
        .args(["--agent-port", &port.to_string(), "--agent-timeout", "1s"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no member's agent answered"), "{err}");
    drop((a1, a2));
}
