//! The Kubernetes clients the agent and the CLI use: from a kubeconfig or the in-cluster
//! service account, with timeouts chosen per purpose, a User-Agent that names the sender, and a
//! field manager on every write.
//!
//! Every request carries `User-Agent: faultline-agent/<version> (<node>)` (the CLI:
//! `faultline/<version> (cli)`), so an audit log shows which node's agent sent it. Every write
//! (POST, PUT, PATCH) names a field manager: the sinks' own (`faultline`, the Lease's
//! `faultline-<identity>`) where they set one, else [`FIELD_MANAGER`] added by a layer of the
//! client: kube-runtime's event `Recorder` sets none, and a write without one would be owned by
//! `unknown` (or the User-Agent's product) in `managedFields`.

use std::path::Path;
use std::time::Duration;

use http::{HeaderValue, Method, Request};
use kube::client::{Body, ClientBuilder};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// The server-side apply field manager of the agent's writes.
pub const FIELD_MANAGER: &str = "faultline";
/// The field manager of the CLI's writes.
pub(crate) const CLI_FIELD_MANAGER: &str = "faultline-cli";

/// The agent's namespace unless configured otherwise.
pub const DEFAULT_NAMESPACE: &str = "faultline-system";

/// How the agent reaches Kubernetes and who it is there: flags every Kubernetes part shares.
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Kubernetes: use this kubeconfig instead of the in-cluster service account.
    #[arg(long, env = "FAULTLINE_KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Never talk to Kubernetes, even inside a cluster.
    #[arg(long, env = "FAULTLINE_STANDALONE", value_parser = clap::builder::BoolishValueParser::new())]
    pub standalone: bool,
    /// Kubernetes: the namespace of the fault ConfigMaps, the coordinator's Lease and Service
    /// (the default `--coordinator`).
    #[arg(long, env = "POD_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Kubernetes: this agent's pod name (the reporting instance of its Events).
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Kubernetes: this agent's projected service-account token (audience `faultline-peer`),
    /// what the coordinator knows this node by: its peer-check reports and its taint-budget
    /// admissions carry it, and the coordinator takes the node's name from it (TokenReview).
    /// Re-read for every request (the kubelet rotates it). Without it the node is labelled but
    /// never newly tainted, and takes no part in peer checks.
    #[arg(long, env = "FAULTLINE_NODE_TOKEN_FILE")]
    pub node_token_file: Option<std::path::PathBuf>,
}

impl Flags {
    /// Kubernetes mode: a kubeconfig was given, or the agent runs in a pod. A failure leaves
    /// the agent standalone (said why): detection never waits for the API.
    pub(crate) async fn connect(&self, node: &str) -> Option<Clients> {
        if self.standalone || (self.kubeconfig.is_none() && !in_pod()) {
            return None;
        }
        match clients(self.kubeconfig.as_deref(), node).await {
            Ok(c) => {
                tracing::info!(node, namespace = %self.namespace, "Kubernetes mode");
                Some(c)
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach Kubernetes; running standalone");
                None
            }
        }
    }
}

/// Whether this process runs in a Kubernetes pod (the kubelet sets this variable in every
/// container).
pub(crate) fn in_pod() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
}

/// Who sends the requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sender<'a> {
    /// The agent on this node.
    Agent { node: &'a str },
    /// The `faultline` command.
    Cli,
}

impl Sender<'_> {
    /// The User-Agent header: `faultline-agent/<version> (<node>)` or `faultline/<version> (cli)`.
    pub(crate) fn user_agent(&self) -> String {
        let version = env!("CARGO_PKG_VERSION");
        match self {
            // A node name is a DNS subdomain, so it is always a valid header value; anything
            // else is replaced rather than refused (the header is for people reading logs).
            Sender::Agent { node } => {
                let node: String = node
                    .chars()
                    .map(|c| if c.is_ascii_graphic() { c } else { '?' })
                    .collect();
                format!("faultline-agent/{version} ({node})")
            }
            Sender::Cli => format!("faultline/{version} (cli)"),
        }
    }

    fn field_manager(&self) -> &'static str {
        match self {
            Sender::Agent { .. } => FIELD_MANAGER,
            Sender::Cli => CLI_FIELD_MANAGER,
        }
    }
}

