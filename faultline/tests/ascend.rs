//! The Ascend source end to end: the real agent binary runs the fake `npu-smi` and `hccn_tool`
//! (`tests/fake-ascend`, shell scripts the test names with `--npu-smi` and `--hccn-tool`) that
//! replay recorded outputs from `tests/fixtures/ascend`; each test rewrites the replayed files
//! while the agent runs to inject faults. No Ascend hardware is involved anywhere (docs/ascend.md
//! says what that leaves unverified).

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{fault, fixtures, Agent};
use faultline_core::record::{FaultType, Handling, Health, NodeRecord, Source};
use faultline_core::time::{SignedDuration, Timestamp};

fn fixture(name: &str) -> String {
    std::fs::read_to_string(fixtures().join("ascend").join(name)).unwrap()
}

/// npu-smi's health answer (the recorded error sample) with other codes and health.
fn health_with(status: &str, codes: &str) -> String {
    let text = fixture("npu-smi-health-error.txt");
    assert!(text.contains("80E01801 80C98008") && text.contains(": Alarm"));
    text.replace("80E01801 80C98008", codes)
        .replace(": Alarm", &format!(": {status}"))
}

const CUSTOMIZATION: &str = r#"{
  "FaultFrequency": [
    {"EventId": ["80E01801"], "TimeWindow": 86400, "Times": 2, "FaultLevel": "ManuallySeparateNPU"}
  ],
  "FaultDuration": [
    {"EventId": ["81078603"], "FaultTimeout": 1, "RecoverTimeout": 2, "FaultLevel": "PreSeparateNPU"}
  ]
}"#;

struct Rig {
    agent: Agent,
    /// What the fake tools replay.
    replay: PathBuf,
    _dir: tempfile::TempDir,
}

/// The agent's own PATH in these tests: no Ascend tool is found on it, so only what the flags
/// name can run.
const PATH_WITHOUT_TOOLS: &str = "/usr/bin:/bin";

/// Writes `dir/<tool>`, a wrapper that runs the fake tool on `replay`. The agent starts tools
/// with a cleared environment, so the replay directory is written into the wrapper.
fn wrap_fake(dir: &Path, tool: &str, replay: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let fakes = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-ascend");
    let path = dir.join(tool);
    let body = format!(
        "#!/bin/sh\nFAKE_ASCEND_STATE='{}' exec '{}' \"$@\"\n",
        replay.display(),
        fakes.join(tool).display()
    );
    std::fs::write(&path, body).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

impl Rig {
    /// An 8-chip 910B node, healthy, its fake tools given with `--npu-smi` and `--hccn-tool`;
    /// `policy` goes under the test's `ascend:` settings.
    fn start(policy: &str, args: &[&str]) -> Rig {
        Rig::start_with(policy, true, args)
    }

    /// Like `start`; without `fakes`, no tool flags (and no tool on the agent's PATH).
    fn start_with(policy: &str, fakes: bool, args: &[&str]) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let replay = dir.path().join("replay");
        std::fs::create_dir_all(&replay).unwrap();
        let put = |name: &str, text: &str| std::fs::write(replay.join(name), text).unwrap();
        put("info.txt", &fixture("npu-smi-info-910b-8.txt"));
        put("health.txt", &fixture("npu-smi-health-ok.txt"));
        put("hccn-link.txt", &fixture("hccn-link-up.txt"));
        put(
            "hccn-net_health.txt",
            &fixture("hccn-net-health-success.txt"),
        );
        put("hccn-link_stat.txt", &fixture("hccn-link-stat.txt"));
        put("hccn-speed.txt", &fixture("hccn-speed.txt"));
        std::fs::write(dir.path().join("custom.json"), CUSTOMIZATION).unwrap();
        let policy_path = dir.path().join("policy.yaml");
        std::fs::write(
            &policy_path,
            format!(
                "ascend:\n  poll_interval: 200ms\n  call_timeout: 1s\n  fault_customization_file: custom.json\n{policy}"
            ),
        )
        .unwrap();
        let npu_smi = wrap_fake(dir.path(), "npu-smi", &replay);
        let hccn_tool = wrap_fake(dir.path(), "hccn_tool", &replay);
        let mut all = vec!["--policy", policy_path.to_str().unwrap(), "--no-nvml"];
        if fakes {
            all.extend_from_slice(&[
                "--npu-smi",
                npu_smi.to_str().unwrap(),
                "--hccn-tool",
                hccn_tool.to_str().unwrap(),
            ]);
        }
        all.extend_from_slice(args);
        let agent = Agent::start_env(dir.path(), &all, &[("PATH", Path::new(PATH_WITHOUT_TOOLS))]);
        Rig {
            agent,
            replay,
            _dir: dir,
        }
    }

    fn put(&self, name: &str, text: &str) {
        // Replace atomically: the agent may be reading the file this very moment.
        let tmp = self.replay.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.replay.join(name)).unwrap();
    }

    fn remove(&self, name: &str) {
        std::fs::remove_file(self.replay.join(name)).unwrap();
    }

    fn running(&self) -> NodeRecord {
        self.agent.wait_for("both Ascend detectors running", |r| {
            detector(r, "npu-smi") == Some("Running") && detector(r, "hccn_tool") == Some("Running")
        })
    }
}

