//! Escalation: a fault's handling raised by the policy's frequency and duration rules, never
//! lowered while the fault is active; and which faults are sticky (only an operator clears them).

use jiff::Timestamp;

use super::{set_handling, EngineEvent, FaultState};
use crate::policy::{EscalationRule, Policy};
use crate::record::Handling;
use crate::time::{signed, since};

/// `ManuallySeparateNPU` means a person must look: only an operator's clear ends such a fault,
/// not the condition going away, a reboot or a quiet period.
pub(super) fn sticky(f: &FaultState) -> bool {
    f.fault.fault_handling == Handling::ManuallySeparateNPU
}

/// When rule `r` raises `f`: `now` if it hits now, a later time if time alone will make it hit,
/// `None` if it does not apply to `f` (another code, or not above its level) or time alone never
/// will. A frequency rule hits now or never by itself (time passing only takes occurrences out
/// of its window); a duration rule when the fault has lasted its duration, and a condition
/// already gone (recovery hold running) stops that clock: then it hits now or never. The one
/// reading of a rule, for [`escalate`] and for the engine's next deadline.
pub(super) fn rule_due(r: &EscalationRule, f: &FaultState, now: Timestamp) -> Option<Timestamp> {
    if r.handling <= f.fault.fault_handling || !r.codes.contains(&f.fault.fault_code) {
        return None;
    }
    match (r.count, r.window, r.duration) {
        (Some(n), Some(w), _) => {
            let w = signed(w);
            let recent = f
                .occurrences
                .iter()
                .filter(|t| since(now, **t) <= w)
                .count();
            (recent >= n as usize).then_some(now)
        }
        (_, _, Some(d)) => match f.resolving_since {
            Some(until) => (since(until, f.active_since) >= signed(d)).then_some(now),
            None => f.active_since.checked_add(signed(d)).ok(),
        },
        _ => None,
    }
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
        if rule_due(r, f, now).is_some_and(|t| t <= now) {
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
