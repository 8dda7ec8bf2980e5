//! The NVML analyzer: pure. Turns inventories, readings and events into engine observations.
//!
//! Conditions are level-triggered: every poll of a GPU sends one `Level` per reading that
//! succeeded (its domain from [`faultline_core::catalog::nvml`]), naming the conditions (lost
//! GPU, pending remap, link down, …) that reading shows now. The engine raises what is new and
//! ends what is gone; the analyzer keeps no list of what it raised, so a restart neither keeps
//! a condition that cleared while the agent was down nor counts one that stayed. A reading that
//! failed sends nothing (its conditions stay as they were): a lost GPU, which reads nothing
//! else, keeps its other conditions.
//!
//! Counters (uncorrectable ECC) add a signal for every increase seen between two polls of this
//! process; rates (NVLink errors, PCIe replays) compare a counter with its value one window ago,
//! and say a rate is low only once this process has watched for a whole window.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use faultline_core::catalog::{nvml, FaultCode};
use faultline_core::engine::{DeviceRef, Observation, Signal};
use faultline_core::policy::NvmlPolicy;
use faultline_core::record::Source;

use super::readings::{CallError, DeviceReadings, EventKind, Identity, NvmlEvent};

#[derive(Debug, Default)]
struct DevState {
    identity: Identity,
    ecc_volatile: Option<u64>,
    ecc_aggregate: Option<u64>,
    links_seen_active: BTreeSet<u32>,
    link_errors: BTreeMap<u32, VecDeque<(Instant, u64)>>,
    replays: VecDeque<(Instant, u64)>,
    /// When this process first read the NVLink error counters and the replay counter: a rate
    /// is known to be low only a whole window later.
    link_errors_since: Option<Instant>,
    replays_since: Option<Instant>,
    /// This process reported a link down: it knows that fault is its own to end, even while
    /// another link (never seen active) keeps the picture unsure.
    nvlink_down_reported: bool,
    /// Uncorrectable ECC errors were present at this process's previous poll.
    ecc_present: bool,
}

/// The analyzer's memory between passes (counter history only; no raised conditions).
#[derive(Debug, Default)]
pub(crate) struct Analyzer {
    devices: BTreeMap<u32, DevState>,
}

/// One poll's conditions of one reading, sent as a `Level`.
fn level(dref: &DeviceRef, domain: &str, present: Vec<Signal>) -> Observation {
    Observation::Level {
        source: Source::Nvml,
        device: Some(dref.clone()),
        domain: domain.to_string(),
        present,
    }
}

/// The domain of a condition this analyzer raises (every one is in the table).
fn domain_of(code: &str) -> &'static str {
    nvml::domain(code).unwrap_or("nvml")
}

fn device_ref(id: &Identity) -> DeviceRef {
    DeviceRef {
        pci: id.pci,
        uuid: id.uuid.clone(),
        index: Some(id.index),
        name: None,
    }
}

impl Analyzer {
    /// A GPU's identity (at start): names it for the engine.
    pub(crate) fn identity(&mut self, id: Identity) -> Vec<Observation> {
        let seen = id.pci.map(|pci| Observation::DeviceSeen {
            pci,
            uuid: id.uuid.clone(),
            index: Some(id.index),
        });
        let index = id.index;
        self.devices.entry(index).or_default().identity = id;
        seen.into_iter().collect()
    }

    /// The device count against the expected count (0, no expectation: nothing missing). An
    /// expectation not known yet (`None`) judges nothing: no level, so what the engine holds
    /// stays as it is.
    pub(crate) fn inventory(&mut self, count: u32, expected: Option<u32>) -> Vec<Observation> {
        let Some(expected) = expected else {
            return Vec::new();
        };
        let mut present = Vec::new();
        if expected > 0 && count < expected {
            let msg = format!("NVML sees {count} of the {expected} GPUs this node should have");
            present.push(Signal::new(
                Source::Nvml,
                FaultCode::named("GPU_MISSING"),
                None,
                msg,
            ));
        }
        // The node as the device: the fault's key is `node`.
        vec![level(
            &DeviceRef::default(),
            domain_of("GPU_MISSING"),
            present,
        )]
    }

