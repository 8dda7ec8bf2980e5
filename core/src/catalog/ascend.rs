//! Ascend fault codes in MindCluster's own file formats, so an operator's files work unchanged.
//!
//! - `faultCode.json`: one list of hex codes per handling level, for chip codes
//!   (`SeparateNPUCodes`) and for network codes (`PreSeparateNPUNetworkCodes`). A key is
//!   `<Level>Codes` or `<Level>NetworkCodes` where `<Level>` is a handling level; other keys are
//!   reported back as ignored (newer MindCluster releases add keys this agent does not use).
//!   A code listed under several levels gets the most severe one. A network code
//!   ([`NETWORK_CODES`]) listed under a chip key is moved to the network table as the device
//!   plugin does: at the same level, or `NotHandleFault` from the restart levels (a port cannot
//!   be restarted).
//! - `faultCustomization.json`, as MindCluster ships it: `FaultFrequency` rules (a code seen
//!   `Times` times within `TimeWindow` seconds raises the chip to `FaultHandling`) and
//!   `FaultDuration` rules (a code lasting `FaultTimeout` seconds raises it to `FaultHandling`;
//!   it counts as recovered only after being gone for `RecoverTimeout` seconds). Both become the
//!   policy's escalation rules. A rule the device plugin would skip (a value out of its range, a
//!   code an earlier rule of the same kind already has) is skipped here too, with a note saying
//!   why; keys this agent does not use (`GraceTolerance`, `ReleaseTimeWindow`, keys of later
//!   releases) are read and noted, never a reason to refuse the file.
//!
//! Codes the tables do not list: a chip code is `SeparateNPU` when the chip's health is worse
//! than a minor alarm, else `NotHandleFault`; a network code is `PreSeparateNPU`.
//! Pure: text in, tables out; the policy loader reads the files.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::record::Handling;
use crate::rules::EscalationRule;

/// The device kind of Ascend training chips (910, 910B, 910A3) in records, as MindCluster's device
/// plugin names them, and the default for a chip whose model name says nothing else.
pub const KIND: &str = "Ascend910";
/// Every family MindCluster names: the device plugin's run modes (`GetDeviceRunMode`).
pub const FAMILIES: [&str; 3] = ["Ascend910", "Ascend310P", "Ascend310"];

/// The family of a chip from the model name npu-smi shows (`910B3`, `310P3`, `310B1`,
/// `Ascend910_9392`), as MindCluster's device plugin names its run modes: 310P cards are
/// `Ascend310P`, 310 and 310B `Ascend310`, and 910, 910B and 910A3 `Ascend910`.
pub fn family_of(model: &str) -> &'static str {
    let m = model.trim().to_ascii_uppercase();
    let m = m.strip_prefix("ASCEND").unwrap_or(&m);
    if m.starts_with("310P") {
        "Ascend310P"
    } else if m.starts_with("310") {
        "Ascend310"
    } else {
        KIND
    }
}
/// The code MindCluster uses for a network port that is down.
pub const LINK_DOWN_CODE: &str = "81078603";

/// The codes MindCluster treats as network faults wherever they are reported or listed (the
/// device plugin's `NetworkFaultCodes`: link down, UBoE port down, and two 9-digit codes).
pub const NETWORK_CODES: [&str; 4] = ["81078603", "81078607", "110000002", "110001024"];

/// Whether a code (normalized) is one of MindCluster's network fault codes.
pub fn is_network_code(code: &str) -> bool {
    NETWORK_CODES.contains(&code)
}

