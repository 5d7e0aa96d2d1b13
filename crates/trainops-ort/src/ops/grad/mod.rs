//! Backward ("gradient") ops of `com.trainops` that the autodiff rules emit for the CPU
//! placement in place of chains of standard ops, and the input checks they share.
//! All float32; the arithmetic is `trainops_kernels::grad`.
//!
//! - [`activation`]: `ReluGrad(dY, X)`, `LeakyReluGrad(dY, X; alpha)`,
//!   `GeluGrad(dY, X; approximate)`, `HardSigmoidGrad(dY, X; alpha, beta)`,
//!   `HardSwishGrad(dY, X)`, `SiluGrad(dY, X)` -> `dX`.
//! - [`pool`]: `MaxPoolGrad(dY, Indices, shape) -> dX`, `MaxPoolGradFromInput(dY, X) -> dX`.
//! - [`norm`]: `LayerNormGrad`; [`softmax`]: `SoftmaxGrad`, `LogSoftmaxGrad`,
//!   `SoftmaxCrossEntropyLossGrad`.
//! - [`batchnorm`]: `BatchNormTrainGrad(dY, X, scale; epsilon) -> dX?, dScale?, dBias?`, and
//!   the forward it belongs to, `BatchNormTrain(X, scale, B, input_mean, input_var; epsilon,
//!   momentum) -> Y, running_mean?, running_var?` (the training-mode BatchNormalization).
//! - [`rnn`]: `GRUGrad`, backpropagation through time of ONNX's `GRU`; [`gru_train`]:
//!   `GRUTrain`, GRU's forward keeping the gates `GRUGrad` then reads; [`lstm`]: `LSTMTrain`
//!   and `LSTMGrad`, the same pair for ONNX's `LSTM`.
//! - [`bias`]: `BiasGrad(dY; leading) -> dB`, the sum over the leading axes.
//! - [`matmul`]: `BlockedMatMul(A, B; transA, transB) -> Y`, a weight's gradient and deep
//!   products on trainops' blocked matrix product.
//! - [`conv`]: `ConvWeightGrad(X, dY) -> dW`, `ConvInputGrad(dY, W, X_shape) -> dX`.
//! - [`gather`]: `GatherGrad(shape, indices, dY, base?) -> dX`, Gather's gradient on axis 0.
//! - [`depthwise`]: `DepthwiseConv(X, W, B?) -> Y`, `DepthwiseConvGrad(dY, X, W) -> dX?, dW?`.

pub mod activation;
pub mod batchnorm;
pub mod bias;
pub mod conv;
pub mod depthwise;
pub mod gather;
pub mod gru_train;
pub mod lstm;
pub mod matmul;
pub mod norm;
pub mod pool;
pub mod rnn;
pub mod softmax;

use crate::error::{Error, Result};
use crate::ffi::{Context, DType, Tensor};
use crate::ops::io;

/// Input `index`: present, float32, aligned.
pub(crate) fn float_input(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<Tensor> {
    typed_input(ctx, op, index, name, DType::Float)
}

/// Input `index`: present, of `dtype`, aligned.
pub(crate) fn typed_input(
    ctx: &Context<'_>,
    op: &'static str,
    index: usize,
    name: &str,
    dtype: DType,
) -> Result<Tensor> {
    let t = io::required(ctx, op, index, name)?;
    if t.dtype != dtype {
        return Err(Error::input(op, index, name, dtype.name(), t.dtype.name()));
    }
    if !t.aligned() {
        return Err(Error::input(op, index, name, "a buffer aligned for its type", "a misaligned one"));
    }
    Ok(t)
}

/// `axis` of a rank-`rank` tensor, negative counted from the end, checked.
pub(crate) fn axis_of(op: &'static str, axis: i64, rank: usize, index: usize, name: &str) -> Result<usize> {
    let r = i64::try_from(rank).unwrap_or(i64::MAX);
    let a = if axis < 0 { axis + r } else { axis };
    if !(0..r).contains(&a) {
        // In i128: -axis - 1 of axis = -2^63 does not fit in i64.
        let axis = i128::from(axis);
        let want = format!("a tensor of rank > {} (attribute axis = {axis})", if axis < 0 { -axis - 1 } else { axis });
        return Err(Error::input(op, index, name, want, format!("rank {rank}")));
    }
    Ok(a as usize)
}

/// An error unless no output buffer overlaps an input buffer (a caller's binding could make
/// them share memory; the kernels read inputs while writing outputs). Empty buffers overlap
/// nothing.
pub(crate) fn disjoint(op: &'static str, outputs: &[(&str, &Tensor)], inputs: &[(&str, &Tensor)]) -> Result<()> {
    for (on, o) in outputs {
        for (iname, i) in inputs {
            let (a, b) = (o.bytes(), i.bytes());
            if !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end {
                return Err(Error::Aliasing { op, what: format!("output {on} shares memory with input {iname}") });
            }
        }
    }
    Ok(())
}

/// [`disjoint`] for an op whose one output is `dX`.
pub(crate) fn no_overlap(op: &'static str, out: &Tensor, inputs: &[(&str, &Tensor)]) -> Result<()> {
    disjoint(op, &[("dX", out)], inputs)
}

/// `dims` (sizes a check has computed) as an ONNX shape, each at most `2^63 - 1`; else an
/// error naming input `index` (`name`), whose shape or the attributes implied them.
pub(crate) fn shape_i64(op: &'static str, index: usize, name: &str, dims: &[usize]) -> Result<Vec<i64>> {
    trainops_kernels::shape::to_i64(name, dims)
        .map_err(|e| Error::input(op, index, name, "sizes an ONNX shape can hold", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::axis_of;

    #[test]
    fn axes_of_any_int64_are_checked() {
        assert_eq!(axis_of("SoftmaxGrad", -1, 3, 1, "Y").unwrap(), 2);
        let msg = axis_of("SoftmaxGrad", i64::MIN, 3, 1, "Y").unwrap_err().to_string();
        assert_eq!(
            msg,
            "SoftmaxGrad: input 1 (Y): expected a tensor of rank > 9223372036854775807 (attribute axis = \
             -9223372036854775808), got rank 3"
        );
        assert!(axis_of("LayerNormGrad", i64::MAX, 3, 1, "X").is_err());
    }
}
