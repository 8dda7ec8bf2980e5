//! Shared helpers for the integration tests: kube clients built from the
//! kubeconfig the emulator writes, and error inspection.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use faultline_kube_emulator::Emulator;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// The kube config for `token`, read back from a kubeconfig file the emulator wrote.
pub async fn config(emu: &Emulator, token: &str) -> Config {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&path, token).unwrap();
    let kc = Kubeconfig::read_from(&path).unwrap();
    Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap()
}

/// A client authenticating with `token`.
pub async fn client(emu: &Emulator, token: &str) -> Client {
    Client::try_from(config(emu, token).await).unwrap()
}

/// A client with kube's default retries (429/503/504) turned off.
pub async fn client_no_retry(emu: &Emulator, token: &str) -> Client {
    let mut cfg = config(emu, token).await;
    cfg.default_retry = false;
    Client::try_from(cfg).unwrap()
}

/// A client whose responses time out after `read_timeout`.
pub async fn client_with_timeout(emu: &Emulator, token: &str, read_timeout: Duration) -> Client {
    let mut cfg = config(emu, token).await;
    cfg.read_timeout = Some(read_timeout);
    cfg.default_retry = false;
    Client::try_from(cfg).unwrap()
}

/// The Kubernetes Status of an API error, if it is one.
pub fn status(err: &kube::Error) -> Option<&kube::core::Status> {
    match err {
        kube::Error::Api(s) => Some(s.as_ref()),
        _ => None,
    }
}

/// (code, reason) of an API error; panics for transport errors.
pub fn code_reason(err: &kube::Error) -> (u16, String) {
    let s = status(err).unwrap_or_else(|| panic!("not an API error: {err:?}"));
    (s.code, s.reason.clone())
}

/// Polls `f` until it returns Some, up to ~10 s.
pub async fn eventually<T, F, Fut>(mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    for _ in 0..200 {
        if let Some(v) = f().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("condition not reached");
}
