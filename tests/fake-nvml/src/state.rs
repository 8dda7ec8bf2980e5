//! The JSON state file that drives the fake, and the pure lookups the C entry points make on it.
//!
//! Nothing here touches raw pointers: everything is plain, safe Rust so it can be unit tested
//! from the rlib. The C ABI lives in `ffi.rs`.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::fmt;
use std::io::Write as _;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use nvml_wrapper_sys::bindings::*;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer};

/// Environment variable naming the state file.
pub const STATE_ENV: &str = "FAKE_NVML_STATE";

/// Default `driver_version` (an R550 driver, so nvml-wrapper picks the NVML 12 field-id scheme).
pub const DEFAULT_DRIVER_VERSION: &str = "550.54.15";

/// Default device name.
pub const DEFAULT_DEVICE_NAME: &str = "NVIDIA H100 80GB HBM3";

/// `pciDeviceId` reported unless the state says otherwise: device 0x2330 (H100 SXM5 80GB),
/// vendor 0x10DE, packed the way NVML packs it (`device << 16 | vendor`).
pub const DEFAULT_PCI_DEVICE_ID: u32 = 0x2330_10DE;

/// Event types this fake can deliver, and reports from `nvmlDeviceGetSupportedEventTypes`.
pub const SUPPORTED_EVENT_TYPES: u64 = (nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypeXidCriticalError) as u64;

/// NVML field ids the fake answers (NVML 12 numbering, what nvml-wrapper sends for R550).
pub mod field {
    pub use nvml_wrapper_sys::bindings::field_id::{
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION as RECOVERY_ACTION,
        NVML_FI_DEV_REMAPPED_COR as REMAPPED_COR, NVML_FI_DEV_REMAPPED_FAILURE as REMAPPED_FAILURE,
        NVML_FI_DEV_REMAPPED_PENDING as REMAPPED_PENDING, NVML_FI_DEV_REMAPPED_UNC as REMAPPED_UNC,
    };
}

/// The exported functions that take no device and whose behaviour `errors` / `hang` can change
/// (every export but `nvmlErrorString`, which has no return code, is here or in
/// [`DEVICE_FUNCTIONS`]).
pub const GLOBAL_FUNCTIONS: &[&str] = &[
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlEventSetCreate",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
];

/// The functions that take a device (handle or index): the only keys allowed in a device's own
/// `errors` / `hang`.
pub const DEVICE_FUNCTIONS: &[&str] = &[
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetSupportedEventTypes",
];

/// NVML return codes by the name used in state files (the `NVML_ERROR_` suffix; `SUCCESS`).
const CODES: &[(&str, nvmlReturn_t)] = &[
    ("SUCCESS", nvmlReturn_enum_NVML_SUCCESS),
    ("UNINITIALIZED", nvmlReturn_enum_NVML_ERROR_UNINITIALIZED),
    (
        "INVALID_ARGUMENT",
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    ),
    ("NOT_SUPPORTED", nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED),
    ("NO_PERMISSION", nvmlReturn_enum_NVML_ERROR_NO_PERMISSION),
    (
        "ALREADY_INITIALIZED",
        nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED,
    ),
    ("NOT_FOUND", nvmlReturn_enum_NVML_ERROR_NOT_FOUND),
    (
        "INSUFFICIENT_SIZE",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE,
    ),
    (
        "INSUFFICIENT_POWER",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER,
    ),
    (
        "DRIVER_NOT_LOADED",
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
    ),
    ("TIMEOUT", nvmlReturn_enum_NVML_ERROR_TIMEOUT),
    ("IRQ_ISSUE", nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE),
    (
        "LIBRARY_NOT_FOUND",
        nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND,
    ),
    (
        "FUNCTION_NOT_FOUND",
        nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
    ),
    (
        "CORRUPTED_INFOROM",
        nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM,
    ),
    ("GPU_IS_LOST", nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST),
    ("RESET_REQUIRED", nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED),
    (
        "OPERATING_SYSTEM",
        nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM,
    ),
    (
        "LIB_RM_VERSION_MISMATCH",
        nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    ),
    ("IN_USE", nvmlReturn_enum_NVML_ERROR_IN_USE),
    ("MEMORY", nvmlReturn_enum_NVML_ERROR_MEMORY),
    ("NO_DATA", nvmlReturn_enum_NVML_ERROR_NO_DATA),
    (
        "VGPU_ECC_NOT_SUPPORTED",
        nvmlReturn_enum_NVML_ERROR_VGPU_ECC_NOT_SUPPORTED,
    ),
    (
        "INSUFFICIENT_RESOURCES",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES,
    ),
    (
        "FREQ_NOT_SUPPORTED",
        nvmlReturn_enum_NVML_ERROR_FREQ_NOT_SUPPORTED,
    ),
    (
        "ARGUMENT_VERSION_MISMATCH",
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    ),
    ("DEPRECATED", nvmlReturn_enum_NVML_ERROR_DEPRECATED),
    ("NOT_READY", nvmlReturn_enum_NVML_ERROR_NOT_READY),
    ("GPU_NOT_FOUND", nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND),
    ("INVALID_STATE", nvmlReturn_enum_NVML_ERROR_INVALID_STATE),
    (
        "RESET_TYPE_NOT_SUPPORTED",
        nvmlReturn_enum_NVML_ERROR_RESET_TYPE_NOT_SUPPORTED,
    ),
    ("UNKNOWN", nvmlReturn_enum_NVML_ERROR_UNKNOWN),
];

