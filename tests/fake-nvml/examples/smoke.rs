//! Smoke check of the fake through the real nvml-wrapper, out of the test harness.
//!
//! ```text
//! cargo build -p faultline-fake-nvml
//! cargo run -p faultline-fake-nvml --example smoke -- target/debug/libfaultline_fake_nvml.so [STATE.json]
//! ```
//!
//! Builds nothing: argv[1] is the built cdylib (default: the one next to this example's
//! directory, `target/<profile>/`); argv[2] is where to write the state file (default: a
//! temporary directory). It writes the scenario state, points `FAKE_NVML_STATE` at it, loads the
//! library with `Nvml::builder().lib_path(..).init()`, prints every reading, receives the Xid 79
//! event, then marks device 0 lost and expects GPU_IS_LOST. Exits 1 on the first mismatch.

#[path = "../tests/common/mod.rs"]
mod common;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::ExitCode;

use nvml_wrapper::Nvml;

fn run(lib: &OsStr, state_path: PathBuf) -> common::Check {
    let state = common::scenario();
    common::write_state(&state_path, &state);
    // Before the library is loaded, while this is the only thread.
    std::env::set_var("FAKE_NVML_STATE", &state_path);
    println!("library: {}", lib.to_string_lossy());
    println!("state:   {}", state_path.display());

    let nvml = Nvml::builder()
        .lib_path(lib)
        .init()
        .map_err(|e| format!("init: {e}"))?;
    common::check_readings(&nvml, &state)?;
    common::check_xid_event(&nvml)?;
    common::check_lost(&nvml, &state_path, &state)?;
    nvml.shutdown().map_err(|e| format!("shutdown: {e}"))
}

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let lib = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(common::lib_next_to_exe);
    let dir = tempfile::tempdir().expect("tempdir");
    let state_path = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.path().join("state.json"));
    match run(lib.as_os_str(), state_path) {
        Ok(()) => {
            println!("smoke: all readings match");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("smoke: MISMATCH: {e}");
            ExitCode::FAILURE
        }
    }
}
