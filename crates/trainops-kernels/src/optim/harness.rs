//! The one kernel test harness of the optimizer family. Each optimizer's `tests.rs`
//! implements [`Harness`] (its test attributes and data domains) and instantiates every
//! test with `optimizer_harness!(Type, N)`: the fast path, at every SIMD level this CPU has,
//! in place and out of place (outputs poisoned with NaN first), on one thread and on a rayon
//! pool, on edge lengths (around every lane width and the chunk size), in f32, f64 and the
//! 16-bit pairs, with non-finite values and in property tests, is bitwise the scalar
//! reference ([`Optimizer::reference`]).

use core::ops::Range;
use std::sync::OnceLock;

use half::{bf16, f16};
use proptest::prelude::*;

use super::{Optimizer, Param};
use crate::parallel::CHUNK;
use crate::simd::{available_levels, detected, Level};
use crate::test_util::{convert, stream, uniform, Bits};
use crate::{Compute, Element, InOut, KernelError, Parallelism, RayonPool, Sequential};

/// What the harness needs to know of an optimizer beyond its contract.
pub trait Harness<const N: usize>: Optimizer<N> {
    /// Attribute sets of the deterministic tests (Momentum: both modes).
    fn fixed_attrs() -> Vec<Self::Attrs>;
    /// Further attribute sets for the non-finite test (extremes such as `epsilon = 0`).
    fn extreme_attrs() -> Vec<Self::Attrs> {
        Vec::new()
    }
    /// Update counts of the deterministic tests (both sides of any `T > 0` rule).
    const T_FIXED: &'static [i64];
    /// Update counts of the property tests.
    const T_RANGE: Range<i64>;
    /// Random attributes for the property tests.
    fn attrs() -> BoxedStrategy<Self::Attrs>;
    /// A value of stream `k` (0 = weights) from `u` uniform in [-0.5, 0.5): the stream's
    /// domain and scale (e.g. `h >= 0` for an accumulated square).
    fn value(k: usize, u: f64) -> f64;
}

/// One tensor's streams (weights first) and gradient.
pub type Case<X, G, const N: usize> = ([Vec<X>; N], Vec<G>);

/// Lengths around every lane width (4, 8, 16) and odd ones.
pub const EDGE_LENGTHS: [usize; 14] = [0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 63, 64, 65, 1000];

/// A rayon pool of 3 threads, shared by the tests.
pub fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("rayon pool"))
}

/// The fast path at `level` on copies of the cases, in place or out of place; out of place,
/// every output buffer holds NaN first (the results must not depend on what it held).
pub fn fast<O: Optimizer<N>, X: Element, G: Element<C = X::C>, const N: usize>(
    level: Level,
    c: &O::Coeffs<X::C>,
    cases: &[Case<X, G, N>],
    par: &dyn Parallelism,
    in_place: bool,
) -> Vec<[Vec<X>; N]> {
    let mut outs: Vec<[Vec<X>; N]> = cases.iter().map(|(s, _)| s.clone()).collect();
    if !in_place {
        let stale = X::store(X::C::from_f64(f64::NAN));
        outs.iter_mut().flatten().flatten().for_each(|e| *e = stale);
    }
    let work: Vec<Param<'_, X, G, N>> = cases
        .iter()
        .zip(outs.iter_mut())
        .map(|((src, g), dst)| {
            let mut k = 0;
            let streams = dst.each_mut().map(|d| {
                k += 1;
                stream(&src[k - 1], d, in_place)
            });
            O::param(streams, g).unwrap()
        })
        .collect();
    O::step_with(level, c, work, par);
    outs
}

/// The reference's results for every case.
pub fn reference<O: Optimizer<N>, X: Element, G: Element<C = X::C>, const N: usize>(
    attrs: &O::Attrs,
    r: f64,
    t: i64,
    cases: &[Case<X, G, N>],
) -> Vec<[Vec<X>; N]> {
    cases.iter().map(|(s, g)| O::reference(attrs, r, t, s.each_ref().map(Vec::as_slice), g)).collect()
}

/// Every output element's bits, tensor by tensor, stream by stream (every NaN as one value:
/// [`Bits::canonical_bits`]).
pub fn bits<X: Bits, const N: usize>(outs: &[[Vec<X>; N]]) -> Vec<u64> {
    outs.iter().flatten().flatten().map(|e| e.canonical_bits()).collect()
}

