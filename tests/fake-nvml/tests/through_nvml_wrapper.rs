//! The fake `libnvidia-ml.so`, loaded by the real nvml-wrapper exactly as the agent loads it.
//!
//! One test function: `FAKE_NVML_STATE` and the library's init count are process-global, so the
//! phases run in order. The variable is set once, before anything is loaded; phases only rewrite
//! the file it names.

mod common;

use std::ffi::CStr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{expect, write_state, Check};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::*;
use serde_json::{json, Value};

fn init(lib: &Path) -> Result<Nvml, NvmlError> {
    Nvml::builder().lib_path(lib.as_os_str()).init()
}

fn dbg_err<T>(r: Result<T, NvmlError>) -> Result<T, String> {
    r.map_err(|e| format!("{e:?}"))
}

/// Missing, invalid and `init_error` states make init fail with the right error.
fn init_failures(lib: &Path, path: &Path) -> Check {
    let _ = std::fs::remove_file(path);
    expect(
        "init, no state file",
        dbg_err(init(lib).map(drop)),
        Err("Unknown".into()),
    )?;
    std::fs::write(path, "{\"devices\": [").expect("write");
    expect(
        "init, truncated JSON",
        dbg_err(init(lib).map(drop)),
        Err("Unknown".into()),
    )?;
    write_state(path, &json!({"devcies": []}));
    expect(
        "init, unknown key",
        dbg_err(init(lib).map(drop)),
        Err("Unknown".into()),
    )?;
    write_state(path, &json!({"init_error": "DRIVER_NOT_LOADED"}));
    expect(
        "init, init_error",
        dbg_err(init(lib).map(drop)),
        Err("DriverNotLoaded".into()),
    )?;
    write_state(path, &json!({"errors": {"nvmlInit_v2": "NO_PERMISSION"}}));
    expect(
        "init, injected",
        dbg_err(init(lib).map(drop)),
        Err("NoPermission".into()),
    )?;
    Ok(())
}

/// The DBE on device 1, then an event appended to the state while a wait is blocked.
fn more_events(nvml: &Nvml, path: &Path, state: &Value) -> Check {
    let set = dbg_err(nvml.create_event_set())?;
    let mut set = set;
    for i in 0..2 {
        let d = dbg_err(nvml.device_by_index(i))?;
        set = d
            .register_events(
                EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR,
                set,
            )
            .map_err(|e| e.error.to_string())?;
    }
    let ev = dbg_err(set.wait(1_000))?;
    expect("dbe event device", ev.device.index().ok(), Some(1))?;
    expect(
        "dbe event type",
        ev.event_type,
        EventTypes::DOUBLE_BIT_ECC_ERROR,
    )?;
    expect("dbe event data", ev.event_data.is_none(), true)?;
    expect(
        "already delivered",
        dbg_err(set.wait(0).map(drop)),
        Err("Timeout".into()),
    )?;

    // Unregistered type (SBE) stays pending; a new Xid arrives while waiting.
    let mut next = state.clone();
    next["events"].as_array_mut().expect("events").extend([
        json!({"id": 3, "device": 0, "type": "sbe"}),
        json!({"id": 4, "device": 0, "type": "xid", "xid": 48}),
    ]);
    std::thread::scope(|s| {
        // EventSet is Send, not Sync: the waiting thread owns it.
        let waiter = s.spawn(move || {
            let t = Instant::now();
            set.wait(5_000)
                .map(|e| (e.device.index().ok(), e.event_data, t.elapsed()))
        });
        std::thread::sleep(Duration::from_millis(100));
        write_state(path, &next);
        let (index, data, took) = dbg_err(waiter.join().expect("waiter"))?;
        expect("late event device", index, Some(0))?;
        expect("late event xid", data, Some(XidError::Value(48)))?;
        expect(
            "late event delivered promptly",
            took < Duration::from_millis(2_000),
            true,
        )
    })?;
    // The SBE (id 3) is delivered to a set registered for it.
    let set2 = dbg_err(nvml.create_event_set())?;
    let set2 = dbg_err(nvml.device_by_index(0))?
        .register_events(EventTypes::SINGLE_BIT_ECC_ERROR, set2)
        .map_err(|e| e.error.to_string())?;
    expect(
        "sbe event type",
        dbg_err(set2.wait(1_000)).map(|e| e.event_type),
        Ok(EventTypes::SINGLE_BIT_ECC_ERROR),
    )?;
    // Registering types the device does not support fails (and nvml-wrapper frees the set).
    let set3 = dbg_err(nvml.create_event_set())?;
    let r = dbg_err(nvml.device_by_index(0))?.register_events(EventTypes::PSTATE_CHANGE, set3);
    expect(
        "register pstate",
        r.map(drop).map_err(|e| format!("{:?}", e.error)),
        Err("NotSupported".into()),
    )?;
    write_state(path, state);
    Ok(())
}

