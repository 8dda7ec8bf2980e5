//! Parsers for the Ascend tools' text output: the `npu-smi info` chip table, the per-chip health
//! query (`npu-smi info -t health -i <card> -c <chip>`) and four `hccn_tool -i <n> … -g` queries
//! (`-link`, `-speed`, `-link_stat`, `-net_health`).
//!
//! The `npu-smi info` layout differs between driver versions and products: column widths, a
//! `Phy-ID` (Atlas A3) or `Device` (310/310P) number beside the chip number, no hugepages
//! column on old drivers, no `Bus-Id` column on some SoC boards, one or two chips per card (each
//! chip normally repeats its card's NPU row; a single NPU row followed by several chip rows is
//! accepted too). So the table parser never uses offsets: it splits `|` rows into cells, learns
//! the layout from the two header rows, and then tells NPU rows from chip rows by what their
//! cells hold. It stops at the process table.
//!
//! The other outputs are `key : value` lines, matched by key (case and spacing ignored) after an
//! optional `[devid N]` / `[device N]` prefix.
//!
//! Every parser takes borrowed text, tolerates CRLF, indentation, banners and unrelated lines, and
//! never panics. Text without the expected line, or with a value that does not read, is an
//! [`AscendParseError`] naming the query and quoting at most 80 characters of what was wrong;
//! nothing falls back to a default.
//!
//! `npu_smi` reads `npu-smi`'s two outputs, `hccn` the four `hccn_tool` queries; this module
//! holds what they share: the error type and the helpers for excerpts and `key : value` lines.

mod hccn;
mod npu_smi;

pub use hccn::{
    parse_link_status, parse_link_up_count, parse_net_health, parse_speed_mbps, LinkStatus,
    NetHealth,
};
pub use npu_smi::{parse_chip_health, parse_npu_info, ChipHealth, NpuChip, NpuHealth};

/// Why a tool's output could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AscendParseError {
    /// No `| NPU … Name | Health | …` header: the text is not a chip table (an error message,
    /// an empty output).
    #[error("npu-smi info: no chip table header found (output begins {output:?})")]
    NoTable { output: String },
    /// The chip table header is not followed by its `Chip [Phy-ID|Device] | Bus-Id` row.
    #[error("npu-smi info: the header is not followed by a `Chip` header row: {line:?}")]
    BadHeader { line: String },
    /// A table with headers but no chip rows.
    #[error("npu-smi info: no chip rows found")]
    NoChips,
    /// A row in the chip table that is neither an NPU row nor a chip row of this layout.
    #[error("npu-smi info: unrecognized table row {line:?}")]
    BadRow { line: String },
    /// A chip row before any NPU row.
    #[error("npu-smi info: chip row without an NPU row before it: {line:?}")]
    ChipWithoutNpu { line: String },
    /// An NPU row not followed by a chip row (a truncated table).
    #[error("npu-smi info: NPU row without a chip row after it: {line:?}")]
    NpuWithoutChip { line: String },
    /// A `Bus-Id` cell that is neither a PCI address nor `NA`.
    #[error("npu-smi info: unparseable Bus-Id {value:?}")]
    BadBusId { value: String },
    /// `npu-smi` rejected the card, chip or device id it was given (`Invalid card id.`).
    #[error("npu-smi: invalid {what} id: {line:?}")]
    InvalidId { what: &'static str, line: String },
    /// The query's key line is missing.
    #[error("{query}: no `{key}` line (output begins {output:?})")]
    MissingLine {
        query: &'static str,
        key: &'static str,
        output: String,
    },
    /// The query's key line has a value that does not read.
    #[error("{query}: unparseable `{key}` value {value:?}")]
    BadValue {
        query: &'static str,
        key: &'static str,
        value: String,
    },
    /// An `Error Code` entry that is not a hexadecimal 32-bit code.
    #[error("unparseable error code {code:?}")]
    BadErrorCode { code: String },
}

/// At most this many characters of offending text go into an error.
const EXCERPT_CHARS: usize = 80;

/// `s` trimmed and cut to [`EXCERPT_CHARS`] characters (the last one `…` when cut).
fn excerpt(s: &str) -> String {
    let t = s.trim();
    if t.chars().count() <= EXCERPT_CHARS {
        return t.to_string();
    }
    let mut out: String = t.chars().take(EXCERPT_CHARS - 1).collect();
    out.push('…');
    out
}

/// An excerpt of the first non-blank line of `text`.
fn first_line(text: &str) -> String {
    excerpt(
        text.lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or(""),
    )
}

/// Whether `a` and `b` have the same words, ignoring ASCII case and the spacing between words.
fn words_eq(a: &str, b: &str) -> bool {
    let mut x = a.split_whitespace();
    let mut y = b.split_whitespace();
    loop {
        match (x.next(), y.next()) {
            (None, None) => return true,
            (Some(p), Some(q)) if p.eq_ignore_ascii_case(q) => {}
            _ => return false,
        }
    }
}