fn detector<'a>(r: &'a NodeRecord, name: &str) -> Option<&'a str> {
    r.agent
        .detectors
        .iter()
        .find(|d| d.name == name)
        .map(|d| d.state.as_str())
}

fn on<'a>(
    r: &'a NodeRecord,
    code: &str,
    device: &str,
) -> Option<&'a faultline_core::record::Fault> {
    r.faults
        .iter()
        .find(|f| f.fault_code == code && f.device == device)
}

fn active_on(r: &NodeRecord, code: &str, device: &str) -> bool {
    on(r, code, device).is_some_and(|f| f.active)
}

/// A chip error code appears and clears; records use Ascend names and the operator's level
/// table.
#[test]
fn chip_error_code_appears_and_clears() {
    let rig = Rig::start("", &[]);
    let r = rig.running();
    assert!(r.faults.is_empty(), "{:?}", r.faults);
    assert_eq!(r.health, Health::Healthy);

    // Card 3 (chip 0): a listed SeparateNPU code, in lower case as some drivers print it.
    rig.put("health-3-0.txt", &health_with("Critical", "0x80e3a201"));
    let r = rig.agent.wait_for("80E3A201 on Ascend910-3", |r| {
        active_on(r, "80E3A201", "Ascend910-3")
    });
    let f = on(&r, "80E3A201", "Ascend910-3").unwrap();
    assert_eq!(f.fault_handling, Handling::SeparateNPU);
    assert_eq!(f.fault_type, FaultType::CardUnhealthy);
    assert_eq!(f.source, Source::Ascend);
    assert!(f.message.contains("HBM"), "{}", f.message);
    assert_eq!(r.health, Health::Unhealthy);

    // The code clears: the fault recovers, the chip is healthy again.
    rig.remove("health-3-0.txt");
    let r = rig.agent.wait_for("80E3A201 recovered", |r| {
        on(r, "80E3A201", "Ascend910-3").is_some_and(|f| !f.active)
    });
    assert_eq!(r.health, Health::Healthy);
    rig.agent.stop();
}

/// A port goes down (code 81078603, CardNetworkUnhealthy), lasts past the duration rule of the
/// operator's faultCustomization.json (1 s -> PreSeparateNPU) and comes back: the fault recovers
/// only after the rule's RecoverTimeout (2 s) of the port being up.
#[test]
fn link_down_escalates_by_duration_and_recovers_after_the_hold() {
    let rig = Rig::start("", &[]);
    rig.running();
    rig.put("hccn-5-link.txt", &fixture("hccn-link-down.txt"));
    let r = rig.agent.wait_for("81078603 on Ascend910-5", |r| {
        active_on(r, "81078603", "Ascend910-5")
    });
    let f = on(&r, "81078603", "Ascend910-5").unwrap();
    assert_eq!(f.fault_type, FaultType::CardNetworkUnhealthy);
    let r = rig.agent.wait_for("escalated to PreSeparateNPU", |r| {
        on(r, "81078603", "Ascend910-5")
            .is_some_and(|f| f.fault_handling == Handling::PreSeparateNPU)
    });
    let f = on(&r, "81078603", "Ascend910-5").unwrap();
    assert_eq!(f.escalated_from, Some(Handling::NotHandleFault));
    assert_eq!(r.health, Health::Degraded);
    let up_at = Timestamp::now();
    rig.remove("hccn-5-link.txt");
    let r = rig.agent.wait_for("81078603 recovered", |r| {
        on(r, "81078603", "Ascend910-5").is_some_and(|f| !f.active)
    });
    let held = on(&r, "81078603", "Ascend910-5")
        .unwrap()
        .recovered_at
        .unwrap()
        .duration_since(up_at);
    assert!(
        held >= SignedDuration::from_millis(1800),
        "recovered {held} after the port came up"
    );
    assert_eq!(r.health, Health::Healthy);
    rig.agent.stop();
}

