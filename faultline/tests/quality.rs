//! Detection quality, measured: replays the incident timelines in tests/fixtures/incidents
//! through the agent's own kernel-log reader (`faultline_core::kmsg_reader::KmsgReader`, as the
//! kmsg source runs it on `/dev/kmsg`) and engine loop (`engine_loop::EngineLoop`, with the
//! built-in catalog and default policy), with time taken from the timeline, and scores each
//! node's verdict, handling level and taints against the timeline's ground truth.
//!
//! A restart in a timeline stops the engine loop, writes its last snapshot's state as the file
//! sink does (`state.json`), reads it back with the agent's `sink::file::read_state` and starts
//! a new loop and reader from it the way `daemon::restore` does (that function is private; the
//! steps are repeated here: `Engine::upgrade`, the same-boot check by boot id, the saved
//! cursor, the saved timeline). The new reader reads the kernel log again from its oldest
//! record, as the agent does on `/dev/kmsg`.
//!
//! The table it computes is docs/benchmarks.md's "Detection quality"; the test fails when a
//! figure there is better than what the code does now (so the docs cannot drift), and prints
//! the table with `cargo test -p faultline --test quality -- --nocapture`.

#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use faultline_agent::clock::Clock;
use faultline_agent::engine_loop::RecordStatus;
use faultline_agent::engine_loop::{EngineLoop, Heartbeat, PersistedState, SinkReport, Snapshot};
use faultline_agent::metrics::Metrics;
use faultline_agent::sink::file::{read_state, STATE_FILE};
use faultline_core::catalog::Catalog;
use faultline_core::engine::{Input, KmsgPosition, Observation};
use faultline_core::kmsg_reader::{KmsgReader, Tally};
use faultline_core::policy::LoadedPolicy;
use faultline_core::record::{Handling, Health};
use faultline_core::time::{Timeline, Timestamp};
use serde::Deserialize;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

