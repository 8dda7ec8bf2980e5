//! Request authentication: an HMAC-SHA256 keyed with the cluster's shared secret (mounted from a
//! Kubernetes Secret) over the whole request, encoded with `auth.mac` empty, so the sender, the
//! time, the nonce and every field are covered. The receiver checks the MAC (in constant time),
//! that the time is within `max_skew` of its clock, and that it has not seen the nonce from that
//! sender (replays).
//!
//! This is authentication of peers that share a secret, not encryption: the check traffic is not
//! confidential, and anyone holding the secret can forge requests.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use hmac::{Hmac, Mac};
use prost::Message;
use sha2::Sha256;

use crate::v1::{Auth, CheckAssignment, CheckReport, PingRequest, RunConclusion, RunRequest};

type HmacSha256 = Hmac<Sha256>;

/// The shortest secret accepted.
pub const MIN_SECRET_BYTES: usize = 16;
/// Nonce length (bytes) the sender must use.
pub const NONCE_BYTES: usize = 16;

/// Why a request was refused. The text is sent back to the caller (it names no secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("the shared secret is shorter than {MIN_SECRET_BYTES} bytes")]
    WeakSecret,
    #[error("request is not signed (no auth)")]
    Missing,
    #[error("request from {sender:?}: the signature does not verify (wrong secret, or the request was changed)")]
    BadMac { sender: String },
    #[error("request from {sender:?}: signed {skew_ms} ms away from this node's clock (at most {max_ms} ms)")]
    Stale {
        sender: String,
        skew_ms: i64,
        max_ms: i64,
    },
    #[error("request from {sender:?}: nonce already used (a replay)")]
    Replayed { sender: String },
    #[error("request from {sender:?}: the nonce must be {NONCE_BYTES} bytes")]
    BadNonce { sender: String },
}

/// A request that carries `Auth`.
pub trait Signed: Message + Clone + Default {
    fn auth(&self) -> Option<&Auth>;
    fn auth_mut(&mut self) -> &mut Option<Auth>;
}

macro_rules! signed {
    ($($t:ty),*) => {$(
        impl Signed for $t {
            fn auth(&self) -> Option<&Auth> {
                self.auth.as_ref()
            }
            fn auth_mut(&mut self) -> &mut Option<Auth> {
                &mut self.auth
            }
        }
    )*};
}
signed!(
    CheckAssignment,
    CheckReport,
    RunRequest,
    PingRequest,
    RunConclusion
);
// The relay's envelope (its inner message keeps its own `Auth`).
signed!(crate::v1::ForwardRequest);

/// The shared secret.
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({} bytes)", self.0.len())
    }
}

impl Key {
    pub fn new(secret: &[u8]) -> Result<Key, AuthError> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(AuthError::WeakSecret);
        }
        Ok(Key(secret.to_vec()))
    }

    /// Whether two keys hold the same secret (a configuration check, not on the request path).
    pub fn same_secret(&self, other: &Key) -> bool {
        self.0 == other.0
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes keys of any length; this cannot fail.
        <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!())
    }
}

/// Signs `msg` as `sender` at `unix_ms` with `nonce`.
pub fn sign<M: Signed>(
    msg: &mut M,
    key: &Key,
    sender: &str,
    unix_ms: i64,
    nonce: [u8; NONCE_BYTES],
) {
    *msg.auth_mut() = Some(Auth {
        sender: sender.to_string(),
        unix_ms,
        nonce: nonce.to_vec(),
        mac: Vec::new(),
    });
    let mut m = key.mac();
    m.update(&msg.encode_to_vec());
    let tag = m.finalize().into_bytes().to_vec();
    if let Some(a) = msg.auth_mut() {
        a.mac = tag;
    }
}

/// Checks requests; remembers recent nonces to refuse replays.
#[derive(Debug)]
pub struct Verifier {
    key: Key,
    max_skew: Duration,
    /// (sender, nonce) -> when it was signed; pruned once older than the skew allows.
    seen: HashMap<(String, Vec<u8>), i64>,
    order: VecDeque<(i64, String, Vec<u8>)>,
}

