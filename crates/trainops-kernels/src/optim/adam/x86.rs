//! AVX2 and AVX-512F Adam kernels for `f32` and `f64`, and AVX-512F ones for `f32` weights
//! with float16 / bfloat16 gradients: `adam_f32_avx512`, `adam_f32_f16_avx512`,
//! `adam_f32_bf16_avx512`, `adam_f64_avx512`, `adam_f32_avx2`, `adam_f64_avx2`, chosen by
//! [`try_simd`]. Each takes the token of its instruction set (see `crate::simd`).
//!
//! Each does the reference's operations in the reference's order (multiply, add, sqrt,
//! divide; no fused multiply-add), and IEEE rounds each of them the same in a vector lane
//! as in a scalar register, so every level is bitwise equal to the scalar reference. Adam
//! is bound by memory bandwidth, so fusing would buy nothing but different bits.

use core::any::{Any, TypeId};
use core::arch::x86_64::*;

use half::{bf16, f16};

use super::{update, AdamCoeffs};
use crate::optim::Param;
use crate::simd::{Avx2, Avx512, Isa, Level};
use crate::Element;

/// Runs the SIMD kernel of `level` for weights `X` and gradients `G` on `p`, or hands `p`
/// back when there is none (16-bit weights, a scalar level, 16-bit gradients on AVX2).
/// The types are matched by `TypeId`: each arm runs only when `X` and `G` are the kernel's.
pub(super) fn try_simd<'a, X: Element, G: Element<C = X::C>>(
    level: Level,
    c: &AdamCoeffs<X::C>,
    mut p: Param<'a, X, G, 3>,
) -> Result<(), Param<'a, X, G, 3>> {
    let pair = (TypeId::of::<X>(), TypeId::of::<G>());
    let (f32_, f64_) = (TypeId::of::<f32>(), TypeId::of::<f64>());
    let (f16_, bf16_) = (TypeId::of::<f16>(), TypeId::of::<bf16>());
    let n = p.g.len();
    let [x, v, h] = &mut p.streams;
    let ptrs = Ptrs { x: x.as_ptrs(), g: p.g.as_ptr(), v: v.as_ptrs(), h: h.as_ptrs() };
    let c: &dyn Any = c;
    let c32 = || c.downcast_ref::<AdamCoeffs<f32>>().expect("the compute type of f32 weights is f32");
    let c64 = || c.downcast_ref::<AdamCoeffs<f64>>().expect("the compute type of f64 weights is f64");
    // Every arm: the token proves the kernel's instruction set; the TypeIds prove
    // that `X` and `G` are the kernel's types, so the cast pointers are the streams' own;
    // each stream and the gradient hold `n` elements (`Optimizer::param` checked), and an
    // InOut's source is its destination or does not overlap it.
    match level.isa() {
        Some(Isa::Avx512(t)) if pair == (f32_, f32_) => {
            // SAFETY: as said above the match, for this kernel's types and set.
            unsafe { adam_f32_avx512(t, c32(), ptrs.cast(), n) }
        }
        Some(Isa::Avx512(t)) if pair == (f32_, f16_) => {
            // SAFETY: as said above the match, for this kernel's types and set.
            unsafe { adam_f32_f16_avx512(t, c32(), ptrs.cast(), n) }
        }
        Some(Isa::Avx512(t)) if pair == (f32_, bf16_) => {
            // SAFETY: as said above the match, for this kernel's types and set.
            unsafe { adam_f32_bf16_avx512(t, c32(), ptrs.cast(), n) }
        }
        Some(Isa::Avx512(t)) if pair == (f64_, f64_) => {
            // SAFETY: as said above the match, for this kernel's types and set.
            unsafe { adam_f64_avx512(t, c64(), ptrs.cast(), n) }
        }
        Some(Isa::Avx2(t)) if pair == (f32_, f32_) => {
            // SAFETY: as said above the match, for this kernel's types and set.
            unsafe { adam_f32_avx2(t, c32(), ptrs.cast(), n) }
        }
        Some(Isa::Avx2(t)) if pair == (f64_, f64_) => {
            // SAFETY: as said above the match, for this kernel's types and set.
            unsafe { adam_f64_avx2(t, c64(), ptrs.cast(), n) }
        }
        _ => return Err(p),
    }
    Ok(())
}

