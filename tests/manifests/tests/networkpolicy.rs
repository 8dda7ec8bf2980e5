//! The NetworkPolicies: the agents' peer-check port admits only the coordinator and agent pods,
//! their probe ports only agent pods, the coordinator's peer-check port only agent pods and the
//! requesters' namespaces, and the metrics/health ports are left open as they were (issue 12
//! §5, issue 28). Ports and labels are read from the DaemonSet, the Deployment and the agent's
//! source, so the policies cannot drift from them.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::PodTemplateSpec;
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

/// The default of `--probe-port-base`, from the agent's parser.
fn probe_port_base() -> u16 {
    common::agent_default("probe-port-base")
        .parse()
        .expect("a number")
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
    CoordinatorPods,
    RequesterNamespaces,
}

/// One workload's pod labels and named container ports.
struct Pods {
    labels: BTreeMap<String, String>,
    ports: BTreeMap<String, i32>,
}

fn pods_of(template: PodTemplateSpec) -> Pods {
    let labels = template.metadata.expect("metadata").labels.expect("labels");
    let container = template.spec.expect("pod spec").containers.remove(0);
    let ports = container
        .ports
        .into_iter()
        .flatten()
        .map(|p| (p.name.expect("a named port"), p.container_port))
        .collect();
    Pods { labels, ports }
}

impl Pods {
    fn port(&self, name: &str) -> i32 {
        *self
            .ports
            .get(name)
            .unwrap_or_else(|| panic!("no container port {name}"))
    }
}

/// Whether a `matchLabels` selector selects pods with `labels`.
fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Whose pods a rule's peer admits: exactly one of the two workloads, or the requesters'
/// namespaces.
fn who(peer: &NetworkPolicyPeer, agents: &Pods, coordinator: &Pods) -> From {
    assert!(peer.ip_block.is_none(), "no IP blocks: {peer:?}");
    match (&peer.pod_selector, &peer.namespace_selector) {
        (Some(p), None) => {
            assert_eq!(p.match_expressions, None);
            let sel = p.match_labels.clone().unwrap_or_default();
            match (
                selects(&sel, &agents.labels),
                selects(&sel, &coordinator.labels),
            ) {
                (true, false) => From::AgentPods,
                (false, true) => From::CoordinatorPods,
                other => panic!("{sel:?} selects (agents, coordinator) = {other:?}: name one"),
            }
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

/// Every (port range, source) the NetworkPolicy `name` admits, sorted; it must select `own`
/// pods and not `other`'s.
fn admitted(
    name: &str,
    own: &Pods,
    other: &Pods,
    agents: &Pods,
    coordinator: &Pods,
) -> Vec<((i32, i32), From)> {
    let docs = common::base_objects();
    let np: NetworkPolicy = common::find(&docs, "NetworkPolicy", name).to();
    assert_eq!(np.metadata.namespace.as_deref(), Some(NAMESPACE));
    let spec = np.spec.expect("spec");
    let selected = spec
        .pod_selector
        .and_then(|s| s.match_labels)
        .expect("matchLabels");
    assert!(
        selects(&selected, &own.labels),
        "{name} selects {selected:?}"
    );
    assert!(
        !selects(&selected, &other.labels),
        "{name} also selects the other workload's pods"
    );
    assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));
    assert!(spec.egress.is_none());

    let mut out: Vec<((i32, i32), From)> = Vec::new();
    for rule in spec.ingress.expect("ingress rules") {
        let ports = rule.ports.expect("every rule names its ports");
        let froms: Vec<From> = match &rule.from {
            None => vec![From::Anyone],
            Some(f) => {
                assert!(!f.is_empty(), "an empty from admits everyone: leave it out");
                f.iter().map(|p| who(p, agents, coordinator)).collect()
            }
        };
        for p in &ports {
            for f in &froms {
                out.push((port_of(p), f.clone()));
            }
        }
    }
    out.sort();
    out
}

fn workloads() -> (Pods, Pods) {
    let docs = common::base_objects();
    let ds: DaemonSet = common::find(&docs, "DaemonSet", "faultline-agent").to();
    let deploy: Deployment = common::find(&docs, "Deployment", "faultline-coordinator").to();
    (
        pods_of(ds.spec.expect("spec").template),
        pods_of(deploy.spec.expect("spec").template),
    )
}

#[test]
fn the_peer_and_probe_ports_admit_only_agents_and_the_coordinator() {
    let (agents, coordinator) = workloads();
    let (peer, http) = (agents.port("peer"), agents.port("http"));
    let probes = {
        let base = i32::from(probe_port_base());
        let n = i32::from(source_u16("agent/src/peer/mod.rs", "PROBE_PORTS"));
        (base, base + n - 1)
    };
    let got = admitted(
        "faultline-peer",
        &agents,
        &coordinator,
        &agents,
        &coordinator,
    );
    let mut want = vec![
        ((http, http), From::Anyone),
        ((peer, peer), From::AgentPods),
        ((peer, peer), From::CoordinatorPods),
        (probes, From::AgentPods),
    ];
    want.sort();
    assert_eq!(got, want);
    assert_eq!((peer, probes), (20261, (20270, 20301)), "as documented");
}

#[test]
fn the_coordinator_admits_agents_and_requesters() {
    let (agents, coordinator) = workloads();
    let (peer, http) = (coordinator.port("peer"), coordinator.port("http"));
    let got = admitted(
        "faultline-coordinator",
        &coordinator,
        &agents,
        &agents,
        &coordinator,
    );
    let mut want = vec![
        ((http, http), From::Anyone),
        ((peer, peer), From::AgentPods),
        ((peer, peer), From::RequesterNamespaces),
    ];
    want.sort();
    assert_eq!(got, want);
    assert_eq!((peer, http), (20262, 20263), "as documented");
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
