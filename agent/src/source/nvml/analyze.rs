//! The NVML analyzer: pure. Turns inventories, readings and events into engine observations.
//!
//! Conditions are level-triggered: a condition (lost GPU, pending remap, link down, …) raises
//! a signal when it appears and a `Resolved` when it goes away; counters (uncorrectable ECC)
//! raise a signal for every increase; rates (NVLink errors, PCIe replays) compare a counter with
//! its value one window ago.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use faultline_core::catalog::FaultCode;
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
    /// Conditions currently raised for this device.
    raised: BTreeSet<&'static str>,
}

/// The analyzer's memory between passes.
#[derive(Debug, Default)]
pub struct Analyzer {
    devices: BTreeMap<u32, DevState>,
    missing_raised: bool,
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
    pub fn new() -> Self {
        Analyzer::default()
    }

    /// A GPU's identity (at start): names it for the engine.
    pub fn identity(&mut self, id: Identity) -> Vec<Observation> {
        let mut out = Vec::new();
        if let Some(pci) = id.pci {
            out.push(Observation::DeviceSeen {
                pci,
                uuid: id.uuid.clone(),
                index: Some(id.index),
            });
        }
        let index = id.index;
        self.devices.entry(index).or_default().identity = id;
        out
    }

    /// The device count against the expected count.
    pub fn inventory(&mut self, count: u32, expected: u32) -> Vec<Observation> {
        let missing = expected > 0 && count < expected;
        let code = FaultCode::named("GPU_MISSING");
        match (missing, self.missing_raised) {
            (true, false) => {
                self.missing_raised = true;
                let msg = format!("NVML sees {count} of the {expected} GPUs this node should have");
                vec![Observation::Signal(Signal::new(
                    Source::Nvml,
                    code,
                    None,
                    msg,
                ))]
            }
            (false, true) => {
                self.missing_raised = false;
                vec![Observation::Resolved {
                    source: Source::Nvml,
                    code,
                    device: None,
                }]
            }
            _ => Vec::new(),
        }
    }

    /// One polling pass over one GPU.
    pub fn readings(
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
        let mut want: BTreeMap<&'static str, String> = BTreeMap::new();

        if let Some(e) = r.lost() {
            let what = if e == CallError::GpuLost {
                "GPU_IS_LOST"
            } else {
                "RESET_REQUIRED"
            };
            want.insert("GPU_LOST", format!("NVML returns {what} for this GPU"));
        }

        // Uncorrectable ECC: raised while the volatile count is non-zero, counted per increase.
        if let Ok(v) = r.ecc_volatile {
            let agg = r.ecc_aggregate.as_ref().ok().copied();
            let increase = match dev.ecc_volatile {
                Some(prev) if v > prev => v - prev,
                Some(_) => 0,
                None => v,
            };
            let agg_increase = match (dev.ecc_aggregate, agg) {
                (Some(prev), Some(now_agg)) if now_agg > prev && increase == 0 => now_agg - prev,
                _ => 0,
            };
            let grew = increase.max(agg_increase);
            if grew > 0 && dev.raised.contains("ECC_UNCORRECTABLE") {
                let mut s = Signal::new(
                    Source::Nvml,
                    FaultCode::named("ECC_UNCORRECTABLE"),
                    Some(dref.clone()),
                    format!("uncorrectable ECC errors grew by {grew} (volatile {v})"),
                );
                s.count = grew;
                out.push(Observation::Signal(s));
            }
            if v > 0 || grew > 0 {
                want.insert(
                    "ECC_UNCORRECTABLE",
                    format!(
                        "uncorrectable ECC errors: volatile {v}, aggregate {}",
                        agg.map_or("n/a".into(), |a| a.to_string())
                    ),
                );
            }
            dev.ecc_volatile = Some(v);
            if agg.is_some() {
                dev.ecc_aggregate = agg;
            }
        }
        if r.pages_pending == Ok(true) {
            want.insert(
                "PAGE_RETIRE_PENDING",
                "retired pages are pending: a GPU reset applies them".into(),
            );
        }
        if let Ok(m) = r.remap {
            if m.failure > 0 {
                want.insert(
                    "REMAP_FAILURE",
                    format!(
                        "row remapping failed ({} uncorrectable rows remapped)",
                        m.uncorrectable
                    ),
                );
            }
            if m.pending > 0 {
                want.insert(
                    "REMAP_PENDING",
                    "row remapping pending: a GPU reset applies it".into(),
                );
            }
        }
        match r.recovery_action {
            Ok(1) => {
                want.insert(
                    "GPU_RESET_REQUIRED",
                    "NVML recovery action: GPU reset".into(),
                );
            }
            Ok(2) => {
                want.insert(
                    "NODE_REBOOT_REQUIRED",
                    "NVML recovery action: node reboot".into(),
                );
            }
            Ok(3) | Ok(4) => {
                want.insert(
                    "GPU_DRAIN_REQUIRED",
                    "NVML recovery action: drain work, then reset".into(),
                );
            }
            _ => {}
        }
        if let Ok(links) = &r.links {
            let mut down = Vec::new();
            let mut noisy = Vec::new();
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
                if let Ok(e) = l.errors {
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
                want.insert(
                    "NVLINK_DOWN",
                    format!("NVLink {} not active", list.join(", ")),
                );
            }
            if !noisy.is_empty() {
                let list: Vec<String> = noisy
                    .iter()
                    .map(|(l, g)| format!("link {l} +{g}"))
                    .collect();
                want.insert(
                    "NVLINK_ERRORS",
                    format!(
                        "NVLink error counters grew within {}: {}",
                        humantime::format_duration(p.nvlink_error_window),
                        list.join(", ")
                    ),
                );
            }
        }
        if let Ok(pc) = r.pcie {
            let width = pc.max_width > 0 && pc.cur_width < pc.max_width;
            let gen = p.pcie_check_generation && pc.max_gen > 0 && pc.cur_gen < pc.max_gen;
            if width || gen {
                want.insert(
                    "PCIE_DEGRADED",
                    format!(
                        "PCIe link Gen{} x{} (maximum Gen{} x{})",
                        pc.cur_gen, pc.cur_width, pc.max_gen, pc.max_width
                    ),
                );
            }
        }
        if let Ok(c) = r.pcie_replay {
            let g = crate::source::counter_growth(&mut dev.replays, now, c, p.pcie_replay_window);
            if g >= p.pcie_replay_threshold {
                want.insert(
                    "PCIE_REPLAY_ERRORS",
                    format!(
                        "PCIe replay counter grew by {g} within {}",
                        humantime::format_duration(p.pcie_replay_window)
                    ),
                );
            }
        }

        // Edges. A lost GPU reads nothing else, so its other conditions stay as they were.
        let lost = want.contains_key("GPU_LOST");
        for (code, msg) in &want {
            if dev.raised.insert(code) {
                let mut s = Signal::new(
                    Source::Nvml,
                    FaultCode::named(code),
                    Some(dref.clone()),
                    msg.clone(),
                );
                if *code == "ECC_UNCORRECTABLE" {
                    s.count = r.ecc_volatile.as_ref().ok().copied().unwrap_or(1).max(1);
                }
                out.push(Observation::Signal(s));
            }
        }
        let gone: Vec<&'static str> = dev
            .raised
            .iter()
            .copied()
            .filter(|c| !want.contains_key(c) && (!lost || *c == "GPU_LOST"))
            .collect();
        for code in gone {
            dev.raised.remove(code);
            out.push(Observation::Resolved {
                source: Source::Nvml,
                code: FaultCode::named(code),
                device: Some(dref.clone()),
            });
        }
        out
    }

