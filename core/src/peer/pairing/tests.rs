//! Table tests and the property tests that hold the pairing guarantees over thousands of
//! random clusters.

use super::*;
use proptest::prelude::*;

fn run(n: usize, truth: &Truth) -> (Verdicts, usize, usize) {
    simulate((0..n).collect(), truth, PairingConfig::default())
}

fn faulty(nodes: &[NodeId]) -> Truth {
    Truth {
        faulty: nodes.iter().copied().collect(),
        noise: 0.05,
        ..Truth::default()
    }
}

/// The noise model of the property tests (docs/peer-checks.md): jitter, whole rounds up to
/// `LOAD`x slower, and one check per round up to `SLOW_CHECK`x slower than that.
const LOAD: f64 = 5.0;
/// On top of ±5-10 % jitter that is up to 1.76x-1.96x the round's other checks: about the
/// measured p99 of a single check at 64 MiB under load (1.82x, at most 1.94x), and above the
/// issue's 1.59x: docs/peer-checks.md, "Noise".
const SLOW_CHECK: f64 = 1.6;

fn noisy(t: Truth) -> Truth {
    Truth {
        noise: 0.05,
        round_slowdown: LOAD,
        slow_check: SLOW_CHECK,
        ..t
    }
}

/// Runs a planner by hand: `time(round, pair)` gives each check's outcome.
fn drive(n: usize, cfg: PairingConfig, time: impl Fn(usize, Pair) -> Outcome) -> (Verdicts, usize) {
    let mut p = Planner::new((0..n).collect(), cfg);
    while let Some(round) = p.next_round() {
        let r = p.rounds();
        let results: Vec<(Pair, Outcome)> =
            round.iter().map(|c| (c.pair, time(r, c.pair))).collect();
        p.record(&results);
    }
    (p.verdicts(), p.rounds())
}

/// A small deterministic jitter (±2 %) per pair and round.
fn wobble(r: usize, p: Pair) -> f64 {
    1.0 + 0.02 * (((p.a() * 7 + p.b() * 13 + r * 5) % 5) as f64 - 2.0) / 2.0
}

#[test]
fn later_rounds_are_judged_against_their_own_round() {
    // Issue 12 §4: one faulty node took 3 rounds. Round 1 runs 4 checks at once, round 2 fewer,
    // and round 2 ran 2.5x slower (or 2.5x faster) as a whole. Its checks are compared with
    // round 2, not with a median over both rounds, so the faulty node's partner is cleared in
    // round 2.
    for load in [2.5, 0.4] {
        let (v, rounds) = drive(8, PairingConfig::default(), |r, p| {
            if p.has(5) {
                Outcome::Fail
            } else {
                let l = if r == 1 { 1.0 } else { load };
                Outcome::Pass {
                    seconds: l * wobble(r, p),
                }
            }
        });
        assert_eq!(v.faulty, BTreeSet::from([5]), "{load}: {v:?}");
        assert!(
            v.broken_links.is_empty() && v.stragglers.is_empty() && v.unknown.is_empty(),
            "{load}: {v:?}"
        );
        assert_eq!(rounds, 2, "{load}");
    }
}

#[test]
fn one_slow_check_then_a_slower_round_is_no_straggler() {
    // Issue 12 §4: a false straggler at 1.59x. Round 1: the check {0, 1} alone takes 1.59x the
    // others (noise: a check, not a node). Round 2 re-measures 0 and 1, and the whole round
    // runs 1.6x slower (load). Against a median over both rounds 0 and 1 were slow twice, with
    // two partners each; against their own rounds they are not.
    let time = |r: usize, p: Pair| {
        let t = if r == 1 && p == Pair::new(0, 1) {
            1.59
        } else if r == 1 {
            1.0
        } else {
            1.6
        };
        Outcome::Pass {
            seconds: t * wobble(r, p),
        }
    };
    // At the old ratio 1.5 the first check is slow: 0 and 1 are measured again with other
    // partners (round 2), then the pair itself (round 3: a degraded link if slow again) ...
    let old = PairingConfig {
        straggler_ratio: 1.5,
        ..PairingConfig::default()
    };
    let (v, rounds) = drive(12, old, time);
    assert!(v.is_clean(), "{v:?}");
    assert_eq!(rounds, 3);
    // ... at the default (chosen from measured noise) 1.59x is not slow at all.
    let (v, rounds) = drive(12, PairingConfig::default(), time);
    assert!(v.is_clean(), "{v:?}");
    assert_eq!(rounds, 1);
}

