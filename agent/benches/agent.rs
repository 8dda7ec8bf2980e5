//! Process-level benchmarks of the standalone agent binary (release build):
//!
//! - latency: an Xid line written to the kernel log FIFO -> the local record shows it;
//!   median and p99 over N events (default 1000), one event every 250 ms (isolated events:
//!   faster ones are coalesced by design, see --write-interval);
//! - storm: 100,000 matching lines within one second: record writes and RSS before/after;
//! - idle: RSS and CPU of the agent over 60 s with nothing happening.
//!
//! `cargo bench -p faultline-agent --bench agent [-- latency|storm|idle] [--events N] [--idle-secs S]`

#![allow(clippy::unwrap_used)] // benchmark harness: a panic is the failure report

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Agent {
    child: Child,
    dir: PathBuf,
    fifo: std::fs::File,
}

impl Agent {
    fn start(dir: &Path) -> Agent {
        let fifo_path = dir.join("kmsg");
        let st = Command::new("mkfifo")
            .arg(&fifo_path)
            .status()
            .expect("mkfifo");
        assert!(st.success());
        std::fs::write(dir.join("boot_id"), "bench\n").unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_faultline-agent"))
            .arg("--kmsg-path")
            .arg(&fifo_path)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--boot-id-path")
            .arg(dir.join("boot_id"))
            .args(["--listen", "127.0.0.1:0", "--node-name", "bench"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("agent");
        // Opening the write end blocks until the agent opens the read end.
        let fifo = std::fs::OpenOptions::new()
            .write(true)
            .open(&fifo_path)
            .expect("open fifo");
        let a = Agent {
            child,
            dir: dir.to_path_buf(),
            fifo,
        };
        a.wait_file();
        a
    }

    fn record_path(&self) -> PathBuf {
        self.dir.join("state/faults.json")
    }

    fn wait_file(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.record_path().exists() || !self.dir.join("state/listen.addr").exists() {
            assert!(Instant::now() < deadline, "agent did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn metric(&self, name: &str) -> f64 {
        use std::io::Read;
        let addr = std::fs::read_to_string(self.dir.join("state/listen.addr")).unwrap();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|v| v.strip_prefix(' '))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0.0)
    }

    fn status(&self, key: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// utime + stime in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        let after = &s[s.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after.split_whitespace().collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }

    fn write(&mut self, bytes: &[u8]) {
        self.fifo.write_all(bytes).unwrap();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        common::terminate(&self.child);
        let _ = self.child.wait();
    }
}

fn latency(events: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut a = Agent::start(dir.path());
    let path = a.record_path();
    let mut lat = Vec::with_capacity(events);
    let gpus = ["3b", "86", "1a", "af", "b1", "c5", "d8", "e1"];
    for i in 0..events {
        let gpu = gpus[i % gpus.len()];
        let want_count = (i / gpus.len() + 1) as u64;
        let pci = format!("0000:{gpu}:00.0");
        let line = format!("4,{},{},-;NVRM: Xid (PCI:0000:{gpu}:00): 95, pid=1, name=bench, Uncontained ECC error\n", i + 1, i);
        let ino = common::record_inode(&path);
        let t0 = Instant::now();
        a.write(line.as_bytes());
        common::wait_record(&path, ino, t0, &format!("event {i}"), |r| {
            common::has_fault(r, "pci_bus_id", &pci, None, want_count)
        });
        lat.push(t0.elapsed().as_secs_f64() * 1000.0);
        std::thread::sleep(Duration::from_millis(250).saturating_sub(t0.elapsed()));
    }
    lat.sort_by(|x, y| x.total_cmp(y));
    println!(
        "latency: {events} events, kmsg FIFO -> faults.json: median {:.2} ms, p99 {:.2} ms, max {:.2} ms (goal p99 < 50 ms: {})",
        common::quantile(&lat, 0.5),
        common::quantile(&lat, 0.99),
        lat[lat.len() - 1],
        if common::quantile(&lat, 0.99) < 50.0 { "met" } else { "NOT met" }
    );
}

fn storm() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = Agent::start(dir.path());
    std::thread::sleep(Duration::from_millis(500));
    let writes0 = a.metric("faultline_sink_writes_total{sink=\"file\"}");
    let rss0 = a.status("VmRSS:");
    let gpus = ["3b", "86", "1a", "af", "b1", "c5", "d8", "e1"];
    let total = 100_000;
    let start = Instant::now();
    let mut seq = 0;
    for chunk in 0..10 {
        let mut buf = String::with_capacity(10_000 * 120);
        for j in 0..10_000 {
            seq += 1;
            let gpu = gpus[j % gpus.len()];
            let xid = if j % 1000 == 0 { 79 } else { 95 };
            buf.push_str(&format!("4,{seq},{seq},-;NVRM: Xid (PCI:0000:{gpu}:00): {xid}, pid=1, name=storm, Uncontained ECC error\n"));
        }
        a.write(buf.as_bytes());
        let next = Duration::from_millis(100 * (chunk + 1));
        std::thread::sleep(next.saturating_sub(start.elapsed()));
    }
    let sent = start.elapsed();
    // Wait until every line is read and the record settled.
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.metric("faultline_kmsg_records_total") < total as f64 {
        assert!(Instant::now() < deadline, "storm not consumed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let consumed = start.elapsed();
    std::thread::sleep(Duration::from_millis(1500));
    let writes = a.metric("faultline_sink_writes_total{sink=\"file\"}") - writes0;
    let rss1 = a.status("VmRSS:");
    let hwm = a.status("VmHWM:");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.record_path()).unwrap()).unwrap();
    let counted: u64 = r["faults"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["count"].as_u64().unwrap())
        .sum();
    println!(
        "storm: {total} matching lines written in {:.2} s, all read after {:.2} s; record writes {writes} (goal <= 10: {}); faults {} with total count {counted}; RSS {} KiB -> {} KiB (peak {} KiB)",
        sent.as_secs_f64(),
        consumed.as_secs_f64(),
        if writes <= 10.0 { "met" } else { "NOT met" },
        r["faults"].as_array().unwrap().len(),
        rss0,
        rss1,
        hwm
    );
    assert_eq!(counted, total as u64, "every line counted");
}

fn idle(secs: u64) {
    let dir = tempfile::tempdir().unwrap();
    let a = Agent::start(dir.path());
    std::thread::sleep(Duration::from_secs(3));
    let ticks_per_s = 100.0; // USER_HZ on Linux
    let c0 = a.cpu_ticks();
    let t0 = Instant::now();
    let mut rss = Vec::new();
    while t0.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(1));
        rss.push(a.status("VmRSS:"));
    }
    let cpu = (a.cpu_ticks() - c0) as f64 / ticks_per_s / t0.elapsed().as_secs_f64() * 100.0;
    rss.sort_unstable();
    let med = rss[rss.len() / 2];
    println!(
        "idle: {secs} s: RSS median {} KiB ({:.1} MiB), max {} KiB; CPU {:.3} % of a core (goals < 15 MiB: {}, < 0.2 %: {})",
        med,
        med as f64 / 1024.0,
        rss[rss.len() - 1],
        cpu,
        if (rss[rss.len() - 1] as f64) < 15.0 * 1024.0 { "met" } else { "NOT met" },
        if cpu < 0.2 { "met" } else { "NOT met" }
    );
}

fn main() {
    let args = common::Args::from_env();
    let parts = ["latency", "storm", "idle"];
    if args.wants(&parts, "storm") {
        storm();
    }
    if args.wants(&parts, "latency") {
        latency(args.flag("--events", 1000) as usize);
    }
    if args.wants(&parts, "idle") {
        idle(args.flag("--idle-secs", 60));
    }
}
