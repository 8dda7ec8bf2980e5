//! Localization rounds on the simulator: faultline's pairing against DLRover's two-round rule
//! and against bisection (split the failing group in halves, all halves of a level in one
//! round), for N = 8 ... 4096 with 1, 2 and N/8 faulty nodes placed at random, a broken link, a
//! straggler and a degraded link (a pair 2.5x slower, both nodes normal with others).
//!
//! `cargo bench -p faultline-core --bench peer [-- --trials N] [--noise-model]`;
//! docs/benchmarks.md has the figures. `--noise-model`: faultline's checks under the property
//! tests' noise model (rounds up to 5x slower, one check per round up to 1.6x slower, ±5 %
//! jitter) instead of ±5 % jitter alone; DLRover and bisection read only pass/fail and the
//! slowdowns, so their columns do not change. Pure computation: no processes, no network.

#![allow(clippy::unwrap_used)]
// A benchmark times itself: the purity rules are for the library.
#![allow(clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use faultline_core::peer::pairing::{simulate, NodeId, Pair, PairingConfig, Truth};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick(&mut self, n: usize, k: usize) -> BTreeSet<NodeId> {
        let mut v: Vec<NodeId> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        v.into_iter().take(k).collect()
    }
}

/// A group check (an allgather among the members) fails when any member is faulty or any link
/// among them is broken.
fn group_fails(truth: &Truth, g: &[NodeId]) -> bool {
    g.iter().any(|n| truth.faulty.contains(n))
        || g.iter().enumerate().any(|(i, a)| {
            g[i + 1..]
                .iter()
                .any(|b| truth.broken_links.contains(&Pair::new(*a, *b)))
        })
}

/// The slowest degraded link among a group's members (1 when none): an allgather runs at the
/// pace of its slowest path.
fn group_link_slowdown(truth: &Truth, g: &[NodeId]) -> f64 {
    truth
        .degraded_links
        .iter()
        .filter(|(p, _)| g.contains(&p.a()) && g.contains(&p.b()))
        .map(|(_, f)| *f)
        .fold(1.0, f64::max)
}

/// What a method reports.
#[derive(Default, PartialEq)]
struct Found {
    faulty: BTreeSet<NodeId>,
    links: BTreeSet<Pair>,
    stragglers: BTreeSet<NodeId>,
    degraded: BTreeSet<Pair>,
}

/// DLRover's rule (FACTS.md section 2): round 0 consecutive pairs (an odd node joins the last
/// pair); round 1 only when round 0 shows a failure or a straggler, pairing fastest with
/// slowest (failures count as 3600 s); faulty = failed in both rounds; straggler = slower than
/// twice the median in both rounds. It has no notion of a link. Returns (found, rounds, checks).
fn dlrover(n: usize, truth: &Truth) -> (Found, usize, usize) {
    let groups = |order: &[NodeId]| -> Vec<Vec<NodeId>> {
        let mut gs: Vec<Vec<NodeId>> = order.chunks(2).map(|c| c.to_vec()).collect();
        if order.len() % 2 == 1 && gs.len() >= 2 {
            let last = gs.pop().unwrap();
            gs.last_mut().unwrap().extend(last);
        }
        gs
    };
    let run = |gs: &[Vec<NodeId>]| -> Vec<f64> {
        let mut t = vec![0.0; n];
        for g in gs {
            let slow = g
                .iter()
                .map(|m| truth.slow.get(m).copied().unwrap_or(1.0))
                .fold(1.0, f64::max)
                * group_link_slowdown(truth, g);
            let secs = if group_fails(truth, g) { 3600.0 } else { slow };
            for &m in g {
                t[m] = secs;
            }
        }
        t
    };
    let slow_in = |t: &[f64]| -> BTreeSet<NodeId> {
        let mut v: Vec<f64> = t.iter().copied().filter(|x| *x < 3600.0).collect();
        v.sort_by(f64::total_cmp);
        let m = v.get(v.len() / 2).copied().unwrap_or(1.0);
        (0..n)
            .filter(|&i| t[i] < 3600.0 && t[i] > 2.0 * m)
            .collect()
    };
    let order: Vec<NodeId> = (0..n).collect();
    let g0 = groups(&order);
    let t0 = run(&g0);
    let failed0: BTreeSet<NodeId> = (0..n).filter(|&i| t0[i] >= 3600.0).collect();
    let slow0 = slow_in(&t0);
    if failed0.is_empty() && slow0.is_empty() {
        return (Found::default(), 1, g0.len());
    }
    let mut by_time: Vec<NodeId> = (0..n).collect();
    by_time.sort_by(|a, b| t0[*a].total_cmp(&t0[*b]).then(a.cmp(b)));
    let mut paired = Vec::with_capacity(n);
    let (mut i, mut j) = (0, n - 1);
    while i < j {
        paired.push(by_time[i]);
        paired.push(by_time[j]);
        i += 1;
        j -= 1;
    }
    if i == j {
        paired.push(by_time[i]);
    }
    let g1 = groups(&paired);
    let t1 = run(&g1);
    let slow1 = slow_in(&t1);
    let found = Found {
        faulty: failed0.into_iter().filter(|&x| t1[x] >= 3600.0).collect(),
        links: BTreeSet::new(),
        stragglers: slow0.intersection(&slow1).copied().collect(),
        degraded: BTreeSet::new(),
    };
    (found, 2, g0.len() + g1.len())
}

