//! The kernel log reader's pure core: raw `/dev/kmsg` records (or dmesg-style lines) in,
//! engine [`Input`]s out, with sequence-gap accounting. The thread that reads the device, and
//! the metrics these counts feed, live in the agent (`source::kmsg`); this module does no I/O.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use jiff::{SignedDuration, Timestamp};

use crate::catalog::FaultCode;
use crate::engine::{DeviceRef, Input, Observation, Signal};
pub use crate::kmsg_position::{Extent, KmsgPosition};
use crate::parse::kmsg::{facility_of, strip_dmesg_time, strip_syslog_pri, RecordError};
use crate::parse::{parse_message, parse_record, KernelEvent};
use crate::record::Source;

/// Where the reader reports what it read. The agent implements it with its Prometheus
/// metrics and logs; [`Tally`] keeps plain counts (tests, fuzzing).
pub trait ReaderCounters: Send + Sync + fmt::Debug {
    /// One record or line was read.
    fn record(&self);
    /// A record at or below the resume cursor was skipped (already counted before a restart).
    fn skipped(&self);
    /// A record whose header could not be parsed; `line` is its start, for the log.
    fn malformed(&self, error: &RecordError, line: &str);
    /// `lost` records were missing before the record with sequence number `next_seq`.
    fn lost(&self, lost: u64, next_seq: u64);
    /// A message matched a parser; `kind` is [`KernelEvent::kind`].
    fn matched(&self, kind: &'static str);
    /// A record the kernel did not write (its facility is not 0: user space wrote it to
    /// `/dev/kmsg`); its message was not scanned.
    fn user_record(&self);
    /// A record whose sequence number is not where it can be (`seq`, after `last`): backwards
    /// after the reader caught up, or implausibly far ahead. Its message was still scanned.
    fn out_of_order(&self, seq: u64, last: u64);
}

/// A forward jump in sequence numbers larger than this is not a loss but a corrupt number
/// (2^40 records is a hundred thousand a second, the most a kernel log sustains, for 127 days).
pub const MAX_PLAUSIBLE_GAP: u64 = 1 << 40;

/// Plain counters.
#[derive(Debug, Default)]
pub struct Tally {
    pub records: AtomicU64,
    pub skipped: AtomicU64,
    pub malformed: AtomicU64,
    pub lost: AtomicU64,
    pub matched: AtomicU64,
    pub out_of_order: AtomicU64,
    pub user_records: AtomicU64,
}

impl Tally {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

impl ReaderCounters for Tally {
    fn record(&self) {
        self.records.fetch_add(1, Ordering::Relaxed);
    }
    fn skipped(&self) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
    }
    fn malformed(&self, _: &RecordError, _: &str) {
        self.malformed.fetch_add(1, Ordering::Relaxed);
    }
    fn lost(&self, lost: u64, _: u64) {
        self.lost.fetch_add(lost, Ordering::Relaxed);
    }
    fn matched(&self, _: &'static str) {
        self.matched.fetch_add(1, Ordering::Relaxed);
    }
    fn out_of_order(&self, _: u64, _: u64) {
        self.out_of_order.fetch_add(1, Ordering::Relaxed);
    }
    fn user_record(&self) {
        self.user_records.fetch_add(1, Ordering::Relaxed);
    }
}

/// A record's number as read.
#[derive(Debug, Clone, Copy)]
enum Number {
    /// From a well-formed header.
    Header(u64),
    /// From a header that is otherwise broken: believed only when it is the next one expected
    /// (a truncated number could be anything).
    Damaged(u64),
    None,
}

/// What a record does to the position.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// The next numbered record, after `lost` missing ones.
    Next { seq: u64, lost: u64 },
    /// No usable number; `out_of_order` is `(seq, last)` for a number that cannot be right
    /// (backwards, or implausibly far ahead of `last`).
    Unsequenced { out_of_order: Option<(u64, u64)> },
}

/// The pure core: bytes in, engine inputs out.
#[derive(Debug)]
pub struct KmsgReader {
    /// The last record with a usable sequence number.
    last_seq: Option<u64>,
    /// Records without a usable sequence number read since that one (or since the start).
    unsequenced: u64,
    /// The log being read ([`KmsgPosition::log`]).
    log: Option<u64>,
    /// How much of a regular file is read with the current record, and with the one before it
    /// ([`KmsgPosition::read`]).
    read: Option<Extent>,
    read_before: Option<Extent>,
    /// While the log is read again from its oldest record (a restart, a reopen): the position
    /// already counted. Records are placed as usual but not counted until the reader is there,
    /// so each record gets the place it had the first time.
    replay: Option<KmsgPosition>,
    /// The log is a stream ([`Self::stream`]): nothing in it is read twice, so nothing replays.
    stream: bool,
    /// Records dated at or before this were already seen (the engine was rebuilt from a record
    /// written then, and the cursor was lost); skipped like replayed ones.
    skip_through: Option<Timestamp>,
    boot_time: Option<Timestamp>,
    use_record_time: bool,
    counters: Arc<dyn ReaderCounters>,
    unsent_cursor: bool,
    /// Messages scanned so far, and the last few SXid reports as `(switch, sxid, at message)`:
    /// a severity line merges into a report of the same SXid at most
    /// [`SXID_COMPANION_WITHIN`] messages before it.
    scanned: u64,
    recent_sxid: std::collections::VecDeque<(crate::parse::PciAddr, u32, u64)>,
}

/// How many messages after its SXid report a `Severity …` line still belongs to it. The driver
/// prints the report and its detail lines back to back; a few lines of slack cover other
/// messages interleaved by other CPUs.
pub const SXID_COMPANION_WITHIN: u64 = 8;

