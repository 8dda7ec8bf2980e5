//! The agent's HTTP endpoints on one port: `/metrics` (Prometheus text), `/healthz` (the engine
//! loop is alive), `/readyz` (the newest record is on disk and the loop alive), `/v1/record`
//! (the latest record as JSON).
//!
//! `/v1/record` is serialized at most once a second ([`RecordBody`]) and the same bytes are
//! shared by every request, with their `Content-Length`: concurrent readers cost no memory
//! beyond the one body. A response cut by the deadline below ends with a reset of the
//! connection, short of its `Content-Length`: an error to every client, never a whole record.
//!
//! Whoever can reach the port can hold connections, so every connection is bounded
//! ([`ServeLimits`]): the connection caps and idle timeout of `crate::listen`, a deadline on
//! reading a request's headers, and a deadline on the whole request (one request per
//! connection, so the connection's deadline is the request's). Scrapers and probes send one
//! small request and read one response; none of this slows them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::clock::Clock;
use crate::component::{Component, Context, Handle, StartError};
use crate::engine_loop::{Heartbeat, RecordStatus, Snapshot, STALE_MS};
use crate::metrics::Metrics;

/// Port of the endpoints when `--listen` is not given.
pub const DEFAULT_PORT: u16 = 20260;

/// Written into the state directory while the agent runs: the address its endpoints are bound
/// to (useful with `--listen …:0`).
pub(crate) const LISTEN_ADDR_FILE: &str = "listen.addr";

/// The endpoints' flags.
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Address of /metrics, /healthz, /readyz and /v1/record. Default: 0.0.0.0:20260 in a pod,
    /// 127.0.0.1:20260 elsewhere.
    #[arg(long, env = "FAULTLINE_LISTEN")]
    pub listen: Option<SocketAddr>,
}

/// Where the endpoints listen when `--listen` is not given: every interface in a pod (its own
/// network namespace; the kubelet's probes and scrapers come to the pod IP), only loopback
/// elsewhere, where every interface is the host's (bare metal, Slurm).
pub(crate) fn default_listen(in_pod: bool) -> SocketAddr {
    let ip = if in_pod {
        std::net::Ipv4Addr::UNSPECIFIED
    } else {
        std::net::Ipv4Addr::LOCALHOST
    };
    SocketAddr::from((ip, DEFAULT_PORT))
}

/// The endpoints, as the daemon starts them.
#[derive(Debug)]
pub(crate) struct Endpoints {
    pub flags: Flags,
    /// Where the bound address is written ([`LISTEN_ADDR_FILE`]), and removed at the end.
    pub state_dir: std::path::PathBuf,
    pub heartbeat: Arc<Heartbeat>,
    pub record: watch::Receiver<RecordStatus>,
}

impl Component for Endpoints {
    const NAME: &'static str = "http";

    async fn start(self, cx: &Context) -> Result<Handle, StartError> {
        let in_pod = crate::kube_client::in_pod();
        let addr = self.flags.listen.unwrap_or_else(|| default_listen(in_pod));
        let listen = |source| StartError::Listen { addr, source };
        let listener = bind(addr).await.map_err(listen)?;
        let bound = listener.local_addr().map_err(listen)?;
        tracing::info!(addr = %bound, state_dir = %self.state_dir.display(), "faultline agent running");
        let addr_file = self.state_dir.join(LISTEN_ADDR_FILE);
        let _ = crate::atomic_file::write(&addr_file, bound.to_string().as_bytes());
        let state = HttpState {
            metrics: cx.metrics.clone(),
            heartbeat: self.heartbeat,
            clock: cx.clock.clone(),
            record: self.record,
            snapshots: cx.snapshots.clone(),
            record_body: Default::default(),
        };
        let shutdown = cx.shutdown.clone();
        Ok(Handle::spawn(Self::NAME, async move {
            if let Err(e) = serve(listener, state, shutdown).await {
                tracing::warn!(error = %e, "HTTP server stopped");
            }
            let _ = std::fs::remove_file(addr_file);
        }))
    }
}

