//! Gelu's derivative in float64 lanes that the compiler vectorises (no calls, no branches):
//! its own `exp` (Cody-Waite reduction, degree-11 Taylor, `2^k` from the bits), and the
//! normal CDF `Phi` from two Chebyshev expansions fitted in float64 against `math.erfc`
//! (`|x| <= 3`: `(Phi(x) - 1/2)/x` in `x^2`, absolute error 6e-16; beyond: the Mills ratio
//! `a Phi(-a)/phi(a)` in `1/a^2`, relative error 1e-13), so the left tail keeps its
//! relative precision. Every piece is accurate to ~1e-13 relative or better, far inside the
//! 2^-24 of float32: after the one rounding, at most 1 ulp from the exact value.
//!
//! The same code is compiled for each x86 level ([`Level`]); no fused multiply-add is ever
//! formed (Rust does not contract), so every level gives the same bits.

use super::activation::Gelu;
use crate::simd::{Isa, Level};

/// `1/sqrt(2 pi)`.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
/// `sqrt(2/pi)`.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of Gelu's tanh form.
const GELU_C: f64 = 0.044_715;

const PHI_SMALL: [f64; 17] = [
    0.2539778289377888,
    -0.11009167465023274,
    0.027404117841038866,
    -0.006071119232890696,
    0.0011680438501726446,
    -0.00019611239680268408,
    2.903915190238493e-05,
    -3.833906507809386e-06,
    4.5584092600914966e-07,
    -4.923950107345716e-08,
    4.869244675093389e-09,
    -4.4375442183491576e-10,
    3.748642221540974e-11,
    -2.9503024020867507e-12,
    2.1730207482960178e-13,
    -1.5073153775221537e-14,
    9.874855895370067e-16,
];
const MILLS: [f64; 17] = [
    0.9543244046408601,
    -0.042887130432605655,
    0.002535294244447736,
    -0.00022396891374643687,
    2.5223422688351103e-05,
    -3.3640523620354647e-06,
    5.09567785861337e-07,
    -8.536369539846139e-08,
    1.5529729463035782e-08,
    -3.0280084488778746e-09,
    6.265478099367201e-10,
    -1.3652755860080588e-10,
    3.113860242513959e-11,
    -7.39656519282233e-12,
    1.8223031412801966e-12,
    -4.642463930060625e-13,
    1.2217466808921693e-13,
];

/// `sum c[k] T_k(u)` by Clenshaw's recurrence.
#[inline(always)]
fn chebyshev(c: &[f64; 17], u: f64) -> f64 {
    let (mut b1, mut b2) = (0.0, 0.0);
    let u2 = 2.0 * u;
    for &ck in c[1..].iter().rev() {
        let b0 = ck + u2 * b1 - b2;
        b2 = b1;
        b1 = b0;
    }
    c[0] + u * b1 - b2
}

/// `e^t` for `t <= 0` (relative error below 1e-14); `t` below -708 is taken as -708
/// (`e^-708` ~ 3e-308: whatever it multiplies rounds to 0 in float32 either way).
#[inline(always)]
fn exp_nonpositive(t: f64) -> f64 {
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52: adding it rounds to an integer
    const LN2_HI: f64 = 6.931_471_803_691_238_2e-1; // fdlibm's split of ln 2 (k * HI exact)
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let t = t.max(-708.0);
    let kf = t * core::f64::consts::LOG2_E + MAGIC;
    let k = kf - MAGIC;
    let r = (t - k * LN2_HI) - k * LN2_LO; // |r| <= ln2 / 2
    let mut p = 1.0 / 39_916_800.0; // 1/11!
    for d in [3_628_800.0, 362_880.0, 40_320.0, 5_040.0, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0] {
        p = p * r + 1.0 / d;
    }
    // k (-1021..=0) in two's complement is kf's bits less MAGIC's; 2^k's bits are
    // (k + 1023) << 52.
    let kbits = kf.to_bits().wrapping_sub(MAGIC.to_bits());
    p * f64::from_bits(kbits.wrapping_add(1023) << 52)
}

/// `Gelu'(x)` of the erf form: `Phi(x) + x phi(x)`.
#[inline(always)]
pub(super) fn erf_form(x: f64) -> f64 {
    let w = x * x; // exact: x is a float32
    let phi = exp_nonpositive(-0.5 * w) * INV_SQRT_2PI;
    let near = 0.5 + x * chebyshev(&PHI_SMALL, w.min(9.0) * (2.0 / 9.0) - 1.0);
    let a = x.abs();
    let tail = phi * chebyshev(&MILLS, 18.0 / w.max(9.0) - 1.0) / a.max(3.0); // Phi(-a)
    let far = if x < 0.0 { tail } else { 1.0 - tail };
    let cdf = if a <= 3.0 { near } else { far };
    limits(x, cdf + x * phi)
}

/// `Gelu'(x)` of the tanh form: with `u = sqrt(2/pi)(x + c x^3)` and `s = sigmoid(2u)`,
/// `s + 2 x s (1 - s) sqrt(2/pi)(1 + 3 c x^2)`; `s` and `1 - s` from `e = exp(-2|u|)`.
#[inline(always)]
pub(super) fn tanh_form(x: f64) -> f64 {
    let x2 = x * x;
    let u = SQRT_2_OVER_PI * x * (1.0 + GELU_C * x2);
    let e = exp_nonpositive(-2.0 * u.abs());
    let inv = 1.0 / (1.0 + e);
    let s = if u >= 0.0 { inv } else { e * inv };
    let one_minus_s = if u >= 0.0 { e * inv } else { inv };
    limits(x, s + 2.0 * x * s * one_minus_s * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x2))
}

/// `Gelu'(+inf) = 1`, `Gelu'(-inf) = 0` (the formulas give inf * 0 there); NaN stays NaN.
#[inline(always)]
fn limits(x: f64, d: f64) -> f64 {
    let d = if x == f64::INFINITY { 1.0 } else { d };
    if x == f64::NEG_INFINITY {
        0.0
    } else {
        d
    }
}

/// `gx = gy * Gelu'(x)` (float64, rounded once), element by element.
#[inline(always)]
fn piece(gy: &[f32], x: &[f32], gx: &mut [f32], approximate: Gelu) {
    match approximate {
        Gelu::Erf => {
            for ((o, &g), &x) in gx.iter_mut().zip(gy).zip(x) {
                *o = (f64::from(g) * erf_form(f64::from(x))) as f32;
            }
        }
        Gelu::Tanh => {
            for ((o, &g), &x) in gx.iter_mut().zip(gy).zip(x) {
                *o = (f64::from(g) * tanh_form(f64::from(x))) as f32;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn piece_avx2(_: crate::simd::Avx2, gy: &[f32], x: &[f32], gx: &mut [f32], approximate: Gelu) {
    piece(gy, x, gx, approximate);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn piece_avx512(_: crate::simd::Avx512, gy: &[f32], x: &[f32], gx: &mut [f32], approximate: Gelu) {
    piece(gy, x, gx, approximate);
}

/// One piece at `level` (which must be available: else the portable code runs).
pub(super) fn run_piece(level: Level, gy: &[f32], x: &[f32], gx: &mut [f32], approximate: Gelu) {
    match level.isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2 and FMA.
        Some(Isa::Avx2(t)) => unsafe { piece_avx2(t, gy, x, gx, approximate) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Some(Isa::Avx512(t)) => unsafe { piece_avx512(t, gy, x, gx, approximate) },
        _ => piece(gy, x, gx, approximate),
    }
}
