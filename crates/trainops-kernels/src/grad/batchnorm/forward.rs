//! The forward of BatchNormalization in training mode (ONNX `BatchNormalization` with
//! `training_mode=1`): `(X, scale, B, input_mean, input_var; epsilon, momentum) -> (Y,
//! running_mean, running_var)` over `X` of shape `[N, C, spatial...]`, every axis but 1
//! reduced. onnxruntime's own CPU kernel for it runs on one thread; this one cuts the
//! channels into the same tasks as the backward.
//!
//! Per channel `c`, with `n = N * prod(spatial)` elements, the batch `mean` and the biased
//! `var` of `X[:, c]` (ONNX's definition):
//!
//! ```text
//! Y            = (X - mean) / sqrt(var + epsilon) * scale + B
//! running_mean = input_mean * momentum + mean * (1 - momentum)
//! running_var  = input_var * momentum + var * (1 - momentum)
//! ```
//!
//! The statistics come from two passes with `f64` accumulators (the sum, then `sum((X -
//! mean)^2)`: no cancellation), the running statistics in `f64` rounded once; a third pass
//! writes `Y = (X - m) * k + B` in `f32` with per-channel `m = mean` and `k = scale * rstd`
//! rounded to `f32`. No fused multiply-add is formed, and each channel's sums run in one
//! task in a fixed order, so the bits depend neither on the [`Parallelism`] nor on the SIMD
//! level. Error bound (tested here against the `f64` [`reference`](mod@reference) and in
//! `tests/test_batchnorm_train_op.py` against numpy in float64), with `a = 2^-30 mean(|X|)`
//! and `q = 2^-30 mean((X - mean)^2)` the float64 sums' error (each sum adds `N` terms per
//! position, then `S` positions in four partial sums: within `(N + S/4 + 2) 2^-53` of the
//! terms' magnitudes, below `2^-30` of them while `N + S/4 < 2^23`): every element of `Y`
//! is within `4 * 2^-24 * (|k| (|X - mean| + |mean|) + |B|) + 2 |k| a` of the exact value
//! (a mean off by `a` moves `X - mean` by `a`; the variance's `q` moves `k` by far less);
//! the running mean within `2^-24 |exact| + 2^-30 |input| momentum + (1 - momentum) a`, the
//! running variance within `2^-24 |exact| + 2^-30 |input| momentum + (1 - momentum) 2 q`.

use super::{at_level, fold, group_width, BnShape, BN_SERIAL_BELOW, LONG_ROW};
use crate::parallel::{for_each_item, Parallelism, Sequential};
use crate::simd::{detected, Isa, Level};
use crate::KernelError;

/// The per-channel inputs besides `X`, each of `C` elements.
#[derive(Debug, Clone, Copy)]
pub struct BnParams<'a> {
    /// `scale` (gamma).
    pub scale: &'a [f32],
    /// `B` (beta).
    pub bias: &'a [f32],
    /// The running mean before the step.
    pub input_mean: &'a [f32],
    /// The running variance before the step.
    pub input_var: &'a [f32],
    /// Added to the variance before its square root.
    pub epsilon: f32,
    /// The running statistics' weight of their old value.
    pub momentum: f32,
}

/// The outputs: `Y` always, each running statistic left out when `None`.
#[derive(Debug)]
pub struct BnOutputs<'a> {
    /// `Y`, shaped as `X`.
    pub y: &'a mut [f32],
    /// The updated running mean, `C` elements.
    pub running_mean: Option<&'a mut [f32]>,
    /// The updated running variance, `C` elements.
    pub running_var: Option<&'a mut [f32]>,
}

/// Training-mode BatchNormalization (see the module text) with the widest SIMD level of
/// this CPU.
pub fn batch_norm_train(
    x: &[f32],
    p: BnParams<'_>,
    shape: BnShape,
    out: BnOutputs<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    batch_norm_train_at(detected(), x, p, shape, out, par)
}

/// [`batch_norm_train`] at SIMD level `level` (the widest available one at most).
pub fn batch_norm_train_at(
    level: Level,
    x: &[f32],
    p: BnParams<'_>,
    shape: BnShape,
    out: BnOutputs<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    check(x, &p, shape, &out)?;
    if shape.is_empty() {
        // No channel, or no element per channel: Y is empty and the batch statistics are
        // undefined, NaN as numpy's mean of nothing (so are the running ones). Nothing else
        // is sized (the other dimensions may be huge beside the zero). The onnxruntime op
        // refuses an X with no element per channel first.
        let BnOutputs { running_mean, running_var, .. } = out;
        running_mean.into_iter().chain(running_var).for_each(|d| d.fill(f32::NAN));
        return Ok(());
    }
    let serial;
    let par = if shape.len() < BN_SERIAL_BELOW {
        serial = Sequential;
        &serial as &dyn Parallelism
    } else {
        par
    };
    let gs = groups(shape, out);
    let cx = Inputs { x, p, shape };
    let isa = level.isa().unwrap_or(Isa::Scalar);
    for_each_item(par, gs, |g| {
        at_level(
            isa,
            #[inline(always)]
            || run_group(&cx, g),
        )
    });
    Ok(())
}

