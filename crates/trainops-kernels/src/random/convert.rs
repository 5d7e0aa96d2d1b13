//! The bottom of the distributions: the contract's word-to-float conversions (TensorFlow's,
//! exact by construction), the 16-bit stores, and the portable loops that are both the
//! scalar level and the SIMD loops' tails. It imports nothing of `random`, so the SIMD
//! kernels (`x86.rs`) sit on it alone and the distributions (`uniform`, `normal`,
//! `dropout`) on both: every file of `random` looks only down.

use core::ops::Mul;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::InOut;

/// `f32(x)`: uniform in `[0, 1)` from the low 23 bits.
#[inline(always)]
pub fn f32_of(x: u32) -> f32 {
    f32::from_bits(0x3F80_0000 | (x & 0x007F_FFFF)) - 1.0
}

/// `f16(x)`: uniform in `[0, 1)` from the low 10 bits (the subtraction is exact).
#[inline(always)]
pub fn f16_of(x: u32) -> f16 {
    f16::from_bits(0x3C00 | (x & 0x03FF) as u16) - f16::ONE
}

/// `bf16(x)`: uniform in `[0, 1)` from the low 7 bits (the subtraction is exact).
#[inline(always)]
pub fn bf16_of(x: u32) -> bf16 {
    bf16::from_bits(0x3F80 | (x & 0x007F) as u16) - bf16::ONE
}

/// `f64(x0, x1)`: uniform in `[0, 1)` from the low 20 bits of `x0` and all of `x1`.
#[inline(always)]
pub fn f64_of(x0: u32, x1: u32) -> f64 {
    f64::from_bits(0x3FF0_0000_0000_0000 | u64::from(x0 & 0x000F_FFFF) << 32 | u64::from(x1)) - 1.0
}

/// Which bits of a word make a 16-bit or 32-bit uniform, as a float32 mantissa:
/// `u = bitcast<f32>(0x3F800000 | (x & mask) << shift) - 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bits {
    pub mask: u32,
    pub shift: u32,
}

/// float32: the low 23 bits.
pub(crate) const F32_BITS: Bits = Bits { mask: 0x007F_FFFF, shift: 0 };
/// float16: the low 10 bits, at the top of a float32 mantissa.
pub(crate) const F16_BITS: Bits = Bits { mask: 0x03FF, shift: 13 };
/// bfloat16: the low 7 bits, at the top of a float32 mantissa.
pub(crate) const BF16_BITS: Bits = Bits { mask: 0x007F, shift: 16 };

/// The bits of a word that make its float32 uniform.
pub const MANTISSA: u32 = 0x007F_FFFF;

/// float16 and bfloat16: float32 values in and out, round-to-nearest-even.
pub(crate) trait Half: Copy + Send + Sync {
    /// `dst[i] = round(src[i])`.
    fn store(src: &[f32], dst: &mut [Self]);
    /// `dst[i] = src[i]` widened (exact).
    fn load(src: &[Self], dst: &mut [f32]);
}

impl Half for f16 {
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

impl Half for bf16 {
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

/// The portable float32 conversion (also the SIMD loops' tails).
pub(crate) fn convert_f32_scalar(words: &[u32], out: &mut [f32], bits: Bits, range: f32, low: f32) {
    for (o, &x) in out.iter_mut().zip(words) {
        let u = f32::from_bits(0x3F80_0000 | (x & bits.mask) << bits.shift) - 1.0;
        *o = u * range + low;
    }
}

/// The portable float64 conversion (also the SIMD loops' tails).
pub(crate) fn convert_f64_scalar(words: &[u32], out: &mut [f64], range: f64, low: f64) {
    for (o, x) in out.iter_mut().zip(words.chunks_exact(2)) {
        *o = f64_of(x[0], x[1]) * range + low;
    }
}

/// The portable loop (also the SIMD loops' tails), for float32 and float64 alike.
pub(crate) fn dropout_scalar<T: Copy + Mul<Output = T> + From<u8>>(
    words: &[u32],
    mut data: InOut<'_, T>,
    from: u32,
    scale: T,
) {
    for (i, &x) in words.iter().enumerate().take(data.len()) {
        let factor = T::from(u8::from(x & MANTISSA >= from));
        let v = data.get(i) * scale * factor;
        data.set(i, v);
    }
}
