//! The HTTP/1.1 server: accept loop, per-connection tasks that can be dropped
//! all at once (`down()`) or one at a time (`Reset` faults), fault injection,
//! the call log, and body reading. Request handling proper is in [`crate::api`].

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use http::{Request, Response};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;
use crate::faults::{Call, FaultAction};
use crate::response::{error_response, Body};
use crate::util::Query;
use crate::Inner;

/// Largest request body accepted (the apiserver's 3 MiB limit).
const MAX_BODY: usize = 3 * 1024 * 1024;

/// A running accept loop.
#[derive(Debug)]
pub(crate) struct Serving {
    token: CancellationToken,
    task: JoinHandle<()>,
}

impl Serving {
    /// Signals the server to stop without waiting.
    pub fn cancel(&self) {
        self.token.cancel();
    }

    /// Stops and waits until the listener and every connection are closed.
    pub async fn stop(self) {
        self.token.cancel();
        let _ = self.task.await;
    }
}

/// Binds with SO_REUSEADDR so `up()` can rebind right after `down()`, with the accept queue a
/// kube-apiserver's listener gets: Go's `net.Listen` asks for `/proc/sys/net/core/somaxconn`
/// (`maxListenerBacklog` in Go's src/net/sock_linux.go; 128, `syscall.SOMAXCONN`, when it cannot
/// be read; at most 65,535). A smaller queue made connections that a real server accepts time
/// out here when 2,000 agents opened theirs in the same second.
pub(crate) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(listen_backlog())
}

/// The accept queue Go asks the kernel for on Linux (see [`bind`]).
fn listen_backlog() -> u32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .filter(|n| *n > 0)
        .map_or(128, |n| n.min(65_535))
}

pub(crate) fn spawn(inner: Arc<Inner>, listener: TcpListener) -> Serving {
    let token = CancellationToken::new();
    let task = tokio::spawn(accept_loop(inner, listener, token.clone()));
    Serving { token, task }
}

async fn accept_loop(inner: Arc<Inner>, listener: TcpListener, token: CancellationToken) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = token.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    conns.spawn(serve_connection(inner.clone(), stream, token.child_token()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    conns.shutdown().await;
}

/// A TCP stream that sends RST instead of FIN when dropped after a `Reset` fault.
struct ConnIo {
    stream: TcpStream,
    reset: Arc<AtomicBool>,
}

impl Drop for ConnIo {
    fn drop(&mut self) {
        if self.reset.load(Ordering::SeqCst) {
            let _ = self.stream.set_zero_linger();
        }
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Per-connection handles a request needs to drop its own connection.
#[derive(Clone)]
struct ConnCtx {
    token: CancellationToken,
    reset: Arc<AtomicBool>,
}

async fn serve_connection(inner: Arc<Inner>, stream: TcpStream, token: CancellationToken) {
    let reset = Arc::new(AtomicBool::new(false));
    let io = ConnIo {
        stream,
        reset: reset.clone(),
    };
    let ctx = ConnCtx {
        token: token.clone(),
        reset,
    };
    let service = service_fn(move |req| {
        let inner = inner.clone();
        let ctx = ctx.clone();
        async move { Ok::<_, Infallible>(handle(inner, ctx, req).await) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(None);
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::select! {
        _ = conn => {}
        _ = token.cancelled() => {}
    }
}

fn header(req: &http::request::Parts, name: http::header::HeaderName) -> Option<String> {
    req.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn handle(inner: Arc<Inner>, conn: ConnCtx, req: Request<Incoming>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let query_raw = parts.uri.query().unwrap_or("").to_string();
    let query = Query::parse(&query_raw);
    if path == "/_emulator" || path.starts_with("/_emulator/") {
        let bytes = match Limited::new(body, MAX_BODY).collect().await {
            Ok(c) => c.to_bytes(),
            Err(_) => return error_response(&ApiError::too_large()),
        };
        return crate::control::handle(&inner, parts.method.as_str(), &path, &bytes);
    }
    let content_type = header(&parts, http::header::CONTENT_TYPE);
    let token = header(&parts, http::header::AUTHORIZATION).and_then(|a| {
        a.strip_prefix("Bearer ")
            .or_else(|| a.strip_prefix("bearer "))
            .map(|t| t.trim().to_string())
    });
    let user_agent = header(&parts, http::header::USER_AGENT);
    let accept = header(&parts, http::header::ACCEPT);
    let mut call = Call {
        method: parts.method.as_str().to_string(),
        path: path.clone(),
        query: query_raw.clone(),
        content_type: content_type.clone(),
        token: token.clone(),
        field_manager: query.get("fieldManager").map(str::to_string),
        user_agent: user_agent.clone(),
        status: 0,
        injected: false,
        at: SystemTime::now(),
    };

    if let Some(action) = inner.take_fault(&call.method, &path, &query_raw) {
        call.injected = true;
        match action {
            FaultAction::Status {
                code,
                retry_after_s,
            } => {
                call.status = code;
                inner.log_call(call);
                return error_response(&ApiError::injected(code, retry_after_s));
            }
            FaultAction::Hang => {
                inner.log_call(call);
                return std::future::pending().await;
            }
            FaultAction::Delay(d) => tokio::time::sleep(d).await,
            FaultAction::Reset => {
                inner.log_call(call);
                conn.reset.store(true, Ordering::SeqCst);
                conn.token.cancel();
                return std::future::pending().await;
            }
        }
    }

    if call.is_write() {
        let wait = inner.write_latency();
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
    let bytes = match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            let err = if e.is::<http_body_util::LengthLimitError>() {
                ApiError::too_large()
            } else {
                ApiError::bad_request(format!("error reading request body: {e}"))
            };
            let resp = error_response(&err);
            call.status = resp.status().as_u16();
            inner.log_call(call);
            return resp;
        }
    };
    let ctx = crate::api::RequestCtx {
        method: parts.method.as_str(),
        path: &path,
        query: &query,
        content_type: content_type.as_deref(),
        token: token.as_deref(),
        user_agent: user_agent.as_deref(),
        accept: accept.as_deref(),
        body: bytes,
    };
    let resp = crate::api::serve(&inner, &ctx);
    call.status = resp.status().as_u16();
    inner.log_call(call);
    resp
}
