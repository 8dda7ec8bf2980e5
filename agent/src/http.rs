//! The agent's HTTP endpoints on one port: `/metrics` (Prometheus text), `/healthz` (the engine
//! loop is alive), `/readyz` (the newest record is on disk), `/v1/record` (the latest
//! record as JSON).

use std::net::SocketAddr;
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
pub(crate) const STALE_MS: i64 = 30_000;

/// Shared state of the endpoints.
#[derive(Debug, Clone)]
pub struct HttpState {
    pub metrics: Arc<Metrics>,
    pub heartbeat: Arc<Heartbeat>,
    pub clock: Arc<dyn Clock>,
    /// `/readyz` is 200 while the newest record is on disk.
    pub record: watch::Receiver<crate::sink::file::RecordStatus>,
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
    if s.record.borrow().is_written() {
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
/// Serves until shutdown. Connections come through [`crate::listen::incoming`] (a cap and an
/// idle timeout); each is HTTP/1.1 with a 10 s limit on reading a request's headers.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    use futures::StreamExt;
    let metrics = state.metrics.clone();
    let app = router(state);
    let mut incoming = std::pin::pin!(crate::listen::incoming(
        listener,
        crate::listen::HTTP_LIMITS,
        metrics,
        "http",
    ));
    loop {
        let io = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            next = incoming.next() => match next {
                Some(Ok(io)) => io,
                Some(Err(_)) => continue,
                None => return Ok(()),
            },
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(hyper_util::rt::TokioIo::new(io), svc);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = shutdown.cancelled() => {
                    // Let a request in flight finish, then close.
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), conn).await;
                }
            }
        });
    }
}

/// Binds the listener (separately, so the caller learns the port before serving).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
