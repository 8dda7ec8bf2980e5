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
/// The pause between two attempts.
const RETRY_EVERY: Duration = Duration::from_secs(2);

/// How long `faultline check` goes on asking while nothing shows a coordinator (nobody holds
/// the Lease, its holder stopped renewing it, nothing takes connections at the address): two
/// Lease terms, 30 s (docs/peer-checks.md, "When no check can run"). A hand-over between two
/// running replicas fits in it with about 10 s to spare for clock skew and slow API calls,
/// counted from the first attempt that saw no coordinator, which is never before the old
/// holder's last renewal:
/// - released (SIGTERM): the standby sleeps until the end of the term it last read and looks
///   again (kube-lease-manager's `watcher_step`); the holder renews [`LEASE_SECONDS`] -
///   [`GRACE_SECONDS`] = 10 s into each term, so that look comes at most one term (15 s) after
///   the release; then a read and a write of the Lease;
/// - crashed or frozen: the standby looks at the holder's last renewal + one term on its own
///   clock, clears the Lease, sleeps a random 0.1 s to 1 s, reads and writes it again: one term,
///   about 1 s and four API calls after the last renewal, plus the skew between the two
///   replicas' clocks; found through the Service (`--coordinator`), also the new holder's
///   readiness probe (every 2 s) and the endpoints' update.
///
/// A coordinator that is not running at all gets no grace beyond this: a rollout whose new
/// pods still pull their image, or a drained node that held both replicas, ends pre-flights
/// with exit 2 after 30 s. A supervisor restarts a bare-metal coordinator within seconds.
///
/// [`LEASE_SECONDS`]: crate::peer::lease::LEASE_SECONDS
/// [`GRACE_SECONDS`]: crate::peer::lease::GRACE_SECONDS
pub const NO_COORDINATOR_GRACE: Duration =
    Duration::from_secs(2 * crate::peer::lease::LEASE_SECONDS);

/// What one attempt showed about the coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Sign {
    /// There is none, and none will come: no check can run (there is no Lease at all).
    Never(String),
    /// There is none now: nobody holds the Lease or its holder stopped renewing it, the holder
    /// names no address, or nothing takes connections at the address. One may come within
    /// [`NO_COORDINATOR_GRACE`] (a replica taking over, a restart).
    Absent(String),
    /// There is one: it took the connection (busy, not the active replica any more, frozen or
    /// gone during the call), or the Lease moved to a new holder during the call.
    Present(String),
    /// Nothing either way: the Lease or the token could not be read.
    Unclear(String),
}

impl Sign {
    fn why(&self) -> &str {
        match self {
            Sign::Never(w) | Sign::Absent(w) | Sign::Present(w) | Sign::Unclear(w) => w,
        }
    }
}

/// Since when every attempt has shown no coordinator.
#[derive(Debug, Default)]
struct Absence {
    since: Option<tokio::time::Instant>,
}

impl Absence {
    /// Takes one attempt's sign, seen at `now`: why no check can run, once that is settled (at
    /// once for [`Sign::Never`]; for [`Sign::Absent`], when nothing but absence has been seen
    /// for `grace`). A coordinator seen starts the count again; an unclear attempt changes
    /// nothing.
    fn settled(
        &mut self,
        sign: &Sign,
        now: tokio::time::Instant,
        grace: Duration,
    ) -> Option<String> {
        match sign {
            Sign::Never(why) => Some(why.clone()),
            Sign::Absent(why) => {
                let since = *self.since.get_or_insert(now);
                (now.saturating_duration_since(since) >= grace).then(|| {
                    format!(
                        "{why}, and no coordinator came within {}",
                        humantime::format_duration(grace)
                    )
                })
            }
            Sign::Present(_) => {
                self.since = None;
                None
            }
            Sign::Unclear(_) => None,
        }
    }
}

