//! Events (kube-runtime's Recorder, core/v1 events) and leases.
#![allow(clippy::unwrap_used)]

mod common;

use common::{client, code_reason};
use faultline_kube_emulator::{node, Emulator};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Node};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Resource;
use serde_json::json;

#[tokio::test]
async fn recorder_publishes_then_patches_a_series_on_a_node() {
    let emu = Emulator::start().await.unwrap();
    emu.put(node("gpu-1", &[]));
    let c = client(&emu, "t").await;
    let n: Node = Api::<Node>::all(c.clone()).get("gpu-1").await.unwrap();
    let reference = n.object_ref(&());
    let recorder = Recorder::new(
        c.clone(),
        Reporter {
            controller: "faultline".into(),
            instance: Some("faultline-gpu-1".into()),
        },
    );
    let ev = Event {
        type_: EventType::Warning,
        reason: "GpuXid".into(),
        note: Some("Xid 79 on GPU 3".into()),
        action: "Cordon".into(),
        secondary: None,
    };
    emu.clear_calls();
    recorder.publish(&ev, &reference).await.unwrap();
    recorder.publish(&ev, &reference).await.unwrap();

    let writes: Vec<(String, Option<String>, u16)> = emu
        .calls()
        .into_iter()
        .map(|c| (c.method, c.content_type, c.status))
        .collect();
    assert_eq!(writes.len(), 2, "{writes:?}");
    assert_eq!(writes[0].0, "POST");
    assert_eq!(writes[0].2, 201);
    assert_eq!(writes[1].0, "PATCH");
    assert_eq!(writes[1].1.as_deref(), Some("application/merge-patch+json"));
    assert_eq!(writes[1].2, 200);

    // Cluster-scoped objects get their events in "default".
    let events = emu.list("events.k8s.io", "events", Some("default"));
    assert_eq!(events.len(), 1);
    let e = &events[0];
    assert_eq!(e["series"]["count"], 2);
    assert_eq!(e["regarding"]["kind"], "Node");
    assert_eq!(e["regarding"]["name"], "gpu-1");
    assert_eq!(e["reason"], "GpuXid");
    assert_eq!(e["reportingController"], "faultline");
    assert_eq!(e["type"], "Warning");
    assert!(
        emu.list("", "events", None).is_empty(),
        "core events are stored separately"
    );
}

#[tokio::test]
async fn core_events_patch_and_select() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "t").await;
    let events: Api<CoreEvent> = Api::namespaced(c.clone(), "default");
    let ev: CoreEvent = serde_json::from_value(json!({
        "metadata": {"name": "gpu-1.1"},
        "involvedObject": {"kind": "Node", "name": "gpu-1", "apiVersion": "v1"},
        "reason": "GpuXid", "message": "Xid 79", "type": "Warning", "count": 1,
        "source": {"component": "faultline"}
    }))
    .unwrap();
    events.create(&PostParams::default(), &ev).await.unwrap();
    let patched = events
        .patch(
            "gpu-1.1",
            &PatchParams::default(),
            &Patch::Strategic(json!({"count": 2, "lastTimestamp": "2025-01-01T00:00:00Z"})),
        )
        .await
        .unwrap();
    assert_eq!(patched.count, Some(2));
    let found = events
        .list(&ListParams::default().fields("involvedObject.name=gpu-1,source=faultline"))
        .await
        .unwrap();
    assert_eq!(found.items.len(), 1);
    let none = events
        .list(&ListParams::default().fields("involvedObject.kind=Pod"))
        .await
        .unwrap();
    assert!(none.items.is_empty());
}

#[tokio::test]
async fn lease_updates_need_the_current_resource_version() {
    let emu = Emulator::start().await.unwrap();
    let a: Api<Lease> = Api::namespaced(client(&emu, "a").await, "kube-node-lease");
    let b: Api<Lease> = Api::namespaced(client(&emu, "b").await, "kube-node-lease");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "faultline-leader"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15,
                 "acquireTime": "2025-01-01T00:00:00.000000Z", "renewTime": "2025-01-01T00:00:00.000000Z"}
    }))
    .unwrap();
    a.create(&PostParams::default(), &lease).await.unwrap();

    // Both read the same version; the first write wins, the second conflicts.
    let mut seen_a = a.get("faultline-leader").await.unwrap();
    let mut seen_b = b.get("faultline-leader").await.unwrap();
    seen_a.spec.as_mut().unwrap().renew_time = None;
    a.replace("faultline-leader", &PostParams::default(), &seen_a)
        .await
        .unwrap();
    seen_b.spec.as_mut().unwrap().holder_identity = Some("b".into());
    let err = b
        .replace("faultline-leader", &PostParams::default(), &seen_b)
        .await
        .unwrap_err();
    assert_eq!(code_reason(&err), (409, "Conflict".into()));
    let current = b.get("faultline-leader").await.unwrap();
    assert_eq!(current.spec.unwrap().holder_identity.as_deref(), Some("a"));

    // Leases may be created by PUT.
    let mut fresh = lease.clone();
    fresh.metadata.name = Some("by-put".into());
    let made = a
        .replace("by-put", &PostParams::default(), &fresh)
        .await
        .unwrap();
    assert!(made.metadata.resource_version.is_some());
}