/// The fast path with coefficients `c` on every level, in place and out of place, on one
/// thread and on [`pool`], bitwise equal to `want`.
pub fn check_coeffs<O: Optimizer<N>, X: Element + Bits, G: Element<C = X::C>, const N: usize>(
    c: &O::Coeffs<X::C>,
    want: &[[Vec<X>; N]],
    cases: &[Case<X, G, N>],
    what: &str,
) {
    let want = bits(want);
    for level in available_levels() {
        for in_place in [false, true] {
            for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(pool()))] {
                let got = bits(&fast::<O, X, G, N>(level, c, cases, par, in_place));
                let first = got.iter().zip(&want).position(|(a, b)| a != b).map(|i| (i, got[i], want[i]));
                assert!(
                    got == want,
                    "{} {what} {level:?} in_place={in_place}: first difference (index, got, want) {first:x?}",
                    std::any::type_name::<(X, G)>()
                );
            }
        }
    }
}

/// [`check_coeffs`] with the coefficients and the reference of `attrs`, `r`, `t`.
pub fn check<O: Optimizer<N>, X: Element + Bits, G: Element<C = X::C>, const N: usize>(
    attrs: &O::Attrs,
    r: f64,
    t: i64,
    cases: &[Case<X, G, N>],
) {
    let c = O::coeffs::<X::C>(attrs, r, t);
    check_coeffs::<O, X, G, N>(&c, &reference::<O, X, G, N>(attrs, r, t, cases), cases, &format!("{attrs:?} t={t}"));
}

/// Deterministic data of lengths `lens` in each stream's domain; gradients in [-1, 1).
pub fn cases64<O: Harness<N>, const N: usize>(lens: &[usize], seed: u64) -> Vec<Case<f64, f64, N>> {
    let mut rnd = uniform(seed);
    lens.iter()
        .map(|&n| {
            let streams = core::array::from_fn(|k| (0..n).map(|_| O::value(k, rnd())).collect());
            (streams, (0..n).map(|_| 2.0 * rnd()).collect())
        })
        .collect()
}

/// The cases converted: streams through `fx`, gradients through `fg`.
pub fn convert_cases<X, G, const N: usize>(
    cases: &[Case<f64, f64, N>],
    fx: impl Fn(f64) -> X + Copy,
    fg: impl Fn(f64) -> G + Copy,
) -> Vec<Case<X, G, N>> {
    cases.iter().map(|(s, g)| (s.each_ref().map(|v| convert(v, fx)), convert(g, fg))).collect()
}

/// Edge lengths and lengths around the chunk size, f32 and f64, every fixed attribute set
/// and update count.
pub fn edge_lengths<O: Harness<N>, const N: usize>() {
    let mut lens = EDGE_LENGTHS.to_vec();
    lens.extend([CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 2 * CHUNK + 13]);
    let c64 = cases64::<O, N>(&lens, 7);
    let c32 = convert_cases(&c64, |e| e as f32, |e| e as f32);
    for a in O::fixed_attrs() {
        for &t in O::T_FIXED {
            check::<O, f64, f64, N>(&a, 0.01, t, &c64);
            check::<O, f32, f32, N>(&a, 0.01, t, &c32);
        }
    }
}

/// float16 and bfloat16 weights, and float32 weights with 16-bit gradients.
pub fn sixteen_bit_pairs<O: Harness<N>, const N: usize>() {
    let mut lens = EDGE_LENGTHS.to_vec();
    lens.push(2 * CHUNK + 13);
    let base = cases64::<O, N>(&lens, 99);
    let f32s = |e: f64| e as f32;
    let mixed16 = convert_cases(&base, f32s, f16::from_f64);
    let mixedb = convert_cases(&base, f32s, bf16::from_f64);
    let all16 = convert_cases(&base, f16::from_f64, f16::from_f64);
    let allb = convert_cases(&base, bf16::from_f64, bf16::from_f64);
    for a in O::fixed_attrs() {
        let t = O::T_FIXED[O::T_FIXED.len() - 1];
        check::<O, f32, f16, N>(&a, 0.1, t, &mixed16);
        check::<O, f32, bf16, N>(&a, 0.1, t, &mixedb);
        check::<O, f16, f16, N>(&a, 0.1, t, &all16);
        check::<O, bf16, bf16, N>(&a, 0.1, t, &allb);
    }
}

