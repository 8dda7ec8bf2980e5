//! The kernel log source: `/dev/kmsg`, or a file or FIFO for tests and replays.
//!
//! `/dev/kmsg` returns one record per `read()`; a reader that falls behind gets `EPIPE` once
//! and continues at the oldest record, so the sequence gap is the number of records lost. A file
//! or FIFO is read line by line and followed like `tail -F` (a replaced or truncated file is
//! read anew from its beginning); its lines may be kmsg records or plain `dmesg` text. A FIFO
//! is a stream: nothing read from it is read again, so nothing in it is skipped as already
//! counted. The I/O loop runs on a dedicated thread; the pure core that turns records
//! into engine inputs is `faultline_core::kmsg_reader::KmsgReader`, which reports what it reads
//! through [`ReaderCounters`], implemented here ([`Counters`]) by the agent's metrics and logs.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use parking_lot::Mutex;

use faultline_core::time::Timestamp;
use tracing::{debug, info, warn};

use faultline_core::engine::DetectorState;
pub(crate) use faultline_core::kmsg_reader::{Extent, KmsgReader, ReaderCounters};
use faultline_core::parse::kmsg::RecordError;
use sha2::{Digest, Sha256};

use super::{Input, SourceContext};
use crate::clock::Clock;
use crate::component::{Component, Context, Handle, StartError};
use crate::metrics::{KindLabel, Metrics, DETECTOR_KMSG};
use crate::rate_limit::LogPacer;

/// How often overruns and gaps are logged while they go on.
const LOSS_LOG_EVERY: Duration = Duration::from_secs(10);

/// The reader's counters: the agent's metrics, and the paced loss log.
#[derive(Debug)]
pub(crate) struct Counters {
    metrics: std::sync::Arc<Metrics>,
    gaps: Mutex<LogPacer>,
    clock: std::sync::Arc<dyn Clock>,
}

impl Counters {
    pub(crate) fn new(metrics: std::sync::Arc<Metrics>, clock: std::sync::Arc<dyn Clock>) -> Self {
        Counters {
            metrics,
            gaps: Mutex::new(LogPacer::new(LOSS_LOG_EVERY)),
            clock,
        }
    }
}

impl ReaderCounters for Counters {
    fn record(&self) {
        self.metrics.kmsg_records.inc();
    }
    fn skipped(&self) {
        self.metrics.kmsg_skipped.inc();
    }
    fn malformed(&self, error: &RecordError, line: &str) {
        self.metrics.kmsg_malformed.inc();
        debug!(%error, line, "malformed kmsg record");
    }
    fn lost(&self, lost: u64, next_seq: u64) {
        self.metrics.kmsg_lost.inc_by(lost);
        let due = self.gaps.lock().note(lost, self.clock.instant());
        if let Some((since, total)) = due {
            warn!(
                lost = since.amount,
                gaps = since.times,
                next_seq,
                lost_total = total.amount,
                gaps_total = total.times,
                "kernel log records lost before they were read (since the last such line)"
            );
        }
    }
    fn matched(&self, kind: &'static str) {
        self.metrics
            .kmsg_matched
            .get_or_create(&KindLabel { kind })
            .inc();
    }
    fn user_record(&self) {
        self.metrics.kmsg_user.inc();
    }
    fn out_of_order(&self, seq: u64, last: u64) {
        // Counted with the malformed records: a sequence number that cannot be right.
        self.metrics.kmsg_malformed.inc();
        debug!(
            seq,
            last, "kernel log record out of sequence; scanned, cursor kept"
        );
    }
}

/// Longest line kept from a file; the rest of a longer line is dropped and counted.
pub(crate) const MAX_LINE: usize = 64 * 1024;