/// 80E01801 twice within 24 h (the operator's FaultFrequency rule) -> ManuallySeparateNPU, which
/// stays after the chip stops reporting it, until `faultline clear`.
#[test]
fn frequency_escalation_to_manual_separation() {
    let rig = Rig::start("", &[]);
    rig.running();
    let code = health_with("Alarm", "80E01801");
    rig.put("health-1-0.txt", &code);
    let r = rig
        .agent
        .wait_for("80E01801", |r| active_on(r, "80E01801", "Ascend910-1"));
    assert_eq!(
        on(&r, "80E01801", "Ascend910-1").unwrap().fault_handling,
        Handling::RestartBusiness
    );
    rig.remove("health-1-0.txt");
    rig.agent.wait_for("80E01801 cleared", |r| {
        !active_on(r, "80E01801", "Ascend910-1")
    });
    rig.put("health-1-0.txt", &code);
    let r = rig.agent.wait_for("ManuallySeparateNPU", |r| {
        on(r, "80E01801", "Ascend910-1")
            .is_some_and(|f| f.active && f.fault_handling == Handling::ManuallySeparateNPU)
    });
    assert_eq!(r.health, Health::Unhealthy);
    rig.remove("health-1-0.txt");
    // Several polls later it is still there.
    std::thread::sleep(Duration::from_millis(1000));
    let r = rig.agent.record().unwrap();
    assert!(active_on(&r, "80E01801", "Ascend910-1"), "{:?}", r.faults);
    let (code, _, err) = common::cli(&["clear", "--code", "80E01801"], &rig.agent.state());
    assert_eq!(code, Some(0), "{err}");
    rig.agent.wait_for("cleared by the operator", |r| {
        !active_on(r, "80E01801", "Ascend910-1")
    });
    rig.agent.stop();
}

/// Garbage from a tool and a tool that hangs are detector faults with the reason: the agent goes
/// on detecting (a kernel-log Xid still arrives), keeps the faults it knew, and recovers when the
/// tool does.
#[test]
fn garbage_and_hangs_are_detector_faults() {
    let rig = Rig::start("", &[]);
    rig.running();
    rig.put("health-2-0.txt", &health_with("Alarm", "80E18402"));
    rig.agent
        .wait_for("80E18402", |r| active_on(r, "80E18402", "Ascend910-2"));

    // npu-smi prints garbage.
    rig.put(
        "info.txt",
        "Segmentation fault (core dumped)\n\u{0}\u{7f}garbage|||\n",
    );
    let r = rig
        .agent
        .wait_for("npu-smi down", |r| active_on(r, "DETECTOR_DOWN", "npu-smi"));
    let f = on(&r, "DETECTOR_DOWN", "npu-smi").unwrap();
    assert!(f.message.contains("npu-smi info"), "{}", f.message);
    assert!(
        active_on(&r, "80E18402", "Ascend910-2"),
        "a known fault was lost"
    );
    rig.put("info.txt", &fixture("npu-smi-info-910b-8.txt"));
    rig.agent.wait_for("npu-smi back", |r| {
        !active_on(r, "DETECTOR_DOWN", "npu-smi")
    });

    // hccn_tool prints garbage for one port.
    rig.put("hccn-6-link.txt", "link status: SIDEWAYS\n");
    let r = rig.agent.wait_for("hccn_tool down", |r| {
        active_on(r, "DETECTOR_DOWN", "hccn_tool")
    });
    assert!(on(&r, "DETECTOR_DOWN", "hccn_tool")
        .unwrap()
        .message
        .contains("Ascend910-6"));
    rig.remove("hccn-6-link.txt");
    rig.agent.wait_for("hccn_tool back", |r| {
        !active_on(r, "DETECTOR_DOWN", "hccn_tool")
    });

    // npu-smi hangs: killed at call_timeout (1 s), every poll.
    rig.put("npu-smi.hang", "");
    let r = rig
        .agent
        .wait_for("npu-smi hung", |r| active_on(r, "DETECTOR_DOWN", "npu-smi"));
    let f = on(&r, "DETECTOR_DOWN", "npu-smi").unwrap();
    assert!(f.message.contains("no answer within 1s"), "{}", f.message);
    rig.agent.append(
        b"4,200,6000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=x, GPU has fallen off the bus.\n",
    );
    let r = rig.agent.wait_for("a kernel-log Xid meanwhile", |r| {
        fault(r, "Xid79").is_some()
    });
    assert!(active_on(&r, "80E18402", "Ascend910-2"));
    rig.remove("npu-smi.hang");
    rig.agent.wait_for("npu-smi back after the hang", |r| {
        !active_on(r, "DETECTOR_DOWN", "npu-smi")
    });
    assert!(
        rig.agent
            .metric("faultline_tool_calls_total{tool=\"npu-smi\",result=\"timeout\"}")
            >= 1.0
    );
    assert!(
        rig.agent
            .metric("faultline_tool_calls_total{tool=\"npu-smi\",result=\"garbage\"}")
            >= 1.0
    );
    rig.agent.stop();
}

