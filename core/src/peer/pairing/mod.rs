//! Peer-check pairing: which nodes check each other in each round, and what the results say.
//! Pure: the coordinator asks for a round, runs its checks, records the outcomes, and repeats
//! until `next_round` returns `None`; `verdicts` reads the evidence.
//!
//! Round 1 pairs neighbours in the given order (sorted by topology label, rotated between runs;
//! `neighbour_order`). With an odd count the last node also checks with the first, which then
//! takes part in two checks (that check's time is not used for straggler statistics). Later
//! rounds pair every unresolved node with a distinct node that has passed a check and that it has
//! not yet been paired with; with no such node, unresolved nodes are paired among themselves.
//!
//! What the evidence means (docs/peer-checks.md):
//! - **good**: passed at least one check (a faulty node fails with everyone);
//! - **faulty node**: never passed, and failed with at least two distinct good partners (one good
//!   partner is not enough: that could be a broken link);
//! - **explained**: never passed, but every failure was with a node found faulty: nothing
//!   against it, no verdict;
//! - **broken link**: a pair failed although both members are good;
//! - **straggler**: at least two of its checks, with distinct partners, were slower than the
//!   median by `straggler_ratio` and by `straggler_mads` median absolute deviations;
//! - **unknown**: still unresolved when no informative pair is left or the round limit is reached,
//!   with the reason.

use std::collections::{BTreeMap, BTreeSet};

/// A node of the run: its index in the member list.
pub type NodeId = usize;

/// Two distinct nodes, smaller first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Pair(NodeId, NodeId);

impl Pair {
    pub fn new(a: NodeId, b: NodeId) -> Pair {
        if a <= b {
            Pair(a, b)
        } else {
            Pair(b, a)
        }
    }
    pub fn a(self) -> NodeId {
        self.0
    }
    pub fn b(self) -> NodeId {
        self.1
    }
    pub fn has(self, n: NodeId) -> bool {
        self.0 == n || self.1 == n
    }
    pub fn other(self, n: NodeId) -> NodeId {
        if self.0 == n {
            self.1
        } else {
            self.0
        }
    }
}

/// One planned check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    pub pair: Pair,
    /// Neither node takes part in another check of the same round (its time is comparable).
    pub exclusive: bool,
}

/// What a check reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// Completed; the time of the allgather (or whatever the run measures), in seconds.
    Pass { seconds: f64 },
    /// Failed, timed out, or a member did not answer.
    Fail,
    /// Not judged: the check could not be run or its result did not come back for a reason
    /// that says nothing about the data path (the coordinator could not reach an agent to
    /// assign it, a report was lost on its way). No evidence either way: its nodes count as not
    /// checked by it, and they are paired with other partners (the pair is not planned again).
    Void,
}

/// Thresholds.
#[derive(Debug, Clone, PartialEq)]
pub struct PairingConfig {
    /// A check is slow when its time exceeds the median by this factor ...
    pub straggler_ratio: f64,
    /// ... and by this many median absolute deviations.
    pub straggler_mads: f64,
    /// Rounds at most (the first included).
    pub max_rounds: usize,
}

impl Default for PairingConfig {
    fn default() -> Self {
        PairingConfig {
            straggler_ratio: 1.5,
            straggler_mads: 3.0,
            max_rounds: 6,
        }
    }
}

/// The result of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Verdicts {
    pub faulty: BTreeSet<NodeId>,
    pub broken_links: BTreeSet<Pair>,
    /// Straggler -> its median check time over the median of all checks.
    pub stragglers: BTreeMap<NodeId, f64>,
    /// Unresolved nodes and why.
    pub unknown: BTreeMap<NodeId, String>,
}

impl Verdicts {
    pub fn is_clean(&self) -> bool {
        self.faulty.is_empty()
            && self.broken_links.is_empty()
            && self.stragglers.is_empty()
            && self.unknown.is_empty()
    }
}

#[derive(Debug, Clone)]
struct Record {
    check: Check,
    outcome: Outcome,
}

/// The planner of one run.
#[derive(Debug, Clone)]
pub struct Planner {
    order: Vec<NodeId>,
    cfg: PairingConfig,
    rounds: usize,
    history: Vec<Record>,
    /// Pairs whose check was not judged (`Outcome::Void`): not evidence, but not planned again.
    voided: BTreeSet<Pair>,
    /// The round handed out and not yet recorded.
    pending: Option<Vec<Check>>,
    finished: bool,
    /// Why planning stopped with nodes unresolved.
    stop_reason: Option<String>,
}

