//! The 36-byte header both of the probe's TCP exchanges open with (the allgather ring and the
//! NCCL id exchange): an 8-byte magic naming the exchange, then the protocol version, world
//! size, rank and block size, big-endian. Each exchange has its own magic, so a peer of one is
//! never mistaken for a peer of the other.

use std::time::{Duration, Instant};

/// Bytes of an encoded header.
pub(crate) const HELLO_LEN: usize = 36;

pub(crate) struct Hello {
    pub version: u32,
    pub world: u64,
    pub rank: u64,
    pub bytes: u64,
}

impl Hello {
    pub fn encode(&self, magic: &[u8; 8]) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(magic);
        b[8..12].copy_from_slice(&self.version.to_be_bytes());
        b[12..20].copy_from_slice(&self.world.to_be_bytes());
        b[20..28].copy_from_slice(&self.rank.to_be_bytes());
        b[28..36].copy_from_slice(&self.bytes.to_be_bytes());
        b
    }

    /// `None` without `magic`: not a peer of this exchange.
    pub fn decode(magic: &[u8; 8], b: &[u8; HELLO_LEN]) -> Option<Hello> {
        if &b[..8] != magic {
            return None;
        }
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(x)
        };
        let mut v = [0u8; 4];
        v.copy_from_slice(&b[8..12]);
        Some(Hello {
            version: u32::from_be_bytes(v),
            world: u64_at(12),
            rank: u64_at(20),
            bytes: u64_at(28),
        })
    }
}

/// Time left until `deadline`; `None` once it has passed.
pub(crate) fn left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}