/// The kernel-log source's flags.
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Kernel log to read: `/dev/kmsg`, or a file or FIFO of kmsg records or dmesg lines.
    #[arg(long, env = "FAULTLINE_KMSG_PATH", default_value = "/dev/kmsg")]
    pub kmsg_path: PathBuf,
    /// Do not read the kernel log at all.
    #[arg(long, env = "FAULTLINE_NO_KMSG", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_kmsg: bool,
    /// How often a kernel log file at its end is checked for growth.
    #[arg(long, env = "FAULTLINE_FOLLOW_INTERVAL", default_value = "10ms", value_parser = humantime::parse_duration)]
    pub follow_interval: Duration,
    /// Nice value of the kernel-log reader's thread (-20 to 19; 0 leaves it). A reader that
    /// falls behind the kernel's ring loses records (`faultline_kmsg_lost_records_total`); at
    /// -5 the reader weighs three times a normal process while records arrive, and uses no CPU
    /// otherwise. Needs CAP_SYS_NICE (the DaemonSet is privileged); without it the agent says so
    /// and reads at its own priority.
    #[arg(long, env = "FAULTLINE_KMSG_NICE", default_value_t = -5, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub kmsg_nice: i32,
}

impl Flags {
    /// The source's configuration, resuming where the restored state left off; `None` with
    /// `--no-kmsg`.
    pub(crate) fn config(
        &self,
        resume_after: Option<faultline_core::engine::KmsgPosition>,
        skip_through: Option<Timestamp>,
        boot_time: Timestamp,
    ) -> Option<KmsgConfig> {
        if self.no_kmsg {
            info!("kernel log source disabled");
            return None;
        }
        Some(KmsgConfig {
            path: self.kmsg_path.clone(),
            resume_after,
            skip_through,
            boot_time: Some(boot_time),
            follow_interval: self.follow_interval,
            nice: self.kmsg_nice,
        })
    }
}

/// Configuration of the kernel log source.
#[derive(Debug, Clone)]
pub(crate) struct KmsgConfig {
    pub path: PathBuf,
    /// Skip records up to this position (same boot, already counted).
    pub resume_after: Option<faultline_core::engine::KmsgPosition>,
    /// Wall-clock time of boot, to date records from their monotonic timestamps.
    pub boot_time: Option<Timestamp>,
    /// Records dated at or before this are skipped: the engine was rebuilt from a record written
    /// then, without a cursor (state.json was lost).
    pub skip_through: Option<Timestamp>,
    /// How often a file at its end is checked for growth.
    pub follow_interval: Duration,
    /// The reader thread's nice value (0: left as it is).
    pub nice: i32,
}

/// Reads `/proc/stat`'s `btime`: the wall-clock time of boot.
pub(crate) fn boot_time(proc_stat: &Path) -> Option<Timestamp> {
    let text = std::fs::read_to_string(proc_stat).ok()?;
    let secs: i64 = text
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Timestamp::from_second(secs).ok()
}

/// Runs the source on a dedicated thread until shutdown. Never returns an error: failures are
/// reported as the detector being down, and the thread retries.
/// If the thread dies (a panic), the detector is reported Down.
pub(crate) fn spawn(cfg: KmsgConfig, ctx: SourceContext) -> std::thread::JoinHandle<()> {
    let on_death = super::report_down(DETECTOR_KMSG, &ctx);
    let shutdown = ctx.shutdown.clone();
    super::spawn_watched("kmsg", shutdown, move || run(cfg, ctx), on_death)
        .unwrap_or_else(|e| panic!("cannot start the kmsg thread: {e}"))
}

impl Component for KmsgConfig {
    const NAME: &'static str = "kmsg";

    /// On a thread of its own: a read of `/dev/kmsg` cannot be cancelled, so the thread is not
    /// joined; it stops at its next record after shutdown.
    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        spawn(self, cx.source());
        Ok(Handle::none())
    }
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
    let obs = super::detector(DETECTOR_KMSG, state, reason);
    ctx.tx.blocking_send(Input::Obs(obs)).is_ok()
}

/// Sets the calling thread's nice value: on Linux `setpriority(PRIO_PROCESS, 0, …)` applies to
/// the calling thread only (setpriority(2), NOTES: the nice value is a per-thread attribute).
/// The kernel log must be read as fast as the kernel writes it: the ring overwrites what a
/// reader starved of CPU has not read yet.
fn set_reader_nice(nice: i32) {
    if nice == 0 {
        return;
    }
    match rustix::process::setpriority_process(None, nice) {
        Ok(()) => info!(nice, "kernel-log reader thread's nice value set"),
        Err(e) => warn!(
            nice,
            error = %e,
            "cannot set the kernel-log reader thread's nice value (needs CAP_SYS_NICE); reading \
             at the agent's priority, which loses records sooner when the CPU is busy"
        ),
    }
}