    /// One polling pass over one GPU: a `Level` per reading that succeeded, and a signal per
    /// uncorrectable ECC increase seen since this process's previous pass.
    pub(crate) fn readings(
        &mut self,
        p: &NvmlPolicy,
        r: &DeviceReadings,
        now: Instant,
    ) -> Vec<Observation> {
        let mut out = Vec::new();
        let dev = self.devices.entry(r.index).or_insert_with(|| DevState {
            identity: Identity {
                index: r.index,
                ..Default::default()
            },
            ..Default::default()
        });
        let dref = device_ref(&dev.identity);
        let signal = |code: &str, msg: String| {
            Signal::new(
                Source::Nvml,
                FaultCode::named(code),
                Some(dref.clone()),
                msg,
            )
        };
        // `(domain, present)`; a reading that failed adds nothing.
        let mut levels: Vec<(&'static str, Vec<Signal>)> = Vec::new();
        let mut read = |code: &'static str, present: Option<Signal>| {
            let d = domain_of(code);
            match levels.iter_mut().find(|(dd, _)| *dd == d) {
                Some((_, v)) => v.extend(present),
                None => levels.push((d, present.into_iter().collect())),
            }
        };

        let lost = r.lost();
        // Every reading failed, none of them as lost: nothing is known about the GPU.
        if lost.is_some() || r.any_read() {
            read(
                "GPU_LOST",
                lost.map(|e| {
                    let what = if e == CallError::GpuLost {
                        "GPU_IS_LOST"
                    } else {
                        "RESET_REQUIRED"
                    };
                    signal("GPU_LOST", format!("NVML returns {what} for this GPU"))
                }),
            );
        }

        // Uncorrectable ECC: present while the volatile count is non-zero; every increase
        // between two passes of this process is counted.
        let mut ecc_growth = None;
        if let Ok(v) = r.ecc_volatile {
            let agg = r.ecc_aggregate.as_ref().ok().copied();
            let increase = match dev.ecc_volatile {
                Some(prev) if v > prev => v - prev,
                _ => 0,
            };
            let agg_increase = match (dev.ecc_aggregate, agg) {
                (Some(prev), Some(now_agg)) if now_agg > prev && increase == 0 => now_agg - prev,
                _ => 0,
            };
            let grew = increase.max(agg_increase);
            // Present at the previous pass too: the level keeps the fault and the growth is a
            // signal of its own. New now: the level raises it, counting the volatile errors.
            let was_present = dev.ecc_present;
            if grew > 0 && was_present {
                ecc_growth = Some(grew);
            }
            // A first reading counts the errors it finds; a later one only what is new (after an
            // operator's clear, the errors seen before are not counted again).
            let known = dev.ecc_volatile.is_some();
            dev.ecc_present = v > 0 || grew > 0;
            let present = dev.ecc_present.then(|| {
                let mut s = signal(
                    "ECC_UNCORRECTABLE",
                    format!(
                        "uncorrectable ECC errors: volatile {v}, aggregate {}",
                        agg.map_or("n/a".into(), |a| a.to_string())
                    ),
                );
                s.count = if known { grew.max(1) } else { v.max(1) };
                s
            });
            read("ECC_UNCORRECTABLE", present);
            dev.ecc_volatile = Some(v);
            dev.ecc_aggregate = agg.or(dev.ecc_aggregate);
        }
        if let Ok(pending) = r.pages_pending {
            read(
                "PAGE_RETIRE_PENDING",
                pending.then(|| {
                    signal(
                        "PAGE_RETIRE_PENDING",
                        "retired pages are pending: a GPU reset applies them".into(),
                    )
                }),
            );
        }
        if let Ok(m) = r.remap {
            read(
                "REMAP_FAILURE",
                (m.failure > 0).then(|| {
                    signal(
                        "REMAP_FAILURE",
                        format!(
                            "row remapping failed ({} uncorrectable rows remapped)",
                            m.uncorrectable
                        ),
                    )
                }),
            );
            read(
                "REMAP_PENDING",
                (m.pending > 0).then(|| {
                    signal(
                        "REMAP_PENDING",
                        "row remapping pending: a GPU reset applies it".into(),
                    )
                }),
            );
        }
        if let Ok(action) = r.recovery_action {
            let present = match action {
                1 => Some(("GPU_RESET_REQUIRED", "NVML recovery action: GPU reset")),
                2 => Some(("NODE_REBOOT_REQUIRED", "NVML recovery action: node reboot")),
                3 | 4 => Some((
                    "GPU_DRAIN_REQUIRED",
                    "NVML recovery action: drain work, then reset",
                )),
                _ => None,
            };
            read(
                "GPU_RESET_REQUIRED",
                present.map(|(code, msg)| signal(code, msg.into())),
            );
        }
        if let Ok(links) = &r.links {
            let mut down = Vec::new();
            // Inactive links never seen active by this process, with no expected count: a link
            // that is not cabled or one that went down before a restart; cannot tell which.
            let mut unsure = false;
            let mut errors_read = false;
            let mut noisy = Vec::new();
            let errors_since = *dev.link_errors_since.get_or_insert(now);
            for l in links {
                if l.active {
                    dev.links_seen_active.insert(l.link);
                }
                let expected = match p.nvlinks_expected {
                    Some(n) => l.link < n,
                    None => dev.links_seen_active.contains(&l.link),
                };
                if expected && !l.active {
                    down.push(l.link);
                }
                unsure |= !expected && !l.active;
                if let Ok(e) = l.errors {
                    errors_read = true;
                    let hist = dev.link_errors.entry(l.link).or_default();
                    let g = crate::source::counter_growth(hist, now, e, p.nvlink_error_window);
                    if g >= p.nvlink_error_threshold {
                        noisy.push((l.link, g));
                    }
                }
            }
            if let Some(n) = p.nvlinks_expected {
                // Links NVML did not even list are down too.
                let listed: BTreeSet<u32> = links.iter().map(|l| l.link).collect();
                down.extend((0..n).filter(|i| !listed.contains(i)));
            }
            if !down.is_empty() {
                let list: Vec<String> = down.iter().map(u32::to_string).collect();
                read(
                    "NVLINK_DOWN",
                    Some(signal(
                        "NVLINK_DOWN",
                        format!("NVLink {} not active", list.join(", ")),
                    )),
                );
            } else if !unsure || dev.nvlink_down_reported {
                read("NVLINK_DOWN", None);
            }
            dev.nvlink_down_reported = !down.is_empty();
            if !noisy.is_empty() {
                let list: Vec<String> = noisy
                    .iter()
                    .map(|(l, g)| format!("link {l} +{g}"))
                    .collect();
                read(
                    "NVLINK_ERRORS",
                    Some(signal(
                        "NVLINK_ERRORS",
                        format!(
                            "NVLink error counters grew within {}: {}",
                            humantime::format_duration(p.nvlink_error_window),
                            list.join(", ")
                        ),
                    )),
                );
            } else if errors_read
                && now.saturating_duration_since(errors_since) >= p.nvlink_error_window
            {
                read("NVLINK_ERRORS", None);
            }
        }
        if let Ok(pc) = r.pcie {
            let width = pc.max_width > 0 && pc.cur_width < pc.max_width;
            let gen = p.pcie_check_generation && pc.max_gen > 0 && pc.cur_gen < pc.max_gen;
            read(
                "PCIE_DEGRADED",
                (width || gen).then(|| {
                    signal(
                        "PCIE_DEGRADED",
                        format!(
                            "PCIe link Gen{} x{} (maximum Gen{} x{})",
                            pc.cur_gen, pc.cur_width, pc.max_gen, pc.max_width
                        ),
                    )
                }),
            );
        }
        if let Ok(c) = r.pcie_replay {
            let since = *dev.replays_since.get_or_insert(now);
            let g = crate::source::counter_growth(&mut dev.replays, now, c, p.pcie_replay_window);
            if g >= p.pcie_replay_threshold {
                read(
                    "PCIE_REPLAY_ERRORS",
                    Some(signal(
                        "PCIE_REPLAY_ERRORS",
                        format!(
                            "PCIe replay counter grew by {g} within {}",
                            humantime::format_duration(p.pcie_replay_window)
                        ),
                    )),
                );
            } else if now.saturating_duration_since(since) >= p.pcie_replay_window {
                read("PCIE_REPLAY_ERRORS", None);
            }
        }

        for (domain, present) in levels {
            out.push(level(&dref, domain, present));
        }
        if let Some(grew) = ecc_growth {
            let v = r.ecc_volatile.as_ref().ok().copied().unwrap_or(0);
            let mut s = signal(
                "ECC_UNCORRECTABLE",
                format!("uncorrectable ECC errors grew by {grew} (volatile {v})"),
            );
            s.count = grew;
            out.push(Observation::Signal(s));
        }
        out
    }

