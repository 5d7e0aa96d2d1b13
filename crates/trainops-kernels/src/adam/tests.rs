use proptest::prelude::*;

use super::*;
use crate::simd::Level;
use crate::test_util::{convert, stream, uniform};
use crate::{RayonPool, Sequential};

/// One tensor's (x, g, v, h) and one tensor's (x', v', h').
type Case<X, G> = (Vec<X>, Vec<G>, Vec<X>, Vec<X>);
type Out<X> = (Vec<X>, Vec<X>, Vec<X>);

/// Runs the fast path out of place on copies, returning (x, v, h).
fn fast<X: AdamKernel<G>, G: Element<C = X::C>>(
    a: &AdamAttrs,
    r: f64,
    t: i64,
    tensors: &[Case<X, G>],
    par: &dyn Parallelism,
    in_place: bool,
) -> Vec<Out<X>> {
    fast_with(crate::simd::detected(), a, r, t, tensors, par, in_place)
}

/// [`fast`] with a forced kernel level.
fn fast_with<X: AdamKernel<G>, G: Element<C = X::C>>(
    level: Level,
    a: &AdamAttrs,
    r: f64,
    t: i64,
    tensors: &[Case<X, G>],
    par: &dyn Parallelism,
    in_place: bool,
) -> Vec<Out<X>> {
    let c = AdamCoeffs::<X::C>::new(a, adjusted_rate(r, t, a.alpha, a.beta));
    let mut outs: Vec<Out<X>> = tensors.iter().map(|(x, _, v, h)| (x.clone(), v.clone(), h.clone())).collect();
    let work = tensors
        .iter()
        .zip(outs.iter_mut())
        .map(|((x, g, v, h), (ox, ov, oh))| {
            // The out-of-place run writes over stale copies (its results must not depend on
            // what the output buffer held).
            if !in_place {
                ox.iter_mut().for_each(|e| *e = X::store(X::C::from_f64(f64::NAN)));
            }
            AdamTensor::new(stream(x, ox, in_place), g, stream(v, ov, in_place), stream(h, oh, in_place)).unwrap()
        })
        .collect();
    step_with(level, &c, work, par);
    outs
}

/// Raw bits of an element, for exact comparisons of every type.
trait Bits: Copy {
    fn bits(self) -> u64;
}
impl Bits for f32 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
}
impl Bits for f64 {
    fn bits(self) -> u64 {
        self.to_bits()
    }
}
impl Bits for half::f16 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
}
impl Bits for half::bf16 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
}

fn bits_of<X: Bits>(o: &[Out<X>]) -> Vec<u64> {
    o.iter().flat_map(|(x, v, h)| x.iter().chain(v).chain(h).map(|e| e.bits())).collect()
}

/// Every level against `reference::adam_unscaled`, in and out of place, for one type pair.
fn check_pair<X: AdamKernel<G> + Bits, G: Element<C = X::C>>(cases: &[Case<X, G>], loss_scale: Option<X::C>) {
    let a = AdamAttrs { norm_coefficient: 0.01, ..AdamAttrs::default() };
    let (r, t) = (0.01, 5);
    let want: Vec<Out<X>> =
        cases.iter().map(|(x, g, v, h)| reference::adam_unscaled(&a, r, t, loss_scale, x, g, v, h)).collect();
    let mut c = AdamCoeffs::<X::C>::new(&a, adjusted_rate(r, t, a.alpha, a.beta));
    c.loss_scale = loss_scale;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for level in crate::simd::available_levels() {
        for in_place in [false, true] {
            let mut outs: Vec<Out<X>> = cases.iter().map(|(x, _, v, h)| (x.clone(), v.clone(), h.clone())).collect();
            let work = cases
                .iter()
                .zip(outs.iter_mut())
                .map(|((x, g, v, h), (ox, ov, oh))| {
                    AdamTensor::new(stream(x, ox, in_place), g, stream(v, ov, in_place), stream(h, oh, in_place))
                        .unwrap()
                })
                .collect();
            step_with(level, &c, work, &RayonPool(Some(&pool)));
            assert!(
                bits_of(&outs) == bits_of(&want),
                "{} {level:?} in_place={in_place}",
                std::any::type_name::<(X, G)>()
            );
        }
    }
}

fn reference_all<X: Element, G: Element<C = X::C>>(
    a: &AdamAttrs,
    r: f64,
    t: i64,
    tensors: &[Case<X, G>],
) -> Vec<Out<X>> {
    tensors.iter().map(|(x, g, v, h)| reference::adam(a, r, t, x, g, v, h)).collect()
}

fn bits32(o: &[Out<f32>]) -> Vec<u32> {
    o.iter().flat_map(|(x, v, h)| x.iter().chain(v).chain(h).map(|e| e.to_bits())).collect()
}

