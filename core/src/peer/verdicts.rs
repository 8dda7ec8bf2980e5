//! A run's verdicts as this node's fault record sees them: pure. Each agent records only what
//! concerns itself, so the node sinks label and taint by the normal rules:
//! - `PEER_UNREACHABLE` on the node when the run found it faulty (it failed with every partner);
//!   `PEER_PROBE_FAILED` instead when the agent knows its own probe could not run, with the
//!   cause (the agent answered every call: it is not unreachable);
//! - `PEER_LINK_FAILED` on `link:<partner>` for each broken link it is an end of;
//! - `PEER_LINK_DEGRADED` on `link:<partner>` for each degraded link it is an end of (slow in
//!   two measurements while both nodes are normal with others), with the slowdown;
//! - `STRAGGLER` on the node, with the slowdown in the message.
//!
//! The observations are `Level`s (domain `peer`), so a later run that finds the node fine clears
//! them. A run that could not tell (the node is `unknown`) or did not include the node changes
//! nothing; nor does a run change the link to a partner it did not judge (not a member of the run,
//! as in a job's pre-flight check of a few nodes, or `unknown` in it).

use std::collections::{BTreeMap, BTreeSet};

use super::pairing::{NodeId, Verdicts};
use crate::catalog::FaultCode;
use crate::engine::{DeviceRef, Observation, Signal};
use crate::record::Source;

/// The `Level` domain of peer-check faults.
pub const DOMAIN: &str = "peer";

/// The device a broken link is recorded on.
pub fn link_device(partner: &str) -> String {
    format!("link:{partner}")
}

/// The `Level` domain of this node's peer links: one level per link, on `link:<partner>`.
pub const LINK_DOMAIN: &str = "peer-link";

