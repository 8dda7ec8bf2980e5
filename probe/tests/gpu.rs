//! The GPU subcommands as the agent (or an operator) runs them on a node without a GPU: a build
//! with the `gpu` feature says "backend ... unavailable" (exit 1, one line, no panic text), one
//! without says it was built without the feature. Each test checks the build it is compiled in.
//! With the feature, stand-in CUDA libraries (built with `cc`) also drive the probe into
//! cudarc's panics (a missing symbol), which must come out as the same one-line error.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn probe(args: &[&str], library_path: Option<&std::path::Path>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_faultline-probe"));
    cmd.args(args).env("RUST_BACKTRACE", "1");
    match library_path {
        Some(p) => cmd.env("LD_LIBRARY_PATH", p),
        None => cmd.env_remove("LD_LIBRARY_PATH"),
    };
    cmd.output().unwrap()
}

/// Exit 1, nothing on stdout, exactly one line on stderr containing `want`, no panic text.
fn assert_one_line_failure(out: &Output, want: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(want), "{err}");
    for panic_text in ["panicked", "backtrace", "RUST_BACKTRACE", "stack backtrace"] {
        assert!(!err.contains(panic_text), "{err}");
    }
    err
}

fn gpu_commands() -> Vec<Vec<String>> {
    let peers2 = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let peer1 = format!("127.0.0.1:{}", free_port());
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    vec![
        s(&["gemm", "--backend", "cublas"]),
        s(&[
            "gemm",
            "--backend",
            "cublas",
            "--dtype",
            "bf16",
            "--n",
            "512",
        ]),
        s(&["nccl-allgather", "--peers", &peer1, "--rank", "0"]),
        s(&[
            "nccl-allgather",
            "--peers",
            &peers2,
            "--rank",
            "1",
            "--size",
            "1MiB",
            "--timeout",
            "2s",
        ]),
    ]
}

#[cfg(feature = "gpu")]
fn backend_of(args: &[String]) -> &'static str {
    if args[0] == "gemm" {
        "cublas"
    } else {
        "nccl"
    }
}

#[cfg(not(feature = "gpu"))]
#[test]
fn without_the_gpu_feature_the_gpu_backends_say_so() {
    for args in gpu_commands() {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_one_line_failure(
            &probe(&args, None),
            "this probe was built without the gpu feature",
        );
    }
}

/// On a machine with a GPU and the CUDA libraries the backends run instead; this test is for
/// the machines without (CI, developer laptops).
#[cfg(feature = "gpu")]
#[test]
fn without_cuda_libraries_the_gpu_backends_are_unavailable() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    for args in gpu_commands() {
        let backend = backend_of(&args);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // Here: "cannot load libcuda (tried libcuda.so, ...)"; with a CUDA toolkit but no
        // driver, another reason, still "unavailable".
        assert_one_line_failure(
            &probe(&args, None),
            &format!("backend {backend} unavailable: "),
        );
    }
}

/// Stand-in libraries in a directory: `empty` ones (load, export nothing) and a libcuda whose
/// cuInit finds no device.
#[cfg(all(feature = "gpu", target_os = "linux"))]
fn fake_libs(name: &str, libs: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("fake-cuda")
        .join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, source) in libs {
        let c = dir.join(format!("{file}.c"));
        std::fs::write(&c, source).unwrap();
        let st = Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join(file))
            .arg(&c)
            .status()
            .unwrap();
        assert!(st.success(), "cc {file}");
    }
    dir
}

#[cfg(all(feature = "gpu", target_os = "linux"))]
const EMPTY: &str = "int faultline_stand_in = 1;\n";

#[cfg(all(feature = "gpu", target_os = "linux"))]
const NO_DEVICE: &str = "int cuInit(unsigned int f) { (void)f; return 100; }\n\
    int cuGetErrorString(int e, const char **s) { (void)e; *s = \"no CUDA-capable device is detected\"; return 0; }\n";

#[cfg(all(feature = "gpu", target_os = "linux"))]
#[test]
fn a_library_without_its_symbols_is_unavailable_not_a_panic() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    // libcuda only: cuBLAS and NCCL are named as missing.
    let dir = fake_libs("only-cuda", &[("libcuda.so.1", EMPTY)]);
    for args in gpu_commands() {
        let backend = backend_of(&args);
        let lib = if backend == "cublas" {
            "libcublas"
        } else {
            "libnccl"
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_one_line_failure(
            &probe(&args, Some(&dir)),
            &format!("backend {backend} unavailable: cannot load {lib}"),
        );
    }
    // Every library loads but exports nothing: cudarc panics on the first symbol; the probe
    // reports it as unavailable, quietly.
    let dir = fake_libs(
        "empty",
        &[
            ("libcuda.so.1", EMPTY),
            ("libcublas.so.12", EMPTY),
            ("libnccl.so", EMPTY),
        ],
    );
    for args in gpu_commands() {
        let backend = backend_of(&args);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = assert_one_line_failure(
            &probe(&args, Some(&dir)),
            &format!("backend {backend} unavailable: Missing symbol"),
        );
        assert!(err.contains("older than this probe needs"), "{err}");
    }
    // A driver that finds no GPU.
    let dir = fake_libs(
        "no-device",
        &[("libcuda.so.1", NO_DEVICE), ("libcublas.so.12", EMPTY)],
    );
    let out = probe(&["gemm", "--backend", "cublas"], Some(&dir));
    assert_one_line_failure(
        &out,
        "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected",
    );
}

#[test]
fn the_cpu_gemm_still_prints_its_json() {
    let out = probe(&["gemm", "--n", "32", "--iterations", "2"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["backend"], "cpu");
    assert_eq!(v["n"], 32);
    assert_eq!(v["iterations"], 2);
    assert!(v["gflops"].as_f64().unwrap() > 0.0);
    assert!(v["elapsed"].is_object());
}

#[test]
fn the_cpu_gemm_refuses_half_precision() {
    let out = probe(&["gemm", "--dtype", "bf16", "--n", "8"], None);
    assert_one_line_failure(&out, "--backend cublas");
}
