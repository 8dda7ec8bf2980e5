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

use std::fmt;

use crate::parse::PciAddr;

/// A chip's health as `npu-smi` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NpuHealth {
    /// `OK`
    Ok,
    /// `Warning`: a minor alarm.
    Warning,
    /// `Alarm`: a major alarm.
    Alarm,
    /// `Critical`: a critical alarm.
    Critical,
    /// `UNKNOWN`: the chip is absent or not started.
    Unknown,
    /// Any other word, kept as printed (trimmed).
    Other(String),
}

impl NpuHealth {
    /// Reads a health word, case-insensitively; surrounding whitespace is ignored.
    pub fn parse(s: &str) -> NpuHealth {
        let t = s.trim();
        if t.eq_ignore_ascii_case("ok") {
            NpuHealth::Ok
        } else if t.eq_ignore_ascii_case("warning") {
            NpuHealth::Warning
        } else if t.eq_ignore_ascii_case("alarm") {
            NpuHealth::Alarm
        } else if t.eq_ignore_ascii_case("critical") {
            NpuHealth::Critical
        } else if t.eq_ignore_ascii_case("unknown") {
            NpuHealth::Unknown
        } else {
            NpuHealth::Other(t.to_string())
        }
    }

    /// The word as `npu-smi` prints it: `OK`, `Warning`, `Alarm`, `Critical`, `UNKNOWN`, or the
    /// text of an `Other`.
    pub fn as_str(&self) -> &str {
        match self {
            NpuHealth::Ok => "OK",
            NpuHealth::Warning => "Warning",
            NpuHealth::Alarm => "Alarm",
            NpuHealth::Critical => "Critical",
            NpuHealth::Unknown => "UNKNOWN",
            NpuHealth::Other(s) => s,
        }
    }

    /// Whether the driver rates the chip above a minor alarm (`Alarm` or `Critical`): the
    /// condition under which MindCluster isolates a chip for an error code it does not list.
    pub fn is_severe(&self) -> bool {
        matches!(self, NpuHealth::Alarm | NpuHealth::Critical)
    }
}

impl fmt::Display for NpuHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One chip of `npu-smi info`: its NPU row and its chip row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpuChip {
    /// The NPU (card) id of the NPU row, as `npu-smi info -i` takes it.
    pub npu: u32,
    /// The chip number within the card, as `npu-smi info -c` takes it.
    pub chip: u32,
    /// The physical id beside the chip number (`Chip  Phy-ID` layouts, Atlas A3).
    pub phy_id: Option<u32>,
    /// The device (logical) id beside the chip number (`Chip  Device` layouts, 310/310P).
    pub device: Option<u32>,
    /// The chip name of the NPU row (`910B3`, `Ascend910`, `310P3`).
    pub name: String,
    /// The health of the NPU row.
    pub health: NpuHealth,
    /// The chip row's `Bus-Id`; `None` where the tool prints `NA` or the layout has no such
    /// column.
    pub bus_id: Option<PciAddr>,
}

impl NpuChip {
    /// The number in the device plugin's name for this chip (`Ascend910-<n>`): the `Phy-ID`
    /// where the table prints one, else the `Device` id, else the NPU id. The last is right for
    /// layouts with one chip per card (910, 910B), where the NPU id is the chip's id; in a
    /// layout with several chips per card and neither column, chips of one card share the
    /// number, so callers must not rely on it there.
    pub fn logical_id(&self) -> u32 {
        self.phy_id.or(self.device).unwrap_or(self.npu)
    }
}

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

// ---------------------------------------------------------------------------------------------
// npu-smi info

/// What the first cell of a chip row holds, learned from the second header row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChipCell {
    /// `Chip`: the chip number alone.
    Plain,
    /// `Chip  Phy-ID`: chip number and physical id.
    PhyId,
    /// `Chip  Device`: chip number and device (logical) id.
    Device,
    /// An empty cell (one chip per NPU row, numbered by position).
    Blank,
}

/// The table layout, learned from the header rows.
#[derive(Debug, Clone, Copy)]
struct Layout {
    /// The cell with the chip name when it has one of its own; `None` when the name shares the
    /// first cell with the NPU id (`| NPU   Name |`).
    name_col: Option<usize>,
    health_col: usize,
    chip: ChipCell,
    bus_col: Option<usize>,
}

/// The cells of a table row (`| a | b |`), trimmed; `None` for any other line.
fn cells(line: &str) -> Option<Vec<&str>> {
    let rest = line.trim().strip_prefix('|')?;
    let rest = rest.strip_suffix('|').unwrap_or(rest);
    Some(rest.split('|').map(str::trim).collect())
}

/// The first header row: `| NPU   Name | Health | …` (or `| NPU ID | Name | Health | …`).
fn header_row(cells: &[&str]) -> Option<Layout> {
    let first = cells.first()?;
    if !first
        .split_whitespace()
        .next()
        .is_some_and(|w| w.eq_ignore_ascii_case("npu"))
    {
        return None;
    }
    let health_col = cells.iter().position(|c| starts_with_ci(c, "health"))?;
    let name_col = if first
        .split_whitespace()
        .any(|w| w.eq_ignore_ascii_case("name"))
    {
        None
    } else {
        Some(cells.iter().position(|c| words_eq(c, "name"))?)
    };
    Some(Layout {
        name_col,
        health_col,
        chip: ChipCell::Plain,
        bus_col: None,
    })
}