#[test]
fn the_noise_model_is_deterministic_and_bounded() {
    let t = noisy(Truth::default());
    let checks: Vec<Check> = (0..20)
        .map(|i| Check {
            pair: Pair::new(2 * i, 2 * i + 1),
            exclusive: true,
        })
        .collect();
    for round in 1..50 {
        let a = t.round_outcomes(&checks, round, 1.0);
        assert_eq!(a, t.round_outcomes(&checks, round, 1.0));
        let secs: Vec<f64> = a
            .iter()
            .map(|(_, o)| match o {
                Outcome::Pass { seconds } => *seconds,
                other => panic!("{other:?}"),
            })
            .collect();
        let lo = secs.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = secs.iter().copied().fold(0.0, f64::max);
        assert!(lo >= 0.95 && hi < LOAD * SLOW_CHECK * 1.05, "{secs:?}");
        // At most one check stands out from the jitter.
        let over = secs.iter().filter(|s| **s > lo * 1.11).count();
        assert!(over <= 1, "round {round}: {secs:?}");
    }
}

#[test]
fn healthy_cluster_is_one_round_without_verdicts() {
    for n in [2, 3, 4, 5, 8, 9, 64] {
        let (v, rounds, checks) = run(
            n,
            &Truth {
                noise: 0.05,
                ..Truth::default()
            },
        );
        assert!(v.is_clean(), "{n}: {v:?}");
        assert_eq!(rounds, 1, "{n}");
        assert_eq!(checks, n.div_ceil(2), "{n}");
    }
}

#[test]
fn first_round_pairs_neighbours_and_the_odd_one_with_the_first() {
    let mut p = Planner::new(vec![4, 2, 0, 1, 3], PairingConfig::default());
    let r1 = p.next_round().unwrap();
    let pairs: Vec<(Pair, bool)> = r1.iter().map(|c| (c.pair, c.exclusive)).collect();
    assert_eq!(
        pairs,
        [
            (Pair::new(4, 2), false),
            (Pair::new(0, 1), true),
            (Pair::new(3, 4), false),
        ]
    );
    // Asking again before recording gives the same round.
    assert_eq!(p.next_round().unwrap(), r1);
}

#[test]
fn dlrover_example_six_nodes_node_six_faulty() {
    // FACTS.md: 6 nodes, round 0 [{1,2},{3,4},{5,6}], {5,6} fails; node 6 is faulty.
    // Here nodes 0..5 stand for 1..6.
    let (v, rounds, _) = run(6, &faulty(&[5]));
    assert_eq!(v.faulty, BTreeSet::from([5]));
    assert!(v.broken_links.is_empty() && v.unknown.is_empty());
    assert_eq!(rounds, 2);
}

#[test]
fn a_broken_link_is_a_link() {
    let truth = Truth {
        broken_links: BTreeSet::from([Pair::new(2, 3)]),
        ..Truth::default()
    };
    let (v, rounds, _) = run(8, &truth);
    assert_eq!(v.broken_links, BTreeSet::from([Pair::new(2, 3)]));
    assert!(v.faulty.is_empty() && v.unknown.is_empty(), "{v:?}");
    assert_eq!(rounds, 2);
}

