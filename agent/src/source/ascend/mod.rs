//! The Ascend NPU source: polls `npu-smi` (chips, health, error codes) and `hccn_tool` (port
//! state, speed, link-up count, net health) every `ascend.poll_interval` and sends what the
//! analyzer makes of it to the engine.
//!
//! No `npu-smi` on the node is normal (not an Ascend node): the detector is `Idle` and the
//! source looks again after the poll interval, doubling the wait up to [`ABSENT_RECHECK`] (and
//! at once when the policy changes), in case the driver is installed later. A tool that hangs is
//! killed at `ascend.call_timeout`; a tool that fails or prints something unparseable marks its
//! detector `Down` with the reason. Neither stops the agent nor loses a fault already known.

pub(crate) mod analyze;
pub(crate) mod tools;

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::watch;
use tracing::{debug, info, warn};

use self::analyze::{Analyzer, LinkPoll, Poll, Unread};
use self::tools::{Tool, ToolError, Tools};
use super::{Input, SourceContext};
use crate::component::{Component, Context, Handle, StartError};
use crate::metrics::{Metrics, ToolLabel};
use crate::metrics::{DETECTOR_HCCN, DETECTOR_NPU_SMI};
use faultline_core::engine::DetectorState;
use faultline_core::parse::ascend::{self as parse, AscendParseError};
use faultline_core::policy::AscendPolicy;
use faultline_core::policy::LoadedPolicy;

/// What every call of one poll uses.
struct Caller<'a, T> {
    tools: &'a T,
    metrics: &'a Metrics,
    policy: &'a AscendPolicy,
}

impl<T: Tools> Caller<'_, T> {
    /// One call: runs the tool, counts the outcome, parses. The error is the reason for the
    /// detector status.
    async fn call<R>(
        &self,
        tool: Tool,
        args: &[&str],
        parse: impl FnOnce(&str) -> Result<R, AscendParseError>,
    ) -> Result<R, Unread> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let call = format!("{} {}", tool.as_str(), args.join(" "));
        let result = match self.tools.run(tool, &args, self.policy.call_timeout).await {
            Ok(out) => parse(&out).map_err(|source| ("garbage", Unread::Garbage { call, source })),
            // Not installed (a node without Ascend NPUs) is no failed call.
            Err(ToolError::NotFound(n)) => Err(("absent", Unread::Absent(n))),
            Err(source @ ToolError::Timeout(_)) => Err(("timeout", Unread::Tool { call, source })),
            Err(source) => Err(("failed", Unread::Tool { call, source })),
        };
        let label = match &result {
            Ok(_) => "ok",
            Err((l, _)) => l,
        };
        self.metrics
            .tool_calls
            .get_or_create(&ToolLabel {
                tool: tool.as_str(),
                result: label,
            })
            .inc();
        result.map_err(|(_, e)| e)
    }
}

/// `npu-smi` is not installed (under the name or path the agent was given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NotInstalled(pub String);