/// The NVML code for an error name: `GPU_IS_LOST`, `NVML_ERROR_GPU_IS_LOST` or `NVML_SUCCESS`
/// (case-insensitive).
pub fn code_from_name(name: &str) -> Option<nvmlReturn_t> {
    let upper = name.trim().to_ascii_uppercase();
    let short = upper
        .strip_prefix("NVML_ERROR_")
        .or_else(|| upper.strip_prefix("NVML_"))
        .unwrap_or(&upper);
    CODES.iter().find(|(n, _)| *n == short).map(|(_, c)| *c)
}

/// The state-file name of an NVML code (`GPU_IS_LOST`), if it has one.
pub fn name_from_code(code: nvmlReturn_t) -> Option<&'static str> {
    CODES.iter().find(|(_, c)| *c == code).map(|(n, _)| *n)
}

/// An NVML return code, written by name in the state file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Code(pub nvmlReturn_t);

impl<'de> Deserialize<'de> for Code {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        code_from_name(&s)
            .map(Code)
            .ok_or_else(|| D::Error::custom(format!("unknown NVML error name {s:?}")))
    }
}

/// Whole-library state, as read from the file named by `FAKE_NVML_STATE`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct State {
    /// What `nvmlSystemGetDriverVersion` answers.
    pub driver_version: String,
    /// `nvmlInit_v2` / `nvmlInitWithFlags` fail with this code.
    pub init_error: Option<Code>,
    /// What `nvmlDeviceGetCount_v2` reports, if not `devices.len()`.
    pub device_count: Option<u32>,
    /// Functions that block (for every device) while they are listed.
    pub hang: Vec<String>,
    /// Function name -> code it returns (for every device).
    pub errors: BTreeMap<String, Code>,
    /// The GPUs, by NVML index.
    pub devices: Vec<Device>,
    /// Events `nvmlEventSetWait_v2` can deliver, in order.
    pub events: Vec<Event>,
}

impl Default for State {
    fn default() -> Self {
        State {
            driver_version: DEFAULT_DRIVER_VERSION.to_owned(),
            init_error: None,
            device_count: None,
            hang: Vec::new(),
            errors: BTreeMap::new(),
            devices: Vec::new(),
            events: Vec::new(),
        }
    }
}

/// ECC error totals (`nvmlDeviceGetTotalEccErrors`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Ecc {
    pub volatile_uncorrected: u64,
    pub aggregate_uncorrected: u64,
    pub volatile_corrected: u64,
    pub aggregate_corrected: u64,
}

/// Row-remapping counters (NVML fields 142-145).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Remap {
    pub correctable: u32,
    pub uncorrectable: u32,
    pub pending: u32,
    pub failure: u32,
}

/// One NVLink.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvLink {
    pub active: bool,
    pub replay: u64,
    pub recovery: u64,
    pub crc_flit: u64,
    pub crc_data: u64,
    /// `NVML_NVLINK_ERROR_DL_ECC_DATA` (counter 4).
    pub ecc_data: u64,
}

impl Default for NvLink {
    fn default() -> Self {
        NvLink {
            active: true,
            replay: 0,
            recovery: 0,
            crc_flit: 0,
            crc_data: 0,
            ecc_data: 0,
        }
    }
}

/// PCIe link state and replay counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Pcie {
    pub cur_gen: u32,
    pub max_gen: u32,
    pub cur_width: u32,
    pub max_width: u32,
    pub replay: u32,
}