/// The second header row: `| Chip [Phy-ID|Device] | Bus-Id | …` (or an empty first cell).
fn chip_header_row(mut layout: Layout, cells: &[&str]) -> Option<Layout> {
    let first = cells.first()?;
    let words: Vec<&str> = first.split_whitespace().collect();
    let bus_col = cells.iter().position(|c| starts_with_ci(c, "bus-id"));
    layout.chip = match words.as_slice() {
        [] if bus_col.is_some() => ChipCell::Blank,
        [c] if c.eq_ignore_ascii_case("chip") => ChipCell::Plain,
        [c, p]
            if c.eq_ignore_ascii_case("chip")
                && ["phy-id", "phyid", "phy_id"]
                    .iter()
                    .any(|k| p.eq_ignore_ascii_case(k)) =>
        {
            ChipCell::PhyId
        }
        [c, d] if c.eq_ignore_ascii_case("chip") && d.eq_ignore_ascii_case("device") => {
            ChipCell::Device
        }
        _ => return None,
    };
    layout.bus_col = bus_col;
    Some(layout)
}

/// One classified data row.
enum Row<'a> {
    Npu {
        npu: u32,
        name: String,
        health: NpuHealth,
    },
    Chip {
        /// `None` for a `Blank` chip cell.
        chip: Option<u32>,
        /// The Phy-ID or Device number.
        second: Option<u32>,
        bus: Option<&'a str>,
    },
}

fn classify<'a>(
    layout: &Layout,
    cells: &[&'a str],
    line: &str,
) -> Result<Row<'a>, AscendParseError> {
    let bad_row = || AscendParseError::BadRow {
        line: excerpt(line),
    };
    let first: Vec<&str> = cells
        .first()
        .map_or_else(Vec::new, |c| c.split_whitespace().collect());
    let health_cell = cells.get(layout.health_col).copied().unwrap_or("");

    // An NPU row: the NPU id, the chip name and a health word.
    match layout.name_col {
        None => {
            if let [id, name @ ..] = first.as_slice() {
                if let (Some(npu), false, false) =
                    (parse_u32(id), name.is_empty(), health_cell.is_empty())
                {
                    let name = name.join(" ");
                    let health = NpuHealth::parse(health_cell);
                    // A chip row of a `Chip  Device` table also starts with two numbers; an NPU
                    // row is told apart by its health word, or by a name that is not a number
                    // (`910B3`; old 310 cards print the bare name `310`).
                    let numeric_name = name.bytes().all(|b| b.is_ascii_digit());
                    if !matches!(health, NpuHealth::Other(_)) || !numeric_name {
                        return Ok(Row::Npu { npu, name, health });
                    }
                }
            }
        }
        Some(nc) => {
            let name = cells.get(nc).copied().unwrap_or("");
            if let ([id], false, false) =
                (first.as_slice(), name.is_empty(), health_cell.is_empty())
            {
                if let Some(npu) = parse_u32(id) {
                    return Ok(Row::Npu {
                        npu,
                        name: name.to_string(),
                        health: NpuHealth::parse(health_cell),
                    });
                }
            }
        }
    }

    // A chip row.
    let (chip, second) = match (layout.chip, first.as_slice()) {
        (ChipCell::Blank, []) => (None, None),
        (ChipCell::Plain, [c]) => (Some(parse_u32(c).ok_or_else(bad_row)?), None),
        (ChipCell::PhyId | ChipCell::Device, [c, n]) => (
            Some(parse_u32(c).ok_or_else(bad_row)?),
            Some(parse_u32(n).ok_or_else(bad_row)?),
        ),
        _ => return Err(bad_row()),
    };
    let bus = match layout.bus_col {
        None => None,
        Some(bc) => Some(*cells.get(bc).ok_or_else(bad_row)?),
    };
    Ok(Row::Chip { chip, second, bus })
}

/// The NPU row the next chip rows belong to.
struct CurrentNpu {
    npu: u32,
    name: String,
    health: NpuHealth,
    /// Chip rows read under it so far.
    chips: u32,
    line: String,
}