fn bits64(o: &[Out<f64>]) -> Vec<u64> {
    o.iter().flat_map(|(x, v, h)| x.iter().chain(v).chain(h).map(|e| e.to_bits())).collect()
}

fn tensor_f32(len: usize) -> impl Strategy<Value = Case<f32, f32>> {
    let vals = move |lo: f32, hi: f32| proptest::collection::vec(lo..hi, len);
    (vals(-10.0, 10.0), vals(-5.0, 5.0), vals(-1.0, 1.0), vals(0.0, 4.0))
}

fn attrs() -> impl Strategy<Value = AdamAttrs> {
    (0.0f32..1.0, 0.0f32..1.0, 1e-8f32..1e-1, 0.0f32..0.5, 0.0f32..0.5).prop_map(|(alpha, beta, epsilon, n, p)| {
        AdamAttrs { alpha, beta, epsilon, norm_coefficient: n, norm_coefficient_post: p }
    })
}

proptest! {
    #[test]
    fn fast_path_equals_reference_f64(
        a in attrs(),
        r in 1e-4f64..1.0,
        t in -3i64..50,
        xs in proptest::collection::vec(-1e3f64..1e3, 0..70),
        in_place in any::<bool>(),
    ) {
        let n = xs.len();
        let g: Vec<f64> = xs.iter().map(|x| x.sin()).collect();
        let v: Vec<f64> = xs.iter().map(|x| x.cos() * 0.1).collect();
        let h: Vec<f64> = xs.iter().map(|x| x.sin().abs()).collect();
        let tensors = vec![(xs, g, v, h)];
        let want = bits64(&reference_all(&a, r, t, &tensors));
        prop_assert_eq!(bits64(&fast(&a, r, t, &tensors, &Sequential, in_place)), want);
        prop_assert_eq!(tensors[0].0.len(), n);
    }
}

/// A node large enough to be split into chunks gives the reference's bits on any pool.
#[test]
fn threaded_split_is_bitwise_the_reference() {
    let lens = [0usize, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 7];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let tensors: Vec<_> = lens
        .iter()
        .map(|&n| {
            let mut v = |s: f32| (0..n).map(|_| rnd() * s).collect::<Vec<f32>>();
            (v(4.0), v(1.0), v(0.1), v(0.01).into_iter().map(f32::abs).collect())
        })
        .collect();
    let a = AdamAttrs { norm_coefficient: 0.01, norm_coefficient_post: 0.001, ..AdamAttrs::default() };
    let want = bits32(&reference_all(&a, 0.01, 7, &tensors));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for in_place in [false, true] {
        assert_eq!(bits32(&fast(&a, 0.01, 7, &tensors, &Sequential, in_place)), want);
        assert_eq!(bits32(&fast(&a, 0.01, 7, &tensors, &RayonPool(Some(&pool)), in_place)), want);
    }
}

#[test]
fn adjusted_rate_follows_the_t_rule() {
    assert_eq!(adjusted_rate(0.1, 0, 0.9, 0.999), 0.1);
    assert_eq!(adjusted_rate(0.1, -4, 0.9, 0.999), 0.1);
    let a = f64::from(0.9f32);
    let b = f64::from(0.999f32);
    let want = 0.1 * (1.0 - b * b).sqrt() / (1.0 - a * a);
    assert!((adjusted_rate(0.1, 2, 0.9, 0.999) - want).abs() < 1e-15);
}

#[test]
fn mismatched_lengths_are_rejected() {
    let (x, v, h) = (vec![0f32; 3], vec![0f32; 3], vec![0f32; 3]);
    let (mut ox, mut ov, mut oh) = (x.clone(), v.clone(), h.clone());
    let r = AdamTensor::new(
        InOut::split(&x, &mut ox).unwrap(),
        &[0f32; 2],
        InOut::split(&v, &mut ov).unwrap(),
        InOut::split(&h, &mut oh).unwrap(),
    );
    assert!(matches!(r, Err(KernelError::LengthMismatch { what: "G", got: 2, expected: 3 })));
}

/// Random data for the level tests: lengths around every lane width (4, 8, 16) and chunk.
fn level_cases(lens: &[usize], seed: u64) -> Vec<Case<f64, f64>> {
    let mut rnd = uniform(seed);
    lens.iter()
        .map(|&n| {
            let mut v = |k: f64| (0..n).map(|_| rnd() * k).collect::<Vec<f64>>();
            (v(8.0), v(2.0), v(0.5), v(0.1).into_iter().map(f64::abs).collect())
        })
        .collect()
}

const EDGE_LENGTHS: [usize; 14] = [0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 63, 64, 65, 1000];