/// Shared state of the endpoints.
#[derive(Debug, Clone)]
pub(crate) struct HttpState {
    pub metrics: Arc<Metrics>,
    pub heartbeat: Arc<Heartbeat>,
    pub clock: Arc<dyn Clock>,
    /// `/readyz` is 200 while the newest record is on disk (and the heartbeat is fresh).
    pub record: watch::Receiver<RecordStatus>,
    pub snapshots: watch::Receiver<Option<Snapshot>>,
    /// `/v1/record`'s body, shared by every request.
    pub record_body: Arc<RecordBody>,
}

/// The body `/v1/record` serves: the newest snapshot's record stamped with the engine loop's
/// heartbeat, serialized at most once per [`RecordBody::FRESH`] and shared. Requests that arrive
/// while it is being serialized wait for that one serialization instead of making their own.
///
/// The engine loop beats after every batch of inputs and publishes up to ten snapshots a second
/// in a storm: a body per (snapshot, heartbeat) would still be one per request then. A body
/// younger than `FRESH` is served as it is (its heartbeat and content at most that old, far
/// inside the 30 s after which a reader calls an agent dead), so at most one serialization a
/// second, and at most `request deadline / FRESH` (15) bodies alive, whatever the requests.
#[derive(Debug, Default)]
pub(crate) struct RecordBody {
    cached: tokio::sync::Mutex<Option<CachedBody>>,
    /// How many times a body was serialized (tests).
    serialized: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
struct CachedBody {
    revision: u64,
    heartbeat: Option<faultline_core::time::Timestamp>,
    /// When it was serialized, as time since boot.
    at: Duration,
    bytes: Bytes,
}

impl RecordBody {
    /// How long a serialized body is served to requests of newer snapshots or heartbeats.
    pub(crate) const FRESH: Duration = Duration::from_secs(1);

    /// The body for `snap` stamped with `heartbeat` at `now` (time since boot): the shared
    /// bytes when they are of both, or younger than [`RecordBody::FRESH`].
    async fn get(
        &self,
        snap: &Snapshot,
        heartbeat: Option<faultline_core::time::Timestamp>,
        now: Duration,
    ) -> Result<Bytes, serde_json::Error> {
        let mut cached = self.cached.lock().await;
        if let Some(c) = cached.as_ref() {
            let same = c.revision == snap.revision && c.heartbeat == heartbeat;
            if same || now.saturating_sub(c.at) < Self::FRESH {
                return Ok(c.bytes.clone());
            }
        }
        // Dropped first: while this one is serialized, only requests still sending it hold it.
        *cached = None;
        let mut r = (*snap.record).clone();
        r.agent.heartbeat_time = heartbeat;
        let bytes = Bytes::from(serde_json::to_vec_pretty(&r)?);
        self.serialized
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *cached = Some(CachedBody {
            revision: snap.revision,
            heartbeat,
            at: now,
            bytes: bytes.clone(),
        });
        Ok(bytes)
    }

    #[cfg(test)]
    fn serialized(&self) -> u64 {
        self.serialized.load(std::sync::atomic::Ordering::Relaxed)
    }
}

pub(crate) fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/record", get(record))
        .with_state(state)
}

/// `/metrics` in the format the scraper's `Accept` asks for, under that format's content type.
async fn metrics(State(s): State<HttpState>, headers: axum::http::HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = crate::metrics::Format::negotiate(accept);
    (
        [(header::CONTENT_TYPE, format.content_type())],
        s.metrics.encode_as(format),
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

/// 200 while the newest record is on disk and the engine loop has beaten within [`STALE_MS`]:
/// what a reader of the record calls a live agent (its heartbeat no older than 30 s). The agent
/// pod's Ready condition stands for that heartbeat where the record has none (`faultline get
/// --cluster`, `hosts`), so a stuck engine loop turns the pod not Ready once the heartbeat is
/// stale, not only after the liveness probe restarts it.
async fn readyz(State(s): State<HttpState>) -> Response {
    if !s.record.borrow().is_written() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the newest record is not on disk (not written yet, or the last write failed)\n",
        )
            .into_response();
    }
    let age = s.heartbeat.age_ms(&*s.clock);
    if age > STALE_MS {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("engine loop silent for {age} ms: the record's heartbeat is stale\n"),
        )
            .into_response();
    }
    (StatusCode::OK, "ready\n").into_response()
}