// ---------------------------------------------------------------------------------------------
// Timelines (format: tests/fixtures/incidents/README.md)

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Incident {
    class: String,
    #[allow(dead_code)] // documentation in the file
    title: String,
    end: String,
    groups: Vec<Group>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Group {
    name: String,
    #[serde(default = "one")]
    nodes: u32,
    stagger: Option<String>,
    truth: Truth,
    events: Vec<Event>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Truth {
    /// The hardware fault the node has, or none.
    hardware: Option<String>,
    /// When its first line is printed (for a node without one: its application codes').
    from: Option<String>,
    verdict: Health,
    handling: Option<Handling>,
    /// On a node with a hardware fault: the level its application codes call for before the
    /// fault (from its first record).
    handling_before: Option<Handling>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Event {
    at: String,
    line: Option<String>,
    #[serde(default = "one")]
    repeat: u32,
    every: Option<String>,
    #[serde(default)]
    lost: bool,
    /// The agent stops here and starts again this much later.
    restart: Option<String>,
}

fn ms(s: &str) -> u64 {
    humantime::parse_duration(s)
        .unwrap_or_else(|e| panic!("duration {s:?}: {e}"))
        .as_millis() as u64
}

/// One node's timeline, expanded: records in print order (each with its sequence number) and
/// restarts, times in milliseconds from the node's start.
#[derive(Debug, Clone)]
struct NodeTimeline {
    class: String,
    name: String,
    end: u64,
    records: Vec<Rec>,
    restarts: Vec<(u64, u64)>,
    truth: Truth,
}

#[derive(Debug, Clone)]
struct Rec {
    t: u64,
    seq: u64,
    msg: String,
    lost: bool,
}

/// The first sequence number of a timeline: the boot's earlier records came before it.
const FIRST_SEQ: u64 = 1000;
/// The record every timeline starts with (the driver's load banner, not a fault).
const BANNER: &str =
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024";

fn load_incidents(dir: &Path) -> Vec<NodeTimeline> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut nodes = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let inc: Incident =
            serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for g in &inc.groups {
            let stagger = g.stagger.as_deref().map_or(0, ms);
            for i in 0..g.nodes {
                let shift = u64::from(i) * stagger;
                let mut recs = Vec::new();
                let mut restarts = Vec::new();
                for ev in &g.events {
                    let at = ms(&ev.at) + shift;
                    match (&ev.line, &ev.restart) {
                        (Some(line), None) => {
                            let every = ev.every.as_deref().map_or(0, ms);
                            for k in 0..u64::from(ev.repeat) {
                                recs.push(Rec {
                                    t: at + k * every,
                                    seq: 0,
                                    msg: line.clone(),
                                    lost: ev.lost,
                                });
                            }
                        }
                        (None, Some(down)) => restarts.push((at, ms(down))),
                        _ => panic!("{}: an event has a line or a restart", path.display()),
                    }
                }
                // Print order: by time, then as written (a stable sort). First, a record the
                // agent read before the timeline starts (it has been running since boot): a
                // loss at the very start is a gap after it, as on a node that runs.
                recs.sort_by_key(|r| r.t);
                recs.insert(
                    0,
                    Rec {
                        t: 0,
                        seq: 0,
                        msg: BANNER.into(),
                        lost: false,
                    },
                );
                for (k, r) in recs.iter_mut().enumerate() {
                    r.seq = FIRST_SEQ + k as u64;
                }
                restarts.sort();
                let mut truth = g.truth.clone();
                truth.from = truth.from.map(|f| format!("{}ms", ms(&f) + shift));
                nodes.push(NodeTimeline {
                    class: inc.class.clone(),
                    name: format!("{}-{}-{i}", inc.class, g.name),
                    end: ms(&inc.end),
                    records: recs,
                    restarts,
                    truth,
                });
            }
        }
    }
    nodes
}

// ---------------------------------------------------------------------------------------------
// The agent, driven on the timeline's time

/// Wall clock and boot clock, set by the harness: the boot started at `BOOT_WALL_MS`, and the
/// node's timeline starts `START_MS` into the boot.
#[derive(Debug)]
struct TimelineClock {
    boot_ms: AtomicU64,
}

const BOOT_WALL_MS: i64 = 1_790_000_000_000;
const START_MS: u64 = 600_000;
const BOOT_ID: &str = "b7a5c6f2-quality-harness";

impl Clock for TimelineClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millisecond(BOOT_WALL_MS + self.boot_ms.load(Ordering::SeqCst) as i64)
            .unwrap()
    }
    fn since_boot(&self) -> Duration {
        Duration::from_millis(self.boot_ms.load(Ordering::SeqCst))
    }
    fn boot_id(&self) -> Option<String> {
        Some(BOOT_ID.into())
    }
}

impl TimelineClock {
    fn set(&self, t: u64) {
        self.boot_ms.store(START_MS + t, Ordering::SeqCst);
    }
}

/// The built-in catalog, parsed once for every run.
fn catalog() -> Arc<Catalog> {
    static CATALOG: std::sync::OnceLock<Arc<Catalog>> = std::sync::OnceLock::new();
    CATALOG
        .get_or_init(|| Arc::new(Catalog::builtin().unwrap()))
        .clone()
}

