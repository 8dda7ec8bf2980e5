//! Authorization of peer-check requests: who may tell this agent what to do, and within which
//! bounds.
//!
//! - [`WhoCoordinates`]: the coordinator now and its public key. `Ping`, `Assign`, `Cancel`,
//!   `Conclude` and `Forward` are accepted only when signed with that key, which no agent holds.
//!   On Kubernetes the Lease holder ([`LeaseHolder`]: the active coordinator replica writes its
//!   name, address and public key into the Lease's holder identity, `<name>@<ip:port>#<key>`;
//!   read on demand and cached for a moment); on bare metal the key the agent is configured
//!   with ([`fixed`]). A `watch::Receiver<Option<CoordinatorId>>` is one too.
//! - [`check_probes`]: the probe addresses of an assignment on this agent's probe ports.
//! - [`admit`]: an assignment's size, iterations and deadline against this agent's own policy.
//! - [`ForwardRate`], [`MAX_FORWARDED_BYTES`]: what this agent forwards as a relay (`Forward`),
//!   at a bounded rate and size.
//!
//! Requesters (`faultline check`) are the coordinator's to authorize
//! (`faultline_coordinator::requesters`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use faultline_core::policy::PeerPolicy;
use faultline_proto::auth::CoordinatorPublicKey;
use faultline_proto::v1::CheckAssignment;
use tokio::sync::{watch, Mutex};
use tokio::time::Instant;

use crate::clock::{Clock, SystemClock};

/// The coordinator as the agents know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CoordinatorId {
    /// Its name: the `sender` its signed requests carry (empty: any name; bare metal knows the
    /// coordinator by its key alone).
    pub(crate) node: String,
    /// Where its service listens (reports go there), when known.
    pub(crate) address: Option<String>,
    /// The public half of the key it signs with.
    pub(crate) key: CoordinatorPublicKey,
}

/// The Lease holder identity of a coordinator replica: `<name>@<ip:port>#<public key>`.
pub fn holder_identity(name: &str, address: &str, key: &CoordinatorPublicKey) -> String {
    format!("{name}@{address}#{key}")
}

impl CoordinatorId {
    /// From a Lease holder identity ([`holder_identity`]); `None` when it is not one.
    pub(crate) fn from_holder(identity: &str) -> Option<CoordinatorId> {
        let (rest, key) = identity.rsplit_once('#')?;
        let key = CoordinatorPublicKey::parse(key).ok()?;
        let (node, address) = rest.rsplit_once('@')?;
        (!node.is_empty() && !address.is_empty()).then(|| CoordinatorId {
            node: node.to_string(),
            address: Some(address.to_string()),
            key,
        })
    }
}

/// Bare metal: the coordinator known by its key alone.
pub(crate) fn fixed(key: CoordinatorPublicKey) -> watch::Receiver<Option<CoordinatorId>> {
    watch::channel(Some(CoordinatorId {
        node: String::new(),
        address: None,
        key,
    }))
    .1
}

