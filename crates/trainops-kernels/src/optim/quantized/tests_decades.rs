//! The arithmetic quantiser (`decades`, AVX-512) against `Map::code` and the plain
//! nearest-entry search: every float of magnitude below 2 (`#[ignore]`d, release mode:
//! `cargo test --release -p trainops-kernels -- --ignored every_float`), and in the normal
//! suite every threshold's and binade edge's neighbourhood, a stride through all floats and
//! random values. An unflagged lane must give the code of every float within `SLACK` places
//! of its value (what makes `v * (1 / d)` as good as `v / d`); the flag rate stays small.

use rayon::prelude::*;

use super::decades::{SLACK, TWO};
use super::map::Map;
use super::reference;
use super::x86::decades_lanes;
use crate::simd::{Isa, Level};
use crate::test_util::uniform;

/// `y` moved `k` places in the float order (through zero: -0 and +0 are one place).
fn step(y: f32, k: i64) -> f32 {
    let order =
        |y: f32| if y.is_sign_negative() { -i64::from(y.to_bits() & 0x7fff_ffff) } else { i64::from(y.to_bits()) };
    let o = order(y) + k;
    if o >= 0 {
        f32::from_bits(o as u32)
    } else {
        f32::from_bits((-o) as u32 | 1 << 31)
    }
}

/// Checks the quantiser on `ys` (whole groups of 16); returns how many lanes were flagged.
fn check(map: &Map, ys: &[f32], plain: bool) -> usize {
    let Some(Isa::Avx512(t)) = Level::Avx512.isa() else { return 0 };
    let dec = map.decades.as_ref().expect("the dynamic maps have decade tables");
    let mut codes = vec![0u8; ys.len()];
    let mut flags = vec![0u16; ys.len() / 16];
    // SAFETY: the token proves the CPU has AVX-512F.
    unsafe { decades_lanes(t, dec, ys, &mut codes, &mut flags) };
    let mut flagged = 0;
    for (i, (&y, &c)) in ys.iter().zip(&codes).enumerate() {
        if flags[i / 16] >> (i % 16) & 1 == 1 {
            flagged += 1;
            continue;
        }
        let (lo, hi) = (map.code(step(y, -i64::from(SLACK))), map.code(step(y, i64::from(SLACK))));
        assert!(c == lo && c == hi, "y = {y:e} ({:#x}): code {c}, {lo}..{hi} within {SLACK} places", y.to_bits());
        if plain {
            assert_eq!(c, reference::nearest(&map.entries, y), "y = {y:e}");
        }
    }
    flagged
}

/// Values `y` and its neighbours, both signs, `width` places either side, whole groups.
fn around(ys: &mut Vec<f32>, y: f32, width: i64) {
    for k in -width..width {
        ys.push(step(y.abs(), k));
        ys.push(-step(y.abs(), k));
    }
}

fn pad(mut ys: Vec<f32>) -> Vec<f32> {
    while !ys.len().is_multiple_of(16) {
        ys.push(0.5);
    }
    ys
}

#[test]
fn decades_match_the_map_near_every_threshold_and_binade_edge() {
    for map in [Map::signed(), Map::unsigned()] {
        let mut ys = Vec::new();
        for &t in &map.thresholds[..255] {
            around(&mut ys, t, 256);
        }
        for b in 96..129u32 {
            around(&mut ys, f32::from_bits(b << 23), 64);
        }
        ys.extend([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::from_bits(1)]);
        let ys = pad(ys);
        // Most of these are flagged (they are near a threshold): no bound on how many.
        check(map, &ys, false);
        // The entries themselves, which steps hit often, and their neighbours: rarely flagged.
        let mut at = Vec::new();
        for &e in &map.entries {
            around(&mut at, e, 4);
        }
        let at = pad(at);
        let flagged = check(map, &at, true);
        assert!(flagged * 50 < at.len(), "{flagged} of {} entries flagged", at.len());
    }
}

#[test]
fn decades_match_the_map_on_a_stride_and_random_values() {
    for map in [Map::signed(), Map::unsigned()] {
        let stride: Vec<f32> = (0..TWO).step_by(65_537).flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)]).collect();
        check(map, &pad(stride), true);
        let mut u = uniform(3);
        let random: Vec<f32> =
            (0..64_000)
                .map(|k| {
                    if k % 2 == 0 {
                        (2.0 * u()) as f32
                    } else {
                        (10f64.powf(-8.0 * (u() + 0.5)) * u().signum()) as f32
                    }
                })
                .collect();
        let flagged = check(map, &random, true);
        println!("{flagged} of {} random values flagged", random.len());
        assert!(flagged * 100 < random.len(), "{flagged} of {} random values flagged", random.len());
    }
}

#[test]
#[ignore = "every float below 2 of both maps: minutes in release mode"]
fn decades_match_the_map_on_every_float() {
    for map in [Map::signed(), Map::unsigned()] {
        let flagged: usize = (0..TWO >> 16)
            .into_par_iter()
            .map(|hi| {
                let ys: Vec<f32> = (0..1u32 << 16)
                    .flat_map(|lo| {
                        let y = f32::from_bits(hi << 16 | lo);
                        [y, -y]
                    })
                    .collect();
                check(map, &ys, false)
            })
            .sum();
        println!("flagged {flagged} of {} floats", 2 * u64::from(TWO));
    }
}

/// `v * (1 / d)` is within 3 places of `v / d` for `|v| <= d` and a normal `1 / d` (the
/// argument in `decades`' documentation), on random and extreme divisors and numerators.
#[test]
fn reciprocal_products_are_within_three_places_of_quotients() {
    let order =
        |y: f32| if y.is_sign_negative() { -i64::from(y.to_bits() & 0x7fff_ffff) } else { i64::from(y.to_bits()) };
    let mut u = uniform(9);
    let mut worst = 0;
    for k in 0..400_000 {
        // Divisors with random mantissas over the whole allowed range, and all-ones ones.
        let e = (u() + 0.5) * 250.0 - 125.0;
        let mut d = (2f64.powf(e)) as f32;
        if k % 7 == 0 {
            d = f32::from_bits(d.to_bits() | 0x007f_ffff);
        }
        if !(f32::MIN_POSITIVE..=2f32.powi(125)).contains(&d) {
            continue;
        }
        let v = match k % 3 {
            0 => d * (u() * 2.0) as f32,
            1 => d * (10f64.powf(-7.0 * (u() + 0.5)) * u().signum()) as f32,
            _ => f32::from_bits(d.to_bits() - (k as u32 % 64)),
        };
        let v = v.clamp(-d, d);
        let r = 1.0 / d;
        worst = worst.max((order(v * r) - order(v / d)).abs());
    }
    assert!(worst <= 3, "{worst} places");
}
