//! The one door to the `gemm` crate: a single-threaded f32 matrix product on strided
//! ndarray views for the GRU ([`matmul_view`], whose invariant keeps every index the crate
//! touches inside the views), through [`gemm_raw`], the only `unsafe` call of it. (The
//! convolution's gradients run on their own product, `conv::fma_chain`.)

use ndarray::{ArrayView2, ArrayViewMut2};

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
