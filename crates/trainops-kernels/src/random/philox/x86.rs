//! The x86_64 kernels.
//!
//! Each of a block's four words lives in its own vector, one block per 64-bit lane with the
//! word in the lane's low half: `mul_epu32` then gives the whole 32x32->64 product in place,
//! `lo` in the low half and `hi` in the high half, and nothing ever reads a high half except
//! to take `hi` from a product. A round on 8 (AVX-512) or 4 (AVX2) blocks is then two
//! multiplies, two shuffles (`hi` to the low half) and two three-way XORs.
//!
//! The last round also packs the output: rotating a product by 32 bits puts `hi` in the low
//! half and `lo` in the high half, so one masked XOR on the low halves gives the lane
//! `[c0', c1']` (resp. `[c2', c3']`), and `unpack{lo,hi}_epi64` of the two pairs gives whole
//! blocks. Blocks are put in lanes in the order that makes those unpacks write them in
//! sequence, with no cross-lane permute.
//!
//! Several independent sets of blocks are interleaved per batch to cover the multiplies'
//! latency (measured on a Xeon with AVX-512: 7 sets of 8 blocks; for AVX2, 2 sets of 4 did as well as
//! 3, and 4 spilled).

use std::arch::x86_64::*;

use super::{round_keys, words, M0, M1, ROUNDS};
use crate::simd::{Avx2, Avx512};

/// `shuffle_epi32` immediate that copies the high half of each 64-bit lane into its low half.
/// A shuffle rather than a 32-bit shift: on Intel cores 512-bit shifts share port 0 with the
/// multiplies, shuffles run on port 5.
const HI_TO_LO: i32 = 0xF5;
/// `shuffle_epi32` immediate that swaps the halves of each 64-bit lane.
const SWAP: i32 = 0xB1;

/// Sets of 8 blocks per AVX-512 batch.
const SETS_512: usize = 7;
/// Blocks per AVX-512 batch.
const BATCH_512: usize = 8 * SETS_512;
/// Sets of 4 blocks per AVX2 batch.
const SETS_256: usize = 2;
/// Blocks per AVX2 batch.
const BATCH_256: usize = 4 * SETS_256;

/// Fills `out` with the blocks of counters `counter, counter + 1, ..` under `key`; when
/// `stream` and `out` starts on a cache line, whole batches go out with non-temporal stores
/// (a batch is 14 whole lines, so every one stays aligned), fenced before returning.
#[target_feature(enable = "avx512f")]
pub(super) fn philox_avx512(_: Avx512, counter: u128, key: [u32; 2], out: &mut [u32], stream: bool) {
    let mut keys = [(_mm512_setzero_si512(), _mm512_setzero_si512()); ROUNDS];
    for (k, [k0, k1]) in keys.iter_mut().zip(round_keys(key)) {
        *k = (_mm512_set1_epi32(k0 as i32), _mm512_set1_epi32(k1 as i32));
    }
    let start = Start512::new(key);
    let mut counter = counter;
    let stream = stream && out.as_ptr().cast::<u8>().align_offset(64) == 0;
    let mut batches = out.chunks_exact_mut(4 * BATCH_512);
    for dst in &mut batches {
        let dst: &mut [u32; 4 * BATCH_512] = dst.try_into().expect("chunks_exact_mut gives whole batches");
        if stream {
            batch512::<true>(counter, &keys, &start, dst);
        } else {
            batch512::<false>(counter, &keys, &start, dst);
        }
        counter = counter.wrapping_add(BATCH_512 as u128);
    }
    let tail = batches.into_remainder();
    if !tail.is_empty() {
        let mut buf = [0u32; 4 * BATCH_512];
        batch512::<false>(counter, &keys, &start, &mut buf);
        tail.copy_from_slice(&buf[..tail.len()]);
    }
    if stream {
        // Non-temporal stores are weakly ordered: fence them before anyone is told the
        // output is written.
        _mm_sfence();
    }
}

