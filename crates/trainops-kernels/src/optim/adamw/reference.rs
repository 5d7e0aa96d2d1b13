//! The scalar reference of AdamW, written line by line from torch 2.x's
//! `torch.optim.adam._single_tensor_adam` (`decoupled_weight_decay=True`) and the CPU
//! kernels its tensor operations run (`lerp_`, `mul_`, `addcmul_`, `sqrt`, `div`, `add_`,
//! `addcdiv_`, `maximum`), on whole slices, for tests of the fast paths. It shares no code
//! with them but the element conversions and `Compute`'s primitives.

use super::AdamWAttrs;
use crate::{Compute, Element};

/// Returns `(X_new, M_new, V_new, Vmax_new)` for one tensor (`Vmax` when `vmax` is given:
/// amsgrad); `g` already has the weights' shape; `t` is torch's step (1 on the first update).
#[allow(clippy::too_many_arguments)]
pub fn adamw<X: Element, G: Element<C = X::C>>(
    attrs: &AdamWAttrs,
    lr: f64,
    t: i64,
    param: &[X],
    grads: &[G],
    exp_avg: &[X],
    exp_avg_sq: &[X],
    max_exp_avg_sq: Option<&[X]>,
) -> (Vec<X>, Vec<X>, Vec<X>, Option<Vec<X>>) {
    // A Python float given to a kernel of this compute type (`Scalar::to<opmath_t>`).
    let scalar = |value: f64| X::C::from_f64(value);
    let AdamWAttrs { beta1, beta2, epsilon: eps, weight_decay, maximize } = *attrs;
    // step = _get_value(step_t); the Python-float scalars of the step.
    let step = t as f64;
    let bias_correction1 = 1.0 - beta1.powf(step);
    let bias_correction2 = 1.0 - beta2.powf(step);
    let step_size = lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.powf(core::hint::black_box(0.5));
    // lerp_scalar_kernel: weight_val = weight.to<scalar_t>(); lerp_vec's branch and fmadd.
    let weight = scalar(1.0 - beta1);
    let one = scalar(1.0);
    let lerp = |start: X::C, end: X::C| {
        if weight < scalar(0.5) && weight > scalar(-0.5) {
            weight.mul_add(end - start, start)
        } else {
            (weight - one).mul_add(end - start, end)
        }
    };
    let (mut xs, mut ms, mut vs, mut maxs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..param.len() {
        // grad = grads[i] if not maximize else -grads[i]
        let mut grad = grads[i].load();
        if maximize {
            grad = -grad;
        }
        let mut p = param[i].load();
        // if weight_decay != 0: param.mul_(1 - lr * weight_decay)
        if weight_decay != 0.0 {
            p = p * scalar(1.0 - lr * weight_decay);
        } else {
            // torch skips the product; `p * 1` is `p` but for a signalling NaN, which it
            // quiets as the fast path (which always multiplies) does.
            p = p * one;
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        let m = lerp(exp_avg[i].load(), grad);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2):
        // addcmul's `self + value * t1 * t2`, contracted to fma(value * t1, t2, self).
        let v = exp_avg_sq[i].load() * scalar(beta2);
        let v = (scalar(1.0 - beta2) * grad).mul_add(grad, v);
        // amsgrad: torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
        let second = match max_exp_avg_sq {
            Some(maxes) => {
                let old = maxes[i].load();
                #[allow(clippy::eq_op)]
                let max = if old != old || old > v { old } else { v };
                maxs.push(X::store(max));
                max
            }
            None => v,
        };
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = second.sqrt() / scalar(bias_correction2_sqrt) + scalar(eps);
        // param.addcdiv_(exp_avg, denom, value=-step_size): self + value * t1 / t2, written
        // as the same subtraction (the same bits: rounding is symmetric in sign), whose
        // operands the compiler does not swap (so which NaN comes out is fixed).
        let p = p - scalar(step_size) * m / denom;
        xs.push(X::store(p));
        ms.push(X::store(m));
        vs.push(X::store(v));
    }
    (xs, ms, vs, max_exp_avg_sq.map(|_| maxs))
}
