//! The forward against the `f64` reference and the module's bound, on edge shapes and
//! random data: every level and every pool give the same bits.

use super::*;
use crate::simd::available_levels;
use crate::test_util::uniform;
use crate::RayonPool;

const EPS: f32 = 1e-5;
const MOMENTUM: f32 = 0.9;

/// `X` with a per-channel offset (so the mean matters) and the per-channel inputs.
struct Data {
    x: Vec<f32>,
    scale: Vec<f32>,
    bias: Vec<f32>,
    mean: Vec<f32>,
    var: Vec<f32>,
}

impl Data {
    fn new(sh: BnShape, seed: u64) -> Self {
        let mut u = uniform(seed);
        let x =
            (0..sh.len()).map(|i| (((i / sh.s.max(1)) % sh.c.max(1)) as f64 * 0.75 - 1.0 + 2.0 * u()) as f32).collect();
        let mut per = |a: f64, b: f64| -> Vec<f32> { (0..sh.c).map(|_| (a + b * u()) as f32).collect() };
        Self { x, scale: per(-1.5, 3.0), bias: per(-1.0, 2.0), mean: per(-1.0, 2.0), var: per(0.5, 1.0) }
    }

    fn params(&self) -> BnParams<'_> {
        BnParams {
            scale: &self.scale,
            bias: &self.bias,
            input_mean: &self.mean,
            input_var: &self.var,
            epsilon: EPS,
            momentum: MOMENTUM,
        }
    }
}

type Out = (Vec<f32>, Vec<f32>, Vec<f32>);

fn fast(level: Level, par: &dyn Parallelism, d: &Data, sh: BnShape) -> Out {
    let (mut y, mut rm, mut rv) = (vec![f32::NAN; sh.len()], vec![f32::NAN; sh.c], vec![f32::NAN; sh.c]);
    let out = BnOutputs { y: &mut y, running_mean: Some(&mut rm), running_var: Some(&mut rv) };
    batch_norm_train_at(level, &d.x, d.params(), sh, out, par).unwrap();
    (y, rm, rv)
}

/// The module's bound on `got` against the exact `f64` values.
fn check_bound(got: &Out, d: &Data, sh: BnShape) {
    let u = 2f64.powi(-24);
    let cnt = (sh.n * sh.s) as f64;
    let f = f64::from;
    let m = f(MOMENTUM);
    for c in 0..sh.c {
        let idx: Vec<usize> = (0..sh.n).flat_map(|n| (0..sh.s).map(move |s| (n * sh.c + c) * sh.s + s)).collect();
        let mean = idx.iter().map(|&i| f(d.x[i])).sum::<f64>() / cnt;
        let var = idx.iter().map(|&i| (f(d.x[i]) - mean).powi(2)).sum::<f64>() / cnt;
        let rstd = 1.0 / (var + f(EPS)).sqrt();
        let k = f(d.scale[c]) * rstd;
        // The float64 sums' error (the module text): 2^-30 of the terms' mean magnitude.
        let a = 2f64.powi(-30) * idx.iter().map(|&i| f(d.x[i]).abs()).sum::<f64>() / cnt;
        let q = 2f64.powi(-30) * var;
        for &i in &idx {
            let xc = f(d.x[i]) - mean;
            let exact = xc * k + f(d.bias[c]);
            let bound = 4.0 * u * (k.abs() * (xc.abs() + mean.abs()) + f(d.bias[c]).abs()) + 2.0 * k.abs() * a;
            assert!((f(got.0[i]) - exact).abs() <= bound, "Y[{i}] of {sh:?}: {} vs {exact} (bound {bound})", got.0[i]);
        }
        for (what, got, input, stat, sums) in
            [("mean", got.1[c], d.mean[c], mean, a), ("var", got.2[c], d.var[c], var, 2.0 * q)]
        {
            let exact = f(input) * m + stat * (1.0 - m);
            let bound = u * exact.abs() + 2f64.powi(-30) * f(input).abs() * m + (1.0 - m) * sums;
            assert!((f(got) - exact).abs() <= bound, "running {what}[{c}] of {sh:?}: {got} vs {exact}");
        }
    }
}

const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 2),
    (2, 1, 1),
    (1, 3, 8),
    (3, 2, 7),
    (5, 3, 9),
    (4, 5, 17),
    (7, 3, 16),
    (2, 70, 1),
    (33, 129, 1),
    (3, 65, 3),
    (9, 4, 64),
    (64, 8, 64),
    (256, 16, 16),
    (2, 5, 100),
];

