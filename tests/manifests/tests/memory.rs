//! The agent container's memory limit holds what the container must hold at once: the agent at
//! its peak in a kernel-log storm, plus, for every peer check the agent runs at once, one probe
//! at its peak and that probe's socket buffers, plus headroom. The inputs are measured figures
//! (docs/benchmarks.md, "Memory of the agent with its probes"; the arithmetic is in
//! docs/kubernetes.md, "Memory"): re-measure and update them here when the agent or the probe
//! changes. The limit is read from the base and, where `kubectl` is installed, from what
//! `kubectl kustomize manifests/` renders.

use serde_json::Value;

use crate::common;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// The agent's peak RSS (VmHWM) in the storm bench, release build (docs/benchmarks.md,
/// "Storm": `cargo bench -p faultline --bench agent -- storm`), rounded up to a MiB.
const AGENT_STORM_PEAK: u64 = 16 * MIB;
/// One probe's peak RSS (VmHWM, its `peak_rss_bytes`) in a 2-rank allgather on loopback,
/// release build, the larger of 64 MiB and 1 GiB per rank (docs/benchmarks.md, "Probe
/// memory"), rounded up to a MiB. It does not grow with the size.
const PROBE_PEAK: u64 = 7 * MIB;
/// One probe's TCP socket buffers at their peak (kernel memory, charged to the container's
/// cgroup on cgroup v2): half of what two ranks on loopback used at 1 GiB (the larger size),
/// measured as memory.kmem.tcp.max_usage_in_bytes of a v1 cgroup (docs/benchmarks.md, "Probe
/// memory"), rounded up to a MiB.
const PROBE_SOCKETS_PEAK: u64 = 15 * MIB;
/// Checks an agent runs at once (one probe each): the agent's `peer::MAX_CONCURRENT_CHECKS`,
/// checked against it below.
const MAX_CONCURRENT_CHECKS: u64 = 4;
/// Headroom over the sum, in percent of it: measurement noise, allocator slack, a larger
/// kernel-log burst than the bench's.
const HEADROOM_PERCENT: u64 = 20;

/// The sum the limit must cover, headroom included.
fn required() -> u64 {
    let sum = AGENT_STORM_PEAK + MAX_CONCURRENT_CHECKS * (PROBE_PEAK + PROBE_SOCKETS_PEAK);
    sum + sum * HEADROOM_PERCENT / 100
}

/// A Kubernetes quantity in bytes (`128Mi`, `1Gi`, `100M`, `134217728`).
fn bytes(q: &str) -> u64 {
    let units: [(&str, u64); 8] = [
        ("Ki", KIB),
        ("Mi", MIB),
        ("Gi", 1024 * MIB),
        ("Ti", 1024 * 1024 * MIB),
        ("k", 1000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (num, mult) = units
        .iter()
        .find_map(|(suffix, m)| q.strip_suffix(suffix).map(|n| (n, *m)))
        .unwrap_or((q, 1));
    num.parse::<u64>()
        .unwrap_or_else(|_| panic!("{q:?} is not a quantity this test reads"))
        * mult
}

/// The agent container's `resources.limits.memory` of a DaemonSet document.
fn limit_of(ds: &Value) -> u64 {
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["name"], "agent", "the agent container first");
    let q = c["resources"]["limits"]["memory"]
        .as_str()
        .expect("a memory limit on the agent container");
    bytes(q)
}

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

#[test]
fn quantities_read_as_bytes() {
    assert_eq!(bytes("128Mi"), 128 * MIB);
    assert_eq!(bytes("1Gi"), 1024 * MIB);
    assert_eq!(bytes("100M"), 100_000_000);
    assert_eq!(bytes("4096"), 4096);
}

#[test]
fn the_inputs_follow_the_code() {
    let n = faultline_agent::peer::MAX_CONCURRENT_CHECKS as u64;
    assert_eq!(
        n, MAX_CONCURRENT_CHECKS,
        "the agent runs {n} checks at once: re-derive the memory limit (docs/kubernetes.md)"
    );
}

#[test]
fn the_memory_limit_holds_the_agent_and_its_probes() {
    let docs = common::base_objects();
    let ds = common::find(&docs, "DaemonSet", "faultline-agent");
    let mut limits = vec![("manifests/base".to_string(), limit_of(&ds.value))];
    match std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(common::manifests_dir())
        .output()
    {
        Ok(out) => {
            assert!(
                out.status.success(),
                "kubectl kustomize failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let rendered = common::parse_yaml(&String::from_utf8_lossy(&out.stdout)).expect("YAML");
            let ds = rendered
                .iter()
                .find(|v| v["kind"] == "DaemonSet" && v["metadata"]["name"] == "faultline-agent")
                .expect("the DaemonSet in kubectl kustomize's output");
            limits.push(("kubectl kustomize manifests/".into(), limit_of(ds)));
        }
        Err(e) => eprintln!("kubectl kustomize skipped: kubectl not available ({e})"),
    }
    let need = required();
    for (from, limit) in limits {
        assert!(
            limit >= need,
            "{from}: memory limit {:.1} MiB is below what the container holds at once: agent \
             {:.0} MiB + {MAX_CONCURRENT_CHECKS} x (probe {:.0} MiB + sockets {:.0} MiB), plus \
             {HEADROOM_PERCENT} % = {:.1} MiB (docs/kubernetes.md, \"Memory\")",
            mib(limit),
            mib(AGENT_STORM_PEAK),
            mib(PROBE_PEAK),
            mib(PROBE_SOCKETS_PEAK),
            mib(need)
        );
    }
}
