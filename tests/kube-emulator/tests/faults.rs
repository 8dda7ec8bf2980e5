//! Fault injection, the call log, down()/up(), and many concurrent clients.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{client, client_no_retry, client_with_timeout, code_reason, eventually, status};
use faultline_kube_emulator::{Emulator, FaultAction, FaultRule};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use serde_json::json;

fn cm(name: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "v"}})).unwrap()
}

#[tokio::test]
async fn status_faults_and_call_log() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "agent-token").await, "default");
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();

    emu.clear_calls();
    emu.inject(
        FaultRule::status(500)
            .on_method("GET")
            .on_path("configmaps/c1")
            .times(1),
    );
    let err = cms.get("c1").await.unwrap_err();
    assert_eq!(code_reason(&err), (500, "InternalError".into()));
    cms.get("c1").await.unwrap();

    // Injected 409 on a write, without touching state.
    emu.inject(FaultRule::status(409).on_method("PATCH").times(1));
    let err = cms
        .patch(
            "c1",
            &PatchParams::apply("faultline").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c1"}, "data": {"k": "changed"}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (409, "Conflict".into()));
    assert_eq!(cms.get("c1").await.unwrap().data.unwrap()["k"], "v");

    let calls = emu.calls();
    let summary: Vec<(&str, u16, bool)> = calls
        .iter()
        .map(|c| (c.method.as_str(), c.status, c.injected))
        .collect();
    assert_eq!(
        summary,
        [
            ("GET", 500, true),
            ("GET", 200, false),
            ("PATCH", 409, true),
            ("GET", 200, false)
        ]
    );
    let patch = &calls[2];
    assert!(patch.is_write());
    assert!(!calls[0].is_write());
    assert_eq!(patch.path, "/api/v1/namespaces/default/configmaps/c1");
    assert_eq!(patch.field_manager.as_deref(), Some("faultline"));
    assert_eq!(
        patch.content_type.as_deref(),
        Some("application/apply-patch+yaml")
    );
    assert!(patch.query.contains("force=true"));
    assert_eq!(patch.token.as_deref(), Some("agent-token"));
}

#[tokio::test]
async fn too_many_requests_with_retry_after() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "t").await;
    let cms: Api<ConfigMap> = Api::namespaced(c, "default");
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();

    // kube-rs retries 429 by default, honouring Retry-After.
    emu.clear_calls();
    emu.inject(FaultRule::too_many_requests(1).on_method("GET").times(2));
    cms.get("c1").await.unwrap();
    let statuses: Vec<(u16, bool)> = emu.calls().iter().map(|c| (c.status, c.injected)).collect();
    assert_eq!(statuses, [(429, true), (429, true), (200, false)]);

    // Without retries the 429 surfaces with retryAfterSeconds.
    let raw: Api<ConfigMap> = Api::namespaced(client_no_retry(&emu, "t").await, "default");
    emu.inject(FaultRule::too_many_requests(3).times(1));
    let err = raw.get("c1").await.unwrap_err();
    assert_eq!(code_reason(&err), (429, "TooManyRequests".into()));
    assert_eq!(
        status(&err)
            .unwrap()
            .details
            .as_ref()
            .unwrap()
            .retry_after_seconds,
        3
    );

    // Rules are consumed in order; a rule without `times` stays until cleared.
    let id = emu.inject(FaultRule::status(503));
    for _ in 0..3 {
        assert_eq!(code_reason(&raw.get("c1").await.unwrap_err()).0, 503);
    }
    assert!(emu.remove_fault(id));
    raw.get("c1").await.unwrap();
    emu.inject(FaultRule::status(503));
    emu.clear_faults();
    raw.get("c1").await.unwrap();
}

#[tokio::test]
async fn hang_delay_and_reset() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "t").await, "default");
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();

    // Hang: the client gives up on its own timeout.
    let impatient: Api<ConfigMap> = Api::namespaced(
        client_with_timeout(&emu, "t", Duration::from_millis(300)).await,
        "default",
    );
    emu.inject(FaultRule::hang().on_path("configmaps/c1").times(1));
    let err = impatient.get("c1").await.unwrap_err();
    assert!(
        status(&err).is_none(),
        "transport error expected, got {err:?}"
    );
    impatient.get("c1").await.unwrap();
    let hung = emu.calls().into_iter().find(|c| c.injected).unwrap();
    assert_eq!(hung.status, 0);

    // Delay: slow but successful.
    emu.clear_calls();
    emu.inject(FaultRule::delay(Duration::from_millis(200)).times(1));
    cms.get("c1").await.unwrap();
    let calls = emu.calls();
    assert_eq!((calls[0].status, calls[0].injected), (200, true));

    // Reset: the connection drops without a response; the next request reconnects.
    emu.inject(FaultRule::reset().on_method("GET").times(1));
    let err = cms.get("c1").await.unwrap_err();
    assert!(
        status(&err).is_none(),
        "transport error expected, got {err:?}"
    );
    cms.get("c1").await.unwrap();

    // The JSON form used by POST /_emulator/faults.
    let rule: FaultRule =
        serde_json::from_value(json!({"action": {"delay": 10}, "times": 1})).unwrap();
    assert_eq!(rule.action, FaultAction::Delay(Duration::from_millis(10)));
}