impl KmsgReader {
    /// A reader of a log read from its oldest record; with `resume`, the position the previous
    /// run saved (same boot): records up to it are skipped as already counted.
    pub fn new(
        resume: Option<KmsgPosition>,
        boot_time: Option<Timestamp>,
        use_record_time: bool,
        counters: Arc<dyn ReaderCounters>,
    ) -> Self {
        KmsgReader {
            last_seq: None,
            unsequenced: 0,
            log: None,
            read: None,
            read_before: None,
            replay: resume.filter(|p| !p.is_start()),
            stream: false,
            skip_through: None,
            boot_time,
            use_record_time,
            counters,
            unsent_cursor: false,
            scanned: 0,
            recent_sxid: std::collections::VecDeque::new(),
        }
    }

    /// Skips records dated at or before `t` (they are in the record the engine was rebuilt
    /// from). Only records the reader can date (device mode, boot time known) are skipped.
    pub fn skip_through(mut self, t: Option<Timestamp>) -> Self {
        self.skip_through = t;
        self
    }

    /// Names the log read ([`KmsgPosition::log`]). A position saved in another log resumes
    /// nothing: that log's records are not this one's (a file replaced while the agent was not
    /// running), so every record here is new. Returns whether the resume position was dropped.
    pub fn in_log(&mut self, log: Option<u64>) -> bool {
        self.log = log;
        let other = self.replay.is_some_and(|p| p.log != log);
        if other {
            self.replay = None;
        }
        other
    }

    /// The log is a stream, a FIFO: a pipe hands each byte it holds to one read only, so what
    /// is read from it was never read before, by this run or an earlier one. Nothing in it is
    /// skipped: the saved position resumes nothing and a reopen replays nothing. (A writer that
    /// sends its old lines again, `journalctl -kf`'s last ten, is counted again: its lines have
    /// no identity the reader could trust; even the sequence numbers are whatever the writer
    /// copied, so skipping by them could hide faults from another log.) Returns whether a
    /// resume position was dropped.
    pub fn stream(&mut self) -> bool {
        self.stream = true;
        self.replay.take().is_some()
    }

    /// The log is being read again from its oldest record (the source reopened it): what was
    /// read already is expected again and skipped, not counted twice. A stream is not read
    /// again: it goes on where it was.
    pub fn reopened(&mut self) {
        if self.stream {
            return;
        }
        let to = self.replay.unwrap_or(self.position());
        self.replay = Some(to).filter(|p| !p.is_start());
        self.last_seq = None;
        self.unsequenced = 0;
        self.read = None;
        self.read_before = None;
    }

    /// The next record fed ends where `read` ends in a regular file: positions from it on carry
    /// it ([`KmsgPosition::read`]).
    pub fn read_to(&mut self, read: Extent) {
        self.read_before = self.read.replace(read);
    }

    /// The log at the path is a new one (the file was replaced or truncated): it is read from
    /// its beginning and every record in it is new. The position starts over, and is sent at
    /// the next [`Self::flush_cursor`] (a restart then resumes in the new log).
    pub fn new_log(&mut self, log: Option<u64>) {
        self.log = log;
        self.replay = None;
        self.stream = false;
        self.read = None;
        self.read_before = None;
        self.skip_through = None;
        self.last_seq = None;
        self.unsequenced = 0;
        self.recent_sxid.clear();
        self.unsent_cursor = true;
    }

    /// The highest sequence number read so far.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Where the reader is: what a restart resumes after once it is saved.
    pub fn position(&self) -> KmsgPosition {
        KmsgPosition {
            seq: self.last_seq,
            unsequenced: self.unsequenced,
            log: self.log,
            read: self.read,
        }
    }

    /// Handles one record (device mode) or one line (file mode).
    pub fn feed(&mut self, raw: &[u8], out: &mut Vec<Input>) {
        if raw.first() == Some(&b' ') {
            return; // continuation line of the previous record (file mode)
        }
        self.counters.record();
        let parsed = parse_record(raw);
        let lossy;
        let (number, message, facility, at) = match &parsed {
            Ok(rec) => (
                Number::Header(rec.seq),
                rec.message.as_ref(),
                rec.facility,
                self.record_time(rec.usec),
            ),
            Err(e) => {
                lossy = String::from_utf8_lossy(raw);
                let first = lossy.split('\n').next().unwrap_or_default();
                if looks_like_header(raw) {
                    // A truncated or corrupt record: say so, and still scan what is there. A
                    // broken header still says who wrote the record when its first field
                    // reads, and its message follows the `;`.
                    self.counters.malformed(e, truncate(&lossy, 120));
                    (
                        header_seq(raw).map_or(Number::None, Number::Damaged),
                        first.split_once(';').map_or(first, |(_, m)| m),
                        header_pri(raw).map_or(KERNEL_FACILITY, facility_of),
                        None,
                    )
                } else if let Some((pri, rest)) = strip_syslog_pri(first) {
                    // A `dmesg -r` line starts with its `<pri>`.
                    (Number::None, strip_dmesg_time(rest), facility_of(pri), None)
                } else {
                    // A plain dmesg line says nothing, and is taken as the kernel's (see `scan`).
                    (Number::None, strip_dmesg_time(first), KERNEL_FACILITY, None)
                }
            }
        };
        let mut place = self.place(number);
        if let Some(to) = self.replay {
            let beyond = matches!(place, Place::Next { seq, .. } if Some(seq) > to.seq);
            if !beyond {
                // Read before: placed, not counted.
                self.advance(place);
                self.counters.skipped();
                self.remember(message, facility);
                if self.position().place() >= to.place() {
                    self.replay = None;
                }
                return;
            }
            // Past the saved position without meeting it (records the ring overwrote, or a log
            // that changed): go on from the saved position; the gap is loss.
            self.replay = None;
            self.last_seq = to.seq;
            self.unsequenced = to.unsequenced;
            place = self.place(number);
        }
        if at.is_some_and(|t| self.skip_through.is_some_and(|s| t <= s)) {
            // Already in the record the engine was rebuilt from; the cursor follows so the next
            // restart resumes after it.
            self.counters.skipped();
            self.advance(place);
            self.remember(message, facility);
            self.unsent_cursor = true;
            return;
        }
        match place {
            Place::Next { seq, lost } if lost > 0 => self.report_loss(lost, seq, out),
            Place::Unsequenced {
                out_of_order: Some((seq, last)),
            } => {
                // Not where a sequence number can be: report it, keep the fault; the record is
                // placed as one without a number.
                self.counters.out_of_order(seq, last);
            }
            _ => {}
        }
        self.advance(place);
        match self.scan(message, facility, at) {
            Some(obs) => {
                // A fault and the cursor covering it, in one input.
                out.push(Input::Kmsg {
                    obs,
                    at: self.position(),
                });
                self.unsent_cursor = false;
            }
            None => self.unsent_cursor = true,
        }
    }

