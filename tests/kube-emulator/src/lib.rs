//! A Kubernetes API server emulator for tests.
//!
//! It serves the core resources faultline touches (nodes, namespaces,
//! configmaps, secrets, pods, services, core and events.k8s.io events, leases)
//! over plain HTTP on loopback, with the semantics clients most often get wrong
//! emulated faithfully: resourceVersion preconditions, status subresources,
//! strategic merge patch list semantics, server-side apply field ownership,
//! watch resumption with bookmarks and 410 Expired, Status errors, and optional
//! RBAC. Tests can inject faults, read the call log, take the server down and
//! up again, and read or write the store directly.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use faultline_kube_emulator::{node, Emulator, FaultRule};
//! let emu = Emulator::start().await?;
//! emu.put(node("gpu-1", &[]));
//! emu.write_kubeconfig(std::path::Path::new("/tmp/kubeconfig"), "agent-token")?;
//! emu.inject(FaultRule::status(500).on_method("PATCH").times(1));
//! # Ok(()) }
//! ```

mod api;
mod auth;
mod control;
mod error;
mod faults;
mod objects;
mod patch;
mod resources;
mod response;
mod reviews;
mod schema;
mod selectors;
mod server;
mod ssa;
mod store;
mod util;
mod validation;
mod watch;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde_json::Value;

pub use auth::{Rule, UserInfo};
pub use faults::{Call, FaultAction, FaultRule, RuleId};
pub use objects::{namespace, node, ResourceRef};

use auth::Grant;
use selectors::{FieldSelector, LabelSelector};
use store::Store;

/// Namespaces that exist from the start.
pub const INITIAL_NAMESPACES: [&str; 4] =
    ["default", "kube-system", "kube-public", "kube-node-lease"];

/// The call log keeps this many most recent calls.
pub const MAX_CALLS: usize = 100_000;

/// Locks a mutex, ignoring poisoning (state stays usable after a panicking test thread).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug)]
pub(crate) struct ActiveRule {
    id: RuleId,
    rule: FaultRule,
    left: Option<u32>,
}

/// Shared state behind every [`Emulator`] handle and server task.
#[derive(Debug)]
pub(crate) struct Inner {
    pub addr: SocketAddr,
    pub store: Mutex<Store>,
    faults: Mutex<Vec<ActiveRule>>,
    next_rule: AtomicU64,
    calls: Mutex<Vec<Call>>,
    grants: Mutex<BTreeMap<String, Grant>>,
    bookmark_ms: AtomicU64,
    /// Every write waits a time in [min, max] ms before it is served (0, 0: none).
    write_latency_ms: Mutex<(u64, u64)>,
    /// Drives the latency's pseudo-random spread.
    latency_seq: AtomicU64,
    serving: Mutex<Option<server::Serving>>,
}

impl Inner {
    /// The first rule matching the request with uses left, consuming one use.
    pub(crate) fn take_fault(&self, method: &str, path: &str, query: &str) -> Option<FaultAction> {
        let target = if query.is_empty() {
            path.to_string()
        } else {
            format!("{path}?{query}")
        };
        let mut faults = lock(&self.faults);
        let r = faults
            .iter_mut()
            .find(|r| r.left != Some(0) && r.rule.matches(method, &target))?;
        if let Some(n) = r.left.as_mut() {
            *n -= 1;
        }
        Some(r.rule.action.clone())
    }

    pub(crate) fn log_call(&self, call: Call) {
        tracing::info!(
            method = %call.method,
            path = %call.path,
            query = %call.query,
            status = call.status,
            injected = call.injected,
            field_manager = call.field_manager.as_deref().unwrap_or(""),
            "kube api call"
        );
        let mut calls = lock(&self.calls);
        if calls.len() >= MAX_CALLS {
            let excess = calls.len() + 1 - MAX_CALLS;
            calls.drain(..excess);
        }
        calls.push(call);
    }

    pub(crate) fn calls(&self) -> Vec<Call> {
        lock(&self.calls).clone()
    }

    pub(crate) fn clear_calls(&self) {
        lock(&self.calls).clear();
    }

    pub(crate) fn inject(&self, rule: FaultRule) -> RuleId {
        let id = RuleId(self.next_rule.fetch_add(1, Ordering::Relaxed));
        let left = rule.times;
        lock(&self.faults).push(ActiveRule { id, rule, left });
        id
    }

    /// Every token's grant (the review APIs read them).
    pub(crate) fn grants_snapshot(&self) -> BTreeMap<String, Grant> {
        lock(&self.grants).clone()
    }

    pub(crate) fn clear_faults(&self) {
        lock(&self.faults).clear();
    }

