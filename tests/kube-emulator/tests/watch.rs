//! Watches: kube-runtime's watcher, resumption from a resourceVersion,
//! bookmarks, 410 Expired, selector transitions and timeouts.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::client;
use faultline_kube_emulator::{Emulator, ResourceRef};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::watcher;
use serde_json::json;

fn cm(name: &str, labels: serde_json::Value) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
}

async fn next<S, T>(s: &mut S) -> T
where
    S: futures::Stream<Item = T> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("no event within 10 s")
        .expect("stream ended")
}

fn name_of(e: &WatchEvent<ConfigMap>) -> String {
    match e {
        WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => {
            o.metadata.name.clone().unwrap()
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn runtime_watcher_sees_changes() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    cms.create(&PostParams::default(), &cm("before", json!({})))
        .await
        .unwrap();

    let mut stream = watcher(cms.clone(), watcher::Config::default()).boxed();
    let mut init = Vec::new();
    loop {
        match next(&mut stream).await.unwrap() {
            watcher::Event::Init => {}
            watcher::Event::InitApply(o) => init.push(o.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(init, ["before"]);

    cms.create(&PostParams::default(), &cm("live", json!({})))
        .await
        .unwrap();
    cms.patch(
        "live",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"a": "b"}})),
    )
    .await
    .unwrap();
    cms.delete("live", &Default::default()).await.unwrap();

    match next(&mut stream).await.unwrap() {
        watcher::Event::Apply(o) => assert!(o.data.is_none()),
        other => panic!("{other:?}"),
    }
    match next(&mut stream).await.unwrap() {
        watcher::Event::Apply(o) => assert_eq!(o.data.unwrap()["a"], "b"),
        other => panic!("{other:?}"),
    }
    match next(&mut stream).await.unwrap() {
        watcher::Event::Delete(o) => assert_eq!(o.metadata.name.as_deref(), Some("live")),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn streaming_list_watcher() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    for n in ["a", "b"] {
        cms.create(&PostParams::default(), &cm(n, json!({})))
            .await
            .unwrap();
    }
    let mut stream = watcher(cms.clone(), watcher::Config::default().streaming_lists()).boxed();
    let mut init = Vec::new();
    loop {
        match next(&mut stream).await.unwrap() {
            watcher::Event::Init => {}
            watcher::Event::InitApply(o) => init.push(o.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(init, ["a", "b"]);
    cms.create(&PostParams::default(), &cm("c", json!({})))
        .await
        .unwrap();
    match next(&mut stream).await.unwrap() {
        watcher::Event::Apply(o) => assert_eq!(o.metadata.name.as_deref(), Some("c")),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn resume_from_resource_version_and_bookmarks() {
    let emu = Emulator::start().await.unwrap();
    emu.set_bookmark_interval(Duration::from_millis(100));
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    cms.create(&PostParams::default(), &cm("old", json!({})))
        .await
        .unwrap();
    let rv = cms
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    // Changes made while nobody watches.
    cms.create(&PostParams::default(), &cm("x", json!({})))
        .await
        .unwrap();
    cms.patch(
        "x",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "v"}})),
    )
    .await
    .unwrap();
    cms.delete("old", &Default::default()).await.unwrap();

    let mut events = cms
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    let e = next(&mut events).await.unwrap();
    assert!(
        matches!(e, WatchEvent::Added(_)) && name_of(&e) == "x",
        "{e:?}"
    );
    let e = next(&mut events).await.unwrap();
    assert!(
        matches!(e, WatchEvent::Modified(_)) && name_of(&e) == "x",
        "{e:?}"
    );
    let e = next(&mut events).await.unwrap();
    assert!(
        matches!(e, WatchEvent::Deleted(_)) && name_of(&e) == "old",
        "{e:?}"
    );
    // Then quiet: a bookmark at the latest resourceVersion.
    match next(&mut events).await.unwrap() {
        WatchEvent::Bookmark(b) => assert_eq!(b.metadata.resource_version, emu.resource_version()),
        other => panic!("{other:?}"),
    }

    // A watch without resourceVersion starts with the current objects.
    let mut fresh = cms
        .watch(&WatchParams::default().disable_bookmarks(), "0")
        .await
        .unwrap()
        .boxed();
    let e = next(&mut fresh).await.unwrap();
    assert!(
        matches!(e, WatchEvent::Added(_)) && name_of(&e) == "x",
        "{e:?}"
    );
}

#[tokio::test]
async fn expired_resource_version_is_410() {
    let emu = Emulator::start().await.unwrap();
    emu.set_history_limit(5);
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    cms.create(&PostParams::default(), &cm("c", json!({})))
        .await
        .unwrap();
    let rv = emu.resource_version();
    for i in 0..10 {
        cms.patch(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"i": i.to_string()}})),
        )
        .await
        .unwrap();
    }
    let mut events = cms
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match next(&mut events).await {
        Ok(WatchEvent::Error(e)) => {
            assert_eq!(e.code, 410);
            assert_eq!(e.reason, "Expired");
        }
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 410),
        other => panic!("{other:?}"),
    }
    assert!(
        tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .unwrap()
            .is_none(),
        "stream ends after the error"
    );

    // kube-runtime's watcher recovers by relisting.
    let mut stream = watcher(cms.clone(), watcher::Config::default()).boxed();
    loop {
        if let watcher::Event::InitDone = next(&mut stream).await.unwrap() {
            break;
        }
    }
}

