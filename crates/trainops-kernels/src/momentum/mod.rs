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

use crate::adam::{CHUNK, SERIAL_BELOW};
use crate::parallel::{run_chunked, Splittable};
use crate::{Compute, Element, InOut, KernelError, Parallelism};

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

/// One tensor of a Momentum node: weights, gradient (already broadcast to the weights'
/// shape) and momentum.
pub struct MomentumTensor<'a, X, G> {
    /// Weights `X`, rewritten as `X_new`.
    pub x: InOut<'a, X>,
    /// Gradient `G`, one element per weight.
    pub g: &'a [G],
    /// Momentum `V`, rewritten as `V_new`.
    pub v: InOut<'a, X>,
}

impl<'a, X: Element, G: Element> MomentumTensor<'a, X, G> {
    /// Checks that all three buffers have the weights' length.
    pub fn new(x: InOut<'a, X>, g: &'a [G], v: InOut<'a, X>) -> Result<Self, KernelError> {
        let n = x.len();
        for (what, got) in [("G", g.len()), ("V", v.len())] {
            if got != n {
                return Err(KernelError::LengthMismatch { what, got, expected: n });
            }
        }
        Ok(Self { x, g, v })
    }
}

impl<X: Element, G: Element> Splittable for MomentumTensor<'_, X, G> {
    fn len(&self) -> usize {
        self.x.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (x0, x1) = self.x.split_at(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (v0, v1) = self.v.split_at(mid);
        (Self { x: x0, g: g0, v: v0 }, Self { x: x1, g: g1, v: v1 })
    }
}

/// One Momentum step over every tensor of a node, split into chunks like Adam's
/// ([`CHUNK`], [`SERIAL_BELOW`]). Each element's result does not depend on how the work is
/// split, so the output is bitwise identical for any `par`.
pub fn step<X, G>(c: &MomentumCoeffs<X::C>, tensors: Vec<MomentumTensor<'_, X, G>>, par: &dyn Parallelism)
where
    X: Element,
    G: Element<C = X::C>,
{
    match c.mode {
        MomentumMode::Standard => run_chunked(tensors, par, CHUNK, SERIAL_BELOW, |t| chunk::<X, G, false>(c, t)),
        MomentumMode::Nesterov => run_chunked(tensors, par, CHUNK, SERIAL_BELOW, |t| chunk::<X, G, true>(c, t)),
    }
}

/// The kernel over one chunk (every element type: 16-bit ones compute in `f32`).
fn chunk<X: Element, G: Element<C = X::C>, const NESTEROV: bool>(
    c: &MomentumCoeffs<X::C>,
    mut t: MomentumTensor<'_, X, G>,
) {
    for i in 0..t.len() {
        let (x, v) = update::<_, NESTEROV>(c, t.x.get(i).load(), t.g[i].load(), t.v.get(i).load());
        t.x.set(i, X::store(x));
        t.v.set(i, X::store(v));
    }
}

#[cfg(test)]
mod tests;
