//! The GPU backends as the rest of the probe sees them: the two entry points ([`cublas_gemm`],
//! [`nccl_allgather`]) and, from `backend`, their configurations, results and errors. This
//! module is in every build; without the `gpu` cargo feature the entry points fail with
//! [`GpuError::NotBuilt`], with it they run the cudarc code in `gpu.rs`.

pub use crate::backend::{
    Backend, CublasGemmConfig, CublasGemmResult, Dtype, GpuError, NcclAllgatherConfig,
    NcclAllgatherResult, MAX_GPU_N,
};

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
    use std::time::Duration;

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
