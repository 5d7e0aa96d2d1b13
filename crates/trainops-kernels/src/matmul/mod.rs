//! `C = alpha op(A) op(B) (+ bias)`, float32, for products whose operands change every call
//! (a training step's weights are graph inputs, so onnxruntime's MLAS cannot prepack them
//! and runs its unpacked path).
//!
//! Blocked as BLIS and OpenBLAS are: B in blocks of [`KC`] rows by [`NC`] columns packed
//! into panels of 32 columns (32 KiB each: one stays in L1 while the strips
//! of A pass it), A in blocks of [`MC`] rows by `KC` packed into strips of the
//! microkernel's rows (in L2), the one microkernel (`micro`), and the next tile of C
//! asked into L2 while a tile is computed. The sizes are the best of those tried in one
//! process on the language model's and ViT's products (Intel Xeon, 2026-11-28): 256 x 64 x
//! 1024 ran them at 125-150 GFLOP/s on one core where 256 x 192 x 2048 ran 100-135.
//!
//! Every element is `acc = fma(a[i, k], b[k, j], acc)` for `k` ascending from 0, stored and
//! reloaded between blocks of `k` (float32 both ways: exact), then `alpha * acc` (skipped
//! when alpha is 1) and `+ bias[j]`, each rounded once: the same bits at every SIMD level,
//! block size and thread count, and [`reference::matmul`]'s.

pub(crate) mod micro;
mod pack;
pub mod reference;
#[cfg(test)]
mod tests;

use std::cell::RefCell;

use ndarray::{ArrayViewMut2, Axis};

use crate::error::KernelError;
use crate::parallel::{for_each_item, Parallelism};
use crate::shape;
use crate::simd::Isa;
use micro::{prefetch, rows, tile_into, Tile, NR};
use pack::{pack_a, pack_b};

/// Rows of B (depth) per packed block.
pub const KC: usize = 256;
const _: () = assert!(KC <= pack::ROW_DEPTH, "KC deeper than pack_a's row copies");
/// Rows of A per packed block.
pub const MC: usize = 64;
/// Columns of B per packed block.
pub const NC: usize = 1024;
/// A task's columns from which its rows of A are packed (below, the microkernel reads A
/// where it lies).
pub const PACK_A_FROM: usize = 256;

thread_local! {
    /// The blocking sizes of this thread's products: the tests try others.
    #[cfg(test)]
    pub(crate) static BLOCKS: std::cell::Cell<(usize, usize, usize, usize)> = const { std::cell::Cell::new((KC, MC, NC, PACK_A_FROM)) };
}

/// (KC, MC, NC, PACK_A_FROM) for this call.
fn blocks() -> (usize, usize, usize, usize) {
    #[cfg(test)]
    return BLOCKS.with(std::cell::Cell::get);
    #[cfg(not(test))]
    (KC, MC, NC, PACK_A_FROM)
}

/// Multiply-adds below which a block's product stays one task.
const TASK_MACS: usize = 1 << 20;

/// One product's sizes and layouts: A is `[m, k]` row-major, or `[k, m]` when `trans_a`;
/// B is `[k, n]`, or `[n, k]` when `trans_b`; C is `[m, n]` row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The depth summed over.
    pub k: usize,
    /// A is stored transposed.
    pub trans_a: bool,
    /// B is stored transposed.
    pub trans_b: bool,
}

impl Dims {
    /// Where element `(i, kk)` of op(A) lies: `i * .0 + kk * .1`.
    fn a_strides(&self) -> (usize, usize) {
        if self.trans_a {
            (1, self.m)
        } else {
            (self.k, 1)
        }
    }

    /// Where element `(kk, j)` of op(B) lies: `kk * .0 + j * .1`.
    fn b_strides(&self) -> (usize, usize) {
        if self.trans_b {
            (1, self.k)
        } else {
            (self.n, 1)
        }
    }
}

