//! The fast path against the `f64` reference, on edge shapes and random data: every level
//! and every pool give the same bits, and those are within the module's stated bound.

use super::*;
use crate::simd::available_levels;
use crate::test_util::uniform;
use crate::RayonPool;

const EPS: f32 = 1e-5;

/// `X` with a per-channel offset (so the mean matters), `dY`, `scale`.
fn data(sh: BnShape, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut u = uniform(seed);
    let x = (0..sh.len()).map(|i| (((i / sh.s.max(1)) % sh.c.max(1)) as f64 * 0.75 - 1.0 + 2.0 * u()) as f32).collect();
    let dy = (0..sh.len()).map(|_| u() as f32).collect();
    let scale = (0..sh.c).map(|_| (0.5 + u()) as f32).collect();
    (x, dy, scale)
}

type Out = (Vec<f32>, Vec<f32>, Vec<f32>);

fn fast(level: Level, par: &dyn Parallelism, dy: &[f32], x: &[f32], scale: &[f32], sh: BnShape) -> Out {
    let (mut dx, mut ds, mut db) = (vec![f32::NAN; sh.len()], vec![f32::NAN; sh.c], vec![f32::NAN; sh.c]);
    let out = BnGrads { dx: Some(&mut dx), dscale: Some(&mut ds), dbias: Some(&mut db) };
    batch_norm_train_grad_at(level, dy, x, scale, EPS, sh, out, par).unwrap();
    (dx, ds, db)
}

/// The module's bound on `got` against the exact `f64` value (which the reference rounds
/// once: half an ulp more).
fn check_bound(got: &Out, dy: &[f32], x: &[f32], scale: &[f32], sh: BnShape) {
    let u = 2f64.powi(-24);
    let cnt = (sh.n * sh.s) as f64;
    for (c, &sc) in scale.iter().enumerate() {
        let idx: Vec<usize> = (0..sh.n).flat_map(|n| (0..sh.s).map(move |s| (n * sh.c + c) * sh.s + s)).collect();
        let f = |v: f32| f64::from(v);
        let mean = idx.iter().map(|&i| f(x[i])).sum::<f64>() / cnt;
        let var = idx.iter().map(|&i| (f(x[i]) - mean).powi(2)).sum::<f64>() / cnt;
        let rstd = 1.0 / (var + f64::from(EPS)).sqrt();
        let sdy = idx.iter().map(|&i| f(dy[i])).sum::<f64>();
        let terms: Vec<f64> = idx.iter().map(|&i| f(dy[i]) * (f(x[i]) - mean) * rstd).collect();
        let sdyxhat = terms.iter().sum::<f64>();
        let k = f(sc) * rstd;
        let (p, mdy) = (rstd * sdyxhat / cnt, sdy / cnt);
        for &i in &idx {
            let exact = k * (f(dy[i]) - sdy / cnt - (f(x[i]) - mean) * rstd * sdyxhat / cnt);
            let xc = f(x[i]) - mean;
            let bound = 4.0 * u * k.abs() * ((f(dy[i]) - mdy).abs() + mdy.abs() + p.abs() * (xc.abs() + mean.abs()));
            assert!((f(got.0[i]) - exact).abs() <= bound, "dX[{i}] of {sh:?}: {} vs {exact} (bound {bound})", got.0[i]);
        }
        let sabs = terms.iter().map(|t| t.abs()).sum::<f64>();
        let dabs = idx.iter().map(|&i| f(dy[i]).abs()).sum::<f64>();
        let ds_bound = u * sdyxhat.abs() + 2f64.powi(-30) * sabs;
        assert!((f(got.1[c]) - sdyxhat).abs() <= ds_bound, "dScale[{c}] of {sh:?}: {} vs {sdyxhat}", got.1[c]);
        assert!((f(got.2[c]) - sdy).abs() <= u * sdy.abs() + 2f64.powi(-30) * dabs, "dBias[{c}] of {sh:?}");
    }
}

