//! Backward kernels of `com.trainops`, emitted by the autodiff rules for the CPU placement
//! (issue 24): [`conv`] (`ConvWeightGrad`, `ConvInputGrad`).

pub mod conv;
