//! Shared by `tests/through_nvml_wrapper.rs` and `examples/smoke.rs`: a scenario state, an
//! atomic state writer, and checks that read the fake through the real nvml-wrapper and compare
//! every reading with the state that was written.

#![allow(dead_code)] // each includer uses a different subset

use std::fmt::Debug;
use std::path::{Path, PathBuf};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::Nvml;
use serde_json::{json, Value};

pub type Check = Result<(), String>;

/// File name of the cdylib cargo builds for this package.
pub const LIB_NAME: &str = "libfaultline_fake_nvml.so";

/// The built cdylib, found from an executable in `target/<profile>/{deps,examples}/`: cargo's
/// copy in `target/<profile>/`, else its own output in `target/<profile>/deps/` (cargo does not
/// restore the copy if it was deleted).
pub fn lib_next_to_exe() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("exe lives in target/<profile>/<dir>/");
    let uplifted = profile_dir.join(LIB_NAME);
    let in_deps = profile_dir.join("deps").join(LIB_NAME);
    if !uplifted.exists() && in_deps.exists() {
        in_deps
    } else {
        uplifted
    }
}

/// Two GPUs: device 0 with every counter non-zero, device 1 with NvLink, remap and the
/// recovery action unsupported. An Xid 79 on device 0 and a DBE on device 1 are pending.
pub fn scenario() -> Value {
    json!({
        "driver_version": "550.54.15",
        "devices": [
            {
                "uuid": "GPU-3b6c1c2e-5f0a-4c1d-9e8b-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
                "pci_bus_id": "00000000:3B:00.0",
                "ecc": {"volatile_uncorrected": 3, "aggregate_uncorrected": 7,
                        "volatile_corrected": 11, "aggregate_corrected": 13},
                "pages_pending_retirement": true,
                "remap": {"correctable": 1, "uncorrectable": 2, "pending": 1, "failure": 0},
                "recovery_action": 1,
                "nvlinks": [
                    {"active": true, "replay": 5, "recovery": 1, "crc_flit": 2, "crc_data": 3},
                    {"active": false}
                ],
                "pcie": {"cur_gen": 4, "max_gen": 5, "cur_width": 8, "max_width": 16, "replay": 42}
            },
            {
                "uuid": "GPU-3b6c1c2e-5f0a-4c1d-9e8b-000000000001",
                "name": "NVIDIA H100 PCIe",
                "pci_bus_id": "00000000:5D:00.0",
                "ecc": {"volatile_uncorrected": 0, "aggregate_uncorrected": 0,
                        "volatile_corrected": 0, "aggregate_corrected": 0},
                "pages_pending_retirement": false,
                "remap": null,
                "recovery_action": null,
                "nvlinks": [],
                "pcie": {"cur_gen": 5, "max_gen": 5, "cur_width": 16, "max_width": 16, "replay": 0}
            }
        ],
        "events": [
            {"id": 1, "device": 0, "type": "xid", "xid": 79},
            {"id": 2, "device": 1, "type": "dbe"}
        ]
    })
}

/// Replaces the state file atomically (write a sibling, rename over), as tests should.
pub fn write_state(path: &Path, state: &Value) {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(state).expect("serialize")).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// Compares and prints one reading.
pub fn expect<T: PartialEq + Debug>(what: &str, got: T, want: T) -> Check {
    if got == want {
        println!("ok    {what}: {got:?}");
        Ok(())
    } else {
        println!("FAIL  {what}: got {got:?}, want {want:?}");
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}

fn u64_at(v: &Value, what: &str) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("scenario has no number at {what}"))
}

/// A field value as nvml-wrapper hands it over, reduced to `Ok(u32)` or the NVML error.
fn field(
    nvml_result: &Result<nvml_wrapper::struct_wrappers::device::FieldValueSample, NvmlError>,
) -> Result<u32, String> {
    match nvml_result {
        Ok(sample) => match &sample.value {
            Ok(SampleValue::U32(x)) => Ok(*x),
            Ok(other) => Err(format!("unexpected value type {other:?}")),
            Err(e) => Err(format!("{e:?}")),
        },
        Err(e) => Err(format!("{e:?}")),
    }
}

