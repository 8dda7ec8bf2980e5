//! The kernel log source: `/dev/kmsg`, or a file or FIFO for tests and replays.
//!
//! `/dev/kmsg` returns one record per `read()`; a reader that falls behind gets `EPIPE` once
//! and continues at the oldest record, so the sequence gap is the number of records lost. A file
//! or FIFO is read line by line and followed like `tail -f`; its lines may be kmsg records or
//! plain `dmesg` text. The I/O loop runs on a dedicated thread; [`KmsgReader`] is the pure core.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tracing::{debug, info, warn};

use super::{Input, SourceContext};
use crate::catalog::FaultCode;
use crate::engine::{DetectorState, DeviceRef, Observation, Signal};
use crate::metrics::Metrics;
use crate::parse::kmsg::strip_dmesg_time;
use crate::parse::{parse_message, parse_record, KernelEvent};
use crate::record::Source;

/// Longest line kept from a file; the rest of a longer line is dropped and counted.
pub const MAX_LINE: usize = 64 * 1024;

/// Configuration of the kernel log source.
#[derive(Debug, Clone)]
pub struct KmsgConfig {
    pub path: PathBuf,
    /// Skip records with a sequence number up to this one (same boot, already counted).
    pub resume_after: Option<u64>,
    /// Wall-clock time of boot, to date records from their monotonic timestamps.
    pub boot_time: Option<DateTime<Utc>>,
    /// How often a file at its end is checked for growth.
    pub follow_interval: Duration,
}

/// The pure core: bytes in, engine inputs out.
#[derive(Debug)]
pub struct KmsgReader {
    last_seq: Option<u64>,
    boot_time: Option<DateTime<Utc>>,
    use_record_time: bool,
    metrics: Arc<Metrics>,
    unsent_cursor: bool,
}

impl KmsgReader {
    pub fn new(
        resume_after: Option<u64>,
        boot_time: Option<DateTime<Utc>>,
        use_record_time: bool,
        metrics: Arc<Metrics>,
    ) -> Self {
        KmsgReader {
            last_seq: resume_after,
            boot_time,
            use_record_time,
            metrics,
            unsent_cursor: false,
        }
    }

    /// The highest sequence number read so far.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Handles one record (device mode) or one line (file mode).
    pub fn feed(&mut self, raw: &[u8], out: &mut Vec<Input>) {
        if raw.first() == Some(&b' ') {
            return; // continuation line of the previous record (file mode)
        }
        self.metrics.kmsg_records.inc();
        match parse_record(raw) {
            Ok(rec) => {
                if let Some(last) = self.last_seq {
                    if rec.seq <= last {
                        self.metrics.kmsg_skipped.inc();
                        return;
                    }
                    let lost = rec.seq - last - 1;
                    if lost > 0 {
                        self.report_loss(lost, rec.seq, out);
                    }
                }
                self.last_seq = Some(rec.seq);
                let at = if self.use_record_time {
                    self.boot_time.and_then(|b| {
                        b.checked_add_signed(chrono::Duration::microseconds(
                            rec.usec.min(i64::MAX as u64) as i64,
                        ))
                    })
                } else {
                    None
                };
                if self.scan(&rec.message, at, out) {
                    out.push(Input::KmsgCursor(rec.seq));
                    self.unsent_cursor = false;
                } else {
                    self.unsent_cursor = true;
                }
            }
            Err(e) => {
                let text = String::from_utf8_lossy(raw);
                if looks_like_header(raw) {
                    // A truncated or corrupt record: say so, and still scan what is there. Its
                    // sequence number, when readable, was read, not lost.
                    self.metrics.kmsg_malformed.inc();
                    debug!(error = %e, line = %truncate(&text, 120), "malformed kmsg record");
                    if let Some(seq) = header_seq(raw) {
                        if self.last_seq.is_none_or(|last| seq > last) {
                            self.last_seq = Some(seq);
                            self.unsent_cursor = true;
                        }
                    }
                }
                self.scan(strip_dmesg_time(text.trim_end_matches('\n')), None, out);
            }
        }
    }

