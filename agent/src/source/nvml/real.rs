//! [`NvmlBackend`] over the real NVML, through nvml-wrapper. The only module that touches NVML.
//!
//! NVML is loaded once per process and kept for its lifetime (`&'static`), so devices and the
//! event set can live on their own threads. In CI this runs against the fake
//! `libnvidia-ml.so` from `tests/fake-nvml`, loaded through the same `lib_path` mechanism.

use std::path::Path;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{EventSet, Nvml};

use super::readings::{
    CallError, CallTracker, DeviceReadings, EventKind, EventWaiter, Identity, Link, NvmlBackend,
    NvmlEvent, Pcie, Reading, Remap,
};

/// NVML field ids (NVML 12 numbering; nvml-wrapper translates for newer drivers).
const FI_REMAPPED_COR: u32 = 142;
const FI_REMAPPED_UNC: u32 = 143;
const FI_REMAPPED_PENDING: u32 = 144;
const FI_REMAPPED_FAILURE: u32 = 145;
const FI_RECOVERY_ACTION: u32 = 230;
/// NVML_NVLINK_MAX_LINKS in current headers.
const MAX_LINKS: u32 = 18;

/// Why NVML could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// No library or no driver: a CPU node. Normal.
    Absent(String),
    /// NVML is there but does not work.
    Broken(String),
}

fn call_error(e: &NvmlError) -> CallError {
    match e {
        NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_) => CallError::NotSupported,
        NvmlError::GpuLost => CallError::GpuLost,
        NvmlError::ResetRequired => CallError::ResetRequired,
        other => CallError::Other(other.to_string()),
    }
}

/// NVML, loaded.
#[derive(Debug)]
pub struct RealNvml {
    nvml: &'static Nvml,
}

/// The NVIDIA kernel driver's own file: it exists while the driver is loaded, in a container
/// too (procfs shows the host's driver).
const DRIVER_LOADED: &str = "/proc/driver/nvidia/version";

/// Loads NVML from `lib` (default: the system's `libnvidia-ml.so.1`) and initializes it.
pub fn open(lib: Option<&Path>) -> Result<RealNvml, OpenError> {
    open_with(lib, Path::new(DRIVER_LOADED))
}

/// [`open`], with the driver's file at `driver_loaded`. A library that cannot be loaded is a
/// CPU node (absent) only where no NVIDIA driver is loaded; beside a loaded driver it is a
/// broken install (the container runtime did not inject the library, or put it where the
/// loader does not look), which must show as a detector down, not idle.
fn open_with(lib: Option<&Path>, driver_loaded: &Path) -> Result<RealNvml, OpenError> {
    let mut builder = Nvml::builder();
    if let Some(p) = lib {
        builder.lib_path(p.as_os_str());
    }
    match builder.init() {
        Ok(n) => Ok(RealNvml {
            // One NVML per process, for the life of the process.
            nvml: Box::leak(Box::new(n)),
        }),
        Err(NvmlError::LibloadingError(e)) if driver_loaded.exists() => {
            Err(OpenError::Broken(format!(
                "the NVIDIA driver is loaded ({}) but NVML cannot be loaded: {e}",
                driver_loaded.display()
            )))
        }
        Err(NvmlError::LibloadingError(e)) => {
            Err(OpenError::Absent(format!("cannot load NVML: {e}")))
        }
        Err(NvmlError::DriverNotLoaded) => {
            Err(OpenError::Absent("the NVIDIA driver is not loaded".into()))
        }
        Err(e) => Err(OpenError::Broken(format!("NVML init failed: {e}"))),
    }
}

impl RealNvml {
    pub(crate) fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }
}

fn field_u64(v: &Result<SampleValue, NvmlError>) -> Reading<u64> {
    match v {
        Ok(SampleValue::U32(x)) => Ok(u64::from(*x)),
        Ok(SampleValue::U64(x)) => Ok(*x),
        Ok(SampleValue::I64(x)) => Ok((*x).max(0) as u64),
        Ok(SampleValue::F64(x)) => Ok(x.max(0.0) as u64),
        Err(e) => Err(call_error(e)),
    }
}

