//! The scalar reference of the bfloat16-state optimizers, for tests of the fast paths: the
//! random words from Philox's own reference, the rounding written as a comparison of the
//! random bits with the value's low bits (as torchao writes it; with the threshold at the
//! top, which is where adding the bits carries) plus this crate's special cases, and the update from Adam's and AdamW's scalar references on the widened moments.
//! It shares no code with the fast path but the element conversions.

use half::bf16;

use crate::optim::adam::{reference::adam, AdamAttrs};
use crate::optim::adamw::{reference::adamw, AdamWAttrs};
use crate::random::philox::reference as philox;
use crate::Element;

/// `x` rounded to bfloat16 with the 16 random bits `r`: away from zero when `r >= 2^16 - f`
/// (`f` the low 16 bits of `x`: probability `f / 2^16`), else toward zero; NaN to its quiet NaN, a finite value never to
/// infinity (`±bfloat16::MAX` instead).
pub fn round(x: f32, r: u16) -> bf16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return bf16::from_bits((bits >> 16) as u16 | 0x0040);
    }
    let toward_zero = (bits >> 16) as u16;
    let fraction = bits & 0xffff;
    let rounded = if u32::from(r) >= 0x1_0000 - fraction { toward_zero + 1 } else { toward_zero };
    let out = bf16::from_bits(rounded);
    if x.is_finite() && out.is_infinite() {
        return if x > 0.0 { bf16::MAX } else { bf16::MIN };
    }
    out
}

/// The random word of each of `n` elements of tensor `tensor` (0-based) in a node with
/// `seed` at update count `t`: Philox's stream of state `[0, 0, t mod 2^32, tensor, seed
/// low, seed high]`.
pub fn words(seed: i64, t: i64, tensor: u32, n: usize) -> Vec<u32> {
    let s = seed as u64;
    let state = [0, 0, t as u32, tensor, s as u32, (s >> 32) as u32];
    let mut out = vec![0u32; n];
    philox::fill(&state, &mut out);
    out
}

/// The moments widened, updated moments rounded with `words`: low halves for `m`, high
/// halves for `v`.
fn round_all(m: &[f32], v: &[f32], words: &[u32]) -> (Vec<bf16>, Vec<bf16>) {
    let m = m.iter().zip(words).map(|(&m, &w)| round(m, w as u16)).collect();
    let v = v.iter().zip(words).map(|(&v, &w)| round(v, (w >> 16) as u16)).collect();
    (m, v)
}

fn widened(m: &[bf16]) -> Vec<f32> {
    m.iter().map(|b| b.to_f32()).collect()
}

/// `AdamBf16State` on one tensor (index `tensor` in its node): `(X_new, M_new, V_new)`.
#[allow(clippy::too_many_arguments)]
pub fn adam_bf16<G: Element<C = f32>>(
    attrs: &AdamAttrs,
    r: f64,
    t: i64,
    seed: i64,
    tensor: u32,
    x: &[f32],
    g: &[G],
    m: &[bf16],
    v: &[bf16],
) -> (Vec<f32>, Vec<bf16>, Vec<bf16>) {
    let (x, m, v) = adam(attrs, r, t, x, g, &widened(m), &widened(v));
    let (m, v) = round_all(&m, &v, &words(seed, t, tensor, x.len()));
    (x, m, v)
}

/// `AdamWBf16State` on one tensor (index `tensor` in its node): `(X_new, M_new, V_new)`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_bf16<G: Element<C = f32>>(
    attrs: &AdamWAttrs,
    lr: f64,
    t: i64,
    seed: i64,
    tensor: u32,
    x: &[f32],
    g: &[G],
    m: &[bf16],
    v: &[bf16],
) -> (Vec<f32>, Vec<bf16>, Vec<bf16>) {
    let (x, m, v, _) = adamw(attrs, lr, t, x, g, &widened(m), &widened(v), None);
    let (m, v) = round_all(&m, &v, &words(seed, t, tensor, x.len()));
    (x, m, v)
}