fn run(cfg: KmsgConfig, ctx: SourceContext) {
    let _span = tracing::info_span!("source", name = "kmsg", path = %cfg.path.display()).entered();
    set_reader_nice(cfg.nice);
    let mut reader: Option<KmsgReader> = None;
    let mut retry =
        crate::backoff::Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    let mut follow = Follow::default();
    let mut opening = Opening::First;
    while !ctx.shutdown.is_cancelled() {
        let fifo = std::fs::metadata(&cfg.path).is_ok_and(|m| m.file_type().is_fifo());
        if fifo {
            // Opening a FIFO for reading blocks until a writer opens it: say so first, so the
            // record shows the detector and why it sees nothing.
            let why = format!(
                "waiting for a writer to open the FIFO {}",
                cfg.path.display()
            );
            info!("{why}");
            if !detector(&ctx, DetectorState::Starting, Some(why)) {
                return;
            }
        }
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
                std::thread::sleep(retry.next_delay());
                continue;
            }
        };
        let meta = file.metadata().ok();
        let is_device = meta
            .as_ref()
            .is_some_and(|m| m.file_type().is_char_device());
        let regular = meta.as_ref().is_some_and(|m| m.is_file());
        // Anything but the device or a regular file (a FIFO) is a stream: read once, never
        // replayed, so nothing read from it is skipped.
        let stream = meta.is_some() && !regular && !is_device;
        let r = reader.get_or_insert_with(|| {
            KmsgReader::new(
                cfg.resume_after,
                cfg.boot_time,
                is_device,
                std::sync::Arc::new(Counters::new(ctx.metrics.clone(), ctx.clock.clone())),
            )
            .skip_through(cfg.skip_through)
        });
        let identity = meta
            .as_ref()
            .filter(|_| !is_device)
            .map(|m| (m.dev(), m.ino()));
        let log = identity.map(log_name);
        match opening {
            Opening::NewFile => r.new_log(log),
            Opening::AfterError => r.reopened(),
            Opening::First => {
                let read = cfg.resume_after.and_then(|p| p.read).filter(|_| regular);
                check_saved_log(r, &file, log, read);
            }
        }
        if stream && r.stream() {
            info!(
                "the kernel log is a FIFO: it replays nothing, so the saved position resumes \
                 nothing; every line read from it is new"
            );
        }
        // In band, before this log's first record: whether a restart reads its records again
        // (the engine loop publishes those before it saves them; a FIFO's it saves first).
        if ctx.tx.blocking_send(Input::KmsgReplays(!stream)).is_err()
            || !detector(&ctx, DetectorState::Running, follow.reason(&cfg.path))
        {
            return;
        }
        info!(device = is_device, resume_after = ?cfg.resume_after, "reading the kernel log");
        retry.reset();
        let result = if is_device {
            read_device(file, r, &ctx).map(|()| Ended::Stopped)
        } else {
            let mut lines = Lines {
                path: &cfg.path,
                identity,
                regular,
                follow: &mut follow,
                interval: cfg.follow_interval,
            };
            lines.read(file, r, &ctx)
        };
        match result {
            Ok(Ended::Stopped) => return, // shutdown or the engine is gone
            Ok(Ended::Replaced) => opening = Opening::NewFile,
            Err(e) => {
                opening = Opening::AfterError;
                warn!(error = %e, "kernel log read failed; reopening");
                if !detector(&ctx, DetectorState::Down, Some(format!("read failed: {e}"))) {
                    return;
                }
                std::thread::sleep(retry.next_delay());
            }
        }
    }
}

/// Why the path is opened (again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// At start: the saved position may resume in this log.
    First,
    /// After a read error: the same log, read again from its oldest record.
    AfterError,
    /// Another file is at the path: read from its beginning, all new.
    NewFile,
}

/// At the first open, drops the saved position when the file at the path is not the log it
/// was taken in: another file (device and inode), or the same one with other bytes up to
/// `read` (a regular file's saved extent).
fn check_saved_log(r: &mut KmsgReader, file: &File, log: Option<u64>, read: Option<Extent>) {
    if r.in_log(log) {
        warn!(
            "the kernel-log file at the path is not the one the saved position was taken in \
             (replaced while the agent was not running); reading all of it as new"
        );
    } else if let Some(read) = read {
        // Same device and inode, other bytes: a file rewritten in place (`O_TRUNC` keeps the
        // inode), or a new one given the old inode number. A regular file only: reading a
        // FIFO that took the old inode number would consume lines no one then parses. (A
        // read error here is the read loop's to report.)
        if starts_with(file, read).is_ok_and(|same| !same) {
            r.new_log(log);
            warn!(
                "the kernel-log file at the path no longer starts with what the saved \
                 position was taken after (rewritten while the agent was not running); \
                 reading all of it as new"
            );
        }
    }
}