/// Whether `s` starts with `prefix`, ignoring ASCII case.
fn starts_with_ci(s: &str, prefix: &str) -> bool {
    s.len() >= prefix.len() && s.as_bytes()[..prefix.len()].eq_ignore_ascii_case(prefix.as_bytes())
}

/// A decimal number made of ASCII digits only (no sign, no spaces).
fn parse_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn parse_u32(s: &str) -> Option<u32> {
    parse_u64(s).and_then(|v| u32::try_from(v).ok())
}

/// `line` without a leading `[devid N]` / `[device N]` tag (hccn_tool prints one on some
/// queries and versions).
fn strip_dev_prefix(line: &str) -> &str {
    let t = line.trim_start();
    if let Some(rest) = t.strip_prefix('[') {
        if let Some((tag, after)) = rest.split_once(']') {
            let tag = tag.trim();
            let num = if starts_with_ci(tag, "devid") {
                tag.get(5..)
            } else if starts_with_ci(tag, "device") {
                tag.get(6..)
            } else {
                None
            };
            if num.is_some_and(|n| parse_u64(n.trim()).is_some()) {
                return after.trim_start();
            }
        }
    }
    t
}

/// A `key : value` line (after any device tag), both sides trimmed.
fn key_value(line: &str) -> Option<(&str, &str)> {
    let (k, v) = strip_dev_prefix(line).split_once(':')?;
    Some((k.trim(), v.trim()))
}

/// The value of the first line whose key is `key`.
fn find_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let (k, v) = key_value(line)?;
        words_eq(k, key).then_some(v)
    })
}

fn missing(query: &'static str, key: &'static str, text: &str) -> AscendParseError {
    AscendParseError::MissingLine {
        query,
        key,
        output: first_line(text),
    }
}

fn bad_value(query: &'static str, key: &'static str, value: &str) -> AscendParseError {
    AscendParseError::BadValue {
        query,
        key,
        value: excerpt(value),
    }
}

/// The recorded tool outputs in tests/fixtures/ascend, shared by the parsers' tests.
#[cfg(test)]
mod fixtures {
    macro_rules! fixture {
        ($name:literal) => {
            include_str!(concat!("../../../../tests/fixtures/ascend/", $name))
        };
    }

    pub const INFO_910B: &str = fixture!("npu-smi-info-910b-8.txt");
    pub const INFO_A3: &str = fixture!("npu-smi-info-910-phyid.txt");
    pub const INFO_310P: &str = fixture!("npu-smi-info-310p-2chips.txt");
    pub const INFO_FAULTS: &str = fixture!("npu-smi-info-910b-faults.txt");
    pub const INFO_310_OLD: &str = fixture!("npu-smi-info-310-old.txt");
    pub const HEALTH_OK: &str = fixture!("npu-smi-health-ok.txt");
    pub const HEALTH_ERROR: &str = fixture!("npu-smi-health-error.txt");
    pub const HEALTH_INVALID: &str = fixture!("npu-smi-health-invalid-card.txt");
    pub const LINK_UP: &str = fixture!("hccn-link-up.txt");
    pub const LINK_DOWN: &str = fixture!("hccn-link-down.txt");
    pub const SPEED: &str = fixture!("hccn-speed.txt");
    pub const LINK_STAT: &str = fixture!("hccn-link-stat.txt");
    pub const NET_OK: &str = fixture!("hccn-net-health-success.txt");
    pub const NET_FAULT: &str = fixture!("hccn-net-health-fault.txt");

    pub const ALL: [&str; 14] = [
        INFO_910B,
        INFO_A3,
        INFO_310P,
        INFO_FAULTS,
        INFO_310_OLD,
        HEALTH_OK,
        HEALTH_ERROR,
        HEALTH_INVALID,
        LINK_UP,
        LINK_DOWN,
        SPEED,
        LINK_STAT,
        NET_OK,
        NET_FAULT,
    ];
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn error_excerpts_are_short() {
        let long = format!(
            "| NPU Name | Health |\n| Chip | Bus-Id |\n| {} |\n",
            "x".repeat(500)
        );
        let Err(AscendParseError::BadRow { line }) = parse_npu_info(&long) else {
            panic!("expected BadRow")
        };
        assert_eq!(line.chars().count(), 80);
        assert!(line.ends_with('…'));
    }

