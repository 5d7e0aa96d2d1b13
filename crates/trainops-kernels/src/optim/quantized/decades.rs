//! The dynamic maps' structure, for a quantiser with neither search nor division (the
//! AVX-512 codec): a code found by arithmetic that says when it may be wrong.
//!
//! A dynamic map's positive entries come in *levels* (`create_dynamic_map`'s exponents):
//! level `l = 1..=7` holds `n_l` entries `10^(l - 7) * (0.1 + 0.9 * (j + 1/2) / n_l)`, so the
//! thresholds inside a level (midpoints of neighbours) sit at whole numbers of
//! `u = |y| * S_l - O_l` (`S_l = n_l / (0.9 * 10^(l - 7))`, `O_l = 0.1 * n_l / 0.9`), and the
//! code of `y` in level `l` is the level's first code plus `floor(u)`, clamped to
//! `0..n_l - 1`. Level 0 is the zero entry and level 8 the entry 1. A level is found from
//! `|y|`'s binade (its float exponent, one of 32 below 2): the level of the binade's lowest
//! value, plus one when `|y|` is above the single level boundary (an exact threshold) that
//! the binade holds, if any. Negative values of the signed map mirror the positive ones
//! (codes count down from the zero entry); negative values of the unsigned map take code 0.
//!
//! The code so found is exact except where `u` is within [`DELTA`] of a whole number (the
//! linear model's rounding) or `|y|` within [`SLACK`] units in the last place of a level
//! boundary, or `|y| >= 2`: the quantiser flags those lanes and redoes them exactly. The
//! quantiser reads `y` as `v * (1 / d)`, which is within 3 units in the last place of the
//! exact `v / d` (two roundings of relative error `2^-24` each, plus the one of `v / d`),
//! when `1 / d` is a normal float: [`SLACK`] and [`DELTA`] cover that too, so an unflagged
//! code is that of every float within [`SLACK`] places of `y`, hence of `v / d`. The tests
//! check this for every float below 2 of both maps (`#[ignore]`d: minutes) and for every
//! threshold's neighbourhood.

use super::reference;

/// Units in the last place around a level boundary that are flagged.
pub(crate) const SLACK: i32 = 8;
/// Distance of `u` from a whole number below which a lane is flagged.
pub(crate) const DELTA: f32 = 1.0 / 4096.0;
/// Bit pattern of `2^-31`, the lowest binade's floor (everything below falls into it).
pub(crate) const KEY_LOW: u32 = 96 << 23;
/// Bit pattern of `2.0`: magnitudes from here up are flagged.
pub(crate) const TWO: u32 = 0x4000_0000;
/// `tk` of a binade without a level boundary: above every magnitude below 2, so that
/// `|y| - tk` is negative (not above, not near).
const NO_BOUNDARY: i32 = 0x7000_0000;

/// The tables of the arithmetic quantiser.
#[derive(Debug)]
pub(crate) struct Decades {
    /// Whether the map is signed (negative values mirror the positive ones).
    pub signed: bool,
    /// Per binade `b` (magnitudes `[2^(b - 31), 2^(b - 30))`): the bit pattern of its level
    /// boundary minus [`SLACK`], or [`NO_BOUNDARY`].
    pub tk: [i32; 32],
    /// Per binade: the level of its lowest value.
    pub level: [i32; 32],
    /// Per level: `S_l` (0 for a level of one entry).
    pub scale: [f32; 16],
    /// Per level: `O_l` (-1/2 for a level of one entry, so that `u` is never near a whole
    /// number).
    pub offset: [f32; 16],
    /// Per level `l` (positive values) and `16 + l` (negative): the code at `u < 1`; for
    /// negative values of the signed map one more than it, the code being `base + !floor(u)`.
    pub base: [i32; 32],
    /// Per level and sign as `base`: the largest `floor(u)`.
    pub top: [i32; 32],
}

impl Decades {
    /// The tables of the dynamic map with `entries` and `thresholds` (`map::Map`'s), or
    /// `None` when the entries are not those of `create_dynamic_map`.
    pub fn new(entries: &[f32; 256], thresholds: &[f32; 256]) -> Option<Self> {
        let signed = entries[0] < 0.0;
        if *entries != reference::dynamic_map(signed) {
            return None;
        }
        // Entries per level 1..=7, each level's first code, the zero entry's code.
        let n = |l: usize| if signed { 1usize << (l - 1) } else { 1 << l };
        let zero: usize = if signed { 127 } else { 0 };
        let mut first = [0usize; 9];
        first[0] = zero;
        first[1] = zero + 1;
        for l in 1..8 {
            first[l + 1] = first[l] + n(l);
        }
        debug_assert_eq!(first[8], 255);
        // The boundary below level l is the threshold between codes first[l] - 1 and first[l].
        let boundary = |l: usize| thresholds[first[l] - 1];
        let (mut scale, mut offset) = ([0f32; 16], [-0.5f32; 16]);
        let (mut base, mut top) = ([0i32; 32], [0i32; 32]);
        base[0] = zero as i32;
        base[8] = 255;
        if signed {
            base[16] = zero as i32 + 1;
            base[16 + 8] = 1;
        }
        for l in 1..8 {
            let (count, decade) = (n(l) as f64, 10f64.powi(l as i32 - 7));
            if count > 1.0 {
                scale[l] = (count / (0.9 * decade)) as f32;
                offset[l] = (0.1 * count / 0.9) as f32;
                // Every threshold inside the level is within DELTA / 4 of its whole number.
                for j in 0..n(l) - 1 {
                    let u = f64::from(thresholds[first[l] + j]) * f64::from(scale[l]) - f64::from(offset[l]);
                    if (u - (j + 1) as f64).abs() > f64::from(DELTA) / 4.0 {
                        return None;
                    }
                }
            }
            base[l] = first[l] as i32;
            top[l] = n(l) as i32 - 1;
            if signed {
                base[16 + l] = 255 - first[l] as i32;
                top[16 + l] = top[l];
            }
        }
        let (mut tk, mut level) = ([NO_BOUNDARY; 32], [0i32; 32]);
        for b in 0..32u32 {
            let (low, high) = (f32::from_bits(KEY_LOW + (b << 23)), f32::from_bits(KEY_LOW + ((b + 1) << 23)));
            let l = (1..=8).filter(|&l| low > boundary(l)).count();
            level[b as usize] = l as i32;
            let inside: Vec<usize> = (l + 1..=8).filter(|&k| boundary(k) < high).collect();
            match inside[..] {
                [] => {}
                [k] => tk[b as usize] = boundary(k).to_bits() as i32 - SLACK,
                _ => return None,
            }
        }
        Some(Self { signed, tk, level, scale, offset, base, top })
    }
}