/// Whether `code` has the form of a MindCluster fault code (eight hex digits), as opposed to
/// one of faultline's named conditions.
pub fn is_fault_code(code: &str) -> bool {
    code.len() == 8 && code.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The built-in `faultCode.json`: the table MindCluster's device plugin ships in release
/// v26.1.0 (`component/ascend-device-plugin/build/faultCode.json`), codes upper-cased and each
/// listed once per level (docs/catalog.md, "Ascend codes").
pub const BUILTIN_FAULT_CODES: &str = include_str!("../../catalog/ascend-faultCode.json");
/// The built-in `faultCustomization.json`.
pub const BUILTIN_CUSTOMIZATION: &str =
    include_str!("../../catalog/ascend-faultCustomization.json");

/// A rejected Ascend table file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {what}")]
pub struct AscendFileError {
    pub file: String,
    pub what: String,
}

/// An Ascend code in record form: upper-case hex without `0x` (`80E01801`). Real tables hold a
/// few codes longer than 8 digits, so up to 16 are accepted.
pub fn normalize_code(s: &str) -> Option<String> {
    let t = s.trim();
    let t = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if t.is_empty() || t.len() > 16 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(t.to_ascii_uppercase())
}

/// The level of a code no table lists.
pub fn unknown_handling(network: bool, severe: bool) -> Handling {
    match (network, severe) {
        (true, _) => Handling::PreSeparateNPU,
        (false, true) => Handling::SeparateNPU,
        (false, false) => Handling::NotHandleFault,
    }
}

/// A parsed `faultCode.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AscendTable {
    chip: HashMap<String, Handling>,
    network: HashMap<String, Handling>,
    /// Keys present in the file that name no handling level.
    pub ignored_keys: Vec<String>,
    /// Network codes found under chip keys and where they went, one line each.
    pub moved: Vec<String>,
}

impl AscendTable {
    /// Parses a `faultCode.json` document; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<AscendTable, AscendFileError> {
        let err = |what: String| AscendFileError {
            file: file.to_string(),
            what,
        };
        let doc: BTreeMap<String, Value> =
            serde_json::from_str(text).map_err(|e| err(format!("not a JSON object: {e}")))?;
        let mut table = AscendTable::default();
        for (key, value) in doc {
            let Some((level, network)) = level_of_key(&key) else {
                table.ignored_keys.push(key);
                continue;
            };
            let Value::Array(items) = value else {
                return Err(err(format!("{key}: must be a list of hex codes")));
            };
            for (i, item) in items.iter().enumerate() {
                let code = item
                    .as_str()
                    .and_then(normalize_code)
                    .ok_or_else(|| err(format!("{key}[{i}]: {item} is not a hex fault code")))?;
                let (map, level) = if network {
                    (&mut table.network, level)
                } else if is_network_code(&code) {
                    let to = network_level_of_chip_key(level);
                    table.moved.push(format!(
                        "{key}: {code} is a network code, read as network {to}"
                    ));
                    (&mut table.network, to)
                } else {
                    (&mut table.chip, level)
                };
                let e = map.entry(code).or_insert(level);
                *e = (*e).max(level);
            }
        }
        Ok(table)
    }

    /// The level the table gives a code (already normalized), if it lists it.
    pub fn lookup(&self, code: &str, network: bool) -> Option<Handling> {
        if network {
            self.network.get(code).copied()
        } else {
            self.chip.get(code).copied()
        }
    }

    /// Chip and network codes listed.
    pub fn len(&self) -> (usize, usize) {
        (self.chip.len(), self.network.len())
    }

    pub fn is_empty(&self) -> bool {
        self.chip.is_empty() && self.network.is_empty()
    }
}

/// Where the device plugin files a network code listed under a chip key: the same level, but
/// the restart levels (a chip's remedies) become `NotHandleFault`.
fn network_level_of_chip_key(level: Handling) -> Handling {
    match level {
        Handling::RestartRequest
        | Handling::RestartBusiness
        | Handling::FreeRestartNPU
        | Handling::RestartNPU => Handling::NotHandleFault,
        other => other,
    }
}

/// `SeparateNPUCodes` -> (SeparateNPU, chip); `PreSeparateNPUNetworkCodes` -> (PreSeparateNPU,
/// network).
fn level_of_key(key: &str) -> Option<(Handling, bool)> {
    let (stem, network) = match key.strip_suffix("NetworkCodes") {
        Some(s) => (s, true),
        None => (key.strip_suffix("Codes")?, false),
    };
    Handling::ALL
        .into_iter()
        .find(|h| h.as_str() == stem)
        .map(|h| (h, network))
}

/// `faultCustomization.json` as the device plugin reads it (`FaultCustomization` in its
/// `fault_code.go`): Go's decoder ignores keys it does not know, so later releases can add keys;
/// here they are kept in `other` and noted.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct CustomizationFile {
    #[serde(default, deserialize_with = "null_is_zero")]
    fault_frequency: Vec<FrequencyRule>,
    #[serde(default, deserialize_with = "null_is_zero")]
    fault_duration: Vec<DurationRule>,
    /// MindCluster's reset timing (`WaitProcessReadCMTime`, `WaitDeviceResetTime`,
    /// `WaitFaultSelfHealingTime`; older files `WaitFlushingCMTime`): the device plugin's, for
    /// the chip resets it performs. This agent resets nothing, so it reads and notes them.
    #[serde(default)]
    grace_tolerance: Option<BTreeMap<String, Value>>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

