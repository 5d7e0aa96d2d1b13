//! The fast form of a dynamic map ([`reference::dynamic_map`]): its entries for
//! dequantisation, and a bucket table for quantisation that finds the nearest entry with one
//! table load and one comparison instead of a search.
//!
//! Nearest entry, ties to the lower one, is `code(y) = #{k : y > mid_k}` over the exact
//! midpoints `mid_k = (map[k] + map[k + 1]) / 2` (in `f64`). For an `f32` `y`, `y > mid_k`
//! exactly when `y > t_k` with `t_k` the largest `f32` not above `mid_k`, so the thresholds
//! are `f32`. Normalised values lie in `[-1, 1]`; their magnitudes from `2^-29` to `1` are
//! cut into buckets of 2^16 consecutive `f32` bit patterns (the exponent and 7 mantissa bits),
//! one set per sign, and below `2^-29` into the first bucket. No bucket holds more than one
//! threshold (checked when the table is built), so `code(y) = base[b] + (y > t[base[b]])`,
//! where `base[b]` is the code of the bucket's lowest value.

use std::sync::OnceLock;

use super::decades::Decades;
use super::reference;

/// Bit pattern of `1.0f32`: magnitudes from here up are outside the buckets.
pub(crate) const ONE: u32 = 0x3f80_0000;
/// Bit pattern of `2^-29`: the first bucket starts at 0 and ends one bucket above this.
pub(crate) const LOW: u32 = (127 - 29) << 23;
/// Bits of a magnitude below the bucket index.
pub(crate) const SHIFT: u32 = 16;
/// Buckets per sign.
pub(crate) const BUCKETS: usize = ((ONE - LOW) >> SHIFT) as usize;

/// A dynamic map with its quantisation table.
#[derive(Debug)]
pub struct Map {
    /// The 256 entries, ascending.
    pub entries: [f32; 256],
    /// `t_k`, the threshold between entries `k` and `k + 1`; `t_255 = +inf`.
    pub(crate) thresholds: [f32; 256],
    /// Per bucket (positive magnitudes, then negative), the code of its lowest value; then
    /// 3 bytes of padding, so that SIMD kernels may gather 4 bytes at any bucket.
    pub(crate) base: Vec<u8>,
    /// The thresholds as the 8 levels of a branchless binary search (AVX-512 kernels):
    /// level `k` holds `t[j * 2s + s - 1]` for `j < 2^k`, with `s = 128 >> k`; a code is
    /// `pos`, grown by `s` at each level where `y > levels[k][pos / 2s]`.
    pub(crate) levels: [[f32; 128]; 8],
    /// The tables of the arithmetic quantiser (AVX-512), `None` for a map that is not a
    /// dynamic map.
    pub(crate) decades: Option<Decades>,
}

/// The largest `f32` not above the exact midpoint of `a <= b`.
fn threshold(a: f32, b: f32) -> f32 {
    let mid = (f64::from(a) + f64::from(b)) / 2.0;
    let t = mid as f32;
    if f64::from(t) <= mid {
        t
    } else {
        next_down(t)
    }
}

/// The next `f32` below a finite `t`.
fn next_down(t: f32) -> f32 {
    if t == 0.0 {
        -f32::from_bits(1)
    } else if t > 0.0 {
        f32::from_bits(t.to_bits() - 1)
    } else {
        f32::from_bits(t.to_bits() + 1)
    }
}

impl Map {
    /// The map's tables, built from its entries (ascending, distinct).
    pub fn new(entries: [f32; 256]) -> Self {
        let mut thresholds = [f32::INFINITY; 256];
        for k in 0..255 {
            thresholds[k] = threshold(entries[k], entries[k + 1]);
        }
        let by_thresholds = |y: f32| thresholds.iter().filter(|&&t| y > t).count();
        let mut base = vec![0u8; 2 * BUCKETS + 3];
        for b in 0..BUCKETS {
            let lowest = if b == 0 { 0 } else { LOW + ((b as u32) << SHIFT) };
            let highest = LOW + (((b + 1) as u32) << SHIFT) - 1;
            for (sign, lo, hi) in [(0, lowest, highest), (1, highest | 1 << 31, lowest | 1 << 31)] {
                let (lo, hi) = (f32::from_bits(lo), f32::from_bits(hi));
                let (c_lo, c_hi) = (by_thresholds(lo), by_thresholds(hi));
                assert!(c_hi - c_lo <= 1, "a dynamic map bucket holds more than one threshold");
                base[sign * BUCKETS + b] = c_lo as u8;
            }
        }
        let mut levels = [[0f32; 128]; 8];
        for (k, level) in levels.iter_mut().enumerate() {
            let s = 128 >> k;
            for (j, t) in level.iter_mut().take(1 << k).enumerate() {
                *t = thresholds[j * 2 * s + s - 1];
            }
        }
        let decades = Decades::new(&entries, &thresholds);
        Self { entries, thresholds, base, levels, decades }
    }

    /// The code of `y`: the nearest entry, the lower one on a tie; 0 for NaN.
    #[inline(always)]
    pub fn code(&self, y: f32) -> u8 {
        let bits = y.to_bits();
        let magnitude = bits & 0x7fff_ffff;
        if magnitude >= ONE {
            // Beyond [-1, 1] (or NaN, which compares false): the end entries.
            return if y > 0.0 { 255 } else { 0 };
        }
        let bucket = (magnitude.saturating_sub(LOW) >> SHIFT) as usize + (bits >> 31) as usize * BUCKETS;
        let base = self.base[bucket];
        base + u8::from(y > self.thresholds[usize::from(base)])
    }

    /// The signed map (first moments), built once.
    pub fn signed() -> &'static Map {
        static SIGNED: OnceLock<Map> = OnceLock::new();
        SIGNED.get_or_init(|| Map::new(reference::dynamic_map(true)))
    }

    /// The unsigned map (second moments), built once.
    pub fn unsigned() -> &'static Map {
        static UNSIGNED: OnceLock<Map> = OnceLock::new();
        UNSIGNED.get_or_init(|| Map::new(reference::dynamic_map(false)))
    }
}
