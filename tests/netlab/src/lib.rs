//! faultline-netlab: a network-namespace lab for tests. A [`Lab`] is a Linux bridge on the
//! host (address `10.<octet>.0.254/24`) with `n` network namespaces plugged into it, node `i`
//! at `10.<octet>.0.<i+1>` on its `eth0`. Tests run programs in a node ([`Lab::command`],
//! [`Lab::tokio_command`]) and break the network on purpose: a node unreachable
//! ([`Lab::isolate`]), one link cut ([`Lab::cut_link`]), a slow path ([`Lab::shape`]); and
//! mend it ([`Lab::heal`]). Dropping the lab deletes everything it created.
//!
//! Needs root, iproute2, iptables and tc ([`Lab::check_available`] says what is missing).
//! Several labs can live at once, in one process or in several: each claims its own subnet
//! (see `claim`), and its interface names are derived from that subnet. Leftovers of a run
//! that crashed are deleted when their subnet is claimed again.
//!
//! Docker hosts: with `br_netfilter` loaded, frames crossing the bridge go through the host's
//! iptables FORWARD chain, whose policy Docker sets to DROP; the lab inserts an ACCEPT rule for
//! its bridge at the top of FORWARD (and deletes it when dropped).

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

mod claim;
mod sys;

use claim::{Claim, Record};

/// Why a lab could not be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The host cannot run a lab (not root, a tool missing, no namespaces).
    #[error("network lab unavailable: {0}")]
    Unavailable(String),
    #[error("bad lab request: {0}")]
    Invalid(String),
    #[error("node {index} does not exist (the lab has {nodes})")]
    NoSuchNode { index: usize, nodes: usize },
    #[error("no free 10.x.0.0/24 subnet for a lab (all 250 in use or claimed)")]
    NoFreeSubnet,
    /// The kernel or the tools lack something this call needs (e.g. the netem qdisc).
    #[error("unsupported here: {0}")]
    Unsupported(String),
    #[error("cannot run `{cmd}`: {source}")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Failed {
        cmd: String,
        status: String,
        stderr: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

/// One node: a network namespace with `eth0` on the lab's bridge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabNode {
    /// The namespace's name (for `ip netns exec`).
    pub ns: String,
    /// The node's address on `eth0`.
    pub ip: Ipv4Addr,
    /// The host end of the node's veth pair (a port of the bridge).
    pub host_veth: String,
}

/// The interface inside every node.
const NODE_DEV: &str = "eth0";

/// A bridge with namespaces on it; everything is deleted on drop.
#[derive(Debug)]
pub struct Lab {
    bridge: String,
    host_ip: Ipv4Addr,
    nodes: Vec<LabNode>,
    /// What exists now (kept current while building, so a failed build is cleaned too).
    record: Record,
    claim: Claim,
}

/// Labs made by this process so far (varies the subnet each one tries first).
static LABS: AtomicUsize = AtomicUsize::new(0);

/// `tag` as it goes into interface names: lowercase letters and digits, at most 6.
fn short_tag(tag: &str) -> String {
    let t: String = tag
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .take(6)
        .collect();
    if t.is_empty() {
        "lab".into()
    } else {
        t
    }
}

/// Names of everything a lab with this tag, octet and size creates. Interface names stay
/// within the kernel's 15 characters: `fl<tag6>-<oo>` and `fl<tag6>-<oo>v<i hex>`.
fn names(tag: &str, octet: u8, n: usize, pid: u32) -> Record {
    let bridge = format!("fl{tag}-{octet:02x}");
    Record {
        pid,
        namespaces: (0..n).map(|i| format!("{bridge}-{pid}-{i}")).collect(),
        veths: (0..n).map(|i| format!("{bridge}v{i:x}")).collect(),
        bridge,
        forward: Vec::new(),
    }
}

/// The iptables programs that need a FORWARD rule for a bridge: `iptables`, and also
/// `iptables-legacy` where `iptables` is the nf_tables one but legacy tables are loaded too
/// (Docker set up with legacy iptables): a DROP policy in either table drops the frame.
fn forward_programs() -> Vec<String> {
    let mut p = vec!["iptables".to_string()];
    let nft = sys::run("iptables", &["-V"]).is_ok_and(|v| v.contains("nf_tables"));
    let legacy_loaded = std::fs::read_to_string("/proc/net/ip_tables_names")
        .is_ok_and(|t| t.lines().any(|l| l.trim() == "filter"));
    if nft && legacy_loaded && sys::run("iptables-legacy", &["-V"]).is_ok() {
        p.push("iptables-legacy".into());
    }
    p
}