/// What the history says right now.
#[derive(Debug, Default)]
struct Evidence {
    good: BTreeSet<NodeId>,
    faulty: BTreeSet<NodeId>,
    /// Never passed, not faulty, not explained: needs another check.
    unresolved: BTreeSet<NodeId>,
    links: BTreeSet<Pair>,
    stragglers: BTreeMap<NodeId, f64>,
    /// Good nodes with exactly one slow check that are not cleared: need another measurement.
    slow_suspects: BTreeSet<NodeId>,
    /// Good nodes none of whose comparable checks was slow.
    normal: BTreeSet<NodeId>,
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Round-1 order: by topology label (members without one last), then by name, rotated by
/// `rotation` places so the pairs change between runs.
pub fn neighbour_order(members: &[(String, Option<String>)], rotation: usize) -> Vec<NodeId> {
    let mut idx: Vec<NodeId> = (0..members.len()).collect();
    idx.sort_by(|&x, &y| {
        let (nx, tx) = &members[x];
        let (ny, ty) = &members[y];
        (tx.is_none(), tx, nx).cmp(&(ty.is_none(), ty, ny))
    });
    if !idx.is_empty() {
        let r = rotation % idx.len();
        idx.rotate_left(r);
    }
    idx
}

impl Planner {
    /// A run over the nodes in `order` (every node exactly once).
    pub fn new(order: Vec<NodeId>, cfg: PairingConfig) -> Planner {
        Planner {
            order,
            cfg,
            rounds: 0,
            history: Vec::new(),
            voided: BTreeSet::new(),
            pending: None,
            finished: false,
            stop_reason: None,
        }
    }

    /// Rounds handed out so far.
    pub fn rounds(&self) -> usize {
        self.rounds
    }

    /// Checks run so far.
    pub fn checks(&self) -> usize {
        self.history.len()
    }

    /// The next round's checks, or `None` when the run is over. Calling it again before
    /// `record` returns the same round.
    pub fn next_round(&mut self) -> Option<Vec<Check>> {
        if let Some(p) = &self.pending {
            return Some(p.clone());
        }
        if self.finished {
            return None;
        }
        let plan = if self.rounds == 0 {
            self.first_round()
        } else if self.rounds >= self.cfg.max_rounds {
            self.stop_reason = Some(format!("round limit ({}) reached", self.cfg.max_rounds));
            Vec::new()
        } else {
            self.later_round()
        };
        if plan.is_empty() {
            self.finished = true;
            return None;
        }
        self.rounds += 1;
        self.pending = Some(plan.clone());
        Some(plan)
    }

    /// Records the outcomes of the pending round. A planned check missing from `results`
    /// counts as failed (its members did not report); results for checks not planned are
    /// ignored.
    pub fn record(&mut self, results: &[(Pair, Outcome)]) {
        let Some(plan) = self.pending.take() else {
            return;
        };
        for check in plan {
            let outcome = results
                .iter()
                .find(|(p, _)| *p == check.pair)
                .map_or(Outcome::Fail, |(_, o)| *o);
            if outcome == Outcome::Void {
                self.voided.insert(check.pair);
                continue;
            }
            self.history.push(Record { check, outcome });
        }
    }

    fn first_round(&self) -> Vec<Check> {
        let o = &self.order;
        let mut plan: Vec<Check> = o
            .chunks(2)
            .filter(|c| c.len() == 2)
            .map(|c| Check {
                pair: Pair::new(c[0], c[1]),
                exclusive: true,
            })
            .collect();
        if o.len() % 2 == 1 && o.len() >= 3 {
            let last = o[o.len() - 1];
            plan.push(Check {
                pair: Pair::new(last, o[0]),
                exclusive: false,
            });
            if let Some(first) = plan.first_mut() {
                first.exclusive = false;
            }
        }
        plan
    }

    fn tried(&self, a: NodeId, b: NodeId) -> bool {
        let p = Pair::new(a, b);
        self.voided.contains(&p) || self.history.iter().any(|r| r.check.pair == p)
    }

