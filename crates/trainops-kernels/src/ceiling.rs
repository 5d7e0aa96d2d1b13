//! A memory-bandwidth ceiling for benchmarks: the memory traffic of an optimizer step with
//! `N` rewritten streams (Adam's `x, v, h`: reads `x, g, v, h`, writes `x, v, h`; Adagrad's
//! and Momentum's two) with the least arithmetic, `s += g` for every stream `s`, so that a
//! benchmark can report an optimizer as a fraction of what the memory allows in the same run.
//! An [`Optimizer`] of two and of three streams with no attributes, so it runs exactly as the
//! optimizers do.

use core::marker::PhantomData;

use crate::optim::{portable, Optimizer, Param};
use crate::simd::Level;
use crate::{Compute, Element};

/// The ceiling's coefficients: none (a type, so the shared SIMD dispatch can name it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CeilingCoeffs<C>(PhantomData<C>);

/// The yardstick: streams `X, V, H` like Adam's, or `X, H` like Adagrad's (Momentum's
/// `X, V` move the same bytes).
#[derive(Debug, Clone, Copy)]
pub struct MemoryCeiling;

/// The streams' names: Adam's for three, Adagrad's for two.
const fn names<const N: usize>() -> [&'static str; N] {
    let mut a = ["S"; N];
    if N > 0 {
        a[0] = "X";
    }
    if N == 2 {
        a[1] = "H";
    }
    if N == 3 {
        a[1] = "V";
        a[2] = "H";
    }
    a
}

