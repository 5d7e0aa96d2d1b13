//! Which instruction set a kernel runs with: detected once per process and cached, or
//! forced by tests so that every level the CPU has is checked against the scalar reference.
//!
//! The one dispatch idiom (after pulp): a [`Level`] is turned into an [`Isa`], whose SIMD
//! variants carry a zero-sized token ([`Avx2`], [`Avx512`]) that only this module can make,
//! and only after detection found the feature. Every SIMD kernel takes its token as first
//! argument, so holding one is the proof its `// SAFETY:` line cites; dispatch is a `match`
//! on the `Isa`, naming each kernel (`adam_f32_avx512`, `philox_avx2`, ...) where grep finds it.

use std::sync::OnceLock;

/// A kernel implementation level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// Portable code; every CPU.
    Scalar,
    /// AVX2 with FMA (256-bit vectors; every AVX2 CPU has FMA); x86_64 only.
    Avx2,
    /// AVX-512F (512-bit vectors, masked tails); x86_64 only.
    Avx512,
}

impl Level {
    /// Whether this CPU can run the level.
    pub fn is_available(self) -> bool {
        match self {
            Level::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Level::Avx2 | Level::Avx512 => false,
        }
    }

    /// The level with its proof of availability, `None` when this CPU cannot run it.
    pub fn isa(self) -> Option<Isa> {
        if !self.is_available() {
            return None;
        }
        Some(match self {
            Level::Scalar => Isa::Scalar,
            Level::Avx2 => Isa::Avx2(Avx2(())),
            Level::Avx512 => Isa::Avx512(Avx512(())),
        })
    }
}

/// Proof that the CPU has AVX2 and FMA: only [`Level::isa`] makes one, after detection.
#[derive(Debug, Clone, Copy)]
pub struct Avx2(());

/// Proof that the CPU has AVX-512F: only [`Level::isa`] makes one, after detection.
#[derive(Debug, Clone, Copy)]
pub struct Avx512(());

/// Proof that the CPU has AVX-512F, AVX512_BF16 (`vcvtneps2bf16`) and AVX512BW, DQ and VL
/// (which every CPU with AVX512_BF16 has: `vpermw`, `vfpclassps`): only
/// [`Avx512::with_bf16`] makes one, after detection. Not a level of its own: the bfloat16
/// kernels of the AVX-512 level use it where the CPU has it.
#[derive(Debug, Clone, Copy)]
pub struct Avx512Bf16(());

impl Avx512 {
    /// This token with AVX512_BF16, BW, DQ and VL added, `None` when the CPU lacks any.
    pub fn with_bf16(self) -> Option<Avx512Bf16> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            return Some(Avx512Bf16(()));
        }
        None
    }
}

/// An available level, with its token.
#[derive(Debug, Clone, Copy)]
pub enum Isa {
    /// Portable code.
    Scalar,
    /// AVX2 is available.
    Avx2(Avx2),
    /// AVX-512F is available.
    Avx512(Avx512),
}

/// Every level this CPU can run, narrowest first; always starts with [`Level::Scalar`].
pub fn available_levels() -> Vec<Level> {
    [Level::Scalar, Level::Avx2, Level::Avx512].into_iter().filter(|l| l.is_available()).collect()
}

/// The widest available level, detected on the first call and cached.
pub fn detected() -> Level {
    static DETECTED: OnceLock<Level> = OnceLock::new();
    *DETECTED.get_or_init(|| available_levels().last().copied().unwrap_or(Level::Scalar))
}
