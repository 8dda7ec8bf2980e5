//! Request authentication. A request is signed over its whole encoding with `auth.mac` empty,
//! so the sender, the receiver, the time, the nonce and every field are covered, by one of two
//! kinds of key ([`VerifyKey`]):
//!
//! - an HMAC-SHA256 secret ([`Key`]): the requesters' secret, an agent's service-account token
//!   (its reports on Kubernetes; the coordinator learns the token's node from the API server),
//!   or on bare metal a node's own key derived from a master the coordinator holds
//!   ([`node_key`]), so that a node can sign only as itself;
//! - the coordinator's Ed25519 key ([`CoordinatorKey`]): the coordinator signs with its private
//!   key and agents hold only its public key ([`CoordinatorPublicKey`]), so no agent can sign as
//!   the coordinator.
//!
//! The receiver checks the signature (an HMAC in constant time), that the request is addressed
//! to it (its own identity, [`Verifier::new`]), that it was signed at most `max_age` ago and at
//! most [`MAX_AHEAD`] ahead of its clock, and that it has not seen the nonce from that sender
//! (replays): the same rules whatever the key.
//!
//! The receiver binding makes a request accepted once acceptable nowhere else: the nonce memory
//! is each receiver's own, so without it the same bytes replayed to a second agent were accepted.
//!
//! This is authentication, not encryption: the check traffic is not confidential. Anyone holding
//! an HMAC secret can forge requests under it (as any sender, to any receiver); only the holder
//! of the coordinator's private key can sign what its public key verifies.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use hmac::{Hmac, Mac};
use prost::Message;
use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use sha2::Sha256;

use crate::v1::{
    AdmitRequest, Auth, CheckAssignment, CheckReport, PingRequest, RunConclusion, RunRequest,
};

type HmacSha256 = Hmac<Sha256>;

/// The shortest secret accepted.
pub const MIN_SECRET_BYTES: usize = 16;
/// The longest sender name taken (a Kubernetes node or pod name is at most 253 bytes).
pub const MAX_NAME_BYTES: usize = 253;
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
/// node name, so it names no agent). Only `Run` and an agent's `Admit`, both sent to the
/// coordinator's Service, accept it ([`Verifier::verify_or_role`],
/// [`Verifier::verify_with_or_role`]).
pub const COORDINATOR_ROLE: &str = "role:coordinator";

/// Why a request was refused. The text is sent back to the caller (it names no secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("the secret is shorter than {MIN_SECRET_BYTES} bytes")]
    WeakSecret,
    #[error("the sender's name is longer than {MAX_NAME_BYTES} bytes")]
    LongName,
    #[error("request is not signed (no auth)")]
    Missing,
    #[error("request from {sender:?}: the signature does not verify (wrong secret, or the request was changed)")]
    BadMac { sender: String },
    #[error("request from {sender:?}: the signature does not verify with the coordinator's public key (not signed by the coordinator, or the request was changed)")]
    BadSignature { sender: String },
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
    RunConclusion,
    AdmitRequest
);
// The relay's envelope (its inner message keeps its own `Auth`).
signed!(crate::v1::ForwardRequest);

/// An HMAC secret.
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
    /// The key's bytes: for writing a node's derived key ([`node_key`]) to that node's file.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn same_secret(&self, other: &Key) -> bool {
        self.0 == other.0
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes keys of any length; this cannot fail.
        <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!())
    }
}

/// The domain-separation label of [`node_key`]: a node's key is never the MAC of anything a
/// request could be.
pub const NODE_KEY_LABEL: &[u8] = b"faultline/v1 node key\0";

/// Bare metal: the key of node `node`, derived from the `master` secret only the coordinator
/// holds: HMAC-SHA256(master, [`NODE_KEY_LABEL`] || node), 32 bytes. Each node is provisioned
/// with its own (written by the coordinator's host, copied to the node like any secret file);
/// the coordinator derives any node's key to check its requests, and a node, holding only its
/// own, can sign only as itself.
pub fn node_key(master: &Key, node: &str) -> Key {
    let mut m = master.mac();
    m.update(NODE_KEY_LABEL);
    m.update(node.as_bytes());
    Key(m.finalize().into_bytes().to_vec())
}

