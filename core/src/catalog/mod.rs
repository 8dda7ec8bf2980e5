//! Catalogs: raw fault codes to `(fault_type, fault_code, fault_handling)`.
//!
//! The tables are data (`core/catalog/*.yaml`, embedded at build time): NVIDIA's Xid and SXid
//! catalog with its recommended actions, and faultline's own named codes. The policy file can
//! override any entry per code; `Catalog::classify` is what the engine calls. Ascend codes
//! come from a table in MindCluster's `faultCode.json` format (`ascend`), built in and
//! overridable by the operator's own file.

pub mod ascend;
pub mod nvml;

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::Deserialize;

use crate::record::{FaultType, Handling};

const NVIDIA_YAML: &str = include_str!("../../catalog/nvidia.yaml");
const FAULTLINE_YAML: &str = include_str!("../../catalog/faultline.yaml");

/// A raw fault code as a source reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultCode {
    Xid(u32),
    Sxid {
        code: u32,
        fatal: bool,
    },
    /// A named condition (`GPU_LOST`).
    Named(String),
    /// An Ascend code (`80E01801`, normalized by `ascend::normalize_code`): a chip code from
    /// npu-smi or a network code (`81078603`, link down). `severe`: the chip's health was worse
    /// than a minor alarm when the code was read (decides the level of unlisted chip codes).
    Ascend {
        code: String,
        network: bool,
        severe: bool,
    },
}

impl FaultCode {
    pub fn named(s: &str) -> Self {
        FaultCode::Named(s.to_string())
    }
}

impl fmt::Display for FaultCode {
    /// The `fault_code` string written into records.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultCode::Xid(x) => write!(f, "Xid{x}"),
            FaultCode::Sxid { code, .. } => write!(f, "SXid{code}"),
            FaultCode::Named(s) => f.write_str(s),
            FaultCode::Ascend { code, .. } => f.write_str(code),
        }
    }
}

/// A fault type and handling level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Class {
    pub fault_type: FaultType,
    pub handling: Handling,
}

