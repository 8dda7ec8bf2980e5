//! `faultline`: read this node's fault record, wait for health, clear faults.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use faultline_agent::cli;
use faultline_agent::clock::SystemClock;
use faultline_core::record::{Handling, Health};

#[derive(Debug, Parser)]
#[command(
    name = "faultline",
    version,
    about = "Read and act on faultline's fault records"
)]
struct Cli {
    /// The agent's state directory (holds faults.json).
    #[arg(
        long,
        global = true,
        env = "FAULTLINE_STATE_DIR",
        default_value = "/run/faultline"
    )]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum HealthArg {
    Healthy,
    Degraded,
    Unhealthy,
}

impl From<HealthArg> for Health {
    fn from(h: HealthArg) -> Self {
        match h {
            HealthArg::Healthy => Health::Healthy,
            HealthArg::Degraded => Health::Degraded,
            HealthArg::Unhealthy => Health::Unhealthy,
        }
    }
}

// Parsed once at start-up and matched once: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Print this node's record.
    Get {
        /// Read this file instead of <state-dir>/faults.json.
        #[arg(long, conflicts_with = "cluster")]
        file: Option<PathBuf>,
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
        /// Include recovered faults.
        #[arg(long)]
        all: bool,
        /// Every node's record, from the cluster's fault ConfigMaps (needs a kubeconfig or a
        /// service account that may list ConfigMaps and pods in the namespace). A record whose
        /// node has no Ready agent pod is printed with a warning on stderr, and the exit status
        /// is 3.
        #[arg(long)]
        cluster: bool,
        /// With --cluster: the kubeconfig to use (default: KUBECONFIG, ~/.kube/config, in-cluster).
        #[arg(long, env = "FAULTLINE_KUBECONFIG", requires = "cluster")]
        kubeconfig: Option<PathBuf>,
        /// With --cluster: the namespace of the fault ConfigMaps.
        #[arg(long, default_value = "faultline-system", requires = "cluster")]
        namespace: String,
        /// With --cluster: only this node.
        #[arg(long, requires = "cluster")]
        node: Option<String>,
        /// With --cluster: only nodes with this verdict (repeat or comma-separate).
        #[arg(long, value_enum, value_delimiter = ',', requires = "cluster")]
        health: Vec<HealthArg>,
        /// With --cluster: only nodes with an active fault of this code (e.g. Xid79).
        #[arg(long, requires = "cluster")]
        code: Option<String>,
        /// The agent counts as not alive when the record's heartbeat is older than this: the
        /// record is still printed, with a warning on stderr, and the exit status is 3.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration, conflicts_with = "cluster")]
        stale_after: Duration,
    },
    /// Wait until this node is healthy: exit 0 healthy, 1 still unhealthy at the timeout,
    /// 2 when the record cannot be read, or the agent is not alive (its heartbeat is stale) at the
    /// timeout.
    WaitHealthy {
        #[arg(long)]
        file: Option<PathBuf>,
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        interval: Duration,
        /// Also accept a Degraded node whose faults need at most a restart of the job
        /// (handling RestartBusiness or below), never one that needs a chip reset or isolation.
        #[arg(long)]
        allow_degraded: bool,
        /// Accept a Degraded node whose most severe handling is at most this level (implies
        /// --allow-degraded with another threshold); an Unhealthy node never passes.
        #[arg(long, value_parser = parse_handling)]
        max_handling: Option<Handling>,
        /// The agent counts as dead (exit 2) when the record's heartbeat is older than this.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        stale_after: Duration,
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
    },
    /// Usable nodes as host:slots lines (for Horovod elastic's discover_hosts and other
    /// launchers): a Ready Node with accelerators, a Ready agent pod, and a record the
    /// acceptance rule takes. Prints nothing when none is usable; exit 2 when there is no
    /// record at all (wrong namespace) or a list is refused. Needs list on nodes, and on
    /// configmaps and pods in the agents' namespace.
    Hosts {
        /// Slots (processes) per host to print (default: the node's allocatable accelerators).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        slots: Option<u32>,
        /// Also list Degraded nodes whose faults need at most a restart of the job (handling
        /// RestartBusiness or below).
        #[arg(long)]
        allow_degraded: bool,
        /// List Degraded nodes whose most severe handling is at most this level.
        #[arg(long, value_parser = parse_handling)]
        max_handling: Option<Handling>,
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
        /// The kubeconfig to use (default: KUBECONFIG, ~/.kube/config, in-cluster).
        #[arg(long, env = "FAULTLINE_KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
        /// The namespace of the fault ConfigMaps.
        #[arg(long, default_value = "faultline-system")]
        namespace: String,
        /// List the job's pods (selected with -l) that run on usable nodes, with the
        /// accelerators each asks for, instead of the nodes. Needs list on pods there.
        #[arg(long, requires = "selector")]
        pods: bool,
        /// The job's pods, as a label selector (with --pods).
        #[arg(short = 'l', long, requires = "pods")]
        selector: Option<String>,
        /// The job's namespace (with --pods).
        #[arg(long, default_value = "default", requires = "pods")]
        pod_namespace: String,
        /// Print pod IPs instead of hostnames (with --pods; hostnames resolve only through a
        /// headless Service named by the pods' subdomain).
        #[arg(long, requires = "pods")]
        ip: bool,
        /// Without Kubernetes (bare metal, Slurm): the peer checks' members file; each
        /// member's agent is asked for its record on --agent-port (start the agents with
        /// `--listen <ip>:<port>`). Needs --slots.
        #[arg(long, conflicts_with = "pods", requires = "slots")]
        members: Option<PathBuf>,
        /// The agents' HTTP port (with --members).
        #[arg(long, default_value_t = faultline_agent::http::DEFAULT_PORT, requires = "members")]
        agent_port: u16,
        /// A member whose agent's last heartbeat is older than this is left out (with
        /// --members; the agents' clocks are compared with this host's, and may be off from it
        /// by as much either way: a heartbeat dated further ahead is left out too).
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration, requires = "members")]
        stale_after: Duration,
        /// How long to wait for each member's agent (with --members).
        #[arg(long, default_value = "3s", value_parser = humantime::parse_duration, requires = "members")]
        agent_timeout: Duration,
    },
    /// Run a peer check among these nodes now and print faulty nodes, broken and degraded
    /// links and stragglers. Exit 0: none; 1: some; 3: some nodes could not be judged; 2: no
    /// run (without a coordinator: at once when there is no coordinator Lease, after 30 s when
    /// none holds it or takes connections).
    Check {
        /// Node names, comma separated.
        #[arg(
            long,
            value_delimiter = ',',
            required_unless_present = "pods",
            conflicts_with = "pods"
        )]
        nodes: Vec<String>,
        /// Check the nodes of the job's pods matching this label selector instead (a list of
        /// pods in --pod-namespace: no cluster-wide right needed); waits for them to be
        /// scheduled, within --timeout.
        #[arg(long)]
        pods: Option<String>,
        /// The job's namespace (with --pods).
        #[arg(long, env = "FAULTLINE_JOB_NAMESPACE", default_value = "default")]
        pod_namespace: String,
        /// Give up after this long (the run, and retries while the coordinator is busy or
        /// changing).
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Deadline of each check (default: the coordinator's policy, `peer.check_timeout`).
        #[arg(long, value_parser = humantime::parse_duration)]
        check_timeout: Option<Duration>,
        /// The coordinator's address (host:port: in a cluster its Service,
        /// `faultline-coordinator.faultline-system:20262`, which sends requests to the active
        /// replica). Default on Kubernetes: the Lease holder's. Required without Kubernetes.
        #[arg(long, env = "FAULTLINE_COORDINATOR")]
        coordinator: Option<String>,
        /// The requesters' peer-check secret (the coordinator's `--requester-secret-file`): it
        /// requests runs and nothing else.
        #[arg(
            long,
            env = "FAULTLINE_PEER_REQUESTER_SECRET_FILE",
            default_value = "/etc/faultline/peer/requester-secret"
        )]
        secret_file: PathBuf,
        /// On Kubernetes, instead of a secret: a service-account token projected for the
        /// audience `faultline-peercheck` (the coordinator checks it with TokenReview and
        /// SubjectAccessReview: `create` on `peerchecks.faultline.io` in the agents' namespace).
        #[arg(long, env = "FAULTLINE_PEER_TOKEN_FILE")]
        token_file: Option<PathBuf>,
        #[arg(long, env = "FAULTLINE_KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
        #[arg(long, env = "POD_NAMESPACE", default_value = "faultline-system")]
        namespace: String,
        /// Without a coordinator service (bare metal, Slurm): run the check from this process,
        /// as a one-shot coordinator of the nodes in this members file (the coordinator's
        /// format). Needs the coordinator's key and the master of the nodes' keys; never while
        /// a coordinator with the same key runs.
        #[arg(long, conflicts_with_all = ["coordinator", "pods", "token_file"], requires_all = ["coordinator_key_file", "node_key_master_file"])]
        members: Option<PathBuf>,
        /// With --members: the coordinator's key (`faultline keys coordinator`).
        #[arg(long, env = "FAULTLINE_COORDINATOR_KEY_FILE", requires = "members")]
        coordinator_key_file: Option<PathBuf>,
        /// With --members: the master of the nodes' keys (`faultline keys master`).
        #[arg(
            long,
            env = "FAULTLINE_PEER_NODE_KEY_MASTER_FILE",
            requires = "members"
        )]
        node_key_master_file: Option<PathBuf>,
        /// With --members: where the agents' reports are taken while the run lasts.
        #[arg(long, default_value = "0.0.0.0:20262", requires = "members")]
        report_listen: std::net::SocketAddr,
        /// With --members: the address (ip or ip:port) the agents send their reports to.
        /// Default: --report-listen's, when it names one.
        #[arg(long, requires = "members")]
        report_address: Option<String>,
        /// With --members: the first of the 32 ports the agents' probes listen on.
        #[arg(long, default_value_t = 20270, requires = "members")]
        probe_port_base: u16,
        /// With --members: the policy (its `peer` section: sizes and deadlines).
        #[arg(long, env = "FAULTLINE_POLICY", requires = "members")]
        policy: Option<PathBuf>,
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
    },
    /// Peer-check credentials without Kubernetes: the coordinator's key, the master of the
    /// nodes' keys, and each node's own key (docs/peer-checks.md, "Bare metal").
    #[command(subcommand)]
    Keys(Keys),
    /// Ask the agent to clear active faults (all, or by code and/or device) and wait for its
    /// answer: exit 0 some cleared (it says which), 1 none matched (it says what is active), 2
    /// refused or not answered within --wait.
    Clear {
        #[arg(long)]
        code: Option<String>,
        /// The device as `faultline get` shows it (its DEVICE column: GPU-2, GPU-0000:3b:00.0,
        /// Ascend910-1, node), its UUID, or its PCI bus id (3b:00.0, 0000:3b:00.0).
        #[arg(long)]
        device: Option<String>,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        wait: Duration,
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
    },
}

