//! The 8-bit optimizers' x86 levels: the portable block kernel compiled with AVX2 or
//! AVX-512F enabled (so that the compiler vectorises the update and the absmax, with the
//! portable code's operations in its order: no fused multiply-add is formed without
//! fast-math), with explicit SIMD codecs. AVX-512: dequantisation permutes the map's
//! entries held in registers; quantisation computes codes from the map's structure
//! (`decades`: a few permutes of small tables, no division per element), and redoes a
//! group with a flagged lane by a binary search over the thresholds whose levels are
//! permutes (gathers, tried first, stalled the kernel on the AMD host). AVX2: gathers of the
//! entries, of the bucket's base code and of its threshold (see `map`). Every level gives
//! the reference's bits.

use core::arch::x86_64::*;

use super::adamw::Rule;
use super::decades::{Decades, DELTA, KEY_LOW, SLACK, TWO};
use super::map::{Map, BUCKETS, LOW, ONE};
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

/// Whole groups of 16 of `out = map[codes] * scale`; returns how many were done. The map's
/// 256 entries are 16 registers: 8 two-register permutes pick by the code's low 5 bits, and
/// bits 5, 6 and 7 choose among them (no gather: they stall on some CPUs).
#[target_feature(enable = "avx512f")]
fn dequantize_avx512(_: Avx512, map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) -> usize {
    let n = codes.len().min(out.len());
    let s = _mm512_set1_ps(scale);
    // SAFETY: 16 loads of 16 floats each, within the map's 256 entries.
    let e: [__m512; 16] = core::array::from_fn(|k| unsafe { _mm512_loadu_ps(map.entries.as_ptr().add(16 * k)) });
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: bytes i..i + 16 of `codes` and floats i..i + 16 of `out` are in bounds.
        unsafe {
            let c = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr().add(i).cast()));
            let p: [__m512; 8] = core::array::from_fn(|k| _mm512_permutex2var_ps(e[2 * k], c, e[2 * k + 1]));
            let (b5, b6, b7) = (
                _mm512_test_epi32_mask(c, _mm512_set1_epi32(32)),
                _mm512_test_epi32_mask(c, _mm512_set1_epi32(64)),
                _mm512_test_epi32_mask(c, _mm512_set1_epi32(128)),
            );
            let q: [__m512; 4] = core::array::from_fn(|k| _mm512_mask_blend_ps(b5, p[2 * k], p[2 * k + 1]));
            let r0 = _mm512_mask_blend_ps(b6, q[0], q[1]);
            let r1 = _mm512_mask_blend_ps(b6, q[2], q[3]);
            let v = _mm512_mask_blend_ps(b7, r0, r1);
            _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(v, s));
        }
        i += 16;
    }
    i
}

/// Whole groups of 16 of `codes = map.code(values / d)`; returns how many were done. With
/// the map's [`Decades`] and a divisor whose reciprocal is a normal float, by arithmetic on
/// `values * (1 / d)` ([`decades_avx512`]), a group with a flagged lane again by
/// [`search_avx512`] on `values / d`; otherwise by that search alone.
#[target_feature(enable = "avx512f")]
fn quantize_avx512(t: Avx512, map: &Map, values: &[f32], a: f32, codes: &mut [u8]) -> usize {
    let n = values.len().min(codes.len()) / 16 * 16;
    let d = divisor(a);
    let (values, codes) = (&values[..n], &mut codes[..n]);
    match &map.decades {
        // `1 / d` is normal (and `d` finite, not NaN).
        Some(dec) if (f32::MIN_POSITIVE..=2f32.powi(125)).contains(&d) => {
            let r = _mm512_set1_ps(1.0 / d);
            let tables = DecadeTables::new(t, dec);
            for (v, c) in values.chunks_exact(16).zip(codes.chunks_exact_mut(16)) {
                // SAFETY: `v` holds 16 floats and `c` 16 bytes.
                unsafe {
                    let v = _mm512_loadu_ps(v.as_ptr());
                    let (code, flagged) = decades_avx512(t, &tables, _mm512_mul_ps(v, r));
                    let code =
                        if flagged == 0 { code } else { search_avx512(t, map, _mm512_div_ps(v, _mm512_set1_ps(d))) };
                    _mm_storeu_si128(c.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(code));
                }
            }
        }
        _ => {
            let d = _mm512_set1_ps(d);
            for (v, c) in values.chunks_exact(16).zip(codes.chunks_exact_mut(16)) {
                // SAFETY: `v` holds 16 floats and `c` 16 bytes.
                unsafe {
                    let code = search_avx512(t, map, _mm512_div_ps(_mm512_loadu_ps(v.as_ptr()), d));
                    _mm_storeu_si128(c.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(code));
                }
            }
        }
    }
    n
}

