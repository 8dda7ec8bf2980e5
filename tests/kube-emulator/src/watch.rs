//! Watch streams: newline-delimited JSON events over a chunked response,
//! resumable from the bounded change history, with bookmarks, selector
//! transitions (an object leaving the selector is DELETED for the watcher),
//! `sendInitialEvents`, `timeoutSeconds`, and 410 Expired for history that is
//! gone.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{json, Value};
use tokio::sync::watch as notify;
use tokio::time::Instant;

use crate::error::ApiError;
use crate::resources::{self, ResourceId};
use crate::response::Body;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::store::{Change, ChangeType};
use crate::{lock, Inner};

/// What a watch request asked for.
#[derive(Debug)]
pub(crate) struct WatchSpec {
    pub rid: ResourceId,
    pub namespace: Option<String>,
    pub label: LabelSelector,
    pub field: FieldSelector,
    pub resource_version: Option<String>,
    pub timeout: Option<Duration>,
    pub bookmarks: bool,
    pub send_initial_events: bool,
}

impl WatchSpec {
    fn matches(&self, obj: &Value) -> bool {
        self.label.matches(obj) && self.field.matches(obj)
    }
}

struct WatchState {
    inner: Arc<Inner>,
    spec: WatchSpec,
    last_rv: u64,
    queue: VecDeque<Bytes>,
    rx: notify::Receiver<u64>,
    /// For a watcher of one object: the store's epoch channel (see `Store::subscribe_named`).
    epoch: Option<notify::Receiver<u64>>,
    /// Whether the history after `last_rv` was scanned once: from then on the object's own
    /// channel (`rx`) carries the version of its every change.
    scanned: bool,
    deadline: Option<Instant>,
    done: bool,
}

fn event(kind: &str, obj: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": kind, "object": obj})).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

fn expired_event(requested: u64, oldest: u64) -> Bytes {
    let status =
        ApiError::expired(format!("too old resource version: {requested} ({oldest})")).to_status();
    event("ERROR", &status)
}

fn with_rv(obj: &Value, rv: u64) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.get_mut("metadata").and_then(Value::as_object_mut) {
        m.insert("resourceVersion".into(), json!(rv.to_string()));
    }
    o
}