/// A missing or null field is Go's zero value, as the device plugin decodes it: the range
/// checks then skip the rule, never the whole file.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct FrequencyRule {
    #[serde(default)]
    event_id: Option<Vec<String>>,
    #[serde(default, deserialize_with = "null_is_zero")]
    time_window: i64,
    #[serde(default, deserialize_with = "null_is_zero")]
    times: i64,
    /// `FaultLevel` was this agent's own name for it before it read MindCluster's files as
    /// shipped; both are accepted.
    #[serde(default, alias = "FaultLevel", deserialize_with = "null_is_zero")]
    fault_handling: String,
    /// How long after recovery the device plugin lifts the escalation; required (and not 0,
    /// which it reads as "never", then as missing) when the level is not
    /// `ManuallySeparateNPU`. Validated; see docs/ascend.md for what this agent does instead.
    #[serde(default)]
    release_time_window: Option<i64>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DurationRule {
    #[serde(default)]
    event_id: Option<Vec<String>>,
    #[serde(default, deserialize_with = "null_is_zero")]
    fault_timeout: i64,
    #[serde(default, deserialize_with = "null_is_zero")]
    recover_timeout: i64,
    #[serde(default, alias = "FaultLevel", deserialize_with = "null_is_zero")]
    fault_handling: String,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

/// A value, or Go's zero value for `null` (as `encoding/json` leaves a field it reads `null`
/// into).
fn null_is_zero<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// The device plugin's ranges for `faultCustomization.json` (its `constants.go`), seconds.
const TIME_WINDOW: (i64, i64) = (60, 864_000);
const TIMES: (i64, i64) = (1, 100);
const FAULT_TIMEOUT: (i64, i64) = (0, 600);
/// 600 in current releases; 86,400 in older ones, whose files stay valid here.
const RECOVER_TIMEOUT: (i64, i64) = (0, 86_400);

/// A parsed `faultCustomization.json`: the escalation rules, and one note per thing read but not
/// applied (a skipped rule and why, an unused key).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Customization {
    pub rules: Vec<EscalationRule>,
    pub notes: Vec<String>,
}