/// A running engine loop.
struct Agent {
    tx: mpsc::Sender<Input>,
    snaps: watch::Receiver<Option<Snapshot>>,
    marker: u64,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Agent {
    /// Starts the loop on `restored` (default: a first start) with the kernel-log cursor
    /// `kmsg_cursor`, as the daemon does: the engine timeline of this boot, the boot id sent
    /// first.
    async fn start(
        node: &str,
        clock: &Arc<TimelineClock>,
        restored: PersistedState,
        kmsg_cursor: Option<KmsgPosition>,
    ) -> Agent {
        let (tx, inputs) = mpsc::channel(4096);
        let (snap_tx, snaps) = watch::channel(None);
        let shutdown = CancellationToken::new();
        let timeline = Timeline::for_boot(
            restored.timeline.as_ref(),
            Some(BOOT_ID),
            clock.now(),
            clock.since_boot(),
        );
        let engine_loop = EngineLoop {
            node: node.into(),
            engine: restored.engine,
            timeline,
            kmsg_cursor,
            boot_time: None,
            marker: 0,
            clears: restored.clears,
            clear_results: mpsc::unbounded_channel().0,
            catalog: catalog(),
            policy: watch::channel(LoadedPolicy::builtin()).1,
            inputs,
            snapshots: snap_tx,
            metrics: Arc::new(Metrics::new()),
            clock: clock.clone(),
            heartbeat: Arc::new(Heartbeat::default()),
            // The harness sends the ticks, at timeline times. The loop's own, at the engine's
            // deadlines, wait on this clock's real-time sleep: one comes only when a deadline is
            // already due at the clock's time, the same tick the harness sends. No beat.
            liveness: Duration::from_secs(365 * 24 * 3600),
            events: None,
            sink_report: watch::channel(SinkReport::default()).1,
            record_writer: watch::channel(RecordStatus::Written).1,
            shutdown: shutdown.clone(),
        };
        let task = tokio::spawn(engine_loop.run());
        let boot = Observation::Boot {
            boot_id: BOOT_ID.into(),
        };
        tx.send(Input::Obs(boot)).await.unwrap();
        Agent {
            tx,
            snaps,
            marker: 0,
            shutdown,
            task,
        }
    }

    /// Applies `inputs` and a tick at the clock's time; returns the snapshot that has them.
    async fn apply(&mut self, inputs: Vec<Input>) -> Snapshot {
        for i in inputs {
            self.tx.send(i).await.unwrap();
        }
        self.tx.send(Input::Obs(Observation::Tick)).await.unwrap();
        self.marker += 1;
        let m = self.marker;
        self.tx.send(Input::Marker(m)).await.unwrap();
        let snap = self
            .snaps
            .wait_for(|s| s.as_ref().is_some_and(|s| s.marker >= m))
            .await
            .unwrap();
        snap.clone().unwrap()
    }

    /// Stops the loop and returns the state its final snapshot carries (what the file sink
    /// writes at shutdown).
    async fn stop(self) -> PersistedState {
        self.shutdown.cancel();
        self.task.await.unwrap();
        let snap = self.snaps.borrow().clone().unwrap();
        (*snap.state).clone()
    }
}

/// What the node looked like after one step.
#[derive(Debug, Clone)]
struct Sample {
    t: u64,
    health: Health,
    handling: Option<Handling>,
    taints: Vec<String>,
}

/// One node's run: the samples, and its faults at the end as `(code, device, count, active)`.
#[derive(Debug)]
struct Run {
    samples: Vec<Sample>,
    faults: Vec<(String, String, u64, bool)>,
}

/// Repeats of records already seen on the node are applied in batches spanning at most this
/// much timeline time, at the time of the last record in the batch (the agent, too, applies what
/// it read in one go). A record the node has not printed before ends its batch, so what it
/// changes is seen at its own time and the time to detect is exact. (One step per record gives
/// the same table and takes four times as long.)
const BATCH_MS: u64 = 100;
/// The engine is ticked at least this often (timeline time), besides a tick at every batch: the
/// agent ticks every second, but between batches nothing but the recovery rules' quiet times
/// (10 minutes, 1 hour) can change, so they end up to this much later here.
const TICK_MS: u64 = 300_000;

async fn run_node(n: &NodeTimeline, with_restarts: bool) -> Run {
    let clock = Arc::new(TimelineClock {
        boot_ms: AtomicU64::new(0),
    });
    clock.set(0);
    let dir = tempfile::tempdir().unwrap();
    let boot_time = Timestamp::from_millisecond(BOOT_WALL_MS).unwrap();
    let restarts: Vec<(u64, u64)> = if with_restarts {
        n.restarts.clone()
    } else {
        Vec::new()
    };
    // Step times: the last record of each batch, every tick, and each restart's stop and start.
    let mut steps = std::collections::BTreeSet::new();
    let mut batch_start: Option<u64> = None;
    let mut seen = std::collections::HashSet::new();
    for (k, r) in n.records.iter().enumerate() {
        if r.lost {
            continue;
        }
        let start = *batch_start.get_or_insert(r.t);
        let first = seen.insert(r.msg.as_str());
        let next = n.records[k + 1..].iter().find(|x| !x.lost);
        if first || next.is_none_or(|x| x.t - start >= BATCH_MS) {
            steps.insert(r.t);
            batch_start = None;
        }
    }
    steps.extend((0..=n.end).step_by(TICK_MS as usize));
    for &(at, down) in &restarts {
        steps.insert(at);
        steps.insert(at + down);
    }
    let mut agent = Some(Agent::start(&n.name, &clock, PersistedState::default(), None).await);
    let mut reader = new_reader(None, boot_time);
    let mut read = 0; // records handed to the reader (an index into n.records)
    let mut samples = Vec::new();
    let mut last = None;
    for t in steps.into_iter().filter(|t| *t <= n.end) {
        let down = restarts.iter().find(|(at, d)| t > *at && t < at + d);
        if down.is_some() {
            continue; // not running: the records wait in the ring buffer
        }
        if agent.is_none() {
            // Started again: restore what the last run saved and read the log from its start.
            let state = read_state(dir.path(), &n.name).unwrap().unwrap();
            let same_boot = state.engine.boot_id() == Some(BOOT_ID);
            let resume = state.kmsg_position().filter(|_| same_boot);
            clock.set(t);
            agent = Some(Agent::start(&n.name, &clock, state, resume).await);
            reader = new_reader(resume, boot_time);
            read = 0;
        }
        clock.set(t);
        let mut inputs = Vec::new();
        while read < n.records.len() && n.records[read].t <= t {
            let r = &n.records[read];
            if !r.lost {
                let usec = (START_MS + r.t) * 1000;
                let raw = format!("4,{},{usec},-;{}", r.seq, r.msg);
                reader.feed(raw.as_bytes(), &mut inputs);
            }
            read += 1;
        }
        reader.flush_cursor(&mut inputs);
        let a = agent.as_mut().unwrap();
        let snap = a.apply(inputs).await;
        samples.push(Sample {
            t,
            health: snap.record.health,
            handling: snap.record.handling,
            taints: snap
                .taints
                .iter()
                .map(|t| format!("{}={}:{}", t.key, t.value, t.effect.as_str()))
                .collect(),
        });
        last = Some(snap);
        if restarts.iter().any(|(at, _)| *at == t) {
            // Stopped: the final snapshot's state is written as the file sink writes it.
            let state = agent.take().unwrap().stop().await;
            let bytes = serde_json::to_vec(&state).unwrap();
            std::fs::write(dir.path().join(STATE_FILE), bytes).unwrap();
        }
    }
    if let Some(a) = agent {
        a.stop().await;
    }
    let faults = last
        .map(|s| {
            let mut f: Vec<_> = s
                .record
                .faults
                .iter()
                .map(|f| (f.fault_code.clone(), f.device.clone(), f.count, f.active))
                .collect();
            f.sort();
            f
        })
        .unwrap_or_default();
    Run { samples, faults }
}

fn new_reader(resume: Option<KmsgPosition>, boot_time: Timestamp) -> KmsgReader {
    // Device mode (`/dev/kmsg`): records are dated from their kernel timestamps.
    KmsgReader::new(resume, Some(boot_time), true, Arc::new(Tally::default()))
}

// ---------------------------------------------------------------------------------------------
// Scoring

/// One node's outcome for one judgement (verdict or handling level).
#[derive(Debug, Default, Clone, Copy)]
struct Outcome {
    /// The truth calls for action (a verdict worse than Healthy; a level above SubHealthFault).
    positive: bool,
    /// Reached the truth at or after `from` (and, for a hardware fault, still there at the end).
    detected: bool,
    /// At some time worse than the truth at that time.
    flagged_wrong: bool,
    /// When it was first reached (ms after `from`).
    ttd: Option<u64>,
}

/// `before` is the truth before `from`, `truth` from then on.
fn score<L: Ord + Copy>(
    samples: &[Sample],
    get: impl Fn(&Sample) -> L,
    before: L,
    truth: L,
    from: u64,
    hardware: bool,
    actionable: impl Fn(L) -> bool,
) -> Outcome {
    let truth_at = |t: u64| if t >= from { truth } else { before };
    let mut o = Outcome {
        positive: actionable(truth),
        ..Outcome::default()
    };
    for s in samples {
        let got = get(s);
        if actionable(got) && got > truth_at(s.t) {
            o.flagged_wrong = true;
        }
        if o.ttd.is_none() && s.t >= from && got >= truth && o.positive {
            o.ttd = Some(s.t - from);
        }
    }
    let held = !hardware || samples.last().is_some_and(|s| get(s) >= truth);
    o.detected = o.positive && o.ttd.is_some() && held;
    o
}

#[derive(Debug, Default)]
struct Row {
    nodes: u32,
    hardware: u32,
    verdict: Counts,
    handling: Counts,
    ttd: Vec<u64>,
    /// Nodes with no hardware fault that carried a taint at some time, and which taints.
    tainted: u32,
    no_hardware: u32,
    taints: BTreeMap<String, u32>,
    /// What went wrong, node by node (printed with the table).
    findings: Vec<String>,
}

#[derive(Debug, Default)]
struct Counts {
    tp: u32,
    positives: u32,
    flagged_wrong: u32,
}

impl Counts {
    fn add(&mut self, o: Outcome) {
        self.tp += u32::from(o.detected);
        self.positives += u32::from(o.positive);
        self.flagged_wrong += u32::from(o.flagged_wrong);
    }
    /// Nodes detected over nodes flagged (detected ones plus wrongly flagged ones; a node
    /// flagged wrongly before its fault and detected later counts in both).
    fn precision(&self) -> Option<f64> {
        let flagged = self.tp + self.flagged_wrong;
        (flagged > 0).then(|| f64::from(self.tp) / f64::from(flagged))
    }
    fn recall(&self) -> Option<f64> {
        (self.positives > 0).then(|| f64::from(self.tp) / f64::from(self.positives))
    }
}

fn judge(row: &mut Row, n: &NodeTimeline, run: &Run) {
    let hardware = n.truth.hardware.is_some();
    let from = n.truth.from.as_deref().map_or(0, ms);
    row.nodes += 1;
    row.hardware += u32::from(hardware);
    // A node without a hardware fault is rightly Healthy throughout.
    let verdict_truth = if hardware {
        n.truth.verdict
    } else {
        Health::Healthy
    };
    let v = score(
        &run.samples,
        |s| s.health,
        Health::Healthy,
        verdict_truth,
        from,
        hardware,
        |h| h != Health::Healthy,
    );
    let h = score(
        &run.samples,
        |s| s.handling,
        n.truth.handling_before,
        n.truth.handling,
        from,
        hardware,
        |l| l.is_some_and(|l| l > Handling::SubHealthFault),
    );
    row.verdict.add(v);
    row.handling.add(h);
    let end = run.samples.last();
    for (what, o) in [("verdict", v), ("handling", h)] {
        let missed = o.positive && !o.detected;
        if missed || o.flagged_wrong {
            row.findings.push(format!(
                "{}: {what} {} (truth: {:?} {:?} from {from} ms; at the end: {:?} {:?})",
                n.name,
                match (missed, o.flagged_wrong) {
                    (true, true) => "missed, and flagged above the truth",
                    (true, false) => "missed",
                    _ => "flagged above the truth",
                },
                n.truth.verdict,
                n.truth.handling,
                end.map(|s| s.health),
                end.and_then(|s| s.handling),
            ));
        }
    }
    if v.detected {
        row.ttd.extend(v.ttd);
    }
    if !hardware {
        row.no_hardware += 1;
        let mut seen: Vec<&String> = run.samples.iter().flat_map(|s| &s.taints).collect();
        seen.sort();
        seen.dedup();
        row.tainted += u32::from(!seen.is_empty());
        for t in seen {
            *row.taints.entry(t.clone()).or_default() += 1;
        }
    }
}

fn fmt_ratio(x: Option<f64>, num: u32, den: u32) -> String {
    match x {
        Some(x) => format!("{x:.2} ({num}/{den})"),
        None => "n/a".into(),
    }
}

/// The table's rows, in the order classes first appear, then `all`.
fn table(rows: &[(String, Row)]) -> Vec<[String; 9]> {
    rows.iter()
        .map(|(class, r)| {
            let mut ttd = r.ttd.clone();
            ttd.sort();
            let p50 = ttd.get(ttd.len().saturating_sub(1) / 2);
            let max = ttd.last();
            let ms = |x: Option<&u64>| x.map_or("n/a".into(), |v| v.to_string());
            [
                class.clone(),
                r.nodes.to_string(),
                r.hardware.to_string(),
                fmt_ratio(
                    r.verdict.precision(),
                    r.verdict.tp,
                    r.verdict.tp + r.verdict.flagged_wrong,
                ),
                fmt_ratio(r.verdict.recall(), r.verdict.tp, r.verdict.positives),
                fmt_ratio(
                    r.handling.precision(),
                    r.handling.tp,
                    r.handling.tp + r.handling.flagged_wrong,
                ),
                fmt_ratio(r.handling.recall(), r.handling.tp, r.handling.positives),
                format!("{} / {}", ms(p50), ms(max)),
                format!("{} of {}", r.tainted, r.no_hardware),
            ]
        })
        .collect()
}

const HEADER: [&str; 9] = [
    "class",
    "nodes",
    "with a hardware fault",
    "verdict precision",
    "verdict recall",
    "handling precision",
    "handling recall",
    "time to detect, p50 / max (ms)",
    "nodes without a hardware fault tainted",
];

fn markdown(rows: &[[String; 9]]) -> String {
    let mut s = format!("| {} |\n", HEADER.join(" | "));
    s += &format!("|{}\n", "---|".repeat(HEADER.len()));
    for r in rows {
        s += &format!("| {} |\n", r.join(" | "));
    }
    s
}

// ---------------------------------------------------------------------------------------------
// The documented table

const BEGIN: &str = "<!-- detection-quality:begin -->";
const END: &str = "<!-- detection-quality:end -->";

fn documented() -> Vec<Vec<String>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let start = text
        .find(BEGIN)
        .expect("docs/benchmarks.md: no detection-quality table");
    let stop = text[start..].find(END).expect("table not closed") + start;
    text[start + BEGIN.len()..stop]
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.contains("precision"))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

