//! Rebuilding the engine from a published record, for when the saved state (`state.json`) is
//! lost or unreadable but the record (`faults.json`) is intact: starting empty would publish a
//! node as Healthy that the last record called Unhealthy.
//!
//! What the record does not carry is rebuilt conservatively: the occurrence history is the last
//! occurrence only (frequency rules count again from there), the level before escalation is
//! `escalated_from`, and the fault keeps its key (PCI address, else UUID, else device name), so
//! the next signal about it merges instead of starting a second fault.

use std::collections::VecDeque;

use super::{Ctx, Engine, FaultCodeRepr, FaultState};
use crate::catalog::ascend::is_fault_code;
use crate::catalog::{nvml, FaultCode};
use crate::record::{Fault, FaultType, Handling, NodeRecord, Source};

/// Which of a record's faults to rebuild.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreScope {
    /// The record was written during the current boot: kernel-log faults still describe it.
    pub same_boot: bool,
}

impl RestoreScope {
    /// Active faults only; of those, every operator-held (sticky) fault, the edge-triggered ones
    /// (kernel log, the agent's own) and NVML's, whose domain follows from the code
    /// ([`crate::catalog::nvml`]) so that its next poll ends them if they are gone. The Ascend
    /// tools and peer verdicts report what is still true at their first poll and run. Kernel-log
    /// faults of an earlier boot are not rebuilt (a reboot ends them), unless an operator must
    /// clear them.
    pub fn keeps(&self, f: &Fault) -> bool {
        if !f.active {
            return false;
        }
        if f.fault_handling == Handling::ManuallySeparateNPU {
            return true;
        }
        // Detectors report their own state at start; an old one could never be cleared by a
        // detector that is not started again.
        if f.fault_code == "DETECTOR_DOWN" {
            return false;
        }
        match f.source {
            Source::Ascend | Source::Peer => false,
            Source::Kmsg => self.same_boot,
            Source::Nvml | Source::Agent => true,
        }
    }
}

impl Engine {
    /// An engine holding the faults of `record` that `scope` keeps. The catalog and policy in
    /// `ctx` recover what the code string does not say (whether an SXid was fatal).
    pub fn from_record(record: &NodeRecord, scope: RestoreScope, ctx: Ctx<'_>) -> Engine {
        let mut e = Engine::new();
        for f in record.faults.iter().filter(|f| scope.keeps(f)) {
            let device_key = f
                .pci_bus_id
                .clone()
                .or_else(|| f.device_uuid.clone())
                .unwrap_or_else(|| f.device.clone());
            let key = format!("{}/{}", f.fault_code, device_key);
            let state = FaultState {
                fault: f.clone(),
                code: code_repr(f, ctx),
                device_key,
                base: f.escalated_from.unwrap_or(f.fault_handling),
                escalated: f.escalated_from.map(|_| f.fault_handling),
                occurrences: VecDeque::from([f.last_seen]),
                active_since: f.first_seen,
                domain: level_domain(f),
                resolving_since: None,
                folded: super::caps::folded_from_record(f),
            };
            e.faults.insert(key, state);
        }
        e.revision += 1;
        e
    }
}

/// The `Level` domain a fault of a level-triggered source is reported in, when its code alone
/// tells (NVML's conditions).
fn level_domain(f: &Fault) -> Option<String> {
    match f.source {
        Source::Nvml => nvml::domain(&f.fault_code).map(str::to_string),
        _ => None,
    }
}

