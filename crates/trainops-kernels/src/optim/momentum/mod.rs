//! ONNX `ai.onnx.preview.training::Momentum` (since version 1), per element:
//!
//! ```text
//! g  = norm_coefficient * x + g
//! v' = alpha * v + beta_adjusted * g          # beta_adjusted = T > 0 ? beta : 1
//! x' = x - R * v'                             # mode "standard"
//! x' = x - R * (g + alpha * v')               # mode "nesterov"
//! ```
//! As for Adam, scalar coefficients are formed in `f64` (from the `f32` attributes and the
//! learning rate `R`) and rounded to the compute type once per call, and the operations run
//! in the order of onnx's reference.

pub mod reference;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::{portable, Optimizer, Param};
use crate::simd::Level;
use crate::{Compute, Element};

/// Which momentum update rule (ONNX's `mode` attribute).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MomentumMode {
    /// `"standard"`: `x' = x - R * v'`.
    Standard,
    /// `"nesterov"`: `x' = x - R * (g + alpha * v')`.
    Nesterov,
}

impl MomentumMode {
    /// The mode named by ONNX's `mode` attribute, `None` for any other string.
    pub fn from_onnx(mode: &str) -> Option<Self> {
        match mode {
            "standard" => Some(Self::Standard),
            "nesterov" => Some(Self::Nesterov),
            _ => None,
        }
    }
}

/// The operator's attributes. ONNX gives none of them a default.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MomentumAttrs {
    /// Decay of the previous momentum.
    pub alpha: f32,
    /// Scale of the current gradient (taken as 1 when `T <= 0`).
    pub beta: f32,
    /// Standard or Nesterov momentum.
    pub mode: MomentumMode,
    /// L2 regularisation added to the gradient before the update.
    pub norm_coefficient: f32,
}

/// `beta` when `T > 0`, else 1: the gradient's coefficient in the first iteration is 1.
pub fn adjusted_beta(t: i64, beta: f32) -> f64 {
    if t > 0 {
        f64::from(beta)
    } else {
        1.0
    }
}

/// The per-call scalars of the update, rounded once to the compute type `C`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MomentumCoeffs<C> {
    /// `alpha`.
    pub alpha: C,
    /// `beta_adjusted` (see [`adjusted_beta`]).
    pub beta: C,
    /// `norm_coefficient`.
    pub norm: C,
    /// The learning rate `R`.
    pub rate: C,
    /// The update rule.
    pub mode: MomentumMode,
}

impl<C: Compute> MomentumCoeffs<C> {
    /// Coefficients for one call with learning rate `r` and update count `t`.
    pub fn new(a: &MomentumAttrs, r: f64, t: i64) -> Self {
        Self {
            alpha: C::from_f64(f64::from(a.alpha)),
            beta: C::from_f64(adjusted_beta(t, a.beta)),
            norm: C::from_f64(f64::from(a.norm_coefficient)),
            rate: C::from_f64(r),
            mode: a.mode,
        }
    }
}

/// The update of one element, `(x, g, v) -> (x', v')`, with Nesterov's rule when `NESTEROV`.
#[inline(always)]
pub fn update<C: Compute, const NESTEROV: bool>(c: &MomentumCoeffs<C>, x: C, g: C, v: C) -> (C, C) {
    let g = c.norm * x + g;
    let v = c.alpha * v + c.beta * g;
    let x = if NESTEROV { x - c.rate * (g + c.alpha * v) } else { x - c.rate * v };
    (x, v)
}

/// Momentum, as the family's [`Optimizer`]: streams `X, V`.
#[derive(Debug, Clone, Copy)]
pub struct Momentum;

impl Optimizer<2> for Momentum {
    type Attrs = MomentumAttrs;
    type Coeffs<C: Compute> = MomentumCoeffs<C>;
    const STREAMS: [&'static str; 2] = ["X", "V"];

    fn coeffs<C: Compute>(attrs: &MomentumAttrs, r: f64, t: i64) -> MomentumCoeffs<C> {
        MomentumCoeffs::new(attrs, r, t)
    }

    #[inline(always)]
    fn update<C: Compute>(c: &MomentumCoeffs<C>, [x, v]: [C; 2], g: C) -> [C; 2] {
        let (x, v) = match c.mode {
            MomentumMode::Standard => update::<C, false>(c, x, g, v),
            MomentumMode::Nesterov => update::<C, true>(c, x, g, v),
        };
        [x, v]
    }

    fn reference<X: Element, G: Element<C = X::C>>(
        attrs: &MomentumAttrs,
        r: f64,
        t: i64,
        [x, v]: [&[X]; 2],
        g: &[G],
    ) -> [Vec<X>; 2] {
        let (x, v) = reference::momentum(attrs, r, t, x, g, v);
        [x, v]
    }

    /// The SIMD kernel of the level for `f32`, `f64` and 16-bit types (see `x86.rs`); else
    /// the portable loop. Either way the mode is decided once per chunk, not per element.
    fn chunk<X: Element, G: Element<C = X::C>>(level: Level, c: &MomentumCoeffs<X::C>, p: Param<'_, X, G, 2>) {
        #[cfg(target_arch = "x86_64")]
        let Err(p) = x86::try_simd(level, c, p) else {
            return;
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = level;
        match c.mode {
            MomentumMode::Standard => portable(c, p, |c, [x, v], g| update::<_, false>(c, x, g, v).into()),
            MomentumMode::Nesterov => portable(c, p, |c, [x, v], g| update::<_, true>(c, x, g, v).into()),
        }
    }
}

#[cfg(test)]
mod tests;