    /// Where a record with this number goes, from the last numbered record.
    fn place(&self, number: Number) -> Place {
        let unsequenced = |out_of_order| Place::Unsequenced { out_of_order };
        match (number, self.last_seq) {
            (Number::Header(seq), None) => Place::Next { seq, lost: 0 },
            (Number::Header(seq), Some(last)) => {
                if seq > last && seq - last - 1 <= MAX_PLAUSIBLE_GAP {
                    Place::Next {
                        seq,
                        lost: seq - last - 1,
                    }
                } else {
                    unsequenced(Some((seq, last)))
                }
            }
            (Number::Damaged(seq), Some(last)) if last.checked_add(1) == Some(seq) => {
                Place::Next { seq, lost: 0 }
            }
            _ => unsequenced(None),
        }
    }

    fn advance(&mut self, place: Place) {
        match place {
            Place::Next { seq, .. } => {
                self.last_seq = Some(seq);
                self.unsequenced = 0;
            }
            Place::Unsequenced { .. } => self.unsequenced += 1,
        }
    }

    /// Wall-clock time of a record from its kernel timestamp, when the reader dates records.
    fn record_time(&self, usec: u64) -> Option<Timestamp> {
        if !self.use_record_time {
            return None;
        }
        let b = self.boot_time?;
        b.checked_add(SignedDuration::from_micros(usec.min(i64::MAX as u64) as i64))
            .ok()
    }

    /// A cursor marker for records read since the last marker, if any.
    pub fn flush_cursor(&mut self, out: &mut Vec<Input>) {
        if self.unsent_cursor {
            out.push(Input::KmsgCursor(self.position()));
            self.unsent_cursor = false;
        }
    }

    /// Reports the `lost` records before `seq`; the report carries the cursor just before `seq`,
    /// so the gap is accounted for exactly once whenever the state is saved.
    fn report_loss(&mut self, lost: u64, seq: u64, out: &mut Vec<Input>) {
        self.counters.lost(lost, seq);
        let mut s = Signal::new(
            Source::Agent,
            FaultCode::named("KMSG_LOSS"),
            None,
            // No number here: the fault's message is its first report's, while its count
            // grows with every gap; the count is the number of records lost in total.
            "kernel log records were lost before faultline read them (the count is how many)",
        );
        s.count = lost;
        out.push(Input::Kmsg {
            obs: Observation::Signal(s),
            at: KmsgPosition {
                log: self.log,
                read: self.read_before,
                ..KmsgPosition::at_seq(seq - 1)
            },
        });
    }

    /// Parses a message into its observation, if it is one the parsers know and the kernel
    /// wrote it.
    ///
    /// Only the kernel writes facility 0 (`LOG_KERN`). A record written to `/dev/kmsg` from
    /// user space gets `LOG_USER` (1) unless its `<N>` prefix names another non-zero facility:
    /// Linux `kernel/printk/printk.c`, `devkmsg_write` (`facility = 1; /* LOG_USER */`, and a
    /// prefix changes it only `if (LOG_FACILITY(u) != 0)`), as the kernel's
    /// `Documentation/ABI/testing/dev-kmsg` states ("Injecting messages with the facility
    /// number LOG_KERN (0) is not possible"). So whoever may write `/dev/kmsg` can put any text
    /// in the log, never a facility-0 record. A dmesg-format line (file mode) carries no
    /// facility: it is scanned, since the file's writer already decides everything in it.
    /// A record skipped because it was counted before (a replay after a restart): nothing is
    /// sent for it, but it still takes its place in what the next records are judged against,
    /// so an SXid's `Severity …` line read after a restart merges into the report before it,
    /// as it did the first time (it was counted once, with its report).
    fn remember(&mut self, msg: &str, facility: u32) {
        if facility != KERNEL_FACILITY {
            return;
        }
        self.scanned += 1;
        if let Some(KernelEvent::Sxid { pci, sxid, .. }) = parse_message(msg) {
            self.note_sxid(pci, sxid);
        }
    }

    fn note_sxid(&mut self, pci: crate::parse::PciAddr, sxid: u32) {
        if self.recent_sxid.len() == SXID_COMPANION_WITHIN as usize {
            self.recent_sxid.pop_front();
        }
        self.recent_sxid.push_back((pci, sxid, self.scanned));
    }

