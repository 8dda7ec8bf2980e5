//! Kernel message parsers: NVIDIA Xid and SXid, the PCI-to-UUID line, "fallen off the bus",
//! PCIe AER uncorrectable errors, machine checks and EDAC memory errors.
//!
//! `parse_message` takes the message text of one kernel log record (what follows `;` in
//! `/dev/kmsg`, or a `dmesg` line without its timestamp) and returns at most one event. Each
//! signal is recognized only by the prefix its driver prints at the start of the message, so a
//! few byte comparisons reject the vast majority of lines before any parsing; the parsers
//! themselves are small hand-written cursors rather than regular expressions because the
//! formats are fixed and the parser is on the hot path (see docs/benchmarks.md).

use memchr::memmem;
use serde::Serialize;

use super::pci::PciAddr;

/// One recognized kernel log event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum KernelEvent {
    /// `NVRM: Xid (PCI:0000:3b:00): 79, pid=…, name=…, text`
    Xid {
        pci: PciAddr,
        xid: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        pid: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        process: Option<String>,
        /// NVLink link number, for Xid 74 (`link 14(…)`).
        #[serde(skip_serializing_if = "Option::is_none")]
        link: Option<u32>,
        /// The driver's text after the code (and pid/name).
        message: String,
    },
    /// `NVRM: GPU at PCI:0000:3b:00: GPU-<uuid>`
    GpuUuid { pci: PciAddr, uuid: String },
    /// `NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.` and the "installed in this
    /// system has fallen off the bus" form.
    FallenOffBus {
        /// Absent in the oldest drivers' address-less form.
        #[serde(skip_serializing_if = "Option::is_none")]
        pci: Option<PciAddr>,
    },
    /// `nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 12028, Non-fatal, Link 32 …`
    Sxid {
        pci: PciAddr,
        sxid: u32,
        /// `Fatal` / `Non-fatal`; absent when the driver prints no severity word.
        #[serde(skip_serializing_if = "Option::is_none")]
        fatal: Option<bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        switch: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        link: Option<u32>,
        message: String,
    },
    /// `nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Severity 0 Engine instance 62 …`: the
    /// line that follows an SXid report with detail. Alone (no report of that SXid just
    /// before it) it is the only trace of the SXid, and the reader records it as one.
    SxidSeverity {
        pci: PciAddr,
        sxid: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        switch: Option<u32>,
        message: String,
    },
    /// An uncorrectable PCIe error reported through AER.
    PcieAer {
        pci: PciAddr,
        fatal: bool,
        message: String,
    },
    /// A machine check (MCE) or EDAC memory error.
    MachineCheck {
        corrected: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        cpu: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        bank: Option<u32>,
        message: String,
    },
}

impl KernelEvent {
    /// Short name of the event kind, for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            KernelEvent::Xid { .. } => "xid",
            KernelEvent::GpuUuid { .. } => "gpu_uuid",
            KernelEvent::FallenOffBus { .. } => "fallen_off_bus",
            KernelEvent::Sxid { .. } => "sxid",
            KernelEvent::SxidSeverity { .. } => "sxid_severity",
            KernelEvent::PcieAer { .. } => "pcie_aer",
            KernelEvent::MachineCheck { .. } => "machine_check",
        }
    }
}

