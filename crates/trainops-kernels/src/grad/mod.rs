//! Backward ("gradient") kernels of the training graph's hot ops (issue 24), emitted by the
//! autodiff rules as `com.trainops` ops for the CPU placement.
//!
//! - [`conv`]: the convolution's weight and input gradients (im2col + GEMM, col2im).

pub mod conv;
mod gemm;
pub mod im2col;
