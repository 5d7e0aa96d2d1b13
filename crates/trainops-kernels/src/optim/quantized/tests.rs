//! The 8-bit optimizers against their scalar reference: the map's known entries, the fast
//! quantiser against the plain nearest-entry search on every threshold's neighbourhood and
//! random values, and whole steps at every level this CPU has, in place and out of place,
//! on one thread and many (tasks of a few blocks), on lengths around the block, with
//! float32 and 16-bit gradients, over several steps.

use half::{bf16, f16};

use super::adamw::{AdamWAttrs, AdamWCoeffs, Rule};
use super::map::Map;
use super::reference::{self, State8bit};
use super::{blocks, step_chunked, Param8bit, Quantized, BLOCK};
use crate::optim::adam::{Adam, AdamAttrs};
use crate::optim::harness::pool;
use crate::optim::Optimizer;
use crate::simd::available_levels;
use crate::test_util::{stream, uniform};
use crate::{Element, InOut, KernelError, Parallelism, RayonPool, Sequential};

/// Lengths around the block (255/256/257), a lane or two, and several blocks.
const LENGTHS: [usize; 14] = [0, 1, 7, 16, 17, 255, 256, 257, 511, 512, 513, 1000, 3 * 256 + 5, 4096];

#[test]
fn maps_have_the_published_shape() {
    for signed in [true, false] {
        let map = reference::dynamic_map(signed);
        assert!(map.windows(2).all(|w| w[0] < w[1]), "sorted and distinct");
        assert_eq!(map[255], 1.0);
        assert_eq!(map.iter().filter(|&&e| e == 0.0).count(), 1);
    }
    let s = reference::dynamic_map(true);
    // 127 negatives, 0, 127 fractions and 1.0; the extremes of exponent 6 (64 means).
    assert_eq!(s[127], 0.0);
    assert_eq!(s[0], -(1.0 - 0.9 / 128.0) as f32);
    assert_eq!(s[254], (1.0 - 0.9 / 128.0) as f32);
    // Exponent 0: one mean, 0.55e-6.
    assert_eq!(s[128], 0.55e-6f64 as f32);
    let u = reference::dynamic_map(false);
    assert_eq!(u[0], 0.0);
    // Exponent 0: two means, 0.325e-6 and 0.775e-6; exponent 6: 128 means.
    assert_eq!((u[1], u[2]), (0.325e-6f64 as f32, 0.775e-6f64 as f32));
    assert_eq!(u[254], (1.0 - 0.9 / 256.0) as f32);
}

/// Values around every threshold, entry and bucket edge, specials and random ones.
fn probe_values(map: &[f32; 256]) -> Vec<f32> {
    let mut out = vec![0.0, -0.0, 1.0, -1.0, 2.0, -2.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-30, -1e-30];
    out.extend([f32::from_bits(1), -f32::from_bits(1), f32::MIN_POSITIVE, 2f32.powi(-29), -(2f32.powi(-29))]);
    let around = |v: f32, out: &mut Vec<f32>| {
        for d in 0..3u32 {
            out.push(f32::from_bits(v.to_bits().wrapping_add(d)));
            out.push(f32::from_bits(v.to_bits().wrapping_sub(d)));
        }
    };
    for k in 0..255 {
        let mid = (f64::from(map[k]) + f64::from(map[k + 1])) / 2.0;
        around(mid as f32, &mut out);
        around(map[k], &mut out);
    }
    let mut u = uniform(11);
    for _ in 0..20_000 {
        out.push((2.0 * u()) as f32);
        // Log-uniform magnitudes from 1e-9 to 1, both signs.
        out.push((10f64.powf(-9.0 * (u() + 0.5)) * u().signum()) as f32);
    }
    out
}

#[test]
fn fast_codes_are_the_nearest_entry() {
    for (signed, fast) in [(true, Map::signed()), (false, Map::unsigned())] {
        let map = reference::dynamic_map(signed);
        assert_eq!(fast.entries, map);
        for y in probe_values(&map) {
            assert_eq!(fast.code(y), reference::nearest(&map, y), "signed {signed}, y = {y:e} ({:#x})", y.to_bits());
        }
    }
}

