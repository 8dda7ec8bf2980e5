//! Peer-check pairing: which nodes check each other in each round, and what the results say.
//! Pure: the coordinator asks for a round, runs its checks, records the outcomes, and repeats
//! until `next_round` returns `None`; `verdicts` reads the evidence.
//!
//! Round 1 pairs neighbours in the given order (sorted by topology label, rotated between runs;
//! `neighbour_order`). With an odd count the last node also checks with the first, which then
//! takes part in two checks (that check's time is not used for straggler statistics). Later
//! rounds pair every unresolved node with a distinct node that has passed a check and that it has
//! not yet been paired with; with no such node, unresolved nodes are paired among themselves.
//! Nodes with one slow check are measured again against a normal node; a pair slow once whose
//! nodes are both normal with other partners is measured again itself; and a later round gets
//! up to 3 reference checks between normal nodes: its own yardstick for time and for load.
//!
//! What the evidence means (docs/peer-checks.md):
//! - **good**: passed at least one check (a faulty node fails with everyone);
//! - **faulty node**: never passed, and failed with at least two distinct good partners (one good
//!   partner is not enough: that could be a broken link);
//! - **explained**: never passed, but every failure was with a node found faulty: nothing
//!   against it, no verdict;
//! - **broken link**: a pair failed with a reported error although both members are good;
//! - **straggler**: slow with at least two distinct partners, each check against its own round
//!   (the lower median of the round's other reference times): slower by `straggler_ratio` and
//!   by `straggler_mads` median absolute deviations;
//! - **degraded link**: a pair whose exclusive checks were slow by the same test (the same
//!   `straggler_ratio`, chosen above the slowest check measured under load; one slow check
//!   alone may still be noise) in two rounds, the second a re-check planned for it, while neither node is a
//!   straggler and each has a check with another partner that was not slow. Neither node is
//!   blamed. A pair slow once and normal when measured again gets nothing. A degraded link
//!   between round-1 neighbours is named in 3 rounds (round 2 clears each node with a normal
//!   partner, round 3 re-checks the pair); one no round-1 check used is not found by the run;
//! - **unknown**: still unresolved when no informative pair is left, the round limit is
//!   reached, or checks kept timing out under load, with the reason.
//!
//! A timeout (`Outcome::TimedOut`) is a failure only in a round that was not overloaded
//! (`Planner` has the rule); the timeouts of an overloaded round are checked again with a
//! longer deadline (`Planner::deadline_factor`).

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
    /// A hard failure: a member reported an error (data, connection, probe), refused the check,
    /// or could not be reached.
    Fail,
    /// Not judged: the check could not be run or its result did not come back for a reason
    /// that says nothing about the data path (the coordinator could not reach an agent to
    /// assign it, a report was lost on its way). No evidence either way: its nodes count as not
    /// checked by it, and they are paired with other partners (the pair is not planned again).
    Void,
    /// The deadline passed and neither member reported a failure. Evidence against a node only
    /// when the round was not overloaded (`Planner` docs).
    TimedOut,
}

/// Thresholds.
#[derive(Debug, Clone, PartialEq)]
pub struct PairingConfig {
    /// A check is slow when its time exceeds its round's median by this factor ...
    pub straggler_ratio: f64,
    /// ... and by this many median absolute deviations.
    pub straggler_mads: f64,
    /// Rounds at most (the first included).
    pub max_rounds: usize,
}

/// The default `straggler_ratio`: above the slowest single check measured on a loaded host at
/// the default check size (1.94x its round's reference at 64 MiB, over 2,000 checks;
/// docs/peer-checks.md, "Noise").
pub const DEFAULT_STRAGGLER_RATIO: f64 = 2.0;

