//! The TCP allgather backend: every rank contributes `bytes` and receives every other rank's.
//! A ring: rank r listens on its own address, connects to rank r+1 and accepts rank r-1; in each
//! of the world-1 steps it sends one block to its successor while it receives one from its
//! predecessor (full duplex, a thread per direction). Every received block is checked against
//! the pattern its owner writes, so a corrupting path fails the check instead of passing it.
//!
//! Memory does not grow with the block size: nothing holds a whole block. Blocks move in
//! pieces of [`PIECE`] bytes through three reused buffers (one to send, one to receive, one for
//! the expected data): each received piece is checked against the owner's pattern
//! ([`crate::pattern`]) as it arrives, and the sender generates each piece from the pattern as it
//! goes. In step s a ring forwards the block it received in step s-1; here the sender
//! regenerates that block from its owner's pattern instead of keeping it (the bytes on the wire
//! are the same, and what was received has already been checked), so a rank ends with every
//! block verified but none stored. Peak RSS is a few MiB at 64 MiB and at 1 GiB
//! (docs/benchmarks.md); the run reports it (`peak_rss_bytes`).
//!
//! Peers meet with a handshake (magic, protocol version, world size, the sender's rank, block
//! size); any mismatch is a clear error, never a hang. Every socket has the deadline as its
//! timeout, so a silent peer ends the check at the deadline.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::hello::{left, Hello, HELLO_LEN};
use crate::pattern;

const MAGIC: &[u8; 8] = b"FLPROBE1";

fn bad_magic() -> String {
    "not a faultline probe (bad magic)".into()
}
/// 2: the data pattern changed (`crate::pattern`, generated piece by piece); a version-1 peer
/// would send data this rank reads as corrupt, so it is turned away at the handshake instead.
const VERSION: u32 = 2;
/// Data moves in pieces of this size, and each of the three buffers holds one piece: the
/// probe's memory for data is 3 x `PIECE`, whatever the block size.
pub(crate) const PIECE: usize = 1 << 20;

/// One allgather run.
#[derive(Debug, Clone)]
pub struct AllgatherConfig {
    /// Every rank's listening address, by rank.
    pub peers: Vec<SocketAddr>,
    pub rank: usize,
    /// Bytes each rank contributes.
    pub bytes: usize,
    pub iterations: u32,
    /// The whole run, connection included, ends with an error at this deadline.
    pub timeout: Duration,
    /// The ring must be connected within this (default: `timeout`). The agent starts both
    /// probes of a check at once, so a partner that has not connected after a few seconds is
    /// not coming (a hung probe, a stuck accelerator): the check fails then, not at `timeout`.
    pub connect_timeout: Option<Duration>,
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AllgatherResult {
    pub world: usize,
    pub rank: usize,
    pub bytes_per_rank: usize,
    pub iterations: u32,
    /// Seconds per iteration, in order.
    pub seconds: Vec<f64>,
    /// Median seconds per iteration.
    pub median_seconds: f64,
    /// Algorithm bandwidth (all ranks' bytes over the median time), GB/s.
    pub algbw_gbps: f64,
    /// Bus bandwidth (algbw x (world-1)/world, comparable across world sizes, as nccl-tests
    /// reports it), GB/s.
    pub busbw_gbps: f64,
    /// The probe process's peak resident memory (VmHWM) at the end of the run, bytes; absent
    /// where /proc does not say. The DaemonSet's memory limit is derived from it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum AllgatherError {
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("rank {rank} at {addr} not reachable before the deadline: {last}")]
    Connect {
        rank: usize,
        addr: SocketAddr,
        last: String,
    },
    #[error("rank {rank} did not connect before the deadline{}", .rejected.as_ref().map(|r| format!(" (rejected: {r})")).unwrap_or_default())]
    Accept {
        rank: usize,
        /// The last connection turned away, and why.
        rejected: Option<String>,
    },
    #[error("handshake with {peer}: {what}")]
    Handshake { peer: String, what: String },
    #[error("{what} with rank {rank}: {source}")]
    Io {
        what: &'static str,
        rank: usize,
        source: std::io::Error,
    },
    #[error("data from rank {owner} is corrupt (byte {offset} of its block)")]
    Corrupt { owner: usize, offset: usize },
    #[error("deadline ({0:?}) passed")]
    Deadline(Duration),
}

