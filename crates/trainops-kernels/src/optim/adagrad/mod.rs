//! ONNX `ai.onnx.preview.training::Adagrad` (since version 1), per element:
//!
//! ```text
//! g  = norm_coefficient * x + g
//! h' = h + g * g
//! x' = x - r * g / (sqrt(h') + epsilon)
//! ```
//! where `r = R / (1 + T * decay_factor)` ([`adjusted_rate`]) is computed once per call in
//! `f64`. As for Adam, scalar coefficients are formed in `f64` from the `f32` attributes and
//! rounded to the compute type once, and the operations run in the order of onnx's reference
//! (`(r * g) / (sqrt(h') + epsilon)`).

pub mod reference;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::{portable, Optimizer, Param};
use crate::simd::Level;
use crate::{Compute, Element};

/// The operator's attributes, with ONNX's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdagradAttrs {
    /// Learning-rate decay per update: `r = R / (1 + T * decay_factor)`.
    pub decay_factor: f32,
    /// Added to `sqrt(h')` to keep the division finite.
    pub epsilon: f32,
    /// L2 regularisation added to the gradient before the update.
    pub norm_coefficient: f32,
}

impl AdagradAttrs {
    /// ONNX's defaults (a constant, for the tables of attributes that need one).
    pub const DEFAULT: Self = Self { decay_factor: 0.0, epsilon: 1e-6, norm_coefficient: 0.0 };
}

impl Default for AdagradAttrs {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// `R / (1 + T * decay_factor)` in `f64` (any `T`: ONNX puts no guard on it).
pub fn adjusted_rate(r: f64, t: i64, decay_factor: f32) -> f64 {
    r / (1.0 + t as f64 * f64::from(decay_factor))
}

/// The per-call scalars of the update, rounded once to the compute type `C`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdagradCoeffs<C> {
    /// `epsilon`.
    pub epsilon: C,
    /// `norm_coefficient`.
    pub norm: C,
    /// The adjusted learning rate.
    pub rate: C,
}

impl<C: Compute> AdagradCoeffs<C> {
    /// Coefficients for one call with adjusted learning rate `rate` (see [`adjusted_rate`]).
    pub fn new(a: &AdagradAttrs, rate: f64) -> Self {
        Self {
            epsilon: C::from_f64(f64::from(a.epsilon)),
            norm: C::from_f64(f64::from(a.norm_coefficient)),
            rate: C::from_f64(rate),
        }
    }
}

/// The update of one element: `(x, g, h) -> (x', h')`.
#[inline(always)]
pub fn update<C: Compute>(c: &AdagradCoeffs<C>, x: C, g: C, h: C) -> (C, C) {
    let g = c.norm * x + g;
    let h = h + g * g;
    let x = x - c.rate * g / (h.sqrt() + c.epsilon);
    (x, h)
}

/// Adagrad, as the family's [`Optimizer`]: streams `X, H`.
#[derive(Debug, Clone, Copy)]
pub struct Adagrad;

impl Optimizer<2> for Adagrad {
    type Attrs = AdagradAttrs;
    type Coeffs<C: Compute> = AdagradCoeffs<C>;
    const STREAMS: [&'static str; 2] = ["X", "H"];

    fn coeffs<C: Compute>(attrs: &AdagradAttrs, r: f64, t: i64) -> AdagradCoeffs<C> {
        AdagradCoeffs::new(attrs, adjusted_rate(r, t, attrs.decay_factor))
    }

    #[inline(always)]
    fn update<C: Compute>(c: &AdagradCoeffs<C>, [x, h]: [C; 2], g: C) -> [C; 2] {
        let (x, h) = update(c, x, g, h);
        [x, h]
    }

    fn reference<X: Element, G: Element<C = X::C>>(
        attrs: &AdagradAttrs,
        r: f64,
        t: i64,
        [x, h]: [&[X]; 2],
        g: &[G],
    ) -> [Vec<X>; 2] {
        let (x, h) = reference::adagrad(attrs, r, t, x, g, h);
        [x, h]
    }

    /// The SIMD kernel of the level for `f32`, `f64` and 16-bit types (see `x86.rs`); the
    /// portable loop otherwise.
    fn chunk<X: Element, G: Element<C = X::C>>(level: Level, c: &AdagradCoeffs<X::C>, p: Param<'_, X, G, 2>) {
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