/// The leading number of a cell (`0.93 (13/14)`, `0 of 92`, `120 / 2000`), or `None` for n/a.
fn lead(cell: &str) -> Option<f64> {
    let first = cell.split_whitespace().next()?;
    if first == "n/a" {
        return None;
    }
    Some(
        first
            .parse()
            .unwrap_or_else(|e| panic!("cell {cell:?}: {e}")),
    )
}

/// The nodes flagged wrongly in a precision cell, `0.65 (11/17)`: 17 - 11.
fn wrong(cell: &str) -> Option<u32> {
    let (tp, flagged) = cell
        .split_once('(')?
        .1
        .trim_end_matches(')')
        .split_once('/')?;
    Some(flagged.trim().parse::<u32>().ok()? - tp.trim().parse::<u32>().ok()?)
}

/// The `k`-th ` / `-separated part of a time-to-detect cell.
fn part(cell: &str, k: usize) -> String {
    cell.split(" / ").nth(k).unwrap_or("n/a").trim().to_string()
}

/// Every way the computed table is worse than the documented one (or differs in shape).
fn regressions(computed: &[[String; 9]], docs: &[Vec<String>]) -> Vec<String> {
    let mut bad = Vec::new();
    if docs.len() != computed.len() {
        bad.push(format!(
            "the documented table has {} rows, the harness {}",
            docs.len(),
            computed.len()
        ));
    }
    for d in docs {
        let Some(c) = computed.iter().find(|c| c[0] == d[0]) else {
            bad.push(format!("documented class {:?} not in the timelines", d[0]));
            continue;
        };
        if d.len() != HEADER.len() {
            bad.push(format!("row {:?}: {} cells", d[0], d.len()));
            continue;
        }
        for k in [1, 2] {
            if c[k] != d[k] {
                bad.push(format!(
                    "{} {}: documented {}, now {}",
                    d[0], HEADER[k], d[k], c[k]
                ));
            }
        }
        // Higher is better: precision and recall.
        for k in 3..=6 {
            match (lead(&d[k]), lead(&c[k])) {
                (Some(doc), Some(now)) if now + 1e-9 < doc => bad.push(format!(
                    "{} {}: documented {}, now {}",
                    d[0], HEADER[k], d[k], c[k]
                )),
                (Some(_), Some(_)) | (None, None) => {}
                _ => bad.push(format!(
                    "{} {}: documented {}, now {}",
                    d[0], HEADER[k], d[k], c[k]
                )),
            }
        }
        // A precision already at 0 cannot fall: the nodes flagged wrongly must not grow either.
        for k in [3, 5] {
            if let (Some(doc), Some(now)) = (wrong(&d[k]), wrong(&c[k])) {
                if now > doc {
                    bad.push(format!(
                        "{} {}: {doc} nodes flagged wrongly documented, now {now}",
                        d[0], HEADER[k]
                    ));
                }
            }
        }
        // Lower is better: time to detect (p50, max) and tainted nodes.
        let lower = [
            (part(&d[7], 0), part(&c[7], 0), "time to detect p50"),
            (part(&d[7], 1), part(&c[7], 1), "time to detect max"),
            (d[8].clone(), c[8].clone(), HEADER[8]),
        ];
        for (doc, now, what) in lower {
            match (lead(&doc), lead(&now)) {
                (Some(x), Some(y)) if y > x + 1e-9 => {
                    bad.push(format!("{} {what}: documented {doc}, now {now}", d[0]))
                }
                (Some(_), Some(_)) | (None, None) => {}
                _ => bad.push(format!("{} {what}: documented {doc}, now {now}", d[0])),
            }
        }
    }
    bad
}

// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn detection_quality_is_at_least_the_documented_table() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/incidents");
    let nodes = load_incidents(&dir);
    assert!(nodes.len() >= 100, "{} nodes", nodes.len());
    let mut rows: Vec<(String, Row)> = Vec::new();
    let mut all = Row::default();
    let mut recounted = Vec::new();
    let mut lines = 0;
    for n in &nodes {
        lines += n.records.len();
        let run = run_node(n, true).await;
        if !n.restarts.is_empty() {
            // No record counted twice, none lost: the same faults and counts as without the
            // restarts.
            let control = run_node(n, false).await;
            if control.faults != run.faults {
                recounted.push(format!(
                    "{}: with restarts {:?}\n  without {:?}",
                    n.name, run.faults, control.faults
                ));
            }
        }
        let i = match rows.iter().position(|(c, _)| *c == n.class) {
            Some(i) => i,
            None => {
                rows.push((n.class.clone(), Row::default()));
                rows.len() - 1
            }
        };
        judge(&mut rows[i].1, n, &run);
        judge(&mut all, n, &run);
    }
    rows.push(("all".into(), all));
    let computed = table(&rows);
    println!(
        "detection quality: {} nodes, {lines} kernel-log records\n\n{}",
        nodes.len(),
        markdown(&computed)
    );
    for (class, r) in &rows {
        if class != "all" {
            for f in &r.findings {
                println!("{f}");
            }
        }
        if !r.taints.is_empty() {
            println!(
                "taints on nodes without a hardware fault ({class}): {:?}",
                r.taints
            );
        }
    }
    assert!(
        recounted.is_empty(),
        "a restart changed what was counted:\n{}",
        recounted.join("\n")
    );
    let bad = regressions(&computed, &documented());
    assert!(
        bad.is_empty(),
        "detection quality is below docs/benchmarks.md's table (or the table is out of date: \
         paste the table printed above):\n{}",
        bad.join("\n")
    );
}