/// What a client is for; its timeouts follow from it.
///
/// The numbers come from the coordinator Lease (`peer::lease`: 15 s, renewed 5 s before it runs
/// out; after a failed renewal kube-lease-manager waits 1-2 s, reads the Lease and patches it
/// again):
/// - `Lease`: a renewal must fail fast enough to be tried again before the Lease runs out, or a
///   healthy coordinator loses it to one slow request. 1 s per request: a failed patch (1 s),
///   the backoff (at most 2 s), the read and the second patch (1 s each) fit in the 5 s grace.
///   A Lease write is tiny; an API server that cannot answer it in a second is in trouble.
/// - `Calls` (every other request: reads, the sinks' writes, the CLI): 10 s, shorter than the
///   Lease, so a coordinator's own writes cannot outlast its leadership unnoticed; the sinks
///   retry with backoff, so a hung server costs a sink at most this before the next try.
/// - `Watch` (the node and ConfigMap sinks' watches of this node's own objects): a watch is quiet for
///   minutes. The API server sends a bookmark only about once a minute (the watch cache's
///   `defaultBookmarkFrequency`) and ends the watch after the watcher's `timeoutSeconds` (290 s,
///   kube-runtime's default, which also gives up on a stream idle for 295 s). A read timeout
///   under that would cut every quiet watch and make it list again: 300 s.
///
/// Connecting is bounded by 3 s everywhere (1 s for the Lease): an API server that does not
/// accept a connection in that time is down, and every caller retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    Calls,
    Lease,
    Watch,
}

impl Purpose {
    /// (connect, read, write) timeouts.
    pub(crate) fn timeouts(self) -> (Duration, Duration, Duration) {
        let s = Duration::from_secs;
        match self {
            Purpose::Calls => (s(3), s(10), s(10)),
            Purpose::Lease => (s(1), s(1), s(1)),
            Purpose::Watch => (s(3), s(300), s(10)),
        }
    }
}

/// The agent's clients: one per [`Purpose`], sharing the configuration.
#[derive(Clone)]
pub struct Clients {
    pub calls: Client,
    pub lease: Client,
    pub watch: Client,
}

impl std::fmt::Debug for Clients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clients")
    }
}

