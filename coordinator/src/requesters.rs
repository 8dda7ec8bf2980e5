//! Who may request a run (`faultline check`): on Kubernetes a projected service-account token
//! for the audience [`REQUESTER_AUDIENCE`], checked with TokenReview, whose user may `create`
//! `peerchecks.faultline.io` in the agents' namespace, checked with SubjectAccessReview
//! ([`KubeRequesters`]); or the requesters' secret (`service`).

/// The audience a requester's projected service-account token must be issued for: a token
/// for this audience is useless against the API server, so the coordinator that receives it
/// cannot use it as the requester.
pub const REQUESTER_AUDIENCE: &str = "faultline-peercheck";
/// What a requester must be allowed in the agents' namespace (RBAC; no such object exists,
/// the right is the point): `create` on `peerchecks` in API group `faultline.io`.
pub const REQUEST_GROUP: &str = "faultline.io";
pub const REQUEST_RESOURCE: &str = "peerchecks";
pub const REQUEST_VERB: &str = "create";

/// Why a token (a requester's, an agent's) was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenRefusal {
    /// Not a valid token for [`REQUESTER_AUDIENCE`] (`UNAUTHENTICATED`).
    #[error("the token is not valid: {0}")]
    Unauthenticated(String),
    /// A valid token of someone not allowed to request runs (`PERMISSION_DENIED`).
    #[error("{0}")]
    Denied(String),
    /// The reviews could not be made (`UNAVAILABLE`).
    #[error("cannot check the requester's token: {0}")]
    Unavailable(String),
}

/// Asks the API server whose `token` is (TokenReview for `audience`): its user, when it is
/// authenticated and the API server echoes the audience in `status.audiences`, as the API
/// reference asks a client to check. The caller's ClusterRole needs `create` on `tokenreviews`.
pub async fn token_review(
    client: &kube::Client,
    token: &str,
    audience: &str,
) -> Result<k8s_openapi::api::authentication::v1::UserInfo, TokenRefusal> {
    use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
    use kube::api::{Api, PostParams};
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_string()),
            audiences: Some(vec![audience.to_string()]),
        },
        ..Default::default()
    };
    let reviewed = Api::<TokenReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| TokenRefusal::Unavailable(format!("TokenReview: {e}")))?;
    let status = reviewed.status.unwrap_or_default();
    if status.authenticated != Some(true) {
        return Err(TokenRefusal::Unauthenticated(
            status
                .error
                .unwrap_or_else(|| "not authenticated".to_string()),
        ));
    }
    if !status.audiences.iter().flatten().any(|a| a == audience) {
        return Err(TokenRefusal::Unauthenticated(format!(
            "not a token for the audience {audience:?} (the API server did not confirm it)"
        )));
    }
    Ok(status.user.unwrap_or_default())
}

/// Checks a requester's bearer token: its name when it may request runs.
#[async_trait::async_trait]
pub trait Requesters: Send + Sync + std::fmt::Debug {
    async fn check(&self, token: &str) -> Result<String, TokenRefusal>;
}

/// Kubernetes: TokenReview (audience [`REQUESTER_AUDIENCE`]; `status.authenticated`, and the
/// audience echoed in `status.audiences`, as the API reference asks a client to check), then
/// SubjectAccessReview for that user's `create peerchecks.faultline.io` in `namespace`
/// (`status.allowed`). The agent's ClusterRole needs `create` on both reviews.
pub struct KubeRequesters {
    pub client: kube::Client,
    pub namespace: String,
}

impl std::fmt::Debug for KubeRequesters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeRequesters")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl Requesters for KubeRequesters {
    async fn check(&self, token: &str) -> Result<String, TokenRefusal> {
        use k8s_openapi::api::authorization::v1::{
            ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
        };
        use kube::api::{Api, PostParams};
        let user = token_review(&self.client, token, REQUESTER_AUDIENCE).await?;
        let username = user.username.clone().unwrap_or_default();
        if username.is_empty() {
            return Err(TokenRefusal::Unauthenticated("no user name".into()));
        }
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(username.clone()),
                groups: user.groups,
                extra: user.extra,
                uid: user.uid,
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(self.namespace.clone()),
                    verb: Some(REQUEST_VERB.into()),
                    group: Some(REQUEST_GROUP.into()),
                    resource: Some(REQUEST_RESOURCE.into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let decided = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &sar)
            .await
            .map_err(|e| TokenRefusal::Unavailable(format!("SubjectAccessReview: {e}")))?;
        if decided.status.is_some_and(|s| s.allowed) {
            Ok(username)
        } else {
            Err(TokenRefusal::Denied(format!(
                "{username} may not request peer checks (needs {REQUEST_VERB} on {REQUEST_RESOURCE}.{REQUEST_GROUP} in namespace {})",
                self.namespace
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// TokenReview and SubjectAccessReview against the API emulator: a token projected for
    /// the requester audience whose user may create peerchecks is accepted by name; one for
    /// another audience, an unknown one, and one without the right are refused, each with its
    /// kind of refusal; the agent without create on the reviews cannot check at all.
    #[tokio::test]
    async fn requester_tokens_are_reviewed_by_the_api_server() {
        use faultline_kube_emulator::{Emulator, Rule, UserInfo};
        let emu = Emulator::start().await.unwrap();
        let ns = "faultline-system";
        emu.authorize(
            "t",
            UserInfo::service_account(ns, "faultline"),
            vec![
                Rule::new(&["create"], &["authentication.k8s.io"], &["tokenreviews"]),
                Rule::new(
                    &["create"],
                    &["authorization.k8s.io"],
                    &["subjectaccessreviews"],
                ),
            ],
        );
        let may = vec![
            Rule::new(&[REQUEST_VERB], &[REQUEST_GROUP], &[REQUEST_RESOURCE]).in_namespace(ns),
        ];
        emu.authorize_for_audiences(
            "launcher-token",
            UserInfo::service_account("jobs", "launcher"),
            may.clone(),
            &[REQUESTER_AUDIENCE],
        );
        emu.authorize_for_audiences(
            "other-audience",
            UserInfo::service_account("jobs", "launcher"),
            may.clone(),
            &["vault"],
        );
        emu.authorize_for_audiences(
            "no-right",
            UserInfo::service_account("jobs", "intruder"),
            vec![],
            &[REQUESTER_AUDIENCE],
        );
        // The API server's own token of the launcher (its default service-account token).
        emu.authorize(
            "api-token",
            UserInfo::service_account("jobs", "launcher"),
            may,
        );
        let (client, _dir) = faultline_agent::sink::kube::emulator_client(&emu, "n1").await;
        let r = KubeRequesters {
            client,
            namespace: ns.into(),
        };
        assert_eq!(
            r.check("launcher-token").await,
            Ok("system:serviceaccount:jobs:launcher".to_string())
        );
        for bad in ["other-audience", "nope", "api-token"] {
            match r.check(bad).await {
                Err(TokenRefusal::Unauthenticated(why)) => {
                    assert!(why.contains("invalid"), "{bad}: {why}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        match r.check("no-right").await {
            Err(TokenRefusal::Denied(why)) => assert!(
                why.contains("system:serviceaccount:jobs:intruder may not request peer checks"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        // Without create on the reviews (RBAC missing): unavailable, never accepted.
        emu.authorize("t", UserInfo::service_account(ns, "faultline"), vec![]);
        assert!(matches!(
            r.check("launcher-token").await,
            Err(TokenRefusal::Unavailable(_))
        ));
    }
}
