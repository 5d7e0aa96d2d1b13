//! Philox4x32-10 random bits (Random123, Salmon et al., SC 2011).
//!
//! The state is six words `[c0, c1, c2, c3, k0, k1]`: a 128-bit counter
//! `C = c0 | c1 << 32 | c2 << 64 | c3 << 96` (see [`counter_of`]) and a key `(k0, k1)`.
//! Output element `i` (flat, row-major) is word `i % 4` of `philox4x32_10(C + i / 4, key)`,
//! the counter wrapping at 2^128; a partial last block gives its first words. The state after
//! a call is `C + ceil(len / 4)` with the key unchanged ([`advance`], [`blocks_for`]).
//!
//! [`fill`] picks the widest SIMD kernel the CPU has once ([`detected`]); [`fill_with`] forces
//! one ([`Level`]). Every level and every split over threads gives bitwise the same output.

pub mod reference;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::parallel::for_each_item;
use crate::simd::Isa;
use crate::Parallelism;

/// Multiplier of counter word 0.
pub const M0: u32 = 0xD251_1F53;
/// Multiplier of counter word 2.
pub const M1: u32 = 0xCD9E_8D57;
/// Weyl increment of key word 0, added before rounds 2..10.
pub const W0: u32 = 0x9E37_79B9;
/// Weyl increment of key word 1, added before rounds 2..10.
pub const W1: u32 = 0xBB67_AE85;
/// Rounds per block.
pub const ROUNDS: usize = 10;

/// Output words per task when a call's work is spread over threads (the kernels' shared
/// [`crate::parallel::CHUNK`], a multiple of 4, so every task starts on a block boundary),
/// and the output length below which everything runs on the calling thread.
pub use crate::parallel::{CHUNK, SERIAL_BELOW};

const _: () = assert!(CHUNK.is_multiple_of(4));

/// The 128-bit counter of a state, `c0` least significant.
pub fn counter_of(state: &[u32; 6]) -> u128 {
    u128::from(state[0]) | u128::from(state[1]) << 32 | u128::from(state[2]) << 64 | u128::from(state[3]) << 96
}

/// `state` with its counter replaced by `counter`, the key kept.
pub fn with_counter(state: &[u32; 6], counter: u128) -> [u32; 6] {
    let [c0, c1, c2, c3] = words(counter);
    [c0, c1, c2, c3, state[4], state[5]]
}

/// `state` with its counter advanced by `blocks` (mod 2^128, carrying across all four words),
/// the key kept.
pub fn advance(state: &[u32; 6], blocks: u128) -> [u32; 6] {
    with_counter(state, counter_of(state).wrapping_add(blocks))
}

/// Counter blocks that an output of `len` words uses: `ceil(len / 4)`.
pub fn blocks_for(len: usize) -> u128 {
    len.div_ceil(4) as u128
}

/// The kernel levels (shared with the other kernels): Philox runs 8 blocks at a time with
/// AVX2 (two interleaved sets of 4) and 56 with AVX-512F (seven interleaved sets of 8).
pub use crate::simd::{available_levels, detected, Level};

/// Fills `out` from `state` with the [`detected`] level and returns the next state.
/// Outputs of [`SERIAL_BELOW`] words or more are split into [`CHUNK`]-word tasks run on `par`;
/// the result does not depend on `par`.
pub fn fill(state: &[u32; 6], out: &mut [u32], par: &dyn Parallelism) -> [u32; 6] {
    fill_with(detected(), state, out, par)
}

/// [`fill`] with a given level, for tests and benchmarks. Outputs of [`STREAM_BYTES`] or
/// more bypass the caches (non-temporal stores, fenced before each task returns); the bits
/// are the same either way.
///
/// # Panics
///
/// When `level` is not available on this CPU (see [`Level::is_available`]).
pub fn fill_with(level: Level, state: &[u32; 6], out: &mut [u32], par: &dyn Parallelism) -> [u32; 6] {
    fill_stores(level, Stores::Auto, state, out, par)
}

/// Which stores a fill uses (benchmarks force each to choose [`STREAM_BYTES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stores {
    /// Streaming from [`STREAM_BYTES`] up, normal below.
    Auto,
    /// Normal (cached) stores at any size.
    Normal,
    /// Streaming stores at any size that has whole cache lines (SIMD levels only).
    Streaming,
}

