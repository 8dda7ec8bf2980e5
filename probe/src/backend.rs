//! What the GPU backends take and give: configurations, results and errors. A leaf: the entry
//! points (`accel`) and the cudarc code (`gpu`) both use it.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use crate::allgather::AllgatherResult;
use crate::ncclid::ExchangeError;
use crate::GemmResult;

/// Largest matrix side the cuBLAS GEMM accepts (three FP32 matrices of this side are 12 GiB).
pub const MAX_GPU_N: usize = 32_768;

/// Which GPU backend an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cublas,
    Nccl,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Cublas => "cublas",
            Backend::Nccl => "nccl",
        })
    }
}

/// Element type of the cuBLAS GEMM (inputs and output; half precision accumulates in FP32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(Dtype::F32),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "f16" | "fp16" | "float16" | "half" => Ok(Dtype::F16),
            _ => Err(format!("{s:?} is not a dtype (f32, bf16 or f16)")),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        })
    }
}

/// One cuBLAS GEMM measurement: `iterations` n x n GEMMs on GPU `device`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CublasGemmConfig {
    pub device: usize,
    pub n: usize,
    pub iterations: u32,
    pub dtype: Dtype,
}

/// What the cuBLAS GEMM measured: the CPU GEMM's fields (`backend` is `"cublas"`) and the GPU.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CublasGemmResult {
    #[serde(flatten)]
    pub gemm: GemmResult,
    pub dtype: Dtype,
    pub device: usize,
    pub device_name: String,
    /// Entries of the product compared with a host computation after the timed loop.
    pub checked_entries: usize,
}

/// One NCCL allgather run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclAllgatherConfig {
    /// Every rank's address, by rank; rank 0's is where the NCCL id is handed out (the others
    /// only count the ranks; NCCL picks its own ports).
    pub peers: Vec<SocketAddr>,
    pub rank: usize,
    /// Bytes each rank contributes.
    pub bytes: usize,
    pub iterations: u32,
    /// The whole run (id exchange, communicator, iterations) ends with an error at this deadline.
    pub timeout: Duration,
    pub device: usize,
}

/// What an NCCL allgather measured: the TCP allgather's report, plus the backend and the GPU.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NcclAllgatherResult {
    /// Always `"nccl"`.
    pub backend: &'static str,
    #[serde(flatten)]
    pub report: AllgatherResult,
    pub device: usize,
    pub device_name: String,
    /// The loaded libnccl's version, e.g. `2.21.5`.
    pub nccl_version: String,
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("this probe was built without the gpu feature (backend {0} needs it: build with --features gpu)")]
    NotBuilt(Backend),
    /// A CUDA library cannot be loaded, or the driver finds no GPU.
    #[error("backend {backend} unavailable: {why}")]
    Unavailable { backend: Backend, why: String },
    #[error("bad configuration: {0}")]
    Config(String),
    /// A CUDA, cuBLAS or NCCL call failed.
    #[error("backend {backend}: cannot {what}: {detail}")]
    Call {
        backend: Backend,
        what: &'static str,
        detail: String,
    },
    #[error("backend nccl: {0}")]
    Exchange(#[from] ExchangeError),
    #[error("backend nccl: deadline ({limit:?}) passed during {phase}")]
    Deadline {
        limit: Duration,
        phase: &'static str,
    },
    #[error("backend nccl: data from rank {owner} is corrupt (byte {offset} of its block)")]
    Corrupt { owner: usize, offset: usize },
    #[error("backend cublas: wrong product: C[{row},{col}] is {got}, expected {want}")]
    WrongProduct {
        row: usize,
        col: usize,
        got: f64,
        want: f64,
    },
    /// cudarc panicked for a reason other than a missing library (caught, reported as an error).
    #[error("backend {backend} failed: {msg}")]
    Panicked { backend: Backend, msg: String },
}
