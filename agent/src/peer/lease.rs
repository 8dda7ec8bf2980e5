//! The Lease `faultline-peercheck` in the agents' namespace as the agents and `faultline check`
//! read it: its holder is the active coordinator replica, named `<name>@<address>#<public key>`
//! (`authz::holder_identity`). The coordinator holds it (`faultline_coordinator::lease`).

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
pub(crate) async fn holder(client: Client, namespace: &str) -> Result<Option<String>, kube::Error> {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    Ok(api
        .get_opt(NAME)
        .await?
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty()))
}

/// The current holder's identity and until when (Unix ms, with slack for clocks) its term
/// runs; `None` when nobody holds the Lease or its term is over (its holder stopped renewing
/// it: dead, or frozen and not to be obeyed when it wakes). A Lease without a renew time or a
/// duration has no term, and so no holder. For the agents (`authz::LeaseHolder`).
pub(crate) async fn live_holder(
    client: Client,
    namespace: &str,
) -> Result<Option<(String, i64)>, kube::Error> {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let Some(spec) = api.get_opt(NAME).await?.and_then(|l| l.spec) else {
        return Ok(None);
    };
    Ok(live(spec, super::wire::now_ms()))
}

/// [`live_holder`]'s reading of a Lease at `now_ms`.
fn live(spec: k8s_openapi::api::coordination::v1::LeaseSpec, now_ms: i64) -> Option<(String, i64)> {
    let (renewed, secs) = (spec.renew_time?, spec.lease_duration_seconds?);
    // Slack for the clocks of the holder, the API server and this node.
    let until = renewed
        .0
        .as_millisecond()
        .saturating_add(i64::from(secs.max(0)).saturating_mul(1000) + HOLDER_SLACK_MS);
    let holder = spec.holder_identity.filter(|h| !h.is_empty())?;
    (now_ms <= until).then_some((holder, until))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    /// A holder is live until its renewal plus its duration (and 5 s of slack); a Lease with no
    /// renewal or no duration has none.
    #[test]
    fn a_holder_is_live_for_its_term() {
        let renewed: faultline_core::time::Timestamp = "2026-11-24T12:00:00Z".parse().unwrap();
        let ms = renewed.as_millisecond();
        let spec = |renew: bool, secs: Option<i32>| LeaseSpec {
            holder_identity: Some("c0@10.0.0.1:20262#k".into()),
            renew_time: renew.then_some(MicroTime(renewed)),
            lease_duration_seconds: secs,
            ..Default::default()
        };
        let until = ms + 15_000 + HOLDER_SLACK_MS;
        assert_eq!(
            live(spec(true, Some(15)), ms + 1_000),
            Some(("c0@10.0.0.1:20262#k".into(), until))
        );
        assert!(live(spec(true, Some(15)), until).is_some());
        assert_eq!(live(spec(true, Some(15)), until + 1), None);
        assert_eq!(live(spec(false, Some(15)), ms), None);
        assert_eq!(live(spec(true, None), ms), None);
    }
}
