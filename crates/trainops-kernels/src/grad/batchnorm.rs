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
//! running statistics, not the batch ones) in two passes with `f64` accumulators: the mean,
//! then `sum((X - mean)^2)`, `sum(dY)` and `sum(dY * (X - mean))` together; a third pass
//! writes `dX = k * ((dY - mean(dY)) - p * (X - mean))` in `f32` with per-channel `f32`
//! coefficients `k = scale * rstd`, `mean(dY)`, `mean`, `p = rstd^2 * sum(dY * (X - mean)) / n`.
//!
//! Error bound (tested here against the `f64` [`reference`] and in
//! `tests/test_grad_batchnorm.py` against numpy in float64): every element of `dX` is within
//! `4 * 2^-24 * |k| * (|dY - mean(dY)| + |mean(dY)| + |p| (|X - mean| + |mean|))` of the exact value, and
//! `dScale`, `dBias` within `2^-24 * |exact| + 2^-30 * sum|term|` (the `f64` sums, rounded once).
//!
//! Each channel's sums run in one task in a fixed order, so the results do not depend on
//! the [`Parallelism`] or on the SIMD level (no fused multiply-add is formed: every level
//! does the portable code's operations in its order).

use crate::parallel::{for_each_item, Parallelism, Sequential, SERIAL_BELOW};
use crate::simd::{detected, Avx2, Avx512, Isa, Level};
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
    /// The shape of a tensor with dimensions `dims` (rank >= 2), `None` for rank < 2.
    pub fn of(dims: &[usize]) -> Option<Self> {
        (dims.len() >= 2).then(|| Self { n: dims[0], c: dims[1], s: dims[2..].iter().product() })
    }

    /// Elements of the whole tensor.
    pub fn len(&self) -> usize {
        self.n * self.c * self.s
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

/// Spatial elements from which a channel's rows are summed in SIMD lanes; below it the
/// rows are walked sample by sample over groups of channels (rank-2 inputs).
const LANE_PATH_FROM: usize = 8;
/// Lanes of the `f64` accumulators (two AVX2 vectors, one AVX-512 vector).
const L: usize = 8;
/// Channels per task on the row path.
const ROW_GROUP: usize = 64;

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
    let serial;
    let par = if shape.len() < SERIAL_BELOW {
        serial = Sequential;
        &serial as &dyn Parallelism
    } else {
        par
    };
    let cx = Inputs { dy, x, scale, eps: f64::from(eps), shape };
    let gs = groups(shape, out);
    match level.isa().unwrap_or(Isa::Scalar) {
        Isa::Scalar => for_each_item(par, gs, |g| run_group(&cx, g)),
        // SAFETY: the token proves the CPU has AVX2 and FMA.
        Isa::Avx2(t) => for_each_item(par, gs, |g| unsafe { run_group_avx2(t, &cx, g) }),
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(t) => for_each_item(par, gs, |g| unsafe { run_group_avx512(t, &cx, g) }),
    }
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

/// The outputs cut into tasks: one channel each on the lane path, [`ROW_GROUP`] channels on
/// the row path.
fn groups(sh: BnShape, out: BnGrads<'_>) -> Vec<Group<'_>> {
    let width = if sh.s >= LANE_PATH_FROM { 1 } else { ROW_GROUP.min(sh.c).max(1) };
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

/// One channel's sums (see the module text).
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    mean: f64,
    sq: f64,
    dy: f64,
    dyxc: f64,
}

/// The group's work with AVX2 enabled (the portable body, vectorised by the compiler).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn run_group_avx2(_: Avx2, cx: &Inputs<'_>, g: Group<'_>) {
    run_group(cx, g);
}

/// The group's work with AVX-512F enabled.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn run_group_avx512(_: Avx512, cx: &Inputs<'_>, g: Group<'_>) {
    run_group(cx, g);
}

/// No x86 levels elsewhere ([`Level::isa`] never gives their tokens).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn run_group_avx2(_: Avx2, cx: &Inputs<'_>, g: Group<'_>) {
    run_group(cx, g);
}

/// No x86 levels elsewhere ([`Level::isa`] never gives their tokens).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn run_group_avx512(_: Avx512, cx: &Inputs<'_>, g: Group<'_>) {
    run_group(cx, g);
}