impl Default for PairingConfig {
    fn default() -> Self {
        PairingConfig {
            straggler_ratio: DEFAULT_STRAGGLER_RATIO,
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
    /// Straggler -> its slowdown: over its comparable checks, each check's time over its own
    /// round's median; the lower median of those (one check slowed by noise does not inflate it).
    pub stragglers: BTreeMap<NodeId, f64>,
    /// Degraded link -> its slowdown: the lower median of its exclusive checks' times over
    /// their rounds' references (all of them slow, at least two).
    pub degraded_links: BTreeMap<Pair, f64>,
    /// Unresolved nodes and why.
    pub unknown: BTreeMap<NodeId, String>,
}

impl Verdicts {
    pub fn is_clean(&self) -> bool {
        self.faulty.is_empty()
            && self.broken_links.is_empty()
            && self.stragglers.is_empty()
            && self.degraded_links.is_empty()
            && self.unknown.is_empty()
    }
}

/// Why the planner asked for a check; decides which checks set a round's reference times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Round 1: neighbours.
    First,
    /// An unresolved node with a good partner, or two unresolved nodes.
    Resolve,
    /// A node with one slow check, measured again against a normal node: the checks the round
    /// judges, never its reference.
    Remeasure,
    /// A pair with one slow check whose nodes are both normal with other partners, measured
    /// again: slow again is a degraded link. Judged, never a reference.
    Relink,
    /// Two normal nodes: the round's reference, for time and for load.
    Reference,
}

#[derive(Debug, Clone)]
struct Record {
    check: Check,
    outcome: Outcome,
    /// The round it ran in (1 for the first).
    round: usize,
    role: Role,
}

/// Reference checks (two normal nodes) a later round gets, as free normal nodes allow.
const REFERENCE_CHECKS: usize = 3;
/// A round needs this many reference times for its own spread (MAD); below it, round 1's
/// relative spread is scaled to the round's median.
const OWN_SPREAD_MIN: usize = 3;
/// Overloaded rounds after which the run gives up on the nodes they left open.
const OVERLOAD_RETRIES: usize = 2;
/// The deadline factor doubles after each overloaded round, up to this (an agent's default
/// ceiling on the deadlines it accepts is this times its check timeout: `PeerPolicy`).
pub const MAX_DEADLINE_FACTOR: f64 = 4.0;

/// The planner of one run.
///
/// Timeouts (`Outcome::TimedOut`) are read per round. A round with a timeout is
/// **overloaded** when a reference check of it timed out, or a check between two nodes that
/// both pass elsewhere timed out, or none of its checks passed, or (with no reference check of
/// it passed) at least two and more than a third of its checks timed out. The timeouts of an overloaded round are no evidence: their nodes are
/// checked again (same pair allowed) and the next round's deadline is longer
/// (`deadline_factor`); after `OVERLOAD_RETRIES` overloaded rounds, or at the round limit,
/// nodes left open by them are unknown ("checks timed out under load"), never faulty. A
/// timeout in a round that is not overloaded counts as a failure against a node that never
/// passes (a hung node is still found), and never makes a broken link (links are named from
/// hard failures only).
#[derive(Debug, Clone)]
pub struct Planner {
    order: Vec<NodeId>,
    cfg: PairingConfig,
    rounds: usize,
    history: Vec<Record>,
    /// Pairs whose check was not judged (`Outcome::Void`): not evidence, but not planned again.
    voided: BTreeSet<Pair>,
    /// The round handed out and not yet recorded.
    pending: Option<Vec<(Check, Role)>>,
    /// Deadline factor of the round last handed out.
    deadline_factor: f64,
    finished: bool,
    /// Why planning stopped with nodes unresolved.
    stop_reason: Option<String>,
}

/// A round's reference: its reference times (exclusive passed checks not planned to
/// re-measure a suspect; round 1: all its exclusive checks), sorted, and their median absolute
/// deviation.
#[derive(Debug, Clone, Default)]
struct RoundStats {
    times: Vec<f64>,
    mad: f64,
}

impl RoundStats {
    /// The lower median (the smaller middle value of an even count) of the reference times
    /// leaving out one occurrence of `own`: a check is not its own reference (in a round of two
    /// checks each is compared with the other), and in a small round one slow reference check
    /// does not lift the bar.
    fn median_without(&self, own: Option<f64>) -> Option<f64> {
        let v = &self.times;
        let skip = own.and_then(|x| v.iter().position(|t| *t == x));
        let k = v.len() - usize::from(skip.is_some());
        if k == 0 {
            return None;
        }
        let at = |i: usize| match skip {
            Some(s) if i >= s => v[i + 1],
            _ => v[i],
        };
        let m = at((k - 1) / 2);
        (m > 0.0).then_some(m)
    }
}

/// One node's comparable checks: (partner, time over its round's median, slow).
type Judged = Vec<(NodeId, f64, bool)>;

/// What the history says right now.
#[derive(Debug, Default)]
struct Evidence {
    good: BTreeSet<NodeId>,
    faulty: BTreeSet<NodeId>,
    /// Never passed, not faulty, not explained: needs another check.
    unresolved: BTreeSet<NodeId>,
    /// Unresolved nodes that failed only by timeouts of overloaded rounds.
    timed_out: BTreeSet<NodeId>,
    /// Unresolved nodes all of whose checks timed out, some in rounds that were not overloaded.
    timed_out_counted: BTreeSet<NodeId>,
    /// Rounds whose timeouts are overload, not evidence.
    overloaded: BTreeSet<usize>,
    links: BTreeSet<Pair>,
    stragglers: BTreeMap<NodeId, f64>,
    /// Good nodes with exactly one slow check that are not cleared: need another measurement.
    slow_suspects: BTreeSet<NodeId>,
    /// Good nodes none of whose comparable checks was slow.
    normal: BTreeSet<NodeId>,
    /// Pairs with one comparable check, slow, whose nodes are both normal with other partners:
    /// need a second measurement of the pair.
    link_suspects: BTreeSet<Pair>,
    degraded: BTreeMap<Pair, f64>,
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

/// The lower median: the middle value, or the smaller of the two middle ones.
fn lower_median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[(v.len() - 1) / 2]
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
            deadline_factor: 1.0,
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

