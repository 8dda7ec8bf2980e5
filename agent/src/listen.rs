//! Listening sockets that anyone who can reach the node can connect to: the HTTP endpoints and
//! the peer-check port. A flood of idle connections must not take the file descriptors the
//! agent needs to write its record, or starve a legitimate check, so every accepted connection
//! goes through [`incoming`]:
//!
//! - at most [`Limits::max_connections`] are open at once, and at most
//!   [`Limits::max_per_address`] from one remote address, so one flooding host cannot take the
//!   slots a coordinator or a scraper on another host needs; a connection over either cap is
//!   accepted and closed at once (counted in `faultline_connections_refused_total`), so the
//!   kernel's backlog never fills with clients that wait forever;
//! - a connection that sends nothing for [`Limits::idle`] is closed (what the server writes,
//!   HTTP/2 keep-alive pings included, does not count), and any connection is closed at
//!   [`Limits::max_age`], so a client that answers pings cannot hold a slot for ever;
//! - an accept error (`EMFILE` when the process is out of descriptors) backs off instead of
//!   spinning, and never ends the listener.
//!
//! With both caps (64 + 128) far below the open-file limit, which [`raise_file_limit`] raises to
//! its hard limit at start, descriptors for the record, the kernel log, the policy and child
//! processes always remain (docs/operations.md has the arithmetic).

use std::collections::HashMap;
use std::future::Future as _;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tracing::warn;

use crate::clock::{Clock, SystemClock};
use crate::metrics::{Metrics, ServerLabel};
use crate::rate_limit::LogPacer;

/// What one listener allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one remote address.
    pub max_per_address: usize,
    /// A connection that sends nothing for this long is closed.
    pub idle: Duration,
    /// Any connection is closed this long after it was accepted (clients reconnect).
    pub max_age: Duration,
}

/// The metrics and health endpoints: scrapers and probes, a handful at a time.
pub(crate) const HTTP_LIMITS: Limits = Limits {
    max_connections: 64,
    max_per_address: 16,
    idle: Duration::from_secs(30),
    max_age: Duration::from_secs(300),
};

/// The peer-check service: the coordinator and the CLI (a node is in at most a few checks).
pub(crate) const PEER_LIMITS: Limits = Limits {
    max_connections: 128,
    max_per_address: 16,
    idle: Duration::from_secs(120),
    max_age: Duration::from_secs(600),
};

/// The coordinator's service: every agent of a fleet may call it at once (a fleet-wide incident:
/// each failing node asks the taint budget; every member reports during a run), one connection
/// each, from its own pod address. The coordinator raises its open-file limit to hold them
/// ([`raise_file_limit`]); `faultline-coordinator --max-connections` and
/// `--max-connections-per-address` change the first two.
pub const COORDINATOR_LIMITS: Limits = Limits {
    max_connections: 8192,
    max_per_address: 16,
    idle: Duration::from_secs(120),
    max_age: Duration::from_secs(600),
};

/// The most the soft limit is raised to: far above what the capped servers and the agent use,
/// and not so high that a child process which closes every descriptor up to the limit (the
/// Ascend tools, the probe inherit it) crawls.
pub(crate) const FILE_LIMIT_CEILING: u64 = 65_536;

/// Raises this process's open-file soft limit towards its hard limit (at most
/// [`FILE_LIMIT_CEILING`]); returns the limit in force.
pub fn raise_file_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let cur = getrlimit(Resource::Nofile);
    // `None` is unlimited (Option's order puts it below every number: compare explicitly).
    let hard = cur.maximum.unwrap_or(FILE_LIMIT_CEILING);
    let target = hard.min(FILE_LIMIT_CEILING);
    if let Some(soft) = cur.current {
        if soft < target {
            let raised = Rlimit {
                current: Some(target),
                maximum: cur.maximum,
            };
            if setrlimit(Resource::Nofile, raised).is_ok() {
                return Some(target);
            }
        }
    }
    cur.current
}

/// An accepted connection holding its slot; it fails with `TimedOut` once idle too long.
#[derive(Debug)]
pub struct Guarded {
    inner: TcpStream,
    _slot: OwnedSemaphorePermit,
    _address: AddressSlot,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    retire: Pin<Box<Sleep>>,
}

impl Guarded {
    fn new(
        inner: TcpStream,
        slot: OwnedSemaphorePermit,
        address: AddressSlot,
        limits: &Limits,
    ) -> Guarded {
        Guarded {
            inner,
            _slot: slot,
            _address: address,
            idle: limits.idle,
            deadline: Box::pin(tokio::time::sleep(limits.idle)),
            retire: Box::pin(tokio::time::sleep(limits.max_age)),
        }
    }

