//! The fault ConfigMap sink's pure decisions: the record as it goes into the ConfigMap (cut to
//! fit), its labels, the keys records are compared by, and when a change is written. No I/O;
//! every function here is table-tested below.

use std::collections::BTreeMap;

use faultline_core::record::{check_code, Health, NodeRecord};
use faultline_core::time::Timestamp;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::rate_limit::WriteBudget;

/// A Kubernetes label value for `s`: itself when valid, else a shortened form with a hash.
pub(crate) fn label_value(s: &str) -> String {
    let valid = s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric());
    if valid {
        return s.to_string();
    }
    let clean: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .take(50)
        .collect();
    let clean = clean.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    let hash = hex::encode(&Sha256::digest(s.as_bytes())[..4]);
    if clean.is_empty() {
        hash
    } else {
        format!("{clean}-{hash}")
    }
}

/// Selects the fault ConfigMaps, one per agent (`faultline cluster`).
pub(crate) const RECORDS_SELECTOR: &str = "app.kubernetes.io/name=faultline,faultline.io/node";

/// The labels of the fault ConfigMap (docs/kubernetes.md, "What the agent publishes").
pub(crate) fn configmap_labels(node: &str, health: Health) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_string(),
            "faultline".to_string(),
        ),
        ("faultline.io/node".to_string(), label_value(node)),
        ("faultline.io/health".to_string(), health.to_string()),
    ])
}

/// The most a ConfigMap may hold: 1 MiB over all keys and values.
pub(crate) const CONFIGMAP_LIMIT: usize = 1024 * 1024;
/// The data key of the fault ConfigMap.
pub(crate) const RECORD_KEY: &str = "faults.json";

/// The record as it goes into the ConfigMap: at most `limit` bytes of JSON. When it is larger,
/// the oldest recovered faults go first, then the least severe active ones (the record is
/// sorted that way: active most severe first, then recovered newest first), `droppedFaults`
/// grows by as many, and `checkCode` is computed over what is left.
pub(crate) fn fit_record(
    record: &NodeRecord,
    limit: usize,
) -> Result<(String, NodeRecord), serde_json::Error> {
    let full = serde_json::to_string_pretty(record)?;
    if full.len() <= limit {
        return Ok((full, record.clone()));
    }
    let mut r = record.clone();
    let sizes: Vec<usize> = r
        .faults
        .iter()
        .map(|f| serde_json::to_string_pretty(f).map(|s| s.len() + 8))
        .collect::<Result<_, _>>()?;
    let mut excess = full.len() - limit;
    let mut drop = 0;
    for size in sizes.iter().rev() {
        if excess == 0 {
            break;
        }
        excess = excess.saturating_sub(*size);
        drop += 1;
    }
    loop {
        let keep = r.faults.len().saturating_sub(drop);
        let mut fitted = r.clone();
        fitted.faults.truncate(keep);
        fitted.dropped_faults = record.dropped_faults + (record.faults.len() - keep) as u64;
        fitted.check_code = check_code(&fitted.faults);
        let text = serde_json::to_string_pretty(&fitted)?;
        if text.len() <= limit || keep == 0 {
            return Ok((text, fitted));
        }
        drop += 1;
        r = record.clone();
    }
}

/// What decides whether the ConfigMap needs a write: everything in the record except
/// `updateTime` (which changes with every snapshot).
pub(crate) fn content_key(record: &NodeRecord) -> String {
    let mut r = record.clone();
    r.update_time = Timestamp::UNIX_EPOCH;
    let bytes = serde_json::to_vec(&r).unwrap_or_default();
    hex::encode(Sha256::digest(&bytes))
}

/// The content key without the detectors' states: a restarted agent's first records lack the
/// detectors that have not reported yet (they are not restored), which is no change worth a
/// write while the agent settles.
pub(crate) fn content_key_without_detectors(record: &NodeRecord) -> String {
    let mut r = record.clone();
    r.agent.detectors.clear();
    content_key(&r)
}

/// The keys the fault ConfigMap sink compares records by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecordKeys {
    /// [`content_key`]: any difference needs a write.
    pub content: String,
    /// [`shape_key`]: a difference here is more than a fault repeating.
    pub shape: String,
}

impl RecordKeys {
    pub(crate) fn of(record: &NodeRecord) -> Self {
        RecordKeys {
            content: content_key(record),
            shape: shape_key(record),
        }
    }
}