impl AllgatherError {
    /// The deadline passed after the ranks connected (a transfer too slow to finish), as
    /// opposed to an error or a rank that never came.
    pub fn is_deadline(&self) -> bool {
        match self {
            AllgatherError::Deadline(_) => true,
            AllgatherError::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ),
            _ => false,
        }
    }
}

fn set_timeouts(s: &TcpStream, deadline: Instant) -> std::io::Result<()> {
    let t = left(deadline).unwrap_or(Duration::from_millis(1));
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))?;
    s.set_nodelay(true)
}

/// Checks a peer's hello against what this rank expects.
fn check_hello(
    h: &Hello,
    cfg: &AllgatherConfig,
    want_rank: usize,
    peer: &str,
) -> Result<(), AllgatherError> {
    let bad = |what: String| AllgatherError::Handshake {
        peer: peer.to_string(),
        what,
    };
    if h.version != VERSION {
        return Err(bad(format!(
            "protocol version {} (this probe speaks {VERSION})",
            h.version
        )));
    }
    if h.world != cfg.peers.len() as u64 {
        return Err(bad(format!(
            "world size {} (this rank has {})",
            h.world,
            cfg.peers.len()
        )));
    }
    if h.bytes != cfg.bytes as u64 {
        return Err(bad(format!(
            "{} bytes per rank (this rank has {})",
            h.bytes, cfg.bytes
        )));
    }
    if h.rank != want_rank as u64 {
        return Err(bad(format!(
            "it says it is rank {}, expected rank {want_rank}",
            h.rank
        )));
    }
    Ok(())
}

