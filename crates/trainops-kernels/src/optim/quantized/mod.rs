//! Optimizers with 8-bit state (after bitsandbytes' `Adam8bit` and torchao's `AdamW8bit`):
//! the two moments of Adam are stored as one byte per element, blockwise-quantised.
//!
//! **Format.** A tensor of `n` elements is cut into blocks of [`BLOCK`] = 256 consecutive
//! elements (flat, row-major; the last block may be short). Each moment stores a `u8` code
//! per element and one `f32` scale per block, the block's absmax (largest `|value|`). The
//! first moment uses the signed dynamic map, the second the unsigned one
//! ([`reference::dynamic_map`], bitsandbytes' `create_dynamic_map`). The value of code `c`
//! in a block with scale `a` is `map[c] * a` (in `f32`). Quantising a block: `a` = its
//! absmax (NaN when any value is NaN), each value `v` becomes the index of the map entry
//! nearest to `v / a` (`v / 1` when `a == 0`), the lower one on a tie. State per parameter:
//! 2 bytes + 8 bytes per 256 = 2.03 bytes, against 8 for float32 moments.
//!
//! **Step.** One pass per block: dequantise both moments, update every element with the
//! float formula of the optimizer (its [`adamw::Rule`]: ONNX Adam's, or PyTorch AdamW's),
//! requantise the new moments with new scales. The weights' update uses the new moments
//! before requantisation, as bitsandbytes and torchao do. A NaN in a block's new moment
//! makes its scale NaN, so the whole block of that moment reads as NaN from then on.
//!
//! **Fast path.** The same per-element code, on block buffers for the moments (`X` and the
//! codes are read from their sources and written to their destinations directly), compiled
//! three times: portable, and with AVX2 and AVX-512F enabled (`x86`), where the compiler
//! vectorises the update and the absmax; the codecs are explicit: portable and AVX2 find a
//! code with one bucket-table load and one comparison ([`map::Map::code`]); AVX-512 by the
//! map's structure on `v * (1 / d)`, without search or division per element (`decades`),
//! redoing the rare flagged groups by a binary search over permuted registers on `v / d`.
//! Without fused multiply-adds every level gives the reference's bits. The kernel is still
//! compute-bound, short of its memory ceiling (`benches/optim8bit.rs`). Blocks run in
//! [`CHUNK`]-element tasks (a multiple of the
//! block), so a block never straddles two threads and the result is independent of them.

pub mod adamw;
mod decades;
pub mod map;
pub mod reference;
#[cfg(test)]
mod tests;
#[cfg(all(test, target_arch = "x86_64"))]
mod tests_decades;
#[cfg(target_arch = "x86_64")]
mod x86;

use self::adamw::Rule;
use self::map::Map;
use crate::parallel::{run_chunked, Splittable, CHUNK, SERIAL_BELOW};
use crate::simd::{detected, Isa, Level};
use crate::stream::Access;
use crate::{Element, InOut, KernelError, Parallelism};

pub use self::reference::BLOCK;

const _: () = assert!(CHUNK.is_multiple_of(BLOCK));

/// Blocks of a tensor of `n` elements: `ceil(n / 256)`.
pub fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// One quantised moment of a tensor: a code per element and a scale per block.
pub struct Quantized<'a> {
    /// The codes, one per element.
    pub codes: InOut<'a, u8>,
    /// The block scales (absmax), one per [`BLOCK`] elements.
    pub absmax: InOut<'a, f32>,
}

/// One parameter tensor of an 8-bit optimizer: weights, gradient and the two moments.
pub struct Param8bit<'a, G> {
    /// Weights `X` (float32).
    pub x: InOut<'a, f32>,
    /// Gradient `G`, one per weight.
    pub g: &'a [G],
    /// First moment (signed map).
    pub m: Quantized<'a>,
    /// Second moment (unsigned map).
    pub v: Quantized<'a>,
}

