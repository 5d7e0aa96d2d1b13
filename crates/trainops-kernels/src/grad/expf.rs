//! `e^t` in float32 lanes the compiler vectorises, for the kernels whose exponent is never
//! positive (SiLU's `exp(-|x|)`, a softmax's `exp(x - max)`): Cody-Waite reduction by ln 2,
//! a degree-7 Taylor polynomial, `2^k` from the bits; no libm call (`f32::exp` is one call
//! per element and does not vectorise: 3.5 ns an element in a 49152-class cross-entropy
//! gradient). No fused multiply-add is formed (Rust does not contract), so every SIMD level
//! gives the same bits.

/// `e^t` for `-87 <= t <= 0`, within `3u` relative.
#[inline(always)]
pub(crate) fn exp_nonpositive(t: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to an integer.
    const MAGIC: f32 = 12_582_912.0;
    // Cephes' split of ln 2: LN2_HI has 9 significant bits, so k * LN2_HI is exact for
    // |k| <= 126.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let kf = t * core::f32::consts::LOG2_E + MAGIC;
    let k = kf - MAGIC;
    let r = (t - k * LN2_HI) - k * LN2_LO; // |r| <= ln2 / 2 (a little more: k's rounding)
    let p = 1.0
        + r * (1.0
            + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    // k (-126..=0) in two's complement is kf's bits less MAGIC's; 2^k's bits are
    // (k + 127) << 23.
    let kbits = kf.to_bits().wrapping_sub(MAGIC.to_bits());
    p * f32::from_bits(kbits.wrapping_add(127) << 23)
}
