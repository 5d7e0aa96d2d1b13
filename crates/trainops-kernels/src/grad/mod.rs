//! Backward ("gradient") kernels of standard ONNX ops, which the autodiff rules emit as
//! `com.trainops` ops on the CPU in place of chains of standard ops (fewer nodes, less
//! memory); each on plain slices with a scalar reference.
//!
//! - [`activation`]: Relu, LeakyRelu and Gelu (both forms).
//! - [`pool`]: MaxPool (a scatter-add at the forward's Indices, or the argmax found again).
//! - [`norm`]: LayerNormalization; [`softmax`]: Softmax, LogSoftmax, SoftmaxCrossEntropyLoss.
//! - [`bias`]: a bias's gradient, the sum over the leading axes (float64 partial sums).
//! - [`batchnorm`]: BatchNormalization in training mode (batch statistics).
//! - [`rnn`]: GRU (backpropagation through time, gates from the forward `GRUTrain` or
//!   recomputed from Y; `rnn::forward`: the forward keeping them).
//! - [`conv`]: the convolution's weight and input gradients (im2col + GEMM, col2im).
//! - [`gather`]: Gather's gradient on axis 0 (a token embedding's), rows added in place.
//! - [`depthwise`]: depthwise convolution (group = channels) forward and gradients, direct
//!   loops over the width.

pub mod activation;
pub mod batchnorm;
pub mod bias;
pub mod conv;
pub mod depthwise;
mod expf;
pub mod gather;
mod gelu;
mod gemm;
pub mod im2col;
pub mod norm;
pub mod pool;
pub mod rnn;
mod silu;
pub mod softmax;