#[test]
fn every_level_and_pool_gives_the_same_bits_within_the_bound() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for (k, &(n, c, s)) in SHAPES.iter().enumerate() {
        let sh = BnShape { n, c, s };
        let d = Data::new(sh, 11 + k as u64);
        let first = fast(Level::Scalar, &Sequential, &d, sh);
        check_bound(&first, &d, sh);
        check_bound(&reference::batch_norm_train(&d.x, d.params(), sh), &d, sh);
        for level in available_levels() {
            for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
                let got = fast(level, par, &d, sh);
                for (a, b) in [(&got.0, &first.0), (&got.1, &first.1), (&got.2, &first.2)] {
                    let same = a.iter().zip(b.iter()).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(same, "{level:?} differs from the scalar level on {sh:?}");
                }
            }
        }
    }
}

#[test]
fn large_threaded_shape_within_the_bound() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let sh = BnShape { n: 256, c: 8, s: 64 };
    let d = Data::new(sh, 99);
    check_bound(&fast(detected(), &RayonPool(Some(&pool)), &d, sh), &d, sh);
}

/// A channel far from zero with a small spread: the two-pass variance keeps its digits
/// (a sum of squares would lose them to cancellation).
#[test]
fn offset_channel_keeps_its_variance() {
    let sh = BnShape { n: 4, c: 1, s: 64 };
    let mut d = Data::new(sh, 5);
    d.x = (0..sh.len()).map(|i| 1000.0 + (i % 7) as f32 * 0.001).collect();
    let got = fast(detected(), &Sequential, &d, sh);
    check_bound(&got, &d, sh);
}

/// Every element of a channel equal: its variance is 0, so Y is B exactly (x - mean = 0).
#[test]
fn constant_channel_gives_the_bias() {
    let sh = BnShape { n: 3, c: 2, s: 5 };
    let mut d = Data::new(sh, 3);
    d.x = vec![2.5f32; sh.len()];
    let got = fast(detected(), &Sequential, &d, sh);
    for (i, &y) in got.0.iter().enumerate() {
        assert_eq!(y, d.bias[(i / sh.s) % sh.c], "{i}");
    }
    let want = (f64::from(d.mean[0]) * 0.9f32 as f64 + 2.5 * (1.0 - 0.9f32 as f64)) as f32;
    assert_eq!(got.1[0], want);
}

/// No channel: nothing to do, whatever the other dimensions (their product may not even
/// fit in usize beside the zero).
#[test]
fn no_channel() {
    for sh in [BnShape { n: 1 << 40, c: 0, s: 1 << 40 }, BnShape { n: 3, c: 0, s: 4 }] {
        let out = BnOutputs { y: &mut [], running_mean: Some(&mut []), running_var: None };
        let p = BnParams { scale: &[], bias: &[], input_mean: &[], input_var: &[], epsilon: EPS, momentum: MOMENTUM };
        batch_norm_train(&[], p, sh, out, &Sequential).unwrap();
    }
}

/// The float64 sums' error is part of the bound: a channel whose large terms cancel (the
/// mean of [2^60, 1, -2^60] computed as 0, exactly 1/3) stays within it.
#[test]
fn cancelling_channel_within_the_bound() {
    let sh = BnShape { n: 3, c: 1, s: 1 };
    let mut d = Data::new(sh, 4);
    d.x = vec![2f32.powi(60), 1.0, -(2f32.powi(60))];
    let got = fast(detected(), &Sequential, &d, sh);
    check_bound(&got, &d, sh);
}

/// No element per channel: Y is empty, the statistics NaN, nothing sized by the huge
/// dimension beside the zero.
#[test]
fn empty_shapes() {
    for (n, c, s) in [(0, 3, 4), (2, 3, 0), (1 << 40, 2, 0)] {
        let sh = BnShape { n, c, s };
        let d = Data::new(BnShape { n: 0, c, s }, 1);
        let (mut rm, mut rv) = (vec![0f32; c], vec![0f32; c]);
        let out = BnOutputs { y: &mut [], running_mean: Some(&mut rm), running_var: Some(&mut rv) };
        batch_norm_train(&d.x, d.params(), sh, out, &Sequential).unwrap();
        assert!(rm.iter().chain(&rv).all(|v| v.is_nan()), "{sh:?}");
    }
}

#[test]
fn lengths_are_checked() {
    let sh = BnShape { n: 2, c: 3, s: 4 };
    let d = Data::new(sh, 2);
    let mut y = vec![0f32; sh.len() - 1];
    let out = BnOutputs { y: &mut y, running_mean: None, running_var: None };
    let e = batch_norm_train(&d.x, d.params(), sh, out, &Sequential).unwrap_err();
    assert_eq!(e, KernelError::LengthMismatch { what: "Y", got: sh.len() - 1, expected: sh.len() });
    let mut y = vec![0f32; sh.len()];
    let p = BnParams { bias: &d.bias[..2], ..d.params() };
    let out = BnOutputs { y: &mut y, running_mean: None, running_var: None };
    let e = batch_norm_train(&d.x, p, sh, out, &Sequential).unwrap_err();
    assert_eq!(e, KernelError::LengthMismatch { what: "B", got: 2, expected: 3 });
}
