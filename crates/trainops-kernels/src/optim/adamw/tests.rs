use proptest::prelude::*;

use super::*;
use crate::optim::harness::Harness;

/// Attribute sets: torch's defaults, and maximize with a large `1 - beta1` (lerp from the
/// end) and no weight decay.
fn fixed() -> Vec<AdamWAttrs> {
    vec![
        AdamWAttrs::default(),
        AdamWAttrs { beta1: 0.3, beta2: 0.99, epsilon: 1e-6, weight_decay: 0.0, maximize: true },
    ]
}

fn random_attrs() -> BoxedStrategy<AdamWAttrs> {
    (0.0f64..1.0, 0.0f64..1.0, 1e-10f64..1e-1, 0.0f64..0.5, any::<bool>())
        .prop_map(|(beta1, beta2, epsilon, weight_decay, maximize)| AdamWAttrs {
            beta1,
            beta2,
            epsilon,
            weight_decay,
            maximize,
        })
        .boxed()
}

/// Without amsgrad: streams `X, M, V`.
mod plain {
    use super::*;

    impl Harness<3> for AdamW {
        fn fixed_attrs() -> Vec<AdamWAttrs> {
            fixed()
        }
        fn extreme_attrs() -> Vec<AdamWAttrs> {
            vec![AdamWAttrs { epsilon: 0.0, ..AdamWAttrs::default() }]
        }
        const T_FIXED: &'static [i64] = &[1, 11];
        const T_RANGE: core::ops::Range<i64> = 1..50;
        fn attrs() -> BoxedStrategy<AdamWAttrs> {
            random_attrs()
        }
        fn value(k: usize, u: f64) -> f64 {
            // x, m, and v >= 0 (a running average of squares).
            [8.0 * u, 0.5 * u, (0.1 * u).abs()][k]
        }
    }

    crate::optim::harness::optimizer_harness!(AdamW, 3);
}

/// With amsgrad: streams `X, M, V, Vmax`.
mod amsgrad {
    use super::*;

    impl Harness<4> for AdamW {
        fn fixed_attrs() -> Vec<AdamWAttrs> {
            fixed()
        }
        fn extreme_attrs() -> Vec<AdamWAttrs> {
            vec![AdamWAttrs { epsilon: 0.0, ..AdamWAttrs::default() }]
        }
        const T_FIXED: &'static [i64] = &[1, 11];
        const T_RANGE: core::ops::Range<i64> = 1..50;
        fn attrs() -> BoxedStrategy<AdamWAttrs> {
            random_attrs()
        }
        fn value(k: usize, u: f64) -> f64 {
            // x, m, and v, vmax >= 0; vmax above or below v.
            [8.0 * u, 0.5 * u, (0.1 * u).abs(), (0.12 * u).abs()][k]
        }
    }

    crate::optim::harness::optimizer_harness!(AdamW, 4);
}

#[test]
fn attributes_read_as_written() {
    assert_eq!(as_written(0.9), 0.9);
    assert_eq!(as_written(0.999), 0.999);
    assert_eq!(as_written(1e-8), 1e-8);
    assert_eq!(as_written(1e-2), 1e-2);
    assert_eq!(as_written(0.0), 0.0);
    assert!(as_written(f32::NAN).is_nan());
    assert_eq!(as_written(f32::INFINITY), f64::INFINITY);
    // Not the float32's exact value.
    assert_ne!(as_written(0.9), f64::from(0.9f32));
}

/// Known answers: one step of torch 2.15's `torch.optim.AdamW` (defaults but lr=0.1,
/// float64, `fused=False, foreach=False`) on param [1, -2, 0.5], grad [0.3, -0.1, 2.0] and
/// zero state; torch's bits, printed from `struct.pack('<d', ...)`.
#[test]
fn first_step_is_torchs_in_f64() {
    let a = AdamWAttrs::default();
    let (x, g) = ([1.0f64, -2.0, 0.5], [0.3f64, -0.1, 2.0]);
    let (x, m, v, _) = reference::adamw(&a, 0.1, 1, &x, &g, &[0.0; 3], &[0.0; 3], None);
    let bits = |v: Vec<f64>| v.iter().map(|e| e.to_bits()).collect::<Vec<u64>>();
    assert_eq!(bits(x), [0x3fecc49ba7ad7534, 0xbffe5e35422c1f69, 0x3fd9916873399124]);
    assert_eq!(bits(m), [0x3f9eb851eb851eb6, 0xbf847ae147ae147a, 0x3fc9999999999998]);
    assert_eq!(bits(v), [0x3f1797cc39ffd614, 0x3ee4f8b588e368f7, 0x3f70624dd2f1aa00]);
}
