//! The probe's TCP allgather against iperf3 on the same path: a 2-node lab (two namespaces on
//! a bridge, veth pairs), five alternating trials of
//! - iperf3, one direction (node 1 sends to node 0 for 3 s),
//! - iperf3 --bidir (both directions at once, as the allgather does),
//! - `faultline-probe allgather` between the two nodes (64 MiB per rank, 10 iterations),
//!
//! first on the bare veth path, then with the path shaped to 1000 Mbit/s each way (tbf, both
//! ends of node 0's veth), so both tools are held to the same link rate.
//!
//! A 2-rank ring allgather sends one block and receives one block per iteration, at the same
//! time on two connections; so its per-direction rate is bytes_per_rank / median_seconds (the
//! probe's busbw_gbps, in GB/s). That is compared with iperf3's one-direction rate and with its
//! per-direction rate under --bidir.
//!
//! Run: `cargo bench -p faultline-netlab --bench tcp_vs_iperf3` (as root). It builds
//! `faultline-probe` (release) first.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use faultline_netlab::Lab;

const TRIALS: usize = 5;
const IPERF_SECONDS: u32 = 3;
const PROBE_SIZE: &str = "64MiB";
const PROBE_ITERATIONS: u32 = 10;
const PROBE_PORT: u16 = 29400;
const IPERF_PORT: u16 = 5201;

type Res<T> = Result<T, String>;

/// Builds the release probe and returns its path (next to this bench's own directory).
fn probe_binary() -> Res<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(cargo)
        .args(["build", "--release", "--quiet", "-p", "faultline-probe"])
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !st.success() {
        return Err("cargo build --release -p faultline-probe failed".into());
    }
    // This bench runs as target/release/deps/tcp_vs_iperf3-<hash>.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("faultline-probe"))
        .ok_or("cannot find the target directory")?;
    if !bin.exists() {
        return Err(format!("{} not found after the build", bin.display()));
    }
    Ok(bin)
}

fn json(bytes: &[u8], what: &str) -> Res<serde_json::Value> {
    serde_json::from_slice(bytes).map_err(|e| {
        format!(
            "{what}: not JSON ({e}): {}",
            String::from_utf8_lossy(bytes)
                .chars()
                .take(400)
                .collect::<String>()
        )
    })
}

fn num(v: &serde_json::Value, path: &[&str]) -> Res<f64> {
    path.iter()
        .try_fold(v, |v, k| v.get(k))
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| format!("no number at {}", path.join(".")))
}

