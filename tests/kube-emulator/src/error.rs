//! Kubernetes `Status` errors, shaped like the ones kube-apiserver returns so
//! that clients decode them into their API error types.

use serde_json::{json, Map, Value};

use crate::resources::ResourceType;

/// One entry of `details.causes`.
#[derive(Debug, Clone)]
pub(crate) struct Cause {
    pub reason: &'static str,
    pub message: String,
    pub field: String,
}

impl Cause {
    pub fn new(reason: &'static str, field: impl Into<String>, message: impl Into<String>) -> Self {
        Cause {
            reason,
            message: message.into(),
            field: field.into(),
        }
    }

    /// `field.Invalid`: `Invalid value: "v": detail`.
    pub fn invalid(field: impl Into<String>, value: &Value, detail: &str) -> Self {
        Cause::new(
            "FieldValueInvalid",
            field,
            format!("Invalid value: {}: {detail}", display_value(value)),
        )
    }

    /// `field.Required`.
    pub fn required(field: impl Into<String>, detail: &str) -> Self {
        let msg = if detail.is_empty() {
            "Required value".to_string()
        } else {
            format!("Required value: {detail}")
        };
        Cause::new("FieldValueRequired", field, msg)
    }

    /// `field.TooLong`.
    pub fn too_long(field: impl Into<String>, max: usize) -> Self {
        Cause::new(
            "FieldValueTooLong",
            field,
            format!("Too long: must have at most {max} bytes"),
        )
    }

    /// `field.Forbidden`.
    pub fn forbidden(field: impl Into<String>, detail: &str) -> Self {
        Cause::new("FieldValueForbidden", field, format!("Forbidden: {detail}"))
    }

    /// `field.Duplicate`.
    pub fn duplicate(field: impl Into<String>, value: &Value) -> Self {
        Cause::new(
            "FieldValueDuplicate",
            field,
            format!("Duplicate value: {}", display_value(value)),
        )
    }

    /// `field.NotSupported`.
    pub fn not_supported(field: impl Into<String>, value: &Value, supported: &[&str]) -> Self {
        let list: Vec<String> = supported.iter().map(|s| format!("\"{s}\"")).collect();
        Cause::new(
            "FieldValueNotSupported",
            field,
            format!(
                "Unsupported value: {}: supported values: {}",
                display_value(value),
                list.join(", ")
            ),
        )
    }
}

fn display_value(v: &Value) -> String {
    match v {
        Value::String(s) => format!("\"{s}\""),
        other => other.to_string(),
    }
}

/// An error answered as a `Status` object.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
    pub retry_after: Option<u32>,
}

