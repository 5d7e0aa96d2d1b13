use super::*;
use crate::simd::available_levels;
use crate::test_util::uniform;
use crate::{RayonPool, Sequential};

const EPS: f64 = f32::EPSILON as f64;

/// dY and a true (log-)softmax Y along the axis of `dims`.
fn case(kind: Kind, dims: Dims, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut u = uniform(seed);
    let total = dims.outer * dims.n * dims.inner;
    let dy: Vec<f32> = (0..total).map(|_| (2.0 * u()) as f32).collect();
    let x: Vec<f64> = (0..total).map(|_| 6.0 * u()).collect();
    let mut y = vec![0f32; total];
    for o in 0..dims.outer {
        for i in 0..dims.inner {
            let at = |c: usize| o * dims.n * dims.inner + c * dims.inner + i;
            let m = (0..dims.n).map(|c| x[at(c)]).fold(f64::MIN, f64::max);
            let z: f64 = (0..dims.n).map(|c| (x[at(c)] - m).exp()).sum();
            for c in 0..dims.n {
                let ls = x[at(c)] - m - z.ln();
                y[at(c)] = (if kind == Kind::Softmax { ls.exp() } else { ls }) as f32;
            }
        }
    }
    (dy, y)
}

fn run(level: Level, kind: Kind, dims: Dims, dy: &[f32], y: &[f32], par: &dyn Parallelism) -> Vec<f32> {
    let mut dx = vec![f32::NAN; dy.len()];
    softmax_grad(level, kind, dims, dy, y, &mut dx, par).unwrap();
    dx
}

/// The fast path's result against the reference, within the module's stated bound.
fn within_bound(kind: Kind, dims: Dims, dy: &[f32], y: &[f32], got: &[f32]) {
    let want = reference(kind, dims, dy, y);
    let Dims { outer, n, inner } = dims;
    for o in 0..outer {
        for i in 0..inner {
            let at = |c: usize| o * n * inner + c * inner + i;
            // The sum of the terms' magnitudes: each f32 product dY Y is rounded before the sum.
            let s: f64 = (0..n)
                .map(|c| (f64::from(dy[at(c)]) * if kind == Kind::Softmax { f64::from(y[at(c)]) } else { 1.0 }).abs())
                .sum();
            for c in 0..n {
                let (d, v) = (f64::from(dy[at(c)]), f64::from(y[at(c)]));
                let scale = match kind {
                    Kind::Softmax => v.abs() * (d.abs() + s),
                    Kind::LogSoftmax => d.abs() + v.exp() * s,
                };
                let (g, w) = (f64::from(got[at(c)]), f64::from(want[at(c)]));
                let bound = 4.0 * EPS * scale + EPS * w.abs() + f64::from(f32::MIN_POSITIVE);
                assert!((g - w).abs() <= bound, "{kind:?} {dims:?} at {}: {g} vs {w}", at(c));
            }
        }
    }
}

#[test]
fn every_level_and_thread_count_gives_the_same_bits_within_the_bound_of_the_reference() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let shapes = [
        (0, 5, 1),
        (3, 0, 1),
        (1, 1, 1),
        (2, 7, 1),
        (3, 8, 1),
        (3, 9, 1),
        (4, 17, 1),
        (5, 32, 1),
        (4096, 32, 1),
        (2, 3, 5),
        (3, 10, 9),
        (64, 10, 1),
        (40, 33, 100),
    ];
    for kind in [Kind::Softmax, Kind::LogSoftmax] {
        for &(outer, n, inner) in &shapes {
            let dims = Dims { outer, n, inner };
            let (dy, y) = case(kind, dims, (outer * 31 + n * 7 + inner) as u64);
            let first = run(Level::Scalar, kind, dims, &dy, &y, &Sequential);
            within_bound(kind, dims, &dy, &y, &first);
            for level in available_levels() {
                for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
                    let got = run(level, kind, dims, &dy, &y, par);
                    let bits = |v: &[f32]| v.iter().map(|e| e.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&first), "{kind:?} {level:?} {dims:?}");
                }
            }
        }
    }
}

#[test]
fn dims_split_an_axis() {
    assert_eq!(Dims::split(&[2, 3, 4, 5], 1), Some(Dims { outer: 2, n: 3, inner: 20 }));
    assert_eq!(Dims::split(&[7], 0), Some(Dims { outer: 1, n: 7, inner: 1 }));
    // An empty tensor's other dimensions may be huge: counts that do not fit are refused,
    // the others give an empty run.
    assert_eq!(Dims::split(&[0, 1 << 40, 1 << 40], 0), None);
    let empty = Dims::split(&[1 << 40, 1 << 40, 0], 1).unwrap();
    assert_eq!(empty, Dims { outer: 1 << 40, n: 1 << 40, inner: 0 });
    softmax_grad(Level::Scalar, Kind::Softmax, empty, &[], &[], &mut [], &Sequential).unwrap();
    let huge = Dims { outer: 0, n: 1 << 40, inner: 1 << 40 };
    softmax_grad(Level::Scalar, Kind::Softmax, huge, &[], &[], &mut [], &Sequential).unwrap();
}

