//! The coordinator replicas' election: the Lease `faultline-peercheck` (kube-lease-manager:
//! acquire, renew, release on shutdown), held by the active replica under its name, address and
//! public key; [`LeaseFence`] fences runs with it.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use kube_lease_manager::{LeaseCreateMode, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::runs::{Fence, FenceError, NotHeld};
use faultline_agent::clock::Clock;
use faultline_agent::peer::lease::{GRACE_SECONDS, LEASE_SECONDS, NAME};

/// Runs the Lease election until shutdown as `identity` (the holder identity), with the field
/// manager `faultline-agent-<name>`; the receiver says whether this replica holds the Lease.
pub fn elect(
    client: Client,
    namespace: String,
    name: String,
    identity: String,
    shutdown: CancellationToken,
) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        loop {
            let built = LeaseManagerBuilder::new(client.clone(), NAME)
                .with_namespace(&namespace)
                .with_identity(&identity)
                .with_duration(LEASE_SECONDS)
                .with_grace(GRACE_SECONDS)
                .with_create_mode(LeaseCreateMode::AutoCreate)
                // One field manager per candidate: server-side apply then refuses a second
                // replica's claim on a held Lease as a conflict (the same manager would
                // overwrite). By the replica's name, not its identity: the API server refuses
                // a field manager of 128 characters or more, and the identity carries the key.
                .with_field_manager(format!(
                    "{}-{name}",
                    faultline_agent::kube_client::FIELD_MANAGER
                ))
                .build()
                .await;
            let manager = match built {
                Ok(m) => m,
                Err(e) => {
                    warn!(error = %e, "cannot start the coordinator election; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(5)) => continue,
                    }
                }
            };
            let (mut held, task) = manager.watch().await;
            loop {
                let now = *held.borrow_and_update();
                if *tx.borrow() != now {
                    info!(holder = now, "peer-check coordinator Lease");
                    tx.send_replace(now);
                }
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        tx.send_replace(false);
                        drop(held); // the manager releases the Lease when its receiver is gone
                        let _ = task.await;
                        return;
                    }
                    r = held.changed() => if r.is_err() { break },
                }
            }
            tx.send_replace(false);
            if let Ok(Err(e)) = task.await {
                warn!(error = %e, "coordinator election stopped; restarting it");
            }
        }
    });
    rx
}

/// The Kubernetes fence: the election's view, and before a run concludes, the Lease itself read
/// again from the API server. It must name this agent, and its last renewal plus its duration
/// must lie ahead: a coordinator frozen (SIGSTOP, a long pause) past its Lease may still see
/// `held` true for a moment after it wakes; the Lease on the server says otherwise.
#[derive(Clone)]
pub struct LeaseFence {
    pub held: watch::Receiver<bool>,
    pub client: Client,
    pub namespace: String,
    pub identity: String,
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for LeaseFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseFence")
            .field("namespace", &self.namespace)
            .field("identity", &self.identity)
            .finish()
    }
}

/// Whether a Lease names `identity` as a holder whose term has not run out at `now`.
pub fn held_by(
    lease: &Lease,
    identity: &str,
    now: faultline_core::time::Timestamp,
) -> Result<(), NotHeld> {
    let spec = lease.spec.as_ref().ok_or(NotHeld::NoSpec)?;
    let holder = spec.holder_identity.as_deref().unwrap_or("");
    if holder != identity {
        return Err(NotHeld::Other {
            holder: holder.to_string(),
            identity: identity.to_string(),
        });
    }
    let renewed = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .ok_or(NotHeld::NoRenewTime)?;
    let seconds = i64::from(spec.lease_duration_seconds.unwrap_or(0).max(0));
    let until = renewed.0 + faultline_core::time::SignedDuration::from_secs(seconds);
    // At least the renewal grace must be left: other candidates judge expiry by their own
    // clocks, and what follows the confirmation (publish, conclude) takes a moment.
    let margin = faultline_core::time::SignedDuration::from_secs(GRACE_SECONDS as i64);
    if until - margin <= now {
        return Err(NotHeld::RunsOut { until });
    }
    Ok(())
}

#[async_trait::async_trait]
impl Fence for LeaseFence {
    fn watch(&self) -> watch::Receiver<bool> {
        self.held.clone()
    }
    async fn confirm(&self) -> Result<(), FenceError> {
        if !*self.held.borrow() {
            return Err(FenceError::LeaseLost);
        }
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &self.namespace);
        let lease = api
            .get_opt(NAME)
            .await
            .map_err(FenceError::LeaseUnreadable)?
            .ok_or(FenceError::LeaseGone)?;
        Ok(held_by(&lease, &self.identity, self.clock.now())?)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    /// The fence's reading of a Lease: this agent's name and a term not yet over, both needed.
    #[test]
    fn a_lease_confirms_only_its_holder_within_its_term() {
        let t = |s: &str| s.parse::<faultline_core::time::Timestamp>().unwrap();
        let lease = |holder: &str, renewed: &str| Lease {
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                renew_time: Some(MicroTime(t(renewed))),
                lease_duration_seconds: Some(15),
                ..Default::default()
            }),
            ..Default::default()
        };
        let me = "n1@10.0.0.2:20261";
        let now = t("2026-11-24T12:00:09Z");
        assert_eq!(held_by(&lease(me, "2026-11-24T12:00:00Z"), me, now), Ok(()));
        let other = held_by(&lease("n4@10.0.0.5:20261", "2026-11-24T12:00:00Z"), me, now);
        assert!(other.unwrap_err().to_string().contains("held by \"n4@"));
        let expired = held_by(&lease(me, "2026-11-24T11:59:50Z"), me, now);
        assert!(expired.unwrap_err().to_string().contains("runs out"));
        // 4 s left: less than the renewal grace.
        let late = held_by(&lease(me, "2026-11-24T11:59:58Z"), me, now);
        assert!(late.unwrap_err().to_string().contains("less than 5 s"));
        assert!(held_by(&Lease::default(), me, now).is_err());
    }
}