/// Every level's codec on the probe values (scale 1, so they reach the map as they are;
/// beyond [-1, 1] too) and on their codes, against the reference.
#[test]
fn every_codec_is_the_reference() {
    use super::{Codec, Portable};
    use crate::simd::Isa;
    fn run<C: Codec>(codec: C, signed: bool, map: &Map) {
        let want_map = reference::dynamic_map(signed);
        let values = probe_values(&want_map);
        let mut codes = vec![0u8; values.len()];
        codec.quantize(map, &values, 1.0, &mut codes);
        for (y, c) in values.iter().zip(&codes) {
            assert_eq!(*c, reference::nearest(&want_map, *y), "signed {signed}, y = {y:e}");
        }
        let all: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).chain([7, 9, 200]).collect();
        let mut out = vec![0f32; all.len()];
        codec.dequantize(map, &all, 0.37, &mut out);
        let want = reference::dequantize(&want_map, &all, &[0.37; 3]);
        assert_eq!(bits(&out), bits(&want));
        // An all-zero block quantises as value / 1.
        let zeros = [0.0f32, -0.0, 0.0];
        let mut z = [1u8; 3];
        codec.quantize(map, &zeros, 0.0, &mut z);
        assert_eq!(
            z,
            [
                reference::nearest(&want_map, 0.0),
                reference::nearest(&want_map, -0.0),
                reference::nearest(&want_map, 0.0)
            ]
        );
    }
    for (signed, map) in [(true, Map::signed()), (false, Map::unsigned())] {
        for level in available_levels() {
            match level.isa().unwrap() {
                Isa::Scalar => run(Portable, signed, map),
                Isa::Avx2(t) => run(t, signed, map),
                Isa::Avx512(t) => run(t, signed, map),
            }
        }
    }
}

#[test]
fn a_midpoint_rounds_to_the_lower_entry() {
    let u = reference::dynamic_map(false);
    let mid = (f64::from(u[254]) + f64::from(u[255])) / 2.0;
    let (below, above) = ((mid - 1e-7) as f32, (mid + 1e-7) as f32);
    assert_eq!((Map::unsigned().code(below), Map::unsigned().code(above)), (254, 255));
    // Where the exact midpoint of two neighbours is an f32, it is a tie: the lower entry.
    let mut ties = 0;
    for map in [Map::signed(), Map::unsigned()] {
        for k in 0..255 {
            let mid = (f64::from(map.entries[k]) + f64::from(map.entries[k + 1])) / 2.0;
            if f64::from(mid as f32) == mid {
                assert_eq!(map.code(mid as f32), k as u8);
                ties += 1;
            }
        }
    }
    assert!(ties > 0, "some midpoints are exact");
}

/// A tensor's 8-bit state from moments drawn in their domains (quantised by the reference).
fn state(n: usize, seed: u64) -> State8bit {
    let mut u = uniform(seed);
    let m: Vec<f32> = (0..n).map(|_| (0.02 * u()) as f32).collect();
    let v: Vec<f32> = (0..n).map(|_| (1e-4 * (u() + 0.5) * (u() + 0.5)) as f32).collect();
    let (m_q, m_absmax) = reference::quantize(&reference::dynamic_map(true), &m);
    let (v_q, v_absmax) = reference::quantize(&reference::dynamic_map(false), &v);
    State8bit { m_q, m_absmax, v_q, v_absmax }
}

/// One tensor's weights and gradient, with zero blocks in the gradient now and then.
fn data<G: Element<C = f32>>(n: usize, seed: u64) -> (Vec<f32>, Vec<G>) {
    let mut u = uniform(seed);
    let x = (0..n).map(|_| u() as f32).collect();
    let g = (0..n).map(|i| G::store(if (i / BLOCK) % 5 == 3 { 0.0 } else { (0.1 * u()) as f32 })).collect();
    (x, g)
}

