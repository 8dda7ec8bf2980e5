//! The kernel log source's pure core over arbitrary input split into lines: never panics, and a
//! sequence gap is reported as loss exactly as counted.
#![no_main]
use std::sync::Arc;

use faultline_core::kmsg_reader::{KmsgPosition, KmsgReader, Tally};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let tally = Arc::new(Tally::default());
    let resume = data
        .first()
        .map(|b| u64::from(*b))
        .filter(|b| b % 2 == 0)
        .map(|b| KmsgPosition {
            seq: Some(b / 4),
            unsequenced: b % 4,
            log: None,
            read: None,
        });
    let mut r = KmsgReader::new(resume, None, data.len() % 3 == 0, tally.clone());
    let mut out = Vec::new();
    for line in data.split(|c| *c == b'\n') {
        r.feed(line, &mut out);
    }
    r.flush_cursor(&mut out);
    assert!(Tally::get(&tally.records) <= data.len() as u64 + 1);
});
