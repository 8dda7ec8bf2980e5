//! Table-driven tests and property tests for the engine.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::policy::Policy;
use crate::record::FaultType;

pub(super) fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + s).expect("valid time")
}

fn pci(s: &str) -> PciAddr {
    s.parse().expect("pci")
}

fn xid(x: u32, gpu: &str) -> Observation {
    Observation::Signal(Signal::new(
        Source::Kmsg,
        FaultCode::Xid(x),
        Some(DeviceRef::pci(pci(gpu))),
        format!("xid {x}"),
    ))
}

fn named(code: &str, source: Source) -> Observation {
    Observation::Signal(Signal::new(source, FaultCode::named(code), None, code))
}

/// An engine with its policy and the built-in catalog, stepped at `t(s)` (shared with the
/// caps tests).
pub(super) struct Rig {
    pub(super) engine: Engine,
    pub(super) policy: Policy,
    pub(super) catalog: Catalog,
}

impl Rig {
    pub(super) fn new(policy: &str) -> Rig {
        Rig {
            engine: Engine::new(),
            policy: Policy::parse(policy).expect("policy"),
            catalog: Catalog::builtin().expect("catalog"),
        }
    }
    pub(super) fn at(&mut self, s: i64, obs: Observation) -> Vec<EngineEvent> {
        let ctx = Ctx {
            policy: &self.policy,
            catalog: &self.catalog,
        };
        self.engine.step(ctx, obs, t(s))
    }
    fn view(&self) -> NodeView {
        self.engine.view(&self.policy)
    }
    fn only(&self) -> Fault {
        let v = self.view();
        assert_eq!(v.faults.len(), 1, "{:#?}", v.faults);
        v.faults[0].clone()
    }
}

#[test]
fn healthy_node_view() {
    let r = Rig::new("");
    let v = r.view();
    assert_eq!(v.health, Health::Healthy);
    assert_eq!(v.handling, None);
    assert!(v.taints.is_empty());
    assert!(v.condition.status);
    assert_eq!(v.labels[HEALTH_LABEL], "Healthy");
}