/// A node without the Ascend tools: both detectors idle, no faults.
#[test]
fn no_ascend_tools_is_idle() {
    let rig = Rig::start_with("", false, &[]);
    let r = rig.agent.wait_for("Ascend detectors idle", |r| {
        detector(r, "npu-smi") == Some("Idle") && detector(r, "hccn_tool") == Some("Idle")
    });
    assert!(r.faults.is_empty(), "{:?}", r.faults);
    assert_eq!(r.health, Health::Healthy);
    // A tool that is not installed is no failed call (issue 26 §2: before, every node without
    // NPUs counted failed npu-smi calls for ever), and the detector reads idle, not down.
    let m = |name: &str| rig.agent.metric(name);
    assert!(m("faultline_tool_calls_total{tool=\"npu-smi\",result=\"absent\"}") >= 1.0);
    assert_eq!(
        m("faultline_tool_calls_total{tool=\"npu-smi\",result=\"failed\"}"),
        0.0
    );
    assert_eq!(
        m("faultline_detector_state{detector=\"npu-smi\",state=\"idle\"}"),
        1.0
    );
    assert_eq!(
        m("faultline_detector_state{detector=\"npu-smi\",state=\"down\"}"),
        0.0
    );
    rig.agent.stop();
}

/// The policy is a ConfigMap, reloaded while the agent runs: it must not choose what runs as
/// root. A policy that names tool paths is refused (its error in the record, the built-in
/// policy in force), and nothing it names is ever run.
#[test]
fn tool_paths_in_the_policy_run_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran-as-root");
    let evil = dir.path().join("evil");
    std::fs::write(&evil, format!("#!/bin/sh\ntouch '{}'\n", marker.display())).unwrap();
    std::fs::set_permissions(&evil, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rig = Rig::start_with(
        &format!(
            "  npu_smi: {}\n  hccn_tool: {}\n",
            evil.display(),
            evil.display()
        ),
        false,
        &[],
    );
    let r = rig
        .agent
        .wait_for("an Ascend poll", |r| detector(r, "npu-smi").is_some());
    std::thread::sleep(Duration::from_secs(1));
    assert!(!marker.exists(), "the policy's tool path was run");
    let error = r.agent.policy.error.clone().unwrap_or_default();
    assert!(
        error.contains("npu_smi"),
        "the policy is refused: {error:?}"
    );
    // No tool from the flags: a node without the tools.
    assert_eq!(detector(&r, "npu-smi"), Some("Idle"));
    rig.agent.stop();
}

/// The API emulator with node-a, the agents' and kube-system namespaces, and the agent's token
/// allowed exactly the call tables (the public faults' one included); its kubeconfig is
/// `<dir>/kubeconfig`.
fn kube_rig() -> (
    tokio::runtime::Runtime,
    faultline_kube_emulator::Emulator,
    tempfile::TempDir,
) {
    use faultline_agent::sink::kube::calls::{API_CALLS, MINDCLUSTER_CALLS};
    use faultline_kube_emulator::UserInfo;
    use serde_json::json;
    let (rt, emu) = common::emulator();
    let rules = common::rules_for(&[API_CALLS, MINDCLUSTER_CALLS], "faultline-system");
    emu.authorize(
        "agent",
        UserInfo::service_account("faultline-system", "faultline"),
        rules,
    );
    for ns in ["faultline-system", "kube-system"] {
        emu.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}));
    }
    emu.put(faultline_kube_emulator::node(
        "node-a",
        &[("kubernetes.io/hostname", "node-a")],
    ));
    let kdir = tempfile::tempdir().unwrap();
    emu.write_kubeconfig(&kdir.path().join("kubeconfig"), "agent")
        .unwrap();
    (rt, emu, kdir)
}

