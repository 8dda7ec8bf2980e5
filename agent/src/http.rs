//! The agent's HTTP endpoints on one port: `/metrics` (Prometheus text), `/healthz` (the engine
//! loop is alive), `/readyz` (the newest record is on disk), `/v1/record` (the latest
//! record as JSON).
//!
//! Whoever can reach the port can hold connections, so every connection is bounded
//! ([`ServeLimits`]): the connection caps and idle timeout of `crate::listen`, a deadline on
//! reading a request's headers, and a deadline on the whole request (one request per
//! connection, so the connection's deadline is the request's). Scrapers and probes send one
//! small request and read one response; none of this slows them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;

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
    let age = s.heartbeat.age_ms(&*s.clock);
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

/// The latest record, its `heartbeatTime` the engine loop's last beat (what `/healthz` reads),
/// so a reader elsewhere (`faultline hosts --members`) can tell a live agent as the local file's
/// heartbeat tells it.
async fn record(State(s): State<HttpState>) -> Response {
    let snap = s.snapshots.borrow().clone();
    match snap {
        Some(snap) => {
            let mut r = (*snap.record).clone();
            r.agent.heartbeat_time = s.heartbeat.last();
            (
                [(header::CONTENT_TYPE, "application/json")],
                serde_json::to_string_pretty(&r).unwrap_or_default(),
            )
                .into_response()
        }
        None => (StatusCode::SERVICE_UNAVAILABLE, "no record yet\n").into_response(),
    }
}

/// What one client may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Open connections (caps, idle timeout, maximum age).
    pub connections: crate::listen::Limits,
    /// From accepting a connection to the end of its request's headers.
    pub header_read: Duration,
    /// From accepting a connection to the end of its response (a slow body, a client that does
    /// not read the response): then the connection is closed.
    pub request: Duration,
}

/// The limits of the agent's endpoints. A probe or a scrape is one small request answered at
/// once; 5 s for the headers and 15 s in all are far beyond what either needs, even for the
/// record (at most about 1 MiB) on a slow link.
pub const LIMITS: ServeLimits = ServeLimits {
    connections: crate::listen::HTTP_LIMITS,
    header_read: Duration::from_secs(5),
    request: Duration::from_secs(15),
};

/// Serves until shutdown, within [`LIMITS`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_with(listener, state, shutdown, LIMITS).await
}

/// Serves until shutdown. Connections come through [`crate::listen::incoming`] (the caps and the
/// idle timeout); each carries one HTTP/1.1 request (no keep-alive) under `limits`.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
    limits: ServeLimits,
) -> std::io::Result<()> {
    use futures::StreamExt;
    let metrics = state.metrics.clone();
    let app = router(state);
    let mut incoming = std::pin::pin!(crate::listen::incoming(
        listener,
        limits.connections,
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
                .header_read_timeout(limits.header_read)
                .keep_alive(false)
                .serve_connection(hyper_util::rt::TokioIo::new(io), svc);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                done = tokio::time::timeout(limits.request, conn.as_mut()) => {
                    if done.is_err() {
                        debug!(deadline_ms = limits.request.as_millis() as u64, "HTTP request past its deadline; connection closed");
                    }
                }
                _ = shutdown.cancelled() => {
                    // Let a request in flight finish, then close.
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(2), conn).await;
                }
            }
        });
    }
}

/// Binds the listener (separately, so the caller learns the port before serving).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::listen::Limits;
    use crate::runtime::SystemClock;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// An agent's endpoints on a loopback port under `limits`.
    async fn server(limits: ServeLimits) -> (SocketAddr, CancellationToken) {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let heartbeat = Arc::new(Heartbeat::default());
        heartbeat.beat(&*clock);
        let state = HttpState {
            metrics: Arc::new(Metrics::new()),
            heartbeat,
            clock,
            record: watch::channel(crate::sink::file::RecordStatus::Written).1,
            snapshots: watch::channel(None).1,
        };
        let shutdown = CancellationToken::new();
        tokio::spawn(serve_with(listener, state, shutdown.clone(), limits));
        (addr, shutdown)
    }

    fn limits(header_read: Duration, request: Duration) -> ServeLimits {
        ServeLimits {
            connections: Limits {
                max_connections: 4,
                max_per_address: 2,
                idle: Duration::from_secs(60),
                max_age: Duration::from_secs(600),
            },
            header_read,
            request,
        }
    }

    async fn connect_from(local: &str, to: SocketAddr) -> TcpStream {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(format!("{local}:0").parse().unwrap()).unwrap();
        s.connect(to).await.unwrap()
    }

    /// Reads until the server closes; how long that took (panics past `limit`).
    async fn closed_within(c: &mut TcpStream, limit: Duration) -> Duration {
        let started = std::time::Instant::now();
        let mut sink = Vec::new();
        tokio::time::timeout(limit, c.read_to_end(&mut sink))
            .await
            .expect("the server closes the connection")
            .ok();
        started.elapsed()
    }

    async fn healthz(c: &mut TcpStream) -> String {
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut out))
            .await
            .expect("answered and closed (one request per connection)")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    /// A slowloris client (half a request line, then nothing) is dropped at the header
    /// deadline, and a request that cannot finish within the whole-request deadline at that
    /// one, whichever is shorter; an ordinary request is answered meanwhile.
    #[tokio::test]
    async fn slow_clients_are_dropped_at_the_deadlines() {
        let (addr, shutdown) =
            server(limits(Duration::from_millis(300), Duration::from_secs(30))).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /hea").await.unwrap();
        let mut ok = TcpStream::connect(addr).await.unwrap();
        assert!(healthz(&mut ok).await.starts_with("HTTP/1.1 200"));
        let took = closed_within(&mut slow, Duration::from_secs(5)).await;
        assert!(took < Duration::from_secs(3), "{took:?}");
        shutdown.cancel();

        // The headers may take long, the request may not.
        let (addr, shutdown) =
            server(limits(Duration::from_secs(30), Duration::from_millis(500))).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ".iter() {
            if slow.write_all(&[*b]).await.is_err() {
                break;
            }
        }
        let took = closed_within(&mut slow, Duration::from_secs(5)).await;
        assert!(started.elapsed() >= Duration::from_millis(400), "{took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
        shutdown.cancel();
    }

    /// Connections over the per-address cap are closed at once, while a client from another
    /// address is answered.
    #[tokio::test]
    async fn connections_over_the_limit_are_closed_and_others_served() {
        let (addr, shutdown) =
            server(limits(Duration::from_secs(30), Duration::from_secs(30))).await;
        let _held = [
            connect_from("127.0.0.1", addr).await,
            connect_from("127.0.0.1", addr).await,
        ];
        let mut over = connect_from("127.0.0.1", addr).await;
        let took = closed_within(&mut over, Duration::from_secs(5)).await;
        assert!(took < Duration::from_secs(2), "{took:?}");
        let mut other = connect_from("127.0.0.2", addr).await;
        assert!(healthz(&mut other).await.starts_with("HTTP/1.1 200"));
        shutdown.cancel();
    }
}
