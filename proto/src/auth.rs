//! Request authentication: an HMAC-SHA256 keyed with the cluster's shared secret (mounted from a
//! Kubernetes Secret) over the whole request, encoded with `auth.mac` empty, so the sender, the
//! receiver, the time, the nonce and every field are covered. The receiver checks the MAC (in
//! constant time), that the request is addressed to it (its own identity, [`Verifier::new`]),
//! that it was signed at most `max_age` ago and at most [`MAX_AHEAD`] ahead of its clock, and
//! that it has not seen the nonce from that sender (replays).
//!
//! The receiver binding makes a request accepted once acceptable nowhere else: the nonce memory
//! is each receiver's own, so without it the same bytes replayed to a second agent were accepted.
//!
//! This is authentication of peers that share a secret, not encryption: the check traffic is not
//! confidential, and anyone holding the secret can forge requests (as any sender, to any
//! receiver).

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
/// How far ahead of the receiver's clock a request may be signed. Hosts kept in step by NTP
/// (chrony, systemd-timesyncd) on one network differ by well under 10 ms, so 2 s is some 200x
/// that and also absorbs a host whose clock NTP is still slewing; a sender further ahead is
/// mis-set, and its requests would otherwise stay acceptable for `max_age` plus the lead
/// (a request signed 25 s ahead lived 55 s with a 30 s window). Past requests keep `max_age`
/// (transit, retries, a receiver behind the sender).
pub const MAX_AHEAD: Duration = Duration::from_secs(2);
/// The receiver a requester names on `Run` when it knows only the coordinator's address
/// (`faultline check --coordinator ADDR`): a role, not a node (the colon is not allowed in a
/// node name, so it names no agent). Only `Run` accepts it ([`Verifier::verify_or_role`]).
pub const COORDINATOR_ROLE: &str = "role:coordinator";

