//! Hands NCCL's unique id from rank 0 to the other ranks over TCP, before any rank creates its
//! communicator. Plain sockets and bytes, no CUDA: the NCCL backend (`gpu`) calls it, and it is
//! tested on machines without a GPU.
//!
//! Rank 0 listens on its `--peers` address; every other rank connects (retrying while rank 0
//! starts) and sends a hello (magic, protocol version, world size, its rank, bytes per rank).
//! Rank 0 answers a matching hello with the 128-byte id and a mismatched one with a reason; a
//! connection without the magic (a stranger, a port scanner, the TCP allgather) gets no answer
//! and is closed. Every read and write is bounded by the run's deadline (and, on rank 0, a
//! silent connection by [`HELLO_WAIT`]), so nothing here outlives the deadline.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::hello::{left, Hello, HELLO_LEN};

/// Length of an NCCL unique id (`ncclUniqueId`, `NCCL_UNIQUE_ID_BYTES`).
pub const ID_LEN: usize = 128;
/// The id itself.
pub type NcclId = [u8; ID_LEN];

const MAGIC: &[u8; 8] = b"FLNCCLID";
/// 2: the data pattern the NCCL allgather fills and checks changed (`crate::pattern`); ranks of
/// different versions would read each other's blocks as corrupt, so they are turned away here.
const VERSION: u32 = 2;
/// Magic, version, status.
const REPLY_HEAD: usize = 13;
const STATUS_OK: u8 = 0;
const STATUS_REJECTED: u8 = 1;
/// Longest rejection reason sent or accepted.
const MAX_REASON: usize = 256;
/// How long rank 0 waits for the hello of a connection it accepted.
pub const HELLO_WAIT: Duration = Duration::from_secs(2);

/// Who takes part, as every rank sees it: a rank whose view differs is turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exchange {
    /// Rank 0's address (its `--peers` entry).
    pub addr: SocketAddr,
    pub world: usize,
    /// Bytes each rank contributes to the allgather.
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("cannot listen on {addr} for the NCCL id exchange: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("rank 0 at {addr} not reachable before the deadline: {last}")]
    Unreachable { addr: SocketAddr, last: String },
    #[error("rank{} {} did not fetch the NCCL id before the deadline{}",
        if .missing.len() > 1 { "s" } else { "" },
        .missing.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "),
        .rejected.as_ref().map(|r| format!(" (rejected: {r})")).unwrap_or_default())]
    Missing {
        missing: Vec<usize>,
        /// The last connection turned away, and why.
        rejected: Option<String>,
    },
    #[error("NCCL id exchange with {peer}: {what}")]
    Handshake { peer: String, what: String },
    #[error("rank 0 at {addr} turned this rank away: {reason}")]
    Rejected { addr: SocketAddr, reason: String },
    #[error("NCCL id exchange: {what} {peer}: {source}")]
    Io {
        what: &'static str,
        peer: String,
        source: std::io::Error,
    },
}

fn set_timeouts(s: &TcpStream, limit: Duration) -> std::io::Result<()> {
    let t = limit.max(Duration::from_millis(1));
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))?;
    s.set_nodelay(true)
}

/// Why rank 0 turns away a hello that has the magic; `None` if it is a rank of this run.
fn mismatch(h: &Hello, ex: &Exchange) -> Option<String> {
    if h.version != VERSION {
        return Some(format!(
            "protocol version {} (rank 0 speaks {VERSION})",
            h.version
        ));
    }
    if h.world != ex.world as u64 {
        return Some(format!("world size {} (rank 0 has {})", h.world, ex.world));
    }
    if h.bytes != ex.bytes {
        return Some(format!(
            "{} bytes per rank (rank 0 has {})",
            h.bytes, ex.bytes
        ));
    }
    if h.rank == 0 || h.rank >= ex.world as u64 {
        return Some(format!(
            "rank {} (expected 1..{} in a world of {})",
            h.rank,
            ex.world.saturating_sub(1),
            ex.world
        ));
    }
    None
}

fn reply_ok(id: &NcclId) -> Vec<u8> {
    let mut r = Vec::with_capacity(REPLY_HEAD + ID_LEN);
    r.extend_from_slice(MAGIC);
    r.extend_from_slice(&VERSION.to_be_bytes());
    r.push(STATUS_OK);
    r.extend_from_slice(id);
    r
}

fn reply_rejected(reason: &str) -> Vec<u8> {
    let mut reason = reason.as_bytes();
    reason = &reason[..reason.len().min(MAX_REASON)];
    let mut r = Vec::with_capacity(REPLY_HEAD + 2 + reason.len());
    r.extend_from_slice(MAGIC);
    r.extend_from_slice(&VERSION.to_be_bytes());
    r.push(STATUS_REJECTED);
    r.extend_from_slice(&(reason.len() as u16).to_be_bytes());
    r.extend_from_slice(reason);
    r
}

/// Rank 0: binds `ex.addr` and serves `id` until every other rank has it.
pub fn serve(ex: &Exchange, id: &NcclId, deadline: Instant) -> Result<(), ExchangeError> {
    let addr = ex.addr;
    let listener =
        TcpListener::bind(addr).map_err(|source| ExchangeError::Listen { addr, source })?;
    serve_on(listener, ex, id, deadline)
}

