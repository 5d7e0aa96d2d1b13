//! The 8-bit optimizers' x86 levels: the portable block kernel compiled with AVX2 or
//! AVX-512F enabled (so that the compiler vectorises the update and the absmax, with the
//! portable code's operations in its order: no fused multiply-add is formed without
//! fast-math), with explicit SIMD codecs: dequantisation gathers the map's entries,
//! quantisation gathers the bucket's base code and its threshold (see `map`) and adds the
//! comparison. Every level gives the reference's bits.

use core::arch::x86_64::*;

use super::adamw::Rule;
use super::map::{Map, BUCKETS, LOW, ONE, SHIFT};
use super::{blocks_8bit, divisor, Codec, Param8bit, Portable};
use crate::simd::{Avx2, Avx512};
use crate::Element;

/// [`blocks_8bit`] with AVX2.
#[target_feature(enable = "avx2")]
pub(super) fn blocks_8bit_avx2<R: Rule, G: Element<C = f32>>(t: Avx2, rule: &R, p: Param8bit<'_, G>) {
    blocks_8bit(t, rule, p);
}

/// [`blocks_8bit`] with AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) fn blocks_8bit_avx512<R: Rule, G: Element<C = f32>>(t: Avx512, rule: &R, p: Param8bit<'_, G>) {
    blocks_8bit(t, rule, p);
}

impl Codec for Avx512 {
    #[inline(always)]
    fn dequantize(self, map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) {
        // SAFETY: the token proves the CPU has AVX-512F.
        let done = unsafe { dequantize_avx512(self, map, codes, scale, out) };
        Portable.dequantize(map, &codes[done..], scale, &mut out[done..]);
    }

    #[inline(always)]
    fn quantize(self, map: &Map, values: &[f32], a: f32, codes: &mut [u8]) {
        // SAFETY: the token proves the CPU has AVX-512F.
        let done = unsafe { quantize_avx512(self, map, values, a, codes) };
        Portable.quantize(map, &values[done..], a, &mut codes[done..]);
    }
}

impl Codec for Avx2 {
    #[inline(always)]
    fn dequantize(self, map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) {
        // SAFETY: the token proves the CPU has AVX2.
        let done = unsafe { dequantize_avx2(self, map, codes, scale, out) };
        Portable.dequantize(map, &codes[done..], scale, &mut out[done..]);
    }

    #[inline(always)]
    fn quantize(self, map: &Map, values: &[f32], a: f32, codes: &mut [u8]) {
        // SAFETY: the token proves the CPU has AVX2.
        let done = unsafe { quantize_avx2(self, map, values, a, codes) };
        Portable.quantize(map, &values[done..], a, &mut codes[done..]);
    }
}

/// Whole groups of 16 of `out = map[codes] * scale`; returns how many were done.
#[target_feature(enable = "avx512f")]
fn dequantize_avx512(_: Avx512, map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) -> usize {
    let n = codes.len().min(out.len());
    let s = _mm512_set1_ps(scale);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: bytes i..i + 16 of `codes` and floats i..i + 16 of `out` are in bounds;
        // every gathered index is a byte, below the map's 256 entries.
        unsafe {
            let c = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr().add(i).cast()));
            let e = _mm512_i32gather_ps::<4>(c, map.entries.as_ptr());
            _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(e, s));
        }
        i += 16;
    }
    i
}

/// Whole groups of 16 of `codes = map.code(values / d)`; returns how many were done.
#[target_feature(enable = "avx512f")]
fn quantize_avx512(_: Avx512, map: &Map, values: &[f32], a: f32, codes: &mut [u8]) -> usize {
    let n = values.len().min(codes.len());
    let d = _mm512_set1_ps(divisor(a));
    let (magnitude, one, low) =
        (_mm512_set1_epi32(0x7fff_ffff), _mm512_set1_epi32(ONE as i32), _mm512_set1_epi32(LOW as i32));
    let (buckets, bit, top) = (_mm512_set1_epi32(BUCKETS as i32), _mm512_set1_epi32(1), _mm512_set1_epi32(255));
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: floats i..i + 16 of `values` and bytes i..i + 16 of `codes` are in
        // bounds; gathers run only in lanes whose magnitude is below one, whose bucket is
        // below 2 * BUCKETS, and read 4 bytes of `base` (padded by 3) and thresholds
        // indexed by a byte (256 of them).
        unsafe {
            let y = _mm512_div_ps(_mm512_loadu_ps(values.as_ptr().add(i)), d);
            let bits = _mm512_castps_si512(y);
            let mag = _mm512_and_si512(bits, magnitude);
            let inside = _mm512_cmplt_epu32_mask(mag, one);
            let sign = _mm512_and_si512(_mm512_srai_epi32::<31>(bits), buckets);
            let bucket =
                _mm512_add_epi32(_mm512_srli_epi32::<SHIFT>(_mm512_sub_epi32(_mm512_max_epu32(mag, low), low)), sign);
            let base =
                _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), inside, bucket, map.base.as_ptr().cast());
            let base = _mm512_and_si512(base, top);
            let t = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), inside, base, map.thresholds.as_ptr());
            let above = _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(inside, y, t);
            let code = _mm512_mask_add_epi32(base, above, base, bit);
            // Outside [-1, 1] (or NaN): 255 above zero, else 0.
            let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(y, _mm512_setzero_ps());
            let end = _mm512_maskz_mov_epi32(positive, top);
            let code = _mm512_mask_blend_epi32(inside, end, code);
            _mm_storeu_si128(codes.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi8(code));
        }
        i += 16;
    }
    i
}

