//! The backward of BatchNormalization in training mode (batch statistics, as PyTorch's
//! `model.train()`): `(dY, X, scale, eps) -> (dX, dScale, dBias)` over `X` of shape
//! `[N, C, spatial...]`, every axis but 1 reduced.
//!
//! Per channel `c`, with `n = N * prod(spatial)` elements, `mean` and the biased `var` of
//! `X[:, c]`, `rstd = 1 / sqrt(var + eps)` and `xhat = (X - mean) * rstd`:
//!
//! ```text
//! dBias[c]  = sum(dY)
//! dScale[c] = sum(dY * xhat)
//! dX        = scale[c] * rstd * (dY - dBias[c] / n - xhat * dScale[c] / n)
//! ```
//!
//! The statistics are recomputed (ONNX's training-mode BatchNormalization outputs the
//! running statistics, not the batch ones) in two passes with `f64` accumulators: the mean
//! and `sum(dY)`, then `sum((X - mean)^2)` and `sum(dY * (X - mean))`; a third pass writes
//! `dX = k * ((dY - mean(dY)) - p * (X - mean))` in `f32` with per-channel `f32` coefficients
//! `k = scale * rstd`, `mean(dY)`, `mean`, `p = rstd^2 * sum(dY * (X - mean)) / n`.
//!
//! Error bound (tested here against the `f64` [`reference`](mod@reference) and in
//! `tests/test_grad_batchnorm.py` against numpy in float64): every element of `dX` is within
//! `4 * 2^-24 * |k| * (|dY - mean(dY)| + |mean(dY)| + |p| (|X - mean| + |mean|))` of the exact value, and
//! `dScale`, `dBias` within `2^-24 * |exact| + 2^-30 * sum|term|` (the `f64` sums, rounded once).
//!
//! Each channel's sums run in one task in a fixed order, so the results do not depend on
//! the [`Parallelism`] or on the SIMD level (no fused multiply-add is formed: every level
//! does the portable code's operations in its order).
//!
//! [`forward`]: the training-mode forward (batch statistics, updated running statistics),
//! cut into the same channel tasks.

use crate::parallel::{for_each_item, Parallelism, Sequential};
use crate::simd::{detected, Isa, Level};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::KernelError;

/// The layout of `X`: `n` samples, `c` channels, `s` spatial elements per sample and
/// channel (the product of the dimensions after the channel axis; 1 for a rank-2 input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnShape {
    /// Batch size (dimension 0).
    pub n: usize,
    /// Channels (dimension 1).
    pub c: usize,
    /// Elements per sample and channel (product of the remaining dimensions).
    pub s: usize,
}

impl BnShape {
    /// The shape of a tensor with dimensions `dims` (rank >= 2), `None` for rank < 2 or
    /// when the element count does not fit in `usize` (no tensor has such a shape; an empty
    /// one may have huge dimensions beside its zero, and its counts are 0).
    pub fn of(dims: &[usize]) -> Option<Self> {
        crate::shape::numel(dims)?;
        let s = crate::shape::numel(dims.get(2..)?)?;
        Some(Self { n: dims[0], c: dims[1], s })
    }

    /// Elements of the whole tensor (0 when a dimension is 0, whatever the others).
    pub fn len(&self) -> usize {
        crate::shape::numel(&[self.n, self.c, self.s]).unwrap_or(0)
    }

    /// True when the tensor has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The outputs the caller wants; each is left out when `None`.
#[derive(Debug, Default)]
pub struct BnGrads<'a> {
    /// `dX`, shaped as `X`.
    pub dx: Option<&'a mut [f32]>,
    /// `dScale`, `C` elements.
    pub dscale: Option<&'a mut [f32]>,
    /// `dBias`, `C` elements.
    pub dbias: Option<&'a mut [f32]>,
}

