//! Sources: turn the world into engine inputs.
//!
//! Each source runs on its own task or thread, gets a [`SourceContext`] with the channel to the
//! engine, the metrics and the shutdown token, and never blocks another source.

pub(crate) mod ascend;
pub(crate) mod control;
pub(crate) mod gpu_count;
pub(crate) mod kmsg;
pub mod nvml;
pub mod policy_watch;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::metrics::Metrics;
use faultline_core::engine::{DetectorState, Observation};

pub(crate) use faultline_core::engine::Input;

/// What every source gets.
#[derive(Debug, Clone)]
pub(crate) struct SourceContext {
    pub tx: mpsc::Sender<Input>,
    pub metrics: Arc<Metrics>,
    /// The clock sources read time on.
    pub clock: Arc<dyn Clock>,
    pub shutdown: CancellationToken,
}

/// Starts `body` on a thread named `name`. If the thread dies of a panic while the agent is not
/// stopping, `on_death` gets a reason (`the kmsg thread stopped: <panic message>`) to report:
/// a detector whose thread is gone must not go on showing Running.
pub(crate) fn spawn_watched(
    name: &str,
    shutdown: CancellationToken,
    body: impl FnOnce() + Send + 'static,
    on_death: impl FnOnce(String) + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let thread = name.to_string();
    std::thread::Builder::new()
        .name(thread.clone())
        .spawn(move || {
            let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) else {
                return;
            };
            let msg = panic_message(&*panic);
            tracing::error!(thread = %thread, panic = %msg, "a source thread died");
            if !shutdown.is_cancelled() {
                on_death(format!("the {thread} thread stopped: {msg}"));
            }
        })
}

/// A panic's message, as `panic!` was given it.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_string())
}

/// The async counterpart of [`spawn_watched`], for sources that run as tasks (the NVML loop,
/// the Ascend poller, the policy watcher, …): if `task` dies of a panic while the agent is not
/// stopping, it is logged, and each of `detectors` is reported Down with the reason (`the nvml
/// task stopped: <panic message>`), instead of the detector showing Running over a source that
/// is gone.
pub(crate) async fn watched_task(
    name: &'static str,
    detectors: &'static [&'static str],
    ctx: SourceContext,
    task: impl std::future::Future<Output = ()> + Send,
) {
    use futures::FutureExt;
    let Err(panic) = std::panic::AssertUnwindSafe(task).catch_unwind().await else {
        return;
    };
    let msg = panic_message(&*panic);
    tracing::error!(source = name, panic = %msg, "a source task died");
    if ctx.shutdown.is_cancelled() {
        return;
    }
    for d in detectors {
        let why = format!("the {name} task stopped: {msg}");
        let obs = detector(d, DetectorState::Down, Some(why));
        let _ = ctx.tx.send(Input::Obs(obs)).await;
    }
}

/// The observation that detector `name` is in `state`, for `reason`.
pub(crate) fn detector(name: &str, state: DetectorState, reason: Option<String>) -> Observation {
    Observation::Detector {
        name: name.into(),
        state,
        reason,
    }
}

/// An `on_death` for [`spawn_watched`] that reports the detector `name` Down to the engine.
pub(crate) fn report_down(name: &'static str, ctx: &SourceContext) -> impl FnOnce(String) + Send {
    let tx = ctx.tx.clone();
    move |why| {
        let obs = detector(name, DetectorState::Down, Some(why));
        // A std thread: blocking is fine, and an engine that is gone needs no report.
        let _ = tx.blocking_send(Input::Obs(obs));
    }
}