/// With `public_faults` on, what the device plugin does not report itself (here a chip whose
/// health is Critical with no error code: `NPU_UNHEALTHY`) is published for ClusterD as
/// `kube-system/faultline-publicfault-<node>`, labelled `mc-consumer-publicfault=true`; when it
/// clears, a `recover` with the same faultId follows. The agent runs against the API emulator
/// with exactly the permissions of the call tables.
#[test]
fn public_faults_configmap_in_kubernetes_mode() {
    use faultline_kube_emulator::ResourceRef;
    use serde_json::{json, Value};

    let (_rt, emu, kdir) = kube_rig();
    let kubeconfig = kdir.path().join("kubeconfig");
    let rig = Rig::start(
        "  mindcluster: { public_faults: { enabled: true } }\n",
        &[
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--settle",
            "0s",
        ],
    );
    rig.running();
    let cm_ref = ResourceRef::config_map("kube-system", "faultline-publicfault-node-a");
    let message = || -> Option<(Value, Value)> {
        let cm = emu.get(&cm_ref)?;
        let m = serde_json::from_str(cm["data"]["PublicFault"].as_str()?).ok()?;
        Some((cm, m))
    };
    // A healthy node has nothing to say.
    std::thread::sleep(Duration::from_millis(600));
    assert!(message().is_none());

    rig.put("health-4-0.txt", &health_with("Critical", "NA"));
    let wait = |what: &str, f: &dyn Fn(&Value) -> bool| -> (Value, Value) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some((cm, m)) = message() {
                if f(&m) {
                    return (cm, m);
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{what}: {:?}\nrecord: {:?}\ncalls: {:?}\nlog: {}",
                message(),
                rig.agent.record().map(|r| r.faults),
                emu.calls()
                    .iter()
                    .filter(|c| c.path.contains("kube-system"))
                    .collect::<Vec<_>>(),
                rig.agent.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let (cm, m) = wait("an occur entry for Ascend910-4", &|m| {
        m["faults"].as_array().is_some_and(|f| {
            f.iter()
                .any(|x| x["assertion"] == "occur" && x["faultLocation"]["device"] == "Ascend910-4")
        })
    });
    assert_eq!(cm["metadata"]["labels"]["mc-consumer-publicfault"], "true");
    // What was published is durable state: in the data directory, which a reboot keeps (it was
    // in /run, so faults a reboot ended were never retracted). It is saved once the apply
    // succeeded, a moment after the ConfigMap appears.
    common::wait_until("the outbox saved", Duration::from_secs(10), || {
        rig.agent
            .data()
            .join("publicfault.json")
            .is_file()
            .then_some(())
    });
    assert!(!rig.agent.state().join("publicfault.json").exists());
    assert_eq!(
        (m["version"].as_str(), m["resource"].as_str()),
        (Some("1.0"), Some("faultline"))
    );
    let f = m["faults"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["faultLocation"]["device"] == "Ascend910-4")
        .unwrap()
        .clone();
    assert_eq!(f["faultType"], "NPU");
    assert_eq!(f["faultLocation"]["faultlineCode"], "NPU_UNHEALTHY");
    assert_eq!(f["influence"][0]["nodeName"], "node-a");
    assert_eq!(f["influence"][0]["deviceIds"], json!([4]));
    assert_eq!(f["faultCode"].as_str().map(str::len), Some(9));

    rig.put("health-4-0.txt", &fixture("npu-smi-health-ok.txt"));
    wait("a recover entry with the same faultId", &|m| {
        m["faults"].as_array().is_some_and(|x| {
            x.iter()
                .any(|x| x["assertion"] == "recover" && x["faultId"] == f["faultId"])
        })
    });
    rig.agent.stop();
    let refused: Vec<_> = emu
        .calls()
        .into_iter()
        .filter(|c| c.status == 403)
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
}
