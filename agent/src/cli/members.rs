//! `faultline hosts --members FILE`: the host list without Kubernetes (bare metal, Slurm). The
//! nodes are the peer checks' members file (`node ip:port [topology]`); each member's agent is
//! asked for its record at `http://<ip>:<agent-port>/v1/record` (the agents must listen there:
//! `--listen <ip>:20260`, since by default they answer on loopback only). A member is usable
//! when its agent answers in time with a record of that node, alive (a fresh heartbeat) and
//! accepted. Each answer is untrusted: bounded in time and size, and checked to name the node.

use std::net::SocketAddr;
use std::time::Duration;

use faultline_core::record::NodeRecord;
use faultline_core::time::Timestamp;
use futures::StreamExt;
use http_body_util::BodyExt;

use super::{not_alive, Accept, Hosts, Now, Outcome};
use crate::clock::{Clock, SystemClock};
use crate::peer::members::{parse_members, Member};

/// The most of one agent's answer read: above the largest record the policy's caps allow (about
/// 6 MB; about 2.2 MB at the default caps, docs/operations.md "Limits"), so no record an agent
/// serves is refused as too large.
pub const MAX_ANSWER_BYTES: usize = 8 << 20;
/// Agents asked at once.
const CONCURRENCY: usize = 64;

/// What asking one member's agent gave.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Answer {
    Record(Box<NodeRecord>),
    /// Why there is no usable record (unreachable, refused, too slow, not a record).
    Failed(String),
}

/// Asks `addr` for `/v1/record` within `timeout`, reading at most [`MAX_ANSWER_BYTES`].
pub(crate) async fn fetch_record(addr: SocketAddr, timeout: Duration) -> Answer {
    match tokio::time::timeout(timeout, fetch(addr)).await {
        Ok(Ok(r)) => Answer::Record(Box::new(r)),
        Ok(Err(why)) => Answer::Failed(format!("its agent at {addr}: {why}")),
        Err(_) => Answer::Failed(format!(
            "its agent at {addr} did not answer within {}",
            humantime::format_duration(timeout)
        )),
    }
}

/// The record of the agent at `addr`; the error reads after "its agent at ADDR: ".
async fn fetch(addr: SocketAddr) -> anyhow::Result<NodeRecord> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    let driver = tokio::spawn(conn);
    let req = http::Request::get("/v1/record")
        .header(http::header::HOST, addr.to_string())
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the answer: {e}"))?
        .to_bytes();
    driver.abort();
    if !status.is_success() {
        anyhow::bail!("answered {status}");
    }
    serde_json::from_slice::<NodeRecord>(&body).map_err(|e| anyhow::anyhow!("not a record: {e}"))
}

/// The usable members with `slots` each, in the file's order, and the others with why.
pub(crate) fn usable_members(
    members: &[(Member, Answer)],
    slots: u32,
    accept: Accept,
    now: Timestamp,
    stale_after: Duration,
) -> Hosts {
    let mut usable = Vec::new();
    let mut left_out = Vec::new();
    for (m, answer) in members {
        let why = match answer {
            Answer::Failed(why) => Some(why.clone()),
            Answer::Record(r) if r.node != m.node => Some(format!(
                "its agent answers for node {:?}, not {:?}",
                r.node, m.node
            )),
            Answer::Record(r) => not_alive(r, &Now::remote(now, stale_after), stale_after)
                .or_else(|| accept.refusal(r)),
        };
        match why {
            Some(w) => left_out.push((m.node.clone(), w)),
            None => usable.push((m.node.clone(), slots)),
        }
    }
    (usable, left_out)
}

/// `faultline hosts --members FILE`.
pub async fn hosts(
    path: &std::path::Path,
    agent_port: u16,
    slots: u32,
    accept: Accept,
    stale_after: Duration,
    timeout: Duration,
) -> Outcome {
    let shown = path.display().to_string();
    let text = match tokio::fs::read_to_string(path).await {
        Ok(t) => t,
        Err(e) => return Outcome::error(format!("error: cannot read {shown}: {e}")),
    };
    let members = match parse_members(&shown, &text) {
        Ok(m) if m.is_empty() => {
            return Outcome::error(format!("error: {shown} lists no member"));
        }
        Ok(m) => m,
        Err(e) => return Outcome::error(format!("error: {e}")),
    };
    // Unordered, so that one slow member does not hold up the next ones; back in file order
    // after.
    let mut answers: Vec<(usize, Member, Answer)> =
        futures::stream::iter(members.into_iter().enumerate())
            .map(|(i, m)| async move {
                // The member's own address (an IPv6 scope id included), on the agents' port.
                let mut addr = m
                    .address
                    .parse::<SocketAddr>()
                    .unwrap_or_else(|_| SocketAddr::new(m.ip, agent_port));
                addr.set_port(agent_port);
                let a = fetch_record(addr, timeout).await;
                (i, m, a)
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
    answers.sort_by_key(|(i, _, _)| *i);
    let answers: Vec<(Member, Answer)> = answers.into_iter().map(|(_, m, a)| (m, a)).collect();
    // No agent answered at all: the agents do not listen there (their default is loopback
    // only) or --agent-port is wrong; that is a wrong setup, not "nothing usable".
    if !answers.iter().any(|(_, a)| matches!(a, Answer::Record(_))) {
        let first = answers
            .first()
            .map(|(m, a)| format!("{}: {a:?}", m.node))
            .unwrap_or_default();
        return Outcome::error(format!(
            "error: no member's agent answered on port {agent_port} (start the agents with --listen <ip>:{agent_port}); {first}"
        ));
    }
    let found = usable_members(&answers, slots, accept, SystemClock.now(), stale_after);
    super::cluster::hosts_outcome(&found, "node")
}
