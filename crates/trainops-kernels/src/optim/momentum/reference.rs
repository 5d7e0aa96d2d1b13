//! The scalar reference of Momentum, written line by line from onnx's
//! `reference/ops/aionnx_preview_training/op_momentum.py` (`_apply_momentum`,
//! `_apply_nesterov`) on whole slices, for tests of the fast path. It shares no code with it
//! but the element conversions and the mode enum.

use super::{MomentumAttrs, MomentumMode};
use crate::{Compute, Element};

/// Returns `(X_new, V_new)` for one tensor; `g` already has the weights' shape.
pub fn momentum<X: Element, G: Element<C = X::C>>(
    attrs: &MomentumAttrs,
    r: f64,
    t: i64,
    x: &[X],
    g: &[G],
    v: &[X],
) -> (Vec<X>, Vec<X>) {
    let c = |value: f64| X::C::from_f64(value);
    let (alpha, norm) = (c(f64::from(attrs.alpha)), c(f64::from(attrs.norm_coefficient)));
    // beta_adjusted = beta if t > 0 else 1
    let beta_adjusted = if t > 0 { c(f64::from(attrs.beta)) } else { c(1.0) };
    let r = c(r);
    let (mut xs, mut vs) = (Vec::with_capacity(x.len()), Vec::with_capacity(x.len()));
    for i in 0..x.len() {
        let (xi, gi, vi) = (x[i].load(), g[i].load(), v[i].load());
        // g_regularized = norm_coefficient * x + g
        let g_regularized = norm * xi + gi;
        // v_new = alpha * v + beta_adjusted * g_regularized
        let v_new = alpha * vi + beta_adjusted * g_regularized;
        let x_new = match attrs.mode {
            // x_new = x - r * v_new
            MomentumMode::Standard => xi - r * v_new,
            // x_new = x - r * (g_regularized + alpha * v_new)
            MomentumMode::Nesterov => xi - r * (g_regularized + alpha * v_new),
        };
        xs.push(X::store(x_new));
        vs.push(X::store(v_new));
    }
    (xs, vs)
}
