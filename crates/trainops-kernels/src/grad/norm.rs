//! LayerNormalization's backward (`com.trainops::LayerNormGrad`), row by row.
//!
//! X is `rows x cols` (the normalised axes flattened into `cols`), with each row's mean `mu`
//! and inverse standard deviation `r` given (the forward node's `Mean` and `InvStdDev`).
//! With `xhat = (x - mu) r` and `g = dY * Scale`:
//!
//! ```text
//! dX     = r (g - mean(g) - xhat mean(g xhat))      (means over the row)
//! dScale = sum over rows of dY xhat
//! dBias  = sum over rows of dY
//! ```
//!
//! [`reference()`] computes all of it in `f64` from the `f32` inputs and rounds once. The fast
//! path computes `xhat`, `g` and `dX` in `f32` and accumulates every sum in `f64` (8 lanes
//! per row; per block of rows for dScale and dBias, the blocks' sums added in block order),
//! so its bits depend on neither the instruction set nor the thread count; against the
//! reference each output is within a few `f32` roundings of its terms (the bound
//! `tests` checks: `8 eps r (|g| + |mean g| + |xhat mean(g xhat)|)` for dX,
//! `4 eps sum |dY xhat|` and `eps sum |dY|`, plus one rounding, for dScale and dBias).

use crate::parallel::{for_each_item, Parallelism, CHUNK, SERIAL_BELOW};
use crate::simd::{Avx2, Avx512, Isa, Level};
use crate::KernelError;

/// The inputs of one call: `dy` and `x` of `rows * cols` elements, `scale` of `cols`,
/// `mean` and `inv_std_dev` of `rows`.
#[derive(Debug, Clone, Copy)]
pub struct LayerNormGradIn<'a> {
    /// The gradient of Y.
    pub dy: &'a [f32],
    /// The forward input.
    pub x: &'a [f32],
    /// The forward Scale, one per column.
    pub scale: &'a [f32],
    /// Each row's mean.
    pub mean: &'a [f32],
    /// Each row's `1 / sqrt(var + epsilon)`.
    pub inv_std_dev: &'a [f32],
}

/// The outputs: `dx` (`rows * cols`), and `dscale` / `dbias` (`cols`) when wanted.
#[derive(Debug)]
pub struct LayerNormGradOut<'a> {
    /// The gradient of X.
    pub dx: &'a mut [f32],
    /// The gradient of Scale.
    pub dscale: Option<&'a mut [f32]>,
    /// The gradient of Bias.
    pub dbias: Option<&'a mut [f32]>,
}

fn check(what: &'static str, got: usize, expected: usize) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { what, got, expected })
    }
}

/// Rows of one task: about [`CHUNK`] elements, at least one row. It depends only on `cols`,
/// so the column sums are added in the same order whatever the thread count.
fn block_rows(cols: usize) -> usize {
    (CHUNK / cols.max(1)).max(1)
}

/// The backward of LayerNormalization over `cols` columns, with the widest available
/// instruction set level at or below `level`; rows in blocks run as tasks of `par`.
pub fn layer_norm_grad(
    level: Level,
    inp: LayerNormGradIn<'_>,
    cols: usize,
    out: LayerNormGradOut<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    let rows = inp.mean.len();
    let total = crate::shape::mul("X (rows * cols)", rows, cols)?;
    check("InvStdDev", inp.inv_std_dev.len(), rows)?;
    check("X", inp.x.len(), total)?;
    check("dY", inp.dy.len(), total)?;
    check("Scale", inp.scale.len(), cols)?;
    check("dX", out.dx.len(), total)?;
    let LayerNormGradOut { dx, dscale, dbias } = out;
    if let Some(d) = dscale.as_deref() {
        check("dScale", d.len(), cols)?;
    }
    if let Some(d) = dbias.as_deref() {
        check("dBias", d.len(), cols)?;
    }
    let sums = dscale.is_some() || dbias.is_some();
    if cols == 0 {
        return Ok(());
    }
    let per = block_rows(cols);
    let blocks = rows.div_ceil(per);
    // Per block: the f64 partial sums of dY xhat (first `cols`) and dY (next `cols`).
    let mut partial = vec![0f64; if sums { blocks * 2 * cols } else { 0 }];
    let mut parts = partial.chunks_mut(2 * cols);
    let items: Vec<Item<'_>> = dx
        .chunks_mut(per * cols)
        .enumerate()
        .map(|(b, d)| (b * per, d, if sums { parts.next() } else { None }))
        .collect();
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let run = |(first, d, acc): Item<'_>| {
        let n = d.len() / cols;
        let block = Block {
            dy: &inp.dy[first * cols..(first + n) * cols],
            x: &inp.x[first * cols..(first + n) * cols],
            scale: inp.scale,
            mean: &inp.mean[first..first + n],
            inv_std_dev: &inp.inv_std_dev[first..first + n],
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves the CPU has AVX-512F.
            Isa::Avx512(t) => unsafe { block_avx512(t, block, d, acc) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the token proves the CPU has AVX2 and FMA.
            Isa::Avx2(t) => unsafe { block_avx2(t, block, d, acc) },
            _ => block_rows_portable(block, d, acc),
        }
    };
    if rows * cols < SERIAL_BELOW {
        items.into_iter().for_each(run);
    } else {
        for_each_item(par, items, run);
    }
    if sums {
        let mut total = vec![0f64; 2 * cols];
        for p in partial.chunks(2 * cols) {
            total.iter_mut().zip(p).for_each(|(t, v)| *t += v);
        }
        if let Some(d) = dscale {
            d.iter_mut().zip(&total[..cols]).for_each(|(o, &v)| *o = v as f32);
        }
        if let Some(d) = dbias {
            d.iter_mut().zip(&total[cols..]).for_each(|(o, &v)| *o = v as f32);
        }
    }
    Ok(())
}