/// Sets `msg`'s auth with an empty `mac` and returns the bytes the signature covers.
fn to_sign<M: Signed>(
    msg: &mut M,
    sender: &str,
    receiver: &str,
    unix_ms: i64,
    nonce: [u8; NONCE_BYTES],
) -> Vec<u8> {
    *msg.auth_mut() = Some(Auth {
        sender: sender.to_string(),
        receiver: receiver.to_string(),
        unix_ms,
        nonce: nonce.to_vec(),
        mac: Vec::new(),
    });
    msg.encode_to_vec()
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
    let bytes = to_sign(msg, sender, receiver, unix_ms, nonce);
    let mut m = key.mac();
    m.update(&bytes);
    let tag = m.finalize().into_bytes().to_vec();
    if let Some(a) = msg.auth_mut() {
        a.mac = tag;
    }
}

/// Length of an Ed25519 public key.
pub const PUBLIC_KEY_BYTES: usize = 32;
/// Length of a public key's text: base64url without padding.
pub const PUBLIC_KEY_CHARS: usize = 43;
/// Length of an Ed25519 signature (what `Auth.mac` carries when the coordinator signs).
pub const SIGNATURE_BYTES: usize = 64;

/// Why a coordinator key could not be made or read: a configuration error, never a request's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("cannot generate a coordinator key: the system's random source failed")]
    Random,
    #[error("the coordinator's key is not an Ed25519 private key as a PKCS#8 v2 document (DER, as CoordinatorKey::generate_pkcs8 writes it): {0}")]
    Pkcs8(String),
    #[error("the coordinator's public key is not valid: {0} (expected {PUBLIC_KEY_CHARS} characters of base64url without padding)")]
    PublicKey(String),
}

/// The coordinator's signing key (Ed25519). Only the coordinator holds it; agents hold its
/// [`CoordinatorPublicKey`]. Its `Debug` shows the public key only.
pub struct CoordinatorKey {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for CoordinatorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorKey")
            .field("public", &self.public_key().to_string())
            .finish_non_exhaustive()
    }
}

impl CoordinatorKey {
    /// A new key as a PKCS#8 v2 document (DER): what to store (a Secret, a file only the
    /// coordinator can read) and give to [`CoordinatorKey::from_pkcs8`].
    pub fn generate_pkcs8() -> Result<Vec<u8>, KeyError> {
        Ed25519KeyPair::generate_pkcs8(&SystemRandom::new())
            .map(|d| d.as_ref().to_vec())
            .map_err(|_| KeyError::Random)
    }

    /// A new key, in memory only (a one-shot coordinator, tests).
    pub fn generate() -> Result<CoordinatorKey, KeyError> {
        CoordinatorKey::from_pkcs8(&CoordinatorKey::generate_pkcs8()?)
    }

    /// The key from a PKCS#8 v2 document's bytes (a key file's contents); the public key it
    /// carries must match the private key.
    pub fn from_pkcs8(document: &[u8]) -> Result<CoordinatorKey, KeyError> {
        Ed25519KeyPair::from_pkcs8(document)
            .map(|pair| CoordinatorKey { pair })
            .map_err(|e| KeyError::Pkcs8(e.to_string()))
    }

    /// The public key agents verify with.
    pub fn public_key(&self) -> CoordinatorPublicKey {
        let mut k = [0u8; PUBLIC_KEY_BYTES];
        k.copy_from_slice(self.pair.public_key().as_ref());
        CoordinatorPublicKey(k)
    }

