//! Fault injection rules and the call log.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// What an injected fault does to a matching request.
///
/// JSON form (for `POST /_emulator/faults`): `{"status": {"code": 500}}`,
/// `{"status": {"code": 429, "retry_after_s": 1}}`, `"hang"`, `{"delay": 250}`
/// (milliseconds), `"reset"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultAction {
    /// Answer with a Kubernetes `Status` error of this code without touching
    /// state; `retry_after_s` sets the `Retry-After` header.
    Status {
        code: u16,
        #[serde(default)]
        retry_after_s: Option<u32>,
    },
    /// Never answer (until `down()` or the client gives up).
    Hang,
    /// Sleep, then handle the request normally.
    Delay(#[serde(with = "millis")] Duration),
    /// Close the connection (with a TCP reset) without a response.
    Reset,
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

/// A fault injection rule. Rules are checked in order; the first matching rule
/// with uses left applies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRule {
    /// HTTP method to match (case-insensitive); `None` matches any.
    #[serde(default)]
    pub method: Option<String>,
    /// Substring of `path?query` to match; `None` matches any.
    #[serde(default)]
    pub path_contains: Option<String>,
    pub action: FaultAction,
    /// How many requests it applies to; `None` until cleared.
    #[serde(default)]
    pub times: Option<u32>,
}

impl FaultRule {
    /// A rule for every request.
    pub fn new(action: FaultAction) -> Self {
        FaultRule {
            method: None,
            path_contains: None,
            action,
            times: None,
        }
    }

    /// Answer `code` (a Kubernetes `Status` error).
    pub fn status(code: u16) -> Self {
        Self::new(FaultAction::Status {
            code,
            retry_after_s: None,
        })
    }

    /// Answer 429 with `Retry-After`.
    pub fn too_many_requests(retry_after_s: u32) -> Self {
        Self::new(FaultAction::Status {
            code: 429,
            retry_after_s: Some(retry_after_s),
        })
    }

    pub fn hang() -> Self {
        Self::new(FaultAction::Hang)
    }

    pub fn delay(d: Duration) -> Self {
        Self::new(FaultAction::Delay(d))
    }

    pub fn reset() -> Self {
        Self::new(FaultAction::Reset)
    }

    /// Only requests with this method.
    pub fn on_method(mut self, method: &str) -> Self {
        self.method = Some(method.to_string());
        self
    }

    /// Only requests whose `path?query` contains this.
    pub fn on_path(mut self, needle: &str) -> Self {
        self.path_contains = Some(needle.to_string());
        self
    }

    /// Only the next `n` matching requests.
    pub fn times(mut self, n: u32) -> Self {
        self.times = Some(n);
        self
    }

    pub(crate) fn matches(&self, method: &str, target: &str) -> bool {
        self.method
            .as_deref()
            .is_none_or(|m| m.eq_ignore_ascii_case(method))
            && self
                .path_contains
                .as_deref()
                .is_none_or(|p| target.contains(p))
    }
}

/// Identifies an injected rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RuleId(pub u64);

/// One logged request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    pub method: String,
    pub path: String,
    /// Raw query string (still percent-encoded), without `?`.
    pub query: String,
    pub content_type: Option<String>,
    /// Bearer token.
    pub token: Option<String>,
    /// `fieldManager` query parameter.
    pub field_manager: Option<String>,
    /// The `User-Agent` header (what the API server's audit log shows as `userAgent`, and the
    /// field manager of a non-apply write that names none).
    pub user_agent: Option<String>,
    /// Response status; 0 when none was sent (hang, reset).
    pub status: u16,
    /// A fault rule applied to this request.
    pub injected: bool,
    pub at: SystemTime,
}

impl Call {
    /// POST, PUT, PATCH or DELETE.
    pub fn is_write(&self) -> bool {
        matches!(self.method.as_str(), "POST" | "PUT" | "PATCH" | "DELETE")
    }

    /// Whether the query string has `watch=true` / `watch=1`.
    pub fn is_watch(&self) -> bool {
        self.query
            .split('&')
            .any(|p| matches!(p, "watch=true" | "watch=1" | "watch=True" | "watch=t"))
            || self.path.contains("/watch/")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn json_forms() {
        let r: FaultRule = serde_json::from_str(
            r#"{"method":"PATCH","path_contains":"nodes","action":{"status":{"code":429,"retry_after_s":2}},"times":1}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            FaultRule::too_many_requests(2)
                .on_method("PATCH")
                .on_path("nodes")
                .times(1)
        );
        let r: FaultRule = serde_json::from_str(r#"{"action":{"delay":250}}"#).unwrap();
        assert_eq!(r.action, FaultAction::Delay(Duration::from_millis(250)));
        let r: FaultRule = serde_json::from_str(r#"{"action":"hang"}"#).unwrap();
        assert_eq!(r.action, FaultAction::Hang);
        assert!(FaultRule::reset()
            .on_method("get")
            .matches("GET", "/api/v1/nodes"));
    }
}
