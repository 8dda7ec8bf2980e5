//! Ascend fault codes in MindCluster's own file formats, so an operator's files work unchanged.
//!
//! - `faultCode.json`: one list of hex codes per handling level, for chip codes
//!   (`SeparateNPUCodes`) and for network codes (`PreSeparateNPUNetworkCodes`). A key is
//!   `<Level>Codes` or `<Level>NetworkCodes` where `<Level>` is a handling level; other keys are
//!   reported back as ignored (newer MindCluster releases add keys this agent does not use).
//!   A code listed under several levels gets the most severe one.
//! - `faultCustomization.json`: `FaultFrequency` rules (a code seen `Times` times within
//!   `TimeWindow` seconds raises the chip to `FaultLevel`) and `FaultDuration` rules (a code
//!   lasting `FaultTimeout` seconds raises it to `FaultLevel`; it counts as recovered only after
//!   being gone for `RecoverTimeout` seconds). Both become the policy's escalation rules.
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

/// The device kind of Ascend chips in records and in MindCluster's `DeviceInfoCfg`.
pub const KIND: &str = "Ascend910";
/// The code MindCluster uses for a network port that is down.
pub const LINK_DOWN_CODE: &str = "81078603";

/// Whether `code` has the form of a MindCluster fault code (eight hex digits), as opposed to
/// one of faultline's named conditions.
pub fn is_fault_code(code: &str) -> bool {
    code.len() == 8 && code.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The built-in `faultCode.json` (docs/catalog.md lists its sources).
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
                let map = if network {
                    &mut table.network
                } else {
                    &mut table.chip
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

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct CustomizationFile {
    #[serde(default)]
    fault_frequency: Vec<FrequencyRule>,
    #[serde(default)]
    fault_duration: Vec<DurationRule>,
    /// Known but not used by this agent (MindCluster's reset timing).
    #[serde(default)]
    #[allow(dead_code)]
    grace_tolerance: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
struct FrequencyRule {
    event_id: Vec<String>,
    time_window: u64,
    times: u32,
    fault_level: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
struct DurationRule {
    event_id: Vec<String>,
    fault_timeout: u64,
    recover_timeout: u64,
    fault_level: String,
}

/// Parses a `faultCustomization.json` document into escalation rules named
/// `<file>:FaultFrequency[i]` / `<file>:FaultDuration[i]`.
pub fn parse_customization(file: &str, text: &str) -> Result<Vec<EscalationRule>, AscendFileError> {
    let err = |what: String| AscendFileError {
        file: file.to_string(),
        what,
    };
    let doc: CustomizationFile = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
    let level = |at: &str, s: &str| {
        Handling::ALL
            .into_iter()
            .find(|h| h.as_str() == s)
            .ok_or_else(|| err(format!("{at}.FaultLevel: {s:?} is not a handling level")))
    };
    let codes = |at: &str, ids: &[String]| -> Result<Vec<String>, AscendFileError> {
        if ids.is_empty() {
            return Err(err(format!("{at}.EventId: must list at least one code")));
        }
        ids.iter()
            .map(|c| {
                normalize_code(c)
                    .ok_or_else(|| err(format!("{at}.EventId: {c:?} is not a hex fault code")))
            })
            .collect()
    };
    let mut rules = Vec::new();
    for (i, r) in doc.fault_frequency.iter().enumerate() {
        let at = format!("FaultFrequency[{i}]");
        if r.times == 0 {
            return Err(err(format!("{at}.Times: must be at least 1")));
        }
        if r.time_window == 0 {
            return Err(err(format!("{at}.TimeWindow: must be at least 1 second")));
        }
        rules.push(EscalationRule {
            name: Some(format!("{file}:{at}")),
            codes: codes(&at, &r.event_id)?,
            count: Some(r.times),
            window: Some(Duration::from_secs(r.time_window)),
            duration: None,
            recover_after: None,
            handling: level(&at, &r.fault_level)?,
        });
    }
    for (i, r) in doc.fault_duration.iter().enumerate() {
        let at = format!("FaultDuration[{i}]");
        if r.fault_timeout == 0 {
            return Err(err(format!("{at}.FaultTimeout: must be at least 1 second")));
        }
        rules.push(EscalationRule {
            name: Some(format!("{file}:{at}")),
            codes: codes(&at, &r.event_id)?,
            count: None,
            window: None,
            duration: Some(Duration::from_secs(r.fault_timeout)),
            recover_after: (r.recover_timeout > 0).then(|| Duration::from_secs(r.recover_timeout)),
            handling: level(&at, &r.fault_level)?,
        });
    }
    Ok(rules)
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
        let rules = parse_customization("builtin", BUILTIN_CUSTOMIZATION).unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].codes, ["81078603"]);
        assert_eq!(rules[0].duration, Some(Duration::from_secs(20)));
        assert_eq!(rules[0].recover_after, Some(Duration::from_secs(60)));
        assert_eq!(rules[0].handling, Handling::PreSeparateNPU);
    }

    #[test]
    fn keys_levels_and_normal_form() {
        let t = AscendTable::parse(
            "f",
            r#"{"SeparateNPUCodes": ["0x80e3a201", "80E18402"],
                "RestartNPUCodes": ["80e3a201"],
                "PreSeparateNPUNetworkCodes": ["81078603"],
                "SubHealthFaultCodes": ["110001024"],
                "ResetFaultCodes": ["1"]}"#,
        )
        .unwrap();
        // Listed twice: the most severe level wins, whatever the order in the file.
        assert_eq!(t.lookup("80E3A201", false), Some(Handling::SeparateNPU));
        assert_eq!(t.lookup("81078603", true), Some(Handling::PreSeparateNPU));
        assert_eq!(t.lookup("110001024", false), Some(Handling::SubHealthFault));
        assert_eq!(t.ignored_keys, ["ResetFaultCodes"]);
        assert_eq!(t.len(), (3, 1));
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

    #[test]
    fn customization_rules() {
        let rules = parse_customization(
            "c.json",
            r#"{"GraceTolerance": {"WaitDeviceResetTime": 150},
                "FaultFrequency": [{"EventId": ["80e01801"], "TimeWindow": 86400, "Times": 2,
                                    "FaultLevel": "ManuallySeparateNPU"}],
                "FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 20,
                                   "RecoverTimeout": 60, "FaultLevel": "PreSeparateNPU"}]}"#,
        )
        .unwrap();
        assert_eq!(rules.len(), 2);
        assert_eq!(rules[0].name.as_deref(), Some("c.json:FaultFrequency[0]"));
        assert_eq!(rules[0].codes, ["80E01801"]);
        assert_eq!(rules[0].count, Some(2));
        assert_eq!(rules[0].window, Some(Duration::from_secs(86400)));
        assert_eq!(rules[0].handling, Handling::ManuallySeparateNPU);
        assert_eq!(rules[1].recover_after, Some(Duration::from_secs(60)));
        let bad = [
            (
                r#"{"FaultFrequency": [{"EventId": [], "TimeWindow": 1, "Times": 1, "FaultLevel": "SeparateNPU"}]}"#,
                "EventId: must list",
            ),
            (
                r#"{"FaultFrequency": [{"EventId": ["1"], "TimeWindow": 1, "Times": 0, "FaultLevel": "SeparateNPU"}]}"#,
                "Times: must be",
            ),
            (
                r#"{"FaultFrequency": [{"EventId": ["1"], "TimeWindow": 1, "Times": 1, "FaultLevel": "Reboot"}]}"#,
                "\"Reboot\" is not a handling level",
            ),
            (
                r#"{"FaultDuration": [{"EventId": ["zz"], "FaultTimeout": 1, "RecoverTimeout": 1, "FaultLevel": "SeparateNPU"}]}"#,
                "\"zz\" is not a hex",
            ),
            (
                r#"{"FaultDuration": [{"EventId": ["1"], "FaultTimeout": 0, "RecoverTimeout": 1, "FaultLevel": "SeparateNPU"}]}"#,
                "FaultTimeout: must be",
            ),
            (
                r#"{"FaultDuration": [{"EventId": ["1"], "Timeout": 3}]}"#,
                "unknown field",
            ),
        ];
        for (text, want) in bad {
            let e = parse_customization("c.json", text).unwrap_err();
            assert!(e.to_string().contains(want), "{text}: {e}");
        }
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
