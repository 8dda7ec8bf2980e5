//! Every node's record, from the fault ConfigMaps: `faultline get --cluster` and `hosts`.
//!
//! `hosts` lists what a launcher can use: a node whose record the acceptance rule takes, that
//! exists as a Node, is Ready, offers accelerators, and whose agent pod is Ready (a record
//! outlives its agent and even its Node). The facts come from the Node and Pod lists; the
//! decision is the pure [`usable_hosts`].

use std::collections::BTreeMap;

use faultline_core::record::{Health, NodeRecord};

use serde_json::json;

use super::{columns, table, Accept, Outcome, NOT_ALIVE_EXIT, NOT_ALIVE_FIELD};

/// Which records `faultline get --cluster` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterFilter {
    /// Only this node.
    pub node: Option<String>,
    /// Only nodes with one of these verdicts (empty: any).
    pub health: Vec<Health>,
    /// Only nodes with an active fault of this code.
    pub code: Option<String>,
}

impl ClusterFilter {
    pub(crate) fn matches(&self, r: &NodeRecord) -> bool {
        self.node.as_ref().is_none_or(|n| &r.node == n)
            && (self.health.is_empty() || self.health.contains(&r.health))
            && self.code.as_ref().is_none_or(|c| {
                r.faults
                    .iter()
                    .any(|f| f.active && f.fault_code.eq_ignore_ascii_case(c))
            })
    }
}

/// Every node's record from the fault ConfigMaps (`faultline-<node>` in `namespace`), sorted by
/// node name, and the ConfigMaps that hold no readable record (name and why).
pub async fn cluster_records(
    client: kube::Client,
    namespace: &str,
) -> Result<(Vec<NodeRecord>, Vec<(String, String)>), kube::Error> {
    use k8s_openapi::api::core::v1::ConfigMap;
    let cms: kube::Api<ConfigMap> = kube::Api::namespaced(client, namespace);
    let list = cms
        .list(
            &kube::api::ListParams::default()
                .labels(crate::sink::kube::configmap::plan::RECORDS_SELECTOR),
        )
        .await?;
    let mut records = Vec::new();
    let mut bad = Vec::new();
    for cm in list.items {
        let name = cm.metadata.name.clone().unwrap_or_default();
        let text = cm
            .data
            .as_ref()
            .and_then(|d| d.get(crate::sink::kube::configmap::plan::RECORD_KEY));
        match text.map(|t| serde_json::from_str::<NodeRecord>(t)) {
            Some(Ok(r)) => records.push(r),
            Some(Err(e)) => bad.push((name, e.to_string())),
            None => bad.push((name, "no faults.json key".to_string())),
        }
    }
    records.sort_by(|a, b| a.node.cmp(&b.node));
    Ok((records, bad))
}

/// The readable records (the unreadable ones are warned about on stderr), or the error outcome
/// when the ConfigMaps cannot be listed.
async fn readable_records(
    client: kube::Client,
    namespace: &str,
) -> Result<Vec<NodeRecord>, Outcome> {
    let (records, bad) = cluster_records(client, namespace).await.map_err(|e| {
        Outcome::error(format!(
            "error: cannot list fault ConfigMaps in {namespace}: {e}"
        ))
    })?;
    for (name, why) in &bad {
        eprintln!("warning: ConfigMap {namespace}/{name} holds no readable record: {why}");
    }
    Ok(records)
}

/// One line per node: verdict, level, active fault codes.
pub fn cluster_table(records: &[NodeRecord]) -> String {
    let mut rows = vec![["NODE", "HEALTH", "HANDLING", "ACTIVE", "UPDATED"]
        .map(String::from)
        .to_vec()];
    for r in records {
        let codes: Vec<String> = r
            .faults
            .iter()
            .filter(|f| f.active)
            .map(|f| format!("{}@{}", f.fault_code, f.device))
            .collect();
        rows.push(vec![
            r.node.clone(),
            r.health.to_string(),
            r.handling
                .map(|h| h.to_string())
                .unwrap_or_else(|| "-".into()),
            if codes.is_empty() {
                "-".into()
            } else {
                codes.join(",")
            },
            r.update_time.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        ]);
    }
    columns(&rows)
}