#[test]
fn mismatched_lengths_are_refused() {
    let dims = Dims { outer: 2, n: 3, inner: 1 };
    let mut dx = vec![0f32; 6];
    let err = softmax_grad(Level::Scalar, Kind::Softmax, dims, &[0.0; 6], &[0.0; 5], &mut dx, &Sequential);
    assert_eq!(err, Err(KernelError::LengthMismatch { what: "Y", got: 5, expected: 6 }));
}

/// The documented bound of [`cross_entropy_grad`] at the reference's element `w` (the row
/// scaled by `s`; `hot`: the label's element) in a row of `classes`, plus the reference's
/// own rounding to float32.
fn ce_bound(w: f64, s: f64, hot: bool, classes: usize) -> f64 {
    let u = EPS / 2.0;
    let p = if s == 0.0 { 1.0 } else { (w / s + if hot { 1.0 } else { 0.0 }).clamp(0.0, 1.0) };
    u * s.abs() * ((10.0 + (classes as f64).ln()) * p + 2.4)
        + 2f64.powi(-125) * s.abs()
        + u * w.abs()
        + f64::from(f32::MIN_POSITIVE)
}

#[test]
fn cross_entropy_within_the_bound_of_the_reference_on_every_level_and_thread_count() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    // rows x classes x the scores' spread: wide spreads make x - max round and e^t fall
    // below the floor; a long row covers the lanes' tails
    for &(rows, classes, spread) in &[
        (0, 3, 8.0),
        (1, 1, 8.0),
        (3, 10, 8.0),
        (64, 10, 8.0),
        (7, 33, 8.0),
        (5000, 17, 8.0),
        (9, 49_157, 30.0),
        (40, 37, 300.0),
        (33, 129, -60.0),
    ] {
        let mut u = uniform((rows * 13 + classes) as u64);
        let x: Vec<f32> = (0..rows * classes).map(|_| (spread * (u() - 0.5)) as f32).collect();
        let labels: Vec<i64> = (0..rows).map(|i| ((i * 7) % (classes + 1)) as i64).collect();
        let ignore = Some(classes as i64); // every (classes+1)-th row is ignored
        let each: Vec<f32> = (0..rows).map(|_| (1.0 + u()) as f32).collect();
        for scale in [LossScale::Mean(1.5), LossScale::Sum(0.7), LossScale::EachRow(&each)] {
            let want = cross_entropy_reference(&x, classes, &labels, ignore, scale);
            let mut first = vec![f32::NAN; x.len()];
            cross_entropy_grad(Level::Scalar, &x, classes, &labels, ignore, scale, &mut first, &Sequential).unwrap();
            for (i, (&g, &w)) in first.iter().zip(&want).enumerate() {
                let s = match scale {
                    LossScale::EachRow(e) => f64::from(e[i / classes]),
                    LossScale::Sum(v) => f64::from(v),
                    LossScale::Mean(v) => {
                        f64::from(v) / labels.iter().filter(|&&l| Some(l) != ignore).count().max(1) as f64
                    }
                };
                let bound = ce_bound(f64::from(w), s, labels[i / classes] == (i % classes) as i64, classes);
                assert!((f64::from(g) - f64::from(w)).abs() <= bound, "{scale:?} {rows}x{classes} at {i}: {g} vs {w}");
            }
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for level in available_levels() {
                let mut other = vec![f32::NAN; x.len()];
                cross_entropy_grad(level, &x, classes, &labels, ignore, scale, &mut other, &RayonPool(Some(&pool)))
                    .unwrap();
                assert_eq!(bits(&other), bits(&first), "{level:?} {rows}x{classes}");
            }
        }
    }
}

#[test]
fn cross_entropy_of_infinite_and_nan_scores() {
    // a -inf score has probability 0; an all -inf row and a NaN give NaN, as the reference
    let x = [f32::NEG_INFINITY, 0.0, 1.0, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NAN, 0.0, 0.0];
    let labels = [1, 0, 2];
    for level in available_levels() {
        let mut dx = [0f32; 9];
        cross_entropy_grad(level, &x, 3, &labels, None, LossScale::Sum(1.0), &mut dx, &Sequential).unwrap();
        let e = 1.0 / (1.0 + 1f64.exp());
        assert_eq!(dx[0], 0.0);
        assert!((f64::from(dx[1]) - (e - 1.0)).abs() < 1e-6 && (f64::from(dx[2]) - (1.0 - e)).abs() < 1e-6, "{dx:?}");
        assert!(dx[3..].iter().all(|v| v.is_nan()), "{level:?}: {dx:?}");
    }
}

