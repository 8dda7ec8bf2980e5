//! `faultline keys`: the peer-check credentials for clusters without Kubernetes, made where the
//! operator keeps secrets. The coordinator holds its key and the master; each node gets only its
//! own key; the agents get the coordinator's public key (a flag, not a secret). On Kubernetes
//! none is needed: each coordinator replica makes its key, agents use their service-account
//! tokens.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context as _;
use faultline_proto::auth::{node_key, CoordinatorKey};

use super::Outcome;

/// Writes `bytes` to a new file only its owner can read; an existing file is never replaced
/// (a key overwritten by mistake locks every agent out).
fn write_new(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// `faultline keys coordinator --out FILE`: a new coordinator key (PKCS#8); prints its public
/// key, which every agent is given (`--peer-coordinator-key`).
pub fn coordinator(out: &Path) -> Outcome {
    let made = CoordinatorKey::generate_pkcs8()
        .map_err(anyhow::Error::from)
        .and_then(|doc| {
            let key = CoordinatorKey::from_pkcs8(&doc)?;
            write_new(out, &doc)?;
            Ok(key.public_key())
        });
    match made {
        Ok(public) => Outcome::ok(public.to_string()),
        Err(e) => Outcome::error(format!("error: {e:#}")),
    }
}

/// `faultline keys public --key FILE`: the public key of a coordinator key.
pub fn public(key: &Path) -> Outcome {
    match std::fs::read(key)
        .with_context(|| format!("cannot read {}", key.display()))
        .and_then(|doc| CoordinatorKey::from_pkcs8(&doc).with_context(|| key.display().to_string()))
    {
        Ok(k) => Outcome::ok(k.public_key().to_string()),
        Err(e) => Outcome::error(format!("error: {e:#}")),
    }
}

/// `faultline keys master --out FILE`: the master of the nodes' keys (the coordinator's
/// `--node-key-master-file`), 32 random bytes as hex.
pub fn master(out: &Path) -> Outcome {
    let mut b = [0u8; 32];
    if let Err(e) = getrandom::fill(&mut b) {
        return Outcome::error(format!("error: no random bytes: {e}"));
    }
    match write_new(out, hex::encode(b).as_bytes()) {
        Ok(()) => Outcome::ok(format!("wrote {}", out.display())),
        Err(e) => Outcome::error(format!("error: {e:#}")),
    }
}

/// `faultline keys node --master FILE --node NAME --out FILE`: the key of one node (its
/// agent's `--peer-node-key-file`), derived from the master, as hex.
pub fn node(master: &Path, node: &str, out: &Path) -> Outcome {
    if node.is_empty() {
        return Outcome::error("error: --node is empty");
    }
    let master = match crate::peer::wire::load_private_key(master) {
        Ok(k) => k,
        Err(e) => return Outcome::error(format!("error: {e}")),
    };
    let key = node_key(&master, node);
    match write_new(out, hex::encode(key.bytes()).as_bytes()) {
        Ok(()) => Outcome::ok(format!("wrote {} for node {node}", out.display())),
        Err(e) => Outcome::error(format!("error: {e:#}")),
    }
}