/// The comparison with the documented table, on made-up rows: equal passes; a documented
/// figure better than the computed one in any column fails, as does an n/a that became a number.
#[test]
fn a_documented_figure_better_than_the_code_fails() {
    let row = |cells: [&str; 9]| cells.map(String::from);
    let now = [row([
        "app",
        "10",
        "2",
        "0.50 (1/2)",
        "0.50 (1/2)",
        "n/a",
        "1.00 (2/2)",
        "5 / 4000",
        "1 of 8",
    ])];
    let docs = |k: usize, cell: &str| {
        let mut d: Vec<String> = now[0].to_vec();
        d[k] = cell.into();
        vec![d]
    };
    assert!(regressions(&now, &docs(0, "app")).is_empty());
    for (k, cell) in [
        (1, "11"),
        (3, "0.60 (1/2)"),
        (3, "0.50 (0/0)"),
        (4, "0.75 (3/4)"),
        (5, "0.10 (1/10)"),
        (6, "n/a"),
        (7, "4 / 4000"),
        (7, "5 / 3999"),
        (8, "0 of 8"),
    ] {
        assert!(
            !regressions(&now, &docs(k, cell)).is_empty(),
            "documented {cell:?} in column {k} passed"
        );
    }
    // Better now than documented: passes.
    assert!(regressions(&now, &docs(4, "0.25 (1/4)")).is_empty());
    assert!(regressions(&now, &docs(7, "9 / 5000")).is_empty());
}
