//! What the distributions share: the split of an output into pieces that each start at their
//! own counter offset (the word-to-float conversions live in `convert.rs`, below the SIMD
//! kernels, and are re-exported here).
//!
//! A piece is generated a sub-chunk at a time: [`SUB`] elements' words go into a 28 KiB
//! buffer (L1-resident) with Philox's own kernel, then a conversion loop turns them into
//! values. Pieces of [`CHUNK`] elements run as tasks of the caller's [`Parallelism`] once an
//! output has [`SERIAL_BELOW`] elements.

use half::{bf16, f16};

/// The word-to-float conversions, where the distributions' callers have always found them.
pub use super::convert::{bf16_of, f16_of, f32_of, f64_of};
use super::philox::{self, Level, Stores};
use crate::parallel::{for_each_item, Parallelism, Sequential, Splittable};
use crate::simd::Isa;

/// Elements per threaded task (the kernels' shared chunk, a multiple of 4, so every task
/// starts on a block), and the length below which everything runs on the calling thread.
pub use crate::parallel::{CHUNK, SERIAL_BELOW};
/// Elements per word buffer (at most four words each: 28 KiB, L1-resident). A multiple of
/// 224 words (Philox's AVX-512 batch of 56 blocks; 7 AVX2 batches of 8 blocks), so that a
/// sub-chunk's words are whole batches and none is computed only to be thrown away.
pub const SUB: usize = 1792;
const BUF_WORDS: usize = 4 * SUB;

const _: () = assert!(SUB.is_multiple_of(224) && CHUNK.is_multiple_of(4));

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
/// own first element; with `head > 0` the first piece is the `head` elements before the
/// output's first cache line (see [`stream_head`]), so that every later piece starts on one.
/// Returns the state after the whole output.
pub(crate) fn split<W: Splittable>(
    state: &[u32; 6],
    work: W,
    words: Words,
    head: usize,
    par: &dyn Parallelism,
    f: impl Fn(&[u32; 6], W) + Sync,
) -> [u32; 6] {
    let n = work.len();
    let next = words.after(state, n);
    if n < SERIAL_BELOW {
        f(state, work);
        return next;
    }
    let mut items = Vec::with_capacity(n.div_ceil(CHUNK) + 1);
    let (mut rest, mut start) = (work, 0);
    let mut take = head.min(n);
    if take == 0 {
        take = CHUNK;
    }
    while !rest.is_empty() {
        let take_now = take.min(rest.len());
        let (first, tail) = rest.split_at(take_now);
        items.push((words.after(state, start), first));
        start += take;
        rest = tail;
        take = CHUNK;
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

/// [`split`] over an output slice under the store policy `stores`: `f(state, piece, stream)`,
/// with the first piece cut at the output's first cache line when it streams.
pub(crate) fn split_out<T: Copy + Send>(
    isa: Isa,
    stores: Stores,
    state: &[u32; 6],
    out: &mut [T],
    words: Words,
    par: &dyn Parallelism,
    f: impl Fn(&[u32; 6], &mut [T], bool) + Sync,
) -> [u32; 6] {
    let stream = streams::<T>(isa, stores, out.len());
    let head = stream_head(stream, words, out);
    split(state, Piece(out), words, head, par, |s, p| f(s, p.0, stream))
}

/// Fills the piece `out` drawn from `state` a sub-chunk at a time: `g(words, values)` writes
/// a sub-chunk's values, into `out` itself or (`stream`) through a [`Sink`].
pub(crate) fn fill_piece<T: Copy + Default>(
    level: Level,
    stream: bool,
    state: &[u32; 6],
    out: &mut [T],
    words: Words,
    mut g: impl FnMut(&[u32], &mut [T]),
) {
    let isa = level.isa().unwrap_or_else(|| panic!("random: {level:?} is not available on this CPU"));
    let mut sink = Sink::new(isa, stream);
    for_each_sub(level, state, out.len(), words, |w, start, n| sink.write(&mut out[start..start + n], |o| g(w, o)));
}

/// Whether an output of `n` elements of `T` goes out with non-temporal stores under
/// `stores`: a SIMD level, and (for [`Stores::Auto`]) at least [`philox::STREAM_BYTES`],
/// the same threshold as Philox's own fill.
pub(crate) fn streams<T>(isa: Isa, stores: Stores, n: usize) -> bool {
    !matches!(isa, Isa::Scalar)
        && match stores {
            Stores::Auto => n * size_of::<T>() >= philox::STREAM_BYTES,
            Stores::Normal => false,
            Stores::Streaming => true,
        }
}

/// Elements of `out` before its first 64-byte boundary (all of it when it has none).
pub(crate) fn head_elems<T>(out: &[T]) -> usize {
    (out.as_ptr().cast::<u8>().align_offset(64) / size_of::<T>()).min(out.len())
}

/// The first piece [`split`] should cut when streaming into `out`: the elements before its
/// first cache line, when they are whole Philox blocks (and whole pairs for the normal
/// draws), so that every later piece starts on a cache line; else 0 (plain [`CHUNK`]
/// pieces, whose unaligned edges [`Sink`] writes with normal stores).
pub(crate) fn stream_head<T>(stream: bool, words: Words, out: &[T]) -> usize {
    let head = head_elems(out);
    let pairs = matches!(words, Words::PairsOfTwo | Words::PairsOfFour);
    if stream && words.of(head).is_multiple_of(4) && (!pairs || head.is_multiple_of(2)) {
        head
    } else {
        0
    }
}

/// Where a piece's values go: straight into the output, or (streaming) into an L1 buffer
/// of [`SUB`] elements first, copied out with non-temporal stores for the whole cache lines
/// and normal stores for the unaligned edges; fenced when dropped, so before the piece's
/// task returns.
pub(crate) struct Sink<T> {
    isa: Isa,
    buf: Vec<T>,
}

impl<T: Copy + Default> Sink<T> {
    /// A sink for one piece; `stream` as from [`streams`].
    pub(crate) fn new(isa: Isa, stream: bool) -> Self {
        let stream = stream && !matches!(isa, Isa::Scalar);
        Sink { isa, buf: if stream { vec![T::default(); SUB] } else { Vec::new() } }
    }

    /// `f(dst)`, or its effect through the buffer; `dst` has at most [`SUB`] elements.
    pub(crate) fn write(&mut self, dst: &mut [T], f: impl FnOnce(&mut [T])) {
        if self.buf.is_empty() {
            f(dst);
        } else {
            let tmp = &mut self.buf[..dst.len()];
            f(tmp);
            stream_copy(self.isa, tmp, dst);
        }
    }
}

impl<T> Drop for Sink<T> {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            fence();
        }
    }
}