/// `faultline get --cluster`: the records, and when the agent behind a record shown is not
/// known to be alive, a warning on stderr, a `notAlive` field in that record's JSON and exit 3,
/// as for this node's record (docs/record.md, "Alive"). A ConfigMap's record carries no
/// heartbeat; its agent pod's Ready condition stands for one ([`agents_alive`]).
pub async fn get_cluster(
    client: kube::Client,
    namespace: &str,
    filter: &ClusterFilter,
    json: bool,
    all: bool,
) -> Outcome {
    let records = match readable_records(client.clone(), namespace).await {
        Ok(r) => r,
        Err(o) => return o,
    };
    let mut shown: Vec<NodeRecord> = records.into_iter().filter(|r| filter.matches(r)).collect();
    if !all {
        for r in &mut shown {
            r.faults.retain(|f| f.active);
        }
    }
    let agents = if shown.is_empty() {
        Ok(BTreeMap::new())
    } else {
        agent_pods_ready(client, namespace).await.map_err(|e| {
            format!("cannot list the agent pods in {namespace} (needs list on pods there): {e}")
        })
    };
    let dead = agents_alive(&shown, &agents, namespace);
    let message = if json {
        let docs: Vec<serde_json::Value> = shown
            .iter()
            .zip(&dead)
            .map(|(r, why)| {
                let mut doc = serde_json::to_value(r).unwrap_or_default();
                if let (Some(why), Some(obj)) = (why, doc.as_object_mut()) {
                    obj.insert(NOT_ALIVE_FIELD.into(), json!(why));
                }
                doc
            })
            .collect();
        serde_json::to_string_pretty(&docs).unwrap_or_default()
    } else if shown.is_empty() {
        "no matching nodes".to_string()
    } else if let (Some(_), [one]) = (&filter.node, shown.as_slice()) {
        table(one, all).trim_end().to_string()
    } else {
        cluster_table(&shown).trim_end().to_string()
    };
    let named: Vec<String> = shown
        .iter()
        .zip(&dead)
        .filter_map(|(r, why)| Some(format!("{} ({})", r.node, why.as_ref()?)))
        .collect();
    if named.is_empty() {
        return Outcome::ok(message);
    }
    Outcome {
        warning: Some(format!(
            "warning: not known to be alive, so their records may be out of date: {}",
            named.join("; ")
        )),
        ..Outcome::new(NOT_ALIVE_EXIT, message)
    }
}

/// For each record, why its agent is not known to be alive; `None` when it is: its node has an
/// agent pod whose Ready condition is True (the agent's `/readyz` fails once its heartbeat is
/// 30 s old, so the pod turns not Ready about 45 s after a stuck engine loop's last beat, within
/// seconds of the agent exiting; docs/record.md, "Alive"). `agents` maps nodes to whether one of
/// their agent pods is Ready, or says why the pods could not be listed. A record without any
/// agent pod may be a deleted Node's (records outlive their Nodes, and `get --cluster` may not
/// list Nodes): the reason says so, and how to remove it from `namespace`.
pub(crate) fn agents_alive(
    records: &[NodeRecord],
    agents: &Result<BTreeMap<String, bool>, String>,
    namespace: &str,
) -> Vec<Option<String>> {
    records
        .iter()
        .map(|r| match agents {
            Err(why) => Some(format!("unknown: {why}")),
            Ok(a) => match a.get(&r.node) {
                None => Some(format!(
                    "no faultline agent pod on the node (if the node no longer exists, its record \
                     outlived it: kubectl -n {namespace} delete configmap {})",
                    crate::sink::kube::configmap::name(&r.node)
                )),
                Some(false) => Some("its faultline agent pod is not Ready".to_string()),
                Some(true) => None,
            },
        })
        .collect()
}

/// Whether each node's faultline agent pod is Ready (any of them, should there be two), from
/// the agent pods in `namespace` (the API server's cache).
async fn agent_pods_ready(
    client: kube::Client,
    namespace: &str,
) -> Result<BTreeMap<String, bool>, kube::Error> {
    use k8s_openapi::api::core::v1::Pod;
    let pods = kube::Api::<Pod>::namespaced(client, namespace)
        .list(
            &kube::api::ListParams::default()
                .match_any()
                .labels(AGENT_POD_SELECTOR),
        )
        .await?;
    let mut ready: BTreeMap<String, bool> = BTreeMap::new();
    for p in &pods.items {
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        let r = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        *ready.entry(node).or_default() |= r;
    }
    Ok(ready)
}

