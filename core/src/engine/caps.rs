//! Caps: what the engine keeps is bounded by design, so that everything the agent writes it can
//! read back at the next start and serve to every reader.
//!
//! - At most `max_active_per_device` active faults per device and `max_active` on the node
//!   (the policy). A new fault past a cap is not added: it is folded into one overflow fault,
//!   `FAULTS_FOLDED`, of its device (or of the node, when the node is at its cap), which counts
//!   what it holds and carries the worst level among it, so folding never makes the verdict
//!   better. The agent's own faults (a detector down, kernel-log loss) are never folded: they
//!   are few, and each says something about the agent itself.
//! - Every string a signal brings from outside (the message, a device's name and UUID) is cut
//!   to a fixed size measured as JSON, so one fault's size is bounded too.
//! - At most [`MAX_DEVICES`] devices' identities are remembered.

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::{
    set_handling, Ctx, DeviceRef, Engine, EngineEvent, FaultCodeRepr, FaultState, Observation,
    Signal,
};
use crate::catalog::FaultCode;
use crate::record::{Fault, FaultType, Handling, Source};
use std::collections::VecDeque;

/// The overflow fault's code.
pub const FOLDED_CODE: &str = "FAULTS_FOLDED";

/// Largest message kept, in bytes of its JSON string (escapes counted).
pub const MAX_MESSAGE_JSON: usize = 1024;
/// Largest device name or UUID kept, in bytes of its JSON string.
pub const MAX_NAME_JSON: usize = 128;
/// Most device identities (PCI address to UUID and index) remembered. A node has a few dozen
/// PCI devices that the sources name; a kernel log naming thousands is not a real node.
pub const MAX_DEVICES: usize = 1024;

/// What an overflow fault holds beyond its record entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Folded {
    /// The worst level folded in since the overflow fault became active.
    pub worst: Handling,
    /// The code of the fault that brought `worst` (the first at that level).
    pub worst_code: String,
    /// Its fault type, which the overflow fault takes (a card's overflow is a card fault).
    pub fault_type: FaultType,
}

/// How many bytes `c` takes inside a JSON string as serde_json writes it.
fn json_len(c: char) -> usize {
    match c {
        '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
        c if (c as u32) < 0x20 => 6,
        c => c.len_utf8(),
    }
}

/// Cuts `s` so that its JSON string takes at most `max` bytes (quotes not counted); a cut
/// string ends with `…`.
pub fn clamp_json(s: &mut String, max: usize) {
    if s.chars().map(json_len).sum::<usize>() <= max {
        return;
    }
    let room = max.saturating_sub('…'.len_utf8());
    let mut used = 0;
    let mut end = 0;
    for (i, c) in s.char_indices() {
        used += json_len(c);
        if used > room {
            break;
        }
        end = i + c.len_utf8();
    }
    s.truncate(end);
    s.push('…');
}

/// Cuts what an observation brings from outside to its bounds, before anything is keyed by it
/// (a level's present signals are matched with the faults by key).
pub(super) fn clamp(obs: &mut Observation) {
    match obs {
        Observation::Signal(s) => clamp_signal(s),
        Observation::Level {
            device, present, ..
        } => {
            if let Some(d) = device.as_mut() {
                clamp_device(d);
            }
            present.iter_mut().for_each(clamp_signal);
        }
        Observation::DeviceSeen {
            uuid: Some(uuid), ..
        } => clamp_json(uuid, MAX_NAME_JSON),
        Observation::Detector {
            reason: Some(reason),
            ..
        } => clamp_json(reason, MAX_MESSAGE_JSON),
        _ => {}
    }
}

fn clamp_signal(s: &mut Signal) {
    clamp_json(&mut s.message, MAX_MESSAGE_JSON);
    if let Some(d) = s.device.as_mut() {
        clamp_device(d);
    }
}

fn clamp_device(d: &mut DeviceRef) {
    for v in [d.name.as_mut(), d.uuid.as_mut()].into_iter().flatten() {
        clamp_json(v, MAX_NAME_JSON);
    }
}

