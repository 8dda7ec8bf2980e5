//! Object validation: the subset of apiserver validation that clients commonly
//! trip over (names, labels, annotations, taints, ConfigMap/Secret keys and size
//! limits, immutability rules).

use serde_json::{json, Map, Value};

use crate::error::Cause;
use crate::resources::ResourceType;
use crate::util::base64_decode;

/// Largest total of keys plus values in a ConfigMap or Secret.
pub(crate) const MAX_CONFIG_SIZE: usize = 1024 * 1024;
/// Largest total size of annotation keys plus values.
pub(crate) const MAX_ANNOTATIONS_SIZE: usize = 256 * 1024;

const SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS1035_MSG: &str = "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')";
const QUALIFIED_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const CONFIG_KEY_MSG: &str = "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')";

pub(crate) fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

pub(crate) fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && !s.is_empty() && s.split('.').all(is_dns1123_label)
}

fn is_dns1035_label(s: &str) -> bool {
    is_dns1123_label(s) && s.as_bytes()[0].is_ascii_lowercase()
}

fn is_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// `prefix/name` or `name`, as label and annotation keys must be.
pub(crate) fn is_qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        Some((prefix, name)) => {
            is_dns1123_subdomain(prefix) && is_name_part(name) && !name.contains('/')
        }
        None => is_name_part(s),
    }
}

pub(crate) fn is_label_value(s: &str) -> bool {
    s.is_empty() || is_name_part(s)
}

fn is_config_key(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Checks a name against the kind's naming rule; `None` when valid.
pub(crate) fn check_name(rt: &ResourceType, name: &str) -> Option<Cause> {
    let (ok, msg) = match rt.kind {
        "Namespace" => (is_dns1123_label(name), LABEL_MSG),
        "Service" => (is_dns1035_label(name), DNS1035_MSG),
        _ => (is_dns1123_subdomain(name), SUBDOMAIN_MSG),
    };
    if ok {
        None
    } else {
        Some(Cause::invalid("metadata.name", &json!(name), msg))
    }
}

fn str_map<'a>(obj: &'a Value, pointer: &str) -> Option<&'a Map<String, Value>> {
    obj.pointer(pointer).and_then(Value::as_object)
}

/// Validates an object about to be stored. `old` is the stored object on updates.
pub(crate) fn validate(rt: &ResourceType, obj: &Value, old: Option<&Value>) -> Vec<Cause> {
    let mut errs = Vec::new();
    let name = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    if name.is_empty() {
        errs.push(Cause::required(
            "metadata.name",
            "name or generateName is required",
        ));
    } else if let Some(c) = check_name(rt, name) {
        errs.push(c);
    }
    validate_meta(obj, &mut errs);
    match rt.kind {
        "Node" => validate_taints(obj, &mut errs),
        "ConfigMap" => validate_config_map(obj, old, &mut errs),
        "Secret" => validate_secret(obj, old, &mut errs),
        "Pod" => validate_pod(obj, old, &mut errs),
        "Lease" => {
            if let Some(d) = obj.pointer("/spec/leaseDurationSeconds") {
                if d.as_i64().is_none_or(|d| d <= 0) {
                    errs.push(Cause::invalid(
                        "spec.leaseDurationSeconds",
                        d,
                        "must be greater than 0",
                    ));
                }
            }
        }
        _ => {}
    }
    errs
}

fn validate_meta(obj: &Value, errs: &mut Vec<Cause>) {
    if let Some(labels) = obj.pointer("/metadata/labels") {
        match labels.as_object() {
            Some(labels) => {
                for (k, v) in labels {
                    if !is_qualified_name(k) {
                        errs.push(Cause::invalid("metadata.labels", &json!(k), QUALIFIED_MSG));
                    }
                    match v.as_str() {
                        Some(s) if is_label_value(s) => {}
                        _ => errs.push(Cause::invalid("metadata.labels", v, LABEL_VALUE_MSG)),
                    }
                }
            }
            None if labels.is_null() => {}
            None => errs.push(Cause::invalid("metadata.labels", labels, "must be a map")),
        }
    }
    if let Some(ann) = str_map(obj, "/metadata/annotations") {
        let mut total = 0;
        for (k, v) in ann {
            if !is_qualified_name(&k.to_ascii_lowercase()) {
                errs.push(Cause::invalid(
                    "metadata.annotations",
                    &json!(k),
                    QUALIFIED_MSG,
                ));
            }
            total += k.len() + v.as_str().map_or(0, str::len);
            if !v.is_string() {
                errs.push(Cause::invalid(
                    format!("metadata.annotations[{k}]"),
                    v,
                    "must be a string",
                ));
            }
        }
        if total > MAX_ANNOTATIONS_SIZE {
            errs.push(Cause::too_long(
                "metadata.annotations",
                MAX_ANNOTATIONS_SIZE,
            ));
        }
    }
    if let Some(fins) = obj
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
    {
        for (i, f) in fins.iter().enumerate() {
            let ok = f.as_str().is_some_and(is_qualified_name);
            if !ok {
                errs.push(Cause::invalid(
                    format!("metadata.finalizers[{i}]"),
                    f,
                    QUALIFIED_MSG,
                ));
            }
        }
    }
    if let Some(refs) = obj
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
    {
        for (i, r) in refs.iter().enumerate() {
            for field in ["apiVersion", "kind", "name", "uid"] {
                if r.get(field)
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    errs.push(Cause::required(
                        format!("metadata.ownerReferences[{i}].{field}"),
                        "",
                    ));
                }
            }
        }
    }
}

