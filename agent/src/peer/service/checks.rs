//! Running the checks the coordinator assigns to this agent: at most `MAX_CONCURRENT_CHECKS` at
//! once, each its probe as a child process (`peer::runner`) that a `Cancel` kills, then the
//! `CheckReport`, signed with this node's own credential (`wire::NodeCredential`), sent to the
//! coordinator address the assignment names, or through the member it names in `report_via`
//! (the coordinator cannot reach this agent and reached it through that member), tried again
//! while it cannot be delivered. Also whether the GPUs run work (a ping's answer: a scheduled
//! check waits for them to be idle), and the runs in which this node's own probe could not
//! start (a conclusion that finds this node faulty names the cause). Each assigned check
//! counts once in `faultline_peer_checks_total`, by how it ended here.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use faultline_proto::v1::coordinator_client::CoordinatorClient;
use faultline_proto::v1::peer_check_client::PeerCheckClient;
use faultline_proto::v1::{forward_request as forward, ForwardRequest as Forward};
use faultline_proto::v1::{CheckAssignment, CheckReport};
use faultline_proto::{MAX_MESSAGE_BYTES, PROTOCOL};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn, Instrument};

use super::ProbeSetup;
use crate::metrics::{Metrics, PeerCheckLabel, PeerCheckResult};
use crate::peer::authz::Admitted;
use crate::peer::busy::Busy;
use crate::peer::client::{
    bearer, endpoint, timed, within, CallError, CALL_TIMEOUT, FORWARD_TIMEOUT,
};
use crate::peer::runner::{self, ProbeOutcome, ProbeSpec};
use crate::peer::wire::NodeCredential;
use crate::peer::{retried, MAX_CONCURRENT_CHECKS};

/// Runs whose own-probe failure an agent remembers (a conclusion comes right after its run).
const OWN_FAILURES_KEPT: usize = 8;
/// Attempts to deliver a check report, and the pause between them.
const REPORT_ATTEMPTS: u32 = 3;
const REPORT_RETRY_PAUSE: Duration = Duration::from_millis(300);
/// How long a ping waits for the busy check.
const BUSY_TIMEOUT: Duration = Duration::from_secs(1);

/// A check as one member sees it: run, round, partner.
pub(super) type CheckKey = (String, u32, String);

/// This member's part in the check `a`: the check's key, its rank in the probe, its partner;
/// `None` when `me` is not a member of it.
pub(super) fn check_key(a: &CheckAssignment, me: &str) -> Option<(CheckKey, usize, String)> {
    let (ma, mb) = (a.a.as_ref()?, a.b.as_ref()?);
    let (rank, partner) = if ma.node == me {
        (0, mb.node.clone())
    } else if mb.node == me {
        (1, ma.node.clone())
    } else {
        return None;
    };
    Some(((a.run_id.clone(), a.round, partner.clone()), rank, partner))
}

/// This node's failed checks in one run.
#[derive(Debug)]
struct OwnRun {
    run_id: String,
    /// Why its probe could not start, the first time.
    cannot_run: Option<String>,
    /// A check failed for another reason too (then the cause is not named).
    other_failures: bool,
}

/// How an assignment was taken.
pub(super) enum Taken {
    /// The check starts.
    New,
    /// The same assignment again: the coordinator retried a call whose answer it did not get.
    /// The check runs already.
    Repeated,
}

/// The checks assigned to this agent: those running, and what it remembers of those that ran.
#[derive(Debug)]
pub(super) struct Checks {
    node: String,
    /// This node's own credential, for its reports.
    credential: NodeCredential,
    probe: ProbeSetup,
    busy: Arc<dyn Busy>,
    /// The checks running now, each with what cancels it.
    pub(super) running: Mutex<HashMap<CheckKey, CancellationToken>>,
    /// Runs in which this node's own probe could not run, with the cause (the newest
    /// `OWN_FAILURES_KEPT`): a conclusion that finds this node faulty names it.
    own_failures: Mutex<VecDeque<OwnRun>>,
    metrics: Arc<Metrics>,
}

impl Checks {
    pub(super) fn new(
        node: String,
        credential: NodeCredential,
        probe: ProbeSetup,
        busy: Arc<dyn Busy>,
        metrics: Arc<Metrics>,
    ) -> Checks {
        Checks {
            node,
            credential,
            probe,
            busy,
            running: Mutex::new(HashMap::new()),
            own_failures: Mutex::new(VecDeque::new()),
            metrics,
        }
    }

