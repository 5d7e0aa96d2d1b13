//! Adam's x86 kernels (see `optim::x86`): `adam_f32_avx512`, `adam_f16_avx512`,
//! `adam_bf16_avx512`, `adam_f32_f16_avx512`, `adam_f32_bf16_avx512`, `adam_f64_avx512`,
//! `adam_f32_avx2`, `adam_f64_avx2`, chosen by [`try_simd`].
//!
//! Each does the reference's operations in the reference's order (multiply, add, sqrt,
//! divide; no fused multiply-add), so every level is bitwise equal to the scalar reference.
//! Adam is bound by memory bandwidth, so fusing would buy nothing but different bits. Each
//! group asks for its streams' lines [`PREFETCH_AHEAD`](crate::optim::x86::PREFETCH_AHEAD)
//! bytes ahead: with the divide and square root in the way, the hardware prefetchers alone
//! leave the loads waiting on memory.

use super::{Adam, AdamCoeffs};
use crate::optim::x86::{bf16x16, bf16x16_native, f16x16, pd256, pd512, prefetch, ps256, ps512, simd_kernels};
use crate::optim::Optimizer;

/// Whole groups of `$lanes` with the operations of set `$v`, streams loaded and stored by
/// `$ld`/`$st` and gradients loaded by `$load_g` (the tail is `simd_kernels!`'s).
macro_rules! adam_lanes {
    ($c:ident, $p:ident, $n:ident, $lanes:literal, $v:ident, $ld:path, $st:path, $load_g:path) => {{
        use $v::{add, div, mul, set1, sqrt, sub};
        let (alpha, one_minus_alpha) = (set1($c.alpha), set1($c.one_minus_alpha));
        let (beta, one_minus_beta) = (set1($c.beta), set1($c.one_minus_beta));
        let (epsilon, norm, keep, rate) = (set1($c.epsilon), set1($c.norm), set1($c.keep), set1($c.rate));
        let unscale = $c.loss_scale.map(|s| set1(s));
        let [(x0, x1), (v0, v1), (h0, h1)] = $p.s;
        let mut i = 0;
        while i + $lanes <= $n {
            // SAFETY: lanes i..i + $lanes are in bounds (i + $lanes <= n), all loads of a
            // lane group come before its stores, and unaligned access is allowed.
            unsafe {
                // Each stream's line PREFETCH_AHEAD bytes on: see `prefetch`.
                prefetch(x0.add(i));
                prefetch($p.g.add(i));
                prefetch(v0.add(i));
                prefetch(h0.add(i));
                let x = $ld(x0.add(i));
                let g = $load_g($p.g.add(i));
                let g = match unscale {
                    Some(s) => div(g, s),
                    None => g,
                };
                let v = $ld(v0.add(i));
                let h = $ld(h0.add(i));
                let g = add(mul(norm, x), g);
                let v = add(mul(alpha, v), mul(one_minus_alpha, g));
                let h = add(mul(beta, h), mul(one_minus_beta, mul(g, g)));
                let x = sub(x, mul(rate, div(v, add(sqrt(h), epsilon))));
                $st(x1.add(i), mul(keep, x));
                $st(v1.add(i), v);
                $st(h1.add(i), h);
            }
            i += $lanes;
        }
    }};
}

simd_kernels!(
    adam_lanes,
    AdamCoeffs,
    3,
    <Adam as Optimizer<3>>::update,
    [
        adam_f32_avx512,
        adam_f16_avx512,
        adam_bf16_avx512,
        adam_bf16_avx512bf16,
        adam_f32_f16_avx512,
        adam_f32_bf16_avx512,
        adam_f64_avx512,
        adam_f32_avx2,
        adam_f64_avx2,
    ]
);