/// Extended resources that are accelerators (device plugins' names).
pub(crate) const ACCELERATOR_RESOURCES: [&str; 6] = [
    "nvidia.com/gpu",
    "amd.com/gpu",
    "huawei.com/Ascend910",
    "huawei.com/Ascend310P",
    "huawei.com/Ascend310",
    "huawei.com/npu",
];

/// A whole count from a resource quantity as the API writes it (`8`, `1k`, `2Ki`); `None` for
/// a fraction or anything else. A node or pod offering several accelerator resources counts the
/// largest (the same devices can be advertised under two names).
pub(crate) fn count_of(q: &str) -> Option<u32> {
    let q = q.trim();
    let digits = q.bytes().take_while(u8::is_ascii_digit).count();
    let n: u64 = q[..digits].parse().ok()?;
    let scale: u64 = match &q[digits..] {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        _ => return None,
    };
    u32::try_from(n.checked_mul(scale)?).ok()
}

/// What `hosts` needs to know about a Node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NodeFacts {
    /// Condition `Ready` is `True`.
    pub ready: bool,
    /// Allocatable accelerators (the sum over [`ACCELERATOR_RESOURCES`]).
    pub accelerators: u32,
}

impl NodeFacts {
    pub(crate) fn of(node: &k8s_openapi::api::core::v1::Node) -> NodeFacts {
        let status = node.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let accelerators = status
            .and_then(|s| s.allocatable.as_ref())
            .map(|a| {
                ACCELERATOR_RESOURCES
                    .iter()
                    .filter_map(|r| a.get(*r))
                    .filter_map(|q| count_of(&q.0))
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0);
        NodeFacts {
            ready,
            accelerators,
        }
    }
}

/// `hosts`' answer: the usable nodes with their slots, and the others with why they are left out.
pub type Hosts = (Vec<(String, u32)>, Vec<(String, String)>);

/// The usable nodes with their slots (`slots`, or the node's accelerators when `None`), sorted
/// by name, and every other record's node with why it is left out.
pub(crate) fn usable_hosts(
    records: &[NodeRecord],
    nodes: &BTreeMap<String, NodeFacts>,
    agents_ready: &BTreeMap<String, bool>,
    accept: Accept,
    slots: Option<u32>,
) -> Hosts {
    let mut usable = Vec::new();
    let mut left_out = Vec::new();
    for r in records {
        let why = match (nodes.get(&r.node), agents_ready.get(&r.node)) {
            (None, _) => Some("no such Node (the record outlived it)".to_string()),
            (Some(n), _) if !n.ready => Some("the Node is not Ready".to_string()),
            (Some(n), _) if n.accelerators == 0 => {
                Some("the Node offers no accelerators".to_string())
            }
            (_, None) => Some("no faultline agent pod on the node".to_string()),
            (_, Some(false)) => Some("its faultline agent pod is not Ready".to_string()),
            _ => accept.refusal(r),
        };
        match why {
            Some(w) => left_out.push((r.node.clone(), w)),
            None => {
                let n = slots.unwrap_or_else(|| nodes.get(&r.node).map_or(0, |n| n.accelerators));
                usable.push((r.node.clone(), n));
            }
        }
    }
    (usable, left_out)
}

/// `faultline hosts`: usable nodes as `host:slots` lines, for Horovod elastic's
/// `discover_hosts` script (and any launcher that wants a host list).
pub fn hosts_lines(usable: &[(String, u32)]) -> String {
    usable
        .iter()
        .map(|(h, slots)| format!("{h}:{slots}\n"))
        .collect()
}

/// `hosts --pods`: which of the job's pods to list and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodQuery {
    pub namespace: String,
    /// A label selector (`app=train,role=worker`).
    pub selector: String,
    /// Print the pod IP instead of its hostname.
    pub ip: bool,
}

/// What `hosts --pods` needs to know about one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodFacts {
    pub name: String,
    pub node: Option<String>,
    /// `hostname[.subdomain]` (the name other pods resolve through a headless Service).
    pub hostname: String,
    pub ip: Option<String>,
    /// Running and not being deleted.
    pub running: bool,
    /// Accelerators its containers ask for (limits, else requests).
    pub accelerators: u32,
}