/// The `reason` the apiserver uses for an HTTP status code.
pub(crate) fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Expired",
        413 => "RequestEntityTooLarge",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "Unknown",
    }
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
            retry_after: None,
        }
    }

    fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    fn resource_details(rt: &ResourceType, name: &str) -> Value {
        let mut d = Map::new();
        if !name.is_empty() {
            d.insert("name".into(), json!(name));
        }
        if !rt.group.is_empty() {
            d.insert("group".into(), json!(rt.group));
        }
        d.insert("kind".into(), json!(rt.resource));
        Value::Object(d)
    }

    /// `nodes "x" not found`.
    pub fn not_found(rt: &ResourceType, name: &str) -> Self {
        ApiError::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", rt.qualified_resource()),
        )
        .with_details(Self::resource_details(rt, name))
    }

    /// Unknown URL.
    pub fn path_not_found() -> Self {
        ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
        .with_details(json!({}))
    }

    pub fn already_exists(rt: &ResourceType, name: &str) -> Self {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", rt.qualified_resource()),
        )
        .with_details(Self::resource_details(rt, name))
    }

    /// `Operation cannot be fulfilled on nodes "x": <msg>`.
    pub fn conflict(rt: &ResourceType, name: &str, msg: &str) -> Self {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {msg}",
                rt.qualified_resource()
            ),
        )
        .with_details(Self::resource_details(rt, name))
    }

    /// The optimistic-concurrency conflict.
    pub fn stale(rt: &ResourceType, name: &str) -> Self {
        Self::conflict(
            rt,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// A server-side apply conflict, with one cause per conflicting field.
    pub fn apply_conflict(rt: &ResourceType, name: &str, conflicts: &[(String, String)]) -> Self {
        // conflicts: (manager description, field path), grouped per manager in the message.
        let mut by_manager: Vec<(String, Vec<String>)> = Vec::new();
        for (m, f) in conflicts {
            match by_manager.iter_mut().find(|(mm, _)| mm == m) {
                Some((_, fs)) => fs.push(f.clone()),
                None => by_manager.push((m.clone(), vec![f.clone()])),
            }
        }
        let n = conflicts.len();
        let mut msg = format!(
            "Apply failed with {n} conflict{}: ",
            if n == 1 { "" } else { "s" }
        );
        let parts: Vec<String> = by_manager
            .iter()
            .map(|(m, fs)| {
                if fs.len() == 1 {
                    format!("conflict with {m}: {}", fs[0])
                } else {
                    let lines: Vec<String> = fs.iter().map(|f| format!("- {f}")).collect();
                    format!("conflicts with {m}:\n{}", lines.join("\n"))
                }
            })
            .collect();
        msg.push_str(&parts.join("\n"));
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|(m, f)| {
                json!({
                    "reason": "FieldManagerConflict",
                    "message": format!("conflict with {m}"),
                    "field": f,
                })
            })
            .collect();
        let mut details = Self::resource_details(rt, name);
        if let Some(d) = details.as_object_mut() {
            d.insert("causes".into(), Value::Array(causes));
        }
        ApiError::new(409, "Conflict", msg).with_details(details)
    }

    /// `ConfigMap "x" is invalid: <causes>` (422).
    pub fn invalid(rt: &ResourceType, name: &str, causes: Vec<Cause>) -> Self {
        Self::invalid_kind(&rt.qualified_kind(), rt.group, rt.kind, name, causes)
    }

    /// 422 for an arbitrary kind (e.g. `PatchOptions.meta.k8s.io`).
    pub fn invalid_kind(
        qualified_kind: &str,
        group: &str,
        kind: &str,
        name: &str,
        causes: Vec<Cause>,
    ) -> Self {
        let rendered: Vec<String> = causes
            .iter()
            .map(|c| {
                if c.field.is_empty() {
                    c.message.clone()
                } else {
                    format!("{}: {}", c.field, c.message)
                }
            })
            .collect();
        let joined = if rendered.len() == 1 {
            rendered[0].clone()
        } else {
            format!("[{}]", rendered.join(", "))
        };
        let msg = format!("{qualified_kind} \"{name}\" is invalid: {joined}");
        let mut d = Map::new();
        if !name.is_empty() {
            d.insert("name".into(), json!(name));
        }
        if !group.is_empty() {
            d.insert("group".into(), json!(group));
        }
        d.insert("kind".into(), json!(kind));
        d.insert(
            "causes".into(),
            Value::Array(
                causes
                    .iter()
                    .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
                    .collect(),
            ),
        );
        ApiError::new(422, "Invalid", msg).with_details(Value::Object(d))
    }

    /// 422 without field causes (e.g. a failed JSON patch `test`).
    pub fn unprocessable(msg: impl Into<String>) -> Self {
        ApiError::new(422, "Invalid", msg)
    }

    pub fn bad_request(msg: impl Into<String>) -> Self {
        ApiError::new(400, "BadRequest", msg)
    }

    pub fn method_not_allowed(method: &str) -> Self {
        ApiError::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource ({method})"),
        )
    }

    pub fn unsupported_media_type(ct: &str) -> Self {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {ct:?})"),
        )
    }

    pub fn too_large() -> Self {
        ApiError::new(
            413,
            "RequestEntityTooLarge",
            "Request entity too large: limit is 3145728",
        )
    }

    pub fn unauthorized() -> Self {
        ApiError::new(401, "Unauthorized", "Unauthorized")
    }

    pub fn forbidden(message: String, details: Value) -> Self {
        ApiError::new(403, "Forbidden", message).with_details(details)
    }

    pub fn expired(msg: impl Into<String>) -> Self {
        ApiError::new(410, "Expired", msg)
    }

    /// The error an injected `Status` fault answers with.
    pub fn injected(code: u16, retry_after: Option<u32>) -> Self {
        let reason = reason_for(code);
        let message = match code {
            409 => "Operation cannot be fulfilled: the object has been modified; please apply your changes to the latest version and try again (injected)".to_string(),
            429 => "Too many requests, please try again later.".to_string(),
            500 => "Internal error occurred: injected fault".to_string(),
            503 => "the server is currently unable to handle the request (injected)".to_string(),
            504 => "The request timed out (injected)".to_string(),
            _ => format!("injected fault ({code})"),
        };
        let mut e = ApiError::new(code, reason, message);
        // 429s always carry Retry-After (1 s unless the rule says otherwise).
        let retry_after = retry_after.or((code == 429).then_some(1));
        if let Some(s) = retry_after {
            e.retry_after = Some(s);
            e.details = Some(json!({"retryAfterSeconds": s}));
        }
        e
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        let mut v = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let (Some(d), Some(o)) = (&self.details, v.as_object_mut()) {
            o.insert("details".into(), d.clone());
        }
        v
    }
}
