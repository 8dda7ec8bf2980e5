//! The wire protocol's credentials as the agent and the coordinator use them: [`Signer`] (an
//! HMAC key: a node's own, or a requester's), [`NodeCredential`] (what an agent signs its
//! reports with), [`CoordinatorSigner`] (the coordinator's Ed25519 key); reading key files;
//! and verdicts as `faultline.v1.Verdict`s and back.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use faultline_proto::auth::{sign, CoordinatorKey, Key, Signed, NONCE_BYTES};
use faultline_proto::v1::{verdict::Kind, Verdict};

use faultline_core::peer::pairing::{NodeId, Pair, Verdicts};

use crate::clock::{Clock, SystemClock};

/// Milliseconds since the Unix epoch by the system clock (what `Auth.unix_ms` carries).
pub fn now_ms() -> i64 {
    SystemClock.now().as_millisecond()
}

/// A fresh random value (nonces, run ids, jitter).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // The OS random source does not fail on Linux once booted; a zero is still a valid value.
    let _ = getrandom::fill(&mut b);
    u64::from_le_bytes(b)
}

/// Why a key file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the peer-check credential {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("peer-check node key {path}: not the 64 hex characters `faultline keys node` writes")]
    NotNodeKey { path: String },
    #[error("peer-check key {path} may be read by other users (mode {mode:o}): `chmod 600` it (whoever reads it can sign as its holder)")]
    Exposed { path: String, mode: u32 },
    #[error("peer-check key {path}: {source}")]
    Weak {
        path: String,
        source: faultline_proto::auth::AuthError,
    },
}

impl SecretError {
    /// The file at `path` cannot be read.
    fn read(path: &Path) -> impl FnOnce(std::io::Error) -> SecretError + '_ {
        |source| SecretError::Read {
            path: path.display().to_string(),
            source,
        }
    }

    /// The key in the file at `path` is refused.
    fn weak(path: &Path) -> impl FnOnce(faultline_proto::auth::AuthError) -> SecretError + '_ {
        |source| SecretError::Weak {
            path: path.display().to_string(),
            source,
        }
    }
}

/// Reads a key file (a node's key, a requester's secret, a token; trailing whitespace dropped).
pub fn load_key(path: &Path) -> Result<Key, SecretError> {
    let bytes = std::fs::read(path).map_err(SecretError::read(path))?;
    Key::new(bytes.trim_ascii_end()).map_err(SecretError::weak(path))
}

/// Refuses a private key file that users other than its owner may read or write (group or
/// others bits: mode & 0o077): a node key there lets any local user report as the node, the
/// master or the coordinator's key lets it speak for every node. `faultline keys` writes 0600.
/// (ssh refuses a private key the same way.)
pub fn ensure_private(path: &Path) -> Result<(), SecretError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)
        .map_err(SecretError::read(path))?
        .permissions()
        .mode()
        & 0o7777;
    if mode & 0o077 != 0 {
        return Err(SecretError::Exposed {
            path: path.display().to_string(),
            mode,
        });
    }
    Ok(())
}

/// Reads a private key file: the master of the nodes' keys (`faultline keys master`), after
/// [`ensure_private`].
pub fn load_private_key(path: &Path) -> Result<Key, SecretError> {
    ensure_private(path)?;
    load_key(path)
}

/// Reads a node's own key (`faultline keys node` writes it as hex), after [`ensure_private`].
pub(crate) fn load_node_key(path: &Path) -> Result<Key, SecretError> {
    ensure_private(path)?;
    let text = std::fs::read_to_string(path).map_err(SecretError::read(path))?;
    let not = || SecretError::NotNodeKey {
        path: path.display().to_string(),
    };
    let bytes = hex::decode(text.trim()).map_err(|_| not())?;
    if bytes.len() != 32 {
        return Err(not());
    }
    Key::new(&bytes).map_err(SecretError::weak(path))
}

/// Signs requests as one sender.
#[derive(Debug, Clone)]
pub struct Signer {
    pub key: Key,
    pub sender: String,
}

impl Signer {
    /// Signs `msg` for `receiver` (the node that serves it, or `auth::COORDINATOR_ROLE` on a
    /// `Run` to an address only): every other receiver refuses it.
    pub fn sign<M: Signed>(&self, mut msg: M, receiver: &str) -> M {
        sign(
            &mut msg,
            &self.key,
            &self.sender,
            receiver,
            now_ms(),
            nonce(),
        );
        msg
    }
}

fn nonce() -> [u8; NONCE_BYTES] {
    let mut nonce = [0u8; NONCE_BYTES];
    let _ = getrandom::fill(&mut nonce);
    nonce
}

/// What an agent signs its reports with: a credential bound to its node, held by no other.
#[derive(Debug, Clone)]
pub(crate) enum NodeCredential {
    /// Without Kubernetes: the node's own key (derived from the coordinator's master).
    Key(Key),
    /// Kubernetes: the file of the agent's projected service-account token, read for every
    /// report (the kubelet rotates it). The report is signed with the token and carries it
    /// (`authorization: Bearer`): the coordinator asks the API server whose node it is.
    Token(PathBuf),
}

