//! Gelu's derivative in float64 lanes that the compiler vectorises (no calls, no branches):
//! for `|x| <= 4` (nearly every block of real activations) one polynomial of degree 20 in
//! `x^2` for the whole `(Gelu'(x) - 1/2)/x`, fitted in float64 against `math.erfc`
//! (absolute error 4e-15, so the root of `Gelu'` near -0.75 keeps float32 precision);
//! beyond, `phi` from its own `exp` (Cody-Waite reduction, degree-11 Taylor, `2^k` from the
//! bits) and `Phi(-a)` from a Chebyshev expansion of the Mills ratio `a Phi(-a)/phi(a)` in
//! `1/a^2` (relative error 1e-13), so the left tail keeps its relative precision. A block
//! of 256 elements within `|x| <= 4` skips the far form (the select would drop it). Every
//! piece is accurate to ~1e-13 relative or better, far inside the
//! 2^-24 of float32: after the one rounding, at most 1 ulp from the exact value.
//!
//! The same code is compiled for each x86 level ([`Level`]); no fused multiply-add is ever
//! formed (Rust does not contract), so every level gives the same bits.

use crate::simd::{Isa, Level};

/// Which ONNX Gelu the gradient is of (its `approximate` attribute).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// `approximate="none"`: `x/2 (1 + erf(x/sqrt 2))`.
    Erf,
    /// `approximate="tanh"`: `x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Tanh,
}

/// `1/sqrt(2 pi)`.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
/// `sqrt(2/pi)`.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of Gelu's tanh form.
const GELU_C: f64 = 0.044_715;

/// `(Gelu'(x) - 1/2) / x = (Phi(x) - 1/2)/x + phi(x)`, a polynomial in `u = x^2/8 - 1` for
/// `|x| <= 4` (monomial coefficients, lowest first; fitted in float64 against `math.erfc`:
/// absolute error of `Gelu'` below 4e-15).
const NEAR: [f64; 21] = [
    0.18325666351049444,
    -0.1135489799910745,
    0.11438926597443741,
    -0.11480940896725131,
    0.10045823284572228,
    -0.07482439301309433,
    0.0478050049128151,
    -0.02657548592591307,
    0.013037933875876245,
    -0.005715500618495988,
    0.0022626374406336364,
    -0.0008161812858188198,
    0.00027031783422751173,
    -8.273162464414509e-05,
    2.353588513923929e-05,
    -6.264923299742141e-06,
    1.5608141225884075e-06,
    -3.5707121193334566e-07,
    7.941977564710866e-08,
    -2.0772974650977396e-08,
    4.095841894037921e-09,
];
/// Chebyshev coefficients of `a Phi(-a) / phi(a)` in `u = 18 / a^2 - 1` (`a >= 3`; used
/// beyond 4).
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
    const LN2_HI: f64 = 6.931_471_803_691_238e-1; // fdlibm's split of ln 2 (k * HI exact)
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let t = t.max(-708.0);
    let kf = t * core::f64::consts::LOG2_E + MAGIC;
    let k = kf - MAGIC;
    let r = (t - k * LN2_HI) - k * LN2_LO; // |r| <= ln2 / 2
    const TAYLOR: [f64; 12] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5_040.0,
        1.0 / 40_320.0,
        1.0 / 362_880.0,
        1.0 / 3_628_800.0,
        1.0 / 39_916_800.0,
    ];
    let p = estrin12(&TAYLOR, r);
    // k (-1021..=0) in two's complement is kf's bits less MAGIC's; 2^k's bits are
    // (k + 1023) << 52.
    let kbits = kf.to_bits().wrapping_sub(MAGIC.to_bits());
    p * f64::from_bits(kbits.wrapping_add(1023) << 52)
}

