//! Gradients of the elementwise activations: `gx = gy * f'(x)`.
//!
//! - [`relu_grad`]: `gx = x > 0 ? gy : 0` (the rule's `Where(Greater(x, 0), gy, 0)`: exact,
//!   a NaN `x` gives 0, `gy` is copied bit for bit). Relu's output `y` may stand for `x`
//!   (`y > 0` exactly when `x > 0`).
//! - [`leaky_relu_grad`]: `gx = x > 0 ? gy : alpha * gy` (exact: one float32 product).
//! - [`hard_sigmoid_grad`]: `gx = 0 < alpha x + beta < 1 ? alpha * gy : 0`, and
//!   [`hard_swish_grad`]: `gx = x < -3 ? 0 : x > 3 ? gy : gy * (x / 3 + 1/2)` (PyTorch's
//!   hardswish_backward): the standard-op rules' float32 operations in their order, so the
//!   same bits as the rules' `Where` chains.
//! - [`silu_grad`]: `gx = gy * SiLU'(x)` for `SiLU(x) = x * sigmoid(x)`, in float32 lanes
//!   (see `silu` for the bound).
//! - [`gelu_grad`]: ONNX Gelu's exact derivative, `none` (erf) and `tanh` forms, evaluated
//!   in float64 lanes (vectorised, see `gelu`) and rounded once: at most 1 ulp (float32) from the exact value of
//!   `gy * Gelu'(x)` (tested against numpy's float64 in `tests/test_grad_activation.py` and
//!   against a float64 reference here).
//!
//! Each has a plain scalar reference ([`reference`](mod@reference)) and a fast path: loops the compiler
//! vectorises, cut into chunks on the caller's [`Parallelism`]. Every element is computed
//! alone, so the fast path equals the reference bit for bit however the work is cut.

use crate::parallel::{run_chunked, Splittable, CHUNK, SERIAL_BELOW};
use crate::{KernelError, Level, Parallelism};

pub use super::gelu::Gelu;

/// Gelu's work per element is ~20x Relu's: smaller chunks, and threads from fewer elements.
const GELU_CHUNK: usize = 1 << 12;
const GELU_SERIAL_BELOW: usize = 1 << 13;

/// One piece of `(gy, x) -> gx`.
struct Piece<'a> {
    gy: &'a [f32],
    x: &'a [f32],
    gx: &'a mut [f32],
}

impl Splittable for Piece<'_> {
    fn len(&self) -> usize {
        self.gx.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (gy0, gy1) = self.gy.split_at(mid);
        let (x0, x1) = self.x.split_at(mid);
        let (gx0, gx1) = self.gx.split_at_mut(mid);
        (Piece { gy: gy0, x: x0, gx: gx0 }, Piece { gy: gy1, x: x1, gx: gx1 })
    }
}

fn check(gy: &[f32], x: &[f32], gx: &[f32]) -> Result<(), KernelError> {
    if x.len() != gy.len() {
        return Err(KernelError::LengthMismatch { what: "x", got: x.len(), expected: gy.len() });
    }
    if gx.len() != gy.len() {
        return Err(KernelError::LengthMismatch { what: "gx", got: gx.len(), expected: gy.len() });
    }
    Ok(())
}