    /// An NVML event.
    pub(crate) fn event(&mut self, ev: &NvmlEvent) -> Vec<Observation> {
        let id = ev
            .index
            .and_then(|i| self.devices.get(&i))
            .map(|d| d.identity.clone());
        let dref = id.as_ref().map(device_ref).or_else(|| {
            ev.index.map(|i| DeviceRef {
                index: Some(i),
                ..Default::default()
            })
        });
        let (code, msg) = match ev.kind {
            EventKind::Xid(x) => (
                FaultCode::Xid(x.min(u64::from(u32::MAX)) as u32),
                format!("Xid {x} reported by NVML"),
            ),
            // The kernel log prints a double-bit ECC error as Xid 48: the same fault.
            EventKind::DoubleBitEcc => (
                FaultCode::Xid(48),
                "double-bit ECC error reported by NVML".to_string(),
            ),
        };
        vec![Observation::Signal(Signal::new(
            Source::Nvml,
            code,
            dref,
            msg,
        ))]
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::super::readings::{Link, Pcie, Remap};
    use super::*;
    use faultline_core::catalog::Catalog;
    use faultline_core::engine::{Ctx, Engine};
    use faultline_core::policy::Policy;
    use std::time::Duration;

    fn ok_readings(index: u32) -> DeviceReadings {
        DeviceReadings {
            index,
            ecc_volatile: Ok(0),
            ecc_aggregate: Ok(0),
            pages_pending: Ok(false),
            remap: Ok(Remap::default()),
            recovery_action: Ok(0),
            links: Ok((0..4)
                .map(|l| Link {
                    link: l,
                    active: true,
                    errors: Ok(0),
                })
                .collect()),
            pcie: Ok(Pcie {
                cur_gen: 5,
                max_gen: 5,
                cur_width: 16,
                max_width: 16,
            }),
            pcie_replay: Ok(0),
        }
    }

    fn identity() -> Identity {
        Identity {
            index: 0,
            uuid: Some("GPU-0".into()),
            pci: Some("0000:3b:00.0".parse().unwrap()),
            name: None,
        }
    }

    /// The analyzer feeding a real engine: what counts is what the record shows.
    struct Rig {
        a: Analyzer,
        engine: Engine,
        policy: Policy,
        catalog: Catalog,
        nvml: NvmlPolicy,
        t0: Instant,
        secs: u64,
    }

    impl Rig {
        fn new(nvml: NvmlPolicy) -> Rig {
            let mut r = Rig {
                a: Analyzer::default(),
                engine: Engine::new(),
                policy: Policy::parse("").unwrap(),
                catalog: Catalog::builtin().unwrap(),
                nvml,
                t0: Instant::now(),
                secs: 0,
            };
            let obs = r.a.identity(identity());
            r.apply(obs);
            r
        }

        /// The same engine (its saved state) with a new analyzer: an agent restart.
        fn restart(&mut self) {
            self.engine =
                serde_json::from_str(&serde_json::to_string(&self.engine).unwrap()).unwrap();
            self.a = Analyzer::default();
            let obs = self.a.identity(identity());
            self.apply(obs);
        }

        fn apply(&mut self, obs: Vec<Observation>) {
            let ctx = Ctx {
                policy: &self.policy,
                catalog: &self.catalog,
            };
            let now =
                faultline_core::time::Timestamp::from_second(1_790_000_000 + self.secs as i64)
                    .unwrap();
            for o in obs {
                self.engine.step(ctx, o, now);
            }
        }

        /// One poll, `dt` seconds after the last; the active faults as `CODExCOUNT`.
        fn poll_after(&mut self, dt: u64, r: &DeviceReadings) -> Vec<String> {
            self.secs += dt;
            let obs = self
                .a
                .readings(&self.nvml, r, self.t0 + Duration::from_secs(self.secs));
            self.apply(obs);
            self.active()
        }

        fn poll(&mut self, r: &DeviceReadings) -> Vec<String> {
            self.poll_after(1, r)
        }

        fn active(&self) -> Vec<String> {
            let mut v: Vec<String> = self
                .engine
                .faults()
                .filter(|f| f.fault.active)
                .map(|f| format!("{}x{}", f.fault.fault_code, f.fault.count))
                .collect();
            v.sort();
            v
        }
    }

    type Mutate = fn(&mut DeviceReadings);

    /// Each condition: a change to healthy readings that shows it.
    const CONDITIONS: &[(&str, Mutate)] = &[
        ("GPU_LOST", |r| {
            *r = DeviceReadings::all_failed(0, CallError::GpuLost)
        }),
        ("PAGE_RETIRE_PENDING", |r| r.pages_pending = Ok(true)),
        ("REMAP_PENDING", |r| {
            r.remap = Ok(Remap {
                pending: 1,
                ..Default::default()
            })
        }),
        ("REMAP_FAILURE", |r| {
            r.remap = Ok(Remap {
                failure: 1,
                ..Default::default()
            })
        }),
        ("GPU_RESET_REQUIRED", |r| r.recovery_action = Ok(1)),
        ("NODE_REBOOT_REQUIRED", |r| r.recovery_action = Ok(2)),
        ("GPU_DRAIN_REQUIRED", |r| r.recovery_action = Ok(4)),
        ("NVLINK_DOWN", |r| {
            if let Ok(l) = &mut r.links {
                l[2].active = false;
            }
        }),
        ("PCIE_DEGRADED", |r| {
            r.pcie = Ok(Pcie {
                cur_gen: 5,
                max_gen: 5,
                cur_width: 8,
                max_width: 16,
            })
        }),
        ("ECC_UNCORRECTABLE", |r| {
            r.ecc_volatile = Ok(1);
            r.ecc_aggregate = Ok(1);
        }),
    ];

    fn bad(mutate: Mutate) -> DeviceReadings {
        let mut r = ok_readings(0);
        mutate(&mut r);
        r
    }

    #[test]
    fn every_condition_has_its_domain() {
        for (code, _) in CONDITIONS {
            assert!(nvml::domain(code).is_some(), "{code}");
        }
    }

    /// Each condition: raised once, not counted again while it lasts, ended when it goes.
    #[test]
    fn conditions_raise_once_and_resolve() {
        for (code, mutate) in CONDITIONS {
            let mut r = Rig::new(NvmlPolicy::default());
            assert!(r.poll(&ok_readings(0)).is_empty(), "{code}: healthy start");
            let want = vec![format!("{code}x1")];
            assert_eq!(r.poll(&bad(*mutate)), want, "{code}");
            assert_eq!(
                r.poll(&bad(*mutate)),
                want,
                "{code}: no recount while it lasts"
            );
            assert!(r.poll(&ok_readings(0)).is_empty(), "{code}: ends");
        }
    }

    /// A restart (new analyzer, engine from saved state) while a condition holds: one poll later
    /// it has ended if it cleared while the agent was down, and it is still one fault with the
    /// same count if it stayed (neither kept forever nor counted again).
    #[test]
    fn a_restart_neither_keeps_a_cleared_condition_nor_recounts_one_that_stayed() {
        for (code, mutate) in CONDITIONS {
            let mut r = Rig::new(NvmlPolicy::default());
            r.poll(&ok_readings(0));
            r.poll(&bad(*mutate));
            r.restart();
            assert_eq!(
                r.poll(&bad(*mutate)),
                vec![format!("{code}x1")],
                "{code}: stayed across the restart"
            );
            r.restart();
            assert!(
                r.poll(&ok_readings(0)).is_empty(),
                "{code}: cleared while the agent was down"
            );
        }
    }

    #[test]
    fn ecc_counts_every_increase_once() {
        let mut r = Rig::new(NvmlPolicy::default());
        r.poll(&ok_readings(0));
        let ecc = |v: u64| {
            let mut x = ok_readings(0);
            x.ecc_volatile = Ok(v);
            x.ecc_aggregate = Ok(v);
            x
        };
        assert_eq!(r.poll(&ecc(2)), ["ECC_UNCORRECTABLEx2"]);
        assert_eq!(r.poll(&ecc(5)), ["ECC_UNCORRECTABLEx5"]);
        assert_eq!(r.poll(&ecc(5)), ["ECC_UNCORRECTABLEx5"]);
        // A restart: the count already seen is not added again; growth after it is.
        r.restart();
        assert_eq!(r.poll(&ecc(5)), ["ECC_UNCORRECTABLEx5"]);
        assert_eq!(r.poll(&ecc(6)), ["ECC_UNCORRECTABLEx6"]);
        // A GPU reset clears the volatile count.
        let mut reset = ecc(0);
        reset.ecc_aggregate = Ok(6);
        assert!(r.poll(&reset).is_empty());
    }

    #[test]
    fn not_supported_is_never_a_fault() {
        let mut r = Rig::new(NvmlPolicy::default());
        assert!(r
            .poll(&DeviceReadings::all_failed(0, CallError::NotSupported))
            .is_empty());
        assert!(r
            .poll(&DeviceReadings::all_failed(
                0,
                CallError::Other("Unknown Error".into())
            ))
            .is_empty());
    }

    /// A reading that fails leaves its conditions as they were (no level is sent for it).
    #[test]
    fn a_failed_reading_ends_nothing() {
        let mut r = Rig::new(NvmlPolicy::default());
        let mut x = ok_readings(0);
        x.pages_pending = Ok(true);
        assert_eq!(r.poll(&x), ["PAGE_RETIRE_PENDINGx1"]);
        x.pages_pending = Err(CallError::Other("Unknown Error".into()));
        assert_eq!(r.poll(&x), ["PAGE_RETIRE_PENDINGx1"]);
    }

    #[test]
    fn expected_links_catch_links_down_from_the_start() {
        let mut r = Rig::new(NvmlPolicy {
            nvlinks_expected: Some(6),
            ..Default::default()
        });
        // Only links 0..4 listed, all active: 4 and 5 are missing.
        assert_eq!(r.poll(&ok_readings(0)), ["NVLINK_DOWNx1"]);
        let msg = r.engine.faults().next().unwrap().fault.message.clone();
        assert!(msg.contains("4, 5"), "{msg}");
    }

    /// Without an expected count, a link never seen active is not known to be cabled: after a
    /// restart with a link still down, the fault stays (not ended by a guess); once it is up,
    /// it ends.
    #[test]
    fn a_link_still_down_after_a_restart_stays_down() {
        let mut r = Rig::new(NvmlPolicy::default());
        r.poll(&ok_readings(0));
        let down = bad(|r| {
            if let Ok(l) = &mut r.links {
                l[2].active = false;
            }
        });
        assert_eq!(r.poll(&down), ["NVLINK_DOWNx1"]);
        r.restart();
        assert_eq!(r.poll(&down), ["NVLINK_DOWNx1"]);
        assert_eq!(r.poll(&down), ["NVLINK_DOWNx1"]);
        assert!(r.poll(&ok_readings(0)).is_empty());
    }

    /// A GPU with a link that was never active (uncabled, or dead before the agent started):
    /// another link that goes down and comes back is still ended by this process.
    #[test]
    fn a_link_that_comes_back_ends_its_fault_beside_a_never_active_link() {
        let mut r = Rig::new(NvmlPolicy::default());
        let with = |down: Option<usize>| {
            let mut x = ok_readings(0);
            if let Ok(l) = &mut x.links {
                l.push(Link {
                    link: 4,
                    active: false,
                    errors: Ok(0),
                });
                if let Some(d) = down {
                    l[d].active = false;
                }
            }
            x
        };
        assert!(r.poll(&with(None)).is_empty(), "never active: not a fault");
        assert_eq!(r.poll(&with(Some(2))), ["NVLINK_DOWNx1"]);
        assert!(r.poll(&with(None)).is_empty(), "link 2 is back");
    }

    /// Readings that all fail without saying the GPU is lost tell nothing: a lost GPU stays lost.
    #[test]
    fn failed_readings_do_not_end_a_lost_gpu() {
        let mut r = Rig::new(NvmlPolicy::default());
        r.poll(&DeviceReadings::all_failed(0, CallError::GpuLost));
        assert_eq!(
            r.poll(&DeviceReadings::all_failed(
                0,
                CallError::Other("Unknown Error".into())
            )),
            ["GPU_LOSTx1"]
        );
        assert!(r.poll(&ok_readings(0)).is_empty());
    }

    /// Uncorrectable ECC errors an operator cleared are not counted again when the fault comes
    /// back at the next poll; growth of the aggregate count alone is counted at every poll.
    #[test]
    fn ecc_after_an_operator_clear_and_aggregate_growth() {
        let mut r = Rig::new(NvmlPolicy::default());
        let ecc = |v: u64, agg: u64| {
            let mut x = ok_readings(0);
            x.ecc_volatile = Ok(v);
            x.ecc_aggregate = Ok(agg);
            x
        };
        r.poll(&ecc(0, 0));
        assert_eq!(r.poll(&ecc(4, 4)), ["ECC_UNCORRECTABLEx4"]);
        let ctx = Ctx {
            policy: &r.policy,
            catalog: &r.catalog,
        };
        let now = faultline_core::time::Timestamp::from_second(1_790_000_100).unwrap();
        r.engine.step(
            ctx,
            Observation::OperatorClear {
                code: None,
                device: None,
            },
            now,
        );
        assert!(r.active().is_empty());
        assert_eq!(
            r.poll(&ecc(4, 4)),
            ["ECC_UNCORRECTABLEx5"],
            "back as one occurrence, not four more"
        );
        // A reset: volatile 0; the aggregate grows twice in a row.
        assert!(r.poll(&ecc(0, 4)).is_empty());
        assert_eq!(
            r.poll(&ecc(0, 6)),
            ["ECC_UNCORRECTABLEx7"],
            "two new errors"
        );
        assert_eq!(r.poll(&ecc(0, 9)), ["ECC_UNCORRECTABLEx10"], "three more");
    }

    #[test]
    fn error_rates_over_a_window() {
        let mut r = Rig::new(NvmlPolicy {
            nvlink_error_threshold: 100,
            nvlink_error_window: Duration::from_secs(600),
            ..Default::default()
        });
        let with = |e: u64, replay: u64| {
            let mut r = ok_readings(0);
            if let Ok(l) = &mut r.links {
                l[1].errors = Ok(e);
            }
            r.pcie_replay = Ok(replay);
            r
        };
        assert!(
            r.poll(&with(1000, 0)).is_empty(),
            "a high counter at start is history, not a rate"
        );
        assert!(r.poll_after(300, &with(1050, 50)).is_empty());
        assert_eq!(
            r.poll_after(290, &with(1100, 100)),
            ["NVLINK_ERRORSx1", "PCIE_REPLAY_ERRORSx1"]
        );
        // A restart: the rate is unknown until a whole window is watched again, so the faults
        // stay (not ended by a guess, not counted again)...
        r.restart();
        assert_eq!(
            r.poll_after(10, &with(1101, 100)),
            ["NVLINK_ERRORSx1", "PCIE_REPLAY_ERRORSx1"]
        );
        // ...and end when the growth over a whole window is small.
        assert!(r.poll_after(700, &with(1110, 101)).is_empty());
    }

    #[test]
    fn generation_check_is_opt_in() {
        let mut x = ok_readings(0);
        x.pcie = Ok(Pcie {
            cur_gen: 1,
            max_gen: 5,
            cur_width: 16,
            max_width: 16,
        });
        let mut r = Rig::new(NvmlPolicy::default());
        assert!(r.poll(&x).is_empty(), "idle GPUs drop to Gen1");
        let mut r = Rig::new(NvmlPolicy {
            pcie_check_generation: true,
            ..Default::default()
        });
        assert_eq!(r.poll(&x), ["PCIE_DEGRADEDx1"]);
    }

    #[test]
    fn lost_gpu_keeps_its_other_conditions() {
        let mut r = Rig::new(NvmlPolicy::default());
        let mut x = ok_readings(0);
        x.remap = Ok(Remap {
            pending: 1,
            ..Default::default()
        });
        r.poll(&x);
        assert_eq!(
            r.poll(&DeviceReadings::all_failed(0, CallError::GpuLost)),
            ["GPU_LOSTx1", "REMAP_PENDINGx1"],
            "REMAP_PENDING is not resolved by silence"
        );
        assert_eq!(r.poll(&x), ["REMAP_PENDINGx1"]);
    }

    #[test]
    fn inventory_and_events() {
        let mut r = Rig::new(NvmlPolicy::default());
        let inv = |r: &mut Rig, n, want| {
            let obs = r.a.inventory(n, want);
            r.apply(obs);
            r.active()
        };
        assert!(
            inv(&mut r, 8, Some(0)).is_empty(),
            "no expectation, no check"
        );
        assert_eq!(inv(&mut r, 7, Some(8)), ["GPU_MISSINGx1"]);
        assert_eq!(inv(&mut r, 7, Some(8)), ["GPU_MISSINGx1"]);
        r.restart();
        // Just restarted: the expectation is not known yet (the label unread, the policy
        // loading). The restored fault is neither ended nor, once it is known, counted again.
        assert_eq!(
            inv(&mut r, 7, None),
            ["GPU_MISSINGx1"],
            "an unknown expectation ends nothing"
        );
        assert_eq!(
            inv(&mut r, 7, Some(8)),
            ["GPU_MISSINGx1"],
            "not counted again"
        );
        assert!(inv(&mut r, 8, Some(8)).is_empty());
        assert_eq!(
            r.engine.faults().next().unwrap().fault.device,
            "node",
            "the node, as before levels"
        );
        let out = r.a.event(&NvmlEvent {
            index: Some(0),
            kind: EventKind::Xid(79),
        });
        let Observation::Signal(s) = &out[0] else {
            panic!()
        };
        assert_eq!(s.code, FaultCode::Xid(79));
        let d = s.device.clone().unwrap();
        assert_eq!(
            d.pci.map(|p| p.to_string()).as_deref(),
            Some("0000:3b:00.0"),
            "same key as the kernel log's Xid"
        );
        let out = r.a.event(&NvmlEvent {
            index: Some(0),
            kind: EventKind::DoubleBitEcc,
        });
        let Observation::Signal(s) = &out[0] else {
            panic!()
        };
        assert_eq!(s.code, FaultCode::Xid(48));
    }
}