/// Connects the ring: (to successor, from predecessor).
fn connect(
    cfg: &AllgatherConfig,
    deadline: Instant,
) -> Result<(TcpStream, TcpStream), AllgatherError> {
    let world = cfg.peers.len();
    let me = cfg.rank;
    let next = (me + 1) % world;
    let prev = (me + world - 1) % world;
    let addr = cfg.peers[me];
    let listener =
        TcpListener::bind(addr).map_err(|source| AllgatherError::Listen { addr, source })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| AllgatherError::Listen { addr, source })?;
    let hello = Hello {
        version: VERSION,
        world: world as u64,
        rank: me as u64,
        bytes: cfg.bytes as u64,
    }
    .encode(MAGIC);
    // Connect out (retrying while the successor starts) and accept in, on two threads.
    let out_cfg = cfg.clone();
    let outgoing = std::thread::spawn(move || -> Result<TcpStream, AllgatherError> {
        let target = out_cfg.peers[next];
        let mut last = String::from("never tried");
        while let Some(t) = left(deadline) {
            match TcpStream::connect_timeout(&target, t.min(Duration::from_secs(1))) {
                Ok(mut s) => {
                    set_timeouts(&s, deadline).map_err(|source| AllgatherError::Io {
                        what: "set up the connection",
                        rank: next,
                        source,
                    })?;
                    s.write_all(&hello).map_err(|source| AllgatherError::Io {
                        what: "send the handshake",
                        rank: next,
                        source,
                    })?;
                    let mut back = [0u8; HELLO_LEN];
                    s.read_exact(&mut back)
                        .map_err(|source| AllgatherError::Io {
                            what: "read the handshake",
                            rank: next,
                            source,
                        })?;
                    let h = Hello::decode(MAGIC, &back)
                        .ok_or_else(bad_magic)
                        .map_err(|what| AllgatherError::Handshake {
                            peer: target.to_string(),
                            what,
                        })?;
                    check_hello(&h, &out_cfg, next, &target.to_string())?;
                    return Ok(s);
                }
                Err(e) => {
                    last = e.to_string();
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        Err(AllgatherError::Connect {
            rank: next,
            addr: target,
            last,
        })
    });
    // Connections that are not the predecessor (a stranger, a probe of another run) are turned
    // away and the wait goes on; the error at the deadline says what was turned away.
    let mut rejected: Option<String> = None;
    let incoming = loop {
        match listener.accept() {
            Ok((mut s, from)) => {
                let _ = s.set_nonblocking(false);
                if set_timeouts(&s, deadline).is_err() {
                    continue;
                }
                let mut theirs = [0u8; HELLO_LEN];
                if let Err(e) = s.read_exact(&mut theirs) {
                    rejected = Some(format!("{from}: no handshake ({e})"));
                    continue;
                }
                let checked = Hello::decode(MAGIC, &theirs)
                    .ok_or_else(bad_magic)
                    .map_err(|what| AllgatherError::Handshake {
                        peer: from.to_string(),
                        what,
                    })
                    .and_then(|h| check_hello(&h, cfg, prev, &from.to_string()));
                if let Err(e) = checked {
                    rejected = Some(e.to_string());
                    continue;
                }
                s.write_all(&hello).map_err(|source| AllgatherError::Io {
                    what: "answer the handshake",
                    rank: prev,
                    source,
                })?;
                break s;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if left(deadline).is_none() {
                    return Err(AllgatherError::Accept {
                        rank: prev,
                        rejected,
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(source) => {
                return Err(AllgatherError::Io {
                    what: "accept",
                    rank: prev,
                    source,
                })
            }
        }
    };
    let out = outgoing
        .join()
        .map_err(|_| AllgatherError::Config("the connecting thread panicked".into()))??;
    Ok((out, incoming))
}

/// Lines the ranks up before a timed iteration, so one rank's check of the last iteration (or a
/// late start) is never timed as transfer by another: a token goes once around the ring
/// (rank 0 sends first and waits for it to come back; the others pass it on).
fn barrier(
    me: usize,
    to_next: &mut TcpStream,
    from_prev: &mut TcpStream,
    next: usize,
    prev: usize,
) -> Result<(), AllgatherError> {
    let mut token = [0u8; 1];
    let send = |s: &mut TcpStream| {
        s.write_all(&[0xB7]).map_err(|source| AllgatherError::Io {
            what: "send the barrier token",
            rank: next,
            source,
        })
    };
    let mut recv = |s: &mut TcpStream| -> Result<(), AllgatherError> {
        s.read_exact(&mut token)
            .map_err(|source| AllgatherError::Io {
                what: "receive the barrier token",
                rank: prev,
                source,
            })?;
        if token[0] == 0xB7 {
            Ok(())
        } else {
            Err(AllgatherError::Corrupt {
                owner: prev,
                offset: 0,
            })
        }
    };
    if me == 0 {
        send(to_next)?;
        recv(from_prev)
    } else {
        recv(from_prev)?;
        send(to_next)
    }
}

/// Runs the allgather: every other rank's block is received and checked, none is kept.
pub fn run(cfg: &AllgatherConfig) -> Result<AllgatherResult, AllgatherError> {
    let world = cfg.peers.len();
    if world < 2 {
        return Err(AllgatherError::Config(
            "an allgather needs at least 2 ranks".into(),
        ));
    }
    if cfg.rank >= world {
        return Err(AllgatherError::Config(format!(
            "rank {} of a world of {world}",
            cfg.rank
        )));
    }
    if cfg.bytes == 0 || cfg.iterations == 0 {
        return Err(AllgatherError::Config(
            "bytes and iterations must be at least 1".into(),
        ));
    }
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    let connect_by = start + cfg.connect_timeout.unwrap_or(cfg.timeout).min(cfg.timeout);
    let (mut to_next, mut from_prev) = connect(cfg, connect_by)?;
    // Connected: from here on the run's own deadline bounds every read and write.
    for (s, rank) in [
        (&to_next, (cfg.rank + 1) % world),
        (&from_prev, (cfg.rank + world - 1) % world),
    ] {
        set_timeouts(s, deadline).map_err(|source| AllgatherError::Io {
            what: "set up the connection",
            rank,
            source,
        })?;
    }
    let me = cfg.rank;
    let next = (me + 1) % world;
    let prev = (me + world - 1) % world;
    // The only data buffers of the run, reused for every piece of every block.
    let piece = PIECE.min(cfg.bytes);
    let mut send_buf = vec![0u8; piece];
    let mut recv_buf = vec![0u8; piece];
    let mut want_buf = vec![0u8; piece];
    // A second handle on the outgoing socket: a receive that fails shuts the sending direction
    // down, so the sending thread stops instead of writing on until the deadline.
    let stopper = to_next.try_clone().map_err(|source| AllgatherError::Io {
        what: "clone the socket",
        rank: next,
        source,
    })?;
    let mut seconds = Vec::new();
    // One untimed warm-up iteration (buffers faulted in, TCP windows open), then the timed ones.
    for iteration in 0..=cfg.iterations {
        barrier(me, &mut to_next, &mut from_prev, next, prev)?;
        let t0 = Instant::now();
        for step in 0..world - 1 {
            // Send the block of the rank `step` places back (own block first: in a ring that
            // is the block received in the previous step, regenerated here); receive the
            // block of the rank `step + 1` places back, checking it piece by piece.
            let send_owner = (me + world - step) % world;
            let recv_owner = (me + world - step - 1) % world;
            let (wrote, read) = std::thread::scope(|s| {
                let writer = &mut to_next;
                let buf = &mut send_buf;
                let sender = s.spawn(move || send_block(writer, send_owner, cfg.bytes, buf));
                let read = recv_block(
                    &mut from_prev,
                    recv_owner,
                    cfg.bytes,
                    &mut recv_buf,
                    &mut want_buf,
                    prev,
                );
                if read.is_err() {
                    let _ = stopper.shutdown(Shutdown::Both);
                }
                (sender.join(), read)
            });
            let wrote =
                wrote.map_err(|_| AllgatherError::Config("the sending thread panicked".into()))?;
            // What this rank received decides first: a send that fails after a failed receive
            // failed because the receive shut the connection down.
            read?;
            wrote.map_err(|source| AllgatherError::Io {
                what: "send",
                rank: next,
                source,
            })?;
            if left(deadline).is_none() {
                return Err(AllgatherError::Deadline(cfg.timeout));
            }
        }
        if iteration > 0 {
            seconds.push(t0.elapsed().as_secs_f64());
        }
    }
    let _ = to_next.flush();
    Ok(summarize(world, me, cfg.bytes, seconds))
}

/// Sends `owner`'s block of `bytes`, generating it piece by piece in `buf`.
fn send_block(
    to: &mut TcpStream,
    owner: usize,
    bytes: usize,
    buf: &mut [u8],
) -> std::io::Result<()> {
    let mut at = 0;
    while at < bytes {
        let n = buf.len().min(bytes - at);
        let piece = &mut buf[..n];
        pattern::fill_at(owner, at, piece);
        to.write_all(piece)?;
        at += n;
    }
    Ok(())
}

/// Receives `owner`'s block of `bytes` from `from_rank` piece by piece into `buf`, checking
/// each piece against the pattern (generated in `want`) as it arrives.
fn recv_block(
    from: &mut TcpStream,
    owner: usize,
    bytes: usize,
    buf: &mut [u8],
    want: &mut [u8],
    from_rank: usize,
) -> Result<(), AllgatherError> {
    let mut at = 0;
    while at < bytes {
        let n = buf.len().min(bytes - at);
        let piece = &mut buf[..n];
        from.read_exact(piece)
            .map_err(|source| AllgatherError::Io {
                what: "receive",
                rank: from_rank,
                source,
            })?;
        if let Some(i) = pattern::first_mismatch(owner, at, piece, want) {
            return Err(AllgatherError::Corrupt {
                owner,
                offset: at + i,
            });
        }
        at += n;
    }
    Ok(())
}

/// The report for per-iteration `seconds` (at least one), shared with the NCCL backend.
pub(crate) fn summarize(
    world: usize,
    rank: usize,
    bytes: usize,
    seconds: Vec<f64>,
) -> AllgatherResult {
    let mut sorted = seconds.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    let algbw = bytes as f64 * world as f64 / median.max(1e-9) / 1e9;
    AllgatherResult {
        world,
        rank,
        bytes_per_rank: bytes,
        iterations: seconds.len() as u32,
        median_seconds: median,
        seconds,
        algbw_gbps: algbw,
        busbw_gbps: algbw * (world - 1) as f64 / world as f64,
        peak_rss_bytes: crate::rss::peak_rss_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Free loopback addresses (bound and released; good enough for tests on one machine).
    fn addrs(n: usize) -> Vec<SocketAddr> {
        let ls: Vec<TcpListener> = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        ls.iter().map(|l| l.local_addr().unwrap()).collect()
    }

    fn world(
        n: usize,
        bytes: usize,
        edit: impl Fn(usize, &mut AllgatherConfig),
    ) -> Vec<Result<AllgatherResult, AllgatherError>> {
        let peers = addrs(n);
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let mut cfg = AllgatherConfig {
                    peers: peers.clone(),
                    rank,
                    bytes,
                    iterations: 3,
                    timeout: Duration::from_secs(10),
                    connect_timeout: None,
                };
                edit(rank, &mut cfg);
                std::thread::spawn(move || run(&cfg))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn ranks_exchange_and_verify_their_blocks() {
        for n in [2, 3, 5] {
            // Not a multiple of the piece size, to cover the last short piece.
            let bytes = 3 * PIECE + 12_345;
            for (rank, r) in world(n, bytes, |_, _| {}).into_iter().enumerate() {
                let r = r.unwrap_or_else(|e| panic!("world {n} rank {rank}: {e}"));
                assert_eq!((r.world, r.rank, r.bytes_per_rank), (n, rank, bytes));
                assert_eq!(r.seconds.len(), 3);
                assert!(r.algbw_gbps > 0.0 && r.busbw_gbps < r.algbw_gbps);
            }
        }
    }

    #[test]
    fn a_missing_rank_ends_at_the_deadline_with_its_name() {
        let peers = addrs(3);
        let started = Instant::now();
        let cfg = AllgatherConfig {
            peers,
            rank: 0,
            bytes: 1024,
            iterations: 1,
            timeout: Duration::from_millis(600),
            connect_timeout: None,
        };
        let e = run(&cfg).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        let s = e.to_string();
        assert!(s.contains("rank 1") || s.contains("rank 2"), "{s}");
    }

    #[test]
    fn mismatched_peers_are_rejected_clearly() {
        let results = world(2, 4096, |rank, cfg| {
            if rank == 1 {
                cfg.bytes = 8192;
                cfg.timeout = Duration::from_secs(2);
            } else {
                cfg.timeout = Duration::from_secs(2);
            }
        });
        let msgs: Vec<String> = results
            .into_iter()
            .map(|r| r.expect_err("a mismatched run must fail").to_string())
            .collect();
        assert!(
            msgs.iter()
                .any(|m| m.contains("rejected") && m.contains("bytes per rank")),
            "{msgs:?}"
        );
    }

    #[test]
    fn a_stranger_is_not_a_peer() {
        let peers = addrs(2);
        let p = peers.clone();
        let stranger = std::thread::spawn(move || {
            // Say something else to rank 0 first; then the real rank 1 runs.
            for _ in 0..100 {
                if let Ok(mut s) = TcpStream::connect(p[0]) {
                    let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n and some more bytes....");
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let h: Vec<_> = (0..2)
            .map(|rank| {
                let cfg = AllgatherConfig {
                    peers: peers.clone(),
                    rank,
                    bytes: 1000,
                    iterations: 1,
                    timeout: Duration::from_secs(5),
                    connect_timeout: None,
                };
                std::thread::spawn(move || run(&cfg))
            })
            .collect();
        stranger.join().unwrap();
        // Rank 0 turns the stranger away and goes on waiting for rank 1.
        for r in h.into_iter().map(|h| h.join().unwrap()) {
            let r = r.unwrap();
            assert_eq!(r.bytes_per_rank, 1000);
        }
    }

    /// A probe of the previous protocol (another data pattern) is turned away at the handshake,
    /// not taken for a peer whose data is corrupt.
    #[test]
    fn a_version_1_probe_is_turned_away() {
        let peers = addrs(2);
        let to = peers[0];
        let old = std::thread::spawn(move || {
            let hello = Hello {
                version: 1,
                world: 2,
                rank: 1,
                bytes: 1000,
            }
            .encode(MAGIC);
            for _ in 0..100 {
                if let Ok(mut s) = TcpStream::connect(to) {
                    let _ = s.write_all(&hello);
                    let _ = s.read(&mut [0u8; 1]);
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let r = run(&AllgatherConfig {
            peers,
            rank: 0,
            bytes: 1000,
            iterations: 1,
            timeout: Duration::from_millis(1500),
            connect_timeout: None,
        });
        old.join().unwrap();
        let e = r.expect_err("no real peer came").to_string();
        assert!(
            e.contains("rejected") && e.contains("protocol version 1"),
            "{e}"
        );
    }

    /// A path that flips one byte is caught by the receiver's check, not reported as a pass.
    #[test]
    fn a_corrupting_path_fails_the_check() {
        let [a0, a1, proxy] = <[SocketAddr; 3]>::try_from(addrs(3)).unwrap();
        // Rank 0 reaches rank 1 through the proxy; rank 1 reaches rank 0 directly.
        let listener = TcpListener::bind(proxy).unwrap();
        std::thread::spawn(move || {
            let (mut down, _) = listener.accept().unwrap();
            let mut up = loop {
                if let Ok(s) = TcpStream::connect(a1) {
                    break s;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let (mut down_r, mut up_w) = (down.try_clone().unwrap(), up.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                let mut seen = 0usize;
                while let Ok(n) = down_r.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    // After the handshake and the first barrier token, in the second piece (the
                    // check locates it across pieces).
                    let flip = 36 + 1 + PIECE + 1000;
                    if (seen..seen + n).contains(&flip) {
                        buf[flip - seen] ^= 0x40;
                    }
                    seen += n;
                    if up_w.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
            let _ = std::io::copy(&mut up, &mut down);
        });
        let cfg = |rank, peers: Vec<SocketAddr>| AllgatherConfig {
            peers,
            rank,
            bytes: 2 * PIECE + 5000,
            iterations: 1,
            timeout: Duration::from_secs(5),
            connect_timeout: None,
        };
        let r0 = std::thread::spawn({
            let c = cfg(0, vec![a0, proxy]);
            move || run(&c)
        });
        let r1 = run(&cfg(1, vec![a0, a1]));
        let _ = r0.join().unwrap();
        match r1 {
            Err(AllgatherError::Corrupt { owner, offset }) => {
                assert_eq!((owner, offset), (0, PIECE + 1000))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_partner_that_never_comes_fails_at_the_connect_timeout() {
        let started = Instant::now();
        let r = run(&AllgatherConfig {
            peers: addrs(2),
            rank: 0,
            bytes: 1024,
            iterations: 1,
            timeout: Duration::from_secs(30),
            connect_timeout: Some(Duration::from_millis(300)),
        });
        assert!(r.is_err(), "{r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn bad_configurations() {
        let cfg = |peers: Vec<SocketAddr>, rank, bytes| AllgatherConfig {
            peers,
            rank,
            bytes,
            iterations: 1,
            timeout: Duration::from_secs(1),
            connect_timeout: None,
        };
        assert!(matches!(
            run(&cfg(addrs(1), 0, 10)),
            Err(AllgatherError::Config(_))
        ));
        assert!(matches!(
            run(&cfg(addrs(2), 2, 10)),
            Err(AllgatherError::Config(_))
        ));
        assert!(matches!(
            run(&cfg(addrs(2), 0, 0)),
            Err(AllgatherError::Config(_))
        ));
    }
}
