//! Parser throughput: kernel log lines per second on one core, over a mixed corpus.
//!
//! The corpus is every line of tests/fixtures/kernel-lines.yaml (matching and not) plus
//! ordinary kernel chatter, shaped like a busy node's log: about 1 line in 20 is a fault
//! signal. Each run feeds the whole corpus through `KmsgReader::feed` (record parse, message
//! parse, observation), then also through the engine, with 0, 100 and 1,000 standing faults
//! (active faults from earlier, on other GPUs) in the engine. Reports the median of 11 runs; the
//! three engine figures alternate within each run, so their ratio is from one run.
//!
//! `cargo bench -p faultline-core --bench parser`

#![allow(clippy::unwrap_used)]
// benchmark harness: a panic is the failure report
// A benchmark times itself and reads its corpus: the purity rules are for the library.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::Instant;

use faultline_core::catalog::Catalog;
use faultline_core::engine::{Ctx, DeviceRef, Engine, Input, Observation, Signal};
use faultline_core::kmsg_reader::{KmsgReader, Tally};
use faultline_core::policy::Policy;
use faultline_core::record::Source;

const NOISE: &[&str] = &[
    "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
    "EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Quota mode: none.",
    "systemd[1]: Started Session 42 of user root.",
    "audit: type=1400 audit(1700000000.123:42): apparmor=\"STATUS\" operation=\"profile_load\"",
    "nvidia-uvm: Loaded the UVM driver, major device number 508.",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "mlx5_core 0000:1f:00.0: mlx5_pcie_event:301:(pid 1234): PCIe slot advertised sufficient power (27W).",
    "br-1234: port 2(veth5678) entered forwarding state",
    "TCP: request_sock_TCP: Possible SYN flooding on port 8080. Sending cookies.",
    "pcieport 0000:00:01.0: AER: Corrected error received: 0000:01:00.0",
];

fn corpus() -> Vec<Vec<u8>> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/kernel-lines.yaml"
    );
    let text = std::fs::read_to_string(path).expect("corpus");
    let cases: Vec<serde_json::Value> = serde_saphyr::from_str(&text).expect("corpus parses");
    let fixture: Vec<String> = cases
        .iter()
        .filter_map(|c| c["line"].as_str().map(|l| l.replace('\n', " ")))
        .collect();
    let mut lines = Vec::new();
    let mut seq = 0u64;
    for round in 0..200 {
        for f in &fixture {
            // One fixture line, then 19 noise lines.
            seq += 1;
            lines.push(format!("4,{seq},{},-;{f}", seq * 10).into_bytes());
            for k in 0..19 {
                seq += 1;
                let n = NOISE[(k + round) % NOISE.len()];
                lines.push(format!("6,{seq},{},-;{n}", seq * 10).into_bytes());
            }
        }
    }
    lines
}

/// Numbers of standing faults the engine holds before the corpus is fed.
const STANDING: [usize; 3] = [0, 100, 1000];

/// An engine holding `n` active faults (NVML conditions on GPUs the corpus never names).
fn engine_with(n: usize, ctx: Ctx<'_>, now: jiff::Timestamp) -> Engine {
    let codes = [
        "PCIE_DEGRADED",
        "NVLINK_ERRORS",
        "REMAP_PENDING",
        "PAGE_RETIRE_PENDING",
    ];
    let mut e = Engine::new();
    for i in 0..n {
        let pci = format!("0002:{:02x}:{:02x}.0", i / 32 % 256, i % 32)
            .parse()
            .unwrap();
        let s = Signal::new(
            Source::Nvml,
            faultline_core::catalog::FaultCode::named(codes[i / 8192 % codes.len()]),
            Some(DeviceRef::pci(pci)),
            "standing",
        );
        e.step(ctx, Observation::Signal(s), now);
    }
    assert_eq!(e.faults().filter(|f| f.fault.active).count(), n);
    e
}

