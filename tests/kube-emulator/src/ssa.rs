//! Field ownership (`metadata.managedFields`) and server-side apply.
//!
//! Ownership is tracked per leaf. A leaf is a scalar, an empty map, an atomic
//! list, one element of a set list (`v:<value>`), or a field inside an element of
//! an associative list (`k:{"type":"Ready"}`); maps are recursed. This is a
//! simplified structured-merge-diff: no per-type schemas beyond
//! [`crate::schema`], no defaulting, no version conversion.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Map, Value};

use crate::schema::{list_type, ListType};

/// A path of `f:`/`k:`/`v:` segments, as in `fieldsV1`.
pub(crate) type FieldPath = Vec<String>;

/// Apply or Update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operation {
    Apply,
    Update,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Apply => "Apply",
            Operation::Update => "Update",
        }
    }
}

/// One `managedFields` entry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub manager: String,
    pub operation: Operation,
    pub subresource: String,
    pub api_version: String,
    pub time: String,
    pub fields: BTreeSet<FieldPath>,
}

impl Entry {
    fn is(&self, manager: &str, op: Operation, subresource: &str) -> bool {
        self.manager == manager && self.operation == op && self.subresource == subresource
    }

    /// How a conflict names this manager: `"m"` for appliers, `"m" using v1` for updaters.
    fn describe(&self) -> String {
        match self.operation {
            Operation::Apply => format!("\"{}\"", self.manager),
            Operation::Update => format!("\"{}\" using {}", self.manager, self.api_version),
        }
    }
}

/// All ownership entries of one object, in `managedFields` order.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Managed(pub Vec<Entry>);

/// Top-level and metadata fields that are never tracked.
fn ignored(top: &str, path_len: usize, key: &str) -> bool {
    if path_len == 0 {
        return key == "apiVersion" || key == "kind";
    }
    top == "metadata"
        && path_len == 1
        && matches!(
            key,
            "name"
                | "namespace"
                | "resourceVersion"
                | "managedFields"
                | "uid"
                | "creationTimestamp"
                | "generation"
                | "deletionTimestamp"
                | "deletionGracePeriodSeconds"
                | "selfLink"
        )
}

/// Every leaf of `obj` with its value.
pub(crate) fn leaves(kind: &str, obj: &Value) -> BTreeMap<FieldPath, Value> {
    let mut out = BTreeMap::new();
    if let Some(m) = obj.as_object() {
        let mut names = Vec::new();
        let mut path = Vec::new();
        walk_map(kind, m, &mut names, &mut path, &mut out);
    }
    out
}

fn walk_map(
    kind: &str,
    m: &Map<String, Value>,
    names: &mut Vec<String>,
    path: &mut FieldPath,
    out: &mut BTreeMap<FieldPath, Value>,
) {
    let top = names.first().cloned().unwrap_or_default();
    for (k, v) in m {
        if ignored(&top, names.len(), k) {
            continue;
        }
        names.push(k.clone());
        path.push(format!("f:{k}"));
        walk_value(kind, v, names, path, out);
        path.pop();
        names.pop();
    }
}

/// `k:{"a":"x","b":1}` for an element of an associative list; `None` if it lacks
/// every key field.
pub(crate) fn key_segment(keys: &[&str], elem: &Value) -> Option<String> {
    let obj = elem.as_object()?;
    let mut parts: Vec<(&str, &Value)> = keys
        .iter()
        .filter_map(|k| obj.get(*k).map(|v| (*k, v)))
        .collect();
    if parts.is_empty() || obj.get(keys[0]).is_none() {
        return None;
    }
    parts.sort_by(|a, b| a.0.cmp(b.0));
    let rendered: Vec<String> = parts
        .iter()
        .map(|(k, v)| format!("{}:{}", json!(k), v))
        .collect();
    Some(format!("k:{{{}}}", rendered.join(",")))
}

fn walk_value(
    kind: &str,
    v: &Value,
    names: &mut Vec<String>,
    path: &mut FieldPath,
    out: &mut BTreeMap<FieldPath, Value>,
) {
    match v {
        Value::Object(m) if !m.is_empty() => walk_map(kind, m, names, path, out),
        Value::Array(items) if !items.is_empty() => match list_type(kind, names) {
            ListType::Atomic => {
                out.insert(path.clone(), v.clone());
            }
            ListType::Set => {
                for item in items {
                    path.push(format!("v:{item}"));
                    out.insert(path.clone(), item.clone());
                    path.pop();
                }
            }
            ListType::Map(keys) => {
                let segs: Option<Vec<String>> =
                    items.iter().map(|i| key_segment(keys, i)).collect();
                let Some(segs) = segs else {
                    out.insert(path.clone(), v.clone());
                    return;
                };
                for (item, seg) in items.iter().zip(segs) {
                    path.push(seg);
                    if let Some(m) = item.as_object() {
                        walk_map(kind, m, names, path, out);
                    }
                    path.pop();
                }
            }
        },
        other => {
            out.insert(path.clone(), other.clone());
        }
    }
}

