//! Backward ("gradient") kernels of the ops whose standard-op backward graphs are slow: the
//! autodiff rules emit them for the CPU placement (issue 24).

pub mod rnn;
