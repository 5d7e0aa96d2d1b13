//! Backward ("gradient") kernels of the autodiff rules' fused ops (issue 24), each on plain
//! slices with a scalar reference.

pub mod norm;
pub mod softmax;
