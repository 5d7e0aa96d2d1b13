//! Backward ("gradient") ops of `com.trainops` that the autodiff rules emit on the CPU in
//! place of chains of standard ops (issue 24). All float32; the arithmetic is
//! `trainops_kernels::grad`.
//!
//! - [`activation`]: `ReluGrad(dY, X)`, `LeakyReluGrad(dY, X; alpha)`,
//!   `GeluGrad(dY, X; approximate)` -> `dX`.
//! - [`pool`]: `MaxPoolGrad(dY, Indices, shape) -> dX`, `MaxPoolGradFromInput(dY, X) -> dX`.

pub mod activation;
pub mod pool;

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

/// An error when output `out` shares memory with any of `inputs` (a caller's binding).
pub(crate) fn no_overlap(op: &'static str, out: &Tensor, inputs: &[(&str, &Tensor)]) -> Result<()> {
    let o = out.bytes();
    for (name, t) in inputs {
        let b = t.bytes();
        if !o.is_empty() && !b.is_empty() && o.start < b.end && b.start < o.end {
            return Err(Error::Aliasing {
                op,
                what: format!("output dX and input {name} are bound to overlapping memory"),
            });
        }
    }
    Ok(())
}