/// Human-readable path for conflict messages: `.metadata.labels.x`,
/// `.status.conditions[type="Ready"].status`, `.metadata.finalizers[="f"]`.
pub(crate) fn display_path(p: &FieldPath) -> String {
    let mut s = String::new();
    for seg in p {
        if let Some(f) = seg.strip_prefix("f:") {
            s.push('.');
            s.push_str(f);
        } else if let Some(k) = seg.strip_prefix("k:") {
            let parsed: Map<String, Value> = serde_json::from_str(k).unwrap_or_default();
            let parts: Vec<String> = parsed.iter().map(|(k, v)| format!("{k}={v}")).collect();
            s.push_str(&format!("[{}]", parts.join(",")));
        } else if let Some(v) = seg.strip_prefix("v:") {
            s.push_str(&format!("[={v}]"));
        }
    }
    s
}

/// Who writes: field manager, subresource ("" or "status"), the apiVersion
/// used, and the time to stamp.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Actor<'a> {
    pub manager: &'a str,
    pub subresource: &'a str,
    pub api_version: &'a str,
    pub now: &'a str,
}

/// Records a non-apply write: leaves that changed move to the writer.
pub(crate) fn record_update(
    managed: &mut Managed,
    kind: &str,
    old: Option<&Value>,
    new: &Value,
    actor: Actor<'_>,
) {
    let old_leaves = old.map(|o| leaves(kind, o)).unwrap_or_default();
    let new_leaves = leaves(kind, new);
    let changed: BTreeSet<FieldPath> = new_leaves
        .iter()
        .filter(|(p, v)| old_leaves.get(*p) != Some(*v))
        .map(|(p, _)| p.clone())
        .collect();
    record_changed(managed, &changed, actor);
    prune(managed, &new_leaves);
}

/// Gives `changed` leaves to one Update manager, taking them from every other entry.
pub(crate) fn record_changed(
    managed: &mut Managed,
    changed: &BTreeSet<FieldPath>,
    actor: Actor<'_>,
) {
    if changed.is_empty() {
        return;
    }
    let (manager, subresource) = (actor.manager, actor.subresource);
    for e in &mut managed.0 {
        if !e.is(manager, Operation::Update, subresource) {
            e.fields.retain(|p| !changed.contains(p));
        }
    }
    match managed
        .0
        .iter_mut()
        .find(|e| e.is(manager, Operation::Update, subresource))
    {
        Some(e) => {
            e.fields.extend(changed.iter().cloned());
            e.time = actor.now.to_string();
            e.api_version = actor.api_version.to_string();
        }
        None => managed.0.push(Entry {
            manager: manager.to_string(),
            operation: Operation::Update,
            subresource: subresource.to_string(),
            api_version: actor.api_version.to_string(),
            time: actor.now.to_string(),
            fields: changed.clone(),
        }),
    }
}

/// Drops ownership of leaves the object no longer has, and empty entries.
pub(crate) fn prune(managed: &mut Managed, present: &BTreeMap<FieldPath, Value>) {
    for e in &mut managed.0 {
        e.fields.retain(|p| present.contains_key(p));
    }
    managed.0.retain(|e| !e.fields.is_empty());
}

/// A server-side apply conflict: (manager description, field path).
pub(crate) type Conflict = (String, String);

