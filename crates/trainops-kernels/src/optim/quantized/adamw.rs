//! PyTorch AdamW's update of one element (`torch.optim.AdamW`, single-tensor path), for the
//! 8-bit and bfloat16-state ops:
//!
//! ```text
//! g  = maximize ? -g : g
//! x  = x * (1 - lr * weight_decay)                      # decoupled decay
//! m' = lerp(m, g, 1 - beta1)                             # torch's two-sided lerp
//! v' = v * beta2 + (1 - beta2) * g * g
//! x' = x - (lr / (1 - beta1^T)) * m' / (sqrt(v') / sqrt(1 - beta2^T) + epsilon)
//! ```
//! with `lerp(a, b, w) = |w| < 0.5 ? a + w * (b - a) : b - (b - a) * (1 - w)` and, when
//! `T <= 0`, no bias correction (ONNX Adam's guard). Scalars are formed in `f64` once per
//! call and rounded to `f32`, as PyTorch does with its Python floats.

use crate::optim::adam::{update as adam_update, AdamCoeffs};

/// The attributes of AdamW, with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWAttrs {
    /// Coefficient of the running gradient average.
    pub beta1: f32,
    /// Coefficient of the running squared-gradient average.
    pub beta2: f32,
    /// Added to the bias-corrected `sqrt(v')`.
    pub epsilon: f32,
    /// Decoupled weight decay (multiplied by the learning rate).
    pub weight_decay: f32,
    /// Maximise the objective (the gradient's sign is flipped).
    pub maximize: bool,
}

impl AdamWAttrs {
    /// PyTorch's defaults, as float32 (a constant, for the tables of attributes that need
    /// one).
    pub const DEFAULT: Self = Self { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.01, maximize: false };
}

impl Default for AdamWAttrs {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// AdamW's per-call scalars, in `f32`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWCoeffs {
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// The lerp weight `1 - beta1`.
    pub weight: f32,
    /// `1 - weight` (the lerp's other side).
    pub one_minus_weight: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `lr / (1 - beta1^T)`.
    pub step: f32,
    /// `sqrt(1 - beta2^T)`.
    pub bias2_sqrt: f32,
    /// `epsilon`.
    pub epsilon: f32,
    /// Flip the gradient's sign.
    pub maximize: bool,
}

impl AdamWCoeffs {
    /// The coefficients of one call with learning rate `lr` and step `t`.
    pub fn new(a: &AdamWAttrs, lr: f64, t: i64) -> Self {
        let (b1, b2) = (f64::from(a.beta1), f64::from(a.beta2));
        let (bias1, bias2) = if t > 0 { (1.0 - b1.powf(t as f64), 1.0 - b2.powf(t as f64)) } else { (1.0, 1.0) };
        let weight = (1.0 - b1) as f32;
        Self {
            decay: (1.0 - lr * f64::from(a.weight_decay)) as f32,
            weight,
            one_minus_weight: 1.0 - weight,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            step: (lr / bias1) as f32,
            bias2_sqrt: bias2.sqrt() as f32,
            epsilon: a.epsilon,
            maximize: a.maximize,
        }
    }
}

/// One element's update `(x, g, m, v) -> (x', m', v')`, the same for every state format.
pub trait Rule: Copy + Send + Sync + 'static {
    /// The update; `m` and `v` are the dequantised moments.
    fn update(&self, x: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32);
}

impl Rule for AdamWCoeffs {
    #[inline(always)]
    fn update(&self, x: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let g = if self.maximize { -g } else { g };
        let x = x * self.decay;
        let m = if self.weight.abs() < 0.5 { m + self.weight * (g - m) } else { g - (g - m) * self.one_minus_weight };
        let v = v * self.beta2 + self.one_minus_beta2 * g * g;
        let denom = v.sqrt() / self.bias2_sqrt + self.epsilon;
        (x - self.step * m / denom, m, v)
    }
}

/// ONNX Adam's update (`optim::adam`), on dequantised moments.
impl Rule for AdamCoeffs<f32> {
    #[inline(always)]
    fn update(&self, x: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        adam_update(self, x, g, m, v)
    }
}
