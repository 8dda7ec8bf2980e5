//! The `/dev/kmsg` record format: `pri,seq,usec,flags[,…];message` followed by optional
//! continuation lines that start with a space (`SUBSYSTEM=pci`, `DEVICE=+pci:…`).
//!
//! See the kernel's `Documentation/ABI/testing/dev-kmsg`. A record that breaks the format is an
//! error the caller counts; its text is still scanned for faults so nothing is lost.

use std::borrow::Cow;

/// One parsed record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KmsgRecord<'a> {
    /// Syslog facility (`pri >> 3`).
    pub facility: u32,
    /// Syslog level (`pri & 7`).
    pub level: u8,
    /// Kernel sequence number: consecutive records differ by one; a gap is lost records.
    pub seq: u64,
    /// Microseconds since boot (CLOCK_MONOTONIC).
    pub usec: u64,
    /// `-` for a whole record, `c` for a continuation fragment.
    pub flag: char,
    /// The message text; invalid UTF-8 is replaced, never rejected.
    pub message: Cow<'a, str>,
    /// `KEY=value` continuation lines.
    pub dict: Vec<(Cow<'a, str>, Cow<'a, str>)>,
}

/// Why a record did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("empty record")]
    Empty,
    #[error("record has no ';' after its header (truncated or not kmsg format)")]
    NoHeader,
    #[error("record header field {field} is not a number: {value:?}")]
    BadField { field: &'static str, value: String },
    #[error("record header has {0} fields, want at least 4 (pri,seq,usec,flags)")]
    ShortHeader(usize),
}

fn text(b: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(b)
}

/// A header field as `u64`: what `str::parse::<u64>` accepts (an optional `+`, then decimal
/// digits, no overflow), read straight from the bytes: every record's three numbers go through
/// here, on the reader's thread.
fn number(field: &'static str, b: &[u8]) -> Result<u64, RecordError> {
    let digits = b.strip_prefix(b"+").unwrap_or(b);
    (!digits.is_empty())
        .then_some(digits)
        .and_then(|d| {
            d.iter().try_fold(0u64, |n, &c| {
                c.is_ascii_digit()
                    .then_some(())
                    .and_then(|()| n.checked_mul(10)?.checked_add(u64::from(c - b'0')))
            })
        })
        .ok_or_else(|| RecordError::BadField {
            field,
            value: String::from_utf8_lossy(b).into_owned(),
        })
}

/// Parses one record (header line and its continuation lines; a trailing newline is optional).
pub fn parse_record(raw: &[u8]) -> Result<KmsgRecord<'_>, RecordError> {
    let raw = raw.strip_suffix(b"\n").unwrap_or(raw);
    if raw.is_empty() {
        return Err(RecordError::Empty);
    }
    let semi = memchr::memchr(b';', raw).ok_or(RecordError::NoHeader)?;
    let header = &raw[..semi];
    // The header never holds a newline; a ';' found past one belongs to a later line.
    if memchr::memchr(b'\n', header).is_some() {
        return Err(RecordError::NoHeader);
    }
    let mut fields = header.split(|c| *c == b',');
    let mut next = || fields.next();
    let (Some(pri), Some(seq), Some(usec), Some(flag)) = (next(), next(), next(), next()) else {
        return Err(RecordError::ShortHeader(
            header.split(|c| *c == b',').count(),
        ));
    };
    let pri = number("pri", pri)?;
    let seq = number("seq", seq)?;
    let usec = number("usec", usec)?;
    let flag = match flag.first() {
        Some(c) if c.is_ascii_graphic() => *c as char,
        _ => '-',
    };
    let body = &raw[semi + 1..];
    let (message, rest) = match memchr::memchr(b'\n', body) {
        Some(i) => (&body[..i], &body[i + 1..]),
        None => (body, &b""[..]),
    };
    let dict = rest
        .split(|c| *c == b'\n')
        .filter_map(|line| line.strip_prefix(b" "))
        .filter_map(|kv| {
            let eq = memchr::memchr(b'=', kv)?;
            Some((text(&kv[..eq]), text(&kv[eq + 1..])))
        })
        .collect();
    Ok(KmsgRecord {
        facility: facility_of(pri),
        level: (pri & 7) as u8,
        seq,
        usec,
        flag,
        message: text(message),
        dict,
    })
}

/// The facility of a `pri` field (`pri >> 3`); one too large for a `u32` is `u32::MAX`, never
/// cut down to a small number (such as the kernel's 0).
pub fn facility_of(pri: u64) -> u32 {
    u32::try_from(pri >> 3).unwrap_or(u32::MAX)
}

/// Splits the `<pri>` that `dmesg -r` prints before each line (`<4>[   12.345678] text`) from
/// the rest of the line.
pub fn strip_syslog_pri(line: &str) -> Option<(u64, &str)> {
    let rest = line.strip_prefix('<')?;
    let end = rest.find('>').filter(|&e| (1..=10).contains(&e))?;
    let pri = rest[..end].parse().ok()?;
    Some((pri, &rest[end + 1..]))
}