    fn later_round(&mut self) -> Vec<Check> {
        let ev = self.evidence();
        let mut used: BTreeSet<NodeId> = BTreeSet::new();
        let mut plan = Vec::new();
        // Most failures first: they resolve the most.
        let failures = |n: NodeId| {
            self.history
                .iter()
                .filter(|r| r.check.pair.has(n) && matches!(r.outcome, Outcome::Fail))
                .count()
        };
        let mut unresolved: Vec<NodeId> = ev.unresolved.iter().copied().collect();
        unresolved.sort_by_key(|&n| (std::cmp::Reverse(failures(n)), n));
        let mut waiting = Vec::new();
        for &s in &unresolved {
            let partner = ev
                .good
                .iter()
                .copied()
                .find(|&g| !used.contains(&g) && !self.tried(s, g));
            match partner {
                Some(g) => {
                    used.insert(g);
                    used.insert(s);
                    plan.push(Check {
                        pair: Pair::new(s, g),
                        exclusive: true,
                    });
                }
                None => waiting.push(s),
            }
        }
        // No good partner left for these: pair them among themselves (a pass clears both).
        for i in 0..waiting.len() {
            let s = waiting[i];
            if used.contains(&s) {
                continue;
            }
            if let Some(&t) = waiting[i + 1..]
                .iter()
                .find(|&&t| !used.contains(&t) && !self.tried(s, t))
            {
                used.insert(s);
                used.insert(t);
                plan.push(Check {
                    pair: Pair::new(s, t),
                    exclusive: true,
                });
            }
        }
        // A second measurement for nodes with one slow check, against a normal node.
        for &s in &ev.slow_suspects {
            if used.contains(&s) {
                continue;
            }
            let partner = ev
                .normal
                .iter()
                .copied()
                .find(|&g| g != s && !used.contains(&g) && !self.tried(s, g));
            if let Some(g) = partner {
                used.insert(g);
                used.insert(s);
                plan.push(Check {
                    pair: Pair::new(s, g),
                    exclusive: true,
                });
            }
        }
        if plan.is_empty() && (!ev.unresolved.is_empty() || !ev.slow_suspects.is_empty()) {
            self.stop_reason = Some("no untried partner left that could tell".into());
        }
        plan
    }

    /// Passing check times, with whether the check was exclusive (comparable).
    fn times(&self) -> Vec<(Pair, f64, bool)> {
        self.history
            .iter()
            .filter_map(|r| match r.outcome {
                Outcome::Pass { seconds } if seconds.is_finite() && seconds >= 0.0 => {
                    Some((r.check.pair, seconds, r.check.exclusive))
                }
                _ => None,
            })
            .collect()
    }

    fn evidence(&self) -> Evidence {
        let mut ev = Evidence::default();
        let mut nodes: BTreeSet<NodeId> = self.order.iter().copied().collect();
        for r in &self.history {
            nodes.insert(r.check.pair.a());
            nodes.insert(r.check.pair.b());
            if matches!(r.outcome, Outcome::Pass { .. }) {
                ev.good.insert(r.check.pair.a());
                ev.good.insert(r.check.pair.b());
            }
        }
        let failed_with = |n: NodeId| -> BTreeSet<NodeId> {
            self.history
                .iter()
                .filter(|r| r.check.pair.has(n) && matches!(r.outcome, Outcome::Fail))
                .map(|r| r.check.pair.other(n))
                .collect()
        };
        for &n in &nodes {
            if !ev.good.contains(&n) && failed_with(n).intersection(&ev.good).count() >= 2 {
                ev.faulty.insert(n);
            }
        }
        for &n in &nodes {
            if ev.good.contains(&n) || ev.faulty.contains(&n) {
                continue;
            }
            let fw = failed_with(n);
            let explained = !fw.is_empty() && fw.iter().all(|p| ev.faulty.contains(p));
            if !explained {
                ev.unresolved.insert(n);
            }
        }
        for r in &self.history {
            let p = r.check.pair;
            if matches!(r.outcome, Outcome::Fail)
                && ev.good.contains(&p.a())
                && ev.good.contains(&p.b())
            {
                ev.links.insert(p);
            }
        }
        // Stragglers. The statistics use exclusive checks only: a node in two checks at once
        // shares its bandwidth. A shared check that was not slow still shows the node is not.
        let times = self.times();
        let mut all: Vec<f64> = times.iter().filter(|x| x.2).map(|x| x.1).collect();
        let m = median(&mut all);
        let mut dev: Vec<f64> = times
            .iter()
            .filter(|x| x.2)
            .map(|x| (x.1 - m).abs())
            .collect();
        let mad = median(&mut dev);
        let slow = |t: f64| {
            m > 0.0 && t > m * self.cfg.straggler_ratio && t > m + self.cfg.straggler_mads * mad
        };
        // Per good node: (partner, time) of its exclusive checks, and whether any shared check
        // of it was normal.
        let mine = |n: NodeId| -> (Vec<(NodeId, f64)>, bool) {
            let excl = times
                .iter()
                .filter(|(p, _, e)| *e && p.has(n))
                .map(|(p, t, _)| (p.other(n), *t))
                .collect();
            let shared_normal = times.iter().any(|(p, t, e)| !*e && p.has(n) && !slow(*t));
            (excl, shared_normal)
        };
        for &n in &ev.good {
            let (excl, shared_normal) = mine(n);
            let slow_partners: BTreeSet<NodeId> = excl
                .iter()
                .filter(|(_, t)| slow(*t))
                .map(|(p, _)| *p)
                .collect();
            if slow_partners.len() >= 2 {
                let mut ts: Vec<f64> = excl.iter().map(|(_, t)| *t).collect();
                ev.stragglers.insert(n, median(&mut ts) / m);
            } else if slow_partners.is_empty() && (!excl.is_empty() || shared_normal) {
                ev.normal.insert(n);
            }
        }
        // The rest: cleared when a check of theirs was normal, or every slow check of theirs
        // was with a straggler; else they need another measurement (one slow check, or no
        // comparable one at all).
        for &n in &ev.good {
            if ev.stragglers.contains_key(&n) || ev.normal.contains(&n) {
                continue;
            }
            let (excl, shared_normal) = mine(n);
            let has_normal = shared_normal || excl.iter().any(|(_, t)| !slow(*t));
            let slow_ones: Vec<&(NodeId, f64)> = excl.iter().filter(|(_, t)| slow(*t)).collect();
            let blamed = !slow_ones.is_empty()
                && slow_ones.iter().all(|(p, _)| ev.stragglers.contains_key(p));
            if !has_normal && !blamed {
                ev.slow_suspects.insert(n);
            }
        }
        ev
    }