/// Parses a `faultCustomization.json` document into escalation rules named
/// `<file>:FaultFrequency[i]` / `<file>:FaultDuration[i]`. Only a document that is not the
/// file's shape (not JSON, a value of the wrong type, a rule without its required keys) is an
/// error; a rule the device plugin would skip is skipped with a note.
pub fn parse_customization(file: &str, text: &str) -> Result<Customization, AscendFileError> {
    let doc: CustomizationFile = serde_json::from_str(text).map_err(|e| AscendFileError {
        file: file.to_string(),
        what: e.to_string(),
    })?;
    let mut out = Customization::default();
    let unused = |at: &str, other: &BTreeMap<String, Value>, notes: &mut Vec<String>| {
        for k in other.keys() {
            notes.push(format!("{at}{k}: not a key this agent knows; ignored"));
        }
    };
    unused("", &doc.other, &mut out.notes);
    if let Some(g) = &doc.grace_tolerance {
        if !g.is_empty() {
            let keys: Vec<&str> = g.keys().map(String::as_str).collect();
            out.notes.push(format!(
                "GraceTolerance ({}): the device plugin's reset timing; this agent resets no chip",
                keys.join(", ")
            ));
        }
    }
    let mut seen_frequency: Vec<String> = Vec::new();
    for (i, r) in doc.fault_frequency.iter().enumerate() {
        let at = format!("FaultFrequency[{i}]");
        unused(&format!("{at}."), &r.other, &mut out.notes);
        let checked = (|| {
            let handling = level_named(&r.fault_handling)?;
            in_range("TimeWindow", r.time_window, TIME_WINDOW)?;
            in_range("Times", r.times, TIMES)?;
            // 0 means "never release" to the device plugin, which then treats the rule as one
            // without a release window.
            match r.release_time_window {
                None | Some(0) if handling != Handling::ManuallySeparateNPU => {
                    return Err(format!(
                        "ReleaseTimeWindow: required (and not 0) for {handling} (only ManuallySeparateNPU may omit it)"
                    ))
                }
                Some(w) if w < 0 => {
                    return Err(format!("ReleaseTimeWindow: {w} is negative"));
                }
                _ => {}
            }
            Ok(handling)
        })();
        let Some(handling) = skip_or(&at, checked, &mut out.notes) else {
            continue;
        };
        let ids = r.event_id.as_deref().unwrap_or_default();
        let Some(codes) = rule_codes(&at, ids, &mut seen_frequency, &mut out.notes) else {
            continue;
        };
        if r.release_time_window.is_some() {
            out.notes.push(format!(
                "{at}.ReleaseTimeWindow: read, not applied: here an escalated fault ends when the \
                 fault does, and ManuallySeparateNPU stays until an operator clears it"
            ));
        }
        out.rules.push(EscalationRule {
            name: Some(format!("{file}:{at}")),
            codes,
            count: u32::try_from(r.times).ok(),
            window: Some(Duration::from_secs(r.time_window.unsigned_abs())),
            duration: None,
            recover_after: None,
            handling,
        });
    }
    let mut seen_duration: Vec<String> = Vec::new();
    for (i, r) in doc.fault_duration.iter().enumerate() {
        let at = format!("FaultDuration[{i}]");
        unused(&format!("{at}."), &r.other, &mut out.notes);
        let checked = (|| {
            let handling = level_named(&r.fault_handling)?;
            if handling == Handling::ManuallySeparateNPU {
                return Err(
                    "FaultHandling: ManuallySeparateNPU is for frequency rules only".into(),
                );
            }
            in_range("FaultTimeout", r.fault_timeout, FAULT_TIMEOUT)?;
            in_range("RecoverTimeout", r.recover_timeout, RECOVER_TIMEOUT)?;
            Ok(handling)
        })();
        let Some(handling) = skip_or(&at, checked, &mut out.notes) else {
            continue;
        };
        let ids = r.event_id.as_deref().unwrap_or_default();
        let Some(codes) = rule_codes(&at, ids, &mut seen_duration, &mut out.notes) else {
            continue;
        };
        out.rules.push(EscalationRule {
            name: Some(format!("{file}:{at}")),
            codes,
            count: None,
            window: None,
            duration: Some(Duration::from_secs(r.fault_timeout.unsigned_abs())),
            recover_after: (r.recover_timeout > 0)
                .then(|| Duration::from_secs(r.recover_timeout.unsigned_abs())),
            handling,
        });
    }
    Ok(out)
}

fn level_named(s: &str) -> Result<Handling, String> {
    Handling::ALL
        .into_iter()
        .find(|h| h.as_str() == s)
        .ok_or_else(|| format!("FaultHandling: {s:?} is not a handling level"))
}

fn in_range(key: &str, v: i64, (lo, hi): (i64, i64)) -> Result<(), String> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(format!("{key}: {v} is outside {lo}..={hi}"))
    }
}

/// The checked value, or a note that the rule is skipped and why.
fn skip_or<T>(at: &str, checked: Result<T, String>, notes: &mut Vec<String>) -> Option<T> {
    checked
        .map_err(|why| notes.push(format!("{at} skipped: {why}")))
        .ok()
}

