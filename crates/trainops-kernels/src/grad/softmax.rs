//! The backward of Softmax and LogSoftmax along one axis (`com.trainops::SoftmaxGrad`,
//! `LogSoftmaxGrad`), from the forward output Y:
//!
//! ```text
//! Softmax:    dX = Y (dY - sum(dY Y))         (sum along the axis)
//! LogSoftmax: dX = dY - exp(Y) sum(dY)
//! ```
//!
//! The tensor is seen as `[outer, n, inner]` (`n` along the axis). [`reference()`] computes in
//! `f64` from the `f32` inputs and rounds once. The fast path accumulates each sum in `f64`
//! (8 lanes along a contiguous axis, one accumulator per inner position otherwise) and does
//! the rest in `f32` (`exp` is `f32::exp`); every output depends on its own slice only, so
//! the bits depend on neither the instruction set nor the thread count. Against the
//! reference each output is within `4 eps |Y| (|dY| + S)` (Softmax) or
//! `4 eps (|dY| + exp(Y) S)` (LogSoftmax), `S` the sum of the summed terms' magnitudes, plus
//! one rounding (`tests`).

use super::expf::exp_nonpositive;
use crate::parallel::{for_each_item, Parallelism, CHUNK, SERIAL_BELOW};
use crate::simd::{Avx2, Avx512, Isa, Level};
use crate::KernelError;

/// Which forward op's gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `Y = softmax(X)`.
    Softmax,
    /// `Y = log_softmax(X)`.
    LogSoftmax,
}

/// The tensor as `[outer, n, inner]`: `n` elements along the axis, `inner` the product of
/// the dimensions after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Product of the dimensions before the axis.
    pub outer: usize,
    /// The axis' length.
    pub n: usize,
    /// Product of the dimensions after the axis.
    pub inner: usize,
}

impl Dims {
    /// `shape` split at `axis` (in `0..shape.len()`); `None` when a count does not fit in
    /// `usize` (an empty tensor's other dimensions may be huge: `[0, 2^40, 2^40]` split at
    /// 0 has 2^80 elements per slice, and no kernel can take it).
    pub fn split(shape: &[usize], axis: usize) -> Option<Self> {
        let (outer, inner) = (crate::shape::numel(&shape[..axis])?, crate::shape::numel(&shape[axis + 1..])?);
        let d = Dims { outer, n: shape[axis], inner };
        crate::shape::numel(&[d.outer, d.n, d.inner])?;
        d.n.checked_mul(d.inner)?;
        Some(d)
    }

    /// Elements (0 when a count is 0, whatever the others).
    fn len(self) -> usize {
        crate::shape::numel(&[self.outer, self.n, self.inner]).unwrap_or(usize::MAX)
    }
}

/// `dx` from `dy` and `y` (each of `dims`' element count), with the widest available level
/// at or below `level`; slices along `outer` in blocks run as tasks of `par`.
pub fn softmax_grad(
    level: Level,
    kind: Kind,
    dims: Dims,
    dy: &[f32],
    y: &[f32],
    dx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    let total = dims.len();
    for (what, got) in [("dY", dy.len()), ("Y", y.len()), ("dX", dx.len())] {
        if got != total {
            return Err(KernelError::LengthMismatch { what, got, expected: total });
        }
    }
    // `n * inner` fits when the tensor has elements; else there is nothing to do.
    let slice = dims.n.saturating_mul(dims.inner);
    if slice == 0 || total == 0 {
        return Ok(());
    }
    let per = (CHUNK / slice).max(1) * slice;
    let items: Vec<(usize, &mut [f32])> = dx.chunks_mut(per).enumerate().map(|(b, d)| (b * per, d)).collect();
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let run = |(first, d): (usize, &mut [f32])| {
        let (dy, y) = (&dy[first..first + d.len()], &y[first..first + d.len()]);
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves the CPU has AVX-512F.
            Isa::Avx512(t) => unsafe { slices_avx512(t, kind, dims, dy, y, d) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves the CPU has AVX2 and FMA.
            Isa::Avx2(t) => unsafe { slices_avx2(t, kind, dims, dy, y, d) },
            _ => slices_portable(kind, dims, dy, y, d),
        }
    };
    if total < SERIAL_BELOW {
        items.into_iter().for_each(run);
    } else {
        for_each_item(par, items, run);
    }
    Ok(())
}

/// [`slices_portable`] with AVX2 and FMA enabled (no contraction without fast-math: the
/// same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn slices_avx2(_: Avx2, kind: Kind, dims: Dims, dy: &[f32], y: &[f32], dx: &mut [f32]) {
    slices_portable(kind, dims, dy, y, dx);
}