    fn scan(&mut self, msg: &str, facility: u32, at: Option<Timestamp>) -> Option<Observation> {
        if facility != KERNEL_FACILITY {
            self.counters.user_record();
            return None;
        }
        self.scanned += 1;
        let ev = parse_message(msg)?;
        self.counters.matched(ev.kind());
        let n = self.scanned;
        match &ev {
            KernelEvent::Sxid { pci, sxid, .. } => self.note_sxid(*pci, *sxid),
            KernelEvent::SxidSeverity { pci, sxid, .. } => {
                let merged = self
                    .recent_sxid
                    .iter()
                    .any(|(p, s, at)| p == pci && s == sxid && n - at <= SXID_COMPANION_WITHIN);
                if merged {
                    return None; // detail of the report just before it
                }
            }
            _ => {}
        }
        Some(to_observation(ev, at))
    }
}

/// The syslog facility of the records the kernel itself writes (`LOG_KERN`).
pub const KERNEL_FACILITY: u32 = 0;

/// The `pri` field of a record whose header is otherwise broken.
fn header_pri(raw: &[u8]) -> Option<u64> {
    let digits = raw.iter().take_while(|c| c.is_ascii_digit()).count();
    std::str::from_utf8(&raw[..digits]).ok()?.parse().ok()
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
pub fn to_observation(ev: KernelEvent, at: Option<Timestamp>) -> Observation {
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
        // A severity line with no report before it: the SXid itself, with no severity word.
        KernelEvent::SxidSeverity {
            pci,
            sxid,
            switch,
            message,
        } => to_observation(
            KernelEvent::Sxid {
                pci,
                sxid,
                fatal: None,
                switch,
                link: None,
                message,
            },
            at,
        ),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(resume: Option<u64>) -> (KmsgReader, Arc<Tally>) {
        reader_at(resume.map(KmsgPosition::at_seq))
    }

    fn reader_at(resume: Option<KmsgPosition>) -> (KmsgReader, Arc<Tally>) {
        let tally = Arc::new(Tally::default());
        (KmsgReader::new(resume, None, false, tally.clone()), tally)
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
                Input::Obs(Observation::Signal(s))
                | Input::Kmsg {
                    obs: Observation::Signal(s),
                    ..
                } => Some(format!("{}x{}", s.code, s.count)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn records_become_signals_with_cursors() {
        let (mut r, _) = reader(None);
        let out = feed_all(
            &mut r,
            &[
                b"6,10,100,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module",
                b"4,11,200,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
                b" SUBSYSTEM=pci",
            ],
        );
        assert_eq!(signals(&out), vec!["Xid79x1"]);
        assert!(
            matches!(out.last(), Some(Input::Kmsg { at, .. }) if *at == KmsgPosition::at_seq(11)),
            "the fault carries its record's cursor: {out:?}"
        );
    }

    #[test]
    fn sequence_gap_is_reported_as_loss() {
        let (mut r, tally) = reader(None);
        let out = feed_all(&mut r, &[b"6,1,0,-;a", b"6,2,0,-;b", b"6,50,0,-;c"]);
        assert_eq!(signals(&out), vec!["KMSG_LOSSx47"]);
        assert_eq!(Tally::get(&tally.lost), 47);
    }

    /// Two gaps make one KMSG_LOSS fault counting every lost record; its message names no
    /// number, so it cannot disagree with the count (it kept the first gap's "47").
    #[test]
    fn the_loss_message_agrees_with_its_count() {
        let (mut r, _) = reader(None);
        let out = feed_all(
            &mut r,
            &[b"6,1,0,-;a", b"6,2,0,-;b", b"6,50,0,-;c", b"6,60,0,-;d"],
        );
        let (policy, catalog) = (
            crate::policy::Policy::default(),
            crate::catalog::Catalog::builtin().unwrap(),
        );
        let ctx = crate::engine::Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        let mut e = crate::engine::Engine::new();
        let now = Timestamp::from_second(1_790_000_000).unwrap();
        for i in out {
            if let Input::Obs(o) | Input::Kmsg { obs: o, .. } = i {
                e.step(ctx, o, now);
            }
        }
        let f = &e.faults().next().unwrap().fault;
        assert_eq!((f.fault_code.as_str(), f.count), ("KMSG_LOSS", 56));
        assert!(
            !f.message.chars().any(|c| c.is_ascii_digit()),
            "{}",
            f.message
        );
    }

    #[test]
    fn first_record_after_a_wrapped_ring_is_not_loss() {
        let (mut r, _) = reader(None);
        let out = feed_all(&mut r, &[b"6,9000,0,-;a", b"6,9001,0,-;b"]);
        assert!(signals(&out).is_empty());
    }

    #[test]
    fn resume_skips_counted_records_and_reports_loss_between_runs() {
        let (mut r, tally) = reader(Some(11));
        let out = feed_all(
            &mut r,
            &[
                b"4,11,200,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
                b"4,15,300,-;NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception",
            ],
        );
        assert_eq!(signals(&out), vec!["KMSG_LOSSx3", "Xid13x1"]);
        assert_eq!(Tally::get(&tally.skipped), 1);
    }

    #[test]
    fn malformed_records_are_counted_and_still_scanned() {
        let (mut r, tally) = reader(None);
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
        assert_eq!(Tally::get(&tally.malformed), 2);
    }

    /// An NVSwitch SXid seen only as its `Severity …` line is recorded as that SXid; a
    /// severity line right after its report merges into it (counted once); one long after a
    /// report of the same SXid, or after a report of another SXid or switch, is its own.
    #[test]
    fn a_lone_sxid_severity_line_is_the_sxid() {
        let sev = |seq: u32, pci: &str, sxid: u32| {
            format!("4,{seq},100,-;nvidia-nvswitch2: SXid (PCI:{pci}): {sxid}, Severity 0 Engine instance 62 Sub-engine instance 00")
        };
        let report = |seq: u32, pci: &str, sxid: u32| {
            format!("4,{seq},100,-;nvidia-nvswitch2: SXid (PCI:{pci}): {sxid}, Non-fatal, Link 62 egress non-posted PRIV error (First)")
        };
        let run = |lines: Vec<String>| {
            let (mut r, _) = reader(None);
            let lines: Vec<&[u8]> = lines.iter().map(|l| l.as_bytes()).collect();
            signals(&feed_all(&mut r, &lines))
        };
        let a = "0000:07:00.0";
        let b = "0000:88:00.0";
        assert_eq!(run(vec![sev(1, a, 12028)]), vec!["SXid12028x1"], "alone");
        assert_eq!(
            run(vec![report(1, a, 12028), sev(2, a, 12028)]),
            vec!["SXid12028x1"],
            "merged into its report"
        );
        assert_eq!(
            run(vec![
                report(1, a, 12028),
                sev(2, b, 12028),
                sev(3, a, 20009)
            ]),
            vec!["SXid12028x1", "SXid12028x1", "SXid20009x1"],
            "another switch, another SXid"
        );
        let mut far = vec![report(1, a, 12028)];
        for i in 0..SXID_COMPANION_WITHIN as u32 {
            far.push(format!("6,{},100,-;unrelated line {i}", i + 2));
        }
        far.push(sev(SXID_COMPANION_WITHIN as u32 + 2, a, 12028));
        assert_eq!(run(far), vec!["SXid12028x1", "SXid12028x1"], "long after");
        // Many other SXid reports in between push the report out of the window.
        let mut busy = vec![report(1, a, 12028)];
        for i in 0..SXID_COMPANION_WITHIN as u32 {
            busy.push(report(i + 2, b, 20000 + i));
        }
        busy.push(sev(SXID_COMPANION_WITHIN as u32 + 2, a, 12028));
        let got = run(busy);
        assert_eq!(
            got.iter().filter(|s| *s == "SXid12028x1").count(),
            2,
            "{got:?}"
        );
    }

    /// A restart between an SXid's report and its `Severity …` line (the report counted and
    /// saved, the severity line not yet): the replayed report is skipped, and the severity line
    /// still merges into it. Before, the skipped report was not remembered and the severity line
    /// became a second count of the SXid (found in the review of issue 27 §2).
    #[test]
    fn an_sxid_severity_line_after_a_restart_merges_into_its_replayed_report() {
        let report = b"4,1,100,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Non-fatal, Link 62 egress non-posted PRIV error (First)".as_slice();
        let sev = b"4,2,100,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Severity 0 Engine instance 62 Sub-engine instance 00".as_slice();
        // The first run counted the report; its saved position is the report's.
        let (mut first, _) = reader(None);
        assert_eq!(
            signals(&feed_all(&mut first, &[report])),
            vec!["SXid12028x1"]
        );
        // The restart reads the ring again from its start.
        let (mut again, tally) = reader(Some(1));
        assert_eq!(
            signals(&feed_all(&mut again, &[report, sev])),
            Vec::<String>::new(),
            "the severity line is the report's detail, counted with it before the restart"
        );
        assert_eq!(Tally::get(&tally.skipped), 1);
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

    const XID: &str = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=a, GPU has fallen off the bus.";

    fn cursors(out: &[Input]) -> Vec<u64> {
        out.iter()
            .filter_map(|i| match i {
                Input::KmsgCursor(c) | Input::Kmsg { at: c, .. } => c.seq,
                _ => None,
            })
            .collect()
    }

    /// A truncated header with an enormous number does not move the cursor: later records are
    /// read, not skipped, and the damage is counted.
    #[test]
    fn a_truncated_header_cannot_push_the_cursor_ahead() {
        let (mut r, tally) = reader(None);
        let out = feed_all(
            &mut r,
            &[
                b"6,10,100,-;hello",
                b"6,9000000000000000000",
                format!("4,11,200,-;{XID}").as_bytes(),
            ],
        );
        assert_eq!(r.last_seq(), Some(11));
        assert_eq!(signals(&out), ["Xid79x1"], "the later fault is not skipped");
        assert_eq!(Tally::get(&tally.malformed), 1);
        // A damaged record that is the next one expected still counts as read, not lost.
        let (mut r, tally) = reader(None);
        let out = feed_all(&mut r, &[b"6,10,100,-;a", b"6,11,1", b"6,12,300,-;b"]);
        assert_eq!(r.last_seq(), Some(12));
        assert_eq!(Tally::get(&tally.lost), 0);
        assert!(signals(&out).is_empty());
    }

    /// After the reader caught up, a record numbered backwards is reported and its fault kept;
    /// the cursor stays. Before it caught up (a restart replaying the ring), records up to the
    /// saved cursor are skipped as already counted.
    #[test]
    fn a_sequence_number_going_backwards_is_reported_and_its_fault_kept() {
        let (mut r, tally) = reader(None);
        let out = feed_all(
            &mut r,
            &[
                b"6,20,100,-;a",
                b"6,21,100,-;b",
                format!("4,15,200,-;{XID}").as_bytes(),
                b"6,22,300,-;c",
            ],
        );
        assert_eq!(signals(&out), ["Xid79x1"]);
        assert_eq!(Tally::get(&tally.out_of_order), 1);
        assert_eq!(Tally::get(&tally.skipped), 0);
        assert_eq!(Tally::get(&tally.lost), 0);
        assert_eq!(r.last_seq(), Some(22));
        assert!(!cursors(&out).contains(&15));

        let (mut r, tally) = reader(Some(30));
        let out = feed_all(
            &mut r,
            &[
                format!("4,29,200,-;{XID}").as_bytes(),
                b"6,30,100,-;a",
                b"6,31,100,-;b",
            ],
        );
        assert!(
            signals(&out).is_empty(),
            "replayed records are not recounted"
        );
        assert_eq!(Tally::get(&tally.skipped), 2);
        assert_eq!(Tally::get(&tally.out_of_order), 0);
    }

    /// A well-formed record that jumps implausibly far is not a loss of trillions of records:
    /// it is scanned and counted, and the cursor does not follow it.
    #[test]
    fn an_absurd_jump_does_not_move_the_cursor() {
        let (mut r, tally) = reader(None);
        let far = format!("4,{},200,-;{XID}", 10 + MAX_PLAUSIBLE_GAP + 2);
        let out = feed_all(&mut r, &[b"6,10,100,-;a", far.as_bytes(), b"6,11,100,-;b"]);
        assert_eq!(signals(&out), ["Xid79x1"]);
        assert_eq!(Tally::get(&tally.out_of_order), 1);
        assert_eq!(Tally::get(&tally.lost), 0);
        assert_eq!(r.last_seq(), Some(11));
        // A large but possible gap (a restart after a long storm) is loss.
        let (mut r, tally) = reader(None);
        let near = format!("6,{},100,-;b", 10 + 1_000_000_001);
        feed_all(&mut r, &[b"6,10,100,-;a", near.as_bytes()]);
        assert_eq!(Tally::get(&tally.lost), 1_000_000_000);
    }

    /// What the agent's engine loop does with each input (agent/src/runtime.rs), on an engine
    /// and the cursor saved with it.
    fn apply(
        e: &mut crate::engine::Engine,
        cursor: &mut Option<KmsgPosition>,
        ctx: crate::engine::Ctx<'_>,
        input: Input,
    ) {
        let now = Timestamp::from_second(1_790_000_000).unwrap();
        match input {
            Input::Obs(o) => {
                e.step(ctx, o, now);
            }
            Input::Kmsg { obs, at } => {
                e.step(ctx, obs, now);
                *cursor = Some(at);
            }
            Input::KmsgCursor(at) => *cursor = Some(at),
            Input::Marker(_) | Input::Clear { .. } | Input::KmsgReplays(_) => {}
        }
    }

    fn counts(e: &crate::engine::Engine) -> Vec<(String, u64)> {
        let mut v: Vec<_> = e
            .faults()
            .map(|f| (f.fault.fault_code.clone(), f.fault.count))
            .collect();
        v.sort();
        v
    }

    /// The state may be saved between any two inputs, and the agent killed right after. A
    /// restart resumes after the saved cursor. Whatever the cut, every fault (and the loss report
    /// for a gap) is counted exactly as in a run that was never killed.
    #[test]
    fn a_kill_between_any_two_inputs_neither_recounts_nor_loses() {
        let policy = crate::policy::Policy::default();
        let catalog = crate::catalog::Catalog::builtin().unwrap();
        let ctx = crate::engine::Ctx {
            policy: &policy,
            catalog: &catalog,
        };
        // Records 1..=14 with 7 missing (a gap), a fault every third record; faults in lines
        // without a usable sequence number before the first record and among the others.
        let mut log: Vec<String> = (1..=14u64)
            .filter(|i| *i != 7)
            .map(|i| {
                if i % 3 == 0 {
                    format!("4,{i},{},-;{XID}", i * 100)
                } else {
                    format!("6,{i},{},-;noise {i}", i * 100)
                }
            })
            .collect();
        let unsequenced = unsequenced_faults();
        log.insert(0, unsequenced[0].clone());
        log.insert(5, unsequenced[1].clone());
        log.insert(9, unsequenced[2].clone());
        log.insert(10, "[    9.000000] noise without a number".into());
        log.insert(12, unsequenced[3].clone());
        log.insert(13, unsequenced[4].clone());
        let read = |resume: Option<KmsgPosition>| {
            let (mut r, _) = reader_at(resume);
            let mut out = Vec::new();
            for l in &log {
                r.feed(l.as_bytes(), &mut out);
            }
            r.flush_cursor(&mut out);
            out
        };
        let inputs = read(None);
        let mut whole = crate::engine::Engine::new();
        let mut cursor = None;
        for i in inputs.clone() {
            apply(&mut whole, &mut cursor, ctx, i);
        }
        let want = counts(&whole);
        assert_eq!(
            want,
            [("KMSG_LOSS".to_string(), 1), ("Xid79".to_string(), 9)]
        );
        for cut in 0..=inputs.len() {
            let mut e = crate::engine::Engine::new();
            let mut cursor = None;
            for i in inputs[..cut].iter().cloned() {
                apply(&mut e, &mut cursor, ctx, i);
            }
            // Killed here; the restart reads the whole ring again from the saved cursor.
            for i in read(cursor) {
                apply(&mut e, &mut cursor, ctx, i);
            }
            assert_eq!(
                counts(&e),
                want,
                "killed after input {cut} of {}",
                inputs.len()
            );
        }
    }

    /// A reopened log is read from its oldest record again: what was read is skipped, not
    /// counted twice and not called out of order.
    #[test]
    fn a_reopened_log_is_not_counted_twice() {
        let (mut r, tally) = reader(None);
        let xid = format!("4,11,200,-;{XID}");
        let first = feed_all(&mut r, &[b"6,10,100,-;a", xid.as_bytes()]);
        assert_eq!(signals(&first), ["Xid79x1"]);
        r.reopened();
        let again = feed_all(&mut r, &[b"6,10,100,-;a", xid.as_bytes(), b"6,12,300,-;b"]);
        assert!(signals(&again).is_empty());
        assert_eq!(Tally::get(&tally.skipped), 2);
        assert_eq!(Tally::get(&tally.out_of_order), 0);
        assert_eq!(r.last_seq(), Some(12));
    }

    /// After the engine was rebuilt from a record (the cursor lost), records dated up to the
    /// record's time are in it already: skipped, with the cursor following them.
    #[test]
    fn records_already_in_the_rebuilt_record_are_skipped() {
        let boot = Timestamp::from_second(1_790_000_000).unwrap();
        let tally = Arc::new(Tally::default());
        let mut r = KmsgReader::new(None, Some(boot), true, tally.clone()).skip_through(Some(
            boot.checked_add(SignedDuration::from_secs(10)).unwrap(),
        ));
        let old = format!("4,1,5000000,-;{XID}"); // 5 s after boot
        let new = format!("4,2,20000000,-;{XID}"); // 20 s after boot
        let out = feed_all(&mut r, &[old.as_bytes(), new.as_bytes()]);
        assert_eq!(
            signals(&out),
            ["Xid79x1"],
            "only the record after the rebuilt one"
        );
        assert_eq!(Tally::get(&tally.skipped), 1);
        assert_eq!(r.last_seq(), Some(2));
    }

    /// Lines with a fault and no usable sequence number: a dmesg-format line, a malformed
    /// number, a number implausibly far ahead, a number going backwards, another dmesg line.
    fn unsequenced_faults() -> Vec<String> {
        vec![
            format!("[    0.500000] {XID}"),
            format!("4,12x,400,-;{XID}"),
            format!("4,{},500,-;{XID}", 1u64 << 41),
            format!("4,2,600,-;{XID}"),
            format!("[   11.000000] {XID}"),
        ]
    }

    /// Records without a usable sequence number are counted once across restarts: each
    /// restart reads the log again from the saved position, three times over, and a line
    /// appended after a restart is counted (issue 25 §4: they were counted again at every
    /// restart, 1, 2, 3).
    #[test]
    fn records_without_a_usable_number_count_once_across_restarts() {
        let mut log: Vec<String> = vec![
            "6,10,100,-;a".into(),
            format!("4,11,200,-;{XID}"),
            "6,12,300,-;b".into(),
        ];
        log.extend(unsequenced_faults());
        let run = |log: &[String], resume: Option<KmsgPosition>| {
            let (mut r, tally) = reader_at(resume);
            let mut out = Vec::new();
            for l in log {
                r.feed(l.as_bytes(), &mut out);
            }
            r.flush_cursor(&mut out);
            (signals(&out).len(), r.position(), tally)
        };
        let (faults, mut pos, _) = run(&log, None);
        assert_eq!(faults, 6);
        assert_eq!(
            pos,
            KmsgPosition {
                seq: Some(12),
                unsequenced: 5,
                log: None,
                read: None
            }
        );
        for restart in 1..=3 {
            let (faults, again, tally) = run(&log, Some(pos));
            assert_eq!(faults, 0, "restart {restart} counted a record again");
            assert_eq!(Tally::get(&tally.skipped), log.len() as u64);
            assert_eq!(again, pos);
            pos = again;
        }
        log.push(format!("[   12.000000] {XID}"));
        let (faults, after, _) = run(&log, Some(pos));
        assert_eq!(faults, 1, "the appended line is new");
        assert_eq!(after.unsequenced, 6);
        // A log of dmesg lines only: the position is a count of lines from its start.
        let dmesg: Vec<String> = (0..3).map(|i| format!("[ {i}.0] {XID}")).collect();
        let (faults, pos, _) = run(&dmesg, None);
        assert_eq!(
            (faults, pos),
            (
                3,
                KmsgPosition {
                    seq: None,
                    unsequenced: 3,
                    log: None,
                    read: None
                }
            )
        );
        assert_eq!(run(&dmesg, Some(pos)).0, 0);
    }

    /// A new log at the path (a replaced or truncated file) is read from its beginning: its
    /// records count even when their numbers are at or below the old log's, and the position
    /// starts over and is sent at once, so a restart resumes in the new log.
    #[test]
    fn a_new_log_starts_over() {
        let (mut r, tally) = reader(None);
        let first = feed_all(
            &mut r,
            &[b"6,10,100,-;a", format!("4,11,200,-;{XID}").as_bytes()],
        );
        assert_eq!(signals(&first), ["Xid79x1"]);
        r.new_log(Some(7));
        let mut out = Vec::new();
        r.flush_cursor(&mut out);
        let start = KmsgPosition {
            log: Some(7),
            ..Default::default()
        };
        assert_eq!(out, [Input::KmsgCursor(start)]);
        let xid = format!("4,1,100,-;{XID}");
        let again = feed_all(&mut r, &[xid.as_bytes(), b"6,2,100,-;b"]);
        assert_eq!(signals(&again), ["Xid79x1"]);
        assert_eq!(
            r.position(),
            KmsgPosition {
                log: Some(7),
                ..KmsgPosition::at_seq(2)
            }
        );
        assert_eq!(Tally::get(&tally.skipped), 0);
        assert_eq!(Tally::get(&tally.out_of_order), 0);
        assert_eq!(Tally::get(&tally.lost), 0);
    }

    /// A reopen in the middle of a replay keeps the replay's target: what the previous run
    /// counted is still skipped.
    #[test]
    fn a_reopen_during_a_replay_keeps_its_target() {
        let log = [
            format!("[ 0.1] {XID}"),
            format!("4,5,100,-;{XID}"),
            format!("4,6,100,-;{XID}"),
        ];
        let (mut r, _) = reader_at(Some(KmsgPosition::at_seq(6)));
        let mut out = Vec::new();
        r.feed(log[0].as_bytes(), &mut out);
        r.reopened();
        for l in &log {
            r.feed(l.as_bytes(), &mut out);
        }
        assert!(signals(&out).is_empty(), "{out:?}");
        assert_eq!(r.position(), KmsgPosition::at_seq(6));
    }

    /// A position saved in another log (a file replaced while the agent was not running)
    /// resumes nothing: the records there are new, even numbered at or below it. In the same
    /// log, it resumes as usual.
    #[test]
    fn a_position_in_another_log_resumes_nothing() {
        let saved = KmsgPosition {
            log: Some(1),
            ..KmsgPosition::at_seq(5)
        };
        let xid = format!("4,2,100,-;{XID}");
        let (mut r, _) = reader_at(Some(saved));
        assert!(r.in_log(Some(2)));
        assert_eq!(signals(&feed_all(&mut r, &[xid.as_bytes()])), ["Xid79x1"]);
        assert_eq!(r.position().log, Some(2));
        let (mut r, _) = reader_at(Some(saved));
        assert!(!r.in_log(Some(1)));
        assert!(feed_all(&mut r, &[xid.as_bytes()]).is_empty());
    }

    /// In a file, a position carries how much of the file is read with its record; a loss
    /// report's (the position just before the record after the gap), how much before it.
    #[test]
    fn positions_carry_how_much_of_the_file_is_read() {
        let (mut r, _) = reader(None);
        let e = |bytes| Extent {
            bytes,
            hash: !bytes,
        };
        let mut out = Vec::new();
        r.read_to(e(10));
        r.feed(b"6,1,100,-;a", &mut out);
        r.read_to(e(20));
        r.feed(format!("4,3,200,-;{XID}").as_bytes(), &mut out);
        let at: Vec<_> = out
            .iter()
            .filter_map(|i| match i {
                Input::Kmsg { at, .. } => Some((at.seq, at.read)),
                _ => None,
            })
            .collect();
        assert_eq!(at, [(Some(2), Some(e(10))), (Some(3), Some(e(20)))]);
        assert_eq!(r.position().read, Some(e(20)));
        r.new_log(None);
        assert_eq!(r.position().read, None, "a new log starts over");
    }

    /// A stream (a FIFO) skips nothing: a saved position in it resumes nothing, whether it
    /// counts lines without a number or numbered records, and a reopen replays nothing. Each
    /// line a pipe hands over is new (before, the lines after a restart were skipped as the
    /// replay of the saved count, which a FIFO never replays).
    #[test]
    fn a_stream_skips_nothing() {
        let line = format!("[    1.000000] {XID}");
        for saved in [
            KmsgPosition {
                seq: None,
                unsequenced: 1,
                log: Some(1),
                read: None,
            },
            KmsgPosition {
                log: Some(1),
                ..KmsgPosition::at_seq(5)
            },
        ] {
            let (mut r, tally) = reader_at(Some(saved));
            assert!(!r.in_log(Some(1)));
            assert!(r.stream(), "the saved position is dropped");
            let numbered = format!("4,2,100,-;{XID}");
            let out = feed_all(&mut r, &[line.as_bytes(), numbered.as_bytes()]);
            assert_eq!(signals(&out), ["Xid79x1", "Xid79x1"], "{saved:?}");
            r.reopened();
            let out = feed_all(&mut r, &[line.as_bytes()]);
            assert_eq!(
                signals(&out),
                ["Xid79x1"],
                "a reopened stream replays nothing"
            );
            assert_eq!(Tally::get(&tally.skipped), 0);
            assert!(!r.stream(), "nothing left to drop");
        }
    }

    /// Issue 25 §1: a record user space wrote (facility not 0) is never scanned, though its
    /// text is a driver's line; the cursor still moves past it. A record whose header is broken
    /// is judged by its first field when that reads, a `dmesg -r` line by its `<pri>`; a plain
    /// dmesg line has no facility and is scanned (file mode: the file's writer decides
    /// everything in it anyway).
    #[test]
    fn only_records_the_kernel_wrote_are_scanned() {
        let (mut r, tally) = reader(None);
        let xid = "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.";
        let lines: Vec<String> = [
            format!("12,1,100,-;{xid}"),           // <4> from user space
            format!("8,2,100,-;{xid}"),            // <0> or <8>
            format!("30,3,100,-,caller=T1;{xid}"), // <30>, daemon
            format!("2047,4,100,-;{xid}"),         // facility 255
            format!("34359738372,5,100,-;{xid}"),  // a pri past u32: not facility 0
            format!("12,6,100;{xid}"),             // broken header, user's pri
            format!("4,7,100,-;{xid}"),            // the kernel's
            format!("[   1.000000] {xid}"),        // dmesg line
            format!("<14>[   1.000000] {xid}"),    // `dmesg -r`, user.info
            format!("<4>[   1.000000] {xid}"),     // `dmesg -r`, the kernel's
        ]
        .into();
        let raw: Vec<&[u8]> = lines.iter().map(|l| l.as_bytes()).collect();
        let mut out = feed_all(&mut r, &raw);
        assert_eq!(signals(&out), ["Xid79x1", "Xid79x1", "Xid79x1"]);
        assert_eq!(Tally::get(&tally.user_records), 7);
        assert_eq!(Tally::get(&tally.matched), 3);
        r.flush_cursor(&mut out);
        assert_eq!(r.last_seq(), Some(7), "the cursor moved past every record");
    }

    /// A device record's signal is dated by its kernel timestamp (boot time + its
    /// microseconds), which no user-space line can check end to end any more.
    #[test]
    fn a_device_record_is_dated_by_its_kernel_timestamp() {
        let boot = Timestamp::from_second(1_790_000_000).unwrap();
        let mut r = KmsgReader::new(None, Some(boot), true, Arc::new(Tally::default()));
        let mut out = Vec::new();
        r.feed(format!("4,1,2500000,-;{XID}").as_bytes(), &mut out);
        let Some(Input::Kmsg {
            obs: Observation::Signal(s),
            ..
        }) = out.first()
        else {
            panic!("{out:?}")
        };
        assert_eq!(
            s.at,
            Some(boot.checked_add(SignedDuration::from_millis(2500)).unwrap())
        );
    }
}