/// Each row: the Xid, the verdict, the taint, the condition status (the default node actions of
/// docs/policy.md).
#[test]
fn xid_to_node_actions() {
    type Row = (
        u32,
        Health,
        Option<(&'static str, TaintEffect)>,
        bool,
        Handling,
    );
    let rows: &[Row] = &[
        (
            79,
            Health::Unhealthy,
            Some(("faultline.io/unhealthy", TaintEffect::NoSchedule)),
            false,
            Handling::SeparateNPU,
        ),
        (95, Health::Degraded, None, true, Handling::RestartNPU),
        (13, Health::Degraded, None, true, Handling::RestartBusiness),
        (43, Health::Healthy, None, true, Handling::NotHandleFault),
        (63, Health::Healthy, None, true, Handling::NotHandleFault),
        (
            99_999,
            Health::Degraded,
            Some(("faultline.io/degraded", TaintEffect::PreferNoSchedule)),
            false,
            Handling::PreSeparateNPU,
        ),
    ];
    for &(x, health, taint, cond, handling) in rows {
        let mut r = Rig::new("");
        r.at(0, xid(x, "0000:3b:00.0"));
        let v = r.view();
        assert_eq!(v.health, health, "Xid {x}");
        assert_eq!(v.handling, Some(handling), "Xid {x}");
        assert_eq!(v.condition.status, cond, "Xid {x}");
        match taint {
            None => assert!(v.taints.is_empty(), "Xid {x}: {:?}", v.taints),
            Some((key, effect)) => assert_eq!(
                v.taints,
                vec![DesiredTaint {
                    key: key.into(),
                    value: format!("Xid{x}"),
                    effect
                }],
                "Xid {x}"
            ),
        }
    }
}

#[test]
fn identical_signals_dedupe_into_one_fault_with_a_count() {
    let mut r = Rig::new("");
    let mut new_faults = 0;
    for i in 0..800_000u32 {
        let ev = r.at(i64::from(i / 1000), xid(95, "0000:3b:00.0"));
        new_faults += ev
            .iter()
            .filter(|e| matches!(e, EngineEvent::NewFault { .. }))
            .count();
    }
    let f = r.only();
    assert_eq!(f.count, 800_000);
    assert_eq!(new_faults, 1);
    assert_eq!(f.first_seen, t(0));
    assert_eq!(f.last_seen, t(799));
}

#[test]
fn different_devices_are_different_faults() {
    let mut r = Rig::new("");
    r.at(0, xid(79, "0000:3b:00.0"));
    r.at(0, xid(79, "0000:86:00.0"));
    r.at(0, xid(13, "0000:86:00.0"));
    assert_eq!(r.view().faults.len(), 3);
}

#[test]
fn uuid_line_names_the_device_of_earlier_and_later_faults() {
    let mut r = Rig::new("");
    r.at(0, xid(31, "0000:3b:00.0"));
    r.at(
        1,
        Observation::DeviceSeen {
            pci: pci("0000:3b:00.0"),
            uuid: Some("GPU-abc".into()),
            index: None,
        },
    );
    r.at(2, xid(79, "0000:3b:00.0"));
    for f in r.view().faults {
        assert_eq!(
            f.device_uuid.as_deref(),
            Some("GPU-abc"),
            "{}",
            f.fault_code
        );
        assert_eq!(f.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
        assert_eq!(f.device, "GPU-0000:3b:00.0");
    }
    r.at(
        3,
        Observation::DeviceSeen {
            pci: pci("0000:3b:00.0"),
            uuid: None,
            index: Some(3),
        },
    );
    assert!(r.view().faults.iter().all(|f| f.device == "GPU-3"));
}

#[test]
fn frequency_escalation_counts_occurrences_not_lines() {
    let mut r = Rig::new(
        "escalation:\n  - codes: [Xid13]\n    count: 3\n    window: 1h\n    handling: SeparateNPU\nburst_window: 5s\n",
    );
    // A burst of 50 lines within 5 s is one occurrence.
    for i in 0..50 {
        r.at(i / 10, xid(13, "0000:3b:00.0"));
    }
    assert_eq!(r.only().fault_handling, Handling::RestartBusiness);
    r.at(600, xid(13, "0000:3b:00.0"));
    assert_eq!(r.only().fault_handling, Handling::RestartBusiness);
    let ev = r.at(1200, xid(13, "0000:3b:00.0"));
    assert!(
        ev.iter().any(|e| matches!(
            e,
            EngineEvent::Escalated {
                to: Handling::SeparateNPU,
                ..
            }
        )),
        "{ev:?}"
    );
    let f = r.only();
    assert_eq!(f.fault_handling, Handling::SeparateNPU);
    assert_eq!(f.escalated_from, Some(Handling::RestartBusiness));
    assert_eq!(r.view().health, Health::Unhealthy);
}

#[test]
fn frequency_outside_the_window_does_not_escalate() {
    let mut r = Rig::new("escalation:\n  - codes: [Xid13]\n    count: 2\n    window: 10m\n    handling: SeparateNPU\n");
    r.at(0, xid(13, "0000:3b:00.0"));
    r.at(601, xid(13, "0000:3b:00.0"));
    assert_eq!(r.only().fault_handling, Handling::RestartBusiness);
}

#[test]
fn duration_escalation_fires_on_tick() {
    let mut r = Rig::new(
        "escalation:\n  - codes: [NVLINK_DOWN]\n    duration: 20s\n    handling: SeparateNPU\n",
    );
    r.at(0, named("NVLINK_DOWN", Source::Nvml));
    r.at(19, Observation::Tick);
    assert_eq!(r.only().fault_handling, Handling::PreSeparateNPU);
    r.at(20, Observation::Tick);
    assert_eq!(r.only().fault_handling, Handling::SeparateNPU);
}

#[test]
fn escalation_survives_quiet_but_not_recovery() {
    let mut r = Rig::new("escalation:\n  - codes: [Xid95]\n    count: 2\n    window: 1h\n    handling: SeparateNPU\n");
    r.at(0, xid(95, "0000:3b:00.0"));
    r.at(100, xid(95, "0000:3b:00.0"));
    r.at(5000, Observation::Tick);
    assert_eq!(
        r.only().fault_handling,
        Handling::SeparateNPU,
        "sticky while active"
    );
    r.at(
        5001,
        Observation::OperatorClear {
            code: None,
            device: None,
        },
    );
    r.at(9000, xid(95, "0000:3b:00.0"));
    let f = r.only();
    assert!(f.active);
    assert_eq!(
        f.fault_handling,
        Handling::RestartNPU,
        "a fresh period starts at the base level"
    );
}

#[test]
fn reboot_clears_kernel_log_faults_only() {
    let mut r = Rig::new("");
    r.at(
        0,
        Observation::Boot {
            boot_id: "a".into(),
        },
    );
    r.at(1, xid(79, "0000:3b:00.0"));
    r.at(1, named("GPU_MISSING", Source::Nvml));
    r.at(
        2,
        Observation::Boot {
            boot_id: "a".into(),
        },
    );
    assert!(
        r.view().faults.iter().all(|f| f.active),
        "same boot: nothing clears"
    );
    let ev = r.at(
        3,
        Observation::Boot {
            boot_id: "b".into(),
        },
    );
    assert!(ev
        .iter()
        .any(|e| matches!(e, EngineEvent::Recovered { code, .. } if code == "Xid79")));
    let v = r.view();
    let xid79 = v.faults.iter().find(|f| f.fault_code == "Xid79").unwrap();
    let missing = v
        .faults
        .iter()
        .find(|f| f.fault_code == "GPU_MISSING")
        .unwrap();
    assert!(!xid79.active && xid79.recovered_at == Some(t(3)));
    assert!(missing.active);
}

#[test]
fn operator_clear_by_code_and_device() {
    let mut r = Rig::new("");
    r.at(0, xid(79, "0000:3b:00.0"));
    r.at(0, xid(79, "0000:86:00.0"));
    r.at(0, xid(95, "0000:86:00.0"));
    r.at(
        1,
        Observation::OperatorClear {
            code: Some("Xid79".into()),
            device: Some("0000:86:00.0".into()),
        },
    );
    let active: Vec<(String, String)> = r
        .view()
        .faults
        .into_iter()
        .filter(|f| f.active)
        .map(|f| (f.fault_code, f.pci_bus_id.unwrap_or_default()))
        .collect();
    assert_eq!(
        active,
        vec![
            ("Xid79".into(), "0000:3b:00.0".into()),
            ("Xid95".into(), "0000:86:00.0".into())
        ]
    );
}

/// `--device` takes the names `faultline get` shows (the DEVICE column: `GPU-<index>` once NVML
/// gave the index, `GPU-<pci>` for a device known only from the kernel log), the UUID, and the
/// PCI bus id in any form the kernel log or NVML prints it. An index the engine does not know
/// names nothing: `GPU-3` is not a kernel-log-only device's name.
#[test]
fn operator_clear_takes_the_device_names_get_shows() {
    let rows: [(&str, &[&str]); 9] = [
        ("GPU-0000:3b:00.0", &["0000:3b:00.0"]),
        ("0000:3b:00.0", &["0000:3b:00.0"]),
        ("3b:00.0", &["0000:3b:00.0"]),
        ("00000000:3B:00.0", &["0000:3b:00.0"]),
        ("PCI:0000:3b:00", &["0000:3b:00.0"]),
        ("GPU-2", &["0000:86:00.0"]),
        ("GPU-5c4a", &["0000:86:00.0"]),
        ("GPU-3", &[]),
        ("3b:00.1", &[]),
    ];
    for (device, want) in rows {
        let mut r = Rig::new("");
        r.at(
            0,
            Observation::DeviceSeen {
                pci: pci("0000:86:00.0"),
                uuid: Some("GPU-5c4a".into()),
                index: Some(2),
            },
        );
        r.at(0, xid(79, "0000:3b:00.0"));
        r.at(0, xid(79, "0000:86:00.0"));
        let shown: Vec<String> = r.view().faults.into_iter().map(|f| f.device).collect();
        assert_eq!(shown, ["GPU-0000:3b:00.0", "GPU-2"], "what get shows");
        let events = r.at(
            1,
            Observation::OperatorClear {
                code: None,
                device: Some(device.into()),
            },
        );
        let cleared: Vec<String> = r
            .view()
            .faults
            .into_iter()
            .filter(|f| !f.active)
            .map(|f| f.pci_bus_id.unwrap_or_default())
            .collect();
        assert_eq!(cleared, want, "--device {device}");
        let recovered = events
            .iter()
            .filter(|e| matches!(e, EngineEvent::Recovered { .. }))
            .count();
        assert_eq!(recovered, want.len(), "one event per cleared fault");
    }
}

#[test]
fn quiet_recovery_rules() {
    // Defaults: KMSG_LOSS clears after 10 min quiet, app-level kernel faults after 1 h.
    let mut r = Rig::new("");
    r.at(0, named("KMSG_LOSS", Source::Agent));
    r.at(0, xid(13, "0000:3b:00.0"));
    r.at(0, xid(79, "0000:3b:00.0"));
    r.at(599, Observation::Tick);
    assert_eq!(r.view().faults.iter().filter(|f| f.active).count(), 3);
    r.at(600, Observation::Tick);
    assert_eq!(r.view().faults.iter().filter(|f| f.active).count(), 2);
    r.at(3600, Observation::Tick);
    let active: Vec<String> = r
        .view()
        .faults
        .into_iter()
        .filter(|f| f.active)
        .map(|f| f.fault_code)
        .collect();
    assert_eq!(
        active,
        vec!["Xid79"],
        "a SeparateNPU fault waits for reboot or operator"
    );
}

#[test]
fn a_level_ends_only_its_own_source_and_domain() {
    let mut r = Rig::new("");
    let level = |source, domain: &str, present: bool| Observation::Level {
        source,
        device: Some(DeviceRef::pci(pci("0000:3b:00.0"))),
        domain: domain.into(),
        present: if present {
            vec![Signal::new(
                Source::Nvml,
                FaultCode::named("NVLINK_DOWN"),
                None,
                "down",
            )]
        } else {
            Vec::new()
        },
    };
    r.at(0, level(Source::Nvml, "nvml-nvlink", true));
    r.at(1, level(Source::Kmsg, "nvml-nvlink", false));
    r.at(2, level(Source::Nvml, "nvml-pcie", false));
    assert!(r.only().active);
    r.at(3, level(Source::Nvml, "nvml-nvlink", false));
    assert!(!r.only().active);
}

/// A level with no device covers every device of its source and domain (a node's peer links).
#[test]
fn a_level_without_a_device_covers_the_domain() {
    let mut r = Rig::new("");
    let link = |p: &str| {
        Signal::new(
            Source::Peer,
            FaultCode::named("PEER_LINK_FAILED"),
            Some(DeviceRef::named(&format!("link:{p}"))),
            "broken",
        )
    };
    let links = |present: Vec<Signal>| Observation::Level {
        source: Source::Peer,
        device: None,
        domain: "peer-link".into(),
        present,
    };
    r.at(0, links(vec![link("a"), link("b")]));
    r.at(
        0,
        Observation::Level {
            source: Source::Peer,
            device: Some(DeviceRef::named("node")),
            domain: "peer".into(),
            present: vec![Signal::new(
                Source::Peer,
                FaultCode::named("STRAGGLER"),
                None,
                "slow",
            )],
        },
    );
    r.at(1, links(vec![link("b")]));
    let active: Vec<String> = r
        .view()
        .faults
        .iter()
        .filter(|f| f.active)
        .map(|f| format!("{}@{}", f.fault_code, f.device))
        .collect();
    assert_eq!(active, ["PEER_LINK_FAILED@link:b", "STRAGGLER@node"]);
}

#[test]
fn same_fault_from_two_sources_is_one_fault() {
    let mut r = Rig::new("");
    r.at(0, xid(79, "0000:3b:00.0"));
    let mut s = Signal::new(
        Source::Nvml,
        FaultCode::Xid(79),
        Some(DeviceRef::pci(pci("0000:3b:00.0"))),
        "nvml",
    );
    s.at = Some(t(1));
    r.at(1, Observation::Signal(s));
    let f = r.only();
    assert_eq!(
        (f.source, f.also_seen_by.clone(), f.count),
        (Source::Kmsg, vec![Source::Nvml], 2)
    );
}

#[test]
fn detector_down_and_back() {
    let mut r = Rig::new("");
    r.at(
        0,
        Observation::Detector {
            name: "nvml".into(),
            state: DetectorState::Down,
            reason: Some("init failed".into()),
        },
    );
    let f = r.only();
    assert_eq!(
        (f.fault_code.as_str(), f.device.as_str(), f.active),
        ("DETECTOR_DOWN", "nvml", true)
    );
    assert!(f.message.contains("init failed"));
    assert_eq!(
        r.view().health,
        Health::Healthy,
        "a blind detector is not a sick node"
    );
    r.at(
        5,
        Observation::Detector {
            name: "nvml".into(),
            state: DetectorState::Running,
            reason: None,
        },
    );
    assert!(!r.only().active);
    r.at(
        6,
        Observation::Detector {
            name: "ascend".into(),
            state: DetectorState::Idle,
            reason: None,
        },
    );
    assert_eq!(r.view().faults.len(), 1, "idle is normal: no fault");
}

/// A detector set up but not watching yet (a kernel-log FIFO without a writer) is shown as
/// Starting with its reason; it is no fault, and a Down before it recovers.
#[test]
fn a_starting_detector_is_shown_and_is_no_fault() {
    let mut r = Rig::new("");
    let obs = |state, reason: &str| Observation::Detector {
        name: "kmsg".into(),
        state,
        reason: Some(reason.into()),
    };
    r.at(0, obs(DetectorState::Starting, "waiting for a writer"));
    assert!(r.view().faults.is_empty());
    let d = &r.engine.detectors()["kmsg"];
    assert_eq!(
        (d.state.as_str(), d.reason.as_deref()),
        ("Starting", Some("waiting for a writer"))
    );
    r.at(1, obs(DetectorState::Down, "cannot open"));
    assert!(r.only().active);
    r.at(2, obs(DetectorState::Starting, "waiting for a writer"));
    assert!(!r.only().active, "no longer down");
}

#[test]
fn policy_reload_reclassifies_and_keeps_escalations() {
    let mut r = Rig::new("");
    r.at(0, xid(43, "0000:3b:00.0"));
    assert_eq!(r.view().health, Health::Healthy);
    r.policy = Policy::parse("overrides:\n  Xid43: { handling: SeparateNPU }\n").unwrap();
    let ev = r.engine.reclassify(Ctx {
        policy: &r.policy,
        catalog: &r.catalog,
    });
    assert!(
        matches!(
            ev.as_slice(),
            [EngineEvent::Reclassified {
                to: Handling::SeparateNPU,
                ..
            }]
        ),
        "{ev:?}"
    );
    assert_eq!(r.view().health, Health::Unhealthy);
}

#[test]
fn history_is_bounded_and_dropped_counted() {
    let mut r = Rig::new("max_recovered: 3\nrecovered_retention: 1h\n");
    for i in 0..6u8 {
        let gpu = format!("0000:{:02x}:00.0", i + 1);
        r.at(i64::from(i), xid(79, &gpu));
        r.at(
            i64::from(i),
            Observation::OperatorClear {
                code: None,
                device: Some(gpu),
            },
        );
    }
    let v = r.view();
    assert_eq!(v.faults.len(), 3);
    assert_eq!(v.dropped_faults, 3);
    // Newest recovered first; the oldest were dropped.
    assert_eq!(v.faults[0].pci_bus_id.as_deref(), Some("0000:06:00.0"));
    r.at(10_000, Observation::Tick);
    assert!(r.view().faults.is_empty(), "past retention");
}

#[test]
fn taints_one_per_key_valued_by_the_worst_fault() {
    let mut r = Rig::new("");
    r.at(0, xid(99_999, "0000:3b:00.0")); // unknown: PreSeparateNPU
    r.at(0, xid(79, "0000:86:00.0"));
    let v = r.view();
    assert_eq!(v.health, Health::Unhealthy);
    assert_eq!(v.taints.len(), 2);
    assert_eq!(v.taints[1].key, "faultline.io/unhealthy");
    assert_eq!(v.taints[1].value, "Xid79");
    assert_eq!(v.condition.reason, "SeparateNPU");
    assert!(
        v.condition.message.starts_with("Xid79 on GPU-0000:86:00.0"),
        "{}",
        v.condition.message
    );
}

#[test]
fn state_round_trips_through_json() {
    let mut r = Rig::new("");
    r.at(
        0,
        Observation::Boot {
            boot_id: "b".into(),
        },
    );
    r.at(0, xid(79, "0000:3b:00.0"));
    r.at(
        0,
        Observation::DeviceSeen {
            pci: pci("0000:3b:00.0"),
            uuid: Some("GPU-x".into()),
            index: Some(1),
        },
    );
    let json = serde_json::to_string(&r.engine).unwrap();
    let back: Engine = serde_json::from_str(&json).unwrap();
    assert_eq!(back, r.engine);
}

// ---- properties ----

pub(super) fn arb_obs() -> impl Strategy<Value = (i64, Observation)> {
    let gpu = prop::sample::select(vec!["0000:3b:00.0", "0000:86:00.0", "0001:c5:00.0"]);
    let xids = prop::sample::select(vec![13u32, 31, 43, 48, 63, 74, 79, 95, 119, 99_999]);
    let codes = prop::sample::select(vec![
        "GPU_LOST",
        "NVLINK_DOWN",
        "KMSG_LOSS",
        "MCE_CORRECTED",
        "STRAGGLER",
    ]);
    let sources = prop::sample::select(vec![Source::Kmsg, Source::Nvml, Source::Agent]);
    let obs = prop_oneof![
        6 => (xids, gpu.clone()).prop_map(|(x, g)| xid(x, g)),
        2 => (codes.clone(), sources.clone()).prop_map(|(c, s)| named(c, s)),
        1 => Just(Observation::Tick),
        1 => prop::option::of(prop::sample::select(vec!["Xid79", "Xid13", "GPU_LOST"]))
            .prop_map(|c| Observation::OperatorClear { code: c.map(String::from), device: None }),
        1 => prop::sample::select(vec!["a", "b"]).prop_map(|b| Observation::Boot { boot_id: b.into() }),
        1 => (gpu.clone(), 0u32..8).prop_map(|(g, i)| Observation::DeviceSeen { pci: pci(g), uuid: Some(format!("GPU-{i}")), index: Some(i) }),
        // A level on one GPU or (no device) over every device of the source, with one condition
        // present or none.
        1 => (prop::option::of(gpu), prop::option::of(prop::sample::select(vec!["NVLINK_DOWN", "GPU_LOST"]))).prop_map(|(g, c)| Observation::Level {
            source: Source::Nvml,
            device: g.map(|g| DeviceRef::pci(pci(g))),
            domain: "d".into(),
            present: c.map(|c| Signal::new(Source::Nvml, FaultCode::named(c), g.map(|g| DeviceRef::pci(pci(g))), "level")).into_iter().collect(),
        }),
    ];
    (0i64..4000, obs)
}

// History is kept long enough that nothing is pruned (pruning has its own test).
const POLICY: &str = "recovered_retention: 100000h\nmax_recovered: 1000\nescalation:\n  - codes: [Xid13, Xid31]\n    count: 2\n    window: 1h\n    handling: SeparateNPU\n  - codes: [NVLINK_DOWN]\n    duration: 30s\n    handling: SeparateNPU\n";

fn run(obs: &[(i64, Observation)]) -> (Engine, Vec<Vec<EngineEvent>>) {
    let mut r = Rig::new(POLICY);
    let mut now = 0;
    let mut all = Vec::new();
    for (dt, o) in obs {
        now += dt;
        all.push(r.at(now, o.clone()));
    }
    (r.engine, all)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// The verdict is never less severe than any active fault's own action.
    #[test]
    fn verdict_never_below_worst_active_fault(obs in prop::collection::vec(arb_obs(), 1..80)) {
        let (engine, _) = run(&obs);
        let policy = Policy::parse(POLICY).unwrap();
        let v = engine.view(&policy);
        for f in v.faults.iter().filter(|f| f.active) {
            prop_assert!(v.health >= policy.node_action(f.fault_handling).health, "{:?} vs {:?}", v.health, f);
            prop_assert!(v.handling >= Some(f.fault_handling));
        }
        if v.faults.iter().all(|f| !f.active) {
            prop_assert_eq!(v.health, Health::Healthy);
        }
    }

    /// The verdict that `HealthChanged` reports (derived only after steps with events) is the
    /// one a full pass over the faults derives, after every step.
    #[test]
    fn health_events_follow_the_full_derivation(obs in prop::collection::vec(arb_obs(), 1..80)) {
        let mut r = Rig::new(POLICY);
        let policy = Policy::parse(POLICY).unwrap();
        let mut health = Health::Healthy;
        let mut now = 0;
        for (dt, o) in obs {
            now += dt;
            for e in r.at(now, o) {
                if let EngineEvent::HealthChanged { from, to } = e {
                    prop_assert_eq!(from, health);
                    health = to;
                }
            }
            prop_assert_eq!(health, r.engine.health(&policy));
        }
    }

    /// Same input, same output.
    #[test]
    fn deterministic(obs in prop::collection::vec(arb_obs(), 1..80)) {
        let (a, ea) = run(&obs);
        let (b, eb) = run(&obs);
        prop_assert_eq!(a, b);
        prop_assert_eq!(ea, eb);
    }

    /// Every signal is counted exactly once unless its fault was dropped from history.
    #[test]
    fn nothing_lost(obs in prop::collection::vec(arb_obs(), 1..80)) {
        // A level counts a condition once when it appears, not once per poll: not a signal each.
        let obs: Vec<_> = obs.into_iter().filter(|(_, o)| !matches!(o, Observation::Level { .. })).collect();
        let (engine, _) = run(&obs);
        let signals = obs.iter().filter(|(_, o)| matches!(o, Observation::Signal(_))).count() as u64;
        let counted: u64 = engine.faults().map(|f| f.fault.count).sum();
        prop_assert_eq!(counted, signals);
    }

    /// Fault handling always equals all three level fields, and escalation never lowers.
    #[test]
    fn levels_consistent(obs in prop::collection::vec(arb_obs(), 1..80)) {
        let (engine, _) = run(&obs);
        for f in engine.faults() {
            prop_assert_eq!(f.fault.fault_handling, f.fault.fault_level);
            prop_assert_eq!(f.fault.fault_handling, f.fault.large_model_fault_level);
            if f.fault.active {
                prop_assert!(f.fault.fault_handling >= f.base);
            }
        }
    }
}

#[test]
fn burst_window_zero_counts_every_line() {
    let mut r = Rig::new("burst_window: 0s\nescalation:\n  - codes: [Xid13]\n    count: 3\n    window: 1m\n    handling: SeparateNPU\n");
    let _ = Duration::from_secs(0);
    r.at(0, xid(13, "0000:3b:00.0"));
    r.at(1, xid(13, "0000:3b:00.0"));
    r.at(2, xid(13, "0000:3b:00.0"));
    assert_eq!(r.only().fault_handling, Handling::SeparateNPU);
}

fn npu_code(code: &str, network: bool, severe: bool) -> FaultCode {
    FaultCode::Ascend {
        code: code.into(),
        network,
        severe,
    }
}

/// A poll of one chip's domain, with these codes present.
fn level(chip: u32, domain: &str, codes: &[FaultCode]) -> Observation {
    Observation::Level {
        source: Source::Ascend,
        device: Some(DeviceRef::named(&format!("Ascend910-{chip}"))),
        domain: domain.into(),
        present: codes
            .iter()
            .map(|c| Signal::new(Source::Ascend, c.clone(), None, format!("{c} seen")))
            .collect(),
    }
}

/// `code@device:handling` for active faults, `code@device:-` for recovered ones.
fn states(r: &Rig) -> Vec<String> {
    r.view()
        .faults
        .iter()
        .map(|f| {
            let h = if f.active {
                f.fault_handling.to_string()
            } else {
                "-".into()
            };
            format!("{}@{}:{h}", f.fault_code, f.device)
        })
        .collect()
}

/// Ascend codes through the engine: classification from the built-in `faultCode.json` and the
/// unlisted-code defaults, level-triggered appearance and clearing, record names.
#[test]
fn ascend_levels_classify_and_clear() {
    let mut r = Rig::new("");
    let codes = [
        npu_code("80E3A201", false, false), // listed SeparateNPU
        npu_code("80E01801", false, false), // listed RestartBusiness
        npu_code("80ABCDEF", false, true),  // unlisted, chip health Alarm, beside listed codes
        npu_code("80ABCDEE", false, false), // unlisted, chip health OK: NotHandleFault
    ];
    let events = r.at(0, level(3, "npu-chip", &codes));
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, EngineEvent::NewFault { .. }))
            .count(),
        4
    );
    assert_eq!(
        states(&r),
        [
            "80E3A201@Ascend910-3:SeparateNPU",
            "80E01801@Ascend910-3:RestartBusiness",
            "80ABCDEE@Ascend910-3:NotHandleFault",
            "80ABCDEF@Ascend910-3:NotHandleFault",
        ]
    );
    let f = &r.view().faults[0];
    assert_eq!(f.fault_type, FaultType::CardUnhealthy);
    assert_eq!(f.source, Source::Ascend);
    // The same poll again changes nothing (no count, no event, no revision).
    let rev = r.engine.revision();
    assert!(r.at(10, level(3, "npu-chip", &codes)).is_empty());
    assert_eq!(r.engine.revision(), rev);
    assert_eq!(r.view().faults[0].count, 1);
    // Another domain or another chip does not clear them.
    r.at(11, level(3, "npu-link", &[]));
    r.at(11, level(4, "npu-chip", &[]));
    assert_eq!(r.view().faults.iter().filter(|f| f.active).count(), 4);
    // Two codes gone: those two recover, at once (no hold for them).
    r.at(20, level(3, "npu-chip", &codes[..2]));
    assert_eq!(
        states(&r),
        [
            "80E3A201@Ascend910-3:SeparateNPU",
            "80E01801@Ascend910-3:RestartBusiness",
            "80ABCDEE@Ascend910-3:-",
            "80ABCDEF@Ascend910-3:-",
        ]
    );
}