fn check(x: &[f32], p: &BnParams<'_>, sh: BnShape, out: &BnOutputs<'_>) -> Result<(), KernelError> {
    let len = |what, got: usize, expected| {
        if got == expected {
            Ok(())
        } else {
            Err(KernelError::LengthMismatch { what, got, expected })
        }
    };
    len("X", x.len(), sh.len())?;
    len("Y", out.y.len(), sh.len())?;
    for (what, v) in [("scale", p.scale), ("B", p.bias), ("input_mean", p.input_mean), ("input_var", p.input_var)] {
        len(what, v.len(), sh.c)?;
    }
    if let Some(d) = &out.running_mean {
        len("running_mean", d.len(), sh.c)?;
    }
    if let Some(d) = &out.running_var {
        len("running_var", d.len(), sh.c)?;
    }
    Ok(())
}

struct Inputs<'a> {
    x: &'a [f32],
    p: BnParams<'a>,
    shape: BnShape,
}

/// One task: channels `c0 .. c0 + width`, with their pieces of the outputs (`y[k]`: the
/// group's elements of sample `k`).
struct Group<'a> {
    c0: usize,
    width: usize,
    y: Vec<&'a mut [f32]>,
    mean: Option<&'a mut [f32]>,
    var: Option<&'a mut [f32]>,
}

/// The outputs cut into tasks as the backward cuts them ([`group_width`] channels).
fn groups(sh: BnShape, out: BnOutputs<'_>) -> Vec<Group<'_>> {
    let width = group_width(sh);
    let count = sh.c.div_ceil(width);
    let mut gs: Vec<Group<'_>> = (0..count)
        .map(|k| {
            let c0 = k * width;
            Group { c0, width: width.min(sh.c - c0), y: Vec::with_capacity(sh.n), mean: None, var: None }
        })
        .collect();
    if sh.c * sh.s > 0 {
        for row in out.y.chunks_mut(sh.c * sh.s) {
            for (g, piece) in gs.iter_mut().zip(row.chunks_mut(width * sh.s)) {
                g.y.push(piece);
            }
        }
    }
    if let Some(d) = out.running_mean {
        gs.iter_mut().zip(d.chunks_mut(width)).for_each(|(g, p)| g.mean = Some(p));
    }
    if let Some(d) = out.running_var {
        gs.iter_mut().zip(d.chunks_mut(width)).for_each(|(g, p)| g.var = Some(p));
    }
    gs
}

/// Positions whose accumulators [`sums`] keeps in registers across the samples.
const BLOCK: usize = 32;

/// For every position `j < w`: `acc[j] = sum_n f(x_n[j], m[j])`, `x_n` = `rows(n)`, summed
/// over the samples in order from 0 (blocks of [`BLOCK`] positions in registers, the tail
/// in memory: the same order either way).
#[inline(always)]
fn sums<'a>(
    samples: usize,
    acc: &mut [f64],
    m: &[f64],
    rows: impl Fn(usize) -> &'a [f32],
    f: impl Fn(f64, f64) -> f64,
) {
    let w = acc.len();
    let full = w - w % BLOCK;
    for j0 in (0..full).step_by(BLOCK) {
        let mut s = [0f64; BLOCK];
        let mj: &[f64; BLOCK] = m[j0..j0 + BLOCK].try_into().expect("a block");
        for n in 0..samples {
            let x: &[f32; BLOCK] = rows(n)[j0..j0 + BLOCK].try_into().expect("a block");
            for k in 0..BLOCK {
                s[k] += f(f64::from(x[k]), mj[k]);
            }
        }
        acc[j0..j0 + BLOCK].copy_from_slice(&s);
    }
    let tail = &mut acc[full..];
    tail.fill(0.0);
    for n in 0..samples {
        let x = &rows(n)[full..w];
        for ((a, &x), &m) in tail.iter_mut().zip(x).zip(&m[full..w]) {
            *a += f(f64::from(x), m);
        }
    }
}

