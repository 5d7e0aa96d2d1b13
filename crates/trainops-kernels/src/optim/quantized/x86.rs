//! The 8-bit optimizers' x86 levels: the portable block kernel compiled with AVX2 or
//! AVX-512F enabled, so that the compiler vectorises its element loops. The operations and
//! their order are the portable code's (no fused multiply-add is ever formed without
//! fast-math), so every level gives the reference's bits.

use super::adamw::Rule;
use super::{blocks_8bit, Param8bit};
use crate::simd::{Avx2, Avx512};
use crate::Element;

/// [`blocks_8bit`] with AVX2.
#[target_feature(enable = "avx2")]
pub(super) fn blocks_8bit_avx2<R: Rule, G: Element<C = f32>>(_: Avx2, rule: &R, p: Param8bit<'_, G>) {
    blocks_8bit(rule, p);
}

/// [`blocks_8bit`] with AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) fn blocks_8bit_avx512<R: Rule, G: Element<C = f32>>(_: Avx512, rule: &R, p: Param8bit<'_, G>) {
    blocks_8bit(rule, p);
}
