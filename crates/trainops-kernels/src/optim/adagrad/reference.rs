//! The scalar reference of Adagrad, written line by line from onnx's
//! `reference/ops/aionnx_preview_training/op_adagrad.py` on whole slices, for tests of the
//! fast path. It shares no code with it but the element conversions.

use super::AdagradAttrs;
use crate::{Compute, Element};

/// Returns `(X_new, H_new)` for one tensor; `g` already has the weights' shape.
pub fn adagrad<X: Element, G: Element<C = X::C>>(
    attrs: &AdagradAttrs,
    r: f64,
    t: i64,
    x: &[X],
    g: &[G],
    h: &[X],
) -> (Vec<X>, Vec<X>) {
    let c = |value: f64| X::C::from_f64(value);
    // r_ = r / (1 + t * decay_factor)
    let r_ = r / (1.0 + t as f64 * f64::from(attrs.decay_factor));
    let (mut xs, mut hs) = (Vec::with_capacity(x.len()), Vec::with_capacity(x.len()));
    for i in 0..x.len() {
        let (xi, gi, hi) = (x[i].load(), g[i].load(), h[i].load());
        // g_regularized = norm_coefficient * x + g
        let g_regularized = c(f64::from(attrs.norm_coefficient)) * xi + gi;
        // h_new = h + g_regularized * g_regularized
        let h_new = hi + g_regularized * g_regularized;
        // h_sqrt = np.sqrt(h_new) + epsilon
        let h_sqrt = h_new.sqrt() + c(f64::from(attrs.epsilon));
        // x_new = x - r_ * g_regularized / h_sqrt   (Python: (r_ * g_regularized) / h_sqrt)
        let x_new = xi - (c(r_) * g_regularized) / h_sqrt;
        xs.push(X::store(x_new));
        hs.push(X::store(h_new));
    }
    (xs, hs)
}