macro_rules! ceiling {
    ($n:literal, $x86:ident) => {
        impl Optimizer<$n> for MemoryCeiling {
            type Attrs = ();
            type Coeffs<C: Compute> = CeilingCoeffs<C>;
            const STREAMS: [&'static str; $n] = names::<$n>();

            fn coeffs<C: Compute>(_: &(), _: f64, _: i64) -> CeilingCoeffs<C> {
                CeilingCoeffs(PhantomData)
            }

            #[inline(always)]
            fn update<C: Compute>(_: &CeilingCoeffs<C>, s: [C; $n], g: C) -> [C; $n] {
                s.map(|e| e + g)
            }

            fn reference<X: Element, G: Element<C = X::C>>(
                _: &(),
                _: f64,
                _: i64,
                streams: [&[X]; $n],
                g: &[G],
            ) -> [Vec<X>; $n] {
                streams.map(|s| s.iter().zip(g).map(|(e, g)| X::store(e.load() + g.load())).collect())
            }

            /// The SIMD kernels of the level (the optimizers' loads, stores and dispatch, so
            /// the yardstick moves memory as they do); else the portable loop.
            fn chunk<X: Element, G: Element<C = X::C>>(level: Level, c: &CeilingCoeffs<X::C>, p: Param<'_, X, G, $n>) {
                #[cfg(target_arch = "x86_64")]
                let Err(p) = $x86::try_simd(level, c, p) else {
                    return;
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = level;
                portable(c, p, Self::update);
            }
        }
    };
}
ceiling!(2, x86_2);
ceiling!(3, x86_3);

/// Whole groups of `$lanes`: every stream loaded, `g` added, stored (`simd_kernels!`).
#[cfg(target_arch = "x86_64")]
macro_rules! ceiling_lanes {
    ($c:ident, $p:ident, $n:ident, $lanes:literal, $v:ident, $ld:path, $st:path, $load_g:path) => {{
        let _ = $c;
        let mut i = 0;
        while i + $lanes <= $n {
            // SAFETY: lanes i..i + $lanes are in bounds (i + $lanes <= n), each stream's
            // lanes are loaded before they are stored, and unaligned access is allowed.
            unsafe {
                let g = $load_g($p.g.add(i));
                // Every load of the group, then every store, as the optimizers do.
                let mut sums = $p.s.map(|_| g);
                for (sum, &(src, _)) in sums.iter_mut().zip(&$p.s) {
                    *sum = $v::add($ld(src.add(i)), g);
                }
                for (&sum, &(_, dst)) in sums.iter().zip(&$p.s) {
                    $st(dst.add(i), sum);
                }
            }
            i += $lanes;
        }
    }};
}

/// The three-stream ceiling's x86 kernels.
#[cfg(target_arch = "x86_64")]
mod x86_3 {
    use super::{CeilingCoeffs, MemoryCeiling};
    use crate::optim::x86::{bf16x16, bf16x16_native, f16x16, pd256, pd512, ps256, ps512, simd_kernels};
    use crate::optim::Optimizer;

    simd_kernels!(
        ceiling_lanes,
        CeilingCoeffs,
        3,
        <MemoryCeiling as Optimizer<3>>::update,
        [
            ceiling3_f32_avx512,
            ceiling3_f16_avx512,
            ceiling3_bf16_avx512,
            ceiling3_bf16_avx512bf16,
            ceiling3_f32_f16_avx512,
            ceiling3_f32_bf16_avx512,
            ceiling3_f64_avx512,
            ceiling3_f32_avx2,
            ceiling3_f64_avx2,
        ]
    );
}

/// The two-stream ceiling's x86 kernels.
#[cfg(target_arch = "x86_64")]
mod x86_2 {
    use super::{CeilingCoeffs, MemoryCeiling};
    use crate::optim::x86::{bf16x16, bf16x16_native, f16x16, pd256, pd512, ps256, ps512, simd_kernels};
    use crate::optim::Optimizer;

    simd_kernels!(
        ceiling_lanes,
        CeilingCoeffs,
        2,
        <MemoryCeiling as Optimizer<2>>::update,
        [
            ceiling2_f32_avx512,
            ceiling2_f16_avx512,
            ceiling2_bf16_avx512,
            ceiling2_bf16_avx512bf16,
            ceiling2_f32_f16_avx512,
            ceiling2_f32_bf16_avx512,
            ceiling2_f64_avx512,
            ceiling2_f32_avx2,
            ceiling2_f64_avx2,
        ]
    );
}

/// The yardstick of the 8-bit optimizers (`optim::quantized`): their traffic with the least
/// arithmetic. Per element `x += g` (f32 read and written, G read) and both moments' codes
/// `+= 1` (one byte each, read and written); per block both scales `+= 1`: 16 bytes per
/// parameter (and 16 per 256 for the scales) with float32 G. Run in the 8-bit kernels'
/// tasks (whole blocks of [`CHUNK`](crate::parallel::CHUNK)), with the loops compiled for
/// `level` as theirs are.
///
/// # Panics
/// When `level` is not available on this CPU.
pub fn ceiling_8bit<G: Element<C = f32>>(
    level: Level,
    params: Vec<crate::optim::quantized::Param8bit<'_, G>>,
    par: &dyn crate::Parallelism,
) {
    use crate::parallel::{run_chunked, CHUNK, SERIAL_BELOW};
    use crate::simd::Isa;
    let isa = level.isa().unwrap_or_else(|| panic!("kernel level {level:?} is not available on this CPU"));
    run_chunked(params, par, CHUNK, SERIAL_BELOW, |p| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2.
        Isa::Avx2(t) => unsafe { ceiling_8bit_avx2(t, p) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(t) => unsafe { ceiling_8bit_avx512(t, p) },
        _ => ceiling_8bit_loops(p),
    });
}

/// [`ceiling_8bit`]'s loops, compiled with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn ceiling_8bit_avx2<G: Element<C = f32>>(_: crate::simd::Avx2, p: crate::optim::quantized::Param8bit<'_, G>) {
    ceiling_8bit_loops(p);
}

/// [`ceiling_8bit`]'s loops, compiled with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn ceiling_8bit_avx512<G: Element<C = f32>>(_: crate::simd::Avx512, p: crate::optim::quantized::Param8bit<'_, G>) {
    ceiling_8bit_loops(p);
}

/// `x += g`, codes `+= 1`, scales `+= 1`, each stream in place or from its source.
#[inline(always)]
fn ceiling_8bit_loops<G: Element<C = f32>>(p: crate::optim::quantized::Param8bit<'_, G>) {
    use crate::stream::Access;
    let crate::optim::quantized::Param8bit { mut x, g, mut m, mut v } = p;
    match x.access() {
        Access::InPlace(x) => x.iter_mut().zip(g).for_each(|(x, g)| *x += g.load()),
        Access::Split(src, dst) => {
            dst.iter_mut().zip(src).zip(g).for_each(|((d, s), g)| *d = s + g.load());
        }
    }
    for codes in [&mut m.codes, &mut v.codes] {
        match codes.access() {
            Access::InPlace(c) => c.iter_mut().for_each(|c| *c = c.wrapping_add(1)),
            Access::Split(src, dst) => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.wrapping_add(1)),
        }
    }
    for scales in [&mut m.absmax, &mut v.absmax] {
        match scales.access() {
            Access::InPlace(a) => a.iter_mut().for_each(|a| *a += 1.0),
            Access::Split(src, dst) => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s + 1.0),
        }
    }
}