/// NaN, infinities, signed zeros, subnormals and extremes travel through the fast path
/// exactly as through the reference: as they come, and with the streams of a non-negative
/// domain (an accumulated square) made non-negative.
pub fn non_finite_values<O: Harness<N>, const N: usize>() {
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::MIN_POSITIVE, 1e-45, f32::MAX];
    let n = 64;
    let pick = |k: usize| (0..n).map(|i| specials[(i * k + i / 8) % specials.len()]).collect::<Vec<f32>>();
    // Weights from pattern 1, the gradient from 3, state stream k from 2k + 3.
    let raw: [Vec<f32>; N] = core::array::from_fn(|k| pick(if k == 0 { 1 } else { 2 * k + 3 }));
    let mut k = 0;
    let domain = raw.clone().map(|v| {
        k += 1;
        if O::value(k - 1, -0.25) >= 0.0 {
            v.into_iter().map(f32::abs).collect()
        } else {
            v
        }
    });
    let cases = vec![(raw, pick(3)), (domain, pick(3))];
    // The same through 16-bit weights and gradients (f32::MAX becomes an infinity,
    // the smallest normal and subnormal f32 become zeros or 16-bit subnormals).
    let narrow = |f: fn(f32) -> f32| -> Vec<Case<f32, f32, N>> {
        cases.iter().map(|(s, g)| (s.clone().map(|v| convert(&v, f)), convert(g, f))).collect()
    };
    let (via16, viab) = (narrow(|e| f16::from_f32(e).to_f32()), narrow(|e| bf16::from_f32(e).to_f32()));
    let all16 = convert_cases(&widen(&via16), f16::from_f64, f16::from_f64);
    let allb = convert_cases(&widen(&viab), bf16::from_f64, bf16::from_f64);
    // Signalling NaNs (and one of each sign and payload) in every stream and the gradient:
    // the SIMD loads may leave them signalling, the first operation must quiet them as the
    // reference's widening does.
    let snan16 = [0x7C01u16, 0xFC01, 0x7D55, 0x7E00, 0x3C00, 0x0001];
    let snanb = [0x7F81u16, 0xFF81, 0x7FAA, 0x7FC0, 0x3F80, 0x0001];
    let sn = |w: &[u16; 6], k: usize| (0..48).map(|i| w[(i * (k + 1) + i / 6) % 6]).collect::<Vec<u16>>();
    let sn16: Vec<Case<f16, f16, N>> = vec![(
        core::array::from_fn(|k| sn(&snan16, k + 1).into_iter().map(f16::from_bits).collect()),
        sn(&snan16, 0).into_iter().map(f16::from_bits).collect(),
    )];
    let snb: Vec<Case<bf16, bf16, N>> = vec![(
        core::array::from_fn(|k| sn(&snanb, k + 1).into_iter().map(bf16::from_bits).collect()),
        sn(&snanb, 0).into_iter().map(bf16::from_bits).collect(),
    )];
    let snf32: Vec<Case<f32, bf16, N>> =
        snb.iter().map(|(s, g)| (s.each_ref().map(|v| convert(v, |e| e.to_f32())), g.clone())).collect();
    for a in O::fixed_attrs().into_iter().chain(O::extreme_attrs()) {
        for &t in O::T_FIXED {
            check::<O, f32, f32, N>(&a, 0.1, t, &cases);
            check::<O, f16, f16, N>(&a, 0.1, t, &all16);
            check::<O, bf16, bf16, N>(&a, 0.1, t, &allb);
            check::<O, f16, f16, N>(&a, 0.1, t, &sn16);
            check::<O, bf16, bf16, N>(&a, 0.1, t, &snb);
            check::<O, f32, bf16, N>(&a, 0.1, t, &snf32);
        }
    }
}

/// `f32` cases widened to `f64` (exact).
fn widen<const N: usize>(cases: &[Case<f32, f32, N>]) -> Vec<Case<f64, f64, N>> {
    cases.iter().map(|(s, g)| (s.each_ref().map(|v| convert(v, f64::from)), convert(g, f64::from))).collect()
}

/// A gradient or a state stream of another length than the weights is refused, named.
pub fn mismatched_lengths<O: Optimizer<N>, const N: usize>() {
    let src = vec![0f32; 3];
    let mut outs: [Vec<f32>; N] = core::array::from_fn(|_| vec![0f32; 3]);
    let streams = outs.each_mut().map(|d| InOut::split(&src, d).unwrap());
    let r = O::param(streams, &[0f32; 2]);
    assert!(matches!(r, Err(KernelError::LengthMismatch { what: "G", got: 2, expected: 3 })));
    for k in 1..N {
        let mut outs: [Vec<f32>; N] = core::array::from_fn(|j| vec![0f32; if j == k { 4 } else { 3 }]);
        let streams = outs.each_mut().map(|d| InOut::in_place(d));
        match O::param(streams, &[0f32; 3]) {
            Err(KernelError::LengthMismatch { what, got: 4, expected: 3 }) => assert_eq!(what, O::STREAMS[k]),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("stream {k} of length 4 accepted"),
        }
    }
}