/// Parses `npu-smi info`: one [`NpuChip`] per chip row, in table order.
pub fn parse_npu_info(text: &str) -> Result<Vec<NpuChip>, AscendParseError> {
    enum State {
        Searching,
        WantChipHeader(Layout, String),
        Rows(Layout),
    }
    let mut state = State::Searching;
    let mut chips = Vec::new();
    let mut current: Option<CurrentNpu> = None;

    for line in text.lines() {
        let Some(cells) = cells(line) else { continue };
        if cells
            .iter()
            .any(|c| starts_with_ci(c, "no running processes"))
        {
            continue;
        }
        match state {
            State::Searching => {
                // Rows before the header (the version banner) are not the table's.
                if let Some(layout) = header_row(&cells) {
                    state = State::WantChipHeader(layout, excerpt(line));
                }
            }
            State::WantChipHeader(layout, _) => {
                let layout =
                    chip_header_row(layout, &cells).ok_or_else(|| AscendParseError::BadHeader {
                        line: excerpt(line),
                    })?;
                state = State::Rows(layout);
            }
            State::Rows(layout) => {
                if cells.iter().any(|c| starts_with_ci(c, "process id")) {
                    break;
                }
                if header_row(&cells).is_some() {
                    return Err(AscendParseError::BadRow {
                        line: excerpt(line),
                    });
                }
                match classify(&layout, &cells, line)? {
                    Row::Npu { npu, name, health } => {
                        if let Some(prev) = current.take() {
                            if prev.chips == 0 {
                                return Err(AscendParseError::NpuWithoutChip { line: prev.line });
                            }
                        }
                        current = Some(CurrentNpu {
                            npu,
                            name,
                            health,
                            chips: 0,
                            line: excerpt(line),
                        });
                    }
                    Row::Chip { chip, second, bus } => {
                        let Some(cur) = current.as_mut() else {
                            return Err(AscendParseError::ChipWithoutNpu {
                                line: excerpt(line),
                            });
                        };
                        let bus_id =
                            match bus {
                                None => None,
                                Some(b) if b.eq_ignore_ascii_case("na") || b == "-" => None,
                                Some(b) => Some(b.parse::<PciAddr>().map_err(|_| {
                                    AscendParseError::BadBusId { value: excerpt(b) }
                                })?),
                            };
                        let (phy_id, device) = match layout.chip {
                            ChipCell::PhyId => (second, None),
                            ChipCell::Device => (None, second),
                            ChipCell::Plain | ChipCell::Blank => (None, None),
                        };
                        chips.push(NpuChip {
                            npu: cur.npu,
                            chip: chip.unwrap_or(cur.chips),
                            phy_id,
                            device,
                            name: cur.name.clone(),
                            health: cur.health.clone(),
                            bus_id,
                        });
                        cur.chips = cur.chips.saturating_add(1);
                    }
                }
            }
        }
    }

    match state {
        State::Searching => Err(AscendParseError::NoTable {
            output: first_line(text),
        }),
        State::WantChipHeader(_, header) => Err(AscendParseError::BadHeader { line: header }),
        State::Rows(_) => {
            if let Some(cur) = current {
                if cur.chips == 0 {
                    return Err(AscendParseError::NpuWithoutChip { line: cur.line });
                }
            }
            if chips.is_empty() {
                Err(AscendParseError::NoChips)
            } else {
                Ok(chips)
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// key : value outputs

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

/// The result of `npu-smi info -t health -i <card> -c <chip>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChipHealth {
    pub health: NpuHealth,
    /// The `Error Code` entries, in printed order; empty for `NA`.
    pub error_codes: Vec<u32>,
    /// The `Error Information` text, continuation lines joined with `; `; empty for `NA` or
    /// when the line is absent.
    pub error_info: String,
}

/// `Invalid card id.` / `Invalid chip id.` / `Invalid device id.`: which id `npu-smi` rejected.
fn invalid_id(line: &str) -> Option<&'static str> {
    let l = line.to_ascii_lowercase();
    let words: Vec<&str> = l
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    words.windows(3).find_map(|w| match w {
        ["invalid", what, "id"] => match *what {
            "card" => Some("card"),
            "chip" => Some("chip"),
            "device" => Some("device"),
            "npu" => Some("npu"),
            _ => None,
        },
        _ => None,
    })
}

/// One `Error Code` entry: up to 8 hex digits, an optional `0x`, any case.
fn error_code(token: &str) -> Result<u32, AscendParseError> {
    let hex = token
        .strip_prefix("0x")
        .or_else(|| token.strip_prefix("0X"))
        .unwrap_or(token);
    if hex.is_empty() || hex.len() > 8 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(AscendParseError::BadErrorCode {
            code: excerpt(token),
        });
    }
    u32::from_str_radix(hex, 16).map_err(|_| AscendParseError::BadErrorCode {
        code: excerpt(token),
    })
}

/// Parses `npu-smi info -t health -i <card> -c <chip>`. `Health Status` and `Error Code` are
/// required; `Error Information` may be absent. Lines that start with `:` continue the key
/// before them. `Invalid card id.` (or chip/device id) is [`AscendParseError::InvalidId`].
pub fn parse_chip_health(text: &str) -> Result<ChipHealth, AscendParseError> {
    const Q: &str = "npu-smi health";
    if let Some((what, line)) = text
        .lines()
        .find_map(|l| invalid_id(l).map(|what| (what, l)))
    {
        return Err(AscendParseError::InvalidId {
            what,
            line: excerpt(line),
        });
    }

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Key {
        Health,
        Code,
        Info,
    }
    let mut health: Option<&str> = None;
    let mut codes: Option<Vec<&str>> = None;
    let mut info: Option<Vec<&str>> = None;
    let mut last: Option<Key> = None;
    for line in text.lines() {
        let t = strip_dev_prefix(line.trim());
        if let Some(rest) = t.strip_prefix(':') {
            match last {
                Some(Key::Code) => codes.get_or_insert_with(Vec::new).push(rest.trim()),
                Some(Key::Info) => info.get_or_insert_with(Vec::new).push(rest.trim()),
                _ => {}
            }
            continue;
        }
        last = None;
        let Some((k, v)) = key_value(t) else { continue };
        if words_eq(k, "health status") {
            if health.is_none() {
                health = Some(v);
                last = Some(Key::Health);
            }
        } else if words_eq(k, "error code") {
            if codes.is_none() {
                codes = Some(vec![v]);
                last = Some(Key::Code);
            }
        } else if words_eq(k, "error information") && info.is_none() {
            info = Some(vec![v]);
            last = Some(Key::Info);
        }
    }

    let health = match health {
        Some(h) if !h.is_empty() => NpuHealth::parse(h),
        Some(h) => return Err(bad_value(Q, "Health Status", h)),
        None => return Err(missing(Q, "Health Status", text)),
    };
    let Some(code_parts) = codes else {
        return Err(missing(Q, "Error Code", text));
    };
    let mut error_codes = Vec::new();
    let mut any = false;
    for token in code_parts
        .iter()
        .flat_map(|p| p.split(|c: char| c.is_whitespace() || c == ','))
        .filter(|t| !t.is_empty())
    {
        any = true;
        if !token.eq_ignore_ascii_case("na") {
            error_codes.push(error_code(token)?);
        }
    }
    if !any {
        return Err(bad_value(Q, "Error Code", ""));
    }
    let error_info = info
        .unwrap_or_default()
        .into_iter()
        .filter(|p| !p.is_empty() && !p.eq_ignore_ascii_case("na"))
        .collect::<Vec<_>>()
        .join("; ");
    Ok(ChipHealth {
        health,
        error_codes,
        error_info,
    })
}

/// The state `hccn_tool -i <n> -link -g` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkStatus {
    Up,
    Down,
}