impl Default for Pcie {
    fn default() -> Self {
        Pcie {
            cur_gen: 5,
            max_gen: 5,
            cur_width: 16,
            max_width: 16,
            replay: 0,
        }
    }
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Device {
    /// Default: `GPU-fa017000-0000-4000-8000-<index as 12 hex digits>`.
    pub uuid: Option<String>,
    pub name: String,
    /// `DDDDDDDD:BB:DD.F` or `DDDD:BB:DD.F`, any case. Reported the way NVML formats it
    /// (`%08X:%02X:%02X.0`). Default: a typical HGX H100 bus for the index.
    pub pci_bus_id: Option<String>,
    /// `pciDeviceId` (`device << 16 | vendor`).
    pub pci_device_id: u32,
    pub lost: bool,
    pub reset_required: bool,
    pub ecc: Ecc,
    pub ecc_supported: bool,
    /// `null`: NOT_SUPPORTED (what Ampere and newer, which remap rows instead, really answer).
    pub pages_pending_retirement: Option<bool>,
    /// `null`: fields 142-145 answer NOT_SUPPORTED.
    pub remap: Option<Remap>,
    /// Field 230. `null`: NOT_SUPPORTED.
    pub recovery_action: Option<u32>,
    /// `[]`: NvLink calls answer NOT_SUPPORTED.
    pub nvlinks: Vec<NvLink>,
    pub pcie: Pcie,
    pub errors: BTreeMap<String, Code>,
    pub hang: Vec<String>,
    /// Processes with a compute context on the GPU (someone's job is running on it).
    pub compute_processes: u32,
}

impl Default for Device {
    fn default() -> Self {
        Device {
            uuid: None,
            name: DEFAULT_DEVICE_NAME.to_owned(),
            pci_bus_id: None,
            pci_device_id: DEFAULT_PCI_DEVICE_ID,
            lost: false,
            reset_required: false,
            ecc: Ecc::default(),
            ecc_supported: true,
            pages_pending_retirement: Some(false),
            remap: Some(Remap::default()),
            recovery_action: None,
            nvlinks: Vec::new(),
            pcie: Pcie::default(),
            errors: BTreeMap::new(),
            hang: Vec::new(),
            compute_processes: 0,
        }
    }
}

/// Kind of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventType {
    /// `nvmlEventTypeXidCriticalError`, `eventData` = the Xid.
    Xid,
    /// `nvmlEventTypeDoubleBitEccError`.
    Dbe,
    /// `nvmlEventTypeSingleBitEccError`.
    Sbe,
}

impl EventType {
    /// The `nvmlEventType*` bit.
    pub fn mask(self) -> u64 {
        u64::from(match self {
            EventType::Xid => nvmlEventTypeXidCriticalError,
            EventType::Dbe => nvmlEventTypeDoubleBitEccError,
            EventType::Sbe => nvmlEventTypeSingleBitEccError,
        })
    }
}

/// One event. Delivered at most once per process (by `id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    pub id: u64,
    /// Device index.
    pub device: u32,
    #[serde(rename = "type")]
    pub kind: EventType,
    /// Required for `xid`, forbidden otherwise.
    #[serde(default)]
    pub xid: Option<u64>,
}

impl Event {
    /// `eventData` as NVML fills it: the Xid for Xid events, 0 otherwise.
    pub fn data(&self) -> u64 {
        self.xid.unwrap_or(0)
    }
}

/// A parsed PCI address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciAddr {
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
    pub function: u32,
}

impl PciAddr {
    /// Parses `DDDDDDDD:BB:DD.F` / `DDDD:BB:DD.F` (hex, any case).
    pub fn parse(s: &str) -> Option<PciAddr> {
        let (domain, rest) = s.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (device, function) = rest.split_once('.')?;
        let hex = |t: &str, max_len: usize| {
            if t.is_empty() || t.len() > max_len || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                None
            } else {
                u32::from_str_radix(t, 16).ok()
            }
        };
        let addr = PciAddr {
            domain: hex(domain, 8)?,
            bus: hex(bus, 2)?,
            device: hex(device, 2)?,
            function: hex(function, 1)?,
        };
        (addr.device < 32 && addr.function < 8).then_some(addr)
    }

    /// NVML's `busId`: `NVML_DEVICE_PCI_BUS_ID_FMT` (`%08X:%02X:%02X.0`).
    pub fn bus_id(&self) -> String {
        format!("{:08X}:{:02X}:{:02X}.0", self.domain, self.bus, self.device)
    }

    /// NVML's `busIdLegacy`: `NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT` (`%04X:%02X:%02X.0`).
    pub fn bus_id_legacy(&self) -> String {
        format!("{:04X}:{:02X}:{:02X}.0", self.domain, self.bus, self.device)
    }
}

/// Buses of the eight GPUs of a typical HGX H100 board, used for default PCI addresses.
const DEFAULT_BUSES: [u32; 8] = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB];

impl Device {
    /// The UUID reported for the device at `index`.
    pub fn uuid_for(&self, index: u32) -> String {
        match &self.uuid {
            Some(u) => u.clone(),
            None => format!("GPU-fa017000-0000-4000-8000-{index:012x}"),
        }
    }

