//! The NVML source: GPU inventory, Xid and double-bit ECC events, ECC counters, retired pages,
//! remapped rows, the driver's recovery action, NVLink state and error rates, PCIe link state
//! and replays, and lost GPUs.
//!
//! Threads, so that no NVML call can block anything but itself: one per GPU (polling), one for
//! the device count, one for events. Each reports what it reads to an async loop that runs the
//! pure [`analyze::Analyzer`] and sends observations to the engine. A watchdog in that loop
//! marks the NVML detector down when a call has not returned within `nvml.call_timeout`, and up
//! again when it returns. A thread that dies (a panic) marks the detector down for good: its
//! GPU is no longer watched. No NVML on the machine (no library, no driver) is normal: the
//! detector is `Idle`, with one info line.

pub(crate) mod analyze;
pub mod readings;
pub mod real;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use self::analyze::Analyzer;
use self::readings::{CallTracker, DeviceReadings, Identity, NvmlBackend, NvmlEvent, Reading};
use super::gpu_count::GpuCountLabel;
use super::{Input, SourceContext};
use crate::component::{Component, Context, Handle, StartError};
use crate::metrics::DETECTOR_NVML;
use faultline_core::engine::DetectorState;
use faultline_core::policy::LoadedPolicy;

/// The NVML source's flags.
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// NVML library to load instead of the system's `libnvidia-ml.so.1`.
    #[arg(long, env = "FAULTLINE_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// Do not use NVML at all.
    #[arg(long, env = "FAULTLINE_NO_NVML", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_nvml: bool,
}

impl Flags {
    /// The source, reading the GPU count the node's label states; `None` with `--no-nvml`.
    pub(crate) fn source(&self, label: watch::Receiver<GpuCountLabel>) -> Option<Nvml> {
        if self.no_nvml {
            info!("NVML source disabled");
            return None;
        }
        Some(Nvml {
            library: self.nvml_lib.clone(),
            label,
        })
    }
}

/// The NVML source, as the daemon starts it.
#[derive(Debug)]
pub(crate) struct Nvml {
    /// The library to load; default: the system's `libnvidia-ml.so.1`.
    library: Option<PathBuf>,
    /// The GPU count the node's labels state (Kubernetes mode).
    label: watch::Receiver<GpuCountLabel>,
}

impl Component for Nvml {
    const NAME: &'static str = "nvml";

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        let source = run(self.library, cx.policy.clone(), self.label, cx.source());
        Ok(Handle::watched(Self::NAME, &[DETECTOR_NVML], cx, source))
    }
}

enum Msg {
    Identity(Identity),
    Count(Reading<u32>),
    Readings(Box<DeviceReadings>),
    Event(NvmlEvent),
    /// A thread died: why.
    Died(String),
}

async fn detector(ctx: &SourceContext, state: DetectorState, reason: Option<String>) -> bool {
    let obs = super::detector(DETECTOR_NVML, state, reason);
    ctx.tx.send(Input::Obs(obs)).await.is_ok()
}

/// How long the GPU count waits for a policy file still loading at start; past it the policy in
/// force (the built-in one) is used, so a hung file cannot stop GPU_MISSING for good.
const LOADING_WAIT: Duration = Duration::from_secs(60);

/// The expected GPU count: the policy's `expected_gpus` when set, else the node label's; 0 for
/// no expectation. `None` while it cannot be known yet: the policy file is still loading (the
/// built-in policy in force meanwhile sets none; for at most [`LOADING_WAIT`]: `waited` says it
/// is over), or the policy leaves it to a node label not read yet. Judging then would end a
/// GPU_MISSING restored from state, and raise and count it again once the expectation arrives.
fn expected(policy: &LoadedPolicy, label: GpuCountLabel, waited: bool) -> Option<u32> {
    if policy.status.loading.is_some() && !waited {
        return None;
    }
    match (policy.policy.expected_gpus, label) {
        (0, GpuCountLabel::Unread) => None,
        (0, GpuCountLabel::Read(n)) => Some(n.unwrap_or(0)),
        (n, _) => Some(n),
    }
}

