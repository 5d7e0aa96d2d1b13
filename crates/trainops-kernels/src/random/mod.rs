//! Counter-based random numbers: [`philox`] (Philox4x32-10), whose state is six words a
//! graph carries as a tensor, so that bits never depend on threads or SIMD level; and the
//! distributions drawn from its stream ([`uniform`], [`normal`], [`dropout`], sharing
//! [`draw`]): element `i` is a pure function of the stream's words, so every level and every
//! split over threads gives the same result (bit for bit for uniform and dropout).
//!
//! Files look only down: `convert.rs` (word-to-float conversions, the portable loops) is
//! the bottom, `x86.rs` (SIMD loops) sits on it, `draw.rs` on both, the distributions on top.

mod convert;
pub mod draw;
pub mod dropout;
pub mod normal;
pub mod philox;
pub mod uniform;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