/// Server-side apply of `applied` onto `current` by `actor`.
pub(crate) fn apply(
    kind: &str,
    managed: &Managed,
    current: &Value,
    applied: &Value,
    actor: Actor<'_>,
    force: bool,
) -> Result<(Value, Managed), Vec<Conflict>> {
    let Actor {
        manager,
        subresource,
        api_version,
        now,
    } = actor;
    let cur_leaves = leaves(kind, current);
    let app_leaves = leaves(kind, applied);
    let mut managed = managed.clone();

    let mut conflicts: Vec<(usize, FieldPath)> = Vec::new();
    for (p, v) in &app_leaves {
        if cur_leaves.get(p) == Some(v) {
            continue;
        }
        for (i, e) in managed.0.iter().enumerate() {
            if !e.is(manager, Operation::Apply, subresource) && e.fields.contains(p) {
                conflicts.push((i, p.clone()));
            }
        }
    }
    if !conflicts.is_empty() {
        if !force {
            return Err(conflicts
                .iter()
                .map(|(i, p)| (managed.0[*i].describe(), display_path(p)))
                .collect());
        }
        for (i, p) in &conflicts {
            managed.0[*i].fields.remove(p);
        }
    }

    let mut obj = current.clone();
    let mut names = Vec::new();
    merge_applied(kind, &mut names, &mut obj, applied);

    let previous: BTreeSet<FieldPath> = managed
        .0
        .iter()
        .find(|e| e.is(manager, Operation::Apply, subresource))
        .map(|e| e.fields.clone())
        .unwrap_or_default();
    for p in previous.iter().filter(|p| !app_leaves.contains_key(*p)) {
        let owned_by_other = managed
            .0
            .iter()
            .any(|e| !e.is(manager, Operation::Apply, subresource) && e.fields.contains(p));
        if !owned_by_other {
            remove_path(&mut obj, p, 0);
        }
    }

    let mine: BTreeSet<FieldPath> = app_leaves.keys().cloned().collect();
    match managed
        .0
        .iter_mut()
        .find(|e| e.is(manager, Operation::Apply, subresource))
    {
        Some(e) => {
            if e.fields != mine {
                e.time = now.to_string();
            }
            e.fields = mine;
            e.api_version = api_version.to_string();
        }
        None => managed.0.push(Entry {
            manager: manager.to_string(),
            operation: Operation::Apply,
            subresource: subresource.to_string(),
            api_version: api_version.to_string(),
            time: now.to_string(),
            fields: mine,
        }),
    }
    let final_leaves = leaves(kind, &obj);
    prune(&mut managed, &final_leaves);
    Ok((obj, managed))
}

/// Merges an applied configuration into the live object.
fn merge_applied(kind: &str, names: &mut Vec<String>, cur: &mut Value, applied: &Value) {
    let (Some(cm), Some(am)) = (cur.as_object_mut(), applied.as_object()) else {
        *cur = applied.clone();
        return;
    };
    for (k, av) in am {
        names.push(k.clone());
        match av {
            Value::Object(a) if a.is_empty() => {
                if !cm.get(k).is_some_and(Value::is_object) {
                    cm.insert(k.clone(), av.clone());
                }
            }
            Value::Object(_) => match cm.get_mut(k) {
                Some(c) if c.is_object() => merge_applied(kind, names, c, av),
                _ => {
                    cm.insert(k.clone(), av.clone());
                }
            },
            Value::Array(items) => match list_type(kind, names) {
                ListType::Atomic => {
                    cm.insert(k.clone(), av.clone());
                }
                ListType::Set => {
                    let mut list = cm
                        .get(k)
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default();
                    for i in items {
                        if !list.contains(i) {
                            list.push(i.clone());
                        }
                    }
                    cm.insert(k.clone(), Value::Array(list));
                }
                ListType::Map(keys) => {
                    let mut list = cm
                        .get(k)
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default();
                    for i in items {
                        let seg = key_segment(keys, i);
                        let pos = seg.as_ref().and_then(|s| {
                            list.iter()
                                .position(|e| key_segment(keys, e).as_ref() == Some(s))
                        });
                        match pos {
                            Some(p) => merge_applied(kind, names, &mut list[p], i),
                            None => list.push(i.clone()),
                        }
                    }
                    cm.insert(k.clone(), Value::Array(list));
                }
            },
            other => {
                cm.insert(k.clone(), other.clone());
            }
        }
        names.pop();
    }
}

