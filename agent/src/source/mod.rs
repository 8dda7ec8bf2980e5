//! Sources: turn the world into engine inputs.
//!
//! Each source runs on its own task or thread, gets a [`SourceContext`] with the channel to the
//! engine, the metrics and the shutdown token, and never blocks another source.

pub mod ascend;
pub mod control;
pub mod kmsg;
pub mod node;
pub mod nvml;
pub mod policy_watch;

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::engine::Observation;
use crate::metrics::Metrics;

/// What sources send to the engine loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Obs(Observation),
    /// Every kernel log record up to and including this sequence number has been sent. The
    /// engine loop persists it with the engine state so a restart neither skips nor recounts.
    KmsgCursor(u64),
}

/// What every source gets.
#[derive(Debug, Clone)]
pub struct SourceContext {
    pub tx: mpsc::Sender<Input>,
    pub metrics: Arc<Metrics>,
    pub shutdown: CancellationToken,
}
