//! Train with trainops' **training artifacts** from Rust, with no Python at run time.
//!
//! The artifacts (written by the Python package: `trainer.save_artifacts(dir)` or
//! `python -m trainops artifacts ...`) are a folder with `training.onnx` (one training
//! step: forward, loss, backward, optimizer update), `eval.onnx`, `checkpoint.safetensors`
//! (every state tensor and the metadata) and `manifest.json` (how to bind them). A
//! [`Trainer`] runs the contract's loop in ONNX Runtime (through the [`ort`] crate, ONNX
//! Runtime loaded at run time, never linked):
//!
//! 1. the trainops custom-op library is registered on the session
//!    ([`runtime::session_builder`]);
//! 2. each state of the checkpoint goes into ONE buffer bound as both the state's input and
//!    its output: each step updates the weights and the optimizer state in place;
//! 3. each [`Trainer::step`] binds the batch, the learning rate and `T`, runs, and advances
//!    `T` (unless the manifest's skip output says the step was skipped);
//! 4. [`Trainer::save`] writes a checkpoint the Python `Trainer` resumes from bit for bit.
//!
//! ```no_run
//! use trainops_trainer::{read_batches, Trainer};
//!
//! # fn main() -> trainops_trainer::Result<()> {
//! let mut trainer = Trainer::from_artifacts("artifacts")?;
//! let batches = read_batches("batches.safetensors")?;
//! for i in 0..100 {
//!     let loss = trainer.step(&batches[i % batches.len()])?;
//!     println!("{}", trainops_trainer::format_g(loss, 9));
//! }
//! trainer.save("checkpoint.safetensors")?;
//! # Ok(())
//! # }
//! ```
//!
//! Libraries: ONNX Runtime from `$ORT_DYLIB_PATH` (or [`TrainerOptions::onnxruntime`]);
//! `libtrainops.so` from `$TRAINOPS_LIBRARY` (or [`TrainerOptions::library`], or the
//! manifest's `custom_op_library` in the artifacts folder).

#![deny(missing_docs)]

mod batches;
pub mod checkpoint;
mod dtype;
mod error;
mod format;
pub mod manifest;
pub mod runtime;
pub mod schema;
mod tensor;
mod trainer;

pub use batches::read_batches;
pub use dtype::DType;
pub use error::{Error, Result};
pub use format::{format_g, python_repr};
pub use manifest::Manifest;
pub use tensor::{Element, HostTensor};
pub use trainer::{Batch, Trainer, TrainerOptions, MODEL_KEY};