fn run(
    gy: &[f32],
    x: &[f32],
    gx: &mut [f32],
    par: &dyn Parallelism,
    (chunk, serial_below): (usize, usize),
    f: impl Fn(Piece<'_>) + Sync,
) -> Result<(), KernelError> {
    check(gy, x, gx)?;
    run_chunked(vec![Piece { gy, x, gx }], par, chunk, serial_below, f);
    Ok(())
}

/// `gx[i] = if x[i] > 0 { gy[i] } else { 0 }`. Errors when the lengths differ.
pub fn relu_grad(gy: &[f32], x: &[f32], gx: &mut [f32], par: &dyn Parallelism) -> Result<(), KernelError> {
    run(gy, x, gx, par, (CHUNK, SERIAL_BELOW), |p| {
        // A select per lane (compare, and-mask): vectorised by the compiler.
        for ((o, &g), &x) in p.gx.iter_mut().zip(p.gy).zip(p.x) {
            *o = if x > 0.0 { g } else { 0.0 };
        }
    })
}

/// `gx[i] = if x[i] > 0 { gy[i] } else { alpha * gy[i] }`. Errors when the lengths differ.
pub fn leaky_relu_grad(
    gy: &[f32],
    x: &[f32],
    alpha: f32,
    gx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    run(gy, x, gx, par, (CHUNK, SERIAL_BELOW), |p| {
        for ((o, &g), &x) in p.gx.iter_mut().zip(p.gy).zip(p.x) {
            *o = if x > 0.0 { g } else { alpha * g };
        }
    })
}

/// HardSigmoid's gradient: `u = x * alpha + beta` (two float32 roundings, as the rule's
/// `Mul` then `Add`), `gx = 0 < u < 1 ? gy * alpha : 0` (a NaN `x` gives 0). Errors when the
/// lengths differ.
pub fn hard_sigmoid_grad(
    gy: &[f32],
    x: &[f32],
    alpha: f32,
    beta: f32,
    gx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    run(gy, x, gx, par, (CHUNK, SERIAL_BELOW), |p| {
        for ((o, &g), &x) in p.gx.iter_mut().zip(p.gy).zip(p.x) {
            let u = x * alpha + beta;
            *o = if u > 0.0 && u < 1.0 { g * alpha } else { 0.0 };
        }
    })
}

/// HardSwish's gradient (PyTorch's hardswish_backward): 0 below -3, `gy` above 3, `gy * (x
/// / 3 + 0.5)` between (three float32 roundings, as the rule's `Div`, `Add`, `Mul`); a NaN
/// `x` gives NaN. Errors when the lengths differ.
pub fn hard_swish_grad(gy: &[f32], x: &[f32], gx: &mut [f32], par: &dyn Parallelism) -> Result<(), KernelError> {
    run(gy, x, gx, par, (CHUNK, SERIAL_BELOW), |p| {
        for ((o, &g), &x) in p.gx.iter_mut().zip(p.gy).zip(p.x) {
            let mid = g * (x / 3.0 + 0.5);
            let upper = if x > 3.0 { g } else { mid };
            *o = if x < -3.0 { 0.0 } else { upper };
        }
    })
}

/// `gx[i] = gy[i] * SiLU'(x[i])` (`SiLU(x) = x * sigmoid(x)`), in float32 within
/// `11 u |gy| (s + 2 |x| s (1 - s))` (see `silu`). Errors when the lengths differ.
pub fn silu_grad(gy: &[f32], x: &[f32], gx: &mut [f32], par: &dyn Parallelism) -> Result<(), KernelError> {
    silu_grad_with(crate::simd::detected(), gy, x, gx, par)
}

/// [`silu_grad`] at a given instruction-set level (the portable code where `level` is not
/// available); every level gives the same bits.
pub fn silu_grad_with(
    level: Level,
    gy: &[f32],
    x: &[f32],
    gx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    run(gy, x, gx, par, (CHUNK, SERIAL_BELOW), |p| super::silu::run_piece(level, p.gy, p.x, p.gx))
}

/// `gx[i] = gy[i] * Gelu'(x[i])`, computed in float64 and rounded once to float32 (at most
/// 1 ulp from the exact value; see `gelu` for how). `Gelu'(+inf) = 1`, `Gelu'(-inf) = 0`;
/// a NaN gives NaN. Errors when the lengths differ.
pub fn gelu_grad(
    gy: &[f32],
    x: &[f32],
    approximate: Gelu,
    gx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    gelu_grad_with(crate::simd::detected(), gy, x, approximate, gx, par)
}

/// [`gelu_grad`] at a given instruction-set level (the portable code where `level` is not
/// available); every level gives the same bits.
pub fn gelu_grad_with(
    level: Level,
    gy: &[f32],
    x: &[f32],
    approximate: Gelu,
    gx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    run(gy, x, gx, par, (GELU_CHUNK, GELU_SERIAL_BELOW), |p| {
        super::gelu::run_piece(level, p.gy, p.x, p.gx, approximate);
    })
}

/// Plain scalar references, straight from the definitions, for the tests.
pub mod reference {
    #[cfg(test)]
    use super::Gelu;

    /// Relu's gradient, element by element.
    pub fn relu_grad(gy: &[f32], x: &[f32]) -> Vec<f32> {
        gy.iter().zip(x).map(|(&g, &x)| if x > 0.0 { g } else { 0.0 }).collect()
    }

    /// LeakyRelu's gradient, element by element.
    pub fn leaky_relu_grad(gy: &[f32], x: &[f32], alpha: f32) -> Vec<f32> {
        gy.iter().zip(x).map(|(&g, &x)| if x > 0.0 { g } else { alpha * g }).collect()
    }

    /// HardSigmoid's gradient, element by element, as the standard-op rule computes it.
    pub fn hard_sigmoid_grad(gy: &[f32], x: &[f32], alpha: f32, beta: f32) -> Vec<f32> {
        gy.iter()
            .zip(x)
            .map(|(&g, &x)| {
                let u = x * alpha + beta;
                if u > 0.0 && u < 1.0 {
                    g * alpha
                } else {
                    0.0
                }
            })
            .collect()
    }

    /// HardSwish's gradient, element by element, as the standard-op rule computes it.
    pub fn hard_swish_grad(gy: &[f32], x: &[f32]) -> Vec<f32> {
        gy.iter()
            .zip(x)
            .map(|(&g, &x)| match x {
                x if x < -3.0 => 0.0,
                x if x > 3.0 => g,
                x => g * (x / 3.0 + 0.5),
            })
            .collect()
    }

    /// SiLU's derivative in float64 from the textbook form `s + x s (1 - s)`, `s = 1 / (1 +
    /// e^-x)` with the standard library's `exp` (an implementation independent of the fast
    /// path's).
    #[cfg(test)]
    pub fn silu_derivative(x: f64) -> f64 {
        let s = 1.0 / (1.0 + (-x).exp());
        s + x * s * (1.0 - s)
    }

    /// Gelu's derivative in float64 (libm's erf), straight from the textbook forms: `Phi(x) + x phi(x)`
    /// with `Phi = (1 + erf(x/sqrt 2))/2`, and `(1 + t)/2 + x/2 (1 - t^2) u'` for tanh.
    /// (Less accurate in the far left tail than the fast path, which avoids cancellation.)
    #[cfg(test)]
    pub fn gelu_derivative(x: f64, approximate: Gelu) -> f64 {
        use core::f64::consts::{PI, SQRT_2};
        match approximate {
            Gelu::Erf => 0.5 * (1.0 + libm::erf(x / SQRT_2)) + x * (-x * x / 2.0).exp() / (2.0 * PI).sqrt(),
            Gelu::Tanh => {
                let k = (2.0 / PI).sqrt();
                let t = (k * (x + 0.044715 * x * x * x)).tanh();
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
            }
        }
    }

    /// Gelu's gradient, element by element (float64, rounded once).
    #[cfg(test)]
    pub fn gelu_grad(gy: &[f32], x: &[f32], approximate: Gelu) -> Vec<f32> {
        gy.iter().zip(x).map(|(&g, &x)| (f64::from(g) * gelu_derivative(f64::from(x), approximate)) as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::uniform;
    use crate::{RayonPool, Sequential};

    const SIZES: [usize; 10] = [0, 1, 3, 7, 8, 9, 15, 17, 1023, (1 << 16) + 13];

    fn data(n: usize, seed: u64, scale: f64) -> Vec<f32> {
        let mut u = uniform(seed);
        (0..n).map(|_| (u() * scale) as f32).collect()
    }

    /// Inputs with the special values first: signed zeros, NaN, infinities, subnormals.
    fn specials(mut v: Vec<f32>) -> Vec<f32> {
        let s = [0.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -1e-40, f32::MAX, f32::MIN];
        for (d, s) in v.iter_mut().zip(s) {
            *d = s;
        }
        v
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn check_all(f: impl Fn(&[f32], &[f32], &mut [f32], &dyn Parallelism), r: impl Fn(&[f32], &[f32]) -> Vec<f32>) {
        for &n in &SIZES {
            let gy = specials(data(n, 1 + n as u64, 4.0));
            let x = specials(data(n, 7 + n as u64, 12.0));
            let want = bits(&r(&gy, &x));
            for par in [&Sequential as &dyn Parallelism, &RayonPool(None)] {
                let mut gx = vec![f32::NAN; n];
                f(&gy, &x, &mut gx, par);
                assert_eq!(bits(&gx), want, "n = {n}");
            }
        }
    }

    #[test]
    fn relu_equals_reference() {
        check_all(|gy, x, gx, p| relu_grad(gy, x, gx, p).unwrap(), reference::relu_grad);
    }

    #[test]
    fn relu_cases() {
        let x = [1.0, 0.0, -0.0, -1.0, f32::NAN, 1e-45];
        let gy = [-0.0, 5.0, 5.0, 5.0, 5.0, f32::NAN];
        let mut gx = [9.0; 6];
        relu_grad(&gy, &x, &mut gx, &Sequential).unwrap();
        assert_eq!(bits(&gx), bits(&[-0.0, 0.0, 0.0, 0.0, 0.0, f32::NAN]));
    }

    #[test]
    fn leaky_relu_equals_reference() {
        for alpha in [0.01, 0.0, -0.5, 3.0] {
            check_all(
                |gy, x, gx, p| leaky_relu_grad(gy, x, alpha, gx, p).unwrap(),
                |gy, x| reference::leaky_relu_grad(gy, x, alpha),
            );
        }
        let mut gx = [0.0; 3];
        leaky_relu_grad(&[2.0, 2.0, 2.0], &[1.0, -1.0, 0.0], 0.25, &mut gx, &Sequential).unwrap();
        assert_eq!(gx, [2.0, 0.5, 0.5]);
    }

    /// Distance in float32 ulps (order-preserving integer map; +0 and -0 are 0 apart).
    fn ulps(a: f32, b: f32) -> u64 {
        let key = |v: f32| {
            let i = v.to_bits() as i32;
            i64::from(if i < 0 { i32::MIN.wrapping_sub(i) } else { i })
        };
        (key(a) - key(b)).unsigned_abs()
    }

    #[test]
    fn gelu_every_level_gives_the_same_bits() {
        for approximate in [Gelu::Erf, Gelu::Tanh] {
            for &n in &SIZES {
                let gy = specials(data(n, 13 + n as u64, 4.0));
                let x = specials(data(n, 17 + n as u64, 16.0));
                let mut want = vec![0.0; n];
                gelu_grad_with(Level::Scalar, &gy, &x, approximate, &mut want, &Sequential).unwrap();
                for level in crate::simd::available_levels() {
                    let mut got = vec![0.0; n];
                    gelu_grad_with(level, &gy, &x, approximate, &mut got, &RayonPool(None)).unwrap();
                    assert_eq!(bits(&got), bits(&want), "{approximate:?} {level:?} n = {n}");
                }
            }
        }
    }

    #[test]
    fn gelu_fast_path_is_the_same_however_cut() {
        for approximate in [Gelu::Erf, Gelu::Tanh] {
            for &n in &SIZES {
                let gy = specials(data(n, 3 + n as u64, 4.0));
                let x = specials(data(n, 5 + n as u64, 16.0));
                let mut one = vec![0.0; n];
                let mut many = vec![0.0; n];
                gelu_grad(&gy, &x, approximate, &mut one, &Sequential).unwrap();
                gelu_grad(&gy, &x, approximate, &mut many, &RayonPool(None)).unwrap();
                assert_eq!(bits(&one), bits(&many), "{approximate:?} n = {n}");
            }
        }
    }

    /// Within 1 ulp of the textbook float64 form wherever that form itself is accurate
    /// (|x| <= 5: no tail cancellation), and the special values.
    #[test]
    fn gelu_within_one_ulp_of_reference() {
        for approximate in [Gelu::Erf, Gelu::Tanh] {
            let x: Vec<f32> = data(20_000, 11, 10.0);
            let gy: Vec<f32> = data(20_000, 12, 6.0);
            let want = reference::gelu_grad(&gy, &x, approximate);
            let mut gx = vec![0.0; x.len()];
            gelu_grad(&gy, &x, approximate, &mut gx, &Sequential).unwrap();
            let worst = (0..x.len()).map(|i| ulps(gx[i], want[i])).max().unwrap();
            assert!(worst <= 1, "{approximate:?}: {worst} ulps");
            let mut s = [0.0f32; 5];
            gelu_grad(
                &[1.0; 5],
                &[f32::INFINITY, f32::NEG_INFINITY, 0.0, f32::NAN, -1e30],
                approximate,
                &mut s,
                &Sequential,
            )
            .unwrap();
            assert_eq!(s[..3], [1.0, 0.0, 0.5]);
            assert!(s[3].is_nan());
            assert_eq!(s[4], 0.0);
        }
    }

    /// A dense sweep of the erf form over [-14, 14] (the left tail included) against libm's
    /// float64 erfc, an implementation independent of the fast path's expansions: 1 ulp.
    #[test]
    fn gelu_erf_sweep_against_libm_erfc() {
        let x: Vec<f32> = (0..200_001).map(|k| (-14.0 + 28.0 * f64::from(k) / 200_000.0) as f32).collect();
        let mut got = vec![0.0; x.len()];
        gelu_grad(&vec![1.0; x.len()], &x, Gelu::Erf, &mut got, &Sequential).unwrap();
        for (&x, &g) in x.iter().zip(&got) {
            let x = f64::from(x);
            let d = 0.5 * libm::erfc(-x / core::f64::consts::SQRT_2)
                + x * (-0.5 * x * x).exp() / (2.0 * core::f64::consts::PI).sqrt();
            assert!(ulps(g, d as f32) <= 1, "x = {x}: {g} vs {d}");
        }
    }

    /// The far left tail, against values worked out independently: Gelu'(x) there is
    /// `phi(x) (1/|x| - |x| - 1/|x|^3 + ...)` (Mills ratio), which the fast path must keep
    /// to float32 precision where `(1 + erf)/2` has no digits left.
    #[test]
    fn gelu_erf_left_tail() {
        for x in [-8.0f64, -12.0, -20.0] {
            let phi = (-x * x / 2.0).exp() / (2.0 * core::f64::consts::PI).sqrt();
            let a = -x;
            let mills = 1.0 / a - 1.0 / a.powi(3) + 3.0 / a.powi(5) - 15.0 / a.powi(7) + 105.0 / a.powi(9);
            let want = (phi * (mills - a)) as f32;
            let mut got = [0.0f32];
            gelu_grad(&[1.0], &[x as f32], Gelu::Erf, &mut got, &Sequential).unwrap();
            assert!(ulps(got[0], want) <= 2, "x = {x}: {} vs {want}", got[0]);
        }
    }

    #[test]
    fn hard_sigmoid_equals_reference() {
        for (alpha, beta) in [(0.2, 0.5), (1.0 / 6.0, 0.5), (-0.3, 0.1)] {
            check_all(
                |gy, x, gx, p| hard_sigmoid_grad(gy, x, alpha, beta, gx, p).unwrap(),
                |gy, x| reference::hard_sigmoid_grad(gy, x, alpha, beta),
            );
        }
        // The kinks: 0 at both ends of the linear piece (u = 0 and u = 1 exactly).
        let mut gx = [9.0; 5];
        hard_sigmoid_grad(&[2.0; 5], &[-2.5, 2.5, 0.0, f32::NAN, -3.0], 0.2, 0.5, &mut gx, &Sequential).unwrap();
        assert_eq!(gx, [0.0, 0.0, 0.4, 0.0, 0.0]);
    }

    #[test]
    fn hard_swish_equals_reference() {
        check_all(|gy, x, gx, p| hard_swish_grad(gy, x, gx, p).unwrap(), reference::hard_swish_grad);
        let mut gx = [9.0; 6];
        hard_swish_grad(&[3.0; 6], &[-4.0, -3.0, 0.0, 3.0, 4.0, f32::NAN], &mut gx, &Sequential).unwrap();
        assert_eq!(gx[..5], [0.0, -1.5, 1.5, 4.5, 3.0]);
        assert!(gx[5].is_nan());
    }

    #[test]
    fn silu_every_level_and_cut_gives_the_same_bits() {
        for &n in &SIZES {
            let gy = specials(data(n, 23 + n as u64, 4.0));
            let x = specials(data(n, 29 + n as u64, 40.0));
            let mut want = vec![0.0; n];
            silu_grad_with(Level::Scalar, &gy, &x, &mut want, &Sequential).unwrap();
            for level in crate::simd::available_levels() {
                let mut got = vec![0.0; n];
                silu_grad_with(level, &gy, &x, &mut got, &RayonPool(None)).unwrap();
                assert_eq!(bits(&got), bits(&want), "{level:?} n = {n}");
            }
        }
    }

    /// Within the module's bound of the textbook float64 form (the standard library's
    /// `exp`), over a dense sweep through the root near -1.2785, the tails and the flat
    /// cut at |x| = 87, and the special values.
    #[test]
    fn silu_within_the_bound_of_reference() {
        let mut x: Vec<f32> = (0..200_001).map(|k| (-40.0 + 80.0 * f64::from(k) / 200_000.0) as f32).collect();
        x.extend((0..20_001).map(|k| (-1.3 + 0.05 * f64::from(k) / 20_000.0) as f32));
        x.extend((0..20_001).map(|k| (80.0 + 20.0 * f64::from(k) / 20_000.0) as f32));
        x.extend((0..20_001).map(|k| (-100.0 + 20.0 * f64::from(k) / 20_000.0) as f32));
        let gy: Vec<f32> = (0..x.len()).map(|k| 0.5 + (k % 13) as f32 * 0.75).collect();
        let mut got = vec![0.0; x.len()];
        silu_grad(&gy, &x, &mut got, &Sequential).unwrap();
        for ((&g, &x), &o) in gy.iter().zip(&x).zip(&got) {
            let (g, x) = (f64::from(g), f64::from(x));
            let exact = g * reference::silu_derivative(x);
            let s = 1.0 / (1.0 + (-x).exp());
            let bound =
                11.0 * 2f64.powi(-24) * g.abs() * (s + 2.0 * x.abs() * s * (1.0 - s)) + 2f64.powi(-100) * g.abs();
            assert!((f64::from(o) - exact).abs() <= bound, "x = {x}: {o} vs {exact}");
        }
        let mut s = [0.0f32; 5];
        silu_grad(&[1.0; 5], &[f32::INFINITY, f32::NEG_INFINITY, 0.0, f32::NAN, -1e30], &mut s, &Sequential).unwrap();
        assert_eq!(s[..3], [1.0, 0.0, 0.5]);
        assert!(s[3].is_nan());
        assert_eq!(s[4], 0.0);
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let mut gx = [0.0; 2];
        assert!(relu_grad(&[1.0, 2.0], &[1.0], &mut gx, &Sequential).is_err());
        assert!(gelu_grad(&[1.0, 2.0], &[1.0, 2.0], Gelu::Erf, &mut gx[..1], &Sequential).is_err());
    }
}
