//! The Ascend analyzer: pure. Turns one poll's tool results into engine observations.
//!
//! Per chip, each poll sends one `Level` observation per domain it could read completely:
//! `npu-chip` (the error codes npu-smi reports, or `NPU_UNHEALTHY` for a bad health with no
//! code), `npu-link` (link down as code `81078603`, low speed, flapping) and `npu-net` (net
//! health). A domain whose query failed sends nothing, so its faults stay as they were, and the
//! tool's detector goes down with the reason. A chip that vanishes from `npu-smi info` raises
//! `NPU_LOST`.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use faultline_core::catalog::FaultCode;
use faultline_core::engine::{DetectorState, DeviceRef, Observation, Signal};
use faultline_core::parse::ascend::{
    AscendParseError, ChipHealth, LinkStatus, NetHealth, NpuChip, NpuHealth,
};
use faultline_core::policy::AscendPolicy;
use faultline_core::record::Source;

use super::tools::ToolError;
use crate::metrics::{DETECTOR_HCCN, DETECTOR_NPU_SMI};
use crate::source::detector;

pub(crate) use faultline_core::catalog::ascend::{family_of, LINK_DOWN_CODE};
pub(crate) const DOMAIN_CHIP: &str = "npu-chip";
pub(crate) const DOMAIN_LINK: &str = "npu-link";
pub(crate) const DOMAIN_NET: &str = "npu-net";

/// Why a query gave no reading; its text is the reason in the detector status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unread {
    /// The tool is not installed.
    #[error("{0} not found")]
    Absent(String),
    /// The tool (`call`: its command line) failed or did not answer.
    #[error("{call}: {source}")]
    Tool {
        call: String,
        #[source]
        source: ToolError,
    },
    /// The tool's output could not be read.
    #[error("{call}: {source}")]
    Garbage {
        call: String,
        #[source]
        source: AscendParseError,
    },
    /// Not asked: an earlier call to the same tool in this poll hung.
    #[error("skipped after {0}")]
    Skipped(Box<Unread>),
}

impl Unread {
    /// The call timed out: further calls to the same tool in this poll are skipped.
    pub(crate) fn is_hung(&self) -> bool {
        matches!(
            self,
            Unread::Tool {
                source: ToolError::Timeout(_),
                ..
            }
        )
    }
}

/// One port's readings; `None` where the query was not made (not configured).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LinkPoll {
    pub status: Result<LinkStatus, Unread>,
    pub speed_mbps: Option<Result<u64, Unread>>,
    pub up_count: Option<Result<u64, Unread>>,
    pub net: Result<NetHealth, Unread>,
}

/// What one poll read. Errors are the reason for the detector status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Poll {
    pub chips: Result<Vec<NpuChip>, Unread>,
    /// Per chip (by logical id): its health query.
    pub health: BTreeMap<u32, Result<ChipHealth, Unread>>,
    /// Per chip (by logical id): its port, when hccn_tool is present.
    pub links: BTreeMap<u32, LinkPoll>,
    /// Why links were not read at all (`None`: they were, or hccn_tool is absent).
    pub hccn_error: Option<Unread>,
    /// hccn_tool is not installed (no ports to check: normal on inference cards).
    pub hccn_absent: bool,
}

/// A chip as MindCluster names it: its family (from the model npu-smi shows, `310P3` ->
/// `Ascend310P`) and its number: `Ascend910-3`, `Ascend310P-0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChipId {
    pub family: &'static str,
    pub id: u32,
}

impl ChipId {
    pub(crate) fn of(c: &NpuChip) -> ChipId {
        ChipId {
            family: family_of(&c.name),
            id: c.logical_id(),
        }
    }
}

impl std::fmt::Display for ChipId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.family, self.id)
    }
}

fn device(id: ChipId) -> DeviceRef {
    DeviceRef::named(&id.to_string())
}

/// One poll's conditions of chip `id` in `domain`, sent as a `Level`.
fn level(id: ChipId, domain: &str, present: Vec<Signal>) -> Observation {
    Observation::Level {
        source: Source::Ascend,
        device: Some(device(id)),
        domain: domain.into(),
        present,
    }
}

