//! The backward ("gradient") ops of issue 24: `com.trainops` kernels that the autodiff rules
//! emit for the CPU placement instead of their standard-op forms.

pub mod batchnorm;
