//! Process-level benchmarks of the standalone agent binary (release build):
//!
//! - latency: an Xid line appended to the kernel log (a regular file on a tmpfs, which a restart
//!   reads again like the device's ring) -> the local record (on a tmpfs, as `/run` is; the
//!   state on the disk, as `/var/lib` is) shows it, side by side with a plain reader of the same
//!   file that writes a file of its own per line (the floor): median and p99 over N events
//!   (default 1000), one event every 250 ms (isolated events: faster ones are coalesced by
//!   design, see --write-interval);
//! - storm: 100,000 matching lines within one second: record writes and RSS before/after;
//! - standing: the same kind of storm, as fast as the agent reads it, with 0, 100 and 1,000
//!   standing faults (active faults on other GPUs) in the agent: lines per second end to end
//!   (kernel log FIFO, parser, engine loop, snapshots, file sink), the three from one run;
//! - idle: RSS (resident, anonymous and file-backed apart) and CPU of the agent over 60 s with
//!   nothing happening, then again after a burst of faults has paged in the code that handles
//!   them;
//! - loss (named only: needs root, sets `kernel.printk_devkmsg=on` for the run and fills this
//!   machine's kernel log): records written to the real `/dev/kmsg` at 20,000 a second while
//!   two busy processes per core compete for the CPU; records lost (overwritten in the ring
//!   before they were read) by the agent and by a plain reader of `/dev/kmsg` in the same run.
//!
//! `FAULTLINE_BENCH_AGENT=PATH` measures another build of the agent (before and after);
//! `FAULTLINE_BENCH_BESIDE=PATH` runs `idle` with that build and this one side by side.
//!
//! `cargo bench -p faultline --bench agent [-- latency|storm|standing|idle|loss]
//!  [--events N] [--idle-secs S] [--standing-lines N] [--loss-records N] [--loss-rate N]
//!  [--loss-runs N]`

#![allow(clippy::unwrap_used)] // benchmark harness: a panic is the failure report

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Agent {
    child: Child,
    /// The state directory (`faults.json`, `listen.addr`).
    state: PathBuf,
    /// The write end of the kernel log.
    fifo: std::fs::File,
}

impl Agent {
    /// An agent reading a FIFO in `dir`, with its state and data directories there.
    fn start(dir: &Path) -> Agent {
        Agent::start_bin(dir, &agent_binary())
    }

    /// [`Agent::start`] with the agent binary `bin`.
    fn start_bin(dir: &Path, bin: &Path) -> Agent {
        let fifo_path = dir.join("kmsg");
        let st = Command::new("mkfifo")
            .arg(&fifo_path)
            .status()
            .expect("mkfifo");
        assert!(st.success());
        let child = Agent::spawn_bin(bin, dir, &fifo_path, dir, &[]);
        // Opening the write end blocks until the agent opens the read end.
        let fifo = std::fs::OpenOptions::new()
            .write(true)
            .open(&fifo_path)
            .expect("open fifo");
        let a = Agent {
            child,
            state: dir.join("state"),
            fifo,
        };
        a.wait_file();
        a
    }

    /// An agent following the regular file `log`, with its state directory in `run` and its
    /// data directory in `disk`, checking the file for growth every `follow`.
    fn following(run: &Path, disk: &Path, log: &Path, follow: Duration) -> Agent {
        let fifo = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("create the log");
        let follow = format!("{}us", follow.as_micros());
        let child = Agent::spawn(run, log, disk, &["--follow-interval", &follow]);
        let a = Agent {
            child,
            state: run.join("state"),
            fifo,
        };
        a.wait_file();
        a
    }

    fn spawn(run: &Path, log: &Path, disk: &Path, extra: &[&str]) -> Child {
        Agent::spawn_bin(&agent_binary(), run, log, disk, extra)
    }

