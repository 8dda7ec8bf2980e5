//! `faultline-fake-nvml`: a test double of NVIDIA's `libnvidia-ml.so`.
//!
//! Built as a `cdylib`, this crate exports the subset of NVML's C API that faultline's agent
//! calls, with NVML's exact symbol names, signatures, struct layouts and return codes, so the
//! agent (through the real `nvml-wrapper`, loaded with `Nvml::builder().lib_path(..)`) can be
//! tested without a GPU. What the "GPUs" report comes from a JSON file named by the
//! `FAKE_NVML_STATE` environment variable, re-read on every call, so tests inject faults (ECC
//! errors, lost GPUs, Xid events, hung calls) by rewriting it. See `README.md` for the schema.
//!
//! Why `unsafe`: a C ABI test double has no choice. The entry points are `extern "C"`, take raw
//! pointers from C callers and write results through them. The unsafety is confined to
//! `ffi.rs`: small `put`/`put_str` helpers that null-check before writing, opaque handles that
//! are integers checked against the state (never dereferenced), and `catch_unwind` around every
//! body so a panic becomes `NVML_ERROR_UNKNOWN` instead of unwinding into C. The state model in
//! `state.rs` is safe Rust and unit tested through the `rlib`.

#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_debug_implementations, rust_2018_idioms)]
// NVML's constants keep their bindgen (C) names, and are matched on.
#![allow(non_upper_case_globals)]

pub mod ffi;
pub mod state;

pub use state::{State, StateError, STATE_ENV};