/// Why the coordinator cannot be told: the Lease could not be read (shared: a cached answer
/// repeats the last read's error).
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot tell who coordinates peer checks: reading the Lease: {0}")]
pub(crate) struct WhoError(#[source] pub Arc<kube::Error>);

/// Who coordinates now: what the service reads before it obeys `Assign`, `Cancel`, `Conclude`.
#[async_trait::async_trait]
pub(crate) trait WhoCoordinates: Send + Sync + std::fmt::Debug {
    /// The coordinator now (`None`: nobody). `recheck`: the caller has a request from someone
    /// else than the last answer; a cached answer is read again if it is not brand new.
    async fn current(&self, recheck: bool) -> Result<Option<CoordinatorId>, WhoError>;
}

#[async_trait::async_trait]
impl WhoCoordinates for watch::Receiver<Option<CoordinatorId>> {
    async fn current(&self, _recheck: bool) -> Result<Option<CoordinatorId>, WhoError> {
        Ok(self.borrow().clone())
    }
}

/// How long an answer read from the Lease or the members file is used.
pub(crate) const WHO_TTL: Duration = Duration::from_secs(5);
/// A recheck reads the source again only if the answer is older than this (a flood of requests
/// from a non-coordinator costs at most one read per this interval).
pub(crate) const RECHECK_AFTER: Duration = Duration::from_millis(500);

/// One source read, cached; on a failed read the last good answer stands (an API server
/// outage must not fail every check), but only for the term the holder had then: a holder that
/// lost the Lease is not obeyed past it, however long the reads fail. With no answer yet the
/// error is returned.
#[derive(Debug, Default)]
struct Cache {
    /// When the source was last read; `None` until a read answers (a failed read before then
    /// leaves nothing to fall back on, so it is not cached).
    at: Option<Instant>,
    /// The holder and the end of its term (Unix ms).
    value: Option<(CoordinatorId, i64)>,
    /// Why the last read failed (`None`: it answered).
    failed: Option<WhoError>,
}

impl Cache {
    fn fresh(&self, recheck: bool, now: Instant) -> bool {
        let age = match self.at {
            Some(at) => now.saturating_duration_since(at),
            None => return false,
        };
        age < if recheck { RECHECK_AFTER } else { WHO_TTL }
    }

    /// The holder within its term; past it, while the reads fail, their error: "nobody holds
    /// the Lease" is said only when the Lease was read and said so (a node that cannot read it
    /// says why, and is still refused).
    fn answer(&self, now_ms: i64) -> Result<Option<CoordinatorId>, WhoError> {
        match (self.holder(now_ms), &self.failed) {
            (None, Some(e)) => Err(e.clone()),
            (h, _) => Ok(h),
        }
    }

    /// The holder known, if its term has not run out at `now_ms`.
    fn holder(&self, now_ms: i64) -> Option<CoordinatorId> {
        self.value
            .as_ref()
            .filter(|(_, until)| now_ms <= *until)
            .map(|(id, _)| id.clone())
    }

    async fn get<F>(
        this: &Mutex<Cache>,
        recheck: bool,
        now_ms: impl Fn() -> i64,
        read: F,
    ) -> Result<Option<CoordinatorId>, WhoError>
    where
        F: std::future::Future<Output = Result<Option<(CoordinatorId, i64)>, WhoError>>,
    {
        let mut c = this.lock().await;
        let now = SystemClock.instant();
        if c.fresh(recheck, now) {
            return c.answer(now_ms());
        }
        match read.await {
            Ok(v) => {
                c.at = Some(now);
                c.value = v;
                c.failed = None;
                c.answer(now_ms())
            }
            Err(e) if c.at.is_some() => {
                c.at = Some(now);
                tracing::debug!(error = %e, "cannot read who coordinates; using the last answer within its term");
                c.failed = Some(e);
                c.answer(now_ms())
            }
            Err(e) => Err(e),
        }
    }
}

/// Kubernetes: the holder of the Lease `faultline-peercheck`, read on demand (every agent,
/// not only the holder, must know it). An expired Lease has no holder.
pub(crate) struct LeaseHolder {
    pub(crate) client: kube::Client,
    pub(crate) namespace: String,
    cache: Mutex<Cache>,
}

impl LeaseHolder {
    pub(crate) fn new(client: kube::Client, namespace: String) -> LeaseHolder {
        LeaseHolder {
            client,
            namespace,
            cache: Mutex::new(Cache::default()),
        }
    }
}

impl std::fmt::Debug for LeaseHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseHolder")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl WhoCoordinates for LeaseHolder {
    async fn current(&self, recheck: bool) -> Result<Option<CoordinatorId>, WhoError> {
        let read = async {
            super::lease::live_holder(self.client.clone(), &self.namespace)
                .await
                .map(|h| h.and_then(|(h, until)| Some((CoordinatorId::from_holder(&h)?, until))))
                .map_err(|e| WhoError(Arc::new(e)))
        };
        Cache::get(&self.cache, recheck, super::wire::now_ms, read).await
    }
}

/// Why an assignment is refused (its text is the refusal's reason on the wire).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{name} {probe:?} is not ip:port")]
    ProbeAddress { name: &'static str, probe: String },
    #[error("{name} {probe}: port not among the probe ports {}..{}", ports.start, ports.end)]
    ProbePort {
        name: &'static str,
        probe: String,
        ports: std::ops::Range<u16>,
    },
    #[error("bytes, iterations and timeout must be set")]
    Unset,
    #[error("bytes {bytes} over this agent's limit {max} ({POLICY_SLACK}x its policy's peer.bytes {policy}, at most {MAX_BYTES})")]
    Bytes { bytes: u64, max: u64, policy: u64 },
    #[error("iterations {iterations} over this agent's limit {max} ({POLICY_SLACK}x its policy's peer.iterations {policy}, at most {MAX_ITERATIONS})")]
    Iterations {
        iterations: u32,
        max: u32,
        policy: u32,
    },
}

