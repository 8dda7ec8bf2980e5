//! The exported NVML entry points.
//!
//! Every function has the exact name and C signature of its `nvml.h` counterpart (as generated
//! in `nvml_wrapper_sys::bindings`). Shared contract, which is NVML's own:
//!
//! * pointer arguments are either null (answered with `NVML_ERROR_INVALID_ARGUMENT`) or valid
//!   for the access NVML documents (`length` bytes for string buffers, `valuesCount` entries
//!   for `nvmlDeviceGetFieldValues`, one value otherwise);
//! * device and event-set handles are opaque: they encode an index / registry id, are checked on
//!   every call, and a bad one is `NVML_ERROR_INVALID_ARGUMENT`, never undefined behaviour;
//! * nothing unwinds out: each body runs under `catch_unwind`, a panic is `NVML_ERROR_UNKNOWN`.
//!
//! Order of checks in a device call: state loads (else UNKNOWN) -> initialized (else
//! UNINITIALIZED) -> handle valid (else INVALID_ARGUMENT) -> blocks while listed in `hang` ->
//! injected error from `errors` (device's own first; an injected `SUCCESS` means "behave
//! normally") -> `lost` (GPU_IS_LOST) -> `reset_required` (RESET_REQUIRED) -> the answer.

// One contract for all of them, documented above.
#![allow(clippy::missing_safety_doc)]
// Parameter names are nvml.h's.
#![allow(non_snake_case)]

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nvml_wrapper_sys::bindings::*;

use crate::state::{self, Device, State, SUPPORTED_EVENT_TYPES};

type Ret = nvmlReturn_t;

const SUCCESS: Ret = nvmlReturn_enum_NVML_SUCCESS;
const UNINITIALIZED: Ret = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const INVALID_ARGUMENT: Ret = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: Ret = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NO_PERMISSION: Ret = nvmlReturn_enum_NVML_ERROR_NO_PERMISSION;
const INSUFFICIENT_SIZE: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const TIMEOUT: Ret = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const GPU_IS_LOST: Ret = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
const RESET_REQUIRED: Ret = nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;
const UNKNOWN: Ret = nvmlReturn_enum_NVML_ERROR_UNKNOWN;

/// How often blocked calls (hangs, event waits) look at the state file again.
const POLL: Duration = Duration::from_millis(10);

/// `pciSubSystemId` reported for every device (H100 SXM5 board, NVIDIA).
const PCI_SUBSYSTEM_ID: u32 = 0x16C1_10DE;

/// NVML reference-counts init/shutdown.
static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

/// What one event set is registered for: `(device index, event mask)` pairs.
type Registrations = Vec<(u32, u64)>;

/// Live event sets: registry id -> registrations.
static EVENT_SETS: Mutex<Option<HashMap<usize, Registrations>>> = Mutex::new(None);
/// First event-set id; far from device handles (1..=devices) so the two never alias.
static NEXT_SET_ID: AtomicUsize = AtomicUsize::new(0x5E7_0001);

