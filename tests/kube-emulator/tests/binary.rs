//! The binary and the `/_emulator` control endpoints.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Stdio;

use common::{client, code_reason};
use faultline_kube_emulator::{Call, Emulator};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node};
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::json;

#[tokio::test]
async fn control_endpoints() {
    let emu = Emulator::start().await.unwrap();
    let c = client(&emu, "t").await;

    let req = |method: &str, path: &str, body: serde_json::Value| {
        http::Request::builder()
            .method(method)
            .uri(path)
            .header("Content-Type", "application/json")
            .body(serde_json::to_vec(&body).unwrap())
            .unwrap()
    };
    let stored: serde_json::Value = c
        .request(req(
            "POST",
            "/_emulator/objects",
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "seeded"}}),
        ))
        .await
        .unwrap();
    assert_eq!(stored["metadata"]["namespace"], "default");

    let _: serde_json::Value = c
        .request(req(
            "POST",
            "/_emulator/faults",
            json!({"method": "GET", "path_contains": "seeded", "action": {"status": {"code": 503}}, "times": 1}),
        ))
        .await
        .unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(common::client_no_retry(&emu, "t").await, "default");
    assert_eq!(code_reason(&cms.get("seeded").await.unwrap_err()).0, 503);
    cms.get("seeded").await.unwrap();

    let calls: Vec<Call> = c
        .request(req("GET", "/_emulator/calls", json!(null)))
        .await
        .unwrap();
    assert_eq!(calls.len(), 2, "control calls are not logged: {calls:?}");
    assert!(calls[0].injected);
    let _: serde_json::Value = c
        .request(req("DELETE", "/_emulator/calls", json!(null)))
        .await
        .unwrap();
    assert!(emu.calls().is_empty());
    let _: serde_json::Value = c
        .request(req("DELETE", "/_emulator/faults", json!(null)))
        .await
        .unwrap();
}

#[tokio::test]
async fn binary_serves_seeds_and_writes_a_kubeconfig() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("emulator.kubeconfig");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_faultline-kube-emulator"))
        .args(["--listen", "127.0.0.1:0", "--kubeconfig"])
        .arg(&kubeconfig)
        .args([
            "--token",
            "dev",
            "--node",
            "gpu-1",
            "--node",
            "gpu-2",
            "--namespace",
            "faultline",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _guard = KillOnDrop(child);
    let kc = common::eventually(|| {
        let path = kubeconfig.clone();
        async move { Kubeconfig::read_from(&path).ok() }
    })
    .await;
    let cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    let c = Client::try_from(cfg).unwrap();
    let nodes: Api<Node> = Api::all(c.clone());
    let names: Vec<String> = nodes
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert_eq!(names, ["gpu-1", "gpu-2"]);
    Api::<Namespace>::all(c).get("faultline").await.unwrap();
}

/// Stops the spawned emulator process even when an assertion fails.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