    /// A cursor marker for records read since the last marker, if any.
    pub fn flush_cursor(&mut self, out: &mut Vec<Input>) {
        if self.unsent_cursor {
            if let Some(seq) = self.last_seq {
                out.push(Input::KmsgCursor(seq));
            }
            self.unsent_cursor = false;
        }
    }

    fn report_loss(&mut self, lost: u64, seq: u64, out: &mut Vec<Input>) {
        self.metrics.kmsg_lost.inc_by(lost);
        warn!(
            lost,
            next_seq = seq,
            "kernel log records lost before they were read"
        );
        let mut s = Signal::new(
            Source::Agent,
            FaultCode::named("KMSG_LOSS"),
            None,
            format!("{lost} kernel log records were lost before faultline read them"),
        );
        s.count = lost;
        out.push(Input::Obs(Observation::Signal(s)));
    }

    /// Parses a message; returns whether it produced an input.
    fn scan(&mut self, msg: &str, at: Option<DateTime<Utc>>, out: &mut Vec<Input>) -> bool {
        let Some(ev) = parse_message(msg) else {
            return false;
        };
        self.metrics
            .kmsg_matched
            .get_or_create(&crate::metrics::KindLabel { kind: ev.kind() })
            .inc();
        out.push(Input::Obs(to_observation(ev, at)));
        true
    }
}

fn looks_like_header(raw: &[u8]) -> bool {
    let digits = raw.iter().take_while(|c| c.is_ascii_digit()).count();
    digits > 0 && raw.get(digits) == Some(&b',')
}

/// The sequence number of a record whose header is otherwise broken (`4,41,11000`).
fn header_seq(raw: &[u8]) -> Option<u64> {
    let head = raw.split(|c| *c == b';' || *c == b'\n').next()?;
    let seq = head.split(|c| *c == b',').nth(1)?;
    std::str::from_utf8(seq).ok()?.parse().ok()
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Maps a kernel event to an engine observation.
pub fn to_observation(ev: KernelEvent, at: Option<DateTime<Utc>>) -> Observation {
    let signal = |code: FaultCode, device: Option<DeviceRef>, message: String| {
        let mut s = Signal::new(Source::Kmsg, code, device, message);
        s.at = at;
        Observation::Signal(s)
    };
    match ev {
        KernelEvent::Xid {
            pci,
            xid,
            link,
            message,
            ..
        } => {
            let message = match link {
                Some(l) if !message.contains("link") => format!("{message} (link {l})"),
                _ => message,
            };
            signal(FaultCode::Xid(xid), Some(DeviceRef::pci(pci)), message)
        }
        KernelEvent::GpuUuid { pci, uuid } => Observation::DeviceSeen {
            pci,
            uuid: Some(uuid),
            index: None,
        },
        KernelEvent::FallenOffBus { pci } => signal(
            FaultCode::Xid(79),
            pci.map(DeviceRef::pci),
            "GPU has fallen off the bus".into(),
        ),
        KernelEvent::Sxid {
            pci,
            sxid,
            fatal,
            switch,
            message,
            ..
        } => {
            let name = match switch {
                Some(n) => format!("nvswitch{n}"),
                None => format!("nvswitch-{pci}"),
            };
            let device = DeviceRef {
                pci: Some(pci),
                name: Some(name),
                ..Default::default()
            };
            // Without a severity word, an SXid the catalog does not know counts as non-fatal.
            let fatal = fatal.unwrap_or(false);
            signal(FaultCode::Sxid { code: sxid, fatal }, Some(device), message)
        }
        KernelEvent::PcieAer {
            pci,
            fatal,
            message,
        } => {
            let code = if fatal {
                "PCIE_AER_FATAL"
            } else {
                "PCIE_AER_NONFATAL"
            };
            let device = DeviceRef {
                pci: Some(pci),
                name: Some(format!("pci-{pci}")),
                ..Default::default()
            };
            signal(FaultCode::named(code), Some(device), message)
        }
        KernelEvent::MachineCheck {
            corrected, message, ..
        } => {
            let code = if corrected {
                "MCE_CORRECTED"
            } else {
                "MCE_UNCORRECTED"
            };
            signal(FaultCode::named(code), None, message)
        }
    }
}

/// Reads `/proc/stat`'s `btime`: the wall-clock time of boot.
pub fn boot_time(proc_stat: &Path) -> Option<DateTime<Utc>> {
    let text = std::fs::read_to_string(proc_stat).ok()?;
    let secs: i64 = text
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    DateTime::from_timestamp(secs, 0)
}

/// Runs the source on a dedicated thread until shutdown. Never returns an error: failures are
/// reported as the detector being down, and the thread retries.
pub fn spawn(cfg: KmsgConfig, ctx: SourceContext) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || run(cfg, ctx))
        .unwrap_or_else(|e| panic!("cannot start the kmsg thread: {e}"))
}

