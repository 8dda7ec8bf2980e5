//! The three non-apply patch types: RFC 7396 merge patch and RFC 6902 JSON
//! patch (both from the `json-patch` crate) and Kubernetes strategic merge
//! patch (implemented here on top of [`crate::schema`]).

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::schema::{list_type, ListType};

/// RFC 7396.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    json_patch::merge(target, patch);
}

/// RFC 6902. Malformed documents are 400, failed operations (including a
/// failing `test`) are 422, as the apiserver answers.
pub(crate) fn json_patch(target: &mut Value, body: &[u8]) -> Result<(), ApiError> {
    let ops: json_patch::Patch = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    json_patch::patch(target, &ops).map_err(|e| ApiError::unprocessable(e.to_string()))
}

/// Kubernetes strategic merge patch. Errors are messages for a 400/422 answer.
pub(crate) fn strategic_merge_patch(
    kind: &str,
    target: &mut Value,
    patch: &Value,
) -> Result<(), String> {
    let Some(p) = patch.as_object() else {
        return Err("strategic merge patch must be a JSON object".into());
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let mut names = Vec::new();
    if let Some(t) = target.as_object_mut() {
        merge_map(kind, &mut names, t, p)?;
    }
    Ok(())
}

fn directive(v: &Value) -> Option<&str> {
    v.get("$patch").and_then(Value::as_str)
}

/// A fresh value from a patch fragment, with directives processed against nothing.
fn fresh(kind: &str, names: &mut Vec<String>, v: &Value) -> Result<Value, String> {
    match v {
        Value::Object(m) => {
            let mut out = Map::new();
            merge_map(kind, names, &mut out, m)?;
            Ok(Value::Object(out))
        }
        Value::Array(items) => {
            let mut out = Vec::new();
            for item in items {
                if directive(item).is_some() {
                    continue;
                }
                out.push(fresh(kind, names, item)?);
            }
            Ok(Value::Array(out))
        }
        other => Ok(other.clone()),
    }
}

fn merge_map(
    kind: &str,
    names: &mut Vec<String>,
    target: &mut Map<String, Value>,
    patch: &Map<String, Value>,
) -> Result<(), String> {
    match patch.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            let mut stripped = patch.clone();
            stripped.remove("$patch");
            target.clear();
            return merge_map(kind, names, target, &stripped);
        }
        Some("delete") => {
            target.clear();
            return Ok(());
        }
        Some("merge") | None => {}
        Some(other) => return Err(format!("Unknown patch type: {other}")),
    }
    for (k, pv) in patch {
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            let remove = pv.as_array().cloned().unwrap_or_default();
            if let Some(list) = target.get_mut(field).and_then(Value::as_array_mut) {
                list.retain(|e| !remove.contains(e));
            }
            continue;
        }
        if k.starts_with("$setElementOrder/") || k == "$patch" || k == "$retainKeys" {
            continue;
        }
        if k.starts_with('$') {
            return Err(format!("unknown strategic merge patch directive {k}"));
        }
        names.push(k.clone());
        let res = merge_field(kind, names, target, k, pv);
        names.pop();
        res?;
    }
    if let Some(keep) = patch.get("$retainKeys").and_then(Value::as_array) {
        let keep: Vec<&str> = keep.iter().filter_map(Value::as_str).collect();
        target.retain(|k, _| keep.contains(&k.as_str()));
    }
    Ok(())
}

fn merge_field(
    kind: &str,
    names: &mut Vec<String>,
    target: &mut Map<String, Value>,
    k: &str,
    pv: &Value,
) -> Result<(), String> {
    match pv {
        Value::Null => {
            target.remove(k);
        }
        Value::Object(pm) => match directive(pv) {
            Some("delete") => {
                target.remove(k);
            }
            _ => match target.get_mut(k).and_then(Value::as_object_mut) {
                Some(tm) => merge_map(kind, names, tm, pm)?,
                None => {
                    let v = fresh(kind, names, pv)?;
                    target.insert(k.to_string(), v);
                }
            },
        },
        Value::Array(items) => match list_type(kind, names) {
            ListType::Atomic => {
                let v = fresh(kind, names, pv)?;
                target.insert(k.to_string(), v);
            }
            ListType::Set => {
                let mut list = target
                    .get(k)
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                if items.iter().any(|i| directive(i) == Some("replace")) {
                    list = items
                        .iter()
                        .filter(|i| directive(i).is_none())
                        .cloned()
                        .collect();
                } else {
                    for item in items {
                        if !list.contains(item) {
                            list.push(item.clone());
                        }
                    }
                }
                target.insert(k.to_string(), Value::Array(list));
            }
            ListType::Map(keys) => {
                let key = keys[0];
                let mut list = target
                    .get(k)
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                merge_keyed_list(kind, names, &mut list, items, key)?;
                target.insert(k.to_string(), Value::Array(list));
            }
        },
        scalar => {
            target.insert(k.to_string(), scalar.clone());
        }
    }
    Ok(())
}