/// Reads every polled value of device `index` and compares it with `state`.
pub fn check_device(nvml: &Nvml, state: &Value, index: u32) -> Check {
    let want = &state["devices"][index as usize];
    let at = |what: &str| format!("device {index} {what}");
    let d = nvml
        .device_by_index(index)
        .map_err(|e| format!("device_by_index({index}): {e}"))?;
    expect(
        &at("uuid"),
        d.uuid().ok(),
        want["uuid"].as_str().map(String::from),
    )?;
    expect(
        &at("name"),
        d.name().ok(),
        want["name"].as_str().map(String::from),
    )?;
    expect(&at("index"), d.index().ok(), Some(index))?;
    let pci = d.pci_info().map_err(|e| format!("pci_info: {e}"))?;
    expect(
        &at("pci bus_id"),
        Some(pci.bus_id),
        want["pci_bus_id"].as_str().map(String::from),
    )?;

    let ecc = &want["ecc"];
    for (err, cnt, key) in [
        (
            MemoryError::Uncorrected,
            EccCounter::Volatile,
            "volatile_uncorrected",
        ),
        (
            MemoryError::Uncorrected,
            EccCounter::Aggregate,
            "aggregate_uncorrected",
        ),
        (
            MemoryError::Corrected,
            EccCounter::Volatile,
            "volatile_corrected",
        ),
        (
            MemoryError::Corrected,
            EccCounter::Aggregate,
            "aggregate_corrected",
        ),
    ] {
        expect(
            &at(&format!("ecc {key}")),
            d.total_ecc_errors(err, cnt).ok(),
            Some(u64_at(&ecc[key], key)),
        )?;
    }
    expect(
        &at("pages pending retirement"),
        d.are_pages_pending_retired().ok(),
        want["pages_pending_retirement"].as_bool(),
    )?;

    let ids = [142, 143, 144, 145, 230].map(FieldId);
    let fields = d
        .field_values_for(&ids)
        .map_err(|e| format!("field_values_for: {e}"))?;
    expect(&at("field count"), fields.len(), ids.len())?;
    let remap = &want["remap"];
    for (i, key) in ["correctable", "uncorrectable", "pending", "failure"]
        .iter()
        .enumerate()
    {
        let wanted = if remap.is_null() {
            Err("NotSupported".to_string())
        } else {
            Ok(u64_at(&remap[key], key) as u32)
        };
        expect(
            &at(&format!("field {} (remap {key})", 142 + i)),
            field(&fields[i]),
            wanted,
        )?;
    }
    let wanted_action = match want["recovery_action"].as_u64() {
        Some(a) => Ok(a as u32),
        None => Err("NotSupported".to_string()),
    };
    expect(
        &at("field 230 (recovery action)"),
        field(&fields[4]),
        wanted_action,
    )?;

    let links = want["nvlinks"].as_array().cloned().unwrap_or_default();
    if links.is_empty() {
        expect(
            &at("nvlink 0 state"),
            d.link_wrapper_for(0)
                .is_active()
                .map_err(|e| format!("{e:?}")),
            Err("NotSupported".into()),
        )?;
    }
    for (l, link) in links.iter().enumerate() {
        let w = d.link_wrapper_for(l as u32);
        expect(
            &at(&format!("nvlink {l} active")),
            w.is_active().ok(),
            Some(link["active"].as_bool().unwrap_or(true)),
        )?;
        for (counter, key) in [
            (ErrorCounter::DlReplay, "replay"),
            (ErrorCounter::DlRecovery, "recovery"),
            (ErrorCounter::DlCrcFlit, "crc_flit"),
            (ErrorCounter::DlCrcData, "crc_data"),
        ] {
            expect(
                &at(&format!("nvlink {l} {key}")),
                w.error_counter(counter).ok(),
                Some(link[key].as_u64().unwrap_or(0)),
            )?;
        }
    }
    if !links.is_empty() {
        let past = links.len() as u32;
        expect(
            &at(&format!("nvlink {past} (past the last)")),
            d.link_wrapper_for(past)
                .is_active()
                .map_err(|e| format!("{e:?}")),
            Err("InvalidArg".into()),
        )?;
    }

    let pcie = &want["pcie"];
    expect(
        &at("pcie cur gen"),
        d.current_pcie_link_gen().ok(),
        Some(u64_at(&pcie["cur_gen"], "cur_gen") as u32),
    )?;
    expect(
        &at("pcie max gen"),
        d.max_pcie_link_gen().ok(),
        Some(u64_at(&pcie["max_gen"], "max_gen") as u32),
    )?;
    expect(
        &at("pcie cur width"),
        d.current_pcie_link_width().ok(),
        Some(u64_at(&pcie["cur_width"], "cur_width") as u32),
    )?;
    expect(
        &at("pcie max width"),
        d.max_pcie_link_width().ok(),
        Some(u64_at(&pcie["max_width"], "max_width") as u32),
    )?;
    expect(
        &at("pcie replay"),
        d.pcie_replay_counter().ok(),
        Some(u64_at(&pcie["replay"], "replay") as u32),
    )?;
    Ok(())
}

