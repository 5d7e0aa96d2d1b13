//! ONNX `ai.onnx.preview.training::Adam` (since version 1), per element:
//!
//! ```text
//! g  = norm_coefficient * x + g
//! v' = alpha * v + (1 - alpha) * g
//! h' = beta  * h + (1 - beta)  * g * g
//! x' = x - r * (v' / (sqrt(h') + epsilon))
//! x' = (1 - norm_coefficient_post) * x'
//! ```
//! where `r` is the bias-corrected learning rate ([`adjusted_rate`]), computed once per call
//! in `f64`. Scalar coefficients are formed in `f64` from the `f32` attributes and rounded to
//! the compute type once, as numpy does with Python scalars.

pub mod reference;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::{portable, Optimizer, Param};
use crate::simd::Level;
use crate::{Compute, Element};

/// The operator's attributes, with ONNX's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamAttrs {
    /// Coefficient of the running gradient average.
    pub alpha: f32,
    /// Coefficient of the running squared-gradient average.
    pub beta: f32,
    /// Added to `sqrt(h')` to keep the division finite.
    pub epsilon: f32,
    /// L2 regularisation added to the gradient before the update.
    pub norm_coefficient: f32,
    /// Decay applied to the updated weights.
    pub norm_coefficient_post: f32,
}

impl AdamAttrs {
    /// ONNX's defaults (a constant, for the tables of attributes that need one).
    pub const DEFAULT: Self =
        Self { alpha: 0.9, beta: 0.999, epsilon: 1e-6, norm_coefficient: 0.0, norm_coefficient_post: 0.0 };
}

impl Default for AdamAttrs {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// `R * sqrt(1 - beta^T) / (1 - alpha^T)` when `T > 0`, else `R`, in `f64`.
pub fn adjusted_rate(r: f64, t: i64, alpha: f32, beta: f32) -> f64 {
    if t > 0 {
        let t = t as f64;
        r * (1.0 - f64::from(beta).powf(t)).sqrt() / (1.0 - f64::from(alpha).powf(t))
    } else {
        r
    }
}

/// The per-call scalars of the update, rounded once to the compute type `C`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamCoeffs<C> {
    /// `alpha`.
    pub alpha: C,
    /// `1 - alpha`.
    pub one_minus_alpha: C,
    /// `beta`.
    pub beta: C,
    /// `1 - beta`.
    pub one_minus_beta: C,
    /// `epsilon`.
    pub epsilon: C,
    /// `norm_coefficient`.
    pub norm: C,
    /// `1 - norm_coefficient_post`.
    pub keep: C,
    /// The adjusted learning rate.
    pub rate: C,
    /// When set, the gradient is first divided by this loss scale (mixed-precision Adam).
    pub loss_scale: Option<C>,
}

impl<C: Compute> AdamCoeffs<C> {
    /// Coefficients for one call with adjusted learning rate `rate` (see [`adjusted_rate`]).
    pub fn new(a: &AdamAttrs, rate: f64) -> Self {
        let f = |v: f32| C::from_f64(f64::from(v));
        let one_minus = |v: f32| C::from_f64(1.0 - f64::from(v));
        Self {
            alpha: f(a.alpha),
            one_minus_alpha: one_minus(a.alpha),
            beta: f(a.beta),
            one_minus_beta: one_minus(a.beta),
            epsilon: f(a.epsilon),
            norm: f(a.norm_coefficient),
            keep: one_minus(a.norm_coefficient_post),
            rate: C::from_f64(rate),
            loss_scale: None,
        }
    }

    /// The same coefficients, with gradients divided by `loss_scale` first.
    pub fn with_loss_scale(self, loss_scale: C) -> Self {
        Self { loss_scale: Some(loss_scale), ..self }
    }
}

/// The update of one element: `(x, g, v, h) -> (x', v', h')`.
#[inline(always)]
pub fn update<C: Compute>(c: &AdamCoeffs<C>, x: C, g: C, v: C, h: C) -> (C, C, C) {
    let g = match c.loss_scale {
        Some(s) => g / s,
        None => g,
    };
    let g = c.norm * x + g;
    let v = c.alpha * v + c.one_minus_alpha * g;
    let h = c.beta * h + c.one_minus_beta * (g * g);
    let x = x - c.rate * (v / (h.sqrt() + c.epsilon));
    (c.keep * x, v, h)
}

/// Adam, as the family's [`Optimizer`]: streams `X, V, H`.
#[derive(Debug, Clone, Copy)]
pub struct Adam;

impl Optimizer<3> for Adam {
    type Attrs = AdamAttrs;
    type Coeffs<C: Compute> = AdamCoeffs<C>;
    const STREAMS: [&'static str; 3] = ["X", "V", "H"];

    fn coeffs<C: Compute>(attrs: &AdamAttrs, r: f64, t: i64) -> AdamCoeffs<C> {
        AdamCoeffs::new(attrs, adjusted_rate(r, t, attrs.alpha, attrs.beta))
    }

    #[inline(always)]
    fn update<C: Compute>(c: &AdamCoeffs<C>, [x, v, h]: [C; 3], g: C) -> [C; 3] {
        let (x, v, h) = update(c, x, g, v, h);
        [x, v, h]
    }

    fn reference<X: Element, G: Element<C = X::C>>(
        attrs: &AdamAttrs,
        r: f64,
        t: i64,
        [x, v, h]: [&[X]; 3],
        g: &[G],
    ) -> [Vec<X>; 3] {
        let (x, v, h) = reference::adam(attrs, r, t, x, g, v, h);
        [x, v, h]
    }

    /// The SIMD kernel of the level for `f32` and `f64` weights (and `f32` weights with
    /// 16-bit gradients, AVX-512 only); the portable loop otherwise.
    fn chunk<X: Element, G: Element<C = X::C>>(level: Level, c: &AdamCoeffs<X::C>, p: Param<'_, X, G, 3>) {
        #[cfg(target_arch = "x86_64")]
        let Err(p) = x86::try_simd(level, c, p) else {
            return;
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = level;
        portable(c, p, Self::update);
    }
}

#[cfg(test)]
mod tests;