/// A rule's codes, normalized; a code an earlier rule of the same kind has is dropped (the
/// device plugin keeps the first), and a rule left with none is skipped.
fn rule_codes(
    at: &str,
    ids: &[String],
    seen: &mut Vec<String>,
    notes: &mut Vec<String>,
) -> Option<Vec<String>> {
    let mut codes = Vec::new();
    for c in ids {
        match normalize_code(c) {
            None => notes.push(format!(
                "{at}.EventId: {c:?} is not a hex fault code; ignored"
            )),
            Some(n) if seen.contains(&n) => notes.push(format!(
                "{at}.EventId: {n} is in an earlier rule of this kind; that one applies"
            )),
            Some(n) => {
                seen.push(n.clone());
                codes.push(n);
            }
        }
    }
    if codes.is_empty() {
        notes.push(format!("{at} skipped: EventId lists no usable code"));
        return None;
    }
    Some(codes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_files_parse() {
        let t = AscendTable::parse("builtin", BUILTIN_FAULT_CODES).unwrap();
        assert!(t.ignored_keys.is_empty(), "{:?}", t.ignored_keys);
        assert_eq!(t.lookup("80E01801", false), Some(Handling::RestartBusiness));
        assert_eq!(t.lookup("81078603", true), Some(Handling::NotHandleFault));
        assert_eq!(t.lookup("81078603", false), None);
        // The built-in faultCustomization.json is MindCluster's as shipped.
        let c = parse_customization("builtin", BUILTIN_CUSTOMIZATION).unwrap();
        let rules = c.rules;
        assert_eq!(rules.len(), 4);
        assert_eq!(rules[0].codes.len(), 41);
        assert!(rules[0].codes.contains(&"80E01801".to_string()));
        assert_eq!(
            (rules[0].count, rules[0].window, rules[0].handling),
            (
                Some(2),
                Some(Duration::from_secs(86_400)),
                Handling::ManuallySeparateNPU
            )
        );
        assert_eq!(
            (rules[1].codes.as_slice(), rules[1].count),
            (&["80E18005".to_string()][..], Some(3))
        );
        assert_eq!(
            (rules[2].codes.as_slice(), rules[2].count),
            (&["81078603".to_string()][..], Some(5))
        );
        assert_eq!(rules[3].codes, ["81078603"]);
        assert_eq!(rules[3].duration, Some(Duration::from_secs(20)));
        assert_eq!(rules[3].recover_after, Some(Duration::from_secs(60)));
        assert_eq!(rules[3].handling, Handling::PreSeparateNPU);
    }

    /// The built-in table holds MindCluster v26.1.0's levels: its size per level, and the codes
    /// whose level changed across releases (816F8002 was SeparateNPU up to v7.3.2).
    #[test]
    fn builtin_table_is_mindcluster_v26_1_0() {
        let t = AscendTable::parse("builtin", BUILTIN_FAULT_CODES).unwrap();
        // 803 entries: A2301001 (RestartBusiness and SeparateNPU) counts once, and four network
        // codes listed under chip keys are network codes.
        assert_eq!(t.len(), (798, 4));
        for (code, level) in [
            ("816F8002", Handling::RestartNPU),
            ("81A3880C", Handling::SubHealthFault),
            ("80F38009", Handling::NotHandleFault),
            ("814D800A", Handling::RestartNPU),
            ("80CB8000", Handling::RestartRequest),
            ("A2301001", Handling::SeparateNPU),
        ] {
            assert_eq!(t.lookup(code, false), Some(level), "{code}");
        }
        for (code, level) in [
            ("81078603", Handling::NotHandleFault),
            ("81078607", Handling::NotHandleFault),
            ("110000002", Handling::SubHealthFault),
            ("110001024", Handling::PreSeparateNPU),
        ] {
            assert_eq!(t.lookup(code, true), Some(level), "{code}");
        }
    }

    #[test]
    fn keys_levels_and_normal_form() {
        let t = AscendTable::parse(
            "f",
            r#"{"SeparateNPUCodes": ["0x80e3a201", "80E18402"],
                "RestartNPUCodes": ["80e3a201"],
                "PreSeparateNPUNetworkCodes": ["81078603"],
                "SubHealthFaultCodes": ["110001023"],
                "ResetFaultCodes": ["1"]}"#,
        )
        .unwrap();
        // Listed twice: the most severe level wins, whatever the order in the file.
        assert_eq!(t.lookup("80E3A201", false), Some(Handling::SeparateNPU));
        assert_eq!(t.lookup("81078603", true), Some(Handling::PreSeparateNPU));
        assert_eq!(t.lookup("110001023", false), Some(Handling::SubHealthFault));
        assert_eq!(t.ignored_keys, ["ResetFaultCodes"]);
        assert_eq!(t.len(), (3, 1));
        assert!(t.moved.is_empty());
    }

    /// A network code listed under a chip key is a network fault at that level, or at
    /// NotHandleFault from a restart level, as the device plugin reads a real faultCode.json
    /// (which lists 81078603 under NotHandleFaultCodes).
    #[test]
    fn network_codes_under_chip_keys_are_network_codes() {
        let t = AscendTable::parse(
            "f",
            r#"{"NotHandleFaultCodes": ["81078603", "80E01801"],
                "RestartBusinessCodes": ["81078607"],
                "SeparateNPUCodes": ["110000002"],
                "SubHealthFaultCodes": ["110001024"]}"#,
        )
        .unwrap();
        assert_eq!(t.lookup("81078603", true), Some(Handling::NotHandleFault));
        assert_eq!(t.lookup("81078603", false), None);
        assert_eq!(t.lookup("81078607", true), Some(Handling::NotHandleFault));
        assert_eq!(t.lookup("110000002", true), Some(Handling::SeparateNPU));
        assert_eq!(t.lookup("110001024", true), Some(Handling::SubHealthFault));
        assert_eq!(t.lookup("80E01801", false), Some(Handling::NotHandleFault));
        assert_eq!(t.len(), (1, 4));
        assert_eq!(t.moved.len(), 4);
        assert!(
            t.moved[..].iter().any(|m| m
                == "RestartBusinessCodes: 81078607 is a network code, read as network NotHandleFault"),
            "{:?}",
            t.moved
        );
        assert!(is_network_code("81078603") && !is_network_code("80E01801"));
    }

    #[test]
    fn bad_tables_are_clear_errors() {
        let cases = [
            ("[]", "not a JSON object"),
            ("{", "not a JSON object"),
            (
                r#"{"SeparateNPUCodes": "80E3A201"}"#,
                "SeparateNPUCodes: must be a list",
            ),
            (
                r#"{"SeparateNPUCodes": ["80E3A2G1"]}"#,
                "SeparateNPUCodes[0]",
            ),
            (
                r#"{"SeparateNPUCodes": [7]}"#,
                "SeparateNPUCodes[0]: 7 is not",
            ),
            (r#"{"SeparateNPUCodes": [""]}"#, "is not a hex fault code"),
        ];
        for (text, want) in cases {
            let e = AscendTable::parse("codes.json", text).unwrap_err();
            assert_eq!(e.file, "codes.json");
            assert!(e.to_string().contains(want), "{text}: {e}");
        }
    }

    /// Files as MindCluster ships them parse, every key accepted: the current one (the built-in
    /// copy, above), an older one (`WaitFlushingCMTime`, no ReleaseTimeWindow rule), and one with
    /// keys of a later release; what is read but not applied is noted.
    #[test]
    fn customization_files_as_shipped() {
        let older = r#"{"GraceTolerance": {"WaitFlushingCMTime": 90, "WaitDeviceResetTime": 120},
            "FaultFrequency": [
              {"EventId": ["80C98000", "80E01801"], "TimeWindow": 86400, "Times": 2,
               "FaultHandling": "ManuallySeparateNPU"},
              {"EventId": ["80E18005"], "TimeWindow": 86400, "Times": 3,
               "FaultHandling": "ManuallySeparateNPU"}],
            "FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 30, "RecoverTimeout": 60,
                               "FaultHandling": "PreSeparateNPU"}]}"#;
        let c = parse_customization("older.json", older).unwrap();
        assert_eq!(c.rules.len(), 3);
        assert_eq!(
            c.rules[0].name.as_deref(),
            Some("older.json:FaultFrequency[0]")
        );
        assert_eq!(c.rules[0].codes, ["80C98000", "80E01801"]);
        assert_eq!(c.rules[2].duration, Some(Duration::from_secs(30)));
        assert_eq!(
            c.notes,
            ["GraceTolerance (WaitDeviceResetTime, WaitFlushingCMTime): the device plugin's reset \
              timing; this agent resets no chip"]
        );

        let later = r#"{"FaultFrequency": [{"EventId": ["80e01801"], "TimeWindow": 3600,
              "Times": 2, "FaultHandling": "RestartNPU", "ReleaseTimeWindow": 600,
              "Scope": "chip"}],
            "FaultDuration": [{"EventId": ["0x81078603"], "FaultTimeout": 0,
              "RecoverTimeout": 0, "FaultHandling": "SeparateNPU"}],
            "FaultUpgrade": {"Enable": true}}"#;
        let c = parse_customization("later.json", later).unwrap();
        assert_eq!(c.rules.len(), 2);
        assert_eq!(c.rules[0].codes, ["80E01801"]);
        assert_eq!(c.rules[0].handling, Handling::RestartNPU);
        assert_eq!(
            c.rules[1].duration,
            Some(Duration::ZERO),
            "FaultTimeout 0 is valid there"
        );
        assert_eq!(c.rules[1].recover_after, None);
        for want in [
            "FaultUpgrade: not a key this agent knows; ignored",
            "FaultFrequency[0].Scope: not a key this agent knows; ignored",
            "FaultFrequency[0].ReleaseTimeWindow: read, not applied",
        ] {
            assert!(
                c.notes.iter().any(|n| n.starts_with(want)),
                "{want}: {:?}",
                c.notes
            );
        }
        // This agent's own earlier key name still reads.
        let own = r#"{"FaultFrequency": [{"EventId": ["80E01801"], "TimeWindow": 86400,
            "Times": 2, "FaultLevel": "ManuallySeparateNPU"}]}"#;
        let c = parse_customization("own.json", own).unwrap();
        assert_eq!(c.rules[0].handling, Handling::ManuallySeparateNPU);
        assert!(
            c.notes.is_empty(),
            "the alias is no unknown key: {:?}",
            c.notes
        );
    }

    /// A rule the device plugin skips is skipped with a note saying why, and the rest of the
    /// file applies; only a document that is not the file's shape is an error.
    #[test]
    fn customization_rules_skipped_as_the_device_plugin_skips_them() {
        let rule = |json: &str| {
            format!(
                r#"{{"FaultFrequency": [{json}, {{"EventId": ["80E18005"], "TimeWindow": 86400, "Times": 3, "FaultHandling": "ManuallySeparateNPU"}}]}}"#
            )
        };
        let m = r#""FaultHandling": "ManuallySeparateNPU""#;
        let cases = [
            (format!(r#"{{"EventId": [], "TimeWindow": 86400, "Times": 2, {m}}}"#), "FaultFrequency[0] skipped: EventId lists no usable code"),
            (format!(r#"{{"EventId": ["1"], "TimeWindow": 59, "Times": 2, {m}}}"#), "FaultFrequency[0] skipped: TimeWindow: 59 is outside 60..=864000"),
            (format!(r#"{{"EventId": ["1"], "TimeWindow": 60, "Times": 101, {m}}}"#), "FaultFrequency[0] skipped: Times: 101 is outside 1..=100"),
            (format!(r#"{{"EventId": ["1"], "TimeWindow": 60, "Times": 0, {m}}}"#), "FaultFrequency[0] skipped: Times: 0 is outside"),
            (r#"{"EventId": ["1"], "TimeWindow": 60, "Times": 2, "FaultHandling": "Reboot"}"#.to_string(), "FaultFrequency[0] skipped: FaultHandling: \"Reboot\" is not a handling level"),
            (r#"{"EventId": ["1"], "TimeWindow": 60, "Times": 2, "FaultHandling": "RestartNPU"}"#.to_string(), "FaultFrequency[0] skipped: ReleaseTimeWindow: required (and not 0) for RestartNPU"),
            (r#"{"EventId": ["1"], "TimeWindow": 60, "Times": 2, "FaultHandling": "RestartNPU", "ReleaseTimeWindow": -1}"#.to_string(), "FaultFrequency[0] skipped: ReleaseTimeWindow: -1 is negative"),
            (format!(r#"{{"EventId": ["zz"], "TimeWindow": 60, "Times": 2, {m}}}"#), "FaultFrequency[0].EventId: \"zz\" is not a hex fault code; ignored"),
            // The second rule's code is already in the first: the first applies.
            (format!(r#"{{"EventId": ["80E18005"], "TimeWindow": 60, "Times": 2, {m}}}"#), "FaultFrequency[1].EventId: 80E18005 is in an earlier rule of this kind"),
        ];
        for (r, want) in cases {
            let c = parse_customization("c.json", &rule(&r)).unwrap();
            assert!(
                c.notes.iter().any(|n| n.starts_with(want)),
                "{r}: want {want:?} in {:?}",
                c.notes
            );
            // The valid rule still applies, unless the skipped one took its code first.
            assert!(c.rules.len() == 1, "{r}: {:?}", c.rules);
        }
        // A missing key is Go's zero value: the rule is skipped (or, where zero is in range,
        // applies), the file is not refused.
        let c = parse_customization(
            "c.json",
            r#"{"FaultFrequency": [{"EventId": ["1"], "Times": 2, "FaultHandling": "ManuallySeparateNPU"},
                                  {"EventId": null, "TimeWindow": 60, "Times": 2, "FaultHandling": "ManuallySeparateNPU"},
                                  {"EventId": ["2"], "TimeWindow": 60, "Times": 2, "FaultHandling": "RestartNPU", "ReleaseTimeWindow": 0}],
                "FaultDuration": [{"EventId": ["3"], "FaultTimeout": 3, "FaultHandling": "SeparateNPU"},
                                 {"EventId": ["4"], "FaultTimeout": 3},
                                 {"EventId": ["5"], "FaultTimeout": null, "RecoverTimeout": null, "FaultHandling": null}]}"#,
        )
        .unwrap();
        assert_eq!(c.rules.len(), 1, "{:?}", c.notes);
        assert_eq!(
            (c.rules[0].codes.as_slice(), c.rules[0].recover_after),
            (&["3".to_string()][..], None)
        );
        for want in [
            "FaultFrequency[0] skipped: TimeWindow: 0 is outside",
            "FaultFrequency[1] skipped: EventId lists no usable code",
            "FaultFrequency[2] skipped: ReleaseTimeWindow: required (and not 0)",
            "FaultDuration[1] skipped: FaultHandling: \"\" is not a handling level",
            "FaultDuration[2] skipped: FaultHandling: \"\" is not a handling level",
        ] {
            assert!(
                c.notes.iter().any(|n| n.starts_with(want)),
                "{want}: {:?}",
                c.notes
            );
        }
        let d = |json: &str| format!(r#"{{"FaultDuration": [{json}]}}"#);
        for (r, want) in [
            (r#"{"EventId": ["1"], "FaultTimeout": 601, "RecoverTimeout": 1, "FaultHandling": "SeparateNPU"}"#, "FaultDuration[0] skipped: FaultTimeout: 601 is outside 0..=600"),
            (r#"{"EventId": ["1"], "FaultTimeout": 1, "RecoverTimeout": -1, "FaultHandling": "SeparateNPU"}"#, "FaultDuration[0] skipped: RecoverTimeout: -1 is outside"),
            (r#"{"EventId": ["1"], "FaultTimeout": 1, "RecoverTimeout": 1, "FaultHandling": "ManuallySeparateNPU"}"#, "FaultDuration[0] skipped: FaultHandling: ManuallySeparateNPU is for frequency rules only"),
        ] {
            let c = parse_customization("c.json", &d(r)).unwrap();
            assert!(c.rules.is_empty(), "{r}");
            assert!(c.notes.iter().any(|n| n.starts_with(want)), "{r}: {:?}", c.notes);
        }
        // Not the file's shape: a clear error naming the file.
        for (text, want) in [
            ("[]", "invalid type"),
            ("{", "EOF"),
            (r#"{"FaultFrequency": {}}"#, "invalid type"),
            (
                r#"{"FaultFrequency": [{"EventId": ["1"], "TimeWindow": "60", "Times": 2, "FaultHandling": "SeparateNPU"}]}"#,
                "invalid type",
            ),
            (
                r#"{"FaultDuration": [{"EventId": ["1"], "FaultTimeout": "3"}]}"#,
                "invalid type",
            ),
        ] {
            let e = parse_customization("c.json", text).unwrap_err();
            assert_eq!(e.file, "c.json");
            assert!(e.to_string().contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn families_as_mindcluster_names_them() {
        for (model, family) in [
            ("910B3", "Ascend910"),
            ("910", "Ascend910"),
            ("Ascend910_9392", "Ascend910"),
            ("310P3", "Ascend310P"),
            (" 310p1 ", "Ascend310P"),
            ("310", "Ascend310"),
            ("310B1", "Ascend310"),
            ("", "Ascend910"),
        ] {
            assert_eq!(family_of(model), family, "{model:?}");
        }
        assert!(FAMILIES.contains(&family_of("310P3")));
    }

    #[test]
    fn unknown_codes_default_by_kind_and_severity() {
        assert_eq!(unknown_handling(true, false), Handling::PreSeparateNPU);
        assert_eq!(unknown_handling(false, true), Handling::SeparateNPU);
        assert_eq!(unknown_handling(false, false), Handling::NotHandleFault);
        assert_eq!(normalize_code(" 0x80e01801 ").as_deref(), Some("80E01801"));
        assert_eq!(normalize_code("0x"), None);
        assert_eq!(normalize_code("12345678901234567"), None);
    }
}