/// Opens NVML and runs the source until shutdown. `label_count` is the GPU count the node's
/// labels state (Kubernetes mode; always `None` standalone).
pub(crate) async fn run(
    library: Option<PathBuf>,
    policy: watch::Receiver<LoadedPolicy>,
    label_count: watch::Receiver<GpuCountLabel>,
    ctx: SourceContext,
) {
    let mut retry = crate::backoff::Backoff::new(Duration::from_secs(60), Duration::from_secs(600));
    loop {
        let timeout = policy.borrow().policy.nvml.call_timeout;
        let lib = library.clone();
        let opened = tokio::time::timeout(
            timeout,
            tokio::task::spawn_blocking(move || real::open(lib.as_deref())),
        )
        .await;
        let reason = match opened {
            Ok(Ok(Ok(nvml))) => {
                info!(driver = ?nvml.driver_version(), "NVML opened");
                run_with(Arc::new(nvml), policy, label_count, ctx).await;
                return;
            }
            Ok(Ok(Err(real::OpenError::Absent(why)))) => {
                info!(reason = %why, "no NVML on this node; the NVML source is idle");
                detector(&ctx, DetectorState::Idle, Some(why)).await;
                return;
            }
            Ok(Ok(Err(real::OpenError::Broken(why)))) => why,
            Ok(Err(e)) => format!("NVML init panicked: {e}"),
            Err(_) => format!(
                "NVML init did not return within {}",
                humantime::format_duration(timeout)
            ),
        };
        warn!(reason = %reason, "NVML is present but not working; retrying");
        if !detector(&ctx, DetectorState::Down, Some(reason)).await {
            return;
        }
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tokio::time::sleep(retry.next_delay()) => {}
        }
    }
}

/// Whether a GPU thread has read its GPU's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdentityRead {
    Unread,
    /// Tried and failed (logged once); tried again every poll.
    Failed,
    Read,
}

/// The NVML detector's state as the loop last reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Health {
    Running,
    /// A call has not returned within the policy's `call_timeout`.
    Hung,
    /// A thread died: the detector stays down (nothing watches its GPU any more).
    Dead,
}

/// Starts a source thread running `f` with its own sender to the source's loop and its own
/// context; its death (a panic) is reported to the loop.
fn spawn_thread(
    name: String,
    ctx: &SourceContext,
    tx: &mpsc::Sender<Msg>,
    f: impl FnOnce(mpsc::Sender<Msg>, SourceContext) + Send + 'static,
) {
    let died = tx.clone();
    let on_death = move |why: String| {
        let _ = died.blocking_send(Msg::Died(why));
    };
    let (tx, own) = (tx.clone(), ctx.clone());
    let body = move || f(tx, own);
    if let Err(e) = super::spawn_watched(&name, ctx.shutdown.clone(), body, on_death) {
        warn!(thread = %name, error = %e, "cannot start an NVML thread");
    }
}

/// Sleeps `total` in short steps, returning early at shutdown.
fn nap(total: Duration, ctx: &SourceContext) {
    let clock = ctx.clock.clone();
    let until = clock.since_boot() + total;
    while !ctx.shutdown.is_cancelled() {
        let left = until.saturating_sub(clock.since_boot());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(200)));
    }
}

