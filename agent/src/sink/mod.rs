//! Sinks: make the world match the engine's latest snapshot, idempotently and only on change.
//!
//! Every sink reads the snapshot `watch` channel, so a slow or failing sink only ever sees the
//! newest state (older ones are coalesced away) and never slows the engine.

pub mod file;
pub mod kube;
pub mod mindcluster;
pub mod publicfault;
