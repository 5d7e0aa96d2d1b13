//! Backward ("gradient") ops of `com.trainops`, emitted by the autodiff rules for the CPU
//! placement (issue 24).
//!
//! - `GRUGrad`: backpropagation through time of ONNX's `GRU` ([`rnn`]).

pub mod rnn;