/// `c = alpha op(a) op(b) + bias` (bias of `n` elements, added to every row), tasks on
/// `par`. Lengths are checked against `dims` first; nothing is written on an error.
pub fn matmul(
    par: &dyn Parallelism,
    dims: Dims,
    a: &[f32],
    b: &[f32],
    alpha: f32,
    bias: Option<&[f32]>,
    c: &mut [f32],
) -> Result<(), KernelError> {
    let Dims { m, n, k, .. } = dims;
    for (what, got, shape) in [("A", a.len(), [m, k]), ("B", b.len(), [k, n]), ("C", c.len(), [m, n])] {
        let expected = shape::count(what, &shape)?;
        if got != expected {
            return Err(KernelError::LengthMismatch { what, got, expected });
        }
    }
    if let Some(bias) = bias {
        if bias.len() != n {
            return Err(KernelError::LengthMismatch { what: "bias", got: bias.len(), expected: n });
        }
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let isa = isa();
    let mut cv = ArrayViewMut2::from_shape((m, n), c).map_err(|_| KernelError::Overflow { what: "C".into() })?;
    if k == 0 {
        cv.fill(0.0);
    } else {
        product(par, isa, dims, a, b, cv.view_mut());
    }
    if alpha != 1.0 || bias.is_some() {
        let items: Vec<_> = cv.axis_chunks_iter_mut(Axis(0), (TASK_MACS / n).max(1)).collect();
        for_each_item(par, items, |mut rows| {
            for mut row in rows.rows_mut() {
                for (j, v) in row.iter_mut().enumerate() {
                    let scaled = if alpha != 1.0 { alpha * *v } else { *v };
                    *v = bias.map_or(scaled, |b| scaled + b[j]);
                }
            }
        });
    }
    Ok(())
}

/// The widest level this CPU runs (tests force each in turn).
fn isa() -> Isa {
    let level = forced().unwrap_or_else(crate::simd::detected);
    level.isa().unwrap_or(Isa::Scalar)
}

#[cfg(test)]
thread_local! {
    /// The level the tests run this thread's products at.
    pub(crate) static LEVEL: std::cell::Cell<Option<crate::simd::Level>> = const { std::cell::Cell::new(None) };
}

#[cfg(test)]
fn forced() -> Option<crate::simd::Level> {
    LEVEL.with(std::cell::Cell::get)
}

#[cfg(not(test))]
#[inline(always)]
fn forced() -> Option<crate::simd::Level> {
    None
}

thread_local! {
    /// This thread's packed block of B (a product's calling thread) and of A (each task's
    /// thread): kept between calls, so a step's products do not map and fault in fresh
    /// pages each time (at most KC x NC and MC x KC floats: 1 MiB and 64 KiB).
    static PACKED_B: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static PACKED_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `c = op(a) op(b)`, `k > 0`: blocks of B's columns, then of depth; each depth block's
/// panels packed (as tasks), then its (row block, panel range) tiles as tasks, each packing
/// its rows of A.
fn product(par: &dyn Parallelism, isa: Isa, d: Dims, a: &[f32], b: &[f32], mut c: ArrayViewMut2<'_, f32>) {
    let (m, n, k) = (d.m, d.n, d.k);
    let (lda, ldb) = (d.a_strides(), d.b_strides());
    let mr = rows(isa);
    let (kcb, mcb, ncb, packs_from) = blocks();
    PACKED_B.with_borrow_mut(|bbuf| {
        for jc in (0..n).step_by(ncb) {
            let nc = ncb.min(n - jc);
            let panels = nc.div_ceil(NR);
            for pc in (0..k).step_by(kcb) {
                let kc = kcb.min(k - pc);
                bbuf.resize(panels * kc * NR, 0.0);
                pack_b(par, b, ldb, (pc, kc), (jc, nc), &mut bbuf[..panels * kc * NR]);
                let bpacked = &bbuf[..panels * kc * NR];
                let row_blocks = m.div_ceil(mcb);
                let want = ((m * nc * kc) / TASK_MACS).clamp(1, 16);
                let chunks = want.div_ceil(row_blocks).min(panels);
                let per = panels.div_ceil(chunks);
                let mut items = Vec::new();
                let mut cols = c.slice_mut(ndarray::s![.., jc..jc + nc]);
                for (ib, mut block) in cols.axis_chunks_iter_mut(Axis(0), mcb).enumerate() {
                    let mut q = 0;
                    while block.ncols() > 0 {
                        let w = (per * NR).min(block.ncols());
                        let (tile, rest) = block.split_at(Axis(1), w);
                        items.push((ib * mcb, q * per, tile));
                        (block, q) = (rest, q + 1);
                    }
                }
                for_each_item(par, items, |(i0, p0, mut tile)| {
                    let rows_here = tile.nrows();
                    // A straight from its rows when the tile is narrow: packing costs a float's copy
                    // per `ncols` multiply-adds, as much as the products at a weight gradient's
                    // 96 columns.
                    let direct = tile.ncols() < packs_from;
                    PACKED_A.with_borrow_mut(|abuf| {
                        let strips = rows_here.div_ceil(mr);
                        if !direct {
                            abuf.resize(strips * kc * mr, 0.0);
                            pack_a(isa, a, lda, (i0, rows_here), (pc, kc), mr, &mut abuf[..strips * kc * mr]);
                        }
                        for (q, c0) in (0..tile.ncols()).step_by(NR).enumerate() {
                            let panel = &bpacked[(p0 + q) * kc * NR..][..kc * NR];
                            let w = NR.min(tile.ncols() - c0);
                            for (s, r0) in (0..rows_here).step_by(mr).enumerate() {
                                let (strip, ld) = match direct {
                                    true => (&a[(i0 + r0) * lda.0 + pc * lda.1..], lda),
                                    false => (&abuf[s * kc * mr..][..kc * mr], (1, mr)),
                                };
                                let rs = mr.min(rows_here - r0);
                                prefetch(&tile, r0 + mr, mr, c0);
                                let t = Tile { a: strip, lda: ld, k: kc, panel, mr: rs, accumulate: pc > 0 };
                                tile_into(isa, t, &mut tile, r0, c0, w);
                            }
                        }
                    });
                });
            }
        }
    });
}