#[tokio::test]
async fn selectors_filter_and_transitions_emit_deleted() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    let other_ns: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "kube-system");
    let mut events = cms
        .watch(
            &WatchParams::default().labels("app=web").disable_bookmarks(),
            "0",
        )
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &cm("db", json!({"app": "db"})))
        .await
        .unwrap();
    other_ns
        .create(
            &PostParams::default(),
            &cm("web-elsewhere", json!({"app": "web"})),
        )
        .await
        .unwrap();
    cms.create(&PostParams::default(), &cm("web", json!({"app": "web"})))
        .await
        .unwrap();
    let e = next(&mut events).await.unwrap();
    assert!(
        matches!(e, WatchEvent::Added(_)) && name_of(&e) == "web",
        "{e:?}"
    );

    // Leaving the selector is a DELETED for this watcher; entering it an ADDED.
    cms.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "api"}}})),
    )
    .await
    .unwrap();
    let e = next(&mut events).await.unwrap();
    assert!(
        matches!(e, WatchEvent::Deleted(_)) && name_of(&e) == "web",
        "{e:?}"
    );
    cms.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "web"}}})),
    )
    .await
    .unwrap();
    let e = next(&mut events).await.unwrap();
    assert!(
        matches!(e, WatchEvent::Added(_)) && name_of(&e) == "db",
        "{e:?}"
    );

    // Field selector on a single object (how agents watch their own Node).
    emu.put(faultline_kube_emulator::node("n1", &[]));
    emu.put(faultline_kube_emulator::node("n2", &[]));
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client(&emu, "t").await);
    let mut node_events = nodes
        .watch(
            &WatchParams::default()
                .fields("metadata.name=n2")
                .disable_bookmarks(),
            "0",
        )
        .await
        .unwrap()
        .boxed();
    match next(&mut node_events).await.unwrap() {
        WatchEvent::Added(n) => assert_eq!(n.metadata.name.as_deref(), Some("n2")),
        other => panic!("{other:?}"),
    }
    let mut n1 = emu.get(&ResourceRef::node("n1")).unwrap();
    n1["metadata"]["labels"]["x"] = json!("1");
    emu.put(n1);
    let mut n2 = emu.get(&ResourceRef::node("n2")).unwrap();
    n2["metadata"]["labels"]["x"] = json!("2");
    emu.put(n2);
    match next(&mut node_events).await.unwrap() {
        WatchEvent::Modified(n) => {
            assert_eq!(n.metadata.name.as_deref(), Some("n2"));
            assert_eq!(n.metadata.labels.unwrap()["x"], "2");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn timeout_seconds_ends_the_stream() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    let mut events = cms
        .watch(&WatchParams::default().timeout(1).disable_bookmarks(), "0")
        .await
        .unwrap()
        .boxed();
    let end = tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .expect("stream should end on its own");
    assert!(end.is_none());
    let _ = events.try_next().await;
}

/// A watch pinned to one object (`metadata.name=x`, as each agent watches its own Node and
/// ConfigMap) sees that object's changes, stays open through many changes to other objects
/// without a spurious 410 even with a short history (it wakes every half history), and sees
/// nothing of the others.
#[tokio::test]
async fn a_watch_of_one_object_sees_it_and_outlives_others_changes() {
    let emu = Emulator::start().await.unwrap();
    emu.set_history_limit(6);
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    for n in ["mine", "other"] {
        cms.create(&PostParams::default(), &cm(n, json!({})))
            .await
            .unwrap();
    }
    let rv = emu.resource_version();
    let wp = WatchParams::default().fields("metadata.name=mine");
    let mut events = cms.watch(&wp, &rv).await.unwrap().boxed();
    for i in 0..40 {
        cms.patch(
            "other",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"i": i.to_string()}})),
        )
        .await
        .unwrap();
    }
    // Let the watcher wake on the epochs while the others change.
    tokio::time::sleep(Duration::from_millis(200)).await;
    cms.patch(
        "mine",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"x": "1"}})),
    )
    .await
    .unwrap();
    match next(&mut events).await {
        Ok(WatchEvent::Modified(o)) => {
            assert_eq!(o.metadata.name.as_deref(), Some("mine"));
            assert_eq!(o.data.unwrap()["x"], "1");
        }
        other => panic!("expected mine's change, got {other:?}"),
    }
    // A watch across namespaces with a pinned name still sees its object (the global path).
    let all: Api<ConfigMap> = Api::all(client(&emu, "t").await);
    let mut across = all
        .watch(&wp, &emu.resource_version())
        .await
        .unwrap()
        .boxed();
    cms.patch(
        "mine",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"x": "2"}})),
    )
    .await
    .unwrap();
    match next(&mut across).await {
        Ok(e) => assert_eq!(name_of(&e), "mine"),
        other => panic!("{other:?}"),
    }
}

