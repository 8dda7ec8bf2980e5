//! MindCluster's `faultCode.json` and `faultCustomization.json` readers on the same input: never
//! panic; a parsed table only holds normalized codes, and parsed rules are valid escalation
//! rules (at least one code, a count with a window or a duration).
#![no_main]
use faultline_core::catalog::ascend::{normalize_code, parse_customization, AscendTable};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(t) = AscendTable::parse("fuzz", &text) {
        let (chip, net) = t.len();
        assert_eq!(t.is_empty(), chip + net == 0);
    }
    if let Ok(c) = parse_customization("fuzz", &text) {
        for r in c.rules {
            assert!(!r.codes.is_empty());
            assert!(r.codes.iter().all(|c| normalize_code(c).as_deref() == Some(c.as_str())));
            assert!(r.count.is_some() == r.window.is_some());
            assert!(r.count.is_some() != r.duration.is_some());
        }
    }
});