/// The level of an unlisted chip code, as MindCluster's device plugin decides it: the chip's
/// health only counts when none of the chip's codes is listed; beside a listed code the unlisted
/// one never raises the chip (so a SubHealth code and an unknown one under an Alarm stay below
/// SeparateNPU). Network codes are not chip codes and keep their own default.
#[test]
fn unlisted_codes_never_rise_above_the_listed_ones() {
    let cases: [(&[FaultCode], &[&str]); 4] = [
        (
            &[npu_code("80ABCDEF", false, true)],
            &["80ABCDEF@Ascend910-0:SeparateNPU"],
        ),
        (
            &[
                npu_code("81A3880C", false, true),
                npu_code("80ABCDEF", false, true),
            ],
            &[
                "81A3880C@Ascend910-0:SubHealthFault",
                "80ABCDEF@Ascend910-0:NotHandleFault",
            ],
        ),
        (
            &[npu_code("80ABCDEF", false, false)],
            &["80ABCDEF@Ascend910-0:NotHandleFault"],
        ),
        (
            &[
                npu_code("81078603", true, true),
                npu_code("80ABCDEF", false, true),
            ],
            &[
                "80ABCDEF@Ascend910-0:SeparateNPU",
                "81078603@Ascend910-0:NotHandleFault",
            ],
        ),
    ];
    for (codes, want) in cases {
        let mut r = Rig::new("");
        r.at(0, level(0, "npu-chip", codes));
        assert_eq!(states(&r), want, "{codes:?}");
    }
    // Judged on every read, whatever came first: alone, then beside a listed code, then alone
    // again (the device plugin recomputes a chip's level from the codes it has now).
    let mut r = Rig::new("");
    let alone = [npu_code("80ABCDEF", false, true)];
    let beside = [
        npu_code("81A3880C", false, true),
        npu_code("80ABCDEF", false, true),
    ];
    r.at(0, level(0, "npu-chip", &alone));
    assert_eq!(states(&r), ["80ABCDEF@Ascend910-0:SeparateNPU"]);
    let events = r.at(10, level(0, "npu-chip", &beside));
    assert!(
        events.iter().any(|e| matches!(
            e,
            EngineEvent::Reclassified {
                from: Handling::SeparateNPU,
                to: Handling::NotHandleFault,
                ..
            }
        )),
        "{events:?}"
    );
    assert_eq!(
        states(&r),
        [
            "81A3880C@Ascend910-0:SubHealthFault",
            "80ABCDEF@Ascend910-0:NotHandleFault",
        ]
    );
    r.at(20, level(0, "npu-chip", &alone));
    assert_eq!(
        states(&r),
        ["80ABCDEF@Ascend910-0:SeparateNPU", "81A3880C@Ascend910-0:-",]
    );
    // Under a health word that eases, the same code alone follows it.
    r.at(
        30,
        level(0, "npu-chip", &[npu_code("80ABCDEF", false, false)]),
    );
    assert_eq!(states(&r)[0], "80ABCDEF@Ascend910-0:NotHandleFault");
}