/// [`slices_portable`] with AVX-512F enabled (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn slices_avx512(_: Avx512, kind: Kind, dims: Dims, dy: &[f32], y: &[f32], dx: &mut [f32]) {
    slices_portable(kind, dims, dy, y, dx);
}

/// Lanes of a contiguous row's sum.
const LANES: usize = 8;

/// The sum a row's gradient needs: `dY Y` (Softmax) or `dY` (LogSoftmax), in `f64` lanes.
#[inline(always)]
fn row_sum(kind: Kind, dy: &[f32], y: &[f32]) -> f32 {
    let mut s = [0f64; LANES];
    let pairs = dy.chunks_exact(LANES).zip(y.chunks_exact(LANES));
    for (d8, y8) in pairs {
        for l in 0..LANES {
            s[l] += f64::from(term(kind, d8[l], y8[l]));
        }
    }
    let tail = dy.len() - dy.len() % LANES;
    for j in tail..dy.len() {
        s[j - tail] += f64::from(term(kind, dy[j], y[j]));
    }
    s.iter().sum::<f64>() as f32
}

#[inline(always)]
fn term(kind: Kind, dy: f32, y: f32) -> f32 {
    match kind {
        Kind::Softmax => dy * y,
        Kind::LogSoftmax => dy,
    }
}

#[inline(always)]
fn grad(kind: Kind, dy: f32, y: f32, s: f32) -> f32 {
    match kind {
        Kind::Softmax => y * (dy - s),
        Kind::LogSoftmax => dy - y.exp() * s,
    }
}

/// Whole `[n, inner]` slices: a block of the tensor.
#[inline(always)]
fn slices_portable(kind: Kind, dims: Dims, dy: &[f32], y: &[f32], dx: &mut [f32]) {
    let (n, inner) = (dims.n, dims.inner);
    let slice = n * inner;
    if inner == 1 {
        for ((d, dy), y) in dx.chunks_exact_mut(n).zip(dy.chunks_exact(n)).zip(y.chunks_exact(n)) {
            let s = row_sum(kind, dy, y);
            d.iter_mut().zip(dy).zip(y).for_each(|((o, &a), &b)| *o = grad(kind, a, b, s));
        }
        return;
    }
    let mut acc = vec![0f64; inner];
    let mut sums = vec![0f32; inner];
    for ((d, dy), y) in dx.chunks_exact_mut(slice).zip(dy.chunks_exact(slice)).zip(y.chunks_exact(slice)) {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (dy, y) in dy.chunks_exact(inner).zip(y.chunks_exact(inner)) {
            acc.iter_mut().zip(dy).zip(y).for_each(|((a, &p), &q)| *a += f64::from(term(kind, p, q)));
        }
        sums.iter_mut().zip(&acc).for_each(|(s, &a)| *s = a as f32);
        for ((d, dy), y) in d.chunks_exact_mut(inner).zip(dy.chunks_exact(inner)).zip(y.chunks_exact(inner)) {
            for (((o, &p), &q), &s) in d.iter_mut().zip(dy).zip(y).zip(&sums) {
                *o = grad(kind, p, q, s);
            }
        }
    }
}

/// The specification in `f64` from the `f32` inputs, rounded once. Tests only.
pub fn reference(kind: Kind, dims: Dims, dy: &[f32], y: &[f32]) -> Vec<f32> {
    let Dims { outer, n, inner } = dims;
    let mut dx = vec![0f32; dims.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |c: usize| o * n * inner + c * inner + i;
            let d = |c: usize| f64::from(dy[at(c)]);
            let v = |c: usize| f64::from(y[at(c)]);
            let s: f64 = (0..n)
                .map(|c| match kind {
                    Kind::Softmax => d(c) * v(c),
                    Kind::LogSoftmax => d(c),
                })
                .sum();
            for c in 0..n {
                dx[at(c)] = match kind {
                    Kind::Softmax => v(c) * (d(c) - s),
                    Kind::LogSoftmax => d(c) - v(c).exp() * s,
                } as f32;
            }
        }
    }
    dx
}

/// How a SoftmaxCrossEntropyLoss gradient scales each row's `softmax - onehot`.
#[derive(Debug, Clone, Copy)]
pub enum LossScale<'a> {
    /// `reduction="none"`: the loss' gradient, one per row.
    EachRow(&'a [f32]),
    /// `reduction="sum"`: the loss' gradient, the same for every row.
    Sum(f32),
    /// `reduction="mean"`: the loss' gradient divided by the number of rows not ignored.
    Mean(f32),
}