/// Parses one kernel message. Returns `None` for every line that is not a fault signal.
///
/// Every signal is recognized only where and how its driver prints it: at the start of the
/// message, with the driver's own prefix, and with a full PCI address (domain included) where
/// the driver prints one. Text that merely contains a driver line is not one: the kernel
/// prints names user space chooses (a process's `comm`, up to 15 bytes, at the start of a
/// segfault or OOM line; a mapped file's name in the middle), and a module may quote another
/// driver's line. Every prefix matched here is longer than 15 bytes before any field a user
/// could name, or demands text after it that no kernel line starting with a `comm` has (see
/// `parse_edac`), so a renamed process cannot forge one. Whether the record came from the
/// kernel at all is the reader's check (facility 0, `kmsg_reader.rs`).
pub fn parse_message(msg: &str) -> Option<KernelEvent> {
    if let Some(rest) = msg.strip_prefix("NVRM: ") {
        return parse_nvrm(rest);
    }
    if let Some(e) = msg.strip_prefix("nvidia-nvswitch").and_then(parse_sxid) {
        return Some(e);
    }
    if let Some(rest) = msg.strip_prefix("mce: ") {
        if let Some(rest) = rest.strip_prefix("[Hardware Error]: ") {
            return parse_mce(msg, rest);
        }
        return rest
            .starts_with("Uncorrected hardware memory error in user-access at ")
            .then(|| machine_check(msg, false));
    }
    if let Some(rest) = msg.strip_prefix("[Hardware Error]: ") {
        // Kernels before `pr_fmt("mce: ")` print the header bare.
        return parse_mce(msg, rest);
    }
    if let Some(rest) = msg.strip_prefix("EDAC MC") {
        return parse_edac(msg, rest);
    }
    parse_aer(msg)
}

/// `NVRM: ` lines: an Xid, the PCI-to-UUID line, or one of the fallen-off-the-bus forms.
fn parse_nvrm(rest: &str) -> Option<KernelEvent> {
    if let Some(r) = rest.strip_prefix("Xid (") {
        return parse_xid(r);
    }
    if let Some(r) = rest.strip_prefix("GPU at ") {
        return parse_uuid(r);
    }
    parse_fallen(rest)
}

/// Parses a decimal number at the start of `s`; returns it and the bytes consumed.
fn decimal(s: &str) -> Option<(u32, usize)> {
    let n = s.bytes().take_while(u8::is_ascii_digit).count();
    if n == 0 || n > 9 {
        return None;
    }
    s[..n].parse().ok().map(|v| (v, n))
}

/// A PCI address at the start of `s` as drivers print it: with its domain (`0000:3b:00`,
/// `PCI:0000:3b:00`, `0000:3b:00.0`, `10000:01:00.0`), never the short `3b:00` that
/// [`PciAddr::parse_prefix`] also takes.
fn driver_pci(s: &str) -> Option<(PciAddr, usize)> {
    let (a, n) = PciAddr::parse_prefix(s)?;
    let body = s[..n]
        .get(..4)
        .filter(|p| p.eq_ignore_ascii_case("PCI:"))
        .map_or(&s[..n], |_| &s[4..n]);
    (body.bytes().filter(|c| *c == b':').count() == 2).then_some((a, n))
}

/// Parses `ADDR): CODE` (what follows the opening parenthesis).
fn addr_and_code(rest: &str) -> Option<(PciAddr, u32, &str)> {
    let (pci, n) = driver_pci(rest)?;
    // MIG adds ` GPU-I:05` before the parenthesis closes.
    let close = rest[n..].find(')').filter(|&i| i <= 16)?;
    let rest = rest[n + close..].strip_prefix("):")?;
    let rest = rest.trim_start();
    let (code, n) = decimal(rest)?;
    Some((pci, code, &rest[n..]))
}

/// Finds `word N` (case-insensitive word) and returns N.
fn number_after(s: &str, word: &str) -> Option<u32> {
    let lower = s.to_ascii_lowercase();
    let mut from = 0;
    while let Some(i) = lower[from..].find(word) {
        let at = from + i + word.len();
        let word_start = at - word.len();
        let boundary = word_start == 0 || !lower.as_bytes()[word_start - 1].is_ascii_alphanumeric();
        if boundary {
            if let Some((v, _)) = decimal(lower[at..].trim_start()) {
                return Some(v);
            }
        }
        from = at;
    }
    None
}

