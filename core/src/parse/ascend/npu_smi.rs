//! `npu-smi` output: the `npu-smi info` chip table and the per-chip health query
//! (`npu-smi info -t health -i <card> -c <chip>`).

use std::fmt;

use super::{
    bad_value, excerpt, first_line, key_value, missing, parse_u32, starts_with_ci,
    strip_dev_prefix, words_eq, AscendParseError,
};
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

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;

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
}
