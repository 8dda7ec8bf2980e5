//! The NetworkPolicy `faultline-peer`: the agents' peer-check port admits only agent pods and
//! the requesters' namespaces, the probe ports only agent pods, and the metrics/health port is
//! left open as it was (issue 12 §5). Ports and labels are read from the DaemonSet and the
//! agent's source, so the policy cannot drift from them.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::common::{self, NAMESPACE};

/// The namespace label that admits `faultline check` (docs/peer-checks.md).
const REQUESTER_LABEL: (&str, &str) = ("faultline.io/peer-requester", "true");

/// A `const NAME: u16 = N;` of an agent source file.
fn source_u16(file: &str, name: &str) -> u16 {
    let text = std::fs::read_to_string(common::repo_root().join(file)).expect("source");
    let at = text
        .find(&format!("const {name}: u16 = "))
        .unwrap_or_else(|| panic!("{file}: no const {name}"));
    let rest = &text[at..];
    let value = &rest[rest.find("= ").expect("=") + 2..rest.find(';').expect(";")];
    value.trim().parse().expect("a number")
}

/// The default of `--probe-port-base` (agent/src/daemon.rs).
fn probe_port_base() -> u16 {
    let text =
        std::fs::read_to_string(common::repo_root().join("agent/src/daemon.rs")).expect("source");
    let at = text.find("pub probe_port_base: u16").expect("the flag");
    let before = &text[..at];
    let d = before.rfind("default_value_t = ").expect("a default") + "default_value_t = ".len();
    let end = before[d..].find(')').expect(")") + d;
    before[d..end].trim().parse().expect("a number")
}

fn port_of(p: &NetworkPolicyPort) -> (i32, i32) {
    assert_eq!(p.protocol.as_deref(), Some("TCP"), "{p:?}");
    let start = match p.port.as_ref().expect("a port") {
        IntOrString::Int(n) => *n,
        IntOrString::String(s) => panic!("a named port {s:?}: name the number"),
    };
    (start, p.end_port.unwrap_or(start))
}

/// Who a rule admits, in words.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum From {
    Anyone,
    AgentPods,
    RequesterNamespaces,
}

fn who(peer: &NetworkPolicyPeer, agent_labels: &BTreeMap<String, String>) -> From {
    assert!(peer.ip_block.is_none(), "no IP blocks: {peer:?}");
    match (&peer.pod_selector, &peer.namespace_selector) {
        (Some(p), None) => {
            assert_eq!(p.match_expressions, None);
            assert_eq!(
                p.match_labels.as_ref(),
                Some(agent_labels),
                "agent pods only"
            );
            From::AgentPods
        }
        (None, Some(n)) => {
            assert_eq!(n.match_expressions, None);
            let want: BTreeMap<String, String> =
                [(REQUESTER_LABEL.0.to_string(), REQUESTER_LABEL.1.to_string())].into();
            assert_eq!(n.match_labels.as_ref(), Some(&want), "{peer:?}");
            From::RequesterNamespaces
        }
        other => panic!("an unexpected peer {other:?}"),
    }
}

#[test]
fn the_peer_and_probe_ports_admit_only_agents_and_requesters() {
    let docs = common::base_objects();
    let ds: DaemonSet = common::find(&docs, "DaemonSet", "faultline-agent").to();
    let template = ds.spec.expect("spec").template;
    let pod_labels = template.metadata.expect("metadata").labels.expect("labels");
    let container = template.spec.expect("pod spec").containers.remove(0);
    let port = |name: &str| {
        container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no container port {name}"))
            .container_port
    };
    let (peer, http) = (port("peer"), port("http"));
    let probes = {
        let base = i32::from(probe_port_base());
        let n = i32::from(source_u16(
            "agent/src/peer/coordinator.rs",
            "PORTS_PER_ROUND",
        )) * i32::from(source_u16("agent/src/peer/coordinator.rs", "PORT_GROUPS"));
        (base, base + n - 1)
    };

    let np: NetworkPolicy = common::find(&docs, "NetworkPolicy", "faultline-peer").to();
    assert_eq!(np.metadata.namespace.as_deref(), Some(NAMESPACE));
    let spec = np.spec.expect("spec");
    // It selects the agent pods (by the label the pod template carries).
    let selected = spec
        .pod_selector
        .and_then(|s| s.match_labels)
        .expect("matchLabels");
    assert!(!selected.is_empty());
    for (k, v) in &selected {
        assert_eq!(pod_labels.get(k), Some(v), "the agent pods carry {k}={v}");
    }
    let agent_labels = selected.clone();
    assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));
    assert!(spec.egress.is_none());

    // Every (port range, source) the policy admits.
    let mut admitted: Vec<((i32, i32), From)> = Vec::new();
    for rule in spec.ingress.expect("ingress rules") {
        let ports = rule.ports.expect("every rule names its ports");
        let froms: Vec<From> = match &rule.from {
            None => vec![From::Anyone],
            Some(f) => {
                assert!(!f.is_empty(), "an empty from admits everyone: leave it out");
                f.iter().map(|p| who(p, &agent_labels)).collect()
            }
        };
        for p in &ports {
            for f in &froms {
                admitted.push((port_of(p), f.clone()));
            }
        }
    }
    admitted.sort();
    let mut want = vec![
        ((http, http), From::Anyone),
        ((peer, peer), From::AgentPods),
        ((peer, peer), From::RequesterNamespaces),
        (probes, From::AgentPods),
    ];
    want.sort();
    assert_eq!(admitted, want);
    assert_eq!((peer, probes), (20261, (20270, 20301)), "as documented");
}

/// The requesters' label is what the docs tell operators to set.
#[test]
fn the_requester_label_is_documented() {
    let docs =
        std::fs::read_to_string(common::repo_root().join("docs/peer-checks.md")).expect("docs");
    assert!(
        docs.contains(&format!("{}={}", REQUESTER_LABEL.0, REQUESTER_LABEL.1)),
        "docs/peer-checks.md names the label"
    );
}