/// The write-only yardstick of random-number fills: `out` zeroed with non-temporal 64-byte
/// stores (AVX-512F; normal stores where it is absent or a line is partial), in the pieces
/// [`crate::parallel::run_chunked`] makes, on `par`. Nothing can write memory faster.
pub fn stream_fill(out: &mut [u32], par: &dyn crate::Parallelism) {
    use crate::parallel::{run_chunked, CHUNK, SERIAL_BELOW};
    run_chunked(vec![Words(out)], par, CHUNK, SERIAL_BELOW, |Words(w)| stream_zero(w));
}

/// A piece of a fill's output.
struct Words<'a>(&'a mut [u32]);

impl crate::Splittable for Words<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.0.split_at_mut(mid);
        (Words(a), Words(b))
    }
}

/// Element types whose zero is all zero bits, which [`stream_zero`] writes as whole lines.
pub(crate) trait ZeroBits: Copy {
    /// The value of all zero bits.
    const ZERO: Self;
}

impl ZeroBits for u32 {
    const ZERO: Self = 0;
}

impl ZeroBits for f32 {
    const ZERO: Self = 0.0;
}

/// Zeroes `w` with non-temporal stores where the CPU has AVX-512F (whole 64-byte lines;
/// the partial ones, and every line elsewhere, with normal stores), fenced: for outputs
/// larger than the caches, where normal stores would read every line before writing it
/// (94 MB zeroed in 4.7 ms this way against memset's 11.5, one thread of an Intel Xeon).
pub(crate) fn stream_zero<T: ZeroBits>(w: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(crate::simd::Isa::Avx512(t)) = Level::Avx512.isa() {
        // SAFETY: the token proves the CPU has AVX-512F.
        return unsafe { stream_zero_avx512(t, w) };
    }
    w.fill(T::ZERO);
}