/// The counter words of blocks `counter .. counter + BATCH_512`: set `s` holds blocks
/// `8 * s + [0, 4, 1, 5, 2, 6, 3, 7]`, one per lane.
#[target_feature(enable = "avx512f")]
#[inline]
fn counters512(counter: u128) -> [[__m512i; 4]; SETS_512] {
    let [w0, w1, w2, w3] = words(counter);
    // Each word zero-extended to 64 bits, so that bit 32 of a lane is the carry out of it.
    let [c0, c1, c2, c3] = [w0, w1, w2, w3].map(|w| _mm512_set1_epi64(i64::from(w)));
    let carries = w0 > u32::MAX - BATCH_512 as u32;
    let mut x = [[c0; 4]; SETS_512];
    for (s, set) in x.iter_mut().enumerate() {
        let offsets = _mm512_add_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), _mm512_set1_epi64(8 * s as i64));
        let c0 = _mm512_add_epi64(c0, offsets);
        *set = if carries {
            // A carry out of the low word within this batch: ripple it up, lane by lane.
            let c1 = _mm512_add_epi64(c1, _mm512_srli_epi64::<32>(c0));
            let c2 = _mm512_add_epi64(c2, _mm512_srli_epi64::<32>(c1));
            let c3 = _mm512_add_epi64(c3, _mm512_srli_epi64::<32>(c2));
            [c0, c1, c2, c3]
        } else {
            [c0, c1, c2, c3]
        };
    }
    x
}

/// What the first two rounds of every batch share within one call: the round keys as
/// words, and each set's block offsets times `M0`.
struct Start512 {
    keys: [[u32; 2]; ROUNDS],
    /// `offsets * M0` per set, the offsets as in [`counters512`] (exact: below 2^38).
    offset_m0: [__m512i; SETS_512],
}

impl Start512 {
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn new(key: [u32; 2]) -> Self {
        let m0 = _mm512_set1_epi64(i64::from(M0));
        let offset_m0 = core::array::from_fn(|s| {
            let offsets = _mm512_add_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), _mm512_set1_epi64(8 * s as i64));
            _mm512_mul_epu32(offsets, m0)
        });
        Start512 { keys: round_keys(key), offset_m0 }
    }
}

/// The blocks `counter .. counter + BATCH_512` after their first two rounds, in the lanes of
/// [`counters512`].
///
/// Within a batch whose low counter word does not carry, words 1, 2 and 3 of every block are
/// the same, so much of the first two rounds is the same for every lane and is computed once,
/// in scalar code: round 1's product of word 2 (and so its new words 0 and 1), and round 2's
/// product of that word 0 (and so its new word 3, and what its new word 2 XORs in). Round 1's
/// product of word 0 needs no multiply either: `(w0 + offset) * M0 = w0 * M0 + offset * M0`
/// exactly, in 64 bits. Per set of 8 blocks the two rounds then take 7 vector operations
/// instead of 12 and the counters' addition: on cores that run 512-bit integer operations on
/// two ports, the generator's limit. A batch that carries takes the general rounds.
#[target_feature(enable = "avx512f")]
#[inline]
fn start512(counter: u128, keys: &[(__m512i, __m512i); ROUNDS], start: &Start512) -> [[__m512i; 4]; SETS_512] {
    let [w0, w1, w2, w3] = words(counter);
    if w0 > u32::MAX - BATCH_512 as u32 {
        let mut x = counters512(counter);
        round512(&mut x, keys[0]);
        round512(&mut x, keys[1]);
        return x;
    }
    let mul = |a: u32, m: u32| u64::from(a) * u64::from(m);
    let ([k0, k1], [l0, l1]) = (start.keys[0], start.keys[1]);
    // Round 1, the lanes' shared half: word 2's product gives word 0 and word 1.
    let q1 = mul(w2, M1);
    let (a0, a1) = ((q1 >> 32) as u32 ^ w1 ^ k0, q1 as u32);
    // Round 2, the shared half: word 0's product gives word 3, and word 2's XOR terms.
    let q0 = mul(a0, M0);
    let (b2, b3) = ((q0 >> 32) as u32 ^ l1, q0 as u32);
    let (w0_m0, w3_k1, a1_l0) = (
        _mm512_set1_epi64(mul(w0, M0) as i64),
        _mm512_set1_epi32((w3 ^ k1) as i32),
        _mm512_set1_epi32((a1 ^ l0) as i32),
    );
    let (b2, b3) = (_mm512_set1_epi32(b2 as i32), _mm512_set1_epi32(b3 as i32));
    let m1 = _mm512_set1_epi64(i64::from(M1));
    core::array::from_fn(|s| {
        // Round 1: word 0's product, its high half into word 2; word 3 is its low half.
        let p0 = _mm512_add_epi64(w0_m0, start.offset_m0[s]);
        let a2 = _mm512_xor_si512(_mm512_shuffle_epi32::<HI_TO_LO>(p0), w3_k1);
        // Round 2: word 2's product, its high half into word 0; word 1 is its low half;
        // word 2 is round 1's word 3 (the low half of `p0`) XOR the shared terms.
        let p1 = _mm512_mul_epu32(a2, m1);
        let c0 = _mm512_xor_si512(_mm512_shuffle_epi32::<HI_TO_LO>(p1), a1_l0);
        [c0, p1, _mm512_xor_si512(p0, b2), b3]
    })
}