/// A watch of one object resumed from a version before that object's last change sees the
/// change (the history is scanned once from the version asked for), and then only its own
/// object's later changes.
#[tokio::test]
async fn a_resumed_watch_of_one_object_sees_its_change_before_the_watch() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    for n in ["mine", "other"] {
        cms.create(&PostParams::default(), &cm(n, json!({})))
            .await
            .unwrap();
    }
    let before = emu.resource_version();
    let patch = |name: &'static str, v: &'static str| {
        let cms = cms.clone();
        async move {
            cms.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"x": v}})),
            )
            .await
            .unwrap();
        }
    };
    patch("mine", "1").await;
    patch("other", "1").await;
    let wp = WatchParams::default().fields("metadata.name=mine");
    let mut events = cms.watch(&wp, &before).await.unwrap().boxed();
    match next(&mut events).await {
        Ok(WatchEvent::Modified(o)) => assert_eq!(o.data.unwrap()["x"], "1"),
        other => panic!("expected mine's change before the watch, got {other:?}"),
    }
    patch("other", "2").await;
    patch("mine", "2").await;
    match next(&mut events).await {
        Ok(WatchEvent::Modified(o)) => {
            assert_eq!(o.metadata.name.as_deref(), Some("mine"));
            assert_eq!(o.data.unwrap()["x"], "2");
        }
        other => panic!("expected mine's second change, got {other:?}"),
    }
}