fn validate_taints(obj: &Value, errs: &mut Vec<Cause>) {
    let Some(taints) = obj.pointer("/spec/taints") else {
        return;
    };
    let Some(taints) = taints.as_array() else {
        if !taints.is_null() {
            errs.push(Cause::invalid("spec.taints", taints, "must be a list"));
        }
        return;
    };
    let mut seen: Vec<(String, String)> = Vec::new();
    for (i, t) in taints.iter().enumerate() {
        let path = format!("spec.taints[{i}]");
        let key = t.get("key").and_then(Value::as_str).unwrap_or("");
        if key.is_empty() {
            errs.push(Cause::required(format!("{path}.key"), ""));
        } else if !is_qualified_name(key) {
            errs.push(Cause::invalid(
                format!("{path}.key"),
                &json!(key),
                QUALIFIED_MSG,
            ));
        }
        if let Some(v) = t.get("value") {
            if !v.as_str().is_some_and(is_label_value) {
                errs.push(Cause::invalid(format!("{path}.value"), v, LABEL_VALUE_MSG));
            }
        }
        let effect = t.get("effect").and_then(Value::as_str).unwrap_or("");
        const EFFECTS: [&str; 3] = ["NoSchedule", "PreferNoSchedule", "NoExecute"];
        if effect.is_empty() {
            errs.push(Cause::required(format!("{path}.effect"), ""));
        } else if !EFFECTS.contains(&effect) {
            errs.push(Cause::not_supported(
                format!("{path}.effect"),
                &json!(effect),
                &EFFECTS,
            ));
        }
        let pair = (key.to_string(), effect.to_string());
        if seen.contains(&pair) {
            let mut c = Cause::duplicate(path, t);
            c.message
                .push_str(": taints must be unique by key and effect pair");
            errs.push(c);
        } else {
            seen.push(pair);
        }
    }
}

/// Sum of key and value lengths of `data` (strings) and `binaryData` (base64, decoded).
fn data_size(obj: &Value, errs: &mut Vec<Cause>, string_data: bool) -> usize {
    let mut total = 0;
    if let Some(data) = str_map(obj, "/data") {
        for (k, v) in data {
            if !is_config_key(k) {
                errs.push(Cause::invalid(
                    format!("data[{k}]"),
                    &json!(k),
                    CONFIG_KEY_MSG,
                ));
            }
            total += k.len();
            let s = v.as_str().unwrap_or("");
            total += if string_data {
                s.len()
            } else {
                base64_decode(s).map(|b| b.len()).unwrap_or(s.len())
            };
        }
    }
    if let Some(data) = str_map(obj, "/binaryData") {
        for (k, v) in data {
            if !is_config_key(k) {
                errs.push(Cause::invalid(
                    format!("binaryData[{k}]"),
                    &json!(k),
                    CONFIG_KEY_MSG,
                ));
            }
            if str_map(obj, "/data").is_some_and(|d| d.contains_key(k)) {
                errs.push(Cause::invalid(
                    format!("data[{k}]"),
                    &json!(k),
                    "duplicate of key present in binaryData",
                ));
            }
            let s = v.as_str().unwrap_or("");
            total += k.len() + base64_decode(s).map(|b| b.len()).unwrap_or(s.len());
        }
    }
    total
}