/// Why a request was refused. The text is sent back to the caller (it names no secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("the shared secret is shorter than {MIN_SECRET_BYTES} bytes")]
    WeakSecret,
    #[error("request is not signed (no auth)")]
    Missing,
    #[error("request from {sender:?}: the signature does not verify (wrong secret, or the request was changed)")]
    BadMac { sender: String },
    #[error("request from {sender:?}: signed {skew_ms} ms before this node's clock (at most {max_ms} ms)")]
    Stale {
        sender: String,
        skew_ms: i64,
        max_ms: i64,
    },
    #[error("request from {sender:?}: signed {ahead_ms} ms ahead of this node's clock (at most {max_ms} ms; are the clocks kept in step by NTP?)")]
    Ahead {
        sender: String,
        ahead_ms: i64,
        max_ms: i64,
    },
    #[error("request from {sender:?} is addressed to {receiver:?}, not to this receiver ({me:?}): a request signed for another is refused")]
    WrongReceiver {
        sender: String,
        receiver: String,
        me: String,
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

/// Signs `msg` as `sender`, for `receiver`, at `unix_ms` with `nonce`.
pub fn sign<M: Signed>(
    msg: &mut M,
    key: &Key,
    sender: &str,
    receiver: &str,
    unix_ms: i64,
    nonce: [u8; NONCE_BYTES],
) {
    *msg.auth_mut() = Some(Auth {
        sender: sender.to_string(),
        receiver: receiver.to_string(),
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

/// Checks requests addressed to one receiver; remembers recent nonces to refuse replays.
#[derive(Debug)]
pub struct Verifier {
    key: Key,
    /// How long ago a request may have been signed.
    max_skew: Duration,
    /// This receiver's identity (its node name): requests must name it in `Auth.receiver`.
    me: String,
    /// (sender, nonce) -> when it was signed; pruned once older than the skew allows.
    seen: HashMap<(String, Vec<u8>), i64>,
    order: VecDeque<(i64, String, Vec<u8>)>,
}

impl Verifier {
    /// A verifier for requests to `me`, signed at most `max_skew` ago (and at most
    /// [`MAX_AHEAD`] ahead).
    pub fn new(key: Key, max_skew: Duration, me: impl Into<String>) -> Verifier {
        Verifier {
            key,
            max_skew,
            me: me.into(),
            seen: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Verifies `msg`, which must be addressed to this receiver, at `now_ms`; returns the
    /// authenticated sender.
    pub fn verify<M: Signed>(&mut self, msg: &M, now_ms: i64) -> Result<String, AuthError> {
        self.check(msg, now_ms, None)
    }

    /// As [`Verifier::verify`], but a request addressed to `role` (e.g. [`COORDINATOR_ROLE`])
    /// is accepted too: for the one RPC whose requester may know only the role's address.
    pub fn verify_or_role<M: Signed>(
        &mut self,
        msg: &M,
        now_ms: i64,
        role: &str,
    ) -> Result<String, AuthError> {
        self.check(msg, now_ms, Some(role))
    }

    fn check<M: Signed>(
        &mut self,
        msg: &M,
        now_ms: i64,
        role: Option<&str>,
    ) -> Result<String, AuthError> {
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
        // After the MAC: the receiver named is then the signer's, not a forger's.
        if auth.receiver != self.me && role.is_none_or(|r| auth.receiver != r) {
            return Err(AuthError::WrongReceiver {
                sender,
                receiver: auth.receiver.clone(),
                me: self.me.clone(),
            });
        }
        let max_ms = i64::try_from(self.max_skew.as_millis()).unwrap_or(i64::MAX);
        let skew_ms = now_ms.saturating_sub(auth.unix_ms);
        if skew_ms > max_ms {
            return Err(AuthError::Stale {
                sender,
                skew_ms,
                max_ms,
            });
        }
        let ahead_max_ms = i64::try_from(MAX_AHEAD.as_millis()).unwrap_or(i64::MAX);
        if skew_ms < 0 && skew_ms.saturating_neg() > ahead_max_ms {
            return Err(AuthError::Ahead {
                sender,
                ahead_ms: skew_ms.saturating_neg(),
                max_ms: ahead_max_ms,
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
    /// The verifying node.
    const ME: &str = "gpu-0";

    #[test]
    fn signed_requests_verify_and_name_their_sender() {
        let key = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let mut v = Verifier::new(key.clone(), Duration::from_secs(30), ME);
        let mut r = report("gpu-1");
        sign(&mut r, &key, "gpu-1", ME, T, [7; NONCE_BYTES]);
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
        sign(&mut a, &key, "gpu-3", ME, T, [8; NONCE_BYTES]);
        assert_eq!(v.verify(&a, T), Ok("gpu-3".to_string()));
        assert_eq!(back, r);
    }

    #[test]
    fn forgeries_and_replays_are_refused_clearly() {
        let key = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let other = Key::new(b"another secret, also 32 bytes...").unwrap();
        let mut v = Verifier::new(key.clone(), Duration::from_secs(30), ME);
        let mut r = report("gpu-1");
        sign(&mut r, &key, "gpu-1", ME, T, [1; NONCE_BYTES]);

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
        sign(&mut wrong, &other, "gpu-1", ME, T, [2; NONCE_BYTES]);
        let e = v.verify(&wrong, T).unwrap_err();
        assert!(e.to_string().contains("does not verify"), "{e}");
        assert_eq!(v.verify(&report("gpu-1"), T), Err(AuthError::Missing));

        // Stale and replayed.
        let mut old = report("gpu-1");
        sign(&mut old, &key, "gpu-1", ME, T - 60_000, [3; NONCE_BYTES]);
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
        sign(&mut short, &key, "gpu-1", ME, T, [4; NONCE_BYTES]);
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

    /// Issue 28: a Conclude signed by the coordinator for one agent was accepted verbatim by a
    /// second (each keeps its own nonces). A request names its receiver, under the MAC: every
    /// other receiver refuses it, and remembers nothing of it.
    #[test]
    fn a_request_for_another_receiver_is_refused() {
        let key = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let mut a = Verifier::new(key.clone(), Duration::from_secs(30), "gpu-1");
        let mut b = Verifier::new(key.clone(), Duration::from_secs(30), "gpu-2");
        let mut r = report("gpu-1");
        sign(&mut r, &key, "gpu-0", "gpu-2", T, [5; NONCE_BYTES]);
        let e = a.verify(&r, T).unwrap_err();
        assert_eq!(
            e,
            AuthError::WrongReceiver {
                sender: "gpu-0".into(),
                receiver: "gpu-2".into(),
                me: "gpu-1".into(),
            }
        );
        assert!(
            e.to_string()
                .contains("addressed to \"gpu-2\", not to this receiver (\"gpu-1\")"),
            "{e}"
        );
        assert_eq!(b.verify(&r, T), Ok("gpu-0".to_string()));
        // The receiver cannot be rewritten: it is under the MAC.
        let mut moved = r.clone();
        if let Some(x) = moved.auth.as_mut() {
            x.receiver = "gpu-1".into();
        }
        assert!(matches!(a.verify(&moved, T), Err(AuthError::BadMac { .. })));
        // The role a requester may name on Run only: accepted where the caller allows it.
        let mut run = RunRequest::default();
        sign(
            &mut run,
            &key,
            "cli@x",
            COORDINATOR_ROLE,
            T,
            [6; NONCE_BYTES],
        );
        assert!(matches!(
            a.verify(&run, T),
            Err(AuthError::WrongReceiver { .. })
        ));
        assert_eq!(
            a.verify_or_role(&run, T, COORDINATOR_ROLE),
            Ok("cli@x".to_string())
        );
        // And still once only.
        assert!(matches!(
            a.verify_or_role(&run, T, COORDINATOR_ROLE),
            Err(AuthError::Replayed { .. })
        ));
    }

    /// Issue 28: a request signed 25 s ahead of the receiver's clock was accepted (the window
    /// was 30 s either way). Ahead: at most `MAX_AHEAD`; behind: `max_skew` as before.
    #[test]
    fn requests_signed_ahead_of_the_clock_are_refused_past_the_bound() {
        let key = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let mut v = Verifier::new(key.clone(), Duration::from_secs(30), ME);
        let at = |unix_ms: i64, n: u8| {
            let mut r = report("gpu-1");
            sign(&mut r, &key, "gpu-1", ME, unix_ms, [n; NONCE_BYTES]);
            r
        };
        let e = v.verify(&at(T + 25_000, 1), T).unwrap_err();
        assert_eq!(
            e,
            AuthError::Ahead {
                sender: "gpu-1".into(),
                ahead_ms: 25_000,
                max_ms: 2_000,
            }
        );
        assert!(e.to_string().contains("25000 ms ahead"), "{e}");
        assert!(matches!(
            v.verify(&at(T + 2_001, 2), T),
            Err(AuthError::Ahead {
                ahead_ms: 2_001,
                ..
            })
        ));
        assert_eq!(v.verify(&at(T + 2_000, 3), T), Ok("gpu-1".to_string()));
        assert_eq!(v.verify(&at(T + 300, 4), T), Ok("gpu-1".to_string()));
        // The past window is unchanged.
        assert_eq!(v.verify(&at(T - 30_000, 5), T), Ok("gpu-1".to_string()));
        assert!(matches!(
            v.verify(&at(T - 30_001, 6), T),
            Err(AuthError::Stale {
                skew_ms: 30_001,
                ..
            })
        ));
    }

    #[test]
    fn weak_secrets_are_refused_and_never_printed() {
        assert_eq!(Key::new(b"short").unwrap_err(), AuthError::WeakSecret);
        let k = Key::new(b"0123456789abcdef").unwrap();
        assert_eq!(format!("{k:?}"), "Key(16 bytes)");
    }
}