/// Bisection: test the whole set; split every failing group in halves and test the halves,
/// all in one round per level. It sees pass or fail only (no stragglers, no links). Returns
/// (found, rounds, checks).
fn bisection(n: usize, truth: &Truth) -> (Found, usize, usize) {
    let mut groups = vec![(0..n).collect::<Vec<_>>()];
    let (mut rounds, mut checks) = (0, 0);
    let mut found = BTreeSet::new();
    while !groups.is_empty() {
        rounds += 1;
        let mut next = Vec::new();
        for g in groups {
            checks += 1;
            if group_fails(truth, &g) {
                if g.len() == 1 {
                    found.insert(g[0]);
                } else {
                    let (a, b) = g.split_at(g.len() / 2);
                    next.push(a.to_vec());
                    next.push(b.to_vec());
                }
            }
        }
        groups = next;
    }
    let found = Found {
        faulty: found,
        ..Found::default()
    };
    (found, rounds, checks)
}

#[derive(Default)]
struct Tally {
    rounds: Vec<usize>,
    checks: usize,
    exact: usize,
}

impl Tally {
    fn add(&mut self, rounds: usize, checks: usize, exact: bool) {
        self.rounds.push(rounds);
        self.checks += checks;
        self.exact += usize::from(exact);
    }
    fn show(&self) -> String {
        let t = self.rounds.len().max(1);
        let mean = self.rounds.iter().sum::<usize>() as f64 / t as f64;
        let max = self.rounds.iter().max().copied().unwrap_or(0);
        format!(
            "{mean:.1} / {max} | {} | {}/{}",
            self.checks / t,
            self.exact,
            self.rounds.len()
        )
    }
}

/// A scenario: its name and a cluster of `n` nodes.
fn scenarios(n: usize, rng: &mut Rng) -> Vec<(String, Truth)> {
    let mut ks = vec![1, 2, n / 8];
    ks.sort_unstable();
    ks.dedup();
    let mut out: Vec<(String, Truth)> = ks
        .into_iter()
        .map(|k| {
            let t = Truth {
                faulty: rng.pick(n, k),
                noise: 0.05,
                ..Truth::default()
            };
            (format!("{k} faulty"), t)
        })
        .collect();
    let two: Vec<NodeId> = rng.pick(n, 3).into_iter().collect();
    // A link the run exercises: between two round-1 neighbours (a link no check uses is found
    // only by a later run, whose rotated order pairs other neighbours).
    let first = (rng.next() as usize % (n / 2)) * 2;
    let link = Pair::new(first, first + 1);
    let two: Vec<NodeId> = two.into_iter().filter(|x| !link.has(*x)).collect();
    out.push((
        "1 broken link".into(),
        Truth {
            broken_links: BTreeSet::from([link]),
            noise: 0.05,
            ..Truth::default()
        },
    ));
    out.push((
        "1 faulty + 1 broken link".into(),
        Truth {
            faulty: BTreeSet::from([two[0]]),
            broken_links: BTreeSet::from([link]),
            noise: 0.05,
            ..Truth::default()
        },
    ));
    out.push((
        "1 straggler (3x)".into(),
        Truth {
            slow: BTreeMap::from([(two[0], 3.0)]),
            noise: 0.05,
            ..Truth::default()
        },
    ));
    // Issue 28's measured case: one pair 2.5x slower than every other, both nodes normal with
    // other partners; between round-1 neighbours like the broken link.
    out.push((
        "1 degraded link (2.5x)".into(),
        Truth {
            degraded_links: BTreeMap::from([(link, 2.5)]),
            noise: 0.05,
            ..Truth::default()
        },
    ));
    out
}

fn exact(found: &Found, truth: &Truth) -> bool {
    found.faulty == truth.faulty
        && found.links == truth.broken_links
        && found.stragglers == truth.slow.keys().copied().collect()
        && found.degraded == truth.degraded_links.keys().copied().collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let noise_model = args.iter().any(|a| a == "--noise-model");
    let trials: usize = args
        .iter()
        .position(|a| a == "--trials")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    println!("| N | scenario | faultline rounds mean / max | checks | exact | DLRover rounds mean / max | checks | exact | bisection rounds mean / max | checks | exact | faultline planning per run |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let mut n = 8;
    while n <= 4096 {
        let names: Vec<String> = scenarios(n, &mut rng).into_iter().map(|s| s.0).collect();
        for (i, name) in names.iter().enumerate() {
            let (mut ours, mut dl, mut bis) =
                (Tally::default(), Tally::default(), Tally::default());
            let mut planning = std::time::Duration::ZERO;
            for _ in 0..trials {
                let mut truth = scenarios(n, &mut rng).swap_remove(i).1;
                if noise_model {
                    truth.round_slowdown = 5.0;
                    truth.slow_check = 1.6;
                }
                let t0 = Instant::now();
                let (v, r, c) = simulate((0..n).collect(), &truth, PairingConfig::default());
                planning += t0.elapsed();
                let found = Found {
                    faulty: v.faulty.clone(),
                    links: v.broken_links.clone(),
                    stragglers: v.stragglers.keys().copied().collect(),
                    degraded: v.degraded_links.keys().copied().collect(),
                };
                ours.add(r, c, exact(&found, &truth) && v.unknown.is_empty());
                let (f, r, c) = dlrover(n, &truth);
                dl.add(r, c, exact(&f, &truth));
                let (f, r, c) = bisection(n, &truth);
                bis.add(r, c, exact(&f, &truth));
            }
            println!(
                "| {n} | {name} | {} | {} | {} | {:.2} ms |",
                ours.show(),
                dl.show(),
                bis.show(),
                planning.as_secs_f64() * 1000.0 / trials as f64
            );
        }
        n *= 2;
    }
}
