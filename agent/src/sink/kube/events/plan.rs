//! The Event sink's pure decisions: which notices become Events, and what each says. No I/O;
//! tested below.

use faultline_core::engine::EngineEvent;

/// The reason of the Event that says the taint budget withholds a taint.
pub(crate) const TAINT_WITHHELD_REASON: &str = "TaintBudgetExceeded";

/// Something the Event sink publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Notice {
    Engine(EngineEvent),
    /// The budget held back these taints.
    TaintWithheld {
        taints: Vec<String>,
        used: u32,
        limit: u32,
        nodes: u32,
    },
}

/// An Event on the Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EventSpec {
    pub warning: bool,
    pub reason: &'static str,
    /// The Recorder groups repeats by (type, reason, action): the action names the fault, so
    /// two faults are two Events and a fault seen again is one Event with a higher count.
    pub action: String,
    pub note: String,
}

fn clip(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max.saturating_sub(3);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

/// The Event for a notice, if it gets one (new faults, escalations, recoveries, withheld
/// taints; policy reclassifications and verdict changes are in the condition and the record).
pub(crate) fn event_for(n: &Notice) -> Option<EventSpec> {
    let spec = match n {
        Notice::Engine(EngineEvent::NewFault {
            code,
            device,
            handling,
            message,
        }) => EventSpec {
            warning: true,
            reason: "FaultDetected",
            action: format!("{code}/{device}"),
            note: format!("{code} on {device} ({handling}): {message}"),
        },
        Notice::Engine(EngineEvent::Escalated {
            code,
            device,
            from,
            to,
            rule,
        }) => EventSpec {
            warning: true,
            reason: "FaultEscalated",
            action: format!("{code}/{device}"),
            note: format!("{code} on {device} escalated from {from} to {to} by rule {rule}"),
        },
        Notice::Engine(EngineEvent::Recovered {
            code,
            device,
            reason,
        }) => EventSpec {
            warning: false,
            reason: "FaultRecovered",
            action: format!("{code}/{device}"),
            note: format!("{code} on {device} recovered: {reason}"),
        },
        Notice::TaintWithheld {
            taints,
            used,
            limit,
            nodes,
        } => EventSpec {
            warning: true,
            reason: TAINT_WITHHELD_REASON,
            action: "Taint".to_string(),
            note: format!(
                "withheld {}: {used} of {nodes} nodes were newly tainted by faultline within the budget window (limit {limit})",
                taints.join(", ")
            ),
        },
        Notice::Engine(_) => return None,
    };
    Some(EventSpec {
        action: clip(spec.action, 128),
        note: clip(spec.note, 1024),
        ..spec
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_core::record::{Handling, Health};

    #[test]
    fn events_per_notice() {
        let new = Notice::Engine(EngineEvent::NewFault {
            code: "Xid79".into(),
            device: "GPU-3".into(),
            handling: Handling::SeparateNPU,
            message: "GPU has fallen off the bus".into(),
        });
        let e = event_for(&new).unwrap();
        assert_eq!(
            (e.warning, e.reason, e.action.as_str()),
            (true, "FaultDetected", "Xid79/GPU-3")
        );
        assert!(e.note.contains("fallen off the bus") && e.note.contains("SeparateNPU"));
        let rec = Notice::Engine(EngineEvent::Recovered {
            code: "Xid79".into(),
            device: "GPU-3".into(),
            reason: "reboot".into(),
        });
        assert_eq!(event_for(&rec).unwrap().reason, "FaultRecovered");
        assert!(!event_for(&rec).unwrap().warning);
        let health = Notice::Engine(EngineEvent::HealthChanged {
            from: Health::Healthy,
            to: Health::Unhealthy,
        });
        assert_eq!(event_for(&health), None);
        let w = Notice::TaintWithheld {
            taints: vec!["faultline.io/unhealthy=Xid79:NoSchedule".into()],
            used: 2,
            limit: 2,
            nodes: 20,
        };
        let e = event_for(&w).unwrap();
        assert_eq!(e.reason, "TaintBudgetExceeded");
        assert!(e.note.contains("2 of 20"), "{}", e.note);
        let long = Notice::Engine(EngineEvent::NewFault {
            code: "Xid79".into(),
            device: "d".repeat(300),
            handling: Handling::SeparateNPU,
            message: "é".repeat(2000),
        });
        let e = event_for(&long).unwrap();
        assert!(e.action.len() <= 128 && e.note.len() <= 1024);
    }
}
