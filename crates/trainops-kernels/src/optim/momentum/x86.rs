//! Momentum's x86 kernels, standard and Nesterov (see `optim::x86`): `momentum_f32_avx512`,
//! `momentum_f16_avx512`, `momentum_bf16_avx512`, `momentum_f32_f16_avx512`,
//! `momentum_f32_bf16_avx512`, `momentum_f64_avx512`, `momentum_f32_avx2`,
//! `momentum_f64_avx2`, chosen by [`try_simd`].
//!
//! Each does the reference's operations in its order (no fused multiply-add), so every level
//! is bitwise equal to the scalar reference. The mode is decided once per chunk.

use super::{Momentum, MomentumCoeffs, MomentumMode};
use crate::optim::x86::{bf16x16, bf16x16_native, f16x16, pd256, pd512, prefetch, ps256, ps512, simd_kernels};
use crate::optim::Optimizer;

/// Whole groups of `$lanes` with the operations of set `$v`, streams loaded and stored by
/// `$ld`/`$st` and gradients loaded by `$load_g` (the tail is `simd_kernels!`'s).
macro_rules! momentum_lanes {
    ($c:ident, $p:ident, $n:ident, $lanes:literal, $v:ident, $ld:path, $st:path, $load_g:path) => {{
        use $v::{add, mul, set1, sub};
        let (alpha, beta, norm, rate) = (set1($c.alpha), set1($c.beta), set1($c.norm), set1($c.rate));
        let [(x0, x1), (v0, v1)] = $p.s;
        macro_rules! run {
            ($nesterov:literal) => {{
                let mut i = 0;
                while i + $lanes <= $n {
                    // SAFETY: lanes i..i + $lanes are in bounds (i + $lanes <= n), all loads
                    // of a lane group come before its stores, and unaligned access is allowed.
                    unsafe {
                        // Each stream's line PREFETCH_AHEAD bytes on: see `prefetch`.
                        prefetch(x0.add(i));
                        prefetch($p.g.add(i));
                        prefetch(v0.add(i));
                        let x = $ld(x0.add(i));
                        let g = $load_g($p.g.add(i));
                        let v = $ld(v0.add(i));
                        let g = add(mul(norm, x), g);
                        let v = add(mul(alpha, v), mul(beta, g));
                        let x = if $nesterov { sub(x, mul(rate, add(g, mul(alpha, v)))) } else { sub(x, mul(rate, v)) };
                        $st(x1.add(i), x);
                        $st(v1.add(i), v);
                    }
                    i += $lanes;
                }
            }};
        }
        match $c.mode {
            MomentumMode::Standard => run!(false),
            MomentumMode::Nesterov => run!(true),
        }
    }};
}

simd_kernels!(
    momentum_lanes,
    MomentumCoeffs,
    2,
    <Momentum as Optimizer<2>>::update,
    [
        momentum_f32_avx512,
        momentum_f16_avx512,
        momentum_bf16_avx512,
        momentum_bf16_avx512bf16,
        momentum_f32_f16_avx512,
        momentum_f32_bf16_avx512,
        momentum_f64_avx512,
        momentum_f32_avx2,
        momentum_f64_avx2,
    ]
);
