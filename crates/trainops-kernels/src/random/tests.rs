//! Every level and every thread count against the contract written out on Philox's scalar
//! reference: bit for bit for uniform and dropout, and for normal (which runs the same float64
//! formula at every level) within the contract's tolerance of the float64 values.

use half::{bf16, f16};

use super::draw::{bf16_of, f16_of, f32_of, f64_of, Output, CHUNK, SERIAL_BELOW, SUB};
use super::philox::{available_levels, reference as philox_ref};
use super::{dropout, normal, uniform};
use crate::parallel::{RayonPool, Sequential};
use crate::test_util::{stream, uniform as lcg};
use crate::{InOut, Parallelism};

/// Edge lengths: empty, one, around both vector widths, around a word buffer, and past the
/// threaded threshold with a partial last chunk.
const LENGTHS: [usize; 16] =
    [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1001, SUB + 3, 3 * SUB + 1, SERIAL_BELOW + CHUNK / 2 + 5];

/// States whose counters carry out of one, two and three words within a call, and one at
/// the very top (the counter wraps).
fn states() -> Vec<[u32; 6]> {
    vec![
        [0, 0, 0, 0, 0, 0],
        [0xFFFF_FFF0, 0, 0, 0, 0x9E37_79B9, 0x0123_4567],
        [0xFFFF_FFFE, 0xFFFF_FFFF, 7, 0, 1, 2],
        [0xFFFF_FFFD, 0xFFFF_FFFF, 0xFFFF_FFFF, 0xFFFF_FFFF, 3, 4],
        [0x7474_6C65, 0x6D53_6561, 0x6F46_726F, 0x4865_6C6C, 0xDEAD_BEEF, 0xFEED_F00D],
    ]
}

fn pools() -> Vec<Box<dyn Parallelism>> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    vec![Box::new(Sequential), Box::new(RayonPool(Some(Box::leak(Box::new(pool)))))]
}

fn lengths_for(state_index: usize) -> impl Iterator<Item = usize> {
    // The long length once (it is slow in debug builds), every short one for every state.
    LENGTHS.into_iter().filter(move |&n| n < SERIAL_BELOW || state_index == 1)
}

#[test]
fn conversions_match_their_definitions() {
    assert_eq!(f32_of(0), 0.0);
    assert_eq!(f32_of(u32::MAX), 1.0 - f32::EPSILON);
    assert_eq!(f32_of(0xFF80_0001), 2f32.powi(-23));
    assert_eq!(f16_of(0x0000_03FF).to_f64(), 1023.0 / 1024.0);
    assert_eq!(bf16_of(0xFFFF_FF81).to_f64(), 1.0 / 128.0);
    assert_eq!(f64_of(0xFFF0_0000, 1), 2f64.powi(-52));
    assert_eq!(f64_of(u32::MAX, u32::MAX), 1.0 - f64::EPSILON);
    for x in [0u32, 1, 0x1234_5678, u32::MAX] {
        assert_eq!(f16_of(x).to_f64(), f64::from(x & 0x3FF) / 1024.0);
        assert_eq!(bf16_of(x).to_f64(), f64::from(x & 0x7F) / 128.0);
    }
}

