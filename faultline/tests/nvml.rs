//! The NVML source end to end: the real agent binary loads the fake `libnvidia-ml.so`
//! (tests/fake-nvml) through nvml-wrapper's `lib_path`, exactly as it loads the real one. Each
//! test writes the fake's JSON state, and rewrites it while the agent runs to inject faults.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{fault, Agent};
use faultline_core::record::{FaultType, Handling, Health, NodeRecord, Source};
use serde_json::{json, Value};

/// The fake library, built (or found up to date) once per test process, so a stale copy is never
/// used.
fn fake_lib() -> PathBuf {
    static LIB: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let st = std::process::Command::new(cargo)
            .args(["build", "--quiet", "-p", "faultline-fake-nvml"])
            .status()
            .unwrap();
        assert!(st.success(), "cannot build the fake NVML library");
        let dir = Path::new(env!("CARGO_BIN_EXE_faultline-agent"))
            .parent()
            .unwrap()
            .to_path_buf();
        let lib = dir.join("libfaultline_fake_nvml.so");
        assert!(lib.exists(), "{} missing", lib.display());
        lib
    })
    .clone()
}

fn gpu(i: u32) -> Value {
    json!({
        "uuid": format!("GPU-00000000-0000-0000-0000-00000000000{i}"),
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": format!("00000000:{:02X}:00.0", 0x1a + i * 0x20),
        "ecc": {"volatile_uncorrected": 0, "aggregate_uncorrected": 0, "volatile_corrected": 0, "aggregate_corrected": 0},
        "remap": {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0},
        "recovery_action": 0,
        "nvlinks": (0..4).map(|_| json!({"active": true, "replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0})).collect::<Vec<_>>(),
        "pcie": {"cur_gen": 5, "max_gen": 5, "cur_width": 16, "max_width": 16, "replay": 0}
    })
}

struct Rig {
    agent: Agent,
    state: PathBuf,
    args: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Rig {
    /// Stops the agent, sets the fake's state while it is down, and starts it again on the same
    /// directories (a restart in the same boot).
    fn restart_with(self, next: &Value) -> Rig {
        let Rig {
            agent,
            state,
            args,
            _dir,
        } = self;
        assert_eq!(agent.stop(), 0);
        std::fs::write(&state, serde_json::to_vec_pretty(next).unwrap()).unwrap();
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let agent = Agent::start_env(_dir.path(), &a, &[("FAKE_NVML_STATE", &state)]);
        Rig {
            agent,
            state,
            args,
            _dir,
        }
    }

    fn start(state: &Value, policy: &str) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let state_path = dir.path().join("nvml-state.json");
        std::fs::write(&state_path, serde_json::to_vec_pretty(state).unwrap()).unwrap();
        let policy_path = dir.path().join("policy.yaml");
        std::fs::write(
            &policy_path,
            format!("nvml:\n  poll_interval: 200ms\n  call_timeout: 1s\n{policy}"),
        )
        .unwrap();
        let lib = fake_lib();
        let args = [
            "--nvml-lib",
            lib.to_str().unwrap(),
            "--policy",
            policy_path.to_str().unwrap(),
        ];
        let agent = Agent::start_env(dir.path(), &args, &[("FAKE_NVML_STATE", &state_path)]);
        Rig {
            agent,
            state: state_path,
            args: args.iter().map(|a| a.to_string()).collect(),
            _dir: dir,
        }
    }

    fn set(&self, state: &Value) {
        faultline_agent::atomic_file::write(
            &self.state,
            &serde_json::to_vec_pretty(state).unwrap(),
        )
        .unwrap();
    }
}

fn nvml_running_clean(r: &NodeRecord) -> bool {
    r.agent
        .detectors
        .iter()
        .any(|d| d.name == "nvml" && d.state == "Running")
}

fn two_gpus() -> Value {
    json!({"driver_version": "550.54.15", "devices": [gpu(0), gpu(1)], "events": []})
}

#[test]
fn healthy_gpus_give_no_faults_and_name_devices() {
    let rig = Rig::start(&two_gpus(), "");
    let r = rig.agent.wait_for("nvml running", nvml_running_clean);
    std::thread::sleep(Duration::from_millis(600));
    let r2 = rig.agent.record().unwrap();
    assert!(r2.faults.is_empty(), "{:#?}", r2.faults);
    assert_eq!(r.health, Health::Healthy);
    rig.agent.stop();
}

/// Every fault the NVML source detects, injected through the fake, with its code, type,
/// handling and device.
#[test]
fn injected_faults_reach_the_record() {
    type Inject = fn(&mut Value);
    let rows: &[(&str, Inject, FaultType, Handling)] = &[
        (
            "Xid79",
            |s| s["events"] = json!([{"id": 1, "device": 1, "type": "xid", "xid": 79}]),
            FaultType::CardUnhealthy,
            Handling::SeparateNPU,
        ),
        (
            "Xid48",
            |s| s["events"] = json!([{"id": 2, "device": 1, "type": "dbe"}]),
            FaultType::CardUnhealthy,
            Handling::RestartNPU,
        ),
        (
            "ECC_UNCORRECTABLE",
            |s| s["devices"][1]["ecc"]["volatile_uncorrected"] = json!(3),
            FaultType::CardUnhealthy,
            Handling::RestartNPU,
        ),
        (
            "PAGE_RETIRE_PENDING",
            |s| s["devices"][1]["pages_pending_retirement"] = json!(true),
            FaultType::CardUnhealthy,
            Handling::RestartNPU,
        ),
        (
            "REMAP_PENDING",
            |s| s["devices"][1]["remap"]["pending"] = json!(1),
            FaultType::CardUnhealthy,
            Handling::RestartNPU,
        ),
        (
            "REMAP_FAILURE",
            |s| s["devices"][1]["remap"]["failure"] = json!(1),
            FaultType::CardUnhealthy,
            Handling::SeparateNPU,
        ),
        (
            "NODE_REBOOT_REQUIRED",
            |s| s["devices"][1]["recovery_action"] = json!(2),
            FaultType::CardUnhealthy,
            Handling::SeparateNPU,
        ),
        (
            "NVLINK_DOWN",
            |s| s["devices"][1]["nvlinks"][2]["active"] = json!(false),
            FaultType::CardNetworkUnhealthy,
            Handling::PreSeparateNPU,
        ),
        (
            "NVLINK_ERRORS",
            |s| s["devices"][1]["nvlinks"][0]["crc_flit"] = json!(500),
            FaultType::CardNetworkUnhealthy,
            Handling::SubHealthFault,
        ),
        (
            "PCIE_DEGRADED",
            |s| s["devices"][1]["pcie"]["cur_width"] = json!(8),
            FaultType::CardUnhealthy,
            Handling::SubHealthFault,
        ),
        (
            "PCIE_REPLAY_ERRORS",
            |s| s["devices"][1]["pcie"]["replay"] = json!(1000),
            FaultType::CardUnhealthy,
            Handling::SubHealthFault,
        ),
        (
            "GPU_LOST",
            |s| s["devices"][1]["lost"] = json!(true),
            FaultType::CardUnhealthy,
            Handling::SeparateNPU,
        ),
    ];
    for (code, inject, ftype, handling) in rows {
        let mut state = two_gpus();
        let rig = Rig::start(&state, "");
        rig.agent.wait_for("nvml running", nvml_running_clean);
        // Let one clean pass happen first, so counters have a baseline.
        std::thread::sleep(Duration::from_millis(400));
        inject(&mut state);
        rig.set(&state);
        let r = rig.agent.wait_for(code, |r| fault(r, code).is_some());
        let f = fault(&r, code).unwrap();
        assert_eq!(
            (f.fault_type, f.fault_handling, f.active),
            (*ftype, *handling, true),
            "{code}"
        );
        assert_eq!(f.device, "GPU-1", "{code}");
        assert_eq!(f.pci_bus_id.as_deref(), Some("0000:3a:00.0"), "{code}");
        assert_eq!(
            f.device_uuid.as_deref(),
            Some("GPU-00000000-0000-0000-0000-000000000001"),
            "{code}"
        );
        assert!(
            f.source == Source::Nvml || f.also_seen_by.contains(&Source::Nvml),
            "{code}"
        );
        assert!(
            r.faults.iter().all(|f| f.device != "GPU-0"),
            "{code}: GPU-0 is healthy: {:#?}",
            r.faults
        );
        rig.agent.stop();
    }
}

#[test]
fn state_like_faults_recover_when_the_condition_goes() {
    let mut state = two_gpus();
    let rig = Rig::start(&state, "");
    rig.agent.wait_for("nvml running", nvml_running_clean);
    state["devices"][0]["nvlinks"][1]["active"] = json!(false);
    rig.set(&state);
    rig.agent.wait_for("link down", |r| {
        fault(r, "NVLINK_DOWN").is_some_and(|f| f.active)
    });
    state["devices"][0]["nvlinks"][1]["active"] = json!(true);
    rig.set(&state);
    let r = rig.agent.wait_for("link up", |r| {
        fault(r, "NVLINK_DOWN").is_some_and(|f| !f.active)
    });
    assert_eq!(r.health, Health::Healthy);
    rig.agent.stop();
}

/// A restart of the agent (same boot, state kept): an NVLink that came back while the agent was
/// down ends after one poll, and uncorrectable ECC errors that are still there are neither a
/// new fault nor counted again. Before NVML conditions were levels, the link stayed down in the
/// record (and the node tainted) forever, and the ECC count doubled.
#[test]
fn a_restart_ends_what_cleared_and_does_not_recount_what_stayed() {
    let mut state = two_gpus();
    let rig = Rig::start(&state, "");
    rig.agent.wait_for("nvml running", nvml_running_clean);
    state["devices"][0]["nvlinks"][1]["active"] = json!(false);
    state["devices"][1]["ecc"]["volatile_uncorrected"] = json!(3);
    state["devices"][1]["ecc"]["aggregate_uncorrected"] = json!(3);
    rig.set(&state);
    rig.agent.wait_for("link down and ECC", |r| {
        fault(r, "NVLINK_DOWN").is_some_and(|f| f.active)
            && fault(r, "ECC_UNCORRECTABLE").is_some_and(|f| f.active && f.count == 3)
    });
    // While the agent is down, the link comes back; the ECC errors stay.
    state["devices"][0]["nvlinks"][1]["active"] = json!(true);
    let rig = rig.restart_with(&state);
    let r = rig.agent.wait_for("link recovered after the restart", |r| {
        fault(r, "NVLINK_DOWN").is_some_and(|f| !f.active)
    });
    assert!(
        rig.agent.log().contains("state restored"),
        "a restart from saved state"
    );
    assert_eq!(
        r.faults.iter().filter(|f| f.active).count(),
        1,
        "only the ECC fault stays: {:?}",
        r.faults
    );
    // Several polls (200 ms each) later the ECC fault is the same one, with the same count.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let r = rig.agent.record().unwrap();
    let ecc = fault(&r, "ECC_UNCORRECTABLE").unwrap();
    assert!(ecc.active);
    assert_eq!(ecc.count, 3, "{ecc:?}");
    rig.agent.stop();
}

#[test]
fn missing_gpu_against_the_expected_count() {
    let rig = Rig::start(&two_gpus(), "expected_gpus: 3\n");
    let r = rig
        .agent
        .wait_for("GPU_MISSING", |r| fault(r, "GPU_MISSING").is_some());
    let f = fault(&r, "GPU_MISSING").unwrap();
    assert!(f.message.contains("2 of the 3"), "{}", f.message);
    assert_eq!(
        (f.device.as_str(), f.fault_handling),
        ("node", Handling::SeparateNPU)
    );
    assert_eq!(r.health, Health::Unhealthy);
    rig.agent.stop();
}

#[test]
fn same_xid_from_kernel_log_and_nvml_is_one_fault() {
    let mut state = two_gpus();
    let rig = Rig::start(&state, "");
    rig.agent.wait_for("nvml running", nvml_running_clean);
    rig.agent.append(b"4,1,100,-;NVRM: Xid (PCI:0000:3a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n");
    rig.agent
        .wait_for("kmsg Xid", |r| fault(r, "Xid79").is_some());
    state["events"] = json!([{"id": 7, "device": 1, "type": "xid", "xid": 79}]);
    rig.set(&state);
    let r = rig.agent.wait_for("merged", |r| {
        fault(r, "Xid79").is_some_and(|f| f.count == 2)
    });
    let xids: Vec<_> = r
        .faults
        .iter()
        .filter(|f| f.fault_code == "Xid79")
        .collect();
    assert_eq!(xids.len(), 1, "{xids:#?}");
    assert_eq!(
        (xids[0].source, xids[0].also_seen_by.clone()),
        (Source::Kmsg, vec![Source::Nvml])
    );
    assert_eq!(xids[0].device, "GPU-1");
    rig.agent.stop();
}

/// A hung NVML call marks the detector down, but the kernel log keeps being read and the record
/// keeps being written; when the call returns, the detector is up again.
#[test]
fn hung_call_blocks_nothing_else() {
    let mut state = two_gpus();
    let rig = Rig::start(&state, "");
    rig.agent.wait_for("nvml running", nvml_running_clean);
    state["devices"][1]["hang"] = json!(["nvmlDeviceGetPcieReplayCounter"]);
    rig.set(&state);
    let r = rig.agent.wait_for("detector down", |r| {
        fault(r, "DETECTOR_DOWN").is_some_and(|f| f.active)
    });
    let f = fault(&r, "DETECTOR_DOWN").unwrap();
    assert_eq!(f.device, "nvml");
    assert!(
        f.message.contains("nvmlDeviceGetPcieReplayCounter") && f.message.contains("GPU 1"),
        "{}",
        f.message
    );

    // GPU 0 is still polled while GPU 1 hangs.
    state["devices"][0]["remap"]["pending"] = json!(1);
    rig.set(&state);
    rig.agent.wait_for("GPU 0 still polled", |r| {
        fault(r, "REMAP_PENDING").is_some()
    });
    // The kernel log is still read and written through.
    rig.agent
        .append(b"4,1,100,-;NVRM: Xid (PCI:0000:3a:00): 13, pid=1, name=a, Graphics Exception\n");
    rig.agent
        .wait_for("kmsg while NVML hangs", |r| fault(r, "Xid13").is_some());

    state["devices"][1]["hang"] = json!([]);
    rig.set(&state);
    rig.agent.wait_for("detector back", |r| {
        fault(r, "DETECTOR_DOWN").is_some_and(|f| !f.active)
    });
    assert_eq!(rig.agent.stop(), 0, "shuts down cleanly even after a hang");
}

#[test]
fn no_nvml_is_idle_not_a_fault() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(
        dir.path(),
        &["--nvml-lib", "/nonexistent/libnvidia-ml.so.1"],
    );
    let r = agent.wait_for("nvml idle", |r| {
        r.agent
            .detectors
            .iter()
            .any(|d| d.name == "nvml" && d.state == "Idle")
    });
    assert!(r.faults.is_empty(), "{:#?}", r.faults);
    assert_eq!(
        agent.metric("faultline_detector_up{detector=\"nvml\"}"),
        0.0
    );
    agent.stop();
}

#[test]
fn broken_nvml_is_a_detector_fault() {
    let state = json!({"init_error": "UNKNOWN", "devices": []});
    let rig = Rig::start(&state, "");
    let r = rig
        .agent
        .wait_for("nvml down", |r| fault(r, "DETECTOR_DOWN").is_some());
    let f = fault(&r, "DETECTOR_DOWN").unwrap();
    assert_eq!(f.device, "nvml");
    assert!(f.message.contains("init"), "{}", f.message);
    assert_eq!(r.health, Health::Healthy);
    rig.agent.stop();
}

/// On Kubernetes the expected GPU count comes from the node label `nvidia.com/gpu.count` when
/// the policy does not set one. The agent runs against the API emulator; among Nodes it touches
/// only its own (another node in the emulated cluster is never read or written).
#[test]
fn expected_count_from_the_node_label() {
    use faultline_kube_emulator::UserInfo;
    let (_rt, emu) = common::emulator();
    emu.authorize(
        "t",
        UserInfo::new("agent"),
        vec![faultline_kube_emulator::Rule::new(&["*"], &["*"], &["*"])],
    );
    emu.put(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "faultline-system"}}),
    );
    emu.put(faultline_kube_emulator::node(
        "node-a",
        &[
            ("nvidia.com/gpu.count", "3"),
            ("kubernetes.io/hostname", "node-a"),
        ],
    ));
    emu.put(faultline_kube_emulator::node(
        "node-b",
        &[("nvidia.com/gpu.count", "8")],
    ));
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig, "t").unwrap();
    let state_path = dir.path().join("nvml-state.json");
    std::fs::write(&state_path, serde_json::to_vec(&two_gpus()).unwrap()).unwrap();
    let lib = fake_lib();
    let args = [
        "--nvml-lib",
        lib.to_str().unwrap(),
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
    ];
    let agent = Agent::start_env(dir.path(), &args, &[("FAKE_NVML_STATE", &state_path)]);
    let r = agent.wait_for("GPU_MISSING from the label", |r| {
        fault(r, "GPU_MISSING").is_some()
    });
    let f = fault(&r, "GPU_MISSING").unwrap();
    assert!(f.message.contains("2 of the 3"), "{}", f.message);
    agent.stop();
    let calls = emu.calls();
    let node_calls: Vec<_> = calls
        .iter()
        .filter(|c| c.path.starts_with("/api/v1/nodes"))
        .collect();
    assert!(
        node_calls
            .iter()
            .any(|c| c.method == "GET" && c.path == "/api/v1/nodes/node-a"),
        "{node_calls:?}"
    );
    // Its own Node by name, or the watch of it: a list/watch pinned by `metadata.name`.
    assert!(
        node_calls
            .iter()
            .all(|c| c.path.starts_with("/api/v1/nodes/node-a")
                || (c.path == "/api/v1/nodes"
                    && c.query.contains("fieldSelector=metadata.name%3Dnode-a"))),
        "{node_calls:?}"
    );
}
