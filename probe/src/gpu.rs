//! The cuBLAS GEMM and NCCL allgather backends on cudarc (built with the `gpu` feature; the
//! public face is `accel`). libcuda, libcublas and libnccl are loaded at run time: each backend
//! first asks cudarc whether its libraries can be loaded (an absent one is "backend ...
//! unavailable"), and runs everything after that under `catch_unwind` with the panic message
//! silenced, because cudarc panics where a library or a symbol cannot be loaded. The only
//! module of the crate allowed `unsafe`; every unsafe block says why it is sound.

use std::any::Any;
use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Once};
use std::time::{Duration, Instant};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, DeviceRepr, DriverError, ValidAsZeroBits};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id};

use crate::backend::{
    Backend, CublasGemmConfig, CublasGemmResult, Dtype, GpuError, NcclAllgatherConfig,
    NcclAllgatherResult,
};
use crate::{allgather, ncclid, pattern, GemmResult};

// ---------------------------------------------------------------------------------------------
// Panics from cudarc, caught and silenced.

thread_local! {
    /// Set while this thread runs code whose panics are caught and reported as errors.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}
static HOOK: Once = Once::new();

/// Runs `f`, turning a panic into `Err(message)` and keeping the panic hook quiet meanwhile (no
/// "thread panicked at" line, no backtrace) on this thread only; other threads' panics are
/// reported as usual.
pub(crate) fn quietly<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    // AssertUnwindSafe: whatever `f` was building is dropped with the panic; nothing it touched
    // is used afterwards.
    let result = std::panic::catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    result.map_err(|payload| panic_message(payload.as_ref()))
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// A caught cudarc panic as an error: a library or symbol it could not load is "unavailable".
fn from_panic(backend: Backend, msg: String) -> GpuError {
    // cudarc: `Unable to dynamically load the "cublas" shared library - searched for ...`
    if msg.starts_with("Unable to dynamically load") {
        let lib = msg.split('"').nth(1).unwrap_or("a CUDA library");
        return GpuError::Unavailable {
            backend,
            why: format!("cannot load lib{lib} ({})", hint(lib)),
        };
    }
    // cudarc: `Missing symbol cublasFoo: ...`
    if msg.starts_with("Missing symbol") {
        return GpuError::Unavailable {
            backend,
            why: format!(
                "{} (the library found is older than this probe needs, or not the real one)",
                one_line(&msg)
            ),
        };
    }
    GpuError::Panicked {
        backend,
        msg: one_line(&msg),
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

// ---------------------------------------------------------------------------------------------
// Libraries and devices.

#[derive(Debug, Clone, Copy)]
enum Lib {
    Driver,
    Cublas,
    Nccl,
}

impl Lib {
    /// cudarc's name for it (`lib<name>.so...`).
    fn name(self) -> &'static str {
        match self {
            Lib::Driver => "cuda",
            Lib::Cublas => "cublas",
            Lib::Nccl => "nccl",
        }
    }

    fn present(self) -> bool {
        // SAFETY: `is_culib_present` dlopens each candidate file name and closes it again. Loading
        // a CUDA library runs only that library's initialisers, which need nothing from us, and
        // no handle or symbol from the probe outlives the call.
        unsafe {
            match self {
                Lib::Driver => cudarc::driver::sys::is_culib_present(),
                Lib::Cublas => cudarc::cublas::sys::is_culib_present(),
                Lib::Nccl => cudarc::nccl::sys::is_culib_present(),
            }
        }
    }
}

/// The file names cudarc tries for `lib` on this platform, and what to do about it.
fn hint(lib: &str) -> String {
    let mut tried: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates(lib) {
        // The `lib<name>64_<ver>` forms are Windows DLL names.
        if !name.contains("64") && !tried.contains(&name) {
            tried.push(name);
        }
    }
    let mut s = format!(
        "tried {}; none loads from the library path (LD_LIBRARY_PATH, ldconfig)",
        tried.join(", ")
    );
    match lib {
        "cuda" => s.push_str("; libcuda comes with the NVIDIA driver"),
        "nccl" => s.push_str(
            "; a runtime-only NCCL install has just libnccl.so.2, which is not among these \
             names: link libnccl.so to it in a directory on LD_LIBRARY_PATH",
        ),
        _ => {}
    }
    s
}

fn require(backend: Backend, libs: &[Lib]) -> Result<(), GpuError> {
    for lib in libs {
        if !lib.present() {
            return Err(GpuError::Unavailable {
                backend,
                why: format!("cannot load lib{} ({})", lib.name(), hint(lib.name())),
            });
        }
    }
    Ok(())
}

fn driver_detail(e: &DriverError) -> String {
    match e.error_string() {
        Ok(s) => format!("{:?}: {}", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}

fn driver_call(backend: Backend, what: &'static str) -> impl Fn(DriverError) -> GpuError {
    move |e| GpuError::Call {
        backend,
        what,
        detail: driver_detail(&e),
    }
}

fn nccl_call(what: &'static str) -> impl Fn(NcclError) -> GpuError {
    move |e| GpuError::Call {
        backend: Backend::Nccl,
        what,
        detail: format!("{:?} (NCCL_DEBUG=WARN says more)", e.0),
    }
}

/// Initialises the driver and opens GPU `device` (its primary context, bound to this thread).
fn open_device(backend: Backend, device: usize) -> Result<(Arc<CudaContext>, String), GpuError> {
    cudarc::driver::result::init().map_err(|e| GpuError::Unavailable {
        backend,
        why: format!("the CUDA driver does not start ({})", driver_detail(&e)),
    })?;
    let count = CudaContext::device_count().map_err(driver_call(backend, "count the GPUs"))?;
    if device >= usize::try_from(count).unwrap_or(0) {
        return Err(GpuError::Config(format!(
            "--device {device}: this node has {count} CUDA device(s)"
        )));
    }
    let ctx = CudaContext::new(device).map_err(driver_call(backend, "open the GPU"))?;
    let name = ctx
        .name()
        .map_err(driver_call(backend, "read the GPU's name"))?;
    Ok((ctx, name))
}

// ---------------------------------------------------------------------------------------------
// cuBLAS GEMM.

/// Element types the GEMM runs in.
trait Element: DeviceRepr + ValidAsZeroBits + Copy {
    const DTYPE: Dtype;
    /// Relative tolerance of one product entry (against the sum of |a_ik * b_kj|): the output's
    /// rounding, as inputs and products are exact and the accumulation is FP32.
    const TOLERANCE: f64;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    const TOLERANCE: f64 = 1e-5;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Element for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    const TOLERANCE: f64 = 1.0 / 128.0;
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}

impl Element for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
    const TOLERANCE: f64 = 1.0 / 1024.0;
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}

/// Inputs: multiples of 1/8 in [-3/8, 3/8] and [-1/4, 1/4], exact in every dtype, with exact
/// products, so the expected product is exact and cannot overflow f16 for n <= 32768.
fn a_value(i: usize) -> f32 {
    ((i % 7) as f32 - 3.0) * 0.125
}

fn b_value(i: usize) -> f32 {
    ((i % 5) as f32 - 2.0) * 0.125
}

/// Entries of the product checked after the timed loop: the corners and a spread of others.
fn sample_entries(n: usize) -> Vec<(usize, usize)> {
    let mut v = vec![(0, 0), (n - 1, n - 1), (0, n - 1), (n - 1, 0)];
    v.extend((0..28).map(|s| ((s * 7919 + 13) % n, (s * 104_729 + 7) % n)));
    v
}

pub(crate) fn cublas_gemm(cfg: &CublasGemmConfig) -> Result<CublasGemmResult, GpuError> {
    let backend = Backend::Cublas;
    quietly(|| {
        require(backend, &[Lib::Driver, Lib::Cublas])?;
        match cfg.dtype {
            Dtype::F32 => gemm_as::<f32>(cfg),
            Dtype::Bf16 => gemm_as::<half::bf16>(cfg),
            Dtype::F16 => gemm_as::<half::f16>(cfg),
        }
    })
    .unwrap_or_else(|msg| Err(from_panic(backend, msg)))
}

fn gemm_as<T: Element>(cfg: &CublasGemmConfig) -> Result<CublasGemmResult, GpuError>
where
    CudaBlas: Gemm<T>,
{
    let backend = Backend::Cublas;
    let call = |what| driver_call(backend, what);
    let n = cfg.n;
    let dim = i32::try_from(n).map_err(|_| GpuError::Config(format!("n {n} is too large")))?;
    let (ctx, device_name) = open_device(backend, cfg.device)?;
    let stream = ctx.default_stream();
    let blas = CudaBlas::new(stream.clone()).map_err(|e| GpuError::Call {
        backend,
        what: "create a cuBLAS handle",
        detail: format!("{:?}", e.0),
    })?;
    // Column-major, as cuBLAS reads them: A[i + k*n], B[k + j*n].
    let a_host: Vec<T> = (0..n * n).map(|i| T::from_f32(a_value(i))).collect();
    let b_host: Vec<T> = (0..n * n).map(|i| T::from_f32(b_value(i))).collect();
    let a = stream
        .clone_htod(&a_host)
        .map_err(call("copy A to the GPU"))?;
    let b = stream
        .clone_htod(&b_host)
        .map_err(call("copy B to the GPU"))?;
    let mut c = stream
        .alloc_zeros::<T>(n * n)
        .map_err(call("allocate C on the GPU"))?;
    let gemm = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: dim,
        n: dim,
        k: dim,
        alpha: T::from_f32(1.0),
        lda: dim,
        ldb: dim,
        beta: T::from_f32(0.0),
        ldc: dim,
    };
    let mut run = || {
        // SAFETY: a, b and c are device buffers of n*n elements of T on `blas`'s stream, and
        // `gemm` describes untransposed n x n matrices with leading dimension n (m = n = k =
        // lda = ldb = ldc = n), so cuBLAS reads and writes only inside those buffers, which
        // live until after the final synchronize below.
        unsafe { blas.gemm(gemm, &a, &b, &mut c) }.map_err(|e| GpuError::Call {
            backend,
            what: "run the GEMM",
            detail: format!("{:?}", e.0),
        })
    };
    run()?;
    stream
        .synchronize()
        .map_err(call("finish the warm-up GEMM"))?;
    let start = Instant::now();
    for _ in 0..cfg.iterations {
        run()?;
    }
    stream.synchronize().map_err(call("finish the GEMMs"))?;
    let elapsed = start.elapsed();
    let got = stream
        .clone_dtoh(&c)
        .map_err(call("copy C back from the GPU"))?;
    let samples = sample_entries(n);
    for &(row, col) in &samples {
        let (mut want, mut scale) = (0.0f64, 0.0f64);
        for k in 0..n {
            let p = a_host[row + k * n].to_f64() * b_host[k + col * n].to_f64();
            want += p;
            scale += p.abs();
        }
        let value = got[row + col * n].to_f64();
        // NaN fails too.
        let close = (value - want).abs() <= T::TOLERANCE * scale + 1e-6;
        if !close {
            return Err(GpuError::WrongProduct {
                row,
                col,
                got: value,
                want,
            });
        }
    }
    Ok(CublasGemmResult {
        gemm: GemmResult {
            backend: "cublas",
            n,
            iterations: cfg.iterations,
            elapsed,
            gflops: crate::gflops(n, cfg.iterations, elapsed),
        },
        dtype: T::DTYPE,
        device: cfg.device,
        device_name,
        checked_entries: samples.len(),
    })
}

// ---------------------------------------------------------------------------------------------
// NCCL allgather.

/// Where an NCCL run is, for the error when the deadline passes in a call that cannot be
/// interrupted (communicator init and collectives wait for the other ranks).
const PHASES: [&str; 8] = [
    "loading the CUDA libraries",
    "opening the GPU",
    "the NCCL id exchange",
    "NCCL communicator init (waiting for every rank to join)",
    "allocating the buffers",
    "the warm-up allgather",
    "the timed allgathers",
    "copying back and checking the data (piece by piece)",
];

/// Extra wait for the worker after the deadline, so its own deadline error (which names the
/// missing rank) wins over the watchdog's.
const WATCHDOG_GRACE: Duration = Duration::from_secs(1);

/// Runs the allgather on a worker thread and waits at most until the deadline (plus a grace):
/// NCCL's init and collectives block until every rank takes part, with no timeout of their
/// own. After a deadline error the worker may still be blocked in NCCL; the probe exits.
pub(crate) fn nccl_allgather(cfg: &NcclAllgatherConfig) -> Result<NcclAllgatherResult, GpuError> {
    let backend = Backend::Nccl;
    let deadline = Instant::now() + cfg.timeout;
    let phase = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let worker = {
        let cfg = cfg.clone();
        let phase = Arc::clone(&phase);
        move || {
            let result = quietly(|| nccl_run(&cfg, deadline, &phase))
                .unwrap_or_else(|msg| Err(from_panic(backend, msg)));
            let _ = tx.send(result);
        }
    };
    std::thread::Builder::new()
        .name("nccl".into())
        .spawn(worker)
        .map_err(|e| GpuError::Call {
            backend,
            what: "start the NCCL thread",
            detail: e.to_string(),
        })?;
    let wait = deadline.saturating_duration_since(Instant::now()) + WATCHDOG_GRACE;
    match rx.recv_timeout(wait) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => Err(GpuError::Deadline {
            limit: cfg.timeout,
            phase: PHASES
                .get(phase.load(Ordering::SeqCst))
                .copied()
                .unwrap_or("the run"),
        }),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(GpuError::Panicked {
            backend,
            msg: "the NCCL thread ended without a result".into(),
        }),
    }
}

fn nccl_version() -> Result<String, GpuError> {
    cudarc::nccl::result::get_nccl_version()
        .map(dotted_version)
        .map_err(nccl_call("read NCCL's version"))
}

/// NCCL_VERSION_CODE as `major.minor.patch`: major*10000 + minor*100 + patch since 2.9,
/// major*1000 + minor*100 + patch before.
fn dotted_version(v: i32) -> String {
    if v >= 10_000 {
        format!("{}.{}.{}", v / 10_000, v / 100 % 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, v / 100 % 10, v % 100)
    }
}

fn nccl_run(
    cfg: &NcclAllgatherConfig,
    deadline: Instant,
    phase: &AtomicUsize,
) -> Result<NcclAllgatherResult, GpuError> {
    let backend = Backend::Nccl;
    let call = |what| driver_call(backend, what);
    let at = |p: usize| phase.store(p, Ordering::SeqCst);
    let world = cfg.peers.len();
    let bytes = cfg.bytes;
    require(backend, &[Lib::Driver, Lib::Nccl])?;
    let nccl_version = nccl_version()?;
    at(1);
    let (ctx, device_name) = open_device(backend, cfg.device)?;
    let stream = ctx.new_stream().map_err(call("create a stream"))?;
    at(2);
    let exchange = ncclid::Exchange {
        addr: cfg.peers[0],
        world,
        bytes: bytes as u64,
    };
    let id = if cfg.rank == 0 {
        let id = Id::new().map_err(nccl_call("create the NCCL unique id"))?;
        if world > 1 {
            let mut raw = [0u8; ncclid::ID_LEN];
            for (r, c) in raw.iter_mut().zip(id.internal()) {
                *r = c.to_ne_bytes()[0];
            }
            ncclid::serve(&exchange, &raw, deadline)?;
        }
        id
    } else {
        let raw = ncclid::fetch(&exchange, cfg.rank, deadline)?;
        Id::uninit(raw.map(|b| std::ffi::c_char::from_ne_bytes([b])))
    };
    at(3);
    let comm = Comm::from_rank(Arc::clone(&stream), cfg.rank, world, id)
        .map_err(nccl_call("create the NCCL communicator"))?;
    at(4);
    // Host memory stays bounded: this rank's block goes up, and the gathered result comes back,
    // in pieces of `allgather::PIECE` through two reused host buffers; the whole block and the
    // gathered tensor exist only on the GPU.
    let piece = allgather::PIECE.min(bytes);
    let mut host = vec![0u8; piece];
    let mut want = vec![0u8; piece];
    let mut send = stream
        .alloc_zeros::<u8>(bytes)
        .map_err(call("allocate the send buffer"))?;
    for start in (0..bytes).step_by(piece) {
        let n = piece.min(bytes - start);
        pattern::fill_at(cfg.rank, start, &mut host[..n]);
        stream
            .memcpy_htod(&host[..n], &mut send.slice_mut(start..start + n))
            .map_err(call("copy this rank's block to the GPU"))?;
        // The host buffer is refilled next: wait until the copy has read it.
        stream
            .synchronize()
            .map_err(call("copy this rank's block to the GPU"))?;
    }
    let mut recv = stream
        .alloc_zeros::<u8>(bytes * world)
        .map_err(call("allocate the receive buffer"))?;
    at(5);
    comm.all_gather(&send, &mut recv)
        .map_err(nccl_call("run the allgather"))?;
    stream
        .synchronize()
        .map_err(call("finish the warm-up allgather"))?;
    at(6);
    let mut seconds = Vec::new();
    for _ in 0..cfg.iterations {
        if Instant::now() >= deadline {
            return Err(GpuError::Deadline {
                limit: cfg.timeout,
                phase: PHASES[6],
            });
        }
        // Cleared before every iteration (untimed), so the check after the last one sees only
        // what that allgather wrote.
        stream
            .memset_zeros(&mut recv)
            .map_err(call("clear the receive buffer"))?;
        stream
            .synchronize()
            .map_err(call("clear the receive buffer"))?;
        let t0 = Instant::now();
        comm.all_gather(&send, &mut recv)
            .map_err(nccl_call("run the allgather"))?;
        stream.synchronize().map_err(call("finish the allgather"))?;
        seconds.push(t0.elapsed().as_secs_f64());
    }
    at(7);
    // Checked piece by piece: each piece of the gathered result is copied into the one host
    // buffer and compared with its owner's pattern, never the whole result at once.
    for owner in 0..world {
        for start in (0..bytes).step_by(piece) {
            let n = piece.min(bytes - start);
            let at = owner * bytes + start;
            stream
                .memcpy_dtoh(&recv.slice(at..at + n), &mut host[..n])
                .map_err(call("copy the gathered data back"))?;
            stream
                .synchronize()
                .map_err(call("copy the gathered data back"))?;
            if let Some(i) = pattern::first_mismatch(owner, start, &host[..n], &mut want) {
                return Err(GpuError::Corrupt {
                    owner,
                    offset: start + i,
                });
            }
        }
    }
    drop(comm);
    Ok(NcclAllgatherResult {
        backend: "nccl",
        report: allgather::summarize(world, cfg.rank, bytes, seconds),
        device: cfg.device,
        device_name,
        nccl_version,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn quietly_turns_a_panic_into_its_message() {
        assert_eq!(quietly(|| 7), Ok(7));
        assert_eq!(
            quietly(|| -> u8 { panic!("no {} here", "libfoo") }),
            Err("no libfoo here".to_string())
        );
        // Nested: the outer call stays quiet after the inner one returns.
        let r = quietly(|| {
            let _ = quietly(|| panic!("inner"));
            panic!("outer")
        });
        assert_eq!(r, Err::<(), _>("outer".to_string()));
    }

    #[test]
    fn cudarc_load_panics_read_as_unavailable() {
        let e = from_panic(
            Backend::Cublas,
            "Unable to dynamically load the \"cublas\" shared library - searched for library \
             names: [...]"
                .into(),
        );
        let s = e.to_string();
        assert!(
            s.starts_with("backend cublas unavailable: cannot load libcublas (tried libcublas.so"),
            "{s}"
        );
        let e = from_panic(Backend::Nccl, "Missing symbol ncclFoo: undefined".into());
        assert!(matches!(e, GpuError::Unavailable { .. }), "{e}");
        let e = from_panic(Backend::Nccl, "Error when aborting Comm.".into());
        assert!(matches!(e, GpuError::Panicked { .. }), "{e}");
    }

    #[test]
    fn product_samples_stay_inside_the_matrix() {
        for n in [1, 2, 7, 100, 8192] {
            assert!(sample_entries(n).iter().all(|&(i, j)| i < n && j < n));
        }
    }

    #[test]
    fn inputs_are_exact_in_half_precision() {
        for i in 0..35 {
            for v in [a_value(i), b_value(i)] {
                assert_eq!(half::bf16::from_f32(v).to_f32(), v);
                assert_eq!(half::f16::from_f32(v).to_f32(), v);
            }
        }
    }

    #[test]
    fn nccl_versions_read_as_dotted() {
        assert_eq!(dotted_version(22_105), "2.21.5");
        assert_eq!(dotted_version(23_003), "2.30.3");
        assert_eq!(dotted_version(2_804), "2.8.4");
    }
}