    fn touch(&mut self) {
        self.deadline.set(tokio::time::sleep(self.idle));
    }

    /// Whether the idle deadline or the maximum age has passed (both timers are polled, so the
    /// task is woken by whichever comes first).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let idle = self.deadline.as_mut().poll(cx).is_ready();
        let old = self.retired(cx);
        idle || old
    }

    /// Whether the maximum age has passed; checked before every read and write too, so a
    /// connection that never goes quiet is retired all the same.
    fn retired(&mut self, cx: &mut Context<'_>) -> bool {
        self.retire.as_mut().poll(cx).is_ready()
    }
}

/// Open connections per remote address.
type PerAddress = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// One connection's place in its address's count; released on drop.
#[derive(Debug)]
struct AddressSlot {
    counts: PerAddress,
    ip: IpAddr,
}

impl AddressSlot {
    /// Takes a place for `ip`, or `None` when it already has `max` connections.
    fn take(counts: &PerAddress, ip: IpAddr, max: usize) -> Option<AddressSlot> {
        let mut m = counts.lock();
        let n = m.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(AddressSlot {
            counts: counts.clone(),
            ip,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut m = self.counts.lock();
        if let Some(n) = m.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

fn idle_error() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "connection idle")
}

impl std::os::fd::AsFd for Guarded {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.retired(cx) {
            return Poll::Ready(Err(idle_error()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.touch();
                }
                Poll::Ready(r)
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.retired(cx) {
            return Poll::Ready(Err(idle_error()));
        }
        match Pin::new(&mut self.inner).poll_write(cx, data) {
            Poll::Ready(r) => Poll::Ready(r),
            // A client that stops reading holds the connection as surely as one that is silent.
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// The accepted connections of `listener`, within `limits`. Never ends and never yields an
/// error (the `Result` is the shape tonic's `serve_with_incoming` takes).
pub fn incoming(
    listener: TcpListener,
    limits: Limits,
    metrics: Arc<Metrics>,
    server: &'static str,
) -> impl Stream<Item = Result<Guarded, io::Error>> + Send + 'static {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let per_address: PerAddress = Arc::default();
    let state = (
        listener,
        slots,
        per_address,
        metrics,
        // At most one warning a minute (the running totals are in the metrics).
        LogPacer::new(Duration::from_secs(60)),
    );
    futures::stream::unfold(
        state,
        move |(l, slots, per_address, metrics, mut warned)| async move {
            loop {
                match l.accept().await {
                    Ok((stream, from)) => match (
                        AddressSlot::take(&per_address, from.ip(), limits.max_per_address),
                        slots.clone().try_acquire_owned(),
                    ) {
                        (Some(address), Ok(slot)) => {
                            let g = Guarded::new(stream, slot, address, &limits);
                            return Some((Ok(g), (l, slots, per_address, metrics, warned)));
                        }
                        (address, _) => {
                            drop(stream);
                            metrics
                                .connections_refused
                                .get_or_create(&ServerLabel { server })
                                .inc();
                            if warned.note(1, SystemClock.instant()).is_some() {
                                // Which cap refused it: the address's own, or the listener's.
                                let (cap, max) = match address {
                                    None => ("per address", limits.max_per_address),
                                    Some(_) => ("in all", limits.max_connections),
                                };
                                warn!(
                                    server,
                                    %from,
                                    cap,
                                    max,
                                    "connection limit reached; closing new connections"
                                );
                            }
                        }
                    },
                    Err(e) => {
                        if warned.note(1, SystemClock.instant()).is_some() {
                            warn!(server, error = %e, "accept failed; backing off");
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_methods)] // tests read the real clock freely
    use super::*;
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn listener() -> (TcpListener, std::net::SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    /// Over the cap, a new connection is closed at once; a slot freed is usable again.
    #[tokio::test]
    async fn connections_over_the_cap_are_closed_at_once() {
        let (l, addr) = listener().await;
        let limits = Limits {
            max_connections: 2,
            max_per_address: 10,
            idle: Duration::from_secs(60),
            max_age: Duration::from_secs(600),
        };
        let metrics = Arc::new(Metrics::new());
        let mut inc = Box::pin(incoming(l, limits, metrics.clone(), "test"));
        let _c1 = TcpStream::connect(addr).await.unwrap();
        let g1 = inc.next().await.unwrap().unwrap();
        let _c2 = TcpStream::connect(addr).await.unwrap();
        let _g2 = inc.next().await.unwrap().unwrap();
        let mut c3 = TcpStream::connect(addr).await.unwrap();
        // The third is accepted and closed by the stream while it waits for a fourth.
        let next = tokio::spawn(async move { inc.next().await.map(|r| r.is_ok()) });
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), c3.read(&mut buf))
            .await
            .expect("closed, not left hanging")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed");
        let refused = metrics
            .connections_refused
            .get_or_create(&ServerLabel { server: "test" })
            .get();
        assert_eq!(refused, 1);
        drop(g1);
        let _c4 = TcpStream::connect(addr).await.unwrap();
        assert_eq!(
            next.await.unwrap(),
            Some(true),
            "a freed slot takes the next"
        );
    }

    /// A connection that sends nothing is closed after the idle time; one that talks stays.
    #[tokio::test]
    async fn idle_connections_are_closed() {
        let (l, addr) = listener().await;
        let limits = Limits {
            max_connections: 4,
            max_per_address: 4,
            idle: Duration::from_millis(300),
            max_age: Duration::from_secs(600),
        };
        let mut inc = Box::pin(incoming(l, limits, Arc::new(Metrics::new()), "test"));
        let mut client = TcpStream::connect(addr).await.unwrap();
        let mut server = inc.next().await.unwrap().unwrap();
        // Activity within the idle time keeps it open.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            client.write_all(b"x").await.unwrap();
            let mut b = [0u8; 1];
            server.read_exact(&mut b).await.unwrap();
        }
        let mut b = [0u8; 1];
        let err = tokio::time::timeout(Duration::from_secs(5), server.read(&mut b))
            .await
            .expect("the idle deadline fires")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    async fn connect_from(local: &str, to: std::net::SocketAddr) -> TcpStream {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(format!("{local}:0").parse().unwrap()).unwrap();
        s.connect(to).await.unwrap()
    }

    /// One address flooding the port gets its share and no more: a client from another address
    /// (127.0.0.2, also loopback) is still served.
    #[tokio::test]
    async fn one_address_cannot_take_every_slot() {
        let (l, addr) = listener().await;
        let limits = Limits {
            max_connections: 8,
            max_per_address: 3,
            idle: Duration::from_secs(60),
            max_age: Duration::from_secs(600),
        };
        let metrics = Arc::new(Metrics::new());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let inc = incoming(l, limits, metrics.clone(), "test");
        tokio::spawn(async move {
            let mut inc = Box::pin(inc);
            while let Some(Ok(g)) = inc.next().await {
                let _ = tx.send(g);
            }
        });
        let mut flood = Vec::new();
        for _ in 0..6 {
            flood.push(connect_from("127.0.0.1", addr).await);
        }
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(rx.recv().await.unwrap());
        }
        let other = connect_from("127.0.0.2", addr).await;
        let g = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the other address is served")
            .unwrap();
        assert_eq!(
            g.inner.peer_addr().unwrap().ip(),
            other.local_addr().unwrap().ip()
        );
        let refused = metrics
            .connections_refused
            .get_or_create(&ServerLabel { server: "test" })
            .get();
        assert_eq!(refused, 3, "the flood's connections beyond its share");
        // A slot given back is usable by the same address again.
        drop(held.pop());
        let _again = connect_from("127.0.0.1", addr).await;
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("served again")
            .unwrap();
    }

    /// A connection that keeps talking is still closed at its maximum age.
    #[tokio::test]
    async fn connections_are_retired_at_their_maximum_age() {
        let (l, addr) = listener().await;
        let limits = Limits {
            max_connections: 4,
            max_per_address: 4,
            idle: Duration::from_secs(60),
            max_age: Duration::from_millis(400),
        };
        let mut inc = Box::pin(incoming(l, limits, Arc::new(Metrics::new()), "test"));
        let mut client = TcpStream::connect(addr).await.unwrap();
        let mut server = inc.next().await.unwrap().unwrap();
        let started = std::time::Instant::now();
        let err = loop {
            client.write_all(b"x").await.unwrap();
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_secs(5), server.read(&mut b)).await {
                Ok(Ok(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                Ok(Err(e)) => break e,
                Err(_) => panic!("never retired"),
            }
            assert!(started.elapsed() < Duration::from_secs(5), "never retired");
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn the_file_limit_is_raised_within_the_ceiling() {
        let got = raise_file_limit().expect("a limit");
        let now = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(Some(got), now.current);
        let hard = now.maximum.unwrap_or(FILE_LIMIT_CEILING);
        assert_eq!(got, hard.min(FILE_LIMIT_CEILING));
    }
}
