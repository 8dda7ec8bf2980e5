//! faultline-core: the pure half of faultline.
//!
//! Everything here is a function of its arguments: record types, parsers (kernel log, PCI
//! addresses, `npu-smi` and `hccn_tool` output), the fault catalogs, the policy document and
//! its validation, the engine, and the peer-check planner and verdict logic. There is no I/O,
//! no clock (time comes in as a value), no async runtime and no thread. The agent crate
//! (`faultline-agent`) owns every source, sink and task and feeds this crate values.
//!
//! The rule is kept by the compiler, not by convention: the crate's dependencies are data and
//! format crates only (.ci/run checks `cargo tree`), and `core/clippy.toml` refuses wall-clock
//! reads and `std::fs`, `std::net` and `std::process`.

#![forbid(unsafe_code)]

pub mod catalog;
pub mod engine;
pub mod kmsg_position;
pub mod kmsg_reader;
pub mod parse;
pub mod peer;
pub mod policy;
pub mod record;
pub mod rules;
pub mod time;
