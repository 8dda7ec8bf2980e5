//! The node sink's pure decisions: the taints, the `AcceleratorHealthy` condition and the
//! health label to write, given the Node as the API server has it and what the engine wants.
//! No I/O; every function here is table-tested below.

use std::collections::BTreeMap;

use faultline_core::engine::{DesiredCondition, DesiredTaint, HEALTH_LABEL};
use faultline_core::policy::TaintEffect;
use faultline_core::time::Timestamp;
use k8s_openapi::api::core::v1::{NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// Taints, labels and ConfigMaps the agent owns all live under this prefix.
pub(crate) const OWNED_PREFIX: &str = "faultline.io/";
/// The condition type the agent owns.
pub(crate) const CONDITION_TYPE: &str = "AcceleratorHealthy";

/// The record's and the API's time types are the same (jiff's `Timestamp`): no conversion.
fn time(t: Timestamp) -> Time {
    Time(t)
}

/// Taints that keep pods off a node (the budget counts these); `PreferNoSchedule` is a hint.
pub(crate) fn is_hard(effect: &str) -> bool {
    effect == TaintEffect::NoSchedule.as_str() || effect == TaintEffect::NoExecute.as_str()
}

fn owned(key: &str) -> bool {
    key.starts_with(OWNED_PREFIX)
}

/// `key=value:Effect`, as `kubectl` prints a taint.
pub(crate) fn taint_string(t: &DesiredTaint) -> String {
    format!("{}={}:{}", t.key, t.value, t.effect.as_str())
}

/// Whether adding `desired` would newly taint the node, so the taint budget must admit it:
/// the node carries no hard faultline taint yet and the engine wants one.
pub(crate) fn needs_admission(actual: &[Taint], desired: &[DesiredTaint]) -> bool {
    let has_hard = actual.iter().any(|t| owned(&t.key) && is_hard(&t.effect));
    let wants_hard = desired.iter().any(|t| is_hard(t.effect.as_str()));
    wants_hard && !has_hard
}

/// The taint list to write: every foreign taint exactly as it is (kubelet, node controller,
/// operators), then the desired faultline taints, keeping `timeAdded` of those already present.
/// With `withhold_hard`, hard faultline taints not already on the node are left out (the budget
/// said no). Returns `None` when the node already carries exactly this set.
pub(crate) fn plan_taints(
    actual: &[Taint],
    desired: &[DesiredTaint],
    withhold_hard: bool,
    now: Timestamp,
) -> Option<Vec<Taint>> {
    let mut out: Vec<Taint> = actual.iter().filter(|t| !owned(&t.key)).cloned().collect();
    for d in desired {
        let effect = d.effect.as_str();
        let existing = actual.iter().find(|t| {
            t.key == d.key && t.effect == effect && t.value.as_deref() == Some(d.value.as_str())
        });
        match existing {
            Some(t) => out.push(t.clone()),
            None if withhold_hard && is_hard(effect) => {}
            None => out.push(Taint {
                key: d.key.clone(),
                value: Some(d.value.clone()),
                effect: effect.to_string(),
                time_added: Some(time(now)),
            }),
        }
    }
    let key = |t: &Taint| (t.key.clone(), t.effect.clone(), t.value.clone());
    let mut a: Vec<_> = actual.iter().map(key).collect();
    let mut b: Vec<_> = out.iter().map(key).collect();
    a.sort();
    b.sort();
    (a != b).then_some(out)
}

/// The desired hard taints `plan_taints` leaves out when withholding.
pub(crate) fn withheld(actual: &[Taint], desired: &[DesiredTaint]) -> Vec<DesiredTaint> {
    desired
        .iter()
        .filter(|d| is_hard(d.effect.as_str()))
        .filter(|d| {
            !actual.iter().any(|t| {
                t.key == d.key
                    && t.effect == d.effect.as_str()
                    && t.value.as_deref() == Some(d.value.as_str())
            })
        })
        .cloned()
        .collect()
}

/// The `AcceleratorHealthy` condition to write, or `None` when the node already says the same.
/// `lastTransitionTime` moves only when the status flips; `lastHeartbeatTime` is the time of the
/// write (the agent does not write heartbeats when nothing changed: the record's `updateTime`
/// and the agent's liveness probe say it is alive).
pub(crate) fn plan_condition(
    actual: &[NodeCondition],
    desired: &DesiredCondition,
    now: Timestamp,
) -> Option<NodeCondition> {
    let status = if desired.status { "True" } else { "False" };
    let cur = actual.iter().find(|c| c.type_ == CONDITION_TYPE);
    if let Some(c) = cur {
        if c.status == status
            && c.reason.as_deref() == Some(desired.reason.as_str())
            && c.message.as_deref() == Some(desired.message.as_str())
        {
            return None;
        }
    }
    let transition = match cur {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => None,
    };
    Some(NodeCondition {
        type_: CONDITION_TYPE.to_string(),
        status: status.to_string(),
        reason: Some(desired.reason.clone()),
        message: Some(desired.message.clone()),
        last_transition_time: Some(transition.unwrap_or_else(|| time(now))),
        last_heartbeat_time: Some(time(now)),
    })
}

/// Whether the node's labels differ from the desired ones (only the desired keys matter:
/// server-side apply removes a key this field manager stopped sending by itself).
pub(crate) fn labels_differ(
    actual: Option<&BTreeMap<String, String>>,
    desired: &BTreeMap<String, String>,
) -> bool {
    desired
        .iter()
        .any(|(k, v)| actual.and_then(|a| a.get(k)) != Some(v))
}

fn health_rank(label: Option<&String>) -> u8 {
    match label.map(String::as_str) {
        Some("Unhealthy") => 2,
        Some("Degraded") => 1,
        _ => 0,
    }
}

/// Whether the desired health label is better than the node's current one: after a restart,
/// such changes wait until the agent has settled (re-read its sources), so a node whose state
/// directory was lost does not lose its taint for the seconds it takes to re-detect the fault.
pub(crate) fn is_improvement(
    actual: Option<&BTreeMap<String, String>>,
    desired: &BTreeMap<String, String>,
) -> bool {
    health_rank(desired.get(HEALTH_LABEL)) < health_rank(actual.and_then(|a| a.get(HEALTH_LABEL)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn taint(key: &str, value: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: Some(value.into()),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn want(key: &str, value: &str, effect: TaintEffect) -> DesiredTaint {
        DesiredTaint {
            key: key.into(),
            value: value.into(),
            effect,
        }
    }

    fn keys(ts: &[Taint]) -> Vec<String> {
        ts.iter()
            .map(|t| {
                format!(
                    "{}={}:{}",
                    t.key,
                    t.value.clone().unwrap_or_default(),
                    t.effect
                )
            })
            .collect()
    }

    #[test]
    fn taint_plans() {
        let kubelet = taint("node.kubernetes.io/not-ready", "", "NoExecute");
        let operator = taint("example.com/maintenance", "yes", "NoSchedule");
        let ours = taint("faultline.io/unhealthy", "Xid79", "NoSchedule");
        let unhealthy = want("faultline.io/unhealthy", "Xid79", TaintEffect::NoSchedule);
        let degraded = want(
            "faultline.io/degraded",
            "Xid13",
            TaintEffect::PreferNoSchedule,
        );
        // (name, actual, desired, withhold, expected list or None for no write)
        type Case<'a> = (
            &'a str,
            Vec<Taint>,
            Vec<DesiredTaint>,
            bool,
            Option<Vec<&'a str>>,
        );
        let cases: Vec<Case<'_>> = vec![
            ("nothing to do", vec![], vec![], false, None),
            (
                "foreign only, nothing desired",
                vec![kubelet.clone(), operator.clone()],
                vec![],
                false,
                None,
            ),
            (
                "add ours after foreign ones",
                vec![kubelet.clone(), operator.clone()],
                vec![unhealthy.clone()],
                false,
                Some(vec![
                    "node.kubernetes.io/not-ready=:NoExecute",
                    "example.com/maintenance=yes:NoSchedule",
                    "faultline.io/unhealthy=Xid79:NoSchedule",
                ]),
            ),
            (
                "already there",
                vec![operator.clone(), ours.clone()],
                vec![unhealthy.clone()],
                false,
                None,
            ),
            (
                "already there, other order",
                vec![ours.clone(), operator.clone()],
                vec![unhealthy.clone()],
                false,
                None,
            ),
            (
                "remove ours, keep foreign",
                vec![ours.clone(), operator.clone()],
                vec![],
                false,
                Some(vec!["example.com/maintenance=yes:NoSchedule"]),
            ),
            (
                "value changes",
                vec![taint("faultline.io/unhealthy", "Xid48", "NoSchedule")],
                vec![unhealthy.clone()],
                false,
                Some(vec!["faultline.io/unhealthy=Xid79:NoSchedule"]),
            ),
            (
                "unhealthy to degraded",
                vec![ours.clone()],
                vec![degraded.clone()],
                false,
                Some(vec!["faultline.io/degraded=Xid13:PreferNoSchedule"]),
            ),
            (
                "withheld hard taint is left out",
                vec![operator.clone()],
                vec![unhealthy.clone()],
                true,
                None,
            ),
            (
                "withholding keeps soft taints",
                vec![],
                vec![unhealthy.clone(), degraded.clone()],
                true,
                Some(vec!["faultline.io/degraded=Xid13:PreferNoSchedule"]),
            ),
            (
                "withholding keeps a hard taint already present",
                vec![ours.clone()],
                vec![unhealthy.clone()],
                true,
                None,
            ),
        ];
        for (name, actual, desired, withhold, expect) in cases {
            let got = plan_taints(&actual, &desired, withhold, t(0));
            assert_eq!(
                got.as_deref().map(keys),
                expect.map(|v| v.iter().map(|s| s.to_string()).collect()),
                "{name}"
            );
        }
    }

    #[test]
    fn kept_taints_keep_their_time_added() {
        let mut ours = taint("faultline.io/unhealthy", "Xid79", "NoSchedule");
        ours.time_added = Some(time(t(-100)));
        let extra = want(
            "faultline.io/degraded",
            "Xid13",
            TaintEffect::PreferNoSchedule,
        );
        let plan = plan_taints(
            &[ours.clone()],
            &[
                want("faultline.io/unhealthy", "Xid79", TaintEffect::NoSchedule),
                extra,
            ],
            false,
            t(0),
        )
        .unwrap();
        assert_eq!(plan[0], ours);
        assert_eq!(plan[1].time_added, Some(time(t(0))));
    }

    #[test]
    fn admission_needed_only_for_a_newly_hard_tainted_node() {
        let hard = want("faultline.io/unhealthy", "Xid79", TaintEffect::NoSchedule);
        let soft = want(
            "faultline.io/degraded",
            "Xid13",
            TaintEffect::PreferNoSchedule,
        );
        let foreign_hard = taint("example.com/x", "", "NoSchedule");
        let ours_other_code = taint("faultline.io/unhealthy", "Xid48", "NoSchedule");
        assert!(needs_admission(&[], std::slice::from_ref(&hard)));
        assert!(
            needs_admission(&[foreign_hard], std::slice::from_ref(&hard)),
            "foreign taints do not count"
        );
        assert!(!needs_admission(&[], std::slice::from_ref(&soft)));
        assert!(
            !needs_admission(
                std::slice::from_ref(&ours_other_code),
                std::slice::from_ref(&hard)
            ),
            "already counted"
        );
        assert_eq!(withheld(&[], &[hard.clone(), soft]), vec![hard.clone()]);
        assert_eq!(
            withheld(&[ours_other_code], std::slice::from_ref(&hard)),
            vec![hard]
        );
    }

    fn cond(status: &str, reason: &str, message: &str, transition: i64) -> NodeCondition {
        NodeCondition {
            type_: CONDITION_TYPE.into(),
            status: status.into(),
            reason: Some(reason.into()),
            message: Some(message.into()),
            last_transition_time: Some(time(t(transition))),
            last_heartbeat_time: Some(time(t(transition))),
        }
    }

    #[test]
    fn condition_plans() {
        let ready = NodeCondition {
            type_: "Ready".into(),
            status: "True".into(),
            ..Default::default()
        };
        let healthy = DesiredCondition {
            status: true,
            reason: "NoFault".into(),
            message: "ok".into(),
        };
        let sick = DesiredCondition {
            status: false,
            reason: "Xid79".into(),
            message: "GPU has fallen off the bus".into(),
        };
        // absent -> written, transition now
        let c = plan_condition(std::slice::from_ref(&ready), &sick, t(10)).unwrap();
        assert_eq!(
            (c.status.as_str(), c.last_transition_time),
            ("False", Some(time(t(10))))
        );
        // same -> nothing
        assert_eq!(
            plan_condition(
                &[ready.clone(), cond("True", "NoFault", "ok", 0)],
                &healthy,
                t(10)
            ),
            None
        );
        // message changes, status does not -> transition time kept
        let c = plan_condition(&[cond("False", "Xid48", "DBE", 3)], &sick, t(10)).unwrap();
        assert_eq!(c.last_transition_time, Some(time(t(3))));
        assert_eq!(c.last_heartbeat_time, Some(time(t(10))));
        // status flips -> transition now
        let c = plan_condition(&[cond("False", "Xid79", "x", 3)], &healthy, t(10)).unwrap();
        assert_eq!(
            (c.status.as_str(), c.last_transition_time),
            ("True", Some(time(t(10))))
        );
    }

    #[test]
    fn label_decisions() {
        let l = |h: &str| BTreeMap::from([(HEALTH_LABEL.to_string(), h.to_string())]);
        let mut other = l("Healthy");
        other.insert("kubernetes.io/hostname".into(), "n1".into());
        assert!(labels_differ(None, &l("Healthy")));
        assert!(
            !labels_differ(Some(&other), &l("Healthy")),
            "foreign labels do not matter"
        );
        assert!(labels_differ(Some(&other), &l("Unhealthy")));
        assert!(is_improvement(Some(&l("Unhealthy")), &l("Healthy")));
        assert!(is_improvement(Some(&l("Unhealthy")), &l("Degraded")));
        assert!(!is_improvement(Some(&l("Healthy")), &l("Unhealthy")));
        assert!(!is_improvement(None, &l("Healthy")));
    }
}
