//! `C = A B` (or `C += A B`) for a B that many products share (the LSTM's `R^T` in every
//! forward step, `R` in every backward step): B is packed once into panels of [`NR`] columns,
//! and each product reads them straight, so a step's small product (`batch` rows) costs no
//! packing. Every element is `acc = fma(a[m, k], b[k, n], acc)` for `k` ascending, from 0
//! (or from C), at every SIMD level and in every split into tasks: the same bits throughout
//! (the portable loop's `f32::mul_add` rounds once, as the FMA instructions do).

use ndarray::{ArrayViewMut2, Axis};

use crate::matmul::micro::{rows, tile_into, Tile, NR};
use crate::parallel::{for_each_item, Parallelism};
use crate::simd::Isa;

/// B (`[k, n]`) as panels `[n / NR][k][NR]`, the last one zero-padded.
#[derive(Debug, Default)]
pub(crate) struct Packed {
    k: usize,
    n: usize,
    data: Vec<f32>,
}

impl Packed {
    /// Packs `b`, row-major `[k, n]` with row stride `ldb`, panels as tasks of `par`.
    pub(crate) fn pack(&mut self, par: &dyn Parallelism, b: &[f32], k: usize, n: usize, ldb: usize) {
        self.fill(par, k, n, |c0, w, panel| {
            for (kk, dst) in panel.chunks_exact_mut(NR).enumerate() {
                dst[..w].copy_from_slice(&b[kk * ldb + c0..][..w]);
            }
        });
    }

    /// Packs the `[k, n]` matrix whose transpose is `bt`, row-major `[n, k]` with row stride
    /// `ld` (W for `X W^T`), panels as tasks of `par`.
    pub(crate) fn pack_t(&mut self, par: &dyn Parallelism, bt: &[f32], k: usize, n: usize, ld: usize) {
        self.fill(par, k, n, |c0, w, panel| {
            for jj in 0..w {
                let src = &bt[(c0 + jj) * ld..][..k];
                for (dst, &v) in panel.chunks_exact_mut(NR).zip(src) {
                    dst[jj] = v;
                }
            }
        });
    }

    /// Sizes the panels for `[k, n]` and has `put(first column, width, panel)` write each
    /// panel's `width` real columns (its padding is zeroed here), a few panels a task.
    fn fill(&mut self, par: &dyn Parallelism, k: usize, n: usize, put: impl Fn(usize, usize, &mut [f32]) + Sync) {
        let panels = n.div_ceil(NR);
        // Every element is written below: no clearing pass (a single-threaded memset of
        // up to 4 MiB before each pack).
        self.data.resize(panels * k * NR, 0.0);
        (self.k, self.n) = (k, n);
        if k == 0 {
            return;
        }
        let per = ((1usize << 15) / (k * NR)).max(1);
        let items: Vec<_> = self.data.chunks_mut(per * k * NR).enumerate().collect();
        for_each_item(par, items, |(q, block)| {
            for (i, panel) in block.chunks_exact_mut(k * NR).enumerate() {
                let c0 = (q * per + i) * NR;
                let w = NR.min(n - c0);
                if w < NR {
                    panel.chunks_exact_mut(NR).for_each(|row| row[w..].fill(0.0));
                }
                put(c0, w, panel);
            }
        });
    }
}

/// Multiply-accumulates below which a product stays one task.
const TASK_MACS: usize = 1 << 18;