fn folded_key(device_key: &str) -> String {
    format!("{FOLDED_CODE}/{device_key}")
}

/// Where a fold goes: the overflow fault of a device, or the node's.
struct Target {
    device_key: String,
    device: String,
    uuid: Option<String>,
    pci: Option<String>,
}

impl Engine {
    /// Where a signal that would add an active fault on `device_key` must be folded, if a cap is
    /// reached; `None`: there is room. The device's overflow fault counts toward the node's cap
    /// (so at most `max_active` active faults besides the node's overflow fault, plus the
    /// agent's own, which count but are never folded); the device's cap does not count it.
    fn fold_target(
        &self,
        ctx: Ctx<'_>,
        device_key: &str,
        names: (&str, Option<&String>, Option<&String>),
    ) -> Option<Target> {
        let node_key = folded_key("node");
        let device_folded = folded_key(device_key);
        let (mut on_device, mut on_node) = (0usize, 0usize);
        for (k, f) in self.faults.iter().filter(|(_, f)| f.fault.active) {
            if *k != node_key {
                on_node += 1;
            }
            if f.device_key == device_key && *k != device_folded {
                on_device += 1;
            }
        }
        let node = Target {
            device_key: "node".into(),
            device: "node".into(),
            uuid: None,
            pci: None,
        };
        if on_device >= ctx.policy.max_active_per_device {
            let open = self
                .faults
                .get(&device_folded)
                .is_some_and(|f| f.fault.active);
            if open || on_node < ctx.policy.max_active {
                let (device, uuid, pci) = names;
                return Some(Target {
                    device_key: device_key.to_string(),
                    device: device.to_string(),
                    uuid: uuid.cloned(),
                    pci: pci.cloned(),
                });
            }
            return Some(node);
        }
        (on_node >= ctx.policy.max_active).then_some(node)
    }