/// One task's work: its first row, its rows of dX, its block's column sums (when wanted).
type Item<'a> = (usize, &'a mut [f32], Option<&'a mut [f64]>);

/// One task's rows of the inputs.
#[derive(Clone, Copy)]
struct Block<'a> {
    dy: &'a [f32],
    x: &'a [f32],
    scale: &'a [f32],
    mean: &'a [f32],
    inv_std_dev: &'a [f32],
}

/// [`block_rows_portable`] with AVX2 and FMA enabled (no contraction without fast-math:
/// the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn block_avx2(_: Avx2, b: Block<'_>, dx: &mut [f32], acc: Option<&mut [f64]>) {
    block_rows_portable(b, dx, acc);
}

/// [`block_rows_portable`] with AVX-512F enabled (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn block_avx512(_: Avx512, b: Block<'_>, dx: &mut [f32], acc: Option<&mut [f64]>) {
    block_rows_portable(b, dx, acc);
}

/// Lanes of the row sums.
const LANES: usize = 8;

/// Every row of a block: dX, and the block's column sums added into `acc` (`[dY xhat | dY]`).
#[inline(always)]
fn block_rows_portable(b: Block<'_>, dx: &mut [f32], mut acc: Option<&mut [f64]>) {
    let cols = b.scale.len();
    let inv_cols = 1.0 / cols as f64;
    for (i, d) in dx.chunks_exact_mut(cols).enumerate() {
        let dy = &b.dy[i * cols..(i + 1) * cols];
        let x = &b.x[i * cols..(i + 1) * cols];
        let (mu, r) = (b.mean[i], b.inv_std_dev[i]);
        let (mut s1, mut s2) = ([0f64; LANES], [0f64; LANES]);
        let mut ci = dy.chunks_exact(LANES).zip(x.chunks_exact(LANES)).zip(b.scale.chunks_exact(LANES));
        for ((dy8, x8), w8) in &mut ci {
            for l in 0..LANES {
                let g = dy8[l] * w8[l];
                s1[l] += f64::from(g);
                s2[l] += f64::from(g * ((x8[l] - mu) * r));
            }
        }
        let tail = cols - cols % LANES;
        for j in tail..cols {
            let g = dy[j] * b.scale[j];
            s1[j - tail] += f64::from(g);
            s2[j - tail] += f64::from(g * ((x[j] - mu) * r));
        }
        let m1 = (s1.iter().sum::<f64>() * inv_cols) as f32;
        let m2 = (s2.iter().sum::<f64>() * inv_cols) as f32;
        match acc.as_deref_mut() {
            None => {
                for (((o, &dyj), &xj), &wj) in d.iter_mut().zip(dy).zip(x).zip(b.scale) {
                    let xh = (xj - mu) * r;
                    *o = r * ((dyj * wj - m1) - xh * m2);
                }
            }
            Some(a) => {
                let (a_s, a_b) = a.split_at_mut(cols);
                let sums = a_s.iter_mut().zip(a_b.iter_mut());
                for ((((o, &dyj), &xj), &wj), (s, bb)) in d.iter_mut().zip(dy).zip(x).zip(b.scale).zip(sums) {
                    let xh = (xj - mu) * r;
                    *o = r * ((dyj * wj - m1) - xh * m2);
                    *s += f64::from(dyj * xh);
                    *bb += f64::from(dyj);
                }
            }
        }
    }
}

/// The specification, in `f64` throughout from the `f32` inputs, rounded once: dX, dScale,
/// dBias. Tests only.
pub fn reference(inp: LayerNormGradIn<'_>, cols: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = inp.mean.len();
    let mut dx = vec![0f32; rows * cols];
    let (mut ds, mut db) = (vec![0f64; cols], vec![0f64; cols]);
    for i in 0..rows {
        let (mu, r) = (f64::from(inp.mean[i]), f64::from(inp.inv_std_dev[i]));
        let at = |j: usize| (f64::from(inp.dy[i * cols + j]), f64::from(inp.x[i * cols + j]));
        let (mut m1, mut m2) = (0.0, 0.0);
        for j in 0..cols {
            let (dy, x) = at(j);
            let g = dy * f64::from(inp.scale[j]);
            m1 += g;
            m2 += g * (x - mu) * r;
        }
        m1 /= cols as f64;
        m2 /= cols as f64;
        for j in 0..cols {
            let (dy, x) = at(j);
            let xh = (x - mu) * r;
            dx[i * cols + j] = (r * (dy * f64::from(inp.scale[j]) - m1 - xh * m2)) as f32;
            ds[j] += dy * xh;
            db[j] += dy;
        }
    }
    let round = |v: Vec<f64>| v.into_iter().map(|e| e as f32).collect();
    (dx, round(ds), round(db))
}

#[cfg(test)]
mod tests;
