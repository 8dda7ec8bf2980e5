//! Policy parser: any text is a policy or an error that says where; never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = faultline_core::policy::Policy::parse(text) {
            assert!(!e.location.is_empty());
        }
    }
});