fn send_all(ctx: &SourceContext, out: &mut Vec<Input>) -> bool {
    for i in out.drain(..) {
        if ctx.tx.blocking_send(i).is_err() {
            return false;
        }
    }
    true
}

fn detector(ctx: &SourceContext, state: DetectorState, reason: Option<String>) -> bool {
    let obs = Observation::Detector {
        name: "kmsg".into(),
        state,
        reason,
    };
    ctx.tx.blocking_send(Input::Obs(obs)).is_ok()
}

fn run(cfg: KmsgConfig, ctx: SourceContext) {
    let _span = tracing::info_span!("source", name = "kmsg", path = %cfg.path.display()).entered();
    let mut reader: Option<KmsgReader> = None;
    let mut retry = Duration::from_millis(500);
    while !ctx.shutdown.is_cancelled() {
        let file = match File::open(&cfg.path) {
            Ok(f) => f,
            Err(e) => {
                warn!(error = %e, "cannot open the kernel log; retrying");
                if !detector(
                    &ctx,
                    DetectorState::Down,
                    Some(format!("cannot open {}: {e}", cfg.path.display())),
                ) {
                    return;
                }
                std::thread::sleep(retry);
                retry = (retry * 2).min(Duration::from_secs(30));
                continue;
            }
        };
        let is_device = file
            .metadata()
            .map(|m| m.file_type().is_char_device())
            .unwrap_or(false);
        let r = reader.get_or_insert_with(|| {
            KmsgReader::new(
                cfg.resume_after,
                cfg.boot_time,
                is_device,
                ctx.metrics.clone(),
            )
        });
        if !detector(&ctx, DetectorState::Running, None) {
            return;
        }
        info!(device = is_device, resume_after = ?cfg.resume_after, "reading the kernel log");
        retry = Duration::from_millis(500);
        let result = if is_device {
            read_device(file, r, &ctx)
        } else {
            read_lines(file, r, &ctx, cfg.follow_interval)
        };
        match result {
            Ok(()) => return, // shutdown or the engine is gone
            Err(e) => {
                warn!(error = %e, "kernel log read failed; reopening");
                if !detector(&ctx, DetectorState::Down, Some(format!("read failed: {e}"))) {
                    return;
                }
                std::thread::sleep(retry);
            }
        }
    }
}

