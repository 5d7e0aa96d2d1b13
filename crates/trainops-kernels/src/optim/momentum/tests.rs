use proptest::prelude::*;

use super::*;
use crate::optim::harness::{optimizer_harness, Harness};

const STANDARD: MomentumMode = MomentumMode::Standard;
const NESTEROV: MomentumMode = MomentumMode::Nesterov;

impl Harness<2> for Momentum {
    fn fixed_attrs() -> Vec<MomentumAttrs> {
        [STANDARD, NESTEROV].map(|mode| MomentumAttrs { alpha: 0.9, beta: 0.5, mode, norm_coefficient: 0.01 }).to_vec()
    }
    fn extreme_attrs() -> Vec<MomentumAttrs> {
        [STANDARD, NESTEROV].map(|mode| MomentumAttrs { alpha: 0.9, beta: 0.1, mode, norm_coefficient: 0.0 }).to_vec()
    }
    const T_FIXED: &'static [i64] = &[0, 7];
    const T_RANGE: core::ops::Range<i64> = -3..5;
    fn attrs() -> BoxedStrategy<MomentumAttrs> {
        let mode = prop_oneof![Just(STANDARD), Just(NESTEROV)];
        (0.0f32..1.0, 0.0f32..2.0, mode, 0.0f32..0.5)
            .prop_map(|(alpha, beta, mode, norm_coefficient)| MomentumAttrs { alpha, beta, mode, norm_coefficient })
            .boxed()
    }
    fn value(k: usize, u: f64) -> f64 {
        [8.0 * u, u][k]
    }
}

optimizer_harness!(Momentum, 2);

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
