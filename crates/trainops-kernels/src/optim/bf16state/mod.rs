//! Adam and AdamW with bfloat16 moments and stochastic rounding: the middle ground between
//! float32 state (8 bytes per parameter) and 8-bit state (about 2): 4 bytes per parameter.
//!
//! **Step.** Per element, the weights `x` (float32), the gradient `g` (float32, float16 or
//! bfloat16, widened exactly) and the moments `m`, `v` (bfloat16, widened exactly; a NaN quieted) go through
//! the float32 update of the optimizer (its [`Rule`]: ONNX Adam's `adam::update`, or
//! PyTorch AdamW's `AdamW::update` from `optim::adamw`); `x'` is stored as computed and the
//! new moments are rounded to bfloat16 stochastically ([`round_stochastic`]). The weights'
//! update uses the new moments before rounding, as the 8-bit optimizers do.
//!
//! **Stochastic rounding** (the standard method, torchao's `_fp32_to_bf16_sr`): add 16
//! uniform random bits to the low 16 bits of the float32's bit pattern and truncate to the
//! high 16. A value whose low bits are `f` rounds away from zero with probability
//! `f / 2^16`, so the rounding is unbiased: `E[round(x)] = x`. Special values, where this
//! crate decides (torchao applies the bit trick to everything): a NaN stays a NaN (quiet:
//! its high 16 bits with the quiet bit set, as a round-to-nearest conversion gives; the
//! trick would turn a NaN whose payload lies in the low bits into infinity); infinities
//! stay (their low bits are zero); and a finite value never becomes infinite: a carry into
//! the all-ones exponent (only from `|x| > bfloat16::MAX`, within one bfloat16 ulp of it)
//! gives `±bfloat16::MAX` instead, since an infinite moment would wreck every later step.
//!
//! **Random bits.** Philox4x32-10 ([`crate::random::philox`]), keyed by the op's 64-bit
//! `seed` (`k0` the low word, `k1` the high one, as `trainops.random.state`). Element `e`
//! of tensor `i` (flat index, `i` counted from 0 in the node) at update count `T` takes word
//! `e % 4` of the block of counter `(c0, c1, c2, c3) = (e / 4 mod 2^32, e / 4 >> 32,
//! T mod 2^32, i)`: the low 16 bits round `m`, the high 16 bits round `v`. In the words of
//! the Philox op: the stream of state `[0, 0, T mod 2^32, i, k0, k1]`, one word per
//! element. The bits depend on nothing else, so the result is the same on any number of
//! threads and at any SIMD level.
//!
//! **Kernels.** One portable piece loop, compiled three times: as is, and with AVX2+FMA or
//! AVX-512F enabled (`x86`), where the compiler vectorises the update and the rounding (no
//! fused multiply-add is formed without fast-math, and AdamW's own `mul_add`s are fused in
//! every build), while Philox fills each piece's words with its own SIMD kernels. Every level
//! gives the reference's bits ([`reference`](mod@reference)). Work runs in
//! [`CHUNK`]-element tasks.

pub mod reference;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use half::bf16;

use crate::optim::adam::{update as adam_update, AdamCoeffs};
use crate::optim::adamw::{AdamW, AdamWCoeffs};
use crate::optim::Optimizer;
use crate::parallel::{run_chunked, Splittable, CHUNK, SERIAL_BELOW};
use crate::random::philox;
use crate::simd::{detected, Isa, Level};
use crate::stream::Access;
use crate::{Element, InOut, KernelError, Parallelism, Sequential};

/// Elements per staged piece: 112 Philox blocks, whole batches of both SIMD Philox kernels
/// (56 blocks with AVX-512, 8 with AVX2).
const PIECE: usize = 448;

/// One element's update `(x, g, m, v) -> (x', m', v')` in float32, on widened moments.
pub trait Rule: Copy + Send + Sync + 'static {
    /// The update.
    fn update(&self, x: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32);
}

/// ONNX Adam (`optim::adam::update`): `m` is its `V`, `v` its `H`.
impl Rule for AdamCoeffs<f32> {
    #[inline(always)]
    fn update(&self, x: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        adam_update(self, x, g, m, v)
    }
}

/// PyTorch's AdamW (`optim::adamw`, without amsgrad).
impl Rule for AdamWCoeffs<f32> {
    #[inline(always)]
    fn update(&self, x: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let [x, m, v] = <AdamW as Optimizer<3>>::update(self, [x, m, v], g);
        (x, m, v)
    }
}