/// Every kernel level the CPU has gives the reference's bits, f32 and f64, in place and
/// out of place, on the edge lengths and on a node big enough to be threaded.
#[test]
fn every_level_is_bitwise_the_reference() {
    let a = AdamAttrs { norm_coefficient: 0.02, norm_coefficient_post: 0.003, ..AdamAttrs::default() };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let mut lens = EDGE_LENGTHS.to_vec();
    lens.push(2 * CHUNK + 13);
    let cases64 = level_cases(&lens, 7);
    let cases32: Vec<Case<f32, f32>> = cases64
        .iter()
        .map(|(x, g, v, h)| {
            let f = |a: &Vec<f64>| a.iter().map(|&e| e as f32).collect::<Vec<f32>>();
            (f(x), f(g), f(v), f(h))
        })
        .collect();
    let want32 = bits32(&reference_all(&a, 0.003, 11, &cases32));
    let want64 = bits64(&reference_all(&a, 0.003, 11, &cases64));
    let levels = crate::simd::available_levels();
    assert_eq!(levels[0], Level::Scalar);
    for &level in &levels {
        for in_place in [false, true] {
            for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
                let got32 = bits32(&fast_with(level, &a, 0.003, 11, &cases32, par, in_place));
                assert!(got32 == want32, "f32 {level:?} in_place={in_place}");
                let got64 = bits64(&fast_with(level, &a, 0.003, 11, &cases64, par, in_place));
                assert!(got64 == want64, "f64 {level:?} in_place={in_place}");
            }
        }
    }
}

proptest! {
    /// Random attributes and data on every level (short lengths: tails and lane edges).
    #[test]
    fn every_level_matches_the_reference_on_random_data(
        a in attrs(),
        r in 1e-4f64..1.0,
        t in -3i64..50,
        tensors in proptest::collection::vec((0usize..70).prop_flat_map(tensor_f32), 1..4),
        in_place in any::<bool>(),
    ) {
        let want = bits32(&reference_all(&a, r, t, &tensors));
        for level in crate::simd::available_levels() {
            prop_assert_eq!(&bits32(&fast_with(level, &a, r, t, &tensors, &Sequential, in_place)), &want);
        }
    }
}

/// Non-finite inputs travel through every level exactly as through the reference.
#[test]
fn non_finite_values_match_on_every_level() {
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::MIN_POSITIVE, 1e-45, f32::MAX];
    let n = 64;
    let pick = |k: usize| (0..n).map(|i| specials[(i * k + i / 8) % specials.len()]).collect::<Vec<f32>>();
    let tensors = vec![(pick(1), pick(3), pick(5), pick(7).into_iter().map(f32::abs).collect())];
    let a = AdamAttrs::default();
    let want = bits32(&reference_all(&a, 0.1, 3, &tensors));
    for level in crate::simd::available_levels() {
        assert_eq!(bits32(&fast_with(level, &a, 0.1, 3, &tensors, &Sequential, false)), want, "{level:?}");
    }
}

/// float16 and bfloat16 weights, and float32 weights with 16-bit gradients (unscaled by a
/// loss scale or not), on every level, bitwise against the reference.
#[test]
fn sixteen_bit_and_mixed_types_are_bitwise_the_reference() {
    let mut lens = EDGE_LENGTHS.to_vec();
    lens.push(2 * CHUNK + 13);
    let base = level_cases(&lens, 99);
    let f32s = |v: &[f64]| convert(v, |e| e as f32);
    let mixed16: Vec<Case<f32, half::f16>> = base
        .iter()
        .map(|(x, g, v, h)| (f32s(x), convert(g, |e| half::f16::from_f64(e * 1e3)), f32s(v), f32s(h)))
        .collect();
    let mixedb: Vec<Case<f32, half::bf16>> = base
        .iter()
        .map(|(x, g, v, h)| (f32s(x), convert(g, |e| half::bf16::from_f64(e * 1e3)), f32s(v), f32s(h)))
        .collect();
    let all16: Vec<Case<half::f16, half::f16>> = base
        .iter()
        .map(|(x, g, v, h)| {
            let f = |a: &Vec<f64>| convert(a, half::f16::from_f64);
            (f(x), f(g), f(v), f(h))
        })
        .collect();
    let allb: Vec<Case<half::bf16, half::bf16>> = base
        .iter()
        .map(|(x, g, v, h)| {
            let f = |a: &Vec<f64>| convert(a, half::bf16::from_f64);
            (f(x), f(g), f(v), f(h))
        })
        .collect();
    for ls in [None, Some(1024.0f32), Some(3.0)] {
        check_pair(&mixed16, ls);
        check_pair(&mixedb, ls);
        check_pair(&all16, ls);
        check_pair(&allb, ls);
    }
}
