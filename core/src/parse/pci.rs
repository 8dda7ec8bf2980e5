//! PCI addresses as the kernel log and NVML print them, normalized to one form.
//!
//! The kernel log prints `PCI:0000:3b:00` (4-digit domain, no function), `0000:3b:00.0` or
//! `03:00`; NVML prints `00000000:3B:00.0`. All normalize to `dddd:bb:dd.f`, lower case.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A normalized PCI address (domain, bus, device, function).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddr {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl PciAddr {
    /// Parses the longest PCI address at the start of `s`; returns it and the bytes consumed.
    /// Accepts an optional `PCI:` prefix, a 4- or 8-digit domain (or none), and an optional
    /// `.f` function.
    pub fn parse_prefix(s: &str) -> Option<(PciAddr, usize)> {
        let b = s.as_bytes();
        let mut i = 0;
        if b.len() >= 4 && b[..4].eq_ignore_ascii_case(b"PCI:") {
            i = 4;
        }
        let (first, n1) = hex_run(&b[i..]);
        if n1 == 0 || b.get(i + n1) != Some(&b':') {
            return None;
        }
        let j = i + n1 + 1;
        let (second, n2) = hex_run(&b[j..]);
        if n2 != 2 {
            return None;
        }
        let k = j + n2;
        // With a domain: first:second:third; without: bus:dev.
        let (domain, bus, device, mut end) = if b.get(k) == Some(&b':') {
            let (third, n3) = hex_run(&b[k + 1..]);
            if n3 != 2 || !(4..=8).contains(&n1) {
                return None;
            }
            (first, second as u8, third as u8, k + 1 + n3)
        } else {
            if n1 != 2 {
                return None;
            }
            (0, first as u8, second as u8, k)
        };
        if device > 0x1f {
            return None;
        }
        let mut function = 0u8;
        if b.get(end) == Some(&b'.') {
            if let Some(f) = b.get(end + 1).and_then(|c| (*c as char).to_digit(8)) {
                function = f as u8;
                end += 2;
            }
        }
        Some((
            PciAddr {
                domain,
                bus,
                device,
                function,
            },
            end,
        ))
    }
}

/// Reads up to 8 hex digits; returns the value and the count read (0 when none, or when the run
/// is longer than 8 digits).
fn hex_run(b: &[u8]) -> (u32, usize) {
    let mut v: u32 = 0;
    let mut n = 0;
    while n < b.len() && b[n].is_ascii_hexdigit() {
        if n == 8 {
            return (0, 0);
        }
        v = (v << 4) | (b[n] as char).to_digit(16).unwrap_or(0);
        n += 1;
    }
    (v, n)
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

/// Error for text that is not a PCI address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a PCI address: {0:?}")]
pub struct BadPciAddr(pub String);

impl FromStr for PciAddr {
    type Err = BadPciAddr;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match PciAddr::parse_prefix(s.trim()) {
            Some((a, n)) if n == s.trim().len() => Ok(a),
            _ => Err(BadPciAddr(s.to_string())),
        }
    }
}

impl Serialize for PciAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_printed_form_normalizes_to_one() {
        let cases = [
            ("PCI:0000:3b:00", "0000:3b:00.0"),
            ("PCI:0000:3B:00", "0000:3b:00.0"),
            ("0000:3b:00.0", "0000:3b:00.0"),
            ("00000000:3B:00.0", "0000:3b:00.0"),
            ("03:00", "0000:03:00.0"),
            ("0000:03:00", "0000:03:00.0"),
            ("0001:c5:1f.7", "0001:c5:1f.7"),
            ("10000:01:00.0", "10000:01:00.0"),
        ];
        for (input, want) in cases {
            let got: PciAddr = input.parse().unwrap_or_else(|e| panic!("{input}: {e}"));
            assert_eq!(got.to_string(), want, "{input}");
        }
    }

    #[test]
    fn rejects_what_is_not_an_address() {
        for bad in [
            "",
            "PCI:",
            "3b",
            "0000:3b",
            "000:3b:00",
            "0:3b:00",
            "0000:3b:20.0",
            "123456789:00:00.0",
            "zz:00",
        ] {
            assert!(bad.parse::<PciAddr>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn prefix_stops_at_the_address() {
        let (a, n) = PciAddr::parse_prefix("PCI:0000:3b:00): 79").unwrap();
        assert_eq!(a.to_string(), "0000:3b:00.0");
        assert_eq!(n, "PCI:0000:3b:00".len());
    }

    proptest! {
        #[test]
        fn display_round_trips(domain in 0u32..0x10000, bus: u8, device in 0u8..0x20, function in 0u8..8) {
            let a = PciAddr { domain, bus, device, function };
            prop_assert_eq!(a.to_string().parse::<PciAddr>(), Ok(a));
        }

        #[test]
        fn never_panics(s in ".{0,40}") {
            let _ = PciAddr::parse_prefix(&s);
        }
    }
}
