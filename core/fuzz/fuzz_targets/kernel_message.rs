//! Kernel message parsers (Xid, SXid, UUID, fallen off the bus, AER, MCE): never panic, and
//! every event serializes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Some(ev) = faultline_core::parse::parse_message(&text) {
        serde_json::to_string(&ev).expect("events serialize");
    }
});
