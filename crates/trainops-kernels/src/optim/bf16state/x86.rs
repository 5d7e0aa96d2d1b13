//! The bfloat16-state optimizers' x86 levels: the portable piece loop compiled with AVX2+FMA
//! or AVX-512F enabled, so that the compiler vectorises the update and the rounding with the
//! portable code's operations in its order (no fused multiply-add is formed without
//! fast-math; AdamW's explicit ones are fused in every build), and Philox runs its kernel of
//! the same level. Every level gives the reference's bits.

use super::{pieces, ParamBf16, Rule, Stochastic};
use crate::simd::{Avx2, Avx512, Level};
use crate::Element;

/// [`pieces`] with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) fn pieces_avx2<R: Rule, G: Element<C = f32>>(_: Avx2, rule: &R, bits: &Stochastic, p: ParamBf16<'_, G>) {
    pieces(Level::Avx2, rule, bits, p);
}

/// [`pieces`] with AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) fn pieces_avx512<R: Rule, G: Element<C = f32>>(_: Avx512, rule: &R, bits: &Stochastic, p: ParamBf16<'_, G>) {
    pieces(Level::Avx512, rule, bits, p);
}