/// `C = A B` (`accumulate`: `C += A B`) with A `[m, k]`, element `(i, j)` at `a[i * rs + j *
/// cs]` (row-major: `(lda, 1)`; a transposed row-major matrix: `(1, ld)`), and C `[m, n]`
/// (any row stride, columns contiguous); large products run as column blocks on `par`
/// (whole panels each: the same bits at any thread count).
pub(crate) fn gemm_packed(
    par: &dyn Parallelism,
    isa: Isa,
    a: &[f32],
    (rs, cs): (usize, usize),
    b: &Packed,
    mut c: ArrayViewMut2<'_, f32>,
    accumulate: bool,
) {
    let (m, n, k) = (c.nrows(), b.n, b.k);
    assert_eq!(c.ncols(), n, "gemm_packed: C's columns");
    assert!(m == 0 || k == 0 || (m - 1) * rs + (k - 1) * cs < a.len(), "gemm_packed: A past its slice");
    let lda = (rs, cs);
    let panels = n.div_ceil(NR);
    let tasks = ((m * n * k) / TASK_MACS).clamp(1, 8).min(panels);
    if tasks <= 1 {
        run(isa, a, lda, b, 0, c.view_mut(), accumulate);
        return;
    }
    let per = panels.div_ceil(tasks);
    let items: Vec<_> = c.axis_chunks_iter_mut(Axis(1), per * NR).enumerate().collect();
    for_each_item(par, items, |(t, c)| run(isa, a, lda, b, t * per, c, accumulate));
}