/// `NVRM: Xid (PCI:0000:3b:00): 79, pid=…, name=…, text`; `rest` follows `Xid (`.
fn parse_xid(rest: &str) -> Option<KernelEvent> {
    let (pci, xid, rest) = addr_and_code(rest)?;
    let mut rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    let mut pid = None;
    let mut process = None;
    if let Some(r) = rest.strip_prefix("pid=") {
        let r = r.trim_start_matches('\'');
        let end = r.find(',').unwrap_or(r.len());
        pid = r[..end].trim_end_matches('\'').parse().ok();
        rest = r[end..].strip_prefix(',').unwrap_or("").trim_start();
        if let Some(r) = rest.strip_prefix("name=") {
            // A process name may itself contain ", "; the driver prints it as the next field,
            // so take everything up to the last ", " that is followed by the driver's text.
            let end = r.find(", ").unwrap_or(r.len());
            let name = r[..end].trim();
            if !name.is_empty() && name != "<unknown>" {
                process = Some(name.to_string());
            }
            rest = r[end..].strip_prefix(',').unwrap_or("").trim_start();
        }
    }
    // Xid 74 prints `link 14(…)`, the NVLink5 Xids 144-150 `Link 05 (…)`.
    let link = if xid == 74 || (144..=150).contains(&xid) {
        number_after(rest, "link ")
    } else {
        None
    };
    Some(KernelEvent::Xid {
        pci,
        xid,
        pid,
        process,
        link,
        message: rest.trim_end().to_string(),
    })
}

/// `nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 12028, Non-fatal, Link 32 …`: the NVSwitch
/// driver names the switch (`nvswitchN`) before the SXid; `rest` follows `nvidia-nvswitch`.
fn parse_sxid(rest: &str) -> Option<KernelEvent> {
    let (switch, n) = decimal(rest)?;
    let rest = rest[n..].strip_prefix(": SXid (")?;
    let switch = Some(switch);
    let (pci, sxid, rest) = addr_and_code(rest)?;
    let rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    let lower = rest.get(..9).unwrap_or(rest).to_ascii_lowercase();
    // `Data {…}` lines follow the report and only add detail. `Severity N Engine instance …`
    // lines follow it too, but some drivers print one with no report before it: the reader
    // decides (kmsg_reader.rs). Its number is not the Fatal/Non-fatal word and is not read as
    // one.
    if rest.starts_with("Data {") {
        return None;
    }
    if rest.starts_with("Severity ") {
        return Some(KernelEvent::SxidSeverity {
            pci,
            sxid,
            switch,
            message: rest.trim_end().to_string(),
        });
    }
    let (fatal, text) = if lower.starts_with("non-fatal") || lower.starts_with("nonfatal") {
        (
            Some(false),
            rest.split_once(',').map(|(_, t)| t.trim()).unwrap_or(""),
        )
    } else if lower.starts_with("fatal") {
        (
            Some(true),
            rest.split_once(',').map(|(_, t)| t.trim()).unwrap_or(""),
        )
    } else {
        // Some SXids print no severity word (`10007, IO failure`).
        (None, rest.trim())
    };
    Some(KernelEvent::Sxid {
        pci,
        sxid,
        fatal,
        switch,
        link: number_after(text, "link "),
        message: text.to_string(),
    })
}

/// `NVRM: GPU at PCI:0000:3b:00: GPU-<uuid>`; `rest` follows `GPU at `.
fn parse_uuid(rest: &str) -> Option<KernelEvent> {
    if !rest.starts_with("PCI:") {
        return None;
    }
    let (pci, n) = driver_pci(rest)?;
    let rest = rest[n..].strip_prefix(':')?.trim_start();
    let uuid: &str = rest.split_whitespace().next()?;
    let uuid = uuid.trim_end_matches(['.', ',']);
    if !uuid.starts_with("GPU-") || uuid.len() < 8 {
        return None;
    }
    Some(KernelEvent::GpuUuid {
        pci,
        uuid: uuid.to_string(),
    })
}

/// The three forms the driver prints (`rest` follows `NVRM: `):
/// `GPU 0000:3b:00.0: GPU has fallen off the bus.` (`NV_DEV_PRINTF`), the probe path's
/// `The NVIDIA GPU 0000:3b:00.0 (PCI ID: …) installed in this system has … fallen off the bus
/// …` (one record, its lines joined by `\x0a`), and the oldest drivers' address-less
/// `GPU has fallen off the bus.`
fn parse_fallen(rest: &str) -> Option<KernelEvent> {
    const FALLEN: &str = "GPU has fallen off the bus";
    if rest.starts_with(FALLEN) {
        return Some(KernelEvent::FallenOffBus { pci: None });
    }
    if let Some(r) = rest.strip_prefix("GPU ") {
        let (pci, n) = driver_pci(r)?;
        return r[n..]
            .strip_prefix(": ")?
            .starts_with(FALLEN)
            .then_some(KernelEvent::FallenOffBus { pci: Some(pci) });
    }
    let r = rest.strip_prefix("The NVIDIA GPU ")?;
    let (pci, n) = driver_pci(r)?;
    memmem::find(&r.as_bytes()[n..], b"fallen off the bus")
        .map(|_| KernelEvent::FallenOffBus { pci: Some(pci) })
}

