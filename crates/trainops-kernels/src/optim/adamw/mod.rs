//! `com.trainops::AdamW`: PyTorch's `torch.optim.AdamW` (`foreach=False, fused=False`,
//! torch 2.x `_single_tensor_adam` with decoupled weight decay), operation by operation,
//! with PyTorch's roundings. Per element, `t` being torch's `step` (1 on the first update):
//!
//! ```text
//! g  = -g if maximize
//! x  = x * (1 - lr * weight_decay)                  param.mul_(1 - lr * weight_decay)
//! m  = lerp(m, g, 1 - beta1)                        exp_avg.lerp_(grad, 1 - beta1)
//! v  = fma(((1 - beta2) * g), g, v * beta2)         exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//! vmax = max(vmax, v); s = vmax if amsgrad else v   torch.maximum(max_exp_avg_sq, exp_avg_sq)
//! d  = sqrt(s) / sqrt(1 - beta2^t) + eps            (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//! x  = x + ((-lr / (1 - beta1^t)) * m) / d          param.addcdiv_(exp_avg, denom, value=-step_size)
//! ```
//! with `lerp(m, g, w) = fma(w, g - m, m)` when `|w| < 0.5`, else `fma(w - 1, g - m, g)`.
//!
//! Where PyTorch rounds: the Python scalars (`1 - lr * weight_decay`, `1 - beta1`, `beta2`,
//! `1 - beta2`, `bias_correction2 ** 0.5`, `eps`, `-step_size`) are computed in `f64` once
//! per call and rounded once to the compute type ([`AdamWCoeffs`]); every tensor operation
//! rounds to the compute type. PyTorch's CPU kernels fuse the multiply-add of `lerp` and of
//! `addcmul` (its vectorised `lerp` calls `fmadd`, and GCC contracts `self + value * t1 * t2`
//! to `fma(value * t1, t2, self)`; both measured against torch 2.15 on this CPU, the scalar
//! tails too), so this does as well, and nowhere else (`addcdiv` is `self + (value * t1) / t2`,
//! in C++'s left-to-right order). The one operation that is not torch's bits is `sqrt`:
//! torch's CPU `sqrt` (MKL's vector math) is within one ulp of the correctly rounded square
//! root this computes, so `m`, `v` and `vmax` are bitwise torch's and `x` within a few ulps
//! (README, AdamW).
//!
//! float16 and bfloat16 tensors compute in `f32` and round once per stored stream, where
//! torch rounds each operation's result to the 16-bit type (a more accurate update; float32
//! weights with 16-bit gradients are torch's float32 update of the widened gradient, exactly).
//!
//! Attributes are ONNX float32; torch's are Python floats. [`as_written`] reads a float32
//! attribute as the decimal it was written as (`0.9`, not `0.89999997615814208984375`),
//! so `beta1=0.9` means Python's `0.9`. The learning rate `R` is taken at its value.

pub mod reference;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::{portable, Optimizer, Param};
use crate::simd::Level;
use crate::{Compute, Element};