/// Whole groups of 8 of `out = map[codes] * scale`; returns how many were done.
#[target_feature(enable = "avx2")]
fn dequantize_avx2(_: Avx2, map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) -> usize {
    let n = codes.len().min(out.len());
    let s = _mm256_set1_ps(scale);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: bytes i..i + 8 of `codes` and floats i..i + 8 of `out` are in bounds;
        // every gathered index is a byte, below the map's 256 entries.
        unsafe {
            let c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(codes.as_ptr().add(i).cast()));
            let e = _mm256_i32gather_ps::<4>(map.entries.as_ptr(), c);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(e, s));
        }
        i += 8;
    }
    i
}

/// Whole groups of 8 of `codes = map.code(values / d)`; returns how many were done.
#[target_feature(enable = "avx2")]
fn quantize_avx2(_: Avx2, map: &Map, values: &[f32], a: f32, codes: &mut [u8]) -> usize {
    let n = values.len().min(codes.len());
    let d = _mm256_set1_ps(divisor(a));
    let magnitude = _mm256_set1_epi32(0x7fff_ffff);
    // Unsigned `mag < ONE` as a signed comparison: magnitudes are below 2^31.
    let (one, low) = (_mm256_set1_epi32(ONE as i32), _mm256_set1_epi32(LOW as i32));
    let (buckets, top) = (_mm256_set1_epi32(BUCKETS as i32), _mm256_set1_epi32(255));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: floats i..i + 8 of `values` and bytes i..i + 8 of `codes` are in bounds;
        // gathers run only in lanes whose magnitude is below one (see `quantize_avx512`).
        unsafe {
            let y = _mm256_div_ps(_mm256_loadu_ps(values.as_ptr().add(i)), d);
            let bits = _mm256_castps_si256(y);
            let mag = _mm256_and_si256(bits, magnitude);
            let inside = _mm256_cmpgt_epi32(one, mag);
            let sign = _mm256_and_si256(_mm256_srai_epi32::<31>(bits), buckets);
            let bucket =
                _mm256_add_epi32(_mm256_srli_epi32::<16>(_mm256_sub_epi32(_mm256_max_epu32(mag, low), low)), sign);
            let zero = _mm256_setzero_si256();
            let base = _mm256_mask_i32gather_epi32::<1>(zero, map.base.as_ptr().cast(), bucket, inside);
            let base = _mm256_and_si256(base, top);
            let t = _mm256_mask_i32gather_ps::<4>(
                _mm256_setzero_ps(),
                map.thresholds.as_ptr(),
                base,
                _mm256_castsi256_ps(inside),
            );
            // `y > t` in the inside lanes is all ones (-1): subtracting it adds one.
            let above = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(y, t)), inside);
            let code = _mm256_sub_epi32(base, above);
            let positive = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(y, _mm256_setzero_ps()));
            let end = _mm256_and_si256(positive, top);
            let code = _mm256_blendv_epi8(end, code, inside);
            // 8 lanes of 0..=255 to 8 bytes: pack to 16 then 8 bits within lanes, then
            // take byte 0..4 of each 128-bit half.
            let packed = _mm256_packus_epi16(_mm256_packus_epi32(code, zero), zero);
            let lo = _mm256_castsi256_si128(packed);
            let hi = _mm256_extracti128_si256::<1>(packed);
            let both = _mm_unpacklo_epi32(lo, hi);
            _mm_storel_epi64(codes.as_mut_ptr().add(i).cast(), both);
        }
        i += 8;
    }
    i
}