/// Reads everything once.
pub(crate) async fn poll_once<T: Tools>(
    tools: &T,
    policy: &AscendPolicy,
    metrics: &Metrics,
) -> Result<Poll, NotInstalled> {
    let caller = &Caller {
        tools,
        metrics,
        policy,
    };
    let chips = match caller
        .call(Tool::NpuSmi, &["info"], parse::parse_npu_info)
        .await
    {
        Err(Unread::Absent(name)) => return Err(NotInstalled(name)),
        r => r,
    };
    let mut poll = Poll {
        chips,
        health: BTreeMap::new(),
        links: BTreeMap::new(),
        hccn_error: None,
        hccn_absent: false,
    };
    let Ok(chips) = poll.chips.clone() else {
        return Ok(poll);
    };
    let mut npu_smi_hung: Option<Unread> = None;
    for c in &chips {
        let id = c.logical_id();
        if let Some(h) = &npu_smi_hung {
            poll.health
                .insert(id, Err(Unread::Skipped(Box::new(h.clone()))));
            continue;
        }
        let (npu, chip) = (c.npu.to_string(), c.chip.to_string());
        let args = [
            "info",
            "-t",
            "health",
            "-i",
            npu.as_str(),
            "-c",
            chip.as_str(),
        ];
        let r = caller
            .call(Tool::NpuSmi, &args, parse::parse_chip_health)
            .await;
        if let Err(e) = &r {
            if e.is_hung() {
                npu_smi_hung = Some(e.clone());
            }
        }
        poll.health.insert(id, r);
    }
    for c in &chips {
        let id = c.logical_id();
        let ids = id.to_string();
        let q = |what: &'static str| ["-i", ids.as_str(), what, "-g"];
        let status = match caller
            .call(Tool::HccnTool, &q("-link"), parse::parse_link_status)
            .await
        {
            Err(Unread::Absent(_)) => {
                poll.hccn_absent = true;
                break;
            }
            Err(e) if e.is_hung() => {
                poll.hccn_error = Some(e);
                break;
            }
            r => r,
        };
        // The counters asked for only when the policy uses them.
        let counter =
            |on: bool, what: &'static str, parse: fn(&str) -> Result<u64, AscendParseError>| {
                let args = q(what);
                async move {
                    if !on {
                        return None;
                    }
                    Some(caller.call(Tool::HccnTool, &args, parse).await)
                }
            };
        let speed_mbps = counter(
            policy.expected_speed_mbps > 0,
            "-speed",
            parse::parse_speed_mbps,
        )
        .await;
        let up_count = counter(
            policy.link_flap_count > 0,
            "-link_stat",
            parse::parse_link_up_count,
        )
        .await;
        let net = caller
            .call(Tool::HccnTool, &q("-net_health"), parse::parse_net_health)
            .await;
        poll.links.insert(
            id,
            LinkPoll {
                status,
                speed_mbps,
                up_count,
                net,
            },
        );
    }
    Ok(poll)
}

/// The longest wait before a node without `npu-smi` is looked at again: the wait starts at the
/// poll interval and doubles up to this. Each look is a search of the tool's `PATH` (11 `stat`
/// calls with the DaemonSet's); at the poll interval (10 s) forever it would be the idle
/// agent's most frequent wake-up on every node without NPUs. A driver installed soon
/// after the agent started (a driver DaemonSet) is seen soon; later, within this, or at once
/// with a policy change or a restart.
pub(crate) const ABSENT_RECHECK: std::time::Duration = std::time::Duration::from_secs(300);

/// The Ascend source's flags.
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Do not poll the Ascend tools (npu-smi, hccn_tool) at all.
    #[arg(long, env = "FAULTLINE_NO_ASCEND", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_ascend: bool,
    /// The `npu-smi` to run (as root): a path, or a name looked up on the agent's PATH. Only
    /// a flag, never the policy: changing it takes a rollout.
    #[arg(long, env = "FAULTLINE_NPU_SMI", default_value = "npu-smi")]
    pub npu_smi: std::path::PathBuf,
    /// The `hccn_tool` to run (as root): a path, or a name looked up on the agent's PATH.
    #[arg(long, env = "FAULTLINE_HCCN_TOOL", default_value = "hccn_tool")]
    pub hccn_tool: std::path::PathBuf,
}

impl Flags {
    /// The source, running the tools the flags name; `None` with `--no-ascend`.
    pub(crate) fn source(&self) -> Option<Ascend> {
        if self.no_ascend {
            info!("Ascend source disabled");
            return None;
        }
        Some(Ascend(tools::RealTools::new(tools::ToolPaths {
            npu_smi: self.npu_smi.clone(),
            hccn_tool: self.hccn_tool.clone(),
        })))
    }
}

/// The Ascend source, as the daemon starts it.
#[derive(Debug)]
pub(crate) struct Ascend(tools::RealTools);

impl Component for Ascend {
    const NAME: &'static str = "ascend";

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        let source = run(Arc::new(self.0), cx.policy.clone(), cx.source());
        let detectors = &[DETECTOR_NPU_SMI, DETECTOR_HCCN];
        Ok(Handle::watched(Self::NAME, detectors, cx, source))
    }
}