impl WatchState {
    fn bookmark(&self, initial_end: bool) -> Bytes {
        let rt = resources::get(self.spec.rid);
        let mut meta = json!({"resourceVersion": self.last_rv.to_string()});
        if initial_end {
            meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        event(
            "BOOKMARK",
            &json!({"kind": rt.kind, "apiVersion": rt.api_version(), "metadata": meta}),
        )
    }

    /// The event this watcher sees for one change, if any.
    fn translate(&self, c: &Change) -> Option<Bytes> {
        if c.rid != self.spec.rid {
            return None;
        }
        if let Some(ns) = &self.spec.namespace {
            if &c.ns != ns {
                return None;
            }
        }
        match c.ctype {
            ChangeType::Added => self.spec.matches(&c.obj).then(|| event("ADDED", &c.obj)),
            ChangeType::Deleted => {
                let was = c.prev.as_deref().unwrap_or(&c.obj);
                (self.spec.matches(&c.obj) || self.spec.matches(was))
                    .then(|| event("DELETED", &c.obj))
            }
            ChangeType::Modified => {
                let now = self.spec.matches(&c.obj);
                let before = c.prev.as_deref().is_some_and(|p| self.spec.matches(p));
                match (before, now) {
                    (true, true) => Some(event("MODIFIED", &c.obj)),
                    (false, true) => Some(event("ADDED", &c.obj)),
                    (true, false) => c
                        .prev
                        .as_deref()
                        .map(|p| event("DELETED", &with_rv(p, c.rv))),
                    (false, false) => None,
                }
            }
        }
    }

    /// Queues events for changes after `last_rv`. A watcher of one object that has scanned
    /// once, woken with no change of its object since (the epoch, a bookmark), moves its
    /// cursor to the head without scanning: the watch cache indexes such a watcher by its
    /// trigger value and never shows it other objects' events (k8s.io/apiserver
    /// pkg/storage/cacher/cacher.go: `startDispatching` picks the watchers of the event's
    /// trigger values from `watchers indexedWatchers`, and the unindexed ones), so its cost
    /// per change does not grow with the number of such watchers.
    fn collect(&mut self) {
        if self.scanned && self.epoch.is_some() && *self.rx.borrow() <= self.last_rv {
            let head = lock(&self.inner.store).resource_version();
            self.last_rv = self.last_rv.max(head);
            return;
        }
        let (changes, head) = {
            let store = lock(&self.inner.store);
            (store.changes_since(self.last_rv), store.resource_version())
        };
        self.scanned = true;
        match changes {
            Ok(changes) => {
                for c in &changes {
                    if let Some(b) = self.translate(c) {
                        self.queue.push_back(b);
                    }
                }
                self.last_rv = changes.last().map_or(head, |c| c.rv).max(self.last_rv);
            }
            Err(oldest) => {
                self.queue.push_back(expired_event(self.last_rv, oldest));
                self.done = true;
            }
        }
    }
}

async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

enum Wake {
    Changed(bool),
    Bookmark,
    Timeout,
}

/// Starts a watch; the response streams until timeout, an error, or the connection drops.
pub(crate) fn start(inner: &Arc<Inner>, spec: WatchSpec) -> Result<Response<Body>, ApiError> {
    let rv = spec.resource_version.clone().unwrap_or_default();
    let resume: Option<u64> = if rv.is_empty() || rv == "0" || spec.send_initial_events {
        None
    } else {
        Some(
            rv.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv:?}")))?,
        )
    };
    let mut state = {
        let mut store = lock(&inner.store);
        let cluster_scoped = !resources::get(spec.rid).namespaced;
        let (rx, epoch) = match spec.field.pinned_name() {
            Some(name) if cluster_scoped || spec.namespace.is_some() => {
                let ns = spec.namespace.clone().unwrap_or_default();
                let (rx, epoch) = store.subscribe_named(spec.rid, &ns, name);
                (rx, Some(epoch))
            }
            _ => (store.subscribe(), None),
        };
        let mut queue = VecDeque::new();
        let mut done = false;
        let last_rv = match resume {
            None => {
                for obj in store.list(
                    spec.rid,
                    spec.namespace.as_deref(),
                    &spec.label,
                    &spec.field,
                ) {
                    queue.push_back(event("ADDED", &obj));
                }
                store.resource_version()
            }
            Some(n) => {
                if let Err(oldest) = store.changes_since(n) {
                    queue.push_back(expired_event(n, oldest));
                    done = true;
                }
                n
            }
        };
        WatchState {
            inner: inner.clone(),
            deadline: spec.timeout.map(|t| Instant::now() + t),
            spec,
            last_rv,
            queue,
            rx,
            epoch,
            scanned: false,
            done,
        }
    };
    if state.spec.send_initial_events && state.spec.bookmarks {
        let b = state.bookmark(true);
        state.queue.push_back(b);
    }

    let stream = futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(b) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(Frame::data(b)), st));
            }
            if st.done {
                return None;
            }
            st.rx.borrow_and_update();
            if let Some(e) = st.epoch.as_mut() {
                e.borrow_and_update();
            }
            st.collect();
            if !st.queue.is_empty() || st.done {
                continue;
            }
            let interval = st.inner.bookmark_interval();
            let bookmarks = st.spec.bookmarks;
            let deadline = st.deadline;
            let epoch = async {
                match st.epoch.as_mut() {
                    Some(e) => e.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            let wake = tokio::select! {
                r = st.rx.changed() => Wake::Changed(r.is_ok()),
                r = epoch => Wake::Changed(r),
                _ = tokio::time::sleep(interval), if bookmarks => Wake::Bookmark,
                _ = until(deadline) => Wake::Timeout,
            };
            match wake {
                Wake::Changed(true) => {}
                Wake::Changed(false) | Wake::Timeout => return None,
                Wake::Bookmark => {
                    let b = st.bookmark(false);
                    st.queue.push_back(b);
                }
            }
        }
    });
    let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    Ok(resp)
}