#[test]
fn a_straggler_is_found_with_its_slowdown() {
    let truth = Truth {
        slow: BTreeMap::from([(6, 3.0)]),
        noise: 0.05,
        ..Truth::default()
    };
    let (v, rounds, _) = run(8, &truth);
    assert!(
        v.faulty.is_empty() && v.broken_links.is_empty() && v.unknown.is_empty(),
        "{v:?}"
    );
    let ratio = v.stragglers[&6];
    assert!((2.7..3.3).contains(&ratio), "{ratio}");
    assert_eq!(v.stragglers.len(), 1);
    assert_eq!(rounds, 2);
}

/// Issue 28: a link flapping every 300 ms made one pair run 2.5x slower than every other pair
/// while both nodes were normal with other partners, and the run gave no verdict at all (the
/// two nodes were re-measured with normal partners, cleared, and the slow pair forgotten). Now
/// the pair is measured again and named a degraded link, in 3 rounds, blaming neither node;
/// also when the link is the first pair of round 1 (0-1).
#[test]
fn a_pair_slow_in_every_round_is_a_degraded_link() {
    for (n, link) in [
        (8, Pair::new(2, 3)),
        (8, Pair::new(0, 1)),
        (12, Pair::new(6, 7)),
    ] {
        let (v, rounds) = drive(n, PairingConfig::default(), |r, p| {
            let slow = if p == link { 2.5 } else { 1.0 };
            Outcome::Pass {
                seconds: slow * wobble(r, p),
            }
        });
        assert_eq!(
            v.degraded_links.keys().copied().collect::<Vec<_>>(),
            [link],
            "{n} {link:?}: {v:?}"
        );
        let ratio = v.degraded_links[&link];
        assert!((2.3..2.7).contains(&ratio), "{ratio}");
        assert!(
            v.faulty.is_empty()
                && v.stragglers.is_empty()
                && v.broken_links.is_empty()
                && v.unknown.is_empty(),
            "{v:?}"
        );
        assert_eq!(rounds, 3, "{n} {link:?}");
    }
    // The same on the simulator, with its noise model (whole rounds up to 5x slower, one check
    // per round up to 1.6x).
    let truth = noisy(Truth {
        degraded_links: BTreeMap::from([(Pair::new(4, 5), 2.5)]),
        ..Truth::default()
    });
    let (v, rounds, _) = run(12, &truth);
    assert_eq!(
        v.degraded_links.keys().copied().collect::<Vec<_>>(),
        [Pair::new(4, 5)],
        "{v:?}"
    );
    assert!(v.stragglers.is_empty() && v.faulty.is_empty() && v.unknown.is_empty());
    assert_eq!(rounds, 3);
}

/// One slow check of a pair is noise until the pair is slow again: a pair 2.5x slow in round 1
/// and normal when re-measured gets nothing, and neither node is blamed.
#[test]
fn a_pair_slow_once_and_normal_again_is_nothing() {
    let link = Pair::new(2, 3);
    let (v, rounds) = drive(8, PairingConfig::default(), |r, p| {
        let slow = if p == link && r == 1 { 2.5 } else { 1.0 };
        Outcome::Pass {
            seconds: slow * wobble(r, p),
        }
    });
    assert!(v.is_clean(), "{v:?}");
    assert_eq!(
        rounds, 3,
        "round 2 clears both nodes, round 3 re-measures the pair"
    );
}

/// A node slow with every partner is a straggler, not the end of a degraded link: its
/// round-1 partner is cleared by its normal check elsewhere, and the pair is not re-measured.
#[test]
fn a_straggler_is_not_a_degraded_link() {
    for slowdown in [2.5, 4.0] {
        let (v, rounds) = drive(8, PairingConfig::default(), |r, p| {
            let slow = if p.has(2) { slowdown } else { 1.0 };
            Outcome::Pass {
                seconds: slow * wobble(r, p),
            }
        });
        assert_eq!(
            v.stragglers.keys().copied().collect::<Vec<_>>(),
            [2],
            "{v:?}"
        );
        assert!(
            v.degraded_links.is_empty() && v.faulty.is_empty() && v.unknown.is_empty(),
            "{v:?}"
        );
        assert_eq!(rounds, 2);
    }
}

