//! The view: the node verdict, the desired labels, taints and condition, and the record's fault
//! list, derived from the engine's state and the policy.

use std::collections::BTreeMap;

use super::{DesiredCondition, DesiredTaint, Engine, FaultState, NodeView, HEALTH_LABEL};
use crate::policy::Policy;
use crate::record::Health;

impl Engine {
    /// The node verdict: the most severe health any active fault's level maps to.
    pub fn health(&self, policy: &Policy) -> Health {
        self.faults
            .values()
            .filter(|f| f.fault.active)
            .map(|f| policy.health_of(f.fault.fault_handling))
            .max()
            .unwrap_or(Health::Healthy)
    }
    /// [`Engine::health`] as of the last step that caused an event (see [`Engine::step`]).
    pub(super) fn cached_health(&mut self, policy: &Policy) -> Health {
        match self.health_cache.0 {
            Some(h) => h,
            None => {
                let h = self.health(policy);
                self.health_cache.0 = Some(h);
                h
            }
        }
    }
    /// The desired node state and the record's fault list.
    pub fn view(&self, policy: &Policy) -> NodeView {
        let mut active: Vec<&FaultState> =
            self.faults.values().filter(|f| f.fault.active).collect();
        active.sort_by(|a, b| {
            b.fault
                .fault_handling
                .cmp(&a.fault.fault_handling)
                .then_with(|| a.fault.fault_code.cmp(&b.fault.fault_code))
                .then_with(|| a.fault.device.cmp(&b.fault.device))
        });
        let health = self.health(policy);
        let handling = active.first().map(|f| f.fault.fault_handling);
        // One taint per key, valued by the most severe fault mapped to it.
        let mut taints: BTreeMap<String, DesiredTaint> = BTreeMap::new();
        let mut condition = true;
        for f in &active {
            let action = policy.node_action(f.fault.fault_handling);
            condition &= action.condition;
            if let Some(t) = action.taint {
                taints.entry(t.key.clone()).or_insert(DesiredTaint {
                    key: t.key,
                    value: f.fault.fault_code.clone(),
                    effect: t.effect,
                });
            }
        }
        let condition = match active.first() {
            None => DesiredCondition {
                status: true,
                reason: "NoFaults".into(),
                message: "no active accelerator faults".into(),
            },
            Some(worst) => DesiredCondition {
                status: condition,
                reason: worst.fault.fault_handling.to_string(),
                message: summarize(&active),
            },
        };
        let mut recovered: Vec<&FaultState> =
            self.faults.values().filter(|f| !f.fault.active).collect();
        recovered.sort_by(|a, b| {
            b.fault
                .recovered_at
                .cmp(&a.fault.recovered_at)
                .then_with(|| a.fault.fault_code.cmp(&b.fault.fault_code))
                .then_with(|| a.fault.device.cmp(&b.fault.device))
        });
        NodeView {
            health,
            handling,
            labels: BTreeMap::from([(HEALTH_LABEL.to_string(), health.to_string())]),
            taints: taints.into_values().collect(),
            condition,
            faults: active
                .iter()
                .chain(recovered.iter())
                .map(|f| f.fault.clone())
                .collect(),
            dropped_faults: self.dropped,
            inventory: self.inventory.clone(),
        }
    }
}

/// A one-line summary of active faults for the condition message.
fn summarize(active: &[&FaultState]) -> String {
    let mut parts: Vec<String> = active
        .iter()
        .take(5)
        .map(|f| {
            format!(
                "{} on {} ({})",
                f.fault.fault_code, f.fault.device, f.fault.fault_handling
            )
        })
        .collect();
    if active.len() > 5 {
        parts.push(format!("and {} more", active.len() - 5));
    }
    parts.join("; ")
}