    /// Folds `s` (which would add an active fault on `device_key`) into an overflow fault if a
    /// cap is reached. Returns whether it did.
    pub(super) fn fold_if_capped(
        &mut self,
        ctx: Ctx<'_>,
        s: &Signal,
        device_key: &str,
        names: (&str, Option<&String>, Option<&String>),
        now: Timestamp,
        events: &mut Vec<EngineEvent>,
    ) -> bool {
        if s.source == Source::Agent {
            return false;
        }
        let Some(target) = self.fold_target(ctx, device_key, names) else {
            return false;
        };
        let at = s.at.unwrap_or(now);
        let count = s.count.max(1);
        let code = s.code.to_string();
        let class = ctx.policy.classify(ctx.catalog, &s.code);
        let key = folded_key(&target.device_key);
        let caps = (
            ctx.policy.max_active_per_device,
            ctx.policy.max_active,
            target.device_key == "node",
        );
        match self.faults.get_mut(&key) {
            Some(f) if f.fault.active => {
                f.fault.count = f.fault.count.saturating_add(count);
                if at > f.fault.last_seen {
                    f.fault.last_seen = at;
                }
                // Folded reports from several sources: no source's recovery (a reboot for the
                // kernel log's) may end what another's would not.
                if s.source != f.fault.source {
                    let was = f.fault.source;
                    f.fault.source = Source::Agent;
                    for src in [was, s.source] {
                        if src != Source::Agent && !f.fault.also_seen_by.contains(&src) {
                            f.fault.also_seen_by.push(src);
                        }
                    }
                    f.fault.also_seen_by.sort();
                }
                let folded = f.folded.get_or_insert_with(|| Folded {
                    worst: f.fault.fault_handling,
                    worst_code: code.clone(),
                    fault_type: f.fault.fault_type,
                });
                if class.handling > folded.worst {
                    folded.worst = class.handling;
                    folded.worst_code = code.clone();
                    folded.fault_type = class.fault_type;
                }
                let worst = folded.worst;
                if worst > f.fault.fault_handling {
                    let from = f.fault.fault_handling;
                    set_handling(&mut f.fault, worst);
                    f.fault.fault_type = class.fault_type;
                    events.push(EngineEvent::Escalated {
                        code: FOLDED_CODE.into(),
                        device: f.fault.device.clone(),
                        from,
                        to: worst,
                        rule: format!("folded {code}"),
                    });
                }
                f.fault.message = folded_message(f, caps, &code, &s.message);
            }
            existing => {
                let own = ctx
                    .policy
                    .classify(ctx.catalog, &FaultCode::named(FOLDED_CODE));
                let handling = own.handling.max(class.handling);
                let folded = Folded {
                    worst: class.handling,
                    worst_code: code.clone(),
                    fault_type: class.fault_type,
                };
                // A recovered overflow fault comes back as any fault does: its first report and
                // its count go on.
                let (occurrences, first_seen, count) = match existing {
                    Some(old) => {
                        let mut q = std::mem::take(&mut old.occurrences);
                        super::push_occurrence(&mut q, at);
                        (
                            q,
                            old.fault.first_seen,
                            old.fault.count.saturating_add(count),
                        )
                    }
                    None => (VecDeque::from([at]), at, count),
                };
                let mut f = FaultState {
                    fault: Fault {
                        fault_type: class.fault_type,
                        fault_code: FOLDED_CODE.into(),
                        fault_handling: handling,
                        fault_level: handling,
                        large_model_fault_level: handling,
                        device: target.device,
                        device_uuid: target.uuid,
                        pci_bus_id: target.pci,
                        source: s.source,
                        also_seen_by: Vec::new(),
                        message: String::new(),
                        first_seen,
                        last_seen: at,
                        count,
                        active: true,
                        recovered_at: None,
                        escalated_from: None,
                    },
                    code: FaultCodeRepr::Named {
                        name: FOLDED_CODE.into(),
                    },
                    device_key: target.device_key,
                    base: own.handling,
                    escalated: None,
                    occurrences,
                    active_since: at,
                    domain: None,
                    resolving_since: None,
                    folded: Some(folded),
                };
                f.fault.message = folded_message(&f, caps, &code, &s.message);
                events.push(EngineEvent::NewFault {
                    code: FOLDED_CODE.into(),
                    device: f.fault.device.clone(),
                    handling,
                    message: f.fault.message.clone(),
                });
                self.faults.insert(key.clone(), f);
            }
        }
        if let Some(f) = self.faults.get(&key) {
            self.reports.0.push(super::Report {
                code: f.fault.fault_code.clone(),
                device: f.fault.device.clone(),
                count,
            });
        }
        self.revision += 1;
        true
    }
}

/// The overflow fault's message: what it holds and why, the worst of it, the last one folded.
fn folded_message(
    f: &FaultState,
    (per_device, per_node, node): (usize, usize, bool),
    last_code: &str,
    last_message: &str,
) -> String {
    let cap = if node {
        format!("{per_node} active faults on the node")
    } else {
        format!("{per_device} active faults per device")
    };
    let worst = f
        .folded
        .as_ref()
        .map(|w| format!("{} ({})", w.worst_code, w.worst))
        .unwrap_or_default();
    let mut m = format!(
        "{} reports of faults past the cap of {cap} folded here; worst {worst}; last {last_code}: {last_message}",
        f.fault.count
    );
    clamp_json(&mut m, MAX_MESSAGE_JSON);
    m
}

/// An overflow fault rebuilt from a record keeps its level: what it holds is not in the record.
pub(super) fn folded_from_record(f: &Fault) -> Option<Folded> {
    (f.fault_code == FOLDED_CODE).then(|| Folded {
        worst: f.fault_handling,
        worst_code: FOLDED_CODE.into(),
        fault_type: f.fault_type,
    })
}

#[cfg(test)]
mod tests {
    //! Table tests of the caps, and properties: the caps hold, and folding never hides a fault.

    use proptest::prelude::*;

    use super::*;
    use crate::engine::tests::{t, Rig};
    use crate::policy::Policy;
    use crate::record::Health;

    const GPUS: [&str; 4] = [
        "0000:3b:00.0",
        "0000:86:00.0",
        "0001:c5:00.0",
        "0000:18:00.0",
    ];

