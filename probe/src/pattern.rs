//! The data every allgather rank contributes: a deterministic pattern per owner rank, generated
//! and checked piece by piece at any offset, so neither the sender nor the receiver ever holds a
//! whole block (the probe's memory does not grow with `--size`).
//!
//! A block is a run of 4 KiB rows of little-endian 64-bit words; word `j` of row `k` of rank
//! `r`'s block is `ROW_TABLE[j] ^ row_key(r, k)`. `row_key` is a bijective mix of `(r, k)`, so
//! every row of every rank differs (a misplaced, repeated or other rank's row is caught), and
//! the table makes the words within a row differ. Generating a full row is one XOR per word,
//! which the compiler vectorizes: several GB/s per core, so a check that verifies as it receives
//! is not limited by the pattern. The TCP allgather and the NCCL backend both use it.

/// Bytes in a row (one key per row).
const ROW: usize = 4096;
const ROW_WORDS: usize = ROW / 8;

/// SplitMix64's finalizer: a bijection on u64 with good mixing.
const fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The words of a row before its key is applied.
static ROW_TABLE: [u64; ROW_WORDS] = {
    let mut t = [0u64; ROW_WORDS];
    let mut i = 0;
    while i < ROW_WORDS {
        t[i] = mix(0x666c_7072_6f62_6500 ^ i as u64);
        i += 1;
    }
    t
};

/// The key of row `row` of `rank`'s block: distinct for every (rank, row) with rank < 2^32 and
/// row < 2^32 (blocks up to 16 TiB), as `mix` is a bijection.
fn row_key(rank: usize, row: usize) -> u64 {
    mix(((rank as u64) << 32) ^ (row as u64 & 0xFFFF_FFFF))
}

/// The byte at `offset` of `rank`'s block.
pub fn byte(rank: usize, offset: usize) -> u8 {
    let word = ROW_TABLE[(offset % ROW) / 8] ^ row_key(rank, offset / ROW);
    word.to_le_bytes()[offset % 8]
}

/// Writes bytes `start..start + buf.len()` of `rank`'s block into `buf`.
pub fn fill_at(rank: usize, start: usize, buf: &mut [u8]) {
    let mut at = start;
    let mut rest = buf;
    while !rest.is_empty() {
        let row = at / ROW;
        let in_row = at % ROW;
        let n = (ROW - in_row).min(rest.len());
        let (head, tail) = rest.split_at_mut(n);
        let key = row_key(rank, row);
        if n == ROW {
            // A whole row: word by word (the vectorized path).
            for (out, t) in head.chunks_exact_mut(8).zip(ROW_TABLE.iter()) {
                out.copy_from_slice(&(t ^ key).to_le_bytes());
            }
        } else {
            for (i, out) in head.iter_mut().enumerate() {
                let o = in_row + i;
                *out = (ROW_TABLE[o / 8] ^ key).to_le_bytes()[o % 8];
            }
        }
        at += n;
        rest = tail;
    }
}

/// Where `got` (bytes `start..` of `rank`'s block) first differs from the pattern, relative to
/// `start`; `None` when it all matches. `scratch` (at least `got.len()` bytes) is overwritten:
/// the expected piece is generated there and compared as memory.
pub fn first_mismatch(rank: usize, start: usize, got: &[u8], scratch: &mut [u8]) -> Option<usize> {
    let want = &mut scratch[..got.len()];
    fill_at(rank, start, want);
    if got == &want[..] {
        return None;
    }
    got.iter().zip(want.iter()).position(|(a, b)| a != b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_at_any_offset_agree_with_the_byte_function() {
        for rank in [0, 1, 7] {
            for (start, len) in [
                (0, 10_000),
                (4095, 2),
                (4093, 8200),
                (12_345, 65_536),
                (1 << 20, 4096),
            ] {
                let mut buf = vec![0u8; len];
                fill_at(rank, start, &mut buf);
                for (i, b) in buf.iter().enumerate() {
                    assert_eq!(
                        *b,
                        byte(rank, start + i),
                        "rank {rank} offset {}",
                        start + i
                    );
                }
            }
        }
    }

    #[test]
    fn ranks_and_rows_differ() {
        let block = |rank, start| {
            let mut b = vec![0u8; ROW];
            fill_at(rank, start, &mut b);
            b
        };
        assert_ne!(block(0, 0), block(1, 0));
        assert_ne!(block(0, 0), block(0, ROW));
        // Within a row the words differ too.
        let b = block(3, 0);
        assert_ne!(b[..8], b[8..16]);
        // A zeroed buffer never passes.
        let mut scratch = vec![0u8; ROW];
        assert!(first_mismatch(0, 0, &[0u8; ROW], &mut scratch).is_some());
    }

    #[test]
    fn a_flipped_byte_is_found_where_it_is() {
        let mut buf = vec![0u8; 3 * ROW + 17];
        fill_at(2, 100, &mut buf);
        let mut scratch = vec![0u8; buf.len()];
        assert_eq!(first_mismatch(2, 100, &buf, &mut scratch), None);
        buf[5000] ^= 0x40;
        assert_eq!(first_mismatch(2, 100, &buf, &mut scratch), Some(5000));
        // Someone else's data at the right place is not this rank's.
        fill_at(3, 100, &mut buf);
        assert!(first_mismatch(2, 100, &buf, &mut scratch).is_some());
    }
}
