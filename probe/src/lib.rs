//! faultline-probe: the peer-check workload (allgather + GEMM), run by the agent as a child
//! process with a hard deadline.
//!
//! Backends: the CPU GEMM (here) and the TCP allgather (`allgather`) in every build; the cuBLAS
//! GEMM and the NCCL allgather (`accel`, implemented in `gpu` on cudarc) with the `gpu` cargo
//! feature, which loads the CUDA libraries at run time. NCCL's unique id travels from rank 0 to
//! the other ranks over TCP (`ncclid`). The rendezvous through the agents comes with the rest
//! of the peer-check work (issue 6).
//!
//! Memory: the allgathers never hold a whole block or the gathered result on the host. Data is
//! generated from, and checked against, `pattern` piece by piece, so a probe's peak RSS stays a
//! few MiB at any `--size` (it reports it: `rss`), and the probes fit in the agent's container.

// Only the cudarc calls in `gpu` need `unsafe`; everything else stays safe code.
#![deny(unsafe_code)]

pub mod accel;
pub mod allgather;
mod backend;
#[cfg(feature = "gpu")]
#[allow(unsafe_code)]
mod gpu;
mod hello;
pub mod ncclid;
pub mod pattern;
pub mod rss;

use std::time::{Duration, Instant};

/// C = A x B for row-major n x n matrices (i-k-j loop order, cache friendly enough for a probe
/// whose job is to compare nodes, not to win benchmarks).
pub fn gemm(n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    assert!(
        a.len() == n * n && b.len() == n * n && c.len() == n * n,
        "matrix sizes"
    );
    c.iter_mut().for_each(|x| *x = 0.0);
    for i in 0..n {
        let row = &mut c[i * n..(i + 1) * n];
        for k in 0..n {
            let aik = a[i * n + k];
            let brow = &b[k * n..(k + 1) * n];
            for (cj, bj) in row.iter_mut().zip(brow) {
                *cj += aik * bj;
            }
        }
    }
}

/// Result of one GEMM measurement.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GemmResult {
    /// `"cpu"` or `"cublas"`.
    pub backend: &'static str,
    pub n: usize,
    pub iterations: u32,
    pub elapsed: Duration,
    pub gflops: f64,
}

/// Runs `iterations` n x n GEMMs on deterministic inputs and reports the rate.
pub fn cpu_gemm(n: usize, iterations: u32) -> GemmResult {
    let a: Vec<f32> = (0..n * n).map(|i| ((i % 7) as f32) * 0.5).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i % 5) as f32) * 0.25).collect();
    let mut c = vec![0.0f32; n * n];
    let start = Instant::now();
    for _ in 0..iterations {
        gemm(n, &a, &b, &mut c);
        std::hint::black_box(&c);
    }
    let elapsed = start.elapsed();
    GemmResult {
        backend: "cpu",
        n,
        iterations,
        elapsed,
        gflops: gflops(n, iterations, elapsed),
    }
}

/// The rate of `iterations` n x n GEMMs (2n^3 flops each) in `elapsed`, in GFLOP/s.
pub fn gflops(n: usize, iterations: u32, elapsed: Duration) -> f64 {
    let flops = 2.0 * (n as f64).powi(3) * f64::from(iterations);
    flops / elapsed.as_secs_f64().max(1e-9) / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_matches_the_definition() {
        let n = 5;
        let a: Vec<f32> = (0..n * n).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..n * n).map(|i| (i as f32) - 3.0).collect();
        let mut c = vec![0.0; n * n];
        gemm(n, &a, &b, &mut c);
        for i in 0..n {
            for j in 0..n {
                let want: f32 = (0..n).map(|k| a[i * n + k] * b[k * n + j]).sum();
                assert_eq!(c[i * n + j], want, "({i},{j})");
            }
        }
    }

    #[test]
    fn rate_is_positive() {
        let r = cpu_gemm(32, 2);
        assert!(r.gflops > 0.0 && r.iterations == 2);
    }
}
