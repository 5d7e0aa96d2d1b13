//! What the distributions share: the contract's word-to-float conversions (TensorFlow's,
//! exact by construction) and the split of an output into pieces that each start at their
//! own counter offset.
//!
//! A piece is generated a sub-chunk at a time: [`SUB`] elements' words go into a 28 KiB
//! buffer (L1-resident) with Philox's own kernel, then a conversion loop turns them into
//! values. Pieces of [`CHUNK`] elements run as tasks of the caller's [`Parallelism`] once an
//! output has [`SERIAL_BELOW`] elements.

use half::{bf16, f16};

use super::philox::{self, Level};
use crate::parallel::{for_each_item, Parallelism, Sequential, Splittable};

/// Elements per threaded task (the kernels' shared chunk, a multiple of 4, so every task
/// starts on a block), and the length below which everything runs on the calling thread.
pub use crate::parallel::{CHUNK, SERIAL_BELOW};
/// Elements per word buffer (at most four words each: 28 KiB, L1-resident). A multiple of
/// 224 words (Philox's AVX-512 batch of 56 blocks; 7 AVX2 batches of 8 blocks), so that a
/// sub-chunk's words are whole batches and none is computed only to be thrown away.
pub const SUB: usize = 1792;
const BUF_WORDS: usize = 4 * SUB;

const _: () = assert!(SUB.is_multiple_of(224) && CHUNK.is_multiple_of(4));

/// `f32(x)`: uniform in `[0, 1)` from the low 23 bits.
#[inline(always)]
pub fn f32_of(x: u32) -> f32 {
    f32::from_bits(0x3F80_0000 | (x & 0x007F_FFFF)) - 1.0
}

/// `f16(x)`: uniform in `[0, 1)` from the low 10 bits (the subtraction is exact).
#[inline(always)]
pub fn f16_of(x: u32) -> f16 {
    f16::from_bits(0x3C00 | (x & 0x03FF) as u16) - f16::ONE
}

/// `bf16(x)`: uniform in `[0, 1)` from the low 7 bits (the subtraction is exact).
#[inline(always)]
pub fn bf16_of(x: u32) -> bf16 {
    bf16::from_bits(0x3F80 | (x & 0x007F) as u16) - bf16::ONE
}

/// `f64(x0, x1)`: uniform in `[0, 1)` from the low 20 bits of `x0` and all of `x1`.
#[inline(always)]
pub fn f64_of(x0: u32, x1: u32) -> f64 {
    f64::from_bits(0x3FF0_0000_0000_0000 | u64::from(x0 & 0x000F_FFFF) << 32 | u64::from(x1)) - 1.0
}

/// How many words an output of `n` elements consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Words {
    /// One per element (uniform float/float16/bfloat16, dropout).
    One,
    /// Two per element (uniform double).
    Two,
    /// Two per pair of elements, an odd last element taking a whole pair (normal, float).
    PairsOfTwo,
    /// Four per pair of elements (normal, double).
    PairsOfFour,
}

impl Words {
    /// Words consumed by `n` elements.
    pub fn of(self, n: usize) -> usize {
        match self {
            Words::One => n,
            Words::Two => 2 * n,
            Words::PairsOfTwo => 2 * n.div_ceil(2),
            Words::PairsOfFour => 4 * n.div_ceil(2),
        }
    }

    /// The state after `n` elements drawn from `state`.
    pub fn after(self, state: &[u32; 6], n: usize) -> [u32; 6] {
        philox::advance(state, philox::blocks_for(self.of(n)))
    }
}

/// An output tensor of one of the four float types.
#[derive(Debug)]
pub enum Output<'a> {
    /// float
    F32(&'a mut [f32]),
    /// double
    F64(&'a mut [f64]),
    /// float16
    F16(&'a mut [f16]),
    /// bfloat16
    BF16(&'a mut [bf16]),
}

impl Output<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Output::F32(o) => o.len(),
            Output::F64(o) => o.len(),
            Output::F16(o) => o.len(),
            Output::BF16(o) => o.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A mutable slice as a unit of threaded work.
pub(crate) struct Piece<'a, T>(pub &'a mut [T]);

impl<T: Send> Splittable for Piece<'_, T> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.0.split_at_mut(mid);
        (Piece(a), Piece(b))
    }
}

/// Runs `f(state, piece)` over `work`: whole on the calling thread below [`SERIAL_BELOW`]
/// elements, else in pieces of [`CHUNK`] elements on `par`, each piece with the state at its
/// own first element. Returns the state after the whole output.
pub(crate) fn split<W: Splittable>(
    state: &[u32; 6],
    work: W,
    words: Words,
    par: &dyn Parallelism,
    f: impl Fn(&[u32; 6], W) + Sync,
) -> [u32; 6] {
    let n = work.len();
    let next = words.after(state, n);
    if n < SERIAL_BELOW {
        f(state, work);
        return next;
    }
    let mut items = Vec::with_capacity(n.div_ceil(CHUNK));
    let (mut rest, mut start) = (work, 0);
    while !rest.is_empty() {
        let take = rest.len().min(CHUNK);
        let (head, tail) = rest.split_at(take);
        items.push((words.after(state, start), head));
        start += CHUNK;
        rest = tail;
    }
    for_each_item(par, items, |(s, w)| f(&s, w));
    next
}

/// Calls `g(words, start, n)` for each sub-chunk `start .. start + n` of a piece of `len`
/// elements drawn from `state`, with that sub-chunk's words made at `level`.
///
/// # Panics
///
/// When `level` is not available on this CPU.
pub(crate) fn for_each_sub(
    level: Level,
    state: &[u32; 6],
    len: usize,
    words: Words,
    mut g: impl FnMut(&[u32], usize, usize),
) {
    let mut buf = [0u32; BUF_WORDS];
    let mut st = *state;
    let mut start = 0;
    while start < len {
        let n = SUB.min(len - start);
        let w = words.of(n);
        st = philox::fill_with(level, &st, &mut buf[..w], &Sequential);
        g(&buf[..w], start, n);
        start += n;
    }
}
