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
pub(crate) const HOLDER_SLACK_MS: i64 = 5_000;

/// What the Lease says about the coordinator, for `faultline check`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Coordinator {
    /// No Lease: no coordinator has run in the namespace (the first one to start creates it,
    /// and none deletes it: a coordinator that stops only clears its holder), or someone
    /// deleted it (`kubectl delete lease`; a coordinator creates it again only as it starts).
    NoLease,
    /// Nobody holds it: a coordinator released it when it stopped, and none has taken it since.
    Unheld,
    /// Its holder stopped renewing it: its term, and the slack for clocks, are over (the
    /// agents obey no such holder). The holder, and when it last renewed the Lease.
    Expired {
        holder: String,
        renewed: Option<faultline_core::time::Timestamp>,
    },
    /// The holder, within its term.
    Live(String),
}

/// The Lease's [`Coordinator`] now.
pub(crate) async fn coordinator(
    client: Client,
    namespace: &str,
) -> Result<Coordinator, kube::Error> {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let lease = api.get_opt(NAME).await?;
    Ok(coordinator_of(
        lease.map(|l| l.spec.unwrap_or_default()),
        super::wire::now_ms(),
    ))
}

/// [`coordinator`]'s reading of a Lease (`None`: there is none) at `now_ms`, by the agents'
/// rule ([`live_holder`]).
fn coordinator_of(
    spec: Option<k8s_openapi::api::coordination::v1::LeaseSpec>,
    now_ms: i64,
) -> Coordinator {
    let Some(spec) = spec else {
        return Coordinator::NoLease;
    };
    let Some(holder) = spec.holder_identity.clone().filter(|h| !h.is_empty()) else {
        return Coordinator::Unheld;
    };
    let renewed = spec.renew_time.as_ref().map(|t| t.0);
    match live(spec, now_ms) {
        Some((h, _)) => Coordinator::Live(h),
        None => Coordinator::Expired { holder, renewed },
    }
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

    /// `faultline check` reads the Lease by the agents' rule: no Lease, no holder, a holder
    /// past its term (and the slack), and a holder within it are told apart.
    #[test]
    fn the_lease_tells_check_whether_there_is_a_coordinator() {
        let renewed: faultline_core::time::Timestamp = "2026-11-24T12:00:00Z".parse().unwrap();
        let ms = renewed.as_millisecond();
        let held = |holder: Option<&str>| LeaseSpec {
            holder_identity: holder.map(String::from),
            renew_time: Some(MicroTime(renewed)),
            lease_duration_seconds: Some(15),
            ..Default::default()
        };
        let id = "c0@10.0.0.1:20262#k";
        assert_eq!(coordinator_of(None, ms), Coordinator::NoLease);
        assert_eq!(coordinator_of(Some(held(None)), ms), Coordinator::Unheld);
        assert_eq!(
            coordinator_of(Some(held(Some(""))), ms),
            Coordinator::Unheld
        );
        let until = ms + 15_000 + HOLDER_SLACK_MS;
        assert_eq!(
            coordinator_of(Some(held(Some(id))), until),
            Coordinator::Live(id.into())
        );
        assert_eq!(
            coordinator_of(Some(held(Some(id))), until + 1),
            Coordinator::Expired {
                holder: id.into(),
                renewed: Some(renewed)
            }
        );
        let no_term = LeaseSpec {
            renew_time: None,
            ..held(Some(id))
        };
        assert_eq!(
            coordinator_of(Some(no_term), ms),
            Coordinator::Expired {
                holder: id.into(),
                renewed: None
            }
        );
    }

    /// `faultline check` judges the Lease on its own clock against the holder's renewTime (the
    /// holder's clock). A live holder renews every term less the grace (10 s), so the Lease
    /// it reads is at most that old. A reader's clock behind reads a live holder as live however
    /// far behind it is; one ahead reads it as live up to the term and the slack less the
    /// Lease's age: always up to 10 s ahead, never more than 20 s ahead (docs/peer-checks.md,
    /// "When no check can run").
    #[test]
    fn a_readers_clock_far_ahead_reads_a_live_holder_as_expired() {
        let renewed: faultline_core::time::Timestamp = "2026-11-24T12:00:00Z".parse().unwrap();
        let ms = renewed.as_millisecond();
        let id = "c0@10.0.0.1:20262#k";
        let spec = || LeaseSpec {
            holder_identity: Some(id.into()),
            renew_time: Some(MicroTime(renewed)),
            lease_duration_seconds: Some(LEASE_SECONDS as i32),
            ..Default::default()
        };
        let live = Coordinator::Live(id.into());
        let renew_every = (LEASE_SECONDS - GRACE_SECONDS) as i64 * 1000;
        // Read just after the renewal, and just before the next one.
        for age in [0, renew_every] {
            let true_now = ms + age;
            for behind in [1_000, 60_000, 3_600_000] {
                assert_eq!(coordinator_of(Some(spec()), true_now - behind), live);
            }
            let most_ahead = LEASE_SECONDS as i64 * 1000 + HOLDER_SLACK_MS - age;
            assert_eq!(coordinator_of(Some(spec()), true_now + most_ahead), live);
            assert!(matches!(
                coordinator_of(Some(spec()), true_now + most_ahead + 1),
                Coordinator::Expired { .. }
            ));
        }
        assert_eq!(
            LEASE_SECONDS as i64 * 1000 + HOLDER_SLACK_MS - renew_every,
            10_000
        );
        assert_eq!(LEASE_SECONDS as i64 * 1000 + HOLDER_SLACK_MS, 20_000);
    }
}