fn forward_rule<'a>(op: &'a str, bridge: &'a str) -> [&'a str; 9] {
    [
        "-w", op, "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT",
    ]
}

/// Deletes everything in `r` that still exists; never fails (cleanup of a lab, or of a crashed
/// run's leftovers).
fn teardown(r: &Record) {
    for ns in &r.namespaces {
        // Processes still inside would keep the namespace (and its veth end) alive. A process
        // that was joining while we listed shows up on the next listing: repeat until none.
        for _ in 0..20 {
            let Ok(pids) = sys::run("ip", &["netns", "pids", ns]) else {
                break;
            };
            let pids: Vec<i32> = pids
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        sys::quiet("ip", &["netns", "del", ns]);
    }
    for veth in &r.veths {
        if link_exists(veth) {
            sys::quiet("ip", &["link", "del", veth]);
        }
    }
    if !r.bridge.is_empty() {
        for program in &r.forward {
            // Once per insertion; more than one only if a crash repeated a rule.
            for _ in 0..8 {
                if !sys::quiet(program, &forward_rule("-D", &r.bridge)) {
                    break;
                }
            }
        }
        if link_exists(&r.bridge) {
            sys::quiet("ip", &["link", "del", &r.bridge]);
        }
    }
}

fn link_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

impl Lab {
    /// Whether this host can run a lab: root, `ip`, `tc` and `iptables` present, and a network
    /// namespace can be created. `Err` says what is missing.
    pub fn check_available() -> Result<(), String> {
        match sys::euid() {
            Some(0) => {}
            Some(uid) => return Err(format!("needs root (running as uid {uid})")),
            None => return Err("cannot read the effective uid from /proc/self/status".into()),
        }
        for (program, arg, package) in [
            ("ip", "-V", "iproute2"),
            ("tc", "-V", "iproute2"),
            ("iptables", "-V", "iptables"),
        ] {
            sys::run(program, &[arg]).map_err(|e| format!("`{program}` ({package}): {e}"))?;
        }
        let probe = format!(
            "flcheck-{}-{}",
            std::process::id(),
            LABS.fetch_add(1, Ordering::Relaxed)
        );
        sys::run("ip", &["netns", "add", &probe])
            .map_err(|e| format!("cannot create a network namespace: {e}"))?;
        sys::quiet("ip", &["netns", "del", &probe]);
        Ok(())
    }

    /// Builds a lab of `n` nodes (1 to 253). `tag` (its first 6 letters and digits) names the
    /// bridge `fl<tag>-<octet hex>` and the namespaces `fl<tag>-<octet hex>-<pid>-<i>`.
    pub fn new(tag: &str, n: usize) -> Result<Lab, LabError> {
        if n == 0 || n > 253 {
            return Err(LabError::Invalid(format!("{n} nodes (a lab has 1 to 253)")));
        }
        let tag = short_tag(tag);
        let pid = std::process::id();
        let seed = (pid as usize)
            .wrapping_mul(31)
            .wrapping_add(LABS.fetch_add(1, Ordering::Relaxed).wrapping_mul(7));
        // Leftovers of crashed labs first (they may hold addresses of subnets we could use).
        claim::sweep(teardown);
        let claim = Claim::take(seed, |o| names(&tag, o, n, pid), teardown)?;
        let octet = claim.octet;
        let planned = names(&tag, octet, n, pid);
        // Same names from an earlier run that left no record (should not happen; cheap).
        teardown(&Record {
            forward: forward_programs(),
            ..planned.clone()
        });
        let mut lab = Lab {
            bridge: planned.bridge.clone(),
            host_ip: Ipv4Addr::new(10, octet, 0, 254),
            nodes: Vec::with_capacity(n),
            record: planned.clone(),
            claim,
        };
        lab.build(&planned)?;
        Ok(lab)
    }

    /// Creates the bridge, the host's FORWARD rules and the nodes. On error the caller drops
    /// the lab, which deletes whatever was created (the record names all of it in advance).
    fn build(&mut self, planned: &Record) -> Result<(), LabError> {
        let br = self.bridge.clone();
        let octet = self.claim.octet;
        sys::run("ip", &["link", "add", "name", &br, "type", "bridge"])?;
        sys::run(
            "ip",
            &["addr", "add", &format!("{}/24", self.host_ip), "dev", &br],
        )?;
        sys::run("ip", &["link", "set", &br, "up"])?;
        // Record the rules before inserting them, so a crash in between still cleans them.
        self.record.forward = forward_programs();
        self.claim.write(&self.record)?;
        for program in self.record.forward.clone() {
            sys::run(&program, &forward_rule("-I", &br))?;
        }
        for (i, (ns, veth)) in planned.namespaces.iter().zip(&planned.veths).enumerate() {
            let ip = Ipv4Addr::new(10, octet, 0, (i + 1) as u8);
            sys::run("ip", &["netns", "add", ns])?;
            sys::run(
                "ip",
                &[
                    "link", "add", veth, "type", "veth", "peer", "name", NODE_DEV, "netns", ns,
                ],
            )?;
            sys::run("ip", &["link", "set", veth, "master", &br])?;
            sys::run("ip", &["link", "set", veth, "up"])?;
            let cidr = format!("{ip}/24");
            sys::run("ip", &["-n", ns, "addr", "add", &cidr, "dev", NODE_DEV])?;
            sys::run("ip", &["-n", ns, "link", "set", NODE_DEV, "up"])?;
            sys::run("ip", &["-n", ns, "link", "set", "lo", "up"])?;
            self.nodes.push(LabNode {
                ns: ns.clone(),
                ip,
                host_veth: veth.clone(),
            });
        }
        Ok(())
    }

    /// The host's address on the bridge (reachable from every node).
    pub fn host_ip(&self) -> Ipv4Addr {
        self.host_ip
    }

    /// The bridge's name.
    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    pub fn nodes(&self) -> &[LabNode] {
        &self.nodes
    }

    fn node(&self, i: usize) -> Result<&LabNode, LabError> {
        self.nodes.get(i).ok_or(LabError::NoSuchNode {
            index: i,
            nodes: self.nodes.len(),
        })
    }

    /// The namespace of node `i`; for an index past the end, a name that does not exist, so
    /// a command built with it fails with `ip`'s own message instead of running on the host.
    fn ns_or_missing(&self, i: usize) -> String {
        self.nodes
            .get(i)
            .map(|n| n.ns.clone())
            .unwrap_or_else(|| format!("{}-no-node-{i}", self.bridge))
    }

    /// `ip netns exec <ns of node i> <program>`; add arguments and run it. (For an index past
    /// the end the command fails when run: no such namespace.)
    pub fn command(&self, i: usize, program: impl AsRef<OsStr>) -> std::process::Command {
        sys::in_ns(&self.ns_or_missing(i), program)
    }

    /// [`Lab::command`] as a `tokio::process::Command`.
    pub fn tokio_command(&self, i: usize, program: impl AsRef<OsStr>) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("ip");
        c.args(["netns", "exec", &self.ns_or_missing(i)])
            .arg(program);
        c
    }

    fn iptables(&self, i: usize, rule: &[&str]) -> Result<(), LabError> {
        let ns = &self.node(i)?.ns;
        let mut args = vec!["-w"];
        args.extend_from_slice(rule);
        sys::run_in(ns, "iptables", &args).map(drop)
    }

    /// Makes node `i` unreachable: inside its namespace everything in and out on `eth0` is
    /// dropped (connections to and from it hang until their timeouts).
    pub fn isolate(&self, i: usize) -> Result<(), LabError> {
        self.iptables(i, &["-I", "INPUT", "-i", NODE_DEV, "-j", "DROP"])?;
        self.iptables(i, &["-I", "OUTPUT", "-o", NODE_DEV, "-j", "DROP"])
    }

    /// Breaks only the link between nodes `i` and `j`: each drops packets to and from the
    /// other's address; both still reach everyone else.
    pub fn cut_link(&self, i: usize, j: usize) -> Result<(), LabError> {
        if i == j {
            return Err(LabError::Invalid(format!("cut_link({i}, {j}): same node")));
        }
        let (a, b) = (self.node(i)?.ip.to_string(), self.node(j)?.ip.to_string());
        for (node, other) in [(i, &b), (j, &a)] {
            self.iptables(node, &["-I", "INPUT", "-s", other, "-j", "DROP"])?;
            self.iptables(node, &["-I", "OUTPUT", "-d", other, "-j", "DROP"])?;
        }
        Ok(())
    }

    /// Breaks the path between node `i` and one service on the host: node `i` drops the host's
    /// connections to its `node_port` and its own to the host's `host_port`. Everything else
    /// still passes: the other nodes, and the host's other ports (the API server).
    pub fn cut_host_ports(&self, i: usize, node_port: u16, host_port: u16) -> Result<(), LabError> {
        let host = self.host_ip().to_string();
        let (np, hp) = (node_port.to_string(), host_port.to_string());
        self.iptables(
            i,
            &[
                "-I", "INPUT", "-s", &host, "-p", "tcp", "--dport", &np, "-j", "DROP",
            ],
        )?;
        self.iptables(
            i,
            &[
                "-I", "OUTPUT", "-d", &host, "-p", "tcp", "--dport", &hp, "-j", "DROP",
            ],
        )
    }

    /// Slows node `i`'s path: every round trip through it gets `delay` longer (half added on
    /// its `eth0` egress, half on the host-side veth's egress toward it), and each direction is
    /// limited to `rate_mbit` (0: no limit). Replaces earlier shaping of the node.
    ///
    /// A delay needs the kernel's netem qdisc (`Unsupported` where it is missing); a rate limit
    /// alone uses tbf.
    pub fn shape(&self, i: usize, delay: Duration, rate_mbit: u32) -> Result<(), LabError> {
        let node = self.node(i)?.clone();
        let mut qdisc: Vec<String> = Vec::new();
        if !delay.is_zero() {
            let half_us = delay.as_micros() / 2;
            qdisc.extend(
                ["netem", "delay", &format!("{half_us}us"), "limit", "100000"].map(String::from),
            );
            if rate_mbit > 0 {
                qdisc.extend(["rate".to_string(), format!("{rate_mbit}mbit")]);
            }
        } else if rate_mbit > 0 {
            // tbf's bucket: 4 ms at the rate, at least 128 KiB (more than a GSO packet).
            let burst = (u64::from(rate_mbit) * 1_000_000 / 8 / 250).max(128 * 1024);
            qdisc.extend(
                [
                    "tbf",
                    "rate",
                    &format!("{rate_mbit}mbit"),
                    "burst",
                    &burst.to_string(),
                    "latency",
                    "50ms",
                ]
                .map(String::from),
            );
        } else {
            return self.unshape(&node);
        }
        let kind = qdisc[0].clone();
        let unsupported = |e: LabError| match e {
            LabError::Failed { ref stderr, .. } if stderr.contains("qdisc kind is unknown") => {
                LabError::Unsupported(format!(
                    "the {kind} qdisc is not in this kernel (for netem: CONFIG_NET_SCH_NETEM, \
                     module sch_netem): {e}"
                ))
            }
            e => e,
        };
        let args = |dev: &str| -> Vec<String> {
            ["qdisc", "replace", "dev", dev, "root"]
                .map(String::from)
                .into_iter()
                .chain(qdisc.iter().cloned())
                .collect()
        };
        let node_side = args(NODE_DEV);
        let node_side: Vec<&str> = node_side.iter().map(String::as_str).collect();
        sys::run_in(&node.ns, "tc", &node_side).map_err(&unsupported)?;
        let host_side = args(&node.host_veth);
        let host_side: Vec<&str> = host_side.iter().map(String::as_str).collect();
        sys::run("tc", &host_side).map_err(&unsupported).map(drop)
    }

    /// Removes shaping of a node (none there is fine).
    fn unshape(&self, node: &LabNode) -> Result<(), LabError> {
        // Deleting the default qdisc fails with "handle of zero": nothing to remove.
        let gone = |r: Result<String, LabError>| match r {
            Err(LabError::Failed { ref stderr, .. }) if stderr.contains("handle of zero") => Ok(()),
            r => r.map(drop),
        };
        gone(sys::run_in(
            &node.ns,
            "tc",
            &["qdisc", "del", "dev", NODE_DEV, "root"],
        ))?;
        gone(sys::run(
            "tc",
            &["qdisc", "del", "dev", &node.host_veth, "root"],
        ))
    }

    /// Undoes [`Lab::isolate`], [`Lab::cut_link`] (on this node's side) and [`Lab::shape`] for
    /// node `i`: its iptables INPUT and OUTPUT chains are flushed and its shaping removed.
    pub fn heal(&self, i: usize) -> Result<(), LabError> {
        self.iptables(i, &["-F", "INPUT"])?;
        self.iptables(i, &["-F", "OUTPUT"])?;
        let node = self.node(i)?.clone();
        self.unshape(&node)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        teardown(&self.record);
        self.claim.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_the_kernel_limit() {
        let r = names(&short_tag("Some-Long_Tag!"), 250, 253, 4_194_304);
        assert_eq!(r.bridge, "flsomelo-fa");
        assert!(r.bridge.len() <= 15);
        assert!(r.veths.iter().all(|v| v.len() <= 15 && v.starts_with("fl")));
        assert_eq!(r.veths[252], "flsomelo-favfc");
        assert_eq!(r.namespaces[1], "flsomelo-fa-4194304-1");
        assert_eq!(short_tag("--"), "lab");
    }
}
