use proptest::prelude::*;

use super::*;
use crate::{RayonPool, Sequential};

/// One tensor's (x, g, v, h) and one tensor's (x', v', h').
type Case<X, G> = (Vec<X>, Vec<G>, Vec<X>, Vec<X>);
type Out<X> = (Vec<X>, Vec<X>, Vec<X>);

/// Runs the fast path out of place on copies, returning (x, v, h).
fn fast<X: Element, G: Element<C = X::C>>(
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
            fn s<'b, X: Copy>(src: &'b [X], dst: &'b mut [X], in_place: bool) -> InOut<'b, X> {
                if in_place {
                    InOut::in_place(dst)
                } else {
                    InOut::split(src, dst).unwrap()
                }
            }
            // The out-of-place run writes over stale copies (its results must not depend on
            // what the output buffer held).
            if !in_place {
                ox.iter_mut().for_each(|e| *e = X::store(X::C::from_f64(f64::NAN)));
            }
            AdamTensor::new(s(x, ox, in_place), g, s(v, ov, in_place), s(h, oh, in_place)).unwrap()
        })
        .collect();
    step(&c, work, par);
    outs
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
    fn fast_path_equals_reference_f32(
        a in attrs(),
        r in 1e-4f64..1.0,
        t in -3i64..50,
        tensors in proptest::collection::vec((0usize..80).prop_flat_map(tensor_f32), 1..5),
        in_place in any::<bool>(),
    ) {
        let want = bits32(&reference_all(&a, r, t, &tensors));
        prop_assert_eq!(bits32(&fast(&a, r, t, &tensors, &Sequential, in_place)), want);
    }

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
