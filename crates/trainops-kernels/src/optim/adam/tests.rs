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

/// Both bfloat16 kernels of the AVX-512 level, each called directly (dispatch picks one per
/// CPU, so the harness reaches only one of them here): the integer narrowing kernel, and,
/// where the CPU has AVX512_BF16, the kernel with `vpermw` widening and `vcvtneps2bf16`
/// narrowing (with its integer path for vectors holding a subnormal). Bitwise the scalar
/// reference on edge lengths and every kind of bfloat16 input: random bit patterns (NaN,
/// infinities, subnormals, zeros of both signs among them), each special value alone in a
/// vector of ordinary ones, and updates that land on subnormal results.
#[cfg(target_arch = "x86_64")]
#[test]
fn both_bfloat16_avx512_kernels_are_bitwise_the_reference() {
    use crate::optim::x86::Ptrs;
    use crate::simd::{Isa, Level};
    use crate::test_util::{uniform, Bits};
    use crate::InOut;
    let Some(Isa::Avx512(tok)) = Level::Avx512.isa() else { return };
    let specials = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::MIN_POSITIVE,
        1e-40,
        -1e-40,
        9.2e-41,
        f32::MAX,
        f32::MIN,
    ]
    .map(bf16::from_f32);
    let mut rnd = uniform(36);
    let mut word = move || bf16::from_bits(((rnd() + 0.5) * 65536.0) as u16);
    let ordinary = |i: usize| bf16::from_f32(0.25 + (i % 7) as f32 * 0.125);
    // (lengths, how the streams are filled): random bit patterns; one special per vector.
    let mut cases: Vec<Case3> = Vec::new();
    type Case3 = ([Vec<bf16>; 3], Vec<bf16>);
    let mut lens = EDGE_LENGTHS.to_vec();
    lens.extend([48, 4099]);
    for &n in &lens {
        cases.push((core::array::from_fn(|_| (0..n).map(|_| word()).collect()), (0..n).map(|_| word()).collect()));
        let mut c: Case3 = (core::array::from_fn(|_| (0..n).map(ordinary).collect()), (0..n).map(ordinary).collect());
        for (i, e) in c.0.iter_mut().flatten().enumerate() {
            if i % 17 == 5 {
                *e = specials[(i / 17) % specials.len()];
            }
        }
        for (i, e) in c.1.iter_mut().enumerate() {
            if i % 13 == 3 {
                *e = specials[(i / 13) % specials.len()];
            }
        }
        cases.push(c);
        // Tiny weights and moments, so that x', v' and h' are subnormal in some lanes.
        let tiny = |i: usize| bf16::from_f32(((i % 11) as f32 - 5.0) * 2e-39);
        cases.push((
            [
                (0..n).map(tiny).collect(),
                (0..n).map(tiny).collect(),
                (0..n).map(|i| bf16::from_f32(tiny(i).to_f32().abs())).collect(),
            ],
            (0..n).map(|i| bf16::from_f32(((i % 5) as f32 - 2.0) * 1e-20)).collect(),
        ));
    }
    let attrs = [
        AdamAttrs::default(),
        AdamAttrs { norm_coefficient: 0.02, norm_coefficient_post: 0.003, ..AdamAttrs::default() },
    ];
    for a in attrs {
        for loss_scale in [None, Some(3.0f32)] {
            let mut c = Adam::coeffs::<f32>(&a, 0.01, 7);
            c.loss_scale = loss_scale;
            for (k, (s, g)) in cases.iter().enumerate() {
                let [x, v, h] = s.each_ref().map(Vec::as_slice);
                let want = reference::adam_unscaled(&a, 0.01, 7, loss_scale, x, g, v, h);
                let want: Vec<u64> = [want.0, want.1, want.2].iter().flatten().map(|e| e.canonical_bits()).collect();
                let run = |native: bool| -> Vec<u64> {
                    let mut out = s.clone();
                    let [o0, o1, o2] = &mut out;
                    let streams = [InOut::in_place(o0), InOut::in_place(o1), InOut::in_place(o2)];
                    let mut p = Adam::param(streams, g).unwrap();
                    let ptrs: Ptrs<bf16, bf16, 3> = Ptrs::of(&mut p);
                    let n = g.len();
                    match (native, tok.with_bf16()) {
                        // SAFETY: the tokens prove the instruction sets; every stream and the
                        // gradient hold `n` elements; the streams are in place.
                        (false, _) => unsafe { super::x86::adam_bf16_avx512(tok, &c, ptrs, n) },
                        // SAFETY: as above.
                        (true, Some(tb)) => unsafe { super::x86::adam_bf16_avx512bf16(tb, &c, ptrs, n) },
                        (true, None) => return want.clone(),
                    }
                    out.iter().flatten().map(|e| e.canonical_bits()).collect()
                };
                for native in [false, true] {
                    let got = run(native);
                    let first = got.iter().zip(&want).position(|(a, b)| a != b);
                    assert!(
                        got == want,
                        "case {k} (n = {}) native={native} {a:?} {loss_scale:?}: first difference at {first:?}",
                        g.len()
                    );
                }
            }
        }
    }
}
