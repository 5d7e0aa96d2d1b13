//! The bfloat16-state optimizers against their scalar reference: the rounding on every
//! random value (exactly unbiased, special values), and whole steps at every level this CPU
//! has, in place and out of place, on one thread and many (tasks cut at any element, not
//! only at Philox blocks), on edge lengths, with float32 and 16-bit gradients, two tensors
//! per node, over several steps.

use half::{bf16, f16};

use super::reference;
use super::{round_stochastic, step_chunked, ParamBf16, Rule, Stochastic, PIECE};
use crate::optim::adam::{Adam, AdamAttrs};
use crate::optim::adamw::{AdamWAttrs, AdamWCoeffs};
use crate::optim::harness::pool;
use crate::optim::Optimizer;
use crate::simd::available_levels;
use crate::test_util::{stream, uniform};
use crate::{Element, InOut, KernelError, Parallelism, RayonPool, Sequential};

/// Lengths around Philox's block (4), the lanes (8, 16), the piece (448) and a few pieces.
const LENGTHS: [usize; 15] = [0, 1, 3, 4, 5, 7, 8, 15, 16, 17, 447, 448, 449, 1000, 3 * 448 + 5];

/// Values near 1, tiny, subnormal, huge, both signs, and exact bfloat16 values.
fn probe_values() -> Vec<f32> {
    let mut out = vec![0.0, -0.0, 1.0, -1.0, 1.0 + 2f32.powi(-9), f32::from_bits(1), -f32::from_bits(0x8001)];
    out.extend([f32::MIN_POSITIVE, 3e38, -3.3e38, f32::from_bits(0x7f7f_0001), f32::from_bits(0x0000_ffff)]);
    let mut u = uniform(3);
    for _ in 0..200 {
        out.push((10f64.powf(-30.0 * (u() + 0.5)) * u().signum()) as f32);
        out.push(u() as f32);
    }
    out
}

#[test]
fn rounding_is_the_reference_and_exactly_unbiased_over_every_random_value() {
    for x in probe_values() {
        let (mut sum, mut away) = (0f64, 0u32);
        let toward_zero = x.to_bits() >> 16;
        for r in 0..=u16::MAX {
            let got = round_stochastic(x, u32::from(r) | 0xABCD_0000);
            assert_eq!(got, reference::round(x, r).to_bits(), "x = {x:e}, r = {r}");
            away += u32::from(u32::from(got) != toward_zero);
            sum += f64::from(bf16::from_bits(got).to_f32());
        }
        // Away from zero with probability (low 16 bits) / 2^16, so the mean is x exactly
        // (beyond bfloat16::MAX, never: see the next test).
        if x.abs() <= bf16::MAX.to_f32() {
            assert_eq!(away, x.to_bits() & 0xffff, "x = {x:e}");
            assert_eq!(sum / 65536.0, f64::from(x), "x = {x:e}");
        } else {
            assert_eq!(away, 0, "x = {x:e}");
        }
    }
}

#[test]
fn rounding_keeps_bfloat16_values_nan_and_infinity_and_never_overflows() {
    let max = bf16::MAX.to_f32();
    for r in [0u32, 1, 0x7fff, 0x8000, 0xffff] {
        for b in [0u16, 0x8000, 0x3f80, 0x0001, 0x7f7f, 0xff7f, 0x7f80, 0xff80] {
            assert_eq!(round_stochastic(bf16::from_bits(b).to_f32(), r), b, "{b:#x}");
        }
        // NaN stays NaN (quiet bit set, sign and high payload kept), even with a low payload.
        assert_eq!(round_stochastic(f32::from_bits(0x7f80_0001), r), 0x7fc0);
        assert_eq!(round_stochastic(f32::from_bits(0xff81_0000), r), 0xffc1);
        // Beyond bfloat16::MAX but finite: MAX, never infinity.
        assert_eq!(round_stochastic(f32::MAX, r), bf16::MAX.to_bits());
        assert_eq!(round_stochastic(-f32::MAX, r), bf16::MIN.to_bits());
    }
    assert!(f32::MAX > max);
    // Below MAX the carry still goes up: into MAX itself.
    assert_eq!(round_stochastic(f32::from_bits(0x7f7e_ffff), 1), 0x7f7f);
}