/// Elements a task's channel group aims at (its channels over every sample). Tasks of one
/// channel each made a 128-channel 16x16 batch of 8 into 128 tasks of 2048 elements, whose
/// dispatch through onnxruntime's pool cost as much as their work: the node ran no faster
/// on two threads than on one (measured; 2.1x with tasks of 16 channels).
const TASK_ELEMENTS: usize = 1 << 14;
/// Spatial elements from which the passes walk each channel's row with its own scalars
/// (below, the per-channel values are spread over the element positions of a group).
const LONG_ROW: usize = 64;
/// Tasks a node is cut into at least, channels allowing.
const MIN_GROUPS: usize = 8;

/// Below this many elements a node runs on the calling thread. Smaller nodes measured no
/// faster on two threads, or slower (a 576-channel 4x4 batch of 16: 0.13 ms on one thread,
/// 0.17 on two), their data moving between the cores' caches costing what the split saves.
const BN_SERIAL_BELOW: usize = 1 << 18;
/// The same for the backward, whose passes do more per element: from 2^15 elements its
/// nodes gain from a second thread in the step (mobilenet_v3_small's BatchNormTrainGrad
/// nodes 6.6-6.9 -> 5.5-5.6 ms in all at two threads, efficientnet_b0's 14.4-15.2 ->
/// 13.6-13.9; the forward's measured the same either way).
const BN_GRAD_SERIAL_BELOW: usize = 1 << 15;

/// Channels per task (the last may have fewer): about [`TASK_ELEMENTS`] elements, at
/// least [`MIN_GROUPS`] tasks where there are channels enough; a function of the shape
/// alone. `sh` has an element.
pub(super) fn group_width(sh: BnShape) -> usize {
    TASK_ELEMENTS.div_ceil(sh.n.saturating_mul(sh.s).max(1)).min(sh.c.div_ceil(MIN_GROUPS)).max(1)
}

/// The gradients of training-mode BatchNormalization (see the module text), with the
/// widest SIMD level of this CPU.
pub fn batch_norm_train_grad(
    dy: &[f32],
    x: &[f32],
    scale: &[f32],
    eps: f32,
    shape: BnShape,
    out: BnGrads<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    batch_norm_train_grad_at(detected(), dy, x, scale, eps, shape, out, par)
}

/// [`batch_norm_train_grad`] at SIMD level `level` (the widest available one at most).
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_train_grad_at(
    level: Level,
    dy: &[f32],
    x: &[f32],
    scale: &[f32],
    eps: f32,
    shape: BnShape,
    out: BnGrads<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    check(dy, x, scale, shape, &out)?;
    if shape.is_empty() {
        // No element per channel: dX is empty, and dScale and dBias are empty sums (as the
        // reference). Nothing else is sized (`n` or `c` may be huge beside the zero).
        let BnGrads { dscale, dbias, .. } = out;
        dscale.into_iter().chain(dbias).for_each(|d| d.fill(0.0));
        return Ok(());
    }
    let serial;
    let par = if shape.len() < BN_GRAD_SERIAL_BELOW {
        serial = Sequential;
        &serial as &dyn Parallelism
    } else {
        par
    };
    let cx = Inputs { dy, x, scale, eps: f64::from(eps), shape };
    let isa = level.isa().unwrap_or(Isa::Scalar);
    for_each_item(par, groups(shape, out), |g| {
        at_level(
            isa,
            #[inline(always)]
            || run_group(&cx, g),
        )
    });
    Ok(())
}

fn check(dy: &[f32], x: &[f32], scale: &[f32], sh: BnShape, out: &BnGrads<'_>) -> Result<(), KernelError> {
    let len = |what, got: usize, expected| {
        if got == expected {
            Ok(())
        } else {
            Err(KernelError::LengthMismatch { what, got, expected })
        }
    };
    len("X", x.len(), sh.len())?;
    len("dY", dy.len(), sh.len())?;
    len("scale", scale.len(), sh.c)?;
    if let Some(d) = &out.dx {
        len("dX", d.len(), sh.len())?;
    }
    if let Some(d) = &out.dscale {
        len("dScale", d.len(), sh.c)?;
    }
    if let Some(d) = &out.dbias {
        len("dBias", d.len(), sh.c)?;
    }
    Ok(())
}