/// The backward of ONNX's SoftmaxCrossEntropyLoss without class weights, for `scores` of
/// `rows x classes` and one label per row: `dX = (softmax(x) - onehot(label)) s`, with `s`
/// the row's [`LossScale`] and 0 for a row whose label is `ignore`. Labels must be in
/// `0..classes` or `ignore` (the caller checks). `softmax` in `f32` lanes (`e^(x - max)` by
/// a polynomial, within `3u` relative, `u = 2^-24`; 0 below `e^-87`), the row sum
/// in `f64` lanes; `mean` divides by the count of rows kept in `f32` (the standard form's
/// `ReduceSum` of the weights, exact below 2^24 rows). All rows ignored gives a zero
/// gradient, as PyTorch's (the loss is 0/0; dividing by the zero count would make every
/// row inf * 0, NaN, and the weights NaN after the update). The bits depend on neither the
/// SIMD level (`level`, the widest used) nor the thread count.
///
/// Accuracy against [`cross_entropy_reference`], carried through each rounding: `x - max`
/// rounds (`u |t|`, which `e^t` turns into a relative error of that size) and `e^t` adds
/// `3u`; the sum's relative error is the `p`-weighted mean of those, at most `3u + u H(p)
/// <= u (3 + ln C)` (`-t_j <= -ln p_j`, and the entropy `H(p) <= ln C` for `C` classes);
/// the reciprocal, the product, the subtraction and the scaling add a rounding each. So each
/// element is within `u |s| ((10 + ln C) p + 2.4) + 2^-125 |s|` (`p |t| <= 1/e`; the last
/// term for the exponents below the floor).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_grad(
    level: Level,
    scores: &[f32],
    classes: usize,
    labels: &[i64],
    ignore: Option<i64>,
    scale: LossScale<'_>,
    dx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    let rows = labels.len();
    let total = crate::shape::mul("scores (rows * classes)", rows, classes)?;
    for (what, got, expected) in [("scores", scores.len(), total), ("dX", dx.len(), total)] {
        if got != expected {
            return Err(KernelError::LengthMismatch { what, got, expected });
        }
    }
    if let LossScale::EachRow(s) = scale {
        if s.len() != rows {
            return Err(KernelError::LengthMismatch { what: "dY", got: s.len(), expected: rows });
        }
    }
    if classes == 0 {
        return Ok(());
    }
    let kept = |l: i64| Some(l) != ignore;
    let common = match scale {
        LossScale::EachRow(_) => 0.0,
        LossScale::Sum(g) => g,
        LossScale::Mean(g) => match labels.iter().filter(|&&l| kept(l)).count() {
            0 => 0.0,
            n => g / n as f32,
        },
    };
    let per = (CHUNK / classes).max(1);
    let items: Vec<(usize, &mut [f32])> = dx.chunks_mut(per * classes).enumerate().map(|(b, d)| (b * per, d)).collect();
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let run = |(first, d): (usize, &mut [f32])| {
        for (k, out) in d.chunks_exact_mut(classes).enumerate() {
            let i = first + k;
            let s = match scale {
                LossScale::EachRow(g) => g[i],
                _ => common,
            };
            // times the row's weight (0 or 1), as the standard form multiplies: inf * 0 is NaN
            let s = s * if kept(labels[i]) { 1.0 } else { 0.0 };
            let row = Row { x: &scores[i * classes..(i + 1) * classes], label: labels[i], s };
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves the CPU has AVX-512F.
                Isa::Avx512(t) => unsafe { ce_row_avx512(t, row, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves the CPU has AVX2 and FMA.
                Isa::Avx2(t) => unsafe { ce_row_avx2(t, row, out) },
                _ => ce_row(row, out),
            }
        }
    };
    if rows * classes < SERIAL_BELOW {
        items.into_iter().for_each(run);
    } else {
        for_each_item(par, items, run);
    }
    Ok(())
}

/// One row of [`cross_entropy_grad`]: the scores, the label and the row's scale.
#[derive(Clone, Copy)]
struct Row<'a> {
    x: &'a [f32],
    label: i64,
    s: f32,
}

/// Below this exponent `e^t` is taken as 0 (it is below `2^-125`).
const EXP_FLOOR: f32 = -87.0;