/// [`Decades`]' tables in registers.
#[derive(Clone, Copy)]
pub(super) struct DecadeTables {
    tk: [__m512i; 2],
    level: [__m512i; 2],
    scale: __m512,
    offset: __m512,
    base: [__m512i; 2],
    top: [__m512i; 2],
    /// All ones for the signed map (negative codes count down), zero for the unsigned.
    flip: __m512i,
}

impl DecadeTables {
    #[inline(always)]
    pub(super) fn new(_: Avx512, dec: &Decades) -> Self {
        // SAFETY: every load reads 16 elements within a table of 16 or 32; the token proves
        // the CPU has AVX-512F.
        unsafe {
            let two =
                |t: &[i32; 32]| [_mm512_loadu_si512(t.as_ptr().cast()), _mm512_loadu_si512(t.as_ptr().add(16).cast())];
            Self {
                tk: two(&dec.tk),
                level: two(&dec.level),
                scale: _mm512_loadu_ps(dec.scale.as_ptr()),
                offset: _mm512_loadu_ps(dec.offset.as_ptr()),
                base: two(&dec.base),
                top: two(&dec.top),
                flip: _mm512_set1_epi32(if dec.signed { -1 } else { 0 }),
            }
        }
    }
}

/// The codes of 16 values `y` by the map's structure (see `decades`), and the mask of lanes
/// whose code may be wrong (within [`SLACK`] places of a level boundary, `u` within
/// [`DELTA`] of a whole number, `|y| >= 2` or NaN).
#[inline(always)]
pub(super) fn decades_avx512(_: Avx512, t: &DecadeTables, y: __m512) -> (__m512i, u16) {
    // SAFETY: register operations only; the token proves the CPU has AVX-512F.
    unsafe {
        let bits = _mm512_castps_si512(y);
        let mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fff_ffff));
        // The binade, from 2^-31 (below it too) to [1, 2): the exponent's low 5 bits.
        let binade = _mm512_srli_epi32::<23>(_mm512_max_epu32(mag, _mm512_set1_epi32(KEY_LOW as i32)));
        let from_boundary = _mm512_sub_epi32(mag, _mm512_permutex2var_epi32(t.tk[0], binade, t.tk[1]));
        let above = _mm512_cmpgt_epi32_mask(from_boundary, _mm512_set1_epi32(SLACK));
        let near = _mm512_cmple_epu32_mask(from_boundary, _mm512_set1_epi32(2 * SLACK));
        let beyond = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(TWO as i32));
        let level = _mm512_permutex2var_epi32(t.level[0], binade, t.level[1]);
        let level = _mm512_mask_add_epi32(level, above, level, _mm512_set1_epi32(1));
        let u = _mm512_sub_ps(
            _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_permutexvar_ps(level, t.scale)),
            _mm512_permutexvar_ps(level, t.offset),
        );
        let frac = _mm512_sub_ps(u, _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(u));
        let whole = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(frac), _mm512_set1_ps(DELTA));
        // Negative lanes: the second half of the per-level tables.
        let negative = _mm512_srai_epi32::<31>(bits);
        let row = _mm512_or_si512(level, _mm512_and_si512(negative, _mm512_set1_epi32(16)));
        let j = _mm512_cvttps_epi32(_mm512_max_ps(u, _mm512_setzero_ps()));
        let j = _mm512_min_epi32(j, _mm512_permutex2var_epi32(t.top[0], row, t.top[1]));
        let j = _mm512_xor_si512(j, _mm512_and_si512(negative, t.flip));
        let code = _mm512_add_epi32(_mm512_permutex2var_epi32(t.base[0], row, t.base[1]), j);
        (code, near | whole | beyond)
    }
}