/// Keeps `(time, value)` samples of a counter for `window` and returns its growth over the
/// window. A counter that went down was reset (driver reload, device reset): only the growth
/// since the reset counts.
pub(crate) fn counter_growth(
    hist: &mut VecDeque<(Instant, u64)>,
    now: Instant,
    value: u64,
    window: Duration,
) -> u64 {
    hist.push_back((now, value));
    while hist.len() > 1
        && hist
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
    {
        hist.pop_front();
    }
    // Back from the newest sample while the counter only grew: the oldest of those is the base.
    let base = hist
        .iter()
        .rev()
        .map(|(_, v)| *v)
        .take_while(|v| *v <= value)
        .min()
        .unwrap_or(value);
    value - base
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;

    /// A source task that panics is reported like a thread: each of its detectors goes Down
    /// with the panic's text; one that ends normally reports nothing.
    #[tokio::test]
    async fn a_dead_task_reports_its_detectors_down() {
        let (tx, mut rx) = mpsc::channel(4);
        let ctx = SourceContext {
            tx,
            metrics: Arc::new(Metrics::default()),
            clock: std::sync::Arc::new(crate::clock::SystemClock),
            shutdown: CancellationToken::new(),
        };
        let dies = async { panic!("called `Option::unwrap()` on a `None` value") };
        watched_task("ascend", &["npu-smi", "hccn_tool"], ctx.clone(), dies).await;
        let mut seen = Vec::new();
        while let Ok(Input::Obs(Observation::Detector {
            name,
            state,
            reason,
        })) = rx.try_recv()
        {
            seen.push((name, state, reason.unwrap_or_default()));
        }
        let why = "the ascend task stopped: called `Option::unwrap()` on a `None` value";
        assert_eq!(
            seen,
            [
                ("npu-smi".to_string(), DetectorState::Down, why.to_string()),
                (
                    "hccn_tool".to_string(),
                    DetectorState::Down,
                    why.to_string()
                ),
            ]
        );
        watched_task("ascend", &["npu-smi"], ctx.clone(), async {}).await;
        assert!(rx.try_recv().is_err(), "a normal end reports nothing");
        ctx.shutdown.cancel();
        watched_task("ascend", &["npu-smi"], ctx.clone(), async { panic!("x") }).await;
        assert!(rx.try_recv().is_err(), "nothing at shutdown");
    }

    /// A source thread that panics is reported: its detector goes Down with the panic's text.
    /// At shutdown, nothing is reported.
    #[test]
    fn a_dead_thread_reports_its_detector_down() {
        let (tx, mut rx) = mpsc::channel(4);
        let ctx = SourceContext {
            tx,
            metrics: Arc::new(Metrics::default()),
            clock: std::sync::Arc::new(crate::clock::SystemClock),
            shutdown: CancellationToken::new(),
        };
        let h = spawn_watched(
            "kmsg",
            ctx.shutdown.clone(),
            || panic!("index out of bounds"),
            report_down("kmsg", &ctx),
        )
        .unwrap();
        h.join().unwrap();
        let Some(Input::Obs(Observation::Detector {
            name,
            state,
            reason,
        })) = rx.try_recv().ok()
        else {
            panic!("no detector report");
        };
        assert_eq!((name.as_str(), state), ("kmsg", DetectorState::Down));
        assert_eq!(
            reason.as_deref(),
            Some("the kmsg thread stopped: index out of bounds")
        );
        ctx.shutdown.cancel();
        let h = spawn_watched(
            "kmsg",
            ctx.shutdown.clone(),
            || panic!("late"),
            report_down("kmsg", &ctx),
        )
        .unwrap();
        h.join().unwrap();
        assert!(rx.try_recv().is_err(), "nothing reported at shutdown");
        // A thread that returns is not a death.
        let h = spawn_watched("x", CancellationToken::new(), || {}, |_| panic!()).unwrap();
        h.join().unwrap();
    }

    #[test]
    fn counter_growth_over_a_window_and_across_resets() {
        let t0 = Instant::now();
        let w = Duration::from_secs(60);
        let s = |n: u64| t0 + Duration::from_secs(n);
        let mut h = VecDeque::new();
        assert_eq!(counter_growth(&mut h, s(0), 5, w), 0);
        assert_eq!(counter_growth(&mut h, s(10), 20, w), 15);
        // Reset to 2, then 4: growth since the reset only.
        assert_eq!(counter_growth(&mut h, s(20), 2, w), 0);
        assert_eq!(counter_growth(&mut h, s(30), 4, w), 2);
        // The window moves past the reset: 4 -> 9 within the window.
        assert_eq!(counter_growth(&mut h, s(85), 9, w), 5);
        assert_eq!(counter_growth(&mut h, s(200), 9, w), 0);
        assert_eq!(h.len(), 1);
    }
}