    /// How much longer than usual the round last handed out by `next_round` should wait for
    /// its checks: 1 normally; 2 when it checks a node again after a timeout; 2, then 4, after
    /// overloaded rounds (their timed-out nodes are checked again with the longer deadline).
    pub fn deadline_factor(&self) -> f64 {
        self.deadline_factor
    }

    /// The next round's checks, or `None` when the run is over. Calling it again before
    /// `record` returns the same round.
    pub fn next_round(&mut self) -> Option<Vec<Check>> {
        if let Some(p) = &self.pending {
            return Some(p.iter().map(|x| x.0).collect());
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
        let checks = plan.iter().map(|x| x.0).collect();
        self.pending = Some(plan);
        Some(checks)
    }

    /// Records the outcomes of the pending round. A planned check missing from `results`
    /// counts as timed out (no report came); results for checks not planned are ignored.
    pub fn record(&mut self, results: &[(Pair, Outcome)]) {
        let Some(plan) = self.pending.take() else {
            return;
        };
        for (check, role) in plan {
            let outcome = results
                .iter()
                .find(|(p, _)| *p == check.pair)
                .map_or(Outcome::TimedOut, |(_, o)| *o);
            if outcome == Outcome::Void {
                self.voided.insert(check.pair);
                continue;
            }
            self.history.push(Record {
                check,
                outcome,
                round: self.rounds,
                role,
            });
        }
    }

    fn first_round(&self) -> Vec<(Check, Role)> {
        let o = &self.order;
        let mut plan: Vec<(Check, Role)> = o
            .chunks(2)
            .filter(|c| c.len() == 2)
            .map(|c| {
                let check = Check {
                    pair: Pair::new(c[0], c[1]),
                    exclusive: true,
                };
                (check, Role::First)
            })
            .collect();
        if o.len() % 2 == 1 && o.len() >= 3 {
            let last = o[o.len() - 1];
            let check = Check {
                pair: Pair::new(last, o[0]),
                exclusive: false,
            };
            plan.push((check, Role::First));
            if let Some(first) = plan.first_mut() {
                first.0.exclusive = false;
            }
        }
        plan
    }

    /// Whether a pair has been checked with a result that says something (a timeout of an
    /// overloaded round says nothing: the pair may be tried again).
    fn tried(&self, a: NodeId, b: NodeId, overloaded: &BTreeSet<usize>) -> bool {
        let p = Pair::new(a, b);
        self.voided.contains(&p)
            || self.history.iter().any(|r| {
                r.check.pair == p
                    && !(r.outcome == Outcome::TimedOut && overloaded.contains(&r.round))
            })
    }

    /// Whether a record counts as a failure of its pair.
    fn failed(r: &Record, overloaded: &BTreeSet<usize>) -> bool {
        match r.outcome {
            Outcome::Fail => true,
            Outcome::TimedOut => !overloaded.contains(&r.round),
            // Never recorded (`record` keeps unjudged checks out of the history).
            Outcome::Pass { .. } | Outcome::Void => false,
        }
    }

    fn later_round(&mut self) -> Vec<(Check, Role)> {
        let ev = self.evidence();
        let ol = &ev.overloaded;
        if ol.len() > OVERLOAD_RETRIES {
            self.stop_reason = Some(format!(
                "checks timed out under load in {} rounds",
                ol.len()
            ));
            return Vec::new();
        }
        let mut used: BTreeSet<NodeId> = BTreeSet::new();
        let mut plan = Vec::new();
        let exclusive = |a: NodeId, b: NodeId, role: Role| {
            let check = Check {
                pair: Pair::new(a, b),
                exclusive: true,
            };
            (check, role)
        };
        // Most failures first: they resolve the most.
        let failures = |n: NodeId| {
            self.history
                .iter()
                .filter(|r| r.check.pair.has(n) && Self::failed(r, ol))
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
                .find(|&g| !used.contains(&g) && !self.tried(s, g, ol));
            match partner {
                Some(g) => {
                    used.insert(g);
                    used.insert(s);
                    plan.push(exclusive(s, g, Role::Resolve));
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
                .find(|&&t| !used.contains(&t) && !self.tried(s, t, ol))
            {
                used.insert(s);
                used.insert(t);
                plan.push(exclusive(s, t, Role::Resolve));
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
                .find(|&g| g != s && !used.contains(&g) && !self.tried(s, g, ol));
            if let Some(g) = partner {
                used.insert(g);
                used.insert(s);
                plan.push(exclusive(s, g, Role::Remeasure));
            }
        }
        // A second measurement of a pair slow once whose nodes are normal with others.
        for &p in &ev.link_suspects {
            if used.contains(&p.a()) || used.contains(&p.b()) {
                continue;
            }
            used.insert(p.a());
            used.insert(p.b());
            plan.push(exclusive(p.a(), p.b(), Role::Relink));
        }
        if plan.is_empty() {
            if !ev.unresolved.is_empty() || !ev.slow_suspects.is_empty() {
                self.stop_reason = Some("no untried partner left that could tell".into());
            }
            return plan;
        }
        // Reference checks between normal nodes: the round's own yardstick for time (its
        // other checks run fewer at once than round 1, or under another load) and for load
        // (a reference check timing out means the round was overloaded). Untried pairs first:
        // they exercise new links.
        let free: Vec<NodeId> = ev
            .normal
            .iter()
            .copied()
            .filter(|n| !used.contains(n))
            .collect();
        let mut refs = 0;
        for untried_only in [true, false] {
            for (i, &a) in free.iter().enumerate() {
                if refs >= REFERENCE_CHECKS || used.contains(&a) {
                    continue;
                }
                if let Some(&b) = free[i + 1..]
                    .iter()
                    .find(|&&b| !used.contains(&b) && (!untried_only || !self.tried(a, b, ol)))
                {
                    used.insert(a);
                    used.insert(b);
                    plan.push(exclusive(a, b, Role::Reference));
                    refs += 1;
                }
            }
        }
        // A longer deadline after overloaded rounds, and for a node checked again after a
        // timeout: one slow check that ran past the deadline passes then, a hung node does not.
        let doublings = i32::try_from(ol.len()).unwrap_or(i32::MAX);
        let mut factor = 2f64.powi(doublings).min(MAX_DEADLINE_FACTOR);
        let timed_out = |n: NodeId| {
            self.history
                .iter()
                .any(|r| r.check.pair.has(n) && r.outcome == Outcome::TimedOut)
        };
        if plan.iter().any(|(c, role)| {
            *role == Role::Resolve && (timed_out(c.pair.a()) || timed_out(c.pair.b()))
        }) {
            factor = factor.max(2.0);
        }
        self.deadline_factor = factor;
        plan
    }

    /// Which rounds are overloaded, given the good nodes.
    fn overloaded(&self, good: &BTreeSet<NodeId>) -> BTreeSet<usize> {
        let mut out = BTreeSet::new();
        for r in 1..=self.rounds {
            let recs: Vec<&Record> = self.history.iter().filter(|x| x.round == r).collect();
            let timed_out = |x: &&&Record| x.outcome == Outcome::TimedOut;
            let timeouts = recs.iter().filter(timed_out).count();
            if timeouts == 0 {
                continue;
            }
            let reference_timed_out = recs
                .iter()
                .filter(timed_out)
                .any(|x| x.role == Role::Reference);
            let between_good = recs
                .iter()
                .filter(timed_out)
                .any(|x| good.contains(&x.check.pair.a()) && good.contains(&x.check.pair.b()));
            let reference_passed = recs
                .iter()
                .any(|x| x.role == Role::Reference && matches!(x.outcome, Outcome::Pass { .. }));
            let none_passed = !recs
                .iter()
                .any(|x| matches!(x.outcome, Outcome::Pass { .. }));
            let most = timeouts >= 2 && timeouts * 3 > recs.len() && !reference_passed;
            if reference_timed_out || between_good || none_passed || most {
                out.insert(r);
            }
        }
        out
    }

    /// Each round's reference (`RoundStats`). With fewer than `OWN_SPREAD_MIN` reference
    /// times the MAD is round 1's relative MAD times the round's median; a round with none is
    /// compared with the latest round before it that has some.
    fn round_stats(&self) -> BTreeMap<usize, RoundStats> {
        let mut out = BTreeMap::new();
        let mut rel_mad = 0.0;
        let mut last: Option<RoundStats> = None;
        for r in 1..=self.rounds {
            let mut t: Vec<f64> = self
                .history
                .iter()
                .filter(|x| x.round == r && Self::is_reference(x))
                .filter_map(|x| pass_time(x.outcome))
                .collect();
            let m = median(&mut t);
            let stats = if m > 0.0 {
                let mad = if t.len() >= OWN_SPREAD_MIN {
                    let mut dev: Vec<f64> = t.iter().map(|x| (x - m).abs()).collect();
                    median(&mut dev)
                } else {
                    rel_mad * m
                };
                if r == 1 && t.len() >= OWN_SPREAD_MIN {
                    rel_mad = mad / m;
                }
                Some(RoundStats { times: t, mad })
            } else {
                last.clone()
            };
            if let Some(s) = stats {
                last = Some(s.clone());
                out.insert(r, s);
            }
        }
        out
    }

    /// Whether a record belongs to its round's reference times.
    fn is_reference(r: &Record) -> bool {
        r.check.exclusive && !matches!(r.role, Role::Remeasure | Role::Relink)
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
        ev.overloaded = self.overloaded(&ev.good);
        let ol = &ev.overloaded;
        let failed_with = |n: NodeId| -> BTreeSet<NodeId> {
            self.history
                .iter()
                .filter(|r| r.check.pair.has(n) && Self::failed(r, ol))
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
                let mine = || self.history.iter().filter(|r| r.check.pair.has(n));
                let timeouts_only = mine().all(|r| r.outcome == Outcome::TimedOut);
                if fw.is_empty() && mine().any(|r| r.outcome == Outcome::TimedOut) {
                    ev.timed_out.insert(n);
                } else if timeouts_only && mine().next().is_some() {
                    ev.timed_out_counted.insert(n);
                }
            }
        }
        for r in &self.history {
            let p = r.check.pair;
            if r.outcome == Outcome::Fail && ev.good.contains(&p.a()) && ev.good.contains(&p.b()) {
                ev.links.insert(p);
            }
        }
        // Stragglers. Each check is judged against its own round (`round_stats`), from
        // exclusive checks only: a node in two checks at once shares its bandwidth. A shared
        // check that was not slow still shows the node is not.
        let stats = self.round_stats();
        let judge = |r: &Record| -> Option<(f64, bool)> {
            let t = pass_time(r.outcome)?;
            let own = Self::is_reference(r).then_some(t);
            // Nothing to compare with (no other check passed): not slow.
            let Some((m, mad)) = stats
                .get(&r.round)
                .and_then(|s| Some((s.median_without(own)?, s.mad)))
            else {
                return Some((1.0, false));
            };
            let slow = t > m * self.cfg.straggler_ratio && t > m + self.cfg.straggler_mads * mad;
            Some((t / m, slow))
        };
        // Per good node: its exclusive checks judged, and whether any shared check of it was
        // normal.
        let mine = |n: NodeId| -> (Judged, bool) {
            let mut excl = Vec::new();
            let mut shared_normal = false;
            for r in self.history.iter().filter(|r| r.check.pair.has(n)) {
                if let Some((ratio, slow)) = judge(r) {
                    if r.check.exclusive {
                        excl.push((r.check.pair.other(n), ratio, slow));
                    } else if !slow {
                        shared_normal = true;
                    }
                }
            }
            (excl, shared_normal)
        };
        for &n in &ev.good {
            let (excl, shared_normal) = mine(n);
            let slow_partners: BTreeSet<NodeId> =
                excl.iter().filter(|x| x.2).map(|x| x.0).collect();
            if slow_partners.len() >= 2 {
                let mut ratios: Vec<f64> = excl.iter().map(|x| x.1).collect();
                ev.stragglers.insert(n, lower_median(&mut ratios));
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
            let has_normal = shared_normal || excl.iter().any(|x| !x.2);
            let slow_ones: Vec<&(NodeId, f64, bool)> = excl.iter().filter(|x| x.2).collect();
            let blamed =
                !slow_ones.is_empty() && slow_ones.iter().all(|x| ev.stragglers.contains_key(&x.0));
            if !has_normal && !blamed {
                ev.slow_suspects.insert(n);
            }
        }
        // Degraded links: pairs with a slow exclusive check whose nodes are both good, neither a
        // straggler, and each normal in a check with another partner. Every exclusive check of
        // the pair slow, at least two: a degraded link; exactly one (and the pair not checked
        // again since, nor voided): measure the pair again.
        let mut by_pair: BTreeMap<Pair, Vec<(f64, bool)>> = BTreeMap::new();
        for r in self.history.iter().filter(|r| r.check.exclusive) {
            if let Some(j) = judge(r) {
                by_pair.entry(r.check.pair).or_default().push(j);
            }
        }
        let normal_elsewhere = |n: NodeId, p: Pair| {
            self.history
                .iter()
                .filter(|r| r.check.pair.has(n) && r.check.pair != p)
                .any(|r| judge(r).is_some_and(|(_, slow)| !slow))
        };
        for (p, judged) in by_pair {
            let (a, b) = (p.a(), p.b());
            if !judged.iter().any(|x| x.1)
                || !ev.good.contains(&a)
                || !ev.good.contains(&b)
                || ev.stragglers.contains_key(&a)
                || ev.stragglers.contains_key(&b)
                || !normal_elsewhere(a, p)
                || !normal_elsewhere(b, p)
            {
                continue;
            }
            if judged.len() >= 2 && judged.iter().all(|x| x.1) {
                let mut ratios: Vec<f64> = judged.iter().map(|x| x.0).collect();
                ev.degraded.insert(p, lower_median(&mut ratios));
            } else if judged.len() == 1
                && !self.voided.contains(&p)
                && self.history.iter().filter(|r| r.check.pair == p).count() == 1
            {
                ev.link_suspects.insert(p);
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
            let why = if ev.timed_out.contains(&n) {
                format!("checks timed out under load ({reason})")
            } else if ev.timed_out_counted.contains(&n) {
                format!("checks timed out, no partner to tell load from a hung node ({reason})")
            } else if ev.good.is_empty() {
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
            degraded_links: ev.degraded,
            unknown,
        }
    }
}

/// A passed check's time, when it is a usable one.
fn pass_time(o: Outcome) -> Option<f64> {
    match o {
        Outcome::Pass { seconds } if seconds.is_finite() && seconds >= 0.0 => Some(seconds),
        _ => None,
    }
}

/// A simulated cluster for tests and the localization benchmark: who is broken, and how checks
/// come out. Every random draw is a hash of (pair, round), so a run is deterministic.
///
/// The noise model (docs/peer-checks.md, "Guarantees"): a check's time is 1 s times the slower
/// member's slowdown, times its link's slowdown (a degraded link), times the round's slowdown
/// (machine load: every check of a round slower by the same factor), times jitter, and one check per round (a check, not a node) is slower
/// again.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Truth {
    pub faulty: BTreeSet<NodeId>,
    pub broken_links: BTreeSet<Pair>,
    /// Node -> slowdown factor (2.0: its checks take twice as long).
    pub slow: BTreeMap<NodeId, f64>,
    /// Degraded link -> slowdown factor of the checks between its two nodes (the nodes are
    /// normal with everyone else).
    pub degraded_links: BTreeMap<Pair, f64>,
    /// Relative jitter on check times (0.05: up to ±5 %).
    pub noise: f64,
    /// Every check of a round is slower by a factor drawn per round from 1 to this (3.0: up to
    /// 3x); 0 or 1: no round slowdowns.
    pub round_slowdown: f64,
    /// One check per round, drawn per round, is slower by a factor drawn from 1 to this, on top
    /// of the rest; 0 or 1: none.
    pub slow_check: f64,
    /// Nodes that hang: their checks time out (no failure reported).
    pub hung: BTreeSet<NodeId>,
    /// A check's deadline in nominal check times (0: none), times the planner's
    /// `deadline_factor`: a check slower than that times out (overload).
    pub deadline: f64,
}

/// A uniform draw in [0, 1) from (a, b, round, salt).
fn unit(a: u64, b: u64, round: u64, salt: u64) -> f64 {
    let h = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add(round)
        .wrapping_add(salt.wrapping_mul(0xD6E8_FEB8_6659_FD93))
        .rotate_left(29)
        .wrapping_mul(0x1656_67B1_9E37_79F9);
    let h = (h ^ (h >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// A factor drawn from [1, max) (1 when max <= 1).
fn up_to(max: f64, u: f64) -> f64 {
    if max > 1.0 {
        1.0 + (max - 1.0) * u
    } else {
        1.0
    }
}

impl Truth {
    /// The outcome of one check of `round`, without the round's single slow check, with the
    /// deadline factor 1.
    pub fn outcome(&self, check: Check, round: usize) -> Outcome {
        self.outcome_with(check, round, 1.0, 1.0)
    }

    fn outcome_with(
        &self,
        check: Check,
        round: usize,
        extra: f64,
        deadline_factor: f64,
    ) -> Outcome {
        let p = check.pair;
        if self.faulty.contains(&p.a())
            || self.faulty.contains(&p.b())
            || self.broken_links.contains(&p)
        {
            return Outcome::Fail;
        }
        if self.hung.contains(&p.a()) || self.hung.contains(&p.b()) {
            return Outcome::TimedOut;
        }
        let slow = |n| self.slow.get(&n).copied().unwrap_or(1.0);
        let r = round as u64;
        let jitter = 1.0 + self.noise * (2.0 * unit(p.a() as u64, p.b() as u64, r, 0) - 1.0);
        let load = up_to(self.round_slowdown, unit(0, 0, r, 1));
        let link = self.degraded_links.get(&p).copied().unwrap_or(1.0);
        let seconds = 1.0 * slow(p.a()).max(slow(p.b())) * link * load * jitter * extra;
        if self.deadline > 0.0 && seconds > self.deadline * deadline_factor {
            return Outcome::TimedOut;
        }
        Outcome::Pass { seconds }
    }

    /// The outcomes of a whole round: `outcome` for each check, one check (drawn per round)
    /// slower by up to `slow_check`, and the deadline times `deadline_factor`.
    pub fn round_outcomes(
        &self,
        checks: &[Check],
        round: usize,
        deadline_factor: f64,
    ) -> Vec<(Pair, Outcome)> {
        let r = round as u64;
        let unlucky = (unit(0, 0, r, 2) * checks.len() as f64) as usize;
        checks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let extra = if i == unlucky {
                    up_to(
                        self.slow_check,
                        unit(c.pair.a() as u64, c.pair.b() as u64, r, 3),
                    )
                } else {
                    1.0
                };
                (c.pair, self.outcome_with(*c, round, extra, deadline_factor))
            })
            .collect()
    }
}

/// Runs a planner against a simulated cluster to the end.
pub fn simulate(order: Vec<NodeId>, truth: &Truth, cfg: PairingConfig) -> (Verdicts, usize, usize) {
    let mut planner = Planner::new(order, cfg);
    while let Some(round) = planner.next_round() {
        let r = planner.rounds();
        let results = truth.round_outcomes(&round, r, planner.deadline_factor());
        planner.record(&results);
    }
    (planner.verdicts(), planner.rounds(), planner.checks())
}

#[cfg(test)]
mod tests;