/// Global and per-device injected errors, and a per-device `SUCCESS` overriding a global one.
fn injected_errors(nvml: &Nvml, path: &Path, state: &Value) -> Check {
    let mut s = state.clone();
    s["errors"] = json!({"nvmlDeviceGetPcieReplayCounter": "UNKNOWN", "nvmlDeviceGetCount_v2": "NO_PERMISSION"});
    s["devices"][0]["errors"] = json!({"nvmlDeviceGetPcieReplayCounter": "SUCCESS"});
    s["devices"][1]["errors"] =
        json!({"nvmlDeviceGetTotalEccErrors": "GPU_IS_LOST", "nvmlDeviceGetName": "GPU_NOT_FOUND"});
    write_state(path, &s);
    let d0 = dbg_err(nvml.device_by_index(0))?;
    let d1 = dbg_err(nvml.device_by_index(1))?;
    expect(
        "injected: count",
        dbg_err(nvml.device_count()),
        Err("NoPermission".into()),
    )?;
    expect(
        "injected: dev 0 replay (overridden)",
        dbg_err(d0.pcie_replay_counter()),
        Ok(42),
    )?;
    expect(
        "injected: dev 1 replay",
        dbg_err(d1.pcie_replay_counter()),
        Err("Unknown".into()),
    )?;
    let ecc = |d: &Device<'_>| {
        dbg_err(d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile))
    };
    expect("injected: dev 0 ecc", ecc(&d0), Ok(3))?;
    expect("injected: dev 1 ecc", ecc(&d1), Err("GpuLost".into()))?;
    expect("injected: dev 1 uuid unaffected", d1.uuid().is_ok(), true)?;
    // Codes newer than nvml-wrapper 0.13 knows come through as UnexpectedVariant.
    expect(
        "injected: dev 1 name",
        dbg_err(d1.name()),
        Err("UnexpectedVariant(28)".into()),
    )?;
    write_state(path, state);
    expect(
        "injected: cleared",
        dbg_err(d1.pcie_replay_counter()),
        Ok(0),
    )?;
    Ok(())
}

/// A listed call blocks until the state no longer lists it; other devices are not blocked.
fn hangs(nvml: &Nvml, path: &Path, state: &Value) -> Check {
    let d0 = dbg_err(nvml.device_by_index(0))?;
    let d1 = dbg_err(nvml.device_by_index(1))?;
    for (what, global) in [("global hang", true), ("device-1 hang", false)] {
        let mut s = state.clone();
        if global {
            s["hang"] = json!(["nvmlDeviceGetUUID"]);
        } else {
            s["devices"][1]["hang"] = json!(["nvmlDeviceGetUUID"]);
        }
        write_state(path, &s);
        std::thread::scope(|scope| {
            let call = scope.spawn(|| d1.uuid());
            if !global {
                expect(
                    &format!("{what}: device 0 answers"),
                    d0.uuid().is_ok(),
                    true,
                )?;
            }
            std::thread::sleep(Duration::from_millis(200));
            expect(
                &format!("{what}: still blocked after 200 ms"),
                call.is_finished(),
                false,
            )?;
            write_state(path, state);
            let released = Instant::now();
            let got = call.join().expect("hung call");
            expect(
                &format!("{what}: answers once released"),
                got.ok(),
                state["devices"][1]["uuid"].as_str().map(String::from),
            )?;
            expect(
                &format!("{what}: released promptly"),
                released.elapsed() < Duration::from_millis(1_000),
                true,
            )
        })?;
    }
    Ok(())
}

/// Rewrites take effect at once, `device_count` overrides, reset-required, bad handles.
fn misc(nvml: &Nvml, path: &Path, state: &Value) -> Check {
    let d0 = dbg_err(nvml.device_by_index(0))?;
    for n in 1..=5u64 {
        let mut s = state.clone();
        s["devices"][0]["ecc"]["volatile_uncorrected"] = json!(n);
        write_state(path, &s);
        // No sleep: the very next call must see it (a changed file is re-read at once).
        let got = dbg_err(d0.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile));
        expect(&format!("rewrite {n} seen on the next call"), got, Ok(n))?;
    }

    let mut s = state.clone();
    s["device_count"] = json!(3);
    s["devices"][1]["reset_required"] = json!(true);
    write_state(path, &s);
    expect("device_count override", dbg_err(nvml.device_count()), Ok(3))?;
    expect(
        "index beyond devices",
        dbg_err(nvml.device_by_index(2).map(drop)),
        Err("NoPermission".into()),
    )?;
    expect(
        "index beyond count",
        dbg_err(nvml.device_by_index(3).map(drop)),
        Err("InvalidArg".into()),
    )?;
    expect(
        "reset required",
        dbg_err(nvml.device_by_index(1).map(drop)),
        Err("ResetRequired".into()),
    )?;

    // SAFETY: deliberately bogus handle value; the fake validates and never dereferences it.
    let bogus = unsafe { Device::new(std::ptr::without_provenance_mut(99), nvml) };
    expect(
        "bogus handle",
        dbg_err(bogus.uuid()),
        Err("InvalidArg".into()),
    )?;

    std::fs::write(path, "not json").expect("write");
    expect(
        "invalid state while initialized",
        dbg_err(d0.index()),
        Err("Unknown".into()),
    )?;
    write_state(path, state);
    expect("valid again", dbg_err(d0.index()), Ok(0))?;
    Ok(())
}

