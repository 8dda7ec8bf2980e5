//! Every node's record, from the fault ConfigMaps: `faultline get --cluster` and `hosts`.

use faultline_core::record::{Health, NodeRecord};

use serde_json::{json, Value};

use super::{columns, table, Accept, Outcome};

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
    pub fn matches(&self, r: &NodeRecord) -> bool {
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
        .list(&kube::api::ListParams::default().labels(crate::sink::kube::budget::NODES_SELECTOR))
        .await?;
    let mut records = Vec::new();
    let mut bad = Vec::new();
    for cm in list.items {
        let name = cm.metadata.name.clone().unwrap_or_default();
        let text = cm
            .data
            .as_ref()
            .and_then(|d| d.get(crate::sink::kube::plan::RECORD_KEY));
        match text.map(|t| serde_json::from_str::<NodeRecord>(t)) {
            Some(Ok(r)) => records.push(r),
            Some(Err(e)) => bad.push((name, e.to_string())),
            None => bad.push((name, "no faults.json key".to_string())),
        }
    }
    records.sort_by(|a, b| a.node.cmp(&b.node));
    Ok((records, bad))
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

/// `faultline get --cluster`.
pub async fn get_cluster(
    client: kube::Client,
    namespace: &str,
    filter: &ClusterFilter,
    json: bool,
    all: bool,
) -> Outcome {
    let (records, bad) = match cluster_records(client, namespace).await {
        Ok(x) => x,
        Err(e) => {
            return Outcome::error(format!(
                "error: cannot list fault ConfigMaps in {namespace}: {e}"
            ))
        }
    };
    for (name, why) in &bad {
        eprintln!("warning: ConfigMap {namespace}/{name} holds no readable record: {why}");
    }
    let mut shown: Vec<NodeRecord> = records.into_iter().filter(|r| filter.matches(r)).collect();
    if !all {
        for r in &mut shown {
            r.faults.retain(|f| f.active);
        }
    }
    if json {
        return Outcome::ok(serde_json::to_string_pretty(&shown).unwrap_or_default());
    }
    if shown.is_empty() {
        return Outcome::ok("no matching nodes");
    }
    if let (Some(_), [one]) = (&filter.node, shown.as_slice()) {
        return Outcome::ok(table(one, all).trim_end().to_string());
    }
    Outcome::ok(cluster_table(&shown).trim_end().to_string())
}

/// `faultline hosts`: usable nodes as `host:slots` lines, for Horovod elastic's
/// `discover_hosts` script (and any launcher that wants a host list): the records `accept`
/// takes, sorted by name.
pub fn hosts_lines(records: &[NodeRecord], slots: u32, accept: Accept) -> String {
    records
        .iter()
        .filter(|r| accept.accepts(r))
        .map(|r| format!("{}:{slots}\n", r.node))
        .collect()
}

/// `faultline hosts` against the cluster's fault records.
pub async fn hosts(client: kube::Client, namespace: &str, slots: u32, accept: Accept) -> Outcome {
    match cluster_records(client, namespace).await {
        Ok((records, bad)) => {
            for (name, why) in &bad {
                eprintln!("warning: ConfigMap {namespace}/{name} holds no readable record: {why}");
            }
            let usable: Vec<Value> = records
                .iter()
                .filter(|r| accept.accepts(r))
                .map(|r| json!({"host": r.node, "slots": slots}))
                .collect();
            Outcome::ok(hosts_lines(&records, slots, accept).trim_end().to_string())
                .with_data(json!({"hosts": usable}))
        }
        Err(e) => Outcome::error(format!(
            "error: cannot list fault ConfigMaps in {namespace}: {e}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_records::{HEALTHY, UNHEALTHY};
    use super::*;

    #[test]
    fn hosts_lists_usable_nodes_with_their_slots() {
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
        ];
        assert_eq!(hosts_lines(&records, 8, Accept::HEALTHY), "a:8\nd:8\n");
        assert_eq!(
            hosts_lines(&records, 4, Accept::DEGRADED),
            "a:4\nc:4\nd:4\n"
        );
        assert_eq!(hosts_lines(&records[1..2], 8, Accept::DEGRADED), "");
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