/// The code behind a record's `fault_code` (the inverse of `FaultCode`'s display). An SXid's
/// severity is not in the string: it is the one whose classification gives the fault's level
/// before escalation (fatal when both or neither do).
fn code_repr(f: &Fault, ctx: Ctx<'_>) -> FaultCodeRepr {
    let c = f.fault_code.as_str();
    if let Some(code) = c.strip_prefix("SXid").and_then(|n| n.parse().ok()) {
        let base = f.escalated_from.unwrap_or(f.fault_handling);
        let level = |fatal| {
            ctx.policy
                .classify(ctx.catalog, &FaultCode::Sxid { code, fatal })
                .handling
        };
        let fatal = !(level(false) == base && level(true) != base);
        return FaultCodeRepr::Sxid { sxid: code, fatal };
    }
    if let Some(xid) = c.strip_prefix("Xid").and_then(|n| n.parse().ok()) {
        return FaultCodeRepr::Xid { xid };
    }
    if f.source == Source::Ascend && is_fault_code(c) {
        return FaultCodeRepr::Ascend {
            code: c.to_string(),
            network: f.fault_type == FaultType::CardNetworkUnhealthy,
            severe: f.fault_handling >= Handling::SeparateNPU,
        };
    }
    FaultCodeRepr::Named {
        name: c.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{Catalog, FaultCode};
    use crate::engine::{Ctx, DeviceRef, Observation, Signal};
    use crate::policy::Policy;
    use crate::record::Health;
    use jiff::Timestamp;

    fn ctx() -> Ctx<'static> {
        static P: std::sync::OnceLock<(Policy, Catalog)> = std::sync::OnceLock::new();
        let (policy, catalog) = P.get_or_init(|| (Policy::default(), Catalog::builtin().unwrap()));
        Ctx { policy, catalog }
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_790_000_000 + s).unwrap()
    }

    /// An engine with one fault from each kind of source, and its record.
    fn record() -> (Engine, NodeRecord) {
        let (policy, catalog) = (Policy::default(), Catalog::builtin().unwrap());
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut e = Engine::new();
        let pci = |s: &str| Some(DeviceRef::pci(s.parse().unwrap()));
        let sig = |src, code, dev| Observation::Signal(Signal::new(src, code, dev, "m"));
        e.step(
            ctx,
            sig(Source::Kmsg, FaultCode::Xid(79), pci("0000:3b:00.0")),
            t(0),
        );
        e.step(
            ctx,
            sig(Source::Nvml, FaultCode::named("GPU_MISSING"), None),
            t(1),
        );
        e.step(
            ctx,
            sig(
                Source::Ascend,
                FaultCode::Ascend {
                    code: "80E01801".into(),
                    network: false,
                    severe: true,
                },
                Some(DeviceRef::named("Ascend910-1")),
            ),
            t(2),
        );
        e.step(
            ctx,
            sig(
                Source::Kmsg,
                FaultCode::Sxid {
                    code: 12028,
                    fatal: true,
                },
                pci("0000:05:00.0"),
            ),
            t(3),
        );
        let v = e.view(&policy);
        let record = NodeRecord {
            api_version: crate::record::API_VERSION.into(),
            node: "n".into(),
            health: v.health,
            handling: v.handling,
            update_time: t(4),
            check_code: crate::record::check_code(&v.faults),
            faults: v.faults,
            dropped_faults: 0,
            agent: crate::record::AgentStatus {
                version: "0".into(),
                policy: crate::record::PolicyStatus {
                    source: "builtin".into(),
                    checksum: String::new(),
                    error: None,
                    loading: None,
                },
                detectors: Vec::new(),
                taint_budget: None,
                heartbeat_time: None,
                heartbeat_boot: None,
            },
        };
        (e, record)
    }

    fn codes(e: &Engine) -> Vec<String> {
        let mut v: Vec<String> = e.faults().map(|f| f.fault.fault_code.clone()).collect();
        v.sort();
        v
    }

    #[test]
    fn the_record_rebuilds_what_no_poll_would_bring_back() {
        let (_, record) = record();
        let same = Engine::from_record(&record, RestoreScope { same_boot: true }, ctx());
        assert_eq!(
            codes(&same),
            ["GPU_MISSING", "SXid12028", "Xid79"],
            "not the Ascend fault: its next poll says"
        );
        let rebooted = Engine::from_record(&record, RestoreScope { same_boot: false }, ctx());
        assert_eq!(
            codes(&rebooted),
            ["GPU_MISSING"],
            "a reboot ends kernel-log faults"
        );
        let policy = Policy::default();
        assert_eq!(same.health(&policy), Health::Unhealthy);
        assert_eq!(
            same.faults()
                .find(|f| f.fault.fault_code == "SXid12028")
                .map(|f| f.code.clone()),
            Some(FaultCodeRepr::Sxid {
                sxid: 12028,
                fatal: true
            })
        );
    }

    /// A rebuilt fault keeps its key: the same Xid again merges into it.
    #[test]
    fn a_rebuilt_fault_merges_with_the_next_signal() {
        let (_, record) = record();
        let (policy, catalog) = (Policy::default(), Catalog::builtin().unwrap());
        let ctx = Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut e = Engine::from_record(&record, RestoreScope { same_boot: true }, ctx);
        let dev = Some(DeviceRef::pci("0000:3b:00.0".parse().unwrap()));
        e.step(
            ctx,
            Observation::Signal(Signal::new(Source::Kmsg, FaultCode::Xid(79), dev, "again")),
            t(10),
        );
        let xids: Vec<u64> = e
            .faults()
            .filter(|f| f.fault.fault_code == "Xid79")
            .map(|f| f.fault.count)
            .collect();
        assert_eq!(xids, [2]);
    }

    /// A fault only an operator may clear survives even a reboot and a level-triggered source.
    #[test]
    fn operator_held_faults_are_always_rebuilt() {
        let (_, mut record) = record();
        for f in &mut record.faults {
            if f.source == Source::Ascend {
                f.fault_handling = Handling::ManuallySeparateNPU;
            }
        }
        let e = Engine::from_record(&record, RestoreScope { same_boot: false }, ctx());
        assert!(codes(&e).contains(&"80E01801".to_string()));
    }

    /// What the agent does with a restored engine before anything else (its engine loop,
    /// `runtime.rs`): `reclassify` under the policy in force, as a reload does. Each row: the
    /// policy the fault was raised under, the one in force at the restart, and the level the
    /// restored fault, the same fault recurring and the same code on another device then have,
    /// whether the engine came back from `state.json` or from the record.
    #[test]
    fn restored_faults_take_the_policy_in_force() {
        use crate::engine::EngineEvent;
        let not_handled = "overrides:\n  Xid13: { handling: NotHandleFault }\n";
        let held = "overrides:\n  Xid13: { handling: ManuallySeparateNPU }\n";
        let rows = [
            (not_handled, "", Handling::RestartBusiness),
            ("", not_handled, Handling::NotHandleFault),
            (held, "", Handling::RestartBusiness),
            ("", held, Handling::ManuallySeparateNPU),
            (not_handled, not_handled, Handling::NotHandleFault),
        ];
        let catalog = Catalog::builtin().unwrap();
        let gpu = |s: &str| Some(DeviceRef::pci(s.parse().unwrap()));
        let xid13 =
            |dev| Observation::Signal(Signal::new(Source::Kmsg, FaultCode::Xid(13), dev, "m"));
        for (then, now, want) in rows {
            let then = Policy::parse(then).unwrap();
            let now = Policy::parse(now).unwrap();
            let old = Ctx {
                policy: &then,
                catalog: &catalog,
            };
            let ctx = Ctx {
                policy: &now,
                catalog: &catalog,
            };
            let mut saved = Engine::new();
            saved.step(old, xid13(gpu("0000:3b:00.0")), t(0));
            let v = saved.view(&then);
            let (_, mut record) = record();
            record.faults = v.faults;
            let from_state: Engine =
                serde_json::from_str(&serde_json::to_string(&saved).unwrap()).unwrap();
            let from_record = Engine::from_record(&record, RestoreScope { same_boot: true }, ctx);
            for (how, mut e) in [("state", from_state), ("record", from_record)] {
                let events = e.reclassify(ctx);
                let level = |e: &Engine, pci: &str| {
                    e.faults()
                        .find(|f| f.fault.pci_bus_id.as_deref() == Some(pci))
                        .map(|f| f.fault.fault_handling)
                };
                assert_eq!(level(&e, "0000:3b:00.0"), Some(want), "{how}: restored");
                let moved = events
                    .iter()
                    .any(|ev| matches!(ev, EngineEvent::Reclassified { .. }));
                let was = saved.faults().next().unwrap().fault.fault_handling;
                assert_eq!(moved, was != want, "{how}: announced when it moved");
                e.step(ctx, xid13(gpu("0000:3b:00.0")), t(60));
                assert_eq!(level(&e, "0000:3b:00.0"), Some(want), "{how}: recurred");
                e.step(ctx, xid13(gpu("0000:86:00.0")), t(60));
                assert_eq!(level(&e, "0000:86:00.0"), Some(want), "{how}: a new one");
            }
        }
    }
}