/// A storm: every line a fault (Xid 31 rotating over 8 GPUs, an Xid 79 every 1,000 lines),
/// as in the side-by-side measurement on /dev/kmsg.
fn storm() -> Vec<Vec<u8>> {
    (0..200_000u64)
        .map(|seq| {
            let bus = 0x1a + (seq % 8) * 0x20;
            let msg = if seq % 1000 == 999 {
                format!("NVRM: Xid (PCI:0000:{bus:02x}:00): 79, pid=0, GPU has fallen off the bus.")
            } else {
                format!("NVRM: Xid (PCI:0000:{bus:02x}:00): 31, pid=1234, name=python, Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12345000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ")
            };
            format!("3,{},{},-;{msg}", seq + 1, (seq + 1) * 10).into_bytes()
        })
        .collect()
}

/// Parse + engine over `lines`, with `n` standing faults; lines per second.
fn pipeline(lines: &[Vec<u8>], n: usize, policy: &Policy, catalog: &Catalog) -> f64 {
    let metrics = Arc::new(Tally::default());
    let mut reader = KmsgReader::new(None, None, false, metrics);
    let ctx = Ctx { policy, catalog };
    let now = jiff::Timestamp::from_second(1_790_000_000).unwrap();
    let mut engine = engine_with(n, ctx, now);
    let mut out = Vec::with_capacity(64);
    let start = Instant::now();
    for l in lines {
        reader.feed(l, &mut out);
        for i in out.drain(..) {
            if let Input::Obs(o) | Input::Kmsg { obs: o, .. } = i {
                engine.step(ctx, o, now);
            }
        }
    }
    let rate = lines.len() as f64 / start.elapsed().as_secs_f64();
    std::hint::black_box(&engine);
    rate
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let lines = corpus();
    let bytes: usize = lines.iter().map(Vec::len).sum();
    let catalog = Catalog::builtin().expect("catalog");
    let policy = Policy::default();
    let mut parse_rates = Vec::new();
    let mut pipeline_rates: Vec<Vec<f64>> = vec![Vec::new(); STANDING.len()];
    let mut storm_rates: Vec<Vec<f64>> = vec![Vec::new(); STANDING.len()];
    let storm = storm();
    let mut signals = 0;
    for _ in 0..11 {
        let metrics = Arc::new(Tally::default());
        let mut reader = KmsgReader::new(None, None, false, metrics);
        let mut out = Vec::with_capacity(64);
        let start = Instant::now();
        let mut n_out = 0;
        for l in &lines {
            reader.feed(l, &mut out);
            n_out += out.len();
            out.clear();
        }
        parse_rates.push(lines.len() as f64 / start.elapsed().as_secs_f64());
        signals = n_out;

        for (k, n) in STANDING.iter().enumerate() {
            pipeline_rates[k].push(pipeline(&lines, *n, &policy, &catalog));
            storm_rates[k].push(pipeline(&storm, *n, &policy, &catalog));
        }
    }
    let p = median(parse_rates);
    let q: Vec<f64> = pipeline_rates.into_iter().map(median).collect();
    let st: Vec<f64> = storm_rates.into_iter().map(median).collect();
    println!(
        "corpus: {} lines, {:.1} MiB, {} engine inputs per pass",
        lines.len(),
        bytes as f64 / 1048576.0,
        signals
    );
    println!(
        "parse (record + message + observation): median {:.2} M lines/s ({:.0} MiB/s)",
        p / 1e6,
        p * bytes as f64 / lines.len() as f64 / 1048576.0
    );
    for (n, rate) in STANDING.iter().zip(&q) {
        println!(
            "parse + engine step, {n:>4} standing faults: median {:.2} M lines/s ({:.0} % of 0)",
            rate / 1e6,
            100.0 * rate / q[0]
        );
    }
    for (n, rate) in STANDING.iter().zip(&st) {
        println!(
            "storm (every line an Xid), {n:>4} standing faults: median {:.2} M lines/s ({:.0} % of 0)",
            rate / 1e6,
            100.0 * rate / st[0]
        );
    }
    let worst = (q.iter().copied().fold(f64::INFINITY, f64::min) / q[0])
        .min(st.iter().copied().fold(f64::INFINITY, f64::min) / st[0]);
    println!(
        "goal: with 1,000 standing faults within 20 % of none -> {}",
        if worst >= 0.8 { "met" } else { "NOT met" }
    );
    println!(
        "goal: > 1 M lines/s on one core -> {}",
        if p > 1e6 { "met" } else { "NOT met" }
    );
}
