//! Kernel message parsers: NVIDIA Xid and SXid, the PCI-to-UUID line, "fallen off the bus",
//! PCIe AER uncorrectable errors and machine checks.
//!
//! `parse_message` takes the message text of one kernel log record (what follows `;` in
//! `/dev/kmsg`, or a `dmesg` line without its timestamp) and returns at most one event. A cheap
//! byte search rejects the vast majority of lines before any parsing; the parsers themselves are
//! small hand-written cursors rather than regular expressions because the formats are fixed
//! and the parser is on the hot path (see docs/benchmarks.md).

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

/// Substring searchers built once: building one per call costs more than the search itself on
/// short lines.
struct Finders {
    sxid: memmem::Finder<'static>,
    xid: memmem::Finder<'static>,
    nvrm: memmem::Finder<'static>,
    uncorrect: memmem::Finder<'static>,
    hw_error: memmem::Finder<'static>,
    edac: memmem::Finder<'static>,
    mem_error: memmem::Finder<'static>,
}

static FINDERS: std::sync::LazyLock<Finders> = std::sync::LazyLock::new(|| Finders {
    sxid: memmem::Finder::new("SXid ("),
    xid: memmem::Finder::new("Xid ("),
    nvrm: memmem::Finder::new("NVRM:"),
    uncorrect: memmem::Finder::new("Uncorrect"),
    hw_error: memmem::Finder::new("Hardware Error]"),
    edac: memmem::Finder::new("EDAC MC"),
    mem_error: memmem::Finder::new("hardware memory error"),
});

/// Parses one kernel message. Returns `None` for every line that is not a fault signal.
pub fn parse_message(msg: &str) -> Option<KernelEvent> {
    let b = msg.as_bytes();
    let f = &*FINDERS;
    if let Some(i) = f.sxid.find(b) {
        return parse_sxid(msg, i);
    }
    if let Some(i) = f.xid.find(b) {
        return parse_xid(msg, i);
    }
    if f.nvrm.find(b).is_some() {
        if let Some(i) = memmem::find(b, b"GPU at PCI:") {
            return parse_uuid(msg, i);
        }
        if memmem::find(b, b"fallen off the bus").is_some() {
            return parse_fallen(msg);
        }
        return None;
    }
    if f.uncorrect.find(b).is_some() {
        if let Some(e) = parse_aer(msg) {
            return Some(e);
        }
    }
    if f.hw_error.find(b).is_some() || f.edac.find(b).is_some() || f.mem_error.find(b).is_some() {
        return parse_mce(msg);
    }
    None
}

/// Parses a decimal number at the start of `s`; returns it and the bytes consumed.
fn decimal(s: &str) -> Option<(u32, usize)> {
    let n = s.bytes().take_while(u8::is_ascii_digit).count();
    if n == 0 || n > 9 {
        return None;
    }
    s[..n].parse().ok().map(|v| (v, n))
}

/// Parses `(ADDR): CODE` starting just after the opening parenthesis.
fn addr_and_code(rest: &str) -> Option<(PciAddr, u32, &str)> {
    let (pci, n) = PciAddr::parse_prefix(rest)?;
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

fn parse_xid(msg: &str, at: usize) -> Option<KernelEvent> {
    let (pci, xid, rest) = addr_and_code(&msg[at + "Xid (".len()..])?;
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

fn parse_sxid(msg: &str, at: usize) -> Option<KernelEvent> {
    let (pci, sxid, rest) = addr_and_code(&msg[at + "SXid (".len()..])?;
    let rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    let lower = rest.get(..9).unwrap_or(rest).to_ascii_lowercase();
    let switch = || {
        memmem::find(msg.as_bytes(), b"nvswitch")
            .and_then(|i| decimal(&msg[i + "nvswitch".len()..]).map(|(v, _)| v))
    };
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
            switch: switch(),
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
        switch: switch(),
        link: number_after(text, "link "),
        message: text.to_string(),
    })
}