/// Runs `f` as the NVML call `name`, its error as a [`CallError`].
fn nvml<T>(
    calls: &CallTracker,
    name: &'static str,
    f: impl FnOnce() -> Result<T, NvmlError>,
) -> Reading<T> {
    calls.call(name, f).map_err(|e| call_error(&e))
}

impl NvmlBackend for RealNvml {
    fn device_count(&self, calls: &CallTracker) -> Reading<u32> {
        nvml(calls, "nvmlDeviceGetCount", || self.nvml.device_count())
    }

    fn identity(&self, index: u32, calls: &CallTracker) -> Reading<Identity> {
        let d = nvml(calls, "nvmlDeviceGetHandleByIndex", || {
            self.nvml.device_by_index(index)
        })?;
        let uuid = calls.call("nvmlDeviceGetUUID", || d.uuid()).ok();
        let pci = calls
            .call("nvmlDeviceGetPciInfo", || d.pci_info())
            .ok()
            .and_then(|p| p.bus_id.parse().ok());
        let name = calls.call("nvmlDeviceGetName", || d.name()).ok();
        Ok(Identity {
            index,
            uuid,
            pci,
            name,
        })
    }

    fn read(&self, index: u32, calls: &CallTracker) -> DeviceReadings {
        let d = match nvml(calls, "nvmlDeviceGetHandleByIndex", || {
            self.nvml.device_by_index(index)
        }) {
            Ok(d) => d,
            Err(e) => return DeviceReadings::all_failed(index, e),
        };
        let ecc = |counter| {
            nvml(calls, "nvmlDeviceGetTotalEccErrors", || {
                d.total_ecc_errors(MemoryError::Uncorrected, counter)
            })
        };
        let ecc_volatile = ecc(EccCounter::Volatile);
        let ecc_aggregate = ecc(EccCounter::Aggregate);
        let pages_pending = nvml(calls, "nvmlDeviceGetRetiredPagesPendingStatus", || {
            d.are_pages_pending_retired()
        });
        let ids = [
            FI_REMAPPED_COR,
            FI_REMAPPED_UNC,
            FI_REMAPPED_PENDING,
            FI_REMAPPED_FAILURE,
            FI_RECOVERY_ACTION,
        ]
        .map(FieldId);
        let fields = nvml(calls, "nvmlDeviceGetFieldValues", || {
            d.field_values_for(&ids)
        });
        let (remap, recovery_action) = match fields {
            Ok(v) if v.len() == ids.len() => {
                let val = |i: usize| {
                    v[i].as_ref()
                        .map_err(call_error)
                        .and_then(|s| field_u64(&s.value))
                };
                let remap = (|| {
                    Ok(Remap {
                        correctable: val(0)?,
                        uncorrectable: val(1)?,
                        pending: val(2)?,
                        failure: val(3)?,
                    })
                })();
                (remap, val(4))
            }
            Ok(_) => (
                Err(CallError::Other("short field value answer".into())),
                Err(CallError::Other("short field value answer".into())),
            ),
            Err(e) => (Err(e.clone()), Err(e)),
        };
        let links = (|| {
            let mut out = Vec::new();
            for l in 0..MAX_LINKS {
                let link = d.link_wrapper_for(l);
                match calls.call("nvmlDeviceGetNvLinkState", || link.is_active()) {
                    Ok(active) => {
                        let mut sum: Reading<u64> = Ok(0);
                        for c in [
                            ErrorCounter::DlReplay,
                            ErrorCounter::DlRecovery,
                            ErrorCounter::DlCrcFlit,
                            ErrorCounter::DlCrcData,
                        ] {
                            let v = nvml(calls, "nvmlDeviceGetNvLinkErrorCounter", || {
                                link.error_counter(c)
                            });
                            sum = match (sum, v) {
                                (Ok(a), Ok(b)) => Ok(a.saturating_add(b)),
                                (Err(e), _) | (_, Err(e)) => Err(e),
                            };
                        }
                        out.push(Link {
                            link: l,
                            active,
                            errors: sum,
                        });
                    }
                    // Past the last link NVML answers INVALID_ARGUMENT; no NVLink at all is
                    // NOT_SUPPORTED (at link 0). A lost GPU fails the reading at any link.
                    Err(NvmlError::InvalidArg) => break,
                    Err(e) => {
                        let e = call_error(&e);
                        if l == 0 || e.is_lost() {
                            return Err(e);
                        }
                        break;
                    }
                }
            }
            Ok(out)
        })();
        let pcie = (|| {
            Ok(Pcie {
                cur_gen: nvml(calls, "nvmlDeviceGetCurrPcieLinkGeneration", || {
                    d.current_pcie_link_gen()
                })?,
                max_gen: nvml(calls, "nvmlDeviceGetMaxPcieLinkGeneration", || {
                    d.max_pcie_link_gen()
                })?,
                cur_width: nvml(calls, "nvmlDeviceGetCurrPcieLinkWidth", || {
                    d.current_pcie_link_width()
                })?,
                max_width: nvml(calls, "nvmlDeviceGetMaxPcieLinkWidth", || {
                    d.max_pcie_link_width()
                })?,
            })
        })();
        let pcie_replay = nvml(calls, "nvmlDeviceGetPcieReplayCounter", || {
            d.pcie_replay_counter()
        })
        .map(u64::from);
        DeviceReadings {
            index,
            ecc_volatile,
            ecc_aggregate,
            pages_pending,
            remap,
            recovery_action,
            links,
            pcie,
            pcie_replay,
        }
    }

