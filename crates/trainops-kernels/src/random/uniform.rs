//! `PhiloxUniform`: element `i` is `u * (high - low) + low` with `u = f32(word(i))`,
//! `f16(word(i))`, `bf16(word(i))` or `f64(word(2i), word(2i+1))`. For float the range, the
//! product and the sum are each rounded to float32; for double they are float64; for the
//! 16-bit types they are float32, rounded once to the output type at the end.
//!
//! Every level gives the bits of [`reference()`]: the SIMD loops do the same IEEE operations
//! (a multiply, then an add: never fused) on the same values.

use half::{bf16, f16};

use super::convert::{
    bf16_of, convert_f32_scalar, convert_f64_scalar, f16_of, f32_of, f64_of, Bits, Half, BF16_BITS, F16_BITS, F32_BITS,
};
use super::draw::{fill_piece, for_each_sub, split_out, Fenced, Output, Words, SUB};
use super::philox::{self, reference as philox_ref, Level, Stores};
use crate::simd::Isa;
use crate::Parallelism;

/// Words consumed by an output: one per element, two for double.
pub fn words_for(out: &Output<'_>) -> usize {
    words_kind(out).of(out.len())
}

fn words_kind(out: &Output<'_>) -> Words {
    if matches!(out, Output::F64(_)) {
        Words::Two
    } else {
        Words::One
    }
}

/// Fills `out` from `state` at the [`philox::detected`] level; returns the next state.
pub fn fill(state: &[u32; 6], low: f32, high: f32, out: Output<'_>, par: &dyn Parallelism) -> [u32; 6] {
    fill_with(philox::detected(), state, low, high, out, par)
}

/// [`fill`] at a given level. Outputs of [`philox::STREAM_BYTES`] or more go out with
/// non-temporal stores, as Philox's own; the bits are the same either way.
///
/// # Panics
///
/// When `level` is not available on this CPU.
pub fn fill_with(
    level: Level,
    state: &[u32; 6],
    low: f32,
    high: f32,
    out: Output<'_>,
    par: &dyn Parallelism,
) -> [u32; 6] {
    fill_stores(level, Stores::Auto, state, low, high, out, par)
}

/// [`fill_with`] with the store policy given (benchmarks force each to measure the
/// threshold; [`Stores::Streaming`] streams at any size on a SIMD level).
///
/// # Panics
///
/// When `level` is not available on this CPU.
pub fn fill_stores(
    level: Level,
    stores: Stores,
    state: &[u32; 6],
    low: f32,
    high: f32,
    out: Output<'_>,
    par: &dyn Parallelism,
) -> [u32; 6] {
    let isa = level.isa().unwrap_or_else(|| panic!("uniform: {level:?} is not available on this CPU"));
    let words = words_kind(&out);
    let range = high - low;
    match out {
        Output::F32(o) => split_out(isa, stores, state, o, words, par, |s, p, stream| match isa {
            // AVX-512: the conversion loop's own stores stream, no copy through a buffer.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(token) if stream => {
                let _fenced = Fenced;
                for_each_sub(level, s, p.len(), words, |w, start, n| {
                    // SAFETY: the token proves the CPU has AVX-512F.
                    unsafe {
                        super::x86::uniform_f32_avx512::<true>(
                            token,
                            w,
                            &mut p[start..start + n],
                            F32_BITS,
                            range,
                            low,
                        );
                    }
                });
            }
            _ => fill_piece(level, stream, s, p, words, |w, o| convert_f32(isa, w, o, F32_BITS, range, low)),
        }),
        Output::F16(o) => split_out(isa, stores, state, o, words, par, |s, p, stream| {
            half_piece(level, isa, stream, s, p, F16_BITS, range, low);
        }),
        Output::BF16(o) => split_out(isa, stores, state, o, words, par, |s, p, stream| {
            half_piece(level, isa, stream, s, p, BF16_BITS, range, low);
        }),
        Output::F64(o) => {
            let (low, range) = (f64::from(low), f64::from(high) - f64::from(low));
            split_out(isa, stores, state, o, words, par, |s, p, stream| {
                fill_piece(level, stream, s, p, words, |w, o| convert_f64(isa, w, o, range, low));
            })
        }
    }
}

/// A 16-bit output through a float32 buffer, rounded once at the end.
#[allow(clippy::too_many_arguments)]
fn half_piece<H: Half + Default>(
    level: Level,
    isa: Isa,
    stream: bool,
    state: &[u32; 6],
    out: &mut [H],
    bits: Bits,
    range: f32,
    low: f32,
) {
    let mut tmp = [0f32; SUB];
    fill_piece(level, stream, state, out, Words::One, |w, o| {
        let t = &mut tmp[..o.len()];
        convert_f32(isa, w, t, bits, range, low);
        H::store(t, o);
    });
}

/// `out[i] = u(words[i]) * range + low` in float32.
pub(crate) fn convert_f32(isa: Isa, words: &[u32], out: &mut [f32], bits: Bits, range: f32, low: f32) {
    debug_assert_eq!(words.len(), out.len());
    match isa {
        Isa::Scalar => convert_f32_scalar(words, out, bits, range, low),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2.
        Isa::Avx2(token) => unsafe { super::x86::uniform_f32_avx2(token, words, out, bits, range, low) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(token) => unsafe { super::x86::uniform_f32_avx512::<false>(token, words, out, bits, range, low) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2(_) | Isa::Avx512(_) => unreachable!("SIMD levels are never available off x86_64"),
    }
}

/// `out[i] = f64(words[2i], words[2i+1]) * range + low` in float64.
pub(crate) fn convert_f64(isa: Isa, words: &[u32], out: &mut [f64], range: f64, low: f64) {
    debug_assert_eq!(words.len(), 2 * out.len());
    match isa {
        Isa::Scalar => convert_f64_scalar(words, out, range, low),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2.
        Isa::Avx2(token) => unsafe { super::x86::uniform_f64_avx2(token, words, out, range, low) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(token) => unsafe { super::x86::uniform_f64_avx512(token, words, out, range, low) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2(_) | Isa::Avx512(_) => unreachable!("SIMD levels are never available off x86_64"),
    }
}

/// The contract written out element by element on Philox's scalar reference, for tests.
pub fn reference(state: &[u32; 6], low: f32, high: f32, out: Output<'_>) -> [u32; 6] {
    let mut words = vec![0u32; words_for(&out)];
    let next = philox_ref::fill(state, &mut words);
    let range32 = high - low;
    match out {
        Output::F32(o) => o.iter_mut().zip(&words).for_each(|(o, &x)| *o = f32_of(x) * range32 + low),
        Output::F16(o) => {
            o.iter_mut().zip(&words).for_each(|(o, &x)| *o = f16::from_f32(f16_of(x).to_f32() * range32 + low))
        }
        Output::BF16(o) => {
            o.iter_mut().zip(&words).for_each(|(o, &x)| *o = bf16::from_f32(bf16_of(x).to_f32() * range32 + low))
        }
        Output::F64(o) => {
            let range = f64::from(high) - f64::from(low);
            o.iter_mut().zip(words.chunks_exact(2)).for_each(|(o, x)| *o = f64_of(x[0], x[1]) * range + f64::from(low))
        }
    }
    next
}
