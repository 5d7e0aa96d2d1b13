//! The one microkernel of the packed matrix products (the blocked [`super::matmul`] and the
//! LSTM's per-step products): up to [`MR_MAX`] rows of A times one panel of [`NR`] packed
//! columns of B, every element `acc = fma(a[r, k], b[k, j], acc)` for `k` ascending, from
//! zero or from C. The same bits at every SIMD level: the portable loop's `f32::mul_add`
//! rounds once, as the FMA instructions do.

use ndarray::ArrayViewMut2;

use crate::simd::Isa;

/// Columns per packed panel of B.
pub(crate) const NR: usize = 32;

/// The AVX-512 kernel's rows (16 accumulators; 12 rows measured no faster).
const MR512: usize = 8;

/// The most rows one call takes: the AVX-512 kernel's.
pub(crate) const MR_MAX: usize = MR512;

/// Rows per call at `isa`: as many as its registers hold next to the panel's vectors.
pub(crate) fn rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx512(_) => MR512,
        Isa::Avx2(_) => 3,
        Isa::Scalar => 4,
    }
}

/// One microkernel call: `mr` rows of A from `a` (element `(r, kk)` at `r * lda.0 + kk *
/// lda.1`: a row-major A is `(lda, 1)`, a transposed one `(1, ld)`, a packed one `(1, mr)`),
/// `k` deep, times one packed panel (`[k][NR]`), starting from C (`accumulate`) or from zeros.
#[derive(Clone, Copy)]
pub(crate) struct Tile<'a> {
    pub(crate) a: &'a [f32],
    pub(crate) lda: (usize, usize),
    pub(crate) k: usize,
    pub(crate) panel: &'a [f32],
    pub(crate) mr: usize,
    pub(crate) accumulate: bool,
}

/// `t` into rows `r0..r0 + t.mr` and columns `c0..c0 + w` (`w <= NR`) of `c`, whose
/// columns are contiguous: a whole panel straight from and into C's rows, a partial one
/// through a buffer (its padding columns computed and dropped).
pub(crate) fn tile_into(isa: Isa, t: Tile<'_>, c: &mut ArrayViewMut2<'_, f32>, r0: usize, c0: usize, w: usize) {
    let (m, n) = c.dim();
    assert!(r0 + t.mr <= m && c0 + w <= n && w <= NR, "microkernel tile outside C");
    assert!(t.mr <= 1 || n <= 1 || c.strides()[1] == 1, "microkernel: C's columns not contiguous");
    let ldc = c.strides()[0];
    assert!(t.mr <= 1 || (ldc >= 0 && ldc as usize >= n), "microkernel: C's rows overlap");
    if w == NR && (n <= 1 || c.strides()[1] == 1) {
        // SAFETY: rows r0..r0 + mr and columns c0..c0 + NR are inside C's view (asserted),
        // its rows `ldc` apart and its columns contiguous; `c` is borrowed mutably.
        unsafe { block(isa, t, c.as_mut_ptr().add(r0 * ldc.max(0) as usize + c0), ldc.max(0) as usize) };
        return;
    }
    let mut acc = [[0.0f32; NR]; MR_MAX];
    if t.accumulate {
        for (r, row) in acc[..t.mr].iter_mut().enumerate() {
            for (j, v) in row[..w].iter_mut().enumerate() {
                *v = c[[r0 + r, c0 + j]];
            }
        }
    }
    // SAFETY: `acc`'s first `mr` (<= MR_MAX, asserted in `block`) rows of NR, `NR` apart.
    unsafe { block(isa, Tile { accumulate: true, ..t }, acc.as_mut_ptr().cast(), NR) };
    for (r, row) in acc[..t.mr].iter().enumerate() {
        for (j, &v) in row[..w].iter().enumerate() {
            c[[r0 + r, c0 + j]] = v;
        }
    }
}

/// Asks the cache for C's rows `r0..r0 + rows`, columns `c0..c0 + NR` (clipped to C), the
/// tile the next call reads: C's rows are a page apart on wide products, and a tile's loads
/// waited on memory at the start of every call, a third of the time on 2048 x 2048 x 2048.
pub(crate) fn prefetch(c: &ArrayViewMut2<'_, f32>, r0: usize, rows: usize, c0: usize) {
    let (m, n) = c.dim();
    if c0 >= n || n == 0 {
        return;
    }
    let ldc = c.strides()[0].max(0) as usize;
    let last = (n - 1).min(c0 + NR - 1);
    for r in r0..m.min(r0 + rows) {
        for j in [c0, last] {
            let p = c.as_ptr().wrapping_add(r * ldc + j);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch is a hint that never faults nor reads into the program;
            // the address is an element of C anyway (r < m, j < n).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.cast())
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = p;
        }
    }
}