/// A file's name as a log ([`faultline_core::engine::KmsgPosition::log`]): its device and inode.
fn log_name((dev, ino): (u64, u64)) -> u64 {
    dev.rotate_left(32) ^ ino
}

/// Whether the file starts with the bytes `read` describes; reads them, then rewinds.
fn starts_with(file: &File, read: Extent) -> io::Result<bool> {
    let mut prefix = Prefix::default();
    let copied = io::copy(&mut file.take(read.bytes), &mut prefix)?;
    (&*file).rewind()?;
    Ok(copied == read.bytes && prefix.extent() == read)
}

/// The bytes of a file read so far, counted and hashed (SHA-256: the same in every build, so a
/// saved [`Extent`] still compares after an upgrade).
#[derive(Default)]
struct Prefix {
    bytes: u64,
    hash: Sha256,
}

impl Prefix {
    fn extent(&self) -> Extent {
        let digest = self.hash.clone().finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        Extent {
            bytes: self.bytes,
            hash: u64::from_be_bytes(first),
        }
    }
}

impl Write for Prefix {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.bytes += buf.len() as u64;
        self.hash.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Why the line reader stopped.
enum Ended {
    /// Shutdown, or the engine is gone.
    Stopped,
    /// Another file is at the path now (the old one was renamed away or removed, and the new
    /// one put in its place): the old one was read to its end.
    Replaced,
}

/// How often the followed file was replaced or cut short, for the detector's reason.
#[derive(Debug, Default)]
struct Follow {
    rotated: u64,
    truncated: u64,
}

impl Follow {
    fn reason(&self, path: &Path) -> Option<String> {
        (self.rotated + self.truncated > 0).then(|| {
            format!(
                "following {}: replaced {} times, truncated {} times; each new file was read \
                 from its beginning",
                path.display(),
                self.rotated,
                self.truncated
            )
        })
    }
}

/// How many records without a fault the device reader reads, at most, before it tells the
/// engine how far it got (a fault carries its own position). Each message wakes the engine loop,
/// and at a high record rate those wake-ups take the CPU the reader needs to keep up with the
/// ring (at one per 256 records: 700 wake-ups a second at 180,000 records a second, and
/// records lost where a plain reader loses none).
const CURSOR_EVERY: u32 = 4096;

/// Once the reader has caught up with the ring, how long it waits for more before it tells the
/// engine its position anyway. So the saved position is the last record read whenever the log
/// has been quiet this long: a restart reads nothing again, and a ring that wrapped while the
/// agent was down shows no loss that did not happen (the gap from a position left behind would
/// be counted as lost records).
const CURSOR_QUIET: Duration = Duration::from_millis(50);

/// Waits until `file` has a record to read, for at most `timeout` (`None`: as long as it takes).
/// False when the time ran out.
fn readable(file: &File, timeout: Option<Duration>) -> io::Result<bool> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let timeout = timeout.map(|t| Timespec {
        tv_sec: t.as_secs() as i64,
        tv_nsec: i64::from(t.subsec_nanos()),
    });
    let mut fds = [PollFd::new(file, PollFlags::IN)];
    loop {
        match poll(&mut fds, timeout.as_ref()) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// `/dev/kmsg`: one record per read, without blocking; at the ring's end the reader waits in
/// `poll`. The loop does no more per record than parse it: the shutdown token (a lock) is
/// checked with the position (a blocked wait is not interrupted by it anyway).
fn read_device(mut file: File, r: &mut KmsgReader, ctx: &SourceContext) -> io::Result<()> {
    rustix::fs::fcntl_setfl(&file, rustix::fs::OFlags::NONBLOCK)?;
    let mut buf = vec![0u8; 16 * 1024];
    let mut out = Vec::new();
    let mut since_marker = 0u32;
    let mut overruns = LogPacer::new(LOSS_LOG_EVERY);
    let clock = ctx.clock.clone();
    loop {
        let flush = match file.read(&mut buf) {
            // Not the kernel's device (another character device given as the path): nothing
            // more will come; look again later rather than spin.
            Ok(0) => {
                std::thread::sleep(Duration::from_millis(50));
                ctx.shutdown.is_cancelled()
            }
            Ok(n) => {
                r.feed(&buf[..n], &mut out);
                since_marker += 1;
                since_marker >= CURSOR_EVERY
            }
            // At the ring's end: the position goes out once the log has been quiet a moment.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let wait = (since_marker > 0).then_some(CURSOR_QUIET);
                !readable(&file, wait)?
            }
            Err(e) if e.raw_os_error() == Some(32) => {
                // EPIPE: the ring buffer overwrote records we had not read. The next read
                // returns the oldest record; the seq gap counts the loss.
                ctx.metrics.kmsg_overruns.inc();
                if let Some((since, total)) = overruns.note(1, clock.instant()) {
                    warn!(
                        overruns = since.times,
                        overruns_total = total.times,
                        "kernel log overrun (EPIPE): reading is behind; continuing at the oldest \
                         record (since the last such line)"
                    );
                }
                false
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => false,
            Err(e) => return Err(e),
        };
        if flush {
            r.flush_cursor(&mut out);
            since_marker = 0;
            if ctx.shutdown.is_cancelled() {
                return Ok(());
            }
        }
        if !out.is_empty() && !send_all(ctx, &mut out) {
            return Ok(());
        }
    }
}

/// A file or FIFO read line by line and followed at its end like `tail -F`: a file replaced at
/// the path (a new inode there: rotation) is noticed and the new one read from its beginning,
/// after the old one was read to its end; a file cut below the read offset (truncation) is read
/// again from its beginning. Both say so in the detector's reason, the log and
/// `faultline_kmsg_new_files_total`. (GNU coreutils `tail.c`, `tail_forever` and
/// `recheck`: a changed device/inode at the name is a new file, a size below the offset is a
/// truncation; both are read from their start.)
struct Lines<'a> {
    path: &'a Path,
    /// Device and inode of the open file.
    identity: Option<(u64, u64)>,
    /// A regular file (a FIFO has no size to check for truncation).
    regular: bool,
    follow: &'a mut Follow,
    interval: Duration,
}

impl Lines<'_> {
    fn read(&mut self, file: File, r: &mut KmsgReader, ctx: &SourceContext) -> io::Result<Ended> {
        let mut reader = BufReader::with_capacity(64 * 1024, file);
        let mut line = Vec::with_capacity(1024);
        let mut out = Vec::new();
        // What was taken from the file (a regular one: its records' positions carry it).
        let mut prefix = Prefix::default();
        // Set once another file is at the path: the old one is read to its end first.
        let mut replaced = false;
        while !ctx.shutdown.is_cancelled() {
            match read_bounded_line(&mut reader, &mut line, MAX_LINE, &mut prefix)? {
                // At the end (possibly mid-line: the rest stays pending): wait for growth.
                LineRead::Eof | LineRead::Partial => {
                    if replaced {
                        // The writer moved on to the new file: a last unfinished line is whole.
                        if !line.is_empty() {
                            self.read_to(r, &prefix);
                            r.feed(&line, &mut out);
                        }
                        r.flush_cursor(&mut out);
                        send_all(ctx, &mut out);
                        return Ok(Ended::Replaced);
                    }
                    if self.replaced_at_path() {
                        replaced = true;
                        self.follow.rotated += 1;
                        ctx.metrics
                            .kmsg_new_files
                            .get_or_create(&KindLabel { kind: "rotated" })
                            .inc();
                        warn!(
                            "another file is at the kernel-log path (rotated); reading the old \
                             one to its end, then the new one from its beginning"
                        );
                        continue;
                    }
                    if self.truncated(&mut reader)? {
                        line.clear();
                        prefix = Prefix::default();
                        r.new_log(self.identity.map(log_name));
                        self.follow.truncated += 1;
                        ctx.metrics
                            .kmsg_new_files
                            .get_or_create(&KindLabel { kind: "truncated" })
                            .inc();
                        warn!("the kernel-log file was truncated; reading it from its beginning");
                        r.flush_cursor(&mut out);
                        if !send_all(ctx, &mut out)
                            || !detector(ctx, DetectorState::Running, self.follow.reason(self.path))
                        {
                            return Ok(Ended::Stopped);
                        }
                        continue;
                    }
                    r.flush_cursor(&mut out);
                    if !send_all(ctx, &mut out) {
                        return Ok(Ended::Stopped);
                    }
                    std::thread::sleep(self.interval);
                }
                LineRead::Line { truncated } => {
                    if truncated {
                        ctx.metrics.kmsg_truncated.inc();
                        debug!(
                            kept = MAX_LINE,
                            "kernel log line longer than the limit; kept its start"
                        );
                    }
                    self.read_to(r, &prefix);
                    r.feed(&line, &mut out);
                    line.clear();
                    if !send_all(ctx, &mut out) {
                        return Ok(Ended::Stopped);
                    }
                }
            }
        }
        Ok(Ended::Stopped)
    }

