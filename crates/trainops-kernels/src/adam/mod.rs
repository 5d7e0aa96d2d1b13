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

use crate::parallel::{run_chunked, Splittable};
use crate::simd::{detected, Level};
use crate::{Compute, Element, InOut, KernelError, Parallelism};

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

impl Default for AdamAttrs {
    fn default() -> Self {
        Self { alpha: 0.9, beta: 0.999, epsilon: 1e-6, norm_coefficient: 0.0, norm_coefficient_post: 0.0 }
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

/// One tensor of an Adam node: weights, gradient (already broadcast to the weights' shape),
/// first and second moments.
pub struct AdamTensor<'a, X, G> {
    /// Weights `X`, rewritten as `X_new`.
    pub x: InOut<'a, X>,
    /// Gradient `G`, one element per weight.
    pub g: &'a [G],
    /// First moment `V`, rewritten as `V_new`.
    pub v: InOut<'a, X>,
    /// Second moment `H`, rewritten as `H_new`.
    pub h: InOut<'a, X>,
}

impl<'a, X: Element, G: Element> AdamTensor<'a, X, G> {
    /// Checks that all four buffers have the weights' length.
    pub fn new(x: InOut<'a, X>, g: &'a [G], v: InOut<'a, X>, h: InOut<'a, X>) -> Result<Self, KernelError> {
        let n = x.len();
        for (what, got) in [("G", g.len()), ("V", v.len()), ("H", h.len())] {
            if got != n {
                return Err(KernelError::LengthMismatch { what, got, expected: n });
            }
        }
        Ok(Self { x, g, v, h })
    }
}

impl<X: Element, G: Element> Splittable for AdamTensor<'_, X, G> {
    fn len(&self) -> usize {
        self.x.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (x0, x1) = self.x.split_at(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (v0, v1) = self.v.split_at(mid);
        let (h0, h1) = self.h.split_at(mid);
        (Self { x: x0, g: g0, v: v0, h: h0 }, Self { x: x1, g: g1, v: v1, h: h1 })
    }
}

/// Elements per task when a node's work is spread over threads.
pub const CHUNK: usize = 1 << 15;
/// Below this many elements in a whole node, everything runs on the calling thread.
pub const SERIAL_BELOW: usize = 1 << 16;

/// One Adam step over every tensor of a node, with the [`detected`] kernel level. Each
/// element's result depends neither on how the work is split nor on the level, so the
/// output is bitwise identical for any `par` and any CPU.
pub fn step<X, G>(c: &AdamCoeffs<X::C>, tensors: Vec<AdamTensor<'_, X, G>>, par: &dyn Parallelism)
where
    X: AdamKernel<G>,
    G: Element<C = X::C>,
{
    step_with(detected(), c, tensors, par);
}

/// [`step`] with a given level (tests force each one the CPU has).
///
/// # Panics
/// When `level` is not available on this CPU.
pub fn step_with<X, G>(level: Level, c: &AdamCoeffs<X::C>, tensors: Vec<AdamTensor<'_, X, G>>, par: &dyn Parallelism)
where
    X: AdamKernel<G>,
    G: Element<C = X::C>,
{
    assert!(level.is_available(), "kernel level {level:?} is not available on this CPU");
    run_chunked(tensors, par, CHUNK, SERIAL_BELOW, |t| X::chunk(level, c, t));
}

/// Weight types with an Adam kernel for gradients of type `G`.
pub trait AdamKernel<G: Element>: Element {
    /// Updates one chunk with the kernel of `level` (available, checked by the caller).
    fn chunk(level: Level, c: &AdamCoeffs<Self::C>, t: AdamTensor<'_, Self, G>);
}

/// An `AdamKernel` impl for weights `$t` and gradients `$g`, with a kernel per SIMD level
/// (`None`: that level runs the portable kernel).
macro_rules! simd_adam {
    ($t:ty, $g:ty, avx512: $avx512:ident, avx2: $($avx2:ident)?) => {
        impl AdamKernel<$g> for $t {
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut, unused_variables))]
            fn chunk(level: Level, c: &AdamCoeffs<<$t as Element>::C>, mut t: AdamTensor<'_, $t, $g>) {
                #[cfg(target_arch = "x86_64")]
                {
                    let kernel = match level {
                        Level::Avx512 => Some(x86::$avx512 as unsafe fn(_, _, _)),
                        Level::Avx2 => None $(.or(Some(x86::$avx2 as unsafe fn(_, _, _))))?,
                        Level::Scalar => None,
                    };
                    if let Some(kernel) = kernel {
                        let n = t.len();
                        let p = x86::Ptrs { x: t.x.as_ptrs(), g: t.g.as_ptr(), v: t.v.as_ptrs(), h: t.h.as_ptrs() };
                        // SAFETY: the level is available (checked in `step_with`); the streams
                        // and the gradient all hold `n` elements (checked in `AdamTensor::new`),
                        // and an InOut's source is its destination or does not overlap it.
                        unsafe { kernel(c, p, n) };
                        return;
                    }
                }
                portable(c, t);
            }
        }
    };
}
simd_adam!(f32, f32, avx512: adam_f32_avx512, avx2: adam_f32_avx2);
simd_adam!(f64, f64, avx512: adam_f64_avx512, avx2: adam_f64_avx2);
simd_adam!(f32, half::f16, avx512: adam_f32_f16_avx512, avx2:);
simd_adam!(f32, half::bf16, avx512: adam_f32_bf16_avx512, avx2:);

/// 16-bit weights: the portable kernel on every level (converting in and out of `f32`).
macro_rules! portable_adam {
    ($t:ty) => {
        impl AdamKernel<$t> for $t {
            fn chunk(_level: Level, c: &AdamCoeffs<f32>, t: AdamTensor<'_, $t, $t>) {
                portable(c, t);
            }
        }
    };
}
portable_adam!(half::f16);
portable_adam!(half::bf16);

/// The portable kernel over one chunk.
fn portable<X: Element, G: Element<C = X::C>>(c: &AdamCoeffs<X::C>, mut t: AdamTensor<'_, X, G>) {
    for i in 0..t.len() {
        let (x, v, h) = update(c, t.x.get(i).load(), t.g[i].load(), t.v.get(i).load(), t.h.get(i).load());
        t.x.set(i, X::store(x));
        t.v.set(i, X::store(v));
        t.h.set(i, X::store(h));
    }
}

#[cfg(test)]
mod tests;
