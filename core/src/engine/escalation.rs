//! Escalation: a fault's handling raised by the policy's frequency and duration rules, never
//! lowered while the fault is active; and which faults are sticky (only an operator clears them).

use jiff::Timestamp;

use super::{set_handling, EngineEvent, FaultState};
use crate::policy::Policy;
use crate::record::Handling;
use crate::time::{signed, since};

/// `ManuallySeparateNPU` means a person must look: only an operator's clear ends such a fault,
/// not the condition going away, a reboot or a quiet period.
pub(super) fn sticky(f: &FaultState) -> bool {
    f.fault.fault_handling == Handling::ManuallySeparateNPU
}

/// Applies the escalation rules that match; never lowers a fault.
pub(super) fn escalate(
    policy: &Policy,
    f: &mut FaultState,
    now: Timestamp,
    events: &mut Vec<EngineEvent>,
) {
    if !f.fault.active {
        return;
    }
    for (i, r) in policy.escalation_rules().enumerate() {
        if r.handling <= f.fault.fault_handling || !r.codes.contains(&f.fault.fault_code) {
            continue;
        }
        let hit = match (r.count, r.window, r.duration) {
            (Some(n), Some(w), _) => {
                let w = signed(w);
                let recent = f
                    .occurrences
                    .iter()
                    .filter(|t| since(now, **t) <= w)
                    .count();
                recent >= n as usize
            }
            (_, _, Some(d)) => {
                // A condition already gone (recovery hold running) stops the clock.
                let until = f.resolving_since.unwrap_or(now);
                since(until, f.active_since) >= signed(d)
            }
            _ => false,
        };
        if hit {
            let from = f.fault.fault_handling;
            f.escalated = Some(r.handling);
            f.fault.escalated_from = Some(f.base);
            set_handling(&mut f.fault, r.handling);
            events.push(EngineEvent::Escalated {
                code: f.fault.fault_code.clone(),
                device: f.fault.device.clone(),
                from,
                to: r.handling,
                rule: r.name.clone().unwrap_or_else(|| format!("escalation[{i}]")),
            });
        }
    }
}