fn check_immutable(obj: &Value, old: Option<&Value>, errs: &mut Vec<Cause>) {
    let Some(old) = old else { return };
    if old.get("immutable").and_then(Value::as_bool) != Some(true) {
        return;
    }
    if obj.get("immutable").and_then(Value::as_bool) != Some(true) {
        errs.push(Cause::forbidden(
            "immutable",
            "field is immutable when `immutable` is set",
        ));
    }
    for field in ["data", "binaryData"] {
        let a = old.get(field).filter(|v| !v.is_null());
        let b = obj.get(field).filter(|v| !v.is_null());
        let empty = |v: Option<&Value>| v.and_then(Value::as_object).is_none_or(Map::is_empty);
        if a != b && !(empty(a) && empty(b)) {
            errs.push(Cause::forbidden(
                field,
                "field is immutable when `immutable` is set",
            ));
        }
    }
}

fn validate_config_map(obj: &Value, old: Option<&Value>, errs: &mut Vec<Cause>) {
    let total = data_size(obj, errs, true);
    if total > MAX_CONFIG_SIZE {
        errs.push(Cause::too_long("[]", MAX_CONFIG_SIZE));
    }
    check_immutable(obj, old, errs);
}

fn validate_secret(obj: &Value, old: Option<&Value>, errs: &mut Vec<Cause>) {
    let total = data_size(obj, errs, false);
    if total > MAX_CONFIG_SIZE {
        errs.push(Cause::too_long("data", MAX_CONFIG_SIZE));
    }
    if let Some(old) = old {
        let t = |v: &Value| {
            v.get("type")
                .and_then(Value::as_str)
                .unwrap_or("Opaque")
                .to_string()
        };
        if t(old) != t(obj) {
            errs.push(Cause::invalid("type", &json!(t(obj)), "field is immutable"));
        }
    }
    check_immutable(obj, old, errs);
}

fn validate_pod(obj: &Value, old: Option<&Value>, errs: &mut Vec<Cause>) {
    let containers = obj.pointer("/spec/containers").and_then(Value::as_array);
    match containers {
        None => errs.push(Cause::required("spec.containers", "")),
        Some(cs) if cs.is_empty() => errs.push(Cause::required("spec.containers", "")),
        Some(cs) => {
            for (i, c) in cs.iter().enumerate() {
                let name = c.get("name").and_then(Value::as_str).unwrap_or("");
                if name.is_empty() {
                    errs.push(Cause::required(format!("spec.containers[{i}].name"), ""));
                } else if !is_dns1123_label(name) {
                    errs.push(Cause::invalid(
                        format!("spec.containers[{i}].name"),
                        &json!(name),
                        LABEL_MSG,
                    ));
                }
                if c.get("image")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    errs.push(Cause::required(format!("spec.containers[{i}].image"), ""));
                }
            }
        }
    }
    // Pod spec updates may only change images, activeDeadlineSeconds, tolerations
    // and terminationGracePeriodSeconds.
    if let Some(old) = old {
        let scrub = |v: &Value| {
            let mut spec = v.get("spec").cloned().unwrap_or(Value::Null);
            for list in ["containers", "initContainers"] {
                if let Some(cs) = spec.get_mut(list).and_then(Value::as_array_mut) {
                    for c in cs {
                        if let Some(o) = c.as_object_mut() {
                            o.remove("image");
                        }
                    }
                }
            }
            if let Some(o) = spec.as_object_mut() {
                for f in [
                    "activeDeadlineSeconds",
                    "tolerations",
                    "terminationGracePeriodSeconds",
                ] {
                    o.remove(f);
                }
            }
            spec
        };
        if scrub(old) != scrub(obj) {
            errs.push(Cause::forbidden(
                "spec",
                "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_dns1123_subdomain("node-1.example.com"));
        assert!(!is_dns1123_subdomain("Node-1"));
        assert!(!is_dns1123_subdomain("-a"));
        assert!(is_qualified_name("faultline.io/gpu-health"));
        assert!(is_qualified_name("Foo_bar"));
        assert!(!is_qualified_name("faultline.io/"));
        assert!(!is_qualified_name("a/b/c"));
        assert!(is_label_value(""));
        assert!(!is_label_value("a:b"));
        assert!(!is_label_value(&"a".repeat(64)));
    }

    #[test]
    fn duplicate_taints() {
        let rt = &crate::resources::RESOURCES[1];
        let node = json!({"metadata": {"name": "n"}, "spec": {"taints": [
            {"key": "a", "effect": "NoSchedule"},
            {"key": "a", "effect": "NoSchedule", "value": "x"},
            {"key": "b", "effect": "Bogus"},
        ]}});
        let errs = validate(rt, &node, None);
        assert_eq!(errs.len(), 2, "{errs:?}");
    }
}