/// The fast path on copies of the cases, out-of-place outputs poisoned first.
fn fast<R: Rule, G: Element<C = f32>>(
    level: crate::Level,
    rule: &R,
    cases: &[(Vec<f32>, Vec<G>, State8bit)],
    par: &dyn Parallelism,
    in_place: bool,
    chunk: usize,
) -> Vec<(Vec<f32>, State8bit)> {
    let mut outs: Vec<(Vec<f32>, State8bit)> = cases
        .iter()
        .map(|(x, _, s)| {
            if in_place {
                (x.clone(), s.clone())
            } else {
                let st = State8bit {
                    m_q: vec![0xAB; s.m_q.len()],
                    m_absmax: vec![f32::NAN; s.m_absmax.len()],
                    v_q: vec![0xCD; s.v_q.len()],
                    v_absmax: vec![f32::NAN; s.v_absmax.len()],
                };
                (vec![f32::NAN; x.len()], st)
            }
        })
        .collect();
    let params: Vec<Param8bit<'_, G>> = cases
        .iter()
        .zip(outs.iter_mut())
        .map(|((x, g, s), (xo, so))| {
            let m = Quantized {
                codes: stream(&s.m_q, &mut so.m_q, in_place),
                absmax: stream(&s.m_absmax, &mut so.m_absmax, in_place),
            };
            let v = Quantized {
                codes: stream(&s.v_q, &mut so.v_q, in_place),
                absmax: stream(&s.v_absmax, &mut so.v_absmax, in_place),
            };
            Param8bit::new(stream(x, xo, in_place), g, m, v).unwrap()
        })
        .collect();
    step_chunked(level, rule, params, par, chunk, 0);
    outs
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Asserts `got` bitwise equals `want`.
fn same(got: &(Vec<f32>, State8bit), want: &(Vec<f32>, State8bit), what: &str) {
    assert_eq!(bits(&got.0), bits(&want.0), "{what}: X");
    assert_eq!(got.1.m_q, want.1.m_q, "{what}: M_q");
    assert_eq!(bits(&got.1.m_absmax), bits(&want.1.m_absmax), "{what}: M_absmax");
    assert_eq!(got.1.v_q, want.1.v_q, "{what}: V_q");
    assert_eq!(bits(&got.1.v_absmax), bits(&want.1.v_absmax), "{what}: V_absmax");
}

/// Every level, placement and pool, over `steps` steps of every length, against
/// `reference(t, x, g, state)`.
fn check_all<R: Rule, G: Element<C = f32>>(
    rule: impl Fn(i64) -> R,
    reference: impl Fn(i64, &[f32], &[G], &State8bit) -> (Vec<f32>, State8bit),
) {
    let cases: Vec<(Vec<f32>, Vec<G>, State8bit)> = LENGTHS
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let (x, g) = data::<G>(n, 7 + k as u64);
            (x, g, state(n, 100 + k as u64))
        })
        .collect();
    for level in available_levels() {
        for in_place in [true, false] {
            let pools: [(&dyn Parallelism, usize); 3] =
                [(&Sequential, BLOCK), (&RayonPool(Some(pool())), BLOCK), (&RayonPool(Some(pool())), 2 * BLOCK)];
            for (par, chunk) in pools {
                let mut now = cases.clone();
                for t in 0..3 {
                    let got = fast(level, &rule(t), &now, par, in_place, chunk);
                    for (case, out) in now.iter_mut().zip(got) {
                        let want = reference(t, &case.0, &case.1, &case.2);
                        let what = format!("{level:?}, n = {}, t = {t}, in place {in_place}", case.0.len());
                        same(&out, &want, &what);
                        case.0 = out.0;
                        case.2 = out.1;
                    }
                }
            }
        }
    }
}

