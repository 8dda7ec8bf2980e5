//! What the NVML source reads, as plain data, and the [`NvmlBackend`] trait that reads it.
//!
//! The trait is the seam between the agent and NVML: `real::RealNvml` implements it with
//! nvml-wrapper (tested against the fake `libnvidia-ml.so` in `tests/fake-nvml`), and unit tests
//! feed the analyzer hand-made readings.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

use faultline_core::parse::PciAddr;

use crate::clock::Clock;

/// Why one NVML call gave no value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// This GPU or driver does not have it: not a fault.
    NotSupported,
    /// `NVML_ERROR_GPU_IS_LOST`.
    GpuLost,
    /// `NVML_ERROR_RESET_REQUIRED`.
    ResetRequired,
    /// Anything else, with NVML's words.
    Other(String),
}

impl CallError {
    pub(crate) fn is_lost(&self) -> bool {
        matches!(self, CallError::GpuLost | CallError::ResetRequired)
    }
}

pub(crate) type Reading<T> = Result<T, CallError>;

/// A GPU's identity.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Identity {
    pub index: u32,
    pub uuid: Option<String>,
    pub pci: Option<PciAddr>,
    pub name: Option<String>,
}

/// Remapped-row field values (NVML fields 142-145).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Remap {
    pub correctable: u64,
    pub uncorrectable: u64,
    pub pending: u64,
    pub failure: u64,
}

/// PCIe link state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pcie {
    pub cur_gen: u32,
    pub max_gen: u32,
    pub cur_width: u32,
    pub max_width: u32,
}

/// One NVLink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub link: u32,
    pub active: bool,
    /// Sum of the replay, recovery and CRC error counters.
    pub errors: Reading<u64>,
}

/// One polling pass over one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceReadings {
    pub index: u32,
    pub ecc_volatile: Reading<u64>,
    pub ecc_aggregate: Reading<u64>,
    pub pages_pending: Reading<bool>,
    pub remap: Reading<Remap>,
    /// NVML field 230: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset.
    pub recovery_action: Reading<u64>,
    pub links: Reading<Vec<Link>>,
    pub pcie: Reading<Pcie>,
    pub pcie_replay: Reading<u64>,
}

impl DeviceReadings {
    /// Readings where every call failed the same way (a lost GPU).
    pub(crate) fn all_failed(index: u32, e: CallError) -> Self {
        DeviceReadings {
            index,
            ecc_volatile: Err(e.clone()),
            ecc_aggregate: Err(e.clone()),
            pages_pending: Err(e.clone()),
            remap: Err(e.clone()),
            recovery_action: Err(e.clone()),
            links: Err(e.clone()),
            pcie: Err(e.clone()),
            pcie_replay: Err(e),
        }
    }

    /// Each reading's error, `None` for a reading that succeeded.
    fn errors(&self) -> [Option<&CallError>; 8] {
        [
            self.ecc_volatile.as_ref().err(),
            self.ecc_aggregate.as_ref().err(),
            self.pages_pending.as_ref().err(),
            self.remap.as_ref().err(),
            self.recovery_action.as_ref().err(),
            self.links.as_ref().err(),
            self.pcie.as_ref().err(),
            self.pcie_replay.as_ref().err(),
        ]
    }

    /// The first lost/reset-required error among the readings, if any.
    pub(crate) fn lost(&self) -> Option<CallError> {
        self.errors()
            .into_iter()
            .flatten()
            .find(|e| e.is_lost())
            .cloned()
    }

    /// At least one reading succeeded.
    pub(crate) fn any_read(&self) -> bool {
        self.errors().iter().any(Option::is_none)
    }
}

/// An NVML event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    Xid(u64),
    DoubleBitEcc,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlEvent {
    pub index: Option<u32>,
    pub kind: EventKind,
}

/// Which NVML call is running, and since when (time since boot on `clock`): lets a watchdog
/// see a hung call.
#[derive(Debug)]
pub struct CallTracker {
    clock: Arc<dyn Clock>,
    /// The call running and when it started, on the monotonic clock: a suspend of the machine
    /// while a call is in flight does not make it hung.
    running: Mutex<Option<(&'static str, tokio::time::Instant)>>,
}

impl CallTracker {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        CallTracker {
            clock,
            running: Mutex::new(None),
        }
    }

    /// Runs `f` as the NVML call `name`.
    pub(crate) fn call<T>(&self, name: &'static str, f: impl FnOnce() -> T) -> T {
        *self.running.lock() = Some((name, self.clock.instant()));
        let out = f();
        *self.running.lock() = None;
        out
    }

    /// The call running for longer than `limit` at `now` ([`Clock::instant`]), with how long.
    pub(crate) fn stuck(
        &self,
        limit: Duration,
        now: tokio::time::Instant,
    ) -> Option<(&'static str, Duration)> {
        let (name, since) = (*self.running.lock())?;
        let d = now.saturating_duration_since(since);
        (d > limit).then_some((name, d))
    }
}

/// Event delivery from NVML, owned by the event thread.
pub trait EventWaiter {
    /// Waits up to `timeout_ms`; `Ok(None)` when nothing happened.
    fn wait(&mut self, timeout_ms: u32) -> Reading<Option<NvmlEvent>>;
}

/// Everything the NVML source asks of NVML.
pub trait NvmlBackend: Send + Sync {
    fn device_count(&self, calls: &CallTracker) -> Reading<u32>;
    fn identity(&self, index: u32, calls: &CallTracker) -> Reading<Identity>;
    fn read(&self, index: u32, calls: &CallTracker) -> DeviceReadings;
    /// Registers for Xid and double-bit ECC events on every GPU.
    fn events(&self) -> Reading<Box<dyn EventWaiter>>;
}
