//! Input checks shared by the optimizer ops.

use crate::error::{Error, Result};
use crate::ffi::{Context, DType, Tensor};

/// Input `index`, which must be present.
pub fn required(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<Tensor> {
    ctx.input(index)?.ok_or_else(|| Error::input(op, index, name, "a tensor", "no input"))
}

fn shape_text(shape: &[i64]) -> String {
    format!("shape {shape:?}")
}

/// The single element of a float or double input (any rank), as `f64`.
pub fn scalar_float(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<f64> {
    let t = required(ctx, op, index, name)?;
    let expected = "a tensor(float) or tensor(double) with exactly one element";
    if t.numel != 1 {
        return Err(Error::input(
            op,
            index,
            name,
            expected,
            format!("{} with {}", t.dtype.name(), shape_text(&t.shape)),
        ));
    }
    match t.dtype {
        // SAFETY: one element of the checked type; inputs are never written by us, and no
        // output slice exists yet.
        DType::Float if t.aligned() => Ok(f64::from(unsafe { t.slice::<f32>() }[0])),
        // SAFETY: as above.
        DType::Double if t.aligned() => Ok(unsafe { t.slice::<f64>() }[0]),
        DType::Float | DType::Double => Err(Error::input(op, index, name, "an aligned buffer", "a misaligned one")),
        other => Err(Error::input(op, index, name, expected, other.name())),
    }
}

/// The single element of a float32 input (any rank).
pub fn scalar_f32(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<f32> {
    let t = required(ctx, op, index, name)?;
    if t.dtype != DType::Float || t.numel != 1 {
        let got = format!("{} with {}", t.dtype.name(), shape_text(&t.shape));
        return Err(Error::input(op, index, name, "a tensor(float) with exactly one element", got));
    }
    if !t.aligned() {
        return Err(Error::input(op, index, name, "an aligned buffer", "a misaligned one"));
    }
    // SAFETY: one float element, aligned; inputs are never written and no output view exists.
    Ok(unsafe { t.slice::<f32>() }[0])
}

/// The single element of an int64 input (any rank).
pub fn scalar_i64(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<i64> {
    let t = required(ctx, op, index, name)?;
    let expected = "a tensor(int64) with exactly one element";
    if t.dtype != DType::Int64 {
        return Err(Error::input(op, index, name, expected, t.dtype.name()));
    }
    if t.numel != 1 {
        return Err(Error::input(op, index, name, expected, shape_text(&t.shape)));
    }
    if !t.aligned() {
        return Err(Error::input(op, index, name, "an aligned buffer", "a misaligned one"));
    }
    // SAFETY: one int64 element, aligned; never written while read.
    Ok(unsafe { t.slice::<i64>() }[0])
}

/// What is known of an input at load time or at run time: its type and shape, where a
/// negative dimension is unknown.
#[derive(Debug, Clone)]
pub struct Sig {
    /// Element type.
    pub dtype: DType,
    /// Dimensions; `-1` (or any negative) for unknown.
    pub shape: Vec<i64>,
}

impl Sig {
    /// Of a run-time tensor.
    pub fn of(t: &Tensor) -> Self {
        Self { dtype: t.dtype, shape: t.shape.clone() }
    }
}

/// True when `from` broadcasts one way to `to` (numpy rules, right-aligned). Unknown
/// dimensions are assumed to fit.
pub fn broadcastable(from: &[i64], to: &[i64]) -> bool {
    from.len() <= to.len() && from.iter().rev().zip(to.iter().rev()).all(|(&f, &t)| f == t || f == 1 || f < 0 || t < 0)
}

/// True when two shapes may be equal (unknown dimensions match anything).
pub fn same_shape(a: &[i64], b: &[i64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| x == y || x < 0 || y < 0)
}