impl Verifier {
    pub fn new(key: Key, max_skew: Duration) -> Verifier {
        Verifier {
            key,
            max_skew,
            seen: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Verifies `msg` at `now_ms`; returns the authenticated sender.
    pub fn verify<M: Signed>(&mut self, msg: &M, now_ms: i64) -> Result<String, AuthError> {
        let auth = msg.auth().ok_or(AuthError::Missing)?;
        let sender = auth.sender.clone();
        let mut unsigned = msg.clone();
        if let Some(a) = unsigned.auth_mut() {
            a.mac.clear();
        }
        let mut m = self.key.mac();
        m.update(&unsigned.encode_to_vec());
        m.verify_slice(&auth.mac).map_err(|_| AuthError::BadMac {
            sender: sender.clone(),
        })?;
        let max_ms = i64::try_from(self.max_skew.as_millis()).unwrap_or(i64::MAX);
        let skew_ms = now_ms.saturating_sub(auth.unix_ms);
        if skew_ms.saturating_abs() > max_ms {
            return Err(AuthError::Stale {
                sender,
                skew_ms,
                max_ms,
            });
        }
        if auth.nonce.len() != NONCE_BYTES {
            return Err(AuthError::BadNonce { sender });
        }
        // Forget nonces too old to be accepted again anyway.
        while let Some((t, _, _)) = self.order.front() {
            if now_ms.saturating_sub(*t) > max_ms.saturating_mul(2) {
                if let Some((_, s, n)) = self.order.pop_front() {
                    self.seen.remove(&(s, n));
                }
            } else {
                break;
            }
        }
        let id = (sender.clone(), auth.nonce.clone());
        if self.seen.contains_key(&id) {
            return Err(AuthError::Replayed { sender });
        }
        self.seen.insert(id, auth.unix_ms);
        self.order
            .push_back((auth.unix_ms, sender.clone(), auth.nonce.clone()));
        Ok(sender)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::Member;

    fn report(node: &str) -> CheckReport {
        CheckReport {
            protocol: crate::PROTOCOL,
            run_id: "run-1".into(),
            round: 2,
            node: node.into(),
            partner: "gpu-2".into(),
            passed: true,
            seconds: 0.25,
            ..Default::default()
        }
    }

    const T: i64 = 1_790_000_000_000;

    #[test]
    fn signed_requests_verify_and_name_their_sender() {
        let key = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let mut v = Verifier::new(key.clone(), Duration::from_secs(30));
        let mut r = report("gpu-1");
        sign(&mut r, &key, "gpu-1", T, [7; NONCE_BYTES]);
        assert_eq!(v.verify(&r, T + 1000), Ok("gpu-1".to_string()));
        // Also through the wire encoding.
        let back = CheckReport::decode(r.encode_to_vec().as_slice()).unwrap();
        let mut a = CheckAssignment {
            a: Some(Member {
                node: "gpu-1".into(),
                address: "10.0.0.1:20261".into(),
                topology: String::new(),
            }),
            ..Default::default()
        };
        sign(&mut a, &key, "gpu-3", T, [8; NONCE_BYTES]);
        assert_eq!(v.verify(&a, T), Ok("gpu-3".to_string()));
        assert_eq!(back, r);
    }

    #[test]
    fn forgeries_and_replays_are_refused_clearly() {
        let key = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let other = Key::new(b"another secret, also 32 bytes...").unwrap();
        let mut v = Verifier::new(key.clone(), Duration::from_secs(30));
        let mut r = report("gpu-1");
        sign(&mut r, &key, "gpu-1", T, [1; NONCE_BYTES]);

        // A changed field (a forged result), a changed sender, a wrong key, no auth at all.
        let mut forged = r.clone();
        forged.passed = false;
        assert!(matches!(
            v.verify(&forged, T),
            Err(AuthError::BadMac { .. })
        ));
        let mut impostor = r.clone();
        if let Some(a) = impostor.auth.as_mut() {
            a.sender = "gpu-9".into();
        }
        assert!(matches!(
            v.verify(&impostor, T),
            Err(AuthError::BadMac { .. })
        ));
        let mut wrong = report("gpu-1");
        sign(&mut wrong, &other, "gpu-1", T, [2; NONCE_BYTES]);
        let e = v.verify(&wrong, T).unwrap_err();
        assert!(e.to_string().contains("does not verify"), "{e}");
        assert_eq!(v.verify(&report("gpu-1"), T), Err(AuthError::Missing));

        // Stale and replayed.
        let mut old = report("gpu-1");
        sign(&mut old, &key, "gpu-1", T - 60_000, [3; NONCE_BYTES]);
        assert!(matches!(
            v.verify(&old, T),
            Err(AuthError::Stale {
                skew_ms: 60_000,
                ..
            })
        ));
        assert_eq!(v.verify(&r, T), Ok("gpu-1".into()));
        assert!(matches!(
            v.verify(&r, T + 10),
            Err(AuthError::Replayed { .. })
        ));
        // Long after, the nonce is forgotten but the request is stale anyway.
        assert!(matches!(
            v.verify(&r, T + 120_000),
            Err(AuthError::Stale { .. })
        ));

        // A short nonce.
        let mut short = report("gpu-1");
        sign(&mut short, &key, "gpu-1", T, [4; NONCE_BYTES]);
        if let Some(a) = short.auth.as_mut() {
            a.nonce.truncate(4);
            a.mac.clear();
        }
        // Re-sign by hand with the short nonce.
        let mut m = key.mac();
        m.update(&short.encode_to_vec());
        short.auth.as_mut().unwrap().mac = m.finalize().into_bytes().to_vec();
        assert!(matches!(
            v.verify(&short, T),
            Err(AuthError::BadNonce { .. })
        ));
    }

    #[test]
    fn weak_secrets_are_refused_and_never_printed() {
        assert_eq!(Key::new(b"short").unwrap_err(), AuthError::WeakSecret);
        let k = Key::new(b"0123456789abcdef").unwrap();
        assert_eq!(format!("{k:?}"), "Key(16 bytes)");
    }
}