/// A report signed for `receiver`, and the bearer token to send with it.
#[derive(Debug, Clone)]
pub(crate) struct SignedReport<M> {
    pub(crate) msg: M,
    pub(crate) token: Option<String>,
}

impl NodeCredential {
    /// Signs `msg` as `node` for `receiver`.
    pub(crate) fn sign<M: Signed>(
        &self,
        msg: M,
        node: &str,
        receiver: &str,
    ) -> Result<SignedReport<M>, SecretError> {
        let (key, token) = match self {
            NodeCredential::Key(key) => (key.clone(), None),
            NodeCredential::Token(path) => {
                let read = std::fs::read_to_string(path).map_err(SecretError::read(path))?;
                let token = read.trim().to_string();
                let key = Key::new(token.as_bytes()).map_err(SecretError::weak(path))?;
                (key, Some(token))
            }
        };
        let signer = Signer {
            key,
            sender: node.to_string(),
        };
        Ok(SignedReport {
            msg: signer.sign(msg, receiver),
            token,
        })
    }
}

/// Signs as the coordinator, with its own key.
#[derive(Debug, Clone)]
pub struct CoordinatorSigner {
    pub key: Arc<CoordinatorKey>,
    pub sender: String,
}

impl CoordinatorSigner {
    /// Signs `msg` for `receiver`: only `receiver` accepts it, and only an agent that knows
    /// this key's public half.
    pub fn sign<M: Signed>(&self, mut msg: M, receiver: &str) -> M {
        self.key
            .sign(&mut msg, &self.sender, receiver, now_ms(), nonce());
        msg
    }
}

/// The verdicts of a run over `members` (names by `NodeId`), as sent on the wire.
pub fn to_proto(members: &[String], v: &Verdicts) -> Vec<Verdict> {
    let name = |n: NodeId| members.get(n).cloned().unwrap_or_else(|| format!("#{n}"));
    let mut out = Vec::new();
    for &n in &v.faulty {
        out.push(Verdict {
            kind: Kind::FaultyNode as i32,
            nodes: vec![name(n)],
            ..Default::default()
        });
    }
    for l in &v.broken_links {
        out.push(Verdict {
            kind: Kind::BrokenLink as i32,
            nodes: vec![name(l.a()), name(l.b())],
            ..Default::default()
        });
    }
    for (l, &ratio) in &v.degraded_links {
        out.push(Verdict {
            kind: Kind::DegradedLink as i32,
            nodes: vec![name(l.a()), name(l.b())],
            slowdown: ratio,
            ..Default::default()
        });
    }
    for (&n, &ratio) in &v.stragglers {
        out.push(Verdict {
            kind: Kind::Straggler as i32,
            nodes: vec![name(n)],
            slowdown: ratio,
            ..Default::default()
        });
    }
    for (&n, why) in &v.unknown {
        out.push(Verdict {
            kind: Kind::Unknown as i32,
            nodes: vec![name(n)],
            reason: why.clone(),
            ..Default::default()
        });
    }
    out
}

/// Why wire verdicts are refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VerdictError {
    #[error("verdict names {0:?}, not a member of the run")]
    NotMember(String),
    #[error("verdict needs one node, has {0}")]
    NodeCount(usize),
    #[error("a broken link needs two distinct nodes")]
    BrokenLinkNodes,
    #[error("a degraded link needs two distinct nodes")]
    DegradedLinkNodes,
    #[error("degraded link slowdown {0} is not a ratio >= 1")]
    DegradedSlowdown(f64),
    #[error("straggler slowdown {0} is not a ratio >= 1")]
    StragglerSlowdown(f64),
    #[error("verdict kind {0} is not known")]
    Kind(i32),
}

/// Wire verdicts back into `Verdicts` over `members`; a verdict naming a node that is not a
/// member, or of an unknown kind, is an error (a peer that sends one is not trusted at all).
pub fn from_proto(members: &[String], verdicts: &[Verdict]) -> Result<Verdicts, VerdictError> {
    let id = |name: &str| -> Result<NodeId, VerdictError> {
        members
            .iter()
            .position(|m| m == name)
            .ok_or_else(|| VerdictError::NotMember(name.to_string()))
    };
    let one = |v: &Verdict| -> Result<NodeId, VerdictError> {
        match v.nodes.as_slice() {
            [n] => id(n),
            other => Err(VerdictError::NodeCount(other.len())),
        }
    };
    let mut out = Verdicts::default();
    for v in verdicts {
        match Kind::try_from(v.kind) {
            Ok(Kind::FaultyNode) => {
                out.faulty.insert(one(v)?);
            }
            Ok(Kind::BrokenLink) => match v.nodes.as_slice() {
                [a, b] if a != b => {
                    out.broken_links.insert(Pair::new(id(a)?, id(b)?));
                }
                _ => return Err(VerdictError::BrokenLinkNodes),
            },
            Ok(Kind::DegradedLink) => match v.nodes.as_slice() {
                [a, b] if a != b => {
                    if !(v.slowdown.is_finite() && v.slowdown >= 1.0) {
                        return Err(VerdictError::DegradedSlowdown(v.slowdown));
                    }
                    out.degraded_links
                        .insert(Pair::new(id(a)?, id(b)?), v.slowdown);
                }
                _ => return Err(VerdictError::DegradedLinkNodes),
            },
            Ok(Kind::Straggler) => {
                if !(v.slowdown.is_finite() && v.slowdown >= 1.0) {
                    return Err(VerdictError::StragglerSlowdown(v.slowdown));
                }
                out.stragglers.insert(one(v)?, v.slowdown);
            }
            Ok(Kind::Unknown) => {
                out.unknown.insert(one(v)?, v.reason.clone());
            }
            _ => return Err(VerdictError::Kind(v.kind)),
        }
    }
    Ok(out)
}

