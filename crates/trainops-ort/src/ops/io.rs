//! The one input reader and the one output check of every op.

use crate::error::{Error, Result};
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, DType, Tensor};

/// Input `index`, which must be present.
pub fn required(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<Tensor> {
    ctx.input(index)?.ok_or_else(|| Error::input(op, index, name, "a tensor", "no input"))
}

/// `a tensor(float) or tensor(double)`.
fn type_list(types: &[DType]) -> String {
    let names: Vec<String> = types.iter().map(|d| d.name()).collect();
    names.join(" or ")
}

/// Input `index`: present, of one of `types`, with exactly `count` elements (any shape),
/// aligned. `detail` follows the element count in the message (e.g. the words' names).
pub fn exact(
    ctx: &Context<'_>,
    op: &'static str,
    index: usize,
    name: &str,
    types: &[DType],
    count: usize,
    detail: &str,
) -> Result<Tensor> {
    let t = required(ctx, op, index, name)?;
    if !types.contains(&t.dtype) || t.numel != count {
        let elements = if count == 1 { "exactly one element".to_owned() } else { format!("exactly {count} elements") };
        let want = format!("a {} with {elements}{detail}", type_list(types));
        return Err(Error::input(op, index, name, want, format!("{} with shape {:?}", t.dtype.name(), t.shape)));
    }
    if !t.aligned() {
        return Err(Error::input(op, index, name, "a buffer aligned for its type", "a misaligned one"));
    }
    Ok(t)
}

/// The single element of a one-element input of type `T` (any rank), and the tensor.
pub fn scalar<T: TensorElem>(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<(T, Tensor)> {
    assert!(T::DTYPE != DType::Bool, "bool inputs are read with `exact` and `Tensor::read_bool`");
    let t = exact(ctx, op, index, name, &[T::DTYPE], 1, "")?;
    // SAFETY: one element of the checked type, aligned; inputs are never written, and no
    // output view exists while an op reads its scalars.
    let value = unsafe { t.slice::<T>() }[0];
    Ok((value, t))
}

/// The single element of a float or double input (any rank), as `f64`.
pub fn scalar_float(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<f64> {
    let t = exact(ctx, op, index, name, &[DType::Float, DType::Double], 1, "")?;
    // SAFETY: one element of the checked type, aligned; never written while read.
    Ok(unsafe {
        if t.dtype == DType::Float {
            f64::from(t.slice::<f32>()[0])
        } else {
            t.slice::<f64>()[0]
        }
    })
}

/// Output `index` of `shape`, allocated (or bound by the caller), checked to be an aligned
/// `dtype` buffer of `shape`'s element count.
pub fn output(
    ctx: &mut Context<'_>,
    op: &'static str,
    index: usize,
    name: &str,
    dtype: DType,
    shape: &[i64],
) -> Result<Tensor> {
    let out = ctx.output(index, shape)?;
    check_output(op, index, name, out, dtype, shape)
}

/// Like [`output`] for an optional output: `None` when the node leaves it out (names it ""
/// or has fewer outputs).
pub fn optional_output(
    ctx: &mut Context<'_>,
    op: &'static str,
    index: usize,
    name: &str,
    dtype: DType,
    shape: &[i64],
) -> Result<Option<Tensor>> {
    if ctx.output_count()? <= index {
        return Ok(None);
    }
    ctx.output_opt(index, shape)?.map(|out| check_output(op, index, name, out, dtype, shape)).transpose()
}

fn check_output(
    op: &'static str,
    index: usize,
    name: &str,
    out: Tensor,
    dtype: DType,
    shape: &[i64],
) -> Result<Tensor> {
    let want = crate::ffi::context::numel(shape).unwrap_or(0);
    if out.dtype != dtype || out.numel != want || !out.aligned() {
        let got = format!("a {} buffer of {} elements", out.dtype.name(), out.numel);
        let expected = format!("an aligned {} buffer of {want} elements", dtype.name());
        return Err(Error::Output { op, index, name: name.into(), expected, got });
    }
    Ok(out)
}