#[derive(Debug, Subcommand)]
enum Keys {
    /// Write a new coordinator key (for `faultline-coordinator --key-file`); prints its public
    /// key, which every agent is given (`--peer-coordinator-key`).
    Coordinator {
        #[arg(long)]
        out: PathBuf,
    },
    /// Print the public key of a coordinator key.
    Public {
        #[arg(long)]
        key: PathBuf,
    },
    /// Write a new master of the nodes' keys (for `faultline-coordinator
    /// --node-key-master-file`).
    Master {
        #[arg(long)]
        out: PathBuf,
    },
    /// Write one node's key (for its agent's `--peer-node-key-file`), derived from the master.
    Node {
        #[arg(long)]
        master: PathBuf,
        #[arg(long)]
        node: String,
        #[arg(long)]
        out: PathBuf,
    },
}

/// A handling level by MindCluster's name (case-insensitive).
fn parse_handling(s: &str) -> Result<Handling, String> {
    Handling::ALL
        .into_iter()
        .find(|h| h.as_str().eq_ignore_ascii_case(s))
        .ok_or_else(|| {
            let names: Vec<&str> = Handling::ALL.iter().map(|h| h.as_str()).collect();
            format!("unknown handling level {s:?}; one of {}", names.join(", "))
        })
}

/// Runs a command that reads the cluster, on a small runtime, with a client from `kubeconfig`
/// (or the usual places).
fn with_cluster<F, Fut>(kubeconfig: Option<PathBuf>, f: F) -> cli::Outcome
where
    F: FnOnce(kube::Client) -> Fut,
    Fut: std::future::Future<Output = cli::Outcome>,
{
    on_runtime(async {
        match faultline_agent::kube_client::client_infer(kubeconfig.as_deref()).await {
            Ok(client) => f(client).await,
            Err(e) => cli::Outcome::failed(format!("error: {e}")),
        }
    })
}

