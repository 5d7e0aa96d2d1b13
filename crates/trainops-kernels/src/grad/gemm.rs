//! The one door to the `gemm` crate: a single-threaded f32 matrix product on strided views,
//! for the convolution ([`matmul`], on slices, every index the crate will touch checked
//! against them first) and the GRU ([`matmul_view`], on ndarray views, whose invariant
//! holds the same); both call the crate through [`gemm_raw`], the only `unsafe` call of it.

use ndarray::{ArrayView2, ArrayViewMut2};

/// A read-only matrix view: element `(r, c)` is `data[r * rs + c * cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

/// One past the largest index a `rows x cols` view with strides `rs`, `cs` reads (0 when empty).
fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `c = a * b`, or `c += a * b` when `accumulate`; `c` is `a.rows x b.cols`, row-major with
/// row stride `ldc`. Runs on the calling thread (the crate's own threading is never used).
/// Panics when the views do not fit their slices or the shapes disagree (a bug of the caller).
pub(crate) fn matmul(a: Mat<'_>, b: Mat<'_>, c: &mut [f32], ldc: usize, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "matmul: inner dimensions differ");
    assert!(span(m, k, a.rs, a.cs) <= a.data.len(), "matmul: lhs view past its slice");
    assert!(span(k, n, b.rs, b.cs) <= b.data.len(), "matmul: rhs view past its slice");
    assert!(n <= ldc || m <= 1, "matmul: rows of the result overlap");
    assert!(span(m, n, ldc, 1) <= c.len(), "matmul: result view past its slice");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in 0..m {
                c[row * ldc..row * ldc + n].fill(0.0);
            }
        }
        return;
    }
    let s = |v: usize| isize::try_from(v).expect("stride fits isize");
    // SAFETY: every element the crate reads or writes, `lhs[r*rs + c*cs]` and so on, lies
    // inside the slices (checked above); `c` is borrowed mutably and the inputs immutably, so
    // the result overlaps neither, and distinct (row, col) pairs of it are distinct elements
    // (n <= ldc).
    unsafe {
        gemm_raw(
            (m, n, k),
            (c.as_mut_ptr(), 1, s(ldc)),
            (accumulate, 1.0),
            (a.data.as_ptr(), s(a.cs), s(a.rs)),
            (b.data.as_ptr(), s(b.cs), s(b.rs)),
        );
    }
}

/// `C = A B + beta C` on ndarray views with any strides, on the calling thread (the GRU's
/// products; `beta` 0: C is not read). Panics when the shapes disagree (a caller's bug).
pub(crate) fn matmul_view(a: ArrayView2<'_, f32>, b: ArrayView2<'_, f32>, beta: f32, mut c: ArrayViewMut2<'_, f32>) {
    let ((m, k), (kb, n)) = (a.dim(), b.dim());
    assert!(kb == k && c.dim() == (m, n), "gemm shapes {:?} x {:?} -> {:?}", a.dim(), b.dim(), c.dim());
    let (sa, sb, sc) = (a.strides(), b.strides(), c.strides());
    let (sa, sb, sc) = ([sa[0], sa[1]], [sb[0], sb[1]], [sc[0], sc[1]]);
    let dst = c.as_mut_ptr();
    // SAFETY: the three views are valid for their shapes and strides (ndarray's invariant),
    // the shapes agree (asserted), C is borrowed mutably so it overlaps neither A nor B, and
    // `gemm` touches only the elements those shapes and strides address. It computes C =
    // beta C + A B, reading C only when beta is not 0.
    unsafe {
        gemm_raw(
            (m, n, k),
            (dst, sc[1], sc[0]),
            (beta != 0.0, beta),
            (a.as_ptr(), sa[1], sa[0]),
            (b.as_ptr(), sb[1], sb[0]),
        );
    }
}

/// The `gemm` crate's `dst = alpha dst + A B` (`dst` read only when `read_dst`), `m x n x
/// k`, each matrix as (pointer, column stride, row stride), with its own threading off.
///
/// # Safety
/// Every element the shapes and strides address lies in a live allocation; `dst`'s
/// elements are distinct for distinct (row, column) pairs and overlap neither input; no
/// other reference writes any of them during the call.
unsafe fn gemm_raw(
    (m, n, k): (usize, usize, usize),
    (dst, dst_cs, dst_rs): (*mut f32, isize, isize),
    (read_dst, alpha): (bool, f32),
    (lhs, lhs_cs, lhs_rs): (*const f32, isize, isize),
    (rhs, rhs_cs, rhs_rs): (*const f32, isize, isize),
) {
    // SAFETY: the caller's contract; `Parallelism::None` runs everything on this thread
    // before returning.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            read_dst,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            alpha,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: Mat<'_>, b: Mat<'_>) -> Vec<f64> {
        let mut out = vec![0f64; a.rows * b.cols];
        for r in 0..a.rows {
            for c in 0..b.cols {
                out[r * b.cols + c] = (0..a.cols)
                    .map(|i| f64::from(a.data[r * a.rs + i * a.cs]) * f64::from(b.data[i * b.rs + c * b.cs]))
                    .sum();
            }
        }
        out
    }

    /// Strided (transposed) views, accumulation, and the empty and k = 0 cases.
    #[test]
    fn matches_naive_product() {
        for &(m, k, n) in &[(0, 3, 2), (2, 0, 3), (1, 1, 1), (3, 5, 7), (17, 33, 9), (8, 64, 65)] {
            let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0).collect();
            // a row-major, b stored transposed ([n x k] row-major).
            let av = Mat { data: &a, rows: m, cols: k, rs: k, cs: 1 };
            let bv = Mat { data: &b, rows: k, cols: n, rs: 1, cs: k };
            let want = naive(av, bv);
            let mut c = vec![f32::NAN; m * n];
            matmul(av, bv, &mut c, n, false);
            for (g, w) in c.iter().zip(&want) {
                assert!((f64::from(*g) - w).abs() <= 1e-5 * (1.0 + w.abs()), "{m}x{k}x{n}: {g} vs {w}");
            }
            matmul(av, bv, &mut c, n, true);
            for (g, w) in c.iter().zip(&want) {
                assert!((f64::from(*g) - 2.0 * w).abs() <= 1e-5 * (1.0 + w.abs()), "{m}x{k}x{n} acc");
            }
        }
    }
}