/// Parses `hccn_tool -i <n> -link -g` (`link status: UP` or `link status: DOWN`).
pub fn parse_link_status(text: &str) -> Result<LinkStatus, AscendParseError> {
    const Q: &str = "hccn_tool link";
    const K: &str = "link status";
    let v = find_value(text, K).ok_or_else(|| missing(Q, K, text))?;
    if v.eq_ignore_ascii_case("up") {
        Ok(LinkStatus::Up)
    } else if v.eq_ignore_ascii_case("down") {
        Ok(LinkStatus::Down)
    } else {
        Err(bad_value(Q, K, v))
    }
}

/// Parses `hccn_tool -i <n> -speed -g` (`Speed: 100000 Mb/s`) into megabits per second. A
/// speed the tool cannot tell (`Unknown!`) is an error.
pub fn parse_speed_mbps(text: &str) -> Result<u64, AscendParseError> {
    const Q: &str = "hccn_tool speed";
    const K: &str = "Speed";
    let v = find_value(text, K).ok_or_else(|| missing(Q, K, text))?;
    let mut words = v.split_whitespace();
    let (Some(num), unit, None) = (words.next(), words.next(), words.next()) else {
        return Err(bad_value(Q, K, v));
    };
    let unit_ok = unit.is_none_or(|u| {
        ["mb/s", "mbps", "mbit/s"]
            .iter()
            .any(|k| u.eq_ignore_ascii_case(k))
    });
    match parse_u64(num) {
        Some(n) if unit_ok => Ok(n),
        _ => Err(bad_value(Q, K, v)),
    }
}

/// Parses `hccn_tool -i <n> -link_stat -g`: the `link up count` (lines may carry a
/// `[devid N]` or `[device N]` tag).
pub fn parse_link_up_count(text: &str) -> Result<u64, AscendParseError> {
    const Q: &str = "hccn_tool link_stat";
    const K: &str = "link up count";
    let v = find_value(text, K).ok_or_else(|| missing(Q, K, text))?;
    parse_u64(v).ok_or_else(|| bad_value(Q, K, v))
}

/// The result of `hccn_tool -i <n> -net_health -g`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetHealth {
    /// The state as printed (`Success`, `Init`, `Socket failed`, `Receive timeout`,
    /// `Unreachable`, `Fault`, `Detect ip set`, …).
    pub state: String,
    /// Only `Success` and `Init` are healthy.
    pub healthy: bool,
}