    /// The verdicts from the evidence so far (final once `next_round` has returned `None`).
    pub fn verdicts(&self) -> Verdicts {
        let ev = self.evidence();
        let reason = self
            .stop_reason
            .clone()
            .unwrap_or_else(|| "the run ended before it was resolved".into());
        let mut unknown: BTreeMap<NodeId, String> = BTreeMap::new();
        for &n in &ev.unresolved {
            let why = if ev.good.is_empty() {
                format!("no node passed a check to compare with ({reason})")
            } else {
                reason.clone()
            };
            unknown.insert(n, why);
        }
        for &n in &ev.slow_suspects {
            unknown.insert(n, format!("slow once, not measured again ({reason})"));
        }
        Verdicts {
            faulty: ev.faulty,
            broken_links: ev.links,
            stragglers: ev.stragglers,
            unknown,
        }
    }
}

/// A simulated cluster for tests and the localization benchmark: who is broken, and how checks
/// come out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Truth {
    pub faulty: BTreeSet<NodeId>,
    pub broken_links: BTreeSet<Pair>,
    /// Node -> slowdown factor (2.0: its checks take twice as long).
    pub slow: BTreeMap<NodeId, f64>,
    /// Relative noise on check times (0.05: up to ±5 %), deterministic per pair and round.
    pub noise: f64,
}

impl Truth {
    pub fn outcome(&self, check: Check, round: usize) -> Outcome {
        let p = check.pair;
        if self.faulty.contains(&p.a())
            || self.faulty.contains(&p.b())
            || self.broken_links.contains(&p)
        {
            return Outcome::Fail;
        }
        let slow = |n| self.slow.get(&n).copied().unwrap_or(1.0);
        // A cheap deterministic hash of (pair, round) for the noise.
        let h = (p.a() as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add((p.b() as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
            .wrapping_add(round as u64)
            .rotate_left(29)
            .wrapping_mul(0x1656_67B1_9E37_79F9);
        let unit = (h >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
        let jitter = 1.0 + self.noise * (2.0 * unit - 1.0);
        Outcome::Pass {
            seconds: 1.0 * slow(p.a()).max(slow(p.b())) * jitter,
        }
    }
}

/// Runs a planner against a simulated cluster to the end.
pub fn simulate(order: Vec<NodeId>, truth: &Truth, cfg: PairingConfig) -> (Verdicts, usize, usize) {
    let mut planner = Planner::new(order, cfg);
    while let Some(round) = planner.next_round() {
        let r = planner.rounds();
        let results: Vec<(Pair, Outcome)> = round
            .iter()
            .map(|c| (c.pair, truth.outcome(*c, r)))
            .collect();
        planner.record(&results);
    }
    (planner.verdicts(), planner.rounds(), planner.checks())
}

#[cfg(test)]
mod tests;
