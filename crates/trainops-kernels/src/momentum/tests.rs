use half::{bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::test_util::{convert, stream, uniform};
use crate::{RayonPool, Sequential};

/// One tensor's (x, g, v) and one tensor's (x', v').
type Case<X, G> = (Vec<X>, Vec<G>, Vec<X>);
type Out<X> = (Vec<X>, Vec<X>);

const STANDARD: MomentumMode = MomentumMode::Standard;
const NESTEROV: MomentumMode = MomentumMode::Nesterov;

/// Runs the fast path on copies of the cases, in place or out of place.
fn fast<X: Element, G: Element<C = X::C>>(
    a: &MomentumAttrs,
    r: f64,
    t: i64,
    cases: &[Case<X, G>],
    par: &dyn Parallelism,
    in_place: bool,
) -> Vec<Out<X>> {
    let c = MomentumCoeffs::<X::C>::new(a, r, t);
    let mut outs: Vec<Out<X>> = cases.iter().map(|(x, _, v)| (x.clone(), v.clone())).collect();
    let work = cases
        .iter()
        .zip(outs.iter_mut())
        .map(|((x, g, v), (ox, ov))| {
            // Out of place, the results must not depend on what the output buffers held.
            if !in_place {
                let stale = X::store(X::C::from_f64(f64::NAN));
                ox.iter_mut().chain(ov.iter_mut()).for_each(|e| *e = stale);
            }
            MomentumTensor::new(stream(x, ox, in_place), g, stream(v, ov, in_place)).unwrap()
        })
        .collect();
    step(&c, work, par);
    outs
}

fn reference_all<X: Element, G: Element<C = X::C>>(
    a: &MomentumAttrs,
    r: f64,
    t: i64,
    cases: &[Case<X, G>],
) -> Vec<Out<X>> {
    cases.iter().map(|(x, g, v)| reference::momentum(a, r, t, x, g, v)).collect()
}

/// Every output element, widened exactly to `f64`, as bits (distinct stored values give
/// distinct bits, signed zeros included).
fn bits<X: Element>(o: &[Out<X>]) -> Vec<u64> {
    o.iter().flat_map(|(x, v)| x.iter().chain(v).map(|e| e.load().to_f64().to_bits())).collect()
}

/// The fast path on every pool, in place and out of place, against the reference.
fn check<X: Element, G: Element<C = X::C>>(a: &MomentumAttrs, r: f64, t: i64, cases: &[Case<X, G>]) {
    let want = bits(&reference_all(a, r, t, cases));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for in_place in [false, true] {
        for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
            let got = bits(&fast(a, r, t, cases, par, in_place));
            assert!(got == want, "{} {:?} in_place={in_place}", std::any::type_name::<(X, G)>(), a.mode);
        }
    }
}

/// Deterministic data of lengths `lens`.
fn cases64(lens: &[usize], seed: u64) -> Vec<Case<f64, f64>> {
    let mut rnd = uniform(seed);
    lens.iter()
        .map(|&n| {
            let mut v = |k: f64| (0..n).map(|_| rnd() * k).collect::<Vec<f64>>();
            (v(8.0), v(2.0), v(1.0))
        })
        .collect()
}

fn to_f32(cases: &[Case<f64, f64>]) -> Vec<Case<f32, f32>> {
    let f = |v: &Vec<f64>| convert(v, |e| e as f32);
    cases.iter().map(|(x, g, v)| (f(x), f(g), f(v))).collect()
}

fn mode() -> impl Strategy<Value = MomentumMode> {
    prop_oneof![Just(STANDARD), Just(NESTEROV)]
}

fn attrs() -> impl Strategy<Value = MomentumAttrs> {
    (0.0f32..1.0, 0.0f32..2.0, mode(), 0.0f32..0.5).prop_map(|(alpha, beta, mode, norm_coefficient)| MomentumAttrs {
        alpha,
        beta,
        mode,
        norm_coefficient,
    })
}

fn tensor_f32(len: usize) -> impl Strategy<Value = Case<f32, f32>> {
    let vals = move |lo: f32, hi: f32| proptest::collection::vec(lo..hi, len);
    (vals(-10.0, 10.0), vals(-5.0, 5.0), vals(-1.0, 1.0))
}