/// An unjudged check (the coordinator could not assign it, a report was lost) is no evidence:
/// its nodes are checked again in the next round, and nobody is blamed for it.
#[test]
fn an_unjudged_check_is_run_again_and_blames_nobody() {
    let mut p = Planner::new((0..4).collect(), PairingConfig::default());
    let r1 = p.next_round().unwrap();
    assert_eq!(r1.len(), 2);
    let pass = Outcome::Pass { seconds: 1.0 };
    p.record(&[(r1[0].pair, Outcome::Void), (r1[1].pair, pass)]);
    assert_eq!(p.checks(), 1, "the unjudged check is not in the history");
    let r2 = p.next_round().unwrap();
    let again: BTreeSet<NodeId> = r2.iter().flat_map(|c| [c.pair.a(), c.pair.b()]).collect();
    assert!(again.contains(&0) && again.contains(&1), "{r2:?}");
    let results: Vec<(Pair, Outcome)> = r2.iter().map(|c| (c.pair, pass)).collect();
    p.record(&results);
    assert!(p.next_round().is_none());
    assert!(p.verdicts().is_clean(), "{:?}", p.verdicts());
}

#[test]
fn too_few_nodes_or_no_healthy_partner_is_unknown_with_the_reason() {
    let (v, _, _) = run(2, &faulty(&[1]));
    assert_eq!(v.unknown.len(), 2, "{v:?}");
    assert!(
        v.unknown[&0].contains("no node passed"),
        "{}",
        v.unknown[&0]
    );
    let (v, _, _) = run(1, &Truth::default());
    assert_eq!(v.unknown.keys().copied().collect::<Vec<_>>(), [0]);
    // Everyone faulty: nothing can be told apart.
    let (v, _, _) = run(6, &faulty(&[0, 1, 2, 3, 4, 5]));
    assert!(v.faulty.is_empty());
    assert_eq!(v.unknown.len(), 6);
}

#[test]
fn missing_results_count_as_timeouts() {
    let mut p = Planner::new((0..4).collect(), PairingConfig::default());
    let r1 = p.next_round().unwrap();
    // Only the first pair reported: the other is a timeout, isolated (one of two checks), so
    // it counts against its nodes.
    p.record(&[(r1[0].pair, Outcome::Pass { seconds: 1.0 })]);
    let r2 = p.next_round().unwrap();
    assert_eq!(
        r2.len(),
        2,
        "both members of the silent pair are checked again: {r2:?}"
    );
    // ... with twice the deadline: one slow check that ran past it passes then.
    assert_eq!(p.deadline_factor(), 2.0);
}

/// Runs a planner by hand with `outcome(round, pair)`; returns the verdicts and each round's
/// deadline factor.
fn drive_timed(n: usize, outcome: impl Fn(usize, Pair) -> Outcome) -> (Verdicts, Vec<f64>) {
    let mut p = Planner::new((0..n).collect(), PairingConfig::default());
    let mut factors = Vec::new();
    while let Some(round) = p.next_round() {
        factors.push(p.deadline_factor());
        let r = p.rounds();
        let results: Vec<(Pair, Outcome)> =
            round.iter().map(|c| (c.pair, outcome(r, c.pair))).collect();
        p.record(&results);
    }
    (p.verdicts(), factors)
}

fn pass(r: usize, p: Pair) -> Outcome {
    Outcome::Pass {
        seconds: wobble(r, p),
    }
}