impl PodFacts {
    pub(crate) fn of(p: &k8s_openapi::api::core::v1::Pod) -> PodFacts {
        let name = p.metadata.name.clone().unwrap_or_default();
        let spec = p.spec.as_ref();
        let host = spec
            .and_then(|s| s.hostname.clone())
            .unwrap_or_else(|| name.clone());
        let hostname = match spec.and_then(|s| s.subdomain.as_deref()) {
            Some(sub) if !sub.is_empty() => format!("{host}.{sub}"),
            _ => host,
        };
        let status = p.status.as_ref();
        let accelerators = spec
            .map(|s| {
                s.containers
                    .iter()
                    .map(|c| {
                        let r = c.resources.as_ref();
                        ACCELERATOR_RESOURCES
                            .iter()
                            .filter_map(|k| {
                                r.and_then(|r| r.limits.as_ref().and_then(|l| l.get(*k)))
                                    .or_else(|| r.and_then(|r| r.requests.as_ref()?.get(*k)))
                            })
                            .filter_map(|q| count_of(&q.0))
                            .max()
                            .unwrap_or(0)
                    })
                    .fold(0u32, u32::saturating_add)
            })
            .unwrap_or(0);
        PodFacts {
            node: spec.and_then(|s| s.node_name.clone()),
            hostname,
            ip: status.and_then(|s| s.pod_ip.clone()),
            running: status.and_then(|s| s.phase.as_deref()) == Some("Running")
                && p.metadata.deletion_timestamp.is_none(),
            accelerators,
            name,
        }
    }
}

/// The job's pods a launcher can use: running, on a node `usable_hosts` accepts, printed as
/// their hostname (or IP) with the accelerators they ask for (or `slots`), sorted by pod name;
/// the others with why.
pub(crate) fn usable_pods(pods: &[PodFacts], nodes: &Hosts, slots: Option<u32>, ip: bool) -> Hosts {
    let usable_nodes: BTreeMap<&str, u32> = nodes.0.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    let left_nodes: BTreeMap<&str, &str> = nodes
        .1
        .iter()
        .map(|(n, w)| (n.as_str(), w.as_str()))
        .collect();
    let mut sorted: Vec<&PodFacts> = pods.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut usable = Vec::new();
    let mut left_out = Vec::new();
    for p in sorted {
        let why = match p.node.as_deref() {
            _ if !p.running => Some("the pod is not running".to_string()),
            None => Some("the pod is not scheduled".to_string()),
            Some(n) if usable_nodes.contains_key(n) => None,
            Some(n) => Some(format!(
                "its node {n}: {}",
                left_nodes
                    .get(n)
                    .copied()
                    .unwrap_or("no fault record for the node")
            )),
        };
        let n = slots.unwrap_or(p.accelerators);
        let why = why.or_else(|| {
            (n == 0).then(|| "the pod asks for no accelerators (give --slots)".to_string())
        });
        let address = if ip {
            p.ip.clone()
        } else {
            Some(p.hostname.clone())
        };
        match (why, address) {
            (Some(w), _) => left_out.push((p.name.clone(), w)),
            (None, None) => left_out.push((p.name.clone(), "the pod has no IP yet".to_string())),
            (None, Some(a)) => usable.push((a, n)),
        }
    }
    (usable, left_out)
}