#[tokio::test]
async fn down_drops_hung_requests_and_watches_then_up_serves_again() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "t").await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    cms.create(&PostParams::default(), &cm("c1")).await.unwrap();

    // A watcher that must survive the outage.
    let mut applied = watcher(cms.clone(), watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    let first = tokio::time::timeout(Duration::from_secs(10), applied.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.metadata.name.as_deref(), Some("c1"));

    // A hung request is dropped by down().
    emu.inject(FaultRule::hang().on_path("configmaps/hang-me").times(1));
    let hung = tokio::spawn({
        let cms = cms.clone();
        async move { cms.get("hang-me").await }
    });
    eventually(|| async {
        emu.calls()
            .iter()
            .any(|c| c.path.ends_with("hang-me"))
            .then_some(())
    })
    .await;
    emu.down().await;
    assert!(!emu.is_up());
    let res = tokio::time::timeout(Duration::from_secs(10), hung)
        .await
        .expect("hung request should fail once the server is down")
        .unwrap();
    let err = res.unwrap_err();
    assert!(status(&err).is_none(), "{err:?}");

    // While down, nothing answers.
    let quick: Api<ConfigMap> = Api::namespaced(
        client_with_timeout(&emu, "t", Duration::from_secs(2)).await,
        "default",
    );
    assert!(quick.get("c1").await.is_err());

    // State survives; writes made directly while down are seen after up().
    emu.put(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "while-down", "namespace": "default"}}));
    emu.up().await.unwrap();
    assert!(emu.is_up());
    let got = eventually(|| async { cms.get("c1").await.ok() }).await;
    assert_eq!(got.data.unwrap()["k"], "v");

    // The watcher reconnects and delivers what happened meanwhile and after.
    cms.create(&PostParams::default(), &cm("after-up"))
        .await
        .unwrap();
    let mut seen = Vec::new();
    while !(seen.contains(&"while-down".to_string()) && seen.contains(&"after-up".to_string())) {
        let o = tokio::time::timeout(Duration::from_secs(30), applied.next())
            .await
            .expect("watcher did not recover")
            .unwrap();
        if let Ok(o) = o {
            seen.push(o.metadata.name.unwrap());
        }
    }
}

#[tokio::test]
async fn two_hundred_concurrent_clients() {
    let emu = Emulator::start().await.unwrap();
    let mut clients = Vec::new();
    for i in 0..200 {
        let mut cfg = common::config(&emu, &format!("client-{i}")).await;
        // Plain HTTP needs no trust store; skipping the OS roots keeps 200 clients cheap.
        cfg.root_cert = Some(Vec::new());
        clients.push(kube::Client::try_from(cfg).unwrap());
    }
    // Some of them hold watches open at the same time.
    let mut watches = Vec::new();
    for c in clients.iter().take(50) {
        let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
        watches.push(
            cms.watch(&kube::api::WatchParams::default(), "0")
                .await
                .unwrap()
                .boxed(),
        );
    }
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            tokio::spawn(async move {
                let cms: Api<ConfigMap> = Api::namespaced(c, "default");
                let name = format!("cm-{i}");
                cms.create(&PostParams::default(), &cm(&name)).await?;
                cms.patch(
                    &name,
                    &PatchParams::apply(&format!("mgr-{i}")),
                    &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"i": i.to_string()}})),
                )
                .await?;
                cms.list(&ListParams::default().labels("missing")).await?;
                Ok::<_, kube::Error>(())
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(emu.list("", "configmaps", Some("default")).len(), 200);
    let tokens: std::collections::BTreeSet<String> =
        emu.calls().into_iter().filter_map(|c| c.token).collect();
    assert_eq!(tokens.len(), 200);
    // Every watcher saw 400 changes (200 creates + 200 applies).
    for mut w in watches {
        let mut n = 0;
        while n < 400 {
            let e = tokio::time::timeout(Duration::from_secs(20), w.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            if matches!(
                e,
                kube::api::WatchEvent::Added(_) | kube::api::WatchEvent::Modified(_)
            ) {
                n += 1;
            }
        }
    }
}

/// `set_write_latency` holds every write at least the range's minimum (a real API server's
/// write path). Only the lower bound is checked: an upper bound would be a timing test on a
/// shared machine.
#[tokio::test]
async fn writes_wait_the_configured_latency_and_reads_do_not() {
    let emu = Emulator::start().await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client(&emu, "agent-token").await, "default");
    cms.create(&PostParams::default(), &cm("warm"))
        .await
        .unwrap();
    emu.set_write_latency(Duration::from_millis(300), Duration::from_millis(320));
    for i in 0..3 {
        let t = std::time::Instant::now();
        cms.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
    }
    assert_eq!(
        emu.calls().iter().filter(|c| c.method == "POST").count(),
        4,
        "every write was served after its wait"
    );
}

/// A metadata-only list (`Accept: ...;as=PartialObjectMetadataList`, what `list_metadata`
/// sends) is answered with metadata only, as a real API server does: no `data` travels.
#[tokio::test]
async fn metadata_only_lists_carry_no_data() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "agent-token").await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    cms.create(&PostParams::default(), &cm("m1")).await.unwrap();
    let req = http::Request::get("/api/v1/namespaces/default/configmaps")
        .header(
            "Accept",
            "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
        )
        .body(Vec::new())
        .unwrap();
    let text = c.request_text(req).await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["kind"], "PartialObjectMetadataList");
    assert_eq!(v["items"][0]["metadata"]["name"], "m1");
    assert!(v["items"][0].get("data").is_none(), "{v}");
    let listed = cms.list_metadata(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);
}
