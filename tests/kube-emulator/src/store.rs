//! The object store: objects as JSON, one global resourceVersion counter, a
//! bounded change history for watches, and the write paths (create, replace,
//! patch, apply, delete) with the apiserver's preconditions and rules.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use serde_json::{json, Map, Value};
use tokio::sync::watch;

use crate::error::{ApiError, Cause};
use crate::patch;
use crate::resources::{self, ResourceId, ResourceType, NAMESPACES};
use crate::selectors::{FieldSelector, LabelSelector};
use crate::ssa::{self, Actor, Managed};
use crate::util::{base64_encode, name_suffix, new_uid, now_rfc3339};
use crate::validation;

/// Changes kept for watch resumption by default.
pub(crate) const DEFAULT_HISTORY: usize = 10_000;

/// Store key: resource, namespace ("" for cluster-scoped), name.
pub(crate) type Key = (ResourceId, String, String);

/// A stored object and its field ownership.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub obj: Arc<Value>,
    pub managed: Managed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeType {
    Added,
    Modified,
    Deleted,
}

/// One entry of the change history.
#[derive(Debug)]
pub(crate) struct Change {
    pub rv: u64,
    pub rid: ResourceId,
    pub ns: String,
    pub ctype: ChangeType,
    pub obj: Arc<Value>,
    pub prev: Option<Arc<Value>>,
}

/// The kind of a PATCH request, from its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchType {
    Merge,
    Json,
    Strategic,
    Apply,
}

impl PatchType {
    pub fn from_content_type(ct: &str) -> Option<PatchType> {
        let base = ct.split(';').next().unwrap_or("").trim();
        match base {
            "application/merge-patch+json" => Some(PatchType::Merge),
            "application/json-patch+json" => Some(PatchType::Json),
            "application/strategic-merge-patch+json" => Some(PatchType::Strategic),
            "application/apply-patch+yaml" => Some(PatchType::Apply),
            _ => None,
        }
    }
}

/// Per-request write options.
#[derive(Debug, Clone, Default)]
pub(crate) struct WriteOpts {
    /// Resolved field manager (query `fieldManager`, else user-agent prefix, else "unknown").
    pub manager: String,
    /// Whether `fieldManager` was given explicitly (apply requires it).
    pub explicit_manager: bool,
    /// `force` was present in the query, and its value.
    pub force: Option<bool>,
    pub dry_run: bool,
}

enum Ownership {
    /// A non-apply write by this manager on this subresource ("" or "status").
    Update {
        manager: String,
        subresource: String,
    },
    /// Ownership already computed (server-side apply).
    Computed(Managed),
}

/// The whole cluster state.
#[derive(Debug)]
pub(crate) struct Store {
    objects: BTreeMap<Key, Stored>,
    rv: u64,
    history: VecDeque<Arc<Change>>,
    dropped_upto: u64,
    history_limit: usize,
    notify: watch::Sender<u64>,
    /// Watchers that pin one object (`fieldSelector=metadata.name=x` in a namespace, or of a
    /// cluster-scoped resource) wait on that object's own channel, so a change wakes only
    /// the watchers it can concern. A real server's watch cache dispatches an event only to
    /// the watchers indexed under its trigger value (k8s.io/apiserver
    /// pkg/storage/cacher/cacher.go: `indexedTrigger`, `watchers indexedWatchers`); waking
    /// all of them, 2,000 agents each watching their own Node and ConfigMap made every write
    /// cost 4,000 wake-ups and a lock each.
    named: HashMap<(ResourceId, String, String), watch::Sender<u64>>,
    /// Sent every `history_limit / 2` changes: a named watcher wakes then too, so the
    /// history it scans on waking never outgrows what is kept (no spurious 410 Gone).
    epoch: watch::Sender<u64>,
}

fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> &'a str {
    meta(obj)
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn meta_mut(obj: &mut Value) -> Result<&mut Map<String, Value>, ApiError> {
    let o = obj
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("the body of the request must be a JSON object"))?;
    let m = o
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if m.is_null() {
        *m = Value::Object(Map::new());
    }
    m.as_object_mut()
        .ok_or_else(|| ApiError::bad_request("metadata must be an object"))
}

fn set_meta(obj: &mut Value, field: &str, v: Value) {
    if let Ok(m) = meta_mut(obj) {
        m.insert(field.to_string(), v);
    }
}

fn copy_meta(from: &Value, to: &mut Value, field: &str) {
    let v = meta(from).and_then(|m| m.get(field)).cloned();
    if let Ok(m) = meta_mut(to) {
        match v {
            Some(v) => {
                m.insert(field.to_string(), v);
            }
            None => {
                m.remove(field);
            }
        }
    }
}

/// Sets apiVersion/kind, rejecting a body written for another type.
fn check_type_meta(rt: &ResourceType, obj: &mut Value) -> Result<(), ApiError> {
    let o = obj
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("the body of the request must be a JSON object"))?;
    let av = rt.api_version();
    match o.get("apiVersion").and_then(Value::as_str) {
        Some(a) if !a.is_empty() && a != av => {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({a}) does not match the expected API version ({av})"
            )))
        }
        _ => {}
    }
    match o.get("kind").and_then(Value::as_str) {
        Some(k) if !k.is_empty() && k != rt.kind => {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                rt.kind
            )))
        }
        _ => {}
    }
    o.insert("apiVersion".into(), json!(av));
    o.insert("kind".into(), json!(rt.kind));
    Ok(())
}