/// The operator's attributes (torch's names and defaults), as `f64` like Python's floats.
/// `amsgrad` is not here: it picks the stream count (3: `X, M, V`; 4: `X, M, V, Vmax`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWAttrs {
    /// Coefficient of the running gradient average (`betas[0]`).
    pub beta1: f64,
    /// Coefficient of the running squared-gradient average (`betas[1]`).
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)`.
    pub epsilon: f64,
    /// Decoupled weight decay: the weights are first scaled by `1 - lr * weight_decay`.
    pub weight_decay: f64,
    /// Ascend the gradient instead (`g = -g`).
    pub maximize: bool,
}

impl Default for AdamWAttrs {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 1e-2, maximize: false }
    }
}

/// A float32 attribute as the decimal it was written as: the shortest decimal that rounds
/// to it (what Python prints), read as `f64`. `0.9f32` gives Python's `0.9`.
pub fn as_written(v: f32) -> f64 {
    format!("{v}").parse().unwrap_or(f64::from(v))
}

/// The per-call scalars of the update, each computed in `f64` as torch's Python code does
/// and rounded once to the compute type `C` (as torch's kernels take Python scalars).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWCoeffs<C> {
    /// Whether the gradient is negated first.
    pub maximize: bool,
    /// `1 - lr * weight_decay` (`1` when `weight_decay` is 0).
    pub decay: C,
    /// `lerp`'s coefficient: its weight `1 - beta1` when that is below 0.5 in magnitude,
    /// else the weight minus one.
    pub lerp: C,
    /// Whether `lerp` runs from the end: `g + (w - 1) * (g - m)` (weight `>= 0.5`).
    pub lerp_from_end: bool,
    /// `beta2`.
    pub beta2: C,
    /// `1 - beta2`.
    pub one_minus_beta2: C,
    /// `(1 - beta2^t) ** 0.5`.
    pub bias_correction2_sqrt: C,
    /// `eps`.
    pub epsilon: C,
    /// `lr / (1 - beta1^t)` (torch adds `-step_size * m / d`; this subtracts
    /// `step_size * m / d`, the same bits, and a NaN operand order the compiler keeps).
    pub step_size: C,
}

impl<C: Compute> AdamWCoeffs<C> {
    /// The coefficients of one call with learning rate `lr` and torch's step `t`.
    pub fn new(a: &AdamWAttrs, lr: f64, t: i64) -> Self {
        let step = t as f64;
        let bias_correction1 = 1.0 - a.beta1.powf(step);
        let bias_correction2 = 1.0 - a.beta2.powf(step);
        // Python's `** 0.5` is libm's pow, which may differ from sqrt in the last bit:
        // black_box keeps the compiler from turning this pow into a sqrt.
        let bias_correction2_sqrt = bias_correction2.powf(core::hint::black_box(0.5));
        let weight = C::from_f64(1.0 - a.beta1);
        let from_end = !(weight < C::from_f64(0.5) && weight > C::from_f64(-0.5));
        Self {
            maximize: a.maximize,
            decay: C::from_f64(if a.weight_decay != 0.0 { 1.0 - lr * a.weight_decay } else { 1.0 }),
            lerp: if from_end { weight - C::from_f64(1.0) } else { weight },
            lerp_from_end: from_end,
            beta2: C::from_f64(a.beta2),
            one_minus_beta2: C::from_f64(1.0 - a.beta2),
            bias_correction2_sqrt: C::from_f64(bias_correction2_sqrt),
            epsilon: C::from_f64(a.epsilon),
            step_size: C::from_f64(lr / bias_correction1),
        }
    }
}

/// The moments of one element: `(x, g, m, v) -> (x decayed, m', v')`.
#[inline(always)]
pub fn moments<C: Compute>(c: &AdamWCoeffs<C>, x: C, g: C, m: C, v: C) -> (C, C, C) {
    let g = if c.maximize { -g } else { g };
    let x = x * c.decay;
    let base = if c.lerp_from_end { g } else { m };
    let m = c.lerp.mul_add(g - m, base);
    let v = (c.one_minus_beta2 * g).mul_add(g, v * c.beta2);
    (x, m, v)
}

/// The step of one element from the decayed weight, the new `m` and the second moment `s`
/// the denominator uses (`v`, or `vmax` with amsgrad).
#[inline(always)]
pub fn apply<C: Compute>(c: &AdamWCoeffs<C>, x: C, m: C, s: C) -> C {
    let denom = s.sqrt() / c.bias_correction2_sqrt + c.epsilon;
    x - (c.step_size * m) / denom
}

/// `a` where `a > b` or `a` is NaN, else `b`: torch's `maximum` (NaN propagates), as a
/// selection that keeps the bits.
#[inline(always)]
pub fn keep_max<C: Compute>(a: C, b: C) -> C {
    #[allow(clippy::eq_op)]
    let a_nan = a != a;
    if a > b || a_nan {
        a
    } else {
        b
    }
}

/// AdamW, as the family's [`Optimizer`]: streams `X, M, V` (amsgrad off) or `X, M, V, Vmax`
/// (amsgrad on, [`Optimizer<4>`]).
#[derive(Debug, Clone, Copy)]
pub struct AdamW;

impl Optimizer<3> for AdamW {
    type Attrs = AdamWAttrs;
    type Coeffs<C: Compute> = AdamWCoeffs<C>;
    const STREAMS: [&'static str; 3] = ["X", "M", "V"];
    const MIN_T: i64 = 1;

    fn coeffs<C: Compute>(attrs: &AdamWAttrs, r: f64, t: i64) -> AdamWCoeffs<C> {
        AdamWCoeffs::new(attrs, r, t)
    }

    #[inline(always)]
    fn update<C: Compute>(c: &AdamWCoeffs<C>, [x, m, v]: [C; 3], g: C) -> [C; 3] {
        let (x, m, v) = moments(c, x, g, m, v);
        [apply(c, x, m, v), m, v]
    }

    fn reference<X: Element, G: Element<C = X::C>>(
        attrs: &AdamWAttrs,
        r: f64,
        t: i64,
        [x, m, v]: [&[X]; 3],
        g: &[G],
    ) -> [Vec<X>; 3] {
        let (x, m, v, _) = reference::adamw(attrs, r, t, x, g, m, v, None);
        [x, m, v]
    }

    /// The SIMD kernel of the level (see `optim::x86`); the portable loop otherwise.
    fn chunk<X: Element, G: Element<C = X::C>>(level: Level, c: &AdamWCoeffs<X::C>, p: Param<'_, X, G, 3>) {
        #[cfg(target_arch = "x86_64")]
        let Err(p) = x86::plain::try_simd(level, c, p) else {
            return;
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = level;
        portable(c, p, <Self as Optimizer<3>>::update);
    }
}

impl Optimizer<4> for AdamW {
    type Attrs = AdamWAttrs;
    type Coeffs<C: Compute> = AdamWCoeffs<C>;
    const STREAMS: [&'static str; 4] = ["X", "M", "V", "Vmax"];
    const MIN_T: i64 = 1;

    fn coeffs<C: Compute>(attrs: &AdamWAttrs, r: f64, t: i64) -> AdamWCoeffs<C> {
        AdamWCoeffs::new(attrs, r, t)
    }

    #[inline(always)]
    fn update<C: Compute>(c: &AdamWCoeffs<C>, [x, m, v, vmax]: [C; 4], g: C) -> [C; 4] {
        let (x, m, v) = moments(c, x, g, m, v);
        let vmax = keep_max(vmax, v);
        [apply(c, x, m, vmax), m, v, vmax]
    }

    fn reference<X: Element, G: Element<C = X::C>>(
        attrs: &AdamWAttrs,
        r: f64,
        t: i64,
        [x, m, v, vmax]: [&[X]; 4],
        g: &[G],
    ) -> [Vec<X>; 4] {
        let (x, m, v, vmax) = reference::adamw(attrs, r, t, x, g, m, v, Some(vmax));
        [x, m, v, vmax.unwrap_or_default()]
    }

    /// The SIMD kernel of the level (see `optim::x86`); the portable loop otherwise.
    fn chunk<X: Element, G: Element<C = X::C>>(level: Level, c: &AdamWCoeffs<X::C>, p: Param<'_, X, G, 4>) {
        #[cfg(target_arch = "x86_64")]
        let Err(p) = x86::amsgrad::try_simd(level, c, p) else {
            return;
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = level;
        portable(c, p, <Self as Optimizer<4>>::update);
    }
}

#[cfg(test)]
mod tests;
