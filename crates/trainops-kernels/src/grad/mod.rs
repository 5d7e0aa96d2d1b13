//! The backward ("gradient") kernels of the training graph's hot ops (issue 24), emitted
//! by the autodiff rules as `com.trainops` ops for the CPU placement.

pub mod batchnorm;