/// MindCluster's duration rule (built in): link down 20 s -> PreSeparateNPU; recovered only after
/// 60 s up; a return within the hold continues the same fault.
#[test]
fn link_down_duration_and_recovery_hold() {
    let mut r = Rig::new("");
    let down = [npu_code("81078603", true, false)];
    r.at(0, level(0, "npu-link", &down));
    assert_eq!(states(&r), ["81078603@Ascend910-0:NotHandleFault"]);
    assert_eq!(
        r.view().faults[0].fault_type,
        FaultType::CardNetworkUnhealthy
    );
    r.at(19, Observation::Tick);
    assert_eq!(states(&r), ["81078603@Ascend910-0:NotHandleFault"]);
    let ev = r.at(20, Observation::Tick);
    assert!(
        ev.iter().any(|e| matches!(
            e,
            EngineEvent::Escalated {
                to: Handling::PreSeparateNPU,
                ..
            }
        )),
        "{ev:?}"
    );
    assert_eq!(r.view().health, Health::Degraded);
    // Up: still active during the hold.
    r.at(30, level(0, "npu-link", &[]));
    r.at(80, Observation::Tick);
    assert_eq!(states(&r), ["81078603@Ascend910-0:PreSeparateNPU"]);
    // Down again within the hold: the same fault, no new occurrence, no new event.
    let ev = r.at(85, level(0, "npu-link", &down));
    assert!(ev.is_empty(), "{ev:?}");
    // Up for the whole hold: recovered.
    r.at(100, level(0, "npu-link", &[]));
    r.at(159, Observation::Tick);
    assert_eq!(states(&r), ["81078603@Ascend910-0:PreSeparateNPU"]);
    let ev = r.at(160, Observation::Tick);
    assert!(
        ev.iter()
            .any(|e| matches!(e, EngineEvent::Recovered { .. })),
        "{ev:?}"
    );
    assert_eq!(states(&r), ["81078603@Ascend910-0:-"]);
    assert_eq!(r.view().health, Health::Healthy);
}