/// Why no client could be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("in-cluster configuration: {0}")]
    InCluster(#[from] kube::config::InClusterError),
    #[error("client: {0}")]
    Client(#[from] kube::Error),
    #[error("no Kubernetes configuration found (give --kubeconfig): {0}")]
    Infer(#[source] kube::config::InferConfigError),
    #[error("User-Agent {0:?} is not a valid header value")]
    UserAgent(String),
}

async fn config_from(kubeconfig: Option<&Path>) -> Result<Config, ClientError> {
    Ok(match kubeconfig {
        Some(p) => {
            let kc = Kubeconfig::read_from(p).map_err(|source| ClientError::Kubeconfig {
                path: p.display().to_string(),
                source,
            })?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|source| ClientError::Kubeconfig {
                    path: p.display().to_string(),
                    source,
                })?
        }
        None => Config::incluster()?,
    })
}

/// The agent's clients, from an explicit kubeconfig or the in-cluster service account.
pub async fn clients(kubeconfig: Option<&Path>, node: &str) -> Result<Clients, ClientError> {
    let config = config_from(kubeconfig).await?;
    let sender = Sender::Agent { node };
    Ok(Clients {
        calls: build(config.clone(), sender, Purpose::Calls)?,
        lease: build(config.clone(), sender, Purpose::Lease)?,
        watch: build(config, sender, Purpose::Watch)?,
    })
}

/// One client for calls, from an explicit kubeconfig or the in-cluster service account.
pub(crate) async fn client(
    kubeconfig: Option<&Path>,
    sender: Sender<'_>,
) -> Result<Client, ClientError> {
    build(config_from(kubeconfig).await?, sender, Purpose::Calls)
}

/// A client from `--kubeconfig`, else the usual places (`KUBECONFIG`, `~/.kube/config`, the
/// in-cluster service account): for the CLI.
pub async fn client_infer(kubeconfig: Option<&Path>) -> Result<Client, ClientError> {
    if kubeconfig.is_some() {
        return client(kubeconfig, Sender::Cli).await;
    }
    let config = Config::infer().await.map_err(ClientError::Infer)?;
    build(config, Sender::Cli, Purpose::Calls)
}

/// A client for `purpose`, whose requests name `sender`.
pub(crate) fn build(
    mut config: Config,
    sender: Sender<'_>,
    purpose: Purpose,
) -> Result<Client, ClientError> {
    let (connect, read, write) = purpose.timeouts();
    config.connect_timeout = Some(connect);
    config.read_timeout = Some(read);
    config.write_timeout = Some(write);
    // The read timeout counts from when a request is written, not from when its pooled
    // connection went idle: without this, a connection idle longer than the timeout failed the
    // next request sent on it (the "context canceled" seen against a real API server).
    config.reset_reader_on_write = true;
    // The Lease's renewals are retried by kube-lease-manager within the grace period; the
    // client's own retries of 429/503 (honouring Retry-After) would outlast it.
    if purpose == Purpose::Lease {
        config.default_retry = false;
    }
    let ua = sender.user_agent();
    let value = HeaderValue::from_str(&ua).map_err(|_| ClientError::UserAgent(ua.clone()))?;
    config
        .headers
        .retain(|(name, _)| name != http::header::USER_AGENT);
    config.headers.push((http::header::USER_AGENT, value));
    let manager = sender.field_manager();
    let builder = ClientBuilder::try_from(config)?;
    let layer = tower::util::MapRequestLayer::new(move |req: Request<Body>| {
        with_field_manager(req, manager)
    });
    Ok(builder.with_layer(&layer).build())
}

/// Adds `fieldManager=<manager>` to a write that names none.
fn with_field_manager<B>(mut req: Request<B>, manager: &str) -> Request<B> {
    if !matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH) {
        return req;
    }
    let uri = req.uri();
    let query = uri.query().unwrap_or("");
    if query
        .split('&')
        .any(|kv| kv.split('=').next() == Some("fieldManager"))
    {
        return req;
    }
    let path = uri.path();
    let pq = if query.is_empty() {
        format!("{path}?fieldManager={manager}")
    } else {
        format!("{path}?{query}&fieldManager={manager}")
    };
    let mut parts = uri.clone().into_parts();
    match pq.parse() {
        Ok(pq) => parts.path_and_query = Some(pq),
        // The manager is one of two constants made of URL-safe characters: cannot happen.
        Err(_) => return req,
    }
    if let Ok(new) = http::Uri::from_parts(parts) {
        *req.uri_mut() = new;
    }
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_without_a_field_manager_get_one_and_others_are_left_alone() {
        let req = |method: Method, uri: &str| {
            Request::builder()
                .method(method)
                .uri(uri)
                .body(())
                .unwrap_or_default()
        };
        let uri = |r: Request<()>| r.uri().to_string();
        assert_eq!(
            uri(with_field_manager(
                req(
                    Method::POST,
                    "https://k/apis/events.k8s.io/v1/namespaces/default/events?"
                ),
                FIELD_MANAGER
            )),
            "https://k/apis/events.k8s.io/v1/namespaces/default/events?fieldManager=faultline"
        );
        assert_eq!(
            uri(with_field_manager(
                req(
                    Method::PATCH,
                    "/api/v1/nodes/n1?fieldManager=faultline&force=true"
                ),
                CLI_FIELD_MANAGER
            )),
            "/api/v1/nodes/n1?fieldManager=faultline&force=true",
            "an explicit manager is kept"
        );
        assert_eq!(
            uri(with_field_manager(
                req(Method::PUT, "/api/v1/namespaces/x/configmaps/y?dryRun=All"),
                CLI_FIELD_MANAGER
            )),
            "/api/v1/namespaces/x/configmaps/y?dryRun=All&fieldManager=faultline-cli"
        );
        for m in [Method::GET, Method::DELETE] {
            assert_eq!(
                uri(with_field_manager(
                    req(m, "/api/v1/nodes?limit=1"),
                    FIELD_MANAGER
                )),
                "/api/v1/nodes?limit=1"
            );
        }
    }

    #[test]
    fn the_user_agent_names_the_program_its_version_and_the_node() {
        let v = env!("CARGO_PKG_VERSION");
        assert_eq!(
            Sender::Agent { node: "gpu-7" }.user_agent(),
            format!("faultline-agent/{v} (gpu-7)")
        );
        assert_eq!(Sender::Cli.user_agent(), format!("faultline/{v} (cli)"));
        let odd = Sender::Agent { node: "a b\n" }.user_agent();
        assert!(HeaderValue::from_str(&odd).is_ok(), "{odd}");
    }

    /// The Lease client's timeouts leave room for a failed renewal, kube-lease-manager's 1 s
    /// backoff and a second try inside the grace period; no ordinary call outlasts the Lease;
    /// a quiet watch outlives the server's bookmark period and the watcher's own timeout.
    #[test]
    fn timeouts_follow_from_the_lease_and_the_watch() {
        let lease = crate::peer::lease::LEASE_SECONDS;
        let grace = crate::peer::lease::GRACE_SECONDS;
        let (c, r, w) = Purpose::Lease.timeouts();
        let one_request = c.max(r.max(w));
        // A failed patch, the longest backoff, then a read and a patch.
        assert!(3 * one_request + Duration::from_secs(2) <= Duration::from_secs(grace));
        let (_, r, w) = Purpose::Calls.timeouts();
        assert!(r < Duration::from_secs(lease) && w < Duration::from_secs(lease));
        let (_, r, _) = Purpose::Watch.timeouts();
        assert!(r > Duration::from_secs(290 + 5) && r > Duration::from_secs(60));
    }
}