/// Read and write pointers of one chunk: `src` may equal `dst` (in place), in which case
/// every element is read before it is written.
pub struct Ptrs<T, G = T> {
    /// Weights.
    pub x: (*const T, *mut T),
    /// Gradient (read only).
    pub g: *const G,
    /// First moment.
    pub v: (*const T, *mut T),
    /// Second moment.
    pub h: (*const T, *mut T),
}

impl<T, G> Ptrs<T, G> {
    /// The same addresses as pointers to `U` and `H` (a pointer cast; reading them is the
    /// kernel's business, under its safety contract).
    fn cast<U, H>(self) -> Ptrs<U, H> {
        let pair = |(s, d): (*const T, *mut T)| (s.cast::<U>(), d.cast::<U>());
        Ptrs { x: pair(self.x), g: self.g.cast(), v: pair(self.v), h: pair(self.h) }
    }
}

/// The scalar tail `[from, n)`, with the portable update (bitwise what the lanes compute).
///
/// # Safety
/// Every pointer of `p` is valid for `n` reads (and writes, for the `.1` ones).
#[inline(always)]
unsafe fn tail<T: crate::Compute, G: Element<C = T>>(c: &AdamCoeffs<T>, p: &Ptrs<T, G>, from: usize, n: usize) {
    for i in from..n {
        // SAFETY: i < n, and the caller guarantees n valid elements behind each pointer;
        // each element is read before it is written.
        unsafe {
            let g = p.g.add(i).read().load();
            let (x, v, h) = update(c, p.x.0.add(i).read(), g, p.v.0.add(i).read(), p.h.0.add(i).read());
            p.x.1.add(i).write(x);
            p.v.1.add(i).write(v);
            p.h.1.add(i).write(h);
        }
    }
}

/// 16 float16 values widened to `f32` (exact, like `f16::to_f32`).
///
/// # Safety
/// AVX-512F is available and `p` is valid for 16 reads.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_f16x16(p: *const f16) -> __m512 {
    // SAFETY: 16 two-byte values at `p` (caller); unaligned loads are allowed.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
}

/// 16 bfloat16 values widened to `f32` (exact: the bits move to the high half).
///
/// # Safety
/// AVX-512F is available and `p` is valid for 16 reads.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_bf16x16(p: *const bf16) -> __m512 {
    // SAFETY: 16 two-byte values at `p` (caller); unaligned loads are allowed.
    unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))) }
}

/// The body of every vector kernel: whole lane groups with the vector operations given,
/// then the scalar tail. Expanded inside each named `#[target_feature]` kernel below.
macro_rules! adam_lanes {
    ($c:ident, $p:ident, $n:ident, $lanes:literal,
     $set1:ident, $load:ident, $load_g:ident, $store:ident, $add:ident, $sub:ident, $mul:ident, $div:ident, $sqrt:ident) => {{
        let (alpha, one_minus_alpha) = ($set1($c.alpha), $set1($c.one_minus_alpha));
        let (beta, one_minus_beta) = ($set1($c.beta), $set1($c.one_minus_beta));
        let (epsilon, norm, keep, rate) = ($set1($c.epsilon), $set1($c.norm), $set1($c.keep), $set1($c.rate));
        let unscale = $c.loss_scale.map(|s| $set1(s));
        let mut i = 0;
        while i + $lanes <= $n {
            // SAFETY: lanes i..i + $lanes are in bounds (i + $lanes <= n), all loads of a
            // lane group come before its stores, and unaligned access is allowed.
            unsafe {
                let x = $load($p.x.0.add(i));
                let g = $load_g($p.g.add(i));
                let g = match unscale {
                    Some(s) => $div(g, s),
                    None => g,
                };
                let v = $load($p.v.0.add(i));
                let h = $load($p.h.0.add(i));
                let g = $add($mul(norm, x), g);
                let v = $add($mul(alpha, v), $mul(one_minus_alpha, g));
                let h = $add($mul(beta, h), $mul(one_minus_beta, $mul(g, g)));
                let x = $sub(x, $mul(rate, $div(v, $add($sqrt(h), epsilon))));
                $store($p.x.1.add(i), $mul(keep, x));
                $store($p.v.1.add(i), v);
                $store($p.h.1.add(i), h);
            }
            i += $lanes;
        }
        // SAFETY: the caller's guarantee covers [i, n).
        unsafe { tail($c, &$p, i, $n) };
    }};
}