/// `C[r] = fma(a[r, k], panel[k], C[r])` for every k ascending, for the tile's rows, C's
/// rows of NR elements `ldc` apart from `c`.
///
/// # Safety
/// `c.add(r * ldc + j)` for `r < t.mr`, `j < NR` must be valid for reads and writes, and no
/// other reference may reach those elements during the call.
pub(crate) unsafe fn block(isa: Isa, t: Tile<'_>, c: *mut f32, ldc: usize) {
    let Tile { a, lda, k, panel, mr, accumulate } = t;
    assert!(mr <= rows(isa), "microkernel: {mr} rows");
    assert!(mr == 0 || k == 0 || (mr - 1) * lda.0 + (k - 1) * lda.1 < a.len());
    assert!(panel.len() >= k * NR);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512F; the reads stay in `a` and `panel` (asserted),
        // C's rows are the caller's promise.
        Isa::Avx512(token) => unsafe { block_avx512(token, t, c, ldc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2 and FMA; as above.
        Isa::Avx2(token) => unsafe { block_avx2(token, t, c, ldc) },
        _ => {
            for r in 0..mr {
                // SAFETY: row r of C, NR elements: the caller's promise.
                let row = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), NR) };
                if !accumulate {
                    row.fill(0.0);
                }
                for kk in 0..k {
                    let av = a[r * lda.0 + kk * lda.1];
                    for (o, &bv) in row.iter_mut().zip(&panel[kk * NR..(kk + 1) * NR]) {
                        *o = av.mul_add(bv, *o);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // indices name registers, unrolled
unsafe fn block_avx512(_: crate::simd::Avx512, t: Tile<'_>, c: *mut f32, ldc: usize) {
    let Tile { a, lda: (rs, cs), k, panel, mr, accumulate } = t;
    // SAFETY: every pointer read stays in `a` and `panel` (the caller asserted their
    // lengths), every one read or written through `c` in the rows the caller vouched for;
    // the token proves the instruction set.
    unsafe {
        use std::arch::x86_64::*;
        let mut v = [[_mm512_setzero_ps(); 2]; MR_MAX];
        if accumulate {
            for r in 0..mr {
                v[r] = [_mm512_loadu_ps(c.add(r * ldc)), _mm512_loadu_ps(c.add(r * ldc + 16))];
            }
        }
        let (ap, bp) = (a.as_ptr(), panel.as_ptr());
        macro_rules! rows {
            ($n:literal) => {
                for kk in 0..k {
                    let b0 = _mm512_loadu_ps(bp.add(kk * NR));
                    let b1 = _mm512_loadu_ps(bp.add(kk * NR + 16));
                    for r in 0..$n {
                        let av = _mm512_set1_ps(*ap.add(r * rs + kk * cs));
                        v[r][0] = _mm512_fmadd_ps(av, b0, v[r][0]);
                        v[r][1] = _mm512_fmadd_ps(av, b1, v[r][1]);
                    }
                }
            };
        }
        // A packed into whole strips of the level's rows (`(1, MR512)`): constant offsets,
        // each broadcast folded into its FMA's memory operand; partial strips as any A.
        macro_rules! packed {
            ($n:expr) => {
                for kk in 0..k {
                    let b0 = _mm512_loadu_ps(bp.add(kk * NR));
                    let b1 = _mm512_loadu_ps(bp.add(kk * NR + 16));
                    for r in 0..$n {
                        let av = _mm512_set1_ps(*ap.add(kk * MR512 + r));
                        v[r][0] = _mm512_fmadd_ps(av, b0, v[r][0]);
                        v[r][1] = _mm512_fmadd_ps(av, b1, v[r][1]);
                    }
                }
            };
        }
        match mr {
            MR512 if (rs, cs) == (1, MR512) => packed!(MR512),
            8 => rows!(8),
            7 => rows!(7),
            6 => rows!(6),
            5 => rows!(5),
            4 => rows!(4),
            3 => rows!(3),
            2 => rows!(2),
            _ => rows!(1),
        }
        for r in 0..mr {
            _mm512_storeu_ps(c.add(r * ldc), v[r][0]);
            _mm512_storeu_ps(c.add(r * ldc + 16), v[r][1]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // indices name registers, unrolled
unsafe fn block_avx2(_: crate::simd::Avx2, t: Tile<'_>, c: *mut f32, ldc: usize) {
    let Tile { a, lda: (rs, cs), k, panel, mr, accumulate } = t;
    // SAFETY: as `block_avx512`'s.
    unsafe {
        use std::arch::x86_64::*;
        let mut v = [[_mm256_setzero_ps(); 4]; 3];
        if accumulate {
            for r in 0..mr {
                for q in 0..4 {
                    v[r][q] = _mm256_loadu_ps(c.add(r * ldc + 8 * q));
                }
            }
        }
        let (ap, bp) = (a.as_ptr(), panel.as_ptr());
        macro_rules! rows {
            ($n:literal) => {
                for kk in 0..k {
                    let b = [0, 1, 2, 3].map(|q| _mm256_loadu_ps(bp.add(kk * NR + 8 * q)));
                    for r in 0..$n {
                        let av = _mm256_set1_ps(*ap.add(r * rs + kk * cs));
                        for q in 0..4 {
                            v[r][q] = _mm256_fmadd_ps(av, b[q], v[r][q]);
                        }
                    }
                }
            };
        }
        match mr {
            3 => rows!(3),
            2 => rows!(2),
            _ => rows!(1),
        }
        for r in 0..mr {
            for q in 0..4 {
                _mm256_storeu_ps(c.add(r * ldc + 8 * q), v[r][q]);
            }
        }
    }
}