/// The Lease's word on where to ask, as the address and the receiver to sign for (the
/// coordinator's name), or the sign that there is no one to ask.
fn target_of(
    lease: crate::peer::lease::Coordinator,
    namespace: &str,
) -> Result<(String, String), Sign> {
    use crate::peer::lease::{Coordinator, NAME};
    match lease {
        Coordinator::Live(id) => crate::peer::authz::CoordinatorId::from_holder(&id)
            .and_then(|c| Some((c.address?, c.node)))
            .ok_or_else(|| {
                Sign::Absent(format!(
                    "the coordinator Lease's holder {id:?} names no address"
                ))
            }),
        Coordinator::NoLease => Err(Sign::Never(format!(
            "there is no coordinator Lease {namespace}/{NAME}: no coordinator has run in \
             {namespace} (is it installed, and is {namespace} the agents' namespace?), or the \
             Lease was deleted (a coordinator creates it only as it starts: restart it)"
        ))),
        Coordinator::Unheld => Err(Sign::Absent(format!(
            "nobody holds the coordinator Lease {namespace}/{NAME} (its last holder released it)"
        ))),
        Coordinator::Expired { holder, renewed } => {
            let name = holder.split('@').next().unwrap_or_default();
            let when = renewed
                .map(|t| format!(", last at {}", t.strftime("%Y-%m-%dT%H:%M:%SZ")))
                .unwrap_or_default();
            Err(Sign::Absent(format!(
                "the coordinator Lease's holder {name} stopped renewing it{when}"
            )))
        }
    }
}