/// The shared inputs of every task.
struct Inputs<'a> {
    dy: &'a [f32],
    x: &'a [f32],
    scale: &'a [f32],
    eps: f64,
    shape: BnShape,
}

/// One task: channels `c0 .. c0 + width`, with their pieces of the outputs (`dx[k]`: the
/// group's elements of sample `k`).
struct Group<'a> {
    c0: usize,
    width: usize,
    dx: Option<Vec<&'a mut [f32]>>,
    dscale: Option<&'a mut [f32]>,
    dbias: Option<&'a mut [f32]>,
}

/// The outputs cut into tasks of [`group_width`] consecutive channels.
fn groups(sh: BnShape, out: BnGrads<'_>) -> Vec<Group<'_>> {
    let width = group_width(sh);
    let count = sh.c.div_ceil(width);
    let mut gs: Vec<Group<'_>> = (0..count)
        .map(|k| {
            let c0 = k * width;
            Group { c0, width: width.min(sh.c - c0), dx: None, dscale: None, dbias: None }
        })
        .collect();
    if let Some(dx) = out.dx {
        for g in gs.iter_mut() {
            g.dx = Some(Vec::with_capacity(sh.n));
        }
        if sh.c * sh.s > 0 {
            for row in dx.chunks_mut(sh.c * sh.s) {
                for (g, piece) in gs.iter_mut().zip(row.chunks_mut(width * sh.s)) {
                    if let Some(v) = g.dx.as_mut() {
                        v.push(piece);
                    }
                }
            }
        }
    }
    if let Some(d) = out.dscale {
        gs.iter_mut().zip(d.chunks_mut(width)).for_each(|(g, p)| g.dscale = Some(p));
    }
    if let Some(d) = out.dbias {
        gs.iter_mut().zip(d.chunks_mut(width)).for_each(|(g, p)| g.dbias = Some(p));
    }
    gs
}

/// Runs `f` compiled for `isa`: the portable body, vectorised by the compiler at that
/// level (`f` must be `#[inline(always)]` so that its body is compiled inside the level's
/// function). The same operations at every level: the same bits. Both BatchNorm kernels'
/// tasks run through it.
#[inline(always)]
pub(super) fn at_level<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2 and FMA.
        Isa::Avx2(t) => unsafe { with_avx2(t, f) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(t) => unsafe { with_avx512(t, f) },
        _ => f(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn with_avx2<R>(_: Avx2, f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn with_avx512<R>(_: Avx512, f: impl FnOnce() -> R) -> R {
    f()
}

/// One group's work. Its channels' rows of one sample are contiguous (`w = width * S`
/// elements): the sums keep one accumulator per element position, summed over the samples
/// in order ([`side_by_side`]: no dependency between neighbours, so the loops vectorise at
/// any `S`); a channel's sum is then its `S` accumulators added in a fixed order ([`fold`]).
#[inline(always)]
fn run_group<'a>(cx: &Inputs<'a>, mut g: Group<'_>) {
    let sh = cx.shape;
    let w = g.width * sh.s;
    let count = (sh.n * sh.s) as f64;
    let c0 = g.c0;
    let block = move |t: &'a [f32], n: usize| -> &'a [f32] {
        let at = (n * sh.c + c0) * sh.s;
        &t[at..at + w]
    };
    let width = g.width;
    let per_channel =
        move |acc: &[f64]| -> Vec<f64> { (0..width).map(|k| fold(&acc[k * sh.s..(k + 1) * sh.s])).collect() };
    // Pass 1: sum(X), sum(dY).
    let (mut sx, mut sd) = (vec![0f64; w], vec![0f64; w]);
    side_by_side(sh.n, w, &mut sx, &mut sd, None, |n| (block(cx.x, n), block(cx.dy, n)), |x, d, _| (x, d));
    let sdy = per_channel(&sd);
    let mean: Vec<f64> = per_channel(&sx).into_iter().map(|v| v / count).collect();
    // Pass 2: sum((X - mean)^2), sum(dY * (X - mean)).
    let mut mean_at = Vec::with_capacity(w);
    for &m in &mean {
        mean_at.resize(mean_at.len() + sh.s, m);
    }
    let (sq, sdx) = (&mut sx, &mut sd);
    side_by_side(
        sh.n,
        w,
        sq,
        sdx,
        Some(&mean_at),
        |n| (block(cx.x, n), block(cx.dy, n)),
        |x, d, m| {
            let v = x - m;
            (v * v, d * v)
        },
    );
    let (sq, sdx) = (per_channel(sq), per_channel(sdx));
    let mut coef = Vec::with_capacity(g.width);
    for k in 0..g.width {
        // No element (N or the spatial size 0): zero sums, and no dX to write.
        let rstd = if count > 0.0 { 1.0 / (sq[k] / count + cx.eps).sqrt() } else { 0.0 };
        let dscale = sdx[k] * rstd;
        if let Some(d) = g.dscale.as_deref_mut() {
            d[k] = dscale as f32;
        }
        if let Some(d) = g.dbias.as_deref_mut() {
            d[k] = sdy[k] as f32;
        }
        let kk = f64::from(cx.scale[g.c0 + k]) * rstd;
        coef.push(Coef {
            k: kk as f32,
            p: (rstd * dscale / count) as f32,
            m: mean[k] as f32,
            mdy: (sdy[k] / count) as f32,
        });
    }
    // Pass 3: dX; long rows channel by channel, short ones with the coefficients spread
    // over the element positions.
    let Some(dx) = g.dx.as_mut() else { return };
    if sh.s >= LONG_ROW {
        for (n, out) in dx.iter_mut().enumerate() {
            let (x, d) = (block(cx.x, n), block(cx.dy, n));
            for ((o, (x, d)), cf) in out.chunks_mut(sh.s).zip(x.chunks(sh.s).zip(d.chunks(sh.s))).zip(&coef) {
                for ((o, &x), &d) in o.iter_mut().zip(x).zip(d) {
                    *o = cf.k * ((d - cf.mdy) - cf.p * (x - cf.m));
                }
            }
        }
    } else {
        let at: Vec<Coef> = coef.iter().flat_map(|&c| std::iter::repeat_n(c, sh.s)).collect();
        let (k, p): (Vec<f32>, Vec<f32>) = at.iter().map(|c| (c.k, c.p)).unzip();
        let (m, mdy): (Vec<f32>, Vec<f32>) = at.iter().map(|c| (c.m, c.mdy)).unzip();
        for (n, out) in dx.iter_mut().enumerate() {
            let (x, dy) = (block(cx.x, n), block(cx.dy, n));
            let coefs = k.iter().zip(&p).zip(m.iter().zip(&mdy));
            for ((o, (&x, &d)), ((&k, &p), (&m, &md))) in out.iter_mut().zip(x.iter().zip(dy)).zip(coefs) {
                *o = k * ((d - md) - p * (x - m));
            }
        }
    }
}

/// Positions whose accumulators [`side_by_side`] keeps in registers across the samples.
const BLOCK: usize = 32;

/// For every position `j < w`: `a[j] = sum_n fa`, `b[j] = sum_n fb` of `f(x, d, m[j])` with
/// `(x, d)` the `j`-th elements of `rows(n)`, summed over the samples `n` in order from 0. In
/// blocks of [`BLOCK`] positions (their sums in registers), the tail side by side in memory:
/// the same order either way.
#[inline(always)]
fn side_by_side<'a>(
    samples: usize,
    w: usize,
    a: &mut [f64],
    b: &mut [f64],
    m: Option<&[f64]>,
    rows: impl Fn(usize) -> (&'a [f32], &'a [f32]),
    f: impl Fn(f64, f64, f64) -> (f64, f64),
) {
    let full = w - w % BLOCK;
    for j0 in (0..full).step_by(BLOCK) {
        let (mut sa, mut sb) = ([0f64; BLOCK], [0f64; BLOCK]);
        let mut mj = [0f64; BLOCK];
        if let Some(m) = m {
            mj.copy_from_slice(&m[j0..j0 + BLOCK]);
        }
        for n in 0..samples {
            let (x, d) = rows(n);
            let (x, d): (&[f32; BLOCK], &[f32; BLOCK]) =
                (x[j0..j0 + BLOCK].try_into().expect("a block"), d[j0..j0 + BLOCK].try_into().expect("a block"));
            for k in 0..BLOCK {
                let (p, q) = f(f64::from(x[k]), f64::from(d[k]), mj[k]);
                sa[k] += p;
                sb[k] += q;
            }
        }
        a[j0..j0 + BLOCK].copy_from_slice(&sa);
        b[j0..j0 + BLOCK].copy_from_slice(&sb);
    }
    let (a, b) = (&mut a[full..w], &mut b[full..w]);
    a.fill(0.0);
    b.fill(0.0);
    for n in 0..samples {
        let (x, d) = rows(n);
        for (j, ((sa, sb), (&x, &d))) in
            a.iter_mut().zip(b.iter_mut()).zip(x[full..].iter().zip(&d[full..])).enumerate()
        {
            let (p, q) = f(f64::from(x), f64::from(d), m.map_or(0.0, |m| m[full + j]));
            *sa += p;
            *sb += q;
        }
    }
}

/// A channel's accumulators added in a fixed order (four interleaved partial sums).
#[inline(always)]
fn fold(v: &[f64]) -> f64 {
    let (body, tail) = v.as_chunks::<4>();
    let mut l = [0f64; 4];
    for ch in body {
        for k in 0..4 {
            l[k] += ch[k];
        }
    }
    for (s, &t) in l.iter_mut().zip(tail) {
        *s += t;
    }
    (l[0] + l[2]) + (l[1] + l[3])
}

/// The per-channel coefficients of `dX = k * ((dY - mdy) - p * (X - m))`.
#[derive(Debug, Clone, Copy)]
struct Coef {
    k: f32,
    p: f32,
    m: f32,
    mdy: f32,
}

/// The plain scalar reference, straight from the formula, in `f64` throughout (tests only).
pub mod reference {
    use super::BnShape;

    /// `(dX, dScale, dBias)` of training-mode BatchNormalization, each element computed in
    /// `f64` and rounded once.
    pub fn batch_norm_train_grad(
        dy: &[f32],
        x: &[f32],
        scale: &[f32],
        eps: f32,
        sh: BnShape,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (mut dx, mut ds, mut db) = (vec![0f32; sh.len()], vec![0f32; sh.c], vec![0f32; sh.c]);
        let at = |n: usize, c: usize, s: usize| (n * sh.c + c) * sh.s + s;
        let cnt = (sh.n * sh.s) as f64;
        for c in 0..sh.c {
            if sh.n * sh.s == 0 {
                continue;
            }
            let all = || (0..sh.n).flat_map(move |n| (0..sh.s).map(move |s| at(n, c, s)));
            let mean = all().map(|i| f64::from(x[i])).sum::<f64>() / cnt;
            let var = all().map(|i| (f64::from(x[i]) - mean).powi(2)).sum::<f64>() / cnt;
            let rstd = 1.0 / (var + f64::from(eps)).sqrt();
            let xhat = |i: usize| (f64::from(x[i]) - mean) * rstd;
            let sdy = all().map(|i| f64::from(dy[i])).sum::<f64>();
            let sdyxhat = all().map(|i| f64::from(dy[i]) * xhat(i)).sum::<f64>();
            db[c] = sdy as f32;
            ds[c] = sdyxhat as f32;
            for i in all() {
                let g = f64::from(scale[c]) * rstd * (f64::from(dy[i]) - sdy / cnt - xhat(i) * sdyxhat / cnt);
                dx[i] = g as f32;
            }
        }
        (dx, ds, db)
    }
}

pub mod forward;

#[cfg(test)]
mod tests;
