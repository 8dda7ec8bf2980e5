//! Ascend `hccn_tool` parsers (`-link`, `-speed`, `-link_stat`, `-net_health`): never panic, and
//! error messages stay short whatever the input.
#![no_main]
use faultline_core::parse::ascend;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let short = |e: ascend::AscendParseError| assert!(e.to_string().len() < 4096);
    let _ = ascend::parse_link_status(&text).map_err(short);
    let _ = ascend::parse_speed_mbps(&text).map_err(short);
    let _ = ascend::parse_link_up_count(&text).map_err(short);
    if let Ok(h) = ascend::parse_net_health(&text).map_err(short) {
        assert!(!h.state.is_empty());
    }
});