/// Rank 0 on a listener already bound (to `ex.addr`, or anywhere in tests): accepts until every
/// rank 1..world has been given the id, or the deadline passes.
pub fn serve_on(
    listener: TcpListener,
    ex: &Exchange,
    id: &NcclId,
    deadline: Instant,
) -> Result<(), ExchangeError> {
    let addr = ex.addr;
    listener
        .set_nonblocking(true)
        .map_err(|source| ExchangeError::Listen { addr, source })?;
    let mut waiting: BTreeSet<usize> = (1..ex.world).collect();
    let mut rejected: Option<String> = None;
    while !waiting.is_empty() {
        match listener.accept() {
            Ok((s, from)) => match answer(s, from, ex, id, deadline) {
                Ok(rank) => {
                    // A rank may come twice (it retried after a lost answer): it gets the id again.
                    waiting.remove(&rank);
                }
                Err(why) => rejected = Some(why),
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if left(deadline).is_none() {
                    return Err(ExchangeError::Missing {
                        missing: waiting.into_iter().collect(),
                        rejected,
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(ExchangeError::Io {
                    what: "accept on",
                    peer: addr.to_string(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// One accepted connection on rank 0: the rank it served, or why it was turned away.
fn answer(
    mut s: TcpStream,
    from: SocketAddr,
    ex: &Exchange,
    id: &NcclId,
    deadline: Instant,
) -> Result<usize, String> {
    let limit = left(deadline).unwrap_or_default().min(HELLO_WAIT);
    s.set_nonblocking(false)
        .and_then(|()| set_timeouts(&s, limit))
        .map_err(|e| format!("{from}: {e}"))?;
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b)
        .map_err(|e| format!("{from}: no hello ({e})"))?;
    let Some(h) = Hello::decode(MAGIC, &b) else {
        // Not one of ours: no answer, just close.
        return Err(format!("{from}: not a faultline probe (bad magic)"));
    };
    if let Some(why) = mismatch(&h, ex) {
        let _ = s.write_all(&reply_rejected(&why));
        return Err(format!("{from}: {why}"));
    }
    s.write_all(&reply_ok(id))
        .and_then(|()| s.flush())
        .map_err(|e| format!("{from}: cannot send the id ({e})"))?;
    // The hello is checked: rank is in 1..world, which fits in usize.
    Ok(h.rank as usize)
}

/// Rank `rank` (1..world): fetches the id from rank 0, retrying while rank 0 is not listening
/// yet, until the deadline.
pub fn fetch(ex: &Exchange, rank: usize, deadline: Instant) -> Result<NcclId, ExchangeError> {
    let addr = ex.addr;
    let hello = Hello {
        version: VERSION,
        world: ex.world as u64,
        rank: rank as u64,
        bytes: ex.bytes,
    }
    .encode(MAGIC);
    let mut last = String::from("never tried");
    while let Some(t) = left(deadline) {
        match TcpStream::connect_timeout(&addr, t.min(Duration::from_secs(1))) {
            Ok(s) => match ask(s, addr, &hello, deadline) {
                Ok(id) => return Ok(id),
                // Rank 0 answered: no point asking again.
                Err(e @ (ExchangeError::Rejected { .. } | ExchangeError::Handshake { .. })) => {
                    return Err(e)
                }
                // A connection that broke (rank 0 restarting, a backlog reset): try again.
                Err(e) => {
                    last = e.to_string();
                    std::thread::sleep(Duration::from_millis(50));
                }
            },
            Err(e) => {
                last = e.to_string();
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    Err(ExchangeError::Unreachable { addr, last })
}

fn ask(
    mut s: TcpStream,
    addr: SocketAddr,
    hello: &[u8; HELLO_LEN],
    deadline: Instant,
) -> Result<NcclId, ExchangeError> {
    let io = |what: &'static str| {
        move |source| ExchangeError::Io {
            what,
            peer: format!("rank 0 at {addr}"),
            source,
        }
    };
    set_timeouts(&s, left(deadline).unwrap_or_default()).map_err(io("set up the connection to"))?;
    s.write_all(hello).map_err(io("send the hello to"))?;
    let mut head = [0u8; REPLY_HEAD];
    s.read_exact(&mut head).map_err(io("read the answer of"))?;
    let bad = |what: String| ExchangeError::Handshake {
        peer: addr.to_string(),
        what,
    };
    if &head[..8] != MAGIC {
        return Err(bad("not a faultline probe (bad magic)".into()));
    }
    let mut v = [0u8; 4];
    v.copy_from_slice(&head[8..12]);
    let version = u32::from_be_bytes(v);
    if version != VERSION {
        return Err(bad(format!(
            "protocol version {version} (this probe speaks {VERSION})"
        )));
    }
    match head[12] {
        STATUS_OK => {
            let mut id = [0u8; ID_LEN];
            s.read_exact(&mut id).map_err(io("read the id from"))?;
            Ok(id)
        }
        STATUS_REJECTED => {
            let mut len = [0u8; 2];
            s.read_exact(&mut len).map_err(io("read the answer of"))?;
            let len = usize::from(u16::from_be_bytes(len));
            if len > MAX_REASON {
                return Err(bad(format!("a {len}-byte rejection reason")));
            }
            let mut reason = vec![0u8; len];
            s.read_exact(&mut reason)
                .map_err(io("read the answer of"))?;
            Err(ExchangeError::Rejected {
                addr,
                reason: String::from_utf8_lossy(&reason).into_owned(),
            })
        }
        other => Err(bad(format!("unknown status {other}"))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn id() -> NcclId {
        let mut id = [0u8; ID_LEN];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 37 % 256) as u8;
        }
        id
    }

    fn listener() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    #[test]
    fn rank_0_serves_the_id_to_two_ranks() {
        let (l, addr) = listener();
        let ex = Exchange {
            addr,
            world: 3,
            bytes: 1 << 20,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let server = std::thread::spawn(move || serve_on(l, &ex, &id(), deadline));
        let clients: Vec<_> = [1, 2]
            .into_iter()
            .map(|rank| std::thread::spawn(move || fetch(&ex, rank, deadline)))
            .collect();
        for c in clients {
            assert_eq!(c.join().unwrap().unwrap(), id());
        }
        server.join().unwrap().unwrap();
    }

    #[test]
    fn a_rank_that_starts_before_rank_0_waits_for_it() {
        let (l, addr) = listener();
        drop(l);
        let ex = Exchange {
            addr,
            world: 2,
            bytes: 4096,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let client = std::thread::spawn(move || fetch(&ex, 1, deadline));
        std::thread::sleep(Duration::from_millis(300));
        serve(&ex, &id(), deadline).unwrap();
        assert_eq!(client.join().unwrap().unwrap(), id());
    }

    #[test]
    fn a_stranger_gets_nothing_and_the_ranks_still_get_the_id() {
        let (l, addr) = listener();
        let ex = Exchange {
            addr,
            world: 2,
            bytes: 4096,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        // The stranger comes first (the server is not accepting yet, so it waits in the backlog).
        let mut stranger = TcpStream::connect(addr).unwrap();
        stranger
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n and then some")
            .unwrap();
        let server = std::thread::spawn(move || serve_on(l, &ex, &id(), deadline));
        stranger
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut got = Vec::new();
        // Closed without an answer (EOF, or a reset because of the unread bytes).
        let _ = stranger.read_to_end(&mut got);
        assert!(got.is_empty(), "the stranger was answered: {got:?}");
        assert_eq!(fetch(&ex, 1, deadline).unwrap(), id());
        server.join().unwrap().unwrap();
    }

    #[test]
    fn a_stranger_alone_is_named_at_the_deadline() {
        let (l, addr) = listener();
        let ex = Exchange {
            addr,
            world: 2,
            bytes: 4096,
        };
        let mut stranger = TcpStream::connect(addr).unwrap();
        stranger.write_all(&[0x42; HELLO_LEN]).unwrap();
        let started = Instant::now();
        let e = serve_on(l, &ex, &id(), started + Duration::from_millis(700)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        let s = e.to_string();
        assert!(s.contains("rank 1 did not fetch"), "{s}");
        assert!(s.contains("bad magic"), "{s}");
    }

    #[test]
    fn a_mismatched_rank_is_told_why() {
        let (l, addr) = listener();
        let ex = Exchange {
            addr,
            world: 2,
            bytes: 4096,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let server = std::thread::spawn(move || {
            serve_on(l, &ex, &id(), Instant::now() + Duration::from_secs(1))
        });
        let other = Exchange { bytes: 8192, ..ex };
        let e = fetch(&other, 1, deadline).unwrap_err();
        assert!(
            matches!(&e, ExchangeError::Rejected { reason, .. } if reason.contains("bytes per rank")),
            "{e}"
        );
        let e = fetch(&Exchange { world: 3, ..ex }, 2, deadline).unwrap_err();
        assert!(e.to_string().contains("world size 3"), "{e}");
        let e = fetch(&ex, 5, deadline).unwrap_err();
        assert!(e.to_string().contains("rank 5"), "{e}");
        // Rank 1 never came with the right view: rank 0 ends at its deadline, naming the reason.
        let e = server.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("rejected"), "{e}");
    }

    #[test]
    fn a_server_that_is_not_rank_0_is_not_believed() {
        let (l, addr) = listener();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let mut b = [0u8; HELLO_LEN];
                let _ = s.read_exact(&mut b);
                let _ = s.write_all(&[b'x'; 200]);
            }
        });
        let ex = Exchange {
            addr,
            world: 2,
            bytes: 1,
        };
        let e = fetch(&ex, 1, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("bad magic"), "{e}");
    }

    #[test]
    fn nobody_listening_ends_at_the_deadline() {
        let (l, addr) = listener();
        drop(l);
        let ex = Exchange {
            addr,
            world: 2,
            bytes: 1,
        };
        let started = Instant::now();
        let e = fetch(&ex, 1, started + Duration::from_millis(500)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(e, ExchangeError::Unreachable { .. }), "{e}");
    }
}
