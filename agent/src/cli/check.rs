//! `faultline check`: asks the peer-check coordinator for a run among named nodes and prints
//! its verdicts.

use std::path::PathBuf;
use std::time::Duration;

use super::Outcome;
use crate::clock::{Clock, SystemClock};

/// `faultline check`: where to send the request and how long to try.
#[derive(Debug, Clone)]
pub struct CheckArgs {
    pub nodes: Vec<String>,
    /// The job's pods instead of `nodes`: (namespace, label selector); their nodes are checked.
    pub pods: Option<(String, String)>,
    /// The whole command gives up after this (retries included).
    pub timeout: Duration,
    /// Per-check deadline to ask for (0: the coordinator's policy).
    pub check_timeout: Option<Duration>,
    /// The coordinator's address (its Service in a cluster); else the Lease holder's.
    pub coordinator: Option<String>,
    pub secret_file: PathBuf,
    /// A projected service-account token to send instead of signing (Kubernetes).
    pub token_file: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub namespace: String,
    pub json: bool,
}

/// The nodes a job's pods run on, from a list of the pods in the job's own namespace: a
/// launcher needs no cluster-wide right (no list of Nodes) for it. Waits, until `deadline`,
/// for every matching pod to be scheduled; none matching is an error.
pub(crate) async fn job_nodes(
    client: kube::Client,
    namespace: &str,
    selector: &str,
    deadline: tokio::time::Instant,
) -> anyhow::Result<Vec<String>> {
    use k8s_openapi::api::core::v1::Pod;
    let pods: kube::Api<Pod> = kube::Api::namespaced(client, namespace);
    loop {
        let list = pods
            .list(&kube::api::ListParams::default().labels(selector))
            .await
            .map_err(|e| {
                anyhow::anyhow!("cannot list the pods {selector:?} in {namespace}: {e}")
            })?;
        if list.items.is_empty() {
            anyhow::bail!("no pod matches {selector:?} in namespace {namespace}");
        }
        let (nodes, pending) = job_nodes_of(&list.items);
        if pending.is_empty() {
            if nodes.is_empty() {
                anyhow::bail!(
                    "no live pod matches {selector:?} in namespace {namespace} (all finished or being deleted)"
                );
            }
            return Ok(nodes);
        }
        if SystemClock.instant() >= deadline {
            anyhow::bail!(
                "pods not scheduled yet: {} (of {} matching {selector:?})",
                pending.join(", "),
                list.items.len()
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// The sorted, distinct nodes of the pods that are scheduled, and the names of those that are
/// not (a finished or deleted pod does not count).
pub(crate) fn job_nodes_of(pods: &[k8s_openapi::api::core::v1::Pod]) -> (Vec<String>, Vec<String>) {
    let mut nodes = std::collections::BTreeSet::new();
    let mut pending = Vec::new();
    for p in pods {
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) || p.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        match p.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            Some(n) if !n.is_empty() => {
                nodes.insert(n.to_string());
            }
            _ => pending.push(p.metadata.name.clone().unwrap_or_default()),
        }
    }
    (nodes.into_iter().collect(), pending)
}

/// The printed report of a run and its exit status: 0 nothing found, 1 a faulty node, broken
/// or degraded link or straggler, 3 only nodes that could not be judged.
pub fn check_report(r: &faultline_proto::v1::RunResult, json: bool) -> Outcome {
    use faultline_proto::v1::verdict::Kind;
    let kinds: Vec<Kind> = r.verdicts.iter().map(|v| v.kind()).collect();
    let code = if kinds.iter().any(|k| *k != Kind::Unknown) {
        1
    } else if kinds.is_empty() {
        0
    } else {
        3
    };
    let message = if json {
        let verdicts: Vec<serde_json::Value> = r
            .verdicts
            .iter()
            .map(|v| {
                let mut o = serde_json::json!({
                    "kind": crate::peer::wire::kind_name(v.kind()),
                    "nodes": v.nodes,
                });
                if v.slowdown > 0.0 {
                    o["slowdown"] = serde_json::json!(v.slowdown);
                }
                if !v.reason.is_empty() {
                    o["reason"] = serde_json::json!(v.reason);
                }
                o
            })
            .collect();
        serde_json::json!({"run_id": r.run_id, "rounds": r.rounds, "verdicts": verdicts})
            .to_string()
    } else {
        let mut out = format!(
            "run {}: {} round{}",
            r.run_id,
            r.rounds,
            if r.rounds == 1 { "" } else { "s" }
        );
        if r.verdicts.is_empty() {
            out.push_str(", no faulty node, broken or degraded link, or straggler");
        }
        for v in &r.verdicts {
            let line = match v.kind() {
                Kind::FaultyNode => format!("faulty node   {}", v.nodes.join(",")),
                Kind::BrokenLink => format!("broken link   {}", v.nodes.join(" <-> ")),
                Kind::DegradedLink => format!(
                    "degraded link {} ({:.2}x the round)",
                    v.nodes.join(" <-> "),
                    v.slowdown
                ),
                Kind::Straggler => {
                    format!(
                        "straggler     {} ({:.2}x the median)",
                        v.nodes.join(","),
                        v.slowdown
                    )
                }
                Kind::Unknown => format!("unknown       {}: {}", v.nodes.join(","), v.reason),
                Kind::Unspecified => format!("?             {}", v.nodes.join(",")),
            };
            out.push('\n');
            out.push_str(&line);
        }
        out
    };
    Outcome::new(code, message)
}

/// What a run request must name: at least two nodes, none empty, none twice (a check pairs
/// nodes; a duplicate or a lone node would come back as a silent de-duplication or "unknown").
pub fn validate_nodes(nodes: &[String]) -> Result<(), BadNodes> {
    if let Some(i) = nodes.iter().position(|n| n.trim().is_empty()) {
        return Err(BadNodes::Empty(i + 1));
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(d) = nodes.iter().find(|n| !seen.insert(n.as_str())) {
        return Err(BadNodes::Twice(d.clone()));
    }
    if nodes.len() < 2 {
        return Err(BadNodes::TooFew(nodes.len()));
    }
    Ok(())
}

/// Why a list of nodes cannot be checked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadNodes {
    /// The (1-based) position of an empty name.
    #[error("node {0} of the list is empty")]
    Empty(usize),
    #[error("node {0:?} is listed twice")]
    Twice(String),
    #[error("a peer check needs at least two nodes, got {0}")]
    TooFew(usize),
}

/// HTTP/2 keep-alive of the call to the coordinator: ping interval, and how long a ping may go
/// unanswered.
const KEEPALIVE: Duration = Duration::from_secs(5);
/// How often the Lease is read again while a call waits.
const LEASE_POLL: Duration = Duration::from_secs(5);

/// Resolves with the new holder's identity once the Lease names a coordinator other than the
/// one at `address` (read every `LEASE_POLL`; a failed read is tried again).
async fn lease_moved(client: kube::Client, namespace: &str, address: &str) -> String {
    loop {
        tokio::time::sleep(LEASE_POLL).await;
        if let Ok(Some(id)) = crate::peer::lease::holder(client.clone(), namespace).await {
            let now = crate::peer::authz::CoordinatorId::from_holder(&id).and_then(|c| c.address);
            if now.as_deref() != Some(address) {
                return id;
            }
        }
    }
}

/// How `faultline check` proves who asks.
enum Credential {
    /// The requester secret signs each request.
    Sign(crate::peer::wire::Signer),
    /// A service-account token, read again on every attempt (the kubelet rotates projected
    /// tokens).
    Token(PathBuf),
}

/// `faultline check --nodes a,b,c`: asks the coordinator to run a check among these nodes now
/// and prints the verdicts. Retries (re-reading the Lease) while the coordinator is unreachable
/// or changing, until `timeout`.
pub async fn check(mut args: CheckArgs) -> Outcome {
    if args.pods.is_none() {
        if let Err(e) = validate_nodes(&args.nodes) {
            return Outcome::error(format!("error: {e}"));
        }
    }
    use faultline_proto::v1::coordinator_client::CoordinatorClient;
    use faultline_proto::v1::RunRequest;
    use tonic::Code;
    let credential = match &args.token_file {
        Some(path) => Credential::Token(path.clone()),
        None => {
            let key = match crate::peer::wire::load_key(&args.secret_file) {
                Ok(k) => k,
                Err(e) => return Outcome::error(format!("error: {e}")),
            };
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            Credential::Sign(crate::peer::wire::Signer {
                key,
                sender: format!("cli@{}", host.trim()),
            })
        }
    };
    let deadline = SystemClock.instant() + args.timeout;
    // One id for every attempt: a coordinator that took over from the one first asked resumes
    // the run under it, and answers a retry with that run instead of starting another.
    let request_id = format!("{:016x}", crate::peer::wire::random_u64());
    let mut last_error = String::from("no attempt made");
    let mut client_kube = None;
    if let Some((ns, selector)) = args.pods.clone() {
        let client = match crate::kube_client::client_infer(args.kubeconfig.as_deref()).await {
            Ok(c) => c,
            Err(e) => return Outcome::error(format!("error: --pods needs Kubernetes: {e}")),
        };
        match job_nodes(client.clone(), &ns, &selector, deadline).await {
            Ok(nodes) => args.nodes = nodes,
            Err(e) => return Outcome::error(format!("error: {e}")),
        }
        if let Err(e) = validate_nodes(&args.nodes) {
            return Outcome::error(format!(
                "error: the job's pods run on {:?}: {e}",
                args.nodes
            ));
        }
        client_kube = Some(client);
    }
    loop {
        if SystemClock.instant() >= deadline {
            return Outcome::error(format!(
                "error: no result within {}: {last_error}",
                humantime::format_duration(args.timeout)
            ));
        }
        // Where to ask, and the receiver to sign the request for: the coordinator's name when
        // it is known (the Lease holder), so nothing else would take the request; with only an
        // address (its Service), the coordinator role (`auth::COORDINATOR_ROLE`).
        let address = match &args.coordinator {
            Some(a) => Ok((
                a.clone(),
                faultline_proto::auth::COORDINATOR_ROLE.to_string(),
            )),
            None => {
                let client = match &client_kube {
                    Some(c) => c.clone(),
                    None => {
                        match crate::kube_client::client_infer(args.kubeconfig.as_deref()).await {
                            Ok(c) => client_kube.insert(c).clone(),
                            Err(e) => {
                                return Outcome::error(format!(
                                    "error: no --coordinator and no Kubernetes to find it in: {e}"
                                ))
                            }
                        }
                    }
                };
                match crate::peer::lease::holder(client, &args.namespace).await {
                    Ok(Some(id)) => crate::peer::authz::CoordinatorId::from_holder(&id)
                        .and_then(|c| Some((c.address?, c.node)))
                        .ok_or_else(|| anyhow::anyhow!("Lease holder {id:?} names no address")),
                    Ok(None) => Err(anyhow::anyhow!("no coordinator holds the Lease yet")),
                    Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => {
                        return Outcome::error(format!(
                            "error: cannot read the coordinator Lease {}/{}: {} (this client needs get on leases)",
                            args.namespace,
                            crate::peer::lease::NAME,
                            s.message
                        ))
                    }
                    Err(e) => Err(anyhow::anyhow!("cannot read the coordinator Lease: {e}")),
                }
            }
        };
        let asked = address.as_ref().ok().map(|(a, _)| a.clone());
        let attempt = async {
            let (address, receiver) = address?;
            // HTTP/2 keep-alive: a coordinator that froze (SIGSTOP, a hung node) answers no
            // ping, and the call ends within seconds instead of at --timeout.
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
                .map_err(|e| anyhow::anyhow!("bad coordinator address {address:?}: {e}"))?
                .connect_timeout(Duration::from_secs(3))
                .http2_keep_alive_interval(KEEPALIVE)
                .keep_alive_timeout(KEEPALIVE)
                .keep_alive_while_idle(true)
                .connect()
                .await
                .map_err(|e| anyhow::anyhow!("cannot reach the coordinator at {address}: {e}"))?;
            let req = RunRequest {
                auth: None,
                protocol: faultline_proto::PROTOCOL,
                nodes: args.nodes.clone(),
                timeout_ms: args
                    .check_timeout
                    .map(|t| t.as_millis().min(u128::from(u32::MAX)) as u32)
                    .unwrap_or(0),
                request_id: request_id.clone(),
            };
            let mut request = match &credential {
                Credential::Sign(s) => tonic::Request::new(s.sign(req, &receiver)),
                Credential::Token(path) => {
                    let token = std::fs::read_to_string(path).map_err(|e| {
                        anyhow::anyhow!("cannot read the token {}: {e}", path.display())
                    })?;
                    let value = format!("Bearer {}", token.trim())
                        .parse::<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>()
                        .map_err(|_| {
                            anyhow::anyhow!("the token {} is not printable text", path.display())
                        })?;
                    let mut r = tonic::Request::new(req);
                    r.metadata_mut().insert("authorization", value);
                    r
                }
            };
            request.set_timeout(deadline.saturating_duration_since(SystemClock.instant()));
            let answer = CoordinatorClient::new(channel)
                .max_decoding_message_size(faultline_proto::MAX_MESSAGE_BYTES)
                .run(request)
                .await;
            Ok::<_, anyhow::Error>((address, answer))
        };
        // Could not ask (no coordinator yet, unreachable): retry. Asked and refused for the
        // request itself (secret, arguments): stop. Any other answer (not the coordinator any
        // more, shutting down): retry.
        // Found through the Lease: the Lease is read again while the call runs, and a new holder
        // ends the wait on the old one (a frozen coordinator may keep its connection open).
        let moved = async {
            match (&client_kube, &asked, &args.coordinator) {
                (Some(c), Some(a), None) => lease_moved(c.clone(), &args.namespace, a).await,
                _ => std::future::pending().await,
            }
        };
        let answered = tokio::select! {
            r = attempt => r,
            holder = moved => Err(anyhow::anyhow!("the coordinator Lease moved to {holder} during the call")),
        };
        last_error = match answered {
            Ok((_, Ok(result))) => return check_report(&result.into_inner(), args.json),
            Ok((_, Err(s)))
                if matches!(
                    s.code(),
                    Code::Unauthenticated | Code::InvalidArgument | Code::PermissionDenied
                ) =>
            {
                return Outcome::error(format!(
                    "error: the coordinator refused the request: {}",
                    s.message()
                ))
            }
            Ok((address, Err(s))) => format!("the coordinator at {address}: {}", s.message()),
            Err(e) => e.to_string(),
        };
        tokio::time::sleep(
            Duration::from_secs(2).min(deadline.saturating_duration_since(SystemClock.instant())),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_run_names_two_or_more_distinct_nodes() {
        let v = |n: &[&str]| validate_nodes(&n.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(v(&["a", "b"]), Ok(()));
        assert_eq!(
            v(&["a", "a"]).unwrap_err().to_string(),
            "node \"a\" is listed twice"
        );
        assert_eq!(
            v(&["a", "", "b"]).unwrap_err().to_string(),
            "node 2 of the list is empty"
        );
        assert!(v(&["a"])
            .unwrap_err()
            .to_string()
            .contains("at least two nodes, got 1"));
        assert!(v(&[]).unwrap_err().to_string().contains("got 0"));
    }

    use super::*;

    #[test]
    fn check_report_exit_codes_and_lines() {
        use faultline_proto::v1::{verdict::Kind, RunResult, Verdict};
        let v = |kind: Kind, nodes: &[&str], slowdown: f64, reason: &str| Verdict {
            kind: kind as i32,
            nodes: nodes.iter().map(|s| s.to_string()).collect(),
            slowdown,
            reason: reason.into(),
        };
        let clean = RunResult {
            run_id: "r1".into(),
            rounds: 1,
            verdicts: vec![],
        };
        let o = check_report(&clean, false);
        assert_eq!(o.code, 0);
        assert_eq!(
            o.message,
            "run r1: 1 round, no faulty node, broken or degraded link, or straggler"
        );
        let found = RunResult {
            run_id: "r2".into(),
            rounds: 2,
            verdicts: vec![
                v(Kind::FaultyNode, &["n5"], 0.0, ""),
                v(Kind::BrokenLink, &["n2", "n3"], 0.0, ""),
                v(Kind::DegradedLink, &["n7", "n8"], 2.48, ""),
                v(Kind::Straggler, &["n6"], 4.0, ""),
                v(Kind::Unknown, &["n9"], 0.0, "accelerators busy"),
            ],
        };
        let o = check_report(&found, false);
        assert_eq!(o.code, 1);
        assert_eq!(
            o.message,
            "run r2: 2 rounds\nfaulty node   n5\nbroken link   n2 <-> n3\ndegraded link n7 <-> n8 (2.48x the round)\nstraggler     n6 (4.00x the median)\nunknown       n9: accelerators busy"
        );
        let j: serde_json::Value =
            serde_json::from_str(&check_report(&found, true).message).unwrap();
        assert_eq!(j["verdicts"][2]["kind"], "degraded_link");
        assert_eq!(j["verdicts"][2]["slowdown"], 2.48);
        assert_eq!(j["verdicts"][3]["kind"], "straggler");
        assert_eq!(j["verdicts"][3]["slowdown"], 4.0);
        assert_eq!(j["verdicts"][1]["nodes"][1], "n3");
        let unknown_only = RunResult {
            run_id: "r3".into(),
            rounds: 1,
            verdicts: vec![v(Kind::Unknown, &["n1"], 0.0, "no node passed")],
        };
        assert_eq!(check_report(&unknown_only, false).code, 3);
    }
}