/// A run's observations for this node (`me`, an index into `members`). No memory between runs:
/// every run states what it judged of the node (one level for the node, one for each link to a
/// partner it judged), so links restored from saved state after a restart heal on the next
/// clean run like any other (a tracker of the links reported before did not survive a restart).
/// A link to a node outside the run, or `unknown` in it, is left as it is: a job's check of two
/// nodes says nothing of their links to a third. (A link to a node that has left the cluster
/// for good is cleared with `faultline clear --device link:<node>`.)
pub fn observe(
    members: &[String],
    me: NodeId,
    verdicts: &Verdicts,
    run_id: &str,
    own_failure: Option<&str>,
) -> Vec<Observation> {
    let Some(my_name) = members.get(me) else {
        return Vec::new();
    };
    if verdicts.unknown.contains_key(&me) {
        return Vec::new();
    }
    let name = |n: NodeId| members.get(n).cloned().unwrap_or_else(|| format!("#{n}"));
    let signal = |code: &str, device: &str, message: String| {
        Signal::new(
            Source::Peer,
            FaultCode::named(code),
            Some(DeviceRef::named(device)),
            message,
        )
    };
    let mut node = Vec::new();
    if verdicts.faulty.contains(&me) {
        node.push(match own_failure {
            Some(cause) => signal(
                "PEER_PROBE_FAILED",
                "node",
                format!("peer check {run_id}: {my_name} failed with every partner; its own probe could not run: {cause}"),
            ),
            None => signal(
                "PEER_UNREACHABLE",
                "node",
                format!("peer check {run_id}: {my_name} failed with every partner, at least two of them good"),
            ),
        });
    }
    if let Some(ratio) = verdicts.stragglers.get(&me) {
        node.push(signal(
            "STRAGGLER",
            "node",
            format!("peer check {run_id}: {my_name} is {ratio:.2}x slower than the median, in two measurements"),
        ));
    }
    let broken: BTreeSet<NodeId> = verdicts
        .broken_links
        .iter()
        .filter(|l| l.has(me))
        .map(|l| l.other(me))
        .collect();
    let degraded: BTreeMap<NodeId, f64> = verdicts
        .degraded_links
        .iter()
        .filter(|(l, _)| l.has(me))
        .map(|(l, r)| (l.other(me), *r))
        .collect();
    // The partners whose link to this node the run judged: broken or degraded, or fine because
    // both ends were judged and no broken or degraded link between them was found.
    let judged = (0..members.len()).filter(|p| {
        *p != me
            && (broken.contains(p) || degraded.contains_key(p) || !verdicts.unknown.contains_key(p))
    });
    let mut out = vec![Observation::Level {
        source: Source::Peer,
        device: Some(DeviceRef::named("node")),
        domain: DOMAIN.into(),
        present: node,
    }];
    for p in judged {
        let partner = name(p);
        let device = link_device(&partner);
        let present = if broken.contains(&p) {
            vec![signal(
                "PEER_LINK_FAILED",
                &device,
                format!("peer check {run_id}: the path between {my_name} and {partner} fails while both pass with others"),
            )]
        } else if let Some(ratio) = degraded.get(&p) {
            vec![signal(
                "PEER_LINK_DEGRADED",
                &device,
                format!("peer check {run_id}: the path between {my_name} and {partner} is {ratio:.2}x slower than the round, in two measurements, while both are normal with others"),
            )]
        } else {
            Vec::new()
        };
        out.push(Observation::Level {
            source: Source::Peer,
            device: Some(DeviceRef::named(&device)),
            domain: LINK_DOMAIN.into(),
            present,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;
    use crate::engine::{Ctx, Engine};
    use crate::peer::pairing::{simulate, Pair, PairingConfig, Truth};
    use crate::policy::Policy;
    use crate::record::{Handling, Health};

    fn members(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("gpu-{i}")).collect()
    }

    /// `code@device` of the active faults.
    fn active(e: &Engine, p: &Policy) -> Vec<String> {
        let mut v: Vec<String> = e
            .view(p)
            .faults
            .iter()
            .filter(|f| f.active)
            .map(|f| format!("{}@{}", f.fault_code, f.device))
            .collect();
        v.sort();
        v
    }

    /// The built-in policy, and a context over it with the built-in catalog.
    /// A simulated run of `truth` over the members, each node's observations stepped into its
    /// own engine.
    fn run_on_engines(m: &[String], truth: &Truth, ctx: Ctx<'_>) -> Vec<Engine> {
        let (v, _, _) = simulate((0..m.len()).collect(), truth, PairingConfig::default());
        let mut engines: Vec<Engine> = (0..m.len()).map(|_| Engine::new()).collect();
        for (i, e) in engines.iter_mut().enumerate() {
            for o in observe(m, i, &v, "run-1", None) {
                e.step(ctx, o, t(0));
            }
        }
        engines
    }

    fn ctx() -> (&'static Policy, Ctx<'static>) {
        static P: std::sync::OnceLock<(Policy, Catalog)> = std::sync::OnceLock::new();
        let (policy, catalog) =
            P.get_or_init(|| (Policy::parse("").unwrap(), Catalog::builtin().unwrap()));
        (policy, Ctx { policy, catalog })
    }

    fn t(s: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_790_000_000 + s).unwrap()
    }

    /// A node whose own probe could not run says so, with the cause, instead of calling itself
    /// unreachable (its agent answered every call); the next run that finds it fine clears it.
    #[test]
    fn a_probe_that_cannot_run_is_named_with_its_cause() {
        let (policy, ctx) = ctx();
        let m = members(4);
        let v = Verdicts {
            faulty: BTreeSet::from([2]),
            ..Verdicts::default()
        };
        let cause = "cannot run /x/faultline-probe: No such file or directory (os error 2)";
        let mut e = Engine::new();
        for o in observe(&m, 2, &v, "run-1", Some(cause)) {
            e.step(ctx, o, t(0));
        }
        assert_eq!(active(&e, policy), ["PEER_PROBE_FAILED@node"]);
        let view = e.view(policy);
        assert!(
            view.faults[0].message.contains(cause),
            "{}",
            view.faults[0].message
        );
        assert_eq!(view.health, Health::Degraded);
        for o in observe(&m, 2, &Verdicts::default(), "run-2", None) {
            e.step(ctx, o, t(60));
        }
        assert!(active(&e, policy).is_empty());
    }

    #[test]
    fn verdicts_reach_the_record_and_clear_on_a_clean_run() {
        let (policy, ctx) = ctx();
        let m = members(8);
        // Run 1 (simulated): node 3 faulty, link 4-5 broken, node 6 a 3x straggler.
        let truth = Truth {
            faulty: BTreeSet::from([3]),
            broken_links: BTreeSet::from([Pair::new(4, 5)]),
            slow: BTreeMap::from([(6, 3.0)]),
            noise: 0.02,
            ..Truth::default()
        };
        let mut engines = run_on_engines(&m, &truth, ctx);
        assert_eq!(active(&engines[3], policy), ["PEER_UNREACHABLE@node"]);
        assert_eq!(engines[3].view(policy).health, Health::Degraded);
        assert_eq!(active(&engines[4], policy), ["PEER_LINK_FAILED@link:gpu-5"]);
        assert_eq!(active(&engines[5], policy), ["PEER_LINK_FAILED@link:gpu-4"]);
        assert_eq!(active(&engines[6], policy), ["STRAGGLER@node"]);
        let straggler = &engines[6].view(policy).faults[0];
        assert!(
            straggler.message.contains("3.0") || straggler.message.contains("2.9"),
            "{}",
            straggler.message
        );
        assert_eq!(straggler.fault_handling, Handling::SubHealthFault);
        for i in [0, 1, 2, 7] {
            assert!(active(&engines[i], policy).is_empty(), "gpu-{i}");
        }
        // Run 2: everything repaired; every recorded fault recovers.
        let (v2, _, _) = simulate(
            (0..8).collect(),
            &Truth::default(),
            PairingConfig::default(),
        );
        for (i, e) in engines.iter_mut().enumerate() {
            for o in observe(&m, i, &v2, "run-2", None) {
                e.step(ctx, o, t(1800));
            }
            assert!(
                active(e, policy).is_empty(),
                "gpu-{i}: {:?}",
                active(e, policy)
            );
        }
    }

    /// Issue 28: a degraded link (a pair slow in two measurements, both nodes normal with
    /// others) reaches both ends' records as `PEER_LINK_DEGRADED` on the link, with the
    /// slowdown, sub-health only (the nodes stay Healthy, nothing else is blamed), and a later
    /// clean run clears it.
    #[test]
    fn a_degraded_link_reaches_both_ends_and_clears() {
        let (policy, ctx) = ctx();
        let m = members(8);
        let truth = Truth {
            degraded_links: BTreeMap::from([(Pair::new(2, 3), 2.5)]),
            noise: 0.02,
            ..Truth::default()
        };
        let mut engines = run_on_engines(&m, &truth, ctx);
        assert_eq!(
            active(&engines[2], policy),
            ["PEER_LINK_DEGRADED@link:gpu-3"]
        );
        assert_eq!(
            active(&engines[3], policy),
            ["PEER_LINK_DEGRADED@link:gpu-2"]
        );
        let view = engines[2].view(policy);
        let f = &view.faults[0];
        assert!(
            f.message.contains("2.5") || f.message.contains("2.4"),
            "{}",
            f.message
        );
        assert_eq!(f.fault_handling, Handling::SubHealthFault);
        assert_eq!(view.health, Health::Healthy);
        for i in [0, 1, 4, 5, 6, 7] {
            assert!(active(&engines[i], policy).is_empty(), "gpu-{i}");
        }
        for (i, e) in engines.iter_mut().enumerate() {
            for o in observe(&m, i, &Verdicts::default(), "run-2", None) {
                e.step(ctx, o, t(1800));
            }
            assert!(active(e, policy).is_empty(), "gpu-{i}");
        }
    }

    /// A restart between two runs: the engine comes back from its saved state (the old tracker's
    /// memory is gone). A link that healed meanwhile is ended by the next clean run, a link that
    /// is still broken stays one fault with its count (fails while the tracker kept the links).
    #[test]
    fn links_restored_after_a_restart_heal_or_stay() {
        let (policy, ctx) = ctx();
        let m = members(8);
        let broken = |links: &[(usize, usize)]| Verdicts {
            broken_links: links.iter().map(|(a, b)| Pair::new(*a, *b)).collect(),
            ..Default::default()
        };
        let mut e = Engine::new();
        for o in observe(&m, 4, &broken(&[(4, 5), (4, 6)]), "run-1", None) {
            e.step(ctx, o, t(0));
        }
        assert_eq!(
            active(&e, policy),
            ["PEER_LINK_FAILED@link:gpu-5", "PEER_LINK_FAILED@link:gpu-6"]
        );
        // Restart: state saved and loaded, a new tracker.
        let mut e: Engine = serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap();
        for o in observe(&m, 4, &broken(&[(4, 6)]), "run-2", None) {
            e.step(ctx, o, t(1800));
        }
        assert_eq!(active(&e, policy), ["PEER_LINK_FAILED@link:gpu-6"]);
        let count = |e: &Engine| e.faults().find(|f| f.fault.active).map(|f| f.fault.count);
        assert_eq!(
            count(&e),
            Some(1),
            "a link that stayed broken is not counted again"
        );
        for o in observe(&m, 4, &Verdicts::default(), "run-3", None) {
            e.step(ctx, o, t(3600));
        }
        assert!(active(&e, policy).is_empty());
    }

    /// A run judges only the links to its own members: a job's pre-flight check of gpu-4 and
    /// gpu-5 leaves gpu-4's broken link to gpu-6 alone, and so does a run in which gpu-6 is
    /// `unknown`; a run that judges gpu-6 ends it. (A single level over all links ended it on
    /// the two-node run.)
    #[test]
    fn a_run_ends_only_the_links_it_judged() {
        let (policy, ctx) = ctx();
        let m = members(8);
        let mut e = Engine::new();
        let v = Verdicts {
            broken_links: BTreeSet::from([Pair::new(4, 6)]),
            ..Default::default()
        };
        for o in observe(&m, 4, &v, "run-1", None) {
            e.step(ctx, o, t(0));
        }
        assert_eq!(active(&e, policy), ["PEER_LINK_FAILED@link:gpu-6"]);

        let pair = vec!["gpu-4".to_string(), "gpu-5".to_string()];
        for o in observe(&pair, 0, &Verdicts::default(), "job", None) {
            e.step(ctx, o, t(60));
        }
        assert_eq!(
            active(&e, policy),
            ["PEER_LINK_FAILED@link:gpu-6"],
            "a run without gpu-6 says nothing of the link to it"
        );

        let mut unsure = Verdicts::default();
        unsure.unknown.insert(6, "did not answer".into());
        for o in observe(&m, 4, &unsure, "run-2", None) {
            e.step(ctx, o, t(1800));
        }
        assert_eq!(
            active(&e, policy),
            ["PEER_LINK_FAILED@link:gpu-6"],
            "gpu-6 unknown: the link is not judged"
        );

        for o in observe(&m, 4, &Verdicts::default(), "run-3", None) {
            e.step(ctx, o, t(3600));
        }
        assert!(active(&e, policy).is_empty());
    }

    #[test]
    fn unknown_or_absent_changes_nothing() {
        let m = members(2);
        let mut v = Verdicts::default();
        v.unknown.insert(0, "no partner".into());
        assert!(observe(&m, 0, &v, "r", None).is_empty());
        assert!(observe(&m, 5, &Verdicts::default(), "r", None).is_empty());
    }
}
