//! The NVML source's conditions and the `Level` domain each is reported in.
//!
//! The NVML source sends one level-triggered observation per GPU, per reading, per poll: the
//! domain names the reading, so a reading that failed this poll (no `Level` sent) leaves its
//! conditions as they were, and a lost GPU, which reads nothing, keeps the rest. The table
//! lives in the core because the engine needs it too: faults rebuilt from a record get their domain from here so the
//! next poll can end them.

/// `(fault code, domain)` of every NVML condition.
pub const CONDITIONS: &[(&str, &str)] = &[
    ("GPU_LOST", "nvml-lost"),
    ("GPU_MISSING", "nvml-inventory"),
    ("ECC_UNCORRECTABLE", "nvml-ecc"),
    ("PAGE_RETIRE_PENDING", "nvml-pages"),
    ("REMAP_FAILURE", "nvml-remap"),
    ("REMAP_PENDING", "nvml-remap"),
    ("GPU_RESET_REQUIRED", "nvml-recovery"),
    ("NODE_REBOOT_REQUIRED", "nvml-recovery"),
    ("GPU_DRAIN_REQUIRED", "nvml-recovery"),
    ("NVLINK_DOWN", "nvml-nvlink"),
    ("NVLINK_ERRORS", "nvml-nvlink-errors"),
    ("PCIE_DEGRADED", "nvml-pcie"),
    ("PCIE_REPLAY_ERRORS", "nvml-pcie-replay"),
];

/// The domain of an NVML condition; `None` for the source's events (Xids), which are not levels.
pub fn domain(code: &str) -> Option<&'static str> {
    CONDITIONS.iter().find(|(c, _)| *c == code).map(|(_, d)| *d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;

    #[test]
    fn every_condition_is_in_the_catalog_once() {
        let catalog = Catalog::builtin().unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for (code, d) in CONDITIONS {
            assert!(seen.insert(*code), "{code} twice");
            assert!(d.starts_with("nvml-"), "{code}: {d}");
            assert!(catalog.is_named(code), "{code} has no catalog entry");
        }
        assert_eq!(domain("NVLINK_DOWN"), Some("nvml-nvlink"));
        assert_eq!(domain("Xid79"), None);
    }
}