    /// `Ok(None)` when authorization is off; `Ok(Some(grant))` for a known token
    /// (or anonymous); `Err(401)` for an unknown token.
    pub(crate) fn authenticate(
        &self,
        token: Option<&str>,
    ) -> Result<Option<Grant>, error::ApiError> {
        let grants = lock(&self.grants);
        if grants.is_empty() {
            return Ok(None);
        }
        match token {
            None => Ok(Some(Grant {
                user: UserInfo {
                    username: "system:anonymous".into(),
                    groups: vec!["system:unauthenticated".into()],
                    extra: BTreeMap::new(),
                },
                rules: Vec::new(),
                audiences: Vec::new(),
            })),
            // A token for other audiences (a projected token for some workload) is not
            // accepted by the API server itself.
            Some(t) => grants
                .get(t)
                .filter(|g| g.token_audiences().iter().any(|a| a == auth::API_AUDIENCE))
                .cloned()
                .map(Some)
                .ok_or_else(error::ApiError::unauthorized),
        }
    }

    /// How long this write waits before it is served: spread evenly over the configured range
    /// (a fixed sequence, so runs are comparable).
    pub(crate) fn write_latency(&self) -> Duration {
        let (lo, hi) = *lock(&self.write_latency_ms);
        if hi == 0 {
            return Duration::ZERO;
        }
        // splitmix64 of a counter: cheap, deterministic, evenly spread.
        let mut z = self
            .latency_seq
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Duration::from_millis(lo + z % (hi - lo + 1))
    }

    pub(crate) fn bookmark_interval(&self) -> Duration {
        Duration::from_millis(self.bookmark_ms.load(Ordering::Relaxed))
    }

    pub(crate) fn put(&self, obj: Value) -> Result<Value, String> {
        lock(&self.store).put(obj)
    }
}

/// Stops the server when the last [`Emulator`] handle is dropped.
#[derive(Debug)]
struct ShutdownGuard(Arc<Inner>);

impl Drop for ShutdownGuard {
    fn drop(&mut self) {
        if let Some(s) = lock(&self.0.serving).take() {
            s.cancel();
        }
    }
}

/// Handle to a running emulator. Clones share the same server and state; the
/// server stops when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct Emulator {
    inner: Arc<Inner>,
    _guard: Arc<ShutdownGuard>,
}