/// Overload, table: (name, nodes, which checks time out (round, pair), what must come out).
/// Each row is run twice: with the timeouts as `TimedOut`, and with them as hard failures
/// (`Fail`, all the old planner had for a check whose deadline passed) for contrast.
#[test]
fn timeouts_under_load_are_retried_not_blamed() {
    struct Row {
        name: &'static str,
        n: usize,
        timed_out: fn(usize, Pair) -> bool,
        faulty: &'static [NodeId],
        factors: &'static [f64],
        unknown: usize,
        /// With hard failures instead: (faulty nodes, broken links) named.
        as_failures: (usize, usize),
    }
    // A cheap hash of (round, pair) for "random" timeouts.
    fn h(r: usize, p: Pair) -> usize {
        (p.a() * 31 + p.b() * 17 + r * 7) % 5
    }
    let rows = [
        Row {
            // A hung node: its check is the only one of round 1 to time out, then again in
            // round 2 while the reference checks pass. Found in 2 rounds.
            name: "isolated timeout, hung node 5",
            n: 8,
            timed_out: |_, p| p.has(5),
            faulty: &[5],
            factors: &[1.0, 2.0],
            unknown: 0,
            as_failures: (1, 0),
        },
        Row {
            // Three of six checks of round 1 time out (more than a third): overload. Their
            // nodes are checked again with twice the deadline, and pass.
            name: "half of round 1 times out, then passes",
            n: 12,
            timed_out: |r, p| r == 1 && p.a() < 6,
            faulty: &[],
            factors: &[1.0, 2.0],
            unknown: 0,
            as_failures: (0, 3),
        },
        Row {
            // One check between two nodes that pass elsewhere times out: not a broken link
            // (links are named from reported failures), the round counts as overloaded.
            name: "one timeout between good nodes",
            n: 8,
            timed_out: |r, p| r == 1 && p == Pair::new(2, 3),
            faulty: &[],
            factors: &[1.0, 2.0],
            unknown: 0,
            as_failures: (0, 1),
        },
        Row {
            // Everything times out, round after round: three overloaded rounds with the deadline
            // doubled twice, then every node is unknown, none faulty.
            name: "every check times out",
            n: 12,
            timed_out: |_, _| true,
            faulty: &[],
            factors: &[1.0, 2.0, 4.0],
            unknown: 12,
            as_failures: (0, 0),
        },
        Row {
            // Issue 12 §2: a healthy 12-node cluster under heavy CPU load, two checks in five
            // timing out in every round, was named with faulty nodes and broken links.
            name: "two in five time out in every round",
            n: 12,
            timed_out: |r, p| h(r, p) < 2,
            faulty: &[],
            // Round 1 (2 of 6 timed out) looked like isolated timeouts until round 2 showed
            // those nodes pass elsewhere: round 2 doubles the deadline for the re-checks, round
            // 3 for one overloaded round known by then (4x after round 3 would come next).
            factors: &[1.0, 2.0, 2.0],
            unknown: 1,
            as_failures: (2, 1),
        },
    ];
    for row in &rows {
        let (v, factors) = drive_timed(row.n, |r, p| {
            if (row.timed_out)(r, p) {
                Outcome::TimedOut
            } else {
                pass(r, p)
            }
        });
        let name = row.name;
        assert_eq!(
            v.faulty,
            row.faulty.iter().copied().collect(),
            "{name}: {v:?}"
        );
        assert!(
            v.broken_links.is_empty() && v.stragglers.is_empty(),
            "{name}: {v:?}"
        );
        assert_eq!(v.unknown.len(), row.unknown, "{name}: {v:?}");
        for why in v.unknown.values() {
            assert!(why.contains("timed out under load"), "{name}: {why}");
        }
        assert_eq!(factors, row.factors, "{name}");
        let (hard, _) = drive_timed(row.n, |r, p| {
            if (row.timed_out)(r, p) {
                Outcome::Fail
            } else {
                pass(r, p)
            }
        });
        assert_eq!(
            (hard.faulty.len(), hard.broken_links.len()),
            row.as_failures,
            "{name} as hard failures: {hard:?}"
        );
    }
}

