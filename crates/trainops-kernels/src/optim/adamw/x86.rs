//! AdamW's x86 kernels (see `optim::x86`), without amsgrad (`plain`: `adamw_f32_avx512`,
//! ...) and with it (`amsgrad`: `adamw_amsgrad_f32_avx512`, ...), each chosen by its
//! `try_simd`.
//!
//! Each does the reference's operations in the reference's order, with a fused multiply-add
//! exactly where the reference (after PyTorch's CPU kernels) has one, `lerp` and `addcmul`,
//! so every level is bitwise equal to the scalar reference.

use super::{AdamW, AdamWCoeffs};
use crate::optim::x86::{bf16x16, bf16x16_native, f16x16, pd256, pd512, prefetch, ps256, ps512, simd_kernels};
use crate::optim::Optimizer;

/// Whole groups of `$lanes` with the operations of set `$v`, streams loaded and stored by
/// `$ld`/`$st` and gradients loaded by `$load_g`; with `$vmax` (`yes`/`no`) the amsgrad
/// stream (the tail is `simd_kernels!`'s).
macro_rules! adamw_body {
    ($c:ident, $p:ident, $n:ident, $lanes:literal, $v:ident, $ld:path, $st:path, $load_g:path, $vmax:ident) => {{
        use $v::{add, div, fmadd, mul, set1, sqrt, sub, xor};
        let (flip, decay, lerp) = (set1(if $c.maximize { -0.0 } else { 0.0 }), set1($c.decay), set1($c.lerp));
        let (beta2, one_minus_beta2) = (set1($c.beta2), set1($c.one_minus_beta2));
        let (bc2, epsilon, step) = (set1($c.bias_correction2_sqrt), set1($c.epsilon), set1($c.step_size));
        let from_end = $c.lerp_from_end;
        let (x0, x1) = $p.s[0];
        let (m0, m1) = $p.s[1];
        let (v0, v1) = $p.s[2];
        let mut i = 0;
        while i + $lanes <= $n {
            // SAFETY: lanes i..i + $lanes are in bounds (i + $lanes <= n), all loads of a
            // lane group come before its stores, and unaligned access is allowed.
            unsafe {
                // Each stream's line PREFETCH_AHEAD bytes on: see `prefetch`.
                prefetch(x0.add(i));
                prefetch($p.g.add(i));
                prefetch(m0.add(i));
                prefetch(v0.add(i));
                let x = $ld(x0.add(i));
                let g = xor($load_g($p.g.add(i)), flip);
                let m = $ld(m0.add(i));
                let v = $ld(v0.add(i));
                let x = mul(x, decay);
                let m = fmadd(lerp, sub(g, m), if from_end { g } else { m });
                let v = fmadd(mul(one_minus_beta2, g), g, mul(v, beta2));
                let s = adamw_body!(@second $v, $p, $ld, $st, i, v, $vmax);
                let denom = add(div(sqrt(s), bc2), epsilon);
                let x = sub(x, div(mul(step, m), denom));
                $st(x1.add(i), x);
                $st(m1.add(i), m);
                $st(v1.add(i), v);
            }
            i += $lanes;
        }
    }};
    (@second $v:ident, $p:ident, $ld:path, $st:path, $i:ident, $new:ident, no) => {
        $new
    };
    (@second $v:ident, $p:ident, $ld:path, $st:path, $i:ident, $new:ident, yes) => {{
        let (s0, s1) = $p.s[3];
        prefetch(s0.add($i));
        let max = $v::keep_max($ld(s0.add($i)), $new);
        $st(s1.add($i), max);
        max
    }};
}

/// The lane body without amsgrad (streams `X, M, V`).
macro_rules! adamw_lanes {
    ($c:ident, $p:ident, $n:ident, $lanes:literal, $v:ident, $ld:path, $st:path, $load_g:path) => {
        adamw_body!($c, $p, $n, $lanes, $v, $ld, $st, $load_g, no)
    };
}

/// The lane body with amsgrad (streams `X, M, V, Vmax`).
macro_rules! adamw_amsgrad_lanes {
    ($c:ident, $p:ident, $n:ident, $lanes:literal, $v:ident, $ld:path, $st:path, $load_g:path) => {
        adamw_body!($c, $p, $n, $lanes, $v, $ld, $st, $load_g, yes)
    };
}

/// The kernels of streams `X, M, V`.
pub(super) mod plain {
    use super::*;

    simd_kernels!(
        adamw_lanes,
        AdamWCoeffs,
        3,
        <AdamW as Optimizer<3>>::update,
        [
            adamw_f32_avx512,
            adamw_f16_avx512,
            adamw_bf16_avx512,
            adamw_bf16_avx512bf16,
            adamw_f32_f16_avx512,
            adamw_f32_bf16_avx512,
            adamw_f64_avx512,
            adamw_f32_avx2,
            adamw_f64_avx2,
        ]
    );
}

/// The kernels of streams `X, M, V, Vmax` (amsgrad).
pub(super) mod amsgrad {
    use super::*;

    simd_kernels!(
        adamw_amsgrad_lanes,
        AdamWCoeffs,
        4,
        <AdamW as Optimizer<4>>::update,
        [
            adamw_amsgrad_f32_avx512,
            adamw_amsgrad_f16_avx512,
            adamw_amsgrad_bf16_avx512,
            adamw_amsgrad_bf16_avx512bf16,
            adamw_amsgrad_f32_f16_avx512,
            adamw_amsgrad_f32_bf16_avx512,
            adamw_amsgrad_f64_avx512,
            adamw_amsgrad_f32_avx2,
            adamw_amsgrad_f64_avx2,
        ]
    );
}
