//! `/_emulator/*` control endpoints for manual use: the call log, fault rules,
//! and direct object writes. They are not logged and never faulted.

use http::Response;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::faults::FaultRule;
use crate::response::{error_response, json_response, Body};
use crate::Inner;

pub(crate) fn handle(inner: &Inner, method: &str, path: &str, body: &[u8]) -> Response<Body> {
    let path = path.trim_end_matches('/');
    match (method, path) {
        ("GET", "/_emulator/calls") => json_response(200, &json!(inner.calls())),
        ("DELETE", "/_emulator/calls") => {
            inner.clear_calls();
            json_response(200, &json!({}))
        }
        ("POST", "/_emulator/faults") => match serde_json::from_slice::<FaultRule>(body) {
            Ok(rule) => {
                let id = inner.inject(rule);
                json_response(201, &json!({"id": id.0}))
            }
            Err(e) => error_response(&ApiError::bad_request(format!("invalid fault rule: {e}"))),
        },
        ("DELETE", "/_emulator/faults") => {
            inner.clear_faults();
            json_response(200, &json!({}))
        }
        ("POST", "/_emulator/objects") => match serde_json::from_slice::<Value>(body) {
            Ok(obj) => match inner.put(obj) {
                Ok(stored) => json_response(200, &stored),
                Err(e) => error_response(&ApiError::bad_request(e)),
            },
            Err(e) => error_response(&ApiError::bad_request(format!("invalid object: {e}"))),
        },
        (_, "/_emulator/calls" | "/_emulator/faults" | "/_emulator/objects") => {
            error_response(&ApiError::method_not_allowed(method))
        }
        _ => error_response(&ApiError::path_not_found()),
    }
}