/// The analyzer's memory between polls.
#[derive(Debug, Default)]
pub(crate) struct Analyzer {
    /// Chips seen so far, by logical id.
    seen: BTreeMap<u32, NpuChip>,
    /// Link-up counter samples per chip.
    up_counts: BTreeMap<u32, VecDeque<(Instant, u64)>>,
}

impl Analyzer {
    pub(crate) fn analyze(
        &mut self,
        poll: &Poll,
        policy: &AscendPolicy,
        now: Instant,
    ) -> Vec<Observation> {
        let chips = match &poll.chips {
            Ok(c) => c,
            Err(why) => {
                let why = Some(why.to_string());
                return vec![detector(DETECTOR_NPU_SMI, DetectorState::Down, why)];
            }
        };
        let mut out = Vec::new();
        let mut npu_smi_errors = Vec::new();
        let mut hccn_errors: Vec<String> = poll.hccn_error.iter().map(|e| e.to_string()).collect();
        // Chips gone since the last poll.
        for (key, old) in &self.seen {
            if !chips.iter().any(|c| c.logical_id() == *key) {
                let id = ChipId::of(old);
                out.push(Observation::Signal(Signal::new(
                    Source::Ascend,
                    FaultCode::named("NPU_LOST"),
                    Some(device(id)),
                    format!(
                        "{id} (NPU {} chip {}) is no longer listed by npu-smi",
                        old.npu, old.chip
                    ),
                )));
            }
        }
        for c in chips {
            self.seen.insert(c.logical_id(), c.clone());
        }
        // One inventory per family seen (a node has one in practice; the device plugin runs in
        // one mode per node).
        let mut families: BTreeMap<&'static str, Vec<String>> = BTreeMap::new();
        for c in self.seen.values() {
            let id = ChipId::of(c);
            families.entry(id.family).or_default().push(id.to_string());
        }
        for (family, names) in families {
            out.push(Observation::Inventory {
                kind: family.into(),
                names,
            });
        }
        for c in chips {
            let key = c.logical_id();
            let id = ChipId::of(c);
            match poll.health.get(&key) {
                Some(Ok(h)) => out.push(chip_level(c, h)),
                Some(Err(why)) => npu_smi_errors.push(format!("{id}: {why}")),
                None => {}
            }
            if let Some(l) = poll.links.get(&key) {
                match self.link_level(id, l, policy, now) {
                    Ok(o) => out.push(o),
                    Err(why) => hccn_errors.push(format!("{id}: {why}")),
                }
                match &l.net {
                    Ok(n) => out.push(net_level(id, n)),
                    Err(why) => hccn_errors.push(format!("{id}: {why}")),
                }
            }
        }
        out.push(detector_from(DETECTOR_NPU_SMI, &npu_smi_errors, false));
        out.push(detector_from(DETECTOR_HCCN, &hccn_errors, poll.hccn_absent));
        out
    }

    fn link_level(
        &mut self,
        id: ChipId,
        l: &LinkPoll,
        policy: &AscendPolicy,
        now: Instant,
    ) -> Result<Observation, Unread> {
        let status = l.status.clone()?;
        let mut present = Vec::new();
        if status == LinkStatus::Down {
            present.push(signal(
                FaultCode::Ascend {
                    code: LINK_DOWN_CODE.into(),
                    network: true,
                    severe: false,
                },
                id,
                format!("{id} network port is down (hccn_tool link status DOWN)"),
            ));
        }
        if let Some(speed) = &l.speed_mbps {
            let speed = speed.clone()?;
            // A port that is down reports no meaningful speed.
            if status == LinkStatus::Up
                && policy.expected_speed_mbps > 0
                && speed < policy.expected_speed_mbps
            {
                present.push(signal(
                    FaultCode::named("NPU_LINK_SPEED_LOW"),
                    id,
                    format!(
                        "{id} network port runs at {speed} Mb/s, expected {} Mb/s",
                        policy.expected_speed_mbps
                    ),
                ));
            }
        }
        if let Some(count) = &l.up_count {
            let count = count.clone()?;
            let grew = crate::source::counter_growth(
                self.up_counts.entry(id.id).or_default(),
                now,
                count,
                policy.link_flap_window,
            );
            if policy.link_flap_count > 0 && grew >= policy.link_flap_count {
                present.push(signal(
                    FaultCode::named("NPU_LINK_FLAPPING"),
                    id,
                    format!(
                        "{id} network port came up {grew} times within {}",
                        humantime::format_duration(policy.link_flap_window)
                    ),
                ));
            }
        }
        Ok(level(id, DOMAIN_LINK, present))
    }
}