const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (2, 1, 1),
    (1, 3, 1),
    (1, 1, 8),
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
    // mobilenet_v3_small's last BatchNorm (576 channels, 4x4, batch 16): threaded
    (16, 576, 16),
];

#[test]
fn every_level_and_pool_gives_the_same_bits_within_the_bound() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for (k, &(n, c, s)) in SHAPES.iter().enumerate() {
        let sh = BnShape { n, c, s };
        let (x, dy, scale) = data(sh, 7 + k as u64);
        let first = fast(Level::Scalar, &Sequential, &dy, &x, &scale, sh);
        check_bound(&first, &dy, &x, &scale, sh);
        let reference = reference::batch_norm_train_grad(&dy, &x, &scale, EPS, sh);
        check_bound(&reference, &dy, &x, &scale, sh);
        for level in available_levels() {
            for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
                let got = fast(level, par, &dy, &x, &scale, sh);
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
    let (x, dy, scale) = data(sh, 99);
    let got = fast(detected(), &RayonPool(Some(&pool)), &dy, &x, &scale, sh);
    check_bound(&got, &dy, &x, &scale, sh);
}

#[test]
fn constant_channel_gives_zero_dx_and_dscale() {
    // Every element of the channel equal: xhat = 0, so dX = scale * rstd * (dY - mean(dY)).
    let sh = BnShape { n: 4, c: 1, s: 9 };
    let x = vec![2.5f32; sh.len()];
    let dy: Vec<f32> = (0..sh.len()).map(|i| i as f32).collect();
    let got = fast(detected(), &Sequential, &dy, &x, &[1.0], sh);
    check_bound(&got, &dy, &x, &[1.0], sh);
    let rstd = 1.0 / f64::from(EPS).sqrt();
    for (i, &g) in got.0.iter().enumerate() {
        // dY - mean(dY) is exact here (halves), so only the product rounds.
        let exact = rstd * (i as f64 - 17.5);
        assert!((f64::from(g) - exact).abs() <= 2.0 * 2f64.powi(-24) * exact.abs(), "{i}: {g} vs {exact}");
    }
    assert_eq!(got.1[0], 0.0);
    assert_eq!(got.2[0], 630.0);
}

#[test]
fn empty_shapes_write_zero_sums() {
    for (n, c, s) in [(0, 3, 4), (3, 0, 4), (2, 3, 0)] {
        let sh = BnShape { n, c, s };
        let (x, dy, scale) = data(sh, 1);
        let got = fast(detected(), &Sequential, &dy, &x, &scale, sh);
        assert!(got.0.is_empty() || sh.is_empty());
        assert!(got.1.iter().chain(&got.2).all(|&v| v == 0.0), "{sh:?}");
    }
}

/// An empty tensor may have huge dimensions beside its zero: nothing is sized by them (the
/// tasks' lists once reserved one entry per sample, 2^40 of them here).
#[test]
fn empty_tensors_with_huge_dimensions() {
    assert_eq!(BnShape::of(&[1 << 40, 1 << 40, 0]), Some(BnShape { n: 1 << 40, c: 1 << 40, s: 0 }));
    assert_eq!(BnShape::of(&[1 << 40, 1 << 40, 1 << 40]), None);
    assert_eq!(BnShape::of(&[3]), None);
    let sh = BnShape::of(&[1 << 40, 2, 0]).unwrap();
    assert_eq!(sh.len(), 0);
    let (mut dx, mut ds, mut db) = (vec![], vec![f32::NAN; 2], vec![f32::NAN; 2]);
    let out = BnGrads { dx: Some(&mut dx), dscale: Some(&mut ds), dbias: Some(&mut db) };
    batch_norm_train_grad(&[], &[], &[1.0, 2.0], EPS, sh, out, &Sequential).unwrap();
    assert_eq!((ds, db), (vec![0.0; 2], vec![0.0; 2]));
}

#[test]
fn each_output_alone_equals_its_part_of_all_three() {
    let sh = BnShape { n: 6, c: 5, s: 10 };
    let (x, dy, scale) = data(sh, 3);
    let all = fast(detected(), &Sequential, &dy, &x, &scale, sh);
    let mut dx = vec![0f32; sh.len()];
    let out = BnGrads { dx: Some(&mut dx), ..Default::default() };
    batch_norm_train_grad(&dy, &x, &scale, EPS, sh, out, &Sequential).unwrap();
    assert_eq!(dx, all.0);
    let mut ds = vec![0f32; sh.c];
    let out = BnGrads { dscale: Some(&mut ds), ..Default::default() };
    batch_norm_train_grad(&dy, &x, &scale, EPS, sh, out, &Sequential).unwrap();
    assert_eq!(ds, all.1);
    let mut db = vec![0f32; sh.c];
    let out = BnGrads { dbias: Some(&mut db), ..Default::default() };
    batch_norm_train_grad(&dy, &x, &scale, EPS, sh, out, &Sequential).unwrap();
    assert_eq!(db, all.2);
}

#[test]
fn wrong_lengths_are_errors() {
    let sh = BnShape { n: 2, c: 3, s: 4 };
    let (x, dy, scale) = data(sh, 5);
    let err = batch_norm_train_grad(&dy, &x[1..], &scale, EPS, sh, BnGrads::default(), &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "X", got: 23, expected: 24 });
    let err = batch_norm_train_grad(&dy, &x, &scale[..2], EPS, sh, BnGrads::default(), &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "scale", got: 2, expected: 3 });
    let mut ds = vec![0f32; 4];
    let out = BnGrads { dscale: Some(&mut ds), ..Default::default() };
    let err = batch_norm_train_grad(&dy, &x, &scale, EPS, sh, out, &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "dScale", got: 4, expected: 3 });
}