/// Fences this thread's non-temporal stores when dropped (for loops that stream without a
/// [`Sink`]).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Fenced;

impl Drop for Fenced {
    fn drop(&mut self) {
        fence();
    }
}

/// Orders this thread's non-temporal stores before anything it does next.
fn fence() {
    #[cfg(target_arch = "x86_64")]
    super::x86::sfence();
}

/// [`stream_copy`], fenced: a copy larger than the caches, outside a [`Sink`].
pub(crate) fn stream_copy_fenced<T: Copy>(isa: Isa, src: &[T], dst: &mut [T]) {
    stream_copy(isa, src, dst);
    #[cfg(target_arch = "x86_64")]
    super::x86::sfence();
}

/// `dst.copy_from_slice(src)`, the 64-byte lines of `dst` with non-temporal stores at a SIMD
/// `isa` (unfenced: [`Sink`] fences), its unaligned head and tail with normal stores.
pub(crate) fn stream_copy<T: Copy>(isa: Isa, src: &[T], dst: &mut [T]) {
    assert_eq!(src.len(), dst.len(), "stream_copy: lengths differ");
    let size = size_of::<T>();
    let head = head_elems(dst);
    let line = if size == 0 || 64 % size != 0 { 0 } else { 64 / size };
    let lines = (dst.len() - head).checked_div(line).unwrap_or(0);
    let body = head + lines * line;
    dst[..head].copy_from_slice(&src[..head]);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `src[head..body]` and `dst[head..body]` are `64 * lines` bytes of distinct
        // slices, and `dst[head..]` starts on a 64-byte boundary; the token proves AVX-512F.
        Isa::Avx512(token) => unsafe {
            super::x86::stream_lines_avx512(token, src[head..].as_ptr().cast(), dst[head..].as_mut_ptr().cast(), lines)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as for AVX-512F; the token proves AVX2.
        Isa::Avx2(token) => unsafe {
            super::x86::stream_lines_avx2(token, src[head..].as_ptr().cast(), dst[head..].as_mut_ptr().cast(), lines)
        },
        _ => dst[head..body].copy_from_slice(&src[head..body]),
    }
    dst[body..].copy_from_slice(&src[body..]);
}