/// One group's work: its channels' rows of one sample are contiguous (`w = width * S`
/// elements), summed with one accumulator per position over the samples, a channel's sum
/// then its `S` accumulators in a fixed order ([`fold`]).
#[inline(always)]
fn run_group<'a>(cx: &Inputs<'a>, mut g: Group<'_>) {
    let sh = cx.shape;
    let (c0, width) = (g.c0, g.width);
    let w = width * sh.s;
    let count = (sh.n * sh.s) as f64;
    let block = move |n: usize| -> &'a [f32] {
        let at = (n * sh.c + c0) * sh.s;
        &cx.x[at..at + w]
    };
    let per_channel = |acc: &[f64]| -> Vec<f64> { (0..width).map(|k| fold(&acc[k * sh.s..(k + 1) * sh.s])).collect() };
    let mut acc = vec![0f64; w];
    let mut at = vec![0f64; w];
    sums(sh.n, &mut acc, &at, block, |x, _| x);
    let mean: Vec<f64> = per_channel(&acc).into_iter().map(|v| v / count).collect();
    for (k, &m) in mean.iter().enumerate() {
        at[k * sh.s..(k + 1) * sh.s].fill(m);
    }
    sums(sh.n, &mut acc, &at, block, |x, m| (x - m) * (x - m));
    let var: Vec<f64> = per_channel(&acc).into_iter().map(|v| v / count).collect();
    let momentum = f64::from(cx.p.momentum);
    let p = &cx.p;
    for k in 0..width {
        let c = c0 + k;
        if let Some(d) = g.mean.as_deref_mut() {
            d[k] = (f64::from(p.input_mean[c]) * momentum + mean[k] * (1.0 - momentum)) as f32;
        }
        if let Some(d) = g.var.as_deref_mut() {
            d[k] = (f64::from(p.input_var[c]) * momentum + var[k] * (1.0 - momentum)) as f32;
        }
    }
    let coef: Vec<(f32, f32, f32)> = (0..width)
        .map(|k| {
            let rstd = 1.0 / (var[k] + f64::from(p.epsilon)).sqrt();
            (mean[k] as f32, (f64::from(p.scale[c0 + k]) * rstd) as f32, p.bias[c0 + k])
        })
        .collect();
    if sh.s >= LONG_ROW {
        for (n, out) in g.y.iter_mut().enumerate() {
            for (o, (x, &(m, k, b))) in out.chunks_mut(sh.s).zip(block(n).chunks(sh.s).zip(&coef)) {
                for (o, &x) in o.iter_mut().zip(x) {
                    *o = (x - m) * k + b;
                }
            }
        }
    } else {
        // Short rows: the coefficients spread over the element positions of a sample's row.
        let spread = |f: fn(&(f32, f32, f32)) -> f32| -> Vec<f32> {
            coef.iter().flat_map(|c| std::iter::repeat_n(f(c), sh.s)).collect()
        };
        let (m, k, b) = (spread(|c| c.0), spread(|c| c.1), spread(|c| c.2));
        for (n, out) in g.y.iter_mut().enumerate() {
            for ((o, &x), ((&m, &k), &b)) in out.iter_mut().zip(block(n)).zip(m.iter().zip(&k).zip(&b)) {
                *o = (x - m) * k + b;
            }
        }
    }
}

/// The plain scalar reference, straight from the formula, in `f64` throughout (tests only).
pub mod reference {
    use super::{BnParams, BnShape};

    /// `(Y, running_mean, running_var)` of training-mode BatchNormalization, each element
    /// computed in `f64` and rounded once.
    pub fn batch_norm_train(x: &[f32], p: BnParams<'_>, sh: BnShape) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (mut y, mut rm, mut rv) = (vec![0f32; sh.len()], vec![0f32; sh.c], vec![0f32; sh.c]);
        let at = |n: usize, c: usize, s: usize| (n * sh.c + c) * sh.s + s;
        let cnt = (sh.n * sh.s) as f64;
        let f = f64::from;
        for c in 0..sh.c {
            let all = || (0..sh.n).flat_map(move |n| (0..sh.s).map(move |s| at(n, c, s)));
            let mean = all().map(|i| f(x[i])).sum::<f64>() / cnt;
            let var = all().map(|i| (f(x[i]) - mean).powi(2)).sum::<f64>() / cnt;
            let rstd = 1.0 / (var + f(p.epsilon)).sqrt();
            for i in all() {
                y[i] = ((f(x[i]) - mean) * rstd * f(p.scale[c]) + f(p.bias[c])) as f32;
            }
            rm[c] = (f(p.input_mean[c]) * f(p.momentum) + mean * (1.0 - f(p.momentum))) as f32;
            rv[c] = (f(p.input_var[c]) * f(p.momentum) + var * (1.0 - f(p.momentum))) as f32;
        }
        (y, rm, rv)
    }
}

#[cfg(test)]
mod tests;