    /// Signs `msg` as `sender`, for `receiver`, at `unix_ms` with `nonce`, as [`sign`] does, with
    /// the [`SIGNATURE_BYTES`]-byte Ed25519 signature in `Auth.mac`.
    pub fn sign<M: Signed>(
        &self,
        msg: &mut M,
        sender: &str,
        receiver: &str,
        unix_ms: i64,
        nonce: [u8; NONCE_BYTES],
    ) {
        let bytes = to_sign(msg, sender, receiver, unix_ms, nonce);
        let sig = self.pair.sign(&bytes).as_ref().to_vec();
        if let Some(a) = msg.auth_mut() {
            a.mac = sig;
        }
    }
}

/// The coordinator's public key: what agents verify its requests with. Its text (`Display`,
/// [`CoordinatorPublicKey::parse`]) is the 32 bytes in base64url without padding, 43
/// characters (RFC 4648 §5), one text per key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CoordinatorPublicKey([u8; PUBLIC_KEY_BYTES]);

impl std::fmt::Debug for CoordinatorPublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CoordinatorPublicKey({self})")
    }
}

impl std::fmt::Display for CoordinatorPublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&base64url::encode(&self.0))
    }
}

impl std::str::FromStr for CoordinatorPublicKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        CoordinatorPublicKey::parse(s)
    }
}

impl CoordinatorPublicKey {
    /// From its text; whitespace around it is ignored (a file or ConfigMap value ends with a
    /// newline).
    pub fn parse(text: &str) -> Result<CoordinatorPublicKey, KeyError> {
        base64url::decode_32(text.trim())
            .map(CoordinatorPublicKey)
            .map_err(KeyError::PublicKey)
    }

    pub fn as_bytes(&self) -> &[u8; PUBLIC_KEY_BYTES] {
        &self.0
    }

    fn verifies(&self, bytes: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(bytes, signature)
            .is_ok()
    }
}

/// Base64url without padding (RFC 4648 §5), for public keys' text.
mod base64url {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

    pub(super) fn encode(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        let (mut acc, mut bits) = (0u32, 0u32);
        for &b in bytes {
            acc = (acc << 8) | u32::from(b);
            bits += 8;
            while bits >= 6 {
                bits -= 6;
                out.push(char::from(ALPHABET[((acc >> bits) & 63) as usize]));
            }
            acc &= (1 << bits) - 1;
        }
        if bits > 0 {
            out.push(char::from(ALPHABET[((acc << (6 - bits)) & 63) as usize]));
        }
        out
    }

    /// Exactly 32 bytes; the unused low bits of the last character must be zero, so that each
    /// key has one text.
    pub(super) fn decode_32(text: &str) -> Result<[u8; 32], String> {
        let want = super::PUBLIC_KEY_CHARS;
        if text.len() != want {
            return Err(format!("{} characters, not {want}", text.len()));
        }
        let mut out = [0u8; 32];
        let (mut acc, mut bits, mut n) = (0u32, 0u32, 0usize);
        for (i, c) in text.bytes().enumerate() {
            let v = ALPHABET
                .iter()
                .position(|&a| a == c)
                .ok_or_else(|| format!("character {} is not base64url", i + 1))?;
            acc = (acc << 6) | v as u32;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                if let Some(o) = out.get_mut(n) {
                    *o = (acc >> bits) as u8;
                }
                n += 1;
                acc &= (1 << bits) - 1;
            }
        }
        if acc != 0 {
            return Err("its last character has bits set past the key's end".into());
        }
        Ok(out)
    }
}

/// What a [`Verifier`] checks signatures with.
#[derive(Debug, Clone)]
pub enum VerifyKey {
    /// An HMAC secret: the shared one, a requester's, or a node's ([`node_key`]).
    Hmac(Key),
    /// The coordinator's public key: only its private key signs what this accepts.
    Coordinator(CoordinatorPublicKey),
    /// The master of the nodes' keys (the coordinator's, without Kubernetes): a request is
    /// checked with the key [`node_key`] derives for the sender it names.
    Nodes(Key),
    /// None of its own: each request is checked with the key given with it
    /// ([`Verifier::verify_with`]); [`Verifier::verify`] refuses everything.
    PerRequest,
}

