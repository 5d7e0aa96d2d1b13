//! The backward ops the autodiff rules emit for the CPU placement (issue 24), and the input
//! checks they share.

pub mod norm;
pub mod softmax;

use crate::error::{Error, Result};
use crate::ffi::{Context, DType, Tensor};
use crate::ops::io;

/// Input `index`: present, a float32 tensor, aligned.
pub(crate) fn float_input(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<Tensor> {
    let t = io::required(ctx, op, index, name)?;
    if t.dtype != DType::Float {
        return Err(Error::input(op, index, name, "tensor(float)", t.dtype.name()));
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
        let want = format!("a tensor of rank > {} (attribute axis = {axis})", if axis < 0 { -axis - 1 } else { axis });
        return Err(Error::input(op, index, name, want, format!("rank {rank}")));
    }
    Ok(a as usize)
}

/// An error unless no output buffer overlaps an input buffer (a caller's binding could make
/// them share memory; the kernels read inputs while writing outputs).
pub(crate) fn disjoint(op: &'static str, outputs: &[(&str, &Tensor)], inputs: &[(&str, &Tensor)]) -> Result<()> {
    for (on, o) in outputs {
        for (iname, i) in inputs {
            let (a, b) = (o.bytes(), i.bytes());
            if a.start < b.end && b.start < a.end {
                return Err(Error::Aliasing { op, what: format!("output {on} shares memory with input {iname}") });
            }
        }
    }
    Ok(())
}

/// A kernel's refusal (lengths it cannot use) as the op's error.
pub(crate) fn kernel_error(op: &'static str, e: trainops_kernels::KernelError) -> Error {
    Error::Runtime { op, call: "kernel", message: e.to_string() }
}