/// The published name of a verdict kind.
pub fn kind_name(k: faultline_proto::v1::verdict::Kind) -> &'static str {
    use faultline_proto::v1::verdict::Kind;
    match k {
        Kind::FaultyNode => "faulty_node",
        Kind::BrokenLink => "broken_link",
        Kind::DegradedLink => "degraded_link",
        Kind::Straggler => "straggler",
        Kind::Unknown => "unknown",
        Kind::Unspecified => "unspecified",
    }
}

/// The verdict kind a published name stands for (`kind_name` reversed).
pub fn kind_from_name(name: &str) -> faultline_proto::v1::verdict::Kind {
    use faultline_proto::v1::verdict::Kind;
    [
        Kind::FaultyNode,
        Kind::BrokenLink,
        Kind::DegradedLink,
        Kind::Straggler,
        Kind::Unknown,
    ]
    .into_iter()
    .find(|k| kind_name(*k) == name)
    .unwrap_or(Kind::Unspecified)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn verdict_kind_names_round_trip() {
        use faultline_proto::v1::verdict::Kind;
        for k in [
            Kind::FaultyNode,
            Kind::BrokenLink,
            Kind::DegradedLink,
            Kind::Straggler,
            Kind::Unknown,
        ] {
            assert_eq!(kind_from_name(kind_name(k)), k);
        }
        assert_eq!(kind_from_name("bogus"), Kind::Unspecified);
    }

    /// A key file others may read is refused, whatever its content; 0600 and 0400 are taken.
    #[test]
    fn a_private_key_others_may_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.key");
        std::fs::write(&path, "ab".repeat(32)).unwrap();
        for (mode, ok) in [
            (0o600, true),
            (0o400, true),
            (0o640, false),
            (0o644, false),
            (0o602, false),
        ] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let r = load_node_key(&path);
            assert_eq!(r.is_ok(), ok, "mode {mode:o}: {r:?}");
            let r = load_private_key(&path);
            assert_eq!(r.is_ok(), ok, "mode {mode:o}: {r:?}");
            if !ok {
                let e = r.unwrap_err().to_string();
                assert!(
                    e.contains(&format!("mode {mode:o}")) && e.contains("chmod 600"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn verdicts_survive_the_wire() {
        let members: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let mut v = Verdicts::default();
        v.faulty.insert(0);
        v.broken_links.insert(Pair::new(2, 1));
        v.stragglers.insert(3, 2.5);
        v.degraded_links.insert(Pair::new(3, 0), 2.4);
        v.unknown.insert(1, "round limit reached".into());
        let wire = to_proto(&members, &v);
        assert_eq!(wire.len(), 5);
        assert_eq!(from_proto(&members, &wire).unwrap(), v);
    }

    #[test]
    fn bad_wire_verdicts_are_refused() {
        let members: Vec<String> = ["a", "b"].map(String::from).to_vec();
        let v = |kind: Kind, nodes: &[&str], slowdown: f64| Verdict {
            kind: kind as i32,
            nodes: nodes.iter().map(|s| s.to_string()).collect(),
            slowdown,
            reason: String::new(),
        };
        for (bad, why) in [
            (v(Kind::FaultyNode, &["z"], 0.0), "not a member"),
            (v(Kind::FaultyNode, &["a", "b"], 0.0), "one node"),
            (v(Kind::BrokenLink, &["a", "a"], 0.0), "two distinct"),
            (v(Kind::Straggler, &["a"], f64::NAN), "ratio"),
            (v(Kind::DegradedLink, &["a", "a"], 2.0), "two distinct"),
            (v(Kind::DegradedLink, &["a", "b"], 0.0), "ratio"),
            (v(Kind::Unspecified, &["a"], 0.0), "not known"),
        ] {
            let e = from_proto(&members, &[bad]).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn secret_file_is_trimmed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, b"0123456789abcdef0123\n").unwrap();
        assert!(load_key(&p).is_ok());
        std::fs::write(&p, b"short\n").unwrap();
        assert!(load_key(&p).unwrap_err().to_string().contains("shorter"));
        assert!(load_key(&dir.path().join("none"))
            .unwrap_err()
            .to_string()
            .contains("cannot read"));
    }
}