    fn spawn_bin(bin: &Path, run: &Path, log: &Path, disk: &Path, extra: &[&str]) -> Child {
        std::fs::write(run.join("boot_id"), "bench\n").unwrap();
        Command::new(bin)
            .arg("--kmsg-path")
            .arg(log)
            .arg("--state-dir")
            .arg(run.join("state"))
            .arg("--data-dir")
            .arg(disk.join("data"))
            .arg("--boot-id-path")
            .arg(run.join("boot_id"))
            .args(["--listen", "127.0.0.1:0", "--node-name", "bench"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("agent")
    }

    fn record_path(&self) -> PathBuf {
        self.state.join("faults.json")
    }

    fn wait_file(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.record_path().exists() || !self.state.join("listen.addr").exists() {
            assert!(Instant::now() < deadline, "agent did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn metric(&self, name: &str) -> f64 {
        use std::io::Read;
        let addr = std::fs::read_to_string(self.state.join("listen.addr")).unwrap();
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

    /// Waits until the agent's count of kernel-log records read stays the same for `quiet`.
    fn wait_read_settled(&self, quiet: Duration) {
        let mut last = -1.0;
        loop {
            std::thread::sleep(quiet);
            let now = self.metric("faultline_kmsg_records_total");
            if now == last {
                return;
            }
            last = now;
        }
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
        cpu_ticks(self.child.id())
    }

    fn write(&mut self, bytes: &[u8]) {
        self.fifo.write_all(bytes).unwrap();
    }
}

/// The agent binary measured: this build's, or `FAULTLINE_BENCH_AGENT` (another build, for a
/// before-and-after table from the same bench).
fn agent_binary() -> PathBuf {
    std::env::var_os("FAULTLINE_BENCH_AGENT").map_or_else(
        || env!("CARGO_BIN_EXE_faultline-agent").into(),
        PathBuf::from,
    )
}

/// utime + stime of process `pid` in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

impl Drop for Agent {
    fn drop(&mut self) {
        common::terminate(&self.child);
        let _ = self.child.wait();
    }
}

/// How often the agent and the plain reader check the kernel-log file for growth in `latency`.
const FOLLOW: Duration = Duration::from_millis(1);

/// The floor of `latency`: a process that follows `log` as the agent follows a file (read to
/// the end, then check again every `follow`) and, for each line naming an Xid, replaces `out`
/// with the line's sequence number (a temporary file renamed over it, as the agent replaces
/// `faults.json`): a line in the log to a file that says so, with nothing in between.
fn plain_reader(log: &Path, out: &Path, follow: Duration) {
    use std::io::{BufRead, BufReader};
    let mut lines = BufReader::new(std::fs::File::open(log).expect("open the log"));
    let tmp = out.with_extension("tmp");
    let mut line = String::new();
    loop {
        line.clear();
        // A line is appended with one write: a read at the end returns nothing or all of it.
        if lines.read_line(&mut line).expect("read the log") == 0 {
            std::thread::sleep(follow);
            continue;
        }
        if line.contains("NVRM: Xid") {
            let seq = line.split(',').nth(1).unwrap_or_default();
            std::fs::write(&tmp, seq).unwrap();
            std::fs::rename(&tmp, out).unwrap();
        }
    }
}

/// Where directories on a tmpfs go: `/dev/shm` where there is one (as `/run` is on a
/// node), else the default temporary directory.
fn tmpfs() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// The plain reader's process, killed when the bench ends (it never ends by itself).
struct Reader(Child);

impl Drop for Reader {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn latency(events: usize) {
    // As on a node: the record on a tmpfs (`/run/faultline`), the state on the disk
    // (`/var/lib/faultline`); the kernel log beside the record (a tmpfs, like the ring).
    let run = tempfile::tempdir_in(tmpfs()).unwrap();
    let disk = tempfile::tempdir().unwrap();
    let log = run.path().join("kmsg");
    let mut a = Agent::following(run.path(), disk.path(), &log, FOLLOW);
    let floor = run.path().join("reader");
    let _reader = Reader(
        Command::new(std::env::current_exe().unwrap())
            .arg("plain-reader")
            .arg(&log)
            .arg(&floor)
            .arg(FOLLOW.as_micros().to_string())
            .spawn()
            .expect("the plain reader"),
    );
    let path = a.record_path();
    let (mut agent_ms, mut floor_ms) = (Vec::new(), Vec::new());
    let gpus = ["3b", "86", "1a", "af", "b1", "c5", "d8", "e1"];
    for i in 0..events {
        let gpu = gpus[i % gpus.len()];
        let want_count = (i / gpus.len() + 1) as u64;
        let pci = format!("0000:{gpu}:00.0");
        let seq = i + 1;
        let line = format!("4,{seq},{i},-;NVRM: Xid (PCI:0000:{gpu}:00): 95, pid=1, name=bench, Uncontained ECC error\n");
        let (mut agent_ino, mut floor_ino) =
            (common::record_inode(&path), common::record_inode(&floor));
        let (mut agent_at, mut floor_at) = (None, None);
        let t0 = Instant::now();
        a.write(line.as_bytes());
        // Both files are polled in one loop, each dated when its new version is first seen.
        while agent_at.is_none() || floor_at.is_none() {
            if floor_at.is_none() && common::record_inode(&floor) != floor_ino {
                let seen = t0.elapsed();
                floor_ino = common::record_inode(&floor);
                if std::fs::read_to_string(&floor).is_ok_and(|s| s == seq.to_string()) {
                    floor_at = Some(seen);
                }
            }
            if agent_at.is_none() && common::record_inode(&path) != agent_ino {
                let seen = t0.elapsed();
                agent_ino = common::record_inode(&path);
                let r: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap_or_default();
                if common::has_fault(&r, "pci_bus_id", &pci, None, want_count) {
                    agent_at = Some(seen);
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "event {i} was not seen"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        agent_ms.push(agent_at.unwrap().as_secs_f64() * 1000.0);
        floor_ms.push(floor_at.unwrap().as_secs_f64() * 1000.0);
        std::thread::sleep(Duration::from_millis(250).saturating_sub(t0.elapsed()));
    }
    for v in [&mut agent_ms, &mut floor_ms] {
        v.sort_by(|x, y| x.total_cmp(y));
    }
    let q = |v: &[f64], p| common::quantile(v, p);
    for (who, v) in [
        ("faultline", &agent_ms),
        ("plain reader (floor)", &floor_ms),
    ] {
        println!(
            "latency: {events} events, kernel log -> file, {who}: median {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            q(v, 0.5),
            q(v, 0.99),
            v[v.len() - 1]
        );
    }
    let ratio = q(&agent_ms, 0.99) / q(&floor_ms, 0.99);
    println!(
        "latency: faultline's p99 is {ratio:.2}x the floor's (goal within 1.5x: {}); median {:.2}x",
        if ratio <= 1.5 { "met" } else { "NOT met" },
        q(&agent_ms, 0.5) / q(&floor_ms, 0.5)
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

/// One storm line: Xid 31 on one of 8 GPUs, an Xid 79 every 1,000 lines.
fn storm_line(seq: u64) -> String {
    let bus = 0x1a + (seq % 8) * 0x20;
    let xid = if seq % 1000 == 999 { 79 } else { 31 };
    format!("3,{seq},{seq},-;NVRM: Xid (PCI:0000:{bus:02x}:00): {xid}, pid=1234, name=python, Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12345000\n")
}

/// Lines per second through the whole agent with `standing` active faults on other GPUs.
fn standing_storm(standing: usize, lines: u64) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let mut a = Agent::start(dir.path());
    let mut seq = 0u64;
    let mut buf = String::new();
    for i in 0..standing {
        seq += 1;
        // Domain 0002: buses the storm never names.
        buf.push_str(&format!(
            "3,{seq},{seq},-;NVRM: Xid (PCI:0002:{:02x}:{:02x}): 13, pid=1, name=x, Graphics Exception\n",
            i / 32 % 256,
            i % 32
        ));
    }
    a.write(buf.as_bytes());
    let deadline = Instant::now() + Duration::from_secs(60);
    while a.metric("faultline_kmsg_records_total") < seq as f64 {
        assert!(Instant::now() < deadline, "standing faults not read");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(500));
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.record_path()).unwrap()).unwrap();
    let active = r["faults"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["active"].as_bool() == Some(true))
        .count();
    assert_eq!(active, standing, "standing faults in the record");
    let first = seq;
    let mut chunk = String::with_capacity(10_000 * 200);
    let start = Instant::now();
    while seq < first + lines {
        chunk.clear();
        for _ in 0..10_000.min(first + lines - seq) {
            seq += 1;
            chunk.push_str(&storm_line(seq));
        }
        // The FIFO blocks the writer while the agent is behind: the rate is the agent's.
        a.write(chunk.as_bytes());
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while a.metric("faultline_kmsg_records_total") < seq as f64 {
        assert!(Instant::now() < deadline, "storm not consumed");
        std::thread::sleep(Duration::from_millis(5));
    }
    lines as f64 / start.elapsed().as_secs_f64()
}

fn standing(lines: u64) {
    let counts = [0usize, 100, 1000];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    // Alternated, three rounds: the three figures come from one run.
    for _ in 0..3 {
        for (k, n) in counts.iter().enumerate() {
            rates[k].push(standing_storm(*n, lines));
        }
    }
    let med: Vec<f64> = rates
        .into_iter()
        .map(|mut v| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        })
        .collect();
    for (n, r) in counts.iter().zip(&med) {
        println!(
            "standing: {n:>4} standing faults: {lines} storm lines, median of 3: {:.0} k lines/s ({:.0} % of 0)",
            r / 1e3,
            100.0 * r / med[0]
        );
    }
    let worst = med.iter().copied().fold(f64::INFINITY, f64::min) / med[0];
    println!(
        "standing: goal within 20 % of none at 1,000 -> {}",
        if worst >= 0.8 { "met" } else { "NOT met" }
    );
}

/// What [`sample`] measured of one agent over its window.
struct Sampled {
    /// Medians of VmRSS, RssAnon and RssFile (KiB), sampled every second.
    rss: [u64; 3],
    /// utime + stime over the window, in clock ticks (USER_HZ, 100 a second on Linux).
    ticks: u64,
    /// The threads' scheduler run time over the window (`/proc/PID/task/*/schedstat`, in
    /// nanoseconds: finer than a tick).
    run_ns: u64,
    /// The window, in seconds.
    secs: f64,
}

impl Sampled {
    /// CPU by ticks, in % of a core.
    fn cpu(&self) -> f64 {
        self.ticks as f64 / 100.0 / self.secs * 100.0
    }
}

/// The agents' memory and CPU over the same `secs`, sampled together.
fn sample(agents: &[&Agent], secs: u64) -> Vec<Sampled> {
    let run_ns = |a: &Agent| -> u64 {
        std::fs::read_dir(format!("/proc/{}/task", a.child.id()))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    };
    let t0 = Instant::now();
    let c0: Vec<_> = agents.iter().map(|a| (a.cpu_ticks(), run_ns(a))).collect();
    let mut rss: Vec<[Vec<u64>; 3]> = agents.iter().map(|_| Default::default()).collect();
    while t0.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(1));
        for (a, v) in agents.iter().zip(&mut rss) {
            for (k, key) in ["VmRSS:", "RssAnon:", "RssFile:"].iter().enumerate() {
                v[k].push(a.status(key));
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    agents
        .iter()
        .zip(c0)
        .zip(rss)
        .map(|((a, (ticks0, ns0)), v)| Sampled {
            rss: v.map(|mut x| {
                x.sort_unstable();
                x[x.len() / 2]
            }),
            ticks: a.cpu_ticks() - ticks0,
            run_ns: run_ns(a) - ns0,
            secs,
        })
        .collect()
}

/// `idle` with `FAULTLINE_BENCH_BESIDE=PATH`: that build and this one (or
/// `FAULTLINE_BENCH_AGENT`) idle in the same minutes, sampled together: RSS medians, and CPU by
/// clock ticks and by the threads' scheduler run time.
fn idle_beside(other: &Path, secs: u64) {
    let bins = [other.to_path_buf(), agent_binary()];
    let dirs: Vec<_> = bins.iter().map(|_| tempfile::tempdir().unwrap()).collect();
    let agents: Vec<Agent> = bins
        .iter()
        .zip(&dirs)
        .map(|(b, d)| Agent::start_bin(d.path(), b))
        .collect();
    std::thread::sleep(Duration::from_secs(5));
    let sampled = sample(&agents.iter().collect::<Vec<_>>(), secs);
    for (bin, m) in bins.iter().zip(sampled) {
        let mib = |k: u64| k as f64 / 1024.0;
        println!(
            "idle beside: {}: {secs} s: RSS median {:.1} MiB (anonymous {:.1}, file-backed {:.1}); CPU {} ticks = {:.3} %, schedstat {:.3} %; binary {} bytes",
            bin.display(),
            mib(m.rss[0]),
            mib(m.rss[1]),
            mib(m.rss[2]),
            m.ticks,
            m.cpu(),
            m.run_ns as f64 / 1e9 / m.secs * 100.0,
            std::fs::metadata(bin).map(|m| m.len()).unwrap_or(0)
        );
    }
}

fn idle(secs: u64) {
    if let Some(other) = std::env::var_os("FAULTLINE_BENCH_BESIDE") {
        return idle_beside(Path::new(&other), secs);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = Agent::start(dir.path());
    std::thread::sleep(Duration::from_secs(3));
    let mib = |k: u64| k as f64 / 1024.0;
    let m = sample(&[&a], secs).remove(0);
    let (fresh, cpu) = (m.rss, m.cpu());
    println!(
        "idle: {secs} s after start: RSS median {:.1} MiB (anonymous {:.1} MiB, file-backed {:.1} MiB); CPU {cpu:.3} % of a core (goals RSS < 15 MiB: {}, CPU < 0.2 %: {})",
        mib(fresh[0]),
        mib(fresh[1]),
        mib(fresh[2]),
        if mib(fresh[0]) < 15.0 { "met" } else { "NOT met" },
        if cpu < 0.2 { "met" } else { "NOT met" }
    );
    // A burst of faults pages in the parser, engine and sink code; RSS does not go back.
    let mut buf = String::new();
    for seq in 1..=10_000u64 {
        buf.push_str(&storm_line(seq));
    }
    a.write(buf.as_bytes());
    std::thread::sleep(Duration::from_secs(3));
    let m = sample(&[&a], secs.min(20)).remove(0);
    let (after, cpu) = (m.rss, m.cpu());
    println!(
        "idle: after a 10,000-line burst: RSS median {:.1} MiB (anonymous {:.1} MiB, file-backed {:.1} MiB); CPU {cpu:.3} % of a core; binary {:.1} MiB on disk",
        mib(after[0]),
        mib(after[1]),
        mib(after[2]),
        std::fs::metadata(agent_binary())
            .map(|m| m.len() as f64 / 1048576.0)
            .unwrap_or(0.0)
    );
}

/// The marker of the records `loss` writes, and of its last one.
const LOSS_TAG: &str = "faultline-bench-load:";
const LOSS_END: &str = "faultline-bench-load: end";

/// The floor of `loss`: reads `/dev/kmsg` from its end one record per `read()` and counts the
/// records it never saw (the sequence gaps after an overrun) until the bench's end record, then
/// writes that count and its own CPU ticks to `out`. Nothing else: no parsing beyond the sequence number.
fn plain_kmsg(out: &Path) {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open("/dev/kmsg").expect("open /dev/kmsg");
    f.seek(SeekFrom::End(0)).expect("seek to the end");
    std::fs::write(out.with_extension("ready"), b"").unwrap();
    let mut buf = vec![0u8; 16 * 1024];
    let (mut last, mut lost) = (None::<u64>, 0u64);
    loop {
        let n = match f.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(32) => continue, // EPIPE: overrun
            Err(e) => panic!("read /dev/kmsg: {e}"),
        };
        let rec = &buf[..n];
        let seq: u64 = std::str::from_utf8(rec)
            .ok()
            .and_then(|r| r.split(',').nth(1))
            .and_then(|s| s.parse().ok())
            .expect("a record's sequence number");
        if let Some(l) = last {
            lost += seq.saturating_sub(l + 1);
        }
        last = Some(seq);
        if rec
            .windows(LOSS_END.len())
            .any(|w| w == LOSS_END.as_bytes())
        {
            let cpu = cpu_ticks(std::process::id());
            std::fs::write(out, format!("{lost} {cpu}")).unwrap();
            return;
        }
    }
}

/// One busy process of `loss`'s load. It dies with the bench, however the bench ends.
fn spin() {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .expect("PR_SET_PDEATHSIG");
    let mut x = 0u64;
    loop {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

/// Restores `kernel.printk_devkmsg` when `loss` ends, however it ends.
struct Devkmsg(String);

impl Devkmsg {
    const PATH: &'static str = "/proc/sys/kernel/printk_devkmsg";

    /// `on`: user-space writes to `/dev/kmsg` are not rate-limited (the default, `ratelimit`,
    /// lets 10 through per 5 s). None where this process may not change it. A bench killed by
    /// a signal leaves it `on`: `sysctl kernel.printk_devkmsg=ratelimit` puts it back.
    fn on() -> Option<Devkmsg> {
        let old = Devkmsg(std::fs::read_to_string(Self::PATH).ok()?.trim().to_string());
        std::fs::write(Self::PATH, "on\n").ok()?;
        // Dropped (the old value written back) if it did not take.
        (std::fs::read_to_string(Self::PATH).ok()?.trim() == "on").then_some(old)
    }
}

impl Drop for Devkmsg {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, format!("{}\n", self.0));
    }
}

/// One run of `loss`.
fn loss_run(records: u64, rate: u64) -> Loss {
    let run = tempfile::tempdir_in(tmpfs()).unwrap();
    let disk = tempfile::tempdir().unwrap();
    let a = Agent::following(run.path(), disk.path(), Path::new("/dev/kmsg"), FOLLOW);
    // The agent reads the ring from its oldest record at first start: wait until it is done.
    a.wait_read_settled(Duration::from_millis(300));
    let lost0 = a.metric("faultline_kmsg_lost_records_total");
    let read0 = a.metric("faultline_kmsg_records_total");
    let out = run.path().join("plain-lost");
    let _reader = Reader(
        Command::new(std::env::current_exe().unwrap())
            .arg("plain-kmsg")
            .arg(&out)
            .spawn()
            .expect("the plain reader"),
    );
    while !out.with_extension("ready").exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let load: Vec<Reader> = (0..2 * cores)
        .map(|_| {
            Reader(
                Command::new(std::env::current_exe().unwrap())
                    .arg("spin")
                    .spawn()
                    .expect("a busy process"),
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let cpu0 = (a.cpu_ticks(), cpu_ticks(_reader.0.id()));
    let mut kmsg = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/kmsg")
        .unwrap();
    let start = Instant::now();
    let mut i = 0u64;
    while i < records {
        let due = ((start.elapsed().as_secs_f64() * rate as f64) as u64).min(records);
        if i >= due {
            std::thread::sleep(Duration::from_micros(500));
            continue;
        }
        while i < due {
            // One write is one record (<12>: facility user, level warning).
            kmsg.write_all(format!("<12>{LOSS_TAG} {i}\n").as_bytes())
                .unwrap();
            i += 1;
        }
    }
    let took = start.elapsed().as_secs_f64();
    kmsg.write_all(format!("<12>{LOSS_END}\n").as_bytes())
        .unwrap();
    drop(load);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !out.exists() {
        assert!(Instant::now() < deadline, "the plain reader did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The agent has read everything once its count of records stops moving.
    a.wait_read_settled(Duration::from_millis(500));
    let agent_lost = (a.metric("faultline_kmsg_lost_records_total") - lost0) as u64;
    let agent_read = (a.metric("faultline_kmsg_records_total") - read0) as u64;
    let agent_cpu = a.cpu_ticks() - cpu0.0;
    let plain = std::fs::read_to_string(&out).unwrap();
    let (plain_lost, plain_cpu) = plain.split_once(' ').unwrap();
    let (plain_lost, plain_cpu): (u64, u64) =
        (plain_lost.parse().unwrap(), plain_cpu.parse().unwrap());
    Loss {
        records,
        took,
        agent_lost,
        agent_read,
        plain_lost,
        agent_cpu,
        plain_cpu: plain_cpu - cpu0.1,
    }
}

/// What one run of `loss` saw.
struct Loss {
    records: u64,
    /// Seconds the writes took.
    took: f64,
    agent_lost: u64,
    /// Records the agent read in the run (the bench's, its end record, and any the kernel wrote
    /// meanwhile).
    agent_read: u64,
    plain_lost: u64,
    /// CPU ticks (10 ms) of the agent and of the plain reader in the run.
    agent_cpu: u64,
    plain_cpu: u64,
}

fn loss(records: u64, rate: u64, runs: u64) {
    let Some(_devkmsg) = Devkmsg::on() else {
        println!("loss: skipped: needs root (kernel.printk_devkmsg must be set to on)");
        return;
    };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    for k in 1..=runs {
        let l = loss_run(records, rate);
        println!(
            "loss: run {k}: {} records in {:.1} s ({:.0}/s), {} busy processes on {cores} cores: faultline read {} and lost {} (CPU {:.2} s), the plain reader lost {} (CPU {:.2} s) (goal: none where the plain reader loses none: {})",
            l.records,
            l.took,
            l.records as f64 / l.took,
            2 * cores,
            l.agent_read,
            l.agent_lost,
            l.agent_cpu as f64 / 100.0,
            l.plain_lost,
            l.plain_cpu as f64 / 100.0,
            if l.agent_lost == 0 || l.plain_lost > 0 { "met" } else { "NOT met" }
        );
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    match argv.get(1).map(String::as_str) {
        Some("plain-kmsg") => return plain_kmsg(Path::new(&argv[2])),
        Some("spin") => spin(),
        _ => {}
    }
    if argv.get(1).map(String::as_str) == Some("plain-reader") {
        let us = argv[4].parse().expect("microseconds");
        plain_reader(
            Path::new(&argv[2]),
            Path::new(&argv[3]),
            Duration::from_micros(us),
        );
        return;
    }
    let args = common::Args::from_env();
    let parts = ["latency", "storm", "standing", "idle", "loss"];
    if args.wants(&parts, "storm") {
        storm();
    }
    if args.wants(&parts, "standing") {
        standing(args.flag("--standing-lines", 200_000));
    }
    if args.wants(&parts, "latency") {
        latency(args.flag("--events", 1000) as usize);
    }
    if args.wants(&parts, "idle") {
        idle(args.flag("--idle-secs", 60));
    }
    // Named only: it changes a sysctl and fills this machine's kernel log.
    if args.named("loss") {
        loss(
            args.flag("--loss-records", 200_000),
            args.flag("--loss-rate", 20_000),
            args.flag("--loss-runs", 3),
        );
    }
}
