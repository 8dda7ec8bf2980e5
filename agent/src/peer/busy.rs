//! Whether this node's GPUs run someone's work, for scheduled GPU peer checks (which would
//! disturb it): the `Busy` trait a ping asks, and `NvmlBusy`, NVML's count of processes with a
//! compute context on each GPU. NVML is opened on first use and kept; when it cannot tell (not
//! loadable, a call fails), the node counts as busy: a scheduled check is not worth disturbing
//! a job that might be there.

use std::path::PathBuf;
use std::sync::Arc;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use parking_lot::Mutex;

/// Whether this node's accelerators run someone's work.
pub trait Busy: Send + Sync + std::fmt::Debug + 'static {
    /// `Some(reason)` when busy.
    fn busy(&self) -> Option<String>;
}

/// Never busy (CPU/TCP checks disturb nothing that matters).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct NeverBusy;

impl Busy for NeverBusy {
    fn busy(&self) -> Option<String> {
        None
    }
}

/// What tells whether the GPUs are busy: NVML, unless the agent was told not to use it.
pub(crate) fn from_flags(nvml: &crate::source::nvml::Flags) -> Arc<dyn Busy> {
    if nvml.no_nvml {
        Arc::new(NeverBusy)
    } else {
        Arc::new(NvmlBusy::new(nvml.nvml_lib.clone()))
    }
}

/// Why NVML cannot tell whether the GPUs are busy.
#[derive(Debug, thiserror::Error)]
enum CheckError {
    #[error("{0}")]
    Count(#[source] NvmlError),
    #[error("GPU {index}: {source}")]
    Gpu {
        index: u32,
        #[source]
        source: NvmlError,
    },
}

/// Busy when any GPU has a compute process.
pub struct NvmlBusy {
    library: Option<PathBuf>,
    nvml: Mutex<Option<Nvml>>,
}

impl std::fmt::Debug for NvmlBusy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBusy")
            .field("library", &self.library)
            .finish_non_exhaustive()
    }
}

impl NvmlBusy {
    /// `library`: the NVML library to load (default: the system's).
    pub fn new(library: Option<PathBuf>) -> NvmlBusy {
        NvmlBusy {
            library,
            nvml: Mutex::new(None),
        }
    }

    fn check(nvml: &Nvml) -> Result<Option<String>, CheckError> {
        let count = nvml.device_count().map_err(CheckError::Count)?;
        let mut busy = Vec::new();
        for i in 0..count {
            let gpu = |source| CheckError::Gpu { index: i, source };
            let d = nvml.device_by_index(i).map_err(gpu)?;
            let n = d.running_compute_processes_count().map_err(gpu)?;
            if n > 0 {
                busy.push(format!(
                    "GPU {i}: {n} compute process{}",
                    if n == 1 { "" } else { "es" }
                ));
            }
        }
        Ok((!busy.is_empty()).then(|| busy.join(", ")))
    }
}

impl Busy for NvmlBusy {
    fn busy(&self) -> Option<String> {
        let mut guard = self.nvml.lock();
        let nvml = match guard.take() {
            Some(n) => n,
            None => {
                let mut b = Nvml::builder();
                if let Some(p) = &self.library {
                    b.lib_path(p.as_os_str());
                }
                match b.init() {
                    Ok(n) => n,
                    Err(e) => return Some(format!("cannot tell (NVML: {e})")),
                }
            }
        };
        match Self::check(guard.insert(nvml)) {
            Ok(b) => b,
            Err(e) => Some(format!("cannot tell (NVML: {e})")),
        }
    }
}
