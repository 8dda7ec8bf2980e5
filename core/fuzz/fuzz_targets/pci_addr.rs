//! PCI address parser: a parsed address prints in the normal form, which parses back to itself.
#![no_main]
use faultline_core::parse::PciAddr;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Some((a, n)) = PciAddr::parse_prefix(&text) {
        assert!(n <= text.len());
        assert_eq!(a.to_string().parse::<PciAddr>(), Ok(a));
    }
});