#[test]
fn adam8bit_fast_path_is_the_reference() {
    let attrs = [
        AdamAttrs::default(),
        AdamAttrs { alpha: 0.8, beta: 0.99, epsilon: 1e-8, norm_coefficient: 0.01, norm_coefficient_post: 0.001 },
    ];
    for a in attrs {
        let rule = |t| Adam::coeffs::<f32>(&a, 0.01, t);
        check_all::<_, f32>(rule, |t, x, g, s| reference::adam8bit(&a, 0.01, t, x, g, s));
        check_all::<_, f16>(rule, |t, x, g, s| reference::adam8bit(&a, 0.01, t, x, g, s));
        check_all::<_, bf16>(rule, |t, x, g, s| reference::adam8bit(&a, 0.01, t, x, g, s));
    }
}

#[test]
fn adamw8bit_fast_path_is_the_reference() {
    let attrs = [
        AdamWAttrs::default(),
        // beta1 < 0.5 takes the lerp's other side; maximize flips the gradient.
        AdamWAttrs { beta1: 0.3, beta2: 0.95, epsilon: 1e-6, weight_decay: 0.1, maximize: true },
    ];
    for a in attrs {
        let rule = |t| AdamWCoeffs::new(&a, 0.003, t);
        check_all::<_, f32>(rule, |t, x, g, s| reference::adamw8bit(&a, 0.003, t, x, g, s));
        check_all::<_, bf16>(rule, |t, x, g, s| reference::adamw8bit(&a, 0.003, t, x, g, s));
    }
}

#[test]
fn non_finite_values_poison_their_block_only() {
    let n = 3 * BLOCK;
    let (x, mut g) = data::<f32>(n, 3);
    g[BLOCK + 5] = f32::NAN;
    g[2 * BLOCK + 9] = f32::INFINITY;
    let s = state(n, 4);
    let a = AdamAttrs::default();
    let want = reference::adam8bit(&a, 0.01, 1, &x, &g, &s);
    for level in available_levels() {
        let got = fast(
            level,
            &Adam::coeffs::<f32>(&a, 0.01, 1),
            &[(x.clone(), g.clone(), s.clone())],
            &Sequential,
            true,
            BLOCK,
        );
        same(&got[0], &want, &format!("{level:?}"));
    }
    assert!(want.1.m_absmax[0].is_finite() && want.1.m_absmax[1].is_nan());
    // An infinite gradient makes v infinite: its block's scale is infinite, m's is too.
    assert_eq!(want.1.v_absmax[2], f32::INFINITY);
}

#[test]
fn lengths_are_checked() {
    let (mut x, g) = (vec![0f32; 300], vec![0f32; 300]);
    let (mut mq, mut vq) = (vec![0u8; 300], vec![0u8; 300]);
    let (mut ma, mut va) = (vec![0f32; 1], vec![0f32; 2]);
    let err = Param8bit::new(
        InOut::in_place(&mut x),
        &g,
        Quantized { codes: InOut::in_place(&mut mq), absmax: InOut::in_place(&mut ma) },
        Quantized { codes: InOut::in_place(&mut vq), absmax: InOut::in_place(&mut va) },
    )
    .err()
    .unwrap();
    assert_eq!(err, KernelError::LengthMismatch { what: "M_absmax", got: 1, expected: 2 });
    assert_eq!(blocks(0), 0);
    assert_eq!((blocks(255), blocks(256), blocks(257)), (1, 1, 2));
}

#[test]
fn quantisation_round_trip_error_is_bounded() {
    // |dequantize(quantize(v)) - v| <= half the widest map gap times the block scale.
    for signed in [true, false] {
        let map = reference::dynamic_map(signed);
        let gap = map.windows(2).map(|w| w[1] - w[0]).fold(0.0f32, f32::max);
        let mut u = uniform(5);
        let v: Vec<f32> = (0..1000).map(|_| if signed { u() as f32 } else { (u() + 0.5) as f32 }).collect();
        let (q, a) = reference::quantize(&map, &v);
        let back = reference::dequantize(&map, &q, &a);
        for (i, (b, v)) in back.iter().zip(&v).enumerate() {
            assert!((b - v).abs() <= 0.5 * gap * a[i / BLOCK] * 1.0001, "{v} -> {b}");
        }
    }
}