fn signal(code: FaultCode, id: ChipId, message: String) -> Signal {
    Signal::new(Source::Ascend, code, Some(device(id)), message)
}

fn chip_level(c: &NpuChip, h: &ChipHealth) -> Observation {
    let id = ChipId::of(c);
    // The health query is more specific than the table; either may say UNKNOWN.
    let health = if h.health == NpuHealth::Ok && c.health != NpuHealth::Ok {
        &c.health
    } else {
        &h.health
    };
    let severe = health.is_severe();
    let info = h.error_info.trim();
    let mut present: Vec<Signal> = h
        .error_codes
        .iter()
        .map(|code| {
            let code = format!("{code:08X}");
            let mut msg = format!(
                "{id} reports error code {code} (health {})",
                health.as_str()
            );
            if !info.is_empty() && !info.eq_ignore_ascii_case("NA") {
                msg.push_str(": ");
                msg.push_str(info);
            }
            // A network code (link down) npu-smi reports on the chip is still a network fault,
            // as the device plugin files it by the code, not by where it was read.
            let network = faultline_core::catalog::ascend::is_network_code(&code);
            signal(
                FaultCode::Ascend {
                    code,
                    network,
                    severe,
                },
                id,
                msg,
            )
        })
        .collect();
    if present.is_empty() && severe {
        present.push(signal(
            FaultCode::named("NPU_UNHEALTHY"),
            id,
            format!("{id} health is {} with no error code", health.as_str()),
        ));
    }
    if *health == NpuHealth::Unknown {
        present.push(signal(
            FaultCode::named("NPU_LOST"),
            id,
            format!("{id} health is UNKNOWN (absent or not started)"),
        ));
    }
    level(id, DOMAIN_CHIP, present)
}

fn net_level(id: ChipId, n: &NetHealth) -> Observation {
    let present = if n.healthy {
        vec![]
    } else {
        vec![signal(
            FaultCode::named("NPU_NET_UNHEALTHY"),
            id,
            format!("{id} net health is {:?}", n.state),
        )]
    };
    level(id, DOMAIN_NET, present)
}