    /// Why the GPUs count as busy now, if they do (never for CPU/TCP checks).
    pub(super) async fn busy(&self) -> Option<String> {
        if !self.probe.gpu {
            return None;
        }
        // NVML calls can hang: ask on a blocking thread, and a node that cannot answer in
        // time counts as busy (a scheduled check is not worth disturbing a job).
        let b = Arc::clone(&self.busy);
        let asked = tokio::task::spawn_blocking(move || b.busy());
        match tokio::time::timeout(BUSY_TIMEOUT, asked).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => Some("cannot tell (the check failed)".into()),
            Err(_) => Some(format!(
                "cannot tell (no answer from NVML within {BUSY_TIMEOUT:?})"
            )),
        }
    }

    /// Starts the admitted check `a`, this member's part in it `role` (`check_key`), probing
    /// `peers`; its report goes to the coordinator `coordinator_node` (the sender of the
    /// assignment), signed for its name. `Err` with the reason when `MAX_CONCURRENT_CHECKS`
    /// run already.
    pub(super) fn start(
        self: &Arc<Self>,
        a: CheckAssignment,
        role: (CheckKey, usize, String),
        admitted: Admitted,
        peers: Vec<SocketAddr>,
        coordinator_node: String,
    ) -> Result<Taken, String> {
        let (key, rank, partner) = role;
        let cancel = CancellationToken::new();
        {
            let mut running = self.running.lock();
            if running.len() >= MAX_CONCURRENT_CHECKS {
                return Err(format!("{} checks already running", running.len()));
            }
            if running.contains_key(&key) {
                return Ok(Taken::Repeated);
            }
            running.insert(key.clone(), cancel.clone());
        }
        debug!(run_id = %a.run_id, round = a.round, partner = %partner, rank, from = %coordinator_node, "check assigned");
        let me = Arc::clone(self);
        let span = tracing::info_span!("peer_check", run_id = %a.run_id, round = a.round, partner = %partner);
        tokio::spawn(
            async move {
                let report = me
                    .run_check(&a, admitted, rank, &partner, peers, cancel)
                    .await;
                me.running.lock().remove(&key);
                if let Some(report) = report {
                    match &a.report_via {
                        Some(via) => me.send_report_via(via, &coordinator_node, report).await,
                        None => {
                            me.send_report(&a.coordinator, &coordinator_node, report)
                                .await
                        }
                    }
                }
            }
            .instrument(span),
        );
        Ok(Taken::New)
    }

    /// Cancels the running check the cancellation `a` names; whether one ran.
    pub(super) fn cancel(&self, a: &CheckAssignment) -> bool {
        check_key(a, &self.node)
            .and_then(|(key, _, _)| self.running.lock().get(&key).cloned())
            .inspect(CancellationToken::cancel)
            .is_some()
    }

    /// Why this node's own probe could not start in `run_id`: named only when every failure of
    /// this node in the run was its probe not starting.
    pub(super) fn cannot_run(&self, run_id: &str) -> Option<String> {
        self.own_failures
            .lock()
            .iter()
            .find(|r| r.run_id == run_id && !r.other_failures)
            .and_then(|r| r.cannot_run.clone())
    }

    /// `faultline_peer_checks_total`: one check this agent was assigned, by how it ended here.
    pub(super) fn count(&self, result: PeerCheckResult) {
        self.metrics
            .peer_checks
            .get_or_create(&PeerCheckLabel { result })
            .inc();
    }

    async fn run_check(
        &self,
        a: &CheckAssignment,
        admitted: Admitted,
        rank: usize,
        partner: &str,
        peers: Vec<SocketAddr>,
        cancel: CancellationToken,
    ) -> Option<CheckReport> {
        let spec = ProbeSpec {
            probe: self.probe.bin.clone(),
            peers,
            rank,
            bytes: admitted.bytes,
            iterations: admitted.iterations,
            timeout: admitted.timeout,
            grace: runner::PROBE_GRACE,
            gpu: self.probe.gpu,
        };
        let outcome = tokio::select! {
            o = runner::run_probe(&spec) => o,
            _ = cancel.cancelled() => {
                debug!("check cancelled by the coordinator");
                self.count(PeerCheckResult::cancelled);
                return None; // the probe child is killed as its future is dropped
            }
        };
        self.count(match &outcome {
            ProbeOutcome::Passed(_) => PeerCheckResult::passed,
            ProbeOutcome::Failed(_) => PeerCheckResult::failed,
            ProbeOutcome::TimedOut(_) => PeerCheckResult::timeout,
            ProbeOutcome::CannotRun(_) => PeerCheckResult::cannot_run,
        });
        // Not passed unless the probe passed.
        let mut report = CheckReport {
            auth: None,
            protocol: PROTOCOL,
            run_id: a.run_id.clone(),
            round: a.round,
            node: self.node.clone(),
            partner: partner.to_string(),
            ..Default::default()
        };
        match outcome {
            ProbeOutcome::Passed(r) => {
                report.passed = true;
                report.seconds = r.median_seconds;
                report.busbw_gbps = r.busbw_gbps;
                if a.gemm {
                    match runner::run_gemm(&self.probe.bin, self.probe.gpu, spec.timeout).await {
                        Ok(g) => report.gemm_gflops = g,
                        Err(e) => warn!(error = %e, "GEMM failed (not a verdict)"),
                    }
                }
            }
            ProbeOutcome::Failed(e) => {
                self.note_failure(&a.run_id, None);
                report.error = e;
            }
            ProbeOutcome::TimedOut(e) => {
                report.timed_out = true;
                report.error = e;
            }
            ProbeOutcome::CannotRun(e) => {
                warn!(error = %e, "the probe cannot run on this node");
                self.note_failure(&a.run_id, Some(&e));
                report.error = e;
            }
        }
        Some(report)
    }

    /// Remembers a failed check of this node in `run_id`: its probe could not start (`cause`),
    /// or it failed otherwise.
    fn note_failure(&self, run_id: &str, cause: Option<&str>) {
        let mut f = self.own_failures.lock();
        let i = f
            .iter()
            .position(|r| r.run_id == run_id)
            .unwrap_or_else(|| {
                if f.len() >= OWN_FAILURES_KEPT {
                    f.pop_front();
                }
                f.push_back(OwnRun {
                    run_id: run_id.to_string(),
                    cannot_run: None,
                    other_failures: false,
                });
                f.len() - 1
            });
        let r = &mut f[i];
        match cause {
            Some(c) => {
                r.cannot_run.get_or_insert_with(|| c.to_string());
            }
            None => r.other_failures = true,
        }
    }

    /// Sends the report, up to `REPORT_ATTEMPTS` times while the coordinator cannot be reached
    /// (a lost report leaves the check unjudged; the coordinator waits `REPORT_SLACK` past the
    /// deadline for it). A refusal is an answer and is not repeated. Each attempt is signed
    /// anew with this node's credential, for the coordinator `to` (the sender of the
    /// assignment): the coordinator refuses a nonce it has seen, every agent a report.
    async fn send_report(&self, coordinator: &str, to: &str, report: CheckReport) {
        let attempt = || {
            let signed = self.credential.sign(report.clone(), &self.node, to);
            async move {
                let signed = signed.map_err(|e| (false, CallError::from(e)))?;
                let ch = endpoint(coordinator)
                    .map_err(|e| (false, e))?
                    .connect()
                    .await
                    .map_err(|e| (true, CallError::Transport(e)))?;
                let mut c = CoordinatorClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
                let mut request = timed(signed.msg, CALL_TIMEOUT);
                if let Some(t) = &signed.token {
                    bearer(&mut request, t).map_err(|e| (false, e))?;
                }
                match tokio::time::timeout(CALL_TIMEOUT, c.report(request)).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(s)) => Err((
                        matches!(
                            s.code(),
                            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                        ),
                        CallError::Answer(s),
                    )),
                    Err(_) => Err((true, CallError::Timeout(CALL_TIMEOUT))),
                }
            }
        };
        // The error says whether it may pass (the coordinator unreachable) or is an answer.
        let sent = retried(REPORT_ATTEMPTS, REPORT_RETRY_PAUSE, |e| e.0, attempt).await;
        if let Err((_, e)) = sent {
            warn!(coordinator, error = %e, "cannot send the check report");
        }
    }

    /// Sends the report through the member the assignment named (`report_via`), as
    /// `send_report` does directly: up to `REPORT_ATTEMPTS` times while it cannot be reached,
    /// each attempt signed anew.
    pub(super) async fn send_report_via(
        &self,
        via: &faultline_proto::v1::Member,
        to: &str,
        report: CheckReport,
    ) {
        let attempt = || {
            let signed = self.credential.sign(report.clone(), &self.node, to);
            async move {
                let signed = signed.map_err(|e| (false, CallError::from(e)))?;
                let envelope = Forward {
                    auth: None,
                    protocol: PROTOCOL,
                    to: None,
                    token: signed.token.unwrap_or_default(),
                    message: Some(forward::Message::Report(signed.msg)),
                };
                let ch = endpoint(&via.address)
                    .map_err(|e| (false, e))?
                    .connect_lazy();
                let mut c = PeerCheckClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES);
                within(FORWARD_TIMEOUT, |t| c.forward(timed(envelope, t)))
                    .await
                    .map(|_| ())
                    .map_err(|e| (true, e))
            }
        };
        let sent = retried(REPORT_ATTEMPTS, REPORT_RETRY_PAUSE, |e| e.0, attempt).await;
        if let Err((_, e)) = sent {
            warn!(via = %via.node, error = %e, "cannot send the check report through the relay");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::time::Duration;

    use faultline_proto::v1::peer_check_server::PeerCheck;
    use faultline_proto::v1::CheckAssignment;
    use tonic::Request;

    use super::super::test_fixtures::{assignment, coordinator, known, service_on};

    /// `faultline_peer_checks_total{result}`: every check this agent is assigned
    /// counts once, by how it ended here: its probe passed, failed, ran out of time or could not
    /// start, the coordinator cancelled it, or the agent refused the assignment. The members
    /// are on loopback, the probe is a script.
    #[tokio::test]
    async fn each_assigned_check_counts_by_its_result() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| -> PathBuf {
            let p = dir.path().join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p
        };
        let report = r#"{"world":2,"rank":1,"median_seconds":0.001,"busbw_gbps":1.0}"#;
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let count = |result: &str| -> u64 {
            let line = format!("faultline_peer_checks_total{{result=\"{result}\"}} ");
            metrics
                .encode()
                .lines()
                .find_map(|l| l.strip_prefix(line.as_str())?.parse().ok())
                .unwrap_or(0)
        };
        let on_loopback = |m: &mut CheckAssignment| {
            for a in [&mut m.probe_a, &mut m.probe_b, &mut m.coordinator] {
                *a = a.replace("10.0.0.", "127.0.0.");
            }
        };
        let c = coordinator();
        let service = |probe: PathBuf| {
            let (svc, inputs) = service_on("n1", Arc::new(known(&c)), probe, metrics.clone());
            std::mem::forget(inputs);
            svc
        };
        let cases = [
            (script("pass", &format!("echo '{report}'")), "passed"),
            (script("fail", "echo broken >&2; exit 1"), "failed"),
            (script("slow", "echo too slow >&2; exit 3"), "timeout"),
            (dir.path().join("missing"), "cannot_run"),
        ];
        for (i, (probe, result)) in cases.into_iter().enumerate() {
            let svc = service(probe);
            let mut a = assignment();
            on_loopback(&mut a);
            a.run_id = format!("r{i}");
            let r = svc.assign(Request::new(c.sign(a, "n1"))).await.unwrap();
            assert!(r.get_ref().accepted, "{result}: {r:?}");
            let counted = tokio::time::timeout(Duration::from_secs(20), async {
                while count(result) == 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await;
            assert!(
                counted.is_ok(),
                "{result} not counted: {}",
                metrics.encode()
            );
        }

        let svc = service(script("hang", "exec sleep 60"));
        let mut a = assignment();
        on_loopback(&mut a);
        let r = svc
            .assign(Request::new(c.sign(a.clone(), "n1")))
            .await
            .unwrap();
        assert!(r.get_ref().accepted, "{r:?}");
        let cancel = CheckAssignment {
            cancel: true,
            ..a.clone()
        };
        let r = svc
            .cancel(Request::new(c.sign(cancel, "n1")))
            .await
            .unwrap();
        assert!(r.get_ref().accepted, "{r:?}");
        let counted = tokio::time::timeout(Duration::from_secs(20), async {
            while count("cancelled") == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(counted.is_ok(), "cancelled not counted");

        a.probe_b = "127.0.0.2:9".into();
        let r = svc.assign(Request::new(c.sign(a, "n1"))).await.unwrap();
        assert!(!r.get_ref().accepted, "{r:?}");
        for result in [
            "passed",
            "failed",
            "timeout",
            "cannot_run",
            "cancelled",
            "refused",
        ] {
            assert_eq!(count(result), 1, "{result}: {}", metrics.encode());
        }
    }
}