    fn events(&self) -> Reading<Box<dyn EventWaiter>> {
        let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
        let mut set = self.nvml.create_event_set().map_err(|e| call_error(&e))?;
        let count = self.nvml.device_count().map_err(|e| call_error(&e))?;
        let mut registered = 0;
        for i in 0..count {
            let Ok(d) = self.nvml.device_by_index(i) else {
                continue;
            };
            let types = match d.supported_event_types() {
                Ok(t) => t & wanted,
                Err(_) => wanted,
            };
            if types.is_empty() {
                continue;
            }
            // On an error the set is gone with it; events stay unavailable, polling goes on.
            set = d
                .register_events(types, set)
                .map_err(|e| call_error(&e.error))?;
            registered += 1;
        }
        if registered == 0 {
            return Err(CallError::NotSupported);
        }
        Ok(Box::new(Events { set }))
    }
}

struct Events {
    set: EventSet<'static>,
}

impl EventWaiter for Events {
    fn wait(&mut self, timeout_ms: u32) -> Reading<Option<NvmlEvent>> {
        match self.set.wait(timeout_ms) {
            Ok(ev) => {
                let index = ev.device.index().ok();
                let kind = if ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    match ev.event_data {
                        Some(XidError::Value(x)) => EventKind::Xid(x),
                        _ => EventKind::Xid(0),
                    }
                } else {
                    EventKind::DoubleBitEcc
                };
                Ok(Some(NvmlEvent { index, kind }))
            }
            Err(NvmlError::Timeout) => Ok(None),
            Err(e) => Err(call_error(&e)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// No library and no driver is a CPU node; no library beside a loaded driver is broken
    /// (an image where the runtime's libnvidia-ml is not found would otherwise look idle).
    #[test]
    fn a_missing_library_is_absent_only_without_a_driver() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libnvidia-ml.so.1");
        let marker = dir.path().join("version");
        match open_with(Some(&lib), &marker) {
            Err(OpenError::Absent(why)) => assert!(why.contains("cannot load NVML"), "{why}"),
            other => panic!("no driver: {:?}", other.err()),
        }
        std::fs::write(&marker, "NVRM version: 580.159.04\n").unwrap();
        match open_with(Some(&lib), &marker) {
            Err(OpenError::Broken(why)) => {
                assert!(why.contains("driver is loaded"), "{why}")
            }
            other => panic!("a driver: {:?}", other.err()),
        }
    }
}