#[test]
fn uniform_is_the_reference_at_every_level_and_thread_count() {
    for (si, state) in states().iter().enumerate() {
        for n in lengths_for(si) {
            for (low, high) in [(0.0f32, 1.0f32), (-3.5, 2.25), (1e-3, 7e5)] {
                let mut want32 = vec![0f32; n];
                let mut want64 = vec![0f64; n];
                let mut want16 = vec![f16::ZERO; n];
                let mut wantb = vec![bf16::ZERO; n];
                let s32 = uniform::reference(state, low, high, Output::F32(&mut want32));
                let s64 = uniform::reference(state, low, high, Output::F64(&mut want64));
                let s16 = uniform::reference(state, low, high, Output::F16(&mut want16));
                let sb = uniform::reference(state, low, high, Output::BF16(&mut wantb));
                assert_eq!(s32, philox_ref::fill(state, &mut vec![0; n]));
                assert_eq!(s64, philox_ref::fill(state, &mut vec![0; 2 * n]));
                assert_eq!((s16, sb), (s32, s32));
                for level in available_levels() {
                    for par in pools() {
                        let ctx = format!("{level:?} n={n} state={state:x?} range=({low}, {high})");
                        let mut got32 = vec![f32::NAN; n];
                        let mut got64 = vec![f64::NAN; n];
                        let mut got16 = vec![f16::NAN; n];
                        let mut gotb = vec![bf16::NAN; n];
                        let run = |out| uniform::fill_with(level, state, low, high, out, &*par);
                        assert_eq!(run(Output::F32(&mut got32)), s32, "{ctx}");
                        assert_eq!(run(Output::F64(&mut got64)), s64, "{ctx}");
                        assert_eq!(run(Output::F16(&mut got16)), s16, "{ctx}");
                        assert_eq!(run(Output::BF16(&mut gotb)), sb, "{ctx}");
                        let bits32 = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        let bits64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert!(bits32(&got32) == bits32(&want32), "float {ctx}");
                        assert!(bits64(&got64) == bits64(&want64), "double {ctx}");
                        assert!(got16.iter().zip(&want16).all(|(a, b)| a.to_bits() == b.to_bits()), "float16 {ctx}");
                        assert!(gotb.iter().zip(&wantb).all(|(a, b)| a.to_bits() == b.to_bits()), "bfloat16 {ctx}");
                    }
                }
            }
        }
    }
}

#[test]
fn keep_from_is_the_float64_comparison() {
    let mut next = lcg(11);
    let mut ratios = vec![0.0, 0.5, 0.25, 1.0 - 2f64.powi(-23), 1.0 - 2f64.powi(-24), 1e-300, 0.9999999];
    for m in [1u32, 2, 3, 4_194_303, 4_194_304, 4_194_305, 8_388_607] {
        let r = f64::from(m) / f64::from(1u32 << 23);
        ratios.extend([r, r.next_down(), r.next_up()]);
    }
    ratios.extend((0..200).map(|_| next() + 0.5));
    for r in ratios {
        let from = dropout::keep_from(r);
        for m in [0u32, 1, 2, 3, 4_194_303, 4_194_304, 4_194_305, 8_388_606, 8_388_607]
            .into_iter()
            .chain([from.saturating_sub(1), from, from + 1].into_iter().filter(|&m| m < 1 << 23))
        {
            assert_eq!(m >= from, f64::from(f32_of(m)) >= r, "ratio {r}, mantissa {m}");
        }
    }
}

fn special_data(n: usize, seed: u64) -> Vec<f64> {
    let mut next = lcg(seed);
    let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 0.0, -1.5, 65504.0, 1e-40];
    (0..n).map(|i| if i % 13 == 5 { specials[(i / 13) % specials.len()] } else { 8.0 * next() }).collect()
}

