//! The peer-check busy test (`peer::busy::NvmlBusy`) through the real nvml-wrapper against the
//! fake `libnvidia-ml.so`: GPUs with compute processes make the node busy, naming them; none,
//! not busy; an NVML that fails or cannot be loaded counts as busy ("cannot tell"). Its own
//! test binary: the fake reads its state file from this process's environment.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use faultline_agent::peer::busy::Busy;
use faultline_agent::peer::busy::NvmlBusy;
use serde_json::json;

fn fake_lib() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = std::process::Command::new(cargo)
        .args(["build", "--quiet", "-p", "faultline-fake-nvml"])
        .status()
        .unwrap();
    assert!(st.success(), "cannot build the fake NVML library");
    Path::new(env!("CARGO_BIN_EXE_faultline-agent"))
        .parent()
        .unwrap()
        .join("libfaultline_fake_nvml.so")
}

#[test]
fn compute_processes_make_the_node_busy() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("nvml-state.json");
    let write = |devices: serde_json::Value| {
        std::fs::write(
            &state,
            serde_json::to_vec(&json!({"driver_version": "550.54.15", "devices": devices}))
                .unwrap(),
        )
        .unwrap();
    };
    write(json!([{}, {"compute_processes": 2}, {"compute_processes": 1}]));
    // The only thread of this test binary that reads the environment is this one.
    std::env::set_var("FAKE_NVML_STATE", &state);
    let busy = NvmlBusy::new(Some(fake_lib()));
    assert_eq!(
        busy.busy().as_deref(),
        Some("GPU 1: 2 compute processes, GPU 2: 1 compute process")
    );
    // The job ended: not busy (the state is re-read on every call).
    write(json!([{}, {}, {}]));
    assert_eq!(busy.busy(), None);
    // NVML fails on the call: cannot tell, so busy.
    write(json!([{}, {"errors": {"nvmlDeviceGetComputeRunningProcesses_v3": "GPU_IS_LOST"}}]));
    let why = busy.busy().unwrap();
    assert!(why.starts_with("cannot tell (NVML: GPU 1:"), "{why}");
    // No NVML at all: cannot tell either.
    let none = NvmlBusy::new(Some(dir.path().join("libnvidia-ml-missing.so")));
    assert!(none.busy().unwrap().starts_with("cannot tell (NVML:"));
}