/// Raw C ABI corners nvml-wrapper never hits.
fn raw_abi(nvml: &Nvml) -> Check {
    let lib = nvml.lib();
    let d0 = dbg_err(nvml.device_by_index(0))?;
    // SAFETY: buffers and out-pointers below are valid for what each call may write.
    unsafe {
        let h = d0.handle();
        let mut small = [0 as std::ffi::c_char; 8];
        expect(
            "uuid into 8 bytes",
            lib.nvmlDeviceGetUUID(h, small.as_mut_ptr(), 8),
            nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE,
        )?;
        expect(
            "null out-pointer",
            lib.nvmlDeviceGetIndex(h, std::ptr::null_mut()),
            nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        )?;
        expect(
            "null device",
            lib.nvmlDeviceGetIndex(std::ptr::null_mut(), &mut 0),
            nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        )?;
        let mut fields: [nvmlFieldValue_t; 1] = std::mem::zeroed();
        expect(
            "zero field values",
            lib.nvmlDeviceGetFieldValues(h, 0, fields.as_mut_ptr()),
            nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        )?;
        fields[0].fieldId = 142;
        expect(
            "one field value",
            lib.nvmlDeviceGetFieldValues(h, 1, fields.as_mut_ptr()),
            nvmlReturn_enum_NVML_SUCCESS,
        )?;
        expect(
            "  its type",
            fields[0].valueType,
            nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT,
        )?;
        expect("  as ullVal too", fields[0].value.ullVal, 1)?;
        expect("  timestamp set", fields[0].timestamp > 0, true)?;
        let mut pci: nvmlPciInfo_t = std::mem::zeroed();
        expect(
            "pci info",
            lib.nvmlDeviceGetPciInfo_v3(h, &mut pci),
            nvmlReturn_enum_NVML_SUCCESS,
        )?;
        expect(
            "  legacy bus id",
            CStr::from_ptr(pci.busIdLegacy.as_ptr()).to_str().ok(),
            Some("0000:3B:00.0"),
        )?;
        expect(
            "  domain/bus/device",
            (pci.domain, pci.bus, pci.device),
            (0, 0x3B, 0),
        )?;
        expect("  pci device id", pci.pciDeviceId, 0x2330_10DE)?;
        expect(
            "free a garbage set",
            lib.nvmlEventSetFree(std::ptr::without_provenance_mut(12345)),
            nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        )?;
        let msg = CStr::from_ptr(lib.nvmlErrorString(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST));
        expect("error string", msg.to_str().ok(), Some("GPU is lost"))?;
        let mut data: nvmlEventData_t = std::mem::zeroed();
        let mut set: nvmlEventSet_t = std::ptr::null_mut();
        expect(
            "create set",
            lib.nvmlEventSetCreate(&mut set),
            nvmlReturn_enum_NVML_SUCCESS,
        )?;
        expect(
            "wait, nothing registered",
            lib.nvmlEventSetWait_v2(set, &mut data, 0),
            nvmlReturn_enum_NVML_ERROR_TIMEOUT,
        )?;
        expect(
            "free set",
            lib.nvmlEventSetFree(set),
            nvmlReturn_enum_NVML_SUCCESS,
        )?;
        expect(
            "double free",
            lib.nvmlEventSetFree(set),
            nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        )?;
        expect(
            "wait on freed set",
            lib.nvmlEventSetWait_v2(set, &mut data, 0),
            nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        )?;
    }
    Ok(())
}

#[test]
fn fake_nvml_through_nvml_wrapper() {
    let lib = common::lib_next_to_exe();
    assert!(lib.exists(), "{} not built", lib.display());
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.json");
    // Set once, before the library is loaded or any thread runs.
    std::env::set_var("FAKE_NVML_STATE", &path);
    let state = common::scenario();

    let run = || -> Check {
        init_failures(&lib, &path)?;
        write_state(&path, &state);
        let nvml = init(&lib).map_err(|e| format!("init: {e}"))?;
        common::check_readings(&nvml, &state)?;
        common::check_xid_event(&nvml)?;
        more_events(&nvml, &path, &state)?;
        injected_errors(&nvml, &path, &state)?;
        hangs(&nvml, &path, &state)?;
        misc(&nvml, &path, &state)?;
        raw_abi(&nvml)?;
        common::check_lost(&nvml, &path, &state)?;
        nvml.shutdown().map_err(|e| format!("shutdown: {e}"))
    };
    if let Err(e) = run() {
        panic!("{e}");
    }
}