/// Where a node's random bits come from: the key (the `seed`) and the update count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stochastic {
    /// Philox key `(k0, k1)`: the seed's low and high 32 bits.
    pub key: [u32; 2],
    /// Counter word `c2`: `T mod 2^32`.
    pub step: u32,
}

impl Stochastic {
    /// The bits of a node with attribute `seed` (its 64-bit two's complement) at update
    /// count `t`.
    pub fn new(seed: i64, t: i64) -> Self {
        let s = seed as u64;
        Self { key: [s as u32, (s >> 32) as u32], step: t as u32 }
    }

    /// The Philox state whose stream, one word per element, rounds tensor `tensor`.
    pub fn state(&self, tensor: u32) -> [u32; 6] {
        [0, 0, self.step, tensor, self.key[0], self.key[1]]
    }
}

/// `x` rounded to bfloat16 stochastically with the random bits `r` (their low 16 are used):
/// `(bits(x) + r) >> 16`, except that a NaN gives its quiet NaN and a finite value that
/// would carry into infinity gives `±bfloat16::MAX` (see the module documentation).
#[inline(always)]
pub fn round_stochastic(x: f32, r: u32) -> u16 {
    let b = x.to_bits();
    let mag = b & 0x7fff_ffff;
    // No carry out of 32 bits but for NaNs, which are replaced below.
    let up = b.wrapping_add(r & 0xffff) >> 16;
    let up = if mag < 0x7f80_0000 && up & 0x7fff == 0x7f80 { up - 1 } else { up };
    let out = if mag > 0x7f80_0000 { (b >> 16) | 0x0040 } else { up };
    out as u16
}

/// One parameter tensor: float32 weights, its gradient and the two bfloat16 moments.
pub struct ParamBf16<'a, G> {
    /// Weights `X` (float32).
    pub x: InOut<'a, f32>,
    /// Gradient `G`, one per weight.
    pub g: &'a [G],
    /// First moment (Adam's `V`, AdamW's `M`).
    pub m: InOut<'a, bf16>,
    /// Second moment (Adam's `H`, AdamW's `V`).
    pub v: InOut<'a, bf16>,
    /// The tensor's index in its node (counter word `c3`).
    tensor: u32,
    /// Flat index in the tensor of this piece's first element.
    offset: usize,
}

impl<'a, G> ParamBf16<'a, G> {
    /// Tensor `tensor` of a node (0-based): checks that gradient and moments have one element
    /// per weight.
    pub fn new(
        x: InOut<'a, f32>,
        g: &'a [G],
        m: InOut<'a, bf16>,
        v: InOut<'a, bf16>,
        tensor: u32,
    ) -> Result<Self, KernelError> {
        let n = x.len();
        for (what, got) in [("G", g.len()), ("M", m.len()), ("V", v.len())] {
            if got != n {
                return Err(KernelError::LengthMismatch { what, got, expected: n });
            }
        }
        Ok(Self { x, g, m, v, tensor, offset: 0 })
    }
}

impl<G: Element> Splittable for ParamBf16<'_, G> {
    fn len(&self) -> usize {
        self.g.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (x0, x1) = self.x.split_at(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (m0, m1) = self.m.split_at(mid);
        let (v0, v1) = self.v.split_at(mid);
        let (tensor, offset) = (self.tensor, self.offset);
        (
            ParamBf16 { x: x0, g: g0, m: m0, v: v0, tensor, offset },
            ParamBf16 { x: x1, g: g1, m: m1, v: v1, tensor, offset: offset + mid },
        )
    }
}

/// One step of `rule` (an optimizer's per-call coefficients) over every tensor of a node,
/// with the [`detected`] level; bitwise the same for any `par` and any level.
pub fn step<R: Rule, G: Element<C = f32>>(
    rule: &R,
    bits: &Stochastic,
    params: Vec<ParamBf16<'_, G>>,
    par: &dyn Parallelism,
) {
    step_with(detected(), rule, bits, params, par);
}

/// [`step`] with a given level (tests and benchmarks force each one).
///
/// # Panics
/// When `level` is not available on this CPU.
pub fn step_with<R: Rule, G: Element<C = f32>>(
    level: Level,
    rule: &R,
    bits: &Stochastic,
    params: Vec<ParamBf16<'_, G>>,
    par: &dyn Parallelism,
) {
    step_chunked(level, rule, bits, params, par, CHUNK, SERIAL_BELOW);
}