impl Emulator {
    /// Starts on `127.0.0.1` on a free port.
    pub async fn start() -> std::io::Result<Emulator> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Starts on `addr`, with the initial namespaces created.
    pub async fn start_on(addr: SocketAddr) -> std::io::Result<Emulator> {
        let listener = server::bind(addr)?;
        let addr = listener.local_addr()?;
        let mut store = Store::new();
        for ns in INITIAL_NAMESPACES {
            // Namespaces are well-formed; `put` cannot fail for them.
            let _ = store.put(namespace(ns));
        }
        let inner = Arc::new(Inner {
            addr,
            store: Mutex::new(store),
            faults: Mutex::new(Vec::new()),
            next_rule: AtomicU64::new(1),
            calls: Mutex::new(Vec::new()),
            grants: Mutex::new(BTreeMap::new()),
            bookmark_ms: AtomicU64::new(60_000),
            write_latency_ms: Mutex::new((0, 0)),
            latency_seq: AtomicU64::new(0),
            serving: Mutex::new(None),
        });
        let serving = server::spawn(inner.clone(), listener);
        *lock(&inner.serving) = Some(serving);
        Ok(Emulator {
            _guard: Arc::new(ShutdownGuard(inner.clone())),
            inner,
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.inner.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// The kubeconfig text [`Self::write_kubeconfig`] writes.
    pub fn kubeconfig(&self, token: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: emulator\n  cluster:\n    server: {url}\ncontexts:\n- name: emulator\n  context:\n    cluster: emulator\n    user: emulator-user\n    namespace: default\ncurrent-context: emulator\nusers:\n- name: emulator-user\n  user:\n    token: {token:?}\npreferences: {{}}\n",
            url = self.url(),
        )
    }

    /// Writes a kubeconfig for this emulator; `token` identifies the client in
    /// the call log and for authorization.
    pub fn write_kubeconfig(&self, path: &Path, token: &str) -> std::io::Result<()> {
        // Write then rename, so a reader polling for the file never sees half of it.
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp-{}", std::process::id()));
        std::fs::write(&tmp, self.kubeconfig(token))?;
        std::fs::rename(&tmp, path)
    }

    /// Stops serving: closes the listener and drops every open connection
    /// (including watches and hung requests). State is kept.
    pub async fn down(&self) {
        let serving = lock(&self.inner.serving).take();
        if let Some(s) = serving {
            s.stop().await;
        }
    }

    /// Serves again on the same address (no-op when already up).
    pub async fn up(&self) -> std::io::Result<()> {
        if lock(&self.inner.serving).is_some() {
            return Ok(());
        }
        let listener = server::bind(self.inner.addr)?;
        let serving = server::spawn(self.inner.clone(), listener);
        let mut slot = lock(&self.inner.serving);
        if slot.is_some() {
            serving.cancel();
        } else {
            *slot = Some(serving);
        }
        Ok(())
    }

    /// Whether the server is accepting connections.
    pub fn is_up(&self) -> bool {
        lock(&self.inner.serving).is_some()
    }

    /// Adds a fault rule (after the existing ones).
    pub fn inject(&self, rule: FaultRule) -> RuleId {
        self.inner.inject(rule)
    }

    /// Removes one fault rule; false if it was not there.
    pub fn remove_fault(&self, id: RuleId) -> bool {
        let mut faults = lock(&self.inner.faults);
        let before = faults.len();
        faults.retain(|r| r.id != id);
        faults.len() != before
    }

    pub fn clear_faults(&self) {
        self.inner.clear_faults();
    }

    /// Every request so far (except `/_emulator/*`), in the order their
    /// responses were decided (hung and reset requests when the fault hit);
    /// the most recent [`MAX_CALLS`] are kept.
    pub fn calls(&self) -> Vec<Call> {
        self.inner.calls()
    }

    pub fn clear_calls(&self) {
        self.inner.clear_calls();
    }

    /// Reads an object from the store (no call logged, no faults).
    pub fn get(&self, r: &ResourceRef) -> Option<Value> {
        let rid = resources::find(&r.group, &r.version, &r.resource)?;
        let store = lock(&self.inner.store);
        store
            .get(rid, r.namespace.as_deref().unwrap_or(""), &r.name)
            .map(|s| (*s.obj).clone())
    }

    /// Lists objects of a resource (any served version), in one namespace or
    /// all (the namespace is ignored for cluster-scoped resources).
    pub fn list(&self, group: &str, resource: &str, namespace: Option<&str>) -> Vec<Value> {
        let Some(rid) = resources::find_resource(group, resource) else {
            return Vec::new();
        };
        let namespace = namespace.filter(|_| resources::get(rid).namespaced);
        let store = lock(&self.inner.store);
        store
            .list(
                rid,
                namespace,
                &LabelSelector::default(),
                &FieldSelector::default(),
            )
            .into_iter()
            .map(|o| (*o).clone())
            .collect()
    }

    /// Creates or replaces an object from its apiVersion/kind/metadata (no
    /// validation, no preconditions; namespaced objects default to `default`).
    /// Assigns resourceVersion, uid, creationTimestamp and generation, notifies
    /// watchers, and records field ownership for manager `emulator`. Returns
    /// the stored object.
    ///
    /// # Panics
    /// When the kind is not served or `metadata.name` is missing.
    pub fn put(&self, obj: Value) -> Value {
        match self.inner.put(obj) {
            Ok(v) => v,
            Err(e) => panic!("Emulator::put: {e}"),
        }
    }

    /// Deletes an object directly (finalizers ignored; namespaces take their
    /// contents with them). False when it did not exist.
    pub fn delete(&self, r: &ResourceRef) -> bool {
        let Some(rid) = resources::find(&r.group, &r.version, &r.resource) else {
            return false;
        };
        lock(&self.inner.store).delete_direct(rid, r.namespace.as_deref().unwrap_or(""), &r.name)
    }

    /// Turns authorization on (if it was off) and lets `token` authenticate as
    /// `user` with `rules`. Calling again for a token replaces its grant.
    pub fn authorize(&self, token: &str, user: UserInfo, rules: Vec<Rule>) {
        lock(&self.inner.grants).insert(
            token.to_string(),
            Grant {
                user,
                rules,
                audiences: Vec::new(),
            },
        );
    }

    /// Like [`Emulator::authorize`], for a token issued for `audiences` only (a projected
    /// service-account token with its `audience`): the API server itself refuses it (401),
    /// and a TokenReview authenticates it only for one of those audiences.
    pub fn authorize_for_audiences(
        &self,
        token: &str,
        user: UserInfo,
        rules: Vec<Rule>,
        audiences: &[&str],
    ) {
        lock(&self.inner.grants).insert(
            token.to_string(),
            Grant {
                user,
                rules,
                audiences: audiences.iter().map(|a| a.to_string()).collect(),
            },
        );
    }

    /// The emulated API server's own audience (tokens without explicit audiences).
    pub const API_AUDIENCE: &'static str = auth::API_AUDIENCE;

    /// How long a watch with `allowWatchBookmarks=true` stays quiet before a
    /// BOOKMARK is sent (default 60 s, as kube-apiserver's watch cache:
    /// `defaultBookmarkFrequency = time.Minute` in
    /// k8s.io/apiserver/pkg/storage/cacher; a client whose read timeout is
    /// shorter sees its quiet watches cut, here as there).
    pub fn set_bookmark_interval(&self, interval: Duration) {
        let ms = u64::try_from(interval.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        self.inner.bookmark_ms.store(ms, Ordering::Relaxed);
    }

    /// Makes every write (POST, PUT, PATCH, DELETE) wait between `min` and `max` before it is
    /// served, like a real API server's write path (admission, etcd round trip: typically
    /// 5-20 ms). Reads stay immediate. Default: no latency.
    pub fn set_write_latency(&self, min: Duration, max: Duration) {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let (lo, hi) = (ms(min), ms(max.max(min)));
        *lock(&self.inner.write_latency_ms) = (lo, hi);
    }

    /// How many changes are kept for watch resumption (default 10,000); a
    /// watch resuming from before them gets 410 Expired.
    pub fn set_history_limit(&self, changes: usize) {
        lock(&self.inner.store).set_history_limit(changes);
    }

    /// The latest resourceVersion handed out.
    pub fn resource_version(&self) -> String {
        lock(&self.inner.store).resource_version().to_string()
    }
}