/// `faultline hosts` against the cluster: the fault records, the Nodes and the agent pods, and
/// with `pods` the job's pods on the usable nodes. No record at all is an error (exit 2), not
/// an empty list: agents always write one, so an empty namespace means a wrong `--namespace` or
/// no agents, never "nothing usable".
pub async fn hosts(
    client: kube::Client,
    namespace: &str,
    slots: Option<u32>,
    accept: Accept,
    pods: Option<PodQuery>,
) -> Outcome {
    use k8s_openapi::api::core::v1::{Node, Pod};
    let records = match readable_records(client.clone(), namespace).await {
        Ok(r) => r,
        Err(o) => return o,
    };
    if records.is_empty() {
        return Outcome::error(format!(
            "error: no fault records in namespace {namespace}: is it the agents' namespace, and do they run?"
        ));
    }
    // Lists served from the API server's cache (resourceVersion=0): a launcher may call this
    // every few seconds, and a quorum read of every Node from etcd each time is not needed.
    let nodes = match kube::Api::<Node>::all(client.clone())
        .list(&kube::api::ListParams::default().match_any())
        .await
    {
        Ok(l) => l
            .items
            .iter()
            .filter_map(|n| Some((n.metadata.name.clone()?, NodeFacts::of(n))))
            .collect::<BTreeMap<_, _>>(),
        Err(e) => return Outcome::error(format!("error: cannot list Nodes: {e}")),
    };
    let agents_ready = match agent_pods_ready(client.clone(), namespace).await {
        Ok(a) => a,
        Err(e) => {
            return Outcome::error(format!(
                "error: cannot list the agent pods in {namespace}: {e}"
            ))
        }
    };
    let found = usable_hosts(&records, &nodes, &agents_ready, accept, slots);
    let Some(q) = pods else {
        return hosts_outcome(&found, "node");
    };
    // With --pods, the job's pods on those nodes.
    let listed = kube::Api::<Pod>::namespaced(client, &q.namespace)
        .list(
            &kube::api::ListParams::default()
                .match_any()
                .labels(&q.selector),
        )
        .await;
    let job: Vec<PodFacts> = match listed {
        Ok(l) => l.items.iter().map(PodFacts::of).collect(),
        Err(e) => {
            return Outcome::error(format!(
                "error: cannot list the pods {:?} in {}: {e}",
                q.selector, q.namespace
            ))
        }
    };
    if job.is_empty() {
        return Outcome::error(format!(
            "error: no pod matches {:?} in namespace {}",
            q.selector, q.namespace
        ));
    }
    hosts_outcome(&usable_pods(&job, &found, slots, q.ip), "pod")
}

/// `hosts`' answer: the `host:slots` lines, and as JSON the hosts and what was left out (each
/// named under `what`, `node` or `pod`) with why.
pub(crate) fn hosts_outcome((usable, left_out): &Hosts, what: &str) -> Outcome {
    let data = json!({
        "hosts": usable.iter().map(|(h, s)| json!({"host": h, "slots": s})).collect::<Vec<_>>(),
        "leftOut": left_out.iter().map(|(n, w)| json!({what: n, "why": w})).collect::<Vec<_>>(),
    });
    Outcome::ok(hosts_lines(usable).trim_end().to_string()).with_data(data)
}

/// The agent pods (the DaemonSet's pod template labels).
pub(crate) const AGENT_POD_SELECTOR: &str =
    "app.kubernetes.io/name=faultline,app.kubernetes.io/component=agent";

#[cfg(test)]
mod tests {
    use super::super::test_records::{HEALTHY, UNHEALTHY};
    use super::*;

    /// Only nodes that exist, are Ready, offer accelerators and have a Ready agent, and whose
    /// record is accepted; each other record says why it is left out.
    #[test]
    fn hosts_lists_only_what_a_launcher_can_use() {
        let rec = |node: &str, health: Health| {
            let mut r: NodeRecord = serde_json::from_str(HEALTHY).unwrap();
            r.node = node.into();
            r.health = health;
            r
        };
        let records = [
            rec("a", Health::Healthy),
            rec("b", Health::Unhealthy),
            rec("c", Health::Degraded),
            rec("d", Health::Healthy),
            rec("gone", Health::Healthy),
            rec("notready", Health::Healthy),
            rec("cpu", Health::Healthy),
            rec("noagent", Health::Healthy),
            rec("agentdown", Health::Healthy),
        ];
        let gpu = |n: u32| NodeFacts {
            ready: true,
            accelerators: n,
        };
        let nodes: BTreeMap<String, NodeFacts> = [
            ("a", gpu(8)),
            ("b", gpu(8)),
            ("c", gpu(4)),
            ("d", gpu(8)),
            (
                "notready",
                NodeFacts {
                    ready: false,
                    accelerators: 8,
                },
            ),
            ("cpu", gpu(0)),
            ("noagent", gpu(8)),
            ("agentdown", gpu(8)),
        ]
        .into_iter()
        .map(|(n, f)| (n.to_string(), f))
        .collect();
        let agents: BTreeMap<String, bool> = ["a", "b", "c", "d", "notready", "cpu"]
            .iter()
            .map(|n| (n.to_string(), true))
            .chain([("agentdown".to_string(), false)])
            .collect();
        let (usable, left) = usable_hosts(&records, &nodes, &agents, Accept::HEALTHY, None);
        assert_eq!(hosts_lines(&usable), "a:8\nd:8\n");
        let why: BTreeMap<&str, &str> =
            left.iter().map(|(n, w)| (n.as_str(), w.as_str())).collect();
        assert_eq!(why["gone"], "no such Node (the record outlived it)");
        assert_eq!(why["notready"], "the Node is not Ready");
        assert_eq!(why["cpu"], "the Node offers no accelerators");
        assert_eq!(why["noagent"], "no faultline agent pod on the node");
        assert_eq!(why["agentdown"], "its faultline agent pod is not Ready");
        assert!(
            why["b"].starts_with("the record says Unhealthy"),
            "{}",
            why["b"]
        );
        let (usable, _) = usable_hosts(&records, &nodes, &agents, Accept::DEGRADED, Some(2));
        assert_eq!(hosts_lines(&usable), "a:2\nc:2\nd:2\n");
    }

