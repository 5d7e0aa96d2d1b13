//! The x86_64 conversion loops: the same IEEE operations as the portable loops (a multiply,
//! then an add, never fused; integer masks and compares), so every lane gives the portable
//! loop's bits. Each loop does whole vectors and leaves its tail to the portable loop; each
//! takes its ISA token (`crate::simd`) as the proof its callers' `// SAFETY:` lines cite.

use std::arch::x86_64::*;

use super::convert::{convert_f32_scalar, convert_f64_scalar, dropout_scalar, Bits, MANTISSA};
use crate::simd::{Avx2, Avx512};
use crate::InOut;

/// [`convert_f32_scalar`] with AVX2, 8 elements a step.
#[target_feature(enable = "avx2")]
pub(super) fn uniform_f32_avx2(_: Avx2, words: &[u32], out: &mut [f32], bits: Bits, range: f32, low: f32) {
    let n = out.len().min(words.len());
    let (mask, exp) = (_mm256_set1_epi32(bits.mask as i32), _mm256_set1_epi32(0x3F80_0000));
    let shift = _mm_cvtsi32_si128(bits.shift as i32);
    let (one, r, l) = (_mm256_set1_ps(1.0), _mm256_set1_ps(range), _mm256_set1_ps(low));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`, and `n` is at most either slice's length.
        let x = unsafe { _mm256_loadu_si256(words.as_ptr().add(i).cast()) };
        let u = _mm256_sub_ps(
            _mm256_castsi256_ps(_mm256_or_si256(_mm256_sll_epi32(_mm256_and_si256(x, mask), shift), exp)),
            one,
        );
        let v = _mm256_add_ps(_mm256_mul_ps(u, r), l);
        // SAFETY: as for the load.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), v) };
        i += 8;
    }
    convert_f32_scalar(&words[i..n], &mut out[i..n], bits, range, low);
}

/// [`convert_f32_scalar`] with AVX-512F, 16 elements a step.
#[target_feature(enable = "avx512f")]
pub(super) fn uniform_f32_avx512<const NT: bool>(
    _: Avx512,
    words: &[u32],
    out: &mut [f32],
    bits: Bits,
    range: f32,
    low: f32,
) {
    let n = out.len().min(words.len());
    let (mask, exp) = (_mm512_set1_epi32(bits.mask as i32), _mm512_set1_epi32(0x3F80_0000));
    let shift = _mm_cvtsi32_si128(bits.shift as i32);
    let (one, r, l) = (_mm512_set1_ps(1.0), _mm512_set1_ps(range), _mm512_set1_ps(low));
    // Streaming: the elements before the first cache line with normal stores, then every
    // vector store on a line of its own.
    let head = if NT { (out.as_ptr().cast::<u8>().align_offset(64) / 4).min(n) } else { 0 };
    convert_f32_scalar(&words[..head], &mut out[..head], bits, range, low);
    let mut i = head;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n`, and `n` is at most either slice's length.
        let x = unsafe { _mm512_loadu_si512(words.as_ptr().add(i).cast()) };
        let u = _mm512_sub_ps(
            _mm512_castsi512_ps(_mm512_or_si512(_mm512_sll_epi32(_mm512_and_si512(x, mask), shift), exp)),
            one,
        );
        let v = _mm512_add_ps(_mm512_mul_ps(u, r), l);
        if NT {
            // SAFETY: as for the load; `out + i` is 64-byte aligned (`head` reached a line
            // boundary and every step is 64 bytes).
            unsafe { _mm512_stream_ps(out.as_mut_ptr().add(i), v) };
        } else {
            // SAFETY: as for the load.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), v) };
        }
        i += 16;
    }
    convert_f32_scalar(&words[i..n], &mut out[i..n], bits, range, low);
}

/// [`convert_f64_scalar`] with AVX2, 4 elements (8 words) a step.
#[target_feature(enable = "avx2")]
pub(super) fn uniform_f64_avx2(_: Avx2, words: &[u32], out: &mut [f64], range: f64, low: f64) {
    let n = out.len().min(words.len() / 2);
    let (mask, exp) = (_mm256_set1_epi64x(0x000F_FFFF_FFFF_FFFF), _mm256_set1_epi64x(0x3FF0_0000_0000_0000));
    let (one, r, l) = (_mm256_set1_pd(1.0), _mm256_set1_pd(range), _mm256_set1_pd(low));
    let mut i = 0;
    while i + 4 <= n {
        // SAFETY: words `2i .. 2i + 8` exist because `i + 4 <= n <= words.len() / 2`.
        let x = unsafe { _mm256_loadu_si256(words.as_ptr().add(2 * i).cast()) };
        // Each 64-bit lane holds `x0 | x1 << 32`; swapped it is `x1 | x0 << 32`.
        let m = _mm256_or_si256(_mm256_and_si256(_mm256_shuffle_epi32::<0xB1>(x), mask), exp);
        let v = _mm256_add_pd(_mm256_mul_pd(_mm256_sub_pd(_mm256_castsi256_pd(m), one), r), l);
        // SAFETY: `i + 4 <= n <= out.len()`.
        unsafe { _mm256_storeu_pd(out.as_mut_ptr().add(i), v) };
        i += 4;
    }
    convert_f64_scalar(&words[2 * i..2 * n], &mut out[i..n], range, low);
}

