//! Ascend `npu-smi` parsers (the `npu-smi info` chip table and the per-chip health query) on the
//! same input: never panic, a parsed table has at least one chip, and error messages stay short
//! whatever the input.
#![no_main]
use faultline_core::parse::ascend;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match ascend::parse_npu_info(&text) {
        Ok(chips) => {
            assert!(!chips.is_empty());
            for c in &chips {
                let _ = (c.logical_id(), c.health.as_str(), c.health.is_severe());
            }
        }
        Err(e) => assert!(e.to_string().len() < 4096),
    }
    match ascend::parse_chip_health(&text) {
        Ok(h) => {
            let _ = h.health.as_str();
        }
        Err(e) => assert!(e.to_string().len() < 4096),
    }
});