/// One round on every set.
#[target_feature(enable = "avx512f")]
#[inline]
fn round512(x: &mut [[__m512i; 4]; SETS_512], (k0, k1): (__m512i, __m512i)) {
    let (m0, m1) = (_mm512_set1_epi64(i64::from(M0)), _mm512_set1_epi64(i64::from(M1)));
    for c in x {
        let (p0, p1) = (_mm512_mul_epu32(c[0], m0), _mm512_mul_epu32(c[2], m1));
        // 0x96: a ^ b ^ c.
        let c0 = _mm512_ternarylogic_epi64::<0x96>(_mm512_shuffle_epi32::<HI_TO_LO>(p1), c[1], k0);
        let c2 = _mm512_ternarylogic_epi64::<0x96>(_mm512_shuffle_epi32::<HI_TO_LO>(p0), c[3], k1);
        *c = [c0, p1, c2, p0];
    }
}

/// Blocks `counter .. counter + BATCH_512` into `dst`, with non-temporal stores when `NT`
/// (then `dst` must start on a 64-byte boundary, which `philox_avx512` checked).
#[target_feature(enable = "avx512f")]
#[inline]
fn batch512<const NT: bool>(
    counter: u128,
    keys: &[(__m512i, __m512i); ROUNDS],
    start: &Start512,
    dst: &mut [u32; 4 * BATCH_512],
) {
    let mut x = start512(counter, keys, start);
    // Written out: left as a loop, the rounds are not unrolled and pay register copies.
    round512(&mut x, keys[2]);
    round512(&mut x, keys[3]);
    round512(&mut x, keys[4]);
    round512(&mut x, keys[5]);
    round512(&mut x, keys[6]);
    round512(&mut x, keys[7]);
    round512(&mut x, keys[8]);
    // The last round, packing each block's words into two lanes of two vectors.
    let (k0, k1) = keys[9];
    let (m0, m1) = (_mm512_set1_epi64(i64::from(M0)), _mm512_set1_epi64(i64::from(M1)));
    for (s, c) in x.into_iter().enumerate() {
        let (p0, p1) = (_mm512_mul_epu32(c[0], m0), _mm512_mul_epu32(c[2], m1));
        // Rotated products are `[hi, lo]`; the low halves (mask 0x5555) become
        // `hi ^ c ^ k`, the high halves keep `lo`.
        let c01 = _mm512_mask_ternarylogic_epi32::<0x96>(_mm512_rol_epi64::<32>(p1), 0x5555, c[1], k0);
        let c23 = _mm512_mask_ternarylogic_epi32::<0x96>(_mm512_rol_epi64::<32>(p0), 0x5555, c[3], k1);
        // Lanes 0, 2, 4, 6 hold blocks 0..4 of a set and lanes 1, 3, 5, 7 blocks 4..8.
        let (lo, hi) = (_mm512_unpacklo_epi64(c01, c23), _mm512_unpackhi_epi64(c01, c23));
        // SAFETY: `dst` holds `32 * SETS_512` words and these write words
        // `32 * s .. 32 * s + 32`, `s < SETS_512`; `storeu` needs no alignment, and with
        // `NT` `dst` starts on a 64-byte boundary (the caller), so both 64-byte stores do.
        unsafe {
            let at = dst.as_mut_ptr().add(32 * s);
            if NT {
                _mm512_stream_si512(at.cast(), lo);
                _mm512_stream_si512(at.add(16).cast(), hi);
            } else {
                _mm512_storeu_si512(at.cast(), lo);
                _mm512_storeu_si512(at.add(16).cast(), hi);
            }
        }
    }
}

