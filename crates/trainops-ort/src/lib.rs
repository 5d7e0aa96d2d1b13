//! libtrainops: ONNX training operators for ONNX Runtime, as a custom-op library.
//!
//! Load it into any ONNX Runtime from 1.17 with `register_custom_ops_library` (Python),
//! `RegisterCustomOpsLibrary_V2` (C/C++) or `SessionBuilder::with_operator_library` (Rust's
//! `ort`). It exports one symbol, [`RegisterCustomOps`], which registers:
//!
//! - `ai.onnx.preview.training::Adam`, `Adagrad` and `Momentum` (v1), ONNX's own operators.
//! - `com.trainops::Philox` (v1), DirectML's Philox4x32-10 random generator.
//! - `com.trainops::MixedPrecisionAdam`, `DynamicLossScale`, `AllFinite` (v1): mixed precision.
//! - `com.trainops.bench::MemoryCeiling` (v1): Adam's memory traffic, for benchmarks.
//!
//! All arithmetic lives in `trainops-kernels`; this crate checks nodes, plans memory and is
//! the only code that calls ONNX Runtime's C API (module `ffi`).

pub mod error;
pub mod ffi;
pub mod ops;
mod register;

pub use register::{op_names, RegisterCustomOps};
