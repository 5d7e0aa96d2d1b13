//! Element types: how a stored tensor element is loaded into the type the math runs in.
//!
//! `float` and `double` compute in themselves; 16-bit storage types (float16, bfloat16)
//! compute in `f32` and are stored back round-to-nearest-even.

use core::fmt::Debug;
use core::ops::{Add, Div, Mul, Neg, Sub};

/// The arithmetic type a kernel computes in (`f32` or `f64`).
pub trait Compute:
    Copy
    + Debug
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + 'static
{
    /// Rounds an `f64` to this type (round-to-nearest-even).
    fn from_f64(v: f64) -> Self;
    /// Widens to `f64` exactly.
    fn to_f64(self) -> f64;
    /// Correctly rounded square root.
    fn sqrt(self) -> Self;
    /// `self * a + b` with one rounding (a fused multiply-add), as PyTorch's CPU kernels
    /// compute `lerp` and `addcmul` (AdamW).
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// Neither infinite nor NaN.
    fn is_finite(self) -> bool;
}

macro_rules! impl_compute {
    ($t:ty) => {
        impl Compute for $t {
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn mul_add(self, a: Self, b: Self) -> Self {
                <$t>::mul_add(self, a, b)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
        }
    };
}
impl_compute!(f32);
impl_compute!(f64);

/// A tensor element type as stored in memory.
pub trait Element: Copy + Debug + Send + Sync + 'static {
    /// The type the math runs in.
    type C: Compute;
    /// ONNX's name for the type, for error messages (`float`, `double`, ...).
    const ONNX_NAME: &'static str;
    /// Loads a stored element into the compute type (exact).
    fn load(self) -> Self::C;
    /// Stores a computed value (round-to-nearest-even where narrower).
    fn store(c: Self::C) -> Self;
    /// Loads a whole slice (`dst.len() == src.len()`); float16 uses `half`'s vectorised
    /// conversion.
    fn load_slice(src: &[Self], dst: &mut [Self::C]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.load();
        }
    }
}

impl Element for f32 {
    type C = f32;
    const ONNX_NAME: &'static str = "float";
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(c: f32) -> Self {
        c
    }
}

impl Element for f64 {
    type C = f64;
    const ONNX_NAME: &'static str = "double";
    #[inline(always)]
    fn load(self) -> f64 {
        self
    }
    #[inline(always)]
    fn store(c: f64) -> Self {
        c
    }
}

/// float16: computes in `f32`; stored round-to-nearest-even (the `half` crate).
impl Element for half::f16 {
    type C = f32;
    const ONNX_NAME: &'static str = "float16";
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(c: f32) -> Self {
        half::f16::from_f32(c)
    }
    fn load_slice(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

/// bfloat16: computes in `f32`; stored round-to-nearest-even (the `half` crate).
impl Element for half::bf16 {
    type C = f32;
    const ONNX_NAME: &'static str = "bfloat16";
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(c: f32) -> Self {
        half::bf16::from_f32(c)
    }
    // `load_slice`: the element loop (a shift, which the compiler vectorises; `half`'s
    // slice conversion for bfloat16 measured slower in MixedPrecisionAdam's check).
}
