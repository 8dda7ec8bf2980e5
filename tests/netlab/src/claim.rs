//! Which subnet a lab may use. Lab `10.<octet>.0.0/24` is claimed with an exclusive `flock` on
//! `/run/faultline-netlab/10.<octet>.lock`, so two labs (in one process, or in two test
//! processes running at once) never get the same subnet or the same interface names, which are
//! derived from the octet. The kernel drops the lock when its holder dies, so a crashed run's
//! subnet can be claimed again; the lock file records what that run created (its record is
//! written before anything is created), and every new lab first deletes such leftovers
//! ([`sweep`]).
//!
//! Lock files are emptied, never deleted: deleting a lock file while others may be opening it
//! would let two holders lock two different files of the same name.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::PathBuf;

use rustix::fs::{flock, FlockOperation};

use crate::{sys, LabError};

/// Where the lock files live (`/run` is a tmpfs: cleared at boot, like namespaces).
const LOCK_DIR: &str = "/run/faultline-netlab";

/// What a lab created on the host, as written into its lock file.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Record {
    pub pid: u32,
    pub bridge: String,
    pub namespaces: Vec<String>,
    pub veths: Vec<String>,
    /// The iptables programs (`iptables`, `iptables-legacy`) holding a FORWARD rule for the
    /// bridge.
    pub forward: Vec<String>,
}

impl Record {
    fn encode(&self) -> String {
        let mut s = format!("pid={}\nbridge={}\n", self.pid, self.bridge);
        for (key, values) in [
            ("ns", &self.namespaces),
            ("veth", &self.veths),
            ("forward", &self.forward),
        ] {
            for v in values {
                s.push_str(&format!("{key}={v}\n"));
            }
        }
        s
    }

    /// Parses a record; unknown lines and bad values are skipped (a leftover is cleaned as far
    /// as it can be understood).
    fn decode(text: &str) -> Record {
        let mut r = Record::default();
        for (key, value) in text.lines().filter_map(|l| l.split_once('=')) {
            let value = value.trim().to_string();
            // Only names this crate makes are ever deleted.
            if !value.starts_with("fl") && key != "pid" && key != "forward" {
                continue;
            }
            match key {
                "pid" => r.pid = value.parse().unwrap_or(0),
                "bridge" => r.bridge = value,
                "ns" => r.namespaces.push(value),
                "veth" => r.veths.push(value),
                "forward" if value == "iptables" || value == "iptables-legacy" => {
                    r.forward.push(value)
                }
                _ => {}
            }
        }
        r
    }
}

/// An exclusive claim on one octet; held until dropped (or the process ends).
#[derive(Debug)]
pub(crate) struct Claim {
    pub octet: u8,
    file: File,
}

impl Claim {
    /// Claims a free octet, trying them in an order derived from `seed`. `names(octet)` is
    /// what the lab will create with that octet; it is recorded before anything is created.
    /// Leftovers of a dead earlier holder are deleted with `teardown` first.
    pub(crate) fn take(
        seed: usize,
        names: impl Fn(u8) -> Record,
        teardown: impl Fn(&Record),
    ) -> Result<Claim, LabError> {
        std::fs::create_dir_all(LOCK_DIR).map_err(|source| LabError::Io {
            what: format!("create {LOCK_DIR}"),
            source,
        })?;
        let used = host_subnets_in_use();
        for k in 0..250 {
            let octet = ((seed + k) % 250 + 1) as u8;
            if used.contains(&octet) {
                continue;
            }
            let path = PathBuf::from(format!("{LOCK_DIR}/10.{octet}.lock"));
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|source| LabError::Io {
                    what: format!("open {}", path.display()),
                    source,
                })?;
            if flock(&file, FlockOperation::NonBlockingLockExclusive).is_err() {
                continue; // a live lab holds it
            }
            let mut old = String::new();
            let _ = file.read_to_string(&mut old);
            let stale = Record::decode(&old);
            if !stale.bridge.is_empty() || !stale.namespaces.is_empty() {
                teardown(&stale);
            }
            let mut claim = Claim { octet, file };
            claim.write(&names(octet))?;
            return Ok(claim);
        }
        Err(LabError::NoFreeSubnet)
    }
}

/// Deletes the leftovers of every dead lab: each lock file that nobody holds but that still
/// names what its lab created (the lab crashed before deleting them). Returns how many.
pub(crate) fn sweep(teardown: impl Fn(&Record)) -> usize {
    let Ok(dir) = std::fs::read_dir(LOCK_DIR) else {
        return 0;
    };
    let mut swept = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("10.") && name.ends_with(".lock")) {
            continue;
        }
        let Ok(mut file) = OpenOptions::new().read(true).write(true).open(entry.path()) else {
            continue;
        };
        if flock(&file, FlockOperation::NonBlockingLockExclusive).is_err() {
            continue; // a live lab
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        let stale = Record::decode(&text);
        if !stale.bridge.is_empty() || !stale.namespaces.is_empty() {
            teardown(&stale);
            let _ = file.set_len(0);
            swept += 1;
        }
    }
    swept
}

impl Claim {
    /// Replaces the record in the lock file.
    pub(crate) fn write(&mut self, record: &Record) -> Result<(), LabError> {
        let what = || format!("write /run/faultline-netlab/10.{}.lock", self.octet);
        self.file
            .set_len(0)
            .and_then(|()| self.file.rewind())
            .and_then(|()| self.file.write_all(record.encode().as_bytes()))
            .and_then(|()| self.file.sync_data())
            .map_err(|source| LabError::Io {
                what: what(),
                source,
            })
    }

    /// Empties the record: everything it named is gone.
    pub(crate) fn clear(&mut self) {
        let _ = self.file.set_len(0);
    }
}

/// Octets `o` for which the host already has an address or a route in `10.o.*` (not claimed
/// by a lab: another network this machine uses).
fn host_subnets_in_use() -> Vec<u8> {
    let mut used = Vec::new();
    for args in [
        &["-4", "-o", "addr", "show"][..],
        &["-4", "route", "show", "table", "all"][..],
    ] {
        let Ok(out) = sys::run("ip", args) else {
            continue;
        };
        for token in out.split_whitespace() {
            if let Some(rest) = token.strip_prefix("10.") {
                if let Some(Ok(o)) = rest.split(['.', '/']).next().map(str::parse::<u8>) {
                    used.push(o);
                }
            }
        }
    }
    // Our own labs' bridges hold addresses too; those octets are locked anyway, and a stale
    // one (its holder dead) is exactly what a claim cleans up, so those are not "in use".
    let ours = |o: u8| {
        let path = format!("{LOCK_DIR}/10.{o}.lock");
        std::fs::read_to_string(path)
            .map(|t| !Record::decode(&t).bridge.is_empty())
            .unwrap_or(false)
    };
    used.retain(|o| !ours(*o));
    used.sort_unstable();
    used.dedup();
    used
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_only_our_names_are_kept() {
        let r = Record {
            pid: 42,
            bridge: "flab-0a".into(),
            namespaces: vec!["flab-0a-42-0".into(), "flab-0a-42-1".into()],
            veths: vec!["flab-0av0".into()],
            forward: vec!["iptables".into()],
        };
        assert_eq!(Record::decode(&r.encode()), r);
        let odd = Record::decode("pid=x\nbridge=eth0\nns=flx-1\nforward=rm\nveth\n");
        assert_eq!(odd.pid, 0);
        assert!(odd.bridge.is_empty() && odd.forward.is_empty());
        assert_eq!(odd.namespaces, vec!["flx-1".to_string()]);
    }
}
