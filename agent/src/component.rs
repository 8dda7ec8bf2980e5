//! The contract every part of the agent is started through, sources and sinks alike.
//!
//! A component is a value built from its own group of flags (a `clap::Args` struct in its
//! module, flattened into the agent's command line) plus the few channel ends it alone uses.
//! [`Component::start`] hands it the [`Context`] every component shares and gets back a
//! [`Handle`], which the daemon waits on at shutdown. The daemon does nothing else with it.
//!
//! docs/ARCHITECTURE.md ("Components") walks through one source and one sink.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::clock::Clock;
use crate::engine_loop::Snapshot;
use crate::kube_client::Clients;
use crate::metrics::Metrics;
use crate::source::{Input, SourceContext};
use faultline_core::policy::LoadedPolicy;

/// What every component is started with.
#[derive(Debug, Clone)]
pub(crate) struct Context {
    /// This node's name.
    pub node: String,
    /// Where sources send what they observe; the engine loop reads it.
    pub inputs: mpsc::Sender<Input>,
    /// The engine loop's latest snapshot (`None` until its first pass): what sinks publish.
    pub snapshots: watch::Receiver<Option<Snapshot>>,
    /// The policy in force, replaced when the policy file changes.
    pub policy: watch::Receiver<LoadedPolicy>,
    pub metrics: Arc<Metrics>,
    pub clock: Arc<dyn Clock>,
    /// The Kubernetes API clients; `None` when the agent runs without Kubernetes.
    pub kube: Option<Clients>,
    /// When to stop: one signal for every part. The engine loop then applies what is already
    /// queued and publishes a final snapshot, and each sink writes it (the daemon waits for
    /// them in that order).
    pub shutdown: CancellationToken,
}

impl Context {
    /// The narrower context the sources' own functions take.
    pub(crate) fn source(&self) -> SourceContext {
        SourceContext {
            tx: self.inputs.clone(),
            metrics: self.metrics.clone(),
            clock: self.clock.clone(),
            shutdown: self.shutdown.clone(),
        }
    }
}

/// A source or a sink.
pub(crate) trait Component: Sized {
    /// The name its logs and its tracing span carry.
    const NAME: &'static str;

    /// Starts the component. An error says why it could not start; the daemon decides
    /// whether the agent runs without it.
    fn start(self, cx: &Context) -> impl Future<Output = Result<Handle, StartError>> + Send;
}

/// A component the flags may turn off: `None` starts nothing.
impl<C: Component + Send> Component for Option<C> {
    const NAME: &'static str = C::NAME;

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        match self {
            Some(c) => c.start(cx).await,
            None => Ok(Handle::none()),
        }
    }
}

/// Why a component did not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    #[error("cannot listen on {addr}")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Flags(&'static str),
    #[error("{what}")]
    Key {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Why a flag's value was refused (clap prints it with the flag's name).
#[derive(Debug, thiserror::Error)]
pub(crate) enum FlagError {
    #[error(transparent)]
    Duration(#[from] humantime::DurationError),
    #[error("{value} is outside {range}")]
    Outside { value: String, range: &'static str },
    #[error("{value} is longer than {max}")]
    TooLong { value: String, max: &'static str },
}

/// The tasks a started component runs, awaited at shutdown. Empty for a component that is
/// disabled, or whose work runs on a thread that cannot be joined (the kernel-log reader's
/// blocking read: it ends at its next record after shutdown).
#[derive(Debug, Default)]
#[must_use = "the daemon waits on a component's handle at shutdown"]
pub(crate) struct Handle(Vec<JoinHandle<()>>);

impl Handle {
    /// Nothing to wait for.
    pub(crate) fn none() -> Self {
        Handle::default()
    }

    /// Runs `task` under the component's span.
    pub(crate) fn spawn(
        name: &'static str,
        task: impl Future<Output = ()> + Send + 'static,
    ) -> Self {
        Handle(vec![tokio::spawn(
            task.instrument(tracing::info_span!("component", name)),
        )])
    }

    /// A source's task: if it dies of a panic, `detectors` are reported down
    /// ([`watched_task`](crate::source::watched_task)) unless the agent is stopping.
    pub(crate) fn watched(
        name: &'static str,
        detectors: &'static [&'static str],
        cx: &Context,
        task: impl Future<Output = ()> + Send + 'static,
    ) -> Self {
        Self::spawn(
            name,
            crate::source::watched_task(name, detectors, cx.source(), task),
        )
    }

    /// Tasks already running.
    pub(crate) fn of(tasks: Vec<JoinHandle<()>>) -> Self {
        Handle(tasks)
    }

    /// Adds another component's tasks to this handle.
    pub(crate) fn add(&mut self, other: Handle) {
        self.0.extend(other.0);
    }

    /// Waits until every task has ended (a task that panicked counts as ended).
    pub(crate) async fn join(self) {
        for t in self.0 {
            let _ = t.await;
        }
    }
}