/// Zeroes `w`: whole 64-byte lines with non-temporal stores, the partial ones with normal
/// stores, fenced before returning.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn stream_zero_avx512<T: ZeroBits>(_: crate::simd::Avx512, w: &mut [T]) {
    use core::arch::x86_64::{_mm512_setzero_si512, _mm512_stream_si512, _mm_sfence};
    let per_line = 64 / size_of::<T>();
    let head = w.as_ptr().align_offset(64).min(w.len());
    let (head, rest) = w.split_at_mut(head);
    head.fill(T::ZERO);
    let mut lines = rest.chunks_exact_mut(per_line);
    for line in &mut lines {
        // SAFETY: `line` is 64 bytes starting on a 64-byte boundary (`rest` starts on one
        // and every line is whole); T's zero is all zero bits (`ZeroBits`).
        unsafe { _mm512_stream_si512(line.as_mut_ptr().cast(), _mm512_setzero_si512()) };
    }
    lines.into_remainder().fill(T::ZERO);
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::CHUNK;
    use crate::{InOut, RayonPool};

    #[test]
    fn adds_the_gradient_in_place_and_out_of_place() {
        let n = 3 * CHUNK + 5;
        let (mut x, g, mut v, mut h) = (vec![1.0f32; n], vec![0.5f32; n], vec![2.0f32; n], vec![3.0f32; n]);
        let t = MemoryCeiling::param([InOut::in_place(&mut x), InOut::in_place(&mut v), InOut::in_place(&mut h)], &g);
        MemoryCeiling::step(&CeilingCoeffs::default(), vec![t.unwrap()], &RayonPool(None));
        assert!(x.iter().all(|&e| e == 1.5) && v.iter().all(|&e| e == 2.5) && h.iter().all(|&e| e == 3.5));
        let (src, mut a, mut b, mut c) = (vec![1.0f64; 9], vec![0.0; 9], vec![0.0; 9], vec![0.0; 9]);
        let gs = vec![2.0f64; 9];
        let t = MemoryCeiling::param(
            [
                InOut::split(&src, &mut a).unwrap(),
                InOut::split(&src, &mut b).unwrap(),
                InOut::split(&src, &mut c).unwrap(),
            ],
            &gs,
        );
        MemoryCeiling::step(&CeilingCoeffs::default(), vec![t.unwrap()], &crate::Sequential);
        assert_eq!((a[8], b[0], c[4], src[0]), (3.0, 3.0, 3.0, 1.0));
    }

    #[test]
    fn two_streams_in_place_and_out_of_place_match_the_reference() {
        let n = 2 * CHUNK + 1029;
        let (x, h, g): (Vec<f32>, Vec<f32>, Vec<f32>) =
            (0..n).map(|i| (i as f32, 0.5 * i as f32, 0.25 * (i % 7) as f32)).collect();
        let want = <MemoryCeiling as Optimizer<2>>::reference(&(), 0.0, 0, [&x, &h], &g);
        let (mut xi, mut hi) = (x.clone(), h.clone());
        let t = MemoryCeiling::param([InOut::in_place(&mut xi), InOut::in_place(&mut hi)], &g).unwrap();
        MemoryCeiling::step(&CeilingCoeffs::default(), vec![t], &RayonPool(None));
        assert_eq!([xi, hi], want);
        let (mut xo, mut ho) = (vec![0f32; n], vec![0f32; n]);
        let t = MemoryCeiling::param([InOut::split(&x, &mut xo).unwrap(), InOut::split(&h, &mut ho).unwrap()], &g);
        MemoryCeiling::step(&CeilingCoeffs::default(), vec![t.unwrap()], &crate::Sequential);
        assert_eq!([xo, ho], want);
        assert_eq!(<MemoryCeiling as Optimizer<2>>::STREAMS, ["X", "H"]);
        assert_eq!(<MemoryCeiling as Optimizer<3>>::STREAMS, ["X", "V", "H"]);
    }

    /// The shared optimizer harness: every SIMD level, placement, pool, edge length and
    /// 16-bit pair is bitwise the reference, for both stream counts.
    macro_rules! ceiling_harness {
        ($m:ident, $n:literal) => {
            mod $m {
                use proptest::prelude::*;

                use super::super::MemoryCeiling;
                use crate::optim::harness::{optimizer_harness, Harness};

                impl Harness<$n> for MemoryCeiling {
                    fn fixed_attrs() -> Vec<()> {
                        vec![()]
                    }
                    const T_FIXED: &'static [i64] = &[1];
                    const T_RANGE: core::ops::Range<i64> = 0..2;
                    fn attrs() -> BoxedStrategy<()> {
                        Just(()).boxed()
                    }
                    fn value(_k: usize, u: f64) -> f64 {
                        8.0 * u
                    }
                }

                optimizer_harness!(MemoryCeiling, $n);
            }
        };
    }
    #[test]
    fn stream_fill_zeroes_every_word_at_any_offset() {
        let mut buf = vec![7u32; 3 * CHUNK + 100];
        for offset in [0, 1, 5, 16] {
            buf.fill(7);
            stream_fill(&mut buf[offset..offset + 2 * CHUNK + 21], &RayonPool(None));
            assert!(buf[offset..offset + 2 * CHUNK + 21].iter().all(|&w| w == 0));
            assert!(buf[..offset].iter().chain(&buf[offset + 2 * CHUNK + 21..]).all(|&w| w == 7));
        }
    }

    #[test]
    fn the_8bit_ceiling_adds_one_everywhere_at_every_level() {
        use crate::optim::quantized::{blocks, Param8bit, Quantized};
        let n = 3 * CHUNK + 300;
        for level in crate::simd::available_levels() {
            let (mut x, g) = (vec![1.0f32; n], vec![0.5f32; n]);
            let (mut mq, mut vq) = (vec![7u8; n], vec![255u8; n]);
            let (mut ma, mut va) = (vec![2.0f32; blocks(n)], vec![3.0f32; blocks(n)]);
            let p = Param8bit::new(
                InOut::in_place(&mut x),
                &g,
                Quantized { codes: InOut::in_place(&mut mq), absmax: InOut::in_place(&mut ma) },
                Quantized { codes: InOut::in_place(&mut vq), absmax: InOut::in_place(&mut va) },
            )
            .unwrap();
            ceiling_8bit(level, vec![p], &RayonPool(None));
            assert!(x.iter().all(|&e| e == 1.5) && mq.iter().all(|&c| c == 8) && vq.iter().all(|&c| c == 0));
            assert!(ma.iter().all(|&a| a == 3.0) && va.iter().all(|&a| a == 4.0), "{level:?}");
        }
    }

    ceiling_harness!(two, 2);
    ceiling_harness!(three, 3);
}