/// Property test: random attributes, rate, update count and data, several tensors, f32,
/// every level, on one thread.
pub fn random_f32<O: Harness<N>, const N: usize>(
    a: &O::Attrs,
    r: f64,
    t: i64,
    lens: &[usize],
    seed: u64,
    in_place: bool,
) -> Result<(), TestCaseError> {
    let cases = convert_cases(&cases64::<O, N>(lens, seed), |e| (e * 2.0) as f32, |e| (e * 5.0) as f32);
    let c = O::coeffs::<f32>(a, r, t);
    let want = bits(&reference::<O, f32, f32, N>(a, r, t, &cases));
    for level in available_levels() {
        prop_assert_eq!(&bits(&fast::<O, f32, f32, N>(level, &c, &cases, &Sequential, in_place)), &want, "{:?}", level);
    }
    Ok(())
}

/// Property test: the same in f64 with gradients spread over many magnitudes, every level,
/// on rayon's global pool.
pub fn random_f64<O: Harness<N>, const N: usize>(
    a: &O::Attrs,
    r: f64,
    t: i64,
    xs: Vec<f64>,
    in_place: bool,
) -> Result<(), TestCaseError> {
    let g: Vec<f64> = xs.iter().map(|x| x.sin() * 1e-3f64.powf(x.cos())).collect();
    let streams: [Vec<f64>; N] =
        core::array::from_fn(
            |k| if k == 0 { xs.clone() } else { xs.iter().map(|x| O::value(k, x.cos() / 2.0)).collect() },
        );
    let cases = vec![(streams, g)];
    let c = O::coeffs::<f64>(a, r, t);
    let want = bits(&reference::<O, f64, f64, N>(a, r, t, &cases));
    for level in available_levels() {
        let got = bits(&fast::<O, f64, f64, N>(level, &c, &cases, &RayonPool(None), in_place));
        prop_assert_eq!(&got, &want, "{:?}", level);
    }
    Ok(())
}

/// Property test: nodes large enough to be split into chunks, on rayon's global pool.
pub fn threaded<O: Harness<N>, const N: usize>(
    a: &O::Attrs,
    t: i64,
    lens: &[usize],
    seed: u64,
    in_place: bool,
) -> Result<(), TestCaseError> {
    let cases = convert_cases(&cases64::<O, N>(lens, seed), |e| e as f32, |e| e as f32);
    let c = O::coeffs::<f32>(a, 0.05, t);
    let want = bits(&reference::<O, f32, f32, N>(a, 0.05, t, &cases));
    prop_assert_eq!(bits(&fast::<O, f32, f32, N>(detected(), &c, &cases, &RayonPool(None), in_place)), want);
    Ok(())
}

/// Every harness test for optimizer `$opt` of `$n` streams (which implements [`Harness`]).
macro_rules! optimizer_harness {
    ($opt:ty, $n:literal) => {
        mod shared_harness {
            use proptest::prelude::*;

            use super::*;
            use crate::optim::harness::{self as h, Harness};
            use crate::parallel::CHUNK;

            #[test]
            fn edge_lengths_every_level_placement_and_pool() {
                h::edge_lengths::<$opt, $n>();
            }

            #[test]
            fn sixteen_bit_and_mixed_pairs() {
                h::sixteen_bit_pairs::<$opt, $n>();
            }

            #[test]
            fn non_finite_values_match_the_reference() {
                h::non_finite_values::<$opt, $n>();
            }

            #[test]
            fn mismatched_lengths_are_rejected() {
                h::mismatched_lengths::<$opt, $n>();
            }

            proptest! {
                #[test]
                fn random_f32(
                    a in <$opt as Harness<$n>>::attrs(),
                    r in 1e-4f64..1.0,
                    t in <$opt as Harness<$n>>::T_RANGE,
                    lens in proptest::collection::vec(0usize..70, 1..4),
                    seed in any::<u64>(),
                    in_place in any::<bool>(),
                ) {
                    h::random_f32::<$opt, $n>(&a, r, t, &lens, seed, in_place)?;
                }

                #[test]
                fn random_f64(
                    a in <$opt as Harness<$n>>::attrs(),
                    r in 1e-4f64..1.0,
                    t in <$opt as Harness<$n>>::T_RANGE,
                    xs in proptest::collection::vec(-1e3f64..1e3, 0..70),
                    in_place in any::<bool>(),
                ) {
                    h::random_f64::<$opt, $n>(&a, r, t, xs, in_place)?;
                }
            }

            proptest! {
                #![proptest_config(ProptestConfig::with_cases(12))]
                #[test]
                fn threaded_random(
                    a in <$opt as Harness<$n>>::attrs(),
                    t in <$opt as Harness<$n>>::T_RANGE,
                    lens in proptest::collection::vec(0usize..3 * CHUNK, 1..4),
                    seed in any::<u64>(),
                    in_place in any::<bool>(),
                ) {
                    h::threaded::<$opt, $n>(&a, t, &lens, seed, in_place)?;
                }
            }
        }
    };
}
pub(crate) use optimizer_harness;