/// `Uncorrected (Fatal)` / `Uncorrectable (Non-Fatal)` (kernels renamed the word in 2023) at
/// the start of `s`: whether fatal, and the text after the parenthesis.
fn uncorrectable(s: &str) -> Option<(bool, &str)> {
    let s = s
        .strip_prefix("Uncorrected ")
        .or_else(|| s.strip_prefix("Uncorrectable "))?;
    if let Some(r) = s.strip_prefix("(Fatal)") {
        Some((true, r))
    } else {
        s.strip_prefix("(Non-Fatal)").map(|r| (false, r))
    }
}

/// An uncorrectable PCIe error, as `drivers/pci/pcie/aer.c` prints it through `pci_err`: the
/// `dev_printk` prefix (the reporting device's driver, or the bus name `pci`, and its address),
/// then an optional `AER: ` and either the report header
/// (`[Multiple ]Uncorrected (Fatal) error received: <dev>`, `… error message received from
/// <dev>`, or `… received: id=0018` on old kernels, where only the reporting port is known) or
/// the detail line (`PCIe Bus Error: severity=Uncorrected (Fatal), type=…`, about the
/// reporting device itself).
fn parse_aer(msg: &str) -> Option<KernelEvent> {
    let sp = memchr::memchr(b' ', msg.as_bytes().get(..33).unwrap_or(msg.as_bytes()))?;
    let driver = &msg.as_bytes()[..sp];
    if driver.is_empty()
        || !driver
            .iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
    {
        return None;
    }
    let after = &msg[sp + 1..];
    let (port, n) = driver_pci(after)?;
    let body = after[n..].strip_prefix(": ")?;
    let body = body.strip_prefix("AER: ").unwrap_or(body);
    let (fatal, pci) = if let Some(sev) = body.strip_prefix("PCIe Bus Error: severity=") {
        let (fatal, r) = uncorrectable(sev)?;
        r.starts_with(',').then_some((fatal, port))?
    } else {
        let (fatal, r) = uncorrectable(body.strip_prefix("Multiple ").unwrap_or(body))?;
        let r = r.strip_prefix(" error ")?;
        let r = r.strip_prefix("message ").unwrap_or(r);
        let r = r.strip_prefix("received")?;
        let dev = r
            .strip_prefix(": ")
            .or_else(|| r.strip_prefix(" from "))
            .and_then(driver_pci)
            .map(|(d, _)| d);
        (fatal, dev.unwrap_or(port))
    };
    Some(KernelEvent::PcieAer {
        pci,
        fatal,
        message: msg.trim().to_string(),
    })
}

fn machine_check(msg: &str, corrected: bool) -> KernelEvent {
    KernelEvent::MachineCheck {
        corrected,
        cpu: number_after(msg, "cpu "),
        bank: number_after(msg, "bank "),
        message: msg.trim().to_string(),
    }
}