#[inline(always)]
fn run_group(cx: &Inputs<'_>, mut g: Group<'_>) {
    let sh = cx.shape;
    let count = (sh.n * sh.s) as f64;
    let mut sums = vec![Sums::default(); g.width];
    if sh.n * sh.s > 0 {
        if sh.s >= LANE_PATH_FROM {
            for (k, s) in sums.iter_mut().enumerate() {
                *s = lane_sums(cx, g.c0 + k, count);
            }
        } else {
            row_sums(cx, g.c0, &mut sums, count);
        }
    }
    let mut coef = Vec::with_capacity(g.width);
    for (k, s) in sums.iter().enumerate() {
        // No element (N or the spatial size 0): zero sums, and no dX to write.
        let rstd = if count > 0.0 { 1.0 / (s.sq / count + cx.eps).sqrt() } else { 0.0 };
        let dscale = s.dyxc * rstd;
        if let Some(d) = g.dscale.as_deref_mut() {
            d[k] = dscale as f32;
        }
        if let Some(d) = g.dbias.as_deref_mut() {
            d[k] = s.dy as f32;
        }
        let kk = f64::from(cx.scale[g.c0 + k]) * rstd;
        let p = rstd * dscale / count;
        coef.push(Coef { k: kk as f32, p: p as f32, m: s.mean as f32, mdy: (s.dy / count) as f32 });
    }
    if let Some(dx) = g.dx.as_mut() {
        for (n, piece) in dx.iter_mut().enumerate() {
            let base = (n * sh.c + g.c0) * sh.s;
            for (k, (out, cf)) in piece.chunks_mut(sh.s).zip(&coef).enumerate() {
                let at = base + k * sh.s;
                write_dx(out, &cx.dy[at..at + sh.s], &cx.x[at..at + sh.s], *cf);
            }
        }
    }
}

/// The per-channel coefficients of `dX = k * ((dY - mdy) - p * (X - m))`.
#[derive(Debug, Clone, Copy)]
struct Coef {
    k: f32,
    p: f32,
    m: f32,
    mdy: f32,
}

#[inline(always)]
fn write_dx(out: &mut [f32], dy: &[f32], x: &[f32], cf: Coef) {
    for ((o, &d), &v) in out.iter_mut().zip(dy).zip(x) {
        *o = cf.k * ((d - cf.mdy) - cf.p * (v - cf.m));
    }
}

/// Sum of eight lanes in a fixed order.
#[inline(always)]
fn fold(a: [f64; L]) -> f64 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Channel `c`'s row of every sample in `data`.
#[inline(always)]
fn rows(data: &[f32], sh: BnShape, c: usize) -> impl Iterator<Item = &[f32]> {
    (0..sh.n).map(move |n| {
        let at = (n * sh.c + c) * sh.s;
        &data[at..at + sh.s]
    })
}

/// Channel `c`'s sums on the lane path: every sample's contiguous row in [`L`] lanes (the
/// tail of a row into the first lanes).
#[inline(always)]
fn lane_sums(cx: &Inputs<'_>, c: usize, count: f64) -> Sums {
    let sh = cx.shape;
    let mut acc = [0f64; L];
    for row in rows(cx.x, sh, c) {
        let mut it = row.chunks_exact(L);
        for ch in &mut it {
            for k in 0..L {
                acc[k] += f64::from(ch[k]);
            }
        }
        for (k, &v) in it.remainder().iter().enumerate() {
            acc[k] += f64::from(v);
        }
    }
    let mean = fold(acc) / count;
    let (mut sq, mut sdy, mut sdx) = ([0f64; L], [0f64; L], [0f64; L]);
    for (xr, dr) in rows(cx.x, sh, c).zip(rows(cx.dy, sh, c)) {
        let (mut xi, mut di) = (xr.chunks_exact(L), dr.chunks_exact(L));
        for (xc, dc) in (&mut xi).zip(&mut di) {
            for k in 0..L {
                let v = f64::from(xc[k]) - mean;
                let d = f64::from(dc[k]);
                sq[k] += v * v;
                sdy[k] += d;
                sdx[k] += d * v;
            }
        }
        for (k, (&xv, &dv)) in xi.remainder().iter().zip(di.remainder()).enumerate() {
            let v = f64::from(xv) - mean;
            let d = f64::from(dv);
            sq[k] += v * v;
            sdy[k] += d;
            sdx[k] += d * v;
        }
    }
    Sums { mean, sq: fold(sq), dy: fold(sdy), dyxc: fold(sdx) }
}

/// The sums of channels `c0 ..` (`sums.len()` of them) on the row path: sample by sample,
/// each channel's elements in order (the reference's order).
#[inline(always)]
fn row_sums(cx: &Inputs<'_>, c0: usize, sums: &mut [Sums], count: f64) {
    let sh = cx.shape;
    let w = sums.len();
    let piece = |n: usize| (n * sh.c + c0) * sh.s..(n * sh.c + c0 + w) * sh.s;
    let mut acc = vec![0f64; w];
    for n in 0..sh.n {
        for (a, ch) in acc.iter_mut().zip(cx.x[piece(n)].chunks_exact(sh.s)) {
            for &v in ch {
                *a += f64::from(v);
            }
        }
    }
    for (s, a) in sums.iter_mut().zip(&acc) {
        s.mean = a / count;
    }
    for n in 0..sh.n {
        let r = piece(n);
        for ((s, xc), dc) in sums.iter_mut().zip(cx.x[r.clone()].chunks_exact(sh.s)).zip(cx.dy[r].chunks_exact(sh.s)) {
            for (&xv, &dv) in xc.iter().zip(dc) {
                let v = f64::from(xv) - s.mean;
                let d = f64::from(dv);
                s.sq += v * v;
                s.dy += d;
                s.dyxc += d * v;
            }
        }
    }
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

#[cfg(test)]
mod tests;