/// Strips a `dmesg`-style `[ 1234.567890] ` timestamp from a plain log line, and the caller id
/// that follows it on kernels built with `CONFIG_PRINTK_CALLER` (`[  T123] `, `[    C2] `): the
/// message parsers look for a driver's prefix at the start of the message.
pub fn strip_dmesg_time(line: &str) -> &str {
    let Some(rest) = bracketed(line.trim_start(), |s| {
        !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit() || c == b'.')
    }) else {
        return line;
    };
    bracketed(rest, |s| {
        s.len() > 1
            && matches!(s.as_bytes()[0], b'T' | b'C')
            && s[1..].bytes().all(|c| c.is_ascii_digit())
    })
    .unwrap_or(rest)
}

/// The text after a leading `[…] ` whose trimmed content passes `ok`.
fn bracketed(s: &str, ok: impl Fn(&str) -> bool) -> Option<&str> {
    let rest = s.strip_prefix('[')?;
    let end = rest.find(']')?;
    ok(rest[..end].trim()).then(|| rest[end + 1..].trim_start())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_a_record_with_dictionary() {
        let r = parse_record(
            b"4,339,5140900,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n",
        )
        .unwrap();
        assert_eq!(
            (r.facility, r.level, r.seq, r.usec, r.flag),
            (0, 4, 339, 5140900, '-')
        );
        assert!(r.message.starts_with("NVRM: Xid"));
        assert_eq!(r.dict.len(), 2);
        assert_eq!(r.dict[1].1, "+pci:0000:3b:00.0");
    }

    #[test]
    fn accepts_extra_header_fields() {
        // Newer kernels append fields (caller id) after the flags.
        let r = parse_record(b"6,1,2,-,caller=T1;hello").unwrap();
        assert_eq!((r.seq, r.message.as_ref()), (1, "hello"));
    }

    #[test]
    fn invalid_utf8_is_replaced_not_rejected() {
        let r = parse_record(b"6,7,8,-;NVRM: \xff\xfe Xid").unwrap();
        assert!(r.message.contains('\u{fffd}'));
        assert!(r.message.ends_with("Xid"));
    }

    #[test]
    fn bad_records_say_why() {
        assert_eq!(parse_record(b""), Err(RecordError::Empty));
        assert_eq!(parse_record(b"6,339,51409"), Err(RecordError::NoHeader));
        assert_eq!(parse_record(b"6,339;x"), Err(RecordError::ShortHeader(2)));
        assert_eq!(
            parse_record(b"6,x9,1,-;x"),
            Err(RecordError::BadField {
                field: "seq",
                value: "x9".into()
            })
        );
        let e = parse_record(b"6,x9,1,-;x").unwrap_err().to_string();
        assert!(e.contains("seq") && e.contains("x9"), "{e}");
    }

    #[test]
    fn dmesg_raw_priority_is_split_off() {
        assert_eq!(
            strip_syslog_pri("<14>[ 1.5] NVRM: x"),
            Some((14, "[ 1.5] NVRM: x"))
        );
        assert_eq!(strip_syslog_pri("<x>[ 1.5] y"), None);
        assert_eq!(strip_syslog_pri("<>y"), None);
        assert_eq!(strip_syslog_pri("[ 1.5] y"), None);
    }

    #[test]
    fn dmesg_time_is_stripped() {
        assert_eq!(strip_dmesg_time("[  12.345678] NVRM: x"), "NVRM: x");
        assert_eq!(strip_dmesg_time("[not time] x"), "[not time] x");
        assert_eq!(
            strip_dmesg_time("[  12.345678] [  T4711] NVRM: x"),
            "NVRM: x"
        );
        assert_eq!(strip_dmesg_time("[ 1.5][    C3] mce: x"), "mce: x");
        // Only a caller id goes: the MCE prefix is a bracket too.
        assert_eq!(
            strip_dmesg_time("[ 1.5] [Hardware Error]: Machine check events logged"),
            "[Hardware Error]: Machine check events logged"
        );
    }

    proptest! {
        #[test]
        fn never_panics(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse_record(&raw);
        }

        #[test]
        fn header_round_trips(pri in 0u64..192, seq: u64, usec: u64, msg in "[^\n]{0,80}") {
            let raw = format!("{pri},{seq},{usec},-;{msg}");
            let r = parse_record(raw.as_bytes()).unwrap();
            prop_assert_eq!(r.seq, seq);
            prop_assert_eq!(r.usec, usec);
            prop_assert_eq!(r.message.as_ref(), msg.as_str());
        }

        /// A header field is read as `str::parse::<u64>` reads it: the same number or the same
        /// refusal, for digits, signs, overflow and bytes that are not text.
        #[test]
        fn header_numbers_read_as_str_parse_reads_them(
            field in prop_oneof![
                "[+-]?[0-9]{0,21}",
                "[0-9 +x-]{0,4}",
                proptest::collection::vec(any::<u8>(), 0..6)
                    .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
            ]
        ) {
            let want = field.parse::<u64>().ok();
            prop_assert_eq!(number("seq", field.as_bytes()).ok(), want);
        }
    }

    #[test]
    fn header_numbers_at_the_edges() {
        for (field, want) in [
            ("18446744073709551615", Some(u64::MAX)),
            ("18446744073709551616", None),
            ("+7", Some(7)),
            ("+", None),
            ("", None),
            ("-0", None),
            ("007", Some(7)),
        ] {
            assert_eq!(number("seq", field.as_bytes()).ok(), want, "{field:?}");
            assert_eq!(field.parse::<u64>().ok(), want, "{field:?}");
        }
        // Not text: refused, as from_utf8 refused it before parse.
        assert!(number("seq", b"1\xff").is_err());
    }
}
