//! Recovery: faults end when a source says the condition is gone (after the code's recovery
//! hold), when a recovery rule's quiet time passes, or when an operator clears them; recovered
//! faults are kept as bounded history.

use jiff::Timestamp;

use super::escalation::{escalate, sticky};
use super::{Engine, EngineEvent, FaultState};
use crate::policy::Policy;
use crate::time::{signed, since};

impl Engine {
    pub(super) fn tick(&mut self, policy: &Policy, now: Timestamp, events: &mut Vec<EngineEvent>) {
        for f in self.faults.values_mut() {
            if !f.fault.active {
                continue;
            }
            escalate(policy, f, now, events);
            if let Some(resolving) = f.resolving_since {
                let hold = policy.recover_hold(&f.fault.fault_code);
                if since(now, resolving) >= signed(hold) {
                    let why = format!(
                        "gone for {} (recovery hold)",
                        humantime::format_duration(hold)
                    );
                    recover(f, now, why, events);
                }
                continue;
            }
            if sticky(f) {
                continue;
            }
            let quiet = since(now, f.fault.last_seen);
            let rule = policy.recovery.iter().find(|r| {
                (r.codes.is_empty() || r.codes.contains(&f.fault.fault_code))
                    && (r.sources.is_empty() || r.sources.contains(&f.fault.source))
                    && r.max_handling.is_none_or(|m| f.fault.fault_handling <= m)
                    && quiet >= signed(r.clear_after)
            });
            if let Some(r) = rule {
                let why = format!(
                    "quiet for {} (recovery rule {})",
                    humantime::format_duration(r.clear_after),
                    r.name.as_deref().unwrap_or("unnamed")
                );
                recover(f, now, why, events);
            }
        }
    }
    /// Drops recovered faults past retention, then the oldest beyond the cap.
    pub(super) fn prune(&mut self, policy: &Policy, now: Timestamp) {
        let retention = signed(policy.recovered_retention);
        let before = self.faults.len();
        self.faults.retain(|_, f| {
            f.fault.active
                || f.fault
                    .recovered_at
                    .is_none_or(|r| since(now, r) < retention)
        });
        let mut recovered: Vec<(Timestamp, String)> = self
            .faults
            .iter()
            .filter(|(_, f)| !f.fault.active)
            .map(|(k, f)| (f.fault.recovered_at.unwrap_or(f.fault.last_seen), k.clone()))
            .collect();
        if recovered.len() > policy.max_recovered {
            recovered.sort();
            let excess = recovered.len() - policy.max_recovered;
            for (_, k) in recovered.into_iter().take(excess) {
                self.faults.remove(&k);
                self.dropped += 1;
            }
        }
        if self.faults.len() != before {
            self.revision += 1;
        }
    }
}

/// A source says the condition is gone: recover now, or start the code's recovery hold.
pub(super) fn resolve(
    policy: &Policy,
    f: &mut FaultState,
    now: Timestamp,
    reason: String,
    events: &mut Vec<EngineEvent>,
) {
    if !f.fault.active || sticky(f) {
        return;
    }
    let hold = policy.recover_hold(&f.fault.fault_code);
    if hold.is_zero() {
        recover(f, now, reason, events);
    } else if f.resolving_since.is_none() {
        f.resolving_since = Some(now);
    }
}

pub(super) fn recover(
    f: &mut FaultState,
    now: Timestamp,
    reason: String,
    events: &mut Vec<EngineEvent>,
) {
    f.resolving_since = None;
    f.fault.active = false;
    f.fault.recovered_at = Some(now);
    events.push(EngineEvent::Recovered {
        code: f.fault.fault_code.clone(),
        device: f.fault.device.clone(),
        reason,
    });
}
