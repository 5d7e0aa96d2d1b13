//! libtrainops: ONNX training operators for ONNX Runtime, as a custom-op library.
//!
//! Load it into any ONNX Runtime from 1.17 with `register_custom_ops_library` (Python),
//! `RegisterCustomOpsLibrary_V2` (C/C++) or `SessionBuilder::with_operator_library` (Rust's
//! `ort`). It exports one symbol, [`RegisterCustomOps`], which registers:
//!
//! - `ai.onnx.preview.training::Adam`, `Adagrad` and `Momentum` (v1), ONNX's own operators.
//! - `com.trainops::Philox` (v1), DirectML's Philox4x32-10 random generator, and
//!   `PhiloxUniform`, `PhiloxNormal`, `PhiloxDropout` (v1): distributions from its stream.
//! - `com.trainops::MixedPrecisionAdam`, `DynamicLossScale`, `AllFinite` (v1): mixed precision.
//! - `com.trainops.bench::MemoryCeiling` (v1): Adam's memory traffic, for benchmarks.
//!
//! All arithmetic lives in `trainops-kernels`; this crate checks nodes, plans memory and is
//! the only code that calls ONNX Runtime's C API (module `ffi`).

pub mod error;
pub mod ffi;
pub mod ops;
mod register;

pub use register::RegisterCustomOps;

/// Entry points for the fuzz targets (`fuzz/`) and their regression tests: the checks that
/// run before any buffer is touched, without an ONNX Runtime. Not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    use crate::error::Result;
    use crate::ops::philox::{output_numel, Source};

    /// Philox's check of requested output dimensions (from the `shape` attribute when
    /// `attribute`, else from the `shape` input): the element count, or the error.
    pub fn philox_output_numel(dims: &[i64], attribute: bool) -> Result<usize> {
        output_numel(dims, if attribute { Source::Attribute } else { Source::Input })
    }
}