/// One row: the maximum in 16 lanes (exact in any order), `e^(x - max)` in float32 lanes
/// ([`exp_nonpositive`]), their sum in [`LANES`] `f64` lanes, then `(e inv - hot) s`.
#[inline(always)]
fn ce_row(row: Row<'_>, out: &mut [f32]) {
    let x = row.x;
    let m = row_max(x);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp_shifted(v, m);
    }
    let mut sum = [0f64; LANES];
    let mut blocks = out.chunks_exact(LANES);
    for b in &mut blocks {
        for l in 0..LANES {
            sum[l] += f64::from(b[l]);
        }
    }
    for (l, &v) in blocks.remainder().iter().enumerate() {
        sum[l] += f64::from(v);
    }
    let inv = (1.0 / sum.iter().sum::<f64>()) as f32;
    let s = row.s;
    // the label's element before the loop overwrites it (labels are checked: in range or
    // ignored, and an ignored row's s is 0 or NaN either way)
    let hot = usize::try_from(row.label).ok().filter(|&l| l < out.len()).map(|l| (l, (out[l] * inv - 1.0) * s));
    for o in out.iter_mut() {
        *o = (*o * inv) * s;
    }
    if let Some((l, v)) = hot {
        out[l] = v;
    }
}

/// A row's maximum in 16 lanes (exact in any order; NaN ignored, as `f32::max` does).
#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut top = [f32::NEG_INFINITY; 16];
    let mut blocks = x.chunks_exact(16);
    for b in &mut blocks {
        for l in 0..16 {
            top[l] = top[l].max(b[l]);
        }
    }
    blocks.remainder().iter().chain(&top).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `e^(x - m)` for one element: [`exp_nonpositive`], 0 below [`EXP_FLOOR`], NaN kept.
#[inline(always)]
fn exp_shifted(v: f32, m: f32) -> f32 {
    let t = v - m;
    // NaN (a NaN score, or inf - inf) fails the comparison and stays NaN
    if t < EXP_FLOOR {
        0.0
    } else {
        exp_nonpositive(t)
    }
}

/// [`ce_row`] with AVX2 and FMA enabled (no contraction without fast-math: the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn ce_row_avx2(_: Avx2, row: Row<'_>, out: &mut [f32]) {
    ce_row(row, out);
}

/// [`ce_row`] with AVX-512F enabled (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn ce_row_avx512(_: Avx512, row: Row<'_>, out: &mut [f32]) {
    ce_row(row, out);
}