proptest! {
    /// Random attributes (both modes), learning rate, update count (both sides of the
    /// `T > 0` rule) and data, several tensors, float.
    #[test]
    fn fast_path_equals_reference_f32(
        a in attrs(),
        r in 1e-4f64..1.0,
        t in -3i64..5,
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
        t in -3i64..5,
        xs in proptest::collection::vec(-1e3f64..1e3, 0..70),
        in_place in any::<bool>(),
    ) {
        let g: Vec<f64> = xs.iter().map(|x| x.sin() * 1e-3f64.powf(x.cos())).collect();
        let v: Vec<f64> = xs.iter().map(|x| x.cos() * 0.1).collect();
        let cases = vec![(xs, g, v)];
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
        t in 0i64..3,
        lens in proptest::collection::vec(0usize..3 * CHUNK, 1..4),
        seed in any::<u64>(),
        in_place in any::<bool>(),
    ) {
        let cases = to_f32(&cases64(&lens, seed));
        let want = bits(&reference_all(&a, 0.05, t, &cases));
        prop_assert_eq!(bits(&fast(&a, 0.05, t, &cases, &RayonPool(None), in_place)), want);
    }
}

/// Lengths around the chunk size, on 1 and 3 threads, in and out of place, float and
/// double, both modes.
#[test]
fn threaded_split_is_bitwise_the_reference() {
    let lens = [0usize, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 7];
    let c64 = cases64(&lens, 5);
    let c32 = to_f32(&c64);
    for mode in [STANDARD, NESTEROV] {
        let a = MomentumAttrs { alpha: 0.9, beta: 0.5, mode, norm_coefficient: 0.01 };
        for t in [0, 7] {
            check(&a, 0.01, t, &c64);
            check(&a, 0.01, t, &c32);
        }
    }
}

/// float16 and bfloat16 weights, and float32 weights with 16-bit gradients.
#[test]
fn sixteen_bit_and_mixed_types_are_bitwise_the_reference() {
    let lens = [0usize, 1, 3, 17, 1000, 2 * CHUNK + 13];
    let base = cases64(&lens, 99);
    let f32s = |v: &[f64]| convert(v, |e| e as f32);
    let mixed16: Vec<Case<f32, f16>> =
        base.iter().map(|(x, g, v)| (f32s(x), convert(g, f16::from_f64), f32s(v))).collect();
    let mixedb: Vec<Case<f32, bf16>> =
        base.iter().map(|(x, g, v)| (f32s(x), convert(g, bf16::from_f64), f32s(v))).collect();
    let all16: Vec<Case<f16, f16>> = base
        .iter()
        .map(|(x, g, v)| (convert(x, f16::from_f64), convert(g, f16::from_f64), convert(v, f16::from_f64)))
        .collect();
    let allb: Vec<Case<bf16, bf16>> = base
        .iter()
        .map(|(x, g, v)| (convert(x, bf16::from_f64), convert(g, bf16::from_f64), convert(v, bf16::from_f64)))
        .collect();
    for mode in [STANDARD, NESTEROV] {
        let a = MomentumAttrs { alpha: 0.95, beta: 0.3, mode, norm_coefficient: 0.02 };
        check(&a, 0.1, 3, &mixed16);
        check(&a, 0.1, 3, &mixedb);
        check(&a, 0.1, 3, &all16);
        check(&a, 0.1, 3, &allb);
    }
}

/// Non-finite and extreme inputs travel through the fast path exactly as through the
/// reference.
#[test]
fn non_finite_values_match_the_reference() {
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::MIN_POSITIVE, 1e-45, f32::MAX];
    let n = 64;
    let pick = |k: usize| (0..n).map(|i| specials[(i * k + i / 8) % specials.len()]).collect::<Vec<f32>>();
    let cases = vec![(pick(1), pick(3), pick(5))];
    for mode in [STANDARD, NESTEROV] {
        for t in [0, 1] {
            check(&MomentumAttrs { alpha: 0.9, beta: 0.1, mode, norm_coefficient: 0.0 }, 0.1, t, &cases);
        }
    }
}