/// Resolves with why no check can run when the Lease shows no coordinator (read every
/// [`RETRY_EVERY`], judged as [`check`] judges it); never otherwise. Runs while `--pods` waits
/// for the job's pods to be scheduled, so that the answer does not wait for them.
async fn no_coordinator(client: kube::Client, namespace: &str) -> String {
    let mut absence = Absence::default();
    loop {
        let sign = match crate::peer::lease::coordinator(client.clone(), namespace).await {
            Ok(lease) => match target_of(lease, namespace) {
                Ok((address, _)) => Sign::Present(address),
                Err(sign) => sign,
            },
            Err(e) => Sign::Unclear(e.to_string()),
        };
        if let Some(why) = absence.settled(&sign, SystemClock.instant(), NO_COORDINATOR_GRACE) {
            return why;
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

/// Resolves with the new holder's identity once the Lease names a live coordinator other than
/// the one at `address` (read every `LEASE_POLL`; a failed read is tried again).
async fn lease_moved(client: kube::Client, namespace: &str, address: &str) -> String {
    loop {
        tokio::time::sleep(LEASE_POLL).await;
        if let Ok(crate::peer::lease::Coordinator::Live(id)) =
            crate::peer::lease::coordinator(client.clone(), namespace).await
        {
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

/// What one call to the coordinator gave.
enum Called {
    /// Its answer (a run's result, or a status).
    Answer(Result<tonic::Response<faultline_proto::v1::RunResult>, tonic::Status>),
    /// No connection (refused, unreachable, not within the connect timeout).
    NoConnection(String),
    /// Not sent: the token could not be read.
    NotSent(String),
}

/// `faultline check --nodes a,b,c`: asks the coordinator to run a check among these nodes now
/// and prints the verdicts. Retries (re-reading the Lease) while a coordinator is there but
/// busy or changing, until `timeout`; ends with exit 2 as soon as no check can run: at once
/// when there is no Lease, after [`NO_COORDINATOR_GRACE`] of no coordinator (docs/peer-checks.md,
/// "When no check can run").
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
    let no_run = |why: String| Outcome::error(format!("error: no peer check can run: {why}"));
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
        // The job's pods may take minutes to be scheduled; whether there is a coordinator is
        // known sooner, and then there is nothing to wait for.
        let lease_says = async {
            match &args.coordinator {
                None => no_coordinator(client.clone(), &args.namespace).await,
                Some(_) => std::future::pending().await,
            }
        };
        let nodes = tokio::select! {
            n = job_nodes(client.clone(), &ns, &selector, deadline) => n,
            why = lease_says => return no_run(why),
        };
        match nodes {
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
    let mut absence = Absence::default();
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
        let target = match &args.coordinator {
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
                match crate::peer::lease::coordinator(client, &args.namespace).await {
                    Ok(lease) => target_of(lease, &args.namespace),
                    Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => {
                        return Outcome::error(format!(
                            "error: cannot read the coordinator Lease {}/{}: {} (this client needs get on leases)",
                            args.namespace,
                            crate::peer::lease::NAME,
                            s.message
                        ))
                    }
                    Err(e) => Err(Sign::Unclear(format!(
                        "cannot read the coordinator Lease: {e}"
                    ))),
                }
            }
        };
        let sign = match target {
            Err(sign) => sign,
            Ok((address, receiver)) => 'asked: {
                let endpoint =
                    match tonic::transport::Endpoint::from_shared(format!("http://{address}")) {
                        Ok(e) => e,
                        // Given, it stays wrong; from the Lease, the next holder may differ.
                        Err(e) => {
                            let why = format!("bad coordinator address {address:?}: {e}");
                            break 'asked match args.coordinator {
                                Some(_) => Sign::Never(why),
                                None => Sign::Absent(why),
                            };
                        }
                    };
                let attempt = async {
                    // HTTP/2 keep-alive: a coordinator that froze (SIGSTOP, a hung node)
                    // answers no ping, and the call ends within seconds instead of at --timeout.
                    let channel = match endpoint
                        .connect_timeout(Duration::from_secs(3))
                        .http2_keep_alive_interval(KEEPALIVE)
                        .keep_alive_timeout(KEEPALIVE)
                        .keep_alive_while_idle(true)
                        .connect()
                        .await
                    {
                        Ok(c) => c,
                        Err(e) => return Called::NoConnection(source_of(&e)),
                    };
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
                        Credential::Token(path) => match with_token(tonic::Request::new(req), path)
                        {
                            Ok(r) => r,
                            Err(why) => return Called::NotSent(why),
                        },
                    };
                    request.set_timeout(deadline.saturating_duration_since(SystemClock.instant()));
                    Called::Answer(
                        CoordinatorClient::new(channel)
                            .max_decoding_message_size(faultline_proto::MAX_MESSAGE_BYTES)
                            .run(request)
                            .await,
                    )
                };
                // Found through the Lease: the Lease is read again while the call runs, and a
                // new holder ends the wait on the old one (a frozen coordinator may keep its
                // connection open).
                let moved = async {
                    match (&client_kube, &args.coordinator) {
                        (Some(c), None) => lease_moved(c.clone(), &args.namespace, &address).await,
                        _ => std::future::pending().await,
                    }
                };
                let called = tokio::select! {
                    c = attempt => c,
                    holder = moved => Called::Answer(Err(tonic::Status::unavailable(format!(
                        "the coordinator Lease moved to {holder} during the call"
                    )))),
                };
                // Asked and refused for the request itself (credential, arguments): stop. Any
                // other answer (busy, not the active replica any more, shutting down, the call
                // broken off): a coordinator is there, ask again until --timeout. No
                // connection: none may be there.
                match called {
                    Called::Answer(Ok(result)) => {
                        return check_report(&result.into_inner(), args.json)
                    }
                    Called::Answer(Err(s))
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
                    Called::Answer(Err(s)) => {
                        Sign::Present(format!("the coordinator at {address}: {}", s.message()))
                    }
                    Called::NoConnection(why) => {
                        Sign::Absent(format!("cannot reach the coordinator at {address} ({why})"))
                    }
                    Called::NotSent(why) => Sign::Unclear(why),
                }
            }
        };
        last_error = sign.why().to_string();
        if let Some(why) = absence.settled(&sign, SystemClock.instant(), NO_COORDINATOR_GRACE) {
            return no_run(why);
        }
        tokio::time::sleep(
            RETRY_EVERY.min(deadline.saturating_duration_since(SystemClock.instant())),
        )
        .await;
    }
}

/// The innermost cause of an error (a connect error's "Connection refused").
fn source_of(e: &(dyn std::error::Error + 'static)) -> String {
    let mut inner = e;
    while let Some(s) = inner.source() {
        inner = s;
    }
    inner.to_string()
}

/// `request` with the service-account token at `path`, read now, as its bearer credential.
fn with_token<T>(
    mut request: tonic::Request<T>,
    path: &std::path::Path,
) -> Result<tonic::Request<T>, String> {
    let token = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the token {}: {e}", path.display()))?;
    crate::peer::client::bearer(&mut request, token.trim())
        .map_err(|_| format!("the token {} is not printable text", path.display()))?;
    Ok(request)
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

    /// What ends a check at once (no Lease), what after two Lease terms of nothing but absence
    /// (nobody holds the Lease, it ran out, nothing takes connections), and what is asked
    /// again until --timeout (a coordinator that took the connection: busy, not active, in a
    /// hand-over).
    #[test]
    fn no_coordinator_ends_the_check_within_two_lease_terms() {
        use crate::peer::lease::LEASE_SECONDS;
        let t0 = SystemClock.instant();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let g = NO_COORDINATOR_GRACE;
        assert_eq!(g, Duration::from_secs(2 * LEASE_SECONDS), "two Lease terms");
        let mut a = Absence::default();
        assert_eq!(
            a.settled(&Sign::Never("no Lease".into()), at(0), g),
            Some("no Lease".into())
        );
        let gone = Sign::Absent("nobody holds the Lease".into());
        let busy = Sign::Present("the coordinator: busy".into());
        let mut a = Absence::default();
        assert_eq!(a.settled(&gone, at(0), g), None);
        assert_eq!(a.settled(&Sign::Unclear("API".into()), at(10), g), None);
        // Past the old grace of one term and the clock slack (20 s): still asking.
        assert_eq!(a.settled(&gone, at(20), g), None);
        assert_eq!(a.settled(&gone, at(29), g), None);
        assert_eq!(
            a.settled(&gone, at(30), g).as_deref(),
            Some("nobody holds the Lease, and no coordinator came within 30s")
        );
        // A coordinator seen in between (a replica took over) starts the count again.
        let mut a = Absence::default();
        assert_eq!(a.settled(&gone, at(0), g), None);
        assert_eq!(a.settled(&busy, at(25), g), None);
        assert_eq!(a.settled(&gone, at(40), g), None);
        assert_eq!(a.settled(&gone, at(69), g), None);
        assert!(a.settled(&gone, at(70), g).is_some());
        // Busy or unclear for as long as it lasts: only --timeout ends that.
        let mut a = Absence::default();
        for s in 0..600 {
            assert_eq!(a.settled(&busy, at(s), g), None);
            assert_eq!(a.settled(&Sign::Unclear("API".into()), at(s), g), None);
        }
    }

    /// The grace holds the slowest hand-over between running replicas with 10 s to spare (for
    /// the skew between their clocks and slow API calls): after a release, the standby looks
    /// again at the end of the term it last read (at most one term later); after a crash, one
    /// term after the last renewal, then kube-lease-manager's random pause (at most 1 s), and
    /// through the Service the new holder's readiness probe (every 2 s,
    /// manifests/base/coordinator.yaml). One term and 5 s (the old grace) left 2 s.
    #[test]
    fn the_grace_holds_a_hand_over_with_room_to_spare() {
        use crate::peer::lease::LEASE_SECONDS;
        let term = Duration::from_secs(LEASE_SECONDS);
        let release = term;
        let crash = term + Duration::from_secs(1) + Duration::from_secs(2);
        let spare = Duration::from_secs(10);
        assert!(
            NO_COORDINATOR_GRACE >= release + spare,
            "{NO_COORDINATOR_GRACE:?}"
        );
        assert!(
            NO_COORDINATOR_GRACE >= crash + spare,
            "{NO_COORDINATOR_GRACE:?}"
        );
    }

    /// The Lease's word as a place to ask: a live holder's address and name; no Lease is no
    /// coordinator for good; nobody holding it, a holder past its term or one without an address
    /// is no coordinator for now.
    #[test]
    fn the_lease_says_where_to_ask_or_why_not() {
        use crate::peer::lease::Coordinator;
        let key = faultline_proto::auth::CoordinatorKey::generate()
            .unwrap()
            .public_key();
        let id = format!("coord-0@10.0.0.1:20262#{key}");
        assert_eq!(
            target_of(Coordinator::Live(id.clone()), "fs"),
            Ok(("10.0.0.1:20262".into(), "coord-0".into()))
        );
        let never = target_of(Coordinator::NoLease, "fs").unwrap_err();
        assert!(
            matches!(&never, Sign::Never(w) if w.contains("no coordinator Lease fs/faultline-peercheck")
                && w.contains("or the Lease was deleted")),
            "{never:?}"
        );
        let unheld = target_of(Coordinator::Unheld, "fs").unwrap_err();
        assert!(
            matches!(&unheld, Sign::Absent(w) if w.contains("nobody holds")),
            "{unheld:?}"
        );
        let expired = target_of(
            Coordinator::Expired {
                holder: id,
                renewed: Some("2026-11-24T12:00:00Z".parse().unwrap()),
            },
            "fs",
        )
        .unwrap_err();
        assert_eq!(
            expired,
            Sign::Absent(
                "the coordinator Lease's holder coord-0 stopped renewing it, last at 2026-11-24T12:00:00Z"
                    .into()
            )
        );
        let bad = target_of(Coordinator::Live("coord-0".into()), "fs").unwrap_err();
        assert!(
            matches!(&bad, Sign::Absent(w) if w.contains("names no address")),
            "{bad:?}"
        );
    }

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