/// Fills `out` with the blocks of counters `counter, counter + 1, ..` under `key`; when
/// `stream` and `out` starts on a cache line, whole batches go out with non-temporal stores
/// (a batch is 2 whole lines), fenced before returning.
#[target_feature(enable = "avx2")]
pub(super) fn philox_avx2(_: Avx2, counter: u128, key: [u32; 2], out: &mut [u32], stream: bool) {
    let mut keys = [(_mm256_setzero_si256(), _mm256_setzero_si256()); ROUNDS];
    for (k, [k0, k1]) in keys.iter_mut().zip(round_keys(key)) {
        *k = (_mm256_set1_epi32(k0 as i32), _mm256_set1_epi32(k1 as i32));
    }
    let mut counter = counter;
    let stream = stream && out.as_ptr().cast::<u8>().align_offset(64) == 0;
    let mut batches = out.chunks_exact_mut(4 * BATCH_256);
    for dst in &mut batches {
        let dst: &mut [u32; 4 * BATCH_256] = dst.try_into().expect("chunks_exact_mut gives whole batches");
        if stream {
            batch256::<true>(counter, &keys, dst);
        } else {
            batch256::<false>(counter, &keys, dst);
        }
        counter = counter.wrapping_add(BATCH_256 as u128);
    }
    let tail = batches.into_remainder();
    if !tail.is_empty() {
        let mut buf = [0u32; 4 * BATCH_256];
        batch256::<false>(counter, &keys, &mut buf);
        tail.copy_from_slice(&buf[..tail.len()]);
    }
    if stream {
        // Non-temporal stores are weakly ordered: fence them before anyone is told the
        // output is written.
        _mm_sfence();
    }
}

/// The counter words of blocks `counter .. counter + BATCH_256`: set `s` holds blocks
/// `4 * s + [0, 2, 1, 3]`, one per lane.
#[target_feature(enable = "avx2")]
#[inline]
fn counters256(counter: u128) -> [[__m256i; 4]; SETS_256] {
    let [w0, w1, w2, w3] = words(counter);
    // Each word zero-extended to 64 bits, so that bit 32 of a lane is the carry out of it.
    let [c0, c1, c2, c3] = [w0, w1, w2, w3].map(|w| _mm256_set1_epi64x(i64::from(w)));
    let carries = w0 > u32::MAX - BATCH_256 as u32;
    let mut x = [[c0; 4]; SETS_256];
    for (s, set) in x.iter_mut().enumerate() {
        let offsets = _mm256_add_epi64(_mm256_setr_epi64x(0, 2, 1, 3), _mm256_set1_epi64x(4 * s as i64));
        let c0 = _mm256_add_epi64(c0, offsets);
        *set = if carries {
            // A carry out of the low word within this batch: ripple it up, lane by lane.
            let c1 = _mm256_add_epi64(c1, _mm256_srli_epi64::<32>(c0));
            let c2 = _mm256_add_epi64(c2, _mm256_srli_epi64::<32>(c1));
            let c3 = _mm256_add_epi64(c3, _mm256_srli_epi64::<32>(c2));
            [c0, c1, c2, c3]
        } else {
            [c0, c1, c2, c3]
        };
    }
    x
}

