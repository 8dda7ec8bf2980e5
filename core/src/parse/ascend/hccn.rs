//! `hccn_tool` output: `-link`, `-speed`, `-link_stat` and `-net_health` queries (`-g`).

use super::{bad_value, find_value, missing, parse_u64, words_eq, AscendParseError};

/// The state `hccn_tool -i <n> -link -g` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkStatus {
    Up,
    Down,
}

/// Parses `hccn_tool -i <n> -link -g` (`link status: UP` or `link status: DOWN`).
pub fn parse_link_status(text: &str) -> Result<LinkStatus, AscendParseError> {
    const Q: &str = "hccn_tool link";
    const K: &str = "link status";
    let v = find_value(text, K).ok_or_else(|| missing(Q, K, text))?;
    if v.eq_ignore_ascii_case("up") {
        Ok(LinkStatus::Up)
    } else if v.eq_ignore_ascii_case("down") {
        Ok(LinkStatus::Down)
    } else {
        Err(bad_value(Q, K, v))
    }
}

/// Parses `hccn_tool -i <n> -speed -g` (`Speed: 100000 Mb/s`) into megabits per second. A
/// speed the tool cannot tell (`Unknown!`) is an error.
pub fn parse_speed_mbps(text: &str) -> Result<u64, AscendParseError> {
    const Q: &str = "hccn_tool speed";
    const K: &str = "Speed";
    let v = find_value(text, K).ok_or_else(|| missing(Q, K, text))?;
    let mut words = v.split_whitespace();
    let (Some(num), unit, None) = (words.next(), words.next(), words.next()) else {
        return Err(bad_value(Q, K, v));
    };
    let unit_ok = unit.is_none_or(|u| {
        ["mb/s", "mbps", "mbit/s"]
            .iter()
            .any(|k| u.eq_ignore_ascii_case(k))
    });
    match parse_u64(num) {
        Some(n) if unit_ok => Ok(n),
        _ => Err(bad_value(Q, K, v)),
    }
}

/// Parses `hccn_tool -i <n> -link_stat -g`: the `link up count` (lines may carry a
/// `[devid N]` or `[device N]` tag).
pub fn parse_link_up_count(text: &str) -> Result<u64, AscendParseError> {
    const Q: &str = "hccn_tool link_stat";
    const K: &str = "link up count";
    let v = find_value(text, K).ok_or_else(|| missing(Q, K, text))?;
    parse_u64(v).ok_or_else(|| bad_value(Q, K, v))
}

/// The result of `hccn_tool -i <n> -net_health -g`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetHealth {
    /// The state as printed (`Success`, `Init`, `Socket failed`, `Receive timeout`,
    /// `Unreachable`, `Fault`, `Detect ip set`, …).
    pub state: String,
    /// Only `Success` and `Init` are healthy.
    pub healthy: bool,
}

/// Parses `hccn_tool -i <n> -net_health -g` (`net health status: <state>`).
pub fn parse_net_health(text: &str) -> Result<NetHealth, AscendParseError> {
    const Q: &str = "hccn_tool net_health";
    const K: &str = "net health status";
    let v = find_value(text, K).ok_or_else(|| missing(Q, K, text))?;
    if v.is_empty() {
        return Err(bad_value(Q, K, v));
    }
    let healthy = words_eq(v, "success") || words_eq(v, "init");
    Ok(NetHealth {
        state: v.split_whitespace().collect::<Vec<_>>().join(" "),
        healthy,
    })
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;

    #[test]
    fn hccn_link() {
        assert_eq!(parse_link_status(LINK_UP), Ok(LinkStatus::Up));
        assert_eq!(parse_link_status(LINK_DOWN), Ok(LinkStatus::Down));
        assert_eq!(
            parse_link_status("[devid 3]link status: up\r\n"),
            Ok(LinkStatus::Up)
        );
        assert_eq!(
            parse_link_status("").unwrap_err().to_string(),
            "hccn_tool link: no `link status` line (output begins \"\")"
        );
        assert!(matches!(
            parse_link_status("link status: FLAPPING\n"),
            Err(AscendParseError::BadValue { .. })
        ));
        assert!(matches!(
            parse_link_status("Get link status failed, ret = -1\n"),
            Err(AscendParseError::MissingLine { .. })
        ));
    }

    #[test]
    fn hccn_speed() {
        assert_eq!(parse_speed_mbps(SPEED), Ok(200_000));
        assert_eq!(parse_speed_mbps("Speed: 100000 Mb/s\n"), Ok(100_000));
        assert_eq!(
            parse_speed_mbps("[device 1] speed : 25000 mbps\n"),
            Ok(25_000)
        );
        for bad in [
            "Speed: Unknown!\n",
            "Speed: 100 Gb/s\n",
            "Speed: -1 Mb/s\n",
            "Speed: 1 2 Mb/s\n",
            "Speed:\n",
            "Speed: 99999999999999999999999 Mb/s\n",
        ] {
            assert!(
                matches!(
                    parse_speed_mbps(bad),
                    Err(AscendParseError::BadValue { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse_speed_mbps("link status: UP\n"),
            Err(AscendParseError::MissingLine { .. })
        ));
    }

    #[test]
    fn hccn_link_stat() {
        assert_eq!(parse_link_up_count(LINK_STAT), Ok(3));
        assert_eq!(
            parse_link_up_count("[device 7]link up count : 12\n"),
            Ok(12)
        );
        assert_eq!(parse_link_up_count("link up count: 0"), Ok(0));
        assert!(matches!(
            parse_link_up_count("[devid 0]link up count : many\n"),
            Err(AscendParseError::BadValue { .. })
        ));
        // The down count and the records are not the up count.
        assert!(matches!(
            parse_link_up_count("[devid 0]link down count : 1\n"),
            Err(AscendParseError::MissingLine { .. })
        ));
    }

    #[test]
    fn hccn_net_health() {
        assert_eq!(
            parse_net_health(NET_OK),
            Ok(NetHealth {
                state: "Success".into(),
                healthy: true
            })
        );
        assert_eq!(
            parse_net_health(NET_FAULT),
            Ok(NetHealth {
                state: "Fault".into(),
                healthy: false
            })
        );
        for (s, healthy) in [
            ("Init", true),
            ("init", true),
            ("Socket failed", false),
            ("Receive timeout", false),
            ("Unreachable", false),
            ("Detect ip set", false),
        ] {
            let got = parse_net_health(&format!("net health status: {s}\n")).unwrap();
            assert_eq!((got.state.as_str(), got.healthy), (s, healthy));
        }
        assert!(matches!(
            parse_net_health("net health status:\n"),
            Err(AscendParseError::BadValue { .. })
        ));
        assert!(matches!(
            parse_net_health("garbage"),
            Err(AscendParseError::MissingLine { .. })
        ));
    }
}
