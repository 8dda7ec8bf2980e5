//! NVML source benchmarks against the fake `libnvidia-ml.so` (tests/fake-nvml), release builds:
//!
//! - pass: the cost of one polling pass over 8 GPUs with 18 NVLinks each, through the real
//!   nvml-wrapper and `RealNvml::read` (the fake's own work is included: an upper bound);
//! - event: an Xid event raised by the fake -> the local record shows it, through the agent
//!   binary; one event every 250 ms.
//!
//! `cargo bench -p faultline --bench nvml [-- pass|event] [--events N]`

#![allow(clippy::unwrap_used)] // benchmark harness: a panic is the failure report

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use faultline_agent::source::nvml::readings::{CallTracker, NvmlBackend};
use faultline_agent::source::nvml::real;
use serde_json::{json, Value};

fn fake_lib() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(cargo)
        .args(["build", "--quiet", "--release", "-p", "faultline-fake-nvml"])
        .status()
        .unwrap();
    assert!(st.success());
    let dir = Path::new(env!("CARGO_BIN_EXE_faultline-agent"))
        .parent()
        .unwrap()
        .to_path_buf();
    dir.join("libfaultline_fake_nvml.so")
}

fn state(events: Vec<Value>) -> Value {
    let gpus: Vec<Value> = (0..8)
        .map(|i| {
            json!({
                "uuid": format!("GPU-00000000-0000-0000-0000-00000000000{i}"),
                "pci_bus_id": format!("00000000:{:02X}:00.0", 0x10 + i * 0x10),
                "remap": {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0},
                "recovery_action": 0,
                "nvlinks": (0..18).map(|_| json!({"active": true})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({"driver_version": "550.54.15", "devices": gpus, "events": events})
}

fn cpu_ticks() -> u64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s[s.rfind(')').unwrap() + 2..].split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn pass(lib: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("state.json");
    std::fs::write(&p, serde_json::to_vec(&state(vec![])).unwrap()).unwrap();
    std::env::set_var("FAKE_NVML_STATE", &p); // before the library loads; single-threaded here
    std::thread::sleep(Duration::from_millis(100)); // the fake trusts its cache once the file is 50 ms old
    let nvml = real::open(Some(lib)).expect("fake NVML opens");
    let calls = CallTracker::new(std::sync::Arc::new(faultline_agent::clock::SystemClock));
    let n = nvml.device_count(&calls).unwrap();
    assert_eq!(n, 8);
    for i in 0..n {
        let _ = nvml.read(i, &calls); // warm up
    }
    let passes = 500;
    let mut times = Vec::with_capacity(passes);
    let c0 = cpu_ticks();
    let t0 = Instant::now();
    for _ in 0..passes {
        let t = Instant::now();
        for i in 0..n {
            let r = nvml.read(i, &calls);
            assert!(r.links.as_ref().map(|l| l.len() == 18).unwrap_or(false));
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu_ms_per_pass = (cpu_ticks() - c0) as f64 * 10.0 / passes as f64;
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "pass: 8 GPUs x 18 NVLinks, {passes} passes: median {:.3} ms, p99 {:.3} ms wall; {:.3} ms CPU per pass (process, {:.1} s total); goal < 5 ms: {}",
        times[passes / 2],
        times[passes * 99 / 100],
        cpu_ms_per_pass,
        wall,
        if times[passes / 2] < 5.0 { "met" } else { "NOT met" }
    );
}

fn event(lib: &Path, events: usize) {
    let dir = tempfile::tempdir().unwrap();
    let sp = dir.path().join("state.json");
    let write_state = |ev: Vec<Value>| {
        faultline_agent::atomic_file::write(&sp, &serde_json::to_vec(&state(ev)).unwrap()).unwrap();
    };
    write_state(vec![]);
    std::fs::write(
        dir.path().join("policy.yaml"),
        "nvml:\n  poll_interval: 10s\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("boot_id"), "bench\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_faultline-agent"))
        .arg("--no-kmsg")
        .arg("--nvml-lib")
        .arg(lib)
        .arg("--policy")
        .arg(dir.path().join("policy.yaml"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--boot-id-path")
        .arg(dir.path().join("boot_id"))
        .args(["--listen", "127.0.0.1:0"])
        .env("FAKE_NVML_STATE", &sp)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let rec = dir.path().join("state/faults.json");
    let running = |v: &Value| {
        v["agent"]["detectors"].as_array().is_some_and(|d| {
            d.iter()
                .any(|d| d["name"] == "nvml" && d["state"] == "Running")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(b) = std::fs::read(&rec) {
            if serde_json::from_slice::<Value>(&b).is_ok_and(|v| running(&v)) {
                break;
            }
        }
        assert!(Instant::now() < deadline, "agent did not start NVML");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let mut lat = Vec::new();
    let mut all = Vec::new();
    for k in 0..events {
        let dev = k % 8;
        let want = (k / 8 + 1) as u64;
        all.push(json!({"id": k + 1, "device": dev, "type": "xid", "xid": 31}));
        let ino = common::record_inode(&rec);
        let t0 = Instant::now();
        write_state(all.clone());
        let uuid = format!("GPU-00000000-0000-0000-0000-00000000000{dev}");
        common::wait_record(&rec, ino, t0, &format!("event {k}"), |r| {
            common::has_fault(r, "device_uuid", &uuid, Some("Xid31"), want)
        });
        lat.push(t0.elapsed().as_secs_f64() * 1e3);
        std::thread::sleep(Duration::from_millis(250).saturating_sub(t0.elapsed()));
    }
    common::terminate(&child);
    let _ = child.wait();
    lat.sort_by(|a, b| a.total_cmp(b));
    let p = |q: f64| common::quantile(&lat, q);
    println!(
        "event: {events} Xid events, fake NVML -> faults.json: median {:.2} ms, p99 {:.2} ms, max {:.2} ms (goal p99 < 100 ms: {})",
        p(0.5),
        p(0.99),
        lat[lat.len() - 1],
        if p(0.99) < 100.0 { "met" } else { "NOT met" }
    );
}

fn main() {
    let args = common::Args::from_env();
    let parts = ["event", "pass"];
    let lib = fake_lib();
    if args.wants(&parts, "event") {
        event(&lib, args.flag("--events", 400) as usize);
    }
    if args.wants(&parts, "pass") {
        pass(&lib);
    }
}
