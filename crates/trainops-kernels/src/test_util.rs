//! Helpers shared by the kernels' unit tests.

use crate::InOut;

/// `dst` updated in place, or rewritten from `src`.
pub fn stream<'b, X: Copy>(src: &'b [X], dst: &'b mut [X], in_place: bool) -> InOut<'b, X> {
    if in_place {
        InOut::in_place(dst)
    } else {
        InOut::split(src, dst).unwrap()
    }
}

/// `v` element by element through `f`.
pub fn convert<A: Copy, B>(v: &[A], f: impl Fn(A) -> B) -> Vec<B> {
    v.iter().map(|&e| f(e)).collect()
}

/// Deterministic test data: a 64-bit LCG whose draws are uniform in [-0.5, 0.5).
pub fn uniform(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
    }
}

/// Raw bits of a stored element, for exact comparisons of every type (NaN payloads and
/// signed zeros included).
pub trait Bits: Copy {
    /// The bits, zero-extended.
    fn bits(self) -> u64;
    /// True for a NaN (any payload, either sign).
    fn is_nan_bits(self) -> bool;
    /// [`Bits::bits`], but every NaN as one value: which NaN an operation on a NaN gives is
    /// not something Rust promises (LLVM may fold the reference's arithmetic on a NaN to
    /// another payload or sign in an optimised build), only that it is a NaN.
    fn canonical_bits(self) -> u64 {
        if self.is_nan_bits() {
            u64::MAX
        } else {
            self.bits()
        }
    }
}
impl Bits for f32 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn is_nan_bits(self) -> bool {
        self.is_nan()
    }
}
impl Bits for f64 {
    fn bits(self) -> u64 {
        self.to_bits()
    }
    fn is_nan_bits(self) -> bool {
        self.is_nan()
    }
}
impl Bits for half::f16 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn is_nan_bits(self) -> bool {
        self.is_nan()
    }
}
impl Bits for half::bf16 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn is_nan_bits(self) -> bool {
        self.is_nan()
    }
}
