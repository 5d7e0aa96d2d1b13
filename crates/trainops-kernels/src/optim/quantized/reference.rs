//! The scalar reference of the 8-bit optimizers, for tests of the fast path: the dynamic
//! quantisation maps (bitsandbytes' `create_dynamic_map`, reimplemented), nearest-entry
//! quantisation by plain search, and each optimizer's step on whole slices, element by
//! element and block by block, written from the formulas in `super`'s documentation. It
//! shares no code with the fast path but the element conversions.

use super::adamw::AdamWAttrs;
use crate::optim::adam::AdamAttrs;
use crate::Element;

/// Elements per quantisation block (one scale each).
pub const BLOCK: usize = 256;

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8)`: 256
/// sorted float32 values in `[-1, 1]` (signed) or `[0, 1]` (unsigned).
///
/// For each exponent `i = 0..7`, `k_i` linear fraction values `10^(i - 6) * mean_j` where
/// `mean_j` are the midpoints of `linspace(0.1, 1, k_i + 1)` (`k_i = 2^i` signed, with
/// their negatives; `2^(i + 1)` unsigned), then `0` and `1`: 2 * 127 + 2 = 254 + 2 = 256
/// entries either way, sorted ascending. Every value is computed in `f64` and rounded once
/// to `f32` (bitsandbytes computes `linspace` and the means in torch's float32, which may
/// differ from these in the last bit of a few entries).
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for i in 0..7i32 {
        let items: usize = if signed { 1 << i } else { 1 << (i + 1) };
        // linspace(0.1, 1, items + 1): boundary b_j = 0.1 + 0.9 * j / items.
        let boundary = |j: usize| 0.1 + 0.9 * j as f64 / items as f64;
        let scale = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0][i as usize]; // 10^(i - 6)
        for j in 0..items {
            let mean = (boundary(j) + boundary(j + 1)) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    assert_eq!(data.len(), 256, "the 8-bit dynamic map has 256 entries");
    let mut map: Vec<f32> = data.iter().map(|&d| d as f32).collect();
    map.sort_by(f32::total_cmp);
    map.try_into().expect("256 entries")
}

/// The index of the entry of `map` (sorted ascending) nearest to `y`, the lower one on a
/// tie; `0` for NaN.
pub fn nearest(map: &[f32; 256], y: f32) -> u8 {
    if y.is_nan() {
        return 0;
    }
    // The first entry >= y (256 when none), by plain linear search.
    let above = map.iter().position(|&e| e >= y).unwrap_or(256);
    if above == 0 {
        return 0;
    }
    if above == 256 {
        return 255;
    }
    let (lo, hi) = (f64::from(map[above - 1]), f64::from(map[above]));
    let y = f64::from(y);
    // Neighbours of similar magnitude: both distances are exact in f64.
    if hi - y < y - lo {
        above as u8
    } else {
        (above - 1) as u8
    }
}

/// The absmax of a block: the largest `|v|`, NaN when any is NaN (and no NaN is ignored).
pub fn absmax(values: &[f32]) -> f32 {
    let mut best = 0.0f32;
    for &v in values {
        if v.is_nan() || best.is_nan() {
            best = f32::NAN;
        } else if v.abs() > best {
            best = v.abs();
        }
    }
    best
}

/// Blockwise quantisation of `values` with `map`: per block of [`BLOCK`] values, its absmax
/// `a` and the codes `nearest(v / a)` (`v / 1` for an all-zero block).
pub fn quantize(map: &[f32; 256], values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(values.len());
    let mut scales = Vec::new();
    for block in values.chunks(BLOCK) {
        let a = absmax(block);
        let d = if a == 0.0 { 1.0 } else { a };
        codes.extend(block.iter().map(|&v| nearest(map, v / d)));
        scales.push(a);
    }
    (codes, scales)
}

/// Blockwise dequantisation: `map[code] * absmax` of the code's block.
pub fn dequantize(map: &[f32; 256], codes: &[u8], scales: &[f32]) -> Vec<f32> {
    codes.iter().enumerate().map(|(i, &c)| map[usize::from(c)] * scales[i / BLOCK]).collect()
}

/// One tensor's 8-bit state: the moments' codes and scales.
#[derive(Debug, Clone, PartialEq)]
pub struct State8bit {
    /// First moment's codes (signed map).
    pub m_q: Vec<u8>,
    /// First moment's block scales.
    pub m_absmax: Vec<f32>,
    /// Second moment's codes (unsigned map).
    pub v_q: Vec<u8>,
    /// Second moment's block scales.
    pub v_absmax: Vec<f32>,
}

/// Adam8bit on one tensor: dequantise, ONNX Adam's update, requantise. Returns `X_new`
/// and the new state.
pub fn adam8bit<G: Element<C = f32>>(
    attrs: &AdamAttrs,
    r: f64,
    t: i64,
    x: &[f32],
    g: &[G],
    state: &State8bit,
) -> (Vec<f32>, State8bit) {
    let c = |value: f64| value as f32;
    let (alpha, beta) = (f64::from(attrs.alpha), f64::from(attrs.beta));
    let r_adjusted = if t > 0 { r * (1.0 - beta.powf(t as f64)).sqrt() / (1.0 - alpha.powf(t as f64)) } else { r };
    step_8bit(x, g, state, |xi, gi, m, v| {
        let g_regularized = c(f64::from(attrs.norm_coefficient)) * xi + gi;
        let m_new = c(alpha) * m + c(1.0 - alpha) * g_regularized;
        let v_new = c(beta) * v + c(1.0 - beta) * (g_regularized * g_regularized);
        let x_new = xi - c(r_adjusted) * (m_new / (v_new.sqrt() + c(f64::from(attrs.epsilon))));
        (c(1.0 - f64::from(attrs.norm_coefficient_post)) * x_new, m_new, v_new)
    })
}

/// AdamW8bit on one tensor: dequantise, PyTorch AdamW's update, requantise.
pub fn adamw8bit<G: Element<C = f32>>(
    attrs: &AdamWAttrs,
    lr: f64,
    t: i64,
    x: &[f32],
    g: &[G],
    state: &State8bit,
) -> (Vec<f32>, State8bit) {
    let c = |value: f64| value as f32;
    let (b1, b2) = (f64::from(attrs.beta1), f64::from(attrs.beta2));
    let (bias1, bias2) = if t > 0 { (1.0 - b1.powf(t as f64), 1.0 - b2.powf(t as f64)) } else { (1.0, 1.0) };
    let weight = c(1.0 - b1);
    step_8bit(x, g, state, |xi, gi, m, v| {
        let gi = if attrs.maximize { -gi } else { gi };
        // param.mul_(1 - lr * weight_decay)
        let xi = xi * c(1.0 - lr * f64::from(attrs.weight_decay));
        // exp_avg.lerp_(grad, 1 - beta1), torch's two-sided lerp
        let m_new = if weight.abs() < 0.5 { m + weight * (gi - m) } else { gi - (gi - m) * (1.0 - weight) };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let v_new = v * c(b2) + c(1.0 - b2) * gi * gi;
        // denom = exp_avg_sq.sqrt() / sqrt(bias_correction2) + eps
        let denom = v_new.sqrt() / c(bias2.sqrt()) + attrs.epsilon;
        // param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        let x_new = xi - c(lr / bias1) * m_new / denom;
        (x_new, m_new, v_new)
    })
}

/// Dequantise the state, apply `update(x, g, m, v) -> (x', m', v')` to every element and
/// requantise the new moments.
fn step_8bit<G: Element<C = f32>>(
    x: &[f32],
    g: &[G],
    state: &State8bit,
    update: impl Fn(f32, f32, f32, f32) -> (f32, f32, f32),
) -> (Vec<f32>, State8bit) {
    let (signed, unsigned) = (dynamic_map(true), dynamic_map(false));
    let m = dequantize(&signed, &state.m_q, &state.m_absmax);
    let v = dequantize(&unsigned, &state.v_q, &state.v_absmax);
    let (mut xs, mut ms, mut vs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..x.len() {
        let (xi, mi, vi) = update(x[i], g[i].load(), m[i], v[i]);
        xs.push(xi);
        ms.push(mi);
        vs.push(vi);
    }
    let (m_q, m_absmax) = quantize(&signed, &ms);
    let (v_q, v_absmax) = quantize(&unsigned, &vs);
    (xs, State8bit { m_q, m_absmax, v_q, v_absmax })
}