#[test]
fn random_words_follow_the_documented_counter() {
    // Random123's known answer for counter 0 and key 0: seed 0, T = 0, tensor 0, e = 0..4.
    assert_eq!(reference::words(0, 0, 0, 4), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
    let s = Stochastic::new(-2, (5 << 32) + 7);
    assert_eq!(s.state(3), [0, 0, 7, 3, 0xffff_fffe, 0xffff_ffff]);
    assert_ne!(reference::words(1, 1, 0, 8), reference::words(1, 1, 1, 8));
    assert_ne!(reference::words(1, 1, 0, 8), reference::words(1, 2, 0, 8));
}

type Case<G> = (Vec<f32>, Vec<G>, Vec<bf16>, Vec<bf16>);

/// One tensor: weights, gradient (zero now and then), moments in their domains.
fn case<G: Element<C = f32>>(n: usize, seed: u64) -> Case<G> {
    let mut u = uniform(seed);
    let x = (0..n).map(|_| u() as f32).collect();
    let g = (0..n).map(|i| G::store(if i % 11 == 5 { 0.0 } else { (0.1 * u()) as f32 })).collect();
    let m = (0..n).map(|_| bf16::from_f32((0.02 * u()) as f32)).collect();
    let v = (0..n).map(|_| bf16::from_f32((1e-4 * (u() + 0.5) * (u() + 0.5)) as f32)).collect();
    (x, g, m, v)
}

/// The fast path on copies of `cases` (tensor `i` of the node is `cases[i]`), outputs
/// poisoned first when out of place.
fn fast<R: Rule, G: Element<C = f32>>(
    level: crate::Level,
    rule: &R,
    bits: &Stochastic,
    cases: &[Case<G>],
    par: &dyn Parallelism,
    in_place: bool,
    chunk: usize,
) -> Vec<(Vec<f32>, Vec<bf16>, Vec<bf16>)> {
    let mut outs: Vec<(Vec<f32>, Vec<bf16>, Vec<bf16>)> = cases
        .iter()
        .map(|(x, _, m, v)| {
            if in_place {
                (x.clone(), m.clone(), v.clone())
            } else {
                (vec![f32::NAN; x.len()], vec![bf16::NAN; m.len()], vec![bf16::NAN; v.len()])
            }
        })
        .collect();
    let params: Vec<ParamBf16<'_, G>> = cases
        .iter()
        .zip(outs.iter_mut())
        .enumerate()
        .map(|(i, ((x, g, m, v), (xo, mo, vo)))| {
            ParamBf16::new(stream(x, xo, in_place), g, stream(m, mo, in_place), stream(v, vo, in_place), i as u32)
                .unwrap()
        })
        .collect();
    step_chunked(level, rule, bits, params, par, chunk, 0);
    outs
}

fn bits32(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn bits16(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Every level, placement, pool and task size, over two steps of two-tensor nodes of every
/// length, against `reference(t, tensor, x, g, m, v)`.
fn check_all<R: Rule, G: Element<C = f32>>(
    seed: i64,
    rule: impl Fn(i64) -> R,
    reference: impl Fn(i64, u32, &[f32], &[G], &[bf16], &[bf16]) -> (Vec<f32>, Vec<bf16>, Vec<bf16>),
) {
    let nodes: Vec<Vec<Case<G>>> = LENGTHS
        .iter()
        .enumerate()
        .map(|(k, &n)| vec![case(n, 7 + k as u64), case((n * 3) / 2 + 1, 50 + k as u64)])
        .collect();
    let pool = RayonPool(Some(pool()));
    let runs: [(&dyn Parallelism, usize); 3] = [(&Sequential, usize::MAX), (&pool, 5), (&pool, PIECE + 3)];
    for level in available_levels() {
        for in_place in [true, false] {
            for (par, chunk) in runs {
                for node in &nodes {
                    let mut now = node.clone();
                    for t in 1..3 {
                        let bits = Stochastic::new(seed, t);
                        let got = fast(level, &rule(t), &bits, &now, par, in_place, chunk);
                        for (i, (case, out)) in now.iter_mut().zip(got).enumerate() {
                            let want = reference(t, i as u32, &case.0, &case.1, &case.2, &case.3);
                            let what = format!(
                                "{level:?}, n = {}, t = {t}, tensor {i}, in place {in_place}, chunk {chunk}",
                                case.0.len()
                            );
                            assert_eq!(bits32(&out.0), bits32(&want.0), "{what}: X");
                            assert_eq!(bits16(&out.1), bits16(&want.1), "{what}: M");
                            assert_eq!(bits16(&out.2), bits16(&want.2), "{what}: V");
                            (case.0, case.2, case.3) = out;
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn adam_fast_path_is_the_reference() {
    let attrs = [
        AdamAttrs::default(),
        AdamAttrs { alpha: 0.8, beta: 0.99, epsilon: 1e-8, norm_coefficient: 0.01, norm_coefficient_post: 0.001 },
    ];
    for a in attrs {
        let rule = |t| Adam::coeffs::<f32>(&a, 0.01, t);
        check_all::<_, f32>(42, rule, |t, i, x, g, m, v| reference::adam_bf16(&a, 0.01, t, 42, i, x, g, m, v));
        check_all::<_, f16>(-3, rule, |t, i, x, g, m, v| reference::adam_bf16(&a, 0.01, t, -3, i, x, g, m, v));
        check_all::<_, bf16>(7, rule, |t, i, x, g, m, v| reference::adam_bf16(&a, 0.01, t, 7, i, x, g, m, v));
    }
}

#[test]
fn adamw_fast_path_is_the_reference() {
    let attrs = [
        AdamWAttrs::default(),
        // beta1 > 0.5 takes the lerp's other side; maximize flips the gradient.
        AdamWAttrs { beta1: 0.3, beta2: 0.95, epsilon: 1e-6, weight_decay: 0.1, maximize: true },
    ];
    for a in attrs {
        let rule = |t| AdamWCoeffs::<f32>::new(&a, 0.003, t);
        check_all::<_, f32>(1 << 40, rule, |t, i, x, g, m, v| {
            reference::adamw_bf16(&a, 0.003, t, 1 << 40, i, x, g, m, v)
        });
        check_all::<_, bf16>(9, rule, |t, i, x, g, m, v| reference::adamw_bf16(&a, 0.003, t, 9, i, x, g, m, v));
    }
}

#[test]
fn non_finite_values_stay_in_their_element() {
    let n = 40;
    let (x, mut g, m, v) = case::<f32>(n, 3);
    g[5] = f32::NAN;
    g[9] = f32::INFINITY;
    let a = AdamAttrs::default();
    let want = reference::adam_bf16(&a, 0.01, 1, 5, 0, &x, &g, &m, &v);
    for level in available_levels() {
        let c = Adam::coeffs::<f32>(&a, 0.01, 1);
        let got = fast(
            level,
            &c,
            &Stochastic::new(5, 1),
            &[(x.clone(), g.clone(), m.clone(), v.clone())],
            &Sequential,
            true,
            8,
        );
        assert_eq!(bits16(&got[0].1), bits16(&want.1), "{level:?}");
        assert_eq!(bits16(&got[0].2), bits16(&want.2), "{level:?}");
        assert_eq!(bits32(&got[0].0), bits32(&want.0), "{level:?}");
    }
    assert!(want.1[5].is_nan() && want.2[9].is_infinite());
    assert_eq!(want.1.iter().filter(|m| m.is_nan()).count(), 1);
    assert!(want.2.iter().enumerate().all(|(i, v)| i == 5 || i == 9 || v.is_finite()));
}

#[test]
fn lengths_are_checked() {
    let (mut x, g) = (vec![0f32; 10], vec![0f32; 10]);
    let (mut m, mut v) = (vec![bf16::ZERO; 10], vec![bf16::ZERO; 9]);
    let err =
        ParamBf16::new(InOut::in_place(&mut x), &g, InOut::in_place(&mut m), InOut::in_place(&mut v), 0).err().unwrap();
    assert_eq!(err, KernelError::LengthMismatch { what: "V", got: 9, expected: 10 });
}