fn merge_keyed_list(
    kind: &str,
    names: &mut Vec<String>,
    list: &mut Vec<Value>,
    items: &[Value],
    key: &str,
) -> Result<(), String> {
    if items.iter().any(|i| directive(i) == Some("replace")) {
        let mut out = Vec::new();
        for i in items.iter().filter(|i| directive(i).is_none()) {
            out.push(fresh(kind, names, i)?);
        }
        *list = out;
        return Ok(());
    }
    for item in items {
        let Some(obj) = item.as_object() else {
            return Err(format!(
                "invalid patch: list element {item} is not an object, merge key {key} expected"
            ));
        };
        let Some(kv) = obj.get(key) else {
            return Err(format!(
                "map: {item} does not contain declared merge key: {key}"
            ));
        };
        let pos = list.iter().position(|e| e.get(key) == Some(kv));
        match directive(item) {
            Some("delete") => {
                list.retain(|e| e.get(key) != Some(kv));
            }
            _ => match pos {
                Some(i) => {
                    if let Some(tm) = list[i].as_object_mut() {
                        merge_map(kind, names, tm, obj)?;
                    }
                }
                None => list.push(fresh(kind, names, item)?),
            },
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn smp_merges_conditions_and_replaces_taints() {
        let mut node = json!({
            "metadata": {"name": "n", "labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
            "spec": {"taints": [{"key": "k1", "effect": "NoSchedule"}]},
            "status": {"conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "MemoryPressure", "status": "False"}
            ]}
        });
        let patch = json!({
            "metadata": {"labels": {"a": null, "c": "3"}, "finalizers": ["y"]},
            "spec": {"taints": [{"key": "k2", "effect": "NoExecute"}]},
            "status": {"conditions": [
                {"type": "GpuHealthy", "status": "False"},
                {"type": "Ready", "status": "False", "reason": "X"},
                {"type": "MemoryPressure", "$patch": "delete"}
            ]}
        });
        strategic_merge_patch("Node", &mut node, &patch).unwrap();
        assert_eq!(node["metadata"]["labels"], json!({"b": "2", "c": "3"}));
        assert_eq!(node["metadata"]["finalizers"], json!(["x", "y"]));
        assert_eq!(
            node["spec"]["taints"],
            json!([{"key": "k2", "effect": "NoExecute"}])
        );
        assert_eq!(
            node["status"]["conditions"],
            json!([
                {"type": "Ready", "status": "False", "reason": "X"},
                {"type": "GpuHealthy", "status": "False"}
            ])
        );
    }

    #[test]
    fn smp_directives() {
        let mut o =
            json!({"metadata": {"finalizers": ["a", "b"]}, "spec": {"x": {"y": 1, "z": 2}}});
        let p = json!({
            "metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]},
            "spec": {"x": {"$patch": "replace", "w": 3}}
        });
        strategic_merge_patch("ConfigMap", &mut o, &p).unwrap();
        assert_eq!(o["metadata"]["finalizers"], json!(["b"]));
        assert_eq!(o["spec"]["x"], json!({"w": 3}));
        let bad = json!({"status": {"conditions": [{"status": "True"}]}});
        assert!(strategic_merge_patch("Node", &mut o, &bad).is_err());
    }

    #[test]
    fn json_patch_test_failure_is_422() {
        let mut o = json!({"a": 1});
        let err = json_patch(&mut o, br#"[{"op":"test","path":"/a","value":2}]"#).unwrap_err();
        assert_eq!(err.code, 422);
        let err = json_patch(&mut o, b"{").unwrap_err();
        assert_eq!(err.code, 400);
        json_patch(&mut o, br#"[{"op":"replace","path":"/a","value":2}]"#).unwrap();
        assert_eq!(o, json!({"a": 2}));
    }
}
