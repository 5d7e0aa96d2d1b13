use half::{bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::test_util::{convert, stream, uniform};
use crate::{RayonPool, Sequential};

/// One tensor's (x, g, h) and one tensor's (x', h').
type Case<X, G> = (Vec<X>, Vec<G>, Vec<X>);
type Out<X> = (Vec<X>, Vec<X>);

/// Runs the fast path on copies of the cases, in place or out of place.
fn fast<X: Element, G: Element<C = X::C>>(
    a: &AdagradAttrs,
    r: f64,
    t: i64,
    cases: &[Case<X, G>],
    par: &dyn Parallelism,
    in_place: bool,
) -> Vec<Out<X>> {
    let c = AdagradCoeffs::<X::C>::new(a, adjusted_rate(r, t, a.decay_factor));
    let mut outs: Vec<Out<X>> = cases.iter().map(|(x, _, h)| (x.clone(), h.clone())).collect();
    let work = cases
        .iter()
        .zip(outs.iter_mut())
        .map(|((x, g, h), (ox, oh))| {
            // Out of place, the results must not depend on what the output buffers held.
            if !in_place {
                let stale = X::store(X::C::from_f64(f64::NAN));
                ox.iter_mut().chain(oh.iter_mut()).for_each(|e| *e = stale);
            }
            AdagradTensor::new(stream(x, ox, in_place), g, stream(h, oh, in_place)).unwrap()
        })
        .collect();
    step(&c, work, par);
    outs
}

fn reference_all<X: Element, G: Element<C = X::C>>(
    a: &AdagradAttrs,
    r: f64,
    t: i64,
    cases: &[Case<X, G>],
) -> Vec<Out<X>> {
    cases.iter().map(|(x, g, h)| reference::adagrad(a, r, t, x, g, h)).collect()
}

/// Every output element, widened exactly to `f64`, as bits (distinct stored values give
/// distinct bits, signed zeros included).
fn bits<X: Element>(o: &[Out<X>]) -> Vec<u64> {
    o.iter().flat_map(|(x, h)| x.iter().chain(h).map(|e| e.load().to_f64().to_bits())).collect()
}

/// The fast path on every pool, in place and out of place, against the reference.
fn check<X: Element, G: Element<C = X::C>>(a: &AdagradAttrs, r: f64, t: i64, cases: &[Case<X, G>]) {
    let want = bits(&reference_all(a, r, t, cases));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for in_place in [false, true] {
        for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
            let got = bits(&fast(a, r, t, cases, par, in_place));
            assert!(got == want, "{} in_place={in_place}", std::any::type_name::<(X, G)>());
        }
    }
}

/// Deterministic data: lengths `lens`, `h >= 0` as an accumulated square is.
fn cases64(lens: &[usize], seed: u64) -> Vec<Case<f64, f64>> {
    let mut rnd = uniform(seed);
    lens.iter()
        .map(|&n| {
            let mut v = |k: f64| (0..n).map(|_| rnd() * k).collect::<Vec<f64>>();
            (v(8.0), v(2.0), v(4.0).into_iter().map(f64::abs).collect())
        })
        .collect()
}

fn attrs() -> impl Strategy<Value = AdagradAttrs> {
    (-0.5f32..2.0, 1e-8f32..1e-1, 0.0f32..0.5).prop_map(|(decay_factor, epsilon, norm_coefficient)| AdagradAttrs {
        decay_factor,
        epsilon,
        norm_coefficient,
    })
}

fn tensor_f32(len: usize) -> impl Strategy<Value = Case<f32, f32>> {
    let vals = move |lo: f32, hi: f32| proptest::collection::vec(lo..hi, len);
    (vals(-10.0, 10.0), vals(-5.0, 5.0), vals(0.0, 4.0))
}