/// The gradient's coefficient is 1 while `T <= 0`, `beta` once `T > 0`.
#[test]
fn beta_is_one_until_the_first_update() {
    for t in [i64::MIN, -1, 0] {
        assert_eq!(adjusted_beta(t, 0.25), 1.0);
    }
    for t in [1, 2, i64::MAX] {
        assert_eq!(adjusted_beta(t, 0.25), 0.25);
    }
    // T = 0: v' = alpha * v + g (not g alone, and not beta * g).
    let a = MomentumAttrs { alpha: 0.5, beta: 0.25, mode: STANDARD, norm_coefficient: 0.0 };
    let (x, v) = reference::momentum(&a, 0.5, 0, &[1.0f64], &[2.0f64], &[4.0f64]);
    assert_eq!((x[0], v[0]), (1.0 - 0.5 * 4.0, 0.5 * 4.0 + 2.0));
    let (x, v) = reference::momentum(&a, 0.5, 1, &[1.0f64], &[2.0f64], &[4.0f64]);
    assert_eq!((x[0], v[0]), (1.0 - 0.5 * 2.5, 0.5 * 4.0 + 0.25 * 2.0));
    let n = MomentumAttrs { mode: NESTEROV, ..a };
    let (x, v) = reference::momentum(&n, 0.5, 1, &[1.0f64], &[2.0f64], &[4.0f64]);
    assert_eq!((x[0], v[0]), (1.0 - 0.5 * (2.0 + 0.5 * 2.5), 2.5));
}

/// onnx's `test_momentum` and `test_nesterov_momentum` cases, in double: known answers.
#[test]
fn onnx_cases_known_answers() {
    let (x, g, v) = (vec![1.2f64, 2.8], vec![-0.94f64, -2.5], vec![1.7f64, 3.6]);
    let standard = MomentumAttrs { alpha: 0.95, beta: 0.1, mode: STANDARD, norm_coefficient: 0.001 };
    let (xs, vs) = reference::momentum(&standard, 0.1, 0, &x, &g, &v);
    let want = ([1.13238, 2.70772], [0.67620003, 0.9227998]);
    for i in 0..2 {
        assert!((xs[i] - want.0[i]).abs() < 1e-6 && (vs[i] - want.1[i]).abs() < 1e-6, "{xs:?} {vs:?}");
    }
    let nesterov = MomentumAttrs { alpha: 0.95, beta: 1.0, mode: NESTEROV, norm_coefficient: 0.01 };
    let (xs, vs) = reference::momentum(&nesterov, 0.1, 0, &x, &g, &v);
    let want = ([1.227535, 2.95714], [0.68700004, 0.94799995]);
    for i in 0..2 {
        assert!((xs[i] - want.0[i]).abs() < 1e-6 && (vs[i] - want.1[i]).abs() < 1e-6, "{xs:?} {vs:?}");
    }
}

#[test]
fn modes_are_named_as_in_onnx() {
    assert_eq!(MomentumMode::from_onnx("standard"), Some(STANDARD));
    assert_eq!(MomentumMode::from_onnx("nesterov"), Some(NESTEROV));
    for bad in ["", "Standard", "NESTEROV", "adam", "standard "] {
        assert_eq!(MomentumMode::from_onnx(bad), None, "{bad:?}");
    }
}

#[test]
fn mismatched_lengths_are_rejected() {
    let (x, v) = (vec![0f64; 3], vec![0f64; 3]);
    let (mut ox, mut ov) = (x.clone(), v.clone());
    let r = MomentumTensor::new(InOut::split(&x, &mut ox).unwrap(), &[0f64; 4], InOut::split(&v, &mut ov).unwrap());
    assert!(matches!(r, Err(KernelError::LengthMismatch { what: "G", got: 4, expected: 3 })));
    let (mut ox, mut ov) = (x.clone(), vec![0f64; 2]);
    let r = MomentumTensor::new(InOut::split(&x, &mut ox).unwrap(), &[0f64; 3], InOut::in_place(&mut ov));
    assert!(matches!(r, Err(KernelError::LengthMismatch { what: "V", got: 2, expected: 3 })));
}