/// Parses `hccn_tool -i <n> -net_health -g` (`net health status: <state>`).
pub fn parse_net_health(text: &str) -> Result<NetHealth, AscendParseError> {
    const Q: &str = "hccn_tool net_health";
    const K: &str = "net health status";
    let v = find_value(text, K).ok_or_else(|| missing(Q, K, text))?;
    if v.is_empty() {
        return Err(bad_value(Q, K, v));
    }
    let healthy = words_eq(v, "success") || words_eq(v, "init");
    Ok(NetHealth {
        state: v.split_whitespace().collect::<Vec<_>>().join(" "),
        healthy,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    macro_rules! fixture {
        ($name:literal) => {
            include_str!(concat!("../../../tests/fixtures/ascend/", $name))
        };
    }

    const INFO_910B: &str = fixture!("npu-smi-info-910b-8.txt");
    const INFO_A3: &str = fixture!("npu-smi-info-910-phyid.txt");
    const INFO_310P: &str = fixture!("npu-smi-info-310p-2chips.txt");
    const INFO_FAULTS: &str = fixture!("npu-smi-info-910b-faults.txt");
    const INFO_310_OLD: &str = fixture!("npu-smi-info-310-old.txt");
    const HEALTH_OK: &str = fixture!("npu-smi-health-ok.txt");
    const HEALTH_ERROR: &str = fixture!("npu-smi-health-error.txt");
    const HEALTH_INVALID: &str = fixture!("npu-smi-health-invalid-card.txt");
    const LINK_UP: &str = fixture!("hccn-link-up.txt");
    const LINK_DOWN: &str = fixture!("hccn-link-down.txt");
    const SPEED: &str = fixture!("hccn-speed.txt");
    const LINK_STAT: &str = fixture!("hccn-link-stat.txt");
    const NET_OK: &str = fixture!("hccn-net-health-success.txt");
    const NET_FAULT: &str = fixture!("hccn-net-health-fault.txt");

    const ALL: [&str; 14] = [
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

    fn pci(s: &str) -> Option<PciAddr> {
        Some(s.parse().unwrap())
    }

    fn chip(npu: u32, chip: u32, name: &str, health: NpuHealth, bus: &str) -> NpuChip {
        NpuChip {
            npu,
            chip,
            phy_id: None,
            device: None,
            name: name.into(),
            health,
            bus_id: pci(bus),
        }
    }

    #[test]
    fn health_words() {
        for (s, h, out) in [
            ("OK", NpuHealth::Ok, "OK"),
            (" ok ", NpuHealth::Ok, "OK"),
            ("Warning", NpuHealth::Warning, "Warning"),
            ("ALARM", NpuHealth::Alarm, "Alarm"),
            ("critical", NpuHealth::Critical, "Critical"),
            ("UNKNOWN", NpuHealth::Unknown, "UNKNOWN"),
            ("Unknown", NpuHealth::Unknown, "UNKNOWN"),
            ("Degraded", NpuHealth::Other("Degraded".into()), "Degraded"),
        ] {
            let got = NpuHealth::parse(s);
            assert_eq!(got, h, "{s:?}");
            assert_eq!(got.as_str(), out);
            assert_eq!(got.to_string(), out);
        }
        let severe: Vec<bool> = [
            NpuHealth::Ok,
            NpuHealth::Warning,
            NpuHealth::Alarm,
            NpuHealth::Critical,
            NpuHealth::Unknown,
            NpuHealth::Other("x".into()),
        ]
        .iter()
        .map(NpuHealth::is_severe)
        .collect();
        assert_eq!(severe, [false, false, true, true, false, false]);
    }

    #[test]
    fn info_910b_eight_chips() {
        let got = parse_npu_info(INFO_910B).unwrap();
        let buses = [
            "0000:c1:00.0",
            "0000:c2:00.0",
            "0000:81:00.0",
            "0000:82:00.0",
            "0000:01:00.0",
            "0000:02:00.0",
            "0000:41:00.0",
            "0000:42:00.0",
        ];
        let want: Vec<NpuChip> = buses
            .iter()
            .enumerate()
            .map(|(i, b)| chip(i as u32, 0, "910B3", NpuHealth::Ok, b))
            .collect();
        assert_eq!(got, want);
        let ids: Vec<u32> = got.iter().map(NpuChip::logical_id).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn info_a3_phy_ids() {
        let got = parse_npu_info(INFO_A3).unwrap();
        let buses = [
            "0000:9d:00.0",
            "0000:9f:00.0",
            "0000:99:00.0",
            "0000:9b:00.0",
            "0000:b9:00.0",
            "0000:bb:00.0",
            "0000:bd:00.0",
            "0000:bf:00.0",
        ];
        let want: Vec<NpuChip> = buses
            .iter()
            .enumerate()
            .map(|(i, b)| NpuChip {
                phy_id: Some(i as u32),
                ..chip(i as u32 / 2, i as u32 % 2, "Ascend910", NpuHealth::Ok, b)
            })
            .collect();
        assert_eq!(got, want);
        assert_eq!(got[5].logical_id(), 5);
    }

    #[test]
    fn info_310p_two_chips_per_card() {
        let got = parse_npu_info(INFO_310P).unwrap();
        let want = vec![
            NpuChip {
                device: Some(0),
                ..chip(2, 0, "310P3", NpuHealth::Ok, "0000:01:00.0")
            },
            NpuChip {
                device: Some(1),
                ..chip(2, 1, "310P3", NpuHealth::Ok, "0000:01:00.0")
            },
            NpuChip {
                device: Some(2),
                ..chip(5, 0, "310P3", NpuHealth::Ok, "0000:81:00.0")
            },
            NpuChip {
                device: Some(3),
                ..chip(5, 1, "310P3", NpuHealth::Warning, "0000:81:00.0")
            },
        ];
        assert_eq!(got, want);
        let ids: Vec<u32> = got.iter().map(NpuChip::logical_id).collect();
        assert_eq!(ids, [0, 1, 2, 3]);
    }

    #[test]
    fn info_with_faulty_chips() {
        let got = parse_npu_info(INFO_FAULTS).unwrap();
        assert_eq!(got.len(), 8);
        let health: Vec<&str> = got.iter().map(|c| c.health.as_str()).collect();
        assert_eq!(
            health,
            ["OK", "OK", "Warning", "Critical", "OK", "OK", "UNKNOWN", "Alarm"]
        );
        assert_eq!(
            got[3],
            chip(3, 0, "910B4", NpuHealth::Critical, "0000:82:00.0")
        );
        assert_eq!(
            got[6],
            chip(6, 0, "910B4", NpuHealth::Unknown, "0000:41:00.0")
        );
        let severe: Vec<u32> = got
            .iter()
            .filter(|c| c.health.is_severe())
            .map(|c| c.npu)
            .collect();
        assert_eq!(severe, [3, 7]);
    }

    #[test]
    fn info_old_driver_without_hugepages_column() {
        let got = parse_npu_info(INFO_310_OLD).unwrap();
        let want: Vec<NpuChip> = (0..4u32)
            .map(|i| NpuChip {
                device: Some(i),
                ..chip(1, i, "310", NpuHealth::Ok, &format!("0000:0{}:00.0", i + 4))
            })
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn info_tolerates_crlf_indentation_and_banners() {
        let crlf = INFO_FAULTS.replace('\n', "\r\n");
        assert_eq!(
            parse_npu_info(&crlf).unwrap(),
            parse_npu_info(INFO_FAULTS).unwrap()
        );
        let indented: String = INFO_310P
            .lines()
            .map(|l| format!("        {l}   \n"))
            .collect();
        let text = format!("$ npu-smi info\n{indented}\n[WARNING] something unrelated\n");
        assert_eq!(
            parse_npu_info(&text).unwrap(),
            parse_npu_info(INFO_310P).unwrap()
        );
    }

    #[test]
    fn info_one_npu_row_for_several_chip_rows() {
        let text = "\
| NPU     Name      | Health          | Power(W)     Temp(C)    |
| Chip    Device    | Bus-Id          | AICore(%)    Memory-Usage(MB) |
+===================+=================+===============================+
| 3       310P3     | Alarm           | NA           51         |
| 0       6         | 0000:3B:00.0    | 0            1500 / 21000 |
| 1       7         | 0000:3B:00.0    | 0            1400 / 21000 |
+===================+=================+===============================+
";
        let got = parse_npu_info(text).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!((got[1].npu, got[1].chip, got[1].device), (3, 1, Some(7)));
        assert_eq!(got[1].health, NpuHealth::Alarm);
        assert_eq!(got[1].logical_id(), 7);
    }

    #[test]
    fn info_soc_board_without_bus_id() {
        // Atlas 200I A2 style: the Bus-Id cell reads NA.
        let text = "\
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
| 0       310B1                 | OK              | 8.9          54                15    / 15            |
| 0       0                     | NA              | 0            4974 / 11577                            |
";
        let got = parse_npu_info(text).unwrap();
        assert_eq!(got[0].bus_id, None);
        // A layout with no Bus-Id column at all.
        let text = "\
| NPU     Name        | Health          | Power     Temp(C)   |
| Chip    Device      | AICore(%)       | Memory-Usage(MB)    |
| 0       310B4       | Alarm           | 0.0       52        |
| 0       0           | 0-78            | 14407/15610         |
";
        let got = parse_npu_info(text).unwrap();
        assert_eq!(
            got,
            vec![NpuChip {
                device: Some(0),
                bus_id: None,
                ..chip(0, 0, "310B4", NpuHealth::Alarm, "0000:00:00.0")
            }]
        );
    }

    #[test]
    fn info_split_name_layout() {
        // The newest layout: `NPU ID | Name | Health`, no chip number.
        let text = "\
| NPU ID | Name             | Health        | Power(W)    Temp(C)           Hugepages-Usage(page) |
|        |                  | Bus-Id        | NPU Util(%) Memory-Usage(MB)  HBM-Usage(MB)         |
+========+==================+===============+=====================================================+
| 0      | Ascend950        | OK            | 350.1       40                0     / 0             |
|        |                  | 0000:01:00.0  | 12          0    / 0          2000  / 131072        |
+========+==================+===============+=====================================================+
| 1      | Ascend950        | Critical      | 340.0       41                0     / 0             |
|        |                  | 0000:02:00.0  | 0           0    / 0          2000  / 131072        |
+========+==================+===============+=====================================================+
| NPU ID                    | Process id    | Process name             | Process memory(MB)       |
";
        let got = parse_npu_info(text).unwrap();
        assert_eq!(
            got,
            vec![
                chip(0, 0, "Ascend950", NpuHealth::Ok, "0000:01:00.0"),
                chip(1, 0, "Ascend950", NpuHealth::Critical, "0000:02:00.0"),
            ]
        );
    }

    #[test]
    fn info_errors() {
        assert_eq!(
            parse_npu_info(""),
            Err(AscendParseError::NoTable { output: "".into() })
        );
        assert_eq!(
            parse_npu_info("dcmi module initialize failed. ret is -8005\n"),
            Err(AscendParseError::NoTable {
                output: "dcmi module initialize failed. ret is -8005".into()
            })
        );
        // Headers only.
        let headers: String = INFO_910B
            .lines()
            .take(6)
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(parse_npu_info(&headers), Err(AscendParseError::NoChips));
        // Header cut after the first header row.
        let cut: String = INFO_910B
            .lines()
            .take(4)
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(matches!(
            parse_npu_info(&cut),
            Err(AscendParseError::BadHeader { .. })
        ));
        // Truncated after an NPU row.
        let cut: String = INFO_910B
            .lines()
            .take(7)
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(matches!(
            parse_npu_info(&cut),
            Err(AscendParseError::NpuWithoutChip { .. })
        ));
        // Truncated inside a chip row, before its Bus-Id cell.
        let mut cut: String = INFO_910B
            .lines()
            .take(7)
            .map(|l| format!("{l}\n"))
            .collect();
        cut.push_str("| 0                        ");
        assert!(matches!(
            parse_npu_info(&cut),
            Err(AscendParseError::BadRow { .. })
        ));
        // A chip row before any NPU row.
        let text = "| NPU Name | Health |\n| Chip | Bus-Id |\n| 0 | 0000:01:00.0 |\n";
        assert!(matches!(
            parse_npu_info(text),
            Err(AscendParseError::ChipWithoutNpu { .. })
        ));
        // A garbled Bus-Id.
        let text =
            "| NPU Name | Health |\n| Chip | Bus-Id |\n| 0 910B | OK |\n| 0 | 0000:zz:00.0 |\n";
        assert_eq!(
            parse_npu_info(text),
            Err(AscendParseError::BadBusId {
                value: "0000:zz:00.0".into()
            })
        );
        // A Phy-ID table with a chip row missing its Phy-ID.
        let text =
            "| NPU Name | Health |\n| Chip Phy-ID | Bus-Id |\n| 0 Ascend910 | OK |\n| 0 | 0000:01:00.0 |\n";
        assert!(matches!(
            parse_npu_info(text),
            Err(AscendParseError::BadRow { .. })
        ));
        // A row that is neither.
        let text = "| NPU Name | Health |\n| Chip | Bus-Id |\n| hello | world |\n";
        assert!(matches!(
            parse_npu_info(text),
            Err(AscendParseError::BadRow { .. })
        ));
        // An unknown second header.
        let text = "| NPU Name | Health |\n| Slot | Bus-Id |\n";
        assert!(matches!(
            parse_npu_info(text),
            Err(AscendParseError::BadHeader { .. })
        ));
    }

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
    fn health_ok() {
        assert_eq!(
            parse_chip_health(HEALTH_OK).unwrap(),
            ChipHealth {
                health: NpuHealth::Ok,
                error_codes: vec![],
                error_info: String::new(),
            }
        );
    }

    #[test]
    fn health_with_two_codes_and_continuation_lines() {
        let got = parse_chip_health(HEALTH_ERROR).unwrap();
        assert_eq!(got.health, NpuHealth::Alarm);
        assert_eq!(got.error_codes, vec![0x80E0_1801, 0x80C9_8008]);
        assert_eq!(
            got.error_info,
            "node type=HBM, sensor type=Memory, event state=uncorrectable ECC error reported; \
             node type=AICORE, sensor type=General Purpose, event state=AI Core task timeout; \
             node type=SOC, sensor type=Temperature, event state=over temperature minor alarm"
        );
        assert_eq!(
            parse_chip_health(&HEALTH_ERROR.replace('\n', "\r\n")).unwrap(),
            got
        );
    }

    #[test]
    fn health_code_forms() {
        let text = "Health Status : critical\nError Code : 0x80e01801,0X1 NA\n";
        let got = parse_chip_health(text).unwrap();
        assert_eq!(got.health, NpuHealth::Critical);
        assert_eq!(got.error_codes, vec![0x80E0_1801, 1]);
        assert_eq!(got.error_info, "");
        // Codes continued on a `:` line.
        let text = "Health Status : Alarm\nError Code : 80E01801\n      : 81078603\nError Information : NA\n";
        assert_eq!(
            parse_chip_health(text).unwrap().error_codes,
            vec![0x80E0_1801, 0x8107_8603]
        );
    }

    #[test]
    fn health_errors() {
        assert_eq!(
            parse_chip_health(HEALTH_INVALID),
            Err(AscendParseError::InvalidId {
                what: "card",
                line: "Invalid card id.".into()
            })
        );
        assert!(matches!(
            parse_chip_health("Invalid chip id.\n"),
            Err(AscendParseError::InvalidId { what: "chip", .. })
        ));
        assert_eq!(
            parse_chip_health("").unwrap_err().to_string(),
            "npu-smi health: no `Health Status` line (output begins \"\")"
        );
        assert!(matches!(
            parse_chip_health("\tHealth Status : OK\n"),
            Err(AscendParseError::MissingLine {
                key: "Error Code",
                ..
            })
        ));
        assert!(matches!(
            parse_chip_health("Health Status :\nError Code : NA\n"),
            Err(AscendParseError::BadValue {
                key: "Health Status",
                ..
            })
        ));
        assert!(matches!(
            parse_chip_health("Health Status : OK\nError Code :\n"),
            Err(AscendParseError::BadValue {
                key: "Error Code",
                ..
            })
        ));
        assert_eq!(
            parse_chip_health("Health Status : Alarm\nError Code : 80E01801 XYZ\n"),
            Err(AscendParseError::BadErrorCode { code: "XYZ".into() })
        );
        assert_eq!(
            AscendParseError::BadErrorCode { code: "XYZ".into() }.to_string(),
            "unparseable error code \"XYZ\""
        );
        assert!(matches!(
            parse_chip_health("Health Status : Alarm\nError Code : 180E01801\n"),
            Err(AscendParseError::BadErrorCode { .. })
        ));
        assert!(matches!(
            parse_chip_health("Health Status : Alarm\nError Code : +1\n"),
            Err(AscendParseError::BadErrorCode { .. })
        ));
    }

    #[test]
    fn hccn_link() {
        assert_eq!(parse_link_status(LINK_UP), Ok(LinkStatus::Up));
        assert_eq!(parse_link_status(LINK_DOWN), Ok(LinkStatus::Down));
        assert_eq!(
            parse_link_status("[devid 3]link status: up\r\n"),
            Ok(LinkStatus::Up)
        );
        assert_eq!(
            parse_link_status("").unwrap_err().to_string(),
            "hccn_tool link: no `link status` line (output begins \"\")"
        );
        assert!(matches!(
            parse_link_status("link status: FLAPPING\n"),
            Err(AscendParseError::BadValue { .. })
        ));
        assert!(matches!(
            parse_link_status("Get link status failed, ret = -1\n"),
            Err(AscendParseError::MissingLine { .. })
        ));
    }

    #[test]
    fn hccn_speed() {
        assert_eq!(parse_speed_mbps(SPEED), Ok(200_000));
        assert_eq!(parse_speed_mbps("Speed: 100000 Mb/s\n"), Ok(100_000));
        assert_eq!(
            parse_speed_mbps("[device 1] speed : 25000 mbps\n"),
            Ok(25_000)
        );
        for bad in [
            "Speed: Unknown!\n",
            "Speed: 100 Gb/s\n",
            "Speed: -1 Mb/s\n",
            "Speed: 1 2 Mb/s\n",
            "Speed:\n",
            "Speed: 99999999999999999999999 Mb/s\n",
        ] {
            assert!(
                matches!(
                    parse_speed_mbps(bad),
                    Err(AscendParseError::BadValue { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse_speed_mbps("link status: UP\n"),
            Err(AscendParseError::MissingLine { .. })
        ));
    }

    #[test]
    fn hccn_link_stat() {
        assert_eq!(parse_link_up_count(LINK_STAT), Ok(3));
        assert_eq!(
            parse_link_up_count("[device 7]link up count : 12\n"),
            Ok(12)
        );
        assert_eq!(parse_link_up_count("link up count: 0"), Ok(0));
        assert!(matches!(
            parse_link_up_count("[devid 0]link up count : many\n"),
            Err(AscendParseError::BadValue { .. })
        ));
        // The down count and the records are not the up count.
        assert!(matches!(
            parse_link_up_count("[devid 0]link down count : 1\n"),
            Err(AscendParseError::MissingLine { .. })
        ));
    }

    #[test]
    fn hccn_net_health() {
        assert_eq!(
            parse_net_health(NET_OK),
            Ok(NetHealth {
                state: "Success".into(),
                healthy: true
            })
        );
        assert_eq!(
            parse_net_health(NET_FAULT),
            Ok(NetHealth {
                state: "Fault".into(),
                healthy: false
            })
        );
        for (s, healthy) in [
            ("Init", true),
            ("init", true),
            ("Socket failed", false),
            ("Receive timeout", false),
            ("Unreachable", false),
            ("Detect ip set", false),
        ] {
            let got = parse_net_health(&format!("net health status: {s}\n")).unwrap();
            assert_eq!((got.state.as_str(), got.healthy), (s, healthy));
        }
        assert!(matches!(
            parse_net_health("net health status:\n"),
            Err(AscendParseError::BadValue { .. })
        ));
        assert!(matches!(
            parse_net_health("garbage"),
            Err(AscendParseError::MissingLine { .. })
        ));
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
