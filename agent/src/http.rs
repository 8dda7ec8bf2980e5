//! The agent's HTTP endpoints on one port: `/metrics` (Prometheus text), `/healthz` (the engine
//! loop is alive), `/readyz` (the newest record is on disk), `/v1/record` (the latest
//! record as JSON).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::runtime::{Clock, Heartbeat, Snapshot};

/// The engine loop beats every tick; this long without a beat means it is stuck.
const STALE_MS: i64 = 30_000;

/// Shared state of the endpoints.
#[derive(Debug, Clone)]
pub struct HttpState {
    pub metrics: Arc<Metrics>,
    pub heartbeat: Arc<Heartbeat>,
    pub clock: Arc<dyn Clock>,
    pub ready: Arc<AtomicBool>,
    pub snapshots: watch::Receiver<Option<Snapshot>>,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/record", get(record))
        .with_state(state)
}

async fn metrics(State(s): State<HttpState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

async fn healthz(State(s): State<HttpState>) -> Response {
    let age = s.heartbeat.age_ms(s.clock.now());
    if age <= STALE_MS {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("engine loop silent for {age} ms\n"),
        )
            .into_response()
    }
}

async fn readyz(State(s): State<HttpState>) -> Response {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the newest record is not on disk (not written yet, or the last write failed)\n",
        )
            .into_response()
    }
}

async fn record(State(s): State<HttpState>) -> Response {
    let snap = s.snapshots.borrow().clone();
    match snap {
        Some(snap) => (
            [(header::CONTENT_TYPE, "application/json")],
            serde_json::to_string_pretty(&*snap.record).unwrap_or_default(),
        )
            .into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "no record yet\n").into_response(),
    }
}

/// Serves until shutdown.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// Binds the listener (separately, so the caller learns the port before serving).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