/// Runs `run` on a single-threaded runtime.
fn on_runtime(run: impl std::future::Future<Output = cli::Outcome>) -> cli::Outcome {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(run),
        Err(e) => cli::Outcome::failed(format!("error: {e}")),
    }
}

// `pub(crate)`: the faultline-agent binary runs it too, when called by the name `faultline`.
pub(crate) fn main() -> std::process::ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        // `-o json` promises one JSON document on stdout, argument errors included; clap
        // failed before it parsed `-o`, so the raw arguments say whether it was asked for.
        Err(e) if e.use_stderr() && cli::json_requested(args.iter().skip(1)) => {
            let outcome = cli::usage_error(&e.render().to_string());
            if let (Some(out), _) = cli::render(&outcome, true) {
                println!("{out}");
            }
            return std::process::ExitCode::from(outcome.code);
        }
        Err(e) => e.exit(),
    };
    let json = match &cli.command {
        Command::Get { output, .. }
        | Command::WaitHealthy { output, .. }
        | Command::Hosts { output, .. }
        | Command::Check { output, .. }
        | Command::Clear { output, .. } => matches!(output, Output::Json),
        Command::Keys(_) => false,
    };
    let outcome = match cli.command {
        Command::Get {
            cluster: true,
            all,
            kubeconfig,
            namespace,
            node,
            health,
            code,
            ..
        } => {
            let filter = cli::ClusterFilter {
                node,
                health: health.into_iter().map(Health::from).collect(),
                code,
            };
            with_cluster(kubeconfig, |client| async move {
                cli::get_cluster(client, &namespace, &filter, json, all).await
            })
        }
        Command::Hosts {
            slots,
            allow_degraded,
            max_handling,
            members: Some(members),
            agent_port,
            stale_after,
            agent_timeout,
            ..
        } => on_runtime(async move {
            let accept = cli::Accept::from_flags(allow_degraded, max_handling);
            cli::members::hosts(
                &members,
                agent_port,
                slots.unwrap_or_default(),
                accept,
                stale_after,
                agent_timeout,
            )
            .await
        }),
        Command::Hosts {
            slots,
            allow_degraded,
            max_handling,
            kubeconfig,
            namespace,
            pods,
            selector,
            pod_namespace,
            ip,
            members: None,
            ..
        } => with_cluster(kubeconfig, |client| async move {
            let accept = cli::Accept::from_flags(allow_degraded, max_handling);
            let pods = pods.then(|| cli::PodQuery {
                namespace: pod_namespace,
                selector: selector.unwrap_or_default(),
                ip,
            });
            cli::hosts(client, &namespace, slots, accept, pods).await
        }),
        Command::Get {
            file,
            all,
            stale_after,
            ..
        } => cli::get(
            &cli::record_path(file.as_deref(), &cli.state_dir),
            json,
            all,
            &cli::Now::read(&SystemClock),
            stale_after,
        ),
        Command::WaitHealthy {
            file,
            timeout,
            interval,
            allow_degraded,
            max_handling,
            stale_after,
            ..
        } => cli::wait_healthy(
            &cli::record_path(file.as_deref(), &cli.state_dir),
            timeout,
            interval,
            cli::Accept::from_flags(allow_degraded, max_handling),
            stale_after,
            &SystemClock,
        ),
        Command::Check {
            nodes,
            pods,
            pod_namespace,
            timeout,
            check_timeout,
            coordinator,
            secret_file,
            token_file,
            kubeconfig,
            namespace,
            members,
            coordinator_key_file,
            node_key_master_file,
            report_listen,
            report_address,
            probe_port_base,
            policy,
            ..
        } => {
            let one_shot = match (members, coordinator_key_file, node_key_master_file) {
                (Some(members), Some(key_file), Some(node_key_master_file)) => {
                    Some(faultline_coordinator::oneshot::OneShot {
                        nodes: nodes.clone(),
                        members,
                        key_file,
                        node_key_master_file,
                        listen: report_listen,
                        address: report_address,
                        probe_port_base,
                        policy,
                        check_timeout,
                    })
                }
                _ => None,
            };
            let args = cli::CheckArgs {
                nodes,
                pods: pods.map(|sel| (pod_namespace, sel)),
                timeout,
                check_timeout,
                coordinator,
                secret_file,
                token_file,
                kubeconfig,
                namespace,
                json,
            };
            let outcome = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => match one_shot {
                    Some(o) => rt.block_on(check_one_shot(o, timeout, json)),
                    None => rt.block_on(cli::check(args)),
                },
                Err(e) => cli::Outcome::failed(format!("error: {e}")),
            };
            // Verdicts go to stdout whatever the exit status (1 and 3 included); errors to
            // stderr, or as JSON to stdout.
            if outcome.code != 2 && !json {
                println!("{}", outcome.message);
                return std::process::ExitCode::from(outcome.code);
            }
            outcome
        }
        Command::Clear {
            code, device, wait, ..
        } => cli::clear(&cli.state_dir, code, device, wait),
        Command::Keys(k) => match k {
            Keys::Coordinator { out } => cli::keys::coordinator(&out),
            Keys::Public { key } => cli::keys::public(&key),
            Keys::Master { out } => cli::keys::master(&out),
            Keys::Node { master, node, out } => cli::keys::node(&master, &node, &out),
        },
    };
    let (out, err) = cli::render(&outcome, json);
    if let Some(out) = out {
        println!("{out}");
    }
    if let Some(err) = err {
        eprintln!("{err}");
    }
    std::process::ExitCode::from(outcome.code)
}

/// `faultline check --members`: the run from this process, as a one-shot coordinator
/// (`faultline_coordinator::oneshot`), within `timeout`.
async fn check_one_shot(
    o: faultline_coordinator::oneshot::OneShot,
    timeout: Duration,
    json: bool,
) -> cli::Outcome {
    if let Err(e) = cli::validate_nodes(&o.nodes) {
        return cli::Outcome::failed(format!("error: {e}"));
    }
    match tokio::time::timeout(timeout, faultline_coordinator::oneshot::run(o)).await {
        Ok(Ok(result)) => cli::check_report(&result, json),
        Ok(Err(e)) => cli::Outcome::failed(format!("error: {e:#}")),
        Err(_) => cli::Outcome::failed(format!(
            "error: no result within {}",
            humantime::format_duration(timeout)
        )),
    }
}
