//! The peer-check members file (`node ip:port [topology]` per line; `#` starts a comment):
//! what the coordinator runs from without Kubernetes and `faultline hosts --members` reads.

use std::net::IpAddr;

/// One member of the check pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub node: String,
    /// Where its agent's peer-check service listens.
    pub address: String,
    /// The address its probes bind (its pod IP: the agents run on the host network).
    pub ip: IpAddr,
    /// The topology label's value, when the node has one.
    pub topology: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum MembersError {
    #[error("cannot read the members file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("members file {path}, line {line}: {message}")]
    Syntax {
        path: String,
        line: usize,
        message: String,
    },
    #[error("listing the agent pods: {0}")]
    Kube(#[from] kube::Error),
}

/// Parses a members file.
pub fn parse_members(path: &str, text: &str) -> Result<Vec<Member>, MembersError> {
    let mut out: Vec<Member> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let err = |message: String| MembersError::Syntax {
            path: path.to_string(),
            line: i + 1,
            message,
        };
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (node, addr, topology) = match fields.as_slice() {
            [n, a] => (*n, *a, None),
            [n, a, t] => (*n, *a, Some(t.to_string())),
            _ => return Err(err("expected `node ip:port [topology]`".into())),
        };
        let sock: std::net::SocketAddr = addr
            .parse()
            .map_err(|_| err(format!("{addr:?} is not ip:port")))?;
        if out.iter().any(|m| m.node == node) {
            return Err(err(format!("node {node:?} is listed twice")));
        }
        out.push(Member {
            node: node.to_string(),
            address: sock.to_string(),
            ip: sock.ip(),
            topology,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn members_file() {
        let m = parse_members(
            "f",
            "# pool\nnode-a 10.0.0.1:20261 rack1\nnode-b 10.0.0.2:20261  # no rack\n\n",
        )
        .unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].topology.as_deref(), Some("rack1"));
        assert_eq!(m[1].address, "10.0.0.2:20261");
        assert_eq!(m[1].ip.to_string(), "10.0.0.2");
        for (bad, why) in [
            ("a", "expected"),
            ("a 10.0.0.1", "not ip:port"),
            ("a 10.0.0.1:1\na 10.0.0.2:1", "twice"),
            ("a b c d", "expected"),
        ] {
            let e = parse_members("f", bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
