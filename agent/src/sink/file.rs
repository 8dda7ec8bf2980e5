//! The node-local file sink: `faults.json` (the record) and `state.json` (what a restart
//! needs) in the state directory.
//!
//! Each file is replaced atomically (write a temporary file in the same directory, fsync,
//! rename), so a reader never sees a half-written file. Writes are rate-limited by a
//! [`WriteBudget`]: a few writes back to back go out at once, after that one per interval, and
//! every change in between is coalesced into the next write. A failed write is retried with
//! backoff; the engine keeps running meanwhile.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::atomic_file::write as write_atomic;
use crate::metrics::{Metrics, SinkLabel};
use crate::runtime::{PersistedState, Snapshot};

pub const FAULTS_FILE: &str = "faults.json";
pub const STATE_FILE: &str = "state.json";

/// Errors of the file sink.
#[derive(Debug, thiserror::Error)]
pub enum FileSinkError {
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Write(#[from] crate::atomic_file::WriteError),
    #[error("cannot encode {what}: {source}")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// A generic cell rate limiter (GCRA): up to `burst` writes at once, then one per `interval`.
#[derive(Debug, Clone)]
pub struct WriteBudget {
    interval: Duration,
    burst: u32,
    /// The theoretical time of the next write if writes were evenly spaced.
    tat: Instant,
}

impl WriteBudget {
    pub fn new(interval: Duration, burst: u32, now: Instant) -> Self {
        WriteBudget {
            interval,
            burst: burst.max(1),
            tat: now,
        }
    }

    /// How long to wait before the next write may go out.
    pub fn wait(&self, now: Instant) -> Duration {
        let slack = self.interval * (self.burst - 1);
        (self.tat.checked_sub(slack).unwrap_or(now)).saturating_duration_since(now)
    }

    /// Records a write made at `now`.
    pub fn spend(&mut self, now: Instant) {
        self.tat = self.tat.max(now) + self.interval;
    }
}

/// Writes one snapshot: the state first (so the record is never ahead of what a restart
/// restores), then the record.
pub fn write_snapshot(dir: &Path, snap: &Snapshot) -> Result<(), FileSinkError> {
    let state = serde_json::to_vec(&*snap.state).map_err(|source| FileSinkError::Encode {
        what: "state",
        source,
    })?;
    write_atomic(&dir.join(STATE_FILE), &state)?;
    let mut record =
        serde_json::to_vec_pretty(&*snap.record).map_err(|source| FileSinkError::Encode {
            what: "record",
            source,
        })?;
    record.push(b'\n');
    Ok(write_atomic(&dir.join(FAULTS_FILE), &record)?)
}

/// Reads `state.json`; a missing file is `Ok(None)`, an unreadable one an error to log.
pub fn read_state(dir: &Path) -> Result<Option<PersistedState>, String> {
    let path = dir.join(STATE_FILE);
    match std::fs::read(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("cannot parse {}: {e}", path.display())),
    }
}

/// Runs the sink until the snapshot channel closes (the engine stopped) or shutdown; always
/// writes the last snapshot it saw before returning.
pub async fn run(
    dir: PathBuf,
    mut rx: watch::Receiver<Option<Snapshot>>,
    metrics: Arc<Metrics>,
    mut budget: WriteBudget,
    ready: Arc<std::sync::atomic::AtomicBool>,
    shutdown: CancellationToken,
) {
    let label = SinkLabel { sink: "file" };
    let mut written: Option<u64> = None;
    let mut backoff = Duration::from_millis(100);
    loop {
        let closed = rx.changed().await.is_err();
        let wait = budget.wait(Instant::now());
        if !closed && !wait.is_zero() && !shutdown.is_cancelled() {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => {}
            }
        }
        loop {
            let snap = rx.borrow_and_update().clone();
            let Some(snap) = snap else { break };
            if written == Some(snap.revision) {
                break;
            }
            let d = dir.clone();
            let started = Instant::now();
            let snap2 = snap.clone();
            let result = tokio::task::spawn_blocking(move || write_snapshot(&d, &snap2))
                .await
                .unwrap_or_else(|e| {
                    Err(FileSinkError::Io {
                        path: dir.clone(),
                        source: std::io::Error::other(e.to_string()),
                    })
                });
            match result {
                Ok(()) => {
                    metrics.sink_writes.get_or_create(&label).inc();
                    metrics
                        .sink_write_seconds
                        .get_or_create(&label)
                        .observe(started.elapsed().as_secs_f64());
                    debug!(
                        revision = snap.revision,
                        latency_us = snap.applied_at.elapsed().as_micros() as u64,
                        "record written"
                    );
                    written = Some(snap.revision);
                    budget.spend(Instant::now());
                    ready.store(true, std::sync::atomic::Ordering::Relaxed);
                    backoff = Duration::from_millis(100);
                    break;
                }
                Err(e) => {
                    metrics.sink_errors.get_or_create(&label).inc();
                    warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "writing the local record failed");
                    if closed && shutdown.is_cancelled() && backoff > Duration::from_secs(2) {
                        return; // give up at shutdown after a few tries
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
            }
        }
        if closed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_allows_a_burst_then_one_per_interval() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut b = WriteBudget::new(ms(100), 3, t0);
        for _ in 0..3 {
            assert_eq!(b.wait(t0), Duration::ZERO);
            b.spend(t0);
        }
        assert_eq!(b.wait(t0), ms(100), "burst spent");
        assert_eq!(b.wait(t0 + ms(40)), ms(60));
        b.spend(t0 + ms(100));
        assert_eq!(b.wait(t0 + ms(100)), ms(100));
        // After a quiet period the whole burst is back, and no more.
        let later = t0 + ms(10_000);
        for _ in 0..3 {
            assert_eq!(b.wait(later), Duration::ZERO);
            b.spend(later);
        }
        assert!(b.wait(later) > Duration::ZERO);
        // At most burst + elapsed/interval writes in any span: 3 + 10 over one second.
        let mut b = WriteBudget::new(ms(100), 3, t0);
        let mut now = t0;
        let mut writes = 0;
        while now < t0 + ms(1000) {
            now += b.wait(now);
            if now >= t0 + ms(1000) {
                break;
            }
            b.spend(now);
            writes += 1;
        }
        assert_eq!(writes, 12);
    }

    #[test]
    fn corrupt_state_is_reported_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_state(dir.path()), Ok(None));
        std::fs::write(dir.path().join(STATE_FILE), b"{not json").unwrap();
        let err = read_state(dir.path()).unwrap_err();
        assert!(
            err.contains("cannot parse") && err.contains("state.json"),
            "{err}"
        );
    }
}