/// A machine check, as `arch/x86/kernel/cpu/mce/core.c` prints it after `[Hardware Error]: `
/// (`rest`): `Machine check events logged` (corrected errors were logged),
/// `CPU 3: Machine Check[ Exception]: 0 Bank 7: <status>` (a record's header) or
/// `Machine check: <reason>` (the kernel's severity verdict, `Processor context corrupt`).
fn parse_mce(msg: &str, rest: &str) -> Option<KernelEvent> {
    if rest.starts_with("Machine check events logged") {
        return Some(machine_check(msg, true));
    }
    if rest.starts_with("Machine check: ") {
        return Some(machine_check(msg, false));
    }
    let r = rest.strip_prefix("CPU ")?;
    let (_, n) = decimal(r)?;
    let r = r[n..].strip_prefix(": Machine Check")?;
    if r.starts_with(" Exception: ") {
        return Some(machine_check(msg, false));
    }
    // Bit 61 of the bank status (UC) says whether the error was corrected.
    r.strip_prefix(": ")?;
    let status = msg.rsplit(": ").next()?.trim();
    let status = u64::from_str_radix(status.split_whitespace().next()?, 16).ok()?;
    Some(machine_check(msg, status & (1 << 61) == 0))
}

/// An EDAC memory controller's error report (`rest` follows `EDAC MC`), as
/// `drivers/edac/edac_mc.c` prints it (`edac_ce_error` / `edac_ue_error`):
/// `EDAC MC0: 1 UE <msg> on <label> (<location> page:0x… offset:0x… grain:…)`, or before 3.6
/// `EDAC MC0: UE page 0x…, offset 0x…, grain 8, …`.
///
/// `EDAC MC0: 1 UE ` is only 15 bytes, short enough for a process name, and the kernel
/// starts lines with one (`<comm>[pid]: segfault at …`, `<comm> invoked oom-killer: …`). So
/// the text after `UE `/`CE ` must start with a letter (the kernel's `[`, ` (` or `:` after a
/// name does not) and hold the report's `page` and `grain` fields, which no line that starts
/// with a name has. The form without a count is shorter still (`EDAC MC0: UE ` is 13 bytes,
/// leaving a name two letters of its own), so there the text must start as that driver's
/// does, `page 0x`: 20 bytes in all, more than any process name holds.
fn parse_edac(msg: &str, rest: &str) -> Option<KernelEvent> {
    let (_, n) = decimal(rest)?;
    let r = rest[n..].strip_prefix(": ")?;
    let (counted, r) = match decimal(r) {
        Some((_, n)) => (true, r[n..].strip_prefix(' ')?),
        None => (false, r),
    };
    let corrected = if r.starts_with("CE ") {
        true
    } else if r.starts_with("UE ") {
        false
    } else {
        return None;
    };
    let tail = &r[3..];
    let b = tail.as_bytes();
    let start = if counted {
        b.first().is_some_and(u8::is_ascii_alphabetic)
    } else {
        tail.starts_with("page 0x")
    };
    let report = start && memmem::find(b, b"page").is_some() && memmem::find(b, b"grain").is_some();
    report.then(|| KernelEvent::MachineCheck {
        corrected,
        cpu: None,
        bank: None,
        message: msg.trim().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pci(s: &str) -> PciAddr {
        s.parse().unwrap()
    }

    #[test]
    fn xid_current_form() {
        let e = parse_message(
            "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        );
        assert_eq!(
            e,
            Some(KernelEvent::Xid {
                pci: pci("0000:3b:00.0"),
                xid: 79,
                pid: None,
                process: None,
                link: None,
                message: "GPU has fallen off the bus.".into()
            })
        );
    }

    #[test]
    fn xid_with_numeric_pid_and_name() {
        let Some(KernelEvent::Xid { pid, process, xid, message, .. }) = parse_message(
            "NVRM: Xid (PCI:0000:b1:00): 31, pid=2210, name=python3, Ch 00000008, intr 00000000. MMU Fault",
        ) else {
            panic!("no match")
        };
        assert_eq!(
            (xid, pid, process.as_deref()),
            (31, Some(2210), Some("python3"))
        );
        assert!(message.starts_with("Ch 00000008"), "{message}");
    }

    #[test]
    fn xid_old_form_without_pci_prefix() {
        let Some(KernelEvent::Xid {
            pci: p,
            xid,
            message,
            ..
        }) = parse_message("NVRM: Xid (0000:03:00): 14, Channel 00000001")
        else {
            panic!("no match")
        };
        assert_eq!(
            (p, xid, message.as_str()),
            (pci("0000:03:00.0"), 14, "Channel 00000001")
        );
    }

    #[test]
    fn xid_74_reports_its_link() {
        let Some(KernelEvent::Xid { link, .. }) = parse_message(
            "NVRM: Xid (PCI:0000:1a:00): 74, pid=1234, name=python, NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
        ) else {
            panic!("no match")
        };
        assert_eq!(link, Some(14));
    }

    #[test]
    fn sxid_fatal_and_nonfatal() {
        let e = parse_message(
            "nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)",
        );
        assert_eq!(
            e,
            Some(KernelEvent::Sxid {
                pci: pci("0000:86:00.0"),
                sxid: 12028,
                fatal: Some(false),
                switch: Some(3),
                link: Some(32),
                message: "Link 32 egress non-posted PRIV error (First)".into()
            })
        );
        let Some(KernelEvent::Sxid { fatal, .. }) = parse_message(
            "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
        ) else {
            panic!()
        };
        assert_eq!(fatal, Some(true));
        assert_eq!(
            parse_message("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Data {0x0, 0x1}"),
            None
        );
    }

    #[test]
    fn uuid_and_fallen_off_forms() {
        assert_eq!(
            parse_message("NVRM: GPU at PCI:0000:3b:00: GPU-5d1c7f7e-1e0b-1b2c-3c4d-0123456789ab"),
            Some(KernelEvent::GpuUuid {
                pci: pci("0000:3b:00.0"),
                uuid: "GPU-5d1c7f7e-1e0b-1b2c-3c4d-0123456789ab".into()
            })
        );
        for line in [
            "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
            "NVRM: The NVIDIA GPU 0000:3b:00.0 (PCI ID: 10de:20b0) installed in this system has fallen off the bus and is not responding to commands.",
        ] {
            assert_eq!(
                parse_message(line),
                Some(KernelEvent::FallenOffBus { pci: Some(pci("0000:3b:00.0")) }),
                "{line}"
            );
        }
    }

    #[test]
    fn aer_uncorrectable_only() {
        let Some(KernelEvent::PcieAer { pci: p, fatal, .. }) = parse_message(
            "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0",
        ) else {
            panic!()
        };
        assert_eq!((p, fatal), (pci("0000:01:00.0"), true));
        let Some(KernelEvent::PcieAer { pci: p, fatal, .. }) = parse_message(
            "nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)",
        ) else {
            panic!()
        };
        assert_eq!((p, fatal), (pci("0000:3b:00.0"), false));
        assert_eq!(
            parse_message("pcieport 0000:00:01.0: AER: Corrected error received: 0000:01:00.0"),
            None
        );
    }

    #[test]
    fn machine_checks() {
        let Some(KernelEvent::MachineCheck {
            corrected,
            cpu,
            bank,
            ..
        }) = parse_message(
            "mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 4: b200000000070f0f",
        )
        else {
            panic!()
        };
        assert_eq!((corrected, cpu, bank), (false, Some(3), Some(4)));
        let Some(KernelEvent::MachineCheck { corrected, .. }) =
            parse_message("mce: [Hardware Error]: Machine check events logged")
        else {
            panic!()
        };
        assert!(corrected);
        let Some(KernelEvent::MachineCheck { corrected, .. }) = parse_message(
            "mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 7: cc0000c000010091",
        ) else {
            panic!()
        };
        assert!(corrected, "UC bit clear");
        assert_eq!(
            parse_message("mce: [Hardware Error]: TSC 0 ADDR 1ffffb0d0"),
            None
        );
    }

    proptest! {
        #[test]
        fn never_panics_on_any_text(s in "\\PC{0,200}") {
            let _ = parse_message(&s);
        }

        #[test]
        fn never_panics_on_mutated_signals(
            base in prop::sample::select(vec![
                "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
                "nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 12028, Non-fatal, Link 32 egress",
                "NVRM: GPU at PCI:0000:3b:00: GPU-5d1c7f7e",
                "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0",
                "mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 7: cc0000c000010091",
            ]),
            cut in 0usize..120,
            junk in "\\PC{0,8}",
        ) {
            let mut s: String = base.chars().take(cut).collect();
            s.push_str(&junk);
            let _ = parse_message(&s);
        }
    }
}