/// [`convert_f64_scalar`] with AVX-512F, 8 elements (16 words) a step.
#[target_feature(enable = "avx512f")]
pub(super) fn uniform_f64_avx512(_: Avx512, words: &[u32], out: &mut [f64], range: f64, low: f64) {
    let n = out.len().min(words.len() / 2);
    let (mask, exp) = (_mm512_set1_epi64(0x000F_FFFF_FFFF_FFFF), _mm512_set1_epi64(0x3FF0_0000_0000_0000));
    let (one, r, l) = (_mm512_set1_pd(1.0), _mm512_set1_pd(range), _mm512_set1_pd(low));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: words `2i .. 2i + 16` exist because `i + 8 <= n <= words.len() / 2`.
        let x = unsafe { _mm512_loadu_si512(words.as_ptr().add(2 * i).cast()) };
        let m = _mm512_or_si512(_mm512_and_si512(_mm512_shuffle_epi32::<0xB1>(x), mask), exp);
        let v = _mm512_add_pd(_mm512_mul_pd(_mm512_sub_pd(_mm512_castsi512_pd(m), one), r), l);
        // SAFETY: `i + 8 <= n <= out.len()`.
        unsafe { _mm512_storeu_pd(out.as_mut_ptr().add(i), v) };
        i += 8;
    }
    convert_f64_scalar(&words[2 * i..2 * n], &mut out[i..n], range, low);
}

/// [`dropout_f32_scalar`] with AVX2, 8 elements a step; `keep_from` is at most 2^23.
#[target_feature(enable = "avx2")]
pub(super) fn dropout_f32_avx2(_: Avx2, words: &[u32], mut data: InOut<'_, f32>, keep_from: u32, scale: f32) {
    let n = data.len().min(words.len());
    let (src, dst) = data.as_ptrs();
    let (mask, below) = (_mm256_set1_epi32(MANTISSA as i32), _mm256_set1_epi32(keep_from as i32 - 1));
    let (one, s) = (_mm256_set1_ps(1.0), _mm256_set1_ps(scale));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n <= words.len()`.
        let x = unsafe { _mm256_loadu_si256(words.as_ptr().add(i).cast()) };
        // Signed compare: both sides are in [-1, 2^23].
        let keep = _mm256_cmpgt_epi32(_mm256_and_si256(x, mask), below);
        let factor = _mm256_and_ps(_mm256_castsi256_ps(keep), one);
        // SAFETY: the stream's pointers are valid for `data.len() >= i + 8` elements; each
        // element is read before it is written (they may be the same buffer).
        unsafe {
            let d = _mm256_loadu_ps(src.add(i));
            _mm256_storeu_ps(dst.add(i), _mm256_mul_ps(_mm256_mul_ps(d, s), factor));
        }
        i += 8;
    }
    let (_, tail) = data.split_at(i);
    dropout_scalar(&words[i..n], tail, keep_from, scale);
}

/// [`dropout_f32_scalar`] with AVX-512F, 16 elements a step.
#[target_feature(enable = "avx512f")]
pub(super) fn dropout_f32_avx512(_: Avx512, words: &[u32], mut data: InOut<'_, f32>, keep_from: u32, scale: f32) {
    let n = data.len().min(words.len());
    let (src, dst) = data.as_ptrs();
    let (mask, from) = (_mm512_set1_epi32(MANTISSA as i32), _mm512_set1_epi32(keep_from as i32));
    let (one, s) = (_mm512_set1_ps(1.0), _mm512_set1_ps(scale));
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n <= words.len()`.
        let x = unsafe { _mm512_loadu_si512(words.as_ptr().add(i).cast()) };
        let keep = _mm512_cmpge_epu32_mask(_mm512_and_si512(x, mask), from);
        let factor = _mm512_maskz_mov_ps(keep, one);
        // SAFETY: as in the AVX2 loop.
        unsafe {
            let d = _mm512_loadu_ps(src.add(i));
            _mm512_storeu_ps(dst.add(i), _mm512_mul_ps(_mm512_mul_ps(d, s), factor));
        }
        i += 16;
    }
    let (_, tail) = data.split_at(i);
    dropout_scalar(&words[i..n], tail, keep_from, scale);
}

