use half::{bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::optim::harness::{self, check_coeffs, optimizer_harness, Harness, EDGE_LENGTHS};
use crate::parallel::CHUNK;

impl Harness<3> for Adam {
    fn fixed_attrs() -> Vec<AdamAttrs> {
        vec![AdamAttrs { norm_coefficient: 0.02, norm_coefficient_post: 0.003, ..AdamAttrs::default() }]
    }
    fn extreme_attrs() -> Vec<AdamAttrs> {
        vec![AdamAttrs::default()]
    }
    const T_FIXED: &'static [i64] = &[0, 11];
    const T_RANGE: core::ops::Range<i64> = -3..50;
    fn attrs() -> BoxedStrategy<AdamAttrs> {
        (0.0f32..1.0, 0.0f32..1.0, 1e-8f32..1e-1, 0.0f32..0.5, 0.0f32..0.5)
            .prop_map(|(alpha, beta, epsilon, n, p)| AdamAttrs {
                alpha,
                beta,
                epsilon,
                norm_coefficient: n,
                norm_coefficient_post: p,
            })
            .boxed()
    }
    fn value(k: usize, u: f64) -> f64 {
        // x, v, and h >= 0 (a running average of squares).
        [8.0 * u, 0.5 * u, (0.1 * u).abs()][k]
    }
}

optimizer_harness!(Adam, 3);

#[test]
fn adjusted_rate_follows_the_t_rule() {
    assert_eq!(adjusted_rate(0.1, 0, 0.9, 0.999), 0.1);
    assert_eq!(adjusted_rate(0.1, -4, 0.9, 0.999), 0.1);
    let a = f64::from(0.9f32);
    let b = f64::from(0.999f32);
    let want = 0.1 * (1.0 - b * b).sqrt() / (1.0 - a * a);
    assert!((adjusted_rate(0.1, 2, 0.9, 0.999) - want).abs() < 1e-15);
}

/// MixedPrecisionAdam's update: gradients divided by a loss scale first, in the 16-bit and
/// mixed pairs, on every level, bitwise against `reference::adam_unscaled`.
#[test]
fn loss_scaled_sixteen_bit_and_mixed_pairs_are_bitwise_the_reference() {
    fn check<X: Element + crate::test_util::Bits, G: Element<C = X::C>>(
        cases: &[harness::Case<X, G, 3>],
        loss_scale: Option<X::C>,
    ) {
        let a = AdamAttrs { norm_coefficient: 0.01, ..AdamAttrs::default() };
        let (r, t) = (0.01, 5);
        let want: Vec<[Vec<X>; 3]> = cases
            .iter()
            .map(|([x, v, h], g)| {
                let (x, v, h) = reference::adam_unscaled(&a, r, t, loss_scale, x, g, v, h);
                [x, v, h]
            })
            .collect();
        let mut c = Adam::coeffs::<X::C>(&a, r, t);
        c.loss_scale = loss_scale;
        check_coeffs::<Adam, X, G, 3>(&c, &want, cases, &format!("loss scale {loss_scale:?}"));
    }
    let mut lens = EDGE_LENGTHS.to_vec();
    lens.push(2 * CHUNK + 13);
    let base = harness::cases64::<Adam, 3>(&lens, 99);
    let f32s = |e: f64| e as f32;
    let mixed16 = harness::convert_cases(&base, f32s, |e| f16::from_f64(e * 1e3));
    let mixedb = harness::convert_cases(&base, f32s, |e| bf16::from_f64(e * 1e3));
    let all16 = harness::convert_cases(&base, f16::from_f64, f16::from_f64);
    let allb = harness::convert_cases(&base, bf16::from_f64, bf16::from_f64);
    for ls in [None, Some(1024.0f32), Some(3.0)] {
        check(&mixed16, ls);
        check(&mixedb, ls);
        check(&all16, ls);
        check(&allb, ls);
    }
}
