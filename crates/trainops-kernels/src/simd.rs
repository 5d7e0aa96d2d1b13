//! Which instruction set a kernel runs with: detected once per process and cached, or
//! forced by tests so that every level the CPU has is checked against the scalar reference.

use std::sync::OnceLock;

/// A kernel implementation level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// Portable code; every CPU.
    Scalar,
    /// AVX2 (256-bit vectors); x86_64 only.
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
            Level::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Level::Avx2 | Level::Avx512 => false,
        }
    }
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