fn is_empty_container(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

fn element_matches(elem: &Value, key: &Map<String, Value>) -> bool {
    key.iter().all(|(k, v)| elem.get(k) == Some(v))
}

/// Removes the leaf at `path`, then containers that became empty because of it
/// (top-level fields are kept).
pub(crate) fn remove_path(v: &mut Value, path: &[String], depth: usize) {
    let Some((seg, rest)) = path.split_first() else {
        return;
    };
    if let Some(name) = seg.strip_prefix("f:") {
        let Some(map) = v.as_object_mut() else {
            return;
        };
        if rest.is_empty() {
            map.remove(name);
            return;
        }
        if let Some(child) = map.get_mut(name) {
            let was_empty = is_empty_container(child);
            remove_path(child, rest, depth + 1);
            if !was_empty && is_empty_container(child) && depth >= 1 {
                map.remove(name);
            }
        }
    } else if let Some(k) = seg.strip_prefix("k:") {
        let Some(arr) = v.as_array_mut() else {
            return;
        };
        let key: Map<String, Value> = serde_json::from_str(k).unwrap_or_default();
        let Some(idx) = arr.iter().position(|e| element_matches(e, &key)) else {
            return;
        };
        if rest.is_empty() {
            arr.remove(idx);
            return;
        }
        remove_path(&mut arr[idx], rest, depth + 1);
        if !element_matches(&arr[idx], &key) || is_empty_container(&arr[idx]) {
            arr.remove(idx);
        }
    } else if let Some(j) = seg.strip_prefix("v:") {
        let Some(arr) = v.as_array_mut() else {
            return;
        };
        if let Ok(val) = serde_json::from_str::<Value>(j) {
            if let Some(idx) = arr.iter().position(|e| *e == val) {
                arr.remove(idx);
            }
        }
    }
}

/// Renders `metadata.managedFields`.
pub(crate) fn render(managed: &Managed) -> Value {
    Value::Array(
        managed
            .0
            .iter()
            .map(|e| {
                let mut fields = Map::new();
                for p in &e.fields {
                    insert_fields(&mut fields, p);
                }
                let mut entry = json!({
                    "manager": e.manager,
                    "operation": e.operation.as_str(),
                    "apiVersion": e.api_version,
                    "time": e.time,
                    "fieldsType": "FieldsV1",
                    "fieldsV1": fields,
                });
                if !e.subresource.is_empty() {
                    if let Some(o) = entry.as_object_mut() {
                        o.insert("subresource".into(), json!(e.subresource));
                    }
                }
                entry
            })
            .collect(),
    )
}

fn insert_fields(m: &mut Map<String, Value>, path: &[String]) {
    let Some((seg, rest)) = path.split_first() else {
        return;
    };
    let child = m
        .entry(seg.clone())
        .or_insert_with(|| Value::Object(Map::new()));
    if let Some(cm) = child.as_object_mut() {
        if seg.starts_with("k:") {
            cm.entry(".").or_insert_with(|| Value::Object(Map::new()));
        }
        insert_fields(cm, rest);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn actor(manager: &str) -> Actor<'_> {
        Actor {
            manager,
            subresource: "",
            api_version: "v1",
            now: "t",
        }
    }

    fn status_actor(manager: &str) -> Actor<'_> {
        Actor {
            manager,
            subresource: "status",
            api_version: "v1",
            now: "t",
        }
    }

    fn applied(labels: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": labels}})
    }

    #[test]
    fn two_appliers_share_and_release() {
        let empty = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        let m = Managed::default();
        let (o, m) = apply(
            "ConfigMap",
            &m,
            &empty,
            &applied(json!({"a": "1", "b": "1"})),
            actor("one"),
            false,
        )
        .unwrap();
        let (o, m) = apply(
            "ConfigMap",
            &m,
            &o,
            &applied(json!({"b": "1", "c": "2"})),
            actor("two"),
            false,
        )
        .unwrap();
        assert_eq!(
            o["metadata"]["labels"],
            json!({"a": "1", "b": "1", "c": "2"})
        );
        // one drops b (still owned by two) and a (nobody else): a disappears.
        let (o, m) = apply(
            "ConfigMap",
            &m,
            &o,
            &applied(json!({})),
            actor("one"),
            false,
        )
        .unwrap();
        assert_eq!(o["metadata"]["labels"], json!({"b": "1", "c": "2"}));
        // one wants c=3: conflict with two.
        let err = apply(
            "ConfigMap",
            &m,
            &o,
            &applied(json!({"c": "3"})),
            actor("one"),
            false,
        )
        .unwrap_err();
        assert_eq!(
            err,
            vec![("\"two\"".to_string(), ".metadata.labels.c".to_string())]
        );
        let (o, m) = apply(
            "ConfigMap",
            &m,
            &o,
            &applied(json!({"c": "3"})),
            actor("one"),
            true,
        )
        .unwrap();
        assert_eq!(o["metadata"]["labels"]["c"], "3");
        let rendered = render(&m);
        let two = rendered
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["manager"] == "two")
            .unwrap();
        assert_eq!(
            two["fieldsV1"],
            json!({"f:metadata": {"f:labels": {"f:b": {}}}})
        );
    }

    #[test]
    fn conditions_tracked_per_element() {
        let node = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
        let mut m = Managed::default();
        record_update(&mut m, "Node", None, &node, status_actor("kubelet"));
        let mine = json!({"status": {"conditions": [{"type": "GpuOk", "status": "False"}]}});
        let (o, m) = apply("Node", &m, &node, &mine, status_actor("agent"), false).unwrap();
        assert_eq!(o["status"]["conditions"].as_array().unwrap().len(), 2);
        let (o, _) = apply(
            "Node",
            &m,
            &o,
            &json!({"status": {}}),
            status_actor("agent"),
            false,
        )
        .unwrap();
        assert_eq!(
            o["status"]["conditions"],
            json!([{"type": "Ready", "status": "True"}])
        );
    }
}