impl From<Key> for VerifyKey {
    fn from(k: Key) -> VerifyKey {
        VerifyKey::Hmac(k)
    }
}

impl From<CoordinatorPublicKey> for VerifyKey {
    fn from(k: CoordinatorPublicKey) -> VerifyKey {
        VerifyKey::Coordinator(k)
    }
}

/// Checks requests addressed to one receiver; remembers recent nonces to refuse replays.
#[derive(Debug)]
pub struct Verifier {
    key: VerifyKey,
    /// How long ago a request may have been signed.
    max_skew: Duration,
    /// This receiver's identity (its node name): requests must name it in `Auth.receiver`.
    me: String,
    /// (sender, nonce) -> when it was signed; pruned once older than the skew allows.
    seen: HashMap<(String, Vec<u8>), i64>,
    order: VecDeque<(i64, String, Vec<u8>)>,
}

impl Verifier {
    /// A verifier for requests to `me` signed with `key` (a [`Key`] or a
    /// [`CoordinatorPublicKey`]), signed at most `max_skew` ago (and at most [`MAX_AHEAD`]
    /// ahead).
    pub fn new(key: impl Into<VerifyKey>, max_skew: Duration, me: impl Into<String>) -> Verifier {
        Verifier {
            key: key.into(),
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
    /// is accepted too: for a request whose sender may know only the role's address.
    pub fn verify_or_role<M: Signed>(
        &mut self,
        msg: &M,
        now_ms: i64,
        role: &str,
    ) -> Result<String, AuthError> {
        self.check(msg, now_ms, Some(role))
    }

    /// As [`Verifier::verify`], with `key` instead of the verifier's own (the same receiver,
    /// times and nonce memory): for a sender whose key is known only with its request (an
    /// agent's report signed with its bearer token, checked by the API server).
    pub fn verify_with<M: Signed>(
        &mut self,
        key: &VerifyKey,
        msg: &M,
        now_ms: i64,
    ) -> Result<String, AuthError> {
        self.check_with(key, msg, now_ms, None)
    }

    /// [`Verifier::verify_with`] and [`Verifier::verify_or_role`] at once: a sender whose key
    /// comes with its request, reaching this receiver through the role's address (an agent's
    /// taint admission sent to the coordinator's Service).
    pub fn verify_with_or_role<M: Signed>(
        &mut self,
        key: &VerifyKey,
        msg: &M,
        now_ms: i64,
        role: &str,
    ) -> Result<String, AuthError> {
        self.check_with(key, msg, now_ms, Some(role))
    }

    fn check<M: Signed>(
        &mut self,
        msg: &M,
        now_ms: i64,
        role: Option<&str>,
    ) -> Result<String, AuthError> {
        let key = self.key.clone();
        self.check_with(&key, msg, now_ms, role)
    }

    fn check_with<M: Signed>(
        &mut self,
        key: &VerifyKey,
        msg: &M,
        now_ms: i64,
        role: Option<&str>,
    ) -> Result<String, AuthError> {
        let auth = msg.auth().ok_or(AuthError::Missing)?;
        // Before anything is kept of it: the nonce memory holds the sender's name.
        if auth.sender.len() > MAX_NAME_BYTES {
            return Err(AuthError::LongName);
        }
        let sender = auth.sender.clone();
        let mut unsigned = msg.clone();
        if let Some(a) = unsigned.auth_mut() {
            a.mac.clear();
        }
        let bytes = unsigned.encode_to_vec();
        let hmac = |key: &Key| {
            let mut m = key.mac();
            m.update(&bytes);
            m.verify_slice(&auth.mac).map_err(|_| AuthError::BadMac {
                sender: sender.clone(),
            })
        };
        match key {
            VerifyKey::Hmac(key) => hmac(key)?,
            // Each node's own key, derived from the master for the sender it names: a request
            // verifies only under the key of the node it claims to come from.
            VerifyKey::Nodes(master) => hmac(&node_key(master, &sender))?,
            VerifyKey::PerRequest => return Err(AuthError::BadMac { sender }),
            VerifyKey::Coordinator(public) => {
                if !public.verifies(&bytes, &auth.mac) {
                    return Err(AuthError::BadSignature { sender });
                }
            }
        }
        // After the signature: the receiver named is then the signer's, not a forger's.
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

    /// Issue 28 review: a sender name of any length was kept in the nonce memory, so requests
    /// of 250 KiB names (each signed with a bearer token of the sender's own making) filled the
    /// coordinator's memory. A name over `MAX_NAME_BYTES` is refused before anything is kept.
    #[test]
    fn a_sender_name_longer_than_a_node_name_is_refused() {
        let key = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let mut v = Verifier::new(key.clone(), Duration::from_secs(30), ME);
        let long = "n".repeat(MAX_NAME_BYTES + 1);
        let mut r = report(&long);
        sign(&mut r, &key, &long, ME, T, [1; NONCE_BYTES]);
        assert_eq!(v.verify(&r, T), Err(AuthError::LongName));
        assert!(v.seen.is_empty() && v.order.is_empty(), "nothing kept");
        let most = "n".repeat(MAX_NAME_BYTES);
        let mut r = report(&most);
        sign(&mut r, &key, &most, ME, T, [2; NONCE_BYTES]);
        assert_eq!(v.verify(&r, T), Ok(most));
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

    /// Issue 28: every agent held the key that signs as the coordinator. The coordinator now
    /// signs with its own Ed25519 key, and agents verify with its public key: a request signed
    /// with every secret an agent holds (the shared key, its node key) is refused, and the
    /// receiver, time, nonce and replay rules are the HMAC verifier's.
    #[test]
    fn only_the_coordinators_key_signs_what_its_public_key_verifies() {
        let coordinator = CoordinatorKey::generate().unwrap();
        let public = coordinator.public_key();
        let mut v = Verifier::new(public, Duration::from_secs(30), ME);
        let conclude = |signer: &CoordinatorKey, to: &str, at: i64, n: u8| {
            let mut c = RunConclusion {
                run_id: "run-1".into(),
                ..Default::default()
            };
            signer.sign(&mut c, "coordinator", to, at, [n; NONCE_BYTES]);
            c
        };
        let c = conclude(&coordinator, ME, T, 1);
        assert_eq!(c.auth.as_ref().unwrap().mac.len(), SIGNATURE_BYTES);
        assert_eq!(v.verify(&c, T + 500), Ok("coordinator".to_string()));
        // Also through the wire encoding, and once only.
        let back = RunConclusion::decode(c.encode_to_vec().as_slice()).unwrap();
        assert!(matches!(
            v.verify(&back, T + 600),
            Err(AuthError::Replayed { .. })
        ));

        // What a member holding every agent credential can sign: with the shared secret, with
        // its own node key, with a key of its own making; and the coordinator's request edited.
        let shared = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let mut forged = RunConclusion::default();
        sign(&mut forged, &shared, "coordinator", ME, T, [2; NONCE_BYTES]);
        let e = v.verify(&forged, T).unwrap_err();
        assert_eq!(
            e,
            AuthError::BadSignature {
                sender: "coordinator".into()
            }
        );
        assert!(
            e.to_string()
                .contains("does not verify with the coordinator's public key"),
            "{e}"
        );
        let mut own = RunConclusion::default();
        sign(
            &mut own,
            &node_key(&shared, "gpu-1"),
            "coordinator",
            ME,
            T,
            [3; NONCE_BYTES],
        );
        assert!(matches!(
            v.verify(&own, T),
            Err(AuthError::BadSignature { .. })
        ));
        let impostor = CoordinatorKey::generate().unwrap();
        assert!(matches!(
            v.verify(&conclude(&impostor, ME, T, 4), T),
            Err(AuthError::BadSignature { .. })
        ));
        let mut edited = conclude(&coordinator, ME, T, 5);
        edited.run_id = "run-2".into();
        assert!(matches!(
            v.verify(&edited, T),
            Err(AuthError::BadSignature { .. })
        ));
        let mut truncated = conclude(&coordinator, ME, T, 6);
        truncated.auth.as_mut().unwrap().mac.truncate(32);
        assert!(matches!(
            v.verify(&truncated, T),
            Err(AuthError::BadSignature { .. })
        ));
        assert_eq!(
            v.verify(&RunConclusion::default(), T),
            Err(AuthError::Missing)
        );

        // The same rules as under an HMAC key: the receiver, the past and future bounds.
        assert!(matches!(
            v.verify(&conclude(&coordinator, "gpu-2", T, 7), T),
            Err(AuthError::WrongReceiver { .. })
        ));
        assert!(matches!(
            v.verify(&conclude(&coordinator, ME, T - 30_001, 8), T),
            Err(AuthError::Stale {
                skew_ms: 30_001,
                ..
            })
        ));
        assert!(matches!(
            v.verify(&conclude(&coordinator, ME, T + 2_001, 9), T),
            Err(AuthError::Ahead {
                ahead_ms: 2_001,
                ..
            })
        ));
        let mut run = RunRequest::default();
        coordinator.sign(
            &mut run,
            "coordinator",
            COORDINATOR_ROLE,
            T,
            [10; NONCE_BYTES],
        );
        assert_eq!(
            v.verify_or_role(&run, T, COORDINATOR_ROLE),
            Ok("coordinator".to_string())
        );
        // A short nonce, signed by the coordinator itself.
        let mut short = conclude(&coordinator, ME, T, 11);
        let a = short.auth.as_mut().unwrap();
        a.nonce.truncate(4);
        a.mac.clear();
        let sig = coordinator.pair.sign(&short.encode_to_vec());
        short.auth.as_mut().unwrap().mac = sig.as_ref().to_vec();
        assert!(matches!(
            v.verify(&short, T),
            Err(AuthError::BadNonce { .. })
        ));

        // And an HMAC verifier does not take the coordinator's signature for a MAC.
        let mut hv = Verifier::new(shared, Duration::from_secs(30), ME);
        assert!(matches!(
            hv.verify(&conclude(&coordinator, ME, T, 12), T),
            Err(AuthError::BadMac { .. })
        ));
    }

    #[test]
    fn coordinator_keys_are_stored_as_pkcs8_and_never_printed() {
        let doc = CoordinatorKey::generate_pkcs8().unwrap();
        let a = CoordinatorKey::from_pkcs8(&doc).unwrap();
        let b = CoordinatorKey::from_pkcs8(&doc).unwrap();
        assert_eq!(a.public_key(), b.public_key());
        assert_ne!(
            CoordinatorKey::generate().unwrap().public_key(),
            a.public_key()
        );
        // What one signs, the other's public key verifies: the same key.
        let mut r = report("gpu-1");
        a.sign(&mut r, "coordinator", ME, T, [1; NONCE_BYTES]);
        let mut v = Verifier::new(b.public_key(), Duration::from_secs(30), ME);
        assert_eq!(v.verify(&r, T), Ok("coordinator".to_string()));
        // The Debug output is the public key only.
        let text = a.public_key().to_string();
        assert_eq!(
            format!("{a:?}"),
            format!("CoordinatorKey {{ public: {text:?}, .. }}")
        );
        // Not a key, a truncated one, the public key in place of the document.
        for bad in [
            &b"not a key"[..],
            &doc[..doc.len() - 1],
            a.public_key().as_bytes(),
        ] {
            let e = CoordinatorKey::from_pkcs8(bad).unwrap_err();
            assert!(matches!(e, KeyError::Pkcs8(_)), "{e:?}");
            assert!(e.to_string().contains("PKCS#8 v2"), "{e}");
        }
    }

    #[test]
    fn public_keys_are_43_characters_of_base64url() {
        let k = CoordinatorKey::generate().unwrap().public_key();
        let text = k.to_string();
        assert_eq!(text.len(), PUBLIC_KEY_CHARS);
        assert!(text
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'));
        assert_eq!(CoordinatorPublicKey::parse(&text), Ok(k));
        assert_eq!(format!("{text}\n").parse::<CoordinatorPublicKey>(), Ok(k));
        assert_eq!(format!("{k:?}"), format!("CoordinatorPublicKey({text})"));
        // RFC 4648 §10's vectors, in the URL alphabet without padding.
        assert_eq!(base64url::encode(b"fo"), "Zm8");
        assert_eq!(base64url::encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64url::encode(&[0xfb, 0xff]), "-_8");
        let all = CoordinatorPublicKey([0xff; PUBLIC_KEY_BYTES]).to_string();
        assert_eq!(all, format!("{}8", "_".repeat(42)));
        assert_eq!(
            CoordinatorPublicKey::parse(&all),
            Ok(CoordinatorPublicKey([0xff; PUBLIC_KEY_BYTES]))
        );
        let cases = [
            (format!("{text}="), "44 characters, not 43"),
            (text[..42].to_string(), "42 characters, not 43"),
            (String::new(), "0 characters"),
            (format!("+{}", &text[1..]), "character 1 is not base64url"),
            (
                format!("{}_", "_".repeat(42)),
                "bits set past the key's end",
            ),
        ];
        for (bad, why) in cases {
            let e = CoordinatorPublicKey::parse(&bad).unwrap_err();
            assert!(matches!(e, KeyError::PublicKey(_)), "{e:?}");
            let e = e.to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(e.contains("43 characters of base64url"), "{e}");
        }
    }

    /// Issue 28 (bare metal): every agent held the one key, so any could sign as any member.
    /// A node's key is derived from a master only the coordinator holds: what node A signs
    /// verifies under A's key and under no other node's.
    #[test]
    fn node_keys_are_derived_per_node_and_sign_only_as_that_node() {
        let master = Key::new(b"a shared secret of 32 bytes.....").unwrap();
        let (a, b) = (node_key(&master, "gpu-1"), node_key(&master, "gpu-2"));
        // Fixed vectors (Python's hmac module): provisioning tools must derive the same keys.
        let hex = |k: &Key| k.0.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(
            hex(&a),
            "e0b5731309edbca5757dcab1df08e28ab14be92503e3cada28d73d82c5f54857"
        );
        assert_eq!(
            hex(&b),
            "49289a7fd410ba3c2aff1951827c292be9d651e08dd9c7ccb4ffb300787763a3"
        );
        assert!(!a.same_secret(&b));
        assert!(!a.same_secret(&master));
        assert!(node_key(&master, "gpu-1").same_secret(&a));
        let other = Key::new(b"another secret, also 32 bytes...").unwrap();
        assert!(!node_key(&other, "gpu-1").same_secret(&a));

        let mut r = report("gpu-1");
        sign(&mut r, &a, "gpu-1", ME, T, [1; NONCE_BYTES]);
        // The coordinator checks a report from gpu-1 with gpu-1's derived key.
        let mut as_a = Verifier::new(node_key(&master, "gpu-1"), Duration::from_secs(30), ME);
        assert_eq!(as_a.verify(&r, T), Ok("gpu-1".to_string()));
        let mut as_b = Verifier::new(node_key(&master, "gpu-2"), Duration::from_secs(30), ME);
        assert!(matches!(as_b.verify(&r, T), Err(AuthError::BadMac { .. })));
        // gpu-1 claiming to be gpu-2: checked with gpu-2's key, refused.
        let mut claim = report("gpu-2");
        sign(&mut claim, &a, "gpu-2", ME, T, [2; NONCE_BYTES]);
        assert!(matches!(
            as_b.verify(&claim, T),
            Err(AuthError::BadMac { .. })
        ));
    }

    #[test]
    fn weak_secrets_are_refused_and_never_printed() {
        assert_eq!(Key::new(b"short").unwrap_err(), AuthError::WeakSecret);
        let k = Key::new(b"0123456789abcdef").unwrap();
        assert_eq!(format!("{k:?}"), "Key(16 bytes)");
    }
}