impl<'a, G> Param8bit<'a, G> {
    /// Checks that gradient and codes have one element per weight and the scales one per
    /// block.
    pub fn new(x: InOut<'a, f32>, g: &'a [G], m: Quantized<'a>, v: Quantized<'a>) -> Result<Self, KernelError> {
        let n = x.len();
        let check = |what, got, expected| {
            if got == expected {
                Ok(())
            } else {
                Err(KernelError::LengthMismatch { what, got, expected })
            }
        };
        check("G", g.len(), n)?;
        check("M_q", m.codes.len(), n)?;
        check("V_q", v.codes.len(), n)?;
        check("M_absmax", m.absmax.len(), blocks(n))?;
        check("V_absmax", v.absmax.len(), blocks(n))?;
        Ok(Self { x, g, m, v })
    }
}

impl Quantized<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (c0, c1) = self.codes.split_at(mid);
        let (a0, a1) = self.absmax.split_at(blocks(mid));
        (Quantized { codes: c0, absmax: a0 }, Quantized { codes: c1, absmax: a1 })
    }
}

impl<G: Element> Splittable for Param8bit<'_, G> {
    fn len(&self) -> usize {
        self.g.len()
    }

    /// Splits between blocks: `mid` is a multiple of [`BLOCK`] (or the end).
    fn split_at(self, mid: usize) -> (Self, Self) {
        assert!(mid.is_multiple_of(BLOCK) || mid == self.g.len(), "8-bit state splits between blocks");
        let (x0, x1) = self.x.split_at(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (m0, m1) = self.m.split_at(mid);
        let (v0, v1) = self.v.split_at(mid);
        (Param8bit { x: x0, g: g0, m: m0, v: v0 }, Param8bit { x: x1, g: g1, m: m1, v: v1 })
    }
}

/// One step of rule `rule` (an optimizer's per-call coefficients) over every tensor of a
/// node, with the [`detected`] level; bitwise the same for any `par` and any level.
pub fn step<R: Rule, G: Element<C = f32>>(rule: &R, params: Vec<Param8bit<'_, G>>, par: &dyn Parallelism) {
    step_with(detected(), rule, params, par);
}

/// [`step`] with a given level (tests and benchmarks force each one).
///
/// # Panics
/// When `level` is not available on this CPU.
pub fn step_with<R: Rule, G: Element<C = f32>>(
    level: Level,
    rule: &R,
    params: Vec<Param8bit<'_, G>>,
    par: &dyn Parallelism,
) {
    step_chunked(level, rule, params, par, CHUNK, SERIAL_BELOW);
}