/// The content key without what a repeating fault moves: every fault's `count` and `lastSeen`,
/// and the `checkCode` computed over them. What is left is the health, the handling, which
/// faults there are and at which level (new, escalated, recovered), their messages and sources,
/// the detectors and the taint budget's report: all written at once.
pub(crate) fn shape_key(record: &NodeRecord) -> String {
    let mut r = record.clone();
    for f in &mut r.faults {
        f.count = 0;
        f.last_seen = Timestamp::UNIX_EPOCH;
    }
    r.check_code.clear();
    content_key(&r)
}

/// How the newest record differs from the one the ConfigMap holds (as last written or read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecordChange {
    /// The same content: nothing to write.
    Same,
    /// Only counts and last-seen times moved (a fault repeating): written within the budget.
    Counters,
    /// Anything else, or nothing known to be there: written at once.
    Content,
}

/// Compares by [`RecordKeys`]; `written` is `None` when the ConfigMap is missing, unreadable or
/// not known yet.
pub(crate) fn record_change(written: Option<&RecordKeys>, newest: &RecordKeys) -> RecordChange {
    match written {
        Some(w) if w.content == newest.content => RecordChange::Same,
        Some(w) if w.shape == newest.shape => RecordChange::Counters,
        _ => RecordChange::Content,
    }
}

/// When the fault ConfigMap sink writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteWhen {
    /// Nothing to write.
    Skip,
    Now,
    /// Wake after this long and decide again with whatever is newest then: the trailing write
    /// that carries the last count of a storm.
    After(std::time::Duration),
}

/// The fault ConfigMap's write decision. A content change (health, handling, a fault new,
/// escalated or recovered, the ConfigMap gone) is written now. A change of counters alone waits
/// for the write budget (`budget_wait`) and for a running retry backoff (`retry_wait`), then
/// goes out with the newest counts: a repeating fault costs one write per interval, never one
/// per repeat, and its final count is never lost.
///
/// While a failed write backs off, `since_failed` is how the newest record differs from that
/// failed attempt: only content new since the attempt goes at once; what the attempt already
/// carried (plus counts) waits for the retry. Compared with the last successful write alone,
/// every later count change looked like content and was sent at once, ~10 applies a second in a
/// storm against a failing API server.
pub(crate) fn when_to_write(
    change: RecordChange,
    since_failed: Option<RecordChange>,
    budget_wait: std::time::Duration,
    retry_wait: std::time::Duration,
) -> WriteWhen {
    if !retry_wait.is_zero() && since_failed.is_some_and(|c| c != RecordChange::Content) {
        return WriteWhen::After(retry_wait);
    }
    match change {
        RecordChange::Same => WriteWhen::Skip,
        RecordChange::Content => WriteWhen::Now,
        RecordChange::Counters => {
            let wait = budget_wait.max(retry_wait);
            if wait.is_zero() {
                WriteWhen::Now
            } else {
                WriteWhen::After(wait)
            }
        }
    }
}

/// The fault ConfigMap's pacing: [`when_to_write`] with the write budget it keeps. A write of
/// counters alone spends the budget (one per interval); a content write goes out regardless
/// and moves the next counters write one interval after it, without running up a debt. So the
/// writes of counters are at least an interval from any write before them, and a storm of one
/// repeating fault over `S` seconds costs at most `1 + ceil(S / interval) + 1` writes: its first
/// report, one per interval, and the trailing write with the final count (plus one per content
/// change, such as an escalation, in the middle).
#[derive(Debug, Clone)]
pub(crate) struct CountsPacer {
    budget: WriteBudget,
}

impl CountsPacer {
    /// `interval`: `--kube-write-interval`; zero writes every change at once.
    pub(crate) fn new(interval: std::time::Duration, now: Instant) -> Self {
        CountsPacer {
            budget: WriteBudget::new(interval, 1, now),
        }
    }

    /// When to write a record that differs from the written one by `change` (and from a failed
    /// attempt by `since_failed`); `retry_at`: when that failed write may be tried again.
    pub(crate) fn decide(
        &self,
        change: RecordChange,
        since_failed: Option<RecordChange>,
        now: Instant,
        retry_at: Option<Instant>,
    ) -> WriteWhen {
        let retry_wait = retry_at.map_or(std::time::Duration::ZERO, |at| {
            at.saturating_duration_since(now)
        });
        when_to_write(change, since_failed, self.budget.wait(now), retry_wait)
    }