    fn xid(x: u32, gpu: &str) -> Observation {
        Observation::Signal(Signal::new(
            Source::Kmsg,
            FaultCode::Xid(x),
            Some(DeviceRef::pci(gpu.parse().expect("pci"))),
            format!("NVRM: Xid (PCI:{gpu}): {x}"),
        ))
    }

    impl Rig {
        /// Active faults as `code@device:handling xcount`, worst first.
        fn active(&self) -> Vec<String> {
            self.engine
                .view(&self.policy)
                .faults
                .iter()
                .filter(|f| f.active)
                .map(|f| {
                    format!(
                        "{}@{}:{} x{}",
                        f.fault_code, f.device, f.fault_handling, f.count
                    )
                })
                .collect()
        }
        fn folded(&self, device: &str) -> Fault {
            self.engine
                .faults()
                .find(|f| f.fault.fault_code == "FAULTS_FOLDED" && f.fault.device == device)
                .unwrap_or_else(|| panic!("no overflow fault on {device}: {:?}", self.active()))
                .fault
                .clone()
        }
    }

    /// Past the per-device cap, new faults of a device fold into its one overflow fault, which
    /// counts them and carries the worst level among them (Xid 79 here: the node stays
    /// Unhealthy, as it would be without the cap); repeats of a kept fault still count there.
    /// Past the node cap (the device's overflow fault counts toward it), faults of any device
    /// fold into the node's overflow fault.
    #[test]
    fn the_excess_folds_into_one_fault_per_device_then_per_node() {
        let mut r = Rig::new("max_active_per_device: 2\nmax_active: 5\n");
        let a = GPUS[0];
        for x in [13, 31, 43, 79, 95] {
            r.at(0, xid(x, a));
        }
        r.at(1, xid(13, a)); // a kept fault repeats: counted on it, not folded
        r.at(2, xid(95, a)); // a folded one repeats: folded again
        assert_eq!(
            r.active(),
            [
                "FAULTS_FOLDED@GPU-0000:3b:00.0:SeparateNPU x4",
                "Xid13@GPU-0000:3b:00.0:RestartBusiness x2",
                "Xid31@GPU-0000:3b:00.0:RestartBusiness x1",
            ]
        );
        let f = r.folded("GPU-0000:3b:00.0");
        assert_eq!(f.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
        assert!(
            f.message
                .starts_with("4 reports of faults past the cap of 2 active faults per device folded here; worst Xid79 (SeparateNPU); last Xid95: NVRM"),
            "{}",
            f.message
        );
        assert_eq!(r.engine.health(&r.policy), Health::Unhealthy);

        // Node cap 5: three on GPU a (two and its overflow fault), two on b; then c folds into
        // the node's overflow fault, and so does b's third (no room for b's own overflow).
        r.at(3, xid(13, GPUS[1]));
        r.at(3, xid(31, GPUS[1]));
        r.at(4, xid(43, GPUS[2]));
        r.at(5, xid(94, GPUS[1]));
        let node = r.folded("node");
        assert_eq!(node.count, 2);
        assert_eq!(node.fault_handling, Handling::RestartBusiness);
        assert!(node.message.contains("cap of 5 active faults on the node"));
        // A further fault of GPU a still goes to a's own overflow fault.
        r.at(6, xid(48, a));
        assert_eq!(r.folded("GPU-0000:3b:00.0").count, 5);
        assert_eq!(r.engine.faults().filter(|f| f.fault.active).count(), 6);
    }

    /// The agent's own faults are never folded.
    #[test]
    fn the_agents_own_faults_are_not_folded() {
        let mut r = Rig::new("max_active_per_device: 1\nmax_active: 1\n");
        r.at(0, xid(13, GPUS[0]));
        for name in ["kmsg", "nvml"] {
            r.at(
                1,
                Observation::Detector {
                    name: name.into(),
                    state: super::super::DetectorState::Down,
                    reason: None,
                },
            );
        }
        let active = r.active();
        assert_eq!(
            active
                .iter()
                .filter(|a| a.starts_with("DETECTOR_DOWN"))
                .count(),
            2,
            "{active:?}"
        );
        assert!(!active.iter().any(|a| a.starts_with("FAULTS_FOLDED")));
    }

    /// The overflow fault ends as what it holds would have: kernel-log faults at a reboot, the
    /// application-level ones after an hour's quiet, an operator's clear; then, with room again,
    /// new faults are kept one by one. A folded `ManuallySeparateNPU` holds it until an
    /// operator clears it. Reports from two sources leave no source's recovery to end it.
    #[test]
    fn the_overflow_fault_recovers_like_what_it_holds() {
        let policy = "max_active_per_device: 1\nmax_active: 100\noverrides:\n  Xid43: { handling: ManuallySeparateNPU }\n";
        let boot = |id: &str| Observation::Boot { boot_id: id.into() };
        let a = GPUS[0];
        let mut r = Rig::new(policy);
        r.at(0, boot("b1"));
        r.at(0, xid(13, a));
        r.at(0, xid(31, a));
        assert_eq!(r.folded("GPU-0000:3b:00.0").count, 1);
        // Quiet for an hour: Xid13 and the overflow fault (holding Xid31) end together.
        r.at(3599, Observation::Tick);
        assert_eq!(r.active().len(), 2);
        r.at(3600, Observation::Tick);
        assert!(r.active().is_empty(), "{:?}", r.active());
        // Room again: a new fault is kept, the next one folded anew (its level judged afresh;
        // the count goes on, as any fault's that comes back).
        r.at(4000, xid(95, a));
        r.at(4000, xid(31, a));
        assert_eq!(
            r.active(),
            [
                "Xid95@GPU-0000:3b:00.0:RestartNPU x1",
                "FAULTS_FOLDED@GPU-0000:3b:00.0:RestartBusiness x2",
            ]
        );
        // Above RestartBusiness nothing recovers by quiet; a reboot ends kernel-log faults.
        r.at(4000, xid(79, a));
        r.at(9000, Observation::Tick);
        assert_eq!(r.active().len(), 2);
        r.at(9000, boot("b2"));
        assert!(r.active().is_empty(), "{:?}", r.active());

        // A folded ManuallySeparateNPU: held over a reboot until an operator clears it.
        r.at(9001, xid(13, a));
        r.at(9001, xid(43, a));
        r.at(9002, boot("b3"));
        assert_eq!(
            r.active(),
            ["FAULTS_FOLDED@GPU-0000:3b:00.0:ManuallySeparateNPU x4"]
        );
        r.at(
            9003,
            Observation::OperatorClear {
                code: Some("FAULTS_FOLDED".into()),
                device: None,
            },
        );
        assert!(r.active().is_empty());

        // Kernel log and NVML reports folded together: a reboot does not end it.
        r.at(9004, xid(13, a));
        r.at(9004, xid(31, a));
        r.at(
            9004,
            Observation::Signal(Signal::new(
                Source::Nvml,
                FaultCode::Xid(95),
                Some(DeviceRef::pci(a.parse().unwrap())),
                "event",
            )),
        );
        let f = r.folded("GPU-0000:3b:00.0");
        assert_eq!(
            (f.source, f.also_seen_by.clone()),
            (Source::Agent, vec![Source::Kmsg, Source::Nvml])
        );
        r.at(9005, boot("b4"));
        assert_eq!(r.active(), ["FAULTS_FOLDED@GPU-0000:3b:00.0:RestartNPU x6"]);
    }

    /// A policy reload re-judges the overflow fault's own code but keeps the worst of what it
    /// holds; a record's overflow fault rebuilt at start keeps its level too.
    #[test]
    fn the_overflow_fault_keeps_its_worst_over_a_reload_and_a_rebuild() {
        let mut r = Rig::new("max_active_per_device: 1\n");
        r.at(0, xid(13, GPUS[0]));
        r.at(0, xid(79, GPUS[0]));
        r.policy = Policy::parse(
            "max_active_per_device: 1\noverrides:\n  FAULTS_FOLDED: { handling: NotHandleFault }\n",
        )
        .unwrap();
        let ctx = Ctx {
            policy: &r.policy,
            catalog: &r.catalog,
        };
        r.engine.reclassify(ctx);
        let f = r.folded("GPU-0000:3b:00.0");
        assert_eq!(f.fault_handling, Handling::SeparateNPU);
        assert_eq!(f.fault_type, FaultType::CardUnhealthy);

        let v = r.engine.view(&r.policy);
        let record = crate::record::NodeRecord {
            api_version: crate::record::API_VERSION.into(),
            node: "n".into(),
            health: v.health,
            handling: v.handling,
            update_time: t(1),
            check_code: crate::record::check_code(&v.faults),
            faults: v.faults,
            dropped_faults: 0,
            agent: crate::record::AgentStatus {
                version: "0".into(),
                policy: Default::default(),
                detectors: Vec::new(),
                taint_budget: None,
                heartbeat_time: None,
                heartbeat_boot: None,
            },
        };
        let mut rebuilt = Engine::from_record(
            &record,
            crate::engine::RestoreScope { same_boot: true },
            ctx,
        );
        rebuilt.reclassify(ctx);
        assert_eq!(
            rebuilt.view(&r.policy).health,
            Health::Unhealthy,
            "{:?}",
            rebuilt.view(&r.policy).faults
        );
    }

    /// Strings from outside are cut to their size as JSON: escapes count, characters are never
    /// split, a cut string ends with `…`.
    #[test]
    fn strings_are_cut_to_their_json_size() {
        let rows: &[(&str, usize, &str)] = &[
            ("short", 10, "short"),
            ("0123456789", 10, "0123456789"),
            ("0123456789a", 10, "0123456…"),
            ("\"\"\"\"\"\"", 10, "\"\"\"…"),
            ("\u{1}\u{1}\u{1}", 10, "\u{1}…"),
            ("ééééééé", 10, "ééé…"),
        ];
        for (input, max, want) in rows {
            let mut s = input.to_string();
            clamp_json(&mut s, *max);
            assert_eq!(s, *want, "{input:?}");
            let json = serde_json::to_string(&s).unwrap();
            assert!(json.len() - 2 <= *max, "{json}");
        }
        // Through the engine: a huge message and device name are cut, and the fault is keyed by
        // the cut name (a level presenting it again finds it).
        let mut r = Rig::new("");
        let long = "x".repeat(100_000);
        let present = || {
            vec![Signal::new(
                Source::Ascend,
                FaultCode::named("NPU_LOST"),
                None,
                "\u{0}".repeat(100_000),
            )]
        };
        let lvl = |present| Observation::Level {
            source: Source::Ascend,
            device: Some(DeviceRef::named(&long)),
            domain: "d".into(),
            present,
        };
        r.at(0, lvl(present()));
        r.at(1, lvl(present()));
        let f = &r.engine.faults().next().unwrap().fault;
        assert!(f.active);
        assert!(serde_json::to_string(&f.message).unwrap().len() <= MAX_MESSAGE_JSON + 2);
        assert!(f.device.len() <= MAX_NAME_JSON);
        r.at(2, lvl(vec![]));
        assert!(!r.engine.faults().next().unwrap().fault.active);
    }

    fn arb_obs() -> impl Strategy<Value = (i64, Observation)> {
        let gpu = prop::sample::select(GPUS.to_vec());
        // Each code comes from one source, as on a node: a fault keeps the source that first
        // raised it (also after it recovered and came back), so one code from two sources would
        // make the two engines' histories, not their caps, differ.
        let xids = prop::sample::select(vec![13u32, 31, 43, 63, 74, 79, 95, 119, 99_999]);
        let named = prop::sample::select(vec![
            ("GPU_LOST", Source::Nvml),
            ("KMSG_LOSS", Source::Agent),
            ("MCE_CORRECTED", Source::Kmsg),
            ("STRAGGLER", Source::Peer),
        ]);
        let obs = prop_oneof![
            8 => (xids, gpu.clone()).prop_map(|(x, g)| xid(x, g)),
            2 => named.prop_map(|(c, s)| Observation::Signal(Signal::new(s, FaultCode::named(c), None, c))),
            1 => (xids_nvml(), gpu.clone()).prop_map(|(x, g)| Observation::Signal(Signal::new(
                Source::Nvml, FaultCode::Xid(x), Some(DeviceRef::pci(g.parse().unwrap())), "event"))),
            1 => Just(Observation::Tick),
            1 => prop::option::of(prop::sample::select(vec!["Xid79", "Xid13", "GPU_LOST"]))
                .prop_map(|c| Observation::OperatorClear { code: c.map(String::from), device: None }),
            1 => prop::sample::select(vec!["a", "b"]).prop_map(|b| Observation::Boot { boot_id: b.into() }),
            1 => (prop::option::of(gpu.clone()), prop::option::of(prop::sample::select(vec!["NVLINK_DOWN", "GPU_LOST"]))).prop_map(|(g, c)| Observation::Level {
                source: Source::Nvml,
                device: g.map(|g| DeviceRef::pci(g.parse().unwrap())),
                domain: "d".into(),
                present: c.map(|c| Signal::new(Source::Nvml, FaultCode::named(c), g.map(|g| DeviceRef::pci(g.parse().unwrap())), "level")).into_iter().collect(),
            }),
        ];
        (0i64..4000, obs)
    }

    fn xids_nvml() -> impl Strategy<Value = u32> {
        prop::sample::select(vec![48u32, 64, 92])
    }

    /// No escalation rules: a folded fault's occurrences are not kept, so it cannot escalate on
    /// its own (docs/policy.md, "Caps").
    const CAPPED: &str = "max_active_per_device: 2\nmax_active: 5\nrecovered_retention: 100000h\nmax_recovered: 1000\n";
    const UNCAPPED: &str = "max_active_per_device: 2048\nmax_active: 2048\nrecovered_retention: 100000h\nmax_recovered: 1000\n";

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// After every step: the caps hold; every fault the uncapped engine has active is active
        /// in the capped one at least as severe, or folded into an active overflow fault of its
        /// device or of the node that is; so the verdict is never better; and every report is
        /// counted once, kept or folded.
        #[test]
        fn caps_hold_and_folding_hides_nothing(obs in prop::collection::vec(arb_obs(), 1..120)) {
            let mut capped = Rig::new(CAPPED);
            let mut uncapped = Rig::new(UNCAPPED);
            let mut now = 0;
            let mut signals = 0u64;
            let levels = obs.iter().any(|(_, o)| matches!(o, Observation::Level { .. }));
            for (dt, o) in obs {
                now += dt;
                if matches!(o, Observation::Signal(_)) {
                    signals += 1;
                }
                capped.at(now, o.clone());
                uncapped.at(now, o);
                let active: Vec<&FaultState> = capped.engine.faults().filter(|f| f.fault.active).collect();
                let kept = active.iter().filter(|f| f.fault.source != Source::Agent || f.folded.is_some());
                let not_node_overflow = kept.filter(|f| !(f.folded.is_some() && f.device_key == "node")).count();
                prop_assert!(not_node_overflow <= 5, "{:?}", capped.active());
                for g in GPUS {
                    let on = active.iter().filter(|f| f.device_key == g && f.folded.is_none()).count();
                    prop_assert!(on <= 2, "{:?}", capped.active());
                }
                for u in uncapped.engine.faults().filter(|f| f.fault.active) {
                    let h = u.fault.fault_handling;
                    let covered = active.iter().any(|c| {
                        c.fault.fault_handling >= h
                            && ((c.fault.fault_code == u.fault.fault_code && c.device_key == u.device_key)
                                || (c.folded.is_some() && (c.device_key == u.device_key || c.device_key == "node")))
                    });
                    prop_assert!(covered, "{:?} not covered in {:?}", u.fault, capped.active());
                }
                prop_assert!(capped.engine.health(&capped.policy) >= uncapped.engine.health(&uncapped.policy));
            }
            // A level counts a condition when it appears, not each poll: only without levels is
            // every count a signal.
            if !levels {
                let counted: u64 = capped.engine.faults().map(|f| f.fault.count).sum();
                prop_assert_eq!(counted, signals);
            }
        }
    }
}