fn parse_uuid(msg: &str, at: usize) -> Option<KernelEvent> {
    let rest = &msg[at + "GPU at ".len()..];
    let (pci, n) = PciAddr::parse_prefix(rest)?;
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

/// Returns the first PCI address that stands as a whole word in `s`.
fn first_pci_word(s: &str) -> Option<PciAddr> {
    // `\x0a` is how /dev/kmsg escapes the newlines of a multi-line message.
    s.split(|c: char| c.is_whitespace() || c == '(' || c == ',' || c == '\\')
        .find_map(|w| {
            let w = w.trim_end_matches(':');
            let (a, n) = PciAddr::parse_prefix(w)?;
            // Require a domain or function so that e.g. `10de:20b0` (a PCI ID) never matches.
            (n == w.len() && w.matches(':').count() + usize::from(w.contains('.')) >= 2)
                .then_some(a)
        })
}

fn parse_fallen(msg: &str) -> Option<KernelEvent> {
    let after = &msg[memmem::find(msg.as_bytes(), b"NVRM:")? + "NVRM:".len()..];
    let pci = first_pci_word(after);
    if pci.is_none() && !after.trim_start().starts_with("GPU has fallen off the bus") {
        return None;
    }
    Some(KernelEvent::FallenOffBus { pci })
}

fn parse_aer(msg: &str) -> Option<KernelEvent> {
    let b = msg.as_bytes();
    // Kernels print `Uncorrected` or `Uncorrectable`.
    let fatal = if memmem::find(b, b" (Fatal)").is_some() {
        true
    } else if memmem::find(b, b" (Non-Fatal)").is_some() {
        false
    } else {
        return None;
    };
    if let Some(i) =
        memmem::find(b, b"error received").or_else(|| memmem::find(b, b"error message received"))
    {
        // `pcieport <port>: AER: Uncorrected (Fatal) error received: <dev>` (or `… from <dev>`,
        // or `id=0018` on old kernels, where only the reporting port is known).
        let tail = &msg[i..];
        let after = tail
            .find("received:")
            .map(|j| &tail[j + "received:".len()..])
            .or_else(|| {
                tail.find("received from ")
                    .map(|j| &tail[j + "received from ".len()..])
            });
        let dev = after.and_then(first_pci_word);
        let pci = dev.or_else(|| first_pci_word(&msg[..i]))?;
        return Some(KernelEvent::PcieAer {
            pci,
            fatal,
            message: msg.trim().to_string(),
        });
    }
    if let Some(i) = memmem::find(b, b"PCIe Bus Error: severity=") {
        // `<driver> <dev>: [AER: ]PCIe Bus Error: severity=Uncorrected (Fatal), type=…`
        let pci = first_pci_word(&msg[..i])?;
        return Some(KernelEvent::PcieAer {
            pci,
            fatal,
            message: msg.trim().to_string(),
        });
    }
    None
}

fn parse_mce(msg: &str) -> Option<KernelEvent> {
    let b = msg.as_bytes();
    let cpu = number_after(msg, "cpu ");
    let bank = number_after(msg, "bank ");
    let corrected = if memmem::find(b, b"Machine check events logged").is_some() {
        true
    } else if memmem::find(b, b"Machine Check Exception").is_some()
        || memmem::find(b, b"Uncorrected hardware memory error").is_some()
        || memmem::find(b, b"Machine check: ").is_some()
    {
        // The last form is the kernel's severity verdict (`Processor context corrupt`).
        false
    } else if let Some(i) = memmem::find(b, b"EDAC MC") {
        // `EDAC MC0: 1 CE memory read error …` / `… UE …`
        let tail = &msg[i..];
        if tail.contains(" UE ") {
            false
        } else if tail.contains(" CE ") {
            true
        } else {
            return None;
        }
    } else if let Some(i) = memmem::find(b, b"Machine Check:") {
        // A decoded record: `CPU 3: Machine Check: 0 Bank 7: cc0000c000010091`. Bit 61 of
        // the bank status (UC) says whether the error was corrected.
        let status = msg[i..].rsplit(": ").next()?.trim();
        let status = u64::from_str_radix(status.split_whitespace().next()?, 16).ok()?;
        status & (1 << 61) == 0
    } else {
        return None;
    };
    Some(KernelEvent::MachineCheck {
        corrected,
        cpu,
        bank,
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