/// `sum c[k] u^k` (21 coefficients) by Estrin's scheme: pairs `c[2i] + c[2i+1] u`, then
/// pairs of those with `u^2`, `u^4`, ...: a dependency chain of depth 5 instead of Horner's
/// 20, which kept the vector units waiting on one another's results. Written out: a loop
/// here is not unrolled, and the element loop is then not vectorised.
#[inline(always)]
fn estrin21(c: &[f64; 21], u: f64) -> f64 {
    let (u2, p) = (u * u, |k: usize| c[2 * k] + c[2 * k + 1] * u);
    let (u4, q) = (u2 * u2, |k: usize| p(2 * k) + p(2 * k + 1) * u2);
    let u8 = u4 * u4;
    let r0 = q(0) + q(1) * u4;
    let r1 = q(2) + q(3) * u4;
    let r2 = q(4) + c[20] * u4;
    (r0 + r1 * u8) + r2 * (u8 * u8)
}

/// `sum c[k] u^k` (12 coefficients) by Estrin's scheme, as [`estrin21`].
#[inline(always)]
fn estrin12(c: &[f64; 12], u: f64) -> f64 {
    let (u2, p) = (u * u, |k: usize| c[2 * k] + c[2 * k + 1] * u);
    let u4 = u2 * u2;
    let q0 = p(0) + p(1) * u2;
    let q1 = p(2) + p(3) * u2;
    let q2 = p(4) + p(5) * u2;
    (q0 + q1 * u4) + q2 * (u4 * u4)
}

/// `Gelu'(x)` of the erf form for `|x| <= 4` (or NaN): `1/2 + x R(x^2)`, no `exp` at all.
#[inline(always)]
fn erf_form_near(x: f64) -> f64 {
    let w = x * x; // exact: x is a float32
    0.5 + x * estrin21(&NEAR, w.min(16.0) * 0.125 - 1.0)
}

/// `Gelu'(x)` of the erf form, `Phi(x) + x phi(x)`: [`erf_form_near`] for `|x| <= 4`,
/// beyond it `Phi(-a) = phi(a) M(a) / a` from the Mills ratio (no cancellation in the left
/// tail).
#[inline(always)]
pub(super) fn erf_form(x: f64) -> f64 {
    let w = x * x;
    let a = x.abs();
    let phi = exp_nonpositive(-0.5 * w) * INV_SQRT_2PI;
    let tail = phi * chebyshev(&MILLS, 18.0 / w.max(9.0) - 1.0) / a.max(3.0); // Phi(-a)
    let far = if x < 0.0 { tail } else { 1.0 - tail } + x * phi;
    let d = if a <= 4.0 { erf_form_near(x) } else { far };
    limits(x, if x.is_nan() { x } else { d })
}

/// Elements per look at whether a block lies within `|x| <= 4` (activations mostly do).
const BLOCK: usize = 256;

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
            for ((gx, gy), x) in gx.chunks_mut(BLOCK).zip(gy.chunks(BLOCK)).zip(x.chunks(BLOCK)) {
                // f32::max ignores NaN: a NaN block may take the near form, which keeps NaN.
                let widest = x.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
                if widest <= 4.0 {
                    for ((o, &g), &x) in gx.iter_mut().zip(gy).zip(x) {
                        *o = (f64::from(g) * erf_form_near(f64::from(x))) as f32;
                    }
                } else {
                    for ((o, &g), &x) in gx.iter_mut().zip(gy).zip(x) {
                        *o = (f64::from(g) * erf_form(f64::from(x))) as f32;
                    }
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The near-only blocks give the bits of the full form, element by element.
    #[test]
    fn near_blocks_equal_the_full_form() {
        let x: Vec<f32> = (0..3000).map(|k| -4.0 + 8.0 * k as f32 / 2999.0).collect();
        let gy: Vec<f32> = (0..3000).map(|k| 1.0 + k as f32 / 7.0).collect();
        let mut got = vec![0.0; x.len()];
        piece(&gy, &x, &mut got, Gelu::Erf);
        for ((&g, &x), &o) in gy.iter().zip(&x).zip(&got) {
            assert_eq!(o.to_bits(), ((f64::from(g) * erf_form(f64::from(x))) as f32).to_bits(), "x = {x}");
        }
    }

    #[test]
    fn exp_against_std() {
        for k in 0..10_000 {
            let t = -745.0 * f64::from(k) / 9_999.0;
            let (got, want) = (exp_nonpositive(t), t.max(-708.0).exp());
            assert!((got - want).abs() <= 1e-14 * want, "t = {t}: {got} vs {want}");
        }
    }
}