/// Adam on `f32`, 16 lanes.
///
/// # Safety
/// Every pointer of `p` is valid for `n` reads (and writes, for the `.1` ones); sources
/// equal their destinations or do not overlap them.
#[target_feature(enable = "avx512f")]
pub unsafe fn adam_f32_avx512(_: Avx512, c: &AdamCoeffs<f32>, p: Ptrs<f32>, n: usize) {
    adam_lanes!(
        c,
        p,
        n,
        16,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_add_ps,
        _mm512_sub_ps,
        _mm512_mul_ps,
        _mm512_div_ps,
        _mm512_sqrt_ps
    )
}

/// Adam on `f32` weights with float16 gradients, 16 lanes.
///
/// # Safety
/// As for [`adam_f32_avx512`].
#[target_feature(enable = "avx512f")]
pub unsafe fn adam_f32_f16_avx512(_: Avx512, c: &AdamCoeffs<f32>, p: Ptrs<f32, f16>, n: usize) {
    adam_lanes!(
        c,
        p,
        n,
        16,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        load_f16x16,
        _mm512_storeu_ps,
        _mm512_add_ps,
        _mm512_sub_ps,
        _mm512_mul_ps,
        _mm512_div_ps,
        _mm512_sqrt_ps
    )
}

/// Adam on `f32` weights with bfloat16 gradients, 16 lanes.
///
/// # Safety
/// As for [`adam_f32_avx512`].
#[target_feature(enable = "avx512f")]
pub unsafe fn adam_f32_bf16_avx512(_: Avx512, c: &AdamCoeffs<f32>, p: Ptrs<f32, bf16>, n: usize) {
    adam_lanes!(
        c,
        p,
        n,
        16,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        load_bf16x16,
        _mm512_storeu_ps,
        _mm512_add_ps,
        _mm512_sub_ps,
        _mm512_mul_ps,
        _mm512_div_ps,
        _mm512_sqrt_ps
    )
}

/// Adam on `f64`, 8 lanes.
///
/// # Safety
/// As for [`adam_f32_avx512`].
#[target_feature(enable = "avx512f")]
pub unsafe fn adam_f64_avx512(_: Avx512, c: &AdamCoeffs<f64>, p: Ptrs<f64>, n: usize) {
    adam_lanes!(
        c,
        p,
        n,
        8,
        _mm512_set1_pd,
        _mm512_loadu_pd,
        _mm512_loadu_pd,
        _mm512_storeu_pd,
        _mm512_add_pd,
        _mm512_sub_pd,
        _mm512_mul_pd,
        _mm512_div_pd,
        _mm512_sqrt_pd
    )
}

/// Adam on `f32`, 8 lanes.
///
/// # Safety
/// As for [`adam_f32_avx512`].
#[target_feature(enable = "avx2")]
pub unsafe fn adam_f32_avx2(_: Avx2, c: &AdamCoeffs<f32>, p: Ptrs<f32>, n: usize) {
    adam_lanes!(
        c,
        p,
        n,
        8,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_add_ps,
        _mm256_sub_ps,
        _mm256_mul_ps,
        _mm256_div_ps,
        _mm256_sqrt_ps
    )
}

/// Adam on `f64`, 4 lanes.
///
/// # Safety
/// As for [`adam_f32_avx512`].
#[target_feature(enable = "avx2")]
pub unsafe fn adam_f64_avx2(_: Avx2, c: &AdamCoeffs<f64>, p: Ptrs<f64>, n: usize) {
    adam_lanes!(
        c,
        p,
        n,
        4,
        _mm256_set1_pd,
        _mm256_loadu_pd,
        _mm256_loadu_pd,
        _mm256_storeu_pd,
        _mm256_add_pd,
        _mm256_sub_pd,
        _mm256_mul_pd,
        _mm256_div_pd,
        _mm256_sqrt_pd
    )
}
