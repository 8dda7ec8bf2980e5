//! Who coordinates: in Kubernetes, the holder of the Lease `faultline-peercheck` in the agent's
//! namespace (kube-lease-manager: acquire, renew, release on shutdown); its holder identity is
//! `<node>@<peer address>`, which is how `faultline check` finds the coordinator. Without
//! Kubernetes, the first node of the members file, fixed.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use kube_lease_manager::{LeaseCreateMode, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::publish::NAME;

/// How long a Lease lasts without renewal: a dead coordinator is replaced after about this.
pub const LEASE_SECONDS: u64 = 15;
/// The holder renews this long before the Lease runs out (`kube_client::Purpose` derives the
/// Lease client's timeouts from it).
pub const GRACE_SECONDS: u64 = 5;

/// How long past its end a Lease still names its holder for the agents (clock differences).
const HOLDER_SLACK_MS: i64 = 5_000;

/// The holder identity for a node and its peer-service address.
pub fn identity(node: &str, address: &str) -> String {
    format!("{node}@{address}")
}

/// The coordinator's peer-service address from a holder identity.
pub fn address_of(identity: &str) -> Option<&str> {
    identity
        .rsplit_once('@')
        .map(|(_, a)| a)
        .filter(|a| !a.is_empty())
}

/// Runs the Lease election until shutdown; the receiver says whether this agent holds it.
pub fn elect(
    client: Client,
    namespace: String,
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
                // agent's claim on a held Lease as a conflict (the same manager would overwrite).
                .with_field_manager(format!("{}-{identity}", crate::kube_client::FIELD_MANAGER))
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

/// The current holder's identity (for `faultline check`).
pub async fn holder(client: Client, namespace: &str) -> Result<Option<String>, kube::Error> {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    Ok(api
        .get_opt(NAME)
        .await?
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty()))
}

/// The current holder's identity, `None` when nobody holds the Lease or it has run out (its
/// holder stopped renewing it: dead, or frozen and not to be obeyed when it wakes). A Lease
/// without a renew time or duration counts as held. For the agents (`authz::LeaseHolder`).
pub async fn live_holder(client: Client, namespace: &str) -> Result<Option<String>, kube::Error> {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let Some(spec) = api.get_opt(NAME).await?.and_then(|l| l.spec) else {
        return Ok(None);
    };
    let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
        (Some(renewed), Some(secs)) => {
            // Slack for the clocks of the holder, the API server and this node.
            let until = renewed
                .0
                .as_millisecond()
                .saturating_add(i64::from(secs.max(0)).saturating_mul(1000) + HOLDER_SLACK_MS);
            super::wire::now_ms() > until
        }
        _ => false,
    };
    Ok(spec.holder_identity.filter(|h| !h.is_empty() && !expired))
}