    /// `get --cluster` takes a record's agent for alive only with a Ready agent pod on its node:
    /// a pod not Ready, no pod, or pods that could not be listed (unknown) are not alive.
    #[test]
    fn get_cluster_judges_agents_by_their_pods() {
        let rec = |node: &str| {
            let mut r: NodeRecord = serde_json::from_str(HEALTHY).unwrap();
            r.node = node.into();
            r
        };
        let records = [rec("up"), rec("down"), rec("none")];
        let agents: BTreeMap<String, bool> =
            [("up".to_string(), true), ("down".to_string(), false)].into();
        assert_eq!(
            agents_alive(&records, &Ok(agents), "fs"),
            [
                None,
                Some("its faultline agent pod is not Ready".to_string()),
                Some(
                    "no faultline agent pod on the node (if the node no longer exists, its \
                     record outlived it: kubectl -n fs delete configmap faultline-none)"
                        .to_string()
                )
            ]
        );
        let unknown = agents_alive(&records[..1], &Err("cannot list: forbidden".into()), "fs");
        assert_eq!(
            unknown,
            [Some("unknown: cannot list: forbidden".to_string())]
        );
    }

    #[test]
    fn accelerator_counts_from_quantities() {
        for (q, want) in [
            ("8", Some(8)),
            ("1k", Some(1000)),
            ("2Ki", Some(2048)),
            ("500m", None),
            ("1.5", None),
            ("", None),
            ("99999999999", None),
        ] {
            assert_eq!(count_of(q), want, "{q:?}");
        }
    }

    #[test]
    fn cluster_filters_and_table() {
        let healthy: NodeRecord = serde_json::from_str(HEALTHY).unwrap();
        let mut sick: NodeRecord = serde_json::from_str(UNHEALTHY).unwrap();
        sick.node = "n2".into();
        let all = [healthy.clone(), sick.clone()];
        let pick = |f: ClusterFilter| -> Vec<String> {
            all.iter()
                .filter(|r| f.matches(r))
                .map(|r| r.node.clone())
                .collect()
        };
        assert_eq!(pick(ClusterFilter::default()), ["n1", "n2"]);
        assert_eq!(
            pick(ClusterFilter {
                health: vec![Health::Unhealthy],
                ..Default::default()
            }),
            ["n2"]
        );
        assert_eq!(
            pick(ClusterFilter {
                health: vec![Health::Healthy, Health::Degraded],
                ..Default::default()
            }),
            ["n1"]
        );
        assert_eq!(
            pick(ClusterFilter {
                code: Some("xid79".into()),
                ..Default::default()
            }),
            ["n2"]
        );
        assert_eq!(
            pick(ClusterFilter {
                code: Some("Xid48".into()),
                ..Default::default()
            }),
            Vec::<String>::new()
        );
        assert_eq!(
            pick(ClusterFilter {
                node: Some("n1".into()),
                ..Default::default()
            }),
            ["n1"]
        );
        sick.faults[0].active = false;
        assert!(
            !ClusterFilter {
                code: Some("Xid79".into()),
                ..Default::default()
            }
            .matches(&sick),
            "recovered faults do not match"
        );
        let t = cluster_table(&all);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[0].starts_with("NODE")
                && lines[1].starts_with("n1")
                && lines[2].starts_with("n2"),
            "{t}"
        );
        assert!(
            lines[2].contains("Unhealthy") && lines[2].contains("Xid79@GPU-3"),
            "{t}"
        );
        assert!(
            lines[1].contains("Healthy") && lines[1].contains(" - "),
            "{t}"
        );
    }
}