/// Checks that an assignment's probe addresses are `ip:port` on this agent's probe ports
/// (`probe_ports`): the probe binds one and connects to the other.
pub(crate) fn check_probes(
    a: &CheckAssignment,
    probe_ports: std::ops::Range<u16>,
) -> Result<Vec<SocketAddr>, Refusal> {
    [("probe_a", &a.probe_a), ("probe_b", &a.probe_b)]
        .into_iter()
        .map(|(name, probe)| {
            let sa: SocketAddr = probe.parse().map_err(|_| Refusal::ProbeAddress {
                name,
                probe: probe.clone(),
            })?;
            if !probe_ports.contains(&sa.port()) {
                return Err(Refusal::ProbePort {
                    name,
                    probe: probe.clone(),
                    ports: probe_ports.clone(),
                });
            }
            Ok(sa)
        })
        .collect()
}

/// The largest assignment, cancel or report a relay forwards (a real one is under 6 KiB: names,
/// addresses and a report's error of at most 4 KiB); a conclusion may be as large as any
/// message (`MAX_MESSAGE_BYTES`: it lists the run's members).
pub(crate) const MAX_FORWARDED_BYTES: usize = 16 * 1024;
/// Forwards a relay makes per second, on average and in a burst: a member the coordinator
/// reaches through it takes at most two checks a round (two assignments, two cancels, two
/// reports), so this covers dozens of such members at once and bounds what a key holder can
/// make a relay send.
pub(crate) const FORWARD_RATE: f64 = 64.0;
pub(crate) const FORWARD_BURST: f64 = 256.0;

/// A token bucket for forwards: [`FORWARD_BURST`] at once, refilled at [`FORWARD_RATE`] per
/// second.
#[derive(Debug)]
pub(crate) struct ForwardRate {
    tokens: f64,
    at: Option<Instant>,
}

impl Default for ForwardRate {
    fn default() -> ForwardRate {
        ForwardRate {
            tokens: FORWARD_BURST,
            at: None,
        }
    }
}