/// Expected outputs are written from the contract: float32 arithmetic for float32 and 16-bit
/// data (then rounded once), float64 for double, on the float64 keep decisions.
#[test]
fn dropout_is_the_reference_at_every_level_and_thread_count() {
    for (si, state) in states().iter().enumerate() {
        for n in lengths_for(si) {
            for ratio in [0.0, 0.5, 0.3, 0.999] {
                let (keep, next) = dropout::reference_keep(state, ratio, n);
                let data = special_data(n, n as u64 + 1);
                let s32 = 1.0f32 / (1.0 - ratio as f32);
                let s64 = 1.0 / (1.0 - ratio);
                let factor = |k: bool| if k { 1.0f32 } else { 0.0 };
                let d32: Vec<f32> = data.iter().map(|&d| d as f32).collect();
                let d16: Vec<f16> = data.iter().map(|&d| f16::from_f64(d)).collect();
                let db: Vec<bf16> = data.iter().map(|&d| bf16::from_f64(d)).collect();
                let w32: Vec<u32> = d32.iter().zip(&keep).map(|(&d, &k)| (d * s32 * factor(k)).to_bits()).collect();
                let w64: Vec<u64> =
                    data.iter().zip(&keep).map(|(&d, &k)| (d * s64 * f64::from(factor(k))).to_bits()).collect();
                let w16: Vec<u16> = d16
                    .iter()
                    .zip(&keep)
                    .map(|(&d, &k)| f16::from_f32(d.to_f32() * s32 * factor(k)).to_bits())
                    .collect();
                let wb: Vec<u16> = db
                    .iter()
                    .zip(&keep)
                    .map(|(&d, &k)| bf16::from_f32(d.to_f32() * s32 * factor(k)).to_bits())
                    .collect();
                for level in available_levels() {
                    for par in pools() {
                        for in_place in [false, true] {
                            let ctx = format!("{level:?} n={n} ratio={ratio} in_place={in_place}");
                            let mut mask = vec![false; n];
                            let mut o32 = d32.clone();
                            let st = dropout::fill_with(
                                level,
                                state,
                                ratio,
                                dropout::Data::F32(stream(&d32, &mut o32, in_place)),
                                Some(&mut mask),
                                &*par,
                            )
                            .unwrap();
                            assert_eq!(st, next, "{ctx}");
                            assert!(mask == keep, "mask {ctx}");
                            assert!(o32.iter().map(|x| x.to_bits()).eq(w32.iter().copied()), "float {ctx}");
                            let mut o64 = data.clone();
                            dropout::fill_with(
                                level,
                                state,
                                ratio,
                                dropout::Data::F64(stream(&data, &mut o64, in_place)),
                                None,
                                &*par,
                            )
                            .unwrap();
                            assert!(o64.iter().map(|x| x.to_bits()).eq(w64.iter().copied()), "double {ctx}");
                            let mut o16 = d16.clone();
                            dropout::fill_with(
                                level,
                                state,
                                ratio,
                                dropout::Data::F16(stream(&d16, &mut o16, in_place)),
                                None,
                                &*par,
                            )
                            .unwrap();
                            assert!(o16.iter().map(|x| x.to_bits()).eq(w16.iter().copied()), "float16 {ctx}");
                            let mut ob = db.clone();
                            let mut mask = vec![false; n];
                            dropout::fill_with(
                                level,
                                state,
                                ratio,
                                dropout::Data::BF16(stream(&db, &mut ob, in_place)),
                                Some(&mut mask),
                                &*par,
                            )
                            .unwrap();
                            assert!(ob.iter().map(|x| x.to_bits()).eq(wb.iter().copied()), "bfloat16 {ctx}");
                            assert!(mask == keep, "mask {ctx}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn dropout_checks_the_mask_and_passes_through() {
    let data = [1.0f32, -2.0, f32::NAN];
    let mut out = [0f32; 3];
    let mut short = [false; 2];
    let err = dropout::fill(
        &[0; 6],
        0.5,
        dropout::Data::F32(InOut::split(&data, &mut out).unwrap()),
        Some(&mut short),
        &Sequential,
    );
    assert!(err.is_err());
    let mut mask = [false; 3];
    dropout::pass_through(dropout::Data::F32(InOut::split(&data, &mut out).unwrap()), Some(&mut mask)).unwrap();
    assert_eq!(mask, [true; 3]);
    assert_eq!(out[..2], [1.0, -2.0]);
    assert!(out[2].is_nan());
    // A dropped negative value is -0.0, a dropped infinity NaN (ratio just under 1 drops
    // everything but mantissas at the very top).
    let data = [-3.0f32, f32::INFINITY];
    let mut out = [0f32; 2];
    let st = [0; 6];
    let (keep, _) = dropout::reference_keep(&st, 0.999_999, 2);
    dropout::fill(&st, 0.999_999, dropout::Data::F32(InOut::split(&data, &mut out).unwrap()), None, &Sequential)
        .unwrap();
    if !keep[0] {
        assert_eq!(out[0].to_bits(), (-0.0f32).to_bits());
    }
    if !keep[1] {
        assert!(out[1].is_nan());
    }
}

/// `got` against the float64 value `z` with the contract's tolerance: `tol * max(1, |r|)`,
/// where `|z| <= r`, so `max(1, |z|)` is a lower bound for it; a looser bound is never used.
fn within(got: f64, want: f64, r: f64, tol: f64) -> bool {
    (got - want).abs() <= tol * r.max(1.0)
}

#[test]
fn normal_is_within_tolerance_at_every_level_and_thread_count() {
    for (si, state) in states().iter().enumerate() {
        for n in lengths_for(si) {
            let (z32, next32) = normal::reference_z(state, n, false);
            let (z64, next64) = normal::reference_z(state, n, true);
            // r of each element's pair, for the tolerance.
            let radius = |z: &[f64]| -> Vec<f64> {
                z.chunks(2)
                    .flat_map(|p| {
                        let r = p.iter().map(|v| v * v).sum::<f64>().sqrt();
                        vec![r; p.len()]
                    })
                    .collect()
            };
            let (r32, r64) = (radius(&z32), radius(&z64));
            for level in available_levels() {
                for par in pools() {
                    let ctx = format!("{level:?} n={n} state={state:x?}");
                    let mut o32 = vec![f32::NAN; n];
                    let mut o64 = vec![f64::NAN; n];
                    let mut o16 = vec![f16::NAN; n];
                    let mut ob = vec![bf16::NAN; n];
                    assert_eq!(
                        normal::fill_with(level, state, 0.0, 1.0, Output::F32(&mut o32), &*par),
                        next32,
                        "{ctx}"
                    );
                    assert_eq!(
                        normal::fill_with(level, state, 0.0, 1.0, Output::F64(&mut o64), &*par),
                        next64,
                        "{ctx}"
                    );
                    assert_eq!(
                        normal::fill_with(level, state, 0.0, 1.0, Output::F16(&mut o16), &*par),
                        next32,
                        "{ctx}"
                    );
                    assert_eq!(
                        normal::fill_with(level, state, 0.0, 1.0, Output::BF16(&mut ob), &*par),
                        next32,
                        "{ctx}"
                    );
                    for i in 0..n {
                        assert!(within(f64::from(o32[i]), f64::from(z32[i] as f32), r32[i], 4e-6), "float {i} {ctx}");
                        assert!(within(o64[i], z64[i], r64[i], 1e-12), "double {i} {ctx}");
                        // 16-bit: the float32 value rounded once; at most one unit in the
                        // last place of the 16-bit type away from the float64 value rounded.
                        let (a, b) = (o16[i], f16::from_f64(z32[i]));
                        assert!(
                            a == b || (a.to_f64() - b.to_f64()).abs() <= (b.to_f64().abs() * 2f64.powi(-10)).max(1e-7),
                            "float16 {i} {ctx}"
                        );
                        let (a, b) = (ob[i], bf16::from_f64(z32[i]));
                        assert!(
                            a == b || (a.to_f64() - b.to_f64()).abs() <= (b.to_f64().abs() * 2f64.powi(-7)).max(1e-7),
                            "bfloat16 {i} {ctx}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn normal_extremes_and_mean_scale() {
    // The smallest u1 (clamped to 1e-7), u1 near 1, v1 at 0 and just under 2*pi.
    for (x0, x1) in
        [(0u32, 0u32), (0, 0x7F_FFFF), (0x7F_FFFF, 0), (0x7F_FFFF, 0x7F_FFFF), (1, 1), (0x40_0000, 0x40_0000)]
    {
        let (z0, z1) = normal::box_muller_f32(x0, x1);
        let u1 = f64::from(f32_of(x0).max(1e-7));
        let v1 = f64::from((2.0 * core::f64::consts::PI * f64::from(f32_of(x1))) as f32);
        let r = (-2.0 * u1.ln()).sqrt();
        assert!(
            within(f64::from(z0), r * v1.sin(), r, 4e-6) && within(f64::from(z1), r * v1.cos(), r, 4e-6),
            "{x0:x} {x1:x}"
        );
    }
    let (z0, _) = normal::box_muller_f32(0, 0);
    assert_eq!(z0, 0.0);
    let (_, z1) = normal::box_muller_f32(0, 0);
    assert!((f64::from(z1) - (-2.0 * 1e-7f32 as f64).ln().abs().sqrt()).abs() < 1e-5 || z1 > 5.6);
    let (z0, z1) = normal::box_muller_f64(&[0, 0, 0, 0]);
    assert_eq!(z0, 0.0);
    assert!((z1 - (-2.0 * 1e-7f64.ln()).sqrt()).abs() < 1e-12);
    // mean and scale: z * scale + mean in float32.
    let st = [5, 6, 7, 8, 9, 10];
    let (mut a, mut b) = (vec![0f32; 9], vec![0f32; 9]);
    normal::fill(&st, 0.0, 1.0, Output::F32(&mut a), &Sequential);
    normal::fill(&st, 2.5, -0.5, Output::F32(&mut b), &Sequential);
    assert!(a.iter().zip(&b).all(|(a, b)| (a * -0.5 + 2.5).to_bits() == b.to_bits()));
}

#[test]
fn an_odd_tail_consumes_its_whole_pair() {
    let st = [0xFFFF_FFFF, 0, 0, 0, 1, 1];
    let mut one = [0f32; 1];
    let mut two = [0f32; 2];
    let next1 = normal::fill(&st, 0.0, 1.0, Output::F32(&mut one), &Sequential);
    let next2 = normal::fill(&st, 0.0, 1.0, Output::F32(&mut two), &Sequential);
    assert_eq!(one[0], two[0]);
    assert_eq!(next1, next2);
    assert_eq!(next1[..4], [0, 1, 0, 0]);
    let mut d = [0f64; 3];
    let next = normal::fill(&st, 0.0, 1.0, Output::F64(&mut d), &Sequential);
    assert_eq!(next[..4], [1, 1, 0, 0]); // 8 words: two blocks
}

/// A slice of `n` elements starting `offset` elements past a 64-byte boundary.
fn at_offset<T: Copy>(buf: &mut Vec<T>, fill: T, n: usize, offset: usize) -> &mut [T] {
    buf.clear();
    buf.resize(n + offset + 64, fill);
    let skip = buf.as_ptr().cast::<u8>().align_offset(64) / size_of::<T>() + offset;
    &mut buf[skip..skip + n]
}

/// Outputs at or above Philox's streaming threshold (and, forced, below it) at aligned and
/// odd offsets: the non-temporal copy, its unaligned head and tail and the cache-line-aligned
/// first piece give the reference's bits at every level and thread count.
#[test]
fn uniform_streams_the_reference_above_the_threshold_at_odd_offsets() {
    use super::philox::{Stores, STREAM_BYTES};
    let state = states()[1];
    let big = STREAM_BYTES / 4 + 37;
    let cases =
        [(big, Stores::Auto), (SERIAL_BELOW + CHUNK / 2 + 5, Stores::Streaming), (3 * SUB + 1, Stores::Streaming)];
    for (n, stores) in cases {
        let (mut want32, mut want16, mut want64) = (vec![0f32; n], vec![f16::ZERO; n], vec![0f64; n / 2]);
        uniform::reference(&state, -3.5, 2.25, Output::F32(&mut want32));
        // float16 from STREAM_BYTES / 2 elements: the threshold counts bytes.
        let n16 = if stores == Stores::Auto { STREAM_BYTES / 2 + 37 } else { n };
        want16.resize(n16, f16::ZERO);
        uniform::reference(&state, -3.5, 2.25, Output::F16(&mut want16));
        uniform::reference(&state, -3.5, 2.25, Output::F64(&mut want64));
        let (mut b32, mut b16, mut b64) = (Vec::new(), Vec::new(), Vec::new());
        for level in available_levels() {
            for par in pools() {
                for offset in [0usize, 1, 3, 4, 8] {
                    let ctx = format!("{level:?} n={n} {stores:?} offset={offset}");
                    let o = at_offset(&mut b32, f32::NAN, n, offset);
                    uniform::fill_stores(level, stores, &state, -3.5, 2.25, Output::F32(o), &*par);
                    assert!(o.iter().zip(&want32).all(|(a, b)| a.to_bits() == b.to_bits()), "float {ctx}");
                    let o = at_offset(&mut b16, f16::NAN, n16, offset);
                    uniform::fill_stores(level, stores, &state, -3.5, 2.25, Output::F16(o), &*par);
                    assert!(o.iter().zip(&want16).all(|(a, b)| a.to_bits() == b.to_bits()), "float16 {ctx}");
                    let o = at_offset(&mut b64, f64::NAN, n / 2, offset);
                    uniform::fill_stores(level, stores, &state, -3.5, 2.25, Output::F64(o), &*par);
                    assert!(o.iter().zip(&want64).all(|(a, b)| a.to_bits() == b.to_bits()), "double {ctx}");
                }
            }
        }
    }
}

/// Normal outputs above the threshold (streamed at the SIMD levels) at odd offsets are
/// bitwise the scalar level's (which never streams), at every level and thread count.
#[test]
fn normal_streams_the_scalar_levels_bits_above_the_threshold_at_odd_offsets() {
    use super::philox::{Level, STREAM_BYTES};
    let state = states()[4];
    let n = STREAM_BYTES / 4 + 37;
    let mut want = vec![0f32; n];
    normal::fill_with(Level::Scalar, &state, 0.5, 2.0, Output::F32(&mut want), &Sequential);
    let mut want16 = vec![bf16::ZERO; STREAM_BYTES / 2 + 5];
    normal::fill_with(Level::Scalar, &state, 0.5, 2.0, Output::BF16(&mut want16), &Sequential);
    let (mut b32, mut b16) = (Vec::new(), Vec::new());
    for level in available_levels() {
        for par in pools() {
            for offset in [0usize, 1, 2, 3] {
                let ctx = format!("{level:?} offset={offset}");
                let o = at_offset(&mut b32, f32::NAN, n, offset);
                normal::fill_with(level, &state, 0.5, 2.0, Output::F32(o), &*par);
                assert!(o.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "float {ctx}");
                let o = at_offset(&mut b16, bf16::NAN, want16.len(), offset);
                normal::fill_with(level, &state, 0.5, 2.0, Output::BF16(o), &*par);
                assert!(o.iter().zip(&want16).all(|(a, b)| a.to_bits() == b.to_bits()), "bfloat16 {ctx}");
            }
        }
    }
}

/// Dropout out of place above the threshold (data and mask streamed) and in place (normal
/// stores), at odd offsets of the output and mask: the reference's bits at every level and
/// thread count.
#[test]
fn dropout_streams_the_reference_above_the_threshold_at_odd_offsets() {
    use super::philox::STREAM_BYTES;
    let state = states()[3];
    let ratio = 0.3;
    let s32 = 1.0f32 / (1.0 - ratio as f32);
    let factor = |k: bool| if k { 1.0f32 } else { 0.0 };
    // float32: a 16 MiB output and a 4 MiB mask, both at the threshold or above.
    let n = STREAM_BYTES + 37;
    let (keep, next) = dropout::reference_keep(&state, ratio, n);
    let d32: Vec<f32> = special_data(n, 9).iter().map(|&d| d as f32).collect();
    let w32: Vec<u32> = d32.iter().zip(&keep).map(|(&d, &k)| (d * s32 * factor(k)).to_bits()).collect();
    // float16: a 4 MiB output, no mask.
    let n16 = STREAM_BYTES / 2 + 5;
    let d16: Vec<f16> = special_data(n16, 10).iter().map(|&d| f16::from_f64(d)).collect();
    let w16: Vec<u16> =
        d16.iter().zip(&keep).map(|(&d, &k)| f16::from_f32(d.to_f32() * s32 * factor(k)).to_bits()).collect();
    let (mut b32, mut bm, mut b16) = (Vec::new(), Vec::new(), Vec::new());
    for level in available_levels() {
        for par in pools() {
            for offset in [0usize, 1, 3] {
                for in_place in [false, true] {
                    let ctx = format!("{level:?} offset={offset} in_place={in_place}");
                    let o = at_offset(&mut b32, 0f32, n, offset);
                    o.copy_from_slice(&d32);
                    let m = at_offset(&mut bm, false, n, 2 * offset + 1);
                    let st = dropout::fill_with(
                        level,
                        &state,
                        ratio,
                        dropout::Data::F32(stream(&d32, o, in_place)),
                        Some(m),
                        &*par,
                    )
                    .unwrap();
                    assert_eq!(st, next, "{ctx}");
                    assert!(m.iter().eq(keep.iter()), "mask {ctx}");
                    assert!(o.iter().map(|x| x.to_bits()).eq(w32.iter().copied()), "float {ctx}");
                    let o = at_offset(&mut b16, f16::ZERO, n16, offset);
                    o.copy_from_slice(&d16);
                    dropout::fill_with(
                        level,
                        &state,
                        ratio,
                        dropout::Data::F16(stream(&d16, o, in_place)),
                        None,
                        &*par,
                    )
                    .unwrap();
                    assert!(o.iter().map(|x| x.to_bits()).eq(w16.iter().copied()), "float16 {ctx}");
                }
            }
        }
    }
}