/// `/dev/kmsg`: one record per read.
fn read_device(mut file: File, r: &mut KmsgReader, ctx: &SourceContext) -> io::Result<()> {
    let mut buf = vec![0u8; 16 * 1024];
    let mut out = Vec::new();
    let mut since_marker = 0u32;
    while !ctx.shutdown.is_cancelled() {
        match file.read(&mut buf) {
            Ok(0) => std::thread::sleep(Duration::from_millis(50)),
            Ok(n) => {
                r.feed(&buf[..n], &mut out);
                since_marker += 1;
                if since_marker >= 256 {
                    r.flush_cursor(&mut out);
                    since_marker = 0;
                }
                if !send_all(ctx, &mut out) {
                    return Ok(());
                }
            }
            Err(e) if e.raw_os_error() == Some(32) => {
                // EPIPE: the ring buffer overwrote records we had not read. The next read
                // returns the oldest record; the seq gap counts the loss.
                ctx.metrics.kmsg_overruns.inc();
                warn!("kernel log overrun (EPIPE); continuing at the oldest record");
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A file or FIFO: bounded lines, followed at its end.
fn read_lines(
    file: File,
    r: &mut KmsgReader,
    ctx: &SourceContext,
    follow: Duration,
) -> io::Result<()> {
    let mut reader = BufReader::with_capacity(64 * 1024, file);
    let mut line = Vec::with_capacity(1024);
    let mut out = Vec::new();
    while !ctx.shutdown.is_cancelled() {
        match read_bounded_line(&mut reader, &mut line, MAX_LINE)? {
            // At the end (possibly mid-line: the rest stays pending): wait for growth.
            LineRead::Eof | LineRead::Partial => {
                r.flush_cursor(&mut out);
                if !send_all(ctx, &mut out) {
                    return Ok(());
                }
                std::thread::sleep(follow);
            }
            LineRead::Line { truncated } => {
                if truncated {
                    ctx.metrics.kmsg_truncated.inc();
                    debug!(
                        kept = MAX_LINE,
                        "kernel log line longer than the limit; kept its start"
                    );
                }
                r.feed(&line, &mut out);
                line.clear();
                if !send_all(ctx, &mut out) {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

enum LineRead {
    Eof,
    /// The input ended mid-line (a writer is mid-line): the start is kept in `line`.
    Partial,
    Line {
        truncated: bool,
    },
}

/// Appends up to `max` bytes of the next line to `line`; bytes past `max` up to the newline are
/// dropped. A line without its newline at the end of the input stays pending in `line`.
fn read_bounded_line<R: BufRead>(
    r: &mut R,
    line: &mut Vec<u8>,
    max: usize,
) -> io::Result<LineRead> {
    let mut truncated = line.len() > max;
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(if line.is_empty() {
                LineRead::Eof
            } else {
                LineRead::Partial
            });
        }
        let (chunk, done) = match memchr::memchr(b'\n', buf) {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        let room = max.saturating_sub(line.len());
        if chunk.len() > room {
            truncated = true;
        }
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        let used = done.unwrap_or(buf.len());
        r.consume(used);
        if done.is_some() {
            return Ok(LineRead::Line { truncated });
        }
        if line.len() >= max {
            // Keep reading to find the end of this line, discarding.
            truncated = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(resume: Option<u64>) -> KmsgReader {
        KmsgReader::new(resume, None, false, Arc::new(Metrics::new()))
    }

    fn feed_all(r: &mut KmsgReader, lines: &[&[u8]]) -> Vec<Input> {
        let mut out = Vec::new();
        for l in lines {
            r.feed(l, &mut out);
        }
        out
    }

    fn signals(out: &[Input]) -> Vec<String> {
        out.iter()
            .filter_map(|i| match i {
                Input::Obs(Observation::Signal(s)) => Some(format!("{}x{}", s.code, s.count)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn records_become_signals_with_cursors() {
        let mut r = reader(None);
        let out = feed_all(
            &mut r,
            &[
                b"6,10,100,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module",
                b"4,11,200,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
                b" SUBSYSTEM=pci",
            ],
        );
        assert_eq!(signals(&out), vec!["Xid79x1"]);
        assert_eq!(out.last(), Some(&Input::KmsgCursor(11)));
    }

    #[test]
    fn sequence_gap_is_reported_as_loss() {
        let mut r = reader(None);
        let out = feed_all(&mut r, &[b"6,1,0,-;a", b"6,2,0,-;b", b"6,50,0,-;c"]);
        assert_eq!(signals(&out), vec!["KMSG_LOSSx47"]);
        assert_eq!(r.metrics.kmsg_lost.get(), 47);
    }

    #[test]
    fn first_record_after_a_wrapped_ring_is_not_loss() {
        let mut r = reader(None);
        let out = feed_all(&mut r, &[b"6,9000,0,-;a", b"6,9001,0,-;b"]);
        assert!(signals(&out).is_empty());
    }

    #[test]
    fn resume_skips_counted_records_and_reports_loss_between_runs() {
        let mut r = reader(Some(11));
        let out = feed_all(
            &mut r,
            &[
                b"4,11,200,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
                b"4,15,300,-;NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception",
            ],
        );
        assert_eq!(signals(&out), vec!["KMSG_LOSSx3", "Xid13x1"]);
        assert_eq!(r.metrics.kmsg_skipped.get(), 1);
    }

    #[test]
    fn malformed_records_are_counted_and_still_scanned() {
        let mut r = reader(None);
        let out = feed_all(
            &mut r,
            &[
                b"4,1x,200;NVRM: Xid (PCI:0000:3b:00): 48, DBE",
                b"4,12",
                b"[  12.000000] NVRM: Xid (PCI:0000:86:00): 95, Uncontained",
                b"\xff\xfe\xfd garbage",
            ],
        );
        assert_eq!(signals(&out), vec!["Xid48x1", "Xid95x1"]);
        assert_eq!(r.metrics.kmsg_malformed.get(), 2);
    }

    #[test]
    fn bounded_lines_truncate_and_continue() {
        let mut data = vec![b'a'; 100];
        data.extend_from_slice(b"\nshort\npartial");
        let mut rd = BufReader::with_capacity(8, &data[..]);
        let mut line = Vec::new();
        assert!(matches!(
            read_bounded_line(&mut rd, &mut line, 10).unwrap(),
            LineRead::Line { truncated: true }
        ));
        assert_eq!(line.len(), 10);
        line.clear();
        assert!(matches!(
            read_bounded_line(&mut rd, &mut line, 10).unwrap(),
            LineRead::Line { truncated: false }
        ));
        assert_eq!(line, b"short");
        line.clear();
        assert!(matches!(
            read_bounded_line(&mut rd, &mut line, 10).unwrap(),
            LineRead::Partial
        ));
        assert_eq!(
            line, b"partial",
            "a line without newline waits for the rest"
        );
        assert!(matches!(
            read_bounded_line(&mut rd, &mut line, 10).unwrap(),
            LineRead::Partial
        ));
    }

    #[test]
    fn every_kernel_event_maps_to_an_observation() {
        let p = "0000:3b:00.0".parse().unwrap();
        let cases = [
            (KernelEvent::FallenOffBus { pci: Some(p) }, "Xid79"),
            (
                KernelEvent::PcieAer {
                    pci: p,
                    fatal: true,
                    message: String::new(),
                },
                "PCIE_AER_FATAL",
            ),
            (
                KernelEvent::PcieAer {
                    pci: p,
                    fatal: false,
                    message: String::new(),
                },
                "PCIE_AER_NONFATAL",
            ),
            (
                KernelEvent::MachineCheck {
                    corrected: true,
                    cpu: None,
                    bank: None,
                    message: String::new(),
                },
                "MCE_CORRECTED",
            ),
            (
                KernelEvent::MachineCheck {
                    corrected: false,
                    cpu: None,
                    bank: None,
                    message: String::new(),
                },
                "MCE_UNCORRECTED",
            ),
            (
                KernelEvent::Sxid {
                    pci: p,
                    sxid: 12028,
                    fatal: Some(false),
                    switch: Some(3),
                    link: None,
                    message: String::new(),
                },
                "SXid12028",
            ),
        ];
        for (ev, code) in cases {
            match to_observation(ev, None) {
                Observation::Signal(s) => assert_eq!(s.code.to_string(), code),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn boot_time_from_proc_stat() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("stat");
        std::fs::write(&p, "cpu 1 2 3\nbtime 1700000000\nprocesses 5\n").unwrap();
        assert_eq!(boot_time(&p).map(|t| t.timestamp()), Some(1_700_000_000));
        std::fs::write(&p, "cpu 1 2 3\n").unwrap();
        assert_eq!(boot_time(&p), None);
    }
}