#[test]
fn shape_of_dims() {
    assert_eq!(BnShape::of(&[4, 3]), Some(BnShape { n: 4, c: 3, s: 1 }));
    assert_eq!(BnShape::of(&[4, 3, 5, 2]), Some(BnShape { n: 4, c: 3, s: 10 }));
    assert_eq!(BnShape::of(&[4]), None);
}

/// Not a test: the kernel's time per element (minimum of many calls, one thread), for
/// tuning (`cargo test --release -p trainops-kernels --lib bn_timing -- --ignored --nocapture`).
#[test]
#[ignore]
fn bn_timing() {
    for (n, c, s) in [(256, 16, 16), (256, 8, 64), (8, 16, 1024), (256, 512, 1)] {
        let sh = BnShape { n, c, s };
        let (x, dy, scale) = data(sh, 1);
        let (mut dx, mut ds, mut db) = (vec![0f32; sh.len()], vec![0f32; c], vec![0f32; c]);
        let mut best = f64::MAX;
        for _ in 0..300 {
            let t = std::time::Instant::now();
            let out = BnGrads { dx: Some(&mut dx), dscale: Some(&mut ds), dbias: Some(&mut db) };
            batch_norm_train_grad(&dy, &x, &scale, EPS, sh, out, &Sequential).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{sh:?}: {:.1} us, {:.3} ns/element", best * 1e6, best * 1e9 / sh.len() as f64);
    }
}

/// No channel beside huge dimensions (their product overflows): nothing to do, no panic
/// (the task width once divided by the wrapped product N * S).
#[test]
fn no_channel_with_huge_dimensions() {
    let sh = BnShape { n: 1 << 40, c: 0, s: 1 << 40 };
    let out = BnGrads { dx: Some(&mut []), dscale: Some(&mut []), dbias: None };
    batch_norm_train_grad(&[], &[], &[], EPS, sh, out, &Sequential).unwrap();
}