/// The codes of 16 values `y`: the number of thresholds below `y`, found by a branchless
/// binary search whose levels are permutes of registers (`Map::levels`). NaN compares false
/// everywhere (code 0), values beyond 1 pass every finite threshold (code 255), as
/// `Map::code` gives.
#[inline(never)]
#[target_feature(enable = "avx512f")]
fn search_avx512(_: Avx512, map: &Map, y: __m512) -> __m512i {
    let lv = &map.levels;
    // SAFETY: every load reads 16 floats within one level's 128.
    let ld = |k: usize, at: usize| unsafe { _mm512_loadu_ps(lv[k].as_ptr().add(at)) };
    let t0 = _mm512_set1_ps(lv[0][0]);
    let (t1, t2, t3, t4) = (ld(1, 0), ld(2, 0), ld(3, 0), ld(4, 0));
    let t5 = [ld(5, 0), ld(5, 16)];
    let t6: [__m512; 4] = core::array::from_fn(|k| ld(6, 16 * k));
    let t7: [__m512; 8] = core::array::from_fn(|k| ld(7, 16 * k));
    let step = |pos: __m512i, t: __m512, s: i32| {
        _mm512_mask_add_epi32(pos, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(y, t), pos, _mm512_set1_epi32(s))
    };
    let pos = step(_mm512_setzero_si512(), t0, 128);
    let pos = step(pos, _mm512_permutexvar_ps(_mm512_srli_epi32::<7>(pos), t1), 64);
    let pos = step(pos, _mm512_permutexvar_ps(_mm512_srli_epi32::<6>(pos), t2), 32);
    let pos = step(pos, _mm512_permutexvar_ps(_mm512_srli_epi32::<5>(pos), t3), 16);
    let pos = step(pos, _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(pos), t4), 8);
    let pos = step(pos, _mm512_permutex2var_ps(t5[0], _mm512_srli_epi32::<3>(pos), t5[1]), 4);
    let j = _mm512_srli_epi32::<2>(pos);
    let hi = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
    let t = _mm512_mask_blend_ps(hi, _mm512_permutex2var_ps(t6[0], j, t6[1]), _mm512_permutex2var_ps(t6[2], j, t6[3]));
    let pos = step(pos, t, 2);
    let j = _mm512_srli_epi32::<1>(pos);
    let p: [__m512; 4] = core::array::from_fn(|k| _mm512_permutex2var_ps(t7[2 * k], j, t7[2 * k + 1]));
    let b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
    let b6 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(64));
    let lo = _mm512_mask_blend_ps(b5, p[0], p[1]);
    let hi = _mm512_mask_blend_ps(b5, p[2], p[3]);
    step(pos, _mm512_mask_blend_ps(b6, lo, hi), 1)
}

/// The arithmetic quantiser's codes and flags of whole groups of 16 of `y` (tests).
#[cfg(test)]
#[target_feature(enable = "avx512f")]
pub(super) fn decades_lanes(t: Avx512, dec: &Decades, y: &[f32], codes: &mut [u8], flags: &mut [u16]) {
    let tables = DecadeTables::new(t, dec);
    for ((y, c), f) in y.chunks_exact(16).zip(codes.chunks_exact_mut(16)).zip(flags.iter_mut()) {
        // SAFETY: `y` holds 16 floats and `c` 16 bytes.
        unsafe {
            let (code, flagged) = decades_avx512(t, &tables, _mm512_loadu_ps(y.as_ptr()));
            _mm_storeu_si128(c.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(code));
            *f = flagged;
        }
    }
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