proptest! {
    /// Random attributes, learning rate, update count and data, several tensors, float.
    #[test]
    fn fast_path_equals_reference_f32(
        a in attrs(),
        r in 1e-4f64..1.0,
        t in -3i64..1000,
        cases in proptest::collection::vec((0usize..70).prop_flat_map(tensor_f32), 1..4),
        in_place in any::<bool>(),
    ) {
        let want = bits(&reference_all(&a, r, t, &cases));
        prop_assert_eq!(bits(&fast(&a, r, t, &cases, &Sequential, in_place)), want);
    }

    /// The same in double, with data spread over many magnitudes.
    #[test]
    fn fast_path_equals_reference_f64(
        a in attrs(),
        r in 1e-4f64..1.0,
        t in -3i64..1000,
        xs in proptest::collection::vec(-1e3f64..1e3, 0..70),
        in_place in any::<bool>(),
    ) {
        let g: Vec<f64> = xs.iter().map(|x| x.sin() * 1e-3f64.powf(x.cos())).collect();
        let h: Vec<f64> = xs.iter().map(|x| x.cos().abs() * 10.0).collect();
        let cases = vec![(xs, g, h)];
        let want = bits(&reference_all(&a, r, t, &cases));
        prop_assert_eq!(bits(&fast(&a, r, t, &cases, &RayonPool(None), in_place)), want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Nodes large enough to be split into chunks, on a rayon pool.
    #[test]
    fn threaded_fast_path_equals_reference(
        a in attrs(),
        t in 0i64..100,
        lens in proptest::collection::vec(0usize..3 * CHUNK, 1..4),
        seed in any::<u64>(),
        in_place in any::<bool>(),
    ) {
        let cases: Vec<Case<f32, f32>> =
            cases64(&lens, seed).iter().map(|(x, g, h)| (convert(x, |e| e as f32), convert(g, |e| e as f32), convert(h, |e| e as f32))).collect();
        let want = bits(&reference_all(&a, 0.05, t, &cases));
        prop_assert_eq!(bits(&fast(&a, 0.05, t, &cases, &RayonPool(None), in_place)), want);
    }
}

/// Lengths around the chunk size, on 1 and 3 threads, in and out of place, float and double.
#[test]
fn threaded_split_is_bitwise_the_reference() {
    let lens = [0usize, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 7];
    let a = AdagradAttrs { decay_factor: 0.1, epsilon: 1e-5, norm_coefficient: 0.01 };
    let c64 = cases64(&lens, 11);
    let c32: Vec<Case<f32, f32>> = c64
        .iter()
        .map(|(x, g, h)| (convert(x, |e| e as f32), convert(g, |e| e as f32), convert(h, |e| e as f32)))
        .collect();
    check(&a, 0.01, 7, &c64);
    check(&a, 0.01, 7, &c32);
}

/// float16 and bfloat16 weights, and float32 weights with 16-bit gradients.
#[test]
fn sixteen_bit_and_mixed_types_are_bitwise_the_reference() {
    let lens = [0usize, 1, 3, 17, 1000, 2 * CHUNK + 13];
    let base = cases64(&lens, 99);
    let a = AdagradAttrs { decay_factor: 0.25, epsilon: 1e-3, norm_coefficient: 0.02 };
    let f32s = |v: &[f64]| convert(v, |e| e as f32);
    let mixed16: Vec<Case<f32, f16>> =
        base.iter().map(|(x, g, h)| (f32s(x), convert(g, f16::from_f64), f32s(h))).collect();
    let mixedb: Vec<Case<f32, bf16>> =
        base.iter().map(|(x, g, h)| (f32s(x), convert(g, bf16::from_f64), f32s(h))).collect();
    let all16: Vec<Case<f16, f16>> = base
        .iter()
        .map(|(x, g, h)| (convert(x, f16::from_f64), convert(g, f16::from_f64), convert(h, f16::from_f64)))
        .collect();
    let allb: Vec<Case<bf16, bf16>> = base
        .iter()
        .map(|(x, g, h)| (convert(x, bf16::from_f64), convert(g, bf16::from_f64), convert(h, bf16::from_f64)))
        .collect();
    check(&a, 0.1, 3, &mixed16);
    check(&a, 0.1, 3, &mixedb);
    check(&a, 0.1, 3, &all16);
    check(&a, 0.1, 3, &allb);
}

/// Non-finite and extreme inputs travel through the fast path exactly as through the
/// reference.
#[test]
fn non_finite_values_match_the_reference() {
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::MIN_POSITIVE, 1e-45, f32::MAX];
    let n = 64;
    let pick = |k: usize| (0..n).map(|i| specials[(i * k + i / 8) % specials.len()]).collect::<Vec<f32>>();
    let cases = vec![(pick(1), pick(3), pick(5))];
    check(&AdagradAttrs::default(), 0.1, 3, &cases);
    check(&AdagradAttrs { decay_factor: 0.5, epsilon: 0.0, norm_coefficient: 0.5 }, 0.1, 0, &cases);
}

#[test]
fn adjusted_rate_follows_onnx() {
    assert_eq!(adjusted_rate(0.1, 0, 0.5), 0.1);
    assert_eq!(adjusted_rate(0.1, 5, 0.0), 0.1);
    assert_eq!(adjusted_rate(0.75, 4, 0.5), 0.25);
    assert_eq!(adjusted_rate(0.75, -1, 0.5), 1.5);
    // The f32 attribute is used as stored: 0.1f32 widened, not the decimal 0.1.
    assert_eq!(adjusted_rate(1.0, 10, 0.1), 1.0 / (1.0 + 10.0 * f64::from(0.1f32)));
}

/// onnx's `test_adagrad` case, in double: known answers of the formula.
#[test]
fn onnx_test_adagrad_known_answer() {
    let a = AdagradAttrs { decay_factor: 0.1, epsilon: 1e-5, norm_coefficient: 0.001 };
    let (x, h) = reference::adagrad(&a, 0.1, 0, &[1.0f64], &[-1.0f64], &[2.0f64]);
    let g = f64::from(0.001f32) - 1.0;
    let h_new = 2.0 + g * g;
    assert_eq!(h[0], h_new);
    assert_eq!(x[0], 1.0 - 0.1 * g / (h_new.sqrt() + f64::from(1e-5f32)));
    assert!((x[0] - 1.0576962).abs() < 1e-6 && (h[0] - 2.998001).abs() < 1e-6, "{x:?} {h:?}");
    let fast = fast(&a, 0.1, 0, &[(vec![1.0f64], vec![-1.0f64], vec![2.0f64])], &Sequential, false);
    assert_eq!(fast[0], (x, h));
}

#[test]
fn mismatched_lengths_are_rejected() {
    let (x, h) = (vec![0f32; 3], vec![0f32; 3]);
    let (mut ox, mut oh) = (x.clone(), h.clone());
    let r = AdagradTensor::new(InOut::split(&x, &mut ox).unwrap(), &[0f32; 2], InOut::split(&h, &mut oh).unwrap());
    assert!(matches!(r, Err(KernelError::LengthMismatch { what: "G", got: 2, expected: 3 })));
    let (mut ox, mut oh) = (x.clone(), vec![0f32; 4]);
    let r = AdagradTensor::new(InOut::split(&x, &mut ox).unwrap(), &[0f32; 3], InOut::in_place(&mut oh));
    assert!(matches!(r, Err(KernelError::LengthMismatch { what: "H", got: 4, expected: 3 })));
}
