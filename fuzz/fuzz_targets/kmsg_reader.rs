//! The kernel log source's pure core over arbitrary input split into lines: never panics, and a
//! sequence gap is reported as loss exactly as counted.
#![no_main]
use std::sync::Arc;

use faultline_agent::metrics::Metrics;
use faultline_agent::source::kmsg::KmsgReader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let metrics = Arc::new(Metrics::new());
    let resume = data.first().map(|b| u64::from(*b)).filter(|b| b % 2 == 0);
    let mut r = KmsgReader::new(resume, None, data.len() % 3 == 0, metrics.clone());
    let mut out = Vec::new();
    for line in data.split(|c| *c == b'\n') {
        r.feed(line, &mut out);
    }
    r.flush_cursor(&mut out);
    assert!(metrics.kmsg_records.get() <= data.len() as u64 + 1);
});
