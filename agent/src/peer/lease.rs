//! The Lease `faultline-peercheck` in the agents' namespace as the agents and `faultline check`
//! read it: its holder is the active coordinator replica, named `<name>@<address>#<public key>`
//! (`authz::holder_identity`). The coordinator holds it (`crate::coordinator::lease`).

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};

/// The Lease's name (also the published run's ConfigMap's).
pub const NAME: &str = "faultline-peercheck";
/// How long a Lease lasts without renewal: a dead coordinator is replaced after about this.
pub const LEASE_SECONDS: u64 = 15;
/// The holder renews this long before the Lease runs out (`kube_client::Purpose` derives the
/// Lease client's timeouts from it).
pub const GRACE_SECONDS: u64 = 5;

/// How long past its end a Lease still names its holder for the agents (clock differences).
const HOLDER_SLACK_MS: i64 = 5_000;

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