#[test]
fn neighbour_order_groups_by_topology_and_rotates() {
    let m = |n: &str, t: Option<&str>| (n.to_string(), t.map(str::to_string));
    let members = [
        m("d", Some("rack-2")),
        m("a", Some("rack-1")),
        m("c", None),
        m("b", Some("rack-1")),
        m("e", Some("rack-2")),
    ];
    assert_eq!(neighbour_order(&members, 0), [1, 3, 0, 4, 2]);
    assert_eq!(neighbour_order(&members, 1), [3, 0, 4, 2, 1]);
    assert_eq!(neighbour_order(&members, 6), [3, 0, 4, 2, 1]);
    assert!(neighbour_order(&[], 3).is_empty());
}

/// A random order of `n` nodes (the round-1 order does not matter to the guarantees).
fn shuffled(n: usize, seed: u64) -> Vec<NodeId> {
    let mut v: Vec<NodeId> = (0..n).collect();
    let mut s = seed | 1;
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

fn pick(n: usize, k: usize, seed: u64) -> BTreeSet<NodeId> {
    shuffled(n, seed.wrapping_mul(31).wrapping_add(7))
        .into_iter()
        .take(k)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// A single faulty node among N >= 3 is found in at most 2 rounds, and nothing else is
    /// blamed.
    #[test]
    fn single_faulty_node_in_two_rounds(n in 3usize..300, f in any::<prop::sample::Index>(), seed in any::<u64>()) {
        let f = f.index(n);
        let truth = noisy(faulty(&[f]));
        let (v, rounds, _) = simulate(shuffled(n, seed), &truth, PairingConfig::default());
        prop_assert_eq!(&v.faulty, &BTreeSet::from([f]));
        prop_assert!(v.broken_links.is_empty() && v.stragglers.is_empty() && v.degraded_links.is_empty() && v.unknown.is_empty(), "{:?}", v);
        prop_assert!(rounds <= 2, "{} rounds", rounds);
    }

    /// k faulty nodes, k <= N/4, are all found, and only they, in at most 3 rounds.
    #[test]
    fn k_faulty_nodes_in_three_rounds(n in 4usize..400, k in 1usize..100, seed in any::<u64>()) {
        let k = k.min(n / 4).max(1);
        let truth = noisy(Truth { faulty: pick(n, k, seed), ..Truth::default() });
        let (v, rounds, _) = simulate(shuffled(n, seed), &truth, PairingConfig::default());
        prop_assert_eq!(&v.faulty, &truth.faulty);
        prop_assert!(v.broken_links.is_empty() && v.degraded_links.is_empty() && v.unknown.is_empty(), "{:?}", v);
        prop_assert!(rounds <= 3, "{} rounds for {} of {}", rounds, k, n);
    }

    /// Broken links between healthy nodes (at most one per node) are found as links and never
    /// blamed on a node, also next to faulty nodes.
    #[test]
    fn broken_links_are_never_blamed_on_a_node(n in 4usize..200, links in 1usize..8, k in 0usize..4, seed in any::<u64>()) {
        let order = shuffled(n, seed);
        let k = k.min(n / 8);
        let bad = pick(n, k, seed ^ 0xABCD);
        // Disjoint links among healthy nodes.
        let healthy: Vec<NodeId> = shuffled(n, seed ^ 0x5555).into_iter().filter(|x| !bad.contains(x)).collect();
        let links: BTreeSet<Pair> = healthy.chunks(2).filter(|c| c.len() == 2).take(links.min(n / 4)).map(|c| Pair::new(c[0], c[1])).collect();
        let truth = noisy(Truth { faulty: bad.clone(), broken_links: links.clone(), ..Truth::default() });
        let (v, _, _) = simulate(order, &truth, PairingConfig::default());
        // Soundness: no healthy node is called faulty, no link is called anything else.
        prop_assert!(v.faulty.is_subset(&bad), "{:?} vs {:?}", v.faulty, bad);
        prop_assert!(v.broken_links.is_subset(&links), "{:?} vs {:?}", v.broken_links, links);
        for l in &links {
            prop_assert!(!v.faulty.contains(&l.a()) && !v.faulty.contains(&l.b()));
        }
        // Completeness where there are enough healthy partners: every link that was checked is
        // found, every faulty node is found.
        prop_assert_eq!(&v.faulty, &bad);
        prop_assert!(v.unknown.is_empty(), "{:?}", v.unknown);
    }

    /// A healthy cluster with noisy times finishes in one round with no verdicts.
    #[test]
    fn healthy_clusters_finish_in_one_round(n in 2usize..500, noise in 0.0f64..0.2) {
        let (v, rounds, _) = run(n, &Truth { noise, round_slowdown: LOAD, ..Truth::default() });
        prop_assert!(v.is_clean(), "{:?}", v);
        prop_assert_eq!(rounds, 1);
    }

    /// ... also when one check of the round is up to 1.6x slower on top of up to ±10 % jitter
    /// (the issue: a healthy 12-node cluster took 2 rounds).
    #[test]
    fn healthy_clusters_with_a_slow_check_finish_in_one_round(n in 2usize..500, noise in 0.0f64..0.1, slow_check in 1.0f64..SLOW_CHECK) {
        let (v, rounds, _) = run(n, &Truth { noise, round_slowdown: LOAD, slow_check, ..Truth::default() });
        prop_assert!(v.is_clean(), "{:?}", v);
        prop_assert_eq!(rounds, 1);
    }

    /// Hung nodes (at most N/8; their checks time out, nothing is reported) are found as
    /// faulty, under the noise model, and nothing else is blamed.
    #[test]
    fn hung_nodes_are_found(n in 8usize..300, k in 1usize..40, seed in any::<u64>()) {
        let k = k.min(n / 8);
        let truth = noisy(Truth { hung: pick(n, k, seed), ..Truth::default() });
        let (v, rounds, _) = simulate(shuffled(n, seed), &truth, PairingConfig::default());
        prop_assert_eq!(&v.faulty, &truth.hung);
        prop_assert!(v.broken_links.is_empty() && v.stragglers.is_empty() && v.degraded_links.is_empty() && v.unknown.is_empty(), "{:?}", v);
        prop_assert!(rounds <= 3, "{} rounds for {} of {}", rounds, k, n);
    }

    /// A healthy cluster under overload (rounds up to 8x slower, deadline 2x to 4x a normal
    /// check, so whole rounds and parts of rounds time out) names no faulty node, no broken
    /// link and no straggler; nodes it cannot tell are unknown because of timeouts.
    #[test]
    fn overload_blames_nobody(n in 2usize..200, load in 1.0f64..8.0, deadline in 2.0f64..4.0, seed in any::<u64>()) {
        let truth = Truth { noise: 0.1, round_slowdown: load, slow_check: SLOW_CHECK, deadline, ..Truth::default() };
        let (v, rounds, _) = simulate(shuffled(n, seed), &truth, PairingConfig::default());
        prop_assert!(v.faulty.is_empty() && v.broken_links.is_empty() && v.stragglers.is_empty() && v.degraded_links.is_empty(), "{:?}", v);
        for why in v.unknown.values() {
            prop_assert!(why.contains("timed out"), "{}", why);
        }
        prop_assert!(rounds <= 6);
    }

    /// One degraded link (2.25x to 10x slower, between round-1 neighbours: a link the run
    /// exercises) among N >= 10 nodes under the noise model is found, exactly, with about its
    /// slowdown, in at most 3 rounds, and nobody is blamed for it. (Below 10, round 1 has 2 to
    /// 4 exclusive checks, and the model's one slow check of the round, up to 1.6x, can lift
    /// the pair's reference or the round's MAD above it: at N = 6, 7 and 9 some placements go
    /// unnamed, as stragglers would.)
    #[test]
    fn a_degraded_link_is_found_and_blames_nobody(n in 10usize..300, at in any::<prop::sample::Index>(), factor in 2.25f64..10.0, seed in any::<u64>()) {
        let order = shuffled(n, seed);
        // An exclusive round-1 pair: with an odd count the first pair shares its first node.
        let first_exclusive = usize::from(n % 2 == 1);
        let i = first_exclusive + at.index(n / 2 - first_exclusive);
        let link = Pair::new(order[2 * i], order[2 * i + 1]);
        let truth = noisy(Truth { degraded_links: BTreeMap::from([(link, factor)]), ..Truth::default() });
        let (v, rounds, _) = simulate(order, &truth, PairingConfig::default());
        prop_assert_eq!(v.degraded_links.keys().copied().collect::<Vec<_>>(), vec![link], "{:?}", v);
        let r = v.degraded_links[&link];
        prop_assert!(r / factor > 0.88 && r / factor < 1.12 * SLOW_CHECK, "ratio {} for {}x", r, factor);
        prop_assert!(v.faulty.is_empty() && v.broken_links.is_empty() && v.stragglers.is_empty() && v.unknown.is_empty(), "{:?}", v);
        prop_assert!(rounds <= 3, "{} rounds", rounds);
    }

    /// Stragglers (at most N/8, slowed 2.25x to 10x) among N >= 10 nodes are found with about
    /// their slowdown, and no normal node is called one. (Below 10, as for a degraded link, the
    /// model's one slow check of a round can lift the round's reference or MAD above a 2.25x
    /// straggler: at N = 9 a placement went unnamed, seed 5475254523050004158.)
    #[test]
    fn stragglers_are_found(n in 10usize..200, k in 1usize..6, factor in 2.25f64..10.0, seed in any::<u64>()) {
        let k = k.min(n / 8);
        let slow: BTreeMap<NodeId, f64> = pick(n, k, seed).into_iter().map(|x| (x, factor)).collect();
        let truth = noisy(Truth { slow: slow.clone(), ..Truth::default() });
        let (v, rounds, _) = simulate(shuffled(n, seed), &truth, PairingConfig::default());
        prop_assert_eq!(v.stragglers.keys().copied().collect::<BTreeSet<_>>(), slow.keys().copied().collect::<BTreeSet<_>>(), "{:?}", v);
        // Within 12 %, or up to SLOW_CHECK above when the noise model's one slow check of a
        // round fell on its checks in every round that measured it.
        for r in v.stragglers.values() {
            prop_assert!(r / factor > 0.88 && r / factor < 1.12 * SLOW_CHECK, "ratio {} for {}x", r, factor);
        }
        prop_assert!(v.faulty.is_empty() && v.broken_links.is_empty() && v.degraded_links.is_empty() && v.unknown.is_empty(), "{:?}", v);
        prop_assert!(rounds <= 3, "{} rounds", rounds);
    }
}

#[test]
fn a_check_is_compared_with_the_lower_median_of_its_rounds_other_checks() {
    // (reference times, the check's own time if it is one of them, the bar)
    let rows: [(&[f64], Option<f64>, Option<f64>); 7] = [
        // Two checks: each against the other.
        (&[1.0, 3.0], Some(3.0), Some(1.0)),
        (&[1.0, 3.0], Some(1.0), Some(3.0)),
        // Three: the lower of the two others, so one slow reference does not lift the bar.
        (&[1.0, 1.6, 3.0], Some(3.0), Some(1.0)),
        (&[1.0, 1.1, 1.2, 1.3, 5.0], Some(5.0), Some(1.1)),
        // Not a reference time itself (a re-measurement): all of them.
        (&[1.0, 1.1, 1.2], None, Some(1.1)),
        // Alone in its round: nothing to compare with.
        (&[2.0], Some(2.0), None),
        (&[], None, None),
    ];
    for (times, own, bar) in rows {
        let s = RoundStats {
            times: times.to_vec(),
            mad: 0.0,
        };
        assert_eq!(s.median_without(own), bar, "{times:?} without {own:?}");
    }
}