/// A short flap (down less than the duration, then up) does not escalate while the hold runs.
#[test]
fn duration_clock_stops_while_the_condition_is_gone() {
    let mut r = Rig::new("");
    r.at(
        0,
        level(0, "npu-link", &[npu_code("81078603", true, false)]),
    );
    r.at(5, level(0, "npu-link", &[]));
    r.at(40, Observation::Tick);
    assert_eq!(states(&r), ["81078603@Ascend910-0:NotHandleFault"]);
    r.at(65, Observation::Tick);
    assert_eq!(states(&r), ["81078603@Ascend910-0:-"]);
}

/// MindCluster's frequency rule: 80E01801 twice within 24 h -> ManuallySeparateNPU, which stays
/// until an operator clears it, whatever the chip reports.
#[test]
fn frequency_escalation_to_manual_separation_is_sticky() {
    let mut r = Rig::new(
        "escalation:\n  - { codes: [\"80E01801\"], count: 2, window: 24h, handling: ManuallySeparateNPU }\n",
    );
    let code = [npu_code("80E01801", false, false)];
    r.at(0, level(1, "npu-chip", &code));
    r.at(60, level(1, "npu-chip", &[]));
    assert_eq!(states(&r), ["80E01801@Ascend910-1:-"]);
    r.at(3600, level(1, "npu-chip", &code));
    assert_eq!(states(&r), ["80E01801@Ascend910-1:ManuallySeparateNPU"]);
    assert_eq!(r.view().health, Health::Unhealthy);
    // Gone from the chip, a day passes, the node reboots: still there.
    r.at(3700, level(1, "npu-chip", &[]));
    r.at(3700 + 86_400, Observation::Tick);
    r.at(
        3800 + 86_400,
        Observation::Boot {
            boot_id: "b2".into(),
        },
    );
    assert_eq!(states(&r), ["80E01801@Ascend910-1:ManuallySeparateNPU"]);
    r.at(
        3900 + 86_400,
        Observation::OperatorClear {
            code: Some("80E01801".into()),
            device: None,
        },
    );
    assert_eq!(states(&r), ["80E01801@Ascend910-1:-"]);
}

