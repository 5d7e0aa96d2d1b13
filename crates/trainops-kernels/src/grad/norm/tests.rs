use super::*;
use crate::simd::available_levels;
use crate::test_util::uniform;
use crate::{RayonPool, Sequential};

/// Inputs of `rows x cols` with each row's true mean and inverse standard deviation.
struct Case {
    dy: Vec<f32>,
    x: Vec<f32>,
    scale: Vec<f32>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
}

fn case(rows: usize, cols: usize, seed: u64) -> Case {
    let mut u = uniform(seed);
    let x: Vec<f32> = (0..rows * cols).map(|_| (3.0 * u() + 0.7) as f32).collect();
    let dy = (0..rows * cols).map(|_| (2.0 * u()) as f32).collect();
    let scale = (0..cols).map(|_| (1.0 + u()) as f32).collect();
    let (mut mean, mut rstd) = (vec![0f32; rows], vec![0f32; rows]);
    for i in 0..rows {
        let row = &x[i * cols..(i + 1) * cols];
        let m = row.iter().map(|&v| f64::from(v)).sum::<f64>() / cols.max(1) as f64;
        let var = row.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / cols.max(1) as f64;
        mean[i] = m as f32;
        rstd[i] = (1.0 / (var + 1e-5).sqrt()) as f32;
    }
    Case { dy, x, scale, mean, rstd }
}

impl Case {
    fn input(&self) -> LayerNormGradIn<'_> {
        LayerNormGradIn { dy: &self.dy, x: &self.x, scale: &self.scale, mean: &self.mean, inv_std_dev: &self.rstd }
    }
    fn run(&self, level: Level, cols: usize, par: &dyn Parallelism) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut dx = vec![f32::NAN; self.x.len()];
        let (mut ds, mut db) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
        let out = LayerNormGradOut { dx: &mut dx, dscale: Some(&mut ds), dbias: Some(&mut db) };
        layer_norm_grad(level, self.input(), cols, out, par).unwrap();
        (dx, ds, db)
    }
}

const EPS: f64 = f32::EPSILON as f64;

/// The fast path against the f64 reference, within the module's stated bound.
fn within_bound(c: &Case, rows: usize, cols: usize, got: &(Vec<f32>, Vec<f32>, Vec<f32>)) {
    let (dx, ds, db) = reference(c.input(), cols);
    for i in 0..rows {
        let (mu, r) = (f64::from(c.mean[i]), f64::from(c.rstd[i]));
        let (mut m1, mut m2) = (0f64, 0f64);
        for j in 0..cols {
            let g = f64::from(c.dy[i * cols + j]) * f64::from(c.scale[j]);
            m1 += g / cols as f64;
            m2 += g * (f64::from(c.x[i * cols + j]) - mu) * r / cols as f64;
        }
        for j in 0..cols {
            let k = i * cols + j;
            let g = f64::from(c.dy[k]) * f64::from(c.scale[j]);
            let xh = (f64::from(c.x[k]) - mu) * r;
            let bound = 8.0 * EPS * r * (g.abs() + m1.abs() + (xh * m2).abs()) + f64::from(f32::MIN_POSITIVE);
            let err = (f64::from(got.0[k]) - f64::from(dx[k])).abs();
            assert!(err <= bound + EPS * f64::from(dx[k]).abs(), "dX[{k}] {} vs {} ({rows}x{cols})", got.0[k], dx[k]);
        }
    }
    for j in 0..cols {
        let (mut sa, mut sb) = (0f64, 0f64);
        for i in 0..rows {
            let dy = f64::from(c.dy[i * cols + j]);
            sa += (dy * (f64::from(c.x[i * cols + j]) - f64::from(c.mean[i])) * f64::from(c.rstd[i])).abs();
            sb += dy.abs();
        }
        let e = (f64::from(got.1[j]) - f64::from(ds[j])).abs();
        assert!(e <= 4.0 * EPS * sa + EPS * f64::from(ds[j]).abs(), "dScale[{j}] {} vs {}", got.1[j], ds[j]);
        let e = (f64::from(got.2[j]) - f64::from(db[j])).abs();
        assert!(e <= EPS * sb + EPS * f64::from(db[j]).abs(), "dBias[{j}] {} vs {}", got.2[j], db[j]);
    }
}

#[test]
fn every_level_and_thread_count_gives_the_same_bits_within_the_bound_of_the_reference() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for &(rows, cols) in &[
        (0, 4),
        (1, 1),
        (3, 7),
        (2, 8),
        (5, 9),
        (4, 15),
        (4, 16),
        (4, 17),
        (33, 64),
        (7, 100),
        (1100, 64),
        (300, 513),
        (2, 40000),
    ] {
        let c = case(rows, cols, (rows * 1000 + cols) as u64);
        let first = c.run(Level::Scalar, cols, &Sequential);
        within_bound(&c, rows, cols, &first);
        for level in available_levels() {
            for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
                let got = c.run(level, cols, par);
                let bits = |v: &Vec<f32>| v.iter().map(|e| e.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.0), bits(&first.0), "dX {level:?} {rows}x{cols}");
                assert_eq!(bits(&got.1), bits(&first.1), "dScale {level:?} {rows}x{cols}");
                assert_eq!(bits(&got.2), bits(&first.2), "dBias {level:?} {rows}x{cols}");
            }
        }
    }
}

#[test]
fn optional_sums_and_zero_columns() {
    let c = case(3, 5, 7);
    let mut dx = vec![0f32; 15];
    let out = LayerNormGradOut { dx: &mut dx, dscale: None, dbias: None };
    layer_norm_grad(Level::Scalar, c.input(), 5, out, &Sequential).unwrap();
    assert_eq!(dx, c.run(Level::Scalar, 5, &Sequential).0);
    // No columns: nothing to compute, and no division by zero.
    let e = case(3, 0, 1);
    let mut none: [f32; 0] = [];
    let out = LayerNormGradOut { dx: &mut [], dscale: Some(&mut none), dbias: None };
    layer_norm_grad(Level::Scalar, e.input(), 0, out, &Sequential).unwrap();
}

#[test]
fn mismatched_lengths_are_refused() {
    let c = case(3, 5, 7);
    let mut dx = vec![0f32; 15];
    let mut short = vec![0f32; 4];
    let inp = LayerNormGradIn { scale: &c.scale[..4], ..c.input() };
    let err = layer_norm_grad(
        Level::Scalar,
        inp,
        5,
        LayerNormGradOut { dx: &mut dx, dscale: None, dbias: None },
        &Sequential,
    );
    assert_eq!(err, Err(KernelError::LengthMismatch { what: "Scale", got: 4, expected: 5 }));
    let out = LayerNormGradOut { dx: &mut dx, dscale: Some(&mut short), dbias: None };
    let err = layer_norm_grad(Level::Scalar, c.input(), 5, out, &Sequential);
    assert_eq!(err, Err(KernelError::LengthMismatch { what: "dScale", got: 4, expected: 5 }));
}