/// Driver version, device count, then every device of `state`.
pub fn check_readings(nvml: &Nvml, state: &Value) -> Check {
    expect(
        "driver version",
        nvml.sys_driver_version().ok(),
        state["driver_version"].as_str().map(String::from),
    )?;
    let devices = state["devices"].as_array().map_or(0, Vec::len) as u32;
    expect("device count", nvml.device_count().ok(), Some(devices))?;
    for i in 0..devices {
        check_device(nvml, state, i)?;
    }
    Ok(())
}

/// Registers device 0 for Xid and DBE events and expects the scenario's Xid 79 on device 0,
/// then a timeout (device 1's DBE is for a device this set did not register).
pub fn check_xid_event(nvml: &Nvml) -> Check {
    let d0 = nvml.device_by_index(0).map_err(|e| e.to_string())?;
    let supported = d0.supported_event_types().map_err(|e| e.to_string())?;
    expect(
        "device 0 supported events",
        supported,
        EventTypes::CRITICAL_XID_ERROR
            | EventTypes::DOUBLE_BIT_ECC_ERROR
            | EventTypes::SINGLE_BIT_ECC_ERROR,
    )?;
    let set = nvml.create_event_set().map_err(|e| e.to_string())?;
    let set = d0
        .register_events(
            EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR,
            set,
        )
        .map_err(|e| e.error.to_string())?;
    let ev = set.wait(2_000).map_err(|e| format!("wait: {e}"))?;
    expect("event device index", ev.device.index().ok(), Some(0))?;
    expect("event type", ev.event_type, EventTypes::CRITICAL_XID_ERROR)?;
    let xid = match ev.event_data {
        Some(XidError::Value(x)) => Some(x),
        _ => None,
    };
    expect("event xid", xid, Some(79))?;
    expect(
        "second wait",
        set.wait(50).map(|_| ()).map_err(|e| format!("{e:?}")),
        Err("Timeout".into()),
    )?;
    Ok(())
}

/// Rewrites `state` with device 0 lost; expects GPU_IS_LOST from a held handle, from a new
/// `device_by_index`, and from an event wait on the lost device; device 1 unaffected.
pub fn check_lost(nvml: &Nvml, path: &Path, state: &Value) -> Check {
    let held = nvml.device_by_index(0).map_err(|e| e.to_string())?;
    let set = nvml.create_event_set().map_err(|e| e.to_string())?;
    let set = held
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .map_err(|e| e.error.to_string())?;
    let mut lost = state.clone();
    lost["devices"][0]["lost"] = json!(true);
    write_state(path, &lost);
    let gpu_lost = || Err::<(), String>("GpuLost".into());
    let err = |r: Result<(), NvmlError>| r.map_err(|e| format!("{e:?}"));
    expect(
        "lost: held handle uuid",
        err(held.uuid().map(drop)),
        gpu_lost(),
    )?;
    expect(
        "lost: held handle ecc",
        err(held
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .map(drop)),
        gpu_lost(),
    )?;
    expect(
        "lost: device_by_index(0)",
        err(nvml.device_by_index(0).map(drop)),
        gpu_lost(),
    )?;
    expect(
        "lost: event wait",
        err(set.wait(1_000).map(drop)),
        gpu_lost(),
    )?;
    let d1 = nvml.device_by_index(1).map_err(|e| e.to_string())?;
    expect(
        "lost: device 1 still answers",
        d1.uuid().ok(),
        state["devices"][1]["uuid"].as_str().map(String::from),
    )?;
    write_state(path, state);
    Ok(())
}