/// [`fill_with`] with the store policy given.
///
/// # Panics
///
/// When `level` is not available on this CPU (see [`Level::is_available`]).
pub fn fill_stores(level: Level, stores: Stores, state: &[u32; 6], out: &mut [u32], par: &dyn Parallelism) -> [u32; 6] {
    let isa = level.isa().unwrap_or_else(|| panic!("philox: {level:?} is not available on this CPU"));
    let (counter, key) = (counter_of(state), [state[4], state[5]]);
    let stream = match stores {
        Stores::Auto => streams(isa, out),
        Stores::Normal => false,
        Stores::Streaming => !matches!(isa, Isa::Scalar) && head_words(out).is_multiple_of(4),
    };
    if out.len() < SERIAL_BELOW {
        run(isa, counter, key, out, stream);
    } else {
        // With streaming stores, the first piece runs up to the first 64-byte boundary, so
        // every later one starts on a cache line (and still on a block: `streams` checked
        // that the head is whole blocks).
        let head = if stream { head_words(out) } else { 0 };
        let (first, rest) = out.split_at_mut(head);
        let items: Vec<(u128, &mut [u32])> = core::iter::once(first)
            .filter(|f| !f.is_empty())
            .chain(rest.chunks_mut(CHUNK))
            .scan(0usize, |offset, chunk| {
                let item = (counter.wrapping_add(blocks_for(*offset)), chunk);
                *offset += item.1.len();
                Some(item)
            })
            .collect();
        for_each_item(par, items, |(counter, chunk)| run(isa, counter, key, chunk, stream));
    }
    advance(state, blocks_for(out.len()))
}

/// Outputs of this many bytes or more are written with non-temporal (streaming) stores,
/// which skip reading each line before writing it and leave the caches to other data.
/// Chosen by measurement (`benches/philox_stream.rs`; the README's Performance section): on
/// the 2-core AVX-512 host streaming was 1.0-1.2x the normal stores at every size from
/// 1 MiB, so the fill alone would stream everywhere; but an output that fits in the L2 of
/// the cores writing it (2 x 2 MiB there) is read next by its consumer (a dropout mask, a
/// uniform draw) from cache, so only outputs that could not stay there anyway stream.
pub const STREAM_BYTES: usize = 4 << 20;

/// Words before the first 64-byte boundary of `out`.
fn head_words(out: &[u32]) -> usize {
    (out.as_ptr().align_offset(64)).min(out.len())
}

/// Whether a call on `out` streams: a SIMD level, at least [`STREAM_BYTES`], and an output
/// whose first cache line starts on a whole block (every buffer onnxruntime allocates is
/// 64-byte aligned; an odd offset keeps the normal stores).
fn streams(isa: Isa, out: &[u32]) -> bool {
    !matches!(isa, Isa::Scalar) && out.len() * 4 >= STREAM_BYTES && head_words(out).is_multiple_of(4)
}

/// Fills `out` with the blocks of counters `counter, counter + 1, ..` under `key`, with the
/// kernel of `isa`; with streaming stores where `stream` and `out` is 64-byte aligned.
fn run(isa: Isa, counter: u128, key: [u32; 2], out: &mut [u32], stream: bool) {
    match isa {
        Isa::Scalar => philox_scalar(counter, key, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2.
        Isa::Avx2(token) => unsafe { x86::philox_avx2(token, counter, key, out, stream) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(token) => unsafe { x86::philox_avx512(token, counter, key, out, stream) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2(_) | Isa::Avx512(_) => unreachable!("SIMD levels are never available off x86_64"),
    }
}

/// The four words of a counter, least significant first.
#[inline(always)]
fn words(counter: u128) -> [u32; 4] {
    [counter as u32, (counter >> 32) as u32, (counter >> 64) as u32, (counter >> 96) as u32]
}

/// The key of each round: `key + r * (W0, W1)` for round `r = 0..10`.
#[inline(always)]
fn round_keys(key: [u32; 2]) -> [[u32; 2]; ROUNDS] {
    let mut keys = [key; ROUNDS];
    for r in 1..ROUNDS {
        keys[r] = [keys[r - 1][0].wrapping_add(W0), keys[r - 1][1].wrapping_add(W1)];
    }
    keys
}

/// One block under precomputed round keys.
#[inline(always)]
fn block(counter: [u32; 4], keys: &[[u32; 2]; ROUNDS]) -> [u32; 4] {
    let mut c = counter;
    for k in keys {
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// The portable kernel.
fn philox_scalar(counter: u128, key: [u32; 2], out: &mut [u32]) {
    let keys = round_keys(key);
    let mut counter = counter;
    for chunk in out.chunks_mut(4) {
        let b = block(words(counter), &keys);
        chunk.copy_from_slice(&b[..chunk.len()]);
        counter = counter.wrapping_add(1);
    }
}

#[cfg(test)]
mod tests;