/// Runs the source until shutdown.
pub(crate) async fn run<T: Tools>(
    tools: Arc<T>,
    mut policy: watch::Receiver<LoadedPolicy>,
    ctx: SourceContext,
) {
    let mut analyzer = Analyzer::default();
    // While the tool is missing (reported once): how long until the next look.
    let mut absent_wait: Option<std::time::Duration> = None;
    let clock = ctx.clock.clone();
    loop {
        let p = policy.borrow_and_update().policy.ascend.clone();
        let started = clock.since_boot();
        let observations = match poll_once(&*tools, &p, &ctx.metrics).await {
            Err(NotInstalled(tool)) => {
                let reported = absent_wait.is_some();
                absent_wait =
                    Some(absent_wait.map_or(p.poll_interval, |w| (w * 2).min(ABSENT_RECHECK)));
                if reported {
                    Vec::new()
                } else {
                    info!(tool = %tool, "npu-smi not found (--npu-smi); the Ascend source is idle");
                    [DETECTOR_NPU_SMI, DETECTOR_HCCN]
                        .into_iter()
                        .map(|name| {
                            let why = format!("{tool} not found");
                            super::detector(name, DetectorState::Idle, Some(why))
                        })
                        .collect()
                }
            }
            Ok(poll) => {
                if absent_wait.take().is_some() {
                    info!("npu-smi found; the Ascend source is running");
                }
                if let Err(why) = &poll.chips {
                    warn!(reason = %why, "npu-smi info failed");
                }
                analyzer.analyze(&poll, &p, clock.instant().into_std())
            }
        };
        debug!(
            took_ms = clock.since_boot().saturating_sub(started).as_millis() as u64,
            n = observations.len(),
            "ascend poll"
        );
        for o in observations {
            if ctx.tx.send(Input::Obs(o)).await.is_err() {
                return;
            }
        }
        let next = absent_wait.unwrap_or(p.poll_interval);
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tokio::time::sleep(next) => {}
            changed = policy.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::ascend::tools::{Tool, ToolError};
    use faultline_core::engine::Observation;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    /// Tools that are not installed, counting how often they were looked for.
    #[derive(Debug, Default)]
    struct Absent(AtomicUsize);

    impl Tools for Absent {
        async fn run(
            &self,
            tool: Tool,
            _args: &[String],
            _timeout: Duration,
        ) -> Result<String, ToolError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Err(ToolError::NotFound(format!("{tool:?}")))
        }
    }

    /// On a node without `npu-smi` the source looks for it after the poll interval (10 s), then
    /// twice as long each time up to [`ABSENT_RECHECK`] (not every 10 s: 91 times in 15
    /// minutes), reports the detector idle once, and looks at once when the policy changes.
    #[tokio::test(start_paused = true)]
    async fn a_node_without_npu_smi_is_looked_at_rarely() {
        let tools = Arc::new(Absent::default());
        let (policy_tx, policy) = watch::channel(LoadedPolicy::builtin());
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let shutdown = CancellationToken::new();
        let ctx = SourceContext {
            tx,
            metrics: Arc::new(Metrics::new()),
            clock: std::sync::Arc::new(crate::clock::SystemClock),
            shutdown: shutdown.clone(),
        };
        let task = tokio::spawn(run(tools.clone(), policy, ctx));
        tokio::time::sleep(Duration::from_secs(900) + Duration::from_millis(1)).await;
        // At 0, 10, 30, 70, 150, 310 (the wait is 5 minutes from here) and 610 s.
        assert_eq!(tools.0.load(Ordering::SeqCst), 7);
        let mut idle = 0;
        while let Ok(input) = rx.try_recv() {
            match input {
                Input::Obs(Observation::Detector { state, .. }) => {
                    assert_eq!(state, DetectorState::Idle);
                    idle += 1;
                }
                other => panic!("unexpected input {other:?}"),
            }
        }
        assert_eq!(idle, 2, "npu-smi and hccn_tool reported idle once");
        policy_tx.send_modify(|_| {});
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(
            tools.0.load(Ordering::SeqCst),
            8,
            "a policy change looks at once"
        );
        shutdown.cancel();
        task.await.unwrap();
    }
}