/// [`dropout_f64_scalar`] with AVX2, 4 elements a step.
#[target_feature(enable = "avx2")]
pub(super) fn dropout_f64_avx2(_: Avx2, words: &[u32], mut data: InOut<'_, f64>, keep_from: u32, scale: f64) {
    let n = data.len().min(words.len());
    let (src, dst) = data.as_ptrs();
    let (mask, below) = (_mm_set1_epi32(MANTISSA as i32), _mm_set1_epi32(keep_from as i32 - 1));
    let (one, s) = (_mm256_set1_pd(1.0), _mm256_set1_pd(scale));
    let mut i = 0;
    while i + 4 <= n {
        // SAFETY: `i + 4 <= n <= words.len()`.
        let x = unsafe { _mm_loadu_si128(words.as_ptr().add(i).cast()) };
        let keep = _mm256_cvtepi32_epi64(_mm_cmpgt_epi32(_mm_and_si128(x, mask), below));
        let factor = _mm256_and_pd(_mm256_castsi256_pd(keep), one);
        // SAFETY: as in the float loop.
        unsafe {
            let d = _mm256_loadu_pd(src.add(i));
            _mm256_storeu_pd(dst.add(i), _mm256_mul_pd(_mm256_mul_pd(d, s), factor));
        }
        i += 4;
    }
    let (_, tail) = data.split_at(i);
    dropout_scalar(&words[i..n], tail, keep_from, scale);
}

/// [`dropout_f64_scalar`] with AVX-512F, 8 elements a step.
#[target_feature(enable = "avx512f")]
pub(super) fn dropout_f64_avx512(_: Avx512, words: &[u32], mut data: InOut<'_, f64>, keep_from: u32, scale: f64) {
    let n = data.len().min(words.len());
    let (src, dst) = data.as_ptrs();
    let (mask, from) = (_mm256_set1_epi32(MANTISSA as i32), _mm256_set1_epi32(keep_from as i32));
    let (one, s) = (_mm512_set1_pd(1.0), _mm512_set1_pd(scale));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n <= words.len()`.
        let x = unsafe { _mm256_loadu_si256(words.as_ptr().add(i).cast()) };
        let m = _mm512_cvtepu32_epi64(_mm256_and_si256(x, mask));
        let keep = _mm512_cmpge_epu64_mask(m, _mm512_cvtepu32_epi64(from));
        let factor = _mm512_maskz_mov_pd(keep, one);
        // SAFETY: as in the float loop.
        unsafe {
            let d = _mm512_loadu_pd(src.add(i));
            _mm512_storeu_pd(dst.add(i), _mm512_mul_pd(_mm512_mul_pd(d, s), factor));
        }
        i += 8;
    }
    let (_, tail) = data.split_at(i);
    dropout_scalar(&words[i..n], tail, keep_from, scale);
}

/// Copies `lines` 64-byte lines from `src` to `dst` with non-temporal stores (unfenced).
///
/// # Safety
///
/// `src` is readable and `dst` writable for `64 * lines` bytes, they do not overlap, and
/// `dst` is 64-byte aligned.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn stream_lines_avx512(_: Avx512, src: *const u8, dst: *mut u8, lines: usize) {
    for i in 0..lines {
        // SAFETY: line `i < lines` is inside both ranges, and `dst + 64 i` is aligned.
        unsafe {
            let v = _mm512_loadu_si512(src.add(64 * i).cast());
            _mm512_stream_si512(dst.add(64 * i).cast(), v);
        }
    }
}

/// [`stream_lines_avx512`] with AVX2, two 32-byte stores a line.
///
/// # Safety
///
/// As for [`stream_lines_avx512`].
#[target_feature(enable = "avx2")]
pub(super) unsafe fn stream_lines_avx2(_: Avx2, src: *const u8, dst: *mut u8, lines: usize) {
    for i in 0..lines {
        // SAFETY: line `i < lines` is inside both ranges, and `dst + 64 i` is aligned.
        unsafe {
            let (s, d) = (src.add(64 * i), dst.add(64 * i));
            let lo = _mm256_loadu_si256(s.cast());
            let hi = _mm256_loadu_si256(s.add(32).cast());
            _mm256_stream_si256(d.cast(), lo);
            _mm256_stream_si256(d.add(32).cast(), hi);
        }
    }
}

/// Fences this thread's non-temporal stores (SSE, baseline on x86_64).
pub(super) fn sfence() {
    // SAFETY: SSE is part of the x86_64 baseline.
    unsafe { _mm_sfence() };
}
