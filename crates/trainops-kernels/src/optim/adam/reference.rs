//! The scalar reference of Adam, written line by line from onnx's
//! `reference/ops/aionnx_preview_training/op_adam.py` on whole slices, for tests of the fast
//! paths. It shares no code with them but the element conversions.

use super::AdamAttrs;
use crate::{Compute, Element};

/// Returns `(X_new, V_new, H_new)` for one tensor; `g` already has the weights' shape.
pub fn adam<X: Element, G: Element<C = X::C>>(
    attrs: &AdamAttrs,
    r: f64,
    t: i64,
    x: &[X],
    g: &[G],
    v: &[X],
    h: &[X],
) -> (Vec<X>, Vec<X>, Vec<X>) {
    adam_unscaled(attrs, r, t, None, x, g, v, h)
}

/// [`adam`] on `G / loss_scale` (computed in the compute type) when `loss_scale` is given.
#[allow(clippy::too_many_arguments)]
pub fn adam_unscaled<X: Element, G: Element<C = X::C>>(
    attrs: &AdamAttrs,
    r: f64,
    t: i64,
    loss_scale: Option<X::C>,
    x: &[X],
    g: &[G],
    v: &[X],
    h: &[X],
) -> (Vec<X>, Vec<X>, Vec<X>) {
    let c = |value: f64| X::C::from_f64(value);
    let (alpha, beta) = (f64::from(attrs.alpha), f64::from(attrs.beta));
    // r_adjusted = r * sqrt(1 - beta**t) / (1 - alpha**t) if t > 0 else r
    let r_adjusted = if t > 0 { r * (1.0 - beta.powf(t as f64)).sqrt() / (1.0 - alpha.powf(t as f64)) } else { r };
    let (mut xs, mut vs, mut hs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..x.len() {
        let (xi, vi, hi) = (x[i].load(), v[i].load(), h[i].load());
        // g = G / loss_scale (MixedPrecisionAdam), else G.
        let gi = loss_scale.map_or(g[i].load(), |s| g[i].load() / s);
        let g_regularized = c(f64::from(attrs.norm_coefficient)) * xi + gi;
        let v_new = c(alpha) * vi + c(1.0 - alpha) * g_regularized;
        let h_new = c(beta) * hi + c(1.0 - beta) * (g_regularized * g_regularized);
        let h_sqrt = h_new.sqrt() + c(f64::from(attrs.epsilon));
        let x_new = xi - c(r_adjusted) * (v_new / h_sqrt);
        let x_final = c(1.0 - f64::from(attrs.norm_coefficient_post)) * x_new;
        xs.push(X::store(x_final));
        vs.push(X::store(v_new));
        hs.push(X::store(h_new));
    }
    (xs, vs, hs)
}