    /// Tells the reader how much of a regular file is read with the line it is fed next.
    fn read_to(&self, r: &mut KmsgReader, prefix: &Prefix) {
        if self.regular {
            r.read_to(prefix.extent());
        }
    }

    /// Another file is at the path: its device or inode differs from the open file's. A path
    /// that names nothing for now (renamed away, the new file not there yet) is not a new
    /// file: the open one is followed until one appears.
    fn replaced_at_path(&self) -> bool {
        match std::fs::metadata(self.path) {
            Ok(m) => self.identity.is_some_and(|id| id != (m.dev(), m.ino())),
            Err(_) => false,
        }
    }

    /// The file is shorter than what was read of it: cut short, and (by the caller) read again
    /// from its beginning.
    fn truncated(&self, reader: &mut BufReader<File>) -> io::Result<bool> {
        if !self.regular {
            return Ok(false);
        }
        let size = reader.get_ref().metadata()?.len();
        let offset = reader.stream_position()?;
        if size >= offset {
            return Ok(false);
        }
        reader.seek(io::SeekFrom::Start(0))?;
        Ok(true)
    }
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
/// dropped. A line without its newline at the end of the input stays pending in `line`. Every
/// byte taken from `r` is added to `taken`.
fn read_bounded_line<R: BufRead>(
    r: &mut R,
    line: &mut Vec<u8>,
    max: usize,
    taken: &mut Prefix,
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
        taken.write_all(&buf[..used])?;
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

    #[test]
    fn bounded_lines_truncate_and_continue() {
        let mut data = vec![b'a'; 100];
        data.extend_from_slice(b"\nshort\npartial");
        let mut rd = BufReader::with_capacity(8, &data[..]);
        let mut line = Vec::new();
        let mut taken = Prefix::default();
        assert!(matches!(
            read_bounded_line(&mut rd, &mut line, 10, &mut taken).unwrap(),
            LineRead::Line { truncated: true }
        ));
        assert_eq!(line.len(), 10);
        line.clear();
        assert!(matches!(
            read_bounded_line(&mut rd, &mut line, 10, &mut taken).unwrap(),
            LineRead::Line { truncated: false }
        ));
        assert_eq!(line, b"short");
        line.clear();
        assert!(matches!(
            read_bounded_line(&mut rd, &mut line, 10, &mut taken).unwrap(),
            LineRead::Partial
        ));
        assert_eq!(
            line, b"partial",
            "a line without newline waits for the rest"
        );
        assert!(matches!(
            read_bounded_line(&mut rd, &mut line, 10, &mut taken).unwrap(),
            LineRead::Partial
        ));
        let mut whole = Prefix::default();
        whole.write_all(&data).unwrap();
        assert_eq!(
            taken.extent(),
            whole.extent(),
            "every byte taken, dropped ones too"
        );
        assert_eq!(taken.extent().bytes, data.len() as u64);
    }

    #[test]
    fn boot_time_from_proc_stat() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("stat");
        std::fs::write(&p, "cpu 1 2 3\nbtime 1700000000\nprocesses 5\n").unwrap();
        assert_eq!(boot_time(&p).map(|t| t.as_second()), Some(1_700_000_000));
        std::fs::write(&p, "cpu 1 2 3\n").unwrap();
        assert_eq!(boot_time(&p), None);
    }
}