/// The operator's faultCode.json replaces the built-in table (a code only the built-in one lists
/// is an unlisted code), as the device plugin's own file replaces its table; an operator
/// customization file replaces the built-in duration rule.
#[test]
fn operator_ascend_tables() {
    let policy = Policy::parse("")
        .unwrap()
        .with_ascend_files(
            Some((
                "codes.json",
                r#"{"SeparateNPUNetworkCodes": ["81078603"], "RestartNPUCodes": ["80E01801"]}"#,
            )),
            Some(("custom.json", r#"{"FaultDuration": []}"#)),
        )
        .unwrap();
    let mut r = Rig::new("");
    r.policy = policy;
    r.at(
        0,
        level(0, "npu-link", &[npu_code("81078603", true, false)]),
    );
    r.at(
        0,
        level(0, "npu-chip", &[npu_code("80E01801", false, false)]),
    );
    assert_eq!(
        states(&r),
        [
            "81078603@Ascend910-0:SeparateNPU",
            "80E01801@Ascend910-0:RestartNPU"
        ]
    );
    // No hold any more: up means recovered at once.
    r.at(5, level(0, "npu-link", &[]));
    assert_eq!(
        states(&r),
        ["80E01801@Ascend910-0:RestartNPU", "81078603@Ascend910-0:-"]
    );
    // 81A3880C is SubHealthFault in the built-in table, not in the operator's: on chip 1, alone
    // under an Alarm, it is an unlisted code (SeparateNPU).
    r.at(
        10,
        level(1, "npu-chip", &[npu_code("81A3880C", false, true)]),
    );
    assert_eq!(states(&r)[0], "81A3880C@Ascend910-1:SeparateNPU");
}

#[test]
fn inventory_is_kept_and_changes_bump_the_revision() {
    let mut r = Rig::new("");
    let inv = |n: u32| Observation::Inventory {
        kind: "Ascend910".into(),
        names: (0..n).map(|i| format!("Ascend910-{i}")).collect(),
    };
    r.at(0, inv(8));
    let rev = r.engine.revision();
    r.at(1, inv(8));
    assert_eq!(r.engine.revision(), rev);
    r.at(2, inv(7));
    assert!(r.engine.revision() > rev);
    assert_eq!(r.engine.inventory("Ascend910").map(|s| s.len()), Some(7));
}

/// A GPU known only by its index (its identity could not be read, as for a GPU lost at an
/// agent restart) gets the fault key of the PCI address the engine knows for that index, so a
/// saved fault is the same fault; with two devices claiming the index, it is not guessed.
#[test]
fn an_index_alone_finds_the_known_device() {
    let mut r = Rig::new("");
    r.at(
        0,
        Observation::DeviceSeen {
            pci: pci("0000:3b:00.0"),
            uuid: Some("GPU-a".into()),
            index: Some(1),
        },
    );
    let lost = |index: u32| {
        Observation::Signal(Signal::new(
            Source::Nvml,
            FaultCode::named("GPU_LOST"),
            Some(DeviceRef {
                index: Some(index),
                ..Default::default()
            }),
            "lost",
        ))
    };
    r.at(1, xid(79, "0000:3b:00.0"));
    r.at(2, lost(1));
    let keys: Vec<String> = r
        .engine
        .faults()
        .map(|f| f.fault.pci_bus_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(keys, ["0000:3b:00.0", "0000:3b:00.0"]);
    // A second device with the same index (stale after a renumbering): no guess.
    r.at(
        3,
        Observation::DeviceSeen {
            pci: pci("0000:86:00.0"),
            uuid: Some("GPU-b".into()),
            index: Some(1),
        },
    );
    r.at(4, lost(1));
    assert!(r
        .engine
        .faults()
        .any(|f| f.fault.pci_bus_id.is_none() && f.fault.device == "GPU-1"));
}

/// Each step reports the faults it took, as the record counts them: the first report and every
/// repeat, with the count it stood for; a level still present, a tick, a clear take none; a
/// report past a cap is the overflow fault's.
#[test]
fn steps_report_the_faults_they_took() {
    let mut r = Rig::new("max_active_per_device: 2\n");
    let took = |r: &Rig| -> Vec<(String, String, u64)> {
        r.engine
            .reports()
            .iter()
            .map(|p| (p.code.clone(), p.device.clone(), p.count))
            .collect()
    };
    let gpu = "GPU-0000:3b:00.0".to_string();
    r.at(0, xid(13, "3b:00.0"));
    assert_eq!(took(&r), [("Xid13".into(), gpu.clone(), 1)]);
    r.at(1, xid(13, "3b:00.0"));
    assert_eq!(took(&r), [("Xid13".into(), gpu.clone(), 1)], "a repeat");
    let mut loss = Signal::new(Source::Kmsg, FaultCode::named("KMSG_LOSS"), None, "lost");
    loss.count = 40;
    r.at(2, Observation::Signal(loss));
    assert_eq!(took(&r), [("KMSG_LOSS".into(), "node".into(), 40)]);
    r.at(3, Observation::Tick);
    assert!(took(&r).is_empty(), "a tick");
    let link = || Observation::Level {
        source: Source::Nvml,
        device: Some(DeviceRef::named("GPU-1")),
        domain: "nvml-nvlink".into(),
        present: vec![Signal::new(
            Source::Nvml,
            FaultCode::named("NVLINK_DOWN"),
            None,
            "down",
        )],
    };
    r.at(4, link());
    assert_eq!(took(&r), [("NVLINK_DOWN".into(), "GPU-1".into(), 1)]);
    r.at(5, link());
    assert!(took(&r).is_empty(), "a level still present");
    r.at(6, xid(31, "3b:00.0"));
    r.at(7, xid(43, "3b:00.0"));
    assert_eq!(took(&r), [(FOLDED_CODE.into(), gpu.clone(), 1)], "folded");
    r.at(
        8,
        Observation::OperatorClear {
            code: None,
            device: None,
        },
    );
    assert!(took(&r).is_empty(), "a clear");
}

/// The inventory is what the polled sources reported: GPUs with an index (and their PCI
/// addresses), listed devices; not a GPU the kernel log alone named.
#[test]
fn the_inventory_is_what_polled_sources_reported() {
    let mut r = Rig::new("");
    r.at(
        0,
        Observation::DeviceSeen {
            pci: pci("3b:00.0"),
            uuid: Some("GPU-aaaa".into()),
            index: Some(0),
        },
    );
    r.at(
        0,
        Observation::DeviceSeen {
            pci: pci("86:00.0"),
            uuid: Some("GPU-bbbb".into()),
            index: None,
        },
    );
    r.at(
        0,
        Observation::Inventory {
            kind: "Ascend910".into(),
            names: vec!["Ascend910-0".into(), "Ascend910-1".into()],
        },
    );
    for d in ["GPU-0", "pci-0000:3b:00.0", "Ascend910-0", "Ascend910-1"] {
        assert!(r.engine.in_inventory(d), "{d}");
    }
    for d in [
        "GPU-1",
        "GPU-00",
        "GPU-0000:86:00.0",
        "pci-0000:86:00.0",
        "pci-3b:00.0",
        "Ascend910-2",
        "node",
        "nvswitch0",
        "",
    ] {
        assert!(!r.engine.in_inventory(d), "{d}");
    }
}