    #[test]
    fn each_sample_reads_only_as_its_own_output() {
        // Which parsers accept each sample: npu info, chip health, link, speed, link_stat,
        // net health.
        let cases: [(&str, [bool; 6]); 14] = [
            (INFO_910B, [true, false, false, false, false, false]),
            (INFO_A3, [true, false, false, false, false, false]),
            (INFO_310P, [true, false, false, false, false, false]),
            (INFO_FAULTS, [true, false, false, false, false, false]),
            (INFO_310_OLD, [true, false, false, false, false, false]),
            (HEALTH_OK, [false, true, false, false, false, false]),
            (HEALTH_ERROR, [false, true, false, false, false, false]),
            (HEALTH_INVALID, [false, false, false, false, false, false]),
            (LINK_UP, [false, false, true, false, false, false]),
            (LINK_DOWN, [false, false, true, false, false, false]),
            (SPEED, [false, false, false, true, false, false]),
            (LINK_STAT, [false, false, false, false, true, false]),
            (NET_OK, [false, false, false, false, false, true]),
            (NET_FAULT, [false, false, false, false, false, true]),
        ];
        for (text, want) in cases {
            let got = [
                parse_npu_info(text).is_ok(),
                parse_chip_health(text).is_ok(),
                parse_link_status(text).is_ok(),
                parse_speed_mbps(text).is_ok(),
                parse_link_up_count(text).is_ok(),
                parse_net_health(text).is_ok(),
            ];
            assert_eq!(got, want, "{text}");
        }
    }

    /// Runs every parser; checks what must hold whatever the input.
    fn run_all(text: &str) {
        let check = |e: AscendParseError| {
            let msg = e.to_string();
            assert!(msg.chars().count() < 1200, "{msg}");
        };
        match parse_npu_info(text) {
            Ok(chips) => {
                assert!(!chips.is_empty());
                for c in &chips {
                    let _ = c.logical_id();
                    let _ = c.health.as_str();
                }
            }
            Err(e) => check(e),
        }
        if let Err(e) = parse_chip_health(text) {
            check(e);
        }
        if let Err(e) = parse_link_status(text) {
            check(e);
        }
        if let Err(e) = parse_speed_mbps(text) {
            check(e);
        }
        if let Err(e) = parse_link_up_count(text) {
            check(e);
        }
        if let Err(e) = parse_net_health(text) {
            check(e);
        }
    }

    #[derive(Debug, Clone)]
    enum Edit {
        Delete(usize),
        Duplicate(usize),
        Truncate(usize, usize),
        Swap(usize, usize),
        Insert(usize, String),
        Replace(usize, String),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        let junk = prop_oneof![
            "\\PC{0,40}",
            "[| :0-9A-Fa-f.\\-\\[\\]]{0,60}",
            Just("| NPU Name | Health |".to_string()),
            Just("| Chip Phy-ID | Bus-Id |".to_string()),
            Just("| 0 0 | NA |".to_string()),
            Just("                               : more".to_string()),
        ];
        prop_oneof![
            (0usize..64).prop_map(Edit::Delete),
            (0usize..64).prop_map(Edit::Duplicate),
            (0usize..64, 0usize..120).prop_map(|(l, c)| Edit::Truncate(l, c)),
            (0usize..64, 0usize..64).prop_map(|(a, b)| Edit::Swap(a, b)),
            (0usize..64, junk.clone()).prop_map(|(l, s)| Edit::Insert(l, s)),
            (0usize..64, junk).prop_map(|(l, s)| Edit::Replace(l, s)),
        ]
    }

    fn apply(base: &str, edits: &[Edit]) -> String {
        let mut lines: Vec<String> = base.lines().map(str::to_string).collect();
        for e in edits {
            let n = lines.len().max(1);
            match e {
                Edit::Delete(i) if !lines.is_empty() => {
                    lines.remove(i % n);
                }
                Edit::Duplicate(i) if !lines.is_empty() => {
                    let l = lines[i % n].clone();
                    lines.insert(i % n, l);
                }
                Edit::Truncate(i, c) if !lines.is_empty() => {
                    let l: String = lines[i % n].chars().take(*c).collect();
                    lines[i % n] = l;
                }
                Edit::Swap(a, b) if !lines.is_empty() => lines.swap(a % n, b % n),
                Edit::Insert(i, s) => lines.insert(i % (lines.len() + 1), s.clone()),
                Edit::Replace(i, s) if !lines.is_empty() => lines[i % n] = s.clone(),
                _ => {}
            }
        }
        lines.join("\n")
    }

    proptest! {
        #[test]
        fn never_panics_on_any_text(s in "\\PC{0,300}") {
            run_all(&s);
        }

        #[test]
        fn never_panics_on_table_like_text(s in "[| :\\n\\r0-9A-Za-z.\\-\\[\\]/]{0,400}") {
            run_all(&s);
        }

        #[test]
        fn never_panics_on_mutated_fixtures(
            base in prop::sample::select(ALL.to_vec()),
            edits in prop::collection::vec(edit(), 1..6),
        ) {
            run_all(&apply(base, &edits));
        }
    }
}