/// Down with the first few reasons, Idle when the tool is absent, else Running.
fn detector_from(name: &str, errors: &[String], absent: bool) -> Observation {
    if absent {
        return detector(name, DetectorState::Idle, Some(format!("{name} not found")));
    }
    if errors.is_empty() {
        return detector(name, DetectorState::Running, None);
    }
    let mut reason = errors[..errors.len().min(3)].join("; ");
    if errors.len() > 3 {
        reason.push_str(&format!("; and {} more", errors.len() - 3));
    }
    detector(name, DetectorState::Down, Some(reason))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;
    use std::time::Duration;

    fn chip(id: u32, health: NpuHealth) -> NpuChip {
        NpuChip {
            npu: id,
            chip: 0,
            phy_id: None,
            device: None,
            name: "910B3".into(),
            health,
            bus_id: None,
        }
    }

    fn health(h: NpuHealth, codes: &[u32]) -> ChipHealth {
        ChipHealth {
            health: h,
            error_codes: codes.to_vec(),
            error_info: String::new(),
        }
    }

    /// A call that failed with `why`.
    fn failed(why: &str) -> Unread {
        Unread::Tool {
            call: "npu-smi info".into(),
            source: ToolError::Io(why.into()),
        }
    }

    fn up() -> LinkPoll {
        LinkPoll {
            status: Ok(LinkStatus::Up),
            speed_mbps: None,
            up_count: None,
            net: Ok(NetHealth {
                state: "Success".into(),
                healthy: true,
            }),
        }
    }

    fn poll(n: u32) -> Poll {
        Poll {
            chips: Ok((0..n).map(|i| chip(i, NpuHealth::Ok)).collect()),
            health: (0..n)
                .map(|i| (i, Ok(health(NpuHealth::Ok, &[]))))
                .collect(),
            links: (0..n).map(|i| (i, up())).collect(),
            hccn_error: None,
            hccn_absent: false,
        }
    }

    /// `domain:device:codes` for every Level, `detector=state` for detectors.
    fn summary(obs: &[Observation]) -> Vec<String> {
        obs.iter()
            .filter_map(|o| match o {
                Observation::Level {
                    device,
                    domain,
                    present,
                    ..
                } => {
                    let codes: Vec<String> = present.iter().map(|s| s.code.to_string()).collect();
                    Some(format!(
                        "{domain}:{}:{}",
                        device
                            .as_ref()
                            .and_then(|d| d.name.as_deref())
                            .unwrap_or("?"),
                        codes.join(",")
                    ))
                }
                Observation::Detector { name, state, .. } => {
                    Some(format!("{name}={}", state.as_str()))
                }
                Observation::Signal(s) => Some(format!("signal:{}", s.code)),
                Observation::Inventory { names, .. } => Some(format!("inventory:{}", names.len())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn table() {
        let p = AscendPolicy::default();
        let t0 = Instant::now();
        type Case = (&'static str, Box<dyn Fn(&mut Poll)>, Vec<&'static str>);
        let cases: Vec<Case> = vec![
            (
                "healthy",
                Box::new(|_| {}),
                vec![
                    "inventory:2",
                    "npu-chip:Ascend910-0:",
                    "npu-link:Ascend910-0:",
                    "npu-net:Ascend910-0:",
                    "npu-chip:Ascend910-1:",
                    "npu-link:Ascend910-1:",
                    "npu-net:Ascend910-1:",
                    "npu-smi=Running",
                    "hccn_tool=Running",
                ],
            ),
            (
                "error codes and a port down",
                Box::new(|p| {
                    p.health
                        .insert(1, Ok(health(NpuHealth::Alarm, &[0x80E0_1801, 0x80C9_8008])));
                    p.links.get_mut(&0).unwrap().status = Ok(LinkStatus::Down);
                }),
                vec![
                    "inventory:2",
                    "npu-chip:Ascend910-0:",
                    "npu-link:Ascend910-0:81078603",
                    "npu-net:Ascend910-0:",
                    "npu-chip:Ascend910-1:80E01801,80C98008",
                    "npu-link:Ascend910-1:",
                    "npu-net:Ascend910-1:",
                    "npu-smi=Running",
                    "hccn_tool=Running",
                ],
            ),
            (
                "bad health without a code; unknown health; net fault",
                Box::new(|p| {
                    p.health.insert(0, Ok(health(NpuHealth::Critical, &[])));
                    p.health.insert(1, Ok(health(NpuHealth::Unknown, &[])));
                    p.links.get_mut(&1).unwrap().net = Ok(NetHealth {
                        state: "Receive timeout".into(),
                        healthy: false,
                    });
                }),
                vec![
                    "inventory:2",
                    "npu-chip:Ascend910-0:NPU_UNHEALTHY",
                    "npu-link:Ascend910-0:",
                    "npu-net:Ascend910-0:",
                    "npu-chip:Ascend910-1:NPU_LOST",
                    "npu-link:Ascend910-1:",
                    "npu-net:Ascend910-1:NPU_NET_UNHEALTHY",
                    "npu-smi=Running",
                    "hccn_tool=Running",
                ],
            ),
            (
                "a failed query sends no Level for its domain and downs the detector",
                Box::new(|p| {
                    p.health.insert(0, Err(failed("garbage")));
                    p.links.get_mut(&1).unwrap().status = Err(failed("no answer"));
                }),
                vec![
                    "inventory:2",
                    "npu-link:Ascend910-0:",
                    "npu-net:Ascend910-0:",
                    "npu-chip:Ascend910-1:",
                    "npu-net:Ascend910-1:",
                    "npu-smi=Down",
                    "hccn_tool=Down",
                ],
            ),
            (
                "npu-smi info failing says only that",
                Box::new(|p| p.chips = Err(failed("no chip rows found"))),
                vec!["npu-smi=Down"],
            ),
            (
                "no hccn_tool: links idle",
                Box::new(|p| {
                    p.links.clear();
                    p.hccn_absent = true;
                }),
                vec![
                    "inventory:2",
                    "npu-chip:Ascend910-0:",
                    "npu-chip:Ascend910-1:",
                    "npu-smi=Running",
                    "hccn_tool=Idle",
                ],
            ),
        ];
        for (name, edit, want) in cases {
            let mut a = Analyzer::default();
            let mut pl = poll(2);
            edit(&mut pl);
            assert_eq!(summary(&a.analyze(&pl, &p, t0)), want, "{name}");
        }
    }

    /// npu-smi reporting a link-down code on a chip: a network fault, as the device plugin files
    /// it (by the code), so it lands in the network list and its own `-Fault` element.
    #[test]
    fn a_network_code_on_a_chip_is_a_network_fault() {
        let p = AscendPolicy::default();
        let mut pl = poll(1);
        pl.health
            .insert(0, Ok(health(NpuHealth::Alarm, &[0x8107_8603, 0x80E0_1801])));
        let obs = Analyzer::default().analyze(&pl, &p, Instant::now());
        let flags: Vec<(String, bool)> = obs
            .iter()
            .filter_map(|o| match o {
                Observation::Level {
                    domain, present, ..
                } if domain == "npu-chip" => Some(present),
                _ => None,
            })
            .flatten()
            .filter_map(|s| match &s.code {
                FaultCode::Ascend { code, network, .. } => Some((code.clone(), *network)),
                _ => None,
            })
            .collect();
        assert_eq!(
            flags,
            [
                ("81078603".to_string(), true),
                ("80E01801".to_string(), false)
            ]
        );
    }

    /// 310P cards are named as MindCluster names them (`Ascend310P-<n>`, inventory kind
    /// `Ascend310P`), not as 910s.
    #[test]
    fn chips_are_named_by_their_family() {
        let p = AscendPolicy::default();
        let mut pl = poll(2);
        for c in pl.chips.as_mut().unwrap() {
            c.name = "310P3".into();
        }
        pl.links.clear();
        pl.hccn_absent = true;
        pl.health
            .insert(1, Ok(health(NpuHealth::Alarm, &[0x80E0_1801])));
        let obs = Analyzer::default().analyze(&pl, &p, Instant::now());
        assert_eq!(
            summary(&obs),
            [
                "inventory:2",
                "npu-chip:Ascend310P-0:",
                "npu-chip:Ascend310P-1:80E01801",
                "npu-smi=Running",
                "hccn_tool=Idle",
            ]
        );
        assert!(obs
            .iter()
            .any(|o| matches!(o, Observation::Inventory { kind, names }
            if kind == "Ascend310P" && names == &["Ascend310P-0", "Ascend310P-1"])));
    }

    #[test]
    fn vanished_chip_is_lost_and_stays_in_the_inventory() {
        let p = AscendPolicy::default();
        let mut a = Analyzer::default();
        let t0 = Instant::now();
        a.analyze(&poll(3), &p, t0);
        let mut pl = poll(3);
        pl.chips.as_mut().unwrap().remove(2);
        let s = summary(&a.analyze(&pl, &p, t0));
        assert_eq!(s[0], "signal:NPU_LOST");
        assert_eq!(s[1], "inventory:3");
    }

    #[test]
    fn flapping_and_speed() {
        let p = AscendPolicy {
            expected_speed_mbps: 200_000,
            ..AscendPolicy::default()
        };
        let mut a = Analyzer::default();
        let t0 = Instant::now();
        let with = |count: u64, speed: u64| {
            let mut pl = poll(1);
            let l = pl.links.get_mut(&0).unwrap();
            l.up_count = Some(Ok(count));
            l.speed_mbps = Some(Ok(speed));
            pl
        };
        let link = |obs: Vec<Observation>| {
            summary(&obs)
                .into_iter()
                .find(|s| s.starts_with("npu-link"))
                .unwrap()
        };
        assert_eq!(
            link(a.analyze(&with(10, 200_000), &p, t0)),
            "npu-link:Ascend910-0:"
        );
        let t1 = t0 + Duration::from_secs(60);
        assert_eq!(
            link(a.analyze(&with(13, 100_000), &p, t1)),
            "npu-link:Ascend910-0:NPU_LINK_SPEED_LOW,NPU_LINK_FLAPPING"
        );
        // Out of the window: the old samples no longer count.
        let t2 = t1 + Duration::from_secs(700);
        assert_eq!(
            link(a.analyze(&with(13, 200_000), &p, t2)),
            "npu-link:Ascend910-0:"
        );
    }
}