    /// Records a write of a record that differed by `change`, made at `now`.
    pub(crate) fn written(&mut self, change: RecordChange, now: Instant) {
        match change {
            RecordChange::Counters => self.budget.spend(now),
            RecordChange::Content | RecordChange::Same => self.budget.note_forced(now),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;
    use faultline_core::record::{AgentStatus, Fault, FaultType, Handling, PolicyStatus, Source};

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    #[test]
    fn label_values() {
        assert_eq!(label_value("gpu-node-17"), "gpu-node-17");
        assert_eq!(label_value("a.b_c-1"), "a.b_c-1");
        let long = "n".repeat(100);
        let v = label_value(&long);
        assert!(v.len() <= 63 && v.starts_with("nnnn"), "{v}");
        assert_ne!(
            label_value(&"n".repeat(101)),
            v,
            "different names, different values"
        );
        let v = label_value("-weird/name-");
        assert!(v.starts_with("weird-name-"), "{v}");
    }

    fn record(active: usize, recovered: usize, msg_len: usize) -> NodeRecord {
        let fault = |i: usize, active: bool| Fault {
            fault_type: FaultType::CardUnhealthy,
            fault_code: format!("Xid{i}"),
            fault_handling: Handling::RestartBusiness,
            fault_level: Handling::RestartBusiness,
            large_model_fault_level: Handling::RestartBusiness,
            device: format!("GPU-{i}"),
            device_uuid: None,
            pci_bus_id: None,
            source: Source::Kmsg,
            message: "m".repeat(msg_len),
            first_seen: t(0),
            last_seen: t(0),
            count: 1,
            active,
            recovered_at: (!active).then(|| t(1)),
            escalated_from: None,
            also_seen_by: vec![],
        };
        let faults: Vec<Fault> = (0..active)
            .map(|i| fault(i, true))
            .chain((0..recovered).map(|i| fault(1000 + i, false)))
            .collect();
        NodeRecord {
            api_version: faultline_core::record::API_VERSION.into(),
            node: "n1".into(),
            health: Health::Degraded,
            handling: Some(Handling::RestartBusiness),
            update_time: t(5),
            check_code: check_code(&faults),
            faults,
            dropped_faults: 0,
            agent: AgentStatus {
                version: "0".into(),
                policy: PolicyStatus::default(),
                detectors: vec![],
                taint_budget: None,
                heartbeat_time: None,
                heartbeat_boot: None,
            },
        }
    }

    #[test]
    fn small_records_go_in_whole() {
        let r = record(2, 2, 10);
        let (text, fitted) = fit_record(&r, CONFIGMAP_LIMIT).unwrap();
        assert_eq!(fitted, r);
        assert_eq!(serde_json::from_str::<NodeRecord>(&text).unwrap(), r);
    }

    #[test]
    fn large_records_drop_recovered_faults_first() {
        let r = record(10, 300, 4000);
        let (text, fitted) = fit_record(&r, CONFIGMAP_LIMIT).unwrap();
        assert!(text.len() <= CONFIGMAP_LIMIT, "{}", text.len());
        let kept = fitted.faults.len();
        assert!(
            kept < 310 && kept > 200,
            "dropped too many or too few: {kept}"
        );
        assert_eq!(fitted.dropped_faults, 310 - kept as u64);
        assert_eq!(
            fitted.faults.iter().filter(|f| f.active).count(),
            10,
            "active faults kept"
        );
        assert_eq!(
            &fitted.faults[..],
            &r.faults[..kept],
            "oldest recovered went first"
        );
        assert_eq!(fitted.check_code, check_code(&fitted.faults));
        // Only a little room is wasted: one more fault would not fit.
        let (_, one_more) = fit_record(&r, text.len() + 4200).unwrap();
        assert!(one_more.faults.len() >= kept);
    }

    #[test]
    fn huge_active_sets_drop_least_severe_active_last() {
        let r = record(400, 0, 4000);
        let (text, fitted) = fit_record(&r, CONFIGMAP_LIMIT).unwrap();
        assert!(text.len() <= CONFIGMAP_LIMIT);
        assert!(fitted.dropped_faults > 0);
        assert_eq!(fitted.faults[0], r.faults[0], "most severe first, kept");
    }

    #[test]
    fn content_key_ignores_update_time_only() {
        let a = record(1, 0, 5);
        let mut b = a.clone();
        b.update_time = t(999);
        assert_eq!(content_key(&a), content_key(&b));
        b.health = Health::Unhealthy;
        assert_ne!(content_key(&a), content_key(&b));
        let mut c = a.clone();
        c.agent.taint_budget = Some(faultline_core::record::TaintBudgetStatus {
            withheld: vec!["x".into()],
            used: 1,
            limit: 1,
            nodes: 3,
            since: t(0),
        });
        assert_ne!(content_key(&a), content_key(&c), "a withheld taint is news");
    }

    /// A repeat moves counters only; every other change is content.
    #[test]
    fn record_changes() {
        let base = record(2, 1, 5);
        let keys = RecordKeys::of(&base);
        let repeat = |r: &mut NodeRecord| {
            r.faults[0].count += 7;
            r.faults[0].last_seen = t(60);
            r.check_code = check_code(&r.faults);
        };
        type Edit = fn(&mut NodeRecord);
        let cases: &[(&str, Edit, RecordChange)] = &[
            ("nothing", |_| {}, RecordChange::Same),
            (
                "updateTime only",
                |r| r.update_time = t(99),
                RecordChange::Same,
            ),
            (
                "a count",
                |r| {
                    r.faults[0].count += 1;
                    r.check_code = check_code(&r.faults)
                },
                RecordChange::Counters,
            ),
            (
                "a last-seen time",
                |r| r.faults[1].last_seen = t(30),
                RecordChange::Counters,
            ),
            (
                "count and last seen",
                |r| {
                    r.faults[0].count += 7;
                    r.faults[0].last_seen = t(60);
                    r.check_code = check_code(&r.faults)
                },
                RecordChange::Counters,
            ),
            (
                "health",
                |r| r.health = Health::Unhealthy,
                RecordChange::Content,
            ),
            (
                "node handling",
                |r| r.handling = Some(Handling::SeparateNPU),
                RecordChange::Content,
            ),
            (
                "a fault escalated",
                |r| {
                    r.faults[0].escalated_from = Some(Handling::RestartBusiness);
                    r.faults[0].fault_handling = Handling::SeparateNPU;
                },
                RecordChange::Content,
            ),
            (
                "a fault recovered",
                |r| {
                    r.faults[0].active = false;
                    r.faults[0].recovered_at = Some(t(9))
                },
                RecordChange::Content,
            ),
            (
                "a new fault",
                |r| {
                    let f = r.faults[0].clone();
                    r.faults.push(Fault {
                        device: "GPU-9".into(),
                        ..f
                    })
                },
                RecordChange::Content,
            ),
            (
                "a fault gone",
                |r| {
                    r.faults.pop();
                },
                RecordChange::Content,
            ),
            (
                "a message",
                |r| r.faults[0].message = "other".into(),
                RecordChange::Content,
            ),
            (
                "another source",
                |r| r.faults[0].also_seen_by = vec![Source::Nvml],
                RecordChange::Content,
            ),
            (
                "a detector",
                |r| {
                    r.agent
                        .detectors
                        .push(faultline_core::record::DetectorStatus {
                            name: "kmsg".into(),
                            state: "Down".into(),
                            reason: None,
                        })
                },
                RecordChange::Content,
            ),
            (
                "dropped faults",
                |r| r.dropped_faults = 3,
                RecordChange::Content,
            ),
        ];
        for (what, edit, want) in cases {
            let mut r = base.clone();
            edit(&mut r);
            assert_eq!(
                record_change(Some(&keys), &RecordKeys::of(&r)),
                *want,
                "{what}"
            );
        }
        assert_eq!(
            record_change(None, &keys),
            RecordChange::Content,
            "nothing there"
        );
        // Counters compared with the last record written, not the last seen: a storm that
        // also escalates is one content change.
        let mut r = base.clone();
        repeat(&mut r);
        r.faults[0].fault_handling = Handling::SeparateNPU;
        assert_eq!(
            record_change(Some(&keys), &RecordKeys::of(&r)),
            RecordChange::Content
        );
    }

    #[test]
    fn write_decisions() {
        use std::time::Duration;
        let (z, s) = (Duration::ZERO, Duration::from_secs);
        let cases = [
            // (change, since a failed attempt, budget wait, retry wait, decision)
            (RecordChange::Same, None, z, z, WriteWhen::Skip),
            (RecordChange::Same, None, s(5), s(1), WriteWhen::Skip),
            (RecordChange::Content, None, z, z, WriteWhen::Now),
            (RecordChange::Content, None, s(9), z, WriteWhen::Now),
            (RecordChange::Content, None, s(9), s(30), WriteWhen::Now),
            (RecordChange::Counters, None, z, z, WriteWhen::Now),
            (
                RecordChange::Counters,
                None,
                s(4),
                z,
                WriteWhen::After(s(4)),
            ),
            (
                RecordChange::Counters,
                None,
                z,
                s(2),
                WriteWhen::After(s(2)),
            ),
            (
                RecordChange::Counters,
                None,
                s(4),
                s(2),
                WriteWhen::After(s(4)),
            ),
            (
                RecordChange::Counters,
                None,
                s(1),
                s(8),
                WriteWhen::After(s(8)),
            ),
            // A failed attempt backing off: what it carried, plus counts, waits for the retry;
            // content new since it goes at once; with no backoff running it is not consulted.
            (
                RecordChange::Content,
                Some(RecordChange::Counters),
                s(9),
                s(30),
                WriteWhen::After(s(30)),
            ),
            (
                RecordChange::Content,
                Some(RecordChange::Same),
                z,
                s(3),
                WriteWhen::After(s(3)),
            ),
            (
                RecordChange::Content,
                Some(RecordChange::Content),
                s(9),
                s(30),
                WriteWhen::Now,
            ),
            (
                RecordChange::Content,
                Some(RecordChange::Counters),
                z,
                z,
                WriteWhen::Now,
            ),
        ];
        for (change, since_failed, budget, retry, want) in cases {
            assert_eq!(
                when_to_write(change, since_failed, budget, retry),
                want,
                "{change:?} since failed {since_failed:?} budget {budget:?} retry {retry:?}"
            );
        }
    }

    /// The sink's loop over a 60 s storm of one repeating fault (a repeat every 50 ms) with a
    /// 10 s interval, decided by [`CountsPacer`]: the first report and an escalation at 25 s go
    /// out the moment they happen, the repeats once per interval, and the last write carries the
    /// final count: 8 writes where every repeat was one before (1,200).
    #[test]
    fn a_storm_is_written_once_per_interval_and_ends_with_its_final_count() {
        use std::time::Duration;
        let interval = Duration::from_secs(10);
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut pacer = CountsPacer::new(interval, t0);
        let mut written: Option<RecordKeys> = None;
        let writes: std::cell::RefCell<Vec<(Duration, u64)>> = Default::default();
        let mut wake: Option<Instant> = None;
        let mut newest = record(1, 0, 5);
        // What the sink does when a snapshot arrives or its wake-up passes.
        let mut step = |now: Instant, r: &NodeRecord, wake: &mut Option<Instant>| {
            let keys = RecordKeys::of(r);
            let change = record_change(written.as_ref(), &keys);
            match pacer.decide(change, None, now, None) {
                WriteWhen::Skip => *wake = None,
                WriteWhen::Now => {
                    pacer.written(change, now);
                    written = Some(keys);
                    *wake = None;
                    writes.borrow_mut().push((now - t0, r.faults[0].count));
                }
                WriteWhen::After(d) => *wake = Some(now + d),
            }
        };
        let repeats = 1200u64;
        for i in 0..repeats {
            let now = ms(50 * i);
            // A wake-up due before this repeat comes first.
            while let Some(w) = wake.filter(|w| *w <= now) {
                step(w, &newest, &mut wake);
            }
            newest.faults[0].count = i + 1;
            newest.faults[0].last_seen = t(i as i64 / 20);
            if i == 501 {
                newest.faults[0].escalated_from = Some(Handling::RestartBusiness);
                newest.faults[0].fault_handling = Handling::SeparateNPU;
            }
            newest.check_code = check_code(&newest.faults);
            step(now, &newest, &mut wake);
        }
        while let Some(w) = wake {
            step(w, &newest, &mut wake);
        }
        let s = |n: u64, count: u64| (Duration::from_millis(n), count);
        assert_eq!(
            *writes.borrow(),
            [
                // The new fault.
                s(0, 1),
                // Counts, one interval after it (the wake-up before the repeat due then).
                s(10_000, 200),
                s(20_000, 400),
                // The escalation, at once.
                s(25_050, 502),
                // Counts, one interval after the escalation.
                s(35_050, 701),
                s(45_050, 901),
                s(55_050, 1101),
                // The trailing write: the final count.
                s(65_050, 1200),
            ]
        );
        // A lone repeat after a quiet spell goes out at once.
        let later = ms(200_000);
        newest.faults[0].count += 1;
        step(later, &newest, &mut wake);
        assert_eq!(writes.borrow().last(), Some(&(later - t0, 1201)));
    }
}