impl ForwardRate {
    /// Takes one forward at `now`: false when the rate is spent.
    pub(crate) fn take(&mut self, now: Instant) -> bool {
        if let Some(at) = self.at {
            let refill = now.saturating_duration_since(at).as_secs_f64() * FORWARD_RATE;
            self.tokens = (self.tokens + refill).min(FORWARD_BURST);
        }
        self.at = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// An assignment's sizes within this agent's bounds: bytes and iterations as asked (they must
/// match the partner's), the deadline as announced up to this agent's ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    pub bytes: u64,
    pub iterations: u32,
    pub timeout: Duration,
}

/// How far above this agent's policy an assignment's bytes and iterations may be: the policy
/// ConfigMap reaches agents at different moments, and a run must not fail everywhere while a
/// larger size rolls out.
pub(crate) const POLICY_SLACK: u64 = 4;
/// Never more than this per check, whatever the policy says.
pub(crate) const MAX_BYTES: u64 = 1 << 30;
pub(crate) const MAX_ITERATIONS: u32 = 1000;

/// Admits an assignment under `policy`: bytes and iterations over `POLICY_SLACK` times the
/// policy's (or over `MAX_BYTES` / `MAX_ITERATIONS`) are refused with the reason; both sides of
/// a check must run the same transfer, so they are never silently changed. The deadline is the
/// announced one (a round after a timeout announces a longer one than `check_timeout`, and the
/// probe must get it, or the retry times out as the first try did), clamped to the policy's
/// `check_timeout_ceiling` (a shorter probe deadline is always safe: the coordinator waits for
/// its own).
pub fn admit(a: &CheckAssignment, policy: &PeerPolicy) -> Result<Admitted, Refusal> {
    if a.timeout_ms == 0 || a.iterations == 0 || a.bytes == 0 {
        return Err(Refusal::Unset);
    }
    let max_bytes = policy
        .bytes
        .max(1)
        .saturating_mul(POLICY_SLACK)
        .min(MAX_BYTES);
    if a.bytes > max_bytes {
        return Err(Refusal::Bytes {
            bytes: a.bytes,
            max: max_bytes,
            policy: policy.bytes,
        });
    }
    let max_iterations = u64::from(policy.iterations.max(1))
        .saturating_mul(POLICY_SLACK)
        .min(u64::from(MAX_ITERATIONS)) as u32;
    if a.iterations > max_iterations {
        return Err(Refusal::Iterations {
            iterations: a.iterations,
            max: max_iterations,
            policy: policy.iterations,
        });
    }
    Ok(Admitted {
        bytes: a.bytes,
        iterations: a.iterations,
        timeout: Duration::from_millis(u64::from(a.timeout_ms)).min(policy.check_timeout_ceiling()),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;
    use faultline_proto::v1::Member as WireMember;

    fn assignment() -> CheckAssignment {
        let w = |n: &str, a: &str| WireMember {
            node: n.into(),
            address: a.into(),
            topology: String::new(),
        };
        CheckAssignment {
            a: Some(w("n0", "10.0.0.1:20261")),
            b: Some(w("n1", "10.0.0.2:20261")),
            probe_a: "10.0.0.1:20270".into(),
            probe_b: "10.0.0.2:20271".into(),
            coordinator: "10.0.0.3:20261".into(),
            bytes: 64 << 20,
            iterations: 5,
            timeout_ms: 10_000,
            ..Default::default()
        }
    }

    type Edit = fn(&mut CheckAssignment);

    /// Probe addresses must be `ip:port` on the probe ports: anything else is refused with the
    /// reason (the probe binds one and connects to the other).
    #[test]
    fn probe_addresses_are_on_the_probe_ports() {
        let ports = 20270..20302;
        assert_eq!(
            check_probes(&assignment(), ports.clone()),
            Ok(vec![
                "10.0.0.1:20270".parse().unwrap(),
                "10.0.0.2:20271".parse().unwrap()
            ])
        );
        let cases: Vec<(Edit, &str)> = vec![
            (
                |a| a.probe_a = "10.0.0.1:10250".into(),
                "probe_a 10.0.0.1:10250: port not among the probe ports",
            ),
            (
                |a| a.probe_b = "10.0.0.2:20302".into(),
                "probe_b 10.0.0.2:20302: port not among",
            ),
            (|a| a.probe_a = "nowhere".into(), "not ip:port"),
            (|a| a.probe_b = String::new(), "probe_b \"\" is not ip:port"),
        ];
        for (edit, why) in cases {
            let mut a = assignment();
            edit(&mut a);
            let e = check_probes(&a, ports.clone()).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
    }

    /// 4 GiB, unbounded iterations and a 49-day timeout: the first two refused, the deadline
    /// clamped to the policy's.
    #[test]
    fn sizes_and_deadlines_are_bounded_by_the_agents_own_policy() {
        let p = PeerPolicy::default();
        let ok = admit(&assignment(), &p).unwrap();
        assert_eq!(ok.bytes, 64 << 20);
        let mut a = assignment();
        a.bytes = 4 << 30;
        let e = admit(&a, &p).unwrap_err().to_string();
        assert!(
            e.contains("bytes 4294967296 over this agent's limit"),
            "{e}"
        );
        let mut a = assignment();
        a.bytes = p.bytes * POLICY_SLACK;
        assert!(admit(&a, &p).is_ok(), "the slack is allowed");
        a.bytes += 1;
        assert!(admit(&a, &p).is_err());
        let mut a = assignment();
        a.iterations = u32::MAX;
        let e = admit(&a, &p).unwrap_err().to_string();
        assert!(e.contains("iterations 4294967295 over"), "{e}");
        let mut a = assignment();
        a.timeout_ms = u32::MAX; // 49.7 days
        assert_eq!(admit(&a, &p).unwrap().timeout, p.check_timeout_ceiling());
        for zero in [
            |a: &mut CheckAssignment| a.bytes = 0,
            |a: &mut CheckAssignment| a.iterations = 0,
            |a: &mut CheckAssignment| a.timeout_ms = 0,
        ] {
            let mut a = assignment();
            zero(&mut a);
            assert!(admit(&a, &p)
                .unwrap_err()
                .to_string()
                .contains("must be set"));
        }
        // A policy asking for more than the hard cap still gets the cap.
        let big = PeerPolicy {
            bytes: 8 << 30,
            ..PeerPolicy::default()
        };
        let mut a = assignment();
        a.bytes = MAX_BYTES + 1;
        assert!(admit(&a, &big).is_err());
    }

    /// Rounds 2 and 3 announce 20 s and 40 s for checks that timed out under load; each agent
    /// clamped them to its 10 s `check_timeout`, so the probes stopped at 10 s again. The
    /// announced deadline is now the probe's, up to the agent's ceiling.
    #[test]
    fn an_announced_deadline_is_the_probes_up_to_the_ceiling() {
        let p = PeerPolicy::default();
        assert_eq!(p.check_timeout, Duration::from_secs(10));
        let with = |ms: u32, p: &PeerPolicy| {
            let mut a = assignment();
            a.timeout_ms = ms;
            admit(&a, p).unwrap().timeout
        };
        assert_eq!(with(20_000, &p), Duration::from_secs(20));
        assert_eq!(with(40_000, &p), Duration::from_secs(40));
        assert_eq!(
            with(3_000, &p),
            Duration::from_secs(3),
            "shorter: as announced"
        );
        // Above the ceiling (by default 4x check_timeout): clamped to it.
        assert_eq!(with(41_000, &p), Duration::from_secs(40));
        let low = PeerPolicy {
            max_check_timeout: Some(Duration::from_secs(15)),
            ..PeerPolicy::default()
        };
        assert_eq!(with(20_000, &low), Duration::from_secs(15));
        assert_eq!(with(12_000, &low), Duration::from_secs(12));
    }

    /// The forward rate: a burst of `FORWARD_BURST`, then `FORWARD_RATE` per second.
    #[tokio::test(start_paused = true)]
    async fn forwards_are_rate_limited() {
        let mut r = ForwardRate::default();
        let t0 = Instant::now();
        let burst = (0..1000).take_while(|_| r.take(t0)).count();
        assert_eq!(burst, FORWARD_BURST as usize);
        assert!(!r.take(t0));
        let later = t0 + Duration::from_millis(500);
        let refilled = (0..1000).take_while(|_| r.take(later)).count();
        assert_eq!(refilled, (FORWARD_RATE / 2.0) as usize);
    }

    /// While the Lease cannot be read, the last holder stays obeyed only for the term it had
    /// when it was read: a replica that lost the Lease, frozen and woken during an API outage,
    /// is not obeyed for as long as the reads fail.
    #[tokio::test(start_paused = true)]
    async fn a_cached_holder_is_obeyed_only_for_its_term() {
        let key = faultline_proto::auth::CoordinatorKey::generate()
            .unwrap()
            .public_key();
        let id = CoordinatorId {
            node: "c0".into(),
            address: None,
            key,
        };
        let cache = Mutex::new(Cache::default());
        let now = std::sync::atomic::AtomicI64::new(1_000);
        let clock = || now.load(std::sync::atomic::Ordering::Relaxed);
        let read_ok = |v: Option<(CoordinatorId, i64)>| async move { Ok(v) };
        let read_fails = || async {
            let down = kube::Error::Service(Box::new(std::io::Error::other("API down")));
            Err::<Option<(CoordinatorId, i64)>, _>(WhoError(Arc::new(down)))
        };
        let got = Cache::get(&cache, false, clock, read_ok(Some((id.clone(), 20_000)))).await;
        assert_eq!(got.unwrap(), Some(id.clone()));
        // The reads fail from now on: within the term the holder stands...
        tokio::time::advance(WHO_TTL * 2).await;
        now.store(19_000, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            Cache::get(&cache, false, clock, read_fails())
                .await
                .unwrap(),
            Some(id.clone())
        );
        // ... and past it nobody is obeyed, however recently the cache was refreshed; the
        // answer is the read's error (not "nobody holds the Lease", which the fleet bench saw
        // agents report while the coordinator held it and their reads failed).
        now.store(20_001, std::sync::atomic::Ordering::Relaxed);
        let e = Cache::get(&cache, false, clock, read_fails())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("API down"), "{e}");
        tokio::time::advance(WHO_TTL * 2).await;
        let e = Cache::get(&cache, false, clock, read_fails())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("API down"), "{e}");
        // A read that answers again, naming nobody: nobody.
        tokio::time::advance(WHO_TTL * 2).await;
        assert_eq!(
            Cache::get(&cache, false, clock, read_ok(None))
                .await
                .unwrap(),
            None
        );
    }

    /// The Lease names the active replica as `<name>@<address>#<public key>`; anything else
    /// names no coordinator (a holder without a key is obeyed by nobody).
    #[test]
    fn holder_identities() {
        let key = faultline_proto::auth::CoordinatorKey::generate()
            .unwrap()
            .public_key();
        let id = holder_identity("c-0", "10.0.0.1:20262", &key);
        assert_eq!(
            CoordinatorId::from_holder(&id),
            Some(CoordinatorId {
                node: "c-0".into(),
                address: Some("10.0.0.1:20262".into()),
                key,
            })
        );
        for bad in [
            "c-0@10.0.0.1:20262".to_string(),
            format!("c-0#{key}"),
            format!("@10.0.0.1:1#{key}"),
            format!("c-0@#{key}"),
            "c-0@10.0.0.1:20262#not-a-key".into(),
            String::new(),
        ] {
            assert_eq!(CoordinatorId::from_holder(&bad), None, "{bad}");
        }
    }
}
