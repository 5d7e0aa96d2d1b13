//! Packing the blocked product's operands: B's blocks into panels of [`NR`] columns, A's
//! into strips of the microkernel's rows, each zero-padded to whole panels and strips.

use super::micro::NR;
use crate::parallel::{for_each_item, Parallelism};
use crate::simd::Isa;

/// The depth the row copies of A's 8-row strips hold: at least the blocked product's KC (a
/// compile-time check there).
pub(super) const ROW_DEPTH: usize = 256;

/// Rows `pc..pc + kc` and columns `jc..jc + nc` of op(B) (element `(kk, j)` at `kk * ldb.0 +
/// j * ldb.1`) into `out` as panels `[nc / NR][kc][NR]`, the last zero-padded; a few
/// panels a task.
pub(super) fn pack_b(
    par: &dyn Parallelism,
    b: &[f32],
    ldb: (usize, usize),
    (pc, kc): (usize, usize),
    (jc, nc): (usize, usize),
    out: &mut [f32],
) {
    let per = ((1usize << 16) / (kc * NR)).max(1);
    let items: Vec<_> = out.chunks_mut(per * kc * NR).enumerate().collect();
    for_each_item(par, items, |(q, panels)| {
        for (i, panel) in panels.chunks_exact_mut(kc * NR).enumerate() {
            let c0 = jc + (q * per + i) * NR;
            let w = NR.min(jc + nc - c0);
            if ldb.1 == 1 {
                // B's rows are contiguous: a row of the panel is a slice of one.
                for (kk, dst) in panel.chunks_exact_mut(NR).enumerate() {
                    let src = &b[(pc + kk) * ldb.0 + c0..];
                    copy_padded::<NR>(dst, src, w);
                }
            } else {
                // B given transposed: each of the panel's columns is a slice of one row.
                if w < NR {
                    panel.chunks_exact_mut(NR).for_each(|row| row[w..].fill(0.0));
                }
                for jj in 0..w {
                    let src = &b[(c0 + jj) * ldb.1 + pc..][..kc];
                    for (dst, &v) in panel.chunks_exact_mut(NR).zip(src) {
                        dst[jj] = v;
                    }
                }
            }
        }
    });
}

/// Rows `i0..i0 + rows` and columns `pc..pc + kc` of op(A) (element `(i, kk)` at `i * lda.0 +
/// kk * lda.1`) into `out` as strips `[rows / mr][kc][mr]`, the last zero-padded.
pub(super) fn pack_a(
    isa: Isa,
    a: &[f32],
    lda: (usize, usize),
    (i0, rows): (usize, usize),
    (pc, kc): (usize, usize),
    mr: usize,
    out: &mut [f32],
) {
    for (s, strip) in out.chunks_exact_mut(kc * mr).enumerate() {
        let r0 = i0 + s * mr;
        let h = mr.min(i0 + rows - r0);
        if lda.1 == 1 {
            // A's rows are contiguous: each is a column of the strip.
            if h < mr {
                strip.chunks_exact_mut(mr).for_each(|col| col[h..].fill(0.0));
            }
            let mut k0 = 0;
            if let (Isa::Avx512(token), 8) = (isa, h) {
                // The strip's rows copied whole first (sequential reads the hardware
                // prefetches; eight rows read in step conflicted in the caches when A's rows
                // are a multiple of 4 KiB apart, as a 49152-wide A's are), then eight rows by
                // eight columns at a time transposed in registers.
                let kw = kc - kc % 8;
                let mut rows = [[0.0f32; ROW_DEPTH]; 8];
                for (r, row) in rows.iter_mut().enumerate() {
                    row[..kw].copy_from_slice(&a[(r0 + r) * lda.0 + pc..][..kw]);
                }
                while k0 < kw {
                    // SAFETY: `rows` holds 8 rows of ROW_DEPTH floats and k0 + 8 <= kw <=
                    // ROW_DEPTH (the copies above sliced `kw` of each); the 64 floats written
                    // are `strip`'s `k0 * 8..(k0 + 8) * 8` (sliced).
                    unsafe {
                        let dst = strip[k0 * 8..(k0 + 8) * 8].as_mut_ptr();
                        transpose8(token, rows.as_ptr().cast::<f32>().add(k0), ROW_DEPTH, dst);
                    }
                    k0 += 8;
                }
            }
            // The rest a cache line of each row at a time: the rows' reads overlap (row by
            // row, a block of A fresh from memory waited on each row's lines in turn).
            while k0 < kc {
                let kw = 16.min(kc - k0);
                let cols = &mut strip[k0 * mr..(k0 + kw) * mr];
                for r in 0..h {
                    let src = &a[(r0 + r) * lda.0 + pc + k0..][..kw];
                    for (dst, &v) in cols.chunks_exact_mut(mr).zip(src) {
                        dst[r] = v;
                    }
                }
                k0 += kw;
            }
        } else {
            // A given transposed: a column of the strip is a slice of one of its rows.
            for (kk, dst) in strip.chunks_exact_mut(mr).enumerate() {
                let src = &a[(pc + kk) * lda.1 + r0..];
                match mr {
                    8 => copy_padded::<8>(dst, src, h),
                    4 => copy_padded::<4>(dst, src, h),
                    3 => copy_padded::<3>(dst, src, h),
                    _ => {
                        dst[..h].copy_from_slice(&src[..h]);
                        dst[h..].fill(0.0);
                    }
                }
            }
        }
    }
}

/// The 8 x 8 block of floats at `src` (rows `ld` apart) transposed into 64 consecutive
/// floats at `dst`: `dst[q * 8 + r] = src[r * ld + q]`.
///
/// # Safety
/// The block's 64 floats must be readable and `dst`'s 64 writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose8(_: crate::simd::Avx512, src: *const f32, ld: usize, dst: *mut f32) {
    // SAFETY: the caller's promise; the token proves AVX-512F, which implies AVX.
    unsafe {
        use std::arch::x86_64::*;
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * ld)));
        let t = [
            _mm256_unpacklo_ps(r[0], r[1]),
            _mm256_unpackhi_ps(r[0], r[1]),
            _mm256_unpacklo_ps(r[2], r[3]),
            _mm256_unpackhi_ps(r[2], r[3]),
            _mm256_unpacklo_ps(r[4], r[5]),
            _mm256_unpackhi_ps(r[4], r[5]),
            _mm256_unpacklo_ps(r[6], r[7]),
            _mm256_unpackhi_ps(r[6], r[7]),
        ];
        let u = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        for q in 0..4 {
            _mm256_storeu_ps(dst.add(q * 8), _mm256_permute2f128_ps::<0x20>(u[q], u[q + 4]));
            _mm256_storeu_ps(dst.add((q + 4) * 8), _mm256_permute2f128_ps::<0x31>(u[q], u[q + 4]));
        }
    }
}

/// `dst[..w] = src[..w]`, `dst[w..] = 0` for `dst` of `N` elements: a copy of a length the
/// compiler knows (a call to `memcpy` for each strip's row of 8 floats took most of the
/// packing of a weight gradient's 384 x 96 x 8192 product).
#[inline(always)]
fn copy_padded<const N: usize>(dst: &mut [f32], src: &[f32], w: usize) {
    let dst: &mut [f32; N] = dst.try_into().expect("a row of the panel or strip");
    if w == N {
        dst.copy_from_slice(&src[..N]);
    } else {
        dst[..w].copy_from_slice(&src[..w]);
        dst[w..].fill(0.0);
    }
}