/// [`step_with`] in tasks of `chunk` elements (a multiple of [`BLOCK`]) from
/// `serial_below` elements up: tests cut small tensors into many tasks.
pub(crate) fn step_chunked<R: Rule, G: Element<C = f32>>(
    level: Level,
    rule: &R,
    params: Vec<Param8bit<'_, G>>,
    par: &dyn Parallelism,
    chunk: usize,
    serial_below: usize,
) {
    assert!(chunk.is_multiple_of(BLOCK), "tasks hold whole blocks");
    let isa = level.isa().unwrap_or_else(|| panic!("kernel level {level:?} is not available on this CPU"));
    run_chunked(params, par, chunk, serial_below, |p| match isa {
        Isa::Scalar => blocks_8bit(Portable, rule, p),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2.
        Isa::Avx2(t) => unsafe { x86::blocks_8bit_avx2(t, rule, p) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(t) => unsafe { x86::blocks_8bit_avx512(t, rule, p) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2(_) | Isa::Avx512(_) => unreachable!("SIMD levels are never available off x86_64"),
    });
}

/// The stream's source (what is read).
#[inline(always)]
fn source<'s, T: Copy>(s: &'s mut InOut<'_, T>) -> &'s [T] {
    match s.access() {
        Access::InPlace(buf) => buf,
        Access::Split(src, _) => src,
    }
}

/// The stream's destination (what is written).
#[inline(always)]
fn destination<'s, T: Copy>(s: &'s mut InOut<'_, T>) -> &'s mut [T] {
    match s.access() {
        Access::InPlace(buf) => buf,
        Access::Split(_, dst) => dst,
    }
}

/// The block's absmax from the magnitudes' bit patterns (their integer order is the float
/// order, NaN above infinity), NaN canonicalised.
#[inline(always)]
fn absmax(values: &[f32]) -> f32 {
    let bits = values.iter().fold(0u32, |a, v| a.max(v.to_bits() & 0x7fff_ffff));
    if bits > f32::INFINITY.to_bits() {
        f32::NAN
    } else {
        f32::from_bits(bits)
    }
}

/// How a level turns codes into values and back; the portable forms are the definition,
/// the SIMD ones (`x86`) do the same operations in lanes.
pub(crate) trait Codec: Copy {
    /// `out[i] = map[codes[i]] * scale`.
    fn dequantize(self, map: &Map, codes: &[u8], scale: f32, out: &mut [f32]);
    /// `codes[i] = map.code(values[i] / d)` with `d = a`, or 1 when `a == 0`.
    fn quantize(self, map: &Map, values: &[f32], a: f32, codes: &mut [u8]);
}

/// The element loops (every level's tail, and the whole block without SIMD).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Portable;

impl Codec for Portable {
    #[inline(always)]
    fn dequantize(self, map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = map.entries[usize::from(c)] * scale;
        }
    }

    #[inline(always)]
    fn quantize(self, map: &Map, values: &[f32], a: f32, codes: &mut [u8]) {
        let d = divisor(a);
        for (c, &v) in codes.iter_mut().zip(values) {
            *c = map.code(v / d);
        }
    }
}

/// What a block's values are divided by before the map search: its absmax, or 1 for an
/// all-zero block.
#[inline(always)]
pub(crate) fn divisor(a: f32) -> f32 {
    if a == 0.0 {
        1.0
    } else {
        a
    }
}

/// The kernel of every level: block by block, dequantise (from the codes' source), update
/// (`X` from its source to its destination, the moments in block buffers), requantise (to
/// the codes' destination). In place, a block's codes are read before they are rewritten.
#[inline(always)]
pub(crate) fn blocks_8bit<C: Codec, R: Rule, G: Element<C = f32>>(codec: C, rule: &R, p: Param8bit<'_, G>) {
    let (signed, unsigned) = (Map::signed(), Map::unsigned());
    let Param8bit { mut x, g, mut m, mut v } = p;
    let (mut ms, mut vs) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (b, start) in (0..g.len()).step_by(BLOCK).enumerate() {
        let end = (start + BLOCK).min(g.len());
        let (ms, vs) = (&mut ms[..end - start], &mut vs[..end - start]);
        let gs = &g[start..end];
        let am = source(&mut m.absmax)[b];
        codec.dequantize(signed, &source(&mut m.codes)[start..end], am, ms);
        let av = source(&mut v.absmax)[b];
        codec.dequantize(unsigned, &source(&mut v.codes)[start..end], av, vs);
        match x.access() {
            Access::InPlace(buf) => {
                for (((x, g), m), v) in buf[start..end].iter_mut().zip(gs).zip(ms.iter_mut()).zip(vs.iter_mut()) {
                    (*x, *m, *v) = rule.update(*x, g.load(), *m, *v);
                }
            }
            Access::Split(src, dst) => {
                let (src, dst) = (&src[start..end], &mut dst[start..end]);
                for ((((d, x), g), m), v) in dst.iter_mut().zip(src).zip(gs).zip(ms.iter_mut()).zip(vs.iter_mut()) {
                    (*d, *m, *v) = rule.update(*x, g.load(), *m, *v);
                }
            }
        }
        let (am, av) = (absmax(ms), absmax(vs));
        codec.quantize(signed, ms, am, &mut destination(&mut m.codes)[start..end]);
        codec.quantize(unsigned, vs, av, &mut destination(&mut v.codes)[start..end]);
        destination(&mut m.absmax)[b] = am;
        destination(&mut v.absmax)[b] = av;
    }
}