/// Fields outside metadata and status changed (drives `metadata.generation`).
fn spec_changed(old: &Value, new: &Value) -> bool {
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(o) = v.as_object_mut() {
            for f in ["metadata", "status", "apiVersion", "kind"] {
                o.remove(f);
            }
        }
        v
    };
    strip(old) != strip(new)
}

fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, v| !v.is_null());
            for v in m.values_mut() {
                strip_nulls(v);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

fn pod_qos(spec: &Value) -> &'static str {
    let containers = spec
        .get("containers")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut any = false;
    let mut all_guaranteed = !containers.is_empty();
    for c in &containers {
        let req = c.pointer("/resources/requests").and_then(Value::as_object);
        let lim = c.pointer("/resources/limits").and_then(Value::as_object);
        if req.is_some_and(|r| !r.is_empty()) || lim.is_some_and(|l| !l.is_empty()) {
            any = true;
        }
        let guaranteed = lim.is_some_and(|l| {
            ["cpu", "memory"].iter().all(|r| {
                l.contains_key(*r)
                    && req.is_none_or(|q| q.get(*r).is_none_or(|v| Some(v) == l.get(*r)))
            })
        });
        all_guaranteed &= guaranteed;
    }
    if !any {
        "BestEffort"
    } else if all_guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

/// Folds `stringData` into `data` as the Secret strategy does.
fn fold_string_data(obj: &mut Value) {
    let Some(o) = obj.as_object_mut() else { return };
    if let Some(Value::Object(sd)) = o.remove("stringData") {
        let data = o.entry("data").or_insert_with(|| Value::Object(Map::new()));
        if !data.is_object() {
            *data = Value::Object(Map::new());
        }
        if let Some(d) = data.as_object_mut() {
            for (k, v) in sd {
                let s = v.as_str().unwrap_or("").to_string();
                d.insert(k, json!(base64_encode(s.as_bytes())));
            }
        }
    }
    o.entry("type").or_insert_with(|| json!("Opaque"));
}

impl Store {
    pub fn new() -> Self {
        let (notify, _) = watch::channel(0);
        let (epoch, _) = watch::channel(0);
        Store {
            objects: BTreeMap::new(),
            rv: 0,
            history: VecDeque::new(),
            dropped_upto: 0,
            history_limit: DEFAULT_HISTORY,
            notify,
            named: HashMap::new(),
            epoch,
        }
    }

    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    pub fn set_history_limit(&mut self, n: usize) {
        self.history_limit = n.max(1);
        self.trim_history();
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.notify.subscribe()
    }

    /// The channel of one object (`ns` empty for a cluster-scoped resource), and the epoch
    /// channel a named watcher also waits on.
    pub fn subscribe_named(
        &mut self,
        rid: ResourceId,
        ns: &str,
        name: &str,
    ) -> (watch::Receiver<u64>, watch::Receiver<u64>) {
        let ns = if resources::get(rid).namespaced {
            ns
        } else {
            ""
        };
        let tx = self
            .named
            .entry((rid, ns.to_string(), name.to_string()))
            .or_insert_with(|| watch::channel(0).0);
        (tx.subscribe(), self.epoch.subscribe())
    }

    fn key(rid: ResourceId, ns: &str, name: &str) -> Key {
        let ns = if resources::get(rid).namespaced {
            ns
        } else {
            ""
        };
        (rid, ns.to_string(), name.to_string())
    }

    pub fn get(&self, rid: ResourceId, ns: &str, name: &str) -> Option<&Stored> {
        self.objects.get(&Self::key(rid, ns, name))
    }

    pub fn namespace_exists(&self, ns: &str) -> bool {
        self.objects
            .contains_key(&(NAMESPACES, String::new(), ns.to_string()))
    }

    /// Objects of a resource, optionally in one namespace, that match the selectors.
    pub fn list(
        &self,
        rid: ResourceId,
        ns: Option<&str>,
        label: &LabelSelector,
        field: &FieldSelector,
    ) -> Vec<Arc<Value>> {
        let start = (rid, ns.unwrap_or("").to_string(), String::new());
        self.objects
            .range(start..)
            .take_while(|(k, _)| k.0 == rid && ns.is_none_or(|n| k.1 == n))
            .filter(|(_, s)| label.matches(&s.obj) && field.matches(&s.obj))
            .map(|(_, s)| s.obj.clone())
            .collect()
    }

    /// History entries after `rv`; `Err(oldest)` when they are no longer kept.
    pub fn changes_since(&self, rv: u64) -> Result<Vec<Arc<Change>>, u64> {
        if rv < self.dropped_upto {
            return Err(self.dropped_upto + 1);
        }
        let idx = self.history.partition_point(|c| c.rv <= rv);
        Ok(self.history.range(idx..).cloned().collect())
    }

    fn trim_history(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(c) = self.history.pop_front() {
                self.dropped_upto = c.rv;
            }
        }
    }

    fn record(&mut self, change: Change) {
        let ns = if resources::get(change.rid).namespaced {
            change.ns.as_str()
        } else {
            ""
        };
        let key = (
            change.rid,
            ns.to_string(),
            meta_str(&change.obj, "name").to_string(),
        );
        if let Some(tx) = self.named.get(&key) {
            if tx.receiver_count() == 0 {
                self.named.remove(&key);
            } else {
                tx.send_replace(self.rv);
            }
        }
        self.history.push_back(Arc::new(change));
        self.trim_history();
        self.notify.send_replace(self.rv);
        let every = (self.history_limit as u64 / 2).max(1);
        if self.rv.is_multiple_of(every) {
            self.epoch.send_replace(self.rv);
        }
    }

    /// Stores `obj` with a fresh resourceVersion and rendered managedFields.
    fn commit(&mut self, key: Key, mut obj: Value, managed: Managed) -> Value {
        self.rv += 1;
        set_meta(&mut obj, "resourceVersion", json!(self.rv.to_string()));
        if managed.0.is_empty() {
            if let Ok(m) = meta_mut(&mut obj) {
                m.remove("managedFields");
            }
        } else {
            set_meta(&mut obj, "managedFields", ssa::render(&managed));
        }
        let arc = Arc::new(obj.clone());
        let prev = self
            .objects
            .insert(
                key.clone(),
                Stored {
                    obj: arc.clone(),
                    managed,
                },
            )
            .map(|s| s.obj);
        let ctype = if prev.is_some() {
            ChangeType::Modified
        } else {
            ChangeType::Added
        };
        self.record(Change {
            rv: self.rv,
            rid: key.0,
            ns: key.1,
            ctype,
            obj: arc,
            prev,
        });
        obj
    }

    /// Removes an object; `last` is its final state (defaults to the stored one).
    fn commit_delete(&mut self, key: &Key, last: Option<Value>) -> Option<Value> {
        let stored = self.objects.remove(key)?;
        self.rv += 1;
        let mut obj = last.unwrap_or_else(|| (*stored.obj).clone());
        set_meta(&mut obj, "resourceVersion", json!(self.rv.to_string()));
        self.record(Change {
            rv: self.rv,
            rid: key.0,
            ns: key.1.clone(),
            ctype: ChangeType::Deleted,
            obj: Arc::new(obj.clone()),
            prev: Some(stored.obj),
        });
        if key.0 == NAMESPACES {
            let doomed: Vec<Key> = self
                .objects
                .keys()
                .filter(|k| k.1 == key.2 && resources::get(k.0).namespaced)
                .cloned()
                .collect();
            for k in doomed {
                self.commit_delete(&k, None);
            }
        }
        Some(obj)
    }

    /// Kind-specific defaults and resets applied on create (the strategies' PrepareForCreate).
    fn prepare_create(&self, rt: &ResourceType, obj: &mut Value) {
        let name = meta_str(obj, "name").to_string();
        let Some(o) = obj.as_object_mut() else { return };
        match (rt.kind, rt.group) {
            ("Namespace", _) => {
                let spec = o.entry("spec").or_insert_with(|| json!({}));
                if let Some(s) = spec.as_object_mut() {
                    s.entry("finalizers")
                        .or_insert_with(|| json!(["kubernetes"]));
                }
                o.insert("status".into(), json!({"phase": "Active"}));
            }
            ("Pod", _) => {
                let spec = o.entry("spec").or_insert_with(|| json!({}));
                if let Some(s) = spec.as_object_mut() {
                    s.entry("restartPolicy").or_insert_with(|| json!("Always"));
                    s.entry("dnsPolicy")
                        .or_insert_with(|| json!("ClusterFirst"));
                    s.entry("schedulerName")
                        .or_insert_with(|| json!("default-scheduler"));
                    s.entry("terminationGracePeriodSeconds")
                        .or_insert_with(|| json!(30));
                    s.entry("enableServiceLinks").or_insert_with(|| json!(true));
                    if let Some(cs) = s.get_mut("containers").and_then(Value::as_array_mut) {
                        for c in cs.iter_mut().filter_map(Value::as_object_mut) {
                            let image = c.get("image").and_then(Value::as_str).unwrap_or("");
                            let latest = !image.contains(':') || image.ends_with(":latest");
                            c.entry("imagePullPolicy").or_insert_with(|| {
                                json!(if latest { "Always" } else { "IfNotPresent" })
                            });
                            c.entry("terminationMessagePath")
                                .or_insert_with(|| json!("/dev/termination-log"));
                            c.entry("terminationMessagePolicy")
                                .or_insert_with(|| json!("File"));
                            c.entry("resources").or_insert_with(|| json!({}));
                        }
                    }
                }
                let qos = pod_qos(o.get("spec").unwrap_or(&Value::Null));
                o.insert(
                    "status".into(),
                    json!({"phase": "Pending", "qosClass": qos}),
                );
            }
            ("Service", _) => {
                let n = self.rv;
                let spec = o.entry("spec").or_insert_with(|| json!({}));
                if let Some(s) = spec.as_object_mut() {
                    s.entry("type").or_insert_with(|| json!("ClusterIP"));
                    s.entry("sessionAffinity").or_insert_with(|| json!("None"));
                    let external = s.get("type").and_then(Value::as_str) == Some("ExternalName");
                    if !external && !s.contains_key("clusterIP") {
                        let ip = format!("10.96.{}.{}", (n / 250) % 250, n % 250 + 2);
                        s.insert("clusterIP".into(), json!(ip));
                        s.insert("clusterIPs".into(), json!([ip]));
                    }
                    if let Some(ports) = s.get_mut("ports").and_then(Value::as_array_mut) {
                        for p in ports.iter_mut().filter_map(Value::as_object_mut) {
                            p.entry("protocol").or_insert_with(|| json!("TCP"));
                            if let Some(port) = p.get("port").cloned() {
                                p.entry("targetPort").or_insert(port);
                            }
                        }
                    }
                }
                o.insert("status".into(), json!({"loadBalancer": {}}));
            }
            ("Secret", _) => fold_string_data(obj),
            _ => {}
        }
        if rt.kind == "Namespace" {
            if let Ok(m) = meta_mut(obj) {
                let labels = m.entry("labels").or_insert_with(|| json!({}));
                if let Some(l) = labels.as_object_mut() {
                    l.insert("kubernetes.io/metadata.name".into(), json!(name));
                }
            }
        }
    }

    /// Kind-specific normalization on update (the strategies' PrepareForUpdate).
    fn prepare_update(rt: &ResourceType, old: &Value, new: &mut Value) {
        match rt.kind {
            "Secret" => fold_string_data(new),
            "Namespace" => {
                let name = meta_str(old, "name").to_string();
                if let Ok(m) = meta_mut(new) {
                    let labels = m.entry("labels").or_insert_with(|| json!({}));
                    if let Some(l) = labels.as_object_mut() {
                        l.insert("kubernetes.io/metadata.name".into(), json!(name));
                    }
                }
            }
            "Service" => {
                for f in ["clusterIP", "clusterIPs"] {
                    let old_v = old.pointer(&format!("/spec/{f}")).cloned();
                    if let (Some(v), Some(spec)) =
                        (old_v, new.get_mut("spec").and_then(Value::as_object_mut))
                    {
                        spec.entry(f).or_insert(v);
                    }
                }
            }
            _ => {}
        }
    }

    /// POST.
    pub fn create(
        &mut self,
        rid: ResourceId,
        ns: &str,
        mut body: Value,
        opts: &WriteOpts,
    ) -> Result<Value, ApiError> {
        let rt = resources::get(rid);
        check_type_meta(rt, &mut body)?;
        let m = meta_mut(&mut body)?;
        set_namespace(rt, m, ns)?;
        if m.get("resourceVersion")
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
        {
            return Err(ApiError::bad_request(
                "resourceVersion should not be set on objects to be created",
            ));
        }
        let mut name = m
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if name.is_empty() {
            if let Some(prefix) = m.get("generateName").and_then(Value::as_str) {
                if !prefix.is_empty() {
                    let base: String = prefix.chars().take(63 - 5).collect();
                    loop {
                        name = format!("{base}{}", name_suffix());
                        if !self.objects.contains_key(&Self::key(rid, ns, &name)) {
                            break;
                        }
                    }
                    m.insert("name".into(), json!(name));
                }
            }
        }
        if rt.namespaced && !self.namespace_exists(ns) {
            return Err(ApiError::not_found(resources::get(NAMESPACES), ns));
        }
        self.create_prepared(
            rid,
            ns,
            body,
            Ownership::Update {
                manager: opts.manager.clone(),
                subresource: String::new(),
            },
            opts.dry_run,
        )
    }

    /// The shared tail of POST and create-by-apply/PUT: defaults, validation, existence.
    fn create_prepared(
        &mut self,
        rid: ResourceId,
        ns: &str,
        mut body: Value,
        ownership: Ownership,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let rt = resources::get(rid);
        if let Ok(m) = meta_mut(&mut body) {
            for f in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "selfLink",
                "managedFields",
                "resourceVersion",
            ] {
                m.remove(f);
            }
        }
        self.prepare_create(rt, &mut body);
        let name = meta_str(&body, "name").to_string();
        let errs = validation::validate(rt, &body, None);
        if !errs.is_empty() {
            return Err(ApiError::invalid(rt, &name, errs));
        }
        let key = Self::key(rid, ns, &name);
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(rt, &name));
        }
        let now = now_rfc3339();
        if let Ok(m) = meta_mut(&mut body) {
            m.insert("uid".into(), json!(new_uid()));
            m.insert("creationTimestamp".into(), json!(now));
            m.insert("generation".into(), json!(1));
        }
        let av = rt.api_version();
        let managed = match ownership {
            Ownership::Update {
                manager,
                subresource,
            } => {
                let mut m = Managed::default();
                let actor = Actor {
                    manager: &manager,
                    subresource: &subresource,
                    api_version: &av,
                    now: &now,
                };
                ssa::record_update(&mut m, rt.kind, None, &body, actor);
                m
            }
            Ownership::Computed(mut m) => {
                ssa::prune(&mut m, &ssa::leaves(rt.kind, &body));
                m
            }
        };
        if dry_run {
            if !managed.0.is_empty() {
                set_meta(&mut body, "managedFields", ssa::render(&managed));
            }
            return Ok(body);
        }
        Ok(self.commit(key, body, managed))
    }

    /// Combines a write body with the stored object for the main resource or `/status`.
    fn scope_write(rt: &ResourceType, old: &Value, mut new: Value, sub: Option<&str>) -> Value {
        if sub == Some("status") {
            let mut out = old.clone();
            if let Some(o) = out.as_object_mut() {
                match new.get("status") {
                    Some(s) => {
                        o.insert("status".into(), s.clone());
                    }
                    None => {
                        o.remove("status");
                    }
                }
            }
            out
        } else {
            if rt.status_subresource {
                if let Some(o) = new.as_object_mut() {
                    match old.get("status") {
                        Some(s) => {
                            o.insert("status".into(), s.clone());
                        }
                        None => {
                            o.remove("status");
                        }
                    }
                }
            }
            new
        }
    }

    fn check_preconditions(
        rt: &ResourceType,
        name: &str,
        stored: &Value,
        rv: &str,
        uid: &str,
    ) -> Result<(), ApiError> {
        if !uid.is_empty() && uid != meta_str(stored, "uid") {
            return Err(ApiError::conflict(
                rt,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(stored, "uid")
                ),
            ));
        }
        if !rv.is_empty() && rv != meta_str(stored, "resourceVersion") {
            return Err(ApiError::stale(rt, name));
        }
        Ok(())
    }

    /// PUT on the main resource or `/status`. Returns (HTTP code, object).
    pub fn replace(
        &mut self,
        rid: ResourceId,
        ns: &str,
        name: &str,
        sub: Option<&str>,
        mut body: Value,
        opts: &WriteOpts,
    ) -> Result<(u16, Value), ApiError> {
        let rt = resources::get(rid);
        check_type_meta(rt, &mut body)?;
        let m = meta_mut(&mut body)?;
        let body_name = m.get("name").and_then(Value::as_str).unwrap_or("");
        if body_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        set_namespace(rt, m, ns)?;
        let rv = m
            .get("resourceVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let uid = m
            .get("uid")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let Some(stored) = self.get(rid, ns, name).cloned() else {
            if sub.is_none() && rt.create_on_update && rv.is_empty() {
                if rt.namespaced && !self.namespace_exists(ns) {
                    return Err(ApiError::not_found(resources::get(NAMESPACES), ns));
                }
                let obj = self.create_prepared(
                    rid,
                    ns,
                    body,
                    Ownership::Update {
                        manager: opts.manager.clone(),
                        subresource: String::new(),
                    },
                    opts.dry_run,
                )?;
                return Ok((201, obj));
            }
            return Err(ApiError::not_found(rt, name));
        };
        Self::check_preconditions(rt, name, &stored.obj, &rv, &uid)?;
        let new = Self::scope_write(rt, &stored.obj, body, sub);
        self.finish_update(
            rid,
            ns,
            name,
            &stored,
            new,
            Ownership::Update {
                manager: opts.manager.clone(),
                subresource: sub.unwrap_or("").to_string(),
            },
            opts.dry_run,
        )
    }

    /// The shared tail of PUT, PATCH and apply on an existing object.
    #[allow(clippy::too_many_arguments)]
    fn finish_update(
        &mut self,
        rid: ResourceId,
        ns: &str,
        name: &str,
        stored: &Stored,
        mut new: Value,
        ownership: Ownership,
        dry_run: bool,
    ) -> Result<(u16, Value), ApiError> {
        let rt = resources::get(rid);
        let old: &Value = &stored.obj;
        if !new.is_object() {
            return Err(ApiError::bad_request(
                "the resulting object must be a JSON object",
            ));
        }
        check_type_meta(rt, &mut new)?;
        meta_mut(&mut new)?;
        for f in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "name",
            "namespace",
            "generation",
        ] {
            copy_meta(old, &mut new, f);
        }
        if let Ok(m) = meta_mut(&mut new) {
            m.remove("selfLink");
            m.remove("managedFields");
        }
        Self::prepare_update(rt, old, &mut new);

        let mut errs = Vec::new();
        if meta(old).is_some_and(|m| m.contains_key("deletionTimestamp")) {
            let fins = |v: &Value| -> Vec<Value> {
                v.pointer("/metadata/finalizers")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default()
            };
            let old_f = fins(old);
            if fins(&new).iter().any(|f| !old_f.contains(f)) {
                errs.push(Cause::forbidden(
                    "metadata.finalizers",
                    "no new finalizers can be added if the object is being deleted",
                ));
            }
        }
        errs.extend(validation::validate(rt, &new, Some(old)));
        if !errs.is_empty() {
            return Err(ApiError::invalid(rt, name, errs));
        }

        if spec_changed(old, &new) {
            let g = old
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            set_meta(&mut new, "generation", json!(g + 1));
        }

        let now = now_rfc3339();
        let av = rt.api_version();
        let managed = match ownership {
            Ownership::Update {
                manager,
                subresource,
            } => {
                let mut m = stored.managed.clone();
                let actor = Actor {
                    manager: &manager,
                    subresource: &subresource,
                    api_version: &av,
                    now: &now,
                };
                ssa::record_update(&mut m, rt.kind, Some(old), &new, actor);
                m
            }
            Ownership::Computed(mut m) => {
                ssa::prune(&mut m, &ssa::leaves(rt.kind, &new));
                m
            }
        };
        if let Ok(m) = meta_mut(&mut new) {
            if managed.0.is_empty() {
                m.remove("managedFields");
            } else {
                m.insert("managedFields".into(), ssa::render(&managed));
            }
            m.insert(
                "resourceVersion".into(),
                json!(meta_str(old, "resourceVersion")),
            );
        }
        // A write that changes nothing is not persisted: same resourceVersion, no event.
        if new == *old {
            return Ok((200, new));
        }
        if dry_run {
            return Ok((200, new));
        }
        let key = Self::key(rid, ns, name);
        let finalizers_empty = new
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty);
        if meta(&new).is_some_and(|m| m.contains_key("deletionTimestamp")) && finalizers_empty {
            let obj = self
                .commit_delete(&key, Some(new))
                .ok_or_else(|| ApiError::not_found(rt, name))?;
            return Ok((200, obj));
        }
        Ok((200, self.commit(key, new, managed)))
    }

    /// PATCH (all four patch types) on the main resource or `/status`.
    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &mut self,
        rid: ResourceId,
        ns: &str,
        name: &str,
        sub: Option<&str>,
        ptype: PatchType,
        body: &[u8],
        opts: &WriteOpts,
    ) -> Result<(u16, Value), ApiError> {
        let rt = resources::get(rid);
        if ptype != PatchType::Apply && opts.force.is_some() {
            return Err(ApiError::invalid_kind(
                "PatchOptions.meta.k8s.io",
                "meta.k8s.io",
                "PatchOptions",
                "",
                vec![Cause::forbidden(
                    "force",
                    "may not be specified for non-apply patch",
                )],
            ));
        }
        if ptype == PatchType::Apply {
            if !opts.explicit_manager {
                return Err(ApiError::invalid_kind(
                    "PatchOptions.meta.k8s.io",
                    "meta.k8s.io",
                    "PatchOptions",
                    "",
                    vec![Cause::required(
                        "fieldManager",
                        "is required for apply patch",
                    )],
                ));
            }
            return self.apply(rid, ns, name, sub, body, opts);
        }
        let Some(stored) = self.get(rid, ns, name).cloned() else {
            return Err(ApiError::not_found(rt, name));
        };
        let mut doc: Value = (*stored.obj).clone();
        match ptype {
            PatchType::Json => patch::json_patch(&mut doc, body)?,
            PatchType::Merge | PatchType::Strategic => {
                let p: Value = serde_json::from_slice(body)
                    .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
                if ptype == PatchType::Merge {
                    patch::merge_patch(&mut doc, &p);
                } else {
                    patch::strategic_merge_patch(rt.kind, &mut doc, &p)
                        .map_err(ApiError::bad_request)?;
                }
            }
            PatchType::Apply => {}
        }
        if !doc.is_object() {
            return Err(ApiError::bad_request(
                "the patched object must be a JSON object",
            ));
        }
        let rv = meta_str(&doc, "resourceVersion").to_string();
        let uid = meta_str(&doc, "uid").to_string();
        Self::check_preconditions(rt, name, &stored.obj, &rv, &uid)?;
        let patched_name = meta_str(&doc, "name");
        if patched_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({patched_name}) does not match the name on the URL ({name})"
            )));
        }
        if rt.namespaced && meta_str(&doc, "namespace") != ns {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let new = Self::scope_write(rt, &stored.obj, doc, sub);
        self.finish_update(
            rid,
            ns,
            name,
            &stored,
            new,
            Ownership::Update {
                manager: opts.manager.clone(),
                subresource: sub.unwrap_or("").to_string(),
            },
            opts.dry_run,
        )
    }

    /// Server-side apply.
    fn apply(
        &mut self,
        rid: ResourceId,
        ns: &str,
        name: &str,
        sub: Option<&str>,
        body: &[u8],
        opts: &WriteOpts,
    ) -> Result<(u16, Value), ApiError> {
        let rt = resources::get(rid);
        let mut applied: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(_) => serde_saphyr::from_slice(body)
                .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?,
        };
        if !applied.is_object() {
            return Err(ApiError::bad_request(
                "the body of an apply patch must be an object",
            ));
        }
        strip_nulls(&mut applied);
        let av = rt.api_version();
        let got_av = applied
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("");
        let got_kind = applied.get("kind").and_then(Value::as_str).unwrap_or("");
        if got_av.is_empty() || got_kind.is_empty() {
            return Err(ApiError::bad_request(
                "apiVersion and kind must be set in an apply patch",
            ));
        }
        if got_av != av {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({got_av}) does not match the expected API version ({av})"
            )));
        }
        if got_kind != rt.kind {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({got_kind}) does not match the expected kind ({})",
                rt.kind
            )));
        }
        let m = meta_mut(&mut applied)?;
        match m.get("name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() && n != name => {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )))
            }
            _ => {
                m.insert("name".into(), json!(name));
            }
        }
        set_namespace(rt, m, ns)?;
        let rv = m
            .get("resourceVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let uid = m
            .get("uid")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        for f in [
            "resourceVersion",
            "managedFields",
            "uid",
            "creationTimestamp",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
        ] {
            m.remove(f);
        }
        if let Some(o) = applied.as_object_mut() {
            if sub == Some("status") {
                o.retain(|k, _| {
                    matches!(k.as_str(), "apiVersion" | "kind" | "metadata" | "status")
                });
                if let Some(m) = o.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.retain(|k, _| k == "name" || k == "namespace");
                }
            } else if rt.status_subresource {
                o.remove("status");
            }
        }
        let subresource = sub.unwrap_or("").to_string();
        let now = now_rfc3339();
        let force = opts.force.unwrap_or(false);
        let actor = Actor {
            manager: &opts.manager,
            subresource: &subresource,
            api_version: &av,
            now: &now,
        };

        let Some(stored) = self.get(rid, ns, name).cloned() else {
            if sub.is_some() {
                return Err(ApiError::not_found(rt, name));
            }
            if !rv.is_empty() {
                return Err(ApiError::not_found(rt, name));
            }
            if rt.namespaced && !self.namespace_exists(ns) {
                return Err(ApiError::not_found(resources::get(NAMESPACES), ns));
            }
            let (obj, managed) = ssa::apply(
                rt.kind,
                &Managed::default(),
                &Value::Object(Map::new()),
                &applied,
                actor,
                force,
            )
            .map_err(|c| ApiError::apply_conflict(rt, name, &c))?;
            let obj =
                self.create_prepared(rid, ns, obj, Ownership::Computed(managed), opts.dry_run)?;
            return Ok((201, obj));
        };
        Self::check_preconditions(rt, name, &stored.obj, &rv, &uid)?;
        let (merged, managed) = ssa::apply(
            rt.kind,
            &stored.managed,
            &stored.obj,
            &applied,
            actor,
            force,
        )
        .map_err(|c| ApiError::apply_conflict(rt, name, &c))?;
        let new = Self::scope_write(rt, &stored.obj, merged, sub);
        self.finish_update(
            rid,
            ns,
            name,
            &stored,
            new,
            Ownership::Computed(managed),
            opts.dry_run,
        )
    }

    /// DELETE. Objects with finalizers get a deletionTimestamp and stay (202).
    pub fn delete(
        &mut self,
        rid: ResourceId,
        ns: &str,
        name: &str,
        options: Option<&Value>,
        dry_run: bool,
    ) -> Result<(u16, Value), ApiError> {
        let rt = resources::get(rid);
        let Some(stored) = self.get(rid, ns, name).cloned() else {
            return Err(ApiError::not_found(rt, name));
        };
        if let Some(pre) = options.and_then(|o| o.get("preconditions")) {
            let uid = pre.get("uid").and_then(Value::as_str).unwrap_or("");
            let rv = pre
                .get("resourceVersion")
                .and_then(Value::as_str)
                .unwrap_or("");
            if !uid.is_empty() && uid != meta_str(&stored.obj, "uid") {
                return Err(ApiError::conflict(
                    rt,
                    name,
                    &format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                        meta_str(&stored.obj, "uid")
                    ),
                ));
            }
            if !rv.is_empty() && rv != meta_str(&stored.obj, "resourceVersion") {
                return Err(ApiError::conflict(
                    rt,
                    name,
                    &format!(
                        "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                        meta_str(&stored.obj, "resourceVersion")
                    ),
                ));
            }
        }
        if dry_run {
            return Ok((200, (*stored.obj).clone()));
        }
        let has_finalizers = stored
            .obj
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        let key = Self::key(rid, ns, name);
        if has_finalizers && rid != NAMESPACES {
            if meta(&stored.obj).is_some_and(|m| m.contains_key("deletionTimestamp")) {
                return Ok((202, (*stored.obj).clone()));
            }
            let mut obj = (*stored.obj).clone();
            let g = obj
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            if let Ok(m) = meta_mut(&mut obj) {
                m.insert("deletionTimestamp".into(), json!(now_rfc3339()));
                m.insert("deletionGracePeriodSeconds".into(), json!(0));
                m.insert("generation".into(), json!(g + 1));
            }
            return Ok((202, self.commit(key, obj, stored.managed)));
        }
        let obj = self
            .commit_delete(&key, None)
            .ok_or_else(|| ApiError::not_found(rt, name))?;
        Ok((200, obj))
    }

    /// DELETE on a collection: deletes every match, returns them as a list.
    pub fn delete_collection(
        &mut self,
        rid: ResourceId,
        ns: Option<&str>,
        label: &LabelSelector,
        field: &FieldSelector,
        dry_run: bool,
    ) -> Result<Vec<Value>, ApiError> {
        let targets: Vec<(String, String)> = self
            .list(rid, ns, label, field)
            .iter()
            .map(|o| {
                (
                    meta_str(o, "namespace").to_string(),
                    meta_str(o, "name").to_string(),
                )
            })
            .collect();
        let mut out = Vec::new();
        for (ns, name) in targets {
            let (_, obj) = self.delete(rid, &ns, &name, None, dry_run)?;
            out.push(obj);
        }
        Ok(out)
    }

    /// Direct create-or-replace (no validation, no preconditions). Ownership is
    /// recorded for manager "emulator" (status fields under the `status` subresource).
    pub fn put(&mut self, mut obj: Value) -> Result<Value, String> {
        let av = obj
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let kind = obj
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let rid = resources::find_kind(&av, &kind)
            .ok_or_else(|| format!("unknown apiVersion/kind {av}/{kind}"))?;
        let rt = resources::get(rid);
        let name = meta_str(&obj, "name").to_string();
        if name.is_empty() {
            return Err("metadata.name is required".into());
        }
        let ns = if rt.namespaced {
            let ns = meta_str(&obj, "namespace");
            if ns.is_empty() {
                "default".to_string()
            } else {
                ns.to_string()
            }
        } else {
            String::new()
        };
        let m = meta_mut(&mut obj).map_err(|e| e.message)?;
        if rt.namespaced {
            m.insert("namespace".into(), json!(ns));
        } else {
            m.remove("namespace");
        }
        m.remove("managedFields");
        m.remove("selfLink");
        let key = Self::key(rid, &ns, &name);
        let old = self.objects.get(&key).cloned();
        let now = now_rfc3339();
        match &old {
            Some(s) => {
                for f in ["uid", "creationTimestamp", "generation"] {
                    copy_meta(&s.obj, &mut obj, f);
                }
                if spec_changed(&s.obj, &obj) {
                    let g = s
                        .obj
                        .pointer("/metadata/generation")
                        .and_then(Value::as_i64)
                        .unwrap_or(1);
                    set_meta(&mut obj, "generation", json!(g + 1));
                }
            }
            None => {
                let m = meta_mut(&mut obj).map_err(|e| e.message)?;
                m.insert("uid".into(), json!(new_uid()));
                m.insert("creationTimestamp".into(), json!(now));
                m.insert("generation".into(), json!(1));
            }
        }
        let mut managed = old.as_ref().map(|s| s.managed.clone()).unwrap_or_default();
        let old_obj = old.as_ref().map(|s| s.obj.as_ref());
        let split = |v: &Value, status: bool| -> Value {
            let mut v = v.clone();
            if let Some(o) = v.as_object_mut() {
                if status {
                    o.retain(|k, _| k == "status");
                } else {
                    o.remove("status");
                }
            }
            v
        };
        if rt.status_subresource {
            let all_leaves = ssa::leaves(rt.kind, &obj);
            for (status, sub) in [(false, ""), (true, "status")] {
                let new_part = split(&obj, status);
                let old_part = old_obj.map(|o| split(o, status));
                let old_leaves = old_part
                    .as_ref()
                    .map(|o| ssa::leaves(rt.kind, o))
                    .unwrap_or_default();
                let changed = ssa::leaves(rt.kind, &new_part)
                    .into_iter()
                    .filter(|(p, v)| old_leaves.get(p) != Some(v))
                    .map(|(p, _)| p)
                    .collect();
                let actor = Actor {
                    manager: "emulator",
                    subresource: sub,
                    api_version: &av,
                    now: &now,
                };
                ssa::record_changed(&mut managed, &changed, actor);
            }
            ssa::prune(&mut managed, &all_leaves);
        } else {
            let actor = Actor {
                manager: "emulator",
                subresource: "",
                api_version: &av,
                now: &now,
            };
            ssa::record_update(&mut managed, rt.kind, old_obj, &obj, actor);
        }
        Ok(self.commit(key, obj, managed))
    }

    /// Direct delete (finalizers ignored).
    pub fn delete_direct(&mut self, rid: ResourceId, ns: &str, name: &str) -> bool {
        let key = Self::key(rid, ns, name);
        self.commit_delete(&key, None).is_some()
    }
}

/// Puts the URL's namespace into a body's metadata (none for cluster-scoped kinds); a body
/// naming another namespace is a bad request.
fn set_namespace(rt: &ResourceType, m: &mut Map<String, Value>, ns: &str) -> Result<(), ApiError> {
    if !rt.namespaced {
        m.remove("namespace");
        return Ok(());
    }
    match m.get("namespace").and_then(Value::as_str) {
        Some(x) if !x.is_empty() && x != ns => Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        )),
        _ => {
            m.insert("namespace".into(), json!(ns));
            Ok(())
        }
    }
}
