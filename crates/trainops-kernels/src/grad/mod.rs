//! Backward ("gradient") kernels of standard ONNX ops, which the autodiff rules emit as
//! `com.trainops` ops on the CPU in place of chains of standard ops.
//!
//! - [`activation`]: Relu, LeakyRelu and Gelu (both forms).
//! - [`pool`]: MaxPool (a scatter-add at the forward's Indices).

pub mod activation;
mod gelu;
pub mod pool;
