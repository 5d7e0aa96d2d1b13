use proptest::prelude::*;

use super::*;
use crate::optim::harness::{self, optimizer_harness, Harness};

impl Harness<2> for Adagrad {
    fn fixed_attrs() -> Vec<AdagradAttrs> {
        vec![
            AdagradAttrs { decay_factor: 0.1, epsilon: 1e-5, norm_coefficient: 0.01 },
            AdagradAttrs { decay_factor: 0.25, epsilon: 1e-3, norm_coefficient: 0.02 },
        ]
    }
    fn extreme_attrs() -> Vec<AdagradAttrs> {
        vec![AdagradAttrs::default(), AdagradAttrs { decay_factor: 0.5, epsilon: 0.0, norm_coefficient: 0.5 }]
    }
    const T_FIXED: &'static [i64] = &[0, 7];
    const T_RANGE: core::ops::Range<i64> = -3..1000;
    fn attrs() -> BoxedStrategy<AdagradAttrs> {
        (-0.5f32..2.0, 1e-8f32..1e-1, 0.0f32..0.5)
            .prop_map(|(decay_factor, epsilon, norm_coefficient)| AdagradAttrs {
                decay_factor,
                epsilon,
                norm_coefficient,
            })
            .boxed()
    }
    fn value(k: usize, u: f64) -> f64 {
        // x, and h >= 0 (an accumulated square).
        [8.0 * u, (4.0 * u).abs()][k]
    }
}

optimizer_harness!(Adagrad, 2);

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
    let c = Adagrad::coeffs::<f64>(&a, 0.1, 0);
    let cases = [([vec![1.0f64], vec![2.0f64]], vec![-1.0f64])];
    let fast = harness::fast::<Adagrad, f64, f64, 2>(crate::simd::detected(), &c, &cases, &crate::Sequential, false);
    assert_eq!(fast[0], [x, h]);
}
