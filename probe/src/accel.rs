//! The GPU backends as the rest of the probe sees them: configurations, results, errors and
//! the two entry points ([`cublas_gemm`], [`nccl_allgather`]). This module is in every build;
//! without the `gpu` cargo feature the entry points fail with [`GpuError::NotBuilt`], with it
//! they run the cudarc code in `gpu.rs`.

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

/// Times `cfg.iterations` GEMMs on the GPU after one warm-up, then checks part of the product.
pub fn cublas_gemm(cfg: &CublasGemmConfig) -> Result<CublasGemmResult, GpuError> {
    #[cfg(not(feature = "gpu"))]
    {
        let _ = cfg;
        Err(GpuError::NotBuilt(Backend::Cublas))
    }
    #[cfg(feature = "gpu")]
    {
        check_gemm(cfg)?;
        crate::gpu::cublas_gemm(cfg)
    }
}

#[cfg(feature = "gpu")]
fn check_gemm(cfg: &CublasGemmConfig) -> Result<(), GpuError> {
    if cfg.n == 0 || cfg.n > MAX_GPU_N {
        return Err(GpuError::Config(format!(
            "n must be in 1..={MAX_GPU_N}, not {}",
            cfg.n
        )));
    }
    if cfg.iterations == 0 {
        return Err(GpuError::Config("iterations must be at least 1".into()));
    }
    Ok(())
}

/// Runs an NCCL allgather among `cfg.peers` as rank `cfg.rank` (a world of one is allowed).
pub fn nccl_allgather(cfg: &NcclAllgatherConfig) -> Result<NcclAllgatherResult, GpuError> {
    #[cfg(not(feature = "gpu"))]
    {
        let _ = cfg;
        Err(GpuError::NotBuilt(Backend::Nccl))
    }
    #[cfg(feature = "gpu")]
    {
        check_nccl(cfg)?;
        crate::gpu::nccl_allgather(cfg)
    }
}

#[cfg(feature = "gpu")]
fn check_nccl(cfg: &NcclAllgatherConfig) -> Result<(), GpuError> {
    let world = cfg.peers.len();
    if world == 0 {
        return Err(GpuError::Config("no peers".into()));
    }
    if cfg.rank >= world {
        return Err(GpuError::Config(format!(
            "rank {} of a world of {world}",
            cfg.rank
        )));
    }
    if cfg.bytes == 0 || cfg.iterations == 0 {
        return Err(GpuError::Config(
            "bytes and iterations must be at least 1".into(),
        ));
    }
    if cfg.bytes.checked_mul(world).is_none() {
        return Err(GpuError::Config("bytes x world overflows".into()));
    }
    if cfg.timeout.is_zero() {
        return Err(GpuError::Config("the timeout must be positive".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn gemm_cfg() -> CublasGemmConfig {
        CublasGemmConfig {
            device: 0,
            n: 64,
            iterations: 1,
            dtype: Dtype::F32,
        }
    }

    fn nccl_cfg() -> NcclAllgatherConfig {
        NcclAllgatherConfig {
            peers: vec!["127.0.0.1:1".parse().unwrap()],
            rank: 0,
            bytes: 1024,
            iterations: 1,
            timeout: Duration::from_secs(5),
            device: 0,
        }
    }

    #[test]
    fn dtypes_parse() {
        assert_eq!("bf16".parse::<Dtype>().unwrap(), Dtype::Bf16);
        assert_eq!("FP16".parse::<Dtype>().unwrap(), Dtype::F16);
        assert_eq!("f32".parse::<Dtype>().unwrap(), Dtype::F32);
        assert!("int8".parse::<Dtype>().is_err());
        assert_eq!(Dtype::Bf16.to_string(), "bf16");
    }

    #[cfg(not(feature = "gpu"))]
    #[test]
    fn without_the_feature_both_backends_say_so() {
        let e = cublas_gemm(&gemm_cfg()).unwrap_err();
        assert!(matches!(e, GpuError::NotBuilt(Backend::Cublas)), "{e}");
        assert!(e.to_string().contains("built without the gpu feature"));
        let e = nccl_allgather(&nccl_cfg()).unwrap_err();
        assert!(matches!(e, GpuError::NotBuilt(Backend::Nccl)), "{e}");
    }

    #[cfg(feature = "gpu")]
    #[test]
    fn bad_configurations_are_refused_before_any_cuda_call() {
        for cfg in [
            CublasGemmConfig { n: 0, ..gemm_cfg() },
            CublasGemmConfig {
                n: MAX_GPU_N + 1,
                ..gemm_cfg()
            },
            CublasGemmConfig {
                iterations: 0,
                ..gemm_cfg()
            },
        ] {
            assert!(matches!(cublas_gemm(&cfg), Err(GpuError::Config(_))));
        }
        for cfg in [
            NcclAllgatherConfig {
                peers: vec![],
                ..nccl_cfg()
            },
            NcclAllgatherConfig {
                rank: 1,
                ..nccl_cfg()
            },
            NcclAllgatherConfig {
                bytes: 0,
                ..nccl_cfg()
            },
        ] {
            assert!(matches!(nccl_allgather(&cfg), Err(GpuError::Config(_))));
        }
    }
}