/// [`step_with`] in tasks of `chunk` elements from `serial_below` elements up: tests cut
/// small tensors into many tasks, at any element.
pub(crate) fn step_chunked<R: Rule, G: Element<C = f32>>(
    level: Level,
    rule: &R,
    bits: &Stochastic,
    params: Vec<ParamBf16<'_, G>>,
    par: &dyn Parallelism,
    chunk: usize,
    serial_below: usize,
) {
    let isa = level.isa().unwrap_or_else(|| panic!("kernel level {level:?} is not available on this CPU"));
    run_chunked(params, par, chunk, serial_below, |p| match isa {
        Isa::Scalar => pieces(level, rule, bits, p),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2 and FMA.
        Isa::Avx2(t) => unsafe { x86::pieces_avx2(t, rule, bits, p) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(t) => unsafe { x86::pieces_avx512(t, rule, bits, p) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2(_) | Isa::Avx512(_) => unreachable!("SIMD levels are never available off x86_64"),
    });
}

/// Copies `out.len()` elements of the stream's source from `start`.
#[inline(always)]
fn read<T: Copy>(s: &mut InOut<'_, T>, start: usize, out: &mut [T]) {
    let src: &[T] = match s.access() {
        Access::InPlace(buf) => buf,
        Access::Split(src, _) => src,
    };
    out.copy_from_slice(&src[start..start + out.len()]);
}

/// Writes `values` to the stream's destination from `start`.
#[inline(always)]
fn write<T: Copy>(s: &mut InOut<'_, T>, start: usize, values: &[T]) {
    let dst: &mut [T] = match s.access() {
        Access::InPlace(buf) => buf,
        Access::Split(_, dst) => dst,
    };
    dst[start..start + values.len()].copy_from_slice(values);
}

/// The kernel of every level: piece by piece, Philox words for the piece's elements (with
/// `level`'s Philox kernel), then the update and the rounding element by element: on the
/// buffers themselves when every stream is updated in place (the Trainer's case), else
/// staged through copies.
#[inline(always)]
pub(crate) fn pieces<R: Rule, G: Element<C = f32>>(level: Level, rule: &R, bits: &Stochastic, p: ParamBf16<'_, G>) {
    let ParamBf16 { mut x, g, mut m, mut v, tensor, offset } = p;
    let state = bits.state(tensor);
    // A piece starting inside a block takes that whole block: up to 3 words more.
    let mut words = [0u32; PIECE + 4];
    let fill = |words: &mut [u32], start: usize, len: usize| {
        let e = offset + start;
        let (skip, used) = (e % 4, (e % 4 + len).div_ceil(4) * 4);
        philox::fill_with(level, &philox::advance(&state, (e / 4) as u128), &mut words[..used], &Sequential);
        skip
    };
    if let (Access::InPlace(xb), Access::InPlace(mb), Access::InPlace(vb)) = (x.access(), m.access(), v.access()) {
        for start in (0..g.len()).step_by(PIECE) {
            let len = PIECE.min(g.len() - start);
            let skip = fill(&mut words, start, len);
            let r = start..start + len;
            update(rule, &mut xb[r.clone()], &g[r.clone()], &mut mb[r.clone()], &mut vb[r], &words[skip..skip + len]);
        }
        return;
    }
    let mut xs = [0f32; PIECE];
    let (mut ms, mut vs) = ([bf16::ZERO; PIECE], [bf16::ZERO; PIECE]);
    for start in (0..g.len()).step_by(PIECE) {
        let len = PIECE.min(g.len() - start);
        let skip = fill(&mut words, start, len);
        let (xs, ms, vs) = (&mut xs[..len], &mut ms[..len], &mut vs[..len]);
        read(&mut x, start, xs);
        read(&mut m, start, ms);
        read(&mut v, start, vs);
        update(rule, xs, &g[start..start + len], ms, vs, &words[skip..skip + len]);
        write(&mut x, start, xs);
        write(&mut m, start, ms);
        write(&mut v, start, vs);
    }
}

/// The update and the rounding of one piece, in place (every slice has `g`'s length).
#[inline(always)]
fn update<R: Rule, G: Element<C = f32>>(rule: &R, x: &mut [f32], g: &[G], m: &mut [bf16], v: &mut [bf16], w: &[u32]) {
    let n = g.len();
    let (x, m, v, w) = (&mut x[..n], &mut m[..n], &mut v[..n], &w[..n]);
    for i in 0..n {
        let (xn, mn, vn) = rule.update(x[i], g[i].load(), m[i].load(), v[i].load());
        x[i] = xn;
        m[i] = bf16::from_bits(round_stochastic(mn, w[i]));
        v[i] = bf16::from_bits(round_stochastic(vn, w[i] >> 16));
    }
}