/// Event ids already delivered to this process (through any set).
static DELIVERED: Mutex<Option<HashSet<u64>>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs an entry point's body: `Err(code)` and panics become return codes.
fn guarded(body: impl FnOnce() -> Result<(), Ret>) -> Ret {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

fn current() -> Result<Arc<State>, Ret> {
    state::load().map_err(|_| UNKNOWN)
}

fn require_init() -> Result<(), Ret> {
    if INIT_COUNT.load(Ordering::SeqCst) == 0 {
        Err(UNINITIALIZED)
    } else {
        Ok(())
    }
}

/// Blocks while `function` is listed in `hang` (globally or for `device`) in the current state.
fn sit_out_hang(function: &str, device: Option<u32>, mut s: Arc<State>) -> Result<Arc<State>, Ret> {
    while s.hangs(function, device) {
        std::thread::sleep(POLL);
        s = current()?;
    }
    Ok(s)
}

fn injected(s: &State, function: &str, device: Option<u32>) -> Result<(), Ret> {
    match s.injected(function, device) {
        Some(code) if code != SUCCESS => Err(code),
        _ => Ok(()),
    }
}

/// Prologue of calls that take no device.
fn enter(function: &str) -> Result<Arc<State>, Ret> {
    let s = current()?;
    require_init()?;
    let s = sit_out_hang(function, None, s)?;
    injected(&s, function, None)?;
    Ok(s)
}

/// Device checks once the index is known: hang, injected error, lost, reset required.
fn device_checks(function: &str, index: u32, s: Arc<State>) -> Result<Arc<State>, Ret> {
    let s = sit_out_hang(function, Some(index), s)?;
    let d = device(&s, index)?;
    injected(&s, function, Some(index))?;
    if d.lost {
        return Err(GPU_IS_LOST);
    }
    if d.reset_required {
        return Err(RESET_REQUIRED);
    }
    Ok(s)
}

/// Prologue of calls that take a device handle; gives the state and the device index.
fn enter_device(function: &str, handle: nvmlDevice_t) -> Result<(Arc<State>, u32), Ret> {
    let s = current()?;
    require_init()?;
    let index = index_of(&s, handle)?;
    let s = device_checks(function, index, s)?;
    Ok((s, index))
}

fn device(s: &State, index: u32) -> Result<&Device, Ret> {
    s.device(index).ok_or(INVALID_ARGUMENT)
}

/// Device handles are `index + 1` as a pointer value.
fn handle_for(index: u32) -> nvmlDevice_t {
    std::ptr::without_provenance_mut(index as usize + 1)
}

fn index_of(s: &State, handle: nvmlDevice_t) -> Result<u32, Ret> {
    let v = handle.addr();
    if v == 0 || v > s.devices.len() {
        return Err(INVALID_ARGUMENT);
    }
    u32::try_from(v - 1).map_err(|_| INVALID_ARGUMENT)
}

fn set_handle(id: usize) -> nvmlEventSet_t {
    std::ptr::without_provenance_mut(id)
}

/// Writes `value` through `out`, or INVALID_ARGUMENT if `out` is null.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), Ret> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and valid for writes per the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Copies `s` and a NUL into the caller's `length`-byte buffer.
///
/// # Safety
/// `buf` is null or valid for `length` bytes of writes.
unsafe fn put_str(buf: *mut c_char, length: c_uint, s: &str) -> Result<(), Ret> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    if s.len() + 1 > length as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` has room for `length >= s.len() + 1` bytes; the regions cannot overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), buf, s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}

/// `s` as a NUL-terminated fixed-size C array (truncated to fit).
fn c_array<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N.saturating_sub(1))) {
        *o = b as c_char;
    }
    out
}

fn enable_state(on: bool) -> nvmlEnableState_t {
    if on {
        nvmlEnableState_enum_NVML_FEATURE_ENABLED
    } else {
        nvmlEnableState_enum_NVML_FEATURE_DISABLED
    }
}

fn init(function: &str) -> Result<(), Ret> {
    let s = current()?;
    let s = sit_out_hang(function, None, s)?;
    injected(&s, function, None)?;
    if let Some(code) = s.init_error {
        if code.0 != SUCCESS {
            return Err(code.0);
        }
    }
    INIT_COUNT.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    guarded(|| init("nvmlInit_v2"))
}

/// Flags (`NVML_INIT_FLAG_NO_GPUS`, `NVML_INIT_FLAG_NO_ATTACH`) are accepted and ignored.
#[no_mangle]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    guarded(|| init("nvmlInitWithFlags"))
}

/// Drops one init reference. Works even when the state file is gone (then answers UNKNOWN
/// after doing it), so dropping an `Nvml` at the end of a test never leaks the reference.
#[no_mangle]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guarded(|| {
        let loaded = current();
        if let Ok(s) = &loaded {
            let s = sit_out_hang("nvmlShutdown", None, Arc::clone(s))?;
            injected(&s, "nvmlShutdown", None)?;
        }
        INIT_COUNT
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map_err(|_| UNINITIALIZED)?;
        loaded.map(drop)
    })
}

fn error_string(code: nvmlReturn_t) -> &'static CStr {
    match code {
        nvmlReturn_enum_NVML_SUCCESS => c"Success",
        nvmlReturn_enum_NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED => c"Already Initialized",
        nvmlReturn_enum_NVML_ERROR_NOT_FOUND => c"Not Found",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER => c"Insufficient External Power",
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        nvmlReturn_enum_NVML_ERROR_TIMEOUT => c"Timeout",
        nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE => c"Interrupt Request Issue",
        nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND => c"NVML Shared Library Not Found",
        nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM => c"Corrupted infoROM",
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED => c"GPU requires restart",
        nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM => {
            c"The operating system has blocked the request"
        }
        nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH => {
            c"RM has detected an NVML/RM version mismatch"
        }
        nvmlReturn_enum_NVML_ERROR_IN_USE => c"In use by another client",
        nvmlReturn_enum_NVML_ERROR_MEMORY => c"Insufficient Memory",
        nvmlReturn_enum_NVML_ERROR_NO_DATA => c"No data",
        nvmlReturn_enum_NVML_ERROR_VGPU_ECC_NOT_SUPPORTED => {
            c"The requested vgpu operation is not available on target device, because ECC is enabled"
        }
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => c"Insufficient Resources",
        nvmlReturn_enum_NVML_ERROR_FREQ_NOT_SUPPORTED => c"Frequency Not Supported",
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument Version Mismatch",
        nvmlReturn_enum_NVML_ERROR_DEPRECATED => c"Deprecated",
        nvmlReturn_enum_NVML_ERROR_NOT_READY => c"Not Ready",
        nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND => c"GPU Not Found",
        nvmlReturn_enum_NVML_ERROR_INVALID_STATE => c"Invalid State",
        nvmlReturn_enum_NVML_ERROR_RESET_TYPE_NOT_SUPPORTED => c"Reset Type Not Supported",
        _ => c"Unknown Error",
    }
}

/// Static, NUL-terminated; never null. Needs no init and no state file.
#[no_mangle]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    catch_unwind(|| error_string(result))
        .unwrap_or(c"Unknown Error")
        .as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guarded(|| {
        let s = enter("nvmlSystemGetDriverVersion")?;
        // SAFETY: `version` is null or valid for `length` bytes (NVML contract).
        unsafe { put_str(version, length, &s.driver_version) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(deviceCount: *mut c_uint) -> nvmlReturn_t {
    guarded(|| {
        let s = enter("nvmlDeviceGetCount_v2")?;
        // SAFETY: null or valid (NVML contract).
        unsafe { put(deviceCount, s.count()) }
    })
}

/// Index < count but beyond `devices` (a `device_count` override) answers NO_PERMISSION, as
/// NVML does for a GPU the caller may not open.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guarded(|| {
        let function = "nvmlDeviceGetHandleByIndex_v2";
        let s = current()?;
        require_init()?;
        if device.is_null() || index >= s.count() {
            return Err(INVALID_ARGUMENT);
        }
        if s.device(index).is_none() {
            return Err(NO_PERMISSION);
        }
        device_checks(function, index, s)?;
        // SAFETY: checked non-null; valid per NVML contract.
        unsafe { put(device, handle_for(index)) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetUUID", device)?;
        let value = self::device(&s, i)?.uuid_for(i);
        // SAFETY: null or valid for `length` bytes (NVML contract).
        unsafe { put_str(uuid, length, &value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetName", device)?;
        let d = self::device(&s, i)?;
        // SAFETY: null or valid for `length` bytes (NVML contract).
        unsafe { put_str(name, length, &d.name) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    guarded(|| {
        let (_, i) = enter_device("nvmlDeviceGetIndex", device)?;
        // SAFETY: null or valid (NVML contract).
        unsafe { put(index, i) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetPciInfo_v3", device)?;
        let d = self::device(&s, i)?;
        let addr = d.pci_for(i);
        let info = nvmlPciInfo_t {
            busIdLegacy: c_array(&addr.bus_id_legacy()),
            domain: addr.domain,
            bus: addr.bus,
            device: addr.device,
            pciDeviceId: d.pci_device_id,
            pciSubSystemId: PCI_SUBSYSTEM_ID,
            busId: c_array(&addr.bus_id()),
        };
        // SAFETY: null or valid (NVML contract).
        unsafe { put(pci, info) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    errorType: nvmlMemoryErrorType_t,
    counterType: nvmlEccCounterType_t,
    eccCounts: *mut c_ulonglong,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetTotalEccErrors", device)?;
        let value = self::device(&s, i)?.ecc_total(errorType, counterType)?;
        // SAFETY: null or valid (NVML contract).
        unsafe { put(eccCounts, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    device: nvmlDevice_t,
    isPending: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetRetiredPagesPendingStatus", device)?;
        let pending = self::device(&s, i)?
            .pages_pending_retirement
            .ok_or(NOT_SUPPORTED)?;
        // SAFETY: null or valid (NVML contract).
        unsafe { put(isPending, enable_state(pending)) }
    })
}

/// `compute_processes` processes (pids 1000, 1001, ..., 1 GiB each). With too little room (or a
/// null array) it answers `INSUFFICIENT_SIZE` with the count, as NVML does; nvml-wrapper asks
/// for the count that way.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetComputeRunningProcesses_v3", device)?;
        let n = self::device(&s, i)?.compute_processes;
        if infoCount.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null (checked) and valid (NVML contract).
        let room = unsafe { *infoCount };
        // SAFETY: as above.
        unsafe { put(infoCount, n)? };
        if n == 0 {
            return Ok(());
        }
        if room < n || infos.is_null() {
            return Err(INSUFFICIENT_SIZE);
        }
        // SAFETY: non-null and valid for `room` >= `n` entries (NVML contract).
        let out = unsafe { std::slice::from_raw_parts_mut(infos, n as usize) };
        for (k, p) in out.iter_mut().enumerate() {
            *p = nvmlProcessInfo_t {
                pid: 1000 + k as c_uint,
                usedGpuMemory: 1 << 30,
                gpuInstanceId: u32::MAX,
                computeInstanceId: u32::MAX,
            };
        }
        Ok(())
    })
}

/// Each entry gets its own `nvmlReturn`; known fields come back as
/// `NVML_VALUE_TYPE_UNSIGNED_INT` with the value also readable as `ullVal`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    valuesCount: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetFieldValues", device)?;
        let d = self::device(&s, i)?;
        let count = usize::try_from(valuesCount).map_err(|_| INVALID_ARGUMENT)?;
        if count == 0 || values.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null and valid for `valuesCount` entries (NVML contract).
        let values = unsafe { std::slice::from_raw_parts_mut(values, count) };
        let now_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|t| i64::try_from(t.as_micros()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        for v in values {
            v.timestamp = now_us;
            v.latencyUsec = 0;
            match d.field_value(v.fieldId) {
                Ok(x) => {
                    v.valueType = nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT;
                    // Little-endian: `uiVal` and `ullVal` both read `x`.
                    v.value = nvmlValue_t {
                        ullVal: u64::from(x),
                    };
                    v.nvmlReturn = SUCCESS;
                }
                Err(code) => v.nvmlReturn = code,
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    isActive: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetNvLinkState", device)?;
        let active = self::device(&s, i)?.nvlink_active(link)?;
        // SAFETY: null or valid (NVML contract).
        unsafe { put(isActive, enable_state(active)) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkErrorCounter(
    device: nvmlDevice_t,
    link: c_uint,
    counter: nvmlNvLinkErrorCounter_t,
    counterValue: *mut c_ulonglong,
) -> nvmlReturn_t {
    guarded(|| {
        let (s, i) = enter_device("nvmlDeviceGetNvLinkErrorCounter", device)?;
        let value = self::device(&s, i)?.nvlink_counter(link, counter)?;
        // SAFETY: null or valid (NVML contract).
        unsafe { put(counterValue, value) }
    })
}

/// Shared body of the four PCIe link getters and the replay counter.
///
/// # Safety
/// `out` is null or valid for a write.
unsafe fn pcie_getter(
    function: &str,
    device: nvmlDevice_t,
    out: *mut c_uint,
    pick: fn(&state::Pcie) -> u32,
) -> Ret {
    guarded(|| {
        let (s, i) = enter_device(function, device)?;
        let value = pick(&self::device(&s, i)?.pcie);
        // SAFETY: null or valid, per this function's contract.
        unsafe { put(out, value) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkGeneration(
    device: nvmlDevice_t,
    currLinkGen: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: the out-pointer is null or valid.
    unsafe {
        pcie_getter(
            "nvmlDeviceGetCurrPcieLinkGeneration",
            device,
            currLinkGen,
            |p| p.cur_gen,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkGeneration(
    device: nvmlDevice_t,
    maxLinkGen: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: the out-pointer is null or valid.
    unsafe {
        pcie_getter(
            "nvmlDeviceGetMaxPcieLinkGeneration",
            device,
            maxLinkGen,
            |p| p.max_gen,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkWidth(
    device: nvmlDevice_t,
    currLinkWidth: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: the out-pointer is null or valid.
    unsafe {
        pcie_getter(
            "nvmlDeviceGetCurrPcieLinkWidth",
            device,
            currLinkWidth,
            |p| p.cur_width,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkWidth(
    device: nvmlDevice_t,
    maxLinkWidth: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: the out-pointer is null or valid.
    unsafe {
        pcie_getter("nvmlDeviceGetMaxPcieLinkWidth", device, maxLinkWidth, |p| {
            p.max_width
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPcieReplayCounter(
    device: nvmlDevice_t,
    value: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: the out-pointer is null or valid.
    unsafe {
        pcie_getter("nvmlDeviceGetPcieReplayCounter", device, value, |p| {
            p.replay
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    guarded(|| {
        enter("nvmlEventSetCreate")?;
        if set.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let id = NEXT_SET_ID.fetch_add(1, Ordering::SeqCst);
        lock(&EVENT_SETS)
            .get_or_insert_with(HashMap::new)
            .insert(id, Vec::new());
        // SAFETY: checked non-null; valid per NVML contract.
        unsafe { put(set, set_handle(id)) }
    })
}

/// Event types outside `xid | dbe | sbe` answer NOT_SUPPORTED, as NVML does for types the
/// device does not support.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    eventTypes: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    guarded(|| {
        let (_, i) = enter_device("nvmlDeviceRegisterEvents", device)?;
        let mut sets = lock(&EVENT_SETS);
        let regs = sets
            .get_or_insert_with(HashMap::new)
            .get_mut(&set.addr())
            .ok_or(INVALID_ARGUMENT)?;
        if eventTypes & !SUPPORTED_EVENT_TYPES != 0 {
            return Err(NOT_SUPPORTED);
        }
        match regs.iter_mut().find(|(d, _)| *d == i) {
            Some((_, mask)) => *mask |= eventTypes,
            None => regs.push((i, eventTypes)),
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    eventTypes: *mut c_ulonglong,
) -> nvmlReturn_t {
    guarded(|| {
        enter_device("nvmlDeviceGetSupportedEventTypes", device)?;
        // SAFETY: null or valid (NVML contract).
        unsafe { put(eventTypes, SUPPORTED_EVENT_TYPES) }
    })
}

/// Delivers the first event of the current state not yet delivered to this process whose
/// device is registered in `set` for its type; else GPU_IS_LOST if a registered device is
/// lost; else looks again every 10 ms until `timeoutms`, then TIMEOUT. A `hang` listing blocks
/// regardless of the timeout.
#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    guarded(|| {
        let function = "nvmlEventSetWait_v2";
        let mut s = current()?;
        require_init()?;
        if data.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let start = Instant::now();
        let timeout = Duration::from_millis(u64::from(timeoutms));
        loop {
            s = sit_out_hang(function, None, s)?;
            injected(&s, function, None)?;
            let regs = lock(&EVENT_SETS)
                .as_ref()
                .and_then(|sets| sets.get(&set.addr()).cloned())
                .ok_or(INVALID_ARGUMENT)?;
            {
                let mut delivered = lock(&DELIVERED);
                let delivered = delivered.get_or_insert_with(HashSet::new);
                if let Some(ev) = s.next_event(delivered, &regs) {
                    delivered.insert(ev.id);
                    let out = nvmlEventData_t {
                        device: handle_for(ev.device),
                        eventType: ev.kind.mask(),
                        eventData: ev.data(),
                        gpuInstanceId: INVALID_GPU_INSTANCE_ID,
                        computeInstanceId: INVALID_GPU_INSTANCE_ID,
                    };
                    // SAFETY: checked non-null; valid per NVML contract.
                    return unsafe { put(data, out) };
                }
            }
            if regs
                .iter()
                .any(|&(d, _)| s.device(d).is_some_and(|d| d.lost))
            {
                return Err(GPU_IS_LOST);
            }
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                return Err(TIMEOUT);
            }
            std::thread::sleep(POLL.min(timeout - elapsed));
            s = current()?;
        }
    })
}

/// Frees the set. A handle that is not a live set (garbage, double free) is
/// INVALID_ARGUMENT. When the state file is unreadable the set is still freed, then UNKNOWN.
#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    guarded(|| {
        let function = "nvmlEventSetFree";
        let loaded = current();
        require_init()?;
        if let Ok(s) = &loaded {
            let s = sit_out_hang(function, None, Arc::clone(s))?;
            injected(&s, function, None)?;
        }
        lock(&EVENT_SETS)
            .as_mut()
            .and_then(|sets| sets.remove(&set.addr()))
            .ok_or(INVALID_ARGUMENT)?;
        loaded.map(drop)
    })
}
