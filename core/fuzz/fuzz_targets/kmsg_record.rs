//! `/dev/kmsg` record parser: any bytes either parse or give an error; a parsed message never
//! spans lines.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = faultline_core::parse::parse_record(data) {
        assert!(!r.message.contains('\n'));
        assert!(r.level < 8);
    }
});