    /// The PCI address reported for the device at `index`.
    pub fn pci_for(&self, index: u32) -> PciAddr {
        match self.pci_bus_id.as_deref().and_then(PciAddr::parse) {
            Some(a) => a,
            None => PciAddr {
                domain: 0,
                bus: DEFAULT_BUSES
                    .get(index as usize)
                    .copied()
                    .unwrap_or(0x10 + index % 0xF0),
                device: 0,
                function: 0,
            },
        }
    }

    /// `nvmlDeviceGetTotalEccErrors(errorType, counterType)`.
    pub fn ecc_total(&self, error_type: u32, counter_type: u32) -> Result<u64, nvmlReturn_t> {
        if !self.ecc_supported {
            return Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED);
        }
        let e = &self.ecc;
        match (error_type, counter_type) {
            (
                nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvmlEccCounterType_enum_NVML_VOLATILE_ECC,
            ) => Ok(e.volatile_uncorrected),
            (
                nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvmlEccCounterType_enum_NVML_AGGREGATE_ECC,
            ) => Ok(e.aggregate_uncorrected),
            (
                nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nvmlEccCounterType_enum_NVML_VOLATILE_ECC,
            ) => Ok(e.volatile_corrected),
            (
                nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nvmlEccCounterType_enum_NVML_AGGREGATE_ECC,
            ) => Ok(e.aggregate_corrected),
            _ => Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        }
    }

    /// One field of `nvmlDeviceGetFieldValues`: the value, or the per-field return code.
    pub fn field_value(&self, field_id: u32) -> Result<u32, nvmlReturn_t> {
        let not_supported = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
        let remap = |f: fn(&Remap) -> u32| self.remap.as_ref().map(f).ok_or(not_supported);
        match field_id {
            field::REMAPPED_COR => remap(|r| r.correctable),
            field::REMAPPED_UNC => remap(|r| r.uncorrectable),
            field::REMAPPED_PENDING => remap(|r| r.pending),
            field::REMAPPED_FAILURE => remap(|r| r.failure),
            field::RECOVERY_ACTION => self.recovery_action.ok_or(not_supported),
            _ => Err(not_supported),
        }
    }

    fn link(&self, link: u32) -> Result<&NvLink, nvmlReturn_t> {
        if self.nvlinks.is_empty() {
            return Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED);
        }
        self.nvlinks
            .get(link as usize)
            .ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
    }

    /// `nvmlDeviceGetNvLinkState`.
    pub fn nvlink_active(&self, link: u32) -> Result<bool, nvmlReturn_t> {
        self.link(link).map(|l| l.active)
    }

    /// `nvmlDeviceGetNvLinkErrorCounter`.
    pub fn nvlink_counter(&self, link: u32, counter: u32) -> Result<u64, nvmlReturn_t> {
        let l = self.link(link)?;
        match counter {
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_REPLAY => Ok(l.replay),
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_RECOVERY => Ok(l.recovery),
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_CRC_FLIT => Ok(l.crc_flit),
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_CRC_DATA => Ok(l.crc_data),
            nvmlNvLinkErrorCounter_enum_NVML_NVLINK_ERROR_DL_ECC_DATA => Ok(l.ecc_data),
            _ => Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT),
        }
    }
}

/// Why a state file was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateError(pub String);

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StateError {}

/// Checks that `name` is a function the fake exports (and, for device lists, takes a device).
fn check_function(name: &str, device_level: bool, where_: &str) -> Result<(), StateError> {
    let takes_device = DEVICE_FUNCTIONS.contains(&name);
    if takes_device || (!device_level && GLOBAL_FUNCTIONS.contains(&name)) {
        Ok(())
    } else if device_level && GLOBAL_FUNCTIONS.contains(&name) {
        Err(StateError(format!(
            "{where_}: {name:?} does not take a device; put it in the top-level list"
        )))
    } else {
        Err(StateError(format!(
            "{where_}: {name:?} is not a function this fake exports"
        )))
    }
}

impl State {
    /// Parses and validates a state file's text.
    pub fn parse(text: &str) -> Result<State, StateError> {
        let state: State =
            serde_json::from_str(text).map_err(|e| StateError(format!("invalid JSON: {e}")))?;
        state.validate()?;
        Ok(state)
    }