/// One round on every set.
#[target_feature(enable = "avx2")]
#[inline]
fn round256(x: &mut [[__m256i; 4]; SETS_256], (k0, k1): (__m256i, __m256i)) {
    let (m0, m1) = (_mm256_set1_epi64x(i64::from(M0)), _mm256_set1_epi64x(i64::from(M1)));
    for c in x {
        let (p0, p1) = (_mm256_mul_epu32(c[0], m0), _mm256_mul_epu32(c[2], m1));
        let c0 = _mm256_xor_si256(_mm256_shuffle_epi32::<HI_TO_LO>(p1), _mm256_xor_si256(c[1], k0));
        let c2 = _mm256_xor_si256(_mm256_shuffle_epi32::<HI_TO_LO>(p0), _mm256_xor_si256(c[3], k1));
        *c = [c0, p1, c2, p0];
    }
}

/// Blocks `counter .. counter + BATCH_256` into `dst`, with non-temporal stores when `NT`
/// (then `dst` must start on a 64-byte boundary, which `philox_avx2` checked).
#[target_feature(enable = "avx2")]
#[inline]
fn batch256<const NT: bool>(counter: u128, keys: &[(__m256i, __m256i); ROUNDS], dst: &mut [u32; 4 * BATCH_256]) {
    let mut x = counters256(counter);
    // Written out: left as a loop, the rounds are not unrolled and pay register copies.
    round256(&mut x, keys[0]);
    round256(&mut x, keys[1]);
    round256(&mut x, keys[2]);
    round256(&mut x, keys[3]);
    round256(&mut x, keys[4]);
    round256(&mut x, keys[5]);
    round256(&mut x, keys[6]);
    round256(&mut x, keys[7]);
    round256(&mut x, keys[8]);
    // The last round, packing each block's words into two lanes of two vectors.
    let (k0, k1) = keys[9];
    let (m0, m1) = (_mm256_set1_epi64x(i64::from(M0)), _mm256_set1_epi64x(i64::from(M1)));
    for (s, c) in x.into_iter().enumerate() {
        let (p0, p1) = (_mm256_mul_epu32(c[0], m0), _mm256_mul_epu32(c[2], m1));
        // Swapped products are `[hi, lo]`; the low halves become `hi ^ c ^ k` and the blend
        // (0xAA) keeps `lo` in the high halves.
        let (s0, s1) = (_mm256_shuffle_epi32::<SWAP>(p0), _mm256_shuffle_epi32::<SWAP>(p1));
        let c01 = _mm256_blend_epi32::<0xAA>(_mm256_xor_si256(s1, _mm256_xor_si256(c[1], k0)), s1);
        let c23 = _mm256_blend_epi32::<0xAA>(_mm256_xor_si256(s0, _mm256_xor_si256(c[3], k1)), s0);
        // Lanes 0, 2 hold blocks 0, 1 of a set and lanes 1, 3 blocks 2, 3.
        let (lo, hi) = (_mm256_unpacklo_epi64(c01, c23), _mm256_unpackhi_epi64(c01, c23));
        // SAFETY: `dst` holds `16 * SETS_256` words and these write words
        // `16 * s .. 16 * s + 16`, `s < SETS_256`; `storeu` needs no alignment, and with
        // `NT` `dst` starts on a 64-byte boundary (the caller), so both 32-byte stores are
        // 32-byte aligned.
        unsafe {
            let at = dst.as_mut_ptr().add(16 * s);
            if NT {
                _mm256_stream_si256(at.cast(), lo);
                _mm256_stream_si256(at.add(8).cast(), hi);
            } else {
                _mm256_storeu_si256(at.cast(), lo);
                _mm256_storeu_si256(at.add(8).cast(), hi);
            }
        }
    }
}