/// One iperf3 run, node 1 client to node 0 server. Returns Gbit/s per direction: (1 -> 0,
/// 0 -> 1 if bidir).
fn iperf3(lab: &Lab, bidir: bool) -> Res<(f64, Option<f64>)> {
    let server_ip = lab.nodes()[0].ip.to_string();
    let port = IPERF_PORT.to_string();
    let mut server = lab
        .command(0, "iperf3")
        .args(["-s", "-1", "-B", &server_ip, "-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("iperf3 -s: {e}"))?;
    let mut args = vec![
        "-c".to_string(),
        server_ip.clone(),
        "-p".into(),
        port.clone(),
        "-t".into(),
        IPERF_SECONDS.to_string(),
        "-J".into(),
    ];
    if bidir {
        args.push("--bidir".into());
    }
    // The server may take a moment to listen.
    let mut last = String::new();
    for _ in 0..50 {
        let out = lab
            .command(1, "iperf3")
            .args(&args)
            .output()
            .map_err(|e| format!("iperf3 -c: {e}"))?;
        let v = json(&out.stdout, "iperf3 -c")?;
        if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
            last = err.to_string();
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let _ = server.wait();
        let fwd = num(&v, &["end", "sum_received", "bits_per_second"])? / 1e9;
        let rev = if bidir {
            Some(
                num(
                    &v,
                    &["end", "sum_received_bidir_reverse", "bits_per_second"],
                )? / 1e9,
            )
        } else {
            None
        };
        return Ok((fwd, rev));
    }
    let _ = server.kill();
    let _ = server.wait();
    Err(format!("iperf3 client never ran: {last}"))
}

/// One allgather run on both nodes. Returns (per-direction Gbit/s of the slower rank, the
/// ranks' median seconds).
fn allgather(lab: &Lab, probe: &PathBuf) -> Res<(f64, [f64; 2])> {
    let peers = format!(
        "{}:{PROBE_PORT},{}:{PROBE_PORT}",
        lab.nodes()[0].ip,
        lab.nodes()[1].ip
    );
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            lab.command(rank, probe)
                .args(["allgather", "--peers", &peers, "--rank", &rank.to_string()])
                .args(["--size", PROBE_SIZE, "--timeout", "30s"])
                .args(["--iterations", &PROBE_ITERATIONS.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("faultline-probe: {e}"))
        })
        .collect::<Res<_>>()?;
    let mut medians = [0.0; 2];
    let mut bytes = 0.0;
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "probe rank {rank}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let v = json(&out.stdout, "faultline-probe")?;
        medians[rank] = num(&v, &["median_seconds"])?;
        bytes = num(&v, &["bytes_per_rank"])?;
    }
    let slowest = medians[0].max(medians[1]);
    Ok((bytes * 8.0 / slowest / 1e9, medians))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

struct Row {
    scenario: &'static str,
    iperf_uni: f64,
    iperf_bidir_per_dir: f64,
    iperf_bidir_total: f64,
    probe: f64,
}

fn scenario(lab: &Lab, probe: &PathBuf, name: &'static str) -> Res<Row> {
    let (mut uni, mut bi_dir, mut bi_total, mut pr) = (vec![], vec![], vec![], vec![]);
    println!("\n## {name}\n");
    println!("| trial | iperf3 1→0 | iperf3 bidir 1→0 | iperf3 bidir 0→1 | probe per direction | probe median s (rank 0, 1) |");
    println!("|---|---|---|---|---|---|");
    for t in 1..=TRIALS {
        let (u, _) = iperf3(lab, false)?;
        let (f, r) = iperf3(lab, true)?;
        let r = r.unwrap_or(f64::NAN);
        let (p, m) = allgather(lab, probe)?;
        println!(
            "| {t} | {u:.2} | {f:.2} | {r:.2} | {p:.2} | {:.4}, {:.4} |",
            m[0], m[1]
        );
        uni.push(u);
        bi_dir.push((f + r) / 2.0);
        bi_total.push(f + r);
        pr.push(p);
    }
    Ok(Row {
        scenario: name,
        iperf_uni: median(&uni),
        iperf_bidir_per_dir: median(&bi_dir),
        iperf_bidir_total: median(&bi_total),
        probe: median(&pr),
    })
}

fn run() -> Res<()> {
    Lab::check_available().map_err(|why| format!("the network lab cannot run here: {why}"))?;
    let probe = probe_binary()?;
    let lab = Lab::new("bench", 2).map_err(|e| e.to_string())?;
    let uname = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let iperf = Command::new("iperf3")
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = || {
        std::fs::read_to_string("/proc/loadavg")
            .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    println!("# faultline-probe allgather vs iperf3 (Gbit/s)");
    println!(
        "\nkernel {uname}, {cpus} CPUs (load average {}), {iperf}; lab {} ({} <-> {}); probe: \
         --size {PROBE_SIZE} --iterations {PROBE_ITERATIONS}, iperf3: -t {IPERF_SECONDS}; \
         {TRIALS} trials each",
        load(),
        lab.bridge(),
        lab.nodes()[0].ip,
        lab.nodes()[1].ip
    );
    let mut rows = vec![scenario(&lab, &probe, "veth, unshaped")?];
    lab.shape(0, Duration::ZERO, 1000)
        .map_err(|e| format!("shape: {e}"))?;
    rows.push(scenario(
        &lab,
        &probe,
        "veth shaped to 1000 Mbit/s each way (tbf)",
    )?);
    println!("\n(load average at the end: {})", load());
    println!("\n## Summary (medians of {TRIALS} trials, Gbit/s per direction)\n");
    println!("| path | iperf3 1 direction | iperf3 --bidir (per direction / total) | probe allgather (per direction) | probe / iperf3 1-dir | probe / iperf3 bidir per-dir |");
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.2} | {:.2} / {:.2} | {:.2} | {:.0} % | {:.0} % |",
            r.scenario,
            r.iperf_uni,
            r.iperf_bidir_per_dir,
            r.iperf_bidir_total,
            r.probe,
            100.0 * r.probe / r.iperf_uni,
            100.0 * r.probe / r.iperf_bidir_per_dir
        );
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("tcp_vs_iperf3: {e}");
        std::process::exit(1);
    }
}