    fn validate(&self) -> Result<(), StateError> {
        if self.driver_version.len() >= NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE as usize {
            return Err(StateError("driver_version is too long".into()));
        }
        for f in &self.hang {
            check_function(f, false, "hang")?;
        }
        for f in self.errors.keys() {
            check_function(f, false, "errors")?;
        }
        for (i, d) in self.devices.iter().enumerate() {
            let at = |what: &str| format!("devices[{i}].{what}");
            for f in &d.hang {
                check_function(f, true, &at("hang"))?;
            }
            for f in d.errors.keys() {
                check_function(f, true, &at("errors"))?;
            }
            if let Some(u) = &d.uuid {
                if u.is_empty() || u.len() >= NVML_DEVICE_UUID_V2_BUFFER_SIZE as usize {
                    return Err(StateError(format!("{}: bad length", at("uuid"))));
                }
            }
            if d.name.len() >= NVML_DEVICE_NAME_V2_BUFFER_SIZE as usize {
                return Err(StateError(format!("{}: too long", at("name"))));
            }
            if let Some(b) = &d.pci_bus_id {
                if PciAddr::parse(b).is_none() {
                    return Err(StateError(format!(
                        "{}: {b:?} is not DDDDDDDD:BB:DD.F",
                        at("pci_bus_id")
                    )));
                }
            }
            if d.nvlinks.len() > NVML_NVLINK_MAX_LINKS as usize {
                return Err(StateError(format!(
                    "{}: more than {NVML_NVLINK_MAX_LINKS} links",
                    at("nvlinks")
                )));
            }
        }
        let mut ids = HashSet::new();
        for (i, e) in self.events.iter().enumerate() {
            if !ids.insert(e.id) {
                return Err(StateError(format!("events[{i}]: duplicate id {}", e.id)));
            }
            if e.device as usize >= self.devices.len() {
                return Err(StateError(format!("events[{i}]: no device {}", e.device)));
            }
            match (e.kind, e.xid) {
                (EventType::Xid, None) => {
                    return Err(StateError(format!(
                        "events[{i}]: an xid event needs \"xid\""
                    )))
                }
                (EventType::Dbe | EventType::Sbe, Some(_)) => {
                    return Err(StateError(format!(
                        "events[{i}]: \"xid\" only goes with type \"xid\""
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// What `nvmlDeviceGetCount_v2` reports.
    pub fn count(&self) -> u32 {
        self.device_count
            .unwrap_or_else(|| u32::try_from(self.devices.len()).unwrap_or(u32::MAX))
    }

    /// The device at `index`, if the state has one.
    pub fn device(&self, index: u32) -> Option<&Device> {
        self.devices.get(index as usize)
    }

    /// Whether `function` is listed as hanging, globally or for `device`.
    pub fn hangs(&self, function: &str, device: Option<u32>) -> bool {
        self.hang.iter().any(|f| f == function)
            || device
                .and_then(|i| self.device(i))
                .is_some_and(|d| d.hang.iter().any(|f| f == function))
    }

    /// The error injected for `function`: the device's own first, then the global one.
    pub fn injected(&self, function: &str, device: Option<u32>) -> Option<nvmlReturn_t> {
        device
            .and_then(|i| self.device(i))
            .and_then(|d| d.errors.get(function))
            .or_else(|| self.errors.get(function))
            .map(|c| c.0)
    }

    /// The first event not in `delivered` whose device is registered in `registrations`
    /// (`(device index, event mask)` pairs) for its type.
    pub fn next_event(
        &self,
        delivered: &HashSet<u64>,
        registrations: &[(u32, u64)],
    ) -> Option<&Event> {
        self.events.iter().find(|e| {
            !delivered.contains(&e.id)
                && registrations
                    .iter()
                    .any(|&(d, mask)| d == e.device && mask & e.kind.mask() != 0)
        })
    }
}

/// Where the current state comes from, and why it could not be had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// `FAKE_NVML_STATE` is not set.
    NoEnv,
    /// The file could not be read.
    Io(String),
    /// The file is not a valid state.
    Invalid(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NoEnv => write!(f, "{STATE_ENV} is not set"),
            LoadError::Io(e) | LoadError::Invalid(e) => f.write_str(e),
        }
    }
}

/// Identity of one version of the file, as far as `stat` can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileKey {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

#[derive(Debug)]
struct Cached {
    path: OsString,
    key: FileKey,
    /// Whether the file may still change without `key` changing: it was read within the same
    /// coarse timestamp tick as its last write.
    fresh_enough: bool,
    state: Arc<State>,
}

static CACHE: Mutex<Option<Cached>> = Mutex::new(None);
static LAST_COMPLAINT: Mutex<Option<String>> = Mutex::new(None);

/// A file read at least this long after its mtime cannot change again without changing mtime
/// (file timestamps tick at most every few ms).
const SETTLE: Duration = Duration::from_millis(50);

fn key_of(meta: &std::fs::Metadata) -> FileKey {
    FileKey {
        dev: meta.dev(),
        ino: meta.ino(),
        len: meta.len(),
        mtime: (meta.mtime(), meta.mtime_nsec()),
        ctime: (meta.ctime(), meta.ctime_nsec()),
    }
}

fn read_once(path: &std::path::Path) -> Result<(FileKey, bool, State), LoadError> {
    let io = |e: std::io::Error| LoadError::Io(format!("cannot read {}: {e}", path.display()));
    let meta = std::fs::metadata(path).map_err(io)?;
    let now = SystemTime::now();
    let settled = meta
        .modified()
        .ok()
        .and_then(|m| now.duration_since(m).ok())
        .is_some_and(|age| age >= SETTLE);
    let text = std::fs::read_to_string(path).map_err(io)?;
    let state = State::parse(&text)
        .map_err(|e| LoadError::Invalid(format!("invalid state file {}: {e}", path.display())))?;
    Ok((key_of(&meta), settled, state))
}

/// Says once on stderr why the state could not be loaded (tests otherwise only see UNKNOWN).
fn complain(e: &LoadError) {
    let msg = e.to_string();
    let mut last = LAST_COMPLAINT
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if last.as_deref() != Some(msg.as_str()) {
        let _ = writeln!(std::io::stderr(), "faultline-fake-nvml: {msg}");
        *last = Some(msg);
    }
}

/// The current state: the file named by `FAKE_NVML_STATE`, re-read whenever it changed.
pub fn load() -> Result<Arc<State>, LoadError> {
    let r = load_inner();
    match &r {
        Ok(_) => {
            *LAST_COMPLAINT
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = None
        }
        Err(e) => complain(e),
    }
    r
}

fn load_inner() -> Result<Arc<State>, LoadError> {
    let path = std::env::var_os(STATE_ENV).ok_or(LoadError::NoEnv)?;
    {
        let cache = CACHE.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = cache.as_ref() {
            if c.path == path && c.fresh_enough {
                if let Ok(meta) = std::fs::metadata(&path) {
                    if key_of(&meta) == c.key {
                        return Ok(Arc::clone(&c.state));
                    }
                }
            }
        }
    }
    // A writer that truncates and rewrites in place can be caught half way: look again briefly
    // before calling the file invalid.
    let p = std::path::Path::new(&path);
    let mut attempt = 0;
    let (key, settled, state) = loop {
        match read_once(p) {
            Ok(v) => break v,
            Err(LoadError::Invalid(_)) if attempt < 2 => {
                attempt += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e),
        }
    };
    let state = Arc::new(state);
    *CACHE.lock().unwrap_or_else(PoisonError::into_inner) = Some(Cached {
        path,
        key,
        fresh_enough: settled,
        state: Arc::clone(&state),
    });
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<State, StateError> {
        State::parse(&v.to_string())
    }

    #[test]
    fn empty_object_gives_defaults() {
        let s = State::parse("{}").unwrap();
        assert_eq!(s, State::default());
        assert_eq!(s.driver_version, "550.54.15");
        assert_eq!(s.count(), 0);
    }

    #[test]
    fn device_defaults() {
        let s = parse(serde_json::json!({"devices": [{}, {}]})).unwrap();
        assert_eq!(s.count(), 2);
        let d = s.device(1).unwrap();
        assert_eq!(d.uuid_for(1), "GPU-fa017000-0000-4000-8000-000000000001");
        assert_eq!(d.pci_for(1).bus_id(), "00000000:2A:00.0");
        assert_eq!(d.name, DEFAULT_DEVICE_NAME);
        assert!(d.ecc_supported);
        assert_eq!(d.pages_pending_retirement, Some(false));
        assert_eq!(d.remap, Some(Remap::default()));
        assert_eq!(d.recovery_action, None);
        assert!(d.nvlinks.is_empty());
        assert_eq!(d.pcie, Pcie::default());
    }

    #[test]
    fn full_example_parses() {
        let s = parse(serde_json::json!({
            "driver_version": "550.54.15",
            "init_error": null,
            "device_count": null,
            "hang": [],
            "errors": {},
            "devices": [{
                "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:3B:00.0",
                "lost": false, "reset_required": false,
                "ecc": {"volatile_uncorrected": 1, "aggregate_uncorrected": 2,
                        "volatile_corrected": 3, "aggregate_corrected": 4},
                "ecc_supported": true,
                "pages_pending_retirement": false,
                "remap": {"correctable": 5, "uncorrectable": 6, "pending": 7, "failure": 8},
                "recovery_action": 2,
                "nvlinks": [{"active": true, "replay": 9, "recovery": 10, "crc_flit": 11, "crc_data": 12}],
                "pcie": {"cur_gen": 4, "max_gen": 5, "cur_width": 8, "max_width": 16, "replay": 13},
                "errors": {}, "hang": []
            }, {}],
            "events": [{"id": 1, "device": 0, "type": "xid", "xid": 79}, {"id": 2, "device": 1, "type": "dbe"}]
        }))
        .unwrap();
        let d = s.device(0).unwrap();
        let (unc, cor) = (
            nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED,
        );
        let (vol, agg) = (
            nvmlEccCounterType_enum_NVML_VOLATILE_ECC,
            nvmlEccCounterType_enum_NVML_AGGREGATE_ECC,
        );
        assert_eq!(d.ecc_total(unc, vol), Ok(1));
        assert_eq!(d.ecc_total(unc, agg), Ok(2));
        assert_eq!(d.ecc_total(cor, vol), Ok(3));
        assert_eq!(d.ecc_total(cor, agg), Ok(4));
        assert_eq!(
            d.ecc_total(7, vol),
            Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(d.field_value(142), Ok(5));
        assert_eq!(d.field_value(143), Ok(6));
        assert_eq!(d.field_value(144), Ok(7));
        assert_eq!(d.field_value(145), Ok(8));
        assert_eq!(d.field_value(230), Ok(2));
        assert_eq!(
            d.field_value(1),
            Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
        );
        assert_eq!(d.nvlink_active(0), Ok(true));
        assert_eq!(d.nvlink_counter(0, 0), Ok(9));
        assert_eq!(d.nvlink_counter(0, 1), Ok(10));
        assert_eq!(d.nvlink_counter(0, 2), Ok(11));
        assert_eq!(d.nvlink_counter(0, 3), Ok(12));
        assert_eq!(d.nvlink_counter(0, 4), Ok(0));
        assert_eq!(
            d.nvlink_counter(0, 5),
            Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(
            d.nvlink_active(1),
            Err(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(d.pcie.replay, 13);
        assert_eq!(d.pci_for(0).bus_id(), "00000000:3B:00.0");
        assert_eq!(d.pci_for(0).bus_id_legacy(), "0000:3B:00.0");
        let other = s.device(1).unwrap();
        assert_eq!(
            other.nvlink_active(0),
            Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
        );
        assert_eq!(
            other.field_value(230),
            Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
        );
    }

    #[test]
    fn null_means_not_supported() {
        let s = parse(serde_json::json!({"devices": [{
            "remap": null, "pages_pending_retirement": null, "ecc_supported": false
        }]}))
        .unwrap();
        let d = s.device(0).unwrap();
        assert_eq!(d.remap, None);
        assert_eq!(d.pages_pending_retirement, None);
        for f in 142..=145 {
            assert_eq!(
                d.field_value(f),
                Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
            );
        }
        assert_eq!(
            d.ecc_total(1, 0),
            Err(nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED)
        );
    }

    #[test]
    fn typos_are_rejected() {
        for bad in [
            serde_json::json!({"devcies": []}),
            serde_json::json!({"devices": [{"uid": "x"}]}),
            serde_json::json!({"devices": [{"ecc": {"volatile": 1}}]}),
            serde_json::json!({"errors": {"nvmlDeviceGetUUUID": "UNKNOWN"}}),
            serde_json::json!({"errors": {"nvmlDeviceGetUUID": "LOST"}}),
            serde_json::json!({"hang": ["nvmlErrorString"]}),
            serde_json::json!({"devices": [{"errors": {"nvmlInit_v2": "UNKNOWN"}}]}),
            serde_json::json!({"devices": [{"pci_bus_id": "3B:00.0"}]}),
            serde_json::json!({"devices": [{}], "events": [{"id": 1, "device": 0, "type": "xid"}]}),
            serde_json::json!({"devices": [{}], "events": [{"id": 1, "device": 0, "type": "dbe", "xid": 1}]}),
            serde_json::json!({"devices": [{}], "events": [{"id": 1, "device": 3, "type": "dbe"}]}),
            serde_json::json!({"devices": [{}], "events": [{"id": 1, "device": 0, "type": "pstate"}]}),
            serde_json::json!({"devices": [{}], "events": [
                {"id": 1, "device": 0, "type": "dbe"}, {"id": 1, "device": 0, "type": "sbe"}]}),
            serde_json::json!({"init_error": "NOPE"}),
        ] {
            assert!(parse(bad.clone()).is_err(), "accepted {bad}");
        }
        assert!(State::parse("{").is_err());
        assert!(State::parse("").is_err());
    }

    #[test]
    fn error_names() {
        assert_eq!(
            code_from_name("GPU_IS_LOST"),
            Some(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST)
        );
        assert_eq!(
            code_from_name("nvml_error_reset_required"),
            Some(nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED)
        );
        assert_eq!(
            code_from_name("NVML_SUCCESS"),
            Some(nvmlReturn_enum_NVML_SUCCESS)
        );
        assert_eq!(
            code_from_name("UNKNOWN"),
            Some(nvmlReturn_enum_NVML_ERROR_UNKNOWN)
        );
        assert_eq!(code_from_name("LOST"), None);
        for (name, code) in CODES {
            assert_eq!(code_from_name(name), Some(*code));
            assert_eq!(name_from_code(*code), Some(*name));
        }
    }

    #[test]
    fn injected_errors_and_hangs() {
        let s = parse(serde_json::json!({
            "errors": {"nvmlDeviceGetUUID": "UNKNOWN", "nvmlDeviceGetCount_v2": "NO_PERMISSION"},
            "hang": ["nvmlEventSetWait_v2"],
            "devices": [
                {"errors": {"nvmlDeviceGetUUID": "GPU_IS_LOST"}, "hang": ["nvmlDeviceGetName"]},
                {}
            ]
        }))
        .unwrap();
        let uuid = "nvmlDeviceGetUUID";
        assert_eq!(
            s.injected(uuid, Some(0)),
            Some(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST)
        );
        assert_eq!(
            s.injected(uuid, Some(1)),
            Some(nvmlReturn_enum_NVML_ERROR_UNKNOWN)
        );
        assert_eq!(
            s.injected("nvmlDeviceGetCount_v2", None),
            Some(nvmlReturn_enum_NVML_ERROR_NO_PERMISSION)
        );
        assert_eq!(s.injected("nvmlDeviceGetName", Some(0)), None);
        assert!(s.hangs("nvmlDeviceGetName", Some(0)));
        assert!(!s.hangs("nvmlDeviceGetName", Some(1)));
        assert!(!s.hangs("nvmlDeviceGetName", None));
        assert!(s.hangs("nvmlEventSetWait_v2", None));
    }

    #[test]
    fn device_count_override() {
        let s = parse(serde_json::json!({"device_count": 7, "devices": [{}]})).unwrap();
        assert_eq!(s.count(), 7);
    }

    #[test]
    fn next_event_respects_delivery_and_registration() {
        let s = parse(serde_json::json!({
            "devices": [{}, {}],
            "events": [
                {"id": 1, "device": 0, "type": "xid", "xid": 79},
                {"id": 2, "device": 1, "type": "dbe"},
                {"id": 3, "device": 0, "type": "sbe"}
            ]
        }))
        .unwrap();
        let xid = u64::from(nvmlEventTypeXidCriticalError);
        let dbe = u64::from(nvmlEventTypeDoubleBitEccError);
        let mut delivered = HashSet::new();
        assert_eq!(s.next_event(&delivered, &[]), None);
        assert_eq!(s.next_event(&delivered, &[(0, xid)]).map(|e| e.id), Some(1));
        assert_eq!(s.next_event(&delivered, &[(0, xid)]).unwrap().data(), 79);
        delivered.insert(1);
        assert_eq!(s.next_event(&delivered, &[(0, xid)]), None);
        assert_eq!(
            s.next_event(&delivered, &[(0, xid), (1, dbe)])
                .map(|e| e.id),
            Some(2)
        );
        delivered.insert(2);
        assert_eq!(
            s.next_event(&delivered, &[(0, SUPPORTED_EVENT_TYPES)])
                .map(|e| (e.id, e.data())),
            Some((3, 0))
        );
    }

    #[test]
    fn pci_addresses() {
        let a = PciAddr::parse("0000:3b:00.0").unwrap();
        assert_eq!(a.bus_id(), "00000000:3B:00.0");
        assert_eq!(a.bus_id_legacy(), "0000:3B:00.0");
        assert_eq!(
            PciAddr::parse("00000001:DB:1F.0").map(|a| (a.domain, a.bus, a.device)),
            Some((1, 0xDB, 0x1F))
        );
        for bad in [
            "",
            "3B:00.0",
            "0000:3B:00",
            "0000:3B:20.0",
            "0000:3B:00.8",
            "zz:3B:00.0",
        ] {
            assert_eq!(PciAddr::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn event_masks() {
        assert_eq!(EventType::Xid.mask(), 8);
        assert_eq!(EventType::Dbe.mask(), 2);
        assert_eq!(EventType::Sbe.mask(), 1);
        assert_eq!(SUPPORTED_EVENT_TYPES, 11);
    }

    /// The loader re-reads a rewritten file at once, and reports a missing or broken one.
    /// (Env var is process-global: this is the only unit test that touches it.)
    #[test]
    fn loader_follows_rewrites() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::env::set_var(STATE_ENV, &path);
        assert!(matches!(load(), Err(LoadError::Io(_))));
        for n in 1..=20u32 {
            // Same length every time, in place, back to back: only content changes.
            std::fs::write(&path, format!(r#"{{"device_count": {}}}"#, 10 + n % 10)).unwrap();
            assert_eq!(load().unwrap().count(), 10 + n % 10);
        }
        std::fs::write(&path, "{\"devices\": [").unwrap();
        assert!(matches!(load(), Err(LoadError::Invalid(_))));
        std::env::remove_var(STATE_ENV);
        assert_eq!(load(), Err(LoadError::NoEnv));
    }
}