/// The latest record, its `heartbeatTime` the engine loop's last beat (what `/healthz` reads),
/// so a reader elsewhere (`faultline hosts --members`) can tell a live agent as the local file's
/// heartbeat tells it.
///
/// The body is the shared one of [`RecordBody`], sent with its `Content-Length`: a body cut by
/// the connection's deadline ends the connection short of that length, which a client reports
/// as an error. One copy for every request: 16 concurrent requests of a large record each
/// serializing their own would take 1.3 GiB. A record that cannot be encoded is an error, not
/// an empty 200.
async fn record(State(s): State<HttpState>) -> Response {
    let snap = s.snapshots.borrow().clone();
    let Some(snap) = snap else {
        return (StatusCode::SERVICE_UNAVAILABLE, "no record yet\n").into_response();
    };
    match s
        .record_body
        .get(&snap, s.heartbeat.last(), s.clock.since_boot())
        .await
    {
        Ok(bytes) => Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_LENGTH, bytes.len())
            .body(Body::from(bytes))
            .unwrap_or_else(|e| {
                (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response()
            }),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the record: {e}\n"),
        )
            .into_response(),
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
/// record on a slow link (about 1 MiB at the default caps, 6 MB at the largest the policy
/// allows: docs/operations.md, "Limits").
pub const LIMITS: ServeLimits = ServeLimits {
    connections: crate::listen::HTTP_LIMITS,
    header_read: Duration::from_secs(5),
    request: Duration::from_secs(15),
};

/// Serves until shutdown, within [`LIMITS`].
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_with(listener, state, shutdown, LIMITS).await
}

/// Serves until shutdown. Connections come through [`crate::listen::incoming`] (the caps and the
/// idle timeout); each carries one HTTP/1.1 request (no keep-alive) under `limits`.
pub(crate) async fn serve_with(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
    limits: ServeLimits,
) -> std::io::Result<()> {
    let metrics = state.metrics.clone();
    serve_router(listener, router(state), metrics, shutdown, limits).await
}