/// Runs the source over an opened backend until shutdown.
pub(crate) async fn run_with(
    backend: Arc<dyn NvmlBackend>,
    mut policy: watch::Receiver<LoadedPolicy>,
    mut label_count: watch::Receiver<GpuCountLabel>,
    ctx: SourceContext,
) {
    let interval_ms = Arc::new(AtomicU64::new(
        policy.borrow().policy.nvml.poll_interval.as_millis() as u64,
    ));
    let (tx, mut rx) = mpsc::channel::<Msg>(256);

    // The device count, once now (it decides how many GPU threads run) and then every interval.
    let clock = ctx.clock.clone();
    let inventory_calls = Arc::new(CallTracker::new(clock.clone()));
    let count = {
        let (b, c) = (backend.clone(), inventory_calls.clone());
        let t = policy.borrow().policy.nvml.call_timeout;
        match tokio::time::timeout(t, tokio::task::spawn_blocking(move || b.device_count(&c))).await
        {
            Ok(Ok(Ok(n))) => n,
            other => {
                let why = match other {
                    Ok(Ok(Err(e))) => format!("nvmlDeviceGetCount failed: {e:?}"),
                    _ => "nvmlDeviceGetCount did not return".to_string(),
                };
                warn!(reason = %why, "NVML cannot count GPUs");
                detector(&ctx, DetectorState::Down, Some(why)).await;
                0
            }
        }
    };
    info!(gpus = count, "NVML source running");
    if !detector(&ctx, DetectorState::Running, None).await {
        return;
    }
    let _ = tx.send(Msg::Count(Ok(count))).await;

    let (b, c, iv) = (
        backend.clone(),
        inventory_calls.clone(),
        interval_ms.clone(),
    );
    spawn_thread("nvml-count".into(), &ctx, &tx, move |tx, ctx| loop {
        nap(Duration::from_millis(iv.load(Ordering::Relaxed)), &ctx);
        if ctx.shutdown.is_cancelled() || tx.blocking_send(Msg::Count(b.device_count(&c))).is_err()
        {
            return;
        }
    });
    let mut trackers: Vec<(u32, Arc<CallTracker>)> = vec![(u32::MAX, inventory_calls)];
    for i in 0..count {
        let calls = Arc::new(CallTracker::new(clock.clone()));
        trackers.push((i, calls.clone()));
        let (b, iv) = (backend.clone(), interval_ms.clone());
        spawn_thread(format!("nvml-gpu{i}"), &ctx, &tx, move |tx, ctx| {
            // Read again every poll until it succeeds: a GPU lost at start has no identity yet,
            // and its faults are keyed by PCI address once it is known. The first failure is
            // logged.
            let mut identity = IdentityRead::Unread;
            while !ctx.shutdown.is_cancelled() {
                if identity != IdentityRead::Read {
                    match b.identity(i, &calls) {
                        Ok(id) => {
                            identity = IdentityRead::Read;
                            if tx.blocking_send(Msg::Identity(id)).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            if identity == IdentityRead::Unread {
                                warn!(gpu = i, error = ?e, "cannot read the GPU's identity; trying again every poll");
                            }
                            identity = IdentityRead::Failed;
                        }
                    }
                }
                let r = b.read(i, &calls);
                if tx.blocking_send(Msg::Readings(Box::new(r))).is_err() {
                    return;
                }
                nap(Duration::from_millis(iv.load(Ordering::Relaxed)), &ctx);
            }
        });
    }
    let b = backend.clone();
    spawn_thread("nvml-events".into(), &ctx, &tx, move |tx, ctx| {
        let mut backoff =
            crate::backoff::Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        while !ctx.shutdown.is_cancelled() {
            let mut events = match b.events() {
                Ok(e) => e,
                Err(e) => {
                    info!(error = ?e, "NVML events unavailable; polling only");
                    nap(Duration::from_secs(300), &ctx);
                    continue;
                }
            };
            while !ctx.shutdown.is_cancelled() {
                match events.wait(1000) {
                    Ok(Some(ev)) => {
                        if tx.blocking_send(Msg::Event(ev)).is_err() {
                            return;
                        }
                        backoff.reset();
                    }
                    Ok(None) => {}
                    Err(e) => {
                        // A lost GPU shows in its polling thread; here only back off.
                        warn!(error = ?e, "waiting for NVML events failed");
                        nap(backoff.next_delay(), &ctx);
                        break;
                    }
                }
            }
        }
    });
    drop(tx);

    let mut analyzer = Analyzer::default();
    let started = clock.instant();
    let waited = || clock.instant().saturating_duration_since(started) >= LOADING_WAIT;
    let mut last_count: Option<u32> = None;
    let mut health = Health::Running;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let out = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            Ok(()) = policy.changed() => {
                let loaded = policy.borrow_and_update().clone();
                interval_ms.store(loaded.policy.nvml.poll_interval.as_millis() as u64, Ordering::Relaxed);
                let want = expected(&loaded, *label_count.borrow(), waited());
                last_count.map(|n| analyzer.inventory(n, want)).unwrap_or_default()
            }
            Ok(()) = label_count.changed() => {
                let label = *label_count.borrow_and_update();
                info!(count = ?label, "expected GPU count from the node label");
                let want = expected(&policy.borrow(), label, waited());
                last_count.map(|n| analyzer.inventory(n, want)).unwrap_or_default()
            }
            msg = rx.recv() => {
                let Some(msg) = msg else { return };
                let loaded = policy.borrow().clone();
                match msg {
                    Msg::Identity(id) => analyzer.identity(id),
                    Msg::Count(Ok(n)) => {
                        last_count = Some(n);
                        analyzer.inventory(n, expected(&loaded, *label_count.borrow(), waited()))
                    }
                    Msg::Count(Err(e)) => {
                        warn!(error = ?e, "nvmlDeviceGetCount failed");
                        Vec::new()
                    }
                    Msg::Readings(r) => analyzer.readings(&loaded.policy.nvml, &r, clock.instant().into_std()),
                    Msg::Event(ev) => analyzer.event(&ev),
                    Msg::Died(why) => {
                        if health != Health::Dead {
                            health = Health::Dead;
                            if !detector(&ctx, DetectorState::Down, Some(why)).await {
                                return;
                            }
                        }
                        Vec::new()
                    }
                }
            }
            _ = tick.tick() => {
                if health == Health::Dead {
                    continue;
                }
                let limit = policy.borrow().policy.nvml.call_timeout;
                let now = clock.instant();
                let stuck = trackers.iter().find_map(|(i, t)| t.stuck(limit, now).map(|(name, d)| (*i, name, d)));
                match (stuck, health) {
                    (Some((i, name, d)), Health::Running) => {
                        health = Health::Hung;
                        let on = if i == u32::MAX { String::new() } else { format!(" on GPU {i}") };
                        let why = format!("{name}{on} has not returned for {} s", d.as_secs());
                        warn!(reason = %why, "NVML call hung");
                        if !detector(&ctx, DetectorState::Down, Some(why)).await {
                            return;
                        }
                    }
                    (None, Health::Hung) => {
                        health = Health::Running;
                        info!("NVML calls return again");
                        if !detector(&ctx, DetectorState::Running, None).await {
                            return;
                        }
                    }
                    _ => {}
                }
                continue;
            }
        };
        for o in out {
            if ctx.tx.send(Input::Obs(o)).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::readings::{CallError, EventWaiter};
    use super::*;
    use crate::metrics::Metrics;
    use faultline_core::engine::Observation;
    use tokio_util::sync::CancellationToken;

    /// `count` GPUs whose readings are all unsupported (never a fault); reading GPU
    /// `panics_on` panics (a bug in a reading, not an NVML error).
    struct Fake {
        count: u32,
        panics_on: Option<u32>,
    }

    impl NvmlBackend for Fake {
        fn device_count(&self, _: &CallTracker) -> Reading<u32> {
            Ok(self.count)
        }
        fn identity(&self, index: u32, _: &CallTracker) -> Reading<Identity> {
            Ok(Identity {
                index,
                ..Default::default()
            })
        }
        fn read(&self, index: u32, _: &CallTracker) -> DeviceReadings {
            assert!(
                self.panics_on != Some(index),
                "reading GPU {index} went wrong"
            );
            DeviceReadings::all_failed(index, CallError::NotSupported)
        }
        fn events(&self) -> Reading<Box<dyn EventWaiter>> {
            Err(CallError::NotSupported)
        }
    }

    fn detectors(rx: &mut mpsc::Receiver<Input>) -> Vec<(DetectorState, Option<String>)> {
        let mut out = Vec::new();
        while let Ok(i) = rx.try_recv() {
            if let Input::Obs(Observation::Detector { state, reason, .. }) = i {
                out.push((state, reason));
            }
        }
        out
    }

    /// The expectation table: the policy's count wins; a loading policy is waited for only
    /// until [`LOADING_WAIT`] is over (a hung file must not stop GPU_MISSING for good).
    #[test]
    fn the_expected_count_table() {
        let mut p = LoadedPolicy::builtin();
        let read = |n| GpuCountLabel::Read(n);
        assert_eq!(expected(&p, GpuCountLabel::Unread, false), None);
        assert_eq!(expected(&p, read(None), false), Some(0));
        assert_eq!(expected(&p, read(Some(8)), false), Some(8));
        p.status.loading = Some("/etc/faultline/policy.yaml".into());
        assert_eq!(expected(&p, read(Some(8)), false), None, "loading");
        assert_eq!(
            expected(&p, read(Some(8)), true),
            Some(8),
            "waited long enough"
        );
        p.status.loading = None;
        let mut explicit = (*p.policy).clone();
        explicit.expected_gpus = 4;
        p.policy = Arc::new(explicit);
        assert_eq!(expected(&p, GpuCountLabel::Unread, false), Some(4));
    }

    /// The GPU_MISSING levels sent so far: for each, whether the fault is present.
    fn missing_levels(rx: &mut mpsc::Receiver<Input>) -> Vec<bool> {
        let mut out = Vec::new();
        while let Ok(i) = rx.try_recv() {
            if let Input::Obs(Observation::Level {
                domain, present, ..
            }) = i
            {
                if Some(domain.as_str()) == faultline_core::catalog::nvml::domain("GPU_MISSING") {
                    out.push(!present.is_empty());
                }
            }
        }
        out
    }

    /// Right after a start the expected GPU count can be unknown: the node label not read yet,
    /// or the policy file still loading. Nothing is judged then (a level saying "nothing
    /// missing" would end a GPU_MISSING restored from state, and its return would be counted
    /// again); once the label is read, 7 of 8 is judged missing; a policy still loading
    /// judges nothing even with the label read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_gpu_count_is_judged_only_once_the_expectation_is_known() {
        let (tx, mut rx) = mpsc::channel(4096);
        let ctx = SourceContext {
            tx,
            metrics: Arc::new(Metrics::default()),
            clock: std::sync::Arc::new(crate::clock::SystemClock),
            shutdown: CancellationToken::new(),
        };
        let mut loaded = LoadedPolicy::builtin();
        let mut p = (*loaded.policy).clone();
        p.nvml.poll_interval = Duration::from_millis(50);
        loaded.policy = Arc::new(p);
        let (ptx, prx) = watch::channel(loaded.clone());
        let (ltx, lrx) = watch::channel(GpuCountLabel::Unread);
        let task = tokio::spawn(run_with(
            Arc::new(Fake {
                count: 7,
                panics_on: None,
            }),
            prx,
            lrx,
            ctx.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(
            missing_levels(&mut rx),
            Vec::<bool>::new(),
            "judged before the label was read"
        );

        ltx.send_replace(GpuCountLabel::Read(Some(8)));
        tokio::time::sleep(Duration::from_millis(600)).await;
        let seen = missing_levels(&mut rx);
        assert!(!seen.is_empty() && seen.iter().all(|m| *m), "{seen:?}");

        let mut loading = loaded.clone();
        loading.status.loading = Some("/etc/faultline/policy.yaml".into());
        ptx.send_replace(loading);
        tokio::time::sleep(Duration::from_millis(100)).await;
        missing_levels(&mut rx);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            missing_levels(&mut rx),
            Vec::<bool>::new(),
            "judged while the policy was loading"
        );
        ptx.send_replace(loaded);
        tokio::time::sleep(Duration::from_millis(600)).await;
        let seen = missing_levels(&mut rx);
        assert!(!seen.is_empty() && seen.iter().all(|m| *m), "{seen:?}");
        ctx.shutdown.cancel();
        let _ = task.await;
    }

    /// A GPU thread that dies marks the detector Down with the reason, and it stays Down (the
    /// hung-call watchdog does not report Running while a thread is gone); the other GPU is
    /// still polled.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_gpu_thread_marks_the_detector_down() {
        let (tx, mut rx) = mpsc::channel(1024);
        let ctx = SourceContext {
            tx,
            metrics: Arc::new(Metrics::default()),
            clock: std::sync::Arc::new(crate::clock::SystemClock),
            shutdown: CancellationToken::new(),
        };
        let mut loaded = LoadedPolicy::builtin();
        let mut p = (*loaded.policy).clone();
        p.nvml.poll_interval = Duration::from_millis(50);
        loaded.policy = Arc::new(p);
        let (_ptx, prx) = watch::channel(loaded);
        let (_ltx, lrx) = watch::channel(GpuCountLabel::Read(None));
        let task = tokio::spawn(run_with(
            Arc::new(Fake {
                count: 2,
                panics_on: Some(1),
            }),
            prx,
            lrx,
            ctx.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let seen = detectors(&mut rx);
        let down: Vec<_> = seen
            .iter()
            .filter(|(s, _)| *s == DetectorState::Down)
            .collect();
        assert_eq!(down.len(), 1, "{seen:?}");
        let why = down[0].1.clone().unwrap_or_default();
        assert!(
            why.contains("nvml-gpu1 thread stopped") && why.contains("reading GPU 1 went wrong"),
            "{why}"
        );
        assert_eq!(
            seen.last().map(|(s, _)| *s),
            Some(DetectorState::Down),
            "stays down: {seen:?}"
        );
        ctx.shutdown.cancel();
        let _ = task.await;
    }
}
