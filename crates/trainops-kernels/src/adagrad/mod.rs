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

use crate::adam::{CHUNK, SERIAL_BELOW};
use crate::parallel::{run_chunked, Splittable};
use crate::{Compute, Element, InOut, KernelError, Parallelism};

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

impl Default for AdagradAttrs {
    fn default() -> Self {
        Self { decay_factor: 0.0, epsilon: 1e-6, norm_coefficient: 0.0 }
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

/// One tensor of an Adagrad node: weights, gradient (already broadcast to the weights'
/// shape) and accumulated squared gradient.
pub struct AdagradTensor<'a, X, G> {
    /// Weights `X`, rewritten as `X_new`.
    pub x: InOut<'a, X>,
    /// Gradient `G`, one element per weight.
    pub g: &'a [G],
    /// Accumulated squared gradient `H`, rewritten as `H_new`.
    pub h: InOut<'a, X>,
}

impl<'a, X: Element, G: Element> AdagradTensor<'a, X, G> {
    /// Checks that all three buffers have the weights' length.
    pub fn new(x: InOut<'a, X>, g: &'a [G], h: InOut<'a, X>) -> Result<Self, KernelError> {
        let n = x.len();
        for (what, got) in [("G", g.len()), ("H", h.len())] {
            if got != n {
                return Err(KernelError::LengthMismatch { what, got, expected: n });
            }
        }
        Ok(Self { x, g, h })
    }
}

impl<X: Element, G: Element> Splittable for AdagradTensor<'_, X, G> {
    fn len(&self) -> usize {
        self.x.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (x0, x1) = self.x.split_at(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (h0, h1) = self.h.split_at(mid);
        (Self { x: x0, g: g0, h: h0 }, Self { x: x1, g: g1, h: h1 })
    }
}

/// One Adagrad step over every tensor of a node, split into chunks like Adam's
/// ([`CHUNK`], [`SERIAL_BELOW`]). Each element's result does not depend on how the work is
/// split, so the output is bitwise identical for any `par`.
pub fn step<X, G>(c: &AdagradCoeffs<X::C>, tensors: Vec<AdagradTensor<'_, X, G>>, par: &dyn Parallelism)
where
    X: Element,
    G: Element<C = X::C>,
{
    run_chunked(tensors, par, CHUNK, SERIAL_BELOW, |t| chunk(c, t));
}

/// The kernel over one chunk (every element type: 16-bit ones compute in `f32`).
fn chunk<X: Element, G: Element<C = X::C>>(c: &AdagradCoeffs<X::C>, mut t: AdagradTensor<'_, X, G>) {
    for i in 0..t.len() {
        let (x, h) = update(c, t.x.get(i).load(), t.g[i].load(), t.h.get(i).load());
        t.x.set(i, X::store(x));
        t.h.set(i, X::store(h));
    }
}

#[cfg(test)]
mod tests;