#[test]
fn cross_entropy_of_ignored_rows_is_zero_and_all_ignored_mean_is_zero() {
    let x = [1.0f32, 2.0, 3.0, 0.5, 0.5, 0.5];
    let mut dx = [f32::NAN; 6];
    cross_entropy_grad(Level::Scalar, &x, 3, &[1, -1], Some(-1), LossScale::Sum(1.0), &mut dx, &Sequential).unwrap();
    assert_eq!(&dx[3..], &[0.0; 3]);
    assert!(dx[1] < 0.0 && dx[0] > 0.0 && dx[2] > 0.0);
    // every row ignored: PyTorch's zero gradient, not 0/0's NaN
    cross_entropy_grad(Level::Scalar, &x, 3, &[-1, -1], Some(-1), LossScale::Mean(1.0), &mut dx, &Sequential).unwrap();
    assert_eq!(dx, [0.0; 6]);
    assert_eq!(cross_entropy_reference(&x, 3, &[-1, -1], Some(-1), LossScale::Mean(1.0)), [0.0; 6]);
    let err = cross_entropy_grad(Level::Scalar, &x, 3, &[0], None, LossScale::Sum(1.0), &mut dx, &Sequential);
    assert_eq!(err, Err(KernelError::LengthMismatch { what: "scores", got: 6, expected: 3 }));
}

#[test]
fn cross_entropy_loss_within_the_bound_of_the_reference_on_every_level_and_thread_count() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let u = EPS / 2.0;
    for &(rows, classes, spread) in
        &[(0, 3, 8.0), (1, 1, 8.0), (3, 10, 8.0), (7, 33, 8.0), (5000, 17, 8.0), (9, 49_157, 30.0), (40, 37, 300.0)]
    {
        let mut r = uniform((rows * 31 + classes) as u64);
        let x: Vec<f32> = (0..rows * classes).map(|_| (spread * (r() - 0.5)) as f32).collect();
        let labels: Vec<i64> = (0..rows).map(|i| ((i * 7) % (classes + 1)) as i64).collect();
        let ignore = Some(classes as i64);
        let want = cross_entropy_loss_reference(&x, classes, &labels, ignore);
        let mut first = vec![f32::NAN; rows];
        let (sum, count) =
            cross_entropy_loss(Level::Scalar, &x, classes, &labels, ignore, &mut first, &Sequential).unwrap();
        assert_eq!(count, labels.iter().filter(|&&l| Some(l) != ignore).count());
        let mut worst = 0f64;
        for (i, (&g, &w)) in first.iter().zip(&want).enumerate() {
            let row = &x[i * classes..(i + 1) * classes];
            let big = row.iter().fold(0f64, |a, &v| a.max(f64::from(v).abs()));
            let bound = u * (3.1 + (classes as f64).ln()) + u * w.abs() + 2f64.powi(-45) * (2.0 * big + w.abs());
            let err = (f64::from(g) - w).abs();
            assert!(err <= bound, "{rows}x{classes} row {i}: {g} vs {w}");
            worst = worst.max(err / bound);
        }
        let exact: f64 = want.iter().sum();
        let bound_sum: f64 =
            want.iter().map(|w| u * (3.1 + (classes as f64).ln()) + 2f64.powi(-45) * (w.abs() + 1e3)).sum();
        assert!((sum - exact).abs() <= bound_sum, "{rows}x{classes}: sum {sum} vs {exact}");
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for level in available_levels() {
            let mut other = vec![f32::NAN; rows];
            let (s2, _) =
                cross_entropy_loss(level, &x, classes, &labels, ignore, &mut other, &RayonPool(Some(&pool))).unwrap();
            assert_eq!(bits(&other), bits(&first), "{level:?} {rows}x{classes}");
            assert_eq!(s2.to_bits(), sum.to_bits());
        }
        eprintln!("{rows}x{classes}: worst {worst:.3} of the bound");
    }
}

#[test]
fn cross_entropy_loss_of_infinite_and_nan_scores_and_bad_lengths() {
    let x = [f32::NEG_INFINITY, 0.0, 1.0, 0.0, f32::NEG_INFINITY, 2.0, f32::NAN, 0.0, 0.0];
    for level in available_levels() {
        let mut out = [0f32; 3];
        cross_entropy_loss(level, &x, 3, &[1, 1, 2], None, &mut out, &Sequential).unwrap();
        let lse = (1.0f64 + 1f64.exp()).ln();
        assert!((f64::from(out[0]) - lse).abs() < 1e-6, "{out:?}");
        assert_eq!(out[1], f32::INFINITY); // the label's score is -inf
        assert!(out[2].is_nan());
    }
    let err = cross_entropy_loss(Level::Scalar, &x, 3, &[0, 0], None, &mut [0.0; 2], &Sequential);
    assert_eq!(err, Err(KernelError::LengthMismatch { what: "scores", got: 9, expected: 6 }));
}