/// What the catalog says about one code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classification {
    pub fault_type: FaultType,
    pub handling: Handling,
    /// A short description of the code (catalog name), empty when unknown.
    pub description: String,
    /// False when the code is not in any table and a default was used.
    pub known: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct XidEntry {
    xid: u32,
    name: String,
    action: String,
    #[serde(default)]
    fault_type: Option<FaultType>,
    #[serde(default)]
    handling: Option<Handling>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SxidEntry {
    sxid: u32,
    name: String,
    fatal: bool,
    handling: Handling,
    #[serde(default)]
    fault_type: Option<FaultType>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NvidiaFile {
    actions: BTreeMap<String, Handling>,
    unknown_xid: Class,
    xid: Vec<XidEntry>,
    unknown_sxid_fatal: Class,
    unknown_sxid_nonfatal: Class,
    sxid: Vec<SxidEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CodeEntry {
    fault_type: FaultType,
    handling: Handling,
    description: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultlineFile {
    codes: BTreeMap<String, CodeEntry>,
}

/// An invalid catalog table.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("catalog {file}: {source}")]
    Parse {
        file: &'static str,
        #[source]
        source: Box<serde_saphyr::Error>,
    },
    #[error("catalog {file}: {what}")]
    Invalid { file: &'static str, what: String },
}

#[derive(Debug, Clone)]
struct Entry {
    class: Class,
    name: String,
}

/// The merged, validated tables.
#[derive(Debug, Clone)]
pub struct Catalog {
    xid: HashMap<u32, Entry>,
    unknown_xid: Class,
    sxid: HashMap<u32, Entry>,
    unknown_sxid_fatal: Class,
    unknown_sxid_nonfatal: Class,
    named: HashMap<String, Entry>,
    /// Catalog action name for each Xid, for documentation and `faultline catalog`.
    xid_actions: HashMap<u32, String>,
    /// The built-in Ascend `faultCode.json`.
    ascend: ascend::AscendTable,
}

impl Catalog {
    /// The catalog built into the binary.
    pub fn builtin() -> Result<Catalog, CatalogError> {
        Catalog::from_yaml(NVIDIA_YAML, FAULTLINE_YAML)
    }

    fn from_yaml(nvidia: &str, own: &str) -> Result<Catalog, CatalogError> {
        let nv: NvidiaFile =
            serde_saphyr::from_str(nvidia).map_err(|source| CatalogError::Parse {
                file: "nvidia.yaml",
                source: Box::new(source),
            })?;
        let own: FaultlineFile =
            serde_saphyr::from_str(own).map_err(|source| CatalogError::Parse {
                file: "faultline.yaml",
                source: Box::new(source),
            })?;
        let invalid = |what: String| CatalogError::Invalid {
            file: "nvidia.yaml",
            what,
        };
        let mut xid = HashMap::new();
        let mut xid_actions = HashMap::new();
        for e in nv.xid {
            let handling = match e.handling {
                Some(h) => h,
                None => *nv.actions.get(&e.action).ok_or_else(|| {
                    invalid(format!(
                        "Xid {} uses action {:?}, which `actions` does not map",
                        e.xid, e.action
                    ))
                })?,
            };
            let class = Class {
                fault_type: e.fault_type.unwrap_or(FaultType::CardUnhealthy),
                handling,
            };
            xid_actions.insert(e.xid, e.action);
            if xid
                .insert(
                    e.xid,
                    Entry {
                        class,
                        name: e.name,
                    },
                )
                .is_some()
            {
                return Err(invalid(format!("Xid {} is listed twice", e.xid)));
            }
        }
        let mut sxid = HashMap::new();
        for e in nv.sxid {
            let class = Class {
                fault_type: e.fault_type.unwrap_or(FaultType::NodeUnhealthy),
                handling: e.handling,
            };
            let _ = e.fatal;
            if sxid
                .insert(
                    e.sxid,
                    Entry {
                        class,
                        name: e.name,
                    },
                )
                .is_some()
            {
                return Err(invalid(format!("SXid {} is listed twice", e.sxid)));
            }
        }
        let named = own
            .codes
            .into_iter()
            .map(|(code, e)| {
                (
                    code,
                    Entry {
                        class: Class {
                            fault_type: e.fault_type,
                            handling: e.handling,
                        },
                        name: e.description,
                    },
                )
            })
            .collect();
        Ok(Catalog {
            xid,
            unknown_xid: nv.unknown_xid,
            sxid,
            unknown_sxid_fatal: nv.unknown_sxid_fatal,
            unknown_sxid_nonfatal: nv.unknown_sxid_nonfatal,
            named,
            xid_actions,
            ascend: ascend::AscendTable::parse(
                "ascend-faultCode.json",
                ascend::BUILTIN_FAULT_CODES,
            )
            .map_err(|e| CatalogError::Invalid {
                file: "ascend-faultCode.json",
                what: e.what,
            })?,
        })
    }

    /// Classifies a code with the built-in tables (policy overrides are applied by the caller).
    pub fn classify(&self, code: &FaultCode) -> Classification {
        if let FaultCode::Ascend {
            code,
            network,
            severe,
        } = code
        {
            return self.classify_ascend(None, code, *network, *severe);
        }
        let (entry, default) = match code {
            FaultCode::Xid(x) => (self.xid.get(x), self.unknown_xid),
            FaultCode::Sxid { code, fatal } => (
                self.sxid.get(code),
                if *fatal {
                    self.unknown_sxid_fatal
                } else {
                    self.unknown_sxid_nonfatal
                },
            ),
            FaultCode::Named(n) => (self.named.get(n), self.unknown_xid),
            FaultCode::Ascend { .. } => (None, self.unknown_xid),
        };
        match entry {
            Some(e) => Classification {
                fault_type: e.class.fault_type,
                handling: e.class.handling,
                description: e.name.clone(),
                known: true,
            },
            None => Classification {
                fault_type: default.fault_type,
                handling: default.handling,
                description: String::new(),
                known: false,
            },
        }
    }

    /// An Ascend code: the operator's table when given, else the built-in one, then the default
    /// for unlisted codes. An operator's table replaces the built-in one, as the device plugin's
    /// own file replaces its table (`LoadFaultCode`): an operator on an older MindCluster release
    /// gets that release's levels, not the newest table's for codes the older file lacks.
    pub fn classify_ascend(
        &self,
        operator: Option<&ascend::AscendTable>,
        code: &str,
        network: bool,
        severe: bool,
    ) -> Classification {
        let norm = ascend::normalize_code(code).unwrap_or_else(|| code.to_string());
        let listed = operator.unwrap_or(&self.ascend).lookup(&norm, network);
        let kind = if network { "network" } else { "chip" };
        Classification {
            fault_type: if network {
                FaultType::CardNetworkUnhealthy
            } else {
                FaultType::CardUnhealthy
            },
            handling: listed.unwrap_or_else(|| ascend::unknown_handling(network, severe)),
            description: match listed {
                Some(_) => format!("Ascend {kind} fault {code}"),
                None => format!("Ascend {kind} fault {code} (not in the fault code table)"),
            },
            known: listed.is_some(),
        }
    }

    /// NVIDIA's recommended action for an Xid, as the catalog names it.
    pub fn xid_action(&self, xid: u32) -> Option<&str> {
        self.xid_actions.get(&xid).map(String::as_str)
    }

    /// Whether a record's `fault_code` is one the built-in tables list (an Xid or SXid of the
    /// NVIDIA catalog, a named code, an Ascend chip or network code), in the spelling records
    /// use: a bounded set, whatever a source reports.
    pub fn lists(&self, code: &str) -> bool {
        let number = |rest: &str| rest.parse::<u32>().ok().filter(|n| n.to_string() == rest);
        if let Some(n) = code.strip_prefix("SXid").and_then(number) {
            return self.sxid.contains_key(&n);
        }
        if let Some(n) = code.strip_prefix("Xid").and_then(number) {
            return self.xid.contains_key(&n);
        }
        self.named.contains_key(code) || ascend_listed(&self.ascend, code)
    }

    /// Whether `code` names one of faultline's own conditions.
    pub fn is_named(&self, code: &str) -> bool {
        self.named.contains_key(code)
    }

    /// Number of Xid, SXid and named entries.
    pub fn len(&self) -> (usize, usize, usize) {
        (self.xid.len(), self.sxid.len(), self.named.len())
    }
}

/// Whether `table` lists `code` (in its normalized spelling) as a chip or a network code.
pub(crate) fn ascend_listed(table: &ascend::AscendTable, code: &str) -> bool {
    ascend::normalize_code(code).is_some_and(|n| n == code)
        && (table.lookup(code, false).is_some() || table.lookup(code, true).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cat() -> Catalog {
        Catalog::builtin().expect("builtin catalog parses")
    }

    #[test]
    fn builtin_tables_parse_and_are_not_empty() {
        let (x, s, n) = cat().len();
        assert!(x >= 40, "only {x} Xids");
        assert!(s >= 1, "no SXids");
        assert!(n >= 15, "only {n} named codes");
    }

    /// The codes the tables list, in the records' spelling, and nothing else: not an unlisted
    /// Xid, not another spelling of a listed one.
    #[test]
    fn lists_the_tables_codes_only() {
        let c = cat();
        for code in [
            "Xid79",
            "Xid13",
            "SXid12028",
            "NVLINK_DOWN",
            "KMSG_LOSS",
            "80E01801",
        ] {
            assert!(c.lists(code), "{code}");
        }
        for code in [
            "Xid99999",
            "Xid079",
            "Xid",
            "SXid",
            "xid79",
            "80e01801",
            "0x80E01801",
            "",
        ] {
            assert!(!c.lists(code), "{code}");
        }
    }

    #[test]
    fn catalog_actions_map_as_the_issue_fixes() {
        let c = cat();
        let h = |x| c.classify(&FaultCode::Xid(x)).handling;
        assert_eq!(c.xid_action(13), Some("RESTART_APP"));
        assert_eq!(h(13), Handling::RestartBusiness);
        assert_eq!(h(31), Handling::RestartBusiness);
        assert_eq!(
            h(79),
            Handling::SeparateNPU,
            "fallen off the bus: reboot the node"
        );
        assert_eq!(h(43), Handling::NotHandleFault);
        assert_eq!(h(63), Handling::NotHandleFault);
        assert_eq!(h(92), Handling::NotHandleFault);
        assert_eq!(h(95), Handling::RestartNPU);
        assert_eq!(h(119), Handling::RestartNPU);
        let unknown = c.classify(&FaultCode::Xid(99_999));
        assert_eq!(unknown.handling, Handling::PreSeparateNPU);
        assert!(!unknown.known);
    }

    #[test]
    fn nvlink_xids_are_network_faults() {
        let c = cat().classify(&FaultCode::Xid(74));
        assert_eq!(c.fault_type, FaultType::CardNetworkUnhealthy);
    }

    #[test]
    fn unknown_sxid_depends_on_severity() {
        let c = cat();
        let fatal = c.classify(&FaultCode::Sxid {
            code: 99_998,
            fatal: true,
        });
        let non = c.classify(&FaultCode::Sxid {
            code: 99_998,
            fatal: false,
        });
        assert!(fatal.handling > non.handling);
        assert_eq!(fatal.handling, Handling::SeparateNPU);
    }

    #[test]
    fn unmapped_action_is_an_error_naming_it() {
        let nv = "actions: {}\nunknown_xid: {fault_type: CardUnhealthy, handling: PreSeparateNPU}\nxid:\n  - {xid: 1, name: x, action: MYSTERY}\nunknown_sxid_fatal: {fault_type: NodeUnhealthy, handling: SeparateNPU}\nunknown_sxid_nonfatal: {fault_type: NodeUnhealthy, handling: SubHealthFault}\nsxid: []\n";
        let err = Catalog::from_yaml(nv, "codes: {}").unwrap_err().to_string();
        assert!(err.contains("MYSTERY") && err.contains("Xid 1"), "{err}");
    }

    #[test]
    fn fault_code_strings() {
        assert_eq!(FaultCode::Xid(79).to_string(), "Xid79");
        assert_eq!(
            FaultCode::Sxid {
                code: 12028,
                fatal: false
            }
            .to_string(),
            "SXid12028"
        );
        assert_eq!(FaultCode::named("GPU_LOST").to_string(), "GPU_LOST");
    }
}
