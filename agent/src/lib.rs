//! faultline-agent: detects accelerator faults on one node and publishes them.
//!
//! Data flows one way: sources turn the world into `faultline_core::engine::Observation`s; the
//! pure `faultline_core::engine::Engine` dedupes, escalates and recovers faults and derives the node's desired
//! state; sinks make the world match it. The peer-check coordinator is a crate of its own
//! (`faultline-coordinator`); `peer` is the agent's member side. See docs/ARCHITECTURE.md.

#![forbid(unsafe_code)]

pub mod atomic_file;
pub(crate) mod backoff;
pub(crate) mod child;
pub mod clear;
pub mod cli;
pub mod clock;
pub(crate) mod component;
pub mod daemon;
pub mod engine_loop;
pub mod http;
pub mod kube_client;
pub mod listen;
pub(crate) mod lock;
pub mod metrics;
pub(crate) mod operator_file;
pub mod peer;
pub mod rate_limit;
pub(crate) mod restore;
pub mod signals;
pub mod sink;
pub mod source;