/// ONNX's SoftmaxCrossEntropyLoss without class weights, forward: `rows x classes` scores,
/// one label per row (in `0..classes` or `ignore`: the caller checks). Each row's loss is
/// `ln(sum_j e^(x_j - max)) + max - x_label` (0 for an ignored row), without the
/// log-probabilities ONNX's function body materialises (a `[rows, classes]` tensor: 201 MB
/// for a 49152-word vocabulary over 1024 tokens). `losses` gets each row's loss (the
/// `none` reduction, rounded once from `f64`); the return value is their `f64` sum in row
/// order and the count of rows kept (for `sum` and `mean`). The exponentials as
/// [`cross_entropy_grad`]'s (float32 lanes, `3u`), their sum and the rest in `f64`; the
/// bits depend on neither `level` nor the thread count.
///
/// Accuracy against [`cross_entropy_loss_reference`]: the sum's relative error is at most
/// `u (3 + ln C)` (as [`cross_entropy_grad`]'s), which the logarithm turns into an
/// absolute one, so each row's loss is within `u (3.1 + ln C)` of the exact value before
/// its float32 rounding (the `f64` operations add below `2^-45 (|max| + |x_label| + ln
/// C)`).
pub fn cross_entropy_loss(
    level: Level,
    scores: &[f32],
    classes: usize,
    labels: &[i64],
    ignore: Option<i64>,
    losses: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(f64, usize), KernelError> {
    let rows = labels.len();
    let total = crate::shape::mul("scores (rows * classes)", rows, classes)?;
    for (what, got, expected) in [("scores", scores.len(), total), ("losses", losses.len(), rows)] {
        if got != expected {
            return Err(KernelError::LengthMismatch { what, got, expected });
        }
    }
    let kept = |l: i64| Some(l) != ignore;
    let count = labels.iter().filter(|&&l| kept(l)).count();
    if classes == 0 || rows == 0 {
        losses.iter_mut().for_each(|v| *v = 0.0);
        return Ok((0.0, count));
    }
    let mut exact = vec![0f64; rows];
    let per = (CHUNK / classes).max(1);
    let items: Vec<(usize, &mut [f64])> = exact.chunks_mut(per).enumerate().map(|(b, d)| (b * per, d)).collect();
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let run = |(first, d): (usize, &mut [f64])| {
        for (k, out) in d.iter_mut().enumerate() {
            let i = first + k;
            if !kept(labels[i]) {
                *out = 0.0;
                continue;
            }
            let x = &scores[i * classes..(i + 1) * classes];
            let (m, sum) = match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves the CPU has AVX-512F.
                Isa::Avx512(t) => unsafe { lse_row_avx512(t, x) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the token proves the CPU has AVX2 and FMA.
                Isa::Avx2(t) => unsafe { lse_row_avx2(t, x) },
                _ => lse_row(x),
            };
            // labels are in range here (the caller checks; ignored rows skipped above)
            let label = labels[i] as usize;
            *out = sum.ln() + (f64::from(m) - f64::from(x[label]));
        }
    };
    if rows * classes < SERIAL_BELOW {
        items.into_iter().for_each(run);
    } else {
        for_each_item(par, items, run);
    }
    for (o, &e) in losses.iter_mut().zip(&exact) {
        *o = e as f32;
    }
    Ok((exact.iter().sum(), count))
}

/// Exponentials [`lse_row`] computes at a time, into a buffer on the stack (a multiple of
/// [`LANES`], so that each element lands in the same lane as in one pass over the row).
const LSE_BLOCK: usize = 1024;

/// A row's maximum and `sum_j e^(x_j - max)`: the float32 exponentials of a block into a
/// buffer (a loop of its own, which the compiler vectorises; computed inside the sum's loop
/// they ran at 9 ns an element), then added into [`LANES`] `f64` lanes, element `j` into
/// lane `j % LANES`.
#[inline(always)]
fn lse_row(x: &[f32]) -> (f32, f64) {
    let m = row_max(x);
    let mut sum = [0f64; LANES];
    let mut buf = [0f32; LSE_BLOCK];
    for block in x.chunks(LSE_BLOCK) {
        let e = &mut buf[..block.len()];
        for (o, &v) in e.iter_mut().zip(block) {
            *o = exp_shifted(v, m);
        }
        let mut lanes = e.chunks_exact(LANES);
        for b in &mut lanes {
            for l in 0..LANES {
                sum[l] += f64::from(b[l]);
            }
        }
        // only the row's last block has a remainder
        for (l, &v) in lanes.remainder().iter().enumerate() {
            sum[l] += f64::from(v);
        }
    }
    (m, sum.iter().sum())
}

/// [`lse_row`] with AVX2 and FMA enabled (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn lse_row_avx2(_: Avx2, x: &[f32]) -> (f32, f64) {
    lse_row(x)
}

/// [`lse_row`] with AVX-512F enabled (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn lse_row_avx512(_: Avx512, x: &[f32]) -> (f32, f64) {
    lse_row(x)
}

/// [`cross_entropy_loss`]'s specification in `f64`: each row's loss, ignored rows 0.
/// Tests only.
pub fn cross_entropy_loss_reference(scores: &[f32], classes: usize, labels: &[i64], ignore: Option<i64>) -> Vec<f64> {
    labels
        .iter()
        .enumerate()
        .map(|(i, &label)| {
            if Some(label) == ignore {
                return 0.0;
            }
            let x: Vec<f64> = scores[i * classes..(i + 1) * classes].iter().map(|&v| f64::from(v)).collect();
            let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
            z.ln() + m - x[label as usize]
        })
        .collect()
}

/// [`cross_entropy_grad`]'s specification in `f64`, rounded once. Tests only.
pub fn cross_entropy_reference(
    scores: &[f32],
    classes: usize,
    labels: &[i64],
    ignore: Option<i64>,
    scale: LossScale<'_>,
) -> Vec<f32> {
    let kept = |l: i64| Some(l) != ignore;
    let count = labels.iter().filter(|&&l| kept(l)).count() as f64;
    let mut dx = vec![0f32; scores.len()];
    for (i, &label) in labels.iter().enumerate() {
        let x: Vec<f64> = scores[i * classes..(i + 1) * classes].iter().map(|&v| f64::from(v)).collect();
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
        let s = match scale {
            LossScale::EachRow(g) => f64::from(g[i]),
            LossScale::Sum(g) => f64::from(g),
            LossScale::Mean(g) => f64::from(g) / count.max(1.0),
        };
        let s = s * if kept(label) { 1.0 } else { 0.0 };
        for j in 0..classes {
            let hot = if label == j as i64 { 1.0 } else { 0.0 };
            dx[i * classes + j] = (((x[j] - m).exp() / z - hot) * s) as f32;
        }
    }
    dx
}

#[cfg(test)]
mod tests;
