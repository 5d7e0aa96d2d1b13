//! Adagrad's x86 kernels (see `optim::x86`): `adagrad_f32_avx512`, `adagrad_f16_avx512`,
//! `adagrad_bf16_avx512`, `adagrad_f32_f16_avx512`, `adagrad_f32_bf16_avx512`,
//! `adagrad_f64_avx512`, `adagrad_f32_avx2`, `adagrad_f64_avx2`, chosen by [`try_simd`].
//!
//! Each does the reference's operations in its order (`(r * g) / (sqrt(h') + epsilon)`; no
//! fused multiply-add), so every level is bitwise equal to the scalar reference.

use super::{Adagrad, AdagradCoeffs};
use crate::optim::x86::{bf16x16, bf16x16_native, f16x16, pd256, pd512, prefetch, ps256, ps512, simd_kernels};
use crate::optim::Optimizer;

/// Whole groups of `$lanes` with the operations of set `$v`, streams loaded and stored by
/// `$ld`/`$st` and gradients loaded by `$load_g` (the tail is `simd_kernels!`'s).
macro_rules! adagrad_lanes {
    ($c:ident, $p:ident, $n:ident, $lanes:literal, $v:ident, $ld:path, $st:path, $load_g:path) => {{
        use $v::{add, div, mul, set1, sqrt, sub};
        let (epsilon, norm, rate) = (set1($c.epsilon), set1($c.norm), set1($c.rate));
        let [(x0, x1), (h0, h1)] = $p.s;
        let mut i = 0;
        while i + $lanes <= $n {
            // SAFETY: lanes i..i + $lanes are in bounds (i + $lanes <= n), all loads of a
            // lane group come before its stores, and unaligned access is allowed.
            unsafe {
                // Each stream's line PREFETCH_AHEAD bytes on: see `prefetch`.
                prefetch(x0.add(i));
                prefetch($p.g.add(i));
                prefetch(h0.add(i));
                let x = $ld(x0.add(i));
                let g = $load_g($p.g.add(i));
                let h = $ld(h0.add(i));
                let g = add(mul(norm, x), g);
                let h = add(h, mul(g, g));
                let x = sub(x, div(mul(rate, g), add(sqrt(h), epsilon)));
                $st(x1.add(i), x);
                $st(h1.add(i), h);
            }
            i += $lanes;
        }
    }};
}

simd_kernels!(
    adagrad_lanes,
    AdagradCoeffs,
    2,
    <Adagrad as Optimizer<2>>::update,
    [
        adagrad_f32_avx512,
        adagrad_f16_avx512,
        adagrad_bf16_avx512,
        adagrad_bf16_avx512bf16,
        adagrad_f32_f16_avx512,
        adagrad_f32_bf16_avx512,
        adagrad_f64_avx512,
        adagrad_f32_avx2,
        adagrad_f64_avx2,
    ]
);