/// The panels from `p0` on, into C's columns (which start at panel `p0`).
fn run(
    isa: Isa,
    a: &[f32],
    lda: (usize, usize),
    b: &Packed,
    p0: usize,
    mut c: ArrayViewMut2<'_, f32>,
    accumulate: bool,
) {
    let (m, k, ncols) = (c.nrows(), b.k, c.ncols());
    let mr = rows(isa).min(8);
    // Row blocks outside, panels inside: C is written row block by row block (a panel at a
    // time down all rows strode across C's pages, 1.8x slower on 1024 x 128 x 1024).
    for r0 in (0..m).step_by(mr) {
        let mr = mr.min(m - r0);
        for (q, c0) in (0..ncols).step_by(NR).enumerate() {
            let panel = &b.data[(p0 + q) * k * NR..][..k * NR];
            let t = Tile { a: &a[r0 * lda.0..], lda, k, panel, mr, accumulate };
            tile_into(isa, t, &mut c, r0, c0, NR.min(ncols - c0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{available_levels, Level};
    use crate::test_util::uniform;
    use crate::{RayonPool, Sequential};
    use ndarray::Array2;

    /// Every level and thread count gives the same bits, within a float64 product's
    /// `k` roundings (gamma_k of the terms' magnitudes).
    #[test]
    fn levels_and_threads_agree_bitwise_and_with_float64() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for &(m, k, n) in &[(1, 1, 1), (16, 256, 1024), (7, 13, 45), (9, 5, 32), (17, 64, 33), (3, 0, 40)] {
            let mut u = uniform((m * 31 + k * 7 + n) as u64);
            let a: Vec<f32> = (0..m * k).map(|_| u() as f32).collect();
            let b: Vec<f32> = (0..k * n).map(|_| u() as f32).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| u() as f32).collect();
            let mut packed = Packed::default();
            packed.pack(&Sequential, &b, k, n, n);
            let bt: Vec<f32> = (0..n * k).map(|q| b[(q % k) * n + q / k]).collect();
            let mut from_t = Packed::default();
            from_t.pack_t(&RayonPool(Some(&pool)), &bt, k, n, k);
            assert_eq!(from_t.data, packed.data);
            let mut first: Option<Vec<f32>> = None;
            for level in available_levels() {
                for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
                    for acc in [false, true] {
                        let mut c = Array2::from_shape_vec((m, n), c0.clone()).unwrap();
                        gemm_packed(par, level.isa().unwrap(), &a, (k, 1), &packed, c.view_mut(), acc);
                        let got = c.into_raw_vec_and_offset().0;
                        for i in 0..m {
                            for j in 0..n {
                                let terms: Vec<f64> =
                                    (0..k).map(|q| f64::from(a[i * k + q]) * f64::from(b[q * n + j])).collect();
                                let base = if acc { f64::from(c0[i * n + j]) } else { 0.0 };
                                let want = base + terms.iter().sum::<f64>();
                                let mag = base.abs() + terms.iter().map(|t| t.abs()).sum::<f64>();
                                let g = (k + 1) as f64 * f64::from(f32::EPSILON) / 2.0;
                                assert!(
                                    (f64::from(got[i * n + j]) - want).abs() <= 1.01 * g * mag,
                                    "{level:?} {m}x{k}x{n}"
                                );
                            }
                        }
                        // A given transposed (`(1, m)` strides): the same bits.
                        let at: Vec<f32> = (0..m * k).map(|q| a[(q % m) * k + q / m]).collect();
                        let mut ct = Array2::from_shape_vec((m, n), c0.clone()).unwrap();
                        gemm_packed(par, level.isa().unwrap(), &at, (1, m), &packed, ct.view_mut(), acc);
                        assert!(ct.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()));
                        if acc {
                            match &first {
                                None => first = Some(got),
                                Some(f) => assert!(
                                    f.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()),
                                    "{level:?} vs {:?}: {m}x{k}x{n}",
                                    Level::Scalar
                                ),
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A reused `Packed` (no clearing pass) holds exactly what a fresh one does: stale values
/// of a larger earlier matrix never survive into the padding or the panels.
#[cfg(test)]
#[test]
fn repacking_over_a_larger_matrix_leaves_nothing_behind() {
    use crate::test_util::uniform;
    use crate::{RayonPool, Sequential};
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let mut u = uniform(7);
    let big: Vec<f32> = (0..300 * 200).map(|_| 1.0 + u() as f32).collect();
    for &(k, n) in &[(37, 45), (300, 33), (5, 200), (1, 1)] {
        let small: Vec<f32> = (0..k * n).map(|_| u() as f32).collect();
        let mut fresh = Packed::default();
        fresh.pack(&Sequential, &small, k, n, n);
        let mut reused = Packed::default();
        reused.pack(&RayonPool(Some(&pool)), &big, 300, 200, 200);
        reused.pack(&RayonPool(Some(&pool)), &small, k, n, n);
        assert_eq!(reused.data, fresh.data, "{k}x{n}");
        reused.pack_t(&Sequential, &big, 200, 300, 200);
        let small_t: Vec<f32> = (0..n * k).map(|q| small[(q % k) * n + q / k]).collect();
        reused.pack_t(&RayonPool(Some(&pool)), &small_t, k, n, k);
        assert_eq!(reused.data, fresh.data, "{k}x{n} transposed");
        // The padding of a partial last panel is zero, the real columns the matrix's.
        for p in 0..n.div_ceil(NR) {
            for kk in 0..k {
                for jj in 0..NR {
                    let want = if p * NR + jj < n { small[kk * n + p * NR + jj] } else { 0.0 };
                    assert_eq!(fresh.data[(p * k + kk) * NR + jj], want);
                }
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::Sequential;
    use ndarray::Array2;

    #[test]
    #[ignore]
    fn rates() {
        for &(m, k, n) in &[
            (16, 256, 1024),
            (16, 1024, 256),
            (1024, 128, 1024),
            (1024, 256, 1024),
            (1024, 1024, 256),
            (1024, 1024, 128),
        ] {
            let a = vec![0.5f32; m * k];
            let b = vec![0.25f32; k * n];
            let mut p = Packed::default();
            p.pack(&Sequential, &b, k, n, n);
            let mut c = Array2::<f32>::zeros((m, n));
            let isa = crate::simd::detected().isa().unwrap();
            let reps = (1usize << 30) / (m * k * n) + 1;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                gemm_packed(&Sequential, isa, &a, (k, 1), &p, c.view_mut(), false);
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            let t1 = std::time::Instant::now();
            for _ in 0..reps {
                p.pack(&Sequential, &b, k, n, n);
            }
            let sp = t1.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{m}x{k}x{n}: {:.1} GFLOP/s, {:.1} us; pack {:.1} us",
                2.0 * (m * k * n) as f64 / s / 1e9,
                s * 1e6,
                sp * 1e6
            );
        }
    }
}