    /// An NVML event.
    pub fn event(&mut self, ev: &NvmlEvent) -> Vec<Observation> {
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
    use super::super::readings::{Link, Pcie, Remap};
    use super::*;
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

    fn codes(obs: &[Observation]) -> Vec<String> {
        obs.iter()
            .map(|o| match o {
                Observation::Signal(s) => format!("+{}x{}", s.code, s.count),
                Observation::Resolved { code, .. } => format!("-{code}"),
                other => format!("{other:?}"),
            })
            .collect()
    }

    fn analyzer() -> (Analyzer, Instant) {
        let mut a = Analyzer::new();
        a.identity(Identity {
            index: 0,
            uuid: Some("GPU-0".into()),
            pci: Some("0000:3b:00.0".parse().unwrap()),
            name: None,
        });
        (a, Instant::now())
    }

    /// Each row: a change to healthy readings, and the edges it must raise then clear.
    #[test]
    fn conditions_raise_once_and_resolve() {
        type Mutate = fn(&mut DeviceReadings);
        let rows: &[(&str, Mutate)] = &[
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
        ];
        let p = NvmlPolicy::default();
        for (code, mutate) in rows {
            let (mut a, t) = analyzer();
            assert!(
                a.readings(&p, &ok_readings(0), t).is_empty(),
                "{code}: healthy start"
            );
            let mut bad = ok_readings(0);
            mutate(&mut bad);
            let raised = codes(&a.readings(&p, &bad, t));
            assert_eq!(raised, vec![format!("+{code}x1")], "{code}");
            assert!(
                a.readings(&p, &bad, t).is_empty(),
                "{code}: no repeat while it lasts"
            );
            assert_eq!(
                codes(&a.readings(&p, &ok_readings(0), t)),
                vec![format!("-{code}")],
                "{code}"
            );
        }
    }

    #[test]
    fn ecc_counts_every_increase() {
        let (mut a, t) = analyzer();
        let p = NvmlPolicy::default();
        a.readings(&p, &ok_readings(0), t);
        let mut r = ok_readings(0);
        r.ecc_volatile = Ok(2);
        r.ecc_aggregate = Ok(2);
        assert_eq!(codes(&a.readings(&p, &r, t)), vec!["+ECC_UNCORRECTABLEx2"]);
        r.ecc_volatile = Ok(5);
        r.ecc_aggregate = Ok(5);
        assert_eq!(codes(&a.readings(&p, &r, t)), vec!["+ECC_UNCORRECTABLEx3"]);
        assert!(a.readings(&p, &r, t).is_empty());
        // A GPU reset clears the volatile count.
        r.ecc_volatile = Ok(0);
        assert_eq!(codes(&a.readings(&p, &r, t)), vec!["-ECC_UNCORRECTABLE"]);
    }

    #[test]
    fn not_supported_is_never_a_fault() {
        let (mut a, t) = analyzer();
        let p = NvmlPolicy::default();
        let r = DeviceReadings::all_failed(0, CallError::NotSupported);
        assert!(a.readings(&p, &r, t).is_empty());
        let r = DeviceReadings::all_failed(0, CallError::Other("Unknown Error".into()));
        assert!(a.readings(&p, &r, t).is_empty());
    }

    #[test]
    fn expected_links_catch_links_down_from_the_start() {
        let (mut a, t) = analyzer();
        let p = NvmlPolicy {
            nvlinks_expected: Some(6),
            ..Default::default()
        };
        // Only links 0..4 listed, all active: 4 and 5 are missing.
        let out = a.readings(&p, &ok_readings(0), t);
        assert_eq!(codes(&out), vec!["+NVLINK_DOWNx1"]);
        let Observation::Signal(s) = &out[0] else {
            panic!()
        };
        assert!(s.message.contains("4, 5"), "{}", s.message);
    }

    #[test]
    fn error_rates_over_a_window() {
        let (mut a, t) = analyzer();
        let p = NvmlPolicy {
            nvlink_error_threshold: 100,
            nvlink_error_window: Duration::from_secs(600),
            ..Default::default()
        };
        let with = |e: u64, replay: u64| {
            let mut r = ok_readings(0);
            if let Ok(l) = &mut r.links {
                l[1].errors = Ok(e);
            }
            r.pcie_replay = Ok(replay);
            r
        };
        let s = Duration::from_secs;
        assert!(
            a.readings(&p, &with(1000, 0), t).is_empty(),
            "a high counter at start is history, not a rate"
        );
        assert!(a.readings(&p, &with(1050, 50), t + s(300)).is_empty());
        assert_eq!(
            codes(&a.readings(&p, &with(1100, 100), t + s(590))),
            vec!["+NVLINK_ERRORSx1", "+PCIE_REPLAY_ERRORSx1"]
        );
        // Ten minutes later the growth over the window is small again.
        assert_eq!(
            codes(&a.readings(&p, &with(1110, 101), t + s(1300))),
            vec!["-NVLINK_ERRORS", "-PCIE_REPLAY_ERRORS"]
        );
    }

    #[test]
    fn generation_check_is_opt_in() {
        let (mut a, t) = analyzer();
        let mut r = ok_readings(0);
        r.pcie = Ok(Pcie {
            cur_gen: 1,
            max_gen: 5,
            cur_width: 16,
            max_width: 16,
        });
        assert!(
            a.readings(&NvmlPolicy::default(), &r, t).is_empty(),
            "idle GPUs drop to Gen1"
        );
        let p = NvmlPolicy {
            pcie_check_generation: true,
            ..Default::default()
        };
        assert_eq!(codes(&a.readings(&p, &r, t)), vec!["+PCIE_DEGRADEDx1"]);
    }

    #[test]
    fn lost_gpu_keeps_its_other_conditions() {
        let (mut a, t) = analyzer();
        let p = NvmlPolicy::default();
        let mut r = ok_readings(0);
        r.remap = Ok(Remap {
            pending: 1,
            ..Default::default()
        });
        a.readings(&p, &r, t);
        let out = a.readings(&p, &DeviceReadings::all_failed(0, CallError::GpuLost), t);
        assert_eq!(
            codes(&out),
            vec!["+GPU_LOSTx1"],
            "REMAP_PENDING is not resolved by silence"
        );
    }

    #[test]
    fn inventory_and_events() {
        let (mut a, _) = analyzer();
        assert!(a.inventory(8, 0).is_empty(), "no expectation, no check");
        assert_eq!(codes(&a.inventory(7, 8)), vec!["+GPU_MISSINGx1"]);
        assert!(a.inventory(7, 8).is_empty());
        assert_eq!(codes(&a.inventory(8, 8)), vec!["-GPU_MISSING"]);
        let out = a.event(&NvmlEvent {
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
        let out = a.event(&NvmlEvent {
            index: Some(0),
            kind: EventKind::DoubleBitEcc,
        });
        assert_eq!(codes(&out), vec!["+Xid48x1"]);
    }
}