/// Serves `app` until shutdown, as [`serve_with`] does (the coordinator's endpoints use it too).
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    app: Router,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    limits: ServeLimits,
) -> std::io::Result<()> {
    use futures::StreamExt;
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
        // A second descriptor of the socket, closed after the connection's own (declared
        // first, dropped last): the close that ends the socket.
        let last_close = rustix::io::dup(&io).ok();
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
                        // A response cut here must read as a failure to any client, also one
                        // that does not compare the body with its Content-Length: the socket
                        // is reset (SO_LINGER 0 at the last close), not ended like a whole body.
                        if let Some(fd) = &last_close {
                            let _ = rustix::net::sockopt::set_socket_linger(fd, Some(Duration::ZERO));
                        }
                        debug!(deadline_ms = limits.request.as_millis() as u64, "HTTP request past its deadline; connection reset");
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
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;
    use crate::clock::SystemClock;
    use crate::listen::Limits;
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
            record: watch::channel(RecordStatus::Written).1,
            snapshots: watch::channel(None).1,
            record_body: Default::default(),
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

    /// `/readyz` is 200 only while the record is on disk and the engine loop has beaten within
    /// STALE_MS: a stuck loop turns it 503 once its heartbeat is stale, as a reader of the
    /// record would call the agent dead, however recent the last successful write.
    #[tokio::test]
    async fn readiness_needs_the_record_on_disk_and_a_fresh_heartbeat() {
        use crate::clock::testing::FakeClock;
        let clock = Arc::new(FakeClock::new(1_800_000_000_000, 600_000));
        let heartbeat = Arc::new(Heartbeat::default());
        let (record_tx, record) = watch::channel(RecordStatus::Written);
        let state = HttpState {
            metrics: Arc::new(Metrics::new()),
            heartbeat: heartbeat.clone(),
            clock: clock.clone() as Arc<dyn Clock>,
            record,
            snapshots: watch::channel(None).1,
            record_body: Default::default(),
        };
        let ready = || async { readyz(State(state.clone())).await.status() };
        // Written, but no beat yet.
        assert_eq!(ready().await, StatusCode::SERVICE_UNAVAILABLE);
        heartbeat.beat(&*clock);
        assert_eq!(ready().await, StatusCode::OK);
        clock.advance(Duration::from_millis(STALE_MS as u64 - 1));
        assert_eq!(ready().await, StatusCode::OK);
        // The loop stuck: the heartbeat goes stale, the record stays written.
        clock.advance(Duration::from_millis(2));
        assert_eq!(ready().await, StatusCode::SERVICE_UNAVAILABLE);
        // A wall-clock step changes nothing: the age is on the boot clock.
        heartbeat.beat(&*clock);
        clock.step_wall(-86_400);
        assert_eq!(ready().await, StatusCode::OK);
        clock.step_wall(2 * 86_400);
        assert_eq!(ready().await, StatusCode::OK);
        // A fresh heartbeat with the last write failed.
        record_tx.send_replace(RecordStatus::Failing("disk full".into()));
        assert_eq!(ready().await, StatusCode::SERVICE_UNAVAILABLE);
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

    /// An agent's endpoints serving `snap` as the newest snapshot (the heartbeat beats once, at
    /// start): its address, shutdown, the shared body and the snapshot channel.
    async fn record_server(
        limits: ServeLimits,
        snap: Snapshot,
    ) -> (
        SocketAddr,
        CancellationToken,
        Arc<RecordBody>,
        watch::Sender<Option<Snapshot>>,
    ) {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let heartbeat = Arc::new(Heartbeat::default());
        heartbeat.beat(&*clock);
        let (tx, rx) = watch::channel(Some(snap));
        let body = Arc::new(RecordBody::default());
        let state = HttpState {
            metrics: Arc::new(Metrics::new()),
            heartbeat,
            clock,
            record: watch::channel(RecordStatus::Written).1,
            snapshots: rx,
            record_body: body.clone(),
        };
        let shutdown = CancellationToken::new();
        tokio::spawn(serve_with(listener, state, shutdown.clone(), limits));
        (addr, shutdown, body, tx)
    }

    /// A snapshot whose record holds `n` faults with 1 KiB messages.
    fn big_snapshot(revision: u64, n: usize) -> Snapshot {
        let mut snap = crate::engine_loop::test_snapshot(revision, 0);
        let mut record = (*snap.record).clone();
        let at = faultline_core::time::Timestamp::from_second(1_700_000_000).unwrap();
        record.faults = (0..n)
            .map(|i| faultline_core::record::Fault {
                fault_type: faultline_core::record::FaultType::CardUnhealthy,
                fault_code: format!("Xid{i}"),
                fault_handling: faultline_core::record::Handling::RestartBusiness,
                fault_level: faultline_core::record::Handling::RestartBusiness,
                large_model_fault_level: faultline_core::record::Handling::RestartBusiness,
                device: format!("GPU-{i}"),
                device_uuid: None,
                pci_bus_id: None,
                source: faultline_core::record::Source::Kmsg,
                also_seen_by: Vec::new(),
                message: "m".repeat(1024),
                first_seen: at,
                last_seen: at,
                count: 1,
                active: true,
                recovered_at: None,
                escalated_from: None,
            })
            .collect();
        snap.record = Arc::new(record);
        snap
    }

    /// Sends one request for the record and reads the whole answer ([`read_answer`]).
    async fn get_record(c: &mut TcpStream) -> (String, Option<usize>, Vec<u8>) {
        c.write_all(b"GET /v1/record HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let (status, length, body, end) = read_answer(c).await;
        assert!(end.is_none(), "{end:?}");
        (status, length, body)
    }

    /// Reads until the server closes or resets: the status line, the `Content-Length`, the
    /// body bytes received and the error that ended the connection (`None`: an end of stream).
    async fn read_answer(
        c: &mut TcpStream,
    ) -> (String, Option<usize>, Vec<u8>, Option<std::io::Error>) {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let end_err = loop {
            match tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await {
                Ok(Ok(0)) => break None,
                Ok(Err(e)) => break Some(e),
                Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
                Err(_) => panic!("the server neither finished nor closed"),
            }
        };
        let end = out
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("headers");
        let head = String::from_utf8_lossy(&out[..end]).to_ascii_lowercase();
        let status = head.lines().next().unwrap_or_default().to_string();
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().unwrap());
        (status, length, out[end + 4..].to_vec(), end_err)
    }

    /// Sixteen concurrent requests get the same whole body with its `Content-Length`, from one
    /// serialization.
    #[tokio::test]
    async fn concurrent_requests_share_one_body_with_its_length() {
        let (addr, shutdown, body, _tx) = record_server(LIMITS, big_snapshot(1, 2000)).await;
        let requests = (0..16).map(|_| async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            get_record(&mut c).await
        });
        let answers = futures::future::join_all(requests).await;
        let first = &answers[0];
        assert!(first.0.starts_with("http/1.1 200"), "{}", first.0);
        assert!(first.2.len() > 2 << 20, "{}", first.2.len());
        for a in &answers {
            assert_eq!(a.1, Some(a.2.len()), "the Content-Length is the body's");
            assert!(a.2 == first.2, "every request gets the same body");
        }
        let r: faultline_core::record::NodeRecord = serde_json::from_slice(&first.2).unwrap();
        assert_eq!(r.faults.len(), 2000);
        assert!(r.agent.heartbeat_time.is_some());
        assert_eq!(body.serialized(), 1, "serialized once for all");

        shutdown.cancel();
    }

    /// The body is serialized again for a new snapshot or heartbeat only once the last one is
    /// [`RecordBody::FRESH`] old; until then the last one is served.
    #[tokio::test]
    async fn a_new_body_at_most_once_a_second() {
        let body = RecordBody::default();
        let t0 = Duration::from_secs(600);
        let beat = |s| Some(faultline_core::time::Timestamp::from_second(s).unwrap());
        let faults = |b: Bytes| {
            serde_json::from_slice::<faultline_core::record::NodeRecord>(&b)
                .unwrap()
                .faults
                .len()
        };
        let first = body.get(&big_snapshot(1, 1), beat(1), t0).await.unwrap();
        assert_eq!(faults(first), 1);
        let young = t0 + RecordBody::FRESH / 2;
        let same = body.get(&big_snapshot(2, 2), beat(2), young).await.unwrap();
        assert_eq!(faults(same), 1, "younger than FRESH: the last body");
        assert_eq!(body.serialized(), 1);
        let later = t0 + RecordBody::FRESH;
        let new = body.get(&big_snapshot(2, 2), beat(2), later).await.unwrap();
        assert_eq!(faults(new), 2);
        assert_eq!(body.serialized(), 2);
        // The same snapshot and heartbeat later still: nothing to serialize.
        let again = later + RecordBody::FRESH * 10;
        body.get(&big_snapshot(2, 2), beat(2), again).await.unwrap();
        assert_eq!(body.serialized(), 2);
    }

    /// A reader too slow to take the body within the deadline gets a response that ends short
    /// of its `Content-Length` (every HTTP client reports that as an error), never a shorter
    /// body presented as whole.
    #[tokio::test]
    async fn a_body_cut_at_the_deadline_is_short_of_its_length() {
        let (addr, shutdown, _, _tx) = record_server(
            limits(Duration::from_secs(5), Duration::from_millis(300)),
            big_snapshot(1, 16_000),
        )
        .await;
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut c = socket.connect(addr).await.unwrap();
        c.write_all(b"GET /v1/record HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        // Read nothing past the deadline, then everything there is.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let (status, length, body, end) = read_answer(&mut c).await;
        assert!(status.starts_with("http/1.1 200"), "{status}");
        let length = length.expect("a Content-Length");
        assert!(length > 16 << 20, "{length}");
        assert!(body.len() < length, "cut: {} of {length}", body.len());
        assert_eq!(
            end.map(|e| e.kind()),
            Some(std::io::ErrorKind::ConnectionReset),
            "the cut reads as an error, not as the end of the body"
        );
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
